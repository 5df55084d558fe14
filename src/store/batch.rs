//! In-batch duplicate handling shared by every backend's batch claim.

use std::collections::HashMap;

use super::{Claim, ClaimRequest, StoreError};

/// The first occurrence of each key in a batch, and what the later ones are.
pub(crate) struct BatchPlan {
    /// Indexes of the first occurrence of each distinct key, in batch order.
    pub firsts: Vec<usize>,
    /// Indexes of later occurrences whose fingerprint differs from the first
    /// one's: each is claimed on its own *after* the firsts, so that it is
    /// compared with the record its key ends up with (the stored one, or the
    /// first occurrence's own claim), not with the first occurrence alone.
    pub repeats: Vec<usize>,
    /// One slot per request: `Some` for later occurrences with the first
    /// one's fingerprint (their outcome is the first one's), `None` for the
    /// others (to be claimed against the table).
    pub claims: Vec<Option<Claim>>,
}

/// Splits a batch into first occurrences, in-batch repeats that share the
/// first one's fate ([`Claim::InBatch`]), and repeats with another
/// fingerprint, which are claimed on their own.
pub(crate) fn plan_batch(reqs: &[ClaimRequest<'_>]) -> BatchPlan {
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(reqs.len());
    let mut firsts = Vec::with_capacity(reqs.len());
    let mut repeats = Vec::new();
    let mut claims = Vec::with_capacity(reqs.len());
    for (i, req) in reqs.iter().enumerate() {
        match seen.get(req.key) {
            None => {
                seen.insert(req.key, i);
                firsts.push(i);
                claims.push(None);
            }
            Some(&first) => match (reqs[first].fingerprint, req.fingerprint) {
                (Some(a), Some(b)) if a != b => {
                    repeats.push(i);
                    claims.push(None);
                }
                _ => claims.push(Some(Claim::InBatch { first })),
            },
        }
    }
    BatchPlan {
        firsts,
        repeats,
        claims,
    }
}

/// Unwraps the decided slots of a batch; every slot must have been decided.
pub(crate) fn finish(claims: Vec<Option<Claim>>) -> Result<Vec<Claim>, StoreError> {
    claims
        .into_iter()
        .map(|c| c.ok_or_else(|| StoreError::Corrupt("a batch entry was left undecided".into())))
        .collect()
}
