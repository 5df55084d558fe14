//! Memory: the onceonly Kafka consumer (batches of 100) drains a backlog
//! produced before it starts (1M messages with `--full`); its peak RSS
//! (VmHWM of the child process) must stay bounded: fetching pauses a
//! partition with 1000 records in flight.

use std::time::{Duration, Instant};

use onceonly::{PgStore, SqlStore};

use super::child::{ChildSpec, KafkaSpec};
use super::common::{Bench, Child, Observer, Plan, Res, business_tables, ledger_counts, pool};
use super::kafka::{create_topics, delete_topics, produce, producer};
use super::stats::Table;

/// Records per transaction while draining.
const BATCH: usize = 100;

pub async fn run(b: &mut Bench) -> Res<()> {
    let n = b.sizes.memory;
    let topic = b.unique("memory");
    let schema = b.schema("memory").await?;
    let result = async {
        create_topics(&b.services.brokers, &[&topic, &format!("{topic}.dlt")]).await?;
        let db = pool(&schema.url, 4).await?;
        business_tables(&db).await?;
        PgStore::new(db.clone()).migrate().await?;
        let plan = Plan::new(n, 0, &topic, 99);
        let t = Instant::now();
        let producer = producer(&b.services.brokers)?;
        produce(&producer, &topic, &plan.keys).await?;
        eprintln!(
            "memory: produced {n} messages in {:.1}s",
            t.elapsed().as_secs_f64()
        );
        drop(producer);

        let observer = Observer::start(db.clone());
        let started = Instant::now();
        let mut child = Child::spawn(&ChildSpec::Kafka(KafkaSpec {
            dedup: true,
            brokers: b.services.brokers.clone(),
            topic: topic.clone(),
            group: format!("{topic}-group"),
            db_url: schema.url.clone(),
            batch: BATCH,
            max_in_flight: None,
        }))
        .await?;
        // Sample RSS as it drains (VmHWM is the peak anyway; the samples
        // show whether it grows with the backlog).
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
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let took = started.elapsed();
        let peak = child.peak_rss_mib();
        child.stop().await?;
        observer.stop().await?;
        let (rows, distinct) = ledger_counts(&db).await?;
        Ok::<_, super::common::BoxError>((peak, took, rows, distinct, samples))
    }
    .await;
    b.drop_schema(&schema).await;
    delete_topics(&b.services.brokers, &[&topic, &format!("{topic}.dlt")]).await;
    let (peak, took, rows, distinct, samples) = result?;
    b.check(rows == n as i64 && distinct == n as i64, || {
        format!("memory: {rows} rows / {distinct} distinct keys for {n} messages")
    });
    let mut table = Table::new(
        format!(
            "Memory: onceonly Kafka consumer (batch {BATCH}) draining a backlog of {n} messages"
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
