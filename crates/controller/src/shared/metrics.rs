//! The controller's Prometheus metrics: one struct and one sub-registry per subsystem (`sweep`,
//! `conditions`, `tuning`, `controller`, `agents`, `reconcile`, `problems`, `cloud`), and only bounded
//! label values (outcome classes, method and controller names, condition types and statuses —
//! never node names or error strings). The one exception to the `nodekeeper_`
//! prefix is node-problem-detector's `problem_counter` / `problem_gauge`, kept under NPD's names
//! so that alert rules written for NPD keep working ([`ProblemTotals`]). Object names appear
//! only in the status gauges of the objects people create ([`ObjectStatus`]: NetworkTest,
//! NodeMaintenance, NodeNetworkConfig), one series per object while it exists, as
//! kube-state-metrics does, so that an alert can name the object to look at.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use kube::runtime::reflector::Store;
use nodekeeper_api::crd::common::{Condition, ConditionStatus};
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_api::crd::{NetworkTest, NodeMaintenance, NodeNetworkConfig};
use nodekeeper_api::names::{CONDITION_PROGRESSING, REASON_PAUSED};

pub use super::agent_client::CallOutcome;

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

/// How a write to the Kubernetes API ended: `Ok`, or the class of its failure. Bounded: the
/// status code's class, never the message.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum PatchResult {
    Ok,
    /// No answer in time: the client's timeout, or the apiserver's 504/408 (the write may
    /// have landed anyway).
    Timeout,
    /// Another 5xx (the apiserver or etcd overloaded or failing).
    ServerError,
    /// 409: a conflicting write.
    Conflict,
    /// Another 4xx: the request was refused (RBAC, validation, the object is gone).
    ClientError,
    /// No HTTP answer at all (connection refused or reset, TLS).
    Transport,
}

impl PatchResult {
    /// The class of a failed write.
    pub fn of(error: &kube::Error) -> Self {
        match error {
            kube::Error::Api(status) => match status.code {
                408 | 504 => Self::Timeout,
                409 => Self::Conflict,
                500..=599 => Self::ServerError,
                _ => Self::ClientError,
            },
            other => {
                // kube wraps the client's timeout in a transport error; only its text says so.
                let text = other.to_string().to_ascii_lowercase();
                if text.contains("timed out") || text.contains("timeout") {
                    Self::Timeout
                } else {
                    Self::Transport
                }
            }
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PatchLabels {
    pub result: PatchResult,
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

/// Every metric the controller exports, by subsystem.
pub struct Metrics {
    pub sweep: SweepMetrics,
    pub conditions: ConditionMetrics,
    pub tuning: TuningMetrics,
    pub runtime: RuntimeMetrics,
    pub agents: AgentMetrics,
    pub reconcile: ReconcileMetrics,
    pub problems: ProblemMetrics,
    pub cloud: CloudMetrics,
    pub maintenance: MaintenanceMetrics,
}

impl Metrics {
    /// Creates the metrics and registers each subsystem under `nodekeeper_<subsystem>_…`.
    pub fn new(registry: &mut Registry) -> Self {
        let totals = Arc::new(ProblemTotals::default());
        registry.register_collector(Box::new(Arc::clone(&totals)));
        let root = registry.sub_registry_with_prefix("nodekeeper");
        let objects = ObjectStatus::default();
        root.register_collector(Box::new(objects.clone()));
        Self {
            sweep: SweepMetrics::register(root.sub_registry_with_prefix("sweep")),
            conditions: ConditionMetrics::register(root.sub_registry_with_prefix("conditions")),
            tuning: TuningMetrics::register(root.sub_registry_with_prefix("tuning")),
            runtime: RuntimeMetrics::register(root.sub_registry_with_prefix("controller")),
            agents: AgentMetrics::register(root.sub_registry_with_prefix("agents")),
            reconcile: ReconcileMetrics::register(
                root.sub_registry_with_prefix("reconcile"),
                objects,
            ),
            problems: ProblemMetrics::register(root.sub_registry_with_prefix("problems"), totals),
            cloud: CloudMetrics::register(root.sub_registry_with_prefix("cloud")),
            maintenance: MaintenanceMetrics::register(root.sub_registry_with_prefix("maintenance")),
        }
    }
}

/// The fleet sweep and the Node watch that feeds it.
#[derive(Clone)]
pub struct SweepMetrics {
    pub agent_calls: Family<OutcomeLabels, Counter>,
    pub agent_call_seconds: Histogram,
    pub set_rules_calls: Family<ResultLabels, Counter>,
    pub nodes_known: Gauge,
    pub nodes_stale: Gauge,
    pub nodes_unreachable: Gauge,
    pub nodes_refusing_rules: Gauge,
    pub nodes_skipped: Family<ReasonLabels, Counter>,
    pub nodes_read_once: Gauge,
    pub initial_sweep_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub calls_in_flight: Gauge,
}

impl SweepMetrics {
    fn register(sweep: &mut Registry) -> Self {
        let m = Self {
            agent_calls: Family::default(),
            agent_call_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            set_rules_calls: Family::default(),
            nodes_known: Gauge::default(),
            nodes_stale: Gauge::default(),
            nodes_unreachable: Gauge::default(),
            nodes_refusing_rules: Gauge::default(),
            nodes_skipped: Family::default(),
            nodes_read_once: Gauge::default(),
            initial_sweep_seconds: Gauge::default(),
            calls_in_flight: Gauge::default(),
        };
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
            "nodes_unreachable",
            "Nodes whose agent's latest call failed (set at once; stale only after staleAfter)",
            m.nodes_unreachable.clone(),
        );
        sweep.register(
            "nodes_refusing_rules",
            "Nodes whose agent refused the rules revision the controller accepted",
            m.nodes_refusing_rules.clone(),
        );
        sweep.register(
            "nodes_skipped",
            "Node observations skipped, by reason",
            m.nodes_skipped.clone(),
        );
        sweep.register(
            "nodes_read",
            "Nodes whose report the controller holds: their agent answered since this process became leader and has not been stale since",
            m.nodes_read_once.clone(),
        );
        sweep.register(
            "initial_sweep_seconds",
            "Seconds from becoming leader until every node with an address was called once, answered or not (0 until then)",
            m.initial_sweep_seconds.clone(),
        );
        sweep.register(
            "calls_in_flight",
            "Agent calls in flight",
            m.calls_in_flight.clone(),
        );
        m
    }
}

/// Node condition writes and the per-condition gauges.
#[derive(Clone)]
pub struct ConditionMetrics {
    pub patches: Family<PatchLabels, Counter>,
    pub nodes: Family<ConditionLabels, Gauge>,
}

impl ConditionMetrics {
    fn register(conditions: &mut Registry) -> Self {
        let m = Self {
            patches: Family::default(),
            nodes: Family::default(),
        };
        conditions.register(
            "patches",
            "Node condition patches (server-side apply) by result: Ok, or the failure's class (Timeout, ServerError, Conflict, ClientError, Transport)",
            m.patches.clone(),
        );
        conditions.register(
            "nodes",
            "Nodes by nodekeeper condition type and status",
            m.nodes.clone(),
        );
        m
    }
}

/// The tuning ConfigMap.
#[derive(Clone)]
pub struct TuningMetrics {
    pub reloads: Family<ResultLabels, Counter>,
    pub invalid_keys: Counter,
    /// 1 while the latest ConfigMap version read was refused, 0 once a good one (or its
    /// absence) is in force. The alert reads this, not `invalid_keys`: the counter goes up once
    /// per refused version, so an `increase()` over it clears while the same refused version
    /// stays.
    pub refused: Gauge,
}

impl TuningMetrics {
    fn register(tuning: &mut Registry) -> Self {
        let m = Self {
            reloads: Family::default(),
            invalid_keys: Counter::default(),
            refused: Gauge::default(),
        };
        tuning.register(
            "reloads",
            "Tuning ConfigMap versions read, by result",
            m.reloads.clone(),
        );
        tuning.register(
            "invalid_keys",
            "Invalid keys found in tuning ConfigMaps",
            m.invalid_keys.clone(),
        );
        tuning.register(
            "refused",
            "1 while the latest tuning ConfigMap version read was refused (the last good configuration, or the defaults, stay in force); 0 once a valid one is read or it is deleted",
            m.refused.clone(),
        );
        m
    }
}

/// The NodeMaintenance controller's cache, which holds objects only while a NodeMaintenance
/// exists (`controllers::node_maintenance::cache`).
#[derive(Clone, Debug, Default)]
pub struct MaintenanceMetrics {
    pub cached_nodes: Gauge,
    pub cached_pods: Gauge,
}

impl MaintenanceMetrics {
    fn register(maintenance: &mut Registry) -> Self {
        let m = Self::default();
        maintenance.register(
            "cached_nodes",
            "Nodes in the NodeMaintenance controller's cache (0 while no NodeMaintenance exists)",
            m.cached_nodes.clone(),
        );
        maintenance.register(
            "cached_pods",
            "Scheduled pods in the NodeMaintenance controller's cache (0 while no NodeMaintenance exists)",
            m.cached_pods.clone(),
        );
        m
    }
}

/// The certificate Secret a series is about (three names: `crate::certs`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SecretLabels {
    pub secret: String,
}

/// Leadership and the PKI.
#[derive(Clone)]
pub struct RuntimeMetrics {
    pub is_leader: Gauge,
    pub certificate_renewals: Counter,
    /// Certificate checks that failed (the API server, or a CA Secret that cannot sign).
    pub certificate_check_failures: Counter,
    /// When each certificate Secret's `tls.crt` expires, as of the last successful check.
    pub certificate_expiry: Family<SecretLabels, Gauge>,
}

impl RuntimeMetrics {
    fn register(runtime: &mut Registry) -> Self {
        let m = Self {
            is_leader: Gauge::default(),
            certificate_renewals: Counter::default(),
            certificate_check_failures: Counter::default(),
            certificate_expiry: Family::default(),
        };
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
        runtime.register(
            "certificate_check_failures",
            "Certificate checks (creation, renewal, CA check) that failed",
            m.certificate_check_failures.clone(),
        );
        runtime.register(
            "certificate_expiry_timestamp_seconds",
            "When the certificate in each certificate Secret expires (Unix seconds), as of the last successful check",
            m.certificate_expiry.clone(),
        );
        m
    }
}

/// Which [`super::agents::Agents`] method a call was.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum AgentMethod {
    Report,
    RunProbes,
    ApplyNetwork,
    CollectDiagnostics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentCallLabels {
    pub method: AgentMethod,
    pub outcome: CallOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: AgentMethod,
}

/// Every call through the agents service, whichever part of the controller made it.
#[derive(Clone)]
pub struct AgentMetrics {
    pub calls: Family<AgentCallLabels, Counter>,
    pub call_seconds: Family<MethodLabels, Histogram>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            call_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 20))
            }),
        }
    }
}

impl AgentMetrics {
    fn register(agents: &mut Registry) -> Self {
        let m = Self::default();
        agents.register(
            "calls",
            "Agent calls by method and outcome",
            m.calls.clone(),
        );
        agents.register(
            "call_seconds",
            "Duration of one agent call by method, connect included",
            m.call_seconds.clone(),
        );
        m
    }

    /// Counts one finished call.
    pub fn record(&self, method: AgentMethod, outcome: CallOutcome, seconds: f64) {
        self.calls
            .get_or_create(&AgentCallLabels { method, outcome })
            .inc();
        self.call_seconds
            .get_or_create(&MethodLabels { method })
            .observe(seconds);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CloudCallLabels {
    /// The Compute API operation (`ListVnicAttachments`, `AttachVnic`, …): a fixed set.
    pub operation: &'static str,
    /// `ok` or `error`.
    pub outcome: &'static str,
}

/// Cloud (OCI Compute API) calls made by the controllers, and how many one node needed to reach
/// its result, so that the cost per node is visible without a per-node label.
#[derive(Clone)]
pub struct CloudMetrics {
    pub calls: Family<CloudCallLabels, Counter>,
    /// Calls spent on one node from its start to Applied or Failed (one observation per node
    /// and generation).
    pub calls_per_node: Histogram,
}

impl Default for CloudMetrics {
    fn default() -> Self {
        Self {
            calls: Family::default(),
            calls_per_node: Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 20.0]),
        }
    }
}

impl CloudMetrics {
    fn register(cloud: &mut Registry) -> Self {
        let m = Self::default();
        cloud.register(
            "calls",
            "OCI Compute API calls by operation and result",
            m.calls.clone(),
        );
        cloud.register(
            "calls_per_node",
            "OCI Compute API calls one node needed to reach Applied or Failed",
            m.calls_per_node.clone(),
        );
        m
    }

    /// Counts one finished call.
    pub fn record(&self, operation: &'static str, ok: bool) {
        self.calls
            .get_or_create(&CloudCallLabels {
                operation,
                outcome: if ok { "ok" } else { "error" },
            })
            .inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// The controller's fixed name (`networktest`, …): one value per controller.
    pub controller: &'static str,
}

/// Reconciles of every watch-reconcile controller, labelled by controller name only, and the
/// status gauges of the objects they cache.
#[derive(Clone)]
pub struct ReconcileMetrics {
    pub runs: Family<ControllerLabels, Counter>,
    pub failures: Family<ControllerLabels, Counter>,
    pub seconds: Family<ControllerLabels, Histogram>,
    /// Each running controller's cache, read at scrape time ([`ObjectStatus::track`]).
    pub objects: ObjectStatus,
}

impl Default for ReconcileMetrics {
    fn default() -> Self {
        Self {
            runs: Family::default(),
            failures: Family::default(),
            seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.005, 2.0, 18))
            }),
            objects: ObjectStatus::default(),
        }
    }
}

impl ReconcileMetrics {
    fn register(reconcile: &mut Registry, objects: ObjectStatus) -> Self {
        let m = Self {
            objects,
            ..Self::default()
        };
        reconcile.register("runs", "Reconciles started, by controller", m.runs.clone());
        reconcile.register(
            "failures",
            "Reconciles that returned an error, by controller",
            m.failures.clone(),
        );
        reconcile.register(
            "seconds",
            "Duration of one reconcile, by controller",
            m.seconds.clone(),
        );
        m
    }

    /// Counts one finished reconcile of `controller`.
    pub fn record(&self, controller: &'static str, ok: bool, seconds: f64) {
        let labels = ControllerLabels { controller };
        self.runs.get_or_create(&labels).inc();
        // The failures series exists from the first reconcile, at 0: `rate()` and `increase()`
        // then count the first failure too, and the dashboard's panel has a series to show.
        let failures = self.failures.get_or_create(&labels);
        if !ok {
            failures.inc();
        }
        self.seconds.get_or_create(&labels).observe(seconds);
    }
}

/// The status gauges of the objects that people create and controllers report on, read at
/// scrape time from each running controller's own cache (kube's reflector store): a series
/// exists while its object does and while this replica runs its controller, so nothing is left
/// behind when an object is deleted or leadership moves. One value per object:
///
/// - `nodekeeper_networktest_phase{namespace,name,phase}` 1 (the phase; `Pending` before the
///   first status);
/// - `nodekeeper_nodemaintenance_nodes{name,state}`: the status counts (`matched`, `cordoned`,
///   `drained`, `blocked`, `failed`);
/// - `nodekeeper_nodenetworkconfig_nodes{name,state}`: the status counts (`matched`,
///   `attached`, `applied`, `failing`), and `nodekeeper_nodenetworkconfig_paused{name}` 1 while
///   the rollout is paused (`Progressing=False`, reason `FailureThresholdReached`).
#[derive(Clone, Default)]
pub struct ObjectStatus {
    sources: Arc<Mutex<Sources>>,
}

/// Reads one cache into the samples.
type Source = Box<dyn Fn(&mut StatusSamples) + Send + Sync>;

#[derive(Default)]
struct Sources {
    next: u64,
    by_id: BTreeMap<u64, Source>,
}

impl std::fmt::Debug for ObjectStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("ObjectStatus")
            .field("caches", &sources.by_id.len())
            .finish()
    }
}

/// A cache being read; dropping it (the controller stopped) removes its series.
#[must_use = "the cache is read only while this is held"]
pub struct Tracked {
    id: u64,
    sources: Arc<Mutex<Sources>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        sources.by_id.remove(&self.id);
    }
}

impl ObjectStatus {
    /// Reads `store` at every scrape until the returned guard is dropped. Kinds without status
    /// gauges are accepted and add nothing, so every controller can be tracked the same way.
    pub fn track<K>(&self, store: Store<K>) -> Tracked
    where
        K: kube::Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        let source: Source = Box::new(move |out| {
            for object in store.state() {
                out.add(object.as_ref());
            }
        });
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        let id = sources.next;
        sources.next += 1;
        sources.by_id.insert(id, source);
        Tracked {
            id,
            sources: Arc::clone(&self.sources),
        }
    }

    fn samples(&self) -> StatusSamples {
        let sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out = StatusSamples::default();
        for source in sources.by_id.values() {
            source(&mut out);
        }
        out
    }
}

/// One gauge sample: its labels and value.
type Sample = (Vec<(&'static str, String)>, i64);

/// One scrape's status samples, by family.
#[derive(Debug, Default, PartialEq)]
struct StatusSamples {
    networktest_phase: Vec<Sample>,
    maintenance_nodes: Vec<Sample>,
    network_config_nodes: Vec<Sample>,
    network_config_paused: Vec<Sample>,
}

impl StatusSamples {
    fn add<K: std::any::Any>(&mut self, object: &K) {
        let object = object as &dyn std::any::Any;
        if let Some(test) = object.downcast_ref::<NetworkTest>() {
            let phase = match test.status.as_ref().and_then(|s| s.phase) {
                None | Some(Phase::Pending) => "Pending",
                Some(Phase::Running) => "Running",
                Some(Phase::Succeeded) => "Succeeded",
                Some(Phase::Failed) => "Failed",
            };
            let labels = vec![
                (
                    "namespace",
                    test.metadata.namespace.clone().unwrap_or_default(),
                ),
                ("name", test.metadata.name.clone().unwrap_or_default()),
                ("phase", phase.to_owned()),
            ];
            self.networktest_phase.push((labels, 1));
        } else if let Some(maintenance) = object.downcast_ref::<NodeMaintenance>() {
            let name = maintenance.metadata.name.clone().unwrap_or_default();
            let s = maintenance.status.clone().unwrap_or_default();
            let counts = [
                ("matched", s.matched),
                ("cordoned", s.cordoned),
                ("drained", s.drained),
                ("blocked", s.blocked),
                ("failed", s.failed),
            ];
            self.maintenance_nodes.extend(by_state(&name, counts));
        } else if let Some(config) = object.downcast_ref::<NodeNetworkConfig>() {
            let name = config.metadata.name.clone().unwrap_or_default();
            let s = config.status.clone().unwrap_or_default();
            let counts = [
                ("matched", s.matched),
                ("attached", s.attached),
                ("applied", s.applied),
                ("failing", s.failing),
            ];
            self.network_config_nodes.extend(by_state(&name, counts));
            let value = i64::from(paused(&s.conditions));
            self.network_config_paused
                .push((vec![("name", name)], value));
        }
    }
}

/// One `{name, state}` sample per count.
fn by_state<'a, const N: usize>(
    name: &'a str,
    counts: [(&'static str, u32); N],
) -> impl Iterator<Item = Sample> + use<'a, N> {
    counts.into_iter().map(move |(state, n)| {
        let labels = vec![("name", name.to_owned()), ("state", state.to_owned())];
        (labels, i64::from(n))
    })
}

/// Whether a NodeNetworkConfig's conditions say its rollout is paused.
fn paused(conditions: &[Condition]) -> bool {
    conditions.iter().any(|c| {
        c.type_ == CONDITION_PROGRESSING
            && c.status == ConditionStatus::False
            && c.reason == REASON_PAUSED
    })
}

impl Collector for ObjectStatus {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = self.samples();
        let families = [
            (
                "networktest_phase",
                "1 for each NetworkTest, labelled with its phase (Pending, Running, Succeeded, Failed)",
                &s.networktest_phase,
            ),
            (
                "nodemaintenance_nodes",
                "Nodes of each NodeMaintenance by state (matched, cordoned, drained, blocked, failed), from its status",
                &s.maintenance_nodes,
            ),
            (
                "nodenetworkconfig_nodes",
                "Nodes of each NodeNetworkConfig by state (matched, attached, applied, failing), from its status",
                &s.network_config_nodes,
            ),
            (
                "nodenetworkconfig_paused",
                "1 while a NodeNetworkConfig's rollout is paused at its failure threshold",
                &s.network_config_paused,
            ),
        ];
        for (name, help, samples) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (labels, value) in samples {
                let labels: Vec<(&str, &str)> =
                    labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                family.encode_family(&labels)?.encode_gauge(value)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("m", "r")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn failed_writes_are_classed_by_status_code() {
        let classes: Vec<PatchResult> = [504, 408, 500, 503, 409, 404, 403, 422]
            .into_iter()
            .map(|c| PatchResult::of(&api_error(c)))
            .collect();
        assert_eq!(
            classes,
            [
                PatchResult::Timeout,
                PatchResult::Timeout,
                PatchResult::ServerError,
                PatchResult::ServerError,
                PatchResult::Conflict,
                PatchResult::ClientError,
                PatchResult::ClientError,
                PatchResult::ClientError,
            ]
        );
    }

    #[test]
    fn every_failure_class_is_its_own_series() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        for result in [PatchResult::Ok, PatchResult::Timeout, PatchResult::Timeout] {
            metrics
                .conditions
                .patches
                .get_or_create(&PatchLabels { result })
                .inc();
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("nodekeeper_conditions_patches_total{result=\"Timeout\"} 2"),
            "{text}"
        );
        assert!(text.contains("nodekeeper_conditions_patches_total{result=\"Ok\"} 1"));
    }
}

/// How a problem Event (a temporary problem, or a problem condition's transition) ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum EventResult {
    Emitted,
    /// Over the node's `problems.eventsPerNodePerHour`: counted here, not written.
    Suppressed,
    /// The API refused it or did not answer.
    Failed,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub result: EventResult,
}

/// Node problems: the problem Events and NPD's problem metrics over the fleet.
#[derive(Clone)]
pub struct ProblemMetrics {
    pub events: Family<EventLabels, Counter>,
    pub totals: Arc<ProblemTotals>,
}

impl ProblemMetrics {
    fn register(problems: &mut Registry, totals: Arc<ProblemTotals>) -> Self {
        let m = Self {
            events: Family::default(),
            totals,
        };
        problems.register(
            "events",
            "Node problem Events by result: Emitted, Suppressed (over the per-node hourly budget) or Failed",
            m.events.clone(),
        );
        m
    }
}

/// Most `reason` values of `problem_counter` and (type, reason) pairs of `problem_gauge`; the
/// rest are summed under [`OTHER_LABEL`]. Reasons come from rule files, which any node may
/// extend, so the controller caps what it exports.
pub const MAX_PROBLEM_SERIES: usize = 256;
/// The label value series beyond [`MAX_PROBLEM_SERIES`] fall into.
pub const OTHER_LABEL: &str = "Other";
/// Longest label value kept; longer ones count as [`OTHER_LABEL`].
const MAX_LABEL_LEN: usize = 128;

fn bounded(value: &str, known: bool, len: usize) -> &str {
    if known || (len < MAX_PROBLEM_SERIES && value.len() <= MAX_LABEL_LEN) {
        value
    } else {
        OTHER_LABEL
    }
}

/// node-problem-detector's `problem_counter{reason}` (problems seen by the fleet's agents while
/// this controller leads, and problem conditions turning `True`) and `problem_gauge{type,reason}`
/// (nodes whose problem condition `type` is `True` with `reason`), aggregated over the fleet.
///
/// Both are written as gauges: in the OpenMetrics text this endpoint serves, a counter's samples
/// must end in `_total`, while NPD's series (and the alert rules written for them) are named
/// `problem_counter`. The value only ever grows, so `rate()` and `increase()` work as on NPD's.
#[derive(Debug, Default)]
pub struct ProblemTotals {
    inner: Mutex<Totals>,
}

#[derive(Debug, Default)]
struct Totals {
    counters: BTreeMap<String, u64>,
    gauges: BTreeMap<(String, String), u64>,
}

impl ProblemTotals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Totals> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `n` problems with `reason`.
    pub fn add(&self, reason: &str, n: u64) {
        if n == 0 {
            return;
        }
        let mut totals = self.lock();
        let len = totals.counters.len();
        let label = bounded(reason, totals.counters.contains_key(reason), len);
        *totals.counters.entry(label.to_owned()).or_default() += n;
    }

    /// Replaces the gauge values with `nodes` ((type, reason) → nodes). A pair seen before and
    /// absent now stays at 0, as NPD keeps a cleared condition's series.
    pub fn set_gauges(&self, nodes: &BTreeMap<(String, String), u64>) {
        let mut totals = self.lock();
        for value in totals.gauges.values_mut() {
            *value = 0;
        }
        for ((type_, reason), count) in nodes {
            let len = totals.gauges.len();
            let known = totals.gauges.contains_key(&(type_.clone(), reason.clone()));
            let key = (
                bounded(type_, known, len).to_owned(),
                bounded(reason, known, len).to_owned(),
            );
            *totals.gauges.entry(key).or_default() += count;
        }
    }

    /// The counter for `reason` (tests and the HTTP API).
    pub fn counter(&self, reason: &str) -> u64 {
        self.lock().counters.get(reason).copied().unwrap_or(0)
    }
}

impl Collector for ProblemTotals {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let totals = self.lock();
        let mut counter = encoder.encode_descriptor(
            "problem_counter",
            "Number of times a specific type of problem have occurred (node-problem-detector's metric, summed over the fleet)",
            None,
            MetricType::Gauge,
        )?;
        for (reason, n) in &totals.counters {
            counter
                .encode_family(&[("reason", reason.as_str())])?
                .encode_gauge(n)?;
        }
        let mut gauge = encoder.encode_descriptor(
            "problem_gauge",
            "Nodes a specific type of problem is affecting (node-problem-detector's metric, summed over the fleet)",
            None,
            MetricType::Gauge,
        )?;
        for ((type_, reason), n) in &totals.gauges {
            gauge
                .encode_family(&[("reason", reason.as_str()), ("type", type_.as_str())])?
                .encode_gauge(n)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod object_tests {
    use super::*;
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher::Event;

    fn encode(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text
    }

    #[test]
    fn status_gauges_follow_the_cache_and_go_with_it() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let mut tests = Writer::<NetworkTest>::default();
        let mut configs = Writer::<NodeNetworkConfig>::default();
        let mut maintenances = Writer::<NodeMaintenance>::default();
        let failed: NetworkTest = serde_json::from_value(serde_json::json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NetworkTest",
            "metadata": {"namespace": "team-a", "name": "mesh"},
            "spec": {"kind": "icmp", "nodeSelector": {}, "targets": [{"address": "10.0.0.1"}]},
            "status": {"phase": "Failed"},
        }))
        .unwrap();
        let paused: NodeNetworkConfig = serde_json::from_value(serde_json::json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NodeNetworkConfig",
            "metadata": {"name": "vnics"},
            "spec": {"nodeSelector": {}},
            "status": {"matched": 3, "applied": 1, "failing": 2, "conditions": [{
                "type": "Progressing", "status": "False", "reason": REASON_PAUSED,
                "message": "paused", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        }))
        .unwrap();
        let blocked: NodeMaintenance = serde_json::from_value(serde_json::json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NodeMaintenance",
            "metadata": {"name": "kernel"},
            "spec": {"nodeSelector": {"matchLabels": {"pool": "a"}}},
            "status": {"matched": 2, "cordoned": 2, "blocked": 1},
        }))
        .unwrap();
        tests.apply_watcher_event(&Event::Apply(failed.clone()));
        configs.apply_watcher_event(&Event::Apply(paused));
        maintenances.apply_watcher_event(&Event::Apply(blocked));
        let objects = &metrics.reconcile.objects;
        let guards = (
            objects.track(tests.as_reader()),
            objects.track(configs.as_reader()),
            objects.track(maintenances.as_reader()),
        );
        let text = encode(&registry);
        for line in [
            "nodekeeper_networktest_phase{namespace=\"team-a\",name=\"mesh\",phase=\"Failed\"} 1\n",
            "nodekeeper_nodenetworkconfig_paused{name=\"vnics\"} 1\n",
            "nodekeeper_nodenetworkconfig_nodes{name=\"vnics\",state=\"failing\"} 2\n",
            "nodekeeper_nodemaintenance_nodes{name=\"kernel\",state=\"blocked\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        // Deleted: its series goes at the next scrape.
        tests.apply_watcher_event(&Event::Delete(failed));
        assert!(!encode(&registry).contains("phase=\"Failed\""));
        // The controllers stop (leadership moved): nothing is left, the families stay declared.
        drop(guards);
        let text = encode(&registry);
        assert!(!text.contains("name=\"vnics\""), "{text}");
        assert!(
            text.contains("# TYPE nodekeeper_nodenetworkconfig_paused gauge"),
            "{text}"
        );
    }

    #[test]
    fn reconcile_failures_start_at_zero() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        metrics.reconcile.record("networktest", true, 0.1);
        let text = encode(&registry);
        assert!(
            text.contains("nodekeeper_reconcile_failures_total{controller=\"networktest\"} 0\n"),
            "{text}"
        );
    }
}

#[cfg(test)]
mod problem_tests {
    use super::*;

    #[test]
    fn npd_names_and_bounded_labels() {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let totals = &metrics.problems.totals;
        totals.add("OOMKilling", 2);
        totals.add("OOMKilling", 1);
        for i in 0..(MAX_PROBLEM_SERIES + 10) {
            totals.add(&format!("R{i}"), 1);
        }
        totals.set_gauges(&[(("KernelDeadlock".into(), "DockerHung".into()), 2)].into());
        totals.set_gauges(&BTreeMap::new());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("problem_counter{reason=\"OOMKilling\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!("problem_counter{{reason=\"{OTHER_LABEL}\"}} 11\n")),
            "{text}"
        );
        // A cleared condition's series stays, at 0.
        assert!(
            text.contains("problem_gauge{reason=\"DockerHung\",type=\"KernelDeadlock\"} 0\n"),
            "{text}"
        );
        assert!(!text.contains("problem_counter_total"), "{text}");
    }
}
