//! Installing `deploy/` the way a user does: `kubectl kustomize deploy/` with the control plane's
//! kubectl (what `kubectl apply -k` renders), server-side apply of the rendered objects, the file
//! each object comes from, and a kubeconfig that acts as a ServiceAccount the manifests create.
//! The install tests and `cargo xtask demo` both install through this module.

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

/// The control plane's kubectl, whose `kustomize` is what `kubectl apply -k` uses (built with
/// the control plane on first use).
pub fn kubectl() -> anyhow::Result<PathBuf> {
    Ok(
        crate::controlplane::binaries::ensure(&mut |line| eprintln!("[kubectl] {line}"))
            .context("build the pinned control plane (for its kubectl)")?
            .path("kubectl"),
    )
}

/// Runs `program args…`; Ok(stdout) on success, Err(status, stdout and stderr) otherwise.
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
        let value = Value::deserialize(document).context("parse YAML")?;
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

/// Objects by [`key`].
pub fn by_key(objects: Vec<Value>) -> BTreeMap<String, Value> {
    objects.into_iter().map(|o| (key(&o), o)).collect()
}

/// `kubectl kustomize <dir>`: the objects `kubectl apply -k <dir>` would send.
pub fn kustomize(dir: &Path) -> anyhow::Result<Vec<Value>> {
    let text = run(&kubectl()?, &["kustomize", &dir.to_string_lossy()])
        .map_err(|e| anyhow::anyhow!("kubectl kustomize {}: {e}", dir.display()))?;
    documents(&text)
        .with_context(|| format!("read what `kubectl kustomize {}` rendered", dir.display()))
}

/// The file each object of the kustomization in `dir` is written in, by [`key`], following its
/// `resources:` (files and directories with their own kustomization) the way kustomize does.
/// Paths are relative to `relative_to`. Patches and generators are not followed: `deploy/` has
/// none, and an object they would add is simply missing here.
pub fn origins(dir: &Path, relative_to: &Path) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    add_origins(dir, relative_to, &mut out, 0)?;
    Ok(out)
}

fn add_origins(
    dir: &Path,
    relative_to: &Path,
    out: &mut BTreeMap<String, PathBuf>,
    depth: usize,
) -> anyhow::Result<()> {
    if depth > 8 {
        bail!("{}: kustomizations nested more than 8 deep", dir.display());
    }
    let file = dir.join("kustomization.yaml");
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?;
    let kustomization: Value =
        serde_yaml::from_str(&text).with_context(|| format!("parse {}", file.display()))?;
    let resources = kustomization["resources"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for resource in resources {
        let Some(entry) = resource.as_str() else {
            bail!("{}: a resources entry is not a string", file.display());
        };
        let path = dir.join(entry);
        if path.is_dir() {
            add_origins(&path, relative_to, out, depth + 1)?;
            continue;
        }
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let shown = path
            .strip_prefix(relative_to)
            .map(Path::to_path_buf)
            .unwrap_or_else(|_| path.clone());
        for object in documents(&text).with_context(|| format!("parse {}", path.display()))? {
            out.insert(key(&object), shown.clone());
        }
    }
    Ok(())
}

/// Server-side applies every object (namespaced ones keep the namespace they carry) as
/// `field_manager`, forcing conflicts, the way `kubectl apply --server-side --force-conflicts`
/// would.
pub async fn apply_all(
    client: &kube::Client,
    objects: &[Value],
    field_manager: &str,
) -> anyhow::Result<()> {
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
            &PatchParams::apply(field_manager).force(),
            &Patch::Apply(object),
        )
        .await
        .with_context(|| format!("apply {}", key(object)))?;
    }
    Ok(())
}

/// A token for ServiceAccount `namespace/name` from the TokenRequest API (what a Pod's projected
/// token is), valid for `lifetime`.
pub async fn service_account_token(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    lifetime: std::time::Duration,
) -> anyhow::Result<String> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = json!({"spec": {"expirationSeconds": lifetime.as_secs(), "audiences": []}});
    accounts
        .create_token_request(
            name,
            &PostParams::default(),
            &serde_json::from_value(request)?,
        )
        .await
        .with_context(|| format!("request a token for ServiceAccount {namespace}/{name}"))?
        .status
        .context("token request without status")?
        .token
        .context("token request without a token")
}

/// Writes to `out` a kubeconfig for the cluster of `admin_kubeconfig` that authenticates as
/// ServiceAccount `namespace/name` with a token from the TokenRequest API (what a Pod's projected
/// token is), valid for `lifetime`.
pub async fn service_account_kubeconfig(
    client: &kube::Client,
    admin_kubeconfig: &Path,
    namespace: &str,
    name: &str,
    lifetime: std::time::Duration,
    out: &Path,
) -> anyhow::Result<()> {
    let token = service_account_token(client, namespace, name, lifetime).await?;
    let admin: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(admin_kubeconfig)
            .with_context(|| format!("read {}", admin_kubeconfig.display()))?,
    )?;
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
    std::fs::write(out, serde_yaml::to_string(&config)?)
        .with_context(|| format!("write {}", out.display()))?;
    Ok(())
}
