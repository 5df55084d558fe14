//! OpenTelemetry (feature `otel`), through the SDK's in-memory exporter:
//! one trace connects an inbound HTTP request, the outbox message its
//! handler enqueues, the relay's publish to Kafka (tansu) and the Kafka
//! consumer that processes it, with `tracestate` and baggage carried along;
//! a dead letter (Kafka and RabbitMQ) continues the trace of the delivery
//! that failed. The parent ids and the messaging attributes are asserted
//! span by span.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::post;
use onceonly::Header;
use onceonly::http::{IdempotencyLayer, Tx as HttpTx};
use onceonly::kafka::{CancellationToken, KafkaConsumer};
use onceonly::outbox::{KafkaPublisher, Outbox, OutboxMessage, Relay, Status};
use onceonly::{HandlerError, Json, SqlStore, Tx, handler_fn};
use onceonly_integration_tests::amqp::{self, Msg};
use onceonly_integration_tests::kafka::{
    Record, brokers, create_topic, header, pg_schema, produce, read_all,
};
use onceonly_integration_tests::{pg_store, unique};
use opentelemetry::propagation::TextMapCompositePropagator;
use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::Value;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The exporter and provider every test of this binary records with.
fn telemetry() -> &'static (InMemorySpanExporter, SdkTracerProvider) {
    static TELEMETRY: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    TELEMETRY.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
            Box::new(TraceContextPropagator::new()),
            Box::new(BaggagePropagator::new()),
        ]));
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("onceonly-tests")))
            .try_init()
            .expect("the tracing subscriber");
        (exporter, provider)
    })
}

/// A remote parent: a fresh trace id and span id, as an upstream service
/// would send them.
fn remote_parent() -> (TraceId, SpanId, String) {
    let trace = TraceId::from_bytes(rand_bytes());
    let mut span = [0u8; 8];
    span.copy_from_slice(&rand_bytes()[..8]);
    let span = SpanId::from_bytes(span);
    let header = format!("00-{trace}-{span}-01");
    (trace, span, header)
}

fn rand_bytes() -> [u8; 16] {
    *uuid::Uuid::new_v4().as_bytes()
}

/// The finished spans of `trace`, once `n` of them are there.
fn spans_of(trace: TraceId, n: usize) -> Vec<SpanData> {
    let (exporter, provider) = telemetry();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        provider.force_flush().expect("flush");
        let spans: Vec<SpanData> = exporter
            .get_finished_spans()
            .expect("spans")
            .into_iter()
            .filter(|s| s.span_context.trace_id() == trace)
            .collect();
        if spans.len() >= n || Instant::now() > deadline {
            return spans;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// The one span named `name` whose `transport` attribute is `transport`
/// (any, if `None`).
fn the<'a>(spans: &'a [SpanData], name: &str, transport: Option<&str>) -> &'a SpanData {
    let found: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| transport.is_none_or(|t| attr(s, "transport").as_deref() == Some(t)))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one {name} span ({transport:?}) in {:#?}",
        spans
            .iter()
            .map(|s| (&s.name, attr(s, "transport")))
            .collect::<Vec<_>>()
    );
    found[0]
}

/// The span id in a `traceparent` header value.
fn span_in(traceparent: &str) -> String {
    traceparent.split('-').nth(2).unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_trace_from_the_http_request_through_the_outbox_and_kafka_to_the_consumer() {
    telemetry();
    let url = pg_schema("otel").await;
    let store = pg_store(&url, "onceonly_keys").await;
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE shipped (id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let outbox = Outbox::<sqlx::Postgres>::new();
    outbox.migrate(&pool).await.expect("outbox");
    let topic = unique("otel_orders");
    create_topic(&topic, 1).await;

    // The HTTP app: an order route that books the order and enqueues an
    // "order placed" record for Kafka in the request's transaction.
    let route = {
        let (outbox, topic) = (outbox.clone(), topic.clone());
        move |tx: HttpTx<sqlx::Postgres>, body: Bytes| {
            let (outbox, topic) = (outbox.clone(), topic.clone());
            async move {
                let order: Value =
                    serde_json::from_slice(&body).map_err(|_| StatusCode::BAD_REQUEST)?;
                let id = order["order"].as_str().unwrap_or_default().to_owned();
                let mut tx = tx
                    .lock()
                    .await
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                    .bind(&id)
                    .execute(&mut *tx)
                    .await
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                outbox
                    .enqueue(
                        &mut tx,
                        OutboxMessage::kafka(&topic, id.clone(), body.to_vec()),
                    )
                    .await
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                Ok::<_, StatusCode>(StatusCode::CREATED)
            }
        }
    };
    let app = Router::new().route("/orders", post(route)).layer(
        IdempotencyLayer::idempotency_key(store.clone(), "orders")
            .build()
            .expect("layer"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let (trace, upstream, traceparent) = remote_parent();
    let answer = reqwest::Client::new()
        .post(format!("http://{addr}/orders"))
        .header("Idempotency-Key", "order-1")
        .header("content-type", "application/json")
        .header("traceparent", &traceparent)
        .header("tracestate", "shop=eu1")
        .header("baggage", "tenant=acme")
        .body(r#"{"order":"order-1"}"#)
        .send()
        .await
        .expect("request");
    assert_eq!(answer.status(), 201);
    server.abort();

    // The relay publishes the record to Kafka.
    let relay = Relay::builder(pool.clone(), outbox.clone())
        .publisher(KafkaPublisher::new(&brokers()).expect("publisher"))
        .poll_interval(Duration::from_millis(50))
        .build()
        .expect("relay")
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(30);
    while outbox.stats(&pool).await.unwrap().rows(Status::Sent) < 1 {
        assert!(Instant::now() < deadline, "the relay did not publish");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.stop().await;
    let record = read_all(&topic, 1, 1, Duration::from_secs(10))
        .pop()
        .expect("the record");

    // A Kafka consumer ships the order.
    let shipping = handler_fn(
        |tx: Tx<sqlx::Postgres>, Json(order): Json<Value>| async move {
            let mut conn = tx.lock().await?;
            sqlx::query("INSERT INTO shipped (id) VALUES ($1)")
                .bind(order["order"].as_str())
                .execute(&mut *conn)
                .await?;
            Ok::<_, HandlerError>(())
        },
    );
    let stats = KafkaConsumer::builder(
        onceonly::Engine::builder(store.clone()).key_expr("header:x-onceonly-message-id"),
    )
    .brokers(brokers())
    .group_id(unique("otel_shipping"))
    .topic(&topic)
    .exit_when_idle(Duration::from_secs(2))
    .build()
    .expect("consumer")
    .run_until(shipping, CancellationToken::new())
    .await
    .expect("consumer");
    assert_eq!(stats.processed, 1);

    let spans = spans_of(trace, 3);
    let http = the(&spans, "onceonly.delivery", Some("http"));
    // The publish that went through (a first attempt may have failed on a
    // topic the broker was still creating).
    let sent: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == "onceonly.publish" && attr(s, "outcome").as_deref() == Some("sent"))
        .collect();
    assert_eq!(sent.len(), 1, "one publish sent");
    let publish = sent[0];
    let consume = the(&spans, "onceonly.delivery", Some("kafka"));
    // The tree: upstream -> HTTP delivery -> publish -> Kafka delivery.
    assert_eq!(
        http.parent_span_id, upstream,
        "the request's span is a child of the caller's"
    );
    assert!(http.parent_span_is_remote);
    assert_eq!(http.span_kind, SpanKind::Server);
    assert_eq!(attr(http, "outcome").as_deref(), Some("processed"));
    // Issue 44, defect 14: the HTTP server span conventions.
    assert_eq!(attr(http, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(attr(http, "http.route").as_deref(), Some("/orders"));
    assert_eq!(
        attr(http, "http.response.status_code").as_deref(),
        Some("201")
    );
    assert_eq!(
        publish.parent_span_id,
        http.span_context.span_id(),
        "the publish is a child of the request that enqueued it"
    );
    assert_eq!(publish.span_kind, SpanKind::Producer);
    assert_eq!(
        consume.parent_span_id,
        publish.span_context.span_id(),
        "the consumer's delivery is a child of the publish"
    );
    assert_eq!(consume.span_kind, SpanKind::Consumer);
    // The messaging conventions, on both sides.
    let message_id = header(&record, Header::MessageId.name())
        .expect("id")
        .to_owned();
    for span in [publish, consume] {
        assert_eq!(attr(span, "messaging.system").as_deref(), Some("kafka"));
        assert_eq!(
            attr(span, "messaging.destination.name").as_deref(),
            Some(topic.as_str())
        );
        assert_eq!(
            attr(span, "messaging.message.id").as_deref(),
            Some(message_id.as_str())
        );
    }
    assert_eq!(
        attr(publish, "messaging.operation.type").as_deref(),
        Some("send")
    );
    assert_eq!(attr(publish, "outcome").as_deref(), Some("sent"));
    assert_eq!(
        attr(consume, "messaging.operation.type").as_deref(),
        Some("process")
    );
    assert_eq!(attr(consume, "outcome").as_deref(), Some("processed"));
    // The record carries the publish's context, the caller's tracestate
    // and baggage.
    {
        use rdkafka::Message as _;
        use rdkafka::message::Headers as _;
        let count = record.headers().map_or(0, |h| {
            h.iter()
                .filter(|h| h.key.eq_ignore_ascii_case("traceparent"))
                .count()
        });
        assert_eq!(count, 1, "one trace context per message");
    }
    let sent = header(&record, "traceparent").expect("traceparent");
    assert!(sent.contains(&trace.to_string()), "{sent}");
    assert_eq!(span_in(sent), publish.span_context.span_id().to_string());
    assert_eq!(header(&record, "tracestate"), Some("shop=eu1"));
    assert!(
        header(&record, "baggage").is_some_and(|b| b.contains("tenant=acme")),
        "{:?}",
        header(&record, "baggage")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_continue_the_trace_of_the_delivery_that_failed() {
    telemetry();
    let url = pg_schema("otel_dl").await;
    let store = pg_store(&url, "onceonly_keys").await;
    let refuse = || {
        handler_fn(
            |_tx: Tx<sqlx::Postgres>, Json(_v): Json<Value>| async move {
                Err::<(), _>(HandlerError::permanent("refused"))
            },
        )
    };

    // Kafka.
    let topic = unique("otel_dl");
    let dlt = format!("{topic}.dlt");
    create_topic(&topic, 1).await;
    create_topic(&dlt, 1).await;
    let (trace, upstream, traceparent) = remote_parent();
    produce(
        &topic,
        &[Record::new("k", r#"{"id":"k-1"}"#).header("traceparent", &traceparent)],
    )
    .await;
    KafkaConsumer::builder(onceonly::Engine::builder(store.clone()).key_expr("json:/id"))
        .brokers(brokers())
        .group_id(unique("otel_dl"))
        .topic(&topic)
        .exit_when_idle(Duration::from_secs(2))
        .build()
        .expect("consumer")
        .run_until(refuse(), CancellationToken::new())
        .await
        .expect("consumer");
    let letter = read_all(&dlt, 1, 1, Duration::from_secs(10))
        .pop()
        .expect("dead letter");
    let spans = spans_of(trace, 1);
    let delivery = the(&spans, "onceonly.delivery", Some("kafka"));
    assert_eq!(delivery.parent_span_id, upstream);
    assert_eq!(attr(delivery, "outcome").as_deref(), Some("failed"));
    let carried = header(&letter, "traceparent").expect("traceparent");
    assert_eq!(
        span_in(carried),
        delivery.span_context.span_id().to_string()
    );

    // RabbitMQ.
    let queue = unique("otel_dl_amqp");
    let dlq = format!("{queue}.dlq");
    let (_conn, channel) = amqp::connect().await;
    amqp::declare_queue(&channel, &queue).await;
    let (trace, upstream, traceparent) = remote_parent();
    amqp::publish(
        &channel,
        &queue,
        &[Msg {
            headers: vec![("traceparent".to_owned(), traceparent.clone())],
            ..Msg::new(r#"{"id":"a-1"}"#)
        }],
    )
    .await;
    onceonly::amqp::AmqpConsumer::builder(onceonly::Engine::builder(store).key_expr("json:/id"))
        .url(amqp::url())
        .queue(&queue)
        .exit_when_idle(Duration::from_secs(2))
        .build()
        .expect("consumer")
        .run_until(refuse(), CancellationToken::new())
        .await
        .expect("consumer");
    let letters = amqp::take(&channel, &dlq, 1, Duration::from_secs(10)).await;
    assert_eq!(letters.len(), 1);
    let spans = spans_of(trace, 1);
    let delivery = the(&spans, "onceonly.delivery", Some("amqp"));
    assert_eq!(
        delivery.parent_span_id, upstream,
        "AMQP headers are read too"
    );
    assert_eq!(delivery.span_kind, SpanKind::Consumer);
    assert_eq!(
        attr(delivery, "messaging.system").as_deref(),
        Some("rabbitmq")
    );
    assert_eq!(
        attr(delivery, "messaging.destination.name").as_deref(),
        Some(queue.as_str())
    );
    let carried =
        amqp::header(&letters[0].delivery.properties, "traceparent").expect("traceparent");
    assert_eq!(
        span_in(&carried),
        delivery.span_context.span_id().to_string()
    );
}

/// The examples export their spans over OTLP/HTTP when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set: `payment_webhook` (a child
/// process) sends the span of a callback that carried a `traceparent` to a
/// loopback OTLP receiver, in the caller's trace, when it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payment_webhook_example_exports_its_spans_over_otlp() {
    use std::sync::{Arc, Mutex};
    // The receiver: every body POSTed to /v1/traces.
    let bodies: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let receiver = Router::new().route(
        "/v1/traces",
        post({
            let bodies = Arc::clone(&bodies);
            move |body: Bytes| {
                let bodies = Arc::clone(&bodies);
                async move {
                    bodies.lock().unwrap().push(body.to_vec());
                    StatusCode::OK
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, receiver).await });

    let dir = tempfile::tempdir().unwrap();
    let app = onceonly_integration_tests::free_port();
    let child = onceonly_integration_tests::child::Logged::new("otlp_webhook")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{otlp}"))
        .env("OTEL_SERVICE_NAME", "payments-webhook");
    let webhook = child.spawn(
        "payment_webhook",
        &[
            "--listen".into(),
            format!("127.0.0.1:{app}"),
            "--database-url".into(),
            format!("sqlite://{}?mode=rwc", dir.path().join("w.db").display()),
        ],
    );
    let (trace, _, traceparent) = remote_parent();
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sent = client
            .post(format!("http://127.0.0.1:{app}/webhooks/payments"))
            .header("traceparent", &traceparent)
            .json(&onceonly_integration_tests::pay("OT-1", 5).account("alice"))
            .send()
            .await;
        match sent {
            Ok(r) => {
                assert!(r.status().is_success(), "{}", r.status());
                break;
            }
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the example did not answer: {e}; log:\n{}", child.tail()),
        }
    }
    // Ctrl-C: the example stops and flushes its spans.
    let pid = webhook.id().expect("pid").to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .expect("kill")
            .success()
    );
    child.finishes(webhook, Duration::from_secs(30)).await;
    server.abort();
    let bodies = bodies.lock().unwrap();
    let exported = bodies.iter().any(|b| {
        contains(b, b"onceonly.delivery")
            && contains(b, &trace.to_bytes())
            && contains(b, b"payments-webhook")
    });
    assert!(
        exported,
        "no OTLP export of the callback's span in the caller's trace ({} bodies); log:\n{}",
        bodies.len(),
        child.tail()
    );
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
