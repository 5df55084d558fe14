//! What only the AMQP consumer counts, beside the [`ConsumerStats`] every
//! broker consumer returns.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::broker::{ConsumerStats, Counters};

fn read(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// What an [`AmqpConsumer`](super::AmqpConsumer) did during one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AmqpStats {
    /// What every broker consumer counts (processed, duplicates, retried,
    /// dead-lettered, acked).
    pub consumer: ConsumerStats,
    /// RPC replies published.
    pub replies: u64,
    /// Acks that could not be sent because the channel was gone (the
    /// broker redelivers those messages; dedup makes that harmless).
    pub acks_lost: u64,
    /// Connections (re)established.
    pub connections: u64,
}

/// The live counters behind an [`AmqpStats`].
#[derive(Default)]
pub(crate) struct AmqpCounters {
    pub(crate) consumer: Counters,
    pub(crate) replies: AtomicU64,
    pub(crate) acks_lost: AtomicU64,
    pub(crate) connections: AtomicU64,
}

impl AmqpCounters {
    /// Whether a connection was established since the last call.
    pub(crate) fn connections_since(&self, seen: &mut u64) -> bool {
        let now = read(&self.connections);
        let new = now > *seen;
        *seen = now;
        new
    }

    pub(crate) fn snapshot(&self) -> AmqpStats {
        AmqpStats {
            consumer: self.consumer.snapshot(),
            replies: read(&self.replies),
            acks_lost: read(&self.acks_lost),
            connections: read(&self.connections),
        }
    }
}
