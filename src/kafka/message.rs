//! A fetched Kafka record, as the workers see it.

use rdkafka::Message;
use rdkafka::message::{Headers, OwnedMessage};

use crate::delivery::Delivery;

/// A record handed to a worker, with the time it was first seen.
pub(crate) struct Envelope {
    pub(crate) message: OwnedMessage,
    pub(crate) first_seen_ms: u64,
}

impl Envelope {
    pub(crate) fn offset(&self) -> i64 {
        self.message.offset()
    }

    /// The engine's view of the record: payload, headers as metadata, the
    /// record key as the message key, and `topic/partition@offset` as the
    /// source stored with the claim.
    pub(crate) fn delivery(&self) -> Delivery {
        let m = &self.message;
        let mut d = Delivery::new(m.payload().unwrap_or_default()).with_source(source(
            m.topic(),
            m.partition(),
            m.offset(),
        ));
        if let Some(key) = m.key() {
            d = d.with_message_key(key);
        }
        if let Some(headers) = m.headers() {
            for h in headers.iter() {
                if let Some(value) = h.value {
                    d = d.with_metadata(h.key, value);
                }
            }
        }
        d
    }
}

/// `topic/partition@offset`.
pub(crate) fn source(topic: &str, partition: i32, offset: i64) -> String {
    format!("{topic}/{partition}@{offset}")
}
