//! Running an example binary as a child process, for crash tests.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// The path of example `name`, built by `cargo test` next to the tests.
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/examples/<name>
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("examples").join(name))
        .expect("target directory layout");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build --example {name} --all-features` \
         (`cargo test --workspace --all-features` builds it too)",
        bin.display()
    );
    bin
}

/// A child whose stderr goes to a log file, for failure messages.
pub struct Logged {
    /// The log file.
    pub log: PathBuf,
    /// Environment variables of the children, besides the test's own.
    envs: Vec<(String, String)>,
}

impl Logged {
    /// A fresh log file in the temp dir.
    pub fn new(name: &str) -> Self {
        Self {
            log: std::env::temp_dir().join(format!("{}.log", crate::unique(name))),
            envs: Vec::new(),
        }
    }

    /// Sets `key` to `value` in the children's environment.
    #[must_use]
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.envs.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Spawns example `name` with `args`, stderr appended to the log;
    /// killed if dropped.
    pub fn spawn(&self, name: &str, args: &[String]) -> Child {
        self.spawn_program(&example_binary(name), args)
    }

    /// Spawns `program` (a binary of this package,
    /// `env!("CARGO_BIN_EXE_<name>")`) with `args`, stderr appended to the
    /// log; killed if dropped.
    pub fn spawn_program(&self, program: &Path, args: &[String]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        Command::new(program)
            .args(args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()))
    }

    /// A supervisor: runs `spawn()`, and again each time the child dies of
    /// a signal, until a run exits 0 by itself. Returns the signal of each
    /// death, in order. Fails if a run exits with an error code, if one run
    /// takes longer than `run_timeout`, or on the `max_deaths + 1`-th death
    /// (a crash loop that does not end).
    pub async fn supervise(
        &self,
        spawn: impl Fn() -> Child,
        max_deaths: usize,
        run_timeout: Duration,
    ) -> Vec<i32> {
        use std::os::unix::process::ExitStatusExt;
        let mut deaths = Vec::new();
        loop {
            let mut child = spawn();
            let status = tokio::time::timeout(run_timeout, child.wait())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "run {} did not end within {run_timeout:?} (deaths so far: {deaths:?}); log:\n{}",
                        deaths.len() + 1,
                        self.tail()
                    )
                })
                .expect("wait");
            if status.success() {
                return deaths;
            }
            let Some(signal) = status.signal() else {
                panic!("the child failed ({status}); log:\n{}", self.tail());
            };
            deaths.push(signal);
            eprintln!(
                "supervisor: the child died of signal {signal} (death {})",
                deaths.len()
            );
            assert!(
                deaths.len() <= max_deaths,
                "still crash-looping after {} deaths (signals {deaths:?}); log:\n{}",
                deaths.len(),
                self.tail()
            );
        }
    }

    /// Runs `worker` with `args` under [`supervise`](Self::supervise) until
    /// a run ends by itself, and checks the crash loop of a poison message
    /// parked after `max_crashes` counted crashes: every death is the
    /// worker's own abort (SIGABRT), one uncounted first crash (the message
    /// was not a suspect yet) and `max_crashes` counted ones. `what` names
    /// the message in the report line.
    pub async fn poison_loop(
        &self,
        worker: &Path,
        args: &[String],
        max_crashes: usize,
        what: &str,
    ) {
        let deaths = self
            .supervise(
                || self.spawn_program(worker, args),
                2 * max_crashes + 2,
                Duration::from_secs(120),
            )
            .await;
        eprintln!(
            "the poison {what} killed the consumer {} times before it was parked: signals {deaths:?}",
            deaths.len()
        );
        assert!(
            deaths.iter().all(|s| *s == 6),
            "every death is the poison's abort: {deaths:?}"
        );
        assert_eq!(
            deaths.len(),
            max_crashes + 1,
            "one uncounted first crash, then {max_crashes} counted ones"
        );
    }

    /// Lets `child` work until `progressed()` (it committed something new),
    /// then a random moment of up to `jitter` more, and SIGKILLs and reaps
    /// it. Fails if the child exits by itself or nothing progressed by
    /// `deadline`.
    pub async fn kill_after_progress(
        &self,
        mut child: Child,
        progressed: impl AsyncFn() -> bool,
        deadline: Instant,
        jitter: Duration,
        rng: &mut fastrand::Rng,
    ) {
        loop {
            if let Some(status) = child.try_wait().expect("child status") {
                panic!("the child exited early ({status}); log:\n{}", self.tail());
            }
            if progressed().await {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no progress; log:\n{}",
                self.tail()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let jitter_ms = u64::try_from(jitter.as_millis()).unwrap_or(u64::MAX);
        tokio::time::sleep(Duration::from_millis(rng.u64(0..jitter_ms.max(1)))).await;
        child.start_kill().expect("SIGKILL");
        child.wait().await.expect("reap");
    }

    /// Waits up to `timeout` for `child` to exit by itself, successfully
    /// (a final run that drains the backlog).
    pub async fn finishes(&self, mut child: Child, timeout: Duration) {
        let status = tokio::time::timeout(timeout, child.wait())
            .await
            .unwrap_or_else(|_| panic!("final run did not drain; log:\n{}", self.tail()))
            .expect("wait");
        assert!(
            status.success(),
            "final run failed ({status}); log:\n{}",
            self.tail()
        );
    }

    /// The last 40 lines of the log.
    pub fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// Clients for crash tests: runs `each(client, i)` for every `i` in
/// `0..keys` on `lanes` concurrent lanes (lane `l` takes `l`, `l + lanes`,
/// ... one after the other), in a task of its own; the results, lane by
/// lane.
pub fn client_lanes<T, F, Fut>(
    lanes: usize,
    keys: usize,
    each: F,
) -> tokio::task::JoinHandle<Vec<T>>
where
    T: Send + 'static,
    F: Fn(reqwest::Client, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut tasks = Vec::new();
        for lane in 0..lanes {
            let (client, each) = (client.clone(), each.clone());
            tasks.push(tokio::spawn(async move {
                let mut results = Vec::new();
                for i in (lane..keys).step_by(lanes) {
                    results.push(each(client.clone(), i).await);
                }
                results
            }));
        }
        let mut results = Vec::new();
        for task in tasks {
            results.extend(task.await.expect("client lane"));
        }
        results
    })
}
