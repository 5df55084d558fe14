//! Which claim path the onceonly consumers and servers of a run use on
//! PostgreSQL: a statement per step (the default) or pipelined (the claim
//! with `BEGIN`, the result with `COMMIT`: `BENCH_PG_PIPELINED=1`), to
//! measure the two against each other; and whether the consumers claim
//! optimistically, after the handler (`BENCH_OPTIMISTIC=1`).

use onceonly::PgStore;

use super::common::Res;

/// Whether `BENCH_PG_PIPELINED` asks for pipelined claims.
fn pipelined_by_env() -> bool {
    std::env::var_os("BENCH_PG_PIPELINED").is_some_and(|v| v != "0" && !v.is_empty())
}

/// A store on `url`, pipelined if `pipelined` or `BENCH_PG_PIPELINED` says so.
pub async fn pg_store(url: &str, pipelined: bool) -> Res<PgStore> {
    let store = PgStore::connect(url).await?;
    Ok(store.pipelined(pipelined || pipelined_by_env()))
}

/// Whether `BENCH_OPTIMISTIC` asks for optimistic claims.
pub fn optimistic() -> bool {
    std::env::var_os("BENCH_OPTIMISTIC").is_some_and(|v| v != "0" && !v.is_empty())
}
