//! What the broker consumers share: graceful shutdown on SIGINT and
//! SIGTERM, and waiting out outages without blocking a stop.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

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

/// Exponential backoff, 100 ms doubling up to 10 s, while the database or
/// a broker is unreachable: such failures are never the message's fault,
/// so they are retried until they pass or the consumer stops.
pub(crate) struct OutageBackoff(Duration);

impl OutageBackoff {
    pub(crate) fn new() -> Self {
        Self(Duration::from_millis(100))
    }

    /// The next delay.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.0;
        self.0 = (self.0 * 2).min(Duration::from_secs(10));
        delay
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
