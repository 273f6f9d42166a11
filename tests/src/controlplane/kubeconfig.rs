//! Kubeconfigs for the admin and each component, and clients built from a kubeconfig.

use std::path::Path;

use super::Error;

pub(super) fn kubeconfig_text(
    name: &str,
    port: u16,
    ca: &Path,
    user: &str,
    cert: &Path,
    key: &Path,
) -> String {
    // JSON strings are valid YAML scalars and quote any path safely.
    let q = |p: &Path| serde_json::to_string(&p.display().to_string()).unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: {name}\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: {name}\n  context:\n    cluster: {name}\n    user: {user}\ncurrent-context: {name}\n",
        ca = q(ca),
        cert = q(cert),
        key = q(key),
    )
}

/// Builds a client from a kubeconfig file, retrying only what the API server asks to be retried
/// (kubectl's rule, [`nodekeeper_api::client`]) instead of kube's default retries.
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client, Error> {
    let kubeconfig =
        kube::config::Kubeconfig::read_from(path).map_err(|source| Error::ReadKubeconfig {
            path: path.to_owned(),
            source,
        })?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|source| Error::ReadKubeconfig {
        path: path.to_owned(),
        source,
    })?;
    // kube's default retry layer silently retries 429s with backoff for minutes — including an
    // eviction refused by a PodDisruptionBudget. Tests must see what the API answered; only the
    // server's own "retry after a second" (storage being (re)initialised) is waited out.
    Ok(nodekeeper_api::client::server_asked_retry(config)?)
}
