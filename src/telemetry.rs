//! Metrics and tracing: the metric names, their labels, and the one place
//! that records them.
//!
//! # Metrics
//!
//! onceonly records through the [`metrics`] facade: without a recorder
//! installed every call is a no-op, and the application picks the exporter
//! (Prometheus, StatsD, OpenTelemetry, ...). **Install the recorder before
//! building engines, consumers and layers**: their metric handles are
//! resolved once, when they are built, so that nothing is allocated per
//! delivery. Call [`describe_metrics`] for help texts. The examples expose
//! Prometheus with `--metrics-addr 127.0.0.1:9000`.
//!
//! This is the one table of onceonly's metrics; the rest of the
//! documentation links here.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `onceonly_deliveries_total` | counter | `scope`, `transport`, `outcome` | one per processing attempt, by [outcome](crate::OutcomeKind): `processed`, `duplicate`, `conflict`, `rejected`, `failed`, `stale` |
//! | `onceonly_retried_total` | counter | `scope`, `transport`, `reason` | retries scheduled after a retryable failure |
//! | `onceonly_dead_lettered_total` | counter | `scope`, `transport`, `reason` | deliveries dead-lettered (publish confirmed) |
//! | `onceonly_handler_duration_seconds` | histogram | `scope`, `transport` | time in the user's handler |
//! | `onceonly_claim_duration_seconds` | histogram | `scope`, `transport` | time from `BEGIN` to the claim's answer (new, duplicate, conflict), lock waits behind a concurrent duplicate included |
//! | `onceonly_commit_duration_seconds` | histogram | `scope`, `transport` | time of the claim transaction's `COMMIT` |
//! | `onceonly_kafka_consumer_lag` | gauge | `scope`, `topic`, `partition` | records between the committed offset and the high watermark (librdkafka statistics, every `statistics_interval`, default 5 s) |
//! | `onceonly_waiting_on_infrastructure` | gauge | `scope`, `transport` | deliveries waiting in place for the database to take writes again (see [`crate::store::InfraFault`]) |
//! | `onceonly_consumer_paused` | gauge | `scope`, `transport` | 1 while a consumer is paused because its handler keeps failing (see [`PausePolicy`](crate::PausePolicy)), 0 otherwise |
//! | `onceonly_consumer_pauses_total` | counter | `scope`, `transport` | times a consumer paused because its handler keeps failing |
//! | `onceonly_deadline_misses_total` | counter | `scope`, `transport` | handlers given up at the transaction deadline (rolled back); a key that misses it [`max_deadline_misses`](crate::EngineBuilder::max_deadline_misses) times is dead-lettered `deadline` |
//! | `onceonly_purged_total` | counter | `table` | dedup records deleted by [`Purger`](crate::ops::Purger) and [`purge_in_batches`](crate::ops::purge_in_batches) |
//! | `onceonly_purge_last_success_timestamp_seconds` | gauge | `table` | Unix time at which a [`Purger`](crate::ops::Purger) round last left no expired record behind |
//! | `onceonly_purge_failures_total` | counter | `table` | [`Purger`](crate::ops::Purger) rounds that failed (database down, no privilege) |
//! | `onceonly_generation_rotated_timestamp_seconds` | gauge | `table` | Unix time of the last rotation of a table of PostgreSQL's generations layout, read from the table by each [`Purger`](crate::ops::Purger) round (0: never rotated) |
//! | `onceonly_generation_rotation_overdue_seconds` | gauge | `table` | how long a rotation has been possible (no live record left in the other generation) without one happening, as of the last [`Purger`](crate::ops::Purger) round: 0 while the table rotates when it can |
//! | `onceonly_steps_total` | counter | `scope`, `result` | [steps](crate::Tx::step) of handlers: `called` (the call ran and its result was recorded) or `replayed` (an earlier attempt's recorded result returned without calling) |
//! | `onceonly_steps_orphaned` | gauge | `table` | finished steps whose key's transaction never committed, older than the [`Completer`](crate::ops::Completer)'s grace, as of its last round |
//! | `onceonly_outbox_backlog`, `onceonly_outbox_oldest_pending_seconds`, `onceonly_outbox_dead_rows` | gauge | `table` | pending outbox messages that are due (delayed messages are left out until they are due), the age of the oldest, dead messages (the [relay](crate::outbox::Relay) refreshes them every 5 s) |
//! | `onceonly_outbox_published_total`, `onceonly_outbox_publish_seconds` | counter, histogram | `kind` | outbox messages confirmed by their destination, and the time of each publish, confirm included (for pipelined messages: until their key's last confirm) |
//! | `onceonly_outbox_failures_total` | counter | `kind`, `destination`, `permanent` | failed outbox publishes |
//! | `onceonly_outbox_destination_wait_seconds` | histogram | `kind` | how long a relayed webhook waited for a place among its URL's [`max_in_flight_per_destination`](crate::outbox::RelayBuilder::max_in_flight_per_destination) (not part of `onceonly_outbox_publish_seconds`): a URL whose webhooks wait long is at its bound |
//!
//! Histograms: exporters that need bucket bounds get good ones for every
//! onceonly duration from [`DURATION_BUCKETS`] (1 ms to 30 s). With
//! `metrics-exporter-prometheus`, set them
//! (`PrometheusBuilder::new().set_buckets(onceonly::telemetry::DURATION_BUCKETS)?`,
//! as the examples do): without them it renders summaries, which
//! `histogram_quantile()` and the dashboard's latency panels cannot use.
//!
//! `transport` is `kafka`, `amqp`, `http`, or `engine` when an
//! [`Engine`](crate::Engine) is driven directly (see
//! [`EngineBuilder::transport`](crate::EngineBuilder::transport)). `reason`
//! is a dead-letter reason code ([`Outcome::reason`](crate::Outcome::reason)):
//! `fingerprint_mismatch`, `bad_key`, `decode_error`, `handler_error`,
//! `store_error`, `crashed`, `deadline`.
//!
//! One scheme, one counter: a delivery retried twice and then processed
//! counts `failed` twice and `processed` once, and `retried` twice.
//! Duplicates are counted apart from errors (`outcome="duplicate"`) and
//! logged at `debug` only. Over HTTP, a request whose key is still being
//! processed by another request (409) also counts as `duplicate`, and a
//! handler's 4xx that is not stored counts as `rejected`; requests that
//! bypass the layer (another method, or no key where the key is optional)
//! are not counted.
//!
//! Alerting rules and a Grafana dashboard built on these metrics ship in
//! `deploy/` (see [`crate::ops`]).
//!
//! # Tracing
//!
//! Each delivery runs in a span named `onceonly.delivery` (at
//! `INFO`) with the fields `scope`, `transport`, `source`, `key` and, once
//! known, `outcome`, and, for OpenTelemetry exporters, `otel.kind`
//! (`consumer` on brokers, `server` over HTTP) and on brokers the
//! messaging conventions `messaging.system` (`kafka`, `rabbitmq`),
//! `messaging.operation.type` (`process`), `messaging.destination.name`
//! (the topic or queue) and `messaging.message.id` (an outbox message's
//! id). With feature `otel` the span is a child of the trace context the
//! message or request carries, and what it sends on carries its own
//! context (see [`crate::ops`], "Tracing"). The handler runs inside it, so its own events carry
//! those fields, and so do onceonly's own events about the delivery (a
//! store error, the cache tier's warnings). Keys can be personal data: the
//! `key` field is shown as
//! [`EngineBuilder::key_redaction`](crate::EngineBuilder::key_redaction)
//! says, e.g. `hmac:` and 16 hex digits of a keyed hash (see
//! [`KeyRedaction`](crate::KeyRedaction)). Errors name no key: the span says which it was.

/// Counter of processing attempts by outcome.
pub const DELIVERIES_TOTAL: &str = "onceonly_deliveries_total";
/// Counter of retries scheduled, by reason.
pub const RETRIED_TOTAL: &str = "onceonly_retried_total";
/// Counter of deliveries dead-lettered, by reason.
pub const DEAD_LETTERED_TOTAL: &str = "onceonly_dead_lettered_total";
/// Histogram of handler run times, in seconds.
pub const HANDLER_DURATION_SECONDS: &str = "onceonly_handler_duration_seconds";
/// Histogram of claim times (from `BEGIN` to the claim's answer), in seconds.
pub const CLAIM_DURATION_SECONDS: &str = "onceonly_claim_duration_seconds";
/// Histogram of claim-transaction commit times, in seconds.
pub const COMMIT_DURATION_SECONDS: &str = "onceonly_commit_duration_seconds";
/// Gauge of Kafka consumer lag per topic and partition, in records.
pub const KAFKA_CONSUMER_LAG: &str = "onceonly_kafka_consumer_lag";

/// Gauge of deliveries waiting in place for the infrastructure.
pub const WAITING_ON_INFRASTRUCTURE: &str = "onceonly_waiting_on_infrastructure";

/// Gauge: 1 while a consumer is paused because its handler keeps failing.
pub const CONSUMER_PAUSED: &str = "onceonly_consumer_paused";
/// Counter of the pauses of consumers whose handler kept failing.
pub const CONSUMER_PAUSES_TOTAL: &str = "onceonly_consumer_pauses_total";

/// Counter of handlers given up at the transaction deadline.
pub const DEADLINE_MISSES_TOTAL: &str = "onceonly_deadline_misses_total";

/// Gauge: Unix time (seconds) of the last rotation of a table of the
/// generations layout, by table.
pub const GENERATION_ROTATED: &str = "onceonly_generation_rotated_timestamp_seconds";
/// Gauge: seconds a rotation of a table of the generations layout has been
/// possible without happening (starved by long claim transactions), by
/// table.
pub const GENERATION_ROTATION_OVERDUE: &str = "onceonly_generation_rotation_overdue_seconds";

/// Counter of dedup records deleted by purges, by table.
pub const PURGED_TOTAL: &str = "onceonly_purged_total";
/// Gauge: Unix time (seconds) of the last [`Purger`](crate::ops::Purger)
/// round that left no expired record behind, by table.
pub const PURGE_LAST_SUCCESS: &str = "onceonly_purge_last_success_timestamp_seconds";
/// Counter of failed [`Purger`](crate::ops::Purger) rounds, by table.
pub const PURGE_FAILURES_TOTAL: &str = "onceonly_purge_failures_total";

/// Bucket bounds, in seconds, for onceonly's duration histograms (claim,
/// commit, handler, outbox publish), from 1 ms to 30 s: e.g.
/// `PrometheusBuilder::set_buckets(DURATION_BUCKETS)` with
/// `metrics-exporter-prometheus`, which otherwise renders histograms as
/// summaries that cannot be aggregated across processes.
pub const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Label: the dedup table (`schema.table`).
pub(crate) const LABEL_TABLE: &str = "table";
/// Label: the dedup scope.
pub(crate) const LABEL_SCOPE: &str = "scope";
/// Label: the transport (`kafka`, `amqp`, `http`, `engine`).
pub(crate) const LABEL_TRANSPORT: &str = "transport";
/// Counter of handler steps, by result (`called`, `replayed`).
pub const STEPS_TOTAL: &str = "onceonly_steps_total";
/// Gauge of finished steps whose key never committed.
pub const STEPS_ORPHANED: &str = "onceonly_steps_orphaned";
/// Label: what became of a step (`called`, `replayed`).
pub(crate) const LABEL_RESULT: &str = "result";
/// Label: the outcome (see [`OutcomeKind::as_str`](crate::OutcomeKind::as_str)).
pub(crate) const LABEL_OUTCOME: &str = "outcome";
/// Label: a dead-letter or retry reason code.
pub(crate) const LABEL_REASON: &str = "reason";
/// Label: a Kafka topic.
#[cfg(feature = "kafka")]
pub(crate) const LABEL_TOPIC: &str = "topic";
/// Label: a Kafka partition number.
#[cfg(feature = "kafka")]
pub(crate) const LABEL_PARTITION: &str = "partition";

/// The transport label of an engine driven directly.
pub(crate) const TRANSPORT_ENGINE: &str = "engine";
/// The transport label of the Kafka consumer.
pub(crate) const TRANSPORT_KAFKA: &str = "kafka";
/// The transport label of the AMQP consumer.
pub(crate) const TRANSPORT_AMQP: &str = "amqp";
/// The transport label of the HTTP layer.
pub(crate) const TRANSPORT_HTTP: &str = "http";

/// Registers units and descriptions of every onceonly metric with the
/// installed recorder (exporters show them as `# HELP`). Optional; call it
/// once after installing the recorder.
pub fn describe_metrics() {
    use metrics::Unit;
    metrics::describe_counter!(
        DELIVERIES_TOTAL,
        Unit::Count,
        "Processing attempts by outcome: processed, duplicate, conflict, rejected, failed, stale"
    );
    metrics::describe_counter!(
        RETRIED_TOTAL,
        Unit::Count,
        "Retries scheduled after a retryable failure, by reason"
    );
    metrics::describe_counter!(
        DEAD_LETTERED_TOTAL,
        Unit::Count,
        "Deliveries dead-lettered (publish confirmed), by reason"
    );
    metrics::describe_histogram!(
        HANDLER_DURATION_SECONDS,
        Unit::Seconds,
        "Time spent in the user's handler"
    );
    metrics::describe_histogram!(
        CLAIM_DURATION_SECONDS,
        Unit::Seconds,
        "Time from BEGIN to the claim's answer (new, duplicate, conflict)"
    );
    metrics::describe_histogram!(
        COMMIT_DURATION_SECONDS,
        Unit::Seconds,
        "Time of the claim transaction's commit"
    );
    metrics::describe_counter!(
        PURGED_TOTAL,
        Unit::Count,
        "Dedup records deleted by purges (Purger, purge_in_batches), by table"
    );
    metrics::describe_gauge!(
        PURGE_LAST_SUCCESS,
        Unit::Seconds,
        "Unix time of the last purger round that left no expired record behind"
    );
    metrics::describe_counter!(
        PURGE_FAILURES_TOTAL,
        Unit::Count,
        "Purger rounds that failed"
    );
    metrics::describe_counter!(
        DEADLINE_MISSES_TOTAL,
        Unit::Count,
        "Handlers given up at the transaction deadline (rolled back)"
    );
    metrics::describe_gauge!(
        GENERATION_ROTATED,
        Unit::Seconds,
        "Unix time of the last rotation of a generations-layout dedup table (0: never)"
    );
    metrics::describe_gauge!(
        GENERATION_ROTATION_OVERDUE,
        Unit::Seconds,
        "Seconds a rotation of a generations-layout dedup table has been possible without happening"
    );
    metrics::describe_gauge!(
        WAITING_ON_INFRASTRUCTURE,
        Unit::Count,
        "Deliveries waiting in place until the database takes writes again"
    );
    metrics::describe_gauge!(
        CONSUMER_PAUSED,
        Unit::Count,
        "1 while a consumer is paused because its handler keeps failing"
    );
    metrics::describe_counter!(
        CONSUMER_PAUSES_TOTAL,
        Unit::Count,
        "Times a consumer paused because its handler keeps failing"
    );
    metrics::describe_counter!(
        STEPS_TOTAL,
        Unit::Count,
        "Handler steps: called (and recorded) or replayed from an earlier attempt's record"
    );
    metrics::describe_gauge!(
        STEPS_ORPHANED,
        Unit::Count,
        "Finished steps whose key's transaction never committed, past the completer's grace"
    );
    metrics::describe_gauge!(
        KAFKA_CONSUMER_LAG,
        Unit::Count,
        "Records between the committed offset and the high watermark"
    );
}

/// Counts `n` records purged from `table`.
pub(crate) fn purged(table: &crate::store::TableName, n: u64) {
    if n > 0 {
        metrics::counter!(PURGED_TOTAL, LABEL_TABLE => table.to_string()).increment(n);
    }
}

/// A [`Purger`](crate::ops::Purger) round on `table` left no expired record
/// behind, at `now_ms`.
pub(crate) fn purge_caught_up(table: &crate::store::TableName, now_ms: i64) {
    #[allow(clippy::cast_precision_loss)]
    let seconds = now_ms as f64 / 1000.0;
    metrics::gauge!(PURGE_LAST_SUCCESS, LABEL_TABLE => table.to_string()).set(seconds);
}

/// What a [`Purger`](crate::ops::Purger) round read of the rotations of
/// `table` (generations layout) at `now_ms`.
pub(crate) fn rotations(
    table: &crate::store::TableName,
    state: &crate::store::Rotations,
    now_ms: i64,
) {
    #[allow(clippy::cast_precision_loss)]
    let seconds = |ms: i64| ms as f64 / 1000.0;
    metrics::gauge!(GENERATION_ROTATED, LABEL_TABLE => table.to_string())
        .set(seconds(state.rotated_at_ms));
    let overdue = state
        .possible_since_ms
        .map_or(0, |since| now_ms.saturating_sub(since).max(0));
    metrics::gauge!(GENERATION_ROTATION_OVERDUE, LABEL_TABLE => table.to_string())
        .set(seconds(overdue));
}

/// A step of a handler in `scope` ran its call and recorded the result.
pub(crate) fn step_called(scope: &str) {
    metrics::counter!(STEPS_TOTAL, LABEL_SCOPE => scope.to_owned(), LABEL_RESULT => "called")
        .increment(1);
}

/// A step of a handler in `scope` returned an earlier attempt's result.
pub(crate) fn step_replayed(scope: &str) {
    metrics::counter!(STEPS_TOTAL, LABEL_SCOPE => scope.to_owned(), LABEL_RESULT => "replayed")
        .increment(1);
}

/// A [`Completer`](crate::ops::Completer) round found `n` orphaned steps
/// in `table`.
pub(crate) fn steps_orphaned(table: &crate::store::TableName, n: usize) {
    #[allow(clippy::cast_precision_loss)]
    metrics::gauge!(STEPS_ORPHANED, LABEL_TABLE => table.to_string()).set(n as f64);
}

/// A [`Purger`](crate::ops::Purger) round on `table` failed.
pub(crate) fn purge_failed(table: &crate::store::TableName) {
    metrics::counter!(PURGE_FAILURES_TOTAL, LABEL_TABLE => table.to_string()).increment(1);
}
