//! `onceonly replay`: send dead letters back to where they came from, with
//! a progress bar and a summary.

use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use onceonly::ops::replay::{Action, Progress, ReplayOptions, ReplayReport, Screen, Verdict};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What is told about each dead letter as the run goes.
pub type OnProgress = Box<dyn Fn(&Progress) + Send + Sync>;

const AFTER_HELP: &str = "\
Replayed messages go back to their original exchange + routing key (AMQP) or
topic (Kafka). The onceonly consumer then treats a key committed meanwhile as
a duplicate (nothing doubled), processes a new key once, and dead-letters a
key reused with another payload again (fingerprint_mismatch).

With --database-url (or ONCEONLY_DATABASE_URL, DATABASE_URL) each selected
letter's key is looked up in the dedup table: the summary says, per failure
group and in total, how many are new work, duplicates (answered, no effect)
and conflicts. A letter older than the dedup retention of its scope (read
from the table, or --retention) is refused and stays: its record may be
gone, so a duplicate could run again. No retention is ever assumed: give
--retention or --database-url (a letter of a scope the table knows no
retention of is refused too). --beyond-retention replays it anyway. A letter replayed --max-replays times already goes to
<queue or topic>.parked instead of cycling.

Examples:
  onceonly replay amqp --url amqp://guest:guest@localhost:5672/%2f --queue orders.dlq --retention 7d --dry-run
  onceonly replay amqp --queue orders.dlq --database-url postgres://app@db/shop --dry-run
  onceonly replay amqp --queue orders.dlq --group 3f9c0a1b2c4d --database-url postgres://app@db/shop
  onceonly replay amqp --queue orders.dlq --reason handler_error --since 2h --rate 50/s --retention 7d
  onceonly replay kafka --brokers localhost:9092 --topic payments.dlt --key PAY-1001 --retention 7d
  onceonly replay kafka --topic payments.dlt --limit 100 --consumer-group ops-replay --retention 7d

Exit status: 0 when every selected dead letter was replayed or parked (or
would be, with --dry-run); 1 when any could not be or was refused (they stay
in the queue/topic) or the run failed.";

/// Replay dead letters back to where they came from.
#[derive(clap::Args, Debug)]
#[command(after_help = AFTER_HELP)]
pub struct ReplayArgs {
    #[command(subcommand)]
    source: Source,
}

/// A dead-letter queue or topic, with what to select from it.
#[derive(clap::Subcommand, Debug)]
pub enum Source {
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
  onceonly replay amqp --queue orders.dlq --dry-run --retention 7d
  onceonly replay amqp --queue orders.dlq --reason handler_error --reason decode_error --database-url $DB
  onceonly replay amqp --queue orders.dlq --since 2026-11-29T08:00:00Z --limit 10 --rate 5/s --retention 1d";

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
  onceonly replay kafka --topic payments.dlt --dry-run --retention 7d
  onceonly replay kafka --topic payments.dlt --reason handler_error --commit-skipped --database-url $DB
  onceonly replay kafka --topic payments.dlt -X security.protocol=ssl --retention 7d";

/// Filters and pacing shared by both sources.
#[derive(clap::Args, Debug)]
pub struct Selection {
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
    /// Only dead letters of this failure group (repeatable; ids from
    /// `onceonly dlq groups`).
    #[arg(long = "group", value_name = "ID")]
    group: Vec<String>,
    /// Replay letters older than the dedup retention of their scope too
    /// (their records may be gone: a duplicate could run again).
    #[arg(long)]
    beyond_retention: bool,
    /// The dedup retention of every scope (default: read from the dedup
    /// table with --database-url; one of the two is required).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    retention: Option<Duration>,
    /// Park a letter already replayed this many times in <source>.parked
    /// instead of replaying it again.
    #[arg(long, value_name = "N", default_value_t = onceonly::ops::replay::DEFAULT_MAX_REPLAYS)]
    max_replays: u32,
    /// The dedup table to look letters' keys up in (new work, duplicate or
    /// conflict) and read the retention from: postgres://…, mysql://… or
    /// sqlite:PATH (else ONCEONLY_DATABASE_URL, then DATABASE_URL; without
    /// any, verdicts are unknown).
    #[arg(long, env = "ONCEONLY_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The dedup table (`table` or `schema.table`).
    #[arg(long, env = "ONCEONLY_TABLE", default_value = onceonly::store::DEFAULT_TABLE)]
    table: String,
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
pub struct AmqpArgs {
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
pub struct KafkaArgs {
    /// Bootstrap servers.
    #[arg(long, env = "ONCEONLY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// The dead-letter topic, e.g. payments.dlt.
    #[arg(long)]
    topic: String,
    /// Consumer group whose offsets record how far the topic was replayed.
    #[arg(long, visible_alias = "group-id", default_value = onceonly::ops::replay::DEFAULT_GROUP)]
    consumer_group: String,
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
    let ui = Ui::new(args.source.selection().dry_run);
    let (label, report) = execute(args.source, Some(ui.callback())).await?;
    ui.finish(&label, report)
}

impl Source {
    fn selection(&self) -> &Selection {
        match self {
            #[cfg(feature = "amqp")]
            Self::Amqp(a) => &a.selection,
            #[cfg(feature = "kafka")]
            Self::Kafka(k) => &k.selection,
        }
    }

    /// Forces a dry run (`onceonly dlq groups` reads, never replays), which
    /// refuses nothing: groups count every letter.
    pub fn read_only(mut self) -> Self {
        let s = match &mut self {
            #[cfg(feature = "amqp")]
            Self::Amqp(a) => &mut a.selection,
            #[cfg(feature = "kafka")]
            Self::Kafka(k) => &mut k.selection,
        };
        s.dry_run = true;
        s.beyond_retention = true;
        self
    }
}

/// Runs the replay `source` describes; returns the source's label
/// (`queue orders.dlq`) and the report.
pub async fn execute(
    source: Source,
    progress: Option<OnProgress>,
) -> Result<(String, ReplayReport), BoxError> {
    let screen = screen(source.selection()).await?;
    let progress = progress.unwrap_or_else(|| Box::new(|_: &Progress| {}));
    match source {
        #[cfg(feature = "amqp")]
        Source::Amqp(a) => {
            let replay = onceonly::ops::replay::AmqpReplay::builder()
                .url(a.url)
                .tls(a.tls.load()?)
                .queue(&a.queue)
                .to_queue(a.to_queue)
                .options(options(&a.selection).screen(screen))
                .on_progress(progress)
                .build()?;
            Ok((format!("queue {}", a.queue), replay.run().await?))
        }
        #[cfg(feature = "kafka")]
        Source::Kafka(k) => {
            let mut builder = onceonly::ops::replay::KafkaReplay::builder()
                .brokers(k.brokers)
                .topic(&k.topic)
                .group(k.consumer_group)
                .commit_skipped(k.commit_skipped)
                .from_beginning(k.from_beginning)
                .options(options(&k.selection).screen(screen))
                .on_progress(progress);
            for (key, value) in k.config {
                builder = builder.config(key, value);
            }
            let report = builder.build()?.run().await?;
            Ok((format!("topic {}", k.topic), report))
        }
    }
}

/// The letters' screening: the dedup table if a database URL is known,
/// the retention, whether to go beyond it.
async fn screen(s: &Selection) -> Result<Screen, BoxError> {
    let mut screen = Screen::new().beyond_retention(s.beyond_retention);
    if let Some(r) = s.retention {
        screen = screen.retention(r);
    }
    match crate::db::database_url(s.database_url.as_deref()) {
        Ok(url) => {
            let db = crate::db::Db::open(&url, &s.table, false).await?;
            Ok(crate::db::with_store!(db, |store| screen.lookup(store)))
        }
        // Never assumed: without the table, the operator says it.
        Err(crate::db::OpenError::NoUrl) if s.retention.is_some() || s.beyond_retention => {
            Ok(screen)
        }
        Err(crate::db::OpenError::NoUrl) => Err(
            "give --retention (the consumers' dedup retention, e.g. 1d) or --database-url: a \
             letter older than the retention may be applied again, and no retention is assumed"
                .into(),
        ),
        Err(e) => Err(e.into()),
    }
}

fn options(s: &Selection) -> ReplayOptions {
    let mut o = ReplayOptions::new()
        .dry_run(s.dry_run)
        .publish_timeout(s.publish_timeout)
        .max_replays(s.max_replays);
    for r in &s.reason {
        o = o.reason(r);
    }
    for k in &s.key {
        o = o.key(k);
    }
    for g in &s.group {
        o = o.group(g);
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

    fn callback(&self) -> OnProgress {
        let bar = self.bar.clone();
        let dry_run = self.dry_run;
        Box::new(move |p: &Progress| {
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
                Action::WouldReplay => {
                    bar.suspend(|| match l.verdict.filter(|v| *v != Verdict::Unknown) {
                        Some(v) => println!("would replay {}: {}", describe(), v.as_str()),
                        None => println!("would replay {}", describe()),
                    })
                }
                Action::Refused => bar.suspend(|| {
                    println!(
                        "refused {}: older than the dedup retention of its scope (or its retention is unknown)",
                        describe()
                    );
                }),
                Action::Parked => bar.suspend(|| {
                    let would = if dry_run { "would park" } else { "parked" };
                    println!("{would} {} after {} replays", describe(), l.replays);
                }),
                Action::Failed => bar.suspend(|| {
                    eprintln!(
                        "failed {}: {}",
                        describe(),
                        p.error.as_deref().unwrap_or("unknown error")
                    );
                }),
                _ => {}
            }
        })
    }

    fn finish(self, source: &str, r: ReplayReport) -> Result<(), BoxError> {
        self.bar.finish_and_clear();
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
        if r.refused > 0 {
            line.push_str(&format!(", refused {}", r.refused));
        }
        if r.parked > 0 {
            let parked = if r.dry_run { "would park" } else { "parked" };
            line.push_str(&format!(", {parked} {}", r.parked));
        }
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
        let v = r.verdicts;
        if r.replayed > 0 {
            println!(
                "{}: {} new, {} duplicates (answered, no effect), {} conflicts, {} unknown{}",
                if r.dry_run { "would be" } else { "were" },
                v.new,
                v.duplicates,
                v.conflicts,
                v.unknown,
                if v.unknown == r.replayed && v.unknown > 0 {
                    " (pass --database-url to look the keys up)"
                } else {
                    ""
                }
            );
        }
        if !r.groups.is_empty() {
            crate::dlq::print_groups(&r.groups, true);
        }
        if r.refused > 0 {
            println!(
                "refused {} dead letter(s) older than the dedup retention of their scope (or whose \
                 scope's retention is unknown: give --retention): their records may be gone, so a \
                 duplicate could run again (--beyond-retention replays them)",
                r.refused
            );
        }
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
        if r.refused > 0 {
            return Err(format!(
                "{} dead letter(s) refused (older than the dedup retention) stay in the {source}",
                r.refused
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
