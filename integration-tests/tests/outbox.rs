//! The transactional outbox on real services: messages commit with the
//! handler's claim or not at all, leave with deterministic ids, keep their
//! order per key with several relays, and survive a broker or an endpoint
//! that fails for a while.

use onceonly::Header;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceonly::outbox::{
    Kind, Outbox, OutboxBackend, OutboxMessage, Outgoing, PublishError, Publisher, Relay, Status,
    WebhookPublisher,
};
use onceonly::{
    Delivery, Engine, HandlerError, Json, Outcome, RetryPolicy, SqlStore, Tx, handler_fn,
};
use onceonly_integration_tests::kafka::{self as k, header};
use onceonly_integration_tests::mock::MockKafka;
use onceonly_integration_tests::{Pay, mysql_store, mysql_url, pay, pg_store, pg_url, unique};

/// A handler that enqueues one settled message per payment (two for
/// account `twice`), and fails after enqueueing for account `broken`.
fn settling<DB: OutboxBackend>(
    outbox: Outbox<DB>,
    topic: String,
) -> impl onceonly::Handler<DB, Input = Json<Pay>, Output = ()> {
    handler_fn(move |tx: Tx<DB>, Json(p): Json<Pay>| {
        let (outbox, topic) = (outbox.clone(), topic.clone());
        async move {
            let mut conn = tx.lock().await?;
            let account = p.account.clone().unwrap_or_default();
            let body = serde_json::json!({ "out_trade_no": p.out_trade_no, "amount": p.amount });
            let message = OutboxMessage::kafka(&topic, account.clone(), body.to_string());
            outbox.enqueue(&mut conn, message.clone()).await?;
            if account == "twice" {
                outbox.enqueue(&mut conn, message).await?;
            }
            if account == "broken" {
                return Err(HandlerError::permanent("refused after enqueueing"));
            }
            Ok(())
        }
    })
}

/// Counts rows of `table` matching `condition` on PostgreSQL.
async fn pg_count(pool: &sqlx::PgPool, table: &str, condition: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table} WHERE {condition}"))
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn messages_commit_with_the_claim_and_never_without_it() {
    let store = pg_store(&pg_url(), &unique("obk")).await;
    let table = unique("obx");
    let outbox = Outbox::<sqlx::Postgres>::on_table(&table).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let engine = Engine::builder(store.clone())
        .scope("settle")
        .key_expr("json:/out_trade_no")
        .retry(RetryPolicy::none())
        .build()
        .expect("engine");
    let handler = settling(outbox.clone(), "settled".into());
    let deliveries = [
        pay("P-1", 10).account("a"),
        pay("P-1", 10).account("a"), // duplicate: handler not run
        pay("P-1", 99).account("a"), // conflict: handler not run
        pay("P-2", 20).account("twice"),
        pay("P-3", 30).account("broken"), // rolled back
    ];
    let mut kinds = Vec::new();
    for p in &deliveries {
        let report = engine.process(&handler, &Delivery::new(p.body())).await;
        kinds.push(report.outcome.kind());
    }
    use onceonly::OutcomeKind as K;
    assert_eq!(
        kinds,
        [
            K::Processed,
            K::Duplicate,
            K::Conflict,
            K::Processed,
            K::Failed
        ]
    );
    let pool = store.pool();
    assert_eq!(
        pg_count(pool, &table, "TRUE").await,
        3,
        "P-1 once, P-2 twice, P-3 never"
    );
    let rows = outbox.list(pool, Status::Pending, 10).await.expect("list");
    let ids: HashSet<&str> = rows.iter().map(|r| r.row.message_id.as_str()).collect();
    assert_eq!(ids.len(), 3, "distinct ids per position");
    assert!(rows.iter().all(|r| r.row.causation.is_some()));
    // The ids are the deterministic ones: P-2's two messages are its
    // positions 0 and 1.
    let p2: Vec<&str> = rows
        .iter()
        .filter(|r| r.row.causation.as_deref() == Some("P-2"))
        .map(|r| r.row.message_id.as_str())
        .collect();
    assert_eq!(p2.len(), 2);

    // P-1's record expires and it is processed again: a new request by the
    // retention's promise, so a new message with a new id (the old id
    // would have been dropped by `ON CONFLICT` here, or downstream).
    sqlx::query(&format!(
        "UPDATE {} SET expires_at_ms = 0 WHERE idem_key = 'P-1'",
        store.table()
    ))
    .execute(pool)
    .await
    .expect("expire");
    let again = engine
        .process(&handler, &Delivery::new(deliveries[0].body()))
        .await;
    assert!(
        matches!(again.outcome, Outcome::Processed { .. }),
        "{again:?}"
    );
    let rows = outbox.list(pool, Status::Pending, 10).await.expect("list");
    let p1: HashSet<&str> = rows
        .iter()
        .filter(|r| r.row.causation.as_deref() == Some("P-1"))
        .map(|r| r.row.message_id.as_str())
        .collect();
    assert_eq!(p1.len(), 2, "a new run of P-1, a new message id");
}

/// Records what it published, per ordering key, failing the first
/// `fail_first` attempts, and publishing slowly enough for relays to
/// overlap.
#[derive(Default)]
struct Recorder {
    /// `(key, row id, message id, global publish sequence)`.
    seen: Mutex<Vec<(String, i64, String, u64)>>,
    fail_first: Mutex<usize>,
    delay: Duration,
}

#[async_trait]
impl Publisher for Recorder {
    fn kind(&self) -> Kind {
        Kind::Kafka
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        {
            let mut fail = self.fail_first.lock().expect("lock");
            if *fail > 0 {
                *fail -= 1;
                return Err(PublishError::retryable("broker unavailable"));
            }
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let row = message.row;
        let key =
            String::from_utf8(row.message_key.clone().unwrap_or_default()).unwrap_or_default();
        let id = message
            .headers
            .iter()
            .find(|(n, _)| n == Header::MessageId.name())
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.seen.lock().expect("lock").push((key, row.id, id, seq));
        Ok(())
    }
}

/// Enqueues `per_key` messages for each of `keys` keys, in one claim per
/// message, and returns the outbox.
async fn fill<DB: OutboxBackend, S: SqlStore<Db = DB>>(
    store: &S,
    outbox: &Outbox<DB>,
    keys: usize,
    per_key: usize,
) {
    fill_as(store, outbox, "F", keys, per_key).await;
}

/// [`fill`] with payments `PREFIX-key-i`.
async fn fill_as<DB: OutboxBackend, S: SqlStore<Db = DB>>(
    store: &S,
    outbox: &Outbox<DB>,
    prefix: &str,
    keys: usize,
    per_key: usize,
) {
    let engine = Engine::builder(store.clone())
        .scope("fill")
        .key_expr("json:/out_trade_no")
        .build()
        .expect("engine");
    let handler = settling(outbox.clone(), "orders".into());
    for i in 0..per_key {
        for key in 0..keys {
            let p = pay(&format!("{prefix}-{key}-{i}"), i as i64).account(&format!("k{key}"));
            let report = engine.process(&handler, &Delivery::new(p.body())).await;
            assert!(
                matches!(report.outcome, Outcome::Processed { .. }),
                "{report:?}"
            );
        }
    }
}

/// Waits until `n` messages of `outbox` are sent; fails after `timeout`
/// with `what`.
async fn wait_sent<DB: OutboxBackend>(
    outbox: &Outbox<DB>,
    pool: &sqlx::Pool<DB>,
    n: i64,
    timeout: Duration,
    what: &str,
) {
    let deadline = Instant::now() + timeout;
    loop {
        let sent = outbox.stats(pool).await.expect("stats").rows(Status::Sent);
        if sent >= n {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {sent}/{n} sent");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs relays over `pool` until the outbox has no pending row; returns
/// what each recorded.
async fn relay_all<DB: OutboxBackend>(
    pool: &sqlx::Pool<DB>,
    outbox: &Outbox<DB>,
    recorders: &[Arc<Recorder>],
    total: usize,
) {
    let handles: Vec<_> = recorders
        .iter()
        .map(|r| {
            Relay::builder(pool.clone(), outbox.clone())
                .publisher(Arc::clone(r))
                .batch(3)
                .poll_interval(Duration::from_millis(20))
                .backoff(Duration::from_millis(20), Duration::from_millis(100))
                .build()
                .expect("relay")
                .spawn()
        })
        .collect();
    wait_sent(
        outbox,
        pool,
        total as i64,
        Duration::from_secs(60),
        "relays did not finish",
    )
    .await;
    for handle in handles {
        handle.stop().await;
    }
}

/// Checks that every message was published exactly once (no crash here)
/// and each key's messages in enqueue order, across all recorders (by the
/// global publish sequence).
fn assert_once_in_order(recorders: &[Arc<Recorder>], keys: usize, per_key: usize) {
    let mut all: Vec<(String, i64, String, u64)> = Vec::new();
    let mut per_recorder = Vec::new();
    for r in recorders {
        let seen = r.seen.lock().expect("lock").clone();
        per_recorder.push(seen.len());
        all.extend(seen);
    }
    assert_eq!(
        all.len(),
        keys * per_key,
        "published once each: {per_recorder:?}"
    );
    let ids: HashSet<&str> = all.iter().map(|(_, _, id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), all.len(), "every message id once");
    all.sort_by_key(|(_, _, _, seq)| *seq);
    let mut last: BTreeMap<&str, i64> = BTreeMap::new();
    for (key, row, _, _) in &all {
        if let Some(prev) = last.insert(key, *row) {
            assert!(prev < *row, "key {key}: row {row} published after {prev}");
        }
    }
}

/// Two relays drain `keys` × `per_key` messages; every message leaves
/// once, each key in order, and both relays take part.
async fn two_relays<DB: OutboxBackend, S: SqlStore<Db = DB>>(
    store: S,
    keys: usize,
    per_key: usize,
) {
    let outbox = Outbox::<DB>::on_table(&unique("obx")).expect("table");
    two_relays_on(store, outbox, keys, per_key).await;
}

async fn two_relays_on<DB: OutboxBackend, S: SqlStore<Db = DB>>(
    store: S,
    outbox: Outbox<DB>,
    keys: usize,
    per_key: usize,
) {
    outbox.migrate(store.pool()).await.expect("migrate");
    fill(&store, &outbox, keys, per_key).await;
    let recorders: Vec<Arc<Recorder>> = (0..2)
        .map(|_| {
            Arc::new(Recorder {
                delay: Duration::from_millis(3),
                ..Recorder::default()
            })
        })
        .collect();
    relay_all(store.pool(), &outbox, &recorders, keys * per_key).await;
    assert_once_in_order(&recorders, keys, per_key);
    let both = recorders
        .iter()
        .all(|r| !r.seen.lock().expect("lock").is_empty());
    assert!(both, "both relays took part");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_keep_per_key_order_on_postgres() {
    two_relays(pg_store(&pg_url(), &unique("obk")).await, 6, 15).await;
}

/// The generations layout (partitioned, purged by rotation): the relays'
/// statements run on it as on a plain table.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_keep_per_key_order_on_postgres_generations() {
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx"))
        .expect("table")
        .generations(true);
    two_relays_on(pg_store(&pg_url(), &unique("obk")).await, outbox, 6, 15).await;
}

/// Rows per generation of a generations outbox, `[g0, g1]`.
async fn generation_rows(pool: &sqlx::PgPool, table: &str) -> [i64; 2] {
    [
        pg_count(pool, &format!("{table}_g0"), "true").await,
        pg_count(pool, &format!("{table}_g1"), "true").await,
    ]
}

/// On the generations layout, sent rows go by rotation (a truncate of the
/// older generation), once none of them was sent after the cut-off; the
/// older generation's pending and dead rows move to the newer one with
/// their ids and are still sent. A plain outbox with rows is upgraded in
/// place: its rows stay, its ids go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sent_rows_go_by_rotation_and_unsent_rows_move_on() {
    for upgrade in [false, true] {
        let store = pg_store(&pg_url(), &unique("obk")).await;
        let pool = store.pool().clone();
        let table = unique("obx");
        let plain = Outbox::<sqlx::Postgres>::on_table(&table).expect("table");
        let generations = plain.clone().generations(true);
        if upgrade {
            // A plain outbox with 12 rows, 2 of them sent, then upgraded.
            plain.migrate(&pool).await.expect("plain migrate");
            fill(&store, &plain, 3, 4).await;
            sqlx::query(&format!(
                "UPDATE {table} SET status = 1, sent_at_ms = 1 WHERE id IN \
                 (SELECT id FROM {table} ORDER BY id LIMIT 2)"
            ))
            .execute(&pool)
            .await
            .unwrap();
            generations.migrate(&pool).await.expect("upgrade");
            assert_eq!(generation_rows(&pool, &table).await, [12, 0]);
            // The plain enqueue is refused by the partitioned table.
            let refused = sqlx::query(&format!(
                "INSERT INTO {table} (message_id, scope, kind, destination, order_key, headers, \
                 payload, next_attempt_at_ms, created_at_ms) \
                 VALUES ('x', 's', 'kafka', 't', 'k', '[]', '', 0, 0) \
                 ON CONFLICT (message_id) DO NOTHING"
            ))
            .execute(&pool)
            .await;
            assert!(
                refused.is_err(),
                "ON CONFLICT (message_id) on a generations table"
            );
        } else {
            generations.migrate(&pool).await.expect("migrate");
        }
        let before: i64 = pg_count(&pool, &table, "true").await;
        let max_id: i64 = sqlx::query_scalar(&format!("SELECT COALESCE(max(id), 0) FROM {table}"))
            .fetch_one(&pool)
            .await
            .unwrap();
        // 12 more messages, in generation 0 (current).
        fill_as(&store, &generations, "G", 3, 4).await;
        let min_new: i64 = sqlx::query_scalar(&format!(
            "SELECT min(id) FROM {table} WHERE scope = 'fill' AND id > $1"
        ))
        .bind(max_id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(min_new > max_id, "ids go on after the upgrade");
        let total = before + 12;
        // Everything pending is sent, then one row is parked as dead and
        // two more are enqueued (pending).
        let recorder = Arc::new(Recorder::default());
        let pending = pg_count(&pool, &table, "status = 0").await as usize;
        relay_all(
            &pool,
            &generations,
            &[Arc::clone(&recorder)],
            total as usize,
        )
        .await;
        assert_eq!(recorder.seen.lock().unwrap().len(), pending);
        let engine = Engine::builder(store.clone())
            .scope("late")
            .key_expr("json:/out_trade_no")
            .build()
            .unwrap();
        let handler = settling(generations.clone(), "orders".into());
        for key in ["L-1", "L-2", "L-3"] {
            let report = engine
                .process(&handler, &Delivery::new(pay(key, 1).body()))
                .await;
            assert!(
                matches!(report.outcome, Outcome::Processed { .. }),
                "{report:?}"
            );
        }
        sqlx::query(&format!(
            "UPDATE {table} SET status = 2 WHERE id = (SELECT max(id) FROM {table})"
        ))
        .execute(&pool)
        .await
        .unwrap();
        let in_g0 = generation_rows(&pool, &table).await[0];
        assert_eq!(in_g0, total + 3);

        // A cut-off before the sends: the (empty) generation 1 rotates in;
        // generation 0, sent after the cut-off, stays.
        generations.purge_sent(&pool, 0, 1000).await.unwrap();
        generations.purge_sent(&pool, 0, 1000).await.unwrap();
        assert_eq!(generation_rows(&pool, &table).await, [in_g0, 0]);
        // A cut-off after them: generation 0 goes, its 3 unsent rows move.
        let later = i64::MAX / 2;
        generations.purge_sent(&pool, later, 1000).await.unwrap();
        assert_eq!(generation_rows(&pool, &table).await, [0, 3]);
        let deleted: i64 = sqlx::query_scalar(
            "SELECT COALESCE(n_tup_del, 0) FROM pg_stat_user_tables WHERE relid = to_regclass($1)",
        )
        .bind(format!("{table}_g0"))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            deleted <= 3,
            "only the unsent rows were deleted one by one: {deleted}"
        );
        // The moved rows are still sent: the pending ones now, the dead one
        // once retried.
        assert_eq!(generations.retry_dead(&pool, None).await.unwrap(), 1);
        relay_all(&pool, &generations, &[Arc::clone(&recorder)], 3).await;
        let seen = recorder.seen.lock().unwrap().clone();
        assert_eq!(seen.len(), pending + 3, "every message once");
        let ids: HashSet<&str> = seen.iter().map(|(_, _, id, _)| id.as_str()).collect();
        assert_eq!(ids.len(), seen.len(), "no message twice");
        sqlx::query(&format!("DROP TABLE {table}, {table}_generation"))
            .execute(&pool)
            .await
            .ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_keep_per_key_order_on_mariadb() {
    two_relays(mysql_store(&mysql_url(), &unique("obk")).await, 6, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_relay_publishes_in_order_after_failures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = onceonly_integration_tests::sqlite_store(&dir.path().join("o.db"), "keys").await;
    let outbox = Outbox::<sqlx::Sqlite>::new();
    outbox.migrate(store.pool()).await.expect("migrate");
    let (keys, per_key) = (3, 5);
    fill(&store, &outbox, keys, per_key).await;
    let recorder = Arc::new(Recorder {
        fail_first: Mutex::new(4),
        ..Recorder::default()
    });
    relay_all(
        store.pool(),
        &outbox,
        &[Arc::clone(&recorder)],
        keys * per_key,
    )
    .await;
    assert_once_in_order(&[recorder], keys, per_key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_relay_sends_every_message_with_its_id_and_waits_out_a_broker_outage() {
    let mock = MockKafka::start(1);
    let topic = unique("settled");
    mock.create_topic(&topic, 2);
    let store = pg_store(&pg_url(), &unique("obk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx")).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let engine = Engine::builder(store.clone())
        .scope("settle")
        .key_expr("json:/out_trade_no")
        .build()
        .expect("engine");
    let handler = settling(outbox.clone(), topic.clone());
    // The broker is down while the first half is enqueued and relayed.
    mock.broker_down(1);
    let publisher = onceonly::outbox::KafkaPublisher::with_config(
        rdkafka::ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap())
            .set("message.timeout.ms", "2000"),
    )
    .expect("producer");
    let relay = Relay::builder(store.pool().clone(), outbox.clone())
        .publisher(publisher)
        .backoff(Duration::from_millis(100), Duration::from_millis(500))
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("relay")
        .spawn();
    let n = 40;
    let mut expected = BTreeMap::new();
    for i in 0..n {
        let p = pay(&format!("K-{i}"), i).account(&format!("acct-{}", i % 4));
        if i == n / 2 {
            tokio::time::sleep(Duration::from_secs(3)).await;
            let pending = outbox
                .stats(store.pool())
                .await
                .expect("stats")
                .rows(Status::Pending);
            assert_eq!(pending, n / 2, "rows wait while the broker is down");
            mock.broker_up(1);
        }
        let report = engine.process(&handler, &Delivery::new(p.body())).await;
        assert!(
            matches!(report.outcome, Outcome::Processed { .. }),
            "{report:?}"
        );
        expected.insert(format!("K-{i}"), format!("acct-{}", i % 4));
    }
    wait_sent(
        &outbox,
        store.pool(),
        n,
        Duration::from_secs(60),
        "not all sent",
    )
    .await;
    let stats = relay.stop().await;
    assert_eq!(stats.dead, 0, "{stats:?}");
    let read = k::read_all_on(
        mock.bootstrap(),
        &topic,
        2,
        n as usize,
        Duration::from_secs(20),
    );
    let mut by_trade: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in &read {
        use rdkafka::Message as _;
        let body: serde_json::Value =
            serde_json::from_slice(m.payload().unwrap_or_default()).expect("json");
        let no = body["out_trade_no"].as_str().expect("no").to_owned();
        let id = header(m, Header::MessageId.name())
            .expect("message id header")
            .to_owned();
        assert_eq!(header(m, "x-onceonly-causation-id"), Some(no.as_str()));
        let key = String::from_utf8(m.key().unwrap_or_default().to_vec()).expect("key");
        assert_eq!(Some(&key), expected.get(&no), "keyed by account");
        order
            .entry(key)
            .or_default()
            .push(body["amount"].as_i64().expect("amount"));
        by_trade.entry(no).or_default().insert(id);
    }
    assert_eq!(by_trade.len(), n as usize, "every payment settled");
    assert!(
        by_trade.values().all(|ids| ids.len() == 1),
        "one id per payment"
    );
    for (key, amounts) in &order {
        let mut sorted = amounts.clone();
        sorted.sort_unstable();
        sorted.dedup();
        let mut firsts = amounts.clone();
        firsts.dedup();
        assert_eq!(firsts, sorted, "key {key}: in enqueue order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_webhook_receiver_that_fails_times_out_and_recovers_gets_each_notification() {
    use axum::Router;
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::post;

    #[derive(Default)]
    struct Receiver {
        calls: usize,
        applied: BTreeMap<String, Vec<u8>>,
        copies: usize,
    }
    let receiver = Arc::new(Mutex::new(Receiver::default()));
    let secret = b"notify-secret-0123".to_vec();
    let check = onceonly::http::SignatureCheck::new(secret.clone())
        .unwrap()
        .header(axum::http::HeaderName::from_static("x-onceonly-signature"));
    let state = Arc::clone(&receiver);
    let app = Router::new().route(
        "/notify",
        post(move |headers: HeaderMap, body: axum::body::Bytes| {
            let state = Arc::clone(&state);
            let check = check.clone();
            async move {
                let call = {
                    let mut r = state.lock().expect("lock");
                    r.calls += 1;
                    r.calls
                };
                match call % 4 {
                    1 => return StatusCode::SERVICE_UNAVAILABLE,
                    2 => {
                        // Longer than the publisher's timeout.
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                    }
                    _ => {}
                }
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                if check.verify(&headers, &body, now).is_err() {
                    return StatusCode::UNAUTHORIZED;
                }
                let id = headers
                    .get(Header::MessageId.name())
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let mut r = state.lock().expect("lock");
                r.copies += 1;
                r.applied.entry(id).or_insert_with(|| body.to_vec());
                StatusCode::NO_CONTENT
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/notify", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let store = pg_store(&pg_url(), &unique("obk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx")).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let engine = Engine::builder(store.clone())
        .scope("notify")
        .key_expr("json:/out_trade_no")
        .build()
        .expect("engine");
    let notify = {
        let (outbox, url) = (outbox.clone(), url.clone());
        handler_fn(move |tx: Tx<sqlx::Postgres>, Json(p): Json<Pay>| {
            let (outbox, url) = (outbox.clone(), url.clone());
            async move {
                let mut conn = tx.lock().await?;
                let body = serde_json::json!({ "out_trade_no": p.out_trade_no, "status": "paid" });
                outbox
                    .enqueue(&mut conn, OutboxMessage::webhook(url, body.to_string()))
                    .await?;
                Ok(())
            }
        })
    };
    let n = 12;
    for i in 0..n {
        let p = pay(&format!("W-{i}"), 5);
        let report = engine.process(&notify, &Delivery::new(p.body())).await;
        assert!(
            matches!(report.outcome, Outcome::Processed { .. }),
            "{report:?}"
        );
    }
    let relay = Relay::builder(store.pool().clone(), outbox.clone())
        // onceonly's own format, which `SignatureCheck` verifies.
        .publisher(
            WebhookPublisher::with_timeout(secret, Duration::from_millis(500))
                .unwrap()
                .signing(onceonly::outbox::WebhookSigning::Onceonly),
        )
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("relay")
        .spawn();
    wait_sent(
        &outbox,
        store.pool(),
        n,
        Duration::from_secs(90),
        "not all notifications delivered",
    )
    .await;
    let stats = relay.stop().await;
    let r = receiver.lock().expect("lock");
    assert_eq!(
        r.applied.len(),
        n as usize,
        "each notification applied once by id"
    );
    assert!(
        r.calls > n as usize,
        "the receiver failed some calls: {}",
        r.calls
    );
    assert!(stats.failed > 0 && stats.dead == 0, "{stats:?}");
    // A timed-out call may have been applied and retried: copies >= ids,
    // still one effect per id.
    assert!(r.copies >= r.applied.len());
}

/// A loopback webhook receiver at `url`: answers each call after `delay`,
/// with 500 when `fail(body, call)` says so (`call`: the body's calls so
/// far, this one included), else 204; records the bodies it answered 2xx
/// in the order it answered them, each body's calls, and the most calls
/// it had in flight at once.
struct Hooks {
    url: String,
    state: Arc<HookState>,
}

#[derive(Default)]
struct HookState {
    delivered: Mutex<Vec<String>>,
    calls: Mutex<BTreeMap<String, usize>>,
    in_flight: std::sync::atomic::AtomicUsize,
    max_in_flight: std::sync::atomic::AtomicUsize,
}

impl Hooks {
    async fn start(
        fail: impl Fn(&str, usize) -> bool + Send + Sync + 'static,
        delay: Duration,
    ) -> Self {
        use axum::Router;
        use axum::http::StatusCode;
        use axum::routing::post;
        use std::sync::atomic::Ordering::SeqCst;
        let state = Arc::new(HookState::default());
        let fail = Arc::new(fail);
        let shared = Arc::clone(&state);
        let app = Router::new().route(
            "/notify",
            post(move |body: axum::body::Bytes| {
                let (state, fail) = (Arc::clone(&shared), Arc::clone(&fail));
                async move {
                    let body = String::from_utf8_lossy(&body).into_owned();
                    let now = state.in_flight.fetch_add(1, SeqCst) + 1;
                    state.max_in_flight.fetch_max(now, SeqCst);
                    let call = {
                        let mut calls = state.calls.lock().expect("lock");
                        let n = calls.entry(body.clone()).or_default();
                        *n += 1;
                        *n
                    };
                    tokio::time::sleep(delay).await;
                    let status = if fail(&body, call) {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        state.delivered.lock().expect("lock").push(body);
                        StatusCode::NO_CONTENT
                    };
                    state.in_flight.fetch_sub(1, SeqCst);
                    status
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/notify", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { url, state }
    }

    fn delivered(&self) -> Vec<String> {
        self.state.delivered.lock().expect("lock").clone()
    }

    fn calls(&self, body: &str) -> usize {
        self.state
            .calls
            .lock()
            .expect("lock")
            .get(body)
            .copied()
            .unwrap_or(0)
    }

    fn max_in_flight(&self) -> usize {
        self.state
            .max_in_flight
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// An outbox on PostgreSQL with `messages` enqueued, each in its own
/// transaction, in order (without a claim).
async fn webhook_outbox(messages: Vec<OutboxMessage>) -> (sqlx::PgPool, Outbox<sqlx::Postgres>) {
    let store = pg_store(&pg_url(), &unique("obk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx")).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let pool = store.pool().clone();
    for message in messages {
        let mut tx = pool.begin().await.expect("begin");
        outbox
            .enqueue_in(&mut *tx, "notify", message)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    (pool, outbox)
}

/// A webhook relay retrying quickly.
fn webhook_relay(
    pool: &sqlx::PgPool,
    outbox: &Outbox<sqlx::Postgres>,
) -> onceonly::outbox::RelayBuilder<sqlx::Postgres> {
    Relay::builder(pool.clone(), outbox.clone())
        .publisher(WebhookPublisher::new(b"notify-secret".to_vec()).expect("secret"))
        .backoff(Duration::from_millis(50), Duration::from_millis(200))
        .poll_interval(Duration::from_millis(20))
}

/// Issue 46, item 3: webhooks without an order key were ordered per URL,
/// so one merchant's notification that its receiver refused held back
/// every other payment's notification to that URL until it went through.
/// Now each is ordered on its own: the other nine arrive while the first
/// one is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_webhook_does_not_hold_back_the_others_to_its_url() {
    // Merchant m0's notification is refused three times.
    let hooks = Hooks::start(|body, call| body == "m0" && call < 4, Duration::ZERO).await;
    let messages = (0..10)
        .map(|i| OutboxMessage::webhook(&hooks.url, format!("m{i}")))
        .collect();
    let (pool, outbox) = webhook_outbox(messages).await;
    let relay = webhook_relay(&pool, &outbox)
        .build()
        .expect("relay")
        .spawn();
    wait_sent(
        &outbox,
        &pool,
        10,
        Duration::from_secs(60),
        "not every notification was delivered",
    )
    .await;
    let stats = relay.stop().await;
    let delivered = hooks.delivered();
    assert_eq!(delivered.len(), 10, "each delivered once: {delivered:?}");
    assert_eq!(
        delivered.last().map(String::as_str),
        Some("m0"),
        "the refused notification held back the others: {delivered:?}"
    );
    assert_eq!(hooks.calls("m0"), 4);
    for i in 1..10 {
        assert_eq!(hooks.calls(&format!("m{i}")), 1, "m{i} sent once");
    }
    assert_eq!((stats.failed, stats.dead), (3, 0), "{stats:?}");
}

/// Webhooks with one `order_by` key to one URL still arrive in the order
/// they were enqueued, each after the one before it was confirmed, while
/// another key's head is refused and retried; that key's followers wait
/// for it, and nothing else does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn webhooks_of_one_order_key_arrive_in_order_while_another_key_retries() {
    // B-0 is refused twice.
    let hooks = Hooks::start(|body, call| body == "B-0" && call < 3, Duration::ZERO).await;
    let mut messages = Vec::new();
    for i in 0..5 {
        if i < 3 {
            messages.push(OutboxMessage::webhook(&hooks.url, format!("B-{i}")).order_by("B"));
        }
        messages.push(OutboxMessage::webhook(&hooks.url, format!("A-{i}")).order_by("A"));
        messages.push(OutboxMessage::webhook(&hooks.url, format!("u-{i}")));
    }
    let (pool, outbox) = webhook_outbox(messages).await;
    let relay = webhook_relay(&pool, &outbox)
        .build()
        .expect("relay")
        .spawn();
    wait_sent(
        &outbox,
        &pool,
        13,
        Duration::from_secs(60),
        "not every notification was delivered",
    )
    .await;
    let stats = relay.stop().await;
    let delivered = hooks.delivered();
    assert_eq!(delivered.len(), 13, "each delivered once: {delivered:?}");
    let of = |prefix: &str| -> Vec<String> {
        delivered
            .iter()
            .filter(|b| b.starts_with(prefix))
            .cloned()
            .collect()
    };
    assert_eq!(
        of("A-"),
        ["A-0", "A-1", "A-2", "A-3", "A-4"],
        "{delivered:?}"
    );
    assert_eq!(of("B-"), ["B-0", "B-1", "B-2"], "{delivered:?}");
    // B's followers were never sent before B-0 went through.
    assert_eq!((hooks.calls("B-1"), hooks.calls("B-2")), (1, 1));
    assert_eq!(hooks.calls("B-0"), 3);
    // Key A and the unordered ones did not wait for B.
    let b0 = delivered.iter().position(|b| b == "B-0").expect("B-0");
    for other in delivered
        .iter()
        .filter(|b| b.starts_with("A-") || b.starts_with("u-"))
    {
        let at = delivered
            .iter()
            .position(|b| b == other)
            .expect("delivered");
        assert!(at < b0, "{other} waited for B-0: {delivered:?}");
    }
    assert_eq!((stats.failed, stats.dead), (2, 0), "{stats:?}");
}

/// A batch of webhooks to one URL goes out side by side, but never more
/// than `max_in_flight_per_destination` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_has_at_most_its_bound_of_webhooks_in_flight_per_url() {
    let hooks = Hooks::start(|_, _| false, Duration::from_millis(100)).await;
    let n = 40;
    let messages = (0..n)
        .map(|i| OutboxMessage::webhook(&hooks.url, format!("n{i}")))
        .collect();
    let (pool, outbox) = webhook_outbox(messages).await;
    let relay = webhook_relay(&pool, &outbox)
        .max_in_flight_per_destination(4)
        .build()
        .expect("relay")
        .spawn();
    wait_sent(
        &outbox,
        &pool,
        n,
        Duration::from_secs(60),
        "not every notification was delivered",
    )
    .await;
    relay.stop().await;
    assert_eq!(hooks.delivered().len(), n as usize, "each delivered once");
    let max = hooks.max_in_flight();
    assert!(max <= 4, "{max} calls in flight at once, bound 4");
    // Side by side, not one after another (a single order per URL sent
    // them one at a time).
    assert!(max >= 2, "the notifications went one at a time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_relay_wakes_when_a_claim_commits() {
    let store = pg_store(&pg_url(), &unique("obk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx")).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let recorder = Arc::new(Recorder::default());
    // Polling alone would take 60 s.
    let relay = Relay::builder(store.pool().clone(), outbox.clone())
        .publisher(Arc::clone(&recorder))
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("relay")
        .spawn();
    // Let it go idle first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let engine = Engine::builder(store.clone())
        .scope("wake")
        .key_expr("json:/out_trade_no")
        .build()
        .expect("engine");
    let handler = settling(outbox.clone(), "settled".into());
    let mut waits = Vec::new();
    for i in 0..5 {
        let started = Instant::now();
        let p = pay(&format!("N-{i}"), 1).account("a");
        engine.process(&handler, &Delivery::new(p.body())).await;
        while recorder.seen.lock().expect("lock").len() <= i {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the relay did not wake"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        waits.push(started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    relay.stop().await;
    eprintln!("commit to publish: {waits:?}");
}

/// Many messages of few keys through one relay round after another, to
/// tansu (a Kafka record per payment) and RabbitMQ (an AMQP message per
/// payment, one queue per key), with the keys' messages pipelined:
/// consumed back, each key's sequence is strictly increasing, nothing is
/// lost, and a copy beyond the first has the first's message id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipelined_relay_keeps_each_keys_order_on_kafka_and_amqp() {
    use onceonly::outbox::{AmqpPublisher, KafkaPublisher};
    use onceonly_integration_tests::amqp;

    let (keys, per_key) = (4usize, 150usize);
    let topic = unique("ob_order");
    k::create_topic(&topic, 3).await;
    let (_conn, channel) = amqp::connect().await;
    let queues: Vec<String> = (0..keys)
        .map(|k| unique(&format!("ob_order_{k}")))
        .collect();
    for q in &queues {
        amqp::declare_queue(&channel, q).await;
    }
    let store = pg_store(&pg_url(), &unique("obk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx")).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let engine = Engine::builder(store.clone())
        .scope("order")
        .key_expr("json:/out_trade_no")
        .build()
        .expect("engine");
    let handler = {
        let (outbox, topic, queues) = (outbox.clone(), topic.clone(), queues.clone());
        handler_fn(move |tx: Tx<sqlx::Postgres>, Json(p): Json<Pay>| {
            let (outbox, topic, queues) = (outbox.clone(), topic.clone(), queues.clone());
            async move {
                let mut conn = tx.lock().await?;
                let account = p.account.clone().unwrap_or_default();
                let key: usize = account.trim_start_matches('k').parse().unwrap_or(0);
                let body = serde_json::json!({ "key": key, "seq": p.seq }).to_string();
                outbox
                    .enqueue(
                        &mut conn,
                        OutboxMessage::kafka(&topic, account, body.clone()),
                    )
                    .await?;
                outbox
                    .enqueue(&mut conn, OutboxMessage::amqp("", &queues[key], body))
                    .await?;
                Ok(())
            }
        })
    };
    for seq in 0..per_key {
        for key in 0..keys {
            let p = pay(&format!("O-{key}-{seq}"), 1)
                .account(&format!("k{key}"))
                .seq(seq as i64);
            let report = engine.process(&handler, &Delivery::new(p.body())).await;
            assert!(
                matches!(report.outcome, Outcome::Processed { .. }),
                "{report:?}"
            );
        }
    }
    let total = keys * per_key;
    // Rounds of 100 rows: every key has dozens of rows in flight per round.
    let relay = Relay::builder(store.pool().clone(), outbox.clone())
        .publisher(KafkaPublisher::new(&k::brokers()).expect("producer"))
        .publisher(AmqpPublisher::new(amqp::url()))
        .batch(100)
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("relay")
        .spawn();
    wait_sent(
        &outbox,
        store.pool(),
        2 * total as i64,
        Duration::from_secs(90),
        "the relay did not send everything",
    )
    .await;
    let stats = relay.stop().await;
    assert_eq!((stats.failed, stats.dead), (0, 0), "{stats:?}");

    /// Checks one key's arrivals: first copies strictly increasing and
    /// complete, later copies repeats of an id seen before.
    fn check(what: &str, arrivals: &[(String, i64)], per_key: usize) {
        let mut first: BTreeMap<&str, i64> = BTreeMap::new();
        let mut sequence = Vec::new();
        for (id, seq) in arrivals {
            match first.get(id.as_str()) {
                Some(earlier) => assert_eq!(earlier, seq, "{what}: one id, one message"),
                None => {
                    first.insert(id, *seq);
                    sequence.push(*seq);
                }
            }
        }
        let expected: Vec<i64> = (0..per_key as i64).collect();
        assert_eq!(sequence, expected, "{what}: in order, none lost");
    }

    let read = k::read_all(&topic, 3, total, Duration::from_secs(30));
    let mut kafka: BTreeMap<String, Vec<(String, i64)>> = BTreeMap::new();
    for m in &read {
        use rdkafka::Message as _;
        let body: serde_json::Value =
            serde_json::from_slice(m.payload().unwrap_or_default()).expect("json");
        let key = String::from_utf8(m.key().unwrap_or_default().to_vec()).expect("key");
        let id = header(m, Header::MessageId.name()).expect("id").to_owned();
        kafka
            .entry(key)
            .or_default()
            .push((id, body["seq"].as_i64().expect("seq")));
    }
    assert_eq!(kafka.len(), keys, "every key arrived on Kafka");
    for (key, arrivals) in &kafka {
        check(&format!("kafka key {key}"), arrivals, per_key);
    }
    for (key, queue) in queues.iter().enumerate() {
        let got = amqp::take(&channel, queue, per_key, Duration::from_secs(30)).await;
        let arrivals: Vec<(String, i64)> = got
            .iter()
            .map(|m| {
                let body: serde_json::Value =
                    serde_json::from_slice(&m.delivery.data).expect("json");
                let id = m
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.as_str().to_owned())
                    .expect("message id");
                (id, body["seq"].as_i64().expect("seq"))
            })
            .collect();
        check(&format!("amqp key {key}"), &arrivals, per_key);
    }
}

/// A publisher that pipelines like Kafka's or AMQP's: the head of key
/// `k0` fails while it is `failing`, and the messages behind it are
/// confirmed anyway (they were in flight). Records each call's rows.
struct PipelinedFlaky {
    failing: std::sync::atomic::AtomicBool,
    calls: Mutex<Vec<(String, Vec<i64>)>>,
}

#[async_trait]
impl Publisher for PipelinedFlaky {
    fn kind(&self) -> Kind {
        Kind::Kafka
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        let far = Instant::now() + Duration::from_secs(5);
        self.publish_ordered(std::slice::from_ref(message), far)
            .await
            .pop()
            .unwrap_or_else(|| Err(PublishError::retryable("nothing")))
    }

    async fn publish_ordered(
        &self,
        messages: &[Outgoing<'_>],
        _deadline: Instant,
    ) -> Vec<Result<(), PublishError>> {
        let key = messages
            .first()
            .and_then(|m| m.row.message_key.clone())
            .map(|k| String::from_utf8(k).unwrap_or_default())
            .unwrap_or_default();
        let ids = messages.iter().map(|m| m.row.id).collect();
        self.calls.lock().expect("lock").push((key.clone(), ids));
        let fail_head = key == "k0" && self.failing.load(std::sync::atomic::Ordering::SeqCst);
        messages
            .iter()
            .enumerate()
            .map(|(i, _)| {
                if fail_head && i == 0 {
                    Err(PublishError::retryable("the head's request failed"))
                } else {
                    Ok(())
                }
            })
            .collect()
    }
}

/// A failed head blocks its key's followers even when a pipelining
/// publisher got them confirmed: none is marked sent before the head, and
/// once the head goes through they all leave again behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_head_blocks_its_followers_even_when_they_were_confirmed() {
    let store = pg_store(&pg_url(), &unique("obk")).await;
    let outbox = Outbox::<sqlx::Postgres>::on_table(&unique("obx")).expect("table");
    outbox.migrate(store.pool()).await.expect("migrate");
    let (keys, per_key) = (2, 5);
    fill(&store, &outbox, keys, per_key).await;
    let publisher = Arc::new(PipelinedFlaky {
        failing: std::sync::atomic::AtomicBool::new(true),
        calls: Mutex::new(Vec::new()),
    });
    let relay = Relay::builder(store.pool().clone(), outbox.clone())
        .publisher(Arc::clone(&publisher))
        .poll_interval(Duration::from_millis(20))
        .backoff(Duration::from_millis(50), Duration::from_millis(100))
        .build()
        .expect("relay")
        .spawn();
    // k1 goes through; k0's head fails round after round.
    wait_sent(
        &outbox,
        store.pool(),
        per_key as i64,
        Duration::from_secs(20),
        "k1 not sent",
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while publisher
        .calls
        .lock()
        .expect("lock")
        .iter()
        .filter(|(k, _)| k == "k0")
        .count()
        < 3
    {
        assert!(Instant::now() < deadline, "k0's head was not retried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pending = outbox
        .list(store.pool(), Status::Pending, 100)
        .await
        .expect("list");
    assert_eq!(
        pending.len(),
        per_key,
        "none of k0's confirmed followers is marked sent while its head fails"
    );
    let head = pending.iter().map(|r| r.row.id).min().expect("head");
    for r in &pending {
        if r.row.id == head {
            assert!(r.row.attempts >= 2 && r.last_error.is_some(), "{r:?}");
        } else {
            assert_eq!(
                (r.row.attempts, r.last_error.as_deref()),
                (0, None),
                "a follower is not charged with its head's failure"
            );
        }
    }
    publisher
        .failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    wait_sent(
        &outbox,
        store.pool(),
        (keys * per_key) as i64,
        Duration::from_secs(20),
        "k0 not sent after its head healed",
    )
    .await;
    relay.stop().await;
    // Every call for k0 started at its head, with the whole key behind it.
    let calls = publisher.calls.lock().expect("lock");
    for (key, ids) in calls.iter().filter(|(k, _)| k == "k0") {
        assert_eq!(ids.first(), Some(&head), "{key}: {ids:?}");
        assert_eq!(ids.len(), per_key, "{key}: {ids:?}");
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{key}: {ids:?}");
    }
}
