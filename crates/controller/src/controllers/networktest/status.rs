//! The `NetworkTest` phase machine (Pending → Running → Succeeded/Failed) and the status object it
//! produces. A transition returns a new status only when the phase changes, so the reconciler that
//! writes exactly what this returns writes status at most once per phase change.

use super::aggregate::Summary;
use super::plan::SpecError;

pub use nodekeeper_api::names::{
    CONDITION_COMPLETE, CONDITION_SPEC_VALID, REASON_AGENT_UNREACHABLE, REASON_IN_PROGRESS,
    REASON_INVALID_SPEC, REASON_NO_MATCHING_NODES,
};

/// `SpecValid` is true.
pub const REASON_VALID: &str = "Valid";
/// `Complete`: every probed pair succeeded.
pub const REASON_ALL_SUCCEEDED: &str = "AllProbesSucceeded";
/// `Complete`: some pair failed (the agents answered).
pub const REASON_PROBES_FAILED: &str = "ProbesFailed";

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
}

impl Phase {
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "Pending" => Self::Pending,
            "Running" => Self::Running,
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            _ => return None,
        })
    }
}

/// A condition as plain data; times are Unix seconds (the reconciler formats them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_unix: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TestStatus {
    pub phase: Phase,
    pub start_unix: Option<i64>,
    pub completion_unix: Option<i64>,
    pub conditions: Vec<Condition>,
    /// The bounded summary (see [`Summary::bounded`]); `None` until the test finished.
    pub summary: Option<Summary>,
}

/// What happened to the test.
#[derive(Debug, Clone)]
pub enum Event {
    /// The test was accepted but waits (e.g. for a free slot).
    Queued,
    /// Probes were sent.
    Started { sources: usize, pairs: usize },
    /// The spec cannot be run; nothing was sent.
    Rejected(SpecError),
    /// Every source answered or gave up.
    Finished(Summary),
}

/// The status after `event`, or `None` when the phase would not change (nothing to write).
pub fn transition(current: Option<&TestStatus>, event: Event, now_unix: i64) -> Option<TestStatus> {
    let phase = current.map(|s| s.phase);
    if phase.is_some_and(Phase::is_terminal) {
        return None;
    }
    let cond = |type_: &str, ok: bool, reason: &str, message: String| Condition {
        type_: type_.to_owned(),
        status: if ok { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        last_transition_unix: now_unix,
    };
    match event {
        Event::Queued => (phase.is_none()).then(|| TestStatus {
            phase: Phase::Pending,
            start_unix: None,
            completion_unix: None,
            conditions: vec![],
            summary: None,
        }),
        Event::Started { sources, pairs } => (phase != Some(Phase::Running)).then(|| TestStatus {
            phase: Phase::Running,
            start_unix: Some(now_unix),
            completion_unix: None,
            conditions: vec![
                cond(CONDITION_SPEC_VALID, true, REASON_VALID, String::new()),
                cond(
                    CONDITION_COMPLETE,
                    false,
                    REASON_IN_PROGRESS,
                    format!("probing {pairs} source→target pairs from {sources} nodes"),
                ),
            ],
            summary: None,
        }),
        Event::Rejected(err) => {
            let reason = if err.field == "spec.nodeSelector" {
                REASON_NO_MATCHING_NODES
            } else {
                REASON_INVALID_SPEC
            };
            Some(TestStatus {
                phase: Phase::Failed,
                start_unix: current.and_then(|s| s.start_unix),
                completion_unix: Some(now_unix),
                conditions: vec![
                    cond(CONDITION_SPEC_VALID, false, reason, err.to_string()),
                    cond(CONDITION_COMPLETE, true, reason, format!("not run: {err}")),
                ],
                summary: None,
            })
        }
        Event::Finished(summary) => {
            let (phase, reason, message) = verdict(&summary);
            let mut conditions = current.map(|s| s.conditions.clone()).unwrap_or_default();
            conditions.retain(|c| c.type_ != CONDITION_COMPLETE);
            if !conditions.iter().any(|c| c.type_ == CONDITION_SPEC_VALID) {
                conditions.push(cond(
                    CONDITION_SPEC_VALID,
                    true,
                    REASON_VALID,
                    String::new(),
                ));
            }
            conditions.push(cond(CONDITION_COMPLETE, true, reason, message));
            Some(TestStatus {
                phase,
                start_unix: current.and_then(|s| s.start_unix).or(Some(now_unix)),
                completion_unix: Some(now_unix),
                conditions,
                summary: Some(summary.bounded()),
            })
        }
    }
}

/// The final phase, the `Complete` condition's reason and a one-line message a user can act on.
pub fn verdict(s: &Summary) -> (Phase, &'static str, String) {
    let figures = format!(
        "{} of {} pairs from {} nodes succeeded, loss {}%",
        s.pairs - s.pairs_failed,
        s.pairs,
        s.sources,
        s.loss_percent
    );
    if s.pairs_failed == 0 && s.pairs > 0 {
        return (Phase::Succeeded, REASON_ALL_SUCCEEDED, figures);
    }
    let worst = s
        .failures
        .first()
        .map(|f| format!("; worst: {} → {}: {}", f.source, f.target_id, f.error))
        .unwrap_or_default();
    if s.sources_unreachable > 0 {
        (
            Phase::Failed,
            REASON_AGENT_UNREACHABLE,
            format!(
                "{} of {} nodes did not answer; {figures}{worst}",
                s.sources_unreachable, s.sources
            ),
        )
    } else {
        (
            Phase::Failed,
            REASON_PROBES_FAILED,
            format!("{figures}{worst}"),
        )
    }
}

/// What to do with a finished test: delete it, or look again after the given seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    Delete,
    RecheckAfter(u64),
    /// Not finished, or no TTL set.
    Keep,
}

pub fn expiry(status: Option<&TestStatus>, ttl_seconds: Option<i64>, now_unix: i64) -> Expiry {
    let (Some(done), Some(ttl)) = (status.and_then(|s| s.completion_unix), ttl_seconds) else {
        return Expiry::Keep;
    };
    let at = done.saturating_add(ttl.max(0));
    if now_unix >= at {
        Expiry::Delete
    } else {
        Expiry::RecheckAfter((at - now_unix) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::super::aggregate::FailedPair;
    use super::*;

    fn summary(pairs: u32, failed: u32, unreachable: u32) -> Summary {
        Summary {
            sources: 3,
            sources_unreachable: unreachable,
            pairs,
            pairs_failed: failed,
            success_rate_percent: 0.0,
            sent: 0,
            received: 0,
            loss_percent: 25.0,
            latency: None,
            path_mtu_min: None,
            targets: vec![],
            targets_omitted: 0,
            failures: (0..failed)
                .map(|i| FailedPair {
                    source: format!("n{i}"),
                    target_id: "hole".into(),
                    sent: 3,
                    received: 0,
                    loss_percent: 100.0,
                    error: "no echo reply before the timeout".into(),
                })
                .collect(),
            failures_omitted: 0,
        }
    }

    /// Drives a whole test and counts the statuses that would be written.
    #[test]
    fn at_most_one_write_per_phase_change() {
        let mut status: Option<TestStatus> = None;
        let mut writes = 0;
        let events = [
            Event::Queued,
            Event::Queued,
            Event::Started {
                sources: 3,
                pairs: 9,
            },
            // A restarted controller re-runs the probes of a Running test: no write.
            Event::Started {
                sources: 3,
                pairs: 9,
            },
            Event::Finished(summary(9, 1, 0)),
            Event::Finished(summary(9, 0, 0)),
            Event::Rejected(SpecError {
                field: "spec.count".into(),
                reason: "x".into(),
            }),
        ];
        for (t, e) in events.into_iter().enumerate() {
            if let Some(next) = transition(status.as_ref(), e, 1000 + t as i64) {
                writes += 1;
                status = Some(next);
            }
        }
        assert_eq!(writes, 3);
        let s = status.unwrap();
        assert_eq!(s.phase, Phase::Failed);
        assert_eq!((s.start_unix, s.completion_unix), (Some(1002), Some(1004)));
        let complete = s
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_COMPLETE)
            .unwrap();
        assert_eq!(complete.reason, REASON_PROBES_FAILED);
        assert!(
            complete
                .message
                .contains("8 of 9 pairs from 3 nodes succeeded"),
            "{}",
            complete.message
        );
        assert!(
            complete.message.contains("worst: n0 → hole"),
            "{}",
            complete.message
        );
        assert_eq!(
            s.conditions
                .iter()
                .filter(|c| c.type_ == CONDITION_COMPLETE)
                .count(),
            1
        );
    }

    #[test]
    fn rejection_names_the_field() {
        let err = SpecError {
            field: "spec.targets[3].url".into(),
            reason: "scheme \"ftp\" is not supported".into(),
        };
        let s = transition(None, Event::Rejected(err), 5).unwrap();
        assert_eq!(s.phase, Phase::Failed);
        let c = s
            .conditions
            .iter()
            .find(|c| c.type_ == CONDITION_SPEC_VALID)
            .unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", REASON_INVALID_SPEC)
        );
        assert_eq!(
            c.message,
            "spec.targets[3].url: scheme \"ftp\" is not supported"
        );
        let none = SpecError {
            field: "spec.nodeSelector".into(),
            reason: "matches no nodes".into(),
        };
        let s = transition(None, Event::Rejected(none), 5).unwrap();
        assert_eq!(s.conditions[0].reason, REASON_NO_MATCHING_NODES);
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(&summary(9, 0, 0)).0, Phase::Succeeded);
        assert_eq!(verdict(&summary(9, 3, 1)).1, REASON_AGENT_UNREACHABLE);
        assert_eq!(
            verdict(&summary(0, 0, 0)).0,
            Phase::Failed,
            "a test that probed nothing did not succeed"
        );
    }

    #[test]
    fn ttl() {
        let done = transition(None, Event::Finished(summary(1, 0, 0)), 100).unwrap();
        assert_eq!(expiry(Some(&done), Some(60), 130), Expiry::RecheckAfter(30));
        assert_eq!(expiry(Some(&done), Some(60), 160), Expiry::Delete);
        assert_eq!(expiry(Some(&done), None, 10_000), Expiry::Keep);
        let running = transition(
            None,
            Event::Started {
                sources: 1,
                pairs: 1,
            },
            100,
        )
        .unwrap();
        assert_eq!(expiry(Some(&running), Some(0), 10_000), Expiry::Keep);
    }
}
