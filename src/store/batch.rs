//! In-batch duplicate handling shared by every backend's batch claim.

use std::collections::HashMap;

use super::claim::Existing;
use super::{Claim, ClaimRequest, ClaimTimes, StoreError};

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

/// What an optimistic batch's look-up decides, from the unexpired records
/// `found` of the batch's keys (by key): [`Claim::Claimed`] for a key that
/// is free to run (absent or expired; its claim comes with its result,
/// after the handler), a duplicate or conflict for a stored key, and for a
/// later occurrence in the batch what it would be against the record its
/// key ends up with (its first occurrence's, or the stored one).
pub(crate) fn looked_up(
    reqs: &[ClaimRequest<'_>],
    times: ClaimTimes,
    found: &HashMap<String, Existing>,
) -> Result<Vec<Claim>, StoreError> {
    let plan = plan_batch(reqs);
    let live = |key: &str| found.get(key).filter(|e| e.expires_at_ms > times.now_ms);
    let mut claims = plan.claims;
    let mut first_of: HashMap<&str, usize> = HashMap::with_capacity(plan.firsts.len());
    for &i in &plan.firsts {
        let req = &reqs[i];
        first_of.insert(req.key, i);
        claims[i] = Some(match live(req.key) {
            Some(e) => e.clone().classify(req)?,
            None => Claim::Claimed,
        });
    }
    for &i in &plan.repeats {
        let req = &reqs[i];
        claims[i] = Some(match live(req.key) {
            Some(e) => e.clone().classify(req)?,
            // The first occurrence runs: its fingerprint is the record's.
            None => Claim::Conflict {
                stored: first_of
                    .get(req.key)
                    .and_then(|&first| reqs[first].fingerprint.copied()),
            },
        });
    }
    finish(claims)
}
