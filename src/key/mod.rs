//! Business keys: how a delivery is mapped to the key that must be processed once.
//!
//! A [`KeySpec`] says where the key comes from ([`KeySource`]) and which limits
//! it must respect. It is built in code ([`KeySpec::header`],
//! [`KeySpec::json_field`], [`KeySpec::json_fields`], [`KeySpec::fingerprint`],
//! [`KeySpec::custom`]) or parsed from a string ([`KeySpec::parse`], see
//! [the string form](self#string-form) for the grammar) so that it can live in a config
//! file or a CLI flag. A malformed expression is a [`KeySpecError`] when the
//! consumer is built; a delivery without a usable key is a [`KeyError`] with a
//! precise reason, never a panic.
//!
#![doc = include_str!("../../docs/keys.md")]
#![doc = include_str!("../../docs/fences.md")]

mod error;
mod fence;
mod parse;

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::delivery::Delivery;
use crate::fingerprint::canonical_bytes;

pub use error::{KeyError, KeySpecError, OrderDecodeError};
pub use fence::{DecodedOrder, FenceSpec, FenceValue, Order, OrderBuilder, OrderPart, OrderSpec};

/// The default and largest key length in bytes (the store's column size).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Length of a compacted key: `sha256:` followed by 64 hex digits.
const COMPACT_LEN: usize = 7 + 64;

/// A validated idempotency key: non-empty UTF-8, no control characters,
/// within the configured length.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdemKey(String);

impl IdemKey {
    /// Validates `raw` against the default limits (255 bytes, no compaction).
    pub fn new(raw: impl Into<String>) -> Result<Self, KeyError> {
        validate(raw.into(), MAX_KEY_LEN, false)
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Debug for IdemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for IdemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdemKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A user function deriving a key from a delivery.
pub type KeyFn = Arc<dyn Fn(&Delivery) -> Result<String, KeyError> + Send + Sync>;

/// Where a key comes from.
#[derive(Clone)]
#[non_exhaustive]
pub enum KeySource {
    /// A header or metadata entry (`Idempotency-Key`, an AMQP message id, ...).
    Metadata {
        /// Entry name, matched case-insensitively.
        name: String,
        /// Require the value to be a UUID.
        uuid: bool,
    },
    /// The broker's message key: a Kafka record key, an AMQP `message_id`.
    MessageKey,
    /// One or more JSON pointers into the payload. One pointer gives the value
    /// itself; several give a JSON array of the values as strings
    /// (`["u1","c9"]`), which is unambiguous even when a value contains a
    /// separator-like character.
    JsonPointers(Vec<String>),
    /// SHA-256 over method, path, canonical JSON body (raw bytes if not JSON)
    /// and principal, each length-prefixed; the key is the hex digest.
    Fingerprint,
    /// A user function.
    Custom(KeyFn),
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Metadata { name, uuid } => f
                .debug_struct("Metadata")
                .field("name", name)
                .field("uuid", uuid)
                .finish(),
            Self::MessageKey => f.write_str("MessageKey"),
            Self::JsonPointers(p) => f.debug_tuple("JsonPointers").field(p).finish(),
            Self::Fingerprint => f.write_str("Fingerprint"),
            Self::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// How to derive and validate the key of each delivery.
#[derive(Clone, Debug)]
pub struct KeySpec {
    source: KeySource,
    max_len: usize,
    compact: bool,
}

impl KeySpec {
    fn new(source: KeySource) -> Self {
        Self {
            source,
            max_len: MAX_KEY_LEN,
            compact: false,
        }
    }

    /// Parses the string form, e.g. `json:/out_trade_no` (see the module docs).
    pub fn parse(expr: &str) -> Result<Self, KeySpecError> {
        parse::parse(expr)
    }

    /// Key from the broker's message key: the Kafka record key, or the AMQP
    /// `message_id` property. String form: `message-key`.
    pub fn message_key() -> Self {
        Self::new(KeySource::MessageKey)
    }

    /// Key from a header or metadata entry.
    pub fn header(name: impl Into<String>) -> Self {
        Self::new(KeySource::Metadata {
            name: name.into(),
            uuid: false,
        })
    }

    /// Key from a header that must hold a UUID.
    pub fn uuid_header(name: impl Into<String>) -> Self {
        Self::new(KeySource::Metadata {
            name: name.into(),
            uuid: true,
        })
    }

    /// Key from one JSON pointer, e.g. `/out_trade_no`.
    pub fn json_field(pointer: impl Into<String>) -> Self {
        Self::new(KeySource::JsonPointers(vec![pointer.into()]))
    }

    /// Composite key from several JSON pointers, e.g. `["/user_id", "/coupon_id"]`.
    pub fn json_fields<I, P>(pointers: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        Self::new(KeySource::JsonPointers(
            pointers.into_iter().map(Into::into).collect(),
        ))
    }

    /// Server-side fingerprint key over method, path, canonical body and principal.
    pub fn fingerprint() -> Self {
        Self::new(KeySource::Fingerprint)
    }

    /// Key from a user function.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&Delivery) -> Result<String, KeyError> + Send + Sync + 'static,
    {
        Self::new(KeySource::Custom(Arc::new(f)))
    }

    /// Sets the maximum key length in bytes (1..=255; checked by [`KeySpec::validate`]).
    #[must_use]
    pub fn max_len(mut self, max: usize) -> Self {
        self.max_len = max;
        self
    }

    /// Hash keys longer than the maximum into `sha256:<hex>` instead of rejecting them.
    #[must_use]
    pub fn compact_long_keys(mut self) -> Self {
        self.compact = true;
        self
    }

    /// The key source.
    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// Checks the spec itself; builders call this so errors surface at build time.
    pub fn validate(&self) -> Result<(), KeySpecError> {
        if self.max_len == 0 || self.max_len > MAX_KEY_LEN {
            return Err(KeySpecError::MaxLength(self.max_len));
        }
        if self.compact && self.max_len < COMPACT_LEN {
            return Err(KeySpecError::CompactTooShort {
                min: COMPACT_LEN,
                max: self.max_len,
            });
        }
        match &self.source {
            KeySource::Metadata { name, .. } => {
                let valid = !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b));
                if !valid {
                    return Err(KeySpecError::InvalidName(name.clone()));
                }
            }
            KeySource::JsonPointers(pointers) => {
                if pointers.is_empty() {
                    return Err(KeySpecError::InvalidPointer(String::new()));
                }
                if let Some(bad) = pointers.iter().find(|p| !p.starts_with('/')) {
                    return Err(KeySpecError::InvalidPointer(bad.clone()));
                }
            }
            KeySource::MessageKey | KeySource::Fingerprint | KeySource::Custom(_) => {}
        }
        Ok(())
    }

    /// Derives and validates the key of `delivery`.
    pub fn derive(&self, delivery: &Delivery) -> Result<IdemKey, KeyError> {
        let raw = match &self.source {
            KeySource::Metadata { name, uuid } => {
                let bytes = delivery
                    .metadata(name)
                    .ok_or_else(|| KeyError::MissingMetadata { name: name.clone() })?;
                let text = std::str::from_utf8(bytes).map_err(|_| KeyError::NotUtf8)?;
                if *uuid && uuid::Uuid::try_parse(text).is_err() {
                    return Err(KeyError::NotUuid);
                }
                text.to_owned()
            }
            KeySource::MessageKey => {
                let bytes = delivery.message_key().ok_or(KeyError::MissingMessageKey)?;
                std::str::from_utf8(bytes)
                    .map_err(|_| KeyError::NotUtf8)?
                    .to_owned()
            }
            KeySource::JsonPointers(pointers) => {
                let json = delivery
                    .json()
                    .map_err(|e| KeyError::NotJson(e.to_owned()))?;
                let mut values = pointers
                    .iter()
                    .map(|p| scalar_at(json, p))
                    .collect::<Result<Vec<_>, _>>()?;
                if values.len() == 1 {
                    values.pop().unwrap_or_default()
                } else {
                    String::from_utf8(canonical_bytes(&values)).map_err(|_| KeyError::NotUtf8)?
                }
            }
            KeySource::Fingerprint => fingerprint_key(delivery),
            KeySource::Custom(f) => f(delivery)?,
        };
        validate(raw, self.max_len, self.compact)
    }
}

fn scalar_at(json: &serde_json::Value, pointer: &str) -> Result<String, KeyError> {
    use serde_json::Value;
    match json.pointer(pointer) {
        None | Some(Value::Null) => Err(KeyError::MissingField {
            pointer: pointer.to_owned(),
        }),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(Value::Bool(b)) => Ok(b.to_string()),
        Some(Value::Array(_) | Value::Object(_)) => Err(KeyError::NotScalar {
            pointer: pointer.to_owned(),
        }),
    }
}

fn fingerprint_key(delivery: &Delivery) -> String {
    let mut h = Sha256::new();
    let body = match delivery.fingerprinted() {
        Ok(v) => crate::fingerprint::canonical_tree(delivery, v),
        Err(_) => delivery.payload().to_vec(),
    };
    for part in [
        delivery.method().unwrap_or_default().as_bytes(),
        delivery.path().unwrap_or_default().as_bytes(),
        &body,
        delivery.principal().unwrap_or_default().as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    hex::encode(h.finalize())
}

fn validate(raw: String, max_len: usize, compact: bool) -> Result<IdemKey, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    if let Some(at) = raw.bytes().position(|b| b.is_ascii_control()) {
        return Err(KeyError::ControlCharacter { at });
    }
    if raw.len() > max_len {
        if compact {
            return Ok(IdemKey(format!(
                "sha256:{}",
                hex::encode(Sha256::digest(raw.as_bytes()))
            )));
        }
        return Err(KeyError::TooLong {
            len: raw.len(),
            max: max_len,
        });
    }
    Ok(IdemKey(raw))
}

#[cfg(test)]
mod tests;
