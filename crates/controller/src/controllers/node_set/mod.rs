//! The `NodeSet` controller: keeps `replicas` Ready nodes made from a `NodeClass`, creating
//! machines through a provider (`provider`: the interface; `kwok`: Node objects kwok simulates),
//! draining nodes through a `NodeMaintenance` before their machine is removed, replacing
//! machines that never join and nodes of an old template (`plan`: the arithmetic, plain
//! functions), and writing the status on change (`status`). This file holds the [`Context`], its
//! caches and the [`Config`] (flags).
//!
//! Caches and wake-ups: the controller scaffold watches NodeSets, and the Nodes of every set,
//! the NodeMaintenances the sets created and the NodeClasses are kept in three reflector stores
//! (Nodes and NodeMaintenances by the `nodekeeper.dev/nodeset` label, so only the sets' own
//! objects; Nodes trimmed to what the plan reads). A reconcile reads only these stores, so while
//! a set is moving it requeues itself every second at no API cost, and every 30 seconds once it
//! has converged. A change that matters in those stores (a node added or removed, its Ready or
//! a nodekeeper condition turning, a drain's status moving) wakes every set at once, coalesced
//! to one wake per [`WAKE_COALESCE`]; heartbeats alone wake nothing. A spec change, including
//! `kubectl scale`, wakes the set through the NodeSet watch.
//!
//! Providers: `kwok` always; `oci` when the controller is given the cloud flags it shares with
//! the NodeNetworkConfig controller (`--oci-endpoint` or `--oci-region`, and `--oci-auth`).

pub mod kwok;
pub mod oci;
pub mod plan;
pub mod provider;
pub mod reconcile;
pub mod status;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Resource, ResourceExt as _};
use nodekeeper_api::crd::node_class::Provider as ProviderKind;
use nodekeeper_api::crd::{NodeClass, NodeMaintenance, NodeSet};
use nodekeeper_api::names::LABEL_NODE_SET;
use serde::de::DeserializeOwned;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

pub use provider::{
    CallCounts, Deletion, Machine, MachineRequest, Provider, ProviderCalls, ProviderError,
};
pub use reconcile::{Error, error_policy, reconcile};

use super::Reconciler;
use super::node_network_config::CloudConfig;
use crate::shared::Shared;

/// The NodeSet controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "node_set")]
pub struct Config {
    /// A machine whose kubelet has not reported this long after creation (its Node has no Ready
    /// condition, or only the `Ready=Unknown` reason `NodeStatusNeverUpdated` that
    /// kube-controller-manager writes on a Node no kubelet ever updated) is deleted and replaced
    /// (with backoff), and counted in the set's `status.failedJoins`. More than 0.
    #[arg(long, env = "NODEKEEPER_NODESET_JOIN_TIMEOUT", default_value = "10m", value_parser = duration)]
    pub nodeset_join_timeout: Duration,

    /// The most replicas one NodeSet may ask for; a set above it is refused with a condition
    /// and nothing is created or removed.
    #[arg(long, env = "NODEKEEPER_NODESET_MAX_REPLICAS", default_value_t = 1000)]
    pub nodeset_max_replicas: u32,

    /// Machine creations in flight at once, per NodeSet.
    #[arg(
        long,
        env = "NODEKEEPER_NODESET_CREATE_CONCURRENCY",
        default_value_t = 32
    )]
    pub nodeset_create_concurrency: usize,

    /// NodeSets reconciled at once.
    #[arg(long, env = "NODEKEEPER_NODESET_CONCURRENCY", default_value_t = 4)]
    pub nodeset_concurrency: u16,

    /// Reconcile only the NodeSets matching this label selector (e.g. two controllers sharing
    /// one API server, each with its own cloud); all NodeSets when unset.
    #[arg(long, env = "NODEKEEPER_NODESET_SELECTOR")]
    pub nodeset_selector: Option<String>,

    /// The orphan sweep (machines at the provider tagged with a set but without a Node) leaves
    /// a machine younger than this alone: its Node may not be written, or not yet seen.
    #[arg(long, env = "NODEKEEPER_NODESET_ORPHAN_GRACE", default_value = "10m", value_parser = duration)]
    pub nodeset_orphan_grace: Duration,

    /// This cluster's name on the machines its NodeSets launch (the freeform tag
    /// `nodekeeper.dev/cluster`): the orphan sweep only ever terminates machines carrying it, so
    /// clusters sharing a compartment (a blue/green upgrade with the same NodeSet names) never
    /// terminate each other's. Unset: the UID of the `kube-system` Namespace, read once (the
    /// controller then needs `get` on that Namespace). Set it to keep the identity across a
    /// rebuilt cluster, at most 256 characters.
    #[arg(long, env = "NODEKEEPER_CLUSTER_ID")]
    pub cluster_id: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nodeset_join_timeout: Duration::from_secs(600),
            nodeset_max_replicas: 1000,
            nodeset_create_concurrency: 32,
            nodeset_concurrency: 4,
            nodeset_selector: None,
            nodeset_orphan_grace: DEFAULT_ORPHAN_GRACE,
            cluster_id: None,
        }
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

/// The caches a reconcile reads.
pub struct Stores {
    pub nodes: Store<Node>,
    pub maintenances: Store<NodeMaintenance>,
    pub classes: Store<NodeClass>,
}

/// What this process remembers about one set between reconciles; lost on restart by design
/// (everything that matters is rebuilt from the Nodes and NodeMaintenances).
#[derive(Debug, Default)]
pub struct SetMemory {
    /// Machines created and not yet seen in the Node cache, with when they were created.
    pub in_flight: HashMap<String, Instant>,
    /// Machines whose deletion was asked for and that are still in the Node cache.
    pub deleting: HashMap<String, Instant>,
    /// Consecutive create failures (and joins that never happened), for the backoff.
    pub failures: u32,
    /// No create before this.
    pub retry_at: Option<Instant>,
    /// The provider's last error, until a create succeeds.
    pub last_error: Option<String>,
    /// When the provider was last listed for machines without a Node.
    pub last_list: Option<Instant>,
    /// NodeMaintenances this process deleted, while the cache may still show them.
    pub deleted_maintenances: HashMap<String, Instant>,
    /// Machines the orphan sweep found with a Node outside the set (its label removed) and left
    /// running; said once each.
    pub kept_orphans: HashSet<String>,
}

/// This process's [`SetMemory`] per name: per NodeSet here, per Node in the kube-node
/// controller.
#[derive(Debug, Default)]
pub struct Memories(Mutex<HashMap<String, SetMemory>>);

impl Memories {
    /// Runs `f` on the memory of `name` (a fresh one the first time).
    pub fn with<T>(&self, name: &str, f: impl FnOnce(&mut SetMemory) -> T) -> T {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        f(all.entry(name.to_owned()).or_default())
    }

    /// Forgets `name`.
    pub fn forget(&self, name: &str) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
    }
}

/// cluster-autoscaler's node-group minimum, as its Cluster API provider reads it from a
/// scalable resource; on a NodeSet, a bound on `spec.replicas` (outside it the set is refused
/// with `ReplicasOutOfBounds` and nothing is created or removed).
pub const ANNOTATION_MIN_SIZE: &str = "cluster.x-k8s.io/cluster-api-autoscaler-node-group-min-size";
/// cluster-autoscaler's node-group maximum (see [`ANNOTATION_MIN_SIZE`]).
pub const ANNOTATION_MAX_SIZE: &str = "cluster.x-k8s.io/cluster-api-autoscaler-node-group-max-size";

/// How often a set whose machines are not Node objects lists its provider for machines that
/// lost their Node (a crash between launch and record): terminated, as no pod ever ran there.
pub const ORPHAN_SWEEP: Duration = Duration::from_secs(60);
/// The default of `--nodeset-orphan-grace`: a machine this young is never swept. Ten minutes
/// is far beyond the seconds between a launch and its Node record, and beyond the two minutes
/// a machine in flight is remembered, so a slow Node watch cannot make a new machine an orphan.
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_secs(600);
/// Store changes within this window wake the sets once.
pub const WAKE_COALESCE: Duration = Duration::from_secs(1);

/// The longest wait between create attempts of a failing provider.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

impl SetMemory {
    /// Records a failure and schedules the next attempt: 2 s, 4 s, … up to [`MAX_BACKOFF`].
    pub fn fail(&mut self, error: String) {
        self.failures = self.failures.saturating_add(1);
        let delay = Duration::from_secs(1u64 << self.failures.min(9)).min(MAX_BACKOFF);
        self.retry_at = Some(Instant::now() + delay);
        self.last_error = Some(error);
    }

    /// A create worked: back to normal.
    pub fn succeed(&mut self) {
        self.failures = 0;
        self.retry_at = None;
        self.last_error = None;
    }

    /// How long creates must still wait.
    pub fn backoff_left(&self) -> Option<Duration> {
        self.retry_at
            .and_then(|t| t.checked_duration_since(Instant::now()))
            .filter(|d| !d.is_zero())
    }
}

/// What the reconciler needs.
pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    /// The provider of `provider: kwok` classes.
    pub kwok: Arc<dyn Provider>,
    /// The provider of `provider: oci` classes, when this controller has one.
    pub oci: Option<Arc<dyn Provider>>,
    /// Why there is no oci provider (the condition's words).
    pub oci_unavailable: String,
    /// Every provider call, counted.
    pub calls: Arc<ProviderCalls>,
    pub join_timeout: Duration,
    /// The orphan sweep leaves machines younger than this alone.
    pub orphan_grace: Duration,
    pub max_replicas: u32,
    pub create_concurrency: usize,
    pub concurrency: u16,
    /// Only NodeSets with these labels.
    pub selector: Option<String>,
    /// How often a set that is moving is looked at again (the caches make this free).
    pub recheck: Duration,
    /// How often a converged set is looked at again.
    pub resync: Duration,
    stores: OnceCell<Arc<Stores>>,
    /// Stops the cache watches when the controller (and so this context) is dropped.
    stop: CancellationToken,
    memory: Memories,
    /// Bumped by the store watches on a change that matters; wakes every set.
    wake: tokio::sync::watch::Sender<u64>,
}

impl Context {
    /// The controller's context in the running controller-manager; `cloud` (the flags shared
    /// with the NodeNetworkConfig controller) gives the oci provider.
    pub fn new(shared: &Shared, config: &Config, cloud: &CloudConfig) -> Self {
        let mut ctx = Self::with_client(shared.client.clone(), shared.recorder(), config);
        match oci_provider(&shared.client, cloud, config.cluster_id.as_deref()) {
            Ok(Some(p)) => {
                tracing::info!("nodeset: OCI access configured; provider oci available");
                ctx.oci = Some(p);
            }
            Ok(None) => {}
            Err(message) => {
                tracing::error!(%message, "nodeset: OCI access misconfigured; provider oci unavailable");
                ctx.oci_unavailable =
                    format!("the controller's OCI access is misconfigured: {message}");
            }
        }
        ctx
    }

    /// A context on `client` with the kwok provider (tests replace `kwok` with their own).
    pub fn with_client(client: kube::Client, recorder: Recorder, config: &Config) -> Self {
        Self {
            kwok: Arc::new(kwok::KwokProvider::new(client.clone())),
            oci: None,
            oci_unavailable: provider::OCI_NOT_CONFIGURED.into(),
            client,
            recorder,
            calls: Arc::default(),
            join_timeout: config.nodeset_join_timeout,
            orphan_grace: config.nodeset_orphan_grace,
            max_replicas: config.nodeset_max_replicas,
            create_concurrency: config.nodeset_create_concurrency.max(1),
            concurrency: config.nodeset_concurrency,
            selector: config.nodeset_selector.clone(),
            recheck: Duration::from_secs(1),
            resync: Duration::from_secs(30),
            stores: OnceCell::new(),
            stop: CancellationToken::new(),
            memory: Memories::default(),
            wake: tokio::sync::watch::Sender::new(0),
        }
    }

    /// The provider for a class's `spec.provider`.
    pub fn provider(&self, kind: ProviderKind) -> Result<Arc<dyn Provider>, ProviderError> {
        provider::pick(kind, &self.kwok, self.oci.as_ref(), &self.oci_unavailable)
    }

    /// Runs `f` on this process's memory of set `name`.
    pub fn memory<T>(&self, name: &str, f: impl FnOnce(&mut SetMemory) -> T) -> T {
        self.memory.with(name, f)
    }

    /// Forgets a set (deleted).
    pub fn forget(&self, name: &str) {
        self.memory.forget(name);
    }

    /// The caches, started on first use; waits (bounded) until each has listed once, so a
    /// reconcile never mistakes an empty cache for a set without nodes.
    pub async fn stores(&self) -> Result<Arc<Stores>, Error> {
        let stores = self
            .stores
            .get_or_init(|| async {
                let by_set = watcher::Config::default().labels(LABEL_NODE_SET);
                Arc::new(Stores {
                    nodes: reflect(
                        Api::all(self.client.clone()),
                        crate::shared::lists::nodes().labels(LABEL_NODE_SET),
                        trim_node,
                        Some((self.wake.clone(), node_fingerprint as fn(&Node) -> String)),
                        self.stop.child_token(),
                    ),
                    maintenances: reflect(
                        Api::all(self.client.clone()),
                        by_set,
                        |nm: &mut NodeMaintenance| nm.managed_fields_mut().clear(),
                        Some((
                            self.wake.clone(),
                            (|nm: &NodeMaintenance| format!("{:?}", nm.status))
                                as fn(&NodeMaintenance) -> String,
                        )),
                        self.stop.child_token(),
                    ),
                    classes: reflect(
                        Api::all(self.client.clone()),
                        watcher::Config::default(),
                        |c: &mut NodeClass| c.managed_fields_mut().clear(),
                        None,
                        self.stop.child_token(),
                    ),
                })
            })
            .await;
        let ready = async {
            stores.nodes.wait_until_ready().await.ok();
            stores.maintenances.wait_until_ready().await.ok();
            stores.classes.wait_until_ready().await.ok();
        };
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .map_err(|_| Error::SyncCaches)?;
        Ok(Arc::clone(stores))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Keeps of a Node only what the plan reads: metadata without managedFields, the providerID, and
/// the Ready and nodekeeper conditions. At 10,000 nodes this is the difference between a few MiB and hundreds.
fn trim_node(node: &mut Node) {
    node.managed_fields_mut().clear();
    if let Some(status) = node.status.as_mut() {
        // Ready, and nodekeeper's own conditions (which a set's repair may name).
        let ready = status.conditions.take().map(|cs| {
            crate::shared::filter_exact(cs, |c| {
                c.type_ == "Ready" || crate::conditions::OWNED_TYPES.contains(&c.type_.as_str())
            })
        });
        *status = Default::default();
        status.conditions = ready;
    }
}

/// The provider of `provider: oci` classes from the cloud flags: `None` without an endpoint or
/// region. Its client retries briefly (3 attempts within 15 s): a reconcile must not wait the
/// SDKs' two minutes, and the set's own backoff takes over. `cluster_id` is `--cluster-id`
/// (`None`: the `kube-system` Namespace's UID, read on first need).
pub fn oci_provider(
    client: &kube::Client,
    cloud: &CloudConfig,
    cluster_id: Option<&str>,
) -> Result<Option<Arc<dyn Provider>>, String> {
    use nodekeeper_oci::compute::{ComputeClient, ComputeConfig};
    let cluster_id = oci::check_cluster_id(cluster_id)?;
    let endpoint = match (&cloud.oci_endpoint, &cloud.oci_region) {
        (Some(e), _) => e.clone(),
        (None, Some(r)) => ComputeConfig::for_region(r, &cloud.oci_realm_domain).endpoint,
        (None, None) => return Ok(None),
    };
    let auth = super::node_network_config::cloud::auth(cloud)?;
    let mut cfg = ComputeConfig::new(&endpoint);
    cfg.retry = nodekeeper_oci::retry::RetryPolicy {
        max_attempts: 3,
        base: Duration::from_secs(1),
        cap: Duration::from_secs(4),
        max_elapsed: Duration::from_secs(15),
    };
    cfg.timeout = Duration::from_secs(20);
    let compute = ComputeClient::new(cfg, auth).map_err(|e| e.to_string())?;
    Ok(Some(Arc::new(oci::OciProvider::new(
        compute,
        client.clone(),
        cluster_id,
    ))))
}

/// What of a Node matters to a set: its Ready status, nodekeeper's condition statuses and
/// whether it is cordoned or being deleted (heartbeats change none of these).
fn node_fingerprint(node: &Node) -> String {
    let conditions: Vec<(&str, &str)> = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .map(|c| (c.type_.as_str(), c.status.as_str()))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "{conditions:?} {:?} {}",
        node.spec.as_ref().and_then(|s| s.unschedulable),
        node.metadata.deletion_timestamp.is_some()
    )
}

/// Where a store's changes wake the sets, and what of an object counts as a change.
type Wake<K> = (tokio::sync::watch::Sender<u64>, fn(&K) -> String);

/// A reflector store of `api`, fed by a watch that runs until `stop`; with `wake`, a change of
/// an object's fingerprint (or its addition or removal) after the first list bumps the sender.
fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    wake: Option<Wake<K>>,
    stop: CancellationToken,
) -> Store<K>
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let mut seen: HashMap<String, String> = HashMap::new();
    let stream = watcher(api, config)
        .default_backoff()
        .modify(trim)
        .reflect(writer)
        .for_each(move |event| {
            if let (Some((sender, fingerprint)), Ok(event)) = (&wake, event) {
                let changed = match event {
                    watcher::Event::InitApply(o) => {
                        seen.insert(o.name_any(), fingerprint(&o));
                        false
                    }
                    watcher::Event::Apply(o) => {
                        let f = fingerprint(&o);
                        seen.insert(o.name_any(), f.clone()).as_ref() != Some(&f)
                    }
                    watcher::Event::Delete(o) => {
                        seen.remove(&o.name_any());
                        true
                    }
                    watcher::Event::Init | watcher::Event::InitDone => false,
                };
                if changed {
                    sender.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            futures::future::ready(())
        });
    tokio::spawn(async move {
        tokio::select! {
            () = stop.cancelled() => {}
            () = stream => {}
        }
    });
    reader
}

impl Reconciler for Context {
    type Object = NodeSet;
    type Error = Error;
    const NAME: &'static str = "nodeset";

    fn api(&self) -> Api<NodeSet> {
        Api::all(self.client.clone())
    }

    fn watcher_config(&self) -> watcher::Config {
        match &self.selector {
            Some(s) => watcher::Config::default().labels(s),
            None => watcher::Config::default(),
        }
    }

    fn concurrency(&self) -> u16 {
        self.concurrency
    }

    fn reconcile_all_on(&self) -> Option<futures::stream::BoxStream<'static, ()>> {
        let rx = self.wake.subscribe();
        Some(
            futures::stream::unfold(rx, |mut rx| async move {
                rx.changed().await.ok()?;
                // Let a burst (a scale-up's nodes joining) settle into one wake.
                tokio::time::sleep(WAKE_COALESCE).await;
                rx.borrow_and_update();
                Some(((), rx))
            })
            .boxed(),
        )
    }

    fn reconcile(
        obj: Arc<NodeSet>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NodeSet>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}
