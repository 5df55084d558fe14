//! The partitions this consumer owns: their workers, offset trackers and
//! backpressure. Shared by the polling loop and the rebalance callback (both
//! run on the polling thread); workers only touch their own [`Partition`].

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::batch_mark::BatchMark;
use super::message::Envelope;
use super::offsets::OffsetTracker;
use crate::sync::lock;

/// A topic and partition.
pub(crate) type Tp = (String, i32);

/// Wakes the polling thread when there may be something to do: a
/// partition queue or the main queue became non-empty (librdkafka's
/// callbacks), or a worker finished a record (room for more).
#[derive(Default)]
pub(crate) struct Wake {
    pending: Mutex<bool>,
    cond: std::sync::Condvar,
}

impl Wake {
    pub(crate) fn notify(&self) {
        *lock(&self.pending) = true;
        self.cond.notify_one();
    }

    /// Waits until notified or `timeout` passed; consumes the notification.
    pub(crate) fn wait(&self, timeout: Duration) {
        let pending = lock(&self.pending);
        let (mut pending, _) = self
            .cond
            .wait_timeout_while(pending, timeout, |p| !*p)
            .unwrap_or_else(PoisonError::into_inner);
        *pending = false;
    }
}

/// What a worker shares with the registry about its partition.
pub(crate) struct Partition {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    /// Cancelled when the partition is revoked or the consumer shuts down:
    /// workers start nothing new and abandon retries (the record stays
    /// uncommitted and is redelivered to the next owner).
    pub(crate) stop: CancellationToken,
    /// Whether batches may have been running when the former owner died
    /// (lanes that take batches only).
    pub(crate) batches: BatchMark,
    tracker: Mutex<OffsetTracker>,
    wake: Arc<Wake>,
}

impl Partition {
    /// Marks `offset` final (committed, duplicate or dead-lettered), and
    /// tells the polling thread there is room for more.
    pub(crate) fn finish(&self, offset: i64) {
        lock(&self.tracker).finish(offset);
        self.wake.notify();
    }
}

/// Starts the worker of one lane of a partition.
pub(crate) type Spawner =
    Arc<dyn Fn(Arc<Partition>, UnboundedReceiver<Envelope>) -> JoinHandle<()> + Send + Sync>;

struct Slot {
    shared: Arc<Partition>,
    lanes: Vec<UnboundedSender<Envelope>>,
    tasks: Vec<JoinHandle<()>>,
    /// Records fetched while the partition was at its in-flight bound.
    held: VecDeque<Envelope>,
    paused: bool,
}

struct State {
    assigned: HashSet<Tp>,
    /// Whether the group's latest word to this member is an assignment
    /// (even an empty one: more members than partitions), rather than a
    /// revoke still waiting for the next assignment.
    joined: bool,
    /// Counts assignments: librdkafka deactivates split partition queues on
    /// every assign, so the polling thread splits them again when it moves.
    epoch: u64,
    slots: HashMap<Tp, Slot>,
    /// The last assignment change or fetched record.
    last_activity: Instant,
}

/// What the polling loop must do after a dispatch.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Dispatched {
    /// Handed to a worker (or dropped as already in hand / not assigned).
    Done,
    /// Held back: pause fetching from this partition.
    Pause(Tp),
}

/// The partitions owned by this consumer.
pub(crate) struct Registry {
    state: Mutex<State>,
    spawner: Spawner,
    lanes: usize,
    max_in_flight: usize,
    drain_timeout: Duration,
    runtime: Handle,
    wake: Arc<Wake>,
}

impl Registry {
    pub(crate) fn new(
        spawner: Spawner,
        lanes: usize,
        max_in_flight: usize,
        drain_timeout: Duration,
        runtime: Handle,
        wake: Arc<Wake>,
    ) -> Self {
        Self {
            state: Mutex::new(State {
                assigned: HashSet::new(),
                joined: false,
                epoch: 0,
                slots: HashMap::new(),
                last_activity: Instant::now(),
            }),
            spawner,
            lanes: lanes.max(1),
            max_in_flight: max_in_flight.max(1),
            drain_timeout,
            runtime,
            wake,
        }
    }

    /// Records newly assigned partitions.
    pub(crate) fn assign(&self, tps: impl IntoIterator<Item = Tp>) {
        let mut state = lock(&self.state);
        state.last_activity = Instant::now();
        state.joined = true;
        state.epoch += 1;
        state.assigned.extend(tps);
    }

    /// Hands a fetched record to the worker of its lane, or holds it back
    /// when its partition is at the in-flight bound (only records that came
    /// through the main queue can be held: a partition's own queue is read
    /// only when it [has room](Self::has_room)). Records of partitions
    /// not (or no longer) assigned are dropped: they stay uncommitted.
    pub(crate) fn dispatch(&self, envelope: Envelope) -> Dispatched {
        use rdkafka::Message;
        let tp: Tp = (
            envelope.message.topic().to_owned(),
            envelope.message.partition(),
        );
        let mut state = lock(&self.state);
        state.last_activity = Instant::now();
        if !state.assigned.contains(&tp) {
            tracing::debug!(topic = %tp.0, partition = tp.1, offset = envelope.offset(), "record of an unassigned partition dropped");
            return Dispatched::Done;
        }
        let slot = state
            .slots
            .entry(tp.clone())
            .or_insert_with(|| self.spawn(&tp));
        // Behind anything already held, to keep the partition's order.
        if !slot.held.is_empty() || lock(&slot.shared.tracker).in_flight() >= self.max_in_flight {
            slot.held.push_back(envelope);
            if !slot.paused && slot.held.len() >= self.max_in_flight {
                slot.paused = true;
                return Dispatched::Pause(tp);
            }
            return Dispatched::Done;
        }
        self.send(slot, envelope);
        Dispatched::Done
    }

    /// Moves held records to their workers as room frees up; returns the
    /// partitions to resume fetching: paused ones whose held records are
    /// down to half the bound.
    ///
    /// This is the fallback for records that came through the main queue
    /// (before their partition's queue was split, or if it cannot be). A
    /// partition has up to `max_in_flight` records at its workers and as
    /// many again held here, fetched, before it is paused; it resumes with
    /// half a window still held. The slack matters: librdkafka drops what it
    /// prefetched for a paused partition and fetches it again on resume, so
    /// pausing and resuming right at the bound would refetch at nearly every
    /// record and leave the workers waiting for each fetch.
    pub(crate) fn release_held(&self) -> Vec<Tp> {
        let mut state = lock(&self.state);
        let mut resume = Vec::new();
        let low_water = self.max_in_flight / 2;
        for (tp, slot) in state
            .slots
            .iter_mut()
            .filter(|(_, s)| !s.held.is_empty() || s.paused)
        {
            while lock(&slot.shared.tracker).in_flight() < self.max_in_flight {
                match slot.held.pop_front() {
                    Some(envelope) => self.send(slot, envelope),
                    None => break,
                }
            }
            if slot.paused && slot.held.len() <= low_water {
                slot.paused = false;
                resume.push(tp.clone());
            }
        }
        resume
    }

    /// Those of `tps` not paused for their in-flight bound.
    pub(crate) fn not_held_back(&self, tps: Vec<Tp>) -> Vec<Tp> {
        let state = lock(&self.state);
        tps.into_iter()
            .filter(|tp| state.slots.get(tp).is_none_or(|slot| !slot.paused))
            .collect()
    }

    /// Whether `tp` is assigned and can take another record now: nothing
    /// held back for it and fewer than `max_in_flight` at its workers. The
    /// polling thread reads a partition's own queue only then, so a full
    /// partition simply stays unread in librdkafka (no pause, no refetch).
    pub(crate) fn has_room(&self, tp: &Tp) -> bool {
        let state = lock(&self.state);
        if !state.assigned.contains(tp) {
            return false;
        }
        state.slots.get(tp).is_none_or(|slot| {
            slot.held.is_empty() && lock(&slot.shared.tracker).in_flight() < self.max_in_flight
        })
    }

    /// The current assignment and its epoch (see `State::epoch`).
    pub(crate) fn assignment(&self) -> (u64, Vec<Tp>) {
        let state = lock(&self.state);
        (state.epoch, state.assigned.iter().cloned().collect())
    }

    /// Commit positions that moved since the last commit.
    pub(crate) fn commit_candidates(&self) -> Vec<(Tp, i64)> {
        let state = lock(&self.state);
        state
            .slots
            .iter()
            .filter_map(|(tp, slot)| {
                lock(&slot.shared.tracker)
                    .commit_candidate()
                    .map(|p| (tp.clone(), p))
            })
            .collect()
    }

    /// Records that these positions were committed.
    pub(crate) fn committed(&self, positions: &[(Tp, i64)]) {
        let state = lock(&self.state);
        for (tp, position) in positions {
            if let Some(slot) = state.slots.get(tp) {
                lock(&slot.shared.tracker).committed(*position);
            }
        }
    }

    /// Whether the group gave this member an assignment (possibly empty:
    /// more members than partitions), nothing was fetched and the assignment
    /// did not change for `idle`, and every record handed out is final and
    /// committed.
    pub(crate) fn is_drained(&self, idle: Duration) -> bool {
        let state = lock(&self.state);
        state.joined
            && state.last_activity.elapsed() >= idle
            && state
                .slots
                .values()
                .all(|s| s.held.is_empty() && lock(&s.shared.tracker).is_settled())
    }

    /// Stops the workers of `which` (every partition if `None`): nothing new
    /// starts, work in progress finishes, held and queued records are dropped
    /// uncommitted. Blocks until the workers have exited, or at most for the
    /// drain timeout: workers still running then (a handler stuck on a lock,
    /// a hung dependency) are aborted, their transactions roll back, and
    /// their records stay uncommitted for the next owner. Returns the final
    /// commit positions. The partitions are forgotten.
    ///
    /// Must not be called from inside the tokio runtime (it blocks on it).
    pub(crate) fn stop(&self, which: Option<&[Tp]>) -> Vec<(Tp, i64)> {
        let slots: Vec<(Tp, Slot)> = {
            let mut state = lock(&self.state);
            state.last_activity = Instant::now();
            // Revoked: not idle-drained until the group assigns again.
            state.joined = false;
            match which {
                None => {
                    state.assigned.clear();
                    state.slots.drain().collect()
                }
                Some(tps) => tps
                    .iter()
                    .filter_map(|tp| {
                        state.assigned.remove(tp);
                        state.slots.remove_entry(tp)
                    })
                    .collect(),
            }
        };
        let mut tasks = Vec::new();
        for (_, slot) in &slots {
            slot.shared.stop.cancel();
        }
        let mut shared = Vec::new();
        for (tp, slot) in slots {
            tasks.extend(slot.tasks);
            shared.push((tp, slot.shared));
            // Dropping the senders ends the lanes' queues.
        }
        let deadline = self.drain_timeout;
        self.runtime.block_on(async {
            let finished = tokio::time::timeout(deadline, async {
                for task in &mut tasks {
                    if let Err(e) = task.await {
                        tracing::error!(error = %e, "a partition worker ended abnormally");
                    }
                }
            })
            .await;
            if finished.is_err() {
                let stuck = tasks.iter().filter(|t| !t.is_finished()).count();
                tracing::warn!(
                    ?deadline,
                    stuck,
                    "partition workers did not finish within the drain timeout; aborting them (their records stay uncommitted and are redelivered)"
                );
                for task in &tasks {
                    task.abort();
                }
            }
        });
        shared
            .into_iter()
            .filter_map(|(tp, p)| lock(&p.tracker).commit_candidate().map(|pos| (tp, pos)))
            .collect()
    }

    fn spawn(&self, tp: &Tp) -> Slot {
        let shared = Arc::new(Partition {
            topic: tp.0.clone(),
            partition: tp.1,
            stop: CancellationToken::new(),
            batches: BatchMark::new(&tp.0, tp.1, self.lanes),
            tracker: Mutex::default(),
            wake: Arc::clone(&self.wake),
        });
        let (lanes, tasks) = (0..self.lanes)
            .map(|_| {
                let (tx, rx) = unbounded_channel();
                (tx, (self.spawner)(Arc::clone(&shared), rx))
            })
            .unzip();
        Slot {
            shared,
            lanes,
            tasks,
            held: VecDeque::new(),
            paused: false,
        }
    }

    fn send(&self, slot: &Slot, envelope: Envelope) {
        if !lock(&slot.shared.tracker).dispatch(envelope.offset()) {
            return;
        }
        let lane = lane_of(&envelope, slot.lanes.len());
        if slot.lanes[lane].send(envelope).is_err() {
            // Only after a stop, which removes the slot first: unreachable
            // in practice, and the record stays uncommitted either way.
            tracing::warn!(topic = %slot.shared.topic, partition = slot.shared.partition, "worker gone, record left uncommitted");
        }
    }
}

/// Records with the same record key go to the same lane, so they are
/// processed in order; records without a key all share lane 0.
fn lane_of(envelope: &Envelope, lanes: usize) -> usize {
    use rdkafka::Message;
    if lanes <= 1 {
        return 0;
    }
    match envelope.message.key() {
        None => 0,
        Some(key) => {
            let mut h = DefaultHasher::new();
            key.hash(&mut h);
            (h.finish() % lanes as u64) as usize
        }
    }
}
