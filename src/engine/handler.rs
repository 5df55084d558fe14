//! The user's handler, its input decoding and its errors.

use std::error::Error as StdError;
use std::marker::PhantomData;

use std::future::Future;

use async_trait::async_trait;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Database;

use super::tx::{Tx, TxGone};
use crate::delivery::Delivery;
use crate::store::InfraFault;

/// A boxed error.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The payload could not be decoded into the handler's input type. The
/// delivery is rejected (reason `decode_error`) and never retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot decode payload: {0}")]
pub struct DecodeError(pub String);

/// Decodes a handler's input from a delivery.
pub trait FromDelivery: Sized + Send + 'static {
    /// Decodes `delivery`.
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError>;
}

/// JSON input: the payload deserialized with serde, or the value tree a
/// [payload decoder](crate::engine::PayloadDecoder) read (an Avro or
/// Protobuf record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Json<T>(pub T);

impl<T: DeserializeOwned + Send + 'static> FromDelivery for Json<T> {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        let decoded = if delivery.is_decoded() {
            match delivery.json() {
                Ok(tree) => T::deserialize(tree),
                Err(e) => return Err(DecodeError(e.to_owned())),
            }
        } else {
            serde_json::from_slice(delivery.payload())
        };
        decoded.map(Json).map_err(|e| DecodeError(e.to_string()))
    }
}

/// Raw bytes input.
impl FromDelivery for Vec<u8> {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        Ok(delivery.payload().to_vec())
    }
}

/// UTF-8 text input.
impl FromDelivery for String {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        String::from_utf8(delivery.payload().to_vec())
            .map_err(|e| DecodeError(format!("payload is not UTF-8: {e}")))
    }
}

/// The whole delivery: its payload, metadata and source.
impl FromDelivery for Delivery {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        Ok(delivery.clone())
    }
}

/// Two inputs decoded from the same delivery, e.g. `(Json<T>, Delivery)`.
impl<A: FromDelivery, B: FromDelivery> FromDelivery for (A, B) {
    fn from_delivery(delivery: &Delivery) -> Result<Self, DecodeError> {
        Ok((A::from_delivery(delivery)?, B::from_delivery(delivery)?))
    }
}

/// A handler failure, classified retryable (a retry may succeed: timeout,
/// deadlock, unavailable dependency) or permanent (the message itself is bad:
/// dead-letter it after the first attempt).
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct HandlerError {
    retryable: bool,
    infrastructure: Option<InfraFault>,
    source: BoxError,
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        Self {
            retryable: true,
            infrastructure: None,
            source: error.into(),
        }
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        Self {
            retryable: false,
            infrastructure: None,
            source: error.into(),
        }
    }

    /// A failure that is the database's (or another dependency's) state,
    /// not the message's: transports wait for it to pass, never
    /// dead-letter because of it. `sqlx` errors converted with `?` are
    /// classified by themselves; use this for your own dependencies.
    pub fn infrastructure(fault: InfraFault, error: impl Into<BoxError>) -> Self {
        Self {
            retryable: true,
            infrastructure: Some(fault),
            source: error.into(),
        }
    }

    /// Whether the policy may retry it.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The infrastructure fault this error is, if it is one (see
    /// [`infra_fault`](crate::store::infra_fault)).
    pub fn infra_fault(&self) -> Option<InfraFault> {
        self.infrastructure
    }

    /// Whether the error is the database's state rather than anything
    /// about the message: a lost connection, a read-only server, a missing
    /// table, a deadlock... Transports wait for such failures to pass
    /// instead of dead-lettering the message.
    pub fn is_infrastructure(&self) -> bool {
        self.infrastructure.is_some()
    }
}

/// Database errors are classified once, by
/// [`infra_fault`](crate::store::infra_fault): the database's state
/// (unreachable, read-only, missing table, permission, resources, shutdown,
/// timeout, contention) is an infrastructure failure that transports wait
/// out; a transaction aborted by an earlier error the handler swallowed
/// (PostgreSQL `25P02`) is retryable, since that error may have been
/// transient; anything else (a constraint violation, a value that does not
/// fit) is permanent.
impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        crate::store::error::observe(&e);
        let infrastructure = crate::store::infra_fault(&e);
        let aborted =
            matches!(&e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"));
        Self {
            retryable: infrastructure.is_some() || aborted,
            infrastructure,
            source: Box::new(e),
        }
    }
}

/// A handle used after the engine finished its delivery: a bug of the
/// handler, never retried.
impl From<TxGone> for HandlerError {
    fn from(e: TxGone) -> Self {
        Self::permanent(e)
    }
}

/// Business logic run once per key, inside the claim's transaction.
///
/// `tx` is the open transaction ([`Tx`]): every write made through it
/// commits together with the claim, or rolls back with it. Do not commit or
/// roll back yourself, and do not perform effects outside the database that
/// cannot be undone (or make them idempotent on their own, e.g. with the
/// Redis store). A closure does the same with [`handler_fn`].
///
/// ```no_run
/// # #[cfg(feature = "sqlite")] {
/// use onceonly::{Delivery, Handler, HandlerError, Json, Tx};
/// use sqlx::Sqlite;
///
/// #[derive(serde::Deserialize)]
/// struct Payment { out_trade_no: String, amount: i64 }
///
/// struct Ledger;
///
/// #[async_trait::async_trait]
/// impl Handler<Sqlite> for Ledger {
///     type Input = Json<Payment>;
///     type Output = i64;
///
///     async fn handle(&self, tx: Tx<Sqlite>, Json(p): Json<Payment>, _: &Delivery) -> Result<i64, HandlerError> {
///         let mut conn = tx.lock().await?;
///         sqlx::query("INSERT INTO ledger (out_trade_no, amount) VALUES (?, ?)")
///             .bind(&p.out_trade_no)
///             .bind(p.amount)
///             .execute(&mut *conn)
///             .await?;
///         Ok(p.amount)
///     }
/// }
/// # }
/// ```
#[async_trait]
pub trait Handler<DB: Database>: Send + Sync {
    /// The decoded input ([`Json<T>`], `Vec<u8>`, `String`, [`Delivery`],
    /// a pair of these, or your own [`FromDelivery`]).
    type Input: FromDelivery;
    /// The result, stored with the key and returned to duplicates.
    type Output: Serialize + DeserializeOwned + Send + Sync + 'static;

    /// Handles one delivery whose key was just claimed.
    async fn handle(
        &self,
        tx: Tx<DB>,
        input: Self::Input,
        delivery: &Delivery,
    ) -> Result<Self::Output, HandlerError>;
}

/// A handler made from a closure; see [`handler_fn`].
pub struct FnHandler<F, DB, I> {
    f: F,
    _types: PhantomData<fn(DB, I)>,
}

/// Wraps an async closure over the claim's transaction and the decoded
/// input as a [`Handler`]:
///
/// ```
/// # #[cfg(feature = "sqlite")] {
/// use onceonly::{handler_fn, Json, Tx};
/// use sqlx::Sqlite;
///
/// #[derive(serde::Deserialize)]
/// struct Payment { out_trade_no: String, amount: i64 }
///
/// let handler = handler_fn(|tx: Tx<Sqlite>, Json(p): Json<Payment>| async move {
///     let mut conn = tx.lock().await?;
///     sqlx::query("INSERT INTO ledger (out_trade_no, amount) VALUES (?, ?)")
///         .bind(&p.out_trade_no)
///         .bind(p.amount)
///         .execute(&mut *conn)
///         .await?;
///     Ok(p.amount)
/// });
/// # let _ = handler; }
/// ```
///
/// The input is anything [`FromDelivery`]; take `(Json<T>, Delivery)` to
/// read the delivery's metadata too.
pub fn handler_fn<F, Fut, DB, I, O>(f: F) -> FnHandler<F, DB, I>
where
    DB: Database,
    I: FromDelivery,
    O: Serialize + DeserializeOwned + Send + Sync + 'static,
    F: Fn(Tx<DB>, I) -> Fut + Send + Sync,
    Fut: Future<Output = Result<O, HandlerError>> + Send,
{
    FnHandler {
        f,
        _types: PhantomData,
    }
}

#[async_trait]
impl<F, Fut, DB, I, O> Handler<DB> for FnHandler<F, DB, I>
where
    DB: Database,
    I: FromDelivery,
    O: Serialize + DeserializeOwned + Send + Sync + 'static,
    F: Fn(Tx<DB>, I) -> Fut + Send + Sync,
    Fut: Future<Output = Result<O, HandlerError>> + Send,
{
    type Input = I;
    type Output = O;

    async fn handle(&self, tx: Tx<DB>, input: I, _: &Delivery) -> Result<O, HandlerError> {
        (self.f)(tx, input).await
    }
}

/// A shared handler: lets the caller keep a reference (to read counters,
/// share caches) while a consumer owns the handler.
#[async_trait]
impl<DB, H> Handler<DB> for std::sync::Arc<H>
where
    DB: Database,
    H: Handler<DB> + ?Sized,
{
    type Input = H::Input;
    type Output = H::Output;

    async fn handle(
        &self,
        tx: Tx<DB>,
        input: Self::Input,
        delivery: &Delivery,
    ) -> Result<Self::Output, HandlerError> {
        (**self).handle(tx, input, delivery).await
    }
}
