//! A Kafka consumer of Avro payments under a Confluent Schema Registry,
//! booking each `out_trade_no` once in a ledger table.
//!
//! Each record is in the registry's wire format (a magic byte, the writer
//! schema's id, the Avro record). The `SchemaRegistry` decoder fetches each
//! schema once by id and turns the record into the tree a JSON payload
//! parses to, so the key `json:/out_trade_no` and `Json<Payment>` read it
//! as they read JSON. The same payment re-encoded under a newer schema
//! version that adds an optional field is a duplicate, not a conflict. A
//! registry outage is waited out; an unknown schema id or a record that
//! does not match its schema is dead-lettered to `<topic>.dlt`. Runs until
//! Ctrl-C or SIGTERM, or with `EXIT_WHEN_IDLE=<secs>` until idle that long.
//!
//! First: `scripts/services` (PostgreSQL and a Kafka broker),
//! `scripts/kafka-topic payments-avro` and `scripts/kafka-topic
//! payments-avro.dlt`, a schema registry, and Avro records with a string
//! `out_trade_no` and a `decimal` (scale 2) `amount` (e.g. from
//! `kafka-avro-console-producer`). Try it:
//!
//! ```text
//! SCHEMA_REGISTRY_URL=http://127.0.0.1:8081 cargo run --example avro_consumer \
//!     --features kafka,postgres,schema-registry
//! ```
//!
//! Settings: `ONCEONLY_PG_URL`, `ONCEONLY_KAFKA_BROKERS`,
//! `SCHEMA_REGISTRY_URL`, `KAFKA_TOPIC` (default `payments-avro`).

use std::time::Duration;

use onceonly::kafka::KafkaConsumer;
use onceonly::schema_registry::SchemaRegistry;
use onceonly::{HandlerError, Json, PgStore, SqlStore, Tx, handler_fn};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Payment {
    out_trade_no: String,
    amount: String, // an Avro decimal reads as its exact text: "123.45"
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

    let registry = SchemaRegistry::builder(env("SCHEMA_REGISTRY_URL", "http://127.0.0.1:8081"));
    let topic = env("KAFKA_TOPIC", "payments-avro");
    let mut consumer = KafkaConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/out_trade_no")
            .payload_decoder(registry.build()?),
    )
    .brokers(env("ONCEONLY_KAFKA_BROKERS", "127.0.0.1:9092"))
    .group_id(format!("{topic}-ledger"))
    .topic(&topic);
    if let Ok(secs) = std::env::var("EXIT_WHEN_IDLE") {
        consumer = consumer.exit_when_idle(Duration::from_secs(secs.parse()?));
    }
    let book = handler_fn(|tx: Tx<Postgres>, Json(p): Json<Payment>| async move {
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO payments_ledger VALUES ($1, ($2::numeric * 100)::bigint)")
            .bind(&p.out_trade_no)
            .bind(&p.amount)
            .execute(&mut *conn)
            .await?;
        Ok::<_, HandlerError>(())
    });
    let stats = consumer.build()?.run(book).await?;
    println!("stopped: {stats:?}");
    Ok(())
}
