//! The outbox scenario: the relay against its own floor (a DB-only drain:
//! the relay's take, lease and mark statements with a publisher that
//! confirms at once, no broker) and against a plain idempotent producer
//! sending the same messages; end-to-end latency from an inbound delivery
//! to its outbound message being readable on the topic; and the drain of
//! webhooks to a receiver that fails one call in ten, per ordering.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use onceonly::outbox::{
    KafkaPublisher, Kind, Outbox, OutboxMessage, Outgoing, PublishError, Publisher, Relay, Status,
    WebhookPublisher,
};
use onceonly::{Delivery, Engine, Json, PgStore, SqlStore, Tx, handler_fn};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sqlx::Postgres;

use super::common::{Bench, Mode, Res, now_us, pool};
use super::kafka::create_topics;
use super::meter::{Cost, DbClient, Window, with_application_name};
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
            "Outbox relay ({n} messages keyed by {ACCOUNTS} accounts, batch 500; Kafka acks=all, idempotent producer)"
        ),
        &[
            "sender",
            "msgs/s",
            "vs DB-only drain",
            "vs plain producer",
            "bench CPU ms/1k",
            "PostgreSQL CPU ms/1k",
        ],
    );
    let mut plain = Vec::new();
    let mut cold = Vec::new();
    let (mut floor, mut floor_cost) = (Vec::new(), Vec::new());
    let (mut relayed, mut relayed_cost) = (Vec::new(), Vec::new());
    let mut latencies = Vec::new();
    for _ in 0..b.runs {
        plain.push(plain_producer(b, n, true).await?);
        cold.push(plain_producer(b, n, false).await?);
        let (rate, cost, _) = relay_run(b, n, false).await?;
        floor.push(rate);
        floor_cost.push(cost);
        let (rate, cost, lat) = relay_run(b, n, true).await?;
        relayed.push(rate);
        relayed_cost.push(cost);
        latencies.extend(lat);
    }
    let (plain, cold) = (median(&plain), median(&cold));
    let (floor, relayed) = (median(&floor), median(&relayed));
    let cpu = |costs: &[Cost], f: fn(&Cost) -> Option<f64>| {
        let v: Vec<f64> = costs.iter().filter_map(f).collect();
        if v.is_empty() {
            "–".to_owned()
        } else {
            format!("{:.0}", median(&v))
        }
    };
    table.row(vec![
        "DB-only drain (the relay's take, lease and mark; confirmed at once, no broker)".into(),
        format!("{floor:.0}"),
        "1.00× (floor)".into(),
        format!("{:.2}×", floor / plain),
        cpu(&floor_cost, |c| c.app_cpu),
        cpu(&floor_cost, |c| c.db_cpu),
    ]);
    table.row(vec![
        "onceonly relay (per-key order, connected first)".into(),
        format!("{relayed:.0}"),
        format!("{:.2}×", relayed / floor),
        format!(
            "{:.2}× ({:.2}× the connecting producer)",
            relayed / plain,
            relayed / cold
        ),
        cpu(&relayed_cost, |c| c.app_cpu),
        cpu(&relayed_cost, |c| c.db_cpu),
    ]);
    table.row(vec![
        "plain producer (connected first, all sends in flight; no database)".into(),
        format!("{plain:.0}"),
        "–".into(),
        "1.00×".into(),
        "–".into(),
        "–".into(),
    ]);
    table.row(vec![
        "plain producer (connecting in the clock)".into(),
        format!("{cold:.0}"),
        "–".into(),
        format!("{:.2}×", cold / plain),
        "–".into(),
        "–".into(),
    ]);
    b.table(table);
    let ratio = relayed / floor;
    b.target(
        "Outbox relay vs its DB-only drain",
        format!("{ratio:.2}× ({relayed:.0} vs {floor:.0} msgs/s)"),
        "≥ 0.8× DB-only drain",
        ratio >= 0.8,
    );
    latencies.sort_unstable();
    let (p50, p99) = (percentile(&latencies, 0.50), percentile(&latencies, 0.99));
    let mut lat = Table::new(
        format!(
            "Outbox end to end ({} payments at {}/s: inbound delivery → outbound message readable on the topic)",
            b.sizes.paced, b.sizes.paced_rate
        ),
        &["wake-up", "p50", "p99", "messages"],
    );
    lat.row(vec![
        "PostgreSQL LISTEN/NOTIFY (+ 1 s poll)".into(),
        ms(p50),
        ms(p99),
        latencies.len().to_string(),
    ]);
    b.table(lat);
    b.target(
        "Outbox end to end p99 (inbound → on the topic)",
        format!("{} (p50 {})", ms(p99), ms(p50)),
        "≤ 15 ms",
        p99 <= Duration::from_millis(15),
    );
    webhooks(b).await
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

/// Confirms every message at once without sending it: a relay with it
/// runs exactly its own database work (take, lease, mark sent), the floor
/// the relay's rate is measured against.
struct Confirming;

#[async_trait]
impl Publisher for Confirming {
    fn kind(&self) -> Kind {
        Kind::Kafka
    }

    async fn publish(&self, _message: &Outgoing<'_>) -> Result<(), PublishError> {
        Ok(())
    }
}

/// Fills the outbox through the engine (not timed), times a relay
/// draining it (to Kafka with `broker`, else through [`Confirming`]:
/// the DB-only drain), then, with `broker`, measures end-to-end latency
/// of paced payments with the relay running. Returns messages per second,
/// the drain's CPU per 1,000 messages (this process and the relay's
/// PostgreSQL backends) and the latencies.
async fn relay_run(b: &mut Bench, n: usize, broker: bool) -> Res<(f64, Cost, Vec<Duration>)> {
    let schema = b.schema("outbox").await?;
    let topic = b.unique("ob-settled");
    if broker {
        create_topics(&b.services, &[&topic]).await?;
    }
    let application_name = b.unique("relay");
    let db = DbClient {
        url: with_application_name(&schema.url, &application_name),
        application_name,
        counted: false,
    };
    let pg = pool(&db.url, 8).await?;
    // Progress is read on a pool of its own, outside the measured backends.
    let watch = pool(&schema.url, 1).await?;
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
    let builder = Relay::builder(pg.clone(), outbox.clone()).batch(500);
    let relay = if broker {
        builder.publisher(KafkaPublisher::new(&b.services.brokers)?)
    } else {
        builder.publisher(Confirming)
    }
    .build()?;
    // The relay's producer connects and gets its producer id before the
    // clock starts, as the warm plain producer does: a relay runs for
    // days, so the table compares publishing, not connecting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let window = Window::open(std::process::id(), &db, &b.admin, None).await?;
    let started = Instant::now();
    let running = relay.spawn();
    let deadline = Instant::now() + Duration::from_secs(600);
    while outbox.stats(&watch).await?.rows(Status::Sent) < n as i64 {
        if Instant::now() > deadline {
            return Err("the relay did not drain the outbox in 10 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    let cost = window.close(n, &b.admin, None).await?;
    if !broker {
        running.stop().await;
        b.drop_schema(&schema).await;
        return Ok((rate, cost, Vec::new()));
    }

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
    Ok((rate, cost, latencies))
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

/// Merchants the webhook notifications are spread over.
const MERCHANTS: usize = 40;

/// How the webhook notifications are ordered.
#[derive(Clone, Copy)]
enum HookOrder {
    /// All in one order (`order_by` the URL): what a webhook without an
    /// order key got before issue 46.
    PerUrl,
    /// One order per merchant (`order_by` the merchant).
    PerMerchant,
    /// None: each notification on its own (the default).
    None,
}

impl HookOrder {
    fn label(self) -> &'static str {
        match self {
            Self::PerUrl => "one order per URL (`order_by(url)`: the default before issue 46)",
            Self::PerMerchant => "one order per merchant (`order_by(merchant)`)",
            Self::None => "none (the default: each on its own, ≤ 16 in flight per URL)",
        }
    }
}

/// What the loopback receiver saw.
#[derive(Default)]
struct Received {
    /// Calls per notification body.
    calls: BTreeMap<String, usize>,
    /// 2xx answers per notification body.
    delivered: BTreeMap<String, usize>,
    /// Calls answered 500.
    failed: usize,
    /// The receiver's time in its callbacks, summed.
    busy: Duration,
    in_flight: usize,
    max_in_flight: usize,
}

/// The fate of a receiver's `call`-th call of `body`, the same in every
/// run and ordering: `(answer 500, wait 200 ms first)`, one call in ten
/// failing and one in twenty slow.
fn fate(body: &str, call: usize) -> (bool, bool) {
    use std::hash::{Hash, Hasher};
    // Fixed keys: the same fates in every run of this build.
    let mut h = std::hash::DefaultHasher::new();
    (46u32, body, call).hash(&mut h);
    let h = h.finish();
    (h.is_multiple_of(10), (h / 10).is_multiple_of(20))
}

/// The webhook drain: notifications of distinct payments to one loopback
/// URL whose receiver fails one call in ten and is sometimes slow, drained
/// by one relay (its defaults; `--quick`: fewer, with short backoff and
/// poll), per ordering.
async fn webhooks(b: &mut Bench) -> Res<()> {
    let quick = b.mode == Mode::Quick;
    let n = if quick { 40 } else { 400 };
    let mut table = Table::new(
        format!(
            "Webhook drain ({n} notifications of distinct payments from {MERCHANTS} merchants to one URL; the receiver answers 500 to one call in ten and waits 200 ms on one in twenty; relay defaults{})",
            if quick {
                ", backoff 10 ms, poll 20 ms"
            } else {
                ""
            }
        ),
        &[
            "ordering",
            "drain",
            "vs one order per URL",
            "calls",
            "500s",
            "receiver busy",
            "most in flight",
        ],
    );
    let mut per_url = None;
    for ordering in [HookOrder::PerUrl, HookOrder::PerMerchant, HookOrder::None] {
        let mut runs = Vec::new();
        let mut last = None;
        for _ in 0..b.runs {
            let (drain, received) = webhook_run(b, n, ordering, quick).await?;
            runs.push(drain.as_secs_f64());
            last = Some(received);
        }
        let drain = median(&runs);
        let before = *per_url.get_or_insert(drain);
        let Some(r) = last else { continue };
        table.row(vec![
            ordering.label().into(),
            format!("{drain:.2} s"),
            format!("{:.1}× faster", before / drain.max(f64::EPSILON)),
            r.calls.values().sum::<usize>().to_string(),
            r.failed.to_string(),
            format!("{:.2} s", r.busy.as_secs_f64()),
            r.max_in_flight.to_string(),
        ]);
    }
    b.table(table);
    Ok(())
}

/// One webhook drain; returns its time and what the receiver saw.
async fn webhook_run(
    b: &mut Bench,
    n: usize,
    ordering: HookOrder,
    quick: bool,
) -> Res<(Duration, Received)> {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    let received = Arc::new(Mutex::new(Received::default()));
    let state = Arc::clone(&received);
    let app = Router::new().route(
        "/notify",
        post(move |body: axum::body::Bytes| {
            let state = Arc::clone(&state);
            async move {
                let started = Instant::now();
                let body = String::from_utf8_lossy(&body).into_owned();
                let call = {
                    let mut r = state.lock().unwrap_or_else(|e| e.into_inner());
                    r.in_flight += 1;
                    r.max_in_flight = r.max_in_flight.max(r.in_flight);
                    let calls = r.calls.entry(body.clone()).or_default();
                    *calls += 1;
                    *calls
                };
                let (fail, slow) = fate(&body, call);
                if slow {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let mut r = state.lock().unwrap_or_else(|e| e.into_inner());
                r.in_flight -= 1;
                r.busy += started.elapsed();
                if fail {
                    r.failed += 1;
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    *r.delivered.entry(body).or_default() += 1;
                    StatusCode::NO_CONTENT
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/notify", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let schema = b.schema("hooks").await?;
    let pg = pool(&schema.url, 8).await?;
    let outbox = Outbox::<Postgres>::new();
    outbox.migrate(&pg).await?;
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let mut tx = pg.begin().await?;
        for &i in chunk {
            let merchant = format!("merchant-{}", i % MERCHANTS);
            let body = serde_json::json!({
                "merchant": merchant,
                "payment": format!("PAY-{i}"),
                "status": "paid",
            })
            .to_string();
            let message = OutboxMessage::webhook(&url, body);
            let message = match ordering {
                HookOrder::PerUrl => message.order_by(url.clone()),
                HookOrder::PerMerchant => message.order_by(merchant),
                HookOrder::None => message,
            };
            outbox.enqueue_in(&mut *tx, "bench-hooks", message).await?;
        }
        tx.commit().await?;
    }
    let mut relay = Relay::builder(pg.clone(), outbox.clone())
        .publisher(WebhookPublisher::new("bench-webhook-secret")?);
    if quick {
        relay = relay
            .backoff(Duration::from_millis(10), Duration::from_millis(100))
            .poll_interval(Duration::from_millis(20));
    }
    let started = Instant::now();
    let running = relay.build()?.spawn();
    let deadline = started + Duration::from_secs(600);
    let drained = loop {
        let stats = outbox.stats(&pg).await?;
        if stats.rows(Status::Sent) + stats.rows(Status::Dead) >= n as i64 {
            break Ok(started.elapsed());
        }
        if Instant::now() > deadline {
            break Err("the relay did not drain the webhooks in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    running.stop().await;
    server.abort();
    let stats = outbox.stats(&pg).await?;
    b.drop_schema(&schema).await;
    let drained = drained?;
    let received = std::mem::take(&mut *received.lock().unwrap_or_else(|e| e.into_inner()));
    let once = received.delivered.values().all(|&c| c == 1);
    b.check(
        received.delivered.len() == n && once && stats.rows(Status::Dead) == 0,
        || {
            format!(
                "webhooks ({}): {} of {n} notifications delivered, {} more than once, {} dead",
                ordering.label(),
                received.delivered.len(),
                received.delivered.values().filter(|&&c| c > 1).count(),
                stats.rows(Status::Dead)
            )
        },
    );
    Ok((drained, received))
}
