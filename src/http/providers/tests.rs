//! Each verifier against callbacks signed as the provider documents, with
//! keys made at run time, and the providers' own published vectors where
//! they publish one.

use std::sync::OnceLock;

use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use axum::http::{HeaderMap, HeaderValue};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use rsa::pkcs1v15::SigningKey;
use rsa::pkcs8::{EncodePublicKey, LineEnding};
use rsa::signature::{SignatureEncoding, Signer};
use rsa::{RsaPrivateKey, RsaPublicKey};
use sha2::Sha256;

use super::*;

/// Two RSA-2048 key pairs, made once per test run.
fn keys() -> &'static [RsaPrivateKey; 2] {
    static KEYS: OnceLock<[RsaPrivateKey; 2]> = OnceLock::new();
    KEYS.get_or_init(|| {
        let mut rng = rsa::rand_core::OsRng;
        [
            RsaPrivateKey::new(&mut rng, 2048).unwrap(),
            RsaPrivateKey::new(&mut rng, 2048).unwrap(),
        ]
    })
}

fn public_pem(key: &RsaPrivateKey) -> String {
    RsaPublicKey::from(key)
        .to_public_key_pem(LineEnding::LF)
        .unwrap()
}

fn rsa_sign(key: &RsaPrivateKey, message: &[u8]) -> String {
    STANDARD.encode(
        SigningKey::<Sha256>::new(key.clone())
            .sign(message)
            .to_bytes(),
    )
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

// ------------------------------------------------------------------ Alipay

const FORM: &str = "application/x-www-form-urlencoded";

/// Percent-encodes every byte that is not unreserved, as Alipay's
/// `URLEncoder` does.
fn enc(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'*' => {
                (b as char).to_string()
            }
            b' ' => "+".into(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A notification signed as Alipay's "异步通知验签" describes: the
/// non-empty parameters but `sign`/`sign_type`, sorted, `k=v&...`, in the
/// charset's bytes.
fn alipay_body(key: &RsaPrivateKey, fields: &[(&str, Vec<u8>)]) -> String {
    let mut signed: Vec<&(&str, Vec<u8>)> = fields.iter().filter(|(_, v)| !v.is_empty()).collect();
    signed.sort_by(|a, b| a.0.cmp(b.0));
    let mut content = Vec::new();
    for (k, v) in signed {
        if !content.is_empty() {
            content.push(b'&');
        }
        content.extend_from_slice(k.as_bytes());
        content.push(b'=');
        content.extend_from_slice(v);
    }
    let sign = rsa_sign(key, &content);
    let mut body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{k}={}", enc(v)))
        .collect();
    body.push(format!("sign={}", enc(sign.as_bytes())));
    body.push("sign_type=RSA2".into());
    body.join("&")
}

fn alipay_fields(charset: &str, subject: Vec<u8>) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("notify_time", b"2026-12-01 20:00:00".to_vec()),
        ("notify_type", b"trade_status_sync".to_vec()),
        ("notify_id", b"ac05099524730693a8b330c5ecf72da9786".to_vec()),
        ("app_id", b"2014072300007148".to_vec()),
        ("charset", charset.as_bytes().to_vec()),
        ("version", b"1.0".to_vec()),
        ("trade_no", b"2013112011001004330000121536".to_vec()),
        ("out_trade_no", b"6823789339978248".to_vec()),
        ("trade_status", b"TRADE_SUCCESS".to_vec()),
        ("total_amount", b"88.88".to_vec()),
        ("subject", subject),
        ("body", Vec::new()),
        ("passback_params", Vec::new()),
    ]
}

#[test]
fn alipay_verifies_utf8_and_gbk_with_empty_fields() {
    let alipay = Alipay::new(&public_pem(&keys()[0])).unwrap();
    let utf8 = alipay_body(
        &keys()[0],
        &alipay_fields("utf-8", "中文 商品".as_bytes().to_vec()),
    );
    let form = headers(&[("content-type", FORM)]);
    let json: serde_json::Value =
        serde_json::from_slice(&alipay.verify(&form, utf8.as_bytes(), 0).unwrap()).unwrap();
    assert_eq!(json["out_trade_no"], "6823789339978248");
    assert_eq!(json["subject"], "中文 商品");
    // Empty fields are not signed: the handler never sees them.
    assert!(json.get("body").is_none(), "{json}");
    assert!(json.get("sign").is_none() && json.get("sign_type").is_none());

    // "中文" in GBK: D6 D0 CE C4; signed over those bytes.
    let gbk = alipay_body(
        &keys()[0],
        &alipay_fields("GBK", vec![0xD6, 0xD0, 0xCE, 0xC4]),
    );
    let form_gbk = headers(&[(
        "content-type",
        "application/x-www-form-urlencoded; charset=GBK",
    )]);
    let json: serde_json::Value =
        serde_json::from_slice(&alipay.verify(&form_gbk, gbk.as_bytes(), 0).unwrap()).unwrap();
    assert_eq!(json["subject"], "中文");
    // The body's own `charset` field decides, even without a header charset.
    assert!(alipay.verify(&form, gbk.as_bytes(), 0).is_ok());

    // One more empty parameter changes nothing signed.
    let extra = format!("{utf8}&fund_bill_list=&voucher_detail_list=");
    assert!(alipay.verify(&form, extra.as_bytes(), 0).is_ok());
}

#[test]
fn alipay_refuses_tampering_other_keys_and_sha1() {
    let alipay = Alipay::new(&public_pem(&keys()[0])).unwrap();
    let form = headers(&[("content-type", FORM)]);
    let body = alipay_body(&keys()[0], &alipay_fields("utf-8", b"x".to_vec()));
    let tampered = body.replace("total_amount=88.88", "total_amount=0.01");
    assert_eq!(
        alipay.verify(&form, tampered.as_bytes(), 0),
        Err(VerifyError::BadSignature)
    );
    let other = alipay_body(&keys()[1], &alipay_fields("utf-8", b"x".to_vec()));
    assert_eq!(
        alipay.verify(&form, other.as_bytes(), 0),
        Err(VerifyError::BadSignature)
    );
    let sha1 = body.replace("sign_type=RSA2", "sign_type=RSA");
    assert!(matches!(
        alipay.verify(&form, sha1.as_bytes(), 0),
        Err(VerifyError::Unsupported(_))
    ));
    let repeated = format!("{body}&out_trade_no=2");
    assert!(matches!(
        alipay.verify(&form, repeated.as_bytes(), 0),
        Err(VerifyError::Malformed(_))
    ));
    let json = headers(&[("content-type", "application/json")]);
    assert!(matches!(
        alipay.verify(&json, body.as_bytes(), 0),
        Err(VerifyError::Malformed(_))
    ));
}

#[test]
fn alipay_keys_are_pem_or_bare_base64() {
    let pem = public_pem(&keys()[0]);
    let bare: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    assert!(Alipay::new(&pem).is_ok());
    assert!(Alipay::new(&bare).is_ok());
    assert!(matches!(
        Alipay::new("not a key"),
        Err(ProviderKeyError::PublicKey(_))
    ));
}

// -------------------------------------------------------------- WeChat Pay

const API_V3_KEY: &[u8; 32] = b"0123456789abcdef0123456789ABCDEF";

/// A notification as "证书和回调报文解密" and "签名验证" describe: the
/// resource encrypted with AEAD_AES_256_GCM, the body signed as
/// `timestamp\nnonce\nbody\n`.
fn wechat_callback(
    key: &RsaPrivateKey,
    serial: &str,
    timestamp: u64,
    plaintext: &str,
) -> (HeaderMap, Vec<u8>) {
    let nonce = "fdasflkja484";
    let aad = "transaction";
    let ciphertext = Aes256Gcm::new(API_V3_KEY.into())
        .encrypt(
            Nonce::from_slice(nonce.as_bytes()),
            Payload {
                msg: plaintext.as_bytes(),
                aad: aad.as_bytes(),
            },
        )
        .unwrap();
    let body = serde_json::json!({
        "id": "EV-2018022511223320873",
        "create_time": "2026-12-01T20:00:00+08:00",
        "resource_type": "encrypt-resource",
        "event_type": "TRANSACTION.SUCCESS",
        "summary": "支付成功",
        "resource": {
            "original_type": "transaction",
            "algorithm": "AEAD_AES_256_GCM",
            "ciphertext": STANDARD.encode(ciphertext),
            "associated_data": aad,
            "nonce": nonce,
        },
    })
    .to_string()
    .into_bytes();
    let ts = timestamp.to_string();
    let sig_nonce = "593BEC0C930BF1AFEB40B4A08C8FB242";
    let mut message = format!("{ts}\n{sig_nonce}\n").into_bytes();
    message.extend_from_slice(&body);
    message.push(b'\n');
    let h = headers(&[
        ("wechatpay-timestamp", &ts),
        ("wechatpay-nonce", sig_nonce),
        ("wechatpay-signature", &rsa_sign(key, &message)),
        ("wechatpay-serial", serial),
        ("wechatpay-signature-type", "WECHATPAY2-SHA256-RSA2048"),
    ]);
    (h, body)
}

const TRANSACTION: &str = r#"{"out_trade_no":"1217752501201407033233368018","transaction_id":"1217752501201407033233368018","trade_state":"SUCCESS","amount":{"total":100,"currency":"CNY"},"payer":{"openid":"oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"}}"#;

fn wechat() -> WeChatPay {
    WeChatPay::new(API_V3_KEY)
        .unwrap()
        .platform_public_key(
            "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
            &public_pem(&keys()[0]),
        )
        .unwrap()
        .platform_public_key(
            "PUB_KEY_ID_0114232134912410000000000000",
            &public_pem(&keys()[1]),
        )
        .unwrap()
}

#[test]
fn wechat_verifies_with_either_serial_and_decrypts() {
    let w = wechat();
    for (key, serial) in [
        (&keys()[0], "5157f09efdc096de15ebe81a47057a7232f1b8e1"),
        (&keys()[1], "PUB_KEY_ID_0114232134912410000000000000"),
    ] {
        let (h, body) = wechat_callback(key, serial, 1_000, TRANSACTION);
        assert_eq!(w.verify(&h, &body, 1_100).unwrap(), TRANSACTION.as_bytes());
    }
}

#[test]
fn wechat_refuses_stale_unknown_tampered_and_undecryptable() {
    let w = wechat();
    let serial = "5157F09EFDC096DE15EBE81A47057A7232F1B8E1";
    let (h, body) = wechat_callback(&keys()[0], serial, 1_000, TRANSACTION);
    assert_eq!(
        w.verify(&h, &body, 1_400),
        Err(VerifyError::StaleTimestamp(400))
    );
    let (h2, body2) = wechat_callback(&keys()[0], "ABCDEF", 1_000, TRANSACTION);
    assert_eq!(
        w.verify(&h2, &body2, 1_000),
        Err(VerifyError::UnknownSerial("ABCDEF".into()))
    );
    let mut tampered = body.clone();
    let at = tampered.iter().position(|&b| b == b'E').unwrap();
    tampered[at] = b'F';
    assert_eq!(
        w.verify(&h, &tampered, 1_000),
        Err(VerifyError::BadSignature)
    );
    // Signed by the key of the other serial.
    let (h3, body3) = wechat_callback(&keys()[1], serial, 1_000, TRANSACTION);
    assert_eq!(w.verify(&h3, &body3, 1_000), Err(VerifyError::BadSignature));
    let other_v3 = WeChatPay::new([7u8; 32])
        .unwrap()
        .platform_public_key(serial, &public_pem(&keys()[0]))
        .unwrap();
    assert!(matches!(
        other_v3.verify(&h, &body, 1_000),
        Err(VerifyError::Undecryptable(_))
    ));
    let mut probe = h.clone();
    probe.insert(
        "wechatpay-signature",
        HeaderValue::from_static("WECHATPAY/SIGNTEST/abc"),
    );
    assert!(w.verify(&probe, &body, 1_000).is_err());
    assert!(matches!(
        WeChatPay::new(b"short"),
        Err(ProviderKeyError::ApiV3Key(5))
    ));
}

// ----------------------------------------------------------------- Stripe

#[test]
fn stripe_reads_its_header_and_several_v1() {
    let stripe = Stripe::new("whsec_test_0123456789").unwrap();
    let body = br#"{"id":"evt_1","type":"payment_intent.succeeded"}"#;
    let value = stripe.sign(1_000, body);
    // Stripe sends v0 too, and two v1 while a secret is rolled.
    let rolled = format!("{value},v1={},v0=abcd", "00".repeat(32));
    let h = headers(&[("stripe-signature", &rolled)]);
    assert_eq!(stripe.verify(&h, body, 1_010), Ok(()));
    assert_eq!(
        stripe.verify(&h, b"{}", 1_010),
        Err(VerifyError::BadSignature)
    );
    assert_eq!(
        stripe.verify(&h, body, 1_000 + 301),
        Err(VerifyError::StaleTimestamp(301))
    );
    assert!(matches!(
        stripe.verify(&headers(&[("x-signature", &value)]), body, 1_000),
        Err(VerifyError::Missing(_))
    ));
}

// ----------------------------------------------------------------- GitHub

#[test]
fn github_published_test_vector() {
    // GitHub Docs, "Validating webhook deliveries", "Testing the webhook
    // payload validation": secret "It's a Secret to Everybody", payload
    // "Hello, World!".
    let github = GitHub::new("It's a Secret to Everybody").unwrap();
    let expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    assert_eq!(github.sign(b"Hello, World!"), expected);
    let h = headers(&[("x-hub-signature-256", expected)]);
    assert_eq!(github.check(&h, b"Hello, World!"), Ok(()));
    // Signed, but not a JSON delivery.
    assert!(matches!(
        github.verify(&h, b"Hello, World!"),
        Err(VerifyError::Malformed(_))
    ));
    assert_eq!(
        github.check(&h, b"Hello, World?"),
        Err(VerifyError::BadSignature)
    );
    let bare = headers(&[("x-hub-signature-256", &expected[7..])]);
    assert!(matches!(
        github.check(&bare, b"Hello, World!"),
        Err(VerifyError::Malformed(_))
    ));
    // A delivery sent as a form: its `payload` field.
    let form = b"payload=%7B%22zen%22%3A%22Keep+it+simple.%22%7D";
    let h = headers(&[("x-hub-signature-256", &github.sign(form))]);
    assert_eq!(
        github.verify(&h, form).unwrap(),
        br#"{"zen":"Keep it simple."}"#
    );
}

// ------------------------------------------------------------------ Adyen

const ADYEN_KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn adyen_item() -> serde_json::Value {
    // The notification of Adyen's HMAC documentation and libraries' tests.
    serde_json::json!({
        "pspReference": "7914073381342284",
        "merchantAccountCode": "TestMerchant",
        "merchantReference": "TestPayment-1407325143704",
        "amount": {"value": 1130, "currency": "EUR"},
        "eventCode": "AUTHORISATION",
        "success": "true",
        "additionalData": {},
    })
}

#[test]
fn adyen_published_test_vector() {
    // Adyen's sample: HMAC key 44782DEF...A056 and this item sign to
    // "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0=".
    let adyen =
        Adyen::new("44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056").unwrap();
    assert_eq!(
        adyen.sign(&adyen_item()),
        "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="
    );
}

#[test]
fn adyen_verifies_the_item_and_refuses_tampering_and_batches() {
    let adyen = Adyen::new(ADYEN_KEY).unwrap();
    let mut item = adyen_item();
    item["additionalData"]["hmacSignature"] = adyen.sign(&item).into();
    let body = |items: Vec<serde_json::Value>| {
        serde_json::json!({"live": "false", "notificationItems": items})
            .to_string()
            .into_bytes()
    };
    let one = body(vec![
        serde_json::json!({ "NotificationRequestItem": item.clone() }),
    ]);
    let payload: serde_json::Value = serde_json::from_slice(&adyen.verify(&one).unwrap()).unwrap();
    let signed = &payload["notificationItems"][0]["NotificationRequestItem"];
    assert_eq!(signed["pspReference"], "7914073381342284");
    assert_eq!(signed["amount"]["value"], 1130);
    // Unsigned fields do not reach the handler.
    assert!(signed.get("additionalData").is_none(), "{payload}");
    assert!(payload.get("live").is_none());
    let mut tampered = item.clone();
    tampered["amount"]["value"] = 1.into();
    let tampered = body(vec![
        serde_json::json!({ "NotificationRequestItem": tampered }),
    ]);
    assert_eq!(adyen.verify(&tampered), Err(VerifyError::BadSignature));
    let two = body(vec![
        serde_json::json!({ "NotificationRequestItem": item.clone() }),
        serde_json::json!({ "NotificationRequestItem": item }),
    ]);
    assert!(matches!(
        adyen.verify(&two),
        Err(VerifyError::Unsupported(_))
    ));
    assert!(matches!(
        Adyen::new("xyz"),
        Err(ProviderKeyError::HmacKey(_))
    ));
}

// ---------------------------------------------------------------- answers

#[test]
fn answers_are_in_the_providers_formats() {
    use axum::body::Body;
    use axum::http::{Response, StatusCode};
    let ok = || Response::new(Body::from("whatever"));
    let failed = || {
        let mut r = Response::new(Body::from("boom"));
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        r
    };
    let alipay = Provider::from(Alipay::new(&public_pem(&keys()[0])).unwrap());
    assert_eq!(alipay.answer(ok()).status(), StatusCode::OK);
    assert_eq!(alipay.success().body, "success");
    let failure = alipay.answer(failed());
    assert_eq!(failure.status(), StatusCode::SERVICE_UNAVAILABLE);
    let wechat = Provider::from(wechat());
    assert_eq!(wechat.answer(ok()).status(), StatusCode::NO_CONTENT);
    assert!(wechat.answer(ok()).headers().get("content-type").is_none());
    let failure = wechat.answer(failed());
    assert_eq!(failure.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failure.headers()["content-type"], "application/json");
    let stripe = Provider::from(Stripe::new("whsec_test_0123456789").unwrap());
    assert_eq!(
        stripe.answer(failed()).status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        Provider::from(GitHub::new("a-github-secret-0").unwrap()).name(),
        "github"
    );
    let mut redirect = ok();
    *redirect.status_mut() = StatusCode::SEE_OTHER;
    let failure = alipay.answer(redirect);
    assert_eq!(failure.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

// ------------------------------------------------------------------- fuzz
//
// Captured, validly signed callbacks of every provider, mutated the ways
// an attacker holding one would (fields re-cut, separators moved, unsigned
// parts changed, charsets swapped, bytes flipped): each mutant either is
// refused, or reaches the handler with exactly the original's key and
// payload. Driven through the layer's own steps (verification, the
// provider's payload, the request's delivery, the key), not through HTTP.

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % (n.max(1) as u64)).unwrap()
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A layer for `provider`, whose steps the fuzz drives one by one (its
/// store is never touched).
fn layer_for(provider: Provider) -> crate::http::IdempotencyLayer<crate::SqliteStore> {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .connect_lazy("sqlite::memory:")
        .unwrap();
    crate::http::IdempotencyLayer::provider(crate::SqliteStore::new(pool), "callbacks", provider)
        .build()
        .unwrap()
}

/// The key and payload the handler would get for a callback, or `None` if
/// the layer refuses it.
fn seen(
    layer: &crate::http::IdempotencyLayer<crate::SqliteStore>,
    path: &str,
    headers: &HeaderMap,
    body: &[u8],
    now: u64,
) -> Option<(String, serde_json::Value)> {
    let cfg = layer.config();
    let mut request = axum::http::Request::post(path).body(()).unwrap();
    *request.headers_mut() = headers.clone();
    let (parts, ()) = request.into_parts();
    let bytes = bytes::Bytes::copy_from_slice(body);
    let (parts, bytes) = crate::http::layer::verified(&cfg.http, parts, bytes, now).ok()?;
    let signed = crate::http::layer::signed(&cfg.http);
    let delivery = crate::http::request::delivery_of(&parts, &bytes, None, signed).ok()?;
    let key = cfg.engine.key_spec().derive(&delivery).ok()?;
    Some((
        key.into_string(),
        serde_json::from_slice(delivery.payload()).ok()?,
    ))
}

const TOKENS: &[&str] = &[
    "&",
    "=",
    "%26",
    "%3D",
    ":",
    "%3A",
    "&x=",
    "&x=1",
    "&sign_type=RSA2",
    "%25",
    "+",
    "%20",
    ",",
    "\"",
    "\\\\",
    "0",
    "A",
    "&out_trade_no=2",
];

/// One random mutation of `body` and `headers`.
fn mutate(rng: &mut Rng, headers: &mut HeaderMap, body: &mut Vec<u8>) {
    let at = |rng: &mut Rng, body: &Vec<u8>| rng.below(body.len() + 1);
    match rng.below(10) {
        0 => {
            if !body.is_empty() {
                let i = rng.below(body.len());
                body[i] = rng.pick(TOKENS).as_bytes()[0];
            }
        }
        1 | 2 => {
            let i = at(rng, body);
            let token = rng.pick(TOKENS).as_bytes().to_vec();
            body.splice(i..i, token);
        }
        3 => {
            let i = at(rng, body);
            let j = (i + rng.below(8)).min(body.len());
            body.drain(i..j);
        }
        4 => {
            // Fields reordered.
            let mut parts: Vec<Vec<u8>> = body.split(|&b| b == b'&').map(<[u8]>::to_vec).collect();
            if parts.len() > 1 {
                let (i, j) = (rng.below(parts.len()), rng.below(parts.len()));
                parts.swap(i, j);
                *body = parts.join(&b'&');
            }
        }
        5 | 6 => {
            // A field re-cut into its neighbour: `&k=v` becomes `%26k%3Dv`.
            let seps: Vec<usize> = body
                .iter()
                .enumerate()
                .filter(|(_, b)| **b == b'&')
                .map(|(i, _)| i)
                .collect();
            if !seps.is_empty() {
                let i = *rng.pick(&seps);
                let eq = body[i..].iter().position(|&b| b == b'=').map(|p| p + i);
                if let Some(eq) = eq {
                    body.splice(eq..=eq, b"%3D".iter().copied());
                }
                body.splice(i..=i, b"%26".iter().copied());
            }
        }
        7 => {
            let guid = format!("{:032x}", rng.next());
            headers.insert("x-github-delivery", HeaderValue::from_str(&guid).unwrap());
        }
        8 => {
            let ct = *rng.pick(&[
                "application/x-www-form-urlencoded; charset=ISO-8859-1",
                "application/x-www-form-urlencoded; charset=GBK",
                "application/x-www-form-urlencoded; charset=utf-8",
                "application/json; charset=latin1",
                "text/plain",
            ]);
            headers.insert("content-type", HeaderValue::from_static(ct));
        }
        _ => {
            // An unsigned header, or a signed one, changed.
            let names: Vec<String> = headers.keys().map(|k| k.as_str().to_owned()).collect();
            if let Some(name) = names.get(rng.below(names.len())) {
                let value = format!("{}{}", rng.pick(TOKENS), rng.next() % 1000);
                if let Ok(value) = HeaderValue::from_str(&value) {
                    headers.insert(
                        axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                        value,
                    );
                }
            }
        }
    }
}

/// Adyen's item with a field's JSON type or presence changed where the
/// signed text stays the same (`"true"` and `true`; absent, `null` and
/// `""`), or an unsigned `amount` of another type added.
fn retype(rng: &mut Rng, body: &[u8]) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let item = v.pointer_mut("/notificationItems/0/NotificationRequestItem")?;
    let object = item.as_object_mut()?;
    match rng.below(6) {
        0 => {
            object.insert("success".into(), serde_json::Value::Bool(true));
        }
        1 => {
            let field = *rng.pick(&["originalReference", "merchantReference"]);
            match object.get(field).and_then(serde_json::Value::as_str) {
                Some("") | None => {
                    let now = rng.pick(&[serde_json::Value::Null, "".into()]).clone();
                    object.insert(field.into(), now);
                }
                Some(_) => {}
            }
        }
        2 => {
            if object
                .get("originalReference")
                .is_some_and(|r| r == "" || r.is_null())
            {
                object.remove("originalReference");
            }
        }
        3 => {
            if object.get("amount").is_none() {
                let amounts = [
                    serde_json::json!("100000 EUR"),
                    serde_json::json!(100_000),
                    serde_json::json!([100_000, "EUR"]),
                    serde_json::json!({}),
                    serde_json::json!({"value": null}),
                ];
                let amount = rng.pick(&amounts).clone();
                object.insert("amount".into(), amount);
            }
        }
        4 => {
            object.insert("eventDate".into(), "2030-01-01T00:00:00Z".into());
        }
        _ => {
            object.insert(
                "amount".into(),
                serde_json::json!({"value": 1130.0, "currency": "EUR"}),
            );
        }
    }
    Some(v.to_string().into_bytes())
}

/// Adyen's item re-partitioned across its `:`-joined signed fields, the
/// signature kept: the same signed string, other fields.
fn repartition(rng: &mut Rng, body: &[u8]) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let item = v.pointer_mut("/notificationItems/0/NotificationRequestItem")?;
    let fields = [
        "/pspReference",
        "/originalReference",
        "/merchantAccountCode",
        "/merchantReference",
        "/amount/value",
        "/amount/currency",
        "/eventCode",
        "/success",
    ];
    let text = |item: &serde_json::Value, p: &str| match item.pointer(p) {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        _ => String::new(),
    };
    let joined: Vec<String> = fields.iter().map(|p| text(item, p)).collect();
    let joined = joined.join(":");
    let colons: Vec<usize> = joined.match_indices(':').map(|(i, _)| i).collect();
    if colons.len() <= 7 {
        return None;
    }
    // Seven of the colons, at random, as the field boundaries.
    let mut cuts: Vec<usize> = colons.clone();
    while cuts.len() > 7 {
        cuts.remove(rng.below(cuts.len()));
    }
    let mut start = 0;
    for (n, pointer) in fields.iter().enumerate() {
        let end = cuts.get(n).copied().unwrap_or(joined.len());
        let part = joined[start..end].to_owned();
        start = end + 1;
        if let Some(slot) = item.pointer_mut(pointer) {
            *slot = serde_json::Value::String(part);
        }
    }
    Some(v.to_string().into_bytes())
}

fn fuzz(
    name: &str,
    layer: &crate::http::IdempotencyLayer<crate::SqliteStore>,
    headers: &HeaderMap,
    body: &[u8],
    now: u64,
    extra: impl Fn(&mut Rng, &[u8]) -> Option<Vec<u8>>,
) {
    let original = seen(layer, "/callback", headers, body, now)
        .unwrap_or_else(|| panic!("{name}: the captured callback itself is refused"));
    let mut rng = Rng(0x5eed_0000_0000_0001 ^ name.len() as u64);
    let mut accepted = 0;
    for round in 0..3_000 {
        let mut h = headers.clone();
        let mut b = body.to_vec();
        for _ in 0..=rng.below(3) {
            mutate(&mut rng, &mut h, &mut b);
        }
        if let Some(other) = extra(&mut rng, &b) {
            b = other;
        }
        // Another path of the same route: nobody signs the path.
        let path = *rng.pick(&["/callback", "/callback/other", "/hooks/x"]);
        if let Some(got) = seen(layer, path, &h, &b, now) {
            accepted += 1;
            assert_eq!(
                got,
                original,
                "{name}: mutant {round} was accepted with another key or payload\nbody: {}\nheaders: {h:?}",
                String::from_utf8_lossy(&b)
            );
        }
    }
    eprintln!("{name}: 3000 mutants, {accepted} accepted, each as the original");
}

#[tokio::test]
async fn mutated_captured_callbacks_are_refused_or_exactly_the_original() {
    let now = 1_796_126_400; // 2026-12-01 20:00:00 Beijing time
    // Alipay: a subject with a legitimate `&`, GBK and UTF-8.
    let alipay = layer_for(Alipay::new(&public_pem(&keys()[0])).unwrap().into());
    for (charset, subject) in [
        ("utf-8", "Tom & Jerry 中文".as_bytes().to_vec()),
        ("GBK", vec![0xD6, 0xD0, 0xCE, 0xC4]),
    ] {
        let body = alipay_body(&keys()[0], &alipay_fields(charset, subject));
        let h = headers(&[("content-type", FORM)]);
        fuzz(
            &format!("alipay {charset}"),
            &alipay,
            &h,
            body.as_bytes(),
            now,
            |_, _| None,
        );
    }
    // WeChat Pay.
    let wechat = layer_for(wechat().into());
    let (h, body) = wechat_callback(
        &keys()[0],
        "5157F09EFDC096DE15EBE81A47057A7232F1B8E1",
        now,
        TRANSACTION,
    );
    fuzz("wechatpay", &wechat, &h, &body, now, |_, _| None);
    // Stripe.
    let secret = "whsec_test_0123456789";
    let stripe = layer_for(Stripe::new(secret).unwrap().into());
    let body =
        br#"{"id":"evt_1","type":"payment_intent.succeeded","data":{"object":{"id":"pi_1"}}}"#;
    let h = headers(&[
        ("content-type", "application/json"),
        (
            "stripe-signature",
            &Stripe::new(secret).unwrap().sign(now, body),
        ),
    ]);
    fuzz("stripe", &stripe, &h, body, now, |_, _| None);
    // GitHub: the delivery id is not signed, so it is not the key.
    let github = GitHub::new("a-github-secret-0").unwrap();
    let body = br#"{"action":"completed","check_run":{"id":4}}"#;
    let h = headers(&[
        ("content-type", "application/json"),
        ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"),
        ("x-hub-signature-256", &github.sign(body)),
    ]);
    fuzz(
        "github",
        &layer_for(github.into()),
        &h,
        body,
        now,
        |_, _| None,
    );
    // Adyen, with a `:` in the merchant reference: re-partitions exist.
    let adyen = Adyen::new(ADYEN_KEY).unwrap();
    let mut item = adyen_item();
    item["merchantReference"] = "order:42:a".into();
    item["eventDate"] = "2026-12-01T12:00:00+01:00".into();
    item["additionalData"]["hmacSignature"] = adyen.sign(&item).into();
    let body = serde_json::json!({"live": "false", "notificationItems": [{"NotificationRequestItem": item}]})
        .to_string()
        .into_bytes();
    let h = headers(&[("content-type", "application/json")]);
    let adyen_layer = layer_for(adyen.into());
    fuzz("adyen", &adyen_layer, &h, &body, now, |rng, b| {
        match rng.below(3) {
            0 => repartition(rng, b),
            1 => retype(rng, b),
            _ => None,
        }
    });
    // An item that signs no amount and no references (a report): nothing
    // unsigned may take their place.
    let adyen = Adyen::new(ADYEN_KEY).unwrap();
    let mut report = serde_json::json!({
        "pspReference": "8915542542127261",
        "merchantAccountCode": "TestMerchant",
        "eventCode": "REPORT_AVAILABLE",
        "success": "true",
        "reason": "https://example.com/report.csv",
        "additionalData": {},
    });
    report["additionalData"]["hmacSignature"] = adyen.sign(&report).into();
    let body = serde_json::json!({"live": "false", "notificationItems": [{"NotificationRequestItem": report}]})
        .to_string()
        .into_bytes();
    fuzz("adyen report", &adyen_layer, &h, &body, now, |rng, b| {
        (rng.below(2) == 0).then(|| retype(rng, b)).flatten()
    });
}
