//! The inbox a user would write by hand instead of onceonly: seed 001
//! §3.2's dedup table with a unique key, claimed in the same transaction
//! as the business writes, written with plain sqlx the way a careful user
//! would. It is the honest anchor for onceonly's cost: a framework should
//! cost nothing over it and win on duplicates.
//!
//! Two forms, as the seed and its one-statement variant write them:
//!
//! - [`Form::ClaimFirst`]: `INSERT idempotency_log (key) ON CONFLICT DO
//!   NOTHING` first (a concurrent copy waits on the row), then the
//!   business writes, then `UPDATE idempotency_log SET response`, `COMMIT`;
//!   a key already there rolls back and answers the stored response. A
//!   consumer has no response to store, so its claim is done at once
//!   (`status = 1`) and has no `UPDATE`: the cheapest correct claim-first.
//! - [`Form::ClaimLast`]: the business writes, then one `INSERT
//!   idempotency_log (key, response) ON CONFLICT DO NOTHING`, `COMMIT`; a
//!   key already there rolls the business writes back and answers the
//!   stored response. One dedup statement per new key, but a duplicate
//!   runs the business writes before it is found out.
//!
//! Same table shape as the seed (`idem_key` unique, `status`, `response`,
//! `created_at`), minus its surrogate `id`: one index to maintain, the
//! cheapest table a careful user would write. PostgreSQL only (the bench's
//! database).

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

/// How the hand-written inbox claims its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Form {
    /// Claim, business writes, record the response, commit.
    ClaimFirst,
    /// Business writes, claim with the response, commit.
    ClaimLast,
}

impl Form {
    /// The name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::ClaimFirst => "hand-written inbox, claim first (seed 001 §3.2)",
            Self::ClaimLast => "hand-written inbox, claim last (one statement)",
        }
    }
}

/// Creates the inbox table if missing (in the pool's schema).
pub async fn create_table(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS idempotency_log (idem_key TEXT PRIMARY KEY, \
         status SMALLINT NOT NULL DEFAULT 0, response BYTEA, \
         created_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Claims `key` on the open transaction `conn`, `status` as given (0:
/// pending, its response to come; 1: done): whether it was new. A
/// concurrent claim of the key waits here until the first commits or
/// rolls back.
pub async fn claim(conn: &mut PgConnection, key: &str, status: i16) -> sqlx::Result<bool> {
    let done = sqlx::query(
        "INSERT INTO idempotency_log (idem_key, status) VALUES ($1, $2) \
         ON CONFLICT (idem_key) DO NOTHING",
    )
    .bind(key)
    .bind(status)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Claims many keys at once (a batch): the keys that were new.
pub async fn claim_many(conn: &mut PgConnection, keys: &[&str]) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "INSERT INTO idempotency_log (idem_key, status) SELECT k, 1 FROM UNNEST($1::text[]) AS k \
         ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key",
    )
    .bind(keys)
    .fetch_all(conn)
    .await
}

/// Records the response of a claimed key.
pub async fn record(conn: &mut PgConnection, key: &str, response: &[u8]) -> sqlx::Result<()> {
    sqlx::query("UPDATE idempotency_log SET status = 1, response = $2 WHERE idem_key = $1")
        .bind(key)
        .bind(response)
        .execute(conn)
        .await?;
    Ok(())
}

/// Claims `key` with its response, last in the transaction: whether it was
/// new (if not, the caller rolls back).
pub async fn claim_done(
    conn: &mut PgConnection,
    key: &str,
    response: Option<&[u8]>,
) -> sqlx::Result<bool> {
    let done = sqlx::query(
        "INSERT INTO idempotency_log (idem_key, status, response) VALUES ($1, 1, $2) \
         ON CONFLICT (idem_key) DO NOTHING",
    )
    .bind(key)
    .bind(response)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The stored response of a done key: `None` if the key is not done (a
/// copy still in flight).
pub async fn stored(pool: &PgPool, key: &str) -> sqlx::Result<Option<Vec<u8>>> {
    let row: Option<(i16, Option<Vec<u8>>)> =
        sqlx::query_as("SELECT status, response FROM idempotency_log WHERE idem_key = $1")
            .bind(key)
            .fetch_optional(pool)
            .await?;
    Ok(match row {
        Some((1, response)) => Some(response.unwrap_or_default()),
        _ => None,
    })
}
