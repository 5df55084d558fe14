//! Which claim path the onceonly consumers and servers of a run use on
//! PostgreSQL: pipelined (the default: the claim with `BEGIN`, the result
//! with `COMMIT`) or one statement each (`BENCH_PG_STATEMENTS=1`, the
//! path before pipelining), to measure the two against each other.

use onceonly::PgStore;

use super::common::Res;

/// Whether `BENCH_PG_STATEMENTS` asks for the statement-per-step path.
pub fn statements() -> bool {
    std::env::var_os("BENCH_PG_STATEMENTS").is_some_and(|v| v != "0" && !v.is_empty())
}

/// A store on `url` with this run's claim path (`statements` forces the
/// statement-per-step path).
pub async fn pg_store(url: &str, statements: bool) -> Res<PgStore> {
    let store = PgStore::connect(url).await?;
    Ok(store.pipelined(!(statements || self::statements())))
}
