//! Metrics and traces of real deliveries: the engine on PostgreSQL, the
//! AMQP consumer on RabbitMQ, the Kafka lag gauge on Kafka, the Prometheus
//! endpoint of the `payment_webhook` example, and the delivery span.
//!
//! Its own test binary: it installs a process-wide metrics recorder. The
//! recorder reads values without resetting them (metrics-util's
//! `DebuggingRecorder` snapshots swap counters to zero, which would race
//! between tests running in parallel); each test uses its own scope, so
//! its counters are its own.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use onceonly::amqp::{AmqpConsumer, CancellationToken};
use onceonly::kafka::KafkaConsumer;
use onceonly::telemetry::{
    CLAIM_DURATION_SECONDS, COMMIT_DURATION_SECONDS, DEAD_LETTERED_TOTAL, DEADLINE_MISSES_TOTAL,
    DELIVERIES_TOTAL, GENERATION_ROTATED, GENERATION_ROTATION_OVERDUE, HANDLER_DURATION_SECONDS,
    KAFKA_CONSUMER_LAG, PURGE_FAILURES_TOTAL, PURGE_LAST_SUCCESS, PURGED_TOTAL, RETRIED_TOTAL,
};
use onceonly::{Delivery, Engine, Handler, HandlerError, Json, RetryPolicy, SqlStore};
use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish, url};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::free_port;
use onceonly_integration_tests::handler::Ledger;
use onceonly_integration_tests::kafka::{Record, committed, create_topic, pg_schema, produce};
use onceonly_integration_tests::{pay, pg_generations_store, pg_store, sqlite_store, unique};
use sqlx::Sqlite;
use tracing::span::{Attributes, Id, Record as SpanRecord};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

// ---------------------------------------------------------------- recorder

type Metrics = Registry<Key, AtomicStorage>;

struct TestRecorder(Arc<Metrics>);

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.0.get_or_create_counter(key, Arc::clone))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.0.get_or_create_gauge(key, Arc::clone))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.0.get_or_create_histogram(key, Arc::clone))
    }
}

/// The process-wide recorder, installed on first use (before any engine is
/// built: handles are resolved at build time).
fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Arc<Metrics>> = OnceLock::new();
    METRICS.get_or_init(|| {
        let registry = Arc::new(Registry::atomic());
        metrics::set_global_recorder(TestRecorder(Arc::clone(&registry)))
            .unwrap_or_else(|_| panic!("another metrics recorder is installed"));
        registry
    })
}

fn matches(key: &Key, name: &str, labels: &[(&str, &str)]) -> bool {
    key.name() == name
        && labels
            .iter()
            .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
}

/// The sum of the counters named `name` having all of `labels`.
fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    metrics()
        .get_counter_handles()
        .iter()
        .filter(|(k, _)| matches(k, name, labels))
        .map(|(_, v)| v.load(Ordering::SeqCst))
        .sum()
}

/// Samples recorded in the histograms named `name` having all of `labels`.
fn samples(name: &str, labels: &[(&str, &str)]) -> usize {
    metrics()
        .get_histogram_handles()
        .iter()
        .filter(|(k, _)| matches(k, name, labels))
        .map(|(_, h)| h.data().len())
        .sum()
}

fn gauge(name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    metrics()
        .get_gauge_handles()
        .iter()
        .find(|(k, _)| matches(k, name, labels))
        .map(|(_, g)| f64::from_bits(g.load(Ordering::SeqCst)))
}

/// The deliveries of `scope` over `transport`, by outcome.
fn outcomes(scope: &str, transport: &str) -> BTreeMap<&'static str, u64> {
    ["processed", "duplicate", "conflict", "rejected", "failed"]
        .into_iter()
        .map(|outcome| {
            let n = counter(
                DELIVERIES_TOTAL,
                &[
                    ("scope", scope),
                    ("transport", transport),
                    ("outcome", outcome),
                ],
            );
            (outcome, n)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn by_reason(name: &str, scope: &str, transport: &str) -> BTreeMap<&'static str, u64> {
    [
        "fingerprint_mismatch",
        "bad_key",
        "decode_error",
        "handler_error",
        "store_error",
    ]
    .into_iter()
    .map(|reason| {
        let labels = [
            ("scope", scope),
            ("transport", transport),
            ("reason", reason),
        ];
        (reason, counter(name, &labels))
    })
    .filter(|(_, n)| *n > 0)
    .collect()
}

// ---------------------------------------------------------------- purge

/// Purges count what they delete, by table: the background purger and the
/// one-off batched purge alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_count_deleted_records_by_table() {
    metrics();
    let url = pg_schema("mxpurge").await;
    let table = unique("mxpurge");
    let store = pg_store(&url, &table).await;
    let qualified = store.table().to_string();
    let engine = Engine::builder(store.clone())
        .scope("s")
        .key_expr("json:/out_trade_no")
        .retention(Duration::from_millis(1))
        .build()
        .unwrap();
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let h = Ledger::default();
    for i in 0..25 {
        let d = Delivery::new(pay(&format!("P-{i}"), 1).account("alice"));
        assert!(engine.process(&h, &d).await.outcome.is_done());
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let now = onceonly::Clock::now_ms(&onceonly::SystemClock);
    let options = onceonly::ops::PurgeOptions::new().batch(10);
    let progress = onceonly::ops::purge_in_batches(
        &store,
        onceonly::ops::PurgeMode::Expired,
        &options,
        now,
        |_| {},
    )
    .await
    .unwrap();
    assert_eq!(progress.deleted, 25);
    assert_eq!(counter(PURGED_TOTAL, &[("table", qualified.as_str())]), 25);

    // A Purger round that catches up says when (OnceonlyPurgeBehind reads it).
    let labels = [("table", qualified.as_str())];
    assert_eq!(gauge(PURGE_LAST_SUCCESS, &labels), None);
    let purger = onceonly::ops::Purger::builder(store.clone())
        .build()
        .unwrap();
    assert_eq!(purger.purge_once().await.unwrap(), 0);
    let caught_up = gauge(PURGE_LAST_SUCCESS, &labels).expect("last success set");
    let now_s = onceonly::Clock::now_ms(&onceonly::SystemClock) as f64 / 1000.0;
    assert!(
        (now_s - caught_up).abs() < 60.0,
        "last success {caught_up}, now {now_s}"
    );
    // A failed round counts (OnceonlyPurgeFailing), and sets no success.
    let missing = store
        .clone()
        .with_table(unique("mxmissing").as_str())
        .unwrap();
    let missing_name = missing.table().to_string();
    let failing = onceonly::ops::Purger::builder(missing).build().unwrap();
    assert!(failing.purge_once().await.is_err());
    let labels = [("table", missing_name.as_str())];
    assert_eq!(counter(PURGE_FAILURES_TOTAL, &labels), 1);
    assert_eq!(gauge(PURGE_LAST_SUCCESS, &labels), None);
}

/// A rotation of a generations table starved by a claim transaction that
/// never ends shows in the gauges: the last rotation's time stays, and the
/// time a rotation has been possible without happening grows
/// (OnceonlyRotationStarved reads it); once the transaction ends the next
/// round rotates and the gauge is back to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starved_rotation_shows_in_the_rotation_gauges() {
    metrics();
    let url = pg_schema("mxrot").await;
    let table = unique("mxrot");
    let store = pg_generations_store(&url, &table).await;
    let qualified = store.table().to_string();
    let labels = [("table", qualified.as_str())];
    let clock = onceonly::ManualClock::new(1_000);
    let purger = onceonly::ops::Purger::builder(store.clone())
        .clock(Arc::new(clock.clone()))
        .build()
        .unwrap();

    // K in generation 0, live until 1_100.
    let mut tx = store.begin().await.unwrap();
    let times = onceonly::store::raw::ClaimTimes::new(1_000, Duration::from_millis(100));
    let claim = store
        .claim(
            &mut tx,
            "s",
            times,
            &onceonly::store::raw::ClaimRequest::new("K"),
        )
        .await
        .unwrap();
    assert_eq!(claim, onceonly::store::raw::Claim::Claimed);
    store.complete(&mut tx, "s", "K", b"1").await.unwrap();
    tx.commit().await.unwrap();

    // The first round rotates (generation 1 was empty); K keeps the new
    // other generation live: nothing is overdue.
    clock.advance_ms(50);
    purger.purge_once().await.unwrap();
    assert_eq!(gauge(GENERATION_ROTATED, &labels), Some(1.05));
    assert_eq!(gauge(GENERATION_ROTATION_OVERDUE, &labels), Some(0.0));

    // K expired at 1_100, but a claim transaction stays open across every
    // attempt of the next round: the rotation is starved.
    let held = store.begin().await.unwrap();
    clock.advance_ms(3_950);
    assert!(
        purger.purge_once().await.is_err(),
        "the rotation is starved"
    );
    assert_eq!(gauge(GENERATION_ROTATED, &labels), Some(1.05));
    assert_eq!(gauge(GENERATION_ROTATION_OVERDUE, &labels), Some(3.9));

    // The transaction ends: the next round rotates.
    drop(held);
    clock.advance_ms(1_000);
    purger.purge_once().await.unwrap();
    assert_eq!(gauge(GENERATION_ROTATED, &labels), Some(6.0));
    assert_eq!(gauge(GENERATION_ROTATION_OVERDUE, &labels), Some(0.0));
}

/// Each handler given up at the transaction deadline counts; the third
/// miss of one key parks it (`Failure::Deadline`), and its counter starts
/// over for a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_missing_the_deadline_count_and_the_third_miss_parks_the_key() {
    metrics();
    let url = pg_schema("mxdl").await;
    let store = pg_store(&url, "onceonly_keys")
        .await
        .deadlines(onceonly::store::Deadlines::default().transaction(Duration::from_millis(200)));
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let scope = unique("mxdl");
    let engine = Engine::builder(store.clone())
        .scope(scope.as_str())
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    let h = Ledger::default();
    let slow = Delivery::new(pay("DL-1", 5).account("slow"));
    let labels = [("scope", scope.as_str()), ("transport", "engine")];
    for miss in 1..=2 {
        let report = engine.process(&h, &slow).await;
        match &report.outcome {
            onceonly::Outcome::Failed(f) => assert!(f.is_infrastructure(), "{f}"),
            other => panic!("miss {miss}: {other:?}"),
        }
        assert_eq!(counter(DEADLINE_MISSES_TOTAL, &labels), miss);
    }
    let report = engine.process(&h, &slow).await;
    match &report.outcome {
        onceonly::Outcome::Failed(f @ onceonly::Failure::Deadline { misses: 3 }) => {
            assert_eq!(f.reason(), "deadline");
        }
        other => panic!("the third miss parks the key: {other:?}"),
    }
    assert_eq!(counter(DEADLINE_MISSES_TOTAL, &labels), 3);
    // Parked: the counter starts over, a replay gets its own misses.
    let report = engine.process(&h, &slow).await;
    assert!(
        matches!(&report.outcome, onceonly::Outcome::Failed(f) if f.is_infrastructure()),
        "{:?}",
        report.outcome
    );
    assert_eq!(h.calls.load(Ordering::SeqCst), 4);
    // Nothing of the slow handler was kept.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 0);
}

// ---------------------------------------------------------------- engine

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_counts_each_outcome_by_scope_and_transport() {
    metrics();
    let url = pg_schema("mxeng").await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let scope = unique("mxeng");
    let engine = Engine::builder(store.clone())
        .scope(scope.as_str())
        .key_expr("json:/out_trade_no")
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(10)),
        )
        .build()
        .unwrap();
    let h = Ledger::default();
    let d = |no: &str, account: &str, amount: i64| Delivery::new(pay(no, amount).account(account));

    let kinds = [
        engine.process(&h, &d("A", "alice", 10)).await,
        engine.process(&h, &d("A", "alice", 10)).await,
        engine.process(&h, &d("A", "alice", 99)).await,
        engine
            .process(&h, &Delivery::new(&b"{\"amount\":1}"[..]))
            .await,
        engine.process(&h, &d("B", "broken", 10)).await,
        engine.process_with_retry(&h, &d("F", "flaky", 10)).await,
    ]
    .map(|r| r.outcome.kind().as_str());
    assert_eq!(
        kinds,
        [
            "processed",
            "duplicate",
            "conflict",
            "rejected",
            "failed",
            "failed"
        ]
    );
    let batch = [d("C", "carol", 5), d("D", "dave", 6), d("C", "carol", 5)];
    let reports = engine.process_batch(&h, &batch).await;
    assert!(reports.iter().all(|r| r.outcome.is_done()));

    // The business effect: one row per processed key, nothing else.
    let charged: Vec<String> = ledger::postgres::charges(store.pool())
        .await
        .unwrap()
        .into_iter()
        .map(|(account, _, _)| account)
        .collect();
    assert_eq!(charged.len(), 3, "A, C and D were charged: {charged:?}");

    assert_eq!(
        outcomes(&scope, "engine"),
        BTreeMap::from([
            ("processed", 3),
            ("duplicate", 2),
            ("conflict", 1),
            ("rejected", 1),
            // broken once, flaky three times
            ("failed", 4),
        ])
    );
    assert_eq!(
        by_reason(RETRIED_TOTAL, &scope, "engine"),
        BTreeMap::from([("handler_error", 2)])
    );
    let labels = [("scope", scope.as_str()), ("transport", "engine")];
    // A, broken, flaky x3, then C and D in the batch.
    assert_eq!(samples(HANDLER_DURATION_SECONDS, &labels), 7);
    // A's transaction and the batch's.
    assert_eq!(samples(COMMIT_DURATION_SECONDS, &labels), 2);
    // Every claim that got an answer: A three times, broken, flaky x3 and
    // the batch's one claim (the keyless delivery claims nothing).
    assert_eq!(samples(CLAIM_DURATION_SECONDS, &labels), 8);
}

// ---------------------------------------------------------------- AMQP

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_consumer_counts_outcomes_retries_and_dead_letters() {
    metrics();
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let queue = unique("mxamqp");
    let url_pg = pg_schema("mxamqp").await;
    let store = pg_store(&url_pg, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let consumer = || {
        AmqpConsumer::builder(
            onceonly::Engine::builder(store.clone())
                .key_expr("json:/out_trade_no")
                .retry(
                    RetryPolicy::default()
                        .max_attempts(2)
                        .initial_delay(Duration::from_millis(100)),
                ),
        )
        .url(url())
        .queue(&queue)
        .exit_when_idle(Duration::from_secs(2))
        .build()
        .unwrap()
    };
    let drain = |consumer: AmqpConsumer<onceonly::PgStore>| async move {
        tokio::time::timeout(
            Duration::from_secs(120),
            consumer.run_until(Arc::new(Ledger::default()), CancellationToken::new()),
        )
        .await
        .expect("consumer did not drain within 120 s")
        .expect("consumer failed")
    };
    // Two runs: A is committed before its duplicate and its conflicting
    // reuse arrive (concurrent handlers give no order within one run).
    publish(
        &channel,
        &queue,
        &[
            Msg::new(pay("A", 10).account("alice")),
            Msg::new(pay("B", 20).account("bob")),
        ],
    )
    .await;
    let first = drain(consumer()).await;
    assert_eq!(first.consumer.processed, 2);
    publish(
        &channel,
        &queue,
        &[
            Msg::new(pay("A", 10).account("alice")),
            Msg::new(pay("A", 99).account("alice")),
            Msg::new(&b"not json"[..]),
            Msg::new(&b"{\"amount\":1}"[..]),
            Msg::new(pay("X", 1).account("broken")),
            Msg::new(pay("F", 1).account("flaky")),
        ],
    )
    .await;
    let stats = drain(consumer()).await;

    assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    let dlq = depth(&channel, &format!("{queue}.dlq")).await;
    assert_eq!(u64::from(dlq), stats.consumer.dead_lettered);
    assert!(stats.consumer.retried >= 1, "flaky was retried: {stats:?}");
    assert_eq!(
        outcomes(&queue, "amqp"),
        BTreeMap::from([
            ("processed", 2),
            ("duplicate", 1),
            ("conflict", 1),
            ("rejected", 2),
            // broken once, flaky on its first try and on each retry
            ("failed", 2 + stats.consumer.retried),
        ])
    );
    assert_eq!(
        by_reason(RETRIED_TOTAL, &queue, "amqp"),
        BTreeMap::from([("handler_error", stats.consumer.retried)])
    );
    assert_eq!(
        by_reason(DEAD_LETTERED_TOTAL, &queue, "amqp"),
        BTreeMap::from([
            ("fingerprint_mismatch", 1),
            ("decode_error", 1),
            ("bad_key", 1),
            // broken, and flaky once its retries ran out
            ("handler_error", 2),
        ])
    );
    assert_eq!(dlq, 5);
}

// ---------------------------------------------------------------- Kafka lag

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_consumer_lag_gauge_reaches_zero_once_everything_is_committed() {
    metrics();
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique("mxlag");
    let group = unique("mxlag_group");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlt"), 1).await;
    let records: Vec<Record> = (0..5)
        .map(|i| {
            let no = format!("L-{i}");
            Record::new(no.clone(), pay(&no, 1 + i).account("lara"))
        })
        .collect();
    produce(&topic, &records).await;
    let url_pg = pg_schema("mxlag").await;
    let store = pg_store(&url_pg, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();

    let consumer =
        KafkaConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
            .brokers(onceonly_integration_tests::kafka::brokers())
            .group_id(&group)
            .topic(&topic)
            .commit_interval(Duration::from_millis(100))
            .statistics_interval(Duration::from_millis(200))
            .build()
            .unwrap();
    let handler = Arc::new(Ledger::default());
    let stop = CancellationToken::new();
    let run = tokio::spawn(consumer.run_until(Arc::clone(&handler), stop.clone()));

    let labels = [
        ("scope", group.as_str()),
        ("topic", topic.as_str()),
        ("partition", "0"),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done = handler.calls.load(Ordering::SeqCst) == 5
            && committed(&group, &topic, 1).get(&0) == Some(&5);
        if done && gauge(KAFKA_CONSUMER_LAG, &labels) == Some(0.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "lag gauge {:?} not 0 within 60 s (handler calls {}, committed {:?})",
            gauge(KAFKA_CONSUMER_LAG, &labels),
            handler.calls.load(Ordering::SeqCst),
            committed(&group, &topic, 1),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(
        outcomes(&group, "kafka"),
        BTreeMap::from([("processed", 5)])
    );
}

// ---------------------------------------------------------------- Prometheus

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_webhook_example_serves_prometheus_counters() {
    let dir = tempfile::tempdir().unwrap();
    let (app, prom) = (free_port(), free_port());
    let child = Logged::new("mxprom");
    let _server = child.spawn(
        "payment_webhook",
        &[
            "--listen".into(),
            format!("127.0.0.1:{app}"),
            "--metrics-addr".into(),
            format!("127.0.0.1:{prom}"),
            "--database-url".into(),
            format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("webhook.db").display()
            ),
        ],
    );
    let client = reqwest::Client::new();
    let body = pay("P-1", 5).account("alice");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut posted = 0;
    while posted < 2 {
        match client
            .post(format!("http://127.0.0.1:{app}/webhooks/payments"))
            .json(&body)
            .send()
            .await
        {
            Ok(r) => {
                assert!(r.status().is_success(), "{}", r.status());
                posted += 1;
            }
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "the example did not answer within 60 s: {e}\n{}",
                    child.tail()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let text = client
        .get(format!("http://127.0.0.1:{prom}/metrics"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .unwrap_or_else(|e| panic!("metrics endpoint: {e}\n{}", child.tail()))
        .text()
        .await
        .unwrap();
    let value = |outcome: &str| {
        text.lines()
            .find(|l| {
                l.starts_with(DELIVERIES_TOTAL)
                    && l.contains("scope=\"payment-callbacks\"")
                    && l.contains("transport=\"http\"")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_owned)
    };
    assert_eq!(value("processed").as_deref(), Some("1"), "{text}");
    assert_eq!(value("duplicate").as_deref(), Some("1"), "{text}");
    assert!(
        text.contains(&format!("# HELP {DELIVERIES_TOTAL}")),
        "described: {text}"
    );
}

// ---------------------------------------------------------------- spans

/// Fields of `onceonly.delivery` spans: as seen by events inside them, and
/// when they close.
#[derive(Default, Clone)]
struct Captured {
    in_handler: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
    closed: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Captured {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &SpanRecord<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<Fields>()
        {
            values.record(fields);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut msg = Fields::default();
        event.record(&mut msg);
        if msg.0.get("message").map(String::as_str) != Some("inside handler") {
            return;
        }
        let Some(scope) = ctx.event_scope(event) else {
            return;
        };
        for span in scope.from_root() {
            if span.name() == "onceonly.delivery"
                && let Some(fields) = span.extensions().get::<Fields>()
            {
                self.in_handler.lock().unwrap().push(fields.0.clone());
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id)
            && span.name() == "onceonly.delivery"
            && let Some(fields) = span.extensions().get::<Fields>()
        {
            self.closed.lock().unwrap().push(fields.0.clone());
        }
    }
}

struct Noisy;

#[async_trait]
impl Handler<Sqlite> for Noisy {
    type Input = Json<serde_json::Value>;
    type Output = ();

    async fn handle(
        &self,
        _tx: onceonly::Tx<sqlx::Sqlite>,
        _input: Json<serde_json::Value>,
        _d: &Delivery,
    ) -> Result<(), HandlerError> {
        tracing::info!("inside handler");
        Ok(())
    }
}

#[tokio::test]
async fn delivery_span_wraps_the_handler_and_hashes_keys_when_asked() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::registry().with(captured.clone());
    // Current-thread runtime: the guard covers every poll of this test.
    let _guard = tracing::subscriber::set_default(subscriber);
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(&dir.path().join("spans.db"), "onceonly_keys").await;
    let scope = unique("mxspan");
    let build = |hash: bool| {
        Engine::builder(store.clone())
            .scope(scope.as_str())
            .key_expr("json:/out_trade_no")
            .key_redaction(if hash {
                onceonly::KeyRedaction::per_process().unwrap()
            } else {
                onceonly::KeyRedaction::plain()
            })
            .build()
            .unwrap()
    };
    let delivery =
        |no: &str| Delivery::new(pay(no, 1).account("alice")).with_source(format!("test/{no}"));
    build(false).process(&Noisy, &delivery("plain-1")).await;
    build(true).process(&Noisy, &delivery("secret-1")).await;
    build(true).process(&Noisy, &delivery("secret-1")).await;

    let in_handler = captured.in_handler.lock().unwrap().clone();
    assert_eq!(in_handler.len(), 2, "the duplicate did not run the handler");
    assert_eq!(in_handler[0]["scope"], scope);
    assert_eq!(in_handler[0]["transport"], "engine");
    assert_eq!(in_handler[0]["source"], "test/plain-1");
    assert_eq!(in_handler[0]["key"], "plain-1");
    let hashed = &in_handler[1]["key"];
    assert!(
        hashed.starts_with("hmac:") && hashed.len() == "hmac:".len() + 16,
        "{hashed}"
    );
    assert!(!hashed.contains("secret"));

    // The SQLite driver's worker thread may hold a clone of the last span
    // a little longer: wait for all three to close.
    let deadline = Instant::now() + Duration::from_secs(10);
    while captured.closed.lock().unwrap().len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let closed = captured.closed.lock().unwrap().clone();
    // In any order: a span closes when the last clone goes, and the
    // connection (and SQLite worker) a later delivery used may differ.
    let mut summary: Vec<(&str, &str)> = closed
        .iter()
        .map(|f| (f["key"].as_str(), f["outcome"].as_str()))
        .collect();
    summary.sort_unstable();
    let mut expected = vec![
        ("plain-1", "processed"),
        (hashed.as_str(), "processed"),
        (hashed.as_str(), "duplicate"),
    ];
    expected.sort_unstable();
    assert_eq!(summary, expected);
}
