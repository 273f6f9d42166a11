//! The `NodeAgent` gRPC service: converts between the proto and the agent's plain data, and maps
//! the agent's errors to `tonic::Status` in exactly one place ([`status`]).

use std::sync::Arc;

use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_server::NodeAgent;
use tonic::{Request, Response, Status};

use crate::Error;
use crate::agent::Agent;
use crate::report::{Report, Threshold, Verdict};
use crate::tunables::{RawRule, RawRuleSet};

/// The service handed to tonic.
#[derive(Clone)]
pub struct AgentService {
    agent: Arc<Agent>,
    diagnostics: Option<Arc<crate::diag::Diagnostics>>,
}

impl AgentService {
    pub fn new(agent: Arc<Agent>) -> Self {
        Self {
            agent,
            diagnostics: None,
        }
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
}

/// The one place where agent errors become gRPC statuses.
pub fn status(error: Error) -> Status {
    match error {
        Error::InvalidRules(_) | Error::InvalidConfig { .. } => {
            Status::invalid_argument(error.to_string())
        }
        Error::RunProbes(crate::probes::ProbeError::InvalidRequest { .. }) => {
            Status::invalid_argument(error.to_string())
        }
        _ => Status::internal(error.to_string()),
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
        let response = crate::probes::run(request.into_inner())
            .await
            .map_err(|e| status(e.into()))?;
        Ok(Response::new(response))
    }

    async fn apply_network(
        &self,
        request: Request<pb::ApplyNetworkRequest>,
    ) -> Result<Response<pb::ApplyNetworkResponse>, Status> {
        let manager = crate::network::manager_for(&self.agent)?;
        Ok(Response::new(manager.apply(request.into_inner()).await?))
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
        Ok(Response::new(diagnostics.collect(request.into_inner())?))
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
                // Ownership is the network manager's knowledge (issue 4); until it lands the
                // agent owns no links.
                managed: false,
            })
            .collect(),
        gpu: Some(pb::GpuState {
            present: r.gpu_present,
            source: r.gpu_source.clone(),
            error: r.gpu_error.clone(),
            gpus: r
                .gpus
                .iter()
                .map(|g| pb::Gpu {
                    index: g.gpu.index,
                    uuid: g.gpu.uuid.clone(),
                    model: g.gpu.model.clone(),
                    memory_total_mib: g.gpu.memory_total_mib,
                    memory_used_mib: g.gpu.memory_used_mib,
                    temperature_c: g.gpu.temperature_c,
                    utilization_percent: g.gpu.utilization_percent,
                    ecc_uncorrected: g.gpu.ecc_uncorrected,
                    // `nvidia-smi --query-gpu` reports no XID events; see the crate README.
                    xid_events: 0,
                    verdict: verdict(g.verdict),
                    message: g.message.clone(),
                })
                .collect(),
        }),
        plugins: r
            .plugins
            .iter()
            .map(|p| pb::PluginState {
                name: p.name.clone(),
                state: p.state.clone(),
                message: p.message.clone(),
                verdict: verdict(p.verdict),
            })
            .collect(),
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
