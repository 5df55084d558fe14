//! Dedup records and the SQL stores that claim them inside the caller's
//! transaction. A record is `(scope, key)` → fingerprint, result, source,
//! created_at, expires_at, under a primary key on `(scope, key)`; the claim
//! is an insert in the same transaction as the handler's business writes,
//! so the key is done together with its effects or, if the transaction
//! rolls back, not at all. One store per backend, each behind its cargo
//! feature: [`PgStore`](crate::store::postgres::PgStore) (`postgres`),
//! [`MySqlStore`](crate::store::mysql::MySqlStore) (`mysql`, also MariaDB),
//! [`SqliteStore`](crate::store::sqlite::SqliteStore) (`sqlite`).
//!
#![doc = include_str!("../../docs/stores.md")]

pub(crate) mod admin;
mod backend;
mod base;
mod batch;
mod claim;
pub(crate) mod claim_tx;
pub(crate) mod deadline;
pub(crate) mod dialect;
pub(crate) mod error;
mod fence;
pub(crate) mod forward;
pub mod raw;
mod rows;
mod side;
mod sql;
mod steps;
mod table;
mod tier;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use std::time::Duration;

use async_trait::async_trait;
use sqlx::{Database, Pool, Transaction};

use crate::fingerprint::Fingerprint;

pub(crate) use backend::Backend;
pub(crate) use claim_tx::ClaimTx;
pub use deadline::{DeadlineMissed, Deadlines, TcpKeepalive, pool_options_for};
pub(crate) use dialect::Dialect;
pub use dialect::Layout;
pub use error::{InfraFault, StoreError, infra_fault, is_write_fault, pool_options};
pub(crate) use fence::FenceRecord;
pub(crate) use raw::{Claim, ClaimRequest, ClaimTimes, Record};
pub(crate) use steps::STARTED_PREFIX;
pub(crate) use steps::{OrphanedStep, StepRecord};
pub use table::TableName;
pub(crate) use tier::{CacheTier, Completed};

/// The default dedup table name.
pub const DEFAULT_TABLE: &str = "onceonly_keys";

/// The largest scope length in bytes.
pub(crate) const MAX_SCOPE_LEN: usize = 128;

/// The largest source length in bytes; longer sources are truncated on a character boundary.
pub(crate) const MAX_SOURCE_LEN: usize = 512;

/// A SQL dedup store: the seam between the engine and a database backend.
///
/// Claims and completions run on the caller's open transaction (`conn`), so
/// they commit or roll back together with the handler's writes.
///
/// Sealed: implemented by the stores this crate ships ([`PgStore`](crate::PgStore),
/// [`MySqlStore`](crate::MySqlStore), [`SqliteStore`](crate::SqliteStore),
/// and [`CachedStore`](crate::redis::CachedStore) around any of them). What
/// an application calls is documented here; the claim methods the engine
/// calls are hidden, and their types live in [`raw`].
#[async_trait]
pub trait SqlStore: sealed::Sealed + Clone + Send + Sync + 'static {
    /// The sqlx database of this backend.
    type Db: Database;

    /// The connection pool.
    fn pool(&self) -> &Pool<Self::Db>;

    /// The dedup table.
    fn table(&self) -> &TableName;

    /// Creates the dedup table, its attempts table
    /// ([`TableName::attempts`]) and their indexes if they do not exist.
    /// Safe to run concurrently from several processes.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Begins a transaction with the isolation this backend's claim relies on.
    async fn begin(&self) -> Result<Transaction<'static, Self::Db>, StoreError>;

    /// The bounds of this store's calls, and of the transactions the
    /// engine runs on it (see [`Deadlines`]; default
    /// [`Deadlines::default`]).
    fn deadlines(&self) -> Deadlines {
        Deadlines::default()
    }

    /// The cache tier in front of this store, if any (see
    /// [`CacheTier`]); plain SQL stores have none.
    #[doc(hidden)]
    fn tier(&self) -> Option<&dyn CacheTier> {
        None
    }

    /// Claims `req.key` in `scope` inside the open transaction `conn`.
    #[doc(hidden)]
    async fn claim(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError>;

    /// Begins a claim transaction and claims `req.key` in it: the open
    /// transaction when the key is new ([`Claim::Claimed`]), what the
    /// claim found otherwise (the transaction ended, nothing written).
    /// The default is [`begin`](Self::begin), then [`claim`](Self::claim):
    /// two round trips. A [pipelined](crate::PgStore::pipelined)
    /// [`PgStore`](crate::PgStore) sends the claim with its `BEGIN`, in one.
    #[doc(hidden)]
    async fn open_claim(
        &self,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Result<ClaimTx<Self::Db>, Claim>, StoreError> {
        open_by_statements(self, scope, times, req).await
    }

    /// Records `result` with the claimed `key`, deletes its attempts
    /// counter if `clear_attempts` (a [suspect](crate::Delivery::with_suspect)
    /// that finished), and commits `tx`. The transaction has ended when
    /// this returns: an error rolled it back, or is the commit's own (then
    /// it may or may not have committed). The default runs
    /// [`complete`](Self::complete), [`clear_attempts`](Self::clear_attempts)
    /// and `COMMIT`, one round trip each; a
    /// [pipelined](crate::PgStore::pipelined) [`PgStore`](crate::PgStore)
    /// sends them in one.
    #[doc(hidden)]
    async fn finish_claim(
        &self,
        tx: ClaimTx<Self::Db>,
        scope: &str,
        key: &str,
        result: &[u8],
        clear_attempts: bool,
    ) -> Result<(), StoreError> {
        finish_by_statements(self, tx, scope, key, result, clear_attempts).await
    }

    /// Claims `req.key` inside `conn` with `result` recorded at once: the
    /// claim of an [optimistic](crate::EngineBuilder::optimistic) engine,
    /// made after its handler ran, in one statement when the key is new.
    /// The default is [`claim`](Self::claim), then
    /// [`complete`](Self::complete) when claimed.
    #[doc(hidden)]
    async fn claim_completed(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
        result: &[u8],
    ) -> Result<Claim, StoreError> {
        let claim = self.claim(conn, scope, times, req).await?;
        if claim == Claim::Claimed {
            self.complete(conn, scope, req.key, result).await?;
        }
        Ok(claim)
    }

    /// Claims many keys inside the open transaction `conn`; one [`Claim`] per
    /// request, in order. A later occurrence of a key inside the batch with
    /// the first occurrence's fingerprint is [`Claim::InBatch`]; one with
    /// another fingerprint is claimed after the first occurrences, against
    /// the record as it then stands in this transaction (a
    /// [`Claim::Conflict`] with the first occurrence's claim, or with a
    /// stored record of another fingerprint; a [`Claim::Duplicate`] of a
    /// stored record with its own fingerprint).
    #[doc(hidden)]
    async fn claim_batch(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError>;

    /// Looks the keys of a batch up inside the open transaction `conn`
    /// without claiming them: the first step of an
    /// [optimistic](crate::EngineBuilder::optimistic) batch, before its
    /// handlers run. One [`Claim`] per request, in order:
    /// [`Claim::Claimed`] for a key that is free (absent, or its record
    /// expired), to be claimed with its result by
    /// [`claim_completed_batch`](Self::claim_completed_batch);
    /// [`Claim::Duplicate`] or [`Claim::Conflict`] for a committed key;
    /// later occurrences inside the batch as in
    /// [`claim_batch`](Self::claim_batch). Nothing is locked: a key taken
    /// meanwhile shows at the claim. The default finds every key free.
    #[doc(hidden)]
    async fn lookup_batch(
        &self,
        _conn: &mut <Self::Db as Database>::Connection,
        _scope: &str,
        _times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let free = |_: &ClaimRequest<'_>| Claim::Claimed;
        Ok(reqs.iter().map(free).collect())
    }

    /// Claims many keys inside `conn` with their results (`results[i]`
    /// for `reqs[i]`), after their handlers ran: the claim of an
    /// [optimistic](crate::EngineBuilder::optimistic) batch, in one
    /// statement on PostgreSQL. One [`Claim`] per request; anything but
    /// [`Claim::Claimed`] means that key was committed meanwhile, and the
    /// caller must roll the transaction back. The default is one
    /// [`claim_completed`](Self::claim_completed) per key.
    #[doc(hidden)]
    async fn claim_completed_batch(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
        results: &[&[u8]],
    ) -> Result<Vec<Claim>, StoreError> {
        let mut claims = Vec::with_capacity(reqs.len());
        for (req, result) in reqs.iter().zip(results) {
            claims.push(
                self.claim_completed(conn, scope, times, req, result)
                    .await?,
            );
        }
        Ok(claims)
    }

    /// Records the result of a claimed key, in the same transaction as the claim.
    #[doc(hidden)]
    async fn complete(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        key: &str,
        result: &[u8],
    ) -> Result<(), StoreError>;

    /// Records the results of many claimed keys, in the same transaction
    /// as their claims; one statement where the backend allows (PostgreSQL),
    /// one [`complete`](Self::complete) per key otherwise.
    #[doc(hidden)]
    async fn complete_many(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        results: &[(&str, &[u8])],
    ) -> Result<(), StoreError> {
        for (key, result) in results {
            self.complete(conn, scope, key, result).await?;
        }
        Ok(())
    }

    /// Reads one committed record (expired or not).
    async fn get(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError>;

    /// Counts one more start of the handler of `key` in `scope` for a
    /// delivery that may be a redelivery after a crash (a *suspect*), and
    /// returns the count: 1 for a first start, or for a counter that had
    /// expired at `times.now_ms`. The counter lives in the attempts table
    /// next to the dedup table ([`TableName::attempts`]); the statement
    /// runs on its own pool connection and is committed when this returns,
    /// so that a crash in the handler that follows cannot undo it. One
    /// statement, one round trip, on every backend. The row expires at
    /// `times.expires_at_ms`.
    #[doc(hidden)]
    async fn bump_attempts(
        &self,
        scope: &str,
        key: &str,
        times: ClaimTimes,
    ) -> Result<u32, StoreError>;

    /// Takes one start off `key`'s counter (never below 0), in its own
    /// statement: the handler that was counted returned, so that start did
    /// not crash the process.
    #[doc(hidden)]
    async fn undo_attempt(&self, scope: &str, key: &str) -> Result<(), StoreError>;

    /// Deletes `key`'s counter on `conn`: inside the claim's transaction
    /// when the handler succeeded (the counter goes with the commit), on a
    /// connection of its own otherwise.
    #[doc(hidden)]
    async fn clear_attempts(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        key: &str,
    ) -> Result<(), StoreError>;

    /// Deletes at most `limit` records that expired at or before `now_ms`
    /// (in `scope` only, if given), in one short transaction; returns how many
    /// were deleted. Call it in a loop until it returns less than `limit`.
    /// Expired attempts counters ([`SqlStore::bump_attempts`]) are deleted
    /// too, within the same `limit`, once no expired record is left.
    #[doc(hidden)]
    async fn purge_expired(
        &self,
        scope: Option<&str>,
        now_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError>;

    /// Moves `entity`'s fence in `scope` forward to `order` inside the
    /// claim's open transaction `conn`, and returns the order the fence
    /// then holds: `order` itself when it is the highest so far (or ties
    /// it, or the fence had expired at `now_ms`), the higher stored order
    /// otherwise (the delivery is stale). One statement on PostgreSQL and
    /// SQLite, two on MySQL; the fence's row stays locked until the
    /// transaction ends, and expires at `expires_at_ms` (see
    /// [`TableName::fence`]).
    #[doc(hidden)]
    async fn advance_fence(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        entity: &str,
        order: &[u8],
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<u8>, StoreError>;

    /// `entity`'s fence in `scope`, as committed (expired or not).
    #[doc(hidden)]
    async fn fence(&self, scope: &str, entity: &str) -> Result<Option<FenceRecord>, StoreError>;

    /// Whether a step can be recorded on its own while the claim's
    /// transaction is open: not on SQLite, whose one writer is that
    /// transaction.
    #[doc(hidden)]
    fn records_steps(&self) -> bool;

    /// `key`'s finished step `step` in `scope`, unless expired at
    /// `now_ms`; read on `conn` (the claim's transaction reads the steps
    /// committed beside it).
    #[doc(hidden)]
    async fn step(
        &self,
        conn: &mut <Self::Db as Database>::Connection,
        scope: &str,
        key: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<Option<StepRecord>, StoreError>;

    /// Records `key`'s finished step `step` with its `result`, committed
    /// on its own (not in the claim's transaction) before this returns,
    /// unless a live record is there; returns the record that stands
    /// (ours, or that of a concurrent attempt that finished first).
    #[doc(hidden)]
    async fn record_step(
        &self,
        scope: &str,
        key: &str,
        step: &str,
        fingerprint: Option<&[u8]>,
        result: &[u8],
        times: ClaimTimes,
    ) -> Result<StepRecord, StoreError>;

    /// Every step of `key` in `scope`, oldest first (expired or not); a
    /// step whose call started and never recorded its result as
    /// `<step> (started; its outcome is unknown)`, with an empty result.
    #[doc(hidden)]
    async fn steps(&self, scope: &str, key: &str) -> Result<Vec<StepRecord>, StoreError>;

    /// At most `limit` live steps that finished before `created_before_ms`
    /// and whose key has no live record at `now_ms`: the handler's
    /// transaction never committed after the step's call (see
    /// [`Completer`](crate::ops::Completer)).
    #[doc(hidden)]
    async fn orphaned_steps(
        &self,
        created_before_ms: i64,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<OrphanedStep>, StoreError>;

    /// The rotations of a table of PostgreSQL's generations layout at
    /// `now_ms` (two cheap reads: the control table, the newest expiry of
    /// the other generation); `None` for every other table. The
    /// [`Purger`](crate::ops::Purger) reports them in its metrics.
    #[doc(hidden)]
    async fn rotations(&self, _now_ms: i64) -> Result<Option<Rotations>, StoreError> {
        Ok(None)
    }
}

/// The rotations of a dedup table of PostgreSQL's generations layout (see
/// [`SqlStore::rotations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rotations {
    /// When the table last rotated, in ms since the Unix epoch (0: never).
    pub rotated_at_ms: i64,
    /// Since when a rotation has been possible (the other generation holds
    /// no live record since then), in ms since the Unix epoch; `None`
    /// while a record of the other generation is live. A rotation that
    /// stays possible for long without happening is starved (claim
    /// transactions that always overlap hold its fence off).
    pub possible_since_ms: Option<i64>,
}

/// [`SqlStore::open_claim`] by [`begin`](SqlStore::begin), then
/// [`claim`](SqlStore::claim).
pub(crate) async fn open_by_statements<S: SqlStore>(
    store: &S,
    scope: &str,
    times: ClaimTimes,
    req: &ClaimRequest<'_>,
) -> Result<Result<ClaimTx<S::Db>, Claim>, StoreError> {
    let began = std::time::Instant::now();
    let mut tx = ClaimTx::new(store.begin().await?, began);
    let bound = store.deadlines().statement_deadline();
    let claim = store.claim(&mut tx, scope, times, req).await;
    opened(tx, claim, bound).await
}

/// What [`SqlStore::open_claim`] returns once the claim in `tx` is done:
/// the open transaction when the key was claimed; otherwise `tx` rolled
/// back (within `bound`) and what the claim found, or its error.
pub(crate) async fn opened<DB: Database>(
    tx: ClaimTx<DB>,
    claim: Result<Claim, StoreError>,
    bound: Duration,
) -> Result<Result<ClaimTx<DB>, Claim>, StoreError> {
    match claim {
        Ok(Claim::Claimed) => Ok(Ok(tx)),
        Ok(found) => {
            tx.rollback(bound).await;
            Ok(Err(found))
        }
        Err(e) => {
            tx.rollback(bound).await;
            Err(e)
        }
    }
}

/// [`SqlStore::finish_claim`] by [`complete`](SqlStore::complete),
/// [`clear_attempts`](SqlStore::clear_attempts) and `COMMIT`.
pub(crate) async fn finish_by_statements<S: SqlStore>(
    store: &S,
    tx: ClaimTx<S::Db>,
    scope: &str,
    key: &str,
    result: &[u8],
    clear_attempts: bool,
) -> Result<(), StoreError> {
    let bound = store.deadlines().statement_deadline();
    let began = tx.began();
    let mut tx = match tx.into_parts() {
        claim_tx::Parts::Sqlx(tx) => tx,
        claim_tx::Parts::Raw(raw) => {
            raw.discard();
            return Err(StoreError::Corrupt(
                "a pipelined claim transaction reached a store that cannot finish it".into(),
            ));
        }
    };
    let mut recorded = store.complete(&mut tx, scope, key, result).await;
    if clear_attempts && recorded.is_ok() {
        // Committed with the effect, or not at all.
        recorded = store.clear_attempts(&mut tx, scope, key).await;
    }
    if let Err(e) = recorded {
        deadline::rollback(tx, began, bound).await;
        return Err(e);
    }
    deadline::within(bound, "commit", tx.commit()).await
}

/// The default number of buckets PostgreSQL's generations layout splits
/// each generation into (`PgStore::generation_buckets`): 8.
pub const DEFAULT_GENERATION_BUCKETS: u16 = 8;

/// The most buckets a generation can be split into: 64.
pub const MAX_GENERATION_BUCKETS: u16 = 64;

/// `ddl` without PostgreSQL's migration lock, for a migration tool that
/// runs the statements in one migration of its own.
pub(crate) fn without_migration_lock(ddl: Vec<String>) -> Vec<String> {
    ddl.into_iter()
        .filter(|s| !s.starts_with("SELECT pg_advisory"))
        .collect()
}

/// Checks a scope: 1 to [`MAX_SCOPE_LEN`] bytes, no control characters.
pub(crate) fn validate_scope(scope: &str) -> Result<(), StoreError> {
    if scope.is_empty()
        || scope.len() > MAX_SCOPE_LEN
        || scope.bytes().any(|b| b.is_ascii_control())
    {
        return Err(StoreError::InvalidScope(scope.chars().take(160).collect()));
    }
    Ok(())
}

/// Truncates a source string to [`MAX_SOURCE_LEN`] bytes on a character boundary.
pub(crate) fn clamp_source(source: &str) -> &str {
    if source.len() <= MAX_SOURCE_LEN {
        return source;
    }
    let mut end = MAX_SOURCE_LEN;
    while !source.is_char_boundary(end) {
        end -= 1;
    }
    &source[..end]
}

/// Decides whether a found record means duplicate or conflict.
pub(crate) fn classify_existing(
    stored_fp: Option<Fingerprint>,
    stored_result: Option<Vec<u8>>,
    req: &ClaimRequest<'_>,
) -> Claim {
    match (stored_fp, req.fingerprint) {
        (Some(stored), Some(received)) if stored != *received => Claim::Conflict {
            stored: Some(stored),
        },
        _ => Claim::Duplicate {
            result: stored_result,
        },
    }
}

/// How many times a claim re-reads when the record changes under it
/// (concurrent purge or reclaim) before giving up with a transient error.
pub(crate) const CLAIM_ROUNDS: usize = 4;

pub(crate) use batch::plan_batch;

/// Checks that recording a result touched exactly the claimed record. None
/// means the claim is gone from its own transaction: the database rolled the
/// transaction back under the handler (MySQL/MariaDB end a transaction on a
/// deadlock or lock wait timeout, and a handler may swallow that error).
/// A key of the attempts table ([`SqlStore::bump_attempts`]) that no
/// delivery's key can equal: counters onceonly keeps for itself (a Kafka
/// partition's batch mark, a key's missed deadlines). A control character
/// (which keys cannot hold), `kind`, and the SHA-256 of `name` in hex, so
/// that it fits every backend's key column whatever `name` is.
pub(crate) fn internal_key(kind: &str, name: &str) -> String {
    use sha2::Digest as _;
    format!(
        "\u{1}{kind}:{}",
        hex::encode(sha2::Sha256::digest(name.as_bytes()))
    )
}

pub(crate) fn expect_one(rows: u64) -> Result<(), StoreError> {
    match rows {
        1 => Ok(()),
        0 => Err(StoreError::ClaimLost),
        n => Err(StoreError::Corrupt(format!(
            "recording a key's result updated {n} rows instead of 1"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::internal_key;

    #[test]
    fn internal_keys_are_no_delivery_key_and_fit_every_key_column() {
        let long = "x".repeat(10_000);
        for name in ["K-1", long.as_str()] {
            let key = internal_key("deadline", name);
            assert!(key.len() <= 80, "{key}");
            assert_eq!(key, internal_key("deadline", name), "stable");
            assert_ne!(key, internal_key("kafka-batches", name), "per kind");
            // A delivery's key can never be one: keys hold no control
            // character.
            assert!(crate::IdemKey::new(key).is_err());
        }
    }
}

/// Keeps [`SqlStore`] implemented by this crate's stores only.
pub(crate) mod sealed {
    /// Implemented by each store of this crate (see `forward_sql_store!`).
    pub trait Sealed {}
}
