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
//!   future outside the current generation;
//! - a purge by `DELETE` (of one scope: a purge of the whole table
//!   rotates) deletes the expired rows it picked by their generation too,
//!   never a key's live record in the other generation.
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
//! Each generation is split into hash partitions on `idem_key`, its
//! *buckets* (`<table>_g<n>_b<k>`, [`PgStore::generation_buckets`]). A
//! rotation truncates the other generation's buckets a step at a time (at
//! most [`PgStore::rotation_step`] of files per fenced transaction) and
//! pauses after each twenty times as long as its commit took, before a last
//! transaction truncates the rest and switches: PostgreSQL
//! unlinks a truncated relation's files as the transaction commits, and on
//! many file systems freeing gigabytes at once stalls every `fsync`
//! meanwhile, the claims' commits included. A generation that is one plain
//! table (generation 0 of a table upgraded from the plain layout) is
//! truncated whole, and split like the current one in the same transaction.
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
//! advisory lock. Each statement locks every bucket: PostgreSQL locks all
//! the partitions of a cached generic plan before it prunes them.
//! Pipelined claims ([`PgStore::pipelined`]) are not available on this
//! layout: claims run as statements.
//!
//! [`PgStore::generations`]: super::PgStore::generations
//! [`PgStore::generation_buckets`]: super::PgStore::generation_buckets
//! [`PgStore::rotation_step`]: super::PgStore::rotation_step
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
            c: table.generation_control().quoted('"'),
        }
    }
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

/// The statements of a store on `table` in the generations layout, whose
/// migration splits each generation into `buckets` hash partitions
/// ([`PgStore::generation_buckets`](super::PgStore::generation_buckets)).
pub(crate) fn sql(table: &TableName, buckets: u16) -> Sql {
    let mut sql = Sql::postgres(table);
    let Names { t, g, c } = Names::of(table);
    sql.ddl = ddl(table, buckets);
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
    // A key may have a record in each generation (an expired one in the
    // other, a live one in the current): a purge deletes the rows it
    // picked, by generation too, and only while they are expired. The
    // plain layout's `(scope, idem_key) IN (...)` would take the live
    // record with the expired one, and the next copy of the key would
    // run its handler again.
    let purge_of = |scope: &str, n: usize| {
        format!(
            "DELETE FROM {t} WHERE (scope, idem_key, generation) IN (SELECT scope, idem_key, \
             generation FROM {t} WHERE {scope}expires_at_ms <= ${n} ORDER BY expires_at_ms \
             LIMIT ${} FOR UPDATE SKIP LOCKED) AND expires_at_ms <= ${n}",
            n + 1
        )
    };
    sql.purge = purge_of("", 1);
    sql.purge_scope = purge_of("scope = $1 AND ", 2);
    let each = |f: &dyn Fn(&str) -> String| [f(&g[0]), f(&g[1])];
    sql.rotation = Some(RotationSql {
        fence: fence_key(table),
        current: format!("SELECT current FROM {c}"),
        state: format!("SELECT current, rotated_at_ms FROM {c}"),
        newest: each(&|g| format!("SELECT max(expires_at_ms) FROM {g}")),
        live: each(&|g| format!("SELECT EXISTS (SELECT 1 FROM {g} WHERE expires_at_ms > $1)")),
        rows: each(&rows_sql),
        truncate: each(&|g| format!("TRUNCATE {g}")),
        switch: switch_sql(&c),
        partitions: g.clone(),
        free_per_step: DEFAULT_ROTATION_STEP,
    });
    sql
}

/// The statement that makes a plain `table`, if there is one, generation 0
/// of its generations layout, for every table of the layout (the dedup
/// table and the outbox): the `generation` column (0 for every row), its
/// keys of the constraint types `key_types` (SQL, e.g. `'p', 'u'`) dropped
/// (the partitioned table's replace them), its indexes `indexes` (by the
/// suffix [`TableName::index`] gave them) renamed to generation 0's, and
/// the table renamed `<table>_g0`. Idempotent: nothing happens once the
/// table is partitioned.
pub(crate) fn adopt_plain_table(table: &TableName, key_types: &str, indexes: &[&str]) -> String {
    let t = table.quoted('"');
    let g0_name = table.suffixed("g0").table().to_owned();
    let renames: String = indexes
        .iter()
        .map(|suffix| {
            let from = table.suffixed(suffix).quoted('"');
            format!(
                "IF to_regclass('{from}') IS NOT NULL THEN \
                 ALTER INDEX {from} RENAME TO \"{g0_name}_{suffix}\"; END IF; "
            )
        })
        .collect();
    format!(
        "DO $onceonly$ DECLARE k record; BEGIN \
         IF EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('{t}') AND relkind = 'r') THEN \
         ALTER TABLE {t} ADD COLUMN IF NOT EXISTS generation smallint NOT NULL DEFAULT 0; \
         FOR k IN SELECT conname FROM pg_constraint \
         WHERE conrelid = to_regclass('{t}') AND contype IN ({key_types}) LOOP \
         EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '{t}', k.conname); END LOOP; \
         {renames}\
         ALTER TABLE {t} RENAME TO \"{g0_name}\"; \
         END IF; END $onceonly$"
    )
}

/// The DDL every table of the generations layout shares, run after its
/// partitioned table was created: a plain table renamed to generation 0 by
/// the upgrade attached (with a validated check and a matching index, in
/// milliseconds), the two partitions, each split into `buckets` hash
/// partitions on `idem_key` when `buckets` is 2 or more, and the control
/// table naming the current generation.
pub(crate) fn partitions_ddl(table: &TableName, buckets: u16) -> Vec<String> {
    let Names { t, g, c } = Names::of(table);
    let mut ddl = vec![format!(
        "DO $onceonly$ BEGIN \
         IF EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('{g0}') \
         AND relkind = 'r' AND NOT relispartition) THEN \
         ALTER TABLE {t} ATTACH PARTITION {g0} FOR VALUES IN (0); \
         END IF; END $onceonly$",
        g0 = g[0]
    )];
    for (generation, g) in g.iter().enumerate() {
        ddl.push(format!(
            "CREATE TABLE IF NOT EXISTS {g} PARTITION OF {t} FOR VALUES IN ({generation}){}",
            if buckets > 1 { BY_HASH } else { "" }
        ));
        // Only a generation this DDL created is split, once: generation 0
        // of an upgraded table is the old plain table (its first rotation
        // splits it, see `reshape`), and a generation already split keeps
        // its buckets whatever `buckets` says now.
        let leaves = buckets_ddl(table, generation, buckets);
        if !leaves.is_empty() {
            ddl.push(format!(
                "DO $onceonly$ BEGIN \
                 IF EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass('{g}') \
                 AND relkind = 'p') AND NOT EXISTS (SELECT 1 FROM pg_inherits \
                 WHERE inhparent = to_regclass('{g}')) THEN {}; END IF; END $onceonly$",
                leaves.join("; ")
            ));
        }
    }
    ddl.extend([
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
    ]);
    ddl
}

/// How a generation split into buckets is partitioned.
const BY_HASH: &str = " PARTITION BY HASH (idem_key)";

/// The hash partitions of generation `generation` of `table` when it is
/// split into `buckets` (none below 2): `<table>_g<generation>_b<n>`.
fn buckets_ddl(table: &TableName, generation: usize, buckets: u16) -> Vec<String> {
    if buckets < 2 {
        return Vec::new();
    }
    let g = table.suffixed(&format!("g{generation}")).quoted('"');
    (0..buckets)
        .map(|n| {
            format!(
                "CREATE TABLE IF NOT EXISTS {} PARTITION OF {g} \
                 FOR VALUES WITH (MODULUS {buckets}, REMAINDER {n})",
                table.suffixed(&format!("g{generation}_b{n}")).quoted('"')
            )
        })
        .collect()
}

/// About how many rows partition `g` (quoted) holds, with its buckets if
/// it has any, from the statistics (`bigint`; counting would read the
/// whole partition).
pub(crate) fn rows_sql(g: &str) -> String {
    format!(
        "SELECT COALESCE((SELECT sum(s.n_live_tup) FROM pg_stat_user_tables s \
         JOIN pg_partition_tree(to_regclass('{g}')) p ON p.relid = s.relid \
         WHERE p.isleaf), 0)::bigint"
    )
}

/// `$1` generation, `$2` now: makes it the current one in control table `c`.
pub(crate) fn switch_sql(c: &str) -> String {
    format!("UPDATE {c} SET current = $1, rotated_at_ms = $2")
}

/// The DDL of the generations layout, upgrading a plain table in place.
fn ddl(table: &TableName, buckets: u16) -> Vec<String> {
    let t = table.quoted('"');
    let mut ddl = vec![
        format!("SELECT pg_advisory_xact_lock(hashtext('onceonly:{table}'))"),
        // A plain table becomes generation 0: the column (instant, or
        // already added by `PgStore::prepare_generations`), its primary key
        // dropped (the partitioned one replaces it), renamed.
        adopt_plain_table(table, "'p'", &["expires_at"]),
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
             scope text NOT NULL, idem_key text NOT NULL, fingerprint bytea, result bytea, \
             source text, created_at_ms bigint NOT NULL, expires_at_ms bigint NOT NULL, \
             generation smallint NOT NULL, PRIMARY KEY (scope, idem_key, generation)) \
             PARTITION BY LIST (generation)"
        ),
    ];
    ddl.extend(partitions_ddl(table, buckets));
    ddl.push(format!(
        "CREATE INDEX IF NOT EXISTS {} ON {t} (expires_at_ms)",
        table.index("expires_at", '"')
    ));
    // The attempts, fence and steps tables are the plain layout's.
    ddl.extend(crate::store::sql::pg_side_ddl(table));
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
///
/// A generation split into buckets is emptied a few buckets at a time
/// (at most [`PgStore::rotation_step`](super::PgStore::rotation_step) of
/// files, or one bucket), each step in its own fenced transaction, and
/// after each one the rotation pauses [`PACE`] times as long as that
/// step's commit took (PostgreSQL unlinks a truncated relation's files as
/// it commits, and on many file systems freeing gigabytes stalls every
/// `fsync` meanwhile, the claims' commits included). Then one last fenced
/// transaction truncates what is left (the last step's worth) and
/// switches: a generation smaller than one step is rotated in one
/// transaction, as if it were not split. A rotation stopped half-way (an
/// error, a dropped future) leaves expired buckets empty and nothing else
/// changed: the next one goes on from there.
pub(super) async fn rotate(
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
) -> Result<u64, StoreError> {
    // Each step is bounded by the statement deadline, the pauses by
    // MAX_PAUSE; each step as a whole by this.
    let d = base.deadlines;
    let step_bound = d.acquire_timeout() + TRY_FOR + 4 * d.statement_deadline();
    let Some((current, rows)) = within(step_bound, "rotation", due(base, rot, now_ms)).await?
    else {
        return Ok(0);
    };
    let other = usize::from(current == 0);
    let buckets = within(
        step_bound,
        "rotation",
        full_buckets(base, &rot.partitions[other]),
    )
    .await?;
    let budget = i64::try_from(rot.free_per_step).unwrap_or(i64::MAX);
    let steps = steps_of(buckets, budget);
    let count = steps.len();
    for (n, buckets) in steps.into_iter().enumerate() {
        let step = Step::Buckets(buckets);
        let attempt = attempts(base, rot, now_ms, current, &step);
        let Some(took) = within(step_bound, "rotation", attempt).await? else {
            return Ok(0);
        };
        let pause = paced(took);
        tracing::debug!(
            table = %base.table,
            generation = other,
            step = n + 1,
            of = count,
            commit_ms = took.as_millis(),
            pause_ms = pause.as_millis(),
            "rotation: emptied buckets of the other generation"
        );
        tokio::time::sleep(pause).await;
    }
    let switch = attempts(base, rot, now_ms, current, &Step::Switch);
    let done = within(step_bound, "rotation", switch).await?;
    Ok(match done {
        Some(_) => u64::try_from(rows).unwrap_or(0),
        None => 0,
    })
}

/// A rotation pauses this many times as long as the commit of the step
/// it took, before the next step: at most about a twentieth of its time
/// is spent freeing files, however big the table.
const PACE: u32 = 20;

/// The longest pause between two steps of a rotation.
const MAX_PAUSE: Duration = Duration::from_secs(10);

/// Steps whose commit took less than this are not followed by a pause:
/// nobody noticed them.
const UNNOTICED: Duration = Duration::from_millis(10);

/// The pause after a step whose commit took `took`.
fn paced(took: Duration) -> Duration {
    if took < UNNOTICED {
        Duration::ZERO
    } else {
        (took * PACE).min(MAX_PAUSE)
    }
}

/// Whether a rotation is due, without the fence (nothing to do is the
/// common answer): the current generation and about how many records the
/// other one holds, if it holds no live one.
async fn due(
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
) -> Result<Option<(i16, i64)>, StoreError> {
    let mut conn = base.pool.acquire().await?;
    let current: i16 = sqlx::query_scalar(&rot.current)
        .fetch_one(&mut *conn)
        .await?;
    let other = usize::from(current == 0);
    let live: bool = sqlx::query_scalar(&rot.live[other])
        .bind(now_ms)
        .fetch_one(&mut *conn)
        .await?;
    if live {
        return Ok(None);
    }
    let rows: i64 = sqlx::query_scalar(&rot.rows[other])
        .fetch_one(&mut *conn)
        .await?;
    Ok(Some((current, rows)))
}

/// The table's rotations at `now_ms` (see
/// [`SqlStore::rotations`](crate::store::SqlStore::rotations)): a rotation
/// has been possible since the other generation's newest record expired,
/// or since the last rotation if that came later (an empty generation).
pub(super) async fn rotations(
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
) -> Result<crate::store::Rotations, StoreError> {
    let mut conn = base.pool.acquire().await?;
    let (current, rotated_at_ms): (i16, i64) =
        sqlx::query_as(&rot.state).fetch_one(&mut *conn).await?;
    let other = usize::from(current == 0);
    let newest: Option<i64> = sqlx::query_scalar(&rot.newest[other])
        .fetch_one(&mut *conn)
        .await?;
    let possible_since_ms = match newest {
        Some(newest) if newest > now_ms => None,
        newest => Some(newest.unwrap_or(0).max(rotated_at_ms)),
    };
    Ok(crate::store::Rotations {
        rotated_at_ms,
        possible_since_ms,
    })
}

/// The buckets of generation partition `g` (quoted) that hold anything
/// (quoted, in order) with their size (table and indexes, bytes); none
/// when the generation is not split.
async fn full_buckets(base: &SqlBase<Postgres>, g: &str) -> Result<Vec<(String, i64)>, StoreError> {
    let buckets: Vec<(String, i64)> = sqlx::query_as(
        "SELECT format('%I.%I', n.nspname, c.relname), pg_total_relation_size(c.oid) \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE i.inhparent = to_regclass($1) AND c.relkind = 'r' \
         AND pg_relation_size(c.oid) > 0 ORDER BY c.relname",
    )
    .bind(g)
    .fetch_all(&base.pool)
    .await?;
    Ok(buckets)
}

/// The default [`PgStore::rotation_step`](super::PgStore::rotation_step):
/// 1 GiB.
pub(crate) const DEFAULT_ROTATION_STEP: u64 = 1 << 30;

/// `buckets` (name, bytes) in steps of at most `budget` bytes each (or one
/// bucket), without the last step: the switch truncates what is left.
fn steps_of(buckets: Vec<(String, i64)>, budget: i64) -> Vec<Vec<String>> {
    let mut steps: Vec<Vec<String>> = Vec::new();
    let mut size = 0;
    for (bucket, bytes) in buckets {
        match steps.last_mut() {
            Some(step) if size + bytes <= budget => {
                step.push(bucket);
                size += bytes;
            }
            _ => {
                steps.push(vec![bucket]);
                size = bytes;
            }
        }
    }
    steps.pop();
    steps
}

/// One fenced step of a rotation.
enum Step {
    /// Empty these buckets (quoted) of the other generation.
    Buckets(Vec<String>),
    /// Empty the other generation and make it the current one.
    Switch,
}

/// `step`, tried again when it timed out on a lock: how long its commit
/// took (`None`: nothing to do any more).
async fn attempts(
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
    current: i16,
    step: &Step,
) -> Result<Option<Duration>, StoreError> {
    let other = usize::from(current == 0);
    let mut conn = base.pool.acquire().await?;
    let mut attempt = 1;
    loop {
        match fenced(&mut conn, base, rot, now_ms, current, step).await {
            Ok(done) => return Ok(done),
            // Something held the fence or the partition longer than the
            // rotation's lock wait: say who, and try again a little later.
            Err(e) if attempt < ROTATION_ATTEMPTS && is_lock_timeout(&e) => {
                let held = match step {
                    Step::Buckets(buckets) => buckets.first().unwrap_or(&rot.partitions[other]),
                    Step::Switch => &rot.partitions[other],
                };
                let holders = holders(&mut conn, held).await;
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
    has_sqlstate(e, "55P03")
}

/// Whether `e` is a PostgreSQL error with SQLSTATE `code`.
fn has_sqlstate(e: &sqlx::Error, code: &str) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == code)
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

/// One fenced attempt at `step` of the rotation away from generation
/// `current`: how long its commit took (`None`: nothing to do any more,
/// the rotation happened meanwhile or a record of the other generation is
/// live).
async fn fenced(
    conn: &mut sqlx::PgConnection,
    base: &SqlBase<Postgres>,
    rot: &RotationSql,
    now_ms: i64,
    current: i16,
    step: &Step,
) -> Result<Option<Duration>, sqlx::Error> {
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
        return Ok(None);
    }
    let truncating = tokio::time::Instant::now();
    match step {
        Step::Buckets(buckets) => {
            sqlx::query(&format!("TRUNCATE {}", buckets.join(", ")))
                .execute(&mut *tx)
                .await?;
        }
        Step::Switch => {
            sqlx::query(&rot.truncate[other]).execute(&mut *tx).await?;
            reshape(&mut tx, &base.table, other).await?;
            sqlx::query(&rot.switch)
                .bind(i16::try_from(other).unwrap_or(0))
                .bind(now_ms)
                .execute(&mut *tx)
                .await?;
        }
    }
    // The truncated files are unlinked as the commit ends.
    let committing = tokio::time::Instant::now();
    tx.commit().await?;
    let took = committing.elapsed();
    if matches!(step, Step::Switch) {
        tracing::info!(
            table = %base.table,
            generation = other,
            fence_ms,
            fence_tries = tries,
            truncate_ms = truncating.elapsed().as_millis(),
            "rotated the dedup table: truncated the other generation and made it the current one"
        );
    }
    Ok(Some(took))
}

/// Splits the emptied generation `generation` into as many buckets as the
/// current one has, if it is a plain table while the current one is split
/// (generation 0 of a table upgraded from the plain layout, at its first
/// rotation). DDL on empty tables, inside the fence, behind a savepoint:
/// the DDL needs the table's owner, and a purging role that is not the
/// owner (with the grants `onceonly doctor` lists) rotates the generation
/// unsplit instead of failing the rotation. A later rotation by the owner
/// splits it.
async fn reshape(
    tx: &mut sqlx::PgConnection,
    table: &TableName,
    generation: usize,
) -> Result<(), sqlx::Error> {
    let names = Names::of(table);
    // Whether the emptied generation is a plain table, and how many
    // buckets the current one has (0 when it is a plain table too).
    let (plain, buckets): (bool, i64) = sqlx::query_as(
        "SELECT (SELECT relkind = 'r' FROM pg_class WHERE oid = to_regclass($1)), \
         (SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($2))",
    )
    .bind(&names.g[generation])
    .bind(&names.g[1 - generation])
    .fetch_one(&mut *tx)
    .await?;
    let buckets = u16::try_from(buckets).unwrap_or(0);
    if !plain || buckets < 2 {
        return Ok(());
    }
    let (t, g) = (&names.t, &names.g[generation]);
    let mut ddl = vec![
        format!("ALTER TABLE {t} DETACH PARTITION {g}"),
        format!("DROP TABLE {g}"),
        format!("CREATE TABLE {g} PARTITION OF {t} FOR VALUES IN ({generation}){BY_HASH}"),
    ];
    ddl.extend(buckets_ddl(table, generation, buckets));
    sqlx::query("SAVEPOINT onceonly_reshape")
        .execute(&mut *tx)
        .await?;
    for statement in ddl {
        match sqlx::query(&statement).execute(&mut *tx).await {
            Ok(_) => {}
            // insufficient_privilege: not the owner.
            Err(e) if has_sqlstate(&e, "42501") => {
                sqlx::query("ROLLBACK TO SAVEPOINT onceonly_reshape")
                    .execute(&mut *tx)
                    .await?;
                tracing::warn!(
                    table = %table,
                    generation,
                    error = %e,
                    "rotated without splitting the emptied generation into buckets: that takes \
                     the table's owner (a rotation by the owner, e.g. `onceonly purge \
                     --expired` as the owner, splits it)"
                );
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
    sqlx::query("RELEASE SAVEPOINT onceonly_reshape")
        .execute(&mut *tx)
        .await?;
    tracing::info!(
        table = %table,
        generation,
        buckets,
        "split the emptied generation into buckets like the current one"
    );
    Ok(())
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
    fn pauses_follow_the_commit_they_come_after_within_bounds() {
        assert_eq!(paced(Duration::from_millis(3)), Duration::ZERO);
        assert_eq!(
            paced(Duration::from_millis(400)),
            Duration::from_millis(400) * PACE
        );
        assert!(Duration::from_millis(400) * PACE < MAX_PAUSE);
        assert_eq!(paced(Duration::from_secs(5)), MAX_PAUSE);
    }

    #[test]
    fn rotation_steps_free_at_most_their_budget_and_leave_the_last_to_the_switch() {
        let b = |n: &str, bytes: i64| (n.to_owned(), bytes);
        // Smaller than a step: the switch does it all.
        assert!(steps_of(vec![b("a", 10), b("b", 10)], 100).is_empty());
        assert!(steps_of(Vec::new(), 100).is_empty());
        let steps = steps_of(
            vec![
                b("a", 60),
                b("b", 30),
                b("c", 50),
                b("d", 500),
                b("e", 40),
                b("f", 40),
            ],
            100,
        );
        // [a b] [c] [d] [e f]: the last one is the switch's.
        assert_eq!(steps, vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
    }

    #[test]
    fn buckets_are_created_once_and_only_when_asked() {
        let t = TableName::new("onceonly_keys").unwrap();
        assert!(buckets_ddl(&t, 0, 1).is_empty());
        let ddl = buckets_ddl(&t, 1, 4);
        assert_eq!(ddl.len(), 4);
        assert!(ddl[3].contains("\"onceonly_keys_g1_b3\" PARTITION OF \"onceonly_keys_g1\""));
        assert!(ddl[3].contains("MODULUS 4, REMAINDER 3"));
        let whole = partitions_ddl(&t, 1).join(";");
        assert!(!whole.contains("HASH"));
        let split = partitions_ddl(&t, 8).join(";");
        assert_eq!(split.matches("PARTITION BY HASH (idem_key)").count(), 2);
        assert_eq!(
            split
                .matches("NOT EXISTS (SELECT 1 FROM pg_inherits")
                .count(),
            2
        );
    }

    #[test]
    fn names_stay_within_postgres_identifier_limit() {
        let long = TableName::new(&"k".repeat(48)).unwrap();
        for name in [
            long.suffixed("g0"),
            long.suffixed("g1_b63"),
            long.suffixed("g0_key"),
            long.suffixed("generation_0"),
            long.generation_control(),
        ] {
            assert!(name.table().len() <= 63, "{name}");
        }
    }
}
