//! Publishing with publisher confirms: a publish counts only once the broker
//! confirmed it, and an unroutable one (no queue bound) is a failure.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Confirmation};

use super::ConsumerError;

/// Publishes and waits for the broker's confirm.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), ConsumerError> {
    let failed = |reason: String| ConsumerError::NotConfirmed {
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
