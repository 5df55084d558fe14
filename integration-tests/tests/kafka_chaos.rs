//! Multi-process chaos on a broker with real group semantics: three
//! `kafka_payments` processes of one group on a 6-partition topic, each
//! SIGKILLed and restarted at random moments at least five times while more
//! than 20,000 payments (37 % duplicates) flow; then a drain. The group must
//! end with every key charged exactly once, exact balances, no dead letter
//! and every partition committed to its end (lag 0), with batch size 1 and
//! with batch size 100; and under KIP-848 (`group.protocol=consumer`),
//! with batch size 1.
//!
//! It runs on librdkafka's mock cluster: tansu 0.6.0 never expires a
//! SIGKILLed member, so the partitions of a killed process would never be
//! handed to the others (see `onceonly_integration_tests::mock`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use onceonly_integration_tests::child::Logged;
use onceonly_integration_tests::kafka::{
    Record, committed_on, payments_args, pg_schema, produce_on, read_all_on,
};
use onceonly_integration_tests::ledger::{assert_exact, crash_stream, rows};
use onceonly_integration_tests::mock::MockKafka;
use onceonly_integration_tests::unique;
use sqlx::PgPool;
use tokio::process::Child;

const PARTITIONS: i32 = 6;
const MEMBERS: usize = 3;
const KILLS_EACH: usize = 5;
/// 12,700 keys: 20,108 messages with the stream's duplicates.
const DISTINCT: usize = 12_700;

struct Group {
    /// KIP-848 (`group.protocol=consumer`) rather than the classic protocol.
    kip848: bool,
    bootstrap: String,
    topic: String,
    dlt: String,
    group: String,
    url: String,
    batch_size: usize,
    log: Logged,
}

impl Group {
    fn spawn(&self) -> Child {
        let mut args = payments_args(
            &self.bootstrap,
            &self.topic,
            &self.group,
            &self.url,
            &self.dlt,
            self.batch_size,
        );
        if self.kip848 {
            args.extend(["--group-protocol".to_owned(), "consumer".to_owned()]);
        }
        self.log.spawn("kafka_payments", &args)
    }
}

async fn chaos(kafka: &MockKafka, batch_size: usize, kip848: bool) {
    let name = format!("kchaos{batch_size}{}", if kip848 { "k" } else { "" });
    let topic = unique(&name);
    let dlt = format!("{topic}.dlt");
    kafka.create_topic(&topic, PARTITIONS);
    kafka.create_topic(&dlt, 1);
    let url = pg_schema(&name).await;
    let pool = PgPool::connect(&url).await.expect("postgres");
    let stream = crash_stream(&format!("X{batch_size}"), DISTINCT);
    assert!(stream.messages.len() >= 20_000 && stream.duplicates() * 5 >= stream.messages.len());
    let records: Vec<Record> = stream
        .messages
        .iter()
        .map(|(no, body)| Record::new(no.clone(), body.clone()))
        .collect();
    let group = Group {
        kip848,
        bootstrap: kafka.bootstrap().to_owned(),
        topic: topic.clone(),
        dlt: dlt.clone(),
        group: unique("chaos"),
        url,
        batch_size,
        log: Logged::new("kafka_chaos"),
    };
    let mut members: Vec<Child> = (0..MEMBERS).map(|_| group.spawn()).collect();

    // Payments flow while the members are killed: about 700 a second.
    let bootstrap = kafka.bootstrap().to_owned();
    let producing = tokio::spawn({
        let topic = topic.clone();
        async move {
            let mut ends = BTreeMap::new();
            for chunk in records.chunks(350) {
                for (p, end) in produce_on(&bootstrap, &topic, chunk).await {
                    let e = ends.entry(p).or_insert(0);
                    *e = end.max(*e);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            ends
        }
    });

    let mut rng = fastrand::Rng::new();
    let mut kills = [0usize; MEMBERS];
    let mut killed_mid_stream = 0;
    while kills.iter().any(|&k| k < KILLS_EACH) {
        tokio::time::sleep(Duration::from_millis(rng.u64(300..1_500))).await;
        let candidates: Vec<usize> = (0..MEMBERS).filter(|&m| kills[m] < KILLS_EACH).collect();
        let m = candidates[rng.usize(0..candidates.len())];
        if let Some(status) = members[m].try_wait().expect("status") {
            panic!(
                "member {m} exited by itself ({status}); log:\n{}",
                group.log.tail()
            );
        }
        members[m].start_kill().expect("SIGKILL");
        members[m].wait().await.expect("reap");
        kills[m] += 1;
        if !producing.is_finished() {
            killed_mid_stream += 1;
        }
        members[m] = group.spawn();
    }
    let ends = tokio::time::timeout(Duration::from_secs(120), producing)
        .await
        .expect("producer stalled")
        .expect("producer");
    assert!(
        killed_mid_stream >= MEMBERS * KILLS_EACH / 2,
        "most kills must land while payments flow ({killed_mid_stream})"
    );

    // Drain: every partition committed to its end.
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let got = committed_on(kafka.bootstrap(), &group.group, &topic, PARTITIONS);
        if ends.iter().all(|(p, end)| got.get(p) == Some(end)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "group lag not 0 after the chaos: committed {got:?}, ends {ends:?}, ledger rows {}; log:\n{}",
            rows(&pool).await,
            group.log.tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for member in &mut members {
        member.start_kill().ok();
        member.wait().await.ok();
    }
    assert_exact(&pool, &stream.expected).await;
    let letters = read_all_on(kafka.bootstrap(), &dlt, 1, 1, Duration::from_secs(1));
    assert!(letters.is_empty(), "nothing was dead-lettered");
    eprintln!(
        "{} batch {batch_size}: {} messages ({} duplicates), {} kills ({killed_mid_stream} while producing), ledger exact, lag 0",
        if kip848 { "KIP-848" } else { "classic" },
        stream.messages.len(),
        stream.duplicates(),
        kills.iter().sum::<usize>()
    );
}

/// One test, the two batch sizes in turn: six processes at once would only
/// fight for the two cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_killed_five_times_each_lose_and_double_nothing() {
    let kafka = MockKafka::start(1);
    chaos(&kafka, 1, false).await;
    chaos(&kafka, 100, false).await;
}

/// The same chaos under KIP-848 (`group.protocol=consumer`): the broker
/// expires a killed member after its consumer session timeout (6 s here,
/// as the classic members' `session.timeout.ms`) and reassigns its
/// partitions incrementally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kip848_three_members_killed_five_times_each_lose_and_double_nothing() {
    let kafka = MockKafka::start_kip848(1, Duration::from_secs(6));
    chaos(&kafka, 1, true).await;
}
