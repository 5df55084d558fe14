//! The tower layer: buffer and check the request, claim its key with the
//! engine's claim session, run the handler in the session's transaction,
//! finish the session with the stored response, then answer.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::http::{Request, Response, StatusCode, header};
use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::{Layer, Service, ServiceExt};
use tracing::{Instrument, Span};

use super::answer::{self, StoreDown};
use super::config::{Ack, Config, IdempotencyLayerBuilder, InFlight, Mode};
use super::fence::unfenceable;
use super::request::{bind_to_request, delivery_of, repeated_key, scope_for};
use super::stored::{StoredResponse, read_up_to};
use super::verify::verify;
use crate::engine::session::traceparent_of;
use crate::engine::{ClaimSpec, Claimed, EngineBuilder, Failure, Finished, OutcomeKind, Session};
use crate::key::{KeyError, KeySpec};
use crate::store::SqlStore;

/// Idempotency for HTTP handlers, as a tower [`Layer`]; see the
/// [module documentation](super).
pub struct IdempotencyLayer<S: SqlStore> {
    cfg: Arc<Config<S>>,
}

impl<S: SqlStore> Clone for IdempotencyLayer<S> {
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
    pub fn idempotency_key(
        engine: impl Into<EngineBuilder<S>>,
        scope: impl Into<String>,
    ) -> IdempotencyLayerBuilder<S> {
        IdempotencyLayerBuilder::new(
            engine.into(),
            scope.into(),
            Mode::Header { required: true },
            Ok(KeySpec::header("Idempotency-Key")),
        )
    }

    /// Payment-callback mode: the key comes from the body (`key_expr`,
    /// e.g. `json:/out_trade_no`; a form-encoded body's fields are read
    /// as a JSON object for the key and the fingerprint, while the handler
    /// gets the body as sent). The first delivery gets the handler's own
    /// response; a duplicate notification gets `ack`.
    pub fn payment_callback(
        engine: impl Into<EngineBuilder<S>>,
        scope: impl Into<String>,
        key_expr: &str,
        ack: Ack,
    ) -> IdempotencyLayerBuilder<S> {
        IdempotencyLayerBuilder::new(
            engine.into(),
            scope.into(),
            Mode::Callback { ack },
            KeySpec::parse(key_expr),
        )
    }

    /// A payment provider's callbacks: verified as the provider specifies
    /// before any dedup work (`401` otherwise), keyed on its business field
    /// ([`Provider::default_key`](super::providers::Provider::default_key);
    /// another with [`EngineBuilder::key_expr`]), and
    /// answered in its format: its success for a processed or duplicate
    /// callback, a status it retries for a failure. See
    /// [`providers`](super::providers).
    #[cfg(feature = "providers")]
    #[cfg_attr(docsrs, doc(cfg(feature = "providers")))]
    pub fn provider(
        engine: impl Into<EngineBuilder<S>>,
        scope: impl Into<String>,
        provider: impl Into<super::providers::Provider>,
    ) -> IdempotencyLayerBuilder<S> {
        let provider = provider.into();
        IdempotencyLayerBuilder::new(
            engine.into(),
            scope.into(),
            Mode::Callback {
                ack: provider.success(),
            },
            Ok(provider.default_key()),
        )
        .with_provider(provider)
    }

    pub(crate) fn from_config(cfg: Config<S>) -> Self {
        Self { cfg: Arc::new(cfg) }
    }

    /// The layer's configuration (tests that drive its steps one by one).
    #[cfg(test)]
    pub(crate) fn config(&self) -> &Config<S> {
        &self.cfg
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
pub struct Idempotent<S: SqlStore, I> {
    inner: I,
    cfg: Arc<Config<S>>,
}

impl<S: SqlStore, I: Clone> Clone for Idempotent<S, I> {
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
    if !cfg.http.methods.contains(req.method()) {
        return pass(inner, req).await;
    }
    let source = format!("{} {}", req.method(), req.uri().path());
    let span = cfg.engine.telemetry().span_of(Some(&source), None);
    #[cfg(feature = "otel")]
    crate::otel::adopt_http(&span, req.headers());
    // The HTTP server span conventions: method, route template (axum's
    // matched path, when the layer sits on a route), status.
    span.record("http.request.method", req.method().as_str());
    if let Some(route) = req.extensions().get::<axum::extract::MatchedPath>() {
        span.record("http.route", route.as_str());
    }
    let response = handle_in_span(cfg, inner, req, source)
        .instrument(span.clone())
        .await;
    span.record("http.response.status_code", response.status().as_u16());
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
    let http = &cfg.http;
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, http.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            let limit = format!("the limit is {} bytes", http.max_request_body);
            return answer::refused(
                cfg,
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
                &limit,
            );
        }
        Err(e) => {
            return answer::refused(
                cfg,
                StatusCode::BAD_REQUEST,
                "unreadable-body",
                "Request body could not be read",
                &e.to_string(),
            );
        }
    };
    let now_secs = u64::try_from(cfg.engine.now_ms() / 1000).unwrap_or(0);
    let path = parts.uri.path().to_owned();
    let (parts, bytes) = match verified(http, parts, bytes, now_secs) {
        Ok(verified) => verified,
        Err(e) => {
            http.refusals.note(&path, &e);
            return answer::refused(
                cfg,
                e.status(),
                e.code(),
                "Callback verification failed",
                &e.public_detail(),
            );
        }
    };
    if matches!(http.mode, Mode::Header { .. }) && repeated_key(&parts.headers) {
        return answer::invalid_key(
            cfg,
            "More than one Idempotency-Key",
            "send exactly one Idempotency-Key header",
        );
    }
    let principal = (http.principal)(&parts);
    let delivery = match delivery_of(&parts, &bytes, principal.as_deref(), signed(http)) {
        Ok(delivery) => delivery,
        Err(e) => return answer::bad_form(cfg, &e),
    };
    let key = match cfg.engine.key_spec().derive(&delivery) {
        Ok(key) => key,
        Err(KeyError::MissingMetadata { .. })
            if matches!(http.mode, Mode::Header { required: false }) =>
        {
            return pass(inner, Request::from_parts(parts, Body::from(bytes))).await;
        }
        Err(e @ KeyError::MissingMetadata { .. }) => {
            return answer::refused(
                cfg,
                StatusCode::BAD_REQUEST,
                "missing-idempotency-key",
                "Idempotency-Key missing",
                &e.to_string(),
            );
        }
        Err(e) => return answer::invalid_key(cfg, "Invalid idempotency key", &e.to_string()),
    };
    cfg.engine
        .telemetry()
        .record_key(&Span::current(), key.as_str());
    let fingerprint = cfg
        .engine
        .fingerprint_spec()
        .compute(&delivery)
        .map(|fp| bind_to_request(&parts, &fp));
    let scope = scope_for(cfg.engine.scope(), principal.as_deref());
    let fence = match cfg.engine.fence_of(&delivery) {
        Ok(fence) => fence,
        // A key committed before is still answered as such.
        Err(e) => return unfenceable(cfg, &scope, &key, fingerprint.as_ref(), &e).await,
    };
    let wait = match http.in_flight {
        InFlight::Conflict { wait, .. } => wait,
        InFlight::WaitThenReplay { bound } => bound,
    };
    let spec = ClaimSpec::new(&key)
        .scope(&scope)
        .fingerprint(fingerprint)
        .source(Some(&source))
        .traceparent(traceparent_of(&delivery))
        .lock_wait(wait)
        .fence(fence.as_ref());
    let session = match cfg.engine.claim_with(spec).await {
        Ok(Claimed::New(session)) => session,
        Ok(Claimed::Duplicate { result }) => {
            tracing::debug!("duplicate");
            return answer::duplicate(cfg, result.as_deref());
        }
        Ok(Claimed::Conflict { .. }) => {
            tracing::debug!("key reused with another request");
            return answer::conflict(cfg);
        }
        Ok(Claimed::Stale(_)) => return answer::stale(cfg),
        // Only for suspects, which HTTP requests never are (a client
        // retries on its own; no broker redelivers).
        Ok(Claimed::Crashed { .. }) => {
            return answer::failed(
                cfg,
                "crashed",
                "Request parked",
                "this request crashed the server too often",
            );
        }
        // Deadlock, serialization failure, lock or busy timeout (SQLite's
        // `BEGIN IMMEDIATE` waits for the write lock the holder may have):
        // another request holds the key (or the table) right now. Never a
        // reason to run the handler without dedup.
        Err(e) if e.is_contention() => return answer::in_flight(cfg),
        Err(e) => {
            return match answer::store_down(cfg, &e) {
                StoreDown::FailOpen => {
                    pass(inner, Request::from_parts(parts, Body::from(bytes))).await
                }
                StoreDown::Answer(response) => response,
            };
        }
    };
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(session.tx());
    let started = Instant::now();
    // Bounded by the transaction deadline (a statement that never
    // answers: a silent network).
    let bound = session.tx().remaining();
    let handled = AssertUnwindSafe(inner.oneshot(req)).catch_unwind();
    let handled =
        crate::store::deadline::bounded(bound, crate::engine::HANDLER_DEADLINE, handled).await;
    cfg.engine.telemetry().handler_time(started.elapsed());
    let handled = match handled {
        Ok(handled) => handled,
        Err(missed) => {
            tracing::error!(error = %missed, "handler missed the transaction deadline; rolled back");
            return missed_deadline(cfg, session).await;
        }
    };
    match handled {
        Ok(Ok(response)) => finish(cfg, session, provider_answer(http, response)).await,
        Ok(Err(never)) => match never {},
        Err(_) => {
            if let Some(taken) = session.abandon_failed().await {
                return taken_answer(cfg, taken);
            }
            tracing::error!("handler panicked; rolled back, nothing stored");
            answer::failed(
                cfg,
                "handler-panicked",
                "Internal error",
                "the request was rolled back; it may be retried with the same key",
            )
        }
    }
}

/// Stores a response worth keeping with the session and commits it, or
/// rolls the session back; then answers.
async fn finish<S: SqlStore>(
    cfg: &Config<S>,
    session: Session<S>,
    response: Response<Body>,
) -> Response<Body> {
    let status = response.status();
    // With a fence, only a success moves the entity's fence forward: a
    // stored 3xx or 4xx would make the older deliveries of the entity
    // stale while this one was never applied.
    let fenced = cfg.engine.fence_spec().is_some();
    let keep = status.is_success()
        || (!fenced && status.is_redirection())
        || (!fenced && cfg.http.store_client_errors && status.is_client_error());
    if !keep {
        // 5xx (and 4xx unless stored): roll back the writes and the claim,
        // so the client may retry with the same key; an optimistic
        // request whose key a concurrent copy committed meanwhile (its
        // row may be what failed this one) gets that copy's answer.
        if let Some(taken) = session.abandon_failed().await {
            return taken_answer(cfg, taken);
        }
        let kind = if status.is_client_error() {
            OutcomeKind::Rejected
        } else {
            OutcomeKind::Failed
        };
        return answer::counted(cfg, kind, response);
    }
    let (mut head, body) = response.into_parts();
    // Read at most the storable size; a longer (or endless) body is stored
    // as a marker and streamed on after the commit. The transaction is
    // open meanwhile: the read is bounded by its deadline, like the
    // handler (a body that trickles holds the key, the fence and a pool
    // connection).
    let bound = session.tx().remaining();
    let read = tokio::time::timeout(bound, read_up_to(body, cfg.http.max_stored_body)).await;
    let (prefix, rest) = match read {
        Ok(Ok(read)) => read,
        Ok(Err(e)) => {
            session.abandon().await;
            return answer::failed(cfg, "response-unreadable", "Response could not be read", &e);
        }
        Err(_) => {
            tracing::error!(deadline = ?bound, "the response body was not read within the transaction deadline; rolled back");
            return missed_deadline(cfg, session).await;
        }
    };
    let stored = StoredResponse::capture(
        status,
        &head.headers,
        &cfg.http.replay_headers,
        &prefix,
        cfg.http.max_stored_body,
    );
    match session.finish(&stored.encode()).await {
        Ok(Finished::Committed) => {}
        // Optimistic: a concurrent copy committed the key meanwhile.
        Ok(taken) => return taken_answer(cfg, taken),
        // Optimistic: the copy in flight held the key past the wait.
        Err(Failure::Store(e)) if e.is_contention() => return answer::in_flight(cfg),
        // A handler that kept its guard (moved into a spawned task or a
        // streaming body) holds the transaction hostage; it rolls back
        // when the guard is finally dropped.
        Err(Failure::TxHeld) => {
            return answer::failed(
                cfg,
                "transaction-gone",
                "Transaction unavailable",
                "the idempotency transaction disappeared",
            );
        }
        // The database refused the request's own writes at COMMIT (a
        // deferred constraint, a constraint trigger) or the handler left
        // the transaction aborted: nothing was kept, and the same request
        // would fail the same way.
        Err(Failure::Commit(e)) => {
            tracing::warn!(error = %e, "the request's writes were refused at commit");
            return answer::refused(
                cfg,
                StatusCode::CONFLICT,
                "commit-refused",
                "Writes refused",
                "the database refused this request's writes when committing them; nothing was kept",
            );
        }
        Err(e) => {
            tracing::error!(error = %e, "storing the response failed; answering 503");
            return answer::unavailable(
                cfg,
                "Could not record the result",
                "the outcome is unknown; retry with the same key to get it",
            );
        }
    }
    cfg.engine
        .telemetry()
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

/// Rolls back a request whose handler (or its response body) missed the
/// transaction deadline and answers it. Counted like the consumers'
/// misses: a request whose handler keeps missing it is refused for good
/// (the counter starts over), not answered "retry later" for ever.
async fn missed_deadline<S: SqlStore>(cfg: &Config<S>, session: Session<S>) -> Response<Body> {
    let tx = session.tx();
    let (scope, key) = (tx.origin().scope().to_owned(), tx.origin().key().to_owned());
    drop(tx);
    session.abandon().await;
    if let Some(parked) = cfg.engine.handler_overran(&scope, &key).await {
        return answer::failed(cfg, "deadline", "Request parked", &parked.to_string());
    }
    answer::unavailable(
        cfg,
        "Idempotency store unavailable",
        "the request was not processed; retry later with the same key",
    )
}

/// The answer to an optimistic request whose key a concurrent copy
/// committed meanwhile: that copy's stored response, or `422`.
fn taken_answer<S: SqlStore>(cfg: &Config<S>, taken: Finished) -> Response<Body> {
    match taken {
        Finished::Conflict { .. } => {
            tracing::debug!("key reused with another request");
            answer::conflict(cfg)
        }
        Finished::Duplicate { result } => {
            tracing::debug!("duplicate, committed meanwhile");
            answer::duplicate(cfg, result.as_deref())
        }
        Finished::Stale(_) => answer::stale(cfg),
        Finished::Committed => answer::failed(
            cfg,
            "internal",
            "Internal error",
            "a rolled-back request was reported committed",
        ),
    }
}

/// The request with the provider's payload as its JSON body; the body as
/// received goes into the extensions.
/// The request once its signature(s) verified at `now_secs`: as
/// received, or with the payload a provider made of it (decoded, decrypted,
/// its signed fields only) as a JSON body.
pub(super) fn verified(
    http: &super::config::Settings,
    parts: axum::http::request::Parts,
    bytes: bytes::Bytes,
    now_secs: u64,
) -> Result<(axum::http::request::Parts, bytes::Bytes), super::VerifyError> {
    Ok(match verify(http, &parts.headers, &bytes, now_secs)? {
        None => (parts, bytes),
        Some(payload) => with_payload(parts, bytes, payload),
    })
}

fn with_payload(
    mut parts: axum::http::request::Parts,
    raw: bytes::Bytes,
    payload: Vec<u8>,
) -> (axum::http::request::Parts, bytes::Bytes) {
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    #[cfg(feature = "providers")]
    parts.extensions.insert(super::providers::RawCallback(raw));
    #[cfg(not(feature = "providers"))]
    drop(raw);
    (parts, bytes::Bytes::from(payload))
}

/// Whether the request is a callback whose bytes, not its content type,
/// were verified by a signature: its key must come from those bytes
/// alone.
pub(super) fn signed(http: &super::config::Settings) -> bool {
    #[cfg(feature = "providers")]
    if http.provider.is_some() {
        return true;
    }
    // In `Idempotency-Key` mode the key is a header, signed or not.
    http.signature.is_some() && matches!(http.mode, Mode::Callback { .. })
}

/// The handler's response in the provider's format, if there is a
/// provider.
fn provider_answer(http: &super::config::Settings, response: Response<Body>) -> Response<Body> {
    #[cfg(feature = "providers")]
    if let Some(provider) = &http.provider {
        return provider.answer(response);
    }
    #[cfg(not(feature = "providers"))]
    let _ = http;
    response
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
