//! How long a lane stays suspect after an assignment when it takes records
//! in batches: the partition's *batch mark*.
//!
//! A lane's records are suspects from the assignment until one of them is
//! processed (see [`run_lane`](super::worker::run_lane)): the record that
//! was running when the former owner died comes first among the records
//! whose key is new. With batches that no longer holds: a crash rolls the
//! whole batch back, so the records before the one that killed the process
//! are new again, and each restart would process one of them alone, end
//! suspicion, and run the killer in an uncounted batch again (about
//! `batch_size + max_crashes` deaths instead of `max_crashes + 1`).
//!
//! So a partition whose lanes may run batches is *marked* in the attempts
//! table (a counter under a key of its own, see
//! [`internal_key`](crate::store::internal_key)) before its first batch,
//! and the mark is deleted when all its lanes end with nothing in flight
//! (a revoke, a shutdown). A new owner finds the mark still there only if
//! the former owner died (or was aborted) with batches possibly in flight:
//! its lanes then stay suspect, processing record by record and counting
//! each new key's start, until each processed `batch_size` records, which
//! covers the batch that was running. After a clean handoff the window is
//! one record, as without batches. The mark costs a statement per
//! assignment and one per clean end, plus one renewal per half retention;
//! never one per batch.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use tokio::sync::OnceCell;

use crate::engine::Engine;
use crate::store::{ClaimTimes, SqlStore, internal_key};
use crate::sync::lock;

/// The batch mark of one assigned partition, shared by its lanes.
pub(crate) struct BatchMark {
    /// The mark's key in the attempts table.
    key: String,
    /// The partition, for the log.
    topic: String,
    partition: i32,
    /// How many records each lane processes alone after the assignment,
    /// once the mark was read (and set).
    window: OnceCell<usize>,
    /// When the mark was last set (renewed before it expires).
    set_at: Mutex<Option<Instant>>,
    /// Lanes still running.
    running: AtomicUsize,
    /// Lanes still suspect.
    suspect: AtomicUsize,
}

impl BatchMark {
    /// The mark of `topic`'s partition `partition`, which has `lanes`
    /// lanes.
    pub(crate) fn new(topic: &str, partition: i32, lanes: usize) -> Self {
        Self {
            key: internal_key("kafka-batches", &format!("{partition}/{topic}")),
            topic: topic.to_owned(),
            partition,
            window: OnceCell::new(),
            set_at: Mutex::new(None),
            running: AtomicUsize::new(lanes),
            suspect: AtomicUsize::new(lanes),
        }
    }

    /// How many records each lane of the partition processes alone after
    /// the assignment (1 after a clean handoff; `batch_size` when the
    /// former owner left the mark: a batch may have been running when it
    /// died), setting the mark for the batches to come. `None` while the
    /// database cannot tell (the lane stays suspect and asks again).
    pub(crate) async fn window<S: SqlStore>(
        &self,
        engine: &Engine<S>,
        batch_size: usize,
    ) -> Option<usize> {
        let (topic, partition) = (self.topic.as_str(), self.partition);
        let found = self
            .window
            .get_or_try_init(|| async {
                let marks = self.set(engine).await?;
                let window = if marks > 1 { batch_size } else { 1 };
                if window > 1 {
                    tracing::warn!(
                        topic,
                        partition,
                        window,
                        "the former owner of this partition died with batches in flight: \
                         its lanes process their first records one by one, as suspects"
                    );
                }
                Ok::<_, crate::store::StoreError>(window)
            })
            .await;
        match found {
            Ok(window) => Some(*window),
            Err(e) => {
                tracing::debug!(error = %e, topic, partition, "could not read the batch mark; the lane stays suspect");
                None
            }
        }
    }

    /// Sets the mark (one more on its counter); how many marks the counter
    /// holds now: more than one when the former owner's was still there.
    async fn set<S: SqlStore>(&self, engine: &Engine<S>) -> Result<u32, crate::store::StoreError> {
        let times = ClaimTimes::new(engine.now_ms(), engine.retention());
        let marks = engine
            .store()
            .bump_attempts(engine.scope(), &self.key, times)
            .await?;
        *lock(&self.set_at) = Some(Instant::now());
        Ok(marks)
    }

    /// Before a batch: sets the mark again once half its retention passed,
    /// so that it never expires under a long ownership.
    pub(crate) async fn renew<S: SqlStore>(&self, engine: &Engine<S>) {
        let due = lock(&self.set_at).is_none_or(|at| at.elapsed() >= engine.retention() / 2);
        if due && let Err(e) = self.set(engine).await {
            let (topic, partition) = (self.topic.as_str(), self.partition);
            tracing::debug!(error = %e, topic, partition, "could not renew the batch mark");
        }
    }

    /// A lane left suspicion.
    pub(crate) fn lane_trusted(&self) {
        self.suspect.fetch_sub(1, Ordering::AcqRel);
    }

    /// A lane ended with nothing in flight (its partition stopped, its
    /// queue closed, or it failed): the last one deletes the mark, unless
    /// the former owner's batch may still lie ahead (a lane left the
    /// revoke still suspect after a death). Should that fail, the next
    /// owner checks its first records one by one.
    pub(crate) async fn lane_ended<S: SqlStore>(&self, engine: &Engine<S>) {
        if self.running.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let Some(window) = self.window.get() else {
            // Never set here (no batch ran): a former owner's mark stays.
            return;
        };
        if *window > 1 && self.suspect.load(Ordering::Acquire) > 0 {
            return;
        }
        engine.forget_counter(engine.scope(), &self.key).await;
    }
}
