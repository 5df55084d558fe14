#![doc = include_str!("crate_doc.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
// Without any SQL backend (a Redis-only build, say) the store and outbox
// internals have no user: their dead code is expected there, not a defect.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code, unused_imports, unused_macros)
)]

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub mod amqp;
#[cfg(feature = "_broker")]
mod broker;
pub mod clock;
pub mod delivery;
pub mod engine;
pub mod fingerprint;
pub mod header;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
pub mod key;
pub mod ops;
#[cfg(feature = "otel")]
mod otel;
pub mod outbox;
pub mod redact;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "schema-registry")]
#[cfg_attr(docsrs, doc(cfg(feature = "schema-registry")))]
pub mod schema_registry;
pub mod store;
mod sync;
pub mod telemetry;

#[cfg(feature = "_broker")]
#[cfg_attr(docsrs, doc(cfg(any(feature = "amqp", feature = "kafka"))))]
pub use broker::{ConsumerStats, PausePolicy};
pub use clock::{Clock, ManualClock, SystemClock};
pub use delivery::Delivery;
pub use engine::{
    BuildError, DecodeError, Engine, EngineBuilder, Failure, FenceCheck, FromDelivery, Handler,
    HandlerError, Json, Outcome, OutcomeKind, Rejection, Report, RetryPolicy, Stale, StepError, Tx,
    handler_fn,
};
pub use fingerprint::{Fingerprint, FingerprintSpec};
pub use header::Header;
pub use key::{
    FenceSpec, FenceValue, IdemKey, KeyError, KeySpec, KeySpecError, Order, OrderBuilder, OrderSpec,
};
pub use redact::KeyRedaction;
#[cfg(feature = "mysql")]
pub use store::mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::postgres::PgStore;
#[cfg(feature = "sqlite")]
pub use store::sqlite::SqliteStore;
pub use store::{SqlStore, StoreError};

/// The README's examples, compiled as doctests: the README is no longer
/// the crate documentation (`src/crate_doc.md` is), but its Rust blocks
/// must keep compiling.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}
