//! The open transaction, handed to the handler through request extensions.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use axum::http::{Response, StatusCode};
use axum::response::IntoResponse;
use sqlx::{Database, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use super::problem::problem;

/// Where the layer keeps the claim's transaction while the handler runs.
pub(crate) struct TxSlot<DB: Database>(pub(crate) Arc<Mutex<Option<Transaction<'static, DB>>>>);

impl<DB: Database> Clone for TxSlot<DB> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

/// The transaction the key was claimed in: an axum extractor. Write through
/// it and your writes commit together with the claim and the stored
/// response, or not at all.
///
/// ```rust,ignore
/// async fn create_order(tx: Tx<Postgres>, Json(order): Json<NewOrder>) -> Result<impl IntoResponse, AppError> {
///     let mut tx = tx.lock().await?;
///     let id: i64 = sqlx::query_scalar("INSERT INTO orders (account, amount) VALUES ($1, $2) RETURNING id")
///         .bind(&order.account)
///         .bind(order.amount)
///         .fetch_one(&mut **tx)
///         .await?;
///     Ok((StatusCode::CREATED, Json(Order { id, .. })))
/// }
/// ```
///
/// Do not commit or roll it back yourself: the layer commits after the
/// response is stored (2xx, and 4xx if configured) and rolls back otherwise.
/// Extraction fails with a 500 problem on a route the layer does not cover;
/// use `Option<Tx<DB>>` where a handler must also run without one (a
/// request without a key where keys are optional, or a fail-open outage).
pub struct Tx<DB: Database>(TxSlot<DB>);

/// The transaction is gone (the layer already finished the request).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the onceonly transaction is no longer available")]
pub struct TxGone;

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

/// The locked transaction: use `&mut **guard` as the sqlx executor.
pub type TxGuard<DB> =
    OwnedMappedMutexGuard<Option<Transaction<'static, DB>>, Transaction<'static, DB>>;

impl<DB: Database> Tx<DB> {
    /// Locks the transaction for the handler's statements: use
    /// `&mut **guard` as the executor.
    pub async fn lock(&self) -> Result<TxGuard<DB>, TxGone> {
        OwnedMutexGuard::try_map(Arc::clone(&self.0.0).lock_owned().await, Option::as_mut)
            .map_err(|_| TxGone)
    }
}

impl<DB: Database, S: Send + Sync> FromRequestParts<S> for Tx<DB> {
    type Rejection = Response<Body>;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<TxSlot<DB>>().cloned().map(Tx).ok_or_else(|| {
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "no-transaction",
                "No idempotency transaction",
                "this route is not behind the onceonly IdempotencyLayer, or the request went through without a key",
            )
        })
    }
}

impl<DB: Database, S: Send + Sync> OptionalFromRequestParts<S> for Tx<DB> {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<TxSlot<DB>>().cloned().map(Tx))
    }
}
