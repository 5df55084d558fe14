//! SQL text of each backend, built once per store from a validated table name.

use super::TableName;

/// Every statement a store runs. Placeholders are `$n` (Postgres, SQLite) or `?` (MySQL).
#[derive(Debug)]
pub(crate) struct Sql {
    pub ddl: Vec<String>,
    pub insert: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub insert_many: String,
    pub existing: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub existing_many: String,
    pub reclaim: String,
    /// `insert` and `reclaim` bounded by a lock wait (`$7`, a
    /// `lock_timeout` value) for their own statement only, restored in the
    /// same statement (PostgreSQL; empty elsewhere). They return how many
    /// rows they wrote.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub insert_waiting: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub reclaim_waiting: String,
    pub complete: String,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub complete_many: String,
    pub get: String,
    pub purge: String,
    pub purge_scope: String,
}

const COLS: &str = "scope, idem_key, fingerprint, source, created_at_ms, expires_at_ms";

/// Statements shared by the `$n`-placeholder dialects (Postgres and SQLite).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn numbered(t: &str, ddl: Vec<String>, purge_tail: &str) -> Sql {
    let purge = |scope: &str| {
        format!(
            "DELETE FROM {t} WHERE (scope, idem_key) IN (SELECT scope, idem_key FROM {t} \
             WHERE expires_at_ms <= $1{scope} ORDER BY expires_at_ms LIMIT $2{purge_tail})"
        )
    };
    Sql {
        ddl,
        insert: format!(
            "INSERT INTO {t} ({COLS}) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (scope, idem_key) DO NOTHING RETURNING 1"
        ),
        insert_many: format!(
            "INSERT INTO {t} ({COLS}) SELECT $1, u.k, u.f, u.s, $5, $6 \
             FROM UNNEST($2::text[], $3::bytea[], $4::text[]) AS u(k, f, s) \
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
            "UPDATE {t} SET fingerprint = $3, source = $4, created_at_ms = $5, expires_at_ms = $6, \
             result = NULL WHERE scope = $1 AND idem_key = $2 AND expires_at_ms <= $5"
        ),
        insert_waiting: String::new(),
        reclaim_waiting: String::new(),
        complete: format!("UPDATE {t} SET result = $3 WHERE scope = $1 AND idem_key = $2"),
        complete_many: format!(
            "UPDATE {t} AS t SET result = u.r FROM UNNEST($2::text[], $3::bytea[]) AS u(k, r) \
             WHERE t.scope = $1 AND t.idem_key = u.k"
        ),
        get: format!("SELECT {COLS}, result FROM {t} WHERE scope = $1 AND idem_key = $2"),
        purge: purge(""),
        purge_scope: purge(" AND scope = $3"),
    }
}

impl Sql {
    #[cfg(feature = "postgres")]
    pub fn postgres(table: &TableName) -> Self {
        let t = table.quoted('"');
        let ddl = vec![
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
        // SKIP LOCKED: a purge never waits on rows a claim is reclaiming.
        let mut sql = numbered(&t, ddl, " FOR UPDATE SKIP LOCKED");
        // The bound is set before the write runs (the write reads its row
        // from `w`) and the saved value restored after it ended (the outer
        // select needs the count of its rows): no extra round trips.
        let waiting = |write: &str| {
            format!(
                "WITH w AS (SELECT current_setting('lock_timeout') AS saved, \
                 set_config('lock_timeout', $7::text, true) AS bound), \
                 s AS ({write} RETURNING 1) \
                 SELECT c.n, set_config('lock_timeout', w.saved, true) \
                 FROM w, (SELECT count(*) AS n FROM s) AS c"
            )
        };
        sql.insert_waiting = waiting(&format!(
            "INSERT INTO {t} ({COLS}) \
             SELECT $1::text, $2::text, $3::bytea, $4::text, $5::bigint, $6::bigint FROM w \
             ON CONFLICT (scope, idem_key) DO NOTHING"
        ));
        sql.reclaim_waiting = waiting(&format!(
            "UPDATE {t} SET fingerprint = $3::bytea, source = $4::text, created_at_ms = $5::bigint, \
             expires_at_ms = $6::bigint, result = NULL FROM w \
             WHERE scope = $1::text AND idem_key = $2::text AND expires_at_ms <= $5::bigint"
        ));
        sql
    }

    #[cfg(feature = "sqlite")]
    pub fn sqlite(table: &TableName) -> Self {
        let t = table.quoted('"');
        let ddl = vec![
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
        numbered(&t, ddl, "")
    }

    #[cfg(feature = "mysql")]
    pub fn mysql(table: &TableName) -> Self {
        let t = table.quoted('`');
        // VARBINARY keys: byte-exact comparison. The default collations of
        // MySQL/MariaDB are case-insensitive and ignore trailing spaces, which
        // would make `abc`, `ABC` and `abc ` one key.
        let ddl = vec![format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
             scope VARBINARY(128) NOT NULL, idem_key VARBINARY(255) NOT NULL, \
             fingerprint VARBINARY(32) NULL, result LONGBLOB NULL, source VARBINARY(512) NULL, \
             created_at_ms BIGINT NOT NULL, expires_at_ms BIGINT NOT NULL, \
             PRIMARY KEY (scope, idem_key), KEY {} (expires_at_ms)\
             ) ENGINE=InnoDB",
            table.index("expires_at", '`')
        )];
        let purge = |scope: &str| {
            format!(
                "DELETE FROM {t} WHERE {scope}expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?"
            )
        };
        Sql {
            ddl,
            insert: format!("INSERT INTO {t} ({COLS}) VALUES (?, ?, ?, ?, ?, ?)"),
            insert_many: String::new(),
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
            complete: format!("UPDATE {t} SET result = ? WHERE scope = ? AND idem_key = ?"),
            complete_many: String::new(),
            get: format!("SELECT {COLS}, result FROM {t} WHERE scope = ? AND idem_key = ?"),
            purge: purge(""),
            purge_scope: purge("scope = ? AND "),
        }
    }
}

/// A PostgreSQL `lock_timeout` value for `wait`, at least 1 ms (0 would
/// mean "no limit").
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn lock_timeout_value(wait: std::time::Duration) -> String {
    format!("{}ms", wait.as_millis().clamp(1, i32::MAX as u128))
}
