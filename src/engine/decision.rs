//! What a transport does with an outcome, decided in one place for every
//! transport: [`decide`], whose documentation holds the table of outcomes
//! and decisions.

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
///
/// This is the one table of outcomes and what becomes of them; the rest of
/// the documentation links here.
///
/// | Outcome | Reason code | Meaning | Decision |
/// |---|---|---|---|
/// | [`Processed { result }`](Outcome::Processed) | – | the handler ran; claim, writes and result committed | [`Ack`](Decision::Ack): ack, commit the offset, answer 2xx with the result |
/// | [`Duplicate { result }`](Outcome::Duplicate) | – | the key is already committed with the same fingerprint (also when its payload no longer decodes into the handler's input type); the handler does not run | [`Ack`](Decision::Ack); the stored result is replayed (an AMQP RPC caller whose stored result no longer decodes gets an error reply) |
/// | [`Stale(stale)`](Outcome::Stale) | – | the delivery is older than its entity's state (a [fence](crate::FenceSpec)); the handler does not run; the key is recorded as stale | [`Ack`](Decision::Ack) (HTTP: 200, or the provider's success answer); never dead-lettered |
/// | [`Conflict { stored, received }`](Outcome::Conflict) | `fingerprint_mismatch` | the key is already committed with another payload; the handler does not run | [`DeadLetter`](Decision::DeadLetter) (HTTP `422`) |
/// | [`Rejected`](Outcome::Rejected) | `bad_key`, `decode_error` | no valid key, or the payload does not decode (and its key is not committed); never retried | [`DeadLetter`](Decision::DeadLetter) (HTTP `400`) |
/// | [`Failed`](Outcome::Failed) with an [`InfraFault`] (unreachable, read-only, missing table, permission, resources, shutdown, timeout, contention, corrupt store), or a [payload decoder](crate::engine::PayloadDecoder) that cannot reach its schema registry | – | the database cannot take writes now, or the payload cannot be read now; rolled back | [`Wait`](Decision::Wait): no ack, no offset commit, no dead letter; process again after a jittered backoff, for as long as it lasts; never counted as an attempt |
/// | [`Failed`](Outcome::Failed): a retryable handler error or a panic (in the handler, a key function, a decoder), or the message's writes refused at COMMIT ([`Failure::Commit`](crate::Failure::Commit)) | `handler_error` | rolled back | [`Retry`](Decision::Retry) after the policy's delay; once the policy is exhausted, [`DeadLetter`](Decision::DeadLetter) (HTTP: a refusal at commit is `409 commit-refused`) |
/// | [`Failed`](Outcome::Failed): a permanent handler error, an unserializable result | `handler_error` | rolled back | [`DeadLetter`](Decision::DeadLetter) |
/// | [`Failed`](Outcome::Failed): a value of the message does not fit the dedup store (a data exception) | `store_error` | rolled back | [`DeadLetter`](Decision::DeadLetter) |
/// | [`Failed(Failure::Crashed)`](crate::Failure::Crashed) | `crashed` | a [suspect](crate::Delivery::with_suspect) whose handler killed the process [`max_crashes`](crate::EngineBuilder::max_crashes) times; the handler does not run again | [`DeadLetter`](Decision::DeadLetter), never retried |
/// | [`Failed(Failure::Deadline)`](crate::Failure::Deadline) | `deadline` | the handler kept its transaction past the [transaction deadline](crate::store::Deadlines::transaction) [`max_deadline_misses`](crate::EngineBuilder::max_deadline_misses) times (default 3) for this key while the database answered (fewer misses are a timeout: `Wait`); rolled back each time | [`DeadLetter`](Decision::DeadLetter), never retried (HTTP `500 deadline`); the key's counter starts over |
///
/// [`Outcome::reason`] gives the code, [`Outcome::kind`] a label for logs
/// and metrics, [`Outcome::is_done`] whether the delivery may be acked, and
/// [`Failure::infra_fault`](crate::Failure::infra_fault) /
/// [`Failure::is_retryable`](crate::Failure::is_retryable) classify
/// failures.
///
/// The Kafka and AMQP consumers translate a decision to their wire (commit
/// the offset or ack; wait in place; retry in place or through a retry
/// queue or topic; publish the dead letter, then commit or ack). The HTTP
/// layer maps the same classes to statuses (see [`crate::http`]).
pub fn decide<T>(outcome: &Outcome<T>, attempts: u32, policy: &RetryPolicy) -> Decision {
    let dead_letter = |attempts| Decision::DeadLetter {
        reason: outcome.reason().unwrap_or("handler_error"),
        error: outcome.error_text().unwrap_or_default(),
        attempts,
    };
    match outcome {
        Outcome::Processed { .. } | Outcome::Duplicate { .. } | Outcome::Stale(_) => Decision::Ack,
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
