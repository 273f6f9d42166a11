//! The test-facing harness: one control plane per test binary (or one shared by all, named by
//! `NODEKEEPER_TEST_KUBECONFIG`), clients, CRD installation, simulated nodes and isolated names.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;

use crate::controlplane::{self, Cluster, Lifetime, Options};

/// Environment variable naming the kubeconfig of an already running control plane; when set,
/// [`ControlPlane::shared`] uses that cluster instead of starting one.
pub const KUBECONFIG_ENV: &str = "NODEKEEPER_TEST_KUBECONFIG";

/// Field manager used for the harness's own server-side applies.
pub const FIELD_MANAGER: &str = "nodekeeper-e2e";

/// A running control plane a test can talk to.
#[derive(Debug)]
pub struct ControlPlane {
    kubeconfig: PathBuf,
    /// Present when this process started the cluster; its components die with the process.
    cluster: Option<Cluster>,
}

impl ControlPlane {
    /// The control plane shared by every test in this binary, started on first use (a few
    /// seconds when the binaries are cached; the first build takes ~20 minutes on 2 cores).
    /// When `NODEKEEPER_TEST_KUBECONFIG` is set, that cluster is used instead.
    ///
    /// Panics, with the reason and the fix, when no control plane can be had: tests that need a
    /// cluster fail rather than pass vacuously.
    pub fn shared() -> &'static ControlPlane {
        static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
        let shared = SHARED.get_or_init(|| {
            if let Some(path) = std::env::var_os(KUBECONFIG_ENV).filter(|p| !p.is_empty()) {
                let path = PathBuf::from(path);
                return if path.is_file() {
                    Ok(ControlPlane { kubeconfig: path, cluster: None })
                } else {
                    Err(format!("{KUBECONFIG_ENV}={} names no file: start a cluster with `cargo xtask cluster up` and set it to the path `cargo xtask cluster env` prints, or unset it", path.display()))
                };
            }
            ControlPlane::start(Options::new(format!("test-{}", std::process::id()), Lifetime::WithThisProcess))
                .map_err(|e| format!("{e:#}"))
        })
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|cp| {
            // A controller waits for nodekeeper's CRDs before it starts: every test binary that
            // runs one gets them installed once, whatever ran before it on this cluster.
            static CRDS: OnceLock<Result<(), String>> = OnceLock::new();
            CRDS.get_or_init(|| cp.install_crds_blocking()).clone().map(|()| cp)
        });
        match shared {
            Ok(cp) => cp,
            Err(message) => panic!("no control plane for this test: {message}"),
        }
    }

    /// Starts a private control plane with `options` (e.g. with audit logging for a
    /// benchmark). Blocks until it is ready; it stops when dropped or when the process exits.
    pub fn start(options: Options) -> anyhow::Result<ControlPlane> {
        // `up` is async, but this may be called from inside a test's runtime: run it on a
        // thread of its own with its own runtime.
        let handle = std::thread::spawn(move || -> Result<Cluster, controlplane::Error> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|source| controlplane::Error::Io {
                    context: "build a tokio runtime".into(),
                    source,
                })?;
            runtime.block_on(controlplane::up(&options, &mut |line| {
                eprintln!("[control plane] {line}")
            }))
        });
        let cluster = handle
            .join()
            .map_err(|_| anyhow::anyhow!("control-plane startup thread panicked"))??;
        Ok(ControlPlane {
            kubeconfig: cluster.kubeconfig.clone(),
            cluster: Some(cluster),
        })
    }

    /// [`install_crds`] from a thread of its own (this may be called inside a test's runtime).
    fn install_crds_blocking(&self) -> Result<(), String> {
        let kubeconfig = self.kubeconfig.clone();
        std::thread::spawn(move || -> anyhow::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let client = controlplane::client_from_kubeconfig(&kubeconfig).await?;
                install_crds(&client).await.map(|_| ())
            })
        })
        .join()
        .map_err(|_| "the CRD install thread panicked".to_owned())?
        .map_err(|e| format!("install deploy/crds/ on the shared control plane: {e:#}"))
    }

    /// Path of the admin kubeconfig (user `nodekeeper-admin`, group `system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A new client for the admin user. Make one per test: a client is bound to the tokio
    /// runtime it was created on, and each `#[tokio::test]` has its own. It retries only what the
    /// API server asks to be retried (`Retry-After`), so a test sees e.g. a PDB-refused eviction
    /// at once.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        controlplane::client_from_kubeconfig(&self.kubeconfig)
            .await
            .with_context(|| format!("connect with {}", self.kubeconfig.display()))
    }

    /// The audit log (JSON lines, one per request) when this process started the cluster with
    /// `Options::audit`.
    pub fn audit_log(&self) -> Option<PathBuf> {
        self.cluster.as_ref().and_then(Cluster::audit_log)
    }

    /// The PID of a component this process started (`kube-apiserver`, `etcd`, `kwok`, …), for
    /// benchmarks that read its CPU time.
    pub fn component_pid(&self, name: &str) -> Option<u32> {
        self.cluster
            .as_ref()?
            .state
            .components
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.pid)
    }
}

/// A name unique to this run: `prefix-<random>-<counter>`, a valid DNS label (≤ 63 chars).
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    static RUN: OnceLock<String> = OnceLock::new();
    let run = RUN.get_or_init(|| format!("{:06x}", rand::random::<u32>() & 0xff_ffff));
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let suffix = format!("-{run}-{n}");
    let prefix: String = prefix
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(63 - suffix.len())
        .collect();
    format!("{}{suffix}", prefix.trim_matches('-'))
}

/// Polls `check` every 250 ms until it yields `Some`, failing after `timeout` with `what` and the
/// last error seen. For waiting on anything a controller or kwok does asynchronously.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last_error = Some(error),
        }
        if Instant::now() > deadline {
            match last_error {
                Some(error) => {
                    bail!("timed out after {timeout:?} waiting for {what}; last error: {error:#}")
                }
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Creates a namespace with a unique name (label `nodekeeper.dev/e2e=true`) and waits for its
/// `default` ServiceAccount, without which pods are rejected. Returns the name.
pub async fn test_namespace(client: &kube::Client, prefix: &str) -> anyhow::Result<String> {
    let name = unique_name(prefix);
    let ns: Namespace = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": name, "labels": { "nodekeeper.dev/e2e": "true" } },
    }))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .context("create namespace")?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
    wait_for(
        &format!("ServiceAccount {name}/default"),
        Duration::from_secs(60),
        || {
            let sas = sas.clone();
            async move { Ok(sas.get_opt("default").await?.map(|_| ())) }
        },
    )
    .await?;
    Ok(name)
}

/// `deploy/crds/` in this checkout.
pub fn crds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("crds")
}

/// Applies every CRD in `deploy/crds/*.yaml` (server-side apply, field manager
/// [`FIELD_MANAGER`]) and waits until each is Established. Returns the CRD names. Idempotent.
pub async fn install_crds(client: &kube::Client) -> anyhow::Result<Vec<String>> {
    let dir = crds_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("read {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut names = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
        for document in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_json::Value::deserialize(document)
                .with_context(|| format!("parse {}", file.display()))?;
            if value.is_null() {
                continue;
            }
            if value["kind"] != "CustomResourceDefinition" {
                bail!(
                    "{} holds a {} where only CustomResourceDefinitions belong",
                    file.display(),
                    value["kind"]
                );
            }
            let name = value["metadata"]["name"]
                .as_str()
                .with_context(|| format!("{}: CRD without metadata.name", file.display()))?
                .to_owned();
            api.patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&value),
            )
            .await
            .with_context(|| format!("apply CRD {name} from {}", file.display()))?;
            names.push(name);
        }
    }
    if names.is_empty() {
        bail!(
            "no CustomResourceDefinitions in {}: run `cargo xtask codegen`",
            dir.display()
        );
    }
    for name in &names {
        let api = api.clone();
        wait_for(
            &format!("CRD {name} to be Established"),
            Duration::from_secs(60),
            || {
                let api = api.clone();
                async move {
                    let crd = api.get(name).await?;
                    let established = crd.status.and_then(|s| s.conditions).is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                    Ok(established.then_some(()))
                }
            },
        )
        .await?;
    }
    Ok(names)
}

use serde::Deserialize as _;

/// Creates `n` simulated nodes named `<unique prefix>-<i>` with `labels` (plus
/// `nodekeeper.dev/simulated=true`) and waits until kwok has made them Ready and
/// kube-controller-manager has lifted their not-ready taint, so pods created next may land on
/// any of them. Node `i` gets `ips[i]` as its InternalIP; with `ips` empty, addresses come from
/// a per-process sequence in 127.1.0.0/16 (pass explicit ones when something will bind them).
/// Returns the node names.
pub async fn create_simulated_nodes(
    client: &kube::Client,
    prefix: &str,
    n: usize,
    labels: &BTreeMap<String, String>,
    ips: &[Ipv4Addr],
) -> anyhow::Result<Vec<String>> {
    static NEXT_IP: AtomicU32 = AtomicU32::new(0);
    if !ips.is_empty() && ips.len() != n {
        bail!(
            "create_simulated_nodes: {} ips given for {n} nodes; pass one per node or none",
            ips.len()
        );
    }
    let base = unique_name(prefix);
    let names: Vec<String> = (0..n).map(|i| format!("{base}-{i}")).collect();
    let ips: Vec<Ipv4Addr> = if ips.is_empty() {
        (0..n)
            .map(|_| controlplane::simulated_node_ip(NEXT_IP.fetch_add(1, Ordering::Relaxed)))
            .collect()
    } else {
        ips.to_vec()
    };
    controlplane::nodes::create(client, &names, &ips, labels).await?;
    // kube-controller-manager lifts the not-ready taints with its client's 20 requests a second,
    // at most 10 nodes a second and 4.4 measured for the vnic benchmark's 1000 (2026-11-29): a
    // minute, and half a second a node on top.
    let bound = Duration::from_secs(60 + u64::try_from(n / 2).unwrap_or(u64::MAX));
    controlplane::nodes::wait_schedulable(client, &names, bound).await?;
    Ok(names)
}

/// Server-side applies a nodekeeper object of `K` named `name` with `spec`, as field manager
/// [`FIELD_MANAGER`] (what a user's `kubectl apply --server-side` does).
pub async fn apply_spec<K>(api: &Api<K>, name: &str, spec: serde_json::Value) -> anyhow::Result<()>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    apply_labelled_spec(api, name, &BTreeMap::new(), spec).await
}

/// [`apply_spec`] with `labels` on the object (a test's controller that watches only objects
/// with its label then leaves other tests' objects in the shared API server alone).
pub async fn apply_labelled_spec<K>(
    api: &Api<K>,
    name: &str,
    labels: &BTreeMap<String, String>,
    spec: serde_json::Value,
) -> anyhow::Result<()>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let kind = K::kind(&());
    let body = json!({
        "apiVersion": K::api_version(&()),
        "kind": kind,
        "metadata": { "name": name, "labels": labels },
        "spec": spec,
    });
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER),
        &Patch::Apply(&body),
    )
    .await
    .with_context(|| format!("apply {} {name}", kind.to_lowercase()))?;
    Ok(())
}

/// Node `node`'s condition `type_` as `(status, reason, message)`, `None` while it has none.
pub async fn node_condition(
    client: &kube::Client,
    node: &str,
    type_: &str,
) -> anyhow::Result<Option<(String, String, String)>> {
    let n = Api::<Node>::all(client.clone())
        .get(node)
        .await
        .with_context(|| format!("get node {node}"))?;
    Ok(n.status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                c.status,
                c.reason.unwrap_or_default(),
                c.message.unwrap_or_default(),
            )
        }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_are_valid_distinct_dns_labels() {
        let a = unique_name("My_Test");
        let b = unique_name("My_Test");
        assert_ne!(a, b);
        assert!(a.starts_with("my-test-"), "{a}");
        let long = unique_name(&"x".repeat(100));
        assert!(long.len() <= 63, "{long}");
        assert!(
            long.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }
}
