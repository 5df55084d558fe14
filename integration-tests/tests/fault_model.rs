//! The fault model (design contract 11): a database in the wrong state is an
//! outage, never a dead letter. Each test breaks a real server while a
//! consumer works, then repairs it, and checks what users care about: no
//! dead letter, nothing acked or committed unprocessed, an exact ledger, and
//! recovery without a restart.
//!
//! - PostgreSQL fails over to **read-only** (`ALTER DATABASE ... SET
//!   default_transaction_read_only = on` and every connection terminated, as
//!   a failover does) under the AMQP and the Kafka consumer: connections
//!   opened meanwhile are read-only for good and must be recycled.
//! - MariaDB turns **read-only** (`SET GLOBAL read_only = ON`, error 1290)
//!   under the AMQP consumer.
//! - The dedup table is **missing** (`migrate` not run) until an operator
//!   runs it.
//! - A **panicking key function** under `prefetch(2)` does not stall the
//!   queue.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceonly::amqp::{AmqpConsumer, CancellationToken};
use onceonly::kafka::KafkaConsumer;
use onceonly::{
    Delivery, Handler, HandlerError, Json, KeyError, KeySpec, MySqlStore, PgStore, RetryPolicy,
    SqlStore,
};
use onceonly_integration_tests::amqp::{
    Msg, connect, declare_queue, depth, publish, publish_stream, url,
};
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::kafka::{Record, committed, create_topic, produce, read_all};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::own_db::OwnDb;
use onceonly_integration_tests::{mysql_url, unique};
use sqlx::{MySqlPool, PgPool};

async fn pg_ledger_store(db: &OwnDb) -> PgStore {
    let store = PgStore::connect(&db.url).await.expect("connect");
    store.migrate().await.expect("migrate");
    ledger::postgres::create_tables(store.pool())
        .await
        .expect("ledger tables");
    store
}

/// Waits until the ledger has at least `n` rows.
async fn wait_for_rows(pool: &PgPool, n: i64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while rows(pool).await < n {
        assert!(Instant::now() < deadline, "no progress: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Rows of a pool that may be read-only right now (reads work).
async fn frozen_for(pool: &PgPool, dur: Duration) -> (i64, i64) {
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before = rows(pool).await;
    tokio::time::sleep(dur).await;
    (before, rows(pool).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_consumer_waits_out_a_read_only_failover() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let db = OwnDb::create("fo_amqp").await;
    let store = pg_ledger_store(&db).await;
    let pool = PgPool::connect(&db.url).await.unwrap();

    let queue = unique("ro_amqp");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let stream = crash_stream("RA", 1_200);
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
    wait_for_rows(&pool, 100, "before the failover").await;
    db.fail_over_read_only().await;

    let (before, after) = frozen_for(&pool, Duration::from_secs(3)).await;
    assert_eq!(
        before, after,
        "nothing commits while the database is read-only"
    );
    assert!(
        (after as usize) + 300 < stream.expected.len(),
        "the failover must hit mid-stream ({after} rows done)"
    );
    assert_eq!(
        depth(&channel, &format!("{queue}.dlq")).await,
        0,
        "a read-only database dead-letters nothing"
    );
    // The database is writable again; connections opened while it was
    // read-only must not keep the consumer stuck.
    db.set_read_only(false).await;

    let stats = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain after the failover")
        .unwrap()
        .expect("consumer failed");
    assert_eq!(stats.consumer.dead_lettered, 0, "{stats:?}");
    assert_exact(&pool, &stream.expected).await;
    assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    assert_eq!(depth(&channel, &format!("{queue}.dlq")).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_consumer_waits_out_a_read_only_failover() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let db = OwnDb::create("fo_kafka").await;
    let store = pg_ledger_store(&db).await;
    let pool = PgPool::connect(&db.url).await.unwrap();

    let topic = unique("ro_kafka");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 2).await;
    create_topic(&dlt, 1).await;
    let stream = crash_stream("RK", 1_200);
    let records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(no, body)| Record::new(no.clone(), body.clone()))
        .collect();
    let ends = produce(&topic, &records).await;

    let group = unique("ro_group");
    let consumer = KafkaConsumer::builder(
        onceonly::Engine::builder(store)
            .key_expr("json:/out_trade_no")
            .retry(RetryPolicy::default().max_attempts(2)),
    )
    .brokers(onceonly_integration_tests::kafka::brokers())
    .group_id(&group)
    .topic(&topic)
    .exit_when_idle(Duration::from_secs(4))
    .build()
    .unwrap();
    let run = tokio::spawn(consumer.run_until(ledger::postgres::Ledger, CancellationToken::new()));
    wait_for_rows(&pool, 100, "before the failover").await;
    db.fail_over_read_only().await;

    let (before, after) = frozen_for(&pool, Duration::from_secs(3)).await;
    assert_eq!(
        before, after,
        "nothing commits while the database is read-only"
    );
    assert!((after as usize) + 300 < stream.expected.len());
    db.set_read_only(false).await;

    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain after the failover")
        .unwrap()
        .expect("consumer failed");
    assert_exact(&pool, &stream.expected).await;
    let got = committed(&group, &topic, 2);
    for (p, end) in &ends {
        assert_eq!(got.get(p), Some(end), "partition {p} committed to its end");
    }
    assert!(
        read_all(&dlt, 1, 1, Duration::from_secs(2)).is_empty(),
        "a read-only database dead-letters nothing"
    );
}

/// A consumer started before anyone ran `migrate` stops at once, saying
/// how to create the table (issue 44: it used to wait for ever); a dedup
/// table that disappears while the consumer runs is waited out: every
/// message waits (nothing is dead-lettered with `store_error`) until the
/// table is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_dedup_table_stops_a_first_start_and_is_waited_for_later() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let db = OwnDb::create("fo_missing").await;
    let store = PgStore::connect(&db.url).await.unwrap();
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let pool = store.pool().clone();

    let queue = unique("missing");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let consumer = || {
        AmqpConsumer::builder(
            onceonly::Engine::builder(store.clone()).key_expr("json:/out_trade_no"),
        )
        .url(url())
        .queue(&queue)
        .exit_when_idle(Duration::from_secs(8))
        .build()
        .unwrap()
    };
    let first = tokio::time::timeout(
        Duration::from_secs(30),
        consumer().run_until(ledger::postgres::Ledger, CancellationToken::new()),
    )
    .await
    .expect("a first start without the table stops at once");
    match first {
        Err(onceonly::amqp::AmqpConsumerError::MissingSchema(why)) => {
            assert!(why.contains("onceonly migrate"), "{why}");
        }
        other => panic!("{other:?}"),
    }

    store.migrate().await.unwrap();
    let run =
        tokio::spawn(consumer().run_until(ledger::postgres::Ledger, CancellationToken::new()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The table disappears while the consumer runs, then messages come.
    sqlx::query(&format!("DROP TABLE {}", store.table()))
        .execute(&pool)
        .await
        .unwrap();
    let stream = crash_stream("MT", 200);
    publish_stream(&channel, &queue, &stream).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(rows(&pool).await, 0, "nothing can commit without the table");
    assert_eq!(depth(&channel, &format!("{queue}.dlq")).await, 0);
    assert!(
        !run.is_finished(),
        "the consumer waits, it does not give up"
    );

    store.migrate().await.unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("consumer did not drain after migrate")
        .unwrap()
        .unwrap();
    assert_eq!(stats.consumer.dead_lettered, 0, "{stats:?}");
    assert_exact(&pool, &stream.expected).await;
    assert_eq!(depth(&channel, &queue).await, 0);
}

/// Charges on MariaDB, by a user without `SUPER` (read_only binds it).
struct MyCharges;

#[async_trait]
impl Handler<sqlx::MySql> for MyCharges {
    type Input = Json<ledger::Payment>;
    type Output = i64;

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::MySql>,
        Json(p): Json<ledger::Payment>,
        _: &Delivery,
    ) -> Result<i64, HandlerError> {
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO charges (out_trade_no, amount) VALUES (?, ?)")
            .bind(&p.out_trade_no)
            .bind(p.amount)
            .execute(&mut *conn)
            .await?;
        Ok(p.amount)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_consumer_waits_out_a_read_only_mariadb() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let root = MySqlPool::connect(&mysql_url()).await.unwrap_or_else(|e| {
        panic!(
            "MariaDB is not reachable at {}: {e}; start it with scripts/services",
            mysql_url()
        )
    });
    let name = unique("ro_my");
    let user = format!("u{}", &name[name.len().saturating_sub(20)..]);
    for stmt in [
        format!("CREATE DATABASE {name}"),
        format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
        format!("CREATE USER '{user}'@'localhost' IDENTIFIED BY 'pw'"),
        format!("GRANT ALL ON {name}.* TO '{user}'@'%'"),
        format!("GRANT ALL ON {name}.* TO '{user}'@'localhost'"),
        format!(
            "CREATE TABLE {name}.charges (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             out_trade_no VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
        ),
    ] {
        sqlx::query(&stmt).execute(&root).await.expect(&stmt);
    }
    let base = mysql_url();
    let host = base
        .rsplit_once('@')
        .map_or("127.0.0.1:3306/test", |(_, h)| h);
    let host = host.split('/').next().unwrap_or("127.0.0.1:3306");
    let store = MySqlStore::connect(&format!("mysql://{user}:pw@{host}/{name}"))
        .await
        .expect("connect as the test user");
    store.migrate().await.unwrap();

    let queue = unique("ro_my_q");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let stream = crash_stream("RM", 800);
    publish_stream(&channel, &queue, &stream).await;
    let consumer =
        AmqpConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
            .url(url())
            .queue(&queue)
            .exit_when_idle(Duration::from_secs(4))
            .build()
            .unwrap();
    let run = tokio::spawn(consumer.run_until(MyCharges, CancellationToken::new()));
    let count = |root: MySqlPool| {
        let name = name.clone();
        async move {
            sqlx::query_scalar::<_, i64>(&format!("SELECT COUNT(*) FROM {name}.charges"))
                .fetch_one(&root)
                .await
                .unwrap()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(root.clone()).await < 100 {
        assert!(Instant::now() < deadline, "no progress before read_only");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query("SET GLOBAL read_only = ON")
        .execute(&root)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before = count(root.clone()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = count(root.clone()).await;
    sqlx::query("SET GLOBAL read_only = OFF")
        .execute(&root)
        .await
        .unwrap();
    assert_eq!(before, after, "nothing commits while MariaDB is read-only");
    assert!((after as usize) + 200 < stream.expected.len());
    assert_eq!(depth(&channel, &format!("{queue}.dlq")).await, 0);

    let stats = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain after read_only was lifted")
        .unwrap()
        .unwrap();
    assert_eq!(stats.consumer.dead_lettered, 0, "{stats:?}");
    let (n, distinct): (i64, i64) = sqlx::query_as(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT out_trade_no) FROM {name}.charges"
    ))
    .fetch_one(&root)
    .await
    .unwrap();
    assert_eq!(n, stream.expected.len() as i64, "one charge per key");
    assert_eq!(distinct, n);
    assert_eq!(depth(&channel, &queue).await, 0);
    for stmt in [
        format!("DROP USER '{user}'@'%'"),
        format!("DROP USER '{user}'@'localhost'"),
        format!("DROP DATABASE {name}"),
    ] {
        let _ = sqlx::query(&stmt).execute(&root).await;
    }
}

/// A custom key function that panics on one message: with `prefetch(2)`
/// the panic must settle that message (retried per the policy, then
/// dead-lettered), never hold a prefetch slot while the rest waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_key_function_does_not_stall_the_queue() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let db = OwnDb::create("fo_panic").await;
    let store = pg_ledger_store(&db).await;
    let pool = store.pool().clone();
    let queue = unique("panic_key");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let stream = crash_stream("PK", 60);
    let mut messages = vec![
        Msg::new(br#"{"poison":1}"#.to_vec()),
        Msg::new(br#"{"poison":2}"#.to_vec()),
    ];
    messages.extend(stream.messages.iter().map(|(_, b)| Msg::new(b.clone())));
    publish(&channel, &queue, &messages).await;

    let key = KeySpec::custom(|d: &Delivery| {
        let v: serde_json::Value =
            serde_json::from_slice(d.payload()).map_err(|e| KeyError::NotJson(e.to_string()))?;
        match v.get("out_trade_no").and_then(|k| k.as_str()) {
            Some(k) => Ok(k.to_owned()),
            None => panic!("key function bug: no out_trade_no"),
        }
    });
    let consumer = AmqpConsumer::builder(
        onceonly::Engine::builder(store).key(key).retry(
            RetryPolicy::default()
                .max_attempts(2)
                .initial_delay(Duration::from_millis(50)),
        ),
    )
    .url(url())
    .queue(&queue)
    .prefetch(2)
    .concurrency(2)
    .exit_when_idle(Duration::from_secs(3))
    .build()
    .unwrap();
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run_until(Arc::new(ledger::postgres::Ledger), CancellationToken::new()),
    )
    .await
    .expect("the queue stalled behind the panicking messages")
    .unwrap();
    assert_exact(&pool, &stream.expected).await;
    assert_eq!(stats.consumer.dead_lettered, 2, "{stats:?}");
    assert_eq!(depth(&channel, &queue).await, 0);
    assert_eq!(depth(&channel, &format!("{queue}.dlq")).await, 2);
}
