//! TLS end to end, with certificates made by the test (a private CA and a
//! server certificate for `localhost`):
//!
//! - PostgreSQL runs with `ssl = on` and a `pg_hba.conf` that rejects plain
//!   connections (a private server: its own data directory and port). The
//!   store, the engine and the `onceonly` CLI reach it with
//!   `sslmode=verify-full&sslrootcert=<test CA>`; a plain connection and a
//!   server that the client's CA did not sign are refused.
//! - Kafka and RabbitMQ are reached through a TLS-terminating proxy (the
//!   broker builds here have no TLS listener of their own: tansu 0.6 has
//!   none, and turning one on in the shared RabbitMQ would reconfigure it for
//!   every other test). A private tansu advertises the proxy's port, so every
//!   Kafka connection, bootstrap and broker, goes through TLS. `onceonly
//!   relay` publishes the outbox with `-X security.protocol=ssl` and an
//!   `amqps://` URL with `--amqp-ca`, `--amqp-cert` and `--amqp-key` (the
//!   AMQP proxy demands a client certificate); an `AmqpConsumer` drains a
//!   queue over amqps with `AmqpTls`, and a client without the certificate
//!   is refused.
//! - Redis is reached with `rediss://` and the test CA as the only root.

use std::process::Stdio;
use std::time::{Duration, Instant};

use onceonly_integration_tests::demo::ledger;

use onceonly::amqp::{AmqpConsumer, AmqpTls, CancellationToken};
use onceonly::ops::replay::AmqpReplay;
use onceonly::outbox::{Outbox, OutboxMessage};
use onceonly::{
    Delivery, Engine, Json, KeySpec, Outcome, PgStore, SqlStore, handler_fn,
    redis::{RedisClaim, RedisStore},
};
use onceonly_integration_tests::amqp::{connect, declare_queue, depth, publish_stream, take};
use onceonly_integration_tests::cli::{onceonly, onceonly_binary};
use onceonly_integration_tests::kafka::pg_schema;
use onceonly_integration_tests::ledger::{assert_exact, crash_stream};
use onceonly_integration_tests::private_pg::PrivatePg;
use onceonly_integration_tests::tls::{TestCa, TlsProxy};
use onceonly_integration_tests::{Pay, free_port, pay, pg_store, unique};
use rdkafka::ClientConfig;
use rdkafka::Message as _;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sqlx::postgres::PgConnectOptions;

/// A private PostgreSQL on `port` that accepts TLS connections only, with
/// `ca`'s server certificate.
/// (Under Docker Compose: service `compose_service`, which publishes `port`.)
fn tls_only_pg(port: u16, compose_service: &str, ca: &TestCa) -> PrivatePg {
    PrivatePg::builder(port)
        .compose_service(compose_service)
        .setting("ssl", "on")
        .setting("ssl_cert_file", "'server.crt'")
        .setting("ssl_key_file", "'server.key'")
        .hba(&[
            "local all all trust",
            "hostssl all all 127.0.0.1/32 trust",
            "hostssl all all ::1/128 trust",
            "hostnossl all all 0.0.0.0/0 reject",
            "hostnossl all all ::/0 reject",
        ])
        .file("server.crt", ca.cert_pem())
        .file("server.key", ca.key_pem())
        .start()
}

/// `postgres://…@localhost:PORT/postgres?sslmode=MODE[&sslrootcert=CA]`.
fn pg_url(port: u16, mode: &str, root: Option<&TestCa>) -> String {
    let mut url = format!("postgres://postgres@localhost:{port}/postgres?sslmode={mode}");
    if let Some(ca) = root {
        url.push_str(&format!("&sslrootcert={}", ca.ca_path().display()));
    }
    url
}

/// `host:port` of a service URL (`scheme://[user[:pw]@]host:port[/…]`).
fn authority(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest).to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_and_the_store_reach_postgres_only_over_verified_tls() {
    let ca = TestCa::with_names("pg", &["localhost"]);
    let stranger = TestCa::new("stranger");
    let pg = tls_only_pg(54_331, "postgres-tls", &ca);
    let port = pg.port();
    let verified = pg_url(port, "verify-full", Some(&ca));

    let migrate = onceonly(&["migrate", "--database-url", &verified]).await;
    assert!(migrate.success, "migrate over TLS: {migrate:?}");
    let stats = onceonly(&["stats", "--database-url", &verified]).await;
    assert!(stats.success, "stats over TLS: {stats:?}");

    // The server refuses plain connections: the TLS above was real.
    let plain = onceonly(&["stats", "--database-url", &pg_url(port, "disable", None)]).await;
    assert!(!plain.success, "a plain connection must be refused");
    assert!(
        plain.stderr.contains("no encryption") || plain.stderr.contains("pg_hba.conf"),
        "{}",
        plain.stderr
    );
    // verify-full checks the chain: a CA that did not sign the server fails.
    let unknown = onceonly(&[
        "stats",
        "--database-url",
        &pg_url(port, "verify-full", Some(&stranger)),
    ])
    .await;
    assert!(!unknown.success, "an unknown issuer must be refused");
    assert!(
        unknown.stderr.to_lowercase().contains("certificate"),
        "{}",
        unknown.stderr
    );
    // verify-full checks the name too: the certificate names `localhost`
    // only, so 127.0.0.1 is refused.
    let by_address = |mode: &str| {
        format!(
            "postgres://postgres@127.0.0.1:{port}/postgres?sslmode={mode}&sslrootcert={}",
            ca.ca_path().display()
        )
    };
    let wrong_name = onceonly(&["stats", "--database-url", &by_address("verify-full")]).await;
    assert!(
        !wrong_name.success,
        "a name the certificate lacks must be refused"
    );
    assert!(
        wrong_name.stderr.contains("not valid for name"),
        "{}",
        wrong_name.stderr
    );
    // (sqlx 0.8.6 with rustls >= 0.23.24 checks the name in verify-ca as
    // well, launchbadge/sqlx#3793: stricter than libpq, so not tested here.)

    // The library: a store from a URL and from ConnectOptions, both on TLS.
    let store = PgStore::connect(&verified).await.expect("store over TLS");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .expect("pg_stat_ssl");
    assert!(ssl, "the store's connection is not encrypted");
    let options: PgConnectOptions = verified.parse().expect("options");
    let store = PgStore::connect_with(options)
        .await
        .expect("store from options");
    store.migrate().await.expect("migrate");
}

/// A connection that was open when a deadline was missed is closed, not
/// reused. Over TLS, sqlx's "hard" close of such a connection waits for
/// the server's `close_notify`, which a server never sends unasked: each
/// claim that found one idle in the pool hung until the acquire timeout
/// and failed, long after the database was healthy again. Here a handler
/// misses its deadline while two other connections of the pool sit idle
/// (counting the miss takes one); the next payment must be processed.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_after_a_missed_deadline_does_not_wait_on_a_stale_tls_connection() {
    let ca = TestCa::with_names("pg-deadline", &["localhost"]);
    let pg = tls_only_pg(54_333, "postgres-tls-deadline", &ca);
    let url = pg_url(pg.port(), "verify-full", Some(&ca));
    let deadlines = onceonly::store::Deadlines::default()
        .transaction(Duration::from_millis(150))
        .acquire(Duration::from_secs(2));
    let options: PgConnectOptions = url.parse().expect("url");
    let pool = onceonly::store::pool_options_for(&deadlines)
        .max_connections(3)
        .connect_with(options)
        .await
        .expect("pool over TLS");
    let store = PgStore::new(pool).deadlines(deadlines);
    store.migrate().await.expect("migrate");
    ledger::postgres::create_tables(store.pool())
        .await
        .expect("ledger");
    let engine = Engine::builder(store.clone())
        .scope("tls-deadline")
        .key(KeySpec::json_field("/out_trade_no"))
        .build()
        .expect("engine");
    // Three connections, all idle in the pool.
    let (a, b, c) = (
        store.pool().acquire().await.expect("a"),
        store.pool().acquire().await.expect("b"),
        store.pool().acquire().await.expect("c"),
    );
    drop((a, b, c));
    tokio::time::sleep(Duration::from_millis(100)).await;

    let slow = handler_fn(
        |tx: onceonly::Tx<sqlx::Postgres>, Json(p): Json<ledger::Payment>| async move {
            let mut conn = tx.lock().await?;
            ledger::postgres::record(&mut conn, &p).await?;
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(p.amount)
        },
    );
    let report = engine
        .process(&slow, &Delivery::new(pay("SLOW", 1).account("a")))
        .await;
    assert!(
        matches!(&report.outcome, Outcome::Failed(f) if f.is_infrastructure()),
        "{:?}",
        report.outcome
    );
    let quick = handler_fn(
        |tx: onceonly::Tx<sqlx::Postgres>, Json(p): Json<ledger::Payment>| async move {
            let mut conn = tx.lock().await?;
            ledger::postgres::record(&mut conn, &p).await?;
            Ok(p.amount)
        },
    );
    // Each attempt ends within the acquire timeout (2 s): none waits on the
    // stale connection. On a loaded machine a fresh TLS connection can
    // itself take longer than the 150 ms transaction deadline: that attempt
    // fails as infrastructure (a timeout) and the next one goes through.
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let report = engine
            .process(&quick, &Delivery::new(pay("QUICK", 7).account("a")))
            .await;
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "an attempt waited {:?} (a stale connection?): {:?}",
            started.elapsed(),
            report.outcome
        );
        let done = matches!(report.outcome, Outcome::Processed { result: 7 });
        let infra = matches!(&report.outcome, Outcome::Failed(f) if f.is_infrastructure());
        outcomes.push(format!("{:?}", report.outcome));
        if done {
            break;
        }
        assert!(infra, "the claim after a missed deadline: {outcomes:?}");
    }
    assert!(
        outcomes.last().is_some_and(|o| o.starts_with("Processed")),
        "the claim after a missed deadline never went through: {outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_relay_publishes_over_tls_to_kafka_and_rabbitmq_from_a_tls_database() {
    let ca = TestCa::new("relay");
    let pg = tls_only_pg(54_332, "postgres-tls-relay", &ca);
    let db = pg_url(pg.port(), "verify-full", Some(&ca));

    // Kafka: a private tansu whose advertised address is the TLS proxy.
    let kafka = PrivateTansu::start(&ca).await;
    let kafka_tls = |config: &mut ClientConfig| {
        config
            .set("bootstrap.servers", kafka.bootstrap())
            .set("security.protocol", "ssl")
            .set("ssl.ca.location", ca.ca_path().to_string_lossy().as_ref());
    };
    let topic = unique("settled_tls");
    let mut admin_config = ClientConfig::new();
    kafka_tls(&mut admin_config);
    let admin: AdminClient<DefaultClientContext> = admin_config.create().expect("admin");
    let created = admin
        .create_topics(
            [&NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic over TLS");
    assert!(created.iter().all(Result::is_ok), "{created:?}");

    // RabbitMQ: amqps through a proxy in front of the shared broker, which
    // wants a client certificate.
    let amqp =
        TlsProxy::start_mutual(&ca, &authority(&onceonly_integration_tests::amqp::url())).await;
    let (client_cert, client_key) = ca.client_identity_paths();
    let (_conn, channel) = connect().await;
    let queue = unique("settled_tls");
    declare_queue(&channel, &queue).await;

    // Payments claimed on the TLS database, each enqueueing one Kafka and
    // one AMQP message in the claim's transaction.
    let store = PgStore::connect(&db).await.expect("store over TLS");
    store.migrate().await.expect("migrate");
    let outbox = Outbox::<sqlx::Postgres>::new();
    outbox.migrate(store.pool()).await.expect("outbox table");
    let engine = Engine::builder(store.clone())
        .scope("tls")
        .key(KeySpec::json_field("/out_trade_no"))
        .build()
        .expect("engine");
    let handler = {
        let (outbox, topic, queue) = (outbox.clone(), topic.clone(), queue.clone());
        handler_fn(
            move |tx: onceonly::Tx<sqlx::Postgres>, Json(p): Json<Pay>| {
                let (outbox, topic, queue) = (outbox.clone(), topic.clone(), queue.clone());
                async move {
                    let mut conn = tx.lock().await?;
                    let body = serde_json::to_vec(&p).expect("json");
                    outbox
                        .enqueue(
                            &mut conn,
                            OutboxMessage::kafka(topic, p.out_trade_no.clone(), body.clone()),
                        )
                        .await?;
                    outbox
                        .enqueue(&mut conn, OutboxMessage::amqp("", queue, body))
                        .await?;
                    Ok(())
                }
            },
        )
    };
    const N: usize = 20;
    for i in 0..N {
        let report = engine
            .process(&handler, &Delivery::new(pay(&format!("TLS-{i:03}"), 10)))
            .await;
        assert!(
            matches!(report.outcome, Outcome::Processed { .. }),
            "{report:?}"
        );
    }

    let mut relay = tokio::process::Command::new(onceonly_binary())
        .args(["relay", "--database-url", &db, "--poll-interval", "200ms"])
        .args(["--kafka-brokers", &kafka.bootstrap()])
        .args(["-X", "security.protocol=ssl"])
        .args(["-X", &format!("ssl.ca.location={}", ca.ca_path().display())])
        .args([
            "--amqp-url",
            &format!("amqps://guest:guest@localhost:{}/%2f", amqp.port()),
        ])
        .arg("--amqp-ca")
        .arg(ca.ca_path())
        .arg("--amqp-cert")
        .arg(&client_cert)
        .arg("--amqp-key")
        .arg(&client_key)
        .env_remove("ONCEONLY_DATABASE_URL")
        .env_remove("ONCEONLY_OUTBOX_TABLE")
        .env_remove("ONCEONLY_KAFKA_BROKERS")
        .env_remove("ONCEONLY_AMQP_URL")
        .env_remove("SSL_CERT_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn onceonly relay");

    let sent = async || -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM onceonly_outbox WHERE status = 1")
            .fetch_one(store.pool())
            .await
            .expect("count")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while sent().await < 2 * N as i64 {
        let exited = relay.try_wait().expect("relay status").is_some();
        if exited || Instant::now() > deadline {
            if let Some(pid) = relay.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
            let out = relay.wait_with_output().await.expect("relay output");
            panic!(
                "the relay did not publish over TLS ({} of {} sent):\n{}",
                sent().await,
                2 * N,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &relay.id().expect("pid").to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let out = tokio::time::timeout(Duration::from_secs(30), relay.wait_with_output())
        .await
        .expect("the relay did not stop on SIGTERM")
        .expect("relay output");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Every message arrived, once, through TLS.
    let mut reader_config = ClientConfig::new();
    kafka_tls(&mut reader_config);
    let records = read_topic(reader_config, &topic, N);
    let mut keys: Vec<String> = records.clone();
    keys.sort();
    keys.dedup();
    assert_eq!((records.len(), keys.len()), (N, N), "{records:?}");
    let delivered = take(&channel, &queue, N + 1, Duration::from_secs(5)).await;
    assert_eq!(delivered.len(), N, "AMQP messages through amqps");
    assert!(
        amqp.handshakes() >= 1,
        "the relay reached RabbitMQ without TLS"
    );
    assert!(kafka.proxy.handshakes() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_amqp_consumer_works_over_amqps_with_a_client_certificate() {
    let ca = TestCa::new("amqp");
    let proxy =
        TlsProxy::start_mutual(&ca, &authority(&onceonly_integration_tests::amqp::url())).await;
    let amqps = format!("amqps://guest:guest@localhost:{}/%2f", proxy.port());
    let (cert, key) = ca.client_identity();
    let tls = AmqpTls::new()
        .ca_pem(ca.ca_pem())
        .client_identity_pem(cert, key);

    let db = pg_schema("amqps").await;
    let store = pg_store(&db, "onceonly_keys").await;
    ledger::postgres::create_tables(store.pool())
        .await
        .expect("ledger");
    let queue = unique("amqps");
    let (_conn, channel) = connect().await;
    declare_queue(&channel, &queue).await;
    let stream = crash_stream("S", 200);
    publish_stream(&channel, &queue, &stream).await;

    let consumer = AmqpConsumer::builder(
        onceonly::Engine::builder(store.clone()).key_expr("json:/out_trade_no"),
    )
    .url(&amqps)
    .tls(tls.clone())
    .queue(&queue)
    .exit_when_idle(Duration::from_secs(2))
    .build()
    .expect("consumer");
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run_until(ledger::postgres::Ledger, CancellationToken::new()),
    )
    .await
    .expect("the consumer did not drain the queue over amqps")
    .expect("consumer failed");
    assert_eq!(stats.consumer.dead_lettered, 0, "{stats:?}");
    assert_exact(store.pool(), &stream.expected).await;
    assert_eq!(depth(&channel, &queue).await, 0, "queue drained");
    assert!(proxy.handshakes() >= 1, "the consumer did not use TLS");

    // Without the client certificate the broker's TLS endpoint refuses the
    // connection: the replay reports it instead of reading anything.
    let handshakes = proxy.handshakes();
    let refused =
        AmqpReplay::builder()
            .url(&amqps)
            .tls(AmqpTls::new().ca_pem(ca.ca_pem()))
            .queue(format!("{queue}.dlq"))
            .options(onceonly::ops::replay::ReplayOptions::new().screen(
                onceonly::ops::replay::Screen::new().retention(Duration::from_secs(86_400)),
            ))
            .build()
            .expect("replay")
            .run()
            .await;
    assert!(
        refused.is_err(),
        "connected without a client certificate: {refused:?}"
    );
    assert_eq!(proxy.handshakes(), handshakes, "no handshake may complete");
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_claims_over_rediss_with_a_private_root() {
    let ca = TestCa::new("redis");
    let redis_url =
        std::env::var("ONCEONLY_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let proxy = TlsProxy::start(&ca, &authority(&redis_url)).await;
    let client = redis::Client::build_with_tls(
        format!("rediss://localhost:{}", proxy.port()),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca.ca_pem().as_bytes().to_vec()),
        },
    )
    .expect("client");
    let conn = redis::aio::ConnectionManager::new(client)
        .await
        .expect("connection over TLS");
    let store = RedisStore::new(conn).with_prefix(unique("tls"));
    let RedisClaim::Claimed(lease) = store.claim("tls", "K-1", None).await.expect("claim") else {
        panic!("a new key must be claimed");
    };
    assert!(store.complete(&lease, b"done").await.expect("complete"));
    match store.claim("tls", "K-1", None).await.expect("claim again") {
        RedisClaim::Done(result) => assert_eq!(result, b"done"),
        other => panic!("expected the stored result, got {other:?}"),
    }
    assert!(proxy.handshakes() >= 1, "the client did not use TLS");

    // A client that trusts only the system roots refuses the test CA.
    let untrusting =
        redis::Client::open(format!("rediss://localhost:{}", proxy.port())).expect("client");
    let refused = tokio::time::timeout(
        Duration::from_secs(10),
        untrusting.get_multiplexed_async_connection(),
    )
    .await
    .expect("a refused handshake fails fast");
    assert!(
        refused.is_err(),
        "a server signed by an unknown CA was accepted"
    );
}

/// Reads `n` records of partition 0 of `topic` from the beginning (their
/// keys), over the client configuration given.
fn read_topic(mut config: ClientConfig, topic: &str, n: usize) -> Vec<String> {
    let consumer: BaseConsumer = config
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, rdkafka::Offset::Beginning)
        .expect("offset");
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut keys = Vec::new();
    // One poll past the n-th record, to see a copy that should not be there.
    while Instant::now() < deadline && keys.len() <= n {
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(m)) => keys.push(String::from_utf8_lossy(m.key().unwrap_or_default()).into()),
            Some(Err(e)) => eprintln!("reader: {e}"),
            None if keys.len() == n => break,
            None => {}
        }
    }
    keys
}

/// A tansu of the test's own, behind a [`TlsProxy`] whose port it
/// advertises: clients can reach it over TLS only.
struct PrivateTansu {
    child: std::process::Child,
    proxy: TlsProxy,
}

impl PrivateTansu {
    async fn start(ca: &TestCa) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let advertised = listener.local_addr().expect("address").port();
        let plain = free_port();
        let child = std::process::Command::new(tansu_binary())
            .args(["broker", "--silent"])
            .args(["--listener-url", &format!("tcp://127.0.0.1:{plain}")])
            .args([
                "--advertised-listener-url",
                &format!("tcp://localhost:{advertised}"),
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", plain)).is_err() {
            assert!(Instant::now() < deadline, "private tansu did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        let proxy = TlsProxy::serve(listener, ca, &format!("127.0.0.1:{plain}"), false);
        Self { child, proxy }
    }

    fn bootstrap(&self) -> String {
        format!("localhost:{}", self.proxy.port())
    }
}

impl Drop for PrivateTansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tansu 0.6.0 binary of `scripts/tansu-bin` (TANSU_BIN, the cache,
/// PATH, else `cargo install`: also where Kafka itself runs under Docker
/// Compose, since this test needs a broker that advertises its proxy).
fn tansu_binary() -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/tansu-bin");
    let out = std::process::Command::new(script)
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/tansu-bin");
    assert!(
        out.status.success(),
        "no tansu 0.6.0 binary and `scripts/tansu-bin` could not install one; set TANSU_BIN"
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
