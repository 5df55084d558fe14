//! `onceonly migrate`: create or upgrade the dedup table and the outbox table.

use clap::Args;
use onceonly::SqlStore;
use onceonly::store::TableName;
use onceonly::store::admin::AdminStore;

use crate::db::{Db, with_store};
use crate::outbox::{OutboxTableArg, outbox_for};
use crate::{CliResult, DbArgs, out};

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
  onceonly migrate --database-url sqlite:data/app.db --no-outbox")]
pub struct MigrateArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    outbox: OutboxTableArg,
    /// Do not create the outbox table.
    #[arg(long)]
    no_outbox: bool,
}

pub async fn run(args: MigrateArgs) -> CliResult {
    // Both names are checked before anything is created.
    let outbox_table = if args.no_outbox {
        None
    } else {
        Some(TableName::new(&args.outbox.outbox_table)?)
    };
    let db = Db::open(&args.db.database_url, &args.db.table, true).await?;
    let backend = db.backend();
    with_store!(&db, |store| {
        store.migrate().await?;
        // Every column this version reads, without reading a row: fails
        // with the database's error if one is missing.
        store.check_columns().await?;
        out!("dedup table {} is ready ({backend})", store.table());
        if let Some(name) = &outbox_table {
            let pool = store.pool();
            outbox_for(pool, &name.to_string())?.migrate(pool).await?;
            out!("outbox table {name} is ready ({backend})");
        }
    });
    Ok(())
}
