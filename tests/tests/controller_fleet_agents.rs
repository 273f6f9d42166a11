//! The agents host of `cargo xtask bench fleet`: every simulated node's agent in one process —
//! one agent state (the agent crate's `Agent` and `AgentService`) per node, one listener per
//! node address, one gRPC server with one TLS configuration (the fleet's certificate) behind all
//! of them, each call dispatched to the agent whose address it arrived on.
//!
//! Not a test by itself: `fleet_agents_host` is ignored and runs only when the bench starts this
//! binary with `NODEKEEPER_E2E_ROLE=fleet-agents` and `NODEKEEPER_FLEET_SPEC=<spec.json>`.
//! The dispatch itself is tested below with a handful of agents.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use nodekeeper_agent::service::AgentService;
use nodekeeper_proto::agent::v1 as pb;
use tonic::{Request, Response, Status};

/// One agent per node, dispatched by the connection's local address.
#[derive(Clone)]
struct Fleet {
    agents: Arc<HashMap<SocketAddr, AgentService>>,
}

impl Fleet {
    fn pick<T>(&self, request: &Request<T>) -> Result<AgentService, Status> {
        let local = request
            .local_addr()
            .ok_or_else(|| Status::internal("no local address"))?;
        self.agents
            .get(&local)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no agent on {local}")))
    }
}

#[tonic::async_trait]
impl pb::node_agent_server::NodeAgent for Fleet {
    async fn get_report(
        &self,
        request: Request<pb::GetReportRequest>,
    ) -> Result<Response<pb::GetReportResponse>, Status> {
        let agent = self.pick(&request)?;
        pb::node_agent_server::NodeAgent::get_report(&agent, request).await
    }
    async fn set_rules(
        &self,
        request: Request<pb::SetRulesRequest>,
    ) -> Result<Response<pb::SetRulesResponse>, Status> {
        let agent = self.pick(&request)?;
        pb::node_agent_server::NodeAgent::set_rules(&agent, request).await
    }
    async fn run_probes(
        &self,
        request: Request<pb::RunProbesRequest>,
    ) -> Result<Response<pb::RunProbesResponse>, Status> {
        let agent = self.pick(&request)?;
        pb::node_agent_server::NodeAgent::run_probes(&agent, request).await
    }
    async fn apply_network(
        &self,
        request: Request<pb::ApplyNetworkRequest>,
    ) -> Result<Response<pb::ApplyNetworkResponse>, Status> {
        let agent = self.pick(&request)?;
        pb::node_agent_server::NodeAgent::apply_network(&agent, request).await
    }

    type CollectDiagnosticsStream =
        <AgentService as pb::node_agent_server::NodeAgent>::CollectDiagnosticsStream;

    async fn collect_diagnostics(
        &self,
        request: Request<pb::DiagnosticsRequest>,
    ) -> Result<Response<Self::CollectDiagnosticsStream>, Status> {
        let agent = self.pick(&request)?;
        pb::node_agent_server::NodeAgent::collect_diagnostics(&agent, request).await
    }
}

#[derive(serde::Deserialize)]
struct Spec {
    port: u16,
    /// Holds tls.crt, tls.key, ca.crt; node i's files go under `n<i>/`.
    dir: PathBuf,
    nodes: Vec<SpecNode>,
}

#[derive(serde::Deserialize)]
struct SpecNode {
    name: String,
    ip: std::net::Ipv4Addr,
}

/// Starts the agents of `spec`; returns when every listener is bound.
async fn host(spec: &Spec, stop: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    use clap::Parser;
    let p = |name: &str| spec.dir.join(name).display().to_string();
    let mut agents = HashMap::new();
    let mut listeners = Vec::new();
    let mut tls = None;
    for (i, node) in spec.nodes.iter().enumerate() {
        let dir = spec.dir.join(format!("n{i}"));
        std::fs::create_dir_all(dir.join("sysctl/net/core"))?;
        std::fs::create_dir_all(dir.join("state"))?;
        let sysctl = dir.join("sysctl/net/core/somaxconn");
        if !sysctl.exists() {
            std::fs::write(&sysctl, "8192\n")?;
        }
        let addr = SocketAddr::new(node.ip.into(), spec.port);
        let config = nodekeeper_agent::Config::try_parse_from([
            "nodekeeper-agent".to_string(),
            format!("--listen={addr}"),
            format!("--node-name={}", node.name),
            format!("--tls-cert={}", p("tls.crt")),
            format!("--tls-key={}", p("tls.key")),
            format!("--client-ca={}", p("ca.crt")),
            format!("--state-dir={}", dir.join("state").display()),
            format!("--sysctl-root={}", dir.join("sysctl").display()),
            "--nvidia-smi=/nonexistent/nvidia-smi".to_string(),
        ])?;
        if tls.is_none() {
            tls = Some(nodekeeper_agent::tls::server_config(&config)?);
        }
        agents.insert(
            addr,
            AgentService::new(Arc::new(nodekeeper_agent::agent::Agent::new(&config))),
        );
        listeners.push(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("bind {addr}"))?,
        );
    }
    let incoming = futures::stream::select_all(
        listeners
            .into_iter()
            .map(tokio_stream::wrappers::TcpListenerStream::new),
    );
    let server = tonic::transport::Server::builder()
        .tls_config(tls.context("no nodes in the spec")?)?
        .add_service(pb::node_agent_server::NodeAgentServer::new(Fleet {
            agents: Arc::new(agents),
        }))
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned());
    tokio::spawn(server);
    Ok(())
}

#[test]
#[ignore = "helper: the agents host of `cargo xtask bench fleet`, which starts it; not a test by itself"]
fn fleet_agents_host() {
    if std::env::var("NODEKEEPER_E2E_ROLE").as_deref() != Ok("fleet-agents") {
        return;
    }
    let path = std::env::var("NODEKEEPER_FLEET_SPEC").expect("NODEKEEPER_FLEET_SPEC");
    let spec: Spec = serde_json::from_slice(&std::fs::read(Path::new(&path)).expect("read spec"))
        .expect("parse spec");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let stop = tokio_util::sync::CancellationToken::new();
        host(&spec, stop.clone()).await.expect("start agents");
        // The bench polls for this file (a pipe to libtest's stdout is not a reliable signal).
        std::fs::write(
            spec.dir.join("ready"),
            format!("{} agents\n", spec.nodes.len()),
        )
        .expect("write ready file");
        // Runs until the bench kills it.
        std::future::pending::<()>().await;
    });
}

/// Three agents in one process answer for their own nodes, over mTLS, by address.
#[tokio::test]
async fn calls_reach_the_agent_of_the_address_called() -> anyhow::Result<()> {
    use nodekeeper_controller::agent_client::{AgentTls, CallLimits, connect};
    use nodekeeper_controller::certs::{Leaf, generate_ca, issue};
    let (ca_cert, ca_key) = generate_ca()?;
    let agent = issue(Leaf::Agent, &ca_cert, &ca_key)?;
    let controller = issue(Leaf::Controller, &ca_cert, &ca_key)?;
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("tls.crt"), &agent.cert)?;
    std::fs::write(dir.path().join("tls.key"), &agent.key)?;
    std::fs::write(dir.path().join("ca.crt"), &agent.ca)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let b = 1 + rand::random::<u8>() % 250;
    let nodes: Vec<SpecNode> = (1..=3)
        .map(|i| SpecNode {
            name: format!("host-node-{i}"),
            ip: std::net::Ipv4Addr::new(127, 44, b, i),
        })
        .collect();
    let spec = Spec {
        port,
        dir: dir.path().to_path_buf(),
        nodes,
    };
    let stop = tokio_util::sync::CancellationToken::new();
    host(&spec, stop.clone()).await?;
    let tls = AgentTls::new(&controller.ca, &controller.cert, &controller.key);
    let limits = CallLimits {
        timeout: std::time::Duration::from_secs(10),
        max_reply_bytes: 4 << 20,
    };
    for node in &spec.nodes {
        let mut conn = connect(&tls, SocketAddr::new(node.ip.into(), port), limits).await?;
        let reply = conn.get_report(0).await?;
        match reply.result {
            Some(pb::get_report_response::Result::Report(report)) => {
                assert_eq!(report.node_name, node.name)
            }
            other => anyhow::bail!("expected a report from {}, got {other:?}", node.name),
        }
    }
    stop.cancel();
    Ok(())
}
