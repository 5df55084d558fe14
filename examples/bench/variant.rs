//! Which claim path the onceonly consumers and servers of a run use on
//! PostgreSQL: a statement per step (the default) or pipelined (the claim
//! with `BEGIN`, the result with `COMMIT`: `BENCH_PG_PIPELINED=1`), to
//! measure the two against each other; whether the consumers claim
//! optimistically, after the handler (`BENCH_OPTIMISTIC=1`); and whether
//! the HTTP servers fence each account (`BENCH_FENCE=1`, ordered by the
//! amount, which every request has at 1: never stale, so the ledger stays
//! exact, and the cost is all there: one more statement per claim, and
//! requests of one account pass its fence one at a time).

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

/// The fence `BENCH_FENCE` asks for: per account, by amount.
pub fn fence() -> Option<onceonly::FenceSpec> {
    std::env::var_os("BENCH_FENCE")
        .is_some_and(|v| v != "0" && !v.is_empty())
        .then(|| {
            onceonly::FenceSpec::new(
                onceonly::KeySpec::json_field("/account"),
                onceonly::OrderSpec::integer("/amount"),
            )
        })
}
