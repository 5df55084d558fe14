//! `onceonly dlq groups`: a dead-letter queue or topic read without
//! consuming it, its letters grouped by reason and error pattern.

use std::process::ExitCode;

use onceonly::ops::replay::FailureGroup;

use crate::out;
use crate::replay::Source;
use crate::time::rfc3339_seconds;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Look into dead-letter queues and topics without consuming them.
#[derive(clap::Args, Debug)]
pub struct DlqArgs {
    #[command(subcommand)]
    command: DlqCommand,
}

#[derive(clap::Subcommand, Debug)]
enum DlqCommand {
    /// Group dead letters by reason and error (numbers, ids and keys masked).
    #[command(after_help = GROUPS_HELP)]
    Groups(GroupsArgs),
}

const GROUPS_HELP: &str = "\
Reads the queue (basic.get, everything requeued: nothing is acked) or the
topic (from the replay group's offsets, nothing committed) like
`onceonly replay --dry-run`, and prints one line per failure group: its id,
reason, count, first and last seen, the error pattern and an example letter.
Replay one group with `onceonly replay ... --group ID`. With --database-url
the groups also say how many letters would be new work, duplicates or
conflicts. The replay filters (--reason, --since, --key, --limit) apply.

Examples:
  onceonly dlq groups amqp --queue orders.dlq
  onceonly dlq groups kafka --topic payments.dlt --from-beginning --json
  onceonly dlq groups amqp --queue orders.dlq --database-url postgres://app@db/shop";

#[derive(clap::Args, Debug)]
struct GroupsArgs {
    /// Print the groups as JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    source: Source,
}

/// Runs `onceonly dlq`.
pub async fn run(args: DlqArgs) -> Result<ExitCode, BoxError> {
    match args.command {
        DlqCommand::Groups(g) => {
            let (label, report) = crate::replay::execute(g.source.read_only(), None).await?;
            if g.json {
                let text = serde_json::to_string_pretty(&serde_json::json!({
                    "source": label,
                    "scanned": report.scanned,
                    "groups": report.groups,
                }))?;
                out!("{text}");
            } else {
                out!(
                    "{label}: {} dead letters in {} groups",
                    report.scanned,
                    report.groups.len()
                );
                print_groups(&report.groups, report.verdicts.unknown < report.replayed);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Prints `groups` as a table; `verdicts`: with the new / duplicate /
/// conflict split.
pub fn print_groups(groups: &[FailureGroup], verdicts: bool) {
    let seen = |t: Option<i64>| t.map_or_else(|| "-".to_owned(), rfc3339_seconds);
    out!(
        "{:<12}  {:<20}  {:>7}  {:<20}  {:<20}{}  ERROR PATTERN",
        "GROUP",
        "REASON",
        "LETTERS",
        "FIRST SEEN",
        "LAST SEEN",
        if verdicts {
            "      NEW  DUPLICATE  CONFLICT  UNKNOWN  REFUSED  PARKED"
        } else {
            ""
        }
    );
    for g in groups {
        let split = if verdicts {
            format!(
                "  {:>7}  {:>9}  {:>8}  {:>7}  {:>7}  {:>6}",
                g.new, g.duplicates, g.conflicts, g.unknown, g.refused, g.parked
            )
        } else {
            String::new()
        };
        out!(
            "{:<12}  {:<20}  {:>7}  {:<20}  {:<20}{split}  {}",
            g.id,
            g.reason.as_deref().unwrap_or("-"),
            g.count,
            seen(g.first_seen_ms),
            seen(g.last_seen_ms),
            g.pattern
        );
        out!(
            "{:<12}  example: {} key {} error {}",
            "",
            g.example_position,
            g.example_key.as_deref().unwrap_or("-"),
            g.example_error.as_deref().unwrap_or("-")
        );
    }
}
