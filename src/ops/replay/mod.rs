//! Replaying dead letters back to where they came from (features `amqp`,
//! `kafka`): the library behind `onceonly replay`.
//!
//! A dead letter is a message the consumer could not process: a handler
//! error after the retries, a key reused with another payload
//! (`fingerprint_mismatch`), a missing key, an undecodable body. Once the
//! cause is fixed (a bug deployed, a downstream service back), replay sends
//! them back to the original exchange and routing key ([`AmqpReplay`]) or
//! topic ([`KafkaReplay`]), where the onceonly consumer processes them like
//! any delivery:
//! - a key that was committed in the meantime (the message was sent again
//!   and went through) is a **duplicate**: acknowledged, nothing doubled;
//! - a key never committed is processed **once**;
//! - a key reused with another payload is still a **conflict**: dead-lettered
//!   again with `fingerprint_mismatch`, never a success.
//!
//! So replaying is always safe against dedup, as long as the dedup records
//! are still retained (the retention must exceed the replay horizon).
//!
//! Selection ([`ReplayOptions`]): by reason, idempotency key, first-seen
//! time, a limit, a rate, and a dry run. What is not replayed stays where it
//! is; see [`AmqpReplay`] and [`KafkaReplay`] for how each transport keeps
//! it, and [`ReplayReport`] for the counts. Progress callbacks
//! ([`AmqpReplayBuilder::on_progress`], [`KafkaReplayBuilder::on_progress`])
//! feed progress bars.
//!
//! ```no_run
//! # async fn f() -> Result<(), onceonly::ops::replay::ReplayError> {
//! use std::time::Duration;
//! use onceonly::ops::replay::{AmqpReplay, ReplayOptions, Screen};
//! // The consumers keep their dedup records 7 days: a letter older than
//! // that is refused (its record may be gone). No retention is assumed.
//! let screen = Screen::new().retention(Duration::from_secs(7 * 86_400));
//! let report = AmqpReplay::builder()
//!     .url("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .queue("orders.dlq")
//!     .options(ReplayOptions::new().reason("handler_error").limit(100).screen(screen))
//!     .build()?
//!     .run()
//!     .await?;
//! println!("{} replayed, {} failed", report.replayed, report.failed);
//! # Ok(()) }
//! ```

#[cfg(feature = "amqp")]
mod amqp;
mod error;
mod group;
#[cfg(feature = "kafka")]
mod kafka;
mod options;
mod report;
mod screen;

#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub use amqp::{AmqpReplay, AmqpReplayBuilder};
pub use error::ReplayError;
pub(crate) use group::error_pattern;
pub use group::{FailureGroup, group_id};
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use kafka::{DEFAULT_GROUP, KafkaReplay, KafkaReplayBuilder};
pub use options::{DEFAULT_MAX_REPLAYS, ReplayOptions};
pub use report::{
    Action, Letter, Progress, ProgressFn, ReplayFailure, ReplayReport, VerdictCounts,
};
pub use screen::{DedupLookup, Screen, Verdict};

pub(crate) const REPLAYED_FROM: &str = crate::Header::ReplayedFrom.name();

pub(crate) const REPLAYS: &str = crate::Header::Replays.name();

pub(crate) const ORIGIN: &str = crate::Header::Origin.name();

/// Suffix of the parking queue or topic: letters replayed too often go to
/// `<dead-letter queue or topic>.parked`.
pub(crate) const PARKED_SUFFIX: &str = ".parked";
