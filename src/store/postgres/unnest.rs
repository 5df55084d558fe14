//! PostgreSQL's batch paths: all keys of a batch in one `UNNEST`
//! statement, where the other backends run one statement per key.

use std::collections::{HashMap, HashSet};

use sqlx::Row;
use sqlx::postgres::{PgConnection, Postgres};

use crate::store::base::SqlBase;
use crate::store::claim::Existing;
use crate::store::rows::StoreRow;
use crate::store::{Claim, ClaimRequest, ClaimTimes, StoreError, clamp_source, plan_batch};

/// The arrays an `UNNEST` insert of claims binds.
struct Columns<'a> {
    keys: Vec<&'a str>,
    fps: Vec<Option<Vec<u8>>>,
    sources: Vec<Option<&'a str>>,
}

impl<'a> Columns<'a> {
    fn of<'r>(reqs: impl Iterator<Item = &'r ClaimRequest<'a>> + Clone) -> Self
    where
        'a: 'r,
    {
        Self {
            keys: reqs.clone().map(|r| r.key).collect(),
            fps: reqs
                .clone()
                .map(|r| r.fingerprint.map(|f| f.as_bytes().to_vec()))
                .collect(),
            sources: reqs.map(|r| r.source.map(clamp_source)).collect(),
        }
    }
}

/// Claims a batch: one insert of every first occurrence, one read of the
/// keys it did not insert, and the single-key path for expired records and
/// for repeats with another fingerprint.
pub(super) async fn claim_batch(
    base: &SqlBase<Postgres>,
    conn: &mut PgConnection,
    scope: &str,
    times: ClaimTimes,
    reqs: &[ClaimRequest<'_>],
) -> Result<Vec<Claim>, StoreError> {
    let plan = plan_batch(reqs);
    let mut claims = plan.claims;
    let firsts: Vec<&ClaimRequest<'_>> = plan.firsts.iter().map(|&i| &reqs[i]).collect();
    let Columns { keys, fps, sources } = Columns::of(firsts.iter().copied());
    let inserted: Vec<String> = sqlx::query_scalar(&base.sql.insert_many)
        .bind(scope)
        .bind(&keys)
        .bind(&fps)
        .bind(&sources)
        .bind(times.now_ms)
        .bind(times.expires_at_ms)
        .fetch_all(&mut *conn)
        .await?;
    let inserted: HashSet<String> = inserted.into_iter().collect();
    let taken: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !inserted.contains(*k))
        .collect();
    let mut found = existing_many(base, conn, scope, &taken).await?;
    for &i in &plan.firsts {
        let req = &reqs[i];
        claims[i] = Some(if inserted.contains(req.key) {
            Claim::Claimed
        } else {
            match found.remove(req.key) {
                Some(e) if e.expires_at_ms > times.now_ms => e.classify(req)?,
                // Expired, or purged since the insert: the single-key path
                // handles reclaim and its races.
                _ => base.claim(conn, scope, times, req).await?,
            }
        });
    }
    // Repeats with another fingerprint than their first occurrence meet
    // the record as it now stands in this transaction.
    for &i in &plan.repeats {
        claims[i] = Some(base.claim(conn, scope, times, &reqs[i]).await?);
    }
    crate::store::batch::finish(claims)
}

/// The records of many keys, in one statement.
pub(super) async fn existing_many(
    base: &SqlBase<Postgres>,
    conn: &mut PgConnection,
    scope: &str,
    keys: &[&str],
) -> Result<HashMap<String, Existing>, StoreError> {
    let mut found = HashMap::with_capacity(keys.len());
    if keys.is_empty() {
        return Ok(found);
    }
    let rows = sqlx::query(&base.sql.existing_many)
        .bind(scope)
        .bind(keys)
        .fetch_all(&mut *conn)
        .await?;
    for row in &rows {
        let key: String = row.try_get("idem_key")?;
        found.insert(key, row.existing()?);
    }
    Ok(found)
}

/// Claims many keys with their results (an optimistic batch): one insert
/// of them all; a key it did not insert (expired, or taken meanwhile) goes
/// through the single-key path.
pub(super) async fn claim_completed_batch(
    base: &SqlBase<Postgres>,
    conn: &mut PgConnection,
    scope: &str,
    times: ClaimTimes,
    reqs: &[ClaimRequest<'_>],
    results: &[&[u8]],
) -> Result<Vec<Claim>, StoreError> {
    if reqs.is_empty() {
        return Ok(Vec::new());
    }
    let Columns { keys, fps, sources } = Columns::of(reqs.iter());
    let inserted: Vec<String> = sqlx::query_scalar(&base.sql.insert_completed_many)
        .bind(scope)
        .bind(&keys)
        .bind(&fps)
        .bind(&sources)
        .bind(times.now_ms)
        .bind(times.expires_at_ms)
        .bind(results)
        .fetch_all(&mut *conn)
        .await?;
    let inserted: HashSet<String> = inserted.into_iter().collect();
    let mut claims = Vec::with_capacity(reqs.len());
    for (req, result) in reqs.iter().zip(results) {
        claims.push(if inserted.contains(req.key) {
            Claim::Claimed
        } else {
            base.claim_completed(conn, scope, times, req, result)
                .await?
        });
    }
    Ok(claims)
}

/// Records many results in one statement.
pub(super) async fn complete_many(
    base: &SqlBase<Postgres>,
    conn: &mut PgConnection,
    scope: &str,
    results: &[(&str, &[u8])],
) -> Result<(), StoreError> {
    if results.is_empty() {
        return Ok(());
    }
    let (keys, values): (Vec<&str>, Vec<&[u8]>) = results.iter().copied().unzip();
    let done = sqlx::query(&base.sql.complete_many)
        .bind(scope)
        .bind(&keys)
        .bind(&values)
        .execute(&mut *conn)
        .await?;
    match done.rows_affected() {
        n if n == results.len() as u64 => Ok(()),
        // Fewer: a claim vanished from its own transaction.
        n if n < results.len() as u64 => Err(StoreError::ClaimLost),
        n => Err(StoreError::Corrupt(format!(
            "recording {} results updated {n} rows",
            results.len()
        ))),
    }
}
