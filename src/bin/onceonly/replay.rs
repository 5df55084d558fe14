//! `onceonly replay`: send dead letters back to where they came from, with
//! a progress bar and a summary.

use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use onceonly::ops::replay::{Action, Progress, ReplayOptions, ReplayReport};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const AFTER_HELP: &str = "\
Replayed messages go back to their original exchange + routing key (AMQP) or
topic (Kafka). The onceonly consumer then treats a key committed meanwhile as
a duplicate (nothing doubled), processes a new key once, and dead-letters a
key reused with another payload again (fingerprint_mismatch).

Examples:
  onceonly replay amqp --url amqp://guest:guest@localhost:5672/%2f --queue orders.dlq --dry-run
  onceonly replay amqp --queue orders.dlq --reason handler_error --since 2h --rate 50/s
  onceonly replay kafka --brokers localhost:9092 --topic payments.dlt --key PAY-1001
  onceonly replay kafka --topic payments.dlt --limit 100 --group ops-replay

Exit status: 0 when every selected dead letter was replayed (or would be, with
--dry-run); 1 when any could not be (they stay in the queue/topic) or the run
failed.";

/// Replay dead letters back to where they came from.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct ReplayArgs {
    #[command(subcommand)]
    source: Source,
}

#[derive(clap::Subcommand, Debug)]
enum Source {
    /// Replay a RabbitMQ dead-letter queue.
    #[cfg(feature = "amqp")]
    #[command(after_help = AMQP_HELP)]
    Amqp(AmqpArgs),
    /// Replay a Kafka dead-letter topic.
    #[cfg(feature = "kafka")]
    #[command(after_help = KAFKA_HELP)]
    Kafka(KafkaArgs),
}

#[cfg(feature = "amqp")]
const AMQP_HELP: &str = "\
Reads the queue with basic.get up to the depth it had at the start. A message
is acked only after its copy was confirmed by the broker (publisher confirms,
mandatory); everything else (filtered out, --dry-run, failed, past --limit)
is requeued. The destination is x-onceonly-original-exchange/-routing-key, or
the first x-death entry for queues fed by RabbitMQ's own dead-lettering.

Examples:
  onceonly replay amqp --queue orders.dlq --dry-run
  onceonly replay amqp --queue orders.dlq --reason handler_error --reason decode_error
  onceonly replay amqp --queue orders.dlq --since 2026-11-29T08:00:00Z --limit 10 --rate 5/s";

#[cfg(feature = "kafka")]
const KAFKA_HELP: &str = "\
Reads each partition from the replay group's committed offset up to the high
watermark at the start, republishes to x-onceonly-original-topic (same
partition and key, acks=all, idempotent producer) and commits the offsets of
the contiguous prefix of replayed records. A failed record stops its
partition there. Records skipped by a filter are not committed past unless
--commit-skipped (then only --from-beginning reads them again); replayed
records after a skipped one are offered again by the next run, where the
consumer sees duplicates.

Examples:
  onceonly replay kafka --topic payments.dlt --dry-run
  onceonly replay kafka --topic payments.dlt --reason handler_error --commit-skipped
  onceonly replay kafka --topic payments.dlt -X security.protocol=ssl";

/// Filters and pacing shared by both sources.
#[derive(clap::Args, Debug)]
struct Selection {
    /// Only dead letters with this x-onceonly-reason (repeatable): handler_error,
    /// fingerprint_mismatch, bad_key, decode_error, store_error, crashed.
    #[arg(long, value_name = "REASON")]
    reason: Vec<String>,
    /// Only dead letters first seen since: a UTC time
    /// (2026-11-29T08:00:00Z; no offsets other than Z, a time without a
    /// zone is read as UTC) or a duration ago (90m, 2h, 1day). Undated
    /// ones do not match.
    #[arg(long, value_name = "TIME|DURATION", value_parser = parse_since)]
    since: Option<SystemTime>,
    /// Only dead letters with this idempotency key (repeatable).
    #[arg(long, value_name = "KEY")]
    key: Vec<String>,
    /// Act on at most N matching dead letters.
    #[arg(long, value_name = "N")]
    limit: Option<u64>,
    /// At most this many republishes per second: 50, 50/s, 600/min.
    #[arg(long, value_name = "N/s", value_parser = parse_rate)]
    rate: Option<f64>,
    /// Show what would be replayed; republish, ack and commit nothing.
    #[arg(long)]
    dry_run: bool,
    /// How long a republish may wait for the broker's confirmation.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    publish_timeout: Duration,
}

#[cfg(feature = "amqp")]
#[derive(clap::Args, Debug)]
struct AmqpArgs {
    /// Broker URL.
    #[arg(
        long,
        env = "ONCEONLY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    url: String,
    #[command(flatten)]
    tls: crate::AmqpTlsArgs,
    /// The dead-letter queue, e.g. orders.dlq.
    #[arg(long)]
    queue: String,
    /// Send copies straight to the queue that dead-lettered them (default
    /// exchange) instead of the original exchange, which may fan out to
    /// other queues.
    #[arg(long)]
    to_queue: bool,
    #[command(flatten)]
    selection: Selection,
}

#[cfg(feature = "kafka")]
#[derive(clap::Args, Debug)]
struct KafkaArgs {
    /// Bootstrap servers.
    #[arg(long, env = "ONCEONLY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// The dead-letter topic, e.g. payments.dlt.
    #[arg(long)]
    topic: String,
    /// Consumer group whose offsets record how far the topic was replayed.
    #[arg(long, default_value = onceonly::ops::replay::DEFAULT_GROUP)]
    group: String,
    /// Commit past records the filters skipped.
    #[arg(long)]
    commit_skipped: bool,
    /// Read from the start of the topic instead of the group's offsets.
    #[arg(long)]
    from_beginning: bool,
    /// librdkafka setting for consumer and producer, KEY=VALUE (repeatable).
    #[arg(short = 'X', value_name = "KEY=VALUE", value_parser = crate::parse_pair)]
    config: Vec<(String, String)>,
    #[command(flatten)]
    selection: Selection,
}

/// Runs `onceonly replay`.
pub async fn run(args: ReplayArgs) -> Result<(), BoxError> {
    match args.source {
        #[cfg(feature = "amqp")]
        Source::Amqp(a) => {
            let ui = Ui::new(a.selection.dry_run);
            let replay = onceonly::ops::replay::AmqpReplay::builder()
                .url(a.url)
                .tls(a.tls.load()?)
                .queue(&a.queue)
                .to_queue(a.to_queue)
                .options(options(&a.selection))
                .on_progress(ui.callback())
                .build()?;
            let report = replay.run().await;
            ui.finish(&format!("queue {}", a.queue), report)
        }
        #[cfg(feature = "kafka")]
        Source::Kafka(k) => {
            let ui = Ui::new(k.selection.dry_run);
            let mut builder = onceonly::ops::replay::KafkaReplay::builder()
                .brokers(k.brokers)
                .topic(&k.topic)
                .group(k.group)
                .commit_skipped(k.commit_skipped)
                .from_beginning(k.from_beginning)
                .options(options(&k.selection))
                .on_progress(ui.callback());
            for (key, value) in k.config {
                builder = builder.config(key, value);
            }
            let report = builder.build()?.run().await;
            ui.finish(&format!("topic {}", k.topic), report)
        }
    }
}

fn options(s: &Selection) -> ReplayOptions {
    let mut o = ReplayOptions::new()
        .dry_run(s.dry_run)
        .publish_timeout(s.publish_timeout);
    for r in &s.reason {
        o = o.reason(r);
    }
    for k in &s.key {
        o = o.key(k);
    }
    if let Some(t) = s.since {
        o = o.since(t);
    }
    if let Some(n) = s.limit {
        o = o.limit(n);
    }
    if let Some(r) = s.rate {
        o = o.rate(r);
    }
    o
}

/// The progress bar (hidden when stderr is not a terminal) and the lines
/// printed per dead letter.
struct Ui {
    bar: ProgressBar,
    dry_run: bool,
}

impl Ui {
    fn new(dry_run: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            None,
            if std::io::stderr().is_terminal() {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
        ) {
            bar.set_style(style);
        }
        Self { bar, dry_run }
    }

    fn callback(&self) -> impl Fn(&Progress) + Send + Sync + 'static {
        let bar = self.bar.clone();
        let dry_run = self.dry_run;
        move |p: &Progress| {
            bar.set_length(p.report.total.max(p.report.scanned));
            bar.set_position(p.report.scanned);
            bar.set_message(format!(
                "{} {}, {} skipped, {} failed",
                p.report.replayed,
                if dry_run { "to replay" } else { "replayed" },
                p.report.skipped,
                p.report.failed
            ));
            let l = &p.letter;
            let describe = || {
                format!(
                    "{} -> {} (reason {}, key {})",
                    l.position,
                    l.target.as_deref().unwrap_or("?"),
                    l.reason.as_deref().unwrap_or("-"),
                    l.key.as_deref().unwrap_or("-"),
                )
            };
            match p.action {
                Action::WouldReplay => bar.suspend(|| println!("would replay {}", describe())),
                Action::Failed => bar.suspend(|| {
                    eprintln!(
                        "failed {}: {}",
                        describe(),
                        p.error.as_deref().unwrap_or("unknown error")
                    );
                }),
                _ => {}
            }
        }
    }

    fn finish(
        self,
        source: &str,
        report: Result<ReplayReport, onceonly::ops::replay::ReplayError>,
    ) -> Result<(), BoxError> {
        self.bar.finish_and_clear();
        let r = report?;
        let mut line = format!(
            "{source}: scanned {}, {} {}, skipped {}, failed {}",
            r.scanned,
            if r.dry_run {
                "would replay"
            } else {
                "replayed"
            },
            r.replayed,
            r.skipped,
            r.failed
        );
        if r.uncommitted > 0 {
            line.push_str(&format!(
                ", {} replayed but not committed (behind a skipped or failed record)",
                r.uncommitted
            ));
        }
        if r.dry_run {
            line.push_str(" (dry run: nothing changed)");
        }
        println!("{line}");
        if r.failed > 0 {
            let first = r
                .failures
                .first()
                .map(|f| format!("; first: {}: {}", f.letter.position, f.error))
                .unwrap_or_default();
            return Err(format!(
                "{} dead letter(s) could not be replayed and stay in the {source}{first}",
                r.failed
            )
            .into());
        }
        Ok(())
    }
}

fn parse_since(s: &str) -> Result<SystemTime, String> {
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        return Ok(t);
    }
    let ago = humantime::parse_duration(s).map_err(|_| {
        format!(
            "{s:?} is neither a UTC time (2026-11-29T08:00:00Z; offsets other than Z are not \
             supported) nor a duration (2h)"
        )
    })?;
    SystemTime::now()
        .checked_sub(ago)
        .ok_or_else(|| format!("{s:?} reaches before the epoch"))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let (n, per) = match s.split_once('/') {
        Some((n, unit)) => {
            let per = match unit.trim() {
                "s" | "sec" | "second" => 1.0,
                "m" | "min" | "minute" => 60.0,
                "h" | "hour" => 3600.0,
                other => return Err(format!("unknown rate unit {other:?}: use /s, /min or /h")),
            };
            (n, per)
        }
        None => (s, 1.0),
    };
    let n: f64 = n
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a rate like 50/s"))?;
    let rate = n / per;
    if rate.is_finite() && rate > 0.0 {
        Ok(rate)
    } else {
        Err(format!("rate must be positive, got {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_since() {
        assert_eq!(parse_rate("50/s"), Ok(50.0));
        assert_eq!(parse_rate("600/min"), Ok(10.0));
        assert_eq!(parse_rate("2"), Ok(2.0));
        assert!(parse_rate("0/s").is_err());
        assert!(parse_rate("5/fortnight").is_err());
        assert!(parse_since("2h").is_ok());
        assert!(parse_since("2026-11-29T08:00:00Z").is_ok());
        assert!(parse_since("yesterday-ish").is_err());
    }
}
