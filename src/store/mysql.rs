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
//! Every transaction a [`MySqlStore`] begins
//! ([`SqlStore::begin`](super::SqlStore::begin)) runs at READ COMMITTED
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

use sqlx::QueryBuilder;
use sqlx::mysql::{MySql, MySqlPool, MySqlPoolOptions, MySqlQueryResult};
use sqlx::query::Query;

use super::backend::Backend;
use super::base::SqlBase;
use super::sql::Sql;
use super::{StoreError, TableName};

/// Claim transactions (and purges by age) run at READ COMMITTED.
const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// A dedup store in MySQL or MariaDB (InnoDB).
#[derive(Clone, Debug)]
pub struct MySqlStore {
    base: SqlBase<MySql>,
}

impl MySqlStore {
    /// A store over `pool`, using the default table `onceonly_keys`.
    pub fn new(pool: MySqlPool) -> Self {
        Self {
            base: SqlBase::new(pool, TableName::default()),
        }
    }

    /// Connects to `url` with a default pool (10 connections, built on
    /// [`pool_options`](crate::store::pool_options)).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let options: MySqlPoolOptions = super::pool_options();
        Ok(Self::new(options.max_connections(10).connect(url).await?))
    }

    /// Connects with `options` (TLS settings, a password from a secret
    /// store, ...) with the same pool as [`MySqlStore::connect`].
    pub async fn connect_with(
        options: sqlx::mysql::MySqlConnectOptions,
    ) -> Result<Self, StoreError> {
        let pool: MySqlPoolOptions = super::pool_options();
        Ok(Self::new(
            pool.max_connections(10).connect_with(options).await?,
        ))
    }

    /// Uses table `name` (`table` or `database.table`), validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self {
            base: self.base.on_table(TableName::new(name)?),
        })
    }
}

super::forward::forward_sql_store!(impl[] for MySqlStore => base, Db = MySql);
super::forward::forward_admin_store!(impl[] for MySqlStore => base);

impl Backend for MySql {
    const QUOTE: char = '`';
    const BYTE_TEXT: bool = true;
    const ROW_VALUES: bool = false;
    const BEGIN: &'static str = BEGIN;
    /// DDL commits implicitly in MySQL; `CREATE TABLE IF NOT EXISTS` is
    /// atomic under the metadata lock, so concurrent migrations are safe.
    const MIGRATE_BEGIN: Option<&'static str> = None;
    /// READ COMMITTED, like the claims: InnoDB then locks only the rows it
    /// deletes, not the gaps of the range, so consumers inserting new keys
    /// into it do not wait for the purge.
    const PURGE_BEGIN: Option<&'static str> = Some(BEGIN);
    /// MySQL has no `RETURNING`, MariaDB only from 10.5.
    const RETURNING: bool = false;

    fn last_insert_id(done: &MySqlQueryResult) -> Option<u64> {
        Some(done.last_insert_id())
    }

    fn sql(table: &TableName) -> Sql {
        Sql::mysql(table)
    }

    /// With `CLIENT_FOUND_ROWS`, the count of matched rows.
    fn rows_affected(done: &MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    fn build<'q>(qb: &'q mut QueryBuilder<'_, Self>) -> Query<'q, Self, Self::Arguments<'q>> {
        qb.build()
    }

    /// Error 1062: the plain `INSERT` of a claim met an existing key (the
    /// failed statement rolled back only itself).
    fn is_duplicate_key(e: &sqlx::Error) -> bool {
        e.as_database_error()
            .and_then(|db| db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .is_some_and(|my| my.number() == 1062)
    }
}
