//! Payment providers' callbacks through the `payment_webhook` example
//! (`--provider ...`, SQLite): each callback is signed byte for byte as the
//! provider's documentation specifies, with keys, certificates and secrets
//! made at run time. RSA keys, X.509 certificates, SHA256withRSA
//! signatures and HMACs come from the `openssl` CLI, an implementation
//! other than the crate's RustCrypto verifiers.
//!
//! For each provider: a valid callback is processed once; the same
//! callback sent 5 times makes one ledger row and gets the provider's
//! success answer each time; a tampered amount gets 401 and writes nothing
//! (no ledger row, no claim); where the scheme signs a timestamp, a stale
//! one gets 401.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::free_port;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::SqlitePool;
use tempfile::TempDir;
use tokio::process::Child;

// ------------------------------------------------------------------ harness

/// One `payment_webhook --provider ...` over a fresh SQLite file.
struct Server {
    dir: TempDir,
    logged: Logged,
    _child: Child,
    base: String,
    client: reqwest::Client,
}

/// An answer: status, content type, body.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    body: String,
}

impl Answer {
    fn problem_type(&self) -> String {
        serde_json::from_str::<Value>(&self.body)
            .ok()
            .and_then(|v| v["type"].as_str().map(str::to_owned))
            .unwrap_or_else(|| panic!("not a problem document: {self:?}"))
    }
}

impl Server {
    /// Starts the example with `args` (after `--provider`'s), in `dir`.
    async fn start(dir: TempDir, args: &[String]) -> Self {
        let port = free_port();
        let logged = Logged::new("providers");
        let mut all = vec![
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--database-url".to_owned(),
            format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("webhook.db").display()
            ),
        ];
        all.extend_from_slice(args);
        let child = logged.spawn("payment_webhook", &all);
        let server = Self {
            dir,
            logged,
            _child: child,
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while server.client.get(&server.base).send().await.is_err() {
            assert!(
                Instant::now() < deadline,
                "payment_webhook did not listen within 60 s:\n{}",
                server.logged.tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server
    }

    /// The example as the endpoint of `provider`, with `secret`.
    async fn provider(provider: &str, secret: &str) -> Self {
        let args = [
            "--provider".into(),
            provider.into(),
            "--provider-secret".into(),
            secret.into(),
        ];
        Self::start(tempfile::tempdir().unwrap(), &args).await
    }

    /// POSTs a callback to `/webhooks/payments`.
    async fn post(&self, headers: &[(&str, String)], body: &[u8]) -> Answer {
        let mut req = self
            .client
            .post(format!("{}/webhooks/payments", self.base))
            .body(body.to_vec());
        for (name, value) in headers {
            req = req.header(*name, value);
        }
        let r = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST: {e}\n{}", self.logged.tail()));
        Answer {
            status: r.status(),
            content_type: r
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_owned()),
            body: r.text().await.unwrap(),
        }
    }

    /// Posts the same callback `times` times; every answer must be `ok`.
    async fn deliver(
        &self,
        times: usize,
        headers: &[(&str, String)],
        body: &[u8],
        ok: impl Fn(&Answer) -> bool,
    ) {
        for i in 0..times {
            let answer = self.post(headers, body).await;
            assert!(
                ok(&answer),
                "delivery {i}: {answer:?}\n{}",
                self.logged.tail()
            );
        }
    }

    async fn pool(&self) -> SqlitePool {
        SqlitePool::connect(&format!(
            "sqlite://{}",
            self.dir.path().join("webhook.db").display()
        ))
        .await
        .unwrap()
    }

    /// `(out_trade_no, rows, total)` of the ledger, sorted.
    async fn ledger(&self) -> Vec<(String, i64, i64)> {
        let pool = self.pool().await;
        let rows = sqlx::query_as(
            "SELECT out_trade_no, COUNT(*), SUM(amount) FROM ledger \
             GROUP BY out_trade_no ORDER BY out_trade_no",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        rows
    }

    /// Claimed keys in the dedup table.
    async fn claims(&self) -> i64 {
        let pool = self.pool().await;
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM onceonly_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        n
    }

    /// Sends a forged callback: `401` with problem `code`, and nothing
    /// written (no new claim, the ledger unchanged).
    async fn refused(&self, headers: &[(&str, String)], body: &[u8], code: &str) {
        let (claims, ledger) = (self.claims().await, self.ledger().await);
        let answer = self.post(headers, body).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{answer:?}");
        assert_eq!(
            answer.content_type.as_deref(),
            Some("application/problem+json")
        );
        assert_eq!(
            answer.problem_type(),
            format!("urn:onceonly:problem:{code}")
        );
        assert_eq!(
            self.claims().await,
            claims,
            "a refused callback left a claim"
        );
        assert_eq!(self.ledger().await, ledger, "a refused callback wrote");
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

// ------------------------------------------------------------------ openssl

/// Runs `openssl args` with `stdin`, returning stdout.
fn openssl(args: &[&str], stdin: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("these tests need the openssl CLI (apt-get install openssl): {e}")
        });
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// An RSA-2048 private key (PEM) in `dir`.
fn rsa_key(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(format!("{name}.key.pem"));
    openssl(
        &[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            path.to_str().unwrap(),
        ],
        b"",
    );
    path
}

/// The public key of `key`, as PEM text.
fn public_pem(key: &Path) -> String {
    String::from_utf8(openssl(
        &["pkey", "-in", key.to_str().unwrap(), "-pubout"],
        b"",
    ))
    .unwrap()
}

/// A self-signed certificate of `key` with serial number `serial` (hex).
fn certificate(dir: &Path, key: &Path, serial: &str) -> PathBuf {
    let path = dir.join(format!("{serial}.cert.pem"));
    openssl(
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            key.to_str().unwrap(),
            "-subj",
            "/C=CN/O=Tenpay.com/CN=Tenpay.com sign",
            "-days",
            "2",
            "-set_serial",
            &format!("0x{serial}"),
            "-out",
            path.to_str().unwrap(),
        ],
        b"",
    );
    path
}

/// SHA256withRSA of `message` with `key`, base64.
fn rsa_sign(key: &Path, message: &[u8]) -> String {
    STANDARD.encode(openssl(
        &["dgst", "-sha256", "-sign", key.to_str().unwrap(), "-binary"],
        message,
    ))
}

/// HMAC-SHA256 of `message`; `key` is `key:<text>` or `hexkey:<hex>`.
fn hmac(key: &str, message: &[u8]) -> Vec<u8> {
    openssl(
        &["dgst", "-sha256", "-mac", "HMAC", "-macopt", key, "-binary"],
        message,
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

// ------------------------------------------------------------------ Alipay

/// Percent-encodes as Java's `URLEncoder` (what Alipay's servers use).
fn url_encode(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'*' => {
                (b as char).to_string()
            }
            b' ' => "+".to_owned(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An Alipay asynchronous notification, signed as Alipay's open platform
/// documentation ("异步通知验签", verifying asynchronous notifications;
/// "自行实现验签", implementing the check yourself) describes: every
/// parameter but `sign` and `sign_type`, empty values left out, sorted by
/// name, `name=value` joined with `&` (values not URL-encoded), in the
/// notification's charset; SHA256withRSA (`sign_type=RSA2`), base64. The
/// body is the URL-encoded parameters, `sign` and `sign_type` included.
fn alipay_notification(key: &Path, fields: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut signed: Vec<&(&str, Vec<u8>)> = fields.iter().filter(|(_, v)| !v.is_empty()).collect();
    signed.sort_by(|a, b| a.0.cmp(b.0));
    let content: Vec<Vec<u8>> = signed
        .iter()
        .map(|(k, v)| [k.as_bytes(), b"=", v].concat())
        .collect();
    let sign = rsa_sign(key, &content.join(&b'&'));
    let mut body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{k}={}", url_encode(v)))
        .collect();
    body.push(format!("sign={}", url_encode(sign.as_bytes())));
    body.push("sign_type=RSA2".to_owned());
    body.join("&").into_bytes()
}

/// `unix` as Alipay writes its times: `yyyy-MM-dd HH:mm:ss`, Beijing time.
fn alipay_time(unix: u64) -> String {
    let t = i64::try_from(unix).unwrap() + 8 * 3600;
    let (days, secs) = (t.div_euclid(86_400), t.rem_euclid(86_400));
    // The civil date of a day count (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// A `trade_status_sync` notification's fields (Alipay's "异步通知参数"),
/// with the extra empty parameters Alipay sends, and `subject` in
/// `charset`.
fn alipay_fields(
    out_trade_no: &str,
    total_amount: &str,
    charset: &str,
    subject: Vec<u8>,
) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("gmt_create", b"2026-12-01 20:00:00".to_vec()),
        ("charset", charset.as_bytes().to_vec()),
        ("seller_email", b"merchant@example.com".to_vec()),
        ("subject", subject),
        ("body", Vec::new()),
        ("buyer_id", b"2088102122524333".to_vec()),
        ("invoice_amount", total_amount.as_bytes().to_vec()),
        ("notify_id", b"2026120100222200000012345678901234".to_vec()),
        ("fund_bill_list", Vec::new()),
        ("notify_type", b"trade_status_sync".to_vec()),
        ("trade_status", b"TRADE_SUCCESS".to_vec()),
        ("receipt_amount", total_amount.as_bytes().to_vec()),
        ("app_id", b"2021000000000000".to_vec()),
        ("buyer_pay_amount", total_amount.as_bytes().to_vec()),
        ("notify_time", alipay_time(now()).into_bytes()),
        ("point_amount", b"0.00".to_vec()),
        ("total_amount", total_amount.as_bytes().to_vec()),
        ("trade_no", b"2026120122001424330500000001".to_vec()),
        ("auth_app_id", b"2021000000000000".to_vec()),
        ("version", b"1.0".to_vec()),
        ("passback_params", Vec::new()),
        ("out_trade_no", out_trade_no.as_bytes().to_vec()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alipay_rsa2_notifications_utf8_and_gbk() {
    let dir = tempfile::tempdir().unwrap();
    let key = rsa_key(dir.path(), "alipay");
    // The bare base64 the Alipay console shows, no PEM armour.
    let bare: String = public_pem(&key)
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect();
    let public = write(dir.path(), "alipay_public_key.txt", &bare);
    let server = Server::start(
        dir,
        &[
            "--provider".into(),
            "alipay".into(),
            "--provider-key".into(),
            public,
        ],
    )
    .await;
    let form = |charset: &str| {
        vec![(
            "content-type",
            format!("application/x-www-form-urlencoded; charset={charset}"),
        )]
    };
    let success = |a: &Answer| {
        a.status == StatusCode::OK
            && a.body == "success"
            && a.content_type.as_deref() == Some("text/plain; charset=utf-8")
    };

    // UTF-8, URL-encoded Chinese text, extra empty parameters; 5 times.
    let utf8 = alipay_notification(
        &key,
        &alipay_fields("ALI-1", "88.88", "utf-8", "中文 商品".as_bytes().to_vec()),
    );
    server.deliver(5, &form("utf-8"), &utf8, success).await;
    // More empty parameters after the fact: not signed, still verifies
    // (and is a duplicate).
    let mut padded = utf8.clone();
    padded.extend_from_slice(b"&voucher_detail_list=&discount_goods_detail=");
    server.deliver(1, &form("utf-8"), &padded, success).await;

    // GBK: the signature covers the GBK bytes of the text.
    let (gbk_subject, _, _) = encoding_rs::GBK.encode("中文商品，测试");
    let gbk = alipay_notification(
        &key,
        &alipay_fields("ALI-2", "0.50", "GBK", gbk_subject.into_owned()),
    );
    server.deliver(5, &form("GBK"), &gbk, success).await;
    assert_eq!(
        server.ledger().await,
        vec![("ALI-1".into(), 1, 8888), ("ALI-2".into(), 1, 50)]
    );

    // A tampered amount: the signature no longer matches.
    let fresh = alipay_notification(
        &key,
        &alipay_fields("ALI-3", "1.00", "utf-8", b"x".to_vec()),
    );
    let tampered = String::from_utf8(fresh)
        .unwrap()
        .replace("total_amount=1.00", "total_amount=9999.00");
    server
        .refused(&form("utf-8"), tampered.as_bytes(), "bad-signature")
        .await;
    // Signed by another key.
    let other = rsa_key(server.dir.path(), "other");
    let forged = alipay_notification(
        &other,
        &alipay_fields("ALI-4", "1.00", "utf-8", b"x".to_vec()),
    );
    server
        .refused(&form("utf-8"), &forged, "bad-signature")
        .await;
    // Alipay signs no timestamp: there is no stale case to test; a replay
    // is a duplicate (above).
}

// -------------------------------------------------------------- WeChat Pay

const API_V3_KEY: &str = "a7cde1ZJB1kG2e7VZJuR1c9aZ2kQ3NMP";

/// A WeChat Pay v3 payment notification ("支付通知API"): the transaction
/// encrypted as "证书和回调报文解密" describes (AEAD_AES_256_GCM with the
/// APIv3 key, a 12-byte `nonce`, `associated_data`, base64 of ciphertext
/// and tag), the body signed as "签名验证" / "如何使用平台证书验签名"
/// describes: SHA256withRSA over `timestamp\nnonce\nbody\n`, base64 in
/// `Wechatpay-Signature`, the platform key's serial in `Wechatpay-Serial`.
fn wechat_notification(
    key: &Path,
    serial: &str,
    timestamp: u64,
    api_v3_key: &str,
    transaction: &Value,
) -> (Vec<(&'static str, String)>, Vec<u8>) {
    let nonce = "fdasflkja484";
    let aad = "transaction";
    let ciphertext = Aes256Gcm::new_from_slice(api_v3_key.as_bytes())
        .unwrap()
        .encrypt(
            Nonce::from_slice(nonce.as_bytes()),
            Payload {
                msg: transaction.to_string().as_bytes(),
                aad: aad.as_bytes(),
            },
        )
        .unwrap();
    let refund = transaction.get("out_refund_no").is_some();
    let body = json!({
        "id": "EV-2018022511223320873",
        "create_time": "2026-12-01T20:00:00+08:00",
        "resource_type": "encrypt-resource",
        "event_type": if refund { "REFUND.SUCCESS" } else { "TRANSACTION.SUCCESS" },
        "summary": if refund { "退款成功" } else { "支付成功" },
        "resource": {
            "original_type": if refund { "refund" } else { "transaction" },
            "algorithm": "AEAD_AES_256_GCM",
            "ciphertext": STANDARD.encode(ciphertext),
            "associated_data": aad,
            "nonce": nonce,
        },
    })
    .to_string()
    .into_bytes();
    let sig_nonce = "593BEC0C930BF1AFEB40B4A08C8FB242";
    let message = [
        timestamp.to_string().as_bytes(),
        b"\n",
        sig_nonce.as_bytes(),
        b"\n",
        &body,
        b"\n",
    ]
    .concat();
    let headers = vec![
        ("content-type", "application/json".to_owned()),
        ("wechatpay-timestamp", timestamp.to_string()),
        ("wechatpay-nonce", sig_nonce.to_owned()),
        ("wechatpay-signature", rsa_sign(key, &message)),
        ("wechatpay-serial", serial.to_owned()),
        (
            "wechatpay-signature-type",
            "WECHATPAY2-SHA256-RSA2048".to_owned(),
        ),
    ];
    (headers, body)
}

fn transaction(out_trade_no: &str, total: i64) -> Value {
    json!({
        "appid": "wxd678efh567hg6787",
        "mchid": "1230000109",
        "out_trade_no": out_trade_no,
        "transaction_id": "1217752501201407033233368018",
        "trade_type": "JSAPI",
        "trade_state": "SUCCESS",
        "trade_state_desc": "支付成功",
        "bank_type": "CMC",
        "success_time": "2026-12-01T20:00:00+08:00",
        "payer": {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
        "amount": {"total": total, "payer_total": total, "currency": "CNY", "payer_currency": "CNY"},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wechatpay_v3_rotated_certificates_and_decryption() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new, pubkey) = (
        rsa_key(dir.path(), "old"),
        rsa_key(dir.path(), "new"),
        rsa_key(dir.path(), "pub"),
    );
    let (old_serial, new_serial) = (
        "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
        "3775B6A45ACD588826D15E583A95F5DD2C5B6C5E",
    );
    let old_cert = certificate(dir.path(), &old, old_serial);
    let new_cert = certificate(dir.path(), &new, new_serial);
    let pub_id = "PUB_KEY_ID_0112345678902025120100000000000001";
    let pub_file = write(dir.path(), "wechatpay_pub_key.pem", &public_pem(&pubkey));
    let server = Server::start(
        dir,
        &[
            "--provider".into(),
            "wechatpay".into(),
            "--provider-secret".into(),
            API_V3_KEY.into(),
            "--provider-key".into(),
            old_cert.to_str().unwrap().into(),
            "--provider-key".into(),
            new_cert.to_str().unwrap().into(),
            "--provider-key".into(),
            format!("{pub_id}={pub_file}"),
        ],
    )
    .await;
    let success = |a: &Answer| a.status == StatusCode::NO_CONTENT && a.body.is_empty();

    // Signed with the old certificate's key, 5 times.
    let (h, body) = wechat_notification(
        &old,
        old_serial,
        now(),
        API_V3_KEY,
        &transaction("WX-1", 100),
    );
    server.deliver(5, &h, &body, success).await;
    // The new certificate (rotation: both configured), and a WeChat Pay
    // public key by its id.
    let (h, body) = wechat_notification(
        &new,
        new_serial,
        now(),
        API_V3_KEY,
        &transaction("WX-2", 200),
    );
    server.deliver(5, &h, &body, success).await;
    let (h, body) = wechat_notification(
        &pubkey,
        pub_id,
        now(),
        API_V3_KEY,
        &transaction("WX-3", 300),
    );
    server.deliver(1, &h, &body, success).await;
    assert_eq!(
        server.ledger().await,
        vec![
            ("WX-1".into(), 1, 100),
            ("WX-2".into(), 1, 200),
            ("WX-3".into(), 1, 300)
        ]
    );

    // A tampered amount: another resource under the genuine headers.
    let (h, _) = wechat_notification(&old, old_serial, now(), API_V3_KEY, &transaction("WX-4", 1));
    let (_, body) = wechat_notification(
        &old,
        old_serial,
        now(),
        API_V3_KEY,
        &transaction("WX-4", 100_000),
    );
    server.refused(&h, &body, "bad-signature").await;
    // Stale: signed ten minutes ago (tolerance: five).
    let (h, body) = wechat_notification(
        &old,
        old_serial,
        now() - 600,
        API_V3_KEY,
        &transaction("WX-5", 1),
    );
    server.refused(&h, &body, "stale-timestamp").await;
    // A serial no certificate was configured for.
    let (h, body) = wechat_notification(
        &old,
        "7132D72A03E93CDDF8C03BBD1F37EEDF",
        now(),
        API_V3_KEY,
        &transaction("WX-6", 1),
    );
    server.refused(&h, &body, "unknown-serial").await;
    // Signed by a key that is not the serial's.
    let (h, body) =
        wechat_notification(&new, old_serial, now(), API_V3_KEY, &transaction("WX-7", 1));
    server.refused(&h, &body, "bad-signature").await;
    // Genuinely signed, but encrypted with another APIv3 key.
    let (h, body) = wechat_notification(
        &old,
        old_serial,
        now(),
        "00000000000000000000000000000000",
        &transaction("WX-8", 1),
    );
    server.refused(&h, &body, "undecryptable-resource").await;
}

// ----------------------------------------------------------------- Stripe

const STRIPE_SECRET: &str = "whsec_test_5WbX5kEWLlfzsGNjH64I8lOOqUB6e8FH";

/// A Stripe event with `Stripe-Signature` as "Check the webhook
/// signatures" / "Verify manually" describes: `t=<unix>,v1=<hex>`, the
/// HMAC-SHA256 of `"<t>.<raw body>"` with the endpoint secret.
fn stripe_event(
    t: u64,
    event_id: &str,
    order: &str,
    amount: i64,
) -> (Vec<(&'static str, String)>, Vec<u8>) {
    stripe_event_of(t, event_id, order, amount, json!("cus_NffrFeUfNV2Hib"))
}

/// [`stripe_event`] with `customer` as given (`null` for a guest checkout,
/// a payment made without a Stripe customer).
fn stripe_event_of(
    t: u64,
    event_id: &str,
    order: &str,
    amount: i64,
    customer: Value,
) -> (Vec<(&'static str, String)>, Vec<u8>) {
    let body = json!({
        "id": event_id,
        "object": "event",
        "api_version": "2024-06-20",
        "created": t,
        "type": "payment_intent.succeeded",
        "livemode": false,
        "pending_webhooks": 1,
        "data": {"object": {
            "id": "pi_3MtwBwLkdIwHu7ix28a3tqPa",
            "object": "payment_intent",
            "amount": amount,
            "currency": "usd",
            "customer": customer,
            "metadata": {"out_trade_no": order},
            "status": "succeeded",
        }},
    })
    .to_string()
    .into_bytes();
    let signed = [t.to_string().as_bytes(), b".", &body].concat();
    let v1 = hex(&hmac(&format!("key:{STRIPE_SECRET}"), &signed));
    let headers = vec![
        ("content-type", "application/json; charset=utf-8".to_owned()),
        (
            "stripe-signature",
            format!("t={t},v1={v1},v0={}", "0".repeat(64)),
        ),
    ];
    (headers, body)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_signed_events() {
    let server = Server::provider("stripe", STRIPE_SECRET).await;
    let success = |a: &Answer| a.status == StatusCode::OK && a.body == r#"{"received":true}"#;
    let (h, body) = stripe_event(now(), "evt_1NG8Du2eZvKYlo2CUI79vXWy", "ST-1", 2000);
    server.deliver(5, &h, &body, success).await;
    assert_eq!(server.ledger().await, vec![("ST-1".into(), 1, 2000)]);

    // A guest checkout: a payment without a customer is booked (a 4xx
    // would make Stripe retry it for three days), once.
    let (h, body) = stripe_event_of(now(), "evt_guest", "ST-GUEST", 1500, Value::Null);
    server.deliver(2, &h, &body, success).await;
    assert_eq!(
        server.ledger().await,
        vec![("ST-1".into(), 1, 2000), ("ST-GUEST".into(), 1, 1500)]
    );

    let (h, body) = stripe_event(now(), "evt_2", "ST-2", 1);
    let tampered = String::from_utf8(body)
        .unwrap()
        .replace(r#""amount":1,"#, r#""amount":100000,"#);
    assert!(tampered.contains("100000"));
    server
        .refused(&h, tampered.as_bytes(), "bad-signature")
        .await;
    let (h, body) = stripe_event(now() - 600, "evt_3", "ST-3", 1);
    server.refused(&h, &body, "stale-timestamp").await;
}

/// With the fence (`FenceSpec::stripe()`: per payment intent, by the
/// event's `created`), an older event of the same payment delivered after a
/// newer one is answered as Stripe expects (so that it stops retrying) and
/// books nothing; a redelivery of it is still stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_events_out_of_order_are_stale_with_the_fence() {
    let args = [
        "--provider".to_owned(),
        "stripe".to_owned(),
        "--provider-secret".to_owned(),
        STRIPE_SECRET.to_owned(),
        "--fence".to_owned(),
    ];
    let server = Server::start(tempfile::tempdir().unwrap(), &args).await;
    let success = |a: &Answer| a.status == StatusCode::OK && a.body == r#"{"received":true}"#;
    let (h, body) = stripe_event(now(), "evt_newer", "ST-NEW", 2000);
    server.deliver(1, &h, &body, success).await;
    // Created a minute earlier, delivered after: stale, twice.
    let (h, body) = stripe_event(now() - 60, "evt_older", "ST-OLD", 1500);
    server.deliver(2, &h, &body, success).await;
    assert_eq!(server.ledger().await, vec![("ST-NEW".into(), 1, 2000)]);
    // A newer event still applies.
    let (h, body) = stripe_event(now() + 1, "evt_newest", "ST-NEWEST", 100);
    server.deliver(1, &h, &body, success).await;
    assert_eq!(
        server.ledger().await,
        vec![("ST-NEW".into(), 1, 2000), ("ST-NEWEST".into(), 1, 100)]
    );
}

// ----------------------------------------------------------------- GitHub

const GITHUB_SECRET: &str = "It's a Secret to Everybody";

/// A delivery signed as GitHub's "Validating webhook deliveries"
/// describes: `X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the raw
/// body>`; `X-GitHub-Delivery` is the delivery's GUID (kept on
/// redelivery).
fn github_delivery(guid: &str, body: &Value) -> (Vec<(&'static str, String)>, Vec<u8>) {
    let body = body.to_string().into_bytes();
    let sig = hex(&hmac(&format!("key:{GITHUB_SECRET}"), &body));
    let headers = vec![
        ("content-type", "application/json".to_owned()),
        ("x-github-event", "payment".to_owned()),
        ("x-github-delivery", guid.to_owned()),
        ("x-hub-signature-256", format!("sha256={sig}")),
    ];
    (headers, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_style_signed_deliveries() {
    let server = Server::provider("github", GITHUB_SECRET).await;
    let success = |a: &Answer| a.status == StatusCode::NO_CONTENT;
    let payment = json!({"out_trade_no": "GH-1", "account": "alice", "amount": 700});
    let (h, body) = github_delivery("72d3162e-cc78-11e3-81ab-4c9367dc0958", &payment);
    server.deliver(5, &h, &body, success).await;
    assert_eq!(server.ledger().await, vec![("GH-1".into(), 1, 700)]);

    let (h, _) = github_delivery(
        "72d3162e-cc78-11e3-81ab-000000000002",
        &json!({"out_trade_no": "GH-2", "account": "alice", "amount": 1}),
    );
    let tampered =
        json!({"out_trade_no": "GH-2", "account": "alice", "amount": 100000}).to_string();
    server
        .refused(&h, tampered.as_bytes(), "bad-signature")
        .await;
}

// ------------------------------------------------------------------ Adyen

/// An HMAC key as Adyen's Customer Area issues it: 32 bytes, hex.
const ADYEN_KEY: &str = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056";

/// A standard webhook signed as Adyen's "Verify HMAC signatures" ("Build
/// your own custom solution") describes: the item's `pspReference`,
/// `originalReference`, `merchantAccountCode`, `merchantReference`,
/// `amount.value`, `amount.currency`, `eventCode`, `success` joined with
/// `:` (absent ones empty), HMAC-SHA256 with the hex-decoded key, base64 in
/// `additionalData.hmacSignature`.
fn adyen_notification(psp: &str, merchant_reference: &str, value: i64) -> Value {
    let signing =
        format!("{psp}::TestMerchant:{merchant_reference}:{value}:EUR:AUTHORISATION:true");
    let sig = STANDARD.encode(hmac(&format!("hexkey:{ADYEN_KEY}"), signing.as_bytes()));
    json!({
        "live": "false",
        "notificationItems": [{"NotificationRequestItem": {
            "additionalData": {"hmacSignature": sig, "shopperReference": "shopper-42"},
            "amount": {"currency": "EUR", "value": value},
            "eventCode": "AUTHORISATION",
            "eventDate": "2026-12-01T20:00:00+01:00",
            "merchantAccountCode": "TestMerchant",
            "merchantReference": merchant_reference,
            "paymentMethod": "visa",
            "pspReference": psp,
            "reason": "033899:1111:03/2030",
            "success": "true",
        }}],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adyen_hmac_notifications() {
    let server = Server::provider("adyen", ADYEN_KEY).await;
    let success = |a: &Answer| a.status == StatusCode::OK && a.body == "[accepted]";
    let json_ct = vec![("content-type", "application/json".to_owned())];
    let body = adyen_notification("7914073381342284", "AD-1", 1130).to_string();
    server.deliver(5, &json_ct, body.as_bytes(), success).await;
    assert_eq!(server.ledger().await, vec![("AD-1".into(), 1, 1130)]);

    let mut tampered = adyen_notification("7914073381342285", "AD-2", 1);
    tampered["notificationItems"][0]["NotificationRequestItem"]["amount"]["value"] = 100_000.into();
    server
        .refused(&json_ct, tampered.to_string().as_bytes(), "bad-signature")
        .await;
}

// ------------------------------------------------- attacks on one capture
//
// What an attacker holding one captured, validly signed callback (signed
// here by openssl, as the provider would) can try, and what a provider's
// ordinary traffic does: each must change money once.

/// A payment booked, then the same signed body resent under fresh
/// `X-GitHub-Delivery` ids (GitHub signs the body only): duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_a_captured_body_resent_with_new_delivery_ids_is_a_duplicate() {
    let server = Server::provider("github", GITHUB_SECRET).await;
    let payment = json!({"out_trade_no": "GH-9", "account": "alice", "amount": 900});
    let (h, body) = github_delivery("72d3162e-cc78-11e3-81ab-4c9367dc0001", &payment);
    server
        .deliver(1, &h, &body, |a| a.status == StatusCode::NO_CONTENT)
        .await;
    for n in 2..=4 {
        let mut replay = h.clone();
        replay[2].1 = format!("72d3162e-cc78-11e3-81ab-4c9367dc000{n}");
        server
            .deliver(1, &replay, &body, |a| a.status == StatusCode::NO_CONTENT)
            .await;
    }
    assert_eq!(server.ledger().await, vec![("GH-9".into(), 1, 900)]);
    assert_eq!(server.claims().await, 1, "one key: a digest of the body");
}

/// The example as an Alipay endpoint with a key of its own: the server,
/// the private key to sign with, and the form content type.
async fn alipay_server() -> (Server, PathBuf, Vec<(&'static str, String)>) {
    let dir = tempfile::tempdir().unwrap();
    let key = rsa_key(dir.path(), "alipay");
    let public = write(dir.path(), "alipay.pem", &public_pem(&key));
    let args = [
        "--provider".into(),
        "alipay".into(),
        "--provider-key".into(),
        public,
    ];
    let server = Server::start(dir, &args).await;
    let form = vec![(
        "content-type",
        "application/x-www-form-urlencoded; charset=utf-8".to_owned(),
    )];
    (server, key, form)
}

/// `out_trade_no=ALI-1%26point_amount%3D0.00` without `point_amount`
/// signs the same bytes as the original: refused, not booked as a new
/// order `ALI-1&point_amount=0.00`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alipay_a_form_recut_around_the_signed_separators_is_refused() {
    let (server, key, form) = alipay_server().await;
    let body = alipay_notification(
        &key,
        &alipay_fields("ALI-1", "88.88", "utf-8", b"x".to_vec()),
    );
    server
        .deliver(1, &form, &body, |a| a.body == "success")
        .await;
    let text = String::from_utf8(body).unwrap();
    assert!(text.contains("&point_amount=0.00&"));
    let recut = text.replace("&point_amount=0.00&", "&").replace(
        "out_trade_no=ALI-1",
        "out_trade_no=ALI-1%26point_amount%3D0.00",
    );
    server
        .refused(&form, recut.as_bytes(), "malformed-signature")
        .await;
    assert_eq!(server.ledger().await, vec![("ALI-1".into(), 1, 8888)]);
}

/// With a `:` in `merchantReference`, the item's `:`-joined signed string
/// can be cut elsewhere (`pspReference` `…4284:`, the account code moved
/// into `originalReference`, ...): refused, not booked under a new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adyen_an_item_repartitioned_around_colons_is_refused() {
    let server = Server::provider("adyen", ADYEN_KEY).await;
    let json_ct = vec![("content-type", "application/json".to_owned())];
    let original = adyen_notification("7914073381342284", "AD:9", 500);
    server
        .deliver(1, &json_ct, original.to_string().as_bytes(), |a| {
            a.body == "[accepted]"
        })
        .await;
    // `7914073381342284::TestMerchant:AD:9:500:EUR:AUTHORISATION:true`, cut
    // one colon further left.
    let mut recut = original.clone();
    let item = &mut recut["notificationItems"][0]["NotificationRequestItem"];
    item["pspReference"] = "7914073381342284:".into();
    item["originalReference"] = "TestMerchant".into();
    item["merchantAccountCode"] = "AD".into();
    item["merchantReference"] = "9".into();
    server
        .refused(
            &json_ct,
            recut.to_string().as_bytes(),
            "malformed-signature",
        )
        .await;
    assert_eq!(server.ledger().await, vec![("AD:9".into(), 1, 500)]);
}

/// `--provider-secret ""` (an unset variable) builds no verifier anyone
/// could satisfy: the example refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_and_short_secrets_refuse_to_start() {
    for (provider, secret) in [
        ("stripe", ""),
        ("github", ""),
        ("github", "short"),
        ("adyen", ""),
        ("adyen", "00112233"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let logged = Logged::new("secrets");
        let args: Vec<String> = [
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--database-url",
            &format!("sqlite://{}?mode=rwc", dir.path().join("w.db").display()),
            "--provider",
            provider,
            "--provider-secret",
            secret,
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        let mut child = logged.spawn("payment_webhook", &args);
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .unwrap_or_else(|_| panic!("{provider} {secret:?}: started:\n{}", logged.tail()))
            .unwrap();
        assert!(!status.success(), "{provider} {secret:?}");
        let log = logged.tail();
        assert!(
            log.contains("HMAC key") || log.contains("too short"),
            "{provider} {secret:?}: {log}"
        );
    }
}

/// One order's notifications are several events: Alipay's TRADE_SUCCESS,
/// TRADE_FINISHED and a refund (`out_biz_no`); WeChat Pay's payment and
/// its refund (`out_refund_no`); Adyen's failed and then successful
/// authorisation. Each is handled (claimed) once; the payment is booked
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_events_of_one_order_are_each_handled_once() {
    // Alipay.
    let (server, key, form) = alipay_server().await;
    let base = alipay_fields("ALI-20", "10.00", "utf-8", b"x".to_vec());
    let with = |status: &str, extra: &[(&'static str, &str)]| {
        let mut fields: Vec<(&'static str, Vec<u8>)> = base
            .iter()
            .filter(|(k, _)| *k != "trade_status")
            .cloned()
            .collect();
        fields.push(("trade_status", status.as_bytes().to_vec()));
        for (k, v) in extra {
            fields.push((k, v.as_bytes().to_vec()));
        }
        alipay_notification(&key, &fields)
    };
    for body in [
        with("TRADE_SUCCESS", &[]),
        with("TRADE_FINISHED", &[]),
        with(
            "TRADE_SUCCESS",
            &[("out_biz_no", "RF-1"), ("refund_fee", "2.00")],
        ),
    ] {
        // Each twice: the second is a duplicate.
        server
            .deliver(2, &form, &body, |a| a.body == "success")
            .await;
    }
    assert_eq!(server.claims().await, 3, "three events, each handled once");
    assert_eq!(server.ledger().await, vec![("ALI-20".into(), 1, 1000)]);

    // WeChat Pay.
    let dir = tempfile::tempdir().unwrap();
    let platform = rsa_key(dir.path(), "platform");
    let serial = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1";
    let pem = write(dir.path(), "platform.pem", &public_pem(&platform));
    let server = Server::start(
        dir,
        &[
            "--provider".into(),
            "wechatpay".into(),
            "--provider-secret".into(),
            API_V3_KEY.into(),
            "--provider-key".into(),
            format!("{serial}={pem}"),
        ],
    )
    .await;
    let payment = transaction("WX-20", 300);
    let refund = json!({
        "mchid": "1230000109",
        "out_trade_no": "WX-20",
        "transaction_id": "1217752501201407033233368018",
        "out_refund_no": "RF-20",
        "refund_id": "50000000382019052709732678859",
        "refund_status": "SUCCESS",
        "success_time": "2026-12-02T10:00:00+08:00",
        "amount": {"total": 300, "refund": 100, "payer_total": 300, "payer_refund": 100},
    });
    for resource in [&payment, &refund] {
        let (h, body) = wechat_notification(&platform, serial, now(), API_V3_KEY, resource);
        server
            .deliver(2, &h, &body, |a| a.status == StatusCode::NO_CONTENT)
            .await;
    }
    assert_eq!(server.claims().await, 2, "the payment and its refund");
    assert_eq!(server.ledger().await, vec![("WX-20".into(), 1, 300)]);

    // Adyen: a refused authorisation, then an accepted one.
    let server = Server::provider("adyen", ADYEN_KEY).await;
    let json_ct = vec![("content-type", "application/json".to_owned())];
    let failed = adyen_event("7914073381342299", "AD-20", 700, "false");
    let succeeded = adyen_event("7914073381342299", "AD-20", 700, "true");
    for body in [failed, succeeded] {
        server
            .deliver(2, &json_ct, body.to_string().as_bytes(), |a| {
                a.body == "[accepted]"
            })
            .await;
    }
    assert_eq!(server.claims().await, 2);
    assert_eq!(server.ledger().await, vec![("AD-20".into(), 1, 700)]);
}

/// [`adyen_notification`] with `success` as given.
fn adyen_event(psp: &str, merchant_reference: &str, value: i64, success: &str) -> Value {
    let signing =
        format!("{psp}::TestMerchant:{merchant_reference}:{value}:EUR:AUTHORISATION:{success}");
    let sig = STANDARD.encode(hmac(&format!("hexkey:{ADYEN_KEY}"), signing.as_bytes()));
    let mut v = adyen_notification(psp, merchant_reference, value);
    let item = &mut v["notificationItems"][0]["NotificationRequestItem"];
    item["success"] = success.into();
    item["additionalData"]["hmacSignature"] = sig.into();
    v
}

/// Work before the signature is checked is bounded: a form of 200,000
/// empty fields is refused before anything is sorted or decoded (`413`),
/// a `Stripe-Signature` of 10,000 `v1` entries before any HMAC (`401`
/// malformed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_fields_and_signatures_are_refused_before_any_work() {
    let (server, _key, form) = alipay_server().await;
    let flood = "a=&".repeat(200_000);
    let answer = server.post(&form, flood.as_bytes()).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE, "{answer:?}");
    assert_eq!(
        answer.problem_type(),
        "urn:onceonly:problem:too-many-fields"
    );
    assert_eq!(server.claims().await, 0);

    let server = Server::provider("stripe", STRIPE_SECRET).await;
    let (mut h, body) = stripe_event(now(), "evt_flood", "ST-9", 1);
    let valid = h
        .iter()
        .find(|(k, _)| *k == "stripe-signature")
        .unwrap()
        .1
        .clone();
    let flooded = format!("{valid},{}", vec!["v1=00"; 10_000].join(","));
    for header in &mut h {
        if header.0 == "stripe-signature" {
            header.1 = flooded.clone();
        }
    }
    server.refused(&h, &body, "malformed-signature").await;
}

/// A captured Alipay notification replayed once its record was purged
/// (the clock moved past the retention): refused by its signed
/// `notify_time`, not processed again. Driven in process, with a test
/// clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alipay_a_replay_after_the_purge_is_refused_by_its_signed_time() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use onceonly::SqlStore;
    use onceonly::http::IdempotencyLayer;
    use onceonly::http::providers::Alipay;

    let dir = tempfile::tempdir().unwrap();
    let key = rsa_key(dir.path(), "alipay");
    let store =
        onceonly_integration_tests::sqlite_store(&dir.path().join("k.db"), "onceonly_keys").await;
    let clock = onceonly::ManualClock::starting_now();
    let layer = IdempotencyLayer::provider(
        onceonly::Engine::builder(store.clone()).clock(clock.clone()),
        "alipay",
        Alipay::new(&public_pem(&key)).unwrap(),
    )
    .build()
    .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = axum::Router::new().route(
        "/notify",
        axum::routing::post(move |_tx: onceonly::http::Tx<sqlx::Sqlite>| {
            let runs = Arc::clone(&counted);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                "ok"
            }
        })
        .layer(layer),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let now_secs =
        |c: &onceonly::ManualClock| u64::try_from(onceonly::Clock::now_ms(c) / 1000).unwrap();
    let mut fields = alipay_fields("ALI-30", "5.00", "utf-8", b"x".to_vec());
    for f in &mut fields {
        if f.0 == "notify_time" {
            f.1 = alipay_time(now_secs(&clock)).into_bytes();
        }
    }
    let body = alipay_notification(&key, &fields);
    let send = || {
        reqwest::Client::new()
            .post(format!("{base}/notify"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.clone())
            .send()
    };
    assert_eq!(send().await.unwrap().text().await.unwrap(), "success");
    assert_eq!(send().await.unwrap().text().await.unwrap(), "success");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Past the retention (2 days for Alipay), the record purged.
    clock.advance_ms(3 * 24 * 3600 * 1000);
    let purged = store
        .purge_expired(None, onceonly::Clock::now_ms(&clock), 1_000)
        .await
        .unwrap();
    assert_eq!(purged, 1, "the record is gone");
    let replay = send().await.unwrap();
    assert_eq!(replay.status(), StatusCode::UNAUTHORIZED);
    let problem: Value = replay.json().await.unwrap();
    assert_eq!(problem["type"], "urn:onceonly:problem:expired-callback");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "not processed again");
}

/// The generic signed callback route (`--secret`): the signature covers
/// the bytes, not the content type. The same signed form sent again as
/// ISO-8859-1 would read `é` as `Ã©`, another key: refused (`415`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_form_under_another_charset_is_not_a_second_key() {
    let dir = tempfile::tempdir().unwrap();
    let secret = "a-shared-secret-0123456789";
    let server = Server::start(dir, &["--secret".into(), secret.into()]).await;
    let body = b"out_trade_no=CAF%C3%89-1&account=alice&amount=5".to_vec();
    let t = now();
    let signed = [t.to_string().as_bytes(), b".", &body].concat();
    let sig = format!("t={t},v1={}", hex(&hmac(&format!("key:{secret}"), &signed)));
    let as_charset = |charset: &str| {
        vec![
            (
                "content-type",
                format!("application/x-www-form-urlencoded; charset={charset}"),
            ),
            ("x-signature", sig.clone()),
        ]
    };
    server
        .deliver(1, &as_charset("utf-8"), &body, |a| a.body == "success")
        .await;
    let latin1 = server.post(&as_charset("ISO-8859-1"), &body).await;
    assert_eq!(
        latin1.status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "{latin1:?}"
    );
    assert_eq!(server.ledger().await, vec![("CAFÉ-1".into(), 1, 5)]);
}

/// Issue 44, defect 6: `FenceSpec::adyen()` reads `eventDate`, which
/// Adyen does not sign and the Adyen route's payload (signed fields only)
/// never holds: every callback would be answered `400` and Adyen would
/// give up. The layer refuses it when built; a fence on signed fields
/// builds.
#[tokio::test]
async fn an_adyen_route_refuses_a_fence_on_a_field_adyen_does_not_sign() {
    use onceonly::http::providers::Adyen;
    use onceonly::http::{HttpBuildError, IdempotencyLayer};
    use onceonly::{FenceSpec, KeySpec, OrderSpec};

    let dir = tempfile::tempdir().unwrap();
    let store =
        onceonly_integration_tests::sqlite_store(&dir.path().join("k.db"), "onceonly_keys").await;
    let hmac = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056";
    let refused = IdempotencyLayer::provider(
        onceonly::Engine::builder(store.clone()).fence(FenceSpec::adyen()),
        "adyen",
        Adyen::new(hmac).unwrap(),
    )
    .build();
    match refused {
        Err(HttpBuildError::FenceFieldUnsigned { provider, pointer }) => {
            assert_eq!(provider, "adyen");
            assert!(pointer.ends_with("eventDate"), "{pointer}");
        }
        other => panic!(
            "FenceSpec::adyen() on the Adyen route: {:?}",
            other.map(|_| ())
        ),
    }
    let signed = FenceSpec::new(
        KeySpec::json_field("/notificationItems/0/NotificationRequestItem/pspReference"),
        OrderSpec::rank(
            "/notificationItems/0/NotificationRequestItem/eventCode",
            ["AUTHORISATION", "CAPTURE", "REFUND"],
        ),
    );
    IdempotencyLayer::provider(
        onceonly::Engine::builder(store).fence(signed),
        "adyen",
        Adyen::new(hmac).unwrap(),
    )
    .build()
    .expect("a fence on signed fields builds");
}

/// Issue 44, defect 15: flags the example would ignore are refused with
/// the reason, never silently dropped (`--refund-api` on SQLite served no
/// route; `--fence` without `--provider` fenced nothing).
#[tokio::test]
async fn the_example_refuses_flags_it_would_ignore() {
    let bin = onceonly_integration_tests::child::example_binary("payment_webhook");
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}?mode=rwc", dir.path().join("w.db").display());
    for (args, says) in [
        (
            vec![
                "--database-url",
                db.as_str(),
                "--refund-api",
                "http://127.0.0.1:1",
            ],
            "--refund-api needs",
        ),
        (
            vec!["--database-url", db.as_str(), "--fence"],
            "give --provider",
        ),
    ] {
        let out = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            tokio::process::Command::new(&bin)
                .args(&args)
                .args(["--listen", "127.0.0.1:0"])
                .output(),
        )
        .await
        .expect("the example exits at once")
        .expect("run the example");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} must be refused: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
