//! PostgreSQL's pipelined claims (the claim with `BEGIN`, the result with
//! `COMMIT`, values hex-encoded in simple queries):
//!
//! - a fuzz test: scopes, keys, sources, fingerprints and results full of
//!   quotes, backslashes, dollar quotes, comment markers, NULs and
//!   non-UTF-8 bytes round-trip byte-exact, exactly as through the
//!   statement-per-step path with bound parameters, and what one path
//!   refuses (a NUL in text) the other refuses with the same SQLSTATE;
//! - the hand-begun transaction keeps sqlx's promises: dropped unfinished
//!   it rolls back and its connection goes back to the pool idle; a failed
//!   finish (the claim's row gone, a deferred constraint at `COMMIT`)
//!   commits nothing and leaves the connection idle; a connection killed
//!   under an open claim is never handed out again;
//! - optimistic batches write each key once, its result in the insert.

use std::time::{Duration, Instant};

use onceonly::store::raw::{Claim, ClaimRequest, ClaimTimes, ClaimTx};
use onceonly::store::{Deadlines, StoreError, pool_options_for};
use onceonly::{Fingerprint, PgStore, SqlStore};
use onceonly_integration_tests::{pg_url, unique};
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{Postgres, Row};

/// Pieces that break naive quoting, in every SQL dialect we know of.
const NASTY: &[&str] = &[
    "'",
    "''",
    "\\",
    "\\'",
    "'\\",
    "$$",
    "$a$",
    "$1",
    "?",
    ";",
    "--",
    "/*",
    "*/",
    "\"",
    "`",
    "%",
    "_",
    "E'",
    "\\x",
    "\\000",
    "\u{feff}",
    "é",
    "中文",
    "😀",
    " ",
    "\t",
    "\n",
    "\r\n",
    "0x27",
    "); DROP TABLE t; --",
    "decode('",
    "', 'hex')",
];

fn nasty_text(rng: &mut fastrand::Rng, max_bytes: usize) -> String {
    let mut s = String::new();
    let parts = rng.usize(1..12);
    for _ in 0..parts {
        let piece: String = if rng.bool() {
            NASTY[rng.usize(..NASTY.len())].to_owned()
        } else {
            (0..rng.usize(1..6)).map(|_| rng.alphanumeric()).collect()
        };
        if s.len() + piece.len() > max_bytes {
            break;
        }
        s.push_str(&piece);
    }
    if s.is_empty() {
        s.push('k');
    }
    s
}

fn nasty_bytes(rng: &mut fastrand::Rng) -> Vec<u8> {
    let len = match rng.u8(..20) {
        0 => 0,
        1 => rng.usize(30_000..70_000),
        _ => rng.usize(1..200),
    };
    (0..len)
        .map(|_| match rng.u8(..8) {
            0 => 0,
            1 => b'\'',
            2 => b'\\',
            3 => 0xff,
            4 => 0xc3, // a UTF-8 lead byte, usually left dangling
            _ => rng.u8(..),
        })
        .collect()
}

async fn pool(application_name: &str, connections: u32) -> PgPool {
    let deadlines = Deadlines::default();
    let options: PgConnectOptions = pg_url().parse().expect("ONCEONLY_PG_URL parses");
    let options = PgStore::session_options(options.application_name(application_name), &deadlines);
    pool_options_for(&deadlines)
        .max_connections(connections)
        .connect_with(options)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {}: {e} (start it with scripts/services)",
                pg_url()
            )
        })
}

async fn store(pool: &PgPool, table: &str, pipelined: bool) -> PgStore {
    let store = PgStore::new(pool.clone())
        .with_table(table)
        .expect("valid table")
        .pipelined(pipelined);
    store.migrate().await.expect("migrate");
    store
}

fn times() -> ClaimTimes {
    ClaimTimes::new(1_700_000_000_000, Duration::from_secs(3600))
}

/// Claims and finishes one key: the claim, or the first error.
async fn claim_and_finish(
    store: &PgStore,
    scope: &str,
    req: &ClaimRequest<'_>,
    result: &[u8],
) -> Result<Claim, StoreError> {
    match store.open_claim(scope, times(), req).await? {
        Ok(tx) => {
            store
                .finish_claim(tx, scope, req.key, result, false)
                .await?;
            Ok(Claim::Claimed)
        }
        Err(found) => Ok(found),
    }
}

fn sqlstate(e: &StoreError) -> Option<String> {
    match e {
        StoreError::Database(e) => e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_round_trip_byte_exact_like_bound_parameters() {
    let db = pool(&unique("fuzz"), 4).await;
    let (t1, t2) = (unique("fuzz_pipe"), unique("fuzz_bound"));
    let piped = store(&db, &t1, true).await;
    let bound = store(&db, &t2, false).await;
    let seed = std::env::var("ONCEONLY_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_2023);
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut round_trips, mut refusals) = (0, 0);
    for case in 0..400 {
        let mut scope = nasty_text(&mut rng, 128);
        let mut key = nasty_text(&mut rng, 255);
        let mut source = nasty_text(&mut rng, 700); // clamped to 512 bytes
        // Every tenth case carries a NUL, which PostgreSQL's text refuses.
        if case % 10 == 9 {
            match rng.u8(..3) {
                0 => scope.push('\0'),
                1 => key.insert(0, '\0'),
                _ => source.push('\0'),
            }
        }
        let fp_bytes: [u8; 32] = std::array::from_fn(|_| rng.u8(..));
        let fp = Fingerprint::from_slice(&fp_bytes).expect("32 bytes");
        let other_fp = Fingerprint::from_slice(&[fp_bytes[0] ^ 1; 32]).expect("32 bytes");
        let with_fp = rng.bool();
        let result = nasty_bytes(&mut rng);
        let req = ClaimRequest {
            key: &key,
            fingerprint: with_fp.then_some(&fp),
            source: Some(&source),
            lock_wait: rng.bool().then(|| Duration::from_millis(rng.u64(1..5000))),
        };
        let a = claim_and_finish(&piped, &scope, &req, &result).await;
        let b = claim_and_finish(&bound, &scope, &req, &result).await;
        match (&a, &b) {
            (Ok(Claim::Claimed), Ok(Claim::Claimed)) => {}
            (Err(ea), Err(eb)) => {
                assert_eq!(
                    sqlstate(ea),
                    sqlstate(eb),
                    "case {case}: the two paths refuse differently: {ea} vs {eb}"
                );
                assert!(
                    sqlstate(ea).is_some(),
                    "case {case}: not a database refusal: {ea}"
                );
                assert!(
                    format!("{scope}{key}{source}").contains('\0'),
                    "case {case}: refused a value without NUL: {ea}"
                );
                refusals += 1;
                continue;
            }
            _ => panic!("case {case}: the paths disagree: {a:?} vs {b:?}"),
        }
        let (ra, rb) = (
            piped.get(&scope, &key).await.expect("get").expect("stored"),
            bound.get(&scope, &key).await.expect("get").expect("stored"),
        );
        assert_eq!(
            ra, rb,
            "case {case}: the two paths stored different records"
        );
        assert_eq!(ra.scope, scope, "case {case}");
        assert_eq!(ra.key, key, "case {case}");
        assert_eq!(ra.result.as_deref(), Some(&result[..]), "case {case}");
        assert_eq!(ra.fingerprint, with_fp.then_some(fp), "case {case}");
        assert_eq!(
            ra.source.as_deref(),
            Some(onceonly::store::raw::clamp_source(&source)),
            "case {case}"
        );
        // A redelivery gets the result back, byte-exact; another payload
        // is a conflict naming the stored fingerprint.
        let again = claim_and_finish(&piped, &scope, &req, b"never stored").await;
        match again {
            Ok(Claim::Duplicate { result: got }) => {
                assert_eq!(got.as_deref(), Some(&result[..]), "case {case}")
            }
            other => panic!("case {case}: a redelivery was {other:?}"),
        }
        if with_fp {
            let conflicting = ClaimRequest {
                fingerprint: Some(&other_fp),
                ..req
            };
            match claim_and_finish(&piped, &scope, &conflicting, b"x").await {
                Ok(Claim::Conflict { stored }) => assert_eq!(stored, Some(fp), "case {case}"),
                other => panic!("case {case}: another payload was {other:?}"),
            }
        }
        round_trips += 1;
    }
    assert!(
        round_trips > 300 && refusals > 20,
        "{round_trips} round trips, {refusals} refusals"
    );
    for t in [&t1, &t2] {
        drop_tables(&db, t).await;
    }
}

async fn drop_tables(db: &PgPool, table: &str) {
    for t in [table.to_owned(), format!("{table}_attempts")] {
        sqlx::query(&format!("DROP TABLE IF EXISTS \"{t}\""))
            .execute(db)
            .await
            .expect("drop");
    }
}

/// The state of the sessions of `application_name`, as the server sees
/// them.
async fn states(observer: &PgPool, application_name: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT coalesce(state, '') FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(application_name)
    .fetch_all(observer)
    .await
    .expect("pg_stat_activity")
}

/// Waits (at most 10 s) until every session of `application_name` is idle
/// outside a transaction.
async fn all_idle(observer: &PgPool, application_name: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = states(observer, application_name).await;
        if now.iter().all(|s| s == "idle") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "sessions still {now:?} 10 s after their transactions should have ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn business(db: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM \"{table}\""))
        .fetch_one(db)
        .await
        .expect("count")
}

async fn write(tx: &mut ClaimTx<Postgres>, table: &str, key: &str) {
    sqlx::query(&format!("INSERT INTO \"{table}\" (k) VALUES ($1)"))
        .bind(key)
        .execute(&mut **tx)
        .await
        .expect("business write");
}

async fn claimed(store: &PgStore, key: &str) -> ClaimTx<Postgres> {
    match store
        .open_claim("s", times(), &ClaimRequest::new(key))
        .await
        .expect("claim")
    {
        Ok(tx) => tx,
        Err(found) => panic!("{key} was not new: {found:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hand_begun_transaction_keeps_sqlx_promises() {
    let app = unique("pipe_tx");
    // One connection: a connection handed back in a transaction, or never
    // handed back, fails the next claim.
    let db = pool(&app, 1).await;
    let observer = pool(&unique("observer"), 2).await;
    let table = unique("pipe_keys");
    let ledger = unique("pipe_ledger");
    let store = store(&db, &table, true).await;
    sqlx::query(&format!(
        "CREATE TABLE \"{ledger}\" (k text PRIMARY KEY DEFERRABLE INITIALLY DEFERRED)"
    ))
    .execute(&observer)
    .await
    .expect("ledger");

    // 1. Dropped unfinished (a cancelled handler): rolled back, the
    //    connection idle in the pool again.
    let mut tx = claimed(&store, "dropped").await;
    write(&mut tx, &ledger, "dropped").await;
    drop(tx);
    all_idle(&observer, &app).await;
    assert_eq!(
        business(&observer, &ledger).await,
        0,
        "a dropped claim's write committed"
    );
    assert!(store.get("s", "dropped").await.expect("get").is_none());
    let tx = claimed(&store, "dropped").await; // free again
    store
        .finish_claim(tx, "s", "dropped", b"ok", false)
        .await
        .expect("finish");
    assert_eq!(
        store
            .get("s", "dropped")
            .await
            .expect("get")
            .and_then(|r| r.result),
        Some(b"ok".to_vec())
    );

    // 2. The claim's row gone when the result is recorded: nothing
    //    commits, the claim is reported lost, the connection is idle.
    let mut tx = claimed(&store, "lost").await;
    write(&mut tx, &ledger, "lost").await;
    sqlx::query(&format!("DELETE FROM \"{table}\" WHERE idem_key = 'lost'"))
        .execute(&mut *tx)
        .await
        .expect("delete");
    let e = store
        .finish_claim(tx, "s", "lost", b"ok", false)
        .await
        .expect_err("a finish without its claim row");
    assert!(matches!(e, StoreError::ClaimLost), "{e}");
    all_idle(&observer, &app).await;
    assert_eq!(
        business(&observer, &ledger).await,
        0,
        "a lost claim's write committed"
    );

    // 3. A deferred constraint fails at COMMIT: nothing commits, the error
    //    is the database's (a write fault), the connection is idle.
    let mut tx = claimed(&store, "deferred-1").await;
    write(&mut tx, &ledger, "dup").await;
    write(&mut tx, &ledger, "dup").await; // checked at COMMIT
    let e = store
        .finish_claim(tx, "s", "deferred-1", b"ok", false)
        .await
        .expect_err("a deferred unique violation");
    match &e {
        StoreError::Database(d) => assert!(onceonly::store::is_write_fault(d), "{e}"),
        other => panic!("not the database's refusal: {other}"),
    }
    all_idle(&observer, &app).await;
    assert_eq!(business(&observer, &ledger).await, 0);
    assert!(store.get("s", "deferred-1").await.expect("get").is_none());

    // 4. The server kills the session under an open claim: the finish
    //    fails, and the next claim runs on a new connection.
    let mut tx = claimed(&store, "killed").await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .expect("pid");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&observer)
        .await
        .expect("terminate");
    store
        .finish_claim(tx, "s", "killed", b"ok", false)
        .await
        .expect_err("a finish on a killed session");
    let mut tx = claimed(&store, "killed").await; // never committed: new
    let new_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .expect("pid");
    assert_ne!(pid, new_pid, "the killed connection was handed out again");
    store
        .finish_claim(tx, "s", "killed", b"ok", false)
        .await
        .expect("finish on the new connection");

    // 5. A duplicate's transaction ends at once.
    match store
        .open_claim("s", times(), &ClaimRequest::new("killed"))
        .await
        .expect("claim")
    {
        Err(Claim::Duplicate { result }) => assert_eq!(result, Some(b"ok".to_vec())),
        other => panic!("not a duplicate: {other:?}"),
    }
    all_idle(&observer, &app).await;
    let rows: i64 = sqlx::query(&format!("SELECT count(*) AS n FROM \"{table}\""))
        .fetch_one(&observer)
        .await
        .expect("count")
        .get("n");
    assert_eq!(rows, 2, "dropped and killed are the only committed keys");
    drop_tables(&observer, &table).await;
    sqlx::query(&format!("DROP TABLE \"{ledger}\""))
        .execute(&observer)
        .await
        .expect("drop");
}

/// The values decoded in SQL must still meet the primary key: a text
/// expression of another collation than the column's would make every
/// claim of a duplicate and every recorded result scan the whole table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_statements_use_the_primary_key() {
    let app = unique("pipe_index");
    let db = pool(&app, 2).await;
    let observer = pool(&unique("observer"), 1).await;
    let table = unique("pipe_index");
    // The table, its indexes and enough rows that a scan would cost the
    // planner more than the index, all written by a pool closed before the
    // count starts: building an index counts as a sequential scan, and a
    // backend may hold its counts back until it exits.
    let setup = pool(&unique("pipe_setup"), 1).await;
    store(&setup, &table, true).await;
    let store = PgStore::new(db.clone())
        .with_table(&table)
        .expect("valid table")
        .pipelined(true);
    sqlx::query(&format!(
        "INSERT INTO \"{table}\" (scope, idem_key, created_at_ms, expires_at_ms) \
         SELECT 's', 'filler-' || g, 0, 9000000000000 FROM generate_series(1, 5000) g"
    ))
    .execute(&setup)
    .await
    .expect("filler");
    setup.close().await;
    let before = scans(&observer, &table, |_, ins| ins >= 5000).await;
    for i in 0..20 {
        let key = format!("k-{i}");
        let tx = claimed(&store, &key).await;
        store
            .finish_claim(tx, "s", &key, b"r", false)
            .await
            .expect("finish");
        match store
            .open_claim("s", times(), &ClaimRequest::new(&key))
            .await
            .expect("claim")
        {
            Err(Claim::Duplicate { .. }) => {}
            other => panic!("not a duplicate: {other:?}"),
        }
    }
    // A backend's statistics reach the server's views when it exits.
    db.close().await;
    let after = scans(&observer, &table, |idx, _| idx >= before.1 + 40).await;
    assert!(
        after.1 >= before.1 + 40,
        "only {} index scans for 40 look-ups (statistics not flushed?)",
        after.1 - before.1
    );
    assert_eq!(
        after.0,
        before.0,
        "pipelined statements scanned the table {} times",
        after.0 - before.0
    );
    drop_tables(&observer, &table).await;
}

/// An optimistic batch writes each new key once, its result in the claim's
/// insert; a claim-first batch inserts the keys, then updates every row
/// with its result (each update a new row version, indexes written again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimistic_batches_insert_each_key_with_its_result_and_update_nothing() {
    let observer = pool(&unique("observer"), 1).await;
    for optimistic in [true, false] {
        let app = unique("opt_batch");
        let db = pool(&app, 2).await;
        let table = unique("opt_batch");
        let store = store(&db, &table, false).await;
        let engine = onceonly::Engine::builder(store)
            .scope("s")
            .key_expr("json:/k")
            .optimistic(optimistic)
            .build()
            .expect("engine");
        let handler = onceonly::handler_fn(
            |_tx: onceonly::Tx<Postgres>, d: onceonly::Delivery| async move { Ok(d.payload().len()) },
        );
        let batch: Vec<onceonly::Delivery> = (0..200)
            .map(|i| onceonly::Delivery::new(format!(r#"{{"k":"b-{i}"}}"#).into_bytes()))
            .collect();
        let reports = engine.process_batch(&handler, &batch).await;
        assert!(
            reports
                .iter()
                .all(|r| matches!(r.outcome, onceonly::Outcome::Processed { .. })),
            "optimistic {optimistic}: {:?}",
            reports.iter().map(|r| r.outcome.kind()).collect::<Vec<_>>()
        );
        let again = engine.process_batch(&handler, &batch[..10]).await;
        assert!(
            again
                .iter()
                .all(|r| matches!(r.outcome, onceonly::Outcome::Duplicate { result: Some(_) })),
            "optimistic {optimistic}: redeliveries are duplicates with their results"
        );
        // A backend's statistics reach the server's views when it exits.
        db.close().await;
        let (inserted, updated) = writes(&observer, &table, 200).await;
        assert_eq!(inserted, 200, "optimistic {optimistic}: one insert per key");
        let expected = if optimistic { 0 } else { 200 };
        assert_eq!(
            updated, expected,
            "optimistic {optimistic}: {updated} result updates for 200 keys"
        );
        drop_tables(&observer, &table).await;
    }
}

/// `(n_tup_ins, n_tup_upd)` of `table` once `n_tup_ins` reached `inserts`,
/// or after 15 s.
async fn writes(observer: &PgPool, table: &str, inserts: i64) -> (i64, i64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let row = sqlx::query(
            "SELECT n_tup_ins AS ins, n_tup_upd AS upd FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(observer)
        .await
        .expect("pg_stat_user_tables");
        let (ins, upd): (i64, i64) = (row.get("ins"), row.get("upd"));
        if ins >= inserts || Instant::now() > deadline {
            return (ins, upd);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(seq_scan, idx_scan)` of `table` once `ready(idx_scan, n_tup_ins)`
/// holds, or after 15 s.
async fn scans(observer: &PgPool, table: &str, ready: impl Fn(i64, i64) -> bool) -> (i64, i64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let row = sqlx::query(
            "SELECT coalesce(seq_scan, 0) AS seq, coalesce(idx_scan, 0) AS idx, n_tup_ins AS ins \
             FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(observer)
        .await
        .expect("pg_stat_user_tables");
        let (seq, idx, ins): (i64, i64, i64) = (row.get("seq"), row.get("idx"), row.get("ins"));
        if ready(idx, ins) || Instant::now() > deadline {
            return (seq, idx);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
