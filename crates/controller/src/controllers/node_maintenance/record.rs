//! What nodekeeper remembers on each Node it maintains (the `nodekeeper.dev/maintenance`
//! annotation): the node's `spec.unschedulable` from before the first maintenance touched it,
//! and each holding maintenance's phase and drain start. Everything about restoring follows
//! from it: a node is uncordoned only when the last holder lets go and it was schedulable
//! before; a node someone else cordoned first stays cordoned. The node's KEP-5683 conditions are
//! computed from it too, so overlapping maintenances agree on them whoever writes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One maintenance's hold on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum HoldPhase {
    /// Selected; waiting for a drain slot. Not cordoned for this holder.
    Waiting,
    /// Cordoned (stage `Cordon`, or `Drain` moved back to `Cordon`).
    Cordoned,
    /// Cordoned and being drained.
    Draining,
    /// Cordoned and drained.
    Drained,
    /// Cordoned; the drain timed out with `onTimeout: Fail`.
    Failed,
}

impl HoldPhase {
    /// Whether this hold keeps the node unschedulable.
    pub fn cordons(self) -> bool {
        self != HoldPhase::Waiting
    }
}

/// One maintenance's hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hold {
    pub phase: HoldPhase,
    /// When this node's drain started (Unix seconds): the timeout counts from here, across
    /// controller restarts and leader changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_start: Option<i64>,
    /// For `Drained` by `onTimeout: Proceed` and for `Failed`: what was left.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The maintenance's `spec.reason`, shown in the node conditions' message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// The annotation's content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRecord {
    /// `spec.unschedulable` before nodekeeper first touched the node.
    pub prior_unschedulable: bool,
    /// Holders by NodeMaintenance name.
    #[serde(default)]
    pub holders: BTreeMap<String, Hold>,
}

impl NodeRecord {
    /// Reads the annotation; a value nodekeeper cannot read is treated as absent, with the
    /// node's current state taken as the prior one (the safe reading: nothing gets uncordoned
    /// that was cordoned when we found it).
    pub fn parse(annotation: Option<&str>) -> Option<NodeRecord> {
        annotation.and_then(|a| serde_json::from_str(a).ok())
    }

    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).expect("a record serializes")
    }

    /// `holder`'s hold, if any.
    pub fn hold(&self, holder: &str) -> Option<&Hold> {
        self.holders.get(holder)
    }

    /// Whether the node should be unschedulable: it was before, or a hold cordons it.
    pub fn wants_unschedulable(&self) -> bool {
        self.prior_unschedulable || self.holders.values().any(|h| h.phase.cordons())
    }

    /// Whether any holder is draining the node (it then counts against the cluster ceiling).
    pub fn draining(&self) -> bool {
        self.holders
            .values()
            .any(|h| h.phase == HoldPhase::Draining)
    }
}

/// The record after `holder` sets its hold to `hold`. `current` is the node's record (if any);
/// `unschedulable_now` its `spec.unschedulable`, which becomes the prior state when this is the
/// first hold. Another holder's hold is never changed.
pub fn set_hold(
    current: Option<&NodeRecord>,
    unschedulable_now: bool,
    holder: &str,
    hold: Hold,
) -> NodeRecord {
    let mut record = current.cloned().unwrap_or(NodeRecord {
        prior_unschedulable: unschedulable_now,
        holders: BTreeMap::new(),
    });
    record.holders.insert(holder.to_owned(), hold);
    record
}

/// What releasing a node does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    /// The record to keep; `None` removes the annotation (no holder left).
    pub record: Option<NodeRecord>,
    /// Whether the node ends schedulable: only when nodekeeper made it unschedulable and no
    /// other maintenance holds it cordoned.
    pub uncordon: bool,
}

/// `holder` lets go of the node.
pub fn release(current: &NodeRecord, holder: &str) -> Release {
    let mut record = current.clone();
    record.holders.remove(holder);
    let still_cordoned = record.wants_unschedulable();
    Release {
        uncordon: !still_cordoned,
        record: (!record.holders.is_empty()).then_some(record),
    }
}

/// A node condition nodekeeper owns during maintenance (KEP-5683 names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCondition {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

/// The maintenance conditions a node should carry for `record` (empty when nothing holds it:
/// they are removed). Computed from the record alone, so that every holder writes the same.
pub fn node_conditions(record: Option<&NodeRecord>) -> Vec<NodeCondition> {
    use nodekeeper_api::names::{
        NODE_CONDITION_DRAIN_IN_PROGRESS, NODE_CONDITION_DRAINED,
        NODE_CONDITION_MAINTENANCE_IN_PROGRESS, NODE_CONDITION_MAINTENANCE_PLANNED,
    };
    let Some(record) = record.filter(|r| !r.holders.is_empty()) else {
        return Vec::new();
    };
    let phases: Vec<HoldPhase> = record.holders.values().map(|h| h.phase).collect();
    let has = |p: HoldPhase| phases.contains(&p);
    let in_progress = phases.iter().any(|p| p.cordons());
    let planned = has(HoldPhase::Waiting) && !in_progress;
    let draining = has(HoldPhase::Draining);
    let drained = !draining && has(HoldPhase::Drained);
    let message = record
        .holders
        .iter()
        .map(|(name, h)| {
            if h.reason.is_empty() {
                format!("NodeMaintenance {name}")
            } else {
                format!("NodeMaintenance {name} ({})", h.reason)
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let cond = |type_, status, reason| NodeCondition {
        type_,
        status,
        reason,
        message: message.clone(),
    };
    vec![
        cond(
            NODE_CONDITION_MAINTENANCE_PLANNED,
            planned,
            if planned {
                "WaitingForTurn"
            } else {
                "NotPlanned"
            },
        ),
        cond(
            NODE_CONDITION_MAINTENANCE_IN_PROGRESS,
            in_progress,
            if in_progress {
                "Cordoned"
            } else {
                "NotStarted"
            },
        ),
        cond(
            NODE_CONDITION_DRAIN_IN_PROGRESS,
            draining,
            if draining {
                "Evicting"
            } else if has(HoldPhase::Failed) {
                "DrainTimedOut"
            } else {
                "NotDraining"
            },
        ),
        cond(
            NODE_CONDITION_DRAINED,
            drained,
            if drained { "Drained" } else { "NotDrained" },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(phase: HoldPhase) -> Hold {
        Hold {
            phase,
            drain_start: None,
            note: String::new(),
            reason: "kernel".into(),
        }
    }

    #[test]
    fn a_node_nodekeeper_cordoned_is_uncordoned_on_release() {
        let r = set_hold(None, false, "a", hold(HoldPhase::Cordoned));
        assert!(!r.prior_unschedulable && r.wants_unschedulable());
        let back = NodeRecord::parse(Some(&r.to_annotation())).unwrap();
        assert_eq!(back, r);
        assert_eq!(
            release(&r, "a"),
            Release {
                record: None,
                uncordon: true
            }
        );
    }

    #[test]
    fn a_node_cordoned_before_stays_cordoned() {
        let r = set_hold(None, true, "a", hold(HoldPhase::Draining));
        assert!(r.prior_unschedulable);
        let rel = release(&r, "a");
        assert_eq!(rel.record, None);
        assert!(!rel.uncordon);
    }

    #[test]
    fn overlapping_maintenances_last_one_out_restores() {
        // A cordons a schedulable node; B joins later and sees it unschedulable, but the
        // record keeps A's view of the prior state.
        let a = set_hold(None, false, "a", hold(HoldPhase::Draining));
        let ab = set_hold(Some(&a), true, "b", hold(HoldPhase::Cordoned));
        assert!(!ab.prior_unschedulable);
        assert_eq!(ab.holders.len(), 2);

        // A finishes first: B still holds it cordoned.
        let rel = release(&ab, "a");
        assert!(!rel.uncordon);
        let b_only = rel.record.unwrap();
        assert_eq!(b_only.holders.keys().collect::<Vec<_>>(), ["b"]);
        // Then B: nobody left, and it was schedulable before A came.
        assert_eq!(
            release(&b_only, "b"),
            Release {
                record: None,
                uncordon: true
            }
        );

        // A waiting holder does not keep the node cordoned.
        let w = set_hold(Some(&a), true, "w", hold(HoldPhase::Waiting));
        let rel = release(&w, "a");
        assert!(rel.uncordon);
        assert!(rel.record.is_some(), "w still has its hold");
        // Releasing a holder that holds nothing changes nothing.
        assert_eq!(release(&a, "zz").record, Some(a));
    }

    #[test]
    fn unreadable_annotation_is_absent() {
        assert_eq!(NodeRecord::parse(Some("{not json")), None);
        assert_eq!(NodeRecord::parse(None), None);
    }

    #[test]
    fn node_conditions_follow_the_holds() {
        let status = |r: &NodeRecord| {
            node_conditions(Some(r))
                .iter()
                .map(|c| (c.type_, c.status))
                .collect::<Vec<_>>()
        };
        let waiting = set_hold(None, false, "a", hold(HoldPhase::Waiting));
        assert_eq!(
            status(&waiting),
            [
                ("MaintenancePlanned", true),
                ("MaintenanceInProgress", false),
                ("DrainInProgress", false),
                ("Drained", false)
            ]
        );
        let draining = set_hold(None, false, "a", hold(HoldPhase::Draining));
        assert_eq!(
            status(&draining),
            [
                ("MaintenancePlanned", false),
                ("MaintenanceInProgress", true),
                ("DrainInProgress", true),
                ("Drained", false)
            ]
        );
        let drained = set_hold(None, false, "a", hold(HoldPhase::Drained));
        assert_eq!(status(&drained)[3], ("Drained", true));
        // Drained by one, still draining by another: not drained.
        let both = set_hold(Some(&drained), false, "b", hold(HoldPhase::Draining));
        assert_eq!(
            status(&both)[2..],
            [("DrainInProgress", true), ("Drained", false)]
        );
        let failed = set_hold(None, false, "a", hold(HoldPhase::Failed));
        assert_eq!(node_conditions(Some(&failed))[2].reason, "DrainTimedOut");
        assert_eq!(
            node_conditions(Some(&failed))[0].message,
            "NodeMaintenance a (kernel)"
        );
        // Released: the conditions go.
        assert!(node_conditions(None).is_empty());
    }
}
