//! A RabbitMQ consumer that books each payment in a ledger table exactly
//! once per `out_trade_no`, however often the broker delivers it.
//!
//! A message is JSON `{"out_trade_no": "T-1", "amount": 500}`. For each
//! one, onceonly claims its `out_trade_no` and the handler inserts the
//! ledger row in the same PostgreSQL transaction; the message is acked
//! after that transaction. A redelivery (the consumer died before its ack,
//! the producer published twice) finds its key claimed and is acked
//! without booking; a message that cannot be processed goes to
//! `<queue>.dlq`. Runs until Ctrl-C or SIGTERM, or with
//! `EXIT_WHEN_IDLE=<secs>` until idle that long.
//!
//! First: `scripts/services` (PostgreSQL and RabbitMQ). Try it: publish one
//! message twice to the queue (with the management UI at
//! http://127.0.0.1:15672, or `rabbitmqadmin publish exchange=amq.default
//! routing_key=payments payload=...`), and find one row:
//!
//! ```text
//! cargo run --example amqp_consumer --features amqp,postgres
//! psql postgres://postgres@127.0.0.1:5432/test -c 'SELECT * FROM payments_ledger'
//! ```
//!
//! Settings: `ONCEONLY_PG_URL`, `ONCEONLY_AMQP_URL`, `AMQP_QUEUE` (default
//! `payments`, declared durable with its dead-letter queue).

use std::time::Duration;

use onceonly::amqp::AmqpConsumer;
use onceonly::{HandlerError, Json, PgStore, SqlStore, Tx, handler_fn};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Payment {
    out_trade_no: String,
    amount: i64,
}

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    let url = env("ONCEONLY_PG_URL", "postgres://postgres@127.0.0.1:5432/test");
    let store = PgStore::connect(&url).await?;
    store.migrate().await?; // the dedup table, onceonly_keys
    let ledger = "CREATE TABLE IF NOT EXISTS payments_ledger (out_trade_no TEXT, amount BIGINT)";
    sqlx::query(ledger).execute(store.pool()).await?;

    let mut consumer =
        AmqpConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
            .url(env(
                "ONCEONLY_AMQP_URL",
                "amqp://guest:guest@127.0.0.1:5672/%2f",
            ))
            .queue(env("AMQP_QUEUE", "payments"));
    if let Ok(secs) = std::env::var("EXIT_WHEN_IDLE") {
        consumer = consumer.exit_when_idle(Duration::from_secs(secs.parse()?));
    }
    // Runs inside the claim's transaction: its row commits with the claim.
    let book = handler_fn(|tx: Tx<Postgres>, Json(p): Json<Payment>| async move {
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO payments_ledger (out_trade_no, amount) VALUES ($1, $2)")
            .bind(&p.out_trade_no)
            .bind(p.amount)
            .execute(&mut *conn)
            .await?;
        Ok::<_, HandlerError>(())
    });
    let stats = consumer.build()?.run(book).await?;
    println!("stopped: {stats:?}");
    Ok(())
}
