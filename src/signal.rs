//! Graceful shutdown on SIGINT and SIGTERM, shared by the consumers.

use tokio_util::sync::CancellationToken;

/// Cancels `shutdown` on SIGINT or SIGTERM (Ctrl-C elsewhere than Unix).
pub(crate) async fn cancel_on_signal(shutdown: CancellationToken) {
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
