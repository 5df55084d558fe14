//! Operations on an outbox table: what the CLI's `onceonly outbox`
//! subcommands and the relay's metrics run.

use sqlx::Pool;

use super::Outbox;
use super::backend::{OutboxBackend, OutboxRecord, RecordsFilter, Status, StatusCount};
use crate::clock::{Clock, SystemClock};
use crate::store::StoreError;

/// What an outbox table holds, per status and kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutboxStats {
    /// One entry per status and kind present.
    pub counts: Vec<StatusCount>,
}

impl OutboxStats {
    /// Rows of `status`, all kinds.
    pub fn rows(&self, status: Status) -> i64 {
        self.counts
            .iter()
            .filter(|c| c.status == status)
            .map(|c| c.rows)
            .sum()
    }

    /// The oldest row of `status`, in ms since the Unix epoch.
    pub fn oldest_ms(&self, status: Status) -> Option<i64> {
        self.counts
            .iter()
            .filter(|c| c.status == status)
            .filter_map(|c| c.oldest_ms)
            .min()
    }
}

impl<DB: OutboxBackend> Outbox<DB> {
    /// Rows per status and kind.
    pub async fn stats(&self, pool: &Pool<DB>) -> Result<OutboxStats, StoreError> {
        Ok(OutboxStats {
            counts: DB::stats(pool, self.sql()).await?,
        })
    }

    /// Rows of `status`, oldest first, at most `limit`.
    pub async fn list(
        &self,
        pool: &Pool<DB>,
        status: Status,
        limit: u32,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        let filter = RecordsFilter::Status(status, i64::from(limit));
        Ok(DB::records(pool, self.sql(), filter).await?)
    }

    /// The row of message `message_id`, if it is still there.
    pub async fn find(
        &self,
        pool: &Pool<DB>,
        message_id: &str,
    ) -> Result<Option<OutboxRecord>, StoreError> {
        let filter = RecordsFilter::MessageId(message_id);
        Ok(DB::records(pool, self.sql(), filter)
            .await?
            .into_iter()
            .next())
    }

    /// Puts dead rows back to pending, due now: all of them, or the one
    /// with `message_id`. Returns how many.
    pub async fn retry_dead(
        &self,
        pool: &Pool<DB>,
        message_id: Option<&str>,
    ) -> Result<u64, StoreError> {
        Ok(DB::retry_dead(pool, self.sql(), message_id, SystemClock.now_ms()).await?)
    }

    /// Deletes rows sent before `before_ms`, at most `batch` per statement
    /// (each its own short transaction), until none is left. Returns how
    /// many.
    pub async fn purge_sent(
        &self,
        pool: &Pool<DB>,
        before_ms: i64,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let batch = i64::from(batch.max(1));
        let mut total = 0;
        loop {
            let deleted = DB::purge_sent(pool, self.sql(), before_ms, batch).await?;
            total += deleted;
            if deleted < batch as u64 {
                return Ok(total);
            }
        }
    }
}
