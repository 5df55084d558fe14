//! AMQP 0-9-1 transport (feature `amqp`): a RabbitMQ consumer whose messages
//! take effect exactly once, over [lapin](https://docs.rs/lapin). The guide
//! below covers running it, its settings, the queues it declares, its
//! outcomes, RPC replies, quorum queues, recovery and shutdown.
//!
#![doc = include_str!("../../docs/amqp.md")]

mod builder;
mod connect;
mod consumer;
mod error;
pub(crate) mod headers;
pub(crate) mod message;
pub(crate) mod pipeline;
pub(crate) mod publish;
mod stats;
mod topology;
mod worker;

pub use crate::broker::ConsumerStats;
pub use builder::AmqpConsumerBuilder;
pub use connect::AmqpTls;
pub(crate) use connect::connect;
pub use consumer::AmqpConsumer;
pub use error::AmqpConsumerError;
pub use stats::AmqpStats;
pub use tokio_util::sync::CancellationToken;
pub use topology::QueueKind;
