//! `onceonly inspect`: show dedup records.

use std::process::ExitCode;

use clap::Args;
use onceonly::Record;
use onceonly::store::admin::{AdminStore, RecordFilter};
use serde_json::json;

use crate::db::with_store;
use crate::time::{now_ms, rfc3339};
use crate::{CliResult, DbArgs, out};

/// Show the dedup record of a key, or the newest records of a scope or source.
#[derive(Args, Debug)]
#[command(after_help = "\
Exit status: 0 if at least one record was found, 3 if none, 1 on errors.

Examples:
  # Was this payment processed, when, and what did the handler return?
  onceonly inspect --database-url postgres://app@db/payments --scope payments --key ord-1042
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
    /// The idempotency key (exact).
    #[arg(long)]
    key: Option<String>,
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
    let now = now_ms();
    for (i, r) in records.iter().enumerate() {
        if args.json {
            out!("{}", to_json(r, now));
        } else {
            if i > 0 {
                out!();
            }
            print_text(r, now);
        }
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

fn to_json(r: &Record, now: i64) -> serde_json::Value {
    let (result, encoding) = result_value(r.result.as_deref());
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
