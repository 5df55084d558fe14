//! Publishing with publisher confirms: a publish counts only once the broker
//! confirmed it, and an unroutable one (no queue bound) is a failure.

use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation};

use super::AmqpConsumerError;
use super::message::set_text;

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
