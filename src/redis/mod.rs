//! Redis tier (feature `redis`).
//!
//! - [`RedisStore`]: fenced, leased claims in Redis alone, for effects that
//!   are not database writes (send an SMS once, call a third-party API
//!   once). Read its guarantee: it is not atomic with the effect.
//! - [`CachedStore`]: Redis in front of a SQL store. Duplicates are answered
//!   from Redis without SQL; SQL stays the source of truth and Redis is
//!   written only after the SQL commit. Works wherever a SQL store does.
//!
//! Both take a [`RedisConnection`]: one server or a Redis Cluster
//! (`redis+cluster://host1:7000,host2:7000`, or
//! [`RedisConnection::builder`]`.cluster(nodes)`).
//!
//! Keys are `<prefix><scope>:<key>`, with no hash tag: on a Redis Cluster
//! the keys of one scope spread over every slot, and so over every master
//! (see [`RedisStore`] for the upgrade from the earlier
//! `<prefix>{<scope>}:<key>`). Log lines and errors never show these Redis
//! keys (they hold the business key); [`RedisStore`]'s lines show the key
//! as its [`KeyRedaction`](crate::KeyRedaction) says.

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
