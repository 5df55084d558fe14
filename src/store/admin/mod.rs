//! Operations queries on the dedup table: statistics, record search, counts
//! and purging by age. These run from the `onceonly` CLI and from maintenance
//! jobs, never on the delivery path, so their SQL is built per call.
//!
//! Purges are bounded: each statement deletes within one primary-key range
//! of at most `batch` rows, so none holds locks on more than one batch.
//! Statistics and searches without a key read the whole table or scope
//! (there is no index on the claim time or the source): run them against a
//! replica when the table is very large.

mod query;
mod run;

use async_trait::async_trait;

use super::{Record, SqlStore, StoreError};

/// Upper bounds (exclusive, in ms of age) of the age buckets in
/// [`ScopeStats::age_buckets`]; the last bucket is "older than the last bound".
pub const AGE_BUCKETS_MS: [i64; 5] = [
    3_600_000,        // 1 hour
    86_400_000,       // 1 day
    7 * 86_400_000,   // 7 days
    30 * 86_400_000,  // 30 days
    365 * 86_400_000, // 365 days
];

/// Labels of the buckets of [`ScopeStats::age_buckets`], in order.
pub const AGE_BUCKET_LABELS: [&str; 6] = ["<1h", "1h-1d", "1d-7d", "7d-30d", "30d-1y", ">=1y"];

/// Statistics of one scope of the dedup table.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ScopeStats {
    /// The scope.
    pub scope: String,
    /// How many records the scope holds, expired or not.
    pub records: u64,
    /// How many of them have expired and wait to be purged.
    pub expired: u64,
    /// How many were claimed but hold no result (a handler whose output
    /// was not stored).
    pub without_result: u64,
    /// Creation time of the oldest record, in ms since the Unix epoch.
    pub oldest_ms: Option<i64>,
    /// Creation time of the newest record, in ms since the Unix epoch.
    pub newest_ms: Option<i64>,
    /// Record counts by age, bucketed by [`AGE_BUCKETS_MS`] (labels in
    /// [`AGE_BUCKET_LABELS`]).
    pub age_buckets: [u64; 6],
}

/// Which records [`AdminStore::find`] returns.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RecordFilter {
    /// Only this scope.
    pub scope: Option<String>,
    /// Only this exact key.
    pub key: Option<String>,
    /// Only records whose source starts with this prefix (e.g. `payments/3@`),
    /// compared byte for byte (case-sensitive on every backend).
    pub source_prefix: Option<String>,
    /// At most this many records (newest first).
    pub limit: u32,
}

impl Default for RecordFilter {
    /// All records, at most 100.
    fn default() -> Self {
        Self::new(100)
    }
}

impl RecordFilter {
    /// A filter returning at most `limit` records (at least 1).
    pub fn new(limit: u32) -> Self {
        Self {
            scope: None,
            key: None,
            source_prefix: None,
            limit: limit.max(1),
        }
    }

    /// Only records of `scope`.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Only the record with `key`.
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only records whose source starts with `prefix`.
    #[must_use]
    pub fn source_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.source_prefix = Some(prefix.into());
        self
    }
}

/// Which records [`AdminStore::count`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CountFilter {
    /// All of them.
    All,
    /// Those expired at this time (ms since the Unix epoch).
    ExpiredAt(i64),
    /// Those created before this time (ms since the Unix epoch).
    CreatedBefore(i64),
    /// Those created before `cutoff_ms` that have not expired at `now_ms`:
    /// what a purge by age would delete although its retention still holds.
    LiveCreatedBefore {
        /// Creation cutoff, ms since the Unix epoch.
        cutoff_ms: i64,
        /// Now, ms since the Unix epoch.
        now_ms: i64,
    },
}

/// Where a purge by age resumes: the last primary key it examined.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeCursor {
    /// Scope of the last examined record.
    pub scope: String,
    /// Key of the last examined record.
    pub key: String,
}

/// One step of [`AdminStore::purge_created_before`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeStep {
    /// Records examined in this step (at most the batch size).
    pub scanned: u64,
    /// Records deleted in this step.
    pub deleted: u64,
    /// Where the next step starts; `None` once the table was walked to its end.
    pub next: Option<PurgeCursor>,
}

/// Operations queries a SQL backend answers, beyond the delivery path of
/// [`SqlStore`].
#[async_trait]
pub trait AdminStore: SqlStore {
    /// Checks that the dedup table and its attempts table
    /// ([`TableName::attempts`](super::TableName::attempts)) have every
    /// column this version reads, without reading a row.
    async fn check_columns(&self) -> Result<(), StoreError>;

    /// Per-scope statistics (only `scope`, if given), ordered by scope.
    /// Scans the table (or the scope): an operator's query, not a hot path.
    async fn stats(&self, scope: Option<&str>, now_ms: i64) -> Result<Vec<ScopeStats>, StoreError>;

    /// Records matching `filter`, newest first.
    async fn find(&self, filter: &RecordFilter) -> Result<Vec<Record>, StoreError>;

    /// How many records the table (or `scope`) holds that match `which`.
    /// [`CountFilter::ExpiredAt`] is answered from the expiry index; the
    /// others scan the table or the scope.
    async fn count(&self, scope: Option<&str>, which: CountFilter) -> Result<u64, StoreError>;

    /// Deletes records created before `cutoff_ms`, expired or not, walking
    /// the primary key in order: this step reads the keys of at most `batch`
    /// records after `after` (from the start if `None`), then deletes the
    /// old ones among them with one statement bounded to that key range.
    /// Call it again with [`PurgeStep::next`] until that is `None`. Each
    /// step reads one bounded index range, so the cost does not depend on
    /// how many records are young, and no index on the creation time is
    /// needed.
    async fn purge_created_before(
        &self,
        scope: Option<&str>,
        cutoff_ms: i64,
        after: Option<&PurgeCursor>,
        batch: u32,
    ) -> Result<PurgeStep, StoreError>;
}

/// Turns cumulative "younger than bound" counts into per-bucket counts.
pub(crate) fn buckets(younger_than: [i64; 5], oldest_bucket: i64) -> [u64; 6] {
    let mut out = [0; 6];
    let mut prev = 0;
    for (i, c) in younger_than.iter().enumerate() {
        out[i] = u64::try_from(c - prev).unwrap_or(0);
        prev = *c;
    }
    out[5] = u64::try_from(oldest_bucket).unwrap_or(0);
    out
}

/// A count column as `u64`.
pub(crate) fn count_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The outcome of one chunk, from the keys it read and the rows it deleted.
pub(crate) fn purge_step(
    scanned: usize,
    deleted: u64,
    last: Option<PurgeCursor>,
    batch: u32,
) -> PurgeStep {
    let scanned = scanned as u64;
    PurgeStep {
        scanned,
        deleted,
        next: last.filter(|_| scanned >= u64::from(batch.max(1))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cursor at `scope`, `key`.
    pub(super) fn cursor(scope: &str, key: &str) -> PurgeCursor {
        PurgeCursor {
            scope: scope.into(),
            key: key.into(),
        }
    }

    #[test]
    fn buckets_are_differences() {
        assert_eq!(buckets([1, 3, 3, 7, 9], 2), [1, 2, 0, 4, 2, 2]);
    }

    #[test]
    fn a_short_chunk_ends_the_walk() {
        assert_eq!(
            purge_step(3, 1, Some(cursor("s", "k")), 3).next,
            Some(cursor("s", "k"))
        );
        assert_eq!(purge_step(2, 1, Some(cursor("s", "k")), 3).next, None);
    }
}
