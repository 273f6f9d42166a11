//! Node problems beyond conditions: which of an agent's temporary problems are new since the last
//! report (and so become Node Events), how the agents' problem counts add up to the fleet's
//! `problem_counter`, and the per-node Event budget (`problems.eventsPerNodePerHour` in any 60
//! minutes; over it, an Event is counted as suppressed and not written).
//!
//! State is per node and in memory only. After a restart or a leader change, problems the agents
//! saw before this controller started to lead are not replayed as Events or counted again: the
//! Events were written then (or belong to a time no controller watched), and counting them again
//! would read as a burst.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType};
use nodekeeper_model::text::truncate;

use crate::conditions::{Transition, TransitionKind};
use crate::shared::metrics::ProblemTotals;
use crate::view::{NodeView, ProblemEventView};

/// The window the Event budget counts over.
const BUDGET_WINDOW: Duration = Duration::from_secs(3600);
/// The Events API's limits on `reason` and `note`.
const MAX_EVENT_REASON: usize = 128;
const MAX_EVENT_NOTE: usize = 1024;

/// `text` within `max` bytes, the ellipsis that marks a cut included.
fn within(text: &str, max: usize) -> String {
    truncate(text, max - '…'.len_utf8()).into_owned()
}

/// Where a node's temporary problems were last read up to: the newest timestamp handled
/// (milliseconds since the Unix epoch) and how many problems with exactly that timestamp were.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    pub at_ms: i64,
    pub at_same_ms: usize,
}

#[derive(Debug)]
struct NodeState {
    cursor: Cursor,
    /// The agent's counts by reason at its last report; `None` before the first.
    counts: Option<BTreeMap<String, u64>>,
    /// When this node's Events were written, within the budget window.
    emitted: VecDeque<Instant>,
}

/// The per-node problem state of the sweep.
#[derive(Debug)]
pub struct Problems {
    nodes: Mutex<HashMap<String, NodeState>>,
    /// When this controller started to lead (milliseconds since the Unix epoch).
    since_ms: i64,
}

/// Temporary problems of one report not handled yet, and the cursor to record once they are
/// handed to a writer.
#[derive(Debug, Default)]
pub struct NewProblems {
    pub events: Vec<ProblemEventView>,
    pub cursor: Option<Cursor>,
}

/// The temporary problems in `recent` (oldest first) after `cursor`, and the cursor past them.
pub fn after_cursor(
    recent: &[ProblemEventView],
    cursor: Cursor,
) -> (Vec<&ProblemEventView>, Cursor) {
    let mut skip_same = cursor.at_same_ms;
    let mut fresh = Vec::new();
    for event in recent {
        if event.timestamp_unix_ms < cursor.at_ms {
            continue;
        }
        if event.timestamp_unix_ms == cursor.at_ms && skip_same > 0 {
            skip_same -= 1;
            continue;
        }
        fresh.push(event);
    }
    let next = match fresh.last() {
        None => cursor,
        Some(last) => Cursor {
            at_ms: last.timestamp_unix_ms,
            at_same_ms: recent
                .iter()
                .filter(|e| e.timestamp_unix_ms == last.timestamp_unix_ms)
                .count(),
        },
    };
    (fresh, next)
}

/// What the agent's counts add to the fleet's counter since `before`. A count lower than before
/// means the agent restarted and counts from 0 again. With no `before` (the node's first report
/// to this leader), only problems dated after `since_ms` count.
pub fn count_increase(
    before: Option<&BTreeMap<String, u64>>,
    view: &NodeView,
    since_ms: i64,
) -> BTreeMap<String, u64> {
    let counts = &view.problems.counts;
    match before {
        Some(before) => counts
            .iter()
            .map(|(reason, now)| {
                let was = before.get(reason).copied().unwrap_or(0);
                let added = if *now >= was { now - was } else { *now };
                (reason.clone(), added)
            })
            .filter(|(_, n)| *n > 0)
            .collect(),
        None => {
            let mut recent: BTreeMap<&str, u64> = BTreeMap::new();
            for e in view
                .problems
                .recent
                .iter()
                .filter(|e| e.timestamp_unix_ms >= since_ms)
            {
                *recent.entry(&e.reason).or_default() += 1;
            }
            for c in view.problems.conditions.iter() {
                if c.status == "True" && c.transition_unix_ms >= since_ms {
                    *recent.entry(&c.reason).or_default() += 1;
                }
            }
            counts
                .iter()
                .filter_map(|(reason, now)| {
                    let n = recent.get(reason.as_str()).copied().unwrap_or(0).min(*now);
                    (n > 0).then(|| (reason.clone(), n))
                })
                .collect()
        }
    }
}

/// Records one Event at `now` unless `budget` Events were already written in the window.
fn admit(emitted: &mut VecDeque<Instant>, now: Instant, budget: u32) -> bool {
    while emitted
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) >= BUDGET_WINDOW)
    {
        emitted.pop_front();
    }
    if emitted.len() >= budget as usize {
        return false;
    }
    emitted.push_back(now);
    true
}

impl Problems {
    pub fn new(since_ms: i64) -> Self {
        Self {
            nodes: Mutex::default(),
            since_ms,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, NodeState>> {
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn entry<'a>(
        &self,
        nodes: &'a mut HashMap<String, NodeState>,
        node: &str,
    ) -> &'a mut NodeState {
        nodes.entry(node.to_owned()).or_insert_with(|| NodeState {
            cursor: Cursor {
                at_ms: self.since_ms,
                at_same_ms: 0,
            },
            counts: None,
            emitted: VecDeque::new(),
        })
    }

    /// Takes in a new report of `node`: adds its new problems to `totals`, and returns its
    /// temporary problems not handled yet (`events` only when `emit_events`).
    pub fn observe(
        &self,
        node: &str,
        view: &NodeView,
        emit_events: bool,
        totals: &ProblemTotals,
    ) -> NewProblems {
        let mut nodes = self.lock();
        let state = self.entry(&mut nodes, node);
        for (reason, n) in count_increase(state.counts.as_ref(), view, self.since_ms) {
            totals.add(&reason, n);
        }
        state.counts = Some(view.problems.counts.iter().cloned().collect());
        let (fresh, cursor) = after_cursor(&view.problems.recent, state.cursor);
        if !emit_events {
            // Nothing to write: the problems are handled by not being written.
            state.cursor = cursor;
            return NewProblems::default();
        }
        NewProblems {
            events: fresh.into_iter().cloned().collect(),
            cursor: (cursor != state.cursor).then_some(cursor),
        }
    }

    /// Records that the problems up to `cursor` were handed to a writer.
    pub fn commit(&self, node: &str, cursor: Cursor) {
        let mut nodes = self.lock();
        self.entry(&mut nodes, node).cursor = cursor;
    }

    /// Whether `node` may have one more Event now under `budget` per hour (and if so, counts it).
    pub fn admit(&self, node: &str, now: Instant, budget: u32) -> bool {
        let mut nodes = self.lock();
        admit(&mut self.entry(&mut nodes, node).emitted, now, budget)
    }

    /// Forgets nodes `keep` says are gone.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|name, _| keep(name));
    }
}

/// The Node an Event is about. The uid is the node's name, as the kubelet and NPD set it, which
/// is what `kubectl describe node` looks for.
pub fn node_reference(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.to_owned()),
        uid: Some(node.to_owned()),
        ..ObjectReference::default()
    }
}

/// The Event for a temporary problem: a Warning with the rule's reason and the log line.
pub fn temporary_event(problem: &ProblemEventView) -> Event {
    Event {
        type_: EventType::Warning,
        reason: within(&problem.reason, MAX_EVENT_REASON),
        note: Some(within(&problem.message, MAX_EVENT_NOTE)),
        action: "DetectProblem".into(),
        secondary: None,
    }
}

/// The Event for a problem condition's transition: a Warning when it turns `True`, Normal when it
/// clears (as NPD reports condition changes).
pub fn transition_event(t: &Transition) -> Event {
    let (type_, verb) = match t.kind {
        TransitionKind::Problem => (EventType::Warning, "is now True"),
        TransitionKind::Recovered => (EventType::Normal, "is now False"),
    };
    Event {
        type_,
        reason: within(&t.reason, MAX_EVENT_REASON),
        note: Some(within(
            &format!("{} {verb}: {}", t.type_, t.message),
            MAX_EVENT_NOTE,
        )),
        action: "ConditionChanged".into(),
        secondary: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::ProblemConditionView;

    fn ev(reason: &str, at: i64) -> ProblemEventView {
        ProblemEventView {
            source: "kernel-monitor".into(),
            reason: reason.into(),
            message: format!("{reason} at {at}"),
            timestamp_unix_ms: at,
        }
    }

    #[test]
    fn the_cursor_hands_out_each_problem_once_even_with_equal_timestamps() {
        let start = Cursor {
            at_ms: 100,
            at_same_ms: 0,
        };
        let recent = vec![ev("Old", 50), ev("A", 200), ev("B", 200)];
        let (fresh, c) = after_cursor(&recent, start);
        assert_eq!(
            fresh.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["A", "B"]
        );
        assert_eq!(
            c,
            Cursor {
                at_ms: 200,
                at_same_ms: 2
            }
        );
        // The same report again: nothing new.
        assert!(after_cursor(&recent, c).0.is_empty());
        // A third problem in the same millisecond, and a later one.
        let more = vec![ev("A", 200), ev("B", 200), ev("C", 200), ev("D", 300)];
        let (fresh, c) = after_cursor(&more, c);
        assert_eq!(
            fresh.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["C", "D"]
        );
        assert_eq!(
            c,
            Cursor {
                at_ms: 300,
                at_same_ms: 1
            }
        );
    }

    #[test]
    fn counts_add_differences_and_survive_an_agent_restart() {
        let mut view = NodeView::default();
        view.problems.counts = vec![("OOMKilling".into(), 5), ("TaskHung".into(), 0)];
        view.problems.recent = vec![ev("OOMKilling", 10), ev("OOMKilling", 1000)];
        view.problems.conditions = vec![ProblemConditionView {
            type_: "KernelDeadlock".into(),
            status: "True".into(),
            reason: "DockerHung".into(),
            message: String::new(),
            source: "kernel-monitor".into(),
            transition_unix_ms: 2000,
        }];
        // First report to this leader: only what happened since it leads (at 500).
        let first = count_increase(None, &view, 500);
        assert_eq!(first, [("OOMKilling".to_string(), 1)].into());
        let before: BTreeMap<String, u64> = view.problems.counts.iter().cloned().collect();
        view.problems.counts = vec![("OOMKilling".into(), 7), ("TaskHung".into(), 1)];
        assert_eq!(
            count_increase(Some(&before), &view, 500),
            [("OOMKilling".to_string(), 2), ("TaskHung".to_string(), 1)].into()
        );
        // Restarted agent: counts from 0 again.
        view.problems.counts = vec![("OOMKilling".into(), 1)];
        assert_eq!(
            count_increase(Some(&before), &view, 500),
            [("OOMKilling".to_string(), 1)].into()
        );
    }

    #[test]
    fn the_budget_allows_n_events_in_any_hour() {
        let mut emitted = VecDeque::new();
        let t0 = Instant::now();
        assert!(admit(&mut emitted, t0, 2));
        assert!(admit(&mut emitted, t0 + Duration::from_secs(10), 2));
        assert!(!admit(&mut emitted, t0 + Duration::from_secs(20), 2));
        assert!(!admit(&mut emitted, t0 + Duration::from_secs(3599), 2));
        assert!(admit(&mut emitted, t0 + Duration::from_secs(3600), 2));
        assert!(!admit(&mut emitted, t0 + Duration::from_secs(3605), 2));
        assert!(!admit(&mut VecDeque::new(), t0, 0), "0 turns Events off");
    }

    #[test]
    fn events_carry_the_rule_reason_and_stay_within_api_limits() {
        let mut p = ev("OOMKilling", 1);
        p.message = "x".repeat(5000);
        let e = temporary_event(&p);
        assert_eq!(e.type_, EventType::Warning);
        assert_eq!(e.reason, "OOMKilling");
        assert!(e.note.unwrap().len() <= MAX_EVENT_NOTE);
        let t = Transition {
            type_: "KernelDeadlock".into(),
            kind: TransitionKind::Recovered,
            reason: "KernelHasNoDeadlock".into(),
            message: "kernel has no deadlock".into(),
        };
        let e = transition_event(&t);
        assert_eq!(e.type_, EventType::Normal);
        assert_eq!(
            e.note.as_deref(),
            Some("KernelDeadlock is now False: kernel has no deadlock")
        );
    }
}
