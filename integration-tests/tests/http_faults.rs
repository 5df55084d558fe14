//! The HTTP layer's side of the fault model: contention is never a reason to
//! run a handler without dedup (even with `FailOpen`), and requests whose key
//! is ambiguous are refused with a 4xx problem instead of being guessed.

use onceonly_integration_tests::demo::webhook_app;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use onceonly::http::{IdempotencyLayer, OnStoreError, Tx};
use onceonly::{SqlStore, SqliteStore};
use reqwest::Client;

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

/// A route whose handler holds its key (and its transaction) for 1.5 s,
/// behind a fail-open layer; returns the base URL and the run counter.
async fn slow_fail_open<S: SqlStore>(store: S) -> (String, Arc<AtomicUsize>)
where
    Tx<S::Db>: axum::extract::FromRequestParts<()>,
{
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let slow = move |tx: Option<Tx<S::Db>>| {
        let runs = Arc::clone(&counted);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let held = tx.is_some();
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            drop(tx);
            (StatusCode::CREATED, format!("tx: {held}"))
        }
    };
    let layer = IdempotencyLayer::idempotency_key(store, "slow")
        .on_store_error(OnStoreError::FailOpen)
        .build()
        .unwrap();
    (
        serve(Router::new().route("/pay", post(slow).layer(layer))).await,
        runs,
    )
}

/// Sends the same key twice, the second while the first holds it.
async fn twice(base: &str) -> (reqwest::Response, reqwest::Response) {
    let c = Client::new();
    let send = || {
        c.post(format!("{base}/pay"))
            .header("Idempotency-Key", "held")
            .body("{}")
            .send()
    };
    let first = tokio::spawn(send());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = send().await.unwrap();
    (first.await.unwrap().unwrap(), second)
}

/// SQLite: the second request's `BEGIN IMMEDIATE` gives up after the busy
/// timeout (`SQLITE_BUSY`). That is contention, not an unreachable store:
/// 409, and the handler ran once, even though the layer fails open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_busy_under_fail_open_is_409_not_a_second_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.db");
    onceonly_integration_tests::sqlite_store(&path, "onceonly_keys").await;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(200));
    let pool = onceonly::store::pool_options::<sqlx::Sqlite>()
        .connect_with(options)
        .await
        .unwrap();
    let (base, runs) = slow_fail_open(SqliteStore::new(pool)).await;
    let (first, second) = twice(&base).await;
    assert_eq!(first.status(), 201);
    assert_eq!(first.text().await.unwrap(), "tx: true");
    assert_eq!(second.status(), 409, "a key in flight is contention");
    assert!(second.headers().get("retry-after").is_some());
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one effect");
}

/// PostgreSQL: the claim waits for the holder's row lock, gives up with
/// `55P03`, and answers 409; the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lock_timeout_under_fail_open_is_409_not_a_second_run() {
    let url = onceonly_integration_tests::kafka::pg_schema("httpfo").await;
    let store = onceonly_integration_tests::pg_store(&url, "onceonly_keys").await;
    let (base, runs) = slow_fail_open(store).await;
    let (first, second) = twice(&base).await;
    assert_eq!(first.status(), 201);
    assert_eq!(second.status(), 409);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one effect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ambiguous_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        onceonly_integration_tests::sqlite_store(&dir.path().join("amb.db"), "onceonly_keys").await;
    webhook_app::sqlite::migrate(&store).await.unwrap();
    let base =
        serve(webhook_app::sqlite::router(store.clone(), None, webhook_app::orders_layer).unwrap())
            .await;
    let c = Client::new();

    // Two Idempotency-Key headers: which one is the key?
    let r = c
        .post(format!("{base}/orders"))
        .header("content-type", "application/json")
        .header("Idempotency-Key", "a")
        .header("Idempotency-Key", "b")
        .body(r#"{"account":"x","amount":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["content-type"], "application/problem+json");

    // A form callback whose bytes are not UTF-8: lossy decoding would make
    // `%FF` and `%FE` one key.
    let form = |body: &'static str, ct: &'static str| {
        c.post(format!("{base}/webhooks/payments"))
            .header("content-type", ct)
            .body(body)
            .send()
    };
    let ct = "application/x-www-form-urlencoded";
    let r = form("out_trade_no=%FF&account=a&total_amount=1", ct)
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let problem: serde_json::Value = r.json().await.unwrap();
    assert_eq!(problem["type"], "urn:onceonly:problem:undecodable-form");
    let r = form(
        "out_trade_no=A1&account=a&total_amount=1",
        // GBK and GB18030 decode with feature `providers`; KOI8-R never.
        "application/x-www-form-urlencoded; charset=koi8-r",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 415, "a charset the layer cannot decode");
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM onceonly_keys")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(n, 0, "nothing was claimed for refused requests");
}

/// A handler always slower than the transaction deadline: each request is
/// rolled back and answered `503` (retry later), counted for its key, and
/// the third is refused for good (`500`, problem `deadline`) instead of
/// being answered "retry later" for ever; the key's count then starts
/// over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_always_slower_than_its_deadline_is_refused_after_three_misses() {
    let store = onceonly_integration_tests::pg_store(
        &onceonly_integration_tests::pg_url(),
        &onceonly_integration_tests::unique("http_slow"),
    )
    .await
    .deadlines(onceonly::store::Deadlines::default().transaction(Duration::from_millis(300)));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let slow = move |_tx: Tx<sqlx::Postgres>| {
        let runs = Arc::clone(&counted);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3)).await;
            (StatusCode::CREATED, "late")
        }
    };
    let layer = IdempotencyLayer::idempotency_key(store, "slow-http")
        .build()
        .unwrap();
    let base = serve(Router::new().route("/pay", post(slow).layer(layer))).await;
    let c = Client::new();
    let send = || {
        c.post(format!("{base}/pay"))
            .header("Idempotency-Key", "always-late")
            .body("{}")
            .send()
    };
    for miss in 1..=2 {
        let r = send().await.unwrap();
        assert_eq!(r.status(), 503, "miss {miss}");
    }
    let r = send().await.unwrap();
    assert_eq!(r.status(), 500);
    let problem: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        problem["type"], "urn:onceonly:problem:deadline",
        "{problem}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // The count starts over: the next request runs (and misses) again.
    assert_eq!(send().await.unwrap().status(), 503);
    assert_eq!(runs.load(Ordering::SeqCst), 4);
}

/// Issue 44, defect 3: a handler that answers at once with a body that
/// trickles (a byte every 200 ms for 20 s) must not hold its key, its
/// transaction and a pool connection while the layer reads the body: the
/// read is bounded by the transaction deadline, the request rolled back
/// and answered `503`, and the key is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_response_body_that_trickles_is_bounded_by_the_transaction_deadline() {
    let store = onceonly_integration_tests::pg_store(
        &onceonly_integration_tests::pg_url(),
        &onceonly_integration_tests::unique("http_trickle"),
    )
    .await
    .deadlines(onceonly::store::Deadlines::default().transaction(Duration::from_millis(500)));
    let trickle = move |tx: Tx<sqlx::Postgres>| async move {
        drop(tx);
        let bytes = futures_util::stream::unfold(0u32, |n| async move {
            if n >= 100 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            Some((
                Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"x")),
                n + 1,
            ))
        });
        (StatusCode::OK, axum::body::Body::from_stream(bytes))
    };
    let layer = IdempotencyLayer::idempotency_key(store.clone(), "trickle-http")
        .build()
        .unwrap();
    let base = serve(Router::new().route("/pay", post(trickle).layer(layer))).await;
    let sent = Client::new()
        .post(format!("{base}/pay"))
        .header("Idempotency-Key", "slow-body")
        .body("{}")
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    let r = sent.expect("answered within the deadline, not after the whole body");
    assert_eq!(r.status(), 503);
    let record = store.get("trickle-http", "slow-body").await.unwrap();
    assert!(record.is_none(), "the key was rolled back: {record:?}");
}
