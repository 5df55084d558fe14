//! The demo apps' logs (to stderr) and, run with
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (e.g. `http://127.0.0.1:4318`) or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (e.g. `http://127.0.0.1:4318/v1/traces`) set,
//! OpenTelemetry traces exported over OTLP/HTTP: each delivery's
//! `onceonly.delivery` span continues the trace its message or request
//! carries (W3C `traceparent`, `tracestate`, `baggage`), and relayed
//! outbox messages carry their own. `OTEL_SERVICE_NAME` names the service
//! (default: the example's name).

/// Keeps the trace exporter alive; dropping it flushes the spans not sent
/// yet.
pub struct Tracing {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

/// Installs the logs and, when configured, the OTLP trace export.
pub fn init(service: &str) -> Tracing {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    // INFO and above, as `tracing_subscriber::fmt()` logs by default (and
    // exports: no span per SQL statement).
    let registry = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::LevelFilter::INFO)
        .with(logs);
    // Either variable the OTLP exporter reads: the general endpoint, or
    // the traces' own (a traces endpoint alone must not export nothing).
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
    {
        match otlp(service) {
            Ok(provider) => {
                use opentelemetry::trace::TracerProvider as _;
                let tracer = provider.tracer("onceonly");
                registry
                    .with(tracing_opentelemetry::layer().with_tracer(tracer))
                    .init();
                return Tracing {
                    provider: Some(provider),
                };
            }
            Err(e) => eprintln!("OTLP trace export not started: {e}"),
        }
    }
    registry.init();
    Tracing { provider: None }
}

/// The OTLP/HTTP exporter (endpoint and headers from the standard
/// `OTEL_EXPORTER_OTLP_*` variables), batched, and the W3C propagators.
fn otlp(
    service: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, Box<dyn std::error::Error>> {
    use opentelemetry::propagation::TextMapCompositePropagator;
    use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()?;
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_owned());
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(name)
                .build(),
        )
        .build();
    opentelemetry::global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
    Ok(provider)
}

impl Drop for Tracing {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("flushing traces: {e}");
        }
    }
}
