//! What the broker consumers share: graceful shutdown on SIGINT and
//! SIGTERM, and waiting out outages without blocking a stop.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::InfraFault;
use crate::telemetry::Telemetry;

/// Runs `run` with a token that SIGINT or SIGTERM cancels.
pub(crate) async fn until_signal<F, Fut>(run: F) -> Fut::Output
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future,
{
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(cancel_on_signal(shutdown.clone()));
    let result = run(shutdown).await;
    signals.abort();
    result
}

/// Sleeps for `delay`; `false` if `stop` was cancelled first.
pub(crate) async fn sleep_unless(stop: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        biased;
        () = stop.cancelled() => false,
        () = tokio::time::sleep(delay) => true,
    }
}

/// Jittered exponential backoff (100 ms doubling up to 10 s) for a broker
/// publish or reconnect that failed: retried until it succeeds or the
/// consumer stops.
pub(crate) fn outage_backoff() -> impl Iterator<Item = Duration> + Send {
    crate::engine::backoff(Duration::from_millis(100), Duration::from_secs(10))
}

/// The longest pause between two attempts of a delivery waiting for the
/// infrastructure, before jitter (which adds up to as much again): short
/// enough that a delivery notices a healed network within seconds.
const INFRA_WAIT_MAX: Duration = Duration::from_secs(4);

/// One delivery waiting in place for the infrastructure (see
/// [`Decision::Wait`](crate::engine::Decision::Wait)): jittered exponential
/// backoff (100 ms doubling up to [`INFRA_WAIT_MAX`]), the
/// `onceonly_waiting_on_infrastructure` gauge, and a log line per change
/// of state rather than per attempt. Dropping it ends the wait.
pub(crate) struct InfraWait<'t> {
    telemetry: &'t Telemetry,
    delays: Box<dyn Iterator<Item = Duration> + Send + 't>,
    waiting: bool,
}

impl<'t> InfraWait<'t> {
    pub(crate) fn new(telemetry: &'t Telemetry) -> Self {
        Self {
            telemetry,
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
            self.telemetry.wait_again(fault, &error);
        } else {
            self.waiting = true;
            self.telemetry.wait_started(fault, &error);
        }
        let delay = self.delays.next().unwrap_or(INFRA_WAIT_MAX);
        sleep_unless(stop, delay).await
    }
}

impl Drop for InfraWait<'_> {
    fn drop(&mut self) {
        if self.waiting {
            self.telemetry.wait_ended();
        }
    }
}

/// Cancels `shutdown` on SIGINT or SIGTERM (Ctrl-C elsewhere than Unix).
async fn cancel_on_signal(shutdown: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT stops the consumer");
                drop(tokio::signal::ctrl_c().await);
            }
        }
    }
    #[cfg(not(unix))]
    drop(tokio::signal::ctrl_c().await);
    tracing::info!("shutdown signal received");
    shutdown.cancel();
}
