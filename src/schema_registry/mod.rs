//! Avro, Protobuf and JSON Schema payloads in the Confluent Schema Registry
//! wire format (feature `schema-registry`).
//!
#![doc = include_str!("../../docs/schema_registry.md")]

mod avro;
mod builtin;
mod client;
mod defaults;
mod protobuf;
mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use reqwest::Url;
use tokio::sync::OnceCell;

use crate::delivery::Delivery;
use crate::engine::{PayloadDecoder, PayloadError};
use crate::sync::lock;

use avro::AvroSchema;
use client::{Client, Fetch};
use protobuf::ProtoSchema;

/// The most schemas kept in memory; beyond it, about half are forgotten,
/// never one being fetched or read (schemas are immutable, so a forgotten
/// one is fetched again).
const MAX_CACHED: usize = 10_000;

/// The default [`SchemaRegistryBuilder::unknown_id_grace`]: 60 s.
pub(crate) const DEFAULT_UNKNOWN_ID_GRACE: Duration = Duration::from_secs(60);

/// A [`PayloadDecoder`] for payloads in the Confluent wire format: it reads
/// the schema id, fetches that schema from the registry once (and keeps it:
/// a schema id never changes meaning), and turns the Avro, Protobuf or
/// JSON record into the value tree key specs and fingerprints read. Cheap
/// to clone; clones share the cache.
///
/// ```no_run
/// # #[cfg(all(feature = "kafka", feature = "postgres"))]
/// # fn f(store: onceonly::PgStore) -> Result<(), Box<dyn std::error::Error>> {
/// use onceonly::schema_registry::SchemaRegistry;
///
/// let registry = SchemaRegistry::builder("https://registry.example.com:8081")
///     .basic_auth("svc-payments", "secret")
///     .build()?;
/// let engine = onceonly::Engine::builder(store)
///     .key_expr("json:/out_trade_no")
///     .payload_decoder(registry);
/// let consumer = onceonly::kafka::KafkaConsumer::builder(engine)
///     .brokers("localhost:9092")
///     .group_id("payments")
///     .topic("payments");
/// # let _ = consumer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct SchemaRegistry {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    /// Read payloads without the magic byte as JSON.
    plain_json: bool,
    cache: Mutex<HashMap<u32, Arc<OnceCell<Arc<Parsed>>>>>,
    /// How long an id every registry URL calls unknown is waited for.
    unknown_id_grace: Duration,
    /// When each id was first found unknown (forgotten once found, or
    /// past the grace), at most [`MAX_CACHED`] of them.
    unknown_since: Mutex<HashMap<u32, Instant>>,
}

/// A schema ready to read payloads, or why its id cannot be used.
enum Parsed {
    Avro(Box<AvroSchema>),
    Protobuf(ProtoSchema),
    Json,
    /// The registry has it but it cannot be read: every payload written
    /// with it is malformed (kept, so that it is not fetched for each).
    Unusable(String),
}

impl SchemaRegistry {
    /// A builder for the registry at `url` (`https://host:8081`, or a base
    /// path such as Apicurio's `https://host/apis/ccompat/v7`); more URLs
    /// with [`SchemaRegistryBuilder::url`] are tried in turn when one does
    /// not answer.
    pub fn builder(url: impl Into<String>) -> SchemaRegistryBuilder {
        SchemaRegistryBuilder {
            urls: vec![url.into()],
            basic_auth: None,
            plain_json: false,
            timeout: client::DEFAULT_TIMEOUT,
            unknown_id_grace: DEFAULT_UNKNOWN_ID_GRACE,
            #[cfg(feature = "tls")]
            ca_pems: Vec::new(),
            #[cfg(feature = "tls")]
            identity_pem: None,
        }
    }

    /// The schema `id`, fetched once.
    async fn schema(&self, id: u32) -> Result<Arc<Parsed>, PayloadError> {
        let cell = {
            let mut cache = lock(&self.inner.cache);
            if cache.len() >= MAX_CACHED && !cache.contains_key(&id) {
                forget_half(&mut cache);
            }
            Arc::clone(cache.entry(id).or_default())
        };
        // One fetch per id at a time; an outage is not kept, so the next
        // delivery fetches again.
        let fetched = cell
            .get_or_try_init(|| async {
                match self.inner.client.schema(id).await {
                    Ok((answer, references)) => {
                        lock(&self.inner.unknown_since).remove(&id);
                        Ok(Arc::new(parse(id, &answer, &references)))
                    }
                    Err(Fetch::NotFound(why)) => Err(self.unknown(id, &why)),
                    Err(Fetch::Unavailable(fault, why)) => {
                        tracing::warn!(schema_id = id, %why, "schema registry unavailable");
                        Err(PayloadError::Unavailable {
                            fault,
                            source: format!("schema registry: {why}").into(),
                        })
                    }
                }
            })
            .await;
        match fetched {
            Ok(parsed) => Ok(Arc::clone(parsed)),
            Err(e) => {
                self.forget(id);
                Err(e)
            }
        }
    }

    /// What an id the registry does not know is: waited for (as an
    /// outage) during the grace since it was first found unknown, since a
    /// registry replica may lag behind the one a producer registered the
    /// schema with; malformed after it.
    fn unknown(&self, id: u32, why: &str) -> PayloadError {
        let now = Instant::now();
        let mut since = lock(&self.inner.unknown_since);
        if since.len() >= MAX_CACHED && !since.contains_key(&id) {
            let grace = self.inner.unknown_id_grace;
            since.retain(|_, first| now.duration_since(*first) <= grace);
        }
        let first = *since.entry(id).or_insert(now);
        if now.duration_since(first) < self.inner.unknown_id_grace {
            tracing::warn!(schema_id = id, %why, "schema id unknown to the registry; waiting in case a replica lags");
            return PayloadError::Unavailable {
                fault: crate::store::InfraFault::Unreachable,
                source: format!("schema registry: schema id {id} not found yet: {why}").into(),
            };
        }
        PayloadError::Malformed(format!("schema id {id}: {why}"))
    }

    /// Drops `id`'s cache entry unless a schema arrived in it meanwhile.
    fn forget(&self, id: u32) {
        let mut cache = lock(&self.inner.cache);
        if cache.get(&id).is_some_and(|cell| !cell.initialized()) {
            cache.remove(&id);
        }
    }

    /// How many schemas are held in memory (for tests and diagnostics).
    pub fn cached_schemas(&self) -> usize {
        lock(&self.inner.cache)
            .values()
            .filter(|cell| cell.initialized())
            .count()
    }
}

/// Forgets idle entries until half of the cache is left: a bound against
/// payloads naming ever new ids.
fn forget_half(cache: &mut HashMap<u32, Arc<OnceCell<Arc<Parsed>>>>) {
    let mut over = cache.len() - MAX_CACHED / 2;
    cache.retain(|_, cell| {
        if over > 0 && Arc::strong_count(cell) == 1 && cell.initialized() {
            over -= 1;
            return false;
        }
        true
    });
}

fn parse(id: u32, answer: &client::Answer, references: &[(String, String)]) -> Parsed {
    let parsed = match answer.schema_type.as_deref().unwrap_or("AVRO") {
        "AVRO" => {
            let texts: Vec<String> = references.iter().map(|(_, text)| text.clone()).collect();
            AvroSchema::parse(&answer.schema, &texts).map(|s| Parsed::Avro(Box::new(s)))
        }
        "PROTOBUF" => ProtoSchema::compile(&answer.schema, references).map(Parsed::Protobuf),
        "JSON" => Ok(Parsed::Json),
        other => Err(format!("schema type {other} is not supported")),
    };
    parsed.unwrap_or_else(|why| {
        tracing::error!(schema_id = id, %why, "schema cannot be used");
        Parsed::Unusable(why)
    })
}

impl SchemaRegistry {
    /// The value tree of `delivery`'s record and, for an Avro record whose
    /// schema has defaults, the tree its fingerprint reads; `None` for a
    /// payload read as it is.
    async fn read(&self, delivery: &Delivery) -> Result<Option<Record>, PayloadError> {
        let payload = delivery.payload();
        if self.inner.plain_json && payload.first() != Some(&0) {
            // Read as it is: parsed and fingerprinted as JSON, exactly as
            // before the topic had a decoder.
            return Ok(None);
        }
        let (id, body) = wire::split(payload).map_err(PayloadError::Malformed)?;
        let schema = self.schema(id).await?;
        let record = match &*schema {
            Parsed::Avro(avro) => avro.decode(body),
            Parsed::Protobuf(proto) => wire::message_indexes(body)
                .and_then(|(indexes, message)| proto.decode(&indexes, message))
                .map(Record::plain),
            Parsed::Json => serde_json::from_slice(body)
                .map(Record::plain)
                .map_err(|e| format!("the payload is not the JSON its schema says: {e}")),
            Parsed::Unusable(why) => Err(format!("schema id {id} cannot be used: {why}")),
        };
        record
            .map(Some)
            .map_err(|why| PayloadError::Malformed(format!("schema id {id}: {why}")))
    }
}

/// A record's value tree, and the tree its fingerprint reads when that is
/// another (members at their schema's default left out).
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) tree: serde_json::Value,
    pub(crate) fingerprinted: Option<serde_json::Value>,
}

impl Record {
    fn plain(tree: serde_json::Value) -> Self {
        Self {
            tree,
            fingerprinted: None,
        }
    }
}

#[async_trait]
impl PayloadDecoder for SchemaRegistry {
    async fn decode(&self, delivery: &Delivery) -> Result<Option<serde_json::Value>, PayloadError> {
        Ok(self.read(delivery).await?.map(|record| record.tree))
    }

    async fn decode_delivery(&self, delivery: &Delivery) -> Result<Option<Delivery>, PayloadError> {
        Ok(self.read(delivery).await?.map(|record| {
            let decoded = delivery.clone().with_decoded(record.tree);
            match record.fingerprinted {
                Some(tree) => decoded.with_fingerprinted(tree),
                None => decoded,
            }
        }))
    }
}

/// A [`SchemaRegistry`] that cannot work. Returned by
/// [`SchemaRegistryBuilder::build`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A URL does not parse, or is not `http` or `https`.
    #[error("schema registry URL {url:?}: {why}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The HTTP client could not be set up (a certificate or key that
    /// does not parse, a TLS backend that cannot start).
    #[error("schema registry client: {0}")]
    Client(String),
    /// The [timeout](SchemaRegistryBuilder::timeout) is zero: every call
    /// would fail.
    #[error("the schema registry timeout must be longer than zero")]
    ZeroTimeout,
}

/// Configures a [`SchemaRegistry`]: URLs, credentials, TLS and timeout.
#[must_use]
pub struct SchemaRegistryBuilder {
    urls: Vec<String>,
    basic_auth: Option<(String, String)>,
    plain_json: bool,
    timeout: Duration,
    unknown_id_grace: Duration,
    #[cfg(feature = "tls")]
    ca_pems: Vec<Vec<u8>>,
    #[cfg(feature = "tls")]
    identity_pem: Option<Vec<u8>>,
}

impl SchemaRegistryBuilder {
    /// Another registry URL, tried when the ones before it do not answer
    /// (Confluent clients' comma-separated `schema.registry.url`).
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.urls.push(url.into());
        self
    }

    /// HTTP basic authentication (Confluent's
    /// `basic.auth.user.info=user:password`; Confluent Cloud's API key and
    /// secret). Credentials in the URL itself are refused by `build`.
    pub fn basic_auth(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.basic_auth = Some((user.into(), password.into()));
        self
    }

    /// Reads payloads that are not in the wire format (their first byte
    /// is not the magic byte 0) as they are, as plain JSON, for a topic
    /// moving from JSON to Avro or Protobuf: their keys and fingerprints
    /// are exactly what they were without a decoder, so a redelivery of a
    /// record processed before the move is still a duplicate. Without it
    /// (the default) they are rejected `decode_error`.
    pub fn plain_json(mut self, read: bool) -> Self {
        self.plain_json = read;
        self
    }

    /// The longest a registry call may take, connecting included (default
    /// 10 s); a registry slower than this is waited out like one that is
    /// down.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long a schema id that every registry URL calls unknown is
    /// waited for, like an outage, before its payloads are malformed
    /// (`decode_error`) (default 60 s): a registry
    /// replica may not have the schema a producer just registered with
    /// another. Counted from the first time the id was found unknown; zero
    /// dead-letters at once.
    pub fn unknown_id_grace(mut self, grace: Duration) -> Self {
        self.unknown_id_grace = grace;
        self
    }

    /// Trusts the CA certificates in `pem` as well as the system's, for a
    /// registry with a private CA (Confluent's
    /// `schema.registry.ssl.truststore`). Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pems.push(pem.into());
        self
    }

    /// Presents the client certificate and PKCS#8 private key in `pem`
    /// (both in one PEM text) to a registry that asks for mutual TLS
    /// (Confluent's `schema.registry.ssl.keystore`). Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn client_identity_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.identity_pem = Some(pem.into());
        self
    }

    /// Checks the URLs and sets up the client. Nothing is fetched yet: a
    /// registry that is down when the consumer starts is waited out at the
    /// first delivery.
    pub fn build(self) -> Result<SchemaRegistry, RegistryError> {
        if self.timeout.is_zero() {
            return Err(RegistryError::ZeroTimeout);
        }
        let mut urls = Vec::with_capacity(self.urls.len());
        for raw in &self.urls {
            let bad = |why: &str| RegistryError::Url {
                url: raw.clone(),
                why: why.to_owned(),
            };
            let url = Url::parse(raw).map_err(|e| bad(&e.to_string()))?;
            match url.scheme() {
                "http" => {}
                "https" if cfg!(feature = "tls") => {}
                "https" => return Err(bad("https needs onceonly's `tls` feature")),
                _ => return Err(bad("not an http or https URL")),
            }
            if !url.username().is_empty() || url.password().is_some() {
                return Err(bad(
                    "credentials in the URL would be logged: use basic_auth()",
                ));
            }
            if url.cannot_be_a_base() {
                return Err(bad("not a base URL"));
            }
            urls.push(url);
        }
        let client_error = |e: reqwest::Error| RegistryError::Client(e.to_string());
        let builder = reqwest::Client::builder()
            .timeout(self.timeout)
            .connect_timeout(self.timeout)
            .redirect(reqwest::redirect::Policy::none());
        #[cfg(feature = "tls")]
        let builder = {
            let mut builder = builder;
            for pem in &self.ca_pems {
                for cert in reqwest::Certificate::from_pem_bundle(pem).map_err(client_error)? {
                    builder = builder.add_root_certificate(cert);
                }
            }
            if let Some(pem) = &self.identity_pem {
                builder = builder.identity(reqwest::Identity::from_pem(pem).map_err(client_error)?);
            }
            builder
        };
        let http = builder.build().map_err(client_error)?;
        Ok(SchemaRegistry {
            inner: Arc::new(Inner {
                client: Client {
                    http,
                    urls,
                    basic_auth: self.basic_auth,
                },
                plain_json: self.plain_json,
                cache: Mutex::new(HashMap::new()),
                unknown_id_grace: self.unknown_id_grace,
                unknown_since: Mutex::new(HashMap::new()),
            }),
        })
    }
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self
            .inner
            .client
            .urls
            .iter()
            .map(client::redacted)
            .collect();
        f.debug_struct("SchemaRegistry")
            .field("urls", &urls)
            .finish_non_exhaustive()
    }
}
