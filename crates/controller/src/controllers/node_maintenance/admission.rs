//! Admission safety: the selections a NodeMaintenance is refused for before it touches any node.
//!
//! Where it runs, and why there: the CRD's CEL rules refuse what is wrong in the object alone
//! (an empty selector, reopening a Complete maintenance, changing the selector mid-way). What
//! depends on the cluster (does the selector pick every node, every control-plane node, more
//! than the cap?) is checked here, by the controller, at the moment the maintenance would first
//! touch a node, and the refusal is a `Ready=False, reason Refused` condition naming the field
//! and the fix. A validating webhook was considered and not chosen: it would answer only at
//! write time, while the node set changes afterwards (a node labelled later joins the
//! selection), so the controller has to check at start anyway; and a webhook adds a serving
//! certificate the API server must trust, a Service, and a failure policy that either blocks
//! every NodeMaintenance write while the controller is down or silently lets them through.
//! Checking at first touch is the one place the check is both current and unavoidable.

use std::fmt;

/// The cluster as the check sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Nodes the selector picks.
    pub selected: u32,
    /// Nodes in the cluster.
    pub total: u32,
    /// Control-plane nodes the selector picks.
    pub selected_control_plane: u32,
    /// Control-plane nodes in the cluster.
    pub total_control_plane: u32,
}

/// Why a selection is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The selector picks every node in the cluster.
    EveryNode { total: u32 },
    /// The selector picks every control-plane node.
    EveryControlPlaneNode { total: u32 },
    /// More nodes than the tuning ConfigMap allows.
    AboveCap { selected: u32, cap: u32 },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fix =
            "narrow spec.nodeSelector, or set spec.allowBroadSelection: true if this is meant";
        match self {
            Refusal::EveryNode { total } => write!(
                f,
                "spec.nodeSelector picks every node in the cluster ({total}); {fix}"
            ),
            Refusal::EveryControlPlaneNode { total } => write!(
                f,
                "spec.nodeSelector picks every control-plane node ({total}); {fix}"
            ),
            Refusal::AboveCap { selected, cap } => write!(
                f,
                "spec.nodeSelector picks {selected} nodes, more than the {cap} allowed by maintenance.maxSelectedNodes in the tuning ConfigMap; {fix}, or raise the cap"
            ),
        }
    }
}

/// Checks a selection; `override_` is `spec.allowBroadSelection`. A selection of nothing is not
/// refused (there is nothing to touch; the status says so).
pub fn check(s: Selection, cap: u32, override_: bool) -> Result<(), Refusal> {
    if override_ || s.selected == 0 {
        return Ok(());
    }
    if s.selected >= s.total {
        return Err(Refusal::EveryNode { total: s.total });
    }
    if s.total_control_plane > 0 && s.selected_control_plane >= s.total_control_plane {
        return Err(Refusal::EveryControlPlaneNode {
            total: s.total_control_plane,
        });
    }
    if s.selected > cap {
        return Err(Refusal::AboveCap {
            selected: s.selected,
            cap,
        });
    }
    Ok(())
}

/// The label that marks control-plane nodes.
pub const CONTROL_PLANE_LABEL: &str = "node-role.kubernetes.io/control-plane";

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(selected: u32, total: u32, cp: u32, total_cp: u32) -> Selection {
        Selection {
            selected,
            total,
            selected_control_plane: cp,
            total_control_plane: total_cp,
        }
    }

    #[test]
    fn refusals_and_overrides() {
        assert_eq!(check(sel(3, 10, 0, 3), 5, false), Ok(()));
        assert_eq!(
            check(sel(10, 10, 3, 3), 100, false),
            Err(Refusal::EveryNode { total: 10 })
        );
        assert_eq!(
            check(sel(4, 10, 3, 3), 100, false),
            Err(Refusal::EveryControlPlaneNode { total: 3 })
        );
        // One of three control-plane nodes is fine.
        assert_eq!(check(sel(4, 10, 1, 3), 100, false), Ok(()));
        assert_eq!(
            check(sel(6, 10, 0, 0), 5, false),
            Err(Refusal::AboveCap {
                selected: 6,
                cap: 5
            })
        );
        for s in [sel(10, 10, 3, 3), sel(4, 10, 3, 3), sel(6, 10, 0, 0)] {
            assert_eq!(check(s, 5, true), Ok(()));
        }
        // Nothing selected: nothing to refuse.
        assert_eq!(check(sel(0, 0, 0, 0), 5, false), Ok(()));
    }

    #[test]
    fn messages_name_the_field_and_the_fix() {
        let m = Refusal::AboveCap {
            selected: 6,
            cap: 5,
        }
        .to_string();
        assert!(m.starts_with("spec.nodeSelector picks 6 nodes"), "{m}");
        assert!(m.contains("maintenance.maxSelectedNodes"), "{m}");
        assert!(m.contains("spec.allowBroadSelection: true"), "{m}");
        let m = Refusal::EveryNode { total: 7 }.to_string();
        assert!(m.contains("every node in the cluster (7)"), "{m}");
    }
}
