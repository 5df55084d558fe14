//! Operations on an outbox table: what the CLI's `onceonly outbox`
//! subcommands and the relay's metrics run. Each statement is bounded by
//! the default [statement deadline](crate::store::Deadlines::statement)
//! (plus taking a connection).

use sqlx::Pool;

use super::Outbox;
use super::backend::{OutboxBackend, OutboxRecord, RecordsFilter, Status, StatusCount};
use crate::clock::{Clock, SystemClock};
use crate::store::deadline::within;
use crate::store::{Deadlines, StoreError};

/// The bound of one statement on the pool: a connection, then the statement.
fn bound() -> std::time::Duration {
    let d = Deadlines::default();
    d.acquire_timeout() + d.statement_deadline()
}

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

    /// Pending rows not due yet ([delayed](super::OutboxMessage::not_before)
    /// messages), all kinds.
    pub fn delayed(&self) -> i64 {
        self.counts.iter().map(|c| c.delayed).sum()
    }

    /// Pending rows that are due: the backlog a relay has to work off.
    pub fn backlog(&self) -> i64 {
        self.rows(Status::Pending) - self.delayed()
    }

    /// The oldest due row of `status` (delayed messages age from when they
    /// are due), in ms since the Unix epoch.
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
            counts: within(bound(), "outbox stats", DB::stats(pool, self.sql())).await?,
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
        within(
            bound(),
            "outbox list",
            DB::records(pool, self.sql(), filter),
        )
        .await
    }

    /// The row of message `message_id`, if it is still there.
    pub async fn find(
        &self,
        pool: &Pool<DB>,
        message_id: &str,
    ) -> Result<Option<OutboxRecord>, StoreError> {
        let filter = RecordsFilter::MessageId(message_id);
        let records = DB::records(pool, self.sql(), filter);
        Ok(within(bound(), "outbox find", records)
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
        let retried = DB::retry_dead(pool, self.sql(), message_id, SystemClock.now_ms());
        within(bound(), "outbox retry", retried).await
    }

    /// Deletes rows sent before `before_ms`, at most `batch` per statement
    /// (each its own short transaction), until none is left. Returns how
    /// many. On the generations layout (PostgreSQL) it rotates instead,
    /// if the older generation holds no row sent since `before_ms`, and
    /// returns about how many rows the truncate removed.
    pub async fn purge_sent(
        &self,
        pool: &Pool<DB>,
        before_ms: i64,
        batch: u32,
    ) -> Result<u64, StoreError> {
        if self.sql().rotation.is_some() {
            // The generations layout: a rotation, not deletes.
            let d = Deadlines::default();
            let bound = d.acquire_timeout() + 4 * d.statement_deadline();
            let rotated = DB::rotate_sent(pool, self.sql(), before_ms, SystemClock.now_ms());
            return Ok(within(bound, "outbox rotation", rotated)
                .await?
                .unwrap_or(0));
        }
        let batch = i64::from(batch.max(1));
        let mut total = 0;
        loop {
            let purged = DB::purge_sent(pool, self.sql(), before_ms, batch);
            let deleted = within(bound(), "outbox purge", purged).await?;
            total += deleted;
            if deleted < batch as u64 {
                return Ok(total);
            }
        }
    }
}
