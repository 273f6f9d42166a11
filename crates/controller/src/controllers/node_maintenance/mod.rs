//! The `NodeMaintenance` controller: declarative cordon and drain. The domain logic is plain
//! functions over plain data — drain plan and timeouts (`plan`), stage to per-node holds
//! (`stage`), what is recorded on each node and how it is restored (`record`), eviction answers
//! (`eviction`), admission safety (`admission`) and the status (`status`) — driven by the
//! reconciler (`reconcile`), which reads the cluster from the watch cache (`cache`) whose
//! watches also wake it. This file holds the [`Context`].

pub mod admission;
pub mod cache;
pub mod eviction;
pub mod plan;
pub mod reconcile;
pub mod record;
pub mod stage;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use nodekeeper_api::crd::NodeMaintenance;
use nodekeeper_api::crd::node_maintenance::NodeMaintenanceStatus;
use tokio::sync::{OnceCell, watch};
use tracing::warn;

pub use reconcile::{Error, error_policy, reconcile};

use super::Reconciler;
use crate::shared::{Shared, TuningState};

/// The cluster-wide limits from the tuning ConfigMap, read at each reconcile.
#[derive(Clone, Copy, Debug)]
pub struct TuningLimits {
    /// `maintenance.maxConcurrentNodes`: nodes draining at once across every maintenance.
    pub max_concurrent_nodes: u32,
    /// `maintenance.maxSelectedNodes`: the admission cap.
    pub max_selected_nodes: u32,
}

/// The controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "node_maintenance")]
pub struct Config {
    /// How long the Node, Pod and PodDisruptionBudget caches stay after the last
    /// NodeMaintenance is gone. They run only while one exists: between maintenances the
    /// controller holds no copy of the cluster's Nodes and Pods.
    #[arg(
        long,
        env = "NODEKEEPER_MAINTENANCE_CACHE_GRACE",
        default_value = "5m",
        value_parser = duration
    )]
    pub maintenance_cache_grace: Duration,
    /// How long a pod on a node tainted `node.kubernetes.io/unreachable` may stay terminating
    /// past its deletion time before a drain counts it gone (and lists it under
    /// `skippedPods` with reason `NodeUnreachable`): without a kubelet to confirm it, its
    /// deletion never completes and the drain could never end. Cluster API waits the same
    /// 5 minutes by default.
    #[arg(
        long,
        env = "NODEKEEPER_MAINTENANCE_UNREACHABLE_POD_WAIT",
        default_value = "5m",
        value_parser = duration
    )]
    pub maintenance_unreachable_pod_wait: Duration,
}

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

/// What the reconciler needs.
pub struct Context {
    /// The process's client, used until [`Context::kube`] has built its own.
    base_client: kube::Client,
    /// A client with kube's default retry layer off: a 429 from a PodDisruptionBudget must come
    /// back at once as "wait", not be retried with backoff inside the client for minutes while
    /// the reconcile (and every other node's drain) waits on it.
    client: OnceCell<kube::Client>,
    pub recorder: Recorder,
    pub tuning: watch::Receiver<Arc<TuningState>>,
    /// How long one reconcile may spend evicting before it requeues.
    pub eviction_budget: Duration,
    /// How often a node with a drain in progress is looked at again when no event comes: a
    /// safety net (the watches wake a drain when a pod leaves or a budget allows again), and
    /// the moment a pod terminating past its grace period is reported.
    pub drain_recheck: Duration,
    /// `--maintenance-unreachable-pod-wait`.
    pub unreachable_pod_wait: Duration,
    /// Nodes, pods and budgets from watches; the watches wake the maintenances.
    pub cache: Arc<cache::Cache>,
    /// The status this replica last wrote per maintenance (by UID) and when: newer than the
    /// watched object until the watch catches up, and the clock of the write coalescing.
    statuses: Mutex<HashMap<String, (NodeMaintenanceStatus, Instant)>>,
    /// Held by the reconcile promoting nodes to Draining, from its read of the cluster-wide
    /// draining count to its Draining holds written: the reconciles run concurrently, and
    /// `maintenance.maxConcurrentNodes` is a ceiling across all of them.
    pub(crate) promotion: tokio::sync::Mutex<()>,
}

impl Context {
    /// The controller's context in the running controller-manager.
    pub fn new(shared: &Shared, config: &Config) -> Self {
        Self {
            base_client: shared.client.clone(),
            client: OnceCell::new(),
            recorder: shared.recorder(),
            tuning: shared.tuning.clone(),
            eviction_budget: Duration::from_secs(5),
            drain_recheck: Duration::from_secs(15),
            unreachable_pod_wait: config.maintenance_unreachable_pod_wait,
            cache: Arc::new(cache::Cache::new(
                config.maintenance_cache_grace,
                shared.metrics.maintenance.clone(),
            )),
            statuses: Mutex::default(),
            promotion: tokio::sync::Mutex::new(()),
        }
    }

    /// A context outside the controller-manager, for driving [`reconcile`] directly (the e2e
    /// tests use it to hand a reconcile an object that is already gone, a race the running
    /// controller hits only by chance). `client` is used as is, for every request: nothing is
    /// inferred from the environment. The limits are the tuning defaults; the caches run while
    /// the caller polls [`cache::Cache::triggers`].
    pub fn standalone(client: kube::Client, identity: &str) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            kube::runtime::events::Reporter {
                controller: "nodekeeper-controller".into(),
                instance: Some(identity.to_owned()),
            },
        );
        let (_, tuning) = watch::channel(Arc::new(TuningState::defaults()));
        Self {
            base_client: client.clone(),
            client: OnceCell::new_with(Some(client)),
            recorder,
            tuning,
            eviction_budget: Duration::from_secs(5),
            drain_recheck: Duration::from_secs(15),
            unreachable_pod_wait: plan::UNREACHABLE_POD_WAIT,
            cache: Arc::new(cache::Cache::default()),
            statuses: Mutex::default(),
            promotion: tokio::sync::Mutex::new(()),
        }
    }

    /// The status this replica last wrote for the maintenance with `uid`.
    pub fn last_status(&self, uid: &str) -> Option<NodeMaintenanceStatus> {
        let statuses = self.statuses.lock().unwrap_or_else(PoisonError::into_inner);
        statuses.get(uid).map(|(s, _)| s.clone())
    }

    /// How long ago this replica last wrote that status; `None` if it has not.
    pub fn since_status_write(&self, uid: &str) -> Option<Duration> {
        let statuses = self.statuses.lock().unwrap_or_else(PoisonError::into_inner);
        statuses.get(uid).map(|(_, at)| at.elapsed())
    }

    pub fn remember_status(&self, uid: &str, status: NodeMaintenanceStatus) {
        let mut statuses = self.statuses.lock().unwrap_or_else(PoisonError::into_inner);
        statuses.insert(uid.to_owned(), (status, Instant::now()));
    }

    pub fn forget_status(&self, uid: &str) {
        let mut statuses = self.statuses.lock().unwrap_or_else(PoisonError::into_inner);
        statuses.remove(uid);
    }

    /// The no-retry client, built on first use from the same configuration the process
    /// inferred (kubeconfig or in-cluster).
    pub async fn kube(&self) -> kube::Client {
        self.client
            .get_or_init(|| async {
                let config = kube::Config::infer().await.map(|mut c| {
                    c.default_retry = false;
                    c
                });
                match config.map(kube::Client::try_from) {
                    Ok(Ok(client)) => client,
                    Ok(Err(error)) => {
                        warn!(%error, "building the no-retry client failed; using the default client");
                        self.base_client.clone()
                    }
                    Err(error) => {
                        warn!(%error, "building the no-retry client failed; using the default client");
                        self.base_client.clone()
                    }
                }
            })
            .await
            .clone()
    }

    /// The limits in force.
    pub fn limits(&self) -> TuningLimits {
        let state = Arc::clone(&self.tuning.borrow());
        TuningLimits {
            max_concurrent_nodes: state.config.maintenance_max_concurrent_nodes,
            max_selected_nodes: state.config.maintenance_max_selected_nodes,
        }
    }
}

impl Reconciler for Context {
    type Object = NodeMaintenance;
    type Error = Error;
    const NAME: &'static str = "nodemaintenance";

    fn api(&self) -> Api<NodeMaintenance> {
        Api::all(self.base_client.clone())
    }

    fn concurrency(&self) -> u16 {
        4
    }

    fn reconcile_all_on(&self) -> Option<BoxStream<'static, ()>> {
        Some(self.cache.triggers(&self.base_client))
    }

    fn reconcile(
        obj: Arc<NodeMaintenance>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NodeMaintenance>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}
