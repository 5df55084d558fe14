//! Non-blocking retries: a retryable failure goes to the retry topic as a
//! copy with its due time, the partition moves on, and the copy is processed
//! by the same engine once due; exhausted copies are dead-lettered with their
//! original coordinates.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use onceonly::Header;
use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::{Delivery, Handler, HandlerError, Json, RetryPolicy, SqlStore};
use onceonly_integration_tests::demo::ledger::{self, Payment, Receipt};
use onceonly_integration_tests::kafka::{
    Record, brokers, committed, create_topic, header, pg_schema, produce, read_all,
};
use onceonly_integration_tests::ledger::{Expected, assert_exact};
use onceonly_integration_tests::{pay, pg_store, unique};
use sqlx::Postgres;

/// The examples' ledger; `SLOW` fails (retryably, after writing) on its
/// first two runs, `NEVER` on every run.
#[derive(Default)]
struct Flaky {
    slow_runs: AtomicUsize,
}

#[async_trait]
impl Handler<Postgres> for Flaky {
    type Input = Json<Payment>;
    type Output = Receipt;

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::Postgres>,
        Json(p): Json<Payment>,
        _: &Delivery,
    ) -> Result<Receipt, HandlerError> {
        let mut conn = tx.lock().await?;
        let receipt = ledger::postgres::record(&mut conn, &p).await?;
        match p.out_trade_no.as_str() {
            "SLOW" if self.slow_runs.fetch_add(1, Ordering::SeqCst) < 2 => {
                Err(HandlerError::retryable("downstream timed out"))
            }
            "NEVER" => Err(HandlerError::retryable("downstream always times out")),
            _ => Ok(receipt),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retryable_failure_waits_in_the_retry_topic_while_the_partition_moves_on() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let topic = unique("kretry");
    let retry = format!("{topic}.retry");
    let dlt = format!("{topic}.dlt");
    for t in [&topic, &retry, &dlt] {
        create_topic(t, 1).await;
    }
    let url = pg_schema("kretry").await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();

    let mut records = Vec::new();
    let mut expected = Expected::new();
    for i in 0..12 {
        let no = match i {
            2 => "SLOW".to_owned(),
            5 => "NEVER".to_owned(),
            _ => format!("R-{i:02}"),
        };
        let account = format!("acct-{i}");
        records.push(Record::new(no.clone(), pay(&no, 10 + i).account(&account)));
        if no != "NEVER" {
            expected.insert(no, (account, 10 + i));
        }
    }
    let ends = produce(&topic, &records).await;

    let group = unique("kretry_group");
    let handler = Arc::new(Flaky::default());
    let run = KafkaConsumer::builder(
        onceonly::Engine::builder(store.clone())
            .key_expr("json:/out_trade_no")
            .retry(
                RetryPolicy::default()
                    .max_attempts(3)
                    .initial_delay(Duration::from_millis(800))
                    .without_jitter(),
            ),
    )
    .brokers(brokers())
    .group_id(&group)
    .topic(&topic)
    .retry_topic(&retry)
    .exit_when_idle(Duration::from_secs(4))
    .build()
    .unwrap()
    .run_until(Arc::clone(&handler), CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("consumer did not drain")
        .expect("consumer failed");

    assert_exact(store.pool(), &expected).await;
    assert_eq!(
        handler.slow_runs.load(Ordering::SeqCst),
        3,
        "SLOW ran 3 times"
    );
    // The partition did not wait for SLOW: every later record took effect
    // before SLOW's third, successful run.
    let ids: Vec<(String, i64)> = sqlx::query_as("SELECT out_trade_no, id FROM ledger ORDER BY id")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(
        ids.last().map(|(no, _)| no.as_str()),
        Some("SLOW"),
        "{ids:?}"
    );
    // Source offsets committed to the end; the retry copies consumed too.
    assert_eq!(committed(&group, &topic, 1).get(&0), ends.get(&0));
    let copies = read_all(&retry, 1, 4, Duration::from_secs(5));
    assert_eq!(copies.len(), 4, "2 copies of SLOW, 2 of NEVER");
    assert_eq!(
        committed(&group, &retry, 1).get(&0).copied(),
        Some(copies.len() as i64),
        "retry copies committed"
    );
    // NEVER exhausted its 3 attempts: one dead letter, with the coordinates
    // of the original record, not of its last copy.
    let letters = read_all(&dlt, 1, 2, Duration::from_secs(5));
    assert_eq!(letters.len(), 1, "one dead letter");
    let letter = &letters[0];
    assert_eq!(
        header(letter, Header::OriginalTopic.name()),
        Some(topic.as_str())
    );
    assert_eq!(header(letter, Header::OriginalOffset.name()), Some("5"));
    assert_eq!(header(letter, Header::Attempts.name()), Some("3"));
    assert_eq!(header(letter, Header::Reason.name()), Some("handler_error"));
}
