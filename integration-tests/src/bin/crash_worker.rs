//! A tiny consumer for the crash test: processes one payment with the engine.
//!
//! `crash_worker BACKEND URL_OR_PATH DEDUP_TABLE BUSINESS_TABLE KEY MODE`
//! with BACKEND `postgres|postgres_pipelined|postgres_generations|mysql|sqlite` and MODE `hang` (after claiming and
//! writing the business row, print `CLAIMED` and sleep so the test can
//! SIGKILL it before the commit), `run` (process and print the outcome, and
//! for a failure its reason), `abort` (a suspect delivery whose handler
//! aborts the process after writing the business row) or `suspect` (a
//! suspect delivery, processed like `run`).

use std::io::Write;
use std::time::Duration;

use onceonly::{Delivery, Engine, Json, handler_fn};
use onceonly_integration_tests::{
    BusinessSql, Pay, mysql_store, pay, pg_generations_store, pg_store, sqlite_store,
};

macro_rules! run {
    ($store:expr, $conn:ty, $sql:expr, $key:expr, $mode:expr) => {{
        let engine = Engine::builder($store)
            .scope("crash-test")
            .key_expr("json:/out_trade_no")
            .max_crashes(2)
            .build()
            .expect("engine");
        let insert = $sql.insert;
        let mode: &str = $mode;
        let (hang, abort) = (mode == "hang", mode == "abort");
        let suspect = abort || mode == "suspect";
        let handler = handler_fn(
            move |tx: onceonly::Tx<<$conn as sqlx::Connection>::Database>, Json(p): Json<Pay>| {
                let insert = insert.clone();
                async move {
                    let mut conn = tx.lock().await?;
                    sqlx::query(&insert)
                        .bind(&p.out_trade_no)
                        .bind(p.amount)
                        .execute(&mut *conn)
                        .await?;
                    if hang {
                        println!("CLAIMED");
                        std::io::stdout().flush().ok();
                        tokio::time::sleep(Duration::from_secs(120)).await;
                    }
                    if abort {
                        std::process::abort();
                    }
                    Ok(p.amount)
                }
            },
        );
        let delivery = Delivery::new(pay(&$key, 7))
            .with_source("crash/0@1")
            .with_suspect(suspect);
        let report = engine.process(&handler, &delivery).await;
        match report.outcome.reason() {
            Some(reason) => println!("{} {reason}", report.outcome.kind().as_str()),
            None => println!("{}", report.outcome.kind().as_str()),
        }
    }};
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [backend, url, table, business, key, mode] = args.as_slice() else {
        eprintln!(
            "usage: crash_worker BACKEND URL DEDUP_TABLE BUSINESS_TABLE KEY hang|run|abort|suspect"
        );
        std::process::exit(2);
    };
    let mode = mode.as_str();
    match backend.as_str() {
        "postgres" => {
            let store = pg_store(url, table).await;
            run!(
                store,
                sqlx::PgConnection,
                BusinessSql::postgres(business),
                key,
                mode
            )
        }
        "postgres_pipelined" => {
            let store = pg_store(url, table).await.pipelined(true);
            run!(
                store,
                sqlx::PgConnection,
                BusinessSql::postgres(business),
                key,
                mode
            )
        }
        "postgres_generations" => {
            let store = pg_generations_store(url, table).await;
            run!(
                store,
                sqlx::PgConnection,
                BusinessSql::postgres(business),
                key,
                mode
            )
        }
        "mysql" => {
            let store = mysql_store(url, table).await;
            run!(
                store,
                sqlx::MySqlConnection,
                BusinessSql::mysql(business),
                key,
                mode
            )
        }
        "sqlite" => {
            let store = sqlite_store(std::path::Path::new(url), table).await;
            run!(
                store,
                sqlx::SqliteConnection,
                BusinessSql::sqlite(business),
                key,
                mode
            )
        }
        other => {
            eprintln!("unknown backend {other}");
            std::process::exit(2);
        }
    }
}
