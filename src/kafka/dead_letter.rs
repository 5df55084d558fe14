//! Publishing copies of a record, and waiting for the broker's
//! acknowledgement: to the dead-letter topic when it cannot be processed
//! (with the reason in headers), or to the retry topic when it failed
//! retryably and non-blocking retries are on (with the attempt count and the
//! time it is due).

use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::error::KafkaConsumerError;
use super::message::Envelope;

/// The names of the headers the Kafka consumer writes (see
/// [`Header`](crate::Header), the one table of them).
pub(crate) mod headers {
    use crate::Header;

    pub(crate) const ORIGINAL_TOPIC: &str = Header::OriginalTopic.name();
    pub(crate) const ORIGINAL_PARTITION: &str = Header::OriginalPartition.name();
    pub(crate) const ORIGINAL_OFFSET: &str = Header::OriginalOffset.name();
    pub(crate) const ORIGINAL_KEY: &str = Header::OriginalKey.name();
    pub(crate) const REASON: &str = Header::Reason.name();
    pub(crate) const ERROR: &str = Header::Error.name();
    pub(crate) const ATTEMPTS: &str = Header::Attempts.name();
    pub(crate) const FIRST_SEEN: &str = Header::FirstSeen.name();
    pub(crate) const IDEMPOTENCY_KEY: &str = Header::IdempotencyKey.name();
    pub(crate) const SCOPE: &str = Header::Scope.name();
    pub(crate) const DUE: &str = Header::Due.name();

    /// The headers this consumer writes on a copy (retry, dead letter): on
    /// an incoming record (a retried copy, a replayed dead letter) they are
    /// replaced, not repeated. Every other header, the outbox's message and
    /// causation ids included, is copied as it came.
    pub(crate) const WRITTEN: [&str; 11] = [
        ORIGINAL_TOPIC,
        ORIGINAL_PARTITION,
        ORIGINAL_OFFSET,
        ORIGINAL_KEY,
        REASON,
        ERROR,
        ATTEMPTS,
        FIRST_SEEN,
        IDEMPOTENCY_KEY,
        SCOPE,
        DUE,
    ];

    /// Whether `name` is one of the headers in [`WRITTEN`].
    pub(crate) fn is_written(name: &str) -> bool {
        WRITTEN.contains(&name)
    }
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
    retry_topic: Option<String>,
    scope: String,
    timeout: Duration,
}

impl DeadLetterer {
    pub(crate) fn new(
        producer: FutureProducer,
        topic: Option<String>,
        retry_topic: Option<String>,
        scope: String,
        timeout: Duration,
    ) -> Self {
        Self {
            producer,
            topic,
            retry_topic,
            scope,
            timeout,
        }
    }

    /// The retry topic of non-blocking retries, if they are on.
    pub(crate) fn retry_topic(&self) -> Option<&str> {
        self.retry_topic.as_deref()
    }

    /// Whether `m` is a copy in the retry topic.
    pub(crate) fn is_retry_copy(&self, m: &impl Message) -> bool {
        self.retry_topic.as_deref() == Some(m.topic())
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
    /// (the producer runs with `acks=all`). A retry copy is dead-lettered to
    /// the dead-letter topic of its original topic, with its original
    /// coordinates.
    pub(crate) async fn publish(
        &self,
        envelope: &Envelope,
        letter: &DeadLetter<'_>,
    ) -> Result<(), KafkaConsumerError> {
        let attempts = letter.attempts.to_string();
        let extra = [
            (headers::REASON, Some(letter.reason.as_bytes())),
            (headers::ERROR, Some(letter.error.as_bytes())),
            (headers::ATTEMPTS, Some(attempts.as_bytes())),
            (headers::IDEMPOTENCY_KEY, letter.key.map(str::as_bytes)),
        ];
        let origin = Origin::of(envelope, self.is_retry_copy(&envelope.message));
        let topic = self.topic_for(&origin.topic);
        self.send(envelope, &origin, &topic, &extra)
            .await
            .map_err(|source| KafkaConsumerError::DeadLetter { topic, source })
    }

    /// Publishes a copy of the record to the retry topic, due at `due_ms`
    /// after `attempts` attempts; `Ok` once acknowledged. Its partition then
    /// moves on.
    pub(crate) async fn publish_retry(
        &self,
        envelope: &Envelope,
        attempts: u32,
        due_ms: u64,
    ) -> Result<(), KafkaConsumerError> {
        let Some(topic) = self.retry_topic.clone() else {
            return Err(KafkaConsumerError::Config(
                "non-blocking retries need a retry topic".into(),
            ));
        };
        let attempts = attempts.to_string();
        let due = due_ms.to_string();
        let extra = [
            (headers::ATTEMPTS, Some(attempts.as_bytes())),
            (headers::DUE, Some(due.as_bytes())),
        ];
        let origin = Origin::of(envelope, self.is_retry_copy(&envelope.message));
        self.send(envelope, &origin, &topic, &extra)
            .await
            .map_err(|source| KafkaConsumerError::RetryCopy { topic, source })
    }

    /// Sends a copy of the record (payload, key, its own headers, those of
    /// an outbox included) to `topic` with this consumer's headers (the
    /// origin, the scope, and `extra`), which replace any it carried.
    async fn send(
        &self,
        envelope: &Envelope,
        origin: &Origin,
        topic: &str,
        extra: &[(&str, Option<&[u8]>)],
    ) -> Result<(), rdkafka::error::KafkaError> {
        let m = &envelope.message;
        // The trace context of the delivery that sends the copy (feature
        // `otel`), which replaces the one the record carried.
        #[cfg(feature = "otel")]
        let context = crate::otel::current();
        #[cfg(not(feature = "otel"))]
        let context: Vec<(String, String)> = Vec::new();
        let mut h = OwnedHeaders::new();
        if let Some(original) = m.headers() {
            for header in original.iter() {
                if !headers::is_written(header.key)
                    && !context
                        .iter()
                        .any(|(n, _)| n.eq_ignore_ascii_case(header.key))
                {
                    h = h.insert(header);
                }
            }
        }
        for (key, value) in &context {
            h = h.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let first_seen = origin.first_seen_ms.to_string();
        let common: [(&str, Option<&[u8]>); 6] = [
            (headers::ORIGINAL_TOPIC, Some(origin.topic.as_bytes())),
            (
                headers::ORIGINAL_PARTITION,
                Some(origin.partition.as_bytes()),
            ),
            (headers::ORIGINAL_OFFSET, Some(origin.offset.as_bytes())),
            (headers::ORIGINAL_KEY, m.key()),
            (headers::FIRST_SEEN, Some(first_seen.as_bytes())),
            (headers::SCOPE, Some(self.scope.as_bytes())),
        ];
        for &(key, value) in common.iter().chain(extra) {
            if let Some(value) = value {
                h = h.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).headers(h);
        if let Some(payload) = m.payload() {
            record = record.payload(payload);
        }
        if let Some(key) = m.key() {
            record = record.key(key);
        }
        match self.producer.send(record, self.timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(e),
        }
    }
}

/// Where a record first came from: itself, or, for a copy in the retry
/// topic, the coordinates its headers carry.
struct Origin {
    topic: String,
    partition: String,
    offset: String,
    first_seen_ms: u64,
}

impl Origin {
    fn of(envelope: &Envelope, retry_copy: bool) -> Self {
        let m = &envelope.message;
        // A replayed or retried record keeps the first-seen time of its
        // first failure.
        let first_seen_ms = header_text(m, headers::FIRST_SEEN)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(envelope.first_seen_ms);
        let from_headers = || {
            Some(Self {
                topic: header_text(m, headers::ORIGINAL_TOPIC)?.to_owned(),
                partition: header_text(m, headers::ORIGINAL_PARTITION)?.to_owned(),
                offset: header_text(m, headers::ORIGINAL_OFFSET)?.to_owned(),
                first_seen_ms,
            })
        };
        match retry_copy.then(from_headers).flatten() {
            Some(origin) => origin,
            None => Self {
                topic: m.topic().to_owned(),
                partition: m.partition().to_string(),
                offset: m.offset().to_string(),
                first_seen_ms,
            },
        }
    }
}

/// The value of header `name` of `m`, as text.
pub(crate) fn header_text<'m>(m: &'m impl Message, name: &str) -> Option<&'m str> {
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
}
