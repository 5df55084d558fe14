//! PostgreSQL's pipelined claims: the claim travels with `BEGIN` and the
//! result with `COMMIT`, so a claimed delivery costs the round trips of
//! the same work without dedup.
//!
//! Both ends are one simple-query message holding several statements,
//! which PostgreSQL runs in order, each with a fresh snapshot (READ
//! COMMITTED), and abandons at the first error:
//!
//! - open: `BEGIN; SET LOCAL lock_timeout ...; INSERT ... ON CONFLICT DO
//!   NOTHING; SELECT <the record>`: the insert's row count says whether the
//!   key was claimed, the select (a new snapshot, after any holder of the
//!   key committed) what was there instead;
//! - finish: `UPDATE ... SET result ...` (failing unless it updated the
//!   claim's row, so that a claim is never committed without its result),
//!   the attempts counter's `DELETE` for a suspect, then `COMMIT`.
//!
//! The simple-query protocol has no parameters, so every value travels as
//! a hex literal decoded by the server (`decode('…', 'hex')`, text through
//! `convert_from(…, 'UTF8')`), never spliced as text: a literal holds only
//! `[0-9a-f]`, whatever the key, scope, source or result hold. Integers are
//! formatted by Rust, the table's name is a validated identifier.
//!
//! sqlx does not know of a transaction begun this way: the connection
//! travels in a [`ClaimTx`] that rolls it back when dropped unfinished and
//! closes it when its state is unknown.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgRow, Postgres};
use sqlx::{Either, Executor, Row};

use super::PgStore;
use crate::store::claim::Existing;
use crate::store::claim_tx::{ClaimTx, Parts};
use crate::store::deadline::within;
use crate::store::sql::lock_timeout_value;
use crate::store::{Claim, ClaimRequest, ClaimTimes, StoreError, clamp_source};

/// SQLSTATE `division_by_zero`: the finishing statement's signal that the
/// result matched no row.
const NO_ROW: &str = "22012";

/// Appends `bytes` as a `bytea` expression (`NULL` for `None`).
fn push_bytea(sql: &mut String, bytes: Option<&[u8]>) {
    match bytes {
        None => sql.push_str("NULL"),
        Some(bytes) => {
            sql.push_str("decode('");
            sql.push_str(&hex::encode(bytes));
            sql.push_str("', 'hex')");
        }
    }
}

/// Appends `text` as a `text` expression (`NULL` for `None`).
fn push_text(sql: &mut String, text: Option<&str>) {
    match text {
        None => sql.push_str("NULL"),
        // `convert_from`'s result takes the collation of its `name`
        // argument, "C": compared with a column of the default collation
        // it would miss the primary key and scan the table.
        Some(text) => {
            sql.push_str("(convert_from(");
            push_bytea(sql, Some(text.as_bytes()));
            sql.push_str(", 'UTF8') COLLATE \"default\")");
        }
    }
}

/// Appends `WHERE scope = … AND idem_key = …`.
fn push_key(sql: &mut String, scope: &str, key: &str) {
    sql.push_str(" WHERE scope = ");
    push_text(sql, Some(scope));
    sql.push_str(" AND idem_key = ");
    push_text(sql, Some(key));
}

/// `SET LOCAL lock_timeout` to `bound` (`None`: the session's setting).
fn set_lock_timeout(sql: &mut String, bound: Option<Duration>) {
    match bound {
        Some(bound) => {
            let _ = write!(
                sql,
                "SET LOCAL lock_timeout = '{}'; ",
                lock_timeout_value(bound)
            );
        }
        None => sql.push_str("SET LOCAL lock_timeout TO DEFAULT; "),
    }
}

/// `SET LOCAL lock_timeout` to the store's `bound` (`None`: no limit).
fn set_store_lock_timeout(sql: &mut String, bound: Option<Duration>) {
    sql.push_str(&super::set_local_lock_timeout(bound));
    sql.push_str("; ");
}

/// The statements that open a claim, and the position of the insert
/// among them.
pub(super) fn open_sql(
    store: &PgStore,
    scope: &str,
    times: ClaimTimes,
    req: &ClaimRequest<'_>,
) -> (String, usize) {
    let t = store.base.quoted_table();
    let mut sql = String::with_capacity(512 + 2 * req.key.len());
    sql.push_str("BEGIN; ");
    let mut insert_at = 1;
    // Nothing when the session starts with the store's bound.
    if let Some(bound) = store.lock_timeout_to_set() {
        set_store_lock_timeout(&mut sql, bound);
        insert_at += 1;
    }
    if let Some(wait) = req.lock_wait {
        set_lock_timeout(&mut sql, Some(wait));
        insert_at += 1;
    }
    let _ = write!(
        sql,
        "INSERT INTO {t} (fingerprint, source, created_at_ms, expires_at_ms, scope, idem_key) VALUES ("
    );
    push_bytea(&mut sql, req.fingerprint.map(|f| f.as_bytes().as_slice()));
    sql.push_str(", ");
    push_text(&mut sql, req.source.map(clamp_source));
    let _ = write!(sql, ", {}, {}, ", times.now_ms, times.expires_at_ms);
    push_text(&mut sql, Some(scope));
    sql.push_str(", ");
    push_text(&mut sql, Some(req.key));
    sql.push_str(") ON CONFLICT (scope, idem_key) DO NOTHING; ");
    if req.lock_wait.is_some() {
        // Back to the store's bound: the session's, or the one set above.
        match store.lock_timeout_to_set() {
            None => set_lock_timeout(&mut sql, None),
            Some(bound) => set_store_lock_timeout(&mut sql, bound),
        }
    }
    let _ = write!(
        sql,
        "SELECT encode(fingerprint, 'hex') AS fingerprint, encode(result, 'hex') AS result, \
         expires_at_ms FROM {t}"
    );
    push_key(&mut sql, scope, req.key);
    (sql, insert_at)
}

/// The statements that record the result and commit, and how many come
/// before the `COMMIT`.
pub(super) fn finish_sql(
    store: &PgStore,
    scope: &str,
    key: &str,
    result: &[u8],
    clear_attempts: bool,
) -> (String, usize) {
    let t = store.base.quoted_table();
    let mut sql = String::with_capacity(256 + 2 * (result.len() + key.len()));
    let _ = write!(sql, "WITH done AS (UPDATE {t} SET result = ");
    push_bytea(&mut sql, Some(result));
    push_key(&mut sql, scope, key);
    // Fails (22012) unless the claim's row was updated: COMMIT never runs then.
    sql.push_str(" RETURNING 1) SELECT 1 / count(*)::int AS recorded FROM done; ");
    let mut before_commit = 1;
    if clear_attempts {
        let a = store.base.table().attempts().quoted('"');
        let _ = write!(sql, "DELETE FROM {a}");
        push_key(&mut sql, scope, key);
        sql.push_str("; ");
        before_commit += 1;
    }
    sql.push_str("COMMIT");
    (sql, before_commit)
}

/// Ends a transaction begun by hand.
fn rollback(
    conn: &mut PoolConnection<Postgres>,
) -> std::pin::Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + '_>> {
    Box::pin(rollback_on(conn))
}

async fn rollback_on(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    conn.execute("ROLLBACK").await?;
    Ok(())
}

/// What the statements of one simple query returned: the row count of
/// each statement that completed, in order, and the rows.
#[derive(Default)]
struct Replies {
    counts: Vec<u64>,
    rows: Vec<PgRow>,
}

/// Runs the statements `sql` on `conn`: their replies, or the first error
/// with the replies of the statements that completed before it.
async fn run(
    conn: &mut PoolConnection<Postgres>,
    sql: &str,
) -> Result<Replies, (sqlx::Error, usize)> {
    let mut replies = Replies::default();
    let mut stream = sqlx::raw_sql(sql).fetch_many(&mut **conn);
    loop {
        match stream.try_next().await {
            Ok(Some(Either::Left(done))) => replies.counts.push(done.rows_affected()),
            Ok(Some(Either::Right(row))) => replies.rows.push(row),
            Ok(None) => return Ok(replies),
            Err(e) => return Err((e, replies.counts.len())),
        }
    }
}

/// A hex-encoded `bytea` column of the record.
fn hex_column(row: &PgRow, column: &str) -> Result<Option<Vec<u8>>, StoreError> {
    let text: Option<String> = row.try_get(column)?;
    text.map(|t| hex::decode(t).map_err(|_| StoreError::Corrupt(format!("{column} is not hex"))))
        .transpose()
}

/// The record the open statements read back.
fn existing(row: &PgRow) -> Result<Existing, StoreError> {
    Ok(Existing {
        fingerprint: hex_column(row, "fingerprint")?,
        result: hex_column(row, "result")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
    })
}

impl PgStore {
    /// [`SqlStore::open_claim`](crate::SqlStore::open_claim) in one round
    /// trip (see the module's documentation).
    pub(super) async fn open_pipelined(
        &self,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Result<ClaimTx<Postgres>, Claim>, StoreError> {
        let d = self.base.deadlines();
        let bound =
            d.acquire_timeout() + d.statement_deadline() + req.lock_wait.unwrap_or_default();
        within(bound, "claim", self.open_unbounded(scope, times, req)).await
    }

    async fn open_unbounded(
        &self,
        scope: &str,
        times: ClaimTimes,
        req: &ClaimRequest<'_>,
    ) -> Result<Result<ClaimTx<Postgres>, Claim>, StoreError> {
        let statement = self.base.deadlines().statement_deadline();
        let began = Instant::now();
        let conn = self.base.pool.acquire().await?;
        let mut tx = ClaimTx::raw(conn, rollback, began, statement);
        let (sql, insert_at) = open_sql(self, scope, times, req);
        let replies = match run(raw_conn(&mut tx)?, &sql).await {
            Ok(replies) => replies,
            Err((e, _)) => {
                tx.rollback(statement).await;
                return Err(e.into());
            }
        };
        if replies.counts.get(insert_at) == Some(&1) {
            return Ok(Ok(tx));
        }
        let found = match replies.rows.first().map(existing).transpose() {
            Ok(found) => found,
            Err(e) => {
                tx.rollback(statement).await;
                return Err(e);
            }
        };
        let claim = match found {
            Some(found) if found.expires_at_ms > times.now_ms => found.classify(req),
            // Expired, or purged since the insert: the claim's other
            // rounds, in the same transaction.
            _ => self.base.claim(&mut tx, scope, times, req).await,
        };
        crate::store::opened(tx, claim, statement).await
    }

    /// [`SqlStore::finish_claim`](crate::SqlStore::finish_claim) in one
    /// round trip for a pipelined transaction; the default path for one
    /// begun by sqlx.
    pub(super) async fn finish_pipelined(
        &self,
        tx: ClaimTx<Postgres>,
        scope: &str,
        key: &str,
        result: &[u8],
        clear_attempts: bool,
    ) -> Result<(), StoreError> {
        let statement = self.base.deadlines().statement_deadline();
        let began = tx.began();
        let mut raw = match tx.into_parts() {
            Parts::Raw(raw) => raw,
            Parts::Sqlx(tx) => {
                let tx = ClaimTx::new(tx, began);
                return crate::store::finish_by_statements(
                    self,
                    tx,
                    scope,
                    key,
                    result,
                    clear_attempts,
                )
                .await;
            }
        };
        let (sql, before_commit) = finish_sql(self, scope, key, result, clear_attempts);
        let finished = async {
            let Some(conn) = raw.conn() else {
                return Err(gone());
            };
            match run(conn, &sql).await {
                Ok(_) => {
                    raw.ended();
                    Ok(())
                }
                // The COMMIT's own error: the server ended the transaction.
                Err((e, completed)) if completed >= before_commit => {
                    raw.ended();
                    Err(e.into())
                }
                Err((e, completed)) => {
                    raw.rollback_within(statement).await;
                    let no_row = completed == 0
                        && e.as_database_error().and_then(|d| d.code()).as_deref() == Some(NO_ROW);
                    Err(if no_row {
                        StoreError::ClaimLost
                    } else {
                        e.into()
                    })
                }
            }
        };
        within(statement, "commit", finished).await
    }
}

/// The connection of a pipelined transaction.
fn raw_conn(tx: &mut ClaimTx<Postgres>) -> Result<&mut PoolConnection<Postgres>, StoreError> {
    tx.raw_conn().ok_or_else(gone)
}

fn gone() -> StoreError {
    StoreError::Corrupt("the pipelined transaction's connection is gone".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_hold_only_hex_digits() {
        let mut sql = String::new();
        push_text(&mut sql, Some("it's a \\ 'quote'\u{0}; DROP TABLE x; --"));
        let (head, tail) = (
            "(convert_from(decode('",
            "', 'hex'), 'UTF8') COLLATE \"default\")",
        );
        assert_eq!(
            sql,
            format!(
                "{head}{}{tail}",
                hex::encode("it's a \\ 'quote'\u{0}; DROP TABLE x; --")
            )
        );
        let inner = &sql[head.len()..sql.len() - tail.len()];
        assert!(inner.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
