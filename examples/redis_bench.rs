//! Benchmark of the Redis tier (not a test: it prints a table, asserts
//! nothing about speed):
//!
//! 1. standalone fenced claims per second (`RedisStore::claim`, one Lua
//!    script each) against `redis-benchmark` running `SET key v NX PX` at the
//!    same concurrency, on this machine, as a ratio;
//! 2. the latency of answering a duplicate with the two-tier store (Redis
//!    hit, no SQL) against the SQL store alone.
//!
//! ```text
//! cargo run --release --example redis_bench --features redis,postgres
//! cargo run --example redis_bench --features redis,postgres -- --quick   # smoke run
//! ```
//! The table is also written to `target/bench/redis.md`.

// The benchmarks' statistics (percentiles, Markdown tables).
#[path = "bench/stats.rs"]
mod stats;

use std::time::{Duration, Instant};

use clap::Parser;
use onceonly::redis::{CachedStore, RedisStore};
use onceonly::{Delivery, Engine, Handler, HandlerError, Json, PgStore, SqlStore};
use sqlx::Postgres;
use stats::percentile;

/// Redis tier benchmark.
#[derive(Parser, Debug)]
struct Args {
    /// Redis URL.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Postgres URL (for the two-tier comparison).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1/test"
    )]
    database_url: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 50)]
    concurrency: usize,
    /// Claims to make.
    #[arg(long, default_value_t = 100_000)]
    claims: usize,
    /// Duplicate deliveries to time per store.
    #[arg(long, default_value_t = 5_000)]
    duplicates: usize,
    /// A short run for CI.
    #[arg(long)]
    quick: bool,
}

/// A handler with one trivial write, so the first delivery commits.
struct Noop;

#[async_trait::async_trait]
impl Handler<Postgres> for Noop {
    type Input = Json<serde_json::Value>;
    type Output = u32;

    async fn handle(
        &self,
        _tx: onceonly::Tx<sqlx::Postgres>,
        _input: Json<serde_json::Value>,
        _d: &Delivery,
    ) -> Result<u32, HandlerError> {
        Ok(1)
    }
}

async fn duplicate_latencies<S: SqlStore<Db = Postgres>>(
    engine: &Engine<S>,
    n: usize,
) -> Vec<Duration> {
    let body = br#"{"id":"bench-duplicate"}"#.to_vec();
    let first = engine.process(&Noop, &Delivery::new(body.clone())).await;
    assert!(first.outcome.is_done(), "{:?}", first.outcome);
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = engine.process(&Noop, &Delivery::new(body.clone())).await;
        times.push(t.elapsed());
        assert_eq!(r.outcome.kind().as_str(), "duplicate");
    }
    times.sort();
    times
}

fn redis_benchmark(args: &Args, n: usize) -> Option<f64> {
    let out = std::process::Command::new("redis-benchmark")
        .args(["-c", &args.concurrency.to_string(), "-n", &n.to_string()])
        .args(["-r", "100000000", "--csv"])
        .args([
            "SET",
            "onceonly-bench:__rand_int__",
            "v",
            "NX",
            "PX",
            "60000",
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "test","rps",... header, then "SET ...","123456.78",...
    text.lines()
        .filter(|l| l.starts_with("\"SET"))
        .find_map(|l| l.split(',').nth(1))
        .and_then(|v| v.trim_matches('"').parse().ok())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = Args::parse();
    if args.quick {
        args.claims = 2_000;
        args.duplicates = 200;
    }
    let run = uuid::Uuid::new_v4().simple().to_string();

    // 1. Claims per second.
    let store = RedisStore::connect(&args.redis_url)
        .await?
        .with_prefix(format!("onceonly-bench-{run}:"))
        .with_lease(Duration::from_secs(60));
    let per_task = args.claims / args.concurrency.max(1);
    let started = Instant::now();
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..per_task {
                    store.claim("bench", &format!("{t}-{i}"), None).await?;
                }
                Ok::<_, onceonly::redis::RedisError>(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    let ours = (per_task * args.concurrency) as f64 / started.elapsed().as_secs_f64();
    let baseline = redis_benchmark(&args, args.claims);

    // 2. Duplicate latency: two tiers vs SQL alone.
    let schema = format!("redis_bench_{run}");
    let admin = sqlx::PgPool::connect(&args.database_url).await?;
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await?;
    let sep = if args.database_url.contains('?') {
        '&'
    } else {
        '?'
    };
    let url = format!(
        "{}{sep}options=-c%20search_path%3D{schema}",
        args.database_url
    );
    let sql = PgStore::connect(&url).await?;
    sql.migrate().await?;
    let sql_only = Engine::builder(sql.clone())
        .scope("sql")
        .key_expr("json:/id")
        .build()?;
    let tiered = Engine::builder(
        CachedStore::connect(sql, &args.redis_url)?.with_prefix(format!("onceonly-bench-{run}:")),
    )
    .scope("tiered")
    .key_expr("json:/id")
    .build()?;
    let sql_times = duplicate_latencies(&sql_only, args.duplicates).await;
    let tier_times = duplicate_latencies(&tiered, args.duplicates).await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await?;

    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mut table = String::new();
    table.push_str(&format!(
        "| Redis tier ({} claims, {} clients{}) | value | baseline | ratio |\n|---|---|---|---|\n",
        args.claims,
        args.concurrency,
        if cfg!(debug_assertions) {
            ", debug build"
        } else {
            ""
        }
    ));
    match baseline {
        Some(b) => table.push_str(&format!(
            "| fenced claims/s (Lua SET NX PX) | {ours:.0} | redis-benchmark SET NX PX: {b:.0} | {:.2}× |\n",
            ours / b
        )),
        None => table.push_str(&format!(
            "| fenced claims/s (Lua SET NX PX) | {ours:.0} | redis-benchmark not found | – |\n"
        )),
    }
    for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
        let (t, s) = (percentile(&tier_times, p), percentile(&sql_times, p));
        table.push_str(&format!(
            "| duplicate latency {name}, two-tier | {:.0} µs | SQL only: {:.0} µs | {:.2}× |\n",
            us(t),
            us(s),
            us(t) / us(s).max(f64::MIN_POSITIVE)
        ));
    }
    print!("{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("redis.md"), &table)?;
    Ok(())
}
