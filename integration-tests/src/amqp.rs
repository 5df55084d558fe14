//! RabbitMQ helpers for the tests: connections, confirmed persistent
//! publishing, queue depth, reading a queue.

use std::time::{Duration, Instant};

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

/// Broker URL: `ONCEONLY_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn url() -> String {
    std::env::var("ONCEONLY_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A connection and a channel in confirm mode.
pub async fn connect() -> (Connection, Channel) {
    let conn = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RabbitMQ is not reachable at {}: {e}\nStart it with `scripts/services` \
                 (or `rabbitmq-server -detached`), or point ONCEONLY_AMQP_URL at a running broker. \
                 These tests never skip.",
                url()
            )
        });
    let channel = conn.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    (conn, channel)
}

/// Declares a durable classic queue with no arguments (what the consumer
/// declares by default), so messages can be published before it starts.
pub async fn declare_queue(channel: &Channel, queue: &str) {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue declare");
}

/// One message to publish.
#[derive(Clone, Debug, Default)]
pub struct Msg {
    /// Body.
    pub body: Vec<u8>,
    /// `message_id`.
    pub message_id: Option<String>,
    /// `reply_to`.
    pub reply_to: Option<String>,
    /// `correlation_id`.
    pub correlation_id: Option<String>,
    /// Text headers.
    pub headers: Vec<(String, String)>,
}

impl Msg {
    /// A message with this body.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        Self {
            body: body.into(),
            ..Self::default()
        }
    }
}

/// Publishes persistent messages to `queue` through the default exchange,
/// each confirmed by the broker. A message the broker nacks (it did not
/// take it: a quorum queue just declared, still electing its leader) is
/// published again, up to 20 times.
pub async fn publish(channel: &Channel, queue: &str, messages: &[Msg]) {
    for chunk in messages.chunks(500) {
        let mut pending: Vec<&Msg> = chunk.iter().collect();
        for round in 0.. {
            let mut confirms = Vec::with_capacity(pending.len());
            for m in &pending {
                let confirm = channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions::default(),
                        &m.body,
                        properties(m),
                    )
                    .await
                    .expect("publish");
                confirms.push(confirm);
            }
            let mut nacked = Vec::new();
            for (m, c) in pending.iter().zip(confirms) {
                if !c.await.expect("confirm").is_ack() {
                    nacked.push(*m);
                }
            }
            if nacked.is_empty() {
                break;
            }
            assert!(round < 20, "publish not confirmed after {round} rounds");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            pending = nacked;
        }
    }
}

/// The properties of `m`: persistent, with its id, reply-to, correlation
/// id and headers.
fn properties(m: &Msg) -> BasicProperties {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = &m.message_id {
        props = props.with_message_id(id.as_str().into());
    }
    if let Some(r) = &m.reply_to {
        props = props.with_reply_to(r.as_str().into());
    }
    if let Some(c) = &m.correlation_id {
        props = props.with_correlation_id(c.as_str().into());
    }
    if !m.headers.is_empty() {
        let mut h = FieldTable::default();
        for (k, v) in &m.headers {
            h.insert(
                ShortString::from(k.as_str()),
                AMQPValue::LongString(LongString::from(v.as_bytes())),
            );
        }
        props = props.with_headers(h);
    }
    props
}

/// Publishes a payment stream's bodies to `queue`, in order.
pub async fn publish_stream(channel: &Channel, queue: &str, stream: &crate::ledger::Stream) {
    let messages: Vec<Msg> = stream
        .messages
        .iter()
        .map(|(_, body)| Msg::new(body.clone()))
        .collect();
    publish(channel, queue, &messages).await;
}

/// Declares an exclusive, auto-deleted reply queue for RPC requests.
pub async fn declare_reply_queue(channel: &Channel, prefix: &str) -> String {
    let name = crate::unique(prefix);
    channel
        .queue_declare(
            name.as_str().into(),
            lapin::options::QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..lapin::options::QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare reply queue");
    name
}

/// Messages ready in `queue` (not counting unacked ones).
pub async fn depth(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
}

/// Takes (and acks) up to `expected` messages from `queue`, waiting up to
/// `timeout` for them to arrive.
pub async fn take(
    channel: &Channel,
    queue: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<lapin::message::BasicGetMessage> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < expected && Instant::now() < deadline {
        match channel
            .basic_get(queue.into(), BasicGetOptions::default())
            .await
            .expect("basic.get")
        {
            Some(m) => {
                m.delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .expect("ack");
                out.push(m);
            }
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    out
}

/// A header of a message as text.
pub fn header(props: &BasicProperties, name: &str) -> Option<String> {
    let value = props.headers().as_ref()?.inner().get(name)?;
    match value {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongLongInt(n) => Some(n.to_string()),
        AMQPValue::LongInt(n) => Some(n.to_string()),
        _ => None,
    }
}
