//! Kafka helpers for the tests: topics, producing, reading a topic from the
//! start, committed offsets, and a Postgres schema per test.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};

/// Broker list: `ONCEONLY_KAFKA_BROKERS`, default `127.0.0.1:9092`.
pub fn brokers() -> String {
    std::env::var("ONCEONLY_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "Kafka is not reachable at {}: {e}\n\
         Start it with `scripts/services` (tansu on 127.0.0.1:9092; `docker compose up -d kafka` \
         also works), or point ONCEONLY_KAFKA_BROKERS at a running broker. These tests never skip.",
        brokers()
    )
}

/// Creates `topic` with `partitions` partitions. Names must be unique per
/// test: the in-memory broker keeps topics until it restarts.
pub async fn create_topic(topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .expect("admin client");
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    match admin.create_topics([&new], &opts).await {
        Ok(results) => {
            for r in results {
                if let Err((name, code)) = r {
                    panic!("creating topic {name} failed: {code}");
                }
            }
        }
        Err(e) => unreachable(e),
    }
}

/// One record to produce.
#[derive(Clone, Debug)]
pub struct Record {
    /// Record key.
    pub key: Option<String>,
    /// Payload.
    pub payload: Vec<u8>,
    /// Headers.
    pub headers: Vec<(String, String)>,
    /// Partition, or `None` for the partitioner's choice.
    pub partition: Option<i32>,
}

impl Record {
    /// A record with a key and a payload.
    pub fn new(key: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            key: Some(key.into()),
            payload: payload.into(),
            headers: Vec::new(),
            partition: None,
        }
    }

    /// Sends it to `partition`.
    pub fn to_partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// Adds a header.
    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }
}

/// A producer with `acks=all` that sends every record in its own batch.
///
/// Broker gap worked around here: tansu 0.6 answers a fetch at an offset
/// inside a multi-record batch with the *next* batch, silently skipping the
/// rest of the batch holding that offset (Apache Kafka returns the batch
/// containing it). A consumer resuming mid-batch after a commit would never
/// see those records. One record per batch keeps every offset a batch start.
pub fn producer() -> FutureProducer {
    producer_on(&brokers())
}

/// [`producer`] for the brokers at `bootstrap` (a mock cluster, say).
pub fn producer_on(bootstrap: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("batch.num.messages", "1")
        .create()
        .expect("producer")
}

/// Produces the records in order, waiting for every delivery report.
/// Returns, per partition, the offset after the last record produced there
/// (the log end this test is responsible for).
pub async fn produce(topic: &str, records: &[Record]) -> BTreeMap<i32, i64> {
    produce_on(&brokers(), topic, records).await
}

/// [`produce`] to the brokers at `bootstrap`.
pub async fn produce_on(bootstrap: &str, topic: &str, records: &[Record]) -> BTreeMap<i32, i64> {
    let producer = producer_on(bootstrap);
    let mut ends = BTreeMap::new();
    // In flight in bounded windows: fast, yet ordered per key and partition.
    for chunk in records.chunks(500) {
        let sends = chunk.iter().map(|r| {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &r.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
                .payload(r.payload.as_slice())
                .headers(headers);
            if let Some(k) = &r.key {
                record = record.key(k);
            }
            if let Some(p) = r.partition {
                record = record.partition(p);
            }
            producer.send(record, Duration::from_secs(30))
        });
        for result in futures_util::future::join_all(sends).await {
            match result {
                Ok(d) => {
                    let end = ends.entry(d.partition).or_insert(0);
                    *end = (*end).max(d.offset + 1);
                }
                Err((e, _)) => unreachable(e),
            }
        }
    }
    ends
}

/// Reads every record of `topic` (all partitions, from the beginning) until
/// `expected` arrived or `timeout` passed.
pub fn read_all(
    topic: &str,
    partitions: i32,
    expected: usize,
    timeout: Duration,
) -> Vec<OwnedMessage> {
    read_all_on(&brokers(), topic, partitions, expected, timeout)
}

/// [`read_all`] from the brokers at `bootstrap`.
pub fn read_all_on(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    expected: usize,
    timeout: Duration,
) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", crate::unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("offset");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < expected && Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push(m.detach()),
            Some(Err(e)) => eprintln!("reader: {e}"),
            None => {}
        }
    }
    out
}

/// Reads every record of `topic` (all `partitions`, from the beginning):
/// at least up to the log end as it is when called, then on until nothing
/// arrived for `quiet`; fails after `timeout`.
///
/// Broker gap worked around here: tansu 0.6 reports a high watermark short
/// of the end of a partition's last multi-record batch (seen with the
/// outbox relay's producer: up to two records past it), so the watermarks
/// are a lower bound only.
pub fn read_to_end(
    topic: &str,
    partitions: i32,
    quiet: Duration,
    timeout: Duration,
) -> Vec<OwnedMessage> {
    read_to_end_on(&brokers(), topic, partitions, quiet, timeout)
}

/// [`read_to_end`] on the brokers at `bootstrap`.
pub fn read_to_end_on(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    quiet: Duration,
    timeout: Duration,
) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", crate::unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut ends = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .unwrap_or_else(|e| unreachable(e));
        if high > low {
            ends.insert(p, high);
        }
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .expect("offset");
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + timeout;
    let mut last = Instant::now();
    let mut out = Vec::new();
    while !ends.is_empty() || last.elapsed() < quiet {
        assert!(
            Instant::now() < deadline,
            "{topic}: log ends {ends:?} not reached within {timeout:?} ({} read)",
            out.len()
        );
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                if let Some(end) = ends.get(&m.partition())
                    && m.offset() + 1 >= *end
                {
                    ends.remove(&m.partition());
                }
                last = Instant::now();
                out.push(m.detach());
            }
            Some(Err(e)) => eprintln!("reader: {e}"),
            None => {}
        }
    }
    out
}

/// The value of header `name` of `m`, as text.
pub fn header<'a>(m: &'a OwnedMessage, name: &str) -> Option<&'a str> {
    use rdkafka::message::Headers;
    m.headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
}

/// Committed positions of `group` on `topic`, per partition (`-1` if none).
pub fn committed(group: &str, topic: &str, partitions: i32) -> BTreeMap<i32, i64> {
    committed_on(&brokers(), group, topic, partitions)
}

/// [`committed`] on the brokers at `bootstrap`.
pub fn committed_on(
    bootstrap: &str,
    group: &str,
    topic: &str,
    partitions: i32,
) -> BTreeMap<i32, i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("offset reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .unwrap_or_else(|e| unreachable(e));
    got.elements()
        .iter()
        .map(|e| {
            let pos = match e.offset() {
                Offset::Offset(o) => o,
                _ => -1,
            };
            (e.partition(), pos)
        })
        .collect()
}

/// A fresh Postgres schema; returns a URL whose connections use it as
/// `search_path`, so the ledger and dedup tables of one test are its own.
pub async fn pg_schema(prefix: &str) -> String {
    let base = crate::pg_url();
    let schema = crate::unique(prefix);
    let pool = sqlx::PgPool::connect(&base).await.unwrap_or_else(|e| {
        panic!("PostgreSQL is not reachable at {base}: {e}; start it with scripts/services")
    });
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&pool)
        .await
        .expect("create schema");
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}options=-c%20search_path%3D{schema}")
}

/// The command line of a `kafka_payments` process of `group` reading
/// `topic` at `brokers` into the ledger at `db_url`, with a 6 s session
/// timeout (the crash and chaos tests).
pub fn payments_args(
    brokers: &str,
    topic: &str,
    group: &str,
    db_url: &str,
    dead_letter_topic: &str,
    batch_size: usize,
) -> Vec<String> {
    [
        "--brokers",
        brokers,
        "--topic",
        topic,
        "--group",
        group,
        "--database-url",
        db_url,
        "--dead-letter-topic",
        dead_letter_topic,
        "--batch-size",
        &batch_size.to_string(),
        "--session-timeout-ms",
        "6000",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect()
}
