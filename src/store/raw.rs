//! Below the engine: claims one by one.
//!
//! The [`Engine`](crate::Engine) and the transports are what an
//! application uses; this module is the door for what sits below them:
//! tests and tools that drive a store's claims directly, and the Redis
//! tier ([`CacheTier`], implemented by
//! [`CachedStore`](crate::redis::CachedStore)). Its types are what
//! [`SqlStore`](super::SqlStore)'s hidden claim methods take and return.
//! They are public so that they can be reached, not a promise: they change
//! with the engine, without a major version, until the store interface is
//! stabilized. [`SqlStore`](super::SqlStore) is sealed: the stores are the
//! ones this crate ships (`PgStore`, `MySqlStore`, `SqliteStore`, and
//! `CachedStore` around any of them).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::fingerprint::Fingerprint;

pub use super::Rotations;
pub use super::claim_tx::ClaimTx;
pub use super::fence::FenceRecord;
pub use super::steps::{OrphanedStep, StepRecord};
pub use super::tier::{CacheTier, CachedRecord, Completed};

/// Truncates a source string to the stored length (512 bytes) on a
/// character boundary, as a claim stores it.
pub fn clamp_source(source: &str) -> &str {
    super::clamp_source(source)
}

/// One key to claim.
#[derive(Clone, Copy, Debug)]
pub struct ClaimRequest<'a> {
    /// The validated key.
    pub key: &'a str,
    /// The payload fingerprint, if fingerprints are enabled.
    pub fingerprint: Option<&'a Fingerprint>,
    /// Source coordinates for audits, e.g. `payments/3@1042`.
    pub source: Option<&'a str>,
    /// How long the claim may wait for the key while another transaction
    /// holds it (a request in flight) before it fails with contention
    /// ([`StoreError::is_contention`](crate::StoreError::is_contention)). `None`: the store's own bound (the
    /// lock timeout of [`PgStore`](crate::store::postgres::PgStore),
    /// SQLite's busy timeout, MySQL's `innodb_lock_wait_timeout`).
    /// PostgreSQL applies it to the claim's own statement only, in the same
    /// round trip; the other backends keep their own bound.
    pub lock_wait: Option<Duration>,
}

impl<'a> ClaimRequest<'a> {
    /// A request for `key`, without fingerprint, source or lock wait.
    pub fn new(key: &'a str) -> Self {
        Self {
            key,
            fingerprint: None,
            source: None,
            lock_wait: None,
        }
    }
}

/// The clock values of a claim: records expire at `expires_at_ms`; a record
/// whose `expires_at_ms <= now_ms` is treated as absent and may be reclaimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimTimes {
    /// Now, in milliseconds since the Unix epoch.
    pub now_ms: i64,
    /// Expiry of a new claim, in milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
}

impl ClaimTimes {
    /// `now_ms` plus a retention window.
    pub fn new(now_ms: i64, retention: Duration) -> Self {
        let ttl = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        Self {
            now_ms,
            expires_at_ms: now_ms.saturating_add(ttl),
        }
    }
}

/// What a claim found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The key is new (or its record had expired): the caller owns it until
    /// its transaction ends.
    Claimed,
    /// The key was already committed with the same payload.
    Duplicate {
        /// The stored result, `None` if none was recorded.
        result: Option<Vec<u8>>,
    },
    /// The key was already committed with another payload fingerprint.
    Conflict {
        /// The fingerprint stored with the key.
        stored: Option<Fingerprint>,
    },
    /// Batch claims only: the same key appeared earlier in the same batch, at
    /// this index, with the same fingerprint. Its outcome is that entry's.
    InBatch {
        /// Index of the first occurrence.
        first: usize,
    },
}

/// A stored record, as read back by [`SqlStore::get`](crate::SqlStore::get).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The scope (consumer group, queue or handler name).
    pub scope: String,
    /// The key.
    pub key: String,
    /// The payload fingerprint.
    pub fingerprint: Option<Fingerprint>,
    /// The stored result bytes.
    pub result: Option<Vec<u8>>,
    /// Source coordinates.
    pub source: Option<String>,
    /// When the record was claimed, in ms since the Unix epoch.
    pub created_at_ms: i64,
    /// When the record expires, in ms since the Unix epoch.
    pub expires_at_ms: i64,
}

impl Record {
    /// `created_at_ms` as a [`SystemTime`].
    pub fn created_at(&self) -> SystemTime {
        from_ms(self.created_at_ms)
    }

    /// `expires_at_ms` as a [`SystemTime`].
    pub fn expires_at(&self) -> SystemTime {
        from_ms(self.expires_at_ms)
    }
}

fn from_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
