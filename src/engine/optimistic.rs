//! Optimistic claims ([`EngineBuilder::optimistic`](super::EngineBuilder::optimistic)):
//! the handler runs first, in a plain transaction, and the key is claimed
//! after it by the statement that also records the result
//! ([`SqlStore::claim_completed`]), just before `COMMIT`. A key found
//! there already rolls the transaction, the handler's writes with it,
//! back and settles as a duplicate or a conflict.

use std::time::Instant;

use super::session::{ending_failure, traceparent_of};
use super::{Engine, Failure, Handler, Origin, Outcome, Tx, settled};
use crate::delivery::Delivery;
use crate::fingerprint::Fingerprint;
use crate::key::IdemKey;
use crate::store::{
    Claim, ClaimRequest, ClaimTimes, ClaimTx, Completed, SqlStore, classify_existing,
};

impl<S: SqlStore> Engine<S> {
    /// One attempt of an optimistic engine (suspects excepted).
    pub(super) async fn attempt_optimistic<H>(
        &self,
        handler: &H,
        delivery: &Delivery,
        key: &IdemKey,
        fingerprint: Option<&Fingerprint>,
        input: H::Input,
    ) -> Outcome<H::Output>
    where
        H: Handler<S::Db>,
    {
        let inner = &*self.inner;
        let scope = inner.scope.as_str();
        let req = ClaimRequest {
            key: key.as_str(),
            fingerprint,
            source: delivery.source(),
            lock_wait: None,
        };
        if let Some(hit) = self.cached_claim(scope, &req).await {
            return settled(hit, fingerprint);
        }
        // Held until the attempt ends: no suspect runs beside it.
        let _gate = self.shared_gate().await;
        let began = Instant::now();
        let tx = match inner.store.begin().await {
            Ok(tx) => ClaimTx::new(tx, began),
            Err(e) => return Outcome::Failed(Failure::Store(e)),
        };
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let origin = Origin::new(scope, key.as_str(), traceparent_of(delivery), times.now_ms);
        let deadline = inner.store.deadlines().transaction_deadline();
        let tx = Tx::new(tx, origin, began, deadline);
        let ran = self.run_handler(tx.clone(), handler, delivery, input).await;
        let Some(mut open) = tx.take(Tx::<S::Db>::RETURN_TIMEOUT).await else {
            return Outcome::Failed(Failure::TxHeld);
        };
        let (output, bytes) = match ran {
            Ok(ran) => ran,
            Err(failure) => {
                self.rollback(open).await;
                return self.committed_meanwhile(&req, fingerprint, failure).await;
            }
        };
        let claim = inner
            .store
            .claim_completed(&mut open, scope, times, &req, &bytes)
            .await;
        match claim {
            Ok(Claim::Claimed) => {}
            Ok(found) => {
                self.rollback(open).await;
                return settled(found, fingerprint);
            }
            Err(e) => {
                self.rollback(open).await;
                return Outcome::Failed(ending_failure(e));
            }
        }
        if let Err(e) = self.commit(open).await {
            return Outcome::Failed(ending_failure(e));
        }
        self.tell_tier(&Completed {
            scope,
            key: key.as_str(),
            fingerprint,
            result: &bytes,
            now_ms: times.now_ms,
            expires_at_ms: times.expires_at_ms,
        })
        .await;
        Outcome::Processed { result: output }
    }

    /// The outcome of a failed optimistic attempt: a duplicate or conflict
    /// if the key was committed meanwhile (a concurrent copy of the
    /// delivery, whose writes may be what failed this handler), the
    /// failure otherwise.
    async fn committed_meanwhile<T: serde::de::DeserializeOwned>(
        &self,
        req: &ClaimRequest<'_>,
        fingerprint: Option<&Fingerprint>,
        failure: Failure,
    ) -> Outcome<T> {
        let inner = &*self.inner;
        match inner.store.get(&inner.scope, req.key).await {
            Ok(Some(record)) if record.expires_at_ms > inner.clock.now_ms() => settled(
                classify_existing(record.fingerprint, record.result, req),
                fingerprint,
            ),
            // Not committed (or unreadable now): the failure stands.
            _ => Outcome::Failed(failure),
        }
    }
}
