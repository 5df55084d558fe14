//! Kafka transport (feature `kafka`): a consumer-group member whose records
//! take effect exactly once, over rdkafka's vendored librdkafka. The
//! guide below covers running it, its settings, its failures, rebalances
//! and shutdown.
//!
#![doc = include_str!("../../docs/kafka.md")]

mod batch_mark;
mod builder;
mod consumer;
mod context;
pub(crate) mod dead_letter;
mod error;
mod message;
mod offsets;
mod partition;
mod protocol;
mod worker;

pub use crate::broker::ConsumerStats;
pub use builder::KafkaConsumerBuilder;
pub use consumer::KafkaConsumer;
pub use error::KafkaConsumerError;
pub use protocol::GroupProtocol;
pub use tokio_util::sync::CancellationToken;
