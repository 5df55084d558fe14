//! The AMQP publisher: publisher confirms pipelined on one channel per
//! slot of ordering keys.

use std::hash::{Hash as _, Hasher as _};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lapin::options::ConfirmSelectOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use super::{Kind, Outgoing, PublishError, Publisher};
use crate::amqp::AmqpTls;
use crate::amqp::pipeline::{self, Publish};
use crate::amqp::publish::CONFIRM_TIMEOUT;

/// How many channels an [`AmqpPublisher`] publishes on by default.
pub(crate) const DEFAULT_AMQP_CHANNELS: usize = 8;

/// Publishes to RabbitMQ with publisher confirms, `mandatory` and
/// persistent delivery: a message counts as sent once the broker
/// confirmed it was routed.
///
/// Ordering keys are spread over a few channels of one connection (see
/// [`with_channels`](AmqpPublisher::with_channels)); a key always uses
/// the same channel, and publishes all its messages of a relay round on
/// it before waiting for their confirms (a channel keeps its messages'
/// order). One key at a time uses a channel, and each unroutable message
/// is matched to its own publish by the message id the broker returns
/// with it, never by the confirm lapin hands the return to. Every wait is
/// bounded by the [timeout](AmqpPublisher::with_timeout) (default 30 s;
/// a broker under a memory or disk alarm never confirms): a channel whose
/// confirm did not come in time is discarded with its connection, so a
/// late confirm is never taken for another message's; a channel the
/// broker closed is replaced alone.
pub struct AmqpPublisher {
    url: String,
    tls: AmqpTls,
    timeout: Duration,
    connection: Mutex<Link>,
    slots: Vec<Mutex<Option<SlotChannel>>>,
}

/// The current connection, numbered so that a failed publish closes only
/// the connection it used.
#[derive(Default)]
struct Link {
    generation: u64,
    open: Option<Connection>,
}

/// A slot's channel, on connection `generation`.
struct SlotChannel {
    generation: u64,
    channel: Channel,
}

impl AmqpPublisher {
    /// A publisher for broker `url` (connects on first use).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            tls: AmqpTls::new(),
            timeout: CONFIRM_TIMEOUT,
            connection: Mutex::new(Link::default()),
            slots: (0..DEFAULT_AMQP_CHANNELS)
                .map(|_| Mutex::new(None))
                .collect(),
        }
    }

    /// TLS settings of an `amqps://` URL beyond the system's roots.
    #[must_use]
    pub fn with_tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    /// How long a publish (waiting for its channel and connecting
    /// included) may wait for the broker's confirms before it fails and is
    /// retried later (default 30 s).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many channels ordering keys are spread over (default
    /// 8, at least 1): how many keys publish at once.
    #[must_use]
    pub fn with_channels(mut self, channels: usize) -> Self {
        self.slots = (0..channels.max(1)).map(|_| Mutex::new(None)).collect();
        self
    }

    /// The slot of an ordering key.
    fn slot(&self, order_key: &str) -> usize {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        order_key.hash(&mut hasher);
        (hasher.finish() % self.slots.len() as u64) as usize
    }

    /// A channel of the current connection, in confirm mode (connecting
    /// first if needed), bounded by the timeout.
    async fn open_channel(&self) -> Result<SlotChannel, PublishError> {
        let unavailable = |e: lapin::Error| PublishError::retryable(format!("amqp: {e}"));
        let opened = tokio::time::timeout(self.timeout, async {
            let mut link = self.connection.lock().await;
            let conn = match link.open.take() {
                Some(conn) if conn.status().connected() => conn,
                old => {
                    if let Some(old) = old {
                        close(old).await;
                    }
                    link.generation += 1;
                    crate::amqp::connect(&self.url, &self.tls).await?
                }
            };
            let channel = conn.create_channel().await;
            link.open = Some(conn);
            let generation = link.generation;
            let channel = channel?;
            drop(link);
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(SlotChannel {
                generation,
                channel,
            })
        })
        .await
        .map_err(|_| {
            PublishError::retryable(format!("amqp: no channel within {:?}", self.timeout))
        })?;
        opened.map_err(unavailable)
    }

    /// Whether the current connection is open.
    async fn connected(&self) -> bool {
        let link = self.connection.lock().await;
        link.open.as_ref().is_some_and(|c| c.status().connected())
    }

    /// Closes connection `generation` if it is still the current one, so
    /// that no late confirm or return of a failed publish is taken for a
    /// later one's (every channel on it goes with it).
    async fn discard_connection(&self, generation: u64) {
        let mut link = self.connection.lock().await;
        if link.generation == generation
            && let Some(conn) = link.open.take()
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

/// The properties a row leaves with: persistent, its message id, its
/// headers.
fn properties(message: &Outgoing<'_>) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in &message.headers {
        headers.insert(
            name.as_str().into(),
            AMQPValue::LongString(value.as_str().into()),
        );
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(message.row.message_id.as_str().into())
        .with_headers(headers)
}

#[async_trait]
impl Publisher for AmqpPublisher {
    fn kind(&self) -> Kind {
        Kind::Amqp
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        super::publish_alone(self, message, self.timeout, "amqp").await
    }

    /// Publishes the key's messages on its slot's channel, all before
    /// waiting, and waits for their confirms (the slot's turn, the channel
    /// and the confirms each bounded by the timeout).
    async fn publish_ordered(
        &self,
        messages: &[Outgoing<'_>],
        _deadline: Instant,
    ) -> Vec<Result<(), PublishError>> {
        let Some(first) = messages.first() else {
            return Vec::new();
        };
        let timeout = self.timeout;
        let Some(slot) = self.slots.get(self.slot(&first.row.order_key)) else {
            return vec![Err(PublishError::retryable("amqp: no channel slot"))];
        };
        let Ok(mut slot) = tokio::time::timeout(timeout, slot.lock()).await else {
            return vec![Err(PublishError::retryable(format!(
                "amqp: the channel stayed busy for {timeout:?}"
            )))];
        };
        let usable = slot
            .as_ref()
            .is_some_and(|s| s.channel.status().connected());
        if !usable {
            match self.open_channel().await {
                Ok(fresh) => *slot = Some(fresh),
                Err(e) => return vec![Err(e)],
            }
        }
        let Some(current) = slot.as_ref() else {
            return vec![Err(PublishError::retryable("amqp: no channel"))];
        };
        let publishes: Vec<Publish<'_>> = messages
            .iter()
            .map(|m| Publish {
                exchange: &m.row.destination,
                routing_key: m.row.routing_key.as_deref().unwrap_or_default(),
                body: &m.row.payload,
                message_id: &m.row.message_id,
                properties: properties(m),
            })
            .collect();
        let outcome = pipeline::publish_all(&current.channel, &publishes, timeout).await;
        if outcome.replace_channel {
            let generation = current.generation;
            let connected = current.channel.status().connected();
            *slot = None;
            // A channel still open whose confirm did not come: the
            // connection may be silent; a channel the broker closed: the
            // connection is fine.
            if connected || !self.connected().await {
                self.discard_connection(generation).await;
            }
        }
        outcome
            .verdicts
            .into_iter()
            .zip(messages)
            .map(|(verdict, m)| {
                // Unroutable (no queue bound) is retryable too: a consumer
                // may declare its queue late.
                verdict.map_err(|reason| {
                    PublishError::retryable(format!(
                        "publish to exchange {:?} with routing key {:?} not confirmed: {reason}",
                        m.row.destination,
                        m.row.routing_key.as_deref().unwrap_or_default()
                    ))
                })
            })
            .collect()
    }
}
