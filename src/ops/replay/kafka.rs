//! Replaying a Kafka dead-letter topic: read each partition from the
//! replay group's committed offset up to the high watermark seen at the
//! start, republish each selected record to its original topic (`acks=all`,
//! idempotent producer, delivery awaited), and commit the dead-letter
//! offsets that are done, contiguously per partition.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::options::{ReplayOptions, required};
use super::report::{Action, Letter, ProgressFn, ReplayReport, record};
use super::{ORIGIN, PARKED_SUFFIX, REPLAYED_FROM, REPLAYS, ReplayError};
use crate::kafka::dead_letter::headers;

/// The consumer group a replay commits its dead-letter offsets under,
/// unless [`KafkaReplayBuilder::group`] says otherwise.
pub const DEFAULT_GROUP: &str = "onceonly-replay";

/// Bounds metadata, watermark and offset requests.
const META_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the run waits for the next record before giving up.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Commit after this many records (and at the end).
const COMMIT_EVERY: u64 = 100;

/// Builds a [`KafkaReplay`]. Required: [`brokers`](Self::brokers) and
/// [`topic`](Self::topic).
pub struct KafkaReplayBuilder {
    brokers: Option<String>,
    topic: Option<String>,
    group: String,
    commit_skipped: bool,
    from_beginning: bool,
    config: Vec<(String, String)>,
    options: ReplayOptions,
    progress: Option<ProgressFn>,
}

impl Default for KafkaReplayBuilder {
    fn default() -> Self {
        Self {
            brokers: None,
            topic: None,
            group: DEFAULT_GROUP.to_owned(),
            commit_skipped: false,
            from_beginning: false,
            config: Vec::new(),
            options: ReplayOptions::default(),
            progress: None,
        }
    }
}

impl std::fmt::Debug for KafkaReplayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaReplayBuilder")
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("commit_skipped", &self.commit_skipped)
            .field("from_beginning", &self.from_beginning)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl KafkaReplayBuilder {
    /// Bootstrap servers (`bootstrap.servers`).
    #[must_use]
    pub fn brokers(mut self, brokers: impl Into<String>) -> Self {
        self.brokers = Some(brokers.into());
        self
    }

    /// The dead-letter topic to read, e.g. `payments.dlt`.
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// The consumer group whose committed offsets mark how far the
    /// dead-letter topic has been replayed (default [`DEFAULT_GROUP`]).
    #[must_use]
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Also commit past records the filters skipped (default `false`):
    /// they are then behind the group's offset and only a
    /// [`from_beginning`](Self::from_beginning) run reaches them again.
    #[must_use]
    pub fn commit_skipped(mut self, yes: bool) -> Self {
        self.commit_skipped = yes;
        self
    }

    /// Read from the start of each partition instead of the committed
    /// offset. Offsets are still committed, but never moved backwards.
    #[must_use]
    pub fn from_beginning(mut self, yes: bool) -> Self {
        self.from_beginning = yes;
        self
    }

    /// A librdkafka setting for both the consumer and the producer (e.g.
    /// `security.protocol`). The settings the guarantees rest on (`acks`,
    /// idempotence, auto commit) cannot be overridden.
    #[must_use]
    pub fn config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    /// Filters, limit, rate and dry run.
    #[must_use]
    pub fn options(mut self, options: ReplayOptions) -> Self {
        self.options = options;
        self
    }

    /// Called after each dead letter.
    #[must_use]
    pub fn on_progress(mut self, f: impl Fn(&super::Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Checks the settings and creates the clients (no connection yet).
    pub fn build(self) -> Result<KafkaReplay, ReplayError> {
        let brokers = required(self.brokers, "the brokers list")?;
        let topic = required(self.topic, "the dead-letter topic")?;
        if self.group.is_empty() {
            return Err(ReplayError::Config(
                "the consumer group must not be empty".into(),
            ));
        }
        self.options.validate()?;
        let mut consumer = ClientConfig::new();
        let mut producer = ClientConfig::new();
        // One record in flight at a time: do not wait to fill a batch
        // (overridable).
        producer.set("linger.ms", "0");
        for c in [&mut consumer, &mut producer] {
            c.set("bootstrap.servers", &brokers);
            for (k, v) in &self.config {
                c.set(k, v);
            }
        }
        consumer
            .set("group.id", &self.group)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true");
        producer
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set(
                "message.timeout.ms",
                self.options.timeout().as_millis().to_string(),
            );
        let consumer: StreamConsumer = consumer.create()?;
        let producer: FutureProducer = producer.create()?;
        Ok(KafkaReplay {
            topic,
            commit_skipped: self.commit_skipped,
            from_beginning: self.from_beginning,
            consumer,
            producer,
            options: self.options,
            progress: self.progress,
        })
    }
}

/// Replays a Kafka dead-letter topic to the topics its records came from.
///
/// Each record goes back to `x-onceonly-original-topic`, to its
/// `x-onceonly-original-partition` (so it lands next to the records of its
/// key), with its record key, payload and headers (the user's, and the
/// outbox's `x-onceonly-message-id` and `x-onceonly-causation-id`) but
/// without the failure's verdict and coordinates (the Kafka consumer's headers in [`Header`](crate::Header),
/// except the first-seen time), plus
/// `x-onceonly-replayed-from: <dlt>/<partition>/<offset>`.
///
/// # Offsets: a dead-letter topic is a log
///
/// A record cannot be removed from a topic, so "replayed" means: behind the
/// committed offset of the replay group ([`DEFAULT_GROUP`] by default) on
/// the dead-letter topic. A run reads each partition from that offset up to
/// the high watermark seen at the start (records dead-lettered again during
/// the run are left for the next one) and commits, per partition, only the
/// contiguous prefix of records that are done:
/// - a replayed record is done once its delivery was acknowledged;
/// - a record that failed to republish is not: the partition stops there
///   (its later records are left for the next run) and the run reports it;
/// - a record the filters skipped is not done, unless
///   [`commit_skipped`](KafkaReplayBuilder::commit_skipped): a filtered run
///   still replays matching records after it, but cannot commit them. A
///   later run offers them again, and the consumer sees duplicates (counted
///   in [`ReplayReport::uncommitted`]). With `commit_skipped`, the skipped ones
///   fall behind the offset and only a
///   [`from_beginning`](KafkaReplayBuilder::from_beginning) run reads them.
///
/// A dry run commits nothing.
pub struct KafkaReplay {
    topic: String,
    commit_skipped: bool,
    from_beginning: bool,
    consumer: StreamConsumer,
    producer: FutureProducer,
    options: ReplayOptions,
    progress: Option<ProgressFn>,
}

impl std::fmt::Debug for KafkaReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaReplay")
            .field("topic", &self.topic)
            .field("commit_skipped", &self.commit_skipped)
            .field("from_beginning", &self.from_beginning)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Where one partition stands.
struct Partition {
    /// First offset past the captured high watermark.
    end: i64,
    /// The group's offset before the run (`None`: none).
    committed: Option<i64>,
    /// Offset to commit: everything before it is done.
    next_commit: i64,
    /// Whether every record so far was done (no gap before `next_commit`).
    contiguous: bool,
    /// Reached `end`, EOF, or stopped by a failure.
    done: bool,
}

impl KafkaReplay {
    /// Starts configuring a replay.
    pub fn builder() -> KafkaReplayBuilder {
        KafkaReplayBuilder::default()
    }

    /// Runs the replay. `Err` when the topic cannot be read or offsets
    /// cannot be committed; records that could not be republished are
    /// counted in [`ReplayReport::failed`] and stay uncommitted.
    ///
    /// Metadata, watermark and commit calls block the calling thread
    /// briefly (librdkafka has no async API for them).
    pub async fn run(&self) -> Result<ReplayReport, ReplayError> {
        let mut partitions = self.plan()?;
        let total: i64 = partitions
            .values()
            .map(|p| (p.end - p.next_commit).max(0))
            .sum();
        let mut report = ReplayReport {
            dry_run: self.options.dry_run,
            total: u64::try_from(total).unwrap_or(0),
            ..ReplayReport::default()
        };
        let mut tpl = TopicPartitionList::new();
        for (id, p) in &mut partitions {
            if p.next_commit >= p.end {
                p.done = true;
            } else {
                tpl.add_partition_offset(&self.topic, *id, Offset::Offset(p.next_commit))?;
            }
        }
        if tpl.count() == 0 {
            return Ok(report);
        }
        self.consumer.assign(&tpl)?;
        let mut pacer = self.options.pacer();
        let mut acted = 0u64;
        let mut since_commit = 0u64;
        let result: Result<(), ReplayError> = async {
            while partitions.values().any(|p| !p.done) && !self.options.limit_reached(acted) {
                let next = tokio::time::timeout(FETCH_TIMEOUT, self.consumer.recv()).await;
                let m = match next {
                    Err(_) => {
                        return Err(ReplayError::Timeout(format!(
                            "no record from {} within {FETCH_TIMEOUT:?}",
                            self.topic
                        )));
                    }
                    Ok(Err(KafkaError::PartitionEOF(id))) => {
                        if let Some(p) = partitions.get_mut(&id) {
                            p.done = true;
                        }
                        continue;
                    }
                    Ok(Err(e)) => return Err(e.into()),
                    Ok(Ok(m)) => m,
                };
                let Some(p) = partitions.get_mut(&m.partition()) else {
                    continue;
                };
                if p.done || m.offset() >= p.end || m.topic() != self.topic {
                    continue;
                }
                report.scanned += 1;
                let (action, error, letter) = self.handle(&m, &mut pacer, &mut acted).await?;
                match action {
                    Action::Replayed | Action::Parked if !self.options.dry_run && p.contiguous => {
                        p.next_commit = m.offset() + 1;
                    }
                    Action::Replayed | Action::Parked if !self.options.dry_run => {
                        report.uncommitted += 1;
                    }
                    Action::Skipped if p.contiguous && self.commit_skipped => {
                        p.next_commit = m.offset() + 1;
                    }
                    Action::Failed => {
                        p.contiguous = false;
                        p.done = true;
                    }
                    _ => p.contiguous = false,
                }
                if m.offset() + 1 >= p.end {
                    p.done = true;
                }
                record(&mut report, self.progress.as_ref(), letter, action, error);
                since_commit += 1;
                if since_commit >= COMMIT_EVERY {
                    since_commit = 0;
                    self.commit(&partitions)?;
                }
            }
            Ok(())
        }
        .await;
        let committed = self.commit(&partitions);
        let _ = self.consumer.unassign();
        result?;
        committed?;
        Ok(report.finish())
    }

    /// Partitions, their high watermarks and the group's offsets.
    fn plan(&self) -> Result<BTreeMap<i32, Partition>, ReplayError> {
        let metadata = self
            .consumer
            .fetch_metadata(Some(&self.topic), META_TIMEOUT)?;
        let Some(topic) = metadata.topics().iter().find(|t| t.name() == self.topic) else {
            return Err(ReplayError::SourceNotFound(self.topic.clone()));
        };
        match topic.error() {
            None => {}
            Some(e) if RDKafkaErrorCode::from(e) == RDKafkaErrorCode::UnknownTopicOrPartition => {
                return Err(ReplayError::SourceNotFound(self.topic.clone()));
            }
            Some(e) => return Err(KafkaError::MetadataFetch(e.into()).into()),
        }
        if topic.partitions().is_empty() {
            return Err(ReplayError::SourceNotFound(self.topic.clone()));
        }
        let mut tpl = TopicPartitionList::new();
        for p in topic.partitions() {
            tpl.add_partition(&self.topic, p.id());
        }
        let committed = self.consumer.committed_offsets(tpl, META_TIMEOUT)?;
        let mut out = BTreeMap::new();
        for p in topic.partitions() {
            let (low, high) = self
                .consumer
                .fetch_watermarks(&self.topic, p.id(), META_TIMEOUT)?;
            let committed =
                committed
                    .find_partition(&self.topic, p.id())
                    .and_then(|e| match e.offset() {
                        Offset::Offset(o) if o >= 0 => Some(o),
                        _ => None,
                    });
            let start = if self.from_beginning {
                low
            } else {
                committed.unwrap_or(low).max(low)
            };
            out.insert(
                p.id(),
                Partition {
                    end: high,
                    committed,
                    next_commit: start,
                    contiguous: true,
                    done: false,
                },
            );
        }
        Ok(out)
    }

    /// Filters and screens one record, and republishes (or parks) it if
    /// selected. `Err` only when the dedup table cannot be read.
    async fn handle(
        &self,
        m: &BorrowedMessage<'_>,
        pacer: &mut super::options::Pacer,
        acted: &mut u64,
    ) -> Result<(Action, Option<String>, Letter), ReplayError> {
        let mut letter = letter(m);
        let selected = self.options.matches(
            letter.reason.as_deref(),
            letter.key.as_deref(),
            letter.first_seen_ms,
            &letter.group,
        );
        if !selected {
            return Ok((Action::Skipped, None, letter));
        }
        *acted += 1;
        let screening = self
            .options
            .screen
            .check(
                letter.scope.as_deref(),
                letter.key.as_deref(),
                letter.first_seen_ms,
                m.payload().unwrap_or_default(),
            )
            .await?;
        letter.verdict = Some(screening.verdict);
        if screening.refused {
            return Ok((Action::Refused, None, letter));
        }
        if self.options.park(letter.replays) {
            let parking = format!("{}{PARKED_SUFFIX}", self.topic);
            letter.target = Some(parking.clone());
            if self.options.dry_run {
                return Ok((Action::Parked, None, letter));
            }
            let (action, error) = self.park(m, &parking).await;
            return Ok((action, error, letter));
        }
        let Some(topic) = text(m, headers::ORIGINAL_TOPIC) else {
            let error = format!("no {} header: unknown destination", headers::ORIGINAL_TOPIC);
            return Ok((Action::Failed, Some(error), letter));
        };
        if self.options.dry_run {
            return Ok((Action::WouldReplay, None, letter));
        }
        pacer.wait().await;
        let (action, error) = self.republish(m, topic, letter.replays).await;
        Ok((action, error, letter))
    }

    /// Sends the record as it is (verdict headers included) to the parking
    /// topic.
    async fn park(&self, m: &BorrowedMessage<'_>, parking: &str) -> (Action, Option<String>) {
        let mut out: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(parking);
        if let Some(h) = m.headers() {
            out = out.headers(h.detach());
        }
        if let Some(payload) = m.payload() {
            out = out.payload(payload);
        }
        if let Some(key) = m.key() {
            out = out.key(key);
        }
        match self.producer.send(out, self.options.timeout()).await {
            Ok(_) => (Action::Parked, None),
            Err((e, _)) => (
                Action::Failed,
                Some(format!("parking in {parking} failed: {e}")),
            ),
        }
    }

    /// Republishes the record to `topic`, its replay count raised.
    async fn republish(
        &self,
        m: &BorrowedMessage<'_>,
        topic: &str,
        replays: u32,
    ) -> (Action, Option<String>) {
        let from = format!("{}/{}/{}", self.topic, m.partition(), m.offset());
        let mut h = OwnedHeaders::new();
        if let Some(original) = m.headers() {
            for header in original.iter() {
                // The failure verdict and coordinates go (and an earlier
                // replay's mark); the first-seen time stays, as on AMQP, so
                // `--since` means the same there. Everything else stays:
                // the user's headers and the outbox's message and
                // causation ids, which downstream consumers key on.
                let verdict = headers::is_written(header.key)
                    || header.key == REPLAYED_FROM
                    || header.key == REPLAYS;
                if !verdict || header.key == headers::FIRST_SEEN {
                    h = h.insert(header);
                }
            }
        }
        h = h.insert(Header {
            key: REPLAYED_FROM,
            value: Some(from.as_bytes()),
        });
        let count = replays.saturating_add(1).to_string();
        h = h.insert(Header {
            key: REPLAYS,
            value: Some(count.as_bytes()),
        });
        let origin = format!(
            "{topic}/{}@{}",
            text(m, headers::ORIGINAL_PARTITION).unwrap_or("?"),
            text(m, headers::ORIGINAL_OFFSET).unwrap_or("?"),
        );
        if text(m, ORIGIN).is_none() {
            h = h.insert(Header {
                key: ORIGIN,
                value: Some(origin.as_bytes()),
            });
        }
        let mut out: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(h);
        if let Some(payload) = m.payload() {
            out = out.payload(payload);
        }
        if let Some(key) = m.key().or_else(|| bytes(m, headers::ORIGINAL_KEY)) {
            out = out.key(key);
        }
        if let Some(partition) = text(m, headers::ORIGINAL_PARTITION).and_then(|t| t.parse().ok()) {
            out = out.partition(partition);
        }
        match self.producer.send(out, self.options.timeout()).await {
            Ok(_) => (Action::Replayed, None),
            Err((e, _)) => (
                Action::Failed,
                Some(format!("publishing to {topic} failed: {e}")),
            ),
        }
    }

    /// Commits every partition whose done prefix moved past the group's
    /// previous offset (never backwards). Nothing in a dry run.
    fn commit(&self, partitions: &BTreeMap<i32, Partition>) -> Result<(), ReplayError> {
        if self.options.dry_run {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        for (id, p) in partitions {
            if p.committed.is_none_or(|c| p.next_commit > c) {
                tpl.add_partition_offset(&self.topic, *id, Offset::Offset(p.next_commit))?;
            }
        }
        if tpl.count() > 0 {
            self.consumer.commit(&tpl, CommitMode::Sync)?;
        }
        Ok(())
    }
}

fn bytes<'a>(m: &'a BorrowedMessage<'_>, name: &str) -> Option<&'a [u8]> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
}

fn text<'a>(m: &'a BorrowedMessage<'_>, name: &str) -> Option<&'a str> {
    bytes(m, name).and_then(|v| std::str::from_utf8(v).ok())
}

fn letter(m: &BorrowedMessage<'_>) -> Letter {
    let target =
        text(m, headers::ORIGINAL_TOPIC).map(|t| match text(m, headers::ORIGINAL_PARTITION) {
            Some(p) => format!("{t}/{p}"),
            None => t.to_owned(),
        });
    let owned = |name| text(m, name).map(str::to_owned);
    Letter::new(
        format!("{}/{}@{}", m.topic(), m.partition(), m.offset()),
        owned(headers::REASON),
        owned(headers::IDEMPOTENCY_KEY),
        target,
        owned(headers::SCOPE),
        owned(headers::ERROR),
        text(m, headers::FIRST_SEEN)
            .and_then(|t| t.parse().ok())
            .or_else(|| m.timestamp().to_millis()),
        text(m, REPLAYS).and_then(|n| n.parse().ok()).unwrap_or(0),
    )
}
