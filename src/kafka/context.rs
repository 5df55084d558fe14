//! Rebalance handling: librdkafka calls these on the polling thread, inside
//! `poll`, before and after it changes the assignment.

use std::sync::Arc;

use metrics::SharedString;
use rdkafka::Statistics;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::{Offset, TopicPartitionList};

use super::partition::{Registry, Tp};
use crate::telemetry::{KAFKA_CONSUMER_LAG, LABEL_PARTITION, LABEL_SCOPE, LABEL_TOPIC};

/// The consumer's context: owns the partition registry, and turns
/// librdkafka's statistics into the consumer-lag gauge.
pub(crate) struct DedupContext {
    pub(crate) registry: Arc<Registry>,
    pub(crate) lag: ConsumerLag,
}

impl ClientContext for DedupContext {
    /// Called on librdkafka's thread every `statistics.interval.ms`.
    fn stats(&self, statistics: Statistics) {
        self.lag.update(&statistics);
    }
}

/// Sets [`KAFKA_CONSUMER_LAG`] per topic and partition from librdkafka's
/// statistics: `consumer_lag` is the high watermark (the last stable
/// offset under `read_committed`) minus the committed offset, which
/// onceonly moves only behind finished records.
pub(crate) struct ConsumerLag {
    scope: SharedString,
}

impl ConsumerLag {
    pub(crate) fn new(scope: &str) -> Self {
        Self {
            scope: SharedString::from(Arc::<str>::from(scope)),
        }
    }

    /// Partitions this member does not fetch report a lag of -1 (unknown)
    /// and are skipped; revoked partitions are set to 0 by
    /// [`revoked`](Self::revoked), so that a member's series does not keep
    /// a stale lag once another member owns the partition.
    pub(crate) fn update(&self, statistics: &Statistics) {
        for (topic, t) in &statistics.topics {
            for (&partition, p) in &t.partitions {
                // -1 is librdkafka's internal "unassigned" partition.
                if partition < 0 || p.consumer_lag < 0 {
                    continue;
                }
                #[allow(clippy::cast_precision_loss)]
                let lag = p.consumer_lag as f64;
                metrics::gauge!(
                    KAFKA_CONSUMER_LAG,
                    LABEL_SCOPE => self.scope.clone(),
                    LABEL_TOPIC => topic.clone(),
                    LABEL_PARTITION => partition.to_string(),
                )
                .set(lag);
            }
        }
    }

    /// Zeroes the gauges of partitions this member no longer owns (the
    /// `metrics` facade cannot delete a series).
    pub(crate) fn revoked(&self, partitions: &[Tp]) {
        for (topic, partition) in partitions {
            metrics::gauge!(
                KAFKA_CONSUMER_LAG,
                LABEL_SCOPE => self.scope.clone(),
                LABEL_TOPIC => topic.clone(),
                LABEL_PARTITION => partition.to_string(),
            )
            .set(0.0);
        }
    }
}

impl ConsumerContext for DedupContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let tps = tps_of(tpl);
                let lost = consumer.assignment_lost();
                // Finish in-flight work of the revoked partitions; nothing of
                // theirs starts after this returns.
                let positions = self.registry.stop(Some(&tps));
                // librdkafka keeps a partition paused by the application
                // across unassign/assign: resume it, or it would stay paused
                // when it comes back to this member.
                set_resumed(consumer, tpl);
                if lost {
                    // Another member may own them already: committing now
                    // could move its position. Redelivery plus dedup covers
                    // whatever finished here.
                    tracing::warn!(partitions = ?tps, "assignment lost; not committing");
                } else if !positions.is_empty() {
                    match commit(consumer, &positions, CommitMode::Sync) {
                        Ok(()) => tracing::info!(?positions, "committed revoked partitions"),
                        Err(e) => {
                            tracing::warn!(error = %e, ?positions, "commit on revoke failed; the next owner reprocesses (deduplicated)")
                        }
                    }
                }
                self.lag.revoked(&tps);
                tracing::info!(partitions = ?tps, "partitions revoked");
            }
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            set_resumed(consumer, tpl);
            let tps = tps_of(tpl);
            tracing::info!(partitions = ?tps, "partitions assigned");
            self.registry.assign(tps);
        }
    }
}

fn set_resumed(consumer: &BaseConsumer<DedupContext>, tpl: &TopicPartitionList) {
    if let Err(e) = consumer.resume(tpl) {
        tracing::debug!(error = %e, "resume of (re)assigned partitions failed");
    }
}

fn tps_of(tpl: &TopicPartitionList) -> Vec<Tp> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

/// Commits the positions (offsets of the next records to consume).
pub(crate) fn commit<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    positions: &[(Tp, i64)],
    mode: CommitMode,
) -> Result<(), rdkafka::error::KafkaError> {
    let mut tpl = TopicPartitionList::with_capacity(positions.len());
    for ((topic, partition), position) in positions {
        tpl.add_partition_offset(topic, *partition, Offset::Offset(*position))?;
    }
    consumer.commit(&tpl, mode)
}
