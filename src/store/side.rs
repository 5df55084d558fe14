//! The two side tables beyond the dedup table, and what their DDL and
//! statements share:
//!
//! - the **fence** table (`<table>_fence`, [`fence`](super::fence)): per
//!   (scope, entity), the highest order of a delivery applied so far;
//! - the **steps** table (`<table>_steps`, [`steps`](super::steps)): per
//!   (scope, key, step), the result of a call to another system made by
//!   the key's handler.
//!
//! Both expire like the dedup table's records and are deleted by the same
//! purge. Neither depends on the dedup table's layout: PostgreSQL's
//! generations layout keeps them plain.

use super::fence::{FenceSql, fence_sql};
use super::steps::{StepsSql, steps_sql};
use super::{Dialect, TableName};

/// The side tables' DDL (the fence table's, then the steps table's) and
/// statements for `table` (the dedup table) in `dialect`.
pub(crate) fn side_sql(dialect: Dialect, table: &TableName) -> (Vec<String>, FenceSql, StepsSql) {
    let (mut ddl, fence) = fence_sql(dialect, table);
    let (steps_ddl, steps) = steps_sql(dialect, table);
    ddl.extend(steps_ddl);
    (ddl, fence, steps)
}

/// What PostgreSQL and SQLite write differently in the `$n` dialects.
pub(super) struct Numbered {
    pub(super) text: &'static str,
    pub(super) bytes: &'static str,
    pub(super) bigint: &'static str,
    /// After `CREATE TABLE (...)`.
    pub(super) table_tail: &'static str,
    /// The greater of two values.
    pub(super) greatest: &'static str,
    /// After a purge's inner select.
    pub(super) purge_tail: &'static str,
}

impl Numbered {
    pub(super) const POSTGRES: Self = Self {
        text: "text",
        bytes: "bytea",
        bigint: "bigint",
        table_tail: "",
        greatest: "GREATEST",
        // A purge never waits on rows a claim holds.
        purge_tail: " FOR UPDATE SKIP LOCKED",
    };
    pub(super) const SQLITE: Self = Self {
        text: "TEXT",
        bytes: "BLOB",
        bigint: "INTEGER",
        table_tail: " WITHOUT ROWID",
        greatest: "max",
        purge_tail: "",
    };

    /// A purge of `table` (its key columns `cols`): rows expired at
    /// parameter `at`, at most parameter `at + 1` of them, those of a
    /// scope only with `scope` (`"scope = $1 AND "`). The outer test of
    /// the expiry: a row refreshed between the inner select and the
    /// delete stays.
    pub(super) fn purge(&self, table: &str, cols: &str, scope: &str, at: usize) -> String {
        let purge_tail = self.purge_tail;
        format!(
            "DELETE FROM {table} WHERE ({cols}) IN (SELECT {cols} FROM {table} \
             WHERE {scope}expires_at_ms <= ${at} ORDER BY expires_at_ms LIMIT ${}{purge_tail}) \
             AND expires_at_ms <= ${at}",
            at + 1
        )
    }
}

/// A MySQL purge of `table`: rows expired at the first parameter, at most
/// the second of them; those of a scope only with `scope`
/// (`"scope = ? AND "`, the scope first).
pub(super) fn mysql_purge(table: &str, scope: &str) -> String {
    format!("DELETE FROM {table} WHERE {scope}expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?")
}
