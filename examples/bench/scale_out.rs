//! Scale-out, shared by the Kafka and AMQP scenarios: 1, 2 and 4 onceonly
//! consumer processes (one Kafka group, or competing consumers of one AMQP
//! queue), started together, drain one backlog.
//!
//! On 2 cores throughput cannot grow with processes; what must not grow is
//! the CPU each message costs. So every row reports, beside the rate, the
//! CPU milliseconds per 1,000 messages of all consumer processes together
//! and of the database backends they use, and the machine's CPU use during
//! the drain (near 100 %: the consumers and the database share the cores;
//! well below: the broker or a lock is the bound).

use super::child::ChildSpec;
use super::common::{Bench, Child, Observer, Plan, Res, drain_backlog};
use super::meter::DbClient;
use super::stats::{Table, median};

/// Process counts of a scale-out table.
const PROCESSES: [usize; 3] = [1, 2, 4];

/// One drain by `procs` processes.
#[derive(Clone, Copy, Debug)]
pub struct ScaleRun {
    /// Messages per second, first commit to last.
    pub rate: f64,
    /// The machine's CPU use during the drain, in percent of all cores.
    pub busy: f64,
    /// CPU ms per 1,000 messages of all consumer processes together.
    pub app_cpu: f64,
    /// CPU ms per 1,000 messages of their database backends.
    pub db_cpu: Option<f64>,
}

/// Starts one child per spec (all sharing the database client `client`),
/// waits until the backlog's effects committed and stops them.
pub async fn drain(
    b: &Bench,
    specs: &[ChildSpec],
    client: &DbClient,
    observer: &Observer,
    plan: &Plan,
) -> Res<ScaleRun> {
    let cpu_before = cpu_ticks();
    let mut children = Vec::new();
    let mut windows = Vec::new();
    for spec in specs {
        let child = Child::spawn(spec).await?;
        windows.push(b.window(&child, client).await?);
        children.push(child);
    }
    // The rate runs from the first commit to the last, so the first join
    // does not count; rebalances as the others join do, as when a group
    // scales out on a backlog.
    let first = children.first_mut().ok_or("no consumer")?;
    let rate = drain_backlog(observer, plan, true, first).await?;
    let busy = match (cpu_before, cpu_ticks()) {
        (Some((busy0, all0)), Some((busy1, all1))) if all1 > all0 => {
            100.0 * (busy1 - busy0) as f64 / (all1 - all0) as f64
        }
        _ => f64::NAN,
    };
    let mut app_cpu = 0.0;
    let mut db_cpu = None;
    for (i, window) in windows.into_iter().enumerate() {
        let cost = b.close_window(window, plan.keys.len()).await?;
        app_cpu += cost.app_cpu.unwrap_or(f64::NAN);
        // The children share one application name: every window sees all
        // their backends, so the first one's database CPU is the total.
        if i == 0 {
            db_cpu = cost.db_cpu;
        }
    }
    for child in children {
        child.stop().await?;
    }
    Ok(ScaleRun {
        rate,
        busy,
        app_cpu,
        db_cpu,
    })
}

/// A scale-out table: one row per process count, medians of the runs,
/// with ratios to the single process.
struct ScaleTable {
    table: Table,
    single: Option<ScaleRun>,
}

impl ScaleTable {
    fn new(title: String) -> Self {
        Self {
            table: Table::new(
                title,
                &[
                    "processes",
                    "msgs/s",
                    "vs 1 process",
                    "CPU ms / 1k: consumers",
                    "CPU ms / 1k: DB",
                    "CPU / msg vs 1 process",
                    "CPU busy (all cores)",
                    "msgs / rows / distinct keys",
                ],
            ),
            single: None,
        }
    }

    /// Adds the row of `procs` processes from its runs.
    fn row(&mut self, procs: usize, runs: &[ScaleRun], counts: String) {
        let pick = |f: fn(&ScaleRun) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        let m = ScaleRun {
            rate: pick(|r| r.rate),
            busy: pick(|r| r.busy),
            app_cpu: pick(|r| r.app_cpu),
            db_cpu: runs
                .iter()
                .all(|r| r.db_cpu.is_some())
                .then(|| pick(|r| r.db_cpu.unwrap_or(f64::NAN))),
        };
        let one = *self.single.get_or_insert(m);
        let total = |r: &ScaleRun| r.app_cpu + r.db_cpu.unwrap_or(0.0);
        self.table.row(vec![
            procs.to_string(),
            format!("{:.0}", m.rate),
            format!("{:.2}×", m.rate / one.rate),
            format!("{:.0}", m.app_cpu),
            m.db_cpu.map_or("–".to_owned(), |v| format!("{v:.0}")),
            format!("{:.2}×", total(&m) / total(&one)),
            format!("{:.0} %", m.busy),
            counts,
        ]);
    }

    fn finish(self, b: &mut Bench) {
        b.table(self.table);
    }
}

/// Messages a scale-out run drains: long enough that joins and rebalances
/// do not dominate (a smoke run only checks that it works).
fn backlog(b: &Bench) -> usize {
    if b.mode == super::common::Mode::Quick {
        b.sizes.backlog
    } else {
        b.sizes.backlog * 8
    }
}

/// Runs `run(bench, processes, backlog, seed)` `b.runs` times for every
/// process count and prints the table titled `title(backlog)`; `run`
/// returns its measures and the ledger counts.
pub async fn measure(
    b: &mut Bench,
    title: impl FnOnce(usize) -> String,
    seed: u64,
    mut run: impl AsyncFnMut(&mut Bench, usize, usize, u64) -> Res<(ScaleRun, String)>,
) -> Res<()> {
    // `BENCH_SCALE_OUT=0`: the per-transport tables only.
    if std::env::var_os("BENCH_SCALE_OUT").is_some_and(|v| v == "0") {
        return Ok(());
    }
    let backlog = backlog(b);
    let mut table = ScaleTable::new(title(backlog));
    for procs in PROCESSES {
        let mut runs = Vec::new();
        let mut counts = String::new();
        for r in 0..b.runs {
            let (measured, rows) = run(b, procs, backlog, seed + r as u64).await?;
            runs.push(measured);
            counts = rows;
        }
        table.row(procs, &runs, counts);
    }
    table.finish(b);
    Ok(())
}

/// `(busy, total)` jiffies of all cores from `/proc/stat`.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?;
    let v: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle + iowait
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}
