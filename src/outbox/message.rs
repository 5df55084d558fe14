//! What a handler sends: a message for a Kafka topic, an AMQP exchange or a
//! webhook URL, and the deterministic id it leaves with.

use sha2::{Digest, Sha256};

use crate::engine::Origin;

/// [`Header::MessageId`](crate::Header::MessageId).
pub(crate) const MESSAGE_ID_HEADER: &str = crate::Header::MessageId.name();
/// [`Header::CausationId`](crate::Header::CausationId).
pub(crate) const CAUSATION_HEADER: &str = crate::Header::CausationId.name();
/// The W3C trace context header, passed on from the inbound message.
pub(crate) const TRACEPARENT_HEADER: &str = "traceparent";

/// Where a message goes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Destination {
    /// A Kafka topic; the message key (if any) picks the partition.
    Kafka {
        /// The topic.
        topic: String,
    },
    /// An AMQP exchange (`""`: the default exchange, the routing key
    /// naming the queue).
    Amqp {
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// An HTTP POST to a URL (a merchant's notification endpoint).
    Webhook {
        /// The URL.
        url: String,
    },
}

impl Destination {
    /// `kafka`, `amqp` or `webhook`.
    pub fn kind(&self) -> Kind {
        match self {
            Self::Kafka { .. } => Kind::Kafka,
            Self::Amqp { .. } => Kind::Amqp,
            Self::Webhook { .. } => Kind::Webhook,
        }
    }

    /// The topic, exchange or URL.
    pub fn target(&self) -> &str {
        match self {
            Self::Kafka { topic } => topic,
            Self::Amqp { exchange, .. } => exchange,
            Self::Webhook { url } => url,
        }
    }

    /// The AMQP routing key.
    pub fn routing_key(&self) -> Option<&str> {
        match self {
            Self::Amqp { routing_key, .. } => Some(routing_key),
            _ => None,
        }
    }
}

/// The kind of a destination; a relay serves the kinds it has a
/// publisher for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Kind {
    /// A Kafka topic.
    Kafka,
    /// An AMQP exchange.
    Amqp,
    /// A webhook URL.
    Webhook,
}

impl Kind {
    /// `kafka`, `amqp` or `webhook`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kafka => "kafka",
            Self::Amqp => "amqp",
            Self::Webhook => "webhook",
        }
    }

    /// The kind stored as `s`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "kafka" => Some(Self::Kafka),
            "amqp" => Some(Self::Amqp),
            "webhook" => Some(Self::Webhook),
            _ => None,
        }
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message to send once the handler's transaction commits; see
/// [`Outbox::enqueue`](super::Outbox::enqueue).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    pub(crate) destination: Destination,
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) order_by: Option<String>,
    pub(crate) not_before: Option<NotBefore>,
    pub(crate) id: Option<String>,
}

/// When a delayed message may leave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NotBefore {
    /// At this time, in ms since the Unix epoch.
    At(i64),
    /// This long after it is enqueued.
    After(std::time::Duration),
}

impl OutboxMessage {
    /// A record for Kafka `topic` with `key` (which also orders it: the
    /// messages of one key leave in the order they were enqueued).
    pub fn kafka(
        topic: impl Into<String>,
        key: impl Into<Vec<u8>>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self::new(
            Destination::Kafka {
                topic: topic.into(),
            },
            Some(key.into()),
            payload.into(),
        )
    }

    /// A message for AMQP `exchange` with `routing_key` (published
    /// persistent and mandatory, with publisher confirms).
    pub fn amqp(
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Self::new(
            Destination::Amqp {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
            },
            None,
            payload.into(),
        )
    }

    /// An HTTP POST of `payload` to `url`, signed with the relay's webhook
    /// secret.
    pub fn webhook(url: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self::new(
            Destination::Webhook { url: url.into() },
            None,
            payload.into(),
        )
    }

    fn new(destination: Destination, key: Option<Vec<u8>>, payload: Vec<u8>) -> Self {
        Self {
            destination,
            key,
            payload,
            headers: Vec::new(),
            order_by: None,
            not_before: None,
            id: None,
        }
    }

    /// Adds a header (a Kafka header, an AMQP header, an HTTP header).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Orders this message after every earlier one with the same
    /// destination and `key`, instead of the default: the Kafka message key,
    /// the AMQP routing key, or, for a webhook, none (each webhook is
    /// ordered on its own).
    ///
    /// A webhook without an `order_by` key holds back no other webhook,
    /// and none holds it back: one merchant's notification that its
    /// receiver keeps refusing (retried with backoff, then parked as dead)
    /// never delays another payment's notification to the same URL, and
    /// the relay sends a URL's webhooks side by side, at most
    /// [`RelayBuilder::max_in_flight_per_destination`](super::RelayBuilder::max_in_flight_per_destination)
    /// at once. Give the webhooks that must arrive in order (the events of
    /// one payment, say) one key: `.order_by(payment_id)`; they then leave
    /// one at a time, each after the one before it was confirmed.
    ///
    /// The ordering key is computed when the message is enqueued and
    /// stored with it: webhooks enqueued before this default (ordered by
    /// their URL) keep that order until they are sent.
    #[must_use]
    pub fn order_by(mut self, key: impl Into<String>) -> Self {
        self.order_by = Some(key.into());
        self
    }

    /// A delayed message: a relay sends it no earlier than `at` (on the
    /// enqueuer's clock, compared on the relay's: keep them in sync), soon
    /// after a poll once it is due. Until then it is pending but not due:
    /// counted apart from the backlog
    /// ([`StatusCount::delayed`](super::StatusCount::delayed)), and
    /// `onceonly outbox inspect` shows it as delayed. A time in the past is
    /// now.
    ///
    /// Order: a delayed message is ordered on its own unless it has an
    /// [`order_by`](Self::order_by) key; then it keeps its place in that
    /// key, and the messages enqueued after it with that key wait for it
    /// (and age, as backlog, meanwhile).
    #[must_use]
    pub fn not_before(mut self, at: std::time::SystemTime) -> Self {
        let ms = at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.not_before = Some(NotBefore::At(ms));
        self
    }

    /// A delayed message, sent no earlier than `delay` after it is
    /// enqueued (see [`not_before`](Self::not_before)).
    #[must_use]
    pub fn delay(mut self, delay: std::time::Duration) -> Self {
        self.not_before = Some(NotBefore::After(delay));
        self
    }

    /// The message's id from the caller's own `id`, unique within the
    /// scope it is enqueued in (a claim's scope, or the scope given to
    /// [`Outbox::enqueue_in`](super::Outbox::enqueue_in); not per inbound
    /// key: two keys of one scope that send `.id("receipt")` send one
    /// message). The message id becomes a hash of the scope and `id`, and
    /// enqueuing a message with the same scope and id again adds nothing,
    /// whatever its payload, for as long as the first is in the table:
    /// pending, dead, or sent and not purged yet (the relay's `keep_sent`,
    /// 24 h by default). A job that runs again after a crash so enqueues
    /// each of its messages once; a job that runs every night needs ids
    /// that name the night. Without it, a message enqueued in a claim gets
    /// [`message_id`] and one enqueued without a claim a random id.
    #[must_use]
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// When the message may first be sent, for one enqueued at `now_ms`.
    pub(crate) fn due_ms(&self, now_ms: i64) -> i64 {
        match self.not_before {
            None => now_ms,
            Some(NotBefore::At(at)) => at.max(now_ms),
            Some(NotBefore::After(delay)) => {
                now_ms.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
            }
        }
    }

    /// Where it goes.
    pub fn destination(&self) -> &Destination {
        &self.destination
    }

    /// The ordering key as stored for message `id` enqueued at `now_ms`:
    /// a SHA-256 over the destination and the key messages are ordered by.
    /// A webhook, or a message delayed past `now_ms`, without an
    /// [`order_by`](Self::order_by) key is ordered on its own (by its id):
    /// it holds back nothing, and nothing holds it back. One due now (a
    /// `not_before` in the past, a zero delay) is no delayed message: it
    /// keeps its place in its key's order.
    pub(crate) fn order_key(&self, id: &str, now_ms: i64) -> String {
        let delayed = self.due_ms(now_ms) > now_ms;
        let by: &[u8] = match (&self.order_by, &self.destination) {
            (Some(by), _) => by.as_bytes(),
            (None, Destination::Webhook { .. }) => id.as_bytes(),
            (None, _) if delayed => id.as_bytes(),
            (None, Destination::Kafka { .. }) => self.key.as_deref().unwrap_or_default(),
            (None, Destination::Amqp { routing_key, .. }) => routing_key.as_bytes(),
        };
        let mut h = Sha256::new();
        for part in [
            self.destination.kind().as_str().as_bytes(),
            self.destination.target().as_bytes(),
            by,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        hex::encode(h.finalize())
    }
}

/// The id of the `position`-th message sent while handling the inbound key
/// of `origin`: a SHA-256 over the scope, the key, the claim's time and the
/// position, so every copy of the message (relay retries, dead letters,
/// replays) carries the same id.
///
/// The claim's time makes each committed run of a handler send its own
/// ids. Within the dedup window a key runs its handler once, so there is
/// one run to name. After the window a key that comes back is processed
/// again, as a new request (the retention is the promise: keep it longer
/// than any redelivery or replay horizon): its effects are written again,
/// and so are its messages, with new ids, which a downstream consumer
/// keyed on [`Header::MessageId`](crate::Header::MessageId) applies instead of dropping them as the
/// old run's (the old run's message may be gone from its dedup window
/// too, or not: either way the new effect's message arrives).
pub fn message_id(origin: &Origin, position: u32) -> String {
    let mut h = Sha256::new();
    h.update(b"onceonly-outbox\0");
    for part in [origin.scope().as_bytes(), origin.key().as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.update(origin.claimed_at_ms().to_be_bytes());
    h.update(position.to_be_bytes());
    uuid_shaped(&h.finalize())
}

/// The id of a message given the caller's own `id` (see
/// [`OutboxMessage::id`]) in `scope`.
pub(crate) fn caller_message_id(scope: &str, id: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"onceonly-outbox-id\0");
    for part in [scope.as_bytes(), id.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    uuid_shaped(&h.finalize())
}

/// 128 bits of a digest, as a UUID-shaped string downstream systems accept
/// as an id.
fn uuid_shaped(d: &[u8]) -> String {
    let hex = hex::encode(&d[..16]);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_depend_on_scope_key_claim_and_position_only() {
        let a = Origin::new("payments", "T-1", None, 1);
        let again = Origin::new("payments", "T-1", Some("00-abc-def-01"), 1);
        assert_eq!(message_id(&a, 0), message_id(&again, 0));
        // The key processed again after its record expired: a new run.
        assert_ne!(
            message_id(&a, 0),
            message_id(&Origin::new("payments", "T-1", None, 2), 0)
        );
        assert_ne!(message_id(&a, 0), message_id(&a, 1));
        assert_ne!(
            message_id(&a, 0),
            message_id(&Origin::new("payments", "T-2", None, 1), 0)
        );
        assert_ne!(
            message_id(&a, 0),
            message_id(&Origin::new("refunds", "T-1", None, 1), 0)
        );
        // No ambiguity between scope and key boundaries.
        assert_ne!(
            message_id(&Origin::new("ab", "c", None, 1), 0),
            message_id(&Origin::new("a", "bc", None, 1), 0)
        );
        assert_eq!(message_id(&a, 0).len(), 36);
    }

    #[test]
    fn a_delayed_message_is_ordered_alone_unless_ordered_by_a_key() {
        use std::time::{Duration, UNIX_EPOCH};
        let now = OutboxMessage::kafka("t", "k", "{}");
        let later = now.clone().delay(Duration::from_secs(60));
        let t = 1_000;
        assert_eq!(now.order_key("a", t), now.order_key("b", t));
        assert_ne!(later.order_key("a", t), now.order_key("a", t));
        assert_ne!(later.order_key("a", t), later.order_key("b", t));
        let ordered = later.clone().order_by("k");
        assert_eq!(ordered.order_key("a", t), ordered.order_key("b", t));
        // Issue 44, defect 8: due now is not delayed: it keeps its key's
        // order (a time in the past, a zero delay).
        let zero = now.clone().delay(Duration::ZERO);
        assert_eq!(zero.order_key("a", t), now.order_key("b", t));
        let past_key = now
            .clone()
            .not_before(UNIX_EPOCH + Duration::from_millis(10));
        assert_eq!(past_key.order_key("a", t), now.order_key("b", t));
        // Due times: now, later, a time in the past (now), a future time.
        assert_eq!(now.due_ms(1_000), 1_000);
        assert_eq!(later.due_ms(1_000), 61_000);
        let past = now
            .clone()
            .not_before(UNIX_EPOCH + Duration::from_millis(10));
        assert_eq!(past.due_ms(1_000), 1_000);
        let at = now.not_before(UNIX_EPOCH + Duration::from_millis(5_000));
        assert_eq!(at.due_ms(1_000), 5_000);
    }

    #[test]
    fn order_keys_follow_destination_and_key() {
        let a = OutboxMessage::kafka("settled", "acct-1", "{}");
        let b = OutboxMessage::kafka("settled", "acct-1", "{\"x\":1}");
        let c = OutboxMessage::kafka("settled", "acct-2", "{}");
        let d = OutboxMessage::kafka("other", "acct-1", "{}");
        assert_eq!(a.order_key("id", 0), b.order_key("id", 0));
        assert_ne!(a.order_key("id", 0), c.order_key("id", 0));
        assert_ne!(a.order_key("id", 0), d.order_key("id", 0));
        let e = OutboxMessage::kafka("settled", "acct-2", "{}").order_by("acct-1");
        assert_eq!(
            e.order_key("id", 0),
            a.order_key("id", 0),
            "order_by replaces the key"
        );
        assert_eq!(a.order_key("id", 0).len(), 64);
    }

    /// Issue 46, item 3: a webhook without an `order_by` key is ordered
    /// on its own (one failing notification held back every other one to
    /// its URL); with one, it keeps that key's order.
    #[test]
    fn webhooks_are_ordered_alone_unless_ordered_by_a_key() {
        let hook = OutboxMessage::webhook("https://m.example/notify", "{}");
        assert_ne!(hook.order_key("a", 0), hook.order_key("b", 0));
        assert_eq!(hook.order_key("a", 0), hook.order_key("a", 0));
        let ordered = hook.clone().order_by("pay-1");
        assert_eq!(ordered.order_key("a", 0), ordered.order_key("b", 0));
        assert_ne!(
            ordered.order_key("a", 0),
            hook.clone().order_by("pay-2").order_key("a", 0)
        );
        // The same key at another URL is another order.
        let elsewhere = OutboxMessage::webhook("https://n.example/notify", "{}").order_by("pay-1");
        assert_ne!(ordered.order_key("a", 0), elsewhere.order_key("a", 0));
    }
}
