//! The NodeMaintenance status from the per-node views: counts, the nodes that need attention
//! first (at most 50), per node at most 10 blocking pods grouped by reason and budget and 10
//! skipped pods (counts for the rest), and the `Ready` / `Progressing` / `Blocked` conditions.
//! The reconciler writes the result only when it differs from what is stored.

use nodekeeper_api::crd::common::{ConditionStatus, MAX_LISTED, set_condition};
use nodekeeper_api::crd::node_maintenance::{
    BlockingPod, MAX_PODS_LISTED, NodeMaintenanceStatus, NodePhase, NodeProgress, SkippedPod, Stage,
};
use nodekeeper_api::names::{
    CONDITION_BLOCKED, CONDITION_PROGRESSING, CONDITION_READY, REASON_DONE, REASON_IN_PROGRESS,
    REASON_NO_MATCHING_NODES,
};

/// Condition reason: the controller refused the maintenance before touching a node.
pub const REASON_REFUSED: &str = "Refused";
/// Condition reason: stage `Idle`.
pub const REASON_IDLE: &str = "Idle";
/// Condition reason: a node's drain is held up by pods.
pub const REASON_PODS_BLOCKING: &str = "PodsBlocking";
/// Condition reason: a node's drain timed out with `onTimeout: Fail`.
pub const REASON_DRAIN_FAILED: &str = "DrainFailed";
/// Condition reason: nothing holds anything up.
pub const REASON_NOT_BLOCKED: &str = "NotBlocked";

/// One node as the reconciler saw it this time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    pub node: String,
    pub phase: NodePhase,
    /// RFC 3339.
    pub drain_start: Option<String>,
    pub pods_remaining: u32,
    pub blocking: Vec<BlockingPod>,
    pub skipped: Vec<SkippedPod>,
    pub local_storage: Vec<String>,
    pub message: String,
}

impl NodeView {
    /// A node with nothing to report but its phase.
    pub fn phase_only(node: &str, phase: NodePhase) -> Self {
        Self {
            node: node.to_owned(),
            phase,
            drain_start: None,
            pods_remaining: 0,
            blocking: Vec::new(),
            skipped: Vec::new(),
            local_storage: Vec::new(),
            message: String::new(),
        }
    }

    fn blocked(&self) -> bool {
        self.phase == NodePhase::Failed
            || (self.phase == NodePhase::Draining && !self.blocking.is_empty())
    }

    /// Lower first in the listed nodes: what a person should look at.
    fn attention(&self) -> u8 {
        match self.phase {
            NodePhase::Failed => 0,
            NodePhase::Draining if !self.blocking.is_empty() => 1,
            NodePhase::Draining => 2,
            NodePhase::Waiting => 3,
            NodePhase::Cordoned => 4,
            NodePhase::Drained => 5,
            NodePhase::Released => 6,
        }
    }
}

fn progress(mut view: NodeView) -> NodeProgress {
    // Grouped by reason, then by budget, so a person sees "3 pods behind PDB web" together.
    view.blocking.sort_by(|a, b| {
        (a.reason, &a.pdb, &a.namespace, &a.name).cmp(&(b.reason, &b.pdb, &b.namespace, &b.name))
    });
    view.skipped
        .sort_by(|a, b| (a.reason, &a.namespace, &a.name).cmp(&(b.reason, &b.namespace, &b.name)));
    let omitted_blocking = view.blocking.len().saturating_sub(MAX_PODS_LISTED);
    let omitted_skipped = view.skipped.len().saturating_sub(MAX_PODS_LISTED);
    view.blocking.truncate(MAX_PODS_LISTED);
    view.skipped.truncate(MAX_PODS_LISTED);
    view.local_storage.sort();
    view.local_storage.truncate(MAX_PODS_LISTED);
    NodeProgress {
        node: view.node,
        phase: view.phase,
        drain_start_time: view.drain_start,
        pods_remaining: view.pods_remaining,
        blocking_pods: view.blocking,
        omitted_blocking_pods: u32::try_from(omitted_blocking).unwrap_or(u32::MAX),
        skipped_pods: view.skipped,
        omitted_skipped_pods: u32::try_from(omitted_skipped).unwrap_or(u32::MAX),
        local_storage_pods: view.local_storage,
        message: view.message,
    }
}

fn count(views: &[NodeView], f: impl Fn(&NodeView) -> bool) -> u32 {
    u32::try_from(views.iter().filter(|v| f(v)).count()).unwrap_or(u32::MAX)
}

/// What the reconciler decided about the whole object this time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Refused before touching a node; the message names the field and the fix.
    Refused(String),
    /// Acting on the nodes of `views`.
    Acting,
}

/// Builds the status. `current` is the stored status (for condition transition times);
/// `now` is RFC 3339.
pub fn build(
    stage: Stage,
    outcome: &Outcome,
    matched: u32,
    mut views: Vec<NodeView>,
    generation: Option<i64>,
    current: Option<&NodeMaintenanceStatus>,
    now: &str,
) -> NodeMaintenanceStatus {
    let mut conditions = current.map(|c| c.conditions.clone()).unwrap_or_default();
    let mut set = |type_: &str, status: bool, reason: &str, message: &str| {
        let status = if status {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        set_condition(
            &mut conditions,
            type_,
            status,
            reason,
            message,
            generation,
            now,
        );
    };

    let cordoned = count(&views, |v| {
        matches!(
            v.phase,
            NodePhase::Cordoned | NodePhase::Draining | NodePhase::Drained | NodePhase::Failed
        )
    });
    let drained = count(&views, |v| v.phase == NodePhase::Drained);
    let released = count(&views, |v| v.phase == NodePhase::Released);
    let failed = count(&views, |v| v.phase == NodePhase::Failed);
    let blocked = count(&views, NodeView::blocked);

    match outcome {
        Outcome::Refused(message) => {
            set(CONDITION_READY, false, REASON_REFUSED, message);
            set(CONDITION_PROGRESSING, false, REASON_REFUSED, message);
            set(CONDITION_BLOCKED, false, REASON_NOT_BLOCKED, "");
        }
        Outcome::Acting if stage == Stage::Idle => {
            set(
                CONDITION_READY,
                true,
                REASON_IDLE,
                "stage Idle: nothing is done",
            );
            set(CONDITION_PROGRESSING, false, REASON_IDLE, "");
            set(CONDITION_BLOCKED, false, REASON_NOT_BLOCKED, "");
        }
        Outcome::Acting if matched == 0 && views.is_empty() => {
            let m = "spec.nodeSelector picks no node; nothing is done (check the labels)";
            set(CONDITION_READY, false, REASON_NO_MATCHING_NODES, m);
            set(CONDITION_PROGRESSING, false, REASON_NO_MATCHING_NODES, m);
            set(CONDITION_BLOCKED, false, REASON_NOT_BLOCKED, "");
        }
        Outcome::Acting => {
            let total = u32::try_from(views.len()).unwrap_or(u32::MAX);
            let (done, what) = match stage {
                Stage::Cordon => (
                    cordoned == total,
                    format!("{cordoned}/{total} nodes cordoned"),
                ),
                Stage::Drain => (drained == total, format!("{drained}/{total} nodes drained")),
                Stage::Complete | Stage::Idle => (
                    released == total,
                    format!("{released}/{total} nodes released"),
                ),
            };
            let stuck = failed > 0 && drained + failed == total && stage == Stage::Drain;
            set(
                CONDITION_READY,
                done,
                if done {
                    REASON_DONE
                } else {
                    REASON_IN_PROGRESS
                },
                &what,
            );
            set(
                CONDITION_PROGRESSING,
                !done && !stuck,
                if done {
                    REASON_DONE
                } else if stuck {
                    REASON_DRAIN_FAILED
                } else {
                    REASON_IN_PROGRESS
                },
                &what,
            );
            if failed > 0 {
                set(
                    CONDITION_BLOCKED,
                    true,
                    REASON_DRAIN_FAILED,
                    &format!("{failed} node drains timed out (onTimeout: Fail); see status.nodes"),
                );
            } else if blocked > 0 {
                set(
                    CONDITION_BLOCKED,
                    true,
                    REASON_PODS_BLOCKING,
                    &format!("{blocked} nodes have pods holding the drain up; see status.nodes"),
                );
            } else {
                set(CONDITION_BLOCKED, false, REASON_NOT_BLOCKED, "");
            }
        }
    }

    views.sort_by(|a, b| (a.attention(), &a.node).cmp(&(b.attention(), &b.node)));
    let omitted = views.len().saturating_sub(MAX_LISTED);
    views.truncate(MAX_LISTED);
    NodeMaintenanceStatus {
        matched,
        cordoned,
        drained,
        blocked,
        failed,
        nodes: views.into_iter().map(progress).collect(),
        omitted_nodes: u32::try_from(omitted).unwrap_or(u32::MAX),
        conditions,
        observed_generation: generation,
    }
}

/// See [`acted_on`].
pub type ActedOn = (
    (u32, u32, u32, u32, u32),
    Vec<(String, NodePhase, Option<String>)>,
    Vec<(String, ConditionStatus, String, String)>,
    Option<i64>,
);

/// What a person acts on in a status: the counts that say how far it got (not `blocked`), each
/// listed node's phase and drain start, and the `Ready` and `Progressing` conditions. Pods
/// remaining, which pods block and why, skipped pods, messages and the `Blocked` condition are
/// details: during a drain behind budgets they change with every eviction, so the reconciler
/// writes a change of details alone less often (see `reconcile::write_status`).
pub fn acted_on(s: &NodeMaintenanceStatus) -> ActedOn {
    let mut nodes: Vec<(String, NodePhase, Option<String>)> = s
        .nodes
        .iter()
        .map(|n| (n.node.clone(), n.phase, n.drain_start_time.clone()))
        .collect();
    // The listed order follows attention (blocked first), a detail.
    nodes.sort_by(|a, b| a.0.cmp(&b.0));
    let conditions: Vec<(String, ConditionStatus, String, String)> = s
        .conditions
        .iter()
        .filter(|c| c.type_ != CONDITION_BLOCKED)
        .map(|c| {
            (
                c.type_.clone(),
                c.status,
                c.reason.clone(),
                c.message.clone(),
            )
        })
        .collect();
    (
        (s.matched, s.cordoned, s.drained, s.failed, s.omitted_nodes),
        nodes,
        conditions,
        s.observed_generation,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodekeeper_api::crd::node_maintenance::{BlockReason, SkipReason};

    fn blocking(name: &str, reason: BlockReason, pdb: Option<&str>) -> BlockingPod {
        BlockingPod {
            namespace: "ns".into(),
            name: name.into(),
            reason,
            pdb: pdb.map(str::to_owned),
            message: String::new(),
        }
    }

    fn cond<'a>(s: &'a NodeMaintenanceStatus, t: &str) -> (&'a str, ConditionStatus) {
        let c = s.conditions.iter().find(|c| c.type_ == t).unwrap();
        (c.reason.as_str(), c.status)
    }

    #[test]
    fn bounded_lists_with_counts_and_attention_first() {
        let mut views: Vec<NodeView> = (0..60)
            .map(|i| NodeView::phase_only(&format!("n{i:02}"), NodePhase::Drained))
            .collect();
        views[59].phase = NodePhase::Draining;
        views[59].blocking = (0..14)
            .map(|i| {
                blocking(
                    &format!("p{i:02}"),
                    BlockReason::PodDisruptionBudget,
                    Some("web"),
                )
            })
            .chain([blocking("job", BlockReason::WaitingForCompletion, None)])
            .chain([blocking("bare", BlockReason::StandalonePod, None)])
            .collect();
        views[59].skipped = (0..12)
            .map(|i| SkippedPod {
                namespace: "kube-system".into(),
                name: format!("ds{i}"),
                reason: SkipReason::DaemonSet,
            })
            .collect();
        let s = build(
            Stage::Drain,
            &Outcome::Acting,
            60,
            views,
            Some(3),
            None,
            "t0",
        );
        assert_eq!(
            (s.matched, s.drained, s.blocked, s.cordoned),
            (60, 59, 1, 60)
        );
        assert_eq!(s.nodes.len(), 50);
        assert_eq!(s.omitted_nodes, 10);
        let first = &s.nodes[0];
        assert_eq!(first.node, "n59", "the blocked node is listed first");
        assert_eq!(first.blocking_pods.len(), 10);
        assert_eq!(first.omitted_blocking_pods, 6);
        assert!(first.blocking_pods.iter().all(
            |p| p.reason == BlockReason::PodDisruptionBudget && p.pdb.as_deref() == Some("web")
        ));
        assert_eq!(first.skipped_pods.len(), 10);
        assert_eq!(first.omitted_skipped_pods, 2);
        assert_eq!(
            cond(&s, "Ready"),
            (REASON_IN_PROGRESS, ConditionStatus::False)
        );
        assert_eq!(
            cond(&s, "Blocked"),
            (REASON_PODS_BLOCKING, ConditionStatus::True)
        );
        assert_eq!(cond(&s, "Progressing").1, ConditionStatus::True);
    }

    #[test]
    fn same_input_same_status_so_nothing_is_written_twice() {
        let views = vec![NodeView::phase_only("a", NodePhase::Cordoned)];
        let s1 = build(
            Stage::Cordon,
            &Outcome::Acting,
            1,
            views.clone(),
            Some(1),
            None,
            "t0",
        );
        let s2 = build(
            Stage::Cordon,
            &Outcome::Acting,
            1,
            views,
            Some(1),
            Some(&s1),
            "t1",
        );
        assert_eq!(s1, s2);
        assert_eq!(cond(&s1, "Ready"), (REASON_DONE, ConditionStatus::True));
    }

    #[test]
    fn refusal_idle_nothing_matched_and_failure() {
        let s = build(
            Stage::Drain,
            &Outcome::Refused("spec.nodeSelector picks every node".into()),
            10,
            vec![],
            Some(1),
            None,
            "t0",
        );
        assert_eq!(cond(&s, "Ready"), (REASON_REFUSED, ConditionStatus::False));
        let s = build(
            Stage::Idle,
            &Outcome::Acting,
            4,
            vec![],
            Some(1),
            None,
            "t0",
        );
        assert_eq!(cond(&s, "Ready"), (REASON_IDLE, ConditionStatus::True));
        let s = build(
            Stage::Drain,
            &Outcome::Acting,
            0,
            vec![],
            Some(1),
            None,
            "t0",
        );
        assert_eq!(
            cond(&s, "Ready"),
            (REASON_NO_MATCHING_NODES, ConditionStatus::False)
        );
        let s = build(
            Stage::Drain,
            &Outcome::Acting,
            2,
            vec![
                NodeView::phase_only("a", NodePhase::Failed),
                NodeView::phase_only("b", NodePhase::Drained),
            ],
            Some(1),
            None,
            "t0",
        );
        assert_eq!(s.failed, 1);
        assert_eq!(
            cond(&s, "Blocked"),
            (REASON_DRAIN_FAILED, ConditionStatus::True)
        );
        assert_eq!(
            cond(&s, "Progressing"),
            (REASON_DRAIN_FAILED, ConditionStatus::False)
        );
    }
}
