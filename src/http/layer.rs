//! The tower layer: buffer and check the request, claim its key in a
//! transaction, run the handler with that transaction, store the response
//! in it, commit, then answer.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;
use tower::{Layer, Service, ServiceExt};

use super::config::{Ack, Config, IdempotencyLayerBuilder, InFlight, Mode, OnStoreError};
use super::problem::{problem, problem_retry_after};
use super::stored::StoredResponse;
use super::tx::TxSlot;
use crate::delivery::Delivery;
use crate::key::{KeyError, KeySpec};
use crate::store::{Claim, ClaimRequest, ClaimTimes, SqlStore, StoreError};

/// Idempotency for HTTP handlers, as a tower [`Layer`]; see the
/// [module documentation](super).
pub struct IdempotencyLayer<S> {
    cfg: Arc<Config<S>>,
}

impl<S> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        Self {
            cfg: Arc::clone(&self.cfg),
        }
    }
}

impl<S: SqlStore> IdempotencyLayer<S> {
    /// `Idempotency-Key` mode (IETF draft): the key is the
    /// `Idempotency-Key` header, unique per `scope` and principal; a
    /// completed key replays its stored response.
    pub fn idempotency_key(store: S, scope: impl Into<String>) -> IdempotencyLayerBuilder<S> {
        IdempotencyLayerBuilder::new(
            store,
            scope.into(),
            Mode::Header { required: true },
            Ok(KeySpec::header("Idempotency-Key")),
        )
    }

    /// Payment-callback mode: the key comes from the body (`key_expr`,
    /// e.g. `json:/out_trade_no`; form-encoded bodies are read as a JSON
    /// object of their fields), and a duplicate notification gets `ack`.
    pub fn payment_callback(
        store: S,
        scope: impl Into<String>,
        key_expr: &str,
        ack: Ack,
    ) -> IdempotencyLayerBuilder<S> {
        IdempotencyLayerBuilder::new(
            store,
            scope.into(),
            Mode::Callback { ack },
            KeySpec::parse(key_expr),
        )
    }

    pub(crate) fn from_config(cfg: Config<S>) -> Self {
        Self { cfg: Arc::new(cfg) }
    }
}

impl<S: SqlStore, I> Layer<I> for IdempotencyLayer<S> {
    type Service = Idempotent<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        Idempotent {
            inner,
            cfg: Arc::clone(&self.cfg),
        }
    }
}

/// The service made by [`IdempotencyLayer`].
pub struct Idempotent<S, I> {
    inner: I,
    cfg: Arc<Config<S>>,
}

impl<S, I: Clone> Clone for Idempotent<S, I> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            cfg: Arc::clone(&self.cfg),
        }
    }
}

impl<S, I> Service<Request<Body>> for Idempotent<S, I>
where
    S: SqlStore,
    I: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    I::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The ready service handles this request; a fresh clone waits for
        // the next one (tower's usual pattern).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let cfg = Arc::clone(&self.cfg);
        Box::pin(async move { Ok(handle(&cfg, inner, req).await) })
    }
}

async fn handle<S, I>(cfg: &Config<S>, inner: I, req: Request<Body>) -> Response<Body>
where
    S: SqlStore,
    I: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
    I::Future: Send,
{
    if !cfg.methods.contains(req.method()) {
        return pass(inner, req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, cfg.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
                &format!("the limit is {} bytes", cfg.max_request_body),
            );
        }
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "Request body could not be read",
                &e.to_string(),
            );
        }
    };
    let now_ms = cfg.clock.now_ms();
    if let Some(check) = &cfg.signature {
        let now_secs = u64::try_from(now_ms / 1000).unwrap_or(0);
        if let Err(e) = check.verify(&parts.headers, &bytes, now_secs) {
            tracing::warn!(path = %parts.uri.path(), error = %e, "callback signature refused");
            return problem(
                StatusCode::UNAUTHORIZED,
                "bad-signature",
                "Signature check failed",
                &e.to_string(),
            );
        }
    }

    let principal = (cfg.principal)(&parts);
    let delivery = delivery_of(&parts, &bytes, principal.as_deref());
    let key = match cfg.key.derive(&delivery) {
        Ok(key) => key,
        Err(KeyError::MissingMetadata { .. })
            if matches!(cfg.mode, Mode::Header { required: false }) =>
        {
            return pass(inner, Request::from_parts(parts, Body::from(bytes))).await;
        }
        Err(e @ KeyError::MissingMetadata { .. }) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Idempotency-Key missing",
                &e.to_string(),
            );
        }
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid-idempotency-key",
                "Invalid idempotency key",
                &e.to_string(),
            );
        }
    };
    let fingerprint = cfg.fingerprint.compute(&delivery);
    let scope = scope_for(&cfg.scope, principal.as_deref());

    let mut tx = match cfg.store.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            return store_down(
                cfg,
                inner,
                Request::from_parts(parts, Body::from(bytes)),
                &e,
            )
            .await;
        }
    };
    let wait = match cfg.in_flight {
        InFlight::Conflict { wait, .. } => wait,
        InFlight::WaitThenReplay { bound } => bound,
    };
    let source = format!("{} {}", parts.method, parts.uri.path());
    let claim = async {
        cfg.store.set_lock_timeout(&mut tx, Some(wait)).await?;
        let claim = cfg
            .store
            .claim(
                &mut tx,
                &scope,
                ClaimTimes::new(now_ms, cfg.retention),
                &ClaimRequest {
                    key: key.as_str(),
                    fingerprint: fingerprint.as_ref(),
                    source: Some(&source),
                },
            )
            .await?;
        // The handler's own statements wait as long as they normally would.
        cfg.store.set_lock_timeout(&mut tx, None).await?;
        Ok::<_, StoreError>(claim)
    }
    .await;
    let claim = match claim {
        Ok(claim) => claim,
        Err(e) if e.is_lock_timeout() => {
            drop(tx.rollback().await);
            let retry_after = match cfg.in_flight {
                InFlight::Conflict {
                    retry_after_secs, ..
                } => retry_after_secs,
                InFlight::WaitThenReplay { .. } => 1,
            };
            return problem_retry_after(
                StatusCode::CONFLICT,
                "request-in-flight",
                "A request with this key is in progress",
                "retry later to get its response",
                retry_after,
            );
        }
        Err(e) => {
            drop(tx.rollback().await);
            return store_down(
                cfg,
                inner,
                Request::from_parts(parts, Body::from(bytes)),
                &e,
            )
            .await;
        }
    };
    match claim {
        Claim::Claimed => {}
        Claim::Duplicate { result } => {
            drop(tx.rollback().await);
            tracing::debug!(key = %key, scope = %scope, "duplicate request replayed");
            return match (
                &cfg.mode,
                result.as_deref().and_then(StoredResponse::decode),
            ) {
                (Mode::Callback { ack }, _) => ack_response(ack),
                (Mode::Header { .. }, Some(stored)) => stored.replay(),
                (Mode::Header { .. }, None) => problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "unreadable-stored-response",
                    "Stored response unreadable",
                    "the key is done, but its stored response cannot be decoded",
                ),
            };
        }
        Claim::Conflict { .. } | Claim::InBatch { .. } => {
            drop(tx.rollback().await);
            return problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency-key-reused",
                "Idempotency key reused with a different request",
                "this key was already used for a request with another payload",
            );
        }
    }

    // Claimed: run the handler with the transaction.
    let slot = TxSlot(Arc::new(Mutex::new(Some(tx))));
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(slot.clone());
    let outcome = AssertUnwindSafe(inner.oneshot(req)).catch_unwind().await;
    let tx = slot.0.lock().await.take();
    let Some(mut tx) = tx else {
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "transaction-gone",
            "Transaction unavailable",
            "the idempotency transaction disappeared",
        );
    };
    let response = match outcome {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => {
            drop(tx.rollback().await);
            tracing::error!(key = %key, "handler panicked; rolled back, nothing stored");
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "handler-panicked",
                "Internal error",
                "the request was rolled back; it may be retried with the same key",
            );
        }
    };
    let status = response.status();
    let keep = status.is_success() || (cfg.store_client_errors && status.is_client_error());
    if !keep {
        // 5xx (and 4xx unless stored): roll back the writes and the claim,
        // so the client may retry with the same key.
        drop(tx.rollback().await);
        return response;
    }
    let (mut head, body) = response.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            drop(tx.rollback().await);
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "response-unreadable",
                "Response could not be read",
                &e.to_string(),
            );
        }
    };
    let stored = StoredResponse::capture(
        status,
        &head.headers,
        &cfg.replay_headers,
        &body,
        cfg.max_stored_body,
    );
    let committed = async {
        cfg.store
            .complete(&mut tx, &scope, key.as_str(), &stored.encode())
            .await?;
        tx.commit().await.map_err(StoreError::from)
    }
    .await;
    if let Err(e) = committed {
        tracing::error!(key = %key, error = %e, "storing the response failed; answering 503");
        return problem_retry_after(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            "Could not record the result",
            "the outcome is unknown; retry with the same key to get it",
            5,
        );
    }
    head.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(head, Body::from(body))
}

async fn pass<I>(inner: I, req: Request<Body>) -> Response<Body>
where
    I: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    match inner.oneshot(req).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

async fn store_down<S, I>(
    cfg: &Config<S>,
    inner: I,
    req: Request<Body>,
    error: &StoreError,
) -> Response<Body>
where
    I: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    match cfg.on_store_error {
        OnStoreError::FailOpen => {
            tracing::error!(error = %error, path = %req.uri().path(), "idempotency store unavailable: FAILING OPEN, request runs without dedup");
            pass(inner, req).await
        }
        _ => {
            tracing::error!(error = %error, "idempotency store unavailable: 503");
            problem_retry_after(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Idempotency store unavailable",
                "the request was not processed; retry later with the same key",
                5,
            )
        }
    }
}

fn ack_response(ack: &Ack) -> Response<Body> {
    let mut response = Response::new(Body::from(ack.body.clone()));
    *response.status_mut() = ack.status;
    if let Ok(v) = HeaderValue::from_str(&ack.content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    response
        .headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}

/// The engine's view of the request: a form body is read as a JSON object
/// of its fields (first value of a repeated field), so JSON-pointer keys and
/// fingerprints work on both.
fn delivery_of(
    parts: &axum::http::request::Parts,
    body: &Bytes,
    principal: Option<&str>,
) -> Delivery {
    let is_form = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    let payload = if is_form {
        let mut fields = serde_json::Map::new();
        for (k, v) in form_urlencoded::parse(body) {
            fields
                .entry(k.into_owned())
                .or_insert_with(|| serde_json::Value::String(v.into_owned()));
        }
        serde_json::Value::Object(fields).to_string().into_bytes()
    } else {
        body.to_vec()
    };
    let mut d = Delivery::new(payload).with_request(parts.method.as_str(), parts.uri.path());
    for (name, value) in &parts.headers {
        d = d.with_metadata(name.as_str(), value.as_bytes());
    }
    if let Some(p) = principal {
        d = d.with_principal(p);
    }
    d
}

/// `scope` alone, or `scope@<hash of the principal>`: keys of different
/// principals never meet.
fn scope_for(scope: &str, principal: Option<&str>) -> String {
    match principal {
        None => scope.to_owned(),
        Some(p) => {
            let digest = hex::encode(Sha256::digest(p.as_bytes()));
            format!("{scope}@{}", &digest[..32])
        }
    }
}
