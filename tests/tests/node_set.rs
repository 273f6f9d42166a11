//! `NodeSet` end to end, on the real API server with kwok running the nodes: the real
//! `nodekeeper-controller` process scales a set 0 → 20 → 5 under a Deployment and a
//! PodDisruptionBudget (scale-down drains through NodeMaintenances, the budget holds, no pod is
//! lost, a not-Ready node goes first, then the newest); a controller killed mid-scale-up and
//! mid-scale-down is restarted and makes no extra machine; bad input gets a condition naming the
//! field, and a provider that fails every create is called a bounded number of times (counted by
//! an in-process controller with a counting provider). Each test runs alone: every controller
//! acts on every NodeSet.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test node_set`.

mod controller_common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use controller_common::*;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Controller;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::{NodeClass, NodeClassSpec, NodeMaintenance, NodeSet};
use nodekeeper_api::names::LABEL_NODE_SET;
use nodekeeper_controller::controllers::node_set::{
    self, Deletion, Machine, MachineRequest, Provider, ProviderError,
};
use nodekeeper_e2e::{
    ControlPlane, apply_spec, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;
use tokio::sync::Mutex;

const TIMEOUT: Duration = Duration::from_secs(180);
const POOL: &str = "nodekeeper.dev/e2e-pool";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// One test at a time: every controller acts on every NodeSet.
static SERIAL: Mutex<()> = Mutex::const_new(());

async fn start_controller(ns: &str, env: &[(&str, &str)]) -> anyhow::Result<ControllerProcess> {
    // The node sweep is pointed at no node: these tests have no agents.
    let controller = ControllerProcess::start(
        ns,
        &unique_name("nset"),
        "nodekeeper.dev/no-such-label=none",
        free_port(),
        env,
    )?;
    let addr = controller.http;
    wait_for("the controller to serve", TIMEOUT, || async move {
        let (status, _) = http_get(addr, "/api/v1/summary").await?;
        Ok((status == 200).then_some(()))
    })
    .await?;
    Ok(controller)
}

async fn setup(prefix: &str) -> anyhow::Result<(kube::Client, String)> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, prefix).await?;
    put_tuning(&client, &ns, &BTreeMap::new()).await?;
    Ok((client, ns))
}

/// A kwok NodeClass whose nodes carry `POOL: pool`.
async fn kwok_class(client: &kube::Client, name: &str, pool: &str) -> anyhow::Result<()> {
    apply_spec(
        &Api::<NodeClass>::all(client.clone()),
        name,
        json!({
            "provider": "kwok",
            "kwok": { "capacity": { "cpu": "8", "memory": "32Gi", "pods": "110" } },
            "labels": { POOL: pool },
        }),
    )
    .await
}

async fn set_replicas(client: &kube::Client, name: &str, replicas: u32) -> anyhow::Result<()> {
    // Through the scale subresource, as `kubectl scale nodeset` does.
    Api::<NodeSet>::all(client.clone())
        .patch_scale(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": replicas } })),
        )
        .await
        .with_context(|| format!("scale nodeset {name} to {replicas}"))?;
    Ok(())
}

async fn set_nodes(client: &kube::Client, set: &str) -> anyhow::Result<Vec<Node>> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
        .await?
        .items)
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn condition(set: &NodeSet, type_: &str) -> Option<(String, String, String)> {
    set.status
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

/// Waits until the set has exactly `n` nodes, all Ready, none draining, status saying so.
async fn wait_converged(client: &kube::Client, set: &str, n: u32) -> anyhow::Result<Vec<Node>> {
    let api: Api<NodeSet> = Api::all(client.clone());
    wait_for(
        &format!("nodeset {set} at {n} Ready nodes"),
        TIMEOUT,
        || {
            let api = api.clone();
            async move {
                let s = api.get(set).await?;
                let st = s.status.clone().unwrap_or_default();
                let nodes = set_nodes(client, set).await?;
                let ok = st.replicas == n
                    && st.ready_replicas == n
                    && st.updated_replicas == n
                    && st.draining_replicas == 0
                    && condition(&s, "Ready").is_some_and(|c| c.0 == "True")
                    && nodes.len() == n as usize
                    && nodes.iter().all(ready);
                Ok(ok.then_some(nodes))
            }
        },
    )
    .await
}

/// Records every node of `set` ever added, from a watch.
fn watch_created(client: &kube::Client, set: &str) -> Arc<std::sync::Mutex<BTreeSet<String>>> {
    let seen = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let sink = Arc::clone(&seen);
    let api: Api<Node> = Api::all(client.clone());
    let config = watcher::Config::default().labels(&format!("{LABEL_NODE_SET}={set}"));
    tokio::spawn(async move {
        let mut stream = watcher(api, config).touched_objects().boxed();
        while let Some(Ok(node)) = stream.next().await {
            sink.lock().unwrap().insert(node.name_any());
        }
    });
    seen
}

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

#[tokio::test]
async fn scale_0_to_20_to_5_drains_behind_a_pdb_and_loses_nothing() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, ns) = setup("nset-scale").await?;
    let _controller = start_controller(&ns, &[]).await?;
    let pool = unique_name("pool");
    let class = unique_name("kwok");
    let set = unique_name("web");
    kwok_class(&client, &class, &pool).await?;
    let sets: Api<NodeSet> = Api::all(client.clone());
    apply_spec(
        &sets,
        &set,
        json!({ "nodeClassName": class, "replicas": 0, "scaleDown": { "drainTimeout": "2m" } }),
    )
    .await?;
    wait_converged(&client, &set, 0).await?;
    let created = watch_created(&client, &set);

    // 0 → 20.
    let started = Instant::now();
    set_replicas(&client, &set, 20).await?;
    let nodes = wait_converged(&client, &set, 20).await?;
    eprintln!("0 → 20 Ready in {:?}", started.elapsed());
    // The scale subresource gives an autoscaler the selector of the set's Nodes.
    let scale = sets.get_scale(&set).await?;
    let selector = scale.status.and_then(|s| s.selector).unwrap_or_default();
    ensure!(
        selector == format!("{LABEL_NODE_SET}={set}"),
        "GET nodesets/{set}/scale gave status.selector {selector:?}"
    );
    ensure!(
        Api::<Node>::all(client.clone())
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .len()
            == 20,
        "status.selector {selector} does not pick the set's 20 nodes"
    );
    for n in &nodes {
        let spec = n.spec.as_ref().context("node spec")?;
        ensure!(
            spec.provider_id.as_deref() == Some(&format!("kwok://{}", n.name_any())),
            "node {} has providerID {:?}",
            n.name_any(),
            spec.provider_id
        );
        ensure!(
            n.labels().get(POOL) == Some(&pool),
            "class label missing on {}",
            n.name_any()
        );
    }
    let s = sets.get(&set).await?;
    ensure!(
        condition(&s, "Progressing").is_some_and(|c| c.1 == "Done"),
        "{:?}",
        s.status
    );

    // One node goes NotReady (kwok stops running it; nothing may land there): it must be the
    // first to leave, though it is the oldest.
    let mut by_age: Vec<(i64, String)> = nodes
        .iter()
        .map(|n| {
            (
                n.creation_timestamp().map_or(0, |t| t.0.as_second()),
                n.name_any(),
            )
        })
        .collect();
    by_age.sort();
    let sick = by_age[0].1.clone();
    break_node(&client, &sick, true).await?;
    wait_for("the status to count the sick node", TIMEOUT, || async {
        let s = sets.get(&set).await?;
        let st = s.status.unwrap_or_default();
        Ok((st.ready_replicas == 19 && st.problems.iter().any(|p| p.node == sick)).then_some(()))
    })
    .await?;

    // 20 pods on the pool, at most 2 unavailable.
    controller_common::pods_behind_a_budget(&client, &ns, (POOL, &pool), 20, 2).await?;
    wait_for("20 running pods", TIMEOUT, || async {
        Ok((running_pods(&client, &ns).await?.len() == 20).then_some(()))
    })
    .await?;

    // 20 → 5, sampling the running pods all along: the budget holds.
    set_replicas(&client, &set, 5).await?;
    let mut fewest = usize::MAX;
    let mut saw_maintenance = false;
    let nms: Api<NodeMaintenance> = Api::all(client.clone());
    let deadline = Instant::now() + TIMEOUT;
    let survivors = loop {
        fewest = fewest.min(running_pods(&client, &ns).await?.len());
        saw_maintenance |= !nms
            .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
            .await?
            .items
            .is_empty();
        let s = sets.get(&set).await?;
        let st = s.status.clone().unwrap_or_default();
        let nodes = set_nodes(&client, &set).await?;
        if nodes.len() == 5
            && st.replicas == 5
            && st.ready_replicas == 5
            && st.draining_replicas == 0
        {
            break nodes;
        }
        if Instant::now() > deadline {
            bail!(
                "nodeset {set} did not reach 5 nodes: {} nodes, status {:?}",
                nodes.len(),
                s.status
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(saw_maintenance, "the scale-down created no NodeMaintenance");
    ensure!(
        fewest >= 18,
        "the PodDisruptionBudget allows 2 unavailable, but only {fewest} pods ran at one point"
    );

    // Who stayed: the five oldest healthy nodes (the sick one left first, then the newest).
    let expected: BTreeSet<String> = by_age
        .iter()
        .filter(|(_, n)| *n != sick)
        .take(5)
        .map(|(_, n)| n.clone())
        .collect();
    let got: BTreeSet<String> = survivors.iter().map(|n| n.name_any()).collect();
    ensure!(
        got == expected,
        "kept {got:?}, expected the oldest healthy {expected:?}"
    );

    // Nothing lost: 20 pods run, all on the survivors; every drain is cleaned up; no node was
    // created beyond the 20.
    let pods = wait_for("20 running pods after the scale-down", TIMEOUT, || async {
        let pods = running_pods(&client, &ns).await?;
        Ok((pods.len() == 20).then_some(pods))
    })
    .await?;
    ensure!(
        pods.values().all(|n| got.contains(n)),
        "pods still on removed nodes: {pods:?}"
    );
    wait_for(
        "the set's NodeMaintenances to be deleted",
        TIMEOUT,
        || async {
            let left = nms
                .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
                .await?;
            Ok(left.items.is_empty().then_some(()))
        },
    )
    .await?;
    let created = created.lock().unwrap().len();
    ensure!(
        created == 20,
        "{created} nodes were created for 20 replicas"
    );
    Ok(())
}

#[tokio::test]
async fn a_controller_killed_mid_scale_makes_no_extra_machine() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, ns) = setup("nset-restart").await?;
    let mut controller = start_controller(&ns, &[]).await?;
    let pool = unique_name("pool");
    let class = unique_name("kwok");
    let set = unique_name("batch");
    kwok_class(&client, &class, &pool).await?;
    let sets: Api<NodeSet> = Api::all(client.clone());
    apply_spec(
        &sets,
        &set,
        json!({ "nodeClassName": class, "replicas": 0 }),
    )
    .await?;
    wait_converged(&client, &set, 0).await?;
    let created = watch_created(&client, &set);

    // Kill the controller as soon as the first machines exist, mid scale-up.
    set_replicas(&client, &set, 30).await?;
    wait_for("the first machines", TIMEOUT, || async {
        Ok((!created.lock().unwrap().is_empty()).then_some(()))
    })
    .await?;
    controller.kill();
    let at_kill = created.lock().unwrap().len();
    eprintln!("killed the controller with {at_kill} of 30 machines created");
    let mut controller = start_controller(&ns, &[]).await?;
    wait_converged(&client, &set, 30).await?;
    let after_up = created.lock().unwrap().clone();
    ensure!(
        after_up.len() == 30,
        "{} machines were created for 30 replicas",
        after_up.len()
    );

    // Kill it again mid scale-down, once drains have started.
    set_replicas(&client, &set, 10).await?;
    let nms: Api<NodeMaintenance> = Api::all(client.clone());
    wait_for("a drain to start", TIMEOUT, || async {
        let l = nms
            .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
            .await?;
        Ok((!l.items.is_empty()).then_some(()))
    })
    .await?;
    controller.kill();
    let _controller = start_controller(&ns, &[]).await?;
    let nodes = wait_converged(&client, &set, 10).await?;
    let after_down = created.lock().unwrap().clone();
    ensure!(
        after_down == after_up,
        "the scale-down created machines: {:?}",
        after_down.difference(&after_up).collect::<Vec<_>>()
    );
    ensure!(nodes.iter().all(|n| after_up.contains(&n.name_any())));
    wait_for(
        "the set's NodeMaintenances to be deleted",
        TIMEOUT,
        || async {
            let left = nms
                .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
                .await?;
            Ok(left.items.is_empty().then_some(()))
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn bad_input_gets_a_condition_naming_the_field() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, ns) = setup("nset-bad").await?;
    let _controller = start_controller(&ns, &[("NODEKEEPER_NODESET_MAX_REPLICAS", "50")]).await?;
    let sets: Api<NodeSet> = Api::all(client.clone());
    let wait_reason = |name: String, reason: &'static str| {
        let sets = sets.clone();
        async move {
            wait_for(
                &format!("nodeset {name}: Ready=False {reason}"),
                TIMEOUT,
                || {
                    let sets = sets.clone();
                    let name = name.clone();
                    async move {
                        let s = sets.get(&name).await?;
                        Ok(condition(&s, "Ready").filter(|c| c.0 == "False" && c.1 == reason))
                    }
                },
            )
            .await
        }
    };

    // A missing NodeClass: named, then the set recovers when the class appears.
    let class = unique_name("later");
    let set = unique_name("noclass");
    apply_spec(
        &sets,
        &set,
        json!({ "nodeClassName": class, "replicas": 2 }),
    )
    .await?;
    let (_, _, message) = wait_reason(set.clone(), "NodeClassNotFound").await?;
    ensure!(
        message.contains("spec.nodeClassName") && message.contains(&class),
        "{message}"
    );
    ensure!(set_nodes(&client, &set).await?.is_empty());
    kwok_class(&client, &class, &unique_name("pool")).await?;
    wait_converged(&client, &set, 2).await?;
    set_replicas(&client, &set, 0).await?;
    wait_converged(&client, &set, 0).await?;

    // Above the controller's cap: named, and nothing is created.
    let capped = unique_name("capped");
    apply_spec(
        &sets,
        &capped,
        json!({ "nodeClassName": class, "replicas": 60 }),
    )
    .await?;
    let (_, _, message) = wait_reason(capped.clone(), "ReplicasAboveCap").await?;
    ensure!(
        message.contains("spec.replicas") && message.contains("50"),
        "{message}"
    );
    ensure!(set_nodes(&client, &capped).await?.is_empty());

    // Outside cluster-autoscaler's min/max annotations: named, nothing created; inside, it goes.
    let bounded = unique_name("bounded");
    let body = |replicas: u32| {
        json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NodeSet",
            "metadata": { "name": bounded, "annotations": {
                "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size": "1",
                "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size": "2",
            } },
            "spec": { "nodeClassName": class, "replicas": replicas },
        })
    };
    sets.patch(
        &bounded,
        &PatchParams::apply("nodekeeper-e2e").force(),
        &Patch::Apply(&body(3)),
    )
    .await?;
    let (_, _, message) = wait_reason(bounded.clone(), "ReplicasOutOfBounds").await?;
    ensure!(
        message.contains("spec.replicas")
            && message.contains("max-size annotation 2")
            && message.contains("cluster-api-autoscaler-node-group-max-size"),
        "{message}"
    );
    ensure!(set_nodes(&client, &bounded).await?.is_empty());
    set_replicas(&client, &bounded, 2).await?;
    wait_converged(&client, &bounded, 2).await?;
    set_replicas(&client, &bounded, 0).await?;
    let (_, _, message) = wait_reason(bounded.clone(), "ReplicasOutOfBounds").await?;
    ensure!(message.contains("min-size annotation 1"), "{message}");
    ensure!(
        set_nodes(&client, &bounded).await?.len() == 2,
        "a scale below the min-size annotation removed nodes"
    );

    // Surge and unavailable both zero: refused by the API server, the message names the field.
    let error = apply_spec(
        &sets,
        &unique_name("stuck"),
        json!({ "nodeClassName": class, "replicas": 1, "maxSurge": 0, "maxUnavailable": "0%" }),
    )
    .await
    .expect_err("maxSurge 0 with maxUnavailable 0 must be refused");
    ensure!(format!("{error:#}").contains("spec.maxSurge"), "{error:#}");

    // A class the provider cannot make (a capacity that is not a quantity): the API's answer
    // is the condition's message; no node exists.
    let broken = unique_name("broken");
    apply_spec(
        &Api::<NodeClass>::all(client.clone()),
        &broken,
        json!({ "provider": "kwok", "kwok": { "capacity": { "cpu": "lots" } } }),
    )
    .await?;
    let bad = unique_name("badclass");
    apply_spec(
        &sets,
        &bad,
        json!({ "nodeClassName": broken, "replicas": 3 }),
    )
    .await?;
    let (_, _, message) = wait_reason(bad.clone(), "ProviderFailed").await?;
    ensure!(
        message.contains("provider kwok") && message.contains("quantities"),
        "{message}"
    );
    ensure!(set_nodes(&client, &bad).await?.is_empty());

    // Labels and taints the API server would refuse on the Node, in the class or the set's
    // template: named before any machine is made (an OCI instance would run without a Node).
    let unlabelled = unique_name("badlabels");
    apply_spec(
        &Api::<NodeClass>::all(client.clone()),
        &unlabelled,
        json!({
            "provider": "kwok",
            "kwok": { "capacity": { "cpu": "8", "memory": "32Gi", "pods": "110" } },
            "labels": { "team name": "x" },
            "taints": [{ "key": "gpu", "effect": "NoSchedule" }],
        }),
    )
    .await?;
    let badlabels = unique_name("badlabels");
    apply_spec(
        &sets,
        &badlabels,
        json!({
            "nodeClassName": unlabelled, "replicas": 2,
            "template": { "taints": [{ "key": "gpu", "value": "yes", "effect": "NoSchedule" }] },
        }),
    )
    .await?;
    let (_, _, message) = wait_reason(badlabels.clone(), "InvalidSpec").await?;
    ensure!(
        message.contains(&format!(
            "NodeClass {unlabelled} spec.labels[\"team name\"]"
        )) && message.contains("spec.template.taints[0]")
            && message.contains("twice"),
        "{message}"
    );
    ensure!(set_nodes(&client, &badlabels).await?.is_empty());
    // Leave nothing for the next test's controller (it has the default cap) to act on.
    for name in [&capped, &bad, &badlabels] {
        set_replicas(&client, name, 0).await?;
    }
    let _ = ns;
    Ok(())
}

/// A provider whose every create fails, counting calls.
#[derive(Default)]
struct Failing {
    creates: AtomicU64,
    others: AtomicU64,
    /// The set of every create asked for.
    sets: std::sync::Mutex<Vec<String>>,
}

impl Provider for Failing {
    fn kind(&self) -> &'static str {
        "failing"
    }
    fn create<'a>(
        &'a self,
        request: &'a MachineRequest,
    ) -> BoxFuture<'a, Result<Machine, ProviderError>> {
        self.creates.fetch_add(1, Ordering::SeqCst);
        self.sets.lock().unwrap().push(request.node_set.clone());
        Box::pin(async move {
            Err(ProviderError::Create {
                node: request.node_name.clone(),
                message: "out of host capacity (test provider)".into(),
            })
        })
    }
    fn delete<'a>(&'a self, _: &'a Machine) -> BoxFuture<'a, Result<Deletion, ProviderError>> {
        self.others.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(Deletion::Gone) })
    }
    fn get<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        self.others.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(None) })
    }
    fn list<'a>(
        &'a self,
        _: &'a str,
        _: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Vec<Machine>, ProviderError>> {
        self.others.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// Runs the NodeSet controller in this process with `provider` in place of kwok's; cancel the
/// token and await the handle to stop it.
fn run_with_kwok_provider(
    client: &kube::Client,
    provider: Arc<dyn Provider>,
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let recorder = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: "nodekeeper-e2e".into(),
            instance: None,
        },
    );
    let mut ctx =
        node_set::Context::with_client(client.clone(), recorder, &node_set::Config::default());
    ctx.kwok = provider;
    let ctx = Arc::new(ctx);
    let stop = tokio_util::sync::CancellationToken::new();
    let token = stop.clone();
    let controller = tokio::spawn(
        Controller::new(
            Api::<NodeSet>::all(client.clone()),
            watcher::Config::default(),
        )
        .graceful_shutdown_on(async move { token.cancelled().await })
        .run(node_set::reconcile, node_set::error_policy, ctx)
        .for_each(|_| futures::future::ready(())),
    );
    (stop, controller)
}

#[tokio::test]
async fn a_provider_failing_every_create_is_called_a_bounded_number_of_times() -> anyhow::Result<()>
{
    let _serial = SERIAL.lock().await;
    let (client, _ns) = setup("nset-failing").await?;
    let failing = Arc::new(Failing::default());
    let (stop, controller) =
        run_with_kwok_provider(&client, Arc::clone(&failing) as Arc<dyn Provider>);

    let class = unique_name("kwok");
    kwok_class(&client, &class, &unique_name("pool")).await?;
    let set = unique_name("failing");
    let sets: Api<NodeSet> = Api::all(client.clone());
    apply_spec(
        &sets,
        &set,
        json!({ "nodeClassName": class, "replicas": 50 }),
    )
    .await?;
    let started = Instant::now();
    let message = wait_for("the ProviderFailed condition", TIMEOUT, || async {
        let s = sets.get(&set).await?;
        Ok(condition(&s, "Ready")
            .filter(|c| c.1 == "ProviderFailed")
            .map(|c| c.2))
    })
    .await?;
    ensure!(
        message.contains("out of host capacity (test provider)"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(started.elapsed())).await;
    let creates = failing.creates.load(Ordering::SeqCst);
    stop.cancel();
    controller.await?;
    // Slow start (1 call per round) and a doubling backoff (2 s, 4 s, 8 s, 16 s): about 4 calls
    // in 20 s for 50 missing machines, never a flood.
    eprintln!("{creates} create calls in 20 s for 50 missing machines");
    ensure!((2..=6).contains(&creates), "{creates} create calls in 20 s");
    ensure!(set_nodes(&client, &set).await?.is_empty());
    set_replicas(&client, &set, 0).await?;
    Ok(())
}

fn schedulable_ready(node: &Node) -> bool {
    ready(node)
        && !node
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false)
}

#[tokio::test]
async fn a_template_change_rolls_within_surge_and_unavailable_across_a_restart()
-> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, ns) = setup("nset-roll").await?;
    let mut controller = start_controller(&ns, &[]).await?;
    let class = unique_name("kwok");
    let set = unique_name("roll");
    kwok_class(&client, &class, &unique_name("pool")).await?;
    let sets: Api<NodeSet> = Api::all(client.clone());
    let spec = |rev: &str| {
        json!({
            "nodeClassName": class, "replicas": 5, "maxSurge": 1, "maxUnavailable": 0,
            "template": { "labels": { "rev": rev } },
        })
    };
    apply_spec(&sets, &set, spec("1")).await?;
    let before = wait_converged(&client, &set, 5).await?;
    let created = watch_created(&client, &set);

    apply_spec(&sets, &set, spec("2")).await?;
    let mut most = 0;
    let mut fewest_available = usize::MAX;
    let mut restarted = false;
    let mut saw_progress = false;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let nodes = set_nodes(&client, &set).await?;
        most = most.max(nodes.len());
        fewest_available =
            fewest_available.min(nodes.iter().filter(|n| schedulable_ready(n)).count());
        let s = sets.get(&set).await?;
        let st = s.status.clone().unwrap_or_default();
        saw_progress |= condition(&s, "Progressing").is_some_and(|c| c.0 == "True");
        // Kill the controller mid-rollout, once, and start another.
        if !restarted && st.updated_replicas >= 2 {
            controller.kill();
            controller = start_controller(&ns, &[]).await?;
            restarted = true;
        }
        let done = nodes.len() == 5
            && nodes
                .iter()
                .all(|n| n.labels().get("rev").map(String::as_str) == Some("2"))
            && nodes.iter().all(ready)
            && st.updated_replicas == 5
            && st.ready_replicas == 5
            && st.draining_replicas == 0;
        if done {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "rollout of {set} did not finish: {} nodes, status {:?}",
                nodes.len(),
                s.status
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ensure!(
        restarted,
        "the rollout finished before the controller could be killed"
    );
    ensure!(
        saw_progress,
        "Progressing was never True during the rollout"
    );
    ensure!(
        most <= 6,
        "maxSurge 1 on 5 replicas, yet {most} nodes existed at once"
    );
    ensure!(
        fewest_available >= 5,
        "maxUnavailable 0 on 5 replicas, yet only {fewest_available} nodes were Ready and schedulable at one point"
    );
    // Each old node was replaced exactly once.
    let created = created.lock().unwrap().clone();
    let old: BTreeSet<String> = before.iter().map(|n| n.name_any()).collect();
    let new: BTreeSet<String> = created.difference(&old).cloned().collect();
    ensure!(
        new.len() == 5,
        "{} new machines for 5 replaced nodes: {new:?}",
        new.len()
    );
    Ok(())
}

/// Takes a node away from kwok (so it stays as patched) and marks it Ready=False; `cordon` keeps
/// pods off it.
async fn break_node(client: &kube::Client, name: &str, cordon: bool) -> anyhow::Result<()> {
    let node_api: Api<Node> = Api::all(client.clone());
    let mut patch = json!({ "metadata": { "labels": { "nodekeeper.dev/simulated": null } } });
    if cordon {
        patch["spec"] = json!({ "unschedulable": true });
    }
    node_api
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    node_api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Strategic(json!({ "status": { "conditions": [{
                "type": "Ready", "status": "False", "reason": "E2eStopped",
                "message": "kwok no longer runs this node", "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }] } })),
        )
        .await?;
    Ok(())
}

/// Gives a node back to kwok, which makes it Ready again.
async fn heal_node(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    Api::<Node>::all(client.clone())
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "metadata": { "labels": { "nodekeeper.dev/simulated": "true" } } }),
            ),
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn repair_replaces_a_node_unhealthy_too_long_but_never_too_many() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, ns) = setup("nset-repair").await?;
    let _controller = start_controller(&ns, &[]).await?;
    let class = unique_name("kwok");
    let set = unique_name("heal");
    kwok_class(&client, &class, &unique_name("pool")).await?;
    let sets: Api<NodeSet> = Api::all(client.clone());
    apply_spec(
        &sets,
        &set,
        json!({
            "nodeClassName": class, "replicas": 5,
            "repair": { "notReadyAfter": "3s", "maxUnhealthy": 1 },
        }),
    )
    .await?;
    let nodes = wait_converged(&client, &set, 5).await?;
    let created = watch_created(&client, &set);
    let (first, second) = (nodes[0].name_any(), nodes[1].name_any());

    // Two of five unhealthy, the bound is one: repair halts and says why; nothing is replaced.
    break_node(&client, &first, false).await?;
    break_node(&client, &second, false).await?;
    let message = wait_for("Progressing=False RepairHalted", TIMEOUT, || async {
        let s = sets.get(&set).await?;
        Ok(condition(&s, "Progressing")
            .filter(|c| c.1 == "RepairHalted")
            .map(|c| c.2))
    })
    .await?;
    ensure!(
        message.contains("2 nodes are unhealthy") && message.contains("spec.repair.maxUnhealthy"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(8)).await;
    let names: BTreeSet<String> = set_nodes(&client, &set)
        .await?
        .iter()
        .map(|n| n.name_any())
        .collect();
    ensure!(
        names.contains(&first) && names.contains(&second) && names.len() == 5,
        "repair went past its bound: {names:?}"
    );
    ensure!(
        created.lock().unwrap().len() == 5,
        "a machine was created while repair was halted"
    );

    // One heals: the other is drained, deleted and replaced.
    heal_node(&client, &second).await?;
    let nodes = wait_for("the unhealthy node to be replaced", TIMEOUT, || async {
        let nodes = set_nodes(&client, &set).await?;
        let gone = !nodes.iter().any(|n| n.name_any() == first);
        Ok((gone && nodes.len() == 5 && nodes.iter().all(ready)).then_some(nodes))
    })
    .await?;
    ensure!(
        nodes.iter().any(|n| n.name_any() == second),
        "the healed node was replaced too"
    );
    wait_converged(&client, &set, 5).await?;
    let created = created.lock().unwrap().len();
    ensure!(
        created == 6,
        "{created} machines in all; expected the 5 and one replacement"
    );
    Ok(())
}

/// Records the nodes whose NodeMaintenance of `set` ever reported them drained, from a watch.
fn watch_drained(client: &kube::Client, set: &str) -> Arc<std::sync::Mutex<BTreeSet<String>>> {
    use nodekeeper_api::crd::node_maintenance::NodePhase;
    use nodekeeper_api::crd::node_set::ANNOTATION_DRAINED_NODE;
    let seen = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let sink = Arc::clone(&seen);
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let config = watcher::Config::default().labels(&format!("{LABEL_NODE_SET}={set}"));
    tokio::spawn(async move {
        let mut stream = watcher(api, config).touched_objects().boxed();
        while let Some(Ok(nm)) = stream.next().await {
            let Some(status) = &nm.status else { continue };
            let mut sink = sink.lock().unwrap();
            for p in &status.nodes {
                if p.phase == NodePhase::Drained {
                    sink.insert(p.node.clone());
                }
            }
            if status.matched == 1
                && status.drained == 1
                && let Some(node) = nm.annotations().get(ANNOTATION_DRAINED_NODE)
            {
                sink.insert(node.clone());
            }
        }
    });
    seen
}

#[tokio::test]
async fn a_set_whose_class_is_gone_still_drains_and_removes_its_nodes() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, ns) = setup("nset-classgone").await?;
    let _controller = start_controller(&ns, &[]).await?;
    let class = unique_name("gone");
    kwok_class(&client, &class, &unique_name("pool")).await?;
    let set = unique_name("orphaned");
    let sets: Api<NodeSet> = Api::all(client.clone());
    apply_spec(
        &sets,
        &set,
        json!({ "nodeClassName": class, "replicas": 2, "scaleDown": { "drainTimeout": "2m" } }),
    )
    .await?;
    let nodes = wait_converged(&client, &set, 2).await?;
    let drained = watch_drained(&client, &set);

    // The class goes: the set says so, naming it, and keeps its nodes.
    Api::<NodeClass>::all(client.clone())
        .delete(&class, &Default::default())
        .await?;
    let class_gone = |s: &NodeSet| {
        condition(s, "Ready")
            .filter(|c| c.0 == "False" && c.1 == "NodeClassNotFound" && c.2.contains(&class))
    };
    wait_for("Ready=False NodeClassNotFound", TIMEOUT, || async {
        Ok(class_gone(&sets.get(&set).await?))
    })
    .await?;
    ensure!(set_nodes(&client, &set).await?.len() == 2);

    // Scaled to 0 without a class: both nodes are drained, then removed; nothing is created.
    let created = watch_created(&client, &set);
    set_replicas(&client, &set, 0).await?;
    let node_api: Api<Node> = Api::all(client.clone());
    wait_for("both nodes drained and gone", TIMEOUT, || async {
        for n in &nodes {
            if node_api.get_opt(&n.name_any()).await?.is_some() {
                return Ok(None);
            }
        }
        Ok(set_nodes(&client, &set).await?.is_empty().then_some(()))
    })
    .await?;
    let names: BTreeSet<String> = nodes.iter().map(|n| n.name_any()).collect();
    let drained = drained.lock().unwrap().clone();
    ensure!(
        drained == names,
        "drained {drained:?} before removal, expected {names:?}"
    );
    let created = created.lock().unwrap().clone();
    ensure!(
        created.is_subset(&names),
        "nodes created without a class: {created:?}"
    );
    let s = wait_for("the status to count 0 nodes", TIMEOUT, || async {
        let s = sets.get(&set).await?;
        let st = s.status.clone().unwrap_or_default();
        Ok((st.replicas == 0 && st.draining_replicas == 0).then_some(s))
    })
    .await?;
    ensure!(class_gone(&s).is_some(), "{:?}", s.status);
    Ok(())
}

#[tokio::test]
async fn names_too_long_for_a_label_value_launch_nothing() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (client, _ns) = setup("nset-longname").await?;
    let failing = Arc::new(Failing::default());
    let (stop, controller) =
        run_with_kwok_provider(&client, Arc::clone(&failing) as Arc<dyn Provider>);
    let sets: Api<NodeSet> = Api::all(client.clone());
    let invalid = |name: String| {
        let sets = sets.clone();
        async move {
            wait_for(&format!("nodeset {name}: InvalidSpec"), TIMEOUT, || {
                let sets = sets.clone();
                let name = name.clone();
                async move {
                    let s = sets.get(&name).await?;
                    Ok(condition(&s, "Ready")
                        .filter(|c| c.1 == "InvalidSpec")
                        .map(|c| c.2))
                }
            })
            .await
        }
    };

    // A set name of 64 characters (names may have 253; label values 63).
    let class = unique_name("kwok");
    kwok_class(&client, &class, &unique_name("pool")).await?;
    let long_set = format!("{}-{}", unique_name("long"), "s".repeat(64));
    apply_spec(
        &sets,
        &long_set,
        json!({ "nodeClassName": class, "replicas": 2 }),
    )
    .await?;
    let message = invalid(long_set.clone()).await?;
    ensure!(
        message.contains("metadata.name") && message.contains("63"),
        "{message}"
    );

    // A class name of 100 characters.
    let long_class = format!("{}-{}", unique_name("kwok"), "c".repeat(100));
    kwok_class(&client, &long_class, &unique_name("pool")).await?;
    let set = unique_name("shortset");
    apply_spec(
        &sets,
        &set,
        json!({ "nodeClassName": long_class, "replicas": 2 }),
    )
    .await?;
    let message = invalid(set.clone()).await?;
    ensure!(
        message.contains("spec.nodeClassName") && message.contains("63"),
        "{message}"
    );
    // A few more reconciles: still no launch.
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Counted for these two sets only: the controller acts on every set left in the cluster.
    let launched: Vec<String> = failing
        .sets
        .lock()
        .unwrap()
        .iter()
        .filter(|s| **s == long_set || **s == set)
        .cloned()
        .collect();
    stop.cancel();
    controller.await?;
    ensure!(
        launched.is_empty(),
        "machines launched for names no Node can carry: {launched:?}"
    );
    for name in [&long_set, &set] {
        set_replicas(&client, name, 0).await?;
    }
    Ok(())
}
