//! `onceonly`: operate a onceonly deployment — create the dedup and outbox
//! tables, inspect and purge records, show statistics, replay dead letters,
//! group dead letters by failure, watch and retry the transactional outbox,
//! compute the logged form of a key.

mod db;
#[cfg(feature = "_broker")]
mod dlq;
mod doctor;
mod inspect;
mod key_hash;
mod migrate;
mod outbox;
mod purge;
mod relay;
#[cfg(feature = "_broker")]
mod replay;
mod stats;
mod time;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// `println!` that does not panic when stdout is closed (`onceonly stats | head`).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}
pub(crate) use out;

/// What a subcommand returns; errors are printed by `main`.
pub type CliResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Operate onceonly: the dedup table, dead letters and the outbox.
#[derive(Parser, Debug)]
#[command(
    name = "onceonly",
    version,
    about,
    propagate_version = true,
    after_help = "\
--database-url, --table and --outbox-table also read ONCEONLY_DATABASE_URL,
ONCEONLY_TABLE and ONCEONLY_OUTBOX_TABLE; without --database-url and
ONCEONLY_DATABASE_URL, DATABASE_URL is used (sqlx's convention). Logs go to
stderr; use -v for more."
)]
struct Cli {
    /// More logging on stderr (-v: debug, -vv: trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    Migrate(migrate::MigrateArgs),
    Inspect(inspect::InspectArgs),
    Purge(purge::PurgeArgs),
    Stats(stats::StatsArgs),
    Outbox(outbox::OutboxArgs),
    Relay(relay::RelayArgs),
    Doctor(doctor::DoctorArgs),
    /// Replay dead letters back to where they came from.
    #[cfg(feature = "_broker")]
    Replay(replay::ReplayArgs),
    /// Look into dead-letter queues and topics (failure groups).
    #[cfg(feature = "_broker")]
    Dlq(dlq::DlqArgs),
    KeyHash(key_hash::KeyHashArgs),
}

/// Where the dedup table lives.
#[derive(clap::Args, Debug)]
pub struct DbArgs {
    /// postgres://…, mysql://… (or mariadb://…) or sqlite:PATH (else
    /// DATABASE_URL).
    #[arg(long, env = "ONCEONLY_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// The dedup table (`table` or `schema.table`).
    #[arg(long, env = "ONCEONLY_TABLE", default_value = onceonly::store::DEFAULT_TABLE)]
    pub table: String,
}

impl DbArgs {
    /// Opens the dedup store these arguments name (the SQLite file must exist).
    pub async fn open(&self) -> Result<db::Db, db::OpenError> {
        let url = db::database_url(self.database_url.as_deref())?;
        db::Db::open(&url, &self.table, false).await
    }
}

/// TLS files of an `amqps://` broker beyond the system's roots.
#[cfg(feature = "amqp")]
#[derive(clap::Args, Debug)]
pub struct AmqpTlsArgs {
    /// PEM file of a CA to trust for amqps:// (besides the system's roots).
    #[arg(long, env = "ONCEONLY_AMQP_CA", value_name = "FILE")]
    pub amqp_ca: Option<std::path::PathBuf>,
    /// PEM client certificate for amqps:// (with --amqp-key).
    #[arg(
        long,
        env = "ONCEONLY_AMQP_CERT",
        value_name = "FILE",
        requires = "amqp_key"
    )]
    pub amqp_cert: Option<std::path::PathBuf>,
    /// PEM private key of --amqp-cert (PKCS#8, PKCS#1 or SEC1, unencrypted).
    #[arg(
        long,
        env = "ONCEONLY_AMQP_KEY",
        value_name = "FILE",
        requires = "amqp_cert"
    )]
    pub amqp_key: Option<std::path::PathBuf>,
}

#[cfg(feature = "amqp")]
impl AmqpTlsArgs {
    /// Reads the files into TLS settings.
    pub fn load(&self) -> std::io::Result<onceonly::amqp::AmqpTls> {
        onceonly::amqp::AmqpTls::from_files(
            self.amqp_ca.as_deref(),
            self.amqp_cert.as_deref(),
            self.amqp_key.as_deref(),
        )
    }
}

/// Parses a librdkafka `KEY=VALUE` setting (`-X`).
#[cfg(feature = "kafka")]
fn parse_pair(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => tracing::Level::WARN,
        1 => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let missing_table = match &cli.command {
        Command::Outbox(_) | Command::Relay(_) => {
            "the outbox table does not exist here; create it with `onceonly migrate` \
             (and check --outbox-table)"
        }
        _ => {
            "the dedup table does not exist here; create it with `onceonly migrate` (and check --table)"
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Migrate(a) => migrate::run(a).await.map(|()| ExitCode::SUCCESS),
            Command::Inspect(a) => inspect::run(a).await,
            Command::Purge(a) => purge::run(a).await.map(|()| ExitCode::SUCCESS),
            Command::Stats(a) => stats::run(a).await.map(|()| ExitCode::SUCCESS),
            Command::Outbox(a) => outbox::run(a).await,
            Command::Relay(a) => relay::run(a).await.map(|()| ExitCode::SUCCESS),
            Command::Doctor(a) => doctor::run(a).await,
            #[cfg(feature = "_broker")]
            Command::Replay(a) => replay::run(a).await.map(|()| ExitCode::SUCCESS),
            #[cfg(feature = "_broker")]
            Command::Dlq(a) => dlq::run(a).await,
            Command::KeyHash(a) => key_hash::run(a).map(|()| ExitCode::SUCCESS),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            // The library's errors already include their causes.
            eprintln!("error: {e}");
            if e.downcast_ref::<onceonly::StoreError>()
                .is_some_and(onceonly::StoreError::is_missing_table)
                || e.downcast_ref::<db::OpenError>()
                    .is_some_and(|o| matches!(o, db::OpenError::Store(s) if s.is_missing_table()))
            {
                eprintln!("hint: {missing_table}");
            }
            ExitCode::FAILURE
        }
    }
}
