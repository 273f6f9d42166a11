//! The `NodeDiagnostic` controller: troubleshooting bundles from the agents of the nodes a
//! NodeDiagnostic names, kept on the controller's own disk (never in etcd) and served by its HTTP
//! API. Files: the reconciler (`reconcile`), the status it writes as plain functions (`status`),
//! one node's stream to disk with its SHA-256 (`collect`), and the bounded store with the
//! download route (`store`). This file holds the [`Context`] and the [`Config`] (flags).
//!
//! Download, through the API server's service proxy, from the path in the NodeDiagnostic's
//! `status.nodes[].downloadPath` (it ends in the bundle's download token, see [`store`]):
//! `kubectl get --raw /api/v1/namespaces/nodekeeper/services/nodekeeper-controller:http/proxy/api/diagnostics/<ns>/<name>/<node>/<token> > bundle.tar.gz`

pub mod collect;
pub mod reconcile;
pub mod status;
pub mod store;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Api;
use kube::runtime::controller::Action;
use nodekeeper_api::crd::NodeDiagnostic;
use tokio::sync::watch;
use tracing::warn;

pub use reconcile::{Error, error_policy, reconcile};
pub use store::BundleStore;

use super::Reconciler;
use crate::shared::{Agents, Shared, TuningState};

/// The NodeDiagnostic controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "node_diagnostic")]
pub struct Config {
    /// Directory for diagnostics bundles on the controller's own disk (an emptyDir in the
    /// Deployment); created on first use.
    #[arg(
        long,
        env = "NODEKEEPER_DIAGNOSTICS_DIR",
        default_value = "/var/lib/nodekeeper/diagnostics"
    )]
    pub diagnostics_dir: PathBuf,

    /// Total bytes of bundles kept in `--diagnostics-dir`; the oldest bundles of other
    /// NodeDiagnostics are evicted to make room, and a bundle that still does not fit fails
    /// (evicting nothing).
    #[arg(
        long,
        env = "NODEKEEPER_DIAGNOSTICS_MAX_BYTES",
        default_value_t = 2 * 1024 * 1024 * 1024
    )]
    pub diagnostics_max_bytes: u64,

    /// Bundles streamed at once by one NodeDiagnostic.
    #[arg(long, env = "NODEKEEPER_DIAGNOSTICS_CONCURRENCY", default_value_t = 8)]
    pub diagnostics_concurrency: usize,

    /// NodeDiagnostics collected at once.
    #[arg(
        long,
        env = "NODEKEEPER_NODEDIAGNOSTIC_CONCURRENCY",
        default_value_t = 2
    )]
    pub nodediagnostic_concurrency: u16,

    /// Longest time one node's bundle may take to arrive.
    #[arg(long, env = "NODEKEEPER_DIAGNOSTICS_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub diagnostics_timeout: Duration,
}

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

/// What the reconciler needs.
pub struct Context {
    pub client: kube::Client,
    pub agent_port: u16,
    pub agents: Arc<dyn Agents>,
    /// The tuning in force: bundle cap and default parts.
    pub tuning: watch::Receiver<Arc<TuningState>>,
    pub store: BundleStore,
    /// Bundles streamed at once per NodeDiagnostic.
    pub agent_concurrency: usize,
    pub object_concurrency: u16,
    /// Per-node deadline.
    pub timeout: Duration,
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
    /// The NodeDiagnostics this process finished, by UID, with their final status: the watch may
    /// still show the Running status (written before the final one), or writing the final one
    /// failed and is retried from here; either way they are not collected again.
    pub finished: Mutex<HashMap<String, reconcile::Finished>>,
    /// Set once the store was swept of the bundles of deleted NodeDiagnostics, before the first
    /// collection of this leadership (see `BundleStore::sweep`).
    pub swept: tokio::sync::OnceCell<()>,
}

impl Context {
    /// The controller's context in the running controller-manager; configures `store` (whose
    /// download route the HTTP API already serves) with the flags.
    pub fn new(shared: &Shared, config: &Config, store: &BundleStore) -> Self {
        if let Err(error) = store.configure(&config.diagnostics_dir, config.diagnostics_max_bytes) {
            warn!(%error, dir = %config.diagnostics_dir.display(), "diagnostics store not usable; bundles will fail");
        }
        Self {
            client: shared.client.clone(),
            agent_port: shared.agent_port,
            agents: shared.agents(),
            tuning: shared.tuning.clone(),
            store: store.clone(),
            agent_concurrency: config.diagnostics_concurrency,
            object_concurrency: config.nodediagnostic_concurrency,
            timeout: config.diagnostics_timeout,
            namespace: None,
            finished: Mutex::default(),
            swept: tokio::sync::OnceCell::new(),
        }
    }
}

impl Reconciler for Context {
    type Object = NodeDiagnostic;
    type Error = Error;
    const NAME: &'static str = "nodediagnostic";
    const CALLS_AGENTS: bool = true;

    fn api(&self) -> Api<NodeDiagnostic> {
        match &self.namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        }
    }

    fn concurrency(&self) -> u16 {
        self.object_concurrency
    }

    fn reconcile(
        obj: Arc<NodeDiagnostic>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NodeDiagnostic>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}
