//! `onceonly outbox`: the transactional outbox table — its backlog and dead
//! messages, putting dead messages back, deleting old sent ones.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use onceonly::outbox::{
    DEFAULT_OUTBOX_TABLE, Outbox, OutboxBackend, OutboxRecord, OutboxStats, Status,
};
use onceonly::store::{DEFAULT_TABLE, StoreError, TableName};
use serde_json::json;
use sqlx::Pool;

use crate::db::Db;
use crate::inspect::{printable, result_value};
use crate::time::{age, before_now, now_ms, parse_duration, rfc3339, rfc3339_seconds};
use crate::{CliResult, out};

/// The transactional outbox: backlog, dead messages, retry, purge of sent rows.
#[derive(Args, Debug)]
#[command(after_help = "\
Messages a handler enqueues with Outbox::enqueue wait in the outbox table
(pending) until a relay publishes them (sent). A message its destination
refuses permanently, or that failed too often, is parked (dead) until it is
retried by hand. The table is created by `onceonly migrate`.

Examples:
  onceonly outbox stats --database-url postgres://app@db/payments
  onceonly outbox inspect --database-url $URL --status dead
  onceonly outbox retry --database-url $URL --all-dead
  onceonly outbox purge --database-url $URL --older-than 7d")]
pub struct OutboxArgs {
    #[command(subcommand)]
    command: OutboxCommand,
}

#[derive(Subcommand, Debug)]
enum OutboxCommand {
    Stats(StatsArgs),
    Inspect(InspectArgs),
    Retry(RetryArgs),
    Purge(PurgeArgs),
}

/// The outbox table's name, with its environment fallback.
#[derive(Args, Debug)]
pub struct OutboxTableArg {
    /// The outbox table (`table` or `schema.table`).
    #[arg(long, env = "ONCEONLY_OUTBOX_TABLE", default_value = DEFAULT_OUTBOX_TABLE)]
    pub outbox_table: String,
}

/// Where the outbox table lives.
#[derive(Args, Debug)]
struct OutboxDbArgs {
    /// postgres://…, mysql://… (or mariadb://…) or sqlite:PATH (else
    /// DATABASE_URL).
    #[arg(long, env = "ONCEONLY_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    #[command(flatten)]
    table: OutboxTableArg,
}

impl OutboxDbArgs {
    /// Validates the table name, then connects.
    async fn open(&self) -> CliResult<(Db, String)> {
        let name = TableName::new(&self.table.outbox_table)?.to_string();
        // The dedup table's name is not used: the outbox has its own.
        let url = crate::db::database_url(self.database_url.as_deref())?;
        let db = Db::open(&url, DEFAULT_TABLE, false).await?;
        Ok((db, name))
    }
}

/// The outbox on `table` for the backend of `pool`, with the layout its
/// table has.
pub(crate) async fn outbox_for<DB: OutboxLayout>(
    pool: &Pool<DB>,
    table: &str,
) -> Result<Outbox<DB>, StoreError> {
    DB::detect(Outbox::on_table(table)?, pool).await
}

/// The layouts an outbox table of a backend can have: PostgreSQL's plain
/// or generations layout (found in the database), one elsewhere.
pub(crate) trait OutboxLayout: OutboxBackend {
    /// `outbox` with the layout its table has.
    async fn detect(outbox: Outbox<Self>, pool: &Pool<Self>) -> Result<Outbox<Self>, StoreError>;

    /// `outbox` with the generations layout or the plain one (`migrate
    /// --layout`, accepted for PostgreSQL only).
    fn choose(outbox: Outbox<Self>, generations: bool) -> Outbox<Self>;
}

#[cfg(feature = "postgres")]
impl OutboxLayout for sqlx::Postgres {
    async fn detect(outbox: Outbox<Self>, pool: &Pool<Self>) -> Result<Outbox<Self>, StoreError> {
        outbox.detect_layout(pool).await
    }

    fn choose(outbox: Outbox<Self>, generations: bool) -> Outbox<Self> {
        outbox.generations(generations)
    }
}

#[cfg(feature = "mysql")]
impl OutboxLayout for sqlx::MySql {
    async fn detect(outbox: Outbox<Self>, _: &Pool<Self>) -> Result<Outbox<Self>, StoreError> {
        Ok(outbox)
    }

    fn choose(outbox: Outbox<Self>, _: bool) -> Outbox<Self> {
        outbox
    }
}

#[cfg(feature = "sqlite")]
impl OutboxLayout for sqlx::Sqlite {
    async fn detect(outbox: Outbox<Self>, _: &Pool<Self>) -> Result<Outbox<Self>, StoreError> {
        Ok(outbox)
    }

    fn choose(outbox: Outbox<Self>, _: bool) -> Outbox<Self> {
        outbox
    }
}

/// The outbox DDL on `table` for `backend`, without a database.
pub(crate) fn outbox_sql(
    dialect: onceonly::ops::admin::Dialect,
    table: &str,
) -> CliResult<Vec<String>> {
    use onceonly::ops::admin::Dialect;
    Ok(match dialect {
        #[cfg(feature = "postgres")]
        Dialect::Postgres => Outbox::<sqlx::Postgres>::on_table(table)?.migration_sql(),
        #[cfg(feature = "mysql")]
        Dialect::MySql => Outbox::<sqlx::MySql>::on_table(table)?.migration_sql(),
        #[cfg(feature = "sqlite")]
        Dialect::Sqlite => Outbox::<sqlx::Sqlite>::on_table(table)?.migration_sql(),
        #[allow(unreachable_patterns)]
        other => return Err(format!("this build has no {other:?} support").into()),
    })
}

/// Runs `$body` with `$outbox` the outbox on table `$table` and `$pool`
/// the pool of `$db`, whatever its backend.
macro_rules! with_outbox {
    ($db:expr, $table:expr, |$outbox:ident, $pool:ident| $body:expr) => {
        $crate::db::with_store!($db, |store| {
            let $pool = onceonly::SqlStore::pool(store);
            let $outbox = $crate::outbox::outbox_for($pool, $table).await?;
            $body
        })
    };
}
pub(crate) use with_outbox;

pub async fn run(args: OutboxArgs) -> CliResult<ExitCode> {
    match args.command {
        OutboxCommand::Stats(a) => stats(a).await.map(|()| ExitCode::SUCCESS),
        OutboxCommand::Inspect(a) => inspect(a).await,
        OutboxCommand::Retry(a) => retry(a).await,
        OutboxCommand::Purge(a) => purge(a).await.map(|()| ExitCode::SUCCESS),
    }
}

/// Messages per status and kind: the backlog, dead messages, oldest ages.
#[derive(Args, Debug)]
#[command(after_help = "\
The backlog is the pending messages: enqueued by committed handlers, not yet
confirmed by their destination. A growing backlog or an old oldest pending
message means no relay runs, or its destination fails; dead messages wait
for `onceonly outbox retry`.

Examples:
  onceonly outbox stats --database-url postgres://app@db/payments
  onceonly outbox stats --database-url $URL --outbox-table billing.outbox --json")]
struct StatsArgs {
    #[command(flatten)]
    db: OutboxDbArgs,
    /// JSON instead of text.
    #[arg(long)]
    json: bool,
}

const STATUSES: [Status; 3] = [Status::Pending, Status::Sent, Status::Dead];

async fn stats(args: StatsArgs) -> CliResult {
    let (db, table) = args.db.open().await?;
    let stats: OutboxStats = with_outbox!(&db, &table, |outbox, pool| outbox.stats(pool).await?);
    let now = now_ms();
    let age_s = |ms: Option<i64>| ms.map(|ms| now.saturating_sub(ms).max(0) / 1000);
    if args.json {
        let rows: serde_json::Map<String, serde_json::Value> = STATUSES
            .iter()
            .map(|s| (s.as_str().to_owned(), stats.rows(*s).into()))
            .collect();
        let counts: Vec<serde_json::Value> = stats
            .counts
            .iter()
            .map(|c| {
                json!({
                    "status": c.status.as_str(),
                    "kind": c.kind,
                    "rows": c.rows,
                    "oldest": c.oldest_ms.map(rfc3339),
                    "oldest_ms": c.oldest_ms,
                    "oldest_age_seconds": age_s(c.oldest_ms),
                    "delayed": c.delayed,
                })
            })
            .collect();
        let oldest_pending = stats.oldest_ms(Status::Pending);
        let out = json!({
            "table": table,
            "backlog": stats.backlog(),
            "delayed": stats.delayed(),
            "oldest_pending": oldest_pending.map(rfc3339),
            "oldest_pending_ms": oldest_pending,
            "oldest_pending_age_seconds": age_s(oldest_pending),
            "rows": rows,
            "counts": counts,
        });
        out!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print_stats(&table, &stats);
    Ok(())
}

fn when(ms: Option<i64>) -> String {
    ms.map_or_else(
        || "-".to_owned(),
        |ms| format!("{} ({} ago)", rfc3339_seconds(ms), age(ms)),
    )
}

fn print_stats(table: &str, stats: &OutboxStats) {
    let total: i64 = stats.counts.iter().map(|c| c.rows).sum();
    if total == 0 {
        out!("outbox table {table}: no messages");
        return;
    }
    let (pending, sent, dead) = (
        stats.rows(Status::Pending),
        stats.rows(Status::Sent),
        stats.rows(Status::Dead),
    );
    out!(
        "outbox table {table}: {total} {}: {pending} pending, {sent} sent, {dead} dead",
        messages(total)
    );
    let backlog = stats.backlog();
    match stats.oldest_ms(Status::Pending) {
        Some(ms) => out!(
            "backlog: {backlog} pending, the oldest enqueued {}",
            when(Some(ms))
        ),
        None => out!("backlog: 0 pending"),
    }
    let delayed = stats.delayed();
    if delayed > 0 {
        out!(
            "delayed: {delayed} not due yet (list them with `onceonly outbox inspect --status pending`)"
        );
    }
    if dead > 0 {
        out!(
            "dead: {dead} (list them with `onceonly outbox inspect --status dead`, \
             retry with `onceonly outbox retry --all-dead`)"
        );
    }
    let width = stats
        .counts
        .iter()
        .map(|c| c.kind.len())
        .max()
        .unwrap_or(4)
        .max(4);
    out!();
    out!(
        "{:<7}  {:<width$}  {:>10}  {}",
        "status",
        "kind",
        "messages",
        "oldest enqueued"
    );
    for c in &stats.counts {
        out!(
            "{:<7}  {:<width$}  {:>10}  {}",
            c.status.as_str(),
            printable(&c.kind),
            c.rows,
            when(c.oldest_ms)
        );
    }
}

fn messages(n: i64) -> &'static str {
    if n == 1 { "message" } else { "messages" }
}

/// A status on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum StatusArg {
    /// Waiting for a relay.
    Pending,
    /// Confirmed by the destination.
    Sent,
    /// Parked after a permanent failure or too many attempts.
    Dead,
}

impl From<StatusArg> for Status {
    fn from(s: StatusArg) -> Self {
        match s {
            StatusArg::Pending => Self::Pending,
            StatusArg::Sent => Self::Sent,
            StatusArg::Dead => Self::Dead,
        }
    }
}

/// Show outbox messages of a status, or one message by its id.
#[derive(Args, Debug)]
#[command(after_help = "\
Text output shows the first --preview characters of each payload; --json
prints whole payloads (as JSON if they are JSON, else text, else hex).

Exit status: 0 if at least one message was found, 3 if none, 1 on errors.

Examples:
  # Why were messages parked?
  onceonly outbox inspect --database-url postgres://app@db/payments --status dead
  # The oldest pending messages: what holds the backlog up
  onceonly outbox inspect --database-url $URL --status pending --limit 5
  # One message, by the id its copies carry in header x-onceonly-message-id
  onceonly outbox inspect --database-url $URL --message-id 3f1c... --json")]
struct InspectArgs {
    #[command(flatten)]
    db: OutboxDbArgs,
    /// Messages of this status, oldest first.
    #[arg(long, value_enum, default_value_t = StatusArg::Dead)]
    status: StatusArg,
    /// At most this many messages.
    #[arg(long, default_value_t = 20)]
    limit: u32,
    /// Only the message with this id (instead of --status and --limit).
    #[arg(long, value_name = "ID", conflicts_with_all = ["status", "limit"])]
    message_id: Option<String>,
    /// Characters of each payload shown in text output.
    #[arg(long, value_name = "CHARS", default_value_t = 200)]
    preview: usize,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
}

async fn inspect(args: InspectArgs) -> CliResult<ExitCode> {
    let (db, table) = args.db.open().await?;
    let records: Vec<OutboxRecord> = match &args.message_id {
        Some(id) => with_outbox!(&db, &table, |outbox, pool| outbox
            .find(pool, id)
            .await?
            .into_iter()
            .collect()),
        None => {
            let status = Status::from(args.status);
            let limit = args.limit.max(1);
            with_outbox!(&db, &table, |outbox, pool| outbox
                .list(pool, status, limit)
                .await?)
        }
    };
    let now = now_ms();
    for (i, r) in records.iter().enumerate() {
        if args.json {
            out!("{}", record_json(r));
        } else {
            if i > 0 {
                out!();
            }
            print_record(r, now, args.preview);
        }
    }
    if records.is_empty() {
        match &args.message_id {
            Some(id) => eprintln!("no message {id:?} in outbox table {table}"),
            None => eprintln!(
                "no {} message in outbox table {table}",
                Status::from(args.status).as_str()
            ),
        }
        return Ok(ExitCode::from(3));
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes as UTF-8 text if they are, else hex; and which.
fn text_or_hex(bytes: &[u8]) -> (String, &'static str) {
    match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_owned(), "utf8"),
        Err(_) => (hex::encode(bytes), "hex"),
    }
}

fn record_json(r: &OutboxRecord) -> serde_json::Value {
    let (payload, encoding) = result_value(Some(&r.row.payload));
    let key = r.row.message_key.as_deref().map(text_or_hex);
    json!({
        "message_id": r.row.message_id,
        "status": r.status.as_str(),
        "kind": r.row.kind,
        "destination": r.row.destination,
        "routing_key": r.row.routing_key,
        "message_key": key.as_ref().map(|(k, _)| k),
        "message_key_encoding": key.as_ref().map(|(_, e)| e),
        "scope": r.row.scope,
        "causation": r.row.causation,
        "traceparent": r.row.traceparent,
        "attempts": r.row.attempts,
        "last_error": r.last_error,
        "delayed": r.status == Status::Pending && r.created_at_ms > now_ms(),
        "created_at": rfc3339(r.created_at_ms),
        "created_at_ms": r.created_at_ms,
        "sent_at": r.sent_at_ms.map(rfc3339),
        "sent_at_ms": r.sent_at_ms,
        "next_attempt_at": (r.status == Status::Pending).then(|| rfc3339(r.next_attempt_at_ms)),
        "next_attempt_at_ms": (r.status == Status::Pending).then_some(r.next_attempt_at_ms),
        "headers": r.row.header_pairs(),
        "payload_bytes": r.row.payload.len(),
        "payload_encoding": encoding,
        "payload": payload,
    })
}

/// The first `chars` characters of `s`, control characters escaped.
fn preview(s: &str, chars: usize) -> (String, bool) {
    let mut it = s.chars();
    let head: String = it.by_ref().take(chars).collect();
    (printable(&head), it.next().is_some())
}

fn print_record(r: &OutboxRecord, now: i64, chars: usize) {
    let opt = |s: Option<&str>| printable(s.unwrap_or("-"));
    out!("message id:   {}", printable(&r.row.message_id));
    out!("status:       {}", r.status.as_str());
    out!("kind:         {}", printable(&r.row.kind));
    out!("destination:  {}", printable(&r.row.destination));
    out!("routing key:  {}", opt(r.row.routing_key.as_deref()));
    match r.row.message_key.as_deref().map(text_or_hex) {
        Some((k, "hex")) => out!("message key:  {k} (hex)"),
        Some((k, _)) => out!("message key:  {}", printable(&k)),
        None => out!("message key:  -"),
    }
    out!("scope:        {}", printable(&r.row.scope));
    out!(
        "causation:    {} (the inbound key)",
        opt(r.row.causation.as_deref())
    );
    out!("traceparent:  {}", opt(r.row.traceparent.as_deref()));
    out!("attempts:     {}", r.row.attempts);
    out!("last error:   {}", opt(r.last_error.as_deref()));
    if r.status == Status::Pending && r.created_at_ms > now {
        out!(
            "delayed:      until {} (not due yet)",
            rfc3339(r.created_at_ms)
        );
    } else {
        out!(
            "created:      {} ({} ago)",
            rfc3339(r.created_at_ms),
            age(r.created_at_ms)
        );
    }
    out!(
        "sent:         {}",
        r.sent_at_ms.map_or_else(|| "-".to_owned(), rfc3339)
    );
    if r.status == Status::Pending {
        let due = if r.next_attempt_at_ms <= now {
            " (due)"
        } else {
            ""
        };
        out!("next attempt: {}{due}", rfc3339(r.next_attempt_at_ms));
    }
    let headers = r.row.header_pairs();
    if headers.is_empty() {
        out!("headers:      -");
    } else {
        let list: Vec<String> = headers
            .iter()
            .map(|(n, v)| format!("{}: {}", printable(n), printable(v)))
            .collect();
        out!("headers:      {}", list.join(", "));
    }
    let bytes = r.row.payload.len();
    let (text, encoding) = text_or_hex(&r.row.payload);
    let (shown, cut) = preview(&text, chars);
    let cut = if cut { ", truncated" } else { "" };
    let hex = if encoding == "hex" { ", hex" } else { "" };
    out!(
        "payload:      {shown}{} ({bytes} {}{hex}{cut})",
        if cut.is_empty() { "" } else { "…" },
        if bytes == 1 { "byte" } else { "bytes" }
    );
}

/// Put dead messages back to pending, due now, with their attempts reset.
#[derive(Args, Debug)]
#[command(
    group = clap::ArgGroup::new("which").required(true).args(["message_id", "all_dead"]),
    after_help = "\
A relay publishes retried messages again on its next round, in their order:
a retried message goes before the later messages of its ordering key that
are still pending. Fix what made them fail first (see `onceonly outbox
inspect --status dead`), or they come back dead.

Exit status: 0 on success (also when there was nothing dead with
--all-dead), 3 if the --message-id message does not exist or is not dead,
1 on errors.

Examples:
  onceonly outbox retry --database-url postgres://app@db/payments --all-dead
  onceonly outbox retry --database-url $URL --message-id 3f1c...")]
struct RetryArgs {
    #[command(flatten)]
    db: OutboxDbArgs,
    /// Only the dead message with this id.
    #[arg(long, value_name = "ID")]
    message_id: Option<String>,
    /// Every dead message.
    #[arg(long)]
    all_dead: bool,
}

async fn retry(args: RetryArgs) -> CliResult<ExitCode> {
    let (db, table) = args.db.open().await?;
    let id = args.message_id.as_deref();
    let retried = with_outbox!(&db, &table, |outbox, pool| outbox
        .retry_dead(pool, id)
        .await?);
    match id {
        None if retried == 0 => out!("no dead messages in outbox table {table}"),
        None => out!(
            "retried {retried} dead {}: pending again, due now",
            messages(i64::try_from(retried).unwrap_or(i64::MAX))
        ),
        Some(id) if retried > 0 => {
            out!("retried message {id}: pending again, due now");
        }
        Some(id) => {
            let found = with_outbox!(&db, &table, |outbox, pool| outbox.find(pool, id).await?);
            match found {
                None => eprintln!("no message {id:?} in outbox table {table}"),
                Some(r) => eprintln!(
                    "message {id:?} is {}, not dead: nothing to retry",
                    r.status.as_str()
                ),
            }
            return Ok(ExitCode::from(3));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Delete sent messages older than an age, in bounded batches.
#[derive(Args, Debug)]
#[command(after_help = "\
Deletes only sent messages (confirmed by their destination), by the time
they were sent; pending and dead ones stay. Each batch is one short DELETE
of at most --batch rows that commits on its own: interrupting it is safe.
Relays purge sent rows themselves after RelayBuilder::keep_sent (default
24 hours); this is for relays built with keep_sent(None), or to purge sooner.

Examples:
  onceonly outbox purge --database-url postgres://app@db/payments --older-than 7d
  onceonly outbox purge --database-url $URL --older-than 12h --batch 1000")]
struct PurgeArgs {
    #[command(flatten)]
    db: OutboxDbArgs,
    /// Delete messages sent longer ago than this (e.g. 7d, 12h).
    #[arg(long, value_name = "AGE", value_parser = parse_duration)]
    older_than: Duration,
    /// Rows per DELETE statement.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch: u32,
}

async fn purge(args: PurgeArgs) -> CliResult {
    let (db, table) = args.db.open().await?;
    let cutoff = before_now(args.older_than);
    let started = Instant::now();
    let deleted = with_outbox!(&db, &table, |outbox, pool| outbox
        .purge_sent(pool, cutoff, args.batch)
        .await?);
    out!(
        "deleted {deleted} sent {} sent before {} from outbox table {table} \
         in batches of at most {} in {:.1}s",
        messages(i64::try_from(deleted).unwrap_or(i64::MAX)),
        rfc3339(cutoff),
        args.batch,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn previews_are_cut_on_characters() {
        assert_eq!(super::preview("héllo", 2), ("hé".to_owned(), true));
        assert_eq!(super::preview("hi", 2), ("hi".to_owned(), false));
        assert_eq!(
            super::preview("a\u{1b}b", 9),
            ("a\\u{1b}b".to_owned(), false)
        );
    }
}
