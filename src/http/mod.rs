//! HTTP transport (feature `http`): an axum/tower layer that makes POST and
//! PATCH handlers idempotent with the `Idempotency-Key` header, or payment
//! callbacks idempotent on a body field, inside the handler's transaction.
//!
//! # Flow
//!
//! 1. Methods not covered (default: POST, PATCH) pass through.
//! 2. The body is buffered up to a limit (`413` beyond).
//! 3. An optional HMAC signature ([`SignatureCheck`]) and, with feature
//!    `providers`, a payment provider's own scheme
//!    ([`providers::Provider`]: Alipay, WeChat Pay v3, Stripe, GitHub-style,
//!    Adyen) are verified over the raw bytes received (`401` naming the
//!    reason, nothing claimed); a provider may turn the callback into
//!    another payload (decoded or decrypted) for the next steps.
//! 4. The key is derived (`400` if missing or malformed) and claimed, with
//!    the body's fingerprint, in a new transaction, in the scope of the
//!    layer and of the caller's [`Principal`] if there is one.
//! 5. A key already completed replays its stored status, allow-listed
//!    headers and body byte for byte, with `Idempotent-Replayed: true` (a
//!    payment callback gets the configured [`Ack`]); a key completed with
//!    another payload gets `422`; a key held by a request in flight gets
//!    `409` with `Retry-After` (or, with [`InFlight::WaitThenReplay`], the
//!    replay once it completes).
//! 6. Otherwise the handler runs with the claim's transaction ([`Tx`]
//!    extractor; the engine's [claim session](crate::engine::Session)).
//!    A 2xx response (and 4xx if configured) is stored in that same
//!    transaction, which then commits; only then is the response sent. A
//!    5xx, a 4xx not stored, or a panic rolls everything back and stores
//!    nothing, so the client may retry with the same key.
//!
//! Errors the layer answers itself are RFC 9457 `application/problem+json`
//! with `type` `urn:onceonly:problem:<code>`: `missing-idempotency-key`,
//! `invalid-idempotency-key` (400, also for a repeated `Idempotency-Key`
//! header), `undecodable-form` (400, a form body that is not UTF-8),
//! `missing-signature`, `malformed-signature`, `bad-signature`,
//! `stale-timestamp`, `unknown-serial`, `undecryptable-resource`,
//! `unsupported-signature`, `expired-callback` (401, see [`VerifyError`]),
//! `too-many-fields` (413, a form of more than [`MAX_FORM_FIELDS`] fields),
//! `request-in-flight` (409), `commit-refused` (409),
//! `body-too-large` (413),
//! `unsupported-charset` (415), `idempotency-key-reused` (422),
//! `deadline` (500: the handler missed its transaction deadline
//! [`max_deadline_misses`](crate::EngineBuilder::max_deadline_misses)
//! times for this key; its counter starts over),
//! `store-unavailable` (503, also for a handler that missed its
//! transaction deadline fewer times).
//!
//! # Failures of the store
//!
//! Classified once (see [`InfraFault`](crate::store::InfraFault)):
//!
//! | before the handler runs | answer |
//! |---|---|
//! | lock contention (the key is in flight, a deadlock, SQLite busy) | `409` with `Retry-After` (or wait and replay, see [`InFlight`]); never fail-open, since the request holding the key may still commit |
//! | the database cannot be reached at all | `503`, or the handler without dedup with [`OnStoreError::FailOpen`] (never for a pool exhausted by the service's own in-flight requests: `503`) |
//! | any other state of the database (read-only, missing table, no privilege, out of resources, shutting down, statement timeout) | `503` with `Retry-After` |
//! | a value of the request does not fit the store | `400` |
//!
//! A failed commit after the handler ran is `503`: the outcome is unknown
//! until the client retries with the same key. A commit the database
//! refused because of the request's own writes (a deferred constraint, a
//! constraint trigger, a transaction the handler left aborted: see
//! [`is_write_fault`](crate::store::is_write_fault)) is `409`
//! `commit-refused`: nothing was kept, and the same request would fail the
//! same way.
//!
//! # Expiry policy
//!
//! Keys and responses are kept for the layer's retention (default 24 hours,
//! [`IdempotencyLayerBuilder::retention`]); a key reused after that is a new
//! request. Publish this to your clients, as the IETF draft asks.

mod answer;
mod config;
pub(crate) mod form;
mod layer;
mod problem;
#[cfg(feature = "providers")]
#[cfg_attr(docsrs, doc(cfg(feature = "providers")))]
pub mod providers;
mod refusals;
mod request;
mod signature;
mod stored;
mod tx;
mod verify;

pub use crate::engine::{Tx, TxGone, TxGuard};
pub use config::{
    Ack, HttpBuildError, IdempotencyLayerBuilder, InFlight, OnStoreError, Principal, PrincipalFn,
};
pub use form::MAX_FORM_FIELDS;
pub use layer::{IdempotencyLayer, Idempotent};
pub use signature::{MAX_SIGNATURES, MIN_SECRET_LEN, SecretError, SignatureCheck, SignatureError};
pub use tx::TxRejection;
pub use verify::VerifyError;
