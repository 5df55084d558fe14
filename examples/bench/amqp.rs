//! AMQP → Postgres: a plain lapin consumer (same prefetch and concurrency,
//! ack after the insert commits) vs `onceonly::amqp::AmqpConsumer`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use onceonly::amqp::AmqpConsumer;
use onceonly::{FingerprintSpec, PgStore, RetryPolicy, SqlStore};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::child::{BenchLedger, ChildSpec, Consumer, Msg, business_write, inbox_write};
use super::common::{
    Bench, Child, Measured, Observer, Plan, RATIO_COLUMNS, Res, RunResult, business_tables,
    columns, drain_backlog, latencies, ledger_counts, payload, pool,
};
use super::inbox::Form;
use super::scale_out::{self, ScaleRun};
use super::stats::Table;

/// Unacked messages the broker sends ahead (both consumers).
pub const PREFETCH: u16 = 32;
/// Messages handled at once (both consumers).
pub const CONCURRENCY: usize = 8;

/// The consumers compared, in table order.
const CONSUMERS: [Consumer; 5] = [
    Consumer::Baseline,
    Consumer::Inbox(Form::ClaimFirst),
    Consumer::Inbox(Form::ClaimLast),
    Consumer::Onceonly,
    Consumer::OnceonlyOptimistic,
];

pub async fn run(b: &mut Bench) -> Res<()> {
    for dup in b.dups.clone() {
        let mut first = vec!["consumer", "msgs/s", "p50", "p99", "peak RSS"];
        first.extend(RATIO_COLUMNS);
        let mut table = Table::new(
            format!(
                "AMQP → Postgres ({} backlog msgs drained + {} paced at {}/s, {dup}% duplicates, prefetch {PREFETCH}, concurrency {CONCURRENCY})",
                b.sizes.backlog, b.sizes.paced, b.sizes.paced_rate
            ),
            &columns(&first, "msgs / rows / distinct keys"),
        );
        // Runs interleave the consumers, so drifting load on the shared
        // machine hits all alike.
        let mut results: Vec<Vec<RunResult>> = CONSUMERS.iter().map(|_| Vec::new()).collect();
        let inline = b.inline_counts();
        for r in 0..b.runs {
            for (v, consumer) in CONSUMERS.into_iter().enumerate() {
                results[v].push(one_run(b, consumer, dup, 2000 + r as u64, inline).await?);
            }
        }
        let mut counted: Vec<Option<RunResult>> = CONSUMERS.iter().map(|_| None).collect();
        if b.counted_pass() {
            for (v, consumer) in CONSUMERS.into_iter().enumerate() {
                counted[v] = Some(one_run(b, consumer, dup, 2999, true).await?);
            }
        }
        let measured: Vec<(Consumer, Measured)> = CONSUMERS
            .into_iter()
            .zip(results)
            .zip(counted)
            .map(|((c, runs), counted)| (c, Measured::combine(&runs, counted.as_ref())))
            .collect();
        super::common::consumer_rows(b, &mut table, &measured, "AMQP per message", dup, None);
        b.table(table);
    }
    scale_out(b).await
}

/// Scale-out: 1, 2 and 4 onceonly consumer processes competing for one
/// queue drain one backlog (no duplicates); see [`scale_out`](super::scale_out).
async fn scale_out(b: &mut Bench) -> Res<()> {
    let title = |backlog| {
        format!(
            "AMQP → Postgres scale-out ({backlog} backlog msgs, one queue, competing consumers, prefetch {PREFETCH}, concurrency {CONCURRENCY} each)"
        )
    };
    scale_out::measure(b, title, 3000, scale_run).await
}

/// One scale-out run; returns its measures and the ledger counts.
async fn scale_run(
    b: &mut Bench,
    procs: usize,
    backlog: usize,
    seed: u64,
) -> Res<(ScaleRun, String)> {
    let queue = b.unique("ascale");
    let schema = b.schema("ascale").await?;
    let client = b.db_client(&schema.url, false)?;
    let (conn, channel) = connect(&b.services.amqp_url).await?;
    let result = async {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        declare(&channel, &queue, false).await?;
        let db = pool(&schema.url, 4).await?;
        business_tables(&db).await?;
        PgStore::new(db.clone()).migrate().await?;
        let plan = Plan::new(backlog, 0, &queue, seed);
        publish(&channel, &queue, &plan.keys).await?;
        let observer = Observer::start(db.clone());
        let spec = ChildSpec::Amqp {
            consumer: Consumer::Onceonly,
            url: b.services.amqp_url.clone(),
            queue: queue.clone(),
            db_url: client.url.clone(),
            prefetch: PREFETCH,
            concurrency: CONCURRENCY,
        };
        let run = scale_out::drain(b, &vec![spec; procs], &client, &observer, &plan).await?;
        observer.stop().await?;
        let left = declare(&channel, &queue, true).await?;
        let (rows, distinct) = ledger_counts(&db).await?;
        Ok::<_, super::common::BoxError>((
            run,
            format!("{} / {rows} / {distinct}", plan.keys.len()),
            rows == plan.distinct as i64 && distinct == rows && left == 0,
        ))
    }
    .await;
    for q in [queue.clone(), format!("{queue}.dlq")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "bye".into()).await;
    b.drop_schema(&schema).await;
    let (run, counts, exact) = result?;
    b.check(exact, || {
        format!("amqp scale-out {procs} processes: ledger {counts}, or messages left in the queue")
    });
    Ok((run, counts))
}

pub async fn connect(url: &str) -> Res<(Connection, Channel)> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| {
            format!("RabbitMQ is not reachable at {url}: {e} (start it with scripts/services)")
        })?;
    let channel = conn.create_channel().await?;
    Ok((conn, channel))
}

pub async fn declare(channel: &Channel, queue: &str, passive: bool) -> Res<u32> {
    Ok(channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                passive,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?
        .message_count())
}

/// Publishes persistent messages, each confirmed, in windows of 1000.
pub async fn publish(channel: &Channel, queue: &str, keys: &[String]) -> Res<()> {
    for chunk in keys.chunks(1000) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for key in chunk {
            confirms.push(publish_one(channel, queue, key).await?);
        }
        for c in confirms {
            if !c.await?.is_ack() {
                return Err("publish not confirmed".into());
            }
        }
    }
    Ok(())
}

async fn publish_one(channel: &Channel, queue: &str, key: &str) -> Res<lapin::PublisherConfirm> {
    Ok(channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &payload(key),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await?)
}

async fn one_run(
    b: &mut Bench,
    consumer: Consumer,
    dup: u32,
    seed: u64,
    counted: bool,
) -> Res<RunResult> {
    let dedup = consumer.dedup();
    let queue = b.unique("amqp");
    let schema = b.schema("amqp").await?;
    let client = b.db_client(&schema.url, counted)?;
    let (conn, channel) = connect(&b.services.amqp_url).await?;
    let result = async {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        declare(&channel, &queue, false).await?;
        let db = pool(&schema.url, 4).await?;
        business_tables(&db).await?;
        PgStore::new(db.clone()).migrate().await?;
        let plan = Plan::new(b.sizes.backlog, dup, &queue, seed);
        publish(&channel, &queue, &plan.keys).await?;

        let observer = Observer::start(db.clone());
        let mut child = Child::spawn(&ChildSpec::Amqp {
            consumer,
            url: b.services.amqp_url.clone(),
            queue: queue.clone(),
            db_url: client.url.clone(),
            prefetch: PREFETCH,
            concurrency: CONCURRENCY,
        })
        .await?;
        let window = b.window(&child, &client).await?;
        let rate = drain_backlog(&observer, &plan, dedup, &mut child).await?;
        let cost = b.close_window(window, plan.keys.len()).await?;

        // Paced fresh keys: latency with the consumer keeping up.
        let (paced, mut tick) = b.sizes.paced(&queue);
        let mut confirms = Vec::new();
        for key in &paced {
            tick.tick().await;
            confirms.push(publish_one(&channel, &queue, key).await?);
        }
        for c in confirms {
            if !c.await?.is_ack() {
                return Err("publish not confirmed".into());
            }
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
        // Unacked messages go back to the queue when the consumer leaves.
        let left = declare(&channel, &queue, true).await?;
        let (rows, distinct) = ledger_counts(&db).await?;
        Ok::<_, super::common::BoxError>((
            RunResult {
                rate,
                latencies: lat,
                rss_mib,
                rows,
                distinct,
                messages: plan.keys.len() + paced.len(),
                cost,
            },
            left,
            (plan.distinct + paced.len()) as i64,
        ))
    }
    .await;
    for q in [queue.clone(), format!("{queue}.dlq")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "bye".into()).await;
    b.drop_schema(&schema).await;
    let (run, left, distinct_keys) = result?;
    let who = consumer.name();
    b.check(left == 0, || {
        format!("amqp {who}: {left} messages left in the queue")
    });
    b.check_ledger(&format!("amqp {who}"), dedup, &run, distinct_keys);
    Ok(run)
}

/// The consumer child: plain lapin (no dedup or the hand-written inbox)
/// or onceonly.
pub async fn consume(
    consumer: Consumer,
    url: &str,
    queue: &str,
    db_url: &str,
    prefetch: u16,
    concurrency: usize,
    stop: CancellationToken,
) -> Res<()> {
    if consumer.onceonly() {
        let store = super::variant::pg_store(db_url, false).await?;
        let amqp = AmqpConsumer::builder(
            onceonly::Engine::builder(store)
                .optimistic(consumer.optimistic())
                .key_expr("json:/out_trade_no")
                .fingerprint(FingerprintSpec::Fields(vec![
                    "/account".into(),
                    "/amount".into(),
                ]))
                .retry(RetryPolicy::default().max_attempts(1)),
        )
        .url(url)
        .queue(queue)
        .prefetch(prefetch)
        .concurrency(concurrency)
        .build()?;
        println!("ready");
        amqp.run_until(BenchLedger, stop).await?;
        return Ok(());
    }
    let db = pool(db_url, 10).await?;
    let (conn, channel) = connect(url).await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("ready");
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break,
            d = deliveries.next() => match d {
                Some(d) => d?,
                None => break,
            },
        };
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let db = db.clone();
        tasks.spawn(async move {
            let _permit = permit;
            let m: Msg = serde_json::from_slice(&delivery.data)?;
            let mut tx = db.begin().await?;
            let new_key = match consumer {
                Consumer::Inbox(form) => inbox_write(&mut tx, form, &m).await?,
                _ => {
                    business_write(&mut tx, &m).await?;
                    true
                }
            };
            let t = Instant::now();
            if new_key {
                tx.commit().await?;
            } else {
                // A duplicate: nothing of it is kept.
                tx.rollback().await?;
            }
            super::child::add_time(&super::child::COMMIT_NANOS, t);
            delivery.acker.ack(BasicAckOptions::default()).await?;
            Ok::<_, super::common::BoxError>(())
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    channel.close(200, "bye".into()).await?;
    conn.close(200, "bye".into()).await?;
    Ok(())
}
