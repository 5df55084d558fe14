//! What every broker consumer shares, whatever the broker: stopping on
//! SIGINT and SIGTERM ([`shutdown`]), waiting out an outage in place
//! ([`wait`]), pausing while the handler keeps failing ([`pause`]), and
//! the [`ConsumerStats`] a consumer returns.
//!
//! Compiled with the private `_broker` feature, which each broker transport
//! (`kafka`, `amqp`) enables. The engine settings every transport builder
//! forwards live below, in the engine (the HTTP layer forwards them too).
//! CONTRIBUTING.md lists what a new transport adds.

pub(crate) mod pause;
pub(crate) mod preflight;
pub(crate) mod shutdown;
mod stats;
pub(crate) mod wait;

pub use pause::PausePolicy;
pub use stats::ConsumerStats;
pub(crate) use stats::{Counters, bump};
