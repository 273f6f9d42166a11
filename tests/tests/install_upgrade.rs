//! Upgrade, proven on a private control plane: the previous release's manifests (the CRDs,
//! `deploy/` and the examples of commit c5b43e3, checked in under
//! `tests/fixtures/previous-release/`) are installed, objects are created with them and the
//! controller, running as that release's ServiceAccount, writes Node conditions from a real agent.
//! Then today's CRDs and `deploy/` are applied over them the way a user upgrades
//! (`kubectl apply --server-side`), and every object is still there (same UID, readable by today's
//! types), the CRDs still store `v1alpha1` only, and the controller, restarted as today's
//! ServiceAccount, keeps the Node conditions as they were (no transition). docs/crd-versions.md
//! has the plan for the next version.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test install_upgrade`.

mod controller_common;
mod install_common;
mod lifecycle_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use controller_common::{agent_tls, free_port, loopback_ips, start_agent, wait_condition};
use install_common::{apply_all, documents, kustomize, repo};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{DynamicObject, GroupVersionKind};
use kube::discovery;
use lifecycle_common::{log_line, start_as};
use nodekeeper_api::crd::{NetworkTest, NodeDiagnostic, NodeMaintenance, NodeNetworkConfig};
use nodekeeper_e2e::{
    ControlPlane, Lifetime, Options, create_simulated_nodes, test_namespace, unique_name,
};
use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(120);
const NAMESPACE: &str = "nodekeeper";
const ACCOUNT: &str = "nodekeeper-controller";
const GROUP: &str = "nodekeeper.dev/e2e-group";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    controller_common::run_as_controller_if_asked();
}

/// This binary's own control plane: the previous release's CRDs must be the first installed.
fn cluster() -> &'static ControlPlane {
    static CLUSTER: OnceLock<ControlPlane> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let options = Options::new(
            format!("test-upgrade-{}", std::process::id()),
            Lifetime::WithThisProcess,
        );
        ControlPlane::start(options).expect("start the control plane")
    })
}

/// A file of the previous release's fixture, as objects.
fn previous(file: &str) -> anyhow::Result<Vec<Value>> {
    let path = repo().join("tests/fixtures/previous-release").join(file);
    documents(&std::fs::read_to_string(&path).with_context(|| path.display().to_string())?)
}

/// Keeps the Pods of `objects`' Deployments and DaemonSets off the simulated nodes (this
/// cluster's kwok would "run" them; the test runs the controller itself).
fn keep_pods_off(objects: &mut [Value]) {
    for o in objects {
        if o["kind"] == "Deployment" || o["kind"] == "DaemonSet" {
            o["spec"]["template"]["spec"]["nodeSelector"] =
                serde_json::json!({"nodekeeper.dev/none": "none"});
        }
    }
}

/// Node conditions as (type, status, reason, lastTransitionTime).
fn conditions(node: &Node) -> BTreeMap<String, (String, String, String)> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            let at = c
                .last_transition_time
                .map(|t| t.0.to_string())
                .unwrap_or_default();
            (c.type_, (c.status, c.reason.unwrap_or_default(), at))
        })
        .collect()
}

/// The UID of every object in `objects`, read back from the cluster.
async fn uids(
    client: &kube::Client,
    objects: &[Value],
) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for o in objects {
        let (group, version) = o["apiVersion"]
            .as_str()
            .context("no apiVersion")?
            .split_once('/')
            .unwrap_or(("", "v1"));
        let gvk = GroupVersionKind::gvk(group, version, o["kind"].as_str().unwrap_or_default());
        let (resource, caps) = discovery::pinned_kind(client, &gvk).await?;
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let api: Api<DynamicObject> = match o["metadata"]["namespace"].as_str() {
            Some(ns) if caps.scope == discovery::Scope::Namespaced => {
                Api::namespaced_with(client.clone(), ns, &resource)
            }
            _ => Api::all_with(client.clone(), &resource),
        };
        let found = api
            .get(name)
            .await
            .with_context(|| install_common::key(o))?;
        out.insert(
            install_common::key(o),
            found.metadata.uid.unwrap_or_default(),
        );
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_keeps_every_object_and_node_condition() -> anyhow::Result<()> {
    let client = cluster().client().await?;
    let work = tempfile::tempdir()?;

    // The previous release, as its user installed it.
    apply_all(&client, &previous("crds.yaml")?).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in previous("crds.yaml")? {
        let name = crd["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        nodekeeper_e2e::wait_for(&format!("CRD {name} established"), TIMEOUT, || {
            let (crds, name) = (crds.clone(), name.clone());
            async move {
                let c = crds.get(&name).await?;
                Ok(c.status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(()))
            }
        })
        .await?;
    }
    let mut manifests = previous("deploy.yaml")?;
    keep_pods_off(&mut manifests);
    apply_all(&client, &manifests).await?;
    let apps = test_namespace(&client, "up-apps").await?;
    let mut examples = previous("examples.yaml")?;
    for o in &mut examples {
        if o["kind"] == "NetworkTest" || o["kind"] == "NodeDiagnostic" {
            o["metadata"]["namespace"] = apps.clone().into();
        }
        if o["kind"] == "ConfigMap" {
            o["data"]["sweepInterval"] = "5s".into();
            o["data"]["callTimeout"] = "2s".into();
        }
    }
    apply_all(&client, &examples).await?;
    let before = uids(&client, &examples).await?;

    // Conditions written on the previous install (its ServiceAccount and RBAC).
    let group = unique_name("up");
    let ips = loopback_ips(1);
    let labels = BTreeMap::from([(GROUP.to_owned(), group.clone())]);
    let node = create_simulated_nodes(&client, "up-node", 1, &labels, &ips)
        .await?
        .remove(0);
    let port = free_port();
    let selector = format!("{GROUP}={group}");
    // The same controller flags before and after the upgrade.
    let start = || {
        start_as(
            cluster(),
            NAMESPACE,
            ACCOUNT,
            &selector,
            port,
            work.path(),
            &[],
        )
    };
    let (mut controller, log) = start().await?;
    let tls = agent_tls(&client, NAMESPACE).await?;
    let _agent = start_agent(&node, SocketAddr::new(ips[0].into(), port), &tls).await?;
    wait_condition(&client, &node, "NodekeeperReachable", "True", None, TIMEOUT)
        .await
        .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    controller.stop();
    let nodes: Api<Node> = Api::all(client.clone());
    let written = conditions(&nodes.get(&node).await?);
    ensure!(written.contains_key("NodekeeperReachable"), "{written:?}");

    // The upgrade: today's CRDs and deploy/, server-side applied over the previous ones.
    nodekeeper_e2e::install_crds(&client).await?;
    let mut today = kustomize(&repo().join("deploy"))?;
    keep_pods_off(&mut today);
    apply_all(&client, &today).await?;

    // Every object kept, and readable as today's types.
    let after = uids(&client, &examples).await?;
    ensure!(
        before == after,
        "objects changed identity:\n{before:#?}\n{after:#?}"
    );
    let apps_tests: Api<NetworkTest> = Api::namespaced(client.clone(), &apps);
    let apps_diags: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &apps);
    let maintenances: Api<NodeMaintenance> = Api::all(client.clone());
    let configs: Api<NodeNetworkConfig> = Api::all(client.clone());
    ensure!(apps_tests.get("mesh").await?.spec.count == 3);
    apps_diags.get("node-bundles").await?;
    let m = maintenances.get("kernel-upgrade").await?;
    ensure!(
        m.spec.reason == "kernel 6.12 upgrade",
        "{:?}",
        m.spec.reason
    );
    configs.get("storage-vnics").await?;
    // One stored version, v1alpha1, on every CRD.
    for crd in nodekeeper_api::crd::all() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let c = crds.get(&name).await?;
        let stored = c.status.and_then(|s| s.stored_versions).unwrap_or_default();
        ensure!(stored == ["v1alpha1"], "{name}: storedVersions {stored:?}");
        let storage: Vec<&str> = c
            .spec
            .versions
            .iter()
            .filter(|v| v.storage)
            .map(|v| v.name.as_str())
            .collect();
        ensure!(
            storage == ["v1alpha1"],
            "{name}: storage version {storage:?}"
        );
    }

    // Today's controller, as today's ServiceAccount: the conditions stay as they were.
    let (mut controller, log) = start().await?;
    log_line(&log, &["leading"], TIMEOUT).await?;
    // Several sweeps (5 s each) with the agent answering.
    tokio::time::sleep(Duration::from_secs(15)).await;
    controller.process.check_alive()?;
    let kept = conditions(&nodes.get(&node).await?);
    for (t, value) in &written {
        ensure!(
            kept.get(t) == Some(value),
            "condition {t} changed over the upgrade: {value:?} -> {:?}",
            kept.get(t)
        );
    }
    controller.stop();
    Ok(())
}
