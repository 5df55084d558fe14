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
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::Transaction;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteSynchronous,
};

use super::claim::{claim_each, claim_one};
use super::sql::Sql;
use super::{Claim, ClaimRequest, ClaimTimes, Record, SqlStore, StoreError, TableName};

/// A dedup store in an SQLite database file.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    table: TableName,
    sql: Arc<Sql>,
}

impl SqliteStore {
    /// A store over an existing pool. The pool's pragmas are the caller's
    /// choice; [`SqliteStore::open`] sets the recommended ones.
    pub fn new(pool: SqlitePool) -> Self {
        Self::on_table(pool, TableName::default())
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
        Ok(Self::on_table(self.pool, TableName::new(name)?))
    }

    fn on_table(pool: SqlitePool, table: TableName) -> Self {
        Self {
            sql: Arc::new(Sql::sqlite(&table)),
            pool,
            table,
        }
    }
}

super::numbered::numbered_store!(SqliteStore, SqliteConnection);
super::numbered::numbered_admin!(SqliteStore);

#[async_trait]
impl SqlStore for SqliteStore {
    type Db = Sqlite;

    fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn table(&self) -> &TableName {
        &self.table
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        for ddl in &self.sql.ddl {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
    }

    async fn claim(
        &self,
        conn: &mut SqliteConnection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        claim_one(self, conn, scope, times, req).await
    }

    async fn claim_batch(
        &self,
        conn: &mut SqliteConnection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        claim_each(self, conn, scope, times, reqs).await
    }

    async fn complete(
        &self,
        conn: &mut SqliteConnection,
        scope: &str,
        key: &str,
        result: &[u8],
    ) -> Result<(), StoreError> {
        self.complete_in(conn, scope, key, result).await
    }

    async fn get(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        self.get_in(scope, key).await
    }

    async fn purge_expired(
        &self,
        scope: Option<&str>,
        now_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError> {
        self.purge_in(scope, now_ms, limit).await
    }
}
