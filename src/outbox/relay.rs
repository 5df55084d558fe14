//! The relay: publishes committed outbox rows, in order per ordering key,
//! and marks them sent once their destination confirmed them.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use sqlx::Pool;
use tokio::sync::{Notify, Semaphore, watch};

use super::Outbox;
use super::backend::{Failed, OutboxBackend, OutboxRow, Status};
use super::message::Kind;
use super::publish::{Outgoing, PublishError, Publisher};
use crate::clock::{Clock, SystemClock};
use crate::store::deadline::within;
use crate::store::{Deadlines, StoreError};

/// How long a relay holds the keys it took in a round by default (see
/// [`RelayBuilder::lease`]).
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How many webhooks a relay has in flight to one URL at most by default
/// (see [`RelayBuilder::max_in_flight_per_destination`]).
const DEFAULT_IN_FLIGHT_PER_DESTINATION: usize = 16;

/// Builds a [`Relay`]: `Relay::builder(pool, outbox).publisher(..).build()`.
pub struct RelayBuilder<DB: OutboxBackend> {
    relay: Relay<DB>,
}

/// Publishes committed outbox rows. Several relays may run at once, in one
/// process or many: each takes the rows it publishes in a short
/// transaction (`FOR UPDATE SKIP LOCKED` on PostgreSQL and MySQL/MariaDB;
/// SQLite has one writer) and leases their keys (see
/// [`RelayBuilder::lease`]), and only the first pending row of an ordering
/// key can be taken, so order per key holds. No transaction is open while
/// a message is published.
pub struct Relay<DB: OutboxBackend> {
    pool: Pool<DB>,
    outbox: Outbox<DB>,
    publishers: BTreeMap<Kind, Arc<dyn Publisher>>,
    batch: u32,
    poll_interval: Duration,
    max_attempts: u32,
    backoff_min: Duration,
    backoff_max: Duration,
    keep_sent: Option<Duration>,
    purge_every: Duration,
    lease: Duration,
    in_flight_per_destination: usize,
    wake: Arc<Notify>,
    deadlines: Deadlines,
}

/// What a relay did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Messages confirmed by their destination and marked sent.
    pub published: u64,
    /// Failed attempts (each retried later, or parked).
    pub failed: u64,
    /// Messages parked as dead.
    pub dead: u64,
    /// Sent rows purged.
    pub purged: u64,
}

impl<DB: OutboxBackend> Relay<DB> {
    /// A relay for `outbox`'s table in `pool`'s database.
    pub fn builder(pool: Pool<DB>, outbox: Outbox<DB>) -> RelayBuilder<DB> {
        RelayBuilder {
            relay: Self {
                pool,
                outbox,
                publishers: BTreeMap::new(),
                batch: 100,
                poll_interval: Duration::from_secs(1),
                max_attempts: 12,
                backoff_min: Duration::from_millis(500),
                backoff_max: Duration::from_secs(300),
                keep_sent: Some(Duration::from_secs(24 * 3600)),
                purge_every: Duration::from_secs(60),
                lease: DEFAULT_LEASE,
                in_flight_per_destination: DEFAULT_IN_FLIGHT_PER_DESTINATION,
                wake: Arc::new(Notify::new()),
                deadlines: Deadlines::default(),
            },
        }
    }

    /// Runs until `shutdown` completes (a round in progress finishes
    /// first).
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> RelayStats {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stats = RelayStats::default();
        let kinds: Vec<Kind> = self.publishers.keys().copied().collect();
        let heads = self.outbox.sql().heads(&kinds);
        // Stopped with the relay (a detached listener would keep a pool
        // connection for ever).
        let _listener = self.listen().map(AbortOnDrop);
        let table = self.outbox.sql().table.clone();
        let mut last_purge = Instant::now();
        let mut last_backlog: Option<Instant> = None;
        let mut failures = crate::engine::backoff(self.backoff_min, Duration::from_secs(30));
        loop {
            if last_backlog.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                self.backlog_metrics(&table).await;
                last_backlog = Some(Instant::now());
            }
            if self.keep_sent.is_some() && last_purge.elapsed() >= self.purge_every {
                stats.purged += self.purge().await;
                last_purge = Instant::now();
            }
            let round = self.round(&heads, &mut stats).await;
            let pause = match round {
                // A full batch: more is likely waiting.
                Ok(n) if n >= self.batch as usize => Duration::ZERO,
                Ok(_) => {
                    failures = crate::engine::backoff(self.backoff_min, Duration::from_secs(30));
                    self.poll_interval
                }
                Err(e) => {
                    tracing::warn!(error = %e, %table, "outbox relay round failed; retrying");
                    failures.next().unwrap_or(Duration::from_secs(30))
                }
            };
            if pause.is_zero() {
                continue;
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return stats,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Runs the relay on the current tokio runtime until
    /// [`RelayHandle::stop`].
    pub fn spawn(self) -> RelayHandle {
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        RelayHandle { stop, task }
    }

    /// A PostgreSQL relay listens for the enqueue notifications, so that
    /// it wakes as soon as a claim commits; other backends poll.
    fn listen(&self) -> Option<tokio::task::JoinHandle<()>> {
        #[cfg(feature = "postgres")]
        {
            let pool = (&self.pool as &dyn std::any::Any).downcast_ref::<sqlx::PgPool>()?;
            let options = pool.connect_options();
            let channel = self.outbox.channel().to_owned();
            let wake = Arc::clone(&self.wake);
            let deadlines = self.deadlines;
            Some(tokio::spawn(async move {
                loop {
                    listen_until_lost(&options, &channel, &wake, &deadlines).await;
                    // Reconnected or not, poll meanwhile.
                    wake.notify_one();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }))
        }
        #[cfg(not(feature = "postgres"))]
        None
    }

    /// One round: take and lease a batch in a short transaction, publish it
    /// per ordering key with no transaction open, then record the results
    /// in another short transaction. Returns how many rows it took.
    ///
    /// No database transaction is open while a message travels: on SQLite
    /// the relay's write lock would stop every claim and enqueue while a
    /// webhook takes its time, and on PostgreSQL and MySQL/MariaDB its row
    /// and gap locks would block enqueues alike. The lease (the heads'
    /// `next_attempt_at_ms` moved to the end of the lease) keeps other
    /// relays off the taken keys meanwhile; a relay that dies mid-round
    /// leaves its keys to the others once the lease ends, and they publish
    /// the rows again with the same message ids.
    async fn round(&self, heads: &str, stats: &mut RelayStats) -> Result<usize, StoreError> {
        let rows = self.take(heads).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        // Keys in parallel, each key's rows in order (pipelined where the
        // publisher can), within half the lease; a webhook URL's keys at
        // most `in_flight_per_destination` at a time.
        let deadline = Instant::now() + self.lease / 2;
        let mut by_key: BTreeMap<&str, Vec<&OutboxRow>> = BTreeMap::new();
        for row in &rows {
            by_key.entry(&row.order_key).or_default().push(row);
        }
        let mut slots: std::collections::HashMap<&str, Arc<Semaphore>> =
            std::collections::HashMap::new();
        let results = futures_util::future::join_all(by_key.into_values().map(|queue| {
            let slot = queue
                .first()
                .filter(|head| head.kind == Kind::Webhook.as_str())
                .map(|head| {
                    Arc::clone(slots.entry(head.destination.as_str()).or_insert_with(|| {
                        Arc::new(Semaphore::new(self.in_flight_per_destination))
                    }))
                });
            self.publish_in_turn(queue, slot, deadline)
        }))
        .await;
        let mut sent = Vec::with_capacity(rows.len());
        let mut failures = Vec::new();
        let mut untried = Vec::new();
        for outcome in results {
            match outcome {
                Turn::Published(ids, failure) => {
                    sent.extend(ids);
                    failures.extend(failure);
                }
                Turn::Untried(head) => untried.push(head),
            }
        }
        self.record(&sent, &failures, &untried, stats).await?;
        Ok(rows.len())
    }

    /// Takes a batch in a short transaction and leases the heads of its
    /// keys (each key's first row; the rows behind a pending head cannot be
    /// anyone's head meanwhile).
    async fn take(&self, heads: &str) -> Result<Vec<OutboxRow>, StoreError> {
        let sql = self.outbox.sql();
        let now = SystemClock.now_ms();
        let statement = self.statement();
        let mut tx = within(self.on_pool(), "begin", DB::begin(&self.pool)).await?;
        let claim = DB::claim(&mut tx, heads, sql, now, i64::from(self.batch));
        let rows = within(statement, "outbox claim", claim).await?;
        if !rows.is_empty() {
            let lease_ms = i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX);
            let mut first_of_key = std::collections::HashSet::new();
            let leased: Vec<i64> = rows
                .iter()
                .filter(|r| first_of_key.insert(r.order_key.as_str()))
                .map(|r| r.id)
                .collect();
            let until = now.saturating_add(lease_ms);
            let lease = DB::update_pending(&mut tx, &sql.lease_prefix, until, &leased);
            within(statement, "outbox lease", lease).await?;
        }
        within(statement, "commit", tx.commit()).await?;
        Ok(rows)
    }

    /// Records a round's results in a short transaction: `sent` rows as
    /// sent, each failure as due again later or parked as dead, and the
    /// leases of the `untried` heads (whose turn did not come before the
    /// round's deadline) ended, so that they are due again now rather
    /// than when the lease ends.
    async fn record(
        &self,
        sent: &[i64],
        failures: &[(&OutboxRow, PublishError)],
        untried: &[i64],
        stats: &mut RelayStats,
    ) -> Result<(), StoreError> {
        let sql = self.outbox.sql();
        let statement = self.statement();
        let mut tx = within(self.on_pool(), "begin", self.pool.begin()).await?;
        let now = SystemClock.now_ms();
        let marked = DB::update_pending(&mut tx, &sql.sent_prefix, now, sent);
        within(statement, "outbox mark sent", marked).await?;
        let released = DB::update_pending(&mut tx, &sql.lease_prefix, now, untried);
        within(statement, "outbox lease end", released).await?;
        let mut recorded = Vec::with_capacity(failures.len());
        for (row, error) in failures {
            let dead = error.is_permanent()
                || u32::try_from(row.attempts + 1).unwrap_or(u32::MAX) >= self.max_attempts;
            let delay = self.retry_delay(row.attempts);
            let failure = Failed {
                id: row.id,
                dead,
                next_ms: SystemClock
                    .now_ms()
                    .saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)),
                error: &error.to_string(),
            };
            let marked = DB::mark_failed(&mut tx, sql, &failure);
            within(statement, "outbox mark failed", marked).await?;
            recorded.push((row, error, dead, delay));
        }
        // A failed commit leaves the rows pending: they are published
        // again, with the same message ids, once their lease ends.
        within(statement, "commit", tx.commit()).await?;
        stats.published += sent.len() as u64;
        for (row, error, dead, delay) in recorded {
            stats.failed += 1;
            if dead {
                stats.dead += 1;
                tracing::error!(message_id = %row.message_id, kind = %row.kind, destination = %row.destination, error = %error, "outbox message parked as dead");
            } else {
                tracing::warn!(message_id = %row.message_id, kind = %row.kind, destination = %row.destination, attempts = row.attempts + 1, ?delay, error = %error, "outbox publish failed; retrying");
            }
        }
        Ok(())
    }

    /// Publishes one key's rows in order ([`publish_in_order`](Self::publish_in_order))
    /// once `slot` (its webhook URL's share of
    /// [`RelayBuilder::max_in_flight_per_destination`]) has room, holding
    /// it meanwhile. A key whose turn has not come by `deadline` is left
    /// untried.
    async fn publish_in_turn<'r>(
        &self,
        queue: Vec<&'r OutboxRow>,
        slot: Option<Arc<Semaphore>>,
        deadline: Instant,
    ) -> Turn<'r> {
        let _permit = match slot {
            Some(slot) => {
                let waited = Instant::now();
                let until = tokio::time::Instant::from_std(deadline);
                match tokio::time::timeout_at(until, slot.acquire_owned()).await {
                    Ok(Ok(permit)) => {
                        if let Some(head) = queue.first() {
                            histogram!(
                                "onceonly_outbox_destination_wait_seconds",
                                "kind" => head.kind.clone(),
                            )
                            .record(waited.elapsed().as_secs_f64());
                        }
                        Some(permit)
                    }
                    // Past the deadline (or, never, a closed semaphore):
                    // the key waits for the next round.
                    Ok(Err(_)) | Err(_) => {
                        return match queue.first() {
                            Some(head) => Turn::Untried(head.id),
                            None => Turn::Published(Vec::new(), None),
                        };
                    }
                }
            }
            None => None,
        };
        let (sent, failure) = self.publish_in_order(queue, deadline).await;
        Turn::Published(sent, failure)
    }

    /// Publishes one key's rows in order through its publisher's
    /// [`Publisher::publish_ordered`] (pipelined where the destination
    /// keeps order in flight), starting none after `deadline`. Returns the
    /// rows confirmed before the first failure, and that failure: every
    /// row after it stays pending, confirmed or not, and leaves again
    /// after it (a failed row blocks the rows behind it).
    async fn publish_in_order<'r>(
        &self,
        queue: Vec<&'r OutboxRow>,
        deadline: Instant,
    ) -> (Vec<i64>, Option<(&'r OutboxRow, PublishError)>) {
        let Some(head) = queue.first().copied() else {
            return (Vec::new(), None);
        };
        let kind = Kind::parse(&head.kind);
        let Some(publisher) = kind.and_then(|k| self.publishers.get(&k)) else {
            let error = PublishError::permanent(format!("no publisher for kind {:?}", head.kind));
            return (Vec::new(), Some((head, error)));
        };
        // An ordering key names its kind, so its rows share one; the rest
        // would wait for the next round.
        let same_kind = queue.iter().take_while(|r| r.kind == head.kind).count();
        let rows = &queue[..same_kind];
        #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
        let mut messages: Vec<Outgoing<'_>> = rows.iter().map(|r| Outgoing::new(r)).collect();
        // A producer span per message (feature `otel`), a child of the
        // context the row stored, whose own context the message carries.
        #[cfg(feature = "otel")]
        let spans: Vec<tracing::Span> = messages
            .iter_mut()
            .map(|message| {
                let span = publish_span(message.row);
                crate::otel::adopt_headers(&span, &message.headers);
                crate::otel::carry(&mut message.headers, &span);
                if message.row.kind == Kind::Webhook.as_str() {
                    // Baggage (tenant or user ids) stays inside: a webhook
                    // goes to a third party.
                    message
                        .headers
                        .retain(|(name, _)| !name.eq_ignore_ascii_case("baggage"));
                }
                span
            })
            .collect();
        let started = Instant::now();
        let results = publisher.publish_ordered(&messages, deadline).await;
        #[cfg(feature = "otel")]
        for (i, span) in spans.iter().enumerate() {
            match results.get(i) {
                Some(Ok(())) => span.record("outcome", "sent"),
                Some(Err(_)) => span
                    .record("outcome", "failed")
                    .record("otel.status_code", "ERROR"),
                // Behind a failure, or past the round's deadline.
                None => span.record("outcome", "not_sent"),
            };
        }
        let took = started.elapsed().as_secs_f64();
        let mut sent = Vec::with_capacity(results.len());
        for (row, published) in rows.iter().copied().zip(results) {
            let kind = row.kind.clone();
            histogram!("onceonly_outbox_publish_seconds", "kind" => kind.clone()).record(took);
            match published {
                Ok(()) => {
                    counter!("onceonly_outbox_published_total", "kind" => kind).increment(1);
                    sent.push(row.id);
                }
                Err(e) => {
                    counter!(
                        "onceonly_outbox_failures_total",
                        "kind" => kind,
                        "destination" => destination_label(row),
                        "permanent" => if e.is_permanent() { "true" } else { "false" },
                    )
                    .increment(1);
                    return (sent, Some((row, e)));
                }
            }
        }
        (sent, None)
    }

    /// The bound of one statement in a round's transaction.
    fn statement(&self) -> Duration {
        self.deadlines.statement_deadline()
    }

    /// The bound of one call on the pool: a connection, then a statement.
    fn on_pool(&self) -> Duration {
        self.deadlines.statement_deadline() + self.deadlines.acquire_timeout()
    }

    /// The delay before attempt `attempts + 2`: doubling from the minimum,
    /// capped.
    fn retry_delay(&self, attempts: i32) -> Duration {
        let doublings = u32::try_from(attempts).unwrap_or(0).min(20);
        self.backoff_min
            .saturating_mul(1 << doublings)
            .min(self.backoff_max)
    }

    async fn backlog_metrics(&self, table: &str) {
        match within(
            self.on_pool(),
            "outbox stats",
            self.outbox.stats(&self.pool),
        )
        .await
        {
            Ok(stats) => {
                // Delayed messages are not due: not a backlog yet.
                let backlog = stats.backlog();
                gauge!("onceonly_outbox_backlog", "table" => table.to_owned()).set(backlog as f64);
                let age = stats
                    .oldest_ms(Status::Pending)
                    .map(|oldest| (SystemClock.now_ms() - oldest).max(0) as f64 / 1000.0)
                    .unwrap_or(0.0);
                gauge!("onceonly_outbox_oldest_pending_seconds", "table" => table.to_owned())
                    .set(age);
                let dead = stats.rows(Status::Dead);
                gauge!("onceonly_outbox_dead_rows", "table" => table.to_owned()).set(dead as f64);
            }
            Err(e) => tracing::debug!(error = %e, "outbox backlog query failed"),
        }
    }

    async fn purge(&self) -> u64 {
        let Some(keep) = self.keep_sent else { return 0 };
        let before = SystemClock
            .now_ms()
            .saturating_sub(i64::try_from(keep.as_millis()).unwrap_or(i64::MAX));
        let purged = self.outbox.purge_sent(&self.pool, before, 1000);
        match within(self.on_pool(), "outbox purge", purged).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "purging sent outbox rows failed");
                0
            }
        }
    }
}

/// What became of one key's rows in a round.
enum Turn<'r> {
    /// The rows confirmed before the first failure, and that failure.
    Published(Vec<i64>, Option<(&'r OutboxRow, PublishError)>),
    /// None tried: the round's deadline came first (the key's head).
    Untried(i64),
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long the outbox listener waits for a notification before it checks
/// that its connection still answers.
#[cfg(feature = "postgres")]
const LISTENER_QUIET: Duration = Duration::from_secs(30);

/// Wakes the relay on each notification of `channel` until the listener's
/// connection fails, or does not answer a check (bounded by the statement
/// deadline) after [`LISTENER_QUIET`] without notifications: a network
/// gone silent. The listener has a pool of its own, so that a silent
/// connection it leaves behind never holds a slot of the relay's pool.
#[cfg(feature = "postgres")]
async fn listen_until_lost(
    options: &sqlx::postgres::PgConnectOptions,
    channel: &str,
    wake: &Notify,
    deadlines: &Deadlines,
) {
    let pool = crate::store::pool_options_for::<sqlx::Postgres>(deadlines)
        .max_connections(1)
        .connect_lazy_with(options.clone());
    let bound = deadlines.acquire_timeout() + deadlines.statement_deadline();
    let listening = within(bound, "outbox listener", async {
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
        listener.listen(channel).await?;
        Ok::<_, sqlx::Error>(listener)
    });
    let mut listener = match listening.await {
        Ok(listener) => listener,
        Err(e) => {
            tracing::debug!(error = %e, "outbox listener cannot connect");
            return;
        }
    };
    loop {
        match tokio::time::timeout(LISTENER_QUIET, listener.recv()).await {
            Ok(Ok(_)) => wake.notify_one(),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "outbox listener lost its connection");
                return;
            }
            Err(_quiet) => {
                let check = sqlx::query("SELECT 1").execute(&mut listener);
                if let Err(e) =
                    within(deadlines.statement_deadline(), "outbox listener", check).await
                {
                    tracing::debug!(error = %e, "outbox listener does not answer");
                    return;
                }
            }
        }
    }
}

/// The metric label of a destination: the topic or exchange, or a
/// webhook's host (URLs would make one series per merchant path).
fn destination_label(row: &OutboxRow) -> String {
    if row.kind == Kind::Webhook.as_str() {
        let rest = row
            .destination
            .split_once("://")
            .map_or(row.destination.as_str(), |(_, r)| r);
        rest.split(['/', '?']).next().unwrap_or_default().to_owned()
    } else {
        row.destination.clone()
    }
}

impl<DB: OutboxBackend> RelayBuilder<DB> {
    /// Adds the publisher of one kind of destination (replacing an earlier
    /// one of the same kind). The relay takes only rows of the kinds it has
    /// publishers for.
    #[must_use]
    pub fn publisher(mut self, publisher: impl Publisher + 'static) -> Self {
        self.relay
            .publishers
            .insert(publisher.kind(), Arc::new(publisher));
        self
    }

    /// At most this many rows per round (default 100).
    #[must_use]
    pub fn batch(mut self, batch: u32) -> Self {
        self.relay.batch = batch.max(1);
        self
    }

    /// How long an idle relay sleeps before looking again (default 1 s; a
    /// PostgreSQL relay also wakes when a row commits).
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.relay.poll_interval = interval;
        self
    }

    /// Attempts before a message is parked as dead (default 12).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.relay.max_attempts = attempts.max(1);
        self
    }

    /// Delay after a failed attempt: `min` doubling up to `max` (default
    /// 500 ms to 5 min).
    #[must_use]
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.relay.backoff_min = min;
        self.relay.backoff_max = max.max(min);
        self
    }

    /// How long sent rows are kept before the relay purges them (default 24
    /// hours; `None`: never, purge with `onceonly outbox purge`).
    #[must_use]
    pub fn keep_sent(mut self, keep: Option<Duration>) -> Self {
        self.relay.keep_sent = keep;
        self
    }

    /// The bounds of the relay's database calls (default
    /// [`Deadlines::default`]): each statement, and taking a connection,
    /// so that a silent network fails a round (retried with backoff)
    /// instead of stalling the relay. Build the pool on
    /// [`pool_options_for`](crate::store::pool_options_for) so that the
    /// connections of a missed deadline are discarded, not reused.
    #[must_use]
    pub fn deadlines(mut self, deadlines: Deadlines) -> Self {
        self.relay.deadlines = deadlines;
        self
    }

    /// How long the keys a round took stay its own (default
    /// 30 s, at least 1 s). A round takes its rows in a short
    /// transaction and publishes them with no transaction open; meanwhile
    /// the lease keeps other relays off those keys. A round starts no
    /// message of a key after half the lease (the rest wait for the next
    /// round; Kafka and AMQP send a key's partition or channel run at
    /// once, bounded by their timeouts). If a relay dies mid-round, its keys are taken up again when
    /// the lease ends, and their unconfirmed rows are sent again with the
    /// same message ids: the lease is how long a crash delays them. A
    /// publish that outlasts the lease (a broker that answers after the
    /// publishers' timeouts, 30 s for Kafka and AMQP, 10 s for webhooks)
    /// may see another relay send the same rows again, with the same ids
    /// and in the same order per key; a downstream consumer keyed on the
    /// message id applies them once.
    #[must_use]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.relay.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// How many webhooks the relay has in flight to one URL at most
    /// (default 16, at least 1). Webhooks without an
    /// [`order_by`](super::OutboxMessage::order_by) key are ordered on
    /// their own, so a round may hold a batch of them for one merchant's
    /// URL: they go out side by side, this many at a time, the others
    /// waiting their turn (a key with an `order_by` key, its messages one
    /// after another, takes one place). A key whose turn has not come by
    /// half the [`lease`](Self::lease) waits for the next round, due at
    /// once. The bound is per relay: two relays may have twice as many in
    /// flight to one URL. Kafka and AMQP are bounded by their publishers
    /// (one producer; the channels of `AmqpPublisher::with_channels`),
    /// not by this.
    #[must_use]
    pub fn max_in_flight_per_destination(mut self, n: usize) -> Self {
        self.relay.in_flight_per_destination = n.clamp(1, Semaphore::MAX_PERMITS);
        self
    }

    /// The relay; fails without a publisher.
    pub fn build(self) -> Result<Relay<DB>, RelayBuildError> {
        if self.relay.publishers.is_empty() {
            return Err(RelayBuildError::NoPublisher);
        }
        Ok(self.relay)
    }
}

/// A relay that cannot work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayBuildError {
    /// No publisher was added.
    #[error("an outbox relay needs at least one publisher")]
    NoPublisher,
}

/// A running [`Relay`].
#[derive(Debug)]
pub struct RelayHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<RelayStats>,
}

impl RelayHandle {
    /// Stops the relay after its current round; returns what it did.
    pub async fn stop(self) -> RelayStats {
        let _ = self.stop.send(true);
        match self.task.await {
            Ok(stats) => stats,
            Err(e) => {
                tracing::error!(error = %e, "the outbox relay task failed");
                RelayStats::default()
            }
        }
    }
}

/// A webhook URL's host (without brackets for IPv6) and port (the
/// scheme's default when it names none).
#[cfg(feature = "otel")]
fn host_and_port(url: &str) -> (Option<String>, Option<u16>) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let authority = authority.rsplit('@').next().unwrap_or_default();
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((host, rest)) => (host, rest.strip_prefix(':')),
            None => (v6, None),
        },
        None => match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    let port = port.and_then(|p| p.parse().ok()).or(match scheme {
        "https" => Some(443),
        "http" => Some(80),
        _ => None,
    });
    ((!host.is_empty()).then(|| host.to_owned()), port)
}

/// The span of one relayed message's publish (feature `otel`), with the
/// OpenTelemetry messaging conventions.
#[cfg(feature = "otel")]
fn publish_span(row: &OutboxRow) -> tracing::Span {
    let system = match Kind::parse(&row.kind) {
        Some(Kind::Kafka) => Some("kafka"),
        Some(Kind::Amqp) => Some("rabbitmq"),
        _ => None,
    };
    // A webhook is an HTTP call to a third party: a client span, named by
    // its host only (a webhook URL's path or query can be a credential).
    // `server.address` is the host alone, `server.port` the port (the
    // HTTP client conventions).
    let (host, port) = match system {
        None => host_and_port(&row.destination),
        Some(_) => (None, None),
    };
    tracing::info_span!(
        "onceonly.publish",
        otel.kind = if system.is_some() { "producer" } else { "client" },
        otel.status_code = tracing::field::Empty,
        messaging.system = system,
        messaging.operation.type = system.map(|_| "send"),
        messaging.destination.name = system.map(|_| row.destination.as_str()),
        server.address = host.as_deref(),
        server.port = port,
        messaging.message.id = %row.message_id,
        outcome = tracing::field::Empty,
    )
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    use super::host_and_port;

    /// Issue 44, defect 14: `server.address` is the host alone, the port
    /// goes to `server.port`.
    #[test]
    fn webhook_spans_name_the_host_and_the_port_apart() {
        assert_eq!(
            host_and_port("https://hooks.example.com:8443/a?token=x"),
            (Some("hooks.example.com".to_owned()), Some(8443))
        );
        assert_eq!(
            host_and_port("http://127.0.0.1/notify"),
            (Some("127.0.0.1".to_owned()), Some(80))
        );
        assert_eq!(
            host_and_port("https://user:pw@[::1]:9000/x"),
            (Some("::1".to_owned()), Some(9000))
        );
        assert_eq!(
            host_and_port("https://example.com"),
            (Some("example.com".to_owned()), Some(443))
        );
    }
}
