//! A message that kills the process, on RabbitMQ: one message among 900
//! makes the consumer (prefetch 32, 8 handlers at once) abort (SIGABRT)
//! every time its handler runs. A supervisor restarts the consumer after
//! each death. The message must be dead-lettered with reason `crashed`
//! after the engine's default of 3 counted crashes (its first delivery is
//! not `redelivered`, so its first crash is not counted), every other
//! message charged exactly once, and the queue drained.

use std::path::Path;
use std::time::Duration;

use onceonly_integration_tests::amqp::{
    Msg, connect, declare_queue, depth, header, publish, take, url,
};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{assert_exact, crash_stream};
use onceonly_integration_tests::{pay, unique};
use sqlx::PgPool;

/// The engine's default `max_crashes`.
const MAX_CRASHES: usize = 3;
const POISON: &str = "M-POISON";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_aborts_the_consumer_is_dead_lettered_crashed_and_the_queue_drains() {
    let queue = unique("apoison");
    let db = pg_schema("apoison").await;
    let pool = PgPool::connect(&db).await.expect("postgres");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;

    // 600 payments (and their duplicates), the poison in the middle.
    let stream = crash_stream("M", 600);
    let mut messages: Vec<Msg> = stream
        .messages
        .iter()
        .map(|(_, body)| Msg::new(body.clone()))
        .collect();
    let poison = pay(POISON, 42).account("acct-poison").body();
    messages.insert(messages.len() / 2, Msg::new(poison.clone()));
    assert!(messages.len() > 900);
    publish(&channel, &queue, &messages).await;

    let args: Vec<String> = ["amqp", url().as_str(), queue.as_str(), db.as_str(), POISON]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
    let log = Logged::new("poison_worker_amqp");
    let worker = Path::new(env!("CARGO_BIN_EXE_poison_worker"));
    log.poison_loop(worker, &args, MAX_CRASHES, "message").await;

    // Every other payment exactly once, none for the poison.
    assert_exact(&pool, &stream.expected).await;
    // The last consumer closed its channel: anything unacked would be back.
    assert_eq!(depth(&channel, &queue).await, 0, "the queue is drained");
    let letters = take(&channel, &format!("{queue}.dlq"), 2, Duration::from_secs(3)).await;
    assert_eq!(letters.len(), 1, "the poison, dead-lettered once");
    let letter = &letters[0].delivery;
    assert_eq!(letter.data, poison, "with its body");
    assert_eq!(
        header(&letter.properties, "x-onceonly-reason").as_deref(),
        Some("crashed")
    );
}
