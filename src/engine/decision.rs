//! What a transport does with an outcome, decided in one place for every
//! transport.
//!
//! | outcome | decision |
//! |---|---|
//! | processed, duplicate | [`Ack`](Decision::Ack) |
//! | failed on the infrastructure (any [`InfraFault`]: unreachable, read-only, missing table, permission, resources, shutdown, timeout, contention, corrupt store) | [`Wait`](Decision::Wait): no ack, no offset commit, no dead letter; process again after a jittered backoff, for as long as it lasts |
//! | retryable handler error or panic (in the handler, a key function, a decoder), or the message's writes refused at COMMIT ([`Failure::Commit`](super::Failure::Commit)), policy not exhausted | [`Retry`](Decision::Retry) after the policy's delay |
//! | the same, policy exhausted | [`DeadLetter`](Decision::DeadLetter) `handler_error` |
//! | permanent handler error, unserializable result | [`DeadLetter`](Decision::DeadLetter) `handler_error` |
//! | data exception on a value of the message in the dedup store | [`DeadLetter`](Decision::DeadLetter) `store_error` |
//! | key reused with another payload | [`DeadLetter`](Decision::DeadLetter) `fingerprint_mismatch` |
//! | a [suspect](crate::Delivery::with_suspect) that crashed the process [`max_crashes`](crate::EngineBuilder::max_crashes) times ([`Failure::Crashed`](super::Failure::Crashed)) | [`DeadLetter`](Decision::DeadLetter) `crashed`, without running the handler again |
//! | a handler that missed the transaction deadline [`max_deadline_misses`](crate::EngineBuilder::max_deadline_misses) times for one key while the database answered ([`Failure::Deadline`](super::Failure::Deadline)); fewer misses wait in place like any timeout | [`DeadLetter`](Decision::DeadLetter) `deadline` |
//! | no key, undecodable payload | [`DeadLetter`](Decision::DeadLetter) `bad_key`, `decode_error` |
//!
//! The Kafka and AMQP consumers translate a decision to their wire (commit
//! the offset or ack; wait in place; retry in place or through a retry
//! queue; publish the dead letter, then commit or ack). The HTTP layer maps
//! the same classes to statuses (its module documentation has the table).

use std::time::Duration;

use super::{Outcome, RetryPolicy};
use crate::store::InfraFault;

/// What a transport must do with a delivery after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// The effect is committed (now or earlier): acknowledge the delivery
    /// (ack, commit the offset, answer).
    Ack,
    /// The infrastructure failed, not the message: keep the delivery
    /// unacknowledged and uncommitted, back off and process it again. Not
    /// an attempt: waits never exhaust the retry policy.
    Wait(InfraFault),
    /// A retryable failure: process the delivery again after `delay`.
    Retry {
        /// The policy's delay before the next attempt.
        delay: Duration,
        /// The failure's reason code, for the retry metric.
        reason: &'static str,
    },
    /// A fault of the message (or an exhausted retry policy): publish a dead
    /// letter with the reason, and acknowledge only once it is confirmed.
    DeadLetter {
        /// The reason code (`fingerprint_mismatch`, `bad_key`,
        /// `decode_error`, `handler_error`, `store_error`, `crashed`,
        /// `deadline`).
        reason: &'static str,
        /// What went wrong, for the dead letter's error text.
        error: String,
        /// Attempts made (0 when rejected before the handler could run).
        attempts: u32,
    },
}

/// Decides what to do with `outcome` after `attempts` attempts under
/// `policy`. Every transport calls this; none decides on its own.
pub fn decide<T>(outcome: &Outcome<T>, attempts: u32, policy: &RetryPolicy) -> Decision {
    let dead_letter = |attempts| Decision::DeadLetter {
        reason: outcome.reason().unwrap_or("handler_error"),
        error: outcome.error_text().unwrap_or_default(),
        attempts,
    };
    match outcome {
        Outcome::Processed { .. } | Outcome::Duplicate { .. } => Decision::Ack,
        Outcome::Failed(f) => match f.infra_fault() {
            Some(fault) => Decision::Wait(fault),
            None if f.is_retryable() => match policy.delay_after(attempts) {
                Some(delay) => Decision::Retry {
                    delay,
                    reason: f.reason(),
                },
                None => dead_letter(attempts),
            },
            None => dead_letter(attempts),
        },
        Outcome::Rejected(_) => dead_letter(0),
        Outcome::Conflict { .. } => dead_letter(attempts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{DecodeError, Failure, HandlerError, Rejection};
    use crate::store::StoreError;

    fn failed(f: Failure) -> Outcome<()> {
        Outcome::Failed(f)
    }

    #[test]
    fn infrastructure_waits_whatever_the_attempt() {
        let policy = RetryPolicy::none();
        let read_only = failed(Failure::Store(StoreError::ClaimLost));
        assert_eq!(
            decide(&read_only, 99, &policy),
            Decision::Wait(InfraFault::Contention)
        );
        let unreachable = failed(Failure::Handler(sqlx::Error::PoolTimedOut.into()));
        assert_eq!(
            decide(&unreachable, 1, &policy),
            Decision::Wait(InfraFault::Unreachable)
        );
    }

    #[test]
    fn retryable_handler_errors_retry_then_dead_letter() {
        let policy = RetryPolicy::default().max_attempts(2).without_jitter();
        let outcome = failed(Failure::Handler(HandlerError::retryable("flaky")));
        assert!(matches!(
            decide(&outcome, 1, &policy),
            Decision::Retry {
                reason: "handler_error",
                ..
            }
        ));
        assert!(matches!(
            decide(&outcome, 2, &policy),
            Decision::DeadLetter {
                reason: "handler_error",
                attempts: 2,
                ..
            }
        ));
    }

    #[test]
    fn message_faults_dead_letter_at_once() {
        let policy = RetryPolicy::default();
        let rejected: Outcome<()> =
            Outcome::Rejected(Rejection::Decode(DecodeError("bad json".into())));
        assert!(matches!(
            decide(&rejected, 1, &policy),
            Decision::DeadLetter {
                reason: "decode_error",
                attempts: 0,
                ..
            }
        ));
        let panicked = failed(Failure::Panic("boom".into()));
        assert!(matches!(
            decide(&panicked, 1, &RetryPolicy::none()),
            Decision::DeadLetter {
                reason: "handler_error",
                ..
            }
        ));
        let permanent = failed(Failure::Handler(HandlerError::permanent("no")));
        assert!(matches!(
            decide(&permanent, 1, &policy),
            Decision::DeadLetter { attempts: 1, .. }
        ));
        let processed = Outcome::Processed { result: () };
        assert_eq!(decide(&processed, 1, &policy), Decision::Ack);
    }

    #[test]
    fn a_handler_that_keeps_missing_its_deadline_is_dead_lettered_deadline() {
        let parked = failed(Failure::Deadline { misses: 3 });
        match decide(&parked, 1, &RetryPolicy::default().max_attempts(10)) {
            Decision::DeadLetter { reason, error, .. } => {
                assert_eq!(reason, "deadline");
                assert!(error.contains("3 times"), "{error}");
            }
            other => panic!("expected a dead letter, got {other:?}"),
        }
    }

    #[test]
    fn a_message_that_keeps_killing_the_process_is_dead_lettered_crashed() {
        // Whatever the retry policy: the handler is not run again.
        let crashed = failed(Failure::Crashed { crashes: 3 });
        match decide(&crashed, 1, &RetryPolicy::default().max_attempts(10)) {
            Decision::DeadLetter { reason, error, .. } => {
                assert_eq!(reason, "crashed");
                assert!(error.contains("3 times"), "{error}");
            }
            other => panic!("expected a dead letter, got {other:?}"),
        }
    }
}
