//! One node's drain plan: which pods leave, in which order (the spec's `drainPlan` groups), which
//! are skipped or waited for, which may not be evicted at all, and what a timeout does. Plain
//! data in, plain data out; the reconciler turns the answer into evictions.

use std::collections::BTreeMap;
use std::time::Duration;

use nodekeeper_api::crd::LabelSelector;
use nodekeeper_api::crd::node_maintenance::{
    DrainPlanEntry, NodeMaintenanceSpec, OnTimeout, PodType, SkipReason,
};

/// Who owns a pod, as far as draining cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// No controlling owner reference: nothing recreates the pod.
    None,
    /// A DaemonSet: it would recreate the pod on the same node.
    DaemonSet,
    /// Any other controller (ReplicaSet, StatefulSet, Job, …).
    Controller,
}

/// What the plan needs to know about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub owner: Owner,
    /// A mirror pod (annotation `kubernetes.io/config.mirror`): a static pod's API shadow.
    pub mirror: bool,
    /// `spec.priority` (0 when unset).
    pub priority: i32,
    /// Phase `Succeeded` or `Failed`: it holds nothing up.
    pub finished: bool,
    /// `metadata.deletionTimestamp` is set: it is on its way out.
    pub terminating: bool,
    /// Phase `Running` with condition `Ready` true: the only pods a PodDisruptionBudget can
    /// keep from being evicted. The API server evicts Pending pods without consulting any
    /// budget, and a not-Ready one whenever its budget's `unhealthyPodEvictionPolicy` lets it
    /// (always with `AlwaysAllow`; under the default `IfHealthyBudget` while the budget has its
    /// healthy pods), which this controller cannot tell from the budget's status alone.
    pub healthy: bool,
    /// It mounts an `emptyDir` volume, whose data eviction discards.
    pub local_storage: bool,
    /// `spec.terminationGracePeriodSeconds` (30 when unset, as the API defaults it).
    pub grace_seconds: i64,
}

impl PodFacts {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The rules of one maintenance, resolved once per reconcile.
#[derive(Clone, Debug)]
pub struct Rules {
    pub plan: Vec<DrainPlanEntry>,
    pub skip: Option<LabelSelector>,
    pub wait: Option<LabelSelector>,
    pub allow_standalone: bool,
    pub timeout: Duration,
    pub on_timeout: OnTimeout,
}

impl Rules {
    /// The spec's rules; an empty `drainPlan` takes [`default_plan`].
    pub fn from_spec(spec: &NodeMaintenanceSpec, timeout: Duration) -> Self {
        Self {
            plan: if spec.drain_plan.is_empty() {
                default_plan()
            } else {
                spec.drain_plan.clone()
            },
            skip: spec.skip_pods.clone(),
            wait: spec.wait_for_pods.clone(),
            allow_standalone: spec.allow_standalone_pods,
            timeout,
            on_timeout: spec.on_timeout,
        }
    }
}

/// Priority up to which a pod is "ordinary" in the default plan: user-defined PriorityClasses
/// may go up to one billion; above that are only `system-cluster-critical` and
/// `system-node-critical`.
pub const USER_PRIORITY_MAX: i32 = 1_000_000_000;

/// The plan used when the spec gives none, in the spirit of the kubelet's graceful node shutdown
/// by priority: first pods of priority ≤ 0 (the default priority and below: batch and ordinary
/// work), then every other pod with a user-defined priority (≤ one billion), and last the
/// system-critical pods (cluster DNS, metrics), so that they keep serving the others while
/// those move.
pub fn default_plan() -> Vec<DrainPlanEntry> {
    vec![
        DrainPlanEntry {
            pod_type: PodType::Any,
            priority_threshold: Some(0),
            pod_selector: None,
        },
        DrainPlanEntry {
            pod_type: PodType::Any,
            priority_threshold: Some(USER_PRIORITY_MAX),
            pod_selector: None,
        },
    ]
}

/// What happens to one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Succeeded or Failed: it holds nothing up.
    Finished,
    /// Left running on purpose.
    Skipped(SkipReason),
    /// Matches `waitForPods`: not evicted, waited for until it finishes.
    WaitForCompletion,
    /// No controller and `allowStandalonePods` is off: not evicted, holds the drain up.
    StandaloneNotAllowed,
    /// Leaves in drain group `group` (0-based; `plan.len()` for pods no entry matches).
    Leaves { group: usize },
}

fn entry_matches(entry: &DrainPlanEntry, pod: &PodFacts) -> bool {
    let type_ok = match entry.pod_type {
        PodType::Any => pod.owner != Owner::DaemonSet,
        PodType::Standalone => pod.owner == Owner::None,
        PodType::Controlled => pod.owner == Owner::Controller,
        PodType::DaemonSet => pod.owner == Owner::DaemonSet,
    };
    type_ok
        && entry.priority_threshold.is_none_or(|t| pod.priority <= t)
        && entry
            .pod_selector
            .as_ref()
            .is_none_or(|s| s.matches(&pod.labels))
}

/// The disposition of one pod under `rules`. Order of the checks: finished pods first (nothing
/// to do), mirror pods (the API cannot remove them), `skipPods`, `waitForPods`, DaemonSet pods
/// (skipped unless a plan entry names them), bare pods (only when allowed), then the first plan
/// entry that matches gives the group.
pub fn disposition(pod: &PodFacts, rules: &Rules) -> Disposition {
    if pod.finished {
        return Disposition::Finished;
    }
    if pod.mirror {
        return Disposition::Skipped(SkipReason::MirrorPod);
    }
    if rules.skip.as_ref().is_some_and(|s| s.matches(&pod.labels)) {
        return Disposition::Skipped(SkipReason::SkipPods);
    }
    if rules.wait.as_ref().is_some_and(|s| s.matches(&pod.labels)) {
        return Disposition::WaitForCompletion;
    }
    let group = rules.plan.iter().position(|e| entry_matches(e, pod));
    if pod.owner == Owner::DaemonSet {
        return match group {
            Some(group) => Disposition::Leaves { group },
            None => Disposition::Skipped(SkipReason::DaemonSet),
        };
    }
    if pod.owner == Owner::None && !rules.allow_standalone {
        return Disposition::StandaloneNotAllowed;
    }
    Disposition::Leaves {
        group: group.unwrap_or(rules.plan.len()),
    }
}

/// One node's plan at this moment. Indices point into the pod slice given to [`plan_node`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodePlan {
    /// The group being drained now; `None` when no pod has to leave any more.
    pub current_group: Option<usize>,
    /// Pods of the current group to evict now (not already terminating).
    pub evict: Vec<usize>,
    /// Pods that still have to leave or finish (every group, waited-for and bare pods).
    pub remaining: Vec<usize>,
    /// Pods already terminating.
    pub terminating: Vec<usize>,
    /// Pods waited for (`waitForPods`) and not finished.
    pub waiting: Vec<usize>,
    /// Bare pods that may not be evicted.
    pub standalone: Vec<usize>,
    /// Pods left running on purpose.
    pub skipped: Vec<(usize, SkipReason)>,
    /// Pods still to leave that have local storage.
    pub local_storage: Vec<usize>,
}

impl NodePlan {
    /// Nothing left that has to leave or finish.
    pub fn drained(&self) -> bool {
        self.remaining.is_empty()
    }
}

/// Plans one node: only the lowest group that still has pods is evicted; a later group waits
/// until every pod of the earlier ones is gone (terminating pods still count as there).
pub fn plan_node(pods: &[PodFacts], rules: &Rules) -> NodePlan {
    plan_node_counting_gone(pods, rules, |_| false)
}

/// How long a pod on an unreachable node may stay terminating past its deletion time
/// (`metadata.deletionTimestamp`, which already includes its grace period) before the drain
/// counts it gone (`--maintenance-unreachable-pod-wait`): Cluster API's drain uses the same
/// 5 minutes for an unreachable node (`SkipWaitForDeleteTimeoutSeconds`).
pub const UNREACHABLE_POD_WAIT: Duration = Duration::from_secs(300);

/// The taint the node lifecycle controller puts on a node whose kubelet stopped reporting.
pub const TAINT_UNREACHABLE: &str = "node.kubernetes.io/unreachable";

/// [`plan_node`], where `gone(i)` says that pod `i` (terminating) is to be counted gone: left
/// on the node as skipped ([`SkipReason::NodeUnreachable`]) instead of waited for. A drain of a
/// node whose kubelet is unreachable could otherwise never end: nothing confirms the deletion
/// of its pods, whose objects stay terminating until the node comes back or is removed.
pub fn plan_node_counting_gone(
    pods: &[PodFacts],
    rules: &Rules,
    gone: impl Fn(usize) -> bool,
) -> NodePlan {
    let mut plan = NodePlan::default();
    let mut groups: Vec<(usize, usize)> = Vec::new();
    for (i, pod) in pods.iter().enumerate() {
        match disposition(pod, rules) {
            Disposition::Finished => continue,
            Disposition::Skipped(reason) => {
                plan.skipped.push((i, reason));
                continue;
            }
            _ if pod.terminating && gone(i) => {
                plan.skipped.push((i, SkipReason::NodeUnreachable));
                continue;
            }
            Disposition::WaitForCompletion => plan.waiting.push(i),
            Disposition::StandaloneNotAllowed => plan.standalone.push(i),
            Disposition::Leaves { group } => {
                groups.push((group, i));
                if pod.local_storage {
                    plan.local_storage.push(i);
                }
            }
        }
        if pod.terminating {
            plan.terminating.push(i);
        }
        plan.remaining.push(i);
    }
    plan.current_group = groups.iter().map(|(g, _)| *g).min();
    if let Some(current) = plan.current_group {
        plan.evict = groups
            .iter()
            .filter(|(g, i)| *g == current && !pods[*i].terminating)
            .map(|(_, i)| *i)
            .collect();
    }
    plan
}

/// What a node's drain does about its deadline at `now` (seconds since the drain started).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadlineStep {
    /// Before the deadline: keep evicting. With `ForceDelete`, `delete` lists the pods whose own
    /// grace period no longer fits between now and the deadline: delete them now, with that
    /// grace period. `recheck_in` is when the next such moment (or the deadline) comes.
    Continue {
        delete: Vec<usize>,
        recheck_in: Duration,
    },
    /// Past the deadline with `Fail`: stop evicting, report the node failed.
    Fail,
    /// Past the deadline with `Proceed`: count the node drained, report what was left.
    Proceed,
    /// Past the deadline with `ForceDelete`: delete what is still there (pods already
    /// terminating are left to finish), then wait for them to go.
    ForceDelete { delete: Vec<usize> },
}

/// The grace period a forced delete gives `pod`: its own, and never 0 (0 would skip the
/// container's shutdown entirely).
pub fn force_grace(pod: &PodFacts) -> i64 {
    pod.grace_seconds.max(1)
}

/// Which pods a forced delete may remove: the ones that must leave and are not already going, and
/// the waited-for ones; bare pods only when `allowStandalonePods` (the plan already leaves them
/// out of `remaining`'s evictable part otherwise).
fn force_candidates(plan: &NodePlan, pods: &[PodFacts]) -> Vec<usize> {
    plan.remaining
        .iter()
        .copied()
        .filter(|i| !pods[*i].terminating && !plan.standalone.contains(i))
        .collect()
}

/// Decides the deadline step for a node whose drain has run `elapsed`.
pub fn deadline_step(
    plan: &NodePlan,
    pods: &[PodFacts],
    rules: &Rules,
    elapsed: Duration,
) -> DeadlineStep {
    let timeout = rules.timeout;
    if elapsed >= timeout {
        return match rules.on_timeout {
            OnTimeout::Fail => DeadlineStep::Fail,
            OnTimeout::Proceed => DeadlineStep::Proceed,
            OnTimeout::ForceDelete => DeadlineStep::ForceDelete {
                delete: force_candidates(plan, pods),
            },
        };
    }
    let left = timeout - elapsed;
    let mut recheck_in = left;
    let mut delete = Vec::new();
    if rules.on_timeout == OnTimeout::ForceDelete {
        for i in force_candidates(plan, pods) {
            let grace = Duration::from_secs(u64::try_from(force_grace(&pods[i])).unwrap_or(0));
            if grace >= left {
                delete.push(i);
            } else {
                recheck_in = recheck_in.min(left - grace);
            }
        }
    }
    DeadlineStep::Continue { delete, recheck_in }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn pod(name: &str, owner: Owner) -> PodFacts {
        PodFacts {
            namespace: "ns".into(),
            name: name.into(),
            labels: BTreeMap::new(),
            owner,
            mirror: false,
            priority: 0,
            finished: false,
            terminating: false,
            healthy: true,
            local_storage: false,
            grace_seconds: 30,
        }
    }

    fn rules(plan: Vec<DrainPlanEntry>) -> Rules {
        Rules {
            plan,
            skip: None,
            wait: None,
            allow_standalone: false,
            timeout: Duration::from_secs(600),
            on_timeout: OnTimeout::Fail,
        }
    }

    fn selector(k: &str, v: &str) -> LabelSelector {
        LabelSelector {
            match_labels: [(k.to_string(), v.to_string())].into(),
            match_expressions: vec![],
        }
    }

    fn names(pods: &[PodFacts], idx: &[usize]) -> Vec<String> {
        idx.iter().map(|i| pods[*i].name.clone()).collect()
    }

    #[test]
    fn default_plan_moves_ordinary_pods_before_high_and_critical_ones() {
        let mut low = pod("low", Owner::Controller);
        low.priority = -10;
        let ordinary = pod("ordinary", Owner::Controller);
        let mut high = pod("high", Owner::Controller);
        high.priority = 1000;
        let mut critical = pod("dns", Owner::Controller);
        critical.priority = 2_000_000_000;
        let pods = vec![critical, high, ordinary, low];
        let r = rules(default_plan());
        let p = plan_node(&pods, &r);
        assert_eq!(p.current_group, Some(0));
        assert_eq!(names(&pods, &p.evict), ["ordinary", "low"]);
        assert_eq!(p.remaining.len(), 4);

        // Once group 0 is gone, group 1 (user priorities), then the critical pods.
        let p = plan_node(&pods[..2], &r);
        assert_eq!(
            (p.current_group, names(&pods, &p.evict)),
            (Some(1), vec!["high".to_string()])
        );
        let p = plan_node(&pods[..1], &r);
        assert_eq!(
            (p.current_group, names(&pods, &p.evict)),
            (Some(2), vec!["dns".to_string()])
        );
    }

    #[test]
    fn a_group_waits_while_an_earlier_one_is_still_terminating() {
        let r = rules(vec![DrainPlanEntry {
            pod_selector: Some(selector("tier", "frontend")),
            ..DrainPlanEntry::default()
        }]);
        let mut front = pod("front", Owner::Controller);
        front.labels.insert("tier".into(), "frontend".into());
        front.terminating = true;
        let back = pod("back", Owner::Controller);
        let pods = vec![back, front];
        let p = plan_node(&pods, &r);
        assert_eq!(p.current_group, Some(0));
        assert!(p.evict.is_empty(), "the frontend pod is already going");
        assert_eq!(names(&pods, &p.terminating), ["front"]);
        assert!(!p.drained());
    }

    #[test]
    fn plan_order_is_pod_type_then_priority_then_selector_as_written() {
        let r = rules(vec![
            DrainPlanEntry {
                pod_type: PodType::Standalone,
                ..DrainPlanEntry::default()
            },
            DrainPlanEntry {
                priority_threshold: Some(100),
                ..DrainPlanEntry::default()
            },
            DrainPlanEntry {
                pod_selector: Some(selector("app", "db")),
                ..DrainPlanEntry::default()
            },
        ]);
        let mut r = r;
        r.allow_standalone = true;
        let bare = pod("bare", Owner::None);
        let mut cheap = pod("cheap", Owner::Controller);
        cheap.priority = 50;
        let mut db = pod("db", Owner::Controller);
        db.priority = 500;
        db.labels.insert("app".into(), "db".into());
        let mut other = pod("other", Owner::Controller);
        other.priority = 500;
        let pods = [bare, cheap, db, other];
        let groups: Vec<_> = pods.iter().map(|p| disposition(p, &r)).collect();
        assert_eq!(
            groups,
            [0, 1, 2, 3].map(|group| Disposition::Leaves { group })
        );
    }

    #[test]
    fn skip_wait_daemonset_mirror_and_bare_pods() {
        let mut r = rules(vec![]);
        r.skip = Some(selector("keep", "yes"));
        r.wait = Some(selector("job", "batch"));
        let mut skipped = pod("skipped", Owner::Controller);
        skipped.labels.insert("keep".into(), "yes".into());
        let mut job = pod("job", Owner::Controller);
        job.labels.insert("job".into(), "batch".into());
        let ds = pod("ds", Owner::DaemonSet);
        let mut mirror = pod("mirror", Owner::None);
        mirror.mirror = true;
        let bare = pod("bare", Owner::None);
        let mut done = pod("done", Owner::Controller);
        done.finished = true;
        let mut scratch = pod("scratch", Owner::Controller);
        scratch.local_storage = true;
        let pods = vec![skipped, job, ds, mirror, bare, done, scratch];
        let p = plan_node(&pods, &r);
        assert_eq!(
            p.skipped
                .iter()
                .map(|(i, why)| (pods[*i].name.as_str(), *why))
                .collect::<Vec<_>>(),
            [
                ("skipped", SkipReason::SkipPods),
                ("ds", SkipReason::DaemonSet),
                ("mirror", SkipReason::MirrorPod)
            ]
        );
        assert_eq!(names(&pods, &p.waiting), ["job"]);
        assert_eq!(names(&pods, &p.standalone), ["bare"]);
        assert_eq!(names(&pods, &p.evict), ["scratch"]);
        assert_eq!(names(&pods, &p.local_storage), ["scratch"]);
        assert_eq!(names(&pods, &p.remaining), ["job", "bare", "scratch"]);

        // With bare pods allowed, the bare pod leaves with the rest.
        r.allow_standalone = true;
        let p = plan_node(&pods, &r);
        assert_eq!(names(&pods, &p.evict), ["bare", "scratch"]);

        // Only the waited-for job left, and it finished: drained.
        let mut job = pods[1].clone();
        job.finished = true;
        assert!(plan_node(&[job, pods[2].clone()], &r).drained());
    }

    #[test]
    fn pods_counted_gone_are_skipped_and_let_the_next_group_go() {
        let r = rules(default_plan());
        let mut stuck = pod("stuck", Owner::Controller);
        stuck.terminating = true;
        let mut going = pod("going", Owner::Controller);
        going.terminating = true;
        let mut bare = pod("bare", Owner::None);
        bare.terminating = true;
        let mut high = pod("high", Owner::Controller);
        high.priority = 1000;
        let pods = vec![stuck, going, bare, high];

        // Nothing counted gone: the terminating pods hold group 0 and the drain up.
        let p = plan_node(&pods, &r);
        assert_eq!(p.current_group, Some(0));
        assert!(p.evict.is_empty());
        assert_eq!(names(&pods, &p.terminating), ["stuck", "going", "bare"]);

        // The stuck pod and the bare one are gone: only the pod still within its wait holds
        // group 0.
        let p = plan_node_counting_gone(&pods, &r, |i| i != 1);
        assert_eq!(
            p.skipped
                .iter()
                .map(|(i, why)| (pods[*i].name.as_str(), *why))
                .collect::<Vec<_>>(),
            [
                ("stuck", SkipReason::NodeUnreachable),
                ("bare", SkipReason::NodeUnreachable)
            ]
        );
        assert_eq!(names(&pods, &p.remaining), ["going", "high"]);
        assert!(p.standalone.is_empty());

        // All gone: the next group is evicted, and once it is gone too the node is drained.
        let p = plan_node_counting_gone(&pods, &r, |_| true);
        assert_eq!(
            (p.current_group, names(&pods, &p.evict)),
            (Some(1), vec!["high".to_string()])
        );
        assert!(plan_node_counting_gone(&pods[..3], &r, |_| true).drained());
        // A pod that is not terminating is never counted gone.
        assert!(!plan_node_counting_gone(&pods[3..], &r, |_| true).drained());
    }

    #[test]
    fn daemonset_pods_leave_only_when_a_plan_entry_names_them() {
        let r = rules(vec![DrainPlanEntry {
            pod_type: PodType::DaemonSet,
            ..DrainPlanEntry::default()
        }]);
        let ds = pod("ds", Owner::DaemonSet);
        assert_eq!(disposition(&ds, &r), Disposition::Leaves { group: 0 });
        // `Any` never takes DaemonSet pods.
        let r = rules(vec![DrainPlanEntry::default()]);
        assert_eq!(
            disposition(&ds, &r),
            Disposition::Skipped(SkipReason::DaemonSet)
        );
    }

    #[test]
    fn timeout_actions() {
        let mut r = rules(vec![]);
        r.timeout = Duration::from_secs(100);
        let mut slow = pod("slow", Owner::Controller);
        slow.grace_seconds = 40;
        let fast = pod("fast", Owner::Controller); // 30 s
        let mut zero = pod("zero", Owner::Controller);
        zero.grace_seconds = 0;
        let bare = pod("bare", Owner::None);
        let pods = vec![slow, fast, zero, bare];
        let p = plan_node(&pods, &r);

        // Fail and Proceed do nothing early.
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(10)),
            DeadlineStep::Continue {
                delete: vec![],
                recheck_in: Duration::from_secs(90)
            }
        );
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(100)),
            DeadlineStep::Fail
        );
        r.on_timeout = OnTimeout::Proceed;
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(150)),
            DeadlineStep::Proceed
        );

        // ForceDelete: each pod is deleted when its own grace period still fits before the
        // deadline; the bare pod (not allowed) never.
        r.on_timeout = OnTimeout::ForceDelete;
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(10)),
            DeadlineStep::Continue {
                delete: vec![],
                recheck_in: Duration::from_secs(50)
            }
        );
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(60)),
            DeadlineStep::Continue {
                delete: vec![0],
                recheck_in: Duration::from_secs(10)
            }
        );
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(99)),
            DeadlineStep::Continue {
                delete: vec![0, 1, 2],
                recheck_in: Duration::from_secs(1)
            }
        );
        assert_eq!(
            deadline_step(&p, &pods, &r, Duration::from_secs(100)),
            DeadlineStep::ForceDelete {
                delete: vec![0, 1, 2]
            }
        );
        assert_eq!(force_grace(&pods[2]), 1, "never grace 0");
        assert_eq!(force_grace(&pods[0]), 40);
    }
}
