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
mod dead_letter;
mod error;
mod message;
mod offsets;
mod partition;
mod protocol;
mod worker;

pub use crate::broker::ConsumerStats;
pub use builder::{DEFAULT_DRAIN_TIMEOUT, DEFAULT_STATISTICS_INTERVAL, KafkaConsumerBuilder};
pub use consumer::KafkaConsumer;
pub use dead_letter::headers;
pub use error::KafkaConsumerError;
pub use protocol::GroupProtocol;
pub use tokio_util::sync::CancellationToken;
