//! `NodeNetworkConfig`: desired secondary VNICs and host interfaces for the nodes a selector picks,
//! rolled out a few nodes at a time, with counts and the failing nodes in status.

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, FieldError, IntOrPercent, LabelSelector, conditions_schema};
use nodekeeper_model::network::{NetworkState, RULE_PRIORITY_MAX, RULE_PRIORITY_MIN};

/// Host network configuration for the nodes `nodeSelector` picks: the OCI secondary-VNIC layout
/// derived from each node's instance metadata (`ociVnics`), and/or an explicit `state` of links,
/// addresses, routes and rules. Applied by each node's agent, at most `maxUnavailable` nodes at a
/// time; a node whose post-apply check fails is rolled back and listed in status.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeNetworkConfig",
    plural = "nodenetworkconfigs",
    singular = "nodenetworkconfig",
    shortname = "nnc",
    category = "nodekeeper",
    status = "NodeNetworkConfigStatus",
    derive = "PartialEq",
    doc = "Desired host networking (OCI secondary VNICs, links, addresses, routes, rules) for selected nodes.",
    printcolumn(name = "Matched", type_ = "integer", json_path = ".status.matched"),
    printcolumn(name = "Applied", type_ = "integer", json_path = ".status.applied"),
    printcolumn(name = "Failing", type_ = "integer", json_path = ".status.failing"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "has(self.ociVnics) || has(self.state)",
        "message": "spec: set ociVnics, state, or both; an empty configuration changes nothing"
    }
]))]
pub struct NodeNetworkConfigSpec {
    /// The nodes this configuration applies to. Required; write `{}` to pick every node.
    pub node_selector: LabelSelector,
    /// Configure every secondary VNIC the node's instance metadata lists (VM: the NIC with the
    /// VNIC's MAC; bare metal: macvlan + VLAN on the physical NIC), each with its own routing
    /// table and source rules. The primary VNIC and 169.254.0.0/16 are never touched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_vnics: Option<OciVnics>,
    /// Links, addresses, routes and rules applied to every selected node, in addition to
    /// `ociVnics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<NetworkState>,
    /// The most selected nodes that may be applying (or failing) at once: a count or a percentage
    /// of the selected nodes (rounded down, at least 1).
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrPercent,
    /// After applying, each of these `address` or `address:port` targets must answer (ICMP, or TCP
    /// connect when a port is given) from the node, or the change is rolled back. Empty: no check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(
            length(min = 1, max = 64),
            regex(pattern = r"^([0-9.]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+)(:[0-9]{1,5})?$")
        )
    )]
    pub check_targets: Vec<String>,
    /// Timeout of the whole post-apply check, in milliseconds.
    #[serde(default = "default_check_timeout_ms")]
    #[schemars(range(min = 100, max = 60000))]
    pub check_timeout_ms: u32,
}

fn default_max_unavailable() -> IntOrPercent {
    IntOrPercent::Int(1)
}
fn default_check_timeout_ms() -> u32 {
    5000
}

/// Layout knobs of the OCI secondary VNICs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciVnics {
    /// MTU of the VNIC interfaces (OCI's is 9000).
    #[serde(default = "default_mtu")]
    #[schemars(range(min = 576, max = 9000))]
    pub mtu: u32,
    /// VNIC number `i` (its position in the metadata answer) uses routing table `tableBase + i`.
    #[serde(default = "default_table_base")]
    #[schemars(range(min = 1, max = 200))]
    pub table_base: u32,
    /// The rule keeping the metadata service on the primary VNIC uses this priority; VNIC `i`
    /// uses `rulePriorityBase + i`. Must leave room within nodekeeper's range 20000–20999.
    #[serde(default = "default_rule_priority_base")]
    #[schemars(range(min = 20000, max = 20900))]
    pub rule_priority_base: u32,
}

impl Default for OciVnics {
    fn default() -> Self {
        Self {
            mtu: default_mtu(),
            table_base: default_table_base(),
            rule_priority_base: default_rule_priority_base(),
        }
    }
}

fn default_mtu() -> u32 {
    9000
}
fn default_table_base() -> u32 {
    100
}
fn default_rule_priority_base() -> u32 {
    20100
}

impl NodeNetworkConfigSpec {
    /// Everything the schema cannot check: the network state's own rules (references between
    /// links, address syntax, reserved ranges) and the selector. Each error names its field.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        self.node_selector
            .validate("spec.nodeSelector", &mut errors);
        if self.oci_vnics.is_none() && self.state.is_none() {
            errors.push(FieldError::new(
                "spec",
                "set ociVnics, state, or both; an empty configuration changes nothing",
            ));
        }
        if let Some(v) = &self.oci_vnics {
            // VNIC rules take rulePriorityBase + index; leave room for 100 VNICs inside the reserved range.
            if v.rule_priority_base < RULE_PRIORITY_MIN
                || v.rule_priority_base > RULE_PRIORITY_MAX - 99
            {
                errors.push(FieldError::new(
                    "spec.ociVnics.rulePriorityBase",
                    format!(
                        "{} leaves no room for the VNIC rules; use {RULE_PRIORITY_MIN}–{}",
                        v.rule_priority_base,
                        RULE_PRIORITY_MAX - 99
                    ),
                ));
            }
        }
        if let Some(state) = &self.state
            && let Err(problems) = state.validate()
        {
            errors.extend(
                problems
                    .into_iter()
                    .map(|p| FieldError::new(format!("spec.state.{}", p.path), p.message)),
            );
        }
        for (i, target) in self.check_targets.iter().enumerate() {
            if parse_check_target(target).is_none() {
                errors.push(FieldError::new(
                    format!("spec.checkTargets[{i}]"),
                    format!("{target:?} is not an address or address:port (IPv6 with a port as [address]:port)"),
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// Parses a check target (`10.0.0.1`, `10.0.0.1:443`, `fd00::1`, `[fd00::1]:443`).
pub fn parse_check_target(s: &str) -> Option<(std::net::IpAddr, Option<u16>)> {
    if let Ok(ip) = s.parse() {
        return Some((ip, None));
    }
    let sa: std::net::SocketAddr = s.parse().ok()?;
    (sa.port() != 0).then_some((sa.ip(), Some(sa.port())))
}

/// One node where the configuration is not in force.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailingNode {
    /// The node's name.
    #[schemars(length(max = 253))]
    pub node: String,
    /// What went wrong (the failing step, or why the agent could not be asked).
    #[schemars(length(max = 1024))]
    pub error: String,
    /// Whether the node was returned to its previous state.
    #[serde(default)]
    pub rolled_back: bool,
}

/// Rollout counts and the failing nodes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeNetworkConfigStatus {
    /// Nodes the selector picks.
    #[serde(default)]
    pub matched: u32,
    /// Nodes where this generation is applied and the check passed.
    #[serde(default)]
    pub applied: u32,
    /// Nodes where applying failed.
    #[serde(default)]
    pub failing: u32,
    /// Failing nodes, at most 50 (the rest are counted in `omittedFailing`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub failing_nodes: Vec<FailingNode>,
    /// Failing nodes not listed in `failingNodes`.
    #[serde(default)]
    pub omitted_failing: u32,
    /// `Ready` (every matched node applied) and `Progressing`.
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
    fn defaults_and_validation() {
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {"matchLabels": {"pool": "gpu"}},
            "ociVnics": {},
            "checkTargets": ["10.0.0.1", "[fd00::1]:443", "10.0.0.2:0", "nope"],
        }))
        .unwrap();
        assert_eq!(spec.max_unavailable, IntOrPercent::Int(1));
        assert_eq!(spec.oci_vnics, Some(OciVnics::default()));
        assert_eq!(spec.check_timeout_ms, 5000);
        let errors = spec.validate().unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.checkTargets[2]", "spec.checkTargets[3]"]);
    }

    #[test]
    fn state_errors_are_prefixed_with_the_field() {
        let spec: NodeNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {},
            "state": {"addresses": [{"link": "missing", "cidr": "10.0.0.5/24"}]},
        }))
        .unwrap();
        let errors = spec.validate().unwrap_err();
        assert!(
            errors.iter().all(|e| e.field.starts_with("spec.state.")),
            "{errors:?}"
        );
        assert!(!errors.is_empty());
    }

    #[test]
    fn empty_configuration_is_refused() {
        let spec: NodeNetworkConfigSpec =
            serde_json::from_value(serde_json::json!({"nodeSelector": {}})).unwrap();
        let errors = spec.validate().unwrap_err();
        assert_eq!(errors[0].field, "spec");
    }

    #[test]
    fn node_selector_is_required() {
        let err =
            serde_json::from_value::<NodeNetworkConfigSpec>(serde_json::json!({"ociVnics": {}}))
                .unwrap_err();
        assert!(err.to_string().contains("nodeSelector"), "{err}");
    }
}
