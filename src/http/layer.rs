//! The tower layer: buffer and check the request, claim its key in a
//! transaction, run the handler with that transaction, store the response
//! in it, commit, then answer.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tokio::sync::Mutex;
use tower::{Layer, Service, ServiceExt};
use tracing::{Instrument, Span};

use super::config::{Ack, Config, IdempotencyLayerBuilder, InFlight, Mode, OnStoreError};
use super::form::{FormError, form_as_json};
use super::problem::{problem, problem_retry_after};
use super::stored::StoredResponse;
use super::tx::TxSlot;
use crate::delivery::Delivery;
use crate::engine::OutcomeKind;
use crate::fingerprint::Fingerprint;
use crate::key::{KeyError, KeySpec};
use crate::store::{Claim, ClaimRequest, ClaimTimes, Completed, SqlStore, StoreError};

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
    let source = format!("{} {}", req.method(), req.uri().path());
    let span = cfg.telemetry.span(Some(&source));
    handle_in_span(cfg, inner, req, source)
        .instrument(span)
        .await
}

/// Counts `kind`, records it on the current span, and answers `response`.
fn outcome<S>(cfg: &Config<S>, kind: OutcomeKind, response: Response<Body>) -> Response<Body> {
    cfg.telemetry.outcome(&Span::current(), kind);
    response
}

async fn handle_in_span<S, I>(
    cfg: &Config<S>,
    inner: I,
    req: Request<Body>,
    source: String,
) -> Response<Body>
where
    S: SqlStore,
    I: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send,
    I::Future: Send,
{
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, cfg.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return outcome(
                cfg,
                OutcomeKind::Rejected,
                problem(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body-too-large",
                    "Request body too large",
                    &format!("the limit is {} bytes", cfg.max_request_body),
                ),
            );
        }
        Err(e) => {
            return outcome(
                cfg,
                OutcomeKind::Rejected,
                problem(
                    StatusCode::BAD_REQUEST,
                    "unreadable-body",
                    "Request body could not be read",
                    &e.to_string(),
                ),
            );
        }
    };
    let now_ms = cfg.clock.now_ms();
    if let Some(check) = &cfg.signature {
        let now_secs = u64::try_from(now_ms / 1000).unwrap_or(0);
        if let Err(e) = check.verify(&parts.headers, &bytes, now_secs) {
            tracing::warn!(path = %parts.uri.path(), error = %e, "callback signature refused");
            return outcome(
                cfg,
                OutcomeKind::Rejected,
                problem(
                    StatusCode::UNAUTHORIZED,
                    "bad-signature",
                    "Signature check failed",
                    &e.to_string(),
                ),
            );
        }
    }

    if matches!(cfg.mode, Mode::Header { .. })
        && parts
            .headers
            .get_all(IDEMPOTENCY_KEY)
            .iter()
            .nth(1)
            .is_some()
    {
        // Which one would be the key? Taking either could replay another
        // request's response.
        return invalid_key(
            cfg,
            "More than one Idempotency-Key",
            "send exactly one Idempotency-Key header",
        );
    }
    let principal = (cfg.principal)(&parts);
    let delivery = match delivery_of(&parts, &bytes, principal.as_deref()) {
        Ok(delivery) => delivery,
        Err(e) => {
            let (status, code, title) = match e {
                FormError::NotUtf8 => (
                    StatusCode::BAD_REQUEST,
                    "undecodable-form",
                    "Form body is not UTF-8",
                ),
                FormError::UnsupportedCharset(_) => (
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported-charset",
                    "Form charset not supported",
                ),
            };
            let refused = problem(status, code, title, &e.to_string());
            return outcome(cfg, OutcomeKind::Rejected, refused);
        }
    };
    let key = match cfg.key.derive(&delivery) {
        Ok(key) => key,
        Err(KeyError::MissingMetadata { .. })
            if matches!(cfg.mode, Mode::Header { required: false }) =>
        {
            return pass(inner, Request::from_parts(parts, Body::from(bytes))).await;
        }
        Err(e @ KeyError::MissingMetadata { .. }) => {
            return outcome(
                cfg,
                OutcomeKind::Rejected,
                problem(
                    StatusCode::BAD_REQUEST,
                    "missing-idempotency-key",
                    "Idempotency-Key missing",
                    &e.to_string(),
                ),
            );
        }
        Err(e) => return invalid_key(cfg, "Invalid idempotency key", &e.to_string()),
    };
    cfg.telemetry.record_key(&Span::current(), key.as_str());
    let fingerprint = cfg
        .fingerprint
        .compute(&delivery)
        .map(|fp| bind_to_request(&parts, &fp));
    let scope = scope_for(&cfg.scope, principal.as_deref());

    let request = ClaimRequest {
        key: key.as_str(),
        fingerprint: fingerprint.as_ref(),
        source: Some(&source),
    };
    // A cache tier answers completed keys without any SQL.
    if let Some(hit) = cfg.store.cached(&scope, key.as_str()).await {
        tracing::debug!("answered from the cache tier");
        return settled(cfg, hit.classify(&request));
    }
    let mut tx = match cfg.store.begin().await {
        Ok(tx) => tx,
        // SQLite's `BEGIN IMMEDIATE` waits for the write lock, which the
        // request holding this key may have: the same as a claim waiting.
        Err(e) if e.is_contention() => return in_flight(cfg),
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
    let times = ClaimTimes::new(now_ms, cfg.retention);
    let claim = async {
        cfg.store.set_lock_timeout(&mut tx, Some(wait)).await?;
        let claim = cfg.store.claim(&mut tx, &scope, times, &request).await?;
        // The handler's own statements wait as long as they normally would.
        cfg.store.set_lock_timeout(&mut tx, None).await?;
        Ok::<_, StoreError>(claim)
    }
    .await;
    let claim = match claim {
        Ok(claim) => claim,
        // Deadlock, serialization failure, lock or busy timeout: another
        // request holds the key (or the table) right now. Never a reason to
        // run the handler without dedup.
        Err(e) if e.is_contention() => {
            drop(tx.rollback().await);
            return in_flight(cfg);
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
        other => {
            drop(tx.rollback().await);
            tracing::debug!("duplicate or reused key");
            return settled(cfg, other);
        }
    }

    // Claimed: run the handler with the transaction.
    let slot = TxSlot(Arc::new(Mutex::new(Some(tx))));
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(slot.clone());
    let started = Instant::now();
    let handled = AssertUnwindSafe(inner.oneshot(req)).catch_unwind().await;
    cfg.telemetry.handler_time(started.elapsed());
    // A handler that kept its guard (moved into a spawned task or a
    // streaming body) holds the transaction hostage: give up after a while;
    // the transaction rolls back when the guard is finally dropped.
    let tx = match tokio::time::timeout(TX_RETURN_TIMEOUT, slot.0.lock()).await {
        Ok(mut guard) => guard.take(),
        Err(_) => None,
    };
    let Some(mut tx) = tx else {
        return outcome(
            cfg,
            OutcomeKind::Failed,
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "transaction-gone",
                "Transaction unavailable",
                "the idempotency transaction disappeared",
            ),
        );
    };
    let response = match handled {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => {
            drop(tx.rollback().await);
            tracing::error!("handler panicked; rolled back, nothing stored");
            return outcome(
                cfg,
                OutcomeKind::Failed,
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "handler-panicked",
                    "Internal error",
                    "the request was rolled back; it may be retried with the same key",
                ),
            );
        }
    };
    let status = response.status();
    let keep = status.is_success()
        || status.is_redirection()
        || (cfg.store_client_errors && status.is_client_error());
    if !keep {
        // 5xx (and 4xx unless stored): roll back the writes and the claim,
        // so the client may retry with the same key.
        drop(tx.rollback().await);
        let kind = if status.is_client_error() {
            OutcomeKind::Rejected
        } else {
            OutcomeKind::Failed
        };
        return outcome(cfg, kind, response);
    }
    let (mut head, body) = response.into_parts();
    // Read at most the storable size; a longer (or endless) body is stored
    // as a marker and streamed on after the commit.
    let (prefix, rest) = match read_up_to(body, cfg.max_stored_body).await {
        Ok(read) => read,
        Err(e) => {
            drop(tx.rollback().await);
            return outcome(
                cfg,
                OutcomeKind::Failed,
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "response-unreadable",
                    "Response could not be read",
                    &e,
                ),
            );
        }
    };
    // A body longer than the limit (`rest` is then `Some`) is stored as a
    // marker by `capture` itself.
    let stored = StoredResponse::capture(
        status,
        &head.headers,
        &cfg.replay_headers,
        &prefix,
        cfg.max_stored_body,
    );
    let encoded = stored.encode();
    let committed = async {
        cfg.store
            .complete(&mut tx, &scope, key.as_str(), &encoded)
            .await?;
        let started = Instant::now();
        let committed = tx.commit().await;
        cfg.telemetry.commit_time(started.elapsed());
        committed.map_err(StoreError::from)
    }
    .await;
    if committed.is_ok() {
        cfg.store
            .committed(&Completed {
                scope: &scope,
                key: key.as_str(),
                fingerprint: fingerprint.as_ref(),
                result: &encoded,
                now_ms: times.now_ms,
                expires_at_ms: times.expires_at_ms,
            })
            .await;
    }
    if let Err(e) = committed {
        tracing::error!(error = %e, "storing the response failed; answering 503");
        return outcome(
            cfg,
            OutcomeKind::Failed,
            problem_retry_after(
                StatusCode::SERVICE_UNAVAILABLE,
                "store-unavailable",
                "Could not record the result",
                "the outcome is unknown; retry with the same key to get it",
                5,
            ),
        );
    }
    cfg.telemetry
        .outcome(&Span::current(), OutcomeKind::Processed);
    match rest {
        None => {
            head.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(head, Body::from(prefix))
        }
        Some(rest) => {
            let stream = futures_util::stream::once(async move { Ok::<_, axum::Error>(prefix) })
                .chain(rest.into_data_stream());
            Response::from_parts(head, Body::from_stream(stream))
        }
    }
}

/// The header of [`IdempotencyLayer::idempotency_key`] mode.
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// How long the layer waits, after the handler returned, for it to let go
/// of the transaction.
const TX_RETURN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads `body` until it ends (`rest` is `None`) or more than `max` bytes
/// were read (`rest` is the unread remainder).
async fn read_up_to(mut body: Body, max: usize) -> Result<(Bytes, Option<Body>), String> {
    let mut buf = bytes::BytesMut::new();
    loop {
        match body.frame().await {
            None => return Ok((buf.freeze(), None)),
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > max {
                        return Ok((buf.freeze(), Some(body)));
                    }
                }
            }
        }
    }
}

/// The answer for a key that is already completed: the replay (or the
/// callback ack), or `422` if it was completed for another request.
fn settled<S>(cfg: &Config<S>, claim: Claim) -> Response<Body> {
    let kind = match &claim {
        Claim::Duplicate { .. } => OutcomeKind::Duplicate,
        _ => OutcomeKind::Conflict,
    };
    cfg.telemetry.outcome(&Span::current(), kind);
    match claim {
        Claim::Duplicate { result } => {
            match (
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
            }
        }
        _ => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency-key-reused",
            "Idempotency key reused with a different request",
            "this key was already used for a request with another payload",
        ),
    }
}

/// `400 invalid-idempotency-key`, counted as rejected.
fn invalid_key<S>(cfg: &Config<S>, title: &str, detail: &str) -> Response<Body> {
    outcome(
        cfg,
        OutcomeKind::Rejected,
        problem(
            StatusCode::BAD_REQUEST,
            "invalid-idempotency-key",
            title,
            detail,
        ),
    )
}

/// A repeat of a key another request is processing: counted as a duplicate.
fn in_flight<S>(cfg: &Config<S>) -> Response<Body> {
    cfg.telemetry
        .outcome(&Span::current(), OutcomeKind::Duplicate);
    let retry_after = match cfg.in_flight {
        InFlight::Conflict {
            retry_after_secs, ..
        } => retry_after_secs,
        InFlight::WaitThenReplay { bound } => bound.as_secs().max(1),
    };
    problem_retry_after(
        StatusCode::CONFLICT,
        "request-in-flight",
        "A request with this key is in progress",
        "retry later to get its response",
        retry_after,
    )
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

/// The answer when the store failed before the handler could run, by the
/// failure's class (see [`InfraFault`](crate::store::InfraFault)): only a
/// database that cannot be reached at all may fail open; any other state of
/// the database (read-only, missing table, no privilege, out of resources,
/// shutting down, timing out) is `503`, and a data exception on a value of
/// the request is `400`.
async fn store_down<S, I>(
    cfg: &Config<S>,
    inner: I,
    req: Request<Body>,
    error: &StoreError,
) -> Response<Body>
where
    I: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    let Some(fault) = error.infra_fault() else {
        tracing::warn!(error = %error, "the idempotency store refused a value of the request");
        return invalid_key(
            cfg,
            "Invalid idempotency key",
            "the key or a value derived from the request does not fit the idempotency store",
        );
    };
    // Failing open or not, the request got no dedup.
    cfg.telemetry.outcome(&Span::current(), OutcomeKind::Failed);
    if fault == crate::store::InfraFault::Unreachable
        && cfg.on_store_error == OnStoreError::FailOpen
    {
        tracing::error!(error = %error, path = %req.uri().path(), "idempotency store unreachable: FAILING OPEN, request runs without dedup");
        return pass(inner, req).await;
    }
    tracing::error!(error = %error, %fault, "idempotency store cannot take writes: 503");
    problem_retry_after(
        StatusCode::SERVICE_UNAVAILABLE,
        "store-unavailable",
        "Idempotency store unavailable",
        "the request was not processed; retry later with the same key",
        5,
    )
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

/// The IETF draft sends the key as a structured-field string (`"abc"`);
/// unquote it (with `\"` and `\\` escapes). A bare token is taken as is.
fn unquote_sf_string(value: &[u8]) -> Vec<u8> {
    match value {
        [b'"', inner @ .., b'"'] => {
            let mut out = Vec::with_capacity(inner.len());
            let mut escaped = false;
            for &b in inner {
                if escaped || b != b'\\' {
                    out.push(b);
                    escaped = false;
                } else {
                    escaped = true;
                }
            }
            out
        }
        _ => value.to_vec(),
    }
}

/// The engine's view of the request: a form body is read as a JSON object
/// of its fields, so JSON-pointer keys and fingerprints work on both. A form
/// body that does not decode strictly is refused.
fn delivery_of(
    parts: &axum::http::request::Parts,
    body: &Bytes,
    principal: Option<&str>,
) -> Result<Delivery, FormError> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let payload = match form_as_json(content_type, body) {
        None => body.to_vec(),
        Some(json) => json?,
    };
    let mut d = Delivery::new(payload).with_request(parts.method.as_str(), parts.uri.path());
    for (name, value) in &parts.headers {
        let value = if name.as_str() == "idempotency-key" {
            unquote_sf_string(value.as_bytes())
        } else {
            value.as_bytes().to_vec()
        };
        d = d.with_metadata(name.as_str(), value);
    }
    if let Some(p) = principal {
        d = d.with_principal(p);
    }
    Ok(d)
}

/// A key names one operation on one resource: the same key and body sent to
/// another method, path or query is another request (`422`), not a replay.
fn bind_to_request(parts: &axum::http::request::Parts, fp: &Fingerprint) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"onceonly-http-request\0");
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
        parts.uri.query().unwrap_or_default().as_bytes(),
        fp.as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Fingerprint(h.finalize().into())
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
