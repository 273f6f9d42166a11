//! What nodekeeper remembers on each Node it maintains (the `nodekeeper.dev/maintenance`
//! annotation): the node's `spec.unschedulable` from before the first maintenance touched it,
//! and each holding maintenance's phase and drain start. Everything about restoring follows
//! from it: a node is uncordoned only when the last holder lets go and it was schedulable
//! before; a node someone else cordoned first stays cordoned. The node's KEP-5683 conditions are
//! computed from it too, so overlapping maintenances agree on them whoever writes.
//!
//! # The maintenance taint
//!
//! While any hold cordons a node, nodekeeper also puts the `nodekeeper.dev/maintenance`
//! `NoSchedule` taint on it (as medik8s' node-maintenance-operator and the KEP-4212 draft do).
//! Why, on top of `spec.unschedulable`: a cordon is anyone's (`kubectl uncordon` undoes it and
//! it says nothing about who or why), while the taint names nodekeeper and keeps replacement
//! pods off a node mid-drain even if someone uncordons it by hand; and a workload that must run
//! there during maintenance (a maintenance tool) can opt in by tolerating it. The cost, accepted:
//! a DaemonSet pod that does not tolerate it is not re-created on the node until release
//! (`NoSchedule` never evicts, so the ones running stay).
//!
//! Restore: the record keeps the node's nodekeeper taints (key prefix `nodekeeper.dev/`) from
//! before the first hold. On the last release the maintenance taint goes unless it was there
//! before, and every recorded taint is there again; taints anyone else set are never touched.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Taint;
use serde::{Deserialize, Serialize};

/// The taint a cordoning hold adds, and its effect.
pub const MAINTENANCE_TAINT: &str = "nodekeeper.dev/maintenance";
pub const MAINTENANCE_EFFECT: &str = "NoSchedule";
/// The prefix of the taints that are nodekeeper's.
pub const NODEKEEPER_TAINT_PREFIX: &str = "nodekeeper.dev/";

/// A taint as recorded (the fields that identify and restore it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedTaint {
    pub key: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
    pub effect: String,
}

impl RecordedTaint {
    fn of(t: &Taint) -> Self {
        Self {
            key: t.key.clone(),
            value: t.value.clone().unwrap_or_default(),
            effect: t.effect.clone(),
        }
    }

    fn to_taint(&self) -> Taint {
        Taint {
            key: self.key.clone(),
            value: (!self.value.is_empty()).then(|| self.value.clone()),
            effect: self.effect.clone(),
            time_added: None,
        }
    }
}

/// nodekeeper's taints among `taints`: what the record keeps from before the first hold.
pub fn nodekeeper_taints(taints: &[Taint]) -> Vec<RecordedTaint> {
    taints
        .iter()
        .filter(|t| t.key.starts_with(NODEKEEPER_TAINT_PREFIX))
        .map(RecordedTaint::of)
        .collect()
}

/// The node's taints after a write. `current`: as read; `prior`: nodekeeper's taints from
/// before the first hold; `cordoned`: whether a hold cordons the node after this write;
/// `released`: no holder is left. Only the maintenance taint (`NoSchedule`) is added or
/// removed — and never removed when it was there before — and on release every recorded taint
/// missing is put back; every other taint stays as read.
pub fn taints(
    current: &[Taint],
    prior: &[RecordedTaint],
    cordoned: bool,
    released: bool,
) -> Vec<Taint> {
    let ours = |key: &str, effect: &str| key == MAINTENANCE_TAINT && effect == MAINTENANCE_EFFECT;
    let had_before = prior.iter().any(|t| ours(&t.key, &t.effect));
    let mut out: Vec<Taint> = current
        .iter()
        .filter(|t| had_before || cordoned || !ours(&t.key, &t.effect))
        .cloned()
        .collect();
    if cordoned && !out.iter().any(|t| ours(&t.key, &t.effect)) {
        out.push(Taint {
            key: MAINTENANCE_TAINT.to_owned(),
            value: None,
            effect: MAINTENANCE_EFFECT.to_owned(),
            time_added: None,
        });
    }
    if released {
        for t in prior {
            if !out.iter().any(|o| o.key == t.key && o.effect == t.effect) {
                out.push(t.to_taint());
            }
        }
    }
    out
}

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
    /// nodekeeper's taints before the first hold (absent in records written before taints were
    /// recorded: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prior_taints: Vec<RecordedTaint>,
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

    /// Whether a hold (not the prior state) cordons the node: the maintenance taint follows.
    pub fn held_cordoned(&self) -> bool {
        self.holders.values().any(|h| h.phase.cordons())
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
        prior_taints: Vec::new(),
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

    fn taint(key: &str, value: Option<&str>) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(str::to_owned),
            effect: "NoSchedule".into(),
            time_added: None,
        }
    }

    #[test]
    fn the_maintenance_taint_follows_the_cordon_and_prior_taints_come_back() {
        let theirs = taint("gpu", None);
        // Held: the taint joins what is there; nothing else changes.
        let held = taints(std::slice::from_ref(&theirs), &[], true, false);
        assert_eq!(held, [theirs.clone(), taint(MAINTENANCE_TAINT, None)]);
        // Idempotent.
        assert_eq!(taints(&held, &[], true, false), held);
        // A waiting hold does not cordon: no taint.
        assert_eq!(
            taints(&held, &[], false, false),
            std::slice::from_ref(&theirs)
        );
        // Released: gone again, and someone else's taint set meanwhile stays.
        let later = [held.clone(), vec![taint("other", None)]].concat();
        assert_eq!(
            taints(&later, &[], false, true),
            [theirs.clone(), taint("other", None)]
        );

        // The same key with another effect is not ours: ours goes beside it, and only ours goes.
        let soft = Taint {
            effect: "PreferNoSchedule".into(),
            ..taint(MAINTENANCE_TAINT, Some("manual"))
        };
        let prior_soft = nodekeeper_taints(std::slice::from_ref(&soft));
        let held = taints(std::slice::from_ref(&soft), &prior_soft, true, false);
        assert_eq!(held, [soft.clone(), taint(MAINTENANCE_TAINT, None)]);
        assert_eq!(taints(&held, &prior_soft, false, true), [soft]);

        // The node carried nodekeeper taints before: the maintenance taint (with its own value)
        // stays as it was, and one removed meanwhile is put back on release.
        let before = [
            taint(MAINTENANCE_TAINT, Some("manual")),
            taint("nodekeeper.dev/gpu-unhealthy", None),
        ];
        let prior = nodekeeper_taints(&[theirs.clone(), before[0].clone(), before[1].clone()]);
        assert_eq!(prior.len(), 2);
        let held = taints(&before, &prior, true, false);
        assert_eq!(held, before);
        let released = taints(&before[..1], &prior, false, true);
        assert_eq!(released, before);

        // The record keeps them, and older records without them still read.
        let mut r = set_hold(None, false, "a", hold(HoldPhase::Cordoned));
        r.prior_taints = prior.clone();
        assert_eq!(NodeRecord::parse(Some(&r.to_annotation())).unwrap(), r);
        let old = r#"{"priorUnschedulable":false,"holders":{}}"#;
        assert!(
            NodeRecord::parse(Some(old))
                .unwrap()
                .prior_taints
                .is_empty()
        );
        assert!(r.held_cordoned());
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
