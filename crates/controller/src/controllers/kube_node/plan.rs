//! What a kube-node reconcile does, decided from the Node alone (plain functions, unit-tested):
//! whether the cached metadata already says "nothing to do", and otherwise which step comes next.

use crate::controllers::node_set::plan::Leaving;

/// What the controller reads of a Node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeState<'a> {
    /// The `nodekeeper.dev/node-class` annotation.
    pub class: Option<&'a str>,
    /// The Node belongs to a NodeSet (that controller's, not this one's).
    pub in_set: bool,
    /// Our finalizer is on it.
    pub finalizer: bool,
    /// `deletionTimestamp` is set.
    pub deleting: bool,
    /// Its `nodekeeper.dev/nodeclass` label names the annotation's class: the machine is recorded.
    pub recorded: bool,
    /// Its `nodekeeper.dev/nodeclass` label names another class than the annotation: the
    /// machine was made from that one, and the annotation changed since.
    pub other_class: Option<&'a str>,
    /// A kubelet registered it (`status.nodeInfo.kubeletVersion`, or `Ready=True`): a machine
    /// runs it already (not in the metadata-only cache; `false` there).
    pub registered: bool,
    /// `spec.providerID` (not in the metadata-only cache; `None` there).
    pub provider_id: Option<&'a str>,
}

/// The next step for a Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Not this controller's (no annotation, a NodeSet's node), or done.
    Nothing,
    /// The Node names a machine already (`spec.providerID`, not ours): nothing is made for it.
    Foreign,
    /// A kubelet registered the Node before this controller made anything: a machine runs it
    /// already, and nothing is made for it.
    Registered,
    /// The annotation names another class than the recorded machine's: a machine is not
    /// changed in place, so nothing is written; the user deletes and recreates the Node.
    ClassChanged,
    /// Add the finalizer, get a machine from the class's provider, record it.
    Make,
    /// The machine exists (its providerID is on the Node): write the record.
    Record,
    /// Being deleted and no machine was ever made: remove the finalizer.
    Release,
    /// Being deleted with a machine: drain, delete the machine, then remove the finalizer.
    Remove,
}

/// Whether the metadata-only cache already shows there is nothing to do, so the Node need not
/// be read: not ours, or ours with its machine recorded and not being deleted.
pub fn settled(s: &NodeState<'_>) -> bool {
    if s.deleting {
        return !s.finalizer;
    }
    s.class.is_none() || s.in_set || (s.finalizer && s.recorded)
}

/// The next step, from the whole Node.
pub fn step(s: &NodeState<'_>) -> Step {
    if s.deleting {
        return match (s.finalizer, s.provider_id) {
            (false, _) => Step::Nothing,
            (true, None) => Step::Release,
            (true, Some(_)) => Step::Remove,
        };
    }
    if s.class.is_none() || s.in_set {
        return Step::Nothing;
    }
    match (s.finalizer, s.provider_id) {
        (false, Some(_)) => Step::Foreign,
        // Without the finalizer nothing was made yet; with it, a kubelet that registered is
        // the machine this controller launched.
        (false, None) if s.registered => Step::Registered,
        (_, None) => Step::Make,
        (true, Some(_)) if s.other_class.is_some() => Step::ClassChanged,
        (true, Some(_)) if !s.recorded => Step::Record,
        (true, Some(_)) => Step::Nothing,
    }
}

/// The node's NodeMaintenance as a removal sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Drain {
    /// There is none.
    Absent,
    /// It is being deleted (its own finalizer restores the node first).
    Going,
    /// It is there; where the node's drain stands.
    Present(Leaving),
}

/// Where a removal stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Removal {
    /// No drain yet: create the NodeMaintenance.
    StartDrain,
    /// Draining, or the NodeMaintenance is going: look again soon.
    Wait,
    /// The drain failed or was refused: say so, and wait for someone to act.
    Stuck(String),
    /// Drained: delete the machine, then the NodeMaintenance.
    DeleteMachine,
    /// The machine and the NodeMaintenance are gone: remove the finalizer. Only then — the
    /// NodeMaintenance's own clean-up writes on the Node, and a server-side apply on a Node
    /// already gone would create it again.
    Release,
}

/// The removal step for a node whose drain is `drain`; `cleaned` says this process deleted the
/// machine and the NodeMaintenance (after a restart it is not known: the drain is done again,
/// quickly, as the node is empty, and the machine's deletion is idempotent).
pub fn removal(drain: Drain, cleaned: bool) -> Removal {
    match drain {
        Drain::Absent if cleaned => Removal::Release,
        Drain::Absent => Removal::StartDrain,
        Drain::Going => Removal::Wait,
        Drain::Present(Leaving::Drained) => Removal::DeleteMachine,
        Drain::Present(Leaving::Stuck(m)) => Removal::Stuck(m),
        Drain::Present(Leaving::No | Leaving::Draining | Leaving::Deleting) => Removal::Wait,
    }
}

/// The name of the NodeMaintenance that drains a kube-node `node` before its machine goes.
pub fn maintenance_name(node: &str) -> String {
    format!("kubenode-drain-{node}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours<'a>() -> NodeState<'a> {
        NodeState {
            class: Some("small"),
            ..Default::default()
        }
    }

    #[test]
    fn a_new_annotated_node_gets_a_machine_then_a_record() {
        let s = ours();
        assert!(!settled(&s));
        assert_eq!(step(&s), Step::Make);
        // The finalizer is there, the machine not yet (a crash between the two).
        let s = NodeState {
            finalizer: true,
            ..ours()
        };
        assert_eq!(step(&s), Step::Make);
        let s = NodeState {
            finalizer: true,
            provider_id: Some("oci://x"),
            ..ours()
        };
        assert_eq!(step(&s), Step::Record);
        let s = NodeState {
            finalizer: true,
            recorded: true,
            provider_id: Some("oci://x"),
            ..ours()
        };
        assert_eq!(step(&s), Step::Nothing);
        assert!(settled(&s));
    }

    #[test]
    fn a_node_a_kubelet_registered_gets_no_machine() {
        let s = NodeState {
            registered: true,
            ..ours()
        };
        assert_eq!(step(&s), Step::Registered);
        // Once the finalizer is on, the kubelet is the machine's being made: go on.
        let s = NodeState {
            finalizer: true,
            ..s
        };
        assert_eq!(step(&s), Step::Make);
    }

    #[test]
    fn a_recorded_node_whose_annotation_changed_is_not_relabeled() {
        let s = NodeState {
            class: Some("large"),
            other_class: Some("small"),
            finalizer: true,
            provider_id: Some("oci://x"),
            ..ours()
        };
        assert!(!settled(&s));
        assert_eq!(step(&s), Step::ClassChanged);
        // Back to its class: settled again.
        let s = NodeState {
            class: Some("small"),
            other_class: None,
            recorded: true,
            ..s
        };
        assert_eq!(step(&s), Step::Nothing);
    }

    #[test]
    fn nodes_that_are_not_ours_are_left_alone() {
        let plain = NodeState::default();
        assert!(settled(&plain));
        assert_eq!(step(&plain), Step::Nothing);
        let set = NodeState {
            in_set: true,
            ..ours()
        };
        assert!(settled(&set));
        assert_eq!(step(&set), Step::Nothing);
        // A Node created with a providerID names its machine already.
        let foreign = NodeState {
            provider_id: Some("oci://y"),
            ..ours()
        };
        assert!(!settled(&foreign));
        assert_eq!(step(&foreign), Step::Foreign);
        // Being deleted without our finalizer: nothing to hold it for.
        let gone = NodeState {
            deleting: true,
            ..ours()
        };
        assert!(settled(&gone));
        assert_eq!(step(&gone), Step::Nothing);
    }

    #[test]
    fn a_deleted_node_is_drained_when_it_has_a_machine() {
        let d = NodeState {
            deleting: true,
            finalizer: true,
            ..ours()
        };
        assert!(!settled(&d));
        assert_eq!(step(&d), Step::Release);
        let d = NodeState {
            provider_id: Some("kwok://a"),
            recorded: true,
            ..d
        };
        assert_eq!(step(&d), Step::Remove);
        // The annotation removed meanwhile: the finalizer still gets its removal.
        let d = NodeState { class: None, ..d };
        assert_eq!(step(&d), Step::Remove);
        assert_eq!(removal(Drain::Absent, false), Removal::StartDrain);
        assert_eq!(
            removal(Drain::Present(Leaving::Draining), false),
            Removal::Wait
        );
        assert_eq!(
            removal(Drain::Present(Leaving::Drained), false),
            Removal::DeleteMachine
        );
        assert_eq!(
            removal(Drain::Present(Leaving::Stuck("timed out".into())), false),
            Removal::Stuck("timed out".into())
        );
        // The finalizer goes only once the NodeMaintenance is gone.
        assert_eq!(removal(Drain::Going, true), Removal::Wait);
        assert_eq!(removal(Drain::Absent, true), Removal::Release);
    }
}
