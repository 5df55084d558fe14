//! The AMQP consumer against the real RabbitMQ and PostgreSQL. Each test has
//! its own queues and Postgres schema.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ledger::Receipt;
use onceonly::Header;
use onceonly::amqp::{AmqpConsumer, AmqpConsumerBuilder, AmqpStats, CancellationToken};
use onceonly::store::Deadlines;
use onceonly::{Delivery, Engine, PgStore, RetryPolicy, SqlStore};
use onceonly_integration_tests::amqp::{
    Msg, connect, declare_queue, declare_reply_queue, depth, header, publish, take, url,
};
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::handler::Ledger;
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::assert_exact;
use onceonly_integration_tests::{pay, pg_store, unique};
use sqlx::PgPool;

struct Setup {
    queue: String,
    store: PgStore,
    pool: PgPool,
}

async fn setup(name: &str) -> Setup {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let queue = unique(name);
    let url = pg_schema(name).await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    Setup {
        queue,
        pool: store.pool().clone(),
        store,
    }
}

fn consumer(s: &Setup) -> AmqpConsumerBuilder<PgStore> {
    consumer_with(s, |e| e)
}

/// [`consumer`] with more engine settings (applied after its own).
fn consumer_with(
    s: &Setup,
    engine: impl FnOnce(onceonly::EngineBuilder<PgStore>) -> onceonly::EngineBuilder<PgStore>,
) -> AmqpConsumerBuilder<PgStore> {
    AmqpConsumer::builder(engine(
        onceonly::Engine::builder(s.store.clone())
            .key_expr("json:/out_trade_no")
            .retry(
                RetryPolicy::default()
                    .max_attempts(3)
                    .initial_delay(Duration::from_millis(300)),
            ),
    ))
    .url(url())
    .queue(&s.queue)
    .exit_when_idle(Duration::from_secs(3))
}

async fn drain(builder: AmqpConsumerBuilder<PgStore>, handler: Arc<Ledger>) -> AmqpStats {
    let run = builder
        .build()
        .expect("consumer")
        .run_until(handler, CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain within 120 s")
        .expect("consumer failed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_and_redeliveries_are_acked_without_running_twice() {
    let s = setup("adup").await;
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..300 {
        let no = format!("A-{i:04}");
        let account = format!("acct-{}", i % 9);
        let body = pay(&no, 10 + i).account(&account).body();
        messages.push(Msg::new(body.clone()));
        if i % 3 == 0 {
            messages.push(Msg::new(body));
        }
        expected.insert(no, (account, 10 + i));
    }
    // Twenty keys were committed by a consumer that crashed before its acks:
    // the broker redelivers them; they must be duplicates.
    let engine = Engine::builder(s.store.clone())
        .scope(s.queue.as_str())
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    let earlier = Ledger::default();
    for i in 0..20 {
        let no = format!("A-{i:04}");
        let (account, amount) = &expected[&no];
        let d = Delivery::new(pay(&no, *amount).account(account));
        assert!(engine.process(&earlier, &d).await.outcome.is_done());
    }
    let (_conn, channel) = connect().await;
    publish(&channel, &s.queue, &messages).await;

    let handler = Arc::new(Ledger::default());
    let stats = drain(consumer(&s), Arc::clone(&handler)).await;
    assert_exact(&s.pool, &expected).await;
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        280,
        "handler ran once per new key"
    );
    assert_eq!(stats.consumer.processed, 280);
    assert_eq!(stats.consumer.duplicates as usize, messages.len() - 280);
    assert_eq!(
        stats.consumer.acked as usize,
        messages.len(),
        "every message acked once"
    );
    assert_eq!(stats.acks_lost, 0);
    assert_eq!(depth(&channel, &s.queue).await, 0, "queue drained");
    assert_eq!(depth(&channel, &format!("{}.dlq", s.queue)).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_messages_retry_with_delay_then_dead_letter_while_others_proceed() {
    let s = setup("apoison").await;
    let dlq = format!("{}.dlq", s.queue);
    let (_conn, channel) = connect().await;
    let handler = Arc::new(Ledger::default());
    // One handler at a time: the two `P-1` messages must be processed in
    // publishing order for the second to be the conflict.
    // The flaky message's retries come back 1 s, then 2 s (and jitter)
    // later, through the broker's TTL expiry, which runs late on a loaded
    // machine: the consumer waits well past that before it calls the queue
    // idle (3 s, seen stopping before the last retry came back).
    let run = tokio::spawn(drain(
        consumer_with(&s, |e| {
            e.retry(
                RetryPolicy::default()
                    .max_attempts(3)
                    .initial_delay(Duration::from_millis(1_000)),
            )
        })
        .concurrency(1)
        .exit_when_idle(Duration::from_secs(8)),
        Arc::clone(&handler),
    ));
    let mut flaky = Msg::new(pay("P-2", 20).account("flaky"));
    flaky.headers.push(("trace-id".into(), "t-2".into()));
    publish(&channel, &s.queue, &[flaky]).await;
    publish(
        &channel,
        &s.queue,
        &[
            Msg::new(pay("P-1", 10).account("alice")),
            Msg::new(b"{\"out_trade_no\":\"P-4\",\"amount\":".to_vec()),
            Msg::new(pay("P-5", 50).account("broken")),
            Msg::new(br#"{"account":"bob","amount":60}"#.to_vec()),
            Msg::new(pay("P-1", 999).account("alice")),
            Msg::new(pay("P-9", 90).account("carol")),
        ],
    )
    .await;
    // The good messages are done while the flaky one still waits in the
    // retry queues (1 s, then 2 s): a retry never blocks the queue.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let rows: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM ledger WHERE account IN ('alice', 'carol')")
                .fetch_one(&s.pool)
                .await
                .unwrap();
        if rows == 2 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "good messages stuck");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead_now = take(&channel, &dlq, 10, Duration::from_millis(500)).await;
    assert!(
        dead_now.iter().all(
            |m| header(&m.delivery.properties, Header::Reason.name()).as_deref()
                != Some("handler_error")
                || header(&m.delivery.properties, Header::Attempts.name()).as_deref() == Some("1")
        ),
        "the flaky message must still be retrying"
    );
    let stats = run.await.unwrap();
    let mut dead = dead_now;
    dead.extend(take(&channel, &dlq, 5, Duration::from_secs(10)).await);

    let expected: BTreeMap<String, (String, i64)> = [("P-1", "alice", 10), ("P-9", "carol", 90)]
        .iter()
        .map(|(n, a, m)| ((*n).to_owned(), ((*a).to_owned(), *m)))
        .collect();
    assert_exact(&s.pool, &expected).await;
    let summary: BTreeMap<String, (String, String)> = dead
        .iter()
        .map(|m| {
            let p = &m.delivery.properties;
            let body = String::from_utf8_lossy(&m.delivery.data).into_owned();
            (
                body,
                (
                    header(p, Header::Reason.name()).unwrap_or_default(),
                    header(p, Header::Attempts.name()).unwrap_or_default(),
                ),
            )
        })
        .collect();
    assert_eq!(dead.len(), 5, "five dead letters: {summary:?}");
    let reason_of = |body: &[u8]| summary[&String::from_utf8_lossy(body).into_owned()].clone();
    assert_eq!(
        reason_of(&pay("P-2", 20).account("flaky").body()),
        ("handler_error".into(), "3".into())
    );
    assert_eq!(
        reason_of(&pay("P-5", 50).account("broken").body()),
        ("handler_error".into(), "1".into())
    );
    assert_eq!(
        reason_of(&pay("P-1", 999).account("alice").body()),
        ("fingerprint_mismatch".into(), "1".into())
    );
    assert_eq!(
        reason_of(b"{\"out_trade_no\":\"P-4\",\"amount\":"),
        ("decode_error".into(), "0".into())
    );
    assert_eq!(
        reason_of(br#"{"account":"bob","amount":60}"#),
        ("bad_key".into(), "0".into())
    );
    for m in &dead {
        let p = &m.delivery.properties;
        assert_eq!(
            header(p, Header::OriginalExchange.name()).as_deref(),
            Some("")
        );
        assert_eq!(
            header(p, Header::OriginalRoutingKey.name()).as_deref(),
            Some(s.queue.as_str())
        );
        assert_eq!(
            header(p, Header::Queue.name()).as_deref(),
            Some(s.queue.as_str())
        );
        assert!(
            !header(p, Header::Error.name())
                .unwrap_or_default()
                .is_empty()
        );
    }
    let flaky = dead
        .iter()
        .find(|m| m.delivery.data == pay("P-2", 20).account("flaky").body())
        .unwrap();
    assert_eq!(
        header(&flaky.delivery.properties, "trace-id").as_deref(),
        Some("t-2"),
        "headers kept"
    );
    assert_eq!(
        header(&flaky.delivery.properties, Header::IdempotencyKey.name()).as_deref(),
        Some("P-2")
    );
    assert_eq!(
        stats.consumer.retried, 2,
        "two delayed retries of the flaky message"
    );
    assert_eq!(stats.consumer.dead_lettered, 5);
    assert_eq!(depth(&channel, &s.queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rpc_reply_for_a_duplicate_carries_the_original_result() {
    use lapin::options::BasicConsumeOptions;
    let s = setup("arpc").await;
    let (_conn, channel) = connect().await;
    let reply_queue = declare_reply_queue(&channel, "arpc_reply").await;
    let request = |corr: &str| Msg {
        body: pay("R-1", 77).account("dora").body(),
        reply_to: Some(reply_queue.clone()),
        correlation_id: Some(corr.into()),
        ..Msg::default()
    };
    publish(&channel, &s.queue, &[request("c-1"), request("c-2")]).await;
    let handler = Arc::new(Ledger::default());
    let stats = drain(consumer(&s).concurrency(1), Arc::clone(&handler)).await;
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
    assert_eq!(stats.replies, 2);
    let _ = BasicConsumeOptions::default();
    let replies = take(&channel, &reply_queue, 2, Duration::from_secs(10)).await;
    assert_eq!(replies.len(), 2);
    let mut by_corr = BTreeMap::new();
    for r in &replies {
        let p = &r.delivery.properties;
        let corr = p.correlation_id().as_ref().unwrap().as_str().to_owned();
        let receipt: Receipt = serde_json::from_slice(&r.delivery.data).unwrap();
        by_corr.insert(corr, (receipt, header(p, "x-onceonly-replayed").unwrap()));
    }
    let (first, replayed1) = &by_corr["c-1"];
    let (second, replayed2) = &by_corr["c-2"];
    assert_eq!(first, second, "the duplicate gets the stored receipt");
    assert_eq!(first.balance, 77);
    assert_eq!((replayed1.as_str(), replayed2.as_str()), ("false", "true"));
}

/// The handler's output type changed since a key was processed: the
/// duplicate's stored result no longer decodes, and its RPC caller still
/// gets a reply (an error one) instead of waiting for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_undecodable_stored_result_still_gets_an_error_reply() {
    let s = setup("aundec").await;
    let (_conn, channel) = connect().await;
    let reply_queue = declare_reply_queue(&channel, "aundec_reply").await;
    let request = |corr: &str| Msg {
        body: pay("U-1", 12).account("erin").body(),
        reply_to: Some(reply_queue.clone()),
        correlation_id: Some(corr.into()),
        ..Msg::default()
    };
    publish(&channel, &s.queue, &[request("old")]).await;
    drain(consumer(&s), Arc::new(Ledger::default())).await;
    publish(&channel, &s.queue, &[request("new")]).await;
    let v2 = onceonly::handler_fn(
        |_tx: onceonly::Tx<sqlx::Postgres>, _: onceonly::Json<serde_json::Value>| async {
            Ok(vec!["v2".to_owned()])
        },
    );
    let stats = consumer(&s)
        .build()
        .unwrap()
        .run_until(v2, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(
        (
            stats.consumer.duplicates,
            stats.replies,
            stats.consumer.dead_lettered
        ),
        (1, 1, 0),
        "{stats:?}"
    );
    let replies = take(&channel, &reply_queue, 2, Duration::from_secs(10)).await;
    let new = replies
        .iter()
        .find(|r| {
            r.delivery
                .properties
                .correlation_id()
                .as_ref()
                .map(|c| c.as_str())
                == Some("new")
        })
        .expect("a reply to the duplicate");
    let p = &new.delivery.properties;
    assert_eq!(header(p, "x-onceonly-replayed").as_deref(), Some("true"));
    assert_eq!(
        header(p, "x-onceonly-error").as_deref(),
        Some("stored_result_unreadable")
    );
    assert_eq!(depth(&channel, &s.queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_declared_quorum_queue_works_the_same() {
    use onceonly::amqp::QueueKind;
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let queue = unique("aquorum");
    let db = pg_schema("aquorum").await;
    let store = pg_store(&db, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let s = Setup {
        queue,
        pool: store.pool().clone(),
        store,
    };
    let handler = Arc::new(Ledger::default());
    let run = tokio::spawn(drain(
        consumer(&s)
            .queue_kind(QueueKind::Quorum)
            .delivery_limit(50),
        Arc::clone(&handler),
    ));
    // The consumer declares the quorum queue (and its quorum dead-letter
    // queue); publish once it exists.
    let (_conn, channel) = connect().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_c, probe) = connect().await;
        let exists = probe
            .queue_declare(
                s.queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .is_ok();
        if exists {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "quorum queue never declared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut expected = BTreeMap::new();
    let mut messages = Vec::new();
    for i in 0..50 {
        let no = format!("Q-{i}");
        messages.push(Msg::new(pay(&no, 2).account("quinn")));
        messages.push(Msg::new(pay(&no, 2).account("quinn")));
        expected.insert(no, ("quinn".to_owned(), 2));
    }
    messages.push(Msg::new(pay("Q-bad", 2).account("broken")));
    publish(&channel, &s.queue, &messages).await;
    let stats = run.await.unwrap();
    assert_exact(&s.pool, &expected).await;
    assert_eq!(
        (
            stats.consumer.processed,
            stats.consumer.duplicates,
            stats.consumer.dead_lettered
        ),
        (50, 50, 1)
    );
    assert_eq!(depth(&channel, &s.queue).await, 0);
    assert_eq!(depth(&channel, &format!("{}.dlq", s.queue)).await, 1);
}

/// With `concurrency(1)` deliveries run strictly in queue order, even with a
/// large prefetch on a multi-threaded runtime: the ledger's insertion order
/// is the publish order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_one_processes_in_queue_order() {
    let s = setup("aorder").await;
    let nos: Vec<String> = (0..300).map(|i| format!("O-{i:04}")).collect();
    let messages: Vec<Msg> = nos
        .iter()
        .enumerate()
        .map(|(i, no)| Msg::new(pay(no, 1).account(&format!("acct-{}", i % 7))))
        .collect();
    let (_conn, channel) = connect().await;
    publish(&channel, &s.queue, &messages).await;
    drain(
        consumer(&s).concurrency(1).prefetch(100),
        Arc::new(Ledger::default()),
    )
    .await;
    let order: Vec<String> = sqlx::query_scalar("SELECT out_trade_no FROM ledger ORDER BY id")
        .fetch_all(&s.pool)
        .await
        .unwrap();
    assert_eq!(order.len(), nos.len(), "every message processed once");
    let first = order.iter().zip(&nos).position(|(got, want)| got != want);
    assert_eq!(
        first,
        None,
        "processed out of queue order from position {first:?}: {:?}",
        first.map(|i| &order[i..(i + 5).min(order.len())])
    );
}

/// A handler that always outlasts the transaction deadline is not a
/// database outage to wait out forever: each miss is counted for its key,
/// and after the engine's default of 3 the message is dead-lettered with
/// reason `deadline` while the others are processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_always_slower_than_its_deadline_is_dead_lettered_deadline() {
    let mut s = setup("aslow").await;
    s.store = s
        .store
        .clone()
        .deadlines(Deadlines::default().transaction(Duration::from_millis(500)));
    let dlq = format!("{}.dlq", s.queue);
    let (_conn, channel) = connect().await;
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..20 {
        let no = format!("D-{i:04}");
        messages.push(Msg::new(pay(&no, 5 + i).account("acct-d").body()));
        expected.insert(no, ("acct-d".to_owned(), 5 + i));
        if i == 10 {
            messages.push(Msg::new(pay("D-SLOW", 99).account("slow").body()));
        }
    }
    publish(&channel, &s.queue, &messages).await;

    let handler = Arc::new(Ledger::default());
    let stats = drain(consumer(&s).concurrency(2), Arc::clone(&handler)).await;
    assert_exact(&s.pool, &expected).await;
    let dead = take(&channel, &dlq, 1, Duration::from_secs(10)).await;
    assert_eq!(dead.len(), 1, "the slow message is dead-lettered");
    let props = &dead[0].delivery.properties;
    assert_eq!(
        header(props, Header::Reason.name()).as_deref(),
        Some("deadline")
    );
    assert_eq!(stats.consumer.dead_lettered, 1);
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        20 + 3,
        "the slow handler ran 3 times, each rolled back at the deadline"
    );
    assert_eq!(depth(&channel, &s.queue).await, 0, "queue drained");
}

/// Issue 44, defect 10: a consumer started on a database without its
/// dedup table stops at once with the command that creates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_first_start_without_the_dedup_table_stops_with_the_command_that_creates_it() {
    let queue = unique("anoschema");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let db_url = pg_schema("anoschema").await;
    let store = PgStore::connect(&db_url)
        .await
        .expect("postgres")
        .with_table("never_migrated")
        .expect("table");
    let run =
        AmqpConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/out_trade_no"))
            .url(url())
            .queue(&queue)
            .build()
            .expect("consumer")
            .run_until(Arc::new(Ledger::default()), CancellationToken::new());
    let ended = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the consumer must not wait for a table that was never created");
    match ended {
        Err(onceonly::amqp::AmqpConsumerError::MissingSchema(why)) => {
            assert!(why.contains("onceonly migrate"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}
