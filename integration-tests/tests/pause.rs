//! Pausing on a failing dependency ([`PausePolicy`]): a handler refunds
//! each payment through a real loopback payment API (`provider_api`), then
//! books it in PostgreSQL. The API goes down (503) while messages keep
//! coming, and comes back.
//!
//! With `pause_on_failure`, on Kafka (tansu) and on RabbitMQ: the consumer
//! pauses after the policy's failed attempts, then only probes the API once
//! per cool-down; nothing is dead-lettered; once the API is back, every
//! payment is refunded once at the provider and booked once, and the
//! offsets are committed to the end (Kafka) or the queue is empty (AMQP).
//!
//! Without it (the same scenario on Kafka), the outage dead-letters
//! payments: what the option is for.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceonly::Header;
use onceonly::amqp::AmqpConsumer;
use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::{
    ConsumerStats, Delivery, Handler, HandlerError, Json, PausePolicy, RetryPolicy, SqlStore,
};
use onceonly_integration_tests::amqp::{self, Msg};
use onceonly_integration_tests::kafka::{
    Record, brokers, committed, create_topic, header, pg_schema, produce, read_all,
};
use onceonly_integration_tests::provider_api::ProviderApi;
use onceonly_integration_tests::{pg_store, unique};
use serde::Deserialize;
use serde_json::json;
use sqlx::{PgPool, Postgres};

/// Payments before the outage, during it, and after it.
const BEFORE: usize = 10;
const DURING: usize = 30;
const AFTER: usize = 10;
const ALL: usize = BEFORE + DURING + AFTER;
/// Kafka partitions (a lane each), AMQP handlers at once.
const PARTITIONS: i32 = 3;
const AMQP_CONCURRENCY: usize = 8;
/// How long the API stays down.
const OUTAGE: Duration = Duration::from_secs(4);
const COOL_DOWN: Duration = Duration::from_millis(400);

#[derive(Deserialize)]
struct Payment {
    payment: String,
    amount: i64,
}

/// Refunds through the provider API, then books the refund.
struct Refunding {
    api: String,
    client: reqwest::Client,
}

#[async_trait]
impl Handler<Postgres> for Refunding {
    type Input = Json<Payment>;
    type Output = ();

    async fn handle(
        &self,
        tx: onceonly::Tx<Postgres>,
        Json(p): Json<Payment>,
        _: &Delivery,
    ) -> Result<(), HandlerError> {
        let answer = self
            .client
            .post(format!("{}/v1/refunds", self.api))
            .header("Idempotency-Key", format!("refund-{}", p.payment))
            .json(&json!({"payment": p.payment, "amount": p.amount}))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(HandlerError::retryable)?;
        if !answer.status().is_success() {
            return Err(HandlerError::retryable(format!(
                "the payment API answered {}",
                answer.status()
            )));
        }
        let refund: serde_json::Value = answer.json().await.map_err(HandlerError::retryable)?;
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO refunds (payment, provider_id, amount) VALUES ($1, $2, $3)")
            .bind(&p.payment)
            .bind(refund["id"].as_str())
            .bind(p.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

impl Refunding {
    fn of(api: &ProviderApi) -> Self {
        Self {
            api: api.url(),
            client: reqwest::Client::new(),
        }
    }
}

/// What the consumer task `run`, whose stop was just cancelled, returned.
async fn stopped<T, E: std::fmt::Debug>(run: tokio::task::JoinHandle<Result<T, E>>) -> T {
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("consumer did not stop")
        .expect("consumer task")
        .expect("consumer failed")
}

fn payment(i: usize) -> (String, Vec<u8>) {
    let no = format!("P-{i:03}");
    let body = json!({"payment": no, "amount": 100 + i}).to_string();
    (no, body.into_bytes())
}

/// 5 attempts: 50, 100, 200, 400 ms apart.
fn retry() -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(5)
        .initial_delay(Duration::from_millis(50))
        .without_jitter()
}

/// Pauses after 5 failures among the last 10 attempts.
fn pause() -> PausePolicy {
    PausePolicy::new()
        .window(10)
        .min_attempts(5)
        .failure_rate(0.5)
        .cool_down(COOL_DOWN)
}

async fn setup(prefix: &str) -> (onceonly::PgStore, ProviderApi) {
    let db = pg_schema(prefix).await;
    let store = pg_store(&db, "onceonly_keys").await;
    sqlx::query(
        "CREATE TABLE refunds (payment text PRIMARY KEY, provider_id text NOT NULL, amount bigint NOT NULL)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    (store, ProviderApi::start().await)
}

async fn booked(pool: &PgPool) -> usize {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM refunds")
        .fetch_one(pool)
        .await
        .unwrap();
    usize::try_from(n).unwrap()
}

async fn wait_booked(pool: &PgPool, n: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while booked(pool).await < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} refunds booked after {within:?}",
            booked(pool).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the outage looked like from the provider's side.
struct Outage {
    /// 503 answers during the whole outage.
    refused: usize,
    /// 503 answers in the outage's second half, once any pause has set in.
    refused_late: usize,
}

/// Keeps the API, taken down by the caller, down for [`OUTAGE`], then
/// brings it back.
async fn outage(api: &ProviderApi) -> Outage {
    tokio::time::sleep(OUTAGE / 2).await;
    let half = api.unavailable_answers();
    tokio::time::sleep(OUTAGE / 2).await;
    let refused = api.unavailable_answers();
    api.set_down(false);
    Outage {
        refused,
        refused_late: refused - half,
    }
}

/// Every payment refunded once at the provider and booked once, with the
/// provider's id.
async fn assert_refunded_once(store: &onceonly::PgStore, api: &ProviderApi, n: usize) {
    let refunds = api.refunds();
    assert_eq!(refunds.len(), n, "refunds executed at the provider");
    for i in 0..n {
        let (no, _) = payment(i);
        assert_eq!(api.refunds_for(&no), 1, "{no} refunded once");
    }
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT payment, provider_id FROM refunds ORDER BY payment")
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(rows.len(), n, "refunds booked");
    for (payment, id) in rows {
        let at_provider = refunds.iter().find(|r| r.payment == payment).unwrap();
        assert_eq!(
            id, at_provider.id,
            "{payment} booked with the provider's id"
        );
    }
}

/// The provider saw the consumer pause: at most the attempts that pause
/// it (and one more for each delivery that ran at once with them), then
/// one probe per cool-down.
fn assert_paused(outage: &Outage, stats: &ConsumerStats, concurrency: usize) {
    eprintln!(
        "paused: the API refused {} calls in {OUTAGE:?} ({} in the second half); {stats:?}",
        outage.refused, outage.refused_late
    );
    let probes = (OUTAGE.as_millis() / COOL_DOWN.as_millis()) as usize + 2;
    let bound = pause().attempts_to_pause() as usize + concurrency - 1 + probes;
    assert!(
        outage.refused <= bound,
        "{} calls to the API while it was down: the consumer did not pause (at most {bound} expected)",
        outage.refused
    );
    let late_bound = (OUTAGE.as_millis() / 2 / COOL_DOWN.as_millis()) as usize + 2;
    assert!(
        (1..=late_bound).contains(&outage.refused_late),
        "{} calls in the outage's second half: one probe per cool-down expected (1 to {late_bound})",
        outage.refused_late
    );
    assert!(stats.pauses >= 1, "{stats:?}");
    assert_eq!(stats.dead_lettered, 0, "nothing dead-lettered: {stats:?}");
}

/// Runs the Kafka scenario; the consumer's stats, the outage, the topic's
/// dead-letter topic and committed offset against its end.
async fn kafka_scenario(
    pause_on_failure: bool,
) -> (
    onceonly::PgStore,
    ProviderApi,
    ConsumerStats,
    Outage,
    Vec<rdkafka::message::OwnedMessage>,
) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique("pause");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, PARTITIONS).await;
    create_topic(&dlt, 1).await;
    let (store, api) = setup("pause_kafka").await;
    let records = |range: std::ops::Range<usize>| -> Vec<Record> {
        range
            .map(|i| {
                let (no, body) = payment(i);
                Record::new(no, body)
            })
            .collect()
    };
    let mut ends = produce(&topic, &records(0..BEFORE)).await;

    let group = unique("pause_group");
    let mut builder = KafkaConsumer::builder(
        onceonly::Engine::builder(store.clone())
            .key_expr("json:/payment")
            .retry(retry()),
    )
    .brokers(brokers())
    .group_id(&group)
    .topic(&topic);
    if pause_on_failure {
        builder = builder.pause_on_failure(pause());
    }
    let stop = CancellationToken::new();
    let run = tokio::spawn(
        builder
            .build()
            .expect("consumer")
            .run_until(Refunding::of(&api), stop.clone()),
    );
    wait_booked(store.pool(), BEFORE, Duration::from_secs(30)).await;
    api.set_down(true);
    ends.extend(produce(&topic, &records(BEFORE..BEFORE + DURING)).await);
    let outage = outage(&api).await;
    // Dead letters are published only while the API is down.
    let letters = read_all(&dlt, 1, BEFORE + DURING, Duration::from_secs(2));
    // Consuming resumed: payments made after the outage go through too.
    ends.extend(produce(&topic, &records(BEFORE + DURING..ALL)).await);
    let expected = ALL - letters.len();
    wait_booked(store.pool(), expected, Duration::from_secs(60)).await;
    // Let the last offsets be committed.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    let stats = stopped(run).await;
    let committed = committed(&group, &topic, PARTITIONS);
    for (partition, end) in &ends {
        assert_eq!(
            committed.get(partition),
            Some(end),
            "partition {partition}: offsets committed to the end"
        );
    }
    (store, api, stats, outage, letters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_pauses_while_the_payment_api_is_down_and_dead_letters_nothing() {
    let (store, api, stats, outage, letters) = kafka_scenario(true).await;
    assert!(letters.is_empty(), "{} dead letters", letters.len());
    assert_paused(&outage, &stats, PARTITIONS as usize);
    assert_refunded_once(&store, &api, ALL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_pause_the_outage_dead_letters_payments() {
    let (_store, api, stats, outage, letters) = kafka_scenario(false).await;
    assert!(
        !letters.is_empty(),
        "the outage dead-lettered nothing: the scenario does not show what pausing prevents"
    );
    assert_eq!(stats.dead_lettered as usize, letters.len());
    for letter in &letters {
        assert_eq!(header(letter, Header::Reason.name()), Some("handler_error"));
    }
    assert_eq!(stats.pauses, 0);
    eprintln!(
        "without a pause: the API refused {} calls in {OUTAGE:?}; {} payments dead-lettered",
        outage.refused,
        letters.len()
    );
    // Every record hammered the API five times.
    assert!(outage.refused >= 5 * letters.len(), "{}", outage.refused);
    assert_eq!(api.refunds().len(), ALL - letters.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_pauses_while_the_payment_api_is_down_and_dead_letters_nothing() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let queue = unique("pause_amqp");
    let dlq = format!("{queue}.dlq");
    let (store, api) = setup("pause_amqp").await;
    let (_conn, channel) = amqp::connect().await;
    amqp::declare_queue(&channel, &queue).await;
    let messages = |range: std::ops::Range<usize>| -> Vec<Msg> {
        range.map(|i| Msg::new(payment(i).1)).collect()
    };
    amqp::publish(&channel, &queue, &messages(0..BEFORE)).await;

    let stop = CancellationToken::new();
    let run = tokio::spawn(
        AmqpConsumer::builder(
            onceonly::Engine::builder(store.clone())
                .key_expr("json:/payment")
                .retry(retry()),
        )
        .url(amqp::url())
        .queue(&queue)
        .concurrency(AMQP_CONCURRENCY)
        .pause_on_failure(pause())
        .build()
        .expect("consumer")
        .run_until(Refunding::of(&api), stop.clone()),
    );
    wait_booked(store.pool(), BEFORE, Duration::from_secs(30)).await;
    api.set_down(true);
    amqp::publish(&channel, &queue, &messages(BEFORE..BEFORE + DURING)).await;
    let outage = outage(&api).await;
    amqp::publish(&channel, &queue, &messages(BEFORE + DURING..ALL)).await;
    wait_booked(store.pool(), ALL, Duration::from_secs(60)).await;
    stop.cancel();
    let stats = stopped(run).await;
    assert_eq!(
        amqp::depth(&channel, &dlq).await,
        0,
        "nothing dead-lettered"
    );
    assert_eq!(
        amqp::depth(&channel, &queue).await,
        0,
        "every message acked"
    );
    assert_paused(&outage, &stats.consumer, AMQP_CONCURRENCY);
    assert_eq!(
        stats.consumer.acked as usize,
        ALL + stats.consumer.retried as usize,
        "{stats:?}"
    );
    assert_refunded_once(&store, &api, ALL).await;
}

#[tokio::test]
async fn a_policy_that_would_pause_after_the_retries_ran_out_is_refused() {
    let (store, _api) = setup("pause_refused").await;
    let kafka = KafkaConsumer::builder(
        onceonly::Engine::builder(store.clone())
            .key_expr("json:/payment")
            .retry(RetryPolicy::default().max_attempts(3)),
    )
    .brokers(brokers())
    .group_id("g")
    .topic("t")
    .pause_on_failure(PausePolicy::new())
    .build()
    .err()
    .expect("refused");
    assert!(
        kafka.to_string().contains("pauses after 5 failed attempts"),
        "{kafka}"
    );
    let amqp = AmqpConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/payment")
            .retry(RetryPolicy::none()),
    )
    .url(amqp::url())
    .queue("q")
    .pause_on_failure(PausePolicy::new().window(4).min_attempts(2))
    .build()
    .err()
    .expect("refused");
    assert!(
        amqp.to_string().contains("dead-letters a delivery after 1"),
        "{amqp}"
    );
}
