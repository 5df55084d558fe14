//! Configuration of a [`KafkaConsumer`].

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::FutureProducer;

use super::KafkaConsumerError;
use super::consumer::{KafkaConsumer, Settings};
use super::dead_letter::DeadLetterer;
use crate::broker::PausePolicy;
use crate::engine::EngineBuilder;
use crate::store::SqlStore;

/// The default [`KafkaConsumerBuilder::statistics_interval`]: 5 s.
pub(crate) const DEFAULT_STATISTICS_INTERVAL: Duration = Duration::from_secs(5);

/// The default [`KafkaConsumerBuilder::drain_timeout`]: 20 s.
pub(crate) const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Builds a [`KafkaConsumer`]. Required: [`brokers`](Self::brokers),
/// [`group_id`](Self::group_id), at least one [`topic`](Self::topic), and
/// a key in the engine builder it was given
/// ([`EngineBuilder::key_expr`]). Engine settings (key, fingerprint,
/// retention, retry policy, fences, scope, ...) live in that
/// [`EngineBuilder`] only.
pub struct KafkaConsumerBuilder<S> {
    engine: EngineBuilder<S>,
    brokers: Option<String>,
    group_id: Option<String>,
    topics: Vec<String>,
    dead_letter_topic: Option<String>,
    retry_topic: Option<String>,
    dead_letter_timeout: Duration,
    key_concurrency: usize,
    max_in_flight: usize,
    batch_size: usize,
    linger: Duration,
    commit_interval: Duration,
    statistics_interval: Duration,
    exit_when_idle: Option<Duration>,
    drain_timeout: Duration,
    common: Vec<(String, String)>,
    consumer: Vec<(String, String)>,
    producer: Vec<(String, String)>,
    group_protocol: Option<super::protocol::GroupProtocol>,
    pause: Option<PausePolicy>,
}

impl<S: SqlStore> KafkaConsumerBuilder<S> {
    pub(super) fn new(engine: EngineBuilder<S>) -> Self {
        Self {
            engine,
            brokers: None,
            group_id: None,
            topics: Vec::new(),
            dead_letter_topic: None,
            retry_topic: None,
            dead_letter_timeout: Duration::from_secs(30),
            key_concurrency: 1,
            max_in_flight: 1_000,
            batch_size: 1,
            linger: Duration::from_millis(5),
            commit_interval: Duration::from_millis(500),
            statistics_interval: DEFAULT_STATISTICS_INTERVAL,
            exit_when_idle: None,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            common: Vec::new(),
            consumer: Vec::new(),
            producer: Vec::new(),
            group_protocol: None,
            pause: None,
        }
    }

    /// The consumer group protocol (default
    /// [`Classic`](super::GroupProtocol::Classic)).
    /// [`Consumer`](super::GroupProtocol::Consumer) is KIP-848
    /// (`group.protocol=consumer`): the broker assigns partitions
    /// incrementally and owns the session and heartbeat timings, so
    /// `build` refuses `partition.assignment.strategy`,
    /// `session.timeout.ms` and `heartbeat.interval.ms` with it, and a
    /// `group.protocol` setting that disagrees. Revokes drain the same way
    /// under both.
    #[must_use]
    pub fn group_protocol(mut self, protocol: super::GroupProtocol) -> Self {
        self.group_protocol = Some(protocol);
        self
    }

    /// Pauses consuming while the handler keeps failing (a dependency
    /// down), instead of retrying every record to exhaustion and
    /// dead-lettering it: fetching from every assigned partition pauses,
    /// records in flight wait uncommitted, and a probe after each
    /// cool-down resumes consuming once the handler succeeds again. See
    /// [`PausePolicy`] for the rule; `build` refuses a policy that would
    /// pause only after the engine builder's
    /// [retry policy](EngineBuilder::retry) dead-letters.
    #[must_use]
    pub fn pause_on_failure(mut self, policy: PausePolicy) -> Self {
        self.pause = Some(policy);
        self
    }

    /// Bootstrap servers, e.g. `127.0.0.1:9092` (`bootstrap.servers`).
    #[must_use]
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.brokers = Some(brokers.into());
        self
    }

    /// Consumer group (`group.id`); also the default dedup scope.
    #[must_use]
    pub fn group_id(mut self, group: impl Into<String>) -> Self {
        self.group_id = Some(group.into());
        self
    }

    /// Subscribes to a topic (call once per topic).
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// One dead-letter topic for every source topic; by default a record of
    /// topic `T` goes to `T.dlt`. The topic must exist unless the broker
    /// creates topics automatically.
    #[must_use]
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Non-blocking retries (opt-in): a retryable failure is not retried in
    /// place, which holds up its partition, but as a copy published to
    /// `topic` (with `x-onceonly-attempts` and the time it is due,
    /// `x-onceonly-due`); once the broker acknowledged the copy, the record's
    /// offset moves on. The consumer also subscribes to `topic`, waits until
    /// each copy is due, and runs it through the same engine: a record that
    /// did take effect after all is a duplicate. Exhausted copies are
    /// dead-lettered to the dead-letter topic of their original topic, with
    /// their original coordinates. The topic must exist unless the broker
    /// creates topics automatically.
    ///
    /// The trade-off: order. In-place retries (the default) keep partition
    /// (and key) order, because nothing behind a retrying record runs before
    /// it is settled; with a retry topic, later records of the same key may
    /// take effect before the retried one. Use it where records are
    /// independent and a slow or flaky dependency must not stall a partition.
    #[must_use]
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.retry_topic = Some(topic.into());
        self
    }

    /// How long one dead-letter publish may wait for its acknowledgement
    /// before it is retried (default 30 s, librdkafka's `message.timeout.ms`).
    #[must_use]
    pub fn dead_letter_timeout(mut self, timeout: Duration) -> Self {
        self.dead_letter_timeout = timeout;
        self
    }

    /// Records of one partition processed concurrently, by record key: `1`
    /// (the default) keeps strict partition order; `n > 1` runs `n` lanes,
    /// each record going to the lane of its key's hash, so records with the
    /// same key stay in order while different keys run in parallel. Records
    /// without a key share one lane. Offsets are still committed only up to
    /// the first unfinished record.
    #[must_use]
    pub fn key_concurrency(mut self, lanes: usize) -> Self {
        self.key_concurrency = lanes;
        self
    }

    /// Records of one partition at its workers and not yet final (default
    /// 1000, and at least twice the [batch size](Self::batch_size), so that
    /// the next batch is ready while one is processed). At the bound the
    /// partition's queue is not read until room frees up: its records wait
    /// in librdkafka's bounded prefetch, so memory is bounded whatever the
    /// backlog, and nothing is paused or fetched again.
    #[must_use]
    pub fn max_in_flight(mut self, records: usize) -> Self {
        self.max_in_flight = records;
        self
    }

    /// Records of one lane claimed and handled in one transaction (default 1:
    /// a transaction per record). A batch that fails is retried record by
    /// record, so one poison record neither blocks nor doubles the others.
    #[must_use]
    pub fn batch_size(mut self, records: usize) -> Self {
        self.batch_size = records;
        self
    }

    /// How long a lane waits for a batch to fill (default 5 ms).
    #[must_use]
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// How often finished offsets are committed (default 500 ms). Offsets
    /// are also committed on revoke and on shutdown.
    #[must_use]
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// How often librdkafka reports statistics, from which the
    /// `onceonly_kafka_consumer_lag`
    /// gauge is set per topic and partition (default 5 s, librdkafka's
    /// `statistics.interval.ms`; the report is computed on librdkafka's
    /// own thread from data it already has, with no extra broker round
    /// trip). `Duration::ZERO` turns the statistics, and the gauge, off.
    #[must_use]
    pub fn statistics_interval(mut self, interval: Duration) -> Self {
        self.statistics_interval = interval;
        self
    }

    /// Stop once the group gave this member its assignment (an empty one
    /// too: a group with more members than partitions), every fetched record
    /// is final and committed, and neither records nor a rebalance arrived
    /// for `idle`. For batch jobs and tests; a broker outage longer than
    /// `idle` counts as idleness too.
    #[must_use]
    pub fn exit_when_idle(mut self, idle: Duration) -> Self {
        self.exit_when_idle = Some(idle);
        self
    }

    /// How long a revoke or a shutdown waits for records in progress
    /// (default 20 s). Records still running then are abandoned: their
    /// workers are aborted, their transactions roll back, their offsets stay
    /// uncommitted, and the next owner of the partition processes them
    /// (dedup absorbs any that had committed after all). Must be below
    /// `max.poll.interval.ms` (librdkafka's default 300 s): a revoke blocks
    /// the poll loop, and a member that stops polling for longer is thrown
    /// out of the group.
    #[must_use]
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// A librdkafka setting for both the consumer and the dead-letter
    /// producer (`security.protocol`, `sasl.*`, `client.id`, ...).
    #[must_use]
    pub fn config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.common.push((key.into(), value.into()));
        self
    }

    /// A librdkafka setting for the consumer only (`session.timeout.ms`,
    /// `partition.assignment.strategy`, ...). `enable.auto.commit` and
    /// `enable.auto.offset.store` cannot be turned on: offsets are committed
    /// by onceonly only.
    #[must_use]
    pub fn consumer_config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.consumer.push((key.into(), value.into()));
        self
    }

    /// A librdkafka setting for the dead-letter producer only (`acks` stays
    /// `all`: a dead letter must be durable before the offset moves on).
    #[must_use]
    pub fn producer_config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.producer.push((key.into(), value.into()));
        self
    }

    /// Validates the settings and creates the dead-letter producer.
    pub fn build(self) -> Result<KafkaConsumer<S>, KafkaConsumerError> {
        let missing = |what: &str| KafkaConsumerError::Config(format!("{what} is required"));
        let brokers = self.brokers.ok_or_else(|| missing("brokers"))?;
        let group = self.group_id.ok_or_else(|| missing("group_id"))?;
        if self.topics.is_empty() {
            return Err(missing("at least one topic"));
        }
        for (name, value) in [
            ("batch_size", self.batch_size),
            ("key_concurrency", self.key_concurrency),
            ("max_in_flight", self.max_in_flight),
        ] {
            if value == 0 {
                return Err(KafkaConsumerError::Config(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        for (key, value) in &self.consumer {
            let forbidden = matches!(
                key.as_str(),
                "enable.auto.commit" | "enable.auto.offset.store"
            ) && value != "false";
            if forbidden {
                return Err(KafkaConsumerError::Config(format!(
                    "{key}={value} would commit offsets of unfinished records"
                )));
            }
        }
        let settings: Vec<(String, String)> =
            self.common.iter().chain(&self.consumer).cloned().collect();
        let protocol = super::protocol::resolve(self.group_protocol, &settings)
            .map_err(KafkaConsumerError::Config)?;
        let max_poll_interval = self
            .common
            .iter()
            .chain(&self.consumer)
            .rev()
            .find(|(k, _)| k == "max.poll.interval.ms")
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .map_or(Duration::from_secs(300), Duration::from_millis);
        if self.drain_timeout >= max_poll_interval {
            return Err(KafkaConsumerError::Config(format!(
                "drain_timeout ({:?}) must be below max.poll.interval.ms ({max_poll_interval:?}): a revoke that waits longer gets the member thrown out of the group",
                self.drain_timeout
            )));
        }
        let engine = self
            .engine
            .or_scope(|| group.clone())
            .transport(crate::telemetry::TRANSPORT_KAFKA)
            .build()?;
        if let Some(pause) = &self.pause {
            pause
                .check(engine.retry_policy())
                .map_err(KafkaConsumerError::Config)?;
        }

        let mut consumer = ClientConfig::new();
        consumer
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            // Bounds librdkafka's prefetch per consumer (default 64 MiB).
            .set("queued.max.messages.kbytes", "16384");
        if !self.statistics_interval.is_zero() {
            // At least 1 ms: librdkafka reads 0 as "off".
            let ms = self.statistics_interval.as_millis().max(1);
            consumer.set("statistics.interval.ms", ms.to_string());
        }
        let mut producer = ClientConfig::new();
        producer
            .set("bootstrap.servers", &brokers)
            .set("acks", "all")
            .set(
                "message.timeout.ms",
                self.dead_letter_timeout.as_millis().to_string(),
            );
        for (key, value) in &self.common {
            consumer.set(key, value);
            producer.set(key, value);
        }
        for (key, value) in &self.consumer {
            consumer.set(key, value);
        }
        for (key, value) in &self.producer {
            producer.set(key, value);
        }
        if protocol == super::GroupProtocol::Consumer {
            consumer.set("group.protocol", protocol.as_str());
        }
        // Set last: never overridden.
        consumer
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        producer.set("acks", "all");
        let producer: FutureProducer = producer.create()?;
        let mut topics = self.topics;
        if let Some(retry) = &self.retry_topic {
            if topics.contains(retry) {
                return Err(KafkaConsumerError::Config(format!(
                    "the retry topic {retry:?} must not also be a source topic"
                )));
            }
            topics.push(retry.clone());
        }
        let dead_letters = DeadLetterer::new(
            producer,
            self.dead_letter_topic,
            self.retry_topic,
            engine.scope().to_owned(),
            self.dead_letter_timeout,
        );
        Ok(KafkaConsumer::new(
            engine,
            consumer,
            dead_letters,
            Settings {
                topics,
                key_concurrency: self.key_concurrency,
                max_in_flight: self.max_in_flight.max(self.batch_size.saturating_mul(2)),
                batch_size: self.batch_size,
                linger: self.linger,
                commit_interval: self.commit_interval,
                exit_when_idle: self.exit_when_idle,
                drain_timeout: self.drain_timeout,
                pause: self.pause,
            },
        ))
    }
}
