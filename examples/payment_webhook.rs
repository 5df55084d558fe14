//! An HTTP server whose payment callbacks and order creation are
//! idempotent, inside each handler's own transaction.
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
//! ```text
//! cargo run --example payment_webhook --features http,sqlite -- --help
//! cargo run --example payment_webhook --features http,sqlite
//! curl -i localhost:3000/orders -H 'Idempotency-Key: 4b1e...' -H 'content-type: application/json' \
//!      -d '{"account":"alice","amount":500}'
//! ```
//!
//! `--metrics-addr 127.0.0.1:9464` (or `ONCEONLY_METRICS_ADDR`) serves
//! Prometheus metrics (see `onceonly::telemetry`) at that address.

#[path = "support/ledger.rs"]
mod ledger;
#[path = "support/metrics.rs"]
mod metrics_endpoint;
#[path = "support/webhook_app.rs"]
mod webhook_app;

use clap::Parser;

/// Idempotent payment callbacks and order creation over HTTP.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "LISTEN", default_value = "127.0.0.1:3000")]
    listen: String,
    /// Database URL: an SQLite file (`sqlite://payment_webhook.db`, the
    /// default, in the working directory) or, with the `postgres` feature,
    /// `postgres://...`.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://payment_webhook.db"
    )]
    database_url: String,
    /// Shared secret: enables HMAC signature checks on the callback route.
    #[arg(long, env = "WEBHOOK_SECRET")]
    secret: Option<String>,
    #[command(flatten)]
    metrics: metrics_endpoint::MetricsArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let args = Args::parse();
    args.metrics.install()?;
    let app = if args.database_url.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            let store = onceonly::PgStore::connect(&args.database_url).await?;
            webhook_app::postgres::migrate(&store).await?;
            webhook_app::postgres::router(store, args.secret, |b| b)?
        }
        #[cfg(not(feature = "postgres"))]
        return Err("this build has no postgres feature: --features http,sqlite,postgres".into());
    } else {
        let path = args
            .database_url
            .strip_prefix("sqlite://")
            .unwrap_or(&args.database_url);
        let store = onceonly::SqliteStore::open(path).await?;
        webhook_app::sqlite::migrate(&store).await?;
        webhook_app::sqlite::router(store, args.secret, |b| b)?
    };
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
