//! Publishing with publisher confirms: a publish counts only once the broker
//! confirmed it, and an unroutable one (no queue bound) is a failure.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation};

use super::AmqpConsumerError;
use super::message::set_text;

/// Confirmed publishes on one channel, one at a time and each bounded.
///
/// One at a time, because lapin hands a `basic.return` (an unroutable
/// message) to whichever confirm completes next, not to its own publish:
/// two publishes in flight on one channel could swap verdicts, reporting
/// the routable one returned and the unroutable one delivered. Bounded,
/// because a broker under a memory or disk alarm stops reading from
/// publishers and never confirms.
///
/// After a publish timed out, its confirm (or return) may still arrive and
/// be taken for the next publish's: a caller that can should replace the
/// channel. The outbox publisher pipelines instead (see
/// [`pipeline`](super::pipeline)): it matches returns by message id.
#[derive(Debug)]
pub(crate) struct Confirms {
    one_at_a_time: tokio::sync::Mutex<()>,
    timeout: Duration,
}

/// How long one publish waits for its confirm by default.
pub(crate) const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

impl Confirms {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            one_at_a_time: tokio::sync::Mutex::new(()),
            timeout,
        }
    }

    /// Waits for this channel's turn: no other publish of this `Confirms`
    /// in flight until the guard drops.
    async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.one_at_a_time.lock().await
    }

    /// Publishes on `channel` once no other publish of this `Confirms` is
    /// in flight (waiting at most the timeout for that), and waits for the
    /// confirm for at most the timeout.
    pub(crate) async fn publish(
        &self,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), AmqpConsumerError> {
        let turn = tokio::time::timeout(self.timeout, self.turn())
            .await
            .map_err(|_| self.timed_out(exchange, routing_key))?;
        self.publish_in_turn(&turn, channel, exchange, routing_key, body, properties)
            .await
            .map_err(|(e, _)| e)
    }

    /// Publishes while holding the turn (see [`Confirms::turn`]), waiting
    /// for the confirm for at most the timeout. `Err` says whether the
    /// channel must be replaced: after a timeout (a late confirm or return
    /// would be taken for the next publish's) or a channel error; a nack or
    /// a return leaves it in order.
    async fn publish_in_turn(
        &self,
        _turn: &tokio::sync::MutexGuard<'_, ()>,
        channel: &Channel,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), (AmqpConsumerError, bool)> {
        let sent = tokio::time::timeout(
            self.timeout,
            publish_confirmed(channel, exchange, routing_key, body, properties),
        )
        .await;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err((e, !channel.status().connected())),
            Err(_) => Err((self.timed_out(exchange, routing_key), true)),
        }
    }

    fn timed_out(&self, exchange: &str, routing_key: &str) -> AmqpConsumerError {
        AmqpConsumerError::NotConfirmed {
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
            reason: format!("no confirm within {:?}", self.timeout),
        }
    }
}

/// Publishes and waits for the broker's confirm.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), AmqpConsumerError> {
    let failed = |reason: String| AmqpConsumerError::NotConfirmed {
        exchange: exchange.to_owned(),
        routing_key: routing_key.to_owned(),
        reason,
    };
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            options,
            body,
            properties,
        )
        .await
        .map_err(|e| failed(e.to_string()))?;
    match confirm.await {
        Ok(Confirmation::Ack(None)) => Ok(()),
        Ok(Confirmation::Ack(Some(_))) => Err(failed("unroutable: returned by the broker".into())),
        Ok(Confirmation::Nack(_)) => Err(failed("nacked by the broker".into())),
        Ok(Confirmation::NotRequested) => Err(failed("publisher confirms are off".into())),
        Err(e) => Err(failed(e.to_string())),
    }
}

/// Properties of a retry copy, dead letter or replayed copy: the original's, made
/// persistent, without `expiration` (a dead letter must not expire out of
/// the dead-letter queue; the original TTL is kept in a header) and without
/// `user_id` (the broker refuses a publish whose `user_id` is not the
/// connection's user).
pub(crate) fn copy_properties(
    original: &BasicProperties,
    mut headers: FieldTable,
) -> BasicProperties {
    if let Some(expiration) = original.expiration() {
        set_text(
            &mut headers,
            "x-onceonly-original-expiration",
            expiration.as_str(),
        );
    }
    let mut p = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(v) = original.content_type() {
        p = p.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        p = p.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        p = p.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        p = p.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        p = p.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        p = p.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        p = p.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        p = p.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        p = p.with_app_id(v.clone());
    }
    p
}
