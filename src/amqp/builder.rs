//! Configuration of an [`AmqpConsumer`].

use std::time::Duration;

use super::consumer::{AmqpConsumer, Settings};
use super::topology::{DeadLetterTarget, QueueKind, Topology};
use super::{AmqpConsumerError, AmqpTls};
use crate::engine::EngineBuilder;
use crate::store::SqlStore;

/// Builds an [`AmqpConsumer`]. Required: [`url`](Self::url),
/// [`queue`](Self::queue), and a key in the engine builder it was given
/// ([`EngineBuilder::key_expr`]). Engine settings (key, fingerprint,
/// retention, retry policy, fences, scope, ...) live in that
/// [`EngineBuilder`] only.
pub struct AmqpConsumerBuilder<S> {
    engine: EngineBuilder<S>,
    url: Option<String>,
    tls: AmqpTls,
    queue: Option<String>,
    kind: QueueKind,
    delivery_limit: Option<i64>,
    dead_letter: Option<DeadLetterTarget>,
    prefetch: u16,
    concurrency: usize,
    exit_when_idle: Option<Duration>,
    reconnect_min: Duration,
    reconnect_max: Duration,
    pause: Option<crate::PausePolicy>,
}

impl<S: SqlStore> AmqpConsumerBuilder<S> {
    pub(super) fn new(engine: EngineBuilder<S>) -> Self {
        Self {
            engine,
            url: None,
            tls: AmqpTls::new(),
            queue: None,
            kind: QueueKind::Classic,
            delivery_limit: None,
            dead_letter: None,
            prefetch: 32,
            concurrency: 8,
            exit_when_idle: None,
            reconnect_min: Duration::from_millis(200),
            reconnect_max: Duration::from_secs(10),
            pause: None,
        }
    }

    /// Broker URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    #[must_use]
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// TLS settings of an `amqps://` URL beyond the system's roots: a
    /// private CA, a client certificate.
    #[must_use]
    pub fn tls(mut self, tls: AmqpTls) -> Self {
        self.tls = tls;
        self
    }

    /// The work queue; also the default dedup scope.
    #[must_use]
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Declare the work queue as classic (default) or quorum, or use an
    /// existing one as it is.
    #[must_use]
    pub fn queue_kind(mut self, kind: QueueKind) -> Self {
        self.kind = kind;
        self
    }

    /// `x-delivery-limit` of a declared quorum queue. RabbitMQ 4 defaults it
    /// to 20 (3.x: unlimited). It counts redeliveries of the *same* message
    /// (after a crash, a connection loss); onceonly's retries publish a new
    /// message to a retry queue and do not count. Past the limit the broker
    /// dead-letters the message to the dead-letter target (reason
    /// `delivery_limit` in `x-death`).
    #[must_use]
    pub fn delivery_limit(mut self, limit: i64) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Dead-letter to this queue (declared durable) through the default
    /// exchange. Default: `<queue>.dlq`.
    #[must_use]
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter = Some(DeadLetterTarget {
            exchange: String::new(),
            routing_key: queue.into(),
            declare: true,
        });
        self
    }

    /// Dead-letter to an existing exchange with a routing key (nothing is
    /// declared; an unroutable dead letter is a failed publish and the
    /// message stays unacked).
    #[must_use]
    pub fn dead_letter_exchange(
        mut self,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.dead_letter = Some(DeadLetterTarget {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            declare: false,
        });
        self
    }

    /// Unacked messages the broker sends ahead (`basic.qos`, default 32).
    #[must_use]
    pub fn prefetch(mut self, messages: u16) -> Self {
        self.prefetch = messages;
        self
    }

    /// Messages handled at once (default 8). AMQP gives no order across
    /// concurrent handlers; use 1 (and one consumer) for strict order.
    #[must_use]
    pub fn concurrency(mut self, handlers: usize) -> Self {
        self.concurrency = handlers;
        self
    }

    /// Stop once nothing arrived and nothing ran for `idle`.
    #[must_use]
    pub fn exit_when_idle(mut self, idle: Duration) -> Self {
        self.exit_when_idle = Some(idle);
        self
    }

    /// Reconnect backoff bounds (default 200 ms doubling up to 10 s, with
    /// jitter so that many consumers do not reconnect in lockstep).
    #[must_use]
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max.max(min);
        self
    }

    /// Pauses consuming while the handler keeps failing (a dependency
    /// down), instead of retrying every message to exhaustion and
    /// dead-lettering it: no new delivery starts (the rest wait, unacked,
    /// in the channel's prefetch), deliveries in flight wait unacked, and a
    /// probe after each cool-down resumes consuming once the handler
    /// succeeds again. See [`PausePolicy`](crate::PausePolicy) for the
    /// rule; `build` refuses a policy that would pause only after the
    /// engine builder's [retry policy](EngineBuilder::retry) dead-letters.
    #[must_use]
    pub fn pause_on_failure(mut self, policy: crate::PausePolicy) -> Self {
        self.pause = Some(policy);
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<AmqpConsumer<S>, AmqpConsumerError> {
        let missing = |what: &str| AmqpConsumerError::Config(format!("{what} is required"));
        let url = self.url.ok_or_else(|| missing("url"))?;
        if let Err(e) = url.parse::<lapin::uri::AMQPUri>() {
            return Err(AmqpConsumerError::Config(format!("invalid AMQP URL: {e}")));
        }
        let queue = self.queue.ok_or_else(|| missing("queue"))?;
        if queue.is_empty() || queue.len() > 200 {
            return Err(AmqpConsumerError::Config(
                "queue names are 1 to 200 bytes (room for the retry and dead-letter suffixes)"
                    .into(),
            ));
        }
        if self.prefetch == 0 || self.concurrency == 0 {
            return Err(AmqpConsumerError::Config(
                "prefetch and concurrency must be at least 1".into(),
            ));
        }
        let engine = self
            .engine
            .or_scope(|| queue.clone())
            .transport(crate::telemetry::TRANSPORT_AMQP)
            .build()?;
        if let Some(pause) = &self.pause {
            pause
                .check(engine.retry_policy())
                .map_err(AmqpConsumerError::Config)?;
        }
        let dead_letter = self.dead_letter.unwrap_or_else(|| DeadLetterTarget {
            exchange: String::new(),
            routing_key: format!("{queue}.dlq"),
            declare: true,
        });
        let topology = Topology::new(
            queue,
            self.kind,
            self.delivery_limit,
            engine.retry_policy(),
            dead_letter,
        );
        Ok(AmqpConsumer::new(
            engine,
            topology,
            Settings {
                url,
                tls: self.tls,
                prefetch: self.prefetch,
                concurrency: self.concurrency,
                exit_when_idle: self.exit_when_idle,
                reconnect_min: self.reconnect_min,
                reconnect_max: self.reconnect_max,
                pause: self.pause,
            },
        ))
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::engine::{Engine, RetryPolicy};
    use crate::store::sqlite::SqliteStore;

    /// The engine builder is the one home of the retry policy, and the
    /// queue is the scope unless the engine builder names one.
    #[tokio::test]
    async fn the_engine_builder_holds_the_retry_policy_and_the_scope() {
        let pool = sqlx::SqlitePool::connect_lazy("sqlite::memory:").expect("pool");
        let store = SqliteStore::new(pool);
        let policy = RetryPolicy::none();
        assert_ne!(policy, RetryPolicy::default());
        let consumer = AmqpConsumer::builder(
            Engine::builder(store.clone())
                .key_expr("json:/id")
                .retry(policy),
        )
        .url("amqp://127.0.0.1:5672/%2f")
        .queue("orders")
        .build()
        .expect("build");
        assert_eq!(consumer.engine().retry_policy(), &policy);
        assert_eq!(consumer.engine().scope(), "orders");
        let named =
            AmqpConsumer::builder(Engine::builder(store).key_expr("json:/id").scope("ledger"))
                .url("amqp://127.0.0.1:5672/%2f")
                .queue("orders")
                .build()
                .expect("build");
        assert_eq!(named.engine().scope(), "ledger");
    }
}
