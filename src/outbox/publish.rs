//! Publishers: what sends an outbox row to its destination and reports
//! only a confirmed delivery as success.

use async_trait::async_trait;

use super::backend::OutboxRow;
use super::message::{CAUSATION_HEADER, Kind, MESSAGE_ID_HEADER, TRACEPARENT_HEADER};

/// One message as it leaves: the row and every header it carries (the
/// user's, then [`MESSAGE_ID_HEADER`], [`CAUSATION_HEADER`] and
/// [`TRACEPARENT_HEADER`]).
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// The row.
    pub row: &'a OutboxRow,
    /// The headers to send.
    pub headers: Vec<(String, String)>,
}

impl<'a> Outgoing<'a> {
    pub(crate) fn new(row: &'a OutboxRow) -> Self {
        let mut headers = row.header_pairs();
        headers.push((MESSAGE_ID_HEADER.to_owned(), row.message_id.clone()));
        if let Some(causation) = &row.causation {
            headers.push((CAUSATION_HEADER.to_owned(), causation.clone()));
        }
        if let Some(traceparent) = &row.traceparent {
            headers.push((TRACEPARENT_HEADER.to_owned(), traceparent.clone()));
        }
        Self { row, headers }
    }
}

/// A publish that was not confirmed.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    permanent: bool,
    message: String,
}

impl PublishError {
    /// A failure worth retrying (broker or endpoint unavailable, timeout,
    /// 5xx).
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            permanent: false,
            message: message.into(),
        }
    }

    /// A failure retrying cannot fix (the endpoint refused the message with
    /// a 4xx, the destination does not exist): the row is parked as dead.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            permanent: true,
            message: message.into(),
        }
    }

    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

/// Sends outbox rows of one [`Kind`]. `Ok` means the destination confirmed
/// the message (Kafka: acknowledged by all in-sync replicas; AMQP: a
/// publisher confirm for a routed message; webhook: a 2xx answer).
#[async_trait]
pub trait Publisher: Send + Sync {
    /// The kind of destination this publisher serves.
    fn kind(&self) -> Kind;

    /// Publishes one message and waits for its confirmation.
    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError>;
}

/// A shared publisher.
#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    fn kind(&self) -> Kind {
        (**self).kind()
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        (**self).publish(message).await
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use std::time::Duration;

    use async_trait::async_trait;
    use rdkafka::ClientConfig;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    use super::{Kind, Outgoing, PublishError, Publisher};

    /// Publishes to Kafka with an idempotent producer (`acks=all`,
    /// `enable.idempotence=true`): a record counts as sent once every
    /// in-sync replica has it.
    pub struct KafkaPublisher {
        producer: FutureProducer,
        timeout: Duration,
    }

    impl KafkaPublisher {
        /// A producer for `brokers` (`host:port,...`).
        pub fn new(brokers: &str) -> Result<Self, rdkafka::error::KafkaError> {
            Self::with_config(ClientConfig::new().set("bootstrap.servers", brokers))
        }

        /// A producer from your own configuration (TLS, SASL, ...);
        /// idempotence and `acks=all` are set on top.
        pub fn with_config(config: &ClientConfig) -> Result<Self, rdkafka::error::KafkaError> {
            let mut config = config.clone();
            // A key's messages are sent one after the other (order), so
            // waiting to fill a batch only adds latency; concurrent keys
            // still share batches. Yours wins if you set it.
            if config.get("linger.ms").is_none() {
                config.set("linger.ms", "0");
            }
            config
                .set("enable.idempotence", "true")
                .set("acks", "all")
                .set("message.timeout.ms", "30000");
            Ok(Self {
                producer: config.create()?,
                timeout: Duration::from_secs(30),
            })
        }
    }

    #[async_trait]
    impl Publisher for KafkaPublisher {
        fn kind(&self) -> Kind {
            Kind::Kafka
        }

        async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
            let row = message.row;
            let mut headers = OwnedHeaders::new();
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
            let mut record = FutureRecord::<[u8], [u8]>::to(&row.destination)
                .payload(&row.payload)
                .headers(headers);
            if let Some(key) = &row.message_key {
                record = record.key(key);
            }
            match self.producer.send(record, self.timeout).await {
                Ok(_) => Ok(()),
                Err((e, _)) => {
                    use rdkafka::types::RDKafkaErrorCode as C;
                    let permanent = matches!(
                        e.rdkafka_error_code(),
                        Some(
                            C::MessageSizeTooLarge | C::InvalidRecord | C::TopicAuthorizationFailed
                        )
                    );
                    let text = format!("kafka {}: {e}", row.destination);
                    Err(if permanent {
                        PublishError::permanent(text)
                    } else {
                        PublishError::retryable(text)
                    })
                }
            }
        }
    }
}
#[cfg(feature = "kafka")]
pub use kafka::KafkaPublisher;

#[cfg(feature = "amqp")]
mod amqp {
    use std::time::Duration;

    use async_trait::async_trait;
    use lapin::options::ConfirmSelectOptions;
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Channel, Connection};
    use tokio::sync::Mutex;

    use super::{Kind, Outgoing, PublishError, Publisher};
    use crate::amqp::AmqpTls;
    use crate::amqp::publish::{CONFIRM_TIMEOUT, Confirms};

    /// Publishes to RabbitMQ with publisher confirms, `mandatory` and
    /// persistent delivery: a message counts as sent once the broker
    /// confirmed it was routed.
    ///
    /// Publishes go one at a time on the channel (a returned message is
    /// matched to the next confirm, not to its own publish, so concurrent
    /// publishes could swap an unroutable message's verdict with another's),
    /// and each waits for its confirm for at most the
    /// [timeout](AmqpPublisher::with_timeout) (default 30 s; a broker
    /// under a memory or disk alarm never confirms). After a timeout or a
    /// lost connection the channel is replaced on the next publish, so a
    /// late confirm is never taken for another message's.
    pub struct AmqpPublisher {
        url: String,
        tls: AmqpTls,
        link: Mutex<Link>,
        confirms: Confirms,
    }

    /// The current connection and channel, numbered so that a failed
    /// publish closes only the link it used.
    #[derive(Default)]
    struct Link {
        generation: u64,
        open: Option<(Connection, Channel)>,
    }

    impl AmqpPublisher {
        /// A publisher for broker `url` (connects on first use).
        pub fn new(url: impl Into<String>) -> Self {
            Self {
                url: url.into(),
                tls: AmqpTls::new(),
                link: Mutex::new(Link::default()),
                confirms: Confirms::new(CONFIRM_TIMEOUT),
            }
        }

        /// TLS settings of an `amqps://` URL beyond the system's roots.
        #[must_use]
        pub fn with_tls(mut self, tls: AmqpTls) -> Self {
            self.tls = tls;
            self
        }

        /// How long a publish (connecting included) may wait for the
        /// broker's confirm before it fails and is retried later (default
        /// 30 s).
        #[must_use]
        pub fn with_timeout(mut self, timeout: Duration) -> Self {
            self.confirms = Confirms::new(timeout);
            self
        }

        async fn channel(&self) -> Result<(u64, Channel), PublishError> {
            let mut link = self.link.lock().await;
            if let Some((_, channel)) = link.open.as_ref().filter(|(_, c)| c.status().connected()) {
                return Ok((link.generation, channel.clone()));
            }
            if let Some((conn, _)) = link.open.take() {
                close(conn).await;
            }
            let unavailable = |e: lapin::Error| PublishError::retryable(format!("amqp: {e}"));
            let opened = tokio::time::timeout(self.confirms.timeout(), async {
                let conn = crate::amqp::connect(&self.url, &self.tls).await?;
                let channel = conn.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                Ok::<_, lapin::Error>((conn, channel))
            })
            .await
            .map_err(|_| {
                PublishError::retryable(format!(
                    "amqp: no channel within {:?}",
                    self.confirms.timeout()
                ))
            })?
            .map_err(unavailable)?;
            let channel = opened.1.clone();
            link.generation += 1;
            link.open = Some(opened);
            Ok((link.generation, channel))
        }

        /// Closes link `generation` if it is still the current one, so that
        /// no late confirm or return of a failed publish is taken for a
        /// later one's.
        async fn discard(&self, generation: u64) {
            let mut link = self.link.lock().await;
            if link.generation == generation
                && let Some((conn, _)) = link.open.take()
            {
                close(conn).await;
            }
        }
    }

    /// Closes a connection without waiting long: its peer may be silent.
    async fn close(conn: Connection) {
        let closing = conn.close(320, "onceonly: replacing the publisher's connection".into());
        drop(tokio::time::timeout(Duration::from_secs(1), closing).await);
    }

    #[async_trait]
    impl Publisher for AmqpPublisher {
        fn kind(&self) -> Kind {
            Kind::Amqp
        }

        async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
            let row = message.row;
            let timeout = self.confirms.timeout();
            let turn = tokio::time::timeout(timeout, self.confirms.turn())
                .await
                .map_err(|_| {
                    PublishError::retryable(format!(
                        "amqp: the channel stayed busy for {timeout:?}"
                    ))
                })?;
            let (generation, channel) = self.channel().await?;
            let mut headers = FieldTable::default();
            for (name, value) in &message.headers {
                headers.insert(
                    name.as_str().into(),
                    AMQPValue::LongString(value.as_str().into()),
                );
            }
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(row.message_id.as_str().into())
                .with_headers(headers);
            let routing_key = row.routing_key.as_deref().unwrap_or_default();
            let sent = self
                .confirms
                .publish_in_turn(
                    &turn,
                    &channel,
                    &row.destination,
                    routing_key,
                    &row.payload,
                    properties,
                )
                .await;
            match sent {
                Ok(()) => Ok(()),
                Err((e, replace)) => {
                    if replace {
                        self.discard(generation).await;
                    }
                    // Unroutable (no queue bound) is retryable too: a
                    // consumer may declare its queue late.
                    Err(PublishError::retryable(e.to_string()))
                }
            }
        }
    }
}
#[cfg(feature = "amqp")]
pub use amqp::AmqpPublisher;

#[cfg(feature = "webhook")]
mod webhook {
    use std::time::Duration;

    use async_trait::async_trait;
    use hmac::{Hmac, Mac};
    use sha2::Sha256;

    use super::{Kind, Outgoing, PublishError, Publisher};
    use crate::outbox::message::SIGNATURE_HEADER;

    /// POSTs webhooks signed with HMAC-SHA256: header
    /// [`SIGNATURE_HEADER`] is `t=<unix seconds>,v1=<hex>` over
    /// `<t>.<body>` (the scheme [`SignatureCheck`](crate::http::SignatureCheck)
    /// verifies, so a onceonly receiver can check it). A 2xx answer is
    /// delivered; 5xx, 408, 429 and timeouts are retried; any other 4xx is
    /// permanent.
    ///
    /// Redirects are not followed: an HTTP client following a 301, 302 or
    /// 303 turns the POST into a GET without body, and the 2xx at its end
    /// would mark a notification delivered that never arrived. A 3xx
    /// answer is a permanent failure naming the `Location`: configure the
    /// final URL.
    pub struct WebhookPublisher {
        client: reqwest::Client,
        secret: Vec<u8>,
    }

    impl WebhookPublisher {
        /// A publisher signing with `secret`, with a 10 s timeout.
        pub fn new(secret: impl Into<Vec<u8>>) -> Self {
            Self::with_timeout(secret, Duration::from_secs(10))
        }

        /// The same with another request timeout.
        pub fn with_timeout(secret: impl Into<Vec<u8>>, timeout: Duration) -> Self {
            let client = reqwest::Client::builder()
                .timeout(timeout)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap_or_else(|e| {
                    // Only a TLS backend that cannot start fails here; the
                    // default client then follows redirects, which
                    // `publish` detects and refuses.
                    tracing::error!(error = %e, "webhook client setup failed; using the default client");
                    reqwest::Client::default()
                });
            Self {
                client,
                secret: secret.into(),
            }
        }

        /// The signature header value for `body` at `unix_secs`.
        pub fn sign(&self, body: &[u8], unix_secs: u64) -> String {
            let mut mac = match Hmac::<Sha256>::new_from_slice(&self.secret) {
                Ok(mac) => mac,
                // HMAC takes keys of any length.
                Err(_) => return String::new(),
            };
            mac.update(unix_secs.to_string().as_bytes());
            mac.update(b".");
            mac.update(body);
            format!(
                "t={unix_secs},v1={}",
                hex::encode(mac.finalize().into_bytes())
            )
        }
    }

    #[async_trait]
    impl Publisher for WebhookPublisher {
        fn kind(&self) -> Kind {
            Kind::Webhook
        }

        async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
            let row = message.row;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let mut request = self
                .client
                .post(&row.destination)
                .header("content-type", "application/json")
                .header(SIGNATURE_HEADER, self.sign(&row.payload, now));
            for (name, value) in &message.headers {
                request = request.header(name, value);
            }
            let response = request
                .body(row.payload.clone())
                .send()
                .await
                .map_err(|e| {
                    if e.is_builder() {
                        PublishError::permanent(format!("webhook {}: {e}", row.destination))
                    } else {
                        PublishError::retryable(format!("webhook {}: {e}", row.destination))
                    }
                })?;
            let status = response.status();
            if status.is_redirection() {
                let location = response
                    .headers()
                    .get(reqwest::header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .unwrap_or("no Location");
                return Err(PublishError::permanent(format!(
                    "webhook {} answered {status} (redirect to {location}, not followed: a POST must reach its final URL)",
                    row.destination
                )));
            }
            if reqwest::Url::parse(&row.destination).ok().as_ref() != Some(response.url()) {
                return Err(PublishError::permanent(format!(
                    "webhook {} was redirected to {}: not delivered",
                    row.destination,
                    response.url()
                )));
            }
            if status.is_success() {
                return Ok(());
            }
            let text = format!("webhook {} answered {status}", row.destination);
            let retry =
                status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429;
            Err(if retry {
                PublishError::retryable(text)
            } else {
                PublishError::permanent(text)
            })
        }
    }
}
#[cfg(feature = "webhook")]
pub use webhook::WebhookPublisher;
