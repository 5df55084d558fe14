//! The transactional outbox: messages a handler sends (Kafka records, AMQP
//! messages, webhooks) commit with its claim and leave exactly once in
//! effect. Inside the handler, [`Outbox::enqueue`] inserts the message into
//! the outbox table in the claim's transaction: it commits with the claim
//! and the handler's writes, or not at all. A [`Relay`] publishes committed
//! rows and marks them sent only after the destination confirmed them.
//!
#![doc = include_str!("../../docs/outbox.md")]

mod admin;
mod backend;
mod generations;
mod message;
mod publish;
mod relay;
mod sql;

use std::marker::PhantomData;
use std::sync::Arc;

pub use admin::OutboxStats;
pub use backend::StatusCount;
pub use backend::{OutboxBackend, OutboxRecord, OutboxRow, Status};
#[cfg(feature = "otel")]
pub(crate) use message::TRACEPARENT_HEADER;
pub use message::{Destination, Kind, OutboxMessage, message_id};
#[cfg(feature = "amqp")]
pub use publish::AmqpPublisher;
#[cfg(feature = "kafka")]
pub use publish::KafkaPublisher;
pub use publish::{Outgoing, PublishError, Publisher};
#[cfg(feature = "webhook")]
pub use publish::{WebhookPublisher, WebhookSecretError, WebhookSigning};
pub use relay::{Relay, RelayBuildError, RelayBuilder, RelayHandle, RelayStats};
pub use sql::DEFAULT_OUTBOX_TABLE;

use crate::clock::{Clock, SystemClock};
use crate::engine::{HandlerError, TxGuard};
use crate::store::{StoreError, TableName};
use backend::NewRow;
use sql::OutboxSql;

#[cfg(feature = "postgres")]
impl Outbox<sqlx::Postgres> {
    /// Whether the outbox table has the *generations* layout (default
    /// `false`): two partitions, sent rows purged by `TRUNCATE` of the
    /// older one instead of by `DELETE`, so that purging never competes
    /// with enqueues and relays, however big the table. `migrate` then
    /// creates that layout, or upgrades a plain table in place (it scans
    /// and indexes the table under an exclusive lock: purge sent rows
    /// first); [`purge_sent`](Self::purge_sent) rotates (once every sent
    /// row of the older generation is older than the cut-off, its unsent
    /// rows move to the newer one and it is truncated). Every process on
    /// the table, enqueuers and relays, must use the same layout: the plain
    /// enqueue fails on a generations table.
    #[must_use]
    pub fn generations(self, generations: bool) -> Self {
        let sql = if generations {
            generations::sql(&self.table)
        } else {
            OutboxSql::new(crate::store::Dialect::Postgres, &self.table)
        };
        Self {
            sql: Arc::new(sql),
            ..self
        }
    }

    /// The outbox with the layout its table has (generations if the table
    /// is partitioned; plain otherwise, also when it does not exist yet).
    pub async fn detect_layout(self, pool: &sqlx::PgPool) -> Result<Self, StoreError> {
        let kind: Option<String> = crate::store::deadline::within(
            {
                let d = crate::store::Deadlines::default();
                d.acquire_timeout() + d.statement_deadline()
            },
            "outbox layout",
            sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
                .bind(self.table.quoted('"'))
                .fetch_optional(pool),
        )
        .await?;
        Ok(self.generations(kind.as_deref() == Some("p")))
    }
}

/// An outbox table on backend `DB`: enqueue messages inside handlers, run
/// a [`Relay`] to send them. Cheap to clone.
pub struct Outbox<DB: OutboxBackend> {
    sql: Arc<OutboxSql>,
    channel: Arc<str>,
    table: TableName,
    _db: PhantomData<fn() -> DB>,
}

impl<DB: OutboxBackend> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Self {
            sql: Arc::clone(&self.sql),
            channel: Arc::clone(&self.channel),
            table: self.table.clone(),
            _db: PhantomData,
        }
    }
}

impl<DB: OutboxBackend> std::fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.sql.table)
            .finish()
    }
}

impl<DB: OutboxBackend> Default for Outbox<DB> {
    fn default() -> Self {
        Self::new()
    }
}

impl<DB: OutboxBackend> Outbox<DB> {
    /// The outbox in table [`DEFAULT_OUTBOX_TABLE`].
    pub fn new() -> Self {
        Self::build(&TableName::new(DEFAULT_OUTBOX_TABLE).unwrap_or_default())
    }

    /// The outbox in table `name` (`table` or `schema.table`).
    pub fn on_table(name: &str) -> Result<Self, StoreError> {
        Ok(Self::build(&TableName::new(name)?))
    }

    fn build(table: &TableName) -> Self {
        Self {
            sql: Arc::new(OutboxSql::new(DB::DIALECT, table)),
            channel: Arc::from(notify_channel(table.table())),
            table: table.clone(),
            _db: PhantomData,
        }
    }

    /// Whether the table has the generations layout
    /// (`Outbox::generations`, PostgreSQL).
    pub fn has_generations(&self) -> bool {
        self.sql.rotation.is_some()
    }

    /// Creates the outbox table and its indexes if they do not exist,
    /// bounded by the default [`Deadlines`](crate::store::Deadlines)
    /// (taking a connection, lock waits, a statement).
    pub async fn migrate(&self, pool: &sqlx::Pool<DB>) -> Result<(), StoreError> {
        let d = crate::store::Deadlines::default();
        let bound = d.acquire_timeout() + d.migration_lock_timeout() + d.statement_deadline();
        crate::store::deadline::within(bound, "outbox migration", DB::create(pool, &self.sql)).await
    }

    /// The DDL of the table, for your own migration tool: run it in one
    /// transaction (on PostgreSQL its first statement takes an advisory
    /// lock that serializes concurrent migrations until the commit).
    pub fn ddl(&self) -> &[String] {
        &self.sql.ddl
    }

    /// The DDL of the table without PostgreSQL's migration lock, for
    /// your own migration tool.
    pub fn migration_sql(&self) -> Vec<String> {
        self.sql
            .ddl
            .iter()
            .filter(|s| !s.starts_with("SELECT pg_advisory"))
            .cloned()
            .collect()
    }

    /// Inserts `message` in the claim's transaction: it commits with the
    /// handler's writes and leaves only then, through a [`Relay`]. Returns
    /// its id (see [`message_id`]: the same for every copy of the message,
    /// new for a later run of the key after its record expired; or the
    /// hash of the claim's scope and the caller's [`id`](OutboxMessage::id)).
    pub async fn enqueue(
        &self,
        conn: &mut TxGuard<DB>,
        message: OutboxMessage,
    ) -> Result<String, HandlerError> {
        let origin = conn.origin();
        let position = origin.next_position();
        let scope = origin.scope().to_owned();
        let id = match &message.id {
            Some(id) => message::caller_message_id(&scope, id),
            None => message_id(origin, position),
        };
        let causation = origin.key().to_owned();
        let traceparent = origin.traceparent().map(str::to_owned);
        let source = Source {
            id: &id,
            scope: &scope,
            causation: Some(&causation),
            traceparent: traceparent.as_deref(),
        };
        self.insert(&mut *conn, &source, &message)
            .await
            .map_err(|e| match e {
                EnqueueError::Invalid(why) => HandlerError::permanent(why),
                EnqueueError::Database(e) => e.into(),
            })?;
        Ok(id)
    }

    /// Inserts `message` in a transaction of the outbox's database that is
    /// not a claim's: a route without an idempotency key, a scheduled job,
    /// a backfill. The message leaves, through a [`Relay`], only if and
    /// once `conn`'s transaction commits (begin one with `pool.begin()`,
    /// enqueue beside your own writes, commit; on SQLite begin with
    /// `pool.begin_with("BEGIN IMMEDIATE")` if the transaction reads before
    /// it writes, so that it queues behind a relay instead of failing as
    /// busy). `scope` names the sender (1 to 128 bytes; shown by
    /// `onceonly outbox inspect`, sent as no header). Returns the message
    /// id: from the caller's [`id`](OutboxMessage::id) if it has one (so
    /// that a job run again enqueues each message once while the first is
    /// in the table), random otherwise. The message carries no causation
    /// id.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use onceonly::outbox::{Outbox, OutboxMessage};
    ///
    /// let outbox = Outbox::<sqlx::Postgres>::new();
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE invoices SET reminded = true WHERE id = 42")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// let reminder = OutboxMessage::webhook("https://example.com/hooks", r#"{"invoice":42}"#)
    ///     .id("reminder:invoice-42")      // a second run of the job adds nothing
    ///     .delay(Duration::from_secs(3600)); // sent in an hour
    /// outbox.enqueue_in(&mut tx, "billing-cron", reminder).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_in(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        message: OutboxMessage,
    ) -> Result<String, EnqueueError> {
        crate::store::validate_scope(scope).map_err(|_| {
            EnqueueError::Invalid("the scope must be 1 to 128 bytes, no control characters")
        })?;
        let id = match &message.id {
            Some(id) => message::caller_message_id(scope, id),
            None => uuid::Uuid::new_v4().to_string(),
        };
        let source = Source {
            id: &id,
            scope,
            causation: None,
            traceparent: None,
        };
        self.insert(conn, &source, &message).await?;
        Ok(id)
    }

    /// Inserts the row of `message` from `source`.
    async fn insert(
        &self,
        conn: &mut DB::Connection,
        source: &Source<'_>,
        message: &OutboxMessage,
    ) -> Result<(), EnqueueError> {
        if message.destination.target().is_empty()
            && !matches!(message.destination, Destination::Amqp { .. })
        {
            return Err(EnqueueError::Invalid(
                "an outbox message needs a topic or URL",
            ));
        }
        let (traceparent, headers) = trace_headers(message, source.traceparent)
            .map_err(|_| EnqueueError::Invalid("the headers do not serialize"))?;
        let now_ms = SystemClock.now_ms();
        let order_key = message.order_key(source.id, now_ms);
        let row = NewRow {
            message_id: source.id,
            scope: source.scope,
            causation: source.causation,
            traceparent: traceparent.as_deref(),
            kind: message.destination.kind().as_str(),
            destination: message.destination.target(),
            routing_key: message.destination.routing_key(),
            message_key: message.key.as_deref(),
            order_key: &order_key,
            headers: &headers,
            payload: &message.payload,
            // A delayed message becomes sendable, and starts to age, when
            // it is due.
            due_ms: message.due_ms(now_ms),
        };
        DB::insert(conn, &self.sql, &row, &self.channel).await?;
        Ok(())
    }

    pub(crate) fn sql(&self) -> &OutboxSql {
        &self.sql
    }

    // Only the PostgreSQL relay listens on it.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}

/// The row's `traceparent` and headers (JSON) for `message`: with feature
/// `otel` and a recorded current span, that span's context, so that the
/// relay's publish continues the trace of the handler or job that enqueued
/// it (the message's own trace headers give way: one context per
/// message); otherwise the inbound `traceparent` and the message's headers.
fn trace_headers(
    message: &OutboxMessage,
    inbound: Option<&str>,
) -> Result<(Option<String>, String), serde_json::Error> {
    #[cfg(feature = "otel")]
    if let Some((traceparent, context)) = crate::otel::current_for_outbox() {
        let own = message.headers.iter().filter(|(name, _)| {
            !name.eq_ignore_ascii_case(TRACEPARENT_HEADER) && !crate::otel::names(&context, name)
        });
        let all: Vec<&(String, String)> = own.chain(context.iter()).collect();
        return Ok((traceparent, serde_json::to_string(&all)?));
    }
    Ok((
        inbound.map(str::to_owned),
        serde_json::to_string(&message.headers)?,
    ))
}

/// Who enqueues a message.
struct Source<'a> {
    id: &'a str,
    scope: &'a str,
    causation: Option<&'a str>,
    traceparent: Option<&'a str>,
}

/// Why [`Outbox::enqueue_in`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The message cannot be sent (no topic or URL).
    #[error("invalid outbox message: {0}")]
    Invalid(&'static str),
    /// The insert failed; the caller's transaction should be rolled back.
    #[error("outbox insert failed: {0}")]
    Database(#[from] sqlx::Error),
}

/// The PostgreSQL NOTIFY channel of outbox table `table`:
/// `onceonly_outbox_<table>`, or, where that would pass PostgreSQL's
/// 63-byte identifier limit (a legal table name of up to 48 bytes can),
/// as much of it as fits with a hash of the whole name, so that every
/// enqueue's `pg_notify` works and distinct tables keep distinct channels.
fn notify_channel(table: &str) -> String {
    const MAX: usize = 63;
    let full = format!("onceonly_outbox_{table}");
    if full.len() <= MAX {
        return full;
    }
    use sha2::{Digest, Sha256};
    let hash = hex::encode(&Sha256::digest(table.as_bytes())[..6]);
    let mut cut = MAX - hash.len() - 1;
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}_{hash}", &full[..cut])
}

#[cfg(test)]
mod tests {
    use super::notify_channel;

    #[test]
    fn notify_channels_fit_postgres_identifiers() {
        assert_eq!(notify_channel("box"), "onceonly_outbox_box");
        let long = "t".repeat(48);
        let a = notify_channel(&long);
        assert_eq!(a.len(), 63);
        let other = format!("{}u", "t".repeat(47));
        assert_ne!(a, notify_channel(&other));
    }
}
