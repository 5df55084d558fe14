//! The string form of an [`OrderSpec`]: parsed by
//! [`OrderSpec::parse`], written back by its `Display` (the grammar is in
//! the type's documentation).

use std::fmt;

use super::component::{Field, Kind};
use super::spec::{OrderSpec, Source};
use crate::key::KeySpecError;

/// Parses the string form, and validates it.
pub(super) fn parse(expr: &str) -> Result<OrderSpec, KeySpecError> {
    let mut items = expr.trim().split(';').map(str::trim);
    let mut spec = parse_component(items.next().unwrap_or_default())?;
    for item in items {
        if let Some(component) = item.strip_prefix("then=") {
            spec = spec.then(parse_component(component.trim())?);
        } else if let Some(offset) = item.strip_prefix("offset=") {
            if spec.offset.is_some() {
                return Err(KeySpecError::InvalidOrder(format!(
                    "`offset=` given twice in {expr:?}"
                )));
            }
            let seconds = parse_offset(offset.trim()).ok_or_else(|| {
                KeySpecError::InvalidOrder(format!(
                    "offset {offset:?}: expected `+HH:MM`, `-HH:MM` or `Z`"
                ))
            })?;
            spec = spec.with_offset(seconds);
        } else {
            return Err(KeySpecError::InvalidOrder(format!(
                "unknown item {item:?}: expected `then=COMPONENT` or `offset=+HH:MM`"
            )));
        }
    }
    spec.validate()?;
    Ok(spec)
}

/// The string form ([`OrderSpec::parse`] reads it back); a custom order is
/// `custom`, an invalid one `invalid`.
impl fmt::Display for OrderSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let components = match &self.source {
            Source::Custom(_) => return f.write_str("custom"),
            Source::Invalid(_) => return f.write_str("invalid"),
            Source::Components(components) => components,
        };
        for (i, component) in components.iter().enumerate() {
            if i > 0 {
                f.write_str(";then=")?;
            }
            let fields = match &component.field {
                Field::Json(pointers) => pointers.join("|"),
                Field::Header(name) => {
                    write!(f, "header:{name}")?;
                    continue;
                }
            };
            match &component.kind {
                Kind::Integer => write!(f, "integer:{fields}")?,
                Kind::Timestamp => write!(f, "timestamp:{fields}")?,
                Kind::Text => write!(f, "text:{fields}")?,
                Kind::Rank(ranks) => write!(f, "rank:{fields}={}", ranks.join("<"))?,
            }
        }
        if let Some(offset) = self.offset {
            let sign = if offset < 0 { '-' } else { '+' };
            let abs = offset.unsigned_abs();
            write!(f, ";offset={sign}{:02}:{:02}", abs / 3600, abs / 60 % 60)?;
            if abs % 60 != 0 {
                write!(f, ":{:02}", abs % 60)?;
            }
        }
        Ok(())
    }
}

fn parse_component(text: &str) -> Result<OrderSpec, KeySpecError> {
    let unknown = || {
        KeySpecError::InvalidOrder(format!(
            "unknown order component {text:?}: expected `integer:/POINTER`, `timestamp:/POINTER`, `text:/POINTER`, `rank:/POINTER=A<B<...` or `header:NAME`"
        ))
    };
    let (kind, rest) = text.split_once(':').ok_or_else(unknown)?;
    let pointers = |list: &str| {
        let mut pointers = Vec::new();
        let mut rest = list;
        while let Some(at) = rest.find("|/") {
            pointers.push(rest[..at].to_owned());
            rest = &rest[at + 1..];
        }
        pointers.push(rest.to_owned());
        Field::Json(pointers)
    };
    let (kind, field) = match kind.trim() {
        "integer" => (Kind::Integer, pointers(rest)),
        "timestamp" => (Kind::Timestamp, pointers(rest)),
        "text" => (Kind::Text, pointers(rest)),
        "header" => (Kind::Integer, Field::Header(rest.to_owned())),
        "rank" => {
            let (list, values) = rest.split_once('=').ok_or_else(|| {
                KeySpecError::InvalidOrder(format!(
                    "rank {text:?} has no values: expected `rank:/POINTER=A<B<...`"
                ))
            })?;
            let ranks = values.split('<').map(|v| v.trim().to_owned()).collect();
            (Kind::Rank(ranks), pointers(list.trim_end()))
        }
        _ => return Err(unknown()),
    };
    Ok(OrderSpec::component(kind, field))
}

/// `+HH:MM`, `-HH:MM`, `+HH:MM:SS` or `Z`, in seconds east of UTC.
fn parse_offset(text: &str) -> Option<i32> {
    if text.eq_ignore_ascii_case("z") {
        return Some(0);
    }
    let (sign, rest) = match text.as_bytes().first()? {
        b'+' => (1, &text[1..]),
        b'-' => (-1, &text[1..]),
        _ => return None,
    };
    let mut parts = rest.split(':');
    let mut two_digits = |required: bool| -> Option<Option<i32>> {
        match parts.next() {
            None if !required => Some(None),
            Some(p) if p.len() == 2 && p.bytes().all(|b| b.is_ascii_digit()) => {
                Some(p.parse().ok())
            }
            _ => None,
        }
    };
    let hours = two_digits(true)??;
    let minutes = two_digits(true)??;
    let seconds = two_digits(false)?.unwrap_or(0);
    if parts.next().is_some() || minutes > 59 || seconds > 59 {
        return None;
    }
    Some(sign * (hours * 3600 + minutes * 60 + seconds))
}
