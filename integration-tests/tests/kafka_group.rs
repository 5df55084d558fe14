//! The Kafka consumer under broker faults, on librdkafka's mock cluster
//! (faithful group semantics and fault injection; see
//! `onceonly_integration_tests::mock`). Every test ends with what users care
//! about: every key charged exactly once, every partition committed to its
//! end, no dead letter.

use std::sync::Arc;
use std::time::{Duration, Instant};

use onceonly::kafka::{CancellationToken, GroupProtocol, KafkaConsumer, KafkaConsumerBuilder};
use onceonly::{PgStore, SqlStore};
use onceonly_integration_tests::demo::ledger;
use onceonly_integration_tests::handler::Ledger;
use onceonly_integration_tests::kafka::{Record, committed_on, pg_schema, produce_on, read_all_on};
use onceonly_integration_tests::ledger::{Stream, assert_exact, crash_stream, rows};
use onceonly_integration_tests::mock::MockKafka;
use onceonly_integration_tests::{pg_store, unique};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

const PARTITIONS: i32 = 3;

struct Setup {
    kafka: MockKafka,
    topic: String,
    dlt: String,
    group: String,
    store: PgStore,
    stream: Stream,
    ends: std::collections::BTreeMap<i32, i64>,
}

async fn setup(name: &str, brokers: i32, distinct: usize) -> Setup {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let kafka = MockKafka::start(brokers);
    let topic = unique(name);
    let dlt = format!("{topic}.dlt");
    kafka.create_topic(&topic, PARTITIONS);
    kafka.create_topic(&dlt, 1);
    let url = pg_schema(name).await;
    let store = pg_store(&url, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool()).await.unwrap();
    let stream = crash_stream(&name.to_uppercase(), distinct);
    let records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(no, body)| Record::new(no.clone(), body.clone()))
        .collect();
    let ends = produce_on(kafka.bootstrap(), &topic, &records).await;
    Setup {
        group: unique("group"),
        kafka,
        topic,
        dlt,
        store,
        stream,
        ends,
    }
}

impl Setup {
    /// A member of the group, before its protocol's settings.
    fn any_member(&self) -> KafkaConsumerBuilder<PgStore> {
        KafkaConsumer::builder(
            onceonly::Engine::builder(self.store.clone()).key_expr("json:/out_trade_no"),
        )
        .brokers(self.kafka.bootstrap())
        .group_id(&self.group)
        .topic(&self.topic)
        .dead_letter_topic(&self.dlt)
        .exit_when_idle(Duration::from_secs(4))
    }

    /// A member of the classic protocol, with short group timings.
    fn member(&self) -> KafkaConsumerBuilder<PgStore> {
        self.any_member()
            .consumer_config("session.timeout.ms", "6000")
            .consumer_config("heartbeat.interval.ms", "500")
    }

    /// A member joining with KIP-848's protocol (`group.protocol=consumer`):
    /// the broker owns the session and heartbeat timings.
    fn member_kip848(&self) -> KafkaConsumerBuilder<PgStore> {
        self.any_member().group_protocol(GroupProtocol::Consumer)
    }

    fn run(&self, builder: KafkaConsumerBuilder<PgStore>) -> tokio::task::JoinHandle<()> {
        let run = builder
            .build()
            .expect("consumer")
            .run_until(Arc::new(Ledger::default()), CancellationToken::new());
        tokio::spawn(async move {
            let _stats = run.await.expect("consumer failed");
        })
    }

    async fn wait_for_rows(&self, n: i64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while rows(self.store.pool()).await < n {
            assert!(Instant::now() < deadline, "no progress to {n} rows");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Exact ledger, every partition committed to its end, no dead letter.
    async fn assert_exactly_once(&self) {
        assert_exact(self.store.pool(), &self.stream.expected).await;
        let got = committed_on(self.kafka.bootstrap(), &self.group, &self.topic, PARTITIONS);
        for (p, end) in &self.ends {
            assert_eq!(
                got.get(p),
                Some(end),
                "partition {p} committed to its end: {got:?}"
            );
        }
        let letters = read_all_on(
            self.kafka.bootstrap(),
            &self.dlt,
            1,
            1,
            Duration::from_secs(1),
        );
        assert!(letters.is_empty(), "a broker fault dead-letters nothing");
    }
}

async fn finish(runs: Vec<tokio::task::JoinHandle<()>>) {
    for run in runs {
        tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .expect("member did not drain")
            .expect("member panicked");
    }
}

/// Offset commits fail for a while (request timeouts, then the coordinator
/// "moving"): the positions stay candidates and are committed once commits
/// work again; nothing is processed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn offset_commits_failing_for_a_while() {
    let s = setup("kcommit", 1, 600).await;
    s.kafka.fail_requests(
        RDKafkaApiKey::OffsetCommit,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        20,
    );
    s.kafka.fail_requests(
        RDKafkaApiKey::OffsetCommit,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_COORDINATOR,
        5,
    );
    let a = s.run(s.member());
    finish(vec![a]).await;
    s.assert_exactly_once().await;
}

/// The only broker goes down mid-stream and comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_broker_down_and_up_again_mid_stream() {
    let s = setup("kdown", 1, 1_000).await;
    // `exit_when_idle` counts a broker outage as idleness: wait out the
    // outage and librdkafka's reconnect backoff before calling it drained.
    let a = s.run(
        s.member()
            .max_in_flight(50)
            .exit_when_idle(Duration::from_secs(12)),
    );
    s.wait_for_rows(200).await;
    s.kafka.broker_down(1);
    tokio::time::sleep(Duration::from_secs(3)).await;
    s.kafka.broker_up(1);
    finish(vec![a]).await;
    s.assert_exactly_once().await;
}

/// Every response delayed by 150 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_broker() {
    let s = setup("kslow", 1, 300).await;
    s.kafka.round_trip_time(1, Duration::from_millis(150));
    let a = s.run(s.member());
    finish(vec![a]).await;
    s.assert_exactly_once().await;
}

/// The group coordinator moves twice mid-stream across a 3-broker cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_group_coordinator_moves() {
    let s = setup("kcoord", 3, 1_000).await;
    let a = s.run(s.member());
    s.wait_for_rows(200).await;
    s.kafka.move_coordinator(&s.group, 2);
    s.wait_for_rows(600).await;
    s.kafka.move_coordinator(&s.group, 3);
    finish(vec![a]).await;
    s.assert_exactly_once().await;
}

/// Heartbeats are answered "unknown member": the member learns it lost its
/// assignment, must not commit for the lost partitions (another member may
/// own them), rejoins and goes on; redeliveries dedupe.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_assignment() {
    let s = setup("klost", 1, 1_000).await;
    let a = s.run(s.member().max_in_flight(50));
    s.wait_for_rows(200).await;
    s.kafka.fail_requests(
        RDKafkaApiKey::Heartbeat,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID,
        3,
    );
    finish(vec![a]).await;
    s.assert_exactly_once().await;
}

/// Partitions at their in-flight bound (records waiting unread in their
/// queues, or held and paused while read from the main queue) are revoked
/// when members join and leave, and come back to either member moving:
/// librdkafka keeps an application pause across unassign/assign, and
/// deactivates split partition queues on every assign.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paused_partitions_revoked_and_reassigned_resume() {
    let s = setup("kpause", 1, 300).await;
    // Idle long enough to still be there when the third member leaves.
    let slow = |b: KafkaConsumerBuilder<PgStore>| {
        b.max_in_flight(4).exit_when_idle(Duration::from_secs(8))
    };
    let handler = Arc::new(Ledger {
        delay: Duration::from_millis(2),
        ..Ledger::default()
    });
    let start = |builder: KafkaConsumerBuilder<PgStore>| {
        let run = builder
            .build()
            .expect("consumer")
            .run_until(Arc::clone(&handler), CancellationToken::new());
        tokio::spawn(async move {
            let _stats = run.await.expect("consumer failed");
        })
    };
    let a = start(slow(s.member()));
    s.wait_for_rows(50).await;
    let b = start(slow(s.member()));
    s.wait_for_rows(150).await;
    // A third member joins and leaves: two more rebalances over paused partitions.
    let stop = CancellationToken::new();
    let c = slow(s.member())
        .build()
        .unwrap()
        .run_until(Arc::clone(&handler), stop.clone());
    let c = tokio::spawn(async move {
        let _stats = c.await.expect("consumer failed");
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    finish(vec![a, b, c]).await;
    s.assert_exactly_once().await;
}

/// More members than partitions: one member's assignment is empty, and
/// `exit_when_idle` still ends it (it used to wait for a partition forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_with_an_empty_assignment_exits_when_idle() {
    let s = setup("kempty", 1, 300).await;
    let members: Vec<_> = (0..=PARTITIONS).map(|_| s.run(s.member())).collect();
    finish(members).await;
    s.assert_exactly_once().await;
}

/// KIP-848 with more members than partitions: the broker leaves one
/// member without a partition, and it still exits when idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kip848_a_member_with_an_empty_assignment_exits_when_idle() {
    let s = setup("kip848e", 1, 300).await;
    let members: Vec<_> = (0..=PARTITIONS).map(|_| s.run(s.member_kip848())).collect();
    finish(members).await;
    s.assert_exactly_once().await;
}

/// The settings the broker owns under KIP-848 are refused when the
/// consumer is built, with the reason.
#[tokio::test]
async fn kip848_refuses_client_side_group_timings() {
    let s = setup("kip848c", 1, 1).await;
    let refused = s
        .member_kip848()
        .consumer_config("session.timeout.ms", "6000")
        .build()
        .err()
        .expect("refused");
    assert!(
        refused
            .to_string()
            .contains("group.consumer.session.timeout.ms"),
        "{refused}"
    );
    let refused = s
        .member_kip848()
        .consumer_config("partition.assignment.strategy", "cooperative-sticky")
        .build()
        .err()
        .expect("refused");
    assert!(refused.to_string().contains("KIP-848"), "{refused}");
    assert!(s.member_kip848().build().is_ok());
}

/// KIP-848 (`group.protocol=consumer`) on the mock cluster: members join
/// and leave while partitions are paused at their in-flight bound, so the
/// broker revokes and reassigns them incrementally; each revoke drains as
/// under the classic protocol, and the ledger is exact. The members that
/// stay run until every partition is committed to its end (the one that
/// left had its partitions taken over), however long the broker takes to
/// reassign them, then stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kip848_members_joining_and_leaving_lose_and_double_nothing() {
    let s = setup("kip848", 1, 300).await;
    let slow = |b: KafkaConsumerBuilder<PgStore>| {
        // Never idle long enough to exit: stopped by the test.
        b.max_in_flight(4).exit_when_idle(Duration::from_secs(3600))
    };
    let handler = Arc::new(Ledger {
        delay: Duration::from_millis(2),
        ..Ledger::default()
    });
    let start = |builder: KafkaConsumerBuilder<PgStore>, stop: CancellationToken| {
        let run = builder
            .build()
            .expect("consumer")
            .run_until(Arc::clone(&handler), stop);
        tokio::spawn(async move {
            let _stats = run.await.expect("consumer failed");
        })
    };
    let stay = CancellationToken::new();
    let a = start(slow(s.member_kip848()), stay.clone());
    s.wait_for_rows(50).await;
    let b = start(slow(s.member_kip848()), stay.clone());
    s.wait_for_rows(150).await;
    let leave = CancellationToken::new();
    let c = start(slow(s.member_kip848()), leave.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    leave.cancel();
    finish(vec![c]).await;
    // The members that stay take over what the one that left had, and
    // commit every partition to its end.
    let started = Instant::now();
    loop {
        let got = committed_on(s.kafka.bootstrap(), &s.group, &s.topic, PARTITIONS);
        if s.ends.iter().all(|(p, end)| got.get(p) == Some(end)) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "partitions not committed to their ends 90 s after a member left: {got:?} of {:?}",
            s.ends
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "every partition committed to its end {:?} after the member left",
        started.elapsed()
    );
    stay.cancel();
    finish(vec![a, b]).await;
    s.assert_exactly_once().await;
}
