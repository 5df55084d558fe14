//! The `payment_webhook` demo app's HTTP app, shared with its tests: a
//! payment-callback route and an `Idempotency-Key` order route, for SQLite
//! and for Postgres.

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

/// The provider API the `/refunds` route calls (its base URL), and the
/// client it calls with.
#[derive(Clone, Debug)]
pub struct RefundApi {
    /// The provider API's base URL; refunds are `POST {url}/v1/refunds`.
    pub url: String,
    /// The HTTP client.
    pub client: reqwest::Client,
}

/// A refund request: `{"payment": "pi_1", "amount": 500}`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct NewRefund {
    /// The payment to refund.
    pub payment: String,
    /// How much, in cents.
    pub amount: i64,
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
    /// The refund API call (a step) failed or could not be recorded.
    Step(onceonly::HandlerError),
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
            Self::Step(e) => (StatusCode::BAD_GATEWAY, e.to_string()),
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

/// The payment in a verified provider callback (the payload the layer
/// hands on: Alipay's fields as JSON, WeChat Pay's decrypted transaction,
/// Stripe's event, Adyen's notification, or a GitHub-style signed
/// `{"out_trade_no","account","amount"}`), or `None` for a notification
/// that settles nothing (a failed or pending payment): acknowledged, not
/// booked.
pub fn provider_payment(provider: &str, body: &[u8]) -> Result<Option<Payment>, AppError> {
    use serde_json::Value;
    let v: Value = serde_json::from_slice(body).map_err(|e| AppError::BadInput(e.to_string()))?;
    let text = |v: &Value, p: &str| v.pointer(p).and_then(Value::as_str).map(str::to_owned);
    let int = |v: &Value, p: &str| v.pointer(p).and_then(Value::as_i64);
    let missing = |what: &str| AppError::BadInput(format!("{provider} callback without {what}"));
    let (settled, out_trade_no, account, amount) = match provider {
        // One order makes several notifications, each its own event (and
        // key): TRADE_SUCCESS books the payment; TRADE_FINISHED (refunds no
        // longer possible), TRADE_CLOSED and refunds (with `out_biz_no`)
        // are acknowledged without booking it again.
        "alipay" => (
            text(&v, "/trade_status").as_deref() == Some("TRADE_SUCCESS")
                && text(&v, "/out_biz_no").is_none(),
            text(&v, "/out_trade_no"),
            text(&v, "/buyer_id"),
            text(&v, "/total_amount").and_then(|yuan| yuan_to_fen(&yuan)),
        ),
        // A refund's resource has `refund_status`, no `trade_state`.
        "wechatpay" => (
            text(&v, "/trade_state").as_deref() == Some("SUCCESS"),
            text(&v, "/out_trade_no"),
            text(&v, "/payer/openid"),
            int(&v, "/amount/total"),
        ),
        // A guest checkout has no customer (`null`): its payment is booked
        // to the account `guest`, not refused (Stripe retries a refused
        // event for three days).
        "stripe" => (
            text(&v, "/type").as_deref() == Some("payment_intent.succeeded"),
            text(&v, "/data/object/metadata/out_trade_no").or_else(|| text(&v, "/data/object/id")),
            text(&v, "/data/object/customer").or_else(|| Some("guest".to_owned())),
            int(&v, "/data/object/amount"),
        ),
        "adyen" => {
            let item = v
                .pointer("/notificationItems/0/NotificationRequestItem")
                .ok_or_else(|| missing("NotificationRequestItem"))?;
            (
                text(item, "/eventCode").as_deref() == Some("AUTHORISATION")
                    && text(item, "/success").as_deref() == Some("true"),
                text(item, "/merchantReference"),
                // Signed fields only reach the handler: `additionalData`
                // (`shopperReference`) is not signed.
                text(item, "/merchantAccountCode"),
                int(item, "/amount/value"),
            )
        }
        _ => (
            true,
            text(&v, "/out_trade_no"),
            text(&v, "/account"),
            int(&v, "/amount"),
        ),
    };
    if !settled {
        return Ok(None);
    }
    let payment = Payment {
        out_trade_no: out_trade_no.ok_or_else(|| missing("out_trade_no"))?,
        account: account.ok_or_else(|| missing("account"))?,
        amount: amount.ok_or_else(|| missing("amount"))?,
    };
    if payment.amount <= 0 {
        return Err(AppError::BadInput("amount must be positive".into()));
    }
    Ok(Some(payment))
}

/// `"88.88"` yuan as 8888 fen; `None` for anything but up to two decimals.
fn yuan_to_fen(yuan: &str) -> Option<i64> {
    let (whole, frac) = yuan.split_once('.').unwrap_or((yuan, ""));
    if frac.len() > 2 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let frac: i64 = format!("{frac:0<2}").parse().ok()?;
    whole
        .parse::<i64>()
        .ok()?
        .checked_mul(100)?
        .checked_add(frac)
}

/// The `POST /orders` layer (`Idempotency-Key`) of [`router`]'s app, from
/// the engine builder the caller configured (`|e| orders_layer(e.optimistic(true))`).
pub fn orders_layer<S: onceonly::SqlStore>(
    engine: onceonly::EngineBuilder<S>,
) -> onceonly::http::IdempotencyLayerBuilder<S> {
    onceonly::http::IdempotencyLayer::idempotency_key(engine, "orders")
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
            use super::{AppError, NewRefund, Notify, RefundApi, parse_payment};

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

            /// The callback of a payment provider: books a settled payment
            /// once; the layer answers in the provider's format.
            async fn provider_callback(
                tx: Tx<$db>,
                provider: &'static str,
                body: Bytes,
            ) -> Result<StatusCode, AppError> {
                let Some(payment) = super::provider_payment(provider, &body)? else {
                    return Ok(StatusCode::OK);
                };
                let mut tx = tx.lock().await?;
                ledger::record(&mut *tx, &payment).await?;
                Ok(StatusCode::OK)
            }

            /// `POST /webhooks/payments` verified, keyed and answered as
            /// `provider` does ([`IdempotencyLayer::provider`]), fenced per
            /// payment if `fence` is set, and `POST /orders` (`Idempotency-Key`).
            pub fn provider_router(
                store: $store,
                provider: onceonly::http::providers::Provider,
                fence: Option<onceonly::FenceSpec>,
            ) -> Result<Router, HttpBuildError> {
                let name = provider.name();
                let callback = move |tx: Tx<$db>, body: Bytes| provider_callback(tx, name, body);
                let mut engine = onceonly::Engine::builder(store.clone());
                if let Some(fence) = fence {
                    engine = engine.fence(fence);
                }
                let callbacks =
                    IdempotencyLayer::provider(engine, "payment-callbacks", provider).build()?;
                let orders = IdempotencyLayer::idempotency_key(store, "orders").build()?;
                Ok(Router::new()
                    .route("/webhooks/payments", post(callback).layer(callbacks))
                    .route("/orders", post(order).layer(orders)))
            }

            /// Creates the tables (dedup, ledger, accounts, orders, refunds).
            pub async fn migrate(store: &$store) -> Result<(), Box<dyn std::error::Error>> {
                store.migrate().await?;
                ledger::create_tables(store.pool()).await?;
                ledger::create_orders_table(store.pool()).await?;
                sqlx::query(
                    "CREATE TABLE IF NOT EXISTS refunds (idem_key TEXT PRIMARY KEY, \
                     payment TEXT NOT NULL, amount BIGINT NOT NULL, provider_refund TEXT NOT NULL)",
                )
                .execute(store.pool())
                .await?;
                Ok(())
            }

            /// `POST /refunds`: refunds a payment at the provider's API,
            /// through a step (the call is made once per key, whatever
            /// dies when), and books the refund in the same transaction as
            /// the claim. `201` with the provider's refund id.
            async fn refund(
                tx: Tx<$db>,
                api: RefundApi,
                headers: HeaderMap,
                Json(new): Json<NewRefund>,
            ) -> Result<(StatusCode, Json<serde_json::Value>), AppError> {
                if new.amount <= 0 {
                    return Err(AppError::BadInput("amount must be positive".into()));
                }
                let body = serde_json::json!({ "payment": new.payment, "amount": new.amount });
                let answer: serde_json::Value = tx
                    .step("refund", |key| async move {
                        let sent = api
                            .client
                            .post(format!("{}/v1/refunds", api.url))
                            .header("Idempotency-Key", key)
                            .json(&body)
                            .timeout(std::time::Duration::from_secs(5))
                            .send()
                            .await
                            .map_err(onceonly::HandlerError::retryable)?;
                        if !sent.status().is_success() {
                            let status = sent.status();
                            return Err(onceonly::HandlerError::retryable(format!(
                                "the refund API answered {status}"
                            )));
                        }
                        sent.json().await.map_err(onceonly::HandlerError::retryable)
                    })
                    .await
                    .map_err(AppError::Step)?;
                let provider_refund = answer["id"].as_str().unwrap_or_default().to_owned();
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let mut conn = tx.lock().await?;
                sqlx::query(
                    "INSERT INTO refunds (idem_key, payment, amount, provider_refund) \
                     VALUES ($1, $2, $3, $4)",
                )
                .bind(&key)
                .bind(&new.payment)
                .bind(new.amount)
                .bind(&provider_refund)
                .execute(&mut *conn)
                .await?;
                let booked = serde_json::json!({
                    "payment": new.payment,
                    "amount": new.amount,
                    "provider_refund": provider_refund,
                });
                Ok((StatusCode::CREATED, Json(booked)))
            }

            /// `POST /refunds` (`Idempotency-Key`), calling `api`; the
            /// downstream keys it sends are keyed with `secret`.
            pub fn refund_router(
                store: $store,
                api: RefundApi,
                secret: &str,
            ) -> Result<Router, HttpBuildError> {
                let refunds = IdempotencyLayer::idempotency_key(onceonly::Engine::builder(store).downstream_secret(secret.as_bytes()), "refunds")
                    .build()?;
                let route = move |tx: Tx<$db>, headers: HeaderMap, body: Json<NewRefund>| {
                    refund(tx, api.clone(), headers, body)
                };
                Ok(Router::new().route("/refunds", post(route).layer(refunds)))
            }

            /// `POST /webhooks/payments` (callback mode, signature checked
            /// if `secret` is set) and `POST /orders` (`Idempotency-Key`);
            /// `orders` adjusts the order route's layer (tests use it).
            pub fn router(
                store: $store,
                secret: Option<String>,
                orders: impl FnOnce(onceonly::EngineBuilder<$store>) -> IdempotencyLayerBuilder<$store>,
            ) -> Result<Router, HttpBuildError> {
                router_notifying(store, secret, None, orders)
            }

            /// [`router`], and with `notify` set, each processed payment
            /// callback also enqueues its merchant notification.
            pub fn router_notifying(
                store: $store,
                secret: Option<String>,
                notify: Option<Notify<$db>>,
                orders: impl FnOnce(onceonly::EngineBuilder<$store>) -> IdempotencyLayerBuilder<$store>,
            ) -> Result<Router, HttpBuildError> {
                let notify = notify.map(Arc::new);
                let callback = move |tx: Tx<$db>, headers: HeaderMap, body: Bytes| {
                    payment(tx, headers, body, notify.clone())
                };
                let mut callbacks = IdempotencyLayer::payment_callback(
                    onceonly::Engine::builder(store.clone()).fingerprint(FingerprintSpec::Fields(vec![
                        "/account".into(),
                        "/amount".into(),
                    ])),
                    "payment-callbacks",
                    "json:/out_trade_no",
                    Ack::plain_success(),
                );
                // A repeated notification may differ in fields such as
                // `notify_time`, never in who is paid how much: those are
                // fingerprinted, and a tampered one gets 422.
                if let Some(secret) = secret {
                    callbacks = callbacks.signature(SignatureCheck::new(secret)?);
                }
                let orders = orders(onceonly::Engine::builder(store)).build()?;
                Ok(Router::new()
                    .route("/webhooks/payments", post(callback).layer(callbacks.build()?))
                    .route("/orders", post(order).layer(orders)))
            }
        }
    };
}

webhook_app!(sqlite, sqlx::Sqlite, onceonly::SqliteStore, sqlite);
webhook_app!(postgres, sqlx::Postgres, onceonly::PgStore, postgres);
