//! The demo apps' in-process outbox relay: waiting for the outbox to drain
//! before a process that was asked to exit when idle stops.

use std::time::Duration;

use onceonly::outbox::{Outbox, OutboxBackend, Status};

/// Waits until `outbox` has no pending row in `pool`'s database, polling,
/// for at most `within`; fails after that.
pub async fn drain<DB: OutboxBackend>(
    outbox: &Outbox<DB>,
    pool: &sqlx::Pool<DB>,
    within: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = tokio::time::Instant::now() + within;
    while outbox.stats(pool).await?.rows(Status::Pending) > 0 {
        if tokio::time::Instant::now() > deadline {
            return Err(format!("the outbox did not drain within {within:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
