//! A consumer with a message that kills it, for the crash-loop tests: the
//! examples' Postgres ledger handler, except that for one key it writes its
//! ledger row and then aborts the whole process (`std::process::abort`, a
//! SIGABRT like a failed assertion in native code), every time it runs.
//! The engine's settings are the defaults (`max_crashes` 3).
//!
//! ```text
//! poison_worker kafka BOOTSTRAP TOPIC GROUP DATABASE_URL DEAD_LETTER_TOPIC POISON_KEY
//! poison_worker amqp AMQP_URL QUEUE DATABASE_URL POISON_KEY
//! ```
//!
//! Both exit 0 once idle for 3 s (the backlog is drained). The Kafka
//! consumer takes records in batches of `POISON_BATCH` (default 1). With
//! `POISON_STAGE=key` the poison kills the process while its key is
//! derived, before any claim (a stage that runs before the handler, like a
//! payload decoder that runs out of memory).

use std::time::Duration;

use async_trait::async_trait;
use onceonly::amqp::AmqpConsumer;
use onceonly::kafka::KafkaConsumer;
use onceonly::{Delivery, Handler, HandlerError, Json, KeySpec, RetryPolicy};
use onceonly_integration_tests::demo::ledger::postgres::{Ledger, open};
use onceonly_integration_tests::demo::ledger::{Payment, Receipt};
use sqlx::Postgres;

/// The ledger, with one key that kills the process.
struct Poisoned {
    poison: String,
}

#[async_trait]
impl Handler<Postgres> for Poisoned {
    type Input = Json<Payment>;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: onceonly::Tx<Postgres>,
        Json(payment): Json<Payment>,
        delivery: &Delivery,
    ) -> Result<Receipt, HandlerError> {
        let poisoned = payment.out_trade_no == self.poison;
        let receipt = Ledger.handle(tx, Json(payment), delivery).await?;
        if poisoned {
            eprintln!("poison_worker: aborting on the poison message");
            std::process::abort();
        }
        Ok(receipt)
    }
}

const IDLE: Duration = Duration::from_secs(3);

/// `/out_trade_no`; with `POISON_STAGE=key`, deriving the poison's key
/// aborts the process.
fn key_spec(poison: &str) -> KeySpec {
    if std::env::var("POISON_STAGE").as_deref() != Ok("key") {
        return KeySpec::json_field("/out_trade_no");
    }
    let poison = poison.to_owned();
    KeySpec::custom(move |delivery: &Delivery| {
        let json = delivery
            .json()
            .map_err(|e| onceonly::KeyError::NotJson(e.to_owned()))?;
        let no = json["out_trade_no"].as_str().unwrap_or_default().to_owned();
        if no == poison {
            eprintln!("poison_worker: aborting while keying the poison message");
            std::process::abort();
        }
        Ok(no)
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let retry = RetryPolicy::default()
        .max_attempts(3)
        .initial_delay(Duration::from_millis(50));
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["kafka", bootstrap, topic, group, db, dlt, poison] => {
            let store = open(db).await?;
            let batch = std::env::var("POISON_BATCH")
                .ok()
                .and_then(|b| b.parse::<usize>().ok())
                .unwrap_or(1);
            let consumer = KafkaConsumer::builder(
                onceonly::Engine::builder(store)
                    .key(key_spec(poison))
                    .retry(retry),
            )
            .batch_size(batch)
            .brokers(*bootstrap)
            .group_id(*group)
            .topic(*topic)
            .dead_letter_topic(*dlt)
            .consumer_config("session.timeout.ms", "6000")
            .exit_when_idle(IDLE)
            .build()?;
            let handler = Poisoned {
                poison: (*poison).to_owned(),
            };
            let stats = consumer.run(handler).await?;
            eprintln!("{stats:?}");
        }
        ["amqp", url, queue, db, poison] => {
            let store = open(db).await?;
            let consumer = AmqpConsumer::builder(
                onceonly::Engine::builder(store)
                    .key_expr("json:/out_trade_no")
                    .retry(retry),
            )
            .url(*url)
            .queue(*queue)
            .prefetch(32)
            .concurrency(8)
            .exit_when_idle(IDLE)
            .build()?;
            let handler = Poisoned {
                poison: (*poison).to_owned(),
            };
            let stats = consumer.run(handler).await?;
            eprintln!("{stats:?}");
        }
        _ => {
            eprintln!(
                "usage: poison_worker kafka BOOTSTRAP TOPIC GROUP DATABASE_URL DLT POISON_KEY\n       \
                 poison_worker amqp AMQP_URL QUEUE DATABASE_URL POISON_KEY"
            );
            std::process::exit(2);
        }
    }
    Ok(())
}
