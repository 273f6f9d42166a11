//! The leader's certificate upkeep: the Secrets are ensured once when it starts leading (see
//! [`crate::certs`]) and re-checked every [`certs::RENEW_CHECK`]; every check hands the current
//! client certificate to the agents service.

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::certs;
use crate::shared::MtlsAgents;
use crate::shared::metrics::RuntimeMetrics;

/// Reissues leaves that near expiry until `shutdown`.
pub async fn renew_certificates(
    secrets: Api<Secret>,
    agents: std::sync::Arc<MtlsAgents>,
    metrics: RuntimeMetrics,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(certs::RENEW_CHECK) => {}
        }
        match certs::ensure(&secrets).await {
            Ok((pem, renewed)) => {
                if renewed {
                    metrics.certificate_renewals.inc();
                }
                agents.set_tls(&pem);
            }
            Err(error) => warn!(%error, "certificate renewal check failed; retrying later"),
        }
    }
}
