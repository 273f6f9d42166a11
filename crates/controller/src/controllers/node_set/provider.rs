//! The machine provider interface a NodeSet creates and removes machines through, shaped like
//! Karpenter's CloudProvider (create, delete until gone, get, list by the set's tag), and the
//! call counters every provider is wrapped in.
//!
//! The per-machine record is the Node object itself, not a separate object: the controller
//! writes the Node (labels naming the set and class, the template-hash annotation, and
//! `spec.providerID` as the machine's identity) in the same write that makes the machine known.
//! A separate per-machine object (Karpenter's NodeClaim, Cluster API's Machine) would cost at
//! least two more writes per machine (create, status) plus a watch and an etcd object per node —
//! against the write budget (≤ 4 writes per created node, ≤ 1 write/s at 10,000 nodes) for no
//! information the Node and the provider's own list cannot give back after a restart.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use futures::future::BoxFuture;
use nodekeeper_api::crd::node_class::{NodeClassSpec, Taint};
use nodekeeper_api::crd::node_set::ANNOTATION_TEMPLATE_HASH;
use nodekeeper_api::names::{LABEL_NODE_CLASS, LABEL_NODE_SET};
use serde_json::json;

/// What the controller asks a provider for: one machine, and the Node it should become.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineRequest {
    /// The Node's name (also the machine's name at the provider).
    pub node_name: String,
    /// The NodeSet it belongs to (the provider's tag). Empty for a single Node a user created
    /// (the kube-node controller): that Node exists already, so the provider adopts it rather
    /// than writing the record ([`MachineRequest::adopts_node`]).
    pub node_set: String,
    /// The NodeClass it is made from.
    pub node_class: String,
    /// The hash of the class spec and set template (the Node's template-hash annotation).
    pub template_hash: String,
    /// Every label the Node carries (class, template, and the set's own).
    pub labels: BTreeMap<String, String>,
    /// Every taint the Node carries.
    pub taints: Vec<Taint>,
    /// The class's template.
    pub class: NodeClassSpec,
}

impl MachineRequest {
    /// Whether the Node exists already (a user created it) and the machine is made for it:
    /// the provider writes no Node record (kwok adopts the Node as its machine; a real
    /// machine's kubelet takes it over when it joins).
    pub fn adopts_node(&self) -> bool {
        self.node_set.is_empty()
    }
}

/// A machine as the provider reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// The Node's name.
    pub node_name: String,
    /// The machine's identity, as in the Node's `spec.providerID` (`kwok://name`, `oci://ocid`).
    pub provider_id: String,
    /// The NodeSet its tag names, if any.
    pub node_set: Option<String>,
    /// When the provider made it, where the provider says (the orphan sweep leaves a machine
    /// younger than its grace alone: its Node may not be written or seen yet).
    pub created: Option<SystemTime>,
}

/// Where a deletion stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deletion {
    /// The machine no longer exists.
    Gone,
    /// Accepted; call again until [`Deletion::Gone`].
    InProgress,
}

/// A provider's failure, with its own words.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("create machine {node}: {message}")]
    Create { node: String, message: String },
    #[error("delete machine {id}: {message}")]
    Delete { id: String, message: String },
    #[error("get machine {id}: {message}")]
    Get { id: String, message: String },
    #[error("list machines of nodeset {node_set}: {message}")]
    List { node_set: String, message: String },
    #[error("look for the machine of node {node}: {message}")]
    Find { node: String, message: String },
    #[error("provider {provider} is not available in this controller: {why}")]
    Unsupported { provider: String, why: String },
}

/// A source of machines. Every call is idempotent: `create` of a machine that exists returns
/// it, `delete` of a machine that is gone says [`Deletion::Gone`].
pub trait Provider: Send + Sync {
    /// The provider's name (`kwok`, `oci`), for conditions and logs.
    fn kind(&self) -> &'static str;
    /// Creates the machine `request` describes.
    fn create<'a>(
        &'a self,
        request: &'a MachineRequest,
    ) -> BoxFuture<'a, Result<Machine, ProviderError>>;
    /// Deletes a machine; call until it answers [`Deletion::Gone`].
    fn delete<'a>(&'a self, machine: &'a Machine)
    -> BoxFuture<'a, Result<Deletion, ProviderError>>;
    /// The machine with this provider id, if it exists.
    fn get<'a>(
        &'a self,
        provider_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>>;
    /// Every live machine this cluster launched for `node_set`, where `class` says to look; a
    /// provider may return this cluster's machines of other sets there too (each names its set,
    /// and the orphan sweep checks it). What the orphan sweep may terminate: a machine another
    /// cluster launched, even for a set of the same name, must not be in it.
    fn list<'a>(
        &'a self,
        node_set: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Vec<Machine>, ProviderError>>;
    /// Whether a machine is its Node object (kwok): then no machine can exist without a Node,
    /// and the controller never lists the provider to find machines that lost theirs.
    fn machine_is_node(&self) -> bool {
        false
    }
    /// The live machine this cluster made for the single Node `node` (a Node a user created:
    /// [`MachineRequest::adopts_node`]), where `class` says to look — one launched before an
    /// answer was lost, a restart or a failover, so the Node never recorded it. Never a
    /// NodeSet's machine. `None` by default: a provider whose machine is its Node
    /// ([`Provider::machine_is_node`]) has nothing to find. A wrapper must pass it on.
    fn find_for_node<'a>(
        &'a self,
        _node: &'a str,
        _class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        Box::pin(async { Ok(None) })
    }
}

/// The provider of a class's `spec.provider`: `kwok`, or `oci` when the controller has one
/// (`why` says why not).
pub fn pick(
    kind: nodekeeper_api::crd::node_class::Provider,
    kwok: &Arc<dyn Provider>,
    oci: Option<&Arc<dyn Provider>>,
    why: &str,
) -> Result<Arc<dyn Provider>, ProviderError> {
    use nodekeeper_api::crd::node_class::Provider as Kind;
    match kind {
        Kind::Kwok => Ok(Arc::clone(kwok)),
        Kind::Oci => oci.cloned().ok_or_else(|| ProviderError::Unsupported {
            provider: "oci".into(),
            why: why.to_owned(),
        }),
    }
}

/// Why a controller has no oci provider when it was given no cloud flags.
pub const OCI_NOT_CONFIGURED: &str = "start it with --oci-endpoint or --oci-region \
    (NODEKEEPER_OCI_ENDPOINT / NODEKEEPER_OCI_REGION) and credentials (--oci-auth), \
    or use a NodeClass with spec.provider: kwok";

/// The Node object that records a machine (the per-machine record, written once when the
/// machine is made): the set's and class's labels and the request's own, the template hash,
/// the taints, and `spec.providerID`. A provider adds what only it knows (kwok: its label and
/// the capacity; a real machine's kubelet reports its own status when it takes the object over).
pub fn node_record(request: &MachineRequest, provider_id: &str) -> serde_json::Value {
    let mut labels = BTreeMap::from([(
        "kubernetes.io/hostname".to_owned(),
        request.node_name.clone(),
    )]);
    labels.extend(request.labels.clone());
    labels.insert(LABEL_NODE_SET.to_owned(), request.node_set.clone());
    labels.insert(LABEL_NODE_CLASS.to_owned(), request.node_class.clone());
    let taints: Vec<serde_json::Value> = request
        .taints
        .iter()
        .map(|t| json!({ "key": t.key, "value": t.value, "effect": t.effect }))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": request.node_name,
            "labels": labels,
            "annotations": { ANNOTATION_TEMPLATE_HASH: request.template_hash },
        },
        "spec": { "providerID": provider_id, "taints": taints },
    })
}

/// Calls made to providers, by operation and result: read by tests and the benchmark, and
/// logged; a runaway loop shows up here first.
#[derive(Debug, Default)]
pub struct ProviderCalls {
    pub create_ok: AtomicU64,
    pub create_failed: AtomicU64,
    pub delete: AtomicU64,
    pub get: AtomicU64,
    pub list: AtomicU64,
}

/// A snapshot of [`ProviderCalls`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CallCounts {
    pub create_ok: u64,
    pub create_failed: u64,
    pub delete: u64,
    pub get: u64,
    pub list: u64,
}

impl ProviderCalls {
    pub fn snapshot(&self) -> CallCounts {
        CallCounts {
            create_ok: self.create_ok.load(Ordering::Relaxed),
            create_failed: self.create_failed.load(Ordering::Relaxed),
            delete: self.delete.load(Ordering::Relaxed),
            get: self.get.load(Ordering::Relaxed),
            list: self.list.load(Ordering::Relaxed),
        }
    }
}
