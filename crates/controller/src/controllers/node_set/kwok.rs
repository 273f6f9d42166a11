//! The kwok provider: a machine is a Node object that kwok simulates (heartbeats, pod
//! lifecycles). Creating the machine is creating the Node, with the set's record on it; deleting
//! it is deleting the Node. A Node a user created (kube-node, [`MachineRequest::adopts_node`])
//! is adopted instead: kwok's label, the class's capacity and the providerID are written on it.

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::node_class::NodeClassSpec;
use nodekeeper_api::names::LABEL_NODE_SET;
use serde_json::json;

use super::provider::{Deletion, Machine, MachineRequest, Provider, ProviderError, node_record};

/// The label kwok must be started to manage (`--manage-nodes-with-label-selector`); kwok leaves
/// nodes without it alone, so the provider puts it on every node it creates.
pub const KWOK_MANAGED_LABEL: &str = "nodekeeper.dev/simulated";
/// The `spec.providerID` scheme of kwok machines.
pub const PROVIDER_ID_PREFIX: &str = "kwok://";

/// Machines as kwok-simulated Node objects.
pub struct KwokProvider {
    nodes: Api<Node>,
}

impl KwokProvider {
    pub fn new(client: kube::Client) -> Self {
        Self {
            nodes: Api::all(client),
        }
    }
}

/// Labels kwok's nodes carry (where the Node has none of its own).
const KWOK_LABELS: [(&str, &str); 3] = [
    ("kubernetes.io/os", "linux"),
    ("kubernetes.io/arch", "amd64"),
    ("type", "kwok"),
];

/// The class's capacity (kwok keeps what the Node is given as capacity and allocatable).
fn capacity(request: &MachineRequest) -> std::collections::BTreeMap<String, String> {
    request
        .class
        .kwok
        .as_ref()
        .map(|k| k.capacity.clone())
        .unwrap_or_default()
}

/// The Node object for a request: the machine's record ([`node_record`]) plus kwok's label,
/// hostname, os and arch labels, and the class's capacity as capacity and allocatable (kwok
/// keeps what the Node is created with).
pub fn node_object(request: &MachineRequest) -> serde_json::Value {
    let mut node = node_record(
        request,
        &format!("{PROVIDER_ID_PREFIX}{}", request.node_name),
    );
    let labels = &mut node["metadata"]["labels"];
    for (k, v) in KWOK_LABELS {
        if labels.get(k).is_none() {
            labels[k] = json!(v);
        }
    }
    labels[KWOK_MANAGED_LABEL] = json!("true");
    let capacity = capacity(request);
    if !capacity.is_empty() {
        node["status"] = json!({ "capacity": capacity, "allocatable": capacity });
    }
    node
}

/// Field manager of the kwok provider's adoption writes (kept apart from the controllers' own
/// server-side apply sets, so neither removes what the other wrote).
pub const MANAGER_KWOK_ADOPT: &str = "nodekeeper-kwok";

/// What adopting an existing Node writes: kwok's label, the os/arch/type labels kwok's nodes
/// carry and the hostname label, each only where the Node has none, and the providerID
/// (metadata and spec); the class's capacity as capacity and allocatable (status), if any.
pub fn adopt_patches(
    request: &MachineRequest,
    existing: &std::collections::BTreeMap<String, String>,
) -> (serde_json::Value, Option<serde_json::Value>) {
    let mut labels = serde_json::Map::new();
    let hostname = ("kubernetes.io/hostname", request.node_name.as_str());
    for (k, v) in std::iter::once(hostname).chain(KWOK_LABELS) {
        if !existing.contains_key(k) {
            labels.insert(k.to_owned(), json!(v));
        }
    }
    labels.insert(KWOK_MANAGED_LABEL.to_owned(), json!("true"));
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": request.node_name, "labels": labels },
        "spec": { "providerID": format!("{PROVIDER_ID_PREFIX}{}", request.node_name) },
    });
    let capacity = capacity(request);
    let status = (!capacity.is_empty()).then(|| {
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": request.node_name },
            "status": { "capacity": capacity, "allocatable": capacity },
        })
    });
    (node, status)
}

impl KwokProvider {
    /// Makes an existing Node (a user created it) kwok's machine: capacity first, then the
    /// label kwok manages nodes by (kwok starts running it) and the providerID. Idempotent; a
    /// Node that names another machine is refused.
    async fn adopt(&self, request: &MachineRequest) -> Result<Machine, ProviderError> {
        let failed = |message: String| ProviderError::Create {
            node: request.node_name.clone(),
            message,
        };
        let own_id = format!("{PROVIDER_ID_PREFIX}{}", request.node_name);
        let node = self
            .nodes
            .get_opt(&request.node_name)
            .await
            .map_err(|e| failed(e.to_string()))?
            .ok_or_else(|| failed(format!("node {} does not exist", request.node_name)))?;
        let current = node.spec.as_ref().and_then(|s| s.provider_id.clone());
        if current.as_ref().is_some_and(|id| *id != own_id) {
            return Err(failed(format!(
                "node {} has spec.providerID {}; it is another machine",
                request.node_name,
                current.unwrap_or_default()
            )));
        }
        let managed = node.labels().get(KWOK_MANAGED_LABEL).map(String::as_str) == Some("true");
        if current.is_none() || !managed {
            let params = PatchParams::apply(MANAGER_KWOK_ADOPT).force();
            let (mut meta, status) = adopt_patches(request, node.labels());
            // On this Node only: without the uid, an apply to a Node deleted meanwhile would
            // create a new one.
            meta["metadata"]["uid"] = json!(node.uid());
            if let Some(status) = status {
                self.nodes
                    .patch_status(&request.node_name, &params, &Patch::Apply(&status))
                    .await
                    .map_err(|e| failed(e.to_string()))?;
            }
            self.nodes
                .patch(&request.node_name, &params, &Patch::Apply(&meta))
                .await
                .map_err(|e| failed(e.to_string()))?;
        }
        Ok(Machine {
            node_name: request.node_name.clone(),
            provider_id: own_id,
            node_set: None,
            created: None,
        })
    }
}

fn machine_of(node: &Node) -> Option<Machine> {
    let provider_id = node.spec.as_ref()?.provider_id.clone()?;
    provider_id
        .starts_with(PROVIDER_ID_PREFIX)
        .then(|| Machine {
            node_name: node.name_any(),
            provider_id,
            node_set: node.labels().get(LABEL_NODE_SET).cloned(),
            created: None,
        })
}

fn name_of(provider_id: &str) -> &str {
    provider_id
        .strip_prefix(PROVIDER_ID_PREFIX)
        .unwrap_or(provider_id)
}

impl Provider for KwokProvider {
    fn kind(&self) -> &'static str {
        "kwok"
    }

    fn create<'a>(
        &'a self,
        request: &'a MachineRequest,
    ) -> BoxFuture<'a, Result<Machine, ProviderError>> {
        Box::pin(async move {
            if request.adopts_node() {
                return self.adopt(request).await;
            }
            let failed = |message: String| ProviderError::Create {
                node: request.node_name.clone(),
                message,
            };
            let node: Node =
                serde_json::from_value(node_object(request)).map_err(|e| failed(e.to_string()))?;
            match self.nodes.create(&PostParams::default(), &node).await {
                Ok(node) => {
                    machine_of(&node).ok_or_else(|| failed("created node has no providerID".into()))
                }
                // Idempotent: the machine exists already (a retry after a lost answer). Only a
                // node of this set is taken for it; another's name is a real conflict.
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    let existing = self
                        .nodes
                        .get(&request.node_name)
                        .await
                        .map_err(|e| failed(e.to_string()))?;
                    match machine_of(&existing) {
                        Some(m) if m.node_set.as_deref() == Some(request.node_set.as_str()) => {
                            Ok(m)
                        }
                        _ => Err(failed(format!(
                            "a node named {} exists and is not a machine of nodeset {}",
                            request.node_name, request.node_set
                        ))),
                    }
                }
                Err(kube::Error::Api(s)) => Err(failed(s.message)),
                Err(e) => Err(failed(e.to_string())),
            }
        })
    }

    fn delete<'a>(
        &'a self,
        machine: &'a Machine,
    ) -> BoxFuture<'a, Result<Deletion, ProviderError>> {
        Box::pin(async move {
            match self
                .nodes
                .delete(name_of(&machine.provider_id), &DeleteParams::default())
                .await
            {
                Ok(either) => Ok(if either.is_left() {
                    Deletion::InProgress
                } else {
                    Deletion::Gone
                }),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(Deletion::Gone),
                Err(e) => Err(ProviderError::Delete {
                    id: machine.provider_id.clone(),
                    message: e.to_string(),
                }),
            }
        })
    }

    fn get<'a>(
        &'a self,
        provider_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Machine>, ProviderError>> {
        Box::pin(async move {
            self.nodes
                .get_opt(name_of(provider_id))
                .await
                .map(|n| n.as_ref().and_then(machine_of))
                .map_err(|e| ProviderError::Get {
                    id: provider_id.to_owned(),
                    message: e.to_string(),
                })
        })
    }

    fn machine_is_node(&self) -> bool {
        true
    }

    fn list<'a>(
        &'a self,
        node_set: &'a str,
        _class: &'a NodeClassSpec,
    ) -> BoxFuture<'a, Result<Vec<Machine>, ProviderError>> {
        Box::pin(async move {
            let params = ListParams::default().labels(&format!("{LABEL_NODE_SET}={node_set}"));
            self.nodes
                .list(&params)
                .await
                .map(|l| l.items.iter().filter_map(machine_of).collect())
                .map_err(|e| ProviderError::List {
                    node_set: node_set.to_owned(),
                    message: e.to_string(),
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodekeeper_api::crd::node_class::{KwokTemplate, Provider as Kind, Taint, TaintEffect};
    use nodekeeper_api::crd::node_set::ANNOTATION_TEMPLATE_HASH;
    use nodekeeper_api::names::LABEL_NODE_CLASS;
    use std::collections::BTreeMap;

    #[test]
    fn the_node_carries_the_record() {
        let request = MachineRequest {
            node_name: "pool-abcde".into(),
            node_set: "pool".into(),
            node_class: "small".into(),
            template_hash: "0123456789".into(),
            labels: BTreeMap::from([("tier".into(), "web".into())]),
            taints: vec![Taint {
                key: "gpu".into(),
                value: String::new(),
                effect: TaintEffect::NoSchedule,
            }],
            class: NodeClassSpec {
                provider: Kind::Kwok,
                oci: None,
                kwok: Some(KwokTemplate {
                    capacity: BTreeMap::from([("cpu".into(), "8".into())]),
                }),
                labels: BTreeMap::new(),
                taints: Vec::new(),
            },
        };
        let node: Node = serde_json::from_value(node_object(&request)).unwrap();
        assert_eq!(node.labels()[LABEL_NODE_SET], "pool");
        assert_eq!(node.labels()[LABEL_NODE_CLASS], "small");
        assert_eq!(node.labels()[KWOK_MANAGED_LABEL], "true");
        assert_eq!(node.labels()["tier"], "web");
        assert_eq!(node.annotations()[ANNOTATION_TEMPLATE_HASH], "0123456789");
        let spec = node.spec.as_ref().unwrap();
        assert_eq!(spec.provider_id.as_deref(), Some("kwok://pool-abcde"));
        assert_eq!(spec.taints.as_ref().unwrap()[0].effect, "NoSchedule");
        let m = machine_of(&node).unwrap();
        assert_eq!(m.node_set.as_deref(), Some("pool"));
        assert_eq!(name_of(&m.provider_id), "pool-abcde");

        // Adopting a user's Node keeps the labels it has and adds kwok's and the capacity.
        let adopting = MachineRequest {
            node_set: String::new(),
            ..request
        };
        assert!(adopting.adopts_node());
        let existing = BTreeMap::from([("kubernetes.io/arch".to_owned(), "arm64".to_owned())]);
        let (meta, status) = adopt_patches(&adopting, &existing);
        let labels = &meta["metadata"]["labels"];
        assert_eq!(labels[KWOK_MANAGED_LABEL], "true");
        assert_eq!(labels["kubernetes.io/hostname"], "pool-abcde");
        assert!(labels.get("kubernetes.io/arch").is_none());
        assert!(labels.get(LABEL_NODE_SET).is_none());
        assert_eq!(meta["spec"]["providerID"], "kwok://pool-abcde");
        assert_eq!(status.unwrap()["status"]["allocatable"]["cpu"], "8");
    }
}
