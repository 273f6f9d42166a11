//! `NodeClass`: the machine template a `NodeSet` creates nodes from, per provider (OCI compute
//! instances, or kwok-simulated nodes).

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, conditions_schema};

/// How to create a machine: the provider and its template, and the labels and taints every node
/// made from it carries.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeClass",
    plural = "nodeclasses",
    singular = "nodeclass",
    shortname = "ncl",
    category = "nodekeeper",
    status = "NodeClassStatus",
    derive = "PartialEq",
    doc = "A machine template (provider, shape, image, network) that NodeSets create nodes from.",
    printcolumn(name = "Provider", type_ = "string", json_path = ".spec.provider"),
    printcolumn(name = "Shape", type_ = "string", json_path = ".spec.oci.shape"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.provider == 'oci' ? has(self.oci) && !has(self.kwok) : has(self.kwok) && !has(self.oci)",
        "message": "spec: give the template of the provider named in spec.provider (spec.oci or spec.kwok), and only that one"
    }
]))]
pub struct NodeClassSpec {
    /// Where machines come from: `oci` (Compute instances) or `kwok` (simulated nodes, for tests
    /// and demos).
    pub provider: Provider,
    /// The instance template, for `provider: oci`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciTemplate>,
    /// The simulated node template, for `provider: kwok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kwok: Option<KwokTemplate>,
    /// Labels every node made from this class carries (a NodeSet's template may add more).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub labels: BTreeMap<String, String>,
    /// Taints every node made from this class carries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub taints: Vec<Taint>,
}

/// A machine provider.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Provider {
    /// Oracle Cloud Infrastructure Compute instances.
    Oci,
    /// Nodes simulated by kwok (no machine behind them).
    Kwok,
}

/// The fields of an OCI `LaunchInstance` request that nodekeeper sets.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciTemplate {
    /// The compartment's OCID.
    #[schemars(
        length(max = 255),
        regex(pattern = r"^ocid1\.(compartment|tenancy)\.[a-z0-9][a-z0-9.-]*$")
    )]
    pub compartment_id: String,
    /// The availability domain, e.g. `Uocm:PHX-AD-1`.
    #[schemars(length(min = 1, max = 255))]
    pub availability_domain: String,
    /// The shape, e.g. `VM.Standard.E5.Flex` or `BM.Standard3.64`.
    #[schemars(
        length(min = 1, max = 255),
        regex(pattern = r"^(VM|BM)\.[A-Za-z0-9.]+$")
    )]
    pub shape: String,
    /// For flexible shapes: OCPUs and memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape_config: Option<ShapeConfig>,
    /// The boot image's OCID.
    #[schemars(
        length(max = 255),
        regex(pattern = r"^ocid1\.image\.[a-z0-9][a-z0-9.-]*$")
    )]
    pub image_id: String,
    /// The primary VNIC's subnet OCID.
    #[schemars(
        length(max = 255),
        regex(pattern = r"^ocid1\.subnet\.[a-z0-9][a-z0-9.-]*$")
    )]
    pub subnet_id: String,
    /// Instance metadata (e.g. `user_data` base64 cloud-init, `ssh_authorized_keys`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub metadata: BTreeMap<String, String>,
    /// Prefix of the instances' display names (the rest is the node's name suffix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub display_name_prefix: Option<String>,
}

/// Flexible shape sizing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShapeConfig {
    /// OCPUs.
    #[schemars(range(min = 1, max = 512))]
    pub ocpus: f64,
    /// Memory in gigabytes.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "memoryInGBs"
    )]
    #[schemars(range(min = 1, max = 8192))]
    pub memory_in_gbs: Option<f64>,
}

/// A simulated node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KwokTemplate {
    /// The node's capacity (and allocatable), e.g. `cpu: "8"`, `memory: 32Gi`, `pods: "110"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    pub capacity: BTreeMap<String, String>,
}

/// A node taint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    /// The taint key.
    #[schemars(length(min = 1, max = 317))]
    pub key: String,
    /// The taint value.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 63))]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: TaintEffect,
}

/// What a taint does to pods that do not tolerate it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

/// Whether the class can be used.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeClassStatus {
    /// `Ready`: the template was checked with the provider.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_class_round_trips() {
        let spec: NodeClassSpec = serde_json::from_value(serde_json::json!({
            "provider": "oci",
            "oci": {
                "compartmentId": "ocid1.compartment.oc1..aaaa",
                "availabilityDomain": "Uocm:PHX-AD-1",
                "shape": "VM.Standard.E5.Flex",
                "shapeConfig": {"ocpus": 2, "memoryInGBs": 16},
                "imageId": "ocid1.image.oc1.phx.aaaa",
                "subnetId": "ocid1.subnet.oc1.phx.aaaa"
            },
            "taints": [{"key": "gpu", "effect": "NoSchedule"}]
        }))
        .unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["oci"]["shapeConfig"]["memoryInGBs"], 16.0);
        let back: NodeClassSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, spec);
    }
}
