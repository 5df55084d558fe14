//! Crash safety of the Kafka example, `kafka_payments`, run as a child
//! process and killed with SIGKILL while it works, then restarted until the
//! topic is drained: every key is charged exactly once and the group has no
//! lag.
//!
//! The example binary is built by `cargo test` (examples are compiled with
//! the tests); build it alone with
//! `cargo build --example kafka_payments --features kafka,postgres`.
//!
//! The kill test runs on librdkafka's mock cluster: tansu 0.6.0 never
//! expires a SIGKILLed member, so a restarted consumer could be given no
//! partitions for good (`onceonly_integration_tests::mock`). The SIGTERM
//! test leaves the group cleanly and stays on tansu.

use std::time::{Duration, Instant};

use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::kafka::{
    Record, brokers, committed, committed_on, create_topic, payments_args, pg_schema, produce,
    produce_on, read_all_on,
};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::mock::MockKafka;
use onceonly_integration_tests::{pay, unique};
use sqlx::PgPool;
use tokio::process::Child;

/// Records produced; keys are 4,800 distinct, the rest are duplicates.
const DISTINCT: usize = 4_800;
const KILLS: usize = 6;

struct Run {
    bootstrap: String,
    topic: String,
    dlt: String,
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
        if let Some(secs) = exit_when_idle {
            args.extend(["--exit-when-idle".to_owned(), secs.to_string()]);
        }
        self.child.spawn("kafka_payments", &args)
    }

    fn log_tail(&self) -> String {
        self.child.tail()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_loses_and_doubles_nothing() {
    let kafka = MockKafka::start(1);
    let topic = unique("kcrash");
    let dlt = format!("{topic}.dlt");
    kafka.create_topic(&topic, 3);
    kafka.create_topic(&dlt, 1);
    let url = pg_schema("kcrash").await;
    let pool = PgPool::connect(&url).await.expect("postgres");

    let stream = crash_stream("C", DISTINCT);
    assert!(stream.messages.len() >= 5_000 && stream.duplicates() * 5 >= stream.messages.len());
    let records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(key, body)| Record::new(key.clone(), body.clone()))
        .collect();
    let ends = produce_on(kafka.bootstrap(), &topic, &records).await;

    let run = Run {
        bootstrap: kafka.bootstrap().to_owned(),
        topic,
        dlt,
        group: unique("kcrash_group"),
        url,
        child: Logged::new("kafka_payments"),
    };
    let mut rng = fastrand::Rng::new();
    let mut kills = 0;
    let deadline = Instant::now() + Duration::from_secs(300);
    while kills < KILLS {
        assert!(
            Instant::now() < deadline,
            "no progress; child log:\n{}",
            run.log_tail()
        );
        let before = rows(&pool).await;
        let batch_size = if kills % 2 == 0 { 1 } else { 25 };
        let child = run.spawn(batch_size, None);
        // Kill while it works: once it has committed something new, after
        // a random extra moment.
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
            "kill {kills}: ledger rows {} (batch size {batch_size})",
            rows(&pool).await
        );
    }
    let before_final = rows(&pool).await;
    assert!(
        (before_final as usize) < DISTINCT,
        "the kills must land before the backlog is drained ({before_final} rows)"
    );

    run.child
        .finishes(run.spawn(10, Some(5)), Duration::from_secs(240))
        .await;

    assert_exact(&pool, &stream.expected).await;
    let positions = committed_on(kafka.bootstrap(), &run.group, &run.topic, 3);
    for (p, end) in &ends {
        assert_eq!(
            positions.get(p),
            Some(end),
            "partition {p} lag must be 0: {positions:?}"
        );
    }
    assert!(
        read_all_on(kafka.bootstrap(), &run.dlt, 1, 1, Duration::from_secs(2)).is_empty(),
        "nothing dead-lettered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_work_commits_and_exits_0() {
    let topic = unique("kterm");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 2).await;
    create_topic(&dlt, 1).await;
    let url = pg_schema("kterm").await;
    let pool = PgPool::connect(&url).await.expect("postgres");
    let records: Vec<Record> = (0..4_000)
        .map(|i| {
            let no = format!("T-{i:05}");
            let body = pay(&no, 1).account("a");
            Record::new(no, body)
        })
        .collect();
    produce(&topic, &records).await;
    let run = Run {
        bootstrap: brokers(),
        topic,
        dlt,
        group: unique("kterm_group"),
        url,
        child: Logged::new("kafka_payments"),
    };
    let mut child = run.spawn(1, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    while rows(&pool).await < 200 {
        assert!(
            Instant::now() < deadline,
            "no progress; log:\n{}",
            run.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = child.id().expect("pid").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(kill.success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap_or_else(|_| panic!("no exit within 30 s of SIGTERM; log:\n{}", run.log_tail()))
        .expect("wait");
    assert!(
        status.success(),
        "exit status {status}; log:\n{}",
        run.log_tail()
    );

    // In partition order, what ran is a prefix of each partition, and a
    // graceful stop commits exactly that prefix: committed = ledger rows.
    let rows = rows(&pool).await;
    let positions = committed(&run.group, &run.topic, 2);
    let committed_total: i64 = positions.values().map(|p| (*p).max(0)).sum();
    assert!(rows < 4_000, "stopped mid-stream ({rows} rows)");
    assert_eq!(
        committed_total, rows,
        "committed offsets {positions:?} must cover exactly the {rows} processed records"
    );
}
