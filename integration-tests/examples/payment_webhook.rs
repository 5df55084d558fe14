//! An HTTP server whose payment callbacks and order creation are
//! idempotent, inside each handler's own transaction.
//!
//! A demo application of the integration tests, which run it as a child
//! process: many options in one program, every one of them tested. For
//! one small example per use, see `examples/` at the repository root.
//!
//! - `POST /webhooks/payments`: a payment provider's notification, JSON or
//!   form-encoded, like the Kafka example's messages (`out_trade_no`,
//!   `account`, `amount`). Keyed on `out_trade_no`; credits the shared
//!   `ledger` / `accounts` tables once; answers `success`, and a repeated
//!   notification gets `success` again without touching the ledger. With
//!   `--secret`, an `X-Signature: t=<unix>,v1=<hex HMAC-SHA256 of
//!   "<t>.<body>">` header is required (401 otherwise).
//! - `POST /orders` with an `Idempotency-Key` header and
//!   `{"account": string, "amount": integer}`: creates an order (201 with the
//!   order as JSON); a retry with the same key replays that response byte
//!   for byte with `Idempotent-Replayed: true`.
//!
//! `--provider alipay|wechatpay|stripe|github|adyen` verifies the callbacks
//! as that provider signs them instead (see `onceonly::http::providers`),
//! keys them on the provider's business field and answers in its format.
//! Keys come from flags or the environment: `--provider-secret`
//! (`PROVIDER_SECRET`: Stripe's or GitHub's signing secret, Adyen's hex
//! HMAC key, WeChat Pay's APIv3 key) and `--provider-key FILE`
//! (`PROVIDER_KEYS`, comma-separated: Alipay's public key, PEM or bare
//! base64; WeChat Pay platform certificates, PEM, or `SERIAL=FILE` for a
//! WeChat Pay public key; repeat for rotation).
//!
//! ```text
//! cargo run --example payment_webhook --features http,sqlite -- \
//!     --provider wechatpay --provider-secret "$APIV3_KEY" \
//!     --provider-key wechatpay_cert_old.pem --provider-key wechatpay_cert_new.pem
//! ```
//!
//! `--notify-url URL` (or `NOTIFY_URL`) also notifies the merchant of each
//! processed payment: the callback's transaction enqueues a JSON body
//! `{"out_trade_no", "account", "amount", "balance"}` in the transactional
//! outbox (`onceonly::outbox`, table `onceonly_outbox`), and a relay
//! running in the same process POSTs it to URL once the transaction
//! committed, signed with `--notify-secret` (or `NOTIFY_SECRET`, default
//! `onceonly-example-secret`) as Standard Webhooks
//! (`webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64
//! HMAC-SHA256 of "<id>.<timestamp>.<body>">`).
//! Redelivered notifications carry the same `x-onceonly-message-id`.
//!
//! ```text
//! cargo run --example payment_webhook --features http,sqlite -- --help
//! cargo run --example payment_webhook --features http,sqlite
//! cargo run --example payment_webhook --features http,sqlite -- \
//!     --notify-url http://127.0.0.1:8080/notify
//! curl -i localhost:3000/orders -H 'Idempotency-Key: 4b1e...' -H 'content-type: application/json' \
//!      -d '{"account":"alice","amount":500}'
//! ```
//!
//! - `POST /refunds` with an `Idempotency-Key` header and
//!   `{"payment": string, "amount": integer}`: refunds the payment at the
//!   provider's API (`--refund-api URL`, `POST URL/v1/refunds`) through a
//!   step (`Tx::step`): the call is recorded as soon as it returned, so a
//!   retry after a crash before the `COMMIT` books the refund without
//!   calling again, and a call that never finished is sent again with the
//!   same downstream `Idempotency-Key`. PostgreSQL only (SQLite has one
//!   writer: a step cannot commit beside the open claim).
//!
//! `--metrics-addr 127.0.0.1:9464` (or `ONCEONLY_METRICS_ADDR`) serves
//! Prometheus metrics (see `onceonly::telemetry`) at that address.

use clap::Parser;
use onceonly::outbox::{OutboxBackend, RelayHandle as Relay};
use onceonly_integration_tests::demo::{metrics as metrics_endpoint, tracing_setup, webhook_app};

/// Idempotent payment callbacks and order creation over HTTP.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "LISTEN", default_value = "127.0.0.1:3000")]
    listen: String,
    /// Database URL, as sqlx reads it: an SQLite file
    /// (`sqlite://payment_webhook.db?mode=rwc`, the default, created in the
    /// working directory if missing) or `postgres://...`.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://payment_webhook.db?mode=rwc"
    )]
    database_url: String,
    /// Shared secret: enables HMAC signature checks on the callback route.
    #[arg(long, env = "WEBHOOK_SECRET")]
    secret: Option<String>,
    /// Optimistic claims on `POST /orders`: the key looked up first, the
    /// handler run, then the key claimed with the response before `COMMIT`
    /// (`IdempotencyLayerBuilder::optimistic`).
    #[arg(long, env = "OPTIMISTIC", value_parser = clap::builder::BoolishValueParser::new())]
    optimistic: bool,
    /// Verify, key and answer callbacks as this payment provider does
    /// (instead of `--secret`).
    #[arg(long, env = "PROVIDER", value_parser = ["alipay", "wechatpay", "stripe", "github", "adyen"])]
    provider: Option<String>,
    /// The provider's secret: Stripe's or GitHub's signing secret, Adyen's
    /// HMAC key (hex), WeChat Pay's APIv3 key.
    #[arg(long, env = "PROVIDER_SECRET")]
    provider_secret: Option<String>,
    /// A file with a provider key: Alipay's public key (PEM or bare
    /// base64), a WeChat Pay platform certificate (PEM), or `SERIAL=FILE`
    /// for a WeChat Pay public key. Repeatable.
    #[arg(long = "provider-key", env = "PROVIDER_KEYS", value_delimiter = ',')]
    provider_keys: Vec<String>,
    /// Fence each payment against out-of-order callbacks with the
    /// provider's preset (`FenceSpec::stripe()`, ...): a callback older
    /// than one applied before to the same payment is acknowledged as
    /// stale without booking it.
    #[arg(long, env = "FENCE", value_parser = clap::builder::BoolishValueParser::new())]
    fence: bool,
    /// Notify the merchant of each processed payment at this URL, through the
    /// transactional outbox and an in-process relay (off when not given).
    #[arg(long, env = "NOTIFY_URL", value_name = "URL")]
    notify_url: Option<String>,
    /// Secret the notifications are signed with (Standard Webhooks,
    /// HMAC-SHA256).
    #[arg(
        long,
        env = "NOTIFY_SECRET",
        default_value = "whsec_b25jZW9ubHktZXhhbXBsZS1ub3RpZnktc2VjcmV0IQ"
    )]
    notify_secret: String,
    /// The provider API `POST /refunds` calls (`URL/v1/refunds`); the
    /// route is served only when this is set.
    #[arg(long, env = "REFUND_API", value_name = "URL")]
    refund_api: Option<String>,
    /// The secret the refund route's downstream keys are keyed with (at
    /// least 16 bytes; the same on every instance).
    #[arg(
        long,
        env = "DOWNSTREAM_SECRET",
        default_value = "onceonly-example-downstream-secret"
    )]
    downstream_secret: String,
    #[command(flatten)]
    metrics: metrics_endpoint::MetricsArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Logs, and OTLP traces with OTEL_EXPORTER_OTLP_ENDPOINT set.
    let _tracing = tracing_setup::init("payment_webhook");
    let args = Args::parse();
    refuse_idle_flags(&args)?;
    args.metrics.install()?;
    if let Some(provider) = provider_of(&args)? {
        let fence = args.fence.then(|| preset_fence(provider.name())).flatten();
        if args.database_url.starts_with("postgres") {
            let store = onceonly::PgStore::connect(&args.database_url).await?;
            webhook_app::postgres::migrate(&store).await?;
            let app = webhook_app::postgres::provider_router(store, provider, fence)?;
            return serve(&args, app, None).await;
        }
        let store = onceonly::SqliteStore::connect(&args.database_url).await?;
        webhook_app::sqlite::migrate(&store).await?;
        let app = webhook_app::sqlite::provider_router(store, provider, fence)?;
        return serve(&args, app, None).await;
    }
    let (app, relay) = if args.database_url.starts_with("postgres") {
        use onceonly::SqlStore;
        let store = onceonly::PgStore::connect(&args.database_url).await?;
        webhook_app::postgres::migrate(&store).await?;
        let (notify, relay) = notify(&args, store.pool()).await?;
        let optimistic = args.optimistic;
        let mut app = webhook_app::postgres::router_notifying(
            store.clone(),
            args.secret.clone(),
            notify,
            |e| webhook_app::orders_layer(e.optimistic(optimistic)),
        )?;
        if let Some(url) = &args.refund_api {
            let api = webhook_app::RefundApi {
                url: url.clone(),
                client: reqwest::Client::new(),
            };
            let refunds =
                webhook_app::postgres::refund_router(store, api, &args.downstream_secret)?;
            app = app.merge(refunds);
        }
        (app, relay)
    } else {
        let store = onceonly::SqliteStore::connect(&args.database_url).await?;
        webhook_app::sqlite::migrate(&store).await?;
        let (notify, relay) = notify(&args, onceonly::SqlStore::pool(&store)).await?;
        let optimistic = args.optimistic;
        let app = webhook_app::sqlite::router_notifying(store, args.secret.clone(), notify, |e| {
            webhook_app::orders_layer(e.optimistic(optimistic))
        })?;
        (app, relay)
    };
    serve(&args, app, relay).await
}

/// Flags this run would ignore are refused, never silently dropped.
fn refuse_idle_flags(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let postgres = args.database_url.starts_with("postgres");
    let provider = args.provider.is_some();
    if args.refund_api.is_some() && !postgres {
        return Err("--refund-api needs --database-url postgres://… (its steps are recorded beside the claim; SQLite has one writer)".into());
    }
    if args.refund_api.is_some() && provider {
        return Err(
            "--refund-api serves the orders app's refund route: not with --provider".into(),
        );
    }
    if args.fence {
        let Some(name) = args.provider.as_deref() else {
            return Err("--fence fences a provider's callbacks: give --provider".into());
        };
        if preset_fence(name).is_none() {
            return Err(
                format!("--fence: {name} has no fence preset (Adyen signs no event time)").into(),
            );
        }
    }
    Ok(())
}

/// Serves `app` until Ctrl-C, then stops the relay.
async fn serve(
    args: &Args,
    app: axum::Router,
    relay: Option<Relay>,
) -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    if let Some(relay) = relay {
        let stats = relay.stop().await;
        eprintln!("outbox relay: {stats:?}");
    }
    Ok(())
}

/// The fence preset of provider `name`, if it has one.
fn preset_fence(name: &str) -> Option<onceonly::FenceSpec> {
    use onceonly::FenceSpec;
    match name {
        "stripe" => Some(FenceSpec::stripe()),
        "wechatpay" => Some(FenceSpec::wechat_pay()),
        "alipay" => Some(FenceSpec::alipay()),
        // Adyen's `eventDate` is not signed, and the route's payload holds
        // signed fields only: no fence (see `FenceSpec::adyen`).
        _ => None,
    }
}

/// The provider of `--provider`, with its keys.
fn provider_of(
    args: &Args,
) -> Result<Option<onceonly::http::providers::Provider>, Box<dyn std::error::Error>> {
    use onceonly::http::providers::{Adyen, Alipay, GitHub, Stripe, WeChatPay};
    let Some(name) = args.provider.as_deref() else {
        return Ok(None);
    };
    let secret = || {
        args.provider_secret
            .clone()
            .ok_or_else(|| format!("--provider {name} needs --provider-secret"))
    };
    let read = |path: &str| {
        std::fs::read_to_string(path).map_err(|e| format!("--provider-key {path}: {e}"))
    };
    Ok(Some(match name {
        "alipay" => {
            let [path] = args.provider_keys.as_slice() else {
                return Err(
                    "--provider alipay needs one --provider-key (Alipay's public key)".into(),
                );
            };
            Alipay::new(&read(path)?)?.into()
        }
        "wechatpay" => {
            let mut wechat = WeChatPay::new(secret()?)?;
            for key in &args.provider_keys {
                wechat = match key.split_once('=') {
                    Some((serial, path)) => wechat.platform_public_key(serial, &read(path)?)?,
                    None => wechat.platform_certificate(&read(key)?)?,
                };
            }
            wechat.into()
        }
        "stripe" => Stripe::new(secret()?)?.into(),
        "github" => GitHub::new(secret()?)?.into(),
        "adyen" => Adyen::new(&secret()?)?.into(),
        other => return Err(format!("unknown provider {other}").into()),
    }))
}

/// With `--notify-url`: migrates the outbox table and starts the relay
/// that POSTs the notifications.
async fn notify<DB: OutboxBackend>(
    args: &Args,
    pool: &sqlx::Pool<DB>,
) -> Result<(Option<webhook_app::Notify<DB>>, Option<Relay>), Box<dyn std::error::Error>> {
    use onceonly::outbox::{Outbox, Relay, WebhookPublisher};
    let Some(url) = &args.notify_url else {
        return Ok((None, None));
    };
    let outbox = Outbox::<DB>::new();
    outbox.migrate(pool).await?;
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(WebhookPublisher::new(args.notify_secret.as_bytes())?)
        .build()?
        .spawn();
    let notify = webhook_app::Notify {
        outbox,
        url: url.clone(),
    };
    Ok((Some(notify), Some(relay)))
}
