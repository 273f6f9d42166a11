//! The `NodeAgent` gRPC service: converts between the proto and the agent's plain data, and maps
//! the agent's errors to `tonic::Status` in exactly one place ([`status`]).

use std::sync::Arc;

use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_server::NodeAgent;
use tonic::{Request, Response, Status};

use nodekeeper_model::indicators::{Threshold, Verdict};

use crate::agent::Agent;
use crate::error::Error;
use crate::network::NetworkError;
use crate::probes::ProbeError;
use crate::report::Report;
use crate::tunables::{RawRule, RawRuleSet};

/// The service handed to tonic.
#[derive(Clone)]
pub struct AgentService {
    agent: Arc<Agent>,
    diagnostics: Option<Arc<crate::diag::Diagnostics>>,
    /// Node-local settings of `RunProbes` ([`crate::Config::probe_options`]).
    probe_options: Arc<crate::probes::ProbeOptions>,
}

impl AgentService {
    pub fn new(agent: Arc<Agent>) -> Self {
        Self {
            agent,
            diagnostics: None,
            probe_options: Arc::default(),
        }
    }

    /// Runs `RunProbes` with `options` (without it, the defaults: the agent container's own
    /// `/etc/resolv.conf`, no extra HTTPS roots).
    pub fn with_probe_options(mut self, options: crate::probes::ProbeOptions) -> Self {
        self.probe_options = Arc::new(options);
        self
    }

    /// Serves `CollectDiagnostics` with `diagnostics` (without it the call is refused).
    pub fn with_diagnostics(mut self, diagnostics: Arc<crate::diag::Diagnostics>) -> Self {
        self.diagnostics = Some(diagnostics);
        self
    }

    /// The agent behind the service (for the network manager and probes to share).
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// Refuses a call meant for another Node. Every agent serves the fleet's one certificate, so
    /// the TLS handshake cannot tell the caller that an address it still files under one Node now
    /// belongs to another (an instance gone and its address handed to a new one); the node name
    /// the caller puts in the request can. Empty: a caller that names no node, not checked.
    fn check_node(&self, meant_for: &str) -> Result<(), Status> {
        let serving = self.agent.node_name();
        if meant_for.is_empty() || meant_for == serving {
            return Ok(());
        }
        Err(Status::failed_precondition(format!(
            "this agent serves node {serving}, not {meant_for}: the address the caller used for \
             {meant_for} now belongs to {serving}; nothing was done"
        )))
    }
}

/// The one place where agent errors become gRPC statuses. What the caller sent wrong is
/// INVALID_ARGUMENT; what this host cannot do as asked (a parent link that is missing, no
/// metadata service configured, a metadata answer that cannot be laid out) is
/// FAILED_PRECONDITION; only a metadata service that could not be read is UNAVAILABLE (asking
/// again may work); faults of the host itself are INTERNAL.
pub fn status(error: Error) -> Status {
    let message = error.to_string();
    match error {
        Error::InvalidRules(_)
        | Error::InvalidConfig { .. }
        | Error::RunProbes(ProbeError::InvalidRequest { .. }) => Status::invalid_argument(message),
        Error::ApplyNetwork(e) => match e {
            NetworkError::ParseDesired(_)
            | NetworkError::Invalid(_)
            | NetworkError::CheckTarget(_)
            | NetworkError::Request { .. }
            | NetworkError::OciOptions(_)
            | NetworkError::LayoutConflict(_) => Status::invalid_argument(message),
            NetworkError::Plan(_)
            | NetworkError::NoImdsEndpoint
            | NetworkError::ImdsEndpoint(_)
            | NetworkError::Layout(_) => Status::failed_precondition(message),
            NetworkError::Metadata(_) => Status::unavailable(message),
            NetworkError::Netlink(_)
            | NetworkError::SaveJournal { .. }
            | NetworkError::Restore { .. } => Status::internal(message),
        },
        Error::RunProbes(_)
        | Error::ReadTls { .. }
        | Error::SaveState { .. }
        | Error::Bind { .. }
        | Error::LockStateDir { .. }
        | Error::Serve(_) => Status::internal(message),
    }
}

#[tonic::async_trait]
impl NodeAgent for AgentService {
    async fn get_report(
        &self,
        request: Request<pb::GetReportRequest>,
    ) -> Result<Response<pb::GetReportResponse>, Status> {
        let since = request.into_inner().since_revision;
        let (revision, report) = self.agent.report(since).await;
        let result = match report {
            Some(report) => pb::get_report_response::Result::Report(to_proto(&report)),
            None => pb::get_report_response::Result::Unchanged(pb::Unchanged {}),
        };
        Ok(Response::new(pb::GetReportResponse {
            revision,
            result: Some(result),
        }))
    }

    async fn set_rules(
        &self,
        request: Request<pb::SetRulesRequest>,
    ) -> Result<Response<pb::SetRulesResponse>, Status> {
        let raw = from_proto(request.into_inner());
        let active_revision = self.agent.set_rules(&raw).await.map_err(status)?;
        Ok(Response::new(pb::SetRulesResponse { active_revision }))
    }

    async fn run_probes(
        &self,
        request: Request<pb::RunProbesRequest>,
    ) -> Result<Response<pb::RunProbesResponse>, Status> {
        let response = crate::probes::run_with(request.into_inner(), &self.probe_options)
            .await
            .map_err(|e| status(e.into()))?;
        Ok(Response::new(response))
    }

    async fn apply_network(
        &self,
        request: Request<pb::ApplyNetworkRequest>,
    ) -> Result<Response<pb::ApplyNetworkResponse>, Status> {
        // The apply runs in a task of its own, and the handler only waits for it: when the
        // caller goes away (its deadline passes, the connection drops) tonic drops the handler's
        // future, and an apply polled inside it would stop between two netlink steps with its
        // rollback never run, leaving the host half-way until the next drift check. A spawned
        // task always finishes, rollback and journal included. (The agent's runtime is
        // current-thread, so the task stays on the thread, and in the network namespace, of the
        // server.)
        let agent = Arc::clone(&self.agent);
        let request = request.into_inner();
        self.check_node(&request.node_name)?;
        let applying = tokio::spawn(async move { agent.network().apply(request).await });
        let response = match applying.await {
            Ok(applied) => applied.map_err(|e| status(e.into()))?,
            // A panic in the apply is the handler's panic, as it was before the task.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => return Err(Status::unavailable("the agent is shutting down; ask again")),
        };
        Ok(Response::new(response))
    }

    type CollectDiagnosticsStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::DiagnosticsChunk, Status>>;

    async fn collect_diagnostics(
        &self,
        request: Request<pb::DiagnosticsRequest>,
    ) -> Result<Response<Self::CollectDiagnosticsStream>, Status> {
        let Some(diagnostics) = &self.diagnostics else {
            return Err(Status::failed_precondition(
                "this agent was built without diagnostics sources",
            ));
        };
        let request = request.into_inner();
        self.check_node(&request.node_name)?;
        Ok(Response::new(diagnostics.collect(request)?))
    }
}

fn verdict(v: Verdict) -> i32 {
    match v {
        Verdict::Unspecified => pb::Verdict::Unspecified as i32,
        Verdict::Ok => pb::Verdict::Ok as i32,
        Verdict::Warning => pb::Verdict::Warning as i32,
        Verdict::Critical => pb::Verdict::Critical as i32,
    }
}

fn from_proto(req: pb::SetRulesRequest) -> RawRuleSet {
    RawRuleSet {
        revision: req.revision,
        rules: req
            .rules
            .into_iter()
            .map(|r| RawRule {
                name: r.name,
                key: r.key,
                comparison: r.comparison,
                values: r.values,
                repair: r.repair,
                repair_max_per_hour: r.repair_max_per_hour,
                severity: r.severity,
            })
            .collect(),
        thresholds: req
            .thresholds
            .into_iter()
            .map(|t| Threshold {
                indicator: t.indicator,
                warning: t.warning,
                critical: t.critical,
            })
            .collect(),
    }
}

/// Converts the plain report into the proto message.
pub fn to_proto(r: &Report) -> pb::NodeReport {
    pb::NodeReport {
        node_name: r.node_name.clone(),
        agent_version: r.agent_version.clone(),
        collected_at_unix_ms: r.collected_at_unix_ms,
        indicators: r
            .indicators
            .iter()
            .map(|i| pb::Indicator {
                name: i.name.clone(),
                value: i.value,
                unit: i.unit.as_str().to_string(),
                verdict: verdict(i.verdict),
                message: i.message.clone(),
            })
            .collect(),
        tunables: r
            .tunables
            .iter()
            .map(|t| pb::TunableStatus {
                rule: t.rule.clone(),
                key: t.key.clone(),
                current: t.current.clone(),
                verdict: verdict(t.verdict),
                expected: t.expected.clone(),
                previous: t.previous.clone(),
                repaired_at_unix_ms: t.repaired_at_unix_ms,
                conflict: t.conflict,
                error: t.error.clone(),
            })
            .collect(),
        problems: Some(crate::monitor::to_proto(&r.problems)),
        rules_revision: r.rules_revision,
        interfaces: r
            .interfaces
            .iter()
            .map(|i| pb::ObservedInterface {
                name: i.name.clone(),
                index: i.index,
                mac: i.mac.clone(),
                mtu: i.mtu,
                up: i.up,
                oper_state: i.oper_state.clone(),
                kind: i.kind.clone(),
                addresses: i.addresses.clone(),
                managed: i.managed,
            })
            .collect(),
        pod_links: r.pod_links,
        gpu: Some(pb::GpuState {
            present: r.gpu_present,
            source: r.gpu_source.clone(),
            error: r.gpu_error.clone(),
            gpus: r
                .gpus
                .iter()
                .map(|g| pb::Gpu {
                    verdict: verdict(g.verdict),
                    message: g.message.clone(),
                    ..crate::collect::gpu::to_proto(&g.gpu)
                })
                .collect(),
            expected_count: r.gpu_expected,
            verdict: verdict(r.gpu_verdict),
            message: r.gpu_message.clone(),
        }),
        plugins: r
            .plugins
            .iter()
            .map(|p| pb::PluginState {
                name: p.name.clone(),
                state: p.state.clone(),
                message: p.message.clone(),
                verdict: verdict(p.verdict),
                version: p.version.clone(),
            })
            .collect(),
        oca_version: r.oca_version.clone(),
        oca_source: r.oca_source.clone(),
        collector_errors: r
            .collector_errors
            .iter()
            .map(|(collector, error)| pb::CollectorError {
                collector: collector.clone(),
                error: error.clone(),
            })
            .collect(),
        system: Some(pb::SystemInfo {
            kernel_release: r.system.kernel_release.clone(),
            boot_id: r.system.boot_id.clone(),
            booted_at_unix: r.system.booted_at_unix,
            cpus: r.system.cpus,
            memory_total_bytes: r.system.memory_total_bytes,
        }),
        network: Some(pb::NetworkStatus {
            applied_generation: r.network.applied_generation.clone(),
            drifted: r.network.drifted,
            drift: r.network.drift.clone(),
            reconverged_at_unix_ms: r.network.reconverged_at_unix_ms,
            last_error: r.network.last_error.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn data_errors_are_not_retryable_and_host_faults_are_internal() {
        let code = |e: Error| status(e).code();
        let net = |e: NetworkError| code(Error::ApplyNetwork(e));
        assert_eq!(code(Error::InvalidRules("x".into())), Code::InvalidArgument);
        assert_eq!(
            code(Error::RunProbes(ProbeError::InvalidRequest {
                field: "count".into(),
                reason: "0".into()
            })),
            Code::InvalidArgument
        );
        assert_eq!(
            net(NetworkError::ParseDesired("x".into())),
            Code::InvalidArgument
        );
        assert_eq!(
            net(NetworkError::LayoutConflict("x".into())),
            Code::InvalidArgument
        );
        assert_eq!(
            net(NetworkError::Plan("x".into())),
            Code::FailedPrecondition
        );
        assert_eq!(net(NetworkError::NoImdsEndpoint), Code::FailedPrecondition);
        // The metadata service answered something that cannot be laid out: asking again gives
        // the same answer, so not UNAVAILABLE.
        assert_eq!(
            net(NetworkError::Layout("vnics[1].vlanTag: missing".into())),
            Code::FailedPrecondition
        );
        assert_eq!(
            net(NetworkError::Metadata("connection refused".into())),
            Code::Unavailable
        );
        assert_eq!(net(NetworkError::Netlink("EPERM".into())), Code::Internal);
        // The message is the manager's own, unchanged by the mapping.
        assert_eq!(
            status(Error::ApplyNetwork(NetworkError::NoImdsEndpoint)).message(),
            NetworkError::NoImdsEndpoint.to_string()
        );
    }
}
