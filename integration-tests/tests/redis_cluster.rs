//! The Redis tier on a real Redis Cluster (3 masters, 3 replicas on
//! loopback, started by `onceonly_integration_tests::redis_cluster`): the
//! keys of one scope spread over every master, and both stores work
//! through the cluster client (`redis+cluster://`).

use onceonly_integration_tests::demo::ledger;

use std::time::Duration;

use onceonly::redis::{CachedStore, RedisClaim, RedisConnection, RedisError, RedisStore};
use onceonly::{Delivery, Engine, Outcome, SqlStore};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::redis_cluster::RedisCluster;
use onceonly_integration_tests::{pay, unique};

/// Asserts every master holds at least a quarter of `total` keys under
/// `prefix` (a fair share is a third) and that they add up; returns the
/// counts per master port.
fn assert_spread(cluster: &RedisCluster, prefix: &str, total: usize) -> Vec<(u16, usize)> {
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3, "{:?}", cluster.nodes_info());
    let counts: Vec<(u16, usize)> = masters
        .iter()
        .map(|&p| (p, cluster.keys_on(p, prefix)))
        .collect();
    eprintln!("{prefix}: {total} keys, per master (port, keys): {counts:?}");
    assert_eq!(
        counts.iter().map(|(_, n)| n).sum::<usize>(),
        total,
        "every key is on exactly one master: {counts:?}"
    );
    for &(port, n) in &counts {
        assert!(
            n * 4 >= total,
            "master 127.0.0.1:{port} holds {n} of {total} keys (a fair share is {}): the keys of \
             one scope are not spread over the cluster ({counts:?})",
            total / 3
        );
    }
    counts
}

/// Claims `key`, retrying an infrastructure error (a reply slower than
/// the 500 ms timeout on a loaded machine) for up to 10 s. A claim whose
/// reply was lost is still taken: its retry answers busy.
async fn claim_retrying(store: &RedisStore, key: &str) -> RedisClaim {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match store.claim("sms", key, None).await {
            Ok(c) => return c,
            Err(e) if e.is_infrastructure() && std::time::Instant::now() < deadline => {
                eprintln!("{key}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{key}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_of_one_scope_spread_over_every_master() {
    let cluster = RedisCluster::start();
    let prefix = format!("{}:", unique("spread"));
    let store = RedisStore::connect(&cluster.url())
        .await
        .expect("connect to the cluster")
        .with_prefix(&prefix)
        .with_replica_acks(1, Duration::from_millis(300));
    const KEYS: usize = 3000;
    let mut completed = std::collections::BTreeSet::new();
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(100) {
        let claims = chunk.iter().map(|&i| {
            let store = store.clone();
            async move {
                let key = format!("order-{i}");
                match claim_retrying(&store, &key).await {
                    RedisClaim::Claimed(lease) if i % 2 == 0 => {
                        match store.complete(&lease, b"\"sent\"").await {
                            Ok(done) => {
                                assert!(done, "{key}: the lease is ours");
                                Some(i)
                            }
                            Err(e) => {
                                assert!(e.is_infrastructure(), "{key}: {e}");
                                None
                            }
                        }
                    }
                    RedisClaim::Claimed(_) | RedisClaim::Busy { .. } => None,
                    other => panic!("{key} is new: {other:?}"),
                }
            }
        });
        completed.extend(
            futures_util::future::join_all(claims)
                .await
                .into_iter()
                .flatten(),
        );
    }
    assert_spread(&cluster, &prefix, KEYS);
    assert!(
        completed.len() * 10 >= KEYS / 2 * 9,
        "{} completed",
        completed.len()
    );
    // The fence and the results hold across the cluster's slots.
    for i in [0usize, 1, 998, 999, 2000, 2999] {
        let again = claim_retrying(&store, &format!("order-{i}")).await;
        if completed.contains(&i) {
            assert_eq!(again, RedisClaim::Done(b"\"sent\"".to_vec()), "order-{i}");
        } else if i % 2 == 1 {
            assert!(
                matches!(again, RedisClaim::Busy { .. }),
                "order-{i}: {again:?}"
            );
        }
    }

    // A single-server connection to a cluster node says what to do,
    // instead of looking like an outage (which would fail open).
    let single = RedisStore::connect(&cluster.node_urls()[0])
        .await
        .expect("connect to one node")
        .with_prefix(&prefix);
    let mut redirected = None;
    for i in 0..50 {
        if let Err(e) = single.claim("sms", &format!("other-{i}"), None).await {
            redirected = Some(e);
            break;
        }
    }
    let e = redirected.expect("of 50 keys, some live on another master");
    assert!(
        matches!(e, RedisError::NotClusterConnection { .. }) && !e.is_infrastructure(),
        "{e}"
    );
    assert!(e.to_string().contains("redis+cluster://"), "{e}");

    // The two-tier store through the same kind of connection, built with
    // the builder: committed keys spread too, and duplicates come back from
    // the cluster.
    let url = pg_schema("rcluster").await;
    let sql = onceonly_integration_tests::pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(sql.pool()).await.unwrap();
    let tier_prefix = format!("{}:", unique("tier"));
    let conn = RedisConnection::builder()
        .cluster(cluster.node_urls())
        .connect()
        .await
        .expect("cluster connection");
    assert!(conn.is_cluster());
    let cached = CachedStore::new(sql, conn).with_prefix(&tier_prefix);
    let engine = Engine::builder(cached.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    const PAYMENTS: usize = 600;
    for i in 0..PAYMENTS {
        let d = Delivery::new(pay(&format!("P-{i}"), 5).account("ann"));
        let r = engine.process(&ledger::postgres::Ledger, &d).await;
        assert!(
            matches!(r.outcome, Outcome::Processed { .. }),
            "{:?}",
            r.outcome
        );
    }
    for i in 0..PAYMENTS {
        let d = Delivery::new(pay(&format!("P-{i}"), 5).account("ann"));
        let r = engine.process(&ledger::postgres::Ledger, &d).await;
        assert_eq!(r.outcome.kind().as_str(), "duplicate");
    }
    // A Redis call slower than 500 ms (a loaded machine) is a miss that
    // SQL answers; all the others come from the cluster.
    eprintln!(
        "two-tier: {} hits, {} misses, {} errors",
        cached.hits(),
        cached.misses(),
        cached.errors()
    );
    assert!(
        cached.hits() * 10 >= PAYMENTS as u64 * 9,
        "duplicates answered by the cluster: {} of {PAYMENTS}",
        cached.hits()
    );
    let written: usize = cluster
        .masters()
        .iter()
        .map(|&p| cluster.keys_on(p, &tier_prefix))
        .sum();
    assert!(written * 10 >= PAYMENTS * 9, "{written} keys written");
    assert_spread(&cluster, &tier_prefix, written);
}
