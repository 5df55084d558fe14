//! Key redaction against the real services: with an HMAC key redaction no
//! raw business key reaches any log line, whichever path logs it (a store
//! error on PostgreSQL, the Redis tier's warnings, the standalone Redis
//! claims), and those lines show the keyed form the delivery span shows,
//! so a line and its span correlate.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use onceonly::redis::{CachedStore, RedisClaim, RedisStore, RunOnceError};
use onceonly::{
    Delivery, Engine, Failure, HandlerError, Json, KeyRedaction, Outcome, SqlStore, StoreError, Tx,
    handler_fn,
};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::{pay, pg_store, redis_unreachable, redis_url, unique};
use sqlx::Postgres;
use tracing_subscriber::fmt::MakeWriter;

const SECRET: &str = "an operator's secret of 32 bytes";

/// Everything logged on this thread while [`Logs::capture`]'s guard
/// lives, as the `fmt` subscriber prints it (with the spans' fields).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Logs {
    /// Captures every level on this thread (the tests run on a
    /// current-thread runtime, so every poll is on it).
    fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let subscriber = tracing_subscriber::fmt()
            .with_writer(self.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// No line shows `raw`; each line containing one of `lines` shows
    /// `shown`.
    fn assert_redacted(&self, raw: &str, shown: &str, lines: &[&str]) {
        let text = self.text();
        assert!(
            !text.contains(raw),
            "the raw key {raw:?} is in the logs:\n{text}"
        );
        for needle in lines {
            let line = text
                .lines()
                .find(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{text}"));
            assert!(
                line.contains(shown),
                "the line does not show the key as {shown}: {line}"
            );
        }
    }
}

fn redaction() -> KeyRedaction {
    KeyRedaction::hmac(SECRET).unwrap()
}

#[tokio::test]
async fn store_errors_name_no_key_and_their_lines_show_the_keyed_form() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let url = pg_schema("redact").await;
    let store = pg_store(&url, "onceonly_keys").await;
    let engine = Engine::builder(store.clone())
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .key_redaction(redaction())
        .transient_retries(1)
        .build()
        .unwrap();

    // The handler deletes its own claim, as a database that rolled the
    // transaction back under it would: recording the result finds no row
    // (`ClaimLost`), which is retried once as contention (logged), then
    // reported.
    let lost = unique("ORDER-LOST");
    let vanish = handler_fn(|tx: Tx<Postgres>, _: Json<serde_json::Value>| async move {
        let origin = tx.origin();
        let (scope, key) = (origin.scope().to_owned(), origin.key().to_owned());
        let mut conn = tx.lock().await?;
        sqlx::query("DELETE FROM onceonly_keys WHERE scope = $1 AND idem_key = $2")
            .bind(scope)
            .bind(key)
            .execute(&mut *conn)
            .await?;
        Ok::<_, HandlerError>(())
    });
    let report = engine.process(&vanish, &Delivery::new(pay(&lost, 1))).await;
    assert!(
        matches!(
            report.outcome,
            Outcome::Failed(Failure::Store(StoreError::ClaimLost))
        ),
        "{:?}",
        report.outcome
    );
    let shown = redaction().show(&lost).into_owned();
    assert!(shown.starts_with("hmac:") && shown.len() == 21, "{shown}");
    logs.assert_redacted(&lost, &shown, &["lock contention, retrying"]);
    let error = report.outcome.error_text().unwrap();
    assert!(!error.contains(&lost), "{error}");

    // A stored fingerprint that does not read back: `Corrupt`.
    let corrupt = unique("ORDER-CORRUPT");
    let ok = handler_fn(|_: Tx<Postgres>, _: Json<serde_json::Value>| async move {
        Ok::<_, HandlerError>(())
    });
    let delivery = Delivery::new(pay(&corrupt, 2));
    assert!(matches!(
        engine.process(&ok, &delivery).await.outcome,
        Outcome::Processed { .. }
    ));
    sqlx::query("UPDATE onceonly_keys SET fingerprint = '\\x01'::bytea WHERE idem_key = $1")
        .bind(&corrupt)
        .execute(store.pool())
        .await
        .unwrap();
    let report = engine.process(&ok, &delivery).await;
    assert!(
        matches!(
            report.outcome,
            Outcome::Failed(Failure::Store(StoreError::Corrupt(_)))
        ),
        "{:?}",
        report.outcome
    );
    let error = report.outcome.error_text().unwrap();
    assert!(!error.contains(&corrupt), "{error}");
    logs.assert_redacted(&corrupt, &redaction().show(&corrupt), &[]);
}

#[tokio::test]
async fn the_redis_tiers_lines_show_the_keyed_form() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let url = pg_schema("redact_tier").await;
    let sql = pg_store(&url, "onceonly_keys").await;
    let prefix = format!("{}:", unique("redact"));
    let cached = CachedStore::connect(sql, &redis_url())
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(prefix.as_str());
    let engine = Engine::builder(cached)
        .scope("payments")
        .key_expr("json:/out_trade_no")
        .key_redaction(redaction())
        .build()
        .unwrap();
    let standalone = RedisStore::connect(&redis_url())
        .await
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(prefix.as_str())
        .with_key_redaction(redaction());

    // A value the tier does not understand under the key (a standalone
    // claim in the same prefix): the tier warns and asks SQL.
    let key = unique("ORDER-TIER");
    assert!(matches!(
        standalone.claim("payments", &key, None).await.unwrap(),
        RedisClaim::Claimed(_)
    ));
    let ok = handler_fn(|_: Tx<Postgres>, _: Json<serde_json::Value>| async move {
        Ok::<_, HandlerError>(())
    });
    let report = engine.process(&ok, &Delivery::new(pay(&key, 1))).await;
    assert!(matches!(report.outcome, Outcome::Processed { .. }));
    logs.assert_redacted(
        &key,
        &redaction().show(&key),
        &["unexpected value in the Redis tier"],
    );
}

#[tokio::test]
async fn standalone_redis_claims_log_the_keyed_form() {
    let logs = Logs::default();
    let _guard = logs.capture();
    let store = RedisStore::connect(&redis_url())
        .await
        .unwrap_or_else(|e| redis_unreachable(e))
        .with_prefix(format!("{}:", unique("redact")))
        .with_lease(Duration::from_millis(60))
        .with_key_redaction(redaction());
    let key = unique("SMS-TO-+4915112345678");
    let ran = store
        .run_once("sms", &key, None, async {
            // Blocks the task: no renewal, the lease runs out in Redis ...
            std::thread::sleep(Duration::from_millis(250));
            // ... and the next renewal finds it lost (logged).
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, std::io::Error>(1)
        })
        .await;
    assert!(matches!(ran, Err(RunOnceError::LeaseLost(_))), "{ran:?}");
    logs.assert_redacted(
        &key,
        &redaction().show(&key),
        &["lease lost while the effect runs"],
    );
}
