//! The outbox's generations layout on PostgreSQL
//! ([`Outbox::generations`](super::Outbox::generations)): sent rows go by
//! `TRUNCATE`, never by `DELETE`, as the dedup table's
//! ([`PgStore::generations`](crate::PgStore::generations)).
//!
//! The table is partitioned by list on `generation` into `<table>_g0` and
//! `<table>_g1`; `<table>_generation` names the current one, where
//! messages are enqueued (unless their message id is in the other one
//! already). Ids come from one sequence, so an id names one row whatever
//! its generation, and the relay's statements (by status, by id) run on the
//! partitioned table as on a plain one.
//!
//! A purge of sent rows rotates: once every *sent* row of the other
//! generation was sent before the cut-off, the rows of it that are not
//! sent (pending, dead) move to the current generation with their ids, the
//! other generation is truncated and becomes the current one. The rotation
//! locks that partition (waiting at most 200 ms, so enqueues and relays
//! queue behind it no longer) and runs in one transaction.

use sqlx::{Database, Executor, IntoArguments, Pool};

#[cfg(feature = "postgres")]
use super::sql::{DEAD, ORDER_LOCK_CLASS, OutboxSql, PENDING, PG_ENQUEUE_VALUES, SENT};
#[cfg(feature = "postgres")]
use crate::store::TableName;
#[cfg(feature = "postgres")]
use crate::store::postgres::{adopt_plain_table, partitions_ddl, rows_sql, switch_sql};

/// Every column of an outbox row, in table order.
#[cfg(feature = "postgres")]
const ALL_COLS: &str = "id, message_id, scope, causation, traceparent, kind, destination, \
    routing_key, message_key, order_key, headers, payload, status, attempts, \
    next_attempt_at_ms, last_error, created_at_ms, sent_at_ms";

/// The statements of an outbox rotation; index `i` of each pair is
/// generation `i`'s.
#[derive(Debug)]
pub struct OutboxRotation {
    /// `BEGIN` with the rotation's lock bound.
    begin: String,
    /// The current generation, locked (rotations one at a time).
    current: String,
    /// Locks generation `i` against enqueues and relays.
    lock: [String; 2],
    /// `$1` cut-off: whether generation `i` holds a row sent at or after it.
    recent: [String; 2],
    /// Moves generation `i`'s unsent rows into the current generation
    /// (`$1`).
    move_unsent: [String; 2],
    /// About how many rows generation `i` holds.
    rows: [String; 2],
    truncate: [String; 2],
    /// `$1` generation, `$2` now: makes it current.
    switch: String,
}

/// The statements of an outbox on `table` in the generations layout.
#[cfg(feature = "postgres")]
pub(crate) fn sql(table: &TableName) -> OutboxSql {
    let mut sql = OutboxSql::new(crate::store::Dialect::Postgres, table);
    let t = table.quoted('"');
    let g = [
        table.suffixed("g0").quoted('"'),
        table.suffixed("g1").quoted('"'),
    ];
    let c = table.suffixed("generation").quoted('"');
    let seq = table.suffixed("id_seq").quoted('"');
    let mut ddl = vec![
        format!("SELECT pg_advisory_xact_lock(hashtext('onceonly_outbox:{table}'))"),
        // A plain outbox becomes generation 0: its ids and their sequence
        // stay; its keys are replaced by the partitioned table's, its
        // indexes renamed to match the partitioned table's.
        adopt_plain_table(table, "'p', 'u'", &["pending", "sent"]),
        format!("CREATE SEQUENCE IF NOT EXISTS {seq}"),
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
             id bigint NOT NULL DEFAULT nextval('{seq}'), message_id text NOT NULL, \
             scope text NOT NULL, causation text, traceparent text, kind text NOT NULL, \
             destination text NOT NULL, routing_key text, message_key bytea, \
             order_key text NOT NULL, headers text NOT NULL, payload bytea NOT NULL, \
             status smallint NOT NULL DEFAULT {PENDING}, attempts integer NOT NULL DEFAULT 0, \
             next_attempt_at_ms bigint NOT NULL, last_error text, \
             created_at_ms bigint NOT NULL, sent_at_ms bigint, generation smallint NOT NULL, \
             PRIMARY KEY (id, generation), UNIQUE (message_id, generation)) \
             PARTITION BY LIST (generation)"
        ),
    ];
    // Sent rows are truncated whole: the outbox's generations are not split.
    ddl.extend(partitions_ddl(table, 1));
    ddl.extend([
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {t} (order_key, id) WHERE status = {PENDING}",
            table.index("pending", '"')
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {t} (sent_at_ms) WHERE status = {SENT}",
            table.index("sent", '"')
        ),
    ]);
    sql.ddl.clear();
    sql.ddl.append(&mut ddl);
    // Into the current generation, unless the message id is in the other.
    // The key's advisory lock first, as in the plain layout (see
    // `OutboxSql::new`): a key's ids follow its enqueuers' commit order.
    sql.enqueue = format!(
        "WITH ins AS (INSERT INTO {t} (message_id, scope, causation, traceparent, kind, \
         destination, routing_key, message_key, order_key, headers, payload, \
         next_attempt_at_ms, created_at_ms, generation) \
         SELECT {PG_ENQUEUE_VALUES}, \
         (SELECT current FROM {c}) \
         FROM (SELECT pg_advisory_xact_lock({ORDER_LOCK_CLASS}, hashtext($9::text))) AS ordered \
         WHERE NOT EXISTS (SELECT 1 FROM {t} AS o \
         WHERE o.message_id = $1::text AND o.generation = (SELECT 1 - current FROM {c})) \
         ON CONFLICT (message_id, generation) DO NOTHING RETURNING id) \
         SELECT pg_notify($14, '') FROM ins"
    );
    let each = |f: &dyn Fn(&str) -> String| [f(&g[0]), f(&g[1])];
    let cols_no_gen = ALL_COLS;
    sql.rotation = Some(OutboxRotation {
        begin: "BEGIN; SET LOCAL lock_timeout = '200ms'".to_owned(),
        current: format!("SELECT current FROM {c} FOR UPDATE"),
        lock: each(&|g| format!("LOCK TABLE {g} IN ACCESS EXCLUSIVE MODE")),
        recent: each(&|g| {
            format!("SELECT EXISTS (SELECT 1 FROM {g} WHERE status = {SENT} AND sent_at_ms >= $1)")
        }),
        move_unsent: each(&|g| {
            format!(
                "WITH moved AS (DELETE FROM {g} WHERE status IN ({PENDING}, {DEAD}) \
                 RETURNING {cols_no_gen}) \
                 INSERT INTO {t} ({cols_no_gen}, generation) SELECT {cols_no_gen}, $1 FROM moved"
            )
        }),
        rows: each(&rows_sql),
        truncate: each(&|g| format!("TRUNCATE {g}")),
        switch: switch_sql(&c),
    });
    sql
}

/// Rotates, if every sent row of the other generation was sent before
/// `before_ms`: about how many rows the truncate removed (`None`: no
/// rotation).
pub(crate) async fn rotate<DB>(
    pool: &Pool<DB>,
    rot: &OutboxRotation,
    before_ms: i64,
    now_ms: i64,
) -> Result<Option<u64>, sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> i16: sqlx::Encode<'q, DB> + sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    for<'q> bool: sqlx::Decode<'q, DB> + sqlx::Type<DB>,
    (i16,): for<'r> sqlx::FromRow<'r, DB::Row>,
    (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    (bool,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let mut tx = pool.begin_with(rot.begin.clone()).await?;
    let (current,): (i16,) = sqlx::query_as(&rot.current).fetch_one(&mut *tx).await?;
    let other = usize::from(current == 0);
    sqlx::query(&rot.lock[other]).execute(&mut *tx).await?;
    let (recent,): (bool,) = sqlx::query_as(&rot.recent[other])
        .bind(before_ms)
        .fetch_one(&mut *tx)
        .await?;
    if recent {
        tx.rollback().await?;
        return Ok(None);
    }
    let (rows,): (i64,) = sqlx::query_as(&rot.rows[other]).fetch_one(&mut *tx).await?;
    sqlx::query(&rot.move_unsent[other])
        .bind(current)
        .execute(&mut *tx)
        .await?;
    sqlx::query(&rot.truncate[other]).execute(&mut *tx).await?;
    sqlx::query(&rot.switch)
        .bind(i16::from(current == 0))
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(u64::try_from(rows).unwrap_or(0)))
}
