//! Replaying an AMQP dead-letter queue: `basic.get` up to the depth seen at
//! the start, republish each selected message (publisher confirms,
//! `mandatory`) and ack it only once confirmed; everything else is
//! requeued at the end by closing the channel.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use super::options::{ReplayOptions, required};
use super::report::{Action, Letter, ProgressFn, ReplayReport, record};
use super::{ORIGIN, PARKED_SUFFIX, REPLAYED_FROM, REPLAYS, ReplayError};
use crate::amqp::message::{header_text, set_text};
use crate::amqp::publish::publish_confirmed;
use crate::amqp::{AmqpTls, headers};

/// Bounds connecting, opening channels and closing.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Builds an [`AmqpReplay`]. Required: [`url`](Self::url) and
/// [`queue`](Self::queue).
#[derive(Default)]
pub struct AmqpReplayBuilder {
    url: Option<String>,
    tls: AmqpTls,
    queue: Option<String>,
    to_queue: bool,
    options: ReplayOptions,
    progress: Option<ProgressFn>,
}

impl std::fmt::Debug for AmqpReplayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpReplayBuilder")
            .field("queue", &self.queue)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl AmqpReplayBuilder {
    /// Broker URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    #[must_use]
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// TLS settings of an `amqps://` URL beyond the system's roots.
    #[must_use]
    pub fn tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    /// The dead-letter queue to read, e.g. `orders.dlq`.
    #[must_use]
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Filters, limit, rate and dry run.
    #[must_use]
    pub fn options(mut self, options: ReplayOptions) -> Self {
        self.options = options;
        self
    }

    /// Send each copy straight to the queue that dead-lettered it (through
    /// the default exchange, from `x-onceonly-queue` or the `x-death`
    /// entry's `queue`) instead of to its original exchange and routing
    /// key. Use it when the original exchange fans out (fanout or topic
    /// exchanges, several bound queues): a copy sent there reaches every
    /// bound queue again, and consumers that do not dedupe would see it
    /// twice.
    #[must_use]
    pub fn to_queue(mut self, to_queue: bool) -> Self {
        self.to_queue = to_queue;
        self
    }

    /// Called after each dead letter.
    #[must_use]
    pub fn on_progress(mut self, f: impl Fn(&super::Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Checks the settings.
    pub fn build(self) -> Result<AmqpReplay, ReplayError> {
        let url = required(self.url, "the broker URL")?;
        let queue = required(self.queue, "the dead-letter queue")?;
        self.options.validate()?;
        Ok(AmqpReplay {
            url,
            tls: self.tls,
            queue,
            to_queue: self.to_queue,
            options: self.options,
            progress: self.progress,
        })
    }
}

/// Replays a RabbitMQ dead-letter queue to where its messages came from.
///
/// The destination of each message is `x-onceonly-original-exchange` /
/// `-routing-key` (written by the onceonly consumer), or else the first
/// entry of RabbitMQ's `x-death` header (`exchange`, first of
/// `routing-keys`), for queues fed by RabbitMQ's own dead-lettering. With
/// [`to_queue`](AmqpReplayBuilder::to_queue) it is the queue that
/// dead-lettered the message, through the default exchange: the original
/// exchange may fan out to other queues.
///
/// The replayed copy keeps body and properties (message id, correlation id,
/// reply-to, content type, timestamp, …) and headers, minus
/// `x-onceonly-reason`, `-error` and `-attempts` (so the consumer's retry
/// budget starts over), plus `x-onceonly-replayed-from: <queue>`.
///
/// Guarantees: a dead letter is acked only after its copy was confirmed
/// by the broker and not returned as unroutable; anything else (filtered
/// out, dry run, failed, not reached) stays unacked and is requeued when
/// the run closes its channel (also if the run crashes). The run reads at most as many messages as the queue held
/// when it started, so letters dead-lettered again meanwhile are not read
/// twice.
pub struct AmqpReplay {
    url: String,
    tls: AmqpTls,
    queue: String,
    to_queue: bool,
    options: ReplayOptions,
    progress: Option<ProgressFn>,
}

impl std::fmt::Debug for AmqpReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpReplay")
            .field("queue", &self.queue)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl AmqpReplay {
    /// Starts configuring a replay.
    pub fn builder() -> AmqpReplayBuilder {
        AmqpReplayBuilder::default()
    }

    /// Runs the replay. `Err` only when it could not read the queue or ack;
    /// dead letters that could not be republished are counted in
    /// [`ReplayReport::failed`] and stay in the queue.
    pub async fn run(&self) -> Result<ReplayReport, ReplayError> {
        let conn = bounded("connecting", crate::amqp::connect(&self.url, &self.tls)).await??;
        let result = self.run_on(&conn).await;
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            conn.close(200, "onceonly replay done".into()),
        )
        .await;
        result
    }

    async fn run_on(&self, conn: &Connection) -> Result<ReplayReport, ReplayError> {
        let source = bounded("opening a channel", conn.create_channel()).await??;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = bounded(
            "checking the queue",
            source.queue_declare(self.queue.as_str().into(), passive, FieldTable::default()),
        )
        .await?
        .map_err(|e| match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 404 => {
                ReplayError::SourceNotFound(self.queue.clone())
            }
            _ => ReplayError::Amqp(e),
        })?;
        let total = u64::from(declared.message_count());
        let mut report = ReplayReport {
            dry_run: self.options.dry_run,
            total,
            ..ReplayReport::default()
        };
        let mut publisher = if self.options.dry_run {
            None
        } else {
            Some(open_publisher(conn).await?)
        };
        let mut pacer = self.options.pacer();
        // Unacked until the end: a message held by this channel is not
        // delivered again, to this run or anyone else, until it is requeued.
        let mut held: Vec<Delivery> = Vec::new();
        let mut acted = 0u64;
        let mut parking_declared = false;
        let outcome: Result<(), ReplayError> = async {
            while report.scanned < total && !self.options.limit_reached(acted) {
                let got = bounded(
                    "basic.get",
                    source.basic_get(self.queue.as_str().into(), BasicGetOptions::default()),
                )
                .await??;
                let Some(got) = got else { break };
                let delivery = got.delivery;
                report.scanned += 1;
                let props = &delivery.properties;
                let h = props.headers().as_ref();
                let first_seen = header_text(h, headers::FIRST_SEEN)
                    .and_then(|t| t.parse().ok())
                    .or_else(|| {
                        props
                            .timestamp()
                            .and_then(|s| i64::try_from(s).ok())
                            .map(|s| s.saturating_mul(1000))
                    });
                let mut letter = Letter::new(
                    format!("{}#{}", self.queue, report.scanned),
                    header_text(h, headers::REASON),
                    header_text(h, headers::IDEMPOTENCY_KEY),
                    destination(h, self.to_queue).map(|(e, r)| {
                        let e = if e.is_empty() { "(default exchange)" } else { e.as_str() };
                        format!("{e}/{r}")
                    }),
                    header_text(h, headers::SCOPE),
                    header_text(h, headers::ERROR),
                    first_seen,
                    header_text(h, REPLAYS).and_then(|n| n.parse().ok()).unwrap_or(0),
                );
                let selected = self.options.matches(
                    letter.reason.as_deref(),
                    letter.key.as_deref(),
                    first_seen,
                    &letter.group,
                );
                if !selected {
                    held.push(delivery);
                    record(&mut report, self.progress.as_ref(), letter, Action::Skipped, None);
                    continue;
                }
                acted += 1;
                let screening = self
                    .options
                    .screen
                    .check(
                        letter.scope.as_deref(),
                        letter.key.as_deref(),
                        first_seen,
                        &delivery.data,
                    )
                    .await?;
                letter.verdict = Some(screening.verdict);
                if screening.refused {
                    held.push(delivery);
                    record(&mut report, self.progress.as_ref(), letter, Action::Refused, None);
                    continue;
                }
                if self.options.park(letter.replays) {
                    let parking = format!("{}{PARKED_SUFFIX}", self.queue);
                    letter.target = Some(format!("(default exchange)/{parking}"));
                    let Some(channel) = publisher.as_mut() else {
                        held.push(delivery);
                        record(&mut report, self.progress.as_ref(), letter, Action::Parked, None);
                        continue;
                    };
                    if !parking_declared {
                        declare_parking(channel, &parking).await?;
                        parking_declared = true;
                    }
                    let sent = tokio::time::timeout(
                        self.options.timeout(),
                        publish_confirmed(channel, "", &parking, &delivery.data, props.clone()),
                    )
                    .await;
                    match sent {
                        Ok(Ok(())) => {
                            ack(&delivery, &letter).await?;
                            record(&mut report, self.progress.as_ref(), letter, Action::Parked, None);
                        }
                        Ok(Err(e)) => {
                            held.push(delivery);
                            record(&mut report, self.progress.as_ref(), letter, Action::Failed, Some(format!("parking in {parking}: {e}")));
                        }
                        Err(_) => {
                            held.push(delivery);
                            record(&mut report, self.progress.as_ref(), letter, Action::Failed, Some(format!("parking in {parking}: not confirmed within {:?}", self.options.timeout())));
                        }
                    }
                    continue;
                }
                let Some((exchange, routing_key)) = destination(h, self.to_queue) else {
                    held.push(delivery);
                    let error = if self.to_queue {
                        "no destination: neither an x-onceonly-queue nor an x-death header".to_owned()
                    } else {
                        "no destination: neither x-onceonly-original-exchange/-routing-key nor x-death headers".to_owned()
                    };
                    record(&mut report, self.progress.as_ref(), letter, Action::Failed, Some(error));
                    continue;
                };
                let Some(channel) = publisher.as_mut() else {
                    held.push(delivery);
                    record(&mut report, self.progress.as_ref(), letter, Action::WouldReplay, None);
                    continue;
                };
                pacer.wait().await;
                let copy = replay_properties(props, &self.queue, letter.replays);
                let sent = tokio::time::timeout(
                    self.options.timeout(),
                    publish_confirmed(channel, &exchange, &routing_key, &delivery.data, copy),
                )
                .await;
                let error = match sent {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!(
                        "publish to exchange {exchange:?} with routing key {routing_key:?} not confirmed within {:?}",
                        self.options.timeout()
                    )),
                };
                if let Some(error) = error {
                    held.push(delivery);
                    record(&mut report, self.progress.as_ref(), letter, Action::Failed, Some(error));
                    if !channel.status().connected() {
                        // The broker closes a channel that publishes to a
                        // missing exchange: open another for the rest.
                        *channel = open_publisher(conn).await?;
                    }
                    continue;
                }
                ack(&delivery, &letter).await?;
                record(&mut report, self.progress.as_ref(), letter, Action::Replayed, None);
            }
            Ok(())
        }
        .await;
        // Everything still held goes back to the queue when the source
        // channel closes, each at its place (classic queues). Closing rather
        // than nacking: RabbitMQ 4 counts a `nack(requeue)` as a failed
        // delivery against a quorum queue's delivery limit, a release on
        // channel close not, so dry runs and filtered runs never push a dead
        // letter over the limit of a quorum dead-letter queue.
        let requeued = held.len();
        if let Some(channel) = publisher {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                channel.close(200, "onceonly replay done".into()),
            )
            .await;
        }
        let closed = tokio::time::timeout(
            Duration::from_secs(5),
            source.close(200, "onceonly replay done".into()),
        )
        .await;
        if !matches!(closed, Ok(Ok(()))) {
            tracing::debug!(
                requeued,
                "source channel close failed; the connection close requeues"
            );
        }
        drop(held);
        outcome.map(|()| report.finish())
    }
}

/// Acks a dead letter whose copy (replayed or parked) was confirmed.
async fn ack(delivery: &Delivery, letter: &Letter) -> Result<(), ReplayError> {
    match delivery.acker.ack(BasicAckOptions::default()).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(ReplayError::ConnectionLost(format!(
            "{} was republished but could not be acked (channel closed); it is requeued and \
             will be offered again (the consumer sees a duplicate)",
            letter.position
        ))),
        Err(e) => Err(ReplayError::Amqp(e)),
    }
}

/// Declares the parking queue (durable), if missing.
async fn declare_parking(channel: &Channel, queue: &str) -> Result<(), ReplayError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    bounded(
        "declaring the parking queue",
        channel.queue_declare(queue.into(), durable, FieldTable::default()),
    )
    .await??;
    Ok(())
}

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> Result<T, ReplayError> {
    tokio::time::timeout(CONNECT_TIMEOUT, f)
        .await
        .map_err(|_| ReplayError::Timeout(format!("{what} took longer than {CONNECT_TIMEOUT:?}")))
}

/// A channel in confirm mode.
async fn open_publisher(conn: &Connection) -> Result<Channel, ReplayError> {
    let channel = bounded("opening a channel", conn.create_channel()).await??;
    bounded(
        "enabling publisher confirms",
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await??;
    Ok(channel)
}

/// `(exchange, routing key)` the message was first published to or, with
/// `to_queue`, the default exchange and the queue that dead-lettered it.
fn destination(h: Option<&FieldTable>, to_queue: bool) -> Option<(String, String)> {
    if to_queue {
        return dead_lettering_queue(h).map(|q| (String::new(), q));
    }
    if let Some(rk) = header_text(h, headers::ORIGINAL_ROUTING_KEY) {
        let exchange = header_text(h, headers::ORIGINAL_EXCHANGE).unwrap_or_default();
        return Some((exchange, rk));
    }
    let AMQPValue::FieldArray(deaths) = h?.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    let exchange = header_text(Some(first), "exchange").unwrap_or_default();
    let AMQPValue::FieldArray(keys) = first.inner().get("routing-keys")? else {
        return None;
    };
    let rk = match keys.as_slice().first()? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok()?,
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        _ => return None,
    };
    Some((exchange, rk))
}

/// The queue that dead-lettered the message: ours, or the first `x-death` entry's.
fn dead_lettering_queue(h: Option<&FieldTable>) -> Option<String> {
    if let Some(q) = header_text(h, headers::QUEUE) {
        return Some(q);
    }
    let AMQPValue::FieldArray(deaths) = h?.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    header_text(Some(first), "queue")
}

/// Headers dropped from the replayed copy: the verdict of the failed run
/// and its retry count.
const DROPPED: [&str; 3] = [headers::REASON, headers::ERROR, headers::ATTEMPTS];

/// The replayed copy's properties: the dead letter's (persistent, without
/// `user_id`, see [`copy_properties`](crate::amqp::publish::copy_properties)),
/// without the dropped headers, with `x-onceonly-replayed-from`.
fn replay_properties(original: &BasicProperties, queue: &str, replays: u32) -> BasicProperties {
    let kept: BTreeMap<ShortString, AMQPValue> = original
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .filter(|(k, _)| !DROPPED.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    let mut h = FieldTable::from(kept);
    set_text(&mut h, REPLAYED_FROM, queue);
    set_text(&mut h, REPLAYS, &replays.saturating_add(1).to_string());
    if header_text(Some(&h), ORIGIN).is_none() {
        // The source the consumer stored with the claim.
        let origin = crate::amqp::message::source(
            &header_text(Some(&h), headers::QUEUE).unwrap_or_default(),
            &header_text(Some(&h), headers::ORIGINAL_EXCHANGE).unwrap_or_default(),
            &header_text(Some(&h), headers::ORIGINAL_ROUTING_KEY).unwrap_or_default(),
        );
        set_text(&mut h, ORIGIN, &origin);
    }
    h.insert(
        ShortString::from("x-onceonly-replayed-at"),
        AMQPValue::LongString(LongString::from(now_ms().to_string())),
    );
    crate::amqp::publish::copy_properties(original, h)
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    #[test]
    fn destination_from_our_headers_or_x_death() {
        let mut h = FieldTable::default();
        set_text(&mut h, headers::ORIGINAL_EXCHANGE, "ex");
        set_text(&mut h, headers::ORIGINAL_ROUTING_KEY, "rk");
        assert_eq!(
            destination(Some(&h), false),
            Some(("ex".into(), "rk".into()))
        );

        let mut death = FieldTable::default();
        set_text(&mut death, "exchange", "");
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
                LongString::from("orders"),
            )])),
        );
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        assert_eq!(
            destination(Some(&h), false),
            Some((String::new(), "orders".into()))
        );
        assert_eq!(destination(None, false), None);
        assert_eq!(destination(None, true), None);
    }

    #[test]
    fn replayed_copy_drops_the_verdict_and_keeps_the_rest() {
        let mut h = FieldTable::default();
        for (k, v) in [
            (headers::REASON, "handler_error"),
            (headers::ERROR, "boom"),
            (headers::ATTEMPTS, "3"),
            (headers::IDEMPOTENCY_KEY, "K-1"),
            ("trace-id", "t-1"),
        ] {
            set_text(&mut h, k, v);
        }
        let original = BasicProperties::default()
            .with_headers(h)
            .with_message_id("m-1".into())
            .with_correlation_id("c-1".into())
            .with_reply_to("replies".into())
            .with_content_type("application/json".into())
            .with_user_id("guest".into());
        let copy = replay_properties(&original, "orders.dlq", 1);
        let ch = copy.headers().as_ref();
        assert_eq!(header_text(ch, headers::REASON), None);
        assert_eq!(header_text(ch, headers::ERROR), None);
        assert_eq!(header_text(ch, headers::ATTEMPTS), None);
        assert_eq!(
            header_text(ch, headers::IDEMPOTENCY_KEY).as_deref(),
            Some("K-1")
        );
        assert_eq!(header_text(ch, "trace-id").as_deref(), Some("t-1"));
        assert_eq!(
            header_text(ch, REPLAYED_FROM).as_deref(),
            Some("orders.dlq")
        );
        assert_eq!(copy.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert_eq!(
            copy.correlation_id().as_ref().map(|s| s.as_str()),
            Some("c-1")
        );
        assert_eq!(
            copy.reply_to().as_ref().map(|s| s.as_str()),
            Some("replies")
        );
        assert_eq!(copy.delivery_mode(), &Some(2));
        assert_eq!(header_text(ch, REPLAYS).as_deref(), Some("2"));
        assert_eq!(header_text(ch, ORIGIN).as_deref(), Some("/"));
        assert_eq!(copy.user_id(), &None);
    }
}
