//! Node conditions owned by nodekeeper: what they should say for an observation
//! ([`desired_conditions`]), whether that differs from what is on the Node ([`changed`]), the
//! server-side-apply body that writes them ([`apply_body`]), and the transitions of problem
//! conditions that become Node Events ([`transitions`]). Plain functions over plain data.
//!
//! Two polarities live side by side. nodekeeper's own types ([`OWNED_TYPES`]) say `True` when
//! all is well. Problem types follow node-problem-detector: `True` means the problem is present.
//! They come from the agents' NPD rules (`KernelDeadlock`, `ReadonlyFilesystem`, a custom
//! plugin's type, …) and from the indicator verdicts the tuning ConfigMap's `signals.*` keys map
//! to condition types (`DiskUsageHigh`, `NTPProblem`, …). Which problem types are ours is read
//! from the Node's managedFields ([`managed_condition_types`]): those our field manager applied.
//!
//! The write budget rests on [`changed`]: a Node is patched only when the status, reason or
//! message of one of our conditions differs from what the Node already carries, so a steady
//! fleet costs no writes at all. Messages therefore never carry values that drift with time
//! (temperatures, sysctl values, percentages, timestamps, counters); they name rules,
//! indicators, GPUs and states, so a message changes only with the set of things at fault.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
use nodekeeper_api::names;
use nodekeeper_model::tuning::{
    ProblemTuning, RESERVED_CONDITION_TYPES, Signal, TuningConfig, format_duration,
};
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

/// nodekeeper's own condition types (`True` = healthy). Problem types are open-ended; the ones on
/// a Node that are ours are those our field manager owns ([`managed_condition_types`]). Any other
/// condition on the Node is not ours and never touched.
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
    pub const GPU_WARNING: &str = "GpuWarning";
    pub const GPU_NOT_EVALUATED: &str = "GpuNotEvaluated";
    pub const NETWORK_CONVERGED: &str = "NetworkConverged";
    pub const NETWORK_DRIFTED: &str = "NetworkDrifted";
    pub const NETWORK_APPLY_FAILED: &str = "NetworkApplyFailed";
}

/// Longest condition message written; longer lists are cut with a count of the rest.
const MAX_MESSAGE: usize = 1024;
/// Most problem conditions (from agents' rules) written on one Node; the agent keeps as many.
pub const MAX_PROBLEM_CONDITIONS: usize = 64;
/// Longest problem condition type or reason taken from an agent; longer ones are not written.
const MAX_PROBLEM_NAME: usize = 128;
/// Items named in one message before "and N more".
const MAX_ITEMS: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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

impl FailureClass {
    /// How much a class says about the agent: a certificate rejection names its cause, an
    /// invalid reply shows a live but wrong peer, "no answer" shows nothing.
    fn specificity(self) -> u8 {
        match self {
            FailureClass::Unreachable => 0,
            FailureClass::InvalidReply => 1,
            FailureClass::Certificate => 2,
        }
    }

    fn of_reason(reason: &str) -> Option<FailureClass> {
        match reason {
            reason::AGENT_UNREACHABLE => Some(FailureClass::Unreachable),
            reason::AGENT_CERTIFICATE_REJECTED => Some(FailureClass::Certificate),
            reason::AGENT_REPLY_INVALID => Some(FailureClass::InvalidReply),
            _ => None,
        }
    }
}

/// The class a stale node's condition names, given the class of the latest failed call and the
/// conditions written: the most specific class seen since the agent last answered. One broken
/// agent often fails in more than one way (an agent that distrusts our certificate answers the
/// handshake with an alert on one call and a closed connection on the next); naming the latest
/// would rewrite the Node at every call, and hide the telling failure behind a vague one.
pub fn stale_class(latest: FailureClass, written: &[Written]) -> FailureClass {
    let shown = written
        .iter()
        .find(|w| w.condition.type_ == REACHABLE && w.condition.status == Status::False)
        .and_then(|w| FailureClass::of_reason(&w.condition.reason));
    match shown {
        Some(shown) if shown.specificity() > latest.specificity() => shown,
        _ => latest,
    }
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
    config: &TuningConfig,
    current: &[Written],
) -> Option<Vec<Condition>> {
    let features = &config.features;
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
            if features.problems {
                out.extend(problem_conditions(view));
            }
            let taken: BTreeSet<String> = out.iter().map(|c| c.type_.clone()).collect();
            out.extend(signal_conditions(view, &config.problems, &taken));
            out
        }
        Observation::Stale {
            address,
            class,
            stale_after,
        } => {
            let (why, what, fix) = match class {
                FailureClass::Unreachable => (reason::AGENT_UNREACHABLE, "has not answered", ""),
                FailureClass::Certificate => (
                    reason::AGENT_CERTIFICATE_REJECTED,
                    "has failed the mutual-TLS handshake",
                    // The cause (expired, another CA, a TLS alert) is in the controller's log
                    // and on the node's page; the fix is nearly always the Secrets.
                    "; the agent must serve the certificate in Secret nodekeeper-agent-tls and \
                     trust the CA in nodekeeper-ca (a CA rotated without its bundle step, an \
                     agent that has not reloaded the Secret): `kubectl nodekeeper node NAME` \
                     shows the handshake's error",
                ),
                FailureClass::InvalidReply => {
                    (reason::AGENT_REPLY_INVALID, "has sent no usable report", "")
                }
            };
            let mut out = vec![Condition::new(
                REACHABLE,
                Status::False,
                why,
                format!(
                    "the nodekeeper agent at {address} {what} for more than {}{fix}",
                    format_duration(stale_after)
                ),
            )];
            // The other conditions we own become Unknown, as the node lifecycle controller does
            // for kubelet conditions: what they said is no longer known to hold.
            for w in current {
                let type_ = w.condition.type_.as_str();
                let enabled = match type_ {
                    REACHABLE => false,
                    TUNABLES_IN_BOUNDS => features.tunables,
                    GPU_HEALTHY => features.gpu,
                    NETWORK_READY => features.network,
                    // A problem type: from the agents' rules, or a signal's.
                    _ => features.problems || config.problems.signals.values().any(|t| t == type_),
                };
                if enabled {
                    out.push(Condition::new(
                        type_,
                        Status::Unknown,
                        why,
                        stale_message(&w.condition),
                    ));
                }
            }
            out
        }
    };
    out.sort_by(|a, b| a.type_.cmp(&b.type_));
    Some(out)
}

/// What an `Unknown` condition of a stale node says. Two things of the condition before it
/// stay in it, each as one clause however long the node stays stale (taken from the condition
/// as written, the previous stale one included, so nothing nests):
/// - `NodeNetworkReady`'s generation (`generation <uid>/<generation>`): a restarted
///   NodeNetworkConfig controller finds the nodes where an object's host side may be by it alone
///   (see [`network_condition`]); without it, an object deleted while the node is stale would
///   leave its host side there.
/// - a problem condition's `True` and its reason (`last True: <reason>`): the Event for its
///   turning `True` was raised, and [`transitions`] judges the agent's next answer against it
///   (no second "is now True" when it answers `True` again; a recovery when it answers `False`).
fn stale_message(before: &Condition) -> String {
    let mut message = STALE_MESSAGE.to_owned();
    if before.type_ == NETWORK_READY
        && let Some(generation) = named_generation(&before.message)
    {
        message.push_str(&format!(
            "; host networking last known at generation {generation}"
        ));
    }
    if is_problem_type(&before.type_)
        && let Some(reason) = last_true_reason(before)
    {
        message.push_str(&format!("; {LAST_TRUE}{reason}"));
    }
    message
}

/// The start of every `Unknown` condition's message on a stale node.
const STALE_MESSAGE: &str = "no fresh report from the nodekeeper agent";

/// How a stale node's `Unknown` problem condition names the reason it was `True` with.
const LAST_TRUE: &str = "last True: ";

/// The `<uid>/<generation>` a `NodeNetworkReady` message names after `generation `, if any.
fn named_generation(message: &str) -> Option<&str> {
    message.match_indices("generation ").find_map(|(at, word)| {
        let token = message[at + word.len()..]
            .split(|c: char| c.is_whitespace() || matches!(c, ':' | ';' | ','))
            .next()?;
        token.contains('/').then_some(token)
    })
}

/// The reason a problem condition was last `True` with: its own when `True`, the one a stale
/// node's `Unknown` kept (see [`stale_message`]), None otherwise.
fn last_true_reason(condition: &Condition) -> Option<&str> {
    match condition.status {
        Status::True => Some(&condition.reason),
        Status::Unknown if condition.message.starts_with(STALE_MESSAGE) => condition
            .message
            .split("; ")
            .find_map(|clause| clause.strip_prefix(LAST_TRUE)),
        _ => None,
    }
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
            let repair = repair_failure(&t.error)
                .map(|why| format!(", repair failed: {why}"))
                .unwrap_or_default();
            // The current value is left out on purpose: it may drift with every read while
            // the verdict holds, and a message that changes is a write.
            format!(
                "{} ({}, expected {}, {}{conflict}{repair})",
                t.rule,
                t.key,
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

/// Why the agent's repair of a tunable failed, in words that stay the same from read to read
/// (no path, no value): the error kind of a failed write (`write /proc/sys/…: Permission denied
/// (os error 13)` gives `permission denied`), or that the kernel kept its own value.
fn repair_failure(error: &str) -> Option<String> {
    if let Some(rest) = error.strip_prefix("write ") {
        let why = rest.rsplit_once(": ").map_or(rest, |(_, why)| why);
        let why = why.split(" (os error").next().unwrap_or(why).trim();
        return Some(if why.is_empty() {
            "write refused".to_owned()
        } else {
            why.to_lowercase()
        });
    }
    error
        .starts_with("the kernel kept ")
        .then(|| "the kernel kept another value".to_owned())
}

/// `GpuHealthy`, read by NodeSets that replace nodes whose listed condition is `False`, so
/// only what means "this node's GPUs are broken" makes it `False`: any Critical verdict (a
/// GPU's, or the agent's over all GPUs, such as fewer GPUs than `--expected-gpus`). Anything
/// not evaluated (a GPU field or the GPU tool could not be read) makes it `Unknown`; warnings
/// alone (row remapping pending, thermal slowdown) keep it `True` and are named in the message.
/// Messages name items and verdict words only, never values that drift between reads.
fn gpu_condition(view: &NodeView) -> Option<Condition> {
    let gpu = &view.gpu;
    let overall = gpu_overall_item(gpu);
    if !gpu.present && gpu.error.is_empty() && overall.is_none() {
        return None;
    }
    let mut items: Vec<(String, Verdict)> = gpu
        .gpus
        .iter()
        .map(|g| {
            let name = format!("GPU {} ({}) {}", g.index, g.uuid, g.verdict.word());
            (name, g.verdict)
        })
        .collect();
    if let Some((_, verdict)) = overall {
        let text = if gpu.message.is_empty() {
            format!("GPUs {}", verdict.word())
        } else {
            gpu.message.clone()
        };
        items.push((text, verdict));
    }
    if !gpu.error.is_empty() {
        // The tool's error text is stable for a given failure (e.g. driver not loaded).
        items.push((
            format!("{} failed: {}", gpu.source_or_tool(), gpu.error),
            Verdict::Unspecified,
        ));
    }
    let count = |v: Verdict| gpu.gpus.iter().filter(|g| g.verdict == v).count();
    let worst = items
        .iter()
        .map(|(_, v)| *v)
        .max_by_key(|v| match v {
            // Unknown outranks a warning here: a node is not called healthy while
            // something is unread.
            Verdict::Ok => 0,
            Verdict::Warning => 1,
            Verdict::Unspecified => 2,
            Verdict::Critical => 3,
        })
        .unwrap_or(Verdict::Ok);
    let named: Vec<String> = items
        .iter()
        .filter(|(_, v)| *v != Verdict::Ok)
        .map(|(name, _)| name.clone())
        .collect();
    let total = gpu.gpus.len();
    Some(match worst {
        Verdict::Ok => Condition::new(
            GPU_HEALTHY,
            Status::True,
            reason::GPUS_HEALTHY,
            format!("{total} GPUs healthy"),
        ),
        Verdict::Warning => Condition::new(
            GPU_HEALTHY,
            Status::True,
            reason::GPU_WARNING,
            format!(
                "{} of {total} GPUs with warnings: {}",
                count(Verdict::Warning),
                list(&named)
            ),
        ),
        Verdict::Unspecified => Condition::new(
            GPU_HEALTHY,
            Status::Unknown,
            if gpu.error.is_empty() {
                reason::GPU_NOT_EVALUATED
            } else {
                reason::GPU_TOOL_FAILED
            },
            format!(
                "{} of {total} GPUs not evaluated: {}",
                count(Verdict::Unspecified),
                list(&named)
            ),
        ),
        Verdict::Critical => Condition::new(
            GPU_HEALTHY,
            Status::False,
            reason::GPU_UNHEALTHY,
            format!(
                "{} of {total} GPUs unhealthy: {}",
                count(Verdict::Critical),
                list(&named)
            ),
        ),
    })
}

/// The agent's verdict over all GPUs where it says more than the GPUs' own verdicts: it is a
/// problem (fewer GPUs than expected) worse than every GPU's, or there is no GPU to judge.
fn gpu_overall_item(gpu: &crate::view::GpuView) -> Option<(String, Verdict)> {
    let worst_gpu = gpu
        .gpus
        .iter()
        .map(|g| severity(g.verdict))
        .max()
        .unwrap_or(0);
    let problem = matches!(gpu.verdict, Verdict::Warning | Verdict::Critical);
    (problem && severity(gpu.verdict) > worst_gpu).then(|| {
        let name = if gpu.message.is_empty() {
            "GPUs".to_owned()
        } else {
            format!("GPUs ({})", gpu.message)
        };
        (name, gpu.verdict)
    })
}

/// The agent's `NodeNetworkReady`. While the agent holds an applied generation
/// (`<object uid>/<generation>`), every message names it, the failed and drifted ones included:
/// a restarted NodeNetworkConfig controller finds the nodes where an object's host side is by
/// that name alone (`generation <uid>/`), and a message without it would make it leave that host
/// side in place when the object is deleted or the node leaves its selector.
fn network_condition(view: &NodeView) -> Option<Condition> {
    let net = &view.network;
    let applied = &net.applied_generation;
    if !net.last_error.is_empty() {
        let message = if applied.is_empty() {
            net.last_error.clone()
        } else {
            format!(
                "{}; host networking stays at generation {applied}",
                net.last_error
            )
        };
        return Some(Condition::new(
            NETWORK_READY,
            Status::False,
            reason::NETWORK_APPLY_FAILED,
            message,
        ));
    }
    if net.drifted {
        let message = if applied.is_empty() {
            format!("drifted: {}", list(&net.drift))
        } else {
            format!("drifted from generation {applied}: {}", list(&net.drift))
        };
        return Some(Condition::new(
            NETWORK_READY,
            Status::False,
            reason::NETWORK_DRIFTED,
            message,
        ));
    }
    if applied.is_empty() {
        // No nodekeeper-managed networking on this node: no opinion.
        return None;
    }
    Some(Condition::new(
        NETWORK_READY,
        Status::True,
        reason::NETWORK_CONVERGED,
        format!("host networking at generation {applied}"),
    ))
}

/// Whether a condition type is a problem type (NPD polarity) rather than one of nodekeeper's own.
pub fn is_problem_type(type_: &str) -> bool {
    !OWNED_TYPES.contains(&type_)
}

/// The condition types nodekeeper's field manager owns on a Node, from its managedFields: the
/// `status.conditions` entries (keyed by type) in the manager's `status` apply. Problem types are
/// open-ended (any rule file may declare one), so ownership, not a fixed list, says which of a
/// Node's conditions are ours to compare and rewrite.
pub fn managed_condition_types(entries: &[ManagedFieldsEntry]) -> BTreeSet<String> {
    entries
        .iter()
        .filter(|e| {
            e.manager.as_deref() == Some(FIELD_MANAGER)
                && e.subresource.as_deref() == Some("status")
        })
        .filter_map(|e| e.fields_v1.as_ref())
        .filter_map(|f| f.0.get("f:status")?.get("f:conditions")?.as_object())
        .flat_map(|conditions| conditions.keys())
        .filter_map(|key| {
            let value: serde_json::Value = serde_json::from_str(key.strip_prefix("k:")?).ok()?;
            value.get("type")?.as_str().map(str::to_owned)
        })
        .collect()
}

/// The agent's permanent NPD problems as conditions, as the rules state them. Types the kubelet
/// or nodekeeper set with another meaning are never taken from an agent.
fn problem_conditions(view: &NodeView) -> Vec<Condition> {
    let mut by_type: BTreeMap<&str, Condition> = BTreeMap::new();
    for c in &view.problems.conditions {
        let usable = !c.type_.is_empty()
            && c.type_.len() <= MAX_PROBLEM_NAME
            && c.reason.len() <= MAX_PROBLEM_NAME
            && !RESERVED_CONDITION_TYPES.contains(&c.type_.as_str());
        if !usable || by_type.len() >= MAX_PROBLEM_CONDITIONS {
            continue;
        }
        by_type.entry(&c.type_).or_insert_with(|| {
            Condition::new(&c.type_, Status::parse(&c.status), &c.reason, &c.message)
        });
    }
    by_type.into_values().collect()
}

/// What one signal's verdicts say: (item name, verdict) pairs.
type SignalItems = Vec<(String, Verdict)>;

fn signal_items(view: &NodeView, signal: Signal) -> SignalItems {
    match signal {
        Signal::OcaPlugins => view
            .plugins
            .iter()
            .map(|p| (format!("plugin {}", p.name), p.verdict))
            .collect(),
        Signal::Gpu => {
            let gpu = &view.gpu;
            let mut items: Vec<(String, Verdict)> = gpu
                .gpus
                .iter()
                .map(|g| (format!("GPU {} ({})", g.index, g.uuid), g.verdict))
                .collect();
            items.extend(gpu_overall_item(gpu));
            if !gpu.error.is_empty() {
                items.push((gpu.source_or_tool().to_owned(), Verdict::Unspecified));
            }
            items
        }
        _ => view
            .indicators
            .iter()
            .filter(|i| Signal::of_indicator(&i.name) == Some(signal))
            .map(|i| (i.name.clone(), i.verdict))
            .collect(),
    }
}

/// How bad a verdict is, for picking the worst: a problem beats "not evaluated" beats ok.
fn severity(verdict: Verdict) -> u8 {
    match verdict {
        Verdict::Ok => 0,
        Verdict::Unspecified => 1,
        Verdict::Warning => 2,
        Verdict::Critical => 3,
    }
}

/// The conditions the `signals.*` mapping asks for: one per configured type, from the worst
/// verdict of the signals mapped to it (`Warning`/`Critical` → `True`, not evaluated →
/// `Unknown`, all ok → `False`). A type no reported item covers is left out (no opinion), and a
/// type already `taken` (an agent rule declares it) is the agent's.
fn signal_conditions(
    view: &NodeView,
    tuning: &ProblemTuning,
    taken: &BTreeSet<String>,
) -> Vec<Condition> {
    let mut by_type: BTreeMap<&str, Vec<(Signal, SignalItems)>> = BTreeMap::new();
    for signal in Signal::ALL {
        let Some(type_) = tuning.signal_type(signal) else {
            continue;
        };
        if taken.contains(type_) {
            continue;
        }
        let items = signal_items(view, signal);
        if !items.is_empty() {
            by_type.entry(type_).or_default().push((signal, items));
        }
    }
    by_type
        .into_iter()
        .map(|(type_, groups)| {
            // The worst verdict; on a tie, the signal listed first in `Signal::ALL`.
            let (signal, worst) = groups
                .iter()
                .map(|(signal, items)| {
                    let worst = items
                        .iter()
                        .map(|(_, v)| *v)
                        .max_by_key(|v| severity(*v))
                        .unwrap_or(Verdict::Ok);
                    (*signal, worst)
                })
                .fold(None, |best: Option<(Signal, Verdict)>, (s, v)| match best {
                    Some((_, bv)) if severity(bv) >= severity(v) => best,
                    _ => Some((s, v)),
                })
                .unwrap_or((Signal::Disk, Verdict::Ok));
            let items: Vec<&(String, Verdict)> =
                groups.iter().flat_map(|(_, items)| items).collect();
            let (status, suffix) = match worst {
                Verdict::Critical => (Status::True, "Critical"),
                Verdict::Warning => (Status::True, "Warning"),
                Verdict::Unspecified => (Status::Unknown, "NotEvaluated"),
                Verdict::Ok => (Status::False, "Normal"),
            };
            let reason = format!("{}{suffix}", signal.reason_stem());
            let message = match status {
                Status::True => {
                    let bad: Vec<String> = items
                        .iter()
                        .filter(|(_, v)| matches!(v, Verdict::Warning | Verdict::Critical))
                        .map(|(name, v)| format!("{name} {}", v.word()))
                        .collect();
                    format!(
                        "{} of {} out of bounds: {}",
                        bad.len(),
                        items.len(),
                        list(&bad)
                    )
                }
                Status::Unknown => {
                    let unread: Vec<String> = items
                        .iter()
                        .filter(|(_, v)| *v == Verdict::Unspecified)
                        .map(|(name, _)| name.clone())
                        .collect();
                    format!(
                        "{} of {} not evaluated: {}",
                        unread.len(),
                        items.len(),
                        list(&unread)
                    )
                }
                Status::False => format!("all {} within bounds", items.len()),
            };
            Condition::new(type_, status, &reason, message)
        })
        .collect()
}

/// Whether an Event is a warning or a recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransitionKind {
    /// A problem condition turned `True`, or stayed `True` with another reason.
    Problem,
    /// A problem condition went from `True` back to `False`.
    Recovered,
}

/// A problem condition's change worth a Node Event (as NPD emits one when a condition changes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub type_: String,
    pub kind: TransitionKind,
    pub reason: String,
    pub message: String,
}

/// The Event-worthy changes from `current` to `desired` among problem conditions. A problem
/// condition first written `False` is no event (it is every healthy node's first state). A
/// stale node's `Unknown` is judged as the `True` it kept, if it kept one (see
/// [`stale_message`]): the Events follow what the agent said, not the gaps between its answers.
pub fn transitions(current: &[Written], desired: &[Condition]) -> Vec<Transition> {
    desired
        .iter()
        .filter(|c| is_problem_type(&c.type_))
        .filter_map(|c| {
            let was_true = current
                .iter()
                .find(|w| w.condition.type_ == c.type_)
                .and_then(|w| last_true_reason(&w.condition));
            let kind = match c.status {
                Status::True if was_true != Some(c.reason.as_str()) => TransitionKind::Problem,
                Status::False if was_true.is_some() => TransitionKind::Recovered,
                _ => return None,
            };
            Some(Transition {
                type_: c.type_.clone(),
                kind,
                reason: c.reason.clone(),
                message: c.message.clone(),
            })
        })
        .collect()
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
    use crate::view::{GpuInfo, IndicatorView, PluginView, ProblemConditionView, TunableView};
    use nodekeeper_model::tuning::Features;

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

    fn problem(type_: &str, status: &str, reason: &str) -> ProblemConditionView {
        ProblemConditionView {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: format!("{type_} {reason}"),
            source: "kernel-monitor".into(),
            transition_unix_ms: 1,
        }
    }

    fn indicator(name: &str, value: f64, verdict: Verdict) -> IndicatorView {
        IndicatorView {
            name: name.into(),
            value,
            unit: "percent".into(),
            verdict,
            message: format!("{value}% used"),
        }
    }

    fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
        conditions.iter().find(|c| c.type_ == type_)
    }

    #[test]
    fn reserved_types_cover_every_type_nodekeeper_or_the_kubelet_writes() {
        for t in OWNED_TYPES.iter().chain(&[
            names::NODE_CONDITION_MAINTENANCE_PLANNED,
            names::NODE_CONDITION_MAINTENANCE_IN_PROGRESS,
            names::NODE_CONDITION_DRAIN_IN_PROGRESS,
            names::NODE_CONDITION_DRAINED,
            "Ready",
        ]) {
            assert!(RESERVED_CONDITION_TYPES.contains(t), "{t}");
        }
    }

    #[test]
    fn agent_problems_are_mirrored_with_npd_polarity_and_reserved_types_refused() {
        let mut view = NodeView::default();
        view.problems.conditions = vec![
            problem("KernelDeadlock", "True", "DockerHung"),
            problem("ReadonlyFilesystem", "False", "FilesystemIsNotReadOnly"),
            // A rule file must not be able to overwrite the kubelet's Ready.
            problem("Ready", "False", "Hijacked"),
            problem("Odd", "maybe", "R"),
        ];
        let want =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        let kd = find(&want, "KernelDeadlock").unwrap();
        assert_eq!(
            (kd.status, kd.reason.as_str()),
            (Status::True, "DockerHung")
        );
        assert_eq!(
            find(&want, "ReadonlyFilesystem").unwrap().status,
            Status::False
        );
        assert_eq!(find(&want, "Ready"), None);
        assert_eq!(find(&want, "Odd").unwrap().status, Status::Unknown);
        // Off: none of them.
        let mut off = TuningConfig::default();
        off.features.problems = false;
        let want = desired_conditions(Observation::Fresh(&view), &off, &[]).unwrap();
        assert_eq!(find(&want, "KernelDeadlock"), None);
    }

    #[test]
    fn signals_map_verdicts_to_configured_types_without_values_in_messages() {
        let mut view = NodeView {
            indicators: vec![
                indicator("disk./.used_percent", 50.0, Verdict::Ok),
                indicator("disk./var/lib.used_percent", 93.0, Verdict::Critical),
                indicator("disk./var/lib.inodes_used_percent", 10.0, Verdict::Ok),
                indicator("psi.io.some_avg60", 0.0, Verdict::Unspecified),
                indicator("memory.available_percent", 3.0, Verdict::Critical),
            ],
            plugins: vec![PluginView {
                name: "osms".into(),
                state: "RUNNING".into(),
                message: String::new(),
                verdict: Verdict::Ok,
            }],
            ..Default::default()
        };
        let mut config = TuningConfig::default();
        assert_eq!(
            desired_conditions(Observation::Fresh(&view), &config, &[])
                .unwrap()
                .iter()
                .find(|c| c.reason.starts_with("PressureStall")),
            None,
            "pressure stalls are opt-in"
        );
        config
            .problems
            .signals
            .insert(Signal::Psi, "PressureStallHigh".into());
        let a = desired_conditions(Observation::Fresh(&view), &config, &[]).unwrap();
        let disk = find(&a, "DiskUsageHigh").unwrap();
        assert_eq!(
            (disk.status, disk.reason.as_str(), disk.message.as_str()),
            (
                Status::True,
                "DiskUsageCritical",
                "1 of 2 out of bounds: disk./var/lib.used_percent critical"
            )
        );
        let inodes = find(&a, "InodeUsageHigh").unwrap();
        assert_eq!(
            (inodes.status, inodes.reason.as_str()),
            (Status::False, "InodeUsageNormal")
        );
        assert_eq!(
            find(&a, "PressureStallHigh").unwrap().status,
            Status::Unknown
        );
        assert_eq!(
            find(&a, "OcaPluginUnhealthy").unwrap().status,
            Status::False
        );
        // No conntrack, time or GPU figures reported: no opinion on those types.
        for absent in ["ConntrackUsageHigh", "NTPProblem", "GpuUnhealthy"] {
            assert_eq!(find(&a, absent), None, "{absent}");
        }
        // The value drifts, the verdict holds: no change, no write.
        view.indicators[1].value = 97.0;
        view.indicators[1].message = "97% used".into();
        let b = desired_conditions(Observation::Fresh(&view), &config, &[]).unwrap();
        assert!(!changed(&written(&a), &b));

        // Two signals on one type: the worst decides; an agent rule's type wins over a signal.
        let mut merged = TuningConfig::default();
        merged
            .problems
            .signals
            .insert(Signal::Inodes, "DiskUsageHigh".into());
        merged
            .problems
            .signals
            .insert(Signal::OcaPlugins, "KernelDeadlock".into());
        view.problems.conditions = vec![problem("KernelDeadlock", "False", "KernelHasNoDeadlock")];
        let c = desired_conditions(Observation::Fresh(&view), &merged, &[]).unwrap();
        let disk = find(&c, "DiskUsageHigh").unwrap();
        assert_eq!(disk.reason, "DiskUsageCritical");
        assert!(
            disk.message.starts_with("1 of 3 out of bounds"),
            "{}",
            disk.message
        );
        assert_eq!(
            find(&c, "KernelDeadlock").unwrap().reason,
            "KernelHasNoDeadlock"
        );
    }

    #[test]
    fn a_drifting_tunable_value_is_no_change() {
        let mut view = NodeView {
            tunables: vec![tunable("a", Verdict::Warning)],
            ..Default::default()
        };
        let config = TuningConfig::default();
        let a = desired_conditions(Observation::Fresh(&view), &config, &[]).unwrap();
        view.tunables[0].current = "129".into();
        let b = desired_conditions(Observation::Fresh(&view), &config, &[]).unwrap();
        assert!(!changed(&written(&a), &b), "{a:?} vs {b:?}");
    }

    #[test]
    fn problem_transitions_become_events_once() {
        let c = |status, reason: &str| Condition::new("KernelDeadlock", status, reason, "m");
        let healthy = c(Status::False, "KernelHasNoDeadlock");
        let sick = c(Status::True, "DockerHung");
        // First write, healthy: no event. Turning True: a problem event. Back: a recovery.
        assert!(transitions(&[], std::slice::from_ref(&healthy)).is_empty());
        let t = transitions(
            &written(std::slice::from_ref(&healthy)),
            std::slice::from_ref(&sick),
        );
        assert_eq!(t.len(), 1);
        assert_eq!(
            (t[0].kind, t[0].reason.as_str()),
            (TransitionKind::Problem, "DockerHung")
        );
        let t = transitions(
            &written(std::slice::from_ref(&sick)),
            std::slice::from_ref(&healthy),
        );
        assert_eq!(t[0].kind, TransitionKind::Recovered);
        // Same state: nothing. Another reason while True: a new problem event.
        assert!(
            transitions(
                &written(std::slice::from_ref(&sick)),
                std::slice::from_ref(&sick)
            )
            .is_empty()
        );
        let other = c(Status::True, "AUFSUmountHung");
        assert_eq!(transitions(&written(&[sick]), &[other]).len(), 1);
        // nodekeeper's own types never make events here.
        let reach = Condition::new(REACHABLE, Status::False, "AgentUnreachable", "m");
        assert!(transitions(&[], &[reach]).is_empty());
    }

    /// Regression: the `Unknown` a stale node's problem condition turns counted as "not True",
    /// so an agent answering again with the `True` it had before raised a second "is now True"
    /// Event, and one answering `False` raised no recovery.
    #[test]
    fn a_stale_spell_raises_no_event_of_its_own() {
        let config = TuningConfig::default();
        let stale = Observation::Stale {
            address: "127.1.0.9:9443",
            class: FailureClass::Unreachable,
            stale_after: Duration::from_secs(900),
        };
        let fresh = |status: &str, reason: &str| {
            let mut view = NodeView::default();
            view.problems.conditions = vec![problem("KernelDeadlock", status, reason)];
            view
        };
        let sick = fresh("True", "DockerHung");
        let healthy = fresh("False", "KernelHasNoDeadlock");
        let events = |before: &[Written], view: &NodeView| {
            let after = desired_conditions(Observation::Fresh(view), &config, before).unwrap();
            transitions(before, &after)
                .into_iter()
                .map(|t| (t.kind, t.reason))
                .collect::<Vec<_>>()
        };
        // True, then stale for two reads, then True again: the one Event was raised before.
        let was_sick =
            written(&desired_conditions(Observation::Fresh(&sick), &config, &[]).unwrap());
        let once = written(&desired_conditions(stale, &config, &was_sick).unwrap());
        assert_eq!(
            find(
                &once.iter().map(|w| w.condition.clone()).collect::<Vec<_>>(),
                "KernelDeadlock"
            )
            .unwrap()
            .status,
            Status::Unknown
        );
        let twice = written(&desired_conditions(stale, &config, &once).unwrap());
        assert!(!changed(
            &once,
            &twice
                .iter()
                .map(|w| w.condition.clone())
                .collect::<Vec<_>>()
        ));
        assert_eq!(events(&twice, &sick), []);
        // Back False: the recovery the Event said True asks for.
        assert_eq!(
            events(&twice, &healthy),
            [(TransitionKind::Recovered, "KernelHasNoDeadlock".to_owned())]
        );
        // Back True with another reason: a new problem.
        assert_eq!(
            events(&twice, &fresh("True", "AUFSUmountHung")),
            [(TransitionKind::Problem, "AUFSUmountHung".to_owned())]
        );
        // False before the spell: False after is nothing, True after is a problem.
        let was_healthy = written(
            &desired_conditions(
                stale,
                &config,
                &written(&desired_conditions(Observation::Fresh(&healthy), &config, &[]).unwrap()),
            )
            .unwrap(),
        );
        assert_eq!(events(&was_healthy, &healthy), []);
        assert_eq!(
            events(&was_healthy, &sick),
            [(TransitionKind::Problem, "DockerHung".to_owned())]
        );
    }

    /// Regression: a stale node's `NodeNetworkReady` lost the generation its message named, and
    /// with it the one clue a restarted NodeNetworkConfig controller has that the object's host
    /// side is on the node (`generation <uid>/`, see its `touched_per_node_condition`).
    #[test]
    fn a_stale_network_condition_keeps_its_generation() {
        let config = TuningConfig::default();
        let stale = Observation::Stale {
            address: "127.1.0.9:9443",
            class: FailureClass::Unreachable,
            stale_after: Duration::from_secs(900),
        };
        let network = |conditions: &[Condition]| {
            find(conditions, NETWORK_READY)
                .expect("a NodeNetworkReady")
                .clone()
        };
        let mut view = NodeView::default();
        view.network.applied_generation = "6f1c-uid/3".into();
        view.network.drifted = true;
        view.network.drift = vec!["address 10.0.0.5/24 missing on nk-v21".into()];
        let before = written(&desired_conditions(Observation::Fresh(&view), &config, &[]).unwrap());
        let once = desired_conditions(stale, &config, &before).unwrap();
        let c = network(&once);
        assert_eq!(c.status, Status::Unknown);
        assert_eq!(
            c.message,
            "no fresh report from the nodekeeper agent; host networking last known at generation 6f1c-uid/3"
        );
        // Staying stale neither nests the clause nor loses it.
        let twice = desired_conditions(stale, &config, &written(&once)).unwrap();
        assert_eq!(network(&twice), c);
        // The NodeNetworkConfig controller's own messages name it too.
        for (message, generation) in [
            ("failed at generation 7a-uid/4: attach failed", "7a-uid/4"),
            ("host networking at generation 7a-uid/5", "7a-uid/5"),
        ] {
            let by_controller = written(&[Condition::new(
                NETWORK_READY,
                Status::False,
                "NetworkApplyFailed",
                message,
            )]);
            let c = network(&desired_conditions(stale, &config, &by_controller).unwrap());
            assert!(
                c.message.ends_with(&format!("generation {generation}")),
                "{}",
                c.message
            );
        }
        // Nothing named, nothing added.
        let plain = written(&[Condition::new(NETWORK_READY, Status::False, "X", "no VNIC")]);
        let c = network(&desired_conditions(stale, &config, &plain).unwrap());
        assert_eq!(c.message, STALE_MESSAGE);
    }

    #[test]
    fn managed_types_are_read_from_our_status_apply_only() {
        let entries: Vec<ManagedFieldsEntry> = serde_json::from_value(json!([
            {"manager": FIELD_MANAGER, "operation": "Apply", "subresource": "status",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:conditions": {
                "k:{\"type\":\"KernelDeadlock\"}": {".": {}, "f:status": {}},
                "k:{\"type\":\"NodekeeperReachable\"}": {".": {}}}}}},
            {"manager": "kubelet", "operation": "Update", "subresource": "status",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:conditions": {
                "k:{\"type\":\"Ready\"}": {}}}}},
        ]))
        .unwrap();
        let types = managed_condition_types(&entries);
        assert_eq!(
            types.into_iter().collect::<Vec<_>>(),
            ["KernelDeadlock", "NodekeeperReachable"]
        );
    }

    #[test]
    fn a_stale_node_keeps_the_most_specific_failure_until_it_answers() {
        let config = TuningConfig::default();
        let stale = |class| Observation::Stale {
            address: "127.1.0.9:9443",
            class,
            stale_after: Duration::from_secs(900),
        };
        // An agent that distrusts us: an alert on one call, a closed connection on the next.
        let first = desired_conditions(stale(FailureClass::Certificate), &config, &[]).unwrap();
        let shown = written(&first);
        let class = stale_class(FailureClass::Unreachable, &shown);
        assert_eq!(class, FailureClass::Certificate);
        let again = desired_conditions(stale(class), &config, &shown).unwrap();
        assert!(!changed(&shown, &again), "rewritten: {again:?}");
        // A more telling failure replaces a vague one at once.
        let vague =
            written(&desired_conditions(stale(FailureClass::Unreachable), &config, &[]).unwrap());
        assert_eq!(
            stale_class(FailureClass::InvalidReply, &vague),
            FailureClass::InvalidReply
        );
        // Once the agent answered (Reachable True), the next outage starts afresh.
        let view = NodeView::default();
        let answered =
            written(&desired_conditions(Observation::Fresh(&view), &config, &shown).unwrap());
        assert_eq!(
            stale_class(FailureClass::Unreachable, &answered),
            FailureClass::Unreachable
        );
    }

    #[test]
    fn stale_turns_problem_types_unknown() {
        let mut view = NodeView::default();
        view.problems.conditions = vec![problem("KernelDeadlock", "True", "DockerHung")];
        let config = TuningConfig::default();
        let before = desired_conditions(Observation::Fresh(&view), &config, &[]).unwrap();
        let stale = Observation::Stale {
            address: "127.1.0.9:9443",
            class: FailureClass::Unreachable,
            stale_after: Duration::from_secs(900),
        };
        let after = desired_conditions(stale, &config, &written(&before)).unwrap();
        assert_eq!(
            find(&after, "KernelDeadlock").unwrap().status,
            Status::Unknown
        );
    }

    #[test]
    fn healthy_node_without_gpu_or_networking() {
        let view = NodeView {
            tunables: vec![tunable("a", Verdict::Ok)],
            ..Default::default()
        };
        let want =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
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
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        let c = want.iter().find(|c| c.type_ == TUNABLES_IN_BOUNDS).unwrap();
        assert_eq!(c.status, Status::False);
        assert_eq!(c.reason, reason::TUNABLES_OUT_OF_BOUNDS);
        assert!(
            c.message
                .starts_with("8 of 9 rules out of bounds: r0 (net.r0, expected >= 4096, warning)"),
            "{}",
            c.message
        );
        assert!(c.message.ends_with("; and 3 more"), "{}", c.message);
    }

    #[test]
    fn a_failed_repair_is_named_without_paths_or_values() {
        let mut t = tunable("somaxconn", Verdict::Warning);
        t.error = "write /proc/sys/net/core/somaxconn: Permission denied (os error 13)".into();
        let view = NodeView {
            tunables: vec![t],
            ..NodeView::default()
        };
        let a =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        let c = find(&a, TUNABLES_IN_BOUNDS).unwrap();
        assert_eq!(c.status, Status::False);
        assert!(
            c.message
                .ends_with(", warning, repair failed: permission denied)"),
            "{}",
            c.message
        );
        assert!(!c.message.contains("/proc"), "{}", c.message);
        // The kernel refusing the value is a failed repair too, said the same on every read.
        let mut view = view;
        view.tunables[0].error = "the kernel kept \"128\" after nodekeeper wrote \"4096\"".into();
        let b =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        let c = find(&b, TUNABLES_IN_BOUNDS).unwrap();
        assert!(
            c.message
                .contains("repair failed: the kernel kept another value"),
            "{}",
            c.message
        );
        view.tunables[0].error = "the kernel kept \"129\" after nodekeeper wrote \"4096\"".into();
        let d =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        assert!(!changed(&written(&b), &d));
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
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
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
        let a =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
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
        let b =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        assert!(!changed(&written(&a), &b));
        // Feature off: no GpuHealthy at all.
        let mut off = TuningConfig {
            features: Features {
                gpu: false,
                ..Features::default()
            },
            ..TuningConfig::default()
        };
        off.problems.signals.clear();
        let c = desired_conditions(Observation::Fresh(&view), &off, &[]).unwrap();
        assert!(!types(&c).contains(&GPU_HEALTHY));
    }

    fn gpu_info(index: u32, verdict: Verdict) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            model: "H100".into(),
            memory_total_mib: 0,
            memory_used_mib: 0,
            temperature_c: 40.0,
            utilization_percent: 0.0,
            ecc_uncorrected: 0,
            xid_events: 0,
            verdict,
            message: String::new(),
        }
    }

    fn gpu_healthy(view: &NodeView) -> Option<Condition> {
        desired_conditions(Observation::Fresh(view), &TuningConfig::default(), &[])
            .unwrap()
            .into_iter()
            .find(|c| c.type_ == GPU_HEALTHY)
    }

    #[test]
    fn missing_gpus_reach_the_node_from_the_overall_verdict() {
        let mut view = NodeView::default();
        view.gpu.present = true;
        view.gpu.source = "nvml".into();
        view.gpu.expected = Some(8);
        view.gpu.gpus = (0..7).map(|i| gpu_info(i, Verdict::Ok)).collect();
        view.gpu.verdict = Verdict::Critical;
        view.gpu.message = "expected 8 GPUs, found 7".into();
        let c = gpu_healthy(&view).unwrap();
        assert_eq!(
            (c.status, c.reason.as_str(), c.message.as_str()),
            (
                Status::False,
                reason::GPU_UNHEALTHY,
                "0 of 7 GPUs unhealthy: expected 8 GPUs, found 7"
            )
        );
        // The GPU signal (GpuUnhealthy by default) says the same.
        let all =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        let signal = find(&all, "GpuUnhealthy").unwrap();
        assert_eq!(signal.status, Status::True, "{signal:?}");
        assert!(
            signal.message.contains("expected 8 GPUs, found 7"),
            "{signal:?}"
        );

        // No GPU found at all (neither NVML nor nvidia-smi answered): still a problem.
        view.gpu = crate::view::GpuView {
            expected: Some(1),
            verdict: Verdict::Critical,
            message: "expected 1 GPUs, found 0 (neither NVML nor nvidia-smi is on this node)"
                .into(),
            ..Default::default()
        };
        let c = gpu_healthy(&view).unwrap();
        assert_eq!(c.status, Status::False, "{c:?}");
        assert!(c.message.contains("expected 1 GPUs, found 0"), "{c:?}");

        // The overall verdict that only repeats a GPU's adds nothing to the message.
        view.gpu = crate::view::GpuView {
            present: true,
            gpus: vec![gpu_info(0, Verdict::Critical)],
            verdict: Verdict::Critical,
            ..Default::default()
        };
        let c = gpu_healthy(&view).unwrap();
        assert_eq!(c.message, "1 of 1 GPUs unhealthy: GPU 0 (GPU-0) critical");
    }

    #[test]
    fn gpu_healthy_is_false_only_for_critical() {
        let mut view = NodeView::default();
        view.gpu.present = true;
        view.gpu.source = "nvml".into();
        let with = |view: &mut NodeView, verdicts: &[Verdict]| {
            view.gpu.gpus = verdicts
                .iter()
                .zip(0..)
                .map(|(v, i)| gpu_info(i, *v))
                .collect();
            view.gpu.verdict = *verdicts.iter().max_by_key(|v| severity(**v)).unwrap();
            gpu_healthy(view).unwrap()
        };
        let c = with(&mut view, &[Verdict::Ok, Verdict::Ok]);
        assert_eq!(
            (c.status, c.reason.as_str()),
            (Status::True, reason::GPUS_HEALTHY)
        );
        // A warning (row remapping pending, thermal slowdown) is no reason to replace the node.
        let c = with(&mut view, &[Verdict::Ok, Verdict::Warning]);
        assert_eq!(
            (c.status, c.reason.as_str(), c.message.as_str()),
            (
                Status::True,
                reason::GPU_WARNING,
                "1 of 2 GPUs with warnings: GPU 1 (GPU-1) warning"
            )
        );
        // Unread is unknown, neither healthy nor broken.
        let c = with(&mut view, &[Verdict::Unspecified, Verdict::Ok]);
        assert_eq!(
            (c.status, c.reason.as_str(), c.message.as_str()),
            (
                Status::Unknown,
                reason::GPU_NOT_EVALUATED,
                "1 of 2 GPUs not evaluated: GPU 0 (GPU-0) not evaluated"
            )
        );
        let c = with(&mut view, &[Verdict::Unspecified, Verdict::Warning]);
        assert_eq!(c.status, Status::Unknown, "{c:?}");
        // Critical wins over everything, a failed tool included.
        view.gpu.error = "XID events: boom".into();
        let c = with(&mut view, &[Verdict::Unspecified, Verdict::Critical]);
        assert_eq!(
            (c.status, c.reason.as_str()),
            (Status::False, reason::GPU_UNHEALTHY)
        );
        let c = with(&mut view, &[Verdict::Ok]);
        assert_eq!(
            (c.status, c.reason.as_str(), c.message.as_str()),
            (
                Status::Unknown,
                reason::GPU_TOOL_FAILED,
                "0 of 1 GPUs not evaluated: nvml failed: XID events: boom"
            )
        );
    }

    #[test]
    fn network_condition_follows_drift_and_errors() {
        let mut view = NodeView::default();
        let net = |v: &NodeView| {
            desired_conditions(Observation::Fresh(v), &TuningConfig::default(), &[])
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
        assert_eq!(
            net(&view).unwrap().message,
            "drifted from generation uid/3: address 10.0.0.5/24 missing on nk-v21"
        );
        view.network.last_error = "add-route failed".into();
        let c = net(&view).unwrap();
        assert_eq!(c.reason, reason::NETWORK_APPLY_FAILED);
        assert_eq!(
            c.message,
            "add-route failed; host networking stays at generation uid/3"
        );
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
        let current = written(std::slice::from_ref(&nnc));
        let desired = desired_conditions(
            Observation::Fresh(&view),
            &TuningConfig::default(),
            &current,
        )
        .unwrap();
        let network: Vec<&Condition> = desired
            .iter()
            .filter(|c| c.type_ == NETWORK_READY)
            .collect();
        assert_eq!(network, [&nnc]);
        // Once the agent has applied, its own word wins again.
        let mut applied = NodeView::default();
        applied.network.applied_generation = "uid/3".into();
        let desired = desired_conditions(
            Observation::Fresh(&applied),
            &TuningConfig::default(),
            &current,
        )
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
            desired_conditions(Observation::Pending, &TuningConfig::default(), &[]),
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
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
        let current = written(&before);
        let stale = Observation::Stale {
            address: "127.1.0.9:9443",
            class: FailureClass::Certificate,
            stale_after: Duration::from_secs(900),
        };
        let after = desired_conditions(stale, &TuningConfig::default(), &current).unwrap();
        assert_eq!(types(&after), vec![REACHABLE, TUNABLES_IN_BOUNDS]);
        assert_eq!(after[0].status, Status::False);
        assert_eq!(after[0].reason, reason::AGENT_CERTIFICATE_REJECTED);
        assert!(
            after[0].message.starts_with(
                "the nodekeeper agent at 127.1.0.9:9443 has failed the mutual-TLS handshake for \
                 more than 15m; "
            ),
            "{}",
            after[0].message
        );
        // What to check: the Secrets, and where the handshake's own error is.
        for named in [
            "nodekeeper-agent-tls",
            "nodekeeper-ca",
            "kubectl nodekeeper node",
        ] {
            assert!(after[0].message.contains(named), "{}", after[0].message);
        }
        assert_eq!(after[1].status, Status::Unknown);
        assert!(changed(&current, &after));
        // Staying stale is no change: no second write.
        assert!(!changed(
            &written(&after),
            &desired_conditions(stale, &TuningConfig::default(), &written(&after)).unwrap()
        ));
    }

    #[test]
    fn changed_ignores_times_and_order_but_sees_removals() {
        let view = NodeView::default();
        let want =
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
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
            desired_conditions(Observation::Fresh(&view), &TuningConfig::default(), &[]).unwrap();
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
