//! A single node, the kube-node way, end to end on the real API server: a Node created with the
//! `nodekeeper.dev/node-class` annotation gets a machine from that NodeClass, and deleting it
//! drains it through a NodeMaintenance before the machine goes. Shown with kwok (the machine is
//! the Node: kwok adopts it and makes it Ready; a Deployment's pod behind a PodDisruptionBudget is
//! evicted by the drain) and with oci against the local OCI endpoint (exactly one LaunchInstance
//! with the class's template, the providerID naming that instance; the deletion terminates it
//! once), and bad input: a missing NodeClass gets a Warning Event naming the annotation, no
//! provider call and no finalizer, and the Node can still be deleted; a Node created with a
//! providerID already gets a Warning and no machine.
//!
//! Faults, with oci: a launch whose answer is lost is found by its tags on the next try, not
//! launched again; a Node deleted before its instance was recorded has that instance terminated;
//! a class whose labels the API server refuses launches nothing; a failed termination is a
//! Warning and the Node waits; a controller without an OCI provider keeps an OCI Node's finalizer
//! and says why.
//!
//! The kube-node controller runs in this process with its providers wrapped in call counters;
//! the NodeMaintenance controller that drains is the real `nodekeeper-controller` process
//! (`NODEKEEPER_CONTROLLERS=nodemaintenance`). One test at a time: each controller acts on every
//! annotated Node.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test kube_node`.

mod controller_common;
mod oci_common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use controller_common::*;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::{NodeClass, NodeClassSpec, NodeMaintenance};
use nodekeeper_api::names::{ANNOTATION_NODE_CLASS, FINALIZER_MACHINE, LABEL_NODE_CLASS};
use nodekeeper_controller::controllers::kube_node;
use nodekeeper_controller::controllers::node_set::{
    self, Deletion, Machine, MachineRequest, Provider, ProviderError,
};
use nodekeeper_e2e::oci_endpoint::{EndpointConfig, OciEndpoint};
use nodekeeper_e2e::{
    ControlPlane, apply_spec, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_secs(120);
const POOL: &str = "nodekeeper.dev/e2e-pool";
/// The label kwok manages nodes by.
const SIMULATED: &str = "nodekeeper.dev/simulated";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// One test at a time: each kube-node controller acts on every annotated Node.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// A real provider with every call counted and every create request kept.
struct Counting {
    inner: Arc<dyn Provider>,
    creates: AtomicU64,
    deletes: AtomicU64,
    others: AtomicU64,
    requests: std::sync::Mutex<Vec<MachineRequest>>,
}

impl Counting {
    fn new(inner: Arc<dyn Provider>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            creates: AtomicU64::new(0),
            deletes: AtomicU64::new(0),
            others: AtomicU64::new(0),
            requests: std::sync::Mutex::default(),
        })
    }

    /// (creates, deletes, gets and lists).
    fn counts(&self) -> (u64, u64, u64) {
        (
            self.creates.load(Ordering::SeqCst),
            self.deletes.load(Ordering::SeqCst),
            self.others.load(Ordering::SeqCst),
        )
    }
}

impl Provider for Counting {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn create<'a>(
        &'a self,
        r: &'a MachineRequest,
    ) -> BoxFuture<'a, Result<Machine, ProviderError>> {
        self.creates.fetch_add(1, Ordering::SeqCst);
        self.requests.lock().unwrap().push(r.clone());
        self.inner.create(r)
    }
    fn delete<'a>(&'a self, m: &'a Machine) -> BoxFuture<'a, Result<Deletion, ProviderError>> {
        self.deletes.fetch_add(1, Ordering::SeqCst);
        self.inner.delete(m)
    }
    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        self.others.fetch_add(1, Ordering::SeqCst);
        self.inner.get(id)
    }
    fn list<'a>(
        &'a self,
        set: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Vec<Machine>, ProviderError>> {
        self.others.fetch_add(1, Ordering::SeqCst);
        self.inner.list(set, class)
    }
    fn machine_is_node(&self) -> bool {
        self.inner.machine_is_node()
    }
    fn find_for_node<'a>(
        &'a self,
        node: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        self.others.fetch_add(1, Ordering::SeqCst);
        self.inner.find_for_node(node, class)
    }
}

/// A real provider with faults on demand: the next `lose` creates launch their machine and then
/// answer an error, as when the answer is lost (each waiting for `hold` first, when given);
/// deletes fail while `fail_deletes` is set.
struct Faulty {
    inner: Arc<dyn Provider>,
    lose: AtomicU64,
    hold: Option<Arc<tokio::sync::Notify>>,
    fail_deletes: AtomicBool,
    creates: AtomicU64,
}

impl Faulty {
    fn new(
        inner: Arc<dyn Provider>,
        lose: u64,
        hold: Option<Arc<tokio::sync::Notify>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            inner,
            lose: AtomicU64::new(lose),
            hold,
            fail_deletes: AtomicBool::new(false),
            creates: AtomicU64::new(0),
        })
    }
}

impl Provider for Faulty {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn create<'a>(
        &'a self,
        r: &'a MachineRequest,
    ) -> BoxFuture<'a, Result<Machine, ProviderError>> {
        Box::pin(async move {
            self.creates.fetch_add(1, Ordering::SeqCst);
            let machine = self.inner.create(r).await?;
            let lost = self
                .lose
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if !lost {
                return Ok(machine);
            }
            if let Some(hold) = &self.hold {
                hold.notified().await;
            }
            Err(ProviderError::Create {
                node: r.node_name.clone(),
                message: format!("the answer was lost (machine {})", machine.provider_id),
            })
        })
    }
    fn delete<'a>(&'a self, m: &'a Machine) -> BoxFuture<'a, Result<Deletion, ProviderError>> {
        if self.fail_deletes.load(Ordering::SeqCst) {
            return Box::pin(async move {
                Err::<Deletion, _>(ProviderError::Delete {
                    id: m.provider_id.clone(),
                    message: "the test refuses deletes".into(),
                })
            });
        }
        self.inner.delete(m)
    }
    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        self.inner.get(id)
    }
    fn list<'a>(
        &'a self,
        set: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Vec<Machine>, ProviderError>> {
        self.inner.list(set, class)
    }
    fn machine_is_node(&self) -> bool {
        self.inner.machine_is_node()
    }
    fn find_for_node<'a>(
        &'a self,
        node: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        self.inner.find_for_node(node, class)
    }
}

/// The test's namespace, the NodeMaintenance controller (a real process) and the kube-node
/// controller in this process; both stop when dropped.
struct Rig {
    client: kube::Client,
    ns: String,
    _maintenance: ControllerProcess,
    stop: CancellationToken,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Rig {
    /// Starts both controllers; `setup` gives the kube-node context its providers.
    async fn new(
        prefix: &str,
        setup: impl FnOnce(&mut kube_node::Context),
    ) -> anyhow::Result<Self> {
        let client = ControlPlane::shared().client().await?;
        install_crds(&client).await?;
        let ns = test_namespace(&client, prefix).await?;
        put_tuning(&client, &ns, &BTreeMap::new()).await?;
        // The node sweep is pointed at no node: these tests have no agents.
        let maintenance = ControllerProcess::start(
            &ns,
            &unique_name("kubenode-nm"),
            "nodekeeper.dev/no-such-label=none",
            free_port(),
            &[("NODEKEEPER_CONTROLLERS", "nodemaintenance")],
        )?;
        let addr = maintenance.http;
        wait_for("the controller to serve", TIMEOUT, || async move {
            let (status, _) = http_get(addr, "/api/v1/summary").await?;
            Ok((status == 200).then_some(()))
        })
        .await?;
        let stop = start_kube_node(&client, setup);
        Ok(Self {
            client,
            ns,
            _maintenance: maintenance,
            stop,
        })
    }

    /// Stops the kube-node controller and starts a fresh one (nothing remembered), as after a
    /// restart.
    fn restart_kube_node(&mut self, setup: impl FnOnce(&mut kube_node::Context)) {
        self.stop.cancel();
        self.stop = start_kube_node(&self.client, setup);
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// Creates a Node as a user would (`kubectl create -f node.yaml`): a name and the annotation.
    async fn create_node(&self, name: &str, class: &str) -> anyhow::Result<()> {
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": name, "annotations": { ANNOTATION_NODE_CLASS: class } },
        }))?;
        self.nodes()
            .create(&PostParams::default(), &node)
            .await
            .with_context(|| format!("create node {name}"))?;
        Ok(())
    }

    async fn wait_gone(&self, name: &str) -> anyhow::Result<()> {
        let nodes = self.nodes();
        let gone = wait_for(&format!("node {name} to be gone"), TIMEOUT, || async {
            Ok(nodes.get_opt(name).await?.is_none().then_some(()))
        })
        .await;
        if gone.is_err() {
            // What held it: its finalizers, and what the controller said on it.
            let node = nodes.get_opt(name).await?;
            let meta = node.map(|n| n.metadata);
            let managers: Vec<_> = meta
                .iter()
                .flat_map(|m| m.managed_fields.iter().flatten())
                .map(|f| (f.manager.clone(), f.operation.clone(), f.time.clone()))
                .collect();
            eprintln!(
                "node {name} left: finalizers {:?}, deleted {:?}, created {:?}, writers {managers:?}",
                meta.as_ref().map(|m| &m.finalizers),
                meta.as_ref().map(|m| &m.deletion_timestamp),
                meta.as_ref().map(|m| &m.creation_timestamp),
            );
            for (reason, note) in node_events(&self.client, name).await? {
                eprintln!("  event {reason}: {note}");
            }
        }
        gone
    }

    /// The Node once its machine is recorded (`spec.providerID` set).
    async fn wait_provider_id(&self, name: &str) -> anyhow::Result<Node> {
        let nodes = self.nodes();
        wait_for("the node's providerID", TIMEOUT, || async {
            Ok(nodes
                .get_opt(name)
                .await?
                .filter(|n| provider_id(n).is_some()))
        })
        .await
    }

    async fn wait_ready(&self, name: &str) -> anyhow::Result<Node> {
        let nodes = self.nodes();
        wait_for(&format!("node {name} to be Ready"), TIMEOUT, || async {
            Ok(nodes.get_opt(name).await?.filter(ready))
        })
        .await
    }
}

/// The Events about Node `name`: (reason, note).
async fn node_events(client: &kube::Client, name: &str) -> anyhow::Result<Vec<(String, String)>> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect())
}

/// Starts a kube-node controller in this process, `setup` giving it its providers; it runs until
/// the returned token is cancelled.
fn start_kube_node(
    client: &kube::Client,
    setup: impl FnOnce(&mut kube_node::Context),
) -> CancellationToken {
    let recorder = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: "nodekeeper-e2e-kubenode".into(),
            instance: None,
        },
    );
    let mut ctx = kube_node::Context::with_client(client.clone(), recorder);
    setup(&mut ctx);
    let stop = CancellationToken::new();
    tokio::spawn(nodekeeper_controller::controllers::start(
        Arc::new(ctx),
        nodekeeper_controller::shared::metrics::ReconcileMetrics::default(),
        stop.clone(),
    ));
    stop
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn provider_id(node: &Node) -> Option<&str> {
    node.spec.as_ref()?.provider_id.as_deref()
}

/// The running pod on `node`, if any.
async fn running_on(client: &kube::Client, ns: &str, node: &str) -> anyhow::Result<Option<String>> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    Ok(pods
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .map(|p| p.name_any()))
}

/// What the kube-node controller is given when it is restarted.
type Setup = Box<dyn FnOnce(&mut kube_node::Context)>;

/// Deletes `node` and follows its removal: its NodeMaintenance appears (then, with `restart`,
/// the kube-node controller is restarted), the pod `pod` (if any) is evicted, the Node goes, and
/// the NodeMaintenance goes too.
async fn delete_and_follow(
    rig: &mut Rig,
    node: &str,
    pod: Option<&str>,
    restart: Option<Setup>,
) -> anyhow::Result<()> {
    let nms: Api<NodeMaintenance> = Api::all(rig.client.clone());
    let nm = format!("kubenode-drain-{node}");
    rig.nodes().delete(node, &DeleteParams::default()).await?;
    let maintenance = wait_for("the node's NodeMaintenance", TIMEOUT, || async {
        Ok(nms.get_opt(&nm).await?)
    })
    .await?;
    ensure!(
        maintenance.spec.stage == nodekeeper_api::crd::node_maintenance::Stage::Drain,
        "{:?}",
        maintenance.spec
    );
    if let Some(setup) = restart {
        rig.restart_kube_node(setup);
    }
    if let Some(pod) = pod {
        let pods: Api<Pod> = Api::namespaced(rig.client.clone(), &rig.ns);
        wait_for(&format!("pod {pod} to be evicted"), TIMEOUT, || async {
            Ok(pods.get_opt(pod).await?.is_none().then_some(()))
        })
        .await?;
    }
    rig.wait_gone(node).await?;
    wait_for("the NodeMaintenance to be gone", TIMEOUT, || async {
        Ok(nms.get_opt(&nm).await?.is_none().then_some(()))
    })
    .await
}

#[tokio::test]
async fn a_kwok_node_created_by_hand_gets_its_machine_and_is_drained_on_deletion()
-> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    let kwok = Counting::new(Arc::new(node_set::kwok::KwokProvider::new(client)));
    let counted = Arc::clone(&kwok);
    let mut rig = Rig::new("kubenode-kwok", move |ctx| {
        ctx.kwok = counted as Arc<dyn Provider>;
    })
    .await?;
    let class = unique_name("kwok");
    let pool = unique_name("pool");
    apply_spec(
        &Api::<NodeClass>::all(rig.client.clone()),
        &class,
        json!({
            "provider": "kwok",
            "kwok": { "capacity": { "cpu": "8", "memory": "32Gi", "pods": "110" } },
            "labels": { POOL: pool },
        }),
    )
    .await?;
    let name = unique_name("node1");
    let started = Instant::now();
    rig.create_node(&name, &class).await?;
    let node = rig.wait_ready(&name).await?;
    eprintln!(
        "node {name} Ready {:.1} s after its creation",
        started.elapsed().as_secs_f64()
    );
    ensure!(
        provider_id(&node) == Some(&format!("kwok://{name}")),
        "{:?}",
        node.spec
    );
    ensure!(node.labels().get(SIMULATED).map(String::as_str) == Some("true"));
    ensure!(node.labels().get(LABEL_NODE_CLASS) == Some(&class));
    ensure!(node.labels().get(POOL) == Some(&pool));
    ensure!(node.finalizers().iter().any(|f| f == FINALIZER_MACHINE));
    let capacity = node.status.as_ref().and_then(|s| s.capacity.as_ref());
    ensure!(
        capacity.and_then(|c| c.get("cpu")).map(|q| q.0.as_str()) == Some("8"),
        "{capacity:?}"
    );

    // One pod on the pool, behind a budget allowing one disruption.
    controller_common::pods_behind_a_budget(&rig.client, &rig.ns, (POOL, &pool), 1, 1).await?;
    let pod = wait_for("the pod to run on the node", TIMEOUT, || {
        running_on(&rig.client, &rig.ns, &name)
    })
    .await?;

    // The controller restarts mid-drain: the new one finds the drain and finishes it.
    let counted = Arc::clone(&kwok);
    let restart: Setup = Box::new(move |ctx| ctx.kwok = counted as Arc<dyn Provider>);
    delete_and_follow(&mut rig, &name, Some(&pod), Some(restart)).await?;
    // One create (the adoption); kwok's machine is the Node, so no delete call; no lists.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let counts = kwok.counts();
    eprintln!("provider calls (creates, deletes, others): {counts:?}");
    ensure!(counts == (1, 0, 0), "{counts:?}");
    Ok(())
}

#[tokio::test]
async fn an_oci_node_created_by_hand_launches_one_instance_and_terminates_it_on_deletion()
-> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    let (endpoint, oci, _credentials, template) = oci_rig_parts(&client).await?;
    let oci = Counting::new(oci);
    let counted = Arc::clone(&oci);
    let mut rig = Rig::new("kubenode-oci", move |ctx| {
        ctx.oci = Some(counted as Arc<dyn Provider>);
    })
    .await?;

    let class = unique_name("e5");
    apply_spec(
        &Api::<NodeClass>::all(rig.client.clone()),
        &class,
        json!({ "provider": "oci", "oci": template, "labels": { POOL: unique_name("pool") } }),
    )
    .await?;
    let name = unique_name("node1");
    rig.create_node(&name, &class).await?;
    let nodes = rig.nodes();
    let node = wait_for("the node's providerID", TIMEOUT, || async {
        Ok(nodes
            .get_opt(&name)
            .await?
            .filter(|n| provider_id(n).is_some()))
    })
    .await?;
    let instances = endpoint.instances();
    ensure!(instances.len() == 1, "{} instances", instances.len());
    let instance = &instances[0];
    ensure!(
        provider_id(&node) == Some(&format!("oci://{}", instance.id)),
        "{:?}",
        node.spec
    );
    ensure!(instance.shape == "VM.Standard.E5.Flex");
    ensure!(instance.freeform_tags.get("nodekeeper.dev/node") == Some(&name));
    ensure!(instance.metadata.get("nodekeeper_node_name") == Some(&name));
    let launched = oci.requests.lock().unwrap().clone();
    ensure!(launched.len() == 1, "{launched:?}");
    let t = launched[0]
        .class
        .oci
        .clone()
        .context("the request carries the class")?;
    ensure!(
        t.image_id == template["imageId"]
            && t.subnet_id == template["subnetId"]
            && t.shape == "VM.Standard.E5.Flex"
    );
    ensure!(node.labels().get(LABEL_NODE_CLASS) == Some(&class));

    // The instance's kubelet joins: once it runs, the Node is handed to kwok (Ready).
    let id = instance.id.clone();
    wait_for("the instance to run", TIMEOUT, || async {
        Ok(endpoint
            .instances()
            .iter()
            .any(|i| i.id == id && i.state == "RUNNING")
            .then_some(()))
    })
    .await?;
    nodes
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { SIMULATED: "true" } } })),
        )
        .await?;
    rig.wait_ready(&name).await?;

    delete_and_follow(&mut rig, &name, None, None).await?;
    let state = endpoint
        .instances()
        .iter()
        .find(|i| i.id == id)
        .map(|i| i.state);
    ensure!(
        matches!(state, Some("TERMINATING" | "TERMINATED")),
        "{state:?}"
    );
    let requests = endpoint.requests();
    let launches = requests
        .iter()
        .filter(|r| r.method == http::Method::POST && r.path.ends_with("/instances"))
        .count();
    let terminates = requests
        .iter()
        .filter(|r| r.method == http::Method::DELETE && r.path.contains(&id))
        .count();
    eprintln!(
        "LaunchInstance {launches}, TerminateInstance {terminates}, provider calls (creates, deletes, others) {:?}",
        oci.counts()
    );
    ensure!(launches == 1, "{launches} LaunchInstance calls");
    ensure!(terminates == 1, "{terminates} TerminateInstance calls");
    let (creates, deletes, others) = oci.counts();
    // One look for an instance launched for the Node before (a lost answer, a restart), one
    // create; deletes until gone, bounded.
    ensure!(
        creates == 1 && others == 1 && (1..=10).contains(&deletes),
        "{:?}",
        oci.counts()
    );
    Ok(())
}

#[tokio::test]
async fn a_node_naming_a_missing_class_gets_a_warning_and_nothing_else() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    let kwok = Counting::new(Arc::new(node_set::kwok::KwokProvider::new(client)));
    let counted = Arc::clone(&kwok);
    let rig = Rig::new("kubenode-bad", move |ctx| {
        ctx.kwok = counted as Arc<dyn Provider>;
    })
    .await?;
    let missing = unique_name("no-such-class");
    let name = unique_name("node1");
    rig.create_node(&name, &missing).await?;
    let note = warning(&rig.client, &name, "NodeClassNotFound").await?;
    ensure!(
        note.contains(ANNOTATION_NODE_CLASS)
            && note.contains(&missing)
            && note.contains("create it"),
        "{note}"
    );
    // Backing off: still nothing asked of the provider, nothing written on the Node.
    tokio::time::sleep(Duration::from_secs(6)).await;
    ensure!(kwok.counts() == (0, 0, 0), "{:?}", kwok.counts());
    let node = rig.nodes().get(&name).await?;
    ensure!(node.finalizers().is_empty(), "{:?}", node.finalizers());
    ensure!(provider_id(&node).is_none());
    ensure!(!node.labels().contains_key(SIMULATED));
    // Nothing holds the Node: it goes at once.
    rig.nodes().delete(&name, &DeleteParams::default()).await?;
    rig.wait_gone(&name).await?;

    // A Node created with a providerID names its machine already: nothing is made for it.
    let class = unique_name("kwok");
    apply_spec(
        &Api::<NodeClass>::all(rig.client.clone()),
        &class,
        json!({ "provider": "kwok", "kwok": {} }),
    )
    .await?;
    let named = unique_name("node2");
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": named, "annotations": { ANNOTATION_NODE_CLASS: class } },
        "spec": { "providerID": "kwok://elsewhere" },
    }))?;
    rig.nodes().create(&PostParams::default(), &node).await?;
    let note = warning(&rig.client, &named, "MachineAlreadyNamed").await?;
    ensure!(
        note.contains("spec.providerID") && note.contains(ANNOTATION_NODE_CLASS),
        "{note}"
    );
    ensure!(kwok.counts() == (0, 0, 0), "{:?}", kwok.counts());
    ensure!(rig.nodes().get(&named).await?.finalizers().is_empty());
    rig.nodes().delete(&named, &DeleteParams::default()).await?;
    rig.wait_gone(&named).await?;
    Ok(())
}

/// Waits for a Warning Event with `reason` on Node `name`; returns its note.
async fn warning(client: &kube::Client, name: &str, reason: &str) -> anyhow::Result<String> {
    wait_for(
        &format!("a {reason} Warning on node {name}"),
        TIMEOUT,
        || async {
            let events: Api<k8s_openapi::api::events::v1::Event> =
                Api::namespaced(client.clone(), "default");
            let list = events.list(&ListParams::default()).await?;
            Ok(list
                .items
                .into_iter()
                .find(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                        && e.type_.as_deref() == Some("Warning")
                        && e.reason.as_deref() == Some(reason)
                })
                .and_then(|e| e.note))
        },
    )
    .await
}

/// The local OCI endpoint (with a subnet and an image), an oci provider on it, the API key it
/// signs with (kept while the test runs) and a NodeClass `spec.oci` using both.
async fn oci_rig_parts(
    client: &kube::Client,
) -> anyhow::Result<(
    Arc<OciEndpoint>,
    Arc<dyn Provider>,
    tempfile::TempDir,
    serde_json::Value,
)> {
    let endpoint = Arc::new(
        OciEndpoint::start(EndpointConfig {
            launch_delay: Duration::from_secs(2),
            terminate_delay: Duration::from_secs(1),
            ..Default::default()
        })
        .await?,
    );
    let (tenancy, user) = ("ocid1.tenancy.oc1..kubenode", "ocid1.user.oc1..kubenode");
    let credentials = oci_common::api_key_for(&endpoint, tenancy, user)?;
    let subnet = endpoint.add_subnet("10.0.0.0/16")?;
    let image = endpoint.add_image();
    let cloud = oci_common::cloud_flags(&endpoint, &credentials)?;
    let oci = node_set::oci_provider(client, &cloud, None)
        .map_err(anyhow::Error::msg)?
        .context("the flags give an oci provider")?;
    let template = json!({
        "compartmentId": "ocid1.compartment.oc1..kubenode",
        "availabilityDomain": "Uocm:PHX-AD-1",
        "shape": "VM.Standard.E5.Flex",
        "shapeConfig": { "ocpus": 2, "memoryInGBs": 16 },
        "imageId": image,
        "subnetId": subnet,
    });
    Ok((endpoint, oci, credentials, template))
}

/// The live (not terminating or terminated) instances at `endpoint`.
fn live_instances(endpoint: &OciEndpoint) -> Vec<String> {
    endpoint
        .instances()
        .iter()
        .filter(|i| !matches!(i.state, "TERMINATING" | "TERMINATED"))
        .map(|i| i.id.clone())
        .collect()
}

/// One Node of an `oci` NodeClass on a kube-node rig whose provider is what `wrap` makes of the
/// local endpoint's (it also gives back the test's handle on it; `class_extra` adds fields to
/// the class's spec).
struct OciCase {
    rig: Rig,
    endpoint: Arc<OciEndpoint>,
    _credentials: tempfile::TempDir,
    class: String,
    name: String,
}

async fn oci_case<H>(
    prefix: &str,
    wrap: impl FnOnce(Arc<dyn Provider>) -> (Arc<dyn Provider>, H),
    class_extra: serde_json::Value,
) -> anyhow::Result<(OciCase, H)> {
    let client = ControlPlane::shared().client().await?;
    let (endpoint, oci, credentials, template) = oci_rig_parts(&client).await?;
    let (provider, handle) = wrap(oci);
    let rig = Rig::new(prefix, move |ctx| ctx.oci = Some(provider)).await?;
    let class = unique_name("e5");
    let mut spec = json!({ "provider": "oci", "oci": template });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), class_extra.as_object()) {
        spec.extend(extra.clone());
    }
    apply_spec(&Api::<NodeClass>::all(rig.client.clone()), &class, spec).await?;
    let name = unique_name("node1");
    rig.create_node(&name, &class).await?;
    let case = OciCase {
        rig,
        endpoint,
        _credentials: credentials,
        class,
        name,
    };
    Ok((case, handle))
}

/// `Faulty` around `oci`, as `oci_case` takes it.
fn faulty_oci(
    lose: u64,
    hold: Option<Arc<tokio::sync::Notify>>,
) -> impl FnOnce(Arc<dyn Provider>) -> (Arc<dyn Provider>, Arc<Faulty>) {
    move |oci| {
        let f = Faulty::new(oci, lose, hold);
        (Arc::clone(&f) as Arc<dyn Provider>, f)
    }
}

#[tokio::test]
async fn an_oci_launch_whose_answer_was_lost_is_found_not_launched_again() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    // The first launch happens, and its answer is lost.
    let (case, faulty) = oci_case("kubenode-lost", faulty_oci(1, None), json!({})).await?;
    let OciCase {
        mut rig,
        endpoint,
        name,
        ..
    } = case;
    let node = rig.wait_provider_id(&name).await?;
    let instances = endpoint.instances();
    ensure!(
        instances.len() == 1,
        "{} instances: {:?}",
        instances.len(),
        instances.iter().map(|i| &i.id).collect::<Vec<_>>()
    );
    let instance = &instances[0];
    ensure!(provider_id(&node) == Some(format!("oci://{}", instance.id).as_str()));
    // Found by its tags: this Node, no set, this cluster.
    ensure!(instance.freeform_tags.get("nodekeeper.dev/node") == Some(&name));
    ensure!(
        instance
            .freeform_tags
            .get("nodekeeper.dev/nodeset")
            .is_none_or(String::is_empty),
        "{:?}",
        instance.freeform_tags
    );
    ensure!(
        instance
            .freeform_tags
            .contains_key("nodekeeper.dev/cluster"),
        "{:?}",
        instance.freeform_tags
    );
    ensure!(faulty.creates.load(Ordering::SeqCst) == 1);
    let note = warning(&rig.client, &name, "ProviderFailed").await?;
    ensure!(note.contains("the answer was lost"), "{note}");

    delete_and_follow(&mut rig, &name, None, None).await?;
    ensure!(
        live_instances(&endpoint).is_empty(),
        "{:?}",
        live_instances(&endpoint)
    );
    Ok(())
}

#[tokio::test]
async fn an_oci_node_deleted_before_its_instance_was_recorded_has_it_terminated()
-> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    // The launch happens; its answer (lost) comes only once the Node is deleted.
    let hold = Arc::new(tokio::sync::Notify::new());
    let (case, faulty) = oci_case(
        "kubenode-early",
        faulty_oci(1, Some(Arc::clone(&hold))),
        json!({}),
    )
    .await?;
    let OciCase {
        rig,
        endpoint,
        name,
        ..
    } = case;
    let id = wait_for("the instance to be launched", TIMEOUT, || async {
        Ok(endpoint.instances().first().map(|i| i.id.clone()))
    })
    .await?;
    let node = rig.nodes().get(&name).await?;
    ensure!(provider_id(&node).is_none(), "{:?}", node.spec);
    ensure!(node.finalizers().iter().any(|f| f == FINALIZER_MACHINE));
    rig.nodes().delete(&name, &DeleteParams::default()).await?;
    hold.notify_one();
    rig.wait_gone(&name).await?;
    let state = endpoint
        .instances()
        .iter()
        .find(|i| i.id == id)
        .map(|i| i.state);
    ensure!(
        matches!(state, Some("TERMINATING" | "TERMINATED")),
        "instance {id} left {state:?}: the Node went without its machine"
    );
    ensure!(endpoint.instances().len() == 1);
    ensure!(faulty.creates.load(Ordering::SeqCst) == 1);
    Ok(())
}

#[tokio::test]
async fn an_oci_class_with_labels_the_api_server_refuses_launches_nothing() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (case, counted) = oci_case(
        "kubenode-badlabel",
        |oci| {
            let c = Counting::new(oci);
            (Arc::clone(&c) as Arc<dyn Provider>, c)
        },
        json!({ "labels": { "team name": "x" } }),
    )
    .await?;
    let OciCase {
        rig,
        endpoint,
        class,
        name,
        ..
    } = case;
    let note = warning(&rig.client, &name, "InvalidSpec").await?;
    ensure!(
        note.contains(r#"spec.labels["team name"]"#) && note.contains(&class),
        "{note}"
    );
    // Several passes' worth of time: nothing launched, nothing written on the Node.
    tokio::time::sleep(Duration::from_secs(15)).await;
    ensure!(
        endpoint.instances().is_empty(),
        "{:?}",
        endpoint.instances().len()
    );
    ensure!(counted.counts() == (0, 0, 0), "{:?}", counted.counts());
    let node = rig.nodes().get(&name).await?;
    ensure!(node.finalizers().is_empty(), "{:?}", node.finalizers());
    ensure!(provider_id(&node).is_none());
    rig.nodes().delete(&name, &DeleteParams::default()).await?;
    rig.wait_gone(&name).await
}

#[tokio::test]
async fn a_failed_termination_is_a_warning_and_the_node_waits_for_it() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let (case, faulty) = oci_case("kubenode-delfail", faulty_oci(0, None), json!({})).await?;
    let OciCase {
        rig,
        endpoint,
        name,
        ..
    } = case;
    let nodes = rig.nodes();
    let node = rig.wait_provider_id(&name).await?;
    let id = provider_id(&node).unwrap_or_default().to_owned();
    faulty.fail_deletes.store(true, Ordering::SeqCst);
    nodes.delete(&name, &DeleteParams::default()).await?;
    let note = warning(&rig.client, &name, "MachineDeleteFailed").await?;
    ensure!(
        note.contains(&id) && note.contains("the test refuses deletes"),
        "{note}"
    );
    let held = nodes.get(&name).await?;
    ensure!(held.finalizers().iter().any(|f| f == FINALIZER_MACHINE));
    // Deletes work again: within the backoff, the instance and the Node go.
    faulty.fail_deletes.store(false, Ordering::SeqCst);
    rig.wait_gone(&name).await?;
    ensure!(
        live_instances(&endpoint).is_empty(),
        "{:?}",
        live_instances(&endpoint)
    );
    Ok(())
}

#[tokio::test]
async fn without_an_oci_provider_an_oci_node_keeps_its_finalizer() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    // The kube-node controller has no OCI provider (no cloud flags).
    let rig = Rig::new("kubenode-nooci", |_| {}).await?;
    let class = unique_name("e5");
    let name = unique_name("node1");
    // A Node recorded as an OCI machine of `class` (as this controller writes it).
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": { ANNOTATION_NODE_CLASS: class },
            "labels": { LABEL_NODE_CLASS: class, "kubernetes.io/hostname": name },
            "finalizers": [FINALIZER_MACHINE],
        },
        "spec": { "providerID": "oci://ocid1.instance.oc1.phx.kubenode" },
    }))?;
    rig.nodes().create(&PostParams::default(), &node).await?;
    rig.nodes().delete(&name, &DeleteParams::default()).await?;
    let note = warning(&rig.client, &name, "ProviderFailed").await?;
    ensure!(
        note.contains("ocid1.instance.oc1.phx.kubenode")
            && note.contains("no OCI provider")
            && note.contains("--oci-endpoint")
            && note.contains(FINALIZER_MACHINE),
        "{note}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let held = rig.nodes().get(&name).await?;
    ensure!(
        held.finalizers().iter().any(|f| f == FINALIZER_MACHINE),
        "{:?}",
        held.finalizers()
    );
    // What the Warning says to do: remove the finalizer by hand.
    rig.nodes()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
        )
        .await?;
    rig.wait_gone(&name).await?;
    let nms: Api<NodeMaintenance> = Api::all(rig.client.clone());
    let _ = nms
        .delete(&format!("kubenode-drain-{name}"), &DeleteParams::default())
        .await;
    Ok(())
}

#[tokio::test]
async fn a_registered_node_gets_no_machine_and_a_recorded_one_keeps_its_class() -> anyhow::Result<()>
{
    let _serial = SERIAL.lock().await;
    let client = ControlPlane::shared().client().await?;
    let kwok = Counting::new(Arc::new(node_set::kwok::KwokProvider::new(client)));
    let counted = Arc::clone(&kwok);
    let rig = Rig::new("kubenode-registered", move |ctx| {
        ctx.kwok = counted as Arc<dyn Provider>;
    })
    .await?;
    let small = unique_name("small");
    let large = unique_name("large");
    let classes = Api::<NodeClass>::all(rig.client.clone());
    for class in [&small, &large] {
        apply_spec(&classes, class, json!({ "provider": "kwok", "kwok": {} })).await?;
    }

    // A Node its kubelet registered (as a kubelet writes it: status.nodeInfo), annotated later.
    let registered = unique_name("kubelet");
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": { "name": registered },
    }))?;
    rig.nodes().create(&PostParams::default(), &node).await?;
    rig.nodes()
        .patch_status(
            &registered,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "nodeInfo": {
                "kubeletVersion": "v1.36.0", "architecture": "amd64", "bootID": "b",
                "containerRuntimeVersion": "containerd://2.0", "kernelVersion": "6.8",
                "kubeProxyVersion": "", "machineID": "m", "operatingSystem": "linux",
                "osImage": "test", "systemUUID": "u",
            } } })),
        )
        .await?;
    rig.nodes()
        .patch(
            &registered,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "metadata": { "annotations": { ANNOTATION_NODE_CLASS: small } } }),
            ),
        )
        .await?;
    let note = warning(&rig.client, &registered, "NodeAlreadyRegistered").await?;
    ensure!(
        note.contains(ANNOTATION_NODE_CLASS) && note.contains("kubelet registered"),
        "{note}"
    );
    ensure!(kwok.counts() == (0, 0, 0), "{:?}", kwok.counts());
    let node = rig.nodes().get(&registered).await?;
    ensure!(node.finalizers().is_empty(), "{:?}", node.finalizers());
    ensure!(provider_id(&node).is_none() && !node.labels().contains_key(SIMULATED));
    rig.nodes()
        .delete(&registered, &DeleteParams::default())
        .await?;
    rig.wait_gone(&registered).await?;

    // A Node with its machine recorded from `small`, its annotation then changed to `large`.
    let name = unique_name("node1");
    rig.create_node(&name, &small).await?;
    rig.wait_ready(&name).await?;
    rig.nodes()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "metadata": { "annotations": { ANNOTATION_NODE_CLASS: large } } }),
            ),
        )
        .await?;
    let note = warning(&rig.client, &name, "ClassChanged").await?;
    ensure!(
        note.contains(&small) && note.contains(&large) && note.contains("Delete the Node"),
        "{note}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let node = rig.nodes().get(&name).await?;
    ensure!(
        node.labels().get(LABEL_NODE_CLASS) == Some(&small),
        "{:?}",
        node.labels()
    );
    ensure!(kwok.counts() == (1, 0, 0), "{:?}", kwok.counts());
    rig.nodes().delete(&name, &DeleteParams::default()).await?;
    rig.wait_gone(&name).await
}
