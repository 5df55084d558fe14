//! Client-side deadlines: every database call onceonly makes has a bound,
//! a silent network included.
//!
//! After a failover the old primary's address often goes *silent*: no FIN,
//! no RST, statements in flight never answer, and sqlx has no deadline of
//! its own. So onceonly bounds each of its calls ([`Deadlines`]):
//!
//! - every statement of the store (`BEGIN`, the claim, recording the
//!   result, `COMMIT`, `ROLLBACK`, reads, purges, migrations) and of the
//!   outbox relay by the *statement* deadline;
//! - the handler, and so its own statements, by the *transaction*
//!   deadline, counted from `BEGIN`;
//! - taking a connection from the pool (connecting included) by the
//!   *acquire* timeout, and the liveness check of an idle connection by
//!   half of it.
//!
//! A call that misses its deadline fails with [`DeadlineMissed`]
//! ([`StoreError::Deadline`], an [`InfraFault::Timeout`](super::InfraFault::Timeout)):
//! transports wait in place and try again, never dead-letter. Its
//! connection may still have a statement in flight, so it must never be
//! used again: every connection that was open when a deadline was missed
//! is closed instead of being returned to, or handed out by, a pool built
//! on [`pool_options`](super::pool_options) (the stores' `connect`
//! constructors use it). Which connection missed is not known to the
//! pool, so this applies to every such pool of the process (SQLite's
//! excepted): a rare miss costs some reconnections, never a reuse of a
//! connection with a statement still in flight. The silent connections are discarded without a
//! byte sent, the healthy ones are replaced by fresh connections, and
//! processing resumes by itself once the network heals.
//!
//! The server side is bounded as well: [`PgStore`](crate::PgStore)'s
//! sessions set `idle_in_transaction_session_timeout` and TCP keepalives
//! (see [`Deadlines::idle_in_transaction`]), so that a silent client's
//! transaction does not hold its claim locks for hours, and migrations take
//! their locks with a timeout ([`Deadlines::migration_lock`]).

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::{Database, Transaction};

use super::StoreError;
use super::error::{epoch, is_stale_connection, since_epoch_ms};

/// The default [`Deadlines::statement`]: 15 s (above PostgreSQL's default
/// claim lock timeout of 10 s).
pub(crate) const DEFAULT_STATEMENT_DEADLINE: Duration = Duration::from_secs(15);

/// The default [`Deadlines::transaction`]: 30 s.
pub(crate) const DEFAULT_TRANSACTION_DEADLINE: Duration = Duration::from_secs(30);

/// The default [`Deadlines::acquire`]: 5 s.
pub(crate) const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// The default [`Deadlines::idle_in_transaction`]: 15 s.
pub(crate) const DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(15);

/// The default [`Deadlines::migration_lock`]: 10 s.
pub(crate) const DEFAULT_MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The default [`Deadlines::tcp_keepalive`]: probes after 10 s of
/// silence, every 5 s, 3 unanswered probes drop the connection.
pub(crate) const DEFAULT_TCP_KEEPALIVE: TcpKeepalive = TcpKeepalive {
    idle: Duration::from_secs(10),
    interval: Duration::from_secs(5),
    count: 3,
};

/// TCP keepalive settings of the server's side of a connection
/// (PostgreSQL's `tcp_keepalives_idle`, `tcp_keepalives_interval`,
/// `tcp_keepalives_count`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpKeepalive {
    /// Silence before the first probe.
    pub idle: Duration,
    /// Between probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub count: u32,
}

/// The bounds of onceonly's database calls, client and server side.
/// Start from the defaults and change what you need:
///
/// ```
/// use std::time::Duration;
/// use onceonly::store::Deadlines;
///
/// let deadlines = Deadlines::default()
///     .statement(Duration::from_secs(20))
///     .transaction(Duration::from_secs(60));
/// assert_eq!(deadlines.transaction_deadline(), Duration::from_secs(60));
/// ```
///
/// | setting | default | bounds |
/// |---|---|---|
/// | [`statement`](Self::statement) | 15 s | each call of the store and the outbox relay (`BEGIN`, claim, result, `COMMIT`, `ROLLBACK`, reads, purges); a claim with a [lock wait](super::ClaimRequest::lock_wait) gets that wait on top |
/// | [`transaction`](Self::transaction) | 30 s | the handler (its own statements included), from `BEGIN` |
/// | [`acquire`](Self::acquire) | 5 s | taking a connection from the pool, connecting included; an idle connection's liveness check gets half |
/// | [`idle_in_transaction`](Self::idle_in_transaction) | 15 s | server side: a session idle inside a transaction (PostgreSQL `idle_in_transaction_session_timeout`, MariaDB `idle_transaction_timeout`) |
/// | [`tcp_keepalive`](Self::tcp_keepalive) | 10 s, 5 s, 3 | server side: PostgreSQL's keepalive probes of a vanished client |
/// | [`migration_lock`](Self::migration_lock) | 10 s | a migration's wait for a lock (PostgreSQL `lock_timeout`, MySQL `lock_wait_timeout`) |
///
/// Keep the statement deadline above the claim's lock timeout
/// ([`PgStore::lock_timeout`](crate::PgStore::lock_timeout), 10 s by
/// default), and the transaction deadline above your slowest handler.
/// After a silent network heals, processing resumes within about the
/// acquire timeout plus one backoff (at most 8 s) once the calls in flight
/// have missed their deadlines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    statement: Duration,
    transaction: Duration,
    acquire: Duration,
    idle_in_transaction: Option<Duration>,
    tcp_keepalive: Option<TcpKeepalive>,
    migration_lock: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            statement: DEFAULT_STATEMENT_DEADLINE,
            transaction: DEFAULT_TRANSACTION_DEADLINE,
            acquire: DEFAULT_ACQUIRE_TIMEOUT,
            idle_in_transaction: Some(DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT),
            tcp_keepalive: Some(DEFAULT_TCP_KEEPALIVE),
            migration_lock: DEFAULT_MIGRATION_LOCK_TIMEOUT,
        }
    }
}

impl Deadlines {
    /// How long one call of the store or the relay may take (default
    /// 15 s, above PostgreSQL's default claim lock timeout of 10 s; at
    /// least 1 ms).
    #[must_use]
    pub fn statement(mut self, deadline: Duration) -> Self {
        self.statement = deadline.max(Duration::from_millis(1));
        self
    }

    /// How long a claim's transaction may run before its handler is given
    /// up on, counted from `BEGIN` (default
    /// 30 s; at least 1 ms).
    #[must_use]
    pub fn transaction(mut self, deadline: Duration) -> Self {
        self.transaction = deadline.max(Duration::from_millis(1));
        self
    }

    /// How long taking a connection from the pool may take, connecting
    /// included (the pool's `acquire_timeout`; default
    /// 5 s). Applies to pools built on
    /// [`pool_options_for`].
    #[must_use]
    pub fn acquire(mut self, timeout: Duration) -> Self {
        self.acquire = timeout.max(Duration::from_millis(2));
        self
    }

    /// Server side: how long a session may sit idle inside a transaction
    /// before the server ends it, rolling back and releasing its locks
    /// (default 15 s; `None`: the
    /// server's setting). A client whose network went silent leaves its
    /// transaction open on the server; without this bound it holds its
    /// claim locks until the server's TCP keepalive gives up, by default
    /// after hours. Keep it above the longest pause of a handler between
    /// two of its statements.
    #[must_use]
    pub fn idle_in_transaction(mut self, timeout: Option<Duration>) -> Self {
        self.idle_in_transaction = timeout;
        self
    }

    /// Server side: the TCP keepalive of PostgreSQL's end of each
    /// connection (default: probes after 10 s of silence, every 5 s, 3
    /// unanswered probes drop the connection; `None`: the server's settings). sqlx 0.8 offers no keepalive on the client's
    /// end: the client side relies on the deadlines.
    #[must_use]
    pub fn tcp_keepalive(mut self, keepalive: Option<TcpKeepalive>) -> Self {
        self.tcp_keepalive = keepalive;
        self
    }

    /// How long a migration waits for a lock before it fails (default
    /// 10 s), so that a startup migration
    /// behind a stuck transaction fails instead of blocking forever.
    #[must_use]
    pub fn migration_lock(mut self, timeout: Duration) -> Self {
        self.migration_lock = timeout.max(Duration::from_millis(1));
        self
    }

    /// See [`Deadlines::statement`].
    pub fn statement_deadline(&self) -> Duration {
        self.statement
    }

    /// See [`Deadlines::transaction`].
    pub fn transaction_deadline(&self) -> Duration {
        self.transaction
    }

    /// See [`Deadlines::acquire`].
    pub fn acquire_timeout(&self) -> Duration {
        self.acquire
    }

    /// See [`Deadlines::idle_in_transaction`].
    pub fn idle_in_transaction_timeout(&self) -> Option<Duration> {
        self.idle_in_transaction
    }

    /// See [`Deadlines::tcp_keepalive`].
    pub fn tcp_keepalive_settings(&self) -> Option<TcpKeepalive> {
        self.tcp_keepalive
    }

    /// See [`Deadlines::migration_lock`].
    pub fn migration_lock_timeout(&self) -> Duration {
        self.migration_lock
    }

    /// How long the liveness check of an idle pooled connection may take:
    /// half the acquire timeout, so that a silent one is replaced within
    /// the same acquire.
    fn ping(&self) -> Duration {
        self.acquire / 2
    }
}

/// A database call that did not answer within its deadline. Its
/// connection is discarded, never reused; an
/// [`InfraFault::Timeout`](super::InfraFault::Timeout).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} did not answer within {after:?} (a silent network or an overloaded database); \
     its connection is discarded"
)]
pub struct DeadlineMissed {
    what: &'static str,
    after: Duration,
}

impl DeadlineMissed {
    /// What missed its deadline, e.g. `claim` or `commit`.
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// The deadline it missed.
    pub fn after(&self) -> Duration {
        self.after
    }
}

// --- Discarding connections that may have a statement in flight ---------
//
// A future of sqlx dropped in the middle of a statement leaves its
// connection waiting for an answer; a pool that gets it back pings it
// first, which on a silent network waits forever (holding a pool slot).
// So when a deadline is missed, every connection open at that moment is
// closed instead of being returned to or handed out by the pool (see
// [`pool_options_for`]). Healthy ones among them are simply replaced.

/// Milliseconds since [`epoch`] of the last missed deadline, plus one; 0
/// if none.
static DEADLINE_MISSED: AtomicU64 = AtomicU64::new(0);

/// Notes a missed deadline: every connection open now is discarded.
fn note_missed() {
    DEADLINE_MISSED.store(since_epoch_ms(Instant::now()) + 1, Ordering::Relaxed);
}

/// Whether a connection of age `age` was open when a deadline was last
/// missed (and so may have a statement in flight, or a silent peer).
fn open_at_a_miss(age: Duration) -> bool {
    opened_before(DEADLINE_MISSED.load(Ordering::Relaxed), age)
}

/// Whether a connection of age `age` was opened before `mark` (ms since
/// [`epoch`], plus one; 0: never).
fn opened_before(mark: u64, age: Duration) -> bool {
    mark != 0 && since_epoch_ms(Instant::now().checked_sub(age).unwrap_or_else(epoch)) < mark
}

/// Whether a deadline was missed since `since`.
pub(crate) fn missed_since(since: Instant) -> bool {
    DEADLINE_MISSED.load(Ordering::Relaxed) > since_epoch_ms(since)
}

/// The error that makes the pool close an idle connection that did not
/// answer its ping without a byte sent (bounded by the acquire timeout).
fn discarded() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "idle pooled connection did not answer: closed, not reused",
    ))
}

/// Runs `call` for at most `bound`. On a miss the connection it used is
/// marked for discarding *before* the call is dropped.
pub(crate) async fn bounded<F: Future>(
    bound: Duration,
    what: &'static str,
    call: F,
) -> Result<F::Output, DeadlineMissed> {
    let mut call = pin!(call);
    tokio::select! {
        biased;
        out = &mut call => Ok(out),
        () = tokio::time::sleep(bound) => {
            note_missed();
            tracing::warn!(what, deadline = ?bound, "a database call missed its deadline; discarding the connections open now");
            Err(DeadlineMissed { what, after: bound })
        }
    }
    // `call` is dropped here, after the miss was noted.
}

/// Runs the database call `call` for at most `bound`: its own error, or
/// [`StoreError::Deadline`].
pub(crate) async fn within<T, E>(
    bound: Duration,
    what: &'static str,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, StoreError>
where
    StoreError: From<E>,
{
    bounded(bound, what, call).await?.map_err(StoreError::from)
}

/// Ends a transaction that will not commit: a `ROLLBACK` bounded by
/// `bound`, or, when a deadline was missed since `began` (its connection
/// is discarded anyway, and may not answer), just dropped: the server
/// rolls back when the connection closes or its transaction idles out.
pub(crate) async fn rollback<DB: Database>(
    tx: Transaction<'static, DB>,
    began: Instant,
    bound: Duration,
) {
    if missed_since(began) {
        drop(tx);
        return;
    }
    drop(bounded(bound, "rollback", tx.rollback()).await);
}

/// How long a pooled connection may have been idle before it is pinged
/// as it is handed out ([`pool_options_for`]): 1 s.
pub(crate) const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

/// sqlx pool options with onceonly's connection hygiene and `deadlines`
/// (see [`pool_options`](super::pool_options) for the defaults):
///
/// - `acquire_timeout` is [`Deadlines::acquire`];
/// - a connection idle for 1 s or longer is checked with a
///   ping bounded by half of it before it is handed out (instead of sqlx's
///   unbounded `test_before_acquire`, which pings every time: a round trip
///   per transaction); one that does not answer is closed and replaced
///   within the same acquire, and every other connection as old is closed
///   too. A connection that answered less than that ago is handed out as
///   it is: should its network have gone silent since, the first
///   statement's deadline catches it;
/// - a connection that was open when a deadline was missed is closed
///   (a `Terminate`, which a silent peer never needs to answer) instead of
///   being returned to the pool or handed out;
/// - an idle connection opened before the database was last seen
///   read-only is closed instead of handed out.
///
/// SQLite connections live in the process (an in-memory database lives in
/// its connection): they are never discarded for a missed deadline.
pub fn pool_options_for<DB: Database>(deadlines: &Deadlines) -> sqlx::pool::PoolOptions<DB> {
    let ping = deadlines.ping();
    let networked = DB::NAME != "SQLite";
    sqlx::pool::PoolOptions::new()
        .acquire_timeout(deadlines.acquire)
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            let read_only = is_stale_connection(meta.age);
            let missed = networked && open_at_a_miss(meta.age);
            Box::pin(async move {
                if read_only {
                    tracing::info!(
                        age = ?meta.age,
                        "closing a pooled connection opened before the database turned read-only"
                    );
                    return Ok(false);
                }
                if missed {
                    // `Ok(false)`: sqlx closes it with a `Terminate`. An
                    // error would make it close "hard", which over TLS
                    // waits for the server's `close_notify` that a server
                    // never sends unasked: the acquire would hang to its
                    // timeout (sqlx 0.8).
                    tracing::debug!("closing a pooled connection that was open when a deadline was missed");
                    return Ok(false);
                }
                if meta.idle_for < PING_IDLE_AFTER {
                    return Ok(true);
                }
                match bounded(ping, "ping", sqlx::Connection::ping(conn)).await {
                    Ok(answered) => answered.map(|()| true),
                    Err(missed) => {
                        tracing::info!(error = %missed, "an idle pooled connection does not answer");
                        Err(discarded())
                    }
                }
            })
        })
        .after_release(move |_conn, meta| {
            // `Ok(false)` rather than an error, as in `before_acquire`: a
            // hard close over TLS would hang the task returning it, and
            // its pool slot with it, for good.
            let missed = networked && open_at_a_miss(meta.age);
            Box::pin(async move { Ok(!missed) })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_open_at_a_miss_are_discarded_later_ones_kept() {
        // The pure rule; the global mark is left alone, so that other
        // tests' pools in this process are not disturbed.
        assert!(!opened_before(0, Duration::from_secs(3600)));
        let mark = since_epoch_ms(Instant::now()) + 1;
        assert!(opened_before(mark, Duration::from_secs(3600)));
        std::thread::sleep(Duration::from_millis(5));
        assert!(!opened_before(mark, Duration::ZERO));
    }

    #[tokio::test]
    async fn a_call_within_its_deadline_is_answered() {
        let answered = within(Duration::from_secs(5), "ok", async {
            Ok::<_, sqlx::Error>(7)
        });
        assert_eq!(answered.await.ok(), Some(7));
        let missed: StoreError = DeadlineMissed {
            what: "claim",
            after: Duration::from_secs(1),
        }
        .into();
        assert_eq!(
            missed.infra_fault(),
            Some(super::super::InfraFault::Timeout)
        );
    }

    #[test]
    fn deadlines_have_floors() {
        let d = Deadlines::default()
            .statement(Duration::ZERO)
            .transaction(Duration::ZERO);
        assert_eq!(d.statement_deadline(), Duration::from_millis(1));
        assert_eq!(d.transaction_deadline(), Duration::from_millis(1));
        assert_eq!(Deadlines::default().ping(), Duration::from_millis(2500));
    }
}
