//! What a NodeSet does next, as plain functions over plain data: which machines to create, which
//! nodes to drain (not Ready first, then newest), which drained machines to delete, which
//! machines that never joined to replace, and the rolling-replacement arithmetic within
//! `maxSurge` / `maxUnavailable` (the Deployment controller's rules, applied to nodes).

use std::cmp::Reverse;

/// How a node is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    /// Its kubelet has never reported: no Ready condition yet, or only the `Ready=Unknown`
    /// (reason `NodeStatusNeverUpdated`) kube-controller-manager writes on such a Node after its
    /// startup grace period. The machine has not joined.
    NeverJoined,
    /// A Ready condition that is not `True`.
    NotReady,
    /// Ready.
    Ready,
}

/// Where a node is on its way out of the set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Leaving {
    /// It is not leaving.
    No,
    /// Its NodeMaintenance is draining it.
    Draining,
    /// Drained: its machine may be deleted.
    Drained,
    /// Its drain failed or was refused; the message says why. It stays until someone acts.
    Stuck(String),
    /// Its machine is being deleted.
    Deleting,
}

/// One node of the set as the controller sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineView {
    pub name: String,
    /// Creation time, Unix seconds.
    pub created: i64,
    pub health: Health,
    /// Made from the current class and template.
    pub updated: bool,
    pub leaving: Leaving,
    /// Since when (Unix seconds) the node is unhealthy for repair: Ready not `True`, or a
    /// condition the set names `False`. `None` when healthy or never joined.
    pub unhealthy_since: Option<i64>,
}

/// Bounded repair, when the set asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repair {
    /// A node unhealthy this long is replaced.
    pub after_secs: i64,
    /// Repair goes on only while at most this many nodes are unhealthy (those being repaired
    /// included).
    pub max_unhealthy: u32,
}

/// The numbers the plan works with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inputs {
    pub replicas: u32,
    /// `replicas` plus `maxSurge`: the most machines that may exist during a replacement.
    pub max_total: u32,
    /// `replicas` minus `maxUnavailable`: the fewest Ready nodes during a replacement.
    pub min_ready: u32,
    /// Now, Unix seconds.
    pub now: i64,
    /// A machine still [`Health::NeverJoined`] this long after creation is replaced.
    pub join_timeout_secs: i64,
    /// Machines created by this process that the Node watch has not shown yet (new, updated,
    /// not joined).
    pub in_flight: u32,
    /// Bounded repair, when the set asks for it.
    pub repair: Option<Repair>,
    /// Whether machines can be created (the set's NodeClass is usable). Without, nothing is
    /// created and nothing is taken out for a replacement that cannot come: no repair, no
    /// replacement of machines that never joined or of outdated nodes; a scale-down still
    /// drains and removes what is beyond `replicas`.
    pub can_create: bool,
}

/// What to do now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Machines to create.
    pub create: u32,
    /// Nodes whose drain starts (a NodeMaintenance is created for each).
    pub drain: Vec<String>,
    /// Nodes being drained that the set needs again (their NodeMaintenance is deleted).
    pub reclaim: Vec<String>,
    /// Drained nodes whose machine is deleted.
    pub remove: Vec<String>,
    /// Machines that never joined within the timeout: deleted at once (no pod ever ran there)
    /// and replaced.
    pub replace: Vec<String>,
    /// Of `drain`: the nodes drained because they were unhealthy too long.
    pub repair: Vec<String>,
    /// Repair is halted: this many nodes are unhealthy, more than allowed.
    pub repair_halted: Option<u32>,
    /// Counts for the status.
    pub counts: Counts,
}

/// The status counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Machines in the set that are not leaving (with those in flight).
    pub replicas: u32,
    pub ready: u32,
    pub updated: u32,
    /// Nodes on their way out (draining, drained, stuck, being deleted).
    pub draining: u32,
}

/// The order in which nodes leave: not Ready first (never joined before not Ready), then the
/// newest, then by name (so two controllers, or two runs, pick the same node).
pub fn removal_order(a: &MachineView, b: &MachineView) -> std::cmp::Ordering {
    (a.health, Reverse(a.created), Reverse(&a.name)).cmp(&(
        b.health,
        Reverse(b.created),
        Reverse(&b.name),
    ))
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The next step for a set whose nodes are `machines`.
pub fn plan(machines: &[MachineView], inputs: Inputs) -> Plan {
    let mut out = Plan::default();
    let expired = |m: &MachineView| {
        m.health == Health::NeverJoined && inputs.now - m.created > inputs.join_timeout_secs
    };
    let mut active: Vec<&MachineView> = Vec::new();
    for m in machines {
        match &m.leaving {
            Leaving::No if expired(m) && inputs.can_create => out.replace.push(m.name.clone()),
            Leaving::No => active.push(m),
            Leaving::Drained => out.remove.push(m.name.clone()),
            Leaving::Draining | Leaving::Stuck(_) | Leaving::Deleting => {}
        }
    }

    // Bounded repair first: the nodes it takes out are replaced by the arithmetic below like any
    // missing node.
    if let Some(r) = inputs.repair.filter(|_| inputs.can_create) {
        let unhealthy = active
            .iter()
            .filter(|m| m.unhealthy_since.is_some())
            .count();
        let repairing = machines
            .iter()
            .filter(|m| m.unhealthy_since.is_some() && !matches!(m.leaving, Leaving::No))
            .count();
        let all = count(unhealthy + repairing);
        if all > r.max_unhealthy {
            out.repair_halted = Some(all);
        } else {
            out.repair = active
                .iter()
                .filter(|m| {
                    m.unhealthy_since
                        .is_some_and(|t| inputs.now - t >= r.after_secs)
                })
                .map(|m| m.name.clone())
                .collect();
            active.retain(|m| !out.repair.contains(&m.name));
        }
    }

    let mut total = count(active.len()) + inputs.in_flight;
    let mut updated = count(active.iter().filter(|m| m.updated).count()) + inputs.in_flight;
    let mut ready = count(active.iter().filter(|m| m.health == Health::Ready).count());

    // Short of machines while some of the set's own current nodes are still draining: keep
    // those (the healthiest, oldest first) before creating new ones.
    if total < inputs.replicas {
        let mut draining: Vec<&MachineView> = machines
            .iter()
            .filter(|m| m.leaving == Leaving::Draining && m.updated)
            .collect();
        draining.sort_by(|a, b| removal_order(b, a));
        for m in draining
            .into_iter()
            .take((inputs.replicas - total) as usize)
        {
            out.reclaim.push(m.name.clone());
            active.push(m);
            total += 1;
            updated += 1;
            if m.health == Health::Ready {
                ready += 1;
            }
        }
    }

    // Outdated machines still on their way out exist (and cost) until deleted: the surge bound
    // counts them, so a rollout never has more than `max_total` machines. (Nodes of a plain
    // scale-down are current and not counted, so scaling back up is never held by them.)
    let leaving_outdated = count(
        machines
            .iter()
            .filter(|m| !m.updated && !matches!(m.leaving, Leaving::No))
            .count(),
    );
    if inputs.can_create {
        out.create = inputs
            .replicas
            .saturating_sub(updated)
            .min(inputs.max_total.saturating_sub(total + leaving_outdated));
    }

    let outdated: Vec<&MachineView> = active.iter().copied().filter(|m| !m.updated).collect();
    // Without creates, outdated nodes are kept (a rollout would only shrink the set).
    if outdated.is_empty() || !inputs.can_create {
        // Plain scale-down: what the user asked for, whatever the availability.
        let mut candidates = active.clone();
        candidates.sort_by(|a, b| removal_order(a, b));
        let excess = total.saturating_sub(inputs.replicas) as usize;
        // Machines in flight cannot be drained yet; they are counted, and the next round sees them.
        out.drain = candidates
            .iter()
            .take(excess.min(candidates.len()))
            .map(|m| m.name.clone())
            .collect();
    } else {
        // Rolling replacement: an outdated node that is not Ready goes at once; a Ready one
        // only while the set keeps `min_ready` Ready nodes.
        let mut budget = ready.saturating_sub(inputs.min_ready);
        let mut candidates = outdated;
        // Updated nodes beyond `replicas` (a scale-down during a rollout) go too, after the old.
        let mut extra: Vec<&MachineView> = active.iter().copied().filter(|m| m.updated).collect();
        extra.sort_by(|a, b| removal_order(a, b));
        let extra_count = (updated.saturating_sub(inputs.replicas) as usize).min(extra.len());
        candidates.sort_by(|a, b| removal_order(a, b));
        candidates.extend(extra.into_iter().take(extra_count));
        for m in candidates {
            if m.health != Health::Ready {
                out.drain.push(m.name.clone());
            } else if budget > 0 {
                budget -= 1;
                out.drain.push(m.name.clone());
            }
        }
    }

    let drained = count(out.drain.len());
    let repaired = count(out.repair.len());
    out.drain.splice(0..0, out.repair.iter().cloned());
    let draining_ready = count(
        active
            .iter()
            .filter(|m| m.health == Health::Ready && out.drain.contains(&m.name))
            .count(),
    );
    let draining_updated = count(
        active
            .iter()
            .filter(|m| m.updated && out.drain.contains(&m.name))
            .count(),
    );
    let leaving_before = count(
        machines
            .iter()
            .filter(|m| !matches!(m.leaving, Leaving::No))
            .count(),
    ) - count(out.reclaim.len());
    out.counts = Counts {
        replicas: total - drained,
        ready: ready - draining_ready,
        updated: updated - draining_updated,
        draining: leaving_before + drained + repaired,
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(name: &str, created: i64, health: Health, updated: bool) -> MachineView {
        MachineView {
            name: name.into(),
            created,
            health,
            updated,
            leaving: Leaving::No,
            unhealthy_since: None,
        }
    }

    fn inputs(replicas: u32, max_total: u32, min_ready: u32) -> Inputs {
        Inputs {
            replicas,
            max_total,
            min_ready,
            now: 1_000,
            join_timeout_secs: 600,
            in_flight: 0,
            repair: None,
            can_create: true,
        }
    }

    #[test]
    fn scale_up_creates_what_is_missing_counting_those_in_flight() {
        let nodes = [m("a", 1, Health::Ready, true)];
        let p = plan(&nodes, inputs(5, 6, 5));
        assert_eq!(p.create, 4);
        let p = plan(
            &nodes,
            Inputs {
                in_flight: 3,
                ..inputs(5, 6, 5)
            },
        );
        assert_eq!(p.create, 1);
        assert_eq!(p.counts.replicas, 4);
        assert!(p.drain.is_empty());
    }

    #[test]
    fn scale_down_drains_not_ready_first_then_newest() {
        let nodes = [
            m("old", 10, Health::Ready, true),
            m("new", 30, Health::Ready, true),
            m("mid", 20, Health::Ready, true),
            m("sick", 5, Health::NotReady, true),
            m("unjoined", 950, Health::NeverJoined, true),
        ];
        let p = plan(&nodes, inputs(2, 3, 2));
        assert_eq!(p.drain, ["unjoined", "sick", "new"]);
        assert_eq!(p.create, 0);
        assert_eq!(p.counts.replicas, 2);
        assert_eq!(p.counts.ready, 2);
        assert_eq!(p.counts.draining, 3);
        // To zero: every node, in the same order.
        let p = plan(&nodes, inputs(0, 1, 0));
        assert_eq!(p.drain, ["unjoined", "sick", "new", "mid", "old"]);
    }

    #[test]
    fn draining_nodes_are_not_drained_twice_and_drained_ones_are_removed() {
        let mut nodes = vec![
            m("a", 1, Health::Ready, true),
            m("b", 2, Health::Ready, true),
            m("c", 3, Health::Ready, true),
        ];
        nodes[2].leaving = Leaving::Draining;
        let p = plan(&nodes, inputs(2, 3, 2));
        assert!(p.drain.is_empty());
        assert_eq!(p.counts.draining, 1);
        nodes[2].leaving = Leaving::Drained;
        let p = plan(&nodes, inputs(2, 3, 2));
        assert_eq!(p.remove, ["c"]);
        nodes[2].leaving = Leaving::Stuck("drain timed out".into());
        let p = plan(&nodes, inputs(2, 3, 2));
        assert!(p.remove.is_empty() && p.drain.is_empty() && p.create == 0);
    }

    #[test]
    fn scaling_back_up_reclaims_a_draining_node_before_creating() {
        let mut nodes = vec![
            m("a", 1, Health::Ready, true),
            m("b", 2, Health::Ready, true),
        ];
        nodes[1].leaving = Leaving::Draining;
        let p = plan(&nodes, inputs(3, 4, 3));
        assert_eq!(p.reclaim, ["b"]);
        assert_eq!(p.create, 1);
        assert_eq!(p.counts.replicas, 2);
        assert_eq!(p.counts.draining, 0);
    }

    #[test]
    fn a_machine_that_never_joins_is_replaced() {
        let nodes = [
            m("late", 100, Health::NeverJoined, true),
            m("fresh", 900, Health::NeverJoined, true),
            m("ok", 1, Health::Ready, true),
        ];
        let p = plan(&nodes, inputs(3, 4, 3));
        assert_eq!(p.replace, ["late"]);
        assert_eq!(p.create, 1);
        assert!(p.drain.is_empty());
    }

    #[test]
    fn rolling_replacement_surges_then_drains_as_new_nodes_get_ready() {
        // maxSurge 1, maxUnavailable 0 on 3 nodes.
        let old = |n: &str, t| m(n, t, Health::Ready, false);
        let nodes = vec![old("o1", 1), old("o2", 2), old("o3", 3)];
        let p = plan(&nodes, inputs(3, 4, 3));
        assert_eq!((p.create, p.drain.len()), (1, 0));
        assert_eq!(p.counts.updated, 0);
        // The new one is there but not Ready: nothing more.
        let mut nodes2 = nodes.clone();
        nodes2.push(m("n1", 10, Health::NotReady, true));
        let p = plan(&nodes2, inputs(3, 4, 3));
        assert_eq!((p.create, p.drain.len()), (0, 0));
        // Ready: one old node (the newest) goes.
        nodes2[3].health = Health::Ready;
        let p = plan(&nodes2, inputs(3, 4, 3));
        assert_eq!(p.drain, ["o3"]);
        assert_eq!(p.create, 0);
        assert_eq!(p.counts.updated, 1);
        // While o3 drains it still counts against the surge: no second new machine yet.
        nodes2[2].leaving = Leaving::Draining;
        let p = plan(&nodes2, inputs(3, 4, 3));
        assert_eq!((p.create, p.drain.len()), (0, 0));
        // Gone: the next new machine.
        nodes2.remove(2);
        let p = plan(&nodes2, inputs(3, 4, 3));
        assert_eq!((p.create, p.drain.len()), (1, 0));
    }

    #[test]
    fn rolling_replacement_without_surge_drains_first() {
        // maxSurge 0, maxUnavailable 1.
        let nodes = vec![
            m("o1", 1, Health::Ready, false),
            m("o2", 2, Health::Ready, false),
            m("o3", 3, Health::NotReady, false),
        ];
        let p = plan(&nodes, inputs(3, 3, 2));
        // The not-Ready one is free; one Ready one fits the budget (2 ready - 2 min = 0): none.
        assert_eq!(p.drain, ["o3"]);
        assert_eq!(p.create, 0);
        let nodes = vec![
            m("o1", 1, Health::Ready, false),
            m("o2", 2, Health::Ready, false),
            m("o3", 3, Health::Ready, false),
        ];
        let p = plan(&nodes, inputs(3, 3, 2));
        assert_eq!(p.drain, ["o3"]);
    }

    #[test]
    fn a_failing_new_node_stops_the_rollout() {
        let nodes = vec![
            m("o1", 1, Health::Ready, false),
            m("o2", 2, Health::Ready, false),
            m("n1", 900, Health::NeverJoined, true),
        ];
        // maxSurge 1, maxUnavailable 0 with 2 replicas: the new node never gets Ready, so no
        // old node is drained and nothing more is created.
        let p = plan(&nodes, inputs(2, 3, 2));
        assert_eq!((p.create, p.drain.len()), (0, 0));
    }

    #[test]
    fn repair_replaces_long_unhealthy_nodes_but_stops_when_too_many_are() {
        let sick = |n: &str, since| MachineView {
            unhealthy_since: Some(since),
            ..m(n, 1, Health::NotReady, true)
        };
        let repair = Some(Repair {
            after_secs: 300,
            max_unhealthy: 1,
        });
        // One node NotReady for 500 s, one for 100 s: only the first is due... but two are
        // unhealthy, above the bound of 1: nothing.
        let nodes = vec![
            m("a", 1, Health::Ready, true),
            m("b", 2, Health::Ready, true),
            m("c", 3, Health::Ready, true),
            sick("d", 500),
            sick("e", 900),
        ];
        let p = plan(
            &nodes,
            Inputs {
                repair,
                ..inputs(5, 6, 5)
            },
        );
        assert_eq!(p.repair_halted, Some(2));
        assert!(p.drain.is_empty() && p.create == 0);
        // With a bound of 2, the one due is drained and replaced at once.
        let repair = Some(Repair {
            after_secs: 300,
            max_unhealthy: 2,
        });
        let p = plan(
            &nodes,
            Inputs {
                repair,
                ..inputs(5, 6, 5)
            },
        );
        assert_eq!(p.repair, ["d"]);
        assert_eq!(p.drain, ["d"]);
        assert_eq!(p.create, 1);
        assert_eq!(p.counts.draining, 1);
        // Repair off: nothing.
        let p = plan(&nodes, inputs(5, 6, 5));
        assert!(p.drain.is_empty() && p.create == 0);
    }

    #[test]
    fn without_creates_a_set_only_scales_down() {
        // The class is gone: a scale-down drains the excess and removes what is drained, but
        // nothing is created, and nothing is taken out for a replacement that cannot come.
        let no_class = |replicas| Inputs {
            can_create: false,
            repair: Some(Repair {
                after_secs: 300,
                max_unhealthy: 5,
            }),
            ..inputs(replicas, replicas + 1, 0)
        };
        let sick = MachineView {
            unhealthy_since: Some(100),
            ..m("sick", 1, Health::NotReady, true)
        };
        let drained = MachineView {
            leaving: Leaving::Drained,
            ..m("drained", 2, Health::Ready, true)
        };
        let nodes = vec![
            m("a", 3, Health::Ready, true),
            m("old", 4, Health::Ready, false),
            m("unjoined", 10, Health::NeverJoined, true),
            sick.clone(),
            drained.clone(),
        ];
        // Short of nodes: nothing created, replaced, repaired or rolled.
        let p = plan(&nodes, no_class(6));
        assert_eq!(p.create, 0);
        assert!(p.replace.is_empty() && p.repair.is_empty() && p.drain.is_empty());
        assert_eq!(p.remove, ["drained"]);
        // With creates, the same nodes would be replaced, repaired and rolled.
        let p = plan(
            &nodes,
            Inputs {
                can_create: true,
                ..no_class(6)
            },
        );
        assert_eq!(p.replace, ["unjoined"]);
        assert_eq!(p.repair, ["sick"]);
        assert!(p.create > 0 && p.drain.contains(&"old".to_owned()));
        // Scaled to 0: every node is drained (not Ready first), the drained one removed.
        let p = plan(&nodes, no_class(0));
        assert_eq!(p.create, 0);
        assert_eq!(p.drain, ["unjoined", "sick", "old", "a"]);
        assert_eq!(p.remove, ["drained"]);
        assert_eq!(p.counts.replicas, 0);
        // Scaled to 2: the two beyond it go, the unhealthy first; the outdated stays.
        let p = plan(&nodes, no_class(2));
        assert_eq!(p.drain, ["unjoined", "sick"]);
    }
}
