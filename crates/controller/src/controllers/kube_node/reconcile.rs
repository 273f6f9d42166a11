//! One kube-node reconcile: settle from the cached metadata when nothing is to be done;
//! otherwise read the Node and take the next step — make its machine (the record checked as the
//! API server will check it, the finalizer, a look for a machine launched for it before, the
//! provider's create, then one write recording the providerID and the class's labels), or, once
//! it is deleted, drain it through a NodeMaintenance, delete the machine until it is gone, delete
//! the NodeMaintenance and remove the finalizer (a machine launched but never recorded is looked
//! for and deleted first). Everything is rebuilt from the Node, its NodeMaintenance and the
//! provider's tags, so a restart or a lost answer at any point resumes without a second machine.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, Resource as _, ResourceExt as _};
use nodekeeper_api::crd::common::{FieldError, format_field_errors};
use nodekeeper_api::crd::node_class::{self, NodeClassSpec};
use nodekeeper_api::crd::node_set::ScaleDown;
use nodekeeper_api::crd::{NodeClass, NodeMaintenance};
use nodekeeper_api::names::{
    ANNOTATION_NODE_CLASS, FINALIZER_MACHINE, LABEL_NODE_CLASS, LABEL_NODE_SET, MANAGER_KUBE_NODE,
    REASON_INVALID_SPEC,
};
use serde_json::json;
use tracing::{info, warn};

use super::Context;
use super::plan::{self, Drain, NodeState, Removal, Step};
use crate::controllers::node_set::reconcile::{
    DrainOrder, delete_maintenance, leaving_of, publish_event, start_drain,
};
use crate::controllers::node_set::{Deletion, Machine, MachineRequest, Provider, kwok, oci};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("read node {name}: {source}")]
    ReadNode { name: String, source: kube::Error },
    #[error("read nodeclass {name}: {source}")]
    ReadClass { name: String, source: kube::Error },
    #[error("write node {name}: {source}")]
    WriteNode { name: String, source: kube::Error },
    #[error("read nodemaintenance {name}: {source}")]
    ReadMaintenance { name: String, source: kube::Error },
    #[error(transparent)]
    Drain(#[from] crate::controllers::node_set::Error),
}

pub fn error_policy(node: Arc<super::NodeMeta>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, node = %node.name_any(), "kubenode reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

/// Event reasons on the Node.
pub const REASON_NODE_CLASS_NOT_FOUND: &str = "NodeClassNotFound";
pub const REASON_PROVIDER_FAILED: &str = "ProviderFailed";
pub const REASON_FOREIGN_MACHINE: &str = "MachineAlreadyNamed";
pub const REASON_DRAIN_STUCK: &str = "DrainStuck";
pub const REASON_MACHINE_CREATED: &str = "MachineCreated";
pub const REASON_MACHINE_DELETED: &str = "MachineDeleted";
pub const REASON_MACHINE_DELETE_FAILED: &str = "MachineDeleteFailed";
pub const REASON_NODE_REGISTERED: &str = "NodeAlreadyRegistered";
pub const REASON_CLASS_CHANGED: &str = "ClassChanged";
pub const REASON_RECORD_REFUSED: &str = "NodeRecordRefused";

/// How often a draining node is looked at again (no watch wakes it).
const RECHECK: Duration = Duration::from_secs(2);
/// How often a machine whose termination is under way is looked at again: each look costs a
/// provider read and a Node read, and a termination takes tens of seconds.
const TERMINATING_RECHECK: Duration = Duration::from_secs(10);
/// How often a removal waiting on the controller's own configuration (no OCI provider) looks
/// again.
const UNAVAILABLE_RECHECK: Duration = Duration::from_secs(60);

pub(super) fn state<'a>(
    meta: &'a kube::api::ObjectMeta,
    provider_id: Option<&'a str>,
) -> NodeState<'a> {
    let class = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_NODE_CLASS))
        .map(String::as_str);
    let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k));
    let class_label = label(LABEL_NODE_CLASS).map(String::as_str);
    NodeState {
        class,
        in_set: label(LABEL_NODE_SET).is_some(),
        finalizer: meta
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == FINALIZER_MACHINE)),
        deleting: meta.deletion_timestamp.is_some(),
        recorded: class.is_some() && class_label == class,
        other_class: class_label.filter(|l| class.is_some_and(|c| c != *l)),
        registered: false,
        provider_id,
    }
}

/// Whether a kubelet registered `node`: it reported its version, or Ready. Not a Ready
/// heartbeat alone: kube-controller-manager gives a Node no kubelet ever updated
/// `Ready=Unknown` (`NodeStatusNeverUpdated`) with the Node's creation as its heartbeat.
fn registered(node: &Node) -> bool {
    let Some(status) = node.status.as_ref() else {
        return false;
    };
    let version = status
        .node_info
        .as_ref()
        .is_some_and(|i| !i.kubelet_version.is_empty());
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    version || ready
}

async fn publish(ctx: &Context, node: &Node, type_: EventType, reason: &str, note: String) {
    publish_event(&ctx.recorder, node, type_, reason, note).await;
}

/// A Warning Event, published once per message for a Node (the Node's status updates wake its
/// reconcile again and again; the same warning is not written each time).
async fn warn_once(ctx: &Context, node: &Node, reason: &str, note: String) {
    let name = node.name_any();
    let new = ctx.memory.with(&name, |m| {
        let new = m.last_error.as_deref() != Some(note.as_str());
        m.last_error = Some(note.clone());
        new
    });
    if new {
        publish(ctx, node, EventType::Warning, reason, note).await;
    }
}

pub async fn reconcile(obj: Arc<super::NodeMeta>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = obj.name_any();
    let seen = state(&obj.metadata, None);
    if plan::settled(&seen) {
        ctx.forget(&name);
        return Ok(Action::await_change());
    }
    // A Node deleted and made again under the name starts with no backoff or warning.
    ctx.meet(&name, obj.metadata.uid.as_deref());
    // A Node's status updates wake it too: while its machine's creation backs off, not even
    // the Node is read.
    if !seen.deleting
        && let Some(wait) = ctx.memory.with(&name, |m| m.backoff_left())
    {
        return Ok(Action::requeue(wait));
    }
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let Some(node) = nodes
        .get_opt(&name)
        .await
        .map_err(|source| Error::ReadNode {
            name: name.clone(),
            source,
        })?
    else {
        ctx.forget(&name);
        return Ok(Action::await_change());
    };
    let provider_id = node.spec.as_ref().and_then(|s| s.provider_id.as_deref());
    let s = NodeState {
        registered: registered(&node),
        ..state(&node.metadata, provider_id)
    };
    match plan::step(&s) {
        Step::Nothing => Ok(Action::await_change()),
        Step::Foreign => {
            let note = format!(
                "node {name}: metadata.annotations[{ANNOTATION_NODE_CLASS}] asks for a machine, but spec.providerID is {} already; nothing is created. Create the Node without spec.providerID, or remove the annotation",
                provider_id.unwrap_or_default()
            );
            warn_once(&ctx, &node, REASON_FOREIGN_MACHINE, note).await;
            Ok(Action::await_change())
        }
        Step::Registered => {
            let note = format!(
                "node {name}: metadata.annotations[{ANNOTATION_NODE_CLASS}] asks for a machine, but a kubelet registered this Node already (status.nodeInfo); nothing is created. Remove the annotation, or create a new Node with it"
            );
            warn_once(&ctx, &node, REASON_NODE_REGISTERED, note).await;
            Ok(Action::await_change())
        }
        Step::ClassChanged => {
            let note = format!(
                "node {name}: metadata.annotations[{ANNOTATION_NODE_CLASS}] is {:?}, but its machine {} was made from NodeClass {:?} (label {LABEL_NODE_CLASS}); a machine is not changed in place and nothing is written. Delete the Node and create it again to get a machine of the new class, or set the annotation back",
                s.class.unwrap_or_default(),
                provider_id.unwrap_or_default(),
                s.other_class.unwrap_or_default(),
            );
            warn_once(&ctx, &node, REASON_CLASS_CHANGED, note).await;
            Ok(Action::await_change())
        }
        Step::Make | Step::Record => make(&ctx, &nodes, &node, s.class.unwrap_or_default()).await,
        Step::Release => release(&ctx, &nodes, &node, s.class).await,
        Step::Remove => remove(&ctx, &nodes, &node, provider_id.unwrap_or_default()).await,
    }
}

/// Gets the Node its machine: the class, the finalizer, the provider's create (an OCI machine
/// made before a restart is found by its tag first), then the record.
async fn make(
    ctx: &Context,
    nodes: &Api<Node>,
    node: &Node,
    class_name: &str,
) -> Result<Action, Error> {
    let name = node.name_any();
    let class = read_class(ctx, class_name).await?;
    let Some(class) = class else {
        let note = format!(
            "node {name}: metadata.annotations[{ANNOTATION_NODE_CLASS}]: NodeClass {class_name:?} does not exist; create it, or name an existing NodeClass. No machine is made until then"
        );
        return Ok(refuse(ctx, node, REASON_NODE_CLASS_NOT_FOUND, note).await);
    };
    // The record as the API server will check it, before the finalizer and the machine: a
    // record it refuses would leave a machine no Node names.
    let errors = record_errors(node, class_name, &class.spec);
    if !errors.is_empty() {
        let note = format!(
            "node {name}: {}; no machine is made until then",
            format_field_errors(&errors)
        );
        return Ok(refuse(ctx, node, REASON_INVALID_SPEC, note).await);
    }
    let provider = match ctx.provider(class.spec.provider) {
        Ok(p) => p,
        Err(error) => {
            let note = format!(
                "node {name}: metadata.annotations[{ANNOTATION_NODE_CLASS}]: NodeClass {class_name}: {error}"
            );
            return Ok(refuse(ctx, node, REASON_PROVIDER_FAILED, note).await);
        }
    };

    // The finalizer first: from here on, deleting the Node deletes the machine.
    let mut provider_id = node.spec.as_ref().and_then(|s| s.provider_id.clone());
    if provider_id.is_none() {
        apply(
            nodes,
            node,
            json!({ "metadata": { "name": name, "finalizers": [FINALIZER_MACHINE] } }),
        )
        .await?;
        let request = request(&name, class_name, &class.spec);
        let machine = match find_made(ctx, &provider, &name, &class.spec).await {
            Ok(Some(m)) => Ok(m),
            Ok(None) => provider.create(&request).await,
            Err(e) => Err(e),
        };
        match machine {
            Ok(m) => {
                ctx.calls.create_ok.fetch_add(1, Ordering::Relaxed);
                info!(node = %name, provider_id = %m.provider_id, provider = provider.kind(), "machine made for node");
                publish(
                    ctx,
                    node,
                    EventType::Normal,
                    REASON_MACHINE_CREATED,
                    format!("machine {} from NodeClass {class_name}", m.provider_id),
                )
                .await;
                provider_id = Some(m.provider_id);
            }
            Err(error) => {
                ctx.calls.create_failed.fetch_add(1, Ordering::Relaxed);
                let note = format!(
                    "node {name}: NodeClass {class_name}: provider {}: {error}",
                    provider.kind()
                );
                return Ok(refuse(ctx, node, REASON_PROVIDER_FAILED, note).await);
            }
        }
    }
    let provider_id = provider_id.unwrap_or_default();
    let written = apply(
        nodes,
        node,
        record(node, class_name, &class.spec, &provider_id),
    )
    .await;
    match written {
        Ok(()) => {}
        // Refused for what it says (a 409 is the Node deleted meanwhile, a 429 load: retried
        // as errors): the machine stays the Node's, found again by its tags on the next try.
        Err(Error::WriteNode {
            source: kube::Error::Api(s),
            ..
        }) if (400..500).contains(&s.code) && s.code != 409 && s.code != 429 => {
            let note = format!(
                "node {name}: the API server refused the record of machine {provider_id} from NodeClass {class_name}: {}; fix the NodeClass's spec.labels or spec.taints (or the Node), the record is tried again with backoff",
                s.message
            );
            return Ok(refuse(ctx, node, REASON_RECORD_REFUSED, note).await);
        }
        Err(error) => return Err(error),
    }
    ctx.forget(&name);
    Ok(Action::await_change())
}

/// What the API server would refuse in the record of `node` from class `class_name`: the
/// class's labels and taints, the class's name as the value of the class label (a name may
/// have 253 characters, a label value 63), and the hostname label the record adds from the
/// Node's name.
pub fn record_errors(node: &Node, class_name: &str, class: &NodeClassSpec) -> Vec<FieldError> {
    let in_class = |f: &str| format!("NodeClass {class_name} spec.{f}");
    let mut errors = node_class::check_labels(&in_class("labels"), &class.labels);
    errors.extend(node_class::check_taints(
        &in_class("taints"),
        &class.taints,
        &[],
    ));
    let annotation = format!("metadata.annotations[{ANNOTATION_NODE_CLASS}]");
    let class_label = BTreeMap::from([(LABEL_NODE_CLASS.to_owned(), class_name.to_owned())]);
    errors.extend(
        node_class::check_labels(&annotation, &class_label)
            .into_iter()
            .map(|e| FieldError {
                field: annotation.clone(),
                message: format!(
                    "{}; the record carries the NodeClass's name as the value of label {LABEL_NODE_CLASS}, and a label value has at most 63 characters: name a NodeClass whose name has at most 63 characters",
                    e.message
                ),
            }),
    );
    if !node.labels().contains_key(HOSTNAME) {
        let hostname = BTreeMap::from([(HOSTNAME.to_owned(), node.name_any())]);
        errors.extend(
            node_class::check_labels("metadata.labels", &hostname)
                .into_iter()
                .map(|e| FieldError {
                    message: format!(
                        "{}; the Node's name is the {HOSTNAME} label a drain selects by: give the Node that label with a valid value, or a shorter name",
                        e.message
                    ),
                    ..e
                }),
        );
    }
    errors
}

/// An OCI machine launched for this Node before its record was written (an answer lost, a
/// restart, a failover) is the Node's machine; kwok's machine is the Node itself, so there is
/// nothing to look for. A failed look is an error: creating then could launch a second machine.
async fn find_made(
    ctx: &Context,
    provider: &Arc<dyn Provider>,
    node: &str,
    class: &NodeClassSpec,
) -> Result<Option<Machine>, crate::controllers::node_set::ProviderError> {
    if provider.machine_is_node() {
        return Ok(None);
    }
    ctx.calls.list.fetch_add(1, Ordering::Relaxed);
    provider.find_for_node(node, class).await
}

/// The label a drain selects a node by.
const HOSTNAME: &str = "kubernetes.io/hostname";

/// Warns on the Node and backs off (2 s, 4 s, … up to five minutes): nothing is made meanwhile.
async fn refuse(ctx: &Context, node: &Node, reason: &str, note: String) -> Action {
    let name = node.name_any();
    warn!(node = %name, reason, %note, "no machine for node; backing off");
    publish(ctx, node, EventType::Warning, reason, note.clone()).await;
    ctx.memory.with(&name, |m| m.fail(note));
    Action::requeue(
        ctx.memory
            .with(&name, |m| m.backoff_left())
            .unwrap_or(RECHECK),
    )
}

/// What the provider is asked for: a machine named after the Node, with no NodeSet (the Node
/// exists: the provider adopts it rather than writing a record).
fn request(node: &str, class_name: &str, class: &NodeClassSpec) -> MachineRequest {
    MachineRequest {
        node_name: node.to_owned(),
        node_set: String::new(),
        node_class: class_name.to_owned(),
        template_hash: String::new(),
        labels: class.labels.clone(),
        taints: class.taints.clone(),
        class: class.clone(),
    }
}

/// The record, as this controller's whole server-side apply set: the finalizer, the class's
/// labels and the class label, the hostname label a drain selects by (when the Node has none),
/// the providerID, and the class's taints added to the Node's own.
pub fn record(
    node: &Node,
    class_name: &str,
    class: &NodeClassSpec,
    provider_id: &str,
) -> serde_json::Value {
    let mut labels: BTreeMap<String, String> = class.labels.clone();
    labels.insert(LABEL_NODE_CLASS.to_owned(), class_name.to_owned());
    if !node.labels().contains_key(HOSTNAME) {
        labels.insert(HOSTNAME.to_owned(), node.name_any());
    }
    let mut spec = json!({ "providerID": provider_id });
    if !class.taints.is_empty() {
        let mut taints: Vec<serde_json::Value> = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .map(|ts| {
                ts.iter()
                    .map(|t| json!({ "key": t.key, "value": t.value, "effect": t.effect }))
                    .collect()
            })
            .unwrap_or_default();
        for t in &class.taints {
            let t = json!({ "key": t.key, "value": t.value, "effect": t.effect });
            if !taints
                .iter()
                .any(|o| o["key"] == t["key"] && o["effect"] == t["effect"])
            {
                taints.push(t);
            }
        }
        spec["taints"] = json!(taints);
    }
    json!({
        "metadata": { "name": node.name_any(), "finalizers": [FINALIZER_MACHINE], "labels": labels },
        "spec": spec,
    })
}

/// Server-side apply of this controller's set on the Node, on that Node only: the uid makes the
/// apply fail (409) rather than create a new Node of the same name when this one was deleted
/// meanwhile (an apply creates what does not exist, resourceVersion or not).
async fn apply(nodes: &Api<Node>, node: &Node, mut body: serde_json::Value) -> Result<(), Error> {
    let name = node.name_any();
    let name = name.as_str();
    body["apiVersion"] = json!("v1");
    body["kind"] = json!("Node");
    body["metadata"]["uid"] = json!(node.uid());
    nodes
        .patch(
            name,
            &PatchParams::apply(MANAGER_KUBE_NODE).force(),
            &Patch::Apply(&body),
        )
        .await
        .map(|_| ())
        .map_err(|source| Error::WriteNode {
            name: name.to_owned(),
            source,
        })
}

/// Removes the finalizer with a JSON patch that first tests it is where it was read (a
/// server-side apply without it would also drop the record's fields this controller owns).
async fn remove_finalizer(nodes: &Api<Node>, node: &Node) -> Result<(), Error> {
    let name = node.name_any();
    let Some(i) = node
        .finalizers()
        .iter()
        .position(|f| f == FINALIZER_MACHINE)
    else {
        return Ok(());
    };
    let path = format!("/metadata/finalizers/{i}");
    let ops = json!([
        { "op": "test", "path": path, "value": FINALIZER_MACHINE },
        { "op": "remove", "path": path },
    ]);
    let patch = Patch::<()>::Json(serde_json::from_value(ops).map_err(|e| Error::WriteNode {
        name: name.clone(),
        source: kube::Error::SerdeError(e),
    })?);
    let params = PatchParams {
        field_manager: Some(MANAGER_KUBE_NODE.to_owned()),
        ..PatchParams::default()
    };
    match nodes.patch(&name, &params, &patch).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::WriteNode { name, source }),
    }
}

/// The provider a machine's providerID names (no class needed: it may be gone by now): `None`
/// for a scheme no provider of this controller knows, an error (why, and the fix) for an OCI
/// machine while this controller has no OCI provider — that machine is not to be left behind.
fn provider_of(ctx: &Context, provider_id: &str) -> Result<Option<Arc<dyn Provider>>, String> {
    if provider_id.starts_with(kwok::PROVIDER_ID_PREFIX) {
        Ok(Some(Arc::clone(&ctx.kwok)))
    } else if provider_id.starts_with(oci::PROVIDER_ID_PREFIX) {
        ctx.oci.clone().map(Some).ok_or_else(|| {
            format!(
                "spec.providerID {provider_id} is an OCI instance, but this controller has no OCI provider ({}); the instance is not terminated and the Node stays until it is. Fix the controller's OCI access, or remove the finalizer {FINALIZER_MACHINE} to delete the Node and leave the instance running (then terminate it by hand)",
                ctx.oci_unavailable
            )
        })
    } else {
        Ok(None)
    }
}

/// Records a failed machine deletion and how long to wait before the next try (2 s, 4 s, …
/// up to five minutes, at least [`TERMINATING_RECHECK`]).
fn delete_backoff(ctx: &Context, name: &str, note: String) -> Duration {
    ctx.memory
        .with(name, |m| {
            m.fail(note);
            m.backoff_left()
        })
        .unwrap_or(TERMINATING_RECHECK)
        .max(TERMINATING_RECHECK)
}

/// Deletes `machine` of Node `node`: `Ok(None)` once it is gone, else when to look again (a
/// failure is warned once on the Node and backed off).
async fn delete_machine(
    ctx: &Context,
    node: &Node,
    provider: &Arc<dyn Provider>,
    machine: &Machine,
) -> Option<Duration> {
    ctx.calls.delete.fetch_add(1, Ordering::Relaxed);
    match provider.delete(machine).await {
        Ok(Deletion::Gone) => None,
        Ok(Deletion::InProgress) => Some(TERMINATING_RECHECK),
        Err(error) => {
            let name = node.name_any();
            warn!(%error, node = %name, "deleting the machine failed; retrying with backoff");
            let note = format!(
                "node {name}: deleting machine {} failed: {error}; retried with backoff, the Node stays until it is gone. Remove the finalizer {FINALIZER_MACHINE} to delete the Node without deleting the machine",
                machine.provider_id
            );
            warn_once(ctx, node, REASON_MACHINE_DELETE_FAILED, note.clone()).await;
            Some(delete_backoff(ctx, &name, note))
        }
    }
}

/// A deleted Node with the finalizer and no providerID: a machine launched for it whose record
/// was never written (an answer lost, a restart) is looked for, and deleted before the finalizer
/// goes — with no drain: no record, so no pod was placed through this controller. kwok's machine
/// is the Node, and a Node whose class is gone names nowhere to look.
async fn release(
    ctx: &Context,
    nodes: &Api<Node>,
    node: &Node,
    class_name: Option<&str>,
) -> Result<Action, Error> {
    let name = node.name_any();
    if let Some(class_name) = class_name {
        let class = read_class(ctx, class_name).await?;
        if let Some(class) = class {
            let provider = match ctx.provider(class.spec.provider) {
                Ok(p) => p,
                Err(error) => {
                    let note = format!(
                        "node {name}: NodeClass {class_name}: {error}; a machine launched for this Node cannot be looked for, so the Node stays. Fix the controller's provider access, or remove the finalizer {FINALIZER_MACHINE} to delete the Node (then check the provider for a machine tagged with it)"
                    );
                    warn_once(ctx, node, REASON_PROVIDER_FAILED, note).await;
                    return Ok(Action::requeue(UNAVAILABLE_RECHECK));
                }
            };
            let found = match find_made(ctx, &provider, &name, &class.spec).await {
                Ok(found) => found,
                Err(error) => {
                    let note = format!(
                        "node {name}: NodeClass {class_name}: provider {}: {error}; the Node stays until a machine launched for it can be looked for. Remove the finalizer {FINALIZER_MACHINE} to delete the Node without looking",
                        provider.kind()
                    );
                    warn_once(ctx, node, REASON_MACHINE_DELETE_FAILED, note.clone()).await;
                    return Ok(Action::requeue(delete_backoff(ctx, &name, note)));
                }
            };
            if let Some(machine) = found {
                info!(node = %name, provider_id = %machine.provider_id, "node deleted before its machine was recorded; deleting the machine");
                if let Some(wait) = delete_machine(ctx, node, &provider, &machine).await {
                    return Ok(Action::requeue(wait));
                }
                publish(
                    ctx,
                    node,
                    EventType::Normal,
                    REASON_MACHINE_DELETED,
                    format!(
                        "machine {} deleted (launched, never recorded on the Node)",
                        machine.provider_id
                    ),
                )
                .await;
            }
        }
    }
    info!(node = %name, "node deleted with no machine; releasing it");
    remove_finalizer(nodes, node).await?;
    ctx.forget(&name);
    Ok(Action::await_change())
}

/// A deleted Node with a machine: drain, delete the machine until gone, clean up.
async fn remove(
    ctx: &Context,
    nodes: &Api<Node>,
    node: &Node,
    provider_id: &str,
) -> Result<Action, Error> {
    let name = node.name_any();
    let nm_api: Api<NodeMaintenance> = Api::all(ctx.client.clone());
    let nm_name = plan::maintenance_name(&name);
    let nm = nm_api
        .get_opt(&nm_name)
        .await
        .map_err(|source| Error::ReadMaintenance {
            name: nm_name.clone(),
            source,
        })?;
    let drain = match &nm {
        None => Drain::Absent,
        Some(nm) if nm.meta().deletion_timestamp.is_some() => Drain::Going,
        Some(nm) => Drain::Present(leaving_of(nm, &name)),
    };
    let cleaned = ctx
        .memory
        .with(&name, |m| m.deleted_maintenances.contains_key(&nm_name));
    match plan::removal(drain, cleaned) {
        Removal::StartDrain => {
            let defaults = ScaleDown::default();
            let order = DrainOrder {
                name: nm_name,
                node: name.clone(),
                hostname: node
                    .labels()
                    .get("kubernetes.io/hostname")
                    .cloned()
                    .unwrap_or_else(|| name.clone()),
                labels: BTreeMap::new(),
                owner: json!({
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": name,
                    "uid": node.uid().unwrap_or_default(),
                }),
                drain_timeout: defaults.drain_timeout,
                on_timeout: defaults.on_timeout,
                reason: format!(
                    "kubenode: node {name} was deleted; its machine goes after the drain"
                ),
            };
            start_drain(&nm_api, &order).await?;
            info!(node = %name, "node deleted; draining it before its machine goes");
            Ok(Action::requeue(RECHECK))
        }
        Removal::Wait => Ok(Action::requeue(RECHECK)),
        Removal::Stuck(message) => {
            let note = format!(
                "node {name}: {message}; the machine stays until the drain finishes. Free the blocking pods, or remove the finalizer {FINALIZER_MACHINE} to delete the Node without deleting its machine"
            );
            warn_once(ctx, node, REASON_DRAIN_STUCK, note).await;
            Ok(Action::requeue(Duration::from_secs(30)))
        }
        Removal::DeleteMachine => {
            match provider_of(ctx, provider_id) {
                // The Node is the machine: deleting it is what is under way.
                Ok(Some(p)) if p.machine_is_node() => {}
                Ok(Some(p)) => {
                    let machine = Machine {
                        node_name: name.clone(),
                        provider_id: provider_id.to_owned(),
                        node_set: None,
                        created: None,
                    };
                    if let Some(wait) = delete_machine(ctx, node, &p, &machine).await {
                        return Ok(Action::requeue(wait));
                    }
                }
                Err(why) => {
                    let note = format!("node {name}: {why}");
                    warn_once(ctx, node, REASON_PROVIDER_FAILED, note).await;
                    return Ok(Action::requeue(UNAVAILABLE_RECHECK));
                }
                Ok(None) => {
                    let note = format!(
                        "node {name}: no provider of this controller owns spec.providerID {provider_id} (neither {} nor {}); the Node goes and that machine is not deleted: delete it where it runs",
                        kwok::PROVIDER_ID_PREFIX,
                        oci::PROVIDER_ID_PREFIX
                    );
                    publish(ctx, node, EventType::Warning, REASON_PROVIDER_FAILED, note).await;
                }
            }
            publish(
                ctx,
                node,
                EventType::Normal,
                REASON_MACHINE_DELETED,
                format!("machine {provider_id} deleted after the drain"),
            )
            .await;
            delete_maintenance(&nm_api, &nm_name).await?;
            ctx.memory.with(&name, |m| {
                m.deleted_maintenances
                    .insert(nm_name, std::time::Instant::now())
            });
            Ok(Action::requeue(RECHECK))
        }
        Removal::Release => {
            remove_finalizer(nodes, node).await?;
            ctx.forget(&name);
            info!(node = %name, provider_id, "machine deleted; node released");
            Ok(Action::await_change())
        }
    }
}

/// The NodeClass `name`, or `None` when there is none.
async fn read_class(ctx: &Context, name: &str) -> Result<Option<NodeClass>, Error> {
    Api::<NodeClass>::all(ctx.client.clone())
        .get_opt(name)
        .await
        .map_err(|source| Error::ReadClass {
            name: name.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    #[test]
    fn the_record_adds_the_class_and_keeps_the_nodes_own() {
        let node: Node = serde_json::from_value(json!({
            "metadata": { "name": "n1", "labels": { "kubernetes.io/hostname": "h1" } },
            "spec": { "taints": [{ "key": "mine", "effect": "NoSchedule" }] },
        }))
        .unwrap();
        let class: NodeClassSpec = serde_json::from_value(json!({
            "provider": "kwok", "kwok": {},
            "labels": { "pool": "a" },
            "taints": [{ "key": "gpu", "effect": "NoSchedule" }, { "key": "mine", "effect": "NoSchedule" }],
        }))
        .unwrap();
        let r = record(&node, "small", &class, "kwok://n1");
        assert_eq!(r["metadata"]["finalizers"][0], FINALIZER_MACHINE);
        assert_eq!(r["metadata"]["labels"][LABEL_NODE_CLASS], "small");
        assert_eq!(r["metadata"]["labels"]["pool"], "a");
        assert!(
            r["metadata"]["labels"]
                .get("kubernetes.io/hostname")
                .is_none()
        );
        assert_eq!(r["spec"]["providerID"], "kwok://n1");
        let taints = r["spec"]["taints"].as_array().unwrap();
        assert_eq!(taints.len(), 2, "{taints:?}");
        let bare: Node = serde_json::from_value(json!({ "metadata": { "name": "n2" } })).unwrap();
        let plain: NodeClassSpec =
            serde_json::from_value(json!({ "provider": "kwok", "kwok": {} })).unwrap();
        let r = record(&bare, "small", &plain, "kwok://n2");
        assert_eq!(r["metadata"]["labels"]["kubernetes.io/hostname"], "n2");
        assert!(r["spec"].get("taints").is_none());
        let req = request("n2", "small", &plain);
        assert!(req.adopts_node());
    }

    #[test]
    fn a_record_the_api_server_would_refuse_is_refused_before_any_machine() {
        let node: Node = serde_json::from_value(json!({ "metadata": { "name": "n1" } })).unwrap();
        let class: NodeClassSpec = serde_json::from_value(json!({
            "provider": "oci",
            "labels": { "team name": "x", "pool": "a" },
            "taints": [{ "key": "gpu", "value": "a b", "effect": "NoSchedule" }],
        }))
        .unwrap();
        let errors = format_field_errors(&record_errors(&node, "e5", &class));
        assert!(
            errors.contains(r#"NodeClass e5 spec.labels["team name"]"#),
            "{errors}"
        );
        assert!(
            errors.contains("NodeClass e5 spec.taints[0].value"),
            "{errors}"
        );
        assert!(!errors.contains("pool"), "{errors}");
        // A name too long for the hostname label the record would add from it.
        let long: Node =
            serde_json::from_value(json!({ "metadata": { "name": "n".repeat(64) } })).unwrap();
        let plain: NodeClassSpec =
            serde_json::from_value(json!({ "provider": "kwok", "kwok": {} })).unwrap();
        let errors = format_field_errors(&record_errors(&long, "small", &plain));
        assert!(
            errors.contains(r#"metadata.labels["kubernetes.io/hostname"]"#)
                && errors.contains("give the Node that label"),
            "{errors}"
        );
        // With its own hostname label the name is not a label value: nothing to refuse.
        let labeled: Node = serde_json::from_value(json!({
            "metadata": { "name": "n".repeat(64), "labels": { HOSTNAME: "h1" } },
        }))
        .unwrap();
        assert_eq!(record_errors(&labeled, "small", &plain), vec![]);
        assert_eq!(record_errors(&node, "small", &plain), vec![]);
        // A class name longer than a label value (a name may have 253 characters): the record's
        // class label would be refused after the machine is launched.
        let long_class = "c".repeat(64);
        let errors = record_errors(&node, &long_class, &plain);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].field,
            format!("metadata.annotations[{ANNOTATION_NODE_CLASS}]")
        );
        assert!(
            errors[0].message.contains(LABEL_NODE_CLASS) && errors[0].message.contains("63"),
            "{}",
            errors[0].message
        );
        assert_eq!(record_errors(&node, &"c".repeat(63), &plain), vec![]);
    }

    fn context() -> Context {
        // Never contacted.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let recorder = kube::runtime::events::Recorder::new(client.clone(), "test".into());
        Context::with_client(client, recorder)
    }

    #[tokio::test]
    async fn an_oci_machine_is_not_left_behind_when_the_controller_has_no_oci() {
        let ctx = context();
        let why = provider_of(&ctx, "oci://ocid1.instance.oc1..a")
            .err()
            .expect("an OCI machine without an OCI provider is not released");
        assert!(
            why.contains("spec.providerID oci://ocid1.instance.oc1..a")
                && why.contains("--oci-endpoint")
                && why.contains(FINALIZER_MACHINE),
            "{why}"
        );
        assert!(matches!(provider_of(&ctx, "kwok://n1"), Ok(Some(_))));
        // A scheme no provider here knows is nobody's to delete: released.
        assert!(matches!(provider_of(&ctx, "aws:///i-1"), Ok(None)));
    }

    #[test]
    fn a_kubelet_registered_node_is_told_from_a_created_one() {
        let created: Node =
            serde_json::from_value(json!({ "metadata": { "name": "n1" } })).unwrap();
        assert!(!registered(&created));
        let reported: Node = serde_json::from_value(json!({
            "metadata": { "name": "n1" },
            "status": { "nodeInfo": {
                "kubeletVersion": "v1.36.0", "architecture": "", "bootID": "",
                "containerRuntimeVersion": "", "kernelVersion": "", "kubeProxyVersion": "",
                "machineID": "", "operatingSystem": "", "osImage": "", "systemUUID": "",
            } },
        }))
        .unwrap();
        assert!(registered(&reported));
        let ready: Node = serde_json::from_value(json!({
            "metadata": { "name": "n1" },
            "status": { "conditions": [{
                "type": "Ready", "status": "True", "lastHeartbeatTime": "2026-11-30T00:00:00Z",
            }] },
        }))
        .unwrap();
        assert!(registered(&ready));
        // What kube-controller-manager writes on a Node no kubelet updated: not a kubelet.
        let never: Node = serde_json::from_value(json!({
            "metadata": { "name": "n1" },
            "status": { "conditions": [{
                "type": "Ready", "status": "Unknown", "reason": "NodeStatusNeverUpdated",
                "lastHeartbeatTime": "2026-11-30T00:00:00Z",
            }] },
        }))
        .unwrap();
        assert!(!registered(&never));
        let meta = ObjectMeta {
            annotations: Some(BTreeMap::from([(
                ANNOTATION_NODE_CLASS.to_owned(),
                "large".to_owned(),
            )])),
            labels: Some(BTreeMap::from([(
                LABEL_NODE_CLASS.to_owned(),
                "small".to_owned(),
            )])),
            ..ObjectMeta::default()
        };
        let s = state(&meta, Some("oci://x"));
        assert_eq!((s.recorded, s.other_class), (false, Some("small")));
    }
}
