//! onceonly in one file, no services needed: an at-least-once stream of
//! payment callbacks (exact duplicates, a burst of concurrent duplicates, a
//! reused key with another amount, malformed messages, a handler that fails
//! once) goes through the engine into an SQLite ledger. Every `out_trade_no`
//! must be charged exactly once; the program exits non-zero otherwise.
//!
//! ```text
//! cargo run --example quickstart
//! ```

#[path = "support/ledger.rs"]
mod ledger;

use std::collections::{BTreeMap, HashSet};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use ledger::{Payment, Receipt};
use onceonly::{
    Delivery, Engine, Handler, HandlerError, Json, Outcome, Report, RetryPolicy, SqlStore,
    SqliteStore, Tx,
};
use sqlx::Sqlite;

/// Credits the ledger. Fails once, retryably, for keys listed in `flaky`
/// (think: a lock timeout), to show that a failure leaves nothing behind.
struct LedgerHandler {
    flaky: Mutex<HashSet<String>>,
}

#[async_trait]
impl Handler<Sqlite> for LedgerHandler {
    type Input = Json<Payment>;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: Tx<Sqlite>,
        Json(payment): Json<Payment>,
        _delivery: &Delivery,
    ) -> Result<Receipt, HandlerError> {
        let mut conn = tx.lock().await?;
        let receipt = ledger::sqlite::record(&mut conn, &payment).await?;
        // Fail *after* writing: the rollback must undo the write and the claim.
        let fail_now = self
            .flaky
            .lock()
            .map(|mut flaky| flaky.remove(&payment.out_trade_no))
            .unwrap_or(false);
        if fail_now {
            return Err(HandlerError::retryable("simulated lock timeout"));
        }
        Ok(receipt)
    }
}

fn payment(no: &str, account: &str, amount: i64) -> String {
    serde_json::json!({ "out_trade_no": no, "account": account, "amount": amount }).to_string()
}

fn describe(report: &Report<Receipt>) -> String {
    match &report.outcome {
        Outcome::Processed { result } => {
            format!("ledger #{} balance {}", result.ledger_id, result.balance)
        }
        Outcome::Duplicate { result: Some(r) } => {
            format!(
                "replayed receipt: ledger #{} balance {}",
                r.ledger_id, r.balance
            )
        }
        Outcome::Conflict { .. } => "same key, other payload: refused".to_owned(),
        Outcome::Rejected(r) => format!("{}: {r}", r.reason()),
        Outcome::Failed(f) => format!("{}: {f}", f.reason()),
        _ => String::new(),
    }
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("quickstart.db")).await?;
    store.migrate().await?;
    ledger::sqlite::create_tables(store.pool()).await?;

    let engine = Engine::builder(store.clone())
        .scope("payments-ledger")
        .key_expr("json:/out_trade_no")
        .retention(Duration::from_secs(7 * 24 * 3600))
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(10)),
        )
        .build()?;
    let handler = LedgerHandler {
        flaky: Mutex::new(HashSet::from(["T-4001".to_owned()])),
    };

    // (label, payload); the burst is sent concurrently below.
    let stream = [
        ("first delivery", payment("T-1001", "alice", 500)),
        ("first delivery", payment("T-1002", "bob", 250)),
        ("redelivery", payment("T-1001", "alice", 500)),
        (
            "redelivery, keys reordered",
            r#"{"amount":250,"account":"bob","out_trade_no":"T-1002"}"#.to_owned(),
        ),
        ("first delivery", payment("T-1003", "alice", 100)),
        ("same key, other amount", payment("T-1002", "bob", 9_999)),
        (
            "malformed JSON",
            r#"{"out_trade_no":"T-3001","amount":"#.to_owned(),
        ),
        (
            "no out_trade_no",
            r#"{"account":"bob","amount":1}"#.to_owned(),
        ),
        (
            "amount is not a number",
            r#"{"out_trade_no":"T-3002","account":"bob","amount":"ten"}"#.to_owned(),
        ),
        ("fails once, then retried", payment("T-4001", "dave", 42)),
        ("redelivery", payment("T-4001", "dave", 42)),
    ];

    println!(
        "{:<3} {:<28} {:<8} {:<10} {:<3} detail",
        "#", "delivery", "key", "outcome", "att"
    );
    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    let mut line = 0;
    let mut show = |label: &str, report: &Report<Receipt>| {
        line += 1;
        let kind = report.outcome.kind().as_str();
        *tally.entry(kind).or_default() += 1;
        let key = report.key.as_ref().map_or("-", |k| k.as_str());
        println!(
            "{line:<3} {label:<28} {key:<8} {kind:<10} {:<3} {}",
            report.attempts,
            describe(report)
        );
    };
    for (i, (label, body)) in stream.iter().enumerate() {
        let delivery =
            Delivery::new(body.as_bytes().to_vec()).with_source(format!("quickstart/0@{i}"));
        show(label, &engine.process_with_retry(&handler, &delivery).await);
    }

    // A payment gateway retrying impatiently: 16 copies at the same moment.
    let burst = (0..16).map(|i| {
        let engine = engine.clone();
        let handler = &handler;
        async move {
            let delivery = Delivery::new(payment("T-2001", "carol", 999).into_bytes())
                .with_source(format!("quickstart/1@{i}"));
            engine.process_with_retry(handler, &delivery).await
        }
    });
    for report in futures_util::future::join_all(burst).await {
        show("concurrent burst (x16)", &report);
    }

    println!();
    println!("outcomes: {tally:?}");
    println!();
    println!("{:<8} {:>7} {:>7}", "key", "charged", "amount");
    let charges = ledger::sqlite::charges(store.pool()).await?;
    for (no, times, total) in &charges {
        println!("{no:<8} {times:>7} {total:>7}");
    }
    let balances = ledger::sqlite::balances(store.pool()).await?;
    println!();
    println!("{:<8} {:>7}", "account", "balance");
    for (account, balance) in &balances {
        println!("{account:<8} {balance:>7}");
    }

    let expected_charges: Vec<(String, i64, i64)> = [
        ("T-1001", 500),
        ("T-1002", 250),
        ("T-1003", 100),
        ("T-2001", 999),
        ("T-4001", 42),
    ]
    .iter()
    .map(|(no, amount)| ((*no).to_owned(), 1, *amount))
    .collect();
    let expected_balances: Vec<(String, i64)> =
        [("alice", 600), ("bob", 250), ("carol", 999), ("dave", 42)]
            .iter()
            .map(|(a, b)| ((*a).to_owned(), *b))
            .collect();
    if charges == expected_charges && balances == expected_balances {
        println!("\nOK: every out_trade_no charged exactly once.");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("\nWRONG LEDGER: expected {expected_charges:?} and {expected_balances:?}");
        Ok(ExitCode::FAILURE)
    }
}
