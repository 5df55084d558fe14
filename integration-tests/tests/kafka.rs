//! The Kafka consumer against a real broker (tansu from `scripts/services`,
//! or Apache Kafka) and PostgreSQL. Each test has its own topics, group and
//! Postgres schema.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use onceonly::Header;
use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::{PgStore, RetryPolicy, SqlStore};
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::handler::Ledger;
use onceonly_integration_tests::kafka::{
    Record, committed, create_topic, header, pg_schema, produce, read_all,
};
use onceonly_integration_tests::ledger::assert_exact;
use onceonly_integration_tests::{pay, pg_store, unique};
use sqlx::PgPool;

struct Setup {
    topic: String,
    dlt: String,
    group: String,
    store: PgStore,
    pool: PgPool,
}

async fn setup(name: &str, partitions: i32) -> Setup {
    // Consumer logs (rebalances, dead letters) in the output of failed tests.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique(name);
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, partitions).await;
    create_topic(&dlt, 1).await;
    let url = pg_schema(name).await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let pool = store.pool().clone();
    Setup {
        group: unique("group"),
        topic,
        dlt,
        store,
        pool,
    }
}

fn consumer(s: &Setup) -> onceonly::kafka::KafkaConsumerBuilder<PgStore> {
    KafkaConsumer::builder(
        onceonly::Engine::builder(s.store.clone())
            .key_expr("json:/out_trade_no")
            .retry(
                RetryPolicy::default()
                    .max_attempts(3)
                    .initial_delay(Duration::from_millis(20)),
            ),
    )
    .brokers(onceonly_integration_tests::kafka::brokers())
    .group_id(&s.group)
    .topic(&s.topic)
    .consumer_config("session.timeout.ms", "6000")
    .exit_when_idle(Duration::from_secs(3))
}

/// Runs the consumer until it is drained and idle, with a hard limit.
async fn drain(
    builder: onceonly::kafka::KafkaConsumerBuilder<PgStore>,
    handler: Arc<Ledger>,
) -> onceonly::ConsumerStats {
    let run = builder
        .build()
        .expect("consumer")
        .run_until(handler, CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain within 120 s")
        .expect("consumer failed")
}

fn assert_no_lag(group: &str, topic: &str, ends: &BTreeMap<i32, i64>, partitions: i32) {
    let got = committed(group, topic, partitions);
    for p in 0..partitions {
        let end = ends.get(&p).copied().unwrap_or(-1);
        assert_eq!(
            got.get(&p).copied(),
            Some(end),
            "partition {p}: committed offset must be the log end (lag 0); all: {got:?}"
        );
    }
}

/// 300 keys over 3 partitions, each key 1 to 3 times: repeats right behind
/// each other (same batch) and far apart (other batches).
fn duplicated_stream(prefix: &str) -> (Vec<Record>, BTreeMap<String, (String, i64)>) {
    let mut records = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..300 {
        let no = format!("{prefix}-{i:04}");
        // One account per key: batches of different partitions then never
        // update the same `accounts` row, so no deadlock rolls a batch back
        // and the handler-call count below is exact.
        let account = format!("acct-{i}");
        let amount = 100 + i;
        let body = pay(&no, amount).account(&account).body();
        records.push(Record::new(no.clone(), body.clone()));
        if i % 3 == 0 {
            records.push(Record::new(no.clone(), body.clone()));
        }
        expected.insert(no, (account, amount));
    }
    // Far-apart repeats of every fifth key.
    for i in (0..300).step_by(5) {
        let no = format!("{prefix}-{i:04}");
        let (account, amount) = &expected[&no];
        records.push(Record::new(no.clone(), pay(&no, *amount).account(account)));
    }
    (records, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_within_and_across_batches_are_charged_once() {
    let s = setup("kdup", 3).await;
    let (records, expected) = duplicated_stream("B");
    assert!(records.len() >= 460, "{} records", records.len());
    let ends = produce(&s.topic, &records).await;
    let handler = Arc::new(Ledger::default());
    let stats = drain(
        consumer(&s)
            .batch_size(50)
            .linger(Duration::from_millis(20)),
        Arc::clone(&handler),
    )
    .await;
    assert_exact(&s.pool, &expected).await;
    // The same statistics as the AMQP consumer's: every record settled,
    // each key processed once, every repeat a duplicate.
    assert_eq!(
        (
            stats.processed,
            stats.duplicates,
            stats.acked,
            stats.dead_lettered
        ),
        (
            expected.len() as u64,
            (records.len() - expected.len()) as u64,
            records.len() as u64,
            0
        ),
        "{stats:?}"
    );
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        expected.len(),
        "the handler ran once per distinct key"
    );
    assert_no_lag(&s.group, &s.topic, &ends, 3);
    assert!(
        read_all(&s.dlt, 1, 1, Duration::from_secs(2)).is_empty(),
        "nothing dead-lettered"
    );

    // A second group is another scope: it charges again, once.
    let other = Setup {
        group: unique("group2"),
        ..s
    };
    let handler = Arc::new(Ledger::default());
    drain(consumer(&other), Arc::clone(&handler)).await;
    assert_eq!(handler.calls.load(Ordering::SeqCst), expected.len());
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(&other.pool)
        .await
        .unwrap();
    assert_eq!(rows as usize, 2 * expected.len());
}

/// After an assignment a lane goes record by record only until its first
/// record commits (those are the suspects of a crash loop); the rest of a
/// backlog goes in batches. Before, the whole first batch the lane had
/// gathered (up to `batch_size` records) ran one transaction per record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_goes_in_batches_once_the_first_record_committed() {
    let s = setup("kbatch", 1).await;
    let mut records = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..600 {
        let no = format!("T-{i:04}");
        let account = format!("acct-{i}");
        records.push(Record::new(no.clone(), pay(&no, 5).account(&account)));
        expected.insert(no, (account, 5));
    }
    let ends = produce(&s.topic, &records).await;
    let stats = drain(
        consumer(&s)
            .batch_size(100)
            .linger(Duration::from_millis(50)),
        Arc::new(Ledger::default()),
    )
    .await;
    assert_exact(&s.pool, &expected).await;
    assert_eq!(stats.processed, 600, "{stats:?}");
    assert_no_lag(&s.group, &s.topic, &ends, 1);
    // Rows written by one transaction share its id (`xmin`).
    let transactions: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT xmin::text) FROM ledger")
        .fetch_one(&s.pool)
        .await
        .unwrap();
    println!("600 backlog records at batch size 100: {transactions} transactions");
    assert!(
        transactions <= 30,
        "600 records of a backlog took {transactions} transactions at batch size 100"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_concurrency_keeps_each_key_in_order() {
    let s = setup("kord", 2).await;
    let mut records = Vec::new();
    let mut expected = BTreeMap::new();
    for seq in 0..60 {
        for a in 0..8 {
            let account = format!("acct-{a}");
            let no = format!("O-{a}-{seq}");
            let body = pay(&no, 1).account(&account).seq(seq);
            records.push(Record::new(account.clone(), body));
            expected.insert(no, (account, 1));
        }
    }
    let ends = produce(&s.topic, &records).await;
    let handler = Arc::new(Ledger {
        delay: Duration::from_millis(2),
        ..Ledger::default()
    });
    drain(consumer(&s).key_concurrency(4), Arc::clone(&handler)).await;
    assert_exact(&s.pool, &expected).await;
    let seen = handler.seen.lock().unwrap().clone();
    let mut last: HashMap<String, i64> = HashMap::new();
    for (account, seq) in &seen {
        if let Some(prev) = last.insert(account.clone(), *seq) {
            assert!(prev < *seq, "{account}: seq {seq} ran after {prev}");
        }
    }
    assert_no_lag(&s.group, &s.topic, &ends, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_records_are_dead_lettered_with_headers_while_others_proceed() {
    let s = setup("kdlt", 1).await;
    let records = vec![
        Record::new("k1", pay("P-1", 10).account("alice")).header("trace-id", "t-1"),
        Record::new("k2", pay("P-2", 20).account("flaky")),
        Record::new("k3", pay("P-3", 30).account("bob")),
        Record::new("k4", b"{\"out_trade_no\":\"P-4\",\"amount\":".to_vec()),
        Record::new("k5", pay("P-5", 50).account("broken")),
        Record::new("k6", br#"{"account":"bob","amount":60}"#.to_vec()),
        Record::new("k7", pay("P-1", 999).account("alice")),
        Record::new("k8", pay("P-1", 10).account("alice")),
        Record::new("k9", pay("P-9", 90).account("carol")),
    ];
    let ends = produce(&s.topic, &records).await;
    let handler = Arc::new(Ledger::default());
    drain(consumer(&s).dead_letter_topic(&s.dlt), Arc::clone(&handler)).await;

    let expected: BTreeMap<String, (String, i64)> = [
        ("P-1", "alice", 10),
        ("P-3", "bob", 30),
        ("P-9", "carol", 90),
    ]
    .iter()
    .map(|(n, a, m)| ((*n).to_owned(), ((*a).to_owned(), *m)))
    .collect();
    assert_exact(&s.pool, &expected).await;
    assert_no_lag(&s.group, &s.topic, &ends, 1);

    let dead = read_all(&s.dlt, 1, 5, Duration::from_secs(20));
    let by_offset: BTreeMap<&str, &rdkafka::message::OwnedMessage> = dead
        .iter()
        .map(|m| (header(m, Header::OriginalOffset.name()).unwrap(), m))
        .collect();
    assert_eq!(dead.len(), 5, "five dead letters: {:?}", by_offset.keys());
    let expect = [
        ("1", "handler_error", "3", "k2"),
        ("3", "decode_error", "0", "k4"),
        ("4", "handler_error", "1", "k5"),
        ("5", "bad_key", "0", "k6"),
        ("6", "fingerprint_mismatch", "1", "k7"),
    ];
    for (offset, reason, attempts, key) in expect {
        use rdkafka::Message;
        let m = by_offset
            .get(offset)
            .unwrap_or_else(|| panic!("no dead letter for offset {offset}"));
        assert_eq!(
            header(m, Header::Reason.name()),
            Some(reason),
            "offset {offset}"
        );
        assert_eq!(
            header(m, Header::Attempts.name()),
            Some(attempts),
            "offset {offset}"
        );
        assert_eq!(
            header(m, Header::OriginalTopic.name()),
            Some(s.topic.as_str())
        );
        assert_eq!(header(m, Header::OriginalPartition.name()), Some("0"));
        assert_eq!(header(m, Header::OriginalKey.name()), Some(key));
        assert_eq!(m.key(), Some(key.as_bytes()), "record key kept");
        assert_eq!(
            m.payload(),
            Some(&*records[offset.parse::<usize>().unwrap()].payload)
        );
        assert!(
            !header(m, Header::Error.name())
                .unwrap_or_default()
                .is_empty()
        );
        let first_seen: u64 = header(m, Header::FirstSeen.name())
            .unwrap()
            .parse()
            .unwrap();
        assert!(first_seen > 1_700_000_000_000, "first seen is epoch millis");
        assert_eq!(header(m, Header::Scope.name()), Some(s.group.as_str()));
    }
    let flaky = by_offset["1"];
    assert_eq!(header(flaky, Header::IdempotencyKey.name()), Some("P-2"));
    assert!(
        header(flaky, Header::Error.name())
            .unwrap()
            .contains("always times out")
    );
    assert_eq!(header(by_offset["5"], Header::IdempotencyKey.name()), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_in_the_middle_loses_and_doubles_nothing() {
    let s = setup("kreb", 4).await;
    let mut records = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..1_500 {
        let no = format!("R-{i:05}");
        let account = format!("acct-{}", i % 11);
        let amount = 1 + i % 97;
        let body = pay(&no, amount).account(&account).body();
        records.push(Record::new(no.clone(), body.clone()));
        if i % 4 == 0 {
            records.push(Record::new(no.clone(), body));
        }
        expected.insert(no, (account, amount));
    }
    let ends = produce(&s.topic, &records).await;
    let first = Arc::new(Ledger {
        delay: Duration::from_millis(10),
        ..Ledger::default()
    });
    let second = Arc::new(Ledger {
        delay: Duration::from_millis(10),
        ..Ledger::default()
    });
    // A small in-flight bound pauses partitions: they must come back
    // unpaused when the rebalance hands them out again.
    let a = tokio::spawn(drain(consumer(&s).max_in_flight(20), Arc::clone(&first)));
    // Join the second member once the first is well into the backlog.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while first.calls.load(Ordering::SeqCst) < 150 {
        assert!(
            std::time::Instant::now() < deadline,
            "first consumer made no progress"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = tokio::spawn(drain(consumer(&s).max_in_flight(20), Arc::clone(&second)));
    a.await.unwrap();
    b.await.unwrap();
    let (n1, n2) = (
        first.calls.load(Ordering::SeqCst),
        second.calls.load(Ordering::SeqCst),
    );
    assert!(
        n2 > 0,
        "the second member got partitions (first {n1}, second {n2})"
    );
    assert_exact(&s.pool, &expected).await;
    assert_no_lag(&s.group, &s.topic, &ends, 4);
    // Handler runs: once per key, plus at most the records in flight at the
    // revoke whose transactions then found a duplicate (none can commit twice).
    assert!(n1 + n2 >= expected.len());
}

/// Issue 44, defect 10: a consumer started on a database without its
/// dedup table (`migrate` never ran) stops at once with the command that
/// creates it, instead of waiting for the table for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_first_start_without_the_dedup_table_stops_with_the_command_that_creates_it() {
    let topic = unique("knoschema");
    create_topic(&topic, 1).await;
    let db_url = pg_schema("knoschema").await;
    let store = PgStore::connect(&db_url)
        .await
        .expect("postgres")
        .with_table("never_migrated")
        .expect("table");
    let run =
        KafkaConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
            .brokers(onceonly_integration_tests::kafka::brokers())
            .group_id(unique("group"))
            .topic(&topic)
            .build()
            .expect("consumer")
            .run_until(Arc::new(Ledger::default()), CancellationToken::new());
    let ended = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the consumer must not wait for a table that was never created");
    match ended {
        Err(onceonly::kafka::KafkaConsumerError::MissingSchema(why)) => {
            assert!(why.contains("onceonly migrate"), "{why}");
            assert!(why.contains("never_migrated"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}
