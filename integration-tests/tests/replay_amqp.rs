//! `onceonly replay amqp` (the real binary) against RabbitMQ and the AMQP
//! consumer on PostgreSQL: replayed dead letters dedupe, conflicts stay
//! conflicts, filters and dry runs leave the queue alone, failures stay.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::options::{BasicGetOptions, BasicRejectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use onceonly::Header;
use onceonly::amqp::{AmqpConsumer, AmqpStats, CancellationToken};
use onceonly::{PgStore, SqlStore};
use onceonly_integration_tests::amqp::{
    Msg, connect, declare_queue, depth, header, publish, take, url,
};
use onceonly_integration_tests::cli::onceonly;
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::handler::{Declining, Outage, process_meanwhile};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{assert_exact, rows};
use onceonly_integration_tests::{pay, pg_store, unique};
use sqlx::PgPool;

struct Setup {
    queue: String,
    dlq: String,
    store: PgStore,
    pool: PgPool,
    /// The database (schema) of the dedup table and the ledger.
    db: String,
}

async fn setup(name: &str) -> Setup {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let queue = unique(name);
    let url = pg_schema(name).await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    declare_queue(&channel, &format!("{queue}.dlq")).await;
    Setup {
        dlq: format!("{queue}.dlq"),
        queue,
        pool: store.pool().clone(),
        store,
        db: url,
    }
}

/// Runs the consumer (one handler at a time) until the queue is idle.
async fn drain<H>(s: &Setup, handler: Arc<H>) -> AmqpStats
where
    H: onceonly::Handler<sqlx::Postgres> + 'static,
{
    let run = AmqpConsumer::builder(
        onceonly::Engine::builder(s.store.clone()).key_expr("json:/out_trade_no"),
    )
    .url(url())
    .queue(&s.queue)
    .concurrency(1)
    .exit_when_idle(Duration::from_secs(1))
    .build()
    .expect("consumer")
    .run_until(handler, CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("consumer did not drain within 60 s")
        .expect("consumer failed")
}

async fn replay(s: &Setup, extra: &[&str]) -> onceonly_integration_tests::cli::Run {
    let url = url();
    let mut args = vec![
        "replay",
        "amqp",
        "--url",
        url.as_str(),
        "--queue",
        s.dlq.as_str(),
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

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A dead letter as the consumer writes it, bound back to `queue`.
fn dead_letter(
    queue: &str,
    body: Vec<u8>,
    reason: &str,
    key: Option<&str>,
    first_seen: i64,
) -> Msg {
    let mut m = Msg::new(body);
    m.message_id = Some(unique("mid"));
    m.correlation_id = Some("corr-1".into());
    m.headers = vec![
        (Header::Reason.name().into(), reason.into()),
        (Header::Error.name().into(), "boom".into()),
        (Header::Attempts.name().into(), "3".into()),
        (Header::OriginalExchange.name().into(), String::new()),
        (Header::OriginalRoutingKey.name().into(), queue.into()),
        (Header::Queue.name().into(), queue.into()),
        (Header::FirstSeen.name().into(), first_seen.to_string()),
        ("trace-id".into(), "t-1".into()),
    ];
    if let Some(k) = key {
        m.headers
            .push((Header::IdempotencyKey.name().into(), k.into()));
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replayed_dead_letters_dedupe_against_keys_committed_meanwhile() {
    let s = setup("rpa_dedup").await;
    let (_conn, channel) = connect().await;
    // The downstream is down: four payments end in the dead-letter queue.
    let mut expected = BTreeMap::new();
    let mut messages = Vec::new();
    for i in 1..=4 {
        let no = format!("K-{i}");
        messages.push(Msg::new(pay(&no, 10 * i).account("acct")));
        expected.insert(no, ("acct".to_owned(), 10 * i));
    }
    publish(&channel, &s.queue, &messages).await;
    let stats = drain(&s, Arc::new(Outage::down())).await;
    assert_eq!(stats.consumer.dead_lettered, 4);
    assert_eq!(depth(&channel, &s.dlq).await, 4);
    // Meanwhile K-1 and K-2 were sent again and went through.
    process_meanwhile(&s.store, s.queue.as_str(), &expected, &["K-1", "K-2"]).await;

    let run = replay(&s, &[]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 4"), "{run:?}");
    assert_eq!(
        depth(&channel, &s.dlq).await,
        0,
        "replayed letters are acked"
    );
    assert_eq!(depth(&channel, &s.queue).await, 4);

    let handler = Arc::new(Outage::default());
    let stats = drain(&s, Arc::clone(&handler)).await;
    assert_exact(&s.pool, &expected).await;
    assert_eq!(
        handler.ledger.calls.load(Ordering::SeqCst),
        2,
        "only K-3 and K-4 ran"
    );
    assert_eq!(
        (stats.consumer.processed, stats.consumer.duplicates),
        (2, 2)
    );
    assert_eq!(
        depth(&channel, &s.dlq).await,
        0,
        "nothing dead-lettered again"
    );
    // The copies came through the default exchange: the stored source is
    // `queue/routing-key`, without an empty exchange segment.
    let source: String =
        sqlx::query_scalar("SELECT source FROM onceonly_keys WHERE idem_key = 'K-3'")
            .fetch_one(&s.pool)
            .await
            .unwrap();
    assert_eq!(source, format!("{}/{}", s.queue, s.queue));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_fingerprint_mismatch_is_still_a_conflict() {
    let s = setup("rpa_conflict").await;
    let (_conn, channel) = connect().await;
    publish(
        &channel,
        &s.queue,
        &[
            Msg::new(pay("P-1", 10).account("alice")),
            Msg::new(pay("P-1", 999).account("alice")),
        ],
    )
    .await;
    let handler = Arc::new(Outage::default());
    drain(&s, Arc::clone(&handler)).await;
    assert_eq!(depth(&channel, &s.dlq).await, 1);

    // Replay while the consumer runs: the conflict comes straight back to
    // the dead-letter queue, and the run must not read it a second time.
    // The consumer stops once idle, so every ack and dead letter is done
    // when its stats come back.
    let consumer = tokio::spawn(
        AmqpConsumer::builder(
            onceonly::Engine::builder(s.store.clone()).key_expr("json:/out_trade_no"),
        )
        .url(url())
        .queue(&s.queue)
        .exit_when_idle(Duration::from_secs(3))
        .build()
        .expect("consumer")
        .run_until(Arc::clone(&handler), CancellationToken::new()),
    );
    let run = replay(&s, &[]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("scanned 1, replayed 1"), "{run:?}");
    let stats = tokio::time::timeout(Duration::from_secs(60), consumer)
        .await
        .expect("consumer did not go idle within 60 s")
        .unwrap()
        .expect("consumer");
    assert_eq!(
        depth(&channel, &s.dlq).await,
        1,
        "back in the dead-letter queue"
    );
    assert_eq!(stats.consumer.dead_lettered, 1, "dead-lettered again");
    assert_eq!(
        handler.ledger.calls.load(Ordering::SeqCst),
        1,
        "the handler never ran for the conflict"
    );
    let expected = BTreeMap::from([("P-1".to_owned(), ("alice".to_owned(), 10))]);
    assert_exact(&s.pool, &expected).await;
    let dead = take(&channel, &s.dlq, 1, Duration::from_secs(5)).await;
    assert_eq!(dead.len(), 1);
    let p = &dead[0].delivery.properties;
    assert_eq!(
        header(p, Header::Reason.name()).as_deref(),
        Some("fingerprint_mismatch")
    );
    assert_eq!(
        header(p, Header::ReplayedFrom.name()).as_deref(),
        Some(s.dlq.as_str())
    );
    assert_eq!(
        dead[0].delivery.data,
        pay("P-1", 999).account("alice").body()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filters_dry_run_and_limit_leave_the_rest_in_the_queue() {
    let s = setup("rpa_filter").await;
    let (_conn, channel) = connect().await;
    let now = now_ms();
    let old = now - 3 * 24 * 3600 * 1000;
    let q = s.queue.as_str();
    publish(
        &channel,
        &s.dlq,
        &[
            dead_letter(
                q,
                pay("F-1", 1).account("a").body(),
                "handler_error",
                Some("F-1"),
                now,
            ),
            dead_letter(q, b"{not json".to_vec(), "decode_error", None, now),
            dead_letter(
                q,
                pay("F-3", 3).account("a").body(),
                "handler_error",
                Some("F-3"),
                old,
            ),
            dead_letter(q, br#"{"amount":4}"#.to_vec(), "bad_key", None, now),
        ],
    )
    .await;

    let run = replay(&s, &["--dry-run"]).await;
    assert!(run.success, "{run:?}");
    assert_eq!(
        run.stdout
            .lines()
            .filter(|l| l.starts_with("would replay "))
            .count(),
        4,
        "{run:?}"
    );
    assert_eq!(
        depth(&channel, &s.dlq).await,
        4,
        "a dry run changes nothing"
    );
    assert_eq!(depth(&channel, &s.queue).await, 0);

    let run = replay(&s, &["--key", "F-3", "--dry-run"]).await;
    assert!(run.success, "{run:?}");
    assert_eq!(
        run.stdout
            .lines()
            .filter(|l| l.starts_with("would replay "))
            .count(),
        1,
        "{run:?}"
    );
    assert!(run.stdout.contains("key F-3"), "{run:?}");

    let run = replay(&s, &["--reason", "handler_error", "--since", "1h"]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 1, skipped 3"), "{run:?}");
    assert_eq!(
        depth(&channel, &s.dlq).await,
        3,
        "filtered-out letters stay"
    );
    let replayed = take(&channel, &s.queue, 1, Duration::from_secs(5)).await;
    assert_eq!(replayed.len(), 1);
    let m = &replayed[0].delivery;
    assert_eq!(m.data, pay("F-1", 1).account("a").body());
    let p = &m.properties;
    for gone in [
        Header::Reason.name(),
        Header::Error.name(),
        Header::Attempts.name(),
    ] {
        assert_eq!(header(p, gone), None, "{gone} stripped");
    }
    assert_eq!(
        header(p, Header::IdempotencyKey.name()).as_deref(),
        Some("F-1")
    );
    assert_eq!(header(p, "trace-id").as_deref(), Some("t-1"));
    assert_eq!(
        header(p, Header::ReplayedFrom.name()).as_deref(),
        Some(s.dlq.as_str())
    );
    assert_eq!(
        p.correlation_id().as_ref().map(|c| c.as_str()),
        Some("corr-1")
    );
    assert!(p.message_id().is_some());

    let run = replay(&s, &["--limit", "2", "--rate", "20/s"]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 2"), "{run:?}");
    assert_eq!(depth(&channel, &s.dlq).await, 1, "the limit leaves one");
    assert_eq!(depth(&channel, &s.queue).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_dead_lettered_messages_go_back_by_x_death() {
    let s = setup("rpa_xdeath").await;
    let (_conn, channel) = connect().await;
    // A work queue dead-lettering by RabbitMQ itself into the DLQ.
    let work = unique("rpa_work");
    let mut args = FieldTable::default();
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from(s.dlq.as_bytes())),
    );
    channel
        .queue_declare(
            work.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await
        .unwrap();
    publish(&channel, &work, &[Msg::new(pay("X-1", 1).account("a"))]).await;
    let got = channel
        .basic_get(work.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("a message");
    got.delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while depth(&channel, &s.dlq).await < 1 {
        assert!(std::time::Instant::now() < deadline, "not dead-lettered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let run = replay(&s, &[]).await;
    assert!(run.success, "{run:?}");
    assert_eq!(depth(&channel, &s.dlq).await, 0);
    let back = take(&channel, &work, 1, Duration::from_secs(5)).await;
    assert_eq!(back.len(), 1, "back in the work queue");
    assert_eq!(back[0].delivery.data, pay("X-1", 1).account("a").body());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_republish_leaves_the_letter_and_fails_the_run() {
    let s = setup("rpa_fail").await;
    let (_conn, channel) = connect().await;
    let now = now_ms();
    let mut gone_exchange = dead_letter(
        &s.queue,
        pay("G-1", 1).account("a").body(),
        "handler_error",
        Some("G-1"),
        now,
    );
    gone_exchange.headers[3].1 = unique("no_such_exchange");
    let good = dead_letter(
        &s.queue,
        pay("G-2", 2).account("a").body(),
        "handler_error",
        Some("G-2"),
        now,
    );
    let unroutable = dead_letter(
        &unique("no_such_queue"),
        pay("G-3", 3).account("a").body(),
        "handler_error",
        Some("G-3"),
        now,
    );
    publish(&channel, &s.dlq, &[gone_exchange, good, unroutable]).await;

    let run = replay(&s, &[]).await;
    eprintln!("what the operator sees:\n{}{}", run.stdout, run.stderr);
    assert!(!run.success, "{run:?}");
    assert!(
        run.stdout.contains("replayed 1, skipped 0, failed 2"),
        "{run:?}"
    );
    assert!(
        run.stderr
            .contains("2 dead letter(s) could not be replayed"),
        "{run:?}"
    );
    assert!(
        run.stderr.contains("NOT_FOUND") || run.stderr.contains("not found"),
        "{run:?}"
    );
    assert!(run.stderr.contains("unroutable"), "{run:?}");
    assert_eq!(depth(&channel, &s.dlq).await, 2, "failed letters stay");
    assert_eq!(
        depth(&channel, &s.queue).await,
        1,
        "the good one went through"
    );
}

/// A dead letter whose original exchange fans out: by default the copy goes
/// back to that exchange (every bound queue gets it again); `--to-queue`
/// sends it only to the queue that dead-lettered it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn to_queue_replays_only_to_the_dead_lettering_queue() {
    use lapin::ExchangeKind;
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    let s = setup("rpa_toq").await;
    let (_conn, channel) = connect().await;
    let fanout = unique("rpa_fan");
    let other = unique("rpa_other");
    declare_queue(&channel, &other).await;
    channel
        .exchange_declare(
            fanout.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for q in [&s.queue, &other] {
        channel
            .queue_bind(
                q.as_str().into(),
                fanout.as_str().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    let letter = |no: &str| {
        let mut m = dead_letter(
            &s.queue,
            pay(no, 1).account("a").body(),
            "handler_error",
            Some(no),
            now_ms(),
        );
        m.headers[3].1 = fanout.clone();
        m.headers[4].1 = String::new();
        m
    };
    publish(&channel, &s.dlq, &[letter("F-1")]).await;
    let run = replay(&s, &["--to-queue"]).await;
    assert!(run.success, "{run:?}");
    assert_eq!(
        depth(&channel, &s.queue).await,
        1,
        "the copy went to its queue"
    );
    assert_eq!(depth(&channel, &other).await, 0, "and to no other queue");
    assert_eq!(depth(&channel, &s.dlq).await, 0);

    publish(&channel, &s.dlq, &[letter("F-2")]).await;
    let run = replay(&s, &[]).await;
    assert!(run.success, "{run:?}");
    assert_eq!(depth(&channel, &s.queue).await, 2);
    assert_eq!(
        depth(&channel, &other).await,
        1,
        "through the original fanout exchange every bound queue gets a copy"
    );
}

/// The dedup table's records and the ledger's rows: what a dry run must not
/// change.
async fn table_rows(pool: &PgPool) -> (i64, i64) {
    let keys = sqlx::query_scalar("SELECT COUNT(*) FROM onceonly_keys")
        .fetch_one(pool)
        .await
        .unwrap();
    let ledger = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    (keys, ledger)
}

/// Letters of three real failures (the consumer's own dead letters): the
/// handler's downstream is down (3), a key reused with another payload (2),
/// no key at all (2). `dlq groups` finds the three groups without consuming
/// anything; a dry run with the dedup table splits them into new work,
/// duplicates, conflicts and unknown without changing anything; `replay
/// --group` replays one group only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_in_failure_groups_dry_run_and_replay_of_one_group() {
    let s = setup("rpa_groups").await;
    let (_conn, channel) = connect().await;
    let mut expected = BTreeMap::new();
    for (no, amount) in [("G-1", 10), ("G-2", 20)] {
        expected.insert(no.to_owned(), ("acct".to_owned(), amount));
    }
    publish(
        &channel,
        &s.queue,
        &[
            Msg::new(pay("G-1", 10).account("acct")),
            Msg::new(pay("G-2", 20).account("acct")),
            // The same keys with other payloads: fingerprint_mismatch.
            Msg::new(pay("G-1", 999).account("acct")),
            Msg::new(pay("G-2", 555).account("acct")),
            // No key: bad_key.
            Msg::new(&br#"{"amount": 5}"#[..]),
            Msg::new(&br#"{"amount": 7, "account": "x"}"#[..]),
        ],
    )
    .await;
    let stats = drain(&s, Arc::new(Outage::default())).await;
    assert_eq!(
        (stats.consumer.processed, stats.consumer.dead_lettered),
        (2, 4)
    );
    let mut down = Vec::new();
    for (no, amount) in [("G-3", 30), ("G-4", 40), ("G-5", 50)] {
        expected.insert(no.to_owned(), ("acct".to_owned(), amount));
        down.push(Msg::new(pay(no, amount).account("acct")));
    }
    publish(&channel, &s.queue, &down).await;
    let stats = drain(&s, Arc::new(Outage::down())).await;
    assert_eq!(stats.consumer.dead_lettered, 3);
    assert_eq!(depth(&channel, &s.dlq).await, 7);

    // Three groups, nothing consumed.
    let url = url();
    let groups = onceonly(&[
        "dlq", "groups", "amqp", "--url", &url, "--queue", &s.dlq, "--json",
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
            ("bad_key", 2),
            ("fingerprint_mismatch", 2),
            ("handler_error", 3)
        ],
        "{}",
        groups.stdout
    );
    assert_eq!(
        depth(&channel, &s.dlq).await,
        7,
        "dlq groups consumed nothing"
    );
    let text = onceonly(&["dlq", "groups", "amqp", "--url", &url, "--queue", &s.dlq]).await;
    assert!(text.success, "{text:?}");
    assert!(
        text.stdout.contains("7 dead letters in 3 groups"),
        "{}",
        text.stdout
    );
    let handler_group = by_reason["handler_error"].1.clone();
    assert!(text.stdout.contains(&handler_group), "{}", text.stdout);

    // Meanwhile G-3 was sent again and went through.
    process_meanwhile(&s.store, s.queue.as_str(), &expected, &["G-3"]).await;
    let before = table_rows(&s.pool).await;
    let db = s.db.clone();
    let dry = replay(&s, &["--dry-run", "--database-url", &db]).await;
    assert!(dry.success, "{dry:?}");
    assert!(
        dry.stdout.contains(
            "would be: 2 new, 1 duplicates (answered, no effect), 2 conflicts, 2 unknown"
        ),
        "{}",
        dry.stdout
    );
    let group_line = dry
        .stdout
        .lines()
        .find(|l| l.starts_with(&handler_group))
        .unwrap_or_else(|| panic!("no line for {handler_group}: {}", dry.stdout));
    let columns: Vec<&str> = group_line.split_whitespace().collect();
    // id, reason, letters, first seen, last seen, new, duplicate, conflict, unknown, refused, parked
    assert_eq!(
        &columns[5..11],
        ["2", "1", "0", "0", "0", "0"],
        "{group_line}"
    );
    assert_eq!(
        depth(&channel, &s.dlq).await,
        7,
        "the dry run consumed nothing"
    );
    assert_eq!(depth(&channel, &s.queue).await, 0, "and published nothing");
    assert_eq!(table_rows(&s.pool).await, before, "and wrote nothing");

    // Replay only the handler's group.
    let run = replay(&s, &["--group", &handler_group, "--database-url", &db]).await;
    assert!(run.success, "{run:?}");
    assert!(
        run.stdout.contains("replayed 3, skipped 4"),
        "{}",
        run.stdout
    );
    assert_eq!(depth(&channel, &s.dlq).await, 4, "the other groups stay");
    let handler = Arc::new(Outage::default());
    let stats = drain(&s, Arc::clone(&handler)).await;
    assert_eq!(
        (stats.consumer.processed, stats.consumer.duplicates),
        (2, 1)
    );
    assert_exact(&s.pool, &expected).await;
}

/// A letter older than the dedup retention is refused unless
/// `--beyond-retention`; a letter replayed too often is parked; replayed
/// copies count their replays and keep their origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn old_letters_are_refused_and_cycling_letters_are_parked() {
    let s = setup("rpa_retain").await;
    let (_conn, channel) = connect().await;
    let parking = format!("{}.parked", s.dlq);
    let day = 86_400_000;
    let old = dead_letter(
        &s.queue,
        pay("R-OLD", 1).account("a").body(),
        "handler_error",
        Some("R-OLD"),
        now_ms() - 10 * day,
    );
    let fresh = dead_letter(
        &s.queue,
        pay("R-NEW", 1).account("a").body(),
        "handler_error",
        Some("R-NEW"),
        now_ms(),
    );
    let mut cycling = dead_letter(
        &s.queue,
        pay("R-LOOP", 1).account("a").body(),
        "handler_error",
        Some("R-LOOP"),
        now_ms(),
    );
    cycling
        .headers
        .push(("x-onceonly-replays".into(), "5".into()));
    publish(&channel, &s.dlq, &[old, fresh, cycling]).await;

    let dry = replay(&s, &["--dry-run"]).await;
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
    assert_eq!(depth(&channel, &s.dlq).await, 3);

    let run = replay(&s, &[]).await;
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
    assert_eq!(depth(&channel, &s.dlq).await, 1, "the old letter stays");
    assert_eq!(
        depth(&channel, &parking).await,
        1,
        "the cycling one is parked"
    );
    let copy = take(&channel, &s.queue, 1, Duration::from_secs(5)).await;
    let p = &copy[0].delivery.properties;
    assert_eq!(
        header(p, Header::IdempotencyKey.name()).as_deref(),
        Some("R-NEW")
    );
    assert_eq!(header(p, "x-onceonly-replays").as_deref(), Some("1"));
    assert_eq!(
        header(p, "x-onceonly-origin"),
        Some(format!("{q}/{q}", q = s.queue)),
        "where the first delivery came from, as its stored source says it"
    );

    let run = replay(&s, &["--beyond-retention"]).await;
    assert!(run.success, "{run:?}");
    assert!(run.stdout.contains("replayed 1"), "{}", run.stdout);
    assert_eq!(depth(&channel, &s.dlq).await, 0);
}

/// A header of the message at the head of `queue`, which stays there: taken
/// with `basic.get` and rejected with requeue (`None`: no such header;
/// panics if the queue is empty).
async fn peek_header(channel: &lapin::Channel, queue: &str, name: &str) -> Option<String> {
    let got = channel
        .basic_get(queue.into(), BasicGetOptions::default())
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{queue} is empty"));
    let value = header(&got.delivery.properties, name);
    got.delivery
        .acker
        .reject(BasicRejectOptions { requeue: true })
        .await
        .unwrap();
    value
}

/// A real consumer whose handler fails one payment every time: the
/// consumer dead-letters it, `onceonly replay` sends it back, it fails
/// again, ... Each copy counts its replays, and the letter that came back
/// `--max-replays` times is parked instead of replayed: it ends in the
/// parking queue, once, and the ledger never kept a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_letter_that_keeps_failing_is_parked_after_max_replays() {
    const MAX_REPLAYS: u32 = 3;
    let s = setup("rpa_loop").await;
    let (_conn, channel) = connect().await;
    let parking = format!("{}.parked", s.dlq);
    let handler = Arc::new(Declining::default());
    let payment = pay("L-1", 25).account("declined");
    publish(&channel, &s.queue, &[Msg::new(payment.clone())]).await;
    let stats = drain(&s, Arc::clone(&handler)).await;
    assert_eq!(stats.consumer.dead_lettered, 1);
    assert_eq!(depth(&channel, &s.dlq).await, 1);
    assert_eq!(
        peek_header(&channel, &s.dlq, Header::Replays.name()).await,
        None,
        "never replayed yet"
    );

    let max = MAX_REPLAYS.to_string();
    for cycle in 1..=MAX_REPLAYS {
        let run = replay(&s, &["--max-replays", &max]).await;
        assert!(run.success, "cycle {cycle}: {run:?}");
        assert!(
            run.stdout
                .contains("scanned 1, replayed 1, skipped 0, failed 0\n"),
            "cycle {cycle}: {}",
            run.stdout
        );
        assert_eq!(depth(&channel, &s.dlq).await, 0, "cycle {cycle}");
        assert_eq!(
            peek_header(&channel, &s.queue, Header::Replays.name())
                .await
                .as_deref(),
            Some(cycle.to_string().as_str()),
            "cycle {cycle}: the copy counts its replays"
        );
        let stats = drain(&s, Arc::clone(&handler)).await;
        assert_eq!(
            (stats.consumer.processed, stats.consumer.dead_lettered),
            (0, 1),
            "cycle {cycle}: failed again"
        );
        assert_eq!(depth(&channel, &s.dlq).await, 1, "cycle {cycle}");
        assert_eq!(
            peek_header(&channel, &s.dlq, Header::Replays.name())
                .await
                .as_deref(),
            Some(cycle.to_string().as_str()),
            "cycle {cycle}: the consumer kept the count when it dead-lettered the copy"
        );
    }

    // Replayed MAX_REPLAYS times and failed each time: parked.
    let run = replay(&s, &["--max-replays", &max]).await;
    assert!(run.success, "{run:?}");
    assert!(
        run.stdout
            .contains("scanned 1, replayed 0, skipped 0, failed 0, parked 1"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains(&format!("after {MAX_REPLAYS} replays")),
        "{}",
        run.stdout
    );
    assert_eq!(depth(&channel, &s.dlq).await, 0);
    assert_eq!(depth(&channel, &s.queue).await, 0, "not replayed again");
    // Nothing cycles any more: the consumer and another replay find nothing.
    let stats = drain(&s, Arc::clone(&handler)).await;
    assert_eq!(
        (stats.consumer.processed, stats.consumer.dead_lettered),
        (0, 0)
    );
    let run = replay(&s, &["--max-replays", &max]).await;
    assert!(run.stdout.contains("scanned 0"), "{}", run.stdout);

    let parked = take(&channel, &parking, 2, Duration::from_secs(3)).await;
    assert_eq!(parked.len(), 1, "parked exactly once");
    let m = &parked[0].delivery;
    assert_eq!(m.data, payment.body());
    let p = &m.properties;
    assert_eq!(
        header(p, Header::Replays.name()),
        Some(MAX_REPLAYS.to_string())
    );
    assert_eq!(
        header(p, Header::Reason.name()).as_deref(),
        Some("handler_error")
    );
    assert_eq!(
        header(p, Header::IdempotencyKey.name()).as_deref(),
        Some("L-1")
    );
    assert_eq!(
        header(p, Header::Error.name()).as_deref(),
        Some("handler failed: payment L-1 of 25 EUR declined by the bank"),
        "parked as it was, with the last failure"
    );
    assert_eq!(
        header(p, Header::Origin.name()),
        Some(format!("{q}/{q}", q = s.queue)),
        "where it was first consumed"
    );
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1 + MAX_REPLAYS as usize,
        "the first delivery and one per replay"
    );
    assert_eq!(rows(&s.pool).await, 0, "every credit was rolled back");
}

/// Real letters of one failure whose error texts differ only in the key
/// and the amount are one group; another error text is another group,
/// though the reason is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn error_texts_that_differ_in_keys_and_amounts_are_one_group() {
    let s = setup("rpa_mask").await;
    let (_conn, channel) = connect().await;
    // Keys without digits: only the key masking can merge them.
    publish(
        &channel,
        &s.queue,
        &[
            Msg::new(pay("ORD-alpha", 1050).account("declined")),
            Msg::new(pay("ORD-beta", 7).account("declined")),
            Msg::new(pay("ORD-gamma", 99_999).account("declined")),
            Msg::new(pay("ORD-delta", 12).account("frozen")),
            Msg::new(pay("ORD-epsilon", 340).account("frozen")),
        ],
    )
    .await;
    let stats = drain(&s, Arc::new(Declining::default())).await;
    assert_eq!(stats.consumer.dead_lettered, 5);

    let url = url();
    let groups = onceonly(&[
        "dlq", "groups", "amqp", "--url", &url, "--queue", &s.dlq, "--json",
    ])
    .await;
    assert!(groups.success, "{groups:?}");
    let json: serde_json::Value = serde_json::from_str(&groups.stdout).expect("JSON");
    let mut found: Vec<(String, String, u64)> = json["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["reason"].as_str().unwrap().to_owned(),
                g["pattern"].as_str().unwrap().to_owned(),
                g["count"].as_u64().unwrap(),
            )
        })
        .collect();
    found.sort();
    assert_eq!(
        found,
        [
            (
                "handler_error".to_owned(),
                "handler failed: account frozen: payment <key> of # EUR refused".to_owned(),
                2
            ),
            (
                "handler_error".to_owned(),
                "handler failed: payment <key> of # EUR declined by the bank".to_owned(),
                3
            ),
        ],
        "{}",
        groups.stdout
    );
    let text = onceonly(&["dlq", "groups", "amqp", "--url", &url, "--queue", &s.dlq]).await;
    assert!(
        text.stdout.contains("5 dead letters in 2 groups"),
        "{}",
        text.stdout
    );
    assert_eq!(
        depth(&channel, &s.dlq).await,
        5,
        "dlq groups consumed nothing"
    );
    assert_eq!(rows(&s.pool).await, 0);
}

/// Issue 44, defect 11: without the dedup table nothing tells the
/// consumers' retention, and none is assumed: `replay` (dry run or not)
/// refuses to start without `--retention` or `--database-url`, and a
/// dated letter of a scope whose retention the table does not know is
/// refused, however young; with `--retention` the same letter replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_assumes_no_retention() {
    let s = setup("rpa_noret").await;
    let (_conn, channel) = connect().await;
    let letter = dead_letter(
        &s.queue,
        pay("NR-1", 5).account("a").body(),
        "handler_error",
        Some("NR-1"),
        now_ms() - 2 * 86_400_000,
    );
    publish(&channel, &s.dlq, &[letter]).await;
    let u = url();
    for dry in [true, false] {
        let mut args = vec![
            "replay",
            "amqp",
            "--url",
            u.as_str(),
            "--queue",
            s.dlq.as_str(),
        ];
        if dry {
            args.push("--dry-run");
        }
        let run = onceonly(&args).await;
        assert!(!run.success, "{run:?}");
        assert!(run.stderr.contains("--retention"), "{}", run.stderr);
    }
    assert_eq!(depth(&channel, &s.dlq).await, 1, "nothing was replayed");
    // The dedup table knows no record of the letter's scope: its retention
    // is unknown, the letter is refused.
    let run = replay(&s, &["--database-url", s.db.as_str()]).await;
    assert!(!run.success, "{run:?}");
    assert!(run.stdout.contains("refused"), "{}", run.stdout);
    assert_eq!(depth(&channel, &s.dlq).await, 1, "refused, it stays");
    // The operator says the consumers keep records 3 days: it replays.
    let run = replay(&s, &["--retention", "3d"]).await;
    assert!(run.success, "{run:?}");
    assert_eq!(depth(&channel, &s.dlq).await, 0);
}
