//! Configuration of the [`IdempotencyLayer`](super::IdempotencyLayer).

use std::sync::Arc;
use std::time::Duration;

use axum::http::request::Parts;
use axum::http::{HeaderName, Method, StatusCode};

use super::layer::IdempotencyLayer;
use super::signature::SignatureCheck;
use crate::engine::{BuildError, Engine, EngineBuilder};
use crate::fingerprint::FingerprintSpec;
use crate::key::{KeySpec, KeySpecError};
use crate::store::{SqlStore, StoreError, validate_scope};
use crate::telemetry::TRANSPORT_HTTP;

/// The authenticated caller, put into request extensions by your auth
/// middleware (before the layer runs). Keys are scoped per principal: one
/// tenant's key never replays another tenant's response.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(pub String);

/// Finds the principal of a request.
pub type PrincipalFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// What a request's key is and what a duplicate gets.
#[derive(Clone, Debug)]
pub(crate) enum Mode {
    /// `Idempotency-Key` header (IETF draft): duplicates replay the stored
    /// response.
    Header { required: bool },
    /// Payment callback: key from the body; duplicates get `ack`.
    Callback { ack: Ack },
}

/// The acknowledgement a payment provider expects for a notification it
/// already delivered, e.g. `200 success` (Alipay) or
/// `200 {"code":"SUCCESS"}` (WeChat Pay).
#[derive(Clone, Debug)]
pub struct Ack {
    pub(crate) status: StatusCode,
    pub(crate) content_type: String,
    pub(crate) body: String,
}

impl Ack {
    /// `status` with `body` as `content_type`.
    pub fn new(
        status: StatusCode,
        content_type: impl Into<String>,
        body: impl Into<String>,
    ) -> Self {
        Self {
            status,
            content_type: content_type.into(),
            body: body.into(),
        }
    }

    /// `200 text/plain success`, what Alipay expects.
    pub fn plain_success() -> Self {
        Self::new(StatusCode::OK, "text/plain; charset=utf-8", "success")
    }

    /// The response (an empty `content_type`: no `Content-Type` header).
    pub(crate) fn response(&self) -> axum::http::Response<axum::body::Body> {
        let mut response = axum::http::Response::new(axum::body::Body::from(self.body.clone()));
        *response.status_mut() = self.status;
        if !self.content_type.is_empty()
            && let Ok(v) = axum::http::HeaderValue::from_str(&self.content_type)
        {
            response
                .headers_mut()
                .insert(axum::http::header::CONTENT_TYPE, v);
        }
        response
    }
}

/// What a request whose key is held by another request in flight gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InFlight {
    /// `409 Conflict` with `Retry-After`, after waiting at most `wait` for
    /// the other request (the default: 50 ms, then 409, `Retry-After: 1`).
    Conflict {
        /// How long to wait for the row lock first.
        wait: Duration,
        /// The `Retry-After` value, in seconds.
        retry_after_secs: u64,
    },
    /// Wait up to `bound` for the other request; if it completes, replay
    /// its response; otherwise `409`.
    WaitThenReplay {
        /// The longest wait.
        bound: Duration,
    },
}

/// What happens when the store is unreachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// `503 Service Unavailable` with `Retry-After` (the default): nothing
    /// runs without dedup.
    #[default]
    FailClosed,
    /// Run the handler without dedup and without a transaction (logged at
    /// error level for every request), but only when the database cannot be
    /// reached at all: contention (a key in flight) is `409`, and a database
    /// that answers but cannot take writes is `503`. Only for handlers that
    /// are safe to run twice and take `Option<Tx<DB>>`.
    FailOpen,
}

/// Why a layer could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpBuildError {
    /// The key expression is invalid.
    #[error("invalid key spec: {0}")]
    Key(#[from] KeySpecError),
    /// The scope is invalid.
    #[error(transparent)]
    Scope(#[from] StoreError),
    /// The scope leaves no room for the per-principal suffix.
    #[error("the scope must be at most 90 bytes (room for the per-principal suffix)")]
    ScopeTooLong,
    /// Retention must be longer than zero.
    #[error("retention must be longer than zero")]
    ZeroRetention,
    /// The engine builder given to the layer names a scope: a layer's
    /// scope is the one its constructor takes (and the per-principal
    /// suffix it adds), so there is one home for it.
    #[error(
        "the layer's scope is its constructor's argument: do not also set EngineBuilder::scope"
    )]
    ScopeSetTwice,
    /// A layer for a payment provider keeps its records for less than the
    /// provider's retry horizon and a margin: a retry sent after a record
    /// was purged would be processed again (see
    /// [`Provider::min_retention`](super::providers::Provider::min_retention)).
    #[error(
        "a retention of {retention:?} is shorter than {provider} retries callbacks for: keep records at least {min:?}"
    )]
    RetentionBelowRetries {
        /// The provider's name.
        provider: &'static str,
        /// The retention asked for.
        retention: Duration,
        /// The shortest retention allowed.
        min: Duration,
    },
    /// A signing secret too short to verify anything (see
    /// [`SignatureCheck::new`](super::SignatureCheck::new)).
    #[error(transparent)]
    Secret(#[from] super::SecretError),
    /// A fence on a layer whose key is optional: requests without a key
    /// would pass around the fence, applying old events and never moving
    /// it forward.
    #[error("a fenced layer needs every request keyed: do not combine fence with an optional key")]
    FenceWithoutKey,
    /// A fence on a payment provider's route that reads a field the
    /// route's payload never holds: the provider's payload keeps its
    /// signed fields only (Adyen signs no `eventDate`), so every callback
    /// would be refused. Fence on signed fields, or take the items from a
    /// service that received them from the provider directly.
    #[error(
        "the fence reads {pointer}, which {provider} does not sign and its route's payload does not hold: every callback would be refused"
    )]
    FenceFieldUnsigned {
        /// The provider's name.
        provider: &'static str,
        /// The JSON pointer the fence reads.
        pointer: String,
    },
    /// Another engine setting is invalid (e.g.
    /// [`max_deadline_misses`](crate::EngineBuilder::max_deadline_misses)
    /// of zero).
    #[error(transparent)]
    Engine(BuildError),
    /// A layer for a payment provider keyed on a request header: no
    /// provider signs its headers, so a captured callback resent with a
    /// new header value would be processed again. Key on signed bytes: a
    /// body field, or the provider's default key (not
    /// [`KeySpec::fingerprint`], which also covers the unsigned path).
    #[error(
        "{provider} callbacks keyed on header {header}, which {provider} does not sign: key on a body field or the body's digest"
    )]
    UnsignedKey {
        /// The provider's name.
        provider: &'static str,
        /// The header named by the key.
        header: String,
    },
}

pub(crate) struct Config<S: SqlStore> {
    /// Claims, commits, the cache tier and telemetry (`transport="http"`).
    pub(crate) engine: Engine<S>,
    pub(crate) http: Settings,
}

/// What only HTTP needs.
pub(crate) struct Settings {
    pub(crate) mode: Mode,
    pub(crate) methods: Vec<Method>,
    pub(crate) in_flight: InFlight,
    pub(crate) store_client_errors: bool,
    pub(crate) max_request_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) signature: Option<SignatureCheck>,
    /// The payment provider whose scheme is verified, and whose answers
    /// the handler's are turned into.
    #[cfg(feature = "providers")]
    pub(crate) provider: Option<super::providers::Provider>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) principal: PrincipalFn,
    /// Refused callbacks, for the log.
    pub(crate) refusals: super::refusals::Refusals,
}

/// Builds an [`IdempotencyLayer`]: start with
/// [`IdempotencyLayer::idempotency_key`],
/// [`IdempotencyLayer::payment_callback`] or `IdempotencyLayer::provider`.
///
/// What only HTTP has is set here; every engine setting (key, retention,
/// fingerprint, optimistic claims, fences, steps' secret, key redaction,
/// ...) is set on the [`EngineBuilder`] the constructor takes, which
/// overrides the layer's defaults: the key (the `Idempotency-Key` header,
/// the provider's business field, `payment_callback`'s `key_expr`), the
/// retention (24 hours; a provider's
/// [default](super::providers::Provider::default_retention)) and the
/// fingerprint (the request in `Idempotency-Key` mode, nothing for
/// callbacks, whose retries change fields such as `notify_time`; use
/// `FingerprintSpec::Fields` over the business fields to refuse a tampered
/// notification).
pub struct IdempotencyLayerBuilder<S> {
    engine: EngineBuilder<S>,
    scope: String,
    /// The layer's default retention, unless the engine builder sets one.
    retention: Duration,
    cfg: Settings,
}

impl<S: SqlStore> IdempotencyLayerBuilder<S> {
    pub(crate) fn new(
        engine: EngineBuilder<S>,
        scope: String,
        mode: Mode,
        key: Result<KeySpec, KeySpecError>,
    ) -> Self {
        let (methods, fingerprint) = match mode {
            Mode::Header { .. } => (vec![Method::POST, Method::PATCH], FingerprintSpec::Auto),
            // Providers change fields such as `notify_time` on every retry:
            // a repeated notification must get the ack, not a conflict.
            Mode::Callback { .. } => (vec![Method::POST], FingerprintSpec::Disabled),
        };
        Self {
            engine: engine
                .or_key(|| key)
                .or_fingerprint(|| fingerprint)
                .transport(TRANSPORT_HTTP),
            scope,
            retention: Duration::from_secs(24 * 3600),
            cfg: Settings {
                mode,
                methods,
                in_flight: InFlight::Conflict {
                    wait: Duration::from_millis(50),
                    retry_after_secs: 1,
                },
                store_client_errors: false,
                max_request_body: 1 << 20,
                max_stored_body: 1 << 20,
                replay_headers: [
                    "content-type",
                    "content-location",
                    "location",
                    "etag",
                    "last-modified",
                ]
                .into_iter()
                .map(HeaderName::from_static)
                .collect(),
                signature: None,
                #[cfg(feature = "providers")]
                provider: None,
                on_store_error: OnStoreError::FailClosed,
                principal: Arc::new(|parts: &Parts| {
                    parts.extensions.get::<Principal>().map(|p| p.0.clone())
                }),
                refusals: super::refusals::Refusals::default(),
            },
        }
    }

    /// Verify `provider`'s scheme and answer in its format (set by
    /// [`IdempotencyLayer::provider`](super::IdempotencyLayer::provider)),
    /// keeping records for its [default retention](super::providers::Provider::default_retention).
    #[cfg(feature = "providers")]
    pub(crate) fn with_provider(mut self, provider: super::providers::Provider) -> Self {
        self.retention = provider.default_retention();
        self.cfg.provider = Some(provider);
        self
    }

    /// Let requests without an `Idempotency-Key` through without dedup
    /// (their handler gets no [`Tx`](super::Tx): take `Option<Tx<DB>>`).
    /// By default a missing key is `400`.
    #[must_use]
    pub fn key_optional(mut self) -> Self {
        if let Mode::Header { required } = &mut self.cfg.mode {
            *required = false;
        }
        self
    }

    /// Methods the layer covers (default: POST and PATCH; callbacks: POST).
    /// Other methods pass through untouched.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.cfg.methods = methods.into_iter().collect();
        self
    }

    /// What a request gets while another with the same key is in flight.
    #[must_use]
    pub fn in_flight(mut self, policy: InFlight) -> Self {
        self.cfg.in_flight = policy;
        self
    }

    /// Also store (and replay) 4xx responses, with the handler's writes.
    /// By default they roll back and are not stored, so a corrected retry
    /// with the same key can succeed.
    #[must_use]
    pub fn store_client_errors(mut self, store: bool) -> Self {
        self.cfg.store_client_errors = store;
        self
    }

    /// Largest request body accepted (default 1 MiB); larger: `413`.
    #[must_use]
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.cfg.max_request_body = bytes;
        self
    }

    /// Largest response body stored (default 1 MiB). A larger response is
    /// still sent and its status and headers stored; a replay then has an
    /// empty body and `Idempotent-Replay-Body: omitted`.
    #[must_use]
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.cfg.max_stored_body = bytes;
        self
    }

    /// Adds a response header to the replayed allow-list (default:
    /// `content-type`, `content-location`, `location`, `etag`,
    /// `last-modified`).
    #[must_use]
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.cfg.replay_headers.push(name);
        self
    }

    /// Checks an HMAC signature before anything else (bad or stale: `401`,
    /// nothing stored).
    #[must_use]
    pub fn signature(mut self, check: SignatureCheck) -> Self {
        self.cfg.signature = Some(check);
        self
    }

    /// Fail closed (default) or open when the store is unreachable.
    #[must_use]
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.cfg.on_store_error = policy;
        self
    }

    /// How to find the principal (default: the [`Principal`] extension).
    #[must_use]
    pub fn principal_from(
        mut self,
        f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.cfg.principal = Arc::new(f);
        self
    }

    /// Validates the settings. Metric handles (label `transport="http"`,
    /// `scope` the layer's scope without the per-principal suffix) are
    /// resolved here: install the metrics recorder before.
    pub fn build(self) -> Result<IdempotencyLayer<S>, HttpBuildError> {
        // The layer's scope is set only here, at `build`: a scope already
        // on the engine builder came with it.
        if self.engine.has_scope() {
            return Err(HttpBuildError::ScopeSetTwice);
        }
        validate_scope(&self.scope)?;
        if self.scope.len() > 90 {
            return Err(HttpBuildError::ScopeTooLong);
        }
        let retention = self.engine.retention_set().unwrap_or(self.retention);
        if retention.is_zero() {
            return Err(HttpBuildError::ZeroRetention);
        }
        let key = match self.engine.key_set() {
            Some(Ok(key)) => key.clone(),
            Some(Err(e)) => return Err(HttpBuildError::Key(e.clone())),
            None => return Err(HttpBuildError::Engine(BuildError::MissingKey)),
        };
        key.validate()?;
        #[cfg(feature = "providers")]
        let mut cfg = self.cfg;
        #[cfg(not(feature = "providers"))]
        let cfg = self.cfg;
        #[cfg(feature = "providers")]
        if let Some(provider) = cfg.provider.take() {
            if retention < provider.min_retention() {
                return Err(HttpBuildError::RetentionBelowRetries {
                    provider: provider.name(),
                    retention,
                    min: provider.min_retention(),
                });
            }
            if let crate::key::KeySource::Metadata { name, .. } = key.source() {
                return Err(HttpBuildError::UnsignedKey {
                    provider: provider.name(),
                    header: name.clone(),
                });
            }
            cfg.provider = Some(provider.with_retention(retention));
        }
        let engine = self
            .engine
            .scope(self.scope)
            .retention(retention)
            .build()
            .map_err(|e| match e {
                BuildError::Key(e) => HttpBuildError::Key(e),
                BuildError::Scope(e) => HttpBuildError::Scope(e),
                BuildError::ZeroRetention => HttpBuildError::ZeroRetention,
                other => HttpBuildError::Engine(other),
            })?;
        if engine.fence_spec().is_some() && matches!(cfg.mode, Mode::Header { required: false }) {
            return Err(HttpBuildError::FenceWithoutKey);
        }
        #[cfg(feature = "providers")]
        if let (Some(fence), Some(provider)) = (engine.fence_spec(), cfg.provider.as_ref()) {
            check_fence_signed(fence, provider)?;
        }
        Ok(IdempotencyLayer::from_config(Config { engine, http: cfg }))
    }
}

/// Refuses a fence that reads a field the provider's route never hands
/// the handler: a provider whose payload holds its signed fields only
/// (Adyen) would answer every callback `400` (the field is missing), and
/// the provider gives up on them. Tried on a payload with every signed
/// field present.
#[cfg(feature = "providers")]
fn check_fence_signed(
    fence: &crate::FenceSpec,
    provider: &super::providers::Provider,
) -> Result<(), HttpBuildError> {
    let Some(sample) = provider.signed_payload_sample() else {
        return Ok(());
    };
    match fence.derive(&crate::Delivery::new(sample)) {
        Err(crate::KeyError::MissingField { pointer }) => Err(HttpBuildError::FenceFieldUnsigned {
            provider: provider.name(),
            pointer,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
#[cfg(feature = "sqlite")]
mod tests {
    use super::*;
    use crate::SqliteStore;
    use crate::http::IdempotencyLayer;

    async fn store() -> SqliteStore {
        SqliteStore::connect("sqlite::memory:").await.unwrap()
    }

    /// The scope is the constructor's: an engine builder that names one
    /// too is refused rather than one of them silently winning; the
    /// engine builder's retention overrides the layer's default.
    #[tokio::test]
    async fn the_scope_has_one_home_and_the_engine_builder_overrides_defaults() {
        let err =
            IdempotencyLayer::idempotency_key(Engine::builder(store().await).scope("x"), "orders")
                .build()
                .err()
                .unwrap();
        assert!(matches!(err, HttpBuildError::ScopeSetTwice), "{err:?}");
        let default = IdempotencyLayer::idempotency_key(store().await, "orders")
            .build()
            .unwrap();
        assert_eq!(default.config().engine.scope(), "orders");
        assert_eq!(
            default.config().engine.retention(),
            Duration::from_secs(24 * 3600)
        );
        let layer = IdempotencyLayer::idempotency_key(
            Engine::builder(store().await).retention(Duration::from_secs(60)),
            "orders",
        )
        .build()
        .unwrap();
        assert_eq!(layer.config().engine.retention(), Duration::from_secs(60));
    }

    #[tokio::test]
    async fn an_invalid_engine_setting_is_named() {
        let err = IdempotencyLayer::idempotency_key(
            Engine::builder(store().await).max_deadline_misses(0),
            "orders",
        )
        .build()
        .err()
        .unwrap();
        assert!(
            matches!(
                err,
                HttpBuildError::Engine(BuildError::ZeroMaxDeadlineMisses)
            ),
            "{err:?}"
        );
        assert_eq!(err.to_string(), "max_deadline_misses must be at least 1");
    }

    /// Requests without a key would pass around the fence.
    #[tokio::test]
    async fn a_fence_needs_every_request_keyed() {
        let fence = || {
            crate::FenceSpec::new(
                KeySpec::json_field("/order"),
                crate::OrderSpec::integer("/version"),
            )
        };
        let err = IdempotencyLayer::idempotency_key(
            Engine::builder(store().await).fence(fence()),
            "orders",
        )
        .key_optional()
        .build()
        .err()
        .unwrap();
        assert!(matches!(err, HttpBuildError::FenceWithoutKey), "{err:?}");
        assert!(
            IdempotencyLayer::idempotency_key(
                Engine::builder(store().await).fence(fence()),
                "orders"
            )
            .build()
            .is_ok()
        );
    }
}
