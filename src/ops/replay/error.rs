//! Errors of a replay run.

/// Why a replay could not start or stopped early.
///
/// Dead letters that could not be republished are *not* errors of the run:
/// they stay in the dead-letter queue or topic and are listed in
/// [`ReplayReport::failures`](super::ReplayReport::failures).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A required setting is missing or a setting is out of range.
    #[error("invalid replay configuration: {0}")]
    Config(String),
    /// The dead-letter queue or topic does not exist.
    #[error("dead-letter source {0:?} not found")]
    SourceNotFound(String),
    /// An AMQP client call failed (connecting, reading the queue, acking).
    #[cfg(feature = "amqp")]
    #[error("AMQP error: {0}")]
    Amqp(#[from] lapin::Error),
    /// A Kafka client call failed (connecting, metadata, fetching, committing).
    #[cfg(feature = "kafka")]
    #[error("Kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// The connection or channel closed under the run.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The dedup table could not be read (screening letters).
    #[error("dedup table: {0}")]
    Store(#[from] crate::store::StoreError),
    /// A broker call did not answer in time.
    #[error("timed out: {0}")]
    Timeout(String),
}
