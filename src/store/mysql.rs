//! MySQL and MariaDB store (feature `mysql`).
//!
//! # How duplicates are detected
//!
//! sqlx-mysql always sets `CLIENT_FOUND_ROWS`, so the affected-row count of
//! `INSERT ... ON DUPLICATE KEY UPDATE k = k` is 1 both for an insert and for
//! an untouched duplicate: it cannot tell them apart. The claim therefore runs
//! a plain `INSERT` and treats error 1062 (duplicate key) as "already claimed".
//! In MySQL a failed statement rolls back only itself, not the transaction.
//!
//! # Isolation
//!
//! Every transaction begun by [`MySqlStore::begin`] runs at READ COMMITTED
//! (`SET TRANSACTION ISOLATION LEVEL READ COMMITTED` for that transaction
//! only). A claim that lost the insert race waits on the winner's row lock,
//! then reads the record with a plain consistent read: under READ COMMITTED
//! that read sees the winner's committed row. Under the default REPEATABLE
//! READ it could read an older snapshot and miss it. The read takes no lock,
//! which avoids the classic InnoDB deadlock between several waiters that each
//! hold a shared lock on the duplicate and all want an exclusive one.
//! Deadlocks (1213) and lock wait timeouts (1205) that remain possible, e.g.
//! when the winner rolls back under several waiters, are transient errors and
//! the engine retries the transaction.
//!
//! Keys and scopes are `VARBINARY`: the default collations compare
//! case-insensitively and ignore trailing spaces, which would merge distinct
//! keys. A batch claim runs one `INSERT` per key in the same transaction
//! (MySQL has no `INSERT ... RETURNING` to report which rows were new).

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::mysql::{MySql, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::{Row, Transaction};

use super::admin::{
    self, AdminStore, CountFilter, Dialect, PurgeCursor, PurgeStep, RecordFilter, ScopeStats,
};
use super::claim::{ClaimSteps, Existing, claim_each, claim_one};
use super::rows::StoreRow;
use super::sql::Sql;
use super::{
    Claim, ClaimRequest, ClaimTimes, Record, SqlStore, StoreError, TableName, clamp_source,
    expect_one,
};

const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// A dedup store in MySQL or MariaDB (InnoDB).
#[derive(Clone, Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    table: TableName,
    sql: Arc<Sql>,
}

impl MySqlStore {
    /// A store over `pool`, using the default table `onceonly_keys`.
    pub fn new(pool: MySqlPool) -> Self {
        Self::on_table(pool, TableName::default())
    }

    /// Connects to `url` with a default pool (10 connections, built on
    /// [`pool_options`](crate::store::pool_options)).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options: MySqlPoolOptions = super::pool_options();
        Ok(Self::new(options.max_connections(10).connect(url).await?))
    }

    /// Uses table `name` (`table` or `database.table`), validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self::on_table(self.pool, TableName::new(name)?))
    }

    fn on_table(pool: MySqlPool, table: TableName) -> Self {
        Self {
            sql: Arc::new(Sql::mysql(&table)),
            pool,
            table,
        }
    }
}

fn is_duplicate_key(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|my| my.number() == 1062)
}

#[async_trait]
impl ClaimSteps for MySqlStore {
    type Conn = MySqlConnection;

    async fn insert(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(&self.sql.insert)
            .bind(scope)
            .bind(req.key)
            .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
            .bind(req.source.map(clamp_source))
            .bind(times.now_ms)
            .bind(times.expires_at_ms)
            .execute(&mut *conn)
            .await;
        match done {
            Ok(_) => Ok(true),
            Err(e) if is_duplicate_key(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn existing(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        key: &str,
    ) -> Result<Option<Existing>, StoreError> {
        let row = sqlx::query(&self.sql.existing)
            .bind(scope)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(Existing {
            fingerprint: row.try_get("fingerprint")?,
            result: row.try_get("result")?,
            expires_at_ms: row.try_get("expires_at_ms")?,
        }))
    }

    async fn reclaim(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError> {
        // With CLIENT_FOUND_ROWS the count is of matched rows, which is what
        // the condition on expires_at_ms needs.
        let done = sqlx::query(&self.sql.reclaim)
            .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
            .bind(req.source.map(clamp_source))
            .bind(times.now_ms)
            .bind(times.expires_at_ms)
            .bind(scope)
            .bind(req.key)
            .bind(times.now_ms)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

#[async_trait]
impl SqlStore for MySqlStore {
    type Db = MySql;

    fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    fn table(&self) -> &TableName {
        &self.table
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        // DDL commits implicitly in MySQL; CREATE TABLE IF NOT EXISTS is
        // atomic under the metadata lock, so concurrent migrations are safe.
        for ddl in &self.sql.ddl {
            sqlx::query(ddl).execute(&self.pool).await?;
        }
        Ok(())
    }

    async fn begin(&self) -> Result<Transaction<'static, MySql>, StoreError> {
        Ok(self.pool.begin_with(BEGIN).await?)
    }

    async fn claim(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        claim_one(self, conn, scope, times, req).await
    }

    async fn claim_batch(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        claim_each(self, conn, scope, times, reqs).await
    }

    async fn complete(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        key: &str,
        result: &[u8],
    ) -> Result<(), StoreError> {
        let done = sqlx::query(&self.sql.complete)
            .bind(result)
            .bind(scope)
            .bind(key)
            .execute(&mut *conn)
            .await?;
        expect_one(done.rows_affected(), key)
    }

    async fn get(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(&self.sql.get)
            .bind(scope)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(StoreRow::record).transpose()
    }

    async fn purge_expired(
        &self,
        scope: Option<&str>,
        now_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let query = match scope {
            Some(scope) => sqlx::query(&self.sql.purge_scope).bind(scope),
            None => sqlx::query(&self.sql.purge),
        };
        let done = query
            .bind(now_ms)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}

#[async_trait]
impl AdminStore for MySqlStore {
    async fn check_columns(&self) -> Result<(), StoreError> {
        sqlx::query(&admin::check_sql(&self.table.quoted('`')))
            .fetch_all(&self.pool)
            .await?;
        Ok(())
    }

    async fn stats(&self, scope: Option<&str>, now_ms: i64) -> Result<Vec<ScopeStats>, StoreError> {
        let stmt = admin::stats_stmt(Dialect::Question, &self.table.quoted('`'), scope, now_ms);
        let rows = admin::bind_all!(sqlx::query(&stmt.sql), stmt)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(StoreRow::scope_stats).collect()
    }

    async fn find(&self, filter: &RecordFilter) -> Result<Vec<Record>, StoreError> {
        let stmt = admin::find_stmt(Dialect::Question, &self.table.quoted('`'), filter);
        let rows = admin::bind_all!(sqlx::query(&stmt.sql), stmt)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(StoreRow::record).collect()
    }

    async fn count(&self, scope: Option<&str>, which: CountFilter) -> Result<u64, StoreError> {
        let stmt = admin::count_stmt(Dialect::Question, &self.table.quoted('`'), scope, which);
        let n: i64 = admin::bind_all!(sqlx::query_scalar(&stmt.sql), stmt)
            .fetch_one(&self.pool)
            .await?;
        Ok(admin::count_of(n))
    }

    async fn purge_created_before(
        &self,
        scope: Option<&str>,
        cutoff_ms: i64,
        after: Option<&PurgeCursor>,
        batch: u32,
    ) -> Result<PurgeStep, StoreError> {
        let t = self.table.quoted('`');
        let chunk = admin::purge_chunk_stmt(Dialect::Question, &t, scope, after, batch);
        let rows = admin::bind_all!(sqlx::query(&chunk.sql), chunk)
            .fetch_all(&self.pool)
            .await?;
        let Some(last) = rows.last() else {
            return Ok(admin::purge_step(0, 0, None, batch));
        };
        let upto = PurgeCursor {
            scope: last.text("scope")?,
            key: last.text("idem_key")?,
        };
        let delete =
            admin::purge_delete_stmt(Dialect::Question, &t, scope, cutoff_ms, after, &upto);
        // READ COMMITTED, like the claims: InnoDB then locks only the rows it
        // deletes, not the gaps of the range, so consumers inserting new keys
        // into it do not wait for the purge.
        let mut tx = self.pool.begin_with(BEGIN).await?;
        let deleted = admin::bind_all!(sqlx::query(&delete.sql), delete)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(admin::purge_step(rows.len(), deleted, Some(upto), batch))
    }
}
