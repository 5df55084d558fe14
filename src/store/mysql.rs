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
//! # A deadlock the handler swallowed
//!
//! InnoDB rolls the *whole* transaction back on a deadlock (1213), and the
//! session goes on in autocommit. A handler that catches the error and
//! carries on leaves the engine on a transaction that no longer exists:
//! a claim-first claim finds its record gone when it records the result
//! ([`StoreError::ClaimLost`], retried). An optimistic claim is the last
//! write and would commit on its own, without the handler's writes: every
//! claim transaction takes a savepoint with its `BEGIN`, and an optimistic
//! claim first releases it (one more round trip), which fails once the
//! transaction ended, as `ClaimLost` too. Writes the handler makes *after*
//! swallowing such an error run in autocommit and stay, whatever onceonly
//! does: let database errors propagate (`?`).
//!
//! Keys and scopes are `VARBINARY`: the default collations compare
//! case-insensitively and ignore trailing spaces, which would merge distinct
//! keys. A batch claim runs one `INSERT` per key in the same transaction
//! (MySQL has no `INSERT ... RETURNING` to report which rows were new).
//!
//! # A silent network
//!
//! Every call is bounded on the client side ([`Deadlines`]). On the server
//! side, MariaDB (10.3 and later) ends a session idle inside a transaction
//! after `idle_transaction_timeout`: the sessions of
//! [`MySqlStore::connect`] set it to [`Deadlines::idle_in_transaction`]
//! (15 s). MySQL has no such setting: a silent client's transaction
//! keeps its locks until the server's `wait_timeout` (8 hours by default)
//! or TCP keepalive ends the session, while waiters give up after
//! `innodb_lock_wait_timeout` (50 s); lower `wait_timeout` on the server
//! if that matters to you. Migrations wait for metadata locks at most
//! [`Deadlines::migration_lock`] (`lock_wait_timeout`, 10 s).

use std::time::Duration;

use sqlx::QueryBuilder;
use sqlx::mysql::{MySql, MySqlConnectOptions, MySqlPool, MySqlQueryResult};
use sqlx::query::Query;

use super::backend::Backend;
use super::base::SqlBase;
use super::dialect::{Dialect, Layout};
use super::sql::Sql;
use super::{Deadlines, StoreError, TableName};

/// Claim transactions (and purges by age) run at READ COMMITTED, and take
/// a savepoint at once: a deadlock's rollback ends the transaction and
/// drops it, which [`TX_CHECK`] finds.
const BEGIN: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION; \
                     SAVEPOINT onceonly_tx";

/// Fails (error 1305, no such savepoint) once the transaction [`BEGIN`]
/// opened has ended: run before an optimistic claim.
const TX_CHECK: &str = "RELEASE SAVEPOINT onceonly_tx";

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
    /// [`pool_options`](crate::store::pool_options)) and the default
    /// [`Deadlines`] (on MariaDB, `idle_transaction_timeout` too).
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url.parse()?).await
    }

    /// Connects with `options` (TLS settings, a password from a secret
    /// store, ...) with the same pool as [`MySqlStore::connect`].
    pub async fn connect_with(options: MySqlConnectOptions) -> Result<Self, StoreError> {
        Self::connect_with_deadlines(options, Deadlines::default()).await
    }

    /// Connects with `options` like [`MySqlStore::connect_with`], under
    /// `deadlines` instead of the defaults.
    pub async fn connect_with_deadlines(
        options: MySqlConnectOptions,
        deadlines: Deadlines,
    ) -> Result<Self, StoreError> {
        let session = session_sql(&deadlines);
        let pool = crate::store::pool_options_for(&deadlines)
            .max_connections(10)
            .after_connect(move |conn, _| {
                let session = session.clone();
                Box::pin(async move {
                    if let Some(sql) = session {
                        sqlx::Executor::execute(conn, sql.as_str()).await?;
                    }
                    Ok(())
                })
            })
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

    /// Uses table `name` (`table` or `database.table`), validated as an identifier.
    pub fn with_table(self, name: &str) -> Result<Self, StoreError> {
        Ok(Self {
            base: self.base.on_table(TableName::new(name)?),
        })
    }
}

/// The statement each new session runs: MariaDB 10.3+ ends a session idle
/// inside a transaction after `idle_transaction_timeout` (an executable
/// comment: MySQL, which has no such setting, sets only a user variable).
fn session_sql(deadlines: &Deadlines) -> Option<String> {
    let idle = deadlines.idle_in_transaction_timeout()?;
    Some(format!(
        "SET @onceonly_session = 1 /*M!100300 , SESSION idle_transaction_timeout = {} */",
        idle.as_secs().max(1)
    ))
}

super::forward::forward_sql_store!(impl[] for MySqlStore => base, Db = MySql);
super::forward::forward_admin_store!(impl[] for MySqlStore => base);

impl Backend for MySql {
    const DIALECT: Dialect = Dialect::MySql;
    const ROW_VALUES: bool = false;
    const BEGIN: &'static str = BEGIN;
    const TX_CHECK: Option<&'static str> = Some(TX_CHECK);
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

    /// Metadata locks of the DDL: the session's `lock_wait_timeout`, in
    /// whole seconds (the migration's connection is closed afterwards).
    fn migration_lock_sql(timeout: Duration) -> Option<String> {
        Some(format!(
            "SET SESSION lock_wait_timeout = {}",
            timeout.as_secs().max(1)
        ))
    }

    /// MySQL has the plain layout only.
    fn sql(table: &TableName, _layout: Layout) -> Sql {
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
