//! The `payment_webhook` server's `POST /refunds` calls a provider's refund
//! API through a step (`Tx::step`), and is SIGKILLed 200 times: right after
//! the provider executed a refund (between the downstream call and the
//! `COMMIT`), or at random moments (before the call, during it, after the
//! commit). Clients retry each refund with the same `Idempotency-Key` until
//! they get an answer. In the end every refund exists exactly once at the
//! provider and exactly once in the ledger, with the provider's id.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use onceonly_integration_tests::child::{Logged, client_lanes};
use onceonly_integration_tests::free_port;
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::provider_api::ProviderApi;
use reqwest::Client;
use sqlx::PgPool;
use tokio::sync::broadcast;

const KEYS: usize = 500;
const KILLS: usize = 200;

/// Waits until the server at `addr` accepts connections.
async fn listening(addr: &str, logged: &Logged) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the server did not start; log:\n{}",
            logged.tail()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Posts refund `i` until the server answers 2xx.
async fn until_refunded(c: &Client, base: &str, i: usize) {
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        assert!(Instant::now() < deadline, "refund {i} never answered");
        let sent = c
            .post(format!("{base}/refunds"))
            .header("content-type", "application/json")
            .header("Idempotency-Key", format!("refund-{i}"))
            .body(format!(
                r#"{{"payment":"pay-{i:04}","amount":{}}}"#,
                100 + i
            ))
            .timeout(Duration::from_secs(5))
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_success() => return,
            // 409 (the key still held by a killed server's connection),
            // 502/503 (the provider call or the store failed), or no
            // server: retry with the same key.
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_between_the_refund_call_and_the_commit_leaves_one_refund_at_the_provider_and_in_the_ledger()
 {
    let db = pg_schema("refundkill").await;
    let pool = PgPool::connect(&db).await.unwrap_or_else(|e| {
        panic!(
            "PostgreSQL is not reachable at {}: {e}; start it with scripts/services",
            onceonly_integration_tests::pg_url()
        )
    });
    let provider = ProviderApi::start().await;
    let addr = format!("127.0.0.1:{}", free_port());
    let base = format!("http://{addr}");
    let logged = Logged::new("refund_kill");
    let args = vec![
        "--listen".to_owned(),
        addr.clone(),
        "--database-url".to_owned(),
        db.clone(),
        "--refund-api".to_owned(),
        provider.url(),
    ];
    let mut server = logged.spawn("payment_webhook", &args);

    let clients = client_lanes(4, KEYS, {
        let base = base.clone();
        move |c: Client, i| {
            let base = base.clone();
            async move { until_refunded(&c, &base, i).await }
        }
    });
    let mut executed = provider.executed();
    let (mut after_call, mut at_random) = (0, 0);
    listening(&addr, &logged).await;
    while !clients.is_finished() && after_call + at_random < KILLS {
        // Every other kill waits for a refund the provider just executed
        // and lands before the server's COMMIT (mostly at once, sometimes a
        // few ms later); the others land at a random moment. Aimed kills
        // wait for an execution rather than race a short timer against
        // it: on a loaded machine one request can outlast any fixed
        // window, and then no kill would ever land after a call.
        if (after_call + at_random) % 2 == 0 {
            match tokio::time::timeout(Duration::from_secs(10), executed.recv()).await {
                Ok(Ok(_) | Err(broadcast::error::RecvError::Lagged(_))) => {
                    if fastrand::u8(0..4) > 0 {
                        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3))).await;
                    }
                    after_call += 1;
                }
                // No refund executed in 10 s (the clients are between
                // retries): a kill at a random moment after all.
                Ok(Err(broadcast::error::RecvError::Closed)) | Err(_) => at_random += 1,
            }
        } else {
            tokio::time::sleep(Duration::from_millis(10 + fastrand::u64(0..90))).await;
            at_random += 1;
        }
        provider.set_delay(Duration::from_millis(fastrand::u64(0..8)));
        server.start_kill().expect("SIGKILL");
        server.wait().await.expect("reap");
        // Refunds executed while the server was down were not killed after.
        server = logged.spawn("payment_webhook", &args);
        listening(&addr, &logged).await;
        executed = executed.resubscribe();
    }
    tokio::time::timeout(Duration::from_secs(300), clients)
        .await
        .unwrap_or_else(|_| panic!("clients did not finish; server log:\n{}", logged.tail()))
        .unwrap();
    server.start_kill().ok();

    let kills = after_call + at_random;
    let at_provider = provider.refunds();
    let per_payment: BTreeMap<String, usize> =
        at_provider.iter().fold(BTreeMap::new(), |mut m, r| {
            *m.entry(r.payment.clone()).or_default() += 1;
            m
        });
    let doubled: Vec<_> = per_payment.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "refunded twice at the provider: {doubled:?}"
    );
    assert_eq!(
        per_payment.len(),
        KEYS,
        "one refund per key at the provider"
    );

    let booked: Vec<(String, String, String)> =
        sqlx::query_as("SELECT idem_key, payment, provider_refund FROM refunds")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(booked.len(), KEYS, "one refund per key in the ledger");
    let provider_ids: BTreeMap<&str, &str> = at_provider
        .iter()
        .map(|r| (r.payment.as_str(), r.id.as_str()))
        .collect();
    for (key, payment, refund) in &booked {
        assert_eq!(
            provider_ids.get(payment.as_str()),
            Some(&refund.as_str()),
            "{key}: the ledger books the provider's refund"
        );
    }
    eprintln!(
        "{kills} SIGKILLs ({after_call} right after the provider executed a refund, {at_random} at random moments); \
         {KEYS} refunds, each once at the provider and once in the ledger; the provider got {} requests, \
         answered {} by replaying its first answer and {} with 409 (a twin in flight)",
        provider.requests(),
        provider.replays(),
        provider.in_use_answers()
    );
    assert!(
        kills >= KILLS,
        "only {kills} kills landed before the clients finished"
    );
    assert!(
        after_call > 0,
        "no kill was aimed between a refund call and its commit"
    );
    // The provider replays an answer only to a second call with the same
    // downstream key: a server died between a call and its COMMIT, and
    // its successor's step called again.
    assert!(
        provider.replays() > 0,
        "no kill landed between a refund call and its commit"
    );
}
