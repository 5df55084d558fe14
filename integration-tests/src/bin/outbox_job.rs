//! A scheduled job for the outbox crash test: sends a reminder for each
//! invoice through the outbox, without a claim.
//!
//! `outbox_job DATABASE_URL OUTBOX_TABLE TOPIC INVOICES DELAY_MS`
//!
//! For each invoice `1..=INVOICES`, in one PostgreSQL transaction: records
//! the reminder in table `reminders` (once per invoice), and enqueues a
//! Kafka record for `TOPIC` keyed and ordered by the invoice's customer
//! (`customer-<n % 8>`) with the caller's id `reminder-<n>` (so a run after
//! a crash enqueues nothing twice), delayed by `DELAY_MS` for even
//! invoices. Every run walks every invoice again; a killed run is simply
//! started again. Exits 0 once every invoice was walked.

use std::time::Duration;

use onceonly::outbox::{Outbox, OutboxMessage};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, table, topic, invoices, delay_ms] = args.as_slice() else {
        eprintln!("usage: outbox_job DATABASE_URL OUTBOX_TABLE TOPIC INVOICES DELAY_MS");
        std::process::exit(2);
    };
    let invoices: i64 = invoices.parse().expect("INVOICES");
    let delay = Duration::from_millis(delay_ms.parse().expect("DELAY_MS"));
    let pool = sqlx::PgPool::connect(url).await.expect("connect");
    let outbox = Outbox::<sqlx::Postgres>::on_table(table).expect("outbox table");
    for invoice in 1..=invoices {
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query("INSERT INTO reminders (invoice) VALUES ($1) ON CONFLICT DO NOTHING")
            .bind(invoice)
            .execute(&mut *tx)
            .await
            .expect("reminder");
        let body = serde_json::json!({ "invoice": invoice }).to_string();
        // One ordering key per customer: a delayed reminder holds back the
        // customer's later ones.
        let customer = format!("customer-{}", invoice % 8);
        let mut message = OutboxMessage::kafka(topic, customer.clone(), body)
            .id(format!("reminder-{invoice}"))
            .order_by(customer);
        if invoice % 2 == 0 {
            message = message.delay(delay);
        }
        outbox
            .enqueue_in(&mut tx, "reminders-job", message)
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
        // Spread the run over time, so that kills land anywhere in it.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
