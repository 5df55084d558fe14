//! `onceonly purge`: delete old dedup records in bounded batches.

use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use onceonly::ops::{PurgeError, PurgeMode, PurgeOptions, PurgeProgress, purge_in_batches};

use crate::db::with_store;
use crate::time::{before_now, now_ms, parse_duration, rfc3339};
use crate::{CliResult, DbArgs, out};

/// Delete expired (or old) dedup records in bounded batches.
#[derive(Args, Debug)]
#[command(
    group = clap::ArgGroup::new("which").required(true).args(["expired", "older_than"]),
    after_help = "\
Each batch is one short DELETE of at most --batch rows: never an unbounded
DELETE, never a table lock. Consumers keep claiming while it runs. Every
batch commits on its own: interrupting a purge (Ctrl-C) is safe, and running
it again continues where it stopped.

Retention rule: a record is what makes a redelivery a duplicate. Purge a key
only after every source that could deliver it again has given up: the
broker's retention, the payment provider's retry window, and the window in
which you might replay dead letters. --expired deletes what the engine's
retention already let go; --older-than deletes by age, and refuses to delete
records that have not expired yet unless --force is given.

Examples:
  onceonly purge --database-url $URL --expired
  onceonly purge --database-url $URL --scope payments --older-than 30d --dry-run
  onceonly purge --database-url $URL --expired --batch 2000 --pause 100ms")]
pub struct PurgeArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
    /// Delete records whose expiry has passed.
    #[arg(long)]
    expired: bool,
    /// Delete records created longer ago than this (e.g. 7d, 12h), expired or not.
    #[arg(long, value_name = "AGE", value_parser = parse_duration)]
    older_than: Option<Duration>,
    /// Rows per DELETE statement.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch: u32,
    /// Sleep between batches (e.g. 50ms), to leave the database breathing room.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pause: Duration,
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// With --older-than: also delete records that have not expired yet.
    #[arg(long)]
    force: bool,
}

pub async fn run(args: PurgeArgs) -> CliResult {
    let db = args.db.open().await?;
    let mode = match args.older_than {
        Some(age) => PurgeMode::CreatedBefore(before_now(age)),
        None => PurgeMode::Expired,
    };
    let mut options = PurgeOptions::new()
        .batch(args.batch)
        .pause_between_batches(args.pause)
        .dry_run(args.dry_run)
        .force(args.force);
    if let Some(s) = &args.scope {
        options = options.scope(s);
    }
    let what = match mode {
        PurgeMode::CreatedBefore(cutoff) => format!("created before {}", rfc3339(cutoff)),
        _ => "that expired".to_owned(),
    };
    let bar = ProgressBar::hidden();
    let started = Instant::now();
    let progress = with_store!(&db, |store| {
        purge_in_batches(store, mode, &options, now_ms(), |p| show(&bar, p)).await
    });
    let progress = match progress {
        Err(PurgeError::WouldDeleteLive { live }) => {
            return Err(format!(
                "{live} of the records to purge have not expired yet: deleting them lets a \
                 redelivery of their keys run again. Check with --dry-run, then pass --force \
                 to delete them anyway"
            )
            .into());
        }
        other => other?,
    };
    bar.finish_and_clear();
    let scope = args
        .scope
        .as_deref()
        .map_or(String::new(), |s| format!(" in scope {s:?}"));
    if progress.dry_run {
        let live = if progress.live > 0 {
            format!(
                ", {} of them not expired yet (a real run needs --force)",
                progress.live
            )
        } else {
            String::new()
        };
        out!(
            "dry run: {} {} {what}{scope} would be deleted{live}; nothing was deleted",
            progress.candidates,
            records(progress.candidates)
        );
    } else {
        out!(
            "deleted {} {} {what}{scope} in {} batches of at most {} ({} examined) in {:.1}s",
            progress.deleted,
            records(progress.deleted),
            progress.batches,
            args.batch,
            progress.scanned,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn records(n: u64) -> &'static str {
    if n == 1 { "record" } else { "records" }
}

/// Starts the bar on the first report, then moves it.
fn show(bar: &ProgressBar, p: &PurgeProgress) {
    if p.batches == 0 {
        if p.dry_run || p.to_scan == 0 {
            return;
        }
        bar.set_length(p.to_scan);
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} examined, {msg} (eta {eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    }
    bar.set_position(p.scanned.min(p.to_scan));
    bar.set_message(format!("{} deleted", p.deleted));
}
