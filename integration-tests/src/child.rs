//! Running an example binary as a child process, for crash tests.

use std::path::PathBuf;
use std::process::Stdio;

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
}

impl Logged {
    /// A fresh log file in the temp dir.
    pub fn new(name: &str) -> Self {
        Self {
            log: std::env::temp_dir().join(format!("{}.log", crate::unique(name))),
        }
    }

    /// Spawns example `name` with `args`, stderr appended to the log;
    /// killed if dropped.
    pub fn spawn(&self, name: &str, args: &[String]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        Command::new(example_binary(name))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"))
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
