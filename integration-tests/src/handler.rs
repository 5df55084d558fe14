//! The examples' ledger handler, instrumented for the transport tests.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use onceonly::{Delivery, Engine, Handler, HandlerError, Json, PgStore};
use sqlx::Postgres;

use crate::demo::ledger::{Payment, Receipt, postgres};
use crate::ledger::Expected;

/// How long the [`Ledger`] handler sleeps for account `slow`.
pub const SLOW: Duration = Duration::from_secs(3);

/// Credits the ledger like the examples, and also: counts calls, records
/// the order of `(account, seq)` for payments with a `seq` field, sleeps
/// `delay` per call, and fails *after* writing (so the rollback must undo
/// the write and the claim) for account `flaky` (retryable) and `broken`
/// (permanent). For account `slow` it sleeps [`SLOW`] after writing, longer
/// than any test's transaction deadline.
#[derive(Default)]
pub struct Ledger {
    /// Handler runs.
    pub calls: AtomicUsize,
    /// `(account, seq)` in the order seen.
    pub seen: Mutex<Vec<(String, i64)>>,
    /// Sleep per call.
    pub delay: Duration,
}

#[async_trait]
impl Handler<Postgres> for Ledger {
    type Input = Json<serde_json::Value>;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::Postgres>,
        Json(v): Json<serde_json::Value>,
        _d: &Delivery,
    ) -> Result<Receipt, HandlerError> {
        let mut conn = tx.lock().await?;
        self.calls.fetch_add(1, Ordering::SeqCst);
        let payment: Payment =
            serde_json::from_value(v.clone()).map_err(HandlerError::permanent)?;
        if let Some(seq) = v.get("seq").and_then(serde_json::Value::as_i64) {
            self.seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push((payment.account.clone(), seq));
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let receipt = postgres::record(&mut conn, &payment).await?;
        if payment.account == "slow" {
            tokio::time::sleep(SLOW).await;
        }
        match payment.account.as_str() {
            "flaky" => Err(HandlerError::retryable("always times out")),
            "broken" => Err(HandlerError::permanent("account closed")),
            _ => Ok(receipt),
        }
    }
}

/// The [`Ledger`] behind a downstream that can be down: while `down` is
/// set every message fails permanently (and is dead-lettered), as in an
/// outage that outlasts the retries.
#[derive(Default)]
pub struct Outage {
    /// The ledger handler that runs while the downstream is up.
    pub ledger: Ledger,
    /// Whether the downstream is down.
    pub down: std::sync::atomic::AtomicBool,
}

impl Outage {
    /// A handler whose downstream is down.
    pub fn down() -> Self {
        let h = Self::default();
        h.down.store(true, Ordering::SeqCst);
        h
    }
}

#[async_trait]
impl Handler<Postgres> for Outage {
    type Input = Json<serde_json::Value>;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::Postgres>,
        input: Json<serde_json::Value>,
        d: &Delivery,
    ) -> Result<Receipt, HandlerError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent("downstream unavailable"));
        }
        self.ledger.handle(tx, input, d).await
    }
}

/// Runs the payments `keys` of `expected` once each through a fresh
/// [`Ledger`] under `scope`, keyed like the consumers (`/out_trade_no`): as
/// if they had been sent again and gone through while copies of them sat
/// in a dead-letter queue. Each must be done.
pub async fn process_meanwhile(store: &PgStore, scope: &str, expected: &Expected, keys: &[&str]) {
    let engine = Engine::builder(store.clone())
        .scope(scope)
        .key_expr("json:/out_trade_no")
        .build()
        .expect("engine");
    let ledger = Ledger::default();
    for no in keys {
        let (account, amount) = &expected[*no];
        let d = Delivery::new(crate::pay(no, *amount).account(account));
        assert!(engine.process(&ledger, &d).await.outcome.is_done(), "{no}");
    }
}

/// A handler that keeps failing the same payments: it credits the ledger,
/// then fails permanently (so the rollback must undo the write and the
/// claim) with an error text that names the payment's key and amount, as
/// real errors do. Account `declined`: "payment K of N EUR declined by the
/// bank"; any other account: "account frozen: payment K of N EUR refused".
#[derive(Default)]
pub struct Declining {
    /// Handler runs.
    pub calls: AtomicUsize,
}

#[async_trait]
impl Handler<Postgres> for Declining {
    type Input = Json<Payment>;
    type Output = ();

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::Postgres>,
        Json(p): Json<Payment>,
        _d: &Delivery,
    ) -> Result<(), HandlerError> {
        let mut conn = tx.lock().await?;
        self.calls.fetch_add(1, Ordering::SeqCst);
        postgres::record(&mut conn, &p).await?;
        let (no, amount) = (&p.out_trade_no, p.amount);
        Err(HandlerError::permanent(match p.account.as_str() {
            "declined" => format!("payment {no} of {amount} EUR declined by the bank"),
            _ => format!("account frozen: payment {no} of {amount} EUR refused"),
        }))
    }
}
