//! `onceonly migrate`: create or upgrade the dedup table and the outbox table.

use clap::Args;
use onceonly::SqlStore;
use onceonly::ops::admin::AdminStore;
use onceonly::store::TableName;

use crate::db::{Db, with_store};
use crate::outbox::{OutboxLayout, OutboxTableArg, outbox_for};
use crate::{CliResult, out};

/// Create the dedup table and the outbox table with their indexes, or add
/// what an older version lacks.
#[derive(Args, Debug)]
#[command(after_help = "\
Safe to run repeatedly and concurrently (e.g. from every replica at start-up):
it only creates what is missing, then checks that the dedup table has the
columns this version reads.

The outbox table (default onceonly_outbox) holds the messages handlers send
with the transactional outbox; --no-outbox skips it.

Examples:
  onceonly migrate --database-url postgres://app@db/payments
  onceonly migrate --database-url mysql://root@127.0.0.1/test --table billing.onceonly_keys
  onceonly migrate --database-url $URL --outbox-table billing.outbox
  onceonly migrate --database-url sqlite:data/app.db --no-outbox
  onceonly migrate --print-sql --backend postgres > migrations/0001_onceonly.sql
  onceonly migrate --database-url $URL --layout generations --prepare   # online, slow
  onceonly migrate --database-url $URL --layout generations             # then: fast")]
pub struct MigrateArgs {
    /// postgres://…, mysql://… (or mariadb://…) or sqlite:PATH (else
    /// DATABASE_URL).
    #[arg(long, env = "ONCEONLY_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The dedup table (`table` or `schema.table`).
    #[arg(long, env = "ONCEONLY_TABLE", default_value = onceonly::store::DEFAULT_TABLE)]
    table: String,
    #[command(flatten)]
    outbox: OutboxTableArg,
    /// Do not create the outbox table.
    #[arg(long)]
    no_outbox: bool,
    /// Print the DDL instead of running it (for your own migration tool,
    /// e.g. a `sqlx migrate` file); needs --backend, not --database-url.
    #[arg(long, requires = "backend")]
    print_sql: bool,
    /// The backend whose DDL --print-sql prints.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// PostgreSQL: the dedup table's layout. `generations` partitions it
    /// into two generations purged by TRUNCATE, never by DELETE (for big
    /// tables; see docs/stores.md), and upgrades a plain table to it. Default:
    /// the layout the table has, plain for a new one.
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    /// PostgreSQL: prepare a plain table for `--layout generations` while
    /// consumers run (a column, a validated check and an index built
    /// CONCURRENTLY: minutes on a big table), then stop. The upgrade that
    /// follows takes milliseconds instead of an exclusive scan.
    #[arg(long, requires = "layout", conflicts_with = "print_sql")]
    prepare: bool,
    /// PostgreSQL, `--layout generations`: into how many hash partitions
    /// each generation is split (1 to 64), so that a rotation frees a big
    /// generation's files a bucket at a time. Read only where this
    /// migration creates a generation.
    #[arg(long, requires = "layout", default_value_t = onceonly::store::DEFAULT_GENERATION_BUCKETS,
          value_parser = clap::value_parser!(u16).range(1..=i64::from(onceonly::store::MAX_GENERATION_BUCKETS)))]
    buckets: u16,
}

/// The dedup table's layout (PostgreSQL).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LayoutArg {
    /// One table, purged by bounded DELETEs.
    Plain,
    /// Two partitions, purged by TRUNCATE of the older one.
    Generations,
}

/// A backend for --print-sql.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum BackendArg {
    Postgres,
    Mysql,
    Sqlite,
}

/// Prints the DDL of the dedup table (and the outbox table) for `backend`.
fn print_sql(args: &MigrateArgs, backend: BackendArg) -> CliResult {
    use onceonly::ops::admin::{Dialect, migration_sql};
    use onceonly::store::Layout;
    let dialect = match backend {
        BackendArg::Postgres => Dialect::Postgres,
        BackendArg::Mysql => Dialect::MySql,
        BackendArg::Sqlite => Dialect::Sqlite,
    };
    let layout = match args.layout {
        Some(LayoutArg::Generations) => Layout::Generations {
            buckets: args.buckets,
        },
        _ => Layout::Plain,
    };
    let table = TableName::new(&args.table)?;
    let dedup = migration_sql(dialect, layout, &table).ok_or_else(|| {
        format!("{backend:?} with this layout: the generations layout is PostgreSQL's only, and a backend needs its feature in this build")
    })?;
    out!("-- onceonly dedup table {table} ({backend:?})");
    for statement in dedup {
        out!("{statement};");
    }
    if !args.no_outbox {
        let name = TableName::new(&args.outbox.outbox_table)?.to_string();
        let outbox = crate::outbox::outbox_sql(dialect, &name)?;
        out!("");
        out!("-- onceonly outbox table {name} ({backend:?})");
        for statement in outbox {
            out!("{statement};");
        }
    }
    Ok(())
}

/// ", generations layout" for a PostgreSQL table of that layout.
fn layout_note(db: &Db) -> &'static str {
    if db.layout().is_generations() {
        ", generations layout"
    } else {
        ""
    }
}

pub async fn run(args: MigrateArgs) -> CliResult {
    if args.print_sql {
        let backend = args.backend.ok_or("--print-sql needs --backend")?;
        return print_sql(&args, backend);
    }
    let database_url = crate::db::database_url(args.database_url.as_deref())?;
    // Both names are checked before anything is created.
    let outbox_table = if args.no_outbox {
        None
    } else {
        Some(TableName::new(&args.outbox.outbox_table)?)
    };
    let db = Db::open(&database_url, &args.table, true).await?;
    let db = match (db, args.layout) {
        #[cfg(feature = "postgres")]
        (Db::Postgres(store), Some(layout)) => {
            let store = store
                .generations(layout == LayoutArg::Generations)
                .generation_buckets(args.buckets);
            if args.prepare {
                if !store.has_generations() {
                    return Err("--prepare prepares the upgrade to --layout generations".into());
                }
                store.prepare_generations().await?;
                out!(
                    "dedup table {} is prepared: run `onceonly migrate --layout generations` \
                     once every process on it runs with PgStore::generations(true)",
                    store.table()
                );
                return Ok(());
            }
            Db::Postgres(store)
        }
        // Unreachable with PostgreSQL alone.
        #[cfg(any(feature = "mysql", feature = "sqlite"))]
        (db, Some(_)) => {
            return Err(format!("--layout is for PostgreSQL, not {}", db.backend()).into());
        }
        (db, None) => db,
    };
    let backend = db.backend();
    with_store!(&db, |store| {
        store.migrate().await?;
        // Every column this version reads, without reading a row: fails
        // with the database's error if one is missing.
        store.check_columns().await?;
        out!(
            "dedup table {} is ready ({backend}{})",
            store.table(),
            layout_note(&db)
        );
        if let Some(name) = &outbox_table {
            let pool = store.pool();
            let outbox = outbox_for(pool, &name.to_string()).await?;
            let outbox = match args.layout {
                Some(layout) => OutboxLayout::choose(outbox, layout == LayoutArg::Generations),
                None => outbox,
            };
            outbox.migrate(pool).await?;
            let note = if outbox.has_generations() {
                ", generations layout"
            } else {
                ""
            };
            out!("outbox table {name} is ready ({backend}{note})");
        }
    });
    Ok(())
}
