//! What differs between the SQL databases, as far as the code written once
//! for all of them ([`SqlBase`], the admin queries) is concerned. Each
//! backend module implements [`Backend`] for its sqlx database; the rest
//! (DDL and statement text) comes from [`Sql`].

use std::collections::HashMap;

use sqlx::query::Query;
use sqlx::{Database, QueryBuilder};

use super::base::SqlBase;
use super::claim::Existing;
use super::dialect::{Dialect, Layout};
use super::sql::Sql;
use super::{Claim, ClaimRequest, ClaimTimes, StoreError, TableName};

/// What one SQL database does its own way.
pub(crate) trait Backend: Database {
    /// Which database this is: the one value the store, the outbox and the
    /// CLI read the dialect from.
    const DIALECT: Dialect;

    /// Row values compare as index ranges (`(scope, idem_key) > (?, ?)`);
    /// otherwise key ranges are written out for the range optimizer.
    const ROW_VALUES: bool;

    /// The `BEGIN` of a claim transaction (a store may set its own).
    const BEGIN: &'static str;

    /// The `BEGIN` of the transaction the DDL runs in; `None`: each DDL
    /// statement runs on its own.
    const MIGRATE_BEGIN: Option<&'static str>;

    /// The `BEGIN` of the transaction a purge by age deletes in, if it needs
    /// one. `None`: the delete runs on its own.
    const PURGE_BEGIN: Option<&'static str> = None;

    /// A statement that fails when the transaction [`BEGIN`](Self::BEGIN)
    /// opened has ended under the caller (MySQL: InnoDB rolls the whole
    /// transaction back on a deadlock, and a handler that swallowed the
    /// error leaves the session in autocommit), run once before an
    /// optimistic claim, the transaction's last write, so that the claim
    /// never commits on its own without the handler's writes. `None`: the
    /// backend aborts the transaction instead (PostgreSQL: every later
    /// statement fails until `ROLLBACK`). Whatever error it fails with is
    /// [`StoreError::ClaimLost`].
    const TX_CHECK: Option<&'static str> = None;

    /// Whether the backend has `INSERT ... RETURNING`. Without it (MySQL,
    /// MariaDB before 10.5) the attempts bump reports its new count as
    /// [`last_insert_id`](Self::last_insert_id).
    const RETURNING: bool = true;

    /// The `LAST_INSERT_ID` a statement set, on backends without
    /// [`RETURNING`](Self::RETURNING).
    fn last_insert_id(_done: &Self::QueryResult) -> Option<u64> {
        None
    }

    /// The statement that bounds a migration's lock waits to `timeout`, run
    /// first in its transaction (or session, when DDL is not
    /// transactional); `None`: the backend's own bound. PostgreSQL's also
    /// silences the notices of `IF NOT EXISTS`.
    fn migration_lock_sql(_timeout: std::time::Duration) -> Option<String> {
        None
    }

    /// Every statement of a store on `table`, laid out as `layout` (a
    /// backend without the layout answers with its plain statements: only
    /// a store of a backend that has the layout can ask for it).
    fn sql(table: &TableName, layout: Layout) -> Sql;

    /// The `BEGIN` of a claim transaction on `table`, laid out as `layout`
    /// (PostgreSQL's generations: with the rotation fence). A store may
    /// add settings of its own.
    fn begin(_table: &TableName, _layout: Layout) -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed(Self::BEGIN)
    }

    /// How many rows a statement wrote (matched, with MySQL's
    /// `CLIENT_FOUND_ROWS`).
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// The query of a built statement, with its arguments borrowed no longer
    /// than the builder: just [`QueryBuilder::build`], which only a concrete
    /// backend may shorten the arguments' lifetime of (SQLite's arguments
    /// borrow; generic code cannot see that they are covariant).
    fn build<'q>(qb: &'q mut QueryBuilder<'_, Self>) -> Query<'q, Self, Self::Arguments<'q>>;

    /// Whether an insert failed because the key exists (backends whose insert
    /// does not skip existing keys by itself).
    fn is_duplicate_key(_error: &sqlx::Error) -> bool {
        false
    }

    /// The backend's own batch claim, if it has one; `None`: one claim per
    /// key ([`SqlBase::claim_batch`]).
    async fn claim_batch(
        _base: &SqlBase<Self>,
        _conn: &mut Self::Connection,
        _scope: &str,
        _times: ClaimTimes,
        _reqs: &[ClaimRequest<'_>],
    ) -> Option<Result<Vec<Claim>, StoreError>> {
        None
    }

    /// The backend's own read of many keys' records, if it has one (by
    /// key); `None`: one read per key.
    async fn existing_many(
        _base: &SqlBase<Self>,
        _conn: &mut Self::Connection,
        _scope: &str,
        _keys: &[&str],
    ) -> Option<Result<HashMap<String, Existing>, StoreError>> {
        None
    }

    /// The backend's own optimistic batch claim (every key with its
    /// result), if it has one; `None`: one
    /// [`claim_completed`](SqlBase::claim_completed) per key.
    async fn claim_completed_batch(
        _base: &SqlBase<Self>,
        _conn: &mut Self::Connection,
        _scope: &str,
        _times: ClaimTimes,
        _reqs: &[ClaimRequest<'_>],
        _results: &[&[u8]],
    ) -> Option<Result<Vec<Claim>, StoreError>> {
        None
    }

    /// The backend's own purge of every expired record, if the table's
    /// layout has one (PostgreSQL's generations: a rotation); `None`: a
    /// bounded `DELETE`.
    async fn rotate(_base: &SqlBase<Self>, _now_ms: i64) -> Option<Result<u64, StoreError>> {
        None
    }

    /// The rotations of the table, if its layout rotates (PostgreSQL's
    /// generations); `None` otherwise.
    async fn rotations(
        _base: &SqlBase<Self>,
        _now_ms: i64,
    ) -> Option<Result<super::Rotations, StoreError>> {
        None
    }

    /// The backend's own way to record many results, if it has one; `None`:
    /// one statement per key.
    async fn complete_many(
        _base: &SqlBase<Self>,
        _conn: &mut Self::Connection,
        _scope: &str,
        _results: &[(&str, &[u8])],
    ) -> Option<Result<(), StoreError>> {
        None
    }
}
