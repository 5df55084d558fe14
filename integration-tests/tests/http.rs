//! The HTTP layer with a real HTTP client against a bound server, on
//! PostgreSQL and on SQLite: the `payment_webhook` example's app, plus
//! test-only routes for failures, panics, binary bodies and outages.

use onceonly_integration_tests::demo::webhook_app;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use onceonly::http::{IdempotencyLayer, InFlight, OnStoreError, Principal, SignatureCheck, Tx};
use onceonly::{KeySpec, PgStore, SqlStore, SqliteStore};
use onceonly_integration_tests::pay;
use reqwest::Client;

/// Serves `app` on an ephemeral port; returns its base URL.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
}

/// Test "authentication": the `x-tenant` header becomes the principal.
async fn tenant(mut req: Request, next: Next) -> Response {
    if let Some(t) = req.headers().get("x-tenant").and_then(|v| v.to_str().ok()) {
        let principal = Principal(t.to_owned());
        req.extensions_mut().insert(principal);
    }
    next.run(req).await
}

fn is_problem(r: &reqwest::Response) -> bool {
    r.headers()["content-type"] == "application/problem+json"
}

async fn post_order(c: &Client, base: &str, key: Option<&str>, body: &str) -> reqwest::Response {
    let mut req = c
        .post(format!("{base}/orders"))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    req.send().await.unwrap()
}

/// Counts handler runs; fails (500) on the first run, panics for
/// `{"panic":true}`, answers a binary body otherwise.
#[derive(Default)]
struct Flaky {
    runs: AtomicUsize,
}

macro_rules! http_suite {
    ($module:ident, $db:ty, $store:ty, $app:ident, $make_store:expr, $down_store:expr, $conflicts:expr) => {
        mod $module {
            use super::*;

            async fn store() -> $store {
                let store: $store = $make_store.await;
                webhook_app::$app::migrate(&store).await.unwrap();
                store
            }

            async fn app(store: &$store, secret: Option<String>) -> String {
                let app =
                    webhook_app::$app::router(store.clone(), secret, webhook_app::orders_layer)
                        .unwrap()
                        .layer(middleware::from_fn(tenant));
                serve(app).await
            }

            async fn count(store: &$store, table: &str) -> i64 {
                sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {table}"))
                    .fetch_one(store.pool())
                    .await
                    .unwrap()
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_replay_is_byte_identical_and_marked() {
                let store = store().await;
                let base = app(&store, None).await;
                let c = Client::new();
                let key = uuid::Uuid::new_v4().to_string();
                let body = r#"{"account":"alice","amount":500}"#;
                let first = post_order(&c, &base, Some(&key), body).await;
                assert_eq!(first.status(), 201);
                assert!(first.headers().get("idempotent-replayed").is_none());
                let first_type = first.headers()["content-type"].clone();
                let first_body = first.bytes().await.unwrap();
                // Same payload with keys reordered: still the same request.
                let again = post_order(
                    &c,
                    &base,
                    Some(&key),
                    r#"{ "amount": 500, "account": "alice" }"#,
                )
                .await;
                assert_eq!(again.status(), 201);
                assert_eq!(again.headers()["idempotent-replayed"], "true");
                assert_eq!(again.headers()["content-type"], first_type);
                assert_eq!(
                    again.bytes().await.unwrap(),
                    first_body,
                    "byte-identical replay"
                );
                assert_eq!(count(&store, "orders").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn bad_keys_and_reused_keys_are_problems() {
                let store = store().await;
                let base = app(&store, None).await;
                let c = Client::new();
                let body = r#"{"account":"bob","amount":5}"#;
                let missing = post_order(&c, &base, None, body).await;
                assert_eq!(missing.status(), 400);
                assert!(is_problem(&missing));
                let text = missing.text().await.unwrap();
                assert!(
                    text.contains("urn:onceonly:problem:missing-idempotency-key"),
                    "{text}"
                );
                let long = "k".repeat(300);
                let too_long = post_order(&c, &base, Some(&long), body).await;
                assert_eq!(too_long.status(), 400);
                assert!(is_problem(&too_long));
                let key = uuid::Uuid::new_v4().to_string();
                assert_eq!(post_order(&c, &base, Some(&key), body).await.status(), 201);
                let reused =
                    post_order(&c, &base, Some(&key), r#"{"account":"bob","amount":6}"#).await;
                assert_eq!(reused.status(), 422);
                assert!(is_problem(&reused));
                assert_eq!(count(&store, "orders").await, 1);

                // UUID keys required: a non-UUID is refused before anything runs.
                let uuid_only = webhook_app::$app::router(store.clone(), None, |e| {
                    webhook_app::orders_layer(e.key(KeySpec::uuid_header("Idempotency-Key")))
                })
                .unwrap();
                let base = serve(uuid_only).await;
                let r = post_order(&c, &base, Some("not-a-uuid"), body).await;
                assert_eq!(r.status(), 400);
                assert!(is_problem(&r));
                assert_eq!(count(&store, "orders").await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn fifty_concurrent_requests_with_one_key_create_one_order() {
                let store = store().await;
                let base = app(&store, None).await;
                let c = Client::new();
                let key = uuid::Uuid::new_v4().to_string();
                let sends = (0..50).map(|_| {
                    let (c, base, key) = (c.clone(), base.clone(), key.clone());
                    async move {
                        let r =
                            post_order(&c, &base, Some(&key), r#"{"account":"carol","amount":9}"#)
                                .await;
                        let replayed = r.headers().get("idempotent-replayed").is_some();
                        let retry_after = r.headers().get("retry-after").is_some();
                        (
                            r.status().as_u16(),
                            replayed,
                            retry_after,
                            r.bytes().await.unwrap(),
                        )
                    }
                });
                let results = futures_util::future::join_all(sends).await;
                let originals: Vec<_> = results.iter().filter(|r| r.0 == 201 && !r.1).collect();
                assert_eq!(originals.len(), 1, "exactly one request ran the handler");
                for (status, replayed, retry_after, body) in &results {
                    match status {
                        201 => assert_eq!(body, &originals[0].3, "replays carry the original body"),
                        409 => assert!(*retry_after && !replayed, "409 carries Retry-After"),
                        other => panic!("unexpected status {other}"),
                    }
                }
                assert_eq!(count(&store, "orders").await, 1, "exactly one order row");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn failures_store_nothing_and_the_retry_succeeds() {
                let store = store().await;
                sqlx::query("CREATE TABLE IF NOT EXISTS attempts (n INTEGER NOT NULL)")
                    .execute(store.pool())
                    .await
                    .unwrap();
                let flaky = Arc::new(Flaky::default());
                let f = Arc::clone(&flaky);
                let handler = move |tx: Tx<$db>, body: Bytes| {
                    let f = Arc::clone(&f);
                    async move {
                        let run = f.runs.fetch_add(1, Ordering::SeqCst);
                        let mut tx = tx.lock().await.unwrap();
                        sqlx::query("INSERT INTO attempts (n) VALUES (1)")
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        if body.as_ref() == br#"{"panic":true}"# {
                            panic!("handler bug");
                        }
                        if run == 0 {
                            return (StatusCode::BAD_GATEWAY, "upstream down").into_response();
                        }
                        (
                            StatusCode::OK,
                            [("content-type", "application/octet-stream")],
                            Bytes::from_static(&[0, 159, 146, 150, 255, 10]),
                        )
                            .into_response()
                    }
                };
                let layer = IdempotencyLayer::idempotency_key(store.clone(), "flaky")
                    .build()
                    .unwrap();
                let base = serve(Router::new().route("/pay", post(handler).layer(layer))).await;
                let c = Client::new();
                let send = |body: &'static str, key: &'static str| {
                    c.post(format!("{base}/pay"))
                        .header("Idempotency-Key", key)
                        .body(body)
                        .send()
                };
                let r = send("{}", "k-5xx").await.unwrap();
                assert_eq!(r.status(), 502);
                assert_eq!(count(&store, "attempts").await, 0, "5xx rolled back");
                let r = send("{}", "k-5xx").await.unwrap();
                assert_eq!(r.status(), 200, "the retry runs again and succeeds");
                let body = r.bytes().await.unwrap();
                assert_eq!(&body[..], &[0, 159, 146, 150, 255, 10]);
                let replay = send("{}", "k-5xx").await.unwrap();
                assert_eq!(replay.headers()["content-type"], "application/octet-stream");
                assert_eq!(
                    replay.bytes().await.unwrap(),
                    body,
                    "binary body replayed byte for byte"
                );
                assert_eq!(count(&store, "attempts").await, 1);
                assert_eq!(flaky.runs.load(Ordering::SeqCst), 2);

                let r = send(r#"{"panic":true}"#, "k-panic").await.unwrap();
                assert_eq!(r.status(), 500);
                assert_eq!(count(&store, "attempts").await, 1, "panic rolled back");

                // 4xx is not stored by default: a corrected retry with the
                // same key goes through.
                let base_app = app(&store, None).await;
                let key = uuid::Uuid::new_v4().to_string();
                let bad = post_order(
                    &c,
                    &base_app,
                    Some(&key),
                    r#"{"account":"dan","amount":-1}"#,
                )
                .await;
                assert_eq!(bad.status(), 400);
                let ok =
                    post_order(&c, &base_app, Some(&key), r#"{"account":"dan","amount":1}"#).await;
                assert_eq!(ok.status(), 201);
            }

            /// Optimistic requests (`IdempotencyLayerBuilder::optimistic`):
            /// a retry is replayed byte for byte, a reused key with another payload is 422, 50
            /// concurrent copies of one key leave one order (the losers
            /// roll back and replay, or get 409 while it is in flight), a
            /// slow copy whose twin committed meanwhile replays the twin's
            /// answer, and a 5xx stores nothing.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn optimistic_requests_replay_conflict_and_commit_once() {
                let store = store().await;
                let app = webhook_app::$app::router(store.clone(), None, |e| {
                    webhook_app::orders_layer(e.optimistic(true))
                })
                .unwrap()
                .layer(middleware::from_fn(tenant));
                let base = serve(app).await;
                let c = Client::new();
                let orders_before = count(&store, "orders").await;
                let key = uuid::Uuid::new_v4().to_string();
                let body = r#"{"account":"olga","amount":70}"#;
                let first = post_order(&c, &base, Some(&key), body).await;
                assert_eq!(first.status(), 201);
                assert!(first.headers().get("idempotent-replayed").is_none());
                let first_body = first.bytes().await.unwrap();
                let again = post_order(&c, &base, Some(&key), body).await;
                assert_eq!(again.status(), 201);
                assert_eq!(again.headers()["idempotent-replayed"], "true");
                assert_eq!(
                    again.bytes().await.unwrap(),
                    first_body,
                    "byte-identical replay"
                );
                let reused =
                    post_order(&c, &base, Some(&key), r#"{"account":"olga","amount":71}"#).await;
                assert_eq!(reused.status(), 422);
                assert!(is_problem(&reused));
                assert_eq!(count(&store, "orders").await, orders_before + 1);

                let key = uuid::Uuid::new_v4().to_string();
                let sends = (0..50).map(|_| {
                    let (c, base, key) = (c.clone(), base.clone(), key.clone());
                    async move {
                        let r =
                            post_order(&c, &base, Some(&key), r#"{"account":"pia","amount":9}"#)
                                .await;
                        let replayed = r.headers().get("idempotent-replayed").is_some();
                        (r.status().as_u16(), replayed, r.bytes().await.unwrap())
                    }
                });
                let results = futures_util::future::join_all(sends).await;
                let originals: Vec<_> = results.iter().filter(|r| r.0 == 201 && !r.1).collect();
                assert_eq!(
                    originals.len(),
                    1,
                    "exactly one request committed: {results:?}"
                );
                for (status, _, body) in &results {
                    match status {
                        201 => {
                            assert_eq!(body, &originals[0].2, "replays carry the committed body")
                        }
                        409 => {}
                        other => panic!("unexpected status {other}"),
                    }
                }
                assert_eq!(
                    count(&store, "orders").await,
                    orders_before + 2,
                    "one order per key"
                );

                // A slow request and its retry 200 ms later: both run, the
                // first commits, the retry rolls back and replays it.
                sqlx::query("CREATE TABLE IF NOT EXISTS slow_opt (n INTEGER NOT NULL)")
                    .execute(store.pool())
                    .await
                    .unwrap();
                let ran = Arc::new(AtomicUsize::new(0));
                let r2 = Arc::clone(&ran);
                let slow = move |tx: Tx<$db>| {
                    let ran = Arc::clone(&r2);
                    async move {
                        let n = ran.fetch_add(1, Ordering::SeqCst);
                        let mut tx = tx.lock().await.unwrap();
                        sqlx::query("INSERT INTO slow_opt (n) VALUES (1)")
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        tokio::time::sleep(Duration::from_millis(600)).await;
                        if n > 0 {
                            return (StatusCode::BAD_GATEWAY, "second copy").into_response();
                        }
                        (StatusCode::CREATED, "made").into_response()
                    }
                };
                let layer = IdempotencyLayer::idempotency_key(
                    onceonly::Engine::builder(store.clone()).optimistic(true),
                    "slow-opt",
                )
                .in_flight(InFlight::WaitThenReplay {
                    bound: Duration::from_secs(5),
                })
                .build()
                .unwrap();
                let slow_base = serve(Router::new().route("/slow", post(slow).layer(layer))).await;
                let send = || {
                    c.post(format!("{slow_base}/slow"))
                        .header("Idempotency-Key", "same")
                        .body("{}")
                        .send()
                };
                let first = tokio::spawn(send());
                tokio::time::sleep(Duration::from_millis(200)).await;
                let second = send().await.unwrap();
                let first = first.await.unwrap().unwrap();
                assert_eq!(first.status(), 201);
                assert_eq!(
                    second.status(),
                    201,
                    "the copy that failed after its twin committed gets the twin's answer"
                );
                assert_eq!(second.headers()["idempotent-replayed"], "true");
                assert_eq!(second.text().await.unwrap(), "made");
                // Both ran unless the machine held the retry back until the
                // first had committed (then its look-up answered it).
                assert!(ran.load(Ordering::SeqCst) >= 1);
                assert_eq!(
                    count(&store, "slow_opt").await,
                    1,
                    "the copy's write rolled back"
                );
                let r = send().await.unwrap();
                assert_eq!(r.headers()["idempotent-replayed"], "true");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn tenants_never_see_each_others_responses() {
                let store = store().await;
                let base = app(&store, None).await;
                let c = Client::new();
                let key = uuid::Uuid::new_v4().to_string();
                let send = |tenant: &'static str, amount: i64| {
                    c.post(format!("{base}/orders"))
                        .header("Idempotency-Key", &key)
                        .header("x-tenant", tenant)
                        .header("content-type", "application/json")
                        .body(format!(r#"{{"account":"{tenant}","amount":{amount}}}"#))
                        .send()
                };
                let a: serde_json::Value = send("tenant-a", 1).await.unwrap().json().await.unwrap();
                let b = send("tenant-b", 2).await.unwrap();
                assert_eq!(b.status(), 201);
                assert!(
                    b.headers().get("idempotent-replayed").is_none(),
                    "B's first request is not a replay of A's"
                );
                let b: serde_json::Value = b.json().await.unwrap();
                assert_ne!(a["id"], b["id"]);
                let a_again = send("tenant-a", 1).await.unwrap();
                assert_eq!(a_again.headers()["idempotent-replayed"], "true");
                let a_again: serde_json::Value = a_again.json().await.unwrap();
                assert_eq!(a_again, a);
                assert_eq!(count(&store, "orders").await, 2);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn payment_callbacks_dedupe_json_and_form_and_check_signatures() {
                let store = store().await;
                let secret = "whsec-test-0123456789".to_owned();
                let base = app(&store, Some(secret.clone())).await;
                let c = Client::new();
                let check = SignatureCheck::new(secret).unwrap();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs();
                let post_signed = |body: String, content_type: &'static str, signature: String| {
                    c.post(format!("{base}/webhooks/payments"))
                        .header("content-type", content_type)
                        .header("x-signature", signature)
                        .body(body)
                        .send()
                };
                let json = pay("W-1", 300).account("erin").to_string();
                for _ in 0..3 {
                    let r = post_signed(
                        json.clone(),
                        "application/json",
                        check.sign(now, json.as_bytes()),
                    )
                    .await
                    .unwrap();
                    assert_eq!(r.status(), 200);
                    assert_eq!(r.text().await.unwrap(), "success");
                }
                let form = "out_trade_no=W-2&account=erin&amount=40".to_owned();
                for _ in 0..2 {
                    let r = post_signed(
                        form.clone(),
                        "application/x-www-form-urlencoded",
                        check.sign(now, form.as_bytes()),
                    )
                    .await
                    .unwrap();
                    assert_eq!(r.status(), 200);
                    assert_eq!(r.text().await.unwrap(), "success");
                }
                // Bad and stale signatures: 401, nothing stored.
                let evil = pay("W-3", 999).account("mallory").to_string();
                let forged = SignatureCheck::new("a-guessed-secret-0")
                    .unwrap()
                    .sign(now, evil.as_bytes());
                let r = post_signed(evil.clone(), "application/json", forged)
                    .await
                    .unwrap();
                assert_eq!(r.status(), 401);
                assert!(is_problem(&r));
                let stale = check.sign(now - 3_600, evil.as_bytes());
                assert_eq!(
                    post_signed(evil.clone(), "application/json", stale)
                        .await
                        .unwrap()
                        .status(),
                    401
                );
                let unsigned = c
                    .post(format!("{base}/webhooks/payments"))
                    .body(evil.clone())
                    .send()
                    .await
                    .unwrap();
                assert_eq!(unsigned.status(), 401);

                let charges = sqlx::query_as::<_, (String, i64)>(
                    "SELECT out_trade_no, amount FROM ledger ORDER BY out_trade_no",
                )
                .fetch_all(store.pool())
                .await
                .unwrap();
                assert_eq!(
                    charges,
                    vec![("W-1".to_owned(), 300), ("W-2".to_owned(), 40)]
                );
                let keys: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM onceonly_keys WHERE scope = 'payment-callbacks'",
                )
                .fetch_one(store.pool())
                .await
                .unwrap();
                assert_eq!(keys, 2, "refused callbacks left no claim");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_request_in_flight_gets_409_or_waits_and_replays() {
                let store = store().await;
                sqlx::query("CREATE TABLE IF NOT EXISTS slow (n INTEGER NOT NULL)")
                    .execute(store.pool())
                    .await
                    .unwrap();
                let slow = |tx: Tx<$db>| async move {
                    let mut tx = tx.lock().await.unwrap();
                    sqlx::query("INSERT INTO slow (n) VALUES (1)")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    (StatusCode::CREATED, "made")
                };
                let c = Client::new();
                for (policy, path) in [
                    (
                        InFlight::Conflict {
                            wait: Duration::from_millis(50),
                            retry_after_secs: 2,
                        },
                        "/conflict",
                    ),
                    (
                        InFlight::WaitThenReplay {
                            bound: Duration::from_secs(5),
                        },
                        "/wait",
                    ),
                ] {
                    let layer = IdempotencyLayer::idempotency_key(
                        store.clone(),
                        path.trim_start_matches('/'),
                    )
                    .in_flight(policy)
                    .build()
                    .unwrap();
                    let base = serve(Router::new().route(path, post(slow).layer(layer))).await;
                    let send = || {
                        c.post(format!("{base}{path}"))
                            .header("Idempotency-Key", "same")
                            .body("{}")
                            .send()
                    };
                    let first = tokio::spawn(send());
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let second = send().await.unwrap();
                    let first = first.await.unwrap().unwrap();
                    assert_eq!(first.status(), 201);
                    let expect_conflict = path == "/conflict" && $conflicts;
                    if expect_conflict {
                        assert_eq!(second.status(), 409, "{path}");
                        assert_eq!(second.headers()["retry-after"], "2");
                        assert!(is_problem(&second));
                    } else {
                        assert_eq!(second.status(), 201, "{path}: waited and replayed");
                        assert_eq!(second.headers()["idempotent-replayed"], "true");
                        assert_eq!(second.text().await.unwrap(), "made");
                    }
                }
                assert_eq!(count(&store, "slow").await, 2, "one run per route");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn keys_bind_to_their_request_and_redirects_are_stored() {
                let store = store().await;
                sqlx::query("CREATE TABLE IF NOT EXISTS made (n INTEGER NOT NULL)")
                    .execute(store.pool())
                    .await
                    .unwrap();
                let make = |tx: Tx<$db>| async move {
                    let mut tx = tx.lock().await.unwrap();
                    sqlx::query("INSERT INTO made (n) VALUES (1)")
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    (StatusCode::SEE_OTHER, [("location", "/made/1")], "")
                };
                let open = |tx: Option<Tx<$db>>| async move { format!("tx: {}", tx.is_some()) };
                let keyed = IdempotencyLayer::idempotency_key(store.clone(), "made")
                    .build()
                    .unwrap();
                let optional = IdempotencyLayer::idempotency_key(store.clone(), "optional")
                    .key_optional()
                    .build()
                    .unwrap();
                let app = Router::new()
                    .route("/a", post(make))
                    .route("/b", post(make))
                    .layer(keyed)
                    .route("/open", post(open).layer(optional));
                let base = serve(app).await;
                let c = reqwest::Client::builder()
                    .redirect(reqwest::redirect::Policy::none())
                    .build()
                    .unwrap();
                let send = |path: &str, key: &str| {
                    c.post(format!("{base}{path}"))
                        .header("Idempotency-Key", key)
                        .body("{}")
                        .send()
                };
                let r = send("/a", "k").await.unwrap();
                assert_eq!(r.status(), 303);
                assert_eq!(count(&store, "made").await, 1, "a 303's writes are kept");
                // A structured-field string is the same key.
                let r = send("/a", "\"k\"").await.unwrap();
                assert_eq!(r.status(), 303);
                assert_eq!(r.headers()["idempotent-replayed"], "true");
                assert_eq!(r.headers()["location"], "/made/1");
                let r = send("/b", "k").await.unwrap();
                assert_eq!(
                    r.status(),
                    422,
                    "same key on another path is another request"
                );
                assert_eq!(count(&store, "made").await, 1);
                let r = c
                    .post(format!("{base}/open"))
                    .body("{}")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(
                    r.text().await.unwrap(),
                    "tx: false",
                    "no key: passes without dedup"
                );
                let r = c
                    .post(format!("{base}/open"))
                    .header("Idempotency-Key", "o")
                    .body("{}")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.text().await.unwrap(), "tx: true");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_retried_notification_with_new_timestamps_is_acked_a_tampered_one_is_not() {
                let store = store().await;
                let base = app(&store, None).await;
                let c = Client::new();
                let form = |time: &str, amount: i64| {
                    c.post(format!("{base}/webhooks/payments"))
                        .header(
                            "content-type",
                            "Application/X-WWW-Form-Urlencoded; charset=utf-8",
                        )
                        .body(format!(
                            "out_trade_no=N-1&account=gus&amount={amount}&notify_time={time}"
                        ))
                        .send()
                };
                for time in [
                    "2026-11-29 10:00:00",
                    "2026-11-29 10:00:05",
                    "2026-11-29 10:01:00",
                ] {
                    let r = form(time, 70).await.unwrap();
                    assert_eq!(r.status(), 200);
                    assert_eq!(r.text().await.unwrap(), "success");
                }
                let tampered = form("2026-11-29 10:02:00", 7_000).await.unwrap();
                assert_eq!(tampered.status(), 422);
                let rows: Vec<(String, i64)> =
                    sqlx::query_as("SELECT out_trade_no, amount FROM ledger")
                        .fetch_all(store.pool())
                        .await
                        .unwrap();
                assert_eq!(rows, vec![("N-1".to_owned(), 70)]);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn body_limits_and_store_outages() {
                let store = store().await;
                let limited = webhook_app::$app::router(store.clone(), None, |e| {
                    webhook_app::orders_layer(e).max_request_body(64)
                })
                .unwrap();
                let base = serve(limited).await;
                let c = Client::new();
                let big = format!(r#"{{"account":"{}","amount":1}}"#, "x".repeat(200));
                let r = post_order(&c, &base, Some("k-big"), &big).await;
                assert_eq!(r.status(), 413);
                assert!(is_problem(&r));

                // The store is unreachable: fail closed with 503.
                let down: $store = $down_store.await;
                let base = serve(
                    webhook_app::$app::router(down.clone(), None, webhook_app::orders_layer)
                        .unwrap(),
                )
                .await;
                let r =
                    post_order(&c, &base, Some("k-down"), r#"{"account":"f","amount":1}"#).await;
                assert_eq!(r.status(), 503);
                assert!(is_problem(&r));
                assert!(r.headers().get("retry-after").is_some());

                // Fail open: the handler runs without dedup (and without a Tx).
                let ran = Arc::new(AtomicUsize::new(0));
                let r2 = Arc::clone(&ran);
                let handler = move |tx: Option<Tx<$db>>| {
                    let ran = Arc::clone(&r2);
                    async move {
                        ran.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::OK, format!("tx: {}", tx.is_some()))
                    }
                };
                let layer = IdempotencyLayer::idempotency_key(down, "open")
                    .on_store_error(OnStoreError::FailOpen)
                    .build()
                    .unwrap();
                let base = serve(Router::new().route("/x", post(handler).layer(layer))).await;
                for _ in 0..2 {
                    let r = c
                        .post(format!("{base}/x"))
                        .header("Idempotency-Key", "k")
                        .body("{}")
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    assert_eq!(r.text().await.unwrap(), "tx: false");
                }
                assert_eq!(
                    ran.load(Ordering::SeqCst),
                    2,
                    "fail-open runs every request"
                );
            }
        }
    };
}

async fn pg() -> PgStore {
    let url = onceonly_integration_tests::kafka::pg_schema("http").await;
    onceonly_integration_tests::pg_store(&url, "onceonly_keys").await
}

async fn pg_down() -> PgStore {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .unwrap();
    PgStore::new(pool)
}

async fn sqlite() -> SqliteStore {
    let dir = tempfile::tempdir().unwrap().keep();
    onceonly_integration_tests::sqlite_store(&dir.join("http.db"), "onceonly_keys").await
}

async fn sqlite_down() -> SqliteStore {
    let store = sqlite().await;
    store.pool().close().await;
    store
}

// Postgres answers a request in flight with 409 after the short lock wait;
// SQLite serializes writers, so a concurrent request waits in BEGIN and
// then replays.
http_suite!(
    on_postgres,
    sqlx::Postgres,
    PgStore,
    postgres,
    pg(),
    pg_down(),
    true
);
http_suite!(
    on_sqlite,
    sqlx::Sqlite,
    SqliteStore,
    sqlite,
    sqlite(),
    sqlite_down(),
    false
);

/// A fenced route (`POST /orders/status`, keyed by `Idempotency-Key`,
/// fenced per order by `version`): an older request after a newer one is
/// answered `200` stale and changes nothing; a 4xx answer is never stored
/// (even with `store_client_errors`), so a refused newer request does not
/// make the older ones stale; a request without a key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_route_answers_older_requests_stale_and_never_fences_on_a_refusal() {
    let store = sqlite().await;
    sqlx::query("CREATE TABLE order_status (id TEXT PRIMARY KEY, status TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    async fn set_status(
        tx: Tx<sqlx::Sqlite>,
        axum::Json(v): axum::Json<serde_json::Value>,
    ) -> Response {
        if v["status"] == "bogus" {
            return (StatusCode::UNPROCESSABLE_ENTITY, "bogus status").into_response();
        }
        let Ok(mut conn) = tx.lock().await else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        sqlx::query(
            "INSERT INTO order_status (id, status) VALUES (?, ?) \
             ON CONFLICT (id) DO UPDATE SET status = excluded.status",
        )
        .bind(v["order"].as_str())
        .bind(v["status"].as_str())
        .execute(&mut *conn)
        .await
        .map_or_else(
            |_| StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            |_| StatusCode::OK.into_response(),
        )
    }
    let fence = onceonly::FenceSpec::new(
        KeySpec::json_field("/order"),
        onceonly::OrderSpec::integer("/version"),
    );
    let layer = IdempotencyLayer::idempotency_key(
        onceonly::Engine::builder(store.clone()).fence(fence),
        "statuses",
    )
    .store_client_errors(true)
    .build()
    .unwrap();
    let base = serve(Router::new().route("/orders/status", post(set_status).layer(layer))).await;
    let c = Client::new();
    let send = |key: &'static str, version: i64, status: &'static str| {
        let (c, base) = (c.clone(), base.clone());
        async move {
            c.post(format!("{base}/orders/status"))
                .header("content-type", "application/json")
                .header("Idempotency-Key", key)
                .body(
                    serde_json::json!({"order": "o-1", "version": version, "status": status})
                        .to_string(),
                )
                .send()
                .await
                .unwrap()
        }
    };
    let status = || async {
        sqlx::query_scalar::<_, String>("SELECT status FROM order_status WHERE id = 'o-1'")
            .fetch_one(store.pool())
            .await
            .unwrap()
    };
    assert_eq!(send("k-2", 2, "paid").await.status(), StatusCode::OK);
    // Version 3 is refused by the handler: not stored, the fence stays at 2.
    assert_eq!(
        send("k-3", 3, "bogus").await.status(),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // Version 1 is older than 2: stale, 200, nothing changed (twice).
    for _ in 0..2 {
        let r = send("k-1", 1, "created").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["onceonly-stale"], "true");
    }
    assert_eq!(status().await, "paid");
    // Version 3 fixed and sent again with its key: applied.
    assert_eq!(send("k-3", 3, "refunded").await.status(), StatusCode::OK);
    assert_eq!(status().await, "refunded");
    // Without an entity, and the key new: refused.
    let r = c
        .post(format!("{base}/orders/status"))
        .header("content-type", "application/json")
        .header("Idempotency-Key", "k-x")
        .body(r#"{"status":"paid"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(is_problem(&r));
}
