//! A tiny consumer for the crash test: processes one payment with the engine.
//!
//! `crash_worker BACKEND URL_OR_PATH DEDUP_TABLE BUSINESS_TABLE KEY MODE`
//! with BACKEND `postgres|mysql|sqlite` and MODE `hang` (after claiming and
//! writing the business row, print `CLAIMED` and sleep so the test can
//! SIGKILL it before the commit) or `run` (process and print the outcome).

use std::io::Write;
use std::time::Duration;

use onceonly::{Delivery, Engine, Json, handler_fn};
use onceonly_integration_tests::{BusinessSql, Pay, mysql_store, pay, pg_store, sqlite_store};

macro_rules! run {
    ($store:expr, $conn:ty, $sql:expr, $key:expr, $hang:expr) => {{
        let engine = Engine::builder($store)
            .scope("crash-test")
            .key_expr("json:/out_trade_no")
            .build()
            .expect("engine");
        let insert = $sql.insert;
        let hang = $hang;
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
                    Ok(p.amount)
                }
            },
        );
        let delivery = Delivery::new(pay(&$key, 7)).with_source("crash/0@1");
        let report = engine.process(&handler, &delivery).await;
        println!("{}", report.outcome.kind().as_str());
    }};
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [backend, url, table, business, key, mode] = args.as_slice() else {
        eprintln!("usage: crash_worker BACKEND URL DEDUP_TABLE BUSINESS_TABLE KEY hang|run");
        std::process::exit(2);
    };
    let hang = mode == "hang";
    match backend.as_str() {
        "postgres" => {
            let store = pg_store(url, table).await;
            run!(
                store,
                sqlx::PgConnection,
                BusinessSql::postgres(business),
                key,
                hang
            )
        }
        "mysql" => {
            let store = mysql_store(url, table).await;
            run!(
                store,
                sqlx::MySqlConnection,
                BusinessSql::mysql(business),
                key,
                hang
            )
        }
        "sqlite" => {
            let store = sqlite_store(std::path::Path::new(url), table).await;
            run!(
                store,
                sqlx::SqliteConnection,
                BusinessSql::sqlite(business),
                key,
                hang
            )
        }
        other => {
            eprintln!("unknown backend {other}");
            std::process::exit(2);
        }
    }
}
