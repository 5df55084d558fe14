//! Converting an AMQP delivery into the engine's [`Delivery`], and header
//! values back and forth.

use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::delivery::Delivery;

/// The engine's view of a message: body, headers with text or binary
/// values as metadata, `message_id` as the message key, and
/// [`source`] as the source stored with the claim. A
/// message the broker delivered before (`redelivered`, or a quorum queue's
/// `x-delivery-count` above 0) is a [suspect](Delivery::with_suspect): the
/// consumer that had it may have died in its handler.
pub(crate) fn to_delivery(queue: &str, message: &lapin::message::Delivery) -> Delivery {
    let props = &message.properties;
    let delivered_before = header_text(props.headers().as_ref(), "x-delivery-count")
        .and_then(|n| n.parse::<u64>().ok())
        .is_some_and(|n| n > 0);
    let mut d = Delivery::new(message.data.clone())
        .with_source(source(
            queue,
            message.exchange.as_str(),
            message.routing_key.as_str(),
        ))
        .with_suspect(message.redelivered || delivered_before);
    if let Some(id) = props.message_id() {
        d = d.with_message_key(id.as_str().as_bytes());
    }
    if let Some(headers) = props.headers() {
        for (name, value) in headers.inner() {
            if let Some(bytes) = value_bytes(value) {
                d = d.with_metadata(name.as_str(), bytes);
            }
        }
    }
    d
}

/// Where a delivery came from: `queue/exchange/routing-key`, or
/// `queue/routing-key` for the default exchange (a message sent straight to
/// a queue, e.g. a replay with `--to-queue`), never an empty segment such as
/// `orders//orders`.
pub(crate) fn source(queue: &str, exchange: &str, routing_key: &str) -> String {
    if exchange.is_empty() {
        format!("{queue}/{routing_key}")
    } else {
        format!("{queue}/{exchange}/{routing_key}")
    }
}

/// Text and binary header values as bytes; integers in decimal.
pub(crate) fn value_bytes(value: &AMQPValue) -> Option<Vec<u8>> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes().to_vec()),
        AMQPValue::ByteArray(b) => Some(b.as_slice().to_vec()),
        AMQPValue::ShortShortInt(n) => Some(n.to_string().into_bytes()),
        AMQPValue::ShortShortUInt(n) => Some(n.to_string().into_bytes()),
        AMQPValue::ShortInt(n) => Some(n.to_string().into_bytes()),
        AMQPValue::ShortUInt(n) => Some(n.to_string().into_bytes()),
        AMQPValue::LongInt(n) => Some(n.to_string().into_bytes()),
        AMQPValue::LongUInt(n) => Some(n.to_string().into_bytes()),
        AMQPValue::LongLongInt(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

/// A header as text, if present and textual or numeric.
pub(crate) fn header_text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    let value = headers?.inner().get(name)?;
    value_bytes(value).and_then(|b| String::from_utf8(b).ok())
}

/// Inserts a text header.
pub(crate) fn set_text(headers: &mut FieldTable, name: &str, value: &str) {
    headers.insert(
        ShortString::from(name),
        AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
    );
}

/// Inserts an integer header.
pub(crate) fn set_int(headers: &mut FieldTable, name: &str, value: i64) {
    headers.insert(ShortString::from(name), AMQPValue::LongLongInt(value));
}

#[cfg(test)]
mod tests {
    #[test]
    fn source_has_no_empty_segment() {
        assert_eq!(
            super::source("orders", "shop", "order.placed"),
            "orders/shop/order.placed"
        );
        assert_eq!(super::source("orders", "", "orders"), "orders/orders");
    }
}
