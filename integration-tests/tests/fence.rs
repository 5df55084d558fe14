//! The per-entity fence on every SQL backend and both PostgreSQL layouts:
//! events of one payment delivered in every order end in the same state
//! (the newest event's), a stale event changes nothing and is recorded as
//! stale, equal orders both apply, optimistic and batch engines fence the
//! same, a handler can take stale deliveries itself, and an entity's fence
//! outlives its keys until its own retention.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use onceonly::{
    Clock, Delivery, Engine, FenceSpec, HandlerError, Json, KeySpec, ManualClock, OrderSpec,
    Outcome, SqlStore, Tx, handler_fn,
};
use onceonly_integration_tests::cli::onceonly;
use onceonly_integration_tests::{
    mysql_store, mysql_url, pg_generations_store, pg_store, pg_url, sqlite_store, unique,
};
use serde_json::{Value, json};
use sqlx::{Database, Encode, Executor, IntoArguments, Type};

/// Four events of one payment: created, paid, refunded twice (two partial
/// refunds at the same moment: equal orders, both apply).
fn events(entity: &str) -> Vec<Value> {
    let at = |s: &str| format!("2024-05-01T10:0{s}:00Z");
    vec![
        json!({"id": format!("{entity}-e1"), "entity": entity, "status": "pending", "at": at("0")}),
        json!({"id": format!("{entity}-e2"), "entity": entity, "status": "succeeded", "at": at("1")}),
        json!({"id": format!("{entity}-e3"), "entity": entity, "status": "refunded", "at": at("2")}),
        json!({"id": format!("{entity}-e4"), "entity": entity, "status": "refunded", "at": at("2")}),
    ]
}

/// The order of event `i` of [`events`] (e3 and e4 tie).
fn rank(i: usize) -> usize {
    [0, 1, 2, 2][i]
}

fn fence() -> FenceSpec {
    FenceSpec::new(
        KeySpec::json_field("/entity"),
        OrderSpec::rank("/status", ["pending", "succeeded", "refunded"])
            .then(OrderSpec::timestamp("/at")),
    )
}

fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut all = Vec::new();
    for p in permutations(n - 1) {
        for at in 0..=p.len() {
            let mut q = p.clone();
            q.insert(at, n - 1);
            all.push(q);
        }
    }
    all
}

/// The business table: one row per applied event, with the order of
/// application.
struct Applied {
    table: String,
    insert: String,
}

impl Applied {
    fn new(placeholder: fn(usize) -> String) -> Self {
        let table = unique("fence_applied");
        let insert = format!(
            "INSERT INTO {table} (entity, event, seq) VALUES ({}, {}, {})",
            placeholder(1),
            placeholder(2),
            placeholder(3)
        );
        Self { table, insert }
    }
}

fn dollar(n: usize) -> String {
    format!("${n}")
}

fn question(_: usize) -> String {
    "?".to_owned()
}

/// Runs every order of delivery of [`events`] through an engine on `store`
/// (optimistic or not, one by one or in one batch), then every event once
/// more, and checks the outcomes and the business table.
async fn every_order<S>(store: S, applied: Applied, optimistic: bool, batch: bool)
where
    S: SqlStore,
    for<'c> &'c mut <S::Db as Database>::Connection: Executor<'c, Database = S::Db>,
    for<'q> <S::Db as Database>::Arguments<'q>: IntoArguments<'q, S::Db>,
    for<'q> String: Encode<'q, S::Db> + Type<S::Db>,
    for<'q> i64: Encode<'q, S::Db> + Type<S::Db>,
    for<'r> (String, i64): sqlx::FromRow<'r, <S::Db as Database>::Row>,
{
    sqlx::query(&format!(
        "CREATE TABLE {} (entity VARCHAR(64) NOT NULL, event VARCHAR(64) NOT NULL, seq BIGINT NOT NULL)",
        applied.table
    ))
    .execute(store.pool())
    .await
    .expect("business table");
    let engine = Engine::builder(store.clone())
        .scope(unique("fence"))
        .key_expr("json:/id")
        .fence(fence())
        .optimistic(optimistic)
        .build()
        .expect("engine");
    let seq = Arc::new(AtomicI64::new(0));
    let insert = Arc::new(applied.insert.clone());
    let handler = handler_fn(move |tx: Tx<S::Db>, Json(e): Json<Value>| {
        let (seq, insert) = (Arc::clone(&seq), Arc::clone(&insert));
        async move {
            assert!(
                !tx.fence().expect("fenced").is_stale(),
                "stale deliveries never reach the handler"
            );
            let mut conn = tx.lock().await?;
            sqlx::query(&insert)
                .bind(e["entity"].as_str().unwrap_or_default().to_owned())
                .bind(e["id"].as_str().unwrap_or_default().to_owned())
                .bind(seq.fetch_add(1, Ordering::SeqCst))
                .execute(&mut *conn)
                .await?;
            Ok::<_, HandlerError>(())
        }
    });
    for (p, order) in permutations(4).into_iter().enumerate() {
        let entity = format!("pi_{p}_{}", u8::from(optimistic) + 2 * u8::from(batch));
        let evs = events(&entity);
        let deliveries: Vec<Delivery> = order
            .iter()
            .map(|i| Delivery::new(evs[*i].to_string()))
            .collect();
        let outcomes: Vec<Outcome<()>> = if batch {
            engine
                .process_batch(&handler, &deliveries)
                .await
                .into_iter()
                .map(|r| r.outcome)
                .collect()
        } else {
            let mut outcomes = Vec::new();
            for d in &deliveries {
                outcomes.push(engine.process(&handler, d).await.outcome);
            }
            outcomes
        };
        // Stale exactly when a higher order was delivered before.
        for (at, (i, outcome)) in order.iter().zip(&outcomes).enumerate() {
            let newer_before = order[..at].iter().any(|j| rank(*j) > rank(*i));
            match outcome {
                Outcome::Stale(stale) => {
                    assert!(
                        newer_before,
                        "order {order:?}: e{} stale for nothing",
                        i + 1
                    );
                    assert_eq!(stale.entity, entity);
                }
                Outcome::Processed { .. } => {
                    assert!(
                        !newer_before,
                        "order {order:?}: e{} applied after a newer event",
                        i + 1
                    )
                }
                other => panic!("order {order:?}: e{}: {other:?}", i + 1),
            }
        }
        // Every event again: a duplicate if applied, stale if it was.
        for (d, first) in deliveries.iter().zip(&outcomes) {
            let again = engine.process(&handler, d).await.outcome;
            match (first, &again) {
                (Outcome::Processed { .. }, Outcome::Duplicate { .. })
                | (Outcome::Stale(_), Outcome::Stale(_)) => {}
                _ => panic!("order {order:?}: redelivery of {first:?} was {again:?}"),
            }
        }
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT event, seq FROM {} WHERE entity = {} ORDER BY seq",
            applied.table,
            if S::Db::NAME == "MySQL" { "?" } else { "$1" }
        ))
        .bind(entity.clone())
        .fetch_all(store.pool())
        .await
        .expect("read the business table");
        let events: Vec<usize> = rows
            .iter()
            .map(|(e, _)| e.rsplit('e').next().unwrap().parse::<usize>().unwrap() - 1)
            .collect();
        // Never an older event applied after a newer one, the state is
        // the newest event's, and both refunds (equal orders) applied.
        assert!(
            events.windows(2).all(|w| rank(w[0]) <= rank(w[1])),
            "order {order:?}: applied {events:?}"
        );
        assert_eq!(
            rank(*events.last().unwrap()),
            2,
            "order {order:?}: ends refunded"
        );
        assert!(
            events.contains(&2) && events.contains(&3),
            "order {order:?}: both refunds applied"
        );
    }
}

#[tokio::test]
async fn every_order_of_delivery_ends_in_the_newest_state_on_postgres() {
    let store = pg_store(&pg_url(), &unique("fence_pg")).await;
    every_order(store.clone(), Applied::new(dollar), false, false).await;
    every_order(store.clone(), Applied::new(dollar), true, false).await;
    every_order(store, Applied::new(dollar), false, true).await;
}

#[tokio::test]
async fn every_order_of_delivery_ends_in_the_newest_state_on_the_generations_layout() {
    let store = pg_generations_store(&pg_url(), &unique("fence_gen")).await;
    every_order(store.clone(), Applied::new(dollar), false, false).await;
    every_order(store, Applied::new(dollar), true, true).await;
}

#[tokio::test]
async fn every_order_of_delivery_ends_in_the_newest_state_on_mariadb() {
    let store = mysql_store(&mysql_url(), &unique("fence_my")).await;
    every_order(store.clone(), Applied::new(question), false, false).await;
    every_order(store.clone(), Applied::new(question), true, false).await;
    every_order(store, Applied::new(question), false, true).await;
}

#[tokio::test]
async fn every_order_of_delivery_ends_in_the_newest_state_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(&dir.path().join("fence.db"), "onceonly_dedup").await;
    every_order(store.clone(), Applied::new(question), false, false).await;
    every_order(store.clone(), Applied::new(question), true, false).await;
    every_order(store, Applied::new(question), false, true).await;
}

#[tokio::test]
async fn a_stale_event_is_recorded_stale_and_a_handler_that_takes_stale_events_decides() {
    let store = pg_store(&pg_url(), &unique("fence_rec")).await;
    let scope = unique("fence");
    let engine = Engine::builder(store.clone())
        .scope(&scope)
        .key_expr("json:/id")
        .fence(fence())
        .build()
        .unwrap();
    let noop =
        handler_fn(|_tx: Tx<sqlx::Postgres>, _: Json<Value>| async { Ok::<_, HandlerError>(()) });
    let evs = events("pi_rec");
    for i in [2, 0] {
        engine
            .process(&noop, &Delivery::new(evs[i].to_string()))
            .await;
    }
    // The stale key is recorded as stale: what `onceonly inspect` shows.
    let record = store
        .get(&scope, "pi_rec-e1")
        .await
        .unwrap()
        .expect("recorded");
    let stale =
        onceonly::Stale::from_recorded(record.result.as_deref().unwrap()).expect("a stale record");
    assert_eq!(stale.entity, "pi_rec");
    assert!(stale.received < stale.current);
    let fenced = store.fence(&scope, "pi_rec").await.unwrap().expect("fence");
    assert_eq!(fenced.order, stale.current.as_bytes());
    // `onceonly inspect` (the real binary) shows both.
    let (url, table) = (pg_url(), store.table().to_string());
    let base = [
        "inspect",
        "--database-url",
        url.as_str(),
        "--table",
        table.as_str(),
        "--scope",
        scope.as_str(),
    ];
    let run = onceonly(&[&base[..], &["--key", "pi_rec-e1", "--json"]].concat()).await;
    assert_eq!(run.code, 0, "{run:?}");
    let shown: Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(shown["result_encoding"], "stale", "{shown}");
    assert_eq!(shown["result"]["entity"], "pi_rec", "{shown}");
    // The orders as their values (rank, then time), and as stored.
    assert_eq!(
        shown["result"]["received"], "0, 2024-05-01T10:00:00Z",
        "{shown}"
    );
    assert_eq!(
        shown["result"]["applied_before"], "2, 2024-05-01T10:02:00Z",
        "{shown}"
    );
    assert_eq!(
        shown["result"]["applied_before_hex"],
        hex_of(&fenced.order),
        "{shown}"
    );
    let run = onceonly(&[&base[..], &["--key", "pi_rec-e1"]].concat()).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains("order:       0, 2024-05-01T10:00:00Z (hex ")
            && run
                .stdout
                .contains("applied:     2, 2024-05-01T10:02:00Z (hex "),
        "{run:?}"
    );
    let run = onceonly(&[&base[..], &["--entity", "pi_rec", "--json"]].concat()).await;
    assert_eq!(run.code, 0, "{run:?}");
    let shown: Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(shown["order_hex"], hex_of(&fenced.order), "{shown}");
    assert_eq!(shown["order"], "2, 2024-05-01T10:02:00Z", "{shown}");
    let run = onceonly(&[&base[..], &["--entity", "pi_rec"]].concat()).await;
    assert_eq!(run.code, 0, "{run:?}");
    let hex = hex_of(&fenced.order);
    assert!(
        run.stdout
            .contains(&format!("order:       2, 2024-05-01T10:02:00Z (hex {hex})")),
        "{run:?}"
    );
    let run = onceonly(&[&base[..], &["--entity", "pi_nobody"]].concat()).await;
    assert_eq!(run.code, 3, "no fence: {run:?}");

    // A handler that takes stale events sees the order applied before.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let taking = Engine::builder(store.clone())
        .scope(unique("fence"))
        .key_expr("json:/id")
        .fence(fence().pass_stale(true))
        .build()
        .unwrap();
    let handler = handler_fn({
        let seen = Arc::clone(&seen);
        move |tx: Tx<sqlx::Postgres>, Json(e): Json<Value>| {
            let seen = Arc::clone(&seen);
            async move {
                let check = tx.fence().expect("fenced").clone();
                seen.lock()
                    .unwrap()
                    .push((e["id"].as_str().unwrap().to_owned(), check.is_stale()));
                Ok::<_, HandlerError>(())
            }
        }
    });
    let evs = events("pi_take");
    for i in [1, 0] {
        let outcome = taking
            .process(&handler, &Delivery::new(evs[i].to_string()))
            .await
            .outcome;
        assert!(matches!(outcome, Outcome::Processed { .. }), "{outcome:?}");
    }
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            ("pi_take-e2".to_owned(), false),
            ("pi_take-e1".to_owned(), true)
        ]
    );
    // The fence never moves back.
    let fenced = store
        .fence(taking.scope(), "pi_take")
        .await
        .unwrap()
        .unwrap();
    let e2 = fence().derive(&Delivery::new(evs[1].to_string())).unwrap();
    assert_eq!(fenced.order, e2.order.as_bytes());
}

#[tokio::test]
async fn a_fence_outlives_its_keys_until_its_own_retention() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(&dir.path().join("fence.db"), "onceonly_dedup").await;
    let clock = ManualClock::new(1_700_000_000_000);
    let engine = Engine::builder(store.clone())
        .scope("fence-retention")
        .key_expr("json:/id")
        .fence(fence())
        .retention(Duration::from_secs(3600))
        .fence_retention(Duration::from_secs(24 * 3600))
        .clock(clock.clone())
        .build()
        .unwrap();
    let noop =
        handler_fn(|_tx: Tx<sqlx::Sqlite>, _: Json<Value>| async { Ok::<_, HandlerError>(()) });
    let evs = events("pi_ret");
    let e1 = Delivery::new(evs[0].to_string());
    assert!(matches!(
        engine
            .process(&noop, &Delivery::new(evs[2].to_string()))
            .await
            .outcome,
        Outcome::Processed { .. }
    ));
    // Two hours on: every key record expired and purged, the fence is not.
    clock.advance_ms(2 * 3600 * 1000);
    store
        .purge_expired(None, clock.now_ms(), 1000)
        .await
        .unwrap();
    assert!(
        store
            .get("fence-retention", "pi_ret-e3")
            .await
            .unwrap()
            .is_none()
    );
    let outcome = engine.process(&noop, &e1).await.outcome;
    assert!(
        matches!(outcome, Outcome::Stale(_)),
        "the fence stops an old event whose key is gone: {outcome:?}"
    );
    // Past the fence's own retention, the entity starts over.
    clock.advance_ms(2 * 24 * 3600 * 1000);
    store
        .purge_expired(None, clock.now_ms(), 1000)
        .await
        .unwrap();
    assert!(
        store
            .fence("fence-retention", "pi_ret")
            .await
            .unwrap()
            .is_none()
    );
    let e2 = Delivery::new(evs[1].to_string());
    assert!(matches!(
        engine.process(&noop, &e2).await.outcome,
        Outcome::Processed { .. }
    ));
}

#[tokio::test]
async fn a_key_committed_before_its_scope_was_fenced_is_still_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(&dir.path().join("fence.db"), "onceonly_dedup").await;
    let build = |fenced: bool| {
        let b = Engine::builder(store.clone())
            .scope("fence-added")
            .key_expr("json:/id");
        let b = if fenced { b.fence(fence()) } else { b };
        b.build().unwrap()
    };
    let noop =
        handler_fn(|_tx: Tx<sqlx::Sqlite>, _: Json<Value>| async { Ok::<_, HandlerError>(()) });
    // An old event without the fields the fence reads, processed before
    // the fence was configured, comes back (a dead-letter replay).
    let old = Delivery::new(json!({"id": "old-1", "amount": 5}).to_string());
    assert!(matches!(
        build(false).process(&noop, &old).await.outcome,
        Outcome::Processed { .. }
    ));
    let fenced = build(true);
    let again = fenced.process(&noop, &old).await.outcome;
    assert!(matches!(again, Outcome::Duplicate { .. }), "{again:?}");
    let batch = fenced
        .process_batch(&noop, std::slice::from_ref(&old))
        .await;
    assert!(
        matches!(batch[0].outcome, Outcome::Duplicate { .. }),
        "{:?}",
        batch[0].outcome
    );
    // Issue 44, defect 7: `Engine::claim` answers it as `process` does.
    match fenced.claim(&old).await {
        Ok(onceonly::engine::Claimed::Duplicate { .. }) => {}
        other => panic!("Engine::claim of a committed key without entity or order: {other:?}"),
    }
    // A new one without them is rejected.
    let new = Delivery::new(json!({"id": "new-1", "amount": 5}).to_string());
    assert_eq!(
        fenced.process(&noop, &new).await.outcome.reason(),
        Some("bad_key")
    );
    assert!(matches!(
        fenced.claim(&new).await,
        Err(onceonly::engine::ClaimError::BadKey(_))
    ));
}

#[tokio::test]
async fn a_delivery_without_an_entity_or_order_is_rejected_and_a_short_fence_retention_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(&dir.path().join("fence.db"), "onceonly_dedup").await;
    let engine = Engine::builder(store.clone())
        .scope("fence-bad")
        .key_expr("json:/id")
        .fence(fence())
        .build()
        .unwrap();
    let noop =
        handler_fn(|_tx: Tx<sqlx::Sqlite>, _: Json<Value>| async { Ok::<_, HandlerError>(()) });
    for bad in [
        json!({"id": "x1", "status": "pending", "at": "2024-05-01T10:00:00Z"}),
        json!({"id": "x2", "entity": "pi", "status": "lost", "at": "2024-05-01T10:00:00Z"}),
        json!({"id": "x3", "entity": "pi", "status": "pending", "at": "yesterday"}),
    ] {
        let outcome = engine
            .process(&noop, &Delivery::new(bad.to_string()))
            .await
            .outcome;
        assert_eq!(outcome.reason(), Some("bad_key"), "{bad}: {outcome:?}");
    }
    let short = Engine::builder(store)
        .scope("fence-bad")
        .key_expr("json:/id")
        .fence(fence())
        .retention(Duration::from_secs(7 * 24 * 3600))
        .fence_retention(Duration::from_secs(3600))
        .build();
    assert!(matches!(
        short,
        Err(onceonly::BuildError::FenceRetention { .. })
    ));
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
