//! Errors of the AMQP consumer.

use crate::engine::BuildError;

/// Why an [`AmqpConsumer`](super::AmqpConsumer) could not be built or
/// stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AmqpConsumerError {
    /// A required setting is missing or a setting is out of range.
    #[error("invalid AMQP consumer configuration: {0}")]
    Config(String),
    /// The engine settings (key spec, scope, retention) are invalid.
    #[error(transparent)]
    Engine(#[from] BuildError),
    /// The broker refused the topology (e.g. a queue exists with other
    /// arguments): retrying cannot help.
    #[error("the broker refused the topology: {0}")]
    Topology(lapin::Error),
    /// The dedup table does not exist: the consumer did not start (the
    /// message says how to create it).
    #[error("{0}")]
    MissingSchema(String),
    /// A client call failed.
    #[error("AMQP error: {0}")]
    Client(#[from] lapin::Error),
    /// The broker closed the connection or cancelled the consumer.
    #[error("AMQP connection lost: {0}")]
    ConnectionLost(String),
    /// A publish was not confirmed by the broker.
    #[error(
        "publish to exchange {exchange:?} with routing key {routing_key:?} not confirmed: {reason}"
    )]
    NotConfirmed {
        /// Target exchange (`""` is the default exchange).
        exchange: String,
        /// Routing key.
        routing_key: String,
        /// Nack, returned as unroutable, or the client error.
        reason: String,
    },
}
