//! Fenced claims in Redis alone, for effects outside any SQL transaction
//! (an SMS, an email, a third-party API call).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::conn::RedisConnection;
use super::error::RedisError;
use super::keys::KeyLayout;
use super::scripts::{self, Replicas};
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
    fingerprint: String,
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
///
/// **Replication and failover.** Redis replicates asynchronously: a master
/// that dies right after answering a claim may take it along, and the
/// replica promoted in its place lets a second caller claim the same key.
/// [`with_replica_acks`](Self::with_replica_acks) closes that window: a
/// claim, renewal or completion is reported only once that many replicas
/// have it (`WAIT`), else it is an error
/// ([`RedisError::NotReplicated`]) and the caller does not hold the key.
///
/// **Redis Cluster.** Connect with `redis+cluster://h1:7000,h2:7000` or
/// [`RedisConnection::builder`]`.cluster(nodes)`. Keys are
/// `<prefix><scope>:<key>` with no hash tag, so one scope spreads over
/// every master; each script touches one key. The cluster client follows
/// `MOVED`/`ASK`, refreshes its slot map after a failover or a resharding,
/// and bounds each call (see [`RedisConnectionBuilder`](super::RedisConnectionBuilder)).
///
/// **Upgrading from the scope-tagged layout.** Keys used to be
/// `<prefix>{<scope>}:<key>`. This store neither reads nor writes those
/// keys unless told to, so after an upgrade: (1) do not run old and new
/// versions side by side (an old and a new process would claim one
/// business key under two Redis keys: stop the old ones, then start the
/// new); (2) keys completed before the upgrade are unknown to the new
/// layout, and a redelivery of one would run its effect again, so turn on
/// [`with_scope_tagged_fallback`](Self::with_scope_tagged_fallback) for one
/// retention period (then turn it off: the old keys have expired).
#[derive(Clone)]
pub struct RedisStore {
    conn: RedisConnection,
    keys: KeyLayout,
    replicas: Option<Replicas>,
    scope_tagged_fallback: bool,
    lease: Duration,
    retention: Duration,
    on_error: OnRedisError,
    unclaimed_runs: Arc<AtomicU64>,
    redaction: KeyRedaction,
}

impl RedisStore {
    /// Connects to `url`: one server (`redis://127.0.0.1:6379`) or a Redis
    /// Cluster (`redis+cluster://10.0.0.1:7000,10.0.0.2:7000`; see
    /// [`RedisConnection`]). The connection reconnects by itself. Lease
    /// 30 s, retention 7 days, prefix `onceonly:`, fail closed.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Ok(Self::new(RedisConnection::connect(url).await?))
    }

    /// Uses an existing connection: a [`RedisConnection`] (e.g. from
    /// [`RedisConnection::builder`]), a
    /// [`ConnectionManager`](::redis::aio::ConnectionManager) or a
    /// [`ClusterConnection`](::redis::cluster_async::ClusterConnection).
    pub fn new(conn: impl Into<RedisConnection>) -> Self {
        Self {
            conn: conn.into(),
            keys: KeyLayout::new("onceonly:"),
            replicas: None,
            scope_tagged_fallback: false,
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

    /// Reports a claim, renewal or completion only once `count` replicas
    /// acknowledged it (`WAIT count timeout`, on the master that took the
    /// write), so that a failover promoting one of them keeps it. A write
    /// fewer replicas acknowledged within `timeout` is an error
    /// ([`RedisError::NotReplicated`]; a claim is then released, best
    /// effort). Off by default (a server without replicas would never
    /// acknowledge); with one replica per master, `1` and a timeout of a
    /// few hundred milliseconds. The wait is cut to 4/5 of the connection's
    /// response timeout (500 ms by default) when this crate built the
    /// connection, since the reply must come before that timeout (a claim
    /// that timed out is held by nobody who knows it, until its lease
    /// ends); give your own connection a response timeout above `timeout`.
    /// `count` 0 turns it off.
    #[must_use]
    pub fn with_replica_acks(mut self, count: u32, timeout: Duration) -> Self {
        self.replicas = (count > 0).then_some(Replicas {
            count,
            timeout: timeout.max(Duration::from_millis(1)),
        });
        self
    }

    /// Also reads each key under the earlier layout
    /// (`<prefix>{<scope>}:<key>`) before claiming it: a key completed there
    /// is answered as done (or a conflict), a claim held there as busy.
    /// For one retention period after upgrading from that layout; it costs
    /// one more Redis call per claim (off by default). It is read-only:
    /// old keys expire by themselves.
    #[must_use]
    pub fn with_scope_tagged_fallback(mut self, on: bool) -> Self {
        self.scope_tagged_fallback = on;
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
        let fp = fingerprint.map(Fingerprint::to_hex).unwrap_or_default();
        if self.scope_tagged_fallback
            && let Some(found) = self.scope_tagged(scope, key, &fp).await?
        {
            return Ok(found);
        }
        let redis_key = self.keys.key(scope, key);
        let owner = uuid::Uuid::new_v4().simple().to_string();
        let (reply, acked): (Vec<Vec<u8>>, _) = scripts::claim()
            .run(
                &self.conn,
                &redis_key,
                &[&owner, &ms(self.lease), &fp],
                self.replicas,
            )
            .await?;
        let claim = match reply.first().map(Vec::as_slice) {
            Some(b"claimed") => RedisClaim::Claimed(Lease {
                key: redis_key,
                owner,
                fingerprint: fp,
            }),
            Some(b"done") => RedisClaim::Done(reply.get(1).cloned().unwrap_or_default()),
            Some(b"conflict") => RedisClaim::Conflict,
            Some(b"busy") => busy(reply.get(1))?,
            _ => return Err(corrupt("unexpected claim reply")),
        };
        if let RedisClaim::Claimed(lease) = &claim
            && let Err(e) = self.replicated(acked)
        {
            // Not held for sure: give it up rather than leave it blocking
            // the key for a lease.
            if let Err(re) = self.release(lease).await {
                tracing::warn!(error = %re, key = %self.redaction.show(key), "releasing an unreplicated claim failed; it expires with its lease");
            }
            return Err(e);
        }
        Ok(claim)
    }

    /// The state of `key` under the scope-tagged layout, if it is there.
    async fn scope_tagged(
        &self,
        scope: &str,
        key: &str,
        fp: &str,
    ) -> Result<Option<RedisClaim>, RedisError> {
        let old_key = self.keys.scope_tagged_key(scope, key);
        let (reply, _): (Vec<Vec<u8>>, _) =
            scripts::peek().run(&self.conn, &old_key, &[], None).await?;
        let Some(value) = reply.first() else {
            return Ok(None);
        };
        if let Some(rest) = value.strip_prefix(b"d\n") {
            let nl = rest
                .iter()
                .position(|&b| b == b'\n')
                .ok_or_else(|| corrupt("completed key without a result"))?;
            let stored = &rest[..nl];
            if !stored.is_empty() && !fp.is_empty() && stored != fp.as_bytes() {
                return Ok(Some(RedisClaim::Conflict));
            }
            return Ok(Some(RedisClaim::Done(rest[nl + 1..].to_vec())));
        }
        if value.starts_with(b"c\n") {
            return busy(reply.get(1)).map(Some);
        }
        Err(corrupt("unexpected value under the scope-tagged key"))
    }

    fn replicated(&self, acked: Option<i64>) -> Result<(), RedisError> {
        match (self.replicas, acked) {
            (Some(wanted), Some(acked)) if acked < i64::from(wanted.count) => {
                Err(RedisError::NotReplicated {
                    acked: u32::try_from(acked).unwrap_or(0),
                    wanted: wanted.count,
                })
            }
            _ => Ok(()),
        }
    }

    /// Records `result` and keeps it for the retention, if `lease` still
    /// holds the claim; `false` if it was lost (expired, or taken over).
    pub async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<bool, RedisError> {
        let (done, acked): (i64, _) = scripts::complete()
            .run(
                &self.conn,
                &lease.key,
                &[
                    &lease.owner,
                    &ms(self.retention),
                    &result,
                    &lease.fingerprint,
                ],
                self.replicas,
            )
            .await?;
        if done == 1 {
            self.replicated(acked)?;
        }
        Ok(done == 1)
    }

    /// Extends the lease; `false` if it was lost.
    pub async fn renew(&self, lease: &Lease) -> Result<bool, RedisError> {
        let (renewed, acked): (i64, _) = scripts::renew()
            .run(
                &self.conn,
                &lease.key,
                &[&lease.owner, &ms(self.lease)],
                self.replicas,
            )
            .await?;
        if renewed == 1 {
            self.replicated(acked)?;
        }
        Ok(renewed == 1)
    }

    /// Gives the key up (the effect failed and may be retried); `false` if
    /// the lease was already lost.
    pub async fn release(&self, lease: &Lease) -> Result<bool, RedisError> {
        let (released, _): (i64, _) = scripts::release()
            .run(&self.conn, &lease.key, &[&lease.owner], None)
            .await?;
        Ok(released == 1)
    }

    /// Runs `effect` unless `key` is done or held (within the limits of the
    /// type's guarantee: not atomic with the effect): claim, renew the lease
    /// every third of it while the effect runs, record the JSON result on
    /// success (retrying a failing Redis until the lease would have ended,
    /// at least three times), release on failure so it can be retried.
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
                // A transient error (a failover, a restart) is retried while
                // the lease surely lasts, at least three times: giving up
                // earlier would report a loss that did not happen. The
                // completion is idempotent, so a retry of one that did go
                // through still answers true.
                let mut attempt = 0u64;
                loop {
                    match self.complete(&lease, &bytes).await {
                        Ok(true) => return Ok(Once::Ran(value)),
                        Ok(false) => break,
                        Err(e) => {
                            attempt += 1;
                            tracing::warn!(key = %self.redaction.show(key), error = %e, attempt, "recording the result failed");
                            if attempt >= 3 && tokio::time::Instant::now() >= held_until {
                                break;
                            }
                            let pause = Duration::from_millis(100 * attempt.min(5));
                            tokio::time::sleep(pause).await;
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

fn corrupt(detail: &str) -> RedisError {
    RedisError::Corrupt {
        detail: detail.to_owned(),
    }
}

/// `Busy` with the holder's remaining lease (a PTTL in decimal).
fn busy(pttl: Option<&Vec<u8>>) -> Result<RedisClaim, RedisError> {
    let pttl = pttl
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|t| t.parse::<i64>().ok())
        .ok_or_else(|| corrupt("busy without a TTL"))?;
    Ok(RedisClaim::Busy {
        retry_after: Duration::from_millis(u64::try_from(pttl).unwrap_or(0)),
    })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
