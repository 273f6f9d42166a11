//! The NodeSet status from what the reconcile saw and did: the counts, the machines with
//! problems (at most 50, the rest counted), the join failures, and the `Ready` / `Progressing`
//! conditions. The reconciler writes it only when it differs from what is stored.

use nodekeeper_api::crd::common::{ConditionStatus, MAX_LISTED, set_condition};
use nodekeeper_api::crd::node_set::{
    MachineProblem, NodeSetStatus, REASON_PROVIDER_FAILED, REASON_REPAIR_HALTED,
    REASON_ROLLOUT_STALLED, REASON_SCALE_DOWN_BLOCKED,
};
use nodekeeper_api::names::{
    CONDITION_PROGRESSING, CONDITION_READY, REASON_DONE, REASON_IN_PROGRESS,
};

use super::plan::Counts;

/// How the reconcile ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The set cannot be acted on (bad spec, missing class, unknown provider); nothing was
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
    },
}

/// The status to write. `counts` is `None` when the nodes were not looked at (a refusal): the
/// stored counts stay.
#[allow(clippy::too_many_arguments)]
pub fn build(
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
        } => {
            let c = counts.unwrap_or_default();
            let summary = format!(
                "{} of {} nodes ready, {} updated, {} draining",
                c.ready, c.replicas, c.updated, c.draining
            );
            if let Some(error) = provider_error {
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
        let a = build(None, Some(counts), vec![], 0, &acting(true), Some(2), "t1");
        let b = build(
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
        let b = build(Some(&a), None, vec![], 0, &refused, Some(2), "t");
        assert_eq!(b.replicas, 60);
        let ready = b
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_READY)
            .unwrap();
        assert_eq!(ready.reason, "NodeClassNotFound");
        assert!(ready.message.contains("spec.nodeClassName"));
    }
}
