//! A seeded simulation of the engine where its features meet: random
//! programs of deliveries (keys, payloads, entities and orders of a fence,
//! redeliveries, conflicting reuses of a key, replays of dead letters,
//! batches) run through the real engine on PostgreSQL (both layouts),
//! MariaDB and SQLite, claim-first and optimistic. The handler calls a
//! loopback provider API that honours `Idempotency-Key` through a step,
//! then books the refund and moves the entity's state, and faults hit it
//! at random: a failure after the step or after the writes (rolled back),
//! and process death at a random instant of a delivery (its future dropped
//! wherever it is awaiting: everything uncommitted is gone, a step already
//! recorded stays), the Completer running in between.
//!
//! After every action an oracle checks what users care about:
//!
//! - each key's refund is booked at most once, and once its delivery was
//!   acknowledged as processed or a duplicate, exactly once;
//! - an entity's state never moves to an older order;
//! - a stale acknowledgement never hides an effect: a key acknowledged
//!   stale has no refund at the provider;
//! - every acknowledgement is backed by a committed record;
//!
//! - every action ends within a minute (no lock left behind);
//!
//! and at the end, once every key was delivered again until it settled:
//! every refund the provider made is booked, or reported by the Completer.
//!
//! A failure prints the seed and the program shrunk to the actions that
//! still fail. `scripts/test` runs a fixed set of seeds; `SIM_SEEDS=N`
//! runs N more (random unless `SIM_SEED=S` starts them).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onceonly::ops::Completer;
use onceonly::{
    Delivery, Engine, FenceSpec, HandlerError, Json, KeySpec, OrderSpec, Outcome, RetryPolicy,
    SqlStore, Tx, handler_fn,
};
use onceonly_integration_tests::provider_api::{ProviderApi, refund_step};
use onceonly_integration_tests::{
    mysql_store, mysql_url, pg_generations_store, pg_store, pg_url, sqlite_store, unique,
};
use serde_json::{Value, json};
use sqlx::{Database, Encode, Executor, IntoArguments, Type};

const SECRET: &str = "simulation-downstream-secret";
/// Seeds every run of `scripts/test` tries, per backend.
const FIXED_SEEDS: std::ops::Range<u64> = 1..41;
/// Actions per program.
const ACTIONS: usize = 36;

/// What goes wrong during one delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// The handler fails (retryable) once its step finished.
    AfterStep,
    /// The handler fails after its writes.
    AfterWrite,
    /// The process dies this many hundred µs into the delivery.
    Death(u64),
}

/// One action of a program.
#[derive(Clone, Debug)]
enum Action {
    /// Deliver payment `key` (of `entity` at `order`, `amount`).
    Deliver { key: u8, variant: u8, fault: Fault },
    /// Deliver these keys in one batch.
    Batch { keys: Vec<u8>, fault: Fault },
    /// Run the Completer.
    Complete,
}

/// The payment of key `k` (variant 1: the same key with another amount,
/// a reused key).
fn payment(k: u8, variant: u8) -> Value {
    let entity = format!("E{}", k % 3);
    let order = i64::from(k % 5) + 1;
    json!({
        "refund": format!("k{k}"),
        "entity": entity,
        "order": order,
        "amount": 100 + i64::from(k) + 1000 * i64::from(variant),
    })
}

fn program(seed: u64) -> Vec<Action> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let fault = |rng: &mut fastrand::Rng| match rng.u8(0..10) {
        0 | 1 => Fault::AfterStep,
        2 => Fault::AfterWrite,
        3 | 4 => Fault::Death(rng.u64(0..60)),
        _ => Fault::None,
    };
    (0..ACTIONS)
        .map(|_| match rng.u8(0..20) {
            0 => Action::Complete,
            1..=3 => Action::Batch {
                keys: (0..rng.usize(2..4)).map(|_| rng.u8(0..10)).collect(),
                fault: fault(&mut rng),
            },
            _ => Action::Deliver {
                key: rng.u8(0..10),
                variant: u8::from(rng.u8(0..12) == 0),
                fault: fault(&mut rng),
            },
        })
        .collect()
}

/// The dialect bits of the business tables.
struct Sql {
    ddl: [String; 2],
    book: String,
    apply: String,
}

impl Sql {
    fn new(tag: &str, mysql: bool) -> (Self, String, String) {
        let (ledger, applied) = (format!("sim_ledger_{tag}"), format!("sim_applied_{tag}"));
        let (id, p) = if mysql {
            (
                "BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY",
                ["?", "?", "?"],
            )
        } else if tag.starts_with("lite") {
            ("INTEGER PRIMARY KEY AUTOINCREMENT", ["?", "?", "?"])
        } else {
            ("BIGSERIAL PRIMARY KEY", ["$1", "$2", "$3"])
        };
        let sql = Sql {
            ddl: [
                format!(
                    "CREATE TABLE {ledger} (id {id}, k VARCHAR(16) NOT NULL, refund VARCHAR(64) NOT NULL, stale BIGINT NOT NULL)"
                ),
                format!(
                    "CREATE TABLE {applied} (id {id}, entity VARCHAR(16) NOT NULL, ord BIGINT NOT NULL)"
                ),
            ],
            book: format!(
                "INSERT INTO {ledger} (k, refund, stale) VALUES ({}, {}, {})",
                p[0], p[1], p[2]
            ),
            apply: format!(
                "INSERT INTO {applied} (entity, ord) VALUES ({}, {})",
                p[0], p[1]
            ),
        };
        (sql, ledger, applied)
    }
}

/// Everything one run of a program shares.
struct World {
    api: ProviderApi,
    /// The fault the next attempt of each key meets in its handler.
    faults: Mutex<BTreeMap<String, Fault>>,
    /// Downstream key -> simulation key.
    downstream: Mutex<BTreeMap<String, String>>,
}

/// What an oracle found wrong.
type Broken = String;

/// Runs `actions` on a fresh business schema of `store`: `Err` with what
/// broke.
async fn run<S>(
    store: &S,
    mysql: bool,
    steps: bool,
    optimistic: bool,
    actions: &[Action],
) -> Result<(), Broken>
where
    S: SqlStore,
    for<'c> &'c mut <S::Db as Database>::Connection: Executor<'c, Database = S::Db>,
    for<'c> &'c sqlx::Pool<S::Db>: Executor<'c, Database = S::Db>,
    for<'q> <S::Db as Database>::Arguments<'q>: IntoArguments<'q, S::Db>,
    for<'q> String: Encode<'q, S::Db> + Type<S::Db>,
    for<'q> i64: Encode<'q, S::Db> + Type<S::Db>,
    for<'r> (String, String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
    for<'r> (String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
{
    let tag = unique(if S::Db::NAME == "SQLite" { "lite" } else { "s" })
        .replace(|c: char| !c.is_ascii_alphanumeric(), "");
    let tag = &tag[..tag.len().min(40)];
    let (sql, ledger, applied) = Sql::new(tag, mysql);
    for ddl in &sql.ddl {
        sqlx::query(ddl)
            .execute(store.pool())
            .await
            .map_err(|e| e.to_string())?;
    }
    let world = Arc::new(World {
        api: ProviderApi::start().await,
        faults: Mutex::default(),
        downstream: Mutex::default(),
    });
    let builder = Engine::builder(store.clone())
        .scope(unique("sim"))
        .key_expr("json:/refund")
        .fence(FenceSpec::new(
            KeySpec::json_field("/entity"),
            OrderSpec::integer("/order"),
        ))
        .optimistic(optimistic)
        .retry(RetryPolicy::none());
    let builder = if steps {
        builder.downstream_secret(SECRET)
    } else {
        builder
    };
    let engine = builder.build().map_err(|e| e.to_string())?;
    let (book, apply) = (Arc::new(sql.book), Arc::new(sql.apply));
    let handler = handler_fn({
        let world = Arc::clone(&world);
        move |tx: Tx<S::Db>, Json(p): Json<Value>| {
            let (world, book, apply) = (Arc::clone(&world), Arc::clone(&book), Arc::clone(&apply));
            async move {
                let key = p["refund"].as_str().unwrap_or_default().to_owned();
                let fault = world
                    .faults
                    .lock()
                    .unwrap()
                    .remove(&key)
                    .unwrap_or(Fault::None);
                let stale = tx.fence().is_some_and(|f| f.is_stale());
                let refund = if steps {
                    world
                        .downstream
                        .lock()
                        .unwrap()
                        .insert(tx.downstream_key("refund")?, key.clone());
                    let api = world.api.url();
                    let body = json!({"payment": key, "amount": p["amount"]});
                    let answer: Value = tx.step("refund", |dk| refund_step(api, dk, body)).await?;
                    answer["id"].as_str().unwrap_or_default().to_owned()
                } else {
                    format!("local-{key}")
                };
                if fault == Fault::AfterStep {
                    return Err(HandlerError::retryable("fault after the step"));
                }
                {
                    let mut conn = tx.lock().await?;
                    sqlx::query(&book)
                        .bind(key.clone())
                        .bind(refund.clone())
                        .bind(i64::from(stale))
                        .execute(&mut *conn)
                        .await
                        .map_err(HandlerError::retryable)?;
                    // A stale delivery books its effect, never moves the
                    // entity's state back.
                    if !stale {
                        sqlx::query(&apply)
                            .bind(p["entity"].as_str().unwrap_or_default().to_owned())
                            .bind(p["order"].as_i64().unwrap_or_default())
                            .execute(&mut *conn)
                            .await
                            .map_err(HandlerError::retryable)?;
                    }
                }
                if fault == Fault::AfterWrite {
                    return Err(HandlerError::retryable("fault after the writes"));
                }
                Ok::<_, HandlerError>(refund)
            }
        }
    });
    let completer = Completer::builder(store.clone())
        .grace(Duration::ZERO)
        .build();
    // What was acknowledged, per key: processed or duplicate (the effect
    // must be booked), stale (no effect may exist).
    let mut acked: BTreeMap<String, &'static str> = BTreeMap::new();
    let mut reported: BTreeSet<String> = BTreeSet::new();

    let deliver = |k: u8, variant: u8| Delivery::new(payment(k, variant).to_string());
    for (step, action) in actions.iter().enumerate() {
        let (deliveries, fault, batch): (Vec<Delivery>, Fault, bool) = match action {
            Action::Complete => {
                for o in completer.check_once().await.map_err(|e| e.to_string())? {
                    if o.scope == engine.scope() {
                        reported.insert(o.key);
                    }
                }
                continue;
            }
            Action::Deliver {
                key,
                variant,
                fault,
            } => (vec![deliver(*key, *variant)], *fault, false),
            Action::Batch { keys, fault } => {
                (keys.iter().map(|k| deliver(*k, 0)).collect(), *fault, true)
            }
        };
        let first_key = format!("k{}", payment_key(&deliveries[0]));
        match fault {
            Fault::AfterStep | Fault::AfterWrite => {
                world
                    .faults
                    .lock()
                    .unwrap()
                    .insert(first_key.clone(), fault);
            }
            Fault::None | Fault::Death(_) => {}
        }
        let work = async {
            if batch {
                engine.process_batch(&handler, &deliveries).await
            } else {
                vec![engine.process(&handler, &deliveries[0]).await]
            }
        };
        // Every wait is bounded: an action that does not end within a
        // minute (a lock nobody releases) is a failure, not a hang.
        let bounded = async {
            match fault {
                Fault::Death(at) => {
                    tokio::select! {
                        reports = work => Some(reports),
                        () = tokio::time::sleep(Duration::from_micros(100 * at)) => None,
                    }
                }
                _ => Some(work.await),
            }
        };
        let reports = tokio::time::timeout(Duration::from_secs(60), bounded)
            .await
            .map_err(|_| format!("action {step} ({action:?}) did not end within 60 s"))?;
        // A fault not met (the key was a duplicate) must not linger.
        world.faults.lock().unwrap().remove(&first_key);
        for (d, report) in deliveries.iter().zip(reports.into_iter().flatten()) {
            let key = format!("k{}", payment_key(d));
            match &report.outcome {
                Outcome::Processed { .. } | Outcome::Duplicate { .. } => {
                    acked.insert(key, "done");
                }
                Outcome::Stale(_) => {
                    acked.entry(key).or_insert("stale");
                }
                _ => {}
            }
        }
        check(store, &engine, &world, &ledger, &applied, &acked)
            .await
            .map_err(|e| format!("after action {step} ({action:?}): {e}"))?;
    }
    // Drain: every key delivered again, without faults, until it settles.
    for k in 0..10 {
        for _ in 0..3 {
            let report = tokio::time::timeout(
                Duration::from_secs(60),
                engine.process(&handler, &deliver(k, 0)),
            )
            .await
            .map_err(|_| format!("the drain's delivery of k{k} did not end within 60 s"))?;
            let key = format!("k{k}");
            match &report.outcome {
                Outcome::Processed { .. } | Outcome::Duplicate { .. } => {
                    acked.insert(key, "done");
                    break;
                }
                Outcome::Stale(_) => {
                    acked.entry(key).or_insert("stale");
                    break;
                }
                Outcome::Conflict { .. } => break,
                _ => {}
            }
        }
    }
    check(store, &engine, &world, &ledger, &applied, &acked)
        .await
        .map_err(|e| format!("after the drain: {e}"))?;
    for o in completer.check_once().await.map_err(|e| e.to_string())? {
        if o.scope == engine.scope() {
            reported.insert(o.key);
        }
    }
    // Every refund the provider made is booked, or reported.
    let booked: BTreeSet<String> = rows(store, &ledger)
        .await?
        .into_iter()
        .map(|(k, _, _)| k)
        .collect();
    let downstream = world.downstream.lock().unwrap().clone();
    for refund in world.api.refunds() {
        let key = downstream
            .get(&refund.idempotency_key)
            .cloned()
            .unwrap_or_default();
        if !booked.contains(&key) && !reported.contains(&key) {
            return Err(format!(
                "the provider refunded {key} ({}) and nothing booked or reported it",
                refund.id
            ));
        }
    }
    Ok(())
}

fn payment_key(d: &Delivery) -> String {
    let v: Value = serde_json::from_slice(d.payload()).unwrap_or_default();
    v["refund"]
        .as_str()
        .unwrap_or_default()
        .trim_start_matches('k')
        .to_owned()
}

async fn rows<S>(store: &S, ledger: &str) -> Result<Vec<(String, String, i64)>, Broken>
where
    S: SqlStore,
    for<'c> &'c sqlx::Pool<S::Db>: Executor<'c, Database = S::Db>,
    for<'q> <S::Db as Database>::Arguments<'q>: IntoArguments<'q, S::Db>,
    for<'r> (String, String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
{
    sqlx::query_as(&format!(
        "SELECT k, refund, stale FROM {ledger} ORDER BY id"
    ))
    .fetch_all(store.pool())
    .await
    .map_err(|e| e.to_string())
}

/// The oracle after one action.
async fn check<S>(
    store: &S,
    engine: &Engine<S>,
    world: &World,
    ledger: &str,
    applied: &str,
    acked: &BTreeMap<String, &'static str>,
) -> Result<(), Broken>
where
    S: SqlStore,
    for<'c> &'c sqlx::Pool<S::Db>: Executor<'c, Database = S::Db>,
    for<'q> <S::Db as Database>::Arguments<'q>: IntoArguments<'q, S::Db>,
    for<'r> (String, String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
    for<'r> (String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
{
    let booked = rows(store, ledger).await?;
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for (k, _, _) in &booked {
        *per_key.entry(k).or_default() += 1;
    }
    if let Some((k, n)) = per_key.iter().find(|(_, n)| **n > 1) {
        return Err(format!("{k} booked {n} times"));
    }
    let states: Vec<(String, i64)> =
        sqlx::query_as(&format!("SELECT entity, ord FROM {applied} ORDER BY id"))
            .fetch_all(store.pool())
            .await
            .map_err(|e| e.to_string())?;
    let mut newest: BTreeMap<&str, i64> = BTreeMap::new();
    for (entity, ord) in &states {
        let before = newest.entry(entity).or_insert(*ord);
        if *ord < *before {
            return Err(format!("{entity} moved back from order {before} to {ord}"));
        }
        *before = *ord;
    }
    let refunded: BTreeSet<String> = {
        let downstream = world.downstream.lock().unwrap();
        world
            .api
            .refunds()
            .iter()
            .filter_map(|r| downstream.get(&r.idempotency_key).cloned())
            .collect()
    };
    for (key, how) in acked {
        let record = store
            .get(engine.scope(), key)
            .await
            .map_err(|e| e.to_string())?;
        if record.is_none() {
            return Err(format!(
                "{key} was acknowledged {how} without a committed record"
            ));
        }
        match *how {
            // Processed or a duplicate of a processed key: booked with it.
            "done" if !per_key.contains_key(key.as_str()) => {
                return Err(format!(
                    "{key} was acknowledged as processed and is not booked (refund at the provider: {})",
                    refunded.contains(key)
                ));
            }
            "stale" if refunded.contains(key) && !per_key.contains_key(key.as_str()) => {
                return Err(format!(
                    "{key} was closed as stale although its refund step ran: the refund is lost"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Runs the fixed seeds and `SIM_SEEDS` more on one backend; on failure,
/// shrinks the program and panics with the seed and the shrunk program.
async fn simulate<S, F, Fut>(name: &str, mysql: bool, steps: bool, store: F)
where
    S: SqlStore,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = S>,
    for<'c> &'c mut <S::Db as Database>::Connection: Executor<'c, Database = S::Db>,
    for<'c> &'c sqlx::Pool<S::Db>: Executor<'c, Database = S::Db>,
    for<'q> <S::Db as Database>::Arguments<'q>: IntoArguments<'q, S::Db>,
    for<'q> String: Encode<'q, S::Db> + Type<S::Db>,
    for<'q> i64: Encode<'q, S::Db> + Type<S::Db>,
    for<'r> (String, String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
    for<'r> (String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
{
    let extra: u64 = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let start: u64 = std::env::var("SIM_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| fastrand::u64(1_000..u64::MAX / 2));
    let seeds: Vec<u64> = FIXED_SEEDS.chain(start..start + extra).collect();
    if std::env::var_os("SIM_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_test_writer()
            .try_init();
    }
    let store = store().await;
    let mut programs = 0;
    for seed in &seeds {
        let optimistic = seed % 2 == 0;
        let actions = program(*seed);
        programs += 1;
        if let Err(broken) = run(&store, mysql, steps, optimistic, &actions).await {
            let shrunk = shrink(&store, mysql, steps, optimistic, actions).await;
            panic!(
                "{name}: seed {seed} ({}) broke: {broken}\nshrunk program ({} actions):\n{}",
                if optimistic {
                    "optimistic"
                } else {
                    "claim-first"
                },
                shrunk.len(),
                shrunk
                    .iter()
                    .map(|a| format!("  {a:?}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
    eprintln!("{name}: {programs} programs of {ACTIONS} actions, every oracle held");
}

/// Removes actions one at a time while the program still fails (tried
/// three times each: a death's instant is a timer, so a failure may need
/// a few runs to show again).
async fn shrink<S>(
    store: &S,
    mysql: bool,
    steps: bool,
    optimistic: bool,
    mut actions: Vec<Action>,
) -> Vec<Action>
where
    S: SqlStore,
    for<'c> &'c mut <S::Db as Database>::Connection: Executor<'c, Database = S::Db>,
    for<'c> &'c sqlx::Pool<S::Db>: Executor<'c, Database = S::Db>,
    for<'q> <S::Db as Database>::Arguments<'q>: IntoArguments<'q, S::Db>,
    for<'q> String: Encode<'q, S::Db> + Type<S::Db>,
    for<'q> i64: Encode<'q, S::Db> + Type<S::Db>,
    for<'r> (String, String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
    for<'r> (String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
{
    let mut i = 0;
    while i < actions.len() {
        let mut fewer = actions.clone();
        fewer.remove(i);
        let mut fails = false;
        for _ in 0..3 {
            if run(store, mysql, steps, optimistic, &fewer).await.is_err() {
                fails = true;
                break;
            }
        }
        if fails {
            actions = fewer;
        } else {
            i += 1;
        }
    }
    actions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_keeps_its_promises_where_features_meet_on_postgres() {
    simulate("postgres", false, true, || async {
        pg_store(&pg_url(), &unique("sim")).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_keeps_its_promises_where_features_meet_on_the_generations_layout() {
    simulate("postgres generations", false, true, || async {
        pg_generations_store(&pg_url(), &unique("simg")).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_keeps_its_promises_where_features_meet_on_mariadb() {
    simulate("mariadb", true, true, || async {
        mysql_store(&mysql_url(), &unique("sim")).await
    })
    .await;
}

/// SQLite records no steps (one writer): the same programs without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_keeps_its_promises_where_features_meet_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sim.db");
    simulate("sqlite", false, false, || async {
        sqlite_store(&path, "onceonly_dedup").await
    })
    .await;
}
