//! The names of the headers the AMQP consumer writes (see
//! [`Header`](crate::Header), the one table of them).

use crate::Header;

pub(crate) const ATTEMPTS: &str = Header::Attempts.name();
pub(crate) const REASON: &str = Header::Reason.name();
pub(crate) const ERROR: &str = Header::Error.name();
pub(crate) const ORIGINAL_EXCHANGE: &str = Header::OriginalExchange.name();
pub(crate) const ORIGINAL_ROUTING_KEY: &str = Header::OriginalRoutingKey.name();
pub(crate) const QUEUE: &str = Header::Queue.name();
pub(crate) const IDEMPOTENCY_KEY: &str = Header::IdempotencyKey.name();
pub(crate) const SCOPE: &str = Header::Scope.name();
pub(crate) const FIRST_SEEN: &str = Header::FirstSeen.name();
