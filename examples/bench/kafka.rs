//! Kafka → Postgres: a plain rdkafka consumer doing the same business
//! writes without dedup (at-least-once, offsets committed every 500 ms
//! after the transaction, batches of the same size) vs
//! `onceonly::kafka::KafkaConsumer`, per message and batched.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use onceonly::kafka::KafkaConsumer;
use onceonly::{FingerprintSpec, PgStore, RetryPolicy, SqlStore};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::child::{BenchLedger, ChildSpec, Consumer, KafkaSpec, Msg, business_write, inbox_write};
use super::common::{
    Bench, Child, FETCH_WAIT_MS, Measured, Observer, Plan, RATIO_COLUMNS, Res, RunResult,
    account_of, business_tables, columns, drain_backlog, latencies, ledger_counts, payload, pool,
};
use super::inbox::{self, Form};
use super::scale_out::{self, ScaleRun};
use super::stats::Table;

/// Batch sizes compared (1 = a transaction per message).
const BATCHES: [usize; 3] = [1, 100, 1000];

/// The consumers compared at `batch`, in table order. The hand-written
/// inbox claims a batch's keys first, in one `UNNEST` insert; claiming
/// last is a per-message form (a batch would lose every message's writes
/// to one duplicate).
fn consumers(batch: usize) -> Vec<Consumer> {
    let mut v = vec![Consumer::Baseline, Consumer::Inbox(Form::ClaimFirst)];
    if batch == 1 {
        v.push(Consumer::Inbox(Form::ClaimLast));
    }
    v.extend([Consumer::Onceonly, Consumer::OnceonlyOptimistic]);
    v
}

pub async fn run(b: &mut Bench) -> Res<()> {
    for dup in b.dups.clone() {
        let mut first = vec!["consumer", "batch", "msgs/s", "p50", "p99", "peak RSS"];
        first.extend(RATIO_COLUMNS);
        let mut table = Table::new(
            format!(
                "Kafka → Postgres ({} backlog msgs drained + {} paced at {}/s, {dup}% duplicates, 1 partition, fetch.wait.max.ms {FETCH_WAIT_MS}; ratios against the same batch)",
                b.sizes.backlog, b.sizes.paced, b.sizes.paced_rate
            ),
            &columns(&first, "msgs / rows / distinct keys"),
        );
        for batch in BATCHES {
            // A smoke run's backlog is smaller than the largest batch, whose
            // code path batch 100 already takes.
            if b.mode == super::common::Mode::Quick && batch > 100 {
                continue;
            }
            let variants = consumers(batch);
            // Runs interleave the variants (baseline, inbox, onceonly,
            // baseline, ...), so drifting load on the shared machine hits
            // all alike.
            let mut results: Vec<Vec<RunResult>> = variants.iter().map(|_| Vec::new()).collect();
            let inline = b.inline_counts();
            for r in 0..b.runs {
                for (v, &consumer) in variants.iter().enumerate() {
                    let seed = 1000 + r as u64;
                    let run = one_run(b, consumer, batch, dup, seed, inline).await?;
                    results[v].push(run);
                }
            }
            let mut counted: Vec<Option<RunResult>> = variants.iter().map(|_| None).collect();
            if b.counted_pass() {
                for (v, &consumer) in variants.iter().enumerate() {
                    counted[v] = Some(one_run(b, consumer, batch, dup, 1999, true).await?);
                }
            }
            let measured: Vec<(Consumer, Measured)> = variants
                .into_iter()
                .zip(results)
                .zip(counted)
                .map(|((c, runs), counted)| (c, Measured::combine(&runs, counted.as_ref())))
                .collect();
            let what = if batch == 1 {
                "Kafka per message".to_owned()
            } else {
                format!("Kafka batch {batch}")
            };
            super::common::consumer_rows(b, &mut table, &measured, &what, dup, Some(batch));
        }
        b.table(table);
    }
    scale_out(b).await
}

/// Partitions of the scale-out topic.
const SCALE_PARTITIONS: i32 = 12;

/// Scale-out: 1, 2 and 4 onceonly consumer processes of one group, started
/// together, drain one backlog from a 12-partition topic (batch 100, no
/// duplicates); see [`scale_out`](super::scale_out).
async fn scale_out(b: &mut Bench) -> Res<()> {
    let broker = if b.services.kafka_mock.is_some() {
        "mock cluster"
    } else {
        "broker"
    };
    let title = |backlog| {
        format!(
            "Kafka → Postgres scale-out ({backlog} backlog msgs, {SCALE_PARTITIONS} partitions, batch 100, one group, {broker})"
        )
    };
    scale_out::measure(b, title, 2000, scale_run).await
}

/// One scale-out run; returns its measures and the ledger counts.
async fn scale_run(
    b: &mut Bench,
    procs: usize,
    backlog: usize,
    seed: u64,
) -> Res<(ScaleRun, String)> {
    let topic = b.unique("kscale");
    let schema = b.schema("kscale").await?;
    let client = b.db_client(&schema.url, false)?;
    let result = async {
        create_topics_with(
            &b.services,
            &[&topic, &format!("{topic}.dlt")],
            SCALE_PARTITIONS,
        )
        .await?;
        let db = pool(&schema.url, 4).await?;
        business_tables(&db).await?;
        PgStore::new(db.clone()).migrate().await?;
        // The whole backlog first: the drain, not the producer, is measured.
        // Records are keyed by account, as an application partitions its
        // updates: one account's balance is then updated from one partition
        // only. Keyed by payment instead, batches of different partitions
        // lock the same `accounts` rows in different orders and deadlock.
        let plan = Plan::new(backlog, 0, &topic, seed);
        let producer = producer(&b.services.brokers)?;
        produce_keyed(&producer, &topic, &plan.keys, account_of).await?;
        let observer = Observer::start(db.clone());
        let group = format!("{topic}-group");
        let spec = ChildSpec::Kafka(KafkaSpec {
            consumer: Consumer::Onceonly,
            brokers: b.services.brokers.clone(),
            topic: topic.clone(),
            group: group.clone(),
            db_url: client.url.clone(),
            batch: 100,
        });
        let run = scale_out::drain(b, &vec![spec; procs], &client, &observer, &plan).await?;
        observer.stop().await?;
        let (rows, distinct) = ledger_counts(&db).await?;
        Ok::<_, super::common::BoxError>((
            run,
            format!("{} / {rows} / {distinct}", plan.keys.len()),
            rows == plan.distinct as i64,
        ))
    }
    .await;
    b.drop_schema(&schema).await;
    delete_topics(&b.services, &[&topic, &format!("{topic}.dlt")]).await;
    let (run, counts, exact) = result?;
    b.check(exact, || {
        format!("kafka scale-out {procs} processes: ledger {counts}")
    });
    Ok((run, counts))
}

/// One consumer run on a fresh topic and schema: drain a backlog (rate),
/// then paced messages (latency); check every message was consumed once
/// (onceonly: one row per distinct key) and the offsets were committed.
async fn one_run(
    b: &mut Bench,
    consumer: Consumer,
    batch: usize,
    dup: u32,
    seed: u64,
    counted: bool,
) -> Res<RunResult> {
    let dedup = consumer.dedup();
    let topic = b.unique("kafka");
    let schema = b.schema("kafka").await?;
    let client = b.db_client(&schema.url, counted)?;
    let result = async {
        create_topics(&b.services, &[&topic, &format!("{topic}.dlt")]).await?;
        let db = pool(&schema.url, 4).await?;
        business_tables(&db).await?;
        PgStore::new(db.clone()).migrate().await?;
        let plan = Plan::new(b.sizes.backlog, dup, &topic, seed);
        let producer = producer(&b.services.brokers)?;
        let mut ends = produce(&producer, &topic, &plan.keys).await?;

        let observer = Observer::start(db.clone());
        let group = format!("{topic}-group");
        let mut child = Child::spawn(&ChildSpec::Kafka(KafkaSpec {
            consumer,
            brokers: b.services.brokers.clone(),
            topic: topic.clone(),
            group: group.clone(),
            db_url: client.url.clone(),
            batch,
        }))
        .await?;
        let window = b.window(&child, &client).await?;
        let rate = drain_backlog(&observer, &plan, dedup, &mut child).await?;
        let cost = b.close_window(window, plan.keys.len()).await?;

        // Paced fresh keys: latency with the consumer keeping up.
        let (paced, mut tick) = b.sizes.paced(&topic);
        let mut sends = Vec::new();
        for key in &paced {
            tick.tick().await;
            let body = payload(key);
            let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(&topic)
                .key(key.as_str())
                .payload(body.as_slice());
            sends.push(producer.send_result(record).map_err(|(e, _)| e)?);
        }
        for s in sends {
            let d = s.await?.map_err(|(e, _)| e)?;
            let end = ends.entry(d.partition).or_insert(0);
            *end = (*end).max(d.offset + 1);
        }
        observer
            .wait_for(
                plan.effects(dedup) + paced.len() as u64,
                Duration::from_secs(60),
                &mut child,
            )
            .await?;
        let lat = latencies(&observer.take());
        let rss_mib = child.peak_rss_mib();
        child.stop().await?;
        observer.stop().await?;

        let committed = committed(&b.services.brokers, &group, &topic, &ends)?;
        let (rows, distinct) = ledger_counts(&db).await?;
        let messages = plan.keys.len() + paced.len();
        let distinct_keys = (plan.distinct + paced.len()) as i64;
        Ok::<_, super::common::BoxError>((
            RunResult {
                rate,
                latencies: lat,
                rss_mib,
                rows,
                distinct,
                messages,
                cost,
            },
            committed == ends,
            format!("committed {committed:?}, log end {ends:?}"),
            distinct_keys,
        ))
    }
    .await;
    b.drop_schema(&schema).await;
    delete_topics(&b.services, &[&topic, &format!("{topic}.dlt")]).await;
    let (run, offsets_ok, offsets, distinct_keys) = result?;
    let who = consumer.name();
    b.check(offsets_ok, || {
        format!("kafka {who} batch {batch}: not every offset committed ({offsets})")
    });
    b.check_ledger(
        &format!("kafka {who} batch {batch}"),
        dedup,
        &run,
        distinct_keys,
    );
    Ok(run)
}

/// Creates topics with one partition.
pub async fn create_topics(services: &super::common::Services, topics: &[&str]) -> Res<()> {
    create_topics_with(services, topics, 1).await
}

/// Creates topics with `partitions` partitions.
async fn create_topics_with(
    services: &super::common::Services,
    topics: &[&str],
    partitions: i32,
) -> Res<()> {
    if let Some(mock) = &services.kafka_mock {
        for t in topics {
            mock.create_topic(t, partitions)?;
        }
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &services.brokers)
        .create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for r in admin.create_topics(&new, &opts).await? {
        r.map_err(|(name, code)| format!("creating topic {name}: {code}"))?;
    }
    Ok(())
}

/// Deletes topics (best effort: tansu keeps them in memory otherwise; the
/// mock cluster has no admin API and goes with the process).
pub async fn delete_topics(services: &super::common::Services, topics: &[&str]) {
    if services.kafka_mock.is_some() {
        return;
    }
    let admin: Result<AdminClient<DefaultClientContext>, _> = ClientConfig::new()
        .set("bootstrap.servers", &services.brokers)
        .create();
    if let Ok(admin) = admin {
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        if let Err(e) = admin.delete_topics(topics, &opts).await {
            eprintln!("deleting topics {topics:?}: {e}");
        }
    }
}

/// A producer with `acks=all` that sends one record per batch.
///
/// tansu 0.6 answers a fetch at an offset inside a multi-record batch with
/// the next batch, skipping the rest of that batch; a consumer resumes
/// mid-batch whenever it pauses a partition (onceonly does at 1000 records
/// in flight), so records would be lost. One record per batch avoids it
/// (see integration-tests/src/kafka.rs).
pub fn producer(brokers: &str) -> Res<FutureProducer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("acks", "all")
        .set("linger.ms", "0")
        .set("batch.num.messages", "1")
        .create()?)
}

/// Produces one message per key, in order, in windows of 1000 awaited
/// deliveries; returns the log end per partition.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    keys: &[String],
) -> Res<BTreeMap<i32, i64>> {
    produce_keyed(producer, topic, keys, |key| key.to_owned()).await
}

/// [`produce`] with the record key `record_key(key)` (the payment's key
/// stays in the payload).
async fn produce_keyed(
    producer: &FutureProducer,
    topic: &str,
    keys: &[String],
    record_key: impl Fn(&str) -> String,
) -> Res<BTreeMap<i32, i64>> {
    let mut ends = BTreeMap::new();
    for chunk in keys.chunks(1000) {
        let mut sends = Vec::with_capacity(chunk.len());
        for key in chunk {
            let body = payload(key);
            let record_key = record_key(key);
            let record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
                .key(record_key.as_str())
                .payload(body.as_slice());
            sends.push(producer.send_result(record).map_err(|(e, _)| e)?);
        }
        for s in sends {
            let d = s.await?.map_err(|(e, _)| e)?;
            let end = ends.entry(d.partition).or_insert(0);
            *end = (*end).max(d.offset + 1);
        }
    }
    Ok(ends)
}

/// The group's committed offsets for the partitions of `ends`.
fn committed(
    brokers: &str,
    group: &str,
    topic: &str,
    ends: &BTreeMap<i32, i64>,
) -> Res<BTreeMap<i32, i64>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in ends.keys() {
        tpl.add_partition(topic, *p);
    }
    let got = consumer.committed_offsets(tpl, Duration::from_secs(10))?;
    Ok(got
        .elements()
        .iter()
        .map(|e| {
            let offset = match e.offset() {
                Offset::Offset(o) => o,
                _ => -1,
            };
            (e.partition(), offset)
        })
        .collect())
}

/// The consumer child: plain rdkafka (no dedup or the hand-written inbox)
/// or onceonly.
pub async fn consume(spec: &KafkaSpec, stop: CancellationToken) -> Res<()> {
    let KafkaSpec {
        consumer,
        brokers,
        topic,
        group,
        db_url,
        batch,
    } = spec.clone();
    let (brokers, topic, group, db_url) = (&brokers[..], &topic[..], &group[..], &db_url[..]);
    if consumer.onceonly() {
        let store = super::variant::pg_store(db_url, false).await?;
        let engine = onceonly::Engine::builder(store)
            .optimistic(consumer.optimistic())
            .key_expr("json:/out_trade_no")
            .fingerprint(FingerprintSpec::Fields(vec![
                "/account".into(),
                "/amount".into(),
            ]))
            .retry(RetryPolicy::default().max_attempts(1));
        let kafka = KafkaConsumer::builder(engine)
            .brokers(brokers)
            .group_id(group)
            .topic(topic)
            .batch_size(batch)
            .consumer_config("auto.offset.reset", "earliest")
            .consumer_config("fetch.wait.max.ms", FETCH_WAIT_MS)
            .build()?;
        println!("ready");
        kafka.run_until(BenchLedger, stop).await?;
        return Ok(());
    }
    let inbox = match consumer {
        Consumer::Inbox(form) => Some(form),
        _ => None,
    };
    baseline(brokers, topic, group, db_url, batch, inbox, stop).await
}

/// The baseline: the same writes, one transaction per batch (5 ms linger,
/// like onceonly's default), offsets committed every 500 ms after the
/// transaction committed, and on shutdown; with `inbox`, each key claimed
/// in the hand-written inbox in the same transaction (see [`inbox`]).
async fn baseline(
    brokers: &str,
    topic: &str,
    group: &str,
    db_url: &str,
    batch: usize,
    inbox: Option<Form>,
    stop: CancellationToken,
) -> Res<()> {
    let db = pool(db_url, 4).await?;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        // The same prefetch bound and fetch wait as onceonly's consumer.
        .set("queued.max.messages.kbytes", "16384")
        .set("fetch.wait.max.ms", FETCH_WAIT_MS)
        .create()?;
    consumer.subscribe(&[topic])?;
    println!("ready");
    let linger = Duration::from_millis(5);
    let mut next: BTreeMap<(String, i32), i64> = BTreeMap::new();
    let mut dirty = false;
    let mut last_commit = Instant::now();
    let commit = |next: &BTreeMap<(String, i32), i64>, mode: CommitMode| -> Res<()> {
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in next {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))?;
        }
        consumer.commit(&tpl, mode)?;
        Ok(())
    };
    loop {
        let first = tokio::select! {
            () = stop.cancelled() => break,
            m = consumer.recv() => m?.detach(),
        };
        let mut records = vec![first];
        let deadline = tokio::time::Instant::now() + linger;
        while records.len() < batch {
            match tokio::time::timeout_at(deadline, consumer.recv()).await {
                Ok(m) => records.push(m?.detach()),
                Err(_) => break,
            }
        }
        let msgs = records
            .iter()
            .map(|r| serde_json::from_slice(r.payload().unwrap_or_default()))
            .collect::<Result<Vec<Msg>, _>>()?;
        let mut tx = db.begin().await?;
        let kept = match inbox {
            None => {
                for m in &msgs {
                    business_write(&mut tx, m).await?;
                }
                true
            }
            // One message: claimed first or last around its writes.
            Some(form) if msgs.len() == 1 => inbox_write(&mut tx, form, &msgs[0]).await?,
            // A batch: its keys claimed first in one insert, then the
            // writes of the new ones (each once).
            Some(_) => {
                let keys: Vec<&str> = msgs.iter().map(|m| m.out_trade_no.as_str()).collect();
                let mut new: std::collections::HashSet<String> = inbox::claim_many(&mut tx, &keys)
                    .await?
                    .into_iter()
                    .collect();
                for m in &msgs {
                    if new.remove(&m.out_trade_no) {
                        business_write(&mut tx, m).await?;
                    }
                }
                true
            }
        };
        let t = Instant::now();
        if kept {
            tx.commit().await?;
        } else {
            // A duplicate: nothing of it is kept.
            tx.rollback().await?;
        }
        super::child::add_time(&super::child::COMMIT_NANOS, t);
        for r in &records {
            next.insert((r.topic().to_owned(), r.partition()), r.offset() + 1);
        }
        dirty = true;
        if last_commit.elapsed() >= Duration::from_millis(500) {
            commit(&next, CommitMode::Async)?;
            dirty = false;
            last_commit = Instant::now();
        }
    }
    if dirty || !next.is_empty() {
        commit(&next, CommitMode::Sync)?;
    }
    Ok(())
}
