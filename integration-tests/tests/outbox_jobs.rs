//! The outbox without a claim ([`Outbox::enqueue_in`]) and delayed
//! messages ([`OutboxMessage::delay`], [`OutboxMessage::not_before`]), on
//! PostgreSQL, MariaDB and SQLite:
//!
//! - a message enqueued in a plain transaction leaves only if that
//!   transaction commits; enqueuing the same caller id again adds nothing;
//! - a delayed message is not sent before it is due, holds back the
//!   messages behind it in its ordering key (and only those), is counted
//!   apart from the backlog, and `onceonly outbox` shows it as delayed;
//! - crash safety: a scheduled job (`outbox_job`, a child process) and the
//!   relay (`onceonly relay`, the real binary) are SIGKILLed at random
//!   moments, again and again, while the job enqueues immediate and delayed
//!   reminders: every invoice is reminded once in the database, its
//!   reminder leaves with one message id, each customer's reminders reach
//!   Kafka in the order they were enqueued (a delayed one holds back those
//!   behind it), and no delayed reminder reaches Kafka before it was due.

use onceonly::Header;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use onceonly::outbox::{
    Kind, Outbox, OutboxBackend, OutboxMessage, Outgoing, PublishError, Publisher, Relay, Status,
};
use onceonly::{SqlStore, SqliteStore};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::cli::{onceonly, onceonly_binary};
use onceonly_integration_tests::kafka::{brokers, create_topic, header, pg_schema, read_to_end};
use onceonly_integration_tests::{mysql_store, mysql_url, pg_store, pg_url, unique};
use rdkafka::Message;

fn now_ms() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// Records each published message: `(key, caller-visible message id, ms
/// since the Unix epoch when published)`.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<(String, String, i64)>>,
}

impl Recorder {
    fn seen(&self) -> Vec<(String, String, i64)> {
        self.seen.lock().unwrap().clone()
    }

    fn published(&self, id: &str) -> Option<i64> {
        self.seen()
            .iter()
            .find(|(_, i, _)| i == id)
            .map(|(_, _, at)| *at)
    }
}

#[async_trait]
impl Publisher for Recorder {
    fn kind(&self) -> Kind {
        Kind::Kafka
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        let key = String::from_utf8(message.row.message_key.clone().unwrap_or_default())
            .unwrap_or_default();
        let id = message
            .headers
            .iter()
            .find(|(n, _)| n == Header::MessageId.name())
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        self.seen.lock().unwrap().push((key, id, now_ms()));
        Ok(())
    }
}

/// Enqueues `message` in a transaction of its own, committed or rolled
/// back; its id.
async fn enqueue<DB: OutboxBackend>(
    pool: &sqlx::Pool<DB>,
    outbox: &Outbox<DB>,
    message: OutboxMessage,
    commit: bool,
) -> String {
    let mut tx = pool.begin().await.expect("begin");
    let id = outbox
        .enqueue_in(&mut tx, "jobs", message)
        .await
        .expect("enqueue");
    if commit {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    id
}

const DELAY: Duration = Duration::from_millis(4000);

/// The claimless and delayed cases on one backend; returns the outbox
/// after the relay sent everything, for backend-specific checks.
async fn claimless_and_delayed<DB: OutboxBackend>(pool: &sqlx::Pool<DB>, outbox: &Outbox<DB>) {
    outbox.migrate(pool).await.expect("migrate");
    let msg = |key: &str, id: &str| OutboxMessage::kafka("reminders", key, id.to_owned()).id(id);

    // A rolled-back transaction sends nothing.
    enqueue(pool, outbox, msg("k1", "rolled-back"), false).await;
    // The same caller id twice: one row, the same message id.
    let a = enqueue(pool, outbox, msg("k1", "a"), true).await;
    let again = enqueue(pool, outbox, msg("k1", "a"), true).await;
    assert_eq!(a, again, "a caller id gives one message id");
    // k1: a, then b delayed but ordered by k1, then c (waits for b);
    // k2: e delayed (ordered alone), then d (does not wait for it); k4: f
    // not before a time in the past (due now).
    let enqueued_at = now_ms();
    let b = enqueue(
        pool,
        outbox,
        msg("k1", "b").delay(DELAY).order_by("k1"),
        true,
    )
    .await;
    let c = enqueue(pool, outbox, msg("k1", "c"), true).await;
    let e = enqueue(pool, outbox, msg("k2", "e").delay(DELAY), true).await;
    let d = enqueue(pool, outbox, msg("k2", "d"), true).await;
    let f = enqueue(
        pool,
        outbox,
        msg("k4", "f").not_before(SystemTime::now() - Duration::from_secs(60)),
        true,
    )
    .await;
    // Without a caller id, each enqueue is a new message.
    let random = OutboxMessage::kafka("reminders", "k3", "x");
    let (r1, r2) = (
        enqueue(pool, outbox, random.clone(), true).await,
        enqueue(pool, outbox, random, true).await,
    );
    assert_ne!(r1, r2);

    let stats = outbox.stats(pool).await.expect("stats");
    assert_eq!(stats.rows(Status::Pending), 8, "{stats:?}");
    assert_eq!(stats.delayed(), 2, "{stats:?}");
    assert_eq!(stats.backlog(), 6, "delayed messages are not backlog yet");
    let rows = outbox.list(pool, Status::Pending, 10).await.expect("list");
    let row = |id: &str| rows.iter().find(|r| r.row.message_id == id).unwrap();
    assert_eq!(row(&a).row.scope, "jobs");
    assert_eq!(row(&a).row.causation, None, "no claim, no causation");
    let due = row(&b).created_at_ms;
    let due_e = row(&e).created_at_ms;
    assert!(
        due >= enqueued_at + DELAY.as_millis() as i64,
        "the delayed row is due after its delay"
    );

    let recorder = Arc::new(Recorder::default());
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(Arc::clone(&recorder))
        .poll_interval(Duration::from_millis(20))
        .build()
        .expect("relay")
        .spawn();
    // a, d, f and the random ones leave at once; b and c (behind b in
    // k1), and e, wait.
    let deadline = Instant::now() + Duration::from_secs(30);
    let first: BTreeSet<String> = [&a, &d, &f, &r1, &r2].map(String::clone).into();
    while recorder.seen().len() < first.len() {
        assert!(Instant::now() < deadline, "{:?}", recorder.seen());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen: BTreeSet<String> = recorder.seen().into_iter().map(|(_, id, _)| id).collect();
    assert_eq!(
        seen, first,
        "before b and e are due, neither they nor c (behind b) left"
    );
    while recorder.seen().len() < 8 {
        assert!(Instant::now() < deadline, "{:?}", recorder.seen());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.stop().await;
    let seen = recorder.seen();
    assert_eq!(seen.len(), 8, "each message once: {seen:?}");
    for (delayed, due) in [(&b, due), (&e, due_e)] {
        let at = recorder.published(delayed).unwrap();
        assert!(at >= due, "a delayed message left {} ms early", due - at);
    }
    let k1: Vec<&str> = seen
        .iter()
        .filter(|(k, _, _)| k == "k1")
        .map(|(_, id, _)| id.as_str())
        .collect();
    assert_eq!(k1, [a.as_str(), b.as_str(), c.as_str()], "k1 in order");
    assert!(
        recorder.published(&d).unwrap() < recorder.published(&e).unwrap(),
        "d did not wait for e, a delayed message ordered alone"
    );
    assert_eq!(
        outbox.stats(pool).await.expect("stats").rows(Status::Sent),
        8
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimless_and_delayed_messages_on_postgres() {
    let url = pg_url();
    let store = pg_store(&url, &unique("objk")).await;
    let table = unique("objx");
    let outbox = Outbox::<sqlx::Postgres>::on_table(&table).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");

    // What `onceonly outbox` shows of a delayed message.
    let id = enqueue(
        store.pool(),
        &outbox,
        OutboxMessage::webhook("https://example.com/h", "{}").delay(Duration::from_secs(3600)),
        true,
    )
    .await;
    let stats = onceonly(&[
        "outbox",
        "stats",
        "--database-url",
        &url,
        "--outbox-table",
        &table,
    ])
    .await;
    assert!(stats.success, "{}", stats.stderr);
    assert!(
        stats.stdout.contains("backlog: 0 pending"),
        "{}",
        stats.stdout
    );
    assert!(
        stats.stdout.contains("delayed: 1 not due yet"),
        "{}",
        stats.stdout
    );
    let inspect = onceonly(&[
        "outbox",
        "inspect",
        "--database-url",
        &url,
        "--outbox-table",
        &table,
        "--message-id",
        &id,
    ])
    .await;
    assert!(inspect.success, "{}", inspect.stderr);
    assert!(
        inspect.stdout.contains("delayed:      until"),
        "{}",
        inspect.stdout
    );
    assert!(inspect.stdout.contains("scope:        jobs"));
    sqlx::query(&format!("DELETE FROM {table}"))
        .execute(store.pool())
        .await
        .unwrap();

    claimless_and_delayed(store.pool(), &outbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimless_and_delayed_messages_on_postgres_generations() {
    let store = pg_store(&pg_url(), &unique("objk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("objg"))
        .expect("table")
        .generations(true);
    claimless_and_delayed(store.pool(), &outbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimless_and_delayed_messages_on_mariadb() {
    let store = mysql_store(&mysql_url(), &unique("objk")).await;
    let outbox = Outbox::<sqlx::MySql>::on_table(&unique("objx")).expect("table");
    claimless_and_delayed(store.pool(), &outbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimless_and_delayed_messages_on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("jobs.db"))
        .await
        .expect("sqlite");
    store.migrate().await.expect("migrate");
    let outbox = Outbox::<sqlx::Sqlite>::new();
    claimless_and_delayed(store.pool(), &outbox).await;
}

/// Records like [`Recorder`], but the first attempt of the message whose
/// payload is `fail_once` fails (retryable).
struct FailsOnce {
    recorder: Arc<Recorder>,
    fail_once: Mutex<Option<String>>,
}

#[async_trait]
impl Publisher for FailsOnce {
    fn kind(&self) -> Kind {
        Kind::Kafka
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        let payload = String::from_utf8_lossy(&message.row.payload).into_owned();
        let fail = {
            let mut once = self.fail_once.lock().unwrap();
            if once.as_deref() == Some(payload.as_str()) {
                once.take()
            } else {
                None
            }
        };
        if fail.is_some() {
            return Err(PublishError::retryable("failing once"));
        }
        self.recorder.publish(message).await
    }
}

/// Issue 44, defects 4 and 8: a key's messages leave in the order their
/// transactions committed (T1 enqueues for `acct-1`, T2 enqueues for it
/// too and commits first: T1's leaves first, since T2 waited for it), and
/// a message due now (`not_before` in the past, a zero delay) keeps its
/// place behind a message of its key whose first send failed.
async fn commit_order<DB: OutboxBackend>(pool: &sqlx::Pool<DB>, outbox: &Outbox<DB>) {
    outbox.migrate(pool).await.expect("migrate");
    let msg = |key: &str, id: &str| OutboxMessage::kafka("orders", key, id.to_owned()).id(id);
    let recorder = Arc::new(Recorder::default());
    let publisher = FailsOnce {
        recorder: Arc::clone(&recorder),
        fail_once: Mutex::new(Some("p1".to_owned())),
    };
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(publisher)
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(300), Duration::from_millis(300))
        .build()
        .expect("relay")
        .spawn();

    let mut t1 = pool.begin().await.expect("begin");
    let first = outbox
        .enqueue_in(&mut t1, "jobs", msg("acct-1", "first"))
        .await
        .expect("enqueue first");
    let t2 = tokio::spawn({
        let (pool, outbox) = (pool.clone(), outbox.clone());
        async move {
            let mut t2 = pool.begin().await.expect("begin");
            let id = outbox
                .enqueue_in(&mut t2, "jobs", msg("acct-1", "second"))
                .await
                .expect("enqueue second");
            t2.commit().await.expect("commit second");
            id
        }
    });
    // The relay polls meanwhile: nothing of acct-1 may leave before T1
    // committed.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(
        recorder.seen().is_empty(),
        "a later message of acct-1 left before an earlier one committed: {:?}",
        recorder.seen()
    );
    t1.commit().await.expect("commit first");
    let second = tokio::time::timeout(Duration::from_secs(20), t2)
        .await
        .expect("T2 ends once T1 committed")
        .expect("T2");

    // p1's first send fails; p2 (a time in the past) and p3 (no delay)
    // are due now and wait behind it.
    let p1 = enqueue(pool, outbox, msg("acct-2", "p1"), true).await;
    let p2 = enqueue(
        pool,
        outbox,
        msg("acct-2", "p2").not_before(SystemTime::now() - Duration::from_secs(60)),
        true,
    )
    .await;
    let p3 = enqueue(
        pool,
        outbox,
        msg("acct-2", "p3").delay(Duration::ZERO),
        true,
    )
    .await;

    let deadline = Instant::now() + Duration::from_secs(30);
    while recorder.seen().len() < 5 {
        assert!(Instant::now() < deadline, "{:?}", recorder.seen());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.stop().await;
    let order = |key: &str| -> Vec<String> {
        recorder
            .seen()
            .into_iter()
            .filter(|(k, _, _)| k == key)
            .map(|(_, id, _)| id)
            .collect()
    };
    assert_eq!(order("acct-1"), [first, second], "acct-1 in commit order");
    assert_eq!(order("acct-2"), [p1, p2, p3], "acct-2 in enqueue order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_messages_leave_in_commit_order_on_postgres() {
    let store = pg_store(&pg_url(), &unique("ocok")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("oco")).expect("table");
    commit_order(store.pool(), &outbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_messages_leave_in_commit_order_on_postgres_generations() {
    let store = pg_store(&pg_url(), &unique("ocok")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("ocg"))
        .expect("table")
        .generations(true);
    commit_order(store.pool(), &outbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_messages_leave_in_commit_order_on_mariadb() {
    let store = mysql_store(&mysql_url(), &unique("ocok")).await;
    let outbox = Outbox::<sqlx::MySql>::on_table(&unique("oco")).expect("table");
    commit_order(store.pool(), &outbox).await;
}

/// The scheduled job and the relay, each SIGKILLed at random moments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_and_its_relay_killed_at_random_send_each_reminder_once_and_never_early() {
    const INVOICES: i64 = 400;
    const KILLS: usize = 4;
    let delay_ms: i64 = 700;
    let url = pg_schema("outbox_job").await;
    let store = pg_store(&url, "onceonly_keys").await;
    let pool = store.pool().clone();
    let outbox_table = "onceonly_outbox";
    Outbox::<sqlx::Postgres>::new()
        .migrate(&pool)
        .await
        .expect("outbox");
    sqlx::query("CREATE TABLE reminders (invoice bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())")
        .execute(&pool)
        .await
        .unwrap();
    let topic = unique("reminders");
    create_topic(&topic, 1).await;

    let log = Logged::new("outbox_job");
    let job_bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_outbox_job"));
    let job_args = vec![
        url.clone(),
        outbox_table.to_owned(),
        topic.clone(),
        INVOICES.to_string(),
        delay_ms.to_string(),
    ];
    let relay_args: Vec<String> = [
        "relay",
        "--database-url",
        &url,
        "--outbox-table",
        outbox_table,
        "--kafka-brokers",
        &brokers(),
        "--poll-interval",
        "50ms",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let mut rng = fastrand::Rng::with_seed(0x5eed_0b0c);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut relay = log.spawn_program(&onceonly_binary(), &relay_args);
    for kill in 0..KILLS {
        // The job: killed once it recorded something new.
        let before = count("SELECT count(*) FROM reminders").await;
        let job = log.spawn_program(&job_bin, &job_args);
        log.kill_after_progress(
            job,
            async || count("SELECT count(*) FROM reminders").await > before,
            deadline,
            Duration::from_millis(150),
            &mut rng,
        )
        .await;
        // The relay: killed once it sent something new (or at once when
        // nothing is due yet).
        let sent_before = count("SELECT count(*) FROM onceonly_outbox WHERE status = 1").await;
        let progressed = async || {
            count("SELECT count(*) FROM onceonly_outbox WHERE status = 1").await > sent_before
                || count("SELECT count(*) FROM onceonly_outbox WHERE status = 0").await == 0
        };
        log.kill_after_progress(
            relay,
            progressed,
            deadline,
            Duration::from_millis(300),
            &mut rng,
        )
        .await;
        eprintln!(
            "kill {}: {} reminders recorded, {} sent",
            kill + 1,
            count("SELECT count(*) FROM reminders").await,
            count("SELECT count(*) FROM onceonly_outbox WHERE status = 1").await
        );
        relay = log.spawn_program(&onceonly_binary(), &relay_args);
    }
    // A last run of the job to the end, then the relay drains.
    log.finishes(
        log.spawn_program(&job_bin, &job_args),
        Duration::from_secs(60),
    )
    .await;
    while count("SELECT count(*) FROM onceonly_outbox WHERE status <> 1").await > 0 {
        assert!(
            Instant::now() < deadline,
            "the relay did not drain; log:\n{}",
            log.tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    relay.start_kill().expect("stop the relay");
    relay.wait().await.expect("reap");

    // The database: each invoice reminded once, one outbox row each.
    assert_eq!(count("SELECT count(*) FROM reminders").await, INVOICES);
    assert_eq!(
        count("SELECT count(*) FROM onceonly_outbox").await,
        INVOICES,
        "re-runs of the job enqueued nothing twice"
    );
    // Each message's due time and its row id (the order of its customer).
    let rows: BTreeMap<String, (i64, i64)> = sqlx::query_as::<_, (String, i64, i64)>(
        "SELECT message_id, created_at_ms, id FROM onceonly_outbox",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, due, row)| (id, (due, row)))
    .collect();
    // Kafka: every reminder, each invoice with one message id, none early.
    let records = read_to_end(&topic, 1, Duration::from_secs(2), Duration::from_secs(30));
    let mut invoices: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Per customer, the row ids in the order they first reached Kafka.
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    let mut early = Vec::new();
    for m in &records {
        let customer = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
        let id = header(m, Header::MessageId.name())
            .expect("message id")
            .to_owned();
        let body: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        let published = m.timestamp().to_millis().expect("timestamp");
        let (due_ms, row) = rows[&id];
        if published < due_ms {
            early.push((id.clone(), due_ms - published));
        }
        if seen.insert(id.clone()) {
            order.entry(customer).or_default().push(row);
        }
        invoices
            .entry(body["invoice"].to_string())
            .or_default()
            .insert(id);
    }
    eprintln!(
        "{} records for {INVOICES} invoices ({} copies after kills); {KILLS} kills of the job and of the relay",
        records.len(),
        records.len() as i64 - INVOICES
    );
    assert!(early.is_empty(), "delayed reminders sent early: {early:?}");
    assert_eq!(invoices.len() as i64, INVOICES, "every invoice reminded");
    for (invoice, set) in &invoices {
        assert_eq!(
            set.len(),
            1,
            "invoice {invoice}: one message id, got {set:?}"
        );
    }
    for (customer, rows) in &order {
        assert!(
            rows.windows(2).all(|w| w[0] < w[1]),
            "{customer}: reminders reached Kafka out of order: {rows:?}"
        );
    }
}
