//! The claim algorithm, written once for every backend
//! ([`SqlBase::claim`](super::base::SqlBase::claim)):
//!
//! 1. Insert the record unless the key exists (the unique index serializes
//!    concurrent inserts: a second inserter waits for the first transaction
//!    and then sees a conflict, or proceeds if it rolled back).
//! 2. Otherwise read the committed record: unexpired → duplicate or conflict.
//! 3. Expired → overwrite it with a conditional update that only matches a
//!    still-expired record; if a concurrent reclaimer won, go round again.
//!
//! This module holds what step 2 reads and how it decides.

use super::{Claim, ClaimRequest, StoreError, classify_existing};
use crate::fingerprint::Fingerprint;

/// The parts of a committed record a claim needs.
#[derive(Clone)]
pub(crate) struct Existing {
    pub fingerprint: Option<Vec<u8>>,
    pub result: Option<Vec<u8>>,
    pub expires_at_ms: i64,
}

impl Existing {
    /// Duplicate or conflict, for an unexpired record.
    pub(crate) fn classify(self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let stored = match self.fingerprint {
            None => None,
            Some(bytes) => Some(Fingerprint::from_slice(&bytes).ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "a stored fingerprint has {} bytes, expected 32",
                    bytes.len()
                ))
            })?),
        };
        Ok(classify_existing(stored, self.result, req))
    }
}
