//! A real loopback HTTP "payment provider API" that honours
//! `Idempotency-Key` the way Stripe does, so that tests can prove that a
//! handler's downstream call took effect exactly once.
//!
//! [`ProviderApi::start`] binds `127.0.0.1:0` and serves, with axum in a
//! spawned tokio task, one route until the [`ProviderApi`] is dropped:
//!
//! `POST /v1/refunds` with header `Idempotency-Key` and JSON body
//! `{"payment": "<string>", "amount": <integer>}`. Extra fields are allowed
//! and are part of the body compared between requests under one key (the
//! whole parsed [`serde_json::Value`] is compared, so key order and
//! whitespace do not matter).
//!
//! | Request | Answer | Effect |
//! |---|---|---|
//! | `Idempotency-Key` missing or empty | 400 `{"error":"idempotency_key_missing"}` | none |
//! | body not JSON, not an object, `payment` not a string or `amount` not an `i64` | 400 `{"error":"invalid_request"}` | none |
//! | key never seen | 200 `{"id":"re_<n>","payment":..,"amount":..}` after the [processing delay](ProviderApi::set_delay) | one [`Refund`] appended to the ledger |
//! | key seen with a different body (in flight or completed) | 422 `{"error":"idempotency_key_reused"}` | none |
//! | key seen with the same body, still in flight | 409 `{"error":"idempotency_key_in_use"}` | none |
//! | key seen with the same body, completed | the stored answer, byte for byte, plus header `Idempotent-Replayed: true` | none |
//!
//! While the provider is [down](ProviderApi::set_down), every request is
//! answered 503 `{"error":"unavailable"}` with no effect, and counted in
//! [`ProviderApi::unavailable_answers`].
//!
//! A body mismatch is checked before the in-flight state: a key reused for a
//! different request is a client bug whatever the timing, and the answer does
//! not depend on a race.
//!
//! Refund ids are `re_1`, `re_2`, ... in execution order. An executed refund
//! is stored (ledger entry, answer and request body under its key) and then
//! its key is broadcast to every [`ProviderApi::executed`] receiver.
//!
//! Like a real provider, a refund whose request was admitted completes even if
//! the client goes away while it is processed (a client timeout, a dropped
//! connection): the processing delay and the execution run in a spawned task
//! that the request handler merely awaits, so the work does not depend on the
//! handler being polled to completion. A later retry under the same key and
//! body replays the stored answer. A request whose connection drops before
//! its body was read and its key marked in flight has no effect.
//!
//! All observers ([`ProviderApi::refunds`], [`ProviderApi::requests`], ...)
//! are cheap and synchronous: the state lives behind a [`std::sync::Mutex`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;

/// The request header carrying the idempotency key.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The answer header marking a replayed answer (value `true`).
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";

/// One executed refund, as the provider's ledger records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refund {
    /// The provider's id: `re_<n>`, n = 1, 2, ... in execution order.
    pub id: String,
    /// The refunded payment (the request's `payment`).
    pub payment: String,
    /// The refunded amount (the request's `amount`).
    pub amount: i64,
    /// The `Idempotency-Key` of the request that executed it.
    pub idempotency_key: String,
}

/// What the provider knows about one idempotency key.
enum KeyState {
    /// Admitted, not executed yet.
    InFlight { body: Value },
    /// Executed: the answer is stored for replays.
    Done {
        body: Value,
        status: StatusCode,
        answer: Value,
    },
}

impl KeyState {
    fn body(&self) -> &Value {
        match self {
            KeyState::InFlight { body } | KeyState::Done { body, .. } => body,
        }
    }
}

/// The mutable state of the provider.
#[derive(Default)]
struct Ledger {
    refunds: Vec<Refund>,
    keys: HashMap<String, KeyState>,
    requests: usize,
    replays: usize,
    in_use_answers: usize,
    reused_answers: usize,
    delay: Duration,
    down: bool,
    unavailable_answers: usize,
}

/// State shared by the handle and the server.
struct Shared {
    ledger: Mutex<Ledger>,
    executed: broadcast::Sender<String>,
}

impl Shared {
    /// The ledger, recovered if a panic poisoned its lock (every update
    /// leaves it consistent before any point that could panic).
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A loopback payment provider API serving `POST /v1/refunds` (see the
/// [module documentation](self)) until dropped.
pub struct ProviderApi {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<()>,
}

impl ProviderApi {
    /// Binds `127.0.0.1:0` and serves in a spawned task of the current tokio
    /// runtime. Panics (with a clear message) if the socket cannot be bound.
    pub async fn start() -> ProviderApi {
        let (executed, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            ledger: Mutex::new(Ledger::default()),
            executed,
        });
        let app = Router::new()
            .route("/v1/refunds", post(refund))
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("provider API: bind a loopback port on 127.0.0.1");
        let addr = listener
            .local_addr()
            .expect("provider API: local address of the bound listener");
        let (shutdown, stop) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                // A send or a dropped sender both mean: stop.
                let _ = stop.await;
            });
            if let Err(e) = serve.await {
                eprintln!("provider API on {addr}: server error: {e}");
            }
        });
        ProviderApi {
            shared,
            addr,
            shutdown: Some(shutdown),
            server,
        }
    }

    /// The base URL, `http://127.0.0.1:PORT` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every executed refund, in execution order.
    pub fn refunds(&self) -> Vec<Refund> {
        self.shared.ledger().refunds.clone()
    }

    /// How many refunds were executed for `payment`.
    pub fn refunds_for(&self, payment: &str) -> usize {
        self.shared
            .ledger()
            .refunds
            .iter()
            .filter(|r| r.payment == payment)
            .count()
    }

    /// How many `POST /v1/refunds` requests were received, whatever their
    /// answer (malformed ones and replays included).
    pub fn requests(&self) -> usize {
        self.shared.ledger().requests
    }

    /// How many stored answers were replayed.
    pub fn replays(&self) -> usize {
        self.shared.ledger().replays
    }

    /// How many 409 `idempotency_key_in_use` answers were given.
    pub fn in_use_answers(&self) -> usize {
        self.shared.ledger().in_use_answers
    }

    /// How many 422 `idempotency_key_reused` answers were given.
    pub fn reused_answers(&self) -> usize {
        self.shared.ledger().reused_answers
    }

    /// A receiver of the idempotency key of each refund executed (not
    /// replayed) after this call, sent right after the refund is stored. Keys
    /// executed before the call are not received: subscribe before sending.
    pub fn executed(&self) -> broadcast::Receiver<String> {
        self.shared.executed.subscribe()
    }

    /// Sets the processing delay between admitting a new key (marking it in
    /// flight) and executing its refund; default zero. Applies to requests
    /// admitted after the call.
    pub fn set_delay(&self, d: Duration) {
        self.shared.ledger().delay = d;
    }
}

impl ProviderApi {
    /// Takes the provider down (`true`: every request is answered 503 with
    /// no effect) or brings it back.
    pub fn set_down(&self, down: bool) {
        self.shared.ledger().down = down;
    }

    /// How many 503 `unavailable` answers were given while down.
    pub fn unavailable_answers(&self) -> usize {
        self.shared.ledger().unavailable_answers
    }
}

impl Drop for ProviderApi {
    /// Stops accepting connections and shuts the open ones down. Refunds
    /// already admitted still complete (their tasks are independent).
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.server.abort();
    }
}

/// A JSON answer `{"error": code}` with `status`.
fn error(status: StatusCode, code: &str) -> Response {
    (status, axum::Json(json!({ "error": code }))).into_response()
}

/// The request body checked: `(payment, amount, whole body)`.
fn parse(body: &[u8]) -> Option<(String, i64, Value)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let payment = value.get("payment")?.as_str()?.to_owned();
    let amount = value.get("amount")?.as_i64()?;
    Some((payment, amount, value))
}

/// What to do with an admitted request.
enum Admission {
    Answer(Response),
    Execute(Duration),
}

/// `POST /v1/refunds`.
async fn refund(
    AxumState(shared): AxumState<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    {
        let mut ledger = shared.ledger();
        ledger.requests += 1;
        if ledger.down {
            ledger.unavailable_answers += 1;
            return error(StatusCode::SERVICE_UNAVAILABLE, "unavailable");
        }
    }

    let key = headers
        .get(IDEMPOTENCY_KEY)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    if key.is_empty() {
        return error(StatusCode::BAD_REQUEST, "idempotency_key_missing");
    }
    let Some((payment, amount, body)) = parse(&body) else {
        return error(StatusCode::BAD_REQUEST, "invalid_request");
    };

    // Check and mark in one critical section, so that of two twins exactly
    // one is admitted.
    let admission = {
        let mut ledger = shared.ledger();
        let delay = ledger.delay;
        match ledger.keys.get(&key) {
            Some(seen) if *seen.body() != body => {
                ledger.reused_answers += 1;
                Admission::Answer(error(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "idempotency_key_reused",
                ))
            }
            Some(KeyState::InFlight { .. }) => {
                ledger.in_use_answers += 1;
                Admission::Answer(error(StatusCode::CONFLICT, "idempotency_key_in_use"))
            }
            Some(KeyState::Done { status, answer, .. }) => {
                let mut response = (*status, axum::Json(answer.clone())).into_response();
                response
                    .headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                ledger.replays += 1;
                Admission::Answer(response)
            }
            None => {
                ledger
                    .keys
                    .insert(key.clone(), KeyState::InFlight { body: body.clone() });
                Admission::Execute(delay)
            }
        }
    };
    let delay = match admission {
        Admission::Answer(response) => return response,
        Admission::Execute(delay) => delay,
    };

    // The work runs on its own task: it completes even if this handler is
    // dropped (client gone) during the delay.
    let work = {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let answer = {
                let mut ledger = shared.ledger();
                let id = format!("re_{}", ledger.refunds.len() + 1);
                let answer = json!({ "id": id, "payment": payment, "amount": amount });
                ledger.refunds.push(Refund {
                    id,
                    payment,
                    amount,
                    idempotency_key: key.clone(),
                });
                ledger.keys.insert(
                    key.clone(),
                    KeyState::Done {
                        body,
                        status: StatusCode::OK,
                        answer: answer.clone(),
                    },
                );
                answer
            };
            // No receiver is fine.
            let _ = shared.executed.send(key);
            answer
        })
    };
    match work.await {
        Ok(answer) => (StatusCode::OK, axum::Json(answer)).into_response(),
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
    }
}

/// A handler's step calling the refund API at `api` (a [`ProviderApi`]'s
/// [`url`](ProviderApi::url)) with downstream key `key`: its answer when
/// it is a success, a retryable failure otherwise (a 409 or 500 has a JSON
/// body too, and taken for the step's result it would book a refund that
/// never happened).
pub async fn refund_step(
    api: String,
    key: String,
    body: Value,
) -> Result<Value, onceonly::HandlerError> {
    let sent = reqwest::Client::new()
        .post(format!("{api}/v1/refunds"))
        .header("Idempotency-Key", key)
        .json(&body)
        .send()
        .await
        .map_err(onceonly::HandlerError::retryable)?;
    if !sent.status().is_success() {
        return Err(onceonly::HandlerError::retryable(format!(
            "{}",
            sent.status()
        )));
    }
    sent.json().await.map_err(onceonly::HandlerError::retryable)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    async fn post_refund(
        client: &reqwest::Client,
        api: &ProviderApi,
        key: Option<&str>,
        body: &Value,
    ) -> reqwest::Result<reqwest::Response> {
        let mut request = client.post(format!("{}/v1/refunds", api.url())).json(body);
        if let Some(key) = key {
            request = request.header(IDEMPOTENCY_KEY, key);
        }
        request.send().await
    }

    async fn answer(response: reqwest::Response) -> (u16, Option<String>, Value) {
        let status = response.status().as_u16();
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED)
            .map(|v| v.to_str().unwrap().to_owned());
        (status, replayed, response.json().await.unwrap())
    }

    #[tokio::test]
    async fn first_call_executes_and_answers_200() {
        let api = ProviderApi::start().await;
        let client = reqwest::Client::new();
        let body = json!({ "payment": "pay_1", "amount": 500 });
        let r = post_refund(&client, &api, Some("k1"), &body).await.unwrap();
        let (status, replayed, json) = answer(r).await;
        assert_eq!(status, 200);
        assert_eq!(replayed, None);
        assert_eq!(
            json,
            json!({ "id": "re_1", "payment": "pay_1", "amount": 500 })
        );
        assert_eq!(
            api.refunds(),
            vec![Refund {
                id: "re_1".into(),
                payment: "pay_1".into(),
                amount: 500,
                idempotency_key: "k1".into(),
            }]
        );
        assert_eq!(api.refunds_for("pay_1"), 1);
        assert_eq!(api.refunds_for("pay_2"), 0);
        assert_eq!(api.requests(), 1);
        assert_eq!(api.replays(), 0);

        // Another key is another refund, numbered in execution order.
        let r = post_refund(&client, &api, Some("k2"), &body).await.unwrap();
        let (status, _, json) = answer(r).await;
        assert_eq!(status, 200);
        assert_eq!(json["id"], "re_2");
        assert_eq!(api.refunds_for("pay_1"), 2);
    }

    #[tokio::test]
    async fn same_key_and_body_replays_without_second_refund() {
        let api = ProviderApi::start().await;
        let client = reqwest::Client::new();
        let body = json!({ "payment": "pay_1", "amount": 500, "reason": "duplicate" });
        let first = post_refund(&client, &api, Some("k"), &body).await.unwrap();
        let first_bytes = first.bytes().await.unwrap();
        // Same value, other key order and spacing.
        let again = client
            .post(format!("{}/v1/refunds", api.url()))
            .header(IDEMPOTENCY_KEY, "k")
            .header("content-type", "application/json")
            .body(r#"{ "reason": "duplicate", "amount": 500, "payment": "pay_1" }"#)
            .send()
            .await
            .unwrap();
        assert_eq!(again.status().as_u16(), 200);
        assert_eq!(again.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(again.bytes().await.unwrap(), first_bytes);
        assert_eq!(api.refunds().len(), 1);
        assert_eq!(api.replays(), 1);
        assert_eq!(api.requests(), 2);
    }

    #[tokio::test]
    async fn different_body_under_same_key_is_422() {
        let api = ProviderApi::start().await;
        let client = reqwest::Client::new();
        let r = post_refund(
            &client,
            &api,
            Some("k"),
            &json!({ "payment": "pay_1", "amount": 500 }),
        )
        .await
        .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let r = post_refund(
            &client,
            &api,
            Some("k"),
            &json!({ "payment": "pay_1", "amount": 501 }),
        )
        .await
        .unwrap();
        let (status, replayed, json) = answer(r).await;
        assert_eq!(status, 422);
        assert_eq!(replayed, None);
        assert_eq!(json, json!({ "error": "idempotency_key_reused" }));
        assert_eq!(api.refunds().len(), 1);
        assert_eq!(api.reused_answers(), 1);
        assert_eq!(api.replays(), 0);
    }

    #[tokio::test]
    async fn concurrent_twin_gets_409_and_one_refund() {
        let api = ProviderApi::start().await;
        api.set_delay(Duration::from_millis(300));
        let client = reqwest::Client::new();
        let body = json!({ "payment": "pay_1", "amount": 500 });
        let (a, b) = tokio::join!(
            post_refund(&client, &api, Some("k"), &body),
            post_refund(&client, &api, Some("k"), &body),
        );
        let (a, b) = (answer(a.unwrap()).await, answer(b.unwrap()).await);
        let mut statuses = [a.0, b.0];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409]);
        let conflict = if a.0 == 409 { &a.2 } else { &b.2 };
        assert_eq!(*conflict, json!({ "error": "idempotency_key_in_use" }));
        assert_eq!(api.refunds().len(), 1);
        assert_eq!(api.in_use_answers(), 1);
        assert_eq!(api.requests(), 2);
    }

    #[tokio::test]
    async fn missing_or_empty_key_and_invalid_body_are_400() {
        let api = ProviderApi::start().await;
        let client = reqwest::Client::new();
        let body = json!({ "payment": "pay_1", "amount": 500 });
        for key in [None, Some("")] {
            let r = post_refund(&client, &api, key, &body).await.unwrap();
            let (status, _, json) = answer(r).await;
            assert_eq!(status, 400);
            assert_eq!(json, json!({ "error": "idempotency_key_missing" }));
        }
        for bad in [
            json!({ "payment": "pay_1" }),
            json!({ "payment": 1, "amount": 500 }),
            json!({ "payment": "pay_1", "amount": 5.5 }),
            json!([1, 2]),
        ] {
            let r = post_refund(&client, &api, Some("k"), &bad).await.unwrap();
            let (status, _, json) = answer(r).await;
            assert_eq!(status, 400, "{bad}");
            assert_eq!(json, json!({ "error": "invalid_request" }));
        }
        let r = client
            .post(format!("{}/v1/refunds", api.url()))
            .header(IDEMPOTENCY_KEY, "k")
            .body("not json")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400);
        assert!(api.refunds().is_empty());
        assert_eq!(api.requests(), 7);
        // The key was never admitted: a valid request under it executes.
        let r = post_refund(&client, &api, Some("k"), &body).await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(api.refunds().len(), 1);
    }

    #[tokio::test]
    async fn client_timeout_still_executes_once_and_retry_replays() {
        let api = ProviderApi::start().await;
        api.set_delay(Duration::from_millis(300));
        let mut executed = api.executed();
        let impatient = reqwest::Client::builder()
            .timeout(Duration::from_millis(50))
            .build()
            .unwrap();
        let body = json!({ "payment": "pay_1", "amount": 500 });
        // Warm up: a pooled connection, so that the 50 ms are spent waiting
        // for the answer, not connecting (no effect: the key is missing).
        let r = post_refund(&impatient, &api, None, &body).await.unwrap();
        assert_eq!(r.status().as_u16(), 400);
        let err = post_refund(&impatient, &api, Some("k"), &body)
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(api.refunds().is_empty(), "executed before the delay");

        let key = tokio::time::timeout(Duration::from_secs(10), executed.recv())
            .await
            .expect("the refund executes although its client is gone")
            .unwrap();
        assert_eq!(key, "k");
        assert_eq!(api.refunds().len(), 1);

        let client = reqwest::Client::new();
        let r = post_refund(&client, &api, Some("k"), &body).await.unwrap();
        let (status, replayed, json) = answer(r).await;
        assert_eq!(status, 200);
        assert_eq!(replayed.as_deref(), Some("true"));
        assert_eq!(
            json,
            json!({ "id": "re_1", "payment": "pay_1", "amount": 500 })
        );
        assert_eq!(api.refunds().len(), 1);
        assert_eq!(api.replays(), 1);
    }

    #[tokio::test]
    async fn executed_receives_each_executed_key_not_replays() {
        let api = ProviderApi::start().await;
        let mut executed = api.executed();
        let client = reqwest::Client::new();
        let body = json!({ "payment": "pay_1", "amount": 500 });
        for _ in 0..2 {
            let r = post_refund(&client, &api, Some("k1"), &body).await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
        }
        let r = post_refund(&client, &api, Some("k2"), &body).await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(executed.recv().await.unwrap(), "k1");
        assert_eq!(executed.recv().await.unwrap(), "k2");
        assert!(matches!(
            executed.try_recv(),
            Err(broadcast::error::TryRecvError::Empty)
        ));
    }

    #[tokio::test]
    async fn drop_stops_the_server() {
        let api = ProviderApi::start().await;
        let url = format!("{}/v1/refunds", api.url());
        drop(api);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = reqwest::Client::new()
            .post(url)
            .header(IDEMPOTENCY_KEY, "k")
            .json(&json!({ "payment": "pay_1", "amount": 500 }))
            .send()
            .await;
        assert!(r.is_err(), "still serving after drop: {r:?}");
    }
}
