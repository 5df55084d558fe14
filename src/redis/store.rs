//! Fenced claims in Redis alone, for effects outside any SQL transaction
//! (an SMS, an email, a third-party API call).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ::redis::aio::ConnectionManager;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::RedisError;
use super::keys::KeyLayout;
use super::scripts;
use crate::fingerprint::Fingerprint;
use crate::redact::KeyRedaction;

/// What to do when Redis is unreachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnRedisError {
    /// Return the error: nothing runs unclaimed (the default).
    #[default]
    FailClosed,
    /// Run the effect without a claim (logged at error level, counted): it
    /// may then run more than once.
    FailOpen,
}

/// A claim held by this caller: the proof needed to complete, renew or
/// release it. Another owner's token never matches (fencing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    key: String,
    owner: String,
}

impl Lease {
    /// The Redis key.
    pub fn redis_key(&self) -> &str {
        &self.key
    }

    /// The owner token (random per claim).
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

/// What a claim found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedisClaim {
    /// The caller owns the key until the lease runs out (renew it, then
    /// complete or release it).
    Claimed(Lease),
    /// The key was completed; here is its result.
    Done(Vec<u8>),
    /// The key was completed for another payload.
    Conflict,
    /// Another caller holds the key; its lease ends in `retry_after`.
    Busy {
        /// Remaining lease of the holder.
        retry_after: Duration,
    },
}

/// What [`RedisStore::run_once`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Once<T> {
    /// The effect ran now and its result was recorded.
    Ran(T),
    /// The effect had already run; its recorded result.
    AlreadyDone(T),
    /// Another caller is running it; try again after `retry_after`.
    Busy {
        /// Remaining lease of the holder.
        retry_after: Duration,
    },
    /// The key was used for another payload.
    Conflict,
    /// Redis was unreachable and the store fails open: the effect ran
    /// without a claim.
    RanUnclaimed(T),
}

/// Why [`RedisStore::run_once`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunOnceError<E> {
    /// The effect failed; its claim was released, so it may be retried.
    #[error("the effect failed: {0}")]
    Effect(E),
    /// Redis failed (and the store fails closed): the effect did not run.
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// The effect ran, but its result could not be recorded: the lease was
    /// lost (Redis lost the key, or renewals failed for longer than the
    /// lease) or Redis kept failing. Another caller may run it again. Its
    /// result is here.
    #[error("the effect ran but its result could not be recorded")]
    LeaseLost(Vec<u8>),
    /// The result could not be (de)serialized.
    #[error("result encoding: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Fenced, leased claims in Redis.
///
/// **Guarantee.** At most one caller at a time holds a key: `claim` is one
/// atomic `SET NX PX` with a random owner token. Completing, renewing and
/// releasing check the token first (fencing), so a caller whose lease ran
/// out cannot overwrite or release the next owner's claim. A completed key
/// keeps its result for the retention and is answered as done.
///
/// **Not guaranteed.** This is not atomic with the effect: if the process
/// dies after the effect but before `complete`, the lease expires and the
/// effect can run again; if the effect outlives its lease without renewal
/// (or Redis loses the key in a failover), two callers can run it. Redis
/// persistence and replication decide what survives a Redis crash. Use the
/// SQL stores when the effect is a database write.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    keys: KeyLayout,
    lease: Duration,
    retention: Duration,
    on_error: OnRedisError,
    unclaimed_runs: Arc<AtomicU64>,
    redaction: KeyRedaction,
}

impl RedisStore {
    /// Connects to `url` (e.g. `redis://127.0.0.1:6379`). The connection
    /// reconnects by itself. Lease 30 s, retention 7 days, prefix
    /// `onceonly:`, fail closed.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Ok(Self::new(super::connect(url).await?))
    }

    /// Uses an existing connection manager.
    pub fn new(conn: ConnectionManager) -> Self {
        Self {
            conn,
            keys: KeyLayout::new("onceonly:"),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(7 * 24 * 3600),
            on_error: OnRedisError::FailClosed,
            unclaimed_runs: Arc::new(AtomicU64::new(0)),
            redaction: KeyRedaction::plain(),
        }
    }

    /// Key prefix (default `onceonly:`).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.keys = KeyLayout::new(prefix);
        self
    }

    /// How long a claim lives without renewal (default 30 s).
    /// [`run_once`](Self::run_once) renews it every third of that.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(3));
        self
    }

    /// How long a completed key and its result are kept (default 7 days).
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention.max(Duration::from_millis(1));
        self
    }

    /// Fail closed (default) or open when Redis is unreachable.
    #[must_use]
    pub fn on_error(mut self, policy: OnRedisError) -> Self {
        self.on_error = policy;
        self
    }

    /// How keys are shown in this store's log lines (default: as they
    /// are). They run outside any delivery span, so they name the key
    /// themselves: give the same [`KeyRedaction`] as your engines for the
    /// same form everywhere.
    #[must_use]
    pub fn with_key_redaction(mut self, redaction: KeyRedaction) -> Self {
        self.redaction = redaction;
        self
    }

    /// Effects run without a claim because Redis was down (fail open).
    pub fn unclaimed_runs(&self) -> u64 {
        self.unclaimed_runs.load(Ordering::Relaxed)
    }

    /// Claims `key` in `scope` for one lease.
    pub async fn claim(
        &self,
        scope: &str,
        key: &str,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<RedisClaim, RedisError> {
        let redis_key = self.keys.key(scope, key);
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let fp = fingerprint.map(Fingerprint::to_hex).unwrap_or_default();
        let reply: Vec<Vec<u8>> = scripts::claim()
            .key(&redis_key)
            .arg(&owner)
            .arg(ms(self.lease))
            .arg(&fp)
            .invoke_async(&mut self.conn.clone())
            .await?;
        let corrupt = |detail: &str| RedisError::Corrupt {
            detail: detail.to_owned(),
        };
        match reply.first().map(Vec::as_slice) {
            Some(b"claimed") => Ok(RedisClaim::Claimed(Lease {
                key: redis_key,
                owner,
            })),
            Some(b"done") => Ok(RedisClaim::Done(reply.get(1).cloned().unwrap_or_default())),
            Some(b"conflict") => Ok(RedisClaim::Conflict),
            Some(b"busy") => {
                let pttl = reply
                    .get(1)
                    .and_then(|b| std::str::from_utf8(b).ok())
                    .and_then(|t| t.parse::<i64>().ok())
                    .ok_or_else(|| corrupt("busy without a TTL"))?;
                Ok(RedisClaim::Busy {
                    retry_after: Duration::from_millis(u64::try_from(pttl).unwrap_or(0)),
                })
            }
            _ => Err(corrupt("unexpected claim reply")),
        }
    }

    /// Records `result` and keeps it for the retention, if `lease` still
    /// holds the claim; `false` if it was lost (expired, or taken over).
    pub async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<bool, RedisError> {
        let done: i64 = scripts::complete()
            .key(&lease.key)
            .arg(&lease.owner)
            .arg(ms(self.retention))
            .arg(result)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(done == 1)
    }

    /// Extends the lease; `false` if it was lost.
    pub async fn renew(&self, lease: &Lease) -> Result<bool, RedisError> {
        let renewed: i64 = scripts::renew()
            .key(&lease.key)
            .arg(&lease.owner)
            .arg(ms(self.lease))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(renewed == 1)
    }

    /// Gives the key up (the effect failed and may be retried); `false` if
    /// the lease was already lost.
    pub async fn release(&self, lease: &Lease) -> Result<bool, RedisError> {
        let released: i64 = scripts::release()
            .key(&lease.key)
            .arg(&lease.owner)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(released == 1)
    }

    /// Runs `effect` unless `key` is done or held (within the limits of the
    /// type's guarantee: not atomic with the effect): claim, renew the lease
    /// every third of it while the effect runs, record the JSON result on
    /// success, release on failure so it can be retried.
    ///
    /// Dropping the returned future mid-effect leaves the claim until its
    /// lease runs out (the effect may have partly run).
    pub async fn run_once<T, E, F>(
        &self,
        scope: &str,
        key: &str,
        fingerprint: Option<&Fingerprint>,
        effect: F,
    ) -> Result<Once<T>, RunOnceError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: Future<Output = Result<T, E>>,
    {
        let lease = match self.claim(scope, key, fingerprint).await {
            Ok(RedisClaim::Claimed(lease)) => lease,
            Ok(RedisClaim::Done(bytes)) => {
                return Ok(Once::AlreadyDone(serde_json::from_slice(&bytes)?));
            }
            Ok(RedisClaim::Conflict) => return Ok(Once::Conflict),
            Ok(RedisClaim::Busy { retry_after }) => return Ok(Once::Busy { retry_after }),
            Err(e) if self.on_error == OnRedisError::FailOpen && e.is_infrastructure() => {
                self.unclaimed_runs.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, scope, key = %self.redaction.show(key), "Redis unavailable: FAILING OPEN, effect runs unclaimed");
                return effect
                    .await
                    .map(Once::RanUnclaimed)
                    .map_err(RunOnceError::Effect);
            }
            Err(e) => return Err(e.into()),
        };
        let renew_every = self.lease / 3;
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Renewals stop once the lease is known lost, or once renewals kept
        // failing until the lease must have run out.
        let mut renewing = true;
        let mut held_until = tokio::time::Instant::now() + self.lease;
        tokio::pin!(effect);
        let outcome = loop {
            tokio::select! {
                outcome = &mut effect => break outcome,
                _ = ticker.tick(), if renewing => match self.renew(&lease).await {
                    Ok(true) => held_until = tokio::time::Instant::now() + self.lease,
                    Ok(false) => {
                        renewing = false;
                        tracing::error!(key = %self.redaction.show(key), "lease lost while the effect runs; another caller may run it too");
                    }
                    Err(e) if tokio::time::Instant::now() < held_until => {
                        tracing::warn!(key = %self.redaction.show(key), error = %e, "lease renewal failed; retrying");
                    }
                    Err(e) => {
                        renewing = false;
                        tracing::error!(key = %self.redaction.show(key), error = %e, "lease renewals failed for a whole lease; the claim is presumed lost");
                    }
                },
            }
        };
        match outcome {
            Ok(value) => {
                let bytes = serde_json::to_vec(&value)?;
                // A transient error is retried a few times: giving up too
                // early would report a loss that did not happen.
                for attempt in 0..3u64 {
                    match self.complete(&lease, &bytes).await {
                        Ok(true) => return Ok(Once::Ran(value)),
                        Ok(false) => break,
                        Err(e) => {
                            tracing::warn!(key = %self.redaction.show(key), error = %e, attempt, "recording the result failed");
                            tokio::time::sleep(Duration::from_millis(100 * (attempt + 1))).await;
                        }
                    }
                }
                Err(RunOnceError::LeaseLost(bytes))
            }
            Err(e) => {
                if let Err(re) = self.release(&lease).await {
                    tracing::warn!(key = %self.redaction.show(key), error = %re, "release failed; the claim expires with its lease");
                }
                Err(RunOnceError::Effect(e))
            }
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
