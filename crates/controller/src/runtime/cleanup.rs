//! `nodekeeper-controller --cleanup`: removes what nodekeeper put in the cluster, and only that,
//! then exits. Run it as the uninstall Job (`deploy/uninstall/cleanup-job.yaml`) after the
//! controller is stopped and before the namespace and CRDs go.
//!
//! What counts as nodekeeper's, per Node (matching `--node-selector`, default all):
//! - conditions: the four types only nodekeeper writes ([`conditions::OWNED_TYPES`]), and every
//!   other type a `nodekeeper-*` field manager owns in the Node's managedFields (the NPD problem
//!   types, the KEP-5683 maintenance types). A type another manager also owns is left and named.
//! - the maintenance taint, the `nodekeeper.dev/maintained` label and the `cordoned-by` and
//!   `maintenance` annotations of NodeMaintenance; the node gets back the `spec.unschedulable` the
//!   annotation recorded from before the first maintenance (a node someone else had cordoned stays
//!   cordoned; with an unreadable record it is left as it is, and said so).
//! - Nodes a NodeSet created, and Nodes whose machine nodekeeper made from a NodeClass (they
//!   carry the `nodekeeper.dev/machine` finalizer, which only the controller removes, after it
//!   has deleted the machine), are named, not deleted: delete them, and the NodeSets, first.
//!
//! nodekeeper's objects are the user's and stay (deleting the CRDs deletes them), but their
//! finalizers would keep them, and the CRDs, from ever going without a controller: the finalizers
//! of NodeMaintenances (whose nodes are restored above) and NodeDiagnostics (whose bundles lived on
//! the controller's disk) are removed. A NodeNetworkConfig's finalizer is kept and named: it stands
//! for VNICs still attached in OCI, which only the controller detaches (README, "Uninstall", step 1).
//!
//! In `--namespace`: the leader Lease (`--lease-name`) and the three certificate Secrets. A Lease
//! that a running controller still renews stops the cleanup before anything is changed (one left
//! by a killed controller is waited out, one lease duration at most).
//!
//! Every write carries the resourceVersion it was computed from (a conflict re-reads, five times
//! at most), so nothing written meanwhile by someone else is lost. A second run finds nothing and
//! says so: the cleanup is idempotent.
// What it did is its output, read by a person in the Job's log: plain lines on stdout.
#![allow(clippy::print_stdout)]

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::{NodeDiagnostic, NodeMaintenance, NodeNetworkConfig};
use nodekeeper_api::names;
use serde_json::{Value, json};

use crate::certs;
use crate::conditions;
use crate::controllers::node_maintenance::reconcile::FINALIZER as MAINTENANCE_FINALIZER;
use crate::controllers::node_maintenance::record::{MAINTENANCE_TAINT, NodeRecord};
use crate::runtime::leader::Record;

/// Field managers whose names start with this are nodekeeper's.
const MANAGER_PREFIX: &str = "nodekeeper-";
/// Labels and annotations nodekeeper puts on Nodes it did not create.
const NODE_LABELS: [&str; 1] = [names::LABEL_MAINTAINED];
const NODE_ANNOTATIONS: [&str; 2] = [names::ANNOTATION_CORDONED_BY, names::ANNOTATION_MAINTENANCE];
/// Attempts per node when its writes conflict with someone else's.
const ATTEMPTS: usize = 5;

/// Why the cleanup stopped.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error(
        "the controller still holds Lease {namespace}/{name} (holder {holder}, renewed {age_s}s ago, \
         held for {duration_s}s): stop it first with `kubectl -n {namespace} scale \
         deployment/nodekeeper-controller --replicas=0`, then run the cleanup again"
    )]
    ControllerRunning {
        namespace: String,
        name: String,
        holder: String,
        age_s: i64,
        duration_s: i64,
    },
    #[error("list nodes: {0}")]
    ListNodes(#[source] Box<kube::Error>),
    #[error("clean node {node}: {source}")]
    CleanNode {
        node: String,
        source: Box<kube::Error>,
    },
    #[error("clean node {node}: it changed under the cleanup {ATTEMPTS} times; run it again")]
    KeepsChanging { node: String },
    #[error("{action} {what} {namespace}/{name}: {source}")]
    Object {
        action: &'static str,
        what: &'static str,
        namespace: String,
        name: String,
        source: Box<kube::Error>,
    },
}

/// What to change on one Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePlan {
    /// Condition types to remove.
    pub conditions: Vec<String>,
    /// Condition types nodekeeper wrote that another manager also owns: (type, manager), left.
    pub shared_conditions: Vec<(String, String)>,
    pub labels: Vec<String>,
    pub annotations: Vec<String>,
    /// Taint keys to remove.
    pub taints: Vec<String>,
    /// Set `spec.unschedulable` back to false (it was schedulable before nodekeeper cordoned it).
    pub uncordon: bool,
    /// Why a cordoned node is left cordoned, when nodekeeper's record cannot say.
    pub left_cordoned: Option<String>,
    /// The NodeSet that created this Node.
    pub created_by: Option<String>,
    /// The NodeClass of the machine behind this Node, when the Node carries the finalizer that
    /// deletes the machine ([`names::FINALIZER_MACHINE`]); left, like the finalizer: removing it
    /// would leave the machine running and no controller to delete it.
    pub machine_of_class: Option<String>,
}

impl NodePlan {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.conditions.is_empty()
            && self.labels.is_empty()
            && self.annotations.is_empty()
            && self.taints.is_empty()
            && !self.uncordon
    }
}

/// Condition types under `f:status.f:conditions` of the status entries of `managedFields` whose
/// manager `pick` accepts, with the manager's name.
fn condition_owners(
    entries: &[ManagedFieldsEntry],
    pick: impl Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in entries {
        let manager = e.manager.as_deref().unwrap_or_default();
        if !pick(manager) {
            continue;
        }
        let Some(fields) = e.fields_v1.as_ref() else {
            continue;
        };
        let Some(list) = fields
            .0
            .get("f:status")
            .and_then(|s| s.get("f:conditions"))
            .and_then(Value::as_object)
        else {
            continue;
        };
        for key in list.keys() {
            let Some(item) = key.strip_prefix("k:") else {
                continue;
            };
            if let Some(t) = serde_json::from_str::<Value>(item)
                .ok()
                .and_then(|v| v.get("type")?.as_str().map(str::to_owned))
            {
                out.push((t, manager.to_owned()));
            }
        }
    }
    out
}

/// What nodekeeper owns on `node`.
pub fn plan_node(node: &Node) -> NodePlan {
    let mut plan = NodePlan::default();
    let managed = node.metadata.managed_fields.as_deref().unwrap_or_default();
    let ours: BTreeSet<String> = condition_owners(managed, |m| m.starts_with(MANAGER_PREFIX))
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    let others = condition_owners(managed, |m| !m.starts_with(MANAGER_PREFIX));
    let present = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten();
    for c in present {
        let always = conditions::OWNED_TYPES.contains(&c.type_.as_str());
        if !always && !ours.contains(&c.type_) {
            continue;
        }
        match others.iter().find(|(t, _)| *t == c.type_) {
            Some((t, manager)) if !always => {
                plan.shared_conditions.push((t.clone(), manager.clone()));
            }
            _ => plan.conditions.push(c.type_.clone()),
        }
    }
    let meta = &node.metadata;
    let labels = meta.labels.clone().unwrap_or_default();
    let annotations = meta.annotations.clone().unwrap_or_default();
    plan.labels = NODE_LABELS
        .iter()
        .filter(|k| labels.contains_key(**k))
        .map(|k| (*k).to_owned())
        .collect();
    plan.annotations = NODE_ANNOTATIONS
        .iter()
        .filter(|k| annotations.contains_key(**k))
        .map(|k| (*k).to_owned())
        .collect();
    plan.created_by = labels.get(names::LABEL_NODE_SET).cloned();
    if meta
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == names::FINALIZER_MACHINE)
    {
        plan.machine_of_class = Some(
            annotations
                .get(names::ANNOTATION_NODE_CLASS)
                .cloned()
                .unwrap_or_default(),
        );
    }
    let spec = node.spec.clone().unwrap_or_default();
    plan.taints = spec
        .taints
        .unwrap_or_default()
        .iter()
        .filter(|t| t.key == MAINTENANCE_TAINT)
        .map(|t| t.key.clone())
        .collect();
    if spec.unschedulable == Some(true) {
        let record = annotations.get(names::ANNOTATION_MAINTENANCE);
        match (record, NodeRecord::parse(record.map(String::as_str))) {
            (Some(_), Some(r)) => plan.uncordon = !r.prior_unschedulable,
            (Some(_), None) => {
                plan.left_cordoned = Some(format!(
                    "its {} annotation cannot be read, so whether it was cordoned before is \
                     unknown; uncordon it by hand if it should be (`kubectl uncordon`)",
                    names::ANNOTATION_MAINTENANCE
                ));
            }
            (None, _) => {}
        }
    }
    plan
}

/// `/` and `~` escaped for a JSON pointer.
fn pointer(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The JSON patch of the Node object (metadata and spec) for `plan`.
fn object_patch(node: &Node, plan: &NodePlan) -> Vec<Value> {
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    // The resourceVersion makes the patch conditional: a Node changed since it was read fails
    // with 409 and is read again.
    let mut ops = vec![json!({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})];
    for k in &plan.labels {
        ops.push(json!({"op": "remove", "path": format!("/metadata/labels/{}", pointer(k))}));
    }
    for k in &plan.annotations {
        ops.push(json!({"op": "remove", "path": format!("/metadata/annotations/{}", pointer(k))}));
    }
    if !plan.taints.is_empty() {
        let kept: Vec<_> = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|t| !plan.taints.contains(&t.key))
            .collect();
        ops.push(json!({"op": "replace", "path": "/spec/taints", "value": kept}));
    }
    if plan.uncordon {
        ops.push(json!({"op": "replace", "path": "/spec/unschedulable", "value": false}));
    }
    ops
}

/// The JSON patch of the Node's status for `plan` (conditions removed from the last index down).
fn status_patch(node: &Node, plan: &NodePlan) -> Vec<Value> {
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    let mut ops = vec![json!({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})];
    let present = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    for (i, c) in present.iter().enumerate().rev() {
        if plan.conditions.contains(&c.type_) {
            ops.push(json!({"op": "remove", "path": format!("/status/conditions/{i}")}));
        }
    }
    ops
}

/// Counts of what was removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub nodes_seen: usize,
    pub nodes_changed: usize,
    pub conditions: usize,
    pub taints: usize,
    pub labels: usize,
    pub annotations: usize,
    pub uncordoned: usize,
    pub leases: usize,
    pub secrets: usize,
    /// Finalizers removed from nodekeeper's objects.
    pub finalizers: usize,
    /// NodeNetworkConfig finalizers left (VNICs still attached).
    pub kept_finalizers: usize,
}

impl Summary {
    /// Adds the node counts of `other` (one node's cleaning) to these.
    fn add_nodes(&mut self, other: &Summary) {
        self.nodes_changed += other.nodes_changed;
        self.conditions += other.conditions;
        self.taints += other.taints;
        self.labels += other.labels;
        self.annotations += other.annotations;
        self.uncordoned += other.uncordoned;
    }

    /// Whether the run removed anything.
    pub fn changed_anything(&self) -> bool {
        self.nodes_changed + self.leases + self.secrets + self.finalizers > 0
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.changed_anything() && self.kept_finalizers == 0 {
            return write!(
                f,
                "cleanup done: nothing of nodekeeper's left ({} nodes checked)",
                self.nodes_seen
            );
        }
        write!(
            f,
            "cleanup done: {} of {} nodes changed ({} conditions, {} taints, {} labels, {} \
             annotations removed; {} uncordoned); {} finalizers removed; {} Lease and {} \
             Secrets deleted",
            self.nodes_changed,
            self.nodes_seen,
            self.conditions,
            self.taints,
            self.labels,
            self.annotations,
            self.uncordoned,
            self.finalizers,
            self.leases,
            self.secrets
        )?;
        if self.kept_finalizers > 0 {
            write!(
                f,
                "; {} NodeNetworkConfig finalizers kept (VNICs still attached)",
                self.kept_finalizers
            )?;
        }
        Ok(())
    }
}

/// Where the cleanup works.
#[derive(Clone, Debug)]
pub struct Scope {
    pub namespace: String,
    pub lease_name: String,
    pub node_selector: Option<String>,
}

/// Runs the cleanup, printing each change and the summary on stdout.
pub async fn run(client: &kube::Client, scope: &Scope) -> Result<Summary, CleanupError> {
    let mut summary = Summary::default();
    let leases: Api<Lease> = Api::namespaced(client.clone(), &scope.namespace);
    let lease = leases
        .get_opt(&scope.lease_name)
        .await
        .map_err(|source| CleanupError::Object {
            action: "read",
            what: "Lease",
            namespace: scope.namespace.clone(),
            name: scope.lease_name.clone(),
            source: Box::new(source),
        })?;
    if let Some(lease) = &lease {
        refuse_if_held(&leases, lease, scope).await?;
    }
    let selector = scope.node_selector.as_deref().filter(|s| !s.is_empty());
    println!(
        "cleaning up nodekeeper: nodes {}, namespace {}",
        selector.map_or("all".to_owned(), |s| format!("matching {s}")),
        scope.namespace
    );

    let nodes: Api<Node> = Api::all(client.clone());
    clean_nodes(&nodes, selector, NODE_PAGE, &mut summary).await?;

    release_objects(client, &mut summary).await?;

    if lease.is_some() {
        delete(&leases, "Lease", &scope.namespace, &scope.lease_name).await?;
        println!("deleted Lease {}/{}", scope.namespace, scope.lease_name);
        summary.leases += 1;
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &scope.namespace);
    for name in [
        certs::CA_SECRET,
        certs::AGENT_SECRET,
        certs::CONTROLLER_SECRET,
    ] {
        let found = secrets
            .get_opt(name)
            .await
            .map_err(|source| CleanupError::Object {
                action: "read",
                what: "Secret",
                namespace: scope.namespace.clone(),
                name: name.to_owned(),
                source: Box::new(source),
            })?;
        if found.is_some() {
            delete(&secrets, "Secret", &scope.namespace, name).await?;
            println!("deleted Secret {}/{name}", scope.namespace);
            summary.secrets += 1;
        }
    }
    println!("{summary}");
    Ok(summary)
}

/// Nodes per page of the Node list. The uninstall Job runs in 128Mi
/// (`deploy/uninstall/cleanup-job.yaml`): one list of every Node of a large cluster (tens of
/// kilobytes each, 65,000 of them) would not fit, a page does.
const NODE_PAGE: u32 = 250;
/// Nodes cleaned at once.
const CLEAN_CONCURRENCY: usize = 8;

/// Whether [`clean_node`] has anything to do or say about a Node with this plan.
fn worth_a_visit(plan: &NodePlan) -> bool {
    !plan.is_empty()
        || plan.created_by.is_some()
        || plan.machine_of_class.is_some()
        || plan.left_cordoned.is_some()
        || !plan.shared_conditions.is_empty()
}

/// Cleans the Nodes matching `selector`: lists them in pages of `page`, keeping only the names
/// of those with something to remove or report (the pages themselves are dropped as they are
/// planned, and read quickly enough that the list's continue token does not expire), then reads
/// and cleans each of those, [`CLEAN_CONCURRENCY`] at a time.
async fn clean_nodes(
    nodes: &Api<Node>,
    selector: Option<&str>,
    page: u32,
    summary: &mut Summary,
) -> Result<(), CleanupError> {
    use futures::StreamExt as _;
    let mut dirty: Vec<String> = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let mut params = ListParams::default().limit(page);
        if let Some(selector) = selector {
            params = params.labels(selector);
        }
        if let Some(token) = &next {
            params = params.continue_token(token);
        }
        let list = nodes
            .list(&params)
            .await
            .map_err(|e| CleanupError::ListNodes(Box::new(e)))?;
        summary.nodes_seen += list.items.len();
        dirty.extend(
            list.items
                .iter()
                .filter(|node| worth_a_visit(&plan_node(node)))
                .map(|node| node.name_any()),
        );
        next = list.metadata.continue_.filter(|t| !t.is_empty());
        if next.is_none() {
            break;
        }
    }
    let mut cleaned = futures::stream::iter(dirty)
        .map(|name| async move {
            let mut one = Summary::default();
            let node = nodes
                .get_opt(&name)
                .await
                .map_err(|source| CleanupError::CleanNode {
                    node: name.clone(),
                    source: Box::new(source),
                })?;
            // Deleted since the list: nothing left to clean.
            if let Some(node) = node {
                clean_node(nodes, node, &mut one).await?;
            }
            Ok::<_, CleanupError>(one)
        })
        .buffer_unordered(CLEAN_CONCURRENCY);
    while let Some(one) = cleaned.next().await {
        summary.add_nodes(&one?);
    }
    Ok(())
}

/// Removes the finalizers of NodeMaintenances and NodeDiagnostics, and names the
/// NodeNetworkConfigs whose finalizer stays.
async fn release_objects(client: &kube::Client, summary: &mut Summary) -> Result<(), CleanupError> {
    let maintenances: Api<NodeMaintenance> = Api::all(client.clone());
    let diagnostics: Api<NodeDiagnostic> = Api::all(client.clone());
    let configs: Api<NodeNetworkConfig> = Api::all(client.clone());
    for object in list_or_none(&maintenances, "NodeMaintenance").await? {
        let api = maintenances.clone();
        drop_finalizer(
            &api,
            &object,
            MAINTENANCE_FINALIZER,
            "NodeMaintenance",
            summary,
        )
        .await?;
    }
    for object in list_or_none(&diagnostics, "NodeDiagnostic").await? {
        let ns = object.namespace().unwrap_or_default();
        let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);
        drop_finalizer(
            &api,
            &object,
            names::FINALIZER_DIAGNOSTIC_BUNDLES,
            "NodeDiagnostic",
            summary,
        )
        .await?;
    }
    for object in list_or_none(&configs, "NodeNetworkConfig").await? {
        if object
            .finalizers()
            .iter()
            .any(|f| f == names::FINALIZER_NODE_NETWORK_CONFIG)
        {
            println!(
                "NodeNetworkConfig {}: finalizer {} kept: the VNICs it attached are still \
                 attached; start the controller and delete it, then run the cleanup again",
                object.name_any(),
                names::FINALIZER_NODE_NETWORK_CONFIG
            );
            summary.kept_finalizers += 1;
        }
    }
    Ok(())
}

/// Every object of `api`; none when its CRD is not installed.
async fn list_or_none<K>(api: &Api<K>, what: &'static str) -> Result<Vec<K>, CleanupError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list(&ListParams::default()).await {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Vec::new()),
        Err(source) => Err(CleanupError::Object {
            action: "list",
            what,
            namespace: String::new(),
            name: "*".into(),
            source: Box::new(source),
        }),
    }
}

/// Removes `finalizer` from `object` (a JSON patch conditional on its resourceVersion; a
/// conflict leaves it for the next run, which the error says).
async fn drop_finalizer<K>(
    api: &Api<K>,
    object: &K,
    finalizer: &str,
    what: &'static str,
    summary: &mut Summary,
) -> Result<(), CleanupError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let finalizers = object.meta().finalizers.clone().unwrap_or_default();
    if !finalizers.iter().any(|f| f == finalizer) {
        return Ok(());
    }
    let kept: Vec<&String> = finalizers.iter().filter(|f| *f != finalizer).collect();
    let ops = json!([
        {"op": "replace", "path": "/metadata/resourceVersion",
         "value": object.meta().resource_version.clone().unwrap_or_default()},
        {"op": "replace", "path": "/metadata/finalizers", "value": kept},
    ]);
    let patch = Patch::<()>::Json(serde_json::from_value(ops).expect("a JSON patch"));
    let name = object.meta().name.clone().unwrap_or_default();
    api.patch(&name, &PatchParams::default(), &patch)
        .await
        .map_err(|source| CleanupError::Object {
            action: "remove the finalizer of",
            what,
            namespace: object.meta().namespace.clone().unwrap_or_default(),
            name: name.clone(),
            source: Box::new(source),
        })?;
    println!("{what} {name}: removed finalizer {finalizer}");
    summary.finalizers += 1;
    Ok(())
}

/// Refuses while a controller renews the Lease: it would re-create what the cleanup removes.
/// Whenever the Lease names a holder it is read again after its duration, and only a changed
/// record (a renewal, judged as the standby judges it) refuses. The renew time is not compared
/// with this host's clock: a controller whose clock is behind (or this one's ahead) would look
/// expired while it still renews.
async fn refuse_if_held(
    leases: &Api<Lease>,
    lease: &Lease,
    scope: &Scope,
) -> Result<(), CleanupError> {
    let Some(wait) = watch_for(lease) else {
        return Ok(());
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let duration_s = i64::from(spec.lease_duration_seconds.unwrap_or(0));
    // Only for the message: how old the renewal looks from here.
    let age_s = spec.renew_time.map_or(-1, |t| {
        k8s_openapi::jiff::Timestamp::now()
            .duration_since(t.0)
            .as_secs()
    });
    println!(
        "Lease {}/{} is held by {holder} (renewed {age_s}s ago by this host's clock); waiting \
         {duration_s}s to see whether a controller still renews it",
        scope.namespace, scope.lease_name
    );
    tokio::time::sleep(wait).await;
    let again = leases
        .get_opt(&scope.lease_name)
        .await
        .map_err(|source| CleanupError::Object {
            action: "read",
            what: "Lease",
            namespace: scope.namespace.clone(),
            name: scope.lease_name.clone(),
            source: Box::new(source),
        })?;
    let renewed_since = again.as_ref().is_some_and(|a| {
        let now = Record::of(a);
        !now.holder.is_empty() && now != Record::of(lease)
    });
    if !renewed_since {
        return Ok(());
    }
    Err(CleanupError::ControllerRunning {
        namespace: scope.namespace.clone(),
        name: scope.lease_name.clone(),
        holder,
        age_s,
        duration_s,
    })
}

/// How long to watch `lease` for a renewal before the cleanup may go on: its duration (and a
/// second) when it names a holder, whatever its renew time says; `None` when it names none.
fn watch_for(lease: &Lease) -> Option<Duration> {
    let spec = lease.spec.as_ref()?;
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder.is_empty() {
        return None;
    }
    let duration = u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0);
    Some(Duration::from_secs(duration + 1))
}

async fn delete<K>(
    api: &Api<K>,
    what: &'static str,
    namespace: &str,
    name: &str,
) -> Result<(), CleanupError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        // Gone meanwhile: what the cleanup wanted.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(CleanupError::Object {
            action: "delete",
            what,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            source: Box::new(source),
        }),
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Cleans one Node: its object (labels, annotations, taint, cordon), then its status.
async fn clean_node(
    nodes: &Api<Node>,
    mut node: Node,
    summary: &mut Summary,
) -> Result<(), CleanupError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let failed = |source| CleanupError::CleanNode {
        node: name.clone(),
        source: Box::new(source),
    };
    let mut changed = false;
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            node = nodes.get(&name).await.map_err(failed)?;
        }
        let plan = plan_node(&node);
        if attempt == 0 {
            if let Some(set) = &plan.created_by {
                println!(
                    "node {name}: created by NodeSet {set}; left in place (delete the NodeSets \
                     before uninstalling)"
                );
            } else if let Some(class) = &plan.machine_of_class {
                println!(
                    "node {name}: its machine was made from NodeClass {class:?} and the finalizer \
                     {} stays until the controller deletes it; left in place (with the controller \
                     running, `kubectl delete node {name}` deletes the machine, then the Node)",
                    names::FINALIZER_MACHINE
                );
            }
            if let Some(why) = &plan.left_cordoned {
                println!("node {name}: left cordoned: {why}");
            }
            for (t, manager) in &plan.shared_conditions {
                println!("node {name}: condition {t} left: field manager {manager} writes it too");
            }
        }
        if plan.is_empty() {
            if changed {
                summary.nodes_changed += 1;
            }
            return Ok(());
        }
        let object = !(plan.labels.is_empty()
            && plan.annotations.is_empty()
            && plan.taints.is_empty()
            && !plan.uncordon);
        if object {
            let patch = Patch::<()>::Json(
                serde_json::from_value(Value::Array(object_patch(&node, &plan)))
                    .expect("a JSON patch"),
            );
            match nodes.patch(&name, &PatchParams::default(), &patch).await {
                Ok(n) => node = n,
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(failed(e)),
            }
            changed = true;
            summary.labels += plan.labels.len();
            summary.annotations += plan.annotations.len();
            summary.taints += plan.taints.len();
            summary.uncordoned += usize::from(plan.uncordon);
            let mut what: Vec<String> = Vec::new();
            what.extend(plan.labels.iter().map(|k| format!("label {k}")));
            what.extend(plan.annotations.iter().map(|k| format!("annotation {k}")));
            what.extend(plan.taints.iter().map(|k| format!("taint {k}")));
            if plan.uncordon {
                what.push("cordon (it was schedulable before nodekeeper)".into());
            }
            println!("node {name}: removed {}", what.join(", "));
        }
        if !plan.conditions.is_empty() {
            let patch = Patch::<()>::Json(
                serde_json::from_value(Value::Array(status_patch(&node, &plan)))
                    .expect("a JSON patch"),
            );
            match nodes
                .patch_status(&name, &PatchParams::default(), &patch)
                .await
            {
                Ok(_) => {}
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(failed(e)),
            }
            summary.conditions += plan.conditions.len();
            println!(
                "node {name}: removed conditions {}",
                plan.conditions.join(", ")
            );
        }
        summary.nodes_changed += 1;
        return Ok(());
    }
    Err(CleanupError::KeepsChanging { node: name })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn node(value: Value) -> Node {
        serde_json::from_value(value).unwrap()
    }

    fn entry(manager: &str, types: &[&str]) -> Value {
        let conditions: serde_json::Map<String, Value> = types
            .iter()
            .map(|t| (format!("k:{{\"type\":\"{t}\"}}"), json!({"f:status": {}})))
            .collect();
        json!({"manager": manager, "operation": "Apply", "subresource": "status",
               "apiVersion": "v1", "fieldsType": "FieldsV1",
               "fieldsV1": {"f:status": {"f:conditions": conditions}}})
    }

    fn cond(t: &str) -> Value {
        json!({"type": t, "status": "True"})
    }

    #[test]
    fn a_lease_with_a_holder_is_watched_whatever_its_renew_time_says() {
        let lease = |holder: Option<&str>, renewed_s_ago: i64| -> Lease {
            let renewed = k8s_openapi::jiff::Timestamp::now()
                - k8s_openapi::jiff::SignedDuration::from_secs(renewed_s_ago);
            serde_json::from_value(json!({
                "metadata": {"name": "nodekeeper-controller"},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                         "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()},
            }))
            .unwrap()
        };
        let wait = Some(Duration::from_secs(16));
        assert_eq!(watch_for(&lease(Some("c-0"), 5)), wait);
        // An hour old by this clock: the controller's clock may be an hour behind while it
        // still renews; only a second look tells.
        assert_eq!(watch_for(&lease(Some("c-0"), 3600)), wait);
        assert_eq!(watch_for(&lease(Some("c-0"), -3600)), wait);
        assert_eq!(watch_for(&lease(None, 5)), None);
        assert_eq!(watch_for(&lease(Some(""), 5)), None);
    }

    /// A stand-in for the API server's Node endpoints: `nodes` served in pages of the `limit`
    /// asked (the continue token is the index of the next), each read and patch answered with
    /// the node; every request's path and query recorded.
    async fn fake_node_api(nodes: Vec<Value>) -> (kube::Client, Arc<Mutex<Vec<String>>>) {
        use axum::extract::{Path, RawQuery, State};
        use axum::routing::get;
        type Served = (Vec<Value>, Arc<Mutex<Vec<String>>>);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let state: Served = (nodes, Arc::clone(&seen));
        async fn list(
            State((nodes, seen)): State<Served>,
            RawQuery(q): RawQuery,
        ) -> axum::Json<Value> {
            let q = q.unwrap_or_default();
            seen.lock().unwrap().push(format!("list {q}"));
            let param = |k: &str| {
                q.split('&')
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                    .map(str::to_owned)
            };
            let limit = param("limit").map_or(nodes.len(), |l| l.parse().unwrap());
            let from: usize = param("continue").map_or(0, |c| c.parse().unwrap());
            let to = (from + limit).min(nodes.len());
            let next = if to < nodes.len() {
                to.to_string()
            } else {
                String::new()
            };
            axum::Json(json!({"apiVersion": "v1", "kind": "NodeList",
                              "metadata": {"resourceVersion": "1", "continue": next},
                              "items": nodes[from..to]}))
        }
        async fn one(
            State((nodes, seen)): State<Served>,
            Path(name): Path<String>,
            method: axum::http::Method,
        ) -> axum::Json<Value> {
            seen.lock().unwrap().push(format!("{method} {name}"));
            let node = nodes
                .iter()
                .find(|n| n["metadata"]["name"] == name.as_str())
                .unwrap();
            axum::Json(node.clone())
        }
        let router = axum::Router::new()
            .route("/api/v1/nodes", get(list))
            .route("/api/v1/nodes/{name}", get(one).patch(one))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        (kube::Client::try_from(config).unwrap(), seen)
    }

    #[tokio::test]
    async fn nodes_are_listed_in_pages_and_only_those_to_clean_are_read() {
        let nodes: Vec<Value> = (0..7)
            .map(|i| {
                let mut labels = json!({"kubernetes.io/hostname": format!("n{i}")});
                if i % 3 == 0 {
                    labels[names::LABEL_MAINTAINED] = json!("true");
                }
                json!({"apiVersion": "v1", "kind": "Node",
                       "metadata": {"name": format!("n{i}"), "resourceVersion": "1", "labels": labels}})
            })
            .collect();
        let (client, seen) = fake_node_api(nodes).await;
        let mut summary = Summary::default();
        clean_nodes(&Api::all(client), None, 2, &mut summary)
            .await
            .unwrap();
        let seen = seen.lock().unwrap().clone();
        let lists: Vec<&String> = seen.iter().filter(|r| r.starts_with("list")).collect();
        assert_eq!(lists.len(), 4, "7 nodes in pages of 2: {seen:?}");
        assert!(lists.iter().all(|q| q.contains("limit=2")), "{seen:?}");
        let mut reads: Vec<&String> = seen.iter().filter(|r| r.starts_with("GET")).collect();
        reads.sort();
        assert_eq!(reads, ["GET n0", "GET n3", "GET n6"], "{seen:?}");
        assert_eq!(seen.iter().filter(|r| r.starts_with("PATCH")).count(), 3);
        assert_eq!(
            (summary.nodes_seen, summary.nodes_changed, summary.labels),
            (7, 3, 3)
        );
    }

    #[test]
    fn plans_only_what_nodekeeper_owns() {
        let record = json!({"priorUnschedulable": false, "holders": {}}).to_string();
        let n = node(json!({
            "metadata": {"name": "n1", "resourceVersion": "7",
                "labels": {"nodekeeper.dev/maintained": "true", "team": "a",
                           "nodekeeper.dev/e2e-group": "g"},
                "annotations": {"nodekeeper.dev/maintenance": record,
                                "nodekeeper.dev/cordoned-by": "m1", "other": "x"},
                "managedFields": [
                    entry("nodekeeper-nodeconditions", &["KernelDeadlock", "NTPProblem"]),
                    entry("nodekeeper-nodemaintenance", &["MaintenanceInProgress"]),
                    entry("node-problem-detector", &["NTPProblem"]),
                    entry("kubelet", &["Ready"]),
                ]},
            "spec": {"unschedulable": true, "taints": [
                {"key": "nodekeeper.dev/maintenance", "effect": "NoSchedule"},
                {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]},
            "status": {"conditions": [cond("Ready"), cond("NodekeeperReachable"),
                cond("KernelDeadlock"), cond("NTPProblem"), cond("MaintenanceInProgress"),
                cond("FrequentKubeletRestart")]},
        }));
        let plan = plan_node(&n);
        assert_eq!(
            plan.conditions,
            [
                "NodekeeperReachable",
                "KernelDeadlock",
                "MaintenanceInProgress"
            ]
        );
        assert_eq!(
            plan.shared_conditions,
            [("NTPProblem".to_owned(), "node-problem-detector".to_owned())]
        );
        assert_eq!(plan.labels, ["nodekeeper.dev/maintained"]);
        assert_eq!(
            plan.annotations,
            ["nodekeeper.dev/cordoned-by", "nodekeeper.dev/maintenance"]
        );
        assert_eq!(plan.taints, ["nodekeeper.dev/maintenance"]);
        assert!(plan.uncordon);

        let ops = object_patch(&n, &plan);
        assert_eq!(ops[0]["value"], "7");
        assert!(
            ops.iter()
                .any(|o| o["path"] == "/metadata/labels/nodekeeper.dev~1maintained")
        );
        let taints = ops.iter().find(|o| o["path"] == "/spec/taints").unwrap();
        assert_eq!(taints["value"].as_array().unwrap().len(), 1);
        assert_eq!(taints["value"][0]["key"], "dedicated");
        let status = status_patch(&n, &plan);
        let paths: Vec<&str> = status[1..]
            .iter()
            .map(|o| o["path"].as_str().unwrap())
            .collect();
        // Last index first, so earlier indices stay valid.
        assert_eq!(
            paths,
            [
                "/status/conditions/4",
                "/status/conditions/2",
                "/status/conditions/1"
            ]
        );
    }

    #[test]
    fn a_node_cordoned_before_nodekeeper_stays_cordoned() {
        let before = json!({"priorUnschedulable": true, "holders": {}}).to_string();
        let n = node(json!({
            "metadata": {"name": "n", "annotations": {"nodekeeper.dev/maintenance": before}},
            "spec": {"unschedulable": true}}));
        let plan = plan_node(&n);
        assert!(!plan.uncordon);
        assert_eq!(plan.annotations, ["nodekeeper.dev/maintenance"]);

        let unreadable = node(json!({
            "metadata": {"name": "n", "annotations": {"nodekeeper.dev/maintenance": "{"}},
            "spec": {"unschedulable": true}}));
        let plan = plan_node(&unreadable);
        assert!(!plan.uncordon);
        assert!(plan.left_cordoned.unwrap().contains("uncordon it by hand"));
    }

    #[test]
    fn a_clean_node_has_an_empty_plan() {
        let n = node(json!({
            "metadata": {"name": "n", "labels": {"nodekeeper.dev/nodeset": "pool"},
                "managedFields": [entry("kubelet", &["Ready"])]},
            "status": {"conditions": [cond("Ready")]}}));
        let plan = plan_node(&n);
        assert!(plan.is_empty());
        assert_eq!(plan.created_by.as_deref(), Some("pool"));
        assert_eq!(plan.machine_of_class, None);
    }

    #[test]
    fn a_node_whose_machine_nodekeeper_made_is_named_and_keeps_its_finalizer() {
        let n = node(json!({
            "metadata": {"name": "n",
                "annotations": {"nodekeeper.dev/node-class": "gpu"},
                "finalizers": ["nodekeeper.dev/machine"]}}));
        let plan = plan_node(&n);
        assert!(plan.is_empty(), "{plan:?}");
        assert_eq!(plan.machine_of_class.as_deref(), Some("gpu"));
        // The annotation alone (a Node the controller never took on) is not a machine of ours.
        let n = node(json!({
            "metadata": {"name": "n", "annotations": {"nodekeeper.dev/node-class": "gpu"}}}));
        assert_eq!(plan_node(&n).machine_of_class, None);
    }
}
