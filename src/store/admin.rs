//! Operations queries on the dedup table: statistics, record search and
//! purging by age. These run from the `onceonly` CLI and from maintenance
//! jobs, never on the delivery path, so their SQL is built per call.
//!
//! Every statement is bounded: searches have a `LIMIT`, purges delete one
//! primary-key range of at most `batch` rows per short transaction, so no
//! statement holds locks on more than one batch.

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
pub struct ScopeStats {
    /// The scope.
    pub scope: String,
    /// How many records the scope holds, expired or not.
    pub records: i64,
    /// How many of them have expired and wait to be purged.
    pub expired: i64,
    /// How many were claimed but hold no result (a handler that stored none,
    /// or a claim written before its result).
    pub without_result: i64,
    /// Creation time of the oldest record, in ms since the Unix epoch.
    pub oldest_ms: Option<i64>,
    /// Creation time of the newest record, in ms since the Unix epoch.
    pub newest_ms: Option<i64>,
    /// Record counts by age, bucketed by [`AGE_BUCKETS_MS`] (labels in
    /// [`AGE_BUCKET_LABELS`]).
    pub age_buckets: [i64; 6],
}

/// Which records [`AdminStore::find`] returns.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct RecordFilter {
    /// Only this scope.
    pub scope: Option<String>,
    /// Only this exact key.
    pub key: Option<String>,
    /// Only records whose source starts with this prefix (e.g. `payments/3@`).
    pub source_prefix: Option<String>,
    /// At most this many records (newest first).
    pub limit: u32,
}

impl RecordFilter {
    /// A filter returning at most `limit` records.
    pub fn new(limit: u32) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    /// Only records of `scope`.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Only the record with `key`.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Only records whose source starts with `prefix`.
    pub fn source_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.source_prefix = Some(prefix.into());
        self
    }
}

/// Which records [`AdminStore::count`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Count {
    /// All of them.
    All,
    /// Those expired at this time (ms since the Unix epoch).
    ExpiredAt(i64),
    /// Those created before this time (ms since the Unix epoch).
    CreatedBefore(i64),
}

/// `SELECT COUNT(*)` for [`AdminStore::count`]; binds: scope?, then the time.
pub(crate) fn count_sql(dialect: Dialect, table: &str, scope: bool, which: Count) -> String {
    let mut b = SqlBuilder::new(
        dialect,
        &format!("SELECT COUNT(*) FROM {table} WHERE 1 = 1"),
    );
    if scope {
        b.push(" AND scope = ?");
    }
    match which {
        Count::All => {}
        Count::ExpiredAt(_) => {
            b.push(" AND expires_at_ms <= ?");
        }
        Count::CreatedBefore(_) => {
            b.push(" AND created_at_ms < ?");
        }
    }
    b.finish().to_owned()
}

impl Count {
    /// The time to bind, if any.
    pub(crate) fn time(self) -> Option<i64> {
        match self {
            Self::All => None,
            Self::ExpiredAt(t) | Self::CreatedBefore(t) => Some(t),
        }
    }
}

/// Where a purge by age resumes: the last primary key it examined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PurgeCursor {
    /// Scope of the last examined record.
    pub scope: String,
    /// Key of the last examined record.
    pub key: String,
}

/// One step of [`AdminStore::purge_created_before`].
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// Per-scope statistics (only `scope`, if given), ordered by scope.
    /// Scans the table (or the scope): an operator's query, not a hot path.
    async fn stats(&self, scope: Option<&str>, now_ms: i64) -> Result<Vec<ScopeStats>, StoreError>;

    /// Records matching `filter`, newest first.
    async fn find(&self, filter: &RecordFilter) -> Result<Vec<Record>, StoreError>;

    /// How many records the table (or `scope`) holds that match `which`.
    /// [`Count::ExpiredAt`] is answered from the expiry index; the others
    /// scan the table or the scope.
    async fn count(&self, scope: Option<&str>, which: Count) -> Result<u64, StoreError>;

    /// Deletes records created before `cutoff_ms`, expired or not, walking
    /// the primary key in order: this step examines at most `batch` records
    /// after `after` (from the start if `None`) and deletes those old
    /// enough, in one short transaction. Call it again with
    /// [`PurgeStep::next`] until that is `None`. Each step reads one bounded
    /// index range, so the cost does not depend on how many records are
    /// young, and no index on the creation time is needed.
    async fn purge_created_before(
        &self,
        scope: Option<&str>,
        cutoff_ms: i64,
        after: Option<&PurgeCursor>,
        batch: u32,
    ) -> Result<PurgeStep, StoreError>;
}

/// SQL text of the admin queries, per placeholder style.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dialect {
    /// `$1, $2, ...` (Postgres, SQLite).
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    Numbered,
    /// `?` (MySQL).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    Question,
}

/// Builds a statement with numbered or `?` placeholders.
pub(crate) struct SqlBuilder {
    dialect: Dialect,
    sql: String,
    params: usize,
}

impl SqlBuilder {
    pub(crate) fn new(dialect: Dialect, start: &str) -> Self {
        let mut b = Self {
            dialect,
            sql: String::with_capacity(256),
            params: 0,
        };
        b.push(start);
        b
    }

    /// Appends `text`, replacing each `?` in it with the next placeholder.
    pub(crate) fn push(&mut self, text: &str) -> &mut Self {
        for c in text.chars() {
            if c == '?' {
                self.params += 1;
                match self.dialect {
                    Dialect::Numbered => {
                        self.sql.push('$');
                        self.sql.push_str(&self.params.to_string());
                    }
                    Dialect::Question => self.sql.push('?'),
                }
            } else {
                self.sql.push(c);
            }
        }
        self
    }

    pub(crate) fn finish(&self) -> &str {
        &self.sql
    }
}

/// `SELECT ... GROUP BY scope` for [`AdminStore::stats`]; binds: now (×7), then scope.
pub(crate) fn stats_sql(dialect: Dialect, table: &str, scope: bool) -> String {
    let mut b = SqlBuilder::new(
        dialect,
        "SELECT scope, COUNT(*) AS records, \
         COUNT(CASE WHEN expires_at_ms <= ? THEN 1 END) AS expired, \
         COUNT(CASE WHEN result IS NULL THEN 1 END) AS without_result, \
         MIN(created_at_ms) AS oldest, MAX(created_at_ms) AS newest",
    );
    for (i, _) in AGE_BUCKETS_MS.iter().enumerate() {
        b.push(&format!(
            ", COUNT(CASE WHEN ? - created_at_ms < {} THEN 1 END) AS b{i}",
            AGE_BUCKETS_MS[i]
        ));
    }
    b.push(", COUNT(CASE WHEN ? - created_at_ms >= ");
    b.push(&format!("{} THEN 1 END) AS b5", AGE_BUCKETS_MS[4]));
    b.push(&format!(" FROM {table}"));
    if scope {
        b.push(" WHERE scope = ?");
    }
    b.push(" GROUP BY scope ORDER BY scope");
    b.finish().to_owned()
}

/// Turns cumulative "younger than bound" counts into per-bucket counts.
pub(crate) fn buckets(younger_than: [i64; 5], oldest_bucket: i64) -> [i64; 6] {
    let mut out = [0; 6];
    let mut prev = 0;
    for (i, c) in younger_than.iter().enumerate() {
        out[i] = c - prev;
        prev = *c;
    }
    out[5] = oldest_bucket;
    out
}

/// `SELECT` for [`AdminStore::find`]; binds in order: scope, key, source
/// pattern (each only if set), then limit.
pub(crate) fn find_sql(dialect: Dialect, table: &str, filter: &RecordFilter) -> String {
    let mut b = SqlBuilder::new(
        dialect,
        &format!(
            "SELECT scope, idem_key, fingerprint, source, created_at_ms, expires_at_ms, result \
             FROM {table} WHERE 1 = 1"
        ),
    );
    if filter.scope.is_some() {
        b.push(" AND scope = ?");
    }
    if filter.key.is_some() {
        b.push(" AND idem_key = ?");
    }
    if filter.source_prefix.is_some() {
        // Backslash is MySQL's default escape; Postgres and SQLite need the
        // clause (and read '\' literally in standard strings).
        b.push(match dialect {
            Dialect::Numbered => " AND source LIKE ? ESCAPE '\\'",
            Dialect::Question => " AND source LIKE ?",
        });
    }
    b.push(" ORDER BY created_at_ms DESC LIMIT ?");
    b.finish().to_owned()
}

/// A `LIKE` pattern matching strings that start with `prefix`, with `\`
/// escaping the wildcards (see [`find_sql`] for the escape clause).
pub(crate) fn like_prefix(prefix: &str) -> String {
    let mut p = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '%' | '_' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('%');
    p
}

/// The two statements of one purge-by-age step.
pub(crate) struct PurgeSql {
    /// Selects the primary keys of the next chunk; binds: scope?, cursor?, limit.
    pub chunk: String,
    /// Deletes old records in the chunk's range; binds: cutoff, scope?, cursor?, upper bound.
    pub delete: String,
}

/// Statements for [`AdminStore::purge_created_before`]. The key range is
/// written out (`a > x OR (a = x AND b > y)`) rather than as a row value,
/// which every backend's range optimizer turns into a primary-key range.
pub(crate) fn purge_sql(dialect: Dialect, table: &str, scope: bool, after: bool) -> PurgeSql {
    let lower = " AND (scope > ? OR (scope = ? AND idem_key > ?))";
    let mut chunk = SqlBuilder::new(
        dialect,
        &format!("SELECT scope, idem_key FROM {table} WHERE 1 = 1"),
    );
    if scope {
        chunk.push(" AND scope = ?");
    }
    if after {
        chunk.push(lower);
    }
    chunk.push(" ORDER BY scope, idem_key LIMIT ?");
    let mut delete = SqlBuilder::new(
        dialect,
        &format!("DELETE FROM {table} WHERE created_at_ms < ?"),
    );
    if scope {
        delete.push(" AND scope = ?");
    }
    if after {
        delete.push(lower);
    }
    delete.push(" AND (scope < ? OR (scope = ? AND idem_key <= ?))");
    PurgeSql {
        chunk: chunk.finish().to_owned(),
        delete: delete.finish().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_follow_the_dialect() {
        let pg = purge_sql(Dialect::Numbered, "\"t\"", true, true);
        assert!(
            pg.chunk
                .contains("scope = $1 AND (scope > $2 OR (scope = $3 AND idem_key > $4))")
        );
        assert!(pg.chunk.ends_with("LIMIT $5"));
        assert!(pg.delete.contains("created_at_ms < $1 AND scope = $2"));
        assert!(pg.delete.ends_with("idem_key <= $8))"));
        let my = purge_sql(Dialect::Question, "`t`", false, false);
        assert_eq!(
            my.chunk,
            "SELECT scope, idem_key FROM `t` WHERE 1 = 1 ORDER BY scope, idem_key LIMIT ?"
        );
    }

    #[test]
    fn like_prefix_escapes_wildcards() {
        assert_eq!(like_prefix("a_b%c\\"), "a\\_b\\%c\\\\%");
    }

    #[test]
    fn buckets_are_differences() {
        assert_eq!(buckets([1, 3, 3, 7, 9], 2), [1, 2, 0, 4, 2, 2]);
    }
}
