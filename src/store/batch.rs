//! In-batch duplicate handling shared by every backend's batch claim.

use std::collections::HashMap;

use super::{Claim, ClaimRequest, StoreError};

/// The first occurrence of each key in a batch, and what the later ones are.
pub(crate) struct BatchPlan {
    /// Indexes of the first occurrence of each distinct key, in batch order.
    pub firsts: Vec<usize>,
    /// One slot per request: `Some` for later occurrences (already decided),
    /// `None` for first occurrences (to be claimed against the table).
    pub claims: Vec<Option<Claim>>,
}

/// Splits a batch into first occurrences and in-batch repeats. A repeat with
/// the same fingerprint is [`Claim::InBatch`], with another one [`Claim::Conflict`].
pub(crate) fn plan_batch(reqs: &[ClaimRequest<'_>]) -> BatchPlan {
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(reqs.len());
    let mut firsts = Vec::with_capacity(reqs.len());
    let mut claims = Vec::with_capacity(reqs.len());
    for (i, req) in reqs.iter().enumerate() {
        match seen.get(req.key) {
            None => {
                seen.insert(req.key, i);
                firsts.push(i);
                claims.push(None);
            }
            Some(&first) => {
                let first_fp = reqs[first].fingerprint;
                claims.push(Some(match (first_fp, req.fingerprint) {
                    (Some(a), Some(b)) if a != b => Claim::Conflict { stored: Some(*a) },
                    _ => Claim::InBatch { first },
                }));
            }
        }
    }
    BatchPlan { firsts, claims }
}

/// Unwraps the decided slots of a batch; every slot must have been decided.
pub(crate) fn finish(claims: Vec<Option<Claim>>) -> Result<Vec<Claim>, StoreError> {
    claims
        .into_iter()
        .map(|c| c.ok_or_else(|| StoreError::Corrupt("a batch entry was left undecided".into())))
        .collect()
}
