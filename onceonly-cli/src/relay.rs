//! `onceonly relay`: the outbox relay as a process of its own.

use std::time::Duration;

use onceonly::outbox::{OutboxBackend, Relay, RelayBuilder, RelayStats};

use crate::db::with_store;
use crate::{CliResult, DbArgs, out};

/// Publish committed outbox rows until SIGINT or SIGTERM.
///
/// Serves the kinds of destination it is given a publisher for
/// (`--kafka-brokers`, `--amqp-url`, `--webhook-secret`); run several for
/// throughput or availability: they share the work and keep the order of
/// each key.
#[derive(clap::Args, Debug)]
pub struct RelayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The outbox table (`table` or `schema.table`).
    #[arg(long, env = "ONCEONLY_OUTBOX_TABLE", default_value = onceonly::outbox::DEFAULT_OUTBOX_TABLE)]
    outbox_table: String,
    /// Kafka bootstrap servers: publish `kafka` rows (idempotent producer, acks=all).
    #[cfg(feature = "kafka")]
    #[arg(long, env = "ONCEONLY_KAFKA_BROKERS")]
    kafka_brokers: Option<String>,
    /// librdkafka setting of the producer, KEY=VALUE (repeatable), e.g.
    /// `-X security.protocol=sasl_ssl -X sasl.mechanism=SCRAM-SHA-512`.
    #[cfg(feature = "kafka")]
    #[arg(short = 'X', value_name = "KEY=VALUE", value_parser = crate::parse_pair, requires = "kafka_brokers")]
    kafka_config: Vec<(String, String)>,
    /// AMQP broker URL: publish `amqp` rows (publisher confirms, mandatory).
    #[cfg(feature = "amqp")]
    #[arg(long, env = "ONCEONLY_AMQP_URL", hide_env_values = true)]
    amqp_url: Option<String>,
    #[cfg(feature = "amqp")]
    #[command(flatten)]
    amqp_tls: crate::AmqpTlsArgs,
    /// HMAC secret: POST `webhook` rows, signed as Standard Webhooks
    /// (`webhook-id`, `webhook-timestamp`, `webhook-signature`; a
    /// `whsec_<base64>` secret is its decoded key).
    #[cfg(feature = "webhook")]
    #[arg(long, env = "ONCEONLY_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: Option<String>,
    /// Sign webhooks in onceonly's own format instead (header
    /// x-onceonly-signature: `t=<unix>,v1=<hex>`), for receivers set up
    /// before Standard Webhooks.
    #[cfg(feature = "webhook")]
    #[arg(long, env = "ONCEONLY_WEBHOOK_ONCEONLY_SIGNATURE")]
    webhook_onceonly_signature: bool,
    /// Rows per round.
    #[arg(long, default_value_t = 100)]
    batch: u32,
    /// How long an idle relay waits before looking again (PostgreSQL also
    /// wakes it on commit), e.g. `1s`.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    poll_interval: Duration,
    /// Failed attempts before a row is parked as dead.
    #[arg(long, default_value_t = 12)]
    max_attempts: u32,
    /// How long sent rows are kept before the relay purges them, e.g. `24h`.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    keep_sent: Duration,
}

pub async fn run(args: RelayArgs) -> CliResult {
    let db = args.db.open().await?;
    let stats = with_store!(db, |store| {
        use onceonly::SqlStore as _;
        relay_on(store.pool().clone(), &args).await?
    });
    out!(
        "relay stopped: {} published, {} failed attempts, {} parked as dead, {} sent rows purged",
        stats.published,
        stats.failed,
        stats.dead,
        stats.purged
    );
    Ok(())
}

async fn relay_on<DB: crate::outbox::OutboxLayout>(
    pool: sqlx::Pool<DB>,
    args: &RelayArgs,
) -> CliResult<RelayStats> {
    // The table's own layout (plain or generations).
    let outbox = crate::outbox::outbox_for(&pool, &args.outbox_table).await?;
    let builder = publishers(Relay::builder(pool, outbox), args)?;
    let relay = builder
        .batch(args.batch)
        .poll_interval(args.poll_interval)
        .max_attempts(args.max_attempts)
        .keep_sent(Some(args.keep_sent))
        .build()
        .map_err(|e| format!("{e}: give --kafka-brokers, --amqp-url or --webhook-secret"))?;
    tracing::info!(table = %args.outbox_table, "outbox relay running");
    Ok(relay.run_until(shutdown_signal()).await)
}

/// Adds a publisher for each destination kind configured.
fn publishers<DB: OutboxBackend>(
    builder: RelayBuilder<DB>,
    args: &RelayArgs,
) -> CliResult<RelayBuilder<DB>> {
    #[allow(unused_mut)]
    let mut builder = builder;
    #[cfg(feature = "kafka")]
    if let Some(brokers) = &args.kafka_brokers {
        let mut config = rdkafka::ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        for (key, value) in &args.kafka_config {
            config.set(key, value);
        }
        builder = builder.publisher(onceonly::outbox::KafkaPublisher::with_config(&config)?);
    }
    #[cfg(feature = "amqp")]
    if let Some(url) = &args.amqp_url {
        builder = builder.publisher(
            onceonly::outbox::AmqpPublisher::new(url.clone()).with_tls(args.amqp_tls.load()?),
        );
    }
    #[cfg(feature = "webhook")]
    if let Some(secret) = &args.webhook_secret {
        let signing = if args.webhook_onceonly_signature {
            onceonly::outbox::WebhookSigning::Onceonly
        } else {
            onceonly::outbox::WebhookSigning::Standard
        };
        builder = builder.publisher(
            onceonly::outbox::WebhookPublisher::new(secret.as_bytes())?.signing(signing),
        );
    }
    let _ = args;
    Ok(builder)
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    drop(tokio::signal::ctrl_c().await);
}
