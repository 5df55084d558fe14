//! Waiting out an infrastructure outage in place (see
//! [`Decision::Wait`](crate::engine::Decision::Wait)): the
//! `onceonly_waiting_on_infrastructure` gauge, and a log that speaks once
//! per change of state (a fault starts, changes class, ends) rather than
//! once per attempt.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use metrics::Gauge;
use tokio_util::sync::CancellationToken;

use super::shutdown::sleep_unless;
use crate::engine::Telemetry;
use crate::store::InfraFault;

/// The longest pause between two attempts of a delivery waiting for the
/// infrastructure, before jitter (which adds up to as much again): short
/// enough that a delivery notices a healed network within seconds.
const INFRA_WAIT_MAX: Duration = Duration::from_secs(4);

/// The deliveries of one consumer waiting for the infrastructure: the
/// gauge, and the state that makes the log speak once per change.
pub(crate) struct Waits {
    telemetry: Telemetry,
    gauge: Gauge,
    state: Mutex<WaitState>,
}

#[derive(Default)]
struct WaitState {
    waiting: usize,
    fault: Option<InfraFault>,
    since: Option<Instant>,
}

impl Waits {
    /// The waits of the consumer recording with `telemetry` (the gauge's
    /// handle is resolved here, once).
    pub(crate) fn new(telemetry: &Telemetry) -> Arc<Self> {
        Arc::new(Self {
            gauge: telemetry.waiting_gauge(),
            telemetry: telemetry.clone(),
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, WaitState> {
        crate::sync::lock(&self.state)
    }

    /// A delivery starts waiting.
    fn started(&self, fault: InfraFault, error: &dyn std::fmt::Display) {
        self.gauge.increment(1.0);
        let mut state = self.lock();
        state.waiting += 1;
        if state.since.is_none() {
            state.since = Some(Instant::now());
        }
        self.note_fault(&mut state, fault, error);
    }

    /// A waiting delivery failed again: logged only if the class changed.
    fn again(&self, fault: InfraFault, error: &dyn std::fmt::Display) {
        let mut state = self.lock();
        self.note_fault(&mut state, fault, error);
    }

    fn note_fault(&self, state: &mut WaitState, fault: InfraFault, error: &dyn std::fmt::Display) {
        if state.fault == Some(fault) {
            tracing::debug!(%fault, %error, "still waiting for the database or schema registry");
            return;
        }
        state.fault = Some(fault);
        tracing::warn!(
            scope = self.telemetry.scope(),
            transport = self.telemetry.transport(),
            %fault,
            %error,
            "the database (or the schema registry) cannot serve deliveries: they wait in place (no ack, no offset commit, no dead letter)"
        );
    }

    /// A delivery stopped waiting (processed, or its consumer stopped).
    fn ended(&self) {
        self.gauge.decrement(1.0);
        let mut state = self.lock();
        state.waiting = state.waiting.saturating_sub(1);
        if state.waiting == 0 {
            let waited = state.since.take().map(|s| s.elapsed());
            if state.fault.take().is_some() {
                tracing::info!(
                    scope = self.telemetry.scope(),
                    transport = self.telemetry.transport(),
                    ?waited,
                    "the database takes writes again; no delivery is waiting"
                );
            }
        }
    }
}

/// One delivery waiting in place for the infrastructure: jittered
/// exponential backoff (100 ms doubling up to [`INFRA_WAIT_MAX`]), counted
/// in its consumer's [`Waits`]. Dropping it ends the wait.
pub(crate) struct InfraWait<'w> {
    waits: &'w Waits,
    delays: Box<dyn Iterator<Item = Duration> + Send + 'w>,
    waiting: bool,
}

impl<'w> InfraWait<'w> {
    pub(crate) fn new(waits: &'w Waits) -> Self {
        Self {
            waits,
            delays: Box::new(crate::engine::backoff(
                Duration::from_millis(100),
                INFRA_WAIT_MAX,
            )),
            waiting: false,
        }
    }

    /// Sleeps before the next attempt of a delivery that failed on
    /// `fault`; `false` if `stop` was cancelled first.
    pub(crate) async fn wait(
        &mut self,
        stop: &CancellationToken,
        fault: InfraFault,
        error: &str,
    ) -> bool {
        if self.waiting {
            self.waits.again(fault, &error);
        } else {
            self.waiting = true;
            self.waits.started(fault, &error);
        }
        let delay = self.delays.next().unwrap_or(INFRA_WAIT_MAX);
        sleep_unless(stop, delay).await
    }
}

impl Drop for InfraWait<'_> {
    fn drop(&mut self) {
        if self.waiting {
            self.waits.ended();
        }
    }
}
