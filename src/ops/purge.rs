//! Bounded purges of the dedup table.
//!
//! A purge never runs one unbounded `DELETE`: it deletes at most `batch`
//! records per statement, each in its own short transaction, and can pause
//! between batches, so claims running at the same time wait at most for one
//! batch (PostgreSQL's expiry purge skips locked rows and does not wait at all).
//!
//! # What may be purged
//!
//! A record is the only thing that makes a redelivery a duplicate. Purge a
//! key only once no transport can deliver it again: after the broker's
//! retention, the payment provider's retry window and the dead-letter replay
//! window have all passed. [`PurgeMode::Expired`] deletes what the engine's
//! `retention` already declared expired (an expired record is reclaimed by
//! the next delivery of its key anyway); [`PurgeMode::CreatedBefore`] deletes
//! by age whatever the expiry says, for an operator who shortens retention.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::FusedFuture;
use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::store::admin::{AdminStore, CountFilter, PurgeCursor};
use crate::store::{SqlStore, StoreError, validate_scope};
use crate::telemetry;

/// Which records a purge deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PurgeMode {
    /// Records whose expiry time has passed.
    Expired,
    /// Records created before this time (ms since the Unix epoch), expired or not.
    CreatedBefore(i64),
}

/// Options of a one-off [`purge_in_batches`].
#[derive(Clone, Debug)]
pub struct PurgeOptions {
    scope: Option<String>,
    batch: u32,
    pause: Duration,
    dry_run: bool,
    force: bool,
}

impl Default for PurgeOptions {
    fn default() -> Self {
        Self {
            scope: None,
            batch: 5_000,
            pause: Duration::ZERO,
            dry_run: false,
            force: false,
        }
    }
}

impl PurgeOptions {
    /// Defaults: all scopes, batches of 5,000, no pause, not a dry run.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only this scope.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// At most `batch` records per statement (at least 1).
    #[must_use]
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Sleep this long between batches, to leave the database breathing room.
    #[must_use]
    pub fn pause_between_batches(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// Count what would be deleted; delete nothing.
    #[must_use]
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// Let [`PurgeMode::CreatedBefore`] delete records that have not expired
    /// yet. Without it such a purge fails with
    /// [`PurgeError::WouldDeleteLive`] before deleting anything.
    #[must_use]
    pub fn force(mut self, force: bool) -> Self {
        self.force = force;
        self
    }
}

/// Why a purge stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PurgeError {
    /// The store failed (after retrying transient errors).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A purge by age would delete records whose retention has not passed;
    /// a redelivery of their keys would run its handler again.
    #[error(
        "{live} of the records to purge have not expired yet: deleting them lets a redelivery \
         of their keys run again (force the purge to delete them anyway)"
    )]
    WouldDeleteLive {
        /// How many unexpired records the purge would delete.
        live: u64,
    },
}

/// Progress of a purge, reported after each batch (and once at the start,
/// with `deleted = 0`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeProgress {
    /// Records matching the purge when it started (for a dry run, the answer).
    pub candidates: u64,
    /// Of those, records that have not expired yet ([`PurgeMode::CreatedBefore`] only).
    pub live: u64,
    /// Records examined so far ([`PurgeMode::CreatedBefore`] walks the whole
    /// table or scope; [`PurgeMode::Expired`] examines only what it deletes).
    pub scanned: u64,
    /// How many records the walk will examine in total
    /// ([`PurgeMode::CreatedBefore`]: the table or scope size at the start).
    pub to_scan: u64,
    /// Records deleted so far.
    pub deleted: u64,
    /// Statements run so far.
    pub batches: u64,
    /// Whether nothing is deleted.
    pub dry_run: bool,
}

/// Purges `store` in bounded batches, calling `on_progress` after each.
/// Returns the final progress. `now_ms` decides what has expired.
///
/// Every batch commits on its own: an interrupted purge has deleted whole
/// batches and nothing else, and can simply be run again. A batch that
/// fails with a transient error (deadlock, lock timeout, lost connection)
/// is retried up to five times with a growing pause.
pub async fn purge_in_batches<S, F>(
    store: &S,
    mode: PurgeMode,
    options: &PurgeOptions,
    now_ms: i64,
    mut on_progress: F,
) -> Result<PurgeProgress, PurgeError>
where
    S: AdminStore,
    F: FnMut(&PurgeProgress) + Send,
{
    let scope = options.scope.as_deref();
    if let Some(scope) = scope {
        validate_scope(scope)?;
    }
    let mut progress = PurgeProgress {
        dry_run: options.dry_run,
        ..PurgeProgress::default()
    };
    match mode {
        PurgeMode::Expired => {
            progress.candidates = store.count(scope, CountFilter::ExpiredAt(now_ms)).await?;
            progress.to_scan = progress.candidates;
        }
        PurgeMode::CreatedBefore(cutoff_ms) => {
            progress.candidates = store
                .count(scope, CountFilter::CreatedBefore(cutoff_ms))
                .await?;
            progress.live = store
                .count(scope, CountFilter::LiveCreatedBefore { cutoff_ms, now_ms })
                .await?;
            progress.to_scan = store.count(scope, CountFilter::All).await?;
            if progress.live > 0 && !options.force && !options.dry_run {
                return Err(PurgeError::WouldDeleteLive {
                    live: progress.live,
                });
            }
        }
    }
    on_progress(&progress);
    if options.dry_run {
        return Ok(progress);
    }
    match mode {
        PurgeMode::Expired => loop {
            let deleted = retrying(|| store.purge_expired(scope, now_ms, options.batch)).await?;
            telemetry::purged(store.table(), deleted);
            progress.batches += 1;
            progress.deleted += deleted;
            progress.scanned += deleted;
            on_progress(&progress);
            if deleted < u64::from(options.batch) {
                break;
            }
            pause(options.pause).await;
        },
        PurgeMode::CreatedBefore(cutoff) => {
            let mut cursor: Option<PurgeCursor> = None;
            loop {
                let step = retrying(|| {
                    store.purge_created_before(scope, cutoff, cursor.as_ref(), options.batch)
                })
                .await?;
                telemetry::purged(store.table(), step.deleted);
                progress.batches += 1;
                progress.deleted += step.deleted;
                progress.scanned += step.scanned;
                on_progress(&progress);
                match step.next {
                    Some(next) => cursor = Some(next),
                    None => break,
                }
                pause(options.pause).await;
            }
        }
    }
    Ok(progress)
}

/// Runs `op`, retrying errors that pass by themselves (contention, a lost
/// connection, a statement timeout, a restarting server) up to five times
/// with jittered backoff. A read-only server, a missing table or a missing
/// privilege fails at once: an operator has to act.
async fn retrying<T, F, Fut>(mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    use crate::store::InfraFault;
    let mut delays = crate::engine::backoff(Duration::from_millis(100), Duration::from_secs(2));
    let mut attempt = 0u32;
    loop {
        match op().await {
            Err(e)
                if attempt < 5
                    && matches!(
                        e.infra_fault(),
                        Some(
                            InfraFault::Contention
                                | InfraFault::Unreachable
                                | InfraFault::Timeout
                                | InfraFault::Shutdown
                        )
                    ) =>
            {
                attempt += 1;
                tracing::warn!(error = %e, attempt, "purge batch failed; retrying");
                tokio::time::sleep(delays.next().unwrap_or(Duration::from_secs(2))).await;
            }
            other => return other,
        }
    }
}

async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// A background job that purges expired records of a store at an interval,
/// inside a service (the library form of `onceonly purge --expired`).
///
/// ```no_run
/// # async fn demo(store: onceonly::SqliteStore) -> Result<(), onceonly::StoreError> {
/// use std::time::Duration;
/// use onceonly::ops::Purger;
///
/// let purger = Purger::builder(store)
///     .every(Duration::from_secs(600))
///     .batch(5_000)
///     .build()?
///     .spawn();
/// // ... serve ...
/// let purged = purger.stop().await;
/// # let _ = purged;
/// # Ok(())
/// # }
/// ```
///
/// Each round deletes expired records in batches until a batch comes back
/// short, then sleeps. A failed round (database down) is logged and retried
/// at the next interval; the purger never stops on an error.
pub struct Purger<S> {
    store: S,
    scope: Option<String>,
    batch: u32,
    every: Duration,
    pause: Duration,
    clock: Arc<dyn Clock>,
}

impl<S> std::fmt::Debug for Purger<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Purger")
            .field("scope", &self.scope)
            .field("batch", &self.batch)
            .field("every", &self.every)
            .field("pause", &self.pause)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Purger`].
pub struct PurgerBuilder<S> {
    purger: Purger<S>,
}

impl<S: SqlStore> Purger<S> {
    /// A purger of `store`'s expired records: every 10 minutes, batches of
    /// 5,000, 50 ms between batches, all scopes, system clock.
    pub fn builder(store: S) -> PurgerBuilder<S> {
        PurgerBuilder {
            purger: Self {
                store,
                scope: None,
                batch: 5_000,
                every: Duration::from_secs(600),
                pause: Duration::from_millis(50),
                clock: Arc::new(SystemClock),
            },
        }
    }

    /// One round: deletes expired records in batches until none are left.
    /// Returns how many were deleted.
    pub async fn purge_once(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        let mut never = std::pin::pin!(std::future::pending::<()>().fuse());
        self.observed_round(&mut total, &mut never).await?;
        Ok(total)
    }

    /// [`round`](Self::round), reported in the metrics: a round that
    /// caught up sets `onceonly_purge_last_success_timestamp_seconds`, a
    /// failed one counts in `onceonly_purge_failures_total`.
    async fn observed_round<F>(
        &self,
        total: &mut u64,
        shutdown: &mut Pin<&mut F>,
    ) -> Result<(), StoreError>
    where
        F: FusedFuture<Output = ()>,
    {
        let now_ms = self.clock.now_ms();
        let round = self.round(now_ms, total, shutdown).await;
        // A table that rotates says how its rotations go, whether this
        // round rotated or not: a rotation possible for long is starved.
        match self.store.rotations(now_ms).await {
            Ok(Some(rotations)) => telemetry::rotations(self.store.table(), &rotations, now_ms),
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "could not read the table's rotations"),
        }
        match round {
            Ok(caught_up) => {
                if caught_up {
                    telemetry::purge_caught_up(self.store.table(), now_ms);
                }
                Ok(())
            }
            Err(e) => {
                telemetry::purge_failed(self.store.table());
                Err(e)
            }
        }
    }

    /// Deletes records expired at `now_ms` batch by batch into `total`,
    /// until a batch comes back short (returns `true`: caught up) or
    /// `shutdown` is ready between two batches (`false`). A batch that
    /// started finishes, unless it is still running [`SHUTDOWN_GRACE`]
    /// after `shutdown` (a rotation of a big generations table, which
    /// pauses between its steps): it is then abandoned between two
    /// statements, each of which commits or rolls back whole, and the next
    /// purge goes on from there.
    async fn round<F>(
        &self,
        now_ms: i64,
        total: &mut u64,
        shutdown: &mut Pin<&mut F>,
    ) -> Result<bool, StoreError>
    where
        F: FusedFuture<Output = ()>,
    {
        loop {
            // A fused future completes once: a batch's select may have
            // seen it.
            if shutdown.is_terminated() || shutdown.as_mut().now_or_never().is_some() {
                return Ok(false);
            }
            let purge = self
                .store
                .purge_expired(self.scope.as_deref(), now_ms, self.batch);
            let deleted = tokio::select! {
                deleted = purge => deleted?,
                () = async {
                    shutdown.as_mut().await;
                    tokio::time::sleep(SHUTDOWN_GRACE).await;
                } => {
                    tracing::info!(
                        table = %self.store.table(),
                        "a purge still running at shutdown was abandoned; the next one goes on"
                    );
                    return Ok(false);
                }
            };
            telemetry::purged(self.store.table(), deleted);
            *total += deleted;
            if deleted < u64::from(self.batch) {
                return Ok(true);
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return Ok(false),
                () = pause(self.pause) => {}
            }
        }
    }

    /// Runs rounds until `shutdown` completes; a batch in progress finishes
    /// first, or is abandoned [`SHUTDOWN_GRACE`] after `shutdown`. Returns
    /// how many records were deleted.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> u64 {
        // Fused: a round may have seen it complete.
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        let mut total = 0;
        loop {
            let before = total;
            match self.observed_round(&mut total, &mut shutdown).await {
                Ok(()) if total > before => tracing::info!(
                    deleted = total - before,
                    table = %self.store.table(),
                    "purged expired dedup records"
                ),
                Ok(()) => {}
                Err(e) => tracing::warn!(
                    error = %e,
                    table = %self.store.table(),
                    "purge of expired dedup records failed; retrying at the next interval"
                ),
            }
            if shutdown.is_terminated() {
                return total;
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return total,
                () = tokio::time::sleep(self.every) => {}
            }
        }
    }

    /// Runs the purger on the current tokio runtime until
    /// [`PurgerHandle::stop`].
    pub fn spawn(self) -> PurgerHandle {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        PurgerHandle { stop, task }
    }
}

impl<S: SqlStore> PurgerBuilder<S> {
    /// Only purge this scope.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.purger.scope = Some(scope.into());
        self
    }

    /// At most `batch` records per statement (at least 1).
    #[must_use]
    pub fn batch(mut self, batch: u32) -> Self {
        self.purger.batch = batch.max(1);
        self
    }

    /// How long to sleep between rounds.
    #[must_use]
    pub fn every(mut self, every: Duration) -> Self {
        self.purger.every = every;
        self
    }

    /// How long to sleep between the batches of one round.
    #[must_use]
    pub fn pause_between_batches(mut self, pause: Duration) -> Self {
        self.purger.pause = pause;
        self
    }

    /// The clock that decides what has expired (use the engine's).
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.purger.clock = clock;
        self
    }

    /// The purger; checks the scope.
    pub fn build(self) -> Result<Purger<S>, StoreError> {
        if let Some(scope) = &self.purger.scope {
            validate_scope(scope)?;
        }
        Ok(self.purger)
    }
}

/// A running [`Purger`].
#[derive(Debug)]
pub struct PurgerHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<u64>,
}

/// How long a stopping [`Purger`] waits for the batch in progress (a
/// bounded `DELETE` takes milliseconds; a rotation of a big generations
/// table pauses between its steps for seconds) before it abandons it.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

impl PurgerHandle {
    /// Stops the purger after its current batch (waiting for it at most
    /// [`SHUTDOWN_GRACE`]); returns how many records it deleted in total.
    /// (Dropping the handle instead leaves the purger running until the
    /// runtime shuts down.)
    pub async fn stop(self) -> u64 {
        let _ = self.stop.send(true);
        match self.task.await {
            Ok(total) => total,
            Err(e) => {
                tracing::error!(error = %e, "the purger task failed");
                0
            }
        }
    }
}
