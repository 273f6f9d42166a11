//! `NodeMaintenance` end to end, through the real `nodekeeper-controller` process against the real
//! API server, with kwok nodes and pods, real Deployments, a StatefulSet, a DaemonSet and
//! PodDisruptionBudgets: stages, restore of the prior cordon, ordered drain groups behind PDBs,
//! skip rules, bare pods, timeouts, overlapping maintenances, deletion, and the admission
//! refusals. Each test runs alone (one controller acts on every NodeMaintenance in the cluster).
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test node_maintenance`.

mod controller_common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use controller_common::*;
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::NodeMaintenance;
use nodekeeper_api::crd::node_maintenance::{BlockReason, NodePhase, SkipReason};
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(120);
const GROUP: &str = "nodekeeper.dev/e2e-group";
const POOL: &str = "nodekeeper.dev/e2e-pool";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// One test at a time: every controller process acts on every NodeMaintenance.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Setup {
    client: kube::Client,
    ns: String,
    _controller: ControllerProcess,
}

async fn setup(prefix: &str, tuning: &[(&str, &str)]) -> anyhow::Result<Setup> {
    setup_with_env(prefix, tuning, &[]).await
}

/// [`setup`], with `env` added to the controller's environment.
async fn setup_with_env(
    prefix: &str,
    tuning: &[(&str, &str)],
    env: &[(&str, &str)],
) -> anyhow::Result<Setup> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, prefix).await?;
    put_tuning(&client, &ns, &tuning.iter().copied().collect()).await?;
    // The node sweep is pointed at no node: these tests have no agents.
    let controller = ControllerProcess::start(
        &ns,
        &unique_name("nm"),
        "nodekeeper.dev/no-such-label=none",
        free_port(),
        env,
    )?;
    // The controller has read the tuning ConfigMap before any maintenance is created.
    let addr = controller.http;
    wait_for(
        "the controller to load the tuning ConfigMap",
        TIMEOUT,
        || async move {
            let (status, body) = http_get(addr, "/api/v1/summary").await?;
            Ok((status == 200 && body.contains("resourceVersion")).then_some(()))
        },
    )
    .await?;
    Ok(Setup {
        client,
        ns,
        _controller: controller,
    })
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn apply_nm(
    client: &kube::Client,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<()> {
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let body = json!({
        "apiVersion": "nodekeeper.dev/v1alpha1",
        "kind": "NodeMaintenance",
        "metadata": { "name": name },
        "spec": spec,
    });
    api.patch(
        name,
        &PatchParams::apply("nodekeeper-e2e").force(),
        &Patch::Apply(&body),
    )
    .await
    .with_context(|| format!("apply nodemaintenance {name}"))?;
    Ok(())
}

async fn set_stage(client: &kube::Client, name: &str, stage: &str) -> anyhow::Result<()> {
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "stage": stage } })),
    )
    .await?;
    Ok(())
}

/// Waits until `check` holds for the maintenance; returns it.
async fn wait_nm(
    client: &kube::Client,
    name: &str,
    what: &str,
    check: impl Fn(&NodeMaintenance) -> bool,
) -> anyhow::Result<NodeMaintenance> {
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let check = &check;
    wait_for(&format!("nodemaintenance {name}: {what}"), TIMEOUT, || {
        let api = api.clone();
        async move {
            let nm = api.get(name).await?;
            Ok(check(&nm).then_some(nm))
        }
    })
    .await
}

fn condition(nm: &NodeMaintenance, type_: &str) -> Option<(String, String, String)> {
    nm.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                format!("{:?}", c.status),
                c.reason.clone(),
                c.message.clone(),
            )
        })
}

fn node_phase(nm: &NodeMaintenance, node: &str) -> Option<NodePhase> {
    nm.status
        .as_ref()?
        .nodes
        .iter()
        .find(|n| n.node == node)
        .map(|n| n.phase)
}

fn unschedulable(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

async fn node(client: &kube::Client, name: &str) -> anyhow::Result<Node> {
    Ok(Api::<Node>::all(client.clone()).get(name).await?)
}

async fn cordon_by_hand(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    // As `kubectl cordon` does: a patch by another field manager.
    Api::<Node>::all(client.clone())
        .patch(
            name,
            &PatchParams {
                field_manager: Some("kubectl-cordon".into()),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({ "spec": { "unschedulable": true } })),
        )
        .await?;
    Ok(())
}

/// Taints a node by hand, as `kubectl taint` does (another field manager).
async fn taint_by_hand(
    client: &kube::Client,
    name: &str,
    taint: serde_json::Value,
) -> anyhow::Result<()> {
    let mut taints = node(client, name)
        .await?
        .spec
        .and_then(|s| s.taints)
        .map(serde_json::to_value)
        .transpose()?
        .unwrap_or_else(|| json!([]));
    taints.as_array_mut().context("taints")?.push(taint);
    Api::<Node>::all(client.clone())
        .patch(
            name,
            &PatchParams {
                field_manager: Some("kubectl-taint".into()),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({ "spec": { "taints": taints } })),
        )
        .await?;
    Ok(())
}

/// A node's nodekeeper taints (key prefix `nodekeeper.dev/`) as (key, value, effect).
fn nodekeeper_taints(node: &Node) -> BTreeSet<(String, String, String)> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| {
            ts.iter()
                .filter(|t| t.key.starts_with("nodekeeper.dev/"))
                .map(|t| {
                    (
                        t.key.clone(),
                        t.value.clone().unwrap_or_default(),
                        t.effect.clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn taint_set(taints: &[(&str, &str, &str)]) -> BTreeSet<(String, String, String)> {
    taints
        .iter()
        .map(|(k, v, e)| ((*k).to_owned(), (*v).to_owned(), (*e).to_owned()))
        .collect()
}

async fn create(client: &kube::Client, ns: &str, value: serde_json::Value) -> anyhow::Result<()> {
    let kind = value["kind"].as_str().unwrap_or_default().to_owned();
    let name = value["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let pp = PostParams::default();
    match kind.as_str() {
        "Pod" => {
            Api::<Pod>::namespaced(client.clone(), ns)
                .create(&pp, &serde_json::from_value(value)?)
                .await?;
        }
        "Deployment" => {
            Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), ns)
                .create(&pp, &serde_json::from_value(value)?)
                .await?;
        }
        "StatefulSet" => {
            Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), ns)
                .create(&pp, &serde_json::from_value(value)?)
                .await?;
        }
        "DaemonSet" => {
            Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client.clone(), ns)
                .create(&pp, &serde_json::from_value(value)?)
                .await?;
        }
        "PodDisruptionBudget" => {
            Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(
                client.clone(),
                ns,
            )
            .create(&pp, &serde_json::from_value(value)?)
            .await?;
        }
        other => bail!("create: unsupported kind {other}"),
    }
    let _ = name;
    Ok(())
}

/// A pod template that lands only on nodes of `pool`.
fn template(
    app: &str,
    pool: &str,
    extra_labels: serde_json::Value,
    grace: i64,
) -> serde_json::Value {
    let mut labels = json!({ "app": app });
    if let Some(extra) = extra_labels.as_object() {
        labels.as_object_mut().unwrap().extend(extra.clone());
    }
    json!({
        "metadata": { "labels": labels },
        "spec": {
            "nodeSelector": { POOL: pool },
            "terminationGracePeriodSeconds": grace,
            "containers": [{ "name": "c", "image": "registry.invalid/nothing:1" }],
        },
    })
}

fn deployment(
    name: &str,
    replicas: i32,
    pool: &str,
    extra: serde_json::Value,
) -> serde_json::Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": template(name, pool, extra, 5),
        },
    })
}

fn pdb(name: &str, app: &str, rule: serde_json::Value) -> serde_json::Value {
    let mut spec = json!({ "selector": { "matchLabels": { "app": app } } });
    spec.as_object_mut()
        .unwrap()
        .extend(rule.as_object().unwrap().clone());
    json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": { "name": name },
        "spec": spec,
    })
}

/// Pods of the namespace that are Running, by name → node.
async fn running_pods(client: &kube::Client, ns: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    Ok(pods
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| Some((p.name_any(), p.spec.as_ref()?.node_name.clone()?)))
        .collect())
}

async fn wait_running(
    client: &kube::Client,
    ns: &str,
    n: usize,
) -> anyhow::Result<BTreeMap<String, String>> {
    wait_for(&format!("{n} running pods in {ns}"), TIMEOUT, || async {
        let pods = running_pods(client, ns).await?;
        Ok((pods.len() >= n).then_some(pods))
    })
    .await
}

/// Records, per pod (namespace/name → uid), the moment its deletion was first seen and the grace
/// period the deletion carried, from a watch.
/// When a deletion was first seen, the grace period it carried, and the pod's `app` label.
type Deletion = (Instant, Option<i64>, String);

#[derive(Default)]
struct Deletions {
    seen: Mutex<BTreeMap<String, Deletion>>,
    /// When a pod of an app was first seen Running on a node: (app, node) → time.
    running: Mutex<BTreeMap<(String, String), Instant>>,
    /// Deletions another Kubernetes component made and said so in the pod's `DisruptionTarget`
    /// condition (the taint manager when a loaded machine lets a kwok node's heartbeat lapse,
    /// pod GC, preemption): key → that condition's reason. Not the controller's doing, so not in
    /// `seen`; kept to be named when an assertion fails.
    others: Mutex<BTreeMap<String, String>>,
    /// Keys in `seen` whose pod went through the Eviction API (its `DisruptionTarget` condition
    /// says `EvictionByEvictionAPI`), as the controller's drain evicts. A pod deleted with no
    /// condition at all is in `seen` but not here: the controller's force-delete, or another
    /// component that does not say so (the StatefulSet controller replacing a pod).
    evicted: Mutex<std::collections::BTreeSet<String>>,
}

/// The reason of a pod's `DisruptionTarget` condition when a component other than the Eviction
/// API set it.
fn disrupted_by_another(pod: &Pod) -> Option<String> {
    let reason = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")?
        .reason
        .clone()?;
    (reason != "EvictionByEvictionAPI").then_some(reason)
}

/// Whether the pod's deletion came through the Eviction API.
fn evicted_by_the_api(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.type_ == "DisruptionTarget"
                    && c.status == "True"
                    && c.reason.as_deref() == Some("EvictionByEvictionAPI")
            })
        })
}

fn watch_deletions(client: &kube::Client, ns: &str) -> Arc<Deletions> {
    let out = Arc::new(Deletions::default());
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let sink = Arc::clone(&out);
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .touched_objects()
            .boxed();
        while let Ok(Some(pod)) = stream.try_next().await {
            let app = pod.labels().get("app").cloned().unwrap_or_default();
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            if running && pod.metadata.deletion_timestamp.is_none() {
                sink.running
                    .lock()
                    .unwrap()
                    .entry((app, node))
                    .or_insert_with(Instant::now);
            }
            if pod.metadata.deletion_timestamp.is_some() {
                let key = format!("{}@{}", pod.name_any(), pod.uid().unwrap_or_default());
                if let Some(reason) = disrupted_by_another(&pod) {
                    sink.others.lock().unwrap().insert(key, reason);
                    continue;
                }
                if evicted_by_the_api(&pod) {
                    sink.evicted.lock().unwrap().insert(key.clone());
                }
                let mut seen = sink.seen.lock().unwrap();
                seen.entry(key).or_insert((
                    Instant::now(),
                    pod.metadata.deletion_grace_period_seconds,
                    pod.labels().get("app").cloned().unwrap_or_default(),
                ));
            }
        }
    });
    out
}

async fn events_for(client: &kube::Client, nm: &str) -> anyhow::Result<Vec<(String, String)>> {
    // Events about a cluster-scoped object are written to `default`.
    let events: Api<KubeEvent> = Api::namespaced(client.clone(), "default");
    let list = events.list(&ListParams::default()).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(nm))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect())
}

/// Stages, restore, ordered groups behind a PDB, DaemonSet and mirror pods skipped, a bare pod
/// held until allowed, local storage reported, a StatefulSet moved, KEP-5683 node conditions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_in_order_behind_pdbs_and_restore_on_complete() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint", &[]).await?;
    let group = unique_name("drain");
    let pool = unique_name("pool");
    let nodes = create_simulated_nodes(
        &client,
        "nk-maint",
        2,
        &labels(&[(GROUP, &group), (POOL, &pool)]),
        &[],
    )
    .await?;
    // Node 1 was cordoned by someone before the maintenance: it must stay cordoned after. It
    // also carries a nodekeeper taint someone set by hand (same key as the maintenance taint,
    // another effect, so the DaemonSet still runs there): it must be there after, exactly.
    cordon_by_hand(&client, &nodes[1]).await?;
    let prior_taint = ("nodekeeper.dev/maintenance", "manual", "PreferNoSchedule");
    taint_by_hand(
        &client,
        &nodes[1],
        json!({ "key": prior_taint.0, "value": prior_taint.1, "effect": prior_taint.2 }),
    )
    .await?;

    // Workloads on node 0 (the only schedulable one of the pool yet).
    create(
        &client,
        &ns,
        deployment("front", 2, &pool, json!({ "tier": "front" })),
    )
    .await?;
    create(
        &client,
        &ns,
        pdb("front-pdb", "front", json!({ "maxUnavailable": 1 })),
    )
    .await?;
    let mut back = deployment("back", 2, &pool, json!({}));
    back["spec"]["template"]["spec"]["volumes"] = json!([{ "name": "scratch", "emptyDir": {} }]);
    create(&client, &ns, back).await?;
    create(
        &client,
        &ns,
        json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": { "name": "db" },
            "spec": {
                "replicas": 1, "serviceName": "db",
                "selector": { "matchLabels": { "app": "db" } },
                "template": template("db", &pool, json!({}), 5),
            },
        }),
    )
    .await?;
    create(
        &client,
        &ns,
        json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": { "name": "agent" },
            "spec": {
                "selector": { "matchLabels": { "app": "agent" } },
                "template": template("agent", &pool, json!({}), 5),
            },
        }),
    )
    .await?;
    // A static pod's mirror, and a bare pod, both bound to node 0.
    create(&client, &ns, json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "static-etcd", "annotations": { "kubernetes.io/config.mirror": "hash" } },
        "spec": { "nodeName": nodes[0], "containers": [{ "name": "c", "image": "registry.invalid/x:1" }] },
    })).await?;
    create(&client, &ns, json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "bare", "labels": { "app": "bare" } },
        "spec": { "nodeName": nodes[0], "containers": [{ "name": "c", "image": "registry.invalid/x:1" }] },
    })).await?;
    // 2 front + 2 back + 1 db + 2 agent (one per node) + static + bare.
    let placed = wait_running(&client, &ns, 9).await?;
    ensure!(
        placed
            .iter()
            .filter(|(p, _)| p.starts_with("front") || p.starts_with("back") || *p == "db-0")
            .all(|(_, n)| n == &nodes[0]),
        "workloads must start on node 0: {placed:?}"
    );
    // Room for the replacements, created only now.
    let spare =
        create_simulated_nodes(&client, "nk-spare", 1, &labels(&[(POOL, &pool)]), &[]).await?;
    let deletions = watch_deletions(&client, &ns);

    let name = unique_name("drain");
    apply_nm(
        &client,
        &name,
        json!({
            "nodeSelector": { "matchLabels": { GROUP: group } },
            "stage": "Cordon",
            "reason": "kernel upgrade",
            "drainPlan": [ { "podSelector": { "matchLabels": { "tier": "front" } } } ],
            "maxConcurrentNodes": 2,
        }),
    )
    .await?;
    wait_nm(&client, &name, "Ready after Cordon", |nm| {
        condition(nm, "Ready").is_some_and(|c| c.0 == "True")
    })
    .await?;
    // Cordoned, and tainted: the maintenance taint beside the one set by hand.
    let maintenance_taint = ("nodekeeper.dev/maintenance", "", "NoSchedule");
    for (n, want) in [
        (&nodes[0], taint_set(&[maintenance_taint])),
        (&nodes[1], taint_set(&[maintenance_taint, prior_taint])),
    ] {
        let n = node(&client, n).await?;
        ensure!(unschedulable(&n), "{} cordoned", n.name_any());
        ensure!(
            nodekeeper_taints(&n) == want,
            "{}: {:?}",
            n.name_any(),
            nodekeeper_taints(&n)
        );
    }
    ensure!(
        deletions.seen.lock().unwrap().is_empty(),
        "Cordon evicts nothing"
    );

    set_stage(&client, &name, "Drain").await?;
    // The bare pod holds node 0 up, named, with the fix.
    let nm = wait_nm(&client, &name, "bare pod blocking node 0", |nm| {
        nm.status.as_ref().is_some_and(|s| {
            s.nodes.iter().any(|n| {
                n.node == nodes[0]
                    && n.blocking_pods
                        .iter()
                        .any(|b| b.name == "bare" && b.reason == BlockReason::StandalonePod)
            })
        }) && node_phase(nm, &nodes[1]) == Some(NodePhase::Drained)
    })
    .await?;
    let n0 = nm
        .status
        .as_ref()
        .unwrap()
        .nodes
        .iter()
        .find(|n| n.node == nodes[0])
        .unwrap()
        .clone();
    let skipped: BTreeSet<(String, SkipReason)> = n0
        .skipped_pods
        .iter()
        .map(|s| (s.name.clone(), s.reason))
        .collect();
    ensure!(
        skipped.contains(&("static-etcd".to_string(), SkipReason::MirrorPod)),
        "{skipped:?}"
    );
    ensure!(
        skipped
            .iter()
            .any(|(n, r)| n.starts_with("agent-") && *r == SkipReason::DaemonSet),
        "{skipped:?}"
    );
    ensure!(
        condition(&nm, "Blocked").is_some_and(|c| c.0 == "True" && c.1 == "PodsBlocking"),
        "{:?}",
        condition(&nm, "Blocked")
    );
    // Node conditions on a drained node and on the draining one.
    let (s, _, m) =
        condition_of(&node(&client, &nodes[1]).await?, "Drained").context("Drained on node 1")?;
    ensure!(s == "True" && m.contains("kernel upgrade"), "{m}");
    let (s, _, _) = condition_of(&node(&client, &nodes[0]).await?, "DrainInProgress")
        .context("DrainInProgress")?;
    ensure!(s == "True");

    // Everything that may leave has left node 0, in plan order, and the replacements run.
    let pods_now = wait_for("node 0 emptied of evictable pods", TIMEOUT, || async {
        let pods = running_pods(&client, &ns).await?;
        let left: Vec<_> = pods
            .iter()
            .filter(|(_, n)| *n == &nodes[0])
            .map(|(p, _)| p.clone())
            .collect();
        Ok(left
            .iter()
            .all(|p| p == "bare" || p == "static-etcd" || p.starts_with("agent-"))
            .then_some(pods))
    })
    .await?;
    // The StatefulSet controller recreates db-0 after its eviction on its own schedule, so wait
    // for it rather than expecting it the moment node 0 is empty.
    wait_for(
        "the StatefulSet pod db-0 running on the spare node",
        TIMEOUT,
        || async {
            let pods = running_pods(&client, &ns).await?;
            Ok((pods.get("db-0") == Some(&spare[0])).then_some(pods))
        },
    )
    .await
    .with_context(|| format!("the StatefulSet pod moved to the spare node: {pods_now:?}"))?;
    {
        let seen = deletions.seen.lock().unwrap();
        let evicted = deletions.evicted.lock().unwrap();
        // The drain evicts; a deletion without the Eviction API's condition is not the
        // drain's (the StatefulSet controller may replace db-0 more than once on kwok).
        let when = |app: &str| {
            seen.iter()
                .filter(|(k, (_, _, a))| a == app && evicted.contains(*k))
                .map(|(_, (t, _, _))| *t)
                .collect::<Vec<_>>()
        };
        let (front, back, db) = (when("front"), when("back"), when("db"));
        ensure!(
            front.len() == 2 && back.len() == 2 && db.len() == 1,
            "evictions: {:?}; deleted without the Eviction API: {:?}; by other components: {:?}",
            seen.iter()
                .filter(|(k, _)| evicted.contains(*k))
                .map(|(_, v)| &v.2)
                .collect::<Vec<_>>(),
            seen.keys()
                .filter(|k| !evicted.contains(*k))
                .collect::<Vec<_>>(),
            deletions.others.lock().unwrap()
        );
        let last_front = front.iter().max().unwrap();
        ensure!(
            back.iter().chain(&db).all(|t| t > last_front),
            "group 1 waited for group 0 to be gone"
        );
        ensure!(
            !seen.values().any(|(_, _, a)| a == "agent" || a == "bare"),
            "DaemonSet and bare pods were not evicted"
        );
    }
    // The PDB allowed one front pod at a time: the second waited for a replacement Ready elsewhere.
    let events = events_for(&client, &name).await?;
    ensure!(
        events
            .iter()
            .any(|(r, n)| r == "EvictedWithLocalStorage" && n.contains("back-")),
        "{events:?}"
    );

    // Allowing bare pods lets node 0 finish.
    Api::<NodeMaintenance>::all(client.clone())
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "allowStandalonePods": true } })),
        )
        .await?;
    wait_nm(&client, &name, "both nodes drained", |nm| {
        nm.status.as_ref().is_some_and(|s| s.drained == 2)
            && condition(nm, "Ready").is_some_and(|c| c.0 == "True")
    })
    .await?;

    // Complete: node 0 uncordoned (nodekeeper cordoned it), node 1 stays cordoned (someone else
    // had), the conditions, label and annotation go.
    set_stage(&client, &name, "Complete").await?;
    wait_nm(&client, &name, "Ready after Complete", |nm| {
        condition(nm, "Ready").is_some_and(|c| c.0 == "True" && c.2.contains("released"))
    })
    .await?;
    let n0 = node(&client, &nodes[0]).await?;
    let n1 = node(&client, &nodes[1]).await?;
    ensure!(!unschedulable(&n0), "node 0 uncordoned");
    ensure!(
        unschedulable(&n1),
        "node 1 was cordoned before and stays so"
    );
    // The taints as they were before: none on node 0, exactly the hand-set one on node 1.
    ensure!(
        nodekeeper_taints(&n0).is_empty(),
        "{:?}",
        nodekeeper_taints(&n0)
    );
    ensure!(
        nodekeeper_taints(&n1) == taint_set(&[prior_taint]),
        "{:?}",
        nodekeeper_taints(&n1)
    );
    for n in [&n0, &n1] {
        ensure!(
            condition_of(n, "Drained").is_none()
                && condition_of(n, "MaintenanceInProgress").is_none(),
            "conditions removed from {}",
            n.name_any()
        );
        ensure!(
            !n.annotations().contains_key("nodekeeper.dev/maintenance"),
            "annotation removed"
        );
        ensure!(
            !n.labels().contains_key("nodekeeper.dev/maintained"),
            "label removed"
        );
    }
    Ok(())
}

fn condition_of(node: &Node, type_: &str) -> Option<(String, String, String)> {
    controller_common::condition(node, type_)
}

/// `drainTimeout` with each `onTimeout`: a PDB that never allows an eviction holds each node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_fail_proceed_and_force_delete_with_the_pods_grace() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint-timeout", &[]).await?;
    let mut names = Vec::new();
    let mut nodes = Vec::new();
    for action in ["Fail", "Proceed", "ForceDelete"] {
        let group = unique_name(action);
        let pool = unique_name("pool");
        let n = create_simulated_nodes(
            &client,
            "nk-timeout",
            1,
            &labels(&[(GROUP, &group), (POOL, &pool)]),
            &[],
        )
        .await?;
        let app = format!("app-{}", action.to_lowercase());
        let mut d = deployment(&app, 1, &pool, json!({}));
        d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = json!(6);
        create(&client, &ns, d).await?;
        create(
            &client,
            &ns,
            pdb(
                &format!("{app}-pdb"),
                &app,
                json!({ "minAvailable": "100%" }),
            ),
        )
        .await?;
        names.push((action, unique_name("timeout"), group));
        nodes.push(n[0].clone());
    }
    wait_running(&client, &ns, 3).await?;
    let deletions = watch_deletions(&client, &ns);
    let started = Instant::now();
    for (action, name, group) in &names {
        apply_nm(
            &client,
            name,
            json!({
                "nodeSelector": { "matchLabels": { GROUP: group } },
                "stage": "Drain", "drainTimeout": "15s", "onTimeout": action,
            }),
        )
        .await?;
    }
    // While waiting, the PDB is named as the blocker.
    let nm = wait_nm(&client, &names[0].1, "PDB named as blocker", |nm| {
        nm.status.as_ref().is_some_and(|s| {
            s.nodes.iter().any(|n| {
                n.blocking_pods.iter().any(|b| {
                    b.reason == BlockReason::PodDisruptionBudget
                        && b.pdb.as_deref() == Some("app-fail-pdb")
                })
            })
        })
    })
    .await?;
    ensure!(condition(&nm, "Blocked").is_some_and(|c| c.0 == "True"));

    let failed = wait_nm(&client, &names[0].1, "Fail", |nm| {
        node_phase(nm, &nodes[0]) == Some(NodePhase::Failed)
    })
    .await?;
    ensure!(
        started.elapsed() >= Duration::from_secs(14),
        "not before the timeout"
    );
    ensure!(condition(&failed, "Blocked").is_some_and(|c| c.1 == "DrainFailed"));
    ensure!(
        unschedulable(&node(&client, &nodes[0]).await?),
        "a failed node stays cordoned"
    );
    let proceed = wait_nm(&client, &names[1].1, "Proceed", |nm| {
        node_phase(nm, &nodes[1]) == Some(NodePhase::Drained)
    })
    .await?;
    let msg = &proceed.status.as_ref().unwrap().nodes[0].message;
    ensure!(
        msg.contains("pods left") && msg.contains("app-proceed"),
        "{msg}"
    );
    wait_nm(&client, &names[2].1, "ForceDelete drained", |nm| {
        node_phase(nm, &nodes[2]) == Some(NodePhase::Drained)
    })
    .await?;
    {
        let seen = deletions.seen.lock().unwrap();
        let forced: Vec<_> = seen
            .values()
            .filter(|(_, _, a)| a == "app-forcedelete")
            .collect();
        ensure!(!forced.is_empty(), "the ForceDelete pod was deleted");
        let (at, grace, _) = forced[0];
        ensure!(
            *grace == Some(6),
            "deleted with its own grace period, not 0: {grace:?}"
        );
        let deadline = started + Duration::from_secs(16);
        ensure!(
            *at + Duration::from_secs(5) <= deadline,
            "deleted early enough to use its grace before the deadline"
        );
        ensure!(
            !seen
                .values()
                .any(|(_, _, a)| a == "app-fail" || a == "app-proceed"),
            "Fail and Proceed delete nothing"
        );
    }
    for (_, name, _) in &names {
        Api::<NodeMaintenance>::all(client.clone())
            .delete(name, &DeleteParams::default())
            .await?;
    }
    Ok(())
}

/// Two maintenances on one node: the first to finish leaves it cordoned; deleting the last
/// restores it (finalizer) and says so in an Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_maintenances_and_delete_restore() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        _controller,
        ..
    } = setup("nk-maint-overlap", &[]).await?;
    let group = unique_name("overlap");
    let nodes =
        create_simulated_nodes(&client, "nk-overlap", 1, &labels(&[(GROUP, &group)]), &[]).await?;
    let (a, b) = (unique_name("a"), unique_name("b"));
    for name in [&a, &b] {
        apply_nm(
            &client,
            name,
            json!({ "nodeSelector": { "matchLabels": { GROUP: group } }, "stage": "Cordon" }),
        )
        .await?;
        wait_nm(&client, name, "cordoned", |nm| {
            condition(nm, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await?;
    }
    set_stage(&client, &a, "Complete").await?;
    wait_nm(&client, &a, "complete", |nm| {
        condition(nm, "Ready").is_some_and(|c| c.0 == "True" && c.2.contains("released"))
    })
    .await?;
    let n = node(&client, &nodes[0]).await?;
    ensure!(unschedulable(&n), "b still holds the node");
    ensure!(n.annotations()["nodekeeper.dev/maintenance"].contains(&b));
    ensure!(
        nodekeeper_taints(&n) == taint_set(&[("nodekeeper.dev/maintenance", "", "NoSchedule")]),
        "b's hold keeps the maintenance taint: {:?}",
        nodekeeper_taints(&n)
    );

    let api: Api<NodeMaintenance> = Api::all(client.clone());
    api.delete(&b, &DeleteParams::default()).await?;
    wait_for("b gone", TIMEOUT, || async {
        Ok(api.get_opt(&b).await?.is_none().then_some(()))
    })
    .await?;
    let n = node(&client, &nodes[0]).await?;
    ensure!(
        !unschedulable(&n),
        "the last holder's deletion restored the node"
    );
    ensure!(
        nodekeeper_taints(&n).is_empty(),
        "and took the maintenance taint off: {:?}",
        nodekeeper_taints(&n)
    );
    ensure!(condition_of(&n, "MaintenanceInProgress").is_none());
    let events = events_for(&client, &b).await?;
    ensure!(
        events.iter().any(|(r, _)| r == "NodesRestored"),
        "{events:?}"
    );
    Ok(())
}

/// Selections refused before any node is touched, and the explicit override.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broad_selections_are_refused_before_any_node_is_touched() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        _controller,
        ..
    } = setup("nk-maint-admit", &[("maintenance.maxSelectedNodes", "2")]).await?;
    let group = unique_name("admit");
    let nodes =
        create_simulated_nodes(&client, "nk-admit", 3, &labels(&[(GROUP, &group)]), &[]).await?;
    let cp = create_simulated_nodes(
        &client,
        "nk-cp",
        1,
        &labels(&[("node-role.kubernetes.io/control-plane", "")]),
        &[],
    )
    .await?;

    let cases = [
        // Every node whatever labels the shared API server's other nodes carry: a label no
        // node has, absent. (`kubernetes.io/os: linux`, the everyday mistake, missed a Node
        // another test binary had left without it.)
        (
            json!({ "matchExpressions": [{ "key": "nodekeeper.dev/e2e-no-node-has-this", "operator": "DoesNotExist" }] }),
            "every node in the cluster",
        ),
        (
            json!({ "matchExpressions": [{ "key": "node-role.kubernetes.io/control-plane", "operator": "Exists" }] }),
            "every control-plane node",
        ),
        (
            json!({ "matchLabels": { GROUP: group } }),
            "maintenance.maxSelectedNodes",
        ),
    ];
    let mut names = Vec::new();
    for (selector, expect) in &cases {
        let name = unique_name("refused");
        apply_nm(
            &client,
            &name,
            json!({ "nodeSelector": selector, "stage": "Drain" }),
        )
        .await?;
        let nm = wait_nm(&client, &name, "refused", |nm| {
            condition(nm, "Ready").is_some_and(|c| c.1 == "Refused")
        })
        .await?;
        let (_, _, message) = condition(&nm, "Ready").unwrap();
        ensure!(
            message.contains(expect) && message.contains("spec.allowBroadSelection"),
            "{message}"
        );
        names.push(name);
    }
    for n in nodes.iter().chain(&cp) {
        let n = node(&client, n).await?;
        ensure!(
            !unschedulable(&n) && !n.annotations().contains_key("nodekeeper.dev/maintenance"),
            "{} untouched",
            n.name_any()
        );
    }
    // Nothing selected: said so, nothing done.
    let none = unique_name("none");
    apply_nm(
        &client,
        &none,
        json!({ "nodeSelector": { "matchLabels": { GROUP: "no-such-group" } }, "stage": "Cordon" }),
    )
    .await?;
    wait_nm(&client, &none, "no matching nodes", |nm| {
        condition(nm, "Ready").is_some_and(|c| c.1 == "NoMatchingNodes")
    })
    .await?;
    // The override proceeds.
    Api::<NodeMaintenance>::all(client.clone())
        .patch(
            &names[2],
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "allowBroadSelection": true, "stage": "Cordon" } })),
        )
        .await?;
    wait_nm(&client, &names[2], "cordoned with the override", |nm| {
        condition(nm, "Ready").is_some_and(|c| c.0 == "True")
    })
    .await?;
    ensure!(unschedulable(&node(&client, &nodes[0]).await?));
    for name in names.iter().chain([&none]) {
        Api::<NodeMaintenance>::all(client.clone())
            .delete(name, &DeleteParams::default())
            .await?;
    }
    wait_for("override's nodes restored", TIMEOUT, || async {
        Ok((!unschedulable(&node(&client, &nodes[0]).await?)).then_some(()))
    })
    .await?;
    Ok(())
}

/// Moving the stage back from Drain to Cordon stops evicting at once; Idle lets the node go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_back_stops_evicting_and_idle_releases() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint-back", &[]).await?;
    let group = unique_name("back");
    let pool = unique_name("pool");
    let nodes = create_simulated_nodes(
        &client,
        "nk-back",
        1,
        &labels(&[(GROUP, &group), (POOL, &pool)]),
        &[],
    )
    .await?;
    create(&client, &ns, deployment("held", 1, &pool, json!({}))).await?;
    create(
        &client,
        &ns,
        pdb("held-pdb", "held", json!({ "minAvailable": "100%" })),
    )
    .await?;
    wait_running(&client, &ns, 1).await?;
    let deletions = watch_deletions(&client, &ns);
    let name = unique_name("back");
    apply_nm(
        &client,
        &name,
        json!({ "nodeSelector": { "matchLabels": { GROUP: group } }, "stage": "Drain" }),
    )
    .await?;
    wait_nm(&client, &name, "blocked by the PDB", |nm| {
        nm.status.as_ref().is_some_and(|s| s.blocked == 1)
    })
    .await?;
    set_stage(&client, &name, "Cordon").await?;
    wait_nm(&client, &name, "cordoned, not draining", |nm| {
        node_phase(nm, &nodes[0]) == Some(NodePhase::Cordoned)
    })
    .await?;
    // The budget goes away: a controller still draining would evict the pod now.
    Api::<k8s_openapi::api::policy::v1::PodDisruptionBudget>::namespaced(client.clone(), &ns)
        .delete("held-pdb", &DeleteParams::default())
        .await?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    ensure!(
        deletions.seen.lock().unwrap().is_empty(),
        "no eviction after moving back to Cordon"
    );
    let n = node(&client, &nodes[0]).await?;
    ensure!(unschedulable(&n));
    ensure!(
        condition_of(&n, "DrainInProgress").is_some_and(|c| c.0 == "False"),
        "{:?}",
        condition_of(&n, "DrainInProgress")
    );
    set_stage(&client, &name, "Idle").await?;
    wait_for("node released by Idle", TIMEOUT, || async {
        let n = node(&client, &nodes[0]).await?;
        Ok(
            (!unschedulable(&n) && condition_of(&n, "MaintenanceInProgress").is_none())
                .then_some(()),
        )
    })
    .await?;
    ensure!(
        deletions.seen.lock().unwrap().is_empty(),
        "Idle evicts nothing"
    );
    Ok(())
}

/// One audited request: (verb, HTTP code, when it was received).
type Audited = (String, i64, Timestamp);

/// The audited requests on `resource`/`subresource` named `name`, in order.
fn audited(text: &str, resource: &str, subresource: &str, name: &str) -> Vec<Audited> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| {
            let o = &e["objectRef"];
            o["resource"] == resource
                && o["subresource"].as_str().unwrap_or_default() == subresource
                && o["name"] == name
        })
        .map(|e| {
            (
                e["verb"].as_str().unwrap_or_default().to_owned(),
                e["responseStatus"]["code"].as_i64().unwrap_or(0),
                e["requestReceivedTimestamp"]
                    .as_str()
                    .and_then(|t| t.parse().ok())
                    .unwrap_or_default(),
            )
        })
        .collect()
}

/// The leader is killed in the middle of a drain, on a private control plane with audit
/// logging: the next leader continues from what is recorded on the nodes (same drain start, so
/// the timeout is not reset), and the audit log shows every pod evicted exactly once across the
/// two leaders (an eviction accepted by the first is not sent again by the second) and both
/// draining nodes written by the second leader (none forgotten).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_handover_mid_drain_evicts_each_pod_once_and_forgets_no_node() -> anyhow::Result<()>
{
    let _serial = SERIAL.lock().await;
    let mut options = nodekeeper_e2e::controlplane::Options::new(
        format!("test-{}-nm-handover", std::process::id()),
        nodekeeper_e2e::controlplane::Lifetime::WithThisProcess,
    );
    options.audit = true;
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(options)).await??;
    let audit_log = cp.audit_log().context("audit enabled")?;
    let client = cp.client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-maint-leader").await?;
    put_tuning(&client, &ns, &BTreeMap::new()).await?;
    let timing = [
        ("NODEKEEPER_LEASE_DURATION", "6s"),
        ("NODEKEEPER_RENEW_DEADLINE", "4s"),
        ("NODEKEEPER_RETRY_PERIOD", "1s"),
    ];
    // This test binary as a controller, against the private control plane.
    let start = |identity: &str| -> anyhow::Result<ControllerProcess> {
        let config = nodekeeper_e2e::rig::ControllerConfig {
            kubeconfig: cp.kubeconfig().to_owned(),
            namespace: ns.clone(),
            identity: identity.to_owned(),
            http: std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, free_port())),
            agent_port: free_port(),
            node_selector: "nodekeeper.dev/no-such-label=none".into(),
            log: Some("info,kube=warn".into()),
            env: timing
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            output: nodekeeper_e2e::rig::Output::Stderr,
        };
        ControllerProcess::spawn(
            &nodekeeper_e2e::rig::Program::this_test_binary(HELPER, "controller")?,
            &config,
        )
    };
    let mut first = start("leader-a")?;
    let group = unique_name("handover");
    let pool = unique_name("pool");
    // A node outside the selection and the pool: this cluster is the test's alone, and a
    // selector picking every node of a cluster is refused.
    create_simulated_nodes(&client, "nk-handover-other", 1, &BTreeMap::new(), &[]).await?;
    let nodes = create_simulated_nodes(
        &client,
        "nk-handover",
        2,
        &labels(&[(GROUP, &group), (POOL, &pool)]),
        &[],
    )
    .await?;
    // Four pods, two on each node (left to the scheduler, 3 + 1 happens, and the first eviction
    // can then drain a node outright); their budget lets one go at a time. Cordoned nodes leave
    // the spread (`nodeTaintsPolicy: Honor`), so the replacements may all go to the spare node.
    let mut slow = deployment("slow", 4, &pool, json!({}));
    slow["spec"]["template"]["spec"]["topologySpreadConstraints"] = json!([{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "nodeTaintsPolicy": "Honor",
        "labelSelector": { "matchLabels": { "app": "slow" } },
    }]);
    create(&client, &ns, slow).await?;
    create(
        &client,
        &ns,
        pdb("slow-pdb", "slow", json!({ "maxUnavailable": 1 })),
    )
    .await?;
    let placed = wait_running(&client, &ns, 4).await?;
    for n in &nodes {
        let on = placed.values().filter(|p| *p == n).count();
        ensure!(on == 2, "{on} pods on {n}, want 2 a node: {placed:?}");
    }
    let originals: BTreeSet<String> = placed.into_keys().collect();
    let deletions = watch_deletions(&client, &ns);
    let name = unique_name("handover");
    apply_nm(
        &client,
        &name,
        json!({ "nodeSelector": { "matchLabels": { GROUP: group } }, "stage": "Drain", "maxConcurrentNodes": 2 }),
    )
    .await?;
    // The first leader evicts one pod; its replacement has nowhere to run (both nodes of the
    // pool are cordoned), so the budget holds the rest.
    wait_nm(&client, &name, "both draining, blocked", |nm| {
        nm.status.as_ref().is_some_and(|s| {
            s.blocked >= 1
                && s.nodes
                    .iter()
                    .filter(|n| n.phase == NodePhase::Draining)
                    .count()
                    == 2
        })
    })
    .await?;
    wait_for("the first eviction", TIMEOUT, || async {
        Ok((!deletions.seen.lock().unwrap().is_empty()).then_some(()))
    })
    .await?;
    let record = |n: &Node| {
        n.annotations()
            .get("nodekeeper.dev/maintenance")
            .cloned()
            .unwrap_or_default()
    };
    let mut before = Vec::new();
    for n in &nodes {
        let r = record(&node(&client, n).await?);
        ensure!(r.contains("drainStart"), "{r}");
        before.push(r);
    }

    first.kill();
    let handover = Timestamp::now();
    let _second = start("leader-b")?;
    // Room for the replacements only now: the new leader must pick the drain up and finish it.
    create_simulated_nodes(
        &client,
        "nk-handover-spare",
        1,
        &labels(&[(POOL, &pool)]),
        &[],
    )
    .await?;
    wait_nm(&client, &name, "both drained after the handover", |nm| {
        nodes
            .iter()
            .all(|n| node_phase(nm, n) == Some(NodePhase::Drained))
    })
    .await?;
    for (n, before) in nodes.iter().zip(&before) {
        let after: serde_json::Value = serde_json::from_str(&record(&node(&client, n).await?))?;
        let before: serde_json::Value = serde_json::from_str(before)?;
        ensure!(
            after["holders"][&name]["drainStart"] == before["holders"][&name]["drainStart"],
            "{n}: the drain start survived the handover: {before} → {after}"
        );
    }

    // The audit log: every original pod evicted (201) exactly once, some by each leader.
    let text = std::fs::read_to_string(&audit_log)?;
    let mut by_first = 0;
    let mut by_second = 0;
    for pod in &originals {
        let accepted: Vec<Audited> = audited(&text, "pods", "eviction", pod)
            .into_iter()
            .filter(|(verb, code, _)| verb == "create" && (200..300).contains(code))
            .collect();
        ensure!(
            accepted.len() == 1,
            "pod {pod} evicted exactly once, not {}: {accepted:?}",
            accepted.len()
        );
        if accepted[0].2 < handover {
            by_first += 1;
        } else {
            by_second += 1;
        }
    }
    ensure!(
        by_first >= 1 && by_second >= 1,
        "evictions on both sides of the handover ({by_first} before, {by_second} after)"
    );
    // No node forgotten: the second leader wrote each node's hold (Drained) itself.
    for n in &nodes {
        let after_handover = audited(&text, "nodes", "", n)
            .into_iter()
            .filter(|(verb, code, at)| verb == "patch" && *code == 200 && *at > handover)
            .count();
        ensure!(
            after_handover >= 1,
            "{n}: written by the second leader after the handover"
        );
    }
    let seen = deletions.seen.lock().unwrap();
    ensure!(
        seen.values().filter(|(_, _, a)| a == "slow").count() == 4,
        "the four original pods deleted once each: {:?}",
        seen.keys()
    );
    Ok(())
}

/// `maxConcurrentNodes` bounds one maintenance; the tuning ConfigMap's
/// `maintenance.maxConcurrentNodes` bounds all of them together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_per_maintenance_and_cluster_wide() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint-conc", &[("maintenance.maxConcurrentNodes", "2")]).await?;
    let (ga, gb) = (unique_name("conc-a"), unique_name("conc-b"));
    let pool = unique_name("pool");
    let a = create_simulated_nodes(
        &client,
        "nk-conc-a",
        3,
        &labels(&[(GROUP, &ga), (POOL, &pool)]),
        &[],
    )
    .await?;
    let b = create_simulated_nodes(
        &client,
        "nk-conc-b",
        2,
        &labels(&[(GROUP, &gb), (POOL, &pool)]),
        &[],
    )
    .await?;
    // One pod per node that a budget never lets go: every drain stays in progress.
    let mut d = deployment("stuck", 5, &pool, json!({}));
    d["spec"]["template"]["spec"]["topologySpreadConstraints"] = json!([{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": { "matchLabels": { "app": "stuck" } },
    }]);
    create(&client, &ns, d).await?;
    create(
        &client,
        &ns,
        pdb("stuck-pdb", "stuck", json!({ "minAvailable": "100%" })),
    )
    .await?;
    let placed = wait_running(&client, &ns, 5).await?;
    ensure!(
        placed.values().collect::<BTreeSet<_>>().len() == 5,
        "one pod per node: {placed:?}"
    );

    let (na, nb) = (unique_name("conc-a"), unique_name("conc-b"));
    apply_nm(&client, &na, json!({ "nodeSelector": { "matchLabels": { GROUP: ga } }, "stage": "Drain", "maxConcurrentNodes": 1 })).await?;
    let nm = wait_nm(&client, &na, "one node draining, two waiting", |nm| {
        nm.status.as_ref().is_some_and(|s| {
            s.nodes
                .iter()
                .filter(|n| n.phase == NodePhase::Draining)
                .count()
                == 1
                && s.nodes
                    .iter()
                    .filter(|n| n.phase == NodePhase::Waiting)
                    .count()
                    == 2
        })
    })
    .await?;
    // A waiting node is not cordoned and says it is planned.
    let waiting = nm
        .status
        .as_ref()
        .unwrap()
        .nodes
        .iter()
        .find(|n| n.phase == NodePhase::Waiting)
        .unwrap()
        .node
        .clone();
    let w = node(&client, &waiting).await?;
    ensure!(
        !unschedulable(&w),
        "a node waiting its turn stays schedulable"
    );
    ensure!(condition_of(&w, "MaintenancePlanned").is_some_and(|c| c.0 == "True"));

    // B may use only the one slot left of the cluster's two.
    apply_nm(&client, &nb, json!({ "nodeSelector": { "matchLabels": { GROUP: gb } }, "stage": "Drain", "maxConcurrentNodes": 2 })).await?;
    wait_nm(
        &client,
        &nb,
        "one of two draining under the cluster ceiling",
        |nm| {
            nm.status.as_ref().is_some_and(|s| {
                s.nodes
                    .iter()
                    .filter(|n| n.phase == NodePhase::Draining)
                    .count()
                    == 1
                    && s.nodes
                        .iter()
                        .filter(|n| n.phase == NodePhase::Waiting)
                        .count()
                        == 1
            })
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let draining: usize = {
        let all = Api::<Node>::all(client.clone())
            .list(&ListParams::default().labels("nodekeeper.dev/maintained=true"))
            .await?;
        all.items
            .iter()
            .filter(|n| a.contains(&n.name_any()) || b.contains(&n.name_any()))
            .filter(|n| unschedulable(n))
            .count()
    };
    ensure!(
        draining == 2,
        "two nodes cordoned-and-draining across both maintenances, got {draining}"
    );
    for name in [&na, &nb] {
        Api::<NodeMaintenance>::all(client.clone())
            .delete(name, &DeleteParams::default())
            .await?;
    }
    Ok(())
}

/// The eviction the controller sends carries the listed pod's UID, and the real API server
/// enforces it: a replacement with the same name (a StatefulSet's, still Pending) is never
/// evicted in place of the pod that was listed. kube 5.0's own `Api::evict` drops the options
/// (it names the field `delete_options`), which once let a drain evict a StatefulSet's new pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_for_a_pod_that_is_gone_spares_its_same_named_replacement() -> anyhow::Result<()>
{
    use nodekeeper_controller::controllers::node_maintenance::eviction::{self, EvictionAnswer};
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-evict-uid").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    // Never scheduled (no node has this label): Pending, which the eviction subresource deletes
    // without consulting any budget — the case where a wrong target costs a pod.
    let pending = |name: &str| {
        serde_json::from_value::<Pod>(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name },
            "spec": {
                "nodeSelector": { "nodekeeper.dev/no-such-node": "x" },
                "containers": [{ "name": "c", "image": "registry.invalid/x:1" }],
            },
        }))
    };
    let old = pods
        .create(&PostParams::default(), &pending("db-0")?)
        .await?;
    let old_uid = old.uid().context("uid")?;
    pods.delete("db-0", &DeleteParams::default().grace_period(0))
        .await?;
    wait_for("the first db-0 gone", TIMEOUT, || async {
        Ok(pods.get_opt("db-0").await?.is_none().then_some(()))
    })
    .await?;
    let replacement = pods
        .create(&PostParams::default(), &pending("db-0")?)
        .await?;
    let answer = eviction::send(&pods, "db-0", Some(&old_uid)).await;
    ensure!(answer == EvictionAnswer::Gone, "{answer:?}");
    let now = pods.get("db-0").await?;
    ensure!(
        now.uid() == replacement.uid() && now.metadata.deletion_timestamp.is_none(),
        "the replacement must be untouched"
    );
    // The right UID evicts it.
    let answer = eviction::send(&pods, "db-0", replacement.uid().as_deref()).await;
    ensure!(answer == EvictionAnswer::Evicted, "{answer:?}");
    let gone = pods
        .get_opt("db-0")
        .await?
        .is_none_or(|p| p.metadata.deletion_timestamp.is_some());
    ensure!(gone, "the evicted pod is deleted or terminating");
    Ok(())
}

/// What the controllers' Node applies rely on, checked on the real kube-apiserver: a
/// server-side apply to a Node that does not exist creates it, even with a resourceVersion (so a
/// hold released on a Node deleted meanwhile would bring back an empty Node), while the same
/// apply carrying the deleted Node's uid is refused with 409 and creates nothing. Every apply to
/// the main resource of an existing object in the controllers carries the uid it read.
#[tokio::test]
async fn an_apply_with_the_uid_of_a_deleted_node_creates_nothing() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let name = unique_name("nm-uid");
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": { "name": name },
    }))?;
    let created = nodes.create(&PostParams::default(), &node).await?;
    let (uid, version) = (created.uid(), created.resource_version());
    nodes.delete(&name, &DeleteParams::default()).await?;
    wait_for("the node gone", TIMEOUT, || async {
        Ok(nodes.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    let params = PatchParams::apply("nodekeeper-e2e").force();
    let hold = |guard: serde_json::Value| {
        let mut metadata =
            json!({ "name": name, "labels": { "nodekeeper.dev/maintained": "true" } });
        for (k, v) in guard.as_object().into_iter().flatten() {
            metadata[k] = v.clone();
        }
        json!({ "apiVersion": "v1", "kind": "Node", "metadata": metadata })
    };

    let refused = nodes
        .patch(
            &name,
            &params,
            &Patch::Apply(hold(json!({ "uid": uid, "resourceVersion": version }))),
        )
        .await;
    match refused {
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        other => bail!("an apply with the deleted node's uid was not refused with 409: {other:?}"),
    }
    ensure!(
        nodes.get_opt(&name).await?.is_none(),
        "the refused apply created {name}"
    );

    // Without the uid the same apply makes a new Node: the danger the uid guards against.
    nodes
        .patch(
            &name,
            &params,
            &Patch::Apply(hold(json!({ "resourceVersion": version }))),
        )
        .await
        .context("an unguarded apply to a missing node")?;
    ensure!(
        nodes.get_opt(&name).await?.is_some(),
        "an apply without uid no longer creates a missing node: the guard may be dropped"
    );
    nodes.delete(&name, &DeleteParams::default()).await?;
    Ok(())
}

/// The controller's NodeMaintenance caches (`nodekeeper_maintenance_cached_{nodes,pods}` on its
/// /metrics) as the number of Nodes and of scheduled Pods in the cluster.
async fn cached(http: std::net::SocketAddr) -> anyhow::Result<(f64, f64)> {
    let (status, text) = http_get(http, "/metrics").await?;
    ensure!(status == 200, "GET /metrics: {status}");
    for name in [
        "nodekeeper_maintenance_cached_nodes",
        "nodekeeper_maintenance_cached_pods",
    ] {
        ensure!(text.contains(name), "{name} on /metrics");
    }
    Ok((
        sum_metric(&text, "nodekeeper_maintenance_cached_nodes", &[]),
        sum_metric(&text, "nodekeeper_maintenance_cached_pods", &[]),
    ))
}

/// Nodes and scheduled Pods in the cluster, as the API server has them.
async fn cluster_counts(client: &kube::Client) -> anyhow::Result<(f64, f64)> {
    let nodes = Api::<Node>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await?
        .items
        .len();
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields("spec.nodeName!="))
        .await?
        .items
        .len();
    Ok((nodes as f64, pods as f64))
}

/// The Node, Pod and PodDisruptionBudget caches cost the controller memory only while a
/// NodeMaintenance exists: none before the first, filled (every Node, every scheduled Pod) once
/// one is applied, kept for `NODEKEEPER_MAINTENANCE_CACHE_GRACE` after the last is deleted,
/// then dropped; and a maintenance after that drains correctly from caches listed again.
/// A private control plane: the gauges count every Node and Pod of the cluster, and the shared
/// one may hold other tests' maintenances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caches_run_only_while_a_maintenance_exists() -> anyhow::Result<()> {
    const GRACE: Duration = Duration::from_secs(8);
    let _serial = SERIAL.lock().await;
    let options = nodekeeper_e2e::controlplane::Options::new(
        format!("test-{}-nm-lazy", std::process::id()),
        nodekeeper_e2e::controlplane::Lifetime::WithThisProcess,
    );
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(options)).await??;
    let client = cp.client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-maint-lazy").await?;
    put_tuning(&client, &ns, &BTreeMap::new()).await?;
    let http = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, free_port()));
    let config = nodekeeper_e2e::rig::ControllerConfig {
        kubeconfig: cp.kubeconfig().to_owned(),
        namespace: ns.clone(),
        identity: unique_name("nm-lazy"),
        http,
        agent_port: free_port(),
        node_selector: "nodekeeper.dev/no-such-label=none".into(),
        log: Some("info,kube=warn".into()),
        env: [(
            "NODEKEEPER_MAINTENANCE_CACHE_GRACE".to_owned(),
            format!("{}s", GRACE.as_secs()),
        )]
        .into(),
        output: nodekeeper_e2e::rig::Output::Stderr,
    };
    let _controller = ControllerProcess::spawn(
        &nodekeeper_e2e::rig::Program::this_test_binary(HELPER, "controller")?,
        &config,
    )?;

    // Two pool nodes, each in a group of its own, and one node outside both; two pods.
    let pool = unique_name("pool");
    let (g1, g2) = (unique_name("g1"), unique_name("g2"));
    let a = create_simulated_nodes(
        &client,
        "nk-lazy-a",
        1,
        &labels(&[(GROUP, &g1), (POOL, &pool)]),
        &[],
    )
    .await?
    .remove(0);
    let b = create_simulated_nodes(
        &client,
        "nk-lazy-b",
        1,
        &labels(&[(GROUP, &g2), (POOL, &pool)]),
        &[],
    )
    .await?
    .remove(0);
    create_simulated_nodes(&client, "nk-lazy-other", 1, &BTreeMap::new(), &[]).await?;
    create(&client, &ns, deployment("web", 2, &pool, json!({}))).await?;
    wait_running(&client, &ns, 2).await?;

    // Leading, tuning read, nodes and pods in the cluster: and no cache.
    wait_for("the controller to lead", TIMEOUT, || async move {
        Ok((metric(http, "nodekeeper_controller_is_leader", &[]).await? == 1.0).then_some(()))
    })
    .await?;
    wait_for(
        "the controller to load the tuning ConfigMap",
        TIMEOUT,
        || async move {
            let (status, body) = http_get(http, "/api/v1/summary").await?;
            Ok((status == 200 && body.contains("resourceVersion")).then_some(()))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        cached(http).await? == (0.0, 0.0),
        "no NodeMaintenance: nothing cached"
    );

    // A maintenance: the caches list every node and scheduled pod, and its drain works.
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let first = unique_name("lazy-first");
    apply_nm(
        &client,
        &first,
        json!({ "nodeSelector": { "matchLabels": { GROUP: g1 } }, "stage": "Drain" }),
    )
    .await?;
    let client_ref = &client;
    wait_for(
        "every node and scheduled pod cached",
        TIMEOUT,
        || async move {
            let (cached, cluster) = (cached(http).await?, cluster_counts(client_ref).await?);
            Ok((cached == cluster && cached.0 >= 3.0).then_some(()))
        },
    )
    .await?;
    wait_nm(&client, &first, "node a drained", |nm| {
        node_phase(nm, &a) == Some(NodePhase::Drained)
    })
    .await?;
    let on_b = wait_for("both pods running on node b", TIMEOUT, || async {
        let pods = running_pods(&client, &ns).await?;
        Ok((pods.len() == 2 && pods.values().all(|n| *n == b)).then_some(pods))
    })
    .await?;

    // Deleted: the caches stay for the grace period, then hold nothing.
    api.delete(&first, &DeleteParams::default()).await?;
    wait_for("the first maintenance gone", TIMEOUT, || async {
        Ok(api.get_opt(&first).await?.is_none().then_some(()))
    })
    .await?;
    let gone = Instant::now();
    let (nodes, _) = cached(http).await?;
    ensure!(
        nodes >= 3.0 || gone.elapsed() >= GRACE,
        "the caches are kept within the grace period ({nodes} nodes cached)"
    );
    wait_for("the caches released", TIMEOUT, || async move {
        Ok((cached(http).await? == (0.0, 0.0)).then_some(()))
    })
    .await?;
    ensure!(
        gone.elapsed() + Duration::from_secs(2) >= GRACE,
        "released after the grace period ({GRACE:?}), not {:?} after the deletion",
        gone.elapsed()
    );

    // A maintenance after that: listed again, and node b's pods are evicted (to node a, no
    // longer held).
    let second = unique_name("lazy-second");
    apply_nm(
        &client,
        &second,
        json!({ "nodeSelector": { "matchLabels": { GROUP: g2 } }, "stage": "Drain" }),
    )
    .await?;
    wait_nm(&client, &second, "node b drained", |nm| {
        node_phase(nm, &b) == Some(NodePhase::Drained)
    })
    .await?;
    let now = wait_for("both pods running again, on node a", TIMEOUT, || async {
        let pods = running_pods(&client, &ns).await?;
        Ok((pods.len() == 2 && pods.values().all(|n| *n == a)).then_some(pods))
    })
    .await?;
    ensure!(
        on_b.keys().all(|p| !now.contains_key(p)),
        "node b's pods were evicted: before {on_b:?}, now {now:?}"
    );
    let (cached_now, cluster) = (cached(http).await?, cluster_counts(&client).await?);
    ensure!(
        cached_now.0 == cluster.0,
        "the caches run again: {cached_now:?} cached, {cluster:?} in the cluster"
    );
    Ok(())
}

/// Whether the maintenance left anything on the node: its record, its cordon, its taint.
fn held_by_maintenance(n: &Node) -> bool {
    n.annotations().contains_key("nodekeeper.dev/maintenance")
        || unschedulable(n)
        || !nodekeeper_taints(n).is_empty()
}

/// A maintenance deleted after the controller's watch showed it but before the finalizer was
/// added is gone at once, and no reconcile will ever see its deletion: the reconcile that was
/// handed it must touch no node. The race is made certain by driving the reconciler directly
/// with the object as it was read before the deletion (the running controller waits for its
/// caches to list first, and a deletion in that wait is what happens on a busy cluster, or when
/// NodeSet deletes the drain it just created). The same direct reconcile of a maintenance that
/// still exists cordons the node, and of its deletion releases it: the check can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_maintenance_deleted_before_its_finalizer_touches_no_node() -> anyhow::Result<()> {
    use nodekeeper_controller::controllers::node_maintenance::{Context, reconcile};
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let group = unique_name("gone");
    let node_name = create_simulated_nodes(&client, "nk-gone", 1, &labels(&[(GROUP, &group)]), &[])
        .await?
        .remove(0);
    let ctx = Arc::new(Context::standalone(
        client.clone(),
        &unique_name("nm-direct"),
    ));
    let mut triggers = ctx.cache.triggers(&client);
    let driver = tokio::spawn(async move { while triggers.next().await.is_some() {} });
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    // Allowed broad: on a fresh control plane this node may be the only one.
    let spec = json!({
        "nodeSelector": { "matchLabels": { GROUP: group } },
        "stage": "Drain",
        "allowBroadSelection": true,
    });

    // Control: a maintenance that exists cordons the node; its deletion releases it.
    let kept = unique_name("kept");
    apply_nm(&client, &kept, spec.clone()).await?;
    reconcile(Arc::new(api.get(&kept).await?), Arc::clone(&ctx)).await?;
    let n = node(&client, &node_name).await?;
    ensure!(
        held_by_maintenance(&n) && unschedulable(&n),
        "a direct reconcile of a live Drain maintenance cordons its node: {:?}",
        n.spec
    );
    api.delete(&kept, &DeleteParams::default()).await?;
    reconcile(Arc::new(api.get(&kept).await?), Arc::clone(&ctx)).await?;
    ensure!(
        !held_by_maintenance(&node(&client, &node_name).await?),
        "the deletion's reconcile releases the node"
    );
    ensure!(
        api.get_opt(&kept).await?.is_none(),
        "and lets the object go"
    );

    // The race: read, deleted (no finalizer yet: gone at once), then reconciled as read.
    let gone = unique_name("gone");
    apply_nm(&client, &gone, spec).await?;
    let stale = api.get(&gone).await?;
    ensure!(stale.finalizers().is_empty(), "{:?}", stale.finalizers());
    api.delete(&gone, &DeleteParams::default()).await?;
    ensure!(api.get_opt(&gone).await?.is_none(), "deleted at once");
    // Judged by the node: a reconcile that went on would also fail later, at its status write.
    let result = reconcile(Arc::new(stale), Arc::clone(&ctx)).await;
    let n = node(&client, &node_name).await?;
    driver.abort();
    ensure!(
        !held_by_maintenance(&n),
        "a maintenance deleted before its finalizer left node {node_name} held: annotation {:?}, unschedulable {}, taints {:?}",
        n.annotations().get("nodekeeper.dev/maintenance"),
        unschedulable(&n),
        nodekeeper_taints(&n)
    );
    result.context("the reconcile of a maintenance that is gone")?;
    Ok(())
}

/// A pod that is Running but not Ready (crash-looping) is evicted behind a budget that allows
/// no disruption, as the API server does for `kubectl drain` (under the default
/// `unhealthyPodEvictionPolicy: IfHealthyBudget` the budget still has its healthy pods); the
/// controller must send that eviction rather than wait on the budget until `drainTimeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_is_not_ready_is_evicted_behind_a_budget_at_zero() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint-unready", &[]).await?;
    let group = unique_name("unready");
    let pool = unique_name("pool");
    let drained_node = create_simulated_nodes(
        &client,
        "nk-unready",
        1,
        &labels(&[(GROUP, &group), (POOL, &pool)]),
        &[],
    )
    .await?
    .remove(0);
    create(&client, &ns, deployment("crash", 2, &pool, json!({}))).await?;
    create(
        &client,
        &ns,
        pdb("crash-pdb", "crash", json!({ "minAvailable": 1 })),
    )
    .await?;
    let placed = wait_running(&client, &ns, 2).await?;
    ensure!(
        placed.values().all(|n| *n == drained_node),
        "both pods on the one pool node: {placed:?}"
    );
    // One of them crash-loops: Running, not Ready (kwok leaves a Running pod's status alone).
    let sick = placed.keys().next().context("a pod")?.clone();
    let now = Timestamp::now().to_string();
    Api::<Pod>::namespaced(client.clone(), &ns)
        .patch_status(
            &sick,
            &PatchParams::default(),
            &Patch::Strategic(json!({ "status": { "conditions": [
                { "type": "Ready", "status": "False", "reason": "E2eCrashLoop", "lastTransitionTime": now },
                { "type": "ContainersReady", "status": "False", "reason": "E2eCrashLoop", "lastTransitionTime": now },
            ] } })),
        )
        .await?;
    let budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(client.clone(), &ns);
    wait_for(
        "crash-pdb: 1 healthy of 1 wanted, no disruption allowed",
        TIMEOUT,
        || async {
            let s = budgets.get("crash-pdb").await?.status.unwrap_or_default();
            Ok((s.current_healthy == Some(1)
                && s.desired_healthy == Some(1)
                && s.disruptions_allowed == Some(0)
                && s.expected_pods == Some(2))
            .then_some(()))
        },
    )
    .await?;
    // Room for the replacements, created only now.
    create_simulated_nodes(
        &client,
        "nk-unready-spare",
        1,
        &labels(&[(POOL, &pool)]),
        &[],
    )
    .await?;

    let name = unique_name("unready");
    apply_nm(
        &client,
        &name,
        json!({ "nodeSelector": { "matchLabels": { GROUP: group } }, "stage": "Drain" }),
    )
    .await?;
    // The sick pod goes at once (the API server evicts it with the budget at 0); its
    // replacement, Ready elsewhere, lets the budget release the healthy one.
    wait_nm(&client, &name, "the node drained", |nm| {
        node_phase(nm, &drained_node) == Some(NodePhase::Drained)
    })
    .await?;
    let left = running_pods(&client, &ns).await?;
    ensure!(
        !left.contains_key(&sick) && !left.values().any(|n| *n == drained_node),
        "no pod left on the drained node: {left:?}"
    );
    Api::<NodeMaintenance>::all(client.clone())
        .delete(&name, &DeleteParams::default())
        .await?;
    Ok(())
}

/// A node is not declared Drained (final: it is never looked at again) on the word of a pod
/// cache that may lag: a pod bound to the node just before the cordon, which the pod watch has
/// not shown yet, keeps it draining. The lag is made certain by driving the reconciler directly
/// with its caches listed and then stopped (frozen), and binding a pod after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_the_cache_has_not_seen_keeps_the_node_draining() -> anyhow::Result<()> {
    use nodekeeper_controller::controllers::node_maintenance::{Context, reconcile};
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-maint-lag").await?;
    let group = unique_name("lag");
    let node_name = create_simulated_nodes(&client, "nk-lag", 1, &labels(&[(GROUP, &group)]), &[])
        .await?
        .remove(0);
    let ctx = Arc::new(Context::standalone(
        client.clone(),
        &unique_name("nm-direct"),
    ));
    let mut triggers = ctx.cache.triggers(&client);
    let driver = tokio::spawn(async move { while triggers.next().await.is_some() {} });
    ctx.cache.want();
    ctx.cache.wait_ready(TIMEOUT).await?;
    // Frozen: no watch event reaches the cache from here on.
    driver.abort();
    let _ = driver.await;
    create(&client, &ns, json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "late", "labels": { "app": "late" } },
        "spec": { "nodeName": node_name, "containers": [{ "name": "c", "image": "registry.invalid/x:1" }] },
    }))
    .await?;

    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let name = unique_name("lag");
    apply_nm(
        &client,
        &name,
        json!({
            "nodeSelector": { "matchLabels": { GROUP: group } },
            "stage": "Drain",
            "allowBroadSelection": true,
        }),
    )
    .await?;
    reconcile(Arc::new(api.get(&name).await?), Arc::clone(&ctx)).await?;
    let nm = api.get(&name).await?;
    let phase = node_phase(&nm, &node_name);
    let remaining = nm
        .status
        .as_ref()
        .and_then(|s| s.nodes.iter().find(|n| n.node == node_name))
        .map(|n| n.pods_remaining);
    // Let go of the node and the object before judging (the cache knows the node it wrote).
    api.delete(&name, &DeleteParams::default()).await?;
    reconcile(Arc::new(api.get(&name).await?), Arc::clone(&ctx)).await?;
    ensure!(
        phase == Some(NodePhase::Draining) && remaining == Some(1),
        "node {node_name} with pod {ns}/late bound to it: phase {phase:?}, pods remaining {remaining:?}; want Draining with 1"
    );
    ensure!(
        !held_by_maintenance(&node(&client, &node_name).await?),
        "the deletion released the node"
    );
    Ok(())
}

/// The cluster-wide `maintenance.maxConcurrentNodes` holds across maintenances reconciled at
/// the same time: four single-node Drain maintenances created in one burst (the controller
/// reconciles four at once, and with its caches cold all four start together once they have
/// listed), with a budget that keeps every drain in progress, and a ceiling of one. A watch of
/// the nodes sees every Draining hold written; at no moment may two nodes drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_ceiling_holds_for_maintenances_created_at_once() -> anyhow::Result<()> {
    const N: usize = 4;
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint-burst", &[("maintenance.maxConcurrentNodes", "1")]).await?;
    let pool = unique_name("pool");
    let mut groups = Vec::new();
    let mut nodes = Vec::new();
    for i in 0..N {
        let group = unique_name(&format!("burst-{i}"));
        let made = create_simulated_nodes(
            &client,
            &format!("nk-burst-{i}"),
            1,
            &labels(&[(GROUP, &group), (POOL, &pool)]),
            &[],
        )
        .await?;
        nodes.extend(made);
        groups.push(group);
    }
    // One pod per node that a budget never lets go: every drain stays in progress.
    let mut d = deployment("stuck", i32::try_from(N)?, &pool, json!({}));
    d["spec"]["template"]["spec"]["topologySpreadConstraints"] = json!([{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": { "matchLabels": { "app": "stuck" } },
    }]);
    create(&client, &ns, d).await?;
    create(
        &client,
        &ns,
        pdb("stuck-pdb", "stuck", json!({ "minAvailable": "100%" })),
    )
    .await?;
    let placed = wait_running(&client, &ns, N).await?;
    ensure!(
        placed.values().collect::<BTreeSet<_>>().len() == N,
        "one pod per node: {placed:?}"
    );

    // Every node of the pool with a Draining hold, at every change the watch shows.
    let most = Arc::new(Mutex::new((0usize, BTreeSet::<String>::new())));
    let (listed_tx, listed) = tokio::sync::oneshot::channel::<()>();
    let watch = {
        let most = Arc::clone(&most);
        let api: Api<Node> = Api::all(client.clone());
        let config = watcher::Config::default().labels(&format!("{POOL}={pool}"));
        let mut draining: BTreeSet<String> = BTreeSet::new();
        let mut listed_tx = Some(listed_tx);
        tokio::spawn(async move {
            let mut stream = watcher(api, config).boxed();
            while let Ok(Some(event)) = stream.try_next().await {
                let n = match event {
                    watcher::Event::Apply(n) | watcher::Event::InitApply(n) => n,
                    watcher::Event::InitDone => {
                        if let Some(tx) = listed_tx.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    watcher::Event::Init | watcher::Event::Delete(_) => continue,
                };
                let holds_draining = n
                    .annotations()
                    .get("nodekeeper.dev/maintenance")
                    .is_some_and(|a| a.contains("\"phase\":\"Draining\""));
                if holds_draining {
                    draining.insert(n.name_any());
                } else {
                    draining.remove(&n.name_any());
                }
                let mut most = most.lock().unwrap();
                if draining.len() > most.0 {
                    *most = (draining.len(), draining.clone());
                }
            }
        })
    };
    // The watch has listed the pool before the first maintenance exists.
    tokio::time::timeout(TIMEOUT, listed)
        .await
        .context("the node watch to list")??;

    let names: Vec<String> = (0..N).map(|i| unique_name(&format!("burst-{i}"))).collect();
    futures::future::try_join_all(names.iter().zip(&groups).map(|(name, group)| {
        apply_nm(
            &client,
            name,
            json!({ "nodeSelector": { "matchLabels": { GROUP: group } }, "stage": "Drain" }),
        )
    }))
    .await?;
    // Every maintenance has placed its node: one draining, the others waiting for a slot.
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let phases = wait_for("every maintenance to place its node", TIMEOUT, || async {
        let mut phases = Vec::new();
        for (name, node) in names.iter().zip(&nodes) {
            match node_phase(&api.get(name).await?, node) {
                Some(p) => phases.push(p),
                None => return Ok(None),
            }
        }
        Ok(Some(phases))
    })
    .await?;
    let draining_now = phases.iter().filter(|p| **p == NodePhase::Draining).count();
    let (most_at_once, which) = most.lock().unwrap().clone();
    watch.abort();
    for name in &names {
        api.delete(name, &DeleteParams::default()).await?;
    }
    ensure!(
        most_at_once <= 1 && draining_now == 1,
        "maintenance.maxConcurrentNodes 1: {most_at_once} nodes drained at once ({which:?}); now {phases:?}"
    );
    Ok(())
}

/// A drain of a node whose kubelet is unreachable ends: a pod evicted there stays terminating
/// for good (nothing confirms its deletion), and once it has been terminating longer than
/// `--maintenance-unreachable-pod-wait` past its deletion time (5 minutes by default; 3 s here)
/// on a node tainted `node.kubernetes.io/unreachable`, it is counted gone and listed as skipped
/// with reason `NodeUnreachable`, as Cluster API's drain does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_of_an_unreachable_node_ends_despite_pods_stuck_terminating() -> anyhow::Result<()>
{
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup_with_env(
        "nk-maint-unreach",
        &[],
        &[("NODEKEEPER_MAINTENANCE_UNREACHABLE_POD_WAIT", "3s")],
    )
    .await?;
    let group = unique_name("unreach");
    let lost = create_simulated_nodes(&client, "nk-unreach", 1, &labels(&[(GROUP, &group)]), &[])
        .await?
        .remove(0);
    create(
        &client,
        &ns,
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "stuck", "labels": { "app": "stuck" } },
            "spec": {
                "nodeName": lost, "terminationGracePeriodSeconds": 1,
                "containers": [{ "name": "c", "image": "registry.invalid/x:1" }],
            },
        }),
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    wait_for("pod stuck running", TIMEOUT, || async {
        let p = pods.get("stuck").await?;
        Ok((p.status.and_then(|s| s.phase).as_deref() == Some("Running")).then_some(()))
    })
    .await?;

    // The kubelet goes away: kwok lets go of the node (it no longer finishes deletions there),
    // whose Ready condition turns Unknown and which is tainted unreachable, as the node
    // lifecycle controller does.
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            &lost,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "metadata": { "labels": { "nodekeeper.dev/simulated": null } } }),
            ),
        )
        .await?;
    let now = Timestamp::now().to_string();
    nodes
        .patch_status(
            &lost,
            &PatchParams::default(),
            &Patch::Strategic(json!({ "status": { "conditions": [{
                "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }] } })),
        )
        .await?;
    taint_by_hand(
        &client,
        &lost,
        json!({ "key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": now }),
    )
    .await?;
    // The pod is deleted (the taint manager would, in time) and stays terminating.
    pods.delete("stuck", &DeleteParams::default()).await?;
    let p = pods.get("stuck").await?;
    ensure!(
        p.metadata.deletion_timestamp.is_some(),
        "the pod is terminating"
    );

    let name = unique_name("unreach");
    // Allowed broad: on a fresh control plane this node may be the only one.
    apply_nm(
        &client,
        &name,
        json!({
            "nodeSelector": { "matchLabels": { GROUP: group } },
            "stage": "Drain",
            "allowBroadSelection": true,
        }),
    )
    .await?;
    let nm = wait_nm(&client, &name, "the unreachable node drained", |nm| {
        node_phase(nm, &lost) == Some(NodePhase::Drained)
    })
    .await?;
    let skipped: Vec<(String, SkipReason)> = nm
        .status
        .as_ref()
        .and_then(|s| s.nodes.iter().find(|n| n.node == lost))
        .map(|n| {
            n.skipped_pods
                .iter()
                .map(|p| (p.name.clone(), p.reason))
                .collect()
        })
        .unwrap_or_default();
    ensure!(
        skipped == [("stuck".to_string(), SkipReason::NodeUnreachable)],
        "the stuck pod is reported skipped as NodeUnreachable: {skipped:?}"
    );
    ensure!(
        pods.get_opt("stuck")
            .await?
            .is_some_and(|p| p.metadata.deletion_timestamp.is_some()),
        "the pod was counted gone, not gone: it is still terminating"
    );
    Api::<NodeMaintenance>::all(client.clone())
        .delete(&name, &DeleteParams::default())
        .await?;
    pods.delete("stuck", &DeleteParams::default().grace_period(0))
        .await?;
    Ok(())
}

/// The second line of defence: a node held by a maintenance that no longer exists (its hold
/// written, as by the race above before it was closed, or by an older replica) is released by
/// the next reconcile of any maintenance, once the maintenances have been listed without it and
/// the API server confirms it is gone; the node is uncordoned and its maintenance taint and
/// record removed, and its Draining hold no longer takes a slot of the cluster ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_whose_maintenance_is_gone_is_released() -> anyhow::Result<()> {
    use nodekeeper_api::names::MANAGER_NODE_MAINTENANCE;
    use nodekeeper_controller::controllers::node_maintenance::{Context, reconcile};
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let (orphan_group, live_group) = (unique_name("orphan"), unique_name("live"));
    let orphaned = create_simulated_nodes(
        &client,
        "nk-orphan",
        1,
        &labels(&[(GROUP, &orphan_group)]),
        &[],
    )
    .await?
    .remove(0);
    let live = create_simulated_nodes(&client, "nk-live", 1, &labels(&[(GROUP, &live_group)]), &[])
        .await?
        .remove(0);
    // The hold as the controller writes it (its field manager, so that its release removes
    // it), by a maintenance that does not exist.
    let ghost = unique_name("ghost");
    let record = json!({
        "priorUnschedulable": false,
        "holders": { ghost.clone(): { "phase": "Draining", "drainStart": Timestamp::now().as_second() } },
    });
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            &orphaned,
            &PatchParams::apply(MANAGER_NODE_MAINTENANCE).force(),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {
                    "name": orphaned,
                    "annotations": { "nodekeeper.dev/maintenance": record.to_string() },
                    "labels": { "nodekeeper.dev/maintained": "true" },
                },
                "spec": {
                    "unschedulable": true,
                    "taints": [{ "key": "nodekeeper.dev/maintenance", "effect": "NoSchedule" }],
                },
            })),
        )
        .await?;
    ensure!(held_by_maintenance(&node(&client, &orphaned).await?));

    let ctx = Arc::new(Context::standalone(
        client.clone(),
        &unique_name("nm-direct"),
    ));
    let mut triggers = ctx.cache.triggers(&client);
    let driver = tokio::spawn(async move { while triggers.next().await.is_some() {} });
    let cache = Arc::clone(&ctx.cache);
    wait_for("the maintenances listed", TIMEOUT, || {
        let cache = Arc::clone(&cache);
        async move { Ok(cache.maintenances_listed().then_some(())) }
    })
    .await?;
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let name = unique_name("live");
    apply_nm(
        &client,
        &name,
        json!({
            "nodeSelector": { "matchLabels": { GROUP: live_group } },
            "stage": "Cordon",
            "allowBroadSelection": true,
        }),
    )
    .await?;
    reconcile(Arc::new(api.get(&name).await?), Arc::clone(&ctx)).await?;
    let (o, l) = (node(&client, &orphaned).await?, node(&client, &live).await?);
    api.delete(&name, &DeleteParams::default()).await?;
    reconcile(Arc::new(api.get(&name).await?), Arc::clone(&ctx)).await?;
    driver.abort();
    ensure!(
        held_by_maintenance(&l) && unschedulable(&l),
        "the live maintenance cordoned its own node"
    );
    ensure!(
        !held_by_maintenance(&o),
        "node {orphaned}, held by {ghost} that does not exist, is released: annotation {:?}, unschedulable {}, taints {:?}",
        o.annotations().get("nodekeeper.dev/maintenance"),
        unschedulable(&o),
        nodekeeper_taints(&o)
    );
    Ok(())
}

/// A drain-plan priority threshold above what an int32 holds is refused by the API server (the
/// schema's `maximum`): stored, it would fail the decoding of every NodeMaintenance list and so
/// stop the controller for all maintenances. The list still decodes, and a maintenance with the
/// largest valid threshold drains its node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_threshold_beyond_int32_is_refused_and_others_still_drain() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let Setup {
        client,
        ns,
        _controller,
    } = setup("nk-maint-int32", &[]).await?;
    let group = unique_name("int32");
    let pool = unique_name("pool");
    let nodes = create_simulated_nodes(
        &client,
        "nk-int32",
        1,
        &labels(&[(GROUP, &group), (POOL, &pool)]),
        &[],
    )
    .await?;
    create(&client, &ns, deployment("w", 1, &pool, json!({}))).await?;
    wait_running(&client, &ns, 1).await?;
    create_simulated_nodes(&client, "nk-int32-spare", 1, &labels(&[(POOL, &pool)]), &[]).await?;

    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let bad = unique_name("bad");
    let body = |name: &str, threshold: i64| {
        json!({
            "apiVersion": "nodekeeper.dev/v1alpha1",
            "kind": "NodeMaintenance",
            "metadata": { "name": name },
            "spec": {
                "nodeSelector": { "matchLabels": { GROUP: group } },
                "stage": "Drain",
                "drainPlan": [ { "priorityThreshold": threshold } ],
            },
        })
    };
    let refused = api
        .patch(
            &bad,
            &PatchParams::apply("nodekeeper-e2e").force(),
            &Patch::Apply(body(&bad, 2_147_483_648)),
        )
        .await;
    match refused {
        Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("priorityThreshold") => {}
        other => bail!("a priorityThreshold of 2147483648 was not refused with 422: {other:?}"),
    }
    ensure!(
        api.get_opt(&bad).await?.is_none(),
        "the refused maintenance {bad} was stored"
    );
    api.list(&ListParams::default())
        .await
        .context("every NodeMaintenance still decodes")?;

    let good = unique_name("good");
    api.patch(
        &good,
        &PatchParams::apply("nodekeeper-e2e").force(),
        &Patch::Apply(body(&good, i64::from(i32::MAX))),
    )
    .await
    .with_context(|| format!("apply nodemaintenance {good}"))?;
    wait_nm(&client, &good, "drained", |nm| {
        node_phase(nm, &nodes[0]) == Some(NodePhase::Drained)
    })
    .await?;
    wait_for("the pod to run on the spare node", TIMEOUT, || async {
        let pods = running_pods(&client, &ns).await?;
        Ok((!pods.is_empty() && pods.values().all(|n| n != &nodes[0])).then_some(()))
    })
    .await?;
    Ok(())
}
