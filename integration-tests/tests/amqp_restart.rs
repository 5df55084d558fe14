//! RabbitMQ restarted under a running consumer (`rabbitmqctl stop_app`, then
//! `start_app`, on the host or inside the compose container, see
//! `onceonly_integration_tests::services`): the consumer reconnects and
//! drains the queue with an exact ledger. In its own test binary so that no
//! other test sees the restart.

use onceonly_integration_tests::demo::ledger;

use std::time::{Duration, Instant};

use onceonly::amqp::{AmqpConsumer, CancellationToken};
use onceonly::{RetryPolicy, SqlStore};
use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish, url};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{Expected, assert_exact, rows};
use onceonly_integration_tests::services::Service;
use onceonly_integration_tests::{pay, pg_store, unique};

/// Starts the broker app again however the test ends.
struct Restart;

impl Drop for Restart {
    fn drop(&mut self) {
        if let Err(e) = Service::RabbitMq.try_start() {
            eprintln!("starting RabbitMQ's app again: {e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_restart_mid_stream_drains_with_an_exact_ledger() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    // Host tools or docker compose: decided first (panics if neither).
    let how = Service::RabbitMq.mechanism();
    let queue = unique("arestart");
    let db = pg_schema("arestart").await;
    let store = pg_store(&db, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let pool = store.pool().clone();
    let (conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let mut messages = Vec::new();
    let mut expected = Expected::new();
    for i in 0..3_000 {
        let no = format!("X-{i:05}");
        let account = format!("acct-{}", i % 13);
        let body = pay(&no, 1 + i % 50).account(&account).body();
        messages.push(Msg::new(body.clone()));
        if i % 5 == 0 {
            messages.push(Msg::new(body));
        }
        expected.insert(no, (account, 1 + i % 50));
    }
    publish(&channel, &queue, &messages).await;
    drop(channel);
    drop(conn);

    let consumer = AmqpConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/out_trade_no")
            .retry(RetryPolicy::default().max_attempts(3)),
    )
    .url(url())
    .queue(&queue)
    .prefetch(16)
    .reconnect_backoff(Duration::from_millis(200), Duration::from_secs(2))
    .exit_when_idle(Duration::from_secs(5))
    .build()
    .unwrap();
    let run = tokio::spawn(consumer.run_until(ledger::postgres::Ledger, CancellationToken::new()));

    let deadline = Instant::now() + Duration::from_secs(60);
    while rows(&pool).await < 300 {
        assert!(Instant::now() < deadline, "no progress before the restart");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let guard = Restart;
    Service::RabbitMq.stop();
    let at_stop = rows(&pool).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    Service::RabbitMq.start();
    std::mem::forget(guard);
    eprintln!(
        "restarted RabbitMQ ({how:?}) with {at_stop} of {} rows done",
        expected.len()
    );

    let stats = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("consumer did not drain after the restart")
        .unwrap()
        .expect("consumer failed");
    assert!(
        stats.connections >= 2,
        "the consumer reconnected: {stats:?}"
    );
    assert!(
        (at_stop as usize) < expected.len(),
        "the restart happened mid-stream"
    );

    assert_exact(&pool, &expected).await;
    let (_conn, channel) = connect().await;
    assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    assert_eq!(
        depth(&channel, &format!("{queue}.dlq")).await,
        0,
        "nothing dead-lettered"
    );
}
