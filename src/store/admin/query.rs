//! The SQL of the operations queries, built per call with sqlx's
//! [`QueryBuilder`] (which writes each backend's placeholders), with the
//! dialect's differences taken from [`Backend`].

use sqlx::{Encode, QueryBuilder, Type};

use super::{AGE_BUCKETS_MS, CountFilter, PurgeCursor, RecordFilter};
use crate::store::backend::Backend;

/// The dedup table's columns, as this version reads them.
const COLUMNS: &str = "scope, idem_key, fingerprint, source, created_at_ms, expires_at_ms, result";

/// An operations statement being built on the table `table`.
pub(crate) struct AdminQuery<'a, DB: Backend> {
    /// The statement and its arguments.
    pub qb: QueryBuilder<'a, DB>,
}

impl<'a, DB> AdminQuery<'a, DB>
where
    DB: Backend,
    i64: Encode<'a, DB> + Type<DB>,
    &'a str: Encode<'a, DB> + Type<DB>,
{
    fn new(sql: String) -> Self {
        Self {
            qb: QueryBuilder::new(sql),
        }
    }

    /// `SELECT <columns> ... WHERE 1 = 0`: fails if a column is missing.
    pub fn check(table: &str) -> Self {
        Self::new(format!("SELECT {COLUMNS} FROM {table} WHERE 1 = 0"))
    }

    /// `SELECT ... GROUP BY scope` for [`AdminStore::stats`](super::AdminStore::stats).
    pub fn stats(table: &str, scope: Option<&'a str>, now_ms: i64) -> Self {
        let mut s = Self::new("SELECT scope, COUNT(*) AS records".into());
        s.qb.push(", COUNT(CASE WHEN expires_at_ms <= ")
            .push_bind(now_ms)
            .push(" THEN 1 END) AS expired")
            .push(
                ", COUNT(CASE WHEN result IS NULL THEN 1 END) AS without_result, \
                 MIN(created_at_ms) AS oldest, MAX(created_at_ms) AS newest",
            );
        // Cumulative "younger than bound" counts b0..b4, then "at least the last bound".
        let cutoff = |bound: i64| now_ms.saturating_sub(bound);
        for (i, bound) in AGE_BUCKETS_MS.iter().enumerate() {
            s.qb.push(", COUNT(CASE WHEN created_at_ms > ")
                .push_bind(cutoff(*bound))
                .push(format!(" THEN 1 END) AS b{i}"));
        }
        s.qb.push(", COUNT(CASE WHEN created_at_ms <= ")
            .push_bind(cutoff(AGE_BUCKETS_MS[4]))
            .push(" THEN 1 END) AS b5")
            .push(format!(" FROM {table}"));
        if let Some(scope) = scope {
            s.qb.push(" WHERE scope = ").push_bind(scope);
        }
        s.qb.push(" GROUP BY scope ORDER BY scope");
        s
    }

    /// `SELECT` for [`AdminStore::find`](super::AdminStore::find).
    pub fn find(table: &str, filter: &'a RecordFilter) -> Self {
        let mut s = Self::new(format!("SELECT {COLUMNS} FROM {table} WHERE 1 = 1"));
        s.scope(filter.scope.as_deref());
        if let Some(key) = &filter.key {
            s.qb.push(" AND idem_key = ").push_bind(key.as_str());
        }
        if let Some(prefix) = &filter.source_prefix {
            // A prefix comparison instead of LIKE: no wildcard escaping (whose
            // syntax depends on server settings), and case-sensitive on SQLite
            // too. MySQL's VARBINARY counts bytes, the others characters (and
            // take the length typed).
            let len = if DB::DIALECT.byte_text() {
                prefix.len()
            } else {
                prefix.chars().count()
            };
            let len = i64::try_from(len).unwrap_or(i64::MAX);
            if DB::DIALECT.byte_text() {
                s.qb.push(" AND substr(source, 1, ")
                    .push_bind(len)
                    .push(")");
            } else {
                s.qb.push(" AND substr(source, 1, CAST(")
                    .push_bind(len)
                    .push(" AS INTEGER))");
            }
            s.qb.push(" = ").push_bind(prefix.as_str());
        }
        s.qb.push(" ORDER BY created_at_ms DESC LIMIT ")
            .push_bind(i64::from(filter.limit.max(1)));
        s
    }

    /// `SELECT COUNT(*) AS n` for [`AdminStore::count`](super::AdminStore::count).
    pub fn count(table: &str, scope: Option<&'a str>, which: CountFilter) -> Self {
        let mut s = Self::new(format!("SELECT COUNT(*) AS n FROM {table} WHERE 1 = 1"));
        s.scope(scope);
        match which {
            CountFilter::All => {}
            CountFilter::ExpiredAt(t) => {
                s.qb.push(" AND expires_at_ms <= ").push_bind(t);
            }
            CountFilter::CreatedBefore(t) => {
                s.qb.push(" AND created_at_ms < ").push_bind(t);
            }
            CountFilter::LiveCreatedBefore { cutoff_ms, now_ms } => {
                s.qb.push(" AND created_at_ms < ")
                    .push_bind(cutoff_ms)
                    .push(" AND expires_at_ms > ")
                    .push_bind(now_ms);
            }
        }
        s
    }

    /// Selects the primary keys of the next chunk of a purge by age.
    pub fn purge_chunk(
        table: &str,
        scope: Option<&'a str>,
        after: Option<&'a PurgeCursor>,
        batch: u32,
    ) -> Self {
        let mut s = Self::new(format!("SELECT scope, idem_key FROM {table} WHERE 1 = 1"));
        s.key_range(scope, after, None);
        s.qb.push(" ORDER BY scope, idem_key LIMIT ")
            .push_bind(i64::from(batch.max(1)));
        s
    }

    /// Deletes the old records of one chunk's key range.
    pub fn purge_delete(
        table: &str,
        scope: Option<&'a str>,
        cutoff_ms: i64,
        after: Option<&'a PurgeCursor>,
        upto: &'a PurgeCursor,
    ) -> Self {
        let mut s = Self::new(format!("DELETE FROM {table} WHERE 1 = 1"));
        s.qb.push(" AND created_at_ms < ").push_bind(cutoff_ms);
        s.key_range(scope, after, Some(upto));
        s
    }

    /// Appends `AND scope = ?` if `scope` is given.
    fn scope(&mut self, scope: Option<&'a str>) {
        if let Some(scope) = scope {
            self.qb.push(" AND scope = ").push_bind(scope);
        }
    }

    /// Appends `AND <key range>`: keys after `after` (exclusive) and up to
    /// `upto` (inclusive), within `scope` if given. Within a scope the range
    /// is on `idem_key` alone; across scopes Postgres and SQLite compare row
    /// values, which both planners turn into a primary-key range, and MySQL
    /// gets the written-out form its range optimizer handles.
    fn key_range(
        &mut self,
        scope: Option<&'a str>,
        after: Option<&'a PurgeCursor>,
        upto: Option<&'a PurgeCursor>,
    ) {
        if scope.is_some() {
            self.scope(scope);
            if let Some(a) = after {
                self.qb.push(" AND idem_key > ").push_bind(a.key.as_str());
            }
            if let Some(u) = upto {
                self.qb.push(" AND idem_key <= ").push_bind(u.key.as_str());
            }
            return;
        }
        if let Some(a) = after {
            self.beyond(a, ">", ">");
        }
        if let Some(u) = upto {
            self.beyond(u, "<", "<=");
        }
    }

    /// Appends `AND (scope, idem_key) <key_op> (c.scope, c.key)`, written
    /// out as `scope <scope_op> c.scope OR (scope = c.scope AND idem_key
    /// <key_op> c.key)` where row values are not index ranges.
    fn beyond(&mut self, c: &'a PurgeCursor, scope_op: &str, key_op: &str) {
        let (scope, key) = (c.scope.as_str(), c.key.as_str());
        if DB::ROW_VALUES {
            self.qb
                .push(format!(" AND (scope, idem_key) {key_op} ("))
                .push_bind(scope)
                .push(", ")
                .push_bind(key)
                .push(")");
        } else {
            self.qb
                .push(format!(" AND (scope {scope_op} "))
                .push_bind(scope)
                .push(" OR (scope = ")
                .push_bind(scope)
                .push(format!(" AND idem_key {key_op} "))
                .push_bind(key)
                .push("))");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::cursor;
    use super::*;
    use sqlx::{Arguments as _, Execute as _};

    /// The statement's text and how many arguments it binds.
    fn parts<DB>(mut q: AdminQuery<'_, DB>) -> (String, usize)
    where
        DB: Backend,
        for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    {
        let sql = q.qb.sql().to_owned();
        let args = DB::build(&mut q.qb).take_arguments().ok().flatten();
        (sql, args.map_or(0, |a| a.len()))
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn row_values_where_they_are_ranges() {
        use sqlx::Postgres;
        let a = cursor("s", "k1");
        let u = cursor("t", "k9");
        let (sql, n) = parts(AdminQuery::<Postgres>::purge_delete(
            "t",
            None,
            5,
            Some(&a),
            &u,
        ));
        assert_eq!(
            sql,
            "DELETE FROM t WHERE 1 = 1 AND created_at_ms < $1 AND (scope, idem_key) > ($2, $3) \
             AND (scope, idem_key) <= ($4, $5)"
        );
        assert_eq!(n, 5);
        let (sql, n) = parts(AdminQuery::<Postgres>::purge_delete(
            "t",
            Some("s"),
            5,
            Some(&a),
            &u,
        ));
        assert!(
            sql.ends_with("scope = $2 AND idem_key > $3 AND idem_key <= $4"),
            "{sql}"
        );
        assert_eq!(n, 4);
        let f = RecordFilter::new(5).source_prefix("pä/1@");
        let (sql, _) = parts(AdminQuery::<Postgres>::find("t", &f));
        assert!(
            sql.contains("substr(source, 1, CAST($1 AS INTEGER)) = $2"),
            "{sql}"
        );
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn written_out_ranges_on_mysql() {
        use sqlx::MySql;
        let a = cursor("s", "k1");
        let (sql, n) = parts(AdminQuery::<MySql>::purge_chunk("`t`", None, Some(&a), 10));
        assert_eq!(
            sql,
            "SELECT scope, idem_key FROM `t` WHERE 1 = 1 AND (scope > ? OR (scope = ? AND idem_key > ?)) \
             ORDER BY scope, idem_key LIMIT ?"
        );
        assert_eq!(n, 4);
        let f = RecordFilter::new(5).source_prefix("pä/1@");
        let (sql, _) = parts(AdminQuery::<MySql>::find("t", &f));
        assert!(sql.contains("substr(source, 1, ?) = ?"), "{sql}");
    }
}
