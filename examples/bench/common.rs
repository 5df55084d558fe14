//! What every scenario shares: sizes per mode, the report (tables, targets,
//! failures), a Postgres schema per run, the commit observer that measures
//! end-to-end latency, child processes and their peak RSS, and key plans
//! with duplicates.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child as TokioChild, ChildStdin, Command};

use super::child::ChildSpec;
use super::meter::{Cost, Counting, DbClient, PgProxy, cost_cells, with_application_name};
use super::stats::{Table, median, ms, percentile};

/// Any error of the harness.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// A table's columns: `first`, the cost columns, then `last`.
pub fn columns<'a>(first: &[&'a str], last: &'a str) -> Vec<&'a str> {
    let mut v = first.to_vec();
    v.extend(super::meter::COST_COLUMNS);
    v.push(last);
    v
}

/// The result of a harness step.
pub type Res<T> = Result<T, BoxError>;
/// A scenario's future.
pub type StepFuture<'a> = Pin<Box<dyn Future<Output = Res<()>> + 'a>>;

/// Benchmark size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Quick,
    Default,
    Full,
}

/// Sizes of every scenario for one mode.
#[derive(Clone, Debug)]
pub struct Sizes {
    /// Backlog messages drained per consumer run (Kafka and AMQP).
    pub backlog: usize,
    /// Messages produced at a steady rate after the backlog, for latency.
    pub paced: usize,
    /// Rate of the paced messages, per second.
    pub paced_rate: u32,
    /// Requests per HTTP run.
    pub requests: usize,
    /// Concurrent HTTP clients.
    pub http_clients: usize,
    /// Existing dedup records for the growth scenario.
    pub growth: Vec<u64>,
    /// Claims timed per growth size.
    pub growth_claims: usize,
    /// Expired records purged in the purge scenario.
    pub purge_rows: u64,
    /// Messages drained in the memory scenario.
    pub memory: usize,
}

impl Sizes {
    fn of(mode: Mode) -> Self {
        match mode {
            // A smoke run: every scenario's code path and correctness
            // checks, in seconds (its numbers mean little).
            Mode::Quick => Self {
                backlog: 400,
                paced: 10,
                paced_rate: 200,
                requests: 100,
                http_clients: 8,
                growth: vec![0, 10_000],
                growth_claims: 100,
                purge_rows: 5_000,
                memory: 2_000,
            },
            Mode::Default => Self {
                backlog: 5_000,
                paced: 400,
                paced_rate: 200,
                requests: 5_000,
                http_clients: 32,
                growth: vec![0, 1_000_000],
                growth_claims: 2_000,
                purge_rows: 200_000,
                memory: 200_000,
            },
            Mode::Full => Self {
                backlog: 5_000,
                paced: 600,
                paced_rate: 200,
                requests: 5_000,
                http_clients: 32,
                growth: vec![0, 1_000_000, 10_000_000],
                growth_claims: 3_000,
                purge_rows: 200_000,
                memory: 1_000_000,
            },
        }
    }
}

/// Where the services are.
#[derive(Clone, Debug)]
pub struct Services {
    pub pg_url: String,
    pub brokers: String,
    /// The in-process mock cluster behind `brokers`, with `--kafka-mock`.
    pub kafka_mock: Option<std::sync::Arc<super::mock::MockBroker>>,
    pub amqp_url: String,
    pub redis_url: String,
}

/// One measured target (see the issue): value, goal, and whether it is met.
#[derive(Clone, Debug)]
pub struct Target {
    pub name: String,
    pub measured: String,
    pub goal: String,
    pub met: bool,
}

/// The state of one benchmark invocation.
pub struct Bench {
    pub mode: Mode,
    pub runs: usize,
    pub dups: Vec<u32>,
    pub sizes: Sizes,
    pub services: Services,
    /// Admin pool on the database (schemas are created through it).
    pub admin: PgPool,
    /// A tag unique to this invocation (topic, queue and schema names).
    pub tag: String,
    /// How round trips and statements are counted.
    pub counting: Counting,
    /// The counting proxy in front of PostgreSQL (unless `Counting::Off`).
    pub proxy: Option<PgProxy>,
    preamble: String,
    tables: Vec<Table>,
    targets: Vec<Target>,
    failures: Vec<String>,
    counter: u64,
}

impl Bench {
    pub async fn new(
        mode: Mode,
        runs: usize,
        dups: Vec<u32>,
        services: Services,
        counting: Counting,
    ) -> Res<Self> {
        let admin = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&services.pg_url)
            .await
            .map_err(|e| {
                format!(
                    "Postgres is not reachable at {}: {e} (start it with scripts/services)",
                    services.pg_url
                )
            })?;
        let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        let proxy = match counting {
            Counting::Off => None,
            _ => Some(PgProxy::start(&services.pg_url).await?),
        };
        Ok(Self {
            mode,
            runs,
            dups,
            sizes: Sizes::of(mode),
            services,
            admin,
            tag,
            counting,
            proxy,
            preamble: String::new(),
            tables: Vec::new(),
            targets: Vec::new(),
            failures: Vec::new(),
            counter: 0,
        })
    }

    /// Prints and records the conditions of this run (build, mode, load).
    pub fn header(&mut self) {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        let text = format!(
            "## onceonly benchmark\n\n{} build, mode {:?}, {} run(s) per measurement (median), \
             duplicate ratios {:?} %, {cpus} CPUs, load average at start: {}.\n\
             Latency is end to end: from the send timestamp in the payload to the moment the \
             business row is visible as committed (polled every {} ms) for consumers; request \
             round trip for HTTP. Peak RSS is the child process's VmHWM. {}\n\n",
            if cfg!(debug_assertions) {
                "**debug**"
            } else {
                "release"
            },
            self.mode,
            self.runs,
            self.dups,
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
            OBSERVER_POLL.as_millis(),
            match self.counting {
                Counting::Separate => {
                    "Round trips and statements per delivery are counted by a PostgreSQL proxy \
                     in one extra run per variant; rates, latencies and CPU come from the \
                     direct runs. CPU is per 1,000 deliveries, of the process under test and of \
                     the database backends serving it."
                }
                Counting::Inline => {
                    "Every run goes through a counting PostgreSQL proxy (rates include its hop); \
                     CPU is per 1,000 deliveries, of the process under test and of the database \
                     backends serving it."
                }
                Counting::Off => {
                    "No round trip counts (--counts off); CPU is per 1,000 deliveries, of the \
                     process under test and of the database backends serving it."
                }
            },
        );
        eprint!("{text}");
        self.preamble = text;
    }

    /// A name unique within this invocation.
    pub fn unique(&mut self, what: &str) -> String {
        self.counter += 1;
        format!("bench_{}_{what}_{}", self.tag, self.counter)
    }

    /// Adds a finished table and prints it.
    pub fn table(&mut self, table: Table) {
        println!("{}", table.render());
        self.tables.push(table);
    }

    /// Records a target.
    pub fn target(&mut self, name: &str, measured: String, goal: &str, met: bool) {
        self.targets.push(Target {
            name: name.to_owned(),
            measured,
            goal: goal.to_owned(),
            met,
        });
    }

    /// Records a failed correctness check (the run exits non-zero).
    pub fn fail(&mut self, what: String) {
        eprintln!("CHECK FAILED: {what}");
        self.failures.push(what);
    }

    /// Checks a condition; records a failure if false.
    pub fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fail(what());
        }
    }

    /// Checks a consumer run's ledger: every key has its effect, exactly
    /// once with dedup, at least once per message without.
    pub fn check_ledger(&mut self, label: &str, dedup: bool, run: &RunResult, distinct_keys: i64) {
        self.check(run.distinct == distinct_keys, || {
            format!(
                "{label}: {} distinct keys in the ledger, {distinct_keys} sent",
                run.distinct
            )
        });
        if dedup {
            self.check(run.rows == distinct_keys, || {
                format!(
                    "{label}: {} ledger rows for {distinct_keys} distinct keys",
                    run.rows
                )
            });
        } else {
            self.check(run.rows >= run.messages as i64, || {
                format!(
                    "{label}: {} ledger rows for {} messages",
                    run.rows, run.messages
                )
            });
        }
    }

    /// Whether every check passed.
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }

    /// Adds the targets table.
    pub fn targets(&mut self) {
        let mut t = Table::new(
            "Targets (ratios measured in this run)",
            &["target", "measured", "goal", "status"],
        );
        for target in &self.targets {
            t.row(vec![
                target.name.clone(),
                target.measured.clone(),
                target.goal.clone(),
                if target.met { "met" } else { "missed" }.to_owned(),
            ]);
        }
        if !self.failures.is_empty() {
            t.row(vec![
                format!("correctness checks: {} failed", self.failures.len()),
                self.failures.join("; "),
                "all pass".into(),
                "FAILED".into(),
            ]);
        }
        self.table(t);
    }

    /// Writes every table so far to `path`.
    pub fn write(&self, path: &std::path::Path) -> Res<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut text = self.preamble.clone();
        for t in &self.tables {
            text.push_str(&t.render());
            text.push('\n');
        }
        std::fs::write(path, text)?;
        Ok(())
    }

    /// A fresh schema; its URL sets the `search_path` to it.
    pub async fn schema(&mut self, what: &str) -> Res<Schema> {
        let name = self.unique(what);
        sqlx::query(&format!("CREATE SCHEMA {name}"))
            .execute(&self.admin)
            .await?;
        let base = &self.services.pg_url;
        let sep = if base.contains('?') { '&' } else { '?' };
        Ok(Schema {
            url: format!("{base}{sep}options=-c%20search_path%3D{name}"),
            name,
        })
    }

    /// The database client of a process under test on `url`: through the
    /// counting proxy if `counted`, with an application name of its own.
    pub fn db_client(&mut self, url: &str, counted: bool) -> Res<DbClient> {
        let application_name = self.unique("app");
        let url = match (&self.proxy, counted) {
            (Some(proxy), true) => proxy.url(url)?,
            _ => url.to_owned(),
        };
        Ok(DbClient {
            url: with_application_name(&url, &application_name),
            application_name,
            counted: counted && self.proxy.is_some(),
        })
    }

    /// Whether the measured runs go through the counting proxy.
    pub fn inline_counts(&self) -> bool {
        self.counting == Counting::Inline
    }

    /// Whether one extra, counted run per variant follows the measured ones.
    pub fn counted_pass(&self) -> bool {
        self.counting == Counting::Separate
    }

    /// Starts measuring the costs of `child` and its database client.
    pub async fn window(&self, child: &Child, db: &DbClient) -> Res<super::meter::Window> {
        let pid = child
            .pid()
            .ok_or("the child exited before its window opened")?;
        super::meter::Window::open(pid, db, &self.admin, self.proxy.as_ref()).await
    }

    /// Ends a window after `deliveries` deliveries.
    pub async fn close_window(&self, window: super::meter::Window, deliveries: usize) -> Res<Cost> {
        window
            .close(deliveries, &self.admin, self.proxy.as_ref())
            .await
    }

    /// Drops a schema made by [`schema`](Self::schema).
    pub async fn drop_schema(&self, schema: &Schema) {
        if let Err(e) = sqlx::query(&format!("DROP SCHEMA {} CASCADE", schema.name))
            .execute(&self.admin)
            .await
        {
            eprintln!("dropping schema {}: {e}", schema.name);
        }
    }
}

/// A Postgres schema for one run.
pub struct Schema {
    pub name: String,
    pub url: String,
}

/// A pool on a schema.
pub async fn pool(url: &str, connections: u32) -> Res<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await?)
}

/// Creates the business tables (ledger, accounts, orders), the
/// hand-written inbox's table and the `seen` table the observer drains, in
/// the schema of `pool`.
pub async fn business_tables(pool: &PgPool) -> Res<()> {
    super::ledger::postgres::create_tables(pool).await?;
    super::ledger::postgres::create_orders_table(pool).await?;
    super::inbox::create_table(pool).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS seen (sent_us BIGINT NOT NULL)")
        .execute(pool)
        .await?;
    Ok(())
}

/// Microseconds since the Unix epoch (wall clock: the producer and the
/// consumer are different processes on this machine).
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// librdkafka's `fetch.wait.max.ms` for every consumer (baseline and
/// onceonly): tansu answers a fetch only when this wait is over, even if
/// records arrived, so the default 500 ms would dominate the latency.
pub const FETCH_WAIT_MS: &str = "10";

/// How often the observer looks for new commits.
pub const OBSERVER_POLL: Duration = Duration::from_millis(2);

/// Watches a schema's `seen` table: every business transaction inserts its
/// message's send time there, and the observer deletes committed rows as
/// soon as they are visible, recording (send time, seen time). That is the
/// end-to-end latency, the same for the baseline and onceonly.
pub struct Observer {
    seen: Arc<std::sync::Mutex<Vec<(i64, i64)>>>,
    count: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Res<()>>,
}

impl Observer {
    pub fn start(pool: PgPool) -> Self {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let count = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, c, st) = (seen.clone(), count.clone(), stop.clone());
        let task = tokio::spawn(async move {
            while !st.load(Ordering::Relaxed) {
                let rows: Vec<i64> = sqlx::query_scalar("DELETE FROM seen RETURNING sent_us")
                    .fetch_all(&pool)
                    .await?;
                let now = now_us();
                if rows.is_empty() {
                    tokio::time::sleep(OBSERVER_POLL).await;
                    continue;
                }
                c.fetch_add(rows.len() as u64, Ordering::Relaxed);
                let mut guard = s.lock().map_err(|_| "observer lock poisoned")?;
                guard.extend(rows.into_iter().map(|sent| (sent, now)));
            }
            Ok(())
        });
        Self {
            seen,
            count,
            stop,
            task,
        }
    }

    /// Commits seen so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Waits until `n` commits were seen; fails after `timeout` without
    /// progress, or if the child died.
    pub async fn wait_for(&self, n: u64, timeout: Duration, child: &mut Child) -> Res<()> {
        let mut last = self.count();
        let mut since = Instant::now();
        while self.count() < n {
            if self.task.is_finished() {
                return Err("the observer stopped (database error?)".into());
            }
            if let Some(status) = child.exited()? {
                return Err(format!(
                    "the consumer exited ({status}) after {} of {n} commits",
                    self.count()
                )
                .into());
            }
            let now = self.count();
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() > timeout {
                return Err(
                    format!("no progress for {timeout:?}: {now} of {n} commits seen").into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Takes the (send time, seen time) pairs recorded so far.
    pub fn take(&self) -> Vec<(i64, i64)> {
        self.seen
            .lock()
            .map(|mut g| std::mem::take(&mut *g))
            .unwrap_or_default()
    }

    pub async fn stop(self) -> Res<()> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// Throughput of a drained backlog, from the commits the observer saw:
/// rows committed after the first commit, over the time from the first to
/// the last commit (start-up, group joins and the first batch excluded),
/// scaled to the messages handled (duplicates included). Rows of one
/// transaction become visible together, so the first poll that saw rows
/// holds the first transaction. `None` if everything committed at once.
pub fn drain_rate(pairs: &[(i64, i64)], messages: usize) -> Option<f64> {
    let first = pairs.iter().map(|p| p.1).min()?;
    let last = pairs.iter().map(|p| p.1).max()?;
    let after_first = pairs.iter().filter(|p| p.1 > first).count();
    if after_first == 0 || last <= first {
        return None;
    }
    let span = (last - first) as f64 / 1e6;
    let per_row = messages as f64 / pairs.len() as f64;
    Some(after_first as f64 * per_row / span)
}

/// Sorted latencies of (send, seen) pairs.
pub fn latencies(pairs: &[(i64, i64)]) -> Vec<Duration> {
    let mut v: Vec<Duration> = pairs
        .iter()
        .map(|(sent, seen)| Duration::from_micros(u64::try_from(seen - sent).unwrap_or(0)))
        .collect();
    v.sort();
    v
}

/// A child process running a consumer or a server of this binary.
pub struct Child {
    inner: TokioChild,
    stdin: Option<ChildStdin>,
    /// What the child printed after `ready` (e.g. its port).
    pub ready: String,
}

impl Child {
    /// Starts `spec` and waits for its `ready` line.
    pub async fn spawn(spec: &ChildSpec) -> Res<Self> {
        let exe = std::env::current_exe()?;
        let mut inner = Command::new(exe)
            .arg("--child")
            .arg(serde_json::to_string(spec)?)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = inner.stdin.take();
        let stdout = inner.stdout.take().ok_or("child stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(rest) = line.strip_prefix("ready") {
                    return Ok::<_, std::io::Error>(Some(rest.trim().to_owned()));
                }
            }
            Ok(None)
        })
        .await
        .map_err(|_| "child not ready within 60 s")??
        .ok_or("child exited before it was ready")?;
        // Keep draining stdout so the child never blocks on it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self {
            inner,
            stdin,
            ready,
        })
    }

    /// The child's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.inner.id()
    }

    /// Peak resident set size so far (VmHWM), in MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        let Some(pid) = self.inner.id() else {
            return 0.0;
        };
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<f64>().ok())
            })
            .map_or(0.0, |kb| kb / 1024.0)
    }

    /// The exit status, if it exited.
    pub fn exited(&mut self) -> Res<Option<std::process::ExitStatus>> {
        Ok(self.inner.try_wait()?)
    }

    /// Asks the child to stop (closes its stdin) and waits for a clean exit.
    pub async fn stop(mut self) -> Res<()> {
        drop(self.stdin.take());
        match tokio::time::timeout(Duration::from_secs(60), self.inner.wait()).await {
            Ok(status) => {
                let status = status?;
                if status.success() {
                    Ok(())
                } else {
                    Err(format!("child exited with {status}").into())
                }
            }
            Err(_) => {
                self.inner.kill().await?;
                Err("child did not stop within 60 s".into())
            }
        }
    }
}

/// A deterministic random source (splitmix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The keys of `n` messages, `dup` percent of them redeliveries of an
/// earlier message's key.
pub struct Plan {
    pub keys: Vec<String>,
    pub distinct: usize,
}

impl Plan {
    pub fn new(n: usize, dup: u32, prefix: &str, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut keys: Vec<String> = Vec::with_capacity(n);
        let mut distinct = 0;
        for i in 0..n {
            if i > 0 && rng.below(100) < u64::from(dup) {
                let earlier = keys[rng.below(i as u64) as usize].clone();
                keys.push(earlier);
            } else {
                keys.push(format!("{prefix}-{distinct}"));
                distinct += 1;
            }
        }
        Self { keys, distinct }
    }

    /// Business rows the backlog should leave: one per distinct key with
    /// dedup, one per message without.
    pub fn effects(&self, dedup: bool) -> u64 {
        (if dedup {
            self.distinct
        } else {
            self.keys.len()
        }) as u64
    }
}

/// Waits until the consumer committed the backlog's effects; returns its
/// drain rate (messages per second).
pub async fn drain_backlog(
    observer: &Observer,
    plan: &Plan,
    dedup: bool,
    child: &mut Child,
) -> Res<f64> {
    observer
        .wait_for(plan.effects(dedup), Duration::from_secs(60), child)
        .await?;
    Ok(drain_rate(&observer.take(), plan.keys.len())
        .ok_or("the whole backlog committed in one transaction: use a larger backlog")?)
}

impl Sizes {
    /// The keys of the paced messages after the backlog, and the ticker
    /// that paces them.
    pub fn paced(&self, prefix: &str) -> (Vec<String>, tokio::time::Interval) {
        let keys = (0..self.paced)
            .map(|i| format!("{prefix}-paced-{i}"))
            .collect();
        let interval = Duration::from_secs_f64(1.0 / f64::from(self.paced_rate.max(1)));
        (keys, tokio::time::interval(interval))
    }
}

/// A message's account: fixed per key, so a redelivery has the same
/// fingerprint (`/account`, `/amount`).
pub fn account_of(key: &str) -> String {
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    format!("acct-{}", h % 1000)
}

/// The JSON payload of a consumer message.
pub fn payload(key: &str) -> Vec<u8> {
    format!(
        r#"{{"out_trade_no":"{key}","account":"{}","amount":1,"sent_us":{}}}"#,
        account_of(key),
        now_us()
    )
    .into_bytes()
}

/// The cells shared by the consumer tables.
pub struct Measured {
    pub rate: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub rss_mib: f64,
    pub rows: i64,
    pub distinct: i64,
    pub messages: usize,
    pub cost: Cost,
}

impl Measured {
    /// Median rate, latency and costs over runs, maximum RSS; the counts of
    /// `counted` (the extra run through the proxy) where the runs have none.
    pub fn combine(runs: &[RunResult], counted: Option<&RunResult>) -> Self {
        let rates: Vec<f64> = runs.iter().map(|r| r.rate).collect();
        let mut p50s: Vec<f64> = Vec::new();
        let mut p99s: Vec<f64> = Vec::new();
        for r in runs {
            p50s.push(percentile(&r.latencies, 0.5).as_secs_f64());
            p99s.push(percentile(&r.latencies, 0.99).as_secs_f64());
        }
        let last = runs.last();
        Self {
            rate: median(&rates),
            p50: Duration::from_secs_f64(median(&p50s)),
            p99: Duration::from_secs_f64(median(&p99s)),
            rss_mib: runs.iter().map(|r| r.rss_mib).fold(0.0, f64::max),
            rows: last.map_or(0, |r| r.rows),
            distinct: last.map_or(0, |r| r.distinct),
            messages: last.map_or(0, |r| r.messages),
            cost: combine_costs(runs, counted),
        }
    }

    /// Table cells: rate, p50, p99, RSS, the ratios against no dedup and
    /// against the best hand-written inbox ([`RATIO_COLUMNS`]), the four
    /// cost columns ([`COST_COLUMNS`](super::meter::COST_COLUMNS)), rows /
    /// distinct keys. A ratio is `1.00×` on the row it is measured against
    /// and `–` where there is nothing to compare with.
    pub fn cells(&self, against: Against) -> Vec<String> {
        let ratio = |base: Option<f64>, own: bool| match (base, own) {
            (_, true) => "1.00×".to_owned(),
            (Some(b), false) => format!("{:.2}×", self.rate / b.max(f64::MIN_POSITIVE)),
            (None, false) => "–".to_owned(),
        };
        vec![
            format!("{:.0}", self.rate),
            ms(self.p50),
            ms(self.p99),
            format!("{:.1} MiB", self.rss_mib),
            ratio(against.baseline, against.is_baseline),
            ratio(against.inbox, false),
        ]
        .into_iter()
        .chain(cost_cells(&self.cost))
        .chain([format!(
            "{} / {} / {}",
            self.messages, self.rows, self.distinct
        )])
        .collect()
    }
}

/// The two ratio columns of the transport tables.
pub const RATIO_COLUMNS: [&str; 2] = ["vs no dedup", "vs best hand-written inbox"];

/// What a row's rate is compared with: the no-dedup baseline's and the
/// best hand-written inbox's rates, and whether the row is the baseline
/// (the best inbox row shows its own `1.00×`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Against {
    pub baseline: Option<f64>,
    pub inbox: Option<f64>,
    pub is_baseline: bool,
}

/// The median of each cost over the runs that measured it; counts from
/// `counted` where no run has them.
fn combine_costs(runs: &[RunResult], counted: Option<&RunResult>) -> Cost {
    let med = |f: &dyn Fn(&Cost) -> Option<f64>, runs: &mut dyn Iterator<Item = &RunResult>| {
        let v: Vec<f64> = runs.filter_map(|r| f(&r.cost)).collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let counts = |f: &dyn Fn(&Cost) -> Option<f64>| {
        med(f, &mut runs.iter()).or_else(|| med(f, &mut counted.into_iter()))
    };
    Cost {
        app_cpu: med(&|c| c.app_cpu, &mut runs.iter()),
        db_cpu: med(&|c| c.db_cpu, &mut runs.iter()),
        round_trips: counts(&|c| c.round_trips),
        statements: counts(&|c| c.statements),
    }
}

/// One run of a consumer or server.
pub struct RunResult {
    pub rate: f64,
    pub latencies: Vec<Duration>,
    pub rss_mib: f64,
    /// Business rows written (effects).
    pub rows: i64,
    /// Distinct keys among them.
    pub distinct: i64,
    /// Messages or requests sent.
    pub messages: usize,
    /// CPU and database round trips of the measured window.
    pub cost: Cost,
}

/// `(rows, distinct keys)` of the ledger in `pool`'s schema.
pub async fn ledger_counts(pool: &PgPool) -> Res<(i64, i64)> {
    Ok(
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT out_trade_no) FROM ledger")
            .fetch_one(pool)
            .await?,
    )
}

/// Adds a consumer table's rows (`batch` as the second cell where the
/// table has that column), each rate against the no-dedup baseline's and
/// the best hand-written inbox's, and the compass goals of onceonly's
/// default against the best hand-written inbox: at least as fast with
/// few duplicates, 1.5 times as fast at 90 %.
pub fn consumer_rows(
    b: &mut Bench,
    table: &mut Table,
    measured: &[(super::child::Consumer, Measured)],
    what: &str,
    dup: u32,
    batch: Option<usize>,
) {
    use super::child::Consumer;
    let baseline = best_rate(measured, |c| c == Consumer::Baseline);
    let inbox = best_rate(measured, |c| matches!(c, Consumer::Inbox(_)));
    for (consumer, m) in measured {
        let against = Against {
            baseline,
            inbox,
            is_baseline: *consumer == Consumer::Baseline,
        };
        let mut cells = vec![consumer.name().to_owned()];
        cells.extend(batch.map(|n| n.to_string()));
        cells.extend(m.cells(against));
        table.row(cells);
        if *consumer != Consumer::Onceonly || dup == 20 {
            continue;
        }
        if let Some(ib) = inbox {
            let goal = if dup >= 90 { 1.5 } else { 1.0 };
            let ratio = m.rate / ib.max(f64::MIN_POSITIVE);
            b.target(
                &format!("{what}: onceonly default vs best hand-written inbox, {dup}% dup"),
                format!("{ratio:.2}× ({:.0} vs {ib:.0} msgs/s)", m.rate),
                &format!("≥ {goal:.1}×"),
                ratio >= goal,
            );
        }
    }
}

/// The best rate among the `measured` variants that `pick` selects.
pub fn best_rate<T: Copy>(measured: &[(T, Measured)], pick: impl Fn(T) -> bool) -> Option<f64> {
    measured
        .iter()
        .filter(|(v, _)| pick(*v))
        .map(|(_, m)| m.rate)
        .reduce(f64::max)
}
