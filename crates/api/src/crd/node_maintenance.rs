//! `NodeMaintenance`: declarative cordon and drain of the nodes a selector picks (the shape of
//! Kubernetes KEP-4212), with per-node progress and the pods that block it.

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::time::Duration;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    Condition, DURATION_PATTERN, FieldError, LabelSelector, conditions_schema, parse_duration_field,
};

/// Cordons and drains the nodes `nodeSelector` picks, stage by stage: `Idle` (nothing), `Cordon`
/// (mark unschedulable), `Drain` (evict pods by `drainPlan`, honouring PodDisruptionBudgets),
/// `Complete` (uncordon and finish). Status shows each node's progress and what blocks it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeMaintenance",
    plural = "nodemaintenances",
    singular = "nodemaintenance",
    shortname = "nm",
    category = "nodekeeper",
    status = "NodeMaintenanceStatus",
    derive = "PartialEq",
    doc = "Declarative cordon and drain of selected nodes, with per-node progress.",
    printcolumn(name = "Stage", type_ = "string", json_path = ".spec.stage"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".status.matched"),
    printcolumn(name = "Drained", type_ = "integer", json_path = ".status.drained"),
    printcolumn(name = "Blocked", type_ = "integer", json_path = ".status.blocked"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".spec.reason",
        priority = 1
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
        "rule": "oldSelf.stage == 'Idle' || self.nodeSelector == oldSelf.nodeSelector",
        "message": "spec.nodeSelector cannot change once maintenance has started; set stage to Idle first, or create another NodeMaintenance",
        "fieldPath": ".nodeSelector"
    },
    {
        "rule": "oldSelf.stage != 'Complete' || self.stage == 'Complete'",
        "message": "spec.stage: a Complete maintenance is finished; create another NodeMaintenance to maintain these nodes again",
        "fieldPath": ".stage"
    }
]))]
pub struct NodeMaintenanceSpec {
    /// The nodes to maintain. Required and must select something specific: write at least one
    /// label or expression.
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "(has(self.matchLabels) && size(self.matchLabels) > 0) || (has(self.matchExpressions) && size(self.matchExpressions) > 0)",
        "message": "spec.nodeSelector must name at least one label or expression; maintaining every node by accident is not allowed"
    }]))]
    pub node_selector: LabelSelector,
    /// What to do now: `Idle` (nothing), `Cordon`, `Drain` (cordon and drain) or `Complete`
    /// (uncordon the nodes and finish).
    #[serde(default)]
    pub stage: Stage,
    /// Drain order: entry 0's pods are evicted and gone before entry 1's are touched, and so on;
    /// pods no entry matches are evicted last. Mirror (static) pods are never evicted, and
    /// DaemonSet pods only when an entry with `podType: DaemonSet` names them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub drain_plan: Vec<DrainPlanEntry>,
    /// Pods matching this selector are left running and do not hold the drain up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_pods: Option<LabelSelector>,
    /// Pods matching this selector are not evicted; the drain waits for them to finish on their
    /// own (e.g. batch jobs), up to `drainTimeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_for_pods: Option<LabelSelector>,
    /// Pods without a controlling owner (bare pods) are evicted only when this is `true`:
    /// nothing recreates them. When `false` they hold the drain up and are listed as blocking.
    #[serde(default)]
    pub allow_standalone_pods: bool,
    /// How long one node's drain may take, e.g. `30m` or `1h30m` (units ms, s, m, h; at most
    /// 168h).
    #[serde(default = "default_drain_timeout")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub drain_timeout: String,
    /// What happens when a node's drain times out: `Fail` (stop evicting there, keep it cordoned,
    /// report it), `Proceed` (count it drained and report the pods left), or `ForceDelete`
    /// (delete the remaining pods, bypassing PodDisruptionBudgets, each early enough to get its
    /// own `terminationGracePeriodSeconds` before the deadline).
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// The most nodes draining at once; the others wait their turn (in `Drain`, a node is cordoned
    /// when its turn comes). The tuning ConfigMap's `maintenance.maxConcurrentNodes` bounds all
    /// maintenances together.
    #[serde(default = "default_max_concurrent_nodes")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_concurrent_nodes: u32,
    /// The controller refuses, before touching any node, a selection that picks every node, every
    /// control-plane node, or more nodes than the tuning ConfigMap's
    /// `maintenance.maxSelectedNodes`. Set this to `true` to say that such a selection is meant.
    #[serde(default)]
    pub allow_broad_selection: bool,
    /// Why the nodes are maintained; copied to the node condition's message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 256))]
    pub reason: String,
}

/// The longest `drainTimeout` accepted.
pub const MAX_DRAIN_TIMEOUT: Duration = Duration::from_secs(168 * 3600);

/// At most this many pods are listed per node in each of `blockingPods` and `skippedPods`.
pub const MAX_PODS_LISTED: usize = 10;

fn default_drain_timeout() -> String {
    "1h".to_string()
}
fn default_max_concurrent_nodes() -> u32 {
    1
}

/// The maintenance stage.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Stage {
    /// Nothing happens yet.
    #[default]
    Idle,
    /// The nodes are marked unschedulable.
    Cordon,
    /// The nodes are cordoned and drained.
    Drain,
    /// The nodes are uncordoned; the maintenance is finished.
    Complete,
}

/// What to do when a node's drain times out.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum OnTimeout {
    /// Stop evicting on that node, keep it cordoned and report it failed; it keeps its
    /// `maxConcurrentNodes` slot, so the maintenance goes no further until someone acts. The
    /// safe default: it never bypasses a PodDisruptionBudget.
    #[default]
    Fail,
    /// Count the node drained and report the pods left on it.
    Proceed,
    /// Delete the remaining pods, bypassing PodDisruptionBudgets; each pod is deleted early
    /// enough to get its own `terminationGracePeriodSeconds` before the deadline (never 0).
    /// Pods without a controller are deleted only with `allowStandalonePods`.
    ForceDelete,
}

/// One step of the drain plan: the pods it matches (every given criterion must hold).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DrainPlanEntry {
    /// Which pods by owner: `Any`, `Standalone` (no controller), `Controlled` (owned by a
    /// controller other than a DaemonSet), or `DaemonSet`.
    #[serde(default)]
    pub pod_type: PodType,
    /// Only pods whose priority is at most this value (lower-priority pods go first when a
    /// plan lists thresholds in increasing order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = i32::MIN, max = i32::MAX))]
    pub priority_threshold: Option<i32>,
    /// Only pods with these labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
}

/// Pods by owner.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum PodType {
    /// Any evictable pod (not DaemonSet-owned, not a mirror pod).
    #[default]
    Any,
    /// Pods without a controlling owner.
    Standalone,
    /// Pods owned by a controller other than a DaemonSet (ReplicaSet, StatefulSet, Job, ...).
    Controlled,
    /// DaemonSet-owned pods (normally left alone; the DaemonSet would recreate them).
    DaemonSet,
}

impl NodeMaintenanceSpec {
    /// The drain timeout as a duration.
    pub fn drain_timeout(&self) -> Result<Duration, FieldError> {
        parse_duration_field("spec.drainTimeout", &self.drain_timeout)
    }

    /// What the schema cannot check; each error names its field.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        self.node_selector
            .validate("spec.nodeSelector", &mut errors);
        if self.node_selector.match_labels.is_empty()
            && self.node_selector.match_expressions.is_empty()
        {
            errors.push(FieldError::new(
                "spec.nodeSelector",
                "must name at least one label or expression; maintaining every node by accident is not allowed",
            ));
        }
        if let Some(s) = &self.skip_pods {
            s.validate("spec.skipPods", &mut errors);
        }
        if let Some(s) = &self.wait_for_pods {
            s.validate("spec.waitForPods", &mut errors);
        }
        for (i, entry) in self.drain_plan.iter().enumerate() {
            if let Some(s) = &entry.pod_selector {
                s.validate(&format!("spec.drainPlan[{i}].podSelector"), &mut errors);
            }
        }
        match self.drain_timeout() {
            Ok(d) if d.is_zero() => errors.push(FieldError::new(
                "spec.drainTimeout",
                "must be longer than zero, e.g. \"30m\"",
            )),
            Ok(d) if d > MAX_DRAIN_TIMEOUT => errors.push(FieldError::new(
                "spec.drainTimeout",
                "must be at most 168h (a week); a longer drain is better split into maintenances",
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

/// Where one node's maintenance is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum NodePhase {
    /// Waiting for its turn (`maxConcurrentNodes`).
    Waiting,
    /// Marked unschedulable.
    Cordoned,
    /// Pods are being evicted.
    Draining,
    /// No pods left that must go (or `onTimeout: Proceed` counted it so; see `message`).
    Drained,
    /// The drain took longer than `drainTimeout` with `onTimeout: Fail`; see `message`.
    Failed,
    /// Uncordoned after `Complete`.
    Released,
}

/// Why a pod holds a drain up.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum BlockReason {
    /// Eviction refused because of a PodDisruptionBudget (named in `pdb`).
    PodDisruptionBudget,
    /// The pod matches `waitForPods` and has not finished.
    WaitingForCompletion,
    /// Evicted, still terminating.
    Terminating,
    /// Eviction failed for another reason (see `message`).
    EvictionFailed,
    /// The pod has no controller and `allowStandalonePods` is `false`.
    StandalonePod,
}

/// Why a pod is left on a node that is drained.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum SkipReason {
    /// A mirror (static) pod: the kubelet runs it from a file; the API cannot evict it.
    MirrorPod,
    /// Owned by a DaemonSet, which would recreate it (evicted only when a `drainPlan` entry
    /// with `podType: DaemonSet` names it).
    DaemonSet,
    /// Matches `skipPods`.
    SkipPods,
    /// Terminating on a node tainted `node.kubernetes.io/unreachable` for longer than the
    /// controller's `--maintenance-unreachable-pod-wait` (5 minutes by default) past its
    /// deletion time: no kubelet will confirm the deletion, so the drain counts the pod gone,
    /// as `kubectl drain --skip-wait-for-delete-timeout` and Cluster API's drain do. Its API
    /// object stays until the node comes back, is deleted, or is tainted out-of-service.
    NodeUnreachable,
}

/// A pod left on a drained node, and why.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkippedPod {
    /// The pod's namespace.
    #[schemars(length(max = 63))]
    pub namespace: String,
    /// The pod's name.
    #[schemars(length(max = 253))]
    pub name: String,
    pub reason: SkipReason,
}

/// A pod that holds one node's drain up.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BlockingPod {
    /// The pod's namespace.
    #[schemars(length(max = 63))]
    pub namespace: String,
    /// The pod's name.
    #[schemars(length(max = 253))]
    pub name: String,
    /// Why it blocks.
    pub reason: BlockReason,
    /// For `PodDisruptionBudget`: the budget's name (in the pod's namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub pdb: Option<String>,
    /// Details, e.g. the API's answer.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 512))]
    pub message: String,
}

/// One node's progress.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeProgress {
    /// The node's name.
    #[schemars(length(max = 253))]
    pub node: String,
    pub phase: NodePhase,
    /// When its drain started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub drain_start_time: Option<String>,
    /// Pods still to leave the node.
    #[serde(default)]
    pub pods_remaining: u32,
    /// Pods holding the drain up, at most 10 (the rest are counted in `omittedBlockingPods`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub blocking_pods: Vec<BlockingPod>,
    /// Blocking pods not listed.
    #[serde(default)]
    pub omitted_blocking_pods: u32,
    /// Pods left running on purpose (DaemonSet, mirror, `skipPods`), at most 10.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub skipped_pods: Vec<SkippedPod>,
    /// Skipped pods not listed.
    #[serde(default)]
    pub omitted_skipped_pods: u32,
    /// Pods still to be evicted that keep data in an `emptyDir` volume, which eviction
    /// discards (`namespace/name`, at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10), inner(length(max = 320)))]
    pub local_storage_pods: Vec<String>,
    /// Details for a human.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 1024))]
    pub message: String,
}

/// Counts over the selected nodes and the nodes that need attention.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeMaintenanceStatus {
    /// Nodes the selector picks.
    #[serde(default)]
    pub matched: u32,
    /// Nodes cordoned (including those draining and drained).
    #[serde(default)]
    pub cordoned: u32,
    /// Nodes drained.
    #[serde(default)]
    pub drained: u32,
    /// Nodes whose drain is held up by at least one pod, or failed.
    #[serde(default)]
    pub blocked: u32,
    /// Nodes timed out or failed.
    #[serde(default)]
    pub failed: u32,
    /// Nodes in progress, blocked, timed out or failed first; at most 50 (the rest are counted in
    /// `omittedNodes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub nodes: Vec<NodeProgress>,
    /// Nodes not listed in `nodes`.
    #[serde(default)]
    pub omitted_nodes: u32,
    /// `Ready` (every node is where the stage wants it; `False` with reason `Refused` when the
    /// controller refused the selection or the spec), `Progressing` (nodes are being cordoned,
    /// drained or released) and `Blocked` (at least one node's drain is held up or failed).
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

    fn spec(extra: serde_json::Value) -> NodeMaintenanceSpec {
        let mut base = serde_json::json!({"nodeSelector": {"matchLabels": {"pool": "a"}}});
        base.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn defaults_are_the_safe_ones() {
        let s = spec(serde_json::json!({}));
        assert_eq!(s.stage, Stage::Idle);
        assert_eq!(s.on_timeout, OnTimeout::Fail);
        assert!(!s.allow_standalone_pods);
        assert!(!s.allow_broad_selection);
        assert_eq!(s.max_concurrent_nodes, 1);
        assert_eq!(s.drain_timeout().unwrap(), Duration::from_secs(3600));
        assert!(s.validate().is_ok());
    }

    #[test]
    fn plan_round_trips() {
        let s = spec(serde_json::json!({
            "stage": "Drain",
            "drainPlan": [
                {"podType": "Standalone"},
                {"priorityThreshold": 1000, "podSelector": {"matchLabels": {"tier": "batch"}}},
                {"podType": "DaemonSet"}
            ],
            "onTimeout": "ForceDelete",
            "drainTimeout": "45m"
        }));
        assert_eq!(s.drain_plan.len(), 3);
        assert_eq!(s.drain_plan[1].pod_type, PodType::Any);
        let back: NodeMaintenanceSpec =
            serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        assert_eq!(s.drain_timeout().unwrap(), Duration::from_secs(45 * 60));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut s = spec(serde_json::json!({"drainTimeout": "0s"}));
        s.node_selector = LabelSelector::default();
        let errors = s.validate().unwrap_err();
        let fields: Vec<_> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.nodeSelector", "spec.drainTimeout"]);

        let s = spec(serde_json::json!({"drainTimeout": "forever"}));
        assert_eq!(s.validate().unwrap_err()[0].field, "spec.drainTimeout");

        let s = spec(serde_json::json!({"drainTimeout": "169h"}));
        let errors = s.validate().unwrap_err();
        assert_eq!(errors[0].field, "spec.drainTimeout");
        assert!(
            errors[0].message.contains("at most 168h"),
            "{}",
            errors[0].message
        );
    }
}
