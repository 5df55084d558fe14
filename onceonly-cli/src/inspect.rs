//! `onceonly inspect`: show dedup records, a key's steps and an entity's fence.

use std::process::ExitCode;

use clap::Args;
use onceonly::ops::admin::{AdminStore, RecordFilter};
use onceonly::store::raw::{FenceRecord, Record, StepRecord};
use onceonly::{Order, SqlStore, Stale};
use serde_json::json;

use crate::db::with_store;
use crate::time::{now_ms, rfc3339};
use crate::{CliResult, DbArgs, out};

/// Show the dedup record of a key (with its steps), the newest records of a
/// scope or source, or an entity's fence.
#[derive(Args, Debug)]
#[command(after_help = "\
Exit status: 0 if at least one record was found, 3 if none, 1 on errors.

Examples:
  # Was this payment processed, when, and what did the handler return?
  # (Its steps too: calls to other systems its handler made.)
  onceonly inspect --database-url postgres://app@db/payments --scope payments --key ord-1042
  # The highest order applied to an entity (its fence)
  onceonly inspect --database-url $URL --scope payments --entity pi_3MtwBw
  # The last 20 records that came from partition 3 of topic payments
  onceonly inspect --database-url $URL --scope payments --source payments/3@ --limit 20
  # Machine-readable (one JSON object per line)
  onceonly inspect --database-url $URL --scope orders --key ord-7 --json")]
pub struct InspectArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The scope (consumer group, queue or handler name).
    #[arg(long)]
    scope: Option<String>,
    /// The idempotency key (exact); its steps are shown with it.
    #[arg(long)]
    key: Option<String>,
    /// An entity (exact): show its fence instead of records.
    #[arg(long, conflicts_with_all = ["key", "source"])]
    entity: Option<String>,
    /// Only records whose source starts with this prefix, e.g. `payments/3@`
    /// (Kafka: topic/partition@offset) or `orders@` (AMQP: queue@delivery).
    #[arg(long, value_name = "PREFIX")]
    source: Option<String>,
    /// At most this many records, newest first.
    #[arg(long, default_value_t = 20)]
    limit: u32,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: InspectArgs) -> CliResult<ExitCode> {
    if args.scope.is_none() && args.key.is_some() {
        return Err("--key needs --scope: a key is unique only within its scope".into());
    }
    if let Some(entity) = &args.entity {
        let Some(scope) = &args.scope else {
            return Err("--entity needs --scope: a fence is per scope".into());
        };
        let db = args.db.open().await?;
        let fence = with_store!(&db, |store| store.fence(scope, entity).await?);
        let Some(fence) = fence else {
            eprintln!("no fence for this entity");
            return Ok(ExitCode::from(3));
        };
        print_fence(scope, entity, &fence, args.json);
        return Ok(ExitCode::SUCCESS);
    }
    let mut filter = RecordFilter::new(args.limit.max(1));
    if let Some(s) = &args.scope {
        filter = filter.scope(s);
    }
    if let Some(k) = &args.key {
        filter = filter.key(k);
    }
    if let Some(p) = &args.source {
        filter = filter.source_prefix(p);
    }
    let db = args.db.open().await?;
    let records = with_store!(&db, |store| store.find(&filter).await?);
    // A key's steps: the calls to other systems its handler made.
    let steps = match (&args.scope, &args.key) {
        (Some(scope), Some(key)) => with_store!(&db, |store| store.steps(scope, key).await?),
        _ => Vec::new(),
    };

    let now = now_ms();
    for (i, r) in records.iter().enumerate() {
        if args.json {
            let mut value = to_json(r, now);
            value["steps"] = steps.iter().map(step_json).collect();
            out!("{value}");
        } else {
            if i > 0 {
                out!();
            }
            print_text(r, now);
            print_steps(&steps);
        }
    }
    if records.is_empty() && !steps.is_empty() {
        // Steps without a record: the handler called and never committed.
        if args.json {
            out!(
                "{}",
                json!({ "steps": steps.iter().map(step_json).collect::<Vec<_>>(), "committed": false })
            );
        } else {
            out!("no record: the key's transaction never committed");
            print_steps(&steps);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if records.is_empty() {
        eprintln!("no record matches");
        return Ok(ExitCode::from(3));
    }
    Ok(ExitCode::SUCCESS)
}

/// The stored result, as JSON if it is JSON, else text if UTF-8, else hex.
pub(crate) fn result_value(result: Option<&[u8]>) -> (serde_json::Value, &'static str) {
    match result {
        None => (serde_json::Value::Null, "none"),
        Some(bytes) => {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
                (v, "json")
            } else if let Ok(s) = std::str::from_utf8(bytes) {
                (s.into(), "utf8")
            } else {
                (hex::encode(bytes).into(), "hex")
            }
        }
    }
}

fn step_json(s: &StepRecord) -> serde_json::Value {
    let (result, encoding) = result_value(Some(&s.result));
    json!({
        "step": s.step,
        "finished_at": rfc3339(s.created_at_ms),
        "expires_at": rfc3339(s.expires_at_ms),
        "result_encoding": encoding,
        "result": result,
    })
}

fn print_steps(steps: &[StepRecord]) {
    for s in steps {
        let (result, _) = result_value(Some(&s.result));
        out!(
            "step:        {} finished {}: {}",
            printable(&s.step),
            rfc3339(s.created_at_ms),
            printable(&result.to_string())
        );
    }
}

fn print_fence(scope: &str, entity: &str, fence: &FenceRecord, json: bool) {
    let order = Order::from_bytes(fence.order.clone());
    if json {
        out!(
            "{}",
            json!({
                "scope": scope,
                "entity": entity,
                "order": decoded(&order),
                "order_hex": order.to_string(),
                "expires_at": rfc3339(fence.expires_at_ms),
            })
        );
    } else {
        out!("scope:       {}", printable(scope));
        out!("entity:      {}", printable(entity));
        out!("order:       {}", order_text(&order));
        out!("expires:     {}", rfc3339(fence.expires_at_ms));
    }
}

/// An order's values read without its spec (`null` if they do not read).
fn decoded(order: &Order) -> Option<String> {
    order.decode().ok().map(|d| d.to_string())
}

/// An order's values, then its hex (as stored) for copy and paste.
fn order_text(order: &Order) -> String {
    match decoded(order) {
        Some(values) => format!("{} (hex {order})", printable(&values)),
        None => format!("hex {order} (not an order's components)"),
    }
}

/// A stale delivery's record, as JSON.
fn stale_json(stale: &Stale) -> serde_json::Value {
    json!({
        "entity": stale.entity,
        "received": decoded(&stale.received),
        "received_hex": stale.received.to_string(),
        "applied_before": decoded(&stale.current),
        "applied_before_hex": stale.current.to_string(),
    })
}

fn to_json(r: &Record, now: i64) -> serde_json::Value {
    let (result, encoding) = match r.result.as_deref().and_then(Stale::from_recorded) {
        Some(stale) => (stale_json(&stale), "stale"),
        None => result_value(r.result.as_deref()),
    };
    json!({
        "scope": r.scope,
        "key": r.key,
        "fingerprint": r.fingerprint.map(|f| f.to_hex()),
        "source": r.source,
        "created_at": rfc3339(r.created_at_ms),
        "created_at_ms": r.created_at_ms,
        "expires_at": rfc3339(r.expires_at_ms),
        "expires_at_ms": r.expires_at_ms,
        "expired": r.expires_at_ms <= now,
        "result_encoding": encoding,
        "result": result,
    })
}

fn print_text(r: &Record, now: i64) {
    let stale = r.result.as_deref().and_then(Stale::from_recorded);
    let (result, encoding) = result_value(r.result.as_deref());
    let state = if r.expires_at_ms <= now {
        " (expired)"
    } else {
        ""
    };
    out!("scope:       {}", printable(&r.scope));
    out!("key:         {}", printable(&r.key));
    out!(
        "fingerprint: {}",
        r.fingerprint.map_or_else(|| "-".to_owned(), |f| f.to_hex())
    );
    out!(
        "source:      {}",
        printable(r.source.as_deref().unwrap_or("-"))
    );
    out!("created:     {}", rfc3339(r.created_at_ms));
    out!("expires:     {}{state}", rfc3339(r.expires_at_ms));
    if let Some(stale) = stale {
        out!(
            "result:      stale: entity {} (a higher order was applied before)",
            printable(&stale.entity)
        );
        out!("order:       {}", order_text(&stale.received));
        out!("applied:     {}", order_text(&stale.current));
        return;
    }
    match encoding {
        "none" => out!("result:      - (none stored)"),
        "utf8" => out!(
            "result:      {}",
            printable(result.as_str().unwrap_or_default())
        ),
        _ => out!("result:      {result} ({encoding})"),
    }
}

/// `s` with control characters escaped, so stored bytes cannot drive the terminal.
pub(crate) fn printable(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}
