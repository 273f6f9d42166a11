//! Which nodes a rollout starts next: at most `rollout.maxUnavailable` nodes changing or failing
//! at once, and none once `rollout.failureThreshold` nodes are failing (the rollout pauses and
//! names them) or once failing nodes alone fill `maxUnavailable` (it pauses as well, saying so);
//! and when a failing node is tried again ([`retry_delay`]).

use std::time::Duration;

use nodekeeper_api::crd::node_network_config::{REASON_MAX_UNAVAILABLE_FAILING, Rollout};
use nodekeeper_api::names::REASON_PAUSED;

/// Failing nodes named in a pause message; the rest are counted.
pub const MAX_NAMED_IN_PAUSE: usize = 10;

/// Where one selected node stands with the object's current generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePhase {
    /// Not started on this generation.
    Pending,
    /// Attaching, waiting for ATTACHED, or applying on the host.
    InProgress,
    /// Attached, applied and checked.
    Applied,
    /// Failed with this error; `rolled_back` says whether the host was restored.
    Failed { error: String, rolled_back: bool },
}

/// One selected node and its phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeState {
    pub name: String,
    pub phase: NodePhase,
}

/// Why the rollout stopped starting nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paused {
    pub failing: usize,
    pub threshold: u32,
    /// The failing nodes, sorted, at most [`MAX_NAMED_IN_PAUSE`].
    pub named: Vec<String>,
    pub cause: PauseCause,
}

/// What stopped the rollout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PauseCause {
    /// `failureThreshold` nodes are failing.
    FailureThreshold,
    /// Below the threshold, but the failing nodes alone fill `maxUnavailable` (the value
    /// given): with no node in progress, none can start until one of them succeeds.
    MaxUnavailable(u32),
}

impl Paused {
    /// The `Progressing` condition's reason.
    pub fn reason(&self) -> &'static str {
        match self.cause {
            PauseCause::FailureThreshold => REASON_PAUSED,
            PauseCause::MaxUnavailable(_) => REASON_MAX_UNAVAILABLE_FAILING,
        }
    }

    /// The `Progressing` condition's message.
    pub fn message(&self) -> String {
        let more = self.failing - self.named.len();
        let tail = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        match self.cause {
            PauseCause::FailureThreshold => format!(
                "paused: {} nodes failing (threshold {}): {}{tail}; fix them or the spec \
                 (status.failingNodes has the errors) to resume",
                self.failing,
                self.threshold,
                self.named.join(", ")
            ),
            PauseCause::MaxUnavailable(max) => format!(
                "paused: {} nodes failing fill rollout.maxUnavailable ({max}), below the \
                 failure threshold ({}): {}{tail}; fix them (status.failingNodes has the \
                 errors; they are retried with backoff) or raise maxUnavailable to resume",
                self.failing,
                self.threshold,
                self.named.join(", ")
            ),
        }
    }
}

/// The next step of the rollout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Nodes to start now, in name order.
    pub start: Vec<String>,
    pub paused: Option<Paused>,
}

/// Decides the next batch. Failing nodes count as unavailable, so a failing batch never lets the
/// rollout run wider; nodes start in name order, so a restarted controller picks the same ones.
/// When failing nodes alone fill `maxUnavailable` (possible below `failureThreshold`, e.g. 1
/// and 3) and none is in progress, nothing can start: that is a pause too, named as such,
/// rather than a `Progressing=True` that never progresses. (Refusing a `failureThreshold` above
/// `maxUnavailable` in validation cannot do it: both may be percentages, resolved against the
/// number of nodes matched at the time.)
pub fn next_batch(nodes: &[NodeState], rollout: &Rollout) -> Decision {
    let matched = u32::try_from(nodes.len()).unwrap_or(u32::MAX);
    let mut failing: Vec<&str> = nodes
        .iter()
        .filter(|n| matches!(n.phase, NodePhase::Failed { .. }))
        .map(|n| n.name.as_str())
        .collect();
    failing.sort_unstable();
    let threshold = rollout.failure_threshold_of(matched);
    let pause = |cause| Decision {
        start: Vec::new(),
        paused: Some(Paused {
            failing: failing.len(),
            threshold,
            named: failing
                .iter()
                .take(MAX_NAMED_IN_PAUSE)
                .map(|s| s.to_string())
                .collect(),
            cause,
        }),
    };
    if failing.len() >= threshold as usize {
        return pause(PauseCause::FailureThreshold);
    }
    let in_progress = nodes
        .iter()
        .filter(|n| n.phase == NodePhase::InProgress)
        .count();
    let max_unavailable = rollout.max_unavailable_of(matched);
    let budget = (max_unavailable as usize).saturating_sub(in_progress + failing.len());
    let mut pending: Vec<&str> = nodes
        .iter()
        .filter(|n| n.phase == NodePhase::Pending)
        .map(|n| n.name.as_str())
        .collect();
    pending.sort_unstable();
    if budget == 0 && in_progress == 0 && !failing.is_empty() && !pending.is_empty() {
        return pause(PauseCause::MaxUnavailable(max_unavailable));
    }
    Decision {
        start: pending
            .into_iter()
            .take(budget)
            .map(str::to_string)
            .collect(),
        paused: None,
    }
}

/// How long a node waits after its `failures`-th failure in a row before it is tried again:
/// `base` doubled per further failure, at most `cap`. A node being retried keeps counting as
/// failing (against `failureThreshold` and `maxUnavailable`) until it succeeds, so retries never
/// widen a paused rollout; they only let a node that was failing for a passing reason (a 429
/// burst, a subnet out of addresses, an agent restart) heal without a spec change.
pub fn retry_delay(failures: u32, base: Duration, cap: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(20);
    base.saturating_mul(1 << doublings)
        .min(cap)
        .max(base.min(cap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodekeeper_api::crd::IntOrPercent;

    fn rollout(max_unavailable: IntOrPercent, failure_threshold: IntOrPercent) -> Rollout {
        Rollout {
            max_unavailable,
            failure_threshold,
        }
    }

    fn nodes(n: usize, phase: impl Fn(usize) -> NodePhase) -> Vec<NodeState> {
        (0..n)
            .map(|i| NodeState {
                name: format!("node-{i:04}"),
                phase: phase(i),
            })
            .collect()
    }

    fn failed() -> NodePhase {
        NodePhase::Failed {
            error: "check failed".into(),
            rolled_back: true,
        }
    }

    #[test]
    fn batches_are_bounded_by_max_unavailable() {
        let r = rollout(IntOrPercent::Percent(10), IntOrPercent::Int(5));
        let all = nodes(1000, |_| NodePhase::Pending);
        let d = next_batch(&all, &r);
        assert_eq!(d.start.len(), 100);
        assert_eq!(d.start[0], "node-0000");
        assert!(d.paused.is_none());
        // 60 in progress: 40 more may start.
        let busy = nodes(1000, |i| {
            if i < 60 {
                NodePhase::InProgress
            } else {
                NodePhase::Pending
            }
        });
        assert_eq!(next_batch(&busy, &r).start.len(), 40);
        assert_eq!(next_batch(&busy, &r).start[0], "node-0060");
        // Rounded down, at least one.
        let few = nodes(5, |_| NodePhase::Pending);
        assert_eq!(next_batch(&few, &r).start, ["node-0000"]);
    }

    #[test]
    fn failing_nodes_count_against_the_budget() {
        let r = rollout(IntOrPercent::Int(3), IntOrPercent::Int(10));
        let all = nodes(10, |i| match i {
            0 => failed(),
            1 => NodePhase::InProgress,
            2 => NodePhase::Applied,
            _ => NodePhase::Pending,
        });
        assert_eq!(next_batch(&all, &r).start, ["node-0003"]);
    }

    #[test]
    fn the_failure_threshold_pauses_and_names_the_nodes() {
        let r = rollout(IntOrPercent::Int(50), IntOrPercent::Percent(1));
        let all = nodes(1200, |i| {
            if i % 100 == 7 {
                failed()
            } else {
                NodePhase::Pending
            }
        });
        let d = next_batch(&all, &r);
        assert!(d.start.is_empty());
        let p = d.paused.unwrap();
        assert_eq!((p.failing, p.threshold), (12, 12));
        assert_eq!(p.named.len(), MAX_NAMED_IN_PAUSE);
        assert_eq!(p.named[0], "node-0007");
        let m = p.message();
        assert!(
            m.contains("node-0007, node-0107") && m.contains("and 2 more"),
            "{m}"
        );
        // One below the threshold: the rollout goes on.
        let fewer = nodes(1200, |i| {
            if i % 100 == 7 && i < 1100 {
                failed()
            } else {
                NodePhase::Pending
            }
        });
        assert!(next_batch(&fewer, &r).paused.is_none());
    }

    /// `maxUnavailable` 1, `failureThreshold` 3: the first
    /// failing node fills the budget; the rollout says it is paused and why, instead of
    /// `Progressing=True` with nothing in progress.
    #[test]
    fn failing_nodes_filling_max_unavailable_pause_and_say_so() {
        let r = rollout(IntOrPercent::Int(1), IntOrPercent::Int(3));
        let all = nodes(5, |i| if i == 0 { failed() } else { NodePhase::Pending });
        let d = next_batch(&all, &r);
        assert!(d.start.is_empty());
        let p = d.paused.unwrap();
        assert_eq!(p.cause, PauseCause::MaxUnavailable(1));
        assert_eq!(p.reason(), REASON_MAX_UNAVAILABLE_FAILING);
        let m = p.message();
        for words in [
            "1 nodes failing fill rollout.maxUnavailable (1)",
            "node-0000",
            "raise maxUnavailable",
        ] {
            assert!(m.contains(words), "{words:?}: {m}");
        }
        // A node still in progress: the rollout is progressing, not paused.
        let busy = nodes(5, |i| match i {
            0 => failed(),
            1 => NodePhase::InProgress,
            _ => NodePhase::Pending,
        });
        let r2 = rollout(IntOrPercent::Int(2), IntOrPercent::Int(3));
        assert_eq!(next_batch(&busy, &r2), Decision::default());
        // Nothing left to start: nothing to pause.
        let done = nodes(2, |i| if i == 0 { failed() } else { NodePhase::Applied });
        assert!(next_batch(&done, &r).paused.is_none());
        // At the threshold, the threshold is the reason.
        let three = nodes(5, |i| if i < 3 { failed() } else { NodePhase::Pending });
        assert_eq!(
            next_batch(&three, &r).paused.unwrap().reason(),
            REASON_PAUSED
        );
    }

    #[test]
    fn retries_back_off_exponentially_up_to_the_cap() {
        let s = Duration::from_secs;
        let delays: Vec<Duration> = (1..=7).map(|f| retry_delay(f, s(30), s(600))).collect();
        assert_eq!(
            delays,
            [s(30), s(60), s(120), s(240), s(480), s(600), s(600)]
        );
        // No overflow however long a node keeps failing; a zero count is the first failure.
        assert_eq!(retry_delay(u32::MAX, s(30), s(600)), s(600));
        assert_eq!(retry_delay(0, s(30), s(600)), s(30));
        // A cap below the base wins.
        assert_eq!(retry_delay(3, s(30), s(10)), s(10));
    }

    #[test]
    fn nothing_to_do_when_every_node_is_applied() {
        let r = Rollout::default();
        assert_eq!(
            next_batch(&nodes(3, |_| NodePhase::Applied), &r),
            Decision::default()
        );
        assert_eq!(next_batch(&[], &r), Decision::default());
    }
}
