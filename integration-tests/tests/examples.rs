//! The small examples of the package `onceonly` (`examples/` at the
//! repository root), each run as a child process against the real
//! services, the way its doc comment tells a user to run it. Each test
//! prepares the example's input (records and messages with a duplicate
//! among them, a signed callback sent twice, dead letters, Avro records
//! under a schema registry, a webhook receiver, a provider API), runs the
//! example, stops it with the signal a user would send (or lets it finish),
//! and checks what the user cares about: each payment booked exactly once,
//! unreadable input dead-lettered, one webhook, one call to the provider.
//!
//! Each test has a PostgreSQL schema, topics and queues of its own, so
//! they run beside the rest of the suite. The examples are built with the
//! tests (`cargo nextest run --workspace --all-features`, or `cargo build
//! --examples --all-features`).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, StatusCode};
use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish};
use onceonly_integration_tests::child::example_binary;
use onceonly_integration_tests::kafka::{
    Record, committed, create_topic, pg_schema, produce, read_all,
};
use onceonly_integration_tests::provider_api::ProviderApi;
use onceonly_integration_tests::schema_registry::{Fixtures, Registry};
use onceonly_integration_tests::{free_port, pay, unique};
use sqlx::PgPool;
use tokio::process::{Child, Command};

// ------------------------------------------------------------------ harness

/// An example running as a child process, its stdout and stderr in a log
/// file (shown when a test fails).
struct Example {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Example {
    /// Starts example `name` with `envs` on top of the test's environment
    /// (which names the services: `ONCEONLY_KAFKA_BROKERS`, ...).
    fn start(name: &'static str, envs: &[(&str, &str)]) -> Self {
        let log = std::env::temp_dir().join(format!("{}.log", unique(name)));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(example_binary(name))
            .envs(envs.iter().copied())
            .stdout(file.try_clone().expect("log file"))
            .stderr(Stdio::from(file))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Self { name, child, log }
    }

    /// What it printed so far.
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `done()` holds, polling; fails after 120 s, or if the
    /// example exits meanwhile.
    async fn wait_until(&mut self, what: &str, done: impl AsyncFn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !done().await {
            if let Some(status) = self.child.try_wait().expect("child status") {
                panic!(
                    "{} exited ({status}) before {what}:\n{}",
                    self.name,
                    self.output()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{}: not {what} within 120 s:\n{}",
                self.name,
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sends `signal` (`INT` for Ctrl-C, `TERM`) and waits for a clean exit.
    async fn stop(self, signal: &str) -> String {
        let pid = self.child.id().expect("the example runs").to_string();
        let sent = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill -{signal} {pid}");
        self.exits().await
    }

    /// Waits for the example to exit by itself, successfully; its output.
    async fn exits(mut self) -> String {
        let status = tokio::time::timeout(Duration::from_secs(120), self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} did not exit within 120 s:\n{}",
                    self.name,
                    self.output()
                )
            })
            .expect("wait");
        let output = self.output();
        assert!(
            status.success(),
            "{} failed ({status}):\n{output}",
            self.name
        );
        output
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// `(out_trade_no, rows, total amount)` of the examples' `payments_ledger`
/// in the schema of `db`, sorted; empty while the table does not exist.
async fn ledger(db: &str) -> Vec<(String, i64, i64)> {
    let pool = PgPool::connect(db).await.expect("PostgreSQL");
    let rows = sqlx::query_as(
        "SELECT out_trade_no, COUNT(*), SUM(amount)::BIGINT FROM payments_ledger \
         GROUP BY out_trade_no ORDER BY out_trade_no",
    )
    .fetch_all(&pool)
    .await
    .unwrap_or_default();
    pool.close().await;
    rows
}

/// One row of [`ledger`]: `key` booked once, for `amount`.
fn once(key: &str, amount: i64) -> (String, i64, i64) {
    (key.to_owned(), 1, amount)
}

async fn execute(db: &str, sql: &str) {
    let pool = PgPool::connect(db).await.expect("PostgreSQL");
    sqlx::query(sql).execute(&pool).await.expect(sql);
    pool.close().await;
}

// -------------------------------------------------------------- quickstart

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_books_each_payment_once() {
    let output = Example::start("quickstart", &[]).exits().await;
    assert!(
        output.contains("OK: every out_trade_no booked exactly once."),
        "{output}"
    );
}

// ----------------------------------------------------------- kafka_consumer

/// Records with a duplicate and an unreadable one: each payment booked
/// once, the unreadable record in the dead-letter topic, every offset
/// committed; SIGTERM stops the consumer cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_books_each_payment_once() {
    let topic = unique("ex_kafka");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 1).await;
    create_topic(&dlt, 1).await;
    let db = pg_schema("ex_kafka").await;
    let unreadable = r#"{"out_trade_no":"K-3","amount":"ten"}"#;
    produce(
        &topic,
        &[
            Record::new("K-1", pay("K-1", 500)),
            Record::new("K-2", pay("K-2", 250)),
            Record::new("K-1", pay("K-1", 500)), // the producer sent it twice
            Record::new("K-3", unreadable),
        ],
    )
    .await;

    let mut example = Example::start(
        "kafka_consumer",
        &[("ONCEONLY_PG_URL", &db), ("KAFKA_TOPIC", &topic)],
    );
    let group = format!("{topic}-ledger");
    example
        .wait_until("every offset committed", async || {
            committed(&group, &topic, 1).get(&0) == Some(&4)
        })
        .await;
    example.stop("TERM").await;

    assert_eq!(ledger(&db).await, vec![once("K-1", 500), once("K-2", 250)]);
    let dead = read_all(&dlt, 1, 2, Duration::from_secs(10));
    assert_eq!(dead.len(), 1, "one dead letter");
    assert_eq!(
        rdkafka::Message::payload(&dead[0]),
        Some(unreadable.as_bytes())
    );
}

// ------------------------------------------------------------ amqp_consumer

/// Messages with a duplicate and an unreadable one: each payment booked
/// once, the unreadable message in `<queue>.dlq`, nothing left unacked;
/// Ctrl-C stops the consumer cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_consumer_books_each_payment_once() {
    let queue = unique("ex_amqp");
    let dlq = format!("{queue}.dlq");
    let db = pg_schema("ex_amqp").await;
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let messages = [
        Msg::new(pay("A-1", 500)),
        Msg::new(pay("A-2", 250)),
        Msg::new(pay("A-1", 500)), // published again: a lost publisher confirm
        Msg::new(r#"{"out_trade_no":"A-3","amount":"ten"}"#),
    ];
    publish(&channel, &queue, &messages).await;

    let mut example = Example::start(
        "amqp_consumer",
        &[("ONCEONLY_PG_URL", &db), ("AMQP_QUEUE", &queue)],
    );
    example
        .wait_until("booked and dead-lettered", async || {
            ledger(&db).await.len() == 2
                && depth(&channel, &queue).await == 0
                && depth(&channel, &dlq).await == 1
        })
        .await;
    example.stop("INT").await;

    assert_eq!(ledger(&db).await, vec![once("A-1", 500), once("A-2", 250)]);
    assert_eq!(depth(&channel, &queue).await, 0, "every message acked");
    assert_eq!(
        depth(&channel, &dlq).await,
        1,
        "the unreadable message dead-lettered"
    );
}

// ----------------------------------------------------------- stripe_webhook

const STRIPE_SECRET: &str = "whsec_test_example_0123456789abcdef";

/// A Stripe event signed as Stripe signs it: `Stripe-Signature:
/// t=<unix>,v1=<hex HMAC-SHA256 of "<t>.<body>">` (the HMAC from the
/// openssl CLI, not the verifier's code).
fn stripe_signature(body: &[u8]) -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let signed = [t.to_string().as_bytes(), b".", body].concat();
    let mut openssl = std::process::Command::new("openssl")
        .args([
            "dgst",
            "-sha256",
            "-mac",
            "HMAC",
            "-macopt",
            &format!("key:{STRIPE_SECRET}"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("these tests need the openssl CLI");
    std::io::Write::write_all(&mut openssl.stdin.take().unwrap(), &signed).unwrap();
    let out = openssl.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let hex = text.trim().rsplit(' ').next().unwrap().to_owned();
    format!("t={t},v1={hex}")
}

/// A guest checkout's `payment_intent.succeeded` (no customer) sent twice,
/// another event type and a forged event: the payment is booked once, and
/// each genuine event gets Stripe's success answer; Ctrl-C stops the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_webhook_books_a_payment_once() {
    let db = pg_schema("ex_stripe").await;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut example = Example::start(
        "stripe_webhook",
        &[
            ("ONCEONLY_PG_URL", &db),
            ("LISTEN", &listen),
            ("STRIPE_WEBHOOK_SECRET", STRIPE_SECRET),
        ],
    );
    let url = format!("http://{listen}/webhooks/stripe");
    let client = reqwest::Client::new();
    example
        .wait_until("listening", async || client.get(&url).send().await.is_ok())
        .await;
    let post = async |body: &serde_json::Value, signature: Option<String>| {
        let body = body.to_string();
        let signature = signature.unwrap_or_else(|| stripe_signature(body.as_bytes()));
        let answer = client
            .post(&url)
            .header("content-type", "application/json")
            .header("stripe-signature", signature)
            .body(body)
            .send()
            .await
            .expect("POST");
        (answer.status(), answer.text().await.unwrap_or_default())
    };
    let succeeded = serde_json::json!({
        "id": "evt_ex_1", "object": "event", "type": "payment_intent.succeeded",
        "data": {"object": {"id": "pi_ex_1", "object": "payment_intent", "amount": 2000,
                            "currency": "usd", "customer": null, "status": "succeeded"}},
    });
    let other = serde_json::json!({
        "id": "evt_ex_2", "object": "event", "type": "customer.created",
        "data": {"object": {"id": "cus_ex_1", "object": "customer"}},
    });
    let received = (StatusCode::OK, r#"{"received":true}"#.to_owned());
    assert_eq!(post(&succeeded, None).await, received);
    assert_eq!(
        post(&succeeded, None).await,
        received,
        "Stripe sent it again"
    );
    assert_eq!(post(&other, None).await, received);
    let forged = post(&succeeded, Some(format!("t=1,v1={}", "0".repeat(64)))).await;
    assert_eq!(forged.0, StatusCode::UNAUTHORIZED, "{forged:?}");
    example.stop("INT").await;

    assert_eq!(ledger(&db).await, vec![once("pi_ex_1", 2000)]);
}

// --------------------------------------------------------------- dlq_replay

/// Payments refused by the database land in the dead-letter queue; after
/// the fix, one of them is sent again and booked; `dlq_replay` sends both
/// letters back (one new, one a duplicate), and the consumer books the new
/// one: each payment booked once, the dead-letter queue empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_books_each_dead_letter_once() {
    let queue = unique("ex_dlq");
    let dlq = format!("{queue}.dlq");
    let db = pg_schema("ex_dlq").await;
    let env = [
        ("ONCEONLY_PG_URL", db.as_str()),
        ("AMQP_QUEUE", queue.as_str()),
        ("EXIT_WHEN_IDLE", "1"),
    ];
    // The bug: a limit the ledger should not have.
    execute(
        &db,
        "CREATE TABLE payments_ledger (out_trade_no TEXT, amount BIGINT, \
         CONSTRAINT amount_limit CHECK (amount < 1000))",
    )
    .await;
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let (d1, d2, d3) = (pay("D-1", 500), pay("D-2", 2000), pay("D-3", 3000));
    publish(
        &channel,
        &queue,
        &[Msg::new(d1), Msg::new(d2.clone()), Msg::new(d3)],
    )
    .await;
    Example::start("amqp_consumer", &env).exits().await;
    assert_eq!(ledger(&db).await, vec![once("D-1", 500)]);
    assert_eq!(depth(&channel, &dlq).await, 2, "D-2 and D-3 dead-lettered");

    // The fix; the sender of D-2 sends it again meanwhile.
    execute(
        &db,
        "ALTER TABLE payments_ledger DROP CONSTRAINT amount_limit",
    )
    .await;
    publish(&channel, &queue, &[Msg::new(d2)]).await;
    Example::start("amqp_consumer", &env).exits().await;

    let replay = Example::start("dlq_replay", &env).exits().await;
    assert!(
        replay.contains("replayed 2 of 2 dead letters (1 new, 1 duplicates, 0 conflicts)"),
        "{replay}"
    );
    assert_eq!(depth(&channel, &dlq).await, 0, "every letter replayed");
    Example::start("amqp_consumer", &env).exits().await;

    assert_eq!(
        ledger(&db).await,
        vec![once("D-1", 500), once("D-2", 2000), once("D-3", 3000)]
    );
    assert_eq!(depth(&channel, &queue).await, 0);
    assert_eq!(depth(&channel, &dlq).await, 0);
}

// ------------------------------------------------------------ avro_consumer

/// Avro records in the registry's wire format: a payment, the same record
/// again, the same payment re-encoded under the schema's next version,
/// another payment, and a record that does not match its schema. Each
/// payment booked once, exact to the cent; the bad record dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_consumer_books_each_payment_once() {
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let topic = unique("ex_avro");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 1).await;
    create_topic(&dlt, 1).await;
    let db = pg_schema("ex_avro").await;
    let records: Vec<Record> = [
        "avro_v1_paid",
        "avro_v1_paid",
        "avro_v2_paid",
        "avro_v1_other",
        "bad_avro_body",
    ]
    .iter()
    .map(|name| Record::new(*name, fixtures.payload(name)))
    .collect();
    produce(&topic, &records).await;

    let registry_url = registry.url();
    let mut example = Example::start(
        "avro_consumer",
        &[
            ("ONCEONLY_PG_URL", &db),
            ("KAFKA_TOPIC", &topic),
            ("SCHEMA_REGISTRY_URL", &registry_url),
        ],
    );
    let group = format!("{topic}-ledger");
    example
        .wait_until("every offset committed", async || {
            committed(&group, &topic, 1).get(&0) == Some(&5)
        })
        .await;
    example.stop("TERM").await;

    // T-1001 is 123.45, T-1002 -0.05 (the fixtures' decimals).
    assert_eq!(
        ledger(&db).await,
        vec![once("T-1001", 12345), once("T-1002", -5)]
    );
    let dead = read_all(&dlt, 1, 2, Duration::from_secs(10));
    assert_eq!(dead.len(), 1, "the bad record dead-lettered");
    assert_eq!(
        rdkafka::Message::payload(&dead[0]),
        Some(fixtures.payload("bad_avro_body").as_slice())
    );
}

// ----------------------------------------------------------- outbox_webhook

/// A payment and its redelivery: one ledger row, and the merchant's
/// receiver gets one signed POST; the example exits once it was delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_webhook_notifies_once() {
    let db = pg_schema("ex_outbox").await;
    let received: Arc<Mutex<Vec<(HeaderMap, String)>>> = Arc::default();
    let receiver = axum::Router::new().route(
        "/notify",
        axum::routing::post({
            let received = Arc::clone(&received);
            move |headers: HeaderMap, body: String| async move {
                received.lock().unwrap().push((headers, body));
                StatusCode::NO_CONTENT
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let notify_url = format!("http://{}/notify", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, receiver).await });

    let output = Example::start(
        "outbox_webhook",
        &[("ONCEONLY_PG_URL", &db), ("NOTIFY_URL", &notify_url)],
    )
    .exits()
    .await;
    server.abort();

    assert!(
        output.contains("delivery: processed") && output.contains("redelivery: duplicate"),
        "{output}"
    );
    assert_eq!(ledger(&db).await, vec![once("T-1", 500)]);
    let received = received.lock().unwrap();
    assert_eq!(received.len(), 1, "one notification: {received:?}");
    let (headers, body) = &received[0];
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(body, serde_json::json!({"settled": "T-1", "amount": 500}));
    for name in ["webhook-id", "webhook-timestamp"] {
        assert!(headers.contains_key(name), "{name} missing: {headers:?}");
    }
    let signature = headers["webhook-signature"].to_str().unwrap();
    assert!(signature.starts_with("v1,"), "{signature}");
}

// -------------------------------------------------------------- refund_step

/// The first attempt fails after the provider call, the retry books the
/// refund, the redelivery is a duplicate: the provider was called once and
/// refunded once, and one refund row names its refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refund_step_calls_the_provider_once() {
    let db = pg_schema("ex_refund").await;
    let api = ProviderApi::start().await;
    let psp = api.url();
    let output = Example::start(
        "refund_step",
        &[("ONCEONLY_PG_URL", &db), ("PSP_API", &psp)],
    )
    .exits()
    .await;

    assert!(
        output.contains("delivery: processed after 2 attempt(s)"),
        "{output}"
    );
    assert!(output.contains("redelivery: duplicate"), "{output}");
    assert_eq!(api.requests(), 1, "one call to the provider");
    let refunds = api.refunds();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!(
        (refunds[0].payment.as_str(), refunds[0].amount),
        ("pi_1", 500)
    );
    let pool = PgPool::connect(&db).await.unwrap();
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT refund_id, provider_id FROM refunds")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![("R-1".to_owned(), refunds[0].id.clone())]);
}
