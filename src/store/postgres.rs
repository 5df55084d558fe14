//! PostgreSQL store (feature `postgres`).
//!
//! Claims use `INSERT ... ON CONFLICT DO NOTHING RETURNING`: a caught unique
//! violation would abort the whole Postgres transaction, `ON CONFLICT` does
//! not. A concurrent claim of the same key blocks on the winner's uncommitted
//! row, then sees its committed record (or inserts, if the winner rolled
//! back). Transactions run at the database's default isolation, normally
//! READ COMMITTED; under REPEATABLE READ or SERIALIZABLE a losing claim gets a
//! serialization failure, which is transient and retried by the engine.
//! Batch claims insert all keys in one `UNNEST` statement.

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, Postgres};
use sqlx::{Row, Transaction};

use super::claim::{Existing, claim_one};
use super::sql::Sql;
use super::{
    Claim, ClaimRequest, ClaimTimes, Record, SqlStore, StoreError, TableName, clamp_source,
    plan_batch,
};

/// A dedup store in PostgreSQL.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    table: TableName,
    sql: Arc<Sql>,
    begin: Arc<str>,
}

/// The default [`PgStore::lock_timeout`]: 10 s.
pub const DEFAULT_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `BEGIN` with a transaction-local `lock_timeout`, in one round trip.
fn begin_sql(lock_timeout: Option<std::time::Duration>) -> Arc<str> {
    match lock_timeout {
        None => Arc::from("BEGIN"),
        Some(t) => Arc::from(format!(
            "BEGIN; SET LOCAL lock_timeout = '{}'",
            super::sql::lock_timeout_value(t)
        )),
    }
}

impl PgStore {
    /// A store over `pool`, using the default table `onceonly_keys`.
    pub fn new(pool: PgPool) -> Self {
        Self::on_table(pool, TableName::default())
    }

    /// Connects to `url` with a default pool (10 connections, built on
    /// [`pool_options`](crate::store::pool_options), so connections stuck
    /// read-only after a failover are recycled).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options: PgPoolOptions = super::pool_options();
        Ok(Self::new(options.max_connections(10).connect(url).await?))
    }

    /// How long a statement of a claim transaction (the claim, and the
    /// handler's statements in it) waits for a row lock before it fails
    /// with `55P03` (default [`DEFAULT_LOCK_TIMEOUT`]; `None`: the server's
    /// setting, by default no limit). A claim stuck behind a transaction
    /// that never ends would otherwise hold its partition or queue slot
    /// forever; a lock timeout is contention, and the delivery waits in
    /// place and tries again. Set on `BEGIN`, in the same round trip.
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Option<std::time::Duration>) -> Self {
        self.begin = begin_sql(timeout);
        self
    }

    /// Uses table `name` (`table` or `schema.table`), validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self {
            sql: Arc::new(Sql::postgres(&TableName::new(name)?)),
            table: TableName::new(name)?,
            ..self
        })
    }

    fn on_table(pool: PgPool, table: TableName) -> Self {
        Self {
            sql: Arc::new(Sql::postgres(&table)),
            pool,
            table,
            begin: begin_sql(Some(DEFAULT_LOCK_TIMEOUT)),
        }
    }
}

fn existing_from(row: &sqlx::postgres::PgRow) -> Result<Existing, sqlx::Error> {
    Ok(Existing {
        fingerprint: row.try_get("fingerprint")?,
        result: row.try_get("result")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
    })
}

super::numbered::numbered_store!(PgStore, PgConnection);
super::numbered::numbered_admin!(PgStore);

#[async_trait]
impl SqlStore for PgStore {
    type Db = Postgres;

    fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn table(&self) -> &TableName {
        &self.table
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still collide in the
        // catalog; serialize migrations of this table with an advisory lock.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("onceonly:{}", self.table))
            .execute(&mut *tx)
            .await?;
        for ddl in &self.sql.ddl {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        Ok(self.pool.begin_with(self.begin.to_string()).await?)
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        claim_one(self, conn, scope, times, req).await
    }

    async fn claim_batch(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let plan = plan_batch(reqs);
        let mut claims = plan.claims;
        let firsts: Vec<&ClaimRequest<'_>> = plan.firsts.iter().map(|&i| &reqs[i]).collect();
        let keys: Vec<&str> = firsts.iter().map(|r| r.key).collect();
        let fps: Vec<Option<Vec<u8>>> = firsts
            .iter()
            .map(|r| r.fingerprint.map(|f| f.as_bytes().to_vec()))
            .collect();
        let sources: Vec<Option<&str>> =
            firsts.iter().map(|r| r.source.map(clamp_source)).collect();
        let inserted: Vec<String> = sqlx::query_scalar(&self.sql.insert_many)
            .bind(scope)
            .bind(&keys)
            .bind(&fps)
            .bind(&sources)
            .bind(times.now_ms)
            .bind(times.expires_at_ms)
            .fetch_all(&mut *conn)
            .await?;
        let inserted: std::collections::HashSet<String> = inserted.into_iter().collect();
        let taken: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| !inserted.contains(*k))
            .collect();
        let mut found = std::collections::HashMap::with_capacity(taken.len());
        if !taken.is_empty() {
            let rows = sqlx::query(&self.sql.existing_many)
                .bind(scope)
                .bind(&taken)
                .fetch_all(&mut *conn)
                .await?;
            for row in &rows {
                let key: String = row.try_get("idem_key")?;
                found.insert(key, existing_from(row)?);
            }
        }
        for &i in &plan.firsts {
            let req = &reqs[i];
            claims[i] = Some(if inserted.contains(req.key) {
                Claim::Claimed
            } else {
                match found.remove(req.key) {
                    Some(e) if e.expires_at_ms > times.now_ms => e.classify(req)?,
                    // Expired, or purged since the insert: the single-key path
                    // handles reclaim and its races.
                    _ => claim_one(self, conn, scope, times, req).await?,
                }
            });
        }
        // Repeats with another fingerprint than their first occurrence meet
        // the record as it now stands in this transaction.
        for &i in &plan.repeats {
            claims[i] = Some(claim_one(self, conn, scope, times, &reqs[i]).await?);
        }
        super::batch::finish(claims)
    }

    async fn complete(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &str,
        result: &[u8],
    ) -> Result<(), StoreError> {
        self.complete_in(conn, scope, key, result).await
    }

    async fn complete_many(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        results: &[(&str, &[u8])],
    ) -> Result<(), StoreError> {
        if results.is_empty() {
            return Ok(());
        }
        let (keys, values): (Vec<&str>, Vec<&[u8]>) = results.iter().copied().unzip();
        let done = sqlx::query(&self.sql.complete_many)
            .bind(scope)
            .bind(&keys)
            .bind(&values)
            .execute(&mut *conn)
            .await?;
        match done.rows_affected() {
            n if n == results.len() as u64 => Ok(()),
            // Fewer: a claim vanished from its own transaction.
            n if n < results.len() as u64 => Err(StoreError::ClaimLost(keys[0].to_owned())),
            n => Err(StoreError::Corrupt(format!(
                "recording {} results updated {n} rows",
                results.len()
            ))),
        }
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
