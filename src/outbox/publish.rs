//! Publishers: what sends an outbox row to its destination and reports
//! only a confirmed delivery as success.

use std::time::Instant;

use async_trait::async_trait;

use super::backend::OutboxRow;
use super::message::{CAUSATION_HEADER, Kind, MESSAGE_ID_HEADER, TRACEPARENT_HEADER};

/// One message as it leaves: the row and every header it carries (the
/// user's, then [`Header::MessageId`](crate::Header::MessageId),
/// [`Header::CausationId`](crate::Header::CausationId) and `traceparent`).
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// The row.
    pub row: &'a OutboxRow,
    /// The headers to send.
    pub headers: Vec<(String, String)>,
}

impl<'a> Outgoing<'a> {
    pub(crate) fn new(row: &'a OutboxRow) -> Self {
        let mut headers = row.header_pairs();
        headers.push((MESSAGE_ID_HEADER.to_owned(), row.message_id.clone()));
        if let Some(causation) = &row.causation {
            headers.push((CAUSATION_HEADER.to_owned(), causation.clone()));
        }
        if let Some(traceparent) = &row.traceparent {
            // One trace context per message: the stored one wins over a
            // `traceparent` among the user's headers.
            headers.retain(|(name, _)| !name.eq_ignore_ascii_case(TRACEPARENT_HEADER));
            headers.push((TRACEPARENT_HEADER.to_owned(), traceparent.clone()));
        }
        Self { row, headers }
    }
}

/// A publish that was not confirmed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    permanent: bool,
    message: String,
}

impl PublishError {
    /// A failure worth retrying (broker or endpoint unavailable, timeout,
    /// 5xx).
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            permanent: false,
            message: message.into(),
        }
    }

    /// A failure retrying cannot fix (the endpoint refused the message with
    /// a 4xx, the destination does not exist): the row is parked as dead.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            permanent: true,
            message: message.into(),
        }
    }

    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

/// Sends outbox rows of one [`Kind`]. `Ok` means the destination confirmed
/// the message (Kafka: acknowledged by all in-sync replicas; AMQP: a
/// publisher confirm for a routed message; webhook: a 2xx answer).
#[async_trait]
pub trait Publisher: Send + Sync {
    /// The kind of destination this publisher serves.
    fn kind(&self) -> Kind;

    /// Publishes one message and waits for its confirmation.
    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError>;

    /// Publishes one ordering key's messages, in their order, and waits
    /// for their confirmations. Returns one result per message it tried,
    /// in order; it may try fewer than `messages` (the rest wait for the
    /// relay's next round). The relay marks sent the messages before the
    /// first failure, records that failure, and leaves every message after
    /// it pending, confirmed or not: they leave again after the failed
    /// one, with the same ids, so a failed message always blocks the ones
    /// behind it.
    ///
    /// The default publishes one message at a time, stops at the first
    /// failure, and starts no message after `deadline` (the relay's share
    /// of its lease). A publisher whose destination keeps the order of
    /// messages in flight overrides it to send them all before waiting:
    /// [`KafkaPublisher`] (the idempotent producer keeps a partition's
    /// order with several requests in flight) and [`AmqpPublisher`] (one
    /// channel per key, many confirms in flight) do. An override still
    /// bounds every wait.
    async fn publish_ordered(
        &self,
        messages: &[Outgoing<'_>],
        deadline: Instant,
    ) -> Vec<Result<(), PublishError>> {
        let mut results = Vec::with_capacity(messages.len());
        for message in messages {
            if !results.is_empty() && Instant::now() >= deadline {
                break;
            }
            let result = self.publish(message).await;
            let failed = result.is_err();
            results.push(result);
            if failed {
                break;
            }
        }
        results
    }
}

/// A shared publisher.
#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    fn kind(&self) -> Kind {
        (**self).kind()
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        (**self).publish(message).await
    }

    async fn publish_ordered(
        &self,
        messages: &[Outgoing<'_>],
        deadline: Instant,
    ) -> Vec<Result<(), PublishError>> {
        (**self).publish_ordered(messages, deadline).await
    }
}

/// [`Publisher::publish`] of a publisher whose one path is
/// [`publish_ordered`](Publisher::publish_ordered): `message` alone, by
/// `timeout` from now (`what` names the publisher in the error when
/// nothing was tried).
#[cfg(feature = "_broker")]
pub(crate) async fn publish_alone<P: Publisher + ?Sized>(
    publisher: &P,
    message: &Outgoing<'_>,
    timeout: std::time::Duration,
    what: &'static str,
) -> Result<(), PublishError> {
    let deadline = Instant::now() + timeout;
    let mut results = publisher
        .publish_ordered(std::slice::from_ref(message), deadline)
        .await;
    results.pop().unwrap_or_else(|| {
        Err(PublishError::retryable(format!(
            "{what}: nothing was published"
        )))
    })
}

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "webhook")]
mod webhook;

#[cfg(feature = "amqp")]
pub use amqp::AmqpPublisher;
#[cfg(feature = "kafka")]
pub use kafka::KafkaPublisher;
#[cfg(feature = "webhook")]
pub use webhook::{WebhookPublisher, WebhookSecretError, WebhookSigning};
