//! Counters of what a consumer did, returned by the Kafka and the AMQP
//! consumer alike when they stop.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a consumer ([`KafkaConsumer`](crate::kafka::KafkaConsumer) or
/// [`AmqpConsumer`](crate::amqp::AmqpConsumer)) did during one run.
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
    /// RPC replies published (AMQP only).
    pub replies: u64,
    /// Messages settled for good: AMQP acks that reached the broker; Kafka
    /// records whose offset may now be committed.
    pub acked: u64,
    /// AMQP acks that could not be sent because the channel was gone (the
    /// broker redelivers those messages; dedup makes that harmless).
    pub acks_lost: u64,
    /// Connections (re)established (AMQP only).
    pub connections: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) replies: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) acks_lost: AtomicU64,
    pub(crate) connections: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// Counts a final outcome that is acknowledged (processed or duplicate).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn settled(&self, kind: crate::engine::OutcomeKind) {
        match kind {
            crate::engine::OutcomeKind::Processed => bump(&self.processed),
            crate::engine::OutcomeKind::Duplicate => bump(&self.duplicates),
            _ => {}
        }
    }

    /// Whether a connection was established since the last call.
    #[cfg_attr(not(feature = "amqp"), allow(dead_code))]
    pub(crate) fn connections_since(&self, seen: &mut u64) -> bool {
        let now = self.connections.load(Ordering::Relaxed);
        let new = now > *seen;
        *seen = now;
        new
    }

    pub(crate) fn snapshot(&self) -> ConsumerStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ConsumerStats {
            processed: get(&self.processed),
            duplicates: get(&self.duplicates),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            replies: get(&self.replies),
            acked: get(&self.acked),
            acks_lost: get(&self.acks_lost),
            connections: get(&self.connections),
        }
    }
}
