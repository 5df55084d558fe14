//! The core contract, against real PostgreSQL, MariaDB and SQLite.
//!
//! The same suite is stamped out per backend by `backend_suite!`. Each test
//! uses its own dedup and business tables, so tests run in parallel.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use onceonly::store::raw::{Claim, ClaimRequest, ClaimTimes};
use onceonly::{Clock, MySqlStore, PgStore, SqliteStore};
use onceonly::{
    Delivery, Engine, Failure, FingerprintSpec, HandlerError, Json, KeyError, KeySpec, ManualClock,
    Outcome, Rejection, RetryPolicy, SqlStore, handler_fn,
};
use onceonly_integration_tests::{
    BusinessSql, Pay, mysql_store, mysql_url, pay, pg_generations_store, pg_store, pg_url,
    sqlite_store, unique,
};

/// A later version of the payment input that old payloads do not decode into.
#[derive(Debug, serde::Deserialize)]
struct PayV2 {
    out_trade_no: String,
    #[allow(dead_code)]
    currency: String,
}

/// What a test handler observes: how often it ran, and whether to fail next.
#[derive(Clone, Default)]
struct Probe {
    runs: Arc<AtomicUsize>,
    fail_next: Arc<AtomicBool>,
    delay_ms: u64,
    poison: Option<&'static str>,
}

/// Outcome counts of a set of reports.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    processed: usize,
    duplicate: usize,
    conflict: usize,
    rejected: usize,
    failed: usize,
}

impl Tally {
    fn add<T>(&mut self, outcome: &Outcome<T>) {
        match outcome {
            Outcome::Processed { .. } => self.processed += 1,
            Outcome::Duplicate { .. } => self.duplicate += 1,
            Outcome::Conflict { .. } => self.conflict += 1,
            Outcome::Rejected(_) => self.rejected += 1,
            Outcome::Failed(_) => self.failed += 1,
            _ => unreachable!("unknown outcome"),
        }
    }
}

macro_rules! backend_suite {
    ($name:ident, $conn:ty, $business:path, $setup:path) => {
        mod $name {
            use super::*;

            struct Ctx<S> {
                store: S,
                sql: BusinessSql,
                business: String,
                url: String,
                _dir: tempfile::TempDir,
            }

            async fn ctx() -> Ctx<impl SqlStore<Db = <$conn as sqlx::Connection>::Database>> {
                let dir = tempfile::tempdir().expect("tempdir");
                let (store, url) = $setup(dir.path(), &unique("keys")).await;
                let business = unique("charges");
                let sql = $business(&business);
                sqlx::query(&sql.create)
                    .execute(store.pool())
                    .await
                    .expect("create business table");
                Ctx {
                    store,
                    sql,
                    business,
                    url,
                    _dir: dir,
                }
            }

            impl<S: SqlStore<Db = <$conn as sqlx::Connection>::Database>> Ctx<S> {
                fn engine(&self) -> onceonly::EngineBuilder<S> {
                    Engine::builder(self.store.clone())
                        .scope("payments")
                        .key_expr("json:/out_trade_no")
                        .retry(RetryPolicy::none())
                }

                fn handler(
                    &self,
                    probe: &Probe,
                ) -> impl onceonly::Handler<
                    <$conn as sqlx::Connection>::Database,
                    Input = Json<Pay>,
                    Output = (String, i64),
                > + use<S> {
                    let insert = self.sql.insert.clone();
                    let probe = probe.clone();
                    handler_fn(move |tx: onceonly::Tx<<$conn as sqlx::Connection>::Database>, Json(p): Json<Pay>| {
                        let insert = insert.clone();
                        let probe = probe.clone();
                        async move {
 let mut conn = tx.lock().await?;
                            probe.runs.fetch_add(1, Ordering::SeqCst);
                            sqlx::query(&insert)
                                .bind(&p.out_trade_no)
                                .bind(p.amount)
                                .execute(&mut *conn)
                                .await?;
                            if probe.delay_ms > 0 {
                                tokio::time::sleep(Duration::from_millis(probe.delay_ms)).await;
                            }
                            if probe.poison == Some(p.out_trade_no.as_str()) {
                                return Err(HandlerError::permanent("poison message"));
                            }
                            if probe.fail_next.swap(false, Ordering::SeqCst) {
                                return Err(HandlerError::permanent(
                                    "injected failure after the write",
                                ));
                            }
                            Ok((p.out_trade_no, p.amount))
                        }
                    })
                }

                async fn scalar(&self, sql: &str) -> i64 {
                    sqlx::query_scalar::<_, i64>(sql)
                        .fetch_one(self.store.pool())
                        .await
                        .expect("scalar query")
                }

                async fn rows(&self) -> i64 {
                    self.scalar(&self.sql.count).await
                }

                /// The attempts counter of `key` (a constant of the test) in
                /// `scope`, `None` without a row.
                async fn attempts(&self, scope: &str, key: &str) -> Option<i64> {
                    let sql = format!(
                        "SELECT attempts FROM {} WHERE scope = '{scope}' AND idem_key = '{key}'",
                        self.store.table().attempts()
                    );
                    sqlx::query_scalar::<_, i32>(&sql)
                        .fetch_optional(self.store.pool())
                        .await
                        .expect("read the attempts table")
                        .map(i64::from)
                }

                async fn drop_tables(self) {
                    let dedup = format!("DROP TABLE IF EXISTS {}", self.store.table());
                    sqlx::query(&dedup).execute(self.store.pool()).await.ok();
                    let attempts = format!("DROP TABLE IF EXISTS {}", self.store.table().attempts());
                    sqlx::query(&attempts).execute(self.store.pool()).await.ok();
                    // The generations layout's control table, where there is one.
                    let control = format!("DROP TABLE IF EXISTS {}_generation", self.store.table());
                    sqlx::query(&control).execute(self.store.pool()).await.ok();
                    sqlx::query(&self.sql.drop)
                        .execute(self.store.pool())
                        .await
                        .ok();
                }
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn thousand_deliveries_with_30_percent_duplicates() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                // 700 distinct keys, 300 redeliveries spread through the stream.
                let mut stream: Vec<String> = (0..700).map(|i| format!("T-{i:04}")).collect();
                for i in 0..300 {
                    let at = (i * 7919) % stream.len();
                    let key = format!("T-{:04}", (i * 31) % 700);
                    stream.insert(at, key);
                }
                let tally = Arc::new(std::sync::Mutex::new(Tally::default()));
                let chunks: Vec<Vec<String>> = stream.chunks(125).map(<[String]>::to_vec).collect();
                let mut tasks = Vec::new();
                for chunk in chunks {
                    let engine = engine.clone();
                    let handler = ctx.handler(&probe);
                    let tally = tally.clone();
                    tasks.push(tokio::spawn(async move {
                        for key in chunk {
                            let d = Delivery::new(pay(&key, 10));
                            let report = engine.process(&handler, &d).await;
                            tally.lock().unwrap().add(&report.outcome);
                        }
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
                drop(handler);
                let tally = std::mem::take(&mut *tally.lock().unwrap());
                assert_eq!(
                    tally,
                    Tally {
                        processed: 700,
                        duplicate: 300,
                        ..Tally::default()
                    }
                );
                assert_eq!(
                    ctx.rows().await,
                    700,
                    "business rows must equal distinct keys"
                );
                assert_eq!(ctx.scalar(&ctx.sql.distinct).await, 700);
                assert_eq!(
                    probe.runs.load(Ordering::SeqCst),
                    700,
                    "handler ran once per key"
                );
                ctx.drop_tables().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_duplicates_run_the_handler_once() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let probe = Probe {
                    delay_ms: 100,
                    ..Probe::default()
                };
                let mut tasks = Vec::new();
                for _ in 0..32 {
                    let engine = engine.clone();
                    let handler = ctx.handler(&probe);
                    tasks.push(tokio::spawn(async move {
                        engine
                            .process(&handler, &Delivery::new(pay("T-hot", 99)))
                            .await
                    }));
                }
                let mut tally = Tally::default();
                let mut replayed = Vec::new();
                for t in tasks {
                    let report = t.await.unwrap();
                    tally.add(&report.outcome);
                    if let Outcome::Duplicate { result } = report.outcome {
                        replayed.push(result);
                    }
                }
                assert_eq!(
                    tally,
                    Tally {
                        processed: 1,
                        duplicate: 31,
                        ..Tally::default()
                    }
                );
                assert_eq!(
                    probe.runs.load(Ordering::SeqCst),
                    1,
                    "handler must run once"
                );
                assert!(
                    replayed
                        .iter()
                        .all(|r| r.as_ref() == Some(&("T-hot".to_owned(), 99))),
                    "every duplicate carries the stored result: {replayed:?}"
                );
                assert_eq!(ctx.rows().await, 1);
                ctx.drop_tables().await;
            }

            /// Optimistic claims (the handler first, the key claimed with
            /// its result before COMMIT): redeliveries are duplicates with
            /// the stored result, a reused key with another payload is a
            /// conflict, and every key's write commits once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn optimistic_claims_apply_each_key_once() {
                let ctx = ctx().await;
                let engine = ctx
                    .engine()
                    .fingerprint(FingerprintSpec::Fields(vec!["/amount".into()]))
                    .optimistic(true)
                    .build()
                    .unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                let mut tally = Tally::default();
                // 200 keys, every other one redelivered right behind itself.
                let keys = (0..200).flat_map(|j| vec![j; 1 + usize::from(j % 2 == 0)]);
                for j in keys {
                    let key = format!("T-{j:04}");
                    let report = engine.process(&handler, &Delivery::new(pay(&key, 10))).await;
                    if let Outcome::Duplicate { result } = &report.outcome {
                        assert_eq!(result.as_ref(), Some(&(key.clone(), 10)));
                    }
                    tally.add(&report.outcome);
                }
                let conflict = engine.process(&handler, &Delivery::new(pay("T-0000", 11))).await;
                tally.add(&conflict.outcome);
                assert_eq!(
                    tally,
                    Tally {
                        processed: 200,
                        duplicate: 100,
                        conflict: 1,
                        ..Tally::default()
                    }
                );
                assert_eq!(ctx.rows().await, 200, "business rows must equal distinct keys");
                assert_eq!(ctx.scalar(&ctx.sql.distinct).await, 200);
                // A third of the deliveries are duplicates: once the engine
                // has seen that, it looks keys up before running handlers.
                let runs = probe.runs.load(Ordering::SeqCst);
                assert!(
                    (200..=240).contains(&runs),
                    "{runs} handler runs for 200 keys and 100 duplicates"
                );
                ctx.drop_tables().await;
            }

            /// Concurrent copies of one key under optimistic claims: each
            /// may run the handler, one commits, the others roll back and
            /// are duplicates, whether the second insert of the key or a
            /// unique business key (the handler's own write failing on the
            /// winner's row) is what finds them out.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn optimistic_concurrent_copies_commit_once() {
                let ctx = ctx().await;
                let engine = ctx.engine().optimistic(true).build().unwrap();
                let probe = Probe {
                    delay_ms: 50,
                    ..Probe::default()
                };
                for (key, unique_business) in [("T-hot-a", false), ("T-hot-b", true)] {
                    if unique_business {
                        let index = format!(
                            "CREATE UNIQUE INDEX {0}_no ON {0} (out_trade_no)",
                            ctx.business
                        );
                        sqlx::query(&index)
                            .execute(ctx.store.pool())
                            .await
                            .expect("unique business key");
                    }
                    let mut tasks = Vec::new();
                    for _ in 0..16 {
                        let engine = engine.clone();
                        let handler = ctx.handler(&probe);
                        tasks.push(tokio::spawn(async move {
                            engine.process(&handler, &Delivery::new(pay(key, 99))).await
                        }));
                    }
                    let mut tally = Tally::default();
                    for t in tasks {
                        let report = t.await.unwrap();
                        if let Outcome::Duplicate { result } = &report.outcome {
                            assert_eq!(result.as_ref(), Some(&(key.to_owned(), 99)));
                        }
                        if let Outcome::Failed(f) = &report.outcome {
                            panic!("{key}: a copy failed: {f}");
                        }
                        tally.add(&report.outcome);
                    }
                    assert_eq!(
                        tally,
                        Tally {
                            processed: 1,
                            duplicate: 15,
                            ..Tally::default()
                        },
                        "{key}"
                    );
                }
                assert_eq!(ctx.rows().await, 2, "one business row per key");
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn handler_error_rolls_back_everything_and_a_retry_processes() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let probe = Probe::default();
                probe.fail_next.store(true, Ordering::SeqCst);
                let handler = ctx.handler(&probe);
                let d = Delivery::new(pay("T-fail", 5));
                let first = engine.process(&handler, &d).await;
                match &first.outcome {
                    Outcome::Failed(f @ Failure::Handler(_)) => {
                        assert!(!f.is_retryable());
                        assert_eq!(f.reason(), "handler_error");
                    }
                    other => panic!("expected a handler failure, got {other:?}"),
                }
                assert_eq!(ctx.rows().await, 0, "the business write was rolled back");
                assert_eq!(
                    ctx.store.get("payments", "T-fail").await.unwrap(),
                    None,
                    "no claim is left behind"
                );
                let retry = engine.process(&handler, &d).await;
                assert!(
                    matches!(retry.outcome, Outcome::Processed { .. }),
                    "{retry:?}"
                );
                assert_eq!(ctx.rows().await, 1);
                let again = engine.process(&handler, &d).await;
                assert!(
                    matches!(again.outcome, Outcome::Duplicate { .. }),
                    "{again:?}"
                );
                assert_eq!(probe.runs.load(Ordering::SeqCst), 2);
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn same_key_other_payload_is_a_conflict() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                let first = engine
                    .process(&handler, &Delivery::new(pay("T-c", 5)))
                    .await;
                assert!(matches!(first.outcome, Outcome::Processed { .. }));
                let expected = FingerprintSpec::Auto.compute(&Delivery::new(pay("T-c", 5)));
                let other = engine
                    .process(&handler, &Delivery::new(pay("T-c", 6)))
                    .await;
                match other.outcome {
                    Outcome::Conflict { stored, received } => {
                        assert_eq!(stored, expected);
                        assert_ne!(received, expected);
                    }
                    o => panic!("expected a conflict, got {o:?}"),
                }
                assert_eq!(other.outcome.reason(), Some("fingerprint_mismatch"));
                assert_eq!(
                    ctx.rows().await,
                    1,
                    "business table untouched by the conflict"
                );
                assert_eq!(
                    ctx.scalar(&format!("SELECT MAX(amount) FROM {}", ctx.business))
                        .await,
                    5
                );
                assert_eq!(probe.runs.load(Ordering::SeqCst), 1);
                ctx.drop_tables().await;
            }

            /// A lock wait (PostgreSQL runs the claim's waiting statements;
            /// the others keep their own bound) changes no outcome: a new
            /// key is claimed, a committed one is a duplicate, an expired
            /// one is reclaimed.
            #[tokio::test]
            async fn claims_with_a_lock_wait_insert_and_reclaim() {
                let ctx = ctx().await;
                let store = &ctx.store;
                let req = ClaimRequest {
                    source: Some("t/0@1"),
                    lock_wait: Some(Duration::from_secs(1)),
                    ..ClaimRequest::new("T-wait")
                };
                let claim = |times: ClaimTimes| async move {
                    let mut tx = store.begin().await.unwrap();
                    let claim = store.claim(&mut tx, "payments", times, &req).await.unwrap();
                    if claim == Claim::Claimed {
                        store.complete(&mut tx, "payments", req.key, b"ok").await.unwrap();
                    }
                    tx.commit().await.unwrap();
                    claim
                };
                let first = ClaimTimes::new(1_000, Duration::from_secs(10));
                assert_eq!(claim(first).await, Claim::Claimed);
                assert_eq!(
                    claim(first).await,
                    Claim::Duplicate {
                        result: Some(b"ok".to_vec())
                    }
                );
                let later = ClaimTimes::new(20_000, Duration::from_secs(10));
                assert_eq!(claim(later).await, Claim::Claimed, "expired → reclaimed");
                let record = store.get("payments", "T-wait").await.unwrap().unwrap();
                assert_eq!(record.created_at_ms, 20_000);
                assert_eq!(record.source.as_deref(), Some("t/0@1"));
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn expired_records_are_reclaimable_and_purged_in_batches() {
                let ctx = ctx().await;
                let clock = ManualClock::starting_now();
                let engine = ctx
                    .engine()
                    .retention(Duration::from_secs(3600))
                    .clock(clock.clone())
                    .build()
                    .unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                let d = Delivery::new(pay("T-exp", 1));
                assert!(matches!(
                    engine.process(&handler, &d).await.outcome,
                    Outcome::Processed { .. }
                ));
                clock.advance_ms(3_599_000);
                assert!(matches!(
                    engine.process(&handler, &d).await.outcome,
                    Outcome::Duplicate { .. }
                ));
                clock.advance_ms(2_000);
                let late = engine.process(&handler, &d).await;
                assert!(
                    matches!(late.outcome, Outcome::Processed { .. }),
                    "expired → reclaimed: {late:?}"
                );
                let record = ctx.store.get("payments", "T-exp").await.unwrap().unwrap();
                assert_eq!(record.created_at_ms, clock.now_ms());
                assert_eq!(ctx.rows().await, 2);

                // Purge: 5 expired records go in bounded batches, the live one stays.
                for i in 0..5 {
                    engine
                        .process(&handler, &Delivery::new(pay(&format!("T-old-{i}"), 1)))
                        .await;
                }
                clock.advance_ms(3_600_000);
                engine
                    .process(&handler, &Delivery::new(pay("T-live", 1)))
                    .await;
                let now = clock.now_ms();
                let mut batches = Vec::new();
                loop {
                    let n = ctx
                        .store
                        .purge_expired(Some("payments"), now, 2)
                        .await
                        .unwrap();
                    batches.push(n);
                    if n < 2 {
                        break;
                    }
                }
                assert_eq!(
                    batches,
                    vec![2, 2, 2, 0],
                    "6 expired records in batches of 2"
                );
                assert!(ctx.store.get("payments", "T-live").await.unwrap().is_some());
                assert!(ctx.store.get("payments", "T-exp").await.unwrap().is_none());
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn bad_keys_are_rejected_with_precise_reasons() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let by_header = ctx
                    .engine()
                    .key(KeySpec::header("Idempotency-Key"))
                    .build()
                    .unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                let reject = |o: Outcome<(String, i64)>| match o {
                    Outcome::Rejected(Rejection::BadKey(e)) => e,
                    other => panic!("expected a bad key, got {other:?}"),
                };
                let empty = engine.process(&handler, &Delivery::new(pay("", 1))).await;
                assert_eq!(reject(empty.outcome), KeyError::Empty);
                let long = "k".repeat(10_240);
                let long = engine
                    .process(&handler, &Delivery::new(pay(&long, 1)))
                    .await;
                assert_eq!(
                    reject(long.outcome),
                    KeyError::TooLong {
                        len: 10_240,
                        max: 255
                    }
                );
                let missing = engine
                    .process(&handler, &Delivery::new(br#"{"amount":1}"#.to_vec()))
                    .await;
                assert_eq!(
                    reject(missing.outcome),
                    KeyError::MissingField {
                        pointer: "/out_trade_no".into()
                    }
                );
                let not_utf8 = by_header
                    .process(
                        &handler,
                        &Delivery::new(pay("T-1", 1))
                            .with_metadata("Idempotency-Key", b"\xc3\x28".to_vec()),
                    )
                    .await;
                assert_eq!(reject(not_utf8.outcome), KeyError::NotUtf8);
                let malformed = engine
                    .process(&handler, &Delivery::new(b"{\"out_trade_no\":".to_vec()))
                    .await;
                let e = reject(malformed.outcome);
                assert!(matches!(e, KeyError::NotJson(_)));
                assert_eq!(e.reason(), "decode_error");
                let undecodable = engine
                    .process(
                        &handler,
                        &Delivery::new(br#"{"out_trade_no":"T-x","amount":"ten"}"#.to_vec()),
                    )
                    .await;
                assert!(matches!(
                    undecodable.outcome,
                    Outcome::Rejected(Rejection::Decode(_))
                ));
                assert_eq!(undecodable.outcome.reason(), Some("decode_error"));
                assert_eq!(
                    probe.runs.load(Ordering::SeqCst),
                    0,
                    "the handler never ran"
                );
                assert_eq!(ctx.rows().await, 0);
                assert_eq!(ctx.store.get("payments", "T-x").await.unwrap(), None);
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn keys_are_byte_exact_and_scopes_are_separate() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let other_scope = ctx.engine().scope("refunds").build().unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                for key in ["abc", "ABC", "abc ", "ábc"] {
                    let r = engine.process(&handler, &Delivery::new(pay(key, 1))).await;
                    assert!(
                        matches!(r.outcome, Outcome::Processed { .. }),
                        "{key:?}: {r:?}"
                    );
                }
                let r = other_scope
                    .process(&handler, &Delivery::new(pay("abc", 1)))
                    .await;
                assert!(
                    matches!(r.outcome, Outcome::Processed { .. }),
                    "another scope processes it once too"
                );
                let r = other_scope
                    .process(&handler, &Delivery::new(pay("abc", 1)))
                    .await;
                assert!(matches!(r.outcome, Outcome::Duplicate { .. }));
                assert_eq!(ctx.rows().await, 5);
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn sigkill_between_claim_and_commit_leaves_nothing_and_a_restart_processes_once()
            {
                let ctx = ctx().await;
                let backend = stringify!($name);
                let table = ctx.store.table().to_string();
                let args = |mode: &'static str| {
                    vec![
                        backend.to_owned(),
                        ctx.url.clone(),
                        table.clone(),
                        ctx.business.clone(),
                        "T-crash".to_owned(),
                        mode.to_owned(),
                    ]
                };
                for kill in 1..=2 {
                    let mut child = Command::new(env!("CARGO_BIN_EXE_crash_worker"))
                        .args(args("hang"))
                        .stdout(Stdio::piped())
                        .spawn()
                        .expect("spawn crash_worker");
                    let stdout = child.stdout.take().unwrap();
                    let line = tokio::task::spawn_blocking(move || {
                        let mut line = String::new();
                        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
                            .map(|_| line)
                    });
                    let line = tokio::time::timeout(Duration::from_secs(60), line)
                        .await
                        .expect("worker claimed within 60 s")
                        .unwrap()
                        .unwrap();
                    assert_eq!(line.trim(), "CLAIMED", "kill #{kill}");
                    // The worker holds the claim and a business row, uncommitted.
                    child.kill().expect("SIGKILL");
                    child.wait().unwrap();
                    assert_eq!(
                        ctx.rows().await,
                        0,
                        "kill #{kill}: the uncommitted business row is gone"
                    );
                    assert_eq!(
                        ctx.store.get("crash-test", "T-crash").await.unwrap(),
                        None,
                        "kill #{kill}: no claim left"
                    );
                }
                let run = || {
                    let out = Command::new(env!("CARGO_BIN_EXE_crash_worker"))
                        .args(args("run"))
                        .output()
                        .expect("run crash_worker");
                    assert!(out.status.success(), "{out:?}");
                    String::from_utf8(out.stdout).unwrap().trim().to_owned()
                };
                assert_eq!(run(), "processed", "the restarted worker processes the key");
                assert_eq!(run(), "duplicate", "and a later redelivery is a duplicate");
                assert_eq!(ctx.rows().await, 1, "exactly one business row");
                ctx.drop_tables().await;
            }

            /// A message whose handler aborts the process: real process
            /// deaths (SIGABRT) of the crash worker, whose engine parks a
            /// suspect after 2 crashes.
            #[tokio::test]
            async fn a_suspect_that_aborts_the_process_is_parked_as_crashed() {
                use std::os::unix::process::ExitStatusExt;
                let ctx = ctx().await;
                let backend = stringify!($name);
                let table = ctx.store.table().to_string();
                let worker = |key: &str, mode: &str| {
                    Command::new(env!("CARGO_BIN_EXE_crash_worker"))
                        .args([backend, ctx.url.as_str(), table.as_str(), ctx.business.as_str(), key, mode])
                        .stderr(Stdio::null())
                        .output()
                        .expect("run crash_worker")
                };
                let said = |out: std::process::Output| {
                    assert!(out.status.success(), "{out:?}");
                    String::from_utf8(out.stdout).unwrap().trim().to_owned()
                };
                for crash in 1..=2 {
                    let out = worker("T-poison", "abort");
                    assert_eq!(
                        out.status.signal(),
                        Some(6),
                        "crash #{crash}: the handler aborts the process: {out:?}"
                    );
                    assert_eq!(ctx.rows().await, 0, "crash #{crash}: its write rolled back");
                    assert_eq!(
                        ctx.attempts("crash-test", "T-poison").await,
                        Some(crash),
                        "crash #{crash}: the start was counted before the handler ran"
                    );
                }
                assert_eq!(
                    said(worker("T-poison", "abort")),
                    "failed crashed",
                    "the third start is refused: dead-letter it as crashed"
                );
                assert_eq!(ctx.rows().await, 0, "the handler did not run again");
                assert_eq!(ctx.store.get("crash-test", "T-poison").await.unwrap(), None);
                assert_eq!(
                    ctx.attempts("crash-test", "T-poison").await,
                    None,
                    "the counter starts over (a replay of the dead letter gets its own attempts)"
                );
                // One crash, then a start that succeeds: processed once, and
                // the counter goes with the commit.
                assert_eq!(worker("T-once", "abort").status.signal(), Some(6));
                assert_eq!(said(worker("T-once", "suspect")), "processed");
                assert_eq!(ctx.attempts("crash-test", "T-once").await, None);
                assert_eq!(said(worker("T-once", "suspect")), "duplicate");
                assert_eq!(ctx.attempts("crash-test", "T-once").await, None, "duplicates are not counted");
                // Healthy deliveries are never counted.
                assert_eq!(said(worker("T-fresh", "run")), "processed");
                assert_eq!(ctx.attempts("crash-test", "T-fresh").await, None);
                assert_eq!(ctx.rows().await, 2, "T-once and T-fresh, once each");
                ctx.drop_tables().await;
            }

            /// Only starts the process did not survive count: a suspect
            /// whose handler returns an error is retried as often as the
            /// policy says and never parked as crashed; expired counters
            /// are purged with the records.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn suspect_handler_errors_are_not_crashes_and_counters_are_purged() {
                let ctx = ctx().await;
                let engine = ctx.engine().max_crashes(1).build().unwrap();
                let probe = Probe { poison: Some("T-err"), ..Probe::default() };
                let handler = ctx.handler(&probe);
                let suspect = |key: &str| Delivery::new(pay(key, 3)).with_suspect(true);
                for attempt in 1..=4 {
                    let report = engine.process(&handler, &suspect("T-err")).await;
                    assert!(
                        matches!(report.outcome, Outcome::Failed(Failure::Handler(_))),
                        "attempt {attempt}: {:?}",
                        report.outcome
                    );
                    assert_eq!(ctx.attempts("payments", "T-err").await, Some(0));
                }
                assert_eq!(probe.runs.load(Ordering::SeqCst), 4);
                // A counter left by a start the process did not survive
                // (max_crashes 1): the next suspect start is refused.
                let times = ClaimTimes::new(onceonly::SystemClock.now_ms(), Duration::from_secs(60));
                assert_eq!(ctx.store.bump_attempts("payments", "T-died", times).await.unwrap(), 1);
                let report = engine.process(&handler, &suspect("T-died")).await;
                assert!(
                    matches!(report.outcome, Outcome::Failed(Failure::Crashed { crashes: 1 })),
                    "{:?}",
                    report.outcome
                );
                assert_eq!(report.outcome.reason(), Some("crashed"));
                assert_eq!(probe.runs.load(Ordering::SeqCst), 4, "not run again");
                // Whatever a counter says, a delivery that is not suspect runs.
                assert_eq!(ctx.store.bump_attempts("payments", "T-died", times).await.unwrap(), 1);
                assert_eq!(ctx.store.bump_attempts("payments", "T-died", times).await.unwrap(), 2);
                let report = engine.process(&handler, &Delivery::new(pay("T-died", 3))).await;
                assert!(matches!(report.outcome, Outcome::Processed { .. }), "{:?}", report.outcome);
                // Expired counters go with the purge; live ones stay.
                let old = ClaimTimes::new(1_000, Duration::from_secs(1));
                ctx.store.bump_attempts("payments", "T-old", old).await.unwrap();
                assert_eq!(
                    ctx.store.bump_attempts("payments", "T-old", old).await.unwrap(),
                    2
                );
                // An expired counter starts over at 1.
                let later = ClaimTimes::new(5_000, Duration::from_secs(1));
                assert_eq!(
                    ctx.store.bump_attempts("payments", "T-old", later).await.unwrap(),
                    1
                );
                let mut purged = 0;
                loop {
                    let n = ctx.store.purge_expired(None, 10_000, 100).await.unwrap();
                    purged += n;
                    if n < 100 {
                        break;
                    }
                }
                assert_eq!(purged, 1, "the expired counter only");
                assert_eq!(ctx.attempts("payments", "T-old").await, None);
                assert_eq!(ctx.attempts("payments", "T-died").await, Some(2));
                ctx.drop_tables().await;
            }

            /// Claimed first, and [optimistic](onceonly::EngineBuilder::optimistic)
            /// (looked up, then claimed with the results): the same outcomes.
            #[tokio::test]
            async fn batches_commit_once_and_a_poison_message_neither_blocks_nor_doubles() {
                for optimistic in [false, true] {
                    batch_outcomes(optimistic).await;
                }
            }

            async fn batch_outcomes(optimistic: bool) {
                let ctx = ctx().await;
                let engine = ctx.engine().optimistic(optimistic).build().unwrap();
                let probe = Probe { poison: Some("P-poison"), ..Probe::default() };
                let handler = ctx.handler(&probe);
                engine.process(&handler, &Delivery::new(pay("P-done", 1))).await;
                engine.process(&handler, &Delivery::new(pay("P-other", 1))).await;
                let batch: Vec<Delivery> = [
                    pay("P-a", 1).body(),
                    pay("P-b", 2).body(),
                    pay("P-a", 1).body(),
                    b"{not json".to_vec(),
                    pay("P-done", 1).body(),
                    pay("P-other", 5).body(),
                    pay("P-b", 3).body(),
                ]
                .into_iter()
                .map(Delivery::new)
                .collect();
                let reports = engine.process_batch(&handler, &batch).await;
                let kinds: Vec<&str> = reports.iter().map(|r| r.outcome.kind().as_str()).collect();
                assert_eq!(
                    kinds,
                    ["processed", "processed", "duplicate", "rejected", "duplicate", "conflict", "conflict"],
                    "optimistic: {optimistic}"
                );
                assert!(
                    matches!(&reports[2].outcome, Outcome::Duplicate { result: Some((k, 1)) } if k == "P-a"),
                    "an in-batch repeat gets the first occurrence's result: {:?}",
                    reports[2]
                );
                assert_eq!(ctx.rows().await, 4);
                assert_eq!(probe.runs.load(Ordering::SeqCst), 4, "one run per new key");

                // A poison message rolls the batch back, then each message goes alone.
                let batch: Vec<Delivery> =
                    [pay("P-1", 1), pay("P-poison", 1), pay("P-2", 1)].into_iter().map(Delivery::new).collect();
                let reports = engine.process_batch(&handler, &batch).await;
                let kinds: Vec<&str> = reports.iter().map(|r| r.outcome.kind().as_str()).collect();
                assert_eq!(kinds, ["processed", "failed", "processed"], "optimistic: {optimistic}");
                assert_eq!(ctx.rows().await, 6, "P-1 and P-2 once each, nothing of the poison");
                assert_eq!(ctx.store.get("payments", "P-poison").await.unwrap(), None);
                let again = engine.process_batch(&handler, &batch[..1]).await;
                assert!(matches!(again[0].outcome, Outcome::Duplicate { .. }));
                ctx.drop_tables().await;
            }

            /// `[A(k,F1), B(k,F2)]` with `k` committed as F2: A conflicts
            /// with the stored record, B is its duplicate.
            #[tokio::test]
            async fn in_batch_repeats_meet_the_record_their_key_ends_up_with() {
                for optimistic in [false, true] {
                    in_batch_repeats(optimistic).await;
                }
            }

            async fn in_batch_repeats(optimistic: bool) {
                let ctx = ctx().await;
                let engine = ctx.engine().optimistic(optimistic).build().unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                let first = engine
                    .process(&handler, &Delivery::new(pay("R-k", 2)))
                    .await;
                assert!(matches!(first.outcome, Outcome::Processed { .. }));
                let batch = [Delivery::new(pay("R-k", 1)), Delivery::new(pay("R-k", 2))];
                let reports = engine.process_batch(&handler, &batch).await;
                assert!(
                    matches!(reports[0].outcome, Outcome::Conflict { .. }),
                    "{:?}",
                    reports[0].outcome
                );
                assert!(
                    matches!(&reports[1].outcome, Outcome::Duplicate { result: Some((k, 2)) } if k == "R-k"),
                    "{:?}",
                    reports[1].outcome
                );
                // A new key: the first occurrence claims, the other payload conflicts.
                let batch = [Delivery::new(pay("R-n", 1)), Delivery::new(pay("R-n", 3))];
                let reports = engine.process_batch(&handler, &batch).await;
                assert!(matches!(reports[0].outcome, Outcome::Processed { .. }));
                assert!(matches!(reports[1].outcome, Outcome::Conflict { .. }));
                assert_eq!(ctx.rows().await, 2, "one charge per key");
                assert_eq!(probe.runs.load(Ordering::SeqCst), 2);
                ctx.drop_tables().await;
            }

            /// Optimistic batches: an expired key is claimed again with its
            /// result; two concurrent batches that share keys apply each key
            /// once (the later batch's claim finds the keys the earlier one
            /// committed, rolls back, and its deliveries go one by one).
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn optimistic_batches_reclaim_expired_keys_and_yield_to_concurrent_commits() {
                let ctx = ctx().await;
                let clock = ManualClock::starting_now();
                let engine = ctx
                    .engine()
                    .optimistic(true)
                    .retention(Duration::from_secs(3600))
                    .clock(clock.clone())
                    .build()
                    .unwrap();
                let probe = Probe { delay_ms: 20, ..Probe::default() };
                let handler = ctx.handler(&probe);
                let old = engine.process_batch(&handler, &[Delivery::new(pay("X-old", 1))]).await;
                assert!(matches!(old[0].outcome, Outcome::Processed { .. }), "{:?}", old[0].outcome);
                clock.advance_ms(3_601_000);
                let again = engine
                    .process_batch(&handler, &[Delivery::new(pay("X-old", 1)), Delivery::new(pay("X-new", 1))])
                    .await;
                let kinds: Vec<&str> = again.iter().map(|r| r.outcome.kind().as_str()).collect();
                assert_eq!(kinds, ["processed", "processed"], "an expired key is new work");
                let record = ctx.store.get("payments", "X-old").await.unwrap().unwrap();
                assert_eq!(record.created_at_ms, clock.now_ms(), "reclaimed at the batch's time");
                assert!(record.result.is_some(), "the reclaimed key carries its result");
                assert_eq!(ctx.rows().await, 3);

                // Keys 0..10 and 5..15, in two batches at once.
                let batch = |from: usize, to: usize| -> Vec<Delivery> {
                    (from..to).map(|i| Delivery::new(pay(&format!("C-{i:02}"), 7))).collect()
                };
                let (a, b) = (batch(0, 10), batch(5, 15));
                let (ra, rb) = tokio::join!(engine.process_batch(&handler, &a), engine.process_batch(&handler, &b));
                let mut tally = Tally::default();
                for report in ra.iter().chain(&rb) {
                    tally.add(&report.outcome);
                }
                assert_eq!(
                    tally,
                    Tally { processed: 15, duplicate: 5, ..Tally::default() },
                    "each shared key processed by one batch, a duplicate in the other"
                );
                assert_eq!(ctx.rows().await, 3 + 15, "one charge per key");
                assert_eq!(
                    ctx.scalar(&ctx.sql.distinct).await,
                    2 + 15,
                    "no key charged twice"
                );
                ctx.drop_tables().await;
            }

            /// The handler's input type changed since a key was processed:
            /// its redelivery is still a duplicate (acked, never
            /// dead-lettered); a new key of that shape is rejected.
            #[tokio::test]
            async fn a_duplicate_whose_payload_no_longer_decodes_is_still_a_duplicate() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                let d = Delivery::new(pay("U-1", 5));
                let first = engine.process(&handler, &d).await;
                assert!(matches!(first.outcome, Outcome::Processed { .. }));
                let v2 = handler_fn(|_tx: onceonly::Tx<<$conn as sqlx::Connection>::Database>, Json(p): Json<PayV2>| {
                    async move { Ok((p.out_trade_no, 0i64)) }
                });
                let again = engine.process(&v2, &d).await;
                assert!(
                    matches!(&again.outcome, Outcome::Duplicate { result: Some((k, 5)) } if k == "U-1"),
                    "{:?}",
                    again.outcome
                );
                let fresh = engine.process(&v2, &Delivery::new(pay("U-2", 5))).await;
                assert!(
                    matches!(fresh.outcome, Outcome::Rejected(Rejection::Decode(_))),
                    "{:?}",
                    fresh.outcome
                );
                let batched = engine.process_batch(&v2, &[Delivery::new(pay("U-1", 5)), Delivery::new(pay("U-3", 5))]).await;
                assert!(matches!(batched[0].outcome, Outcome::Duplicate { .. }), "{:?}", batched[0].outcome);
                assert!(matches!(batched[1].outcome, Outcome::Rejected(_)), "{:?}", batched[1].outcome);
                assert_eq!(ctx.rows().await, 1);
                ctx.drop_tables().await;
            }

            #[tokio::test]
            async fn batch_claim_reports_new_duplicate_conflict_and_in_batch_repeats() {
                let ctx = ctx().await;
                let engine = ctx.engine().build().unwrap();
                let probe = Probe::default();
                let handler = ctx.handler(&probe);
                engine
                    .process(&handler, &Delivery::new(pay("B-done", 1)))
                    .await;
                engine
                    .process(&handler, &Delivery::new(pay("B-other", 1)))
                    .await;
                let fp = |no: &str, amount| {
                    FingerprintSpec::Auto
                        .compute(&Delivery::new(pay(no, amount)))
                        .unwrap()
                };
                let fps = [
                    fp("B-a", 1),
                    fp("B-b", 1),
                    fp("B-done", 1),
                    fp("B-other", 2),
                    fp("B-b", 9),
                ];
                let req = |key, i: usize| ClaimRequest {
                    key,
                    fingerprint: Some(&fps[i]),
                    source: Some("t/0@1"),
                    lock_wait: None,
                };
                let reqs = [
                    req("B-a", 0),
                    req("B-b", 1),
                    req("B-a", 0),
                    req("B-done", 2),
                    req("B-other", 3),
                    req("B-b", 4),
                ];
                let times = ClaimTimes::new(
                    onceonly::SystemClock.now_ms(),
                    Duration::from_secs(60),
                );
                let mut tx = ctx.store.begin().await.unwrap();
                let claims = ctx
                    .store
                    .claim_batch(&mut tx, "payments", times, &reqs)
                    .await
                    .unwrap();
                assert_eq!(claims[0], Claim::Claimed);
                assert_eq!(claims[1], Claim::Claimed);
                assert_eq!(claims[2], Claim::InBatch { first: 0 });
                assert!(
                    matches!(&claims[3], Claim::Duplicate { result: Some(_) }),
                    "{:?}",
                    claims[3]
                );
                assert!(
                    matches!(&claims[4], Claim::Conflict { stored: Some(_) }),
                    "{:?}",
                    claims[4]
                );
                assert_eq!(
                    claims[5],
                    Claim::Conflict {
                        stored: Some(fps[1])
                    }
                );
                for key in ["B-a", "B-b"] {
                    ctx.store
                        .complete(&mut tx, "payments", key, b"\"ok\"")
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                let a = ctx.store.get("payments", "B-a").await.unwrap().unwrap();
                assert_eq!(a.result.as_deref(), Some(&b"\"ok\""[..]));
                assert_eq!(a.fingerprint, Some(fps[0]));
                assert_eq!(a.source.as_deref(), Some("t/0@1"));
                // A batch that rolls back leaves nothing.
                let mut tx = ctx.store.begin().await.unwrap();
                let r = [req("B-gone", 0)];
                assert_eq!(
                    ctx.store
                        .claim_batch(&mut tx, "payments", times, &r)
                        .await
                        .unwrap(),
                    vec![Claim::Claimed]
                );
                tx.rollback().await.unwrap();
                assert_eq!(ctx.store.get("payments", "B-gone").await.unwrap(), None);
                ctx.drop_tables().await;
            }
        }
    };
}

/// Each setup returns a migrated store on dedup table `table` and the
/// address the crash worker connects to (a URL, or the SQLite file).
async fn postgres_setup(_dir: &Path, table: &str) -> (PgStore, String) {
    let url = pg_url();
    (pg_store(&url, table).await, url)
}

/// The PostgreSQL store with pipelined claims (the claim with `BEGIN`, the
/// result with `COMMIT`): the whole suite again on that path.
async fn postgres_pipelined_setup(_dir: &Path, table: &str) -> (PgStore, String) {
    let url = pg_url();
    (pg_store(&url, table).await.pipelined(true), url)
}

/// The PostgreSQL store on the generations layout (two partitions, purged
/// by rotation): the whole suite again on that layout.
async fn postgres_generations_setup(_dir: &Path, table: &str) -> (PgStore, String) {
    let url = pg_url();
    (pg_generations_store(&url, table).await, url)
}

async fn mysql_setup(_dir: &Path, table: &str) -> (MySqlStore, String) {
    let url = mysql_url();
    (mysql_store(&url, table).await, url)
}

async fn sqlite_setup(dir: &Path, table: &str) -> (SqliteStore, String) {
    let path = dir.join("db.sqlite");
    (sqlite_store(&path, table).await, path.display().to_string())
}

backend_suite!(
    postgres,
    sqlx::PgConnection,
    BusinessSql::postgres,
    postgres_setup
);
backend_suite!(
    postgres_pipelined,
    sqlx::PgConnection,
    BusinessSql::postgres,
    postgres_pipelined_setup
);
backend_suite!(
    postgres_generations,
    sqlx::PgConnection,
    BusinessSql::postgres,
    postgres_generations_setup
);
backend_suite!(
    mysql,
    sqlx::MySqlConnection,
    BusinessSql::mysql,
    mysql_setup
);
backend_suite!(
    sqlite,
    sqlx::SqliteConnection,
    BusinessSql::sqlite,
    sqlite_setup
);

/// MySQL/MariaDB end a transaction on a deadlock (1213): a handler that
/// swallows the error leaves its claim rolled back under the engine. Recording
/// the result then finds no claim: that is contention, retried, never a
/// "corrupt store" dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_claim_rolled_back_by_a_swallowed_deadlock_is_retried() {
    swallowed_deadlock(Mode::ClaimFirst).await;
}

/// The same on an optimistic engine, whose claim is the last statement:
/// after InnoDB's rollback it would run outside any transaction, commit
/// on its own and report the delivery processed without the handler's
/// writes. The claim finds the transaction gone and the attempt is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_optimistic_claim_after_a_swallowed_deadlock_is_retried() {
    swallowed_deadlock(Mode::Optimistic).await;
}

/// The same for an optimistic batch (one claim per key on MySQL): the
/// batch is rolled back and its deliveries go one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_optimistic_batch_after_a_swallowed_deadlock_goes_one_by_one() {
    swallowed_deadlock(Mode::OptimisticBatch).await;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    ClaimFirst,
    Optimistic,
    OptimisticBatch,
}

/// A handler whose first run is made InnoDB's deadlock victim and swallows
/// the error; every delivery must still be charged exactly once.
async fn swallowed_deadlock(mode: Mode) {
    let store = mysql_store(&mysql_url(), &unique("keys")).await;
    let locks = unique("locks");
    let filler = unique("filler");
    let charges = unique("charges");
    for stmt in [
        format!("CREATE TABLE {locks} (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB"),
        format!("INSERT INTO {locks} VALUES (1, 0), (2, 0)"),
        format!("CREATE TABLE {filler} (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB"),
        format!(
            "CREATE TABLE {charges} (out_trade_no VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
        ),
    ] {
        sqlx::query(&stmt).execute(store.pool()).await.unwrap();
    }
    for i in 0..200 {
        sqlx::query(&format!("INSERT INTO {filler} VALUES (?, 0)"))
            .bind(i)
            .execute(store.pool())
            .await
            .unwrap();
    }
    let engine = Engine::builder(store.clone())
        .scope("deadlock")
        .key_expr("json:/out_trade_no")
        .optimistic(mode != Mode::ClaimFirst)
        .build()
        .unwrap();
    // In a batch, the victim is the last handler: writes of a handler
    // after a swallowed rollback would run outside any transaction.
    let victim = match mode {
        Mode::OptimisticBatch => "DL-2",
        _ => "DL-1",
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let deadlocked = Arc::new(AtomicBool::new(false));
    let pool = store.pool().clone();
    let handler = {
        let (runs, deadlocked) = (runs.clone(), deadlocked.clone());
        let (locks, filler, charges) = (locks.clone(), filler.clone(), charges.clone());
        handler_fn(move |tx: onceonly::Tx<sqlx::MySql>, Json(p): Json<Pay>| {
            let (runs, deadlocked, pool) = (runs.clone(), deadlocked.clone(), pool.clone());
            let (locks, filler, charges) = (locks.clone(), filler.clone(), charges.clone());
            async move {
                let mut conn = tx.lock().await?;
                runs.fetch_add(1, Ordering::SeqCst);
                sqlx::query(&format!("INSERT INTO {charges} VALUES (?, ?)"))
                    .bind(&p.out_trade_no)
                    .bind(p.amount)
                    .execute(&mut *conn)
                    .await?;
                if p.out_trade_no == victim && !deadlocked.load(Ordering::SeqCst) {
                    sqlx::query(&format!("UPDATE {locks} SET v = v + 1 WHERE id = 1"))
                        .execute(&mut *conn)
                        .await?;
                    // A bigger transaction takes row 2 and waits for row 1:
                    // InnoDB rolls back the smaller one, this handler's.
                    let other_locks = locks.clone();
                    let other = tokio::spawn(async move {
                        let locks = other_locks;
                        let mut tx = pool.begin().await.unwrap();
                        sqlx::query(&format!("UPDATE {filler} SET v = v + 1"))
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        sqlx::query(&format!("UPDATE {locks} SET v = v + 1 WHERE id = 2"))
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        sqlx::query(&format!("UPDATE {locks} SET v = v + 1 WHERE id = 1"))
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        tx.commit().await.unwrap();
                    });
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let r = sqlx::query(&format!("UPDATE {locks} SET v = v + 1 WHERE id = 2"))
                        .execute(&mut *conn)
                        .await;
                    // The handler's bug under test: the error is swallowed.
                    if let Err(e) = r {
                        deadlocked.store(
                            e.as_database_error()
                                .and_then(|d| {
                                    d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                                })
                                .is_some_and(|m| m.number() == 1213),
                            Ordering::SeqCst,
                        );
                    }
                    other.await.unwrap();
                }
                Ok(p.amount)
            }
        })
    };
    let deliveries = match mode {
        Mode::OptimisticBatch => vec![Delivery::new(pay("DL-1", 7)), Delivery::new(pay("DL-2", 9))],
        _ => vec![Delivery::new(pay("DL-1", 7))],
    };
    let reports = match mode {
        Mode::OptimisticBatch => engine.process_batch(&handler, &deliveries).await,
        _ => vec![engine.process(&handler, &deliveries[0]).await],
    };
    assert!(
        deadlocked.load(Ordering::SeqCst),
        "the test needs InnoDB to pick the handler as the deadlock victim"
    );
    for report in &reports {
        assert!(
            matches!(report.outcome, Outcome::Processed { .. }),
            "{mode:?}: {:?}",
            report.outcome
        );
    }
    let expected_runs = 2 * deliveries.len();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        expected_runs,
        "{mode:?}: retried once after the lost transaction"
    );
    for (no, amount) in [("DL-1", 7_i64), ("DL-2", 9)].iter().take(deliveries.len()) {
        let n: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT amount FROM {charges} WHERE out_trade_no = ?"
        ))
        .bind(no)
        .fetch_all(store.pool())
        .await
        .unwrap();
        assert_eq!(n, vec![*amount], "{mode:?}: {no} charged once");
        assert!(store.get("deadlock", no).await.unwrap().is_some());
    }
}

/// A suspect (a possible redelivery after a crash) runs alone: its handler
/// starts only after the handlers already running ended, and no other
/// handler of the engine starts until it ended, so a crash in it is never
/// blamed on a bystander (and a bystander's crash never on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_suspect_runs_alone() {
    let store = pg_store(&pg_url(), &unique("keys")).await;
    let engine = Engine::builder(store.clone())
        .scope("alone")
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    let events = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let handler = {
        let events = events.clone();
        Arc::new(handler_fn(
            move |_tx: onceonly::Tx<sqlx::Postgres>, Json(p): Json<Pay>| {
                let events = events.clone();
                async move {
                    events
                        .lock()
                        .unwrap()
                        .push(format!("start {}", p.out_trade_no));
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    events
                        .lock()
                        .unwrap()
                        .push(format!("end {}", p.out_trade_no));
                    Ok(p.amount)
                }
            },
        ))
    };
    let run = |key: &str, suspect: bool| {
        let (engine, handler) = (engine.clone(), handler.clone());
        let delivery = Delivery::new(pay(key, 1)).with_suspect(suspect);
        tokio::spawn(async move { engine.process(&*handler, &delivery).await.outcome.kind() })
    };
    let first = run("H-1", false);
    while !events.lock().unwrap().contains(&"start H-1".to_owned()) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut tasks = vec![first, run("S-1", true)];
    for i in 2..6 {
        tasks.push(run(&format!("H-{i}"), false));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), onceonly::OutcomeKind::Processed);
    }
    let events = events.lock().unwrap().clone();
    let at = |e: &str| events.iter().position(|x| x == e).unwrap();
    let (start, end) = (at("start S-1"), at("end S-1"));
    assert!(
        start > at("end H-1"),
        "the suspect waits for H-1: {events:?}"
    );
    assert_eq!(
        end,
        start + 1,
        "nothing runs beside the suspect: {events:?}"
    );
    sqlx::query(&format!("DROP TABLE IF EXISTS {}", store.table()))
        .execute(store.pool())
        .await
        .ok();
    sqlx::query(&format!(
        "DROP TABLE IF EXISTS {}",
        store.table().attempts()
    ))
    .execute(store.pool())
    .await
    .ok();
}

/// Migrations on PostgreSQL are quiet: neither the first start on a fresh
/// database nor any later one logs PostgreSQL's notices ("relation ...
/// already exists, skipping", one per `CREATE ... IF NOT EXISTS` that
/// found its object), for the dedup table (both layouts) and the outbox.
/// sqlx logs each notice as an INFO event of `sqlx::postgres::notice`;
/// this test captures them (one thread: the subscriber is the thread's).
#[tokio::test(flavor = "current_thread")]
async fn postgres_migrations_log_no_notices() {
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let logged = || String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();

    let url = pg_url();
    let store = PgStore::connect(&url).await.expect("connect");
    let plain = store.clone().with_table(&unique("quiet")).unwrap();
    let generations = store
        .clone()
        .with_table(&unique("quiet_gen"))
        .unwrap()
        .generations(true);
    let outbox =
        onceonly::outbox::Outbox::<sqlx::Postgres>::on_table(&unique("quiet_out")).unwrap();
    for start in ["first start (fresh tables)", "second start"] {
        plain.migrate().await.expect("migrate plain");
        generations.migrate().await.expect("migrate generations");
        outbox.migrate(store.pool()).await.expect("migrate outbox");
        let log = logged();
        assert!(
            !log.contains("sqlx::postgres::notice") && !log.contains("already exists"),
            "{start} logged PostgreSQL's notices:\n{log}"
        );
    }
}

/// A claim-first engine (the default) looks keys up before claiming them
/// while duplicates are common, as optimistic engines do: a duplicate is
/// then one indexed read, with no claim transaction. Shown by a table lock
/// that stops every insert but no read (`EXCLUSIVE`): before, the
/// duplicate's claim waited on it (until the 10 s `lock_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_first_engines_answer_common_duplicates_without_a_transaction() {
    let url = pg_url();
    let table = unique("lookup");
    let store = pg_store(&url, &table).await;
    let engine = Engine::builder(store.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = handler_fn(
        move |_tx: onceonly::Tx<sqlx::Postgres>, Json(_p): Json<Pay>| {
            let counted = counted.clone();
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(())
            }
        },
    );
    // Every key twice: half the claims find their key taken.
    for j in 0..40 {
        let key = format!("L-{j:03}");
        for _ in 0..2 {
            engine
                .process(&handler, &Delivery::new(pay(&key, 10)))
                .await;
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 40);

    let mut locker = store.pool().begin().await.unwrap();
    sqlx::query(&format!("LOCK TABLE {table} IN EXCLUSIVE MODE"))
        .execute(&mut *locker)
        .await
        .unwrap();
    let duplicate = tokio::time::timeout(
        Duration::from_secs(5),
        engine.process(&handler, &Delivery::new(pay("L-007", 10))),
    )
    .await;
    locker.rollback().await.unwrap();
    let report =
        duplicate.expect("the duplicate waited on the table lock: it was claimed, not looked up");
    assert!(
        matches!(report.outcome, Outcome::Duplicate { .. }),
        "{:?}",
        report.outcome
    );
    assert_eq!(runs.load(Ordering::SeqCst), 40);
}

/// A store that connected itself starts its sessions with the claim's
/// `lock_timeout` (10 s) instead of setting it on every `BEGIN`: the
/// handler's statements in the claim transaction still wait at most that
/// long for a lock.
#[tokio::test]
async fn a_connected_stores_claims_wait_at_most_its_lock_timeout() {
    let url = pg_url();
    let store = pg_store(&url, &unique("bounded")).await;
    let engine = Engine::builder(store)
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    let handler = handler_fn(
        |tx: onceonly::Tx<sqlx::Postgres>, Json(_p): Json<Pay>| async move {
            let mut conn = tx.lock().await?;
            let bound: String = sqlx::query_scalar("SHOW lock_timeout")
                .fetch_one(&mut *conn)
                .await?;
            Ok::<_, HandlerError>(bound)
        },
    );
    let report = engine
        .process(&handler, &Delivery::new(pay("B-1", 1)))
        .await;
    match report.outcome {
        Outcome::Processed { result } => assert_eq!(result, "10s"),
        other => panic!("{other:?}"),
    }
}
