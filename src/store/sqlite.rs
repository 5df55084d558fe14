//! SQLite store (feature `sqlite`, the embedded default).
//!
//! [`SqliteStore::open`] configures the database for this job: WAL journal
//! (readers never block the writer), `synchronous = FULL` (a committed claim
//! survives power loss, so an ack is never sent for a claim that could still
//! vanish), a busy timeout, and `BEGIN IMMEDIATE` transactions so that
//! concurrent writers queue on the write lock instead of failing on a lock
//! upgrade. SQLite has a single writer: claims of the same key are serialized
//! by that lock, and the primary key decides which one wins.
//! A batch claim runs one statement per key in the same transaction; with an
//! in-process database that costs no round trips.

use std::path::Path;
use std::time::Duration;

use sqlx::QueryBuilder;
use sqlx::query::Query;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteQueryResult, SqliteSynchronous,
};

use super::backend::Backend;
use super::base::SqlBase;
use super::sql::Sql;
use super::{StoreError, TableName};

/// A dedup store in an SQLite database file.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    base: SqlBase<Sqlite>,
}

impl SqliteStore {
    /// A store over an existing pool. The pool's pragmas are the caller's
    /// choice; [`SqliteStore::open`] sets the recommended ones.
    pub fn new(pool: SqlitePool) -> Self {
        Self {
            base: SqlBase::new(pool, TableName::default()),
        }
    }

    /// Opens (creating if needed) the database file at `path` with WAL,
    /// `synchronous = FULL` and a 10 s busy timeout.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        let options: SqlitePoolOptions = super::pool_options();
        let pool = options.max_connections(8).connect_with(connect).await?;
        Ok(Self::new(pool))
    }

    /// Uses table `name`, validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self {
            base: self.base.on_table(TableName::new(name)?),
        })
    }
}

super::forward::forward_sql_store!(impl[] for SqliteStore => base, Db = Sqlite);
super::forward::forward_admin_store!(impl[] for SqliteStore => base);

impl Backend for Sqlite {
    const QUOTE: char = '"';
    const BYTE_TEXT: bool = false;
    const ROW_VALUES: bool = true;
    /// Writers queue on the write lock instead of failing on a lock upgrade.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const MIGRATE_BEGIN: Option<&'static str> = Some(Self::BEGIN);

    fn sql(table: &TableName) -> Sql {
        Sql::sqlite(table)
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn build<'q>(qb: &'q mut QueryBuilder<'_, Self>) -> Query<'q, Self, Self::Arguments<'q>> {
        qb.build()
    }
}
