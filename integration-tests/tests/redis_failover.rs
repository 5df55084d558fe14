//! A master of a real Redis Cluster SIGKILLed mid-stream (3 masters, 3
//! replicas on loopback; `onceonly_integration_tests::redis_cluster`): its
//! replica is promoted, the dead node comes back as a replica, and
//! meanwhile
//!
//! - fenced claims (`RedisStore` with one replica acknowledgement) stay
//!   fenced: no two callers hold one key at once, neither the leases taken
//!   before the kill nor those of a stream of duplicate claims running
//!   through it, and every key ends completed;
//! - the two-tier store over PostgreSQL stays exact: SQL is the truth, the
//!   ledger has every key once, no duplicate effect, no lost message.
//!
//! In its own test binary: nothing else runs while the cluster fails over.

use onceonly_integration_tests::demo::ledger;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use onceonly::redis::{CachedStore, Once, RedisClaim, RedisStore, RunOnceError};
use onceonly::{Delivery, Engine, SqlStore};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{assert_exact, crash_stream};
use onceonly_integration_tests::redis_cluster::RedisCluster;
use onceonly_integration_tests::unique;

/// Keys of the fenced stream, each run by two workers at once.
const STREAM_KEYS: usize = 2400;
/// Leases taken before the kill and held through it.
const HELD_KEYS: usize = 300;
/// Lease of the stream's claims: longer than a failover, so a completion
/// that fails while the cluster elects a master is retried until it
/// succeeds rather than reported lost.
const LEASE: Duration = Duration::from_secs(6);

#[derive(Default)]
struct Counts {
    ran: AtomicU64,
    already_done: AtomicU64,
    busy: AtomicU64,
    redis_errors: AtomicU64,
    not_replicated: AtomicU64,
    lease_lost: AtomicU64,
    progress: AtomicUsize,
    /// Redis errors by kind (their text up to the first `:`).
    error_kinds: Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Who holds each key right now, as the holders themselves see it: a token
/// and the time until which its lease surely lasts.
#[derive(Default)]
struct Holders {
    current: Mutex<HashMap<String, (u64, Instant)>>,
    effects: Mutex<HashMap<String, u32>>,
    lost: Mutex<HashMap<String, u32>>,
    overlaps: Mutex<Vec<String>>,
}

impl Holders {
    /// The effect of a holder of `key` whose claim was sent at `sent`:
    /// there must be no other live holder. Its lease lasts at least until
    /// `sent + LEASE` (Redis took the claim after `sent`).
    fn enter(&self, key: &str, token: u64, sent: Instant) {
        let now = Instant::now();
        let mut current = self.current.lock().unwrap();
        if let Some((other, until)) = current.get(key)
            && *other != token
            && *until > now
        {
            self.overlaps.lock().unwrap().push(key.to_owned());
        }
        current.insert(key.to_owned(), (token, sent + LEASE));
        *self
            .effects
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default() += 1;
    }

    fn leave(&self, key: &str, token: u64) {
        let mut current = self.current.lock().unwrap();
        if current.get(key).is_some_and(|(t, _)| *t == token) {
            current.remove(key);
        }
    }
}

async fn fenced_worker(
    store: RedisStore,
    worker: usize,
    holders: Arc<Holders>,
    counts: Arc<Counts>,
) {
    static TOKENS: AtomicU64 = AtomicU64::new(1);
    for i in (worker % 2..STREAM_KEYS).step_by(2) {
        let key = format!("fx-{i:05}");
        loop {
            let token = TOKENS.fetch_add(1, Ordering::Relaxed);
            let sent = Instant::now();
            let effect = {
                let holders = Arc::clone(&holders);
                let key = key.clone();
                async move {
                    holders.enter(&key, token, sent);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok::<_, std::convert::Infallible>(token)
                }
            };
            let outcome = store.run_once("sms", &key, None, effect).await;
            holders.leave(&key, token);
            match outcome {
                Ok(Once::Ran(_)) => {
                    counts.ran.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Ok(Once::AlreadyDone(_)) => {
                    counts.already_done.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Ok(Once::Busy { retry_after }) => {
                    counts.busy.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(
                        retry_after.clamp(Duration::from_millis(5), Duration::from_millis(100)),
                    )
                    .await;
                }
                Err(RunOnceError::Redis(e)) => {
                    assert!(e.is_infrastructure(), "{key}: {e}");
                    if matches!(e, onceonly::redis::RedisError::NotReplicated { .. }) {
                        counts.not_replicated.fetch_add(1, Ordering::Relaxed);
                    } else {
                        counts.redis_errors.fetch_add(1, Ordering::Relaxed);
                        let text = e.to_string();
                        let kind = text.trim_start_matches("Redis error: ");
                        let kind = kind.split([':', '(']).next().unwrap_or_default().trim();
                        *counts
                            .error_kinds
                            .lock()
                            .unwrap()
                            .entry(kind.to_owned())
                            .or_default() += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(RunOnceError::LeaseLost(_)) => {
                    counts.lease_lost.fetch_add(1, Ordering::Relaxed);
                    *holders.lost.lock().unwrap().entry(key.clone()).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(other) => panic!("{key}: {other:?}"),
                Err(e) => panic!("{key}: {e}"),
            }
        }
        counts.progress.fetch_add(1, Ordering::Relaxed);
    }
}

/// Claims every key of `keys` once with `store`, retrying infrastructure
/// errors for up to 20 s per key.
async fn claim_all(store: &RedisStore, keys: &[String]) -> Vec<RedisClaim> {
    let mut out = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(100) {
        let claims = chunk.iter().map(|key| async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match store.claim("sms", key, None).await {
                    Ok(c) => return c,
                    Err(e) if e.is_infrastructure() && Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => panic!("{key}: {e}"),
                }
            }
        });
        out.extend(futures_util::future::join_all(claims).await);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_failover_mid_stream_keeps_claims_fenced_and_sql_exact() {
    let cluster = Arc::new(RedisCluster::start());
    let prefix = format!("{}:", unique("failover"));
    let connect = |lease: Duration| {
        let url = cluster.url();
        let prefix = prefix.clone();
        async move {
            RedisStore::connect(&url)
                .await
                .expect("connect to the cluster")
                .with_prefix(prefix)
                .with_lease(lease)
                .with_replica_acks(1, Duration::from_millis(200))
        }
    };

    // Leases taken before the kill, held through it (60 s).
    let holder = connect(Duration::from_secs(60)).await;
    // A claim whose reply was lost (a timeout) is held by nobody who knows
    // it: only the leases this caller got are checked.
    let wanted: Vec<String> = (0..HELD_KEYS).map(|i| format!("held-{i:04}")).collect();
    let held: Vec<String> = wanted
        .iter()
        .zip(claim_all(&holder, &wanted).await)
        .filter(|(_, c)| matches!(c, RedisClaim::Claimed(_)))
        .map(|(k, _)| k.clone())
        .collect();
    assert!(
        held.len() * 10 >= HELD_KEYS * 9,
        "only {} of {HELD_KEYS} leases taken before the kill",
        held.len()
    );

    // The two-tier store over PostgreSQL, on the same cluster.
    let url = pg_schema("rfailover").await;
    let sql = onceonly_integration_tests::pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(sql.pool()).await.unwrap();
    let tier_prefix = format!("{}:", unique("tier"));
    let cached = CachedStore::connect(sql, &cluster.url())
        .expect("cluster URL")
        .with_prefix(&tier_prefix);
    let engine = Engine::builder(cached.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .build()
        .unwrap();
    // A third before the kill, a third while the cluster fails over, a
    // third once the old master is back as a replica.
    let stream = Arc::new(crash_stream("F", 1500));
    let tier_done = Arc::new(AtomicUsize::new(0));
    let (phase_tx, mut phase_rx) = tokio::sync::watch::channel(0u8);
    let tier = {
        let (stream, done) = (Arc::clone(&stream), Arc::clone(&tier_done));
        tokio::spawn(async move {
            let third = stream.messages.len() / 3;
            for (i, (_, body)) in stream.messages.iter().enumerate() {
                if i == third || i == 2 * third {
                    let want = if i == third { 1 } else { 2 };
                    phase_rx.wait_for(|p| *p >= want).await.unwrap();
                }
                let report = engine
                    .process(&ledger::postgres::Ledger, &Delivery::new(body.clone()))
                    .await;
                assert!(
                    report.outcome.is_done(),
                    "message {i}: {:?}",
                    report.outcome
                );
                done.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    // The fenced stream: four workers, two on each key.
    let holders = Arc::new(Holders::default());
    let counts = Arc::new(Counts::default());
    let stream_store = connect(LEASE).await;
    let workers: Vec<_> = (0..4)
        .map(|w| {
            tokio::spawn(fenced_worker(
                stream_store.clone(),
                w,
                Arc::clone(&holders),
                Arc::clone(&counts),
            ))
        })
        .collect();

    // A third of the way through, SIGKILL a master.
    while counts.progress.load(Ordering::Relaxed) < STREAM_KEYS * 2 / 3
        && !workers.iter().all(|w| w.is_finished())
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = cluster.nodes_info();
    let victim = cluster.masters()[0];
    let victim_id = cluster.id_of(victim);
    let promoted = before
        .iter()
        .find(|n| n.master_id.as_deref() == Some(victim_id.as_str()))
        .map(|n| n.port)
        .expect("the victim has a replica");
    let at_kill = (
        counts.progress.load(Ordering::Relaxed) / 2,
        tier_done.load(Ordering::Relaxed),
    );
    let c = Arc::clone(&cluster);
    let phases = phase_tx.clone();
    let (failover, resync) = tokio::task::spawn_blocking(move || {
        c.kill(victim);
        phases.send_replace(1);
        let failover = c.wait_failover(&victim_id, Duration::from_secs(30));
        // The dead master comes back as the replica of its successor, so
        // that claims there can be acknowledged by a replica again.
        c.restart(victim);
        let resync = c.wait_in_sync(victim, Duration::from_secs(30));
        (failover, resync)
    })
    .await
    .unwrap();
    let at_failover = (
        counts.progress.load(Ordering::Relaxed) / 2,
        tier_done.load(Ordering::Relaxed),
    );
    let (hits_before_recovery, errors_before_recovery) = (cached.hits(), cached.errors());
    phase_tx.send_replace(2);

    for w in workers {
        w.await.unwrap();
    }
    tier.await.unwrap();

    // Fenced claims stayed fenced.
    let overlaps = holders.overlaps.lock().unwrap().clone();
    let checker = connect(LEASE).await;
    let held_after = claim_all(&checker, &held).await;
    let stolen: Vec<_> = held
        .iter()
        .zip(&held_after)
        .filter(|(_, c)| !matches!(c, RedisClaim::Busy { .. }))
        .map(|(k, c)| format!("{k}: {c:?}"))
        .collect();
    let stream_keys: Vec<String> = (0..STREAM_KEYS).map(|i| format!("fx-{i:05}")).collect();
    let not_done: Vec<_> = stream_keys
        .iter()
        .zip(claim_all(&checker, &stream_keys).await)
        .filter(|(_, c)| !matches!(c, RedisClaim::Done(_)))
        .map(|(k, c)| format!("{k}: {c:?}"))
        .take(5)
        .collect();
    let effects = holders.effects.lock().unwrap().clone();
    let lost = holders.lost.lock().unwrap().clone();
    let rerun: Vec<_> = effects
        .iter()
        .filter(|(k, n)| **n > 1 + lost.get(*k).copied().unwrap_or(0))
        .map(|(k, n)| format!("{k}: {n} effects"))
        .take(5)
        .collect();
    let rerun_after_lost: u32 = effects.values().map(|n| n.saturating_sub(1)).sum();
    let held_on_victim_slots = cluster.keys_on(promoted, &format!("{prefix}sms:held-"));
    let per_master: Vec<(u16, usize)> = cluster
        .masters()
        .iter()
        .map(|&p| (p, cluster.keys_on(p, &prefix)))
        .collect();

    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    eprintln!(
        "failover: master 127.0.0.1:{victim} SIGKILLed after {} of {STREAM_KEYS} fenced keys and \
         {} of {} two-tier messages; replica 127.0.0.1:{promoted} promoted and cluster_state:ok \
         {failover:?} later; the old master back in sync as a replica {resync:?} after that (by \
         then {} fenced keys and {} messages done)",
        at_kill.0,
        at_kill.1,
        stream.messages.len(),
        at_failover.0,
        at_failover.1,
    );
    eprintln!(
        "fenced stream: {STREAM_KEYS} keys x 2 workers: {} claims ran the effect, {} duplicates \
         answered done, {} busy answers, retries during the failover: {} Redis errors + {} \
         claims/completions not acknowledged by a replica; {} completions unconfirmed (LeaseLost returned), \
         {} effects re-run after one; overlapping holders: {}; Redis errors by kind: {:?}",
        c(&counts.ran),
        c(&counts.already_done),
        c(&counts.busy),
        c(&counts.redis_errors),
        c(&counts.not_replicated),
        c(&counts.lease_lost),
        rerun_after_lost,
        overlaps.len(),
        counts.error_kinds.lock().unwrap()
    );
    eprintln!(
        "held leases: {} of {HELD_KEYS} taken before the kill ({held_on_victim_slots} keys on the \
         killed master's slots), {} still busy for a new caller after the failover",
        held.len(),
        held_after
            .iter()
            .filter(|c| matches!(c, RedisClaim::Busy { .. }))
            .count()
    );
    eprintln!("keys per master (port, keys): {per_master:?}");
    eprintln!(
        "two-tier: {} messages, {} distinct keys, {} duplicates; Redis hits {} ({} before the old \
         master was back), misses {}, errors {} ({} before; each one fell through to SQL)",
        stream.messages.len(),
        stream.expected.len(),
        stream.duplicates(),
        cached.hits(),
        hits_before_recovery,
        cached.misses(),
        cached.errors(),
        errors_before_recovery
    );

    assert!(
        overlaps.is_empty(),
        "two holders of one key at once: {overlaps:?}"
    );
    assert!(
        stolen.is_empty(),
        "held leases lost in the failover: {stolen:?}"
    );
    assert!(
        held_on_victim_slots > 0,
        "no held lease was on the killed master: the failover tested nothing"
    );
    assert!(
        not_done.is_empty(),
        "fenced keys not completed: {not_done:?}"
    );
    assert!(
        rerun.is_empty(),
        "effects run again without a lost result: {rerun:?}"
    );
    assert_eq!(
        effects.len(),
        STREAM_KEYS,
        "every key's effect ran at least once"
    );
    assert!(
        at_kill.0 < STREAM_KEYS && at_kill.1 < stream.messages.len(),
        "the kill came mid-stream"
    );
    assert!(
        cached.hits() > hits_before_recovery,
        "the tier answers duplicates again after the failover"
    );
    assert_exact(cached.pool(), &stream.expected).await;
}
