//! The database checks: tables and indexes, the connecting role's
//! privileges, whether the server takes writes, and its clock.

use onceonly::store::TableName;

use super::finding::Finding;

/// A table the doctor checks, with the DDL that creates it.
pub struct Checked {
    /// The table.
    pub name: TableName,
    /// The DDL that creates it and its indexes.
    pub ddl: Vec<String>,
    /// What it is for (PostgreSQL's generations layout needs different
    /// grants on the dedup table's partitions and the outbox's).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub role: TableRole,
}

/// What a checked table is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableRole {
    /// The dedup table.
    Dedup,
    /// A side table of the dedup table: attempts, fence, steps.
    Attempts,
    /// The outbox.
    Outbox,
}

impl TableRole {
    /// What a rotation of this table's generations layout (PostgreSQL)
    /// does to each generation itself: the dedup table's reads whether a
    /// record is live and truncates it; the outbox's also moves its unsent
    /// rows out (and locks it, which any of these grants).
    #[cfg(feature = "postgres")]
    fn generation_needs(self) -> &'static [&'static str] {
        match self {
            Self::Outbox => &["SELECT", "DELETE", "TRUNCATE"],
            Self::Dedup | Self::Attempts => &["SELECT", "TRUNCATE"],
        }
    }
}

/// The index names a backend's DDL creates on `on` (the table as the DDL
/// quotes it: `CREATE INDEX IF NOT EXISTS "name" ON "table" ...`), unquoted.
pub fn index_names(ddl: &[String], on: &str) -> Vec<String> {
    ddl.iter()
        .filter_map(|s| {
            let rest = s.split("CREATE INDEX IF NOT EXISTS ").nth(1)?;
            let (name, target) = rest.split_once(" ON ")?;
            target
                .starts_with(&format!("{on} "))
                .then(|| name.trim_matches(|c| c == '"' || c == '`').to_owned())
        })
        .collect()
}

/// The finding on `table`'s expected indexes, given those present.
pub fn indexes_finding(table: &TableName, expected: &[String], present: &[String]) -> Finding {
    let missing: Vec<&String> = expected.iter().filter(|i| !present.contains(i)).collect();
    if missing.is_empty() {
        Finding::ok("indexes", format!("{table}: {}", expected.join(", ")))
    } else {
        Finding::fail(
            "indexes",
            format!(
                "{table} lacks {}: purges and claims scan the table",
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            "onceonly migrate (creates what is missing)",
        )
    }
}

/// A PostgreSQL role as a `GRANT` names it: a quoted identifier.
#[cfg(feature = "postgres")]
pub fn pg_grantee(role: &str) -> String {
    format!("\"{}\"", role.replace('"', "\"\""))
}

/// A MySQL account (`CURRENT_USER()`'s `user@host`) as a `GRANT` names
/// it: `'user'@'host'`.
#[cfg(feature = "mysql")]
pub fn mysql_grantee(account: &str) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "''"));
    match account.rsplit_once('@') {
        Some((user, host)) => format!("{}@{}", quote(user), quote(host)),
        None => quote(account),
    }
}

/// The finding on the privileges `role` (its name as shown) lacks on
/// `table`; the fix grants them to `grantee` (the role quoted for `GRANT`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn privileges_finding(
    role: &str,
    grantee: &str,
    table: &str,
    missing: &[&str],
    needed: &[&str],
) -> Finding {
    if missing.is_empty() {
        Finding::ok(
            "privileges",
            format!("{role} may {} on {table}", needed.join(", ")),
        )
    } else {
        Finding::fail(
            "privileges",
            format!(
                "{role} lacks {} on {table}: claims, purges or the relay fail and deliveries wait",
                missing.join(", ")
            ),
            format!("GRANT {} ON {table} TO {grantee}", missing.join(", ")),
        )
    }
}

/// What the connecting role lacks for the rotations of a table of
/// PostgreSQL's generations layout.
#[cfg(feature = "postgres")]
pub struct LayoutPrivileges {
    /// How many partitions the table has (generations and their buckets).
    pub partitions: usize,
    /// Each relation (quoted, qualified) the role lacks privileges on, with
    /// those privileges, in the order of the grants to suggest.
    pub missing: Vec<(String, Vec<String>)>,
}

/// The finding on the privileges a generations table's rotations need.
/// The fix is one `GRANT` per set of privileges, naming every relation
/// that lacks that set.
#[cfg(feature = "postgres")]
pub fn layout_privileges_finding(role: &str, table: &str, layout: &LayoutPrivileges) -> Finding {
    if layout.missing.is_empty() {
        return Finding::ok(
            "privileges",
            format!(
                "{role} may rotate {table} (generations layout: its control table and {} \
                 partitions)",
                layout.partitions
            ),
        );
    }
    let mut grants: Vec<(String, Vec<&str>)> = Vec::new();
    for (relation, lacks) in &layout.missing {
        let privileges = lacks.join(", ");
        match grants.iter_mut().find(|(p, _)| *p == privileges) {
            Some((_, relations)) => relations.push(relation),
            None => grants.push((privileges, vec![relation])),
        }
    }
    let grantee = pg_grantee(role);
    let lacks = grants
        .iter()
        .map(|(privileges, relations)| format!("{privileges} on {}", relations.join(", ")))
        .collect::<Vec<_>>()
        .join("; ");
    Finding::fail(
        "privileges",
        format!(
            "{role} lacks {lacks}: {table} has the generations layout, whose claims read its \
             control table and whose purge rotates (truncates) its partitions; without them \
             claims or purges fail and deliveries wait or the table grows"
        ),
        grants
            .iter()
            .map(|(privileges, relations)| {
                format!(
                    "GRANT {privileges} ON {} TO {grantee}",
                    relations.join(", ")
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    )
}

/// The finding on the clock: the database's `db_ms` read between `before`
/// and `after` on the host (ms since the Unix epoch).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn clock_finding(db_ms: i64, before: i64, after: i64) -> Finding {
    let host = before + (after - before) / 2;
    let skew = db_ms - host;
    let detail = format!("database clock {skew:+} ms from this host's");
    if skew.abs() > 10_000 {
        Finding::fail(
            "clock",
            detail,
            "synchronise both clocks (NTP): expiry and retention are decided by the hosts' \
             clocks, purges and statistics by the same numbers",
        )
    } else if skew.abs() > 1_000 {
        Finding::warn("clock", detail, "synchronise both clocks (NTP)")
    } else {
        Finding::ok("clock", detail)
    }
}

/// Now on the host, ms since the Unix epoch.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub fn host_now() -> i64 {
    crate::time::now_ms()
}

#[cfg(feature = "postgres")]
pub mod postgres {
    //! PostgreSQL: the catalog and `has_table_privilege`.

    use onceonly::store::TableName;
    use sqlx::PgPool;

    use super::{
        Checked, Finding, clock_finding, index_names, indexes_finding, layout_privileges_finding,
        pg_grantee, privileges_finding,
    };

    const NEEDED: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

    /// Indexes, privileges, writability and clock of `tables` (with the
    /// DDL that creates them).
    pub async fn check(pool: &PgPool, tables: &[Checked]) -> Vec<Finding> {
        let mut out = Vec::new();
        let role: String = match sqlx::query_scalar("SELECT current_user::text")
            .fetch_one(pool)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                out.push(Finding::fail(
                    "connect",
                    e.to_string(),
                    "check --database-url",
                ));
                return out;
            }
        };
        for Checked {
            name: table,
            ddl,
            role: table_role,
        } in tables
        {
            let schema = table.schema().map(str::to_owned);
            let present: Vec<String> = sqlx::query_scalar(
                "SELECT indexname::text FROM pg_indexes \
                 WHERE schemaname = COALESCE($1, current_schema()) AND tablename = $2",
            )
            .bind(&schema)
            .bind(table.table())
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            let name = table.quoted('"');
            out.push(indexes_finding(table, &index_names(ddl, &name), &present));
            let mut missing = Vec::new();
            for privilege in NEEDED {
                let has: Result<bool, _> =
                    sqlx::query_scalar("SELECT has_table_privilege(current_user, $1, $2)")
                        .bind(&name)
                        .bind(privilege)
                        .fetch_one(pool)
                        .await;
                if !has.unwrap_or(false) {
                    missing.push(privilege);
                }
            }
            out.push(privileges_finding(
                &role,
                &pg_grantee(&role),
                &name,
                &missing,
                &NEEDED,
            ));
            match layout_missing(pool, table, table_role.generation_needs()).await {
                Ok(Some(layout)) => out.push(layout_privileges_finding(&role, &name, &layout)),
                Ok(None) => {}
                Err(e) => out.push(Finding::fail(
                    "privileges",
                    format!("{name}'s partitions: {e}"),
                    "check --database-url",
                )),
            }
        }
        out.push(writable(pool).await);
        let before = super::host_now();
        let db: Result<i64, _> =
            sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
                .fetch_one(pool)
                .await;
        let after = super::host_now();
        if let Ok(db) = db {
            out.push(clock_finding(db, before, after));
        }
        out
    }

    /// On a table of the generations layout, the privileges its rotation
    /// needs that the connecting role lacks: `generation_needs` on each
    /// generation, TRUNCATE on each of their buckets (a rotation empties a
    /// big generation bucket by bucket), SELECT and UPDATE on the control
    /// table (claims read it, the rotation's switch updates it). `None`
    /// for a table that is not partitioned.
    async fn layout_missing(
        pool: &PgPool,
        table: &TableName,
        generation_needs: &[&str],
    ) -> Result<Option<super::LayoutPrivileges>, sqlx::Error> {
        let partitions: Vec<(String, i32, Vec<String>)> = sqlx::query_as(
            "SELECT format('%I.%I', n.nspname, c.relname), p.level, \
             ARRAY(SELECT w FROM unnest(CASE WHEN p.level = 1 THEN $2::text[] \
             ELSE ARRAY['TRUNCATE'] END) AS w \
             WHERE NOT has_table_privilege(current_user, p.relid, w)) \
             FROM pg_partition_tree(to_regclass($1)) AS p \
             JOIN pg_class c ON c.oid = p.relid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE p.level > 0 ORDER BY p.level, c.relname",
        )
        .bind(table.quoted('"'))
        .bind(generation_needs)
        .fetch_all(pool)
        .await?;
        if partitions.is_empty() {
            return Ok(None);
        }
        let control: Option<(String, Vec<String>)> = sqlx::query_as(
            "SELECT format('%I.%I', n.nspname, c.relname), \
             ARRAY(SELECT w FROM unnest(ARRAY['SELECT', 'UPDATE']) AS w \
             WHERE NOT has_table_privilege(current_user, c.oid, w)) \
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = to_regclass($1)",
        )
        .bind(table.generation_control().quoted('"'))
        .fetch_optional(pool)
        .await?;
        let partition_count = partitions.len();
        let mut missing: Vec<(String, Vec<String>)> = partitions
            .into_iter()
            .filter(|(_, _, lacks)| !lacks.is_empty())
            .map(|(name, _, lacks)| (name, lacks))
            .collect();
        if let Some(control) = control.filter(|(_, lacks)| !lacks.is_empty()) {
            missing.insert(0, control);
        }
        Ok(Some(super::LayoutPrivileges {
            partitions: partition_count,
            missing,
        }))
    }

    async fn writable(pool: &PgPool) -> Finding {
        let row: Result<(bool, String, String), _> = sqlx::query_as(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), \
             current_database()::text",
        )
        .fetch_one(pool)
        .await;
        match row {
            Ok((true, _, _)) => Finding::fail(
                "writable",
                "the server is a read-only standby (pg_is_in_recovery): every claim fails and \
                 deliveries wait",
                "point --database-url (and the services) at the primary",
            ),
            Ok((false, read_only, db)) if read_only == "on" => Finding::fail(
                "writable",
                format!(
                    "sessions of database {db} are read-only (transaction_read_only = on): every \
                     claim fails and deliveries wait"
                ),
                format!(
                    "ALTER DATABASE {db} SET default_transaction_read_only = off (or the role's \
                     setting), or point --database-url at the primary"
                ),
            ),
            Ok(_) => Finding::ok("writable", "the server takes writes"),
            Err(e) => Finding::fail("writable", e.to_string(), "check --database-url"),
        }
    }
}

#[cfg(feature = "mysql")]
pub mod mysql {
    //! MySQL and MariaDB: `information_schema`, and privileges probed with
    //! statements that touch no row, in a transaction rolled back.

    use sqlx::MySqlPool;

    use super::{
        Checked, Finding, clock_finding, index_names, indexes_finding, mysql_grantee,
        privileges_finding,
    };

    const NEEDED: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

    /// Indexes, privileges, writability and clock of `tables`.
    pub async fn check(pool: &MySqlPool, tables: &[Checked]) -> Vec<Finding> {
        let mut out = Vec::new();
        let role: String = match sqlx::query_scalar("SELECT CURRENT_USER()")
            .fetch_one(pool)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                out.push(Finding::fail(
                    "connect",
                    e.to_string(),
                    "check --database-url",
                ));
                return out;
            }
        };
        for Checked {
            name: table, ddl, ..
        } in tables
        {
            let present: Vec<String> = sqlx::query_scalar(
                "SELECT DISTINCT CAST(index_name AS CHAR) FROM information_schema.statistics \
                 WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?",
            )
            .bind(table.schema())
            .bind(table.table())
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            let name = table.quoted('`');
            out.push(indexes_finding(table, &index_names(ddl, &name), &present));
            let probes = [
                ("SELECT", format!("SELECT 1 FROM {name} LIMIT 0")),
                (
                    "INSERT",
                    format!("INSERT INTO {name} SELECT * FROM {name} WHERE 1 = 0"),
                ),
                (
                    "UPDATE",
                    format!("UPDATE {name} SET scope = scope WHERE 1 = 0"),
                ),
                ("DELETE", format!("DELETE FROM {name} WHERE 1 = 0")),
            ];
            let mut missing = Vec::new();
            if let Ok(mut tx) = pool.begin().await {
                for (privilege, sql) in &probes {
                    // 1142: command denied to user for table.
                    if let Err(sqlx::Error::Database(e)) = sqlx::query(sql).execute(&mut *tx).await
                        && e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                            .is_some_and(|m| m.number() == 1142)
                    {
                        missing.push(*privilege);
                    }
                }
                let _ = tx.rollback().await;
            }
            out.push(privileges_finding(
                &role,
                &mysql_grantee(&role),
                &name,
                &missing,
                &NEEDED,
            ));
        }
        let read_only: Result<i64, _> = sqlx::query_scalar("SELECT @@global.read_only + 0")
            .fetch_one(pool)
            .await;
        out.push(match read_only {
            Ok(0) => Finding::ok("writable", "the server takes writes"),
            Ok(_) => Finding::fail(
                "writable",
                "the server is read-only (read_only = ON): every claim fails and deliveries wait",
                "SET GLOBAL read_only = OFF on the primary, or point --database-url at it",
            ),
            Err(e) => Finding::fail("writable", e.to_string(), "check --database-url"),
        });
        let before = super::host_now();
        let db: Result<i64, _> =
            sqlx::query_scalar("SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
                .fetch_one(pool)
                .await;
        let after = super::host_now();
        if let Ok(db) = db {
            out.push(clock_finding(db, before, after));
        }
        out
    }
}

#[cfg(feature = "sqlite")]
pub mod sqlite {
    //! SQLite: its catalog; no roles, no server clock.

    use sqlx::SqlitePool;

    use super::{Checked, Finding, index_names, indexes_finding};

    /// Indexes and writability of `tables`.
    pub async fn check(pool: &SqlitePool, tables: &[Checked]) -> Vec<Finding> {
        let mut out = Vec::new();
        for Checked {
            name: table, ddl, ..
        } in tables
        {
            let present: Vec<String> = sqlx::query_scalar(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?",
            )
            .bind(table.table())
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            let on = table.quoted('"');
            out.push(indexes_finding(table, &index_names(ddl, &on), &present));
        }
        let query_only: Result<i64, _> = sqlx::query_scalar("PRAGMA query_only")
            .fetch_one(pool)
            .await;
        out.push(match query_only {
            Ok(0) => Finding::ok("writable", "the database file takes writes"),
            Ok(_) => Finding::fail(
                "writable",
                "the connection is query-only",
                "open the database without query_only / mode=ro",
            ),
            Err(e) => Finding::fail("writable", e.to_string(), "check --database-url"),
        });
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn index_names_come_from_the_ddl() {
        let ddl = vec![
            "CREATE TABLE IF NOT EXISTS \"k\" (a int)".to_owned(),
            "CREATE INDEX IF NOT EXISTS \"k_expires_at\" ON \"k\" (expires_at_ms)".to_owned(),
            "CREATE INDEX IF NOT EXISTS `o_pending` ON `o` (order_key, id)".to_owned(),
        ];
        assert_eq!(super::index_names(&ddl, "\"k\""), ["k_expires_at"]);
        assert_eq!(super::index_names(&ddl, "`o`"), ["o_pending"]);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn layout_grants_group_relations_by_what_they_lack() {
        use super::super::finding::Status;
        let v = |s: &[&str]| s.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let layout = super::LayoutPrivileges {
            partitions: 6,
            missing: vec![
                ("public.k_generation".to_owned(), v(&["SELECT", "UPDATE"])),
                ("public.k_g0".to_owned(), v(&["TRUNCATE"])),
                ("public.k_g1".to_owned(), v(&["TRUNCATE"])),
                ("public.k_g0_b0".to_owned(), v(&["TRUNCATE"])),
            ],
        };
        let f = super::layout_privileges_finding("app", "\"k\"", &layout);
        assert_eq!(f.status, Status::Fail);
        assert_eq!(
            f.fix.as_deref(),
            Some(
                "GRANT SELECT, UPDATE ON public.k_generation TO \"app\"; \
                 GRANT TRUNCATE ON public.k_g0, public.k_g1, public.k_g0_b0 TO \"app\""
            )
        );
        let fine = super::LayoutPrivileges {
            partitions: 6,
            missing: Vec::new(),
        };
        let f = super::layout_privileges_finding("app", "\"k\"", &fine);
        assert_eq!(f.status, Status::Ok);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_grantees_are_quoted_identifiers() {
        assert_eq!(super::pg_grantee("app"), "\"app\"");
        assert_eq!(super::pg_grantee("We\"ird role"), "\"We\"\"ird role\"");
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_grantees_are_quoted_accounts() {
        assert_eq!(super::mysql_grantee("app@%"), "'app'@'%'");
        assert_eq!(
            super::mysql_grantee("o'neil@10.0.0.1"),
            "'o''neil'@'10.0.0.1'"
        );
        assert_eq!(super::mysql_grantee("a@b@host"), "'a@b'@'host'");
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn clock_skew_thresholds() {
        use super::super::finding::Status;
        assert_eq!(super::clock_finding(1_000, 900, 1_100).status, Status::Ok);
        assert_eq!(super::clock_finding(5_000, 0, 0).status, Status::Warn);
        assert_eq!(super::clock_finding(-20_000, 0, 0).status, Status::Fail);
    }
}
