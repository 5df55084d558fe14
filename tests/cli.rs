//! The `onceonly` binary answers `--help` for `replay` with examples. Also
//! makes `cargo test --workspace --all-features` build the binary that the
//! replay tests in integration-tests run.

use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_onceonly"))
        .args(args)
        .output()
        .expect("run onceonly");
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn replay_help_lists_both_sources_with_examples() {
    let text = help(&["replay", "--help"]);
    assert!(text.contains("amqp") && text.contains("kafka"), "{text}");
    assert!(text.contains("Examples:"), "{text}");
    for source in ["amqp", "kafka"] {
        let text = help(&["replay", source, "--help"]);
        for flag in [
            "--reason",
            "--since",
            "--key",
            "--limit",
            "--rate",
            "--dry-run",
        ] {
            assert!(text.contains(flag), "{source}: {flag} missing:\n{text}");
        }
        assert!(text.contains("Examples:"), "{text}");
    }
}

#[test]
fn bad_flags_are_rejected_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_onceonly"))
        .args(["replay", "amqp", "--queue", "q", "--rate", "0/s"])
        .output()
        .expect("run onceonly");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rate must be positive"));
}
