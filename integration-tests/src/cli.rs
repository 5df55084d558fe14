//! Running the `onceonly` binary.

use std::path::PathBuf;
use std::process::Output;

/// The `onceonly` binary: `ONCEONLY_BIN` if set, else the one built by
/// `cargo test --workspace --all-features` into the target directory next
/// to the tests.
pub fn onceonly_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("ONCEONLY_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/onceonly
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("onceonly"))
        .expect("target directory layout");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p onceonly-cli --all-features` \
         (`cargo test --workspace --all-features` builds it too)",
        bin.display()
    );
    bin
}

/// What a run of `onceonly` printed.
#[derive(Debug)]
pub struct Run {
    /// Exit status 0.
    pub success: bool,
    /// The exit status (-1 if killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `onceonly ARGS` to completion (stderr is not a terminal: no
/// progress bar).
pub async fn onceonly(args: &[&str]) -> Run {
    let out: Output = tokio::process::Command::new(onceonly_binary())
        .args(args)
        // Only the flags of each test choose the database.
        .env_remove("ONCEONLY_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .env_remove("ONCEONLY_TABLE")
        .env_remove("ONCEONLY_OUTBOX_TABLE")
        .output()
        .await
        .expect("run onceonly");
    Run {
        success: out.status.success(),
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
