//! The outbox statements, written once for every SQL backend of the dedup
//! store (its `Backend`). The SQL text comes from [`OutboxSql`].

use async_trait::async_trait;
use sqlx::{
    ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Transaction, Type,
};

use super::sql::OutboxSql;
use crate::store::{Backend, Dialect};

/// A row about to be inserted.
pub struct NewRow<'a> {
    pub message_id: &'a str,
    pub scope: &'a str,
    pub causation: Option<&'a str>,
    pub traceparent: Option<&'a str>,
    pub kind: &'a str,
    pub destination: &'a str,
    pub routing_key: Option<&'a str>,
    pub message_key: Option<&'a [u8]>,
    pub order_key: &'a str,
    pub headers: &'a str,
    pub payload: &'a [u8],
    /// When it may first be sent: its `next_attempt_at_ms` and its
    /// `created_at_ms` (enqueue time, or a delayed message's due time).
    pub due_ms: i64,
}

/// A pending row, as a relay publishes it.
#[derive(Clone, Debug)]
pub struct OutboxRow {
    /// The row's sequence number (enqueue order).
    pub id: i64,
    /// The message's deterministic id.
    pub message_id: String,
    /// The scope of the inbound key.
    pub scope: String,
    /// The inbound key the message was sent for.
    pub causation: Option<String>,
    /// The inbound message's W3C trace context.
    pub traceparent: Option<String>,
    /// `kafka`, `amqp` or `webhook`.
    pub kind: String,
    /// The topic, exchange or URL.
    pub destination: String,
    /// The AMQP routing key.
    pub routing_key: Option<String>,
    /// The Kafka message key.
    pub message_key: Option<Vec<u8>>,
    /// The user's headers, as a JSON array of `[name, value]` pairs.
    pub headers: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// Attempts made before this one.
    pub attempts: i32,
    /// The ordering key.
    pub(crate) order_key: String,
}

impl OutboxRow {
    /// The user's headers.
    pub fn header_pairs(&self) -> Vec<(String, String)> {
        serde_json::from_str(&self.headers).unwrap_or_default()
    }
}

/// A row with its delivery state, as the CLI shows it.
#[derive(Clone, Debug)]
pub struct OutboxRecord {
    /// The message.
    pub row: OutboxRow,
    /// Pending, sent or dead.
    pub status: Status,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// When it was enqueued, in ms since the Unix epoch; for a
    /// [delayed](super::OutboxMessage::not_before) message, when it is due
    /// (a delayed message ages from then).
    pub created_at_ms: i64,
    /// When its destination confirmed it.
    pub sent_at_ms: Option<i64>,
    /// When a pending row is due next.
    pub next_attempt_at_ms: i64,
}

/// The delivery state of an outbox row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Status {
    /// Waiting for a relay.
    Pending,
    /// Confirmed by its destination.
    Sent,
    /// Failed permanently or too often; waits for `onceonly outbox retry`.
    Dead,
}

impl Status {
    /// As stored.
    pub(crate) fn code(self) -> i16 {
        match self {
            Self::Pending => super::sql::PENDING,
            Self::Sent => super::sql::SENT,
            Self::Dead => super::sql::DEAD,
        }
    }

    /// The status stored as `code`.
    pub(crate) fn from_code(code: i16) -> Option<Self> {
        match code {
            super::sql::PENDING => Some(Self::Pending),
            super::sql::SENT => Some(Self::Sent),
            super::sql::DEAD => Some(Self::Dead),
            _ => None,
        }
    }

    /// `pending`, `sent` or `dead`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Sent => "sent",
            Self::Dead => "dead",
        }
    }
}

/// Rows of one status and kind.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatusCount {
    /// The status.
    pub status: Status,
    /// `kafka`, `amqp` or `webhook`.
    pub kind: String,
    /// How many rows.
    pub rows: i64,
    /// The oldest due row's `created_at_ms` (delayed rows do not count).
    pub oldest_ms: Option<i64>,
    /// Pending rows not due yet: [delayed](super::OutboxMessage::not_before)
    /// messages (included in `rows`).
    pub delayed: i64,
}

/// A SQL backend the outbox runs on: PostgreSQL, MySQL/MariaDB or SQLite.
#[async_trait]
pub trait OutboxBackend: Database {
    /// The database: the same value as its dedup store's.
    const DIALECT: Dialect;

    /// Creates the table and its indexes if missing.
    #[doc(hidden)]
    async fn create(pool: &Pool<Self>, sql: &OutboxSql) -> Result<(), sqlx::Error>;

    /// Inserts a row in the caller's transaction (nothing if its id exists).
    #[doc(hidden)]
    async fn insert(
        conn: &mut Self::Connection,
        sql: &OutboxSql,
        row: &NewRow<'_>,
        channel: &str,
    ) -> Result<(), sqlx::Error>;

    /// Begins the short transaction in which a relay takes and leases its
    /// rows (SQLite: `BEGIN IMMEDIATE`).
    #[doc(hidden)]
    async fn begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error>;

    /// Locks the due heads of up to `limit` ordering keys and the rows
    /// queued behind them (at most `limit` in all), in id order.
    #[doc(hidden)]
    async fn claim(
        conn: &mut Self::Connection,
        heads: &str,
        sql: &OutboxSql,
        now_ms: i64,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error>;

    /// Sets one column of pending rows `ids`: `prefix` (an `UPDATE ..
    /// SET column = ` of [`OutboxSql`]: `lease_prefix` leases a relay's
    /// heads until `value`, `sent_prefix` marks rows sent at `value`).
    #[doc(hidden)]
    async fn update_pending(
        conn: &mut Self::Connection,
        prefix: &str,
        value: i64,
        ids: &[i64],
    ) -> Result<(), sqlx::Error>;

    /// Records a failed attempt: parked if `dead`, otherwise due again at
    /// `next_ms`.
    #[doc(hidden)]
    async fn mark_failed(
        conn: &mut Self::Connection,
        sql: &OutboxSql,
        failure: &Failed<'_>,
    ) -> Result<(), sqlx::Error>;

    /// Rows per status and kind.
    #[doc(hidden)]
    async fn stats(pool: &Pool<Self>, sql: &OutboxSql) -> Result<Vec<StatusCount>, sqlx::Error>;

    /// Deletes at most `limit` rows sent before `before_ms`.
    #[doc(hidden)]
    async fn purge_sent(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        before_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error>;

    /// Rotates the generations layout's partitions, if the table has that
    /// layout and the older generation holds no row sent at or after
    /// `before_ms`: about how many rows went (`None`: no rotation).
    #[doc(hidden)]
    async fn rotate_sent(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        before_ms: i64,
        now_ms: i64,
    ) -> Result<Option<u64>, sqlx::Error>;

    /// Dead rows (all, or the one with `message_id`) back to pending.
    #[doc(hidden)]
    async fn retry_dead(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        message_id: Option<&str>,
        now_ms: i64,
    ) -> Result<u64, sqlx::Error>;

    /// Rows of `status`, oldest first, or the row with a message id.
    #[doc(hidden)]
    async fn records(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        filter: RecordsFilter<'_>,
    ) -> Result<Vec<OutboxRecord>, sqlx::Error>;
}

/// Which records to read.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum RecordsFilter<'a> {
    /// Rows of a status, oldest first, at most `limit`.
    Status(Status, i64),
    /// The row with this message id.
    MessageId(&'a str),
}

/// A failed attempt.
#[doc(hidden)]
pub struct Failed<'a> {
    pub(crate) id: i64,
    pub(crate) dead: bool,
    pub(crate) next_ms: i64,
    pub(crate) error: &'a str,
}

/// Reads text column `column`. MySQL reports columns with a binary
/// collation (`utf8mb4_bin`, `ascii_bin`) as binary, which sqlx will not
/// decode as a `String`: with `byte_text`, read bytes and check UTF-8.
fn text<DB: Database>(
    r: &DB::Row,
    column: &str,
    byte_text: bool,
) -> Result<Option<String>, sqlx::Error>
where
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
{
    use sqlx::Row as _;
    if !byte_text {
        return r.try_get(column);
    }
    let bytes: Option<Vec<u8>> = r.try_get(column)?;
    bytes
        .map(|b| {
            String::from_utf8(b).map_err(|e| sqlx::Error::ColumnDecode {
                index: column.to_owned(),
                source: Box::new(e),
            })
        })
        .transpose()
}

/// Like [`text`], for a `NOT NULL` column.
fn text_nn<DB: Database>(r: &DB::Row, column: &str, byte_text: bool) -> Result<String, sqlx::Error>
where
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
{
    text::<DB>(r, column, byte_text)?.ok_or_else(|| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: "unexpected NULL".into(),
    })
}

/// Reads an [`OutboxRow`] from a row of any backend (`byte_text`: see
/// [`text`]).
fn read_row<DB: Database>(r: &DB::Row, byte_text: bool) -> Result<OutboxRow, sqlx::Error>
where
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> i32: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
{
    use sqlx::Row as _;
    let t = |column| text::<DB>(r, column, byte_text);
    let t_nn = |column| text_nn::<DB>(r, column, byte_text);
    Ok(OutboxRow {
        id: r.try_get("id")?,
        message_id: t_nn("message_id")?,
        scope: t_nn("scope")?,
        causation: t("causation")?,
        traceparent: t("traceparent")?,
        kind: t_nn("kind")?,
        destination: t_nn("destination")?,
        routing_key: t("routing_key")?,
        message_key: r.try_get("message_key")?,
        headers: t_nn("headers")?,
        payload: r.try_get("payload")?,
        attempts: r.try_get("attempts")?,
        order_key: t_nn("order_key")?,
    })
}

/// Reads an [`OutboxRecord`] (a row and its state).
fn read_record<DB: Database>(r: &DB::Row, byte_text: bool) -> Result<OutboxRecord, sqlx::Error>
where
    usize: sqlx::ColumnIndex<DB::Row>,
    for<'c> &'c str: sqlx::ColumnIndex<DB::Row>,
    for<'r> i64: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> i32: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> i16: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
{
    use sqlx::Row as _;
    let code: i16 = r.try_get("status")?;
    Ok(OutboxRecord {
        row: read_row::<DB>(r, byte_text)?,
        status: Status::from_code(code)
            .ok_or_else(|| sqlx::Error::Decode(format!("unknown outbox status {code}").into()))?,
        last_error: text::<DB>(r, "last_error", byte_text)?,
        created_at_ms: r.try_get("created_at_ms")?,
        sent_at_ms: r.try_get("sent_at_ms")?,
        next_attempt_at_ms: r.try_get("next_attempt_at_ms")?,
    })
}

/// Every database a dedup store runs on, through the store's own
/// `Backend`: one generic implementation, whose statements differ only by
/// their SQL text (`OutboxSql`) and the [`Dialect`].
#[async_trait]
impl<DB> OutboxBackend for DB
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Decode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> i32: Decode<'q, DB> + Type<DB>,
    for<'q> i16: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> bool: Decode<'q, DB> + Type<DB>,
    (i16,): for<'r> sqlx::FromRow<'r, DB::Row>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    usize: ColumnIndex<DB::Row>,
    for<'c> &'c str: ColumnIndex<DB::Row>,
{
    // The store's value for this database, not derived again.
    const DIALECT: Dialect = <DB as Backend>::DIALECT;

    async fn create(pool: &Pool<Self>, sql: &OutboxSql) -> Result<(), sqlx::Error> {
        // One transaction: PostgreSQL's advisory lock (the first
        // statement) holds until the DDL commits.
        let mut tx = pool.begin().await?;
        // PostgreSQL: lock waits bounded, so that a migration
        // behind a stuck transaction fails instead of blocking
        // forever (the caller bounds the whole migration).
        if matches!(Self::DIALECT, Dialect::Postgres) {
            let timeout = crate::store::Deadlines::default().migration_lock_timeout();
            // Quiet too: no NOTICE for each `IF NOT EXISTS` that finds
            // its object (sqlx logs them at INFO, on every start).
            let set = format!(
                "SELECT set_config('lock_timeout', '{}ms', true), \
                 set_config('client_min_messages', 'warning', true)",
                timeout.as_millis().max(1)
            );
            sqlx::query(&set).execute(&mut *tx).await?;
        }
        for ddl in &sql.ddl {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    async fn insert(
        conn: &mut Self::Connection,
        sql: &OutboxSql,
        row: &NewRow<'_>,
        channel: &str,
    ) -> Result<(), sqlx::Error> {
        if !sql.enqueue_lock.is_empty() {
            sqlx::query(&sql.enqueue_lock)
                .bind(row.order_key)
                .execute(&mut *conn)
                .await?;
        }
        let mut q = sqlx::query(&sql.enqueue)
            .bind(row.message_id)
            .bind(row.scope)
            .bind(row.causation)
            .bind(row.traceparent)
            .bind(row.kind)
            .bind(row.destination)
            .bind(row.routing_key)
            .bind(row.message_key)
            .bind(row.order_key)
            .bind(row.headers)
            .bind(row.payload)
            .bind(row.due_ms)
            .bind(row.due_ms);
        if matches!(Self::DIALECT, Dialect::Postgres) {
            q = q.bind(channel);
        }
        q.execute(&mut *conn).await?;
        Ok(())
    }

    async fn begin(pool: &Pool<Self>) -> Result<Transaction<'static, Self>, sqlx::Error> {
        match Self::DIALECT {
            // SQLite: take the write lock now, so that two relays
            // queue instead of failing on a lock upgrade.
            Dialect::Sqlite => pool.begin_with(<DB as Backend>::BEGIN).await,
            _ => pool.begin().await,
        }
    }

    async fn claim(
        conn: &mut Self::Connection,
        heads: &str,
        sql: &OutboxSql,
        now_ms: i64,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        let read = |r: &_| read_row::<Self>(r, Self::DIALECT.byte_text());
        let head_rows = sqlx::query(heads)
            .bind(now_ms)
            .bind(limit)
            .fetch_all(&mut *conn)
            .await?;
        if head_rows.is_empty() {
            return Ok(Vec::new());
        }
        let heads: Vec<OutboxRow> = head_rows.iter().map(read).collect::<Result<_, _>>()?;
        // Rows behind a locked head cannot be any other relay's
        // head until this transaction ends: take some along.
        let mut qb = sqlx::QueryBuilder::<Self>::new(&sql.follow_prefix);
        let mut keys = qb.separated(", ");
        for head in &heads {
            keys.push_bind(head.order_key.clone());
        }
        // In id order under one limit: a key's head always comes
        // before the rows behind it, so a cut never takes a row
        // without its head.
        qb.push(") ORDER BY id LIMIT ");
        qb.push_bind(limit);
        qb.push(sql.follow_lock);
        let rows = DB::build(&mut qb).fetch_all(&mut *conn).await?;
        // A delayed row stops its key: neither it nor the rows behind it
        // leave before it is due (order is kept).
        let head_ids: std::collections::HashSet<i64> = heads.iter().map(|h| h.id).collect();
        let mut stopped = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            use sqlx::Row as _;
            let row = read(r)?;
            let due: i64 = r.try_get("next_attempt_at_ms")?;
            let is_head = head_ids.contains(&row.id);
            if stopped.contains(&row.order_key) || (!is_head && due > now_ms) {
                stopped.insert(row.order_key.clone());
                continue;
            }
            out.push(row);
        }
        Ok(out)
    }

    async fn update_pending(
        conn: &mut Self::Connection,
        prefix: &str,
        value: i64,
        ids: &[i64],
    ) -> Result<(), sqlx::Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut qb = sqlx::QueryBuilder::<Self>::new(prefix);
        qb.push_bind(value);
        qb.push(" WHERE status = 0 AND id IN (");
        let mut list = qb.separated(", ");
        for id in ids {
            list.push_bind(*id);
        }
        qb.push(")");
        DB::build(&mut qb).execute(&mut *conn).await?;
        Ok(())
    }

    async fn mark_failed(
        conn: &mut Self::Connection,
        sql: &OutboxSql,
        failure: &Failed<'_>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(&sql.failed)
            .bind(
                if failure.dead {
                    Status::Dead
                } else {
                    Status::Pending
                }
                .code(),
            )
            .bind(failure.next_ms)
            .bind(failure.error)
            .bind(failure.id)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn stats(pool: &Pool<Self>, sql: &OutboxSql) -> Result<Vec<StatusCount>, sqlx::Error> {
        use sqlx::Row as _;
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let rows = sqlx::query(&sql.stats)
            .bind(now)
            .bind(now)
            .fetch_all(pool)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let code: i16 = r.try_get("status")?;
            let Some(status) = Status::from_code(code) else {
                continue;
            };
            out.push(StatusCount {
                status,
                kind: text_nn::<Self>(r, "kind", Self::DIALECT.byte_text())?,
                rows: r.try_get("n")?,
                oldest_ms: r.try_get("oldest_ms")?,
                delayed: r.try_get("delayed_n")?,
            });
        }
        Ok(out)
    }

    async fn purge_sent(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        before_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(&sql.purge_sent)
            .bind(before_ms)
            .bind(limit)
            .execute(pool)
            .await?;
        Ok(<DB as Backend>::rows_affected(&done))
    }

    async fn rotate_sent(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        before_ms: i64,
        now_ms: i64,
    ) -> Result<Option<u64>, sqlx::Error> {
        match &sql.rotation {
            Some(rotation) => {
                super::generations::rotate::<Self>(pool, rotation, before_ms, now_ms).await
            }
            None => Ok(None),
        }
    }

    async fn retry_dead(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        message_id: Option<&str>,
        now_ms: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = match message_id {
            None => {
                sqlx::query(&sql.retry_all)
                    .bind(now_ms)
                    .execute(pool)
                    .await?
            }
            Some(id) => {
                sqlx::query(&sql.retry_one)
                    .bind(now_ms)
                    .bind(id)
                    .execute(pool)
                    .await?
            }
        };
        Ok(<DB as Backend>::rows_affected(&done))
    }

    async fn records(
        pool: &Pool<Self>,
        sql: &OutboxSql,
        filter: RecordsFilter<'_>,
    ) -> Result<Vec<OutboxRecord>, sqlx::Error> {
        let rows = match filter {
            RecordsFilter::Status(status, limit) => {
                sqlx::query(&sql.list)
                    .bind(status.code())
                    .bind(limit)
                    .fetch_all(pool)
                    .await?
            }
            RecordsFilter::MessageId(id) => sqlx::query(&sql.find).bind(id).fetch_all(pool).await?,
        };
        rows.iter()
            .map(|r| read_record::<Self>(r, Self::DIALECT.byte_text()))
            .collect()
    }
}
