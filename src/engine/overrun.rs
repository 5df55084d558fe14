//! Handlers that outlast the transaction deadline: counting the misses of
//! each key, and parking a key whose handler keeps missing it.
//!
//! A handler still running at the
//! [transaction deadline](crate::store::Deadlines::transaction) is given
//! up: its transaction rolls back and the attempt fails as a timeout, which
//! the transports wait out in place, as they would a silent database. A
//! handler that is *always* slower than the deadline would so wait for
//! ever, its partition or queue with it. So each miss is counted for its
//! key in the attempts table (as crashes are, under a key of its own, see
//! [`internal_key`]), by one autocommit statement that also shows that the
//! database answers: when it does not, the miss is not counted (a silent
//! network looks the same from the handler's side) and the delivery waits
//! as before. A key that missed
//! [`max_deadline_misses`](super::EngineBuilder::max_deadline_misses)
//! times fails with [`Failure::Deadline`]: dead-lettered `deadline`, and
//! its counter deleted, so that a replay of the dead letter starts over.
//! The counter expires with the dedup window otherwise.

use super::{Engine, Failure};
use crate::store::{ClaimTimes, SqlStore, StoreError, internal_key};

/// The default [`EngineBuilder::max_deadline_misses`](super::EngineBuilder::max_deadline_misses): 3.
pub(crate) const DEFAULT_MAX_DEADLINE_MISSES: u32 = 3;

/// What [`Deadlines`](crate::store::Deadlines) calls the handler's
/// transaction when it misses its deadline.
pub(crate) const HANDLER_DEADLINE: &str = "the handler's transaction";

/// Whether `failure` is the handler's transaction missing its deadline.
pub(crate) fn is_handler_overrun(failure: &Failure) -> bool {
    matches!(failure, Failure::Store(StoreError::Deadline(missed)) if missed.what() == HANDLER_DEADLINE)
}

impl<S: SqlStore> Engine<S> {
    /// Counts a miss of the transaction deadline by `key`'s handler in
    /// `scope` (its transaction already rolled back): the failure to report
    /// instead of the timeout once the key missed it too often.
    pub(crate) async fn handler_overran(&self, scope: &str, key: &str) -> Option<Failure> {
        let inner = &*self.inner;
        inner.telemetry.deadline_missed();
        let counter = internal_key("deadline", key);
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let misses = match inner.store.bump_attempts(scope, &counter, times).await {
            Ok(misses) => misses,
            Err(e) => {
                tracing::debug!(error = %e, "a missed deadline could not be counted: the database does not answer; waiting");
                return None;
            }
        };
        if misses < inner.max_deadline_misses {
            tracing::warn!(
                misses,
                max_deadline_misses = inner.max_deadline_misses,
                "the handler missed its transaction deadline; rolled back, tried again later"
            );
            return None;
        }
        tracing::error!(
            misses,
            reason = "deadline",
            "the handler missed its transaction deadline every time; parking the delivery"
        );
        self.forget_counter(scope, &counter).await;
        Some(Failure::Deadline { misses })
    }
}
