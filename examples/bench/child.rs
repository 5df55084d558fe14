//! The child processes: this binary with `--child <json spec>` runs one
//! consumer or HTTP server, prints `ready` on stdout once it is set up, and
//! stops gracefully when its stdin closes. Running them apart from the
//! producer lets the parent read the consumer's own peak RSS.

use onceonly::{Delivery, Handler, HandlerError, Json};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Postgres};
use tokio_util::sync::CancellationToken;

use super::common::Res;
use super::ledger::Payment;

/// What a child runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChildSpec {
    /// Kafka consumer: plain rdkafka (`dedup: false`) or onceonly.
    Kafka {
        dedup: bool,
        brokers: String,
        topic: String,
        group: String,
        db_url: String,
        batch: usize,
    },
    /// AMQP consumer: plain lapin (`dedup: false`) or onceonly.
    Amqp {
        dedup: bool,
        url: String,
        queue: String,
        db_url: String,
        prefetch: u16,
        concurrency: usize,
    },
    /// HTTP server for `POST /orders`.
    Http {
        server: super::http::Server,
        db_url: String,
        sqlite_path: String,
        redis_url: String,
        redis_prefix: String,
    },
}

/// Runs the child described by `spec` until its stdin closes.
pub async fn run(spec: &str) -> Res<()> {
    let spec: ChildSpec = serde_json::from_str(spec)?;
    let stop = CancellationToken::new();
    let on_eof = stop.clone();
    // A plain thread: stdin reads block.
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        while let Ok(n) = std::io::Read::read(&mut stdin, &mut buf) {
            if n == 0 {
                break;
            }
        }
        on_eof.cancel();
    });
    match spec {
        ChildSpec::Kafka {
            dedup,
            brokers,
            topic,
            group,
            db_url,
            batch,
        } => super::kafka::consume(dedup, &brokers, &topic, &group, &db_url, batch, stop).await,
        ChildSpec::Amqp {
            dedup,
            url,
            queue,
            db_url,
            prefetch,
            concurrency,
        } => super::amqp::consume(dedup, &url, &queue, &db_url, prefetch, concurrency, stop).await,
        ChildSpec::Http {
            server,
            db_url,
            sqlite_path,
            redis_url,
            redis_prefix,
        } => {
            super::http::serve(
                server,
                &db_url,
                &sqlite_path,
                &redis_url,
                &redis_prefix,
                stop,
            )
            .await
        }
    }
}

/// A consumer message: a payment plus its send time.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Msg {
    pub out_trade_no: String,
    pub account: String,
    pub amount: i64,
    pub sent_us: i64,
}

/// The business write of every consumer, baseline or not: a ledger row, the
/// account balance, and the send time for the observer, in the caller's
/// transaction.
pub async fn business_write(conn: &mut PgConnection, m: &Msg) -> sqlx::Result<()> {
    let p = Payment {
        out_trade_no: m.out_trade_no.clone(),
        account: m.account.clone(),
        amount: m.amount,
    };
    super::ledger::postgres::record(conn, &p).await?;
    sqlx::query("INSERT INTO seen (sent_us) VALUES ($1)")
        .bind(m.sent_us)
        .execute(conn)
        .await?;
    Ok(())
}

/// The onceonly handler: the same business write inside the claim's transaction.
pub struct BenchLedger;

#[async_trait::async_trait]
impl Handler<Postgres> for BenchLedger {
    type Input = Json<Msg>;
    type Output = u8;

    async fn handle(
        &self,
        conn: &mut PgConnection,
        Json(m): Json<Msg>,
        _delivery: &Delivery,
    ) -> Result<u8, HandlerError> {
        business_write(conn, &m).await?;
        Ok(1)
    }
}
