//! The claim's open transaction, as an owned handle the handler works in.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use sqlx::Database;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use super::fence::FenceCheck;
use super::handler::HandlerError;
use super::steps::{StepError, StepLog};
use crate::fingerprint::Fingerprint;
use crate::store::ClaimTx;

/// The transaction a key was claimed in. Every handler gets one, broker
/// and HTTP alike: write through it and the writes commit together with
/// the claim and the stored result, or not at all.
///
/// It is a cheap handle (clone it freely); [`lock`](Tx::lock) it for the
/// handler's statements and use `&mut *conn` as the sqlx executor:
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn f(tx: onceonly::Tx<sqlx::Sqlite>) -> Result<(), onceonly::HandlerError> {
/// let mut conn = tx.lock().await?;
/// sqlx::query("INSERT INTO ledger (out_trade_no, amount) VALUES (?, ?)")
///     .bind("T-1")
///     .bind(100)
///     .execute(&mut *conn)
///     .await?;
/// # Ok(()) }
/// ```
///
/// Do not commit or roll it back yourself, and do not keep a lock after the
/// handler returned: the engine takes the transaction back then to record
/// the result and commit (a lock still held after
/// [`RETURN_TIMEOUT`](Tx::RETURN_TIMEOUT) fails the delivery, and the
/// transaction rolls back when the lock is finally dropped).
///
/// The handler has until [`deadline`](Tx::deadline) (the store's
/// [transaction deadline](crate::store::Deadlines::transaction) after
/// `BEGIN`): a handler still running then, e.g. on a statement that never
/// answers because the network went silent, is dropped, the transaction
/// is given up and its connection discarded, and the delivery waits in
/// place like on any database outage.
pub struct Tx<DB: Database> {
    slot: Arc<Mutex<Option<ClaimTx<DB>>>>,
    origin: Arc<Origin>,
    deadline: Instant,
    steps: Arc<StepLog<DB>>,
}

impl<DB: Database> Clone for Tx<DB> {
    fn clone(&self) -> Self {
        Self {
            slot: Arc::clone(&self.slot),
            origin: Arc::clone(&self.origin),
            deadline: self.deadline,
            steps: Arc::clone(&self.steps),
        }
    }
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// What a transaction was opened for: the claimed key, its scope and the
/// inbound message's trace context. Messages a handler sends through the
/// [outbox](crate::outbox) take their deterministic ids from it.
#[derive(Debug)]
pub struct Origin {
    scope: String,
    key: String,
    traceparent: Option<String>,
    claimed_at_ms: i64,
    sequence: AtomicU32,
    fingerprint: Option<Fingerprint>,
    fence: OnceLock<FenceCheck>,
}

impl Origin {
    pub(crate) fn new(
        scope: &str,
        key: &str,
        traceparent: Option<&str>,
        claimed_at_ms: i64,
    ) -> Self {
        Self {
            scope: scope.to_owned(),
            key: key.to_owned(),
            traceparent: traceparent.map(str::to_owned),
            claimed_at_ms,
            sequence: AtomicU32::new(0),
            fingerprint: None,
            fence: OnceLock::new(),
        }
    }

    /// The same origin, for a delivery with `fingerprint` (its steps are
    /// recorded with it).
    pub(crate) fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// What the fence found, once it passed (see [`Tx::fence`]).
    pub(crate) fn set_fence(&self, check: FenceCheck) {
        // Set once per origin: the fence runs once per claim.
        let _ = self.fence.set(check);
    }

    /// When the key was claimed, in milliseconds since the Unix epoch (the
    /// dedup record's creation time): it tells this run of the handler
    /// from a later one after the record expired and the key came back.
    pub fn claimed_at_ms(&self) -> i64 {
        self.claimed_at_ms
    }

    /// The scope the key was claimed in.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The claimed key (the inbound message's idempotency key).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The inbound message's W3C `traceparent`, if it carried one.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// The position of the next message sent from this handler run: 0, 1,
    /// 2... in the order of the calls.
    pub fn next_position(&self) -> u32 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }
}

/// The transaction is gone: the engine already finished the delivery (the
/// handle was used after the handler returned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the onceonly transaction is no longer available")]
pub struct TxGone;

/// The locked connection of a [`Tx`]: use `&mut *conn` as the executor.
/// It also knows the claim's [`Origin`], for the
/// [outbox](crate::outbox).
pub struct TxGuard<DB: Database> {
    conn: OwnedMappedMutexGuard<Option<ClaimTx<DB>>, DB::Connection>,
    origin: Arc<Origin>,
}

impl<DB: Database> TxGuard<DB> {
    /// What the transaction was opened for.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }
}

impl<DB: Database> Deref for TxGuard<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Database> DerefMut for TxGuard<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

impl<DB: Database> Tx<DB> {
    /// How long the engine waits, after the handler returned, for it to let
    /// go of the transaction.
    pub const RETURN_TIMEOUT: Duration = Duration::from_secs(30);

    /// The transaction `tx`, begun at `began`, whose handler has `bound`
    /// and records its steps in `steps`.
    pub(crate) fn new(
        tx: ClaimTx<DB>,
        origin: Origin,
        began: Instant,
        bound: Duration,
        steps: Arc<StepLog<DB>>,
    ) -> Self {
        Self {
            slot: Arc::new(Mutex::new(Some(tx))),
            origin: Arc::new(origin),
            deadline: began + bound,
            steps,
        }
    }

    /// When the handler must be done: the store's
    /// [transaction deadline](crate::store::Deadlines::transaction) after
    /// `BEGIN`.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// What is left until [`deadline`](Tx::deadline).
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// The same transaction, opened for another key (a batch runs several
    /// handlers in one transaction).
    pub(crate) fn for_origin(&self, origin: Origin) -> Self {
        Self {
            slot: Arc::clone(&self.slot),
            origin: Arc::new(origin),
            deadline: self.deadline,
            steps: Arc::clone(&self.steps),
        }
    }

    /// What the entity's [fence](crate::FenceSpec) found for this
    /// delivery: `None` when the engine has no fence. A handler of a fence
    /// that [passes stale deliveries](crate::FenceSpec::pass_stale) reads
    /// [`FenceCheck::is_stale`] and the order applied before
    /// ([`FenceCheck::current`]) and decides.
    pub fn fence(&self) -> Option<&FenceCheck> {
        self.origin.fence.get()
    }

    /// The key to send a downstream system for `step` of this delivery
    /// (as Stripe's or Adyen's `Idempotency-Key`, WeChat Pay's
    /// `out_refund_no`): the same on every attempt and every redelivery
    /// of the same key, different for every scope, key and step, and
    /// revealing none of them (an HMAC under the engine's
    /// [downstream secret](crate::EngineBuilder::downstream_secret)).
    /// 40 hex digits.
    pub fn downstream_key(&self, step: &str) -> Result<String, StepError> {
        let origin = &self.origin;
        self.steps
            .downstream_key(origin.scope(), origin.key(), step)
    }

    /// Runs `call` once for this delivery's key, as a recovery point: its
    /// result is recorded in the steps table, committed on its own as
    /// soon as `call` returned, before this transaction ends. On every
    /// later attempt or redelivery of the key (the process died before
    /// the `COMMIT`, the handler failed after the step and is retried)
    /// the recorded result is returned without calling again. A `call`
    /// that failed, or whose result was never recorded, is called again,
    /// with the same downstream key (its argument, see
    /// [`downstream_key`](Tx::downstream_key)): send it to the downstream
    /// system so that it answers a repeated call with its first answer.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn f(tx: onceonly::Tx<sqlx::Postgres>, http: reqwest::Client) -> Result<(), onceonly::HandlerError> {
    /// use onceonly::HandlerError;
    ///
    /// let refund: serde_json::Value = tx
    ///     .step("refund", |key| async move {
    ///         let answer = http
    ///             .post("https://api.example.com/v1/refunds")
    ///             .header("Idempotency-Key", key)
    ///             .json(&serde_json::json!({ "payment": "pi_1", "amount": 500 }))
    ///             .send()
    ///             .await
    ///             .map_err(HandlerError::retryable)?;
    ///         answer.json().await.map_err(HandlerError::retryable)
    ///     })
    ///     .await?;
    /// let mut conn = tx.lock().await?;
    /// sqlx::query("INSERT INTO refunds (payment, provider_id) VALUES ($1, $2)")
    ///     .bind("pi_1")
    ///     .bind(refund["id"].as_str())
    ///     .execute(&mut *conn)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// Errors of `call` are returned as they are (the handler's retry and
    /// dead-letter decision applies); a step that cannot be recorded or
    /// read is an infrastructure failure ([`StepError`] converts into
    /// [`HandlerError`]). Exactly once holds only if the downstream system
    /// honours the key: what is guaranteed and what is not is listed in
    /// the [steps guide](crate::engine#steps).
    pub async fn step<T, F, Fut>(&self, step: &str, call: F) -> Result<T, HandlerError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
    {
        let origin = &self.origin;
        let (scope, key, fingerprint) = (origin.scope(), origin.key(), origin.fingerprint.as_ref());
        let downstream = self.downstream_key(step)?;
        let log = &self.steps;
        let finished = {
            let mut conn = self.lock().await.map_err(|_| StepError::Gone)?;
            log.finished(&mut conn, scope, key, step, fingerprint)
                .await?
        };
        if let Some(stored) = finished {
            crate::telemetry::step_replayed(scope);
            return decode_step(&stored);
        }
        let claim = (scope, key, origin.claimed_at_ms());
        // The call's start, committed before it: a process that dies
        // between the call and its record leaves a trace that a later
        // delivery of the key (a stale one included) and the Completer see.
        log.record_start(claim, step, fingerprint).await?;
        let value = call(downstream).await?;
        let bytes = serde_json::to_vec(&value).map_err(StepError::Encoding)?;
        let standing = log.record(claim, step, fingerprint, &bytes).await?;
        crate::telemetry::step_called(scope);
        if standing == bytes {
            Ok(value)
        } else {
            // A concurrent attempt of the key recorded its result first:
            // every attempt goes on with the one that stands.
            decode_step(&standing)
        }
    }

    /// What the transaction was opened for.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Locks the transaction's connection for the handler's statements.
    pub async fn lock(&self) -> Result<TxGuard<DB>, TxGone> {
        let conn = OwnedMutexGuard::try_map(Arc::clone(&self.slot).lock_owned().await, |slot| {
            slot.as_mut().map(|tx| &mut **tx)
        })
        .map_err(|_| TxGone)?;
        Ok(TxGuard {
            conn,
            origin: Arc::clone(&self.origin),
        })
    }

    /// Takes the transaction back once the handler let go of it; `None` if
    /// it is gone or still held after `wait`.
    pub(crate) async fn take(&self, wait: Duration) -> Option<ClaimTx<DB>> {
        match tokio::time::timeout(wait, self.slot.lock()).await {
            Ok(mut slot) => slot.take(),
            Err(_) => None,
        }
    }
}

/// A step's recorded result, as the step's type.
fn decode_step<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, HandlerError> {
    serde_json::from_slice(bytes)
        .map_err(StepError::Encoding)
        .map_err(HandlerError::from)
}
