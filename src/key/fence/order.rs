//! The order encoding: [`Order`], built component by component with
//! [`OrderBuilder`], and read back without its spec ([`Order::decode`]).

use std::fmt;

use super::decode::{DecodedOrder, decode};
use crate::key::OrderDecodeError;

/// Flipping the sign bit of an `i64`'s two's complement makes its
/// big-endian bytes sort as the number does (negatives first).
const SIGN: u64 = 1 << 63;

/// An order value, encoded so that byte-wise (memcmp) comparison is the
/// order's comparison; stored as `bytea` / `VARBINARY` / `BLOB`.
///
/// The bytes are the order's components one after the other, with no
/// type tags (the [`OrderSpec`](super::OrderSpec) says what each position is):
///
/// - an integer, a timestamp (milliseconds since the Unix epoch) and a
///   rank (its index in the ranked values): 8 bytes, big-endian, of the
///   `i64` with its sign bit flipped, so that negative values sort first;
/// - a text: its UTF-8 bytes with each `0x00` written `0x00 0xFF`, then
///   `0x00 0x00`, so that a text sorts before any longer text it is a
///   prefix of, whatever component follows it.
///
/// This encoding is stored and compared across versions: it never
/// changes. Orders are only comparable when built by the same spec.
/// `Display` is the lower-case hex of the bytes;
/// [`OrderSpec::describe`](super::OrderSpec::describe) decodes them by
/// their spec (field names, ranked values), and [`Order::decode`] without
/// it (integers, timestamps, texts), which is what `onceonly inspect`
/// shows.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Order(Vec<u8>);

impl Order {
    /// The longest order in bytes (the store's column size); a longer one
    /// is a [`KeyError::BadOrder`](crate::KeyError::BadOrder) when it is
    /// derived.
    pub const MAX_LEN: usize = 255;

    /// An order as read back from the store (not checked).
    pub fn from_bytes(bytes: Vec<u8>) -> Order {
        Order(bytes)
    }

    /// The encoded bytes, as stored and compared.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// A builder of orders in this encoding, for custom order functions
    /// ([`OrderSpec::custom`](super::OrderSpec::custom)).
    pub fn builder() -> OrderBuilder {
        OrderBuilder::default()
    }

    /// The order's components as its bytes hold them, read without its
    /// spec: for operators' tools, which see the stored bytes only (see
    /// [`DecodedOrder`] for how an encoding without type tags is read).
    /// [`OrderSpec::describe`](super::OrderSpec::describe) names them
    /// when the spec is at hand.
    ///
    /// ```
    /// use onceonly::Order;
    ///
    /// let order = Order::builder().rank(1).timestamp_ms(1_714_528_800_320).build();
    /// assert_eq!(order.to_string(), "80000000000000018000018f31e14e40");
    /// assert_eq!(order.decode()?.to_string(), "1, 2024-05-01T02:00:00.320Z");
    /// # Ok::<(), onceonly::key::OrderDecodeError>(())
    /// ```
    ///
    /// Errors: bytes that are no sequence of components
    /// ([`OrderDecodeError::Malformed`]), or more than [`Order::MAX_LEN`]
    /// of them ([`OrderDecodeError::TooLong`]).
    pub fn decode(&self) -> Result<DecodedOrder, OrderDecodeError> {
        decode(&self.0)
    }
}

impl fmt::Debug for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Order({})", hex::encode(&self.0))
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0))
    }
}

/// Builds an [`Order`] component by component, in the encoding of
/// [`Order`]: the first component compared first.
///
/// ```
/// use onceonly::Order;
///
/// let paid = Order::builder().rank(1).timestamp_ms(1_714_528_800_000).build();
/// let refunded = Order::builder().rank(2).timestamp_ms(0).build();
/// assert!(paid < refunded);
/// ```
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct OrderBuilder {
    bytes: Vec<u8>,
}

impl OrderBuilder {
    /// Appends an integer.
    pub fn integer(mut self, value: i64) -> Self {
        push_i64(&mut self.bytes, value);
        self
    }

    /// Appends a timestamp, in milliseconds since the Unix epoch (encoded
    /// as an integer).
    pub fn timestamp_ms(self, millis: i64) -> Self {
        self.integer(millis)
    }

    /// Appends a rank: a position in a list of states (encoded as an
    /// integer).
    pub fn rank(self, index: u32) -> Self {
        self.integer(i64::from(index))
    }

    /// Appends a text, compared byte-wise.
    pub fn text(mut self, text: &str) -> Self {
        push_text(&mut self.bytes, text);
        self
    }

    /// The order. Its length is checked (at most [`Order::MAX_LEN`]) when
    /// a custom function returns it.
    pub fn build(self) -> Order {
        Order(self.bytes)
    }
}

pub(super) fn push_i64(out: &mut Vec<u8>, value: i64) {
    out.extend_from_slice(&(value.cast_unsigned() ^ SIGN).to_be_bytes());
}

pub(super) fn push_text(out: &mut Vec<u8>, text: &str) {
    for &b in text.as_bytes() {
        out.push(b);
        if b == 0 {
            out.push(0xFF);
        }
    }
    out.extend_from_slice(&[0, 0]);
}

pub(super) fn take_i64(bytes: &[u8]) -> Option<(i64, &[u8])> {
    let (head, rest) = bytes.split_first_chunk::<8>()?;
    Some(((u64::from_be_bytes(*head) ^ SIGN).cast_signed(), rest))
}

pub(super) fn take_text(bytes: &[u8]) -> Option<(Vec<u8>, &[u8])> {
    let mut text = Vec::new();
    let mut i = 0;
    loop {
        match (bytes.get(i)?, bytes.get(i + 1)) {
            (0, Some(0)) => return Some((text, bytes.get(i + 2..)?)),
            (0, Some(0xFF)) => {
                text.push(0);
                i += 2;
            }
            (0, _) => return None,
            (&b, _) => {
                text.push(b);
                i += 1;
            }
        }
    }
}
