//! The fence on Kafka (tansu and PostgreSQL): the versions of 30 orders
//! produced shuffled into one partition (as several producers interleave
//! them), consumed in batches: every order ends at its newest version,
//! each record older than one consumed before it is stale (counted, its
//! offset committed, nothing dead-lettered), and the consumer's lag is 0.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::{FenceSpec, HandlerError, Json, KeySpec, OrderSpec, SqlStore, Tx, handler_fn};
use onceonly_integration_tests::kafka::{Record, committed, create_topic, pg_schema, produce};
use onceonly_integration_tests::{pg_store, unique};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shuffled_versions_end_at_the_newest_and_the_older_ones_are_stale() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique("fence_kafka");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 1).await;
    create_topic(&dlt, 1).await;
    let store = pg_store(&pg_schema("fence_kafka").await, "onceonly_keys").await;
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY, version bigint NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();

    // Versions 1..=4 of each order, shuffled; the expected stale count is
    // what a reader of the partition in order would call stale.
    let mut records = Vec::new();
    for order in 0..30 {
        for version in 1..=4 {
            records.push((format!("ord-{order}"), version));
        }
    }
    fastrand::shuffle(&mut records);
    let mut newest: BTreeMap<String, i64> = BTreeMap::new();
    let mut stale = 0;
    for (order, version) in &records {
        let seen = newest.entry(order.clone()).or_insert(0);
        if *version < *seen {
            stale += 1;
        }
        *seen = (*seen).max(*version);
    }
    let ends = produce(
        &topic,
        &records
            .iter()
            .map(|(order, version)| {
                let body = json!({"event": format!("{order}-v{version}"), "order": order, "version": version});
                Record::new(order.clone(), body.to_string())
            })
            .collect::<Vec<_>>(),
    )
    .await;

    let handler = Arc::new(handler_fn(
        |tx: Tx<sqlx::Postgres>, Json(e): Json<Value>| async move {
            let mut conn = tx.lock().await?;
            sqlx::query(
                "INSERT INTO orders (id, version) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET version = excluded.version",
            )
            .bind(e["order"].as_str())
            .bind(e["version"].as_i64())
            .execute(&mut *conn)
            .await?;
            Ok::<_, HandlerError>(())
        },
    ));
    let group = unique("group");
    let run = KafkaConsumer::builder(
        onceonly::Engine::builder(store.clone())
            .key_expr("json:/event")
            .fence(FenceSpec::new(
                KeySpec::json_field("/order"),
                OrderSpec::integer("/version"),
            )),
    )
    .brokers(onceonly_integration_tests::kafka::brokers())
    .group_id(&group)
    .topic(&topic)
    .consumer_config("session.timeout.ms", "6000")
    .exit_when_idle(Duration::from_secs(3))
    .build()
    .expect("consumer")
    .run_until(handler, CancellationToken::new());
    let stats = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain within 120 s")
        .expect("consumer failed");

    assert_eq!(stats.stale, stale, "{stats:?}");
    assert_eq!(
        stats.processed + stats.stale,
        records.len() as u64,
        "{stats:?}"
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT id, version FROM orders ORDER BY id")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(rows.len(), 30);
    assert!(
        rows.iter().all(|(_, v)| *v == 4),
        "every order at its newest version: {rows:?}"
    );
    let end = ends.get(&0).copied().unwrap_or(-1);
    assert_eq!(
        committed(&group, &topic, 1).get(&0).copied(),
        Some(end),
        "stale records are committed too (lag 0)"
    );
}
