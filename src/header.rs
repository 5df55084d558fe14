//! Every header onceonly writes on a message, in one table: what a dead
//! letter, a retried copy, a replayed copy or a relayed outbox message
//! carries, on Kafka and AMQP alike, and the webhook headers of the outbox
//! relay. Values are UTF-8 text; numbers are decimal; times are
//! milliseconds since the Unix epoch.
//!
//! ```
//! use onceonly::Header;
//!
//! assert_eq!(Header::Reason.name(), "x-onceonly-reason");
//! assert_eq!(Header::from_name("x-onceonly-attempts"), Some(Header::Attempts));
//! ```

/// A header onceonly writes. [`name`](Self::name) is its wire name; the
/// table below says who writes it.
///
/// | Header | Written by |
/// |---|---|
/// | `Reason`, `Error`, `Attempts`, `FirstSeen`, `IdempotencyKey`, `Scope` | Kafka and AMQP consumers on a dead letter or a retried copy |
/// | `OriginalTopic`, `OriginalPartition`, `OriginalOffset`, `OriginalKey`, `Due` | the Kafka consumer (`Due` on a copy in the retry topic) |
/// | `OriginalExchange`, `OriginalRoutingKey`, `Queue` | the AMQP consumer |
/// | `ReplayedFrom`, `Replays`, `Origin` | the dead-letter replay tools on every replayed copy |
/// | `MessageId`, `CausationId` | the outbox relay on every message |
/// | `Signature` | the webhook publisher signing in onceonly's own format |
/// | `WebhookId`, `WebhookTimestamp`, `WebhookSignature` | the webhook publisher signing as Standard Webhooks (the default) |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Header {
    /// The reason code, one of those in the table of
    /// [`decide`](crate::engine::decide).
    Reason,
    /// The error text.
    Error,
    /// How many times the handler ran (0 when the message was rejected
    /// before it ran).
    Attempts,
    /// When the consumer first received the message.
    FirstSeen,
    /// The idempotency key, when one could be derived.
    IdempotencyKey,
    /// The dedup scope (by default the consumer group or the queue).
    Scope,
    /// Kafka: the topic the record was consumed from.
    OriginalTopic,
    /// Kafka: its partition.
    OriginalPartition,
    /// Kafka: its offset.
    OriginalOffset,
    /// Kafka: its record key, verbatim (absent for a record without key;
    /// the dead-letter record carries the same record key).
    OriginalKey,
    /// Kafka, on a copy in the retry topic: when it is due again.
    Due,
    /// AMQP: the exchange the message was first published to (`""`: the
    /// default exchange).
    OriginalExchange,
    /// AMQP: the routing key it was first published with.
    OriginalRoutingKey,
    /// AMQP: the queue it was consumed from.
    Queue,
    /// A replayed copy: where it was replayed from (the dead-letter queue,
    /// or `<topic>/<partition>/<offset>` of the dead-letter topic).
    ReplayedFrom,
    /// A replayed copy: how often the message was replayed, this copy
    /// included. Kept when the copy is dead-lettered again, so that a
    /// letter replayed [`ReplayOptions::max_replays`](crate::ops::replay::ReplayOptions::max_replays)
    /// times is parked instead of cycling.
    Replays,
    /// A replayed copy: where the message was first consumed from, kept
    /// across replays: `topic/partition@offset` (Kafka), or
    /// `queue/exchange/routing-key` (`queue/routing-key` through the
    /// default exchange) for AMQP.
    Origin,
    /// Every relayed outbox message: its deterministic id. Key a
    /// downstream consumer on it (`header:x-onceonly-message-id`) to apply
    /// each message once.
    MessageId,
    /// Every relayed outbox message: the inbound key it was sent for.
    CausationId,
    /// A webhook's HMAC-SHA256 signature in onceonly's own format
    /// (`t=<unix secs>,v1=<hex>` over `<t>.<body>`), which
    /// [`SignatureCheck`](crate::http::SignatureCheck) verifies.
    Signature,
    /// Standard Webhooks: the message id.
    WebhookId,
    /// Standard Webhooks: the timestamp (Unix seconds).
    WebhookTimestamp,
    /// Standard Webhooks: the signature (`v1,<base64>`).
    WebhookSignature,
}

impl Header {
    /// Every header, in the order of the table.
    pub const ALL: [Header; 23] = [
        Self::Reason,
        Self::Error,
        Self::Attempts,
        Self::FirstSeen,
        Self::IdempotencyKey,
        Self::Scope,
        Self::OriginalTopic,
        Self::OriginalPartition,
        Self::OriginalOffset,
        Self::OriginalKey,
        Self::Due,
        Self::OriginalExchange,
        Self::OriginalRoutingKey,
        Self::Queue,
        Self::ReplayedFrom,
        Self::Replays,
        Self::Origin,
        Self::MessageId,
        Self::CausationId,
        Self::Signature,
        Self::WebhookId,
        Self::WebhookTimestamp,
        Self::WebhookSignature,
    ];

    /// The prefix of every onceonly header but the Standard Webhooks ones.
    pub const PREFIX: &'static str = "x-onceonly-";

    /// The header's name on the wire.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Reason => "x-onceonly-reason",
            Self::Error => "x-onceonly-error",
            Self::Attempts => "x-onceonly-attempts",
            Self::FirstSeen => "x-onceonly-first-seen",
            Self::IdempotencyKey => "x-onceonly-idempotency-key",
            Self::Scope => "x-onceonly-scope",
            Self::OriginalTopic => "x-onceonly-original-topic",
            Self::OriginalPartition => "x-onceonly-original-partition",
            Self::OriginalOffset => "x-onceonly-original-offset",
            Self::OriginalKey => "x-onceonly-original-key",
            Self::Due => "x-onceonly-due",
            Self::OriginalExchange => "x-onceonly-original-exchange",
            Self::OriginalRoutingKey => "x-onceonly-original-routing-key",
            Self::Queue => "x-onceonly-queue",
            Self::ReplayedFrom => "x-onceonly-replayed-from",
            Self::Replays => "x-onceonly-replays",
            Self::Origin => "x-onceonly-origin",
            Self::MessageId => "x-onceonly-message-id",
            Self::CausationId => "x-onceonly-causation-id",
            Self::Signature => "x-onceonly-signature",
            Self::WebhookId => "webhook-id",
            Self::WebhookTimestamp => "webhook-timestamp",
            Self::WebhookSignature => "webhook-signature",
        }
    }

    /// The header named `name` (exactly, lower case), if onceonly writes
    /// one.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|h| h.name() == name)
    }
}

impl std::fmt::Display for Header {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_lower_case_and_found_back() {
        let mut names: Vec<_> = Header::ALL.iter().map(|h| h.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Header::ALL.len(), "a name written twice");
        for h in Header::ALL {
            assert_eq!(h.name(), h.name().to_ascii_lowercase());
            assert_eq!(Header::from_name(h.name()), Some(h));
            assert!(h.name().starts_with(Header::PREFIX) || h.name().starts_with("webhook-"));
        }
        assert_eq!(Header::from_name("traceparent"), None);
    }
}
