//! Schema Registry payloads ([`SchemaRegistry`]): Avro, Protobuf and JSON
//! Schema records in the Confluent wire format, written by independent
//! encoders (Python's `fastavro` and Google's `protobuf`, see
//! `fixtures/schema_registry/make.py`), read through a loopback registry
//! (`onceonly_integration_tests::schema_registry`).
//!
//! The decoder gives each record the value tree the fixtures expect; the
//! same values re-encoded under a newer schema id are a duplicate, not a
//! conflict; bad payloads are `decode_error` dead letters; a registry that
//! is down, refuses the credentials or the TLS handshake is waited out;
//! and on Kafka (tansu) every payment is booked once, with the registry
//! down when the consumer starts.

use std::time::{Duration, Instant};

use onceonly::Header;
use onceonly::amqp::AmqpConsumer;
use onceonly::engine::{PayloadDecoder, PayloadError};
use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::schema_registry::SchemaRegistry;
use onceonly::store::InfraFault;
use onceonly::{Delivery, FingerprintSpec, HandlerError, Json, KeySpec, SqlStore, Tx, handler_fn};
use onceonly_integration_tests::amqp::{self, Msg};
use onceonly_integration_tests::kafka::{
    Record, brokers, committed, create_topic, header, pg_schema, produce, read_all,
};
use onceonly_integration_tests::schema_registry::{Fixtures, Registry};
use onceonly_integration_tests::tls::{TestCa, TlsProxy};
use onceonly_integration_tests::{pg_store, unique};
use serde::Deserialize;
use serde_json::Value;
use sqlx::Postgres;

/// A client of `url` that judges an unknown id at once (no grace).
fn registry_at(url: &str) -> SchemaRegistry {
    SchemaRegistry::builder(url)
        .timeout(Duration::from_secs(2))
        .unknown_id_grace(Duration::ZERO)
        .build()
        .expect("registry client")
}

/// The tree `registry` reads from `payload` (a payload it leaves as it is
/// fails the test).
async fn decode(registry: &SchemaRegistry, payload: Vec<u8>) -> Result<Value, PayloadError> {
    registry
        .decode(&Delivery::new(payload))
        .await
        .map(|tree| tree.expect("a value tree, not a payload left as it is"))
}

fn unavailable(result: Result<Value, PayloadError>) -> InfraFault {
    match result {
        Err(PayloadError::Unavailable { fault, .. }) => fault,
        other => panic!("expected the registry to be unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn every_fixture_decodes_to_its_tree_and_bad_payloads_are_malformed() {
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let decoder = registry_at(&registry.url());
    for name in fixtures.names() {
        let got = decode(&decoder, fixtures.payload(&name)).await;
        match (fixtures.expected(&name), got) {
            (Some(expected), Ok(tree)) => assert_eq!(tree, expected, "{name}"),
            (None, Err(PayloadError::Malformed(why))) => {
                eprintln!("{name}: {why}");
                assert!(!why.is_empty(), "{name}: a reason for the dead letter");
            }
            (expected, got) => panic!("{name}: expected {expected:?}, got {got:?}"),
        }
    }
    // Plain JSON beside the wire format, for a topic moving to Avro: left
    // as it is (the engine parses it as JSON, as without a decoder).
    let mixed = SchemaRegistry::builder(registry.url())
        .plain_json(true)
        .build()
        .unwrap();
    for name in ["bad_plain_json", "bad_magic"] {
        let read = mixed.decode(&Delivery::new(fixtures.payload(name))).await;
        assert!(matches!(read, Ok(None)), "{name}: {read:?}");
    }
    assert!(matches!(
        decode(&mixed, fixtures.payload("avro_v1_paid")).await,
        Ok(tree) if Some(&tree) == fixtures.expected("avro_v1_paid").as_ref()
    ));
    // Base path of Apicurio's compatibility API.
    let apicurio = registry_at(&format!("{}/apis/ccompat/v7", registry.url()));
    let tree = decode(&apicurio, fixtures.payload("proto_v1_refund"))
        .await
        .unwrap();
    assert_eq!(Some(tree), fixtures.expected("proto_v1_refund"));
}

#[tokio::test]
async fn a_re_encode_under_a_new_schema_is_the_same_key_and_fingerprint() {
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let decoder = registry_at(&registry.url());
    let key = KeySpec::parse("json:/out_trade_no").unwrap();
    let seen = |name: &'static str| {
        let decoder = decoder.clone();
        let payload = fixtures.payload(name);
        let key = key.clone();
        async move {
            let raw = Delivery::new(payload);
            // What the engine reads: the tree, and the tree the
            // fingerprint reads (Avro defaults left out).
            let decoded = decoder.decode_delivery(&raw).await.unwrap().unwrap();
            (
                key.derive(&decoded).unwrap().into_string(),
                FingerprintSpec::Auto.compute(&decoded).unwrap(),
                FingerprintSpec::Auto.compute(&raw).unwrap(),
            )
        }
    };
    for (v1, v2, changed) in [
        ("avro_v1_paid", "avro_v2_paid", "avro_v2_memo"),
        // Fields added with defaults, filled in by the re-encode.
        ("avro_v1_paid", "avro_v3_paid", "avro_v3_channel"),
        ("avro_v2_paid", "avro_v3_paid", "avro_v3_channel"),
        // Zero values where the defaults are not: not the defaults.
        ("avro_v1_paid", "avro_v3_paid", "avro_v3_zeroed"),
        ("proto_v1_payment", "proto_v2_payment", "proto_v2_memo"),
    ] {
        let (k1, f1, raw1) = seen(v1).await;
        let (k2, f2, raw2) = seen(v2).await;
        let (k3, f3, _) = seen(changed).await;
        assert_ne!(
            raw1, raw2,
            "{v1} and {v2} differ as bytes (another schema id)"
        );
        assert_eq!(
            (&k1, f1),
            (&k2, f2),
            "{v1} and {v2}: same key and fingerprint"
        );
        assert_eq!(k1, k3);
        assert_ne!(
            f1, f3,
            "{changed} carries another value: another fingerprint"
        );
    }
}

/// A topic moving from JSON to Avro: records processed before the move
/// are still duplicates when redelivered to a consumer with the decoder
/// and `plain_json`, zero values included (their key and fingerprint are
/// what they were); an Avro re-encode is one too when the JSON had no
/// member at a zero value (the decoded form leaves those out, the JSON
/// fingerprint kept them).
#[tokio::test]
async fn moving_a_topic_from_json_to_avro_keeps_its_duplicates() {
    use onceonly::{Engine, Outcome};
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let dir = tempfile::tempdir().unwrap();
    let store = onceonly::SqliteStore::open(dir.path().join("move.db"))
        .await
        .unwrap();
    store.migrate().await.unwrap();
    let handler = handler_fn(|_tx: Tx<sqlx::Sqlite>, Json(_): Json<Value>| async move {
        Ok::<_, HandlerError>(())
    });
    let engines = |scope: &str, key: &str| {
        let before = Engine::builder(store.clone())
            .scope(scope)
            .key_expr(key)
            .build()
            .unwrap();
        let decoder = SchemaRegistry::builder(registry.url())
            .plain_json(true)
            .build()
            .unwrap();
        let after = Engine::builder(store.clone())
            .scope(scope)
            .key_expr(key)
            .payload_decoder(decoder)
            .build()
            .unwrap();
        (before, after)
    };
    // The JSON of avro_v1_paid's record, without its null fee.
    let paid = serde_json::json!({
        "out_trade_no": "T-1001", "amount": "123.45", "currency": "CNY",
        "paid_at": 1_796_466_600_000_i64, "status": "PAID",
        "buyer": {"id": "u-7", "tags": ["vip", "cn"]}, "extras": {"channel": "app"},
        "ref": "AQID/w==",
    });
    let mut with_zeros = paid.clone();
    with_zeros["fee"] = Value::Null;
    with_zeros["memo"] = serde_json::json!("");
    for key in ["json:/out_trade_no", "fingerprint"] {
        let (before, after) = engines(&format!("move-{}", key.len()), key);
        let json = Delivery::new(with_zeros.to_string().into_bytes());
        let first = before.process(&handler, &json).await;
        assert!(
            matches!(first.outcome, Outcome::Processed { .. }),
            "{key}: {:?}",
            first.outcome
        );
        let again = after.process(&handler, &json).await;
        assert!(
            matches!(again.outcome, Outcome::Duplicate { .. }),
            "{key}: {:?}",
            again.outcome
        );
    }
    let (before, after) = engines("move-avro", "json:/out_trade_no");
    let json = Delivery::new(paid.to_string().into_bytes());
    assert!(matches!(
        before.process(&handler, &json).await.outcome,
        Outcome::Processed { .. }
    ));
    let avro = Delivery::new(fixtures.payload("avro_v1_paid"));
    let again = after.process(&handler, &avro).await;
    assert!(
        matches!(again.outcome, Outcome::Duplicate { .. }),
        "{:?}",
        again.outcome
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_schema_is_fetched_once_however_many_workers_ask() {
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let decoder = registry_at(&registry.url());
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let decoder = decoder.clone();
            let payload = fixtures.payload(if i % 2 == 0 {
                "avro_ref_refund"
            } else {
                "proto_v1_payment"
            });
            tokio::spawn(async move { decode(&decoder, payload).await.unwrap() })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(registry.fetches_of(3), 1, "{:?}", registry.requests());
    assert_eq!(registry.fetches_of(10), 1, "{:?}", registry.requests());
    assert_eq!(
        registry
            .requests()
            .iter()
            .filter(|p| p.starts_with("/subjects/money-value/versions/1"))
            .count(),
        1,
        "the reference is fetched with its schema"
    );
    assert_eq!(decoder.cached_schemas(), 2);
    // An unknown id is not kept: the registry is asked again (it may have
    // been registered since), and the payload is malformed each time.
    for _ in 0..2 {
        assert!(matches!(
            decode(&decoder, fixtures.payload("bad_unknown_id")).await,
            Err(PayloadError::Malformed(_))
        ));
    }
    assert_eq!(registry.fetches_of(99), 2);
}

#[tokio::test]
async fn soft_deleted_references_and_registries_without_the_id() {
    let fixtures = Fixtures::load();
    let refund = || fixtures.payload("avro_ref_refund");
    // Schema 3 references money-value version 1, since soft-deleted: its
    // records still read, as with Confluent's serializers.
    let registry = Registry::start().await;
    registry.soft_delete("money-value", 1);
    let tree = decode(&registry_at(&registry.url()), refund())
        .await
        .unwrap();
    assert_eq!(Some(tree), fixtures.expected("avro_ref_refund"));

    // A registry without schema 3 (a replica behind, another tenant)
    // listed first: the next one has it.
    let lacking = Registry::start().await;
    lacking.forget(3);
    let both = SchemaRegistry::builder(lacking.url())
        .url(registry.url())
        .build()
        .unwrap();
    assert!(decode(&both, refund()).await.is_ok());
    // While the one that may have it is down, "not found" elsewhere waits.
    let fresh = SchemaRegistry::builder(lacking.url())
        .url(registry.url())
        .unknown_id_grace(Duration::ZERO)
        .build()
        .unwrap();
    registry.set_down(true);
    assert_eq!(
        unavailable(decode(&fresh, refund()).await),
        InfraFault::Unreachable
    );
    // When every registry says so, the id is unknown: a dead letter.
    registry.set_down(false);
    registry.forget(3);
    assert!(matches!(
        decode(&fresh, refund()).await,
        Err(PayloadError::Malformed(why)) if why.contains("40403")
    ));
}

/// Issue 44, defect 9: a schema id no registry URL knows yet (a replica
/// behind the one the producer registered with) is waited for like an
/// outage during the grace, read once the replica has it, and malformed
/// (`decode_error`) only once the grace has passed.
#[tokio::test]
async fn an_unknown_id_is_waited_for_during_the_grace_then_malformed() {
    let fixtures = Fixtures::load();
    let refund = || fixtures.payload("avro_ref_refund");
    let replica = Registry::start().await;
    replica.forget(3);
    let lagging = SchemaRegistry::builder(replica.url())
        .timeout(Duration::from_secs(2))
        .unknown_id_grace(Duration::from_secs(3))
        .build()
        .unwrap();
    assert_eq!(
        unavailable(decode(&lagging, refund()).await),
        InfraFault::Unreachable,
        "an unknown id waits during the grace"
    );
    assert_eq!(
        unavailable(decode(&lagging, refund()).await),
        InfraFault::Unreachable,
        "asked again, still within the grace"
    );
    assert_eq!(replica.fetches_of(3), 2, "the registry is asked each time");
    // Past the grace, an id still unknown is malformed.
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    assert!(matches!(
        decode(&lagging, refund()).await,
        Err(PayloadError::Malformed(why)) if why.contains("40403")
    ));
    // A registry that knows the id is read at once, whatever the grace.
    let full = Registry::start().await;
    let fresh = SchemaRegistry::builder(full.url()).build().unwrap();
    assert!(decode(&fresh, refund()).await.is_ok());
}

#[tokio::test]
async fn an_outage_wrong_credentials_or_a_wrong_url_wait_and_the_next_url_is_tried() {
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let paid = || fixtures.payload("avro_v1_paid");

    registry.set_down(true);
    let plain = registry_at(&registry.url());
    assert_eq!(
        unavailable(decode(&plain, paid()).await),
        InfraFault::Unreachable
    );
    // Not even the unknown id is judged while the registry is down.
    assert_eq!(
        unavailable(decode(&plain, fixtures.payload("bad_unknown_id")).await),
        InfraFault::Unreachable
    );
    registry.set_down(false);
    assert!(
        decode(&plain, paid()).await.is_ok(),
        "resumes once the registry is back"
    );

    registry.require_basic_auth("svc", "right");
    let wrong = SchemaRegistry::builder(registry.url())
        .basic_auth("svc", "wrong")
        .build()
        .unwrap();
    assert_eq!(
        unavailable(decode(&wrong, paid()).await),
        InfraFault::Permission
    );
    let right = SchemaRegistry::builder(registry.url())
        .basic_auth("svc", "right")
        .build()
        .unwrap();
    assert!(decode(&right, paid()).await.is_ok());

    // A URL that is not a registry (404 without a registry error code) is
    // a wrong configuration, not a bad message.
    let lost = SchemaRegistry::builder(format!("{}/not-the-api", registry.url()))
        .basic_auth("svc", "right")
        .build()
        .unwrap();
    assert_eq!(
        unavailable(decode(&lost, paid()).await),
        InfraFault::Corrupt
    );

    // Nothing listens on the first URL: the second answers.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dead_first = SchemaRegistry::builder(format!("http://127.0.0.1:{closed}"))
        .url(registry.url())
        .basic_auth("svc", "right")
        .build()
        .unwrap();
    assert!(decode(&dead_first, paid()).await.is_ok());
    let only_dead = registry_at(&format!("http://127.0.0.1:{closed}"));
    assert_eq!(
        unavailable(decode(&only_dead, paid()).await),
        InfraFault::Unreachable
    );

    // A registry that accepts the connection and never answers is a timeout.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let started = Instant::now();
    assert_eq!(
        unavailable(decode(&registry_at(&silent_url), paid()).await),
        InfraFault::Timeout
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "bounded by the timeout"
    );
    hold.abort();

    assert!(
        SchemaRegistry::builder("http://user:pw@127.0.0.1:1")
            .build()
            .is_err(),
        "credentials in the URL are refused"
    );
}

#[tokio::test]
async fn https_with_a_private_ca_and_mutual_tls() {
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let ca = TestCa::new("registry");
    let proxy = TlsProxy::start(&ca, &registry.address()).await;
    let url = format!("https://localhost:{}", proxy.port());

    let untrusting = registry_at(&url);
    assert_eq!(
        unavailable(decode(&untrusting, fixtures.payload("avro_v1_paid")).await),
        InfraFault::Unreachable,
        "a certificate of an unknown CA is refused, and waited out"
    );
    let trusting = SchemaRegistry::builder(&url)
        .ca_pem(ca.ca_pem())
        .build()
        .unwrap();
    let tree = decode(&trusting, fixtures.payload("avro_v1_paid"))
        .await
        .unwrap();
    assert_eq!(Some(tree), fixtures.expected("avro_v1_paid"));

    let mutual = TlsProxy::start_mutual(&ca, &registry.address()).await;
    let url = format!("https://localhost:{}", mutual.port());
    let anonymous = SchemaRegistry::builder(&url)
        .ca_pem(ca.ca_pem())
        .build()
        .unwrap();
    assert_eq!(
        unavailable(decode(&anonymous, fixtures.payload("proto_v1_payment")).await),
        InfraFault::Unreachable
    );
    let (cert, key) = ca.client_identity();
    let identified = SchemaRegistry::builder(&url)
        .ca_pem(ca.ca_pem())
        .client_identity_pem(format!("{cert}\n{key}"))
        .build()
        .unwrap();
    let tree = decode(&identified, fixtures.payload("proto_v1_payment"))
        .await
        .unwrap();
    assert_eq!(Some(tree), fixtures.expected("proto_v1_payment"));
}

#[derive(Deserialize)]
struct Paid {
    out_trade_no: String,
    /// Avro: a decimal string; JSON Schema: a number; Protobuf: `amount_fen`.
    amount: Option<Value>,
    amount_fen: Option<i64>,
}

/// Stops the consumer task `run`; what it returned.
async fn stopped<T: std::fmt::Debug, E: std::fmt::Debug>(
    stop: CancellationToken,
    run: tokio::task::JoinHandle<Result<T, E>>,
) -> T {
    stop.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the consumer did not stop")
        .expect("consumer task")
        .expect("consumer");
    eprintln!("{stats:?}");
    stats
}

/// Books each payment in `ledger`, counting the handler's runs in `runs`.
fn book() -> impl onceonly::Handler<Postgres, Output = ()> {
    handler_fn(|tx: Tx<Postgres>, Json(paid): Json<Paid>| async move {
        let amount = match paid.amount {
            Some(Value::String(decimal)) => Some(decimal),
            Some(other) => Some(other.to_string()),
            None => paid.amount_fen.map(|fen| fen.to_string()),
        }
        .ok_or_else(|| HandlerError::permanent("no amount"))?;
        let mut conn = tx.lock().await?;
        sqlx::query(
            "INSERT INTO ledger (out_trade_no, amount) VALUES ($1, $2)
             ON CONFLICT (out_trade_no) DO UPDATE SET runs = ledger.runs + 1",
        )
        .bind(&paid.out_trade_no)
        .bind(&amount)
        .execute(&mut *conn)
        .await?;
        Ok::<_, HandlerError>(())
    })
}

async fn ledger_store(prefix: &str) -> onceonly::PgStore {
    let db = pg_schema(prefix).await;
    let store = pg_store(&db, "onceonly_keys").await;
    sqlx::query(
        "CREATE TABLE ledger (out_trade_no text PRIMARY KEY, amount text NOT NULL, runs int NOT NULL DEFAULT 1)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    store
}

async fn ledger(store: &onceonly::PgStore) -> Vec<(String, String, i32)> {
    sqlx::query_as("SELECT out_trade_no, amount, runs FROM ledger ORDER BY out_trade_no")
        .fetch_all(store.pool())
        .await
        .unwrap()
}

fn rows(expected: &[(&str, &str)]) -> Vec<(String, String, i32)> {
    expected
        .iter()
        .map(|(k, a)| ((*k).to_owned(), (*a).to_owned(), 1))
        .collect()
}

/// On Kafka: Avro and Protobuf payments, their re-encodes under newer
/// schema ids, a changed payment and bad payloads, consumed while the
/// registry is down at first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_books_each_payment_once_and_dead_letters_bad_payloads() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let registry = Registry::start().await;
    let fixtures = Fixtures::load();
    let topic = unique("registry");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 1).await;
    create_topic(&dlt, 1).await;
    let store = ledger_store("registry_kafka").await;

    let sent = [
        "avro_v1_paid",
        "proto_v1_payment",
        "bad_magic",
        "avro_v2_paid",     // duplicate of avro_v1_paid
        "proto_v2_payment", // duplicate of proto_v1_payment
        "bad_unknown_id",
        "avro_v2_memo",    // the same key with another value: conflict
        "avro_v3_paid",    // defaults filled in by a re-encode: duplicate
        "avro_v3_channel", // a field added, not at its default: conflict
        "avro_v3_zeroed",  // zero values where the defaults are not: conflict
        "avro_v1_other",
        "bad_plain_json",
        "json_schema",
        "proto_v1_zero", // amount_fen 0: in the tree, as the handler needs it
    ];
    let records: Vec<Record> = sent
        .iter()
        .map(|name| Record::new(*name, fixtures.payload(name)))
        .collect();
    registry.set_down(true);
    let ends = produce(&topic, &records).await;

    let group = unique("registry_group");
    let stop = CancellationToken::new();
    let consumer = KafkaConsumer::builder(
        onceonly::Engine::builder(store.clone())
            .key_expr("json:/out_trade_no")
            .payload_decoder(
                SchemaRegistry::builder(registry.url())
                    .timeout(Duration::from_secs(2))
                    .unknown_id_grace(Duration::from_secs(1))
                    .build()
                    .unwrap(),
            ),
    )
    .brokers(brokers())
    .group_id(&group)
    .topic(&topic)
    .build()
    .unwrap();
    let run = tokio::spawn(consumer.run_until(book(), stop.clone()));

    // The registry is down: nothing is booked, dead-lettered or committed.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let booked: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(booked, 0);
    assert!(
        read_all(&dlt, 1, 1, Duration::from_millis(500)).is_empty(),
        "nothing dead-lettered during the outage"
    );
    assert!(
        committed(&group, &topic, 1).get(&0).is_none_or(|o| *o <= 0),
        "no offset committed during the outage"
    );
    assert!(registry.fetches_of(1) >= 1, "the registry was asked");

    let outage_requests = registry.requests().len();
    registry.set_down(false);
    let letters = read_all(&dlt, 1, 6, Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(30);
    while committed(&group, &topic, 1).get(&0) != ends.get(&0) {
        assert!(
            Instant::now() < deadline,
            "offsets not committed to the end"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stopped(stop, run).await;

    let mut reasons: Vec<(String, String)> = letters
        .iter()
        .map(|m| {
            let key = String::from_utf8(rdkafka::Message::key(m).unwrap().to_vec()).unwrap();
            (key, header(m, Header::Reason.name()).unwrap().to_owned())
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("avro_v2_memo", "fingerprint_mismatch"),
            ("avro_v3_channel", "fingerprint_mismatch"),
            ("avro_v3_zeroed", "fingerprint_mismatch"),
            ("bad_magic", "decode_error"),
            ("bad_plain_json", "decode_error"),
            ("bad_unknown_id", "decode_error"),
        ]
        .map(|(k, r)| (k.to_owned(), r.to_owned()))
    );
    for m in &letters {
        let key = std::str::from_utf8(rdkafka::Message::key(m).unwrap()).unwrap();
        assert_eq!(
            rdkafka::Message::payload(m).unwrap(),
            fixtures.payload(key),
            "{key}: the dead letter carries the original bytes"
        );
    }
    assert_eq!(
        ledger(&store).await,
        rows(&[
            ("T-1001", "123.45"),
            ("T-1002", "-0.05"),
            ("T-2001", "12345"),
            ("T-2002", "0"),
            ("T-3001", "7"),
        ]),
        "each payment booked once, its handler run once"
    );
    // Once back, each schema was fetched once (an unknown id each time
    // it is seen: again and again during its grace).
    let after: Vec<String> = registry.requests()[outage_requests..].to_vec();
    let fetches = |id: u32| {
        let suffix = format!("/schemas/ids/{id}");
        after.iter().filter(|p| p.ends_with(&suffix)).count()
    };
    for id in [1, 2, 5, 10, 11, 20] {
        assert_eq!(fetches(id), 1, "{id}: {after:?}");
    }
    assert!(
        fetches(99) >= 2,
        "the unknown id is asked again during its grace: {after:?}"
    );
}

/// On RabbitMQ, through a registry that wants credentials: Protobuf and
/// Avro payments, a re-encode, and Protobuf payloads that do not match
/// their schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn amqp_books_each_payment_once_and_dead_letters_bad_payloads() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let registry = Registry::start().await;
    registry.require_basic_auth("svc-payments", "s3cret");
    let fixtures = Fixtures::load();
    let store = ledger_store("registry_amqp").await;
    let queue = unique("registry_amqp");
    let dlq = format!("{queue}.dlq");
    let (_conn, channel) = amqp::connect().await;
    amqp::declare_queue(&channel, &queue).await;
    let sent = [
        "proto_v1_payment",
        "bad_proto_index",
        "proto_v2_payment",
        "avro_v1_paid",
        "bad_proto_body",
        "avro_v2_paid",
    ];
    let messages: Vec<Msg> = sent.iter().map(|n| Msg::new(fixtures.payload(n))).collect();
    amqp::publish(&channel, &queue, &messages).await;

    let stop = CancellationToken::new();
    let run = tokio::spawn(
        AmqpConsumer::builder(
            onceonly::Engine::builder(store.clone())
                .key_expr("json:/out_trade_no")
                .payload_decoder(
                    SchemaRegistry::builder(registry.url())
                        .basic_auth("svc-payments", "s3cret")
                        .unknown_id_grace(Duration::from_secs(1))
                        .build()
                        .unwrap(),
                ),
        )
        .url(amqp::url())
        .queue(&queue)
        .build()
        .expect("consumer")
        .run_until(book(), stop.clone()),
    );
    // The consumer declares the dead-letter queue as it starts.
    let deadline = Instant::now() + Duration::from_secs(30);
    while amqp::depth(&channel, &queue).await > 0 || ledger(&store).await.len() < 2 {
        assert!(Instant::now() < deadline, "the queue was not drained");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = amqp::take(&channel, &dlq, 2, Duration::from_secs(30)).await;
    let stats = stopped(stop, run).await;
    let mut bodies: Vec<Vec<u8>> = letters.iter().map(|m| m.delivery.data.clone()).collect();
    bodies.sort();
    let mut bad = vec![
        fixtures.payload("bad_proto_index"),
        fixtures.payload("bad_proto_body"),
    ];
    bad.sort();
    assert_eq!(
        bodies, bad,
        "the two bad payloads dead-lettered as they were"
    );
    for m in &letters {
        assert_eq!(
            amqp::header(&m.delivery.properties, Header::Reason.name()).as_deref(),
            Some("decode_error")
        );
    }
    assert_eq!(
        ledger(&store).await,
        rows(&[("T-1001", "123.45"), ("T-2001", "12345")]),
        "each payment booked once, its handler run once"
    );
    assert_eq!(stats.consumer.duplicates, 2, "{stats:?}");
}
