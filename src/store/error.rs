//! Store errors and the classification of transient database errors.

/// An error of the dedup store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The table name is not a valid SQL identifier.
    #[error(
        "invalid table name {0:?}: use `table` or `schema.table`, letters, digits and `_`, at most 48 bytes each"
    )]
    InvalidTableName(String),
    /// The scope is empty, too long or contains control characters.
    #[error("invalid scope {0:?}: 1 to 128 bytes without control characters")]
    InvalidScope(String),
    /// The record of a key kept changing under the claim (concurrent purge
    /// and reclaim); transient.
    #[error("claim of key {0:?} kept racing with concurrent changes")]
    Contention(String),
    /// A stored record could not be read back.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// Whether a statement gave up waiting for a lock another transaction
    /// holds: Postgres `55P03`, MySQL/MariaDB 1205, SQLite `BUSY`/`LOCKED`.
    /// For a claim this means the key is in flight elsewhere.
    pub fn is_lock_timeout(&self) -> bool {
        match self {
            Self::Database(sqlx::Error::Database(db)) => match db_code(db.as_ref()) {
                DbCode::MySql(n) => n == 1205,
                DbCode::Sqlite(c) => matches!(c, 5 | 6),
                DbCode::SqlState(c) => c.as_deref() == Some("55P03"),
            },
            _ => false,
        }
    }

    /// Whether the database is unreachable or momentarily refusing work
    /// (connection errors, deadlocks, lock timeouts, busy): nothing about the
    /// message. Transports wait for an outage to pass and never dead-letter
    /// because of one. Invalid names and corrupt records are not outages.
    pub fn is_outage(&self) -> bool {
        match self {
            Self::Database(e) => is_connection_error(e) || is_transient(e),
            Self::Contention(_) => true,
            _ => false,
        }
    }

    /// Whether the dedup table does not exist (Postgres `42P01`, MySQL/MariaDB
    /// 1146, SQLite "no such table"): run `migrate` first.
    pub fn is_missing_table(&self) -> bool {
        match self {
            Self::Database(sqlx::Error::Database(db)) => match db_code(db.as_ref()) {
                DbCode::MySql(n) => n == 1146,
                DbCode::Sqlite(_) => db.message().starts_with("no such table"),
                DbCode::SqlState(c) => c.as_deref() == Some("42P01"),
            },
            _ => false,
        }
    }

    /// Whether retrying the transaction may succeed (lost connection,
    /// deadlock, serialization failure, lock timeout, busy database).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(e) => is_transient(e),
            Self::Contention(_) => true,
            _ => false,
        }
    }
}

/// Whether a sqlx error means the database is unreachable rather than that
/// this transaction failed: I/O and TLS errors, pool timeouts or closure, a
/// crashed connection worker, and the Postgres connection-exception class
/// `08xxx`, too many connections `53300` and shutdown codes `57P01`-`57P03`. Transports wait for such
/// errors to pass instead of dead-lettering the message.
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") || matches!(&*c, "53300" | "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Whether a sqlx error is worth retrying: I/O and pool timeouts, and the
/// database errors that mean "try again" on each backend (Postgres
/// serialization failure `40001`, deadlock `40P01`, lock not available `55P03`,
/// shutdown `57P01`/`57P02`/`57P03`; MySQL/MariaDB deadlock 1213 and lock wait
/// timeout 1205; SQLite `BUSY` and `LOCKED`).
pub fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => match db_code(db.as_ref()) {
            DbCode::MySql(n) => matches!(n, 1205 | 1213),
            DbCode::Sqlite(c) => matches!(c, 5 | 6),
            DbCode::SqlState(c) => matches!(
                c.as_deref(),
                Some("40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03")
            ),
        },
        _ => false,
    }
}

/// A database error's code in the form each backend reports it.
enum DbCode<'a> {
    /// MySQL/MariaDB error number.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    MySql(u16),
    /// SQLite primary result code (the low byte of the extended code sqlx
    /// reports).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Sqlite(i32),
    /// SQLSTATE (Postgres).
    SqlState(Option<std::borrow::Cow<'a, str>>),
}

fn db_code(db: &dyn sqlx::error::DatabaseError) -> DbCode<'_> {
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return DbCode::MySql(my.number());
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        let code = db.code().and_then(|c| c.parse::<i32>().ok()).unwrap_or(0);
        return DbCode::Sqlite(code & 0xff);
    }
    DbCode::SqlState(db.code())
}
