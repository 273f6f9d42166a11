//! The `NodeSet` controller: keeps `replicas` Ready nodes made from a `NodeClass`, creating
//! machines through a provider (`provider`: the interface; `kwok`: Node objects kwok simulates),
//! draining nodes through a `NodeMaintenance` before their machine is removed, replacing
//! machines that never join and nodes of an old template (`plan`: the arithmetic, plain
//! functions), and writing the status on change (`status`). This file holds the [`Context`], its
//! caches and the [`Config`] (flags).
//!
//! Caches, and why no extra watch triggers: the controller scaffold watches NodeSets only, so
//! the Nodes of every set, the NodeMaintenances the sets created and the NodeClasses are kept in
//! three reflector stores (Nodes and NodeMaintenances by the `nodekeeper.dev/nodeset` label, so
//! only the sets' own objects; Nodes trimmed to what the plan reads). A reconcile reads only
//! these stores, so while a set is moving it requeues itself every second at no API cost, and
//! every 30 seconds once it has converged (so a node that turns NotReady shows in the status
//! within 30 s; a spec change, including `kubectl scale`, wakes the set at once).

pub mod kwok;
pub mod plan;
pub mod provider;
pub mod reconcile;
pub mod status;

use std::collections::HashMap;
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
use crate::shared::Shared;

/// The NodeSet controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "node_set")]
pub struct Config {
    /// A machine whose Node has no Ready condition this long after creation is deleted and
    /// replaced (with backoff), and counted in the set's `status.failedJoins`.
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
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nodeset_join_timeout: Duration::from_secs(600),
            nodeset_max_replicas: 1000,
            nodeset_create_concurrency: 32,
            nodeset_concurrency: 4,
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
}

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
    /// Every provider call, counted.
    pub calls: Arc<ProviderCalls>,
    pub join_timeout: Duration,
    pub max_replicas: u32,
    pub create_concurrency: usize,
    pub concurrency: u16,
    /// How often a set that is moving is looked at again (the caches make this free).
    pub recheck: Duration,
    /// How often a converged set is looked at again.
    pub resync: Duration,
    stores: OnceCell<Arc<Stores>>,
    /// Stops the cache watches when the controller (and so this context) is dropped.
    stop: CancellationToken,
    memory: Mutex<HashMap<String, SetMemory>>,
}

impl Context {
    /// The controller's context in the running controller-manager.
    pub fn new(shared: &Shared, config: &Config) -> Self {
        Self::with_client(shared.client.clone(), shared.recorder(), config)
    }

    /// A context on `client` with the kwok provider (tests replace `kwok` with their own).
    pub fn with_client(client: kube::Client, recorder: Recorder, config: &Config) -> Self {
        Self {
            kwok: Arc::new(kwok::KwokProvider::new(client.clone())),
            oci: None,
            client,
            recorder,
            calls: Arc::default(),
            join_timeout: config.nodeset_join_timeout,
            max_replicas: config.nodeset_max_replicas,
            create_concurrency: config.nodeset_create_concurrency.max(1),
            concurrency: config.nodeset_concurrency,
            recheck: Duration::from_secs(1),
            resync: Duration::from_secs(30),
            stores: OnceCell::new(),
            stop: CancellationToken::new(),
            memory: Mutex::default(),
        }
    }

    /// The provider for a class's `spec.provider`.
    pub fn provider(&self, kind: ProviderKind) -> Result<Arc<dyn Provider>, ProviderError> {
        match kind {
            ProviderKind::Kwok => Ok(Arc::clone(&self.kwok)),
            ProviderKind::Oci => self.oci.clone().ok_or(ProviderError::Unsupported {
                provider: "oci".into(),
            }),
        }
    }

    /// Runs `f` on this process's memory of set `name`.
    pub fn memory<T>(&self, name: &str, f: impl FnOnce(&mut SetMemory) -> T) -> T {
        let mut all = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        f(all.entry(name.to_owned()).or_default())
    }

    /// Forgets a set (deleted).
    pub fn forget(&self, name: &str) {
        self.memory
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
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
                        by_set.clone(),
                        trim_node,
                        self.stop.child_token(),
                    ),
                    maintenances: reflect(
                        Api::all(self.client.clone()),
                        by_set,
                        |nm: &mut NodeMaintenance| nm.managed_fields_mut().clear(),
                        self.stop.child_token(),
                    ),
                    classes: reflect(
                        Api::all(self.client.clone()),
                        watcher::Config::default(),
                        |c: &mut NodeClass| c.managed_fields_mut().clear(),
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
            cs.into_iter()
                .filter(|c| {
                    c.type_ == "Ready" || crate::conditions::OWNED_TYPES.contains(&c.type_.as_str())
                })
                .collect()
        });
        *status = Default::default();
        status.conditions = ready;
    }
}

/// A reflector store of `api`, fed by a watch that runs until `stop`.
fn reflect<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
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
    let stream = watcher(api, config)
        .default_backoff()
        .modify(trim)
        .reflect(writer)
        .for_each(|_| futures::future::ready(()));
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

    fn concurrency(&self) -> u16 {
        self.concurrency
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
