//! Counters of what a consumer did, returned when it stops.

use std::sync::atomic::{AtomicU64, Ordering};

/// What an [`AmqpConsumer`](super::AmqpConsumer) did during one run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AmqpStats {
    /// Messages whose handler ran and committed.
    pub processed: u64,
    /// Messages whose key was already committed (handler not run).
    pub duplicates: u64,
    /// Messages sent to a retry queue.
    pub retried: u64,
    /// Messages sent to the dead-letter target.
    pub dead_lettered: u64,
    /// RPC replies published.
    pub replies: u64,
    /// Acks that reached the broker.
    pub acked: u64,
    /// Acks that could not be sent because the channel was gone (the broker
    /// redelivers those messages; dedup makes that harmless).
    pub acks_lost: u64,
    /// Connections (re)established.
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
    /// Whether a connection was established since the last call.
    pub(crate) fn connections_since(&self, seen: &mut u64) -> bool {
        let now = self.connections.load(Ordering::Relaxed);
        let new = now > *seen;
        *seen = now;
        new
    }

    pub(crate) fn snapshot(&self) -> AmqpStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        AmqpStats {
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
