//! `onceonly migrate`: create or upgrade the dedup table.

use clap::Args;
use onceonly::SqlStore;
use onceonly::store::admin::AdminStore;

use crate::db::{Db, with_store};
use crate::{CliResult, DbArgs, out};

/// Create the dedup table and its indexes, or add what an older version lacks.
#[derive(Args, Debug)]
#[command(after_help = "\
Safe to run repeatedly and concurrently (e.g. from every replica at start-up):
it only creates what is missing, then checks that the table has the columns
this version reads.

Examples:
  onceonly migrate --database-url postgres://app@db/payments
  onceonly migrate --database-url mysql://root@127.0.0.1/test --table billing.onceonly_keys
  onceonly migrate --database-url sqlite:data/app.db")]
pub struct MigrateArgs {
    #[command(flatten)]
    db: DbArgs,
}

pub async fn run(args: MigrateArgs) -> CliResult {
    let db = Db::open(&args.db.database_url, &args.db.table, true).await?;
    let backend = db.backend();
    with_store!(&db, |store| {
        store.migrate().await?;
        // Every column this version reads, without reading a row: fails
        // with the database's error if one is missing.
        store.check_columns().await?;
        out!("dedup table {} is ready ({backend})", store.table());
    });
    Ok(())
}
