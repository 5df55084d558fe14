//! The per-entity fence, as the engine runs it: a second claim in the
//! claim's transaction, on the entity a delivery is about and its order
//! (see [`FenceSpec`](crate::FenceSpec)). A delivery whose order is lower
//! than the highest applied for its entity is *stale*: recorded under its
//! key as stale (so that its redeliveries are answered without the fence),
//! acknowledged, and its handler not run, unless the fence
//! [passes stale deliveries](crate::FenceSpec::pass_stale) to the handler,
//! which then reads [`Tx::fence`](crate::Tx::fence) and decides.

use serde::{Deserialize, Serialize};
use sqlx::Database;

use super::Engine;
use super::session::millis;
use crate::key::{FenceValue, Order};
use crate::store::{SqlStore, StoreError};

/// What the fence found for a delivery: its entity, its order and the
/// order the entity's fence holds once it passed (in the claim's
/// transaction). Read it in a handler with [`Tx::fence`](crate::Tx::fence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceCheck {
    entity: String,
    received: Order,
    current: Order,
}

impl FenceCheck {
    pub(crate) fn new(entity: String, received: Order, current: Order) -> Self {
        Self {
            entity,
            received,
            current,
        }
    }

    /// The entity the delivery is about.
    pub fn entity(&self) -> &str {
        &self.entity
    }

    /// The delivery's order.
    pub fn received(&self) -> &Order {
        &self.received
    }

    /// The highest order applied to the entity, this delivery's included
    /// when it is not stale.
    pub fn current(&self) -> &Order {
        &self.current
    }

    /// Whether a delivery of a higher order was applied before: this one
    /// is older than the entity's state.
    pub fn is_stale(&self) -> bool {
        self.received < self.current
    }

    /// The check as a stale outcome.
    pub(crate) fn stale(&self) -> Stale {
        Stale {
            entity: self.entity.clone(),
            received: self.received.clone(),
            current: self.current.clone(),
        }
    }
}

impl<S: SqlStore> Engine<S> {
    /// Passes `value` through its entity's fence in `scope`, on the
    /// claim's transaction `conn`, at `now_ms` (the fence then expires
    /// after the engine's fence retention): what the fence found. The one
    /// place single claims and batches advance a fence.
    pub(super) async fn pass_fence(
        &self,
        conn: &mut <S::Db as Database>::Connection,
        scope: &str,
        value: &FenceValue,
        now_ms: i64,
    ) -> Result<FenceCheck, StoreError> {
        let inner = &*self.inner;
        let expires_at_ms = now_ms.saturating_add(millis(inner.fence_retention));
        let entity = value.entity.as_str();
        let current = inner
            .store
            .advance_fence(
                conn,
                scope,
                entity,
                value.order.as_bytes(),
                expires_at_ms,
                now_ms,
            )
            .await?;
        Ok(FenceCheck::new(
            entity.to_owned(),
            value.order.clone(),
            Order::from_bytes(current),
        ))
    }
}

/// A stale delivery: a delivery of a higher order was applied to its
/// entity before. See [`Outcome::Stale`](crate::Outcome::Stale).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stale {
    /// The entity the delivery is about.
    pub entity: String,
    /// The delivery's order.
    pub received: Order,
    /// The higher order applied before it.
    pub current: Order,
}

/// The result a stale delivery's key is recorded with: a prefix no JSON
/// text and no stored HTTP response starts with (a NUL byte), then the
/// stale outcome as JSON.
const MARKER: &[u8] = b"\0onceonly:stale\0";

#[derive(Serialize, Deserialize)]
struct Recorded {
    entity: String,
    received: String,
    current: String,
}

impl Stale {
    /// The result a stale delivery's key is recorded with.
    pub(crate) fn recorded(&self) -> Vec<u8> {
        let recorded = Recorded {
            entity: self.entity.clone(),
            received: hex::encode(self.received.as_bytes()),
            current: hex::encode(self.current.as_bytes()),
        };
        let mut bytes = MARKER.to_vec();
        // A struct of strings always serializes.
        bytes.extend(serde_json::to_vec(&recorded).unwrap_or_default());
        bytes
    }

    /// The stale outcome a key was recorded with, if `result` is one.
    pub fn from_recorded(result: &[u8]) -> Option<Self> {
        let json = result.strip_prefix(MARKER)?;
        let recorded: Recorded = serde_json::from_slice(json).ok()?;
        Some(Self {
            entity: recorded.entity,
            received: Order::from_bytes(hex::decode(recorded.received).ok()?),
            current: Order::from_bytes(hex::decode(recorded.current).ok()?),
        })
    }
}

/// Whether a stored result is a stale delivery's record.
pub(crate) fn is_recorded_stale(result: Option<&[u8]>) -> Option<Stale> {
    result.and_then(Stale::from_recorded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_record_round_trips_and_no_json_result_is_one() {
        let stale = Stale {
            entity: "pi_1".into(),
            received: Order::builder().integer(5).build(),
            current: Order::builder().integer(7).build(),
        };
        let recorded = stale.recorded();
        assert_eq!(Stale::from_recorded(&recorded), Some(stale));
        assert_eq!(Stale::from_recorded(br#"{"entity":"pi_1"}"#), None);
        assert_eq!(Stale::from_recorded(b"\"stale\""), None);
        assert_eq!(Stale::from_recorded(b""), None);
    }

    #[test]
    fn stale_only_below_the_current_order() {
        let o = |n| Order::builder().integer(n).build();
        assert!(FenceCheck::new("e".into(), o(1), o(2)).is_stale());
        assert!(!FenceCheck::new("e".into(), o(2), o(2)).is_stale());
    }
}
