//! Per-entity fences: which entity a delivery is about ([`KeySpec`]) and
//! its order ([`OrderSpec`]), derived from the delivery alone (no I/O).
//! The engine keeps the highest order seen per (scope, entity) and calls a
//! delivery of a strictly lower order *stale*. The guide, with the
//! encoding, the string form and the providers' presets, is
//! `docs/fences.md`.
//!
//! - this module: [`FenceSpec`] (entity and order) and [`FenceValue`];
//! - `spec`: [`OrderSpec`], built, validated, derived and described;
//! - `component`: one component of an order spec, read and encoded;
//! - `parse`: the string form of an order spec, both ways;
//! - `time`: the timestamps a `timestamp:` component reads;
//! - `order`: the encoding, [`Order`] and [`OrderBuilder`];
//! - `decode`: an order read back without its spec ([`Order::decode`]).
//!
//! The providers' presets (`FenceSpec::stripe()`, ...) live with the
//! providers, in `http/providers/fence.rs` (feature `providers`).

mod component;
mod decode;
mod order;
mod parse;
mod spec;
mod time;

pub use decode::{DecodedOrder, OrderPart};
pub use order::{Order, OrderBuilder};
pub use spec::OrderSpec;

use super::{IdemKey, KeyError, KeySpec, KeySpecError};
use crate::delivery::Delivery;

/// The fence of a consumer or route: which entity a delivery is about
/// ([`KeySpec`], with all its limits) and its order ([`OrderSpec`]).
///
/// The engine keeps, per scope and entity, the highest order applied; a
/// delivery whose order is strictly lower is *stale*: acknowledged without
/// running the handler (unless the fence [passes stale
/// deliveries](Self::pass_stale)). An equal order is not stale. A fence is
/// for handlers that apply the state a delivery describes; see the guide
/// (`docs/fences.md`) for the presets' fields and the retention. The
/// payment providers' presets (`FenceSpec::stripe()`, `wechat_pay()`,
/// `alipay()`, `adyen()`) come with the feature `providers`.
///
/// ```
/// use onceonly::{Delivery, FenceSpec, KeySpec, OrderSpec};
///
/// let fence = FenceSpec::new(
///     KeySpec::json_field("/order_id"),
///     OrderSpec::parse("rank:/status=pending<paid<refunded;then=timestamp:/updated_at")?,
/// );
/// fence.validate()?;
/// let paid = fence.derive(&Delivery::new(
///     r#"{"order_id":"o-1","status":"paid","updated_at":"2024-05-01T10:00:00+08:00"}"#,
/// ))?;
/// assert_eq!(paid.entity.as_str(), "o-1");
/// assert_eq!(
///     fence.order().describe(&paid.order),
///     "status=paid, updated_at=2024-05-01T02:00:00Z"
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct FenceSpec {
    entity: KeySpec,
    order: OrderSpec,
    pass_stale: bool,
}

/// What a delivery's fence is: its entity and order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceValue {
    /// The entity the delivery is about (a payment, an order).
    pub entity: IdemKey,
    /// The delivery's order among the entity's deliveries.
    pub order: Order,
}

impl FenceSpec {
    /// A fence on the entity `entity` derives, ordered by `order`; stale
    /// deliveries are acknowledged without running the handler.
    pub fn new(entity: KeySpec, order: OrderSpec) -> Self {
        Self {
            entity,
            order,
            pass_stale: false,
        }
    }

    /// Run the handler on stale deliveries too (it reads the fence from its
    /// transaction and decides); default: stale deliveries are
    /// acknowledged without running the handler.
    #[must_use]
    pub fn pass_stale(mut self, pass: bool) -> Self {
        self.pass_stale = pass;
        self
    }

    /// Whether stale deliveries still run the handler ([`pass_stale`](Self::pass_stale)).
    pub fn passes_stale(&self) -> bool {
        self.pass_stale
    }

    /// How the entity is derived.
    pub fn entity(&self) -> &KeySpec {
        &self.entity
    }

    /// How the order is derived.
    pub fn order(&self) -> &OrderSpec {
        &self.order
    }

    /// Checks the entity's and the order's specs.
    pub fn validate(&self) -> Result<(), KeySpecError> {
        self.entity.validate()?;
        self.order.validate()
    }

    /// The entity and the order of `delivery` (the entity's error first).
    pub fn derive(&self, delivery: &Delivery) -> Result<FenceValue, KeyError> {
        Ok(FenceValue {
            entity: self.entity.derive(delivery)?,
            order: self.order.derive(delivery)?,
        })
    }
}

#[cfg(test)]
mod tests;
