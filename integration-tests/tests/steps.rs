//! Steps and downstream keys against a real loopback provider API that
//! honours `Idempotency-Key` like Stripe: a finished step is not called
//! again when its handler fails after it, the downstream key is the same on
//! every attempt and keyed by the secret, a key reused for another payload
//! gets no other message's step, the completer finds a key whose
//! transaction never committed after its step, and SQLite says it cannot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use onceonly::ops::Completer;
use onceonly::{
    Delivery, Engine, HandlerError, Json, Outcome, RetryPolicy, SqlStore, StepError, Tx, handler_fn,
};
use onceonly_integration_tests::cli::onceonly;
use onceonly_integration_tests::provider_api::{ProviderApi, refund_step};
use onceonly_integration_tests::{mysql_store, mysql_url, pg_store, pg_url, sqlite_store, unique};
use serde_json::{Value, json};
use sqlx::Database as _;

const SECRET: &str = "steps-test-downstream-secret";

/// A refund through a step; the handler then fails `fail_after` times
/// (retryable) before it returns.
fn refund_handler<DB: sqlx::Database>(
    api: String,
    fail_after: Arc<AtomicU32>,
    keys: Arc<std::sync::Mutex<Vec<String>>>,
) -> impl onceonly::Handler<DB, Output = Value> {
    handler_fn(move |tx: Tx<DB>, Json(r): Json<Value>| {
        let (api, fail_after, keys) = (api.clone(), Arc::clone(&fail_after), Arc::clone(&keys));
        async move {
            keys.lock().unwrap().push(tx.downstream_key("refund")?);
            let body = json!({"payment": r["payment"], "amount": r["amount"]});
            let answer: Value = tx.step("refund", |key| refund_step(api, key, body)).await?;
            if fail_after
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(HandlerError::retryable("failing after the step"));
            }
            Ok::<_, HandlerError>(answer)
        }
    })
}

async fn a_finished_step_is_not_called_again<S: SqlStore>(store: S) {
    let provider = ProviderApi::start().await;
    let engine = Engine::builder(store.clone())
        .scope(unique("steps"))
        .key_expr("json:/refund")
        .downstream_secret(SECRET)
        .retry(
            RetryPolicy::default()
                .max_attempts(5)
                .initial_delay(Duration::from_millis(5))
                .without_jitter(),
        )
        .build()
        .unwrap();
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler = refund_handler::<S::Db>(
        provider.url(),
        Arc::new(AtomicU32::new(2)),
        Arc::clone(&keys),
    );
    let delivery =
        Delivery::new(json!({"refund": "r-1", "payment": "pi_1", "amount": 500}).to_string());
    let report = engine.process_with_retry(&handler, &delivery).await;
    let Outcome::Processed { result } = &report.outcome else {
        panic!("{:?}", report.outcome);
    };
    assert_eq!(
        report.attempts, 3,
        "two failures after the step, then success"
    );
    assert_eq!(provider.refunds().len(), 1, "one refund at the provider");
    assert_eq!(provider.requests(), 1, "the step was not called again");
    assert_eq!(result["id"], provider.refunds()[0].id);
    // The same downstream key on every attempt: 40 hex digits.
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 3);
    assert!(keys.iter().all(|k| *k == keys[0]));
    assert_eq!(keys[0].len(), 40);
    assert!(keys[0].bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(provider.refunds()[0].idempotency_key, keys[0]);
    // The step is listed with the key.
    let steps = store.steps(engine.scope(), "r-1").await.unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].step, "refund");
    // It expires with the committed record, never after it: a committed
    // key is never taken for an orphan.
    let record = store.get(engine.scope(), "r-1").await.unwrap().unwrap();
    assert!(
        steps[0].expires_at_ms <= record.expires_at_ms,
        "step {} after record {}",
        steps[0].expires_at_ms,
        record.expires_at_ms
    );
    // `onceonly inspect` (the real binary) lists it with the record.
    let table = store.table().to_string();
    let url = if S::Db::NAME == "MySQL" {
        mysql_url()
    } else {
        pg_url()
    };
    let scope = engine.scope().to_owned();
    let run = onceonly(&[
        "inspect",
        "--database-url",
        url.as_str(),
        "--table",
        table.as_str(),
        "--scope",
        scope.as_str(),
        "--key",
        "r-1",
        "--json",
    ])
    .await;
    assert_eq!(run.code, 0, "{run:?}");
    let shown: Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(shown["steps"][0]["step"], "refund", "{shown}");
    assert_eq!(shown["steps"][0]["result"]["id"], result["id"], "{shown}");
    // A redelivery is a duplicate: no call.
    let again = engine.process(&handler, &delivery).await;
    assert!(matches!(again.outcome, Outcome::Duplicate { .. }));
    assert_eq!(provider.requests(), 1);
}

#[tokio::test]
async fn a_finished_step_is_not_called_again_when_its_handler_fails_after_it_postgres() {
    a_finished_step_is_not_called_again(pg_store(&pg_url(), &unique("steps_pg")).await).await;
}

#[tokio::test]
async fn a_finished_step_is_not_called_again_when_its_handler_fails_after_it_mariadb() {
    a_finished_step_is_not_called_again(mysql_store(&mysql_url(), &unique("steps_my")).await).await;
}

#[tokio::test]
async fn downstream_keys_depend_on_the_secret_the_key_and_the_step_only() {
    let store = pg_store(&pg_url(), &unique("steps_keys")).await;
    let key_of = |secret: &'static str, scope: &'static str| {
        let store = store.clone();
        async move {
            let engine = Engine::builder(store)
                .scope(scope)
                .key_expr("json:/id")
                .downstream_secret(secret)
                .build()
                .unwrap();
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let handler = handler_fn({
                let seen = Arc::clone(&seen);
                move |tx: Tx<sqlx::Postgres>, _: Json<Value>| {
                    let seen = Arc::clone(&seen);
                    async move {
                        seen.lock()
                            .unwrap()
                            .push((tx.downstream_key("refund")?, tx.downstream_key("email")?));
                        // Rolled back: the next engine claims the key again.
                        Err::<(), _>(HandlerError::permanent("look only"))
                    }
                }
            });
            for id in ["a", "b"] {
                engine
                    .process(&handler, &Delivery::new(json!({"id": id}).to_string()))
                    .await;
            }
            seen.lock().unwrap().clone()
        }
    };
    let first = key_of("secret-one-0123456789", "scope-a").await;
    assert_eq!(
        first,
        key_of("secret-one-0123456789", "scope-a").await,
        "stable"
    );
    assert_ne!(first[0].0, first[0].1, "per step");
    assert_ne!(first[0].0, first[1].0, "per key");
    assert_ne!(
        first,
        key_of("secret-two-0123456789", "scope-a").await,
        "per secret"
    );
    assert_ne!(
        first,
        key_of("secret-one-0123456789", "scope-b").await,
        "per scope"
    );
    let short = Engine::builder(store.clone())
        .scope("s")
        .key_expr("json:/id")
        .downstream_secret("short")
        .build();
    assert!(matches!(
        short,
        Err(onceonly::BuildError::DownstreamSecret { min: 16 })
    ));
    let none = Engine::builder(store)
        .scope("s")
        .key_expr("json:/id")
        .build()
        .unwrap();
    let handler = handler_fn(|tx: Tx<sqlx::Postgres>, _: Json<Value>| async move {
        match tx.downstream_key("refund") {
            Err(StepError::NoSecret) => Err::<(), _>(HandlerError::permanent("no secret")),
            other => panic!("{other:?}"),
        }
    });
    let out = none
        .process(&handler, &Delivery::new(json!({"id": "z"}).to_string()))
        .await;
    assert!(matches!(out.outcome, Outcome::Failed(_)));
}

#[tokio::test]
async fn a_key_reused_for_another_payload_gets_no_other_step_and_the_completer_finds_orphans() {
    let store = pg_store(&pg_url(), &unique("steps_orphan")).await;
    let provider = ProviderApi::start().await;
    let engine = Engine::builder(store.clone())
        .scope(unique("steps"))
        .key_expr("json:/refund")
        .downstream_secret(SECRET)
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
    // The handler fails after the step, and is not retried: the step
    // finished, the transaction never committed.
    let failing = refund_handler::<sqlx::Postgres>(
        provider.url(),
        Arc::new(AtomicU32::new(1)),
        Arc::clone(&keys),
    );
    let first =
        Delivery::new(json!({"refund": "r-9", "payment": "pi_9", "amount": 900}).to_string());
    let out = engine.process_with_retry(&failing, &first).await;
    assert!(
        matches!(out.outcome, Outcome::Failed(_)),
        "{:?}",
        out.outcome
    );
    assert_eq!(provider.refunds().len(), 1);

    let completer = Completer::builder(store.clone())
        .grace(Duration::ZERO)
        .build();
    let orphans = completer.check_once().await.unwrap();
    let mine: Vec<_> = orphans
        .iter()
        .filter(|o| o.scope == engine.scope())
        .collect();
    assert_eq!(mine.len(), 1, "{orphans:?}");
    assert_eq!(
        (mine[0].key.as_str(), mine[0].step.as_str()),
        ("r-9", "refund")
    );

    // The same key with another payload: not the first payload's step.
    let ok = refund_handler::<sqlx::Postgres>(
        provider.url(),
        Arc::new(AtomicU32::new(0)),
        Arc::clone(&keys),
    );
    let other = Delivery::new(json!({"refund": "r-9", "payment": "pi_9", "amount": 1}).to_string());
    let out = engine.process_with_retry(&ok, &other).await;
    match &out.outcome {
        Outcome::Failed(f) => assert!(f.to_string().contains("another payload"), "{f}"),
        o => panic!("{o:?}"),
    }
    assert_eq!(provider.requests(), 1, "no call for the reused key");

    // The first payload delivered again completes without calling.
    let out = engine.process_with_retry(&ok, &first).await;
    assert!(
        matches!(out.outcome, Outcome::Processed { .. }),
        "{:?}",
        out.outcome
    );
    assert_eq!(provider.requests(), 1);
    let orphans = completer.check_once().await.unwrap();
    assert!(
        orphans.iter().all(|o| o.scope != engine.scope()),
        "{orphans:?}"
    );
}

#[tokio::test]
async fn sqlite_cannot_record_steps_and_says_so_when_built() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(&dir.path().join("steps.db"), "onceonly_dedup").await;
    let built = Engine::builder(store.clone())
        .scope("steps")
        .key_expr("json:/refund")
        .downstream_secret(SECRET)
        .build();
    assert!(matches!(built, Err(onceonly::BuildError::StepsUnsupported)));
    // Without a secret, a step fails at once, without calling.
    let provider = ProviderApi::start().await;
    let engine = Engine::builder(store)
        .scope("steps")
        .key_expr("json:/refund")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    let handler = refund_handler::<sqlx::Sqlite>(
        provider.url(),
        Arc::new(AtomicU32::new(0)),
        Arc::new(std::sync::Mutex::new(Vec::new())),
    );
    let d = Delivery::new(json!({"refund": "r-1", "payment": "pi_1", "amount": 1}).to_string());
    let out = engine.process(&handler, &d).await;
    match &out.outcome {
        Outcome::Failed(f) => {
            assert!(f.to_string().contains("secret"), "{f}");
            assert!(!f.is_retryable());
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(provider.requests(), 0);
}

/// A refund of `/entity` at `/order` on database `$db`: its step calls
/// the provider, then the handler books the refund with `$insert` and
/// fails (retryable) while `$fail` holds its key.
macro_rules! fenced_refund_handler {
    ($db:ty, $api:expr, $insert:expr, $fail:expr) => {{
        let (api, insert, fail): (String, String, Arc<std::sync::Mutex<Option<String>>>) =
            ($api, $insert, $fail);
        handler_fn(move |tx: Tx<$db>, Json(r): Json<Value>| {
            let (api, insert, fail) = (api.clone(), insert.clone(), Arc::clone(&fail));
            async move {
                let key = r["refund"].as_str().unwrap_or_default().to_owned();
                let body = json!({"payment": r["payment"], "amount": r["amount"]});
                let answer: Value = tx
                    .step("refund", |key| refund_step(api, key, body))
                    .await?;
                let provider_id = answer["id"].as_str().unwrap_or_default().to_owned();
                {
                    let mut conn = tx.lock().await?;
                    sqlx::query(&insert)
                        .bind(key.clone())
                        .bind(provider_id)
                        .execute(&mut *conn)
                        .await
                        .map_err(HandlerError::retryable)?;
                }
                if fail.lock().unwrap().as_deref() == Some(key.as_str()) {
                    return Err(HandlerError::retryable("rolled back after the step"));
                }
                Ok::<_, HandlerError>(answer)
            }
        })
    }};
}

/// Issue 44, defect 1: key `a` (entity E, order 5) finishes its refund
/// step and rolls back; order 6 of E commits; the redelivery of `a` is
/// stale, yet the refund happened at the provider: it must be booked
/// (its handler runs, its step answers from its record), never closed as
/// stale without its effect.
async fn a_stale_redelivery_books_a_step_that_ran(url: &str, mysql: bool, batch: bool) {
    let store = if mysql {
        None
    } else {
        Some(pg_store(url, &unique("steps_stale")).await)
    };
    let my = if mysql {
        Some(mysql_store(url, &unique("steps_stale")).await)
    } else {
        None
    };
    let table = unique("stale_refunds");
    let ddl = format!(
        "CREATE TABLE {table} (refund VARCHAR(64) PRIMARY KEY, provider_id VARCHAR(64) NOT NULL)"
    );
    let provider = ProviderApi::start().await;
    let fail = Arc::new(std::sync::Mutex::new(Some("a".to_owned())));
    let fence = onceonly::FenceSpec::new(
        onceonly::KeySpec::json_field("/entity"),
        onceonly::OrderSpec::integer("/order"),
    );
    let deliveries = |key: &str, order: i64, amount: i64| {
        Delivery::new(
            json!({"refund": key, "entity": "E", "order": order, "payment": format!("pi_{key}"), "amount": amount})
                .to_string(),
        )
    };
    let a = deliveries("a", 5, 100);
    let b = deliveries("b", 6, 200);
    macro_rules! run {
        ($store:expr, $db:ty, $insert:expr) => {{
            let store = $store;
            let pool = store.pool().clone();
            sqlx::query(&ddl).execute(&pool).await.unwrap();
            let engine = Engine::builder(store.clone())
                .scope(unique("stale_steps"))
                .key_expr("json:/refund")
                .fence(fence.clone())
                .downstream_secret(SECRET)
                .retry(RetryPolicy::none())
                .build()
                .unwrap();
            let handler = fenced_refund_handler!($db, provider.url(), $insert, Arc::clone(&fail));
            let first = engine.process(&handler, &a).await;
            assert!(
                matches!(first.outcome, Outcome::Failed(_)),
                "{:?}",
                first.outcome
            );
            assert_eq!(provider.refunds().len(), 1, "a's refund was issued");
            *fail.lock().unwrap() = None;
            let newer = engine.process(&handler, &b).await;
            assert!(
                matches!(newer.outcome, Outcome::Processed { .. }),
                "{:?}",
                newer.outcome
            );
            let again = if batch {
                engine
                    .process_batch(&handler, std::slice::from_ref(&a))
                    .await
                    .remove(0)
            } else {
                engine.process(&handler, &a).await
            };
            assert!(
                matches!(again.outcome, Outcome::Processed { .. }),
                "the stale redelivery of a key whose step ran must book it: {:?}",
                again.outcome
            );
            let booked: Vec<(String, String)> = sqlx::query_as(&format!(
                "SELECT refund, provider_id FROM {table} ORDER BY refund"
            ))
            .fetch_all(&pool)
            .await
            .unwrap();
            let refunds = provider.refunds();
            assert_eq!(refunds.len(), 2, "one refund each at the provider");
            assert_eq!(provider.requests(), 2, "a's step was not called again");
            assert_eq!(booked.len(), 2, "both refunds booked: {booked:?}");
            assert!(
                booked
                    .iter()
                    .all(|(_, id)| refunds.iter().any(|r| r.id == *id)),
                "{booked:?} vs {refunds:?}"
            );
            // Nothing is left for the completer to report.
            let orphans = Completer::builder(store.clone())
                .grace(Duration::ZERO)
                .build()
                .check_once()
                .await
                .unwrap();
            assert!(
                orphans.iter().all(|o| o.scope != engine.scope()),
                "{orphans:?}"
            );
            // A later redelivery is a duplicate.
            let dup = engine.process(&handler, &a).await;
            assert!(
                matches!(dup.outcome, Outcome::Duplicate { .. }),
                "{:?}",
                dup.outcome
            );
        }};
    }
    if let Some(store) = store {
        run!(
            store,
            sqlx::Postgres,
            format!("INSERT INTO {table} (refund, provider_id) VALUES ($1, $2)")
        );
    }
    if let Some(store) = my {
        run!(
            store,
            sqlx::MySql,
            format!("INSERT INTO {table} (refund, provider_id) VALUES (?, ?)")
        );
    }
}

#[tokio::test]
async fn a_stale_redelivery_books_a_step_that_ran_postgres() {
    a_stale_redelivery_books_a_step_that_ran(&pg_url(), false, false).await;
}

#[tokio::test]
async fn a_stale_redelivery_books_a_step_that_ran_in_a_batch_postgres() {
    a_stale_redelivery_books_a_step_that_ran(&pg_url(), false, true).await;
}

#[tokio::test]
async fn a_stale_redelivery_books_a_step_that_ran_mariadb() {
    a_stale_redelivery_books_a_step_that_ran(&mysql_url(), true, false).await;
}
