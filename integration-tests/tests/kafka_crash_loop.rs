//! A message that kills the process, on Kafka: one record among 900 makes
//! the consumer abort (SIGABRT) every time its handler runs. A supervisor
//! restarts the consumer after each death. The record must be
//! dead-lettered with reason `crashed` after the engine's default of 3
//! counted crashes (its first crash, while it was not yet a suspect, is not
//! counted), every other record charged exactly once, and every partition
//! committed to its end.
//!
//! It runs on librdkafka's mock cluster: tansu 0.6.0 never expires a dead
//! member, so a restarted consumer would get no partitions (see
//! `onceonly_integration_tests::mock`).

use std::path::Path;
use std::time::Duration;

use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::kafka::{
    Record, committed_on, header, pg_schema, produce_on, read_all_on,
};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream};
use onceonly_integration_tests::mock::MockKafka;
use onceonly_integration_tests::{pay, unique};
use rdkafka::Message;
use sqlx::PgPool;

/// The engine's default `max_crashes`.
const MAX_CRASHES: usize = 3;
const POISON: &str = "K-POISON";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_aborts_the_consumer_is_dead_lettered_crashed_and_the_partition_moves_on() {
    let kafka = MockKafka::start(1);
    let bootstrap = kafka.bootstrap().to_owned();
    let topic = unique("kpoison");
    let dlt = format!("{topic}.dlt");
    kafka.create_topic(&topic, 3);
    kafka.create_topic(&dlt, 1);
    let url = pg_schema("kpoison").await;
    let pool = PgPool::connect(&url).await.expect("postgres");

    // 600 payments (and their duplicates), the poison in the middle.
    let stream = crash_stream("K", 600);
    let mut records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(no, body)| Record::new(no.clone(), body.clone()))
        .collect();
    let poison = Record::new(POISON, pay(POISON, 42).account("acct-poison").body());
    records.insert(records.len() / 2, poison);
    assert!(records.len() > 900);
    let ends = produce_on(&bootstrap, &topic, &records).await;

    let group = unique("kpoison_group");
    let args: Vec<String> = [
        "kafka",
        bootstrap.as_str(),
        topic.as_str(),
        group.as_str(),
        url.as_str(),
        dlt.as_str(),
        POISON,
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    let log = Logged::new("poison_worker_kafka");
    let worker = Path::new(env!("CARGO_BIN_EXE_poison_worker"));
    log.poison_loop(worker, &args, MAX_CRASHES, "record").await;

    // Every other payment exactly once; none for the poison (its write
    // rolled back with each death).
    assert_exact(&pool, &stream.expected).await;
    let letters = read_all_on(&bootstrap, &dlt, 1, 2, Duration::from_secs(5));
    assert!(!letters.is_empty(), "the poison is dead-lettered");
    for letter in &letters {
        assert_eq!(letter.key(), Some(POISON.as_bytes()), "only the poison");
        assert_eq!(header(letter, "x-onceonly-reason"), Some("crashed"));
    }
    let positions = committed_on(&bootstrap, &group, &topic, 3);
    for (p, end) in &ends {
        assert_eq!(
            positions.get(p),
            Some(end),
            "partition {p} is committed to its end: {positions:?}"
        );
    }
}

/// The same with batches of 50: a crash rolls back the whole batch, so the
/// records before the poison in it were never committed. Its first crash
/// (inside a batch, uncounted) must still be followed by at most
/// `max_crashes` counted ones: after a death the records of the crashed
/// batch run alone, so the poison is counted, however deep in its batch
/// it sat (here, 30 records in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_deep_in_a_batch_is_dead_lettered_after_max_crashes_plus_one_deaths() {
    let kafka = MockKafka::start(1);
    let bootstrap = kafka.bootstrap().to_owned();
    let topic = unique("kpoisonb");
    let dlt = format!("{topic}.dlt");
    kafka.create_topic(&topic, 1);
    kafka.create_topic(&dlt, 1);
    let url = pg_schema("kpoisonb").await;
    let pool = PgPool::connect(&url).await.expect("postgres");

    let stream = crash_stream("KB", 200);
    let mut records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(no, body)| Record::new(no.clone(), body.clone()))
        .collect();
    let poison = Record::new(POISON, pay(POISON, 42).account("acct-poison").body());
    records.insert(31, poison);
    let ends = produce_on(&bootstrap, &topic, &records).await;

    let group = unique("kpoisonb_group");
    let args: Vec<String> = [
        "kafka",
        bootstrap.as_str(),
        topic.as_str(),
        group.as_str(),
        url.as_str(),
        dlt.as_str(),
        POISON,
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    let log = Logged::new("poison_worker_kafka_batch").env("POISON_BATCH", "50");
    let worker = Path::new(env!("CARGO_BIN_EXE_poison_worker"));
    log.poison_loop(worker, &args, MAX_CRASHES, "record in a batch")
        .await;

    assert_exact(&pool, &stream.expected).await;
    let letters = read_all_on(&bootstrap, &dlt, 1, 2, Duration::from_secs(5));
    assert!(!letters.is_empty(), "the poison is dead-lettered");
    for letter in &letters {
        assert_eq!(letter.key(), Some(POISON.as_bytes()), "only the poison");
        assert_eq!(header(letter, "x-onceonly-reason"), Some("crashed"));
    }
    let positions = committed_on(&bootstrap, &group, &topic, 1);
    for (p, end) in &ends {
        assert_eq!(positions.get(p), Some(end), "committed to its end");
    }
}
