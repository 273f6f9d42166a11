//! What a NodeDiagnostic's status says at each step, as plain functions: refused (the field named),
//! running (nodes listed; then, at most every [`PROGRESS_EVERY`], the nodes done so far), finished (per-node outcome, counts, conditions), and when a finished one
//! expires. The reconciler writes a status only when the function's answer differs from the
//! current one.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nodekeeper_api::crd::node_diagnostic::{NodeBundle, NodeDiagnosticStatus, Phase};
use nodekeeper_api::crd::{ConditionStatus, FieldError, set_condition};
use nodekeeper_api::names::{
    CONDITION_COMPLETE, CONDITION_SPEC_VALID, REASON_DONE, REASON_IN_PROGRESS, REASON_INVALID_SPEC,
    REASON_NO_MATCHING_NODES,
};
use nodekeeper_model::diagnostics::MAX_NODES;

/// Condition type: whether the controller's disk had room for the bundles.
pub const CONDITION_STORAGE_AVAILABLE: &str = "StorageAvailable";
/// Some node's bundle could not be collected.
pub const REASON_NODES_FAILED: &str = "NodesFailed";
/// Older bundles were evicted to make room.
pub const REASON_EVICTED: &str = "OlderBundlesEvicted";
/// Condition type: whether every stored bundle can still be downloaded.
pub const CONDITION_BUNDLES_AVAILABLE: &str = "BundlesAvailable";
/// Some stored bundles are gone (evicted, or not on the controller serving downloads).
pub const REASON_BUNDLES_GONE: &str = "BundlesGone";
/// A bundle was refused for lack of room.
pub const REASON_STORE_FULL: &str = "StoreFull";
/// Every bundle fit.
pub const REASON_ROOM: &str = "Room";

/// At most this many bytes of a node's reason are kept (the schema allows 1024).
const MAX_REASON: usize = 1000;

/// A collection writes the outcomes of the nodes done so far into its Running status at most
/// this often (and only when some node finished since): bounded writes, a live count for
/// whoever waits (`kubectl nodekeeper diag`).
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

pub fn rfc3339(unix: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(unix)).to_string()
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The controller HTTP API path of a bundle: the last segment is its download token, so only
/// those who can read the NodeDiagnostic's status learn it (see [`super::store`]).
pub fn download_path(ns: &str, name: &str, node: &str, token: &str) -> String {
    format!("/api/diagnostics/{ns}/{name}/{node}/{token}")
}

/// A selector may match at most [`MAX_NODES`]; `matched` is how many it matched (the list is cut
/// at `MAX_NODES + 1`, so a larger number is never read).
pub fn check_selection(matched: usize) -> Result<(), FieldError> {
    if matched > MAX_NODES {
        return Err(FieldError::new(
            "spec.nodeSelector",
            format!(
                "matches more than {MAX_NODES} nodes; narrow the selector (at most {MAX_NODES} \
                 nodes per NodeDiagnostic) or name one node with spec.nodeName"
            ),
        ));
    }
    Ok(())
}

/// The generation and time every condition set in one step carries.
struct Stamp {
    generation: Option<i64>,
    now: String,
}

impl Stamp {
    fn set(
        &self,
        s: &mut NodeDiagnosticStatus,
        type_: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
    ) {
        set_condition(
            &mut s.conditions,
            type_,
            status,
            reason,
            message,
            self.generation,
            &self.now,
        );
    }
}

/// A node's entry with no bundle (yet).
pub fn without_bundle(node: &str, phase: Phase, reason: String) -> NodeBundle {
    NodeBundle {
        node: node.to_owned(),
        phase,
        size_bytes: 0,
        sha256: String::new(),
        download_path: String::new(),
        reason,
    }
}

/// A fresh status keeping `prev`'s conditions, and the stamp for the conditions set now.
fn base(
    prev: Option<&NodeDiagnosticStatus>,
    generation: Option<i64>,
    now: u64,
) -> (NodeDiagnosticStatus, Stamp) {
    let status = NodeDiagnosticStatus {
        conditions: prev.map(|p| p.conditions.clone()).unwrap_or_default(),
        observed_generation: generation,
        ..NodeDiagnosticStatus::default()
    };
    let stamp = Stamp {
        generation,
        now: rfc3339(now),
    };
    (status, stamp)
}

/// The spec was refused: Failed, `SpecValid=False` naming the field.
pub fn refused(
    prev: Option<&NodeDiagnosticStatus>,
    error: &FieldError,
    generation: Option<i64>,
    now: u64,
) -> NodeDiagnosticStatus {
    let (mut s, stamp) = base(prev, generation, now);
    s.phase = Some(Phase::Failed);
    s.completion_time = Some(
        prev.and_then(|p| p.completion_time.clone())
            .unwrap_or(stamp.now.clone()),
    );
    let message = error.to_string();
    stamp.set(
        &mut s,
        CONDITION_SPEC_VALID,
        ConditionStatus::False,
        REASON_INVALID_SPEC,
        &message,
    );
    stamp.set(
        &mut s,
        CONDITION_COMPLETE,
        ConditionStatus::True,
        REASON_INVALID_SPEC,
        &message,
    );
    s
}

/// Collection started for `nodes`.
pub fn running(
    prev: Option<&NodeDiagnosticStatus>,
    nodes: &[String],
    generation: Option<i64>,
    now: u64,
) -> NodeDiagnosticStatus {
    let (mut s, stamp) = base(prev, generation, now);
    s.phase = Some(Phase::Running);
    s.node_count = u32::try_from(nodes.len()).unwrap_or(u32::MAX);
    s.nodes = nodes
        .iter()
        .take(MAX_NODES)
        .map(|n| without_bundle(n, Phase::Running, String::new()))
        .collect();
    stamp.set(
        &mut s,
        CONDITION_SPEC_VALID,
        ConditionStatus::True,
        REASON_DONE,
        "",
    );
    stamp.set(
        &mut s,
        CONDITION_COMPLETE,
        ConditionStatus::False,
        REASON_IN_PROGRESS,
        "",
    );
    s
}

/// `running` with the outcome of each node in `done` in place of its Running entry; still
/// Running, the counts so far.
pub fn progress(running: &NodeDiagnosticStatus, done: &[NodeBundle]) -> NodeDiagnosticStatus {
    let mut s = running.clone();
    for entry in &mut s.nodes {
        if let Some(outcome) = done.iter().find(|d| d.node == entry.node) {
            entry.clone_from(outcome);
            entry.reason = nodekeeper_model::text::truncate(&entry.reason, MAX_REASON).into_owned();
        }
    }
    s.failed_count =
        u32::try_from(done.iter().filter(|n| n.phase == Phase::Failed).count()).unwrap_or(u32::MAX);
    s
}

/// How the store fared while collecting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Storage {
    /// Bundles of other NodeDiagnostics evicted (`<ns>/<name>/<node>`).
    pub evicted: Vec<String>,
    /// A bundle was refused: the message.
    pub full: Option<String>,
}

/// Every node has an outcome.
pub fn finished(
    prev: Option<&NodeDiagnosticStatus>,
    mut nodes: Vec<NodeBundle>,
    storage: &Storage,
    generation: Option<i64>,
    now: u64,
) -> NodeDiagnosticStatus {
    let (mut s, stamp) = base(prev, generation, now);
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    for n in &mut nodes {
        n.reason = nodekeeper_model::text::truncate(&n.reason, MAX_REASON).into_owned();
    }
    s.node_count = u32::try_from(nodes.len()).unwrap_or(u32::MAX);
    s.failed_count = u32::try_from(nodes.iter().filter(|n| n.phase != Phase::Succeeded).count())
        .unwrap_or(u32::MAX);
    let (phase, reason, message) = if nodes.is_empty() {
        (
            Phase::Failed,
            REASON_NO_MATCHING_NODES,
            "the spec selects no node".to_owned(),
        )
    } else if s.failed_count > 0 {
        (
            Phase::Failed,
            REASON_NODES_FAILED,
            format!(
                "{} of {} nodes failed; see nodes[].reason",
                s.failed_count, s.node_count
            ),
        )
    } else {
        (
            Phase::Succeeded,
            REASON_DONE,
            format!("{} bundles stored", s.node_count),
        )
    };
    s.phase = Some(phase);
    s.nodes = nodes.into_iter().take(MAX_NODES).collect();
    s.completion_time = Some(stamp.now.clone());
    stamp.set(
        &mut s,
        CONDITION_SPEC_VALID,
        ConditionStatus::True,
        REASON_DONE,
        "",
    );
    stamp.set(
        &mut s,
        CONDITION_COMPLETE,
        ConditionStatus::True,
        reason,
        &message,
    );
    let (status, reason, message) = match (&storage.full, storage.evicted.len()) {
        (Some(full), _) => (ConditionStatus::False, REASON_STORE_FULL, full.clone()),
        (None, 0) => (ConditionStatus::True, REASON_ROOM, String::new()),
        (None, n) => (
            ConditionStatus::False,
            REASON_EVICTED,
            format!(
                "{n} older bundles were evicted to make room (first: {}); raise \
                 --diagnostics-max-bytes or delete finished NodeDiagnostics",
                storage.evicted[0]
            ),
        ),
    };
    stamp.set(
        &mut s,
        CONDITION_STORAGE_AVAILABLE,
        status,
        reason,
        &message,
    );
    s
}

/// A finished status after the bundles of `gone` (node, why) disappeared from the store: each
/// such node keeps its outcome, size and checksum but loses its download path and says why, and
/// `BundlesAvailable=False` counts them. Nodes already marked are left as they are, so the same
/// answer twice writes nothing.
pub fn bundles_gone(
    prev: &NodeDiagnosticStatus,
    gone: &[(String, &str)],
    now: u64,
) -> NodeDiagnosticStatus {
    let mut s = prev.clone();
    for n in &mut s.nodes {
        if n.download_path.is_empty() {
            continue;
        }
        if let Some((_, why)) = gone.iter().find(|(node, _)| *node == n.node) {
            n.download_path.clear();
            n.reason = nodekeeper_model::text::truncate(why, MAX_REASON).into_owned();
        }
    }
    let missing = s
        .nodes
        .iter()
        .filter(|n| n.phase == Phase::Succeeded && n.download_path.is_empty())
        .count();
    if missing > 0 {
        let stamp = Stamp {
            generation: prev.observed_generation,
            now: rfc3339(now),
        };
        let message = format!(
            "{missing} of {} collected bundles can no longer be downloaded; see nodes[].reason",
            s.node_count
        );
        stamp.set(
            &mut s,
            CONDITION_BUNDLES_AVAILABLE,
            ConditionStatus::False,
            REASON_BUNDLES_GONE,
            &message,
        );
    }
    s
}

/// Whether the status is final.
pub fn is_terminal(s: Option<&NodeDiagnosticStatus>) -> bool {
    matches!(
        s.and_then(|s| s.phase),
        Some(Phase::Succeeded | Phase::Failed)
    )
}

/// What to do with a finished NodeDiagnostic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    Delete,
    RecheckAfter(Duration),
}

pub fn expiry(s: &NodeDiagnosticStatus, ttl_seconds: u32, now: u64) -> Expiry {
    let finished = s
        .completion_time
        .as_deref()
        .and_then(|t| humantime::parse_rfc3339(t).ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(now, |d| d.as_secs());
    let due = finished.saturating_add(u64::from(ttl_seconds));
    if now >= due {
        Expiry::Delete
    } else {
        Expiry::RecheckAfter(Duration::from_secs(due - now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle(node: &str, phase: Phase) -> NodeBundle {
        NodeBundle {
            node: node.into(),
            phase,
            size_bytes: 1,
            sha256: String::new(),
            download_path: String::new(),
            reason: if phase == Phase::Failed {
                "x".repeat(5000)
            } else {
                String::new()
            },
        }
    }

    fn condition<'a>(s: &'a NodeDiagnosticStatus, t: &str) -> &'a nodekeeper_api::crd::Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn progress_shows_the_nodes_done_so_far_and_stays_running() {
        let nodes = ["n1".to_string(), "n2".to_string(), "n3".to_string()];
        let running = running(None, &nodes, Some(1), 100);
        let s = progress(
            &running,
            &[bundle("n2", Phase::Succeeded), bundle("n3", Phase::Failed)],
        );
        assert_eq!(s.phase, Some(Phase::Running));
        assert_eq!((s.node_count, s.failed_count), (3, 1));
        let phases: Vec<_> = s.nodes.iter().map(|n| (n.node.as_str(), n.phase)).collect();
        assert_eq!(
            phases,
            [
                ("n1", Phase::Running),
                ("n2", Phase::Succeeded),
                ("n3", Phase::Failed)
            ]
        );
        assert!(s.nodes[2].reason.len() <= MAX_REASON + 3);
        assert_eq!(s.conditions, running.conditions);
        assert_eq!(progress(&running, &[]), running);
    }

    #[test]
    fn a_gone_bundle_loses_its_download_path_once_and_says_why() {
        let run = running(None, &["a".into(), "b".into()], Some(1), 100);
        let mut ok = bundle("a", Phase::Succeeded);
        ok.download_path = download_path("ns", "d", "a", "t1");
        let mut other = bundle("b", Phase::Succeeded);
        other.download_path = download_path("ns", "d", "b", "t2");
        let done = finished(
            Some(&run),
            vec![ok, other],
            &Storage::default(),
            Some(1),
            200,
        );
        assert!(
            done.conditions
                .iter()
                .all(|c| c.type_ != CONDITION_BUNDLES_AVAILABLE)
        );
        let gone = bundles_gone(&done, &[("a".into(), "evicted")], 300);
        assert_eq!(gone.nodes[0].download_path, "");
        assert_eq!(gone.nodes[0].reason, "evicted");
        assert_eq!(gone.nodes[0].phase, Phase::Succeeded);
        assert_eq!(
            gone.nodes[1].download_path,
            download_path("ns", "d", "b", "t2")
        );
        let c = condition(&gone, CONDITION_BUNDLES_AVAILABLE);
        assert_eq!(c.status, ConditionStatus::False);
        assert!(c.message.starts_with("1 of 2"), "{}", c.message);
        // Asked again (a later reconcile finds the same file missing): nothing changes.
        assert_eq!(
            bundles_gone(&gone, &[("a".into(), "other words")], 400),
            gone
        );
    }

    #[test]
    fn selection_above_the_cap_is_refused_naming_the_field() {
        assert!(check_selection(MAX_NODES).is_ok());
        let err = check_selection(MAX_NODES + 1).unwrap_err();
        assert_eq!(err.field, "spec.nodeSelector");
        assert!(err.message.contains("more than 50 nodes"), "{err}");
    }

    #[test]
    fn one_failed_node_fails_the_collection_and_the_others_keep_their_bundles() {
        let run = running(None, &["b".into(), "a".into()], Some(1), 100);
        assert_eq!(run.phase, Some(Phase::Running));
        let done = finished(
            Some(&run),
            vec![bundle("b", Phase::Failed), bundle("a", Phase::Succeeded)],
            &Storage::default(),
            Some(1),
            200,
        );
        assert_eq!(done.phase, Some(Phase::Failed));
        assert_eq!((done.node_count, done.failed_count), (2, 1));
        assert_eq!(done.nodes[0].node, "a");
        assert!(done.nodes[1].reason.len() <= MAX_REASON + 3);
        assert_eq!(
            condition(&done, CONDITION_COMPLETE).reason,
            REASON_NODES_FAILED
        );
        assert_eq!(
            condition(&done, CONDITION_STORAGE_AVAILABLE).status,
            ConditionStatus::True
        );
        // Same input, same status: the reconciler writes nothing the second time.
        let again = finished(
            Some(&done),
            done.nodes.clone(),
            &Storage::default(),
            Some(1),
            200,
        );
        assert_eq!(again, done);
    }

    #[test]
    fn storage_trouble_is_a_condition() {
        let storage = Storage {
            evicted: vec!["ns/old/n1".into()],
            full: None,
        };
        let s = finished(None, vec![bundle("a", Phase::Succeeded)], &storage, None, 1);
        assert_eq!(s.phase, Some(Phase::Succeeded));
        let c = condition(&s, CONDITION_STORAGE_AVAILABLE);
        assert_eq!(
            (c.status, c.reason.as_str()),
            (ConditionStatus::False, REASON_EVICTED)
        );
        assert!(c.message.contains("ns/old/n1"));
    }

    #[test]
    fn refused_and_expiry() {
        let s = refused(
            None,
            &FieldError::new("spec.parts[0]", "unknown part"),
            Some(1),
            10,
        );
        assert_eq!(s.phase, Some(Phase::Failed));
        assert!(
            condition(&s, CONDITION_SPEC_VALID)
                .message
                .starts_with("spec.parts[0]")
        );
        assert_eq!(
            expiry(&s, 60, 30),
            Expiry::RecheckAfter(Duration::from_secs(40))
        );
        assert_eq!(expiry(&s, 60, 70), Expiry::Delete);
        assert!(is_terminal(Some(&s)));
    }
}
