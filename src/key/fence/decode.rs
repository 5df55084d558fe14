//! An [`Order`](super::Order) read back without its spec
//! ([`Order::decode`](super::Order::decode)): what operators' tools show,
//! since they see the stored bytes only. The encoding has no type tags, so
//! what each component is, is read from its bytes.

use std::fmt;
use std::ops::Range;

use super::order::{take_i64, take_text};
use super::time::format_millis;
use crate::key::OrderDecodeError;

/// From 2000-01-01 to 2200-01-01 (UTC), in milliseconds since the Unix
/// epoch: an 8-byte component in this range is shown as a time.
const TIMES: Range<i64> = 946_684_800_000..7_258_118_400_000;

/// One component of an order, as [`Order::decode`](super::Order::decode)
/// reads it.
///
/// `Display`: an integer in decimal, a timestamp in RFC 3339 (UTC,
/// milliseconds when there are any), a text quoted and escaped like a
/// Rust string.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderPart {
    /// An 8-byte component whose value, read as milliseconds since the
    /// Unix epoch, falls between the years 2000 and 2200: a timestamp
    /// component (or an integer that large).
    Timestamp(i64),
    /// Any other 8-byte component: an integer, or a rank (the index of
    /// its state in the spec's list, from 0).
    Integer(i64),
    /// A text component.
    Text(String),
}

impl fmt::Display for OrderPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timestamp(millis) => f.write_str(&format_millis(*millis)),
            Self::Integer(value) => write!(f, "{value}"),
            Self::Text(text) => write!(f, "{text:?}"),
        }
    }
}

/// An order's components as its bytes hold them
/// ([`Order::decode`](super::Order::decode)), first compared first.
///
/// The encoding has no type tags: the bytes are read as the components
/// they can be, an 8-byte component (an integer, a rank, a timestamp) or
/// a text (UTF-8, ended by `0x00 0x00`). Where both readings fit, a
/// component that starts with `0x7F` to `0xBF` (each integer from -2^56
/// to 2^62: ranks, versions, timestamps) is read as an integer, any other
/// as a text; an 8-byte component is shown as a time when it reads as one
/// between the years 2000 and 2200 ([`OrderPart::Timestamp`]). An integer
/// below -2^56, or a text that starts with the character DEL (`0x7F`),
/// may be read as something else: the spec's
/// [`describe`](super::OrderSpec::describe) is exact.
///
/// `Display`: the parts joined by `, ` (`2, 2024-05-01T02:00:00.320Z`),
/// or `(empty)` for an order of no component.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedOrder {
    parts: Vec<OrderPart>,
}

impl DecodedOrder {
    /// The components, first compared first.
    pub fn parts(&self) -> &[OrderPart] {
        &self.parts
    }
}

impl fmt::Display for DecodedOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.parts.is_empty() {
            return f.write_str("(empty)");
        }
        for (i, part) in self.parts.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{part}")?;
        }
        Ok(())
    }
}

/// `bytes` as components (see [`DecodedOrder`]).
pub(super) fn decode(bytes: &[u8]) -> Result<DecodedOrder, OrderDecodeError> {
    let len = bytes.len();
    if len > super::Order::MAX_LEN {
        return Err(OrderDecodeError::TooLong {
            len,
            max: super::Order::MAX_LEN,
        });
    }
    // From the end: whether the bytes from `i` on are whole components,
    // and the length of the text at `i` when it is one followed by whole
    // components (at most 255 texts of at most 255 bytes).
    let mut whole = vec![false; len + 1];
    let mut texts = vec![None; len];
    whole[len] = true;
    for i in (0..len).rev() {
        texts[i] = text_len(&bytes[i..]).filter(|n| whole[i + n]);
        let integer = i + 8 <= len && whole[i + 8];
        whole[i] = integer || texts[i].is_some();
    }
    if !whole[0] {
        return Err(OrderDecodeError::Malformed { len });
    }
    // From the start, the reading that fits; where both do, by the first
    // byte (see `DecodedOrder`).
    let malformed = OrderDecodeError::Malformed { len };
    let mut parts = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let i = len - rest.len();
        let integer = whole.get(i + 8) == Some(&true);
        let text = texts.get(i).copied().flatten().is_some()
            && !(integer && matches!(rest.first(), Some(0x7F..=0xBF)));
        let part;
        (part, rest) = if text {
            let (raw, tail) = take_text(rest).ok_or_else(|| malformed.clone())?;
            let text = String::from_utf8(raw).map_err(|_| malformed.clone())?;
            (OrderPart::Text(text), tail)
        } else {
            let (value, tail) = take_i64(rest).ok_or_else(|| malformed.clone())?;
            if TIMES.contains(&value) {
                (OrderPart::Timestamp(value), tail)
            } else {
                (OrderPart::Integer(value), tail)
            }
        };
        parts.push(part);
    }
    Ok(DecodedOrder { parts })
}

/// How many bytes the text at the front of `bytes` takes, its end
/// included, if there is one (UTF-8, ended by `0x00 0x00`).
fn text_len(bytes: &[u8]) -> Option<usize> {
    let (raw, rest) = take_text(bytes)?;
    std::str::from_utf8(&raw).ok()?;
    Some(bytes.len() - rest.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::Delivery;
    use crate::key::{Order, OrderSpec};

    /// 2024-05-01T02:00:00Z.
    const MAY_FIRST: i64 = 1_714_528_800_000;

    fn parts(order: &Order) -> Vec<OrderPart> {
        order.decode().unwrap().parts().to_vec()
    }

    #[test]
    fn each_kind_of_component_decodes_and_displays() {
        let b = Order::builder;
        // Integers, ranks among them, either sign.
        assert_eq!(parts(&b().integer(42).build()), [OrderPart::Integer(42)]);
        assert_eq!(parts(&b().integer(-7).build()), [OrderPart::Integer(-7)]);
        assert_eq!(parts(&b().rank(0).build()), [OrderPart::Integer(0)]);
        assert_eq!(
            parts(&b().integer(i64::MAX).build()),
            [OrderPart::Integer(i64::MAX)]
        );
        assert_eq!(b().integer(-7).build().decode().unwrap().to_string(), "-7");
        // Timestamps, in RFC 3339 (UTC), to the millisecond.
        let paid = b().timestamp_ms(MAY_FIRST + 320).build();
        assert_eq!(parts(&paid), [OrderPart::Timestamp(MAY_FIRST + 320)]);
        assert_eq!(
            paid.decode().unwrap().to_string(),
            "2024-05-01T02:00:00.320Z"
        );
        // The order of the issue: `800001a24e384400`.
        let stored = Order::from_bytes(hex::decode("800001a24e384400").unwrap());
        assert_eq!(stored.decode().unwrap().to_string(), "2026-12-07T01:57:20Z");
        // Texts, quoted and escaped; NULs and the empty text too.
        assert_eq!(
            parts(&b().text("r-7").build()),
            [OrderPart::Text("r-7".into())]
        );
        assert_eq!(
            b().text("a\0\"é").build().decode().unwrap().to_string(),
            r#""a\0\"é""#
        );
        assert_eq!(
            parts(&b().text("").build()),
            [OrderPart::Text(String::new())]
        );
        // Composite orders, component by component.
        let composite = b()
            .rank(2)
            .timestamp_ms(MAY_FIRST)
            .text("a\0")
            .integer(-1)
            .text("zz")
            .build();
        assert_eq!(
            composite.decode().unwrap().to_string(),
            r#"2, 2024-05-01T02:00:00Z, "a\0", -1, "zz""#
        );
        assert_eq!(b().build().decode().unwrap().to_string(), "(empty)");
    }

    /// What a spec derives decodes to what it describes, without the
    /// spec's names.
    #[test]
    fn derived_orders_decode_to_their_values() {
        let spec = OrderSpec::parse(
            "rank:/status=pending<paid<refunded;then=timestamp:/at;then=text:/id;then=integer:/v",
        )
        .unwrap();
        let order = spec
            .derive(&Delivery::new(
                r#"{"status":"refunded","at":"2024-05-01 10:00:00.5+08:00","id":"re_1","v":-3}"#,
            ))
            .unwrap();
        assert_eq!(
            spec.describe(&order),
            r#"status=refunded, at=2024-05-01T02:00:00.500Z, id="re_1", v=-3"#
        );
        assert_eq!(
            order.decode().unwrap().to_string(),
            r#"2, 2024-05-01T02:00:00.500Z, "re_1", -3"#
        );
    }

    /// Every sequence of up to three sample components decodes back to
    /// itself, whatever comes before or after it.
    #[test]
    fn sequences_of_components_round_trip() {
        let samples = [
            OrderPart::Integer(0),
            OrderPart::Integer(3),
            OrderPart::Integer(-1),
            OrderPart::Integer(-256),
            OrderPart::Integer(1_000_000),
            OrderPart::Integer(i64::MAX),
            OrderPart::Timestamp(MAY_FIRST),
            OrderPart::Timestamp(MAY_FIRST + 1),
            OrderPart::Text(String::new()),
            OrderPart::Text("a".into()),
            OrderPart::Text("\0".into()),
            OrderPart::Text("pi_3P9f2aLkdIwHu7ix".into()),
            OrderPart::Text("€\0\0x".into()),
        ];
        let build = |parts: &[&OrderPart]| {
            parts
                .iter()
                .fold(Order::builder(), |b, part| match part {
                    OrderPart::Integer(v) | OrderPart::Timestamp(v) => b.integer(*v),
                    OrderPart::Text(t) => b.text(t),
                })
                .build()
        };
        for a in &samples {
            for b in &samples {
                for c in &samples {
                    for sequence in [vec![a], vec![a, b], vec![a, b, c]] {
                        let order = build(&sequence);
                        let want: Vec<OrderPart> = sequence.into_iter().cloned().collect();
                        assert_eq!(parts(&order), want, "{order}");
                    }
                }
            }
        }
    }

    #[test]
    fn bytes_that_are_no_order_are_refused() {
        for bad in [
            &[0x80][..],
            &[0x80, 0, 0, 0, 0, 0, 0],
            &[b'a', 0],
            &[b'a', 0, 1],
            &[0xFF, 0xFE, 0, 0],
        ] {
            assert_eq!(
                Order::from_bytes(bad.to_vec()).decode(),
                Err(OrderDecodeError::Malformed { len: bad.len() }),
                "{bad:?}"
            );
        }
        assert_eq!(
            Order::from_bytes(vec![0x80; 256]).decode(),
            Err(OrderDecodeError::TooLong { len: 256, max: 255 })
        );
    }
}
