//! What a replay run did, and the progress events it emits on the way.

use std::sync::Arc;

/// What happened to one dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Republished and confirmed; removed from the dead-letter queue (AMQP)
    /// or counted for the commit (Kafka).
    Replayed,
    /// Would have been republished (dry run); left where it is.
    WouldReplay,
    /// Did not match the filters; left where it is.
    Skipped,
    /// Matched, but could not be republished; left where it is.
    Failed,
}

/// One dead letter the run looked at.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Letter {
    /// Where it sits: `queue#n` (n-th message read) or `topic/partition@offset`.
    pub position: String,
    /// Its `x-onceonly-reason`, if any.
    pub reason: Option<String>,
    /// Its `x-onceonly-idempotency-key`, if any.
    pub key: Option<String>,
    /// Where it goes back to: `exchange/routing-key` (`(default exchange)/queue`)
    /// or `topic[/partition]`;
    /// `None` if that could not be determined.
    pub target: Option<String>,
}

/// A dead letter that matched but could not be republished.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReplayFailure {
    /// The dead letter.
    pub letter: Letter,
    /// Why (unroutable, nacked, no original destination, timeout, …).
    pub error: String,
}

/// Counts of a replay run.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Whether this was a dry run (nothing republished, acked or committed).
    pub dry_run: bool,
    /// How many dead letters were expected at the start (queue depth, or
    /// records between the committed offsets and the high watermarks).
    pub total: u64,
    /// Dead letters read.
    pub scanned: u64,
    /// Republished and confirmed (in a dry run: would have been).
    pub replayed: u64,
    /// Left in place because they did not match the filters (or came after
    /// the `limit`).
    pub skipped: u64,
    /// Matched but could not be republished; left in place.
    pub failed: u64,
    /// Kafka only: replayed records whose dead-letter offset could not be
    /// committed because a skipped or failed record comes before them in
    /// their partition. A later run offers them again (the consumer then
    /// sees duplicates).
    pub uncommitted: u64,
    /// The failed dead letters, in the order met.
    pub failures: Vec<ReplayFailure>,
}

impl ReplayReport {
    /// Whether every matching dead letter was replayed.
    pub fn is_success(&self) -> bool {
        self.failed == 0
    }
}

/// A progress event: the dead letter just handled and the counts so far.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Progress {
    /// The dead letter.
    pub letter: Letter,
    /// What happened to it.
    pub action: Action,
    /// The failure text when `action` is [`Action::Failed`].
    pub error: Option<String>,
    /// Counts so far (without the failure list).
    pub report: ReplayReport,
}

/// Receives a [`Progress`] after each dead letter (e.g. to draw a progress
/// bar). Called on the replay's task: keep it quick.
pub type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// Counts a letter into the report and tells the progress callback.
pub(crate) fn record(
    report: &mut ReplayReport,
    progress: Option<&ProgressFn>,
    letter: Letter,
    action: Action,
    error: Option<String>,
) {
    match action {
        Action::Replayed | Action::WouldReplay => report.replayed += 1,
        Action::Skipped => report.skipped += 1,
        Action::Failed => report.failed += 1,
    }
    if let (Action::Failed, Some(e)) = (action, &error) {
        tracing::warn!(position = %letter.position, target = ?letter.target, error = %e, "dead letter not replayed");
        report.failures.push(ReplayFailure {
            letter: letter.clone(),
            error: e.clone(),
        });
    }
    if let Some(f) = progress {
        let mut counts = report.clone();
        counts.failures = Vec::new();
        f(&Progress {
            letter,
            action,
            error,
            report: counts,
        });
    }
}
