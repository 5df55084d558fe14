//! Operations on a running deployment: purging the dedup table (once, or in
//! the background with [`Purger`]) and, with the `amqp` or `kafka` feature,
//! replaying dead letters ([`replay`]). The `onceonly` command-line tool
//! (feature `cli`) is built on this module.

pub mod purge;
#[cfg(any(feature = "amqp", feature = "kafka"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "amqp", feature = "kafka"))))]
pub mod replay;

pub use purge::{
    PurgeError, PurgeMode, PurgeOptions, PurgeProgress, Purger, PurgerBuilder, PurgerHandle,
    SHUTDOWN_GRACE, purge_in_batches,
};
