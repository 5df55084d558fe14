//! Store errors and the one classification of database failures.
//!
//! Every database error onceonly sees, whether from its own statements or
//! from a handler's (through `?` into [`HandlerError`](crate::HandlerError)),
//! is classified here, once, by [`infra_fault`]: either it is an
//! [`InfraFault`] (the database cannot take this write *right now*, whatever
//! the message says) or it is not (a constraint violation, a value out of
//! range: something about this message or this handler).
//!
//! Transports wait in place for an infrastructure fault to pass (no ack, no
//! offset commit, no dead letter); only faults of the message itself are ever
//! dead-lettered. The decision is made in one place,
//! [`engine::decide`](crate::engine::decide).
//!
//! The classes and the codes of each backend are listed on [`InfraFault`].

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// An error of the dedup store.
///
/// No variant carries the idempotency key, so no error text can leak one
/// into a log: the `onceonly.delivery` span around the line that logs the
/// error names the key, as the engine's
/// [`KeyRedaction`](crate::KeyRedaction) shows it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database failed.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// The table name is not a valid SQL identifier.
    #[error(
        "invalid table name {0:?}: use `table` or `schema.table`, letters, digits and `_`, at most 48 bytes each"
    )]
    InvalidTableName(String),
    /// The scope is empty, too long or contains control characters.
    #[error("invalid scope {0:?}: 1 to 128 bytes without control characters")]
    InvalidScope(String),
    /// The record of the key kept changing under the claim (concurrent
    /// purge and reclaim); transient.
    #[error("the claim kept racing with concurrent changes to its record (purge, reclaim)")]
    Contention,
    /// The claim of a key vanished from its own open transaction before the
    /// result was recorded: the database rolled the transaction back inside
    /// the handler (a deadlock or lock wait timeout victim on MySQL/MariaDB,
    /// whose error the handler swallowed). Nothing of the attempt is
    /// committed; it is retried.
    #[error("the claim was rolled back by the database during the handler")]
    ClaimLost,
    /// A stored record could not be read back (the text names no key).
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    /// The dedup table's layout does not allow what was asked (preparing
    /// the generations upgrade of something that is not a plain table).
    #[error("{0}")]
    Layout(String),
    /// A database call did not answer within its deadline (see
    /// [`Deadlines`](super::Deadlines)): a silent network or an overloaded
    /// database. Its connection is discarded; an
    /// [`InfraFault::Timeout`].
    #[error(transparent)]
    Deadline(#[from] super::deadline::DeadlineMissed),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        observe(&e);
        Self::Database(e)
    }
}

/// Why the database cannot take a write right now. Nothing about the
/// message: a transport waits for it to pass.
///
/// # The codes
///
/// | class | PostgreSQL (SQLSTATE) | MySQL / MariaDB (error number) | SQLite (primary result code) | client side (sqlx) |
/// |---|---|---|---|---|
/// | [`Unreachable`](InfraFault::Unreachable) | `08xxx`, `57P03` | 1040, 1081, 1129, 1130, 1152, 1158–1161, 1184, 1203, 2002, 2003, 2006, 2013, 4031 | `CANTOPEN` (14) | I/O, TLS, protocol, pool timed out or closed, worker crashed |
/// | [`ReadOnly`](InfraFault::ReadOnly) | `25006` | 1290, 1792, 1836, 1874 | `READONLY` (8) | |
/// | [`MissingSchema`](InfraFault::MissingSchema) | `42P01`, `42703`, `3F000`, `3D000`, `42883` | 1049, 1054, 1146 | "no such table/column" | column not found |
/// | [`Permission`](InfraFault::Permission) | `42501`, `28xxx` | 1044, 1045, 1142, 1143, 1227, 1370 | `PERM` (3), `AUTH` (23) | |
/// | [`Resources`](InfraFault::Resources) | `53xxx`, `58xxx`, `XX001`, `XX002` | 1021, 1030, 1037, 1038, 1041, 1114, 1135, 1637 | `NOMEM` (7), `IOERR` (10), `CORRUPT` (11), `FULL` (13), `NOTADB` (26) | |
/// | [`Shutdown`](InfraFault::Shutdown) | `57P01`, `57P02`, `57P04`, `57P05` | 1053, 1927 | | |
/// | [`Timeout`](InfraFault::Timeout) | `57014` | 1317, 1969, 3024 | `INTERRUPT` (9) | a call that missed its [deadline](super::Deadlines) ([`StoreError::Deadline`]) |
/// | [`Contention`](InfraFault::Contention) | `40001`, `40P01`, `55P03`, `55006` | 1205, 1213, 1412, 1615 | `BUSY` (5), `LOCKED` (6), `SCHEMA` (17) | |
/// | [`Corrupt`](InfraFault::Corrupt) | | | | a dedup record that does not read back |
///
/// Not infrastructure: constraint violations (`23xxx`, 1062, ...), data
/// exceptions (`22xxx`: a value of this message does not fit), a
/// transaction the handler left aborted (`25P02`, see [`is_write_fault`]),
/// syntax errors and anything else: those say something about the message
/// or the code.
///
/// Every [`StoreError`] of the dedup store's own statements is an
/// infrastructure fault except a data exception (`22xxx`, MySQL 1366/1406),
/// which only a value taken from the message can cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InfraFault {
    /// The server cannot be reached: connection refused or lost, pool
    /// exhausted, server starting.
    Unreachable,
    /// The server or database is read-only (a replica after a failover, a
    /// database set read-only for maintenance).
    ReadOnly,
    /// A table, column, schema or database is missing (`migrate` not run,
    /// a deploy out of order).
    MissingSchema,
    /// The database user lacks a privilege, or cannot log in.
    Permission,
    /// The server is out of disk, memory, connections or I/O, or reports
    /// corrupt storage.
    Resources,
    /// The server is shutting down or killed the session.
    Shutdown,
    /// A statement timeout cancelled the statement, or a call missed its
    /// client-side [deadline](super::Deadlines) (a silent network).
    Timeout,
    /// Lock contention: deadlock, lock wait timeout, serialization failure,
    /// busy database, or a transaction the database rolled back under the
    /// handler. Retrying the transaction is expected to succeed.
    Contention,
    /// The dedup store answered as onceonly does not expect: a record that
    /// does not read back as it was written, or an error of the store's own
    /// statements outside every class above.
    Corrupt,
}

impl InfraFault {
    /// A short label for logs and metrics, e.g. `read_only`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::ReadOnly => "read_only",
            Self::MissingSchema => "missing_schema",
            Self::Permission => "permission",
            Self::Resources => "resources",
            Self::Shutdown => "shutdown",
            Self::Timeout => "timeout",
            Self::Contention => "contention",
            Self::Corrupt => "corrupt",
        }
    }
}

impl fmt::Display for InfraFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl StoreError {
    /// The infrastructure fault this error is, or `None` if it is a fault
    /// of the message (a data exception on one of its values).
    pub fn infra_fault(&self) -> Option<InfraFault> {
        match self {
            Self::Database(e) if is_data_exception(e) => None,
            // Anything else from the dedup store's own statements is unexpected
            // of the database, never the message's doing.
            Self::Database(e) => Some(infra_fault(e).unwrap_or(InfraFault::Corrupt)),
            Self::Contention | Self::ClaimLost => Some(InfraFault::Contention),
            Self::Deadline(_) => Some(InfraFault::Timeout),
            Self::Corrupt(_) => Some(InfraFault::Corrupt),
            // Rejected when an engine or layer is built; never at run time.
            Self::InvalidTableName(_) | Self::InvalidScope(_) => Some(InfraFault::MissingSchema),
            // An operator's step, never a message's doing.
            Self::Layout(_) => Some(InfraFault::MissingSchema),
        }
    }

    /// Whether the error is the infrastructure's rather than the message's
    /// (see [`StoreError::infra_fault`]): transports wait for it to pass and
    /// never dead-letter because of it.
    pub fn is_infrastructure(&self) -> bool {
        self.infra_fault().is_some()
    }

    /// Whether the database cannot be reached at all (the only case in
    /// which an HTTP layer configured to fail open runs a handler without
    /// dedup).
    pub fn is_unreachable(&self) -> bool {
        self.infra_fault() == Some(InfraFault::Unreachable)
    }

    /// Whether the error is lock contention ([`InfraFault::Contention`]).
    /// For a claim this means the key is in flight elsewhere.
    pub fn is_contention(&self) -> bool {
        self.infra_fault() == Some(InfraFault::Contention)
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
}

/// The infrastructure fault a sqlx error is, or `None` when it says
/// something about the statement's values or the code (see [`InfraFault`]
/// for the codes of each class).
pub fn infra_fault(e: &sqlx::Error) -> Option<InfraFault> {
    use InfraFault::*;
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::BeginFailed => Some(Unreachable),
        sqlx::Error::ColumnNotFound(_) => Some(MissingSchema),
        sqlx::Error::Database(db) => match db_code(db.as_ref()) {
            DbCode::MySql(n) => mysql_fault(n),
            DbCode::Sqlite(c) => sqlite_fault(c, db.message()),
            DbCode::SqlState(c) => c.as_deref().and_then(sqlstate_fault),
        },
        _ => None,
    }
}

fn sqlstate_fault(code: &str) -> Option<InfraFault> {
    use InfraFault::*;
    Some(match code {
        "57P03" => Unreachable,
        "25006" => ReadOnly,
        "42P01" | "42703" | "3F000" | "3D000" | "42883" => MissingSchema,
        "42501" => Permission,
        "XX001" | "XX002" => Resources,
        "57P01" | "57P02" | "57P04" | "57P05" => Shutdown,
        "57014" => Timeout,
        "40001" | "40P01" | "55P03" | "55006" => Contention,
        c if c.starts_with("08") => Unreachable,
        c if c.starts_with("28") => Permission,
        c if c.starts_with("53") || c.starts_with("58") => Resources,
        _ => return None,
    })
}

fn mysql_fault(n: u16) -> Option<InfraFault> {
    use InfraFault::*;
    Some(match n {
        1040
        | 1081
        | 1129
        | 1130
        | 1152
        | 1158..=1161
        | 1184
        | 1203
        | 2002
        | 2003
        | 2006
        | 2013
        | 4031 => Unreachable,
        1290 | 1792 | 1836 | 1874 => ReadOnly,
        1049 | 1054 | 1146 => MissingSchema,
        1044 | 1045 | 1142 | 1143 | 1227 | 1370 => Permission,
        1021 | 1030 | 1037 | 1038 | 1041 | 1114 | 1135 | 1637 => Resources,
        1053 | 1927 => Shutdown,
        1317 | 1969 | 3024 => Timeout,
        1205 | 1213 | 1412 | 1615 => Contention,
        _ => return None,
    })
}

fn sqlite_fault(primary: i32, message: &str) -> Option<InfraFault> {
    use InfraFault::*;
    Some(match primary {
        14 => Unreachable,
        8 => ReadOnly,
        3 | 23 => Permission,
        7 | 10 | 11 | 13 | 26 => Resources,
        9 => Timeout,
        5 | 6 | 17 => Contention,
        1 if message.starts_with("no such table") || message.starts_with("no such column") => {
            MissingSchema
        }
        _ => return None,
    })
}

/// Whether `e`, raised as a claim's transaction ends (recording the result,
/// or `COMMIT`), is a fault of the message's own writes rather than of the
/// database's state:
///
/// | | PostgreSQL (SQLSTATE) | MySQL / MariaDB | SQLite |
/// |---|---|---|---|
/// | a constraint checked at COMMIT (deferred unique or foreign key, check) | `23xxx`, `40002` | 1062, 1451, 1452, 3819, 4025 | `CONSTRAINT` (19) |
/// | a constraint trigger raising an error | `P0001` | 1644 (`SIGNAL`) | `CONSTRAINT` (19, `RAISE`) |
/// | a transaction the handler left aborted (it swallowed one of its errors) | `25P02` | | |
///
/// Such a failure is retried and dead-lettered like a handler error
/// ([`Failure::Commit`](crate::engine::Failure::Commit)), never waited on:
/// waiting in place is for the database's state, and these would fail the
/// same way forever.
pub fn is_write_fault(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => match db_code(db.as_ref()) {
            DbCode::MySql(n) => matches!(n, 1062 | 1451 | 1452 | 1644 | 3819 | 4025),
            DbCode::Sqlite(c) => c == 19,
            DbCode::SqlState(c) => c.is_some_and(|c| {
                c.starts_with("23") || matches!(c.as_ref(), "40002" | "P0001" | "25P02")
            }),
        },
        _ => false,
    }
}

/// Whether a value of the statement did not fit (Postgres class `22`,
/// MySQL 1366/1406): the message's fault, never the database's.
fn is_data_exception(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => match db_code(db.as_ref()) {
            DbCode::MySql(n) => matches!(n, 1366 | 1406),
            DbCode::Sqlite(_) => false,
            DbCode::SqlState(c) => c.is_some_and(|c| c.starts_with("22")),
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

// --- Recycling connections opened while the database was read-only -------
//
// PostgreSQL applies `default_transaction_read_only` (set by `ALTER DATABASE`
// or `ALTER ROLE`, as during a failover or maintenance) when a session
// starts, and the session keeps it: a pooled connection opened while the
// database was read-only stays read-only after the database is writable
// again. SQLite connections opened on a read-only file behave alike. So when
// a read-only error is seen, every connection that existed at that moment is
// closed instead of being handed out again (see [`pool_options`]).

/// Milliseconds since [`epoch`] of the last read-only error seen, plus one;
/// 0 if none.
static READ_ONLY_SEEN: AtomicU64 = AtomicU64::new(0);

pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(crate) fn since_epoch_ms(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(epoch()).as_millis()).unwrap_or(u64::MAX)
}

/// Notes a database error: a read-only error marks every connection open
/// now as stale. Called by the conversions into [`StoreError`] and
/// [`HandlerError`](crate::HandlerError), so that every error onceonly sees
/// counts.
pub(crate) fn observe(e: &sqlx::Error) {
    if infra_fault(e) == Some(InfraFault::ReadOnly) {
        READ_ONLY_SEEN.store(since_epoch_ms(Instant::now()) + 1, Ordering::Relaxed);
    }
}

/// Whether a pooled connection of age `age` was already open when the last
/// read-only error was seen, and so may be stuck read-only.
pub fn is_stale_connection(age: std::time::Duration) -> bool {
    let seen = READ_ONLY_SEEN.load(Ordering::Relaxed);
    if seen == 0 {
        return false;
    }
    let opened = Instant::now().checked_sub(age).unwrap_or_else(epoch);
    since_epoch_ms(opened) < seen
}

/// sqlx pool options with onceonly's connection hygiene and default
/// [`Deadlines`](super::Deadlines) (see [`pool_options_for`](super::pool_options_for)):
/// a bounded acquire (5 s) and liveness check of idle connections;
/// connections that were open when a database call missed its deadline
/// (a silent network) are closed instead of reused; an idle connection
/// that was already open when a read-only error was seen (see
/// [`InfraFault::ReadOnly`]) is closed instead of handed out, so consumers
/// recover by themselves once the database is writable again. The stores'
/// `connect` constructors use it; use it when you build a pool yourself:
///
/// ```
/// # #[cfg(feature = "sqlite")] {
/// let options = onceonly::store::pool_options::<sqlx::Sqlite>().max_connections(4);
/// # let _ = options; }
/// ```
///
/// A pool built otherwise pings a connection whose call missed its
/// deadline before reusing it, and on a silent network that ping never
/// ends (and holds a pool slot).
pub fn pool_options<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
    super::deadline::pool_options_for(&super::Deadlines::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified() {
        assert_eq!(sqlstate_fault("25006"), Some(InfraFault::ReadOnly));
        assert_eq!(sqlstate_fault("08006"), Some(InfraFault::Unreachable));
        assert_eq!(sqlstate_fault("53100"), Some(InfraFault::Resources));
        assert_eq!(sqlstate_fault("28P01"), Some(InfraFault::Permission));
        assert_eq!(sqlstate_fault("57014"), Some(InfraFault::Timeout));
        assert_eq!(sqlstate_fault("57P01"), Some(InfraFault::Shutdown));
        assert_eq!(sqlstate_fault("40P01"), Some(InfraFault::Contention));
        assert_eq!(sqlstate_fault("23505"), None);
        assert_eq!(sqlstate_fault("22001"), None);
        assert_eq!(sqlstate_fault("42601"), None);
        // A handler's swallowed error is not the database's state.
        assert_eq!(sqlstate_fault("25P02"), None);
    }

    #[test]
    fn mysql_and_sqlite_codes_are_classified() {
        assert_eq!(mysql_fault(1290), Some(InfraFault::ReadOnly));
        assert_eq!(mysql_fault(1146), Some(InfraFault::MissingSchema));
        assert_eq!(mysql_fault(1213), Some(InfraFault::Contention));
        assert_eq!(mysql_fault(1062), None);
        assert_eq!(sqlite_fault(8, ""), Some(InfraFault::ReadOnly));
        assert_eq!(sqlite_fault(13, ""), Some(InfraFault::Resources));
        assert_eq!(
            sqlite_fault(1, "no such table: x"),
            Some(InfraFault::MissingSchema)
        );
        assert_eq!(sqlite_fault(1, "near \"x\": syntax error"), None);
        assert_eq!(sqlite_fault(19, ""), None);
    }

    #[test]
    fn store_errors_other_than_data_exceptions_are_infrastructure() {
        assert!(StoreError::Database(sqlx::Error::PoolTimedOut).is_unreachable());
        assert!(StoreError::ClaimLost.is_contention());
        assert!(StoreError::Contention.is_contention());
        assert!(StoreError::Corrupt("x".into()).is_infrastructure());
        assert!(StoreError::Database(sqlx::Error::RowNotFound).is_infrastructure());
    }

    #[test]
    fn connections_older_than_a_read_only_error_are_stale() {
        // Before any read-only error nothing is stale; afterwards only
        // connections opened before it are.
        let old = std::time::Duration::from_secs(3600);
        READ_ONLY_SEEN.store(since_epoch_ms(Instant::now()) + 1, Ordering::Relaxed);
        assert!(is_stale_connection(old));
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(!is_stale_connection(std::time::Duration::ZERO));
    }
}
