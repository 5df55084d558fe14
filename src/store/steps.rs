//! The steps table (`<table>_steps`): per (scope, key, step), the result
//! of a call to another system made by the key's handler, committed on
//! its own before the handler's transaction ends
//! ([`SqlStore::record_step`](super::SqlStore::record_step)); its DDL and
//! statements in each dialect, and what reading it returns. The engine's
//! half is `engine/steps.rs`.

use sqlx::{Encode, Executor, IntoArguments, Type};

use super::backend::Backend;
use super::base::SqlBase;
use super::deadline::within;
use super::rows::StoreRow;
use super::side::{Numbered, mysql_purge};
use super::{Dialect, StoreError, TableName};
use crate::fingerprint::Fingerprint;

/// What the record of a step's start is named: `\u{1}started:<step>` (no
/// step name holds a control character, so none is ever one). A step
/// records its start, committed on its own, before its call.
pub(crate) const STARTED_PREFIX: &str = "\u{1}started:";

/// The step a started-step record is of, if `name` is one.
pub(crate) fn started_step(name: &str) -> Option<&str> {
    name.strip_prefix(STARTED_PREFIX)
}

/// How a step that started and never finished is shown.
fn started_label(step: &str) -> String {
    format!("{step} (started; its outcome is unknown)")
}

/// The statements on the steps table.
#[derive(Debug, Default)]
pub(crate) struct StepsSql {
    /// scope, key, step, fingerprint, result, created, expires, now: the
    /// step's record, unless a live one is there (an expired one is
    /// overwritten).
    pub insert: String,
    /// scope, key, step: one record.
    pub get: String,
    /// scope, key: every step of a key, oldest first.
    pub list: String,
    /// created before, now, limit: live steps older than the bound whose
    /// key has no live record in the dedup table (`scope`, `idem_key`,
    /// `step`, `created_at_ms`).
    pub orphaned: String,
    /// now, limit.
    pub purge: String,
    /// scope, now, limit.
    pub purge_scope: String,
}

/// The steps table's DDL and statements for `table` (the dedup table) in
/// `dialect`.
pub(super) fn steps_sql(dialect: Dialect, table: &TableName) -> (Vec<String>, StepsSql) {
    match dialect {
        Dialect::MySql => mysql(table),
        Dialect::Postgres => numbered(table, &Numbered::POSTGRES),
        Dialect::Sqlite => numbered(table, &Numbered::SQLITE),
    }
}

fn numbered(table: &TableName, n: &Numbered) -> (Vec<String>, StepsSql) {
    let Numbered {
        text,
        bytes,
        bigint,
        table_tail,
        ..
    } = n;
    let t = table.quoted('"');
    let s = table.steps().quoted('"');
    let ddl = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {s} (\
             scope {text} NOT NULL, idem_key {text} NOT NULL, step {text} NOT NULL, \
             fingerprint {bytes}, result {bytes} NOT NULL, created_at_ms {bigint} NOT NULL, \
             expires_at_ms {bigint} NOT NULL, PRIMARY KEY (scope, idem_key, step)){table_tail}"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {s} (expires_at_ms)",
            table.index("steps_exp", '"')
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {s} (created_at_ms)",
            table.index("steps_created", '"')
        ),
    ];
    let step_cols = "step, fingerprint, result, created_at_ms, expires_at_ms";
    let steps = StepsSql {
        insert: format!(
            "INSERT INTO {s} AS s (scope, idem_key, {step_cols}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (scope, idem_key, step) DO UPDATE \
             SET fingerprint = excluded.fingerprint, result = excluded.result, \
             created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms \
             WHERE s.expires_at_ms <= $8"
        ),
        get: format!(
            "SELECT {step_cols} FROM {s} WHERE scope = $1 AND idem_key = $2 AND step = $3"
        ),
        list: format!(
            "SELECT {step_cols} FROM {s} WHERE scope = $1 AND idem_key = $2 \
             ORDER BY created_at_ms, step"
        ),
        orphaned: format!(
            "SELECT s.scope, s.idem_key, s.step, s.created_at_ms FROM {s} AS s \
             WHERE s.created_at_ms <= $1 AND s.expires_at_ms > $2 AND NOT EXISTS \
             (SELECT 1 FROM {t} AS t WHERE t.scope = s.scope AND t.idem_key = s.idem_key \
             AND t.expires_at_ms > $2) ORDER BY s.created_at_ms LIMIT $3"
        ),
        purge: n.purge(&s, "scope, idem_key, step", "", 1),
        purge_scope: n.purge(&s, "scope, idem_key, step", "scope = $1 AND ", 2),
    };
    (ddl, steps)
}

fn mysql(table: &TableName) -> (Vec<String>, StepsSql) {
    let t = table.quoted('`');
    let s = table.steps().quoted('`');
    // VARBINARY text: byte-exact comparison, as in the dedup table.
    let ddl = vec![format!(
        "CREATE TABLE IF NOT EXISTS {s} (\
         scope VARBINARY(128) NOT NULL, idem_key VARBINARY(255) NOT NULL, \
         step VARBINARY(64) NOT NULL, fingerprint VARBINARY(32) NULL, \
         result LONGBLOB NOT NULL, created_at_ms BIGINT NOT NULL, \
         expires_at_ms BIGINT NOT NULL, PRIMARY KEY (scope, idem_key, step), \
         KEY {} (expires_at_ms), KEY {} (created_at_ms)) ENGINE=InnoDB",
        table.index("steps_exp", '`'),
        table.index("steps_created", '`')
    )];
    let step_cols = "step, fingerprint, result, created_at_ms, expires_at_ms";
    // One `now` per assignment; `expires_at_ms` last, so that every test
    // reads the old expiry.
    let overwrite = |col: &str| format!("{col} = IF(expires_at_ms <= ?, VALUES({col}), {col})");
    let steps = StepsSql {
        insert: format!(
            "INSERT INTO {s} (scope, idem_key, {step_cols}) VALUES (?, ?, ?, ?, ?, ?, ?) \
             ON DUPLICATE KEY UPDATE {}, {}, {}, {}",
            overwrite("fingerprint"),
            overwrite("result"),
            overwrite("created_at_ms"),
            overwrite("expires_at_ms"),
        ),
        get: format!("SELECT {step_cols} FROM {s} WHERE scope = ? AND idem_key = ? AND step = ?"),
        list: format!(
            "SELECT {step_cols} FROM {s} WHERE scope = ? AND idem_key = ? \
             ORDER BY created_at_ms, step"
        ),
        orphaned: format!(
            "SELECT s.scope, s.idem_key, s.step, s.created_at_ms FROM {s} AS s \
             WHERE s.created_at_ms <= ? AND s.expires_at_ms > ? AND NOT EXISTS \
             (SELECT 1 FROM {t} AS t WHERE t.scope = s.scope AND t.idem_key = s.idem_key \
             AND t.expires_at_ms > ?) ORDER BY s.created_at_ms LIMIT ?"
        ),
        purge: mysql_purge(&s, ""),
        purge_scope: mysql_purge(&s, "scope = ? AND "),
    };
    (ddl, steps)
}

/// A finished step of a key's handler, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepRecord {
    /// The step's name.
    pub step: String,
    /// The fingerprint of the delivery whose handler ran the step.
    pub fingerprint: Option<Fingerprint>,
    /// The step's result, as its JSON encoding.
    pub result: Vec<u8>,
    /// When it finished, in ms since the Unix epoch.
    pub created_at_ms: i64,
    /// When it expires, in ms since the Unix epoch.
    pub expires_at_ms: i64,
}

/// A finished step whose key has no committed record: the handler's
/// transaction never committed after the call (see
/// [`SqlStore::orphaned_steps`](super::SqlStore::orphaned_steps)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OrphanedStep {
    /// The key's scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The step's name.
    pub step: String,
    /// When the step finished, in ms since the Unix epoch.
    pub created_at_ms: i64,
}

impl<DB> SqlBase<DB>
where
    DB: Backend,
    DB::Row: StoreRow,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
{
    /// Whether a step can be committed beside an open claim: not on
    /// SQLite, whose only writer is the claim's transaction.
    pub fn records_steps(&self) -> bool {
        DB::DIALECT != Dialect::Sqlite
    }

    /// `key`'s step `step` in `scope`, if it finished and has not expired
    /// at `now_ms`; read on `conn` (the claim's transaction: a step is
    /// committed on its own, and read committed sees it).
    pub async fn step(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<Option<StepRecord>, StoreError> {
        let row = sqlx::query(&self.sql.steps.get)
            .bind(scope)
            .bind(key)
            .bind(step)
            .fetch_optional(&mut *conn);
        let row = within(self.deadlines.statement_deadline(), "step read", row).await?;
        let record = row.as_ref().map(StoreRow::step_record).transpose()?;
        Ok(record.filter(|r| r.expires_at_ms > now_ms))
    }

    /// [`step`](Self::step) on a connection of the pool.
    async fn step_pooled(
        &self,
        scope: &str,
        key: &str,
        step: &str,
        now_ms: i64,
    ) -> Result<Option<StepRecord>, StoreError> {
        let read = async {
            let mut conn = self.pool.acquire().await?;
            self.step(&mut conn, scope, key, step, now_ms).await
        };
        within(self.pool_bound(), "step read", read).await
    }

    /// Records `key`'s finished step `step` in its own statement on the
    /// pool (committed when this returns), unless a live record is there
    /// (a concurrent attempt of the same key finished it first); returns
    /// the record that then stands. Bounded: two statements, one after
    /// the other on a pool connection each.
    pub async fn record_step(
        &self,
        scope: &str,
        key: &str,
        step: &str,
        fingerprint: Option<&[u8]>,
        result: &[u8],
        times: super::ClaimTimes,
    ) -> Result<StepRecord, StoreError> {
        let mut query = sqlx::query(&self.sql.steps.insert)
            .bind(scope)
            .bind(key)
            .bind(step)
            .bind(fingerprint)
            .bind(result)
            .bind(times.now_ms)
            .bind(times.expires_at_ms);
        // MySQL tests the expiry once per assignment.
        let nows = if DB::DIALECT == Dialect::MySql { 4 } else { 1 };
        for _ in 0..nows {
            query = query.bind(times.now_ms);
        }
        within(self.pool_bound(), "step record", query.execute(&self.pool)).await?;
        self.step_pooled(scope, key, step, times.now_ms)
            .await?
            .ok_or_else(|| StoreError::Corrupt("a recorded step did not read back".into()))
    }

    /// Every step of `key` in `scope`, oldest first (expired or not): a
    /// step that only started (its call's outcome unknown) as
    /// `<step> (started; its outcome is unknown)` with an empty result.
    pub async fn steps(&self, scope: &str, key: &str) -> Result<Vec<StepRecord>, StoreError> {
        let rows = sqlx::query(&self.sql.steps.list)
            .bind(scope)
            .bind(key)
            .fetch_all(&self.pool);
        let rows = within(self.pool_bound(), "steps read", rows).await?;
        let found: Vec<StepRecord> = rows
            .iter()
            .map(StoreRow::step_record)
            .collect::<Result<_, _>>()?;
        let finished: std::collections::HashSet<String> = found
            .iter()
            .filter(|s| started_step(&s.step).is_none())
            .map(|s| s.step.clone())
            .collect();
        Ok(found
            .into_iter()
            .filter_map(|mut s| match started_step(&s.step) {
                None => Some(s),
                Some(step) if finished.contains(step) => None,
                Some(step) => {
                    s.step = started_label(step);
                    Some(s)
                }
            })
            .collect())
    }

    /// At most `limit` live steps finished before `created_before_ms`
    /// whose key has no live record (see
    /// [`SqlStore::orphaned_steps`](super::SqlStore::orphaned_steps)).
    pub async fn orphaned_steps(
        &self,
        created_before_ms: i64,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<OrphanedStep>, StoreError> {
        let mut query = sqlx::query(&self.sql.steps.orphaned)
            .bind(created_before_ms)
            .bind(now_ms);
        if DB::DIALECT == Dialect::MySql {
            query = query.bind(now_ms);
        }
        let rows = query.bind(i64::from(limit)).fetch_all(&self.pool);
        let rows = within(self.pool_bound(), "orphaned steps", rows).await?;
        let found: Vec<OrphanedStep> = rows
            .iter()
            .map(StoreRow::orphaned_step)
            .collect::<Result<_, _>>()?;
        // A step that started and finished is reported once, finished; one
        // that only started is reported as such (its call's outcome is
        // unknown).
        let finished: std::collections::HashSet<(String, String, String)> = found
            .iter()
            .filter(|o| started_step(&o.step).is_none())
            .map(|o| (o.scope.clone(), o.key.clone(), o.step.clone()))
            .collect();
        Ok(found
            .into_iter()
            .filter_map(|mut o| match started_step(&o.step) {
                None => Some(o),
                Some(step) => {
                    let step = step.to_owned();
                    let done = (o.scope.clone(), o.key.clone(), step.clone());
                    if finished.contains(&done) {
                        return None;
                    }
                    o.step = started_label(&step);
                    Some(o)
                }
            })
            .collect())
    }
}
