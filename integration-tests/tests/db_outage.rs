//! The database goes away under a running consumer: a private PostgreSQL
//! (its own data directory and port, so no other test is disturbed) is
//! stopped with `pg_ctl stop -m immediate` while the AMQP consumer works,
//! then started again. An outage is the infrastructure's fault, not the
//! messages': nothing may be dead-lettered, nothing acked unprocessed, and
//! the ledger must end exact.

#[path = "../../examples/support/ledger.rs"]
mod ledger;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use onceonly::amqp::{AmqpConsumer, CancellationToken};
use onceonly::{PgStore, RetryPolicy, SqlStore};
use onceonly_integration_tests::amqp::{connect, declare_queue, depth, publish_stream, url};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::unique;

const PORT: u16 = 54_329;

/// A throwaway PostgreSQL server run as the `postgres` user.
struct PrivatePg {
    bin: PathBuf,
    data: PathBuf,
}

impl PrivatePg {
    fn ctl(&self, args: &[&str]) -> bool {
        let pg_ctl = self.bin.join("pg_ctl");
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(pg_ctl)
            .arg("-D")
            .arg(&self.data)
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    fn start(&self) {
        let opts = format!("-p {PORT} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off");
        assert!(
            self.ctl(&[
                "-w",
                "-l",
                "/tmp/onceonly-private-pg.log",
                "-o",
                &opts,
                "start"
            ]),
            "private PostgreSQL did not start; see /tmp/onceonly-private-pg.log"
        );
    }

    fn stop_immediately(&self) {
        assert!(self.ctl(&["-m", "immediate", "stop"]), "pg_ctl stop failed");
    }

    fn new() -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|versions| {
                versions
                    .flatten()
                    .map(|v| v.path().join("bin"))
                    .find(|b| b.join("initdb").exists())
            })
            .expect("PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql");
        let data = std::env::temp_dir().join(unique("onceonly-pg"));
        std::fs::create_dir_all(&data).unwrap();
        chown_postgres(&data);
        let ok = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "initdb failed (the test runs it as the postgres user through runuser)"
        );
        let pg = Self { bin, data };
        pg.start();
        pg
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.ctl(&["-m", "immediate", "stop"]);
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn chown_postgres(path: &Path) {
    let ok = Command::new("chown")
        .args(["postgres:postgres"])
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "chown postgres {}", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_is_waited_out_never_dead_lettered() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let pg = PrivatePg::new();
    let db_url = format!("postgres://postgres@127.0.0.1:{PORT}/postgres");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect(&db_url)
        .await
        .expect("private postgres");
    let store = PgStore::new(pool.clone());
    store.migrate().await.unwrap();
    ledger::postgres::create_tables(&pool).await.unwrap();

    let queue = unique("dbout");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let stream = crash_stream("D", 4_800);
    publish_stream(&channel, &queue, &stream).await;

    let consumer = AmqpConsumer::builder(store)
        .url(url())
        .queue(&queue)
        .key_expr("json:/out_trade_no")
        .retry(RetryPolicy::default().max_attempts(2))
        .exit_when_idle(Duration::from_secs(4))
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run_until(ledger::postgres::Ledger, CancellationToken::new()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while rows(&pool).await < 200 {
        assert!(Instant::now() < deadline, "no progress before the outage");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    pg.stop_immediately();
    // The pool's connections are gone with the server: count from a fresh one later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.start();
    let at_restart = rows(&pool).await;
    assert!(
        (at_restart as usize) + 1_000 < stream.expected.len(),
        "the outage must hit mid-stream ({at_restart} rows done before the restart)"
    );

    let stats = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("consumer did not drain after the outage")
        .unwrap()
        .expect("consumer failed");
    assert_eq!(
        stats.dead_lettered, 0,
        "an outage never dead-letters: {stats:?}"
    );
    assert_exact(&pool, &stream.expected).await;
    assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    assert_eq!(
        depth(&channel, &format!("{queue}.dlq")).await,
        0,
        "dead-letter queue empty"
    );
}
