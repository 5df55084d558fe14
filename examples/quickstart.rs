//! onceonly in one file: payment callbacks arrive at least once (a
//! redelivery, a redelivery with its fields reordered, 16 concurrent copies,
//! a key reused with another amount, malformed JSON) and go through the
//! engine into a ledger. The handler's insert and the claim of the
//! `out_trade_no` commit in one transaction, so every payment is booked
//! exactly once; the program exits non-zero otherwise.
//!
//! Nothing to start first: SQLite in memory. Try it:
//!
//! ```text
//! cargo run --example quickstart
//! ```

use std::process::ExitCode;

use onceonly::{Delivery, Engine, HandlerError, Json, SqlStore, SqliteStore, Tx, handler_fn};
use sqlx::Sqlite;

#[derive(serde::Deserialize)]
struct Payment {
    out_trade_no: String,
    amount: i64,
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite::memory:").await?;
    store.migrate().await?; // the dedup table, onceonly_keys
    let ledger = "CREATE TABLE ledger (out_trade_no TEXT NOT NULL, amount INTEGER NOT NULL)";
    sqlx::query(ledger).execute(store.pool()).await?;
    let engine = Engine::builder(store.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .build()?;
    // Runs inside the claim's transaction: no unique index on the ledger.
    let book = handler_fn(|tx: Tx<Sqlite>, Json(p): Json<Payment>| async move {
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO ledger (out_trade_no, amount) VALUES (?, ?)")
            .bind(&p.out_trade_no)
            .bind(p.amount)
            .execute(&mut *conn)
            .await?;
        Ok::<_, HandlerError>(())
    });

    let stream = [
        r#"{"out_trade_no":"T-1","amount":500}"#,
        r#"{"out_trade_no":"T-2","amount":250}"#,
        r#"{"out_trade_no":"T-1","amount":500}"#, // a redelivery
        r#"{"amount":250,"out_trade_no":"T-2"}"#, // the same, reordered
        r#"{"out_trade_no":"T-2","amount":9999}"#, // same key, other amount
        r#"{"out_trade_no":"T-3","amount":"#,     // malformed
    ];
    for body in stream {
        let report = engine.process(&book, &Delivery::new(body)).await;
        println!("{:<10} {body}", report.outcome.kind().as_str());
    }
    // A gateway retrying impatiently: 16 copies at the same moment.
    let copies = (0..16).map(|_| {
        let delivery = Delivery::new(r#"{"out_trade_no":"T-4","amount":42}"#);
        let (engine, book) = (&engine, &book);
        async move { engine.process(book, &delivery).await }
    });
    for report in futures_util::future::join_all(copies).await {
        let kind = report.outcome.kind().as_str();
        println!("{kind:<10} T-4 (a concurrent copy)");
    }

    let sql = "SELECT out_trade_no, COUNT(*), SUM(amount) FROM ledger GROUP BY 1 ORDER BY 1";
    let ledger: Vec<(String, i64, i64)> = sqlx::query_as(sql).fetch_all(store.pool()).await?;
    println!("\nledger (key, rows, amount): {ledger:?}");
    let expected = [("T-1", 500), ("T-2", 250), ("T-4", 42)].map(|(k, a)| (String::from(k), 1, a));
    if ledger == expected {
        println!("OK: every out_trade_no booked exactly once.");
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("WRONG LEDGER: expected {expected:?}");
    Ok(ExitCode::FAILURE)
}
