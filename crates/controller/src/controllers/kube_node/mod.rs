//! The kube-node controller: a Node a user creates (`kubectl create -f node.yaml`) with the
//! `nodekeeper.dev/node-class` annotation gets a machine from that NodeClass — the Node comes
//! first, the machine joins later and its kubelet takes the object over — and deleting such a
//! Node drains it through a NodeMaintenance, then deletes the machine (`reconcile`; the steps are
//! plain functions in `plan`). This file holds the [`Context`] and the Node watch.
//!
//! The watch: Nodes have no server-side annotation selector and there may be 10,000 of them, so
//! the controller watches Node metadata only ([`NodeMeta`]: the API server sends
//! `PartialObjectMetadata`) and keeps of each only the few fields it reads (a few hundred bytes
//! a Node). A Node without the annotation or the finalizer, or whose machine is recorded, is
//! settled from its metadata alone and not even cached ([`Reconciler::keeps`]); only a Node with
//! work to do is cached, and read in full when reconciled.

pub mod plan;
pub mod reconcile;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use std::borrow::Cow;

use k8s_openapi::ClusterResourceScope;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::Resource;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::runtime::watcher;
use nodekeeper_api::names::{ANNOTATION_NODE_CLASS, LABEL_NODE_CLASS, LABEL_NODE_SET};
use serde::Deserialize;

pub use reconcile::{Error, error_policy, reconcile};

use super::Reconciler;
use super::node_network_config::CloudConfig;
use super::node_set::{Memories, Provider, ProviderCalls, ProviderError, provider};
use crate::shared::Shared;

/// What the reconciler needs.
pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    /// The provider of `provider: kwok` classes.
    pub kwok: Arc<dyn Provider>,
    /// The provider of `provider: oci` classes, when this controller has one.
    pub oci: Option<Arc<dyn Provider>>,
    /// Why there is no oci provider (the Event's words).
    pub oci_unavailable: String,
    /// Every provider call, counted.
    pub calls: Arc<ProviderCalls>,
    /// Nodes reconciled at once.
    pub concurrency: u16,
    /// Per node: the failures and the backoff of its machine's creation (lost on restart: the
    /// Node itself says how far it got).
    pub memory: Memories,
    /// Per node name: the UID of the Node `memory` is about ([`Context::meet`]).
    uids: Mutex<HashMap<String, String>>,
}

impl Context {
    /// The controller's context in the running controller-manager; `cloud` (the flags shared
    /// with the NodeNetworkConfig and NodeSet controllers) gives the oci provider.
    pub fn new(shared: &Shared, cloud: &CloudConfig) -> Self {
        Self::for_cluster(shared, cloud, None)
    }

    /// [`Context::new`] with `--cluster-id` (the NodeSet controller's flag; `None`: the
    /// `kube-system` Namespace's UID): a single Node's instance carries this cluster's identity,
    /// which `find_for_node` finds it by after a lost answer.
    pub fn for_cluster(shared: &Shared, cloud: &CloudConfig, cluster_id: Option<&str>) -> Self {
        let mut ctx = Self::with_client(shared.client.clone(), shared.recorder());
        match super::node_set::oci_provider(&shared.client, cloud, cluster_id) {
            Ok(Some(p)) => ctx.oci = Some(p),
            Ok(None) => {}
            Err(message) => {
                ctx.oci_unavailable =
                    format!("the controller's OCI access is misconfigured: {message}");
            }
        }
        ctx
    }

    /// A context on `client` with the kwok provider only (tests add their own).
    pub fn with_client(client: kube::Client, recorder: Recorder) -> Self {
        Self {
            kwok: Arc::new(super::node_set::kwok::KwokProvider::new(client.clone())),
            oci: None,
            oci_unavailable: provider::OCI_NOT_CONFIGURED.into(),
            client,
            recorder,
            calls: Arc::default(),
            concurrency: 8,
            memory: Memories::default(),
            uids: Mutex::default(),
        }
    }

    /// Starts the memory of Node `name` afresh when `uid` is not the Node it is about: a Node
    /// deleted and created again under the name (the watch's deletion reaches no reconcile)
    /// must not inherit the old one's backoff or warnings.
    pub fn meet(&self, name: &str, uid: Option<&str>) {
        let uid = uid.unwrap_or_default();
        let mut uids = self.uids.lock().unwrap_or_else(PoisonError::into_inner);
        if uids.get(name).map(String::as_str) != Some(uid) {
            self.memory.forget(name);
            uids.insert(name.to_owned(), uid.to_owned());
        }
    }

    /// Forgets Node `name`.
    pub fn forget(&self, name: &str) {
        self.memory.forget(name);
        self.uids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
    }

    /// The provider of a class's `spec.provider`.
    pub fn provider(
        &self,
        kind: nodekeeper_api::crd::node_class::Provider,
    ) -> Result<Arc<dyn Provider>, ProviderError> {
        provider::pick(kind, &self.kwok, self.oci.as_ref(), &self.oci_unavailable)
    }
}

/// A Node as this controller caches it: metadata only (the watch asks the API server for
/// `PartialObjectMetadata`), trimmed while it is read to the annotation, the set and class
/// labels, finalizers, deletion timestamp and identity — a few hundred bytes a Node.
#[derive(Clone, Debug, Default)]
pub struct NodeMeta {
    pub metadata: ObjectMeta,
}

impl Resource for NodeMeta {
    type DynamicType = ();
    type Scope = ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Node::kind(&())
    }
    fn group(_: &()) -> Cow<'_, str> {
        Node::group(&())
    }
    fn version(_: &()) -> Cow<'_, str> {
        Node::version(&())
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Node::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
    fn metadata_api() -> bool {
        true
    }
}

impl<'de> Deserialize<'de> for NodeMeta {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut metadata = PartialObjectMeta::<Node>::deserialize(d)?.metadata;
        trim(&mut metadata);
        Ok(Self { metadata })
    }
}

/// Keeps of a Node's metadata what the controller reads.
fn trim(m: &mut ObjectMeta) {
    m.managed_fields = None;
    m.owner_references = None;
    m.annotations = only(m.annotations.take(), &[ANNOTATION_NODE_CLASS]);
    m.labels = only(m.labels.take(), &[LABEL_NODE_CLASS, LABEL_NODE_SET]);
}

/// The entries of `map` under `keys`, `None` when there are none. Built anew rather than
/// `retain`ed: a `BTreeMap` emptied in place keeps its node allocated (544 bytes for
/// `String` keys and values), and nearly every Node keeps none of its labels and annotations
/// — two such nodes per Node were about 10 MiB of this cache at 10,000 Nodes.
fn only(map: Option<BTreeMap<String, String>>, keys: &[&str]) -> Option<BTreeMap<String, String>> {
    let kept: BTreeMap<_, _> = map?
        .into_iter()
        .filter(|(k, _)| keys.contains(&k.as_str()))
        .collect();
    (!kept.is_empty()).then_some(kept)
}

impl Reconciler for Context {
    type Object = NodeMeta;
    type Error = Error;
    const NAME: &'static str = "kubenode";

    /// Every Node's metadata: Nodes have no server-side annotation selector; the reconcile of a
    /// Node without the annotation or the finalizer ends at once, reading nothing.
    fn api(&self) -> Api<NodeMeta> {
        Api::all(self.client.clone())
    }

    fn watcher_config(&self) -> watcher::Config {
        crate::shared::lists::nodes()
    }

    fn concurrency(&self) -> u16 {
        self.concurrency
    }

    /// Only Nodes with work: the reconcile of a settled Node forgets it and does nothing else,
    /// so a settled Node is forgotten here instead and left out of the cache — on a fleet of
    /// kubelet-registered Nodes the cache then holds none.
    fn keeps(&self, node: &NodeMeta) -> bool {
        let settled = plan::settled(&reconcile::state(&node.metadata, None));
        if settled && let Some(name) = node.metadata.name.as_deref() {
            self.forget(name);
        }
        !settled
    }

    fn reconcile(
        obj: Arc<NodeMeta>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NodeMeta>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt as _;
    use nodekeeper_api::names::FINALIZER_MACHINE;

    #[test]
    fn the_cache_keeps_a_few_fields_of_the_metadata() {
        let body = serde_json::json!({
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": {
                "name": "n1", "resourceVersion": "7", "uid": "u1",
                "finalizers": [FINALIZER_MACHINE],
                "annotations": { ANNOTATION_NODE_CLASS: "small", "big": "x".repeat(4096) },
                "labels": { LABEL_NODE_CLASS: "small", "kubernetes.io/hostname": "n1" },
                "managedFields": [{ "manager": "kubelet", "operation": "Update" }],
            },
        });
        let n: NodeMeta = serde_json::from_value(body).unwrap();
        assert_eq!(n.name_any(), "n1");
        assert_eq!(n.resource_version().as_deref(), Some("7"));
        assert_eq!(n.annotations().len(), 1);
        assert_eq!(n.labels().len(), 1);
        assert!(n.metadata.managed_fields.is_none());
        assert_eq!(n.finalizers(), [FINALIZER_MACHINE]);
        assert!(NodeMeta::metadata_api());

        // A Node with nothing of this controller's keeps no maps at all (see `only`).
        let plain: NodeMeta = serde_json::from_value(serde_json::json!({
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": {
                "name": "n2", "resourceVersion": "8", "uid": "u2",
                "annotations": { "node.alpha.kubernetes.io/ttl": "0" },
                "labels": { "kubernetes.io/hostname": "n2", "kubernetes.io/os": "linux" },
            },
        }))
        .unwrap();
        assert_eq!(plain.metadata.annotations, None);
        assert_eq!(plain.metadata.labels, None);
        assert_eq!(NodeMeta::url_path(&(), None), "/api/v1/nodes");
        assert_eq!(NodeMeta::kind(&()), "Node");
    }

    fn meta(metadata: serde_json::Value) -> NodeMeta {
        let body = serde_json::json!({
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": metadata,
        });
        serde_json::from_value(body).unwrap()
    }

    #[tokio::test]
    async fn only_nodes_with_work_are_cached_and_a_settled_one_is_forgotten() {
        // Never contacted: `keeps` reads the metadata and the memory only.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let recorder = Recorder::new(client.clone(), "test".into());
        let ctx = Context::with_client(client, recorder);
        let class = serde_json::json!({ ANNOTATION_NODE_CLASS: "small" });

        // A Node its kubelet registered: nothing of this controller's, not cached.
        assert!(!ctx.keeps(&meta(serde_json::json!({ "name": "kubelet" }))));
        // Annotated, its machine not made yet: cached.
        let fresh = meta(serde_json::json!({ "name": "fresh", "annotations": class }));
        assert!(ctx.keeps(&fresh));
        // Its machine made and recorded: settled, and its memory (a past failure) forgotten.
        ctx.memory
            .with("fresh", |m| m.last_error = Some("quota".into()));
        let recorded = meta(serde_json::json!({
            "name": "fresh", "annotations": class, "finalizers": [FINALIZER_MACHINE],
            "labels": { LABEL_NODE_CLASS: "small" },
        }));
        assert!(!ctx.keeps(&recorded));
        assert_eq!(ctx.memory.with("fresh", |m| m.last_error.clone()), None);
        // Deleted with its finalizer: the machine is to be removed, cached again.
        let deleting = meta(serde_json::json!({
            "name": "fresh", "annotations": class, "finalizers": [FINALIZER_MACHINE],
            "labels": { LABEL_NODE_CLASS: "small" },
            "deletionTimestamp": "2026-11-24T00:00:00Z",
        }));
        assert!(ctx.keeps(&deleting));
        // A Node deleted and created again under the name starts with no backoff.
        ctx.meet("again", Some("u1"));
        ctx.memory.with("again", |m| m.fail("quota".into()));
        ctx.meet("again", Some("u1"));
        assert!(ctx.memory.with("again", |m| m.backoff_left()).is_some());
        ctx.meet("again", Some("u2"));
        assert_eq!(ctx.memory.with("again", |m| m.backoff_left()), None);
        // A Node of a NodeSet is that controller's.
        let in_set = meta(serde_json::json!({
            "name": "member", "annotations": class, "labels": { LABEL_NODE_SET: "pool" },
        }));
        assert!(!ctx.keeps(&in_set));
    }
}
