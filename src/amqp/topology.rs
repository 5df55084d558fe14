//! The queues a consumer uses: the work queue, one retry queue per retry
//! delay (messages wait there, then dead-letter back to the work queue), and
//! the dead-letter target.

use std::time::Duration;

use lapin::Channel;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use super::AmqpConsumerError;
use crate::engine::RetryPolicy;

/// How the work queue is obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueKind {
    /// Declare a durable classic queue (the default).
    #[default]
    Classic,
    /// Declare a durable quorum queue. Its poison-message limit
    /// (`x-delivery-limit`) dead-letters to the dead-letter target.
    Quorum,
    /// Use an existing queue as it is (passive declare: fails if missing).
    Existing,
}

/// Where messages that cannot be processed go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeadLetterTarget {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    /// Declare `routing_key` as a durable queue (default exchange target).
    pub(crate) declare: bool,
}

/// A retry queue: messages published there come back after `ttl_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RetryQueue {
    pub(crate) name: String,
    pub(crate) ttl_ms: u64,
}

/// The whole topology of one consumer.
#[derive(Clone, Debug)]
pub(crate) struct Topology {
    pub(crate) queue: String,
    pub(crate) kind: QueueKind,
    pub(crate) delivery_limit: Option<i64>,
    /// `retry[n - 1]` holds messages whose attempt `n` failed.
    pub(crate) retry: Vec<RetryQueue>,
    pub(crate) dead_letter: DeadLetterTarget,
}

impl Topology {
    pub(crate) fn new(
        queue: String,
        kind: QueueKind,
        delivery_limit: Option<i64>,
        policy: &RetryPolicy,
        dead_letter: DeadLetterTarget,
    ) -> Self {
        // Queue TTLs are fixed per queue, so delays are the policy's without
        // jitter; queues are named after their delay, so changing the policy
        // declares new queues instead of clashing with the old arguments.
        let nominal = policy.without_jitter();
        // Longest TTL RabbitMQ accepts: 2^32 - 1 ms.
        let retry = (1..policy.attempts())
            .filter_map(|n| nominal.delay_after(n))
            .map(|d| d.min(Duration::from_millis(u64::from(u32::MAX))))
            .map(|d| {
                let ttl_ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                RetryQueue {
                    name: format!("{queue}.retry.{ttl_ms}ms"),
                    ttl_ms,
                }
            })
            .collect();
        Self {
            queue,
            kind,
            delivery_limit,
            retry,
            dead_letter,
        }
    }

    /// The retry queue for a message whose attempt `attempt` just failed,
    /// or `None` when the policy is exhausted.
    pub(crate) fn retry_queue(&self, attempt: u32) -> Option<&RetryQueue> {
        let index = usize::try_from(attempt).ok()?.checked_sub(1)?;
        self.retry.get(index)
    }

    /// Declares everything (idempotent). A queue that exists with other
    /// arguments is a [`AmqpConsumerError::Topology`].
    pub(crate) async fn declare(&self, channel: &Channel) -> Result<(), AmqpConsumerError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        match self.kind {
            QueueKind::Existing => {
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                declare(channel, &self.queue, passive, FieldTable::default()).await?;
            }
            kind => {
                let mut args = FieldTable::default();
                if kind == QueueKind::Quorum {
                    text(&mut args, "x-queue-type", "quorum");
                    text(
                        &mut args,
                        "x-dead-letter-exchange",
                        &self.dead_letter.exchange,
                    );
                    text(
                        &mut args,
                        "x-dead-letter-routing-key",
                        &self.dead_letter.routing_key,
                    );
                    if let Some(limit) = self.delivery_limit {
                        args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
                    }
                }
                declare(channel, &self.queue, durable, args).await?;
            }
        }
        let mut declared = std::collections::HashSet::new();
        // Attempts past the delay cap share a queue: declare it once.
        for retry in self
            .retry
            .iter()
            .filter(|r| declared.insert(r.name.as_str()))
        {
            let mut args = FieldTable::default();
            args.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(i64::try_from(retry.ttl_ms).unwrap_or(i64::MAX)),
            );
            text(&mut args, "x-dead-letter-exchange", "");
            text(&mut args, "x-dead-letter-routing-key", &self.queue);
            declare(channel, &retry.name, durable, args).await?;
        }
        if self.dead_letter.declare {
            let mut args = FieldTable::default();
            if self.kind == QueueKind::Quorum {
                text(&mut args, "x-queue-type", "quorum");
            }
            declare(channel, &self.dead_letter.routing_key, durable, args).await?;
        }
        Ok(())
    }
}

fn text(args: &mut FieldTable, key: &str, value: &str) {
    args.insert(
        ShortString::from(key),
        AMQPValue::LongString(LongString::from(value)),
    );
}

async fn declare(
    channel: &Channel,
    name: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
) -> Result<(), AmqpConsumerError> {
    channel
        .queue_declare(name.into(), options, args)
        .await
        .map(drop)
        .map_err(|e| {
            if is_connection_level(&e) {
                AmqpConsumerError::Client(e)
            } else {
                AmqpConsumerError::Topology(e)
            }
        })
}

/// Whether an error is worth reconnecting for, rather than a refusal by the
/// broker that a retry cannot change: access refused (403), not found (404),
/// resource locked (405) or precondition failed (406, e.g. a queue declared
/// with other arguments).
pub(crate) fn is_connection_level(e: &lapin::Error) -> bool {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => !matches!(amqp.get_id(), 403..=406),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_retry_queue_per_delay_named_after_it() {
        use std::time::Duration;
        let policy = RetryPolicy::default()
            .max_attempts(4)
            .initial_delay(Duration::from_millis(100))
            .max_delay(Duration::from_millis(300));
        let dl = DeadLetterTarget {
            exchange: String::new(),
            routing_key: "orders.dlq".into(),
            declare: true,
        };
        let t = Topology::new("orders".into(), QueueKind::Classic, None, &policy, dl);
        let names: Vec<_> = t
            .retry
            .iter()
            .map(|r| (r.name.as_str(), r.ttl_ms))
            .collect();
        assert_eq!(
            names,
            [
                ("orders.retry.100ms", 100),
                ("orders.retry.200ms", 200),
                ("orders.retry.300ms", 300)
            ]
        );
        assert_eq!(t.retry_queue(1).map(|r| r.ttl_ms), Some(100));
        assert_eq!(t.retry_queue(3).map(|r| r.ttl_ms), Some(300));
        assert_eq!(t.retry_queue(4), None, "attempt 4 of 4 is the last");
        assert_eq!(t.retry_queue(0), None);
    }
}
