//! The NodeNetworkConfig status computed from the nodes' phases: counts, at most 50 failing
//! nodes with their error (the rest counted), `Ready` and `Progressing` conditions, and a
//! `Conflict` condition while an older object holds some of the selected nodes
//! ([`conflict_message`]); `None` when nothing changed, so the reconciler writes status on
//! change only.

use nodekeeper_api::crd::node_network_config::{FailingNode, NodeNetworkConfigStatus};
use nodekeeper_api::crd::{ConditionStatus, set_condition};
use nodekeeper_api::names::{
    CONDITION_PROGRESSING, CONDITION_READY, REASON_DONE, REASON_IN_PROGRESS,
    REASON_NO_MATCHING_NODES,
};
pub use nodekeeper_api::names::{REASON_NOT_APPLIED, REASON_PAUSED};

use super::rollout::{NodePhase, Paused};

/// Failing nodes listed in status (the schema's bound).
pub const MAX_FAILING_LISTED: usize = 50;
/// Longest error kept per failing node (the schema's bound), in bytes.
pub const MAX_ERROR_LEN: usize = 1024;

/// One selected node as the status sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeReport<'a> {
    pub name: &'a str,
    /// Every VNIC of `ociVnics.attach` is ATTACHED on it.
    pub attached: bool,
    pub phase: &'a NodePhase,
}

/// `Conflict=True`: some selected nodes are left to an older NodeNetworkConfig. The condition is
/// absent when there is no conflict.
pub const CONDITION_CONFLICT: &str = "Conflict";
/// `Conflict=True`'s reason.
pub const REASON_SELECTED_BY_ANOTHER: &str = "NodesSelectedByAnother";
/// Nodes named per other object in a conflict message; the rest are counted.
pub const MAX_NAMED_IN_CONFLICT: usize = 10;

/// The `Conflict` message of object `this` whose selector also picks `claimed` (node → the
/// older object that keeps it); `None` when nothing is claimed.
pub fn conflict_message(
    this: &str,
    claimed: &std::collections::BTreeMap<String, String>,
) -> Option<String> {
    let mut by_other: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for (node, other) in claimed {
        by_other.entry(other).or_default().push(node);
    }
    let parts: Vec<String> = by_other
        .iter()
        .map(|(other, nodes)| {
            let more = nodes.len().saturating_sub(MAX_NAMED_IN_CONFLICT);
            let tail = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            format!(
                "{} node(s) selected by both nodenetworkconfig {this} and nodenetworkconfig \
                 {other}, which is older and keeps them: {}{tail}",
                nodes.len(),
                nodes[..nodes.len().min(MAX_NAMED_IN_CONFLICT)].join(", ")
            )
        })
        .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "{}; a node takes one NodeNetworkConfig: narrow spec.nodeSelector of {this} or of \
             the other object (this object changes nothing on those nodes meanwhile)",
            parts.join("; ")
        )
    })
}

/// The status for `nodes` on top of `previous`; `None` when it would be equal to `previous`.
/// `now` (RFC 3339) is used only for conditions whose status changes. `conflict`: the
/// [`conflict_message`], if any.
pub fn next_status(
    previous: &NodeNetworkConfigStatus,
    nodes: &[NodeReport<'_>],
    paused: Option<&Paused>,
    conflict: Option<&str>,
    generation: Option<i64>,
    now: &str,
) -> Option<NodeNetworkConfigStatus> {
    let count = |f: &dyn Fn(&NodeReport<'_>) -> bool| {
        u32::try_from(nodes.iter().filter(|n| f(n)).count()).unwrap_or(u32::MAX)
    };
    let mut failing: Vec<FailingNode> = nodes
        .iter()
        .filter_map(|n| match n.phase {
            NodePhase::Failed { error, rolled_back } => Some(FailingNode {
                node: n.name.to_string(),
                error: truncate(error, MAX_ERROR_LEN),
                rolled_back: *rolled_back,
            }),
            _ => None,
        })
        .collect();
    failing.sort_by(|a, b| a.node.cmp(&b.node));
    let failing_count = u32::try_from(failing.len()).unwrap_or(u32::MAX);
    failing.truncate(MAX_FAILING_LISTED);
    let mut next = NodeNetworkConfigStatus {
        matched: u32::try_from(nodes.len()).unwrap_or(u32::MAX),
        attached: count(&|n| n.attached),
        applied: count(&|n| *n.phase == NodePhase::Applied),
        failing: failing_count,
        omitted_failing: failing_count - u32::try_from(failing.len()).unwrap_or(0),
        failing_nodes: failing,
        conditions: previous.conditions.clone(),
        observed_generation: generation,
    };
    let (ready, ready_reason, ready_message) = if next.matched == 0 {
        (
            ConditionStatus::False,
            REASON_NO_MATCHING_NODES,
            "no node matches spec.nodeSelector".to_string(),
        )
    } else if next.applied == next.matched {
        (ConditionStatus::True, REASON_DONE, String::new())
    } else {
        (
            ConditionStatus::False,
            REASON_NOT_APPLIED,
            format!(
                "{} of {} nodes applied, {} failing",
                next.applied, next.matched, next.failing
            ),
        )
    };
    let (progressing, progress_reason, progress_message) = match paused {
        Some(p) => (ConditionStatus::False, p.reason(), p.message()),
        None if next.applied < next.matched => {
            (ConditionStatus::True, REASON_IN_PROGRESS, String::new())
        }
        None => (ConditionStatus::False, REASON_DONE, String::new()),
    };
    set_condition(
        &mut next.conditions,
        CONDITION_READY,
        ready,
        ready_reason,
        &ready_message,
        generation,
        now,
    );
    set_condition(
        &mut next.conditions,
        CONDITION_PROGRESSING,
        progressing,
        progress_reason,
        &progress_message,
        generation,
        now,
    );
    match conflict {
        Some(message) => {
            set_condition(
                &mut next.conditions,
                CONDITION_CONFLICT,
                ConditionStatus::True,
                REASON_SELECTED_BY_ANOTHER,
                &truncate(message, MAX_ERROR_LEN),
                generation,
                now,
            );
        }
        None => next.conditions.retain(|c| c.type_ != CONDITION_CONFLICT),
    }
    (next != *previous).then_some(next)
}

/// The status of an object that cannot be rolled out at all (its spec is invalid, or it asks
/// for VNICs and the controller has no cloud access): nothing on any node changes, `Ready=False`
/// with `reason` and `message` (naming the field or flag and what to do), `Progressing=False`.
/// `None` when `previous` already says so.
pub fn blocked_status(
    previous: &NodeNetworkConfigStatus,
    matched: u32,
    generation: Option<i64>,
    reason: &str,
    message: &str,
    now: &str,
) -> Option<NodeNetworkConfigStatus> {
    let mut next = NodeNetworkConfigStatus {
        matched,
        attached: 0,
        applied: 0,
        failing: 0,
        failing_nodes: Vec::new(),
        omitted_failing: 0,
        conditions: previous.conditions.clone(),
        observed_generation: generation,
    };
    let message = truncate(message, MAX_ERROR_LEN);
    set_condition(
        &mut next.conditions,
        CONDITION_READY,
        ConditionStatus::False,
        reason,
        &message,
        generation,
        now,
    );
    set_condition(
        &mut next.conditions,
        CONDITION_PROGRESSING,
        ConditionStatus::False,
        reason,
        "nothing is rolled out until this is fixed",
        generation,
        now,
    );
    (next != *previous).then_some(next)
}

/// `s` cut to at most `max` bytes on a character boundary, marked with `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max - '…'.len_utf8();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_conflict_names_both_objects_and_the_nodes_and_goes_away() {
        let claimed: std::collections::BTreeMap<String, String> = (0..12)
            .map(|i| (format!("node-{i:02}"), "older".to_string()))
            .chain([("node-x".to_string(), "oldest".to_string())])
            .collect();
        let m = conflict_message("younger", &claimed).unwrap();
        assert!(
            m.contains(
                "12 node(s) selected by both nodenetworkconfig younger and nodenetworkconfig older"
            ) && m.contains("node-00, node-01")
                && m.contains("and 2 more")
                && m.contains("nodenetworkconfig oldest, which is older and keeps them: node-x")
                && m.contains("narrow spec.nodeSelector of younger"),
            "{m}"
        );
        assert_eq!(conflict_message("younger", &Default::default()), None);
        let all = phases(2, |_| NodePhase::Applied);
        let s = next_status(
            &Default::default(),
            &reports(&all),
            None,
            Some(&m),
            Some(1),
            "t1",
        )
        .unwrap();
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_CONFLICT)
            .unwrap();
        assert_eq!(
            (c.reason.as_str(), c.message.as_str()),
            (REASON_SELECTED_BY_ANOTHER, m.as_str())
        );
        // Resolved: the condition goes, which is a change to write.
        let after = next_status(&s, &reports(&all), None, None, Some(1), "t2").unwrap();
        assert!(
            after
                .conditions
                .iter()
                .all(|c| c.type_ != CONDITION_CONFLICT)
        );
        assert_eq!(
            next_status(&after, &reports(&all), None, None, Some(1), "t3"),
            None
        );
    }

    use super::*;
    use crate::controllers::node_network_config::rollout::{NodeState, next_batch};
    use nodekeeper_api::crd::IntOrPercent;
    use nodekeeper_api::crd::node_network_config::Rollout;

    fn phases(n: usize, phase: impl Fn(usize) -> NodePhase) -> Vec<(String, NodePhase)> {
        (0..n).map(|i| (format!("node-{i:03}"), phase(i))).collect()
    }

    fn reports(all: &[(String, NodePhase)]) -> Vec<NodeReport<'_>> {
        all.iter()
            .map(|(name, phase)| NodeReport {
                name,
                attached: *phase != NodePhase::Pending,
                phase,
            })
            .collect()
    }

    fn failed(i: usize) -> NodePhase {
        NodePhase::Failed {
            error: format!("apply failed on link vnic{i}"),
            rolled_back: true,
        }
    }

    #[test]
    fn counts_and_at_most_fifty_failing_nodes() {
        let all = phases(120, |i| match i % 3 {
            0 => failed(i),
            1 => NodePhase::Applied,
            _ => NodePhase::Pending,
        });
        let s = next_status(
            &Default::default(),
            &reports(&all),
            None,
            None,
            Some(3),
            "t1",
        )
        .unwrap();
        assert_eq!(
            (s.matched, s.attached, s.applied, s.failing),
            (120, 80, 40, 40)
        );
        let all = phases(200, |i| {
            if i < 70 {
                failed(i)
            } else {
                NodePhase::Applied
            }
        });
        let s = next_status(
            &Default::default(),
            &reports(&all),
            None,
            None,
            Some(3),
            "t1",
        )
        .unwrap();
        assert_eq!(s.failing, 70);
        assert_eq!(s.failing_nodes.len(), MAX_FAILING_LISTED);
        assert_eq!(s.omitted_failing, 20);
        assert_eq!(s.failing_nodes[0].node, "node-000");
        assert_eq!(s.failing_nodes[0].error, "apply failed on link vnic0");
        assert_eq!(s.observed_generation, Some(3));
    }

    #[test]
    fn written_on_change_only() {
        let all = phases(4, |i| {
            if i < 2 {
                NodePhase::Applied
            } else {
                NodePhase::InProgress
            }
        });
        let first = next_status(
            &Default::default(),
            &reports(&all),
            None,
            None,
            Some(1),
            "t1",
        )
        .unwrap();
        let progressing = first
            .conditions
            .iter()
            .find(|c| c.type_ == "Progressing")
            .unwrap();
        assert_eq!(progressing.status, ConditionStatus::True);
        // Same facts later: nothing to write, whatever the clock says.
        assert_eq!(
            next_status(&first, &reports(&all), None, None, Some(1), "t2"),
            None
        );
        // One more node applied: counts change, condition times stay.
        let more = phases(4, |i| {
            if i < 3 {
                NodePhase::Applied
            } else {
                NodePhase::InProgress
            }
        });
        let second = next_status(&first, &reports(&more), None, None, Some(1), "t3").unwrap();
        assert_eq!(second.applied, 3);
        assert!(
            second
                .conditions
                .iter()
                .all(|c| c.last_transition_time == "t1")
        );
        // All applied: Ready turns True at t4.
        let done = phases(4, |_| NodePhase::Applied);
        let third = next_status(&second, &reports(&done), None, None, Some(1), "t4").unwrap();
        let ready = third
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(
            (ready.status, ready.last_transition_time.as_str()),
            (ConditionStatus::True, "t4")
        );
    }

    #[test]
    fn a_paused_rollout_names_its_failing_nodes_in_progressing() {
        let all = phases(10, |i| if i < 2 { failed(i) } else { NodePhase::Pending });
        let states: Vec<NodeState> = all
            .iter()
            .map(|(name, phase)| NodeState {
                name: name.clone(),
                phase: phase.clone(),
            })
            .collect();
        let rollout = Rollout {
            max_unavailable: IntOrPercent::Int(2),
            failure_threshold: IntOrPercent::Int(2),
        };
        let decision = next_batch(&states, &rollout);
        let s = next_status(
            &Default::default(),
            &reports(&all),
            decision.paused.as_ref(),
            None,
            None,
            "t",
        )
        .unwrap();
        let p = s
            .conditions
            .iter()
            .find(|c| c.type_ == "Progressing")
            .unwrap();
        assert_eq!(
            (p.status, p.reason.as_str()),
            (ConditionStatus::False, REASON_PAUSED)
        );
        assert!(p.message.contains("node-000, node-001"), "{}", p.message);
    }

    #[test]
    fn no_matching_nodes_and_long_errors() {
        let s = next_status(&Default::default(), &[], None, None, None, "t").unwrap();
        let ready = s.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(ready.reason, REASON_NO_MATCHING_NODES);
        let long = NodePhase::Failed {
            error: "é".repeat(1000),
            rolled_back: false,
        };
        let r = [NodeReport {
            name: "n",
            attached: false,
            phase: &long,
        }];
        let s = next_status(&Default::default(), &r, None, None, None, "t").unwrap();
        assert!(s.failing_nodes[0].error.len() <= MAX_ERROR_LEN);
        assert!(s.failing_nodes[0].error.ends_with('…'));
    }
}
