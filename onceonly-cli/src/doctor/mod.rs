//! `onceonly doctor`: checks a deployment and says what is wrong and how to
//! fix it.

#[cfg(feature = "_broker")]
mod brokers;
mod finding;
mod sql;

use std::process::ExitCode;
use std::time::Duration;

use onceonly::ops::admin::migration_sql;
use onceonly::ops::admin::{AdminStore, RecordFilter};
use onceonly::store::TableName;

use crate::db::{Db, with_store};
use crate::outbox::OutboxTableArg;
use crate::{CliResult, DbArgs, out};
use finding::{Finding, Status};
use onceonly::SqlStore as _;
use sql::{Checked, TableRole};

const HELP: &str = "\
Checks, in order: the dedup table, its attempts table and the outbox table
exist with every column and index this version expects; the connecting role
may SELECT, INSERT, UPDATE and DELETE on them (PostgreSQL: has_table_privilege;
MySQL: statements touching no row, rolled back), and on a PostgreSQL table of
the generations layout what its rotations need (SELECT and UPDATE on the
control table, TRUNCATE on the partitions); the server takes writes (not
a standby, not read-only); the database's clock against this host's; the
outbox backlog, its oldest pending message and dead messages; the dedup
retention (--retention, else the newest record's, else 7d) against each
--topic's retention.ms and the oldest letter of each --dlq queue.

Exit status: 0 when every check passed, 3 when there are only warnings, 1
when a check failed (or the doctor could not run).

Examples:
  onceonly doctor --database-url postgres://app@db/payments
  onceonly doctor --kafka-brokers kafka:9092 --topic payments --topic payments.dlt
  onceonly doctor --amqp-url amqp://ops@mq/%2f --dlq orders.dlq --json";

/// Check a deployment: tables, privileges, writability, clock, outbox,
/// retention against the brokers.
#[derive(clap::Args, Debug)]
#[command(after_help = HELP)]
pub struct DoctorArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    outbox: OutboxTableArg,
    /// Skip the outbox table (for deployments that do not use it).
    #[arg(long)]
    no_outbox: bool,
    /// The scope whose dedup retention the brokers are compared with
    /// (default: the newest record's scope).
    #[arg(long)]
    scope: Option<String>,
    /// The dedup retention, instead of reading it from the table.
    #[arg(long, value_name = "DURATION", value_parser = crate::time::parse_duration)]
    retention: Option<Duration>,
    /// Kafka bootstrap servers, for --topic.
    #[cfg(feature = "kafka")]
    #[arg(long, env = "ONCEONLY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// A topic (consumed or dead-letter) whose retention.ms to compare with
    /// the dedup retention (repeatable).
    #[cfg(feature = "kafka")]
    #[arg(long = "topic", value_name = "TOPIC")]
    topics: Vec<String>,
    /// librdkafka setting, KEY=VALUE (repeatable).
    #[cfg(feature = "kafka")]
    #[arg(short = 'X', value_name = "KEY=VALUE", value_parser = crate::parse_pair)]
    config: Vec<(String, String)>,
    /// AMQP broker URL, for --dlq.
    #[cfg(feature = "amqp")]
    #[arg(
        long,
        env = "ONCEONLY_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    amqp_url: String,
    #[cfg(feature = "amqp")]
    #[command(flatten)]
    tls: crate::AmqpTlsArgs,
    /// A dead-letter queue whose oldest letter to compare with the dedup
    /// retention (repeatable; nothing is consumed).
    #[cfg(feature = "amqp")]
    #[arg(long = "dlq", value_name = "QUEUE")]
    dlqs: Vec<String>,
    /// Print the findings as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `onceonly doctor`.
pub async fn run(args: DoctorArgs) -> CliResult<ExitCode> {
    let findings = match args.db.open().await {
        Ok(db) => checks(&args, &db).await?,
        Err(e) => vec![Finding::fail(
            "connect",
            e.to_string(),
            "check --database-url (or ONCEONLY_DATABASE_URL, DATABASE_URL) and --table",
        )],
    };
    if args.json {
        let status = findings
            .iter()
            .map(|f| f.status)
            .max()
            .unwrap_or(Status::Ok);
        out!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "status": status,
                "findings": findings,
            }))?
        );
    } else {
        finding::print(&findings);
    }
    Ok(ExitCode::from(finding::exit_code(&findings)))
}

async fn checks(args: &DoctorArgs, db: &Db) -> CliResult<Vec<Finding>> {
    let mut findings = Vec::new();
    let (dedup, columns, retention) = with_store!(db, |store| {
        let table = store.table().clone();
        let columns = store.check_columns().await;
        let retention = dedup_retention(store, args).await;
        (table, columns, retention)
    });
    let dedup_ddl = migration_sql(db.dialect(), db.layout(), &dedup).unwrap_or_default();
    let mut tables = Vec::new();
    match columns {
        Ok(()) => {
            findings.push(Finding::ok(
                "tables",
                format!(
                    "{dedup}, {}, {} and {} have every column",
                    dedup.attempts(),
                    dedup.fence(),
                    dedup.steps()
                ),
            ));
            tables.push(Checked {
                name: dedup.clone(),
                ddl: dedup_ddl.clone(),
                role: TableRole::Dedup,
            });
            for side in [dedup.attempts(), dedup.fence(), dedup.steps()] {
                tables.push(Checked {
                    name: side,
                    ddl: dedup_ddl.clone(),
                    role: TableRole::Attempts,
                });
            }
        }
        Err(e) => findings.push(Finding::fail(
            "tables",
            format!(
                "{dedup}, {}, {} or {}: {e}",
                dedup.attempts(),
                dedup.fence(),
                dedup.steps()
            ),
            "onceonly migrate (creates or completes the tables; check --table)",
        )),
    }
    if !args.no_outbox {
        let name = TableName::new(&args.outbox.outbox_table)?;
        let table = name.to_string();
        let stats =
            crate::outbox::with_outbox!(db, &table, |outbox, pool| outbox.stats(pool).await);
        match stats {
            Ok(stats) => {
                findings.push(Finding::ok(
                    "tables",
                    format!("outbox table {table} is there"),
                ));
                findings.push(outbox_finding(&table, &stats));
                let ddl = crate::outbox::outbox_sql(db.dialect(), &table)?;
                tables.push(Checked {
                    name,
                    ddl,
                    role: TableRole::Outbox,
                });
            }
            Err(e) if e.is_missing_table() => findings.push(Finding::warn(
                "tables",
                format!("no outbox table {table}"),
                "onceonly migrate creates it; --no-outbox if this deployment does not use the \
                 outbox",
            )),
            Err(e) => findings.push(Finding::fail(
                "tables",
                format!("outbox table {table}: {e}"),
                "onceonly migrate (check --outbox-table)",
            )),
        }
    }
    findings.extend(backend_checks(db, &tables).await);
    let (retention, source) = retention;
    findings.push(Finding::ok(
        "retention",
        format!(
            "dedup retention {} ({source})",
            humantime::format_duration(Duration::from_secs(retention.as_secs()))
        ),
    ));
    #[cfg(feature = "kafka")]
    if !args.topics.is_empty() {
        findings.extend(
            brokers::kafka(&args.kafka_brokers, &args.config, &args.topics, retention).await,
        );
    }
    #[cfg(feature = "amqp")]
    if !args.dlqs.is_empty() {
        findings
            .extend(brokers::amqp(&args.amqp_url, &args.tls.load()?, &args.dlqs, retention).await);
    }
    Ok(findings)
}

/// The checks only the backend can answer: indexes, privileges, writes,
/// clock.
async fn backend_checks(db: &Db, tables: &[Checked]) -> Vec<Finding> {
    match db {
        #[cfg(feature = "postgres")]
        Db::Postgres(s) => sql::postgres::check(onceonly::SqlStore::pool(s), tables).await,
        #[cfg(feature = "mysql")]
        Db::MySql(s) => sql::mysql::check(onceonly::SqlStore::pool(s), tables).await,
        #[cfg(feature = "sqlite")]
        Db::Sqlite(s) => sql::sqlite::check(onceonly::SqlStore::pool(s), tables).await,
    }
}

/// The dedup retention and where it comes from.
async fn dedup_retention<S: AdminStore>(store: &S, args: &DoctorArgs) -> (Duration, String) {
    if let Some(r) = args.retention {
        return (r, "--retention".to_owned());
    }
    let mut filter = RecordFilter::new(1);
    if let Some(scope) = &args.scope {
        filter = filter.scope(scope);
    }
    match store.find(&filter).await {
        Ok(records) => match records.first() {
            Some(r) => (
                Duration::from_millis(
                    u64::try_from(r.expires_at_ms - r.created_at_ms).unwrap_or(0),
                ),
                format!("of the newest record, scope {}", r.scope),
            ),
            None => (
                onceonly::engine::DEFAULT_RETENTION,
                "no record yet: the engine's default".to_owned(),
            ),
        },
        Err(_) => (
            onceonly::engine::DEFAULT_RETENTION,
            "the table cannot be read: the engine's default".to_owned(),
        ),
    }
}

/// Backlog, oldest pending and dead messages of the outbox.
fn outbox_finding(table: &str, stats: &onceonly::outbox::OutboxStats) -> Finding {
    use onceonly::outbox::Status as Row;
    // Delayed messages are not due yet: not backlog.
    let pending = stats.backlog();
    let dead = stats.rows(Row::Dead);
    let age_s = stats
        .oldest_ms(Row::Pending)
        .map_or(0, |t| (crate::time::now_ms() - t).max(0) / 1000);
    if dead > 0 {
        Finding::warn(
            "outbox",
            format!("{table}: {dead} dead messages, {pending} pending"),
            format!(
                "onceonly outbox inspect --outbox-table {table} --status dead; fix the \
                 destination, then onceonly outbox retry --all-dead"
            ),
        )
    } else if age_s > 300 {
        Finding::warn(
            "outbox",
            format!("{table}: {pending} pending, the oldest for {age_s} s"),
            "check that a relay runs (onceonly relay) and that its destinations answer \
             (onceonly outbox inspect --status pending)",
        )
    } else {
        Finding::ok(
            "outbox",
            format!("{table}: {pending} pending (oldest {age_s} s), none dead"),
        )
    }
}
