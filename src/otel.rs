//! OpenTelemetry context propagation (feature `otel`): the one place that
//! reads a trace context out of message headers and writes one into them,
//! through the application's global propagator
//! ([`opentelemetry::global::set_text_map_propagator`]; W3C
//! `traceparent`/`tracestate` and `baggage` with the SDK's
//! `TraceContextPropagator` and `BaggagePropagator`), and the spans a
//! [`tracing_opentelemetry`] layer exports.
//!
//! Without a propagator (the default is a no-op one) or without the
//! `tracing_opentelemetry` layer in the subscriber, nothing here changes a
//! header: an inbound `traceparent` is still passed on verbatim.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::delivery::Delivery;

/// Header pairs, as messages and outbox rows carry them.
pub(crate) type Headers = Vec<(String, String)>;

/// Reads a delivery's headers (its metadata), as UTF-8.
struct DeliveryHeaders<'a>(&'a Delivery);

impl Extractor for DeliveryHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .metadata_entries()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .and_then(|(_, value)| std::str::from_utf8(value).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.metadata_entries().map(|(name, _)| name).collect()
    }
}

/// Reads an HTTP request's headers.
#[cfg(feature = "http")]
struct HttpHeaders<'a>(&'a axum::http::HeaderMap);

#[cfg(feature = "http")]
impl Extractor for HttpHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(axum::http::HeaderName::as_str).collect()
    }
}

/// Makes `span` a child of the trace context of an HTTP request's headers.
#[cfg(feature = "http")]
pub(crate) fn adopt_http(span: &Span, headers: &axum::http::HeaderMap) {
    let parent =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HttpHeaders(headers)));
    adopt_context(span, parent);
}

/// Reads header pairs.
struct Pairs<'a>(&'a [(String, String)]);

impl Extractor for Pairs<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .map(|(_, value)| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_str()).collect()
    }
}

/// Collects what a propagator writes.
struct Collect(Vec<(String, String)>);

impl Injector for Collect {
    fn set(&mut self, key: &str, value: String) {
        // The W3C propagator writes an empty `tracestate` for a context
        // without one: no header rather than an empty one.
        if !value.is_empty() {
            self.0.push((key.to_owned(), value));
        }
    }
}

/// Makes `span` a child of the trace context in `delivery`'s headers (and
/// gives it their baggage), if they carry one the global propagator reads
/// and no span of the application's is current.
pub(crate) fn adopt(span: &Span, delivery: &Delivery) {
    let parent =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&DeliveryHeaders(delivery)));
    adopt_context(span, parent);
}

/// Makes `span` a child of the trace context in `headers`, if any.
pub(crate) fn adopt_headers(span: &Span, headers: &[(String, String)]) {
    let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&Pairs(headers)));
    adopt_context(span, parent);
}

fn adopt_context(span: &Span, parent: opentelemetry::Context) {
    // Inside a span of the application's (its own request span, a job's
    // span) the delivery stays that span's child: re-parenting it would
    // tear the handler's spans away from the application's trace.
    if Span::current().context().span().span_context().is_valid() {
        return;
    }
    if parent.span().span_context().is_valid() {
        // An error means the span was already started with another parent
        // or is not recorded by an OpenTelemetry layer: nothing to adopt.
        let _ = span.set_parent(parent);
    }
}

/// The headers the global propagator writes for `span`'s context
/// (`traceparent`, `tracestate`, `baggage`), empty when the span is not
/// recorded by an OpenTelemetry layer.
pub(crate) fn headers_of(span: &Span) -> Headers {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut out = Collect(Vec::new());
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut out));
    out.0
}

/// The current span's context as headers (see [`headers_of`]): what a copy
/// of a message (a dead letter, a retry copy) sent now carries.
pub(crate) fn current() -> Headers {
    headers_of(&Span::current())
}

/// Whether header `name` is one of `context`'s (header names compare
/// without case).
pub(crate) fn names(context: &[(String, String)], name: &str) -> bool {
    context.iter().any(|(n, _)| n.eq_ignore_ascii_case(name))
}

/// Replaces, in `headers`, the headers of `span`'s context (when it has
/// one): a relayed outbox message then continues the trace of the span
/// that sent it.
pub(crate) fn carry(headers: &mut Headers, span: &Span) {
    let context = headers_of(span);
    if context.is_empty() {
        return;
    }
    headers.retain(|(name, _)| !names(&context, name));
    headers.extend(context);
}

/// The current span's context for an outbox row, if a span is recorded:
/// its `traceparent` (none if the propagator writes another format) and
/// its other headers (`tracestate`, `baggage`).
pub(crate) fn current_for_outbox() -> Option<(Option<String>, Headers)> {
    let mut context = current();
    if context.is_empty() {
        return None;
    }
    let traceparent = context
        .iter()
        .position(|(n, _)| n.eq_ignore_ascii_case(crate::outbox::TRACEPARENT_HEADER))
        .map(|i| context.remove(i).1);
    Some((traceparent, context))
}
