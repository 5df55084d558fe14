//! Counters of what a broker consumer did, returned when it stops.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::OutcomeKind;

/// What a broker consumer did during one run: what every transport counts
/// alike. [`KafkaConsumer`](crate::kafka::KafkaConsumer) returns it;
/// [`AmqpConsumer`](crate::amqp::AmqpConsumer) returns it inside
/// [`AmqpStats`](crate::amqp::AmqpStats), with what only AMQP counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Messages whose handler ran and committed.
    pub processed: u64,
    /// Messages whose key was already committed (handler not run).
    pub duplicates: u64,
    /// Retries scheduled: an AMQP retry queue, a Kafka retry-topic copy or
    /// an in-process Kafka retry.
    pub retried: u64,
    /// Messages sent to the dead-letter target.
    pub dead_lettered: u64,
    /// Messages older than their entity's state (see
    /// [`Outcome::Stale`](crate::Outcome::Stale)): acknowledged, handler
    /// not run.
    pub stale: u64,
    /// Times the consumer paused because its handler kept failing (see
    /// [`PausePolicy`](crate::PausePolicy)).
    pub pauses: u64,
    /// Messages settled for good: AMQP acks that reached the broker; Kafka
    /// records whose offset may now be committed.
    pub acked: u64,
}

/// The live counters behind a [`ConsumerStats`].
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) stale: AtomicU64,
    /// Shared with the consumer's [`Breaker`](super::pause::Breaker).
    pub(crate) pauses: Arc<AtomicU64>,
}

/// Adds one to `counter`.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Reads `counter`.
fn read(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

impl Counters {
    /// Counts a final outcome that is acknowledged (processed, duplicate
    /// or stale).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn settled(&self, kind: OutcomeKind) {
        match kind {
            OutcomeKind::Processed => bump(&self.processed),
            OutcomeKind::Duplicate => bump(&self.duplicates),
            OutcomeKind::Stale => bump(&self.stale),
            _ => {}
        }
    }

    pub(crate) fn snapshot(&self) -> ConsumerStats {
        ConsumerStats {
            processed: read(&self.processed),
            duplicates: read(&self.duplicates),
            retried: read(&self.retried),
            dead_lettered: read(&self.dead_lettered),
            acked: read(&self.acked),
            stale: read(&self.stale),
            pauses: read(&self.pauses),
        }
    }
}
