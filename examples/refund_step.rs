//! A handler that calls a payment provider's refund API through a step
//! (`Tx::step`), so that no retry or redelivery refunds twice.
//!
//! The call cannot be part of the database transaction. The step sends it
//! with an `Idempotency-Key` derived from the message key and records the
//! answer as soon as it returned: a retry after a failure before `COMMIT`
//! gets that answer without calling again; a call that never finished is
//! sent again under the same key, which the provider answers with its
//! first answer. Here the first attempt fails right after the call (the
//! connection lost before `COMMIT`), the retry books the refund, and a
//! redelivery is a duplicate: one call, one refund row.
//!
//! First: `scripts/services` (PostgreSQL), and a provider API that takes
//! `POST /v1/refunds` with JSON `{"payment", "amount"}` and honours
//! `Idempotency-Key` (as the tests' `integration-tests/src/provider_api.rs`
//! does). Try it: `PSP_API=http://127.0.0.1:12111 cargo run --example
//! refund_step --features postgres`. Settings: `ONCEONLY_PG_URL`,
//! `PSP_API`, `DOWNSTREAM_SECRET` (at least 16 bytes, on every instance).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use onceonly::{Delivery, Engine, HandlerError, Json, PgStore, RetryPolicy, SqlStore, Tx};
use serde_json::{Value, json};
use sqlx::Postgres;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The provider call: only a success is recorded; anything else is retried.
async fn call(api: &str, key: String, body: Value) -> Result<Value, HandlerError> {
    let request = reqwest::Client::new().post(format!("{api}/v1/refunds"));
    let request = request.header("Idempotency-Key", key).json(&body);
    let sent = request.timeout(Duration::from_secs(10)).send().await;
    let answer = sent.and_then(|r| r.error_for_status());
    let answer = answer.map_err(HandlerError::retryable)?;
    answer.json().await.map_err(HandlerError::retryable)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let url = env("ONCEONLY_PG_URL", "postgres://postgres@127.0.0.1:5432/test");
    let store = PgStore::connect(&url).await?;
    store.migrate().await?; // the dedup table and its steps table
    let refunds = "CREATE TABLE IF NOT EXISTS refunds (refund_id TEXT, provider_id TEXT)";
    sqlx::query(refunds).execute(store.pool()).await?;
    let engine = Engine::builder(store)
        .scope("refunds")
        .key_expr("json:/refund_id")
        .downstream_secret(env("DOWNSTREAM_SECRET", "example-downstream-secret"))
        .retry(RetryPolicy::default().max_attempts(3))
        .build()?;

    let api = &env("PSP_API", "http://127.0.0.1:12111");
    let fail_once = &AtomicBool::new(true);
    let refund = onceonly::handler_fn(move |tx: Tx<Postgres>, Json(r): Json<Value>| async move {
        let body = json!({ "payment": r["payment"], "amount": r["amount"] });
        let answer = tx.step("refund", |key| call(api, key, body)).await?;
        if fail_once.swap(false, Ordering::SeqCst) {
            return Err(HandlerError::retryable("connection lost before COMMIT"));
        }
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO refunds VALUES ($1, $2)")
            .bind(r["refund_id"].as_str())
            .bind(answer["id"].as_str())
            .execute(&mut *conn)
            .await?;
        Ok(())
    });
    let message = Delivery::new(r#"{"refund_id":"R-1","payment":"pi_1","amount":500}"#);
    for what in ["delivery", "redelivery"] {
        let report = engine.process_with_retry(&refund, &message).await;
        let outcome = report.outcome.kind().as_str();
        println!("{what}: {outcome} after {} attempt(s)", report.attempts);
    }
    Ok(())
}
