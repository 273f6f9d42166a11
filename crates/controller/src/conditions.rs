//! Node conditions owned by nodekeeper: what they should say for an observation
//! ([`desired_conditions`]), whether that differs from what is on the Node ([`changed`]), and the
//! server-side-apply body that writes them ([`apply_body`]). Plain functions over plain data.
//!
//! The write budget rests on [`changed`]: a Node is patched only when the status, reason or
//! message of one of our conditions differs from what the Node already carries, so a steady
//! fleet costs no writes at all. Messages therefore never carry values that drift with time
//! (temperatures, timestamps, counters); they name rules, GPUs and states.

use std::collections::BTreeMap;
use std::time::Duration;

use nodekeeper_api::names;
use nodekeeper_model::tuning::{Features, format_duration};
use serde_json::json;

use crate::view::{NodeView, Verdict};

/// Field manager of the condition patches (server-side apply on `nodes/status`).
pub const FIELD_MANAGER: &str = names::MANAGER_NODE_CONDITIONS;

/// The agent answers.
pub const REACHABLE: &str = names::NODE_CONDITION_REACHABLE;
/// Every tunable rule is satisfied.
pub const TUNABLES_IN_BOUNDS: &str = names::NODE_CONDITION_TUNABLES_IN_BOUNDS;
/// Every GPU reports healthy (set only on nodes with GPUs).
pub const GPU_HEALTHY: &str = names::NODE_CONDITION_GPU_HEALTHY;
/// nodekeeper-managed host networking is applied and has not drifted (set only on nodes with it).
pub const NETWORK_READY: &str = names::NODE_CONDITION_NETWORK_READY;

/// Every condition type this module writes; others on the Node are not ours and never touched.
pub const OWNED_TYPES: [&str; 4] = [REACHABLE, TUNABLES_IN_BOUNDS, GPU_HEALTHY, NETWORK_READY];

/// Condition reasons (PascalCase).
pub mod reason {
    pub const AGENT_REACHABLE: &str = "AgentReachable";
    pub const AGENT_UNREACHABLE: &str = nodekeeper_api::names::REASON_AGENT_UNREACHABLE;
    pub const AGENT_CERTIFICATE_REJECTED: &str = "AgentCertificateRejected";
    pub const AGENT_REPLY_INVALID: &str = "AgentReplyInvalid";
    pub const NO_RULES: &str = "NoRules";
    pub const TUNABLES_IN_BOUNDS: &str = "TunablesInBounds";
    pub const TUNABLES_OUT_OF_BOUNDS: &str = "TunablesOutOfBounds";
    pub const TUNABLES_NOT_EVALUATED: &str = "TunablesNotEvaluated";
    pub const GPUS_HEALTHY: &str = "GpusHealthy";
    pub const GPU_UNHEALTHY: &str = "GpuUnhealthy";
    pub const GPU_TOOL_FAILED: &str = "GpuToolFailed";
    pub const NETWORK_CONVERGED: &str = "NetworkConverged";
    pub const NETWORK_DRIFTED: &str = "NetworkDrifted";
    pub const NETWORK_APPLY_FAILED: &str = "NetworkApplyFailed";
}

/// Longest condition message written; longer lists are cut with a count of the rest.
const MAX_MESSAGE: usize = 1024;
/// Items named in one message before "and N more".
const MAX_ITEMS: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    True,
    False,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::True => "True",
            Status::False => "False",
            Status::Unknown => "Unknown",
        }
    }

    pub fn parse(s: &str) -> Status {
        match s {
            "True" => Status::True,
            "False" => Status::False,
            _ => Status::Unknown,
        }
    }
}

/// One condition as nodekeeper compares it. Times are kept beside it, not compared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub type_: String,
    pub status: Status,
    pub reason: String,
    pub message: String,
}

impl Condition {
    fn new(type_: &str, status: Status, reason: &str, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE - 3;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        Condition {
            type_: type_.to_owned(),
            status,
            reason: reason.to_owned(),
            message,
        }
    }
}

/// A condition as found on the Node, with its transition time (RFC 3339) kept so that an
/// unchanged status keeps its original `lastTransitionTime`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub condition: Condition,
    pub last_transition_time: Option<String>,
}

/// Why calls to an agent fail, in the few classes that mean something to an operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureClass {
    /// No answer: refused, unroutable or timed out.
    Unreachable,
    /// The TLS handshake failed (wrong certificate on either side).
    Certificate,
    /// An answer that is not a usable report (garbage, too large, wrong node).
    InvalidReply,
}

/// What the controller knows about one node's agent at one moment.
#[derive(Clone, Copy, Debug)]
pub enum Observation<'a> {
    /// Nothing yet (just started, or never answered but not yet stale): no opinion, no write.
    Pending,
    /// The agent answered recently; this is its report.
    Fresh(&'a NodeView),
    /// No good answer for longer than `staleAfter`.
    Stale {
        address: &'a str,
        class: FailureClass,
        stale_after: Duration,
    },
}

/// The conditions nodekeeper wants on the node, sorted by type; `None` means "no opinion" (keep
/// whatever is there).
pub fn desired_conditions(
    observation: Observation<'_>,
    features: &Features,
    current: &[Written],
) -> Option<Vec<Condition>> {
    let mut out = match observation {
        Observation::Pending => return None,
        Observation::Fresh(view) => {
            let mut out = vec![Condition::new(
                REACHABLE,
                Status::True,
                reason::AGENT_REACHABLE,
                "the nodekeeper agent answers",
            )];
            if features.tunables {
                out.push(tunables_condition(view));
            }
            if features.gpu {
                out.extend(gpu_condition(view));
            }
            if features.network {
                match network_condition(view) {
                    Some(c) => out.push(c),
                    // The agent has no network state, but the NodeNetworkConfig controller may
                    // have said why (a VNIC it could not attach): keep its word rather than
                    // rewrite the node on every pull.
                    None => out.extend(
                        current
                            .iter()
                            .find(|w| w.condition.type_ == NETWORK_READY)
                            .map(|w| w.condition.clone()),
                    ),
                }
            }
            out
        }
        Observation::Stale {
            address,
            class,
            stale_after,
        } => {
            let (why, what) = match class {
                FailureClass::Unreachable => (reason::AGENT_UNREACHABLE, "has not answered"),
                FailureClass::Certificate => (
                    reason::AGENT_CERTIFICATE_REJECTED,
                    "has failed the mutual-TLS handshake",
                ),
                FailureClass::InvalidReply => {
                    (reason::AGENT_REPLY_INVALID, "has sent no usable report")
                }
            };
            let mut out = vec![Condition::new(
                REACHABLE,
                Status::False,
                why,
                format!(
                    "the nodekeeper agent at {address} {what} for more than {}",
                    format_duration(stale_after)
                ),
            )];
            // The other conditions we own become Unknown, as the node lifecycle controller does
            // for kubelet conditions: what they said is no longer known to hold.
            for w in current {
                let type_ = w.condition.type_.as_str();
                let enabled = match type_ {
                    TUNABLES_IN_BOUNDS => features.tunables,
                    GPU_HEALTHY => features.gpu,
                    NETWORK_READY => features.network,
                    _ => false,
                };
                if enabled {
                    out.push(Condition::new(
                        type_,
                        Status::Unknown,
                        why,
                        "no fresh report from the nodekeeper agent",
                    ));
                }
            }
            out
        }
    };
    out.sort_by(|a, b| a.type_.cmp(&b.type_));
    Some(out)
}

/// True when writing `desired` would change the node: a type added or removed, or a status,
/// reason or message that differs. Times never count.
pub fn changed(current: &[Written], desired: &[Condition]) -> bool {
    let now: BTreeMap<&str, &Condition> = current
        .iter()
        .map(|w| (w.condition.type_.as_str(), &w.condition))
        .collect();
    let want: BTreeMap<&str, &Condition> = desired.iter().map(|c| (c.type_.as_str(), c)).collect();
    now != want
}

/// The server-side-apply body for `nodes/{name}/status`: all of our conditions (types we stop
/// listing are removed by the apply, as the field manager owned them). A condition whose status is
/// unchanged keeps its `lastTransitionTime`.
pub fn apply_body(
    name: &str,
    current: &[Written],
    desired: &[Condition],
    now_rfc3339: &str,
) -> serde_json::Value {
    let conditions: Vec<serde_json::Value> = desired
        .iter()
        .map(|c| {
            let transition = current
                .iter()
                .find(|w| w.condition.type_ == c.type_ && w.condition.status == c.status)
                .and_then(|w| w.last_transition_time.clone())
                .unwrap_or_else(|| now_rfc3339.to_owned());
            json!({
                "type": c.type_,
                "status": c.status.as_str(),
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": transition,
                // The time of this write, which happens only on change: never a heartbeat.
                "lastHeartbeatTime": now_rfc3339,
            })
        })
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name },
        "status": { "conditions": conditions },
    })
}

fn list(items: &[String]) -> String {
    let mut text = items
        .iter()
        .take(MAX_ITEMS)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > MAX_ITEMS {
        text.push_str(&format!("; and {} more", items.len() - MAX_ITEMS));
    }
    text
}

fn tunables_condition(view: &NodeView) -> Condition {
    if view.tunables.is_empty() {
        return Condition::new(
            TUNABLES_IN_BOUNDS,
            Status::True,
            reason::NO_RULES,
            "no tunable rules in force",
        );
    }
    let out_of_bounds: Vec<String> = view
        .tunables
        .iter()
        .filter(|t| matches!(t.verdict, Verdict::Warning | Verdict::Critical))
        .map(|t| {
            let conflict = if t.conflict {
                ", changed back by someone else"
            } else {
                ""
            };
            format!(
                "{} ({} = {:?}, expected {}, {}{conflict})",
                t.rule,
                t.key,
                t.current,
                t.expected,
                t.verdict.word()
            )
        })
        .collect();
    if !out_of_bounds.is_empty() {
        return Condition::new(
            TUNABLES_IN_BOUNDS,
            Status::False,
            reason::TUNABLES_OUT_OF_BOUNDS,
            format!(
                "{} of {} rules out of bounds: {}",
                out_of_bounds.len(),
                view.tunables.len(),
                list(&out_of_bounds)
            ),
        );
    }
    let unread: Vec<String> = view
        .tunables
        .iter()
        .filter(|t| t.verdict == Verdict::Unspecified)
        .map(|t| format!("{} ({})", t.rule, t.key))
        .collect();
    if !unread.is_empty() {
        return Condition::new(
            TUNABLES_IN_BOUNDS,
            Status::Unknown,
            reason::TUNABLES_NOT_EVALUATED,
            format!(
                "{} of {} rules could not be evaluated: {}",
                unread.len(),
                view.tunables.len(),
                list(&unread)
            ),
        );
    }
    Condition::new(
        TUNABLES_IN_BOUNDS,
        Status::True,
        reason::TUNABLES_IN_BOUNDS,
        format!("all {} rules in bounds", view.tunables.len()),
    )
}

fn gpu_condition(view: &NodeView) -> Option<Condition> {
    let gpu = &view.gpu;
    if !gpu.error.is_empty() {
        // The tool's error text is stable for a given failure (e.g. driver not loaded).
        return Some(Condition::new(
            GPU_HEALTHY,
            Status::Unknown,
            reason::GPU_TOOL_FAILED,
            format!("{} failed: {}", gpu.source_or_tool(), gpu.error),
        ));
    }
    if !gpu.present {
        return None;
    }
    let bad: Vec<String> = gpu
        .gpus
        .iter()
        .filter(|g| g.verdict != Verdict::Ok)
        .map(|g| format!("GPU {} ({}) {}", g.index, g.uuid, g.verdict.word()))
        .collect();
    Some(if bad.is_empty() {
        Condition::new(
            GPU_HEALTHY,
            Status::True,
            reason::GPUS_HEALTHY,
            format!("{} GPUs healthy", gpu.gpus.len()),
        )
    } else {
        Condition::new(
            GPU_HEALTHY,
            Status::False,
            reason::GPU_UNHEALTHY,
            format!(
                "{} of {} GPUs unhealthy: {}",
                bad.len(),
                gpu.gpus.len(),
                list(&bad)
            ),
        )
    })
}

fn network_condition(view: &NodeView) -> Option<Condition> {
    let net = &view.network;
    if !net.last_error.is_empty() {
        return Some(Condition::new(
            NETWORK_READY,
            Status::False,
            reason::NETWORK_APPLY_FAILED,
            net.last_error.clone(),
        ));
    }
    if net.drifted {
        return Some(Condition::new(
            NETWORK_READY,
            Status::False,
            reason::NETWORK_DRIFTED,
            format!("drifted: {}", list(&net.drift)),
        ));
    }
    if net.applied_generation.is_empty() {
        // No nodekeeper-managed networking on this node: no opinion.
        return None;
    }
    Some(Condition::new(
        NETWORK_READY,
        Status::True,
        reason::NETWORK_CONVERGED,
        format!("host networking at generation {}", net.applied_generation),
    ))
}

impl crate::view::GpuView {
    fn source_or_tool(&self) -> &str {
        if self.source.is_empty() {
            "the GPU tool"
        } else {
            &self.source
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{GpuInfo, TunableView};

    fn tunable(rule: &str, verdict: Verdict) -> TunableView {
        TunableView {
            rule: rule.into(),
            key: format!("net.{rule}"),
            current: "128".into(),
            verdict,
            expected: ">= 4096".into(),
            previous: String::new(),
            repaired_at_unix_ms: 0,
            conflict: false,
            error: String::new(),
        }
    }

    fn written(conditions: &[Condition]) -> Vec<Written> {
        conditions
            .iter()
            .map(|c| Written {
                condition: c.clone(),
                last_transition_time: Some("2026-01-01T00:00:00Z".into()),
            })
            .collect()
    }

    fn types(conditions: &[Condition]) -> Vec<&str> {
        conditions.iter().map(|c| c.type_.as_str()).collect()
    }

    #[test]
    fn healthy_node_without_gpu_or_networking() {
        let view = NodeView {
            tunables: vec![tunable("a", Verdict::Ok)],
            ..Default::default()
        };
        let want =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        assert_eq!(types(&want), vec![REACHABLE, TUNABLES_IN_BOUNDS]);
        assert!(want.iter().all(|c| c.status == Status::True));
        assert_eq!(want[1].message, "all 1 rules in bounds");
    }

    #[test]
    fn out_of_bounds_names_rules_and_caps_the_list() {
        let view = NodeView {
            tunables: (0..8)
                .map(|i| tunable(&format!("r{i}"), Verdict::Warning))
                .chain([tunable("fine", Verdict::Ok)])
                .collect(),
            ..Default::default()
        };
        let want =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        let c = want.iter().find(|c| c.type_ == TUNABLES_IN_BOUNDS).unwrap();
        assert_eq!(c.status, Status::False);
        assert_eq!(c.reason, reason::TUNABLES_OUT_OF_BOUNDS);
        assert!(
            c.message.starts_with(
                "8 of 9 rules out of bounds: r0 (net.r0 = \"128\", expected >= 4096, warning)"
            ),
            "{}",
            c.message
        );
        assert!(c.message.ends_with("; and 3 more"), "{}", c.message);
    }

    #[test]
    fn unevaluated_tunables_are_unknown_not_healthy() {
        let view = NodeView {
            tunables: vec![
                tunable("a", Verdict::Ok),
                tunable("b", Verdict::Unspecified),
            ],
            ..Default::default()
        };
        let want =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        assert_eq!(want[1].status, Status::Unknown);
    }

    #[test]
    fn gpu_condition_only_on_gpu_nodes_and_without_drifting_values() {
        let mut view = NodeView::default();
        view.gpu.present = true;
        view.gpu.source = "nvidia-smi".into();
        let gpu = |i, temp, verdict| GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            model: "A10".into(),
            memory_total_mib: 0,
            memory_used_mib: 0,
            temperature_c: temp,
            utilization_percent: 0.0,
            ecc_uncorrected: 0,
            xid_events: 0,
            verdict,
            message: format!("{temp}°C"),
        };
        view.gpu.gpus = vec![gpu(0, 40.0, Verdict::Ok), gpu(1, 95.0, Verdict::Critical)];
        let a = desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        let c = a.iter().find(|c| c.type_ == GPU_HEALTHY).unwrap();
        assert_eq!(
            (c.status, c.message.as_str()),
            (
                Status::False,
                "1 of 2 GPUs unhealthy: GPU 1 (GPU-1) critical"
            )
        );
        // A temperature change with the same verdicts is no change.
        view.gpu.gpus[1].temperature_c = 96.0;
        view.gpu.gpus[1].message = "96°C".into();
        let b = desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        assert!(!changed(&written(&a), &b));
        // Feature off: no GpuHealthy at all.
        let off = Features {
            gpu: false,
            ..Features::default()
        };
        let c = desired_conditions(Observation::Fresh(&view), &off, &[]).unwrap();
        assert!(!types(&c).contains(&GPU_HEALTHY));
    }

    #[test]
    fn network_condition_follows_drift_and_errors() {
        let mut view = NodeView::default();
        let net = |v: &NodeView| {
            desired_conditions(Observation::Fresh(v), &Features::default(), &[])
                .unwrap()
                .into_iter()
                .find(|c| c.type_ == NETWORK_READY)
        };
        assert_eq!(net(&view), None);
        view.network.applied_generation = "uid/3".into();
        assert_eq!(net(&view).unwrap().status, Status::True);
        view.network.drifted = true;
        view.network.drift = vec!["address 10.0.0.5/24 missing on nk-v21".into()];
        assert_eq!(net(&view).unwrap().reason, reason::NETWORK_DRIFTED);
        view.network.last_error = "add-route failed".into();
        assert_eq!(net(&view).unwrap().reason, reason::NETWORK_APPLY_FAILED);
    }

    #[test]
    fn a_network_condition_the_agent_cannot_tell_is_kept_not_rewritten() {
        let view = NodeView::default();
        let nnc = Condition::new(
            NETWORK_READY,
            Status::False,
            "VnicAttachFailed",
            "spec.ociVnics.attach[0].nicIndex: …",
        );
        let current = written(&[nnc.clone()]);
        let desired =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &current).unwrap();
        let network: Vec<&Condition> = desired
            .iter()
            .filter(|c| c.type_ == NETWORK_READY)
            .collect();
        assert_eq!(network, [&nnc]);
        // Once the agent has applied, its own word wins again.
        let mut applied = NodeView::default();
        applied.network.applied_generation = "uid/3".into();
        let desired =
            desired_conditions(Observation::Fresh(&applied), &Features::default(), &current)
                .unwrap();
        let network: Vec<&Condition> = desired
            .iter()
            .filter(|c| c.type_ == NETWORK_READY)
            .collect();
        assert_eq!(network[0].reason, reason::NETWORK_CONVERGED);
    }

    #[test]
    fn pending_has_no_opinion() {
        assert_eq!(
            desired_conditions(Observation::Pending, &Features::default(), &[]),
            None
        );
    }

    #[test]
    fn stale_marks_reachable_false_and_the_rest_unknown() {
        let view = NodeView {
            tunables: vec![tunable("a", Verdict::Ok)],
            ..Default::default()
        };
        let before =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        let current = written(&before);
        let stale = Observation::Stale {
            address: "127.1.0.9:9443",
            class: FailureClass::Certificate,
            stale_after: Duration::from_secs(900),
        };
        let after = desired_conditions(stale, &Features::default(), &current).unwrap();
        assert_eq!(types(&after), vec![REACHABLE, TUNABLES_IN_BOUNDS]);
        assert_eq!(after[0].status, Status::False);
        assert_eq!(after[0].reason, reason::AGENT_CERTIFICATE_REJECTED);
        assert_eq!(
            after[0].message,
            "the nodekeeper agent at 127.1.0.9:9443 has failed the mutual-TLS handshake for more than 15m"
        );
        assert_eq!(after[1].status, Status::Unknown);
        assert!(changed(&current, &after));
        // Staying stale is no change: no second write.
        assert!(!changed(
            &written(&after),
            &desired_conditions(stale, &Features::default(), &written(&after)).unwrap()
        ));
    }

    #[test]
    fn changed_ignores_times_and_order_but_sees_removals() {
        let view = NodeView::default();
        let want =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        let mut current = written(&want);
        current.reverse();
        current[0].last_transition_time = Some("2020-01-01T00:00:00Z".into());
        assert!(!changed(&current, &want));
        let fewer: Vec<Condition> = want
            .iter()
            .filter(|c| c.type_ == REACHABLE)
            .cloned()
            .collect();
        assert!(changed(&current, &fewer));
        let mut other = want.clone();
        other[0].message.push('!');
        assert!(changed(&current, &other));
    }

    #[test]
    fn apply_body_keeps_transition_time_when_status_holds() {
        let view = NodeView::default();
        let want =
            desired_conditions(Observation::Fresh(&view), &Features::default(), &[]).unwrap();
        let mut current = written(&want);
        current[0].condition.message = "old message".into();
        let body = apply_body("n1", &current, &want, "2026-06-01T00:00:00Z");
        let first = &body["status"]["conditions"][0];
        assert_eq!(first["lastTransitionTime"], "2026-01-01T00:00:00Z");
        assert_eq!(first["lastHeartbeatTime"], "2026-06-01T00:00:00Z");
        current[0].condition.status = Status::False;
        let body = apply_body("n1", &current, &want, "2026-06-01T00:00:00Z");
        assert_eq!(
            body["status"]["conditions"][0]["lastTransitionTime"],
            "2026-06-01T00:00:00Z"
        );
        assert_eq!(body["metadata"]["name"], "n1");
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let c = Condition::new(REACHABLE, Status::True, "R", "é".repeat(2000));
        assert!(c.message.len() <= MAX_MESSAGE);
        assert!(c.message.ends_with("..."));
    }
}
