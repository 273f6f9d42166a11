//! The NodeSet status from what the reconcile saw and did: the counts, the machines with
//! problems (at most 50, the rest counted), the join failures, and the `Ready` / `Progressing`
//! conditions. The reconciler writes it only when it differs from what is stored.

use nodekeeper_api::crd::common::{ConditionStatus, MAX_LISTED, set_condition};
use nodekeeper_api::crd::node_set::{
    MachineProblem, NodeSetStatus, REASON_PROVIDER_FAILED, REASON_REPAIR_HALTED,
    REASON_ROLLOUT_STALLED, REASON_SCALE_DOWN_BLOCKED,
};
use nodekeeper_api::names::{
    CONDITION_PROGRESSING, CONDITION_READY, LABEL_NODE_SET, REASON_DONE, REASON_IN_PROGRESS,
};

use super::plan::Counts;

/// Why the set's NodeClass cannot make machines (missing, a Node record the API server would
/// refuse, its provider unavailable): nothing is created, while a scale-down goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CannotCreate {
    /// A PascalCase condition reason (`NodeClassNotFound`, `InvalidSpec`, `ProviderFailed`).
    pub reason: &'static str,
    /// Names the field and the fix.
    pub message: String,
    /// The set has fewer nodes than `spec.replicas`: it cannot progress until the class is fixed.
    pub short: bool,
}

/// How the reconcile ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The set cannot be acted on (bad spec, controller's cap, autoscaler bounds); nothing was
    /// touched. `reason` is a PascalCase condition reason; `message` names the field and the fix.
    Refused {
        reason: &'static str,
        message: String,
    },
    /// The set was acted on.
    Acting {
        /// Everything is as asked: nothing to create, drain or remove, every node Ready.
        converged: bool,
        /// The provider's last create error, while creates back off.
        provider_error: Option<String>,
        /// A node's drain failed or was refused.
        scale_down_blocked: Option<String>,
        /// Too much of the set is unhealthy for repair to go on.
        repair_halted: Option<String>,
        /// New machines do not join while old ones wait to be replaced.
        rollout_stalled: Option<String>,
        /// The class cannot make machines: `Ready=False` with its reason whatever else holds.
        cannot_create: Option<CannotCreate>,
    },
}

/// The label selector of set `set`'s Nodes, as `status.selector` gives it to the scale
/// subresource: the label [`super::provider::node_record`] puts on every Node of the set.
pub fn selector(set: &str) -> String {
    format!("{LABEL_NODE_SET}={set}")
}

/// The status to write for set `set`. `counts` is `None` when the nodes were not looked at (a
/// refusal): the stored counts stay.
#[allow(clippy::too_many_arguments)]
pub fn build(
    set: &str,
    current: Option<&NodeSetStatus>,
    counts: Option<Counts>,
    mut problems: Vec<MachineProblem>,
    new_failed_joins: u32,
    outcome: &Outcome,
    generation: Option<i64>,
    now: &str,
) -> NodeSetStatus {
    let mut s = current.cloned().unwrap_or_default();
    if let Some(c) = counts {
        s.replicas = c.replicas;
        s.ready_replicas = c.ready;
        s.updated_replicas = c.updated;
        s.draining_replicas = c.draining;
        let omitted = problems.len().saturating_sub(MAX_LISTED);
        problems.truncate(MAX_LISTED);
        s.problems = problems;
        s.omitted_problems = u32::try_from(omitted).unwrap_or(u32::MAX);
    }
    s.failed_joins = s.failed_joins.saturating_add(new_failed_joins);
    s.observed_generation = generation;
    // The scale subresource's selector (an autoscaler refuses a scale without one): the label
    // every Node of the set carries. Constant for a set, so it costs no write after the first.
    s.selector = Some(selector(set));
    let mut cond = |type_: &str, status, reason: &str, message: &str| {
        set_condition(
            &mut s.conditions,
            type_,
            status,
            reason,
            message,
            generation,
            now,
        );
    };
    match outcome {
        Outcome::Refused { reason, message } => {
            cond(CONDITION_READY, ConditionStatus::False, reason, message);
            cond(
                CONDITION_PROGRESSING,
                ConditionStatus::False,
                reason,
                message,
            );
        }
        Outcome::Acting {
            converged,
            provider_error,
            scale_down_blocked,
            repair_halted,
            rollout_stalled,
            cannot_create,
        } => {
            let c = counts.unwrap_or_default();
            let summary = format!(
                "{} of {} nodes ready, {} updated, {} draining",
                c.ready, c.replicas, c.updated, c.draining
            );
            if let Some(c) = cannot_create {
                cond(
                    CONDITION_READY,
                    ConditionStatus::False,
                    c.reason,
                    &c.message,
                );
            } else if let Some(error) = provider_error {
                cond(
                    CONDITION_READY,
                    ConditionStatus::False,
                    REASON_PROVIDER_FAILED,
                    error,
                );
            } else if *converged {
                cond(
                    CONDITION_READY,
                    ConditionStatus::True,
                    REASON_DONE,
                    &summary,
                );
            } else {
                cond(
                    CONDITION_READY,
                    ConditionStatus::False,
                    REASON_IN_PROGRESS,
                    &summary,
                );
            }
            if let Some(message) = scale_down_blocked {
                cond(
                    CONDITION_PROGRESSING,
                    ConditionStatus::False,
                    REASON_SCALE_DOWN_BLOCKED,
                    message,
                );
            } else if let Some(message) = repair_halted {
                cond(
                    CONDITION_PROGRESSING,
                    ConditionStatus::False,
                    REASON_REPAIR_HALTED,
                    message,
                );
            } else if let Some(message) = rollout_stalled {
                cond(
                    CONDITION_PROGRESSING,
                    ConditionStatus::False,
                    REASON_ROLLOUT_STALLED,
                    message,
                );
            } else if let Some(c) = cannot_create.as_ref().filter(|c| c.short) {
                cond(
                    CONDITION_PROGRESSING,
                    ConditionStatus::False,
                    c.reason,
                    &c.message,
                );
            } else if *converged {
                cond(
                    CONDITION_PROGRESSING,
                    ConditionStatus::False,
                    REASON_DONE,
                    &summary,
                );
            } else {
                cond(
                    CONDITION_PROGRESSING,
                    ConditionStatus::True,
                    REASON_IN_PROGRESS,
                    &summary,
                );
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acting(converged: bool) -> Outcome {
        Outcome::Acting {
            converged,
            provider_error: None,
            scale_down_blocked: None,
            repair_halted: None,
            rollout_stalled: None,
            cannot_create: None,
        }
    }

    #[test]
    fn unchanged_inputs_give_an_unchanged_status() {
        let counts = Counts {
            replicas: 3,
            ready: 3,
            updated: 3,
            draining: 0,
        };
        let a = build(
            "web",
            None,
            Some(counts),
            vec![],
            0,
            &acting(true),
            Some(2),
            "t1",
        );
        let b = build(
            "web",
            Some(&a),
            Some(counts),
            vec![],
            0,
            &acting(true),
            Some(2),
            "t2",
        );
        assert_eq!(
            a, b,
            "a second reconcile with nothing new must not cause a write"
        );
        assert_eq!(a.conditions[0].status, ConditionStatus::True);
        assert_eq!(a.selector.as_deref(), Some("nodekeeper.dev/nodeset=web"));
    }

    #[test]
    fn problems_are_bounded_and_refusals_keep_the_counts() {
        let counts = Counts {
            replicas: 60,
            ready: 0,
            updated: 60,
            draining: 0,
        };
        let problems = (0..60)
            .map(|i| MachineProblem {
                node: format!("n{i}"),
                message: "not Ready".into(),
            })
            .collect();
        let a = build(
            "web",
            None,
            Some(counts),
            problems,
            2,
            &acting(false),
            Some(1),
            "t",
        );
        assert_eq!(
            (a.problems.len(), a.omitted_problems, a.failed_joins),
            (50, 10, 2)
        );
        let refused = Outcome::Refused {
            reason: "NodeClassNotFound",
            message: "spec.nodeClassName: NodeClass \"x\" does not exist".into(),
        };
        let b = build("web", Some(&a), None, vec![], 0, &refused, Some(2), "t");
        assert_eq!(b.replicas, 60);
        assert_eq!(b.selector.as_deref(), Some("nodekeeper.dev/nodeset=web"));
        let ready = b
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .unwrap();
        assert_eq!(ready.reason, "NodeClassNotFound");
        assert!(ready.message.contains("spec.nodeClassName"));
    }

    #[test]
    fn a_class_that_cannot_make_machines_is_named_while_the_set_scales_down() {
        let counts = Counts {
            replicas: 1,
            ready: 1,
            updated: 1,
            draining: 1,
        };
        let cannot_converged = |short, converged| Outcome::Acting {
            converged,
            provider_error: None,
            scale_down_blocked: None,
            repair_halted: None,
            rollout_stalled: None,
            cannot_create: Some(CannotCreate {
                reason: "NodeClassNotFound",
                message: "spec.nodeClassName: NodeClass \"x\" does not exist".into(),
                short,
            }),
        };
        let cannot = |short| cannot_converged(short, false);
        let find = |s: &NodeSetStatus, t: &str| {
            let c = s.conditions.iter().find(|c| c.type_ == t).unwrap();
            (c.status, c.reason.clone())
        };
        // Draining towards a lower count: Ready names the class, the scale-down progresses.
        let s = build(
            "web",
            None,
            Some(counts),
            vec![],
            0,
            &cannot(false),
            Some(1),
            "t",
        );
        assert_eq!(
            find(&s, CONDITION_READY),
            (ConditionStatus::False, "NodeClassNotFound".into())
        );
        assert_eq!(
            find(&s, CONDITION_PROGRESSING),
            (ConditionStatus::True, REASON_IN_PROGRESS.into())
        );
        assert_eq!((s.replicas, s.draining_replicas), (1, 1));
        // Short of nodes: it cannot progress either.
        let s = build(
            "web",
            None,
            Some(counts),
            vec![],
            0,
            &cannot(true),
            Some(1),
            "t",
        );
        assert_eq!(
            find(&s, CONDITION_PROGRESSING),
            (ConditionStatus::False, "NodeClassNotFound".into())
        );
        // Even when nothing else is left to do, Ready stays False naming the class.
        let done = cannot_converged(false, true);
        let s = build("web", None, Some(counts), vec![], 0, &done, Some(1), "t");
        assert_eq!(
            find(&s, CONDITION_READY),
            (ConditionStatus::False, "NodeClassNotFound".into())
        );
    }

    #[test]
    fn the_selector_picks_the_nodes_the_set_records() {
        let class =
            serde_json::from_value(serde_json::json!({"provider": "kwok", "kwok": {}})).unwrap();
        let request = super::super::provider::MachineRequest {
            node_name: "web-bcdfg".into(),
            node_set: "web".into(),
            node_class: "small".into(),
            template_hash: "0123456789".into(),
            labels: Default::default(),
            taints: vec![],
            class,
        };
        let record = super::super::provider::node_record(&request, "kwok://web-bcdfg");
        let selector = selector("web");
        let (key, value) = selector.split_once('=').unwrap();
        assert_eq!(record["metadata"]["labels"][key], value, "{selector}");
    }
}
