//! Node problems beyond conditions: which of an agent's temporary problems are new since the last
//! report (and so become Node Events), how the agents' problem counts add up to the fleet's
//! `problem_counter`, and the per-node Event budget (`problems.eventsPerNodePerHour` in any 60
//! minutes; over it, an Event is counted as suppressed and not written).
//!
//! State is per node and in memory only. After a restart or a leader change, problems the agents
//! saw before this controller started to lead are not replayed as Events or counted again: the
//! Events were written then (or belong to a time no controller watched), and counting them again
//! would read as a burst.
//!
//! Which problems are new is read from the agent's numbering (`sequence` within
//! `sequence_epoch`): the timestamps come from three clocks (the kernel log's time since boot
//! made wall time, the journal's, the plugin runner's), so a problem recorded later can be
//! stamped earlier, and a cursor over timestamps would skip it or hand one out twice. Timestamps
//! still decide where numbers cannot: on a node's first report to this leader (the rule above),
//! on the first report after an agent restart (a new epoch; the restarted agent reads its logs'
//! lookback window again and lists problems already handled under new numbers), and for an
//! agent that does not number its problems (epoch 0).
//!
//! A restarted agent may stamp a problem it lists again a little differently: an agent older
//! than the kernel log's boot time from `/proc/stat`'s `btime` (now minus `/proc/uptime`, in
//! 10 ms steps, recomputed at each start), or the wall clock stepped between the two starts.
//! So on a new epoch a problem stamped within [`TOLERANCE_MS`] of the newest handled one is
//! told by what it says (source, reason and message, [`Cursor::near`]), not by its timestamp:
//! one handled already is not written twice, and one that happened while the agent was down is
//! not skipped for a stamp a few milliseconds early.

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

/// Where a node's temporary problems were last read up to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    /// The newest timestamp handled (milliseconds since the Unix epoch) and how many problems
    /// with exactly that timestamp were: read where the numbers cannot be (see the module doc).
    pub at_ms: i64,
    pub at_same_ms: usize,
    /// The agent's `sequence_epoch` the problems were last read under, and the highest number
    /// handled in it; epoch 0: not read by numbers yet.
    pub epoch: u64,
    pub sequence: u64,
    /// What the problems handled within 2 × [`TOLERANCE_MS`] before `at_ms` say
    /// ([`fingerprint`]; 0: an empty place; see `near_newest`), for the first read of a new
    /// epoch. A fixed array, so that a node's state stays small and the cursor `Copy`.
    pub near: [u32; NEAR_MAX],
    /// More than [`NEAR_MAX`] were handled there: one not in `near` may be handled anyway.
    pub near_overflow: bool,
}

impl Cursor {
    /// Before the first report: problems dated from `since_ms` on are new.
    pub fn since(since_ms: i64) -> Self {
        Self {
            at_ms: since_ms,
            at_same_ms: 0,
            epoch: 0,
            sequence: 0,
            near: [0; NEAR_MAX],
            near_overflow: false,
        }
    }
}

/// How far apart two agent starts on one boot may stamp one kernel record: boot time as now
/// minus `/proc/uptime` (older agents) moves by tens of milliseconds; by up to a second where
/// an agent of this version follows an older one (whole seconds of `btime`).
pub const TOLERANCE_MS: i64 = 1000;

/// Problems remembered near the newest handled one ([`Cursor::near`]).
pub const NEAR_MAX: usize = 16;

/// What a problem says (source, reason, message) as a small number, never 0.
pub fn fingerprint(event: &ProblemEventView) -> u32 {
    use std::hash::{Hash as _, Hasher as _};
    // SipHash with fixed keys: the same number in every run, which the cursor relies on only
    // within one process anyway.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&event.source, &event.reason, &event.message).hash(&mut hasher);
    let h = hasher.finish();
    ((h >> 32) as u32 ^ h as u32) | 1
}

/// The fingerprints of the problems in `recent` stamped within 2 × [`TOLERANCE_MS`] before
/// `at_ms` (inclusive), newest first, and whether there were more than [`NEAR_MAX`]. When
/// `at_ms` is `previous`'s, what `previous` remembered is kept too (the agent's list is bounded,
/// and the problems at the newest stamp may have left it).
fn near_newest(
    recent: &[ProblemEventView],
    at_ms: i64,
    previous: &Cursor,
) -> ([u32; NEAR_MAX], bool) {
    let mut listed: Vec<(i64, u32)> = recent
        .iter()
        .filter(|e| e.timestamp_unix_ms <= at_ms && e.timestamp_unix_ms > at_ms - 2 * TOLERANCE_MS)
        .map(|e| (e.timestamp_unix_ms, fingerprint(e)))
        .collect();
    listed.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    let mut out: Vec<u32> = Vec::with_capacity(NEAR_MAX);
    let mut overflow = false;
    let kept = (previous.at_ms == at_ms)
        .then_some(previous.near.iter().copied().filter(|f| *f != 0))
        .into_iter()
        .flatten();
    for fp in listed.into_iter().map(|(_, fp)| fp).chain(kept) {
        if out.contains(&fp) {
            continue;
        }
        if out.len() == NEAR_MAX {
            overflow = true;
            break;
        }
        out.push(fp);
    }
    overflow |= previous.at_ms == at_ms && previous.near_overflow;
    let mut near = [0; NEAR_MAX];
    near[..out.len()].copy_from_slice(&out);
    (near, overflow)
}

/// The problems in `recent` not handled yet on the first read of a new epoch (a restarted
/// agent): by timestamp, except near the newest handled one, where by what they say (see the
/// module doc).
fn after_restart(recent: &[ProblemEventView], cursor: Cursor) -> Vec<&ProblemEventView> {
    if cursor.near.iter().all(|f| *f == 0) && !cursor.near_overflow {
        // Nothing handled near the cursor (a node's first report to this leader): timestamps.
        return after_timestamp(recent, cursor).0;
    }
    let by_stamp = after_timestamp(recent, cursor).0;
    let new_by_stamp = |e: &ProblemEventView| by_stamp.iter().any(|s| std::ptr::eq(*s, e));
    recent
        .iter()
        .filter(|e| {
            if (e.timestamp_unix_ms - cursor.at_ms).abs() > TOLERANCE_MS {
                return new_by_stamp(e);
            }
            if cursor.near.contains(&fingerprint(e)) {
                return false;
            }
            // Not among those handled near the cursor: new, unless some handled there could
            // not be remembered.
            !cursor.near_overflow || new_by_stamp(e)
        })
        .collect()
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

/// The temporary problems in `recent` (in the agent's recording order) after `cursor`, and the
/// cursor past them. `epoch` is the report's `sequence_epoch`: the same as the cursor's, the
/// numbers decide; another (a restarted agent, or the node's first report here), the
/// timestamps decide once; 0 (an agent that does not number its problems), the timestamps
/// decide as they always did.
pub fn after_cursor(
    recent: &[ProblemEventView],
    epoch: u64,
    cursor: Cursor,
) -> (Vec<&ProblemEventView>, Cursor) {
    if epoch == 0 {
        let (fresh, next) = after_timestamp(recent, cursor);
        // Every listed problem stamped up to the cursor counts as handled (read or skipped).
        let (near, near_overflow) = near_newest(recent, next.at_ms, &cursor);
        return (
            fresh,
            Cursor {
                epoch: 0,
                sequence: 0,
                near,
                near_overflow,
                ..next
            },
        );
    }
    let same = epoch == cursor.epoch;
    let fresh = if same {
        recent
            .iter()
            .filter(|e| e.sequence > cursor.sequence)
            .collect()
    } else {
        after_restart(recent, cursor)
    };
    let (at_ms, at_same_ms) = newest_listed(recent, cursor);
    let before = if same { cursor.sequence } else { 0 };
    let (near, near_overflow) = near_newest(recent, at_ms, &cursor);
    let next = Cursor {
        at_ms,
        at_same_ms,
        epoch,
        sequence: recent.iter().map(|e| e.sequence).fold(before, u64::max),
        near,
        near_overflow,
    };
    (fresh, next)
}

/// The timestamp part of a cursor past every problem in `recent` as well as past `cursor`: all
/// of them are handled once a report is read by numbers, whatever their timestamps' order, so a
/// later read by timestamps (after an agent restart) starts after the newest.
fn newest_listed(recent: &[ProblemEventView], cursor: Cursor) -> (i64, usize) {
    let Some(newest) = recent.iter().map(|e| e.timestamp_unix_ms).max() else {
        return (cursor.at_ms, cursor.at_same_ms);
    };
    let same_ms = recent
        .iter()
        .filter(|e| e.timestamp_unix_ms == newest)
        .count();
    match newest.cmp(&cursor.at_ms) {
        std::cmp::Ordering::Less => (cursor.at_ms, cursor.at_same_ms),
        std::cmp::Ordering::Equal => (newest, same_ms.max(cursor.at_same_ms)),
        std::cmp::Ordering::Greater => (newest, same_ms),
    }
}

/// The problems in `recent` (oldest first) dated after `cursor`'s timestamp, and the cursor's
/// timestamp part past them: right only where timestamps are in recording order.
fn after_timestamp(
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
            ..cursor
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
            cursor: Cursor::since(self.since_ms),
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
        let (fresh, cursor) = after_cursor(
            &view.problems.recent,
            view.problems.sequence_epoch,
            state.cursor,
        );
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
            sequence: 0,
        }
    }

    /// A numbered problem, as an agent that numbers them lists it.
    fn numbered(source: &str, reason: &str, at: i64, sequence: u64) -> ProblemEventView {
        ProblemEventView {
            source: source.into(),
            sequence,
            ..ev(reason, at)
        }
    }

    fn reasons(fresh: &[&ProblemEventView]) -> Vec<String> {
        fresh.iter().map(|e| e.reason.clone()).collect()
    }

    /// A node's report with `recent` numbered under `epoch`.
    fn report(epoch: u64, recent: Vec<ProblemEventView>) -> NodeView {
        let mut view = NodeView::default();
        view.problems.sequence_epoch = epoch;
        view.problems.recent = recent;
        view
    }

    /// What `observe` hands out for `view`, committed as the sweep commits it.
    fn read(problems: &Problems, view: &NodeView) -> Vec<String> {
        let new = problems.observe("n1", view, true, &ProblemTotals::default());
        if let Some(cursor) = new.cursor {
            problems.commit("n1", cursor);
        }
        new.events.iter().map(|e| e.reason.clone()).collect()
    }

    #[test]
    fn the_cursor_hands_out_each_problem_once_even_with_equal_timestamps() {
        // An agent that does not number its problems (epoch 0): by timestamps, as before.
        let start = Cursor::since(100);
        let recent = vec![ev("Old", 50), ev("A", 200), ev("B", 200)];
        let (fresh, c) = after_cursor(&recent, 0, start);
        assert_eq!(
            fresh.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["A", "B"]
        );
        assert_eq!((c.at_ms, c.at_same_ms, c.epoch), (200, 2, 0));
        // The same report again: nothing new.
        assert!(after_cursor(&recent, 0, c).0.is_empty());
        // A third problem in the same millisecond, and a later one.
        let more = vec![ev("A", 200), ev("B", 200), ev("C", 200), ev("D", 300)];
        let (fresh, c) = after_cursor(&more, 0, c);
        assert_eq!(
            fresh.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
            ["C", "D"]
        );
        assert_eq!((c.at_ms, c.at_same_ms, c.epoch), (300, 1, 0));
    }

    #[test]
    fn numbered_problems_are_handed_out_once_whatever_their_timestamps() {
        let problems = Problems::new(100);
        // The kernel log's clock ahead of the plugin runner's: the plugin's problem, recorded
        // after the kernel's, is stamped before it.
        let oom = numbered("kernel-monitor", "OOMKilling", 2000, 1);
        assert_eq!(
            read(&problems, &report(7, vec![oom.clone()])),
            ["OOMKilling"]
        );
        let plugin = numbered("custom-plugin", "PluginProblem", 1500, 2);
        let mut recent = vec![oom.clone(), plugin.clone()];
        assert_eq!(
            read(&problems, &report(7, recent.clone())),
            ["PluginProblem"]
        );
        assert!(read(&problems, &report(7, recent.clone())).is_empty());
        // Two more in one millisecond, one report apart, and a third stamped before all.
        recent.push(numbered("kernel-monitor", "A", 3000, 3));
        assert_eq!(read(&problems, &report(7, recent.clone())), ["A"]);
        recent.push(numbered("kernel-monitor", "B", 3000, 4));
        recent.push(numbered("journal", "C", 10, 5));
        assert_eq!(read(&problems, &report(7, recent.clone())), ["B", "C"]);
        assert!(read(&problems, &report(7, recent)).is_empty());

        // In one report, a later problem stamped earlier: by timestamps the cursor would end at
        // the earlier stamp and hand out the other again on the next read.
        let recent = vec![
            numbered("kernel-monitor", "K", 5000, 6),
            numbered("custom-plugin", "P", 4000, 7),
        ];
        let (fresh, c) = after_cursor(
            &recent,
            7,
            Cursor {
                epoch: 7,
                ..Cursor::since(0)
            },
        );
        assert_eq!(reasons(&fresh), ["K", "P"]);
        assert!(after_cursor(&recent, 7, c).0.is_empty());
        assert_eq!(
            (c.epoch, c.sequence, c.at_ms, c.at_same_ms),
            (7, 7, 5000, 1)
        );
    }

    #[test]
    fn the_first_report_to_this_leader_replays_nothing_from_before_it_led() {
        let problems = Problems::new(1000);
        let recent = vec![
            numbered("kernel-monitor", "Before", 900, 1),
            numbered("kernel-monitor", "After", 1100, 2),
            // Stamped before by a slow clock: the first report can only go by timestamps.
            numbered("custom-plugin", "Skewed", 950, 3),
        ];
        assert_eq!(read(&problems, &report(7, recent.clone())), ["After"]);
        // From then on by numbers: a problem stamped earlier still counts.
        let mut more = recent;
        more.push(numbered("custom-plugin", "Late", 990, 4));
        assert_eq!(read(&problems, &report(7, more)), ["Late"]);
    }

    #[test]
    fn an_agent_restart_starts_a_new_numbering_without_replaying_the_lookback() {
        let problems = Problems::new(100);
        let before = vec![
            numbered("kernel-monitor", "A", 1000, 1),
            numbered("custom-plugin", "B", 900, 2),
            numbered("kernel-monitor", "C", 2000, 3),
        ];
        assert_eq!(read(&problems, &report(7, before)), ["A", "B", "C"]);
        // The agent restarts (epoch 8, numbers from 1): its kernel-log reader lists A and C
        // again from the lookback window; D happened while it was down, E after it started.
        let after = vec![
            numbered("kernel-monitor", "A", 1000, 1),
            numbered("kernel-monitor", "C", 2000, 2),
            numbered("kernel-monitor", "D", 2500, 3),
            numbered("custom-plugin", "E", 3000, 4),
        ];
        assert_eq!(read(&problems, &report(8, after.clone())), ["D", "E"]);
        assert!(read(&problems, &report(8, after.clone())).is_empty());
        // Then by the new numbers again, low numbers and early stamps included.
        let mut more = after;
        more.push(numbered("custom-plugin", "F", 1500, 5));
        assert_eq!(read(&problems, &report(8, more)), ["F"]);
    }

    #[test]
    fn problems_listed_again_with_shifted_stamps_after_an_agent_restart_are_not_new() {
        let before = vec![
            numbered("kernel-monitor", "A", 1000, 1),
            numbered("custom-plugin", "B", 900, 2),
            numbered("kernel-monitor", "C", 2000, 3),
        ];
        // The restarted agent computed the boot time 3 ms later: the kernel records it lists
        // again are stamped 3 ms later; D and E are new.
        let problems = Problems::new(100);
        assert_eq!(read(&problems, &report(7, before.clone())), ["A", "B", "C"]);
        let shifted = |e: &ProblemEventView, by: i64, sequence| ProblemEventView {
            timestamp_unix_ms: e.timestamp_unix_ms + by,
            sequence,
            ..e.clone()
        };
        let later = vec![
            shifted(&before[0], 3, 1),
            shifted(&before[2], 3, 2),
            numbered("kernel-monitor", "D", 2500, 3),
            numbered("custom-plugin", "E", 3100, 4),
        ];
        assert_eq!(read(&problems, &report(8, later.clone())), ["D", "E"]);
        assert!(read(&problems, &report(8, later)).is_empty());

        // 3 ms earlier instead: D, which happened while the agent was down, is stamped before
        // the newest handled problem and is new all the same.
        let problems = Problems::new(100);
        assert_eq!(read(&problems, &report(7, before.clone())), ["A", "B", "C"]);
        let earlier = vec![
            shifted(&before[0], -3, 1),
            shifted(&before[2], -3, 2),
            numbered("kernel-monitor", "D", 1999, 3),
        ];
        assert_eq!(read(&problems, &report(8, earlier)), ["D"]);

        // A whole second later (an agent of this version after an older one): the same.
        let problems = Problems::new(100);
        assert_eq!(read(&problems, &report(7, before.clone())), ["A", "B", "C"]);
        let second = vec![
            shifted(&before[0], 1000, 1),
            shifted(&before[2], 1000, 2),
            numbered("kernel-monitor", "D", 3001, 3),
        ];
        assert_eq!(read(&problems, &report(8, second)), ["D"]);
    }

    #[test]
    fn more_problems_near_the_cursor_than_remembered_fall_back_to_timestamps() {
        let problems = Problems::new(100);
        let flood: Vec<ProblemEventView> = (0..20)
            .map(|i| numbered("kernel-monitor", &format!("P{i}"), 2000 + i, i as u64 + 1))
            .collect();
        assert_eq!(read(&problems, &report(7, flood.clone())).len(), 20);
        // Listed again unchanged after a restart: the newest 16 are known by what they say,
        // the other 4 by their stamps; none is new. The new one is.
        let mut again: Vec<ProblemEventView> = flood
            .iter()
            .enumerate()
            .map(|(i, e)| ProblemEventView {
                sequence: i as u64 + 1,
                ..e.clone()
            })
            .collect();
        again.push(numbered("kernel-monitor", "New", 2100, 21));
        assert_eq!(read(&problems, &report(8, again)), ["New"]);
    }

    #[test]
    fn an_agent_that_does_not_number_its_problems_is_read_by_timestamps() {
        let problems = Problems::new(100);
        let recent = vec![ev("A", 200), ev("B", 300)];
        assert_eq!(read(&problems, &report(0, recent.clone())), ["A", "B"]);
        assert!(read(&problems, &report(0, recent.clone())).is_empty());
        // Stamped before the newest handled: skipped, as the timestamps say.
        let mut more = recent;
        more.push(ev("Skewed", 250));
        more.push(ev("C", 400));
        assert_eq!(read(&problems, &report(0, more.clone())), ["C"]);
        // Upgraded to an agent that numbers them (a restart): by timestamps once, then numbers.
        let upgraded = vec![
            numbered("kernel-monitor", "C", 400, 1),
            numbered("kernel-monitor", "D", 500, 2),
        ];
        assert_eq!(read(&problems, &report(9, upgraded.clone())), ["D"]);
        let mut more = upgraded;
        more.push(numbered("custom-plugin", "E", 450, 3));
        assert_eq!(read(&problems, &report(9, more)), ["E"]);
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
