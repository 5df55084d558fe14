//! The consumer: a session per connection (consume, process concurrently,
//! ack), and a loop that reconnects with backoff when the connection drops.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::AmqpConsumerError;
use super::builder::AmqpConsumerBuilder;
use super::stats::{AmqpCounters, AmqpStats};
use super::topology::{Topology, is_connection_level};
use super::worker::{Env, handle};
use crate::broker::bump;
use crate::broker::pause::Breaker;
use crate::broker::wait::Waits;
use crate::engine::{Engine, Handler};
use crate::store::SqlStore;

pub(super) struct Settings {
    pub(super) url: String,
    pub(super) tls: super::AmqpTls,
    pub(super) prefetch: u16,
    pub(super) concurrency: usize,
    pub(super) exit_when_idle: Option<Duration>,
    pub(super) reconnect_min: Duration,
    pub(super) reconnect_max: Duration,
    pub(super) pause: Option<crate::broker::PausePolicy>,
}

/// An AMQP 0-9-1 (RabbitMQ) consumer that processes each message's effect
/// exactly once and acks only after the commit.
///
/// See the [module documentation](super) for the guarantee and each knob.
pub struct AmqpConsumer<S: SqlStore> {
    engine: Engine<S>,
    topology: Topology,
    settings: Settings,
    /// Its deliveries waiting for the infrastructure (the gauge's handle
    /// resolved at build, like every other metric handle).
    waits: Arc<Waits>,
    /// Pauses consuming while the handler keeps failing.
    breaker: Breaker,
    counters: AmqpCounters,
}

/// Why a session ended.
enum End {
    Stopped,
    Idle,
}

impl<S: SqlStore> AmqpConsumer<S> {
    /// Starts configuring a consumer. `engine` holds every engine
    /// setting (key, fingerprint, retention, retry policy, fences, ...):
    /// pass `Engine::builder(store).key_expr("json:/order_id")` (a key is
    /// required: a store alone fails `build`). Its scope defaults to the
    /// queue name; its
    /// [retry policy](crate::EngineBuilder::retry) becomes delayed retry
    /// queues.
    pub fn builder(engine: impl Into<crate::EngineBuilder<S>>) -> AmqpConsumerBuilder<S> {
        AmqpConsumerBuilder::new(engine.into())
    }

    pub(super) fn new(engine: Engine<S>, topology: Topology, settings: Settings) -> Self {
        let counters = AmqpCounters::default();
        Self {
            waits: Waits::new(engine.telemetry()),
            breaker: Breaker::new(
                settings.pause,
                engine.telemetry(),
                Arc::clone(&counters.consumer.pauses),
            ),
            counters,
            engine,
            topology,
            settings,
        }
    }

    /// The engine (store, scope, key spec) this consumer runs.
    pub fn engine(&self) -> &Engine<S> {
        &self.engine
    }

    /// Runs until SIGINT or SIGTERM (or until idle, if
    /// [`exit_when_idle`](AmqpConsumerBuilder::exit_when_idle) is set), then
    /// shuts down gracefully (see [`run_until`](Self::run_until)).
    pub async fn run<H>(self, handler: H) -> Result<AmqpStats, AmqpConsumerError>
    where
        H: Handler<S::Db> + 'static,
    {
        crate::broker::shutdown::until_signal(|shutdown| self.run_until(handler, shutdown)).await
    }

    /// Runs until `shutdown` is cancelled (or until idle, if configured),
    /// reconnecting with backoff whenever the connection drops. Shutdown
    /// cancels the consumer (no new deliveries), lets messages being handled
    /// finish and ack (retry waits are cut short: those stay unacked and the
    /// broker redelivers them), then closes the channel and the connection.
    ///
    /// Fails only on what reconnecting cannot fix: a topology the broker
    /// refuses (e.g. the queue exists with other arguments, or is missing
    /// with [`QueueKind::Existing`](super::QueueKind::Existing)).
    pub async fn run_until<H>(
        self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<AmqpStats, AmqpConsumerError>
    where
        H: Handler<S::Db> + 'static,
    {
        if let Some(missing) = crate::broker::preflight::missing_schema(&self.engine).await {
            return Err(AmqpConsumerError::MissingSchema(missing));
        }
        let waits = self.waits;
        let env = Arc::new(Env {
            engine: self.engine,
            handler,
            topology: self.topology,
            counters: self.counters,
            waits,
            breaker: self.breaker,
            publishing: super::publish::Confirms::new(super::publish::CONFIRM_TIMEOUT),
        });
        let settings = self.settings;
        let delays = || crate::engine::backoff(settings.reconnect_min, settings.reconnect_max);
        let mut backoff = delays();
        let mut idle_since = Instant::now();
        let mut seen = 0;
        while !shutdown.is_cancelled() {
            match session(&env, &settings, &shutdown, &mut idle_since).await {
                Ok(End::Stopped | End::Idle) => break,
                Err(e) if !is_reconnectable(&e) => return Err(e),
                Err(e) => {
                    if env.counters.connections_since(&mut seen) {
                        // It had connected: start the backoff over.
                        backoff = delays();
                    }
                    let delay = backoff.next().unwrap_or(settings.reconnect_max);
                    tracing::warn!(error = %e, ?delay, "AMQP connection lost or refused; reconnecting");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        Ok(env.counters.snapshot())
    }
}

/// One connection's life. `Err` means: reconnect (unless it is a topology error).
async fn session<S, H>(
    env: &Arc<Env<S, H>>,
    settings: &Settings,
    shutdown: &CancellationToken,
    idle_since: &mut Instant,
) -> Result<End, AmqpConsumerError>
where
    S: SqlStore,
    H: Handler<S::Db> + 'static,
{
    // A broker that is starting can accept the connection and then stall:
    // bound the whole setup.
    let setup = async {
        let conn = super::connect(&settings.url, &settings.tls).await?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        channel
            .basic_qos(settings.prefetch, BasicQosOptions::default())
            .await?;
        env.topology.declare(&channel).await?;
        let consumer = channel
            .basic_consume(
                env.topology.queue.as_str().into(),
                // The broker generates a unique consumer tag.
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok::<_, AmqpConsumerError>((conn, channel, consumer))
    };
    let (conn, channel, mut consumer) = match tokio::time::timeout(SETUP_TIMEOUT, setup).await {
        Ok(result) => result?,
        Err(_) => {
            return Err(AmqpConsumerError::ConnectionLost(format!(
                "connection setup took longer than {SETUP_TIMEOUT:?}"
            )));
        }
    };
    let tag = consumer.tag();
    bump(&env.counters.connections);
    // Time spent reconnecting is not idleness.
    *idle_since = Instant::now();
    tracing::info!(queue = %env.topology.queue, prefetch = settings.prefetch, "consuming");

    // Stops the tasks of this session: on shutdown, and when the connection
    // is gone (their acks could not reach the broker anyway).
    let stop = shutdown.child_token();
    let permits = Arc::new(Semaphore::new(settings.concurrency));
    let mut tasks = JoinSet::new();
    let idle_check = settings.exit_when_idle.unwrap_or(Duration::from_secs(3600));
    let mut tick = tokio::time::interval(
        Duration::from_millis(200)
            .min(idle_check)
            .max(Duration::from_millis(1)),
    );
    // A delivery is taken from the stream only with a permit in hand, so
    // deliveries start in the order they arrived (with `concurrency(1)`,
    // strictly one after the other); the rest wait, unacked, in the
    // prefetch buffer.
    let mut permit: Option<OwnedSemaphorePermit> = None;
    let end: Result<End, AmqpConsumerError> = loop {
        tokio::select! {
            () = shutdown.cancelled() => break Ok(End::Stopped),
            p = Arc::clone(&permits).acquire_owned(), if permit.is_none() => match p {
                Ok(p) => permit = Some(p),
                // Closed only after this loop.
                Err(_) => break Ok(End::Stopped),
            },
            next = consumer.next(), if permit.is_some() => match next {
                Some(Ok(message)) => {
                    *idle_since = Instant::now();
                    let env = Arc::clone(env);
                    let channel = channel.clone();
                    let stop = stop.clone();
                    let held = permit.take();
                    tasks.spawn(async move {
                        let _held = held;
                        let acker = message.acker.clone();
                        // User code is caught by the engine; this is the net
                        // under onceonly's own code: the message goes back to
                        // the queue rather than holding a prefetch slot until
                        // the channel closes.
                        let handled = AssertUnwindSafe(handle(&env, &channel, message, &stop))
                            .catch_unwind()
                            .await;
                        if handled.is_err() {
                            tracing::error!("a delivery task panicked; requeueing its message");
                            let requeue = BasicNackOptions { requeue: true, ..Default::default() };
                            if let Err(e) = acker.nack(requeue).await {
                                tracing::warn!(error = %e, "nack after a panic failed; the broker redelivers on channel close");
                            }
                        }
                    });
                }
                // The broker closed the channel (an ack timeout, a refused
                // publish) or the connection: reconnect either way; only a
                // topology refused at setup is fatal.
                Some(Err(e)) => break Err(AmqpConsumerError::ConnectionLost(e.to_string())),
                None => break Err(AmqpConsumerError::ConnectionLost(
                    "the broker ended the consumer (connection closed or consumer cancelled)".into(),
                )),
            },
            Some(done) = tasks.join_next() => {
                if let Err(e) = done
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "a delivery task panicked; its message stays unacked and is redelivered");
                }
                *idle_since = Instant::now();
            }
            _ = tick.tick() => {
                // Do not rely on the delivery stream alone to notice a dead
                // connection.
                if !conn.status().connected() || !channel.status().connected() {
                    break Err(AmqpConsumerError::ConnectionLost(
                        "the connection or channel is no longer open".into(),
                    ));
                }
                if let Some(idle) = settings.exit_when_idle
                    && tasks.is_empty()
                    && idle_since.elapsed() >= idle
                {
                    tracing::info!(?idle, "queue idle; stopping");
                    break Ok(End::Idle);
                }
            }
        }
    };
    let open = conn.status().connected() && channel.status().connected();
    if end.is_ok() && open {
        // No new deliveries.
        let cancel = channel.basic_cancel(tag.clone(), BasicCancelOptions::default());
        match tokio::time::timeout(CLOSE_TIMEOUT, cancel).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "basic.cancel failed"),
            Err(_) => tracing::debug!("basic.cancel timed out"),
        }
    }
    // Deliveries not started yet stay unacked (requeued when the channel
    // closes); outage waits and publish retries end now; handlers in
    // progress finish and ack if the channel is still there.
    permits.close();
    stop.cancel();
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done
                && e.is_panic()
            {
                tracing::error!(error = %e, "a delivery task panicked");
            }
        }
    })
    .await;
    if drained.is_err() {
        // Their messages stay unacked and come back.
        tracing::warn!("handlers still running after {DRAIN_TIMEOUT:?}; abandoning them");
        tasks.abort_all();
    }
    if conn.status().connected() {
        let reason = "onceonly consumer stopping";
        if tokio::time::timeout(CLOSE_TIMEOUT, channel.close(200, reason.into()))
            .await
            .is_err()
        {
            tracing::debug!("channel close timed out");
        }
        if tokio::time::timeout(CLOSE_TIMEOUT, conn.close(200, reason.into()))
            .await
            .is_err()
        {
            tracing::debug!("connection close timed out");
        }
    }
    end
}

/// Bounds connecting, declaring and starting to consume.
const SETUP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bounds each closing step on a connection that may be half dead.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a session end waits for handlers in progress.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether reconnecting may help.
fn is_reconnectable(e: &AmqpConsumerError) -> bool {
    match e {
        AmqpConsumerError::Client(e) => is_connection_level(e),
        AmqpConsumerError::ConnectionLost(_) | AmqpConsumerError::NotConfirmed { .. } => true,
        _ => false,
    }
}
