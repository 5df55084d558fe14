//! A Kafka consumer that credits a Postgres ledger exactly once per
//! `out_trade_no`, however often Kafka redelivers.
//!
//! A demo application of the integration tests, which run it as a child
//! process: many options in one program, every one of them tested. For
//! one small example per use, see `examples/` at the repository root.
//!
//! Each record is JSON `{"out_trade_no": string, "account": string,
//! "amount": integer}`. In one transaction per record (or per batch with
//! `--batch-size`), onceonly claims the `out_trade_no`, the handler inserts a
//! `ledger` row and adds the amount to `accounts`, and only after the commit
//! is the offset committed. Records that cannot be processed go to the
//! dead-letter topic with the reason in `x-onceonly-*` headers.
//!
//! With `--settled-topic TOPIC` (or `SETTLED_TOPIC`), each processed
//! payment also enqueues, in the same transaction, a JSON message
//! `{"out_trade_no", "account", "amount", "balance"}` keyed by account in
//! the transactional outbox (`onceonly::outbox`, table `onceonly_outbox`);
//! a relay running in the same process publishes it to TOPIC once the
//! transaction committed. A crash may publish a message again, always with
//! the same `x-onceonly-message-id` header: downstream consumers dedupe on
//! it (`key_expr("header:x-onceonly-message-id")`). With
//! `--exit-when-idle`, the process waits for the outbox to be drained
//! before it exits.
//!
//! ```text
//! scripts/services                       # Postgres and a Kafka broker (tansu)
//! scripts/kafka-topic payments 3
//! scripts/kafka-topic payments.dlt 1
//! cargo run --example kafka_payments --features kafka,postgres -- --help
//! cargo run --example kafka_payments --features kafka,postgres -- --exit-when-idle 10
//! scripts/kafka-topic payments.settled 3
//! cargo run --example kafka_payments --features kafka,postgres -- --settled-topic payments.settled
//! ```
//!
//! `--metrics-addr 127.0.0.1:9464` (or `ONCEONLY_METRICS_ADDR`) serves
//! Prometheus metrics (see `onceonly::telemetry`) at that address.

use std::time::Duration;

use clap::Parser;
use onceonly::kafka::{GroupProtocol, KafkaConsumer};
use onceonly::outbox::{KafkaPublisher, Outbox, Relay};
use onceonly::{RetryPolicy, SqlStore};
use onceonly_integration_tests::demo::{
    ledger, metrics as metrics_endpoint, relay as relay_support, tracing_setup,
};
use sqlx::Postgres;

/// Consume payment records from Kafka into a Postgres ledger, exactly once per out_trade_no.
#[derive(Parser, Debug)]
#[command(
    version,
    after_help = "Example:\n  kafka_payments --topic payments --group payments-ledger --batch-size 100 --exit-when-idle 10"
)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Topic to consume.
    #[arg(long, env = "KAFKA_TOPIC", default_value = "payments")]
    topic: String,
    /// Consumer group; also the dedup scope.
    #[arg(long, env = "KAFKA_GROUP", default_value = "payments-ledger")]
    group: String,
    /// Postgres URL (ledger, accounts and the dedup table live there).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1/test"
    )]
    database_url: String,
    /// Where records that cannot be processed go.
    #[arg(long, env = "DEAD_LETTER_TOPIC", default_value = "payments.dlt")]
    dead_letter_topic: String,
    /// Records per transaction (1 = one transaction per record).
    #[arg(long, env = "BATCH_SIZE", default_value_t = 1)]
    batch_size: usize,
    /// Records of one partition in flight at once, by record key (1 = strict partition order).
    #[arg(long, env = "KEY_CONCURRENCY", default_value_t = 1)]
    key_concurrency: usize,
    /// Consumer session timeout: how long the group waits for a member that died
    /// before giving its partitions to the others.
    #[arg(long, env = "KAFKA_SESSION_TIMEOUT_MS", default_value_t = 10_000)]
    session_timeout_ms: u64,
    /// The consumer group protocol: `classic`, or `consumer` (KIP-848: the
    /// broker assigns partitions and owns the session timeout, so
    /// --session-timeout-ms is not used).
    #[arg(long, env = "KAFKA_GROUP_PROTOCOL", default_value = "classic", value_parser = ["classic", "consumer"])]
    group_protocol: String,
    /// Exit 0 once the assignment is drained and nothing arrived for SECS seconds.
    #[arg(long, env = "EXIT_WHEN_IDLE", value_name = "SECS")]
    exit_when_idle: Option<u64>,
    /// Announce each processed payment on this topic, through the transactional
    /// outbox and an in-process relay (off when not given).
    #[arg(long, env = "SETTLED_TOPIC", value_name = "TOPIC")]
    settled_topic: Option<String>,
    #[command(flatten)]
    metrics: metrics_endpoint::MetricsArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Logs, and OTLP traces with OTEL_EXPORTER_OTLP_ENDPOINT set.
    let _tracing = tracing_setup::init("kafka_payments");
    let args = Args::parse();
    args.metrics.install()?;

    let store = ledger::postgres::open(&args.database_url).await?;
    let pool = store.pool().clone();
    let outbox = Outbox::<Postgres>::new();
    if args.settled_topic.is_some() {
        outbox.migrate(&pool).await?;
    }

    let mut builder = KafkaConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/out_trade_no")
            .retry(
                RetryPolicy::default()
                    .max_attempts(3)
                    .initial_delay(Duration::from_millis(50)),
            ),
    )
    .brokers(&args.brokers)
    .group_id(&args.group)
    .topic(&args.topic)
    .dead_letter_topic(&args.dead_letter_topic)
    .batch_size(args.batch_size)
    .key_concurrency(args.key_concurrency);
    builder = if args.group_protocol == "consumer" {
        builder.group_protocol(GroupProtocol::Consumer)
    } else {
        builder.consumer_config("session.timeout.ms", args.session_timeout_ms.to_string())
    };
    if let Some(secs) = args.exit_when_idle {
        builder = builder.exit_when_idle(Duration::from_secs(secs));
    }
    let consumer = builder.build()?;
    let Some(topic) = args.settled_topic else {
        consumer.run(ledger::postgres::Ledger).await?;
        return Ok(());
    };

    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(KafkaPublisher::new(&args.brokers)?)
        .build()?
        .spawn();
    let handler = ledger::postgres::SettlingLedger {
        outbox: outbox.clone(),
        to: ledger::postgres::SettledTo::Kafka(topic),
    };
    let result = consumer.run(handler).await;
    if result.is_ok() && args.exit_when_idle.is_some() {
        // Exit only once every committed message has left.
        relay_support::drain(&outbox, &pool, Duration::from_secs(60)).await?;
    }
    let stats = relay.stop().await;
    eprintln!("outbox relay: {stats:?}");
    result?;
    Ok(())
}
