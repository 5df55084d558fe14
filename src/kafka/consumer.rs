//! The consumer: a polling thread that owns the librdkafka consumer, and a
//! tokio task per partition lane that processes records.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{ClientConfig, TopicPartitionList};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use super::ConsumerError;
use super::builder::KafkaConsumerBuilder;
use super::context::{ConsumerLag, DedupContext, commit};
use super::dead_letter::DeadLetterer;
use super::message::Envelope;
use super::partition::{Dispatched, Registry, Spawner, Tp, lock};
use super::worker::{Env, run_lane};
use crate::clock::{Clock, SystemClock};
use crate::engine::{Engine, Handler};
use crate::store::SqlStore;

/// How long one `poll` waits; bounds how late shutdown, commits and
/// resumption of paused partitions are noticed.
const POLL_TIMEOUT: Duration = Duration::from_millis(100);

/// The poll timeout while records wait for room at their workers.
const PAUSED_POLL_TIMEOUT: Duration = Duration::from_millis(2);

pub(super) struct Settings {
    pub(super) topics: Vec<String>,
    pub(super) key_concurrency: usize,
    pub(super) max_in_flight: usize,
    pub(super) batch_size: usize,
    pub(super) linger: Duration,
    pub(super) commit_interval: Duration,
    pub(super) exit_when_idle: Option<Duration>,
    pub(super) drain_timeout: Duration,
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
}

impl<S: SqlStore> KafkaConsumer<S> {
    /// Starts configuring a consumer whose claims go to `store`.
    pub fn builder(store: S) -> KafkaConsumerBuilder<S> {
        KafkaConsumerBuilder::new(store)
    }

    pub(super) fn new(
        engine: Engine<S>,
        config: ClientConfig,
        dead_letters: DeadLetterer,
        settings: Settings,
    ) -> Self {
        Self {
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
    pub async fn run<H>(self, handler: H) -> Result<(), ConsumerError>
    where
        H: Handler<S::Db> + 'static,
    {
        crate::consumer_support::until_signal(|shutdown| self.run_until(handler, shutdown)).await
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
    ) -> Result<(), ConsumerError>
    where
        H: Handler<S::Db> + 'static,
    {
        let runtime = Handle::current();
        // Stops the polling thread if this future is dropped, too.
        let shutdown = shutdown.child_token();
        let _stop_on_drop = shutdown.clone().drop_guard();
        let env = Arc::new(Env {
            engine: self.engine,
            handler,
            dead_letters: self.dead_letters,
            batch_size: self.settings.batch_size,
            linger: self.settings.linger,
            shutdown: shutdown.clone(),
            failure: Mutex::new(None),
        });
        let spawn_on = runtime.clone();
        let lanes_env = Arc::clone(&env);
        let spawner: Spawner = Arc::new(move |partition, rx| {
            spawn_on.spawn(run_lane(Arc::clone(&lanes_env), partition, rx))
        });
        let registry = Arc::new(Registry::new(
            spawner,
            self.settings.key_concurrency,
            self.settings.max_in_flight,
            self.settings.drain_timeout,
            runtime,
        ));
        let consumer: BaseConsumer<DedupContext> =
            self.config.create_with_context(DedupContext {
                registry: Arc::clone(&registry),
                lag: ConsumerLag::new(env.engine.scope()),
            })?;
        let topics: Vec<&str> = self.settings.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;

        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let poller = Poller {
            consumer,
            registry,
            commit_interval: self.settings.commit_interval,
            exit_when_idle: self.settings.exit_when_idle,
            shutdown,
        };
        std::thread::Builder::new()
            .name("onceonly-kafka-poll".into())
            .spawn(move || {
                let result = poller.run();
                // The consumer is dropped here: it leaves the group (its
                // revoke callback has nothing left to commit).
                let _ = done_tx.send(result);
            })
            .map_err(|e| ConsumerError::PollThread(e.to_string()))?;
        done_rx
            .await
            .map_err(|_| ConsumerError::PollThread("the polling thread panicked".into()))??;
        match lock(&env.failure).take() {
            Some(why) => Err(ConsumerError::Worker(why)),
            None => Ok(()),
        }
    }
}

struct Poller {
    consumer: BaseConsumer<DedupContext>,
    registry: Arc<Registry>,
    commit_interval: Duration,
    exit_when_idle: Option<Duration>,
    shutdown: CancellationToken,
}

impl Poller {
    fn run(self) -> Result<(), ConsumerError> {
        let mut last_commit = Instant::now();
        let mut fatal = None;
        while !self.shutdown.is_cancelled() {
            // Held records are handed to their workers here, between
            // polls: poll briefly while any wait, or the workers would idle
            // for up to a whole poll timeout.
            let timeout = if self.registry.any_held() {
                PAUSED_POLL_TIMEOUT
            } else {
                POLL_TIMEOUT
            };
            match self.consumer.poll(timeout) {
                Some(Ok(message)) => {
                    let envelope = Envelope {
                        message: message.detach(),
                        first_seen_ms: u64::try_from(SystemClock.now_ms()).unwrap_or(0),
                    };
                    if let Dispatched::Pause(tp) = self.registry.dispatch(envelope) {
                        self.set_paused(&[tp], true);
                    }
                }
                Some(Err(e)) => {
                    if let Some((code, reason)) = self.consumer.client().fatal_error() {
                        tracing::error!(?code, %reason, "fatal Kafka client error; stopping");
                        fatal = Some(ConsumerError::Fatal(format!("{code:?}: {reason}")));
                        break;
                    }
                    tracing::warn!(error = %e, "Kafka consumer error");
                }
                None => {}
            }
            let resume = self.registry.release_held();
            if !resume.is_empty() {
                self.set_paused(&resume, false);
            }
            if last_commit.elapsed() >= self.commit_interval {
                self.commit_finished();
                last_commit = Instant::now();
            }
            if let Some(idle) = self.exit_when_idle {
                if self.registry.is_drained(idle) {
                    tracing::info!(?idle, "drained and idle; stopping");
                    break;
                }
            }
        }
        // Graceful stop: finish what is running, commit, leave.
        let positions = self.registry.stop(None);
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
