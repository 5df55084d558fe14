//! The open transaction of a claim: an sqlx [`Transaction`], or a pooled
//! connection inside a transaction that a backend began itself, in the
//! same round trip as the claim (PostgreSQL's pipelined claims, see
//! [`PgStore`](crate::PgStore)).
//!
//! A transaction begun by hand is invisible to sqlx, so this type keeps
//! sqlx's promises for it: dropped unfinished, it is rolled back (bounded)
//! before its connection goes back to the pool, and a connection that
//! cannot be rolled back, or that was open when a deadline was missed, is
//! closed instead of being reused.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Database, Transaction};

use super::StoreError;
use super::deadline::{self, bounded};

/// A `ROLLBACK` of a connection's hand-begun transaction: `Ok` once the
/// connection is idle again and may go back to the pool.
pub(crate) type RollbackFn<DB> =
    fn(
        &mut PoolConnection<DB>,
    ) -> Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + '_>>;

/// An open claim transaction. It dereferences to the connection, to run
/// statements on; the engine finishes it with
/// [`SqlStore::finish_claim`](super::SqlStore::finish_claim) or rolls it
/// back. Dropped unfinished, it rolls back.
pub struct ClaimTx<DB: Database> {
    inner: Inner<DB>,
    began: Instant,
}

enum Inner<DB: Database> {
    /// Begun, committed and rolled back by sqlx.
    Sqlx(Transaction<'static, DB>),
    /// Begun by the backend on this connection (`None` once ended).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Raw(RawTx<DB>),
}

/// A connection inside a transaction its backend began by hand.
pub(crate) struct RawTx<DB: Database> {
    conn: Option<PoolConnection<DB>>,
    rollback: RollbackFn<DB>,
    began: Instant,
    bound: Duration,
}

impl<DB: Database> std::fmt::Debug for ClaimTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.inner {
            Inner::Sqlx(_) => "sqlx",
            Inner::Raw(_) => "pipelined",
        };
        f.debug_struct("ClaimTx")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

impl<DB: Database> ClaimTx<DB> {
    /// An sqlx transaction begun at `began`.
    pub fn new(tx: Transaction<'static, DB>, began: Instant) -> Self {
        Self {
            inner: Inner::Sqlx(tx),
            began,
        }
    }

    /// `conn`, inside a transaction begun by hand at `began`; `rollback`
    /// ends it, bounded by `bound` when the transaction is dropped.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn raw(
        conn: PoolConnection<DB>,
        rollback: RollbackFn<DB>,
        began: Instant,
        bound: Duration,
    ) -> Self {
        Self {
            inner: Inner::Raw(RawTx {
                conn: Some(conn),
                rollback,
                began,
                bound,
            }),
            began,
        }
    }

    /// The connection of a transaction begun by hand; `None` for sqlx's.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn raw_conn(&mut self) -> Option<&mut PoolConnection<DB>> {
        match &mut self.inner {
            Inner::Raw(raw) => raw.conn(),
            Inner::Sqlx(_) => None,
        }
    }

    /// When the transaction began.
    pub fn began(&self) -> Instant {
        self.began
    }

    /// What the transaction is: sqlx's, to commit with sqlx, or begun by
    /// hand, for its backend to end.
    pub(crate) fn into_parts(self) -> Parts<DB> {
        match self.inner {
            Inner::Sqlx(tx) => Parts::Sqlx(tx),
            Inner::Raw(raw) => Parts::Raw(raw),
        }
    }

    /// Commits an sqlx transaction within `bound` (a batch's: its results
    /// were recorded already). A transaction begun by hand is committed by
    /// its backend ([`SqlStore::finish_claim`](super::SqlStore::finish_claim)),
    /// never here.
    pub(crate) async fn commit(self, bound: Duration) -> Result<(), StoreError> {
        match self.inner {
            Inner::Sqlx(tx) => deadline::within(bound, "commit", tx.commit()).await,
            Inner::Raw(raw) => {
                raw.discard();
                Err(StoreError::Corrupt(
                    "a pipelined claim transaction cannot be committed without its result".into(),
                ))
            }
        }
    }

    /// Ends the transaction without committing: a `ROLLBACK` bounded by
    /// `bound`, or, when a deadline was missed since it began (its
    /// connection is discarded anyway, and may not answer), just dropped.
    pub(crate) async fn rollback(self, bound: Duration) {
        match self.inner {
            Inner::Sqlx(tx) => deadline::rollback(tx, self.began, bound).await,
            Inner::Raw(mut raw) => raw.rollback_within(bound).await,
        }
    }
}

/// A [`ClaimTx`] taken apart.
pub(crate) enum Parts<DB: Database> {
    Sqlx(Transaction<'static, DB>),
    Raw(RawTx<DB>),
}

impl<DB: Database> RawTx<DB> {
    /// The connection, for the statements that end the transaction.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn conn(&mut self) -> Option<&mut PoolConnection<DB>> {
        self.conn.as_mut()
    }

    /// The transaction ended on the server (committed, or rolled back by
    /// it): the connection goes back to the pool as it is.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn ended(mut self) {
        drop(self.conn.take());
    }

    /// The connection's state is unknown (an error in the middle of a
    /// statement, a deadline): close it instead of reusing it.
    pub(crate) fn discard(mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close_on_drop();
        }
    }

    /// `ROLLBACK` within `bound`; the connection is closed if it does not
    /// answer, or if a deadline was missed since the transaction began.
    pub(crate) async fn rollback_within(&mut self, bound: Duration) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if deadline::missed_since(self.began) {
            conn.close_on_drop();
            return;
        }
        let rollback = self.rollback;
        match bounded(bound, "rollback", rollback(&mut conn)).await {
            Ok(Ok(())) => {}
            _ => conn.close_on_drop(),
        }
    }
}

impl<DB: Database> Drop for RawTx<DB> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            conn.close_on_drop();
            return;
        };
        let mut rest = RawTx {
            conn: Some(conn),
            rollback: self.rollback,
            began: self.began,
            bound: self.bound,
        };
        // A task dropped before it ran (the runtime shutting down) drops
        // `rest` outside a runtime: the connection is closed then.
        runtime.spawn(async move {
            let bound = rest.bound;
            rest.rollback_within(bound).await;
        });
    }
}

impl<DB: Database> Deref for ClaimTx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        match &self.inner {
            Inner::Sqlx(tx) => tx,
            Inner::Raw(raw) => raw.conn.as_ref().map_or_else(|| gone(), |c| &**c),
        }
    }
}

impl<DB: Database> DerefMut for ClaimTx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match &mut self.inner {
            Inner::Sqlx(tx) => tx,
            Inner::Raw(raw) => raw.conn.as_mut().map_or_else(|| gone(), |c| &mut **c),
        }
    }
}

/// A raw transaction's connection is only taken by the methods that
/// consume the transaction, so a live `ClaimTx` always has one.
#[allow(clippy::panic)]
fn gone() -> ! {
    panic!("onceonly: a claim transaction was used after it ended")
}
