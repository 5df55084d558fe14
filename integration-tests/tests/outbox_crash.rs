//! Crash safety of the transactional outbox: `kafka_payments
//! --settled-topic` runs as a child process (consumer and in-process relay)
//! and is killed with SIGKILL at random moments while payments flow, then
//! restarted, and finally drains with `--exit-when-idle`. The ledger is
//! exact; the settled topic holds every processed payment at least once,
//! every copy of one payment with the same message id, and nothing for a
//! payment that was refused or conflicted; a downstream consumer keyed on
//! `header:x-onceonly-message-id` applies each message exactly once.
//!
//! Sizes: `ONCEONLY_OUTBOX_CRASH_DISTINCT` distinct payments (default
//! 4,000, which sends 6,334 messages, 37 % duplicates, plus the bad ones)
//! and `ONCEONLY_OUTBOX_CRASH_KILLS` kills (default 6).
//!
//! Build the example first: `cargo build --example kafka_payments
//! --features kafka,postgres` (`cargo test --workspace --all-features`
//! builds it too).
//!
//! It runs on librdkafka's mock cluster: tansu 0.6.0 never expires a
//! SIGKILLed member, so a restarted consumer could be given no partitions
//! for good (`onceonly_integration_tests::mock`).

use onceonly::Header;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use onceonly::kafka::KafkaConsumer;
use onceonly::{Json, Tx, handler_fn};
use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::demo::ledger::Settled;
use onceonly_integration_tests::kafka::{
    Record, header, payments_args, pg_schema, produce_on, read_to_end_on,
};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::mock::MockKafka;
use onceonly_integration_tests::{pay, pg_store, unique};
use rdkafka::Message;
use sqlx::{PgPool, Postgres};
use tokio::process::Child;

const PARTITIONS: i32 = 3;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        })
        .unwrap_or(default)
}

struct Run {
    bootstrap: String,
    topic: String,
    dlt: String,
    settled: String,
    group: String,
    url: String,
    child: Logged,
}

impl Run {
    fn spawn(&self, batch_size: usize, exit_when_idle: Option<u64>) -> Child {
        let mut args = payments_args(
            &self.bootstrap,
            &self.topic,
            &self.group,
            &self.url,
            &self.dlt,
            batch_size,
        );
        args.extend(["--settled-topic".to_owned(), self.settled.clone()]);
        if let Some(secs) = exit_when_idle {
            args.extend(["--exit-when-idle".to_owned(), secs.to_string()]);
        }
        self.child.spawn("kafka_payments", &args)
    }
}

/// Outbox rows per status (0 pending, 1 sent, 2 dead).
async fn outbox_rows(pool: &PgPool) -> BTreeMap<i16, i64> {
    sqlx::query_as("SELECT status, COUNT(*) FROM onceonly_outbox GROUP BY status")
        .fetch_all(pool)
        .await
        .unwrap_or_default()
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_never_loses_doubles_or_invents_a_settled_message() {
    let started = Instant::now();
    let distinct = env_or("ONCEONLY_OUTBOX_CRASH_DISTINCT", 4_000);
    let kills_wanted = env_or("ONCEONLY_OUTBOX_CRASH_KILLS", 6);
    let kafka = MockKafka::start(1);
    let topic = unique("ocrash");
    let dlt = format!("{topic}.dlt");
    let settled = format!("{topic}.settled");
    kafka.create_topic(&topic, PARTITIONS);
    kafka.create_topic(&dlt, 1);
    kafka.create_topic(&settled, PARTITIONS);
    let url = pg_schema("ocrash").await;
    let pool = PgPool::connect(&url).await.expect("postgres");

    // The good payments, with duplicates, and bad ones the handler must not
    // announce: refused (non-positive amounts, spread through the stream)
    // and conflicting (a processed key sent again with another amount, at
    // the end, after the original).
    let mut stream = crash_stream("O", distinct);
    let mut bad: BTreeSet<(String, i64)> = BTreeSet::new();
    for i in 0..20 {
        let no = format!("O-REFUSED-{i:03}");
        let amount = -(i as i64);
        let body = pay(&no, amount).account("acct-refused").body();
        let at = (i * stream.messages.len() / 20).min(stream.messages.len());
        stream.messages.insert(at, (no.clone(), body));
        bad.insert((no, amount));
    }
    for i in 0..20 {
        let no = format!("O-{:06}", i * distinct / 20);
        let (account, amount) = stream.expected[&no].clone();
        let body = pay(&no, amount + 1).account(&account).body();
        stream.messages.push((no.clone(), body));
        bad.insert((no, amount + 1));
    }
    let duplicates = stream.messages.len() - stream.expected.len() - bad.len();
    if distinct >= 4_000 {
        assert!(stream.messages.len() >= 5_000, "at least 5,000 payments");
    }
    assert!(
        duplicates * 5 >= stream.messages.len(),
        "at least 20 % duplicates"
    );
    let records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(key, body)| Record::new(key.clone(), body.clone()))
        .collect();
    produce_on(kafka.bootstrap(), &topic, &records).await;

    let run = Run {
        bootstrap: kafka.bootstrap().to_owned(),
        topic,
        dlt,
        settled,
        group: unique("ocrash_group"),
        url: url.clone(),
        child: Logged::new("kafka_payments_outbox"),
    };
    let mut rng = fastrand::Rng::new();
    let mut kills = 0;
    let deadline = Instant::now() + Duration::from_secs(300);
    while kills < kills_wanted {
        assert!(
            Instant::now() < deadline,
            "no progress; child log:\n{}",
            run.child.tail()
        );
        let before = rows(&pool).await;
        let batch_size = if kills % 2 == 0 { 1 } else { 25 };
        let child = run.spawn(batch_size, None);
        // Kill while it works: once it has committed something new, after
        // a random extra moment (the relay publishes meanwhile).
        run.child
            .kill_after_progress(
                child,
                async || rows(&pool).await > before,
                deadline,
                Duration::from_millis(700),
                &mut rng,
            )
            .await;
        kills += 1;
        eprintln!(
            "kill {kills}: ledger rows {}, outbox rows by status {:?} (batch size {batch_size})",
            rows(&pool).await,
            outbox_rows(&pool).await
        );
    }
    let before_final = rows(&pool).await;
    assert!(
        (before_final as usize) < distinct,
        "the kills must land before the backlog is drained ({before_final} rows)"
    );

    run.child
        .finishes(run.spawn(10, Some(5)), Duration::from_secs(240))
        .await;

    // (a) The ledger is exact; the outbox holds one sent row per payment.
    assert_exact(&pool, &stream.expected).await;
    let outbox = outbox_rows(&pool).await;
    assert_eq!(
        outbox,
        BTreeMap::from([(1, distinct as i64)]),
        "outbox rows by status: all sent, one per processed payment"
    );

    // The bad payments were dead-lettered, and only they.
    let dead: BTreeSet<(String, i64)> = read_to_end_on(
        kafka.bootstrap(),
        &run.dlt,
        1,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .iter()
    .map(|m| {
        let v: serde_json::Value =
            serde_json::from_slice(m.payload().unwrap_or_default()).expect("dead letter JSON");
        (
            v["out_trade_no"].as_str().unwrap_or_default().to_owned(),
            v["amount"].as_i64().unwrap_or_default(),
        )
    })
    .collect();
    assert_eq!(dead, bad, "dead-lettered payments");

    // (b), (c), (d): the settled topic.
    let messages = read_to_end_on(
        kafka.bootstrap(),
        &run.settled,
        PARTITIONS,
        Duration::from_secs(3),
        Duration::from_secs(60),
    );
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut id_owner: BTreeMap<String, String> = BTreeMap::new();
    let mut by_key: BTreeMap<String, Settled> = BTreeMap::new();
    for m in &messages {
        let s: Settled =
            serde_json::from_slice(m.payload().unwrap_or_default()).expect("settled JSON");
        let id = header(m, Header::MessageId.name())
            .unwrap_or_else(|| panic!("{s:?} has no {}", Header::MessageId.name()))
            .to_owned();
        assert_eq!(
            m.key(),
            Some(s.account.as_bytes()),
            "keyed by account: {s:?}"
        );
        // (d) Nothing for a refused payment or a conflicting copy: every
        // message is a processed payment, with its original amount.
        let want = stream.expected.get(&s.out_trade_no).unwrap_or_else(|| {
            panic!("settled message for a payment that was never processed: {s:?}")
        });
        assert_eq!(
            (&s.account, s.amount),
            (&want.0, want.1),
            "settled message with another account or amount than processed"
        );
        if let Some(first) = by_key.get(&s.out_trade_no) {
            assert_eq!(first, &s, "copies of one payment differ");
        }
        by_key.insert(s.out_trade_no.clone(), s.clone());
        if let Some(owner) = id_owner.insert(id.clone(), s.out_trade_no.clone()) {
            assert_eq!(
                owner, s.out_trade_no,
                "message id {id} used by two payments"
            );
        }
        ids.entry(s.out_trade_no).or_default().insert(id);
    }
    // (b) Every processed payment at least once.
    let missing: Vec<_> = stream
        .expected
        .keys()
        .filter(|no| !ids.contains_key(*no))
        .take(5)
        .collect();
    assert!(
        missing.is_empty(),
        "payments without a settled message: {missing:?}"
    );
    // (c) One message id per payment, however many copies.
    let split: Vec<_> = ids
        .iter()
        .filter(|(_, set)| set.len() != 1)
        .take(5)
        .collect();
    assert!(
        split.is_empty(),
        "payments with several message ids: {split:?}"
    );
    // The balances tell the commit order per account: sorted by balance,
    // each is the previous one plus the payment's amount.
    let mut per_account: BTreeMap<&str, Vec<&Settled>> = BTreeMap::new();
    for s in by_key.values() {
        per_account.entry(&s.account).or_default().push(s);
    }
    for (account, mut list) in per_account {
        list.sort_by_key(|s| s.balance);
        let mut balance = 0;
        for s in list {
            balance += s.amount;
            assert_eq!(s.balance, balance, "{account}: balance after {s:?}");
        }
    }
    let copies = messages.len();

    // (e) A downstream consumer keyed on the message id applies each
    // payment once, although the topic may hold several copies.
    let store = pg_store(&url, "downstream_dedup").await;
    sqlx::query(
        "CREATE TABLE applied (id BIGSERIAL PRIMARY KEY, out_trade_no TEXT NOT NULL, \
         amount BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .expect("create applied");
    let consumer = KafkaConsumer::builder(
        onceonly::Engine::builder(store).key_expr(&format!("header:{}", Header::MessageId.name())),
    )
    .brokers(kafka.bootstrap())
    .group_id(unique("ocrash_downstream"))
    .topic(&run.settled)
    .dead_letter_topic(&run.dlt)
    .exit_when_idle(Duration::from_secs(3))
    .build()
    .expect("downstream consumer");
    let apply = handler_fn(|tx: Tx<Postgres>, Json(s): Json<Settled>| async move {
        let mut conn = tx.lock().await?;
        sqlx::query("INSERT INTO applied (out_trade_no, amount) VALUES ($1, $2)")
            .bind(&s.out_trade_no)
            .bind(s.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    });
    let downstream = tokio::time::timeout(
        Duration::from_secs(120),
        consumer.run_until(apply, onceonly::kafka::CancellationToken::new()),
    )
    .await
    .expect("downstream consumer did not finish")
    .expect("downstream consumer");
    let applied: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT out_trade_no, COUNT(*), SUM(amount)::BIGINT FROM applied \
         GROUP BY out_trade_no ORDER BY out_trade_no",
    )
    .fetch_all(&pool)
    .await
    .expect("read applied");
    let want: Vec<(String, i64, i64)> = stream
        .expected
        .iter()
        .map(|(no, (_, amount))| (no.clone(), 1, *amount))
        .collect();
    assert_eq!(
        applied, want,
        "every payment applied downstream exactly once"
    );
    assert_eq!(downstream.processed, distinct as u64, "{downstream:?}");
    assert_eq!(
        downstream.processed + downstream.duplicates,
        copies as u64,
        "{downstream:?}"
    );

    eprintln!(
        "outbox crash: {} messages ({} distinct payments, {duplicates} duplicates, {} bad), \
         {kills} kills, {copies} copies in the settled topic ({} extra), downstream {:?}, {:?}",
        stream.messages.len(),
        distinct,
        bad.len(),
        copies - distinct,
        downstream,
        started.elapsed()
    );
}
