//! The `payment_webhook` example's HTTP app, shared with its tests: a
//! payment-callback route and an `Idempotency-Key` order route, for SQLite
//! and for Postgres.
#![allow(dead_code)] // each user compiles the backends it needs

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use onceonly::outbox::{Outbox, OutboxBackend};

use super::ledger::Payment;

/// The merchant notification of each processed payment callback: a
/// [`Settled`](super::ledger::Settled) JSON body enqueued in `outbox`, in
/// the callback's transaction, for a webhook POST to `url` (sent by a
/// relay once the transaction committed).
pub struct Notify<DB: OutboxBackend> {
    /// The outbox the notifications are enqueued in.
    pub outbox: Outbox<DB>,
    /// The merchant's notification URL.
    pub url: String,
}

/// Errors of the handlers: bad input is `400` (rolled back, not stored),
/// database errors `500` (rolled back, the client may retry).
#[derive(Debug)]
pub enum AppError {
    /// The body is not a payment or an order.
    BadInput(String),
    /// The database failed.
    Database(sqlx::Error),
    /// The transaction was gone.
    Tx(onceonly::http::TxGone),
    /// The notification could not be enqueued.
    Outbox(onceonly::HandlerError),
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

impl From<onceonly::http::TxGone> for AppError {
    fn from(e: onceonly::http::TxGone) -> Self {
        Self::Tx(e)
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let (status, detail) = match self {
            Self::BadInput(d) => (StatusCode::BAD_REQUEST, d),
            Self::Database(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            Self::Tx(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            Self::Outbox(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let body = serde_json::json!({
            "type": "about:blank",
            "title": status.canonical_reason().unwrap_or("error"),
            "status": status.as_u16(),
            "detail": detail,
        });
        (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response()
    }
}

/// A payment notification, JSON or form-encoded.
pub fn parse_payment(headers: &HeaderMap, body: &Bytes) -> Result<Payment, AppError> {
    let form = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.to_ascii_lowercase()
                .starts_with("application/x-www-form-urlencoded")
        });
    let parsed = if form {
        let mut fields = serde_json::Map::new();
        for (k, v) in form_urlencoded::parse(body) {
            let value = match k.as_ref() {
                // Form fields are text; the amount is a number.
                "amount" => v
                    .parse::<i64>()
                    .map(serde_json::Value::from)
                    .map_err(|e| AppError::BadInput(format!("amount: {e}")))?,
                _ => serde_json::Value::String(v.into_owned()),
            };
            fields.entry(k.into_owned()).or_insert(value);
        }
        serde_json::from_value(serde_json::Value::Object(fields))
    } else {
        serde_json::from_slice(body)
    };
    let payment: Payment = parsed.map_err(|e| AppError::BadInput(e.to_string()))?;
    if payment.amount <= 0 {
        return Err(AppError::BadInput("amount must be positive".into()));
    }
    Ok(payment)
}

/// Generates `router(store, secret, orders_layer_config)` and
/// `router_notifying(store, secret, notify, orders_layer_config)` for one
/// backend.
macro_rules! webhook_app {
    ($module:ident, $db:ty, $store:ty, $flavour:ident) => {
        /// The app over this backend.
        pub mod $module {
            use axum::Router;
            use axum::body::Bytes;
            use axum::http::{HeaderMap, StatusCode, header};
            use axum::response::IntoResponse;
            use axum::routing::post;
            use axum::Json;
            use std::sync::Arc;
            use onceonly::outbox::OutboxMessage;
            use onceonly::{FingerprintSpec, SqlStore};
            use onceonly::http::{
                Ack, HttpBuildError, IdempotencyLayer, IdempotencyLayerBuilder, SignatureCheck, Tx,
            };

            use super::super::ledger::{NewOrder, Order, Settled, $flavour as ledger};
            use super::{AppError, Notify, parse_payment};

            async fn payment(
                tx: Tx<$db>,
                headers: HeaderMap,
                body: Bytes,
                notify: Option<Arc<Notify<$db>>>,
            ) -> Result<impl IntoResponse, AppError> {
                let payment = parse_payment(&headers, &body)?;
                let mut tx = tx.lock().await?;
                let receipt = ledger::record(&mut *tx, &payment).await?;
                if let Some(notify) = notify {
                    let settled = Settled::new(&payment, &receipt);
                    let message = OutboxMessage::webhook(notify.url.as_str(), settled.body());
                    notify
                        .outbox
                        .enqueue(&mut tx, message)
                        .await
                        .map_err(AppError::Outbox)?;
                }
                Ok((
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                    "success",
                ))
            }

            async fn order(
                tx: Tx<$db>,
                Json(new): Json<NewOrder>,
            ) -> Result<(StatusCode, Json<Order>), AppError> {
                if new.amount <= 0 {
                    return Err(AppError::BadInput("amount must be positive".into()));
                }
                let mut tx = tx.lock().await?;
                let order = ledger::insert_order(&mut *tx, &new).await?;
                Ok((StatusCode::CREATED, Json(order)))
            }

            /// Creates the tables (dedup, ledger, accounts, orders).
            pub async fn migrate(store: &$store) -> Result<(), Box<dyn std::error::Error>> {
                store.migrate().await?;
                ledger::create_tables(store.pool()).await?;
                ledger::create_orders_table(store.pool()).await?;
                Ok(())
            }

            /// `POST /webhooks/payments` (callback mode, signature checked
            /// if `secret` is set) and `POST /orders` (`Idempotency-Key`);
            /// `orders` adjusts the order route's layer (tests use it).
            pub fn router(
                store: $store,
                secret: Option<String>,
                orders: impl FnOnce(IdempotencyLayerBuilder<$store>) -> IdempotencyLayerBuilder<$store>,
            ) -> Result<Router, HttpBuildError> {
                router_notifying(store, secret, None, orders)
            }

            /// [`router`], and with `notify` set, each processed payment
            /// callback also enqueues its merchant notification.
            pub fn router_notifying(
                store: $store,
                secret: Option<String>,
                notify: Option<Notify<$db>>,
                orders: impl FnOnce(IdempotencyLayerBuilder<$store>) -> IdempotencyLayerBuilder<$store>,
            ) -> Result<Router, HttpBuildError> {
                let notify = notify.map(Arc::new);
                let callback = move |tx: Tx<$db>, headers: HeaderMap, body: Bytes| {
                    payment(tx, headers, body, notify.clone())
                };
                let mut callbacks = IdempotencyLayer::payment_callback(
                    store.clone(),
                    "payment-callbacks",
                    "json:/out_trade_no",
                    Ack::plain_success(),
                );
                // A repeated notification may differ in fields such as
                // `notify_time`, never in who is paid how much: those are
                // fingerprinted, and a tampered one gets 422.
                callbacks = callbacks.fingerprint(FingerprintSpec::Fields(vec![
                    "/account".into(),
                    "/amount".into(),
                ]));
                if let Some(secret) = secret {
                    callbacks = callbacks.signature(SignatureCheck::new(secret));
                }
                let orders = orders(IdempotencyLayer::idempotency_key(store, "orders")).build()?;
                Ok(Router::new()
                    .route("/webhooks/payments", post(callback).layer(callbacks.build()?))
                    .route("/orders", post(order).layer(orders)))
            }
        }
    };
}

#[cfg(feature = "sqlite")]
webhook_app!(sqlite, sqlx::Sqlite, onceonly::SqliteStore, sqlite);
#[cfg(feature = "postgres")]
webhook_app!(postgres, sqlx::Postgres, onceonly::PgStore, postgres);
