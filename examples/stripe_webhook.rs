//! A Stripe webhook endpoint that books each succeeded payment once, however
//! often Stripe sends its event.
//!
//! `IdempotencyLayer::provider` checks the `Stripe-Signature` header (an
//! HMAC of the timestamp and the raw body, at most 5 minutes old), claims
//! the event's `id` in the same PostgreSQL transaction as the handler's
//! ledger row, and answers `{"received":true}`: to a repeated event too,
//! without running the handler again. A forged or stale event gets 401.
//! The handler books `payment_intent.succeeded` (with or without a
//! customer) and acknowledges every other event type. Runs until Ctrl-C.
//!
//! First: `scripts/services` (PostgreSQL), and the endpoint's signing
//! secret: `stripe listen --forward-to localhost:3000/webhooks/stripe`
//! prints one (`whsec_...`). Try it: trigger an event, resend it from the
//! dashboard, and find one row:
//!
//! ```text
//! STRIPE_WEBHOOK_SECRET=whsec_... cargo run --example stripe_webhook --features providers,postgres
//! stripe trigger payment_intent.succeeded
//! psql postgres://postgres@127.0.0.1:5432/test -c 'SELECT * FROM payments_ledger'
//! ```
//!
//! Settings: `ONCEONLY_PG_URL`, `STRIPE_WEBHOOK_SECRET`, `LISTEN` (`127.0.0.1:3000`).

use axum::{Router, body::Bytes, http::StatusCode, routing::post};
use onceonly::http::{IdempotencyLayer, providers::Stripe};
use onceonly::{PgStore, SqlStore, Tx};
use sqlx::Postgres;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Runs once per event id, inside the claim's transaction; any 2xx
/// becomes Stripe's success answer.
async fn event(tx: Tx<Postgres>, body: Bytes) -> Result<StatusCode, StatusCode> {
    let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if event["type"] != "payment_intent.succeeded" {
        return Ok(StatusCode::OK); // nothing to book
    }
    let intent = &event["data"]["object"];
    let (Some(id), Some(amount)) = (intent["id"].as_str(), intent["amount"].as_i64()) else {
        tracing::error!(%event, "not booked: no id or amount"); // a retry would not read better
        return Ok(StatusCode::OK);
    };
    let mut conn = tx.lock().await.map_err(internal)?;
    sqlx::query("INSERT INTO payments_ledger VALUES ($1, $2)")
        .bind(id)
        .bind(amount)
        .execute(&mut *conn)
        .await
        .map_err(internal)?;
    Ok(StatusCode::OK)
}

fn internal(e: impl std::fmt::Display) -> StatusCode {
    tracing::error!("{e}");
    StatusCode::INTERNAL_SERVER_ERROR // rolled back; Stripe retries
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let url = env("ONCEONLY_PG_URL", "postgres://postgres@127.0.0.1:5432/test");
    let store = PgStore::connect(&url).await?;
    store.migrate().await?; // the dedup table, onceonly_keys
    let ledger = "CREATE TABLE IF NOT EXISTS payments_ledger (out_trade_no TEXT, amount BIGINT)";
    sqlx::query(ledger).execute(store.pool()).await?;

    let secret = std::env::var("STRIPE_WEBHOOK_SECRET").map_err(|_| "set STRIPE_WEBHOOK_SECRET")?;
    let stripe = IdempotencyLayer::provider(store, "stripe", Stripe::new(secret)?).build()?;
    let app = Router::new().route("/webhooks/stripe", post(event).layer(stripe));
    let listener = tokio::net::TcpListener::bind(env("LISTEN", "127.0.0.1:3000")).await?;
    let addr = listener.local_addr()?;
    eprintln!("listening on http://{addr}/webhooks/stripe");
    let ctrl_c = async { drop(tokio::signal::ctrl_c().await) };
    let server = axum::serve(listener, app);
    server.with_graceful_shutdown(ctrl_c).await?;
    Ok(())
}
