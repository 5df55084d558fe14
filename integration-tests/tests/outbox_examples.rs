//! The examples' outbox options end to end, each example run as a child
//! process: `amqp_orders --settled-exchange` relays one settled message per
//! processed payment to the exchange, and `payment_webhook --notify-url`
//! POSTs one signed merchant notification per processed payment callback.
//!
//! Build the examples first: `cargo build --examples --all-features`
//! (`payment_webhook` needs the `webhook` feature for `--notify-url`).

use onceonly::Header;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderMap;
use lapin::ExchangeKind;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
use lapin::types::FieldTable;
use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish, take, url};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::demo::ledger::Settled;
use onceonly_integration_tests::free_port;
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{Expected, assert_exact};
use onceonly_integration_tests::{pay, unique};
use sqlx::PgPool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_orders_relays_one_settled_message_per_payment() {
    let (_conn, channel) = connect().await;
    let queue = unique("osettle");
    let exchange = format!("{queue}.settled");
    let settled_queue = format!("{queue}.settled.all");
    declare_queue(&channel, &queue).await;
    // What the example declares, and a queue bound to every account.
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("exchange declare");
    declare_queue(&channel, &settled_queue).await;
    channel
        .queue_bind(
            settled_queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");

    let mut expected = Expected::new();
    let mut messages = Vec::new();
    for i in 0..200 {
        let no = format!("S-{i:04}");
        let account = format!("acct-{}", i % 7);
        let amount = 1 + i64::from(i) % 50;
        let body = pay(&no, amount).account(&account).body();
        messages.push(Msg::new(body.clone()));
        if i % 3 == 0 {
            messages.push(Msg::new(body));
        }
        expected.insert(no, (account, amount));
    }
    for i in 0..3 {
        // Refused by the handler: dead-lettered, never announced.
        let no = format!("S-REFUSED-{i}");
        messages.push(Msg::new(pay(&no, 0).account("acct-0").body()));
    }
    publish(&channel, &queue, &messages).await;

    let db = pg_schema("osettle").await;
    let pool = PgPool::connect(&db).await.expect("postgres");
    let child = Logged::new("amqp_orders_outbox");
    let args: Vec<String> = [
        "--amqp-url",
        &url(),
        "--queue",
        &queue,
        "--database-url",
        &db,
        "--settled-exchange",
        &exchange,
        "--exit-when-idle",
        "3",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    let mut run = child.spawn("amqp_orders", &args);
    let status = tokio::time::timeout(Duration::from_secs(90), run.wait())
        .await
        .unwrap_or_else(|_| panic!("amqp_orders did not finish; log:\n{}", child.tail()))
        .expect("wait");
    assert!(status.success(), "{status}; log:\n{}", child.tail());
    assert_exact(&pool, &expected).await;

    let got = take(&channel, &settled_queue, 300, Duration::from_secs(10)).await;
    assert_eq!(depth(&channel, &settled_queue).await, 0);
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in &got {
        let s: Settled = serde_json::from_slice(&m.delivery.data).expect("settled JSON");
        assert_eq!(
            m.delivery.routing_key.as_str(),
            s.account,
            "routed by account"
        );
        assert_eq!(
            (&s.account, s.amount),
            expected
                .get(&s.out_trade_no)
                .map(|(a, n)| (a, *n))
                .unwrap_or_else(|| panic!("settled message for an unprocessed payment: {s:?}")),
        );
        let id = onceonly_integration_tests::amqp::header(
            &m.delivery.properties,
            Header::MessageId.name(),
        )
        .expect("message id header");
        assert_eq!(
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|v| v.as_str()),
            Some(id.as_str()),
            "AMQP message_id"
        );
        ids.entry(s.out_trade_no).or_default().insert(id);
    }
    // One run, no crash: exactly one message per payment.
    assert_eq!(got.len(), expected.len(), "settled messages");
    assert_eq!(
        ids.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    assert!(ids.values().all(|set| set.len() == 1));
}

/// What the merchant's endpoint received: headers and body per POST.
type Received = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_webhook_notifies_the_merchant_once_per_payment() {
    // The merchant's notification endpoint.
    let received: Received = Arc::default();
    let sink = Arc::clone(&received);
    let merchant = axum::Router::new().route(
        "/notify",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let sink = Arc::clone(&sink);
            async move {
                sink.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((headers, body));
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let notify_url = format!("http://{}/notify", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, merchant).await });

    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("webhook.db").display()
    );
    let listen = format!("127.0.0.1:{}", free_port());
    let child = Logged::new("payment_webhook_outbox");
    let args: Vec<String> = [
        "--listen",
        &listen,
        "--database-url",
        &db,
        "--notify-url",
        &notify_url,
        "--notify-secret",
        "s3cret",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    let mut server = child.spawn("payment_webhook", &args);
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::net::TcpStream::connect(&listen).await.is_err() {
        if let Some(status) = server.try_wait().expect("status") {
            panic!("payment_webhook exited ({status}); log:\n{}", child.tail());
        }
        assert!(
            Instant::now() < deadline,
            "no server; log:\n{}",
            child.tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let http = reqwest::Client::new();
    let callback = format!("http://{listen}/webhooks/payments");
    let mut expected = Expected::new();
    for i in 0..20 {
        let no = format!("W-{i:03}");
        let account = format!("acct-{}", i % 3);
        let body = pay(&no, 10 + i64::from(i)).account(&account).body();
        // Every callback is sent twice: the repeat must not notify again.
        for _ in 0..2 {
            let r = http
                .post(&callback)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .expect("callback");
            assert!(r.status().is_success(), "{}", r.status());
        }
        expected.insert(no, (account, 10 + i64::from(i)));
    }
    let refused = http
        .post(&callback)
        .header("content-type", "application/json")
        .body(pay("W-REFUSED", 0).account("acct-0").body())
        .send()
        .await
        .expect("callback");
    assert_eq!(refused.status().as_u16(), 400);

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = received
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        if n >= expected.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{n} notifications after 30 s; log:\n{}",
            child.tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything more would arrive now.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let got = received
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    assert_eq!(got.len(), expected.len(), "one notification per payment");
    let mut ids = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for (headers, body) in &got {
        let s: Settled = serde_json::from_slice(body).expect("notification JSON");
        assert_eq!(
            expected.get(&s.out_trade_no),
            Some(&(s.account.clone(), s.amount)),
            "{s:?}"
        );
        seen.insert(s.out_trade_no);
        // Signed as Standard Webhooks: checked with openssl, not with the
        // signer under test.
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let id = header(Header::MessageId.name());
        assert_eq!(
            header(Header::WebhookId.name()),
            id,
            "webhook-id is the message id"
        );
        let timestamp = header(Header::WebhookTimestamp.name());
        let signed = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body].concat();
        assert_eq!(
            header(Header::WebhookSignature.name()),
            format!("v1,{}", openssl_hmac_base64(b"s3cret", &signed)),
            "a Standard Webhooks signature"
        );
        assert!(
            headers.get(Header::Signature.name()).is_none(),
            "one signature scheme"
        );
        ids.insert(id);
    }
    assert_eq!(seen.len(), expected.len());
    assert_eq!(ids.len(), expected.len());
    server.start_kill().expect("kill");
    let _ = server.wait().await;
}

/// Base64 of HMAC-SHA256 of `data` under `key`, computed by the openssl
/// command line (an implementation other than the publisher's).
fn openssl_hmac_base64(key: &[u8], data: &[u8]) -> String {
    use std::io::Write;
    let mut mac = std::process::Command::new("openssl")
        .args(["dgst", "-sha256", "-binary", "-mac", "HMAC", "-macopt"])
        .arg(format!(
            "hexkey:{}",
            key.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("openssl (scripts/build-deps installs it)");
    mac.stdin.take().unwrap().write_all(data).unwrap();
    let digest = mac.wait_with_output().unwrap().stdout;
    let mut b64 = std::process::Command::new("openssl")
        .args(["base64", "-A"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    b64.stdin.take().unwrap().write_all(&digest).unwrap();
    String::from_utf8(b64.wait_with_output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_owned()
}
