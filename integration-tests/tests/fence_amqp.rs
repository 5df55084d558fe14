//! The fence on a broker: an AMQP consumer on PostgreSQL whose old event
//! was dead-lettered, then superseded by a newer event of the same order,
//! gets the old event back from `onceonly replay amqp` (the real binary):
//! it is stale, acknowledged without running the handler, and not
//! dead-lettered again; the order keeps the newer state.

use std::sync::Arc;
use std::time::Duration;

use onceonly::amqp::{AmqpConsumer, AmqpStats, CancellationToken};
use onceonly::{FenceSpec, HandlerError, Json, KeySpec, OrderSpec, SqlStore, Tx, handler_fn};
use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish, url};
use onceonly_integration_tests::cli::onceonly;
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::{pg_store, unique};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replayed_dead_letter_older_than_the_fence_is_stale_and_acked() {
    let queue = unique("fence_amqp");
    let dlq = format!("{queue}.dlq");
    let db = pg_schema("fence_amqp").await;
    let store = pg_store(&db, "onceonly_keys").await;
    sqlx::query(
        "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    declare_queue(&channel, &dlq).await;

    // Sets the order's status; an event marked `poison` fails for good.
    let handler = Arc::new(handler_fn(
        |tx: Tx<sqlx::Postgres>, Json(e): Json<Value>| async move {
            if e["poison"].as_bool() == Some(true) {
                return Err(HandlerError::permanent("the ledger refused this event"));
            }
            let mut conn = tx.lock().await?;
            sqlx::query(
                "INSERT INTO orders (id, status, version) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO UPDATE SET status = excluded.status, version = excluded.version",
            )
            .bind(e["order"].as_str())
            .bind(e["status"].as_str())
            .bind(e["version"].as_i64())
            .execute(&mut *conn)
            .await?;
            Ok::<_, HandlerError>(())
        },
    ));
    let drain = |handler| {
        let (store, queue) = (store.clone(), queue.clone());
        async move {
            let run = AmqpConsumer::builder(
                onceonly::Engine::builder(store)
                    .key_expr("json:/event")
                    .fence(FenceSpec::new(
                        KeySpec::json_field("/order"),
                        OrderSpec::integer("/version"),
                    )),
            )
            .url(url())
            .queue(&queue)
            .concurrency(1)
            .exit_when_idle(Duration::from_secs(1))
            .build()
            .expect("consumer")
            .run_until(handler, CancellationToken::new());
            let stats: AmqpStats = tokio::time::timeout(Duration::from_secs(60), run)
                .await
                .expect("consumer did not drain within 60 s")
                .expect("consumer failed");
            stats
        }
    };
    let event = |id: &str, version: i64, status: &str, poison: bool| {
        Msg::new(
            json!({"event": id, "order": "ord-1", "version": version, "status": status, "poison": poison})
                .to_string(),
        )
    };
    // Version 1 (paid) fails and is dead-lettered; version 2 (refunded)
    // goes through.
    publish(&channel, &queue, &[event("ev-1", 1, "paid", true)]).await;
    let stats = drain(Arc::clone(&handler)).await;
    assert_eq!(stats.consumer.dead_lettered, 1);
    assert_eq!(depth(&channel, &dlq).await, 1);
    publish(&channel, &queue, &[event("ev-2", 2, "refunded", false)]).await;
    let stats = drain(Arc::clone(&handler)).await;
    assert_eq!(stats.consumer.processed, 1);

    // The operator replays the dead-letter queue: version 1 comes back.
    let u = url();
    let run = onceonly(&[
        "replay",
        "amqp",
        "--url",
        u.as_str(),
        "--queue",
        dlq.as_str(),
        "--retention",
        "7d",
    ])
    .await;
    assert!(run.success, "replay failed: {}", run.stderr);
    assert_eq!(depth(&channel, &dlq).await, 0);
    let stats = drain(Arc::clone(&handler)).await;
    assert_eq!(stats.consumer.stale, 1, "{stats:?}");
    assert_eq!(
        stats.consumer.dead_lettered, 0,
        "a stale event is never dead-lettered"
    );
    assert_eq!(depth(&channel, &queue).await, 0, "acknowledged");
    assert_eq!(depth(&channel, &dlq).await, 0);
    let state: (String, i64) =
        sqlx::query_as("SELECT status, version FROM orders WHERE id = 'ord-1'")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(
        state,
        ("refunded".to_owned(), 2),
        "the order never moved back"
    );
}
