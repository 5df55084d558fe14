//! `onceonly replay kafka` (the real binary) against a Kafka-compatible
//! broker (tansu) and the Kafka consumer on PostgreSQL: replayed dead
//! letters dedupe, conflicts stay conflicts, dead-letter offsets are
//! committed only past what is done, filters and dry runs are honoured.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use onceonly::Header;
use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::{PgStore, SqlStore};
use onceonly_integration_tests::cli::{Run, onceonly};
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::handler::{Declining, Outage, process_meanwhile};
use onceonly_integration_tests::kafka::{
    Record, brokers, committed, create_topic, header, pg_schema, produce, read_all,
};
use onceonly_integration_tests::ledger::{assert_exact, rows};
use onceonly_integration_tests::{pay, pg_store, unique};
use rdkafka::Message;
use sqlx::PgPool;

struct Setup {
    topic: String,
    dlt: String,
    group: String,
    store: PgStore,
    pool: PgPool,
    /// The database (schema) of the dedup table and the ledger.
    db: String,
}

async fn setup(name: &str) -> Setup {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique(name);
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 1).await;
    create_topic(&dlt, 1).await;
    let url = pg_schema(name).await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    Setup {
        group: unique("group"),
        pool: store.pool().clone(),
        topic,
        dlt,
        store,
        db: url,
    }
}

/// Runs the consumer until the topic is idle.
async fn drain<H>(s: &Setup, handler: Arc<H>)
where
    H: onceonly::Handler<sqlx::Postgres> + 'static,
{
    let run = KafkaConsumer::builder(
        onceonly::Engine::builder(s.store.clone()).key_expr("json:/out_trade_no"),
    )
    .brokers(brokers())
    .group_id(&s.group)
    .topic(&s.topic)
    .consumer_config("session.timeout.ms", "6000")
    // One record per batch on the dead-letter topic (tansu, see
    // integration-tests/src/kafka.rs).
    .producer_config("batch.num.messages", "1")
    .exit_when_idle(Duration::from_secs(2))
    .build()
    .expect("consumer")
    .run_until(handler, CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("consumer did not drain within 60 s")
        .expect("consumer failed");
}

async fn replay(s: &Setup, group: &str, extra: &[&str]) -> Run {
    let brokers = brokers();
    let mut args = vec![
        "replay",
        "kafka",
        "--brokers",
        brokers.as_str(),
        "--topic",
        s.dlt.as_str(),
        "--consumer-group",
        group,
    ];
    args.extend_from_slice(extra);
    // No retention is assumed: the operator states the consumers' one
    // unless the dedup table tells it.
    if !args
        .iter()
        .any(|a| ["--database-url", "--retention", "--beyond-retention"].contains(a))
    {
        args.extend(["--retention", "7d"]);
    }
    onceonly(&args).await
}

/// A dead letter as the consumer writes it.
fn dead_letter(topic: &str, key: &str, body: Vec<u8>, reason: &str) -> Record {
    Record::new(key, body)
        .header("trace-id", "t-1")
        .header(Header::OriginalTopic.name(), topic)
        .header(Header::OriginalPartition.name(), "0")
        .header(Header::OriginalOffset.name(), "7")
        .header(Header::Reason.name(), reason)
        .header(Header::Error.name(), "boom")
        .header(Header::Attempts.name(), "3")
        .header(Header::IdempotencyKey.name(), key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replayed_dead_letters_dedupe_and_commit_the_dead_letter_offsets() {
    let s = setup("rpk_dedup").await;
    let mut expected = BTreeMap::new();
    let mut records = Vec::new();
    for i in 1..=4 {
        let no = format!("K-{i}");
        records.push(Record::new(no.clone(), pay(&no, 10 * i).account("acct")));
        expected.insert(no, ("acct".to_owned(), 10 * i));
    }
    produce(&s.topic, &records).await;
    // The downstream is down: all four are dead-lettered.
    drain(&s, Arc::new(Outage::down())).await;
    assert_eq!(read_all(&s.dlt, 1, 4, Duration::from_secs(10)).len(), 4);
    // Meanwhile K-1 and K-2 were sent again and went through.
    process_meanwhile(&s.store, s.group.as_str(), &expected, &["K-1", "K-2"]).await;

    let group = unique("replay");
    let run = replay(&s, &group, &[]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 4"), "{run:?}");
    assert_eq!(
        committed(&group, &s.dlt, 1)[&0],
        4,
        "dead-letter offsets committed"
    );
    // A second run finds nothing left.
    let run = replay(&s, &group, &[]).await;
    assert!(run.stdout.contains("scanned 0"), "{run:?}");

    let handler = Arc::new(Outage::default());
    drain(&s, Arc::clone(&handler)).await;
    assert_exact(&s.pool, &expected).await;
    assert_eq!(
        handler.ledger.calls.load(Ordering::SeqCst),
        2,
        "only K-3 and K-4 ran"
    );
    assert_eq!(
        read_all(&s.dlt, 1, 5, Duration::from_secs(2)).len(),
        4,
        "nothing dead-lettered again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_fingerprint_mismatch_is_still_a_conflict() {
    let s = setup("rpk_conflict").await;
    produce(
        &s.topic,
        &[
            Record::new("P-1", pay("P-1", 10).account("alice")),
            Record::new("P-1", pay("P-1", 999).account("alice")),
        ],
    )
    .await;
    let handler = Arc::new(Outage::default());
    drain(&s, Arc::clone(&handler)).await;
    assert_eq!(read_all(&s.dlt, 1, 1, Duration::from_secs(10)).len(), 1);

    let group = unique("replay");
    let run = replay(&s, &group, &[]).await;
    assert!(run.success, "{run:?}");
    drain(&s, Arc::clone(&handler)).await;
    let dead = read_all(&s.dlt, 1, 2, Duration::from_secs(10));
    assert_eq!(dead.len(), 2, "dead-lettered again");
    assert_eq!(
        header(&dead[1], Header::Reason.name()),
        Some("fingerprint_mismatch")
    );
    assert_eq!(
        dead[1].payload(),
        Some(pay("P-1", 999).account("alice").body().as_slice())
    );
    assert_eq!(handler.ledger.calls.load(Ordering::SeqCst), 1);
    let expected = BTreeMap::from([("P-1".to_owned(), ("alice".to_owned(), 10))]);
    assert_exact(&s.pool, &expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filters_dry_run_and_limit_commit_only_what_is_done() {
    let s = setup("rpk_filter").await;
    let t = s.topic.as_str();
    produce(
        &s.dlt,
        &[
            dead_letter(t, "F-0", pay("F-0", 1).account("a").body(), "handler_error"),
            dead_letter(t, "F-1", b"{not json".to_vec(), "decode_error"),
            dead_letter(t, "F-2", pay("F-2", 2).account("a").body(), "handler_error"),
            dead_letter(t, "F-3", br#"{"amount":3}"#.to_vec(), "bad_key"),
        ],
    )
    .await;

    // Dry run: prints, publishes and commits nothing.
    let group = unique("replay");
    let run = replay(&s, &group, &["--dry-run"]).await;
    assert!(run.success, "{run:?}");
    let would = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("would replay "))
        .count();
    assert_eq!(would, 4, "{run:?}");
    assert_eq!(
        committed(&group, &s.dlt, 1)[&0],
        -1,
        "a dry run commits nothing"
    );

    // Only decode_error: replayed, but not committed past the skipped F-0.
    let run = replay(&s, &group, &["--reason", "decode_error"]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 1, skipped 3"), "{run:?}");
    assert!(
        run.stdout.contains("1 replayed but not committed"),
        "{run:?}"
    );
    assert!(
        committed(&group, &s.dlt, 1)[&0] <= 0,
        "nothing committed past F-0"
    );
    let back = read_all(&s.topic, 1, 1, Duration::from_secs(10));
    assert_eq!(back.len(), 1);
    let m = &back[0];
    assert_eq!(m.key(), Some("F-1".as_bytes()));
    assert_eq!(m.payload(), Some(b"{not json".as_slice()));
    assert_eq!(header(m, "trace-id"), Some("t-1"));
    for gone in [
        Header::Reason.name(),
        Header::Error.name(),
        Header::Attempts.name(),
        Header::OriginalTopic.name(),
    ] {
        assert_eq!(header(m, gone), None, "{gone} stripped");
    }
    assert_eq!(
        header(m, Header::ReplayedFrom.name()),
        Some(format!("{}/0/1", s.dlt).as_str())
    );

    // --limit 1 on a fresh group: F-0 replayed and committed, nothing more.
    let limited = unique("replay");
    let run = replay(&s, &limited, &["--limit", "1"]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("scanned 1, replayed 1"), "{run:?}");
    assert_eq!(committed(&limited, &s.dlt, 1)[&0], 1);

    // handler_error with --commit-skipped: F-0 and F-2 replayed, the
    // skipped ones committed past too.
    let skipping = unique("replay");
    let run = replay(
        &s,
        &skipping,
        &[
            "--reason",
            "handler_error",
            "--commit-skipped",
            "--rate",
            "50/s",
        ],
    )
    .await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 2, skipped 2"), "{run:?}");
    assert_eq!(committed(&skipping, &s.dlt, 1)[&0], 4);
    assert_eq!(read_all(&s.topic, 1, 4, Duration::from_secs(10)).len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_that_cannot_be_replayed_stops_its_partition_and_fails_the_run() {
    let s = setup("rpk_fail").await;
    let t = s.topic.as_str();
    produce(
        &s.dlt,
        &[
            dead_letter(t, "G-0", pay("G-0", 1).account("a").body(), "handler_error"),
            // Not a onceonly dead letter: no original topic.
            Record::new("G-1", pay("G-1", 2).account("a"))
                .header(Header::Reason.name(), "handler_error"),
            dead_letter(t, "G-2", pay("G-2", 3).account("a").body(), "handler_error"),
        ],
    )
    .await;
    let group = unique("replay");
    let run = replay(&s, &group, &[]).await;
    assert!(!run.success, "{run:?}");
    assert!(
        run.stdout.contains("replayed 1, skipped 0, failed 1"),
        "{run:?}"
    );
    assert!(run.stderr.contains("could not be replayed"), "{run:?}");
    assert!(run.stderr.contains(Header::OriginalTopic.name()), "{run:?}");
    assert_eq!(
        committed(&group, &s.dlt, 1)[&0],
        1,
        "committed up to the failed record"
    );
    let back = read_all(&s.topic, 1, 2, Duration::from_secs(3));
    assert_eq!(back.len(), 1, "G-2 waits behind the failed record");
}

/// The consumer's own dead letters of three failures (a key reused with
/// another payload, no key, the downstream down twice): `dlq groups` finds
/// three groups and commits nothing; a dry run against the dedup table
/// splits them and commits nothing; `replay --group` replays one group.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_in_failure_groups_on_a_topic() {
    let s = setup("rpk_groups").await;
    let mut expected = BTreeMap::new();
    for (no, amount) in [("G-1", 10), ("G-3", 30), ("G-4", 40)] {
        expected.insert(no.to_owned(), ("acct".to_owned(), amount));
    }
    produce(
        &s.topic,
        &[
            Record::new("G-1", pay("G-1", 10).account("acct")),
            Record::new("G-1", pay("G-1", 999).account("acct")),
            Record::new("none", br#"{"amount": 5}"#.to_vec()),
        ],
    )
    .await;
    drain(&s, Arc::new(Outage::default())).await;
    produce(
        &s.topic,
        &[
            Record::new("G-3", pay("G-3", 30).account("acct")),
            Record::new("G-4", pay("G-4", 40).account("acct")),
        ],
    )
    .await;
    drain(&s, Arc::new(Outage::down())).await;
    assert_eq!(read_all(&s.dlt, 1, 4, Duration::from_secs(10)).len(), 4);

    let group = unique("replay");
    let brokers = brokers();
    let groups = onceonly(&[
        "dlq",
        "groups",
        "kafka",
        "--brokers",
        &brokers,
        "--topic",
        &s.dlt,
        "--consumer-group",
        &group,
        "--json",
    ])
    .await;
    assert!(groups.success, "{groups:?}");
    let json: serde_json::Value = serde_json::from_str(&groups.stdout).expect("JSON");
    let by_reason: BTreeMap<String, (u64, String)> = json["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["reason"].as_str().unwrap().to_owned(),
                (
                    g["count"].as_u64().unwrap(),
                    g["id"].as_str().unwrap().to_owned(),
                ),
            )
        })
        .collect();
    assert_eq!(
        by_reason
            .iter()
            .map(|(r, (n, _))| (r.as_str(), *n))
            .collect::<Vec<_>>(),
        [
            ("bad_key", 1),
            ("fingerprint_mismatch", 1),
            ("handler_error", 2)
        ],
        "{}",
        groups.stdout
    );
    assert!(
        committed(&group, &s.dlt, 1)[&0] < 0,
        "dlq groups committed nothing"
    );

    // Meanwhile G-3 went through.
    process_meanwhile(&s.store, s.group.as_str(), &expected, &["G-3"]).await;
    let dry = replay(&s, &group, &["--dry-run", "--database-url", &s.db]).await;
    assert!(dry.success, "{dry:?}");
    assert!(
        dry.stdout.contains(
            "would be: 1 new, 1 duplicates (answered, no effect), 1 conflicts, 1 unknown"
        ),
        "{}",
        dry.stdout
    );
    assert!(
        committed(&group, &s.dlt, 1)[&0] < 0,
        "the dry run committed nothing"
    );

    let handler_group = &by_reason["handler_error"].1;
    let run = replay(&s, &group, &["--group", handler_group, "--commit-skipped"]).await;
    assert!(run.success, "{run:?}");
    assert!(
        run.stdout.contains("replayed 2, skipped 2"),
        "{}",
        run.stdout
    );
    let handler = Arc::new(Outage::default());
    drain(&s, Arc::clone(&handler)).await;
    assert_eq!(
        handler.ledger.calls.load(Ordering::SeqCst),
        1,
        "G-4 ran, G-3 was a duplicate"
    );
    assert_exact(&s.pool, &expected).await;
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A letter older than the dedup retention is refused (and holds the
/// replay group's offset) unless `--beyond-retention`; a letter replayed
/// too often goes to `<topic>.parked`; replayed copies count their replays
/// and say where they were first consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn old_letters_are_refused_and_cycling_letters_are_parked() {
    let s = setup("rpk_retain").await;
    let parking = format!("{}.parked", s.dlt);
    create_topic(&parking, 1).await;
    let t = s.topic.as_str();
    let day = 86_400_000;
    let letter = |no: &str, first_seen: i64| {
        dead_letter(t, no, pay(no, 1).account("a").body(), "handler_error")
            .header(Header::FirstSeen.name(), &first_seen.to_string())
    };
    // The old one last: a refused record holds the offset, the others are
    // committed past.
    produce(
        &s.dlt,
        &[
            letter("R-NEW", now_ms()),
            letter("R-LOOP", now_ms()).header(Header::Replays.name(), "5"),
            letter("R-OLD", now_ms() - 10 * day),
        ],
    )
    .await;

    let group = unique("replay");
    let dry = replay(&s, &group, &["--dry-run"]).await;
    assert_eq!(dry.code, 1, "refused letters fail the run: {dry:?}");
    assert!(
        dry.stdout
            .contains("would replay 1, skipped 0, failed 0, refused 1, would park 1"),
        "{}",
        dry.stdout
    );
    assert!(
        dry.stdout
            .contains("refused 1 dead letter(s) older than the dedup retention"),
        "{}",
        dry.stdout
    );
    assert!(dry.stdout.contains("after 5 replays"), "{}", dry.stdout);
    assert_eq!(
        committed(&group, &s.dlt, 1)[&0],
        -1,
        "the dry run commits nothing"
    );
    assert!(
        read_all(&parking, 1, 1, Duration::from_secs(2)).is_empty(),
        "the dry run parks nothing"
    );

    let run = replay(&s, &group, &[]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stdout
            .contains("replayed 1, skipped 0, failed 0, refused 1, parked 1"),
        "{}",
        run.stdout
    );
    assert!(
        run.stderr.contains("1 dead letter(s) refused"),
        "{}",
        run.stderr
    );
    assert_eq!(
        committed(&group, &s.dlt, 1)[&0],
        2,
        "committed past the replayed and the parked letter, not the refused one"
    );
    let parked = read_all(&parking, 1, 2, Duration::from_secs(5));
    assert_eq!(parked.len(), 1, "the cycling one is parked: {parked:?}");
    let m = &parked[0];
    assert_eq!(m.key(), Some("R-LOOP".as_bytes()));
    assert_eq!(
        header(m, Header::Replays.name()),
        Some("5"),
        "parked as it was"
    );
    assert_eq!(header(m, Header::Reason.name()), Some("handler_error"));
    assert_eq!(header(m, Header::OriginalTopic.name()), Some(t));

    let copies = read_all(&s.topic, 1, 2, Duration::from_secs(5));
    assert_eq!(copies.len(), 1, "only R-NEW went back: {copies:?}");
    let m = &copies[0];
    assert_eq!(m.key(), Some("R-NEW".as_bytes()));
    assert_eq!(header(m, Header::Replays.name()), Some("1"));
    assert_eq!(
        header(m, Header::Origin.name()),
        Some(format!("{t}/0@7").as_str()),
        "where the first delivery was consumed: the original coordinates"
    );
    assert_eq!(
        header(m, Header::ReplayedFrom.name()),
        Some(format!("{}/0/0", s.dlt).as_str())
    );
    assert!(
        header(m, Header::FirstSeen.name()).is_some(),
        "first-seen kept"
    );
    for gone in [
        Header::OriginalTopic.name(),
        Header::OriginalOffset.name(),
        Header::Reason.name(),
    ] {
        assert_eq!(header(m, gone), None, "{gone} stripped");
    }

    let run = replay(&s, &group, &["--beyond-retention"]).await;
    assert!(run.success, "{run:?}");
    assert!(
        run.stdout
            .contains("scanned 1, replayed 1, skipped 0, failed 0\n"),
        "{}",
        run.stdout
    );
    assert_eq!(committed(&group, &s.dlt, 1)[&0], 3);
    let copies = read_all(&s.topic, 1, 3, Duration::from_secs(5));
    assert_eq!(copies.len(), 2, "{copies:?}");
    assert_eq!(copies[1].key(), Some("R-OLD".as_bytes()));
    assert_eq!(header(&copies[1], Header::Replays.name()), Some("1"));
    assert_eq!(
        read_all(&parking, 1, 2, Duration::from_secs(2)).len(),
        1,
        "parked once"
    );
}

/// A real consumer whose handler fails one payment every time, replayed
/// again and again from the dead-letter topic: each copy counts its
/// replays (the consumer keeps the count when it dead-letters the copy),
/// and after `--max-replays` the letter goes to `<topic>.parked`, once,
/// instead of cycling; the ledger never kept a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_letter_that_keeps_failing_is_parked_after_max_replays() {
    const MAX_REPLAYS: u32 = 2;
    let s = setup("rpk_loop").await;
    let parking = format!("{}.parked", s.dlt);
    create_topic(&parking, 1).await;
    let handler = Arc::new(Declining::default());
    let payment = pay("L-1", 25).account("declined");
    produce(&s.topic, &[Record::new("L-1", payment.clone())]).await;
    drain(&s, Arc::clone(&handler)).await;
    let dead = read_all(&s.dlt, 1, 1, Duration::from_secs(10));
    assert_eq!(dead.len(), 1);
    assert_eq!(
        header(&dead[0], Header::Replays.name()),
        None,
        "never replayed yet"
    );

    let group = unique("replay");
    let max = MAX_REPLAYS.to_string();
    for cycle in 1..=MAX_REPLAYS {
        let run = replay(&s, &group, &["--max-replays", &max]).await;
        assert!(run.success, "cycle {cycle}: {run:?}");
        assert!(
            run.stdout
                .contains("scanned 1, replayed 1, skipped 0, failed 0\n"),
            "cycle {cycle}: {}",
            run.stdout
        );
        let n = cycle as usize;
        let copies = read_all(&s.topic, 1, n + 1, Duration::from_secs(10));
        assert_eq!(copies.len(), n + 1, "cycle {cycle}");
        assert_eq!(
            header(&copies[n], Header::Replays.name()),
            Some(cycle.to_string().as_str()),
            "cycle {cycle}: the copy counts its replays"
        );
        drain(&s, Arc::clone(&handler)).await;
        let dead = read_all(&s.dlt, 1, n + 2, Duration::from_secs(10));
        assert_eq!(dead.len(), n + 1, "cycle {cycle}: dead-lettered again");
        assert_eq!(
            header(&dead[n], Header::Replays.name()),
            Some(cycle.to_string().as_str()),
            "cycle {cycle}: the consumer kept the count"
        );
        assert_eq!(
            header(&dead[n], Header::Origin.name()),
            Some(format!("{}/0@0", s.topic).as_str()),
            "cycle {cycle}: the first delivery's coordinates"
        );
    }

    let run = replay(&s, &group, &["--max-replays", &max]).await;
    assert!(run.success, "{run:?}");
    assert!(
        run.stdout
            .contains("scanned 1, replayed 0, skipped 0, failed 0, parked 1"),
        "{}",
        run.stdout
    );
    let n = MAX_REPLAYS as usize;
    assert_eq!(
        read_all(&s.topic, 1, n + 2, Duration::from_secs(3)).len(),
        n + 1,
        "not replayed again"
    );
    // Nothing cycles any more: another replay finds nothing.
    let run = replay(&s, &group, &["--max-replays", &max]).await;
    assert!(run.stdout.contains("scanned 0"), "{}", run.stdout);
    let parked = read_all(&parking, 1, 2, Duration::from_secs(5));
    assert_eq!(parked.len(), 1, "parked exactly once");
    let m = &parked[0];
    assert_eq!(m.key(), Some("L-1".as_bytes()));
    assert_eq!(m.payload(), Some(payment.body().as_slice()));
    assert_eq!(header(m, Header::Replays.name()), Some(max.as_str()));
    assert_eq!(
        header(m, Header::Error.name()),
        Some("handler failed: payment L-1 of 25 EUR declined by the bank")
    );
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1 + n,
        "the first delivery and one per replay"
    );
    assert_eq!(rows(&s.pool).await, 0, "every credit was rolled back");
}
