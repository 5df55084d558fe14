//! The Kafka publisher: an idempotent producer that sends an ordering
//! key's messages without waiting for each one's acknowledgement.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use rdkafka::types::RDKafkaErrorCode;

use super::{Kind, Outgoing, PublishError, Publisher};

/// How long a publish waits for delivery reports beyond the producer's own
/// `message.timeout.ms` (which librdkafka enforces itself) before it gives
/// up on them.
const REPORT_GRACE: Duration = Duration::from_secs(5);

/// How long a publish waits before it offers a message again to a full
/// producer queue.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);

/// Publishes to Kafka with an idempotent producer (`acks=all`,
/// `enable.idempotence=true`, `enable.gapless.guarantee=true`): a record
/// counts as sent once every in-sync replica has it.
///
/// An ordering key's messages that go to one partition (the same message
/// key) are all handed to the producer at once and their acknowledgements
/// awaited afterwards: the idempotent producer keeps a partition's order
/// with up to 5 requests in flight, retries included. With the gapless
/// guarantee, a failure that would leave a gap in a partition's sequence
/// is a fatal producer error instead of a silent skip: every message after
/// it fails too, and the publisher replaces the producer (a fatal error
/// ends a producer for good). A message that times out
/// (`message.timeout.ms`) is outside that guarantee: one of its key's
/// messages already in flight behind it may still be written, ahead of
/// it; the relay leaves it pending and sends it again after the failed
/// one, with the same id. Messages without a message key may land on any
/// partition, so each waits for the one before it.
pub struct KafkaPublisher {
    config: ClientConfig,
    producer: Mutex<Current>,
    timeout: Duration,
}

/// The producer in use, numbered so that a fatal error replaces only the
/// producer that raised it.
struct Current {
    generation: u64,
    producer: Arc<FutureProducer>,
}

impl KafkaPublisher {
    /// A producer for `brokers` (`host:port,...`).
    pub fn new(brokers: &str) -> Result<Self, KafkaError> {
        Self::with_config(ClientConfig::new().set("bootstrap.servers", brokers))
    }

    /// A producer from your own configuration (TLS, SASL, ...);
    /// `enable.idempotence`, `enable.gapless.guarantee` and `acks=all` are
    /// set on top. `linger.ms` defaults to 0 (a relay round hands over its
    /// messages at once, so waiting to fill a batch only adds latency) and
    /// `message.timeout.ms` to 30 s, the bound of a publish; yours win if
    /// you set them.
    pub fn with_config(config: &ClientConfig) -> Result<Self, KafkaError> {
        let mut config = config.clone();
        for (name, value) in [("linger.ms", "0"), ("message.timeout.ms", "30000")] {
            if config.get(name).is_none() {
                config.set(name, value);
            }
        }
        config
            .set("enable.idempotence", "true")
            .set("enable.gapless.guarantee", "true")
            .set("acks", "all");
        let timeout = config
            .get("message.timeout.ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .map_or(Duration::from_secs(30), Duration::from_millis);
        let producer = Arc::new(config.create()?);
        Ok(Self {
            config,
            producer: Mutex::new(Current {
                generation: 0,
                producer,
            }),
            timeout,
        })
    }

    fn current(&self) -> MutexGuard<'_, Current> {
        crate::sync::lock(&self.producer)
    }

    /// Replaces producer `generation` after a fatal error (if it is still
    /// the current one).
    fn replace(&self, generation: u64, why: &str) {
        let fresh: Result<FutureProducer, KafkaError> = self.config.create();
        let old = {
            let mut current = self.current();
            if current.generation != generation {
                return;
            }
            match fresh {
                Ok(fresh) => {
                    current.generation += 1;
                    std::mem::replace(&mut current.producer, Arc::new(fresh))
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot replace the Kafka producer after a fatal error; retrying with the next publish");
                    return;
                }
            }
        };
        tracing::error!(
            error = why,
            "the Kafka producer hit a fatal error; replaced it"
        );
        // Dropping a producer joins its polling thread: not on the runtime.
        drop(tokio::task::spawn_blocking(move || drop(old)));
    }

    /// Hands one message to the producer, waiting (until `started` plus
    /// the timeout) while its queue is full.
    async fn enqueue(
        &self,
        producer: &FutureProducer,
        message: &Outgoing<'_>,
        started: Instant,
    ) -> Result<DeliveryFuture, PublishError> {
        let row = message.row;
        let mut headers = OwnedHeaders::new();
        for (name, value) in &message.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(&row.destination)
            .payload(&row.payload)
            .headers(headers);
        if let Some(key) = &row.message_key {
            record = record.key(key);
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if started.elapsed() < self.timeout =>
                {
                    record = back;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, _)) => return Err(failure(&row.destination, &e)),
            }
        }
    }

    /// Publishes `run` (messages for one partition, or a single one) on
    /// `producer`: hands them all over, then collects their delivery
    /// reports in order, each bounded. Appends one result per message
    /// tried; a message the producer refused ends the run.
    async fn publish_run(
        &self,
        producer: &FutureProducer,
        run: &[Outgoing<'_>],
        results: &mut Vec<Result<(), PublishError>>,
    ) {
        let started = Instant::now();
        let mut deliveries = Vec::with_capacity(run.len());
        let mut refused = None;
        for message in run {
            match self.enqueue(producer, message, started).await {
                Ok(delivery) => deliveries.push((message, delivery)),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let bound = tokio::time::Instant::from_std(started + self.timeout + REPORT_GRACE);
        for (message, delivery) in deliveries {
            let topic = &message.row.destination;
            results.push(match tokio::time::timeout_at(bound, delivery).await {
                Ok(Ok(Ok(_))) => Ok(()),
                Ok(Ok(Err((e, _)))) => Err(failure(topic, &e)),
                Ok(Err(_canceled)) => Err(PublishError::retryable(format!(
                    "kafka {topic}: the producer went away before reporting"
                ))),
                Err(_) => Err(PublishError::retryable(format!(
                    "kafka {topic}: no delivery report within {:?}",
                    self.timeout + REPORT_GRACE
                ))),
            });
        }
        results.extend(refused.map(Err));
    }
}

/// A delivery failure as a [`PublishError`]: permanent for what no retry
/// fixes (too large, invalid, not authorized).
fn failure(topic: &str, e: &KafkaError) -> PublishError {
    use RDKafkaErrorCode as C;
    let permanent = matches!(
        e.rdkafka_error_code(),
        Some(C::MessageSizeTooLarge | C::InvalidRecord | C::TopicAuthorizationFailed)
    );
    let text = format!("kafka {topic}: {e}");
    if permanent {
        PublishError::permanent(text)
    } else {
        PublishError::retryable(text)
    }
}

/// Splits a key's messages into runs that may be in flight together: the
/// consecutive messages with the same message key (one partition). A
/// message without a key is a run of its own.
fn runs<'m, 'a>(messages: &'m [Outgoing<'a>]) -> Vec<&'m [Outgoing<'a>]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=messages.len() {
        let cut = i == messages.len() || {
            let (a, b) = (
                &messages[i - 1].row.message_key,
                &messages[i].row.message_key,
            );
            a.is_none() || a != b
        };
        if cut {
            runs.push(&messages[start..i]);
            start = i;
        }
    }
    runs
}

#[async_trait]
impl Publisher for KafkaPublisher {
    fn kind(&self) -> Kind {
        Kind::Kafka
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        super::publish_alone(self, message, self.timeout, "kafka").await
    }

    /// Hands each run of messages for one partition to the producer at
    /// once and waits for its reports; the next run starts only once the
    /// previous one was acknowledged in full. A failure ends the key's
    /// publishing; a fatal producer error also replaces the producer.
    async fn publish_ordered(
        &self,
        messages: &[Outgoing<'_>],
        deadline: Instant,
    ) -> Vec<Result<(), PublishError>> {
        let (generation, producer) = {
            let current = self.current();
            (current.generation, Arc::clone(&current.producer))
        };
        let mut results = Vec::with_capacity(messages.len());
        for run in runs(messages) {
            if !results.is_empty() && Instant::now() >= deadline {
                break;
            }
            self.publish_run(&producer, run, &mut results).await;
            if results.iter().any(Result::is_err) {
                break;
            }
        }
        if results.iter().any(Result::is_err)
            && let Some((code, reason)) = producer.client().fatal_error()
        {
            self.replace(generation, &format!("{code:?}: {reason}"));
        }
        results
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::mocking::MockCluster;

    use super::*;
    use crate::outbox::backend::OutboxRow;

    fn row(id: i64, topic: &str, key: Option<&str>) -> OutboxRow {
        OutboxRow {
            id,
            message_id: format!("m-{id}"),
            scope: "s".into(),
            causation: None,
            traceparent: None,
            kind: "kafka".into(),
            destination: topic.into(),
            routing_key: None,
            message_key: key.map(|k| k.as_bytes().to_vec()),
            headers: "[]".into(),
            payload: format!("p-{id}").into_bytes(),
            attempts: 0,
            order_key: "k".into(),
        }
    }

    #[test]
    fn runs_group_one_partitions_messages_and_split_keyless_ones() {
        let rows = [
            row(1, "t", Some("a")),
            row(2, "t", Some("a")),
            row(3, "t", Some("b")),
            row(4, "t", None),
            row(5, "t", None),
            row(6, "t", Some("b")),
        ];
        let out: Vec<Outgoing<'_>> = rows.iter().map(Outgoing::new).collect();
        let lengths: Vec<usize> = runs(&out).iter().map(|r| r.len()).collect();
        assert_eq!(lengths, [2, 1, 1, 1, 1]);
        assert!(runs(&[]).is_empty());
    }

    /// A request that fails for good is a fatal producer error (the
    /// gapless guarantee): the messages behind it fail too (none is
    /// reported delivered), and the publisher carries on with a new
    /// producer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fatal_error_fails_the_rest_and_replaces_the_producer() {
        let mock = MockCluster::new(1).expect("mock cluster");
        mock.create_topic("fatal", 1, 1).expect("topic");
        let publisher = KafkaPublisher::with_config(
            ClientConfig::new()
                .set("bootstrap.servers", mock.bootstrap_servers())
                .set("message.timeout.ms", "10000")
                // One produce request per run, so the injected error
                // fails the whole run (messages of a later request that
                // got through before the fatal error was raised would be
                // acknowledged: the relay leaves them pending behind the
                // failed head, see `relay.rs`).
                .set("linger.ms", "200"),
        )
        .expect("publisher");
        let rows: Vec<OutboxRow> = (0..20).map(|i| row(i, "fatal", Some("a"))).collect();
        let out: Vec<Outgoing<'_>> = rows.iter().map(Outgoing::new).collect();
        let far = Instant::now() + Duration::from_secs(60);
        let before = publisher.publish_ordered(&out[..5], far).await;
        assert!(before.iter().all(Result::is_ok), "{before:?}");

        // The next produce request fails permanently: with the gapless
        // guarantee, a fatal error.
        mock.request_errors(
            rdkafka::types::RDKafkaApiKey::Produce,
            &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_RECORD],
        );
        let during = publisher.publish_ordered(&out[5..15], far).await;
        assert!(
            during.iter().all(Result::is_err),
            "nothing after a fatal error is delivered: {during:?}"
        );
        assert_eq!(publisher.current().generation, 1, "replaced");
        let after = publisher.publish_ordered(&out[15..], far).await;
        assert_eq!(after.len(), 5);
        assert!(after.iter().all(Result::is_ok), "{after:?}");
    }
}
