//! Calls to other systems from a handler: deterministic keys to send them
//! ([`Tx::downstream_key`](crate::Tx::downstream_key)) and recovery points
//! ([`Tx::step`](crate::Tx::step)).
//!
//! A call to a provider's refund API, a ledger service or an email API
//! cannot be part of the claim's transaction. A *step* records the call's
//! result in the steps table ([`TableName::steps`](crate::store::TableName::steps)),
//! committed on its own as soon as the call returned, before the
//! handler's transaction ends. If the process dies before the `COMMIT`,
//! the redelivery's handler runs again, and its step returns the stored
//! result without calling again; a step whose call never finished calls
//! again with the same [downstream key](crate::Tx::downstream_key), which
//! a downstream system that honours idempotency keys answers with its
//! first answer.

use std::sync::Arc;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use sqlx::Database;

use crate::clock::Clock;
use crate::fingerprint::Fingerprint;
use crate::store::{ClaimTimes, STARTED_PREFIX, SqlStore, StepRecord, StoreError};

use super::handler::HandlerError;

/// The shortest secret [`EngineBuilder::downstream_secret`](crate::EngineBuilder::downstream_secret)
/// takes, in bytes.
pub(crate) const MIN_DOWNSTREAM_SECRET: usize = 16;

/// What a downstream key's HMAC starts with: a key for another purpose
/// under the same secret is never a downstream key.
const DOMAIN: &[u8] = b"onceonly downstream key v1\0";

/// The longest step name, in bytes.
pub(crate) const MAX_STEP_NAME: usize = 64;

/// Why a step or a downstream key could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The engine has no [downstream secret](crate::EngineBuilder::downstream_secret).
    #[error("downstream keys need a secret: set EngineBuilder::downstream_secret")]
    NoSecret,
    /// The step name is empty, longer than 64 bytes or holds a
    /// control character.
    #[error("invalid step name: 1 to {MAX_STEP_NAME} bytes without control characters")]
    BadName,
    /// The store cannot commit a step while the claim's transaction is
    /// open (SQLite: one writer at a time).
    #[error(
        "this store cannot record steps beside an open claim (SQLite has one writer); use PostgreSQL or MySQL"
    )]
    Unsupported,
    /// The step was recorded by an earlier attempt of the same key with
    /// another payload: the key was reused for a different message.
    #[error("step {0:?} was recorded for another payload under the same key")]
    Conflict(String),
    /// The step's result does not serialize, or its stored result no
    /// longer decodes as the step's type.
    #[error("step result: {0}")]
    Encoding(#[source] serde_json::Error),
    /// The steps table could not be read or written.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The transaction handle is used after the handler returned.
    #[error("the transaction's handler already returned")]
    Gone,
}

impl From<StepError> for HandlerError {
    /// A store failure waits as infrastructure; the rest is permanent
    /// (retrying cannot fix a configuration or a reused key).
    fn from(e: StepError) -> Self {
        match e {
            StepError::Store(store) => match store.infra_fault() {
                Some(fault) => HandlerError::infrastructure(fault, store),
                None => HandlerError::permanent(store),
            },
            other => HandlerError::permanent(other),
        }
    }
}

/// What a handler's transaction needs to run steps: the store's steps
/// table, the clock, the records' retention and the secret keying
/// downstream keys. One per engine, shared by its transactions.
pub(crate) struct StepLog<DB: Database> {
    store: Arc<dyn StepStore<DB>>,
    clock: Arc<dyn Clock>,
    retention: std::time::Duration,
    secret: Option<Arc<[u8]>>,
}

impl<DB: Database> std::fmt::Debug for StepLog<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLog")
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .finish_non_exhaustive()
    }
}

/// The steps table of a store, as a transaction reaches it (object-safe:
/// a [`Tx`](crate::Tx) knows its database, not its store).
#[async_trait]
trait StepStore<DB: Database>: Send + Sync {
    fn records_steps(&self) -> bool;
    async fn step(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<Option<StepRecord>, StoreError>;
    async fn record_step(
        &self,
        scope: &str,
        key: &str,
        step: &str,
        fingerprint: Option<&[u8]>,
        result: &[u8],
        times: ClaimTimes,
    ) -> Result<StepRecord, StoreError>;
}

struct Steps<S>(S);

#[async_trait]
impl<S: SqlStore> StepStore<S::Db> for Steps<S> {
    fn records_steps(&self) -> bool {
        self.0.records_steps()
    }

    async fn step(
        &self,
        conn: &mut <S::Db as Database>::Connection,
        scope: &str,
        key: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<Option<StepRecord>, StoreError> {
        self.0.step(conn, scope, key, step, now_ms).await
    }

    async fn record_step(
        &self,
        scope: &str,
        key: &str,
        step: &str,
        fingerprint: Option<&[u8]>,
        result: &[u8],
        times: ClaimTimes,
    ) -> Result<StepRecord, StoreError> {
        self.0
            .record_step(scope, key, step, fingerprint, result, times)
            .await
    }
}

impl<DB: Database> StepLog<DB> {
    pub(crate) fn new<S: SqlStore<Db = DB>>(
        store: S,
        clock: Arc<dyn Clock>,
        retention: std::time::Duration,
        secret: Option<Arc<[u8]>>,
    ) -> Self {
        Self {
            store: Arc::new(Steps(store)),
            clock,
            retention,
            secret,
        }
    }

    /// The downstream key of `step` for `key` in `scope`: HMAC-SHA-256
    /// under the engine's secret of a domain label and the three, each
    /// length-prefixed,
    /// as 40 hex digits (160 bits): within Stripe's 255, Adyen's 64 and
    /// WeChat Pay's `out_refund_no` 64 characters, and of characters
    /// every one of them takes.
    pub(crate) fn downstream_key(
        &self,
        scope: &str,
        key: &str,
        step: &str,
    ) -> Result<String, StepError> {
        check_name(step)?;
        let secret = self.secret.as_deref().ok_or(StepError::NoSecret)?;
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| StepError::NoSecret)?;
        mac.update(DOMAIN);
        for part in [scope, key, step] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part.as_bytes());
        }
        let digest = mac.finalize().into_bytes();
        Ok(hex::encode(&digest[..20]))
    }

    /// The step's stored result, if an attempt of `key` finished it:
    /// read on the claim's own connection `conn` (a step is committed on
    /// its own, and the claim's transaction reads what is committed), so
    /// that only recording a step takes a second connection.
    pub(crate) async fn finished(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
        step: &str,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Option<Vec<u8>>, StepError> {
        check_name(step)?;
        if !self.store.records_steps() {
            return Err(StepError::Unsupported);
        }
        let now_ms = self.clock.now_ms();
        let Some(record) = self.store.step(conn, scope, key, step, now_ms).await? else {
            return Ok(None);
        };
        check_payload(&record, step, fingerprint)?;
        Ok(Some(record.result))
    }

    /// Records that `step` is about to call, committed on its own before
    /// the call (an empty result under [`STARTED_PREFIX`] and the step's
    /// name): if the process dies after the call and before its record, a
    /// delivery of the key still knows a call may have happened.
    pub(crate) async fn record_start(
        &self,
        claim: (&str, &str, i64),
        step: &str,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<(), StepError> {
        let name = format!("{STARTED_PREFIX}{step}");
        self.record(claim, &name, fingerprint, b"").await?;
        Ok(())
    }

    /// Records the step's `result`, committed when this returns; the
    /// result that stands (a concurrent attempt's, if it recorded first).
    /// It expires with the record of the claim made at `claimed_at_ms`:
    /// never after it, so that a step never outlives a committed record
    /// and looks orphaned.
    pub(crate) async fn record(
        &self,
        (scope, key, claimed_at_ms): (&str, &str, i64),
        step: &str,
        fingerprint: Option<&Fingerprint>,
        result: &[u8],
    ) -> Result<Vec<u8>, StepError> {
        let expires_at_ms = ClaimTimes::new(claimed_at_ms, self.retention).expires_at_ms;
        let times = ClaimTimes {
            now_ms: self.clock.now_ms(),
            expires_at_ms,
        };
        let fp = fingerprint.map(|f| f.as_bytes().as_slice());
        let record = self
            .store
            .record_step(scope, key, step, fp, result, times)
            .await?;
        check_payload(&record, step, fingerprint)?;
        Ok(record.result)
    }
}

fn check_name(step: &str) -> Result<(), StepError> {
    let ok = !step.is_empty()
        && step.len() <= MAX_STEP_NAME
        && !step.bytes().any(|b| b.is_ascii_control());
    if ok { Ok(()) } else { Err(StepError::BadName) }
}

/// A step recorded for another payload under the same key is a reused
/// key, not this delivery's step.
fn check_payload(
    record: &StepRecord,
    step: &str,
    fingerprint: Option<&Fingerprint>,
) -> Result<(), StepError> {
    match (record.fingerprint.as_ref(), fingerprint) {
        (Some(stored), Some(ours)) if stored != ours => Err(StepError::Conflict(step.to_owned())),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_are_checked() {
        assert!(check_name("refund").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name(&"x".repeat(65)).is_err());
        assert!(check_name("a\nb").is_err());
    }
}
