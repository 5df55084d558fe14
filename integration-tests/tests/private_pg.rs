//! The private PostgreSQL's builder applies what a test asks for (a
//! setting, `pg_hba.conf` lines, a file in the data directory), on the host
//! (`initdb`/`pg_ctl`) and under Docker Compose (written into the
//! `postgres-private` container, loopback addresses of the hba lines
//! rewritten), and a fresh server starts empty. Port 54329 under compose, like
//! `db_outage.rs` (test binaries run one after the other).

use onceonly_integration_tests::private_pg::PrivatePg;
use sqlx::Row;

const PORT: u16 = 54_329;

#[tokio::test]
async fn the_builder_applies_settings_hba_and_files() {
    let pg = PrivatePg::builder(PORT)
        .setting("work_mem", "'7MB'")
        .setting("application_name", "'onceonly-private'")
        .hba(&[
            "local all all trust",
            "host all postgres 127.0.0.1/32 trust",
            "host all all ::1/128 trust",
        ])
        .file("onceonly-note.txt", "written by the builder\n")
        .start();
    eprintln!("private PostgreSQL through {:?}", pg.mechanism());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&pg.url())
        .await
        .expect("private postgres (hba line for 127.0.0.1 must admit us)");

    let work_mem: String = sqlx::query_scalar("SHOW work_mem")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(work_mem, "7MB");
    let note: String = sqlx::query_scalar("SELECT pg_read_file('onceonly-note.txt')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(note, "written by the builder\n");
    let rules = sqlx::query("SELECT type, address FROM pg_hba_file_rules ORDER BY line_number")
        .fetch_all(&pool)
        .await
        .unwrap();
    let rules: Vec<(String, Option<String>)> = rules.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(rules.len(), 3, "exactly the builder's lines: {rules:?}");
    assert_eq!(rules[0].0, "local");

    // Fresh: no table of an earlier run (db_outage uses the same port).
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(tables, 0, "a new private server starts empty");
}
