//! `onceonly stats`: what the dedup table holds.

use clap::Args;
use onceonly::ops::admin::{AGE_BUCKET_LABELS, AdminStore, ScopeStats};

use crate::db::with_store;
use crate::time::{age, now_ms, rfc3339_seconds};
use crate::{CliResult, DbArgs, out};

/// Records per scope, an age histogram, oldest and newest, expired but not yet purged.
#[derive(Args, Debug)]
#[command(after_help = "\
Scans the table (or the scope): run it against a replica on very large tables.

Examples:
  onceonly stats --database-url postgres://app@db/payments
  onceonly stats --database-url $URL --scope payments --json")]
pub struct StatsArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Only this scope.
    #[arg(long)]
    scope: Option<String>,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: StatsArgs) -> CliResult {
    let db = args.db.open().await?;
    let now = now_ms();
    let (stats, table) = with_store!(&db, |store| (
        store.stats(args.scope.as_deref(), now).await?,
        onceonly::SqlStore::table(store).to_string()
    ));
    if args.json {
        let out = serde_json::json!({
            "table": table,
            "age_buckets": AGE_BUCKET_LABELS,
            "scopes": stats,
        });
        out!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if stats.is_empty() {
        out!("table {table}: no records");
        return Ok(());
    }
    print_table(&table, &stats);
    Ok(())
}

fn print_table(table: &str, stats: &[ScopeStats]) {
    let total: u64 = stats.iter().map(|s| s.records).sum();
    let expired: u64 = stats.iter().map(|s| s.expired).sum();
    let scopes = if stats.len() == 1 { "scope" } else { "scopes" };
    out!(
        "table {table}: {total} records in {} {scopes}, {expired} expired (purgeable)\n",
        stats.len()
    );
    let width = stats
        .iter()
        .map(|s| s.scope.len())
        .max()
        .unwrap_or(5)
        .max(5);
    out!(
        "{:<width$}  {:>10}  {:>10}  {:>10}  {:<34}  {:<34}",
        "scope",
        "records",
        "expired",
        "no result",
        "oldest",
        "newest"
    );
    for s in stats {
        let when = |ms: Option<i64>| {
            ms.map_or_else(
                || "-".to_owned(),
                |ms| format!("{} ({} ago)", rfc3339_seconds(ms), age(ms)),
            )
        };
        out!(
            "{:<width$}  {:>10}  {:>10}  {:>10}  {:<34}  {:<34}",
            s.scope,
            s.records,
            s.expired,
            s.without_result,
            when(s.oldest_ms),
            when(s.newest_ms)
        );
    }
    out!("\nage histogram (records by time since claimed)");
    let mut header = format!("{:<width$}", "scope");
    for label in AGE_BUCKET_LABELS {
        header.push_str(&format!("  {label:>10}"));
    }
    out!("{header}");
    for s in stats {
        let mut line = format!("{:<width$}", s.scope);
        for n in s.age_buckets {
            line.push_str(&format!("  {n:>10}"));
        }
        out!("{line}");
    }
}
