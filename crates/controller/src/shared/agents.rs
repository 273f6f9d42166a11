//! The agents service: every call the controller makes to a node agent goes through [`Agents`]
//! (`report`, `run_probes`, `apply_network`, `collect_diagnostics`), so that each call gets
//! the same treatment whichever controller makes it: only agents of Nodes this controller manages
//! (its `--node-selector`) are contacted, over mutual TLS with the current certificates, within a
//! whole-call timeout and the reply size limit, inside a tracing span naming the node, and
//! counted in `nodekeeper_agents_*` by method and outcome.
//!
//! [`Agents`] is a trait so that a test can run the agent's real code in-process (e.g. probes
//! inside a network namespace) behind the same interface; [`MtlsAgents`] is the one used in
//! production, built on the transport in [`super::agent_client`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use nodekeeper_model::tuning::RuleSet;
use nodekeeper_proto::agent::v1 as pb;
use tracing::Instrument as _;

use super::agent_client::{self, AgentConnection, AgentTls, CallError, CallLimits, CallOutcome};
use super::fleet::Fleet;
use super::metrics::{AgentMethod, AgentMetrics};
use crate::certs::Pem;
use crate::view::{InvalidReport, NodeView};

/// The agent to call: the Node's name and its agent's gRPC endpoint (InternalIP and port).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentNode {
    pub name: String,
    pub endpoint: SocketAddr,
}

/// What a report call asks.
#[derive(Clone, Copy, Debug)]
pub struct ReportRequest<'a> {
    /// The report revision the caller holds; the agent answers "unchanged" when it still has it.
    pub cached_revision: Option<u64>,
    /// Rules to push on the same connection when the agent holds another revision.
    pub rules: Option<RulesPush<'a>>,
}

/// Rules to push during a report call.
#[derive(Clone, Copy, Debug)]
pub struct RulesPush<'a> {
    pub rules: &'a RuleSet,
    /// The revision the agent last reported, used when its answer is "unchanged".
    pub known_agent_revision: Option<u64>,
    /// A revision the agent refused on its merits: not pushed again.
    pub refused_revision: u64,
}

/// What happened to a [`RulesPush`].
#[derive(Debug)]
pub enum RulesOutcome {
    /// Not asked for, the agent refused the revision before, or the call ended before the
    /// agent's rules were known.
    NotPushed,
    /// Not pushed: the agent already holds the revision (given). It refuses nothing, so any
    /// refusal recorded for it is over (the ConfigMap went back to rules the agent kept).
    Held(u64),
    /// The agent took the rules (revision given).
    Applied(u64),
    /// The agent refused or the call failed (revision given).
    Failed(u64, CallError),
}

/// The answer of a report call: the report (None when unchanged) and, whatever became of the
/// report, what became of the rules push.
#[derive(Debug)]
pub struct Report {
    pub view: Result<Option<NodeView>, CallError>,
    pub rules: RulesOutcome,
}

/// HTTP/2 window of a diagnostics stream: four of the agent's 64 KiB chunks in flight, so the
/// controller holds at most this much of a bundle in memory however fast the agent sends.
pub const DIAGNOSTICS_WINDOW_BYTES: u32 = 256 * 1024;

/// A diagnostics bundle as the agent streams it (`.tar.gz` chunks; the last carries the summary).
pub type DiagnosticsStream = BoxStream<'static, Result<pb::DiagnosticsChunk, CallError>>;

/// Calls to node agents. Every method contacts only managed nodes and returns an error naming
/// the endpoint otherwise.
pub trait Agents: Send + Sync {
    /// Reads the node's report (and pushes rules, see [`ReportRequest`]).
    fn report<'a>(
        &'a self,
        node: &'a AgentNode,
        request: ReportRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Report>;

    /// Asks the agent to run a `NetworkTest`'s probes.
    fn run_probes<'a>(
        &'a self,
        node: &'a AgentNode,
        request: pb::RunProbesRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>>;

    /// Asks the agent to plan and (unless a dry run) apply host network state.
    fn apply_network<'a>(
        &'a self,
        node: &'a AgentNode,
        request: pb::ApplyNetworkRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>>;

    /// Opens the agent's diagnostics bundle stream; `timeout` bounds connecting and opening, the
    /// caller bounds the reading.
    fn collect_diagnostics<'a>(
        &'a self,
        node: &'a AgentNode,
        request: pb::DiagnosticsRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<DiagnosticsStream, CallError>>;
}

/// The production [`Agents`]: mutual TLS to the agents of the Nodes in [`Fleet`].
pub struct MtlsAgents {
    fleet: Arc<Fleet>,
    tls: RwLock<Option<AgentTls>>,
    max_reply_bytes: usize,
    metrics: AgentMetrics,
}

impl MtlsAgents {
    pub fn new(fleet: Arc<Fleet>, max_reply_bytes: usize, metrics: AgentMetrics) -> Self {
        Self {
            fleet,
            tls: RwLock::new(None),
            max_reply_bytes,
            metrics,
        }
    }

    /// Installs the client certificate and CA (at start, and after every renewal).
    pub fn set_tls(&self, pem: &Pem) {
        *self
            .tls
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(AgentTls::new(&pem.ca, &pem.cert, &pem.key));
    }

    /// Checks the node is managed, then connects with the current certificates.
    async fn connect(
        &self,
        node: &AgentNode,
        timeout: Duration,
    ) -> Result<AgentConnection, CallError> {
        self.connect_windowed(node, timeout, None).await
    }

    /// [`Self::connect`] with HTTP/2 windows of `window` bytes (see
    /// [`agent_client::connect_windowed`]).
    async fn connect_windowed(
        &self,
        node: &AgentNode,
        timeout: Duration,
        window: Option<u32>,
    ) -> Result<AgentConnection, CallError> {
        let managed = self
            .fleet
            .lock()
            .get(&node.name)
            .is_some_and(|entry| entry.address == Some(node.endpoint.ip()));
        if !managed {
            return Err(CallError {
                outcome: CallOutcome::NotManaged,
                endpoint: node.endpoint,
                detail: format!(
                    "no node {} with this InternalIP is managed by this controller (check --node-selector); not contacted",
                    node.name
                ),
            });
        }
        let tls = self
            .tls
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let Some(tls) = tls else {
            return Err(CallError {
                outcome: CallOutcome::Tls,
                endpoint: node.endpoint,
                detail: "the controller's certificates are not loaded yet".into(),
            });
        };
        let limits = CallLimits {
            timeout,
            max_reply_bytes: self.max_reply_bytes,
        };
        agent_client::connect_windowed(&tls, node.endpoint, limits, window).await
    }

    /// Runs `call` in a span naming the node and counts it by method and outcome.
    fn measured<'a, T: Send + 'a>(
        &'a self,
        method: AgentMethod,
        node: &AgentNode,
        call: impl Future<Output = (CallOutcome, T)> + Send + 'a,
    ) -> BoxFuture<'a, T> {
        let span = tracing::info_span!("agent_call", method = ?method, node = %node.name, endpoint = %node.endpoint);
        Box::pin(
            async move {
                let started = Instant::now();
                let (outcome, result) = call.await;
                self.metrics
                    .record(method, outcome, started.elapsed().as_secs_f64());
                result
            }
            .instrument(span),
        )
    }

    /// One request and its answer on a fresh connection, measured.
    fn unary<'a, T, F, Fut>(
        &'a self,
        method: AgentMethod,
        node: &'a AgentNode,
        timeout: Duration,
        call: F,
    ) -> BoxFuture<'a, Result<T, CallError>>
    where
        T: Send + 'a,
        F: FnOnce(AgentConnection) -> Fut + Send + 'a,
        Fut: Future<Output = Result<T, CallError>> + Send + 'a,
    {
        self.measured(method, node, async move {
            let result = tokio::time::timeout(timeout, async {
                match self.connect(node, timeout).await {
                    Ok(conn) => call(conn).await,
                    Err(error) => Err(error),
                }
            })
            .await
            .unwrap_or_else(|_| Err(whole_call_timeout(node, timeout)));
            let outcome = match &result {
                Ok(_) => CallOutcome::Answered,
                Err(e) => e.outcome,
            };
            (outcome, result)
        })
    }

    /// The report call: connect, `GetReport`, and when the agent holds another revision
    /// `SetRules` and a second `GetReport`, all within one `timeout` (each step's own limit is
    /// the same `timeout`, so without the whole-call deadline a wedged agent could hold the
    /// caller four times as long). What became of the push is kept when the deadline ends the
    /// call after it.
    async fn report_inner(
        &self,
        node: &AgentNode,
        request: ReportRequest<'_>,
        timeout: Duration,
    ) -> Report {
        let mut rules = RulesOutcome::NotPushed;
        // The revision being pushed while `SetRules` is in flight.
        let mut pushing = None;
        let call = async {
            let mut conn = self.connect(node, timeout).await?;
            let invalid = |e: InvalidReport| CallError {
                outcome: CallOutcome::InvalidReply,
                endpoint: node.endpoint,
                detail: e.to_string(),
            };
            let reply = conn
                .get_report(request.cached_revision.unwrap_or(0))
                .await?;
            let mut view = NodeView::from_reply(&node.name, reply, request.cached_revision)
                .map_err(invalid)?;
            let Some(push) = request.rules else {
                return Ok(view);
            };
            let agent_rules = view
                .as_ref()
                .map(|v| v.rules_revision)
                .or(push.known_agent_revision)
                .unwrap_or(0);
            let wanted = push.rules.revision();
            // An agent that already holds the revision is not called; nor is one that refused it.
            if agent_rules == wanted {
                rules = RulesOutcome::Held(wanted);
                return Ok(view);
            }
            if push.refused_revision == wanted {
                return Ok(view);
            }
            pushing = Some(wanted);
            let pushed = conn.set_rules(set_rules_request(push.rules, wanted)).await;
            pushing = None;
            match pushed {
                Ok(_) => {
                    rules = RulesOutcome::Applied(wanted);
                    // The agent's report changes with its rules: fetch it now rather than a
                    // sweep later.
                    let since = view
                        .as_ref()
                        .map(|v| v.revision)
                        .or(request.cached_revision)
                        .unwrap_or(0);
                    let reply = conn.get_report(since).await?;
                    if let Some(fresh) =
                        NodeView::from_reply(&node.name, reply, Some(since)).map_err(invalid)?
                    {
                        view = Some(fresh);
                    }
                }
                Err(error) => rules = RulesOutcome::Failed(wanted, error),
            }
            Ok(view)
        };
        let answered = tokio::time::timeout(timeout, call).await;
        let view = answered.unwrap_or_else(|_| {
            let error = whole_call_timeout(node, timeout);
            if let Some(wanted) = pushing {
                rules = RulesOutcome::Failed(wanted, error.clone());
            }
            Err(error)
        });
        Report { view, rules }
    }
}

impl Agents for MtlsAgents {
    fn report<'a>(
        &'a self,
        node: &'a AgentNode,
        request: ReportRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Report> {
        self.measured(AgentMethod::Report, node, async move {
            let report = self.report_inner(node, request, timeout).await;
            let outcome = match &report.view {
                Ok(None) => CallOutcome::Unchanged,
                Ok(Some(_)) => CallOutcome::Report,
                Err(e) => e.outcome,
            };
            (outcome, report)
        })
    }

    fn run_probes<'a>(
        &'a self,
        node: &'a AgentNode,
        request: pb::RunProbesRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>> {
        self.unary(
            AgentMethod::RunProbes,
            node,
            timeout,
            |mut conn| async move { conn.run_probes(request).await },
        )
    }

    fn apply_network<'a>(
        &'a self,
        node: &'a AgentNode,
        mut request: pb::ApplyNetworkRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>> {
        // Named here, for every caller: an agent now at this address for another Node refuses.
        request.node_name.clone_from(&node.name);
        self.unary(
            AgentMethod::ApplyNetwork,
            node,
            timeout,
            |mut conn| async move { conn.apply_network(request).await },
        )
    }

    fn collect_diagnostics<'a>(
        &'a self,
        node: &'a AgentNode,
        mut request: pb::DiagnosticsRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<DiagnosticsStream, CallError>> {
        use futures::StreamExt as _;
        request.node_name.clone_from(&node.name);
        self.measured(AgentMethod::CollectDiagnostics, node, async move {
            let result: Result<DiagnosticsStream, CallError> = async {
                let mut conn = self
                    .connect_windowed(node, timeout, Some(DIAGNOSTICS_WINDOW_BYTES))
                    .await?;
                Ok(conn.collect_diagnostics(request).await?.boxed())
            }
            .await;
            let outcome = match &result {
                Ok(_) => CallOutcome::Answered,
                Err(e) => e.outcome,
            };
            (outcome, result)
        })
    }
}

/// A call that did not end within its whole-call timeout (connecting included).
fn whole_call_timeout(node: &AgentNode, timeout: Duration) -> CallError {
    CallError {
        outcome: CallOutcome::Timeout,
        endpoint: node.endpoint,
        detail: format!("the call did not end within {timeout:?}, connecting included"),
    }
}

/// The `SetRules` request for a rule set.
pub fn set_rules_request(rules: &RuleSet, revision: u64) -> pb::SetRulesRequest {
    use nodekeeper_model::tuning::{Comparison, Severity};
    pb::SetRulesRequest {
        revision,
        rules: rules
            .tunables
            .iter()
            .map(|r| pb::TunableRule {
                name: r.name.clone(),
                key: r.key.clone(),
                comparison: match r.comparison {
                    Comparison::Equal => pb::Comparison::Equal,
                    Comparison::AtLeast => pb::Comparison::AtLeast,
                    Comparison::AtMost => pb::Comparison::AtMost,
                    Comparison::OneOf => pb::Comparison::OneOf,
                } as i32,
                values: r.values.clone(),
                repair: r.repair,
                repair_max_per_hour: r.repair_max_per_hour,
                severity: match r.severity {
                    Severity::Warning => pb::Verdict::Warning,
                    Severity::Critical => pb::Verdict::Critical,
                } as i32,
            })
            .collect(),
        thresholds: rules
            .thresholds
            .iter()
            .map(|t| pb::IndicatorThreshold {
                indicator: t.indicator.clone(),
                warning: t.warning,
                critical: t.critical,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::fleet::NodeFacts;
    use crate::shared::metrics::AgentCallLabels;
    use nodekeeper_model::tuning;
    use std::collections::BTreeMap;

    fn agents(fleet: &Arc<Fleet>) -> (MtlsAgents, AgentMetrics) {
        let metrics = AgentMetrics::default();
        (
            MtlsAgents::new(Arc::clone(fleet), 1024, metrics.clone()),
            metrics,
        )
    }

    fn calls(metrics: &AgentMetrics, method: AgentMethod, outcome: CallOutcome) -> u64 {
        metrics
            .calls
            .get_or_create(&AgentCallLabels { method, outcome })
            .get()
    }

    #[tokio::test]
    async fn nodes_outside_the_fleet_are_not_contacted() {
        // A listener that would see any connection attempt.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let fleet = Arc::new(Fleet::default());
        let (agents, metrics) = agents(&fleet);
        let node = AgentNode {
            name: "w1".into(),
            endpoint: listener.local_addr().unwrap(),
        };
        let err = agents
            .run_probes(
                &node,
                pb::RunProbesRequest::default(),
                Duration::from_secs(1),
            )
            .await
            .unwrap_err();
        assert_eq!(err.outcome, CallOutcome::NotManaged);
        assert!(err.to_string().contains("check --node-selector"), "{err}");
        let err = agents
            .apply_network(
                &node,
                pb::ApplyNetworkRequest::default(),
                Duration::from_secs(1),
            )
            .await
            .unwrap_err();
        assert_eq!(err.outcome, CallOutcome::NotManaged);
        assert!(listener.accept().is_err(), "a connection was made");

        // The same name at another address is not the managed node either.
        fleet.observe(
            NodeFacts {
                name: "w1".into(),
                address: Some("127.0.0.2".parse().unwrap()),
                resource_version: 1,
                written: vec![],
                foreign: vec![],
            },
            Instant::now(),
        );
        let report = agents
            .report(
                &node,
                ReportRequest {
                    cached_revision: None,
                    rules: None,
                },
                Duration::from_secs(1),
            )
            .await;
        assert_eq!(report.view.unwrap_err().outcome, CallOutcome::NotManaged);
        assert!(matches!(report.rules, RulesOutcome::NotPushed));
        assert!(listener.accept().is_err(), "a connection was made");

        let counted = [
            (AgentMethod::RunProbes, 1),
            (AgentMethod::ApplyNetwork, 1),
            (AgentMethod::Report, 1),
        ];
        for (method, n) in counted {
            assert_eq!(
                calls(&metrics, method, CallOutcome::NotManaged),
                n,
                "{method:?}"
            );
        }
    }

    #[tokio::test]
    async fn managed_nodes_need_the_certificates_first() {
        let fleet = Arc::new(Fleet::default());
        fleet.observe(
            NodeFacts {
                name: "w1".into(),
                address: Some("127.0.0.1".parse().unwrap()),
                resource_version: 1,
                written: vec![],
                foreign: vec![],
            },
            Instant::now(),
        );
        let (agents, metrics) = agents(&fleet);
        let node = AgentNode {
            name: "w1".into(),
            endpoint: "127.0.0.1:1".parse().unwrap(),
        };
        let err = agents
            .run_probes(
                &node,
                pb::RunProbesRequest::default(),
                Duration::from_secs(1),
            )
            .await
            .unwrap_err();
        assert_eq!(err.outcome, CallOutcome::Tls);
        assert!(err.detail.contains("not loaded"), "{err}");
        assert_eq!(calls(&metrics, AgentMethod::RunProbes, CallOutcome::Tls), 1);
    }

    /// An agent served in-process over mutual TLS: it holds a rules revision, takes every
    /// `SetRules`, and can be made slow or to fail the report that follows a push.
    struct FakeAgent {
        rules_revision: std::sync::atomic::AtomicU64,
        /// How long each `GetReport` and `SetRules` takes to answer.
        delay: Duration,
        fail_report_after_rules: bool,
        set_rules_calls: std::sync::atomic::AtomicUsize,
    }

    #[tonic::async_trait]
    impl pb::node_agent_server::NodeAgent for FakeAgent {
        async fn get_report(
            &self,
            _: tonic::Request<pb::GetReportRequest>,
        ) -> Result<tonic::Response<pb::GetReportResponse>, tonic::Status> {
            use std::sync::atomic::Ordering;
            tokio::time::sleep(self.delay).await;
            if self.fail_report_after_rules && self.set_rules_calls.load(Ordering::SeqCst) > 0 {
                return Err(tonic::Status::unavailable("collecting"));
            }
            let rules_revision = self.rules_revision.load(Ordering::SeqCst);
            Ok(tonic::Response::new(pb::GetReportResponse {
                revision: 100 + rules_revision,
                result: Some(pb::get_report_response::Result::Report(pb::NodeReport {
                    node_name: "w1".into(),
                    rules_revision,
                    ..Default::default()
                })),
            }))
        }

        async fn set_rules(
            &self,
            request: tonic::Request<pb::SetRulesRequest>,
        ) -> Result<tonic::Response<pb::SetRulesResponse>, tonic::Status> {
            use std::sync::atomic::Ordering;
            tokio::time::sleep(self.delay).await;
            let revision = request.into_inner().revision;
            self.set_rules_calls.fetch_add(1, Ordering::SeqCst);
            self.rules_revision.store(revision, Ordering::SeqCst);
            Ok(tonic::Response::new(pb::SetRulesResponse {
                active_revision: revision,
            }))
        }

        async fn run_probes(
            &self,
            _: tonic::Request<pb::RunProbesRequest>,
        ) -> Result<tonic::Response<pb::RunProbesResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("run_probes"))
        }

        async fn apply_network(
            &self,
            _: tonic::Request<pb::ApplyNetworkRequest>,
        ) -> Result<tonic::Response<pb::ApplyNetworkResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("apply_network"))
        }

        type CollectDiagnosticsStream =
            futures::stream::Empty<Result<pb::DiagnosticsChunk, tonic::Status>>;

        async fn collect_diagnostics(
            &self,
            _: tonic::Request<pb::DiagnosticsRequest>,
        ) -> Result<tonic::Response<Self::CollectDiagnosticsStream>, tonic::Status> {
            Err(tonic::Status::unimplemented("collect_diagnostics"))
        }
    }

    /// Serves `agent` on 127.0.0.1 with a fresh CA; returns the managed node, the agents service
    /// holding the controller's certificate, and the agent.
    async fn serve(agent: FakeAgent) -> (AgentNode, MtlsAgents, Arc<FakeAgent>) {
        use crate::certs::{Leaf, generate_ca, issue};
        use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
        let (ca_cert, ca_key) = generate_ca().unwrap();
        let server = issue(Leaf::Agent, &ca_cert, &ca_key).unwrap();
        let client = issue(Leaf::Controller, &ca_cert, &ca_key).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = listener.local_addr().unwrap();
        let agent = Arc::new(agent);
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(&server.cert, &server.key))
            .client_ca_root(Certificate::from_pem(&ca_cert));
        let service = pb::node_agent_server::NodeAgentServer::from_arc(Arc::clone(&agent));
        tokio::spawn(
            Server::builder()
                .tls_config(tls)
                .unwrap()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let fleet = Arc::new(Fleet::default());
        fleet.observe(
            NodeFacts {
                name: "w1".into(),
                address: Some(endpoint.ip()),
                resource_version: 1,
                written: vec![],
                foreign: vec![],
            },
            Instant::now(),
        );
        let (agents, _) = agents(&fleet);
        let agents = MtlsAgents {
            max_reply_bytes: 1 << 20,
            ..agents
        };
        agents.set_tls(&client);
        let node = AgentNode {
            name: "w1".into(),
            endpoint,
        };
        (node, agents, agent)
    }

    fn fake_agent(rules_revision: u64, delay: Duration) -> FakeAgent {
        FakeAgent {
            rules_revision: rules_revision.into(),
            delay,
            fail_report_after_rules: false,
            set_rules_calls: 0.into(),
        }
    }

    fn rule_set() -> RuleSet {
        let data: BTreeMap<String, String> = [(
            "rules.yaml".to_string(),
            "tunables:\n  - {name: a, key: net.core.somaxconn, atLeast: 4096}\n".to_string(),
        )]
        .into();
        tuning::parse(&data).unwrap().rules
    }

    /// Regression: a refusal recorded for a revision was never cleared when the ConfigMap went
    /// back to the revision the agent had kept, since the agent was then not called and the
    /// outcome said nothing.
    #[tokio::test]
    async fn an_agent_holding_the_wanted_revision_says_so() {
        let rules = rule_set();
        let wanted = rules.revision();
        let (node, agents, agent) = serve(fake_agent(wanted, Duration::ZERO)).await;
        let report = agents
            .report(
                &node,
                ReportRequest {
                    cached_revision: None,
                    rules: Some(RulesPush {
                        rules: &rules,
                        known_agent_revision: None,
                        // The agent refused another revision before.
                        refused_revision: wanted + 1,
                    }),
                },
                Duration::from_secs(5),
            )
            .await;
        assert!(report.view.unwrap().is_some());
        assert!(
            matches!(report.rules, RulesOutcome::Held(r) if r == wanted),
            "{:?}",
            report.rules
        );
        assert_eq!(
            agent
                .set_rules_calls
                .load(std::sync::atomic::Ordering::SeqCst),
            0,
            "an agent holding the revision is not pushed to"
        );
    }

    /// The push's outcome survives a report that fails after it.
    #[tokio::test]
    async fn rules_taken_are_reported_when_the_report_after_them_fails() {
        let rules = rule_set();
        let wanted = rules.revision();
        let (node, agents, _) = serve(FakeAgent {
            fail_report_after_rules: true,
            ..fake_agent(wanted + 1, Duration::ZERO)
        })
        .await;
        let report = agents
            .report(
                &node,
                ReportRequest {
                    cached_revision: None,
                    rules: Some(RulesPush {
                        rules: &rules,
                        known_agent_revision: None,
                        refused_revision: 0,
                    }),
                },
                Duration::from_secs(5),
            )
            .await;
        assert!(report.view.is_err());
        assert!(
            matches!(report.rules, RulesOutcome::Applied(r) if r == wanted),
            "{:?}",
            report.rules
        );
    }

    /// Regression: `callTimeout` bounded each step (connect, report, push, report) on its own,
    /// so a slow agent held a sweep slot up to four times as long as configured.
    #[tokio::test]
    async fn the_timeout_bounds_the_whole_report_call() {
        let rules = rule_set();
        let wanted = rules.revision();
        // Each step answers within the timeout; together they do not.
        let timeout = Duration::from_millis(1500);
        let (node, agents, agent) = serve(fake_agent(wanted + 1, Duration::from_millis(600))).await;
        let started = Instant::now();
        let report = agents
            .report(
                &node,
                ReportRequest {
                    cached_revision: None,
                    rules: Some(RulesPush {
                        rules: &rules,
                        known_agent_revision: None,
                        refused_revision: 0,
                    }),
                },
                timeout,
            )
            .await;
        let took = started.elapsed();
        assert!(took < timeout + Duration::from_millis(300), "took {took:?}");
        let error = report.view.unwrap_err();
        assert_eq!(error.outcome, CallOutcome::Timeout, "{error}");
        // The deadline fell during the second report: the push had been taken.
        assert!(
            matches!(report.rules, RulesOutcome::Applied(r) if r == wanted),
            "{:?}",
            report.rules
        );
        assert_eq!(
            agent
                .set_rules_calls
                .load(std::sync::atomic::Ordering::SeqCst),
            1
        );
    }

    #[test]
    fn rules_request_carries_every_field() {
        let data: BTreeMap<String, String> = [(
            "rules.yaml".to_string(),
            "tunables:\n  - {name: a, key: net.core.somaxconn, atLeast: 4096, severity: critical, repairMaxPerHour: 3}\nthresholds:\n  - {indicator: 'disk.*', warning: 70, critical: 80}\n".to_string(),
        )]
        .into();
        let config = tuning::parse(&data).unwrap();
        let revision = config.rules.revision();
        let req = set_rules_request(&config.rules, revision);
        assert_eq!(req.revision, revision);
        assert_eq!(req.rules[0].comparison, pb::Comparison::AtLeast as i32);
        assert_eq!(req.rules[0].values, vec!["4096".to_string()]);
        assert_eq!(req.rules[0].severity, pb::Verdict::Critical as i32);
        assert_eq!(req.rules[0].repair_max_per_hour, 3);
        assert!(!req.rules[0].repair);
        assert_eq!(req.thresholds[0].indicator, "disk.*");
    }
}
