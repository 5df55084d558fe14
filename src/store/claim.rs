//! The claim algorithm, written once for every backend.
//!
//! 1. Insert the record unless the key exists (the unique index serializes
//!    concurrent inserts: a second inserter waits for the first transaction
//!    and then sees a conflict, or proceeds if it rolled back).
//! 2. Otherwise read the committed record: unexpired → duplicate or conflict.
//! 3. Expired → overwrite it with a conditional update that only matches a
//!    still-expired record; if a concurrent reclaimer won, go round again.

use async_trait::async_trait;

#[cfg(any(feature = "mysql", feature = "sqlite"))]
use super::plan_batch;
use super::{CLAIM_ROUNDS, Claim, ClaimRequest, ClaimTimes, StoreError, classify_existing};
use crate::fingerprint::Fingerprint;

/// The parts of a committed record a claim needs.
pub(crate) struct Existing {
    pub fingerprint: Option<Vec<u8>>,
    pub result: Option<Vec<u8>>,
    pub expires_at_ms: i64,
}

impl Existing {
    pub(crate) fn classify(self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let stored = match self.fingerprint {
            None => None,
            Some(bytes) => Some(Fingerprint::from_slice(&bytes).ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "fingerprint of key {:?} has {} bytes, expected 32",
                    req.key,
                    bytes.len()
                ))
            })?),
        };
        Ok(classify_existing(stored, self.result, req))
    }
}

/// The three statements of a claim, per backend.
#[async_trait]
pub(crate) trait ClaimSteps: Send + Sync {
    type Conn: Send;

    /// Inserts the record; `false` if the key already exists.
    async fn insert(
        &self,
        conn: &mut Self::Conn,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError>;

    /// Reads the latest committed record of the key.
    async fn existing(
        &self,
        conn: &mut Self::Conn,
        scope: &str,
        key: &str,
    ) -> Result<Option<Existing>, StoreError>;

    /// Overwrites the record if it is still expired at `times.now_ms`.
    async fn reclaim(
        &self,
        conn: &mut Self::Conn,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError>;
}

pub(crate) async fn claim_one<S: ClaimSteps>(
    steps: &S,
    conn: &mut S::Conn,
    scope: &str,
    times: ClaimTimes,
    req: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    for _ in 0..CLAIM_ROUNDS {
        if steps.insert(conn, scope, times, req).await? {
            return Ok(Claim::Claimed);
        }
        match steps.existing(conn, scope, req.key).await? {
            // Purged between our insert and our read: insert again.
            None => continue,
            Some(found) if found.expires_at_ms > times.now_ms => return found.classify(req),
            Some(_) => {
                if steps.reclaim(conn, scope, times, req).await? {
                    return Ok(Claim::Claimed);
                }
            }
        }
    }
    Err(StoreError::Contention(req.key.to_owned()))
}

/// Batch claim as a sequence of single claims in the caller's transaction,
/// for backends without `INSERT ... RETURNING` of conflicting rows or where
/// statements are cheap (SQLite is in-process).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) async fn claim_each<S: ClaimSteps>(
    steps: &S,
    conn: &mut S::Conn,
    scope: &str,
    times: ClaimTimes,
    reqs: &[ClaimRequest<'_>],
) -> Result<Vec<Claim>, StoreError> {
    let plan = plan_batch(reqs);
    let mut claims = plan.claims;
    for i in plan.firsts.into_iter().chain(plan.repeats) {
        claims[i] = Some(claim_one(steps, conn, scope, times, &reqs[i]).await?);
    }
    super::batch::finish(claims)
}
