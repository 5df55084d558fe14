//! The claim's transaction as an axum extractor.

use axum::body::Body;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::{Response, StatusCode};
use axum::response::IntoResponse;
use sqlx::Database;

use super::problem::problem;
use crate::engine::{Tx, TxGone};

/// The handler's [`Tx`] could not be extracted: the route is not behind an
/// [`IdempotencyLayer`](super::IdempotencyLayer), or the request went
/// through without a key (optional keys, or a fail-open outage; take
/// `Option<Tx<DB>>` where a handler must also run without one). Answers
/// `500` with problem type `urn:onceonly:problem:no-transaction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "no onceonly transaction: the route is not behind the IdempotencyLayer, or the request had no key"
)]
pub struct TxRejection;

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response<Body> {
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "no-transaction",
            "No idempotency transaction",
            "this route is not behind the onceonly IdempotencyLayer, or the request went through without a key",
        )
    }
}

impl IntoResponse for TxGone {
    fn into_response(self) -> Response<Body> {
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "transaction-gone",
            "Transaction unavailable",
            "the idempotency transaction was already finished",
        )
    }
}

/// The transaction the request's key was claimed in. Write through it and
/// your writes commit together with the claim and the stored response, or
/// not at all:
///
/// ```no_run
/// # #[cfg(feature = "postgres")] mod f {
/// use axum::http::StatusCode;
/// use axum::Json;
/// use onceonly::Tx;
/// use sqlx::Postgres;
///
/// #[derive(serde::Deserialize)]
/// struct NewOrder { account: String, amount: i64 }
///
/// async fn create_order(
///     tx: Tx<Postgres>,
///     Json(order): Json<NewOrder>,
/// ) -> Result<(StatusCode, String), StatusCode> {
///     let mut conn = tx.lock().await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     let id: i64 = sqlx::query_scalar("INSERT INTO orders (account, amount) VALUES ($1, $2) RETURNING id")
///         .bind(&order.account)
///         .bind(order.amount)
///         .fetch_one(&mut *conn)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     Ok((StatusCode::CREATED, id.to_string()))
/// }
/// # }
/// ```
///
/// The layer commits after the response is stored (2xx, and 4xx if
/// configured) and rolls back otherwise.
impl<DB: Database, S: Send + Sync> FromRequestParts<S> for Tx<DB> {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Tx<DB>>().cloned().ok_or(TxRejection)
    }
}

impl<DB: Database, S: Send + Sync> OptionalFromRequestParts<S> for Tx<DB> {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Tx<DB>>().cloned())
    }
}
