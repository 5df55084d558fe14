//! The transport-neutral engine: derive the key, decode, claim, run the
//! handler in the claim's transaction, record the result, commit, report.
//! The engine never acknowledges anything: transports act on the
//! [`Outcome`], as [`decide`] says.
//!
#![doc = include_str!("../../docs/engine.md")]
#![doc = include_str!("../../docs/outcomes.md")]
#![doc = include_str!("../../docs/steps.md")]

mod batch;
mod builder;
mod crash;
mod decision;
mod fence;
mod handler;
mod outcome;
mod overrun;
mod payload;
mod retry;
pub(crate) mod session;
mod steps;
mod telemetry;
mod tx;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tracing::{Instrument, Span};

use crate::clock::Clock;
use crate::delivery::Delivery;
use crate::fingerprint::{Fingerprint, FingerprintSpec};
use crate::key::{FenceSpec, FenceValue, IdemKey, KeySpec};
use crate::store::{Claim, ClaimRequest, InfraFault, SqlStore, StoreError, classify_existing};

pub use builder::{BuildError, DEFAULT_RETENTION, EngineBuilder};
pub(crate) use crash::DEFAULT_MAX_CRASHES;
pub use decision::{Decision, decide};
pub use fence::{FenceCheck, Stale};
pub use handler::{
    BoxError, DecodeError, FnHandler, FromDelivery, Handler, HandlerError, Json, handler_fn,
};
pub use outcome::{Failure, Outcome, OutcomeKind, Rejection, Report};
pub(crate) use overrun::DEFAULT_MAX_DEADLINE_MISSES;
pub(crate) use overrun::HANDLER_DEADLINE;
pub use payload::{PayloadDecoder, PayloadError};
pub use retry::RetryPolicy;
pub use session::{ClaimError, ClaimSpec, Claimed, Finished, Session};
#[allow(unused_imports)] // no transport compiled in: no user
pub use steps::StepError;
pub(crate) use telemetry::Telemetry;
pub use tx::{Origin, Tx, TxGone, TxGuard};

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

struct Inner<S: SqlStore> {
    store: S,
    telemetry: Telemetry,
    scope: String,
    key: KeySpec,
    fingerprint: FingerprintSpec,
    retention: Duration,
    retry: RetryPolicy,
    transient_retries: u32,
    clock: Arc<dyn Clock>,
    /// Suspects that crashed the process this often are dead-lettered.
    max_crashes: u32,
    /// Keys whose handler missed the transaction deadline this often are
    /// dead-lettered.
    max_deadline_misses: u32,
    crashes: crash::Crashes,
    /// Claims after the handler, with the result (see
    /// [`EngineBuilder::optimistic`]).
    optimistic: bool,
    /// How common duplicates were lately (engines look keys up first
    /// while they are common).
    recent_duplicates: DuplicateShare,
    /// The per-entity fence, if any (see [`EngineBuilder::fence`]).
    fence: Option<FenceSpec>,
    /// How long an entity's fence is kept after its last delivery.
    fence_retention: Duration,
    /// The steps table and the downstream keys' secret.
    steps: Arc<steps::StepLog<S::Db>>,
    /// Turns payloads that are not JSON into their value tree (see
    /// [`EngineBuilder::payload_decoder`]).
    decoder: Option<Arc<dyn PayloadDecoder>>,
}

/// A moving share of duplicates among an engine's recent claims (a key
/// found taken by the look-up, the claim, the optimistic claim with the
/// result, or after a failed handler; against a key claimed): an
/// exponential average over about 64, in 1/65,536.
#[derive(Default)]
struct DuplicateShare(std::sync::atomic::AtomicU32);

impl DuplicateShare {
    const ONE: u32 = 1 << 16;

    /// Counts one delivery in. Concurrent updates may lose one another's
    /// sample: it is an estimate.
    fn note(&self, duplicate: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let old = self.0.load(Relaxed);
        let sample = if duplicate { Self::ONE } else { 0 };
        self.0.store(old - old / 64 + sample / 64, Relaxed);
    }

    /// Whether more than one in five were duplicates.
    fn common(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) > Self::ONE / 5
    }
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

    /// The per-entity fence, if any (see [`EngineBuilder::fence`]).
    pub fn fence_spec(&self) -> Option<&FenceSpec> {
        self.inner.fence.as_ref()
    }

    /// The retry policy, for transports that schedule retries themselves.
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.inner.retry
    }

    /// How long records are kept.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// How many times a suspect delivery may crash the process before it
    /// is dead-lettered with reason `crashed` (see
    /// [`EngineBuilder::max_crashes`]).
    pub fn max_crashes(&self) -> u32 {
        self.inner.max_crashes
    }

    /// How this engine shows keys in spans and logs (see
    /// [`EngineBuilder::key_redaction`]): use it to log keys in your own
    /// code the way onceonly does, e.g.
    /// `tracing::warn!(key = %engine.key_redaction().show(key), ...)`.
    pub fn key_redaction(&self) -> &crate::KeyRedaction {
        self.inner.telemetry.redaction()
    }

    /// The metric handles and span settings of this engine.
    #[cfg(any(feature = "_broker", feature = "http"))]
    pub(crate) fn telemetry(&self) -> &Telemetry {
        &self.inner.telemetry
    }

    /// What the payload fingerprint covers.
    #[cfg(feature = "http")]
    pub(crate) fn fingerprint_spec(&self) -> &FingerprintSpec {
        &self.inner.fingerprint
    }

    /// Now, by the engine's clock, in ms since the Unix epoch.
    #[cfg(any(feature = "http", feature = "kafka"))]
    pub(crate) fn now_ms(&self) -> i64 {
        self.inner.clock.now_ms()
    }

    /// A new `onceonly.delivery` span for `delivery` (see
    /// [`telemetry`](crate::telemetry)), for transports that keep one span
    /// over retries, dead-lettering and acknowledgement.
    pub(crate) fn delivery_span(&self, delivery: &Delivery) -> Span {
        let span = self.inner.telemetry.span(delivery);
        #[cfg(feature = "otel")]
        crate::otel::adopt(&span, delivery);
        span
    }

    /// `delivery` with the value tree of the engine's
    /// [payload decoder](EngineBuilder::payload_decoder), if it has one;
    /// the outcome of a payload the decoder cannot read.
    pub(crate) async fn decoded<'d, T>(
        &self,
        delivery: &'d Delivery,
    ) -> Result<std::borrow::Cow<'d, Delivery>, Outcome<T>> {
        payload::decoded(self.inner.decoder.as_deref(), delivery).await
    }

    /// Processes one delivery in one attempt (transient database errors such
    /// as deadlocks are retried internally a few times; handler failures are
    /// not). Transports that schedule their own retries call this and use
    /// [`Engine::retry_policy`].
    ///
    /// Runs in a new `onceonly.delivery` span and counts the outcome (see
    /// [`telemetry`](crate::telemetry)).
    pub async fn process<H>(&self, handler: &H, delivery: &Delivery) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        let span = self.delivery_span(delivery);
        self.process_in_span(handler, delivery)
            .instrument(span)
            .await
    }

    /// [`Engine::process`] in the current span (a transport's delivery
    /// span): records the key and outcome there and counts the outcome.
    pub(crate) async fn process_in_span<H>(
        &self,
        handler: &H,
        delivery: &Delivery,
    ) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        let report = self.process_untraced(handler, delivery).await;
        self.inner
            .telemetry
            .outcome(&Span::current(), report.outcome.kind());
        report
    }

    async fn process_untraced<H>(&self, handler: &H, delivery: &Delivery) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        // A panic in user code outside the handler (a key function, a
        // decoder, the result's `Serialize`) is a failure like a handler
        // panic, never a delivery left unsettled. An open transaction is
        // rolled back when it is dropped during the unwind.
        match AssertUnwindSafe(self.process_caught(handler, delivery))
            .catch_unwind()
            .await
        {
            Ok(report) => report,
            Err(panic) => {
                let what = panic_message(panic.as_ref());
                tracing::error!(panic = %what, "panic while processing a delivery");
                report(None, Outcome::Failed(Failure::Panic(what)))
            }
        }
    }

    async fn process_caught<H>(&self, handler: &H, delivery: &Delivery) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        // A suspect's stages before its claim are counted: a payload that
        // kills the process while it is decoded or keyed is parked too.
        let mut early = match self.count_early(delivery).await {
            Ok(early) => early,
            Err(failure) => return report(None, Outcome::Failed(failure)),
        };
        let decoded = match self.decoded(delivery).await {
            Ok(decoded) => decoded,
            Err(outcome) => return report(None, outcome),
        };
        let delivery = &*decoded;
        let key = match self.inner.key.derive(delivery) {
            Ok(key) => key,
            Err(e) => return report(None, Outcome::Rejected(e.into())),
        };
        self.inner
            .telemetry
            .record_key(&Span::current(), key.as_str());
        let fingerprint = self.inner.fingerprint.compute(delivery);
        // Without an entity or order, a committed key is still a
        // duplicate; only a new one is rejected.
        let fence = match self.fence_of(delivery) {
            Ok(fence) => fence,
            Err(e) => {
                let outcome = self
                    .settled_or(&key, fingerprint.as_ref(), delivery, e.into())
                    .await;
                return report(Some(key), outcome);
            }
        };
        let mut decoded = Some(H::Input::from_delivery(delivery));
        let mut contention = backoff(Duration::from_millis(20), Duration::from_millis(500));
        let mut transient = 0;
        loop {
            // Decoded once up front; a transaction retried after contention
            // decodes again (the handler consumed the first input).
            let decoded = decoded
                .take()
                .unwrap_or_else(|| H::Input::from_delivery(delivery));
            let input = match decoded {
                Ok(input) => input,
                Err(e) => {
                    let outcome = self
                        .settled_or(&key, fingerprint.as_ref(), delivery, e.into())
                        .await;
                    return report(Some(key), outcome);
                }
            };
            if let Some(early) = early.take() {
                early.survived().await;
            }
            let outcome = self
                .attempt(
                    handler,
                    delivery,
                    (&key, fence.as_ref()),
                    fingerprint.as_ref(),
                    input,
                )
                .await;
            match &outcome {
                Outcome::Failed(f)
                    if f.infra_fault() == Some(InfraFault::Contention)
                        && transient < self.inner.transient_retries =>
                {
                    transient += 1;
                    tracing::debug!(error = %f, "lock contention, retrying the transaction");
                    tokio::time::sleep(contention.next().unwrap_or(Duration::from_millis(500)))
                        .await;
                }
                _ => return report(Some(key), outcome),
            }
        }
    }

    /// The outcome of a delivery that cannot be processed as it is (its
    /// payload does not decode, or it has no valid entity or order for
    /// the fence): a key that is already committed is still a duplicate
    /// (or a conflict, or stale), even if its payload no longer decodes
    /// into the handler's input type (the type changed since) or a fence
    /// was added since; otherwise it is `rejection`.
    async fn settled_or<T: serde::de::DeserializeOwned>(
        &self,
        key: &IdemKey,
        fingerprint: Option<&Fingerprint>,
        delivery: &Delivery,
        rejection: Rejection,
    ) -> Outcome<T> {
        let req = ClaimRequest {
            key: key.as_str(),
            fingerprint,
            source: delivery.source(),
            lock_wait: None,
        };
        match self.committed(&self.inner.scope, &req).await {
            Ok(Some(claim)) => settled(claim, fingerprint),
            Ok(None) => Outcome::Rejected(rejection),
            Err(e) => Outcome::Failed(Failure::Store(e)),
        }
    }

    /// What `req.key` is committed as in `scope` now (cache tier first),
    /// without claiming it: `None` if it is free (absent or expired).
    pub(crate) async fn committed(
        &self,
        scope: &str,
        req: &ClaimRequest<'_>,
    ) -> Result<Option<Claim>, StoreError> {
        let inner = &*self.inner;
        if let Some(hit) = self.cached_claim(scope, req).await {
            return Ok(Some(hit));
        }
        let record = inner.store.get(scope, req.key).await?;
        Ok(record
            .filter(|r| r.expires_at_ms > inner.clock.now_ms())
            .map(|r| classify_existing(r.fingerprint, r.result, req)))
    }

    /// Processes one delivery, retrying retryable failures in-process with
    /// the engine's [`RetryPolicy`] (sleeping between attempts). The report
    /// carries the number of attempts made. All attempts run in one
    /// `onceonly.delivery` span; each retry is counted.
    ///
    /// Without a transport to wait in place, infrastructure failures are
    /// retried with the same policy (so this call is bounded); the report of
    /// the last attempt tells the caller what is left to do.
    pub async fn process_with_retry<H>(&self, handler: &H, delivery: &Delivery) -> Report<H::Output>
    where
        H: Handler<S::Db>,
    {
        let span = self.delivery_span(delivery);
        async {
            let mut attempts = 1;
            loop {
                let mut report = self.process_in_span(handler, delivery).await;
                report.attempts = attempts;
                let retry = match decide(&report.outcome, attempts, &self.inner.retry) {
                    Decision::Retry { delay, reason } => Some((delay, reason)),
                    Decision::Wait(_) => self
                        .inner
                        .retry
                        .delay_after(attempts)
                        .map(|delay| (delay, "store_error")),
                    _ => None,
                };
                match retry {
                    Some((delay, reason)) => {
                        self.inner.telemetry.retried(reason);
                        tracing::debug!(attempts, ?delay, "retrying");
                        tokio::time::sleep(delay).await;
                        attempts += 1;
                    }
                    None => return report,
                }
            }
        }
        .instrument(span)
        .await
    }

    async fn attempt<H>(
        &self,
        handler: &H,
        delivery: &Delivery,
        (key, fence): (&IdemKey, Option<&FenceValue>),
        fingerprint: Option<&Fingerprint>,
        input: H::Input,
    ) -> Outcome<H::Output>
    where
        H: Handler<S::Db>,
    {
        let spec = ClaimSpec::new(key)
            .fingerprint(fingerprint.copied())
            .source(delivery.source())
            .traceparent(session::traceparent_of(delivery))
            .suspect(delivery.is_suspect())
            .fence(fence);
        let session = match self.claim_with(spec).await {
            Ok(Claimed::New(session)) => session,
            Ok(Claimed::Duplicate { result }) => {
                return Outcome::Duplicate {
                    result: result.and_then(|bytes| decode_stored(&bytes)),
                };
            }
            Ok(Claimed::Conflict { stored, received }) => {
                return Outcome::Conflict { stored, received };
            }
            Ok(Claimed::Crashed { crashes }) => {
                return Outcome::Failed(Failure::Crashed { crashes });
            }
            Ok(Claimed::Stale(stale)) => return Outcome::Stale(stale),
            Err(e) => return Outcome::Failed(Failure::Store(e)),
        };
        match self
            .run_handler(session.tx(), handler, delivery, input)
            .await
        {
            Ok((output, bytes)) => match session.finish(&bytes).await {
                Ok(end) => finished(end, Some(output)),
                Err(failure) => Outcome::Failed(failure),
            },
            // An optimistic session's key committed meanwhile by a
            // concurrent copy (whose writes may be what failed this
            // handler): a duplicate, not a failure to retry.
            Err(failure) => match session.abandon_failed().await {
                Some(taken) => finished(taken, None),
                // A handler slower than the deadline is counted, and
                // parked once it missed it too often.
                None if overrun::is_handler_overrun(&failure) => {
                    let parked = self.handler_overran(&self.inner.scope, key.as_str());
                    Outcome::Failed(parked.await.unwrap_or(failure))
                }
                None => Outcome::Failed(failure),
            },
        }
    }

    /// Runs the handler on the open transaction (panics caught) and encodes
    /// its output for storage; the caller records it.
    async fn run_handler<H>(
        &self,
        tx: Tx<S::Db>,
        handler: &H,
        delivery: &Delivery,
        input: H::Input,
    ) -> Result<(H::Output, Vec<u8>), Failure>
    where
        H: Handler<S::Db>,
    {
        let started = Instant::now();
        // Bounded by the transaction deadline: a statement of the handler
        // that never answers (a silent network) gives the attempt up.
        let bound = tx.remaining();
        let handled = AssertUnwindSafe(handler.handle(tx, input, delivery)).catch_unwind();
        let output = crate::store::deadline::bounded(bound, HANDLER_DEADLINE, handled)
            .await
            .map_err(|missed| Failure::Store(missed.into()));
        self.inner.telemetry.handler_time(started.elapsed());
        let output = output?
            .map_err(|panic| Failure::Panic(panic_message(panic.as_ref())))?
            .map_err(Failure::Handler)?;
        let bytes = serde_json::to_vec(&output).map_err(Failure::Encode)?;
        Ok((output, bytes))
    }
}

/// The outcome of a session's end: `output` is the handler's, if it
/// returned one.
fn finished<T: serde::de::DeserializeOwned>(end: Finished, output: Option<T>) -> Outcome<T> {
    match (end, output) {
        (Finished::Committed, Some(result)) => Outcome::Processed { result },
        (Finished::Committed, None) => Outcome::Failed(Failure::Store(StoreError::Corrupt(
            "a failed session committed".into(),
        ))),
        (Finished::Duplicate { result }, _) => Outcome::Duplicate {
            result: result.and_then(|bytes| decode_stored(&bytes)),
        },
        (Finished::Conflict { stored, received }, _) => Outcome::Conflict { stored, received },
        (Finished::Stale(stale), _) => Outcome::Stale(stale),
    }
}

/// The outcome of a claim that found the key already taken.
fn settled<T: serde::de::DeserializeOwned>(
    claim: Claim,
    received: Option<&Fingerprint>,
) -> Outcome<T> {
    match claim {
        Claim::Duplicate { result } => match fence::is_recorded_stale(result.as_deref()) {
            Some(stale) => Outcome::Stale(stale),
            None => Outcome::Duplicate {
                result: result.and_then(|bytes| decode_stored(&bytes)),
            },
        },
        Claim::Conflict { stored } => Outcome::Conflict {
            stored,
            received: received.copied(),
        },
        // Claimed and in-batch repeats are resolved by the callers.
        other => Outcome::Failed(Failure::Store(StoreError::Corrupt(format!(
            "unexpected claim {other:?} of a settled key"
        )))),
    }
}

/// Jittered exponential delays from `min` doubling up to `max`, without end:
/// every backoff loop of the crate (contention, outages, publishes,
/// reconnects) draws from one of these, so that workers do not retry in
/// lockstep after an outage.
pub(crate) fn backoff(min: Duration, max: Duration) -> impl Iterator<Item = Duration> + Send {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::new()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

fn report<T>(key: Option<IdemKey>, outcome: Outcome<T>) -> Report<T> {
    Report {
        key,
        attempts: 1,
        outcome,
    }
}

fn decode_stored<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    match serde_json::from_slice(bytes) {
        Ok(value) => Some(value),
        Err(e) => {
            tracing::warn!(error = %e, "stored result does not decode as the handler's output");
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

#[cfg(test)]
mod duplicate_share_tests {
    use super::DuplicateShare;

    #[test]
    fn common_after_a_run_of_duplicates_and_rare_again_after_new_keys() {
        let share = DuplicateShare::default();
        assert!(!share.common());
        for _ in 0..14 {
            share.note(true);
        }
        assert!(!share.common(), "14 in a row: 0.197");
        share.note(true);
        assert!(share.common(), "15 in a row: 0.21");
        for _ in 0..200 {
            share.note(false);
        }
        assert!(!share.common());
        // One in ten stays below the bar; one in three goes above it.
        for i in 0..600 {
            share.note(i % 10 == 0);
        }
        assert!(!share.common());
        for i in 0..600 {
            share.note(i % 3 == 0);
        }
        assert!(share.common());
    }
}
