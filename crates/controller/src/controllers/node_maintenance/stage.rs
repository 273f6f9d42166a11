//! From the stage to each node's hold: who is cordoned, who drains now (within
//! `maxConcurrentNodes` and the cluster-wide ceiling), who waits, who is let go. Moving a stage
//! back stops draining at once (Draining → Cordoned) and leaves evicted pods evicted.

use nodekeeper_api::crd::node_maintenance::Stage;

use super::record::HoldPhase;

/// What this maintenance wants for one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Let go (restore, if nobody else holds it).
    Release,
    /// Hold in this phase.
    Hold(HoldPhase),
}

/// One node: whether the selector picks it, and this maintenance's hold on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeHold {
    pub node: String,
    pub selected: bool,
    pub hold: Option<HoldPhase>,
}

/// Drain slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// `spec.maxConcurrentNodes`.
    pub max_concurrent: u32,
    /// The tuning ConfigMap's `maintenance.maxConcurrentNodes`.
    pub cluster_ceiling: u32,
    /// Nodes draining now under every maintenance, this one included.
    pub cluster_draining: u32,
}

/// The target for every node, in the order given. Nodes are promoted to `Draining` in the order
/// given (the reconciler sorts them by name, so every replica picks the same ones).
pub fn targets(stage: Stage, nodes: &[NodeHold], limits: Limits) -> Vec<Target> {
    match stage {
        Stage::Idle | Stage::Complete => nodes.iter().map(|_| Target::Release).collect(),
        Stage::Cordon => nodes
            .iter()
            .map(|n| {
                if n.selected {
                    Target::Hold(HoldPhase::Cordoned)
                } else {
                    Target::Release
                }
            })
            .collect(),
        Stage::Drain => {
            // A failed node keeps its slot: `onTimeout: Fail` stops the maintenance there.
            let busy = nodes
                .iter()
                .filter(|n| {
                    n.selected && matches!(n.hold, Some(HoldPhase::Draining | HoldPhase::Failed))
                })
                .count();
            let busy = u32::try_from(busy).unwrap_or(u32::MAX);
            let mut free = limits.max_concurrent.saturating_sub(busy).min(
                limits
                    .cluster_ceiling
                    .saturating_sub(limits.cluster_draining),
            );
            nodes
                .iter()
                .map(|n| {
                    if !n.selected {
                        return Target::Release;
                    }
                    match n.hold {
                        Some(
                            p @ (HoldPhase::Draining | HoldPhase::Drained | HoldPhase::Failed),
                        ) => Target::Hold(p),
                        waiting @ (None | Some(HoldPhase::Waiting | HoldPhase::Cordoned)) => {
                            if free > 0 {
                                free -= 1;
                                Target::Hold(HoldPhase::Draining)
                            } else {
                                // A node cordoned by an earlier `Cordon` stage stays cordoned
                                // while it waits.
                                Target::Hold(waiting.unwrap_or(HoldPhase::Waiting))
                            }
                        }
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(node: &str, hold: Option<HoldPhase>) -> NodeHold {
        NodeHold {
            node: node.into(),
            selected: true,
            hold,
        }
    }

    const WIDE: Limits = Limits {
        max_concurrent: 100,
        cluster_ceiling: 100,
        cluster_draining: 0,
    };

    #[test]
    fn drain_respects_max_concurrent_and_failed_nodes_keep_their_slot() {
        use HoldPhase::*;
        let nodes = [
            n("a", Some(Drained)),
            n("b", Some(Draining)),
            n("c", None),
            n("d", Some(Cordoned)),
            n("e", None),
        ];
        let limits = Limits {
            max_concurrent: 2,
            ..WIDE
        };
        assert_eq!(
            targets(Stage::Drain, &nodes, limits),
            [
                Target::Hold(Drained),
                Target::Hold(Draining),
                Target::Hold(Draining),
                Target::Hold(Cordoned),
                Target::Hold(Waiting)
            ]
        );
        let nodes = [n("a", Some(Failed)), n("b", None)];
        let limits = Limits {
            max_concurrent: 1,
            ..WIDE
        };
        assert_eq!(
            targets(Stage::Drain, &nodes, limits),
            [Target::Hold(Failed), Target::Hold(Waiting)]
        );
    }

    #[test]
    fn the_cluster_ceiling_bounds_every_maintenance_together() {
        let nodes = [n("a", None), n("b", None), n("c", None)];
        let limits = Limits {
            max_concurrent: 3,
            cluster_ceiling: 5,
            cluster_draining: 4,
        };
        assert_eq!(
            targets(Stage::Drain, &nodes, limits),
            [
                Target::Hold(HoldPhase::Draining),
                Target::Hold(HoldPhase::Waiting),
                Target::Hold(HoldPhase::Waiting)
            ]
        );
    }

    #[test]
    fn stages_back_and_forward() {
        use HoldPhase::*;
        let nodes = [
            n("a", Some(Draining)),
            n("b", Some(Drained)),
            n("c", Some(Waiting)),
        ];
        // Drain → Cordon: stop draining at once, keep everything cordoned.
        assert_eq!(
            targets(Stage::Cordon, &nodes, WIDE),
            [Target::Hold(Cordoned); 3]
        );
        // → Idle and → Complete: let go of everything.
        assert_eq!(targets(Stage::Idle, &nodes, WIDE), [Target::Release; 3]);
        assert_eq!(targets(Stage::Complete, &nodes, WIDE), [Target::Release; 3]);
        // A node no longer selected is let go.
        let mut gone = n("x", Some(Draining));
        gone.selected = false;
        assert_eq!(targets(Stage::Drain, &[gone], WIDE), [Target::Release]);
    }
}
