//! Batch processing: many deliveries, one transaction, one batch claim.
//!
//! The fast path claims every key with [`SqlStore::claim_batch`], runs the
//! handler for the new ones in delivery order on the same transaction, and
//! commits once. If anything in the batch fails (a handler error or panic, a
//! store error), the whole transaction rolls back, so no claim and no write
//! of it remains, and every delivery is then processed on its own with
//! [`Engine::process`]: one poison message neither blocks nor doubles the
//! others.

use super::fence::FenceCheck;
use super::{
    Engine, Failure, FromDelivery, Handler, Origin, Outcome, Report, Tx, decode_stored, report,
    settled,
};
use crate::delivery::Delivery;
use crate::fingerprint::Fingerprint;
use crate::key::{FenceValue, IdemKey};
use crate::store::{Claim, ClaimRequest, ClaimTimes, ClaimTx, Completed, SqlStore, StoreError};
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use tracing::{Instrument, Span};

/// A delivery that passed key derivation and decoding.
struct Ready<'d, I> {
    index: usize,
    delivery: &'d Delivery,
    key: IdemKey,
    fingerprint: Option<Fingerprint>,
    fence: Option<FenceValue>,
    input: Option<I>,
    span: Span,
}

impl<S: SqlStore> Engine<S> {
    /// Processes `deliveries` in one transaction where possible; returns one
    /// report per delivery, in order. If anything in the batch fails, the
    /// transaction rolls back and every delivery is processed on its own.
    pub async fn process_batch<H>(
        &self,
        handler: &H,
        deliveries: &[Delivery],
    ) -> Vec<Report<H::Output>>
    where
        H: Handler<S::Db>,
    {
        match self.try_process_batch(handler, deliveries).await {
            Some(reports) => reports,
            None => {
                let mut reports = Vec::with_capacity(deliveries.len());
                for delivery in deliveries {
                    reports.push(self.process(handler, delivery).await);
                }
                reports
            }
        }
    }

    /// The single-transaction part of [`Engine::process_batch`], without the
    /// fallback (`None` at once if a delivery is a
    /// [suspect](Delivery::with_suspect): those are processed one by one): `Some` with one report per delivery, in order, when the
    /// batch transaction committed (deliveries without a valid key or input
    /// are `Rejected` and took no part in it); `None` when it rolled back, so
    /// that nothing of the batch took effect and the caller can process the
    /// deliveries one by one in its own order (a transport that must keep
    /// order settles each before starting the next).
    pub async fn try_process_batch<H>(
        &self,
        handler: &H,
        deliveries: &[Delivery],
    ) -> Option<Vec<Report<H::Output>>>
    where
        H: Handler<S::Db>,
    {
        // A panic in user code (key function, decoder, handler, result
        // encoding) rolls the batch back; one by one, each delivery then
        // settles on its own.
        match AssertUnwindSafe(self.try_batch_caught(handler, deliveries))
            .catch_unwind()
            .await
        {
            Ok(reports) => reports,
            Err(_) => {
                tracing::debug!("panic inside a batch, processing one by one");
                None
            }
        }
    }

    async fn try_batch_caught<H>(
        &self,
        handler: &H,
        deliveries: &[Delivery],
    ) -> Option<Vec<Report<H::Output>>>
    where
        H: Handler<S::Db>,
    {
        // Suspects are counted and run alone, one by one.
        if deliveries.iter().any(Delivery::is_suspect) {
            return None;
        }
        let mut reports: Vec<Option<Report<H::Output>>> = deliveries.iter().map(|_| None).collect();
        let spans: Vec<Span> = deliveries.iter().map(|d| self.delivery_span(d)).collect();
        // Decoded first, outside the transaction; a decoder that cannot
        // reach its registry sends the batch one by one, where each
        // delivery waits.
        let mut decoded = Vec::with_capacity(deliveries.len());
        for ((index, delivery), span) in deliveries.iter().enumerate().zip(&spans) {
            match self.decoded(delivery).instrument(span.clone()).await {
                Ok(delivery) => decoded.push(Some(delivery)),
                Err(Outcome::Failed(_)) => return None,
                Err(outcome) => {
                    reports[index] = Some(report(None, outcome));
                    decoded.push(None);
                }
            }
        }
        let mut ready = Vec::with_capacity(deliveries.len());
        for ((index, delivery), span) in decoded.iter().enumerate().zip(&spans) {
            let Some(delivery) = delivery.as_deref() else {
                continue;
            };
            let key = match self.inner.key.derive(delivery) {
                Ok(key) => key,
                Err(e) => {
                    reports[index] = Some(report(None, Outcome::Rejected(e.into())));
                    continue;
                }
            };
            self.inner.telemetry.record_key(span, key.as_str());
            let fingerprint = self.inner.fingerprint.compute(delivery);
            let fence = match self.fence_of(delivery) {
                Ok(fence) => fence,
                Err(e) => {
                    let outcome = self
                        .settled_or(&key, fingerprint.as_ref(), delivery, e.into())
                        .instrument(span.clone())
                        .await;
                    reports[index] = Some(report(Some(key), outcome));
                    continue;
                }
            };
            let req = ClaimRequest {
                key: key.as_str(),
                fingerprint: fingerprint.as_ref(),
                source: delivery.source(),
                lock_wait: None,
            };
            if let Some(hit) = self.cached_claim(&self.inner.scope, &req).await {
                let outcome = settled(hit, fingerprint.as_ref());
                reports[index] = Some(report(Some(key), outcome));
                continue;
            }
            match H::Input::from_delivery(delivery) {
                Ok(input) => ready.push(Ready {
                    index,
                    delivery,
                    fingerprint,
                    fence,
                    key,
                    input: Some(input),
                    span: span.clone(),
                }),
                Err(e) => {
                    let outcome = self
                        .settled_or(&key, fingerprint.as_ref(), delivery, e.into())
                        .instrument(span.clone())
                        .await;
                    reports[index] = Some(report(Some(key), outcome));
                }
            }
        }
        if !ready.is_empty() {
            let outcomes = self.batch_attempt(handler, &mut ready).await?;
            for (item, outcome) in ready.iter().zip(outcomes) {
                reports[item.index] = Some(report(Some(item.key.clone()), outcome));
            }
        }
        let reports: Vec<_> = reports.into_iter().flatten().collect();
        // Counted only once the batch committed; a rolled-back batch is
        // counted delivery by delivery by whoever processes it next.
        for (report, span) in reports.iter().zip(&spans) {
            self.inner.telemetry.outcome(span, report.outcome.kind());
        }
        Some(reports)
    }

    /// The single-transaction path; `None` means "rolled back, go one by one".
    async fn batch_attempt<H>(
        &self,
        handler: &H,
        ready: &mut [Ready<'_, H::Input>],
    ) -> Option<Vec<Outcome<H::Output>>>
    where
        H: Handler<S::Db>,
    {
        let inner = &*self.inner;
        // Held until the batch ends: no suspect runs beside it.
        let _gate = self.shared_gate().await;
        let began = std::time::Instant::now();
        let mut tx = ClaimTx::new(inner.store.begin().await.ok()?, began);
        let times = ClaimTimes::new(inner.clock.now_ms(), inner.retention);
        let claims = {
            let reqs: Vec<ClaimRequest<'_>> = ready
                .iter()
                .map(|r| ClaimRequest {
                    key: r.key.as_str(),
                    fingerprint: r.fingerprint.as_ref(),
                    source: r.delivery.source(),
                    lock_wait: None,
                })
                .collect();
            // Optimistic: only looked up now, claimed with the results.
            let claims = if inner.optimistic {
                inner
                    .store
                    .lookup_batch(&mut tx, &inner.scope, times, &reqs)
                    .await
            } else {
                inner
                    .store
                    .claim_batch(&mut tx, &inner.scope, times, &reqs)
                    .await
            };
            match claims {
                Ok(claims) => {
                    inner.telemetry.claim_time(began.elapsed());
                    claims
                }
                Err(e) => {
                    tracing::debug!(error = %e, "batch claim failed, processing one by one");
                    self.rollback(tx).await;
                    return None;
                }
            }
        };
        // Borrows of the entries' fences only: inputs need not be `Sync`.
        let fenced: Vec<(usize, &FenceValue)> = ready
            .iter()
            .zip(&claims)
            .enumerate()
            .filter_map(|(i, (item, claim))| match (claim, &item.fence) {
                (Claim::Claimed, Some(fence)) => Some((i, fence)),
                _ => None,
            })
            .collect();
        let checks = match self.batch_fences(&mut tx, times, ready.len(), fenced).await {
            Ok(checks) => checks,
            Err(e) => {
                tracing::debug!(error = %e, "a batch's fences failed, processing one by one");
                self.rollback(tx).await;
                return None;
            }
        };
        let bound = inner.store.deadlines().transaction_deadline();
        let origin = Origin::new(&inner.scope, "", None, times.now_ms);
        let tx = Tx::new(
            tx,
            origin,
            began,
            bound,
            std::sync::Arc::clone(&inner.steps),
        );
        let passes_stale = inner.fence.as_ref().is_some_and(|f| f.passes_stale());
        let mut outcomes = Vec::with_capacity(ready.len());
        let mut stored: Vec<Option<Vec<u8>>> = vec![None; ready.len()];
        for (i, ((item, claim), check)) in ready.iter_mut().zip(claims).zip(checks).enumerate() {
            let stale = check
                .as_ref()
                .filter(|c| c.is_stale() && !passes_stale)
                .map(FenceCheck::stale);
            // A stale key whose step ran is not closed as stale: one by
            // one, its handler runs (see `Engine::fenced`).
            if stale.is_some()
                && !matches!(
                    self.has_finished_steps(&inner.scope, item.key.as_str(), times.now_ms)
                        .await,
                    Ok(false)
                )
            {
                tracing::debug!(parent: &item.span, "a stale key with finished steps in a batch, processing one by one");
                if let Some(tx) = tx.take(Tx::<S::Db>::RETURN_TIMEOUT).await {
                    self.rollback(tx).await;
                }
                return None;
            }
            let outcome = match (claim, stale) {
                // Recorded as stale with the batch's results.
                (Claim::Claimed, Some(stale)) => {
                    stored[i] = Some(stale.recorded());
                    Outcome::Stale(stale)
                }
                (Claim::Claimed, None) => {
                    // Each entry is claimed at most once, so its input is there.
                    let run = match item.input.take() {
                        Some(input) => {
                            // Results are recorded together, below.
                            let origin = Origin::new(
                                &inner.scope,
                                item.key.as_str(),
                                super::session::traceparent_of(item.delivery),
                                times.now_ms,
                            )
                            .with_fingerprint(item.fingerprint);
                            if let Some(check) = check {
                                origin.set_fence(check);
                            }
                            self.run_handler(tx.for_origin(origin), handler, item.delivery, input)
                                .instrument(item.span.clone())
                                .await
                        }
                        None => Err(Failure::Store(StoreError::Corrupt(
                            "batch entry claimed twice".into(),
                        ))),
                    };
                    match run {
                        Ok((output, bytes)) => {
                            stored[i] = Some(bytes);
                            Outcome::Processed { result: output }
                        }
                        Err(failure) => {
                            tracing::debug!(parent: &item.span, error = %failure, "failure inside a batch, processing one by one");
                            if let Some(tx) = tx.take(Tx::<S::Db>::RETURN_TIMEOUT).await {
                                self.rollback(tx).await;
                            }
                            return None;
                        }
                    }
                }
                // A repeat inside the batch shares the fate of its first
                // occurrence: a duplicate of what it stored, or the same conflict.
                (Claim::InBatch { first }, _) => match outcomes.get(first) {
                    Some(Outcome::Conflict { stored, .. }) => Outcome::Conflict {
                        stored: *stored,
                        received: item.fingerprint,
                    },
                    Some(Outcome::Stale(stale)) => Outcome::Stale(stale.clone()),
                    _ => Outcome::Duplicate {
                        result: stored
                            .get(first)
                            .and_then(Option::as_deref)
                            .and_then(decode_stored),
                    },
                },
                (other, _) => {
                    if let Claim::Duplicate { result } = &other {
                        stored[i].clone_from(result);
                    }
                    settled(other, item.fingerprint.as_ref())
                }
            };
            outcomes.push(outcome);
        }
        // A handler that kept the transaction: it rolls back when let go.
        let mut tx = tx.take(Tx::<S::Db>::RETURN_TIMEOUT).await?;
        // Every new key's result in one statement where the backend can.
        // Borrows of the items' fields, not of the items: inputs need not
        // be `Sync`.
        let processed: Vec<(ClaimRequest<'_>, &[u8])> = ready
            .iter()
            .zip(&stored)
            .zip(&outcomes)
            .filter_map(|((item, bytes), outcome)| match (bytes, outcome) {
                (Some(bytes), Outcome::Processed { .. } | Outcome::Stale(_)) => Some((
                    ClaimRequest {
                        key: item.key.as_str(),
                        fingerprint: item.fingerprint.as_ref(),
                        source: item.delivery.source(),
                        lock_wait: None,
                    },
                    bytes.as_slice(),
                )),
                _ => None,
            })
            .collect();
        let recorded = if inner.optimistic {
            self.claim_processed(&mut tx, times, &processed).await
        } else {
            let results: Vec<(&str, &[u8])> = processed
                .iter()
                .map(|(req, bytes)| (req.key, *bytes))
                .collect();
            inner
                .store
                .complete_many(&mut tx, &inner.scope, &results)
                .await
        };
        if let Err(e) = recorded {
            tracing::debug!(error = %e, "recording a batch's results failed, processing one by one");
            self.rollback(tx).await;
            return None;
        }
        // A failed commit is ambiguous; processing one by one settles it:
        // committed keys come back as duplicates, the others are processed.
        self.commit(tx).await.ok()?;
        // Owned copies: inputs need not be `Sync`, so no reference to
        // `ready` is held across the awaits.
        let done: Vec<(IdemKey, Option<Fingerprint>, Vec<u8>)> = ready
            .iter()
            .zip(stored)
            .zip(&outcomes)
            .filter_map(|((item, bytes), outcome)| match (bytes, outcome) {
                (Some(bytes), Outcome::Processed { .. } | Outcome::Stale(_)) => {
                    Some((item.key.clone(), item.fingerprint, bytes))
                }
                _ => None,
            })
            .collect();
        for (key, fingerprint, bytes) in &done {
            self.tell_tier(&Completed {
                scope: &inner.scope,
                key: key.as_str(),
                fingerprint: fingerprint.as_ref(),
                result: bytes,
                now_ms: times.now_ms,
                expires_at_ms: times.expires_at_ms,
            })
            .await;
        }
        Some(outcomes)
    }

    /// Passes the batch's new keys (`fenced`: entry index and fence)
    /// through their entities' fences, in the batch's transaction, ordered
    /// by entity (so that two batches lock fences in the same order), each
    /// entity's deliveries in delivery order: what the fence found for
    /// each of the `entries` (`None` for an entry without a fence or not
    /// claimed).
    async fn batch_fences(
        &self,
        tx: &mut ClaimTx<S::Db>,
        times: ClaimTimes,
        entries: usize,
        mut order: Vec<(usize, &FenceValue)>,
    ) -> Result<Vec<Option<FenceCheck>>, StoreError> {
        let scope = &self.inner.scope;
        let mut checks = vec![None; entries];
        order.sort_by(|a, b| a.1.entity.cmp(&b.1.entity).then(a.0.cmp(&b.0)));
        for (i, fence) in order {
            checks[i] = Some(self.pass_fence(tx, scope, fence, times.now_ms).await?);
        }
        Ok(checks)
    }

    /// An optimistic batch's claim, after its handlers ran: every processed
    /// key with its result ([`SqlStore::claim_completed_batch`]). A key
    /// committed meanwhile by another transaction is an error here: the
    /// batch rolls back, and one by one that delivery is a duplicate.
    async fn claim_processed(
        &self,
        tx: &mut ClaimTx<S::Db>,
        times: ClaimTimes,
        processed: &[(ClaimRequest<'_>, &[u8])],
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let reqs: Vec<ClaimRequest<'_>> = processed.iter().map(|(req, _)| *req).collect();
        let results: Vec<&[u8]> = processed.iter().map(|(_, bytes)| *bytes).collect();
        let claims = inner
            .store
            .claim_completed_batch(tx, &inner.scope, times, &reqs, &results)
            .await?;
        if claims.iter().all(|c| *c == Claim::Claimed) {
            Ok(())
        } else {
            Err(StoreError::Contention)
        }
    }
}
