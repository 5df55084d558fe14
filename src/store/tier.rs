//! The seam for a cache tier in front of a SQL store (the Redis tier): it
//! answers completed keys before any SQL runs and learns of keys after
//! their transaction committed.

use async_trait::async_trait;

use super::{Claim, ClaimRequest, classify_existing};
use crate::fingerprint::Fingerprint;

/// A completed key as a cache tier remembers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedRecord {
    /// Its payload fingerprint, if one was stored.
    pub fingerprint: Option<Fingerprint>,
    /// Its stored result.
    pub result: Option<Vec<u8>>,
}

impl CachedRecord {
    /// What a claim of `req` would have found in the database.
    pub fn classify(self, req: &ClaimRequest<'_>) -> Claim {
        classify_existing(self.fingerprint, self.result, req)
    }
}

/// A key whose transaction committed, for [`CacheTier::committed`].
#[derive(Clone, Copy, Debug)]
pub struct Completed<'a> {
    /// The scope.
    pub scope: &'a str,
    /// The key.
    pub key: &'a str,
    /// Its fingerprint.
    pub fingerprint: Option<&'a Fingerprint>,
    /// Its stored result.
    pub result: &'a [u8],
    /// The claim time the expiry was computed from (the engine's clock).
    pub now_ms: i64,
    /// When the record expires, in milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
}

/// A cache of completed keys in front of a [`SqlStore`](super::SqlStore),
/// returned by [`SqlStore::tier`](super::SqlStore::tier). The database stays
/// the authority: the tier may forget, but never invents a key.
#[async_trait]
pub trait CacheTier: Send + Sync {
    /// Whether `key` is known to be completed, *before* any SQL runs:
    /// `Some` is final (a duplicate, or a conflict if the fingerprint
    /// differs); `None` means "ask the database".
    async fn cached(&self, scope: &str, key: &str) -> Option<CachedRecord>;

    /// Called after the transaction that completed `done.key` committed,
    /// never before. Best effort.
    async fn committed(&self, done: &Completed<'_>);
}
