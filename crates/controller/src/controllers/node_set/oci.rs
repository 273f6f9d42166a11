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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use nodekeeper_api::crd::node_class::{NodeClassSpec, OciTemplate};
use nodekeeper_api::names::{LABEL_NODE_CLASS, LABEL_NODE_SET};
use nodekeeper_oci::compute::{
    ComputeClient, ComputeError, CreateVnicDetails, Instance, InstanceState, LaunchInstanceDetails,
    ListInstancesFilter, ShapeConfig, SourceDetails, TerminateOptions,
};
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
/// Instance metadata key carrying the Node name, for the bootstrap's `--hostname-override`.
pub const METADATA_NODE_NAME: &str = "nodekeeper_node_name";
/// How long a ListShapes answer is trusted.
const SHAPES_TTL: Duration = Duration::from_secs(600);

type ShapeKey = (String, String, String);

/// Machines as OCI Compute instances.
pub struct OciProvider {
    compute: ComputeClient,
    nodes: Api<Node>,
    /// (compartment, availability domain, image) → shapes offered, and when that was read.
    shapes: Mutex<HashMap<ShapeKey, (Instant, Vec<String>)>>,
}

impl OciProvider {
    pub fn new(compute: ComputeClient, client: kube::Client) -> Self {
        Self {
            compute,
            nodes: Api::all(client),
            shapes: Mutex::default(),
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

/// The LaunchInstance request for a machine.
pub fn launch_details(request: &MachineRequest, t: &OciTemplate) -> LaunchInstanceDetails {
    let mut metadata = t.metadata.clone();
    metadata.insert(METADATA_NODE_NAME.to_owned(), request.node_name.clone());
    let display_name = match &t.display_name_prefix {
        Some(p) => format!("{p}{}", request.node_name),
        None => request.node_name.clone(),
    };
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
        freeform_tags: BTreeMap::from([
            (TAG_NODE_SET.to_owned(), request.node_set.clone()),
            (TAG_NODE.to_owned(), request.node_name.clone()),
            (TAG_NODE_CLASS.to_owned(), request.node_class.clone()),
            (TAG_TEMPLATE_HASH.to_owned(), request.template_hash.clone()),
        ]),
        fault_domain: None,
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
    })
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
            let instance = self
                .compute
                .launch_instance(&launch_details(request, t))
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
                Ok(_) => match self
                    .compute
                    .terminate_instance(&id, &TerminateOptions::default())
                    .await
                {
                    Ok(()) => Deletion::InProgress,
                    Err(e) if e.is_not_found() => Deletion::Gone,
                    Err(e) => return Err(failed(e.to_string())),
                },
            };
            // The instance is going: its Node object goes with it (the cloud controller
            // manager's job on OCI, done here so a set never counts a terminated machine).
            match self
                .nodes
                .delete(&machine.node_name, &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(failed(format!("delete node {}: {e}", machine.node_name))),
            }
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
            // ListInstances cannot filter by tag: list the compartment's instances in the
            // class's availability domain and keep the live ones tagged with the set.
            let all = self
                .compute
                .list_instances(
                    &t.compartment_id,
                    &ListInstancesFilter {
                        availability_domain: Some(t.availability_domain.clone()),
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| ProviderError::List {
                    node_set: node_set.to_owned(),
                    message: field_of_error(t, &e),
                })?;
            Ok(all
                .iter()
                .filter(|i| !i.lifecycle_state.is_terminal())
                .filter(|i| i.freeform_tags.get(TAG_NODE_SET).map(String::as_str) == Some(node_set))
                .filter_map(machine_of)
                .collect())
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
        let d = launch_details(&request(), &template());
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
