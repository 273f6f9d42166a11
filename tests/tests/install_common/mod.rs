//! Shared pieces of the install tests: the pinned Helm, rendering `deploy/helm/nodekeeper`, and
//! the library's install helpers (`nodekeeper_e2e::install`: kustomize, apply, ServiceAccount
//! kubeconfig) under the names these tests use.
// Each test binary uses a different part of this module.
#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

pub use nodekeeper_e2e::install::{by_key, documents, key, kustomize, repo, run};

/// `deploy/helm/nodekeeper`.
pub fn chart_dir() -> PathBuf {
    repo().join("deploy").join("helm").join("nodekeeper")
}

/// The pinned Helm, built from `xtask/tools/helm` on first use.
pub fn helm() -> PathBuf {
    nodekeeper_e2e::gotool::ensure(&nodekeeper_e2e::gotool::HELM, &mut |line| {
        eprintln!("[helm] {line}")
    })
    .expect("build the pinned Helm (needs Go and the Go module proxy the first time)")
}

/// The control plane's kubectl.
pub fn kubectl() -> PathBuf {
    nodekeeper_e2e::install::kubectl().expect("build the pinned control plane")
}

/// `helm template nodekeeper deploy/helm/nodekeeper --namespace <namespace> <args…>`.
pub fn helm_template(namespace: &str, args: &[&str]) -> Result<Vec<Value>, String> {
    let chart = chart_dir();
    let mut all = vec![
        "template",
        "nodekeeper",
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
        // The chart's kubeVersion is checked against this (Helm built without its release
        // ldflags would assume v1.20); the local control plane's version.
        "--kube-version",
        "1.36.0",
    ];
    all.extend_from_slice(args);
    let text = run(&helm(), &all)?;
    documents(&text).map_err(|e| format!("{e:#}"))
}

/// Server-side applies every object as the install tests' field manager.
pub async fn apply_all(client: &kube::Client, objects: &[Value]) -> anyhow::Result<()> {
    nodekeeper_e2e::install::apply_all(client, objects, "nodekeeper-install-test").await
}

/// A kubeconfig acting as ServiceAccount `namespace/name`, valid for an hour.
pub async fn service_account_kubeconfig(
    client: &kube::Client,
    admin_kubeconfig: &Path,
    namespace: &str,
    name: &str,
    out: &Path,
) -> anyhow::Result<()> {
    nodekeeper_e2e::install::service_account_kubeconfig(
        client,
        admin_kubeconfig,
        namespace,
        name,
        Duration::from_secs(3600),
        out,
    )
    .await
}
