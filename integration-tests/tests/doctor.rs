//! `onceonly doctor` (the real binary) against real services: a PostgreSQL
//! database whose role lost DELETE on the dedup table and that then turns
//! read-only (both problems named, with their fixes, exit status 1); a
//! generations table whose role may not rotate it (the grants named, and
//! enough once run); a
//! RabbitMQ dead-letter queue whose oldest letter is older than the dedup
//! retention, and a Kafka topic that keeps records longer (warnings, exit
//! status 3).

use onceonly::Header;
use onceonly_integration_tests::amqp::{Msg, connect, declare_queue, depth, publish, url};
use onceonly_integration_tests::cli::{Run, onceonly};
use onceonly_integration_tests::own_db::OwnDb;
use onceonly_integration_tests::{pay, unique};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;

/// The findings of a `--json` run: (check, status, detail, fix).
fn findings(run: &Run) -> Vec<(String, String, String, String)> {
    let json: serde_json::Value = serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("doctor --json printed no JSON ({e}): {run:?}"));
    json["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| {
            let text = |k: &str| f[k].as_str().unwrap_or_default().to_owned();
            (text("check"), text("status"), text("detail"), text("fix"))
        })
        .collect()
}

fn failures(run: &Run) -> Vec<(String, String, String)> {
    findings(run)
        .into_iter()
        .filter(|(_, status, _, _)| status == "fail")
        .map(|(check, _, detail, fix)| (check, detail, fix))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_names_a_revoked_privilege_and_a_read_only_database() {
    let db = OwnDb::create("doctor").await;
    let migrated = onceonly(&["migrate", "--database-url", &db.url]).await;
    assert!(migrated.success, "{migrated:?}");
    let healthy = onceonly(&["doctor", "--database-url", &db.url]).await;
    assert_eq!(
        healthy.code, 0,
        "a fresh deployment is healthy: {healthy:?}"
    );
    assert!(
        healthy.stdout.contains("0 problem(s), 0 warning(s)"),
        "{}",
        healthy.stdout
    );

    // An application role that may not DELETE from the dedup table (the
    // purge and the claim of an expired key need it).
    let role = unique("doctor_app");
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT SELECT, INSERT, UPDATE ON onceonly_keys TO {role}"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON onceonly_keys_attempts, onceonly_keys_fence, \
             onceonly_keys_steps, onceonly_outbox TO {role}"
        ),
        format!("GRANT USAGE ON SEQUENCE onceonly_outbox_id_seq TO {role}"),
    ] {
        sqlx::query(&sql)
            .execute(&admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let app_url = as_role(&db, &role);

    let revoked = onceonly(&["doctor", "--database-url", &app_url, "--json"]).await;
    assert_eq!(revoked.code, 1, "{revoked:?}");
    let fails = failures(&revoked);
    assert_eq!(fails.len(), 1, "only the privilege: {fails:?}");
    let (check, detail, fix) = &fails[0];
    assert_eq!(check, "privileges");
    assert!(
        detail.contains(&format!("{role} lacks DELETE on \"onceonly_keys\"")),
        "{detail}"
    );
    assert_eq!(
        fix,
        &format!("GRANT DELETE ON \"onceonly_keys\" TO \"{role}\"")
    );

    // The database fails over to read-only as well: both problems, named.
    drop(admin);
    db.fail_over_read_only().await;
    let both = onceonly(&["doctor", "--database-url", &app_url, "--json"]).await;
    assert_eq!(both.code, 1, "{both:?}");
    let fails = failures(&both);
    let checks: Vec<&str> = fails.iter().map(|(c, _, _)| c.as_str()).collect();
    assert_eq!(checks, ["privileges", "writable"], "{fails:?}");
    assert!(fails[1].1.contains("read-only"), "{fails:?}");
    assert!(
        fails[1].2.contains("default_transaction_read_only = off"),
        "the fix says how: {fails:?}"
    );
    let text = onceonly(&["doctor", "--database-url", &app_url]).await;
    assert_eq!(text.code, 1);
    assert!(text.stdout.contains("2 problem(s)"), "{}", text.stdout);
    assert!(text.stdout.contains("FAIL  privileges"), "{}", text.stdout);
    assert!(text.stdout.contains("FAIL  writable"), "{}", text.stdout);

    // Leave no role behind on the shared server.
    db.set_read_only(false).await;
    db.terminate_connections().await;
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::query(&format!("DROP OWNED BY {role}"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await
        .unwrap();
}

/// The URL of `db` for `role`.
fn as_role(db: &OwnDb, role: &str) -> String {
    let host = db
        .url
        .split_once('@')
        .map(|(_, h)| h)
        .expect("user@host in the URL");
    format!("postgres://{role}@{host}")
}

/// Runs each statement of `sql` (`;`-separated, as a doctor's fix) on
/// `url`.
async fn execute(url: &str, sql: &str) {
    let admin = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::raw_sql(sql)
        .execute(&admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    admin.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_names_what_the_rotations_of_a_generations_table_need() {
    let db = OwnDb::create("doctor_gen").await;
    let migrated = onceonly(&[
        "migrate",
        "--database-url",
        &db.url,
        "--layout",
        "generations",
        "--buckets",
        "2",
    ])
    .await;
    assert!(migrated.success, "{migrated:?}");
    let healthy = onceonly(&["doctor", "--database-url", &db.url, "--json"]).await;
    assert_eq!(healthy.code, 0, "the owner may do it all: {healthy:?}");
    assert!(
        findings(&healthy)
            .iter()
            .any(|(c, s, d, _)| c == "privileges"
                && s == "ok"
                && d.contains("may rotate \"onceonly_keys\"")
                && d.contains("6 partitions")),
        "two generations of two buckets each: {healthy:?}"
    );

    // An application role granted what the plain layout needs, as the
    // plain layout's documentation says.
    let role = unique("doctor_gen_app");
    execute(
        &db.url,
        &format!(
            "CREATE ROLE {role} LOGIN; \
             GRANT SELECT, INSERT, UPDATE, DELETE \
             ON onceonly_keys, onceonly_keys_attempts, onceonly_keys_fence, onceonly_keys_steps, \
             onceonly_outbox TO {role}; \
             GRANT USAGE ON SEQUENCE onceonly_outbox_id_seq TO {role}"
        ),
    )
    .await;
    let app_url = as_role(&db, &role);
    let denied = onceonly(&["purge", "--database-url", &app_url, "--expired"]).await;
    assert!(
        !denied.success && denied.stderr.contains("permission denied"),
        "its purge cannot rotate: {denied:?}"
    );

    let run = onceonly(&["doctor", "--database-url", &app_url, "--json"]).await;
    assert_eq!(run.code, 1, "{run:?}");
    let fails = failures(&run);
    assert_eq!(fails.len(), 2, "the dedup table and the outbox: {fails:?}");
    assert!(fails.iter().all(|(check, _, _)| check == "privileges"));
    let (_, detail, fix) = &fails[0];
    assert!(
        detail.contains(&format!(
            "{role} lacks SELECT, UPDATE on public.onceonly_keys_generation"
        )),
        "{detail}"
    );
    assert_eq!(
        fix,
        &format!(
            "GRANT SELECT, UPDATE ON public.onceonly_keys_generation TO \"{role}\"; \
             GRANT SELECT, TRUNCATE ON public.onceonly_keys_g0, public.onceonly_keys_g1 TO \"{role}\"; \
             GRANT TRUNCATE ON public.onceonly_keys_g0_b0, public.onceonly_keys_g0_b1, \
             public.onceonly_keys_g1_b0, public.onceonly_keys_g1_b1 TO \"{role}\""
        )
    );
    assert_eq!(
        fails[1].2,
        format!(
            "GRANT SELECT, UPDATE ON public.onceonly_outbox_generation TO \"{role}\"; \
             GRANT SELECT, DELETE, TRUNCATE ON public.onceonly_outbox_g0, \
             public.onceonly_outbox_g1 TO \"{role}\""
        )
    );

    // The fixes, run as they are, are all the role needed.
    for (_, _, fix) in &fails {
        execute(&db.url, fix).await;
    }
    let fixed = onceonly(&["doctor", "--database-url", &app_url]).await;
    assert_eq!(fixed.code, 0, "{fixed:?}");
    let purged = onceonly(&["purge", "--database-url", &app_url, "--expired"]).await;
    assert!(purged.success, "{purged:?}");
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    let current: i16 = sqlx::query_scalar("SELECT current FROM onceonly_keys_generation")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(current, 1, "the role's purge rotated the empty generation");

    // Leave no role behind on the shared server.
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(&sql).execute(&admin).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_compares_the_dedup_retention_with_the_brokers() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite:{}", dir.path().join("doctor.db").display());
    let migrated = onceonly(&["migrate", "--database-url", &sqlite]).await;
    assert!(migrated.success, "{migrated:?}");

    // A dead-letter queue whose oldest letter was first seen 10 days ago.
    let (_conn, channel) = connect().await;
    let dlq = unique("doctor_dlq");
    declare_queue(&channel, &dlq).await;
    let mut old = Msg::new(pay("D-1", 1).account("a"));
    let ten_days_ago = onceonly::Clock::now_ms(&onceonly::SystemClock) - 10 * 86_400_000;
    old.headers = vec![(Header::FirstSeen.name().into(), ten_days_ago.to_string())];
    publish(&channel, &dlq, &[old, Msg::new(pay("D-2", 1).account("a"))]).await;

    // A topic that keeps records for 30 days.
    let topic = unique("doctor_topic");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set(
            "bootstrap.servers",
            onceonly_integration_tests::kafka::brokers(),
        )
        .create()
        .unwrap();
    let thirty_days = (30 * 86_400_000_i64).to_string();
    let new =
        NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set("retention.ms", &thirty_days);
    let created = admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .expect("create topic");
    assert!(created.iter().all(Result::is_ok), "{created:?}");

    let amqp = url();
    let brokers = onceonly_integration_tests::kafka::brokers();
    let run = onceonly(&[
        "doctor",
        "--database-url",
        &sqlite,
        "--retention",
        "7d",
        "--amqp-url",
        &amqp,
        "--dlq",
        &dlq,
        "--kafka-brokers",
        &brokers,
        "--topic",
        &topic,
        "--json",
    ])
    .await;
    assert_eq!(run.code, 3, "warnings only: {run:?}");
    let warnings: Vec<(String, String)> = findings(&run)
        .into_iter()
        .filter(|(_, status, _, _)| status == "warn")
        .map(|(check, _, detail, _)| (check, detail))
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings.iter().any(|(c, d)| c == "retention"
            && d.contains(&format!("queue {dlq}: the oldest of 2 letters is 10days"))
            && d.contains("older than the dedup retention 7days")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|(c, d)| c == "retention"
                && d.contains(&format!("topic {topic} keeps records 30days"))),
        "{warnings:?}"
    );
    assert_eq!(
        depth(&channel, &dlq).await,
        2,
        "the doctor consumed nothing"
    );

    let within = onceonly(&[
        "doctor",
        "--database-url",
        &sqlite,
        "--retention",
        "60d",
        "--amqp-url",
        &amqp,
        "--dlq",
        &dlq,
        "--kafka-brokers",
        &brokers,
        "--topic",
        &topic,
    ])
    .await;
    assert_eq!(
        within.code, 0,
        "a 60-day dedup window covers both: {within:?}"
    );
}
