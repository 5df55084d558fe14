//! Errors of key derivation (per delivery) and of key specifications (at build time).

/// Why no idempotency key could be derived from a delivery.
///
/// Each variant is a distinct, precise reason; transports put
/// [`KeyError::reason`] and the message into the dead-letter headers or the
/// HTTP problem body. No variant carries the key's text (it may be
/// personal data, and these messages are logged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header or metadata entry is absent.
    #[error("missing metadata entry {name:?}")]
    MissingMetadata {
        /// The entry that was looked up.
        name: String,
    },
    /// The message has no broker message key (Kafka record key, AMQP `message_id`).
    #[error("message has no message key")]
    MissingMessageKey,
    /// The JSON pointer matched nothing, or matched `null`.
    #[error("missing JSON field {pointer:?}")]
    MissingField {
        /// The pointer that was looked up.
        pointer: String,
    },
    /// The JSON pointer matched an object or an array.
    #[error("JSON field {pointer:?} is not a string, number or boolean")]
    NotScalar {
        /// The pointer that was looked up.
        pointer: String,
    },
    /// The payload is not valid JSON but the key spec reads JSON fields.
    #[error("payload is not valid JSON: {0}")]
    NotJson(String),
    /// The key is empty.
    #[error("key is empty")]
    Empty,
    /// The key is longer than the configured maximum (and compaction is off).
    #[error("key is {len} bytes long, the maximum is {max}")]
    TooLong {
        /// Length of the derived key in bytes.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The key bytes are not valid UTF-8.
    #[error("key is not valid UTF-8")]
    NotUtf8,
    /// The key contains a control character.
    #[error("key contains a control character at byte {at}")]
    ControlCharacter {
        /// Byte offset of the first control character.
        at: usize,
    },
    /// The spec requires a UUID and the key is not one.
    #[error("key is not a UUID")]
    NotUuid,
    /// A user-supplied key function refused the delivery.
    #[error("key function failed: {0}")]
    Custom(String),
    /// A [fence](crate::FenceSpec)'s order could not be read from the
    /// delivery: the value is not of the component's type (not an
    /// integer, not a timestamp, not one of the ranked values, not a
    /// string), or the order is too long. The message names the field and
    /// the reason, never the value.
    #[error("order field {pointer:?} is unusable: {reason}")]
    BadOrder {
        /// The JSON pointer (or the metadata entry's name) of the component.
        pointer: String,
        /// Why the value cannot be used, without the value itself.
        reason: String,
    },
}

impl KeyError {
    /// The stable reason code used in dead-letter headers and metrics:
    /// `decode_error` when the payload could not be parsed, `bad_key` otherwise.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotJson(_) => "decode_error",
            _ => "bad_key",
        }
    }
}

/// A key specification that cannot be used. Returned when a consumer is built,
/// never at the first message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeySpecError {
    /// The expression does not start with a known source.
    #[error(
        "unknown key source in {0:?}: expected `header:NAME`, `meta:NAME`, `message-key`, `json:/POINTER[+/POINTER...]` or `fingerprint`"
    )]
    UnknownSource(String),
    /// A header or metadata name is empty or contains characters not allowed in a header name.
    #[error("invalid metadata name {0:?}")]
    InvalidName(String),
    /// A JSON pointer is empty or does not start with `/`.
    #[error("invalid JSON pointer {0:?}: it must start with `/`")]
    InvalidPointer(String),
    /// An option after `;` is unknown or malformed.
    #[error("invalid key option {0:?}: expected `max=N`, `compact` or `uuid`")]
    InvalidOption(String),
    /// The maximum length is out of range.
    #[error("maximum key length {0} is out of range 1..=255 (the store's column size)")]
    MaxLength(usize),
    /// An [order spec](crate::OrderSpec) is malformed: an unknown
    /// component, an empty or repeated ranked value, a custom order
    /// combined with other components, an offset out of range.
    #[error("invalid order spec: {0}")]
    InvalidOrder(String),
    /// Compaction needs room for the `sha256:` form.
    #[error(
        "compaction needs a maximum key length of at least {min} bytes to hold `sha256:<hex>`, got {max}"
    )]
    CompactTooShort {
        /// Minimum length required.
        min: usize,
        /// The configured maximum.
        max: usize,
    },
}

/// Why stored bytes cannot be read back as an order's components without
/// its spec ([`Order::decode`](crate::Order::decode)); the bytes are
/// still an [`Order`](crate::Order) (its hex is its `Display`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OrderDecodeError {
    /// The bytes are not a sequence of components: 8-byte integers and
    /// UTF-8 texts ended by `0x00 0x00`.
    #[error("these {len} bytes are not an order's components")]
    Malformed {
        /// How many bytes there are.
        len: usize,
    },
    /// More bytes than an order holds.
    #[error("an order of {len} bytes is longer than the maximum of {max}")]
    TooLong {
        /// How many bytes there are.
        len: usize,
        /// [`Order::MAX_LEN`](crate::Order::MAX_LEN).
        max: usize,
    },
}
