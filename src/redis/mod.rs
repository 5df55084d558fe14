//! Redis tier (feature `redis`).
//!
//! - [`RedisStore`]: fenced, leased claims in Redis alone, for effects that
//!   are not database writes (send an SMS once, call a third-party API
//!   once). Read its guarantee: it is not atomic with the effect.
//! - [`CachedStore`]: Redis in front of a SQL store. Duplicates are answered
//!   from Redis without SQL; SQL stays the source of truth and Redis is
//!   written only after the SQL commit. Works wherever a SQL store does.
//!
//! Keys are `<prefix>{<scope>}:<key>`: the hash tag keeps a scope in one
//! Redis Cluster slot. Log lines and errors never show these Redis keys
//! (they hold the business key); [`RedisStore`]'s lines show the key as
//! its [`KeyRedaction`](crate::KeyRedaction) says.

mod cached;
mod error;
mod keys;
mod scripts;
mod store;

use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};

pub use cached::CachedStore;
pub use error::RedisError;
pub use store::{Lease, OnRedisError, Once, RedisClaim, RedisStore, RunOnceError};

/// Connects with short timeouts: an unreachable Redis must cost a lookup
/// half a second, not stall every delivery behind reconnect retries. The
/// manager reconnects in the background on the next command.
pub(crate) async fn connect(url: &str) -> Result<ConnectionManager, RedisError> {
    let client = ::redis::Client::open(url)?;
    Ok(ConnectionManager::new_with_config(client, config()).await?)
}

/// Like [`connect`], without waiting for the first connection.
pub(crate) fn connect_lazy(url: &str) -> Result<ConnectionManager, RedisError> {
    let client = ::redis::Client::open(url)?;
    Ok(ConnectionManager::new_lazy_with_config(client, config())?)
}

fn config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_millis(500)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_secs(1))
}
