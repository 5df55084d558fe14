//! The edges of the outbox and retry paths (issue 22): copies keep the
//! outbox's message id, publishes are matched to their own confirms and
//! bounded, redirects are not deliveries, commit-time message faults are
//! dead-lettered instead of waited on, the relay holds no transaction while
//! it publishes, and the smaller leaks and collisions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use onceonly::outbox::{
    AmqpPublisher, Outbox, OutboxBackend, OutboxMessage, Relay, Status, WebhookPublisher,
};
use onceonly::{Delivery, Engine, HandlerError, Json, Outcome, SqlStore, Tx, handler_fn};
use onceonly_integration_tests::{pg_store, pg_url, unique};

/// Processes one inbound message `no` whose handler enqueues `messages`
/// (built from `no`); asserts it was processed and returns the ids.
async fn enqueue_for<S, F>(store: &S, outbox: &Outbox<S::Db>, no: &str, messages: F)
where
    S: SqlStore,
    S::Db: OutboxBackend,
    F: Fn(&str) -> Vec<OutboxMessage> + Send + Sync + 'static,
{
    let engine = Engine::builder(store.clone())
        .scope("edges")
        .key_expr("json:/no")
        .build()
        .expect("engine");
    let messages = Arc::new(messages);
    let outbox = outbox.clone();
    let handler = handler_fn(move |tx: Tx<S::Db>, Json(v): Json<serde_json::Value>| {
        let (outbox, messages) = (outbox.clone(), Arc::clone(&messages));
        async move {
            let no = v["no"].as_str().unwrap_or_default().to_owned();
            let mut conn = tx.lock().await?;
            for m in messages(&no) {
                outbox.enqueue(&mut conn, m).await?;
            }
            Ok::<_, HandlerError>(())
        }
    });
    let body = serde_json::json!({ "no": no }).to_string();
    let report = engine.process(&handler, &Delivery::new(body)).await;
    assert!(
        matches!(report.outcome, Outcome::Processed { .. }),
        "{no}: {report:?}"
    );
}

/// Serves `app` on an ephemeral loopback port.
async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    addr
}

/// A store in a schema of its own with table `seats`, whose seat is
/// unique, checked only at COMMIT (a deferred constraint).
async fn seats_store(prefix: &str) -> onceonly::PgStore {
    let url = onceonly_integration_tests::kafka::pg_schema(prefix).await;
    let store = pg_store(&url, "onceonly_keys").await;
    sqlx::query(
        "CREATE TABLE seats (no text PRIMARY KEY, seat text NOT NULL, \
         CONSTRAINT one_per_seat UNIQUE (seat) DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(store.pool())
    .await
    .expect("table");
    store
}

/// Runs one relay until `done` says so (checked every 50 ms) or `within`
/// passed, then stops it.
async fn relay_until<DB: OutboxBackend>(
    relay: Relay<DB>,
    within: Duration,
    mut done: impl AsyncFnMut() -> bool,
) -> onceonly::outbox::RelayStats {
    let handle = relay.spawn();
    let deadline = tokio::time::Instant::now() + within;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay did not get there within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.stop().await
}

// --- 1. Copies keep the outbox's message id ---------------------------------

mod kafka_copies {
    use super::*;
    use onceonly::Header;
    use onceonly::kafka::{CancellationToken, KafkaConsumer};
    use onceonly::ops::replay::KafkaReplay;
    use onceonly_integration_tests::kafka::{
        Record, brokers, create_topic, header, pg_schema, produce, read_all,
    };

    /// Applies messages keyed on the outbox's message id; `FLAKY` fails
    /// (retryably) on its first run, `BROKEN` on every run until `fixed`.
    struct Downstream {
        flaky_runs: AtomicUsize,
        fixed: AtomicBool,
    }

    #[async_trait::async_trait]
    impl onceonly::Handler<sqlx::Postgres> for Downstream {
        type Input = Json<serde_json::Value>;
        type Output = ();

        async fn handle(
            &self,
            tx: Tx<sqlx::Postgres>,
            Json(v): Json<serde_json::Value>,
            delivery: &Delivery,
        ) -> Result<(), HandlerError> {
            let no = v["no"].as_str().unwrap_or_default().to_owned();
            if no == "FLAKY" && self.flaky_runs.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(HandlerError::retryable("downstream timed out"));
            }
            if no == "BROKEN" && !self.fixed.load(Ordering::SeqCst) {
                return Err(HandlerError::retryable("downstream keeps timing out"));
            }
            let id = delivery
                .metadata(Header::MessageId.name())
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            let mut conn = tx.lock().await?;
            sqlx::query("INSERT INTO applied (message_id, no) VALUES ($1, $2)")
                .bind(id)
                .bind(no)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
    }

    /// A downstream consumer keyed on `header:x-onceonly-message-id` gets
    /// a message after one transient failure through the retry topic, and
    /// a replayed dead letter of another: both keep the message id (and
    /// the causation id) that the outbox put on them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn retry_copies_and_replayed_dead_letters_keep_the_message_id() {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        let topic = unique("edge_copies");
        let retry = format!("{topic}.retry");
        let dlt = format!("{topic}.dlt");
        for t in [&topic, &retry, &dlt] {
            create_topic(t, 1).await;
        }
        let url = pg_schema("edgecp").await;
        let store = pg_store(&url, "onceonly_keys").await;
        sqlx::query("CREATE TABLE applied (message_id text PRIMARY KEY, no text NOT NULL)")
            .execute(store.pool())
            .await
            .expect("table");
        // As the relay sends them: the message and causation ids in headers.
        let records: Vec<Record> = ["OK", "FLAKY", "BROKEN"]
            .iter()
            .map(|no| {
                Record::new(*no, serde_json::json!({ "no": no }).to_string())
                    .header(Header::MessageId.name(), &format!("m-{no}"))
                    .header("x-onceonly-causation-id", &format!("c-{no}"))
            })
            .collect();
        produce(&topic, &records).await;
        let group = unique("edge_copies_group");
        let handler = Arc::new(Downstream {
            flaky_runs: AtomicUsize::new(0),
            fixed: AtomicBool::new(false),
        });
        let consume = || {
            KafkaConsumer::builder(
                onceonly::Engine::builder(store.clone())
                    .key_expr(&format!("header:{}", Header::MessageId.name()))
                    .retry(
                        onceonly::RetryPolicy::default()
                            .max_attempts(2)
                            .initial_delay(Duration::from_millis(300))
                            .without_jitter(),
                    ),
            )
            .brokers(brokers())
            .group_id(&group)
            .topic(&topic)
            .retry_topic(&retry)
            .exit_when_idle(Duration::from_secs(4))
            .build()
            .expect("consumer")
            .run_until(Arc::clone(&handler), CancellationToken::new())
        };
        tokio::time::timeout(Duration::from_secs(90), consume())
            .await
            .expect("consumer did not drain")
            .expect("consumer failed");
        let applied = |pool: sqlx::PgPool| async move {
            sqlx::query_as::<_, (String, String)>("SELECT no, message_id FROM applied ORDER BY no")
                .fetch_all(&pool)
                .await
                .expect("applied")
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let after_first = applied(store.pool().clone()).await;
        assert_eq!(
            after_first.get("FLAKY").map(String::as_str),
            Some("m-FLAKY"),
            "a retry copy keeps the message id: {after_first:?}"
        );
        assert_eq!(after_first.get("OK").map(String::as_str), Some("m-OK"));
        assert!(!after_first.contains_key("BROKEN"));
        let letters = read_all(&dlt, 1, 2, Duration::from_secs(10));
        assert_eq!(letters.len(), 1, "BROKEN dead-lettered once");
        assert_eq!(
            header(&letters[0], Header::MessageId.name()),
            Some("m-BROKEN")
        );
        assert_eq!(
            header(&letters[0], "x-onceonly-causation-id"),
            Some("c-BROKEN")
        );
        assert_eq!(
            header(&letters[0], Header::Reason.name()),
            Some("handler_error"),
            "dead-lettered for the handler's failure, not for a missing key"
        );

        // The bug is fixed; the operator replays the dead letter.
        handler.fixed.store(true, Ordering::SeqCst);
        let report = KafkaReplay::builder()
            .brokers(brokers())
            .topic(&dlt)
            .options(onceonly::ops::replay::ReplayOptions::new().screen(
                onceonly::ops::replay::Screen::new().retention(Duration::from_secs(86_400)),
            ))
            .build()
            .expect("replay")
            .run()
            .await
            .expect("replay run");
        assert_eq!(report.replayed, 1, "{report:?}");
        tokio::time::timeout(Duration::from_secs(90), consume())
            .await
            .expect("consumer did not drain")
            .expect("consumer failed");
        let after_replay = applied(store.pool().clone()).await;
        assert_eq!(
            after_replay.get("BROKEN").map(String::as_str),
            Some("m-BROKEN"),
            "the replayed dead letter is applied under its message id"
        );
        assert_eq!(after_replay.len(), 3);
    }
}

// --- 2. AMQP: each publish its own confirm --------------------------------

mod amqp_confirms {
    use super::*;
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::types::FieldTable;
    use onceonly_integration_tests::amqp::{connect, depth, take, url};

    /// Routable and unroutable messages published concurrently by one
    /// relay round: exactly the routable ones are marked sent (each once),
    /// and the unroutable ones are not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_publishes_mark_exactly_the_routable_messages_sent() {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        let exchange = unique("edge_ex");
        let queue = unique("edge_routed");
        let (_conn, channel) = connect().await;
        channel
            .exchange_declare(
                exchange.as_str().into(),
                lapin::ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    auto_delete: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("exchange");
        // A transient queue: the broker confirms routed messages at once,
        // so their acks and the unroutable ones' come in the same batches
        // (`multiple`), right after the returns.
        channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    auto_delete: true,
                    ..lapin::options::QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "routed".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
        let store = pg_store(&pg_url(), &unique("edge_keys")).await;
        let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("edge_ob")).expect("table");
        outbox.migrate(store.pool()).await.expect("migrate");
        let n = 300;
        for i in 0..n {
            let ex = exchange.clone();
            enqueue_for(&store, &outbox, &format!("M-{i:03}"), move |no| {
                let routing = if i % 2 == 0 { "routed" } else { "nowhere" };
                // One ordering key each: all publish concurrently.
                vec![OutboxMessage::amqp(&ex, routing, no.as_bytes().to_vec()).order_by(no)]
            })
            .await;
        }
        let relay = Relay::builder(store.pool().clone(), outbox.clone())
            .publisher(AmqpPublisher::new(url()))
            .batch(300)
            .max_attempts(1)
            .build()
            .expect("relay");
        let pool = store.pool().clone();
        let ob = outbox.clone();
        let stats = relay_until(relay, Duration::from_secs(60), async || {
            let s = ob.stats(&pool).await.expect("stats");
            s.rows(Status::Pending) == 0
        })
        .await;
        let sent = outbox
            .list(store.pool(), Status::Sent, 1000)
            .await
            .expect("list");
        let dead = outbox
            .list(store.pool(), Status::Dead, 1000)
            .await
            .expect("list");
        let routing =
            |r: &onceonly::outbox::OutboxRecord| r.row.routing_key.clone().unwrap_or_default();
        assert_eq!(sent.len(), n / 2, "{stats:?}");
        assert!(
            sent.iter().all(|r| routing(r) == "routed"),
            "an unroutable message was marked sent: {:?}",
            sent.iter().map(routing).collect::<Vec<_>>()
        );
        assert!(dead.iter().all(|r| routing(r) == "nowhere"));
        let got = take(&channel, &queue, n, Duration::from_secs(5)).await;
        let mut bodies: Vec<String> = got
            .iter()
            .map(|m| String::from_utf8_lossy(&m.delivery.data).into_owned())
            .collect();
        bodies.sort();
        let expected: Vec<String> = (0..n).step_by(2).map(|i| format!("M-{i:03}")).collect();
        assert_eq!(bodies, expected, "each routable message arrived once");
        assert_eq!(depth(&channel, &queue).await, 0);
    }
}

/// The same with the messages of each ordering key pipelined: routable
/// and unroutable messages share four keys, so every relay round has many
/// publishes of one key in flight on one channel, and the broker confirms
/// them in `multiple` batches right after the returns. Each return is
/// matched to its own message: exactly the routable ones are marked sent,
/// the unroutable ones are parked, and a routable message confirmed
/// behind an unroutable one is sent again (the same id) after it.
mod amqp_pipelined_confirms {
    use super::*;
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    use onceonly_integration_tests::amqp::{connect, take, url};

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn pipelined_publishes_match_each_return_to_its_own_message() {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        let exchange = unique("edge_pipe_ex");
        let queue = unique("edge_pipe_routed");
        let (_conn, channel) = connect().await;
        channel
            .exchange_declare(
                exchange.as_str().into(),
                lapin::ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    auto_delete: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("exchange");
        // Transient, as in `amqp_confirms`: acks come in batches.
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "routed".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
        let store = pg_store(&pg_url(), &unique("edge_keys")).await;
        let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("edge_ob")).expect("table");
        outbox.migrate(store.pool()).await.expect("migrate");
        let n = 300;
        for i in 0..n {
            let ex = exchange.clone();
            enqueue_for(&store, &outbox, &format!("P-{i:03}"), move |no| {
                // Every third message unroutable, four ordering keys.
                let routing = if i % 3 == 1 { "nowhere" } else { "routed" };
                let key = format!("key-{}", i % 4);
                vec![OutboxMessage::amqp(&ex, routing, no.as_bytes().to_vec()).order_by(key)]
            })
            .await;
        }
        let relay = Relay::builder(store.pool().clone(), outbox.clone())
            // One channel: every key's pipeline on it in turn.
            .publisher(AmqpPublisher::new(url()).with_channels(1))
            .batch(300)
            .max_attempts(1)
            .poll_interval(Duration::from_millis(20))
            .build()
            .expect("relay");
        let pool = store.pool().clone();
        let ob = outbox.clone();
        let stats = relay_until(relay, Duration::from_secs(60), async || {
            let s = ob.stats(&pool).await.expect("stats");
            s.rows(Status::Pending) == 0
        })
        .await;
        let rows = |status| {
            let (outbox, pool) = (outbox.clone(), store.pool().clone());
            async move {
                let mut bodies: Vec<String> = outbox
                    .list(&pool, status, 1000)
                    .await
                    .expect("list")
                    .iter()
                    .map(|r| String::from_utf8_lossy(&r.row.payload).into_owned())
                    .collect();
                bodies.sort();
                bodies
            }
        };
        let routable: Vec<String> = (0..n)
            .filter(|i| i % 3 != 1)
            .map(|i| format!("P-{i:03}"))
            .collect();
        let unroutable: Vec<String> = (0..n)
            .filter(|i| i % 3 == 1)
            .map(|i| format!("P-{i:03}"))
            .collect();
        assert_eq!(rows(Status::Sent).await, routable, "{stats:?}");
        assert_eq!(rows(Status::Dead).await, unroutable, "{stats:?}");
        // Copies of a routable message confirmed behind an unroutable one
        // arrive more than once, with one message id.
        let got = take(&channel, &queue, 2 * n, Duration::from_secs(5)).await;
        let mut ids: BTreeMap<String, String> = BTreeMap::new();
        for m in &got {
            let body = String::from_utf8_lossy(&m.delivery.data).into_owned();
            let id = m
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_owned())
                .expect("message id");
            let first = ids.entry(body.clone()).or_insert_with(|| id.clone());
            assert_eq!(*first, id, "{body}: one id on every copy");
        }
        let arrived: Vec<String> = ids.into_keys().collect();
        assert_eq!(arrived, routable, "each routable message arrived");
    }
}

/// A broker that stops answering (no FIN, no RST: a memory alarm, a dead
/// link) does not hold a relay round for ever: the publish fails after its
/// timeout, the row stays pending with the reason, the relay stops when
/// asked, and once the network heals the message goes out on a new
/// connection.
mod amqp_silent_broker {
    use super::*;
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    use onceonly_integration_tests::amqp::{connect, take};
    use onceonly_integration_tests::silent_proxy::SilentProxy;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_silent_broker_ends_a_relay_round_within_the_publish_timeout() {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        let queue = unique("edge_silent");
        let (_conn, channel) = connect().await;
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue");
        let proxy = SilentProxy::start("127.0.0.1:5672").await;
        let via_proxy = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
        let store = pg_store(&pg_url(), &unique("edge_keys")).await;
        let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("edge_ob")).expect("table");
        outbox.migrate(store.pool()).await.expect("migrate");
        let to_queue =
            |q: String| move |no: &str| vec![OutboxMessage::amqp("", &q, no.as_bytes().to_vec())];
        enqueue_for(&store, &outbox, "Q-1", to_queue(queue.clone())).await;
        let relay = Relay::builder(store.pool().clone(), outbox.clone())
            .publisher(AmqpPublisher::new(via_proxy).with_timeout(Duration::from_secs(2)))
            .poll_interval(Duration::from_millis(50))
            .backoff(Duration::from_millis(100), Duration::from_millis(200))
            .build()
            .expect("relay")
            .spawn();
        let sent = |n: i64| {
            let (outbox, pool) = (outbox.clone(), store.pool().clone());
            async move { outbox.stats(&pool).await.expect("stats").rows(Status::Sent) >= n }
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !sent(1).await {
            assert!(tokio::time::Instant::now() < deadline, "Q-1 not sent");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        proxy.silence();
        enqueue_for(&store, &outbox, "Q-2", to_queue(queue.clone())).await;
        // The publish times out and the round records it.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let pending = outbox
                .list(store.pool(), Status::Pending, 10)
                .await
                .expect("list");
            if let Some(error) = pending.first().and_then(|r| r.last_error.clone()) {
                assert!(error.contains("no confirm within"), "{error}");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the relay round never ended: {pending:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        proxy.heal();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !sent(2).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "Q-2 not sent after the heal"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::timeout(Duration::from_secs(10), relay.stop())
            .await
            .expect("the relay did not stop");
        let got = take(&channel, &queue, 2, Duration::from_secs(5)).await;
        let bodies: Vec<String> = got
            .iter()
            .map(|m| String::from_utf8_lossy(&m.delivery.data).into_owned())
            .collect();
        assert!(
            bodies.contains(&"Q-1".to_owned()) && bodies.contains(&"Q-2".to_owned()),
            "{bodies:?}"
        );
    }
}

// --- 3. Webhooks: a redirect is not a delivery ----------------------------

mod webhook_redirect {
    use super::*;
    use axum::Router;
    use axum::http::{StatusCode, header};
    use axum::routing::any;

    /// A POST answered 301 is not delivered (the client would have turned
    /// it into a body-less GET to the new location): the message is parked
    /// with the reason, and the redirect target never hears of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_webhook_answered_with_a_redirect_is_not_delivered() {
        let reached = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&reached);
        let app = Router::new()
            .route(
                "/hook",
                any(|| async {
                    (
                        StatusCode::MOVED_PERMANENTLY,
                        [(header::LOCATION, "/final")],
                    )
                }),
            )
            .route(
                "/final",
                any(move || {
                    let counter = Arc::clone(&counter);
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        StatusCode::OK
                    }
                }),
            );
        let addr = serve(app).await;
        let store = pg_store(&pg_url(), &unique("edge_keys")).await;
        let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("edge_ob")).expect("table");
        outbox.migrate(store.pool()).await.expect("migrate");
        let hook = format!("http://{addr}/hook");
        enqueue_for(&store, &outbox, "W-1", move |_| {
            vec![OutboxMessage::webhook(&hook, b"{\"paid\":true}".to_vec())]
        })
        .await;
        let relay = Relay::builder(store.pool().clone(), outbox.clone())
            .publisher(WebhookPublisher::new(b"secret".to_vec()).unwrap())
            .backoff(Duration::from_millis(50), Duration::from_millis(100))
            .max_attempts(3)
            .build()
            .expect("relay");
        let (pool, ob) = (store.pool().clone(), outbox.clone());
        relay_until(relay, Duration::from_secs(30), async || {
            let s = ob.stats(&pool).await.expect("stats");
            s.rows(Status::Pending) == 0
        })
        .await;
        let stats = outbox.stats(store.pool()).await.expect("stats");
        assert_eq!(stats.rows(Status::Sent), 0, "a redirect is not a delivery");
        let dead = outbox
            .list(store.pool(), Status::Dead, 10)
            .await
            .expect("list");
        assert_eq!(dead.len(), 1);
        let error = dead[0].last_error.clone().unwrap_or_default();
        assert!(error.contains("301"), "{error}");
        assert_eq!(
            reached.load(Ordering::SeqCst),
            0,
            "no request followed the redirect"
        );
    }
}

// --- 4. Message faults at COMMIT are dead-lettered, not waited on ---------

mod commit_faults {
    use super::*;
    use onceonly::Header;
    use onceonly::amqp::{AmqpConsumer, CancellationToken};
    use onceonly_integration_tests::amqp::{
        Msg, connect, declare_queue, depth, header, publish, take, url,
    };

    /// Books a seat: the seat is unique, checked only at COMMIT (a
    /// deferred constraint). `SWALLOW` runs a failing statement, ignores
    /// the error and returns Ok, leaving the transaction aborted.
    fn booking()
    -> impl onceonly::Handler<sqlx::Postgres, Input = Json<serde_json::Value>, Output = ()> {
        handler_fn(
            |tx: Tx<sqlx::Postgres>, Json(v): Json<serde_json::Value>| async move {
                let no = v["no"].as_str().unwrap_or_default().to_owned();
                let seat = v["seat"].as_str().unwrap_or_default().to_owned();
                let mut conn = tx.lock().await?;
                if no == "SWALLOW" {
                    let failed = sqlx::query("INSERT INTO no_such_table VALUES (1)")
                        .execute(&mut *conn)
                        .await;
                    assert!(failed.is_err());
                    return Ok(());
                }
                sqlx::query("INSERT INTO seats (no, seat) VALUES ($1, $2)")
                    .bind(&no)
                    .bind(&seat)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            },
        )
    }

    /// A message whose writes violate a deferred unique constraint at
    /// COMMIT, and one whose handler swallowed an error, are retried per
    /// the policy and dead-lettered; the queue drains and every other
    /// message takes effect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn commit_time_faults_are_retried_then_dead_lettered() {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        let store = seats_store("edgecommit").await;
        let queue = unique("edge_commit");
        let (_conn, channel) = connect().await;
        declare_queue(&channel, &queue).await;
        let mut messages = Vec::new();
        for i in 0..20 {
            let no = format!("B-{i:02}");
            messages.push(Msg::new(
                serde_json::json!({ "no": no, "seat": format!("s{i}") }).to_string(),
            ));
        }
        // Seat s3 again, under another key: refused at COMMIT.
        messages.push(Msg::new(
            serde_json::json!({ "no": "TAKEN", "seat": "s3" }).to_string(),
        ));
        messages.push(Msg::new(
            serde_json::json!({ "no": "SWALLOW", "seat": "x" }).to_string(),
        ));
        publish(&channel, &queue, &messages).await;
        let run = AmqpConsumer::builder(
            onceonly::Engine::builder(store.clone())
                .key_expr("json:/no")
                .retry(
                    onceonly::RetryPolicy::default()
                        .max_attempts(3)
                        .initial_delay(Duration::from_millis(100))
                        .without_jitter(),
                ),
        )
        .url(url())
        .queue(&queue)
        .exit_when_idle(Duration::from_secs(3))
        .build()
        .expect("consumer")
        .run_until(booking(), CancellationToken::new());
        let stats = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("the consumer waited on a message fault instead of dead-lettering it")
            .expect("consumer failed");
        assert_eq!(stats.consumer.processed, 20, "{stats:?}");
        assert_eq!(stats.consumer.dead_lettered, 2, "{stats:?}");
        let letters = take(&channel, &format!("{queue}.dlq"), 2, Duration::from_secs(5)).await;
        let mut seen: Vec<(String, Option<String>, Option<String>)> = letters
            .iter()
            .map(|m| {
                let v: serde_json::Value = serde_json::from_slice(&m.delivery.data).expect("json");
                (
                    v["no"].as_str().unwrap_or_default().to_owned(),
                    header(&m.delivery.properties, Header::Reason.name()),
                    header(&m.delivery.properties, Header::Attempts.name()),
                )
            })
            .collect();
        seen.sort();
        assert_eq!(
            seen,
            vec![
                (
                    "SWALLOW".to_owned(),
                    Some("handler_error".to_owned()),
                    Some("3".to_owned())
                ),
                (
                    "TAKEN".to_owned(),
                    Some("handler_error".to_owned()),
                    Some("3".to_owned())
                ),
            ]
        );
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM seats")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(rows, 20);
        assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    }
}

/// Over HTTP, writes refused at COMMIT are the request's fault: `409
/// commit-refused`, not a `503` that invites the client to retry the same
/// doomed request for ever; the key stays free.
mod commit_faults_http {
    use super::*;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use onceonly::http::IdempotencyLayer;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_whose_writes_fail_at_commit_is_409() {
        let store = seats_store("edgehttp").await;
        let book = |tx: onceonly::http::Tx<sqlx::Postgres>, body: String| async move {
            let Ok(mut conn) = tx.lock().await else {
                return StatusCode::INTERNAL_SERVER_ERROR;
            };
            let done =
                sqlx::query("INSERT INTO seats (no, seat) VALUES (gen_random_uuid()::text, $1)")
                    .bind(body)
                    .execute(&mut *conn)
                    .await;
            if done.is_ok() {
                StatusCode::CREATED
            } else {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        let layer = IdempotencyLayer::idempotency_key(store.clone(), "seats")
            .build()
            .expect("layer");
        let addr = serve(Router::new().route("/book", post(book).layer(layer))).await;
        let client = reqwest::Client::new();
        let send = |key: &'static str| {
            client
                .post(format!("http://{addr}/book"))
                .header("Idempotency-Key", key)
                .body("s1")
                .send()
        };
        assert_eq!(send("first").await.expect("first").status(), 201);
        let second = send("second").await.expect("second");
        assert_eq!(second.status(), 409);
        let problem: serde_json::Value = second.json().await.expect("problem json");
        assert_eq!(problem["type"], "urn:onceonly:problem:commit-refused");
        let seats: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM seats")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(seats, 1);
    }
}

// --- 5. The relay holds no transaction while it publishes -----------------

mod relay_no_tx {
    use super::*;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use onceonly_integration_tests::{mysql_store, mysql_url};

    /// While the relay waits 10 s for a slow webhook, claims and outbox
    /// enqueues commit: the relay holds no lock across the network.
    async fn a_slow_webhook_does_not_block_claims<S>(store: S, outbox: Outbox<S::Db>)
    where
        S: SqlStore,
        S::Db: OutboxBackend,
    {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        let arrived = Arc::new(tokio::sync::Notify::new());
        let answered = Arc::new(AtomicBool::new(false));
        let (a, b) = (Arc::clone(&arrived), Arc::clone(&answered));
        let app = Router::new().route(
            "/slow",
            post(move || {
                let (arrived, answered) = (Arc::clone(&a), Arc::clone(&b));
                async move {
                    arrived.notify_one();
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    answered.store(true, Ordering::SeqCst);
                    StatusCode::OK
                }
            }),
        );
        let addr = serve(app).await;
        outbox.migrate(store.pool()).await.expect("migrate");
        let hook = format!("http://{addr}/slow");
        let to_hook =
            |hook: String| move |_: &str| vec![OutboxMessage::webhook(&hook, b"{}".to_vec())];
        enqueue_for(&store, &outbox, "S-1", to_hook(hook.clone())).await;
        let relay = Relay::builder(store.pool().clone(), outbox.clone())
            .publisher(
                WebhookPublisher::with_timeout(b"k".to_vec(), Duration::from_secs(20)).unwrap(),
            )
            .poll_interval(Duration::from_millis(20))
            .build()
            .expect("relay")
            .spawn();
        tokio::time::timeout(Duration::from_secs(10), arrived.notified())
            .await
            .expect("the relay never called the webhook");
        // The relay is now waiting on the network. Claims go on.
        for i in 0..3 {
            enqueue_for(
                &store,
                &outbox,
                &format!("S-{}", i + 2),
                to_hook(hook.clone()),
            )
            .await;
        }
        assert!(
            !answered.load(Ordering::SeqCst),
            "the claims waited for the webhook's answer"
        );
        relay.stop().await;
    }

    /// SQLite has one writer: a relay holding it would make every claim
    /// `BUSY`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_slow_webhook_does_not_block_claims_on_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            onceonly_integration_tests::sqlite_store(&dir.path().join("relay.db"), "onceonly_keys")
                .await;
        a_slow_webhook_does_not_block_claims(store, Outbox::new()).await;
    }

    /// MariaDB: the relay's `FOR UPDATE SKIP LOCKED` scan takes row and
    /// gap locks under REPEATABLE READ.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_slow_webhook_does_not_block_claims_on_mariadb() {
        let store = mysql_store(&mysql_url(), &unique("edge_keys")).await;
        let outbox = Outbox::on_table(&unique("edge_ob")).expect("table");
        a_slow_webhook_does_not_block_claims(store, outbox).await;
    }
}

// --- 6. Smaller edges -------------------------------------------------------

mod smaller {
    use super::*;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use onceonly::PgStore;
    use onceonly::http::{IdempotencyLayer, OnStoreError};

    /// Starting and stopping a PostgreSQL relay leaves no listener behind
    /// holding a pool connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_relay_gives_its_listener_connection_back() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&pg_url())
            .await
            .expect("PostgreSQL: start it with scripts/services");
        let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("edge_ob")).expect("table");
        outbox.migrate(&pool).await.expect("migrate");
        for _ in 0..4 {
            let relay = Relay::builder(pool.clone(), outbox.clone())
                .publisher(WebhookPublisher::new(b"k".to_vec()).unwrap())
                .build()
                .expect("relay")
                .spawn();
            tokio::time::sleep(Duration::from_millis(300)).await;
            relay.stop().await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let conn = pool.acquire().await;
        assert!(conn.is_ok(), "stopped relays still hold the pool: {conn:?}");
    }

    /// A legal 48-byte table name would make `onceonly_outbox_<table>` too
    /// long a NOTIFY channel; enqueueing still works and wakes the relay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_outbox_table_name_still_enqueues() {
        let mut table = unique("edge_long");
        while table.len() < 48 {
            table.push('x');
        }
        table.truncate(48);
        let store = pg_store(&pg_url(), &unique("edge_keys")).await;
        let outbox = Outbox::<sqlx::Postgres>::on_table(&table).expect("a legal name");
        outbox.migrate(store.pool()).await.expect("migrate");
        enqueue_for(&store, &outbox, "L-1", |no| {
            vec![OutboxMessage::webhook(
                "http://127.0.0.1:9/x",
                no.as_bytes().to_vec(),
            )]
        })
        .await;
        let stats = outbox.stats(store.pool()).await.expect("stats");
        assert_eq!(stats.rows(Status::Pending), 1);
        sqlx::query(&format!("DROP TABLE \"{table}\""))
            .execute(store.pool())
            .await
            .expect("drop");
    }

    /// A pool exhausted by the service's own requests (waiting for a key
    /// another request holds) is not an unreachable database: a fail-open
    /// layer answers 503 and runs no second copy of the request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn fail_open_runs_no_second_copy_when_the_pool_is_exhausted() {
        let pool = onceonly::store::pool_options::<sqlx::Postgres>()
            .max_connections(1)
            .acquire_timeout(Duration::from_millis(500))
            .connect(&pg_url())
            .await
            .expect("PostgreSQL: start it with scripts/services");
        let store = PgStore::new(pool)
            .with_table(&unique("edge_keys"))
            .expect("table");
        store.migrate().await.expect("migrate");
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let slow = move |tx: Option<onceonly::http::Tx<sqlx::Postgres>>| {
            let runs = Arc::clone(&counted);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1_500)).await;
                drop(tx);
                StatusCode::CREATED
            }
        };
        let layer = IdempotencyLayer::idempotency_key(store, "slow")
            .on_store_error(OnStoreError::FailOpen)
            .build()
            .expect("layer");
        let addr = serve(Router::new().route("/pay", post(slow).layer(layer))).await;
        let client = reqwest::Client::new();
        let send = || {
            client
                .post(format!("http://{addr}/pay"))
                .header("Idempotency-Key", "held")
                .body("{}")
                .send()
        };
        let first = tokio::spawn(send());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = send().await.expect("second");
        let first = first.await.unwrap().expect("first");
        assert_eq!(first.status(), 201);
        assert_ne!(second.status(), 201, "a second copy ran");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "one effect");
    }
}
