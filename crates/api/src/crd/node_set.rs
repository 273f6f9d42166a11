//! `NodeSet`: a desired number of nodes made from a `NodeClass`, replaced and scaled within surge
//! and unavailability limits; nodes are drained (the `NodeMaintenance` way) before removal.

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;
use std::time::Duration;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    Condition, DURATION_PATTERN, FieldError, IntOrPercent, conditions_schema, parse_duration_field,
};
use super::node_class::Taint;
use super::node_maintenance::{MAX_DRAIN_TIMEOUT, OnTimeout};

/// Annotation on a Node made by a NodeSet: the hash of the NodeClass spec and the set's template
/// it was made from; a node whose hash differs from the current one is replaced (rolling).
pub const ANNOTATION_TEMPLATE_HASH: &str = "nodekeeper.dev/template-hash";
/// Annotation on a NodeMaintenance a NodeSet created to drain one of its nodes: the node's name.
pub const ANNOTATION_DRAINED_NODE: &str = "nodekeeper.dev/nodeset-node";
/// Condition reason: the NodeClass the set names does not exist.
pub const REASON_NODE_CLASS_NOT_FOUND: &str = "NodeClassNotFound";
/// Condition reason: `spec.replicas` is above the controller's cap.
pub const REASON_ABOVE_CAP: &str = "ReplicasAboveCap";
/// Condition reason: the provider refused to create machines; the message has its error.
pub const REASON_PROVIDER_FAILED: &str = "ProviderFailed";
/// Condition reason: a node's drain failed or was refused; the scale-down waits.
pub const REASON_SCALE_DOWN_BLOCKED: &str = "ScaleDownBlocked";
/// Condition reason: more of the set is unhealthy than `spec.repair.maxUnhealthy`; repair waits.
pub const REASON_REPAIR_HALTED: &str = "RepairHalted";
/// Condition reason: new machines do not join; the rollout waits.
pub const REASON_ROLLOUT_STALLED: &str = "RolloutStalled";

/// Keeps `replicas` nodes made from the NodeClass `nodeClassName`. Scaling down (and replacing a
/// node) cordons and drains the node first, then removes its machine.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeSet",
    plural = "nodesets",
    singular = "nodeset",
    shortname = "nset",
    category = "nodekeeper",
    status = "NodeSetStatus",
    derive = "PartialEq",
    doc = "A desired number of nodes made from a NodeClass, with surge/unavailable limits and drain before removal.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Class", type_ = "string", json_path = ".spec.nodeClassName"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Current", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "Updated",
        type_ = "integer",
        json_path = ".status.updatedReplicas"
    ),
    printcolumn(
        name = "Draining",
        type_ = "integer",
        json_path = ".status.drainingReplicas"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
        "message": "spec.maxSurge and spec.maxUnavailable cannot both be zero: nodes could never be replaced; raise one of them"
    }
]))]
pub struct NodeSetSpec {
    /// The NodeClass nodes are made from.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub node_class_name: String,
    /// The number of nodes wanted.
    #[schemars(range(min = 0, max = 10000))]
    pub replicas: u32,
    /// How many nodes above `replicas` may exist while replacing: a count or a percentage of
    /// `replicas` (rounded up).
    #[serde(default = "default_max_surge")]
    pub max_surge: IntOrPercent,
    /// How many of the `replicas` nodes may be missing or not ready while replacing: a count or a
    /// percentage of `replicas` (rounded down).
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrPercent,
    /// What the set adds to each node on top of its NodeClass.
    #[serde(default, skip_serializing_if = "NodeTemplate::is_empty")]
    pub template: NodeTemplate,
    /// How a node leaves: drained, then removed.
    #[serde(default)]
    pub scale_down: ScaleDown,
    /// Replacing unhealthy nodes (off unless `notReadyAfter` is set).
    #[serde(default, skip_serializing_if = "Repair::is_off")]
    pub repair: Repair,
}

/// Bounded repair: a node unhealthy for longer than `notReadyAfter` is drained and replaced, but
/// only while at most `maxUnhealthy` of the set is unhealthy (as Karpenter stops at 20 %: when
/// many nodes fail at once the cause is rarely the nodes, and replacing them all would make it
/// worse).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Repair {
    /// How long a node may be unhealthy (Ready not `True`, or one of `conditions` `False`)
    /// before it is replaced, e.g. `10m`. Unset: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub not_ready_after: Option<String>,
    /// Node condition types (nodekeeper's: `NodekeeperReachable`, `NodeNetworkReady`,
    /// `TunablesInBounds`, `GpuHealthy`) whose status `False` also makes a node unhealthy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(max = 63)))]
    pub conditions: Vec<String>,
    /// The most unhealthy nodes (a count, or a percentage of `replicas`, rounded down, at least
    /// one) for which repair goes on; above it repair stops with a condition. Default 20%.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unhealthy: Option<IntOrPercent>,
}

impl Repair {
    fn is_off(&self) -> bool {
        self == &Self::default()
    }

    /// The repair delay, if repair is on.
    pub fn after(&self) -> Result<Option<Duration>, FieldError> {
        self.not_ready_after
            .as_deref()
            .map(|d| parse_duration_field("spec.repair.notReadyAfter", d))
            .transpose()
    }

    /// The most unhealthy nodes repair goes on with, for `replicas`.
    pub fn max_unhealthy(&self, replicas: u32) -> u32 {
        self.max_unhealthy
            .unwrap_or(IntOrPercent::Percent(20))
            .resolve(replicas, false)
            .max(1)
    }
}

fn default_max_surge() -> IntOrPercent {
    IntOrPercent::Int(1)
}
fn default_max_unavailable() -> IntOrPercent {
    IntOrPercent::Int(0)
}

/// Labels and taints the set adds to its nodes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeTemplate {
    /// Labels added to each node (on top of the NodeClass's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub labels: BTreeMap<String, String>,
    /// Taints added to each node (on top of the NodeClass's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub taints: Vec<Taint>,
}

impl NodeTemplate {
    fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.taints.is_empty()
    }
}

/// How a node is taken out of the set.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleDown {
    /// How long the node's drain may take (units ms, s, m, h; at most 168h), as
    /// `NodeMaintenance.spec.drainTimeout`.
    #[serde(default = "default_drain_timeout")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub drain_timeout: String,
    /// What happens when the drain times out, as `NodeMaintenance.spec.onTimeout`. `Fail` here
    /// means the node is kept and the scale-down stops until someone intervenes.
    #[serde(default)]
    pub on_timeout: OnTimeout,
}

impl Default for ScaleDown {
    fn default() -> Self {
        Self {
            drain_timeout: default_drain_timeout(),
            on_timeout: OnTimeout::default(),
        }
    }
}

fn default_drain_timeout() -> String {
    "30m".to_string()
}

impl NodeSetSpec {
    /// The scale-down drain timeout as a duration.
    pub fn drain_timeout(&self) -> Result<Duration, FieldError> {
        parse_duration_field(
            "spec.scaleDown.drainTimeout",
            &self.scale_down.drain_timeout,
        )
    }

    /// The rollout bounds for the current `replicas`: (most nodes that may exist, fewest nodes
    /// that must be ready). Kubernetes' rounding: surge up, unavailable down; and, as in its
    /// Deployment controller's `ResolveFenceposts`, when both come to zero (`maxSurge: 0` with a
    /// percentage `maxUnavailable` that rounds down to nothing) one node may be unavailable, or
    /// the rollout could never move.
    pub fn rollout_bounds(&self) -> (u32, u32) {
        let surge = self.max_surge.resolve(self.replicas, true);
        let mut unavailable = self.max_unavailable.resolve(self.replicas, false);
        if surge == 0 && unavailable == 0 {
            unavailable = 1;
        }
        (
            self.replicas.saturating_add(surge),
            self.replicas.saturating_sub(unavailable),
        )
    }

    /// What the schema cannot check; each error names its field.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        let zero = |v: IntOrPercent| matches!(v, IntOrPercent::Int(0) | IntOrPercent::Percent(0));
        if zero(self.max_surge) && zero(self.max_unavailable) {
            errors.push(FieldError::new(
                "spec.maxSurge",
                "maxSurge and maxUnavailable cannot both be zero: nodes could never be replaced; raise one of them",
            ));
        }
        if let Err(e) = self.repair.after() {
            errors.push(e);
        }
        match self.drain_timeout() {
            Ok(d) if d.is_zero() => errors.push(FieldError::new(
                "spec.scaleDown.drainTimeout",
                "must be longer than zero, e.g. \"30m\"",
            )),
            // The set drains through a NodeMaintenance with this timeout, which refuses a longer
            // one; the set would then never finish a scale-down.
            Ok(d) if d > MAX_DRAIN_TIMEOUT => errors.push(FieldError::new(
                "spec.scaleDown.drainTimeout",
                "must be at most 168h (a week), the longest drain a NodeMaintenance accepts, e.g. \"30m\"",
            )),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

/// A node of the set that needs attention.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineProblem {
    /// The node's (or pending machine's) name.
    #[schemars(length(max = 253))]
    pub node: String,
    /// What is wrong (launch failed, not ready, drain timed out, ...).
    #[schemars(length(max = 1024))]
    pub message: String,
}

/// Replica counts.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSetStatus {
    /// Nodes (and machines being created) that belong to the set.
    #[serde(default)]
    pub replicas: u32,
    /// Nodes that are Ready.
    #[serde(default)]
    pub ready_replicas: u32,
    /// Nodes made from the current NodeClass and template.
    #[serde(default)]
    pub updated_replicas: u32,
    /// Nodes being drained before removal.
    #[serde(default)]
    pub draining_replicas: u32,
    /// Nodes that need attention, at most 50 (the rest are counted in `omittedProblems`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub problems: Vec<MachineProblem>,
    /// Problems not listed.
    #[serde(default)]
    pub omitted_problems: u32,
    /// Machines deleted and replaced because their node never joined (no Ready condition within
    /// the controller's join timeout), since the set was created.
    #[serde(default)]
    pub failed_joins: u32,
    /// `Ready` (replicas ready and updated) and `Progressing`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The label selector of this set's Nodes, for the scale subresource (a HorizontalPodAutoscaler
    /// or KEDA refuses a scale without one): `nodekeeper.dev/nodeset=<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub selector: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> NodeSetSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn defaults_and_bounds() {
        let s = spec(serde_json::json!({"nodeClassName": "c", "replicas": 10}));
        assert_eq!(s.max_surge, IntOrPercent::Int(1));
        assert_eq!(s.max_unavailable, IntOrPercent::Int(0));
        assert_eq!(s.scale_down, ScaleDown::default());
        assert_eq!(s.drain_timeout().unwrap(), Duration::from_secs(1800));
        assert_eq!(s.rollout_bounds(), (11, 10));
        assert!(s.validate().is_ok());

        let s = spec(serde_json::json!({
            "nodeClassName": "c", "replicas": 10, "maxSurge": "25%", "maxUnavailable": "25%"
        }));
        assert_eq!(s.rollout_bounds(), (13, 8));
    }

    /// `maxSurge: 0` with a `maxUnavailable` percentage that rounds down to zero: one node may
    /// still be unavailable (Kubernetes' fencepost rule), so the rollout can move.
    #[test]
    fn surge_and_unavailable_both_rounding_to_zero_allow_one_unavailable() {
        let s = spec(serde_json::json!({
            "nodeClassName": "c", "replicas": 3, "maxSurge": 0, "maxUnavailable": "25%"
        }));
        assert!(s.validate().is_ok());
        assert_eq!(s.rollout_bounds(), (3, 2));

        // A percentage surge rounds up, so it is never zero for a non-empty set: no fencepost.
        let s = spec(serde_json::json!({
            "nodeClassName": "c", "replicas": 3, "maxSurge": "1%", "maxUnavailable": "25%"
        }));
        assert_eq!(s.rollout_bounds(), (4, 3));
    }

    #[test]
    fn zero_surge_and_unavailable_is_refused() {
        let s = spec(serde_json::json!({
            "nodeClassName": "c", "replicas": 3, "maxSurge": 0, "maxUnavailable": "0%"
        }));
        assert_eq!(s.validate().unwrap_err()[0].field, "spec.maxSurge");
    }

    /// A drain timeout the NodeMaintenance the set creates would refuse is refused on the set.
    #[test]
    fn drain_timeout_above_a_week_is_refused() {
        let with = |timeout: &str| {
            spec(serde_json::json!({
                "nodeClassName": "c", "replicas": 3, "scaleDown": {"drainTimeout": timeout}
            }))
        };
        assert!(with("168h").validate().is_ok());
        let errors = with("168h1s").validate().unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].field, "spec.scaleDown.drainTimeout");
        assert!(errors[0].message.contains("at most 168h"), "{}", errors[0]);
    }

    /// HPA and KEDA read the set's selector from the scale subresource; without
    /// `labelSelectorPath` they refuse to scale it.
    #[test]
    fn scale_subresource_has_the_status_selector() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(NodeSet::crd()).unwrap();
        let scale = &crd["spec"]["versions"][0]["subresources"]["scale"];
        assert_eq!(scale["specReplicasPath"], ".spec.replicas", "{scale}");
        assert_eq!(scale["labelSelectorPath"], ".status.selector", "{scale}");
        let status =
            &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"];
        assert_eq!(
            status["properties"]["selector"]["type"], "string",
            "{status}"
        );
    }

    #[test]
    fn replicas_are_required() {
        let err = serde_json::from_value::<NodeSetSpec>(serde_json::json!({"nodeClassName": "c"}))
            .unwrap_err();
        assert!(err.to_string().contains("replicas"), "{err}");
    }
}
