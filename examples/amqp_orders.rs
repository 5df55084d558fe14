//! A RabbitMQ consumer that credits a Postgres ledger exactly once per
//! `out_trade_no`, however often the broker redelivers.
//!
//! Messages are the Kafka example's JSON payments (`out_trade_no`,
//! `account`, `amount`), keyed on `/out_trade_no`, written to the same
//! `ledger` / `accounts` tables by the same code. A message is acked only
//! after its transaction committed (or it was a duplicate, or its retry copy
//! or dead letter was confirmed). Retries wait in `<queue>.retry.<ms>ms`
//! queues; exhausted and invalid messages go to `<queue>.dlq` with
//! `x-onceonly-*` headers. Messages with `reply_to` get the receipt back.
//!
//! ```text
//! scripts/services                       # Postgres and RabbitMQ
//! cargo run --example amqp_orders --features amqp,postgres -- --help
//! cargo run --example amqp_orders --features amqp,postgres -- --exit-when-idle 10
//! ```
//!
//! `--metrics-addr 127.0.0.1:9464` (or `ONCEONLY_METRICS_ADDR`) serves
//! Prometheus metrics (see `onceonly::telemetry`) at that address.

#[path = "support/ledger.rs"]
mod ledger;
#[path = "support/metrics.rs"]
mod metrics_endpoint;

use std::time::Duration;

use clap::Parser;
use onceonly::RetryPolicy;
use onceonly::amqp::AmqpConsumer;

/// Consume payment messages from RabbitMQ into a Postgres ledger, exactly once per out_trade_no.
#[derive(Parser, Debug)]
#[command(
    version,
    after_help = "Example:\n  amqp_orders --queue orders --prefetch 64 --exit-when-idle 10"
)]
struct Args {
    /// Broker URL.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Work queue (declared durable; also the dedup scope).
    #[arg(long, env = "AMQP_QUEUE", default_value = "orders")]
    queue: String,
    /// Postgres URL (ledger, accounts and the dedup table live there).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1/test"
    )]
    database_url: String,
    /// Unacked messages the broker sends ahead.
    #[arg(long, env = "AMQP_PREFETCH", default_value_t = 32)]
    prefetch: u16,
    /// Messages handled at once.
    #[arg(long, env = "AMQP_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// Exit 0 once nothing arrived and nothing ran for SECS seconds.
    #[arg(long, env = "EXIT_WHEN_IDLE", value_name = "SECS")]
    exit_when_idle: Option<u64>,
    #[command(flatten)]
    metrics: metrics_endpoint::MetricsArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let args = Args::parse();
    args.metrics.install()?;

    let store = ledger::postgres::open(&args.database_url).await?;

    let mut builder = AmqpConsumer::builder(store)
        .url(&args.amqp_url)
        .queue(&args.queue)
        .key_expr("json:/out_trade_no")
        .prefetch(args.prefetch)
        .concurrency(args.concurrency)
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(200)),
        );
    if let Some(secs) = args.exit_when_idle {
        builder = builder.exit_when_idle(Duration::from_secs(secs));
    }
    let stats = builder.build()?.run(ledger::postgres::Ledger).await?;
    eprintln!("{stats:?}");
    Ok(())
}
