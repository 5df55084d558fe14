//! Avro field defaults in the value tree's form: a record written before
//! a field existed and the same record re-encoded under a newer schema
//! version, with the field's `default` filled in, stand for the same
//! values (that is Avro's schema resolution), so their fingerprints leave
//! a member at its default out.

use std::collections::{HashMap, HashSet};

use apache_avro::Schema;
use apache_avro::schema::UuidSchema;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Map, Value};

use super::avro::{MAX_SCALE, float, with_scale};

/// The deepest a default is followed through named types: schemas are
/// not recursive (the decoder refuses those), so this is only a bound.
const MAX_DEPTH: usize = 64;

/// The defaults the fingerprint has to know, by record (full name) and
/// field name, in the tree's form.
pub(crate) type Defaults = HashMap<String, HashMap<String, Value>>;

/// The record fields anywhere in `schema` whose default, in the tree's
/// form, is not one the fingerprint leaves out anyway (a zero value):
/// without any, no second tree is built.
pub(super) fn of(schema: &Schema, names: &HashMap<String, Schema>) -> Defaults {
    let mut found = Defaults::new();
    collect(schema, names, &mut HashSet::new(), &mut found);
    found
}

fn collect(
    schema: &Schema,
    names: &HashMap<String, Schema>,
    seen: &mut HashSet<String>,
    found: &mut Defaults,
) {
    match schema {
        Schema::Ref { name } => {
            if let Some(named) = names.get(&name.fullname(None)) {
                collect(named, names, seen, found);
            }
        }
        Schema::Record(r) => {
            let record = r.name.fullname(None);
            if !seen.insert(record.clone()) {
                return;
            }
            for field in &r.fields {
                if let Some(default) = field
                    .default
                    .as_ref()
                    .and_then(|d| default_tree(d, &field.schema, names))
                    .filter(|d| !crate::fingerprint::leaves_out(d))
                {
                    found
                        .entry(record.clone())
                        .or_default()
                        .insert(field.name.clone(), default);
                }
                collect(&field.schema, names, seen, found);
            }
        }
        Schema::Array(a) => collect(&a.items, names, seen, found),
        Schema::Map(m) => collect(&m.types, names, seen, found),
        Schema::Union(u) => {
            for variant in u.variants() {
                collect(variant, names, seen, found);
            }
        }
        _ => {}
    }
}

/// How the fingerprint reads a field whose default is not a zero value
/// but whose value is one (`false` where the default is `true`, `0` where
/// it is `1`): not left out as a zero value is, since it is not the
/// default, but as a string no value tree holds (it starts with NUL)
/// carrying the value's canonical JSON.
pub(super) fn explicit(value: &Value) -> Value {
    let canonical = crate::fingerprint::canonical_bytes(value);
    Value::String(format!("\u{0}set {}", String::from_utf8_lossy(&canonical)))
}

/// The value tree a field of `schema` whose record left it out reads as:
/// its `default` (Avro's JSON encoding of a value) in the form the decoder
/// gives the written value. `None` when the default does not fit the
/// schema, or is of a type whose default is not read here (`big-decimal`,
/// `duration`, a `uuid` not carried as a string): such a field is then
/// always fingerprinted.
pub(super) fn default_tree(
    default: &Value,
    schema: &Schema,
    names: &HashMap<String, Schema>,
) -> Option<Value> {
    tree(default, schema, names, 0)
}

fn tree(
    default: &Value,
    schema: &Schema,
    names: &HashMap<String, Schema>,
    depth: usize,
) -> Option<Value> {
    if depth > MAX_DEPTH {
        return None;
    }
    let depth = depth + 1;
    match schema {
        Schema::Ref { name } => tree(default, names.get(&name.fullname(None))?, names, depth),
        Schema::Null => default.is_null().then_some(Value::Null),
        Schema::Boolean => default.as_bool().map(Value::Bool),
        Schema::Int
        | Schema::Long
        | Schema::Date
        | Schema::TimeMillis
        | Schema::TimeMicros
        | Schema::TimestampMillis
        | Schema::TimestampMicros
        | Schema::TimestampNanos
        | Schema::LocalTimestampMillis
        | Schema::LocalTimestampMicros
        | Schema::LocalTimestampNanos => default.as_i64().map(Value::from),
        // Read as the 32-bit float the record would carry.
        #[allow(clippy::cast_possible_truncation)]
        Schema::Float => default.as_f64().map(|f| float(f64::from(f as f32))),
        Schema::Double => default.as_f64().map(float),
        Schema::String | Schema::Enum(_) => default.as_str().map(|s| Value::String(s.to_owned())),
        // The decoder writes a uuid in lower case.
        Schema::Uuid(UuidSchema::String) => default
            .as_str()
            .map(|s| Value::String(s.to_ascii_lowercase())),
        Schema::Bytes | Schema::Fixed(_) => Some(Value::String(BASE64.encode(latin1(default)?))),
        Schema::Decimal(d) if d.scale <= MAX_SCALE => {
            let unscaled = num_bigint::BigInt::from_signed_bytes_be(&latin1(default)?);
            Some(Value::String(with_scale(&unscaled.to_string(), d.scale)))
        }
        Schema::Union(u) => u
            .variants()
            .iter()
            .find_map(|variant| tree(default, variant, names, depth)),
        Schema::Array(a) => default
            .as_array()?
            .iter()
            .map(|item| tree(item, &a.items, names, depth))
            .collect::<Option<Vec<_>>>()
            .map(Value::Array),
        Schema::Map(m) => default
            .as_object()?
            .iter()
            .map(|(k, v)| Some((k.clone(), tree(v, &m.types, names, depth)?)))
            .collect::<Option<Map<_, _>>>()
            .map(Value::Object),
        Schema::Record(r) => {
            let given = default.as_object()?;
            r.fields
                .iter()
                .map(|f| {
                    let member = given.get(&f.name).or(f.default.as_ref())?;
                    Some((f.name.clone(), tree(member, &f.schema, names, depth)?))
                })
                .collect::<Option<Map<_, _>>>()
                .map(Value::Object)
        }
        _ => None,
    }
}

/// The bytes of an Avro `bytes` or `fixed` default: a JSON string whose
/// characters are the code points 0-255 of the bytes.
fn latin1(default: &Value) -> Option<Vec<u8>> {
    default
        .as_str()?
        .chars()
        .map(|c| u8::try_from(u32::from(c)).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn of(default: Value, schema: &str) -> Option<Value> {
        let schema = Schema::parse_str(schema).unwrap();
        default_tree(&default, &schema, &HashMap::new())
    }

    #[test]
    fn defaults_read_as_the_written_value_would() {
        assert_eq!(of(json!("web"), r#""string""#), Some(json!("web")));
        assert_eq!(of(json!(7), r#""long""#), Some(json!(7)));
        assert_eq!(
            of(json!(0.1), r#""float""#),
            Some(float(f64::from(0.1_f32)))
        );
        assert_eq!(of(json!(1), r#""double""#), Some(float(1.0)));
        assert_eq!(of(json!("\u{1}\u{ff}"), r#""bytes""#), Some(json!("Af8=")));
        assert_eq!(
            of(
                json!("\u{30}\u{39}"),
                r#"{"type":"bytes","logicalType":"decimal","precision":6,"scale":2}"#
            ),
            Some(json!("123.45"))
        );
        assert_eq!(of(json!("EUR"), r#"["string","null"]"#), Some(json!("EUR")));
        assert_eq!(
            of(
                json!({"a": 1}),
                r#"{"type":"record","name":"R","fields":[{"name":"a","type":"int"},{"name":"b","type":"string","default":"x"}]}"#
            ),
            Some(json!({"a": 1, "b": "x"}))
        );
        // A default that does not fit, or is not read: never left out.
        assert_eq!(of(json!("Ā"), r#""bytes""#), None);
        assert_eq!(of(json!("x"), r#""int""#), None);
    }

    #[test]
    fn only_defaults_that_are_not_zero_values_are_kept() {
        let of_text = |text: &str| super::of(&Schema::parse_str(text).unwrap(), &HashMap::new());
        assert!(
            of_text(
                r#"{"type":"record","name":"P","fields":[{"name":"memo","type":["null","string"],"default":null},{"name":"n","type":"int","default":0}]}"#
            )
            .is_empty()
        );
        let nested = of_text(
            r#"{"type":"record","name":"P","namespace":"x","fields":[
                {"name":"b","type":{"type":"record","name":"B","fields":[{"name":"channel","type":"string","default":"web"}]}},
                {"name":"fee","type":{"type":"bytes","logicalType":"decimal","precision":4,"scale":2},"default":""}]}"#,
        );
        assert_eq!(nested["x.B"].get("channel"), Some(&json!("web")));
        // An empty decimal default reads as "0.00", which is not left out.
        assert_eq!(nested["x.P"].get("fee"), Some(&json!("0.00")));
    }
}
