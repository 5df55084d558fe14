//! The `payment_webhook` server SIGKILLed again and again while clients keep
//! retrying their requests with the same `Idempotency-Key` until they get an
//! answer: every key has exactly one effect (one order row), whether the kill
//! landed before the claim, in the handler, or between commit and answer.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use onceonly_integration_tests::child::{Logged, client_lanes};
use onceonly_integration_tests::free_port;
use onceonly_integration_tests::kafka::pg_schema;
use reqwest::Client;
use sqlx::PgPool;

const KEYS: usize = 1_500;

/// Posts order `i` until the server answers 2xx; returns whether the answer
/// that ended it was a replay.
async fn until_answered(c: &Client, base: &str, i: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        assert!(Instant::now() < deadline, "order {i} never answered");
        let sent = c
            .post(format!("{base}/orders"))
            .header("content-type", "application/json")
            .header("Idempotency-Key", format!("kill-{i}"))
            .body(format!(
                r#"{{"account":"acct-{i:04}","amount":{}}}"#,
                100 + i
            ))
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => {
                return r.headers().get("idempotent-replayed").is_some();
            }
            // 409 (the key is still held by a request of the killed
            // server until its connection is gone), 503, or no server.
            _ => tokio::time::sleep(Duration::from_millis(30)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_mid_request_while_clients_retry_makes_one_effect_per_key() {
    let db = pg_schema("httpkill").await;
    let base_url = onceonly_integration_tests::pg_url();
    let pool = PgPool::connect(&db).await.unwrap_or_else(|e| {
        panic!("PostgreSQL is not reachable at {base_url}: {e}; start it with scripts/services")
    });
    let addr = format!("127.0.0.1:{}", free_port());
    let base = format!("http://{addr}");
    let logged = Logged::new("webhook_kill");
    let args = vec![
        "--listen".to_owned(),
        addr.clone(),
        "--database-url".to_owned(),
        db.clone(),
    ];
    let mut server = logged.spawn("payment_webhook", &args);

    let clients = client_lanes(4, KEYS, {
        let base = base.clone();
        move |c: Client, i| {
            let base = base.clone();
            async move { until_answered(&c, &base, i).await }
        }
    });
    let mut kills = 0;
    while !clients.is_finished() && kills < 6 {
        tokio::time::sleep(Duration::from_millis(150 + fastrand::u64(0..250))).await;
        server.start_kill().expect("SIGKILL");
        server.wait().await.expect("reap");
        kills += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
        server = logged.spawn("payment_webhook", &args);
    }
    let replays = tokio::time::timeout(Duration::from_secs(120), clients)
        .await
        .unwrap_or_else(|_| panic!("clients did not finish; server log:\n{}", logged.tail()))
        .unwrap()
        .into_iter()
        .filter(|replayed| *replayed)
        .count();
    assert!(
        kills >= 3,
        "only {kills} kills landed before the clients finished"
    );
    let per_account: BTreeMap<String, i64> =
        sqlx::query_as("SELECT account, COUNT(*) FROM orders GROUP BY account")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let doubled: Vec<_> = per_account.iter().filter(|(_, n)| **n != 1).collect();
    assert!(doubled.is_empty(), "orders made twice: {doubled:?}");
    assert_eq!(per_account.len(), KEYS, "one order per key");
    eprintln!("{kills} SIGKILLs, {KEYS} keys, {replays} answered by a replay");
    server.start_kill().ok();
}
