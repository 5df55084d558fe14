//! Prometheus and promtool (Debian's `prometheus` package, installed by
//! `scripts/build-deps`) for the tests of the shipped alert rules and
//! dashboard: the tools, the repository's `deploy/` files, and a private
//! Prometheus server on loopback.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// `deploy/` of the repository (rules and dashboard).
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .join("deploy")
}

/// The path of `tool` (`promtool`, `prometheus`): `ONCEONLY_PROMTOOL` /
/// `ONCEONLY_PROMETHEUS` if set, else the one on `PATH`. Panics with the
/// install command when missing: these tests never skip.
pub fn tool(tool: &str) -> PathBuf {
    let var = format!("ONCEONLY_{}", tool.to_ascii_uppercase());
    if let Some(path) = std::env::var_os(&var) {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(tool))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{tool} is not installed: run scripts/build-deps (as root it runs \
             `apt-get install -y prometheus`, which provides promtool and prometheus), \
             or set {var} to its path. These tests never skip."
        )
    })
}

/// What a run of `promtool ARGS` printed, in `dir`.
pub fn promtool(dir: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(tool("promtool"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool")
}

/// A Prometheus server of the test's own on `127.0.0.1`, with its data in a
/// temporary directory; killed when dropped.
pub struct Prometheus {
    /// Its HTTP port.
    pub port: u16,
    _child: Child,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus with `config` (prometheus.yml text; relative rule
    /// files are read from the directory `files` are written to) and waits
    /// until it is ready (at most 60 s).
    pub async fn start(config: &str, files: &[(&str, String)]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("prometheus.yml"), config).expect("write config");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("write rule file");
        }
        let port = crate::free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new(tool("prometheus"))
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn prometheus");
        let prometheus = Self {
            port,
            _child: child,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = reqwest::get(prometheus.url("/-/ready"))
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return prometheus;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus was not ready within 60 s; its log:\n{}",
                prometheus.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `http://127.0.0.1:PORT` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The alerts Prometheus holds now (`/api/v1/alerts`): pending and firing.
    pub async fn alerts(&self) -> Vec<serde_json::Value> {
        let body: serde_json::Value = reqwest::get(self.url("/api/v1/alerts"))
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|e| panic!("prometheus alerts API: {e}\n{}", self.log()))
            .json()
            .await
            .expect("alerts JSON");
        body["data"]["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The health of each scrape target (`/api/v1/targets`): `up`, `down`,
    /// `unknown`.
    pub async fn target_health(&self) -> Vec<String> {
        let body: serde_json::Value = reqwest::get(self.url("/api/v1/targets"))
            .await
            .and_then(reqwest::Response::error_for_status)
            .unwrap_or_else(|e| panic!("prometheus targets API: {e}\n{}", self.log()))
            .json()
            .await
            .expect("targets JSON");
        body["data"]["activeTargets"]
            .as_array()
            .map(|targets| {
                targets
                    .iter()
                    .map(|t| t["health"].as_str().unwrap_or("?").to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The last 30 lines of its log.
    pub fn log(&self) -> String {
        let text =
            std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}
