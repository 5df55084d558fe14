//! The answers the layer gives itself: replays, the callback ack, and the
//! problem documents of refused requests, each counted once.

use axum::body::Body;
use axum::http::{HeaderValue, Response, StatusCode};
use tracing::Span;

use super::config::{Ack, Config, InFlight, Mode};
use super::form::FormError;
use super::problem::{problem, problem_retry_after};
use super::stored::StoredResponse;
use crate::engine::OutcomeKind;
use crate::store::{InfraFault, SqlStore, StoreError};

/// Counts `kind`, records it on the current span, and answers `response`.
pub(super) fn counted<S: SqlStore>(
    cfg: &Config<S>,
    kind: OutcomeKind,
    response: Response<Body>,
) -> Response<Body> {
    cfg.engine.telemetry().outcome(&Span::current(), kind);
    response
}

/// A request refused before anything was claimed, counted as rejected.
pub(super) fn refused<S: SqlStore>(
    cfg: &Config<S>,
    status: StatusCode,
    code: &str,
    title: &str,
    detail: &str,
) -> Response<Body> {
    counted(
        cfg,
        OutcomeKind::Rejected,
        problem(status, code, title, detail),
    )
}

/// `400 invalid-idempotency-key`, counted as rejected.
pub(super) fn invalid_key<S: SqlStore>(
    cfg: &Config<S>,
    title: &str,
    detail: &str,
) -> Response<Body> {
    refused(
        cfg,
        StatusCode::BAD_REQUEST,
        "invalid-idempotency-key",
        title,
        detail,
    )
}

/// A form body that does not decode: `400` or `415`.
pub(super) fn bad_form<S: SqlStore>(cfg: &Config<S>, e: &FormError) -> Response<Body> {
    let (status, code, title) = match e {
        FormError::NotUtf8 => (
            StatusCode::BAD_REQUEST,
            "undecodable-form",
            "Form body is not UTF-8",
        ),
        FormError::UnsupportedCharset(_)
        | FormError::UnsignedCharset(_)
        | FormError::SignedNotForm => (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-charset",
            "Form charset not supported",
        ),
        FormError::BadEscape => (
            StatusCode::BAD_REQUEST,
            "undecodable-form",
            "Form body has a broken escape",
        ),
        FormError::TooManyFields => (
            StatusCode::PAYLOAD_TOO_LARGE,
            "too-many-fields",
            "Form body has too many fields",
        ),
    };
    refused(cfg, status, code, title, &e.to_string())
}

/// A failure after the key was claimed: nothing of the request remains,
/// counted as failed.
pub(super) fn failed<S: SqlStore>(
    cfg: &Config<S>,
    code: &str,
    title: &str,
    detail: &str,
) -> Response<Body> {
    counted(
        cfg,
        OutcomeKind::Failed,
        problem(StatusCode::INTERNAL_SERVER_ERROR, code, title, detail),
    )
}

/// The answer for a key that is already completed: the replay (or the
/// callback ack).
pub(super) fn duplicate<S: SqlStore>(cfg: &Config<S>, result: Option<&[u8]>) -> Response<Body> {
    let response = match (&cfg.http.mode, result.and_then(StoredResponse::decode)) {
        (Mode::Callback { ack }, _) => ack_response(ack),
        (Mode::Header { .. }, Some(stored)) => stored.replay(),
        (Mode::Header { .. }, None) => problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "unreadable-stored-response",
            "Stored response unreadable",
            "the key is done, but its stored response cannot be decoded",
        ),
    };
    counted(cfg, OutcomeKind::Duplicate, response)
}

/// A stale request (older than its entity's state, see
/// [`FenceSpec`](crate::FenceSpec)): nothing was done, and nothing will
/// be on a retry. A callback gets the provider's success answer (so that
/// it stops retrying); an API request `200` with a JSON body saying so
/// and the header `onceonly-stale: true`. Counted as stale.
pub(super) fn stale<S: SqlStore>(cfg: &Config<S>) -> Response<Body> {
    let mut response = match &cfg.http.mode {
        Mode::Callback { ack } => ack.response(),
        Mode::Header { .. } => {
            let body = serde_json::json!({
                "type": "urn:onceonly:stale",
                "title": "Stale request",
                "status": 200,
                "detail": "a newer request for the same entity was applied before; nothing was changed",
            });
            let mut response = Response::new(Body::from(body.to_string()));
            response.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
    };
    response
        .headers_mut()
        .insert("onceonly-stale", HeaderValue::from_static("true"));
    counted(cfg, OutcomeKind::Stale, response)
}

/// `422`: the key was completed for a request with another payload.
pub(super) fn conflict<S: SqlStore>(cfg: &Config<S>) -> Response<Body> {
    counted(
        cfg,
        OutcomeKind::Conflict,
        problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency-key-reused",
            "Idempotency key reused with a different request",
            "this key was already used for a request with another payload",
        ),
    )
}

/// A repeat of a key another request is processing: `409`, counted as a
/// duplicate.
pub(super) fn in_flight<S: SqlStore>(cfg: &Config<S>) -> Response<Body> {
    let retry_after = match cfg.http.in_flight {
        InFlight::Conflict {
            retry_after_secs, ..
        } => retry_after_secs,
        InFlight::WaitThenReplay { bound } => bound.as_secs().max(1),
    };
    counted(
        cfg,
        OutcomeKind::Duplicate,
        problem_retry_after(
            StatusCode::CONFLICT,
            "request-in-flight",
            "A request with this key is in progress",
            "retry later to get its response",
            retry_after,
        ),
    )
}

/// `503`: the request was not processed, or its outcome is unknown.
pub(super) fn unavailable<S: SqlStore>(
    cfg: &Config<S>,
    title: &str,
    detail: &str,
) -> Response<Body> {
    counted(
        cfg,
        OutcomeKind::Failed,
        problem_retry_after(
            StatusCode::SERVICE_UNAVAILABLE,
            "store-unavailable",
            title,
            detail,
            5,
        ),
    )
}

/// What to do when the store failed before the handler could run, by the
/// failure's class (see [`InfraFault`]).
pub(super) enum StoreDown {
    /// Run the handler without dedup (unreachable store, fail-open policy).
    FailOpen,
    /// Answer this.
    Answer(Response<Body>),
}

/// Whether `error` is a pool that timed out while every connection was in
/// use: not an unreachable database but our own load, typically requests
/// waiting for the lock of a key another request holds. Failing open then
/// would run a second copy of a request whose first copy is still running.
fn pool_exhausted<DB: sqlx::Database>(pool: &sqlx::Pool<DB>, error: &StoreError) -> bool {
    matches!(error, StoreError::Database(sqlx::Error::PoolTimedOut))
        && pool.num_idle() == 0
        && pool.size() >= pool.options().get_max_connections()
}

/// Only a database that cannot be reached at all may fail open (a pool
/// exhausted by the service's own in-flight requests is not that); any other
/// state of the database (read-only, missing table, no privilege, out of
/// resources, shutting down, timing out) is `503`, and a data exception on
/// a value of the request is `400`.
pub(super) fn store_down<S: SqlStore>(cfg: &Config<S>, error: &StoreError) -> StoreDown {
    let Some(fault) = error.infra_fault() else {
        tracing::warn!(error = %error, "the idempotency store refused a value of the request");
        return StoreDown::Answer(invalid_key(
            cfg,
            "Invalid idempotency key",
            "the key or a value derived from the request does not fit the idempotency store",
        ));
    };
    if fault == InfraFault::Unreachable
        && cfg.http.on_store_error == super::config::OnStoreError::FailOpen
        && !pool_exhausted(cfg.engine.store().pool(), error)
    {
        // Failing open or not, the request got no dedup.
        cfg.engine
            .telemetry()
            .outcome(&Span::current(), OutcomeKind::Failed);
        tracing::error!(error = %error, "idempotency store unreachable: FAILING OPEN, request runs without dedup");
        return StoreDown::FailOpen;
    }
    tracing::error!(error = %error, %fault, "idempotency store cannot take writes: 503");
    StoreDown::Answer(unavailable(
        cfg,
        "Idempotency store unavailable",
        "the request was not processed; retry later with the same key",
    ))
}

fn ack_response(ack: &Ack) -> Response<Body> {
    let mut response = ack.response();
    response
        .headers_mut()
        .insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}
