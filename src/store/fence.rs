//! The fence table (`<table>_fence`): per (scope, entity), the highest
//! order of a delivery applied so far, moved only forward by a statement
//! in the claim's transaction
//! ([`SqlStore::advance_fence`](super::SqlStore::advance_fence)); its DDL
//! and statements in each dialect, and what reading it returns. The
//! engine's half is `engine/fence.rs`, the orders' encoding
//! `key/fence/order.rs`.

use sqlx::{Encode, Executor, IntoArguments, Type};

use super::backend::Backend;
use super::base::SqlBase;
use super::deadline::within;
use super::rows::StoreRow;
use super::side::{Numbered, mysql_purge};
use super::{Dialect, StoreError, TableName};

/// The statements on the fence table. Orders are byte strings compared
/// byte-wise (bytea, VARBINARY, BLOB: memcmp in every backend).
#[derive(Debug, Default)]
pub(crate) struct FenceSql {
    /// scope, entity, order, expires, now: inserts the row, or raises its
    /// order to the greater of both (an expired row takes the new order),
    /// and refreshes its expiry. PostgreSQL and SQLite return the order it
    /// then holds as `ord`; MySQL reads it with `advance_read`.
    pub advance: String,
    /// scope, entity: the row's order under the lock the upsert took
    /// (MySQL; empty elsewhere).
    pub advance_read: String,
    /// scope, entity: `ord`, `expires_at_ms`.
    pub get: String,
    /// now, limit.
    pub purge: String,
    /// scope, now, limit.
    pub purge_scope: String,
}

/// The fence table's DDL and statements for `table` (the dedup table) in
/// `dialect`.
pub(super) fn fence_sql(dialect: Dialect, table: &TableName) -> (Vec<String>, FenceSql) {
    match dialect {
        Dialect::MySql => mysql(table),
        Dialect::Postgres => numbered(table, &Numbered::POSTGRES),
        Dialect::Sqlite => numbered(table, &Numbered::SQLITE),
    }
}

fn numbered(table: &TableName, n: &Numbered) -> (Vec<String>, FenceSql) {
    let Numbered {
        text,
        bytes,
        bigint,
        table_tail,
        greatest,
        ..
    } = n;
    let f = table.fence().quoted('"');
    let ddl = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {f} (\
             scope {text} NOT NULL, entity {text} NOT NULL, ord {bytes} NOT NULL, \
             expires_at_ms {bigint} NOT NULL, PRIMARY KEY (scope, entity)){table_tail}"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {f} (expires_at_ms)",
            table.index("fence_exp", '"')
        ),
    ];
    let fence = FenceSql {
        // The alias: `DO UPDATE` sees both the row and `excluded`.
        advance: format!(
            "INSERT INTO {f} AS f (scope, entity, ord, expires_at_ms) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (scope, entity) DO UPDATE SET \
             ord = CASE WHEN f.expires_at_ms <= $5 THEN excluded.ord \
             ELSE {greatest}(f.ord, excluded.ord) END, \
             expires_at_ms = {greatest}(f.expires_at_ms, excluded.expires_at_ms) RETURNING ord"
        ),
        advance_read: String::new(),
        get: format!("SELECT ord, expires_at_ms FROM {f} WHERE scope = $1 AND entity = $2"),
        purge: n.purge(&f, "scope, entity", "", 1),
        purge_scope: n.purge(&f, "scope, entity", "scope = $1 AND ", 2),
    };
    (ddl, fence)
}

fn mysql(table: &TableName) -> (Vec<String>, FenceSql) {
    let f = table.fence().quoted('`');
    // VARBINARY text: byte-exact comparison, as in the dedup table.
    let ddl = vec![format!(
        "CREATE TABLE IF NOT EXISTS {f} (\
         scope VARBINARY(128) NOT NULL, entity VARBINARY(255) NOT NULL, \
         ord VARBINARY(255) NOT NULL, expires_at_ms BIGINT NOT NULL, \
         PRIMARY KEY (scope, entity), KEY {} (expires_at_ms)) ENGINE=InnoDB",
        table.index("fence_exp", '`')
    )];
    let fence = FenceSql {
        // Assignments run left to right: `ord` reads the old expiry.
        advance: format!(
            "INSERT INTO {f} (scope, entity, ord, expires_at_ms) VALUES (?, ?, ?, ?) \
             ON DUPLICATE KEY UPDATE \
             ord = IF(expires_at_ms <= ?, VALUES(ord), GREATEST(ord, VALUES(ord))), \
             expires_at_ms = GREATEST(expires_at_ms, VALUES(expires_at_ms))"
        ),
        // A locking read: the row as it is now, not as the transaction's
        // snapshot saw it.
        advance_read: format!("SELECT ord FROM {f} WHERE scope = ? AND entity = ? FOR UPDATE"),
        get: format!("SELECT ord, expires_at_ms FROM {f} WHERE scope = ? AND entity = ?"),
        purge: mysql_purge(&f, ""),
        purge_scope: mysql_purge(&f, "scope = ? AND "),
    };
    (ddl, fence)
}

/// An entity's fence as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FenceRecord {
    /// The highest order applied, encoded (see
    /// [`Order`](crate::Order)).
    pub order: Vec<u8>,
    /// When the fence expires (the purger deletes it then), in ms since
    /// the Unix epoch.
    pub expires_at_ms: i64,
}

impl<DB> SqlBase<DB>
where
    DB: Backend,
    DB::Row: StoreRow,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    /// Moves `entity`'s fence in `scope` to `order` if that is higher (or
    /// the fence expired at `now_ms`), on the claim's transaction `conn`,
    /// and returns the order the fence then holds: `order` itself unless a
    /// higher one was applied before. The row stays locked until the
    /// transaction ends, so deliveries of one entity pass the fence one
    /// at a time. Bounded by the statement deadline (two on MySQL).
    pub async fn advance_fence(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        entity: &str,
        order: &[u8],
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<u8>, StoreError> {
        let fence = &self.sql.fence;
        let advance = async {
            let query = sqlx::query(&fence.advance)
                .bind(scope)
                .bind(entity)
                .bind(order)
                .bind(expires_at_ms)
                .bind(now_ms);
            if DB::RETURNING {
                let row = query.fetch_one(&mut *conn).await?;
                return row.bytes("ord");
            }
            query.execute(&mut *conn).await?;
            let row = sqlx::query(&fence.advance_read)
                .bind(scope)
                .bind(entity)
                .fetch_one(&mut *conn)
                .await?;
            row.bytes("ord")
        };
        within(self.deadlines.statement_deadline() * 2, "fence", advance).await
    }

    /// `entity`'s fence in `scope`, as committed (expired or not).
    pub async fn fence(
        &self,
        scope: &str,
        entity: &str,
    ) -> Result<Option<FenceRecord>, StoreError> {
        let row = sqlx::query(&self.sql.fence.get)
            .bind(scope)
            .bind(entity)
            .fetch_optional(&self.pool);
        let row = within(self.pool_bound(), "fence read", row).await?;
        row.map(|row| {
            Ok(FenceRecord {
                order: row.bytes("ord")?,
                expires_at_ms: row.int("expires_at_ms")?,
            })
        })
        .transpose()
    }
}
