//! What the engine reports for each delivery. Transports act on it: ack,
//! commit the offset, answer, retry or dead-letter.

use crate::engine::fence::Stale;
use crate::engine::handler::{DecodeError, HandlerError};
use crate::fingerprint::Fingerprint;
use crate::key::{IdemKey, KeyError};
use crate::store::{InfraFault, StoreError};

/// The outcome of one delivery, with its key and attempt count.
#[derive(Debug)]
pub struct Report<T> {
    /// The derived key (`None` when no key could be derived).
    pub key: Option<IdemKey>,
    /// How many attempts were made (1 unless retried in-process).
    pub attempts: u32,
    /// What happened.
    pub outcome: Outcome<T>,
}

/// What happened to a delivery.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome<T> {
    /// The handler ran and its transaction, claim included, committed.
    /// Safe to acknowledge.
    Processed {
        /// The handler's result, as stored.
        result: T,
    },
    /// The key was already committed with the same payload: the handler did
    /// not run. Safe to acknowledge.
    Duplicate {
        /// The stored result; `None` if none was stored or it no longer
        /// decodes as the handler's output type.
        result: Option<T>,
    },
    /// The key was already committed with another payload fingerprint: the
    /// handler did not run. Dead-letter with reason `fingerprint_mismatch`
    /// (HTTP: 422).
    Conflict {
        /// The fingerprint stored with the key.
        stored: Option<Fingerprint>,
        /// The fingerprint of this delivery.
        received: Option<Fingerprint>,
    },
    /// Bad input: no key or undecodable payload. Never retried; dead-letter
    /// it (HTTP: 400).
    Rejected(Rejection),
    /// The delivery is older than its entity's state: a delivery of a
    /// higher order was applied to the same entity before (see
    /// [`FenceSpec`](crate::FenceSpec)). The handler did not run; the key
    /// is recorded as stale. Safe to acknowledge; never dead-lettered.
    Stale(Stale),
    /// The attempt failed and was rolled back: nothing of it was committed.
    Failed(Failure),
}

impl<T> Outcome<T> {
    /// A short label for logs, metrics and tables.
    pub fn kind(&self) -> OutcomeKind {
        match self {
            Self::Processed { .. } => OutcomeKind::Processed,
            Self::Duplicate { .. } => OutcomeKind::Duplicate,
            Self::Conflict { .. } => OutcomeKind::Conflict,
            Self::Rejected(_) => OutcomeKind::Rejected,
            Self::Failed(_) => OutcomeKind::Failed,
            Self::Stale(_) => OutcomeKind::Stale,
        }
    }

    /// The dead-letter reason code: `fingerprint_mismatch`, `bad_key`,
    /// `decode_error`, `handler_error`, `store_error`, `crashed` or
    /// `deadline`; `None`
    /// for processed, duplicate and stale deliveries.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Self::Processed { .. } | Self::Duplicate { .. } | Self::Stale(_) => None,
            Self::Conflict { .. } => Some("fingerprint_mismatch"),
            Self::Rejected(r) => Some(r.reason()),
            Self::Failed(f) => Some(f.reason()),
        }
    }

    /// What went wrong, for a dead letter's error text; `None` for processed,
    /// duplicate and stale deliveries.
    pub fn error_text(&self) -> Option<String> {
        match self {
            Self::Processed { .. } | Self::Duplicate { .. } | Self::Stale(_) => None,
            Self::Conflict { .. } => Some(
                "the key was already used for a different payload (fingerprint mismatch)"
                    .to_owned(),
            ),
            Self::Rejected(r) => Some(r.to_string()),
            Self::Failed(f) => Some(f.to_string()),
        }
    }

    /// Whether the delivery may be acknowledged without further action:
    /// its effect is committed (processed), was committed earlier
    /// (duplicate), or is superseded by a newer delivery's (stale).
    pub fn is_done(&self) -> bool {
        matches!(
            self,
            Self::Processed { .. } | Self::Duplicate { .. } | Self::Stale(_)
        )
    }
}

/// The variant of an [`Outcome`], without data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum OutcomeKind {
    /// See [`Outcome::Processed`].
    Processed,
    /// See [`Outcome::Duplicate`].
    Duplicate,
    /// See [`Outcome::Conflict`].
    Conflict,
    /// See [`Outcome::Rejected`].
    Rejected,
    /// See [`Outcome::Failed`].
    Failed,
    /// See [`Outcome::Stale`].
    Stale,
}

impl OutcomeKind {
    /// Lower-case name, e.g. `duplicate`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Conflict => "conflict",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::Stale => "stale",
        }
    }
}

/// Why a delivery was rejected as bad input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// No valid key could be derived.
    #[error(transparent)]
    BadKey(#[from] KeyError),
    /// The payload does not decode into the handler's input type.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

impl Rejection {
    /// `bad_key` or `decode_error`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::BadKey(e) => e.reason(),
            Self::Decode(_) => "decode_error",
        }
    }
}

/// Why an attempt failed. Whatever the cause, its transaction was rolled
/// back: no claim and no business write of it remain.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The handler returned an error.
    #[error("handler failed: {0}")]
    Handler(#[source] HandlerError),
    /// User code panicked: the handler, or a key function, decoder or the
    /// result's `Serialize` around it. Retried per the retry policy (a panic
    /// may come from a passing condition), then dead-lettered.
    #[error("handler panicked: {0}")]
    Panic(String),
    /// The dedup store (the database) failed. Unless it is a data exception
    /// on one of the message's values, this says nothing about the message:
    /// transports wait in place (see [`Failure::infra_fault`]).
    #[error("dedup store failed: {0}")]
    Store(#[source] StoreError),
    /// The handler's result could not be serialized for storage.
    #[error("cannot serialize the handler's result: {0}")]
    Encode(#[source] serde_json::Error),
    /// The handler kept a lock on its [`Tx`](crate::Tx) after it returned
    /// (moved into a spawned task or a streaming body): the engine could
    /// not take the transaction back, which rolls back when the lock is
    /// dropped. A bug of the handler, never retried.
    #[error("the handler kept the transaction after it returned")]
    TxHeld,
    /// The database refused the message's own writes as the transaction
    /// ended: a deferred constraint or a constraint trigger failing at
    /// `COMMIT`, or a transaction the handler left aborted (PostgreSQL
    /// `25P02`) after swallowing one of its errors (see
    /// [`is_write_fault`](crate::store::is_write_fault)). Nothing of the
    /// attempt is committed. Retried per the retry policy (a missing parent
    /// row may arrive), then dead-lettered (`handler_error`); never waited
    /// on as if the database were down.
    #[error("the database refused the message's writes at commit: {0}")]
    Commit(#[source] sqlx::Error),
    /// The delivery is a [suspect](crate::Delivery::with_suspect) whose
    /// handler was started `crashes` times already without ever finishing:
    /// each time, the process died under it (an abort, an out-of-memory
    /// kill, a segfault). The handler is not run again; the delivery is
    /// dead-lettered with reason `crashed` so that its partition or queue
    /// moves on (see [`EngineBuilder::max_crashes`](crate::EngineBuilder::max_crashes)).
    /// Never retried.
    #[error(
        "the process died {crashes} times while handling this delivery; parked instead of running it again"
    )]
    Crashed {
        /// How many started handler runs never finished.
        crashes: u32,
    },
    /// The handler kept its transaction past the
    /// [transaction deadline](crate::store::Deadlines::transaction)
    /// `misses` times for this key, each time rolled back, while the
    /// database answered: the handler is slower than the deadline, not the
    /// database unreachable. Parked (dead-lettered `deadline`) instead of
    /// waiting in place for ever; see
    /// [`EngineBuilder::max_deadline_misses`](crate::EngineBuilder::max_deadline_misses).
    /// Never retried.
    #[error(
        "the handler missed its transaction deadline {misses} times; parked instead of running it again"
    )]
    Deadline {
        /// How many of the key's attempts missed the deadline.
        misses: u32,
    },
    /// The [payload decoder](crate::engine::PayloadDecoder) could not reach
    /// what it needs (a schema registry down, slow or refusing the
    /// credentials). Nothing ran; the message is not at fault: transports
    /// wait in place (see [`Failure::infra_fault`]).
    #[error("the payload decoder is unavailable: {source}")]
    Decoder {
        /// What kind of outage it is.
        fault: InfraFault,
        /// What went wrong.
        #[source]
        source: crate::engine::BoxError,
    },
}

impl Failure {
    /// Whether the retry policy may try again: a retryable handler error,
    /// or any infrastructure failure.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Handler(e) => e.is_retryable() || e.is_infrastructure(),
            Self::Store(e) => e.is_infrastructure(),
            Self::Panic(_) | Self::Commit(_) | Self::Decoder { .. } => true,
            Self::Encode(_) | Self::TxHeld | Self::Crashed { .. } | Self::Deadline { .. } => false,
        }
    }

    /// The infrastructure fault this failure is, if it is the database's
    /// state rather than the message's (see [`InfraFault`]): a store
    /// failure other than a data exception, a handler error that
    /// [is one](HandlerError::infra_fault), or an unavailable
    /// [payload decoder](Failure::Decoder).
    pub fn infra_fault(&self) -> Option<InfraFault> {
        match self {
            Self::Store(e) => e.infra_fault(),
            Self::Handler(e) => e.infra_fault(),
            Self::Decoder { fault, .. } => Some(*fault),
            Self::Panic(_)
            | Self::Encode(_)
            | Self::TxHeld
            | Self::Commit(_)
            | Self::Crashed { .. }
            | Self::Deadline { .. } => None,
        }
    }

    /// Whether the failure is the infrastructure's rather than the
    /// message's (see [`Failure::infra_fault`]).
    pub fn is_infrastructure(&self) -> bool {
        self.infra_fault().is_some()
    }

    /// `store_error` for store failures, `crashed` for a delivery that
    /// crashed the process too often, `deadline` for one whose handler
    /// kept missing the transaction deadline, `handler_error` otherwise.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Store(_) => "store_error",
            Self::Crashed { .. } => "crashed",
            Self::Deadline { .. } => "deadline",
            _ => "handler_error",
        }
    }
}
