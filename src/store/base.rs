//! The statements of a dedup store, written once for every SQL backend.
//!
//! [`SqlBase`] holds a pool, a table, its [`Sql`] and the `BEGIN` of claim
//! transactions; the backend stores wrap one and forward to it
//! ([`forward_sql_store`](super::forward::forward_sql_store)), with what differs per database coming
//! from [`Backend`]. Arguments are bound in the order documented on
//! [`Sql`], which is the order of the placeholders in every dialect's text.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use sqlx::{Database, Encode, Executor, IntoArguments, Pool, Transaction, Type};

use super::backend::Backend;
use super::claim::Existing;
use super::deadline::{Deadlines, within};
use super::dialect::Layout;
use super::rows::StoreRow;
use super::sql::{Sql, lock_timeout_value};
use super::{
    CLAIM_ROUNDS, Claim, ClaimRequest, ClaimTimes, Record, StoreError, TableName, clamp_source,
    expect_one, plan_batch,
};

/// A pool, a table and the statements of its backend.
#[derive(Debug)]
pub(crate) struct SqlBase<DB: Database> {
    pub pool: Pool<DB>,
    pub table: TableName,
    /// The table's layout: `sql` and `begin` are built from it.
    pub layout: Layout,
    pub sql: Arc<Sql>,
    /// The `BEGIN` of claim transactions.
    pub begin: Cow<'static, str>,
    /// The bounds of every call.
    pub deadlines: Deadlines,
}

impl<DB: Database> Clone for SqlBase<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            layout: self.layout,
            sql: Arc::clone(&self.sql),
            begin: self.begin.clone(),
            deadlines: self.deadlines,
        }
    }
}

impl<DB: Backend> SqlBase<DB> {
    /// A store on `table` (of the plain layout) over `pool`.
    pub fn new(pool: Pool<DB>, table: TableName) -> Self {
        Self {
            sql: Arc::new(DB::sql(&table, Layout::Plain)),
            begin: DB::begin(&table, Layout::Plain),
            pool,
            table,
            layout: Layout::Plain,
            deadlines: Deadlines::default(),
        }
    }

    /// The same store on another table of the same layout: the statements
    /// and `BEGIN` are rebuilt from both.
    pub fn on_table(self, table: TableName) -> Self {
        Self {
            sql: Arc::new(DB::sql(&table, self.layout)),
            begin: DB::begin(&table, self.layout),
            table,
            ..self
        }
    }

    /// The same store with the table laid out as `layout`: the statements
    /// and `BEGIN` are rebuilt from both.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // the only layout beside the plain one
    pub fn with_layout(self, layout: Layout) -> Self {
        Self {
            sql: Arc::new(DB::sql(&self.table, layout)),
            begin: DB::begin(&self.table, layout),
            layout,
            ..self
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The table, quoted for this backend.
    pub fn quoted_table(&self) -> String {
        self.table.quoted(DB::DIALECT.quote())
    }

    /// The bounds of every call.
    pub fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    /// The bound of one statement.
    fn statement(&self) -> std::time::Duration {
        self.deadlines.statement_deadline()
    }

    /// The bound of one statement on the pool: taking a connection, then
    /// the statement.
    pub fn pool_bound(&self) -> std::time::Duration {
        self.statement() + self.deadlines.acquire_timeout()
    }

    /// Begins a claim transaction: taking a connection (bounded by the
    /// pool's acquire timeout) and `BEGIN`, bounded by both deadlines.
    ///
    /// Cancellation-safe: sqlx's `begin` dropped after its `BEGIN` ran but
    /// before it made the transaction returns the connection to the pool
    /// with the transaction open (SQLite: holding the write lock every
    /// other claim then waits for; PostgreSQL: the next claim on that
    /// connection inside it). A delivery's future is dropped anywhere (an
    /// HTTP client that disconnects, a deadline, a shutdown), so `BEGIN`
    /// runs in a task of its own: the transaction it makes always exists,
    /// and is rolled back when dropped.
    pub async fn begin(&self) -> Result<Transaction<'static, DB>, StoreError> {
        let bound = self.deadlines.acquire_timeout() + self.statement();
        let (pool, statement) = (self.pool.clone(), self.begin.clone());
        let task = tokio::spawn(async move { pool.begin_with(statement).await });
        let joined = async {
            match task.await {
                Ok(begun) => begun.map_err(StoreError::from),
                Err(e) => Err(StoreError::Corrupt(format!("the BEGIN task failed: {e}"))),
            }
        };
        within(bound, "begin", joined).await
    }
}

/// The two writes of a claim.
#[derive(Clone, Copy)]
enum Write {
    /// Inserts the record, unless the key exists.
    Insert,
    /// Overwrites the record, if it is still expired.
    Reclaim,
}

impl<DB> SqlBase<DB>
where
    DB: Backend,
    DB::Row: StoreRow,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q str>: Encode<'q, DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
{
    /// Creates the table and its indexes if they do not exist, in one
    /// transaction where the backend's DDL is transactional. Locks are
    /// waited for at most [`Deadlines::migration_lock`], and the whole
    /// migration is bounded.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let d = &self.deadlines;
        let bound = d.acquire_timeout() + d.migration_lock_timeout() + self.statement();
        within(bound, "migration", self.migrate_unbounded()).await
    }

    async fn migrate_unbounded(&self) -> Result<(), StoreError> {
        let lock_timeout = DB::migration_lock_sql(self.deadlines.migration_lock_timeout());
        let Some(begin) = DB::MIGRATE_BEGIN else {
            // One connection for the session's lock timeout, closed after.
            let mut conn = self.pool.acquire().await?;
            conn.close_on_drop();
            if let Some(set) = &lock_timeout {
                sqlx::query(set).execute(&mut *conn).await?;
            }
            for ddl in &self.sql.ddl {
                sqlx::query(ddl).execute(&mut *conn).await?;
            }
            return Ok(());
        };
        let mut tx = self.pool.begin_with(begin).await?;
        if let Some(set) = &lock_timeout {
            sqlx::query(set).execute(&mut *tx).await?;
        }
        for ddl in &self.sql.ddl {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Claims `req.key`: see [`claim`](super::claim) for the algorithm.
    /// Bounded by the statement deadline plus the request's lock wait.
    pub async fn claim(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        let bound = self.statement() + req.lock_wait.unwrap_or_default();
        within(bound, "claim", self.claim_rounds(conn, scope, times, req)).await
    }

    async fn claim_rounds(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Claim, StoreError> {
        for _ in 0..CLAIM_ROUNDS {
            if self.write(conn, scope, times, req, Write::Insert).await? {
                return Ok(Claim::Claimed);
            }
            match self.existing(conn, scope, req.key).await? {
                // Purged between our insert and our read: insert again.
                None => continue,
                Some(found) if found.expires_at_ms > times.now_ms => return found.classify(req),
                Some(_) => {
                    if self.write(conn, scope, times, req, Write::Reclaim).await? {
                        return Ok(Claim::Claimed);
                    }
                }
            }
        }
        Err(StoreError::Contention)
    }

    /// Claims `req.key` with its result recorded in the same statement
    /// (an optimistic claim, after the handler ran); a key already there
    /// goes through the claim's other rounds, and a reclaimed expired
    /// record gets the result next. Bounded like [`claim`](Self::claim).
    pub async fn claim_completed(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
        result: &[u8],
    ) -> Result<Claim, StoreError> {
        self.check_tx(conn).await?;
        self.claim_completed_in(conn, scope, times, req, result)
            .await
    }

    /// Fails with [`StoreError::ClaimLost`] if the transaction on `conn`
    /// ended under the caller (see [`Backend::TX_CHECK`]): before an
    /// optimistic claim, which would otherwise commit on its own.
    async fn check_tx(&self, conn: &mut DB::Connection) -> Result<(), StoreError> {
        let Some(check) = DB::TX_CHECK else {
            return Ok(());
        };
        // Unprepared (a `&str`): MySQL's text protocol, which takes any
        // statement.
        let checked = (&mut *conn).execute(check);
        match within(self.statement(), "transaction check", checked).await {
            Ok(_) => Ok(()),
            Err(StoreError::Database(e)) if e.as_database_error().is_some() => {
                tracing::warn!(error = %e, "the claim's transaction ended under the handler (a swallowed deadlock?); retrying the attempt");
                Err(StoreError::ClaimLost)
            }
            Err(e) => Err(e),
        }
    }

    /// [`claim_completed`](Self::claim_completed) on a transaction known
    /// to be open.
    async fn claim_completed_in(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
        result: &[u8],
    ) -> Result<Claim, StoreError> {
        let bound = self.statement() + req.lock_wait.unwrap_or_default();
        let waiting = &self.sql.insert_completed_waiting;
        let bind = |sql| {
            sqlx::query(sql)
                .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
                .bind(req.source.map(clamp_source))
                .bind(times.now_ms)
                .bind(times.expires_at_ms)
                .bind(scope)
                .bind(req.key)
                .bind(result)
        };
        let inserted = if let Some(wait) = req.lock_wait.filter(|_| !waiting.is_empty()) {
            let row = bind(waiting)
                .bind(lock_timeout_value(wait))
                .fetch_one(&mut *conn);
            within(bound, "claim", row).await?.int("n")? == 1
        } else {
            let insert = bind(&self.sql.insert_completed).execute(&mut *conn);
            match within(bound, "claim", insert).await {
                Ok(done) => DB::rows_affected(&done) == 1,
                Err(StoreError::Database(e)) if DB::is_duplicate_key(&e) => false,
                Err(e) => return Err(e),
            }
        };
        if inserted {
            return Ok(Claim::Claimed);
        }
        let claim = self.claim(conn, scope, times, req).await?;
        if claim == Claim::Claimed {
            self.complete(conn, scope, req.key, result).await?;
        }
        Ok(claim)
    }

    /// Claims many keys: the backend's own batch claim, or one claim per key.
    pub async fn claim_batch(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let claims = self.claim_batch_unbounded(conn, scope, times, reqs);
        within(self.statement(), "batch claim", claims).await
    }

    async fn claim_batch_unbounded(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        if let Some(claims) = DB::claim_batch(self, conn, scope, times, reqs).await {
            return claims;
        }
        let plan = plan_batch(reqs);
        let mut claims = plan.claims;
        for i in plan.firsts.into_iter().chain(plan.repeats) {
            claims[i] = Some(self.claim(conn, scope, times, &reqs[i]).await?);
        }
        super::batch::finish(claims)
    }

    /// Looks a batch's keys up without claiming them (an optimistic
    /// batch, before its handlers run): see
    /// [`SqlStore::lookup_batch`](super::SqlStore::lookup_batch).
    pub async fn lookup_batch(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let found = self.existing_many(conn, scope, reqs);
        let found = within(self.statement(), "batch look-up", found).await?;
        super::batch::looked_up(reqs, times, &found)
    }

    /// The records of the keys of `reqs`, by key.
    async fn existing_many(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        reqs: &[ClaimRequest<'_>],
    ) -> Result<HashMap<String, Existing>, StoreError> {
        let mut keys: Vec<&str> = reqs.iter().map(|r| r.key).collect();
        keys.sort_unstable();
        keys.dedup();
        if let Some(found) = DB::existing_many(self, conn, scope, &keys).await {
            return found;
        }
        let mut found = HashMap::with_capacity(keys.len());
        for key in keys {
            if let Some(existing) = self.existing(conn, scope, key).await? {
                found.insert(key.to_owned(), existing);
            }
        }
        Ok(found)
    }

    /// Claims many keys with their results after their handlers ran (an
    /// optimistic batch): the backend's own statement, or one
    /// [`claim_completed`](Self::claim_completed) per key. One [`Claim`]
    /// per request; anything but [`Claim::Claimed`] means the key was
    /// taken meanwhile.
    pub async fn claim_completed_batch(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
        results: &[&[u8]],
    ) -> Result<Vec<Claim>, StoreError> {
        if reqs.len() != results.len() {
            return Err(StoreError::Corrupt(format!(
                "{} keys with {} results",
                reqs.len(),
                results.len()
            )));
        }
        self.check_tx(conn).await?;
        let batch = DB::claim_completed_batch(self, conn, scope, times, reqs, results);
        let batch = async { batch.await.transpose() };
        if let Some(claims) = within(self.statement(), "batch claim", batch).await? {
            return Ok(claims);
        }
        let mut claims = Vec::with_capacity(reqs.len());
        for (req, result) in reqs.iter().zip(results) {
            claims.push(
                self.claim_completed_in(conn, scope, times, req, result)
                    .await?,
            );
        }
        Ok(claims)
    }

    /// Runs one of a claim's writes; whether it wrote the row. With a lock
    /// wait in the request, and where the backend has one, the write's
    /// waiting form runs instead: bounded by the wait (its last argument),
    /// it returns how many rows it wrote in its column `n`. Otherwise the
    /// count is of matched rows (MySQL with `CLIENT_FOUND_ROWS` too), and a
    /// duplicate key is no row.
    async fn write(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
        write: Write,
    ) -> Result<bool, StoreError> {
        let (plain, waiting) = match write {
            Write::Insert => (&self.sql.insert, &self.sql.insert_waiting),
            Write::Reclaim => (&self.sql.reclaim, &self.sql.reclaim_waiting),
        };
        let bind = |sql| {
            let query = sqlx::query(sql)
                .bind(req.fingerprint.map(|f| f.as_bytes().as_slice()))
                .bind(req.source.map(clamp_source))
                .bind(times.now_ms)
                .bind(times.expires_at_ms)
                .bind(scope)
                .bind(req.key);
            match write {
                Write::Insert => query,
                // Still expired now.
                Write::Reclaim => query.bind(times.now_ms),
            }
        };
        if let Some(wait) = req.lock_wait.filter(|_| !waiting.is_empty()) {
            let row = bind(waiting)
                .bind(lock_timeout_value(wait))
                .fetch_one(&mut *conn)
                .await?;
            return Ok(row.int("n")? == 1);
        }
        match bind(plain).execute(&mut *conn).await {
            Ok(done) => Ok(DB::rows_affected(&done) == 1),
            Err(e) if DB::is_duplicate_key(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads the latest committed record of the key.
    async fn existing(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
    ) -> Result<Option<Existing>, StoreError> {
        let row = sqlx::query(&self.sql.existing)
            .bind(scope)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
        row.as_ref().map(StoreRow::existing).transpose()
    }

    /// Records the result of a claimed key, in the claim's transaction.
    pub async fn complete(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
        result: &[u8],
    ) -> Result<(), StoreError> {
        let done = sqlx::query(&self.sql.complete)
            .bind(result)
            .bind(scope)
            .bind(key)
            .execute(&mut *conn);
        let done = within(self.statement(), "recording the result", done).await?;
        expect_one(DB::rows_affected(&done))
    }

    /// Records many results: the backend's own statement, or one per key.
    pub async fn complete_many(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        results: &[(&str, &[u8])],
    ) -> Result<(), StoreError> {
        let done = self.complete_many_unbounded(conn, scope, results);
        within(self.statement(), "recording the results", done).await
    }

    async fn complete_many_unbounded(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        results: &[(&str, &[u8])],
    ) -> Result<(), StoreError> {
        if let Some(done) = DB::complete_many(self, conn, scope, results).await {
            return done;
        }
        for (key, result) in results {
            self.complete(conn, scope, key, result).await?;
        }
        Ok(())
    }

    /// Reads one committed record.
    pub async fn get(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(&self.sql.get)
            .bind(scope)
            .bind(key)
            .fetch_optional(&self.pool);
        let row = within(self.pool_bound(), "read", row).await?;
        row.as_ref().map(StoreRow::record).transpose()
    }

    /// Deletes at most `limit` records expired at `now_ms`: dedup records
    /// first, then, with what is left of `limit`, expired rows of the
    /// attempts, steps and fence tables.
    pub async fn purge_expired(
        &self,
        scope: Option<&str>,
        now_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let sql = &self.sql;
        let rotated = match scope {
            None => DB::rotate(self, now_ms).await,
            Some(_) => None,
        };
        let deleted = match rotated {
            Some(rotated) => rotated?,
            None => {
                self.purge_from(&sql.purge, &sql.purge_scope, scope, now_ms, limit)
                    .await?
            }
        };
        // Then the side tables, with what is left of `limit`.
        let mut purged = deleted;
        for (purge, purge_scope) in [
            (&sql.attempts.purge, &sql.attempts.purge_scope),
            (&sql.steps.purge, &sql.steps.purge_scope),
            (&sql.fence.purge, &sql.fence.purge_scope),
        ] {
            let left = u64::from(limit).saturating_sub(purged);
            let Ok(left @ 1..) = u32::try_from(left) else {
                break;
            };
            match self
                .purge_from(purge, purge_scope, scope, now_ms, left)
                .await
            {
                Ok(n) => purged += n,
                // The fence and steps tables came with an upgrade: a table
                // migrated by hand from an older DDL, or a role granted
                // the older tables only, still purges its records.
                Err(e) if side_table_unusable(&e) => {
                    tracing::warn!(error = %e, table = %self.table, "a side table of the dedup table cannot be purged (missing, or no privilege): run `onceonly migrate` and `onceonly doctor`");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(purged)
    }

    /// The table's rotations (see [`SqlStore::rotations`](super::SqlStore::rotations)),
    /// bounded.
    pub async fn rotations(&self, now_ms: i64) -> Result<Option<super::Rotations>, StoreError> {
        let read = async { DB::rotations(self, now_ms).await.transpose() };
        within(self.pool_bound(), "rotations", read).await
    }

    /// One bounded delete of expired rows, with `purge` or `purge_scope`.
    async fn purge_from(
        &self,
        purge: &str,
        purge_scope: &str,
        scope: Option<&str>,
        now_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let query = match scope {
            Some(scope) => sqlx::query(purge_scope).bind(scope),
            None => sqlx::query(purge),
        };
        let done = query
            .bind(now_ms)
            .bind(i64::from(limit))
            .execute(&self.pool);
        let done = within(self.pool_bound(), "purge", done).await?;
        Ok(DB::rows_affected(&done))
    }

    /// Counts one more start of `key`'s handler, in its own statement on
    /// the pool (committed when it returns); the new count. Bounded like
    /// every call of the store: a silent network fails it, never hangs it.
    pub async fn bump_attempts(
        &self,
        scope: &str,
        key: &str,
        times: ClaimTimes,
    ) -> Result<u32, StoreError> {
        // MySQL may read the count back in a second statement.
        let bound = self.pool_bound() + self.statement();
        let count = within(
            bound,
            "attempts counter",
            self.bump_unbounded(scope, key, times),
        );
        count
            .await?
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| StoreError::Corrupt("the attempts counter did not read back".into()))
    }

    async fn bump_unbounded(
        &self,
        scope: &str,
        key: &str,
        times: ClaimTimes,
    ) -> Result<Option<u64>, StoreError> {
        let query = sqlx::query(&self.sql.attempts.bump)
            .bind(scope)
            .bind(key)
            .bind(times.expires_at_ms)
            .bind(times.now_ms)
            .bind(times.expires_at_ms);
        if DB::RETURNING {
            let row = query.fetch_one(&self.pool).await?;
            return Ok(u64::try_from(row.int("attempts")?).ok());
        }
        let mut conn = self.pool.acquire().await?;
        let done = query.execute(&mut *conn).await?;
        if let Some(n) = DB::last_insert_id(&done).filter(|n| *n > 0) {
            return Ok(Some(n));
        }
        let row = sqlx::query(&self.sql.attempts.bump_read)
            .fetch_one(&mut *conn)
            .await?;
        Ok(u64::try_from(row.int("attempts")?).ok())
    }

    /// One start of `key`'s handler fewer, in its own statement (bounded).
    pub async fn undo_attempt(&self, scope: &str, key: &str) -> Result<(), StoreError> {
        let undo = sqlx::query(&self.sql.attempts.undo)
            .bind(scope)
            .bind(key)
            .execute(&self.pool);
        within(self.pool_bound(), "attempts counter", undo).await?;
        Ok(())
    }

    /// Deletes `key`'s attempts counter on `conn` (bounded).
    pub async fn clear_attempts(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        let clear = sqlx::query(&self.sql.attempts.clear)
            .bind(scope)
            .bind(key)
            .execute(&mut *conn);
        within(self.statement(), "attempts counter", clear).await?;
        Ok(())
    }
}

/// Whether a purge of a side table failed because the table is missing or
/// the role may not delete from it.
fn side_table_unusable(e: &StoreError) -> bool {
    use super::InfraFault;
    e.is_missing_table() || matches!(e.infra_fault(), Some(InfraFault::Permission))
}
