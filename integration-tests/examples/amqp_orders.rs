//! A RabbitMQ consumer that credits a Postgres ledger exactly once per
//! `out_trade_no`, however often the broker redelivers.
//!
//! A demo application of the integration tests, which run it as a child
//! process: many options in one program, every one of them tested. For
//! one small example per use, see `examples/` at the repository root.
//!
//! Messages are the Kafka example's JSON payments (`out_trade_no`,
//! `account`, `amount`), keyed on `/out_trade_no`, written to the same
//! `ledger` / `accounts` tables by the same code. A message is acked only
//! after its transaction committed (or it was a duplicate, or its retry copy
//! or dead letter was confirmed). Retries wait in `<queue>.retry.<ms>ms`
//! queues; exhausted and invalid messages go to `<queue>.dlq` with
//! `x-onceonly-*` headers. Messages with `reply_to` get the receipt back.
//!
//! With `--settled-exchange EXCHANGE` (or `SETTLED_EXCHANGE`), each
//! processed payment also enqueues, in the same transaction, a JSON message
//! `{"out_trade_no", "account", "amount", "balance"}` in the transactional
//! outbox (`onceonly::outbox`, table `onceonly_outbox`); a relay running in
//! the same process publishes it to EXCHANGE (declared as a durable topic
//! exchange if missing) with the account as routing key, once the
//! transaction committed. Bind a queue to the exchange: an unroutable
//! message is retried, then parked as dead. Copies after a crash carry the
//! same `x-onceonly-message-id` header (also the AMQP `message_id`).
//!
//! ```text
//! scripts/services                       # Postgres and RabbitMQ
//! cargo run --example amqp_orders --features amqp,postgres -- --help
//! cargo run --example amqp_orders --features amqp,postgres -- --exit-when-idle 10
//! cargo run --example amqp_orders --features amqp,postgres -- --settled-exchange orders.settled
//! ```
//!
//! `--metrics-addr 127.0.0.1:9464` (or `ONCEONLY_METRICS_ADDR`) serves
//! Prometheus metrics (see `onceonly::telemetry`) at that address.

use std::time::Duration;

use clap::Parser;
use onceonly::amqp::AmqpConsumer;
use onceonly::outbox::{AmqpPublisher, Outbox, Relay};
use onceonly::{RetryPolicy, SqlStore};
use onceonly_integration_tests::demo::{
    ledger, metrics as metrics_endpoint, relay as relay_support, tracing_setup,
};
use sqlx::Postgres;

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
    /// Announce each processed payment on this exchange (routing key: the account),
    /// through the transactional outbox and an in-process relay (off when not given).
    #[arg(long, env = "SETTLED_EXCHANGE", value_name = "EXCHANGE")]
    settled_exchange: Option<String>,
    #[command(flatten)]
    metrics: metrics_endpoint::MetricsArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Logs, and OTLP traces with OTEL_EXPORTER_OTLP_ENDPOINT set.
    let _tracing = tracing_setup::init("amqp_orders");
    let args = Args::parse();
    args.metrics.install()?;

    let store = ledger::postgres::open(&args.database_url).await?;
    let pool = store.pool().clone();
    let outbox = Outbox::<Postgres>::new();
    if let Some(exchange) = &args.settled_exchange {
        outbox.migrate(&pool).await?;
        declare_exchange(&args.amqp_url, exchange).await?;
    }

    let mut builder = AmqpConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/out_trade_no")
            .retry(
                RetryPolicy::default()
                    .max_attempts(3)
                    .initial_delay(Duration::from_millis(200)),
            ),
    )
    .url(&args.amqp_url)
    .queue(&args.queue)
    .prefetch(args.prefetch)
    .concurrency(args.concurrency);
    if let Some(secs) = args.exit_when_idle {
        builder = builder.exit_when_idle(Duration::from_secs(secs));
    }
    let consumer = builder.build()?;
    let Some(exchange) = args.settled_exchange else {
        let stats = consumer.run(ledger::postgres::Ledger).await?;
        eprintln!("{stats:?}");
        return Ok(());
    };

    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(AmqpPublisher::new(&args.amqp_url))
        .build()?
        .spawn();
    let handler = ledger::postgres::SettlingLedger {
        outbox: outbox.clone(),
        to: ledger::postgres::SettledTo::Amqp(exchange),
    };
    let result = consumer.run(handler).await;
    if result.is_ok() && args.exit_when_idle.is_some() {
        // Exit only once every committed message has left.
        relay_support::drain(&outbox, &pool, Duration::from_secs(60)).await?;
    }
    let relayed = relay.stop().await;
    eprintln!("outbox relay: {relayed:?}");
    eprintln!("{:?}", result?);
    Ok(())
}

/// Declares `exchange` as a durable topic exchange (nothing happens if it
/// exists with that type; the broker refuses another type).
async fn declare_exchange(url: &str, exchange: &str) -> Result<(), lapin::Error> {
    use lapin::options::ExchangeDeclareOptions;
    use lapin::types::FieldTable;
    use lapin::{Connection, ConnectionProperties, ExchangeKind};

    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    conn.close(200, "OK".into()).await
}
