//! One component of an order spec: where its value is read from (a JSON
//! pointer, with fallbacks, or a header), what it is read as (an integer,
//! a timestamp, a rank, a text), and how it is appended to an
//! [`Order`](super::Order)'s bytes and read back by its spec.

use serde_json::Value;

use super::order::{push_i64, push_text, take_i64, take_text};
use super::time::{
    EpochUnit, datetime_millis, epoch_unit, float_millis, format_millis, unix_millis,
};
use crate::delivery::Delivery;
use crate::key::{KeyError, Order};

/// What a component's value is read as.
#[derive(Clone, Debug)]
pub(super) enum Kind {
    Integer,
    Timestamp,
    /// The ranked values, lowest first.
    Rank(Vec<String>),
    Text,
}

/// Where a component's value comes from.
#[derive(Clone, Debug)]
pub(super) enum Field {
    /// The first of these JSON pointers whose value is present and not `null`.
    Json(Vec<String>),
    /// A metadata entry (header), by name.
    Header(String),
}

/// One component of an order: what its value is read as, and where from.
#[derive(Clone, Debug)]
pub(super) struct Component {
    pub(super) kind: Kind,
    pub(super) field: Field,
}

pub(super) fn too_long(len: usize, pointer: &str) -> KeyError {
    bad(
        pointer,
        format!(
            "the order is {len} bytes long, the maximum is {}",
            Order::MAX_LEN
        ),
    )
}

fn bad(pointer: &str, reason: impl Into<String>) -> KeyError {
    KeyError::BadOrder {
        pointer: pointer.to_owned(),
        reason: reason.into(),
    }
}

impl Component {
    /// The field(s) as `describe` and error messages name them: pointers
    /// without their leading `/`, joined by `|`; a header by its name.
    pub(super) fn label(&self) -> String {
        match &self.field {
            Field::Json(pointers) => pointers
                .iter()
                .map(|p| p.strip_prefix('/').unwrap_or(p))
                .collect::<Vec<_>>()
                .join("|"),
            Field::Header(name) => name.clone(),
        }
    }

    pub(super) fn append(
        &self,
        delivery: &Delivery,
        offset: i32,
        out: &mut Vec<u8>,
    ) -> Result<(), KeyError> {
        match &self.field {
            Field::Header(name) => {
                let raw = delivery
                    .metadata(name)
                    .ok_or_else(|| KeyError::MissingMetadata { name: name.clone() })?;
                let text = std::str::from_utf8(raw).map_err(|_| bad(name, "not UTF-8"))?;
                self.append_text_value(text.trim(), name, offset, out)
            }
            Field::Json(pointers) => {
                let json = delivery
                    .json()
                    .map_err(|e| KeyError::NotJson(e.to_owned()))?;
                let (pointer, value) = pointers
                    .iter()
                    .find_map(|p| json.pointer(p).filter(|v| !v.is_null()).map(|v| (p, v)))
                    .ok_or_else(|| KeyError::MissingField {
                        pointer: pointers.join("|"),
                    })?;
                match value {
                    Value::String(text) => self.append_text_value(text, pointer, offset, out),
                    Value::Number(n) => self.append_number(n, pointer, out),
                    Value::Bool(b) => match &self.kind {
                        Kind::Rank(ranks) => append_rank(ranks, &b.to_string(), pointer, out),
                        _ => Err(bad(pointer, "a boolean")),
                    },
                    _ => Err(bad(pointer, "an object or an array, not a scalar")),
                }
            }
        }
    }

    /// A string value (a JSON string, or a header's text).
    fn append_text_value(
        &self,
        text: &str,
        pointer: &str,
        offset: i32,
        out: &mut Vec<u8>,
    ) -> Result<(), KeyError> {
        match &self.kind {
            Kind::Integer => {
                let value = text
                    .parse::<i64>()
                    .map_err(|_| bad(pointer, "not an integer (or out of the i64 range)"))?;
                push_i64(out, value);
            }
            Kind::Timestamp => {
                let millis = match unix_millis(text) {
                    Some(millis) => millis.map_err(|reason| bad(pointer, reason))?,
                    None => datetime_millis(text, offset).ok_or_else(|| {
                        bad(
                            pointer,
                            "not a timestamp (RFC 3339, `YYYY-MM-DD HH:MM:SS` or Unix seconds)",
                        )
                    })?,
                };
                push_i64(out, millis);
            }
            Kind::Rank(ranks) => return append_rank(ranks, text, pointer, out),
            Kind::Text => push_text(out, text),
        }
        Ok(())
    }

    fn append_number(
        &self,
        n: &serde_json::Number,
        pointer: &str,
        out: &mut Vec<u8>,
    ) -> Result<(), KeyError> {
        match &self.kind {
            Kind::Integer => {
                let value = match (n.as_i64(), n.as_u64()) {
                    (Some(v), _) => v,
                    (None, Some(_)) => return Err(bad(pointer, "out of the i64 range")),
                    (None, None) => return Err(bad(pointer, "not an integer")),
                };
                push_i64(out, value);
            }
            Kind::Timestamp => {
                let millis = match epoch_unit(n) {
                    // Seconds, exactly as written (fractions included).
                    EpochUnit::Seconds => {
                        let text = n.to_string();
                        match unix_millis(&text) {
                            Some(millis) => millis.map_err(|reason| bad(pointer, reason))?,
                            // serde_json writes large or tiny floats with an exponent.
                            None => float_millis(n.as_f64())
                                .ok_or_else(|| bad(pointer, "out of range"))?,
                        }
                    }
                    finer => finer
                        .millis(n)
                        .ok_or_else(|| bad(pointer, "out of range"))?,
                };
                push_i64(out, millis);
            }
            Kind::Rank(ranks) => return append_rank(ranks, &n.to_string(), pointer, out),
            Kind::Text => {
                return Err(bad(
                    pointer,
                    "a number, not a string (text orders compare strings: use `integer`)",
                ));
            }
        }
        Ok(())
    }

    /// One component decoded from the front of `bytes`, and the rest.
    pub(super) fn decode<'b>(&self, bytes: &'b [u8]) -> Option<(String, &'b [u8])> {
        match &self.kind {
            Kind::Integer => take_i64(bytes).map(|(v, rest)| (v.to_string(), rest)),
            Kind::Timestamp => take_i64(bytes).map(|(v, rest)| (format_millis(v), rest)),
            Kind::Rank(ranks) => take_i64(bytes).map(|(v, rest)| {
                let name = usize::try_from(v).ok().and_then(|i| ranks.get(i));
                (name.cloned().unwrap_or_else(|| format!("#{v}")), rest)
            }),
            Kind::Text => take_text(bytes)
                .map(|(text, rest)| (format!("{:?}", String::from_utf8_lossy(&text)), rest)),
        }
    }
}

fn append_rank(
    ranks: &[String],
    value: &str,
    pointer: &str,
    out: &mut Vec<u8>,
) -> Result<(), KeyError> {
    let index = ranks.iter().position(|r| r == value).ok_or_else(|| {
        bad(
            pointer,
            format!("not one of the {} ranked values", ranks.len()),
        )
    })?;
    push_i64(
        out,
        i64::try_from(index).map_err(|_| bad(pointer, "rank out of range"))?,
    );
    Ok(())
}
