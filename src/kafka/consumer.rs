//! The consumer: a polling thread that owns the librdkafka consumer, and a
//! tokio task per partition lane that processes records.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{ClientConfig, TopicPartitionList};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use super::KafkaConsumerError;
use super::builder::KafkaConsumerBuilder;
use super::context::{ConsumerLag, DedupContext, commit};
use super::dead_letter::DeadLetterer;
use super::message::Envelope;
use super::partition::{Dispatched, Registry, Spawner, Tp, Wake};
use super::worker::{Env, run_lane};
use crate::broker::PausePolicy;
use crate::broker::pause::Breaker;
use crate::broker::wait::Waits;
use crate::broker::{ConsumerStats, Counters};
use crate::clock::{Clock, SystemClock};
use crate::engine::{Engine, Handler};
use crate::store::SqlStore;
use crate::sync::lock;

/// The longest the polling thread sleeps without a wake-up (librdkafka's
/// queue callbacks and finished records wake it earlier): bounds how late a
/// shutdown is noticed.
const MAX_WAIT: Duration = Duration::from_millis(100);

pub(super) struct Settings {
    pub(super) topics: Vec<String>,
    pub(super) key_concurrency: usize,
    pub(super) max_in_flight: usize,
    pub(super) batch_size: usize,
    pub(super) linger: Duration,
    pub(super) commit_interval: Duration,
    pub(super) exit_when_idle: Option<Duration>,
    pub(super) drain_timeout: Duration,
    pub(super) pause: Option<PausePolicy>,
}

/// A Kafka consumer group member that processes each record's effect exactly
/// once and commits offsets only behind finished records.
///
/// See the [module documentation](super) for the guarantee and each knob.
pub struct KafkaConsumer<S: SqlStore> {
    engine: Engine<S>,
    config: ClientConfig,
    dead_letters: DeadLetterer,
    settings: Settings,
    /// Its deliveries waiting for the infrastructure (the gauge's handle
    /// resolved at build, like every other metric handle).
    waits: Arc<Waits>,
    /// Pauses consuming while the handler keeps failing.
    breaker: Arc<Breaker>,
    counters: Counters,
}

impl<S: SqlStore> KafkaConsumer<S> {
    /// Starts configuring a consumer. `engine` holds every engine
    /// setting (key, fingerprint, retention, retries, fences, ...): pass
    /// `Engine::builder(store).key_expr("json:/out_trade_no")` (a key is
    /// required: a store alone fails `build`). Its scope defaults to the
    /// group id.
    pub fn builder(engine: impl Into<crate::EngineBuilder<S>>) -> KafkaConsumerBuilder<S> {
        KafkaConsumerBuilder::new(engine.into())
    }

    pub(super) fn new(
        engine: Engine<S>,
        config: ClientConfig,
        dead_letters: DeadLetterer,
        settings: Settings,
    ) -> Self {
        let counters = Counters::default();
        Self {
            waits: Waits::new(engine.telemetry()),
            breaker: Arc::new(Breaker::new(
                settings.pause,
                engine.telemetry(),
                Arc::clone(&counters.pauses),
            )),
            counters,
            engine,
            config,
            dead_letters,
            settings,
        }
    }

    /// The engine (store, scope, key spec) this consumer runs.
    pub fn engine(&self) -> &Engine<S> {
        &self.engine
    }

    /// Runs until SIGINT or SIGTERM (Ctrl-C elsewhere than Unix), or until
    /// idle if [`exit_when_idle`](KafkaConsumerBuilder::exit_when_idle) is
    /// set; then shuts down gracefully (see [`run_until`](Self::run_until)).
    pub async fn run<H>(self, handler: H) -> Result<ConsumerStats, KafkaConsumerError>
    where
        H: Handler<S::Db> + 'static,
    {
        crate::broker::shutdown::until_signal(|shutdown| self.run_until(handler, shutdown)).await
    }

    /// Runs until `shutdown` is cancelled (or until idle, if configured).
    /// Shutdown stops fetching, lets records being handled finish for at
    /// most the [drain timeout](KafkaConsumerBuilder::drain_timeout) (retry
    /// and outage waits are cut short; those records stay uncommitted),
    /// commits finished offsets synchronously and leaves the group.
    pub async fn run_until<H>(
        self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<ConsumerStats, KafkaConsumerError>
    where
        H: Handler<S::Db> + 'static,
    {
        if let Some(missing) = crate::broker::preflight::missing_schema(&self.engine).await {
            return Err(KafkaConsumerError::MissingSchema(missing));
        }
        let runtime = Handle::current();
        // Stops the polling thread if this future is dropped, too.
        let shutdown = shutdown.child_token();
        let _stop_on_drop = shutdown.clone().drop_guard();
        let waits = self.waits;
        let env = Arc::new(Env {
            engine: self.engine,
            handler,
            dead_letters: self.dead_letters,
            batch_size: self.settings.batch_size,
            linger: self.settings.linger,
            shutdown: shutdown.clone(),
            failure: Mutex::new(None),
            counters: self.counters,
            waits,
            breaker: Arc::clone(&self.breaker),
        });
        let spawn_on = runtime.clone();
        let lanes_env = Arc::clone(&env);
        let spawner: Spawner = Arc::new(move |partition, rx| {
            spawn_on.spawn(run_lane(Arc::clone(&lanes_env), partition, rx))
        });
        let wake = Arc::new(Wake::default());
        let registry = Arc::new(Registry::new(
            spawner,
            self.settings.key_concurrency,
            self.settings.max_in_flight,
            self.settings.drain_timeout,
            runtime,
            Arc::clone(&wake),
        ));
        let mut consumer: BaseConsumer<DedupContext> =
            self.config.create_with_context(DedupContext {
                registry: Arc::clone(&registry),
                lag: ConsumerLag::new(env.engine.scope()),
            })?;
        let main_wake = Arc::clone(&wake);
        consumer.set_nonempty_callback(move || main_wake.notify());
        let consumer = Arc::new(consumer);
        let topics: Vec<&str> = self.settings.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;

        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let poller = Poller {
            consumer,
            registry,
            wake,
            queues: HashMap::new(),
            split_epoch: 0,
            commit_interval: self.settings.commit_interval,
            exit_when_idle: self.settings.exit_when_idle,
            shutdown,
            breaker: self.breaker,
            breaker_paused: None,
        };
        std::thread::Builder::new()
            .name("onceonly-kafka-poll".into())
            .spawn(move || {
                let result = poller.run();
                // The consumer is dropped here: it leaves the group (its
                // revoke callback has nothing left to commit).
                let _ = done_tx.send(result);
            })
            .map_err(|e| KafkaConsumerError::PollThread(e.to_string()))?;
        done_rx
            .await
            .map_err(|_| KafkaConsumerError::PollThread("the polling thread panicked".into()))??;
        match lock(&env.failure).take() {
            Some(why) => Err(KafkaConsumerError::Worker(why)),
            None => Ok(env.counters.snapshot()),
        }
    }
}

struct Poller {
    consumer: Arc<BaseConsumer<DedupContext>>,
    registry: Arc<Registry>,
    wake: Arc<Wake>,
    /// Each assigned partition's own queue, split from the main queue, and
    /// the assignment epoch they were split in.
    queues: HashMap<Tp, PartitionQueue<DedupContext>>,
    split_epoch: u64,
    commit_interval: Duration,
    exit_when_idle: Option<Duration>,
    shutdown: CancellationToken,
    /// The consumer's breaker: fetching pauses during its cool-downs.
    breaker: Arc<Breaker>,
    /// The assignment epoch in which every assigned partition was paused
    /// for the breaker's cool-down, while it lasts.
    breaker_paused: Option<u64>,
}

impl Poller {
    fn run(mut self) -> Result<(), KafkaConsumerError> {
        let mut last_commit = Instant::now();
        let mut fatal = None;
        while !self.shutdown.is_cancelled() {
            // Events and rebalances (and records of partitions not split
            // yet) come through the main queue.
            if let Err(e) = self.drain_main_queue() {
                fatal = Some(e);
                break;
            }
            if self.split_assigned() {
                // Records fetched before the split went to the main queue:
                // hand them out before anything of the partitions' own
                // queues, to keep each partition's order.
                if let Err(e) = self.drain_main_queue() {
                    fatal = Some(e);
                    break;
                }
            }
            let resume = self.registry.release_held();
            // During a cool-down every partition stays paused; the
            // breaker's resume resumes them.
            if !resume.is_empty() && self.breaker_paused.is_none() {
                self.set_paused(&resume, false);
            }
            self.follow_breaker();
            self.read_partition_queues();
            if last_commit.elapsed() >= self.commit_interval {
                self.commit_finished();
                last_commit = Instant::now();
            }
            // Not while paused for a failing dependency: fetching stopped,
            // so nothing arriving says nothing about the backlog.
            if let Some(idle) = self.exit_when_idle
                && self.breaker_paused.is_none()
                && self.registry.is_drained(idle)
            {
                tracing::info!(?idle, "drained and idle; stopping");
                break;
            }
            // Until a queue becomes non-empty, a worker frees room, or
            // the next commit is due.
            let until_commit = self.commit_interval.saturating_sub(last_commit.elapsed());
            self.wake.wait(until_commit.min(MAX_WAIT));
        }
        // Graceful stop: finish what is running, commit, leave.
        let positions = self.registry.stop(None);
        self.queues.clear();
        if !positions.is_empty() {
            match commit(&self.consumer, &positions, CommitMode::Sync) {
                Ok(()) => tracing::info!(?positions, "final offsets committed"),
                Err(e) => {
                    tracing::warn!(error = %e, "final commit failed; the records are redelivered and deduplicated")
                }
            }
        }
        fatal.map_or(Ok(()), Err)
    }

    /// Pauses fetching from every assigned partition while the breaker
    /// cools down (again after each new assignment), and resumes the
    /// partitions not held back for their in-flight bound once it probes.
    /// Records in flight are untouched: they wait at the breaker.
    fn follow_breaker(&mut self) {
        let cooling = self.breaker.cooling_down();
        match (cooling, self.breaker_paused) {
            (false, None) => {}
            (true, paused) => {
                let (epoch, assigned) = self.registry.assignment();
                if paused != Some(epoch) {
                    self.set_paused(&assigned, true);
                    self.breaker_paused = Some(epoch);
                    tracing::debug!(
                        partitions = assigned.len(),
                        "fetching paused for the cool-down"
                    );
                }
            }
            (false, Some(_)) => {
                let (_, assigned) = self.registry.assignment();
                let resume = self.registry.not_held_back(assigned);
                self.set_paused(&resume, false);
                self.breaker_paused = None;
                tracing::debug!(partitions = resume.len(), "fetching resumed for the probe");
            }
        }
    }

    /// Serves the main queue until it is empty: rebalance callbacks, errors,
    /// and records of partitions without a queue of their own. `Err` on a
    /// fatal client error.
    fn drain_main_queue(&self) -> Result<(), KafkaConsumerError> {
        // `poll` answers `None` both when the queue is empty and when it
        // served an event (a rebalance, a commit result): stop at the second
        // `None` in a row.
        let mut nothing = 0;
        while nothing < 2 {
            match self.consumer.poll(Duration::ZERO) {
                Some(Ok(message)) => {
                    nothing = 0;
                    if let Dispatched::Pause(tp) = self.registry.dispatch(envelope(message)) {
                        self.set_paused(&[tp], true);
                    }
                }
                Some(Err(e)) => {
                    nothing = 0;
                    if let Some((code, reason)) = self.consumer.client().fatal_error() {
                        tracing::error!(?code, %reason, "fatal Kafka client error; stopping");
                        return Err(KafkaConsumerError::Fatal(format!("{code:?}: {reason}")));
                    }
                    tracing::warn!(error = %e, "Kafka consumer error");
                }
                None => nothing += 1,
            }
        }
        Ok(())
    }

    /// Gives every assigned partition its own queue after an assignment
    /// (librdkafka deactivates split queues on every assign). Returns
    /// whether it split anything.
    fn split_assigned(&mut self) -> bool {
        let (epoch, assigned) = self.registry.assignment();
        if epoch == self.split_epoch {
            // Revoked partitions lose their queue.
            self.queues.retain(|tp, _| assigned.contains(tp));
            return false;
        }
        self.split_epoch = epoch;
        self.queues.clear();
        for tp in assigned {
            match self.consumer.split_partition_queue(&tp.0, tp.1) {
                Some(mut queue) => {
                    let wake = Arc::clone(&self.wake);
                    queue.set_nonempty_callback(move || wake.notify());
                    self.queues.insert(tp, queue);
                }
                // Its records keep coming through the main queue, bounded by
                // pausing as before.
                None => {
                    tracing::warn!(topic = %tp.0, partition = tp.1, "cannot split the partition's queue; reading it from the main queue")
                }
            }
        }
        true
    }

    /// Hands out records of partitions with room, from their own queues. A
    /// full partition is not read: its records wait in librdkafka, whose
    /// prefetch is bounded (`queued.max.messages.kbytes`), and nothing is
    /// paused, dropped or fetched again.
    fn read_partition_queues(&self) {
        for (tp, queue) in &self.queues {
            while self.registry.has_room(tp) {
                match queue.poll(Duration::ZERO) {
                    Some(Ok(message)) => {
                        // Room was checked: it goes straight to a worker.
                        let _ = self.registry.dispatch(envelope(message));
                    }
                    Some(Err(e)) => {
                        tracing::warn!(topic = %tp.0, partition = tp.1, error = %e, "Kafka partition error");
                        break;
                    }
                    None => break,
                }
            }
        }
    }

    fn commit_finished(&self) {
        let positions = self.registry.commit_candidates();
        if positions.is_empty() {
            return;
        }
        match commit(&self.consumer, &positions, CommitMode::Sync) {
            Ok(()) => self.registry.committed(&positions),
            // Kept as candidates: retried at the next interval.
            Err(e) => tracing::warn!(error = %e, "offset commit failed; will retry"),
        }
    }

    fn set_paused(&self, tps: &[Tp], pause: bool) {
        if tps.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::with_capacity(tps.len());
        for (topic, partition) in tps {
            tpl.add_partition(topic, *partition);
        }
        let result = if pause {
            self.consumer.pause(&tpl)
        } else {
            self.consumer.resume(&tpl)
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, pause, partitions = ?tps, "pause/resume failed");
        }
    }
}

fn envelope(message: rdkafka::message::BorrowedMessage<'_>) -> Envelope {
    Envelope {
        message: message.detach(),
        first_seen_ms: u64::try_from(SystemClock.now_ms()).unwrap_or(0),
    }
}
