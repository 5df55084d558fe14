//! HTTP transport (feature `http`): an axum/tower layer that makes POST and
//! PATCH handlers idempotent with the `Idempotency-Key` header, or payment
//! callbacks idempotent on a body field, inside the handler's transaction.
//! The guide comes first; the table of every answer the layer gives
//! follows it ([Answers](#answers)).
//!
#![doc = include_str!("../../docs/http.md")]
//!
//! # Answers
//!
//! What the layer answers, besides the handler's own response. This is the
//! one table of HTTP failures; the rest of the documentation links here.
//!
//! | Situation | Response |
//! |---|---|
//! | Method not covered (default: POST, PATCH; callbacks: POST) | Passes through |
//! | Body over `max_request_body` (default 1 MiB) | `413` `body-too-large` |
//! | A form of more than 256 fields | `413` `too-many-fields`, before anything is decoded |
//! | Bad, stale or missing signature (when configured), or a payment provider's callback that does not verify | `401`, nothing claimed; the problem `type` names the reason (see [`VerifyError`]): `missing-signature`, `malformed-signature`, `bad-signature`, `stale-timestamp`, `unknown-serial`, `undecryptable-resource`, `unsupported-signature`, `expired-callback` |
//! | Key missing (`key_optional()` lets it through without dedup) | `400` `missing-idempotency-key` |
//! | Key malformed: too long, not a UUID with `KeySpec::uuid_header`, control characters, repeated header | `400` `invalid-idempotency-key` (a structured-field string `"abc"` is unquoted first, as the draft sends it) |
//! | Form body (`application/x-www-form-urlencoded`) that is not UTF-8 and declares no other charset | `400` `undecodable-form` (never lossy decoding into one key) |
//! | Form body in a charset other than UTF-8 or ISO-8859-1 (and, with feature `providers`, GBK and GB18030) | `415` `unsupported-charset` |
//! | A value of the request does not fit the store | `400` |
//! | Key completed with the same payload fingerprint | Stored status, allow-listed headers and body, byte for byte, plus `Idempotent-Replayed: true`; payment callbacks get the configured [`Ack`] (e.g. `200 success`) |
//! | Key completed with another payload, or sent to another method, path or query | `422` `idempotency-key-reused` |
//! | Key held by a request in flight, or any lock contention before the handler runs (Postgres `55P03`/`40001`/`40P01`, MySQL 1205/1213, SQLite `BUSY` after the busy timeout) | `409` `request-in-flight` with `Retry-After` after waiting `InFlight::Conflict { wait }` (default 50 ms); [`InFlight::WaitThenReplay`] waits and replays. Never fail-open: the request holding the key may still commit |
//! | Store unreachable (connection refused or lost, pool timed out) | `503` `store-unavailable` with `Retry-After` (fail closed, default); [`OnStoreError::FailOpen`] runs the handler without dedup and without `Tx`, logging an error for every request; never for a pool exhausted by the service's own in-flight requests: `503` |
//! | Store reachable but unable to take writes (read-only, missing table, no privilege, out of resources, shutting down, statement timeout; see [`InfraFault`](crate::store::InfraFault)) | `503` `store-unavailable` with `Retry-After`, never fail-open |
//! | The handler answered 5xx, a 4xx not stored (see `store_client_errors`), or panicked | its own answer (a panic: `500` `handler-panicked`); everything rolled back, nothing stored: the client may retry with the same key |
//! | The handler missed its transaction deadline, fewer than [`max_deadline_misses`](crate::EngineBuilder::max_deadline_misses) times for this key | `503` `store-unavailable` |
//! | The handler missed its transaction deadline `max_deadline_misses` times for this key | `500` `deadline`; its counter starts over |
//! | The commit failed after the handler ran | `503`: the outcome is unknown until the client retries with the same key, which then replays the response or runs the request |
//! | The database refused the commit because of the request's own writes (a deferred constraint, a constraint trigger, a transaction the handler left aborted: see [`is_write_fault`](crate::store::is_write_fault)) | `409` `commit-refused`: nothing was kept, and the same request would fail the same way |
//!
//! Every error the layer answers itself is RFC 9457
//! `application/problem+json` with `type` `urn:onceonly:problem:<code>`,
//! the code named in the table.

mod answer;
mod config;
mod fence;
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
pub use layer::{IdempotencyLayer, Idempotent};
pub use signature::{SecretError, SignatureCheck, SignatureError};
pub use tx::TxRejection;
pub use verify::VerifyError;
