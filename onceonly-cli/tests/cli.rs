//! The `onceonly` CLI on SQLite, which needs no services, and the `--help`
//! of `replay`. The tests against PostgreSQL, MariaDB, RabbitMQ and Kafka are
//! in `integration-tests/tests/{cli,replay_*}.rs`; this file also makes
//! `cargo test --workspace --all-features` build the binary they run.
#![cfg(feature = "sqlite")]

use std::process::Command;
use std::time::Duration;

use onceonly::{
    Clock as _, Delivery, Engine, KeyRedaction, KeySpec, ManualClock, Outcome, SqlStore,
    SqliteStore, handler_fn,
};

/// Runs the CLI (this file's one runner); returns its exit status (-1 if
/// killed by a signal), stdout and stderr.
fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onceonly"))
        .args(args)
        .env_remove("ONCEONLY_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .output()
        .expect("run onceonly");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn help_lists_the_subcommands() {
    let (code, out, _) = cli(&["--help"]);
    assert_eq!(code, 0);
    for sub in [
        "migrate", "inspect", "purge", "stats", "outbox", "doctor", "dlq", "key-hash",
    ] {
        assert!(out.contains(sub), "{sub} missing from --help:\n{out}");
    }
    let (code, _, err) = cli(&["purge", "--database-url", "sqlite:x.db"]);
    assert_eq!(
        code, 2,
        "purge without --expired/--older-than is a usage error"
    );
    assert!(err.contains("--expired"), "{err}");
    let (code, _, err) = cli(&["stats", "--database-url", "oracle://scott:tiger@db/x"]);
    assert_eq!(code, 1);
    assert!(err.contains("unsupported database URL"), "{err}");
    assert!(
        !err.contains("tiger"),
        "the password leaked into the error: {err}"
    );
}

#[test]
fn key_hash_prints_the_form_the_logs_show() {
    let key_hash = |secret: Option<&str>, keys: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_onceonly"));
        cmd.args(["key-hash", "--secret-env", "ONCEONLY_TEST_KEY_SECRET"])
            .args(keys)
            .env_remove("ONCEONLY_TEST_KEY_SECRET");
        if let Some(secret) = secret {
            cmd.env("ONCEONLY_TEST_KEY_SECRET", secret);
        }
        let out = cmd.output().expect("run onceonly");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let secret = "an operator's secret of 32 bytes";
    let (code, out, err) = key_hash(Some(secret), &["ORDER-4711", "--", "-1"]);
    assert_eq!(code, 0, "{err}");
    let redaction = KeyRedaction::hmac(secret).unwrap();
    assert_eq!(
        out,
        format!(
            "{}\n{}\n",
            redaction.show("ORDER-4711"),
            redaction.show("-1")
        )
    );
    let (code, _, err) = key_hash(None, &["ORDER-4711"]);
    assert_eq!(code, 1);
    assert!(err.contains("ONCEONLY_TEST_KEY_SECRET is not set"), "{err}");
    let (code, _, err) = key_hash(Some("short"), &["ORDER-4711"]);
    assert_eq!(code, 1);
    assert!(err.contains("at least 16"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_inspect_stats_and_purge_on_sqlite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ops.db");
    let url = format!("sqlite:{}", path.display());
    let (code, out, err) = cli(&["migrate", "--database-url", &url, "--table", "ops_keys"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ops_keys is ready (sqlite)"), "{out}");

    // Ten payments processed a week ago with a one-day retention (expired),
    // five today (live).
    let store = SqliteStore::open(&path)
        .await
        .expect("open")
        .with_table("ops_keys")
        .expect("table");
    let now = ManualClock::starting_now();
    let old = ManualClock::new(now.now_ms() - 6 * 86_400_000);
    for (clock, range) in [(old, 0..10), (now, 10..15)] {
        let engine = Engine::builder(store.clone())
            .scope("payments")
            .key(KeySpec::json_field("/out_trade_no"))
            .retention(Duration::from_secs(86_400))
            .clock(clock)
            .build()
            .expect("engine");
        let handler = handler_fn(
            |_tx: onceonly::Tx<sqlx::Sqlite>, body: Vec<u8>| async move { Ok(body.len()) },
        );
        for i in range {
            let body = format!(r#"{{"out_trade_no":"ord-{i}","amount":{i}}}"#);
            let d = Delivery::new(body.into_bytes()).with_source(format!("pay/0@{i}"));
            let report = engine.process(&handler, &d).await;
            assert!(
                matches!(report.outcome, Outcome::Processed { .. }),
                "{report:?}"
            );
        }
    }

    let (code, out, err) = cli(&[
        "inspect",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--scope",
        "payments",
        "--key",
        "ord-12",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let rec: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(rec["key"], "ord-12");
    assert_eq!(rec["source"], "pay/0@12");
    assert_eq!(rec["expired"], false);
    assert_eq!(
        rec["result"], 37,
        "the stored result (the body length) comes back"
    );
    let (code, _, _) = cli(&[
        "inspect",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--scope",
        "payments",
        "--key",
        "nope",
    ]);
    assert_eq!(code, 3, "no record: exit status 3");

    let (code, out, err) = cli(&[
        "stats",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let stats: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let scope = &stats["scopes"][0];
    assert_eq!(scope["scope"], "payments");
    assert_eq!(scope["records"], 15);
    assert_eq!(scope["expired"], 10);
    assert_eq!(scope["age_buckets"][0], 5, "five claimed within the hour");
    assert_eq!(
        scope["age_buckets"][2], 10,
        "ten claimed between one and seven days ago"
    );

    let (code, out, err) = cli(&[
        "purge",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--expired",
        "--dry-run",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("dry run: 10 records"), "{out}");
    assert_eq!(live_count(&store).await, 15, "a dry run deletes nothing");
    let (code, out, err) = cli(&[
        "purge",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--expired",
        "--batch",
        "3",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("deleted 10 records that expired in 4 batches"),
        "{out}"
    );
    assert_eq!(live_count(&store).await, 5);
    assert!(
        store
            .get("payments", "ord-12")
            .await
            .expect("get")
            .is_some()
    );
    assert!(store.get("payments", "ord-3").await.expect("get").is_none());

    // By age: the five live records are younger than a day.
    let (code, out, err) = cli(&[
        "purge",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--older-than",
        "1h",
        "--batch",
        "2",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("deleted 0 records created before"), "{out}");
    assert!(out.contains("(5 examined)"), "{out}");
    let (code, _, err) = cli(&[
        "purge",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--older-than",
        "0s",
        "--batch",
        "2",
    ]);
    assert_eq!(code, 1, "live records need --force");
    assert!(
        err.contains("5 of the records to purge have not expired yet"),
        "{err}"
    );
    let (code, out, err) = cli(&[
        "purge",
        "--database-url",
        &url,
        "--table",
        "ops_keys",
        "--older-than",
        "0s",
        "--batch",
        "2",
        "--force",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("deleted 5 records created before"), "{out}");
    assert_eq!(live_count(&store).await, 0);
}

async fn live_count(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM ops_keys")
        .fetch_one(store.pool())
        .await
        .expect("count")
}

#[cfg(all(feature = "amqp", feature = "kafka"))]
fn help(args: &[&str]) -> String {
    let (code, out, err) = cli(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    out
}

#[test]
#[cfg(all(feature = "amqp", feature = "kafka"))]
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
#[cfg(feature = "amqp")]
fn bad_flags_are_rejected_with_a_message() {
    let (code, _, err) = cli(&["replay", "amqp", "--queue", "q", "--rate", "0/s"]);
    assert_ne!(code, 0);
    assert!(err.contains("rate must be positive"));
}

/// `migrate --print-sql` prints DDL a user's own migration tool can run:
/// applied to an empty SQLite database, the store works on it as if
/// `migrate` had run.
#[tokio::test]
async fn printed_sql_creates_tables_the_store_and_the_outbox_accept() {
    let (code, sql, err) = cli(&["migrate", "--print-sql", "--backend", "sqlite"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        sql.contains("CREATE TABLE IF NOT EXISTS \"onceonly_keys\""),
        "{sql}"
    );
    assert!(
        sql.contains("CREATE TABLE IF NOT EXISTS \"onceonly_outbox\""),
        "{sql}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("own-migrations.db");
    let url = format!("sqlite:{}?mode=rwc", path.display());
    let pool = sqlx::SqlitePool::connect(&url).await.expect("open");
    for statement in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let statement: String = statement
            .lines()
            .filter(|l| !l.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        if !statement.trim().is_empty() {
            sqlx::query(&statement)
                .execute(&pool)
                .await
                .expect("apply printed DDL");
        }
    }
    pool.close().await;
    // The CLI reads both tables without `migrate`.
    let db = format!("sqlite:{}", path.display());
    let (code, out, err) = cli(&["stats", "--database-url", &db]);
    assert_eq!(code, 0, "stats: {out}{err}");
    let (code, out, err) = cli(&["outbox", "stats", "--database-url", &db]);
    assert_eq!(code, 0, "outbox stats: {out}{err}");
    // Without --backend it is a usage error.
    let (code, _, err) = cli(&["migrate", "--print-sql"]);
    assert_eq!(code, 2, "{err}");
}

/// Runs the CLI with these database variables set (and no others).
fn cli_with_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_onceonly"));
    cmd.args(args)
        .env_remove("ONCEONLY_DATABASE_URL")
        .env_remove("DATABASE_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run onceonly");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn database_url_is_read_when_onceonly_database_url_is_unset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite:{}", dir.path().join("env.db").display());
    // sqlx's convention: DATABASE_URL alone is enough, for every subcommand.
    let (code, out, err) = cli_with_env(&["migrate"], &[("DATABASE_URL", &url)]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("dedup table onceonly_keys is ready"), "{out}");
    let (code, out, err) = cli_with_env(&["stats"], &[("DATABASE_URL", &url)]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli_with_env(&["outbox", "stats"], &[("DATABASE_URL", &url)]);
    assert_eq!(code, 0, "{out}{err}");
    // ONCEONLY_DATABASE_URL wins over DATABASE_URL, and the flag over both.
    let elsewhere = "oracle://scott:tiger@db/x";
    let (code, out, err) = cli_with_env(
        &["stats"],
        &[("ONCEONLY_DATABASE_URL", &url), ("DATABASE_URL", elsewhere)],
    );
    assert_eq!(code, 0, "ONCEONLY_DATABASE_URL first: {out}{err}");
    let (code, _, err) = cli_with_env(
        &["stats", "--database-url", elsewhere],
        &[("ONCEONLY_DATABASE_URL", &url)],
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("unsupported database URL"),
        "the flag first: {err}"
    );
    // Neither: the error names all three ways.
    let (code, _, err) = cli_with_env(&["stats"], &[]);
    assert_eq!(code, 1);
    for way in ["--database-url", "ONCEONLY_DATABASE_URL", "DATABASE_URL"] {
        assert!(err.contains(way), "{way} missing from: {err}");
    }
}
