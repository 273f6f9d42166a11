//! Waiting for nodekeeper's CRDs at start: a controller started before `deploy/crds/` was
//! applied would otherwise fail every watch and restart in a loop. Instead it logs once which
//! CRDs are missing and the command that installs them, asks the API server's discovery again
//! with a backoff (1 s doubling to 30 s), and goes on as soon as every CRD is served. Discovery
//! is readable by every authenticated user (`system:discovery`), so this needs no RBAC.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The longest pause between two checks.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The command a user runs to install the CRDs.
pub const INSTALL_HINT: &str = "kubectl apply --server-side -f deploy/crds/ (the Helm chart's crds/ holds the same files; Helm installs them on `helm install` only)";

/// The names (`<plural>.<group>`) of nodekeeper's CRDs that the API server does not serve.
pub async fn missing(client: &kube::Client) -> Result<Vec<String>, kube::Error> {
    let served = match client
        .list_api_group_resources(nodekeeper_api::names::API_VERSION)
        .await
    {
        Ok(list) => list.resources.into_iter().map(|r| r.name).collect(),
        // The group is not served at all: none of them is installed.
        Err(kube::Error::Api(s)) if s.code == 404 => Vec::new(),
        Err(e) => return Err(e),
    };
    Ok(nodekeeper_api::crd::all()
        .into_iter()
        .filter(|crd| !served.contains(&crd.spec.names.plural))
        .map(|crd| crd.metadata.name.unwrap_or_default())
        .collect())
}

/// Returns once every CRD is served (true), or when `shutdown` is cancelled (false).
pub async fn wait_for_crds(client: &kube::Client, shutdown: &CancellationToken) -> bool {
    let mut backoff = Duration::from_secs(1);
    let mut logged: Option<Vec<String>> = None;
    loop {
        match missing(client).await {
            Ok(m) if m.is_empty() => {
                if logged.is_some() {
                    info!("nodekeeper's CRDs are installed; starting");
                }
                return true;
            }
            Ok(m) => {
                // One line per distinct set, not one per check.
                if logged.as_ref() != Some(&m) {
                    warn!(
                        missing = %m.join(", "),
                        fix = INSTALL_HINT,
                        "waiting for nodekeeper's CRDs: {} not installed; install them with {INSTALL_HINT}",
                        m.join(", ")
                    );
                    logged = Some(m);
                }
            }
            Err(error) => warn!(%error, "cannot ask the API server which CRDs it serves; retrying"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
