//! Dedup-table growth (claim latency with 0 … 10M existing records, and
//! while a bounded purge runs) and purge under load (claim stalls while
//! expired records are purged in batches of 5000).
//!
//! A "claim" here is one `Engine::process` of a fresh key with a handler
//! that writes nothing: begin, claim (`INSERT … ON CONFLICT DO NOTHING`),
//! complete (`UPDATE … SET result`), commit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use onceonly::{Delivery, Engine, Handler, HandlerError, Json, PgStore, SqlStore};
use sqlx::{PgPool, Postgres};

use super::common::{Bench, Res, Rng, Schema, now_us, pool};
use super::stats::{Table, ms, percentile};

/// Records purged per statement.
const PURGE_BATCH: u32 = 5_000;

/// A handler with no writes: only the dedup record is written.
pub(super) struct Noop;

#[async_trait::async_trait]
impl Handler<Postgres> for Noop {
    type Input = Json<serde_json::Value>;
    type Output = u8;

    async fn handle(
        &self,
        _tx: onceonly::Tx<sqlx::Postgres>,
        _input: Json<serde_json::Value>,
        _d: &Delivery,
    ) -> Result<u8, HandlerError> {
        Ok(1)
    }
}

async fn engine(schema: &Schema, connections: u32) -> Res<(Engine<PgStore>, PgPool)> {
    let db = pool(&schema.url, connections).await?;
    let store = PgStore::new(db.clone());
    store.migrate().await?;
    let engine = Engine::builder(store)
        .scope("bench")
        .key_expr("json:/k")
        .build()?;
    Ok((engine, db))
}

/// One claim of a fresh random key; its duration.
pub(super) async fn claim(engine: &Engine<PgStore>, rng: &mut Rng) -> Res<Duration> {
    let body = format!(r#"{{"k":"new-{:016x}{:016x}"}}"#, rng.next(), rng.next());
    let t = Instant::now();
    let r = engine
        .process(&Noop, &Delivery::new(body.into_bytes()))
        .await;
    let took = t.elapsed();
    if !r.outcome.is_done() {
        return Err(format!("claim failed: {:?}", r.outcome).into());
    }
    Ok(took)
}

/// Adds records `from+1 ..= to` (already expired, so a purge can delete
/// them; a claim of a new key is unaffected) with `INSERT … SELECT
/// generate_series`, the indexes dropped during the load and rebuilt after.
async fn fill(db: &PgPool, schema: &str, from: u64, to: u64) -> Res<()> {
    if to <= from {
        return Ok(());
    }
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexname::text, indexdef::text FROM pg_indexes \
         WHERE schemaname = $1 AND tablename = 'onceonly_keys' AND indexname <> 'onceonly_keys_pkey'",
    )
    .bind(schema)
    .fetch_all(db)
    .await?;
    let big = to - from > 200_000;
    if big {
        sqlx::query("ALTER TABLE onceonly_keys DROP CONSTRAINT onceonly_keys_pkey")
            .execute(db)
            .await?;
        for (name, _) in &indexes {
            sqlx::query(&format!("DROP INDEX {name}"))
                .execute(db)
                .await?;
        }
    }
    let now_ms = now_us() / 1000;
    // Key order is random (md5), as real keys are.
    sqlx::query(
        "INSERT INTO onceonly_keys (scope, idem_key, fingerprint, result, source, created_at_ms, expires_at_ms) \
         SELECT 'bench', md5(g::text), NULL, '\\x31'::bytea, NULL, $1, $1 - 1 \
         FROM generate_series($2::bigint, $3::bigint) AS g",
    )
    .bind(now_ms - 86_400_000)
    .bind(i64::try_from(from + 1)?)
    .bind(i64::try_from(to)?)
    .execute(db)
    .await?;
    if big {
        sqlx::query("ALTER TABLE onceonly_keys ADD CONSTRAINT onceonly_keys_pkey PRIMARY KEY (scope, idem_key)")
            .execute(db)
            .await?;
        for (_, def) in &indexes {
            sqlx::query(def).execute(db).await?;
        }
    }
    sqlx::query("VACUUM ANALYZE onceonly_keys")
        .execute(db)
        .await?;
    Ok(())
}

/// Purges expired records in bounded batches until none are left or
/// `stop` is set; returns (rows purged, time taken).
async fn purge_loop(engine: Engine<PgStore>, stop: Arc<AtomicBool>) -> Res<(u64, Duration)> {
    let t = Instant::now();
    let mut total = 0;
    while !stop.load(Ordering::Relaxed) {
        let n = engine
            .store()
            .purge_expired(None, now_us() / 1000, PURGE_BATCH)
            .await?;
        total += n;
        if n < u64::from(PURGE_BATCH) {
            break;
        }
    }
    Ok((total, t.elapsed()))
}

pub async fn run_growth(b: &mut Bench) -> Res<()> {
    let schema = b.schema("growth").await?;
    let result = growth(b, &schema).await;
    b.drop_schema(&schema).await;
    let table = result?;
    b.table(table);
    Ok(())
}

async fn growth(b: &mut Bench, schema: &Schema) -> Res<Table> {
    let (engine, db) = engine(schema, 4).await?;
    let n = b.sizes.growth_claims;
    let mut table = Table::new(
        format!(
            "Dedup-table growth: claim + commit latency, {n} sequential claims of new random keys (Postgres)"
        ),
        &[
            "existing records",
            "p50",
            "p99",
            "claims/s",
            "p50 vs 0 records",
            "p99 vs 0 records",
        ],
    );
    let mut rng = Rng::new(42);
    let mut have = 0;
    let mut zero: Option<(Duration, Duration)> = None;
    let mut last = (0, Duration::ZERO, Duration::ZERO);
    let sizes = b.sizes.growth.clone();
    for &size in &sizes {
        let t = Instant::now();
        fill(&db, &schema.name, have, size).await?;
        if size > have {
            eprintln!(
                "growth: filled {size} records in {:.1}s",
                t.elapsed().as_secs_f64()
            );
        }
        have = size;
        // Warm up the connections and the plan cache.
        for _ in 0..50 {
            claim(&engine, &mut rng).await?;
        }
        let started = Instant::now();
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            times.push(claim(&engine, &mut rng).await?);
        }
        let rate = n as f64 / started.elapsed().as_secs_f64();
        times.sort();
        let (p50, p99) = (percentile(&times, 0.5), percentile(&times, 0.99));
        let z = *zero.get_or_insert((p50, p99));
        table.row(vec![
            format!("{size}"),
            ms(p50),
            ms(p99),
            format!("{rate:.0}"),
            format!("{:.2}×", p50.as_secs_f64() / z.0.as_secs_f64()),
            format!("{:.2}×", p99.as_secs_f64() / z.1.as_secs_f64()),
        ]);
        last = (size, p50, p99);
    }
    // The same while a bounded purge deletes the (expired) records.
    if have > 0 {
        let stop = Arc::new(AtomicBool::new(false));
        let purger = tokio::spawn(purge_loop(engine.clone(), stop.clone()));
        let started = Instant::now();
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            if purger.is_finished() {
                break;
            }
            times.push(claim(&engine, &mut rng).await?);
        }
        let elapsed = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        let (purged, _) = purger.await??;
        times.sort();
        let (p50, p99) = (percentile(&times, 0.5), percentile(&times, 0.99));
        let z = zero.unwrap_or((p50, p99));
        table.row(vec![
            format!(
                "{have}, during purge (batches of {PURGE_BATCH}; {purged} purged meanwhile, {} claims)",
                times.len()
            ),
            ms(p50),
            ms(p99),
            format!("{:.0}", times.len() as f64 / elapsed.as_secs_f64()),
            format!("{:.2}×", p50.as_secs_f64() / z.0.as_secs_f64()),
            format!("{:.2}×", p99.as_secs_f64() / z.1.as_secs_f64()),
        ]);
    }
    if let Some(z) = zero {
        let (size, p50, p99) = last;
        let ratio = p50.as_secs_f64() / z.0.as_secs_f64();
        b.target(
            &format!("claim latency p50 at {size} records vs 0"),
            format!(
                "{ratio:.2}× ({} vs {}; p99 {:.2}×)",
                ms(p50),
                ms(z.0),
                p99.as_secs_f64() / z.1.as_secs_f64()
            ),
            "≤ 1.5× (at 10M records: --full)",
            ratio <= 1.5,
        );
    }
    Ok(table)
}

/// When each claim started, and how long it took.
pub(super) type Timed = Vec<(Instant, Duration)>;

/// `n` tasks that claim new keys one after the other until `stop`, each
/// recording its claims (seeds `seed`, `seed + 1`, …).
pub(super) fn claimers(
    engine: &Engine<PgStore>,
    stop: &Arc<AtomicBool>,
    n: usize,
    seed: u64,
) -> tokio::task::JoinSet<Res<Timed>> {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (engine, stop) = (engine.clone(), stop.clone());
        tasks.spawn(async move {
            let mut rng = Rng::new(seed + i as u64);
            let mut times = Timed::new();
            while !stop.load(Ordering::Relaxed) {
                let at = Instant::now();
                times.push((at, claim(&engine, &mut rng).await?));
            }
            Ok(times)
        });
    }
    tasks
}

/// Every claim the tasks of [`claimers`] recorded.
pub(super) async fn claims_of(mut tasks: tokio::task::JoinSet<Res<Timed>>) -> Res<Timed> {
    let mut all = Timed::new();
    while let Some(done) = tasks.join_next().await {
        all.extend(done??);
    }
    Ok(all)
}

/// The durations of the claims that started in `from..to`, sorted.
pub(super) fn phase(all: &Timed, from: Instant, to: Instant) -> Vec<Duration> {
    let mut v: Vec<Duration> = all
        .iter()
        .filter(|(at, _)| *at >= from && *at < to)
        .map(|(_, d)| *d)
        .collect();
    v.sort();
    v
}

pub async fn run_purge(b: &mut Bench) -> Res<()> {
    let schema = b.schema("purge").await?;
    let result = purge(b, &schema).await;
    b.drop_schema(&schema).await;
    let table = result?;
    b.table(table);
    Ok(())
}

/// Inserters claim new keys continuously (4 at once); first without purge,
/// then while the expired records are purged.
async fn purge(b: &mut Bench, schema: &Schema) -> Res<Table> {
    const INSERTERS: usize = 4;
    let (engine, db) = engine(schema, 8).await?;
    let rows = b.sizes.purge_rows;
    fill(&db, &schema.name, 0, rows).await?;
    let quiet = if b.mode == super::common::Mode::Quick {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(4)
    };

    let stop = Arc::new(AtomicBool::new(false));
    let inserters = claimers(&engine, &stop, INSERTERS, 7);
    let t0 = Instant::now();
    tokio::time::sleep(quiet).await;
    let t1 = Instant::now();
    let (purged, took) = purge_loop(engine.clone(), Arc::new(AtomicBool::new(false))).await?;
    let t2 = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let all = claims_of(inserters).await?;
    let (without, during) = (phase(&all, t0, t1), phase(&all, t1, t2));
    let left: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM onceonly_keys WHERE idem_key NOT LIKE 'new-%'")
            .fetch_one(&db)
            .await?;
    b.check(purged == rows && left == 0, || {
        format!("purge: {purged} of {rows} expired records purged, {left} left")
    });
    let mut table = Table::new(
        format!(
            "Purge under load: {rows} expired records purged in batches of {PURGE_BATCH} ({purged} in {:.1}s, {:.0} rows/s) while {INSERTERS} inserters claim new keys",
            took.as_secs_f64(),
            purged as f64 / took.as_secs_f64().max(1e-9)
        ),
        &[
            "phase",
            "claims",
            "claims/s",
            "p50",
            "p99",
            "worst stall (max)",
            "p99 vs without purge",
        ],
    );
    let p99_without = percentile(&without, 0.99);
    for (name, v, span) in [
        ("without purge", &without, t1 - t0),
        ("during purge", &during, t2 - t1),
    ] {
        let p99 = percentile(v, 0.99);
        table.row(vec![
            name.to_owned(),
            v.len().to_string(),
            format!("{:.0}", v.len() as f64 / span.as_secs_f64().max(1e-9)),
            ms(percentile(v, 0.5)),
            ms(p99),
            ms(v.last().copied().unwrap_or_default()),
            format!(
                "{:.2}×",
                p99.as_secs_f64() / p99_without.as_secs_f64().max(1e-9)
            ),
        ]);
    }
    Ok(table)
}
