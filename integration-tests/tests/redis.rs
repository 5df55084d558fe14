//! The Redis tier against the real Redis: fenced, leased claims, and the
//! two-tier store in front of PostgreSQL (with the engine and a transport).

use onceonly_integration_tests::demo::ledger;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use onceonly::redis::{CachedStore, Once, RedisClaim, RedisStore, RunOnceError};
use onceonly::{Delivery, Engine, Fingerprint, Outcome, PgStore, SqlStore};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::{pay, redis_unreachable, redis_url, unique};

async fn redis_store(lease: Duration) -> RedisStore {
    RedisStore::connect(&redis_url())
        .await
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(format!("{}:", unique("t")))
        .with_lease(lease)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_have_exactly_one_owner() {
    let store = redis_store(Duration::from_secs(10)).await;
    let claims = (0..32).map(|_| {
        let store = store.clone();
        async move { store.claim("sms", "user-1", None).await.unwrap() }
    });
    let results = futures_util::future::join_all(claims).await;
    let owners = results
        .iter()
        .filter(|c| matches!(c, RedisClaim::Claimed(_)))
        .count();
    assert_eq!(owners, 1, "{results:?}");
    assert!(
        results
            .iter()
            .all(|c| matches!(c, RedisClaim::Claimed(_) | RedisClaim::Busy { .. }))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lease_is_reclaimable_and_the_old_owner_is_fenced_off() {
    let store = redis_store(Duration::from_millis(200)).await;
    let RedisClaim::Claimed(old) = store.claim("mail", "m-1", None).await.unwrap() else {
        panic!("first claim")
    };
    assert!(matches!(
        store.claim("mail", "m-1", None).await.unwrap(),
        RedisClaim::Busy { .. }
    ));
    // The owner died: its lease runs out and the key is claimable again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let RedisClaim::Claimed(new) = store.claim("mail", "m-1", None).await.unwrap() else {
        panic!("reclaim after expiry")
    };
    assert_ne!(old.owner(), new.owner());
    // The stale owner can neither complete, renew nor release the new claim.
    assert!(!store.complete(&old, b"\"stale\"").await.unwrap());
    assert!(!store.renew(&old).await.unwrap());
    assert!(!store.release(&old).await.unwrap());
    assert!(matches!(
        store.claim("mail", "m-1", None).await.unwrap(),
        RedisClaim::Busy { .. }
    ));
    assert!(store.complete(&new, b"\"sent\"").await.unwrap());
    assert_eq!(
        store.claim("mail", "m-1", None).await.unwrap(),
        RedisClaim::Done(b"\"sent\"".to_vec())
    );
    // Completed keys outlive the lease (they keep the retention).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        store.claim("mail", "m-1", None).await.unwrap(),
        RedisClaim::Done(_)
    ));
    // Same key, other payload.
    let fp = Fingerprint([1; 32]);
    let RedisClaim::Claimed(l) = store.claim("mail", "m-2", Some(&fp)).await.unwrap() else {
        panic!()
    };
    assert!(store.complete(&l, b"1").await.unwrap());
    assert_eq!(
        store
            .claim("mail", "m-2", Some(&Fingerprint([2; 32])))
            .await
            .unwrap(),
        RedisClaim::Conflict
    );
    assert_eq!(
        store.claim("mail", "m-2", Some(&fp)).await.unwrap(),
        RedisClaim::Done(b"1".to_vec())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewal_keeps_a_handler_running_three_leases_safe() {
    let store = redis_store(Duration::from_millis(300)).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let effect = |runs: Arc<AtomicUsize>| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(900)).await;
        Ok::<_, std::io::Error>("sent".to_owned())
    };
    let slow = {
        let (store, runs) = (store.clone(), Arc::clone(&runs));
        tokio::spawn(async move { store.run_once("sms", "u-9", None, effect(runs)).await })
    };
    // Competitors keep trying during the three leases: all busy.
    let mut tries = 0;
    while !slow.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = store
            .run_once("sms", "u-9", None, effect(Arc::clone(&runs)))
            .await
            .unwrap();
        if slow.is_finished() {
            break;
        }
        assert!(
            matches!(r, Once::Busy { .. } | Once::AlreadyDone(_)),
            "{r:?}"
        );
        tries += 1;
    }
    assert!(
        tries >= 10,
        "competitors tried during the whole run ({tries})"
    );
    assert_eq!(slow.await.unwrap().unwrap(), Once::Ran("sent".to_owned()));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the effect ran once");
    let again = store
        .run_once("sms", "u-9", None, effect(Arc::clone(&runs)))
        .await
        .unwrap();
    assert_eq!(again, Once::AlreadyDone("sent".to_owned()));

    // A failed effect releases its claim: the retry runs.
    let failed = store
        .run_once("sms", "u-10", None, async {
            Err::<String, _>("gateway down")
        })
        .await;
    assert!(matches!(failed, Err(RunOnceError::Effect("gateway down"))));
    let retried = store
        .run_once("sms", "u-10", None, async {
            Ok::<_, &str>("ok".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(retried, Once::Ran("ok".to_owned()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_tier_answers_duplicates_without_sql() {
    let url = pg_schema("rtier").await;
    let acquired = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&acquired);
    // Every SQL transaction starts by taking a pooled connection: count them.
    let opened = Arc::clone(&acquired);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .before_acquire(move |_conn, _meta| {
            let counter = Arc::clone(&counter);
            Box::pin(async move {
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(true)
            })
        })
        // A new connection skips before_acquire: count those too.
        .after_connect(move |_conn, _meta| {
            let opened = Arc::clone(&opened);
            Box::pin(async move {
                opened.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap();
    let sql = PgStore::new(pool);
    sql.migrate().await.unwrap();
    ledger::postgres::create_tables(sql.pool()).await.unwrap();
    let store = CachedStore::connect(sql, &redis_url())
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(format!("{}:", unique("tier")));
    let engine = Engine::builder(store.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    let body = pay("T-1", 5).account("ann").body();
    let first = engine
        .process(&ledger::postgres::Ledger, &Delivery::new(body.clone()))
        .await;
    let Outcome::Processed { result } = first.outcome else {
        panic!("{:?}", first.outcome)
    };
    let after_first = acquired.load(Ordering::SeqCst);
    assert!(after_first > 0);
    for _ in 0..5 {
        let dup = engine
            .process(&ledger::postgres::Ledger, &Delivery::new(body.clone()))
            .await;
        assert_eq!(dup.outcome.kind().as_str(), "duplicate");
        let Outcome::Duplicate { result: Some(r) } = dup.outcome else {
            panic!()
        };
        assert_eq!(r, result, "the stored result comes back from Redis");
    }
    assert_eq!(
        acquired.load(Ordering::SeqCst),
        after_first,
        "no SQL for cached duplicates"
    );
    assert_eq!(store.hits(), 5);
    // Another payload under the same key is still a conflict.
    let other = engine
        .process(
            &ledger::postgres::Ledger,
            &Delivery::new(pay("T-1", 6).account("ann")),
        )
        .await;
    assert_eq!(other.outcome.kind().as_str(), "conflict");
    assert_eq!(acquired.load(Ordering::SeqCst), after_first);
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1);

    // A rolled-back attempt never reaches Redis: its redelivery runs.
    let broken = pay("T-2", -5).account("ann").body();
    let failed = engine
        .process(&ledger::postgres::Ledger, &Delivery::new(broken))
        .await;
    assert_eq!(failed.outcome.kind().as_str(), "failed");
    let fixed = pay("T-2", 5).account("ann").body();
    let retried = engine
        .process(&ledger::postgres::Ledger, &Delivery::new(fixed.clone()))
        .await;
    assert_eq!(
        retried.outcome.kind().as_str(),
        "processed",
        "not answered from Redis"
    );

    // Batches (the Kafka batch mode) are answered from Redis too.
    let hits_before = store.hits();
    let sql_before = acquired.load(Ordering::SeqCst);
    let batch = vec![Delivery::new(body.clone()), Delivery::new(fixed)];
    let reports = engine
        .try_process_batch(&ledger::postgres::Ledger, &batch)
        .await
        .unwrap();
    assert!(
        reports
            .iter()
            .all(|r| r.outcome.kind().as_str() == "duplicate")
    );
    assert_eq!(store.hits() - hits_before, 2);
    assert_eq!(
        acquired.load(Ordering::SeqCst),
        sql_before,
        "no SQL for a batch of cached keys"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_tier_works_under_the_amqp_consumer() {
    use onceonly::amqp::{AmqpConsumer, CancellationToken};
    use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish};
    use onceonly_integration_tests::ledger::{Expected, assert_exact};
    let url = pg_schema("ramqp").await;
    let sql = onceonly_integration_tests::pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(sql.pool()).await.unwrap();
    let store = CachedStore::connect(sql, &redis_url())
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(format!("{}:", unique("tier")));
    let queue = unique("ramqp");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let mut expected = Expected::new();
    let mut messages = Vec::new();
    for i in 0..100 {
        let no = format!("Z-{i}");
        messages.push(Msg::new(pay(&no, 3).account("zed")));
        expected.insert(no, ("zed".to_owned(), 3));
    }
    let run = |store: CachedStore<PgStore>| {
        let queue = queue.clone();
        async move {
            AmqpConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
                .url(onceonly_integration_tests::amqp::url())
                .queue(&queue)
                .exit_when_idle(Duration::from_secs(2))
                .build()
                .unwrap()
                .run_until(ledger::postgres::Ledger, CancellationToken::new())
                .await
                .unwrap()
        }
    };
    publish(&channel, &queue, &messages).await;
    let first = run(store.clone()).await;
    assert_eq!(first.consumer.processed, 100);
    // A redelivered batch (e.g. a dead-letter replay): all from Redis.
    publish(&channel, &queue, &messages).await;
    let second = run(store.clone()).await;
    assert_eq!(
        (second.consumer.processed, second.consumer.duplicates),
        (0, 100)
    );
    assert!(store.hits() >= 100, "hits {}", store.hits());
    assert_exact(store.pool(), &expected).await;
    assert_eq!(depth(&channel, &queue).await, 0);
}

/// Sets `key` to `value` for a minute on the shared Redis, as a process of
/// the earlier version (scope-tagged layout) left it.
async fn set_raw(key: &str, value: &[u8]) {
    let client = redis::Client::open(redis_url()).unwrap_or_else(|e| redis_unreachable(e));
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| redis_unreachable(e));
    redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("PX")
        .arg(60_000)
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_of_the_scope_tagged_layout_are_honoured_with_the_upgrade_fallback() {
    let prefix = format!("{}:", unique("upgrade"));
    let fp = Fingerprint([3; 32]);
    // Left by the earlier version: a completed key (with a fingerprint) and
    // a claim in progress.
    set_raw(
        &format!("{prefix}{{sms}}:done-1"),
        format!("d\n{}\n\"sent\"", fp.to_hex()).as_bytes(),
    )
    .await;
    set_raw(&format!("{prefix}{{sms}}:held-1"), b"c\nold-owner\n").await;
    let plain = RedisStore::connect(&redis_url())
        .await
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(&prefix);
    let upgrading = plain.clone().with_scope_tagged_fallback(true);

    // With the fallback: done stays done, a conflict stays a conflict, a
    // held claim stays busy, and a key unknown there is claimed as usual.
    assert_eq!(
        upgrading.claim("sms", "done-1", Some(&fp)).await.unwrap(),
        RedisClaim::Done(b"\"sent\"".to_vec())
    );
    assert_eq!(
        upgrading
            .claim("sms", "done-1", Some(&Fingerprint([4; 32])))
            .await
            .unwrap(),
        RedisClaim::Conflict
    );
    let busy = upgrading.claim("sms", "held-1", None).await.unwrap();
    assert!(
        matches!(busy, RedisClaim::Busy { retry_after } if retry_after > Duration::from_secs(50)),
        "{busy:?}"
    );
    let RedisClaim::Claimed(lease) = upgrading.claim("sms", "new-1", None).await.unwrap() else {
        panic!("a key unknown to both layouts is claimed")
    };
    assert_eq!(lease.redis_key(), format!("{prefix}sms:new-1"));
    assert!(upgrading.complete(&lease, b"1").await.unwrap());
    assert_eq!(
        plain.claim("sms", "new-1", None).await.unwrap(),
        RedisClaim::Done(b"1".to_vec()),
        "new keys are written in the new layout only"
    );

    // Without it the earlier keys are invisible: the hazard the upgrade
    // notes describe (the effect of done-1 would run again).
    assert!(matches!(
        plain.claim("sms", "done-1", Some(&fp)).await.unwrap(),
        RedisClaim::Claimed(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_no_replica_acknowledged_is_an_error_and_is_released() {
    // The shared Redis has no replica: WAIT 1 always times out.
    let store = redis_store(Duration::from_secs(30))
        .await
        .with_replica_acks(1, Duration::from_millis(50));
    let err = store.claim("sms", "u-1", None).await.unwrap_err();
    assert!(
        matches!(
            err,
            onceonly::redis::RedisError::NotReplicated {
                acked: 0,
                wanted: 1
            }
        ),
        "{err}"
    );
    assert!(err.is_infrastructure());
    // Released: the key is not blocked for the 30 s lease.
    let without = store.clone().with_replica_acks(0, Duration::ZERO);
    assert!(matches!(
        without.claim("sms", "u-1", None).await.unwrap(),
        RedisClaim::Claimed(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_tier_old_and_new_versions_side_by_side_stay_exactly_once() {
    let url = pg_schema("rmixed").await;
    let sql = onceonly_integration_tests::pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(sql.pool()).await.unwrap();
    let prefix = format!("{}:", unique("mixed"));
    let store = CachedStore::connect(sql.clone(), &redis_url())
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(&prefix);
    let engine = |s| {
        Engine::builder(s)
            .scope("payments")
            .key_expr("json:/out_trade_no")
            .build()
            .unwrap()
    };
    // An old-version process committed M-1 and cached it under the
    // scope-tagged key (emulated: SQL alone, then the key it wrote).
    let old = engine(
        CachedStore::connect(sql.clone(), &redis_url())
            .unwrap()
            .with_prefix(format!("{}:", unique("elsewhere"))),
    );
    let body = pay("M-1", 7).account("ann").body();
    let first = old
        .process(&ledger::postgres::Ledger, &Delivery::new(body.clone()))
        .await;
    assert_eq!(first.outcome.kind().as_str(), "processed");
    set_raw(&format!("{prefix}{{payments}}:M-1"), b"d\n\n{}").await;
    // The new version misses that key, asks SQL, and SQL says duplicate.
    let new = engine(store.clone());
    let dup = new
        .process(&ledger::postgres::Ledger, &Delivery::new(body))
        .await;
    assert_eq!(dup.outcome.kind().as_str(), "duplicate");
    assert_eq!((store.hits(), store.misses()), (0, 1));
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "charged once");
}
