//! SIGTERM and SIGINT: either cancels the root of the shutdown tree.

use tokio_util::sync::CancellationToken;
use tracing::info;

/// Cancels `shutdown` on the first SIGTERM or SIGINT.
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let terminated = async {
        match term.as_mut() {
            Some(t) => t.recv().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        Some(()) = terminated => {}
        () = shutdown.cancelled() => return,
    }
    info!("shutdown requested");
    shutdown.cancel();
}
