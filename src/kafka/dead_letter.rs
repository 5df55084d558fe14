//! Publishing a record that cannot be processed to the dead-letter topic,
//! with the reason in headers, and waiting for the broker's acknowledgement.

use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::error::ConsumerError;
use super::message::Envelope;

/// Header names written on every dead-lettered record. Values are UTF-8
/// text; numbers are decimal.
pub mod headers {
    /// The topic the record was consumed from.
    pub const ORIGINAL_TOPIC: &str = "x-onceonly-original-topic";
    /// Its partition.
    pub const ORIGINAL_PARTITION: &str = "x-onceonly-original-partition";
    /// Its offset.
    pub const ORIGINAL_OFFSET: &str = "x-onceonly-original-offset";
    /// Its record key, verbatim (absent for a record without key). The
    /// dead-letter record carries the same record key.
    pub const ORIGINAL_KEY: &str = "x-onceonly-original-key";
    /// `handler_error`, `fingerprint_mismatch`, `bad_key` or `decode_error`.
    pub const REASON: &str = "x-onceonly-reason";
    /// The error text.
    pub const ERROR: &str = "x-onceonly-error";
    /// How many times the handler ran (0 when the record was rejected before).
    pub const ATTEMPTS: &str = "x-onceonly-attempts";
    /// When this consumer first fetched the record, in milliseconds since
    /// the Unix epoch.
    pub const FIRST_SEEN: &str = "x-onceonly-first-seen";
    /// The idempotency key, when one could be derived.
    pub const IDEMPOTENCY_KEY: &str = "x-onceonly-idempotency-key";
    /// The dedup scope (by default the consumer group).
    pub const SCOPE: &str = "x-onceonly-scope";
    /// Prefix shared by all of the above; such headers on an incoming record
    /// (a replayed dead letter) are replaced, not repeated.
    pub const PREFIX: &str = "x-onceonly-";
}

/// Why a record is dead-lettered.
pub(crate) struct DeadLetter<'a> {
    pub(crate) reason: &'static str,
    pub(crate) error: String,
    pub(crate) attempts: u32,
    pub(crate) key: Option<&'a str>,
}

/// Publishes dead letters and waits for their delivery reports.
pub(crate) struct DeadLetterer {
    producer: FutureProducer,
    topic: Option<String>,
    scope: String,
    timeout: Duration,
}

impl DeadLetterer {
    pub(crate) fn new(
        producer: FutureProducer,
        topic: Option<String>,
        scope: String,
        timeout: Duration,
    ) -> Self {
        Self {
            producer,
            topic,
            scope,
            timeout,
        }
    }

    /// The dead-letter topic for records of `topic`: the configured one, or
    /// `<topic>.dlt`.
    pub(crate) fn topic_for(&self, topic: &str) -> String {
        match &self.topic {
            Some(t) => t.clone(),
            None => format!("{topic}.dlt"),
        }
    }

    /// Publishes one dead letter; `Ok` only once the broker acknowledged it
    /// (the producer runs with `acks=all`).
    pub(crate) async fn publish(
        &self,
        envelope: &Envelope,
        letter: &DeadLetter<'_>,
    ) -> Result<(), ConsumerError> {
        let m = &envelope.message;
        let mut h = OwnedHeaders::new();
        if let Some(original) = m.headers() {
            for header in original.iter() {
                if !header.key.starts_with(headers::PREFIX) {
                    h = h.insert(header);
                }
            }
        }
        let partition = m.partition().to_string();
        let offset = m.offset().to_string();
        let attempts = letter.attempts.to_string();
        // A replayed record keeps the first-seen time of its first failure.
        let first_seen = m
            .headers()
            .and_then(|hs| {
                hs.iter()
                    .find(|h| h.key == headers::FIRST_SEEN)
                    .and_then(|h| h.value)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .unwrap_or(envelope.first_seen_ms)
            .to_string();
        let text: [(&str, Option<&[u8]>); 10] = [
            (headers::ORIGINAL_TOPIC, Some(m.topic().as_bytes())),
            (headers::ORIGINAL_PARTITION, Some(partition.as_bytes())),
            (headers::ORIGINAL_OFFSET, Some(offset.as_bytes())),
            (headers::ORIGINAL_KEY, m.key()),
            (headers::REASON, Some(letter.reason.as_bytes())),
            (headers::ERROR, Some(letter.error.as_bytes())),
            (headers::ATTEMPTS, Some(attempts.as_bytes())),
            (headers::FIRST_SEEN, Some(first_seen.as_bytes())),
            (headers::IDEMPOTENCY_KEY, letter.key.map(str::as_bytes)),
            (headers::SCOPE, Some(self.scope.as_bytes())),
        ];
        for (key, value) in text {
            if let Some(value) = value {
                h = h.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let topic = self.topic_for(m.topic());
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(h);
        if let Some(payload) = m.payload() {
            record = record.payload(payload);
        }
        if let Some(key) = m.key() {
            record = record.key(key);
        }
        match self.producer.send(record, self.timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(ConsumerError::DeadLetter { topic, source: e }),
        }
    }
}
