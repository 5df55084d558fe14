//! The string form of key specifications, for configuration files and CLI flags.
//!
//! Grammar (options after `;`, in any order):
//!
//! ```text
//! spec     = source *( ";" option )
//! source   = "header:" NAME | "meta:" NAME | "message-key" | "json:" POINTER *( "+" POINTER ) | "fingerprint"
//! option   = "max=" 1..255 | "compact" | "uuid"
//! ```
//!
//! Examples: `header:Idempotency-Key;uuid`, `json:/out_trade_no`,
//! `json:/user_id+/coupon_id`, `fingerprint`, `json:/ref;max=100;compact`.
//! A composite is split on `+/`, so a property name that ends in `+` cannot
//! be addressed by a composite in string form; use [`KeySpec::json_fields`].

use super::{KeySource, KeySpec, KeySpecError};

pub(super) fn parse(expr: &str) -> Result<KeySpec, KeySpecError> {
    let mut parts = expr.trim().split(';');
    let source = parts.next().unwrap_or_default().trim();
    let mut spec = if let Some(name) = source.strip_prefix("header:") {
        KeySpec::new(KeySource::Metadata {
            name: name.to_owned(),
            uuid: false,
        })
    } else if let Some(name) = source.strip_prefix("meta:") {
        KeySpec::new(KeySource::Metadata {
            name: name.to_owned(),
            uuid: false,
        })
    } else if let Some(pointers) = source.strip_prefix("json:") {
        let mut list = Vec::new();
        let mut rest = pointers;
        while let Some(at) = rest.find("+/") {
            list.push(rest[..at].to_owned());
            rest = &rest[at + 1..];
        }
        list.push(rest.to_owned());
        KeySpec::new(KeySource::JsonPointers(list))
    } else if source == "message-key" {
        KeySpec::new(KeySource::MessageKey)
    } else if source == "fingerprint" {
        KeySpec::new(KeySource::Fingerprint)
    } else {
        return Err(KeySpecError::UnknownSource(expr.to_owned()));
    };
    for option in parts.map(str::trim) {
        spec = match option {
            "compact" => spec.compact_long_keys(),
            "uuid" => match spec.source {
                KeySource::Metadata { name, .. } => KeySpec {
                    source: KeySource::Metadata { name, uuid: true },
                    ..spec
                },
                _ => return Err(KeySpecError::InvalidOption(option.to_owned())),
            },
            _ => match option.strip_prefix("max=").map(str::parse::<usize>) {
                Some(Ok(max)) => spec.max_len(max),
                _ => return Err(KeySpecError::InvalidOption(option.to_owned())),
            },
        };
    }
    spec.validate()?;
    Ok(spec)
}
