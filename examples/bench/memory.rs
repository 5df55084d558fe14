//! Memory: the onceonly AMQP consumer drains a backlog published before it
//! starts (1M persistent messages with `--full`); its peak RSS (VmHWM of
//! the child process) must stay bounded by the prefetch, not the backlog.
//!
//! AMQP rather than Kafka: tansu (the local Kafka broker) slows down on
//! large topics when a consumer pauses and resumes a partition (onceonly's
//! in-flight bound), to about 100 records/s at 1M records, which would make
//! a 1M drain take hours.

use std::time::{Duration, Instant};

use lapin::options::{ConfirmSelectOptions, QueueDeleteOptions};
use onceonly::{PgStore, SqlStore};

use super::amqp::{CONCURRENCY, PREFETCH, connect, declare, publish};
use super::child::{ChildSpec, Consumer};
use super::common::{Bench, Child, Observer, Plan, Res, business_tables, ledger_counts, pool};
use super::stats::Table;

pub async fn run(b: &mut Bench) -> Res<()> {
    let n = b.sizes.memory;
    let queue = b.unique("memory");
    let schema = b.schema("memory").await?;
    let (conn, channel) = connect(&b.services.amqp_url).await?;
    let result = async {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        declare(&channel, &queue, false).await?;
        let db = pool(&schema.url, 4).await?;
        business_tables(&db).await?;
        PgStore::new(db.clone()).migrate().await?;
        let plan = Plan::new(n, 0, &queue, 99);
        let t = Instant::now();
        publish(&channel, &queue, &plan.keys).await?;
        eprintln!(
            "memory: published {n} messages in {:.1}s",
            t.elapsed().as_secs_f64()
        );
        drop(plan);

        let observer = Observer::start(db.clone());
        let started = Instant::now();
        let mut child = Child::spawn(&ChildSpec::Amqp {
            consumer: Consumer::Onceonly,
            url: b.services.amqp_url.clone(),
            queue: queue.clone(),
            db_url: schema.url.clone(),
            prefetch: PREFETCH,
            concurrency: CONCURRENCY,
        })
        .await?;
        // Sample VmHWM as it drains: it is the peak anyway, the samples show
        // whether it grows with the backlog drained.
        let mut samples = Vec::new();
        let mut last = (0, Instant::now());
        loop {
            let count = observer.count();
            if count >= n as u64 {
                break;
            }
            if let Some(status) = child.exited()? {
                return Err(format!("the consumer exited ({status}) after {count} of {n}").into());
            }
            if count != last.0 {
                last = (count, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(120) {
                return Err(format!("no progress for 120 s: {count} of {n} commits seen").into());
            }
            samples.push((count, child.peak_rss_mib()));
            // The observer keeps every latency pair: drop them as we go.
            drop(observer.take());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let took = started.elapsed();
        let peak = child.peak_rss_mib();
        child.stop().await?;
        observer.stop().await?;
        let left = declare(&channel, &queue, true).await?;
        let (rows, distinct) = ledger_counts(&db).await?;
        Ok::<_, super::common::BoxError>((peak, took, rows, distinct, left, samples))
    }
    .await;
    for q in [queue.clone(), format!("{queue}.dlq")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "bye".into()).await;
    b.drop_schema(&schema).await;
    let (peak, took, rows, distinct, left, samples) = result?;
    b.check(rows == n as i64 && distinct == n as i64 && left == 0, || {
        format!("memory: {rows} rows / {distinct} distinct keys for {n} messages, {left} left in the queue")
    });
    let mut table = Table::new(
        format!(
            "Memory: onceonly AMQP consumer (prefetch {PREFETCH}, concurrency {CONCURRENCY}) draining a backlog of {n} persistent messages"
        ),
        &[
            "messages",
            "drain time (incl. start-up)",
            "msgs/s",
            "peak RSS (VmHWM)",
            "VmHWM after 25% / 50% / 75% of the backlog",
        ],
    );
    let at = |q: f64| {
        samples
            .iter()
            .find(|(c, _)| *c as f64 >= q * n as f64)
            .map_or("–".to_owned(), |(_, r)| format!("{r:.1}"))
    };
    table.row(vec![
        n.to_string(),
        format!("{:.1} s", took.as_secs_f64()),
        format!("{:.0}", n as f64 / took.as_secs_f64()),
        format!("{peak:.1} MiB"),
        format!("{} / {} / {} MiB", at(0.25), at(0.5), at(0.75)),
    ]);
    b.table(table);
    b.target(
        &format!("consumer peak RSS draining {n} messages"),
        format!("{peak:.1} MiB"),
        "≤ 100 MB (1M messages: --full)",
        peak * 1.048_576 <= 100.0,
    );
    Ok(())
}
