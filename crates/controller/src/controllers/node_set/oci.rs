//! The OCI provider: a machine is a Compute instance launched from the NodeClass's `spec.oci`
//! (shape and shape config, image, subnet, metadata with the user data), tagged with the NodeSet,
//! the node's name, the class and the template hash, and recorded as a Node object whose
//! `spec.providerID` is `oci://<instance OCID>` (the OCI cloud controller manager's form). The
//! Node comes first, then the instance boots and its kubelet registers under the same name and
//! takes the object over (the kubelet adopts an existing Node of its name); the instance's
//! metadata carries that name under [`METADATA_NODE_NAME`] for its bootstrap to pass as
//! `--hostname-override`.
//!
//! Bad input is named by field: the shape is checked against ListShapes (cached) before any
//! launch, and LaunchInstance's refusals are mapped back to `spec.oci.<field>` where the answer
//! says which. "Out of host capacity" is a capacity answer: one call, an error naming the shape
//! and availability domain, and the NodeSet's backoff — never a retry loop (the client does not
//! retry it). Deleting terminates the instance (idempotent: a 404 or TERMINATED instance is gone)
//! and deletes its Node object. For a Node a user created ([`MachineRequest::adopts_node`]) no
//! record is written: the Node is there, and its caller writes the providerID.
//!
//! Ownership: every instance also carries this cluster's identity ([`TAG_CLUSTER`]:
//! `--cluster-id`, or the `kube-system` Namespace's UID), and `list` — what the orphan sweep
//! terminates from — returns only a set's instances carrying it, so a cluster sharing the
//! compartment and a NodeSet name never has its instances swept by this one; an instance without
//! the tag (launched before it existed) is never swept, nor is a single Node's (set tag empty).
//! A single Node's instance is found by `find_for_node` instead (its node tag, an empty set tag
//! and this cluster's tag), so a launch whose answer was lost is not launched twice. Deleting checks the instance's tags name the
//! machine's node and set (and cluster, where it carries one) before TerminateInstance, and
//! deletes the Node only while its `spec.providerID` names the instance.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::Api;
use kube::api::{DeleteParams, PostParams, Preconditions};
use nodekeeper_api::crd::node_class::{NodeClassSpec, OciTemplate};
use nodekeeper_api::names::{LABEL_NODE_CLASS, LABEL_NODE_SET};
use nodekeeper_oci::compute::{
    ComputeClient, ComputeError, CreateVnicDetails, Instance, InstanceState, LaunchInstanceDetails,
    ListInstancesFilter, ShapeConfig, SourceDetails, TerminateOptions,
};
use tokio::sync::OnceCell;
use tracing::{info, warn};

use super::provider::{Deletion, Machine, MachineRequest, Provider, ProviderError, node_record};
use crate::controllers::node_network_config::cloud::instance_id;

/// The `spec.providerID` scheme of OCI machines.
pub const PROVIDER_ID_PREFIX: &str = "oci://";
/// Freeform tag: the NodeSet an instance belongs to (what `list` selects by).
pub const TAG_NODE_SET: &str = LABEL_NODE_SET;
/// Freeform tag: the Node name the instance is recorded as.
pub const TAG_NODE: &str = "nodekeeper.dev/node";
/// Freeform tag: the NodeClass the instance was made from.
pub const TAG_NODE_CLASS: &str = LABEL_NODE_CLASS;
/// Freeform tag: the template hash the instance was made from.
pub const TAG_TEMPLATE_HASH: &str = "nodekeeper.dev/template-hash";
/// Freeform tag: the cluster whose NodeSet launched the instance (`--cluster-id`, or the
/// `kube-system` Namespace's UID); the orphan sweep only terminates instances carrying this
/// cluster's.
pub const TAG_CLUSTER: &str = "nodekeeper.dev/cluster";
/// The longest freeform tag value OCI accepts.
const MAX_TAG_VALUE: usize = 256;
/// Instance metadata key carrying the Node name, for the bootstrap's `--hostname-override`.
pub const METADATA_NODE_NAME: &str = "nodekeeper_node_name";
/// How long a ListShapes answer is trusted.
const SHAPES_TTL: Duration = Duration::from_secs(600);

type ShapeKey = (String, String, String);

/// Machines as OCI Compute instances.
pub struct OciProvider {
    compute: ComputeClient,
    nodes: Api<Node>,
    namespaces: Api<Namespace>,
    /// (compartment, availability domain, image) → shapes offered, and when that was read.
    shapes: Mutex<HashMap<ShapeKey, (Instant, Vec<String>)>>,
    /// This cluster's identity: `--cluster-id`, or the `kube-system` Namespace's UID once read.
    cluster: OnceCell<String>,
    /// Whether the log has said that instances without the cluster tag are never swept.
    said_untagged: AtomicBool,
}

/// Checks `--cluster-id`: `None` when unset, else a value an OCI freeform tag can carry.
pub fn check_cluster_id(id: Option<&str>) -> Result<Option<String>, String> {
    match id.map(str::trim) {
        None => Ok(None),
        Some("") => Err(
            "--cluster-id (NODEKEEPER_CLUSTER_ID) is empty; unset it to use the kube-system \
             Namespace's UID, or give the cluster a name"
                .into(),
        ),
        Some(id) if id.chars().count() > MAX_TAG_VALUE => Err(format!(
            "--cluster-id (NODEKEEPER_CLUSTER_ID) has {} characters; an OCI freeform tag value \
             holds at most {MAX_TAG_VALUE}, so give a shorter one",
            id.chars().count()
        )),
        Some(id) => Ok(Some(id.to_owned())),
    }
}

impl OciProvider {
    /// The provider launching through `compute`; `cluster_id` is `--cluster-id` (checked by
    /// [`check_cluster_id`]), `None` for the `kube-system` Namespace's UID.
    pub fn new(compute: ComputeClient, client: kube::Client, cluster_id: Option<String>) -> Self {
        Self {
            compute,
            nodes: Api::all(client.clone()),
            namespaces: Api::all(client),
            shapes: Mutex::default(),
            cluster: cluster_id.map_or_else(OnceCell::new, |id| OnceCell::new_with(Some(id))),
            said_untagged: AtomicBool::new(false),
        }
    }

    /// This cluster's identity: `--cluster-id`, or the UID of the `kube-system` Namespace, read
    /// once (it lives as long as the cluster, and no other cluster has it).
    async fn cluster(&self) -> Result<&str, String> {
        self.cluster
            .get_or_try_init(|| async {
                let ns = self.namespaces.get("kube-system").await.map_err(|e| {
                    format!(
                        "this cluster's identity (the {TAG_CLUSTER} tag) is the kube-system \
                         Namespace's UID, and reading it failed: {e}; give the controller `get` \
                         on namespaces/kube-system, or set --cluster-id (NODEKEEPER_CLUSTER_ID)"
                    )
                })?;
                ns.metadata
                    .uid
                    .filter(|u| !u.is_empty())
                    .ok_or_else(|| "namespace kube-system has no metadata.uid; set --cluster-id (NODEKEEPER_CLUSTER_ID)".to_owned())
            })
            .await
            .map(String::as_str)
    }

    /// Deletes the Node named `name` only while its `spec.providerID` is `provider_id`: a Node
    /// of that name that is another machine's (or nobody's) is not this deletion's to remove.
    async fn delete_node_of(&self, name: &str, provider_id: &str) -> Result<(), String> {
        let node = match self.nodes.get_opt(name).await {
            Ok(Some(n)) => n,
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("read node {name}: {e}")),
        };
        let names = node.spec.as_ref().and_then(|s| s.provider_id.as_deref());
        if names != Some(provider_id) {
            warn!(node = %name, node_provider_id = names.unwrap_or(""), %provider_id, "node is not this machine's; left in place");
            return Ok(());
        }
        // The UID precondition: a Node deleted and made again under the name since the read is
        // another object, and is left alone (the providerID cannot change once set).
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: node.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.nodes.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
            Err(e) => Err(format!("delete node {name}: {e}")),
        }
    }

    /// Checks `spec.oci.shape` against the shapes offered for the template's compartment,
    /// availability domain and image (one ListShapes per ten minutes and template).
    async fn check_shape(&self, t: &OciTemplate) -> Result<(), String> {
        let key = (
            t.compartment_id.clone(),
            t.availability_domain.clone(),
            t.image_id.clone(),
        );
        let cached = self
            .shapes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .filter(|(at, _)| at.elapsed() < SHAPES_TTL)
            .map(|(_, s)| s.clone());
        let offered = match cached {
            Some(s) => s,
            None => {
                let shapes = self
                    .compute
                    .list_shapes(
                        &t.compartment_id,
                        Some(&t.availability_domain),
                        Some(&t.image_id),
                    )
                    .await
                    .map_err(|e| field_of_error(t, &e))?;
                let names: Vec<String> = shapes.into_iter().map(|s| s.shape).collect();
                self.shapes
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key, (Instant::now(), names.clone()));
                names
            }
        };
        if offered.iter().any(|s| s == &t.shape) {
            return Ok(());
        }
        let mut some: Vec<&str> = offered.iter().map(String::as_str).take(8).collect();
        some.sort_unstable();
        Err(format!(
            "spec.oci.shape: {:?} is not offered in availability domain {} for image {} \
             (offered: {}{}); name one of those",
            t.shape,
            t.availability_domain,
            t.image_id,
            some.join(", "),
            if offered.len() > some.len() {
                ", …"
            } else {
                ""
            }
        ))
    }
}

/// The LaunchInstance request for a machine; `cluster` is this cluster's identity, tagged on
/// every instance (`None` only in tests).
pub fn launch_details(
    request: &MachineRequest,
    t: &OciTemplate,
    cluster: Option<&str>,
) -> LaunchInstanceDetails {
    let mut freeform_tags = BTreeMap::from([
        (TAG_NODE_SET.to_owned(), request.node_set.clone()),
        (TAG_NODE.to_owned(), request.node_name.clone()),
        (TAG_NODE_CLASS.to_owned(), request.node_class.clone()),
        (TAG_TEMPLATE_HASH.to_owned(), request.template_hash.clone()),
    ]);
    if let Some(c) = cluster {
        freeform_tags.insert(TAG_CLUSTER.to_owned(), c.to_owned());
    }
    let mut metadata = t.metadata.clone();
    metadata.insert(METADATA_NODE_NAME.to_owned(), request.node_name.clone());
    let display_name = display_name(t, &request.node_name);
    LaunchInstanceDetails {
        availability_domain: t.availability_domain.clone(),
        compartment_id: t.compartment_id.clone(),
        shape: t.shape.clone(),
        shape_config: t.shape_config.as_ref().map(|c| ShapeConfig {
            ocpus: Some(c.ocpus as f32),
            memory_in_gbs: c.memory_in_gbs.map(|m| m as f32),
        }),
        source_details: Some(SourceDetails::Image {
            image_id: t.image_id.clone(),
            boot_volume_size_in_gbs: None,
        }),
        create_vnic_details: Some(CreateVnicDetails {
            subnet_id: t.subnet_id.clone(),
            display_name: Some(display_name.clone()),
            ..Default::default()
        }),
        metadata,
        display_name: Some(display_name),
        freeform_tags,
        fault_domain: None,
    }
}

/// The instance's display name for Node `node`: the template's prefix and the name.
fn display_name(t: &OciTemplate, node: &str) -> String {
    match &t.display_name_prefix {
        Some(p) => format!("{p}{node}"),
        None => node.to_owned(),
    }
}

/// An OCI answer as a message naming the NodeClass field it concerns, where the answer says
/// which: an OCID of the template in a 404's message, the shape in a 400's, the metadata.
pub fn field_of_error(t: &OciTemplate, error: &ComputeError) -> String {
    if let ComputeError::OutOfCapacity { .. } = error {
        return format!(
            "spec.oci.shape: {} in availability domain {}: {error}",
            t.shape, t.availability_domain
        );
    }
    let message = match error {
        ComputeError::Service { message, .. } => message.as_str(),
        _ => return error.to_string(),
    };
    let by_ocid = [
        ("spec.oci.imageId", &t.image_id),
        ("spec.oci.subnetId", &t.subnet_id),
        ("spec.oci.compartmentId", &t.compartment_id),
    ]
    .into_iter()
    .find(|(_, id)| message.contains(id.as_str()));
    let lower = message.to_ascii_lowercase();
    let field = match by_ocid {
        Some((f, _)) => f,
        None if lower.contains("shape") => "spec.oci.shape",
        None if lower.contains("metadata") || lower.contains("user_data") => "spec.oci.metadata",
        None if lower.contains("availability domain") => "spec.oci.availabilityDomain",
        None if error.is_not_found() => {
            "spec.oci.compartmentId, spec.oci.imageId or spec.oci.subnetId (one of them names \
             nothing this controller may see)"
        }
        None => "spec.oci",
    };
    format!("{field}: {error}")
}

fn machine_of(i: &Instance) -> Option<Machine> {
    Some(Machine {
        node_name: i.freeform_tags.get(TAG_NODE)?.clone(),
        provider_id: format!("{PROVIDER_ID_PREFIX}{}", i.id),
        node_set: i.freeform_tags.get(TAG_NODE_SET).cloned(),
        created: i.created(),
    })
}

/// The live instances this cluster launched for any NodeSet (tagged with `cluster` and a set),
/// and how many more are tagged with `node_set` but carry no cluster tag at all (never returned:
/// they may be another cluster's, launched before the tag existed).
fn of_cluster(all: &[Instance], node_set: &str, cluster: &str) -> (Vec<Machine>, usize) {
    let live = || all.iter().filter(|i| !i.lifecycle_state.is_terminal());
    let untagged = live()
        .filter(|i| tag(i, TAG_NODE_SET) == Some(node_set) && tag(i, TAG_CLUSTER).is_none())
        .count();
    let ours = live()
        .filter(|i| tag(i, TAG_NODE_SET).is_some_and(|s| !s.is_empty()))
        .filter(|i| tag(i, TAG_CLUSTER) == Some(cluster))
        .filter_map(machine_of)
        .collect();
    (ours, untagged)
}

/// The live instance this cluster launched for the single Node `node` (tagged with the node, an
/// empty set tag and `cluster`) — the oldest, when an earlier lost answer left more than one —
/// and the ids of the others (leaked: nothing records them).
fn single_of<'a>(
    all: &'a [Instance],
    node: &str,
    cluster: &str,
) -> (Option<Machine>, Vec<&'a str>) {
    let mut found: Vec<&Instance> = all
        .iter()
        .filter(|i| !i.lifecycle_state.is_terminal())
        .filter(|i| tag(i, TAG_NODE) == Some(node))
        .filter(|i| tag(i, TAG_NODE_SET).unwrap_or("").is_empty())
        .filter(|i| tag(i, TAG_CLUSTER) == Some(cluster))
        .collect();
    found.sort_by_key(|i| (i.created(), i.id.clone()));
    let machine = found.first().and_then(|i| machine_of(i)).map(|m| Machine {
        node_set: None,
        ..m
    });
    let others = found.iter().skip(1).map(|i| i.id.as_str()).collect();
    (machine, others)
}

/// The value of freeform tag `key` on `i`.
fn tag<'a>(i: &'a Instance, key: &str) -> Option<&'a str> {
    i.freeform_tags.get(key).map(String::as_str)
}

/// Whether instance `i` is the machine a deletion names: tagged with its node and its set (none
/// for a kube-node machine), and, where it carries a cluster tag, with `cluster` (this
/// cluster's). A Node's providerID naming an instance it was not launched for — edited by
/// hand, or a name reused across clusters — must not terminate that instance.
fn check_owner(i: &Instance, machine: &Machine, cluster: Option<&str>) -> Result<(), String> {
    let tag = |k: &str| tag(i, k);
    let want_set = machine.node_set.as_deref().unwrap_or("");
    let mismatch = if tag(TAG_NODE) != Some(machine.node_name.as_str()) {
        Some(format!(
            "{TAG_NODE}={:?}, not node {}",
            tag(TAG_NODE).unwrap_or(""),
            machine.node_name
        ))
    } else if tag(TAG_NODE_SET).unwrap_or("") != want_set {
        Some(format!(
            "{TAG_NODE_SET}={:?}, not {want_set:?}",
            tag(TAG_NODE_SET).unwrap_or("")
        ))
    } else {
        match (tag(TAG_CLUSTER), cluster) {
            (Some(theirs), Some(ours)) if theirs != ours => Some(format!(
                "{TAG_CLUSTER}={theirs:?}, another cluster's (this one is {ours:?})"
            )),
            _ => None,
        }
    };
    match mismatch {
        None => Ok(()),
        Some(m) => Err(format!(
            "instance {} is tagged {m}: it was not launched as this machine, so it is not \
             terminated; check the spec.providerID of node {} (delete the Node by hand if it \
             names the wrong instance)",
            i.id, machine.node_name
        )),
    }
}

impl Provider for OciProvider {
    fn kind(&self) -> &'static str {
        "oci"
    }

    fn create<'a>(
        &'a self,
        request: &'a MachineRequest,
    ) -> BoxFuture<'a, Result<Machine, ProviderError>> {
        Box::pin(async move {
            let failed = |message: String| ProviderError::Create {
                node: request.node_name.clone(),
                message,
            };
            let Some(t) = request.class.oci.as_ref() else {
                return Err(failed(
                    "spec.oci: the NodeClass says provider oci but has no oci template".into(),
                ));
            };
            self.check_shape(t).await.map_err(failed)?;
            // Every instance carries this cluster's identity: a NodeSet's is what the orphan
            // sweep lists by, a single Node's what `find_for_node` finds it by after a lost
            // answer (the sweep never takes it: its set tag is empty).
            let cluster = self.cluster().await.map_err(failed)?;
            let instance = self
                .compute
                .launch_instance(&launch_details(request, t, Some(cluster)))
                .await
                .map_err(|e| failed(field_of_error(t, &e)))?;
            let provider_id = format!("{PROVIDER_ID_PREFIX}{}", instance.id);
            info!(node = %request.node_name, instance = %instance.id, nodeset = %request.node_set, "launched instance");
            if request.adopts_node() {
                // The Node exists (a user created it); its caller records the providerID.
                return Ok(Machine {
                    node_name: request.node_name.clone(),
                    provider_id,
                    node_set: None,
                    created: instance.created(),
                });
            }
            let node: Node = serde_json::from_value(node_record(request, &provider_id))
                .map_err(|e| failed(e.to_string()))?;
            let recorded = match self.nodes.create(&PostParams::default(), &node).await {
                Ok(_) => Ok(()),
                // The kubelet was faster (it registered before the record was written): the
                // object is the machine's if it names the instance.
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    match self.nodes.get_opt(&request.node_name).await {
                        Ok(Some(n))
                            if n.spec.as_ref().and_then(|s| s.provider_id.as_deref())
                                == Some(provider_id.as_str()) =>
                        {
                            Ok(())
                        }
                        _ => Err(format!(
                            "a node named {} exists and is not instance {}",
                            request.node_name, instance.id
                        )),
                    }
                }
                Err(e) => Err(e.to_string()),
            };
            if let Err(message) = recorded {
                // No record, no machine: an instance nobody tracks would run (and cost) forever.
                if let Err(error) = self
                    .compute
                    .terminate_instance(&instance.id, &TerminateOptions::default())
                    .await
                {
                    warn!(%error, instance = %instance.id, "terminating an unrecorded instance failed; the orphan sweep retries");
                }
                return Err(failed(format!(
                    "record node {}: {message}",
                    request.node_name
                )));
            }
            Ok(Machine {
                node_name: request.node_name.clone(),
                provider_id,
                node_set: Some(request.node_set.clone()),
                created: instance.created(),
            })
        })
    }

    fn delete<'a>(
        &'a self,
        machine: &'a Machine,
    ) -> BoxFuture<'a, Result<Deletion, ProviderError>> {
        Box::pin(async move {
            let failed = |message: String| ProviderError::Delete {
                id: machine.provider_id.clone(),
                message,
            };
            let id = instance_id(Some(&machine.provider_id)).map_err(failed)?;
            let deletion = match self.compute.get_instance(&id).await {
                Err(e) if e.is_not_found() => Deletion::Gone,
                Err(e) => return Err(failed(e.to_string())),
                Ok(i) if i.lifecycle_state == InstanceState::Terminated => Deletion::Gone,
                Ok(i) if i.lifecycle_state == InstanceState::Terminating => Deletion::InProgress,
                Ok(i) => {
                    let cluster = if i.freeform_tags.contains_key(TAG_CLUSTER) {
                        Some(self.cluster().await.map_err(failed)?)
                    } else {
                        None
                    };
                    check_owner(&i, machine, cluster).map_err(failed)?;
                    match self
                        .compute
                        .terminate_instance(&id, &TerminateOptions::default())
                        .await
                    {
                        Ok(()) => Deletion::InProgress,
                        Err(e) if e.is_not_found() => Deletion::Gone,
                        Err(e) => return Err(failed(e.to_string())),
                    }
                }
            };
            // The instance is going: its Node object goes with it (the cloud controller
            // manager's job on OCI, done here so a set never counts a terminated machine) —
            // while that Node is this machine's.
            self.delete_node_of(&machine.node_name, &machine.provider_id)
                .await
                .map_err(failed)?;
            Ok(deletion)
        })
    }

    fn get<'a>(
        &'a self,
        provider_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        Box::pin(async move {
            let failed = |message: String| ProviderError::Get {
                id: provider_id.to_owned(),
                message,
            };
            let id = instance_id(Some(provider_id)).map_err(failed)?;
            match self.compute.get_instance(&id).await {
                Ok(i) if i.lifecycle_state.is_terminal() => Ok(None),
                Ok(i) => Ok(machine_of(&i)),
                Err(e) if e.is_not_found() => Ok(None),
                Err(e) => Err(failed(e.to_string())),
            }
        })
    }

    fn list<'a>(
        &'a self,
        node_set: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Vec<Machine>, ProviderError>> {
        Box::pin(async move {
            let Some(t) = class.oci.as_ref() else {
                return Ok(Vec::new());
            };
            let cluster = self
                .cluster()
                .await
                .map_err(|message| ProviderError::List {
                    node_set: node_set.to_owned(),
                    message,
                })?;
            // ListInstances cannot filter by tag: list the compartment's instances and keep
            // the live ones this cluster launched for a set — this one's, and any other's (a set
            // deleted with a machine leaked has no sweep of its own). In every availability
            // domain, not only the class's: a machine leaked just before the class moved to
            // another domain is still this set's to sweep.
            let all = self
                .compute
                .list_instances(&t.compartment_id, &ListInstancesFilter::default())
                .await
                .map_err(|e| ProviderError::List {
                    node_set: node_set.to_owned(),
                    message: field_of_error(t, &e),
                })?;
            let (ours, untagged) = of_cluster(&all, node_set, cluster);
            if untagged > 0 && !self.said_untagged.swap(true, Ordering::Relaxed) {
                warn!(
                    nodeset = %node_set,
                    untagged,
                    "instances tagged with this nodeset but without the {TAG_CLUSTER} tag (launched before it existed, or by another cluster) are never swept as orphans; terminate any that are leaked by hand (said once)"
                );
            }
            Ok(ours)
        })
    }

    /// One ListInstances filtered by the display name the launch gave (not the whole
    /// compartment), then the tags: a NodeSet's instance or another cluster's is never it.
    fn find_for_node<'a>(
        &'a self,
        node: &'a str,
        class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        Box::pin(async move {
            let failed = |message: String| ProviderError::Find {
                node: node.to_owned(),
                message,
            };
            let Some(t) = class.oci.as_ref() else {
                return Ok(None);
            };
            let cluster = self.cluster().await.map_err(failed)?;
            let filter = ListInstancesFilter {
                display_name: Some(display_name(t, node)),
                ..ListInstancesFilter::default()
            };
            let all = self
                .compute
                .list_instances(&t.compartment_id, &filter)
                .await
                .map_err(|e| failed(field_of_error(t, &e)))?;
            let (machine, others) = single_of(&all, node, cluster);
            if !others.is_empty() {
                warn!(node, instances = ?others, "more instances were launched for this node than it records (lost answers); terminate the extra ones by hand");
            }
            Ok(machine)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodekeeper_api::crd::node_class::Provider as Kind;

    fn template() -> OciTemplate {
        serde_json::from_value(serde_json::json!({
            "compartmentId": "ocid1.compartment.oc1..aaaa",
            "availabilityDomain": "Uocm:PHX-AD-1",
            "shape": "VM.Standard.E5.Flex",
            "shapeConfig": {"ocpus": 2, "memoryInGBs": 16},
            "imageId": "ocid1.image.oc1.phx.bbbb",
            "subnetId": "ocid1.subnet.oc1.phx.cccc",
            "metadata": {"user_data": "I2Nsb3VkLWNvbmZpZwo=", "ssh_authorized_keys": "ssh-ed25519 AAAA"},
            "displayNamePrefix": "k8s-"
        }))
        .unwrap()
    }

    fn request() -> MachineRequest {
        MachineRequest {
            node_name: "pool-bcdfg".into(),
            node_set: "pool".into(),
            node_class: "e5".into(),
            template_hash: "0123456789".into(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            class: NodeClassSpec {
                provider: Kind::Oci,
                oci: Some(template()),
                kwok: None,
                labels: BTreeMap::new(),
                taints: Vec::new(),
            },
        }
    }

    #[test]
    fn the_launch_carries_the_template_and_the_tags() {
        let d = launch_details(&request(), &template(), Some("cluster-a"));
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["shape"], "VM.Standard.E5.Flex");
        assert_eq!(v["shapeConfig"]["ocpus"], 2.0);
        assert_eq!(v["shapeConfig"]["memoryInGBs"], 16.0);
        assert_eq!(
            v["sourceDetails"],
            serde_json::json!({"sourceType": "image", "imageId": "ocid1.image.oc1.phx.bbbb"})
        );
        assert_eq!(
            v["createVnicDetails"]["subnetId"],
            "ocid1.subnet.oc1.phx.cccc"
        );
        assert_eq!(v["displayName"], "k8s-pool-bcdfg");
        assert_eq!(v["metadata"]["user_data"], "I2Nsb3VkLWNvbmZpZwo=");
        assert_eq!(v["metadata"][METADATA_NODE_NAME], "pool-bcdfg");
        assert_eq!(v["freeformTags"][TAG_NODE_SET], "pool");
        assert_eq!(v["freeformTags"][TAG_NODE], "pool-bcdfg");
        assert_eq!(v["freeformTags"][TAG_TEMPLATE_HASH], "0123456789");
        assert_eq!(v["freeformTags"][TAG_CLUSTER], "cluster-a");
        let plain = serde_json::to_value(launch_details(&request(), &template(), None)).unwrap();
        assert!(plain["freeformTags"].get(TAG_CLUSTER).is_none(), "{plain}");
    }

    fn instance(id: &str, state: &str, tags: &[(&str, &str)]) -> Instance {
        let tags: BTreeMap<&str, &str> = tags.iter().copied().collect();
        serde_json::from_value(serde_json::json!({
            "id": id, "lifecycleState": state, "freeformTags": tags,
            "timeCreated": "2026-01-01T00:00:00Z",
        }))
        .unwrap()
    }

    #[test]
    fn only_this_clusters_instances_are_listed() {
        let all = [
            instance(
                "mine",
                "RUNNING",
                &[
                    (TAG_NODE_SET, "pool"),
                    (TAG_NODE, "pool-a"),
                    (TAG_CLUSTER, "blue"),
                ],
            ),
            instance(
                "green",
                "RUNNING",
                &[
                    (TAG_NODE_SET, "pool"),
                    (TAG_NODE, "pool-b"),
                    (TAG_CLUSTER, "green"),
                ],
            ),
            instance(
                "legacy",
                "PROVISIONING",
                &[(TAG_NODE_SET, "pool"), (TAG_NODE, "pool-c")],
            ),
            instance(
                "other-set",
                "RUNNING",
                &[
                    (TAG_NODE_SET, "db"),
                    (TAG_NODE, "db-a"),
                    (TAG_CLUSTER, "blue"),
                ],
            ),
            instance(
                "gone",
                "TERMINATING",
                &[
                    (TAG_NODE_SET, "pool"),
                    (TAG_NODE, "pool-d"),
                    (TAG_CLUSTER, "blue"),
                ],
            ),
            instance(
                "nameless",
                "RUNNING",
                &[(TAG_NODE_SET, "pool"), (TAG_CLUSTER, "blue")],
            ),
            instance(
                "kube-node",
                "RUNNING",
                &[
                    (TAG_NODE_SET, ""),
                    (TAG_NODE, "gpu-1"),
                    (TAG_CLUSTER, "blue"),
                ],
            ),
        ];
        let (ours, untagged) = of_cluster(&all, "pool", "blue");
        let ids: Vec<&str> = ours.iter().map(|m| m.provider_id.as_str()).collect();
        assert_eq!(ids, ["oci://mine", "oci://other-set"]);
        assert_eq!(ours[0].node_name, "pool-a");
        assert_eq!(ours[0].node_set.as_deref(), Some("pool"));
        assert_eq!(ours[1].node_set.as_deref(), Some("db"));
        assert!(ours[0].created.is_some());
        assert_eq!(untagged, 1);
        let (ours, untagged) = of_cluster(&all, "db", "green");
        assert_eq!(ours.len(), 1);
        assert_eq!(ours[0].provider_id, "oci://green");
        assert_eq!(untagged, 0);
    }

    #[test]
    fn a_single_nodes_instance_is_found_by_its_node_and_never_swept() {
        let at = |id: &str, state: &str, time: &str, tags: &[(&str, &str)]| {
            let mut i = instance(id, state, tags);
            i.time_created = Some(time.into());
            i
        };
        let single = [
            (TAG_NODE_SET, ""),
            (TAG_NODE, "gpu-1"),
            (TAG_CLUSTER, "blue"),
        ];
        let all = [
            at("second", "RUNNING", "2026-01-02T00:00:00Z", &single),
            at("first", "PROVISIONING", "2026-01-01T00:00:00Z", &single),
            at("gone", "TERMINATED", "2025-01-01T00:00:00Z", &single),
            // Another cluster's single Node of the same name, and one launched before the
            // cluster tag: never this Node's machine.
            instance(
                "green",
                "RUNNING",
                &[
                    (TAG_NODE_SET, ""),
                    (TAG_NODE, "gpu-1"),
                    (TAG_CLUSTER, "green"),
                ],
            ),
            instance(
                "legacy",
                "RUNNING",
                &[(TAG_NODE_SET, ""), (TAG_NODE, "gpu-1")],
            ),
            // A NodeSet's machine whose node has the same name.
            instance(
                "member",
                "RUNNING",
                &[
                    (TAG_NODE_SET, "pool"),
                    (TAG_NODE, "gpu-1"),
                    (TAG_CLUSTER, "blue"),
                ],
            ),
            instance(
                "other",
                "RUNNING",
                &[
                    (TAG_NODE_SET, ""),
                    (TAG_NODE, "gpu-2"),
                    (TAG_CLUSTER, "blue"),
                ],
            ),
        ];
        let (found, others) = single_of(&all, "gpu-1", "blue");
        let found = found.expect("the single Node's instance is found");
        assert_eq!(found.provider_id, "oci://first");
        assert_eq!(found.node_name, "gpu-1");
        assert_eq!(found.node_set, None);
        assert_eq!(others, ["second"]);
        assert_eq!(single_of(&all, "gpu-3", "blue"), (None, Vec::<&str>::new()));
        // The orphan sweep lists none of them, cluster tag or not.
        let (swept, _) = of_cluster(&all, "pool", "blue");
        let ids: Vec<&str> = swept.iter().map(|m| m.provider_id.as_str()).collect();
        assert_eq!(ids, ["oci://member"]);
        // What a single Node's launch carries: its node, an empty set and this cluster.
        let mut r = request();
        r.node_set = String::new();
        assert!(r.adopts_node());
        let v = serde_json::to_value(launch_details(&r, &template(), Some("blue"))).unwrap();
        assert_eq!(v["freeformTags"][TAG_NODE_SET], "");
        assert_eq!(v["freeformTags"][TAG_CLUSTER], "blue");
        assert_eq!(v["displayName"], display_name(&template(), &r.node_name));
    }

    #[test]
    fn an_instance_is_terminated_only_as_the_machine_it_was_launched_as() {
        let machine = |node: &str, set: Option<&str>| Machine {
            node_name: node.into(),
            provider_id: "oci://i".into(),
            node_set: set.map(Into::into),
            created: None,
        };
        let i = instance(
            "i",
            "RUNNING",
            &[
                (TAG_NODE_SET, "pool"),
                (TAG_NODE, "pool-a"),
                (TAG_CLUSTER, "blue"),
            ],
        );
        assert_eq!(
            check_owner(&i, &machine("pool-a", Some("pool")), Some("blue")),
            Ok(())
        );
        let e = check_owner(&i, &machine("pool-b", Some("pool")), Some("blue")).unwrap_err();
        assert!(
            e.contains("instance i is tagged nodekeeper.dev/node=\"pool-a\", not node pool-b"),
            "{e}"
        );
        assert!(e.contains("spec.providerID of node pool-b"), "{e}");
        let e = check_owner(&i, &machine("pool-a", Some("web")), Some("blue")).unwrap_err();
        assert!(
            e.contains("nodekeeper.dev/nodeset=\"pool\", not \"web\""),
            "{e}"
        );
        let e = check_owner(&i, &machine("pool-a", Some("pool")), Some("green")).unwrap_err();
        assert!(e.contains("another cluster's"), "{e}");
        // A kube-node machine: no set, no cluster tag.
        let single = instance("s", "RUNNING", &[(TAG_NODE_SET, ""), (TAG_NODE, "gpu-1")]);
        assert_eq!(check_owner(&single, &machine("gpu-1", None), None), Ok(()));
        assert!(check_owner(&single, &machine("gpu-1", Some("pool")), None).is_err());
        // An instance launched before the cluster tag existed.
        let legacy = instance(
            "l",
            "RUNNING",
            &[(TAG_NODE_SET, "pool"), (TAG_NODE, "pool-a")],
        );
        assert_eq!(
            check_owner(&legacy, &machine("pool-a", Some("pool")), None),
            Ok(())
        );
    }

    #[test]
    fn the_cluster_id_flag_is_checked() {
        assert_eq!(check_cluster_id(None), Ok(None));
        assert_eq!(
            check_cluster_id(Some(" prod-1 ")),
            Ok(Some("prod-1".into()))
        );
        let e = check_cluster_id(Some("")).unwrap_err();
        assert!(
            e.contains("--cluster-id (NODEKEEPER_CLUSTER_ID) is empty"),
            "{e}"
        );
        let e = check_cluster_id(Some(&"x".repeat(257))).unwrap_err();
        assert!(
            e.contains("257 characters") && e.contains("at most 256"),
            "{e}"
        );
    }

    #[test]
    fn refusals_name_the_field() {
        let t = template();
        let service = |status: u16, message: &str| ComputeError::Service {
            operation: "LaunchInstance",
            status,
            code: "x".into(),
            message: message.into(),
            request_id: "r".into(),
            attempts: 1,
        };
        let m = field_of_error(
            &t,
            &service(
                404,
                "Authorization failed or requested resource not found: image ocid1.image.oc1.phx.bbbb.",
            ),
        );
        assert!(m.starts_with("spec.oci.imageId: "), "{m}");
        let m = field_of_error(&t, &service(400, "Shape VM.X is not offered."));
        assert!(m.starts_with("spec.oci.shape: "), "{m}");
        let m = field_of_error(
            &t,
            &service(404, "Authorization failed or requested resource not found."),
        );
        assert!(
            m.contains("spec.oci.compartmentId, spec.oci.imageId or spec.oci.subnetId"),
            "{m}"
        );
        let m = field_of_error(
            &t,
            &ComputeError::OutOfCapacity {
                operation: "LaunchInstance",
                message: "Out of host capacity.".into(),
                request_id: "r".into(),
            },
        );
        assert!(
            m.starts_with(
                "spec.oci.shape: VM.Standard.E5.Flex in availability domain Uocm:PHX-AD-1: "
            ) && m.contains("out of host capacity"),
            "{m}"
        );
    }

    #[test]
    fn listed_instances_become_machines_by_their_tags() {
        let i: Instance = serde_json::from_value(serde_json::json!({
            "id": "ocid1.instance.oc1.phx.dddd", "lifecycleState": "RUNNING",
            "freeformTags": {TAG_NODE_SET: "pool", TAG_NODE: "pool-bcdfg"}
        }))
        .unwrap();
        let m = machine_of(&i).unwrap();
        assert_eq!(m.provider_id, "oci://ocid1.instance.oc1.phx.dddd");
        assert_eq!(m.node_name, "pool-bcdfg");
        assert_eq!(m.node_set.as_deref(), Some("pool"));
    }
}
