//! Which offset of a partition may be committed: the highest *contiguous*
//! finished one. A message that is still running, retrying or was abandoned
//! holds the commit position back, whatever finished after it.

use std::collections::VecDeque;

/// Tracks the dispatched and finished offsets of one partition.
#[derive(Debug, Default)]
pub(crate) struct OffsetTracker {
    /// Dispatched offsets not yet released, ascending, with a finished flag.
    pending: VecDeque<(i64, bool)>,
    /// The highest offset handed to a worker.
    last_dispatched: Option<i64>,
    /// Everything below this offset is finished: the next commit position.
    done_upto: Option<i64>,
    /// The position last committed (or being committed).
    committed: Option<i64>,
}

impl OffsetTracker {
    /// Records that `offset` goes to a worker. Returns `false` (and records
    /// nothing) if it is not above every offset dispatched so far: the client
    /// fetched it again after a pause, and it is already in hand.
    pub(crate) fn dispatch(&mut self, offset: i64) -> bool {
        if self.last_dispatched.is_some_and(|last| offset <= last) {
            return false;
        }
        self.last_dispatched = Some(offset);
        self.pending.push_back((offset, false));
        true
    }

    /// Records that `offset` reached a final outcome (committed, duplicate or
    /// dead-lettered). Unknown offsets are ignored.
    pub(crate) fn finish(&mut self, offset: i64) {
        if let Ok(at) = self.pending.binary_search_by_key(&offset, |&(o, _)| o) {
            self.pending[at].1 = true;
        }
        while let Some(&(o, true)) = self.pending.front() {
            self.pending.pop_front();
            self.done_upto = Some(o + 1);
        }
    }

    /// The position to commit (the offset of the next message to consume),
    /// if it moved since the last call that was followed by
    /// [`OffsetTracker::committed`].
    pub(crate) fn commit_candidate(&self) -> Option<i64> {
        self.done_upto.filter(|&p| self.committed != Some(p))
    }

    /// Records that `position` was committed.
    pub(crate) fn committed(&mut self, position: i64) {
        if self.committed.is_none_or(|c| c < position) {
            self.committed = Some(position);
        }
    }

    /// Messages dispatched and not finished.
    pub(crate) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Whether every dispatched message is finished and committed.
    pub(crate) fn is_settled(&self) -> bool {
        self.pending.is_empty() && self.commit_candidate().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_only_the_contiguous_prefix() {
        let mut t = OffsetTracker::default();
        for o in 10..15 {
            assert!(t.dispatch(o));
        }
        assert_eq!(t.commit_candidate(), None);
        t.finish(12);
        t.finish(11);
        assert_eq!(t.commit_candidate(), None, "10 is still running");
        t.finish(10);
        assert_eq!(t.commit_candidate(), Some(13));
        t.committed(13);
        assert_eq!(t.commit_candidate(), None);
        assert_eq!(t.in_flight(), 2);
        t.finish(14);
        assert_eq!(t.commit_candidate(), None, "13 is still running");
        t.finish(13);
        assert_eq!(t.commit_candidate(), Some(15));
        t.committed(15);
        assert!(t.is_settled());
    }

    #[test]
    fn gaps_in_offsets_do_not_hold_the_position_back() {
        // Compacted topics and transaction markers leave gaps.
        let mut t = OffsetTracker::default();
        t.dispatch(3);
        t.dispatch(7);
        t.finish(7);
        t.finish(3);
        assert_eq!(t.commit_candidate(), Some(8));
    }

    #[test]
    fn refetched_offsets_are_not_dispatched_twice() {
        let mut t = OffsetTracker::default();
        assert!(t.dispatch(5));
        assert!(!t.dispatch(5));
        assert!(!t.dispatch(4));
        assert!(t.dispatch(6));
        assert_eq!(t.in_flight(), 2);
    }

    #[test]
    fn an_abandoned_message_blocks_commits_forever() {
        let mut t = OffsetTracker::default();
        t.dispatch(0);
        t.dispatch(1);
        t.finish(1);
        assert_eq!(t.commit_candidate(), None);
        assert!(!t.is_settled());
    }

    #[test]
    fn unknown_offsets_are_ignored() {
        let mut t = OffsetTracker::default();
        t.dispatch(1);
        t.finish(99);
        assert_eq!(t.commit_candidate(), None);
        assert_eq!(t.in_flight(), 1);
    }
}
