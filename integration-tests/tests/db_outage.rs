//! The database goes away under a running consumer: a private PostgreSQL
//! (its own data directory and port, so no other test is disturbed) is
//! stopped with `pg_ctl stop -m immediate` (under Docker Compose: its
//! container `postgres-private` killed) while the AMQP consumer works,
//! then started again. An outage is the infrastructure's fault, not the
//! messages': nothing may be dead-lettered, nothing acked unprocessed, and
//! the ledger must end exact.

use onceonly_integration_tests::demo::ledger;

use std::time::{Duration, Instant};

use onceonly::amqp::{AmqpConsumer, CancellationToken};
use onceonly::{PgStore, RetryPolicy, SqlStore};
use onceonly_integration_tests::amqp::{connect, declare_queue, depth, publish_stream, url};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::private_pg::PrivatePg;
use onceonly_integration_tests::unique;

const PORT: u16 = 54_329;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_is_waited_out_never_dead_lettered() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let pg = PrivatePg::builder(PORT).start();
    let db_url = pg.url();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect(&db_url)
        .await
        .expect("private postgres");
    let store = PgStore::new(pool.clone());
    store.migrate().await.unwrap();
    ledger::postgres::create_tables(&pool).await.unwrap();

    let queue = unique("dbout");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let stream = crash_stream("D", 4_800);
    publish_stream(&channel, &queue, &stream).await;

    let consumer = AmqpConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/out_trade_no")
            .retry(RetryPolicy::default().max_attempts(2)),
    )
    .url(url())
    .queue(&queue)
    .exit_when_idle(Duration::from_secs(4))
    .build()
    .unwrap();
    let run = tokio::spawn(consumer.run_until(ledger::postgres::Ledger, CancellationToken::new()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while rows(&pool).await < 200 {
        assert!(Instant::now() < deadline, "no progress before the outage");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pg.stop_immediately();
    // The pool's connections are gone with the server: count from a fresh one later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.start();
    let at_restart = rows(&pool).await;
    assert!(
        (at_restart as usize) + 1_000 < stream.expected.len(),
        "the outage must hit mid-stream ({at_restart} rows done before the restart)"
    );

    let stats = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain after the outage")
        .unwrap()
        .expect("consumer failed");
    assert_eq!(
        stats.consumer.dead_lettered, 0,
        "an outage never dead-letters: {stats:?}"
    );
    assert_exact(&pool, &stream.expected).await;
    assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    assert_eq!(
        depth(&channel, &format!("{queue}.dlq")).await,
        0,
        "dead-letter queue empty"
    );
}
