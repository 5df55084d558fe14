//! What operations tools are built from: the queries of
//! [`onceonly-cli`](https://crates.io/crates/onceonly-cli) (`onceonly
//! stats`, `inspect`, `purge`, `migrate --print-sql`, `doctor`) and of your
//! own maintenance jobs.
//!
//! **For operations tools such as `onceonly-cli`; not covered by the semver
//! promise of the handler API.** An application that only handles
//! deliveries never needs this module: its items may change in a minor
//! release, together with the CLI of the same version.
//!
//! - [`AdminStore`]: statistics per scope, record search, counts and
//!   purges by age or expiry on the dedup table, implemented by every SQL
//!   store. These read the whole table or scope where no index helps: run
//!   them against a replica when the table is very large.
//! - [`migration_sql`]: the DDL that [`SqlStore::migrate`](crate::SqlStore::migrate)
//!   runs, for a migration tool of your own (`onceonly migrate
//!   --print-sql` prints it), by [`Dialect`].
//! - `amqp_connect` (feature `amqp`): a RabbitMQ connection made the way
//!   the consumer, the outbox publisher and the replay make theirs.
//!
//! The outbox's operations (counts per status, listing, retrying dead
//! rows, purging sent rows) are methods of
//! [`Outbox`](crate::outbox::Outbox): `stats`, `list`, `find`,
//! `retry_dead`, `purge_sent`.

pub use crate::store::admin::{
    AGE_BUCKET_LABELS, AGE_BUCKETS_MS, AdminStore, CountFilter, PurgeCursor, PurgeStep,
    RecordFilter, ScopeStats,
};
pub use crate::store::dialect::Dialect;
use crate::store::{Layout, TableName};

/// Opens a connection to `url` with `tls`, as the AMQP consumer, the outbox
/// publisher and the replay do (for operations tools that talk to the same
/// broker, e.g. `onceonly doctor`). Not bounded: wrap it in a timeout.
#[cfg(feature = "amqp")]
#[cfg_attr(docsrs, doc(cfg(feature = "amqp")))]
pub async fn amqp_connect(
    url: &str,
    tls: &crate::amqp::AmqpTls,
) -> Result<lapin::Connection, lapin::Error> {
    crate::amqp::connect(url, tls).await
}

/// The DDL [`SqlStore::migrate`](crate::SqlStore::migrate) runs for dedup table `table` of `layout`
/// on `dialect` (the table, its attempts table [`TableName::attempts`](crate::store::TableName::attempts) and
/// their indexes, `IF NOT EXISTS`), for your own migration tool: the same
/// statements the store builds (`Backend::sql`). `None` if the backend is
/// not compiled in, or has no such layout (generations: PostgreSQL only).
/// PostgreSQL's migration lock is left out: run the statements in one
/// migration.
// Without any backend compiled in every arm returns `None`.
#[allow(unreachable_code, unused_variables)]
pub fn migration_sql(dialect: Dialect, layout: Layout, table: &TableName) -> Option<Vec<String>> {
    use crate::store::Backend;
    let ddl: Vec<String> = match (dialect, layout) {
        #[cfg(feature = "postgres")]
        (Dialect::Postgres, layout) => sqlx::Postgres::sql(table, layout).ddl,
        #[cfg(feature = "mysql")]
        (Dialect::MySql, Layout::Plain) => sqlx::MySql::sql(table, layout).ddl,
        #[cfg(feature = "sqlite")]
        (Dialect::Sqlite, Layout::Plain) => sqlx::Sqlite::sql(table, layout).ddl,
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    Some(crate::store::without_migration_lock(ddl))
}
