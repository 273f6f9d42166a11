//! Shared pieces of the install tests: the pinned Helm and kubectl (kustomize is built into
//! kubectl), rendering `deploy/` and `deploy/helm/nodekeeper` to objects, applying rendered
//! objects with server-side apply, and a kubeconfig holding a ServiceAccount's token.
// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;
use kube::api::{DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::discovery::{self, Scope};
use serde::Deserialize as _;
use serde_json::{Value, json};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

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

/// The control plane's kubectl, whose `kustomize` is what `kubectl apply -k` uses.
pub fn kubectl() -> PathBuf {
    nodekeeper_e2e::controlplane::binaries::ensure(&mut |line| eprintln!("[kubectl] {line}"))
        .expect("build the pinned control plane")
        .path("kubectl")
}

/// Runs `program args…`; Ok(stdout) on success, Err(stderr) otherwise.
pub fn run(program: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("run {}: {e}", program.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{}\n{stdout}{stderr}", out.status))
    }
}

/// The non-empty YAML documents of `text`.
pub fn documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for document in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(document).context("parse rendered YAML")?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// `kind/namespace/name` of an object.
pub fn key(object: &Value) -> String {
    format!(
        "{}/{}/{}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["namespace"].as_str().unwrap_or(""),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// Rendered objects by [`key`].
pub fn by_key(objects: Vec<Value>) -> BTreeMap<String, Value> {
    objects.into_iter().map(|o| (key(&o), o)).collect()
}

/// `kubectl kustomize <dir>`.
pub fn kustomize(dir: &Path) -> anyhow::Result<Vec<Value>> {
    let text = run(&kubectl(), &["kustomize", &dir.to_string_lossy()])
        .map_err(|e| anyhow::anyhow!("kubectl kustomize {}: {e}", dir.display()))?;
    documents(&text)
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

/// Server-side applies every object (namespaced ones keep the namespace they carry) as the
/// admin, the way `kubectl apply --server-side` would.
pub async fn apply_all(client: &kube::Client, objects: &[Value]) -> anyhow::Result<()> {
    for object in objects {
        let api_version = object["apiVersion"].as_str().context("no apiVersion")?;
        let kind = object["kind"].as_str().context("no kind")?;
        let name = object["metadata"]["name"].as_str().context("no name")?;
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (resource, caps) = discovery::pinned_kind(client, &gvk)
            .await
            .with_context(|| format!("discover {api_version} {kind}"))?;
        let api: Api<DynamicObject> = if caps.scope == Scope::Namespaced {
            let namespace = object["metadata"]["namespace"]
                .as_str()
                .with_context(|| format!("{} has no namespace", key(object)))?;
            Api::namespaced_with(client.clone(), namespace, &resource)
        } else {
            Api::all_with(client.clone(), &resource)
        };
        api.patch(
            name,
            &PatchParams::apply("nodekeeper-install-test").force(),
            &Patch::Apply(object),
        )
        .await
        .with_context(|| format!("apply {}", key(object)))?;
    }
    Ok(())
}

/// A kubeconfig for the cluster of `admin_kubeconfig` that authenticates as ServiceAccount
/// `namespace/name` with a token from the TokenRequest API (what a Pod's projected token is).
pub async fn service_account_kubeconfig(
    client: &kube::Client,
    admin_kubeconfig: &Path,
    namespace: &str,
    name: &str,
    out: &Path,
) -> anyhow::Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let token = accounts
        .create_token_request(
            name,
            &PostParams::default(),
            &serde_json::from_value(json!({"spec": {"expirationSeconds": 3600, "audiences": []}}))?,
        )
        .await
        .with_context(|| format!("request a token for ServiceAccount {namespace}/{name}"))?
        .status
        .context("token request without status")?
        .token;
    let admin: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(admin_kubeconfig)?)?;
    let cluster = admin["clusters"][0]["cluster"].clone();
    if cluster.is_null() {
        bail!("{} names no cluster", admin_kubeconfig.display());
    }
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
        "current-context": "sa",
    });
    std::fs::write(out, serde_yaml::to_string(&config)?)?;
    Ok(())
}
