//! What every controller may use, built once by the runtime: the Kubernetes client, the Event
//! recorder factory, the metrics (one sub-registry per subsystem), the agents service, and the
//! two pieces of shared state fed by watches of their own — the fleet (Node watch, [`fleet`])
//! and the tuning in force (ConfigMap watch, [`tuning`]).
//!
//! Nothing here imports from `controllers` or `runtime`: the dependency direction is
//! `runtime` → `controllers` → `shared` → the plain modules (`certs`, `conditions`, `view`,
//! `schedule`).

pub mod agent_client;
pub mod agents;
pub mod fleet;
pub mod lists;
pub mod metrics;
pub mod tls_sessions;
pub mod tuning;
pub mod writers;

use std::sync::Arc;

use kube::runtime::events::{Recorder, Reporter};
use tokio::sync::watch;

pub use agents::{AgentNode, Agents, MtlsAgents};
pub use fleet::Fleet;
pub use metrics::Metrics;
pub use tuning::TuningState;

/// `items` with only those `keep` accepts, in an allocation of their size. Collecting a filtered
/// `Vec` reuses the original's allocation: a trimmed Node that keeps one of its twenty
/// conditions would hold room for all twenty, for as long as a cache holds the Node (2.2 MiB at
/// 1,000 nodes in NodeMaintenance's cache, heaptrack).
pub fn filter_exact<T>(mut items: Vec<T>, keep: impl FnMut(&T) -> bool) -> Vec<T> {
    items.retain(keep);
    items.shrink_to_fit();
    items
}

/// The toolbox a controller's `Context` is built from. Cheap to share (`Arc`s and handles).
pub struct Shared {
    pub client: kube::Client,
    /// The controller's namespace (Lease, Secrets, tuning ConfigMap).
    pub namespace: String,
    /// This replica's identity, also the Event reporter instance.
    pub identity: String,
    /// The agents' gRPC port on each node's InternalIP.
    pub agent_port: u16,
    pub metrics: Arc<Metrics>,
    pub fleet: Arc<Fleet>,
    pub tuning: watch::Receiver<Arc<TuningState>>,
    /// The production agents service; controllers take it as `Arc<dyn Agents>`.
    pub agents: Arc<MtlsAgents>,
    /// Annotations the leader's next Lease renewal writes (no write of their own).
    pub lease_annotations: LeaseAnnotations,
}

/// Annotations the leader's renewals put on its Lease, set by whoever has something to record
/// there: shared with the renewal thread.
pub type LeaseAnnotations = Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>;

impl Shared {
    /// An Event recorder reporting as `nodekeeper-controller` from this replica. One per
    /// controller task; the recorder batches and deduplicates its own Events.
    pub fn recorder(&self) -> Recorder {
        Recorder::new(
            self.client.clone(),
            Reporter {
                controller: "nodekeeper-controller".into(),
                instance: Some(self.identity.clone()),
            },
        )
    }

    /// The agents service as a trait object.
    pub fn agents(&self) -> Arc<dyn Agents> {
        Arc::clone(&self.agents) as Arc<dyn Agents>
    }
}
