//! SQL text of each backend, built once per store from a validated table name.

use super::fence::FenceSql;
use super::side::side_sql;
use super::steps::StepsSql;
use super::{Dialect, TableName};

/// Every statement a store runs. Placeholders are `$n` (Postgres, SQLite) or
/// `?` (MySQL), numbered in the order they appear in the text, so that one
/// bind order serves every dialect; the order of each statement is given on
/// its field and followed by [`SqlBase`](super::base::SqlBase).
#[derive(Debug)]
pub(crate) struct Sql {
    /// Creates the table and its indexes (PostgreSQL: after taking the
    /// migration lock), in order.
    pub ddl: Vec<String>,
    /// fingerprint, source, now, expires, scope, key; writes one row or none.
    pub insert: String,
    /// fingerprint, source, now, expires, scope, key, result: `insert`
    /// with the result (optimistic claims, after the handler).
    pub insert_completed: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub insert_many: String,
    /// scope, keys, fingerprints, sources, now, expires, results: the
    /// optimistic batch claim, every key with its result in one insert
    /// (PostgreSQL; empty elsewhere). Returns the keys it inserted.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub insert_completed_many: String,
    /// scope, key.
    pub existing: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub existing_many: String,
    /// fingerprint, source, now, expires, scope, key, now (the record
    /// must be expired at).
    pub reclaim: String,
    /// `insert` and `reclaim` bounded by a lock wait (one more argument, a
    /// `lock_timeout` value) for their own statement only, restored in the
    /// same statement (PostgreSQL; empty elsewhere). They return how many
    /// rows they wrote.
    pub insert_waiting: String,
    pub reclaim_waiting: String,
    /// `insert_completed` bounded by a lock wait (its eighth argument),
    /// returning how many rows it wrote in `n` (PostgreSQL; empty elsewhere).
    pub insert_completed_waiting: String,
    /// result, scope, key.
    pub complete: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub complete_many: String,
    /// scope, key.
    pub get: String,
    /// now, limit.
    pub purge: String,
    /// scope, now, limit.
    pub purge_scope: String,
    /// The crash counter of suspect deliveries (see
    /// [`SqlStore::bump_attempts`](super::SqlStore::bump_attempts)), in the
    /// attempts table next to the dedup table.
    pub attempts: AttemptsSql,
    /// How an expiry purge of the whole table rotates generations instead
    /// of deleting rows (PostgreSQL's generations layout; `None`
    /// elsewhere).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub rotation: Option<RotationSql>,
    /// The fence table's statements (see [`fence`](super::fence)).
    pub fence: FenceSql,
    /// The steps table's statements (see [`steps`](super::steps)).
    pub steps: StepsSql,
}

/// The statements of a rotation (see `store::postgres::generations`).
/// Index `i` of each pair is generation `i`'s.
#[derive(Debug)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) struct RotationSql {
    /// The advisory lock every claim transaction holds shared, and a
    /// rotation takes exclusively.
    pub fence: i64,
    /// The current generation (`current`, a `smallint`).
    pub current: String,
    /// The current generation and when the table last rotated
    /// (`current`, `rotated_at_ms`).
    pub state: String,
    /// The newest expiry in generation `i` (`bigint`, NULL when empty).
    pub newest: [String; 2],
    /// now: whether generation `i` holds a record live at now.
    pub live: [String; 2],
    /// About how many records generation `i` holds (`bigint`, from the
    /// statistics: counting them would read the whole partition).
    pub rows: [String; 2],
    /// Empties generation `i`.
    pub truncate: [String; 2],
    /// generation, now: makes it the current one.
    pub switch: String,
    /// The partitions, quoted.
    pub partitions: [String; 2],
    /// How many bytes of files a rotation frees per fenced step, at most
    /// (a bigger bucket is a step of its own).
    pub free_per_step: u64,
}

/// The statements on the attempts table: one row per suspect key whose
/// handler was started and has not finished, `(scope, idem_key)` →
/// `attempts`, `expires_at_ms`.
#[derive(Debug)]
pub(crate) struct AttemptsSql {
    /// scope, key, expires, now, expires: inserts the row with 1 attempt,
    /// or adds one to it (starting over at 1 if it had expired at now).
    /// Returns the new count in column `attempts` where the backend has
    /// `RETURNING`; MySQL sets it as `LAST_INSERT_ID` instead.
    pub bump: String,
    /// Reads back the count `bump` set as `LAST_INSERT_ID`, on the same
    /// connection, should the statement's OK packet not carry it (MySQL;
    /// empty elsewhere).
    pub bump_read: String,
    /// scope, key: one attempt fewer (never below 0).
    pub undo: String,
    /// scope, key: deletes the row.
    pub clear: String,
    /// now, limit.
    pub purge: String,
    /// scope, now, limit.
    pub purge_scope: String,
}

pub(crate) const COLS: &str = "scope, idem_key, fingerprint, source, created_at_ms, expires_at_ms";

/// The columns an `insert` writes, in its bind order.
pub(crate) const INSERT_COLS: &str =
    "fingerprint, source, created_at_ms, expires_at_ms, scope, idem_key";

/// Statements shared by the `$n`-placeholder dialects (Postgres and SQLite).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn numbered(t: &str, a: &str, ddl: Vec<String>, purge_tail: &str) -> Sql {
    // The outer test of the expiry keeps a purge from deleting a live
    // record even on a table where a key can have several rows (a plain
    // store left running on a table upgraded to PostgreSQL's generations
    // layout, which has its own statements).
    let purge_of = |t: &str, scope: &str, n: usize| {
        format!(
            "DELETE FROM {t} WHERE (scope, idem_key) IN (SELECT scope, idem_key FROM {t} \
             WHERE {scope}expires_at_ms <= ${n} ORDER BY expires_at_ms LIMIT ${}{purge_tail}) \
             AND expires_at_ms <= ${n}",
            n + 1
        )
    };
    let purge = |scope: &str, n: usize| purge_of(t, scope, n);
    Sql {
        ddl,
        insert: format!(
            "INSERT INTO {t} ({INSERT_COLS}) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (scope, idem_key) DO NOTHING"
        ),
        insert_completed: format!(
            "INSERT INTO {t} ({INSERT_COLS}, result) VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (scope, idem_key) DO NOTHING"
        ),
        insert_many: format!(
            "INSERT INTO {t} ({COLS}) SELECT $1, u.k, u.f, u.s, $5, $6 \
             FROM UNNEST($2::text[], $3::bytea[], $4::text[]) AS u(k, f, s) \
             ON CONFLICT (scope, idem_key) DO NOTHING RETURNING idem_key"
        ),
        insert_completed_many: format!(
            "INSERT INTO {t} ({COLS}, result) SELECT $1, u.k, u.f, u.s, $5, $6, u.r \
             FROM UNNEST($2::text[], $3::bytea[], $4::text[], $7::bytea[]) AS u(k, f, s, r) \
             ON CONFLICT (scope, idem_key) DO NOTHING RETURNING idem_key"
        ),
        existing: format!(
            "SELECT fingerprint, result, expires_at_ms FROM {t} WHERE scope = $1 AND idem_key = $2"
        ),
        existing_many: format!(
            "SELECT idem_key, fingerprint, result, expires_at_ms FROM {t} \
             WHERE scope = $1 AND idem_key = ANY($2::text[])"
        ),
        reclaim: format!(
            "UPDATE {t} SET fingerprint = $1, source = $2, created_at_ms = $3, expires_at_ms = $4, \
             result = NULL WHERE scope = $5 AND idem_key = $6 AND expires_at_ms <= $7"
        ),
        insert_waiting: String::new(),
        reclaim_waiting: String::new(),
        insert_completed_waiting: String::new(),
        complete: format!("UPDATE {t} SET result = $1 WHERE scope = $2 AND idem_key = $3"),
        complete_many: format!(
            "UPDATE {t} AS t SET result = u.r FROM UNNEST($2::text[], $3::bytea[]) AS u(k, r) \
             WHERE t.scope = $1 AND t.idem_key = u.k"
        ),
        get: format!("SELECT {COLS}, result FROM {t} WHERE scope = $1 AND idem_key = $2"),
        purge: purge("", 1),
        purge_scope: purge("scope = $1 AND ", 2),
        attempts: AttemptsSql {
            // The alias: PostgreSQL's `DO UPDATE` sees both the row and
            // `excluded`, so bare column names would be ambiguous.
            bump: format!(
                "INSERT INTO {a} AS a (scope, idem_key, attempts, expires_at_ms) \
                 VALUES ($1, $2, 1, $3) ON CONFLICT (scope, idem_key) DO UPDATE SET \
                 attempts = CASE WHEN a.expires_at_ms <= $4 THEN 1 ELSE a.attempts + 1 END, \
                 expires_at_ms = $5 RETURNING CAST(attempts AS BIGINT) AS attempts"
            ),
            bump_read: String::new(),
            undo: format!(
                "UPDATE {a} SET attempts = attempts - 1 \
                 WHERE scope = $1 AND idem_key = $2 AND attempts > 0"
            ),
            clear: format!("DELETE FROM {a} WHERE scope = $1 AND idem_key = $2"),
            purge: purge_of(a, "", 1),
            purge_scope: purge_of(a, "scope = $1 AND ", 2),
        },
        rotation: None,
        fence: FenceSql::default(),
        steps: StepsSql::default(),
    }
}

/// The DDL of the attempts table `a` of dedup table `table`, with the
/// column types of a backend (`text`, `bigint`, `integer`) and a table
/// suffix (SQLite's `WITHOUT ROWID`).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn attempts_ddl(table: &TableName, a: &str, types: (&str, &str, &str), tail: &str) -> [String; 2] {
    let (text, bigint, int) = types;
    [
        format!(
            "CREATE TABLE IF NOT EXISTS {a} (\
             scope {text} NOT NULL, idem_key {text} NOT NULL, attempts {int} NOT NULL, \
             expires_at_ms {bigint} NOT NULL, PRIMARY KEY (scope, idem_key)){tail}"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {} ON {a} (expires_at_ms)",
            table.index("attempts_exp", '"')
        ),
    ]
}

/// The DDL of a PostgreSQL dedup table's plain side tables (attempts,
/// fence, steps), whatever the dedup table's layout.
#[cfg(feature = "postgres")]
pub(crate) fn pg_side_ddl(table: &TableName) -> Vec<String> {
    let a = table.attempts().quoted('"');
    let mut ddl = attempts_ddl(table, &a, ("text", "bigint", "integer"), "").to_vec();
    ddl.extend(side_sql(Dialect::Postgres, table).0);
    ddl
}

impl Sql {
    #[cfg(feature = "postgres")]
    pub fn postgres(table: &TableName) -> Self {
        let t = table.quoted('"');
        let a = table.attempts().quoted('"');
        let mut ddl = vec![
            // Concurrent `CREATE TABLE IF NOT EXISTS` can still collide in
            // the catalog; serialize migrations of this table with an
            // advisory lock, held until the DDL's transaction ends. The
            // validated name holds no quote.
            format!("SELECT pg_advisory_xact_lock(hashtext('onceonly:{table}'))"),
            // A table of the generations layout stays one: the plain
            // statements would fail on it at the first claim, not here.
            format!(
                "DO $onceonly$ BEGIN IF EXISTS (SELECT 1 FROM pg_class \
                 WHERE oid = to_regclass('{t}') AND relkind = 'p') THEN RAISE EXCEPTION \
                 'onceonly: % has the generations layout: open it with PgStore::generations(true)', \
                 '{table}'; END IF; END $onceonly$"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 scope text NOT NULL, idem_key text NOT NULL, fingerprint bytea, result bytea, \
                 source text, created_at_ms bigint NOT NULL, expires_at_ms bigint NOT NULL, \
                 PRIMARY KEY (scope, idem_key))"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {t} (expires_at_ms)",
                table.index("expires_at", '"')
            ),
        ];
        // The attempts table; the fence and steps tables come with
        // `with_side`, as on the other backends (`pg_side_ddl`, which has
        // them too, is the generations layout's).
        ddl.extend(attempts_ddl(table, &a, ("text", "bigint", "integer"), ""));
        // SKIP LOCKED: a purge never waits on rows a claim is reclaiming.
        let mut sql = numbered(&t, &a, ddl, " FOR UPDATE SKIP LOCKED");
        sql.insert_waiting = pg_waiting(
            &format!(
                "INSERT INTO {t} ({INSERT_COLS}) \
                 SELECT $1::bytea, $2::text, $3::bigint, $4::bigint, $5::text, $6::text FROM w \
                 ON CONFLICT (scope, idem_key) DO NOTHING"
            ),
            "$7",
        );
        sql.insert_completed_waiting = pg_waiting(
            &format!(
                "INSERT INTO {t} ({INSERT_COLS}, result) \
                 SELECT $1::bytea, $2::text, $3::bigint, $4::bigint, $5::text, $6::text, \
                 $7::bytea FROM w ON CONFLICT (scope, idem_key) DO NOTHING"
            ),
            "$8",
        );
        sql.reclaim_waiting = pg_waiting(
            &format!(
                "UPDATE {t} SET fingerprint = $1::bytea, source = $2::text, \
                 created_at_ms = $3::bigint, expires_at_ms = $4::bigint, result = NULL FROM w \
                 WHERE scope = $5::text AND idem_key = $6::text AND expires_at_ms <= $7::bigint"
            ),
            "$8",
        );
        sql.with_side(Dialect::Postgres, table)
    }

    #[cfg(feature = "sqlite")]
    pub fn sqlite(table: &TableName) -> Self {
        let t = table.quoted('"');
        let a = table.attempts().quoted('"');
        let mut ddl = vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 scope TEXT NOT NULL, idem_key TEXT NOT NULL, fingerprint BLOB, result BLOB, \
                 source TEXT, created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, \
                 PRIMARY KEY (scope, idem_key)) WITHOUT ROWID"
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {t} (expires_at_ms)",
                table.index("expires_at", '"')
            ),
        ];
        ddl.extend(attempts_ddl(
            table,
            &a,
            ("TEXT", "INTEGER", "INTEGER"),
            " WITHOUT ROWID",
        ));
        numbered(&t, &a, ddl, "").with_side(Dialect::Sqlite, table)
    }

    #[cfg(feature = "mysql")]
    pub fn mysql(table: &TableName) -> Self {
        let t = table.quoted('`');
        let a = table.attempts().quoted('`');
        // VARBINARY keys: byte-exact comparison. The default collations of
        // MySQL/MariaDB are case-insensitive and ignore trailing spaces, which
        // would make `abc`, `ABC` and `abc ` one key.
        let ddl = vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (\
                 scope VARBINARY(128) NOT NULL, idem_key VARBINARY(255) NOT NULL, \
                 fingerprint VARBINARY(32) NULL, result LONGBLOB NULL, source VARBINARY(512) NULL, \
                 created_at_ms BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL, \
                 PRIMARY KEY (scope, idem_key), KEY {} (expires_at_ms)\
                 ) ENGINE=InnoDB",
                table.index("expires_at", '`')
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {a} (\
                 scope VARBINARY(128) NOT NULL, idem_key VARBINARY(255) NOT NULL, \
                 attempts INT NOT NULL, expires_at_ms BIGINT NOT NULL, \
                 PRIMARY KEY (scope, idem_key), KEY {} (expires_at_ms)\
                 ) ENGINE=InnoDB",
                table.index("attempts_exp", '`')
            ),
        ];
        let purge_of = |t: &str, scope: &str| {
            format!(
                "DELETE FROM {t} WHERE {scope}expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?"
            )
        };
        let purge = |scope: &str| purge_of(&t, scope);
        Sql {
            ddl,
            insert: format!("INSERT INTO {t} ({INSERT_COLS}) VALUES (?, ?, ?, ?, ?, ?)"),
            insert_completed: format!(
                "INSERT INTO {t} ({INSERT_COLS}, result) VALUES (?, ?, ?, ?, ?, ?, ?)"
            ),
            insert_many: String::new(),
            insert_completed_many: String::new(),
            existing: format!(
                "SELECT fingerprint, result, expires_at_ms FROM {t} WHERE scope = ? AND idem_key = ?"
            ),
            existing_many: String::new(),
            reclaim: format!(
                "UPDATE {t} SET fingerprint = ?, source = ?, created_at_ms = ?, expires_at_ms = ?, \
                 result = NULL WHERE scope = ? AND idem_key = ? AND expires_at_ms <= ?"
            ),
            insert_waiting: String::new(),
            reclaim_waiting: String::new(),
            insert_completed_waiting: String::new(),
            complete: format!("UPDATE {t} SET result = ? WHERE scope = ? AND idem_key = ?"),
            complete_many: String::new(),
            get: format!("SELECT {COLS}, result FROM {t} WHERE scope = ? AND idem_key = ?"),
            purge: purge(""),
            purge_scope: purge("scope = ? AND "),
            attempts: AttemptsSql {
                // No `RETURNING` before MariaDB 10.5, none in MySQL: the new
                // count is set as `LAST_INSERT_ID`, which the statement's OK
                // packet carries (no second round trip). The count is
                // assigned before the expiry, so it reads the old expiry.
                bump: format!(
                    "INSERT INTO {a} (scope, idem_key, attempts, expires_at_ms) \
                     VALUES (?, ?, LAST_INSERT_ID(1), ?) ON DUPLICATE KEY UPDATE \
                     attempts = LAST_INSERT_ID(IF(expires_at_ms <= ?, 1, attempts + 1)), \
                     expires_at_ms = ?"
                ),
                bump_read: "SELECT CAST(LAST_INSERT_ID() AS SIGNED) AS attempts".to_owned(),
                undo: format!(
                    "UPDATE {a} SET attempts = attempts - 1 \
                     WHERE scope = ? AND idem_key = ? AND attempts > 0"
                ),
                clear: format!("DELETE FROM {a} WHERE scope = ? AND idem_key = ?"),
                purge: purge_of(&a, ""),
                purge_scope: purge_of(&a, "scope = ? AND "),
            },
            rotation: None,
            fence: FenceSql::default(),
            steps: StepsSql::default(),
        }
        .with_side(Dialect::MySql, table)
    }

    /// The side tables' DDL (after the dedup table's) and statements.
    fn with_side(mut self, dialect: Dialect, table: &TableName) -> Self {
        let (ddl, fence, steps) = side_sql(dialect, table);
        self.ddl.extend(ddl);
        self.fence = fence;
        self.steps = steps;
        self
    }
}

/// `write` bounded by a lock wait of `bound` (a parameter) for its own
/// statement only, returning how many rows it wrote in `n` (PostgreSQL).
/// The bound is set before the write runs (the write must read a row of
/// `w`) and the saved value restored after it ended (the outer select
/// needs the count of its rows): no extra round trips.
#[cfg(feature = "postgres")]
pub(crate) fn pg_waiting(write: &str, bound: &str) -> String {
    format!(
        "WITH w AS (SELECT current_setting('lock_timeout') AS saved, \
         set_config('lock_timeout', {bound}::text, true) AS bound), \
         s AS ({write} RETURNING 1) \
         SELECT c.n, set_config('lock_timeout', w.saved, true) \
         FROM w, (SELECT count(*) AS n FROM s) AS c"
    )
}

/// A PostgreSQL `lock_timeout` value for `wait`, at least 1 ms (0 would
/// mean "no limit").
pub(crate) fn lock_timeout_value(wait: std::time::Duration) -> String {
    format!("{}ms", wait.as_millis().clamp(1, i32::MAX as u128))
}
