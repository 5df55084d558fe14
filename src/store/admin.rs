//! Operations queries on the dedup table: statistics, record search, counts
//! and purging by age. These run from the `onceonly` CLI and from maintenance
//! jobs, never on the delivery path, so their SQL is built per call.
//!
//! Purges are bounded: each statement deletes within one primary-key range
//! of at most `batch` rows, so none holds locks on more than one batch.
//! Statistics and searches without a key read the whole table or scope
//! (there is no index on the claim time or the source): run them against a
//! replica when the table is very large.

use async_trait::async_trait;

use super::{Record, SqlStore, StoreError};

/// Upper bounds (exclusive, in ms of age) of the age buckets in
/// [`ScopeStats::age_buckets`]; the last bucket is "older than the last bound".
pub const AGE_BUCKETS_MS: [i64; 5] = [
    3_600_000,        // 1 hour
    86_400_000,       // 1 day
    7 * 86_400_000,   // 7 days
    30 * 86_400_000,  // 30 days
    365 * 86_400_000, // 365 days
];

/// Labels of the buckets of [`ScopeStats::age_buckets`], in order.
pub const AGE_BUCKET_LABELS: [&str; 6] = ["<1h", "1h-1d", "1d-7d", "7d-30d", "30d-1y", ">=1y"];

/// Statistics of one scope of the dedup table.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ScopeStats {
    /// The scope.
    pub scope: String,
    /// How many records the scope holds, expired or not.
    pub records: u64,
    /// How many of them have expired and wait to be purged.
    pub expired: u64,
    /// How many were claimed but hold no result (a handler whose output
    /// was not stored).
    pub without_result: u64,
    /// Creation time of the oldest record, in ms since the Unix epoch.
    pub oldest_ms: Option<i64>,
    /// Creation time of the newest record, in ms since the Unix epoch.
    pub newest_ms: Option<i64>,
    /// Record counts by age, bucketed by [`AGE_BUCKETS_MS`] (labels in
    /// [`AGE_BUCKET_LABELS`]).
    pub age_buckets: [u64; 6],
}

/// Which records [`AdminStore::find`] returns.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RecordFilter {
    /// Only this scope.
    pub scope: Option<String>,
    /// Only this exact key.
    pub key: Option<String>,
    /// Only records whose source starts with this prefix (e.g. `payments/3@`),
    /// compared byte for byte (case-sensitive on every backend).
    pub source_prefix: Option<String>,
    /// At most this many records (newest first).
    pub limit: u32,
}

impl Default for RecordFilter {
    /// All records, at most 100.
    fn default() -> Self {
        Self::new(100)
    }
}

impl RecordFilter {
    /// A filter returning at most `limit` records (at least 1).
    pub fn new(limit: u32) -> Self {
        Self {
            scope: None,
            key: None,
            source_prefix: None,
            limit: limit.max(1),
        }
    }

    /// Only records of `scope`.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Only the record with `key`.
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only records whose source starts with `prefix`.
    #[must_use]
    pub fn source_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.source_prefix = Some(prefix.into());
        self
    }
}

/// Which records [`AdminStore::count`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CountFilter {
    /// All of them.
    All,
    /// Those expired at this time (ms since the Unix epoch).
    ExpiredAt(i64),
    /// Those created before this time (ms since the Unix epoch).
    CreatedBefore(i64),
    /// Those created before `cutoff_ms` that have not expired at `now_ms`:
    /// what a purge by age would delete although its retention still holds.
    LiveCreatedBefore {
        /// Creation cutoff, ms since the Unix epoch.
        cutoff_ms: i64,
        /// Now, ms since the Unix epoch.
        now_ms: i64,
    },
}

/// Where a purge by age resumes: the last primary key it examined.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeCursor {
    /// Scope of the last examined record.
    pub scope: String,
    /// Key of the last examined record.
    pub key: String,
}

/// One step of [`AdminStore::purge_created_before`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeStep {
    /// Records examined in this step (at most the batch size).
    pub scanned: u64,
    /// Records deleted in this step.
    pub deleted: u64,
    /// Where the next step starts; `None` once the table was walked to its end.
    pub next: Option<PurgeCursor>,
}

/// Operations queries a SQL backend answers, beyond the delivery path of
/// [`SqlStore`].
#[async_trait]
pub trait AdminStore: SqlStore {
    /// Checks that the dedup table has every column this version reads,
    /// without reading a row.
    async fn check_columns(&self) -> Result<(), StoreError>;

    /// Per-scope statistics (only `scope`, if given), ordered by scope.
    /// Scans the table (or the scope): an operator's query, not a hot path.
    async fn stats(&self, scope: Option<&str>, now_ms: i64) -> Result<Vec<ScopeStats>, StoreError>;

    /// Records matching `filter`, newest first.
    async fn find(&self, filter: &RecordFilter) -> Result<Vec<Record>, StoreError>;

    /// How many records the table (or `scope`) holds that match `which`.
    /// [`CountFilter::ExpiredAt`] is answered from the expiry index; the
    /// others scan the table or the scope.
    async fn count(&self, scope: Option<&str>, which: CountFilter) -> Result<u64, StoreError>;

    /// Deletes records created before `cutoff_ms`, expired or not, walking
    /// the primary key in order: this step reads the keys of at most `batch`
    /// records after `after` (from the start if `None`), then deletes the
    /// old ones among them with one statement bounded to that key range.
    /// Call it again with [`PurgeStep::next`] until that is `None`. Each
    /// step reads one bounded index range, so the cost does not depend on
    /// how many records are young, and no index on the creation time is
    /// needed.
    async fn purge_created_before(
        &self,
        scope: Option<&str>,
        cutoff_ms: i64,
        after: Option<&PurgeCursor>,
        batch: u32,
    ) -> Result<PurgeStep, StoreError>;
}

/// Placeholder style of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// `$1, $2, ...` (Postgres, SQLite); row values compare as index ranges.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    Numbered,
    /// `?` (MySQL); row ranges are written out.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    Question,
}

/// A bound argument of an admin statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

/// A statement with its arguments, built together so they cannot drift apart.
#[derive(Debug)]
pub(crate) struct Stmt {
    dialect: Dialect,
    pub sql: String,
    pub args: Vec<Arg>,
}

impl Stmt {
    pub(crate) fn new(dialect: Dialect, sql: &str) -> Self {
        Self {
            dialect,
            sql: sql.to_owned(),
            args: Vec::new(),
        }
    }

    /// Appends `text` with no placeholder.
    fn text(&mut self, text: &str) -> &mut Self {
        self.sql.push_str(text);
        self
    }

    /// Appends `text`, whose `?` placeholders take `args` in order.
    fn with(&mut self, text: &str, args: impl IntoIterator<Item = Arg>) -> &mut Self {
        let mut args = args.into_iter();
        for c in text.chars() {
            if c == '?' {
                let arg = args.next();
                debug_assert!(arg.is_some(), "fewer arguments than placeholders");
                self.args.extend(arg);
                match self.dialect {
                    Dialect::Numbered => {
                        self.sql.push('$');
                        self.sql.push_str(&self.args.len().to_string());
                    }
                    Dialect::Question => self.sql.push('?'),
                }
            } else {
                self.sql.push(c);
            }
        }
        debug_assert!(args.next().is_none(), "more arguments than placeholders");
        self
    }
}

fn text(s: &str) -> Arg {
    Arg::Text(s.to_owned())
}

/// The dedup table's columns, as this version reads them.
const COLUMNS: &str = "scope, idem_key, fingerprint, source, created_at_ms, expires_at_ms, result";

/// `SELECT <columns> ... WHERE 1 = 0`: fails if a column is missing.
pub(crate) fn check_sql(table: &str) -> String {
    format!("SELECT {COLUMNS} FROM {table} WHERE 1 = 0")
}

/// `SELECT ... GROUP BY scope` for [`AdminStore::stats`].
pub(crate) fn stats_stmt(dialect: Dialect, table: &str, scope: Option<&str>, now_ms: i64) -> Stmt {
    let mut s = Stmt::new(dialect, "SELECT scope, COUNT(*) AS records");
    s.with(
        ", COUNT(CASE WHEN expires_at_ms <= ? THEN 1 END) AS expired",
        [Arg::Int(now_ms)],
    );
    s.text(
        ", COUNT(CASE WHEN result IS NULL THEN 1 END) AS without_result, \
         MIN(created_at_ms) AS oldest, MAX(created_at_ms) AS newest",
    );
    // Cumulative "younger than bound" counts b0..b4, then "at least the last bound".
    let cutoff = |bound: i64| Arg::Int(now_ms.saturating_sub(bound));
    for (i, bound) in AGE_BUCKETS_MS.iter().enumerate() {
        s.with(
            &format!(", COUNT(CASE WHEN created_at_ms > ? THEN 1 END) AS b{i}"),
            [cutoff(*bound)],
        );
    }
    s.with(
        ", COUNT(CASE WHEN created_at_ms <= ? THEN 1 END) AS b5",
        [cutoff(AGE_BUCKETS_MS[4])],
    );
    s.text(&format!(" FROM {table}"));
    if let Some(scope) = scope {
        s.with(" WHERE scope = ?", [text(scope)]);
    }
    s.text(" GROUP BY scope ORDER BY scope");
    s
}

/// Turns cumulative "younger than bound" counts into per-bucket counts.
pub(crate) fn buckets(younger_than: [i64; 5], oldest_bucket: i64) -> [u64; 6] {
    let mut out = [0; 6];
    let mut prev = 0;
    for (i, c) in younger_than.iter().enumerate() {
        out[i] = u64::try_from(c - prev).unwrap_or(0);
        prev = *c;
    }
    out[5] = u64::try_from(oldest_bucket).unwrap_or(0);
    out
}

/// A count column as `u64`.
pub(crate) fn count_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// `SELECT` for [`AdminStore::find`].
pub(crate) fn find_stmt(dialect: Dialect, table: &str, filter: &RecordFilter) -> Stmt {
    let mut s = Stmt::new(
        dialect,
        &format!("SELECT {COLUMNS} FROM {table} WHERE 1 = 1"),
    );
    if let Some(scope) = &filter.scope {
        s.with(" AND scope = ?", [text(scope)]);
    }
    if let Some(key) = &filter.key {
        s.with(" AND idem_key = ?", [text(key)]);
    }
    if let Some(prefix) = &filter.source_prefix {
        // A prefix comparison instead of LIKE: no wildcard escaping (whose
        // syntax depends on server settings), and case-sensitive on SQLite
        // too. MySQL's VARBINARY counts bytes, the others characters.
        let len = match dialect {
            Dialect::Question => prefix.len(),
            Dialect::Numbered => prefix.chars().count(),
        };
        s.with(
            match dialect {
                Dialect::Numbered => " AND substr(source, 1, CAST(? AS INTEGER)) = ?",
                Dialect::Question => " AND substr(source, 1, ?) = ?",
            },
            [
                Arg::Int(i64::try_from(len).unwrap_or(i64::MAX)),
                text(prefix),
            ],
        );
    }
    s.with(
        " ORDER BY created_at_ms DESC LIMIT ?",
        [Arg::Int(i64::from(filter.limit.max(1)))],
    );
    s
}

/// `SELECT COUNT(*)` for [`AdminStore::count`].
pub(crate) fn count_stmt(
    dialect: Dialect,
    table: &str,
    scope: Option<&str>,
    which: CountFilter,
) -> Stmt {
    let mut s = Stmt::new(
        dialect,
        &format!("SELECT COUNT(*) FROM {table} WHERE 1 = 1"),
    );
    if let Some(scope) = scope {
        s.with(" AND scope = ?", [text(scope)]);
    }
    match which {
        CountFilter::All => {}
        CountFilter::ExpiredAt(t) => {
            s.with(" AND expires_at_ms <= ?", [Arg::Int(t)]);
        }
        CountFilter::CreatedBefore(t) => {
            s.with(" AND created_at_ms < ?", [Arg::Int(t)]);
        }
        CountFilter::LiveCreatedBefore { cutoff_ms, now_ms } => {
            s.with(
                " AND created_at_ms < ? AND expires_at_ms > ?",
                [Arg::Int(cutoff_ms), Arg::Int(now_ms)],
            );
        }
    }
    s
}

/// Appends `AND <key range>`: keys after `after` (exclusive) and up to
/// `upto` (inclusive), within `scope` if given. Within a scope the range is
/// on `idem_key` alone; across scopes Postgres and SQLite compare row
/// values, which both planners turn into a primary-key range, and MySQL gets
/// the written-out form its range optimizer handles.
fn key_range(
    s: &mut Stmt,
    scope: Option<&str>,
    after: Option<&PurgeCursor>,
    upto: Option<&PurgeCursor>,
) {
    if let Some(scope) = scope {
        s.with(" AND scope = ?", [text(scope)]);
        if let Some(a) = after {
            s.with(" AND idem_key > ?", [text(&a.key)]);
        }
        if let Some(u) = upto {
            s.with(" AND idem_key <= ?", [text(&u.key)]);
        }
        return;
    }
    let numbered = s.dialect == Dialect::Numbered;
    if let Some(a) = after {
        if numbered {
            s.with(
                " AND (scope, idem_key) > (?, ?)",
                [text(&a.scope), text(&a.key)],
            );
        } else {
            s.with(
                " AND (scope > ? OR (scope = ? AND idem_key > ?))",
                [text(&a.scope), text(&a.scope), text(&a.key)],
            );
        }
    }
    if let Some(u) = upto {
        if numbered {
            s.with(
                " AND (scope, idem_key) <= (?, ?)",
                [text(&u.scope), text(&u.key)],
            );
        } else {
            s.with(
                " AND (scope < ? OR (scope = ? AND idem_key <= ?))",
                [text(&u.scope), text(&u.scope), text(&u.key)],
            );
        }
    }
}

/// Selects the primary keys of the next chunk of a purge by age.
pub(crate) fn purge_chunk_stmt(
    dialect: Dialect,
    table: &str,
    scope: Option<&str>,
    after: Option<&PurgeCursor>,
    batch: u32,
) -> Stmt {
    let mut s = Stmt::new(
        dialect,
        &format!("SELECT scope, idem_key FROM {table} WHERE 1 = 1"),
    );
    key_range(&mut s, scope, after, None);
    s.with(
        " ORDER BY scope, idem_key LIMIT ?",
        [Arg::Int(i64::from(batch.max(1)))],
    );
    s
}

/// Deletes the old records of one chunk's key range.
pub(crate) fn purge_delete_stmt(
    dialect: Dialect,
    table: &str,
    scope: Option<&str>,
    cutoff_ms: i64,
    after: Option<&PurgeCursor>,
    upto: &PurgeCursor,
) -> Stmt {
    let mut s = Stmt::new(dialect, &format!("DELETE FROM {table} WHERE 1 = 1"));
    s.with(" AND created_at_ms < ?", [Arg::Int(cutoff_ms)]);
    key_range(&mut s, scope, after, Some(upto));
    s
}

/// The outcome of one chunk, from the keys it read and the rows it deleted.
pub(crate) fn purge_step(
    scanned: usize,
    deleted: u64,
    last: Option<PurgeCursor>,
    batch: u32,
) -> PurgeStep {
    let scanned = scanned as u64;
    PurgeStep {
        scanned,
        deleted,
        next: last.filter(|_| scanned >= u64::from(batch.max(1))),
    }
}

/// Binds a statement's arguments to a sqlx query of any backend.
macro_rules! bind_all {
    ($query:expr, $stmt:expr) => {{
        let mut q = $query;
        for arg in &$stmt.args {
            q = match arg {
                $crate::store::admin::Arg::Text(s) => q.bind(s.as_str()),
                $crate::store::admin::Arg::Int(i) => q.bind(*i),
            };
        }
        q
    }};
}
pub(crate) use bind_all;

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor(scope: &str, key: &str) -> PurgeCursor {
        PurgeCursor {
            scope: scope.into(),
            key: key.into(),
        }
    }

    #[test]
    fn ranges_follow_the_dialect() {
        let a = cursor("s", "k1");
        let u = cursor("t", "k9");
        let pg = purge_delete_stmt(Dialect::Numbered, "t", None, 5, Some(&a), &u);
        assert_eq!(
            pg.sql,
            "DELETE FROM t WHERE 1 = 1 AND created_at_ms < $1 AND (scope, idem_key) > ($2, $3) \
             AND (scope, idem_key) <= ($4, $5)"
        );
        assert_eq!(pg.args.len(), 5);
        let scoped = purge_delete_stmt(Dialect::Numbered, "t", Some("s"), 5, Some(&a), &u);
        assert!(
            scoped
                .sql
                .ends_with("scope = $2 AND idem_key > $3 AND idem_key <= $4")
        );
        assert_eq!(scoped.args[1..], [text("s"), text("k1"), text("k9")]);
        let my = purge_chunk_stmt(Dialect::Question, "`t`", None, Some(&a), 10);
        assert_eq!(
            my.sql,
            "SELECT scope, idem_key FROM `t` WHERE 1 = 1 AND (scope > ? OR (scope = ? AND idem_key > ?)) \
             ORDER BY scope, idem_key LIMIT ?"
        );
        assert_eq!(my.args, [text("s"), text("s"), text("k1"), Arg::Int(10)]);
    }

    #[test]
    fn source_prefix_is_a_byte_or_char_prefix() {
        let f = RecordFilter::new(5).source_prefix("pä/1@");
        let pg = find_stmt(Dialect::Numbered, "t", &f);
        assert!(
            pg.sql
                .contains("substr(source, 1, CAST($1 AS INTEGER)) = $2"),
            "{}",
            pg.sql
        );
        assert_eq!(pg.args[0], Arg::Int(5));
        assert_eq!(find_stmt(Dialect::Question, "t", &f).args[0], Arg::Int(6));
    }

    #[test]
    fn buckets_are_differences() {
        assert_eq!(buckets([1, 3, 3, 7, 9], 2), [1, 2, 0, 4, 2, 2]);
    }

    #[test]
    fn a_short_chunk_ends_the_walk() {
        assert_eq!(
            purge_step(3, 1, Some(cursor("s", "k")), 3).next,
            Some(cursor("s", "k"))
        );
        assert_eq!(purge_step(2, 1, Some(cursor("s", "k")), 3).next, None);
    }
}
