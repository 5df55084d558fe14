//! Errors of the Kafka consumer.

use crate::engine::BuildError;

/// Why a [`KafkaConsumer`](super::KafkaConsumer) could not be built or stopped
/// with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaConsumerError {
    /// A required setting is missing or a setting is out of range.
    #[error("invalid Kafka consumer configuration: {0}")]
    Config(String),
    /// The engine settings (key spec, scope, retention) are invalid.
    #[error(transparent)]
    Engine(#[from] BuildError),
    /// librdkafka refused the configuration or a client call failed.
    #[error("Kafka client error: {0}")]
    Client(#[from] rdkafka::error::KafkaError),
    /// A dead letter was not acknowledged by the broker.
    #[error("publishing a dead letter to {topic} failed: {source}")]
    DeadLetter {
        /// The dead-letter topic.
        topic: String,
        /// The producer's error.
        source: rdkafka::error::KafkaError,
    },
    /// A copy for a non-blocking retry was not acknowledged by the broker.
    #[error("publishing a retry copy to {topic} failed: {source}")]
    RetryCopy {
        /// The retry topic.
        topic: String,
        /// The producer's error.
        source: rdkafka::error::KafkaError,
    },
    /// librdkafka reported a fatal error (e.g. a fenced static member).
    #[error("fatal Kafka client error: {0}")]
    Fatal(String),
    /// A partition worker panicked outside the handler (the handler's own
    /// panics are caught and dead-lettered); the consumer stopped.
    #[error("{0}")]
    Worker(String),
    /// The dedup table does not exist: the consumer did not start (the
    /// message says how to create it).
    #[error("{0}")]
    MissingSchema(String),
    /// The polling thread could not be started or died.
    #[error("the Kafka polling thread failed: {0}")]
    PollThread(String),
}
