//! No wait is unbounded: a Kafka handler stuck forever on one record must
//! not hold a rebalance or a shutdown hostage. Both return within the drain
//! timeout; the stuck record's transaction rolls back, its offset stays
//! uncommitted, and the next owner processes it exactly once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceonly::kafka::{CancellationToken, KafkaConsumer, KafkaConsumerBuilder};
use onceonly::{Delivery, Handler, HandlerError, Json, PgStore, SqlStore};
use onceonly_integration_tests::demo::ledger::{self, Payment, Receipt};
use onceonly_integration_tests::kafka::{Record, committed, create_topic, pg_schema, produce};
use onceonly_integration_tests::ledger::{Expected, assert_exact, rows};
use onceonly_integration_tests::{pay, pg_store, unique};
use sqlx::Postgres;

/// The examples' ledger, except that the first run for `STUCK` never ends
/// (after writing: its transaction holds the claim).
#[derive(Default)]
struct Hangs {
    hang_once: AtomicBool,
    hanging: AtomicUsize,
}

#[async_trait]
impl Handler<Postgres> for Hangs {
    type Input = Json<Payment>;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::Postgres>,
        Json(p): Json<Payment>,
        _: &Delivery,
    ) -> Result<Receipt, HandlerError> {
        let mut conn = tx.lock().await?;
        let receipt = ledger::postgres::record(&mut conn, &p).await?;
        if p.out_trade_no == "STUCK" && self.hang_once.swap(false, Ordering::SeqCst) {
            self.hanging.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
        Ok(receipt)
    }
}

const DRAIN: Duration = Duration::from_secs(2);

struct Setup {
    topic: String,
    group: String,
    store: PgStore,
    expected: Expected,
    ends: std::collections::BTreeMap<i32, i64>,
}

async fn setup(name: &str) -> Setup {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique(name);
    create_topic(&topic, 2).await;
    create_topic(&format!("{topic}.dlt"), 1).await;
    let url = pg_schema(name).await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let mut expected = Expected::new();
    let mut records = Vec::new();
    for i in 0..40 {
        let no = if i == 5 {
            "STUCK".to_owned()
        } else {
            format!("{name}-{i:03}")
        };
        // STUCK's account is its own: its hung transaction holds that
        // account's row lock, which would (rightly) hold up others too.
        let account = if i == 5 {
            "acct-stuck".to_owned()
        } else {
            format!("acct-{}", i % 7)
        };
        records.push(
            Record::new(no.clone(), pay(&no, 10 + i).account(&account)).to_partition(i as i32 % 2),
        );
        expected.insert(no, (account, 10 + i));
    }
    let ends = produce(&topic, &records).await;
    Setup {
        group: unique("stuck"),
        topic,
        store,
        expected,
        ends,
    }
}

fn member(s: &Setup) -> KafkaConsumerBuilder<PgStore> {
    KafkaConsumer::builder(
        onceonly::Engine::builder(s.store.clone()).key_expr("json:/out_trade_no"),
    )
    .brokers(onceonly_integration_tests::kafka::brokers())
    .group_id(&s.group)
    .topic(&s.topic)
    .drain_timeout(DRAIN)
    .consumer_config("session.timeout.ms", "6000")
}

async fn wait_until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_committed_to_end(s: &Setup) {
    let got = committed(&s.group, &s.topic, 2);
    for (p, end) in &s.ends {
        assert_eq!(got.get(p), Some(end), "partition {p}: {got:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_with_a_stuck_handler_returns_within_the_drain_timeout() {
    let s = setup("kstop").await;
    let handler = Arc::new(Hangs::default());
    handler.hang_once.store(true, Ordering::SeqCst);
    let stop = CancellationToken::new();
    let run = tokio::spawn(
        member(&s)
            .build()
            .unwrap()
            .run_until(Arc::clone(&handler), stop.clone()),
    );
    let pool = s.store.pool().clone();
    let h = Arc::clone(&handler);
    wait_until("the handler hangs", Duration::from_secs(60), async || {
        h.hanging.load(Ordering::SeqCst) == 1
    })
    .await;
    // The other partition finishes; STUCK's partition waits behind it.
    wait_until(
        "the other partition drains",
        Duration::from_secs(60),
        async || rows(&pool).await >= 20,
    )
    .await;
    let asked = Instant::now();
    stop.cancel();
    tokio::time::timeout(DRAIN + Duration::from_secs(10), run)
        .await
        .expect("shutdown hung behind the stuck handler")
        .unwrap()
        .expect("consumer failed");
    let took = asked.elapsed();
    assert!(
        took < DRAIN + Duration::from_secs(8),
        "shutdown took {took:?}"
    );

    // The stuck record was abandoned uncommitted: the next run processes it once.
    let run = member(&s)
        .exit_when_idle(Duration::from_secs(3))
        .build()
        .unwrap()
        .run_until(Arc::clone(&handler), CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("restart did not drain")
        .unwrap();
    assert_exact(s.store.pool(), &s.expected).await;
    assert_committed_to_end(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_with_a_stuck_handler_completes_within_the_drain_timeout() {
    let s = setup("kjoin").await;
    let handler = Arc::new(Hangs::default());
    handler.hang_once.store(true, Ordering::SeqCst);
    let a = tokio::spawn(
        member(&s)
            .exit_when_idle(Duration::from_secs(4))
            .build()
            .unwrap()
            .run_until(Arc::clone(&handler), CancellationToken::new()),
    );
    let h = Arc::clone(&handler);
    wait_until("the handler hangs", Duration::from_secs(60), async || {
        h.hanging.load(Ordering::SeqCst) == 1
    })
    .await;
    // A second member joins: the first must give its partitions up (the
    // revoke aborts the stuck worker after the drain timeout), and whoever
    // owns STUCK's partition next processes it.
    let b = tokio::spawn(
        member(&s)
            .exit_when_idle(Duration::from_secs(4))
            .build()
            .unwrap()
            .run_until(Arc::clone(&handler), CancellationToken::new()),
    );
    let pool = s.store.pool().clone();
    let total = s.expected.len() as i64;
    wait_until(
        "every record, STUCK included, after the rebalance",
        Duration::from_secs(60),
        async || rows(&pool).await >= total,
    )
    .await;
    for (name, run) in [("first", a), ("second", b)] {
        tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .unwrap_or_else(|_| panic!("{name} member did not finish"))
            .unwrap()
            .unwrap();
    }
    assert_exact(s.store.pool(), &s.expected).await;
    assert_committed_to_end(&s);
}
