//! The claim's open transaction, as an owned handle the handler works in.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{Database, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

/// The transaction a key was claimed in. Every handler gets one, broker
/// and HTTP alike: write through it and the writes commit together with
/// the claim and the stored result, or not at all.
///
/// It is a cheap handle (clone it freely); [`lock`](Tx::lock) it for the
/// handler's statements and use `&mut *conn` as the sqlx executor:
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn f(tx: onceonly::Tx<sqlx::Sqlite>) -> Result<(), onceonly::HandlerError> {
/// let mut conn = tx.lock().await?;
/// sqlx::query("INSERT INTO ledger (out_trade_no, amount) VALUES (?, ?)")
///     .bind("T-1")
///     .bind(100)
///     .execute(&mut *conn)
///     .await?;
/// # Ok(()) }
/// ```
///
/// Do not commit or roll it back yourself, and do not keep a lock after the
/// handler returned: the engine takes the transaction back then to record
/// the result and commit (a lock still held after
/// [`RETURN_TIMEOUT`](Tx::RETURN_TIMEOUT) fails the delivery, and the
/// transaction rolls back when the lock is finally dropped).
pub struct Tx<DB: Database>(Arc<Mutex<Option<Transaction<'static, DB>>>>);

impl<DB: Database> Clone for Tx<DB> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

/// The transaction is gone: the engine already finished the delivery (the
/// handle was used after the handler returned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the onceonly transaction is no longer available")]
pub struct TxGone;

/// The locked connection of a [`Tx`]: use `&mut *conn` as the executor.
pub type TxGuard<DB> =
    OwnedMappedMutexGuard<Option<Transaction<'static, DB>>, <DB as Database>::Connection>;

impl<DB: Database> Tx<DB> {
    /// How long the engine waits, after the handler returned, for it to let
    /// go of the transaction.
    pub const RETURN_TIMEOUT: Duration = Duration::from_secs(30);

    pub(crate) fn new(tx: Transaction<'static, DB>) -> Self {
        Self(Arc::new(Mutex::new(Some(tx))))
    }

    /// Locks the transaction's connection for the handler's statements.
    pub async fn lock(&self) -> Result<TxGuard<DB>, TxGone> {
        OwnedMutexGuard::try_map(Arc::clone(&self.0).lock_owned().await, |slot| {
            slot.as_mut().map(|tx| &mut **tx)
        })
        .map_err(|_| TxGone)
    }

    /// Takes the transaction back once the handler let go of it; `None` if
    /// it is gone or still held after `wait`.
    pub(crate) async fn take(&self, wait: Duration) -> Option<Transaction<'static, DB>> {
        match tokio::time::timeout(wait, self.0.lock()).await {
            Ok(mut slot) => slot.take(),
            Err(_) => None,
        }
    }
}
