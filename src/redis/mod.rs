//! Redis tier (feature `redis`): a cache in front of any SQL store
//! ([`CachedStore`]), and fenced, leased claims for effects outside any SQL
//! transaction ([`RedisStore`]), on one server or a Redis Cluster.
//!
#![doc = include_str!("../../docs/redis.md")]

mod cached;
mod conn;
mod error;
mod keys;
mod scripts;
mod store;

pub use cached::CachedStore;
pub use conn::{RedisConnection, RedisConnectionBuilder};
pub use error::RedisError;
pub use store::{Lease, OnRedisError, Once, RedisClaim, RedisStore, RunOnceError};
