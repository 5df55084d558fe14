//! Header names onceonly writes on retried and dead-lettered messages.

/// Attempts made so far (set on messages sent through a retry queue).
pub const ATTEMPTS: &str = "x-onceonly-attempts";
/// The reason code, one of those in the table of
/// [`decide`](crate::engine::decide).
pub const REASON: &str = "x-onceonly-reason";
/// The error text.
pub const ERROR: &str = "x-onceonly-error";
/// The exchange the message was first published to (`""`: default exchange).
pub const ORIGINAL_EXCHANGE: &str = "x-onceonly-original-exchange";
/// The routing key it was first published with.
pub const ORIGINAL_ROUTING_KEY: &str = "x-onceonly-original-routing-key";
/// The queue it was consumed from.
pub const QUEUE: &str = "x-onceonly-queue";
/// The idempotency key, when one could be derived.
pub const IDEMPOTENCY_KEY: &str = "x-onceonly-idempotency-key";
/// The dedup scope (by default the queue name).
pub const SCOPE: &str = "x-onceonly-scope";
/// When the consumer first received the message (ms since the Unix epoch).
pub const FIRST_SEEN: &str = "x-onceonly-first-seen";
