//! PostgreSQL's generations layout: a dedup table that is purged by
//! `TRUNCATE`, never by `DELETE` ([`PgStore::generations`]).
//!
//! # Layout
//!
//! The dedup table is partitioned by list on a `generation` column into two
//! partitions, `<table>_g0` and `<table>_g1`, with the primary key
//! `(scope, idem_key, generation)`. A one-row control table,
//! `<table>_generation`, names the *current* generation:
//!
//! - a claim inserts into the current generation only, and only if the key
//!   has no live record in the other one (`NOT EXISTS`, in the insert
//!   statement itself); the current generation's unique index settles races
//!   between claims as in the plain layout;
//! - a read returns the key's newest record (the live one, if any);
//! - a reclaim of an expired record and a result update touch the current
//!   generation's row only, so a record's expiry never moves into the
//!   future outside the current generation.
//!
//! # Rotation
//!
//! An expiry purge of the whole table rotates instead of deleting: once no
//! record of the other generation is live, it `TRUNCATE`s that partition
//! and makes it the current one. A truncate leaves no dead rows, no index
//! entries to step over and no vacuum debt, and takes a few milliseconds
//! whatever the partition holds, so claims never compete with a purge for
//! minutes of I/O and WAL. The table holds at most the records of two
//! generations: about one to two retention periods of claims.
//!
//! Rotation is fenced: every claim transaction takes an advisory lock in
//! shared mode with its `BEGIN` (same round trip), and a rotation takes it
//! exclusively. So no claim transaction that read the old current
//! generation is open when the switch commits: two copies of one key can
//! never land in two generations, where no unique index would see both.
//! The rotation first tries the lock without queueing (claims keep
//! flowing), and only then waits for it, bounded by a short
//! `lock_timeout`; a rotation that does not get it fails as contention and
//! is tried again by the purge's retries.
//!
//! # What it costs
//!
//! A claim probes the other generation's primary key too (one more index
//! look-up in the same statement), and its transaction takes one shared
//! advisory lock. Pipelined claims ([`PgStore::pipelined`]) are not
//! available on this layout: claims run as statements.
//!
//! [`PgStore::generations`]: super::PgStore::generations
//! [`PgStore::pipelined`]: super::PgStore::pipelined

use std::time::Duration;

use sqlx::postgres::Postgres;
use sqlx::{Connection as _, Row as _};

use crate::store::base::SqlBase;
use crate::store::deadline::within;
use crate::store::sql::{COLS, INSERT_COLS, RotationSql, Sql, pg_waiting};
use crate::store::{StoreError, TableName};

/// How long a rotation tries the fence without queueing, in steps of
/// [`TRY_EVERY`], before it waits for it.
const TRY_FOR: Duration = Duration::from_millis(500);
const TRY_EVERY: Duration = Duration::from_millis(10);

/// How long `prepare_generations`' concurrent index build waits for the
/// transactions older than it to end.
const INDEX_BUILD_WAIT: &str = "15min";

/// The rotation's bound on each lock wait (the fence, the truncate):
/// claims that arrive meanwhile queue behind it at most this long.
const ROTATION_LOCK_WAIT: &str = "200ms";

/// The names of a table's generations layout.
struct Names {
    /// The partitioned dedup table, quoted.
    t: String,
    /// Its partitions, quoted.
    g: [String; 2],
    /// The control table, quoted.
    c: String,
}

impl Names {
    fn of(table: &TableName) -> Self {
        Self {
            t: table.quoted('"'),
            g: [
                table.suffixed("g0").quoted('"'),
                table.suffixed("g1").quoted('"'),
            ],
            c: control_table(table).quoted('"'),
        }
    }
}

/// The control table of `table`'s generations: `<table>_generation`.
pub(crate) fn control_table(table: &TableName) -> TableName {
    table.suffixed("generation")
}

/// The advisory lock that fences rotations of `table` (FNV-1a of its
/// name): computed here so that each `BEGIN` carries a literal.
pub(crate) fn fence_key(table: &TableName) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in format!("onceonly:generations:{table}").bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

/// The statement a claim transaction's `BEGIN` ends with: the fence, shared.
pub(super) fn fence_shared(table: &TableName) -> String {
    format!("SELECT pg_advisory_xact_lock_shared({})", fence_key(table))
}

/// The statements of a store on `table` in the generations layout.
pub(crate) fn sql(table: &TableName) -> Sql {
    let mut sql = Sql::postgres(table);
    let Names { t, g, c } = Names::of(table);
    sql.ddl = ddl(table);
    // A live record in the other generation makes the key taken; the
    // current generation's primary key does the rest, as in the plain
    // layout. Both generations are read by init plans, so that only the
    // other generation's partition is probed (run-time pruning). `w` is
    // the lock-wait CTE of the waiting forms.
    let current = format!("(SELECT current FROM {c})");
    let other = format!("(SELECT 1 - current FROM {c})");
    let insert = |result: bool, w: &str| {
        let (col, val) = if result {
            (", result", ", $7::bytea")
        } else {
            ("", "")
        };
        format!(
            "INSERT INTO {t} (generation, {INSERT_COLS}{col}) \
             SELECT {current}, $1::bytea, $2::text, $3::bigint, $4::bigint, $5::text, $6::text{val}\
             {w} WHERE NOT EXISTS (SELECT 1 FROM {t} AS o \
             WHERE o.scope = $5::text AND o.idem_key = $6::text \
             AND o.generation = {other} AND o.expires_at_ms > $3::bigint) \
             ON CONFLICT (scope, idem_key, generation) DO NOTHING"
        )
    };
    sql.insert = insert(false, "");
    sql.insert_completed = insert(true, "");
    sql.insert_waiting = pg_waiting(&insert(false, " FROM w"), "$7");
    sql.insert_completed_waiting = pg_waiting(&insert(true, " FROM w"), "$8");
    let many = |result: bool| {
        let (col, val, arr, alias) = if result {
            (", result", ", u.r", ", $7::bytea[]", ", r")
        } else {
            ("", "", "", "")
        };
        format!(
            "INSERT INTO {t} (generation, {COLS}{col}) \
             SELECT {current}, $1::text, u.k, u.f, u.s, $5::bigint, $6::bigint{val} \
             FROM UNNEST($2::text[], $3::bytea[], $4::text[]{arr}) AS u(k, f, s{alias}) \
             WHERE NOT EXISTS (SELECT 1 FROM {t} AS o WHERE o.scope = $1::text \
             AND o.idem_key = u.k AND o.generation = {other} AND o.expires_at_ms > $5::bigint) \
             ON CONFLICT (scope, idem_key, generation) DO NOTHING RETURNING idem_key"
        )
    };
    sql.insert_many = many(false);
    sql.insert_completed_many = many(true);
    // The newest record: the live one if there is one (a key is live in
    // one generation at most).
    sql.existing = format!(
        "SELECT fingerprint, result, expires_at_ms FROM {t} WHERE scope = $1 AND idem_key = $2 \
         ORDER BY expires_at_ms DESC LIMIT 1"
    );
    sql.existing_many = format!(
        "SELECT DISTINCT ON (idem_key) idem_key, fingerprint, result, expires_at_ms FROM {t} \
         WHERE scope = $1 AND idem_key = ANY($2::text[]) ORDER BY idem_key, expires_at_ms DESC"
    );
    sql.get = format!(
        "SELECT {COLS}, result FROM {t} WHERE scope = $1 AND idem_key = $2 \
         ORDER BY expires_at_ms DESC LIMIT 1"
    );
    // Only the current generation's rows are reclaimed and completed: a
    // record outside it never gets a later expiry.
    let reclaim = |w: &str| {
        format!(
            "UPDATE {t} SET fingerprint = $1::bytea, source = $2::text, \
             created_at_ms = $3::bigint, expires_at_ms = $4::bigint, result = NULL{from} \
             WHERE scope = $5::text AND idem_key = $6::text AND expires_at_ms <= $7::bigint \
             AND generation = {current}",
            from = if w.is_empty() { "" } else { " FROM w" },
        )
    };
    sql.reclaim = reclaim("");
    sql.reclaim_waiting = pg_waiting(&reclaim("w"), "$8");
    sql.complete = format!(
        "UPDATE {t} SET result = $1 WHERE scope = $2 AND idem_key = $3 AND generation = {current}"
    );
    sql.complete_many = format!(
        "UPDATE {t} AS t SET result = u.r FROM UNNEST($2::text[], $3::bytea[]) AS u(k, r) \
         WHERE t.scope = $1 AND t.idem_key = u.k AND t.generation = {current}"
    );
    let each = |f: &dyn Fn(&str) -> String| [f(&g[0]), f(&g[1])];
    sql.rotation = Some(RotationSql {
        fence: fence_key(table),
        current: format!("SELECT current FROM {c}"),
        live: each(&|g| format!("SELECT EXISTS (SELECT 1 FROM {g} WHERE expires_at_ms > $1)")),
        rows: each(&rows_sql),
        truncate: each(&|g| format!("TRUNCATE {g}")),
        switch: switch_sql(&c),
        partitions: g.clone(),
    });
    sql
}

/// The DDL every table of the generations layout shares, run after its
/// partitioned table was created: a plain table renamed to generation 0 by
/// the upgrade attached (with a validated check and a matching index, in
/// milliseconds), the two partitions, and the control table naming the
/// current generation.
pub(crate) fn partitions_ddl(table: &TableName) -> Vec<String> {
    let Names { t, g, c } = Names::of(table);
    vec![
        format!(
            "DO $onceonly$ BEGIN \
             IF EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('{g0}') \
             AND relkind = 'r' AND NOT relispartition) THEN \
             ALTER TABLE {t} ATTACH PARTITION {g0} FOR VALUES IN (0); \
             END IF; END $onceonly$",
            g0 = g[0]
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {} PARTITION OF {t} FOR VALUES IN (0)",
            g[0]
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {} PARTITION OF {t} FOR VALUES IN (1)",
            g[1]
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {c} (\
             id smallint PRIMARY KEY CHECK (id = 1), \
             current smallint NOT NULL CHECK (current IN (0, 1)), \
             rotated_at_ms bigint NOT NULL)"
        ),
        format!(
            "INSERT INTO {c} (id, current, rotated_at_ms) VALUES (1, 0, 0) \
             ON CONFLICT (id) DO NOTHING"
        ),
    ]
}

/// About how many rows partition `g` (quoted) holds, from the statistics
/// (`bigint`; counting would read the whole partition).
pub(crate) fn rows_sql(g: &str) -> String {
    format!(
        "SELECT COALESCE((SELECT n_live_tup FROM pg_stat_user_tables \
         WHERE relid = to_regclass('{g}')), 0)::bigint"
    )
}

/// `$1` generation, `$2` now: makes it the current one in control table `c`.
pub(crate) fn switch_sql(c: &str) -> String {
    format!("UPDATE {c} SET current = $1, rotated_at_ms = $2")
}

/// The DDL of the generations layout, upgrading a plain table in place.
fn ddl(table: &TableName) -> Vec<String> {
    let t = table.quoted('"');
    let g0_name = table.suffixed("g0").table().to_owned();
    let expires = table.suffixed("expires_at").quoted('"');
    let g0_expires = format!("{g0_name}_expires_at");
    let mut ddl = vec![
        format!("SELECT pg_advisory_xact_lock(hashtext('onceonly:{table}'))"),
        // A plain table becomes generation 0: the column (instant, or
        // already added by `PgStore::prepare_generations`), its primary key
        // dropped (the partitioned one replaces it), renamed.
        format!(
            "DO $onceonly$ DECLARE pk text; BEGIN \
             IF EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('{t}') AND relkind = 'r') THEN \
             ALTER TABLE {t} ADD COLUMN IF NOT EXISTS generation smallint NOT NULL DEFAULT 0; \
             SELECT conname INTO pk FROM pg_constraint \
             WHERE conrelid = to_regclass('{t}') AND contype = 'p'; \
             IF pk IS NOT NULL THEN \
             EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '{t}', pk); END IF; \
             IF to_regclass('{expires}') IS NOT NULL THEN \
             ALTER INDEX {expires} RENAME TO \"{g0_expires}\"; END IF; \
             ALTER TABLE {t} RENAME TO \"{g0_name}\"; \
             END IF; END $onceonly$"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
             scope text NOT NULL, idem_key text NOT NULL, fingerprint bytea, result bytea, \
             source text, created_at_ms bigint NOT NULL, expires_at_ms bigint NOT NULL, \
             generation smallint NOT NULL, PRIMARY KEY (scope, idem_key, generation)) \
             PARTITION BY LIST (generation)"
        ),
    ];
    ddl.extend(partitions_ddl(table));
    ddl.push(format!(
        "CREATE INDEX IF NOT EXISTS {} ON {t} (expires_at_ms)",
        table.index("expires_at", '"')
    ));
    // The attempts table is the plain layout's.
    let plain = Sql::postgres(table).ddl;
    ddl.extend(plain.into_iter().filter(|s| s.contains("_attempts")));
    ddl
}

/// The statements of [`PgStore::prepare_generations`](super::PgStore::prepare_generations),
/// each run on its own (the index is built `CONCURRENTLY`).
fn prepare_sql(table: &TableName) -> [String; 4] {
    let t = table.quoted('"');
    let check = table.suffixed("generation_0").table().to_owned();
    let index = table.suffixed("g0_key").table().to_owned();
    [
        format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS generation smallint NOT NULL DEFAULT 0"),
        format!(
            "DO $onceonly$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_constraint \
             WHERE conrelid = to_regclass('{t}') AND conname = '{check}') THEN \
             ALTER TABLE {t} ADD CONSTRAINT \"{check}\" CHECK (generation = 0) NOT VALID; \
             END IF; END $onceonly$"
        ),
        format!("ALTER TABLE {t} VALIDATE CONSTRAINT \"{check}\""),
        format!(
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS \"{index}\" \
             ON {t} (scope, idem_key, generation)"
        ),
    ]
}

/// Prepares a plain table for the upgrade, online: see
/// [`PgStore::prepare_generations`](super::PgStore::prepare_generations).
pub(super) async fn prepare(base: &SqlBase<Postgres>) -> Result<(), StoreError> {
    let table = &base.table;
    let t = table.quoted('"');
    let mut conn = base.pool.acquire().await?;
    // Session settings below: this connection is not given back.
    conn.close_on_drop();
    let kind: Option<String> =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
            .bind(&t)
            .fetch_optional(&mut *conn)
            .await?;
    match kind.as_deref() {
        Some("r") => {}
        Some("p") => return Ok(()),
        _ => {
            return Err(StoreError::Layout(format!(
                "{table} does not exist: nothing to prepare (migrate creates the layout)"
            )));
        }
    }
    // A failed earlier build leaves an invalid index behind: build it anew.
    let index = table.suffixed("g0_key");
    let invalid: Option<bool> = sqlx::query_scalar(
        "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)",
    )
    .bind(index.quoted('"'))
    .fetch_optional(&mut *conn)
    .await?;
    if invalid == Some(true) {
        let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {}", index.quoted('"'));
        sqlx::query(&drop).execute(&mut *conn).await?;
    }
    let lock = crate::store::sql::lock_timeout_value(base.deadlines.migration_lock_timeout());
    let [column, check, validate, index] = prepare_sql(table);
    sqlx::query(&format!("SET lock_timeout = '{lock}'"))
        .execute(&mut *conn)
        .await?;
    for statement in [column, check, validate] {
        sqlx::query(&statement).execute(&mut *conn).await?;
    }
    // The concurrent build waits for every transaction older than it, in
    // the whole database, to end: a bound for long reports and loads.
    sqlx::query(&format!("SET lock_timeout = '{INDEX_BUILD_WAIT}'"))
        .execute(&mut *conn)
        .await?;
    sqlx::query(&index).execute(&mut *conn).await?;
    Ok(())
}

/// Rotates, if the other generation holds no live record at `now_ms`:
/// about how many records the truncate removed (0 if it did not rotate).
pub(super) async fn rotate(
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
) -> Result<u64, StoreError> {
    // Each step is bounded by the statement deadline; the whole by this.
    let d = base.deadlines;
    let bound = d.acquire_timeout() + TRY_FOR + 4 * d.statement_deadline();
    within(bound, "rotation", rotate_unbounded(base, rot, now_ms)).await
}

async fn rotate_unbounded(
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
) -> Result<u64, StoreError> {
    let mut conn = base.pool.acquire().await?;
    // Without the fence first: nothing to do is the common answer.
    let current: i16 = sqlx::query_scalar(&rot.current)
        .fetch_one(&mut *conn)
        .await?;
    let other = usize::from(current == 0);
    let live: bool = sqlx::query_scalar(&rot.live[other])
        .bind(now_ms)
        .fetch_one(&mut *conn)
        .await?;
    if live {
        return Ok(0);
    }
    let rows: i64 = sqlx::query_scalar(&rot.rows[other])
        .fetch_one(&mut *conn)
        .await?;
    let mut attempt = 1;
    loop {
        match switch(&mut conn, base, rot, now_ms, current).await {
            Ok(done) => {
                return Ok(if done {
                    u64::try_from(rows).unwrap_or(0)
                } else {
                    0
                });
            }
            // Something held the fence or the partition longer than the
            // rotation's lock wait: say who, and try again a little later.
            Err(e) if attempt < ROTATION_ATTEMPTS && is_lock_timeout(&e) => {
                let holders = holders(&mut conn, &rot.partitions[other]).await;
                tracing::warn!(
                    table = %base.table,
                    attempt,
                    %holders,
                    "a rotation of the dedup table waited too long for its locks; trying again"
                );
                attempt += 1;
                tokio::time::sleep(TRY_EVERY * 10).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Rotations give up after this many attempts that timed out on a lock
/// (the error is contention: the purge's caller tries again later).
const ROTATION_ATTEMPTS: u32 = 3;

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "55P03")
}

/// Who holds a lock on `partition` (pid, mode, state, the query's start),
/// for the log of a rotation that could not get its own.
async fn holders(conn: &mut sqlx::PgConnection, partition: &str) -> String {
    /// pid, lock mode, state, the query's start.
    type Holder = (i32, String, Option<String>, Option<String>);
    let rows: Result<Vec<Holder>, _> = sqlx::query_as(
        "SELECT l.pid, l.mode, a.state, left(a.query, 80) FROM pg_locks l \
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.relation = to_regclass($1) AND l.granted AND l.pid <> pg_backend_pid()",
    )
    .bind(partition)
    .fetch_all(&mut *conn)
    .await;
    match rows {
        Ok(rows) if rows.is_empty() => "nobody holds the partition (the fence was held)".into(),
        Ok(rows) => rows
            .iter()
            .map(|(pid, mode, state, query)| {
                format!(
                    "pid {pid} {mode} ({}): {}",
                    state.as_deref().unwrap_or("?"),
                    query.as_deref().unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) => format!("unknown ({e})"),
    }
}

/// One fenced attempt: the switch from generation `current` to the other
/// one, after truncating it. `Ok(false)`: nothing to do any more.
async fn switch(
    conn: &mut sqlx::PgConnection,
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
    current: i16,
) -> Result<bool, sqlx::Error> {
    let other = usize::from(current == 0);
    let mut tx = conn
        .begin_with(format!(
            "BEGIN; SET LOCAL lock_timeout = '{ROTATION_LOCK_WAIT}'"
        ))
        .await?;
    let started = tokio::time::Instant::now();
    let mut tries = 0_u32;
    let mut fenced = false;
    while !fenced && started.elapsed() < TRY_FOR {
        let row = sqlx::query("SELECT pg_try_advisory_xact_lock($1) AS got")
            .bind(rot.fence)
            .fetch_one(&mut *tx)
            .await?;
        fenced = row.try_get("got")?;
        tries += 1;
        if !fenced {
            tokio::time::sleep(TRY_EVERY).await;
        }
    }
    if !fenced {
        // Claims queue behind this wait: it is short (lock_timeout).
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(rot.fence)
            .execute(&mut *tx)
            .await?;
    }
    // No claim transaction is open now, and none begins until this commits.
    let fence_ms = started.elapsed().as_millis();
    let now_current: i16 = sqlx::query_scalar(&format!("{} FOR UPDATE", rot.current))
        .fetch_one(&mut *tx)
        .await?;
    let live: bool = sqlx::query_scalar(&rot.live[other])
        .bind(now_ms)
        .fetch_one(&mut *tx)
        .await?;
    if now_current != current || live {
        tx.rollback().await?;
        return Ok(false);
    }
    let truncating = tokio::time::Instant::now();
    sqlx::query(&rot.truncate[other]).execute(&mut *tx).await?;
    sqlx::query(&rot.switch)
        .bind(i16::try_from(other).unwrap_or(0))
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    tracing::info!(
        table = %base.table,
        generation = other,
        fence_ms,
        fence_tries = tries,
        truncate_ms = truncating.elapsed().as_millis(),
        "rotated the dedup table: truncated the other generation and made it the current one"
    );
    Ok(true)
}

/// Whether `table` has the generations layout (a partitioned table).
pub(super) async fn detect(base: &SqlBase<Postgres>) -> Result<bool, StoreError> {
    let kind: Option<String> =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
            .bind(base.table.quoted('"'))
            .fetch_optional(&base.pool)
            .await?;
    Ok(kind.as_deref() == Some("p"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_is_stable_and_per_table() {
        let a = TableName::new("onceonly_keys").unwrap();
        let b = TableName::new("billing.onceonly_keys").unwrap();
        assert_eq!(fence_key(&a), fence_key(&a.clone()));
        assert_ne!(fence_key(&a), fence_key(&b));
        assert!(fence_shared(&a).starts_with("SELECT pg_advisory_xact_lock_shared("));
    }

    #[test]
    fn names_stay_within_postgres_identifier_limit() {
        let long = TableName::new(&"k".repeat(48)).unwrap();
        for name in [
            long.suffixed("g0"),
            long.suffixed("g0_key"),
            long.suffixed("generation_0"),
            control_table(&long),
        ] {
            assert!(name.table().len() <= 63, "{name}");
        }
    }
}
