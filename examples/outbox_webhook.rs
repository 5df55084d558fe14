//! A webhook sent once a payment is booked, through the transactional
//! outbox: the handler enqueues the notification in its own transaction,
//! and a relay POSTs it to the merchant's URL once that transaction
//! committed; never for a payment rolled back, never for a duplicate.
//!
//! Here a payment and its redelivery go through the engine: one ledger row,
//! one notification, signed as Standard Webhooks (`webhook-id`, `-timestamp`,
//! `-signature`). The relay retries until a 2xx, each copy with the same
//! `webhook-id` for the receiver to dedupe on. Exits once all is delivered.
//!
//! First: `scripts/services` (PostgreSQL), and a receiver at `NOTIFY_URL`
//! (yours, or a request bin). Try it, and find one POST there:
//!
//! ```text
//! NOTIFY_URL=https://webhook.site/<id> cargo run --example outbox_webhook --features webhook,postgres
//! ```
//!
//! Settings: `ONCEONLY_PG_URL`, `NOTIFY_URL`, `NOTIFY_SECRET` (`whsec_<base64>`).

use onceonly::outbox::{Outbox, OutboxMessage, Relay, Status, WebhookPublisher};
use onceonly::{Delivery, Engine, HandlerError, Json, PgStore, SqlStore, Tx, handler_fn};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Payment {
    out_trade_no: String,
    amount: i64,
}

const SECRET: &str = "whsec_b25jZW9ubHktZXhhbXBsZS1ub3RpZnktc2VjcmV0IQ";

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let url = env("ONCEONLY_PG_URL", "postgres://postgres@127.0.0.1:5432/test");
    let store = PgStore::connect(&url).await?;
    store.migrate().await?; // the dedup table, onceonly_keys
    let pool = store.pool().clone();
    let ledger = "CREATE TABLE IF NOT EXISTS payments_ledger (out_trade_no TEXT, amount BIGINT)";
    sqlx::query(ledger).execute(&pool).await?;
    let outbox = Outbox::<Postgres>::new(); // table onceonly_outbox
    outbox.migrate(&pool).await?;

    let engine = Engine::builder(store)
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .build()?;
    let (outbox, url) = (&outbox, &env("NOTIFY_URL", "http://127.0.0.1:8080/notify"));
    let book = handler_fn(move |tx: Tx<Postgres>, Json(p): Json<Payment>| async move {
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO payments_ledger VALUES ($1, $2)")
            .bind(&p.out_trade_no)
            .bind(p.amount)
            .execute(&mut *conn)
            .await?;
        let settled = serde_json::json!({ "settled": p.out_trade_no, "amount": p.amount });
        let message = OutboxMessage::webhook(url, settled.to_string());
        outbox.enqueue(&mut conn, message).await?;
        Ok::<_, HandlerError>(()) // the notification commits with the row, or not at all
    });
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(WebhookPublisher::new(env("NOTIFY_SECRET", SECRET))?)
        .build()?
        .spawn();

    let payment = Delivery::new(r#"{"out_trade_no":"T-1","amount":500}"#);
    for what in ["delivery", "redelivery"] {
        let report = engine.process(&book, &payment).await;
        println!("{what}: {}", report.outcome.kind().as_str());
    }
    while outbox.stats(&pool).await?.rows(Status::Pending) > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    println!("relay: {:?}", relay.stop().await);
    Ok(())
}
