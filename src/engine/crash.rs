//! Messages that kill the process: counting the handler starts of
//! *suspect* deliveries, and parking a delivery that crashed the process
//! too often.
//!
//! A delivery is a suspect when it may be a redelivery of a message whose
//! handler was running when the process died ([`Delivery::with_suspect`]:
//! the transports decide, at no cost). For a suspect whose key is new, the
//! claim ([`Engine::claim_with`]) works in this order:
//!
//! 1. claim as usual: a duplicate or a conflict ends there, uncounted;
//! 2. a new key: roll that claim back and wait for the engine's *gate*
//!    exclusively, so that no other handler of this engine runs while the
//!    suspect's does (a crash is then the suspect's own, never blamed on the
//!    messages that happened to run beside it);
//! 3. count the start: one autocommit statement on its own pool connection
//!    ([`SqlStore::bump_attempts`]), committed before the handler runs (on
//!    SQLite, the single writer, no claim transaction may be open then:
//!    hence the order). A count of [`EngineBuilder::max_crashes`] + 1 or
//!    more means the handler was started `max_crashes` times before and
//!    the process died each time: the counter is deleted and the claim reports
//!    [`Claimed::Crashed`] ([`Failure::Crashed`], dead-lettered `crashed`);
//! 4. claim again and run the handler. Success deletes the counter inside
//!    the claim's transaction; a handler that returns (an error, a panic) or
//!    a session dropped unfinished (a revoke) takes its start back
//!    ([`SqlStore::undo_attempt`]), since that start did not crash the
//!    process. The count is therefore the number of starts the process did
//!    not survive, plus the one running.
//!
//! Healthy deliveries pay nothing but an uncontended shared lock of the
//! gate: no round trip.
//!
//! What runs for a delivery before its key is known (the payload decoder,
//! the key, the fence, the handler's input type) may kill the process too
//! (a decoder that runs out of memory, a native abort). A suspect's early
//! stages are therefore counted as well, alone under the exclusive gate,
//! under a counter named by the digest of its payload (the only name it
//! has before decoding, [`Engine::count_early`]): started
//! [`EngineBuilder::max_crashes`] times without the process surviving, it
//! is parked `crashed` without decoding it again; once those stages
//! returned, the start is taken back and the claim counts as above.
//!
//! [`Delivery::with_suspect`]: crate::Delivery::with_suspect
//! [`SqlStore::bump_attempts`]: crate::store::SqlStore::bump_attempts
//! [`SqlStore::undo_attempt`]: crate::store::SqlStore::undo_attempt
//! [`EngineBuilder::max_crashes`]: super::EngineBuilder::max_crashes
//! [`Claimed::Crashed`]: super::Claimed::Crashed
//! [`Failure::Crashed`]: super::Failure::Crashed

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

use super::Engine;
use crate::store::{ClaimTimes, SqlStore, StoreError};
use crate::sync::lock;

/// The default [`EngineBuilder::max_crashes`](super::EngineBuilder::max_crashes): 3.
pub(crate) const DEFAULT_MAX_CRASHES: u32 = 3;

/// What the engine keeps for crash counting.
#[derive(Default)]
pub(super) struct Crashes {
    /// Shared by every claim, exclusive for a counted suspect.
    gate: Arc<RwLock<()>>,
    /// `(scope, key)` of counted starts this process could not take back
    /// (the database failed): its count already includes this process, so
    /// the next start here is not counted again.
    owed: Mutex<HashSet<(String, String)>>,
}

/// A claim's hold on the engine's gate, released with its session.
pub(super) enum Gate {
    /// Any number of claims at once.
    Shared(#[allow(dead_code)] OwnedRwLockReadGuard<()>),
    /// A counted suspect, alone.
    Exclusive(#[allow(dead_code)] OwnedRwLockWriteGuard<()>),
}

/// What counting a suspect's start found.
pub(super) enum Start<S: SqlStore> {
    /// Counted: run the handler.
    Counted(Counted<S>),
    /// Started this many times already, each time the process died.
    Crashed(u32),
}

/// A counted start of a suspect's handler. Settle it with
/// [`finished`](Counted::finished) (its counter was deleted in the claim's
/// transaction) or [`undo`](Counted::undo); dropped unsettled (the
/// session was dropped: a revoke, a shutdown), the start is taken back in
/// the background.
pub(super) struct Counted<S: SqlStore> {
    engine: Engine<S>,
    scope: String,
    key: String,
    armed: bool,
}

impl<S: SqlStore> Counted<S> {
    /// The handler succeeded and its commit deleted the counter.
    pub(super) fn finished(mut self) {
        self.armed = false;
    }

    /// The handler returned without success: this start did not crash
    /// the process.
    pub(super) async fn undo(mut self) {
        self.armed = false;
        self.engine.undo_start(&self.scope, &self.key).await;
    }
}

impl<S: SqlStore> Drop for Counted<S> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // A process that is dying runs nothing more: only starts that the
        // process survived are taken back.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            let (scope, key) = (
                std::mem::take(&mut self.scope),
                std::mem::take(&mut self.key),
            );
            runtime.spawn(async move { engine.undo_start(&scope, &key).await });
        }
    }
}

/// A suspect's counted early stages (decoding, key, fence, input), alone
/// under the exclusive gate. [`survived`](EarlyStart::survived) once they
/// returned; dropped (an early return, a panic), the start is taken back
/// in the background, since the process survived it.
pub(super) struct EarlyStart<S: SqlStore> {
    counted: Counted<S>,
    _gate: Gate,
}

impl<S: SqlStore> EarlyStart<S> {
    /// The early stages returned: the start is taken back and the gate
    /// let go (the claim counts the handler's start on its own).
    pub(super) async fn survived(self) {
        self.counted.undo().await;
    }
}

impl<S: SqlStore> Engine<S> {
    /// Counts the start of a suspect's early stages (see the
    /// [module](self)): `None` for a delivery that is not a suspect (no
    /// round trip), the counted start, or the crashes it caused already
    /// when it is to be parked (its counter deleted, so that a replay of
    /// its dead letter starts over).
    pub(super) async fn count_early(
        &self,
        delivery: &crate::Delivery,
    ) -> Result<Option<EarlyStart<S>>, super::Failure> {
        use sha2::Digest as _;
        if !delivery.is_suspect() {
            return Ok(None);
        }
        let inner = &*self.inner;
        let gate = self.exclusive_gate().await;
        let digest = hex::encode(sha2::Sha256::digest(delivery.payload()));
        let counter = crate::store::internal_key("early", &digest);
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        match self.count_start(&inner.scope, &counter, times).await {
            Ok(Start::Counted(counted)) => Ok(Some(EarlyStart {
                counted,
                _gate: gate,
            })),
            Ok(Start::Crashed(crashes)) => Err(super::Failure::Crashed { crashes }),
            Err(e) => Err(super::Failure::Store(e)),
        }
    }

    /// Waits for a shared hold of the gate.
    pub(super) async fn shared_gate(&self) -> Gate {
        Gate::Shared(Arc::clone(&self.inner.crashes.gate).read_owned().await)
    }

    /// Waits until no other claim of this engine holds the gate.
    pub(super) async fn exclusive_gate(&self) -> Gate {
        Gate::Exclusive(Arc::clone(&self.inner.crashes.gate).write_owned().await)
    }

    /// Counts a start of `key`'s handler (see the [module](self)).
    pub(super) async fn count_start(
        &self,
        scope: &str,
        key: &str,
        times: ClaimTimes,
    ) -> Result<Start<S>, StoreError> {
        let inner = &*self.inner;
        let owed = (scope.to_owned(), key.to_owned());
        let counted = Counted {
            engine: self.clone(),
            scope: owed.0.clone(),
            key: owed.1.clone(),
            armed: true,
        };
        if lock(&inner.crashes.owed).remove(&owed) {
            // Counted already by this process, and never taken back.
            return Ok(Start::Counted(counted));
        }
        let mut counted = counted;
        let starts = match inner.store.bump_attempts(scope, key, times).await {
            Ok(starts) => starts,
            Err(e) => {
                counted.armed = false;
                return Err(e);
            }
        };
        let crashes = starts.saturating_sub(1);
        if crashes < inner.max_crashes {
            if crashes > 0 {
                tracing::warn!(
                    crashes,
                    max_crashes = inner.max_crashes,
                    "a redelivered message whose handler was running when the process died is started again"
                );
            }
            return Ok(Start::Counted(counted));
        }
        counted.armed = false;
        tracing::error!(
            crashes,
            reason = "crashed",
            "the process died every time this message's handler ran; dead-lettering it"
        );
        // A dead letter starts over: a replay of it gets its own attempts.
        self.forget_counter(scope, key).await;
        Ok(Start::Crashed(crashes))
    }

    /// Deletes the attempts-table counter `key` of `scope` (a parked
    /// delivery's, so that a replay of its dead letter starts over; a
    /// Kafka partition's batch mark), on a connection of its own, bounded
    /// by the pool's acquire timeout and the statement deadline. A failure
    /// is logged only: the counter expires with the dedup window.
    pub(crate) async fn forget_counter(&self, scope: &str, key: &str) {
        let store = &self.inner.store;
        let cleared = async {
            let mut conn = store.pool().acquire().await?;
            store.clear_attempts(&mut *conn, scope, key).await
        };
        if let Err(e) = cleared.await {
            tracing::warn!(error = %e, "could not delete an attempts-table counter; it expires with the dedup window");
        }
    }

    /// Takes a counted start back; if the database cannot, remembers that
    /// this process's start is still counted.
    async fn undo_start(&self, scope: &str, key: &str) {
        if let Err(e) = self.inner.store.undo_attempt(scope, key).await {
            tracing::warn!(error = %e, "could not take back a counted start of a suspect; the next start in this process is not counted again");
            lock(&self.inner.crashes.owed).insert((scope.to_owned(), key.to_owned()));
        }
    }
}
