//! Protobuf messages to the value tree, as the
//! [mapping](crate::schema_registry#the-value-tree) says: the proto3 JSON
//! mapping with `.proto` field names, 64-bit integers as numbers and
//! fields without presence at their default value.

use prost_reflect::{
    DescriptorPool, DynamicMessage, FileDescriptor, MessageDescriptor, SerializeOptions,
};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

/// The name the schema's own file is compiled under (the registry does
/// not say it; references keep the import names they are given).
const SCHEMA_FILE: &str = "onceonly-registry-schema.proto";

/// A compiled `.proto` schema.
#[derive(Debug)]
pub(crate) struct ProtoSchema {
    file: FileDescriptor,
}

/// The schema's files: its own text and its references', by import name.
struct Sources(Vec<(String, String)>);

impl FileResolver for Sources {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        match self.0.iter().find(|(n, _)| n == name) {
            Some((name, text)) => File::from_source(name, text),
            None => Err(protox::Error::file_not_found(name)),
        }
    }
}

impl ProtoSchema {
    /// Compiles `text` with `references` (import name, text); the
    /// well-known `google/protobuf/*.proto` files and the ones Confluent's
    /// serializers treat as built in (`google/type/*.proto`,
    /// `confluent/meta.proto`, `confluent/type/decimal.proto`) need no
    /// reference.
    pub(crate) fn compile(text: &str, references: &[(String, String)]) -> Result<Self, String> {
        let mut sources = vec![(SCHEMA_FILE.to_owned(), text.to_owned())];
        sources.extend(references.iter().cloned());
        let mut resolver = ChainFileResolver::new();
        resolver.add(Sources(sources));
        resolver.add(Sources(
            super::builtin::FILES
                .iter()
                .map(|(name, text)| ((*name).to_owned(), (*text).to_owned()))
                .collect(),
        ));
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler
            .open_file(SCHEMA_FILE)
            .map_err(|e| format!("Protobuf schema: {e}"))?;
        let pool: DescriptorPool = compiler.descriptor_pool();
        let file = pool
            .get_file_by_name(SCHEMA_FILE)
            .ok_or_else(|| "Protobuf schema: the compiled file is missing".to_owned())?;
        if let Some(field) = any_field(&file) {
            return Err(format!(
                "field {field} is a google.protobuf.Any: records with Any fields are not read \
                 (an Any nests as deep as its bytes say, and its JSON form needs the packed type)"
            ));
        }
        Ok(Self { file })
    }

    /// The message type the Confluent message `indexes` point at. Nested
    /// messages are counted as Confluent's Java serializer counts them,
    /// without the entries protoc generates for `map` fields (Confluent's
    /// Python client counts those too: its indexes differ for messages
    /// declared after a map field).
    fn message(&self, indexes: &[usize]) -> Result<MessageDescriptor, String> {
        let missing = || format!("Protobuf message indexes {indexes:?} are not in the schema");
        let (first, nested) = indexes.split_first().ok_or_else(missing)?;
        let mut message = self.file.messages().nth(*first).ok_or_else(missing)?;
        for index in nested {
            let child = message
                .child_messages()
                .filter(|m| !m.is_map_entry())
                .nth(*index);
            message = child.ok_or_else(missing)?;
        }
        Ok(message)
    }

    /// The value tree of the message `indexes` name, encoded in `body`.
    pub(crate) fn decode(
        &self,
        indexes: &[usize],
        body: &[u8],
    ) -> Result<serde_json::Value, String> {
        let descriptor = self.message(indexes)?;
        let name = descriptor.full_name().to_owned();
        let message = DynamicMessage::decode(descriptor, body)
            .map_err(|e| format!("the payload does not decode as {name}: {e}"))?;
        let options = SerializeOptions::new()
            .use_proto_field_name(true)
            .stringify_64_bit_integers(false)
            .skip_default_fields(false);
        message
            .serialize_with_options(serde_json::value::Serializer, &options)
            .map_err(|e| format!("{name} has no JSON form: {e}"))
    }
}

/// The first field of a message of `file` (or of a message they reach)
/// whose type is `google.protobuf.Any`.
fn any_field(file: &FileDescriptor) -> Option<String> {
    let mut seen = std::collections::HashSet::new();
    let mut todo: Vec<MessageDescriptor> = file.messages().collect();
    while let Some(message) = todo.pop() {
        if !seen.insert(message.full_name().to_owned()) {
            continue;
        }
        todo.extend(message.child_messages());
        for field in message.fields() {
            if let prost_reflect::Kind::Message(of) = field.kind() {
                if of.full_name() == "google.protobuf.Any" {
                    return Some(field.full_name().to_owned());
                }
                todo.push(of);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROTO: &str = r#"
        syntax = "proto3";
        package t;
        message A { string id = 1; message B { int64 n = 1; } }
        message C { A.B b = 1; }
    "#;

    #[test]
    fn indexes_walk_top_level_then_nested_messages() {
        let schema = ProtoSchema::compile(PROTO, &[]).unwrap();
        assert_eq!(schema.message(&[0]).unwrap().full_name(), "t.A");
        assert_eq!(schema.message(&[0, 0]).unwrap().full_name(), "t.A.B");
        assert_eq!(schema.message(&[1]).unwrap().full_name(), "t.C");
        assert!(schema.message(&[2]).is_err());
        assert!(schema.message(&[0, 1]).is_err());
    }

    #[test]
    fn map_entries_do_not_count_as_nested_messages() {
        // protoc lists LabelsEntry before Buyer; Confluent's Java
        // serializer writes [0, 0] for Buyer.
        let text = "syntax = \"proto3\"; package m; message P { map<string, string> labels = 1; message Buyer { string id = 1; } }";
        let schema = ProtoSchema::compile(text, &[]).unwrap();
        assert_eq!(schema.message(&[0, 0]).unwrap().full_name(), "m.P.Buyer");
        assert!(schema.message(&[0, 1]).is_err());
    }

    #[test]
    fn any_fields_are_refused() {
        let text = "syntax = \"proto3\"; package a; import \"google/protobuf/any.proto\";
            message Outer { Inner inner = 1; } message Inner { google.protobuf.Any detail = 1; }";
        let refused = ProtoSchema::compile(text, &[]).unwrap_err();
        assert!(refused.contains("a.Inner.detail"), "{refused}");
    }

    #[test]
    fn references_are_imports_by_name() {
        let money = (
            "money.proto".to_owned(),
            "syntax = \"proto3\"; package m; message Money { int64 units = 1; }".to_owned(),
        );
        let text = "syntax = \"proto3\"; import \"money.proto\"; package p; message Refund { m.Money money = 1; }";
        let schema = ProtoSchema::compile(text, &[money]).unwrap();
        // money { units: -3 }
        let tree = schema
            .decode(
                &[0],
                b"\x0a\x0b\x08\xfd\xff\xff\xff\xff\xff\xff\xff\xff\x01",
            )
            .unwrap();
        assert_eq!(tree, serde_json::json!({"money": {"units": -3}}));
        assert!(
            ProtoSchema::compile(text, &[])
                .unwrap_err()
                .contains("money.proto")
        );
    }

    #[test]
    fn confluent_built_ins_need_no_reference() {
        let text = r#"
            syntax = "proto3";
            package p;
            import "confluent/meta.proto";
            import "confluent/type/decimal.proto";
            import "google/type/money.proto";
            message Paid {
                option (confluent.message_meta).doc = "a payment";
                string out_trade_no = 1 [(confluent.field_meta).params = { key: "pii" value: "no" }];
                google.type.Money amount = 2;
                confluent.type.Decimal fee = 3;
                int64 refunded_fen = 4;
            }
        "#;
        let schema = ProtoSchema::compile(text, &[]).unwrap();
        // out_trade_no "T", amount { currency_code "CNY", units 12, nanos 500000000 }
        let body = b"\x0a\x01T\x12\x0d\x0a\x03CNY\x10\x0c\x18\x80\xca\xb5\xee\x01";
        assert_eq!(
            schema.decode(&[0], body).unwrap(),
            serde_json::json!({
                "out_trade_no": "T",
                "amount": {"currency_code": "CNY", "units": 12, "nanos": 500_000_000},
                "refunded_fen": 0,
            })
        );
    }

    #[test]
    fn a_body_that_is_not_the_message_is_malformed() {
        let schema = ProtoSchema::compile(PROTO, &[]).unwrap();
        assert!(
            schema
                .decode(&[0], b"\x0a\xff\xff")
                .unwrap_err()
                .contains("t.A")
        );
    }
}
