//! The outbox scenario: the relay against a plain idempotent producer
//! sending the same messages, and end-to-end latency from an inbound
//! delivery to its outbound message being readable on the topic.

use std::time::{Duration, Instant};

use onceonly::outbox::{KafkaPublisher, Outbox, OutboxMessage, Relay, Status};
use onceonly::{Delivery, Engine, Json, PgStore, SqlStore, Tx, handler_fn};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sqlx::Postgres;

use super::common::{Bench, Res, now_us, pool};
use super::kafka::create_topics;
use super::stats::{Table, median, ms, percentile};

/// Accounts the messages are keyed by (the relay's ordering keys).
const ACCOUNTS: usize = 32;

#[derive(serde::Deserialize)]
struct Inbound {
    out_trade_no: String,
    account: String,
    sent_us: i64,
}

fn inbound(i: usize, sent_us: i64) -> Vec<u8> {
    serde_json::json!({
        "out_trade_no": format!("OB-{i}"),
        "account": format!("acct-{}", i % ACCOUNTS),
        "sent_us": sent_us,
    })
    .to_string()
    .into_bytes()
}

pub async fn run(b: &mut Bench) -> Res<()> {
    let n = b.sizes.backlog;
    let mut table = Table::new(
        format!(
            "Outbox relay ({n} messages keyed by {ACCOUNTS} accounts, Kafka acks=all, idempotent producer)"
        ),
        &["sender", "msgs/s", "vs plain producer"],
    );
    let mut plain = Vec::new();
    let mut cold = Vec::new();
    let mut relayed = Vec::new();
    let mut latencies = Vec::new();
    for _ in 0..b.runs {
        plain.push(plain_producer(b, n, true).await?);
        cold.push(plain_producer(b, n, false).await?);
        let (rate, lat) = relay_run(b, n).await?;
        relayed.push(rate);
        latencies.extend(lat);
    }
    let (plain, cold, relayed) = (median(&plain), median(&cold), median(&relayed));
    table.row(vec![
        "plain producer (connected first, all sends in flight)".into(),
        format!("{plain:.0}"),
        "1.00× (baseline)".into(),
    ]);
    table.row(vec![
        "plain producer (connecting in the clock)".into(),
        format!("{cold:.0}"),
        format!("{:.2}×", cold / plain),
    ]);
    table.row(vec![
        "onceonly relay (batch 500, per-key order, connected first)".into(),
        format!("{relayed:.0}"),
        format!(
            "{:.2}× ({:.2}× the connecting producer)",
            relayed / plain,
            relayed / cold
        ),
    ]);
    b.table(table);
    latencies.sort_unstable();
    let mut lat = Table::new(
        format!(
            "Outbox end to end ({} payments at {}/s: inbound delivery → outbound message readable on the topic)",
            b.sizes.paced, b.sizes.paced_rate
        ),
        &["wake-up", "p50", "p99", "messages"],
    );
    lat.row(vec![
        "PostgreSQL LISTEN/NOTIFY (+ 1 s poll)".into(),
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        latencies.len().to_string(),
    ]);
    b.table(lat);
    Ok(())
}

/// Sends `n` records with a plain idempotent producer, every send in
/// flight at once; returns messages per second. `warm`: the producer is
/// connected, with its producer id, before the clock starts (librdkafka
/// asks for the id every 500 ms until a broker is up, which alone is about
/// the time 5,000 records take).
async fn plain_producer(b: &mut Bench, n: usize, warm: bool) -> Res<f64> {
    let topic = b.unique("ob-plain");
    create_topics(&b.services, &[&topic]).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &b.services.brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()?;
    if warm {
        producer
            .send(
                FutureRecord::to(&topic).key("warm-up").payload("warm-up"),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    let started = Instant::now();
    let sends = (0..n).map(|i| {
        let producer = &producer;
        let topic = &topic;
        async move {
            let key = format!("acct-{}", i % ACCOUNTS);
            let body = inbound(i, 0);
            producer
                .send(
                    FutureRecord::to(topic).key(&key).payload(&body),
                    Duration::from_secs(30),
                )
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        }
    });
    for sent in futures_util::future::join_all(sends).await {
        sent?;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Fills the outbox through the engine (not timed), times the relay
/// draining it, then measures end-to-end latency of paced payments with
/// the relay running. Returns messages per second and the latencies.
async fn relay_run(b: &mut Bench, n: usize) -> Res<(f64, Vec<Duration>)> {
    let schema = b.schema("outbox").await?;
    let topic = b.unique("ob-settled");
    create_topics(&b.services, &[&topic]).await?;
    let pg = pool(&schema.url, 8).await?;
    let store = PgStore::new(pg.clone());
    store.migrate().await?;
    let outbox = Outbox::<Postgres>::new();
    outbox.migrate(&pg).await?;
    let engine = Engine::builder(store)
        .scope("bench-outbox")
        .key_expr("json:/out_trade_no")
        .build()?;
    let handler = {
        let (outbox, topic) = (outbox.clone(), topic.clone());
        handler_fn(move |tx: Tx<Postgres>, Json(p): Json<Inbound>| {
            let (outbox, topic) = (outbox.clone(), topic.clone());
            async move {
                let mut conn = tx.lock().await?;
                let body =
                    serde_json::json!({ "out_trade_no": p.out_trade_no, "sent_us": p.sent_us });
                outbox
                    .enqueue(
                        &mut conn,
                        OutboxMessage::kafka(topic, p.account, body.to_string()),
                    )
                    .await?;
                Ok(())
            }
        })
    };
    let deliveries: Vec<Delivery> = (0..n).map(|i| Delivery::new(inbound(i, 0))).collect();
    for chunk in deliveries.chunks(200) {
        engine.process_batch(&handler, chunk).await;
    }
    let relay = || -> Res<Relay<Postgres>> {
        Ok(Relay::builder(pg.clone(), outbox.clone())
            .publisher(KafkaPublisher::new(&b.services.brokers)?)
            .batch(500)
            .build()?)
    };
    // The relay's producer connects and gets its producer id before the
    // clock starts, as the warm plain producer does: a relay runs for
    // days, so the table compares publishing, not connecting.
    let relay = relay()?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    let running = relay.spawn();
    let deadline = Instant::now() + Duration::from_secs(600);
    while outbox.stats(&pg).await?.rows(Status::Sent) < n as i64 {
        if Instant::now() > deadline {
            return Err("the relay did not drain the outbox in 10 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();

    // Paced payments with the relay running; a reader timestamps arrivals.
    let paced = b.sizes.paced;
    // Reading from the start, so an arrival is timed when it happens.
    let reader = tokio::task::spawn_blocking(reader(&b.services.brokers, &topic, n, paced)?);
    let gap = Duration::from_secs_f64(1.0 / f64::from(b.sizes.paced_rate.max(1)));
    for i in 0..paced {
        let d = Delivery::new(inbound(n + i, now_us()));
        engine.process(&handler, &d).await;
        tokio::time::sleep(gap).await;
    }
    let latencies = reader.await??;
    running.stop().await;
    b.drop_schema(&schema).await;
    Ok((rate, latencies))
}

/// A reader of `topic` from offset `skip` that returns, for `expected`
/// messages, the time from their `sent_us` to their arrival.
fn reader(
    brokers: &str,
    topic: &str,
    skip: usize,
    expected: usize,
) -> Res<impl FnOnce() -> Res<Vec<Duration>> + Send + 'static> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("ob-reader-{topic}"))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "5")
        .create()?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(skip as i64))?;
    consumer.assign(&tpl)?;
    Ok(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut out = Vec::with_capacity(expected);
        while out.len() < expected && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                let body: serde_json::Value =
                    serde_json::from_slice(m.payload().unwrap_or_default())?;
                let sent = body["sent_us"].as_i64().unwrap_or(0);
                if sent > 0 {
                    let us = u64::try_from(now_us() - sent).unwrap_or(0);
                    out.push(Duration::from_micros(us));
                }
            }
        }
        if out.len() < expected {
            return Err(
                format!("only {} of {expected} outbound messages arrived", out.len()).into(),
            );
        }
        Ok(out)
    })
}
