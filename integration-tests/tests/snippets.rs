//! The snippets of docs/ (and README.md) that move money, run as written
//! (`build.rs` copies each block marked `<!-- snippet: NAME -->` into
//! `$OUT_DIR/snippets/NAME.rs`; only rustdoc's feature gate is left out).
//!
//! Each runs against PostgreSQL (a database of its own: the snippets name
//! their business tables) and the loopback provider API, which honours
//! `Idempotency-Key` as Stripe does and can be down: a refund is booked
//! exactly once with the provider's id, and a provider that answers with
//! an error (`503` with a JSON body) books nothing.

use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use onceonly::{Delivery, Outcome};
use onceonly_integration_tests::own_db::OwnDb;
use onceonly_integration_tests::pg_store;
use onceonly_integration_tests::provider_api::ProviderApi;
use serde_json::json;
use sqlx::PgPool;

/// docs/providers.md's payments snippet: a Stripe callback route with a
/// fence, and a refund route whose call to the provider is a step.
mod providers_payments {
    include!(concat!(env!("OUT_DIR"), "/snippets/providers_payments.rs"));
}

/// docs/steps.md's snippet: an engine and a handler that refunds through
/// a step and books the refund.
mod steps_refund {
    include!(concat!(env!("OUT_DIR"), "/snippets/steps_refund.rs"));
}

const STRIPE_SECRET: &str = "whsec_test_5WbX5kEWLlfzsGNjH64I8lOOqUB6e8FH";

/// Sets what the snippets read from the environment. Each test binary of
/// nextest is a process of its own, and both tests set the same values.
fn environment(api: &ProviderApi) {
    // SAFETY: set before any thread of the test reads the environment;
    // both tests set the same values.
    unsafe {
        std::env::set_var("PSP_API", api.url());
        std::env::set_var("DOWNSTREAM_SECRET", "snippet-downstream-secret");
    }
}

async fn database(prefix: &str, tables: &str) -> (OwnDb, onceonly::PgStore, PgPool) {
    let db = OwnDb::create(prefix).await;
    let store = pg_store(&db.url, "onceonly_keys").await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    sqlx::raw_sql(tables).execute(&pool).await.expect("tables");
    (db, store, pool)
}

/// The refunds booked: the snippet's key column and the provider's id.
async fn booked(pool: &PgPool, key: &str) -> Vec<(String, Option<String>)> {
    sqlx::query_as(&format!(
        "SELECT {key}, provider_id FROM refunds ORDER BY 1"
    ))
    .fetch_all(pool)
    .await
    .expect("refunds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_payments_snippet_refunds_once_and_fences_stripe_events() {
    let api = ProviderApi::start().await;
    environment(&api);
    let (_db, store, pool) = database(
        "snippet_providers",
        "CREATE TABLE payments (intent text PRIMARY KEY, status text);
         CREATE TABLE refunds (payment text NOT NULL, provider_id text);
         INSERT INTO payments VALUES ('pi_3MtwBwLkdIwHu7ix28a3tqPa', 'requires_payment_method');",
    )
    .await;
    let app = providers_payments::example::app(store, STRIPE_SECRET).expect("the snippet's app");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = reqwest::Client::new();
    let refund = |key: &'static str| {
        http.post(format!("{base}/refunds"))
            .header("Idempotency-Key", key)
            .json(&json!({"payment": "pi_1", "amount": 500}))
            .send()
    };

    // The provider answers 503 with a JSON body: nothing booked.
    api.set_down(true);
    let answer = refund("refund-1").await.unwrap();
    assert_eq!(answer.status(), 502, "the step failed");
    assert_eq!(
        booked(&pool, "payment").await,
        [],
        "no refund booked that never happened"
    );
    assert_eq!(api.unavailable_answers(), 1);

    // Back: the retry refunds once and books the provider's id; its
    // duplicate gets the stored answer and calls nothing.
    api.set_down(false);
    for _ in 0..3 {
        let answer = refund("refund-1").await.unwrap();
        assert_eq!(answer.status(), 201);
    }
    assert_eq!(api.refunds().len(), 1, "one refund at the provider");
    assert_eq!(
        booked(&pool, "payment").await,
        [("pi_1".to_owned(), Some(api.refunds()[0].id.clone()))]
    );

    // Stripe events of one payment intent, signed as Stripe signs: the
    // newer applies, the older one delivered after it does not.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    for (created, id, status) in [
        (now, "evt_new", "succeeded"),
        (now - 60, "evt_old", "processing"),
    ] {
        let (signature, body) = stripe_event(created, id, status);
        let answer = http
            .post(format!("{base}/webhooks/stripe"))
            .header("content-type", "application/json")
            .header("stripe-signature", signature)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{id}: Stripe stops retrying");
    }
    let status: String = sqlx::query_scalar("SELECT status FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "succeeded", "the older event did not move it back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_steps_snippet_refunds_once_and_books_nothing_on_an_error_answer() {
    let api = ProviderApi::start().await;
    environment(&api);
    let (_db, store, pool) = database(
        "snippet_steps",
        "CREATE TABLE refunds (refund_id text PRIMARY KEY, provider_id text);",
    )
    .await;
    let (engine, handler) = steps_refund::refunds(store).expect("the snippet's engine");
    let delivery =
        Delivery::new(json!({"refund_id": "R-1", "payment": "pi_1", "amount": 500}).to_string());

    // The provider answers 503 with a JSON body: a retryable failure,
    // nothing booked.
    api.set_down(true);
    let report = engine.process(&handler, &delivery).await;
    assert!(
        matches!(report.outcome, Outcome::Failed(_)),
        "{:?}",
        report.outcome
    );
    assert_eq!(
        booked(&pool, "refund_id").await,
        [],
        "no refund booked that never happened"
    );

    api.set_down(false);
    let report = engine.process(&handler, &delivery).await;
    assert!(
        matches!(report.outcome, Outcome::Processed { .. }),
        "{:?}",
        report.outcome
    );
    let report = engine.process(&handler, &delivery).await;
    assert!(
        matches!(report.outcome, Outcome::Duplicate { .. }),
        "{:?}",
        report.outcome
    );
    assert_eq!(api.refunds().len(), 1, "one refund at the provider");
    assert_eq!(
        booked(&pool, "refund_id").await,
        [("R-1".to_owned(), Some(api.refunds()[0].id.clone()))]
    );
}

/// A `payment_intent` event and its `Stripe-Signature` (`t=..,v1=..`,
/// HMAC-SHA256 of `"<t>.<body>"` with the endpoint secret, by openssl).
fn stripe_event(created: u64, id: &str, status: &str) -> (String, Vec<u8>) {
    let body = json!({
        "id": id,
        "object": "event",
        "created": created,
        "type": format!("payment_intent.{status}"),
        "data": {"object": {
            "id": "pi_3MtwBwLkdIwHu7ix28a3tqPa",
            "object": "payment_intent",
            "status": status,
        }},
    })
    .to_string()
    .into_bytes();
    let signed = [created.to_string().as_bytes(), b".", &body].concat();
    let mut openssl = Command::new("openssl")
        .args(["dgst", "-sha256", "-mac", "HMAC", "-macopt"])
        .arg(format!("key:{STRIPE_SECRET}"))
        .arg("-hex")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("these tests need the openssl CLI (apt-get install openssl)");
    std::io::Write::write_all(&mut openssl.stdin.take().unwrap(), &signed).unwrap();
    let out = String::from_utf8(openssl.wait_with_output().unwrap().stdout).unwrap();
    let v1 = out.trim().rsplit(' ').next().unwrap().to_owned();
    (format!("t={},v1={v1}", created), body)
}
