//! HTTP `POST /orders`: a plain axum handler (one transaction per request)
//! vs the same handler behind `IdempotencyLayer` on Postgres, on SQLite and
//! on the Redis two-tier (`CachedStore` in front of Postgres). The client is
//! a keep-alive reqwest pool at a fixed concurrency in this process; the
//! server is a child process.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Json, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use onceonly::http::{IdempotencyLayer, Tx};
use onceonly::redis::CachedStore;
use onceonly::{SqlStore, SqliteStore};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, Sqlite, SqlitePool};
use tokio_util::sync::CancellationToken;

use super::child::ChildSpec;
use super::common::{
    Against, Bench, Child, Measured, Plan, RATIO_COLUMNS, Res, RunResult, account_of, best_rate,
    business_tables, columns, pool,
};
use super::inbox::{self, Form};
use super::ledger::{NewOrder, Order};
use super::stats::Table;

/// The server variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Server {
    BaselinePg,
    InboxPg(Form),
    OnceonlyPgOptimistic,
    OnceonlyPgStatements,
    OnceonlyRedis,
    BaselineSqlite,
    OnceonlySqlite,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Self::BaselinePg => "baseline, Postgres (no dedup)",
            Self::InboxPg(form) => form.name(),
            Self::OnceonlyPgOptimistic => "onceonly, Postgres (optimistic)",
            Self::OnceonlyPgStatements => "onceonly, Postgres (default: a statement per step)",
            Self::OnceonlyRedis => "onceonly, Redis two-tier + Postgres",
            Self::BaselineSqlite => "baseline, SQLite (no dedup)",
            Self::OnceonlySqlite => "onceonly, SQLite",
        }
    }

    fn dedup(self) -> bool {
        !matches!(self, Self::BaselinePg | Self::BaselineSqlite)
    }

    fn sqlite(self) -> bool {
        matches!(self, Self::BaselineSqlite | Self::OnceonlySqlite)
    }
}

const SERVERS: [Server; 8] = [
    Server::BaselinePg,
    Server::InboxPg(Form::ClaimFirst),
    Server::InboxPg(Form::ClaimLast),
    Server::OnceonlyPgStatements,
    Server::OnceonlyPgOptimistic,
    Server::OnceonlyRedis,
    Server::BaselineSqlite,
    Server::OnceonlySqlite,
];

pub async fn run(b: &mut Bench) -> Res<()> {
    for dup in b.dups.clone() {
        let mut first = vec!["server", "req/s", "p50", "p99", "peak RSS"];
        first.extend(RATIO_COLUMNS);
        let mut table = Table::new(
            format!(
                "HTTP POST /orders ({} requests, {} keep-alive clients, {dup}% duplicates = retried Idempotency-Keys; ratios against the same database)",
                b.sizes.requests, b.sizes.http_clients
            ),
            &columns(&first, "requests / orders rows / distinct keys"),
        );
        // Runs interleave the servers, so drifting load on the shared
        // machine hits all alike.
        let mut results: Vec<Vec<RunResult>> = SERVERS.iter().map(|_| Vec::new()).collect();
        let inline = b.inline_counts();
        for r in 0..b.runs {
            for (v, server) in SERVERS.into_iter().enumerate() {
                results[v].push(one_run(b, server, dup, 3000 + r as u64, inline).await?);
            }
        }
        // The counted run (SQLite has no database round trips).
        let mut counted: Vec<Option<RunResult>> = SERVERS.iter().map(|_| None).collect();
        if b.counted_pass() {
            for (v, server) in SERVERS.into_iter().enumerate() {
                if !server.sqlite() {
                    counted[v] = Some(one_run(b, server, dup, 3999, true).await?);
                }
            }
        }
        let measured: Vec<(Server, Measured)> = SERVERS
            .into_iter()
            .zip(results)
            .zip(counted)
            .map(|((server, runs), counted)| (server, Measured::combine(&runs, counted.as_ref())))
            .collect();
        let base_pg = best_rate(&measured, |s| s == Server::BaselinePg);
        let base_sqlite = best_rate(&measured, |s| s == Server::BaselineSqlite);
        let inbox = best_rate(&measured, |s| matches!(s, Server::InboxPg(_)));
        for (server, m) in &measured {
            let server = *server;
            let against = Against {
                baseline: if server.sqlite() {
                    base_sqlite
                } else {
                    base_pg
                },
                inbox: (!server.sqlite()).then_some(inbox).flatten(),
                is_baseline: !server.dedup(),
            };
            let mut cells = vec![server.name().to_owned()];
            cells.extend(m.cells(against));
            table.row(cells);
            let goals: &[(Server, &str, f64, f64)] = &[
                (Server::OnceonlyPgStatements, "default", 0.78, 1.0),
                (Server::OnceonlyPgOptimistic, "optimistic", 0.0, 1.0),
            ];
            for &(s, what, vs_base, vs_inbox) in goals {
                // The goals are stated at 0 and 90 %.
                if s != server || dup == 20 {
                    continue;
                }
                let (Some(bl), Some(ib)) = (base_pg, inbox) else {
                    continue;
                };
                let dup_goal = if dup >= 90 { 1.5 } else { vs_inbox };
                let (r_base, r_inbox) = (m.rate / bl, m.rate / ib);
                b.target(
                    &format!("HTTP {what} vs best hand-written inbox, {dup}% dup"),
                    format!("{r_inbox:.2}× ({:.0} vs {ib:.0} req/s)", m.rate),
                    &format!("≥ {dup_goal:.1}×"),
                    r_inbox >= dup_goal,
                );
                if vs_base > 0.0 && dup == 0 {
                    b.target(
                        &format!("HTTP {what} vs no dedup, {dup}% dup"),
                        format!("{r_base:.2}× ({:.0} vs {bl:.0} req/s)", m.rate),
                        &format!("≥ {vs_base:.2}×"),
                        r_base >= vs_base,
                    );
                }
            }
        }
        b.table(table);
    }
    Ok(())
}

async fn one_run(
    b: &mut Bench,
    server: Server,
    dup: u32,
    seed: u64,
    counted: bool,
) -> Res<RunResult> {
    let schema = b.schema("http").await?;
    let client = b.db_client(&schema.url, counted && !server.sqlite())?;
    let dir = tempfile::tempdir()?;
    let sqlite_path = dir.path().join("bench.db").display().to_string();
    let prefix = format!("{}:", b.unique("http"));
    let result = async {
        let db = pool(&schema.url, 2).await?;
        business_tables(&db).await?;
        let child = Child::spawn(&ChildSpec::Http {
            server,
            db_url: client.url.clone(),
            sqlite_path: sqlite_path.clone(),
            redis_url: b.services.redis_url.clone(),
            redis_prefix: prefix.clone(),
        })
        .await?;
        let url = format!("http://127.0.0.1:{}/orders", child.ready);
        let plan = Plan::new(b.sizes.requests, dup, &prefix, seed);
        let window = b.window(&child, &client).await?;
        let (rate, latencies, failures) = load(&url, &plan.keys, b.sizes.http_clients).await?;
        let mut cost = b.close_window(window, plan.keys.len()).await?;
        if server.sqlite() {
            // In-process: the database's CPU is the server's.
            cost.db_cpu = None;
        }
        let rss_mib = child.peak_rss_mib();
        child.stop().await?;
        let rows: i64 = if server.sqlite() {
            let lite = SqlitePool::connect(&format!("sqlite://{sqlite_path}")).await?;
            let n = sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                .fetch_one(&lite)
                .await?;
            lite.close().await;
            n
        } else {
            sqlx::query_scalar("SELECT COUNT(*) FROM orders")
                .fetch_one(&db)
                .await?
        };
        Ok::<_, super::common::BoxError>((
            RunResult {
                rate,
                latencies,
                rss_mib,
                rows,
                distinct: plan.distinct as i64,
                messages: plan.keys.len(),
                cost,
            },
            failures,
        ))
    }
    .await;
    b.drop_schema(&schema).await;
    if server == Server::OnceonlyRedis
        && let Err(e) = forget_redis_keys(&b.services.redis_url, &prefix).await
    {
        eprintln!("removing the Redis keys {prefix}*: {e}");
    }
    let (run, failures) = result?;
    let name = server.name();
    b.check(failures.is_empty(), || {
        format!("http {name}: failed requests: {failures:?}")
    });
    let expected = if server.dedup() {
        run.distinct
    } else {
        run.messages as i64
    };
    b.check(run.rows == expected, || {
        format!("http {name}: {} orders rows, expected {expected}", run.rows)
    });
    Ok(run)
}

/// Deletes the run's cache entries (they would live for the retention).
async fn forget_redis_keys(url: &str, prefix: &str) -> Res<()> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// Sends one request per key from `clients` concurrent keep-alive clients;
/// a `409` (the same key still in flight) is retried after 5 ms, as a
/// client would. Returns requests/s, sorted latencies (first send to final
/// answer) and the unexpected answers.
async fn load(
    url: &str,
    keys: &[String],
    clients: usize,
) -> Res<(f64, Vec<Duration>, Vec<String>)> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .timeout(Duration::from_secs(30))
        .build()?;
    let keys: Arc<Vec<String>> = Arc::new(keys.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients.max(1) {
        let (client, keys, next, url) =
            (client.clone(), keys.clone(), next.clone(), url.to_owned());
        tasks.spawn(async move {
            let mut lat = Vec::new();
            let mut bad = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(key) = keys.get(i) else { break };
                let body = serde_json::json!({"account": account_of(key), "amount": 1});
                let t = Instant::now();
                loop {
                    let resp = client
                        .post(&url)
                        .header("Idempotency-Key", key.as_str())
                        .json(&body)
                        .send()
                        .await;
                    match resp {
                        Ok(r) if r.status().is_success() => {
                            let _ = r.bytes().await;
                            break;
                        }
                        Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => {
                            let _ = r.bytes().await;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Ok(r) => {
                            let status = r.status();
                            let text = r.text().await.unwrap_or_default();
                            bad.push(format!("{status}: {text}"));
                            break;
                        }
                        Err(e) => {
                            bad.push(e.to_string());
                            break;
                        }
                    }
                }
                lat.push(t.elapsed());
            }
            (lat, bad)
        });
    }
    let mut latencies = Vec::with_capacity(keys.len());
    let mut failures = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (lat, bad) = done?;
        latencies.extend(lat);
        failures.extend(bad);
    }
    let rate = keys.len() as f64 / started.elapsed().as_secs_f64();
    latencies.sort();
    failures.truncate(5);
    Ok((rate, latencies, failures))
}

/// Errors of the handlers: `500`, rolled back.
fn internal(e: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

type Answer = Result<(StatusCode, Json<Order>), (StatusCode, String)>;

async fn baseline_pg(State(db): State<PgPool>, Json(new): Json<NewOrder>) -> Answer {
    let mut tx = db.begin().await.map_err(internal)?;
    let order = super::ledger::postgres::insert_order(&mut tx, &new)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    Ok((StatusCode::CREATED, Json(order)))
}

/// The hand-written inbox's answers: the order, or the stored one of a key
/// claimed before (`409` while a copy is in flight, which the client
/// retries).
type InboxAnswer = Result<(StatusCode, Vec<u8>), (StatusCode, String)>;

/// `POST /orders` with the hand-written inbox (see [`inbox`]), as a
/// careful user would write it on plain sqlx.
async fn inbox_pg(
    State((db, form)): State<(PgPool, Form)>,
    headers: HeaderMap,
    Json(new): Json<NewOrder>,
) -> InboxAnswer {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty() && k.len() <= 128)
        .ok_or((
            StatusCode::BAD_REQUEST,
            "Idempotency-Key missing".to_owned(),
        ))?
        .to_owned();
    let mut tx = db.begin().await.map_err(internal)?;
    let new_key = match form {
        Form::ClaimFirst => {
            if inbox::claim(&mut tx, &key, 0).await.map_err(internal)? {
                let order = super::ledger::postgres::insert_order(&mut tx, &new)
                    .await
                    .map_err(internal)?;
                let body = serde_json::to_vec(&order).map_err(internal)?;
                inbox::record(&mut tx, &key, &body)
                    .await
                    .map_err(internal)?;
                Some(body)
            } else {
                None
            }
        }
        Form::ClaimLast => {
            let order = super::ledger::postgres::insert_order(&mut tx, &new)
                .await
                .map_err(internal)?;
            let body = serde_json::to_vec(&order).map_err(internal)?;
            inbox::claim_done(&mut tx, &key, Some(&body))
                .await
                .map_err(internal)?
                .then_some(body)
        }
    };
    match new_key {
        Some(body) => {
            tx.commit().await.map_err(internal)?;
            Ok((StatusCode::CREATED, body))
        }
        None => {
            tx.rollback().await.map_err(internal)?;
            match inbox::stored(&db, &key).await.map_err(internal)? {
                Some(body) => Ok((StatusCode::CREATED, body)),
                None => Err((StatusCode::CONFLICT, "in flight".to_owned())),
            }
        }
    }
}

async fn baseline_sqlite(State(db): State<SqlitePool>, Json(new): Json<NewOrder>) -> Answer {
    let mut tx = db.begin().await.map_err(internal)?;
    let order = super::ledger::sqlite::insert_order(&mut tx, &new)
        .await
        .map_err(internal)?;
    tx.commit().await.map_err(internal)?;
    Ok((StatusCode::CREATED, Json(order)))
}

async fn onceonly_pg(tx: Tx<Postgres>, Json(new): Json<NewOrder>) -> Answer {
    let mut tx = tx.lock().await.map_err(internal)?;
    let order = super::ledger::postgres::insert_order(&mut tx, &new)
        .await
        .map_err(internal)?;
    Ok((StatusCode::CREATED, Json(order)))
}

async fn onceonly_sqlite(tx: Tx<Sqlite>, Json(new): Json<NewOrder>) -> Answer {
    let mut tx = tx.lock().await.map_err(internal)?;
    let order = super::ledger::sqlite::insert_order(&mut tx, &new)
        .await
        .map_err(internal)?;
    Ok((StatusCode::CREATED, Json(order)))
}

/// The server child: prints `ready <port>` and serves until `stop`.
pub async fn serve(
    server: Server,
    db_url: &str,
    sqlite_path: &str,
    redis_url: &str,
    redis_prefix: &str,
    stop: CancellationToken,
) -> Res<()> {
    let app = match server {
        Server::BaselinePg => Router::new()
            .route("/orders", post(baseline_pg))
            .with_state(pool(db_url, 10).await?),
        Server::InboxPg(form) => Router::new()
            .route("/orders", post(inbox_pg))
            .with_state((pool(db_url, 10).await?, form)),
        Server::OnceonlyPgOptimistic | Server::OnceonlyPgStatements => {
            let optimistic = server == Server::OnceonlyPgOptimistic || super::variant::optimistic();
            let store = super::variant::pg_store(db_url, false).await?;
            store.migrate().await?;
            let mut engine = onceonly::Engine::builder(store).optimistic(optimistic);
            if let Some(fence) = super::variant::fence() {
                engine = engine.fence(fence);
            }
            let layer = IdempotencyLayer::idempotency_key(engine, "orders").build()?;
            Router::new().route("/orders", post(onceonly_pg).layer(layer))
        }
        Server::OnceonlyRedis => {
            let sql = super::variant::pg_store(db_url, false).await?;
            sql.migrate().await?;
            let store = CachedStore::connect(sql, redis_url)?.with_prefix(redis_prefix);
            let layer = IdempotencyLayer::idempotency_key(
                onceonly::Engine::builder(store).optimistic(super::variant::optimistic()),
                "orders",
            )
            .build()?;
            Router::new().route("/orders", post(onceonly_pg).layer(layer))
        }
        Server::BaselineSqlite | Server::OnceonlySqlite => {
            let store = SqliteStore::open(sqlite_path).await?;
            store.migrate().await?;
            super::ledger::sqlite::create_orders_table(store.pool()).await?;
            if server == Server::BaselineSqlite {
                Router::new()
                    .route("/orders", post(baseline_sqlite))
                    .with_state(store.pool().clone())
            } else {
                let layer = IdempotencyLayer::idempotency_key(
                    onceonly::Engine::builder(store).optimistic(super::variant::optimistic()),
                    "orders",
                )
                .build()?;
                Router::new().route("/orders", post(onceonly_sqlite).layer(layer))
            }
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("ready {}", listener.local_addr()?.port());
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await?;
    Ok(())
}
