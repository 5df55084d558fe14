//! Stopping a consumer: graceful shutdown on SIGINT and SIGTERM, and
//! sleeps and backoffs that a stop cuts short.

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

/// Jittered exponential backoff (100 ms doubling up to 10 s) for a broker
/// publish or reconnect that failed: retried until it succeeds or the
/// consumer stops.
pub(crate) fn outage_backoff() -> impl Iterator<Item = Duration> + Send {
    crate::engine::backoff(Duration::from_millis(100), Duration::from_secs(10))
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
