//! The transport-neutral engine: derive the key, decode, claim, run the
//! handler in the claim's transaction, record the result, commit, report.
//!
//! The engine never acknowledges anything. Transports act on the
//! [`Outcome`]: acknowledge `Processed` and `Duplicate`, dead-letter
//! `Conflict`, `Rejected` and exhausted handler failures, and back off on
//! store failures.

mod batch;
mod builder;
mod handler;
mod outcome;
mod retry;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use crate::clock::Clock;
use crate::delivery::Delivery;
use crate::fingerprint::{Fingerprint, FingerprintSpec};
use crate::key::{IdemKey, KeySpec};
use crate::store::{Claim, ClaimRequest, ClaimTimes, SqlStore, StoreError};

pub use builder::{BuildError, EngineBuilder};
pub use handler::{
    BoxError, DecodeError, FnHandler, FromDelivery, Handler, HandlerError, Json, handler_fn,
};
pub use outcome::{Failure, Outcome, OutcomeKind, Rejection, Report};
pub use retry::RetryPolicy;

/// Claims keys and runs handlers exactly once per key, over a [`SqlStore`].
///
/// Cheap to clone: clones share the same configuration and pool.
pub struct Engine<S: SqlStore> {
    inner: Arc<Inner<S>>,
}

impl<S: SqlStore> Clone for Engine<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<S> {
    store: S,
    scope: String,
    key: KeySpec,
    fingerprint: FingerprintSpec,
    retention: Duration,
    retry: RetryPolicy,
    transient_retries: u32,
    clock: Arc<dyn Clock>,
}

/// The first attempt's decoded input, or a fresh decode for later attempts.
enum Input<I> {
    Decoded(I),
    Again,
}

impl<S: SqlStore> Engine<S> {
    /// Starts configuring an engine over `store`.
    pub fn builder(store: S) -> EngineBuilder<S> {
        EngineBuilder::new(store)
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// The scope keys are unique in.
    pub fn scope(&self) -> &str {
        &self.inner.scope
    }

    /// The key specification.
    pub fn key_spec(&self) -> &KeySpec {
        &self.inner.key
    }

    /// The retry policy, for transports that schedule retries themselves.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.inner.retry
    }

    /// How long records are kept.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// Processes one delivery in one attempt (transient database errors such
    /// as deadlocks are retried internally a few times; handler failures are
    /// not). Transports that schedule their own retries call this and use
    /// [`Engine::retry_policy`].
    pub async fn process<H>(&self, handler: &H, delivery: &Delivery) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        let key = match self.inner.key.derive(delivery) {
            Ok(key) => key,
            Err(e) => return report(None, Outcome::Rejected(e.into())),
        };
        let mut input = match H::Input::from_delivery(delivery) {
            Ok(input) => Input::Decoded(input),
            Err(e) => return report(Some(key), Outcome::Rejected(e.into())),
        };
        let fingerprint = self.inner.fingerprint.compute(delivery);
        let mut transient = 0;
        loop {
            let this = std::mem::replace(&mut input, Input::Again);
            let input = match this {
                Input::Decoded(i) => i,
                Input::Again => match H::Input::from_delivery(delivery) {
                    Ok(i) => i,
                    Err(e) => return report(Some(key), Outcome::Rejected(e.into())),
                },
            };
            let outcome = self
                .attempt(handler, delivery, &key, fingerprint.as_ref(), input)
                .await;
            match &outcome {
                Outcome::Failed(Failure::Store(e))
                    if e.is_transient() && transient < self.inner.transient_retries =>
                {
                    transient += 1;
                    tracing::debug!(key = %key, error = %e, "transient store error, retrying the transaction");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(transient))).await;
                }
                _ => return report(Some(key), outcome),
            }
        }
    }

    /// Processes one delivery, retrying retryable failures in-process with
    /// the engine's [`RetryPolicy`] (sleeping between attempts). The report
    /// carries the number of attempts made.
    pub async fn process_with_retry<H>(&self, handler: &H, delivery: &Delivery) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        let mut attempts = 1;
        loop {
            let mut report = self.process(handler, delivery).await;
            report.attempts = attempts;
            let delay = match &report.outcome {
                Outcome::Failed(f) if f.is_retryable() => self.inner.retry.delay_after(attempts),
                _ => None,
            };
            match delay {
                Some(delay) => {
                    tracing::debug!(key = ?report.key, attempts, ?delay, "retrying");
                    tokio::time::sleep(delay).await;
                    attempts += 1;
                }
                None => return report,
            }
        }
    }

    async fn attempt<H>(
        &self,
        handler: &H,
        delivery: &Delivery,
        key: &IdemKey,
        fingerprint: Option<&Fingerprint>,
        input: H::Input,
    ) -> Outcome<H::Output>
    where
        H: Handler<S::Db>,
    {
        let inner = &*self.inner;
        let mut tx = match inner.store.begin().await {
            Ok(tx) => tx,
            Err(e) => return Outcome::Failed(Failure::Store(e)),
        };
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let req = ClaimRequest {
            key: key.as_str(),
            fingerprint,
            source: delivery.source(),
        };
        let claim = match inner.store.claim(&mut tx, &inner.scope, times, &req).await {
            Ok(claim) => claim,
            Err(e) => return Outcome::Failed(Failure::Store(e)),
        };
        match claim {
            Claim::Claimed => {}
            Claim::Duplicate { result } => {
                // Nothing was written; ending the read-only transaction
                // either way is fine, and rollback never fails a duplicate.
                drop(tx.rollback().await);
                return Outcome::Duplicate {
                    result: result.and_then(|bytes| decode_stored(key, &bytes)),
                };
            }
            Claim::Conflict { stored } => {
                drop(tx.rollback().await);
                return Outcome::Conflict {
                    stored,
                    received: fingerprint.copied(),
                };
            }
            Claim::InBatch { .. } => {
                drop(tx.rollback().await);
                return Outcome::Failed(Failure::Store(StoreError::Corrupt(
                    "single claim reported an in-batch duplicate".into(),
                )));
            }
        }
        let run = AssertUnwindSafe(handler.handle(&mut tx, input, delivery))
            .catch_unwind()
            .await;
        let output = match run {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => {
                drop(tx.rollback().await);
                return Outcome::Failed(Failure::Handler(e));
            }
            Err(panic) => {
                drop(tx.rollback().await);
                return Outcome::Failed(Failure::Panic(panic_message(panic.as_ref())));
            }
        };
        let bytes = match serde_json::to_vec(&output) {
            Ok(bytes) => bytes,
            Err(e) => {
                drop(tx.rollback().await);
                return Outcome::Failed(Failure::Encode(e));
            }
        };
        if let Err(e) = inner
            .store
            .complete(&mut tx, &inner.scope, key.as_str(), &bytes)
            .await
        {
            drop(tx.rollback().await);
            return Outcome::Failed(Failure::Store(e));
        }
        // A failed commit is ambiguous (it may have reached the database);
        // reporting it as a failure leads to a redelivery, and the claim
        // then tells whether it had committed.
        match tx.commit().await {
            Ok(()) => Outcome::Processed { result: output },
            Err(e) => Outcome::Failed(Failure::Store(e.into())),
        }
    }
}

fn report<T>(key: Option<IdemKey>, outcome: Outcome<T>) -> Report<T> {
    Report {
        key,
        attempts: 1,
        outcome,
    }
}

fn decode_stored<T: serde::de::DeserializeOwned>(key: &IdemKey, bytes: &[u8]) -> Option<T> {
    match serde_json::from_slice(bytes) {
        Ok(value) => Some(value),
        Err(e) => {
            tracing::warn!(key = %key, error = %e, "stored result does not decode as the handler's output");
            None
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
