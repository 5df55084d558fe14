//! A big dedup table on PostgreSQL, plain layout vs generations layout
//! (`PgStore::generations`):
//!
//! - **purge round**: a table of N records; four claimers claim new keys
//!   without pause, first idle, then while a purge runs: on the plain
//!   layout the bounded `DELETE`s of one steady-state purge round (the
//!   records that expired since the last round), on the generations layout
//!   one rotation (`TRUNCATE` of the other generation, N/2 records). Claim
//!   p50/p99 idle vs during the purge, the worst stall, the purge's
//!   duration, the table's size;
//! - **steady state**: claims of keys that live a few seconds and a purge
//!   every second, with and without a transaction that holds back the
//!   `xmin` horizon the whole time (what a forgotten `BEGIN` in a psql
//!   session or a long report does): the table's size over time, dead rows
//!   and autovacuum runs at the end.
//!
//! Sizes: `BENCH_BIG_TABLE=10000000,50000000,100000000` (records), else
//! 5k (`--quick`), 1M (default), 10M (`--full`). At 100M records the
//! fill alone takes tens of minutes and ~20 GB of disk: opt in.
//! `BENCH_BIG_TABLE_LAYOUTS` lists the layouts to measure (default
//! `plain,generations:1,generations`): `plain`, `generations` (each
//! generation split into the default number of buckets) or
//! `generations:K` (K buckets; 1: not split). `BENCH_BIG_TABLE_STEADY=0`
//! skips the steady-state table.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use onceonly::{Engine, PgStore, SqlStore};
use sqlx::PgPool;

use super::common::{Bench, Mode, Res, Rng, Schema, now_us, pool};
use super::growth::{claim, claimers, claims_of, phase};
use super::stats::{Table, ms, percentile};

/// Records one steady-state purge round of the plain layout deletes.
const ROUND: u64 = 100_000;
/// Rows per purge statement (the `Purger`'s default).
const BATCH: u32 = 5_000;
/// Concurrent claimers.
const CLAIMERS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    Plain,
    /// Each generation split into this many buckets.
    Generations(u16),
}

impl Layout {
    fn name(self) -> String {
        match self {
            Self::Plain => "plain (bounded DELETE)".to_owned(),
            Self::Generations(1) => "generations (TRUNCATE)".to_owned(),
            Self::Generations(k) => format!("generations, {k} buckets (paced TRUNCATEs)"),
        }
    }

    fn parse(s: &str) -> Res<Self> {
        Ok(match s.trim().split_once(':') {
            None if s.trim() == "plain" => Self::Plain,
            None if s.trim() == "generations" => {
                Self::Generations(onceonly::store::postgres::DEFAULT_GENERATION_BUCKETS)
            }
            Some(("generations", k)) => Self::Generations(k.parse()?),
            _ => return Err(format!("unknown layout {s:?} in BENCH_BIG_TABLE_LAYOUTS").into()),
        })
    }
}

/// The layouts to measure (`BENCH_BIG_TABLE_LAYOUTS`).
fn layouts() -> Res<Vec<Layout>> {
    let list = std::env::var("BENCH_BIG_TABLE_LAYOUTS")
        .unwrap_or_else(|_| "plain,generations:1,generations".to_owned());
    list.split(',').map(Layout::parse).collect()
}

pub async fn run(b: &mut Bench) -> Res<()> {
    if std::env::var_os("BENCH_TRACE").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let sizes = sizes(b.mode)?;
    let window = match b.mode {
        Mode::Quick => Duration::from_secs(1),
        _ => Duration::from_secs(10),
    };
    let mut table = Table::new(
        format!(
            "A big dedup table: claim latency idle vs during a purge ({CLAIMERS} claimers of new keys; \
             plain: one purge round of {ROUND} expired records in DELETEs of {BATCH}; \
             generations: one rotation truncating half the table)"
        ),
        &[
            "records",
            "layout",
            "p50 idle",
            "p99 idle",
            "p50 during purge",
            "p99 during purge",
            "p99 during / idle",
            "worst stall",
            "purge took",
            "records removed",
            "table + indexes",
        ],
    );
    let layouts = layouts()?;
    for &n in &sizes {
        for &layout in &layouts {
            let schema = b.schema("big").await?;
            let row = purge_round(&schema, layout, n, window).await;
            b.drop_schema(&schema).await;
            let row = row?;
            let split = matches!(layout, Layout::Generations(k) if k > 1);
            if n == *sizes.last().unwrap_or(&n) && split {
                b.target(
                    &format!(
                        "claim p99 during a purge vs idle at {n} records ({})",
                        layout.name()
                    ),
                    format!("{:.2}×", row.ratio),
                    "≤ 1.3×",
                    row.ratio <= 1.3,
                );
            }
            eprintln!("big-table: {}", row.cells.join(" | "));
            table.row(row.cells);
        }
    }
    b.table(table);
    if std::env::var("BENCH_BIG_TABLE_STEADY").as_deref() != Ok("0") {
        let steady = steady_state(b).await?;
        b.table(steady);
    }
    Ok(())
}

fn sizes(mode: Mode) -> Res<Vec<u64>> {
    if let Ok(list) = std::env::var("BENCH_BIG_TABLE") {
        return list
            .split(',')
            .map(|s| s.trim().replace('_', "").parse::<u64>().map_err(Into::into))
            .collect();
    }
    Ok(vec![match mode {
        Mode::Quick => 5_000,
        Mode::Default => 1_000_000,
        Mode::Full => 10_000_000,
    }])
}

async fn store(schema: &Schema, layout: Layout, connections: u32) -> Res<(PgStore, PgPool)> {
    let db = pool(&schema.url, connections).await?;
    let store = match layout {
        Layout::Plain => PgStore::new(db.clone()),
        Layout::Generations(k) => PgStore::new(db.clone())
            .generations(true)
            .generation_buckets(k),
    };
    store.migrate().await?;
    Ok((store, db))
}

fn engine(store: PgStore, retention: Duration) -> Res<Engine<PgStore>> {
    Ok(Engine::builder(store)
        .scope("bench")
        .key_expr("json:/k")
        .retention(retention)
        .build()?)
}

/// One row of the purge-round table.
struct RoundRow {
    cells: Vec<String>,
    ratio: f64,
}

async fn purge_round(schema: &Schema, layout: Layout, n: u64, window: Duration) -> Res<RoundRow> {
    let (store, db) = store(schema, layout, CLAIMERS as u32 + 2).await?;
    let t = Instant::now();
    let now_ms = now_us() / 1000;
    // Live records expire in a day, expired ones expired an hour ago.
    let (live, expired) = (now_ms + 86_400_000, now_ms - 3_600_000);
    match layout {
        Layout::Plain => {
            let round = ROUND.min(n / 2);
            fill_plain(&db, n, round, live, expired).await?;
        }
        Layout::Generations(_) => fill_generations(&db, n, live, expired).await?,
    }
    eprintln!(
        "big-table: {n} records ({layout:?}) filled in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let before = size(&db).await?;
    let engine = engine(store.clone(), Duration::from_secs(86_400))?;
    // Warm up the connections and the plan cache.
    let mut rng = Rng::new(1);
    for _ in 0..50 {
        claim(&engine, &mut rng).await?;
    }

    let stop = Arc::new(AtomicBool::new(false));
    let tasks = claimers(&engine, &stop, CLAIMERS, 100);
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let t1 = Instant::now();
    let mut removed = 0;
    let mut failures = 0;
    loop {
        // Transient failures are tried again, as the Purger would.
        let n = match store.purge_expired(None, now_us() / 1000, BATCH).await {
            Ok(n) => n,
            Err(e) if failures < 5 && e.is_infrastructure() => {
                failures += 1;
                eprintln!("big-table: purge failed ({e}); trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        removed += n;
        if n < u64::from(BATCH) {
            break;
        }
    }
    let took = t1.elapsed();
    if took < window {
        tokio::time::sleep(window - took).await;
    }
    let t2 = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let all = claims_of(tasks).await?;
    let (idle, during) = (phase(&all, t0, t1), phase(&all, t1, t2));
    if layout != Layout::Plain {
        // The rotation reports the statistics' estimate: count instead.
        removed = n / 2;
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM onceonly_keys WHERE idem_key NOT LIKE 'new-%'",
        )
        .fetch_one(&db)
        .await?;
        if left as u64 != n - n / 2 {
            return Err(format!(
                "generations: {left} old records left, expected {}",
                n - n / 2
            )
            .into());
        }
    }
    let after = size(&db).await?;
    let (p99_idle, p99_during) = (percentile(&idle, 0.99), percentile(&during, 0.99));
    let ratio = p99_during.as_secs_f64() / p99_idle.as_secs_f64().max(1e-9);
    Ok(RoundRow {
        cells: vec![
            n.to_string(),
            layout.name(),
            ms(percentile(&idle, 0.5)),
            ms(p99_idle),
            ms(percentile(&during, 0.5)),
            ms(p99_during),
            format!("{ratio:.2}×"),
            ms(during.last().copied().unwrap_or_default()),
            format!("{:.2} s", took.as_secs_f64()),
            removed.to_string(),
            format!("{} → {}", mib(before), mib(after)),
        ],
        ratio,
    })
}

fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1_048_576.0)
}

/// The dedup table's size with its indexes (all partitions).
async fn size(db: &PgPool) -> Res<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COALESCE(sum(pg_total_relation_size(c.oid)), 0)::bigint FROM pg_class c \
         JOIN pg_namespace s ON s.oid = c.relnamespace \
         WHERE s.nspname = current_schema() AND c.relkind = 'r' \
         AND c.relname ~ '^onceonly_keys(_g[01](_b[0-9]+)?)?$'",
    )
    .fetch_one(db)
    .await?)
}

/// Inserts `count` records numbered from `first` into `table` (md5 keys,
/// random order as real keys are) expiring at `expires`, with `extra`
/// columns (`generation`).
async fn insert_rows(
    db: &PgPool,
    table: &str,
    first: u64,
    count: u64,
    expires: i64,
    generation: Option<i16>,
) -> Res<()> {
    let (col, val) = match generation {
        Some(g) => (", generation", format!(", {g}")),
        None => ("", String::new()),
    };
    // In slices, so that no statement runs for many minutes.
    let slice = 5_000_000;
    let mut from = first;
    while from < first + count {
        let to = (from + slice).min(first + count);
        sqlx::query(&format!(
            "INSERT INTO {table} (scope, idem_key, result, created_at_ms, expires_at_ms{col}) \
             SELECT 'bench', md5(g::text), '\\x31'::bytea, $1 - 86400000, $1{val} \
             FROM generate_series($2::bigint, $3::bigint - 1) AS g"
        ))
        .bind(expires)
        .bind(i64::try_from(from)?)
        .bind(i64::try_from(to)?)
        .execute(db)
        .await?;
        from = to;
    }
    Ok(())
}

async fn exec(db: &PgPool, sql: &str) -> Res<()> {
    sqlx::query(sql).execute(db).await?;
    Ok(())
}

/// The plain table with `n` records, `expired` of them expired: loaded
/// without indexes, which are built after.
async fn fill_plain(db: &PgPool, n: u64, expired: u64, live_at: i64, expired_at: i64) -> Res<()> {
    exec(db, "SET maintenance_work_mem = '1GB'").await?;
    exec(
        db,
        "ALTER TABLE onceonly_keys DROP CONSTRAINT onceonly_keys_pkey",
    )
    .await?;
    exec(db, "DROP INDEX onceonly_keys_expires_at").await?;
    insert_rows(db, "onceonly_keys", 0, expired, expired_at, None).await?;
    insert_rows(db, "onceonly_keys", expired, n - expired, live_at, None).await?;
    exec(
        db,
        "ALTER TABLE onceonly_keys ADD PRIMARY KEY (scope, idem_key)",
    )
    .await?;
    exec(
        db,
        "CREATE INDEX onceonly_keys_expires_at ON onceonly_keys (expires_at_ms)",
    )
    .await?;
    exec(db, "VACUUM ANALYZE onceonly_keys").await?;
    Ok(())
}

/// The generations layout with `n` records: half live in the current
/// generation (0), half expired in the other (1). Each partition is
/// detached, loaded without indexes, indexed and attached again (a
/// generation split into buckets is loaded through its routing, and its
/// indexes are built bucket by bucket).
async fn fill_generations(db: &PgPool, n: u64, live_at: i64, expired_at: i64) -> Res<()> {
    exec(db, "SET maintenance_work_mem = '1GB'").await?;
    let halves = [(0_i16, n - n / 2, live_at), (1_i16, n / 2, expired_at)];
    for (g, count, expires) in halves {
        let part = format!("onceonly_keys_g{g}");
        exec(
            db,
            &format!("ALTER TABLE onceonly_keys DETACH PARTITION {part}"),
        )
        .await?;
        // The detached copies of the partitioned indexes go; new ones are
        // built after the load and match the parent's again.
        let indexes: Vec<String> = sqlx::query_scalar(
            "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = to_regclass($1)",
        )
        .bind(&part)
        .fetch_all(db)
        .await?;
        let pkey: Option<String> = sqlx::query_scalar(
            "SELECT conname::text FROM pg_constraint WHERE conrelid = to_regclass($1) AND contype = 'p'",
        )
        .bind(&part)
        .fetch_optional(db)
        .await?;
        if let Some(pkey) = pkey {
            exec(db, &format!("ALTER TABLE {part} DROP CONSTRAINT {pkey}")).await?;
        }
        for index in indexes {
            exec(db, &format!("DROP INDEX IF EXISTS {index}")).await?;
        }
        insert_rows(db, &part, u64::from(g as u16) * n, count, expires, Some(g)).await?;
        exec(
            db,
            &format!("ALTER TABLE {part} ADD PRIMARY KEY (scope, idem_key, generation)"),
        )
        .await?;
        exec(db, &format!("CREATE INDEX ON {part} (expires_at_ms)")).await?;
        exec(
            db,
            &format!("ALTER TABLE {part} ADD CONSTRAINT {part}_g CHECK (generation = {g})"),
        )
        .await?;
        exec(
            db,
            &format!("ALTER TABLE onceonly_keys ATTACH PARTITION {part} FOR VALUES IN ({g})"),
        )
        .await?;
        exec(db, &format!("VACUUM ANALYZE {part}")).await?;
    }
    exec(db, "UPDATE onceonly_keys_generation SET current = 0").await?;
    Ok(())
}

/// The steady-state table: claims of short-lived keys with a purge every
/// second, plain vs generations, with and without a held `xmin`.
async fn steady_state(b: &mut Bench) -> Res<Table> {
    let (ttl, run, every) = match b.mode {
        Mode::Quick => (Duration::from_secs(1), Duration::from_secs(2), 1),
        Mode::Default => (Duration::from_secs(10), Duration::from_secs(60), 10),
        Mode::Full => (Duration::from_secs(20), Duration::from_secs(180), 30),
    };
    let samples: Vec<u64> = (0..=run.as_secs() / every).map(|i| i * every).collect();
    let mut columns: Vec<String> = vec!["layout".into(), "xmin held".into()];
    columns.extend(samples.iter().map(|s| format!("size at {s} s")));
    columns.extend([
        "claims".into(),
        "dead rows at end".into(),
        "autovacuum runs".into(),
    ]);
    let header: Vec<&str> = columns.iter().map(String::as_str).collect();
    let mut table = Table::new(
        format!(
            "Steady state: {CLAIMERS} claimers of keys that live {} s, a purge every second, for {} s: \
             table + index size over time",
            ttl.as_secs(),
            run.as_secs()
        ),
        &header,
    );
    let split = Layout::Generations(onceonly::store::postgres::DEFAULT_GENERATION_BUCKETS);
    for layout in [Layout::Plain, split] {
        for held in [false, true] {
            let schema = b.schema("steady").await?;
            let row = steady_run(&schema, layout, held, ttl, run, every).await;
            b.drop_schema(&schema).await;
            table.row(row?);
        }
    }
    Ok(table)
}

async fn steady_run(
    schema: &Schema,
    layout: Layout,
    held: bool,
    ttl: Duration,
    run: Duration,
    every: u64,
) -> Res<Vec<String>> {
    let (store, db) = store(schema, layout, CLAIMERS as u32 + 3).await?;
    let engine = engine(store.clone(), ttl)?;
    // A transaction that holds back the xmin horizon: it read something
    // (another table) and stays open.
    let mut holder = if held {
        let mut conn = db.acquire().await?;
        sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT count(*) FROM pg_class")
            .execute(&mut *conn)
            .await?;
        Some(conn)
    } else {
        None
    };
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = claimers(&engine, &stop, CLAIMERS, 500);
    let purger = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                loop {
                    let n = store.purge_expired(None, now_us() / 1000, BATCH).await?;
                    if n < u64::from(BATCH) {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok::<_, onceonly::StoreError>(())
        })
    };
    let started = Instant::now();
    let mut sizes = Vec::new();
    for s in (0..=run.as_secs()).step_by(every as usize) {
        let at = started + Duration::from_secs(s);
        tokio::time::sleep_until(at.into()).await;
        sizes.push(mib(size(&db).await?));
    }
    stop.store(true, Ordering::Relaxed);
    let claims = claims_of(tasks).await?.len();
    purger.await??;
    if let Some(conn) = holder.as_mut() {
        sqlx::query("ROLLBACK").execute(&mut **conn).await?;
    }
    drop(holder);
    let (dead, vacuums): (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(sum(n_dead_tup), 0)::bigint, COALESCE(sum(autovacuum_count), 0)::bigint \
         FROM pg_stat_user_tables WHERE schemaname = current_schema() \
         AND relname ~ '^onceonly_keys(_g[01](_b[0-9]+)?)?$'",
    )
    .fetch_one(&db)
    .await?;
    let mut row = vec![layout.name(), if held { "yes" } else { "no" }.to_owned()];
    row.extend(sizes);
    row.extend([claims.to_string(), dead.to_string(), vacuums.to_string()]);
    Ok(row)
}
