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
    // 600 payments (and their duplicates) on 3 partitions, the poison in
    // the middle; one record at a time.
    poison_run(&Poisoned {
        name: "kpoison",
        partitions: 3,
        distinct: 600,
        at: None,
        batch: 1,
        stage: None,
    })
    .await;
}

/// The same with batches of 50: a crash rolls back the whole batch, so the
/// records before the poison in it were never committed. Its first crash
/// (inside a batch, uncounted) must still be followed by at most
/// `max_crashes` counted ones: after a death the records of the crashed
/// batch run alone, so the poison is counted, however deep in its batch
/// it sat (here, 30 records in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_deep_in_a_batch_is_dead_lettered_after_max_crashes_plus_one_deaths() {
    poison_run(&Poisoned {
        name: "kpoisonb",
        partitions: 1,
        distinct: 200,
        at: Some(31),
        batch: 50,
        stage: None,
    })
    .await;
}

/// Issue 44, defect 2: a record that kills the process before its claim
/// (here while its key is derived; a payload decoder that runs out of
/// memory is the same) is parked `crashed` too, after the same number of
/// deaths, instead of a crash loop on its offset for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_aborts_the_consumer_before_its_claim_is_dead_lettered_crashed() {
    poison_run(&Poisoned {
        name: "kpoisonk",
        partitions: 2,
        distinct: 300,
        at: None,
        batch: 1,
        stage: Some("key"),
    })
    .await;
}

/// A topic with a poison record, consumed by `poison_worker` under a
/// supervisor until a run ends by itself.
struct Poisoned {
    name: &'static str,
    partitions: i32,
    /// Distinct payments of the stream (with duplicates).
    distinct: usize,
    /// Where the poison goes among the records (default: the middle).
    at: Option<usize>,
    /// The consumer's batch size.
    batch: usize,
    /// Where the poison kills the process (`POISON_STAGE`): the handler
    /// by default.
    stage: Option<&'static str>,
}

/// Runs `p`: the poison is dead-lettered `crashed` after at most
/// `max_crashes + 1` deaths, every other payment is charged exactly once,
/// and every partition is committed to its end.
async fn poison_run(p: &Poisoned) {
    let kafka = MockKafka::start(1);
    let bootstrap = kafka.bootstrap().to_owned();
    let topic = unique(p.name);
    let dlt = format!("{topic}.dlt");
    kafka.create_topic(&topic, p.partitions);
    kafka.create_topic(&dlt, 1);
    let url = pg_schema(p.name).await;
    let pool = PgPool::connect(&url).await.expect("postgres");

    let stream = crash_stream("K", p.distinct);
    let mut records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(no, body)| Record::new(no.clone(), body.clone()))
        .collect();
    let poison = Record::new(POISON, pay(POISON, 42).account("acct-poison").body());
    let at = p.at.unwrap_or(records.len() / 2);
    records.insert(at, poison);
    let ends = produce_on(&bootstrap, &topic, &records).await;

    let group = unique(&format!("{}_group", p.name));
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
    let log = Logged::new(&format!("poison_worker_{}", p.name))
        .env("POISON_BATCH", &p.batch.to_string())
        .env("POISON_STAGE", p.stage.unwrap_or("handler"));
    let worker = Path::new(env!("CARGO_BIN_EXE_poison_worker"));
    let what = format!("record (batches of {})", p.batch);
    log.poison_loop(worker, &args, MAX_CRASHES, &what).await;

    // Every other payment exactly once; none for the poison (its write
    // rolled back with each death).
    assert_exact(&pool, &stream.expected).await;
    let letters = read_all_on(&bootstrap, &dlt, 1, 2, Duration::from_secs(5));
    assert!(!letters.is_empty(), "the poison is dead-lettered");
    for letter in &letters {
        assert_eq!(letter.key(), Some(POISON.as_bytes()), "only the poison");
        assert_eq!(header(letter, "x-onceonly-reason"), Some("crashed"));
    }
    let positions = committed_on(&bootstrap, &group, &topic, p.partitions);
    for (partition, end) in &ends {
        assert_eq!(
            positions.get(partition),
            Some(end),
            "partition {partition} is committed to its end: {positions:?}"
        );
    }
}
