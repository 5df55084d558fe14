//! The `onceonly` CLI and the background purger against real PostgreSQL and
//! MariaDB: purges while consumers keep claiming, purges by age and scope,
//! inspect and stats; `onceonly outbox` on PostgreSQL, MariaDB and SQLite.
//! (The dedup subcommands on SQLite: `onceonly-cli/tests/cli.rs`.)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use onceonly::ops::Purger;
use onceonly::outbox::{Outbox, OutboxMessage};
use onceonly::{
    Clock as _, Delivery, Engine, Json, KeySpec, MySqlStore, Outcome, PgStore, SqlStore,
    SqliteStore, SystemClock, handler_fn,
};
use onceonly_integration_tests::cli::onceonly;
use onceonly_integration_tests::{
    BusinessSql, Pay, mysql_store, mysql_url, pay, pg_store, pg_url, unique,
};

const DAY_MS: i64 = 86_400_000;

/// Seeds `n` records of `scope` claimed `age_ms` ago that expire at
/// `expires_offset_ms` from now, with one SQL statement (generated rows).
async fn seed_pg(
    store: &PgStore,
    scope: &str,
    prefix: &str,
    n: i64,
    age_ms: i64,
    expires_offset_ms: i64,
) {
    let now = SystemClock.now_ms();
    sqlx::query(&format!(
        "INSERT INTO {} (scope, idem_key, fingerprint, result, source, created_at_ms, expires_at_ms) \
         SELECT $1, $2 || i, NULL, '1', 'seed@' || i, $3, $4 FROM generate_series(1, $5) AS i",
        store.table().quoted('"')
    ))
    .bind(scope)
    .bind(prefix)
    .bind(now - age_ms)
    .bind(now + expires_offset_ms)
    .bind(n)
    .execute(store.pool())
    .await
    .expect("seed");
}

async fn seed_mysql(
    store: &MySqlStore,
    scope: &str,
    prefix: &str,
    n: i64,
    age_ms: i64,
    expires_offset_ms: i64,
) {
    let now = SystemClock.now_ms();
    // A recursive CTE generates the rows: MariaDB has no generate_series.
    sqlx::query(&format!(
        "INSERT INTO {} (scope, idem_key, fingerprint, result, source, created_at_ms, expires_at_ms) \
         WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < ?) \
         SELECT ?, CONCAT(?, i), NULL, '1', CONCAT('seed@', i), ?, ? FROM seq",
        store.table().quoted('`')
    ))
    .bind(n)
    .bind(scope)
    .bind(prefix)
    .bind(now - age_ms)
    .bind(now + expires_offset_ms)
    .execute(store.pool())
    .await
    .expect("seed");
}

async fn count_pg(store: &PgStore, filter: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE {filter}",
        store.table().quoted('"')
    ))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

async fn count_mysql(store: &MySqlStore, filter: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE {filter}",
        store.table().quoted('`')
    ))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

/// 200,000 expired records are purged by `onceonly purge --expired` while
/// four consumers keep claiming new keys and writing business rows. Nothing
/// live is lost: every new key keeps its record and exactly one business
/// row, the 10,000 live seeded records stay, every expired one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purge_of_200k_expired_records_while_consumers_insert_on_postgres() {
    let url = pg_url();
    let table = unique("purge_load");
    let store = pg_store(&url, &table).await;
    let business = unique("purge_load_charges");
    let sql = BusinessSql::postgres(&business);
    sqlx::query(&sql.create)
        .execute(store.pool())
        .await
        .expect("business table");
    seed_pg(&store, "payments", "old-", 200_000, 8 * DAY_MS, -DAY_MS).await;
    seed_pg(&store, "payments", "live-", 10_000, 8 * DAY_MS, DAY_MS).await;

    let engine = Arc::new(
        Engine::builder(store.clone())
            .scope("payments")
            .key(KeySpec::json_field("/out_trade_no"))
            .build()
            .expect("engine"),
    );
    let insert = sql.insert.clone();
    let handler = Arc::new(handler_fn(
        move |tx: onceonly::Tx<sqlx::Postgres>, Json(p): Json<Pay>| {
            let insert = insert.clone();
            async move {
                let mut conn = tx.lock().await?;
                sqlx::query(&insert)
                    .bind(&p.out_trade_no)
                    .bind(p.amount)
                    .execute(&mut *conn)
                    .await?;
                Ok(p.amount)
            }
        },
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let worst_us = Arc::new(AtomicU64::new(0));
    let mut consumers = Vec::new();
    for c in 0..4 {
        let (engine, handler, stop, worst_us) = (
            engine.clone(),
            handler.clone(),
            stop.clone(),
            worst_us.clone(),
        );
        consumers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                // Every key twice: the second delivery must be a duplicate.
                let key = format!("new-{c}-{n}");
                for round in 0..2 {
                    let started = Instant::now();
                    let report = engine
                        .process(&*handler, &Delivery::new(pay(&key, 5)))
                        .await;
                    worst_us.fetch_max(started.elapsed().as_micros() as u64, Ordering::SeqCst);
                    match (round, &report.outcome) {
                        (0, Outcome::Processed { .. }) | (1, Outcome::Duplicate { .. }) => {}
                        _ => panic!("{key} round {round}: {report:?}"),
                    }
                }
                n += 1;
            }
            n
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let run = onceonly(&[
        "purge",
        "--database-url",
        &url,
        "--table",
        &table,
        "--expired",
        "--batch",
        "5000",
    ])
    .await;
    let purge_time = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let mut inserted = 0;
    for c in consumers {
        inserted += c.await.expect("consumer");
    }
    assert_eq!(run.code, 0, "purge failed: {run:?}");
    assert!(
        run.stdout
            .contains("deleted 200000 records that expired in 41 batches"),
        "{run:?}"
    );
    assert_eq!(
        count_pg(&store, "idem_key LIKE 'old-%'").await,
        0,
        "expired records left"
    );
    assert_eq!(
        count_pg(&store, "idem_key LIKE 'live-%'").await,
        10_000,
        "live records purged"
    );
    let new = count_pg(&store, "idem_key LIKE 'new-%'").await;
    assert_eq!(new as u64, inserted, "a claimed key lost its record");
    let rows: i64 = sqlx::query_scalar(&sql.count)
        .fetch_one(store.pool())
        .await
        .expect("rows");
    let distinct: i64 = sqlx::query_scalar(&sql.distinct)
        .fetch_one(store.pool())
        .await
        .expect("distinct");
    assert_eq!(
        (rows, distinct),
        (new, new),
        "every new key charged exactly once"
    );
    eprintln!(
        "purged 200,000 expired records in {purge_time:?} while 4 consumers processed {inserted} keys \
         (twice each); worst delivery latency {} ms",
        worst_us.load(Ordering::SeqCst) / 1000
    );
}

/// `--older-than` with `--scope` deletes only that scope's old records,
/// whether or not they expired; `--dry-run` counts and deletes nothing; a
/// small batch walks many primary-key ranges, including keys with `%` and
/// `_` and scopes that sort next to each other.
async fn purge_by_age_and_scope(
    url: &str,
    table: &str,
    seed: impl AsyncFn(&str, &str, i64, i64, i64),
    count: impl AsyncFn(&str) -> i64,
) {
    seed("a", "old-", 700, 40 * DAY_MS, DAY_MS).await; // old, not expired
    seed("a", "o%_ld-", 30, 40 * DAY_MS, -DAY_MS).await; // old and expired
    seed("a", "new-", 500, DAY_MS, DAY_MS).await;
    seed("ab", "old-", 300, 40 * DAY_MS, DAY_MS).await; // other scope
    seed("b", "old-", 200, 40 * DAY_MS, DAY_MS).await;
    let base = [
        "purge",
        "--database-url",
        url,
        "--table",
        table,
        "--scope",
        "a",
        "--older-than",
        "30d",
    ];

    let run = onceonly(&base).await;
    assert_eq!(run.code, 1, "records that have not expired need --force");
    assert!(
        run.stderr
            .contains("700 of the records to purge have not expired yet"),
        "{run:?}"
    );
    assert_eq!(
        count("1 = 1").await,
        1730,
        "a refused purge deletes nothing"
    );

    let run = onceonly(&[&base[..], &["--dry-run"]].concat()).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("dry run: 730 records created before"),
        "{run:?}"
    );
    assert!(
        run.stdout.contains("700 of them not expired yet"),
        "{run:?}"
    );
    assert_eq!(count("1 = 1").await, 1730, "a dry run deletes nothing");

    let run = onceonly(&[&base[..], &["--batch", "97", "--force"]].concat()).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("deleted 730 records created before"),
        "{run:?}"
    );
    assert!(
        run.stdout.contains("(1230 examined)"),
        "the walk covers scope a only: {run:?}"
    );
    assert_eq!(
        count("scope = 'a'").await,
        500,
        "scope a keeps its young records"
    );
    assert_eq!(count("scope = 'a' AND idem_key LIKE 'new-%'").await, 500);
    assert_eq!(count("scope = 'ab'").await, 300, "scope ab untouched");
    assert_eq!(count("scope = 'b'").await, 200, "scope b untouched");

    // Without --scope: the whole table, in batches.
    let run = onceonly(&[
        "purge",
        "--database-url",
        url,
        "--table",
        table,
        "--older-than",
        "30d",
        "--batch",
        "64",
        "--force",
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("deleted 500 records"), "{run:?}");
    assert_eq!(count("1 = 1").await, 500);

    // inspect and stats on what is left.
    let run = onceonly(&[
        "inspect",
        "--database-url",
        url,
        "--table",
        table,
        "--scope",
        "a",
        "--source",
        "seed@12",
        "--limit",
        "100",
        "--json",
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    let keys: Vec<String> = run
        .stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("JSON line")["key"]
                .as_str()
                .expect("key")
                .to_owned()
        })
        .collect();
    // seed@12 and seed@120..129: eleven sources start with "seed@12".
    assert_eq!(keys.len(), 11, "{keys:?}");
    assert!(keys.iter().all(|k| k.starts_with("new-")));
    // `_` is no wildcard: no source starts with the literal "seed@1_".
    let run = onceonly(&[
        "inspect",
        "--database-url",
        url,
        "--table",
        table,
        "--scope",
        "a",
        "--source",
        "seed@1_",
    ])
    .await;
    assert_eq!(run.code, 3, "nothing matches a literal underscore");
    let run = onceonly(&["stats", "--database-url", url, "--table", table, "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let stats: serde_json::Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(stats["scopes"].as_array().map(Vec::len), Some(1), "{stats}");
    assert_eq!(stats["scopes"][0]["records"], 500);
    assert_eq!(
        stats["scopes"][0]["age_buckets"][2], 500,
        "all claimed just over a day ago: 1d-7d"
    );
    let run = onceonly(&["stats", "--database-url", url, "--table", table]).await;
    assert_eq!(run.code, 0);
    assert!(
        run.stdout.contains("table ") && run.stdout.contains("500 records in 1 scope,"),
        "{run:?}"
    );
}

/// `onceonly migrate` on `table` succeeds and says the table is ready on
/// `backend`.
async fn migrate_with_cli(url: &str, table: &str, backend: &str) {
    let run = onceonly(&["migrate", "--database-url", url, "--table", table]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains(&format!("is ready ({backend})")),
        "{run:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_by_age_and_scope_on_postgres() {
    let url = pg_url();
    let table = unique("purge_age");
    let store = pg_store(&url, &table).await;
    // The table exists already: migrating it is a no-op.
    migrate_with_cli(&url, &table, "postgres").await;
    purge_by_age_and_scope(
        &url,
        &table,
        async |scope, prefix, n, age, exp| seed_pg(&store, scope, prefix, n, age, exp).await,
        async |filter| count_pg(&store, filter).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_by_age_and_scope_on_mariadb() {
    let url = mysql_url();
    let table = unique("purge_age");
    migrate_with_cli(&url, &table, "mysql").await;
    let store = mysql_store(&url, &table).await;
    purge_by_age_and_scope(
        &url,
        &table,
        async |scope, prefix, n, age, exp| seed_mysql(&store, scope, prefix, n, age, exp).await,
        async |filter| count_mysql(&store, filter).await,
    )
    .await;
}

/// The library's background purger deletes expired records at its interval
/// and reports the total when stopped.
#[tokio::test(flavor = "multi_thread")]
async fn background_purger_deletes_expired_records() {
    let url = pg_url();
    let table = unique("purger");
    let store = pg_store(&url, &table).await;
    seed_pg(&store, "s", "old-", 1234, 2 * DAY_MS, -DAY_MS).await;
    seed_pg(&store, "s", "live-", 10, 0, DAY_MS).await;
    let handle = Purger::builder(store.clone())
        .every(Duration::from_millis(100))
        .batch(500)
        .build()
        .expect("purger")
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    while count_pg(&store, "idem_key LIKE 'old-%'").await > 0 {
        assert!(
            Instant::now() < deadline,
            "the purger did not purge in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Expire more while it runs: the next round takes them.
    seed_pg(&store, "s", "later-", 77, DAY_MS, -1).await;
    while count_pg(&store, "idem_key LIKE 'later-%'").await > 0 {
        assert!(Instant::now() < deadline, "the second round did not come");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(handle.stop().await, 1234 + 77);
    assert_eq!(count_pg(&store, "1 = 1").await, 10, "live records stay");
}

/// A purger stopped in the middle of a round (between two batches) stops
/// there and reports what it deleted: it neither runs the round to its end
/// nor fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_purger_stopped_mid_round_stops_between_batches_with_its_total() {
    let url = pg_url();
    let table = unique("purger_stop");
    let store = pg_store(&url, &table).await;
    seed_pg(&store, "s", "old-", 2_000, 2 * DAY_MS, -DAY_MS).await;
    // Batches of 10, 20 ms apart: the round lasts about 4 s.
    let handle = Purger::builder(store.clone())
        .batch(10)
        .pause_between_batches(Duration::from_millis(20))
        .build()
        .expect("purger")
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(20);
    while count_pg(&store, "idem_key LIKE 'old-%'").await > 1_900 {
        assert!(Instant::now() < deadline, "the purger did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopping = Instant::now();
    let total = handle.stop().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(2),
        "stopped after {:?}",
        stopping.elapsed()
    );
    let left = count_pg(&store, "idem_key LIKE 'old-%'").await;
    assert!(left > 0, "the round ran to its end");
    assert_eq!(total, 2_000 - left as u64, "the total it reported");
}

/// A purger stopped while its batch waits (here on a table lock that
/// outlasts every deadline; in production a long paced rotation) gives
/// that batch up `SHUTDOWN_GRACE` after the stop instead of holding the
/// stop until it ends, and the next purge deletes what it left.
#[tokio::test(flavor = "multi_thread")]
async fn a_purger_stopped_while_its_batch_waits_gives_it_up_after_the_grace() {
    let url = pg_url();
    let table = unique("purger_grace");
    let patient = Duration::from_secs(60);
    let store = pg_store(&url, &table)
        .await
        .lock_timeout(Some(patient))
        .deadlines(
            onceonly::store::Deadlines::default()
                .statement(patient)
                .transaction(patient),
        );
    seed_pg(&store, "s", "old-", 100, 2 * DAY_MS, -DAY_MS).await;
    // Another session holds the table: the purge's DELETE waits for it.
    let holder = sqlx::PgPool::connect(&url).await.expect("connect");
    let mut locked = holder.begin().await.expect("begin");
    sqlx::query(&format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        store.table().quoted('"')
    ))
    .execute(&mut *locked)
    .await
    .expect("lock");
    let handle = Purger::builder(store.clone())
        .batch(10)
        .build()
        .expect("purger")
        .spawn();
    // Until the purge waits on the lock.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // This test's DELETE only: other test binaries run at the same time.
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE%' \
             AND datname = current_database() AND strpos(query, $1) > 0",
        )
        .bind(store.table().table())
        .fetch_one(&holder)
        .await
        .expect("activity");
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the purge never waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stopping = Instant::now();
    let total = tokio::time::timeout(patient / 2, handle.stop())
        .await
        .expect("the stop waited for the blocked batch");
    let took = stopping.elapsed();
    assert!(
        took >= onceonly::ops::SHUTDOWN_GRACE,
        "gave the batch up before its grace: {took:?}"
    );
    assert_eq!(total, 0, "nothing could be deleted");
    locked.rollback().await.expect("release");
    // The next purge goes on from there.
    let next = Purger::builder(store.clone())
        .batch(10)
        .build()
        .expect("purger");
    let deleted = tokio::time::timeout(patient, next.purge_once())
        .await
        .expect("the next purge ended")
        .expect("the next purge");
    assert_eq!(
        count_pg(&store, "idem_key LIKE 'old-%'").await,
        0,
        "the next purge deleted what was left ({deleted} by it)"
    );
    holder.close().await;
}

/// Processes orders `k-0`..`k-5` with a handler that enqueues one Kafka
/// message per order into outbox table `$outbox` on backend `$db` (the
/// real API, in the claim's transaction), then `k-0` again: a duplicate,
/// which enqueues nothing.
macro_rules! enqueue_orders {
    ($store:expr, $db:ty, $outbox:expr) => {
        enqueue_orders!($store, $db, $outbox, "orders.placed")
    };
    ($store:expr, $db:ty, $outbox:expr, $topic:expr) => {{
        let outbox = Outbox::<$db>::on_table($outbox).expect("outbox table");
        let topic: String = $topic.to_owned();
        let engine = Engine::builder($store.clone())
            .scope("orders")
            .key(KeySpec::json_field("/out_trade_no"))
            .build()
            .expect("engine");
        let handler = handler_fn(move |tx: onceonly::Tx<$db>, Json(p): Json<Pay>| {
            let (outbox, topic) = (outbox.clone(), topic.clone());
            async move {
                let mut conn = tx.lock().await?;
                let payload =
                    serde_json::json!({ "order": p.out_trade_no, "note": "x".repeat(300) });
                outbox
                    .enqueue(
                        &mut conn,
                        OutboxMessage::kafka(
                            topic,
                            p.out_trade_no.clone(),
                            payload.to_string(),
                        ),
                    )
                    .await?;
                Ok(())
            }
        });
        for i in 0..6 {
            let report = engine
                .process(&handler, &Delivery::new(pay(&format!("k-{i}"), 5)))
                .await;
            assert!(
                matches!(report.outcome, Outcome::Processed { .. }),
                "{report:?}"
            );
        }
        let again = engine.process(&handler, &Delivery::new(pay("k-0", 5))).await;
        assert!(
            matches!(again.outcome, Outcome::Duplicate { .. }),
            "{again:?}"
        );
    }};
}

/// `onceonly outbox stats|inspect|retry|purge` on outbox table `outbox`,
/// which holds the six messages of [`enqueue_orders`]: two are parked as
/// dead and three marked sent (two of them two hours ago) by hand, the way
/// a relay would have.
async fn outbox_subcommands(
    url: &str,
    outbox: &str,
    exec: impl AsyncFn(&str),
    count: impl AsyncFn(&str) -> i64,
) {
    assert_eq!(
        count("1 = 1").await,
        6,
        "one message per order, none for the duplicate"
    );
    assert_eq!(count("status = 0 AND attempts = 0").await, 6, "all pending");
    let now = SystemClock.now_ms();
    exec(&format!(
        "UPDATE {outbox} SET status = 2, attempts = 3, last_error = 'broker said no' \
         WHERE causation IN ('k-0', 'k-1')"
    ))
    .await;
    exec(&format!(
        "UPDATE {outbox} SET status = 1, attempts = 1, sent_at_ms = {} \
         WHERE causation IN ('k-2', 'k-3')",
        now - 2 * 3_600_000
    ))
    .await;
    exec(&format!(
        "UPDATE {outbox} SET status = 1, attempts = 1, sent_at_ms = {} WHERE causation = 'k-4'",
        now - 60_000
    ))
    .await;
    let db = ["--database-url", url, "--outbox-table", outbox];
    let cli = async |args: &[&str]| onceonly(&[args, &db[..]].concat()).await;

    // stats
    let run = cli(&["outbox", "stats"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains(&format!(
            "outbox table {outbox}: 6 messages: 1 pending, 3 sent, 2 dead"
        )),
        "{run:?}"
    );
    assert!(
        run.stdout
            .contains("backlog: 1 pending, the oldest enqueued 20"),
        "{run:?}"
    );
    assert!(run.stdout.contains("dead: 2 ("), "{run:?}");
    for line in [
        "pending  kafka           1",
        "sent     kafka           3",
        "dead     kafka           2",
    ] {
        assert!(run.stdout.contains(line), "{line:?} missing: {run:?}");
    }
    let run = cli(&["outbox", "stats", "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let stats: serde_json::Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(stats["table"], outbox, "{stats}");
    assert_eq!(stats["backlog"], 1, "{stats}");
    assert_eq!(stats["rows"]["sent"], 3, "{stats}");
    assert_eq!(stats["rows"]["dead"], 2, "{stats}");
    assert!(
        stats["oldest_pending_ms"]
            .as_i64()
            .is_some_and(|ms| ms <= now),
        "{stats}"
    );
    assert_eq!(stats["counts"].as_array().map(Vec::len), Some(3), "{stats}");

    // inspect
    let run = cli(&["outbox", "inspect", "--status", "dead"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout.matches("message id:").count(), 2, "{run:?}");
    for expected in [
        "status:       dead",
        "kind:         kafka",
        "destination:  orders.placed",
        "message key:  k-0",
        "scope:        orders",
        "causation:    k-0 (the inbound key)",
        "causation:    k-1 (the inbound key)",
        "attempts:     3",
        "last error:   broker said no",
        "sent:         -",
        "payload:      {\"",
        "bytes, truncated)",
    ] {
        assert!(
            run.stdout.contains(expected),
            "{expected:?} missing: {run:?}"
        );
    }
    let run = cli(&["outbox", "inspect", "--status", "dead", "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let dead: Vec<serde_json::Value> = run
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(dead.len(), 2, "{run:?}");
    assert_eq!(dead[0]["causation"], "k-0", "oldest first");
    assert_eq!(dead[1]["causation"], "k-1");
    assert_eq!(dead[0]["status"], "dead");
    assert_eq!(
        dead[0]["payload"]["order"], "k-0",
        "the whole payload, as JSON"
    );
    let dead_id = dead[0]["message_id"]
        .as_str()
        .expect("message id")
        .to_owned();
    let run = cli(&["outbox", "inspect", "--message-id", &dead_id, "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout.lines().count(), 1, "{run:?}");
    let run = cli(&["outbox", "inspect", "--message-id", "no-such-id"]).await;
    assert_eq!(run.code, 3, "{run:?}");
    let run = cli(&["outbox", "inspect", "--status", "pending", "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let pending: serde_json::Value = serde_json::from_str(run.stdout.trim()).expect("one line");
    assert_eq!(pending["causation"], "k-5", "{pending}");
    assert!(pending["next_attempt_at_ms"].is_i64(), "{pending}");
    let pending_id = pending["message_id"]
        .as_str()
        .expect("message id")
        .to_owned();
    let run = cli(&["outbox", "inspect", "--status", "sent", "--limit", "2"]).await;
    assert_eq!(
        run.stdout.matches("message id:").count(),
        2,
        "--limit: {run:?}"
    );

    // retry
    let run = cli(&["outbox", "retry"]).await;
    assert_eq!(
        run.code, 2,
        "retry needs --message-id or --all-dead: {run:?}"
    );
    let run = cli(&["outbox", "retry", "--message-id", &pending_id]).await;
    assert_eq!(run.code, 3, "{run:?}");
    assert!(run.stderr.contains("is pending, not dead"), "{run:?}");
    let run = cli(&["outbox", "retry", "--message-id", &dead_id]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains(&format!("retried message {dead_id}")),
        "{run:?}"
    );
    assert_eq!(
        count("status = 0 AND causation = 'k-0' AND attempts = 0").await,
        1
    );
    assert_eq!(count("status = 2").await, 1, "only that one");
    let run = cli(&["outbox", "retry", "--all-dead"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("retried 1 dead message: pending again"),
        "{run:?}"
    );
    assert_eq!(count("status = 2").await, 0, "no dead message left");
    assert_eq!(
        count("status = 0 AND last_error IS NULL AND attempts = 0").await,
        3,
        "k-0, k-1 and k-5 pending, their errors cleared"
    );
    let run = cli(&["outbox", "retry", "--all-dead"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("no dead messages"), "{run:?}");

    // purge
    let run = cli(&["outbox", "purge", "--older-than", "1h", "--batch", "1"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("deleted 2 sent messages sent before"),
        "{run:?}"
    );
    assert_eq!(
        count("status = 1").await,
        1,
        "the recently sent message stays"
    );
    assert_eq!(count("causation = 'k-4'").await, 1);
    assert_eq!(count("status = 0").await, 3, "pending messages stay");
    let run = cli(&["outbox", "purge", "--older-than", "1h"]).await;
    assert!(run.stdout.contains("deleted 0 sent messages"), "{run:?}");

    // A table that does not exist.
    let run = onceonly(&[
        "outbox",
        "stats",
        "--database-url",
        url,
        "--outbox-table",
        "no_such_outbox",
    ])
    .await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.contains("hint: the outbox table does not exist"),
        "{run:?}"
    );
}

/// `onceonly migrate` creates the dedup table and outbox table `outbox`.
async fn migrate_with_outbox(url: &str, table: &str, outbox: &str, backend: &str) {
    let run = onceonly(&[
        "migrate",
        "--database-url",
        url,
        "--table",
        table,
        "--outbox-table",
        outbox,
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains(&format!("dedup table {table} is ready ({backend})")),
        "{run:?}"
    );
    assert!(
        run.stdout
            .contains(&format!("outbox table {outbox} is ready ({backend})")),
        "{run:?}"
    );
    let run = onceonly(&[
        "outbox",
        "stats",
        "--database-url",
        url,
        "--outbox-table",
        outbox,
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains(&format!("outbox table {outbox}: no messages")),
        "{run:?}"
    );
}

/// [`outbox_subcommands`] with `store`'s pool running the test's own
/// statements (a macro: the executor bounds differ per backend).
macro_rules! outbox_subcommands_on {
    ($store:expr, $url:expr, $outbox:expr) => {{
        let outbox: &str = $outbox;
        outbox_subcommands(
            $url,
            outbox,
            async |sql| {
                sqlx::query(sql)
                    .execute($store.pool())
                    .await
                    .expect("update");
            },
            async |filter| {
                sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {outbox} WHERE {filter}"))
                    .fetch_one($store.pool())
                    .await
                    .expect("count")
            },
        )
        .await
    }};
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_subcommands_on_postgres() {
    let url = pg_url();
    let (table, outbox) = (unique("ob_keys"), unique("ob"));
    migrate_with_outbox(&url, &table, &outbox, "postgres").await;
    let store = pg_store(&url, &table).await;
    enqueue_orders!(store, sqlx::Postgres, &outbox);
    outbox_subcommands_on!(store, &url, &outbox);
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_subcommands_on_mariadb() {
    let url = mysql_url();
    let (table, outbox) = (unique("ob_keys"), unique("ob"));
    migrate_with_outbox(&url, &table, &outbox, "mysql").await;
    let store = mysql_store(&url, &table).await;
    enqueue_orders!(store, sqlx::MySql, &outbox);
    outbox_subcommands_on!(store, &url, &outbox);
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_subcommands_on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("outbox.db");
    let url = format!("sqlite:{}", path.display());
    migrate_with_outbox(&url, "ob_keys", "ob", "sqlite").await;
    let store = SqliteStore::open(&path)
        .await
        .expect("open")
        .with_table("ob_keys")
        .expect("table");
    enqueue_orders!(store, sqlx::Sqlite, "ob");
    outbox_subcommands_on!(store, &url, "ob");
}

/// `onceonly relay` publishes the outbox to Kafka, keeps running while
/// idle, and stops on SIGTERM with a summary.
#[tokio::test(flavor = "multi_thread")]
async fn relay_subcommand_publishes_the_outbox_and_stops_on_sigterm() {
    let url = pg_url();
    let (table, outbox) = (unique("rl_keys"), unique("rl"));
    migrate_with_outbox(&url, &table, &outbox, "postgres").await;
    let store = pg_store(&url, &table).await;
    // Topics live as long as the broker: one per run.
    let topic = unique("orders_placed");
    onceonly_integration_tests::kafka::create_topic(&topic, 1).await;
    enqueue_orders!(store, sqlx::Postgres, &outbox, topic.as_str());
    let sent = async || -> i64 {
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {outbox} WHERE status = 1"))
            .fetch_one(store.pool())
            .await
            .expect("count")
    };
    let brokers = onceonly_integration_tests::kafka::brokers();
    let child = tokio::process::Command::new(onceonly_integration_tests::cli::onceonly_binary())
        .args([
            "relay",
            "--database-url",
            &url,
            "--outbox-table",
            &outbox,
            "--kafka-brokers",
            &brokers,
        ])
        .env_remove("ONCEONLY_DATABASE_URL")
        .env_remove("ONCEONLY_OUTBOX_TABLE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn onceonly relay");
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent().await < 6 {
        assert!(
            Instant::now() < deadline,
            "the relay did not publish the outbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = child.id().expect("pid").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("the relay did not stop on SIGTERM")
        .expect("relay output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("relay stopped: 6 published"), "{stdout}");
}
