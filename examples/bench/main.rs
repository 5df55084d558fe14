//! The benchmark harness (not a test: it prints tables and asserts nothing
//! about speed). One invocation runs, against the same services, each
//! scenario side by side with a baseline that does the same business writes
//! without dedup (and, for the transports, with the dedup a user would
//! write by hand), and prints one Markdown table per scenario:
//!
//! - `kafka`: Kafka → Postgres, a plain rdkafka consumer (no dedup, and
//!   the hand-written inbox of [`inbox`]) vs
//!   `onceonly::kafka::KafkaConsumer` (default and optimistic), per
//!   message and batched (100, 1000);
//! - `amqp`: AMQP → Postgres, a plain lapin consumer (no dedup, and the
//!   hand-written inbox) vs `AmqpConsumer` (default and optimistic);
//! - `http`: `POST /orders`, a plain axum handler (no dedup, and the
//!   hand-written inbox) vs `IdempotencyLayer` on Postgres (default and
//!   optimistic), SQLite and the Redis two-tier;
//! - `growth`: claim latency with 0 / 100k / 1M / 10M existing records, and
//!   while a bounded purge runs;
//! - `purge`: claim stalls while 200k expired records are purged;
//! - `big-table`: a big dedup table, plain vs generations layout: claim
//!   latency during a purge, and the table's size in steady state with and
//!   without a held `xmin` (`BENCH_BIG_TABLE=10000000,50000000,100000000`
//!   for the 100M-record run);
//! - `memory`: peak RSS of the AMQP consumer draining a large backlog
//!   (1,000,000 messages with `--full`);
//! - `outbox`: the relay draining a Kafka backlog against its DB-only
//!   drain (the same take, lease and mark statements, a publisher that
//!   confirms at once) and a plain producer, end-to-end latency, and the
//!   drain of 400 webhooks to a receiver failing one call in ten, per
//!   ordering;
//! - `registry`: Avro and Protobuf payloads decoded through a
//!   `SchemaRegistry` against the same records parsed as JSON, alone and
//!   inside a claim.
//!
//! The Kafka, AMQP and HTTP tables also show what a delivery costs:
//! database round trips and statements per delivery, counted by a
//! PostgreSQL proxy in the bench (see `meter.rs`), and CPU milliseconds per
//! 1,000 deliveries of the process under test and of the database backends
//! serving it.
//!
//! Each transport scenario runs for every duplicate ratio of `--dup`
//! (duplicates are redeliveries of earlier keys). Consumers and servers run
//! as child processes (this binary with the hidden `--child` flag), so their
//! peak RSS (`VmHWM`) is measured alone. A scenario that fails its
//! correctness check (rows ≠ distinct keys, messages left unconsumed) makes
//! the run exit non-zero. Tables also go to `target/bench/bench.md`.
//!
//! ```text
//! scripts/services
//! cargo run --release --example bench --all-features               # default sizes
//! cargo run --release --example bench --all-features -- --full     # 1M / 10M sizes
//! cargo run --example bench --all-features -- --quick              # CI smoke run
//! cargo run --release --example bench --all-features -- --scenario kafka,http --dup 0 --runs 5
//! ```

mod amqp;
mod big_table;
mod child;
mod common;
mod growth;
mod http;
mod inbox;
mod kafka;
mod ledger;
mod memory;
mod meter;
mod mock;
mod outbox;
mod registry;
mod scale_out;
mod stats;
mod variant;

use std::process::ExitCode;

use clap::{Parser, ValueEnum};

use common::{Bench, Mode};

/// A scenario to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Kafka,
    Amqp,
    Http,
    Growth,
    Memory,
    Purge,
    Outbox,
    BigTable,
    Registry,
    All,
}

/// Benchmarks onceonly against no-dedup baselines.
#[derive(Parser, Debug)]
#[command(after_help = "Tables are printed and written to target/bench/bench.md (see --out).")]
struct Args {
    /// Small sizes, one run each: a smoke test for CI (seconds per scenario).
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    /// Large sizes: 10M-record growth, 1M-message memory drain.
    #[arg(long)]
    full: bool,
    /// Scenarios to run (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    scenario: Vec<Scenario>,
    /// Duplicate ratios in percent (comma-separated).
    #[arg(long, value_delimiter = ',')]
    dup: Option<Vec<u32>>,
    /// Runs per measurement (the median is reported); default 3, 1 with --quick.
    #[arg(long)]
    runs: Option<usize>,
    /// Postgres URL.
    #[arg(
        long,
        env = "ONCEONLY_PG_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pg_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "ONCEONLY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Run the Kafka scenario on an in-process librdkafka mock cluster
    /// instead of `--brokers` (a broker that is not the bound).
    #[arg(long)]
    kafka_mock: bool,
    /// AMQP URL.
    #[arg(
        long,
        env = "ONCEONLY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// Redis URL.
    #[arg(
        long,
        env = "ONCEONLY_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// Where the tables are written.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/target/bench/bench.md"))]
    out: std::path::PathBuf,
    /// How database round trips and statements per delivery are counted:
    /// `separate` (default) adds one run per variant through a counting
    /// PostgreSQL proxy and takes rates from the direct runs; `inline`
    /// (default with --quick) sends every run through the proxy; `off`.
    #[arg(long, value_enum)]
    counts: Option<meter::Counting>,
    /// Internal: run as a consumer or server child process (JSON spec).
    #[arg(long, hide = true)]
    child: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: cannot start tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(spec) = &args.child {
        return match runtime.block_on(child::run(spec)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench child: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match runtime.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench: some scenario failed its correctness check (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<bool, common::BoxError> {
    let mode = if args.quick {
        Mode::Quick
    } else if args.full {
        Mode::Full
    } else {
        Mode::Default
    };
    let all = args.scenario.contains(&Scenario::All);
    let wants = |s: Scenario| all || args.scenario.contains(&s);
    let dups = args.dup.clone().unwrap_or_else(|| {
        if args.quick {
            vec![20]
        } else {
            vec![0, 20, 90]
        }
    });
    if let Some(bad) = dups.iter().find(|d| **d >= 100) {
        return Err(format!("--dup {bad}: a duplicate ratio is a percentage below 100").into());
    }
    let kafka_mock = if args.kafka_mock {
        Some(std::sync::Arc::new(mock::MockBroker::start()?))
    } else {
        None
    };
    let mut bench = Bench::new(
        mode,
        args.runs.unwrap_or(if args.quick { 1 } else { 3 }).max(1),
        dups,
        common::Services {
            pg_url: args.pg_url.clone(),
            brokers: match &kafka_mock {
                Some(m) => m.bootstrap.clone(),
                None => args.brokers.clone(),
            },
            kafka_mock,
            amqp_url: args.amqp_url.clone(),
            redis_url: args.redis_url.clone(),
        },
        args.counts.unwrap_or(if args.quick {
            meter::Counting::Inline
        } else {
            meter::Counting::Separate
        }),
    )
    .await?;
    bench.header();
    type Step = fn(&mut Bench) -> common::StepFuture<'_>;
    let steps: [(Scenario, &str, Step); 9] = [
        (Scenario::Kafka, "kafka", |b| Box::pin(kafka::run(b))),
        (Scenario::Amqp, "amqp", |b| Box::pin(amqp::run(b))),
        (Scenario::Http, "http", |b| Box::pin(http::run(b))),
        (Scenario::Growth, "growth", |b| {
            Box::pin(growth::run_growth(b))
        }),
        (Scenario::Purge, "purge", |b| Box::pin(growth::run_purge(b))),
        (Scenario::Memory, "memory", |b| Box::pin(memory::run(b))),
        (Scenario::Outbox, "outbox", |b| Box::pin(outbox::run(b))),
        (Scenario::BigTable, "big-table", |b| {
            Box::pin(big_table::run(b))
        }),
        (Scenario::Registry, "registry", |b| {
            Box::pin(registry::run(b))
        }),
    ];
    for (scenario, name, step) in steps {
        if !wants(scenario) {
            continue;
        }
        let started = std::time::Instant::now();
        eprintln!("== scenario {name}");
        if let Err(e) = step(&mut bench).await {
            eprintln!("scenario {name} FAILED: {e}");
            bench.fail(format!("{name}: {e}"));
        }
        eprintln!(
            "== scenario {name} took {:.1}s",
            started.elapsed().as_secs_f64()
        );
        bench.write(&args.out)?;
    }
    bench.targets();
    bench.write(&args.out)?;
    eprintln!("tables written to {}", args.out.display());
    Ok(bench.ok())
}
