//! The `NodeNetworkConfig` controller: for every node the selector picks, attach the missing OCI
//! secondary VNICs, wait for ATTACHED, then `ApplyNetwork` on the agent (host side, with its
//! plan/apply/check/rollback), a few nodes at a time (`rollout.maxUnavailable`), pausing once
//! `rollout.failureThreshold` nodes fail.
//!
//! Files: the pure logic — one node's VNIC diff ([`plan`]), which nodes start next ([`rollout`]),
//! the bounded status ([`status`]) — the cloud side with its caches and call counting
//! ([`cloud`]), and the reconciler that drives one node at a time through its steps without
//! ever blocking on the cloud ([`reconcile`]). This file holds the [`Context`] and the
//! [`Config`] (flags).
//!
//! Nodes are read from a reflector of this controller's own (the shared fleet keeps no labels or
//! provider IDs); a change of a node's labels is picked up at the next pass (at most
//! `--nnc-resync-interval` later). A node that leaves the selector loses what the object put
//! there (host side, then its VNICs). A node two objects select belongs to the older one (by
//! creation time, then name); the younger leaves it alone and says so in its `Conflict`
//! condition, naming both objects and the nodes.

pub mod cloud;
pub mod plan;
pub mod reconcile;
pub mod rollout;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use nodekeeper_api::crd::NodeNetworkConfig;

pub use cloud::{CloudAccess, CloudConfig};
pub use reconcile::{Error, error_policy, reconcile};

use super::Reconciler;
use crate::shared::metrics::CloudMetrics;
use crate::shared::{Agents, Shared};

/// The NodeNetworkConfig controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "node_network_config")]
pub struct Config {
    #[command(flatten)]
    pub cloud: CloudConfig,

    /// Nodes of one NodeNetworkConfig stepped at once (cloud and agent calls in flight).
    #[arg(long, env = "NODEKEEPER_NNC_NODE_CONCURRENCY", default_value_t = 32)]
    pub nnc_node_concurrency: usize,

    /// NodeNetworkConfigs reconciled at once.
    #[arg(long, env = "NODEKEEPER_NNC_CONCURRENCY", default_value_t = 2)]
    pub nnc_concurrency: u16,

    /// How soon a rollout in progress is looked at again (attachments waiting for ATTACHED,
    /// nodes waiting for their turn); also how long one pass goes on taking the first looks
    /// that fall due, before it writes the status. At least 100ms.
    #[arg(long, env = "NODEKEEPER_NNC_POLL_INTERVAL", default_value = "2s", value_parser = duration)]
    pub nnc_poll_interval: Duration,

    /// How often a finished rollout is looked at again (nodes added or relabelled). At least 1s.
    #[arg(long, env = "NODEKEEPER_NNC_RESYNC_INTERVAL", default_value = "60s", value_parser = duration)]
    pub nnc_resync_interval: Duration,

    /// Longest wait for a VNIC to become ATTACHED and visible on the host (its interface and
    /// the metadata service's answer); the node then fails, naming the VNIC. More than 0.
    #[arg(long, env = "NODEKEEPER_NNC_ATTACH_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub nnc_attach_timeout: Duration,

    /// How long OCI takes from AttachVnic to ATTACHED, at least: the first look at a new
    /// attachment waits this long (longer after looks that found attachments still ATTACHING,
    /// never shorter), so a VNIC usually costs one GetVnicAttachment.
    #[arg(long, env = "NODEKEEPER_NNC_ATTACH_LATENCY", default_value = "10s", value_parser = duration)]
    pub nnc_attach_latency: Duration,

    /// Longest `ApplyNetwork` call (the post-apply check included). More than 0.
    #[arg(long, env = "NODEKEEPER_NNC_APPLY_TIMEOUT", default_value = "90s", value_parser = duration)]
    pub nnc_apply_timeout: Duration,

    /// Wait before a failed node is tried again; doubled after each further failure in a row.
    #[arg(long, env = "NODEKEEPER_NNC_RETRY_BACKOFF", default_value = "30s", value_parser = duration)]
    pub nnc_retry_backoff: Duration,

    /// Longest wait between two tries of a failing node.
    #[arg(long, env = "NODEKEEPER_NNC_RETRY_BACKOFF_MAX", default_value = "10m", value_parser = duration)]
    pub nnc_retry_backoff_max: Duration,
}

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

/// Timing and concurrency of the reconciler.
#[derive(Clone, Debug)]
pub struct Settings {
    pub node_concurrency: usize,
    pub object_concurrency: u16,
    pub poll: Duration,
    pub resync: Duration,
    pub attach_timeout: Duration,
    pub apply_timeout: Duration,
    /// First and longest wait before a failed node is tried again.
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
}

impl Settings {
    pub fn from_config(c: &Config) -> Self {
        Self {
            node_concurrency: c.nnc_node_concurrency.max(1),
            object_concurrency: c.nnc_concurrency.max(1),
            poll: c.nnc_poll_interval,
            resync: c.nnc_resync_interval,
            attach_timeout: c.nnc_attach_timeout,
            apply_timeout: c.nnc_apply_timeout,
            retry_backoff: c.nnc_retry_backoff,
            retry_backoff_max: c.nnc_retry_backoff_max,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            node_concurrency: 32,
            object_concurrency: 2,
            poll: Duration::from_secs(2),
            resync: Duration::from_secs(60),
            attach_timeout: Duration::from_secs(300),
            apply_timeout: Duration::from_secs(90),
            retry_backoff: Duration::from_secs(30),
            retry_backoff_max: Duration::from_secs(600),
        }
    }
}

/// The Nodes as this controller sees them: a reflector store fed by its own watch, started by
/// the first reconcile (a cluster without NodeNetworkConfigs pays nothing for it) and ended when
/// the context is dropped. Each Node is trimmed as it arrives to what a reconcile reads
/// ([`trim_node`]): at 10,000 nodes a whole Node (images, node info, every condition with its
/// message) would cost tens of MiB.
pub struct NodeCache {
    client: kube::Client,
    started: std::sync::OnceLock<(Store<Node>, tokio::task::AbortHandle)>,
}

impl NodeCache {
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            started: std::sync::OnceLock::new(),
        }
    }

    /// The store, its watch started on the first call (it may still be listing).
    pub fn store(&self) -> &Store<Node> {
        let (store, _) = self.started.get_or_init(|| {
            let (store, writer) = reflector::store();
            let stream = watcher(
                Api::<Node>::all(self.client.clone()),
                crate::shared::lists::nodes(),
            )
            .default_backoff()
            .modify(trim_node)
            .reflect(writer)
            .applied_objects();
            let task = tokio::spawn(async move {
                stream.for_each(|_| futures::future::ready(())).await;
            });
            (store, task.abort_handle())
        });
        store
    }
}

impl Drop for NodeCache {
    fn drop(&mut self) {
        if let Some((_, task)) = self.started.get() {
            task.abort();
        }
    }
}

/// Keeps of a Node what `reconcile::node_info` reads: name, labels, the provider ID, the
/// InternalIP and this controller's `NodeNetworkReady` condition.
pub(crate) fn trim_node(node: &mut Node) {
    let meta = std::mem::take(&mut node.metadata);
    node.metadata = kube::api::ObjectMeta {
        name: meta.name,
        resource_version: meta.resource_version,
        uid: meta.uid,
        labels: meta.labels,
        ..Default::default()
    };
    if let Some(spec) = node.spec.as_mut() {
        *spec = k8s_openapi::api::core::v1::NodeSpec {
            provider_id: spec.provider_id.take(),
            ..Default::default()
        };
    }
    if let Some(status) = node.status.as_mut() {
        let addresses = status.addresses.take().map(|a| {
            let mut first = true;
            crate::shared::filter_exact(a, |a| {
                let keep = first && a.type_ == "InternalIP";
                first &= !keep;
                keep
            })
        });
        let conditions = status.conditions.take().map(|cs| {
            crate::shared::filter_exact(cs, |c| {
                c.type_ == nodekeeper_api::names::NODE_CONDITION_NETWORK_READY
            })
        });
        *status = k8s_openapi::api::core::v1::NodeStatus {
            addresses,
            conditions,
            ..Default::default()
        };
    }
}

/// What the reconciler needs.
pub struct Context {
    pub client: kube::Client,
    pub agents: Arc<dyn Agents>,
    pub agent_port: u16,
    pub cloud: CloudAccess,
    pub metrics: CloudMetrics,
    pub settings: Settings,
    pub nodes: NodeCache,
    /// Per object (by uid): where each selected node stands. Lost on restart and rebuilt from
    /// OCI's attachments (found by display name and owner tag) and idempotent applies.
    pub(crate) runs: Mutex<HashMap<String, reconcile::ObjectRun>>,
    /// Reconcile only the NodeNetworkConfigs with these labels (tests sharing one API server
    /// each run their own controller); `None`: all of them.
    pub object_labels: Option<String>,
}

impl Context {
    /// The controller's context in the running controller-manager.
    pub fn new(shared: &Shared, config: &Config) -> Self {
        let metrics = shared.metrics.cloud.clone();
        let cloud = match CloudAccess::from_config(&config.cloud, metrics.clone()) {
            CloudAccess::On(c) => match Arc::try_unwrap(c) {
                Ok(c) => {
                    CloudAccess::On(Arc::new(c.with_attach_latency(config.nnc_attach_latency)))
                }
                Err(c) => CloudAccess::On(c),
            },
            other => other,
        };
        match &cloud {
            CloudAccess::Off => tracing::info!(
                "nodenetworkconfig: no OCI endpoint configured; VNICs are never attached or detached"
            ),
            CloudAccess::Misconfigured(message) => {
                tracing::error!(%message, "nodenetworkconfig: OCI access misconfigured")
            }
            CloudAccess::On(_) => tracing::info!("nodenetworkconfig: OCI access configured"),
        }
        Self::with(
            shared.client.clone(),
            shared.agents(),
            shared.agent_port,
            cloud,
            metrics,
            Settings::from_config(config),
        )
    }

    /// A context from its parts (tests and benchmarks build their own agents and cloud).
    pub fn with(
        client: kube::Client,
        agents: Arc<dyn Agents>,
        agent_port: u16,
        cloud: CloudAccess,
        metrics: CloudMetrics,
        settings: Settings,
    ) -> Self {
        Self {
            nodes: NodeCache::new(client.clone()),
            client,
            agents,
            agent_port,
            cloud,
            metrics,
            settings,
            runs: Mutex::default(),
            object_labels: None,
        }
    }

    /// Reconciles only the objects `label_selector` (e.g. `team=a`) picks.
    pub fn watching(mut self, label_selector: &str) -> Self {
        self.object_labels = Some(label_selector.to_string());
        self
    }
}

impl Reconciler for Context {
    type Object = NodeNetworkConfig;
    type Error = Error;
    const NAME: &'static str = "nodenetworkconfig";
    const CALLS_AGENTS: bool = true;

    fn api(&self) -> Api<NodeNetworkConfig> {
        Api::all(self.client.clone())
    }

    fn watcher_config(&self) -> watcher::Config {
        match &self.object_labels {
            Some(l) => watcher::Config::default().labels(l),
            None => watcher::Config::default(),
        }
    }

    fn concurrency(&self) -> u16 {
        self.settings.object_concurrency
    }

    fn reconcile(
        obj: Arc<NodeNetworkConfig>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NodeNetworkConfig>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}
