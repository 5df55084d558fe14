//! PostgreSQL store (feature `postgres`).
//!
//! Claims use `INSERT ... ON CONFLICT DO NOTHING`: a caught unique
//! violation would abort the whole Postgres transaction, `ON CONFLICT` does
//! not. A concurrent claim of the same key blocks on the winner's uncommitted
//! row, then sees its committed record (or inserts, if the winner rolled
//! back). Transactions run at the database's default isolation, normally
//! READ COMMITTED; under REPEATABLE READ or SERIALIZABLE a losing claim gets a
//! serialization failure, which is transient and retried by the engine.
//! Batch claims insert all keys in one `UNNEST` statement.

mod unnest;

use std::borrow::Cow;
use std::time::Duration;

use sqlx::QueryBuilder;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgQueryResult, Postgres};
use sqlx::query::Query;

use super::backend::Backend;
use super::base::SqlBase;
use super::sql::{Sql, lock_timeout_value};
use super::{Claim, ClaimRequest, ClaimTimes, StoreError, TableName};

/// A dedup store in PostgreSQL.
#[derive(Clone, Debug)]
pub struct PgStore {
    base: SqlBase<Postgres>,
}

/// The default [`PgStore::lock_timeout`]: 10 s.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// `BEGIN` with a transaction-local `lock_timeout`, in one round trip.
fn begin_sql(lock_timeout: Option<Duration>) -> Cow<'static, str> {
    match lock_timeout {
        None => Cow::Borrowed(Postgres::BEGIN),
        Some(t) => Cow::Owned(format!(
            "BEGIN; SET LOCAL lock_timeout = '{}'",
            lock_timeout_value(t)
        )),
    }
}

impl PgStore {
    /// A store over `pool`, using the default table `onceonly_keys`.
    pub fn new(pool: PgPool) -> Self {
        let mut base = SqlBase::new(pool, TableName::default());
        base.begin = begin_sql(Some(DEFAULT_LOCK_TIMEOUT));
        Self { base }
    }

    /// Connects to `url` with a default pool (10 connections, built on
    /// [`pool_options`](crate::store::pool_options), so connections stuck
    /// read-only after a failover are recycled).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options: PgPoolOptions = super::pool_options();
        Ok(Self::new(options.max_connections(10).connect(url).await?))
    }

    /// Connects with `options` (TLS settings, a password from a secret
    /// store, ...) with the same pool as [`PgStore::connect`].
    pub async fn connect_with(
        options: sqlx::postgres::PgConnectOptions,
    ) -> Result<Self, StoreError> {
        let pool: PgPoolOptions = super::pool_options();
        Ok(Self::new(
            pool.max_connections(10).connect_with(options).await?,
        ))
    }

    /// How long a statement of a claim transaction (the claim, and the
    /// handler's statements in it) waits for a row lock before it fails
    /// with `55P03` (default [`DEFAULT_LOCK_TIMEOUT`]; `None`: the server's
    /// setting, by default no limit). A claim stuck behind a transaction
    /// that never ends would otherwise hold its partition or queue slot
    /// forever; a lock timeout is contention, and the delivery waits in
    /// place and tries again. Set on `BEGIN`, in the same round trip.
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.base.begin = begin_sql(timeout);
        self
    }

    /// Uses table `name` (`table` or `schema.table`), validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self {
            base: self.base.on_table(TableName::new(name)?),
        })
    }
}

super::forward::forward_sql_store!(impl[] for PgStore => base, Db = Postgres);
super::forward::forward_admin_store!(impl[] for PgStore => base);

impl Backend for Postgres {
    const QUOTE: char = '"';
    const BYTE_TEXT: bool = false;
    const ROW_VALUES: bool = true;
    const BEGIN: &'static str = "BEGIN";
    const MIGRATE_BEGIN: Option<&'static str> = Some("BEGIN");

    fn sql(table: &TableName) -> Sql {
        Sql::postgres(table)
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn build<'q>(qb: &'q mut QueryBuilder<'_, Self>) -> Query<'q, Self, Self::Arguments<'q>> {
        qb.build()
    }

    async fn claim_batch(
        base: &SqlBase<Self>,
        conn: &mut PgConnection,
        scope: &str,
        times: ClaimTimes,
        reqs: &[ClaimRequest<'_>],
    ) -> Option<Result<Vec<Claim>, StoreError>> {
        Some(unnest::claim_batch(base, conn, scope, times, reqs).await)
    }

    async fn complete_many(
        base: &SqlBase<Self>,
        conn: &mut PgConnection,
        scope: &str,
        results: &[(&str, &[u8])],
    ) -> Option<Result<(), StoreError>> {
        Some(unnest::complete_many(base, conn, scope, results).await)
    }
}
