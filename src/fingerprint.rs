//! Payload fingerprints: how onceonly tells a true duplicate from a key reused
//! with another payload.
//!
//! A fingerprint is a SHA-256 digest stored next to the key. JSON payloads are
//! hashed in their RFC 8785 canonical form (JSON Canonicalization Scheme), so
//! key order, insignificant whitespace, unicode escapes (`"\u00e9"` vs `"é"`)
//! and number spellings (`1.0` vs `1`, `1e2` vs `100`) do not change it.
//! Other payloads are hashed as raw bytes. Each form is domain-separated, so a
//! raw body can never collide with the canonical form of a JSON one.
//!
//! Note on numbers: RFC 8785 represents numbers as IEEE-754 doubles, so two
//! integers above 2^53 that round to the same double fingerprint alike. Carry
//! such amounts as strings if they must be told apart.
//!
//! A record a [payload decoder](crate::engine::PayloadDecoder) read (Avro,
//! Protobuf) is fingerprinted in its *decoded form*: the canonical JSON of
//! its value tree where object members at their zero value (`null`,
//! `false`, `0`, `""`, `[]`, `{}`) are left out, at every level, and
//! integers beyond ±2^53 are their exact decimal strings. A field a newer
//! schema version adds, unset, and the defaults proto3 does not write (but
//! an enum's, read as its first name) do not change it; two 64-bit ids
//! one apart do. A zero and a missing value fingerprint alike. A decoder
//! may also leave out members at their schema's default (the
//! [Schema Registry](crate::schema_registry) does for Avro field
//! defaults, see [`Delivery::with_fingerprinted`]): a field added with a
//! default, filled in by a re-encode, does not change it either.

use std::borrow::Cow;
use std::fmt;

use sha2::{Digest, Sha256};

use crate::delivery::Delivery;

/// A SHA-256 payload fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Builds a fingerprint from stored bytes; `None` unless exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Self)
    }

    /// Lower-case hex form.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Which part of a delivery the payload fingerprint covers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintSpec {
    /// Canonical JSON when the payload parses as JSON, raw bytes otherwise (the default).
    #[default]
    Auto,
    /// Always the raw payload bytes.
    Raw,
    /// Only the values at these JSON pointers (missing ones count as `null`),
    /// e.g. `["/amount", "/currency"]` so that a retry carrying a new
    /// timestamp is still a duplicate. Non-JSON payloads fall back to raw bytes.
    Fields(Vec<String>),
    /// No fingerprint: same key always means duplicate, conflicts are never detected.
    Disabled,
}

impl FingerprintSpec {
    /// The fingerprint of `delivery`, or `None` when disabled.
    pub fn compute(&self, delivery: &Delivery) -> Option<Fingerprint> {
        match self {
            Self::Disabled => None,
            Self::Raw => Some(raw(delivery.payload())),
            Self::Auto => Some(match delivery.fingerprinted() {
                Ok(value) => digest(b"onceonly-json\0", &canonical_tree(delivery, value)),
                Err(_) => raw(delivery.payload()),
            }),
            Self::Fields(pointers) => Some(match delivery.fingerprinted() {
                Ok(value) => {
                    let null = serde_json::Value::Null;
                    let picked: Vec<Cow<'_, serde_json::Value>> = pointers
                        .iter()
                        .map(|p| form(delivery, value.pointer(p).unwrap_or(&null)))
                        .collect();
                    digest(b"onceonly-fields\0", &canonical_bytes(&picked))
                }
                Err(_) => raw(delivery.payload()),
            }),
        }
    }
}

/// RFC 8785 canonical bytes of a serializable value.
pub fn canonical_bytes<T: serde::Serialize>(value: &T) -> Vec<u8> {
    // Serializing an in-memory serde_json value cannot fail: every map key is a
    // string and every float is finite.
    serde_json_canonicalizer::to_vec(value).unwrap_or_default()
}

/// The canonical bytes of `delivery`'s value tree `value` (its
/// [fingerprinted](Delivery::with_fingerprinted) tree when it has one):
/// RFC 8785, of the decoded form for a record a decoder read (see the
/// module docs).
pub(crate) fn canonical_tree(delivery: &Delivery, value: &serde_json::Value) -> Vec<u8> {
    canonical_bytes(&form(delivery, value))
}

/// What of `value` is fingerprinted: itself, or its decoded form (`null`
/// for a zero value) for a record a decoder read.
fn form<'v>(delivery: &Delivery, value: &'v serde_json::Value) -> Cow<'v, serde_json::Value> {
    if delivery.is_decoded() {
        Cow::Owned(decoded_form(value).unwrap_or(serde_json::Value::Null))
    } else {
        Cow::Borrowed(value)
    }
}

/// Whether the decoded form leaves `value` out: a zero value, or a
/// container of nothing but zero values.
#[cfg_attr(not(feature = "schema-registry"), allow(dead_code))]
pub(crate) fn leaves_out(value: &serde_json::Value) -> bool {
    decoded_form(value).is_none()
}

/// The decoded form of a value: `None` for a zero value, objects without
/// their zero members, integers beyond ±2^53 as exact strings.
fn decoded_form(value: &serde_json::Value) -> Option<serde_json::Value> {
    use serde_json::Value;
    const EXACT: u64 = 1 << 53;
    match value {
        Value::Null | Value::Bool(false) => None,
        Value::String(s) if s.is_empty() => None,
        Value::Number(n) if n.as_f64() == Some(0.0) => None,
        Value::Number(n)
            if n.as_i64()
                .map(i64::unsigned_abs)
                .or(n.as_u64())
                .is_some_and(|m| m > EXACT) =>
        {
            Some(Value::String(n.to_string()))
        }
        Value::Array(items) if items.is_empty() => None,
        Value::Array(items) => Some(Value::Array(
            items
                .iter()
                .map(|v| decoded_form(v).unwrap_or(Value::Null))
                .collect(),
        )),
        Value::Object(members) => {
            let kept: serde_json::Map<String, Value> = members
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), decoded_form(v)?)))
                .collect();
            (!kept.is_empty()).then_some(Value::Object(kept))
        }
        other => Some(other.clone()),
    }
}

/// Fingerprint of a parsed JSON value in canonical form.
pub fn canonical_json(value: &serde_json::Value) -> Fingerprint {
    digest(b"onceonly-json\0", &canonical_bytes(value))
}

/// Fingerprint of raw bytes.
pub fn raw(bytes: &[u8]) -> Fingerprint {
    digest(b"onceonly-raw\0", bytes)
}

fn digest(domain: &[u8], bytes: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(domain);
    h.update(bytes);
    Fingerprint(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(tree: serde_json::Value) -> Option<Fingerprint> {
        FingerprintSpec::Auto.compute(&Delivery::new(b"\0\0\0\0\x01".to_vec()).with_decoded(tree))
    }

    #[test]
    fn decoded_records_ignore_zero_values_but_not_big_integers() {
        use serde_json::json;
        let v1 = decoded(json!({"no": "T-1", "amount": 5, "buyer": {"id": "u", "tags": []}}));
        let v2 = decoded(
            json!({"no": "T-1", "amount": 5, "memo": null, "test": false,
            "fee": 0, "note": "", "buyer": {"id": "u", "tags": [], "vip": false}, "extra": {}}),
        );
        assert_eq!(v1, v2, "unset fields a newer version added change nothing");
        assert_ne!(
            v1,
            decoded(json!({"no": "T-1", "amount": 6, "buyer": {"id": "u"}}))
        );
        assert_ne!(
            decoded(json!({"payee": 9_007_199_254_740_993_u64})),
            decoded(json!({"payee": 9_007_199_254_740_992_u64})),
            "64-bit ids one apart"
        );
        assert_ne!(
            decoded(json!({"debit": -9_007_199_254_740_993_i64})),
            decoded(json!({"debit": -9_007_199_254_740_992_i64}))
        );
        // Positions in arrays stay.
        assert_ne!(decoded(json!({"a": [0, 1]})), decoded(json!({"a": [1]})));
        // The JSON form of the same record fingerprints alike (a topic
        // moving from JSON to Avro).
        assert_eq!(
            decoded(json!({"no": "T-1", "amount": 5})),
            FingerprintSpec::Auto.compute(&Delivery::new(br#"{"amount":5,"no":"T-1"}"#.to_vec()))
        );
    }

    fn fp(body: &str) -> Option<Fingerprint> {
        FingerprintSpec::Auto.compute(&Delivery::new(body.as_bytes().to_vec()))
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(
            fp(r#"{"a":1,"b":{"y":2,"x":[1,2]}}"#),
            fp("{ \"b\" : { \"x\" : [ 1 , 2 ], \"y\":2 },\n \"a\" : 1 }")
        );
    }

    #[test]
    fn unicode_escapes_are_canonicalised() {
        assert_eq!(fp(r#"{"name":"caf\u00e9"}"#), fp(r#"{"name":"café"}"#));
        assert_eq!(fp(r#"{"s":"\/"}"#), fp(r#"{"s":"/"}"#));
    }

    #[test]
    fn number_forms_are_canonicalised() {
        assert_eq!(fp(r#"{"n":1.0}"#), fp(r#"{"n":1}"#));
        assert_eq!(fp(r#"{"n":1e2}"#), fp(r#"{"n":100}"#));
        assert_eq!(fp(r#"{"n":-0.0}"#), fp(r#"{"n":0}"#));
        assert_ne!(fp(r#"{"n":100}"#), fp(r#"{"n":101}"#));
    }

    #[test]
    fn values_and_types_matter() {
        assert_ne!(fp(r#"{"n":"1"}"#), fp(r#"{"n":1}"#));
        assert_ne!(fp(r#"[1,2]"#), fp(r#"[2,1]"#));
    }

    #[test]
    fn raw_and_json_domains_are_separated() {
        let body = br#"{"a":1}"#.to_vec();
        let raw = FingerprintSpec::Raw.compute(&Delivery::new(body.clone()));
        let json = FingerprintSpec::Auto.compute(&Delivery::new(body));
        assert_ne!(raw, json);
        // Non-JSON falls back to raw bytes under Auto.
        assert_eq!(
            FingerprintSpec::Auto.compute(&Delivery::new(b"\xff\x00binary".to_vec())),
            FingerprintSpec::Raw.compute(&Delivery::new(b"\xff\x00binary".to_vec()))
        );
    }

    #[test]
    fn field_subset_ignores_other_fields() {
        let spec = FingerprintSpec::Fields(vec!["/amount".into(), "/currency".into()]);
        let a = spec.compute(&Delivery::new(
            br#"{"amount":5,"currency":"EUR","ts":1}"#.to_vec(),
        ));
        let b = spec.compute(&Delivery::new(
            br#"{"ts":2,"currency":"EUR","amount":5.0}"#.to_vec(),
        ));
        let c = spec.compute(&Delivery::new(
            br#"{"amount":6,"currency":"EUR","ts":1}"#.to_vec(),
        ));
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn disabled_gives_none() {
        assert_eq!(
            FingerprintSpec::Disabled.compute(&Delivery::new(b"x".to_vec())),
            None
        );
    }
}
