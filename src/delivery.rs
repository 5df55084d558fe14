//! The transport-neutral view of one delivery.
//!
//! Every transport (Kafka, AMQP, HTTP) translates its wire message into a
//! [`Delivery`]: the payload bytes, the metadata entries (headers, broker
//! properties), the source coordinates used for audits, and for HTTP the
//! request line and principal. Key derivation and fingerprints read only this
//! type, so they behave identically whatever the transport.

use std::sync::OnceLock;

/// One delivery of a message, request or callback, as seen by the engine.
#[derive(Debug, Default, Clone)]
pub struct Delivery {
    payload: Vec<u8>,
    metadata: Vec<(String, Vec<u8>)>,
    source: Option<String>,
    method: Option<String>,
    path: Option<String>,
    principal: Option<String>,
    message_key: Option<Vec<u8>>,
    suspect: bool,
    json: OnceLock<Result<serde_json::Value, String>>,
    decoded: bool,
    fingerprinted: Option<serde_json::Value>,
}

impl Delivery {
    /// A delivery carrying `payload`, with no metadata.
    pub fn new(payload: impl Into<Vec<u8>>) -> Self {
        Self {
            payload: payload.into(),
            ..Self::default()
        }
    }

    /// Adds a metadata entry (a header, or a broker property such as a message id).
    ///
    /// Names are matched case-insensitively by [`Delivery::metadata`]; the first
    /// entry with a given name wins.
    #[must_use]
    pub fn with_metadata(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.metadata.push((name.into(), value.into()));
        self
    }

    /// Sets the source coordinates stored with the record, e.g. `payments/3@1042`.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Sets the HTTP method and path, used by the `fingerprint` key.
    #[must_use]
    pub fn with_request(mut self, method: impl Into<String>, path: impl Into<String>) -> Self {
        self.method = Some(method.into());
        self.path = Some(path.into());
        self
    }

    /// Sets the authenticated principal (user or tenant), used by the `fingerprint` key.
    #[must_use]
    pub fn with_principal(mut self, principal: impl Into<String>) -> Self {
        self.principal = Some(principal.into());
        self
    }

    /// Sets the broker's own message key (a Kafka record key, an AMQP
    /// `message_id`), read by [`KeySpec::message_key`](crate::KeySpec::message_key).
    #[must_use]
    pub fn with_message_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.message_key = Some(key.into());
        self
    }

    /// Marks the delivery as a *suspect*: it may be a redelivery of a
    /// message whose handler was running when its process died (an abort,
    /// an out-of-memory kill, a segfault). The engine then counts the start
    /// of its handler durably before running it, and dead-letters it with
    /// reason `crashed` instead once it has crashed the process
    /// [`max_crashes`](crate::EngineBuilder::max_crashes) times; see
    /// [`ClaimSpec::suspect`](crate::engine::ClaimSpec::suspect). The
    /// broker consumers set it themselves (AMQP: a redelivered message;
    /// Kafka: the first records of a partition lane after an assignment).
    #[must_use]
    pub fn with_suspect(mut self, suspect: bool) -> Self {
        self.suspect = suspect;
        self
    }

    /// Sets the payload's value tree, as a
    /// [payload decoder](crate::engine::PayloadDecoder) read it (an Avro or
    /// Protobuf record): key specs, fingerprints and [`Json`](crate::Json)
    /// inputs read `tree` instead of parsing the payload as JSON; the raw
    /// payload stays what dead letters carry.
    #[must_use]
    pub fn with_decoded(mut self, tree: serde_json::Value) -> Self {
        self.json = OnceLock::from(Ok(tree));
        self.decoded = true;
        self.fingerprinted = None;
        self
    }

    /// Sets the tree the payload fingerprint reads, for a decoded record
    /// (see [`Delivery::with_decoded`]) whose schema stands for values left
    /// out: the value tree without the members at their schema's default
    /// (an Avro field's `default`), so that a record re-encoded under a
    /// newer schema version that fills a default in is a duplicate of the
    /// record written before the field existed. Key specs, fences and
    /// inputs still read the full value tree.
    #[must_use]
    pub fn with_fingerprinted(mut self, tree: serde_json::Value) -> Self {
        self.fingerprinted = Some(tree);
        self
    }

    /// The tree the payload fingerprint reads: the one set by
    /// [`Delivery::with_fingerprinted`], or else [`Delivery::json`].
    pub(crate) fn fingerprinted(&self) -> Result<&serde_json::Value, &str> {
        match &self.fingerprinted {
            Some(tree) => Ok(tree),
            None => self.json(),
        }
    }

    /// Whether the payload's value tree was set by a decoder (see
    /// [`Delivery::with_decoded`]) rather than parsed from JSON.
    pub fn is_decoded(&self) -> bool {
        self.decoded
    }

    /// Whether the delivery is a suspect (see [`Delivery::with_suspect`]).
    pub fn is_suspect(&self) -> bool {
        self.suspect
    }

    /// The broker's message key, if the message has one.
    pub fn message_key(&self) -> Option<&[u8]> {
        self.message_key.as_deref()
    }

    /// The raw payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The value of the first metadata entry named `name` (ASCII case-insensitive).
    pub fn metadata(&self, name: &str) -> Option<&[u8]> {
        self.metadata
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// All metadata entries in arrival order.
    pub fn metadata_entries(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.metadata
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
    }

    /// The source coordinates, if the transport set them.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// The HTTP method, if any.
    pub fn method(&self) -> Option<&str> {
        self.method.as_deref()
    }

    /// The HTTP path, if any.
    pub fn path(&self) -> Option<&str> {
        self.path.as_deref()
    }

    /// The authenticated principal, if any.
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }

    /// The payload parsed as JSON, parsed at most once per delivery, or the
    /// value tree a decoder set (see [`Delivery::with_decoded`]).
    ///
    /// Returns the parser's message when the payload is not valid JSON.
    pub fn json(&self) -> Result<&serde_json::Value, &str> {
        self.json
            .get_or_init(|| serde_json::from_slice(&self.payload).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_lookup_is_case_insensitive_and_first_wins() {
        let d = Delivery::new(b"{}".to_vec())
            .with_metadata("Idempotency-Key", "a")
            .with_metadata("idempotency-key", "b");
        assert_eq!(d.metadata("IDEMPOTENCY-KEY"), Some(&b"a"[..]));
        assert_eq!(d.metadata("missing"), None);
    }

    #[test]
    fn json_is_parsed_lazily_and_errors_are_kept() {
        let d = Delivery::new(b"{not json".to_vec());
        assert!(d.json().is_err());
        let d = Delivery::new(br#"{"a":1}"#.to_vec());
        assert_eq!(
            d.json()
                .ok()
                .and_then(|v| v.get("a"))
                .and_then(|v| v.as_i64()),
            Some(1)
        );
    }
}
