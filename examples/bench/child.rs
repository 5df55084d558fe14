//! The child processes: this binary with `--child <json spec>` runs one
//! consumer or HTTP server, prints `ready` on stdout once it is set up, and
//! stops gracefully when its stdin closes. Running them apart from the
//! producer lets the parent read the consumer's own peak RSS.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
    /// Kafka consumer: plain rdkafka, the hand-written inbox on rdkafka,
    /// or onceonly.
    Kafka(KafkaSpec),
    /// AMQP consumer: plain lapin, the hand-written inbox on lapin, or
    /// onceonly.
    Amqp {
        consumer: Consumer,
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

/// Which consumer a Kafka or AMQP child runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consumer {
    /// The same business writes without dedup (at least once): the floor.
    Baseline,
    /// The hand-written inbox (see [`inbox`](super::inbox)).
    Inbox(super::inbox::Form),
    /// onceonly with its defaults.
    Onceonly,
    /// onceonly, claiming after the handler (`EngineBuilder::optimistic`).
    OnceonlyOptimistic,
}

impl Consumer {
    /// Whether it dedupes (every consumer but the baseline).
    pub fn dedup(self) -> bool {
        self != Self::Baseline
    }

    /// Whether onceonly runs it.
    pub fn onceonly(self) -> bool {
        matches!(self, Self::Onceonly | Self::OnceonlyOptimistic)
    }

    /// The name in the tables.
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline => "baseline (no dedup)",
            Self::Inbox(form) => form.name(),
            Self::Onceonly => "onceonly (default)",
            Self::OnceonlyOptimistic => "onceonly, optimistic",
        }
    }

    /// Whether onceonly claims after the handler (this variant, or every
    /// onceonly consumer with `BENCH_OPTIMISTIC=1`).
    pub fn optimistic(self) -> bool {
        self == Self::OnceonlyOptimistic || super::variant::optimistic()
    }
}

/// A Kafka consumer child.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KafkaSpec {
    /// Which consumer.
    pub consumer: Consumer,
    pub brokers: String,
    pub topic: String,
    pub group: String,
    pub db_url: String,
    /// Records per transaction.
    pub batch: usize,
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
    let started = std::time::Instant::now();
    let result = match spec {
        ChildSpec::Kafka(spec) => super::kafka::consume(&spec, stop).await,
        ChildSpec::Amqp {
            consumer,
            url,
            queue,
            db_url,
            prefetch,
            concurrency,
        } => {
            super::amqp::consume(consumer, &url, &queue, &db_url, prefetch, concurrency, stop).await
        }
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
    };
    if std::env::var_os("BENCH_PROFILE").is_some() {
        let n = WRITES.load(Ordering::Relaxed);
        let busy = Duration::from_nanos(WRITE_NANOS.load(Ordering::Relaxed));
        let commits = Duration::from_nanos(COMMIT_NANOS.load(Ordering::Relaxed));
        eprintln!(
            "profile: {n} business writes took {:.0} ms in all ({:.0} µs each); baseline commits {:.0} ms; child alive {:.0} ms",
            busy.as_secs_f64() * 1e3,
            busy.as_secs_f64() * 1e6 / n.max(1) as f64,
            commits.as_secs_f64() * 1e3,
            started.elapsed().as_secs_f64() * 1e3,
        );
    }
    result
}

/// Business writes made and the time they took (`BENCH_PROFILE=1` prints
/// them when the child stops: a timing breakdown of where the time goes).
static WRITES: AtomicU64 = AtomicU64::new(0);
static WRITE_NANOS: AtomicU64 = AtomicU64::new(0);
/// Time the baseline consumers spent in `COMMIT`.
pub static COMMIT_NANOS: AtomicU64 = AtomicU64::new(0);

/// Adds the time since `t` to a profile counter.
pub fn add_time(counter: &AtomicU64, t: Instant) {
    counter.fetch_add(
        u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
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
    let t = Instant::now();
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
    WRITES.fetch_add(1, Ordering::Relaxed);
    add_time(&WRITE_NANOS, t);
    Ok(())
}

/// The hand-written inbox's consumer transaction for `m` on the open
/// transaction `conn`: its key claimed first (done at once: a consumer
/// has no response to store) or last, around the same business write.
/// Whether the key was new (if not, the caller rolls back: a duplicate).
pub async fn inbox_write(
    conn: &mut PgConnection,
    form: super::inbox::Form,
    m: &Msg,
) -> sqlx::Result<bool> {
    use super::inbox::{Form, claim, claim_done};
    match form {
        Form::ClaimFirst => {
            if !claim(conn, &m.out_trade_no, 1).await? {
                return Ok(false);
            }
            business_write(conn, m).await?;
            Ok(true)
        }
        Form::ClaimLast => {
            business_write(conn, m).await?;
            claim_done(conn, &m.out_trade_no, None).await
        }
    }
}

/// The onceonly handler: the same business write inside the claim's transaction.
pub struct BenchLedger;

#[async_trait::async_trait]
impl Handler<Postgres> for BenchLedger {
    type Input = Json<Msg>;
    type Output = u8;

    async fn handle(
        &self,
        tx: onceonly::Tx<sqlx::Postgres>,
        Json(m): Json<Msg>,
        _delivery: &Delivery,
    ) -> Result<u8, HandlerError> {
        let mut conn = tx.lock().await?;
        business_write(&mut conn, &m).await?;
        Ok(1)
    }
}
