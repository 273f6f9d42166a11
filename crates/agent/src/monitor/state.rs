//! What the problem monitors found, in one bounded place the report reads: the current
//! permanent conditions, counts of problems by reason (temporary problems and conditions turning
//! True, as NPD's `problem_counter`), the latest few temporary problems, and the rules, files
//! and plugins that were refused.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use nodekeeper_model::text::truncate;
use serde::Deserialize;

/// At most this many distinct temporary-problem reasons are counted; further reasons are
/// counted under [`OTHER_REASON`]. Reasons come from rule files, so this only bites on a
/// configuration with an absurd number of rules, but nothing here may grow without bound.
pub const MAX_REASONS: usize = 128;
/// The counter reasons beyond [`MAX_REASONS`] fall into.
pub const OTHER_REASON: &str = "Other";
/// Latest temporary problems kept (the Event-worthy records the controller may turn into Events).
pub const MAX_RECENT: usize = 32;
/// Refusals kept; more are counted but not listed.
pub const MAX_REFUSALS: usize = 64;
/// Conditions kept (one per condition type across all rule files).
pub const MAX_CONDITIONS: usize = 64;
/// Messages are cut to this many bytes (at a character boundary, `…` appended).
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// Condition status with node-problem-detector's polarity: `True` means the problem is present.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConditionStatus {
    False,
    True,
    Unknown,
}

impl ConditionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::False => "False",
            ConditionStatus::True => "True",
            ConditionStatus::Unknown => "Unknown",
        }
    }
}

/// NPD's `type` of a rule: a temporary problem becomes an Event, a permanent one a condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleType {
    Temporary,
    Permanent,
}

/// One entry of NPD's `conditions[]`: a condition type and its healthy (`False`) reason and message.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ConditionDefault {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
}

/// A condition as it stands now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub kind: String,
    pub status: ConditionStatus,
    pub reason: String,
    pub message: String,
    /// The rule file (`source`) that owns the condition.
    pub source: String,
    pub transition: SystemTime,
}

/// A temporary problem (NPD emits these as Warning Events).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub source: String,
    pub reason: String,
    pub message: String,
    pub timestamp: SystemTime,
    /// The order it was recorded in: 1, 2, 3, … within the state's `sequence_epoch`.
    pub sequence: u64,
}

/// A rule, rule file or plugin that does not run, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The file (or built-in name) it came from.
    pub origin: String,
    /// Which part: `rules[3]`, `plugin`, …; empty for the whole file.
    pub item: String,
    pub reason: String,
}

/// Everything the monitors found; cheap to clone for a report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProblemState {
    conditions: BTreeMap<String, Condition>,
    counters: BTreeMap<String, u64>,
    recent: VecDeque<Problem>,
    refusals: Vec<Refusal>,
    refusals_dropped: u64,
    /// Kernel-log records lost before the monitor read them (sequence gaps, ring overruns).
    lost_records: u64,
    /// Which numbering [`Problem::sequence`] belongs to: drawn once per agent process (see
    /// [`Self::new_shared`]); 0 only in a state made for a test.
    sequence_epoch: u64,
    /// The sequence number of the latest problem recorded; 0 before the first.
    sequence: u64,
    /// Bumped on every change, so a reader can tell cheaply whether anything moved.
    revision: u64,
}

/// The state shared between the monitor tasks and the report.
pub type SharedState = Arc<Mutex<ProblemState>>;

/// Locks the shared state; a panic in another holder leaves plain data behind, which stays usable.
pub fn lock(state: &SharedState) -> std::sync::MutexGuard<'_, ProblemState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ProblemState {
    /// The agent process's state, its problems numbered under a new random epoch. A restart
    /// starts a new numbering rather than continuing the old one (which is not kept): the
    /// recent problems are not kept either, and the restarted monitors read their logs'
    /// lookback window again, so problems listed before the restart can be listed again, and
    /// numbers that continued would make them look new. The epoch tells the controller that
    /// this happened.
    pub fn new_shared() -> SharedState {
        Arc::new(Mutex::new(ProblemState::with_epoch(rand::random_range(
            1..=u64::MAX,
        ))))
    }

    /// An empty state whose problems are numbered under `sequence_epoch`.
    pub fn with_epoch(sequence_epoch: u64) -> ProblemState {
        ProblemState {
            sequence_epoch,
            ..ProblemState::default()
        }
    }

    /// Declares a condition with its healthy default (status `False`), as NPD does at start.
    /// A condition already declared keeps its state (two files naming the same type share it).
    pub fn declare(&mut self, source: &str, default: &ConditionDefault, now: SystemTime) {
        if self.conditions.contains_key(&default.kind) {
            return;
        }
        if self.conditions.len() >= MAX_CONDITIONS {
            self.refuse(
                source,
                &format!("conditions[{}]", default.kind),
                &format!("more than {MAX_CONDITIONS} condition types in all rule files"),
            );
            return;
        }
        self.conditions.insert(
            default.kind.clone(),
            Condition {
                kind: default.kind.clone(),
                status: ConditionStatus::False,
                reason: default.reason.clone(),
                message: truncate(&default.message, MAX_MESSAGE_BYTES).into_owned(),
                source: source.to_owned(),
                transition: now,
            },
        );
        self.revision += 1;
    }

    /// Sets a declared condition. As in NPD, the message (and transition time) change only
    /// when the status or the reason changes, so a message that carries a drifting value
    /// cannot cause a write per drift. Returns whether anything changed.
    pub fn set_condition(
        &mut self,
        kind: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
        at: SystemTime,
    ) -> bool {
        let Some(condition) = self.conditions.get_mut(kind) else {
            return false;
        };
        if condition.status == status && condition.reason == reason {
            return false;
        }
        condition.status = status;
        condition.reason = reason.to_owned();
        condition.message = truncate(message, MAX_MESSAGE_BYTES).into_owned();
        condition.transition = at;
        self.revision += 1;
        // NPD counts a condition turning into a problem under its reason, as it counts events.
        if status == ConditionStatus::True {
            *self.counter_slot(reason) += 1;
        }
        true
    }

    /// Sets a declared condition `True` as it was kept before an agent restart: its reason,
    /// message and transition time, without counting it again (it was counted when it turned
    /// True). Returns whether anything changed.
    pub fn restore_condition(
        &mut self,
        kind: &str,
        reason: &str,
        message: &str,
        transition: SystemTime,
    ) -> bool {
        let Some(condition) = self.conditions.get_mut(kind) else {
            return false;
        };
        if condition.status == ConditionStatus::True {
            return false;
        }
        condition.status = ConditionStatus::True;
        condition.reason = reason.to_owned();
        condition.message = truncate(message, MAX_MESSAGE_BYTES).into_owned();
        condition.transition = transition;
        self.revision += 1;
        true
    }

    /// The counter for `reason`, or [`OTHER_REASON`]'s when [`MAX_REASONS`] are taken.
    fn counter_slot(&mut self, reason: &str) -> &mut u64 {
        let key = if self.counters.contains_key(reason) || self.counters.len() < MAX_REASONS {
            reason
        } else {
            OTHER_REASON
        };
        self.counters.entry(key.to_owned()).or_default()
    }

    /// Starts a reason's counter at 0, so that `problem_counter` has the series before the
    /// first problem (as NPD initialises it for every rule).
    pub fn init_counter(&mut self, reason: &str) {
        if !self.counters.contains_key(reason) && self.counters.len() < MAX_REASONS {
            self.counters.insert(reason.to_owned(), 0);
            self.revision += 1;
        }
    }

    /// Like [`Self::set_condition`] but also replaces the message of an unchanged condition
    /// (NPD's `enable_message_change_based_condition_update`, off by default).
    pub fn set_condition_message(&mut self, kind: &str, message: &str) -> bool {
        let Some(condition) = self.conditions.get_mut(kind) else {
            return false;
        };
        let message = truncate(message, MAX_MESSAGE_BYTES);
        if condition.message == message {
            return false;
        }
        condition.message = message.into_owned();
        self.revision += 1;
        true
    }

    /// Records a temporary problem: counted by reason (bounded) and kept among the latest few,
    /// numbered next. `at` is by the source's clock; the number is what orders the problems, as
    /// the sources' clocks need not agree (the list is in recording order, so in number order).
    pub fn record(&mut self, source: &str, reason: &str, message: &str, at: SystemTime) {
        *self.counter_slot(reason) += 1;
        if self.recent.len() == MAX_RECENT {
            self.recent.pop_front();
        }
        self.sequence += 1;
        self.recent.push_back(Problem {
            source: source.to_owned(),
            reason: reason.to_owned(),
            message: truncate(message, MAX_MESSAGE_BYTES).into_owned(),
            timestamp: at,
            sequence: self.sequence,
        });
        self.revision += 1;
    }

    /// Lists something that does not run, with the reason (bounded; later ones are counted).
    pub fn refuse(&mut self, origin: &str, item: &str, reason: &str) {
        tracing::warn!(origin, item, reason, "monitor rule refused");
        if self.refusals.len() >= MAX_REFUSALS {
            self.refusals_dropped += 1;
        } else {
            self.refusals.push(Refusal {
                origin: origin.to_owned(),
                item: item.to_owned(),
                reason: truncate(reason, MAX_MESSAGE_BYTES).into_owned(),
            });
        }
        self.revision += 1;
    }

    /// Makes `reason` the one refusal of `origin` (replacing the previous ones), unless it is
    /// that already: a reader retrying on the same error lists and logs it once, not per retry.
    /// Returns whether it was new.
    pub fn refuse_once(&mut self, origin: &str, reason: &str) -> bool {
        let kept = truncate(reason, MAX_MESSAGE_BYTES);
        let mine: Vec<&Refusal> = self
            .refusals
            .iter()
            .filter(|r| r.origin == origin)
            .collect();
        if let [only] = mine.as_slice()
            && only.item.is_empty()
            && only.reason == kept
        {
            return false;
        }
        self.clear_refusals(origin);
        self.refuse(origin, "", reason);
        true
    }

    /// Removes the refusals of one origin (a file that is loaded again).
    pub fn clear_refusals(&mut self, origin: &str) {
        let before = self.refusals.len();
        self.refusals.retain(|r| r.origin != origin);
        if self.refusals.len() != before {
            self.revision += 1;
        }
    }

    pub fn add_lost(&mut self, n: u64) {
        if n > 0 {
            self.lost_records += n;
            self.revision += 1;
        }
    }

    /// The content as text for the report's revision: everything but times (a condition
    /// declared again after a restart is the same content) and the internal revision.
    pub fn fingerprint(&self, out: &mut String) {
        use std::fmt::Write as _;
        for c in self.conditions.values() {
            let _ = writeln!(
                out,
                "pc {} {:?} {} {:?}",
                c.kind, c.status, c.reason, c.message
            );
        }
        for (reason, n) in &self.counters {
            let _ = writeln!(out, "pn {reason} {n}");
        }
        for p in &self.recent {
            let _ = writeln!(out, "pe {} {} {:?}", p.source, p.reason, p.message);
        }
        for r in &self.refusals {
            let _ = writeln!(out, "pr {} {} {:?}", r.origin, r.item, r.reason);
        }
        let _ = writeln!(out, "pl {} {}", self.refusals_dropped, self.lost_records);
    }

    pub fn condition(&self, kind: &str) -> Option<&Condition> {
        self.conditions.get(kind)
    }
    pub fn conditions(&self) -> impl Iterator<Item = &Condition> {
        self.conditions.values()
    }
    pub fn counter(&self, reason: &str) -> u64 {
        self.counters.get(reason).copied().unwrap_or(0)
    }
    pub fn counters(&self) -> &BTreeMap<String, u64> {
        &self.counters
    }
    pub fn recent(&self) -> impl Iterator<Item = &Problem> {
        self.recent.iter()
    }
    pub fn refusals(&self) -> &[Refusal] {
        &self.refusals
    }
    pub fn refusals_dropped(&self) -> u64 {
        self.refusals_dropped
    }
    pub fn lost_records(&self) -> u64 {
        self.lost_records
    }
    pub fn sequence_epoch(&self) -> u64 {
        self.sequence_epoch
    }
    pub fn revision(&self) -> u64 {
        self.revision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default(kind: &str) -> ConditionDefault {
        ConditionDefault {
            kind: kind.into(),
            reason: format!("No{kind}"),
            message: "fine".into(),
        }
    }

    #[test]
    fn message_changes_only_with_status_or_reason() {
        let mut s = ProblemState::default();
        let t = SystemTime::UNIX_EPOCH;
        s.declare("k", &default("KernelDeadlock"), t);
        assert!(s.set_condition(
            "KernelDeadlock",
            ConditionStatus::True,
            "DockerHung",
            "a 120",
            t
        ));
        let rev = s.revision();
        assert!(!s.set_condition(
            "KernelDeadlock",
            ConditionStatus::True,
            "DockerHung",
            "a 240",
            t
        ));
        assert_eq!(s.revision(), rev);
        assert_eq!(s.condition("KernelDeadlock").unwrap().message, "a 120");
        assert!(!s.set_condition("Undeclared", ConditionStatus::True, "X", "m", t));
    }

    #[test]
    fn counters_and_recent_are_bounded() {
        let mut s = ProblemState::default();
        let t = SystemTime::UNIX_EPOCH;
        for i in 0..(MAX_REASONS + 10) {
            s.record("src", &format!("R{i}"), &"x".repeat(5000), t);
        }
        assert_eq!(s.counters().len(), MAX_REASONS + 1);
        assert_eq!(s.counter(OTHER_REASON), 10);
        assert_eq!(s.recent().count(), MAX_RECENT);
        assert!(
            s.recent()
                .all(|p| p.message.len() == MAX_MESSAGE_BYTES + '…'.len_utf8())
        );
        for i in 0..(MAX_REFUSALS + 3) {
            s.refuse("f", &format!("rules[{i}]"), "bad");
        }
        assert_eq!(s.refusals().len(), MAX_REFUSALS);
        assert_eq!(s.refusals_dropped(), 3);
    }

    #[test]
    fn problems_are_numbered_in_recording_order_whatever_their_timestamps() {
        let mut s = ProblemState::with_epoch(7);
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000);
        s.record("kernel-monitor", "OOMKilling", "a", t);
        // A plugin's problem stamped earlier by its clock, recorded later.
        s.record(
            "plugin",
            "Custom",
            "b",
            t - std::time::Duration::from_secs(5),
        );
        let numbers: Vec<u64> = s.recent().map(|p| p.sequence).collect();
        assert_eq!(numbers, [1, 2]);
        for i in 0..MAX_RECENT {
            s.record("kernel-monitor", "OOMKilling", &format!("c{i}"), t);
        }
        let numbers: Vec<u64> = s.recent().map(|p| p.sequence).collect();
        // The two first fell out of the bounded list; the numbers go on from where they were.
        assert_eq!(numbers, (3..=MAX_RECENT as u64 + 2).collect::<Vec<_>>());
        assert_eq!(s.sequence_epoch(), 7);
        let a = lock(&ProblemState::new_shared()).sequence_epoch();
        let b = lock(&ProblemState::new_shared()).sequence_epoch();
        assert!(a != 0 && b != 0 && a != b, "{a} {b}");
    }
}
