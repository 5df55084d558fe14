//! A model-based test of every store: random interleavings of what
//! deliveries, operators and failures do to a store, checked against what
//! the store promises.
//!
//! A seeded generator writes a program of operations: deliveries claimed
//! first or optimistically, alone or in batches, whose handler writes its
//! effect and then succeeds, fails, or kills its own database session (a
//! crash mid-transaction); sessions dropped after their writes; purges of
//! one scope or of the whole table (a rotation on the generations layout);
//! the clock moving on; and, on PostgreSQL's plain layout, the upgrade in
//! place to generations. `Advance` steps cut the program into rounds: in a
//! round the clock stands still and several lanes run their operations
//! concurrently against real servers, one engine per (scope, claim mode,
//! retention), two scopes sharing their keys.
//!
//! After every round the test reads the effects table and the store and
//! checks, per scope and key:
//! - no effect committed while an earlier one's record was still live (a
//!   key with a live record is never claimed again);
//! - every effect belongs to an attempt that reported `Processed`, or whose
//!   outcome was a failure that may have committed; none to an attempt that
//!   failed in its handler, crashed, was abandoned, or was a duplicate or a
//!   conflict (at most one effect per claim);
//! - every `Processed` has its effect (no acked delivery lacks its effect);
//!   every `Duplicate` names a committed effect of the same payload, every
//!   `Conflict` stands for one of another payload;
//! - a key whose effect is live reads back from the store with that
//!   effect's result;
//! - every operation ends (each is bounded; a hang is a failure).
//!
//! Redis alone (fenced leases in real time) has a model of its own.
//!
//! `MODEL_SEEDS=N` runs N seeds per backend (default 8, as `scripts/test`
//! does); `MODEL_SEED=S` runs seed S only; `MODEL_OPS=N` sets the program
//! length (default 80). A failure prints the seed, then shrinks the
//! program (dropping operations while it still fails) and prints the
//! smallest one found.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceonly::redis::{CachedStore, RedisClaim, RedisStore};
use onceonly::{
    Delivery, Engine, Failure, Handler, HandlerError, Json, ManualClock, Outcome, PgStore,
    RetryPolicy, SqlStore, Tx,
};
use onceonly_integration_tests::{
    mysql_store, mysql_url, pg_generations_store, pg_store, pg_url, redis_url, sqlite_store, unique,
};
use serde::{Deserialize, Serialize};
use sqlx::{Database, MySql, Pool, Postgres, Sqlite};

// ------------------------------------------------------------ the program

/// What a handler does after writing its effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// Returns its result.
    Succeed,
    /// Returns an error: the attempt rolls back.
    Fail,
    /// Kills its own database session: the transaction dies with the
    /// connection, as when the process crashes.
    Crash,
}

/// One step of a program. `lane`: which concurrent lane of its round runs
/// it; `engine`: which of [`ENGINES`].
#[derive(Clone, Debug)]
enum Op {
    Deliver {
        lane: u8,
        engine: u8,
        key: u8,
        payload: u8,
        fate: Fate,
        /// A possible redelivery after a crash: its start is counted
        /// durably and it runs alone.
        suspect: bool,
    },
    Batch {
        lane: u8,
        engine: u8,
        items: Vec<(u8, u8, Fate)>,
    },
    /// A session claimed, written in, and dropped unfinished.
    Abandon {
        lane: u8,
        engine: u8,
        key: u8,
        payload: u8,
    },
    Purge {
        lane: u8,
        scope: Option<u8>,
    },
    /// The clock moves on (ends a round).
    Advance(i64),
    /// PostgreSQL plain layout only: upgrade to generations in place.
    Upgrade {
        lane: u8,
    },
}

impl Op {
    fn lane(&self) -> u8 {
        match self {
            Self::Deliver { lane, .. }
            | Self::Batch { lane, .. }
            | Self::Abandon { lane, .. }
            | Self::Purge { lane, .. }
            | Self::Upgrade { lane } => *lane,
            Self::Advance(_) => 0,
        }
    }
}

/// The engines: scope, optimistic, retention (ms).
const ENGINES: [(&str, bool, i64); 4] = [
    ("a", false, 40),
    ("a", true, 150),
    ("b", false, 150),
    ("b", true, 40),
];
const SCOPES: [&str; 2] = ["a", "b"];
const KEYS: u8 = 5;
const LANES: u8 = 5;

fn generate(seed: u64, len: usize, upgrade: bool) -> Vec<Op> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut ops = Vec::with_capacity(len);
    let mut upgraded = false;
    let fate = |rng: &mut fastrand::Rng| match rng.u8(0..10) {
        0 => Fate::Fail,
        1 => Fate::Crash,
        _ => Fate::Succeed,
    };
    for _ in 0..len {
        let lane = rng.u8(0..LANES);
        let engine = rng.u8(0..ENGINES.len() as u8);
        let op = match rng.u8(0..100) {
            0..=47 => Op::Deliver {
                lane,
                engine,
                key: rng.u8(0..KEYS),
                payload: u8::from(rng.u8(0..8) == 0),
                fate: fate(&mut rng),
                suspect: rng.u8(0..8) == 0,
            },
            48..=59 => Op::Batch {
                lane,
                engine,
                items: (0..rng.usize(2..5))
                    .map(|_| (rng.u8(0..KEYS), u8::from(rng.u8(0..8) == 0), fate(&mut rng)))
                    .collect(),
            },
            60..=65 => Op::Abandon {
                lane,
                engine,
                key: rng.u8(0..KEYS),
                payload: 0,
            },
            66..=77 => Op::Purge {
                lane,
                scope: (rng.u8(0..3) > 0).then(|| rng.u8(0..2)),
            },
            78..=79 if upgrade && !upgraded => {
                upgraded = true;
                Op::Upgrade { lane }
            }
            78..=89 => Op::Deliver {
                lane,
                engine,
                key: rng.u8(0..KEYS),
                payload: 0,
                fate: Fate::Succeed,
                suspect: false,
            },
            _ => Op::Advance(rng.i64(10..=120)),
        };
        ops.push(op);
    }
    ops
}

/// The number of seeds, the program length, or one seed to replay.
fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let n: u64 = std::env::var("MODEL_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    (0..n).map(|i| 0x6f6e_6365 + i * 7919).collect()
}

fn program_len() -> usize {
    std::env::var("MODEL_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(80)
}

// ----------------------------------------------------- the business table

/// The effects table in each SQL dialect, and how a handler kills its own
/// session.
#[async_trait]
trait EffectSql: Database {
    async fn create(pool: &Pool<Self>, table: &str);
    async fn insert(
        conn: &mut Self::Connection,
        table: &str,
        e: &EffectRow,
    ) -> Result<(), sqlx::Error>;
    async fn all(pool: &Pool<Self>, table: &str) -> Vec<EffectRow>;
    /// Ends the session the connection is on, from inside it; `false` if
    /// the backend has no session to end (SQLite).
    async fn kill(conn: &mut Self::Connection) -> bool;
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct EffectRow {
    scope: String,
    idem_key: String,
    attempt: i64,
    payload: i64,
}

macro_rules! effect_sql {
    ($db:ty, $p:expr, $kill:expr) => {
        #[async_trait]
        impl EffectSql for $db {
            async fn create(pool: &Pool<Self>, table: &str) {
                sqlx::query(&format!(
                    "CREATE TABLE {table} (scope VARCHAR(8) NOT NULL, idem_key VARCHAR(32) NOT NULL, \
                     attempt BIGINT NOT NULL, payload BIGINT NOT NULL)"
                ))
                .execute(pool)
                .await
                .expect("effects table");
            }

            async fn insert(
                conn: &mut Self::Connection,
                table: &str,
                e: &EffectRow,
            ) -> Result<(), sqlx::Error> {
                let p = $p;
                sqlx::query(&format!(
                    "INSERT INTO {table} (scope, idem_key, attempt, payload) VALUES ({}, {}, {}, {})",
                    p[0], p[1], p[2], p[3]
                ))
                .bind(&e.scope)
                .bind(&e.idem_key)
                .bind(e.attempt)
                .bind(e.payload)
                .execute(&mut *conn)
                .await
                .map(|_| ())
            }

            async fn all(pool: &Pool<Self>, table: &str) -> Vec<EffectRow> {
                let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(&format!(
                    "SELECT scope, idem_key, attempt, payload FROM {table}"
                ))
                .fetch_all(pool)
                .await
                .expect("read the effects");
                rows.into_iter()
                    .map(|(scope, idem_key, attempt, payload)| EffectRow {
                        scope,
                        idem_key,
                        attempt,
                        payload,
                    })
                    .collect()
            }

            async fn kill(conn: &mut Self::Connection) -> bool {
                $kill(conn).await
            }
        }
    };
}

effect_sql!(Postgres, ["$1", "$2", "$3", "$4"], kill_postgres);
effect_sql!(MySql, ["?", "?", "?", "?"], kill_mysql);
effect_sql!(Sqlite, ["?1", "?2", "?3", "?4"], kill_nothing);

async fn kill_postgres(conn: &mut sqlx::PgConnection) -> bool {
    let _ = sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
        .execute(&mut *conn)
        .await;
    true
}

async fn kill_mysql(conn: &mut sqlx::MySqlConnection) -> bool {
    let id: Result<u64, _> = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut *conn)
        .await;
    if let Ok(id) = id {
        let _ = sqlx::query(&format!("KILL CONNECTION {id}"))
            .execute(&mut *conn)
            .await;
    }
    true
}

/// SQLite has no session to end: the attempt fails like any other.
async fn kill_nothing(_conn: &mut sqlx::SqliteConnection) -> bool {
    false
}

// --------------------------------------------------------------- handler

/// A delivery's body.
#[derive(Serialize, Deserialize)]
struct Body {
    k: String,
    p: i64,
}

/// Writes the effect, then meets the fate the delivery carries.
struct Effects {
    table: String,
}

#[async_trait]
impl<DB: EffectSql> Handler<DB> for Effects {
    type Input = Json<Body>;
    type Output = i64;

    async fn handle(
        &self,
        tx: Tx<DB>,
        Json(body): Json<Body>,
        delivery: &Delivery,
    ) -> Result<i64, HandlerError> {
        let attempt = meta_i64(delivery, "attempt");
        let fate = match meta_i64(delivery, "fate") {
            1 => Fate::Fail,
            2 => Fate::Crash,
            _ => Fate::Succeed,
        };
        let row = EffectRow {
            scope: tx.origin().scope().to_owned(),
            idem_key: body.k,
            attempt,
            payload: body.p,
        };
        let mut conn = tx.lock().await?;
        DB::insert(&mut conn, &self.table, &row).await?;
        match fate {
            Fate::Succeed => Ok(attempt),
            Fate::Fail => Err(HandlerError::permanent("the fate of this attempt")),
            Fate::Crash => {
                DB::kill(&mut conn).await;
                Err(HandlerError::permanent("crashed mid-transaction"))
            }
        }
    }
}

fn meta_i64(d: &Delivery, name: &str) -> i64 {
    d.metadata(name)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

fn delivery(attempt: i64, key: u8, payload: u8, fate: Fate) -> Delivery {
    let body = serde_json::to_vec(&Body {
        k: format!("K{key}"),
        p: i64::from(payload),
    })
    .expect("body");
    let fate = match fate {
        Fate::Succeed => 0,
        Fate::Fail => 1,
        Fate::Crash => 2,
    };
    Delivery::new(body)
        .with_metadata("attempt", attempt.to_string())
        .with_metadata("fate", fate.to_string())
}

// ------------------------------------------------------------ the harness

/// A fresh store and its effects table, for one run of a program.
struct Setup<S: SqlStore> {
    store: S,
    /// The same table opened with the generations layout (the upgrade's
    /// target), on PostgreSQL's plain layout.
    upgraded: Option<S>,
    effects: String,
}

/// What an attempt reported.
#[derive(Clone, Debug)]
enum Seen {
    Processed(i64),
    Duplicate(Option<i64>),
    Conflict,
    /// A failure: `fate` what its handler was told to do, `error` what
    /// it reported (shown in failure messages).
    Failed {
        fate: Fate,
        #[allow(dead_code)]
        error: String,
    },
    /// A rejection (never expected here).
    Rejected(String),
    /// Abandoned after its write.
    Abandoned,
    /// Found the key committed by the cache tier or claim before running.
    Skipped,
}

/// One attempt: what it was, and what it reported.
#[derive(Clone, Debug)]
struct Attempt {
    engine: u8,
    key: u8,
    payload: u8,
    round_at: i64,
    seen: Seen,
}

/// The state one run shares between its lanes.
struct Run<S: SqlStore> {
    engines: Mutex<Arc<Vec<Engine<S>>>>,
    store: Mutex<S>,
    upgraded: Option<S>,
    effects: String,
    clock: ManualClock,
    next_attempt: AtomicI64,
    attempts: Mutex<BTreeMap<i64, Attempt>>,
}

fn engines<S: SqlStore>(store: &S, clock: &ManualClock) -> Arc<Vec<Engine<S>>> {
    Arc::new(
        ENGINES
            .iter()
            .map(|(scope, optimistic, retention)| {
                Engine::builder(store.clone())
                    .scope(*scope)
                    .key_expr("json:/k")
                    .optimistic(*optimistic)
                    .retention(Duration::from_millis(*retention as u64))
                    .retry(RetryPolicy::none())
                    .clock(clock.clone())
                    .build()
                    .expect("engine")
            })
            .collect(),
    )
}

/// How long one operation may take: a hang is a failure.
const OP_BOUND: Duration = Duration::from_secs(60);

impl<S: SqlStore> Run<S>
where
    S::Db: EffectSql,
{
    fn attempt_id(&self) -> i64 {
        self.next_attempt.fetch_add(1, Ordering::SeqCst)
    }

    fn record(&self, id: i64, attempt: Attempt) {
        self.attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, attempt);
    }

    fn current(&self) -> (Arc<Vec<Engine<S>>>, S) {
        let engines = self
            .engines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let store = self.store.lock().unwrap_or_else(|p| p.into_inner()).clone();
        (engines, store)
    }

    async fn op(&self, op: &Op) -> Result<(), String> {
        let handler = Effects {
            table: self.effects.clone(),
        };
        let (engine_set, store) = self.current();
        let now = onceonly::Clock::now_ms(&self.clock);
        match op {
            Op::Deliver {
                engine,
                key,
                payload,
                fate,
                suspect,
                ..
            } => {
                let id = self.attempt_id();
                let d = delivery(id, *key, *payload, *fate).with_suspect(*suspect);
                let report = engine_set[usize::from(*engine)].process(&handler, &d).await;
                self.record(
                    id,
                    attempt(*engine, *key, *payload, now, *fate, report.outcome),
                );
            }
            Op::Batch { engine, items, .. } => {
                let ids: Vec<i64> = items.iter().map(|_| self.attempt_id()).collect();
                let ds: Vec<Delivery> = items
                    .iter()
                    .zip(&ids)
                    .map(|((k, p, f), id)| delivery(*id, *k, *p, *f))
                    .collect();
                let reports = engine_set[usize::from(*engine)]
                    .process_batch(&handler, &ds)
                    .await;
                for (((k, p, f), id), report) in items.iter().zip(&ids).zip(reports) {
                    self.record(*id, attempt(*engine, *k, *p, now, *f, report.outcome));
                }
            }
            Op::Abandon {
                engine,
                key,
                payload,
                ..
            } => {
                let id = self.attempt_id();
                let d = delivery(id, *key, *payload, Fate::Succeed);
                let engine_ref = &engine_set[usize::from(*engine)];
                let seen = match engine_ref.claim(&d).await {
                    Ok(onceonly::engine::Claimed::New(session)) => {
                        let row = EffectRow {
                            scope: ENGINES[usize::from(*engine)].0.to_owned(),
                            idem_key: format!("K{key}"),
                            attempt: id,
                            payload: i64::from(*payload),
                        };
                        let tx = session.tx();
                        if let Ok(mut conn) = tx.lock().await {
                            let _ = S::Db::insert(&mut conn, &self.effects, &row).await;
                        }
                        drop(tx);
                        session.abandon().await;
                        Seen::Abandoned
                    }
                    Ok(_) => Seen::Skipped,
                    Err(e) => Seen::Failed {
                        fate: Fate::Fail,
                        error: e.to_string(),
                    },
                };
                self.record(
                    id,
                    Attempt {
                        engine: *engine,
                        key: *key,
                        payload: *payload,
                        round_at: now,
                        seen,
                    },
                );
            }
            Op::Purge { scope, .. } => {
                let scope = scope.map(|s| SCOPES[usize::from(s)]);
                // Purge errors (a rotation that met contention) are the
                // store's business: no effect depends on them.
                for _ in 0..20 {
                    match store.purge_expired(scope, now, 7).await {
                        Ok(n) if n < 7 => break,
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
            }
            Op::Upgrade { .. } => {
                let Some(upgraded) = &self.upgraded else {
                    return Ok(());
                };
                let mut last = None;
                for _ in 0..5 {
                    match upgraded.migrate().await {
                        Ok(()) => {
                            last = None;
                            break;
                        }
                        Err(e) => last = Some(e.to_string()),
                    }
                }
                if let Some(e) = last {
                    return Err(format!("the upgrade in place failed: {e}"));
                }
                *self.store.lock().unwrap_or_else(|p| p.into_inner()) = upgraded.clone();
                *self.engines.lock().unwrap_or_else(|p| p.into_inner()) =
                    engines(upgraded, &self.clock);
            }
            Op::Advance(_) => {}
        }
        Ok(())
    }
}

fn attempt<T: Into<i64> + Copy>(
    engine: u8,
    key: u8,
    payload: u8,
    round_at: i64,
    fate: Fate,
    outcome: Outcome<T>,
) -> Attempt {
    let seen = match outcome {
        Outcome::Processed { result } => Seen::Processed(result.into()),
        Outcome::Duplicate { result } => Seen::Duplicate(result.map(Into::into)),
        Outcome::Conflict { .. } => Seen::Conflict,
        Outcome::Rejected(r) => Seen::Rejected(r.to_string()),
        Outcome::Failed(f) => Seen::Failed {
            fate,
            error: failure_text(&f),
        },
        _ => Seen::Rejected("an unknown outcome".into()),
    };
    Attempt {
        engine,
        key,
        payload,
        round_at,
        seen,
    }
}

fn failure_text(f: &Failure) -> String {
    format!("{f} ({})", f.reason())
}

/// Runs `ops` on a fresh setup: what its attempts reported (counts by
/// kind), or what broke, after which round.
async fn run_program<S, F, Fut>(
    make: &F,
    ops: &[Op],
) -> Result<BTreeMap<&'static str, usize>, String>
where
    S: SqlStore,
    S::Db: EffectSql,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Setup<S>>,
{
    let setup = make().await;
    S::Db::create(setup.store.pool(), &setup.effects).await;
    let clock = ManualClock::new(1_000_000);
    let run = Arc::new(Run {
        engines: Mutex::new(engines(&setup.store, &clock)),
        store: Mutex::new(setup.store.clone()),
        upgraded: setup.upgraded.clone(),
        effects: setup.effects.clone(),
        clock: clock.clone(),
        next_attempt: AtomicI64::new(1),
        attempts: Mutex::new(BTreeMap::new()),
    });
    let mut rounds: Vec<Vec<Op>> = vec![Vec::new()];
    let mut advances = Vec::new();
    for op in ops {
        match op {
            Op::Advance(ms) => {
                advances.push(*ms);
                rounds.push(Vec::new());
            }
            other => rounds.last_mut().expect("a round").push(other.clone()),
        }
    }
    for (n, round) in rounds.iter().enumerate() {
        let mut lanes: BTreeMap<u8, Vec<Op>> = BTreeMap::new();
        for op in round {
            lanes.entry(op.lane()).or_default().push(op.clone());
        }
        let tasks: Vec<_> = lanes
            .into_values()
            .map(|ops| {
                let run = Arc::clone(&run);
                tokio::spawn(async move {
                    for op in &ops {
                        match tokio::time::timeout(OP_BOUND, run.op(op)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => return Err(e),
                            Err(_) => {
                                return Err(format!("{op:?} did not end within {OP_BOUND:?}"));
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for task in tasks {
            task.await
                .map_err(|e| format!("round {n}: a lane panicked: {e}"))?
                .map_err(|e| format!("round {n}: {e}"))?;
        }
        check(&run, n).await?;
        if let Some(ms) = advances.get(n) {
            clock.advance_ms(*ms);
        }
    }
    let mut tally = BTreeMap::new();
    for a in run
        .attempts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
    {
        let kind = match &a.seen {
            Seen::Processed(_) => "processed",
            Seen::Duplicate(_) => "duplicate",
            Seen::Conflict => "conflict",
            Seen::Failed { .. } => "failed",
            Seen::Rejected(_) => "rejected",
            Seen::Abandoned => "abandoned",
            Seen::Skipped => "skipped",
        };
        *tally.entry(kind).or_insert(0) += 1;
    }
    Ok(tally)
}

/// Checks the effects and the store against what the attempts reported.
async fn check<S>(run: &Run<S>, round: usize) -> Result<(), String>
where
    S: SqlStore,
    S::Db: EffectSql,
{
    let (_, store) = run.current();
    let effects = S::Db::all(store.pool(), &run.effects).await;
    let attempts = run
        .attempts
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let now = onceonly::Clock::now_ms(&run.clock);
    let fail = |what: String| Err(format!("after round {round} (clock {now}): {what}"));
    let by_attempt: HashMap<i64, &EffectRow> = effects.iter().map(|e| (e.attempt, e)).collect();
    if by_attempt.len() != effects.len() {
        return fail("one attempt wrote two effects".into());
    }
    // Every effect belongs to an attempt that may have committed.
    for e in &effects {
        let Some(a) = attempts.get(&e.attempt) else {
            return fail(format!("an effect of an unknown attempt: {e:?}"));
        };
        let may_commit = match &a.seen {
            Seen::Processed(_) => true,
            // A failure after the handler succeeded may be a commit that
            // reached the database.
            Seen::Failed {
                fate: Fate::Succeed,
                ..
            } => true,
            _ => false,
        };
        if !may_commit {
            return fail(format!(
                "attempt {} committed its effect but reported {:?}",
                e.attempt, a.seen
            ));
        }
    }
    // Every processed attempt has its effect; duplicates and conflicts
    // stand for committed effects.
    for (id, a) in &attempts {
        let scope = ENGINES[usize::from(a.engine)].0;
        let key = format!("K{}", a.key);
        match &a.seen {
            Seen::Processed(result) => {
                if result != id || !by_attempt.contains_key(id) {
                    return fail(format!(
                        "attempt {id} was acked as processed without its effect ({a:?})"
                    ));
                }
            }
            Seen::Duplicate(result) => {
                let Some(first) = result else {
                    return fail(format!("attempt {id}: a duplicate without a stored result"));
                };
                match by_attempt.get(first) {
                    Some(e) if e.scope == scope && e.idem_key == key => {
                        if e.payload != i64::from(a.payload) {
                            return fail(format!(
                                "attempt {id}: a duplicate of {first}, whose payload differs (a conflict)"
                            ));
                        }
                    }
                    _ => {
                        return fail(format!(
                            "attempt {id}: a duplicate of {first}, which committed no effect of this key"
                        ));
                    }
                }
            }
            Seen::Conflict => {
                let other = effects.iter().any(|e| {
                    e.scope == scope && e.idem_key == key && e.payload != i64::from(a.payload)
                });
                if !other {
                    return fail(format!(
                        "attempt {id}: a conflict with no effect of another payload"
                    ));
                }
            }
            Seen::Rejected(why) => return fail(format!("attempt {id} was rejected: {why}")),
            Seen::Failed { .. } | Seen::Abandoned | Seen::Skipped => {}
        }
    }
    // No effect while an earlier one of its key was live; the live one
    // reads back from the store.
    // (scope, key) -> (claimed at, live until, attempt) of each effect.
    type Lives = Vec<(i64, i64, i64)>;
    let mut per_key: BTreeMap<(String, String), Lives> = BTreeMap::new();
    for e in &effects {
        let a = &attempts[&e.attempt];
        let retention = ENGINES[usize::from(a.engine)].2;
        per_key
            .entry((e.scope.clone(), e.idem_key.clone()))
            .or_default()
            .push((a.round_at, a.round_at + retention, e.attempt));
    }
    for ((scope, key), mut list) in per_key {
        list.sort_unstable();
        for pair in list.windows(2) {
            let ((_, live_until, first), (at, _, second)) = (pair[0], pair[1]);
            if at < live_until {
                return fail(format!(
                    "{scope}/{key}: attempt {second} committed at {at} while attempt {first}'s \
                     record was live until {live_until}: a doubled effect"
                ));
            }
        }
        if let Some(&(_, live_until, last)) = list.last()
            && live_until > now
        {
            let record = store
                .get(&scope, &key)
                .await
                .map_err(|e| format!("read {scope}/{key}: {e}"))?;
            let result = record
                .filter(|r| r.expires_at_ms > now)
                .and_then(|r| r.result)
                .and_then(|r| serde_json::from_slice::<i64>(&r).ok());
            if result != Some(last) {
                return fail(format!(
                    "{scope}/{key}: attempt {last}'s record is live until {live_until}, \
                     but the store reads {result:?}"
                ));
            }
        }
    }
    Ok(())
}

/// Runs every seed on `make`'s store; a failure is shrunk and reported.
async fn model<S, F, Fut>(backend: &str, upgrade: bool, make: F)
where
    S: SqlStore,
    S::Db: EffectSql,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Setup<S>>,
{
    let len = program_len();
    for seed in seeds() {
        let ops = generate(seed, len, upgrade);
        let started = Instant::now();
        let error = match run_program(&make, &ops).await {
            Ok(tally) => {
                eprintln!(
                    "model {backend}: seed {seed} ({} ops) held in {:?}: {tally:?}",
                    ops.len(),
                    started.elapsed()
                );
                continue;
            }
            Err(error) => error,
        };
        eprintln!("model {backend}: seed {seed} FAILED: {error}\nshrinking...");
        let (small, small_error) = shrink(&make, ops, error).await;
        panic!(
            "model {backend}: seed {seed} failed (replay: MODEL_SEED={seed} MODEL_OPS={len}).\n\
             Smallest failing program ({} ops):\n{}\nIt fails with: {small_error}",
            small.len(),
            small
                .iter()
                .map(|op| format!("  {op:?}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Drops operations (halves, then quarters, ..., then one at a time) while
/// the program still fails; at most 3 minutes.
async fn shrink<S, F, Fut>(make: &F, mut ops: Vec<Op>, mut error: String) -> (Vec<Op>, String)
where
    S: SqlStore,
    S::Db: EffectSql,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Setup<S>>,
{
    let until = Instant::now() + Duration::from_secs(180);
    let mut chunk = ops.len() / 2;
    while chunk >= 1 && Instant::now() < until {
        let mut start = 0;
        let mut progressed = false;
        while start < ops.len() && Instant::now() < until {
            let mut candidate = ops.clone();
            let end = (start + chunk).min(candidate.len());
            candidate.drain(start..end);
            // Interleavings vary: a candidate gets two tries.
            let mut failed = None;
            for _ in 0..2 {
                if let Err(e) = run_program(make, &candidate).await {
                    failed = Some(e);
                    break;
                }
            }
            match failed {
                Some(e) => {
                    ops = candidate;
                    error = e;
                    progressed = true;
                }
                None => start += chunk,
            }
        }
        if !progressed {
            chunk /= 2;
        }
    }
    (ops, error)
}

// -------------------------------------------------------------- backends

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_postgres_plain_with_an_upgrade_in_place() {
    model("postgres plain", true, || async {
        let table = unique("model_pg");
        let store = pg_store(&pg_url(), &table).await;
        let upgraded = store.clone().generations(true);
        Setup {
            store,
            upgraded: Some(upgraded),
            effects: unique("model_fx"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_postgres_generations_one_bucket() {
    model("postgres generations, 1 bucket", false, || async {
        let table = unique("model_g1");
        let store = PgStore::connect(&pg_url())
            .await
            .expect("postgres")
            .with_table(&table)
            .expect("table")
            .generations(true)
            .generation_buckets(1);
        store.migrate().await.expect("migrate");
        Setup {
            store,
            upgraded: None,
            effects: unique("model_fx"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_postgres_generations_eight_buckets() {
    model("postgres generations, 8 buckets", false, || async {
        Setup {
            store: pg_generations_store(&pg_url(), &unique("model_g8")).await,
            upgraded: None,
            effects: unique("model_fx"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_mariadb() {
    model("mariadb", false, || async {
        Setup {
            store: mysql_store(&mysql_url(), &unique("model_my")).await,
            upgraded: None,
            effects: unique("model_fx"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_owned();
    model("sqlite", false, || {
        let path = path.join(format!("{}.db", unique("model")));
        async move {
            Setup {
                store: sqlite_store(&path, "onceonly_keys").await,
                upgraded: None,
                effects: unique("model_fx"),
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_redis_tier_in_front_of_postgres() {
    model("redis tier + postgres", false, || async {
        let sql = pg_store(&pg_url(), &unique("model_tier")).await;
        Setup {
            store: CachedStore::connect(sql, &redis_url()).expect("redis"),
            upgraded: None,
            effects: unique("model_fx"),
        }
    })
    .await;
}

// ------------------------------------------------------- Redis alone

/// Redis's fenced leases, in real time: lanes claim keys and complete,
/// release, abandon (crash: the lease runs out) or outlive their lease
/// before completing. Checked: a completion is accepted at most once per
/// key, and only from the lease's owner while no one else could hold it;
/// a `Done` answer returns that completion's result; no claim is granted
/// while a completion or an unexpired, unreleased lease certainly stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_redis_fenced_leases() {
    const LEASE: Duration = Duration::from_millis(300);
    for seed in seeds() {
        let store = RedisStore::connect(&redis_url())
            .await
            .expect("redis")
            .with_prefix(format!("{}:", unique("model")))
            .with_lease(LEASE)
            .with_retention(Duration::from_secs(60));
        let log: Arc<Mutex<Vec<Event>>> = Arc::default();
        let epoch = Instant::now();
        let tasks: Vec<_> = (0..LANES)
            .map(|lane| {
                let store = store.clone();
                let log = Arc::clone(&log);
                let mut rng = fastrand::Rng::with_seed(seed ^ u64::from(lane) << 32);
                tokio::spawn(async move {
                    for step in 0..25 {
                        let key = format!("K{}", rng.u8(0..3));
                        let attempt = i64::from(lane) * 1000 + step;
                        let started = epoch.elapsed();
                        let claim = store.claim("s", &key, None).await.expect("claim");
                        let ended = epoch.elapsed();
                        let lease = match claim {
                            RedisClaim::Claimed(lease) => lease,
                            RedisClaim::Done(result) => {
                                let result = std::str::from_utf8(&result)
                                    .ok()
                                    .and_then(|r| r.parse().ok());
                                push(&log, Event::Done { key, result });
                                continue;
                            }
                            _ => continue,
                        };
                        push(
                            &log,
                            Event::Claimed {
                                key: key.clone(),
                                attempt,
                                started,
                                ended,
                            },
                        );
                        match rng.u8(0..10) {
                            // Crash: the lease runs out.
                            0 => {}
                            1 | 2 => {
                                let asked = epoch.elapsed();
                                let released = store.release(&lease).await.expect("release");
                                if released {
                                    push(&log, Event::Released { attempt, asked });
                                }
                            }
                            fate => {
                                if fate == 3 {
                                    // Outlives its lease before completing.
                                    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
                                } else {
                                    tokio::time::sleep(Duration::from_millis(rng.u64(0..30))).await;
                                }
                                let asked = epoch.elapsed();
                                let done = store
                                    .complete(&lease, attempt.to_string().as_bytes())
                                    .await
                                    .expect("complete");
                                if done {
                                    push(
                                        &log,
                                        Event::Completed {
                                            key,
                                            attempt,
                                            asked,
                                            at: epoch.elapsed(),
                                        },
                                    );
                                }
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(rng.u64(0..40))).await;
                    }
                })
            })
            .collect();
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(120), task)
                .await
                .expect("a lane did not end")
                .expect("a lane panicked");
        }
        let log = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Err(e) = check_leases(&log, LEASE) {
            panic!("model redis: seed {seed}: {e}\nevents: {log:#?}");
        }
        eprintln!("model redis: seed {seed} held ({} events)", log.len());
    }
}

#[derive(Clone, Debug)]
enum Event {
    Claimed {
        key: String,
        attempt: i64,
        started: Duration,
        ended: Duration,
    },
    Released {
        attempt: i64,
        asked: Duration,
    },
    Completed {
        key: String,
        attempt: i64,
        asked: Duration,
        at: Duration,
    },
    Done {
        key: String,
        result: Option<i64>,
    },
}

fn push(log: &Mutex<Vec<Event>>, e: Event) {
    log.lock().unwrap_or_else(|p| p.into_inner()).push(e);
}

fn check_leases(log: &[Event], lease: Duration) -> Result<(), String> {
    let mut completed: HashMap<&str, (i64, Duration)> = HashMap::new();
    let mut claims: Vec<(&str, i64, Duration, Duration)> = Vec::new();
    let mut released: HashMap<i64, Duration> = HashMap::new();
    for e in log {
        match e {
            Event::Completed {
                key, attempt, at, ..
            } => {
                if let Some((first, _)) = completed.insert(key, (*attempt, *at)) {
                    return Err(format!(
                        "{key} completed twice: by {first} and by {attempt}"
                    ));
                }
            }
            Event::Claimed {
                key,
                attempt,
                started,
                ended,
            } => {
                claims.push((key, *attempt, *started, *ended));
            }
            Event::Released { attempt, asked } => {
                released.insert(*attempt, *asked);
            }
            Event::Done { .. } => {}
        }
    }
    for e in log {
        if let Event::Completed {
            key,
            attempt,
            asked,
            ..
        } = e
        {
            // Accepted from the owner only: no one else was granted the
            // key between its claim and its completion.
            let Some(&(_, _, _, ended)) = claims.iter().find(|c| c.1 == *attempt) else {
                return Err(format!(
                    "{key}: completion by {attempt}, which never claimed it"
                ));
            };
            let others = claims.iter().filter(|c| c.0 == key && c.1 != *attempt);
            for &(_, other, other_started, other_ended) in others {
                // Granted surely after this claim and before this
                // completion was asked: fencing must refuse the completion.
                if other_started > ended && other_ended < *asked {
                    return Err(format!(
                        "{key}: the completion of {attempt} was accepted after {other} claimed the key"
                    ));
                }
            }
        }
        if let Event::Done { key, result, .. } = e {
            match completed.get(key.as_str()) {
                Some((attempt, _)) if Some(*attempt) == *result => {}
                other => {
                    return Err(format!(
                        "{key}: done with result {result:?}, but the completion was {other:?}"
                    ));
                }
            }
        }
    }
    // No claim while a completion or a held lease certainly stood.
    for &(key, attempt, started, ended) in &claims {
        if let Some((first, at)) = completed.get(key)
            && *at < started
        {
            return Err(format!(
                "{key}: {attempt} claimed it after {first} completed it"
            ));
        }
        for &(other_key, other, other_started, other_ended) in &claims {
            if other_key != key || other == attempt || other_ended >= started {
                continue;
            }
            // `other` surely held the key from its claim's answer until
            // `other_started + lease`, unless it released or completed it.
            let held_until = other_started + lease;
            let ended_early = released.get(&other).copied().or_else(|| {
                completed
                    .get(key)
                    .filter(|(a, _)| *a == other)
                    .map(|(_, at)| *at)
            });
            let free_from = ended_early.map_or(held_until, |at| at.min(held_until));
            if ended < free_from {
                return Err(format!(
                    "{key}: {attempt} was granted the key while {other}'s lease stood"
                ));
            }
        }
    }
    Ok(())
}
