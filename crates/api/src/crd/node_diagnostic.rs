//! `NodeDiagnostic`: a request for troubleshooting bundles from one node or a bounded set of nodes,
//! and the small status that says where each bundle can be downloaded. The bundles themselves live
//! on the controller's disk, never in etcd.

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, FieldError, LabelSelector, check_selector, conditions_schema};
pub use nodekeeper_model::diagnostics::{MAX_NODES, PARTS};

/// Gathers a diagnostics bundle (kernel log, journal tails, network state, sysctls, sockets,
/// disks, plugin and GPU state, the agent's report) from each selected node. The controller keeps
/// the bundles on its own disk and serves them over its HTTP API; the status lists each node's
/// bundle size, SHA-256 and download path. A NodeDiagnostic is one collection: its spec cannot
/// change.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeDiagnostic",
    plural = "nodediagnostics",
    singular = "nodediagnostic",
    shortname = "ndiag",
    category = "nodekeeper",
    namespaced,
    status = "NodeDiagnosticStatus",
    derive = "PartialEq",
    doc = "Diagnostics bundles collected from selected nodes, kept on the controller's disk.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".status.nodeCount"),
    printcolumn(name = "Failed", type_ = "integer", json_path = ".status.failedCount"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self == oldSelf",
        "message": "spec is immutable: a NodeDiagnostic is one collection; create a new one to collect again"
    },
    {
        "rule": "has(self.nodeName) != has(self.nodeSelector)",
        "message": "spec: set exactly one of nodeName and nodeSelector"
    }
]))]
pub struct NodeDiagnosticSpec {
    /// The one node to collect from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub node_name: Option<String>,
    /// The nodes to collect from; it must match at most 50 nodes (the controller refuses a
    /// selector that matches more, naming this field). An empty selector matches every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// The parts to gather; empty means the tuning ConfigMap's `diagnostics.parts` (default: all).
    /// Known parts: report, kernel-log, journal, network, nodekeeper-network, sysctl, sockets,
    /// disk, oca, gpu, node-files.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(min = 1, max = 64)))]
    pub parts: Vec<String>,
    /// Seconds after the collection finishes before the controller deletes this object and its
    /// bundles.
    #[serde(default = "default_ttl")]
    #[schemars(range(min = 0, max = 604800))]
    pub ttl_seconds_after_finished: u32,
}

fn default_ttl() -> u32 {
    3600
}

impl NodeDiagnosticSpec {
    /// Checks what the schema cannot: part names, one way to name nodes, and the selector's keys
    /// and values as the API server checks them (a selector it would refuse could never list
    /// nodes). Errors name the field.
    pub fn validate(&self) -> Result<(), FieldError> {
        for (i, part) in self.parts.iter().enumerate() {
            if let Err(e) = nodekeeper_model::diagnostics::check_parts(&[part]) {
                return Err(FieldError::new(format!("spec.parts[{i}]"), e.to_string()));
            }
        }
        match (&self.node_name, &self.node_selector) {
            (Some(_), None) => Ok(()),
            (None, Some(selector)) => check_selector("spec.nodeSelector", selector),
            _ => Err(FieldError::new(
                "spec.nodeName",
                "set exactly one of spec.nodeName and spec.nodeSelector",
            )),
        }
    }
}

/// Where a collection, or one node's part of it, is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Accepted, not started.
    Pending,
    /// Bundles are being collected.
    Running,
    /// Every selected node's bundle is stored (for a node: its bundle is stored).
    Succeeded,
    /// The spec was refused, or some node's bundle could not be collected (see `nodes[].reason`).
    Failed,
}

/// One node's bundle.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeBundle {
    /// The Node's name.
    #[schemars(length(max = 253))]
    pub node: String,
    /// `Succeeded` or `Failed` (`Running` while collecting).
    pub phase: Phase,
    /// Size of the `.tar.gz` bundle in bytes.
    #[serde(default)]
    pub size_bytes: u64,
    /// SHA-256 of the bundle, hex: compare with `sha256sum` of the download.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 64))]
    pub sha256: String,
    /// The controller HTTP API path of the bundle
    /// (`/api/diagnostics/<namespace>/<name>/<node>/<token>`); prefix it with the service proxy
    /// path to download through the API server. The last segment is a random token recorded with
    /// the bundle: the path is the capability to download it, so whoever can read this status can
    /// download the bundle, and a path without the right token answers 404.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 1024))]
    pub download_path: String,
    /// Why the node failed (or which parts failed inside its bundle).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 1024))]
    pub reason: String,
}

/// The collection's outcome. Written when it changes only.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeDiagnosticStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Nodes selected.
    #[serde(default)]
    pub node_count: u32,
    /// Nodes whose bundle could not be collected.
    #[serde(default)]
    pub failed_count: u32,
    /// One entry per selected node (at most 50: the selector cap).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub nodes: Vec<NodeBundle>,
    /// When the collection finished (RFC 3339); the TTL counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub completion_time: Option<String>,
    /// `SpecValid` (False with reason `InvalidSpec` naming the field), `Complete`, and
    /// `StorageAvailable` (False when older bundles were evicted, or this one refused, for lack
    /// of room on the controller's disk).
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

    fn spec(v: serde_json::Value) -> NodeDiagnosticSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn defaults_and_round_trip() {
        let s = spec(serde_json::json!({"nodeName": "n1"}));
        assert_eq!(s.ttl_seconds_after_finished, 3600);
        assert!(s.parts.is_empty());
        s.validate().unwrap();
        let mut d = NodeDiagnostic::new("d", s);
        d.status = Some(NodeDiagnosticStatus {
            phase: Some(Phase::Succeeded),
            node_count: 1,
            nodes: vec![NodeBundle {
                node: "n1".into(),
                phase: Phase::Succeeded,
                size_bytes: 10,
                sha256: "ab".into(),
                download_path: "/api/diagnostics/ns/d/n1/0123456789abcdef0123456789abcdef".into(),
                reason: String::new(),
            }],
            ..Default::default()
        });
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(
            json["status"]["nodes"][0]["downloadPath"],
            "/api/diagnostics/ns/d/n1/0123456789abcdef0123456789abcdef"
        );
        assert_eq!(serde_json::from_value::<NodeDiagnostic>(json).unwrap(), d);
    }

    #[test]
    fn unknown_part_is_refused_naming_the_field() {
        let err = spec(serde_json::json!({"nodeName": "n1", "parts": ["report", "dmesg"]}))
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "spec.parts[1]");
        assert!(err.message.contains("\"dmesg\""), "{err}");
    }

    #[test]
    fn a_selector_the_api_server_would_refuse_is_refused_naming_the_field() {
        for (selector, field, needle) in [
            (
                serde_json::json!({"matchLabels": {"pool": "gpu", "Bad Key": "x"}}),
                "spec.nodeSelector.matchLabels[\"Bad Key\"]",
                "label key",
            ),
            (
                serde_json::json!({"matchLabels": {"pool": "-gpu"}}),
                "spec.nodeSelector.matchLabels[\"pool\"]",
                "label value",
            ),
            (
                serde_json::json!({"matchExpressions": [
                    {"key": "zone", "operator": "Exists"},
                    {"key": "tier", "operator": "In", "values": ["web", "db_"]},
                ]}),
                "spec.nodeSelector.matchExpressions[1]",
                "label value",
            ),
            (
                serde_json::json!({"matchExpressions": [{"key": "zone", "operator": "In"}]}),
                "spec.nodeSelector.matchExpressions[0].values",
                "at least one value",
            ),
        ] {
            let err = spec(serde_json::json!({"nodeSelector": selector}))
                .validate()
                .unwrap_err();
            assert_eq!(err.field, field, "{err}");
            assert!(err.message.contains(needle), "{err}");
        }
        spec(serde_json::json!({"nodeSelector": {
            "matchLabels": {"nodekeeper.dev/pool": "gpu-1"},
            "matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}],
        }}))
        .validate()
        .unwrap();
        spec(serde_json::json!({"nodeSelector": {}}))
            .validate()
            .unwrap();
    }

    #[test]
    fn exactly_one_way_to_name_nodes() {
        let err = spec(serde_json::json!({})).validate().unwrap_err();
        assert_eq!(err.field, "spec.nodeName");
    }
}
