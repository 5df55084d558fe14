//! Replaying a dead-letter queue from code, once the cause of the failures
//! is fixed: `AmqpReplay` sends each letter of `<queue>.dlq` back where it
//! came from, and the consumer (the `amqp_consumer` example) processes it
//! like any message.
//!
//! That is safe because the consumer dedupes: a payment that was booked
//! meanwhile (its sender sent it again after the fix) is a duplicate,
//! acknowledged without booking it twice; one never booked is booked once.
//! The replay reads the dedup table too: it says what each letter will do
//! (new, duplicate, conflict), and refuses a letter older than the
//! consumer's dedup retention, whose record may be gone.
//!
//! First: `scripts/services` (PostgreSQL and RabbitMQ), and dead letters:
//! the `amqp_consumer` example dead-letters a payment its handler refused
//! (a database constraint, say) to `payments.dlq`. Try it, after fixing the
//! cause, then let the consumer book the replayed letters:
//!
//! ```text
//! cargo run --example dlq_replay --features amqp,postgres
//! EXIT_WHEN_IDLE=2 cargo run --example amqp_consumer --features amqp,postgres
//! ```
//!
//! Settings: `ONCEONLY_PG_URL`, `ONCEONLY_AMQP_URL`, `AMQP_QUEUE` (default
//! `payments`: the letters are read from `payments.dlq`).

use onceonly::ops::replay::{AmqpReplay, ReplayOptions, Screen};
use onceonly::{PgStore, SqlStore};

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init();
    // The consumer's dedup table: each letter's verdict, and the retention
    // its records are kept (a letter older than that is left in place).
    let url = env("ONCEONLY_PG_URL", "postgres://postgres@127.0.0.1:5432/test");
    let store = PgStore::connect(&url).await?;
    store.migrate().await?;
    let options = ReplayOptions::new()
        .reason("handler_error") // the failures that were fixed
        .screen(Screen::new().lookup(store));
    let report = AmqpReplay::builder()
        .url(env(
            "ONCEONLY_AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f",
        ))
        .queue(format!("{}.dlq", env("AMQP_QUEUE", "payments")))
        .options(options)
        .build()?
        .run()
        .await?;
    let v = report.verdicts;
    println!(
        "replayed {} of {} dead letters ({} new, {} duplicates, {} conflicts), \
         {} left in place, {} refused as older than the retention, {} failed",
        report.replayed,
        report.scanned,
        v.new,
        v.duplicates,
        v.conflicts,
        report.skipped,
        report.refused,
        report.failed
    );
    if !report.is_success() {
        return Err(format!("{} dead letters could not be replayed", report.failed).into());
    }
    Ok(())
}
