//! Avro records to the value tree, as the
//! [mapping table](crate::schema_registry#the-value-tree) says.

use std::collections::{HashMap, HashSet};
use std::io::Read;

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::schema::ResolvedSchema;
use apache_avro::types::Value as Avro;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Map, Number, Value};

use super::Record;
use super::defaults::{self, Defaults};

/// The largest decimal scale read: beyond it a record is refused rather
/// than a string of that many digits built.
pub(super) const MAX_SCALE: usize = 1_000;

/// A writer schema with the named schemas its references bring, ready
/// to read records.
#[derive(Debug)]
pub(crate) struct AvroSchema {
    writer: Schema,
    references: Vec<Schema>,
    /// Named types by full name, to follow `Ref`s while building the tree.
    names: HashMap<String, Schema>,
    /// The record fields whose default the fingerprint does not leave
    /// out anyway, with the default in the tree's form, converted once:
    /// when there are any, a record's fingerprint reads a second tree,
    /// without the members at their default.
    defaults: Defaults,
}

impl AvroSchema {
    /// Parses `text` with `references` (each a schema text, in the order the
    /// registry lists them, already including their own references).
    ///
    /// A recursive schema (a named type that contains itself, such as a
    /// linked list) is refused: records of it nest as deep as their bytes
    /// say, and reading them would overflow the stack on a hostile payload.
    pub(crate) fn parse(text: &str, references: &[String]) -> Result<Self, String> {
        let (writer, references) = if references.is_empty() {
            (
                Schema::parse_str(text).map_err(|e| e.to_string())?,
                Vec::new(),
            )
        } else {
            Schema::parse_str_with_list(text, references).map_err(|e| e.to_string())?
        };
        let names: HashMap<String, Schema> = {
            let resolved =
                ResolvedSchema::new_with_schemata(references.iter().chain([&writer]).collect())
                    .map_err(|e| e.to_string())?;
            resolved
                .get_names()
                .iter()
                .map(|(name, schema)| (name.fullname(None), (*schema).clone()))
                .collect()
        };
        if let Some(name) = recursive(&writer, &names, &mut Vec::new(), &mut HashSet::new()) {
            return Err(format!(
                "the named type {name} contains itself: recursive schemas are not read"
            ));
        }
        if let Some(items) = weightless_items(&writer, &names, &mut HashSet::new()) {
            return Err(format!(
                "an array of {items}, which take no bytes: a few bytes of a record could stand for billions of items, so such schemas are not read"
            ));
        }
        let defaults = defaults::of(&writer, &names);
        Ok(Self {
            writer,
            references,
            names,
            defaults,
        })
    }

    /// The value tree of one datum, and the tree its fingerprint reads
    /// when the schema has defaults.
    pub(crate) fn decode(&self, body: &[u8]) -> Result<Record, String> {
        let resolved = ResolvedSchema::new_with_schemata(
            self.references.iter().chain([&self.writer]).collect(),
        )
        .map_err(|e| format!("Avro schema: {e}"))?;
        let reader = GenericDatumReader::builder(&self.writer)
            .resolved_writer_schemata(resolved)
            .build()
            .map_err(|e| format!("Avro schema: {e}"))?;
        let mut input = Strict::new(body);
        let value = reader.read_value(&mut input);
        // apache-avro reads a union, a boolean or a string cut short as
        // `null` (the end of a container file): any read past the end is a
        // truncated record here.
        if input.overran {
            return Err("the Avro record is truncated".to_owned());
        }
        let value =
            value.map_err(|e| format!("the payload does not match its Avro schema: {e}"))?;
        if !input.rest.is_empty() {
            return Err(format!(
                "{} bytes left after the Avro record: the payload does not match its schema",
                input.rest.len()
            ));
        }
        let tree = tree(&value, &self.writer, &self.names)?;
        let fingerprinted = (!self.defaults.is_empty())
            .then(|| strip(&value, &tree, &self.writer, &self.names, &self.defaults));
        Ok(Record {
            tree,
            fingerprinted,
        })
    }
}

/// The payload as a reader that remembers being asked for more than it
/// holds.
struct Strict<'a> {
    rest: &'a [u8],
    overran: bool,
}

impl<'a> Strict<'a> {
    fn new(rest: &'a [u8]) -> Self {
        Self {
            rest,
            overran: false,
        }
    }
}

impl Read for Strict<'_> {
    /// A read past the end fails (not `Ok(0)`): apache-avro reads a union
    /// or a boolean at the end of its input as `null`, so an array whose
    /// block count promises millions of union items would otherwise fill
    /// memory with nulls read from nothing.
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !buf.is_empty() && self.rest.is_empty() {
            self.overran = true;
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the Avro record is truncated",
            ));
        }
        self.rest.read(buf)
    }
}

/// The items of an array in `schema` that take no bytes to write (`null`,
/// a zero-size `fixed`, a record of such fields), described: an array of
/// them is as long as its block count says, whatever the payload's size.
fn weightless_items(
    schema: &Schema,
    names: &HashMap<String, Schema>,
    seen: &mut HashSet<String>,
) -> Option<String> {
    let children: Vec<&Schema> = match schema {
        Schema::Ref { name } => {
            let full = name.fullname(None);
            if !seen.insert(full.clone()) {
                return None;
            }
            return names
                .get(&full)
                .and_then(|named| weightless_items(named, names, seen));
        }
        Schema::Array(a) => {
            if weightless(&a.items, names, 0) {
                return Some(format!("{:?}", a.items));
            }
            vec![&*a.items]
        }
        Schema::Record(r) => r.fields.iter().map(|f| &f.schema).collect(),
        Schema::Map(m) => vec![&*m.types],
        Schema::Union(u) => u.variants().iter().collect(),
        _ => Vec::new(),
    };
    children
        .into_iter()
        .find_map(|child| weightless_items(child, names, seen))
}

/// Whether a value of `schema` may be written in zero bytes. `depth`
/// bounds the references followed (schemas are not recursive by then).
fn weightless(schema: &Schema, names: &HashMap<String, Schema>, depth: usize) -> bool {
    if depth > 64 {
        return false;
    }
    match schema {
        Schema::Null => true,
        Schema::Fixed(f) => f.size == 0,
        Schema::Decimal(d) => {
            matches!(&d.inner, apache_avro::schema::InnerDecimalSchema::Fixed(f) if f.size == 0)
        }
        Schema::Record(r) => r
            .fields
            .iter()
            .all(|f| weightless(&f.schema, names, depth + 1)),
        Schema::Ref { name } => names
            .get(&name.fullname(None))
            .is_some_and(|named| weightless(named, names, depth + 1)),
        _ => false,
    }
}

/// The first named type found inside itself, following references.
fn recursive(
    schema: &Schema,
    names: &HashMap<String, Schema>,
    path: &mut Vec<String>,
    done: &mut HashSet<String>,
) -> Option<String> {
    let (name, children): (Option<String>, Vec<&Schema>) = match schema {
        Schema::Ref { name } => {
            let full = name.fullname(None);
            if path.contains(&full) {
                return Some(full);
            }
            if done.contains(&full) {
                return None;
            }
            return names
                .get(&full)
                .and_then(|named| recursive(named, names, path, done));
        }
        Schema::Record(r) => (
            Some(r.name.fullname(None)),
            r.fields.iter().map(|f| &f.schema).collect(),
        ),
        Schema::Array(a) => (None, vec![&*a.items]),
        Schema::Map(m) => (None, vec![&*m.types]),
        Schema::Union(u) => (None, u.variants().iter().collect()),
        _ => (None, Vec::new()),
    };
    if let Some(name) = &name {
        path.push(name.clone());
    }
    let found = children
        .into_iter()
        .find_map(|child| recursive(child, names, path, done));
    if let Some(name) = name {
        path.pop();
        done.insert(name);
    }
    found
}

/// The value tree of `value`, read under `schema`.
fn tree(value: &Avro, schema: &Schema, names: &HashMap<String, Schema>) -> Result<Value, String> {
    let schema = match schema {
        Schema::Ref { name } => names
            .get(&name.fullname(None))
            .ok_or_else(|| format!("Avro schema: unknown named type {}", name.fullname(None)))?,
        other => other,
    };
    Ok(match (value, schema) {
        (Avro::Null, Schema::Null) => Value::Null,
        (Avro::Null, other) => {
            return Err(format!(
                "the Avro record is truncated: null read for {other:?}"
            ));
        }
        (Avro::Boolean(b), _) => Value::Bool(*b),
        (Avro::Int(n) | Avro::Date(n) | Avro::TimeMillis(n), _) => Value::from(*n),
        (
            Avro::Long(n)
            | Avro::TimeMicros(n)
            | Avro::TimestampMillis(n)
            | Avro::TimestampMicros(n)
            | Avro::TimestampNanos(n)
            | Avro::LocalTimestampMillis(n)
            | Avro::LocalTimestampMicros(n)
            | Avro::LocalTimestampNanos(n),
            _,
        ) => Value::from(*n),
        (Avro::Float(f), _) => float(f64::from(*f)),
        (Avro::Double(f), _) => float(*f),
        (Avro::String(s) | Avro::Enum(_, s), _) => Value::String(s.clone()),
        (Avro::Bytes(b) | Avro::Fixed(_, b), _) => Value::String(BASE64.encode(b)),
        (Avro::Uuid(u), _) => Value::String(u.to_string()),
        (Avro::BigDecimal(d), _) => {
            // Its scale is the record's to say: 3·10⁹ would be a string
            // of 3 GB.
            let scale = d.fractional_digit_count();
            if scale.unsigned_abs() > MAX_SCALE as u64 {
                return Err(format!(
                    "Avro big-decimal scale {scale} is beyond ±{MAX_SCALE}"
                ));
            }
            Value::String(d.to_plain_string())
        }
        (Avro::Decimal(d), Schema::Decimal(s)) => {
            if s.scale > MAX_SCALE {
                return Err(format!(
                    "Avro decimal scale {} is above {MAX_SCALE}",
                    s.scale
                ));
            }
            let unscaled = num_bigint::BigInt::from(d.clone());
            Value::String(with_scale(&unscaled.to_string(), s.scale))
        }
        (Avro::Decimal(_), other) => {
            return Err(format!("Avro decimal read under a {other:?} schema"));
        }
        (Avro::Duration(d), _) => serde_json::json!({
            "months": u32::from(d.months()),
            "days": u32::from(d.days()),
            "millis": u32::from(d.millis()),
        }),
        (Avro::Union(index, inner), Schema::Union(u)) => {
            let branch = usize::try_from(*index)
                .ok()
                .and_then(|i| u.variants().get(i))
                .ok_or_else(|| format!("Avro union branch {index} is not in the schema"))?;
            tree(inner, branch, names)?
        }
        (Avro::Array(items), Schema::Array(a)) => Value::Array(
            items
                .iter()
                .map(|item| tree(item, &a.items, names))
                .collect::<Result<_, _>>()?,
        ),
        (Avro::Map(entries), Schema::Map(m)) => Value::Object(
            entries
                .iter()
                .map(|(k, v)| Ok((k.clone(), tree(v, &m.types, names)?)))
                .collect::<Result<Map<_, _>, String>>()?,
        ),
        (Avro::Record(fields), Schema::Record(r)) => {
            let mut object = Map::new();
            for ((name, value), field) in fields.iter().zip(&r.fields) {
                object.insert(name.clone(), tree(value, &field.schema, names)?);
            }
            Value::Object(object)
        }
        (value, schema) => {
            return Err(format!(
                "Avro value {value:?} does not fit its schema {schema:?}"
            ));
        }
    })
}

/// The tree the fingerprint reads of `value`, whose value tree is `full`
/// (built by [`tree`] under `schema`): without the record fields at their
/// schema's default, and with a field whose default is not a zero value
/// but whose value is one kept as [`defaults::explicit`] (the fingerprint
/// leaves zero values out, and "at the default" and "set to zero" must
/// differ). A walk of the tree already built: each default is compared
/// once, never a subtree built again.
fn strip(
    value: &Avro,
    full: &Value,
    schema: &Schema,
    names: &HashMap<String, Schema>,
    defaults: &Defaults,
) -> Value {
    let schema = match schema {
        Schema::Ref { name } => match names.get(&name.fullname(None)) {
            Some(named) => named,
            None => return full.clone(),
        },
        other => other,
    };
    match (value, schema, full) {
        (Avro::Union(index, inner), Schema::Union(u), _) => {
            match usize::try_from(*index)
                .ok()
                .and_then(|i| u.variants().get(i))
            {
                Some(branch) => strip(inner, full, branch, names, defaults),
                None => full.clone(),
            }
        }
        (Avro::Array(items), Schema::Array(a), Value::Array(built)) => Value::Array(
            items
                .iter()
                .zip(built)
                .map(|(item, full)| strip(item, full, &a.items, names, defaults))
                .collect(),
        ),
        (Avro::Map(entries), Schema::Map(m), Value::Object(built)) => Value::Object(
            entries
                .iter()
                .filter_map(|(k, v)| {
                    let full = built.get(k)?;
                    Some((k.clone(), strip(v, full, &m.types, names, defaults)))
                })
                .collect(),
        ),
        (Avro::Record(fields), Schema::Record(r), Value::Object(built)) => {
            let fields_defaults = defaults.get(&r.name.fullname(None));
            let mut object = Map::new();
            for ((name, value), field) in fields.iter().zip(&r.fields) {
                let Some(full) = built.get(name) else {
                    continue;
                };
                let default = fields_defaults.and_then(|d| d.get(&field.name));
                if default == Some(full) {
                    continue;
                }
                let stripped = strip(value, full, &field.schema, names, defaults);
                let kept = if default.is_some() && crate::fingerprint::leaves_out(&stripped) {
                    defaults::explicit(full)
                } else {
                    stripped
                };
                object.insert(name.clone(), kept);
            }
            Value::Object(object)
        }
        _ => full.clone(),
    }
}

/// A JSON number, or the string Protobuf's JSON mapping also uses for a
/// float JSON cannot carry.
pub(super) fn float(f: f64) -> Value {
    match Number::from_f64(f) {
        Some(n) => Value::Number(n),
        None if f.is_nan() => Value::String("NaN".to_owned()),
        None if f > 0.0 => Value::String("Infinity".to_owned()),
        None => Value::String("-Infinity".to_owned()),
    }
}

/// `unscaled` (a decimal integer, maybe negative) with `scale` digits after
/// the point: `with_scale("-5", 2)` is `"-0.05"`.
pub(super) fn with_scale(unscaled: &str, scale: usize) -> String {
    if scale == 0 {
        return unscaled.to_owned();
    }
    let (sign, digits) = match unscaled.strip_prefix('-') {
        Some(digits) => ("-", digits),
        None => ("", unscaled),
    };
    let digits = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = digits.split_at(digits.len() - scale);
    format!("{sign}{int}.{frac}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_keep_their_scale() {
        assert_eq!(with_scale("12345", 2), "123.45");
        assert_eq!(with_scale("-5", 2), "-0.05");
        assert_eq!(with_scale("5", 0), "5");
        assert_eq!(with_scale("0", 3), "0.000");
        assert_eq!(with_scale("-120", 1), "-12.0");
    }

    #[test]
    fn floats_json_cannot_carry_become_strings() {
        assert_eq!(float(f64::NAN), "NaN");
        assert_eq!(float(f64::INFINITY), "Infinity");
        assert_eq!(float(f64::NEG_INFINITY), "-Infinity");
        assert_eq!(float(1.5), 1.5);
    }

    #[test]
    fn recursive_schemas_are_refused() {
        let list = r#"{"type":"record","name":"N","fields":[{"name":"next","type":["null","N"]}]}"#;
        assert!(
            AvroSchema::parse(list, &[])
                .unwrap_err()
                .contains("contains itself")
        );
        let tree = r#"{"type":"record","name":"T","fields":[
            {"name":"kids","type":{"type":"array","items":{"type":"record","name":"K","fields":[
                {"name":"up","type":["null","T"]}]}}}]}"#;
        assert!(
            AvroSchema::parse(tree, &[])
                .unwrap_err()
                .contains("contains itself")
        );
        // A named type used twice side by side is not recursion.
        let twice = r#"{"type":"record","name":"P","fields":[
            {"name":"a","type":{"type":"fixed","name":"Amt","size":8,"logicalType":"decimal","precision":18,"scale":2}},
            {"name":"b","type":"Amt"}]}"#;
        let schema = AvroSchema::parse(twice, &[]).unwrap();
        let mut body = vec![0u8; 7];
        body.push(0x7b); // 1.23
        body.extend([0xff; 8]); // -0.01
        assert_eq!(
            schema.decode(&body).unwrap().tree,
            serde_json::json!({"a": "1.23", "b": "-0.01"})
        );
    }

    #[test]
    fn a_record_cut_short_is_truncated_not_null() {
        let schema = AvroSchema::parse(
            r#"{"type":"record","name":"R","fields":[
                {"name":"id","type":"string"},
                {"name":"memo","type":["null","string"],"default":null},
                {"name":"ok","type":"boolean"}]}"#,
            &[],
        )
        .unwrap();
        // id "ab", memo null, ok true
        assert_eq!(
            schema.decode(b"\x04ab\x00\x01").unwrap().tree,
            serde_json::json!({"id": "ab", "memo": null, "ok": true})
        );
        for cut in [&b"\x04ab\x00"[..], b"\x04ab", b"\x04a"] {
            assert!(
                schema.decode(cut).unwrap_err().contains("truncated"),
                "{cut:?}"
            );
        }
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let schema = AvroSchema::parse(
            r#"{"type":"record","name":"R","fields":[{"name":"a","type":"int"}]}"#,
            &[],
        )
        .unwrap();
        assert_eq!(
            schema.decode(b"\x02").unwrap().tree,
            serde_json::json!({"a": 1})
        );
        assert!(
            schema
                .decode(b"\x02\x02")
                .unwrap_err()
                .contains("left after")
        );
        assert!(schema.decode(b"").unwrap_err().contains("truncated"));
    }

    /// Issue 44, defect 2: a 15-byte big-decimal whose scale is 3·10⁹
    /// (or -3·10⁹) is refused instead of written out in gigabytes.
    #[test]
    fn a_big_decimal_with_a_huge_scale_is_refused() {
        let schema = AvroSchema::parse(
            r#"{"type":"record","name":"R","fields":[
                {"name":"d","type":{"type":"bytes","logicalType":"big-decimal"}}]}"#,
            &[],
        )
        .unwrap();
        // Inner bytes: varint length 1, unscaled 7, zigzag varint scale.
        let with_scale = |scale: i64| {
            let mut inner = vec![0x02, 0x07];
            let mut z = ((scale << 1) ^ (scale >> 63)) as u64;
            loop {
                let b = (z & 0x7f) as u8;
                z >>= 7;
                if z == 0 {
                    inner.push(b);
                    break;
                }
                inner.push(b | 0x80);
            }
            let mut body = vec![(inner.len() as u8) << 1];
            body.extend(inner);
            body
        };
        assert_eq!(
            schema.decode(&with_scale(2)).unwrap().tree,
            serde_json::json!({"d": "0.07"})
        );
        for scale in [3_000_000_000_i64, -3_000_000_000] {
            let body = with_scale(scale);
            assert!(body.len() <= 15, "{}", body.len());
            let e = schema.decode(&body).unwrap_err();
            assert!(e.contains("scale"), "{scale}: {e}");
        }
    }

    /// Issue 44, defect 2: an array of `["null", "string"]` whose block
    /// count promises 2^40 items, in a few bytes, is refused as
    /// truncated without reading nulls from nothing; arrays of items that
    /// take no bytes are refused with their schema.
    #[test]
    fn arrays_cannot_promise_more_items_than_their_bytes_hold() {
        let schema = AvroSchema::parse(
            r#"{"type":"record","name":"R","fields":[
                {"name":"xs","type":{"type":"array","items":["null","string"]}}]}"#,
            &[],
        )
        .unwrap();
        // block count 2^20 (zigzag varint), then nothing.
        let e = schema.decode(&[0x80, 0x80, 0x80, 0x01]).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        // A real array still reads: [null, "a"].
        assert_eq!(
            schema
                .decode(&[0x04, 0x00, 0x02, 0x02, b'a', 0x00])
                .unwrap()
                .tree,
            serde_json::json!({"xs": [null, "a"]})
        );
        for weightless in [
            r#"{"type":"array","items":"null"}"#,
            r#"{"type":"array","items":{"type":"fixed","name":"Z","size":0}}"#,
            r#"{"type":"record","name":"O","fields":[{"name":"a","type":{"type":"array","items":
                {"type":"record","name":"E","fields":[{"name":"n","type":"null"}]}}}]}"#,
        ] {
            let e = AvroSchema::parse(weightless, &[]).unwrap_err();
            assert!(e.contains("take no bytes"), "{weightless}: {e}");
        }
    }
}
