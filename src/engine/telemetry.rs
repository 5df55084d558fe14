//! The metric handles and span settings an engine records with, resolved
//! once per scope and transport (the names and labels are defined once, in
//! [`crate::telemetry`]).

use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Histogram, SharedString};
use tracing::Span;
use tracing::field::Empty;

use super::OutcomeKind;
use crate::redact::KeyRedaction;
use crate::telemetry::{
    CLAIM_DURATION_SECONDS, COMMIT_DURATION_SECONDS, DEADLINE_MISSES_TOTAL, DELIVERIES_TOTAL,
    HANDLER_DURATION_SECONDS, LABEL_OUTCOME, LABEL_REASON, LABEL_SCOPE, LABEL_TRANSPORT,
    RETRIED_TOTAL,
};

const OUTCOMES: [OutcomeKind; 6] = [
    OutcomeKind::Processed,
    OutcomeKind::Duplicate,
    OutcomeKind::Conflict,
    OutcomeKind::Rejected,
    OutcomeKind::Failed,
    OutcomeKind::Stale,
];

/// The metric handles and span settings of one scope and transport,
/// resolved once when an engine, consumer or layer is built.
#[derive(Clone)]
pub(crate) struct Telemetry {
    scope: SharedString,
    transport: &'static str,
    redaction: KeyRedaction,
    outcomes: [Counter; 6],
    handler: Histogram,
    claim: Histogram,
    commit: Histogram,
    deadline_misses: Counter,
}

impl Telemetry {
    /// Resolves the handles of `scope` and `transport` with the recorder
    /// installed now.
    pub(crate) fn new(scope: &str, transport: &'static str, redaction: KeyRedaction) -> Self {
        let scope = SharedString::from(Arc::<str>::from(scope));
        let outcomes = OUTCOMES.map(|kind| {
            metrics::counter!(
                DELIVERIES_TOTAL,
                LABEL_SCOPE => scope.clone(),
                LABEL_TRANSPORT => transport,
                LABEL_OUTCOME => kind.as_str(),
            )
        });
        // Each handle spelled out: the alerts test reads the metric names
        // and kinds from these calls.
        let handler = metrics::histogram!(
            HANDLER_DURATION_SECONDS,
            LABEL_SCOPE => scope.clone(),
            LABEL_TRANSPORT => transport,
        );
        let claim = metrics::histogram!(
            CLAIM_DURATION_SECONDS,
            LABEL_SCOPE => scope.clone(),
            LABEL_TRANSPORT => transport,
        );
        let commit = metrics::histogram!(
            COMMIT_DURATION_SECONDS,
            LABEL_SCOPE => scope.clone(),
            LABEL_TRANSPORT => transport,
        );
        let deadline_misses = metrics::counter!(
            DEADLINE_MISSES_TOTAL,
            LABEL_SCOPE => scope.clone(),
            LABEL_TRANSPORT => transport,
        );
        Self {
            scope,
            transport,
            redaction,
            outcomes,
            handler,
            claim,
            commit,
            deadline_misses,
        }
    }

    /// The scope label.
    #[cfg(feature = "_broker")]
    pub(crate) fn scope(&self) -> &str {
        &self.scope
    }

    /// The transport label.
    #[cfg(feature = "_broker")]
    pub(crate) fn transport(&self) -> &'static str {
        self.transport
    }

    /// The gauge of this scope's deliveries waiting for the infrastructure
    /// (resolved per call: once per consumer).
    #[cfg(feature = "_broker")]
    pub(crate) fn waiting_gauge(&self) -> metrics::Gauge {
        metrics::gauge!(
            crate::telemetry::WAITING_ON_INFRASTRUCTURE,
            LABEL_SCOPE => self.scope.clone(),
            LABEL_TRANSPORT => self.transport,
        )
    }

    /// The gauge of this consumer's pause (see [`crate::PausePolicy`]),
    /// resolved per call: once per consumer.
    #[cfg(feature = "_broker")]
    pub(crate) fn paused_gauge(&self) -> metrics::Gauge {
        metrics::gauge!(
            crate::telemetry::CONSUMER_PAUSED,
            LABEL_SCOPE => self.scope.clone(),
            LABEL_TRANSPORT => self.transport,
        )
    }

    /// The counter of this consumer's pauses, resolved per call: once per
    /// consumer.
    #[cfg(feature = "_broker")]
    pub(crate) fn pauses_counter(&self) -> metrics::Counter {
        metrics::counter!(
            crate::telemetry::CONSUMER_PAUSES_TOTAL,
            LABEL_SCOPE => self.scope.clone(),
            LABEL_TRANSPORT => self.transport,
        )
    }

    /// Counts one outcome and records it on `span`; a duplicate is logged
    /// at `debug` (it is not an error).
    pub(crate) fn outcome(&self, span: &Span, kind: OutcomeKind) {
        if let Some(i) = OUTCOMES.iter().position(|k| *k == kind) {
            self.outcomes[i].increment(1);
        }
        Self::record_outcome(span, kind);
        match kind {
            OutcomeKind::Duplicate => {
                tracing::debug!("duplicate: already committed, handler not run");
            }
            OutcomeKind::Stale => {
                tracing::info!("stale: older than its entity's state, handler not run");
            }
            _ => {}
        }
    }

    /// Records `kind` on `span` without counting it (already counted).
    pub(crate) fn record_outcome(span: &Span, kind: OutcomeKind) {
        span.record("outcome", kind.as_str());
    }

    /// Time spent in the handler.
    pub(crate) fn handler_time(&self, elapsed: Duration) {
        self.handler.record(elapsed.as_secs_f64());
    }

    /// Time of a claim, from `BEGIN` to the store's answer.
    pub(crate) fn claim_time(&self, elapsed: Duration) {
        self.claim.record(elapsed.as_secs_f64());
    }

    /// Time of a commit.
    pub(crate) fn commit_time(&self, elapsed: Duration) {
        self.commit.record(elapsed.as_secs_f64());
    }

    /// One retry scheduled. Rare: the handle is resolved per call.
    pub(crate) fn retried(&self, reason: &'static str) {
        metrics::counter!(
            RETRIED_TOTAL,
            LABEL_SCOPE => self.scope.clone(),
            LABEL_TRANSPORT => self.transport,
            LABEL_REASON => reason,
        )
        .increment(1);
    }

    /// A handler was given up at the transaction deadline.
    pub(crate) fn deadline_missed(&self) {
        self.deadline_misses.increment(1);
    }

    /// One delivery dead-lettered. Rare: the handle is resolved per call.
    #[cfg(feature = "_broker")]
    pub(crate) fn dead_lettered(&self, reason: &'static str) {
        metrics::counter!(
            crate::telemetry::DEAD_LETTERED_TOTAL,
            LABEL_SCOPE => self.scope.clone(),
            LABEL_TRANSPORT => self.transport,
            LABEL_REASON => reason,
        )
        .increment(1);
    }

    /// A new delivery span (see the [module documentation](self)).
    pub(crate) fn span(&self, delivery: &crate::Delivery) -> Span {
        let message_id = delivery
            .metadata(crate::Header::MessageId.name())
            .and_then(|id| std::str::from_utf8(id).ok());
        self.span_of(delivery.source(), message_id)
    }

    /// The span of a delivery from `source` (see [`span`](Self::span)),
    /// before the delivery itself exists (the HTTP layer's).
    pub(crate) fn span_of(&self, source: Option<&str>, message_id: Option<&str>) -> Span {
        // The OpenTelemetry messaging conventions, for brokers: the system,
        // the topic or queue (the source's first segment), the message id
        // when the message carries one (an outbox message's).
        let system = match self.transport {
            crate::telemetry::TRANSPORT_KAFKA => Some("kafka"),
            crate::telemetry::TRANSPORT_AMQP => Some("rabbitmq"),
            _ => None,
        };
        let destination = system.and(source).map(|s| s.split('/').next().unwrap_or(s));
        let message_id = system.and(message_id);
        let kind = match (system, self.transport) {
            (Some(_), _) => "consumer",
            (None, crate::telemetry::TRANSPORT_HTTP) => "server",
            (None, _) => "internal",
        };
        tracing::info_span!(
            "onceonly.delivery",
            scope = &*self.scope,
            transport = self.transport,
            source,
            key = Empty,
            outcome = Empty,
            otel.kind = kind,
            messaging.system = system,
            messaging.operation.type = system.map(|_| "process"),
            messaging.destination.name = destination,
            messaging.message.id = message_id,
            http.request.method = Empty,
            http.route = Empty,
            http.response.status_code = Empty,
        )
    }

    /// How keys are shown in spans and logs.
    pub(crate) fn redaction(&self) -> &KeyRedaction {
        &self.redaction
    }

    /// Records the key on `span`, as the redaction shows it.
    pub(crate) fn record_key(&self, span: &Span, key: &str) {
        if span.is_disabled() {
            return;
        }
        span.record("key", &*self.redaction.show(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_table_matches_the_kinds() {
        let names: Vec<_> = OUTCOMES.iter().map(OutcomeKind::as_str).collect();
        assert_eq!(
            names,
            [
                "processed",
                "duplicate",
                "conflict",
                "rejected",
                "failed",
                "stale"
            ]
        );
    }
}
