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
use std::str::FromStr;
use std::time::Duration;

use sqlx::QueryBuilder;
use sqlx::query::Query;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteQueryResult, SqliteSynchronous,
};

use super::backend::Backend;
use super::base::SqlBase;
use super::dialect::{Dialect, Layout};
use super::sql::Sql;
use super::{Deadlines, StoreError, TableName};

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
        Self::connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true),
        )
        .await
    }

    /// Connects to a database URL as sqlx reads it:
    /// `sqlite://data/app.db?mode=rwc` (create if missing),
    /// `sqlite:app.db` (must exist), `sqlite::memory:` (one connection, so
    /// that every statement sees the same in-memory database). The
    /// recommended pragmas are set as with [`SqliteStore::open`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?;
        Self::connect_with(options).await
    }

    /// Connects with `options` (yours, e.g. with extensions or a key),
    /// adding WAL, `synchronous = FULL`, a 10 s busy timeout and foreign
    /// keys.
    pub async fn connect_with(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        let in_memory = options.get_filename() == Path::new(":memory:");
        let options = options
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // No network in between: waiting for one of few connections while
        // writers queue on the write lock is normal, so sqlx's 30 s.
        let deadlines = Deadlines::default().acquire(Duration::from_secs(30));
        let pool: SqlitePoolOptions = super::pool_options_for(&deadlines);
        let connections = if in_memory { 1 } else { 8 };
        let pool = pool
            .max_connections(connections)
            .connect_with(options)
            .await?;
        Ok(Self::new(pool).deadlines(deadlines))
    }

    /// Bounds every call of this store, and the transactions an engine
    /// runs on it, by `deadlines` (default [`Deadlines::default`]).
    #[must_use]
    pub fn deadlines(mut self, deadlines: Deadlines) -> Self {
        self.base.deadlines = deadlines;
        self
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
    const DIALECT: Dialect = Dialect::Sqlite;
    const ROW_VALUES: bool = true;
    /// Writers queue on the write lock instead of failing on a lock upgrade.
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    const MIGRATE_BEGIN: Option<&'static str> = Some(Self::BEGIN);

    /// SQLite has the plain layout only.
    fn sql(table: &TableName, _layout: Layout) -> Sql {
        Sql::sqlite(table)
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn build<'q>(qb: &'q mut QueryBuilder<'_, Self>) -> Query<'q, Self, Self::Arguments<'q>> {
        qb.build()
    }
}

#[cfg(test)]
mod url_tests {
    use super::*;
    use crate::store::SqlStore as _;

    #[tokio::test]
    async fn urls_follow_sqlx_conventions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("webhook.db");
        // `mode=rwc` creates the file, named without the query.
        let url = format!("sqlite://{}?mode=rwc", file.display());
        let store = SqliteStore::connect(&url).await.expect("rwc creates");
        store.migrate().await.expect("migrate");
        assert!(file.exists(), "created {}", file.display());
        let stray = std::fs::read_dir(dir.path())
            .expect("list")
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().contains('?'));
        assert!(!stray, "no file named after the query string");
        // Without `mode=rwc` a missing file is an error, as in sqlx.
        let missing = format!("sqlite:{}", dir.path().join("missing.db").display());
        assert!(SqliteStore::connect(&missing).await.is_err());
        // In memory: one connection, so the table migrate made is there.
        let memory = SqliteStore::connect("sqlite::memory:")
            .await
            .expect("memory");
        memory.migrate().await.expect("migrate in memory");
        assert!(memory.get("s", "k").await.expect("get").is_none());
    }
}
