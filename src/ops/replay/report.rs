//! What a replay run did, and the progress events it emits on the way.

use std::sync::Arc;

use super::group::{FailureGroup, Groups};
use super::screen::Verdict;

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
    /// Matched, but older than its scope's dedup retention (its record may
    /// be gone, so a duplicate could run again); left where it is.
    Refused,
    /// Replayed too often already: moved to the parking queue or topic
    /// instead of its original destination.
    Parked,
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
    /// Its `x-onceonly-scope`, if any.
    pub scope: Option<String>,
    /// Its `x-onceonly-error`, if any.
    pub error: Option<String>,
    /// Its error text with keys and numbers masked (the key and every word containing a digit masked, runs of whitespace collapsed).
    pub pattern: String,
    /// Its failure group (see [`group_id`](super::group_id)).
    pub group: String,
    /// When the consumer first received it (`x-onceonly-first-seen`, else
    /// the message timestamp), in ms since the Unix epoch.
    pub first_seen_ms: Option<i64>,
    /// How often it was replayed before (`x-onceonly-replays`).
    pub replays: u32,
    /// What replaying it would do by the dedup table, once screened.
    pub verdict: Option<Verdict>,
}

impl Letter {
    /// A letter with these attributes; its pattern and group follow from
    /// the reason, error and key.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        position: String,
        reason: Option<String>,
        key: Option<String>,
        target: Option<String>,
        scope: Option<String>,
        error: Option<String>,
        first_seen_ms: Option<i64>,
        replays: u32,
    ) -> Self {
        let pattern = super::error_pattern(error.as_deref().unwrap_or(""), key.as_deref());
        let group = super::group_id(reason.as_deref(), &pattern);
        Self {
            position,
            reason,
            key,
            target,
            scope,
            error,
            pattern,
            group,
            first_seen_ms,
            replays,
            verdict: None,
        }
    }
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
    /// Matched but refused: older than their scope's dedup retention; left
    /// in place.
    pub refused: u64,
    /// Moved to the parking queue or topic after too many replays.
    pub parked: u64,
    /// Of the replayed (or, in a dry run, to-be-replayed) letters, how many
    /// were new work, duplicates, conflicts, or not known, by the dedup
    /// table.
    pub verdicts: VerdictCounts,
    /// The failure groups of the letters that matched the filters, largest
    /// first (complete once the run returned).
    pub groups: Vec<FailureGroup>,
    /// The failed dead letters, in the order met.
    pub failures: Vec<ReplayFailure>,
    pub(crate) acc: Groups,
}

/// Letters by [`Verdict`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct VerdictCounts {
    /// Key without a live record: the handler would run.
    pub new: u64,
    /// Key committed with the same payload: answered, no effect.
    pub duplicates: u64,
    /// Key committed with another payload: dead-lettered again.
    pub conflicts: u64,
    /// Not known (no key or scope, or no dedup table given).
    pub unknown: u64,
}

impl VerdictCounts {
    fn add(&mut self, verdict: Option<Verdict>) {
        match verdict {
            Some(Verdict::New) => self.new += 1,
            Some(Verdict::Duplicate) => self.duplicates += 1,
            Some(Verdict::Conflict) => self.conflicts += 1,
            Some(Verdict::Unknown) | None => self.unknown += 1,
        }
    }
}

impl ReplayReport {
    /// Whether every matching dead letter was replayed.
    pub fn is_success(&self) -> bool {
        self.failed == 0
    }

    /// Fills [`groups`](Self::groups) from what the run counted.
    pub(crate) fn finish(mut self) -> Self {
        self.groups = self.acc.sorted();
        self
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
        Action::Replayed | Action::WouldReplay => {
            report.replayed += 1;
            report.verdicts.add(letter.verdict);
        }
        Action::Skipped => report.skipped += 1,
        Action::Failed => report.failed += 1,
        Action::Refused => report.refused += 1,
        Action::Parked => report.parked += 1,
    }
    if action != Action::Skipped {
        report
            .acc
            .add(&letter, action == Action::Refused, action == Action::Parked);
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
        counts.acc = Groups::default();
        f(&Progress {
            letter,
            action,
            error,
            report: counts,
        });
    }
}
