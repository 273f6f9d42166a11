//! Uninstall, proven on a private control plane: the Helm chart is installed into a namespace
//! other than `nodekeeper` and its controller, running as that namespace's ServiceAccount, sweeps
//! real agents (Node conditions) and cordons a node for a NodeMaintenance (taint, label,
//! annotations). Then `nodekeeper-controller --cleanup`, as the ServiceAccount of
//! `deploy/uninstall/cleanup-job.yaml`, refuses while the controller still holds its Lease, and once
//! it is stopped removes exactly what nodekeeper put there (the Nodes get back their cordon state;
//! someone else's condition, taint and label stay), with no 403 in the audit log; a second run
//! finds nothing. And a controller started before the CRDs exist waits with one log line naming
//! them and the command that installs them, then starts when they appear.
//!
//! The same uninstall once more as a user's cluster runs it: the Job of `cleanup-job.yaml` as a
//! container of the controller image (the archive `cargo xtask test` builds), started by podman
//! from the Job's Pod template the way a kubelet starts it — its ServiceAccount's token from the
//! TokenRequest API with the cluster CA and namespace mounted where a Pod has them,
//! `KUBERNETES_SERVICE_HOST/PORT` set, the Job's user, read-only root and dropped capabilities —
//! leaves the nodes as they were, as that ServiceAccount and with no 403.
//!
//! The host half (`nodekeeper-agent --cleanup`) is tested in a network namespace in
//! `crates/agent/src/cleanup.rs`.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test install_cleanup` (it builds the images
//! first; the container test needs root and is skipped otherwise).

mod controller_common;
mod install_common;
mod lifecycle_common;
mod podman_common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use controller_common::{agent_tls, free_port, loopback_ips, start_agent};
use install_common::{apply_all, documents, helm_template, kustomize, repo};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use lifecycle_common::{log_line, start_as};
use nodekeeper_api::crd::NodeMaintenance;
use nodekeeper_e2e::{
    ControlPlane, Lifetime, Options, apply_spec, create_simulated_nodes, install_crds, unique_name,
    wait_for,
};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(120);
const GROUP: &str = "nodekeeper.dev/e2e-group";
const CONTROLLER_ACCOUNT: &str = "nodekeeper-controller";
const CLEANUP_ACCOUNT: &str = "nodekeeper-cleanup";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    controller_common::run_as_controller_if_asked();
}

/// One test at a time: one deletes the CRDs the other needs.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This binary's own control plane, with the audit log on.
fn cluster() -> &'static ControlPlane {
    static CLUSTER: OnceLock<ControlPlane> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let mut options = Options::new(
            format!("test-uninstall-{}", std::process::id()),
            Lifetime::WithThisProcess,
        );
        options.audit = true;
        ControlPlane::start(options).expect("start the audited control plane")
    })
}

/// The chart rendered into `namespace`, its Pods kept off the simulated nodes (this cluster's
/// kwok would "run" them), applied as the admin.
async fn install_chart(client: &kube::Client, namespace: &str) -> anyhow::Result<()> {
    let objects = helm_template(
        namespace,
        &[
            "--set",
            "createNamespace=true",
            "--set",
            "agent.nodeSelector.nodekeeper\\.dev/none=none",
            "--set",
            "controller.nodeSelector.nodekeeper\\.dev/none=none",
        ],
    )
    .map_err(anyhow::Error::msg)?;
    apply_all(client, &objects).await
}

/// `deploy/uninstall/cleanup-job.yaml` moved to `namespace` (the edit its comment describes).
fn cleanup_manifest(namespace: &str) -> anyhow::Result<Vec<Value>> {
    let text = std::fs::read_to_string(repo().join("deploy/uninstall/cleanup-job.yaml"))?;
    let mut objects = documents(&text)?;
    for o in &mut objects {
        if o["metadata"]["namespace"].is_string() {
            o["metadata"]["namespace"] = namespace.into();
        }
        if let Some(subjects) = o.get_mut("subjects").and_then(Value::as_array_mut) {
            for s in subjects {
                s["namespace"] = namespace.into();
            }
        }
    }
    Ok(objects)
}

/// Runs `--cleanup` as the cleanup account to its end: (succeeded, its output).
async fn cleanup(namespace: &str, work: &Path) -> anyhow::Result<(bool, String)> {
    let (mut process, log) = start_as(
        cluster(),
        namespace,
        CLEANUP_ACCOUNT,
        "",
        free_port(),
        work,
        &[("NODEKEEPER_CLEANUP", "true")],
    )
    .await?;
    let status = tokio::task::spawn_blocking(move || process.process.wait()).await??;
    Ok((status.success(), std::fs::read_to_string(&log)?))
}

/// Requests by `username` from the audit log: (response code, `verb requestURI`).
fn audited(username: &str) -> anyhow::Result<Vec<(u64, String)>> {
    let path = cluster().audit_log().context("no audit log")?;
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["user"]["username"] == username)
        .map(|e| {
            let code = e["responseStatus"]["code"].as_u64().unwrap_or_default();
            let verb = e["verb"].as_str().unwrap_or_default();
            (
                code,
                format!("{verb} {}", e["requestURI"].as_str().unwrap_or_default()),
            )
        })
        .collect())
}

/// Requests by `username` that the API server refused with 403, from the audit log.
fn refused(username: &str) -> anyhow::Result<Vec<String>> {
    Ok(audited(username)?
        .into_iter()
        .filter_map(|(code, request)| (code == 403).then_some(request))
        .collect())
}

fn condition_types(node: &Node) -> Vec<String> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|c| c.iter().map(|c| c.type_.clone()).collect())
        .unwrap_or_default()
}

/// What a user compares on a Node before and after: condition types, labels, taints (key and
/// effect) and the cordon.
#[derive(Debug, PartialEq, Eq)]
struct NodeState {
    conditions: BTreeSet<String>,
    labels: BTreeMap<String, String>,
    taints: BTreeSet<(String, String)>,
    unschedulable: bool,
}

/// A node's state as far as an install or cleanup may change it. The legacy
/// `beta.kubernetes.io/{os,arch}` labels are left out: kube-controller-manager's node lifecycle
/// controller copies them from the stable labels whenever it gets to a node, which on a loaded
/// machine can fall between the two snapshots (seen in CI).
fn state(node: &Node) -> NodeState {
    let spec = node.spec.clone().unwrap_or_default();
    let mut labels = node.metadata.labels.clone().unwrap_or_default();
    labels.retain(|k, _| !k.starts_with("beta.kubernetes.io/"));
    NodeState {
        conditions: condition_types(node).into_iter().collect(),
        labels,
        taints: spec
            .taints
            .unwrap_or_default()
            .into_iter()
            .map(|t| (t.key, t.effect))
            .collect(),
        unschedulable: spec.unschedulable == Some(true),
    }
}

fn has_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

fn label(node: &Node, key: &str) -> Option<String> {
    node.metadata.labels.as_ref()?.get(key).cloned()
}

fn annotation(node: &Node, key: &str) -> Option<String> {
    node.metadata.annotations.as_ref()?.get(key).cloned()
}

/// Someone else's condition, taint and label on `node`, which the cleanup must leave.
async fn add_foreign(nodes: &Api<Node>, node: &str) -> anyhow::Result<()> {
    let params = PatchParams::apply("someone-else").force();
    nodes
        .patch_status(
            node,
            &params,
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Node",
                "status": {"conditions": [{"type": "SomeoneElsesCheck", "status": "True",
                    "reason": "Fine", "message": "not nodekeeper's",
                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
        )
        .await?;
    nodes
        .patch(
            node,
            &params,
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"labels": {"example.com/keep": "yes"}},
                "spec": {"taints": [{"key": "example.com/keep", "effect": "PreferNoSchedule"}]}})),
        )
        .await?;
    Ok(())
}

/// What a test installed and made nodekeeper do, to be cleaned up.
struct Installed {
    client: kube::Client,
    namespace: String,
    agent_nodes: Vec<String>,
    pool_node: String,
    /// Every node's state before nodekeeper touched it.
    before: BTreeMap<String, NodeState>,
    /// The NodeMaintenance that cordoned the pool node.
    nm: String,
    controller: nodekeeper_e2e::rig::ControllerProcess,
    agents: Vec<controller_common::AgentHandle>,
    work: tempfile::TempDir,
}

/// Installs the chart into a namespace of its own (not the default) with the cleanup's
/// ServiceAccount and RBAC, and lets nodekeeper leave its marks: the sweep's conditions on two
/// nodes with agents, a NodeMaintenance's cordon (taint, label, annotations, condition) on a
/// third, the leader Lease and the certificate Secrets. Someone else's condition, taint and
/// label sit beside them.
async fn install_and_use() -> anyhow::Result<Installed> {
    let client = cluster().client().await?;
    install_crds(&client).await?;
    // Another namespace than the default, for the install and the uninstall.
    let namespace = unique_name("nk-elsewhere");
    install_chart(&client, &namespace).await?;
    apply_all(
        &client,
        &cleanup_manifest(&namespace)?
            .into_iter()
            .filter(|o| o["kind"] != "Job")
            .collect::<Vec<_>>(),
    )
    .await?;
    let tuning: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    tuning
        .patch(
            "nodekeeper-tuning",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"sweepInterval": "5s", "callTimeout": "2s"}})),
        )
        .await?;
    let work = tempfile::tempdir()?;

    // Two nodes with agents (the sweep's conditions), one for the NodeMaintenance.
    let group = unique_name("un");
    let ips = loopback_ips(2);
    let labels = BTreeMap::from([(GROUP.to_owned(), group.clone())]);
    let agent_nodes = create_simulated_nodes(&client, "un-agent", 2, &labels, &ips).await?;
    let pool = unique_name("pool");
    let pool_labels = BTreeMap::from([("pool".to_owned(), pool.clone())]);
    let pool_node = create_simulated_nodes(&client, "un-pool", 1, &pool_labels, &[])
        .await?
        .remove(0);
    let nodes: Api<Node> = Api::all(client.clone());
    add_foreign(&nodes, &agent_nodes[0]).await?;
    add_foreign(&nodes, &pool_node).await?;
    // The node lifecycle controller takes the `node.kubernetes.io/not-ready` taint off a node
    // some seconds after it turned Ready; a snapshot taken before that would miss it after the
    // cleanup (seen in CI). Snapshot the nodes once it has.
    let mut before = BTreeMap::new();
    for name in agent_nodes.iter().chain([&pool_node]) {
        let settled = wait_for(
            &format!("{name} without the not-ready taint"),
            TIMEOUT,
            || {
                let nodes = nodes.clone();
                async move {
                    let n = nodes.get(name).await?;
                    Ok((!has_taint(&n, "node.kubernetes.io/not-ready")).then_some(n))
                }
            },
        )
        .await?;
        before.insert(name.clone(), state(&settled));
    }

    let port = free_port();
    let (controller, log) = start_as(
        cluster(),
        &namespace,
        CONTROLLER_ACCOUNT,
        &format!("{GROUP}={group}"),
        port,
        work.path(),
        &[],
    )
    .await?;
    let tls = agent_tls(&client, &namespace).await?;
    let mut agents = Vec::new();
    for (node, ip) in agent_nodes.iter().zip(&ips) {
        agents.push(start_agent(node, SocketAddr::new((*ip).into(), port), &tls).await?);
    }
    for node in &agent_nodes {
        controller_common::wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            None,
            TIMEOUT,
        )
        .await
        .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    }
    let maintenances: Api<NodeMaintenance> = Api::all(client.clone());
    let nm = unique_name("un-cordon");
    apply_spec(
        &maintenances,
        &nm,
        json!({"nodeSelector": {"matchLabels": {"pool": pool}}, "stage": "Cordon",
               "reason": "uninstall test"}),
    )
    .await?;
    wait_for("the pool node cordoned by nodekeeper", TIMEOUT, || {
        let nodes = nodes.clone();
        let name = pool_node.clone();
        async move {
            let n = nodes.get(&name).await?;
            let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
            Ok((cordoned
                && has_taint(&n, "nodekeeper.dev/maintenance")
                && label(&n, "nodekeeper.dev/maintained").is_some()
                && condition_types(&n).contains(&"MaintenanceInProgress".to_owned()))
            .then_some(()))
        }
    })
    .await?;

    Ok(Installed {
        client,
        namespace,
        agent_nodes,
        pool_node,
        before,
        nm,
        controller,
        agents,
        work,
    })
}

/// Asserts that every node is as it was before nodekeeper and that its Lease and Secrets are
/// gone, while someone else's marks and the install's own objects stay.
async fn assert_clean(installed: &Installed) -> anyhow::Result<()> {
    let Installed {
        client,
        namespace,
        agent_nodes,
        pool_node,
        before,
        ..
    } = installed;
    let nodes: Api<Node> = Api::all(client.clone());
    let tuning: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    // Every node is as it was before nodekeeper: the same condition types, labels, taints and
    // cordon state, and no nodekeeper annotation.
    // (The node lifecycle controller takes its `node.kubernetes.io/unschedulable` taint off an
    // uncordoned node a moment later, hence the wait.)
    for name in agent_nodes.iter().chain([pool_node]) {
        let was = &before[name.as_str()];
        let matched = wait_for(&format!("{name} as before nodekeeper"), TIMEOUT, || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get(name).await?;
                let clean = annotation(&n, "nodekeeper.dev/maintenance").is_none()
                    && annotation(&n, "nodekeeper.dev/cordoned-by").is_none();
                Ok((clean && state(&n) == *was).then_some(()))
            }
        })
        .await;
        if matched.is_err() {
            let now = state(&nodes.get(name).await?);
            anyhow::bail!("{name}: before nodekeeper {was:#?}, after the cleanup {now:#?}");
        }
    }
    for name in [&agent_nodes[0], pool_node] {
        let n = nodes.get(name).await?;
        ensure!(
            condition_types(&n).contains(&"SomeoneElsesCheck".to_owned()),
            "{name} lost someone else's condition"
        );
        ensure!(
            has_taint(&n, "example.com/keep"),
            "{name} lost someone else's taint"
        );
        ensure!(
            label(&n, "example.com/keep").is_some(),
            "{name} lost someone else's label"
        );
    }
    let pool_now = nodes.get(pool_node).await?;
    ensure!(
        pool_now.spec.as_ref().and_then(|s| s.unschedulable) != Some(true),
        "the pool node was schedulable before nodekeeper cordoned it, and is still cordoned"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    ensure!(leases.list(&ListParams::default()).await?.items.is_empty());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    for name in [
        "nodekeeper-ca",
        "nodekeeper-agent-tls",
        "nodekeeper-controller-tls",
    ] {
        ensure!(secrets.get_opt(name).await?.is_none(), "Secret {name} left");
    }
    // What the install put there is `kubectl delete -k deploy/`'s (or Helm's), not the cleanup's.
    ensure!(tuning.get_opt("nodekeeper-tuning").await?.is_some());

    Ok(())
}

/// The nodekeeper-specific lines of a finished cleanup's output: it is done, and it removed the
/// NodeMaintenance's finalizer.
async fn assert_cleanup_done(installed: &Installed, ok: bool, out: &str) -> anyhow::Result<()> {
    ensure!(ok, "cleanup failed:\n{out}");
    ensure!(out.contains("cleanup done:"), "{out}");
    ensure!(
        out.contains(&format!(
            "NodeMaintenance {}: removed finalizer",
            installed.nm
        )),
        "{out}"
    );
    let maintenances: Api<NodeMaintenance> = Api::all(installed.client.clone());
    let left = maintenances.get(&installed.nm).await?;
    ensure!(
        left.metadata.finalizers.unwrap_or_default().is_empty(),
        "the NodeMaintenance keeps a finalizer no controller will remove"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_what_nodekeeper_put_in_the_cluster_and_only_that() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let mut installed = install_and_use().await?;
    let (client, namespace, work) = (
        installed.client.clone(),
        installed.namespace.clone(),
        installed.work.path().to_owned(),
    );
    let nodes: Api<Node> = Api::all(client.clone());
    let maintenances: Api<NodeMaintenance> = Api::all(client.clone());
    let nm = installed.nm.clone();

    // While the controller runs, the cleanup refuses and changes nothing.
    let (ok, out) = cleanup(&namespace, &work).await?;
    ensure!(
        !ok,
        "the cleanup ran while the controller held its Lease:\n{out}"
    );
    ensure!(
        out.contains("still holds Lease")
            && out.contains("scale deployment/nodekeeper-controller --replicas=0"),
        "{out}"
    );
    let n = nodes.get(&installed.agent_nodes[0]).await?;
    ensure!(condition_types(&n).contains(&"NodekeeperReachable".to_owned()));

    // Stopped the hard way (a replica killed, not releasing its Lease): the cleanup waits the
    // duration the Lease itself declares, sees no renewal, and goes on.
    let held = Api::<Lease>::namespaced(client.clone(), &namespace)
        .get("nodekeeper-controller")
        .await?;
    let declared = held
        .spec
        .and_then(|s| s.lease_duration_seconds)
        .context("the controller's Lease declares no leaseDurationSeconds")?;
    installed.controller.kill();
    for agent in &installed.agents {
        agent.stop();
    }
    let (ok, out) = cleanup(&namespace, &work).await?;
    assert_cleanup_done(&installed, ok, &out).await?;
    ensure!(
        out.contains(&format!(
            "waiting {declared}s to see whether a controller still renews it"
        )),
        "{out}"
    );
    eprintln!("{out}");
    assert_clean(&installed).await?;

    // Idempotent.
    let (ok, again) = cleanup(&namespace, &work).await?;
    ensure!(
        ok && again.contains("nothing of nodekeeper's left"),
        "{again}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let user = format!("system:serviceaccount:{namespace}:{CLEANUP_ACCOUNT}");
    let denied = refused(&user)?;
    ensure!(
        denied.is_empty(),
        "refused to the cleanup account: {denied:#?}"
    );
    maintenances.delete(&nm, &DeleteParams::default()).await?;
    Ok(())
}

/// `deploy/uninstall/cleanup-job.yaml`'s Job in `installed.namespace`, run as a kubelet runs
/// its Pod: the controller image, the Pod template's args, env, user and security context, its
/// ServiceAccount's projected token. The Pod network's `kubernetes` Service is the API server's
/// loopback address here, so the container shares the host's network. (succeeded, its log).
async fn cleanup_in_container(installed: &Installed) -> anyhow::Result<(bool, String)> {
    let image = podman_common::load("controller")?;
    let job = cleanup_manifest(&installed.namespace)?
        .into_iter()
        .find(|o| o["kind"] == "Job")
        .context("no Job in deploy/uninstall/cleanup-job.yaml")?;
    let pod = job["spec"]["template"]["spec"].clone();
    podman_common::ensure_image(&pod, "nodekeeper-controller")?;
    let account = pod["serviceAccountName"]
        .as_str()
        .context("the Job's Pod names no ServiceAccount")?;
    let token = installed.work.path().join(unique_name("serviceaccount"));
    podman_common::service_account_volume(&installed.client, &installed.namespace, account, &token)
        .await?;
    let run = podman_common::PodRun {
        pod: &pod,
        image: &image,
        fields: BTreeMap::from([("metadata.namespace", installed.namespace.clone())]),
        volumes: BTreeMap::new(),
        env_overrides: BTreeMap::new(),
        network: Some("host".into()),
        service_account: Some((token, podman_common::api_server(cluster().kubeconfig())?)),
    };
    let container = run.start("nk-cleanup-job")?;
    let waited = tokio::time::timeout(
        TIMEOUT,
        tokio::task::spawn_blocking(move || (container.wait(), container)),
    )
    .await
    .context("the cleanup Job's container did not finish")?;
    let (code, container) = waited?;
    Ok((code? == 0, container.logs()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uninstall_job_runs_from_the_controller_image_as_its_service_account()
-> anyhow::Result<()> {
    nodekeeper_testkit::skip_unless_root!("needs root: podman runs the controller image");
    // Before the install: without the image this test fails at once.
    podman_common::archive("controller")?;
    let _serial = SERIAL.lock().await;
    let mut installed = install_and_use().await?;
    // The uninstall's order (README, "Uninstall"): the controller scaled to 0, the agents gone.
    installed.controller.stop();
    for agent in &installed.agents {
        agent.stop();
    }
    let (ok, out) = cleanup_in_container(&installed).await?;
    eprintln!("{out}");
    assert_cleanup_done(&installed, ok, &out).await?;
    assert_clean(&installed).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let user = format!(
        "system:serviceaccount:{}:{CLEANUP_ACCOUNT}",
        installed.namespace
    );
    let denied = refused(&user)?;
    ensure!(
        denied.is_empty(),
        "refused to the cleanup account: {denied:#?}"
    );
    // It acted as that ServiceAccount: the audit log has its writes.
    let acted = audited(&user)?;
    ensure!(
        acted
            .iter()
            .any(|(code, r)| *code == 200 && r.starts_with("delete ") && r.contains("/leases/")),
        "the audit log has no Lease deletion by {user}: {acted:#?}"
    );
    let maintenances: Api<NodeMaintenance> = Api::all(installed.client.clone());
    maintenances
        .delete(&installed.nm, &DeleteParams::default())
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_started_before_the_crds_waits_for_them() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = cluster().client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let ours: Vec<String> = nodekeeper_api::crd::all()
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    for name in &ours {
        let _ = crds.delete(name, &DeleteParams::default()).await;
    }
    wait_for("nodekeeper's CRDs to be gone", TIMEOUT, || {
        let crds = crds.clone();
        let ours = ours.clone();
        async move {
            for name in &ours {
                if crds.get_opt(name).await?.is_some() {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        }
    })
    .await?;
    let namespace = unique_name("nk-nocrds");
    install_chart(&client, &namespace).await?;
    let work = tempfile::tempdir()?;
    let (mut controller, log) = start_as(
        cluster(),
        &namespace,
        CONTROLLER_ACCOUNT,
        "nodekeeper.dev/none=none",
        free_port(),
        work.path(),
        &[],
    )
    .await?;
    let mut needles = vec![
        "waiting for nodekeeper's CRDs",
        "kubectl apply --server-side -f deploy/crds/",
    ];
    needles.extend(ours.iter().map(String::as_str));
    log_line(&log, &needles, TIMEOUT).await?;
    // It waits (several re-checks: 1 + 2 + 4 s), alive, without leading, and said so once.
    tokio::time::sleep(Duration::from_secs(8)).await;
    controller.process.check_alive()?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    ensure!(leases.list(&ListParams::default()).await?.items.is_empty());
    let text = std::fs::read_to_string(&log)?;
    let waits = text.matches("waiting for nodekeeper's CRDs").count();
    ensure!(waits == 1, "{waits} wait lines, want 1:\n{text}");

    install_crds(&client).await?;
    log_line(&log, &["CRDs are installed; starting"], TIMEOUT).await?;
    wait_for("the controller to lead", TIMEOUT, || {
        let leases = leases.clone();
        async move { Ok((!leases.list(&ListParams::default()).await?.items.is_empty()).then_some(())) }
    })
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    controller.process.check_alive()?;
    controller.stop();
    Ok(())
}

/// The uninstall manifests run the images and state directory the install uses.
#[test]
fn the_uninstall_manifests_match_the_install() -> anyhow::Result<()> {
    let installed = kustomize(&repo().join("deploy"))?;
    let find = |objects: &[Value], kind: &str, name: &str| -> anyhow::Result<Value> {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
            .with_context(|| format!("no {kind} {name}"))
    };
    let controller = find(&installed, "Deployment", "nodekeeper-controller")?;
    let agent = find(&installed, "DaemonSet", "nodekeeper-agent")?;
    let job = find(
        &cleanup_manifest("nodekeeper")?,
        "Job",
        "nodekeeper-cleanup",
    )?;
    let text = std::fs::read_to_string(repo().join("deploy/uninstall/agent-cleanup.yaml"))?;
    let host = find(&documents(&text)?, "DaemonSet", "nodekeeper-agent-cleanup")?;
    let pod = |o: &Value| o["spec"]["template"]["spec"].clone();
    let container = |o: &Value| pod(o)["containers"][0].clone();
    ensure!(container(&job)["image"] == container(&controller)["image"]);
    ensure!(container(&job)["args"][0] == "--cleanup");
    ensure!(pod(&job)["securityContext"] == pod(&controller)["securityContext"]);
    ensure!(container(&host)["image"] == container(&agent)["image"]);
    let env = |o: &Value, name: &str| {
        container(o)["env"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["name"] == name).cloned())
            .map(|e| e["value"].clone())
    };
    ensure!(env(&host, "NODEKEEPER_CLEANUP") == Some("true".into()));
    ensure!(env(&host, "NODEKEEPER_STATE_DIR") == env(&agent, "NODEKEEPER_STATE_DIR"));
    let state = |o: &Value| {
        pod(o)["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == "state").cloned())
            .map(|v| v["hostPath"]["path"].clone())
    };
    ensure!(state(&host).is_some() && state(&host) == state(&agent));
    Ok(())
}
