//! A Kafka consumer that books each payment in a ledger table exactly once
//! per `out_trade_no`, however often Kafka delivers it.
//!
//! A record is JSON `{"out_trade_no": "T-1", "amount": 500}`. For each one,
//! onceonly claims its `out_trade_no` and the handler inserts the ledger
//! row in the same PostgreSQL transaction; the offset is committed after
//! that transaction. A redelivered record finds its key claimed and is
//! skipped; one that cannot be processed goes to `<topic>.dlt`. Runs until
//! Ctrl-C or SIGTERM, or with `EXIT_WHEN_IDLE=<secs>` until idle that long.
//!
//! First: `scripts/services` (PostgreSQL and a Kafka broker), then
//! `scripts/kafka-topic payments 3` and `scripts/kafka-topic payments.dlt`.
//! Try it: send one record twice, and find one row.
//!
//! ```text
//! cargo run --example kafka_consumer --features kafka,postgres
//! echo '{"out_trade_no":"T-1","amount":500}' | kcat -P -b 127.0.0.1:9092 -t payments
//! echo '{"out_trade_no":"T-1","amount":500}' | kcat -P -b 127.0.0.1:9092 -t payments
//! psql postgres://postgres@127.0.0.1:5432/test -c 'SELECT * FROM payments_ledger'
//! ```
//!
//! Settings: `ONCEONLY_PG_URL`, `ONCEONLY_KAFKA_BROKERS`, `KAFKA_TOPIC`
//! (default `payments`; the consumer group is `<topic>-ledger`).

use std::time::Duration;

use onceonly::kafka::KafkaConsumer;
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

    let topic = env("KAFKA_TOPIC", "payments");
    let mut consumer =
        KafkaConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
            .brokers(env("ONCEONLY_KAFKA_BROKERS", "127.0.0.1:9092"))
            .group_id(format!("{topic}-ledger"))
            .topic(&topic);
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
