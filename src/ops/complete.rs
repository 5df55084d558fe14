//! Finding handlers that called another system and never committed.
//!
//! A [step](crate::Tx::step) is committed on its own as soon as its call
//! returned; the handler's transaction commits later. If the process dies
//! in between and the message is never delivered again (a webhook whose
//! provider gave up, a message a consumer dead-lettered, an operator who
//! purged a queue), the downstream system has done its part and the
//! business transaction never happened. The [`Completer`] finds such keys:
//! live steps older than a grace period whose key has no live record in
//! the dedup table. It reports them (a log line each, the
//! `onceonly_steps_orphaned` gauge and its alert) and hands them to a
//! callback that can deliver the message again, e.g. by publishing it
//! from the source of truth; its handler then finds its steps finished and
//! completes the transaction without calling again.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::clock::{Clock, SystemClock};
use crate::store::{OrphanedStep, SqlStore, StoreError};
use crate::telemetry;

/// What a [`Completer`] does with the orphaned steps of a round.
pub type OrphanHandler = Arc<dyn Fn(&[OrphanedStep]) + Send + Sync>;

/// Finds finished steps whose key never committed; see the
/// [module documentation](self).
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn f(store: onceonly::PgStore) {
/// use std::time::Duration;
/// use onceonly::ops::Completer;
///
/// let completer = Completer::builder(store)
///     .grace(Duration::from_secs(600))
///     .on_orphans(|orphans| {
///         for o in orphans {
///             // Look the message up by its key in your source of truth
///             // and deliver it again (idempotently: a key comes back at
///             // every round until it commits).
///             tracing::error!(scope = %o.scope, step = %o.step, "a payment to deliver again");
///         }
///     })
///     .build()
///     .spawn();
/// // ...
/// completer.stop().await;
/// # }
/// ```
pub struct Completer<S> {
    store: S,
    grace: Duration,
    every: Duration,
    limit: u32,
    clock: Arc<dyn Clock>,
    on_orphans: Option<OrphanHandler>,
}

impl<S> std::fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("grace", &self.grace)
            .field("every", &self.every)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Completer`].
pub struct CompleterBuilder<S> {
    completer: Completer<S>,
}

impl<S: SqlStore> Completer<S> {
    /// A completer of `store`'s steps: a grace of 15 minutes (longer than
    /// any handler may run: the [transaction deadline](crate::store::Deadlines::transaction)
    /// plus the time a delivery may wait for a redelivery), every 5
    /// minutes, at most 1,000 orphans per round, system clock, no callback.
    pub fn builder(store: S) -> CompleterBuilder<S> {
        CompleterBuilder {
            completer: Self {
                store,
                grace: Duration::from_secs(15 * 60),
                every: Duration::from_secs(5 * 60),
                limit: 1_000,
                clock: Arc::new(SystemClock),
                on_orphans: None,
            },
        }
    }

    /// One round: the orphaned steps now (at most the limit), reported in
    /// the log and the gauge and passed to the callback.
    pub async fn check_once(&self) -> Result<Vec<OrphanedStep>, StoreError> {
        let now_ms = self.clock.now_ms();
        let grace = i64::try_from(self.grace.as_millis()).unwrap_or(i64::MAX);
        let orphans = self
            .store
            .orphaned_steps(now_ms.saturating_sub(grace), now_ms, self.limit)
            .await?;
        telemetry::steps_orphaned(self.store.table(), orphans.len());
        for o in &orphans {
            tracing::warn!(
                scope = %o.scope,
                step = %o.step,
                finished_at_ms = o.created_at_ms,
                "a step finished but its key's transaction never committed; deliver the message again to complete it"
            );
        }
        if let (Some(f), false) = (&self.on_orphans, orphans.is_empty()) {
            f(&orphans);
        }
        Ok(orphans)
    }

    /// Runs rounds until `shutdown` completes. A failed round (database
    /// down) is logged and retried at the next interval.
    pub async fn run_until(self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            if let Err(e) = self.check_once().await {
                tracing::warn!(error = %e, table = %self.store.table(), "looking for orphaned steps failed; retrying at the next interval");
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return,
                () = tokio::time::sleep(self.every) => {}
            }
        }
    }

    /// Runs the completer on the current tokio runtime until
    /// [`CompleterHandle::stop`].
    pub fn spawn(self) -> CompleterHandle {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        CompleterHandle { stop, task }
    }
}

impl<S: SqlStore> CompleterBuilder<S> {
    /// How old a step must be before its key counts as never committed.
    #[must_use]
    pub fn grace(mut self, grace: Duration) -> Self {
        self.completer.grace = grace;
        self
    }

    /// How long to sleep between rounds.
    #[must_use]
    pub fn every(mut self, every: Duration) -> Self {
        self.completer.every = every;
        self
    }

    /// At most this many orphans per round (at least 1).
    #[must_use]
    pub fn limit(mut self, limit: u32) -> Self {
        self.completer.limit = limit.max(1);
        self
    }

    /// The clock (use the engine's).
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.completer.clock = clock;
        self
    }

    /// Called with each round's orphans (when there are any): deliver
    /// their messages again from here.
    #[must_use]
    pub fn on_orphans(mut self, f: impl Fn(&[OrphanedStep]) + Send + Sync + 'static) -> Self {
        self.completer.on_orphans = Some(Arc::new(f));
        self
    }

    /// The completer.
    pub fn build(self) -> Completer<S> {
        self.completer
    }
}

/// A running [`Completer`].
#[derive(Debug)]
pub struct CompleterHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl CompleterHandle {
    /// Stops the completer after its current round.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await {
            tracing::error!(error = %e, "the completer task failed");
        }
    }
}
