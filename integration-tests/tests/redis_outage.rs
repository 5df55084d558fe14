//! Redis shut down in the middle of a run (`redis-cli shutdown nosave` and
//! `scripts/services redis` on the host, `docker compose stop redis` and
//! `up -d --wait redis` under compose; see
//! `onceonly_integration_tests::services`): the two-tier store falls
//! through to SQL and every key still takes effect exactly once. In its own
//! test binary so no other test sees the outage.

use onceonly_integration_tests::demo::ledger;

use onceonly::redis::CachedStore;
use onceonly::{Delivery, Engine, SqlStore};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{assert_exact, crash_stream};
use onceonly_integration_tests::services::Service;
use onceonly_integration_tests::{redis_unreachable, redis_url, unique};

/// Starts Redis again however the test ends.
struct Restart;

impl Restart {
    fn now(&self) {
        Service::Redis.start();
    }
}

impl Drop for Restart {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Err(e) = Service::Redis.try_start()
        {
            eprintln!("starting Redis again: {e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_mid_run_stays_exactly_once_through_sql() {
    // Host tools or docker compose: decided first (panics if neither).
    let how = Service::Redis.mechanism();
    eprintln!("Redis is stopped and started through: {how:?}");
    let url = pg_schema("routage").await;
    let sql = onceonly_integration_tests::pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(sql.pool()).await.unwrap();
    let store = CachedStore::connect(sql, &redis_url())
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(format!("{}:", unique("outage")));
    let engine = Engine::builder(store.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    // 600 keys with duplicates (adjacent and at the end), in three thirds:
    // Redis up, Redis down, Redis back.
    let stream = crash_stream("O", 600);
    let third = stream.messages.len() / 3;
    let restart = Restart;
    for (i, (_, body)) in stream.messages.iter().enumerate() {
        if i == third {
            Service::Redis.stop();
        }
        if i == 2 * third {
            restart.now();
        }
        let report = engine
            .process(&ledger::postgres::Ledger, &Delivery::new(body.clone()))
            .await;
        assert!(
            report.outcome.is_done(),
            "message {i}: {:?}",
            report.outcome
        );
    }
    drop(restart);
    assert!(store.errors() > 0, "the outage was noticed and counted");
    assert!(
        store.hits() > 0,
        "Redis answered duplicates before and after the outage"
    );
    assert_exact(store.pool(), &stream.expected).await;
}
