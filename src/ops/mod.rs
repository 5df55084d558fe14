//! Operations on a running deployment: purging the dedup table (once, or in
//! the background with [`Purger`]) and, with the `amqp` or `kafka` feature,
//! replaying dead letters ([`replay`]). The `onceonly` command-line tool
//! (crate `onceonly-cli`) is built on this module; [`admin`] holds the
//! queries only such tools need. The guide below covers the
//! CLI, checking a deployment, replaying dead letters, metrics, alerts and
//! the dashboard, tracing, and running at scale.
//!
#![doc = include_str!("../../docs/operations.md")]

pub mod admin;
pub mod complete;
pub mod purge;
#[cfg(feature = "_broker")]
#[cfg_attr(docsrs, doc(cfg(any(feature = "amqp", feature = "kafka"))))]
pub mod replay;

pub use complete::{Completer, CompleterBuilder, CompleterHandle, OrphanHandler};
pub use purge::{
    PurgeError, PurgeMode, PurgeOptions, PurgeProgress, Purger, PurgerBuilder, PurgerHandle,
    SHUTDOWN_GRACE, purge_in_batches,
};
