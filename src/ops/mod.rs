//! Operations on a running deployment: purging the dedup table (once, or in
//! the background with [`Purger`]) and, with the transport features,
//! replaying dead letters. The `onceonly` command-line tool (feature `cli`)
//! is built on this module.

pub mod purge;

pub use purge::{
    PurgeError, PurgeMode, PurgeOptions, PurgeProgress, Purger, PurgerBuilder, PurgerHandle,
    purge_in_batches,
};
