//! The controller's Prometheus metrics: one sub-registry per subsystem, and only bounded label
//! values (outcome classes, condition types and statuses — never node names or error strings).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// How one agent call ended. A closed set, so the label stays bounded.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum CallOutcome {
    /// A full report arrived.
    Report,
    /// The agent said our copy is current.
    Unchanged,
    /// No TCP connection (refused, unreachable).
    Connect,
    /// The call did not finish within the per-call timeout.
    Timeout,
    /// The TLS handshake failed: wrong or untrusted certificate on either side.
    Tls,
    /// The reply was not a valid report (garbage, not gRPC, wrong node, missing fields).
    InvalidReply,
    /// The reply exceeded the size limit.
    TooLarge,
    /// The agent answered with a gRPC error status.
    Status,
}

impl CallOutcome {
    pub fn is_success(self) -> bool {
        matches!(self, CallOutcome::Report | CallOutcome::Unchanged)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: CallOutcome,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum WriteResult {
    Ok,
    Error,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: WriteResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: SkipReason,
}

/// Why a node was not read.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum SkipReason {
    /// The Node has no InternalIP address.
    NoInternalIp,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    /// One of the few condition types nodekeeper owns.
    pub condition: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
}

/// Every metric the controller exports.
pub struct Metrics {
    pub agent_calls: Family<OutcomeLabels, Counter>,
    pub agent_call_seconds: Histogram,
    pub set_rules_calls: Family<ResultLabels, Counter>,
    pub nodes_known: Gauge,
    pub nodes_stale: Gauge,
    pub nodes_skipped: Family<ReasonLabels, Counter>,
    pub nodes_read_once: Gauge,
    pub initial_sweep_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub calls_in_flight: Gauge,
    pub condition_patches: Family<ResultLabels, Counter>,
    pub conditions: Family<ConditionLabels, Gauge>,
    pub tuning_reloads: Family<ResultLabels, Counter>,
    pub tuning_invalid_keys: Counter,
    pub is_leader: Gauge,
    pub certificate_renewals: Counter,
}

impl Metrics {
    /// Creates the metrics and registers them under `nodekeeper_…`.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            agent_calls: Family::default(),
            agent_call_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            set_rules_calls: Family::default(),
            nodes_known: Gauge::default(),
            nodes_stale: Gauge::default(),
            nodes_skipped: Family::default(),
            nodes_read_once: Gauge::default(),
            initial_sweep_seconds: Gauge::default(),
            calls_in_flight: Gauge::default(),
            condition_patches: Family::default(),
            conditions: Family::default(),
            tuning_reloads: Family::default(),
            tuning_invalid_keys: Counter::default(),
            is_leader: Gauge::default(),
            certificate_renewals: Counter::default(),
        };
        let root = registry.sub_registry_with_prefix("nodekeeper");

        let sweep = root.sub_registry_with_prefix("sweep");
        sweep.register(
            "agent_calls",
            "Agent GetReport calls by outcome",
            m.agent_calls.clone(),
        );
        sweep.register(
            "agent_call_seconds",
            "Duration of one agent call, connect included",
            m.agent_call_seconds.clone(),
        );
        sweep.register(
            "set_rules_calls",
            "SetRules calls by result",
            m.set_rules_calls.clone(),
        );
        sweep.register(
            "nodes_known",
            "Nodes the controller watches",
            m.nodes_known.clone(),
        );
        sweep.register(
            "nodes_stale",
            "Nodes whose agent has not answered within staleAfter",
            m.nodes_stale.clone(),
        );
        sweep.register(
            "nodes_skipped",
            "Node observations skipped, by reason",
            m.nodes_skipped.clone(),
        );
        sweep.register(
            "nodes_read",
            "Nodes whose agent answered at least once since this process became leader",
            m.nodes_read_once.clone(),
        );
        sweep.register(
            "initial_sweep_seconds",
            "Seconds from becoming leader until every known node was read once (0 until then)",
            m.initial_sweep_seconds.clone(),
        );
        sweep.register(
            "calls_in_flight",
            "Agent calls in flight",
            m.calls_in_flight.clone(),
        );

        let conditions = root.sub_registry_with_prefix("conditions");
        conditions.register(
            "patches",
            "Node condition patches (server-side apply) by result",
            m.condition_patches.clone(),
        );
        conditions.register(
            "nodes",
            "Nodes by nodekeeper condition type and status",
            m.conditions.clone(),
        );

        let tuning = root.sub_registry_with_prefix("tuning");
        tuning.register(
            "reloads",
            "Tuning ConfigMap versions read, by result",
            m.tuning_reloads.clone(),
        );
        tuning.register(
            "invalid_keys",
            "Invalid keys found in tuning ConfigMaps",
            m.tuning_invalid_keys.clone(),
        );

        let runtime = root.sub_registry_with_prefix("controller");
        runtime.register(
            "is_leader",
            "1 while this replica holds the Lease",
            m.is_leader.clone(),
        );
        runtime.register(
            "certificate_renewals",
            "Certificates reissued before expiry",
            m.certificate_renewals.clone(),
        );
        m
    }
}
