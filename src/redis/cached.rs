//! Two tiers: Redis in front of a SQL store. SQL stays the source of truth;
//! Redis only remembers keys whose transaction committed, so duplicates are
//! answered without touching SQL.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::redis::AsyncCommands;
use async_trait::async_trait;

use crate::store::admin::AdminStore;

use super::conn::RedisConnection;
use super::error::RedisError;
use super::keys::KeyLayout;
use crate::fingerprint::Fingerprint;
use crate::store::raw::CachedRecord;
use crate::store::{CacheTier, Completed, SqlStore};
use crate::sync::lock;

/// Counters of a [`CachedStore`].
#[derive(Default, Debug)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    /// Until when Redis is skipped after a failure, so an outage costs one
    /// timeout per second, not one per delivery.
    skip_until: Mutex<Option<Instant>>,
}

/// How long Redis is skipped after a failure.
const BACKOFF: Duration = Duration::from_secs(1);
/// The longest a Redis call may take before it counts as failed (the
/// connection manager's own timeouts do not bound a reconnect).
const OP_TIMEOUT: Duration = Duration::from_millis(500);

/// A [`SqlStore`] with a Redis tier in front: use it wherever a SQL store
/// goes (engine, Kafka, AMQP, HTTP).
///
/// - A key found in Redis is answered as a duplicate (or a conflict, if its
///   fingerprint differs) before any SQL runs.
/// - A miss goes to SQL, which decides as always.
/// - After a SQL transaction that completed a key commits, the key and its
///   result are written to Redis, best effort, with the record's expiry.
///   Redis is never written before the commit, so it never knows a key SQL
///   does not.
/// - Redis down: every lookup falls through to SQL (logged, counted in
///   [`errors`](Self::errors)); exactly-once still holds, through SQL.
///
/// On a Redis Cluster (`redis+cluster://`) keys spread over every master
/// (`<prefix><scope>:<key>`, no hash tag). Upgrading from the earlier
/// scope-tagged layout (`<prefix>{<scope>}:<key>`) needs nothing: the new
/// keys start empty, so duplicates are answered by SQL until Redis learns
/// them again, and the old keys expire with their records. Old and new
/// versions can run side by side during a rolling upgrade: each misses the
/// other's keys and asks SQL, which decides as always.
///
/// Its log lines name no key: they are emitted inside the delivery's
/// `onceonly.delivery` span, whose `key` field shows it as the engine's
/// [`KeyRedaction`](crate::KeyRedaction) says.
#[derive(Clone)]
pub struct CachedStore<S> {
    sql: S,
    conn: RedisConnection,
    keys: KeyLayout,
    counters: Arc<Counters>,
}

impl<S: SqlStore> CachedStore<S> {
    /// Puts Redis at `url` in front of `sql`: one server
    /// (`redis://127.0.0.1:6379`) or a Redis Cluster
    /// (`redis+cluster://10.0.0.1:7000,10.0.0.2:7000`; see
    /// [`RedisConnection`]). Connects lazily: a Redis that is down at
    /// startup only means lookups go to SQL until it is up.
    pub fn connect(sql: S, url: &str) -> Result<Self, RedisError> {
        Ok(Self::new(
            sql,
            RedisConnection::builder().url(url).connect_lazy()?,
        ))
    }

    /// Uses an existing connection: a [`RedisConnection`] (e.g. from
    /// [`RedisConnection::builder`]`.cluster(nodes).connect_lazy()`), a
    /// [`ConnectionManager`](::redis::aio::ConnectionManager) or a
    /// [`ClusterConnection`](::redis::cluster_async::ClusterConnection).
    /// Keys go under
    /// `onceonly:sql:<table>:`: stores of different tables sharing one
    /// Redis never answer for each other. Two databases with the same table
    /// name (staging and production) need different prefixes, and a Redis
    /// tier must be flushed when its database is restored from a backup.
    pub fn new(sql: S, conn: impl Into<RedisConnection>) -> Self {
        let keys = KeyLayout::new(format!("onceonly:sql:{}:", sql.table()));
        Self {
            sql,
            conn: conn.into(),
            keys,
            counters: Arc::default(),
        }
    }

    /// Key prefix (default `onceonly:sql:<table>:`).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.keys = KeyLayout::new(prefix);
        self
    }

    /// The SQL store behind.
    pub fn sql(&self) -> &S {
        &self.sql
    }

    /// Lookups answered by Redis.
    pub fn hits(&self) -> u64 {
        self.counters.hits.load(Ordering::Relaxed)
    }

    /// Lookups Redis did not know (SQL answered).
    pub fn misses(&self) -> u64 {
        self.counters.misses.load(Ordering::Relaxed)
    }

    /// Redis failures (lookups fell through to SQL, writes were skipped).
    /// After a failure Redis is left alone for a second: lookups go straight
    /// to SQL and writes are skipped (not counted again).
    pub fn errors(&self) -> u64 {
        self.counters.errors.load(Ordering::Relaxed)
    }

    fn redis_skipped(&self) -> bool {
        let until = *lock(&self.counters.skip_until);
        until.is_some_and(|t| Instant::now() < t)
    }

    fn failed(&self) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.counters.skip_until) = Some(Instant::now() + BACKOFF);
    }

    async fn lookup(&self, scope: &str, key: &str) -> Result<Option<Vec<u8>>, RedisError> {
        let redis_key = self.keys.key(scope, key);
        let mut conn = self.conn.clone();
        let get = conn.get::<_, Option<Vec<u8>>>(&redis_key);
        match tokio::time::timeout(OP_TIMEOUT, get).await {
            Ok(value) => value.map_err(|e| self.classify(e)),
            Err(_) => Err(timed_out()),
        }
    }

    /// A cluster redirection on a single-server connection says so.
    fn classify(&self, e: ::redis::RedisError) -> RedisError {
        let e = RedisError::from(e);
        if self.conn.is_cluster() {
            e
        } else {
            e.on_single_server()
        }
    }
}

fn timed_out() -> RedisError {
    RedisError::Redis(::redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "Redis call timed out",
    )))
}

/// `d\n<fingerprint hex>\n<result>`, the layout the standalone store uses
/// for completed keys.
fn encode(fingerprint: Option<&Fingerprint>, result: &[u8]) -> Vec<u8> {
    let fp = fingerprint.map(Fingerprint::to_hex).unwrap_or_default();
    let mut v = Vec::with_capacity(3 + fp.len() + result.len());
    v.extend_from_slice(b"d\n");
    v.extend_from_slice(fp.as_bytes());
    v.push(b'\n');
    v.extend_from_slice(result);
    v
}

fn decode(value: &[u8]) -> Option<CachedRecord> {
    let rest = value.strip_prefix(b"d\n")?;
    let nl = rest.iter().position(|&b| b == b'\n')?;
    let fp = &rest[..nl];
    let fingerprint = if fp.is_empty() {
        None
    } else {
        Some(Fingerprint::from_slice(&hex::decode(fp).ok()?)?)
    };
    Some(CachedRecord {
        fingerprint,
        result: Some(rest[nl + 1..].to_vec()),
    })
}

crate::store::forward::forward_sql_store!(
    impl[S: SqlStore] for CachedStore<S> => sql,
    Db = S::Db,
    fn tier(&self) -> Option<&dyn CacheTier> {
        Some(self)
    },
    async fn open_claim(
        &self,
        scope: &str,
        times: crate::store::ClaimTimes,
        req: &crate::store::ClaimRequest<'_>,
    ) -> Result<Result<crate::store::ClaimTx<S::Db>, crate::store::Claim>, crate::store::StoreError> {
        self.sql.open_claim(scope, times, req).await
    },
    async fn finish_claim(
        &self,
        tx: crate::store::ClaimTx<S::Db>,
        scope: &str,
        key: &str,
        result: &[u8],
        clear_attempts: bool,
    ) -> Result<(), crate::store::StoreError> {
        self.sql.finish_claim(tx, scope, key, result, clear_attempts).await
    },
);

crate::store::forward::forward_admin_store!(
    /// Operations queries go to SQL. A purge by age deletes SQL records only:
    /// keys Redis still caches keep answering as duplicates until their expiry,
    /// which errs on the safe side.
    impl[S: AdminStore] for CachedStore<S> => sql
);

/// The Redis side of the tier: a hit answers without SQL, a committed key
/// is written after its commit.
#[async_trait]
impl<S: SqlStore> CacheTier for CachedStore<S> {
    async fn cached(&self, scope: &str, key: &str) -> Option<CachedRecord> {
        if self.redis_skipped() {
            return None;
        }
        match self.lookup(scope, key).await {
            Ok(Some(value)) => match decode(&value) {
                Some(hit) => {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    Some(hit)
                }
                None => {
                    // Not ours (a shared prefix?): a miss, SQL decides.
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(scope, "unexpected value in the Redis tier; asking SQL");
                    None
                }
            },
            Ok(None) => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(e) => {
                self.failed();
                tracing::warn!(error = %e, scope, "Redis lookup failed; asking SQL (Redis skipped for 1 s)");
                None
            }
        }
    }

    async fn committed(&self, done: &Completed<'_>) {
        if self.redis_skipped() {
            return;
        }
        let redis_key = self.keys.key(done.scope, done.key);
        let value = encode(done.fingerprint, done.result);
        // Relative to the engine's clock, like the SQL expiry: no reliance
        // on Redis's clock agreeing with ours.
        let ttl_ms = u64::try_from(done.expires_at_ms.saturating_sub(done.now_ms))
            .unwrap_or(0)
            .max(1);
        let mut conn = self.conn.clone();
        let mut cmd = ::redis::cmd("SET");
        cmd.arg(&redis_key).arg(value).arg("PX").arg(ttl_ms);
        let set = cmd.query_async::<()>(&mut conn);
        let written = match tokio::time::timeout(OP_TIMEOUT, set).await {
            Ok(result) => result.map_err(|e| self.classify(e)),
            Err(_) => Err(timed_out()),
        };
        if let Err(e) = written {
            self.failed();
            tracing::warn!(error = %e, scope = done.scope, "Redis write after commit failed; SQL still has the record");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_records_round_trip() {
        let fp = Fingerprint([7; 32]);
        let v = encode(Some(&fp), b"{\"ok\":1}\n\0");
        let back = decode(&v).unwrap();
        assert_eq!(back.fingerprint, Some(fp));
        assert_eq!(back.result.as_deref(), Some(&b"{\"ok\":1}\n\0"[..]));
        assert_eq!(decode(&encode(None, b"")).unwrap().fingerprint, None);
        assert!(decode(b"c\nowner\n").is_none());
    }
}
