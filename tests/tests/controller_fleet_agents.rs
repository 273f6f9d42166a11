//! The agents host of `cargo xtask bench fleet`: many simulated nodes' agents in one process (the
//! rig starts one such process per `AGENTS_PER_HOST` nodes) — one agent state (the agent crate's
//! `Agent` and `AgentService`) per node, one listener per node address, one gRPC server with one
//! TLS configuration (the fleet's certificate) behind all of them, each call dispatched to the
//! agent whose address it arrived on.
//!
//! The TLS configuration is the agent's (`nodekeeper_agent::tls::server_config`: its identity,
//! client certificates required from the same CA, h2) built here as a rustls config, because one
//! setting must differ: the session cache. A real agent keeps rustls's default of 256 sessions
//! for its one or two controllers; one cache of 256 shared by thousands of simulated agents
//! would forget nearly every session, and the controller, which resumes the sessions of up to
//! 65,536 agents, would pay a full handshake on every call where a real fleet pays none.
//!
//! Not a test by itself: `fleet_agents_host` is ignored and runs only when the rig
//! (`nodekeeper_e2e::rig::AgentsHost`) starts this binary with `NODEKEEPER_E2E_ROLE=fleet-agents`
//! and `NODEKEEPER_FLEET_SPEC=<spec.json>`.
//! The dispatch itself is tested below with a handful of agents.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use futures::StreamExt as _;
use nodekeeper_agent::service::AgentService;
use nodekeeper_e2e::rig::{FLEET_ROLE, FleetNode, FleetSpec, ROLE_ENV, sysctl_path};
use nodekeeper_proto::agent::v1 as pb;
use tonic::{Request, Response, Status};

/// One agent per node, dispatched by the connection's local address.
#[derive(Clone)]
struct Fleet {
    agents: Arc<HashMap<SocketAddr, Hosted>>,
}

#[derive(Clone)]
struct Hosted {
    service: AgentService,
    /// [`FleetSpec::outage_marker`]: while it exists, this agent is off the network.
    outage: PathBuf,
}

impl Fleet {
    fn pick<T>(&self, request: &Request<T>) -> Result<AgentService, Status> {
        let local = request
            .local_addr()
            .ok_or_else(|| Status::internal("no local address"))?;
        let hosted = self
            .agents
            .get(&local)
            .ok_or_else(|| Status::not_found(format!("no agent on {local}")))?;
        if hosted.outage.exists() {
            return Err(Status::unavailable(format!(
                "agent on {local} is in an outage"
            )));
        }
        Ok(hosted.service.clone())
    }

    /// Whether a connection accepted on `local` may go on (its agent is not in an outage).
    fn accepts(&self, local: SocketAddr) -> bool {
        self.agents
            .get(&local)
            .is_none_or(|hosted| !hosted.outage.exists())
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

/// Starts the agents of `spec`'s nodes in `shard`; returns when every listener is bound.
async fn host(
    spec: &FleetSpec,
    shard: std::ops::Range<usize>,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    use clap::Parser;
    let mut agents = HashMap::new();
    let mut listeners = Vec::new();
    let mut tls = None;
    let hosted = shard.len();
    for i in shard {
        let setup = spec.agent(i);
        setup.create_dirs()?;
        if !sysctl_path(&setup.sysctl_root, "net.core.somaxconn").exists() {
            setup.write_sysctl("net.core.somaxconn", "8192")?;
        }
        let addr = setup.listen;
        let config = nodekeeper_agent::Config::try_parse_from(setup.args())?;
        if tls.is_none() {
            // The agent's own check of the files, then the same settings for this host.
            nodekeeper_agent::tls::server_config(&config)?;
            tls = Some(server_tls(&config, hosted)?);
        }
        agents.insert(
            addr,
            Hosted {
                service: AgentService::new(Arc::new(nodekeeper_agent::agent::Agent::new(&config))),
                outage: spec.outage_marker(i),
            },
        );
        listeners.push(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("bind {addr}"))?,
        );
    }
    let fleet = Fleet {
        agents: Arc::new(agents),
    };
    // A connection to an agent in an outage is closed as soon as it is accepted.
    let gate = fleet.clone();
    let incoming = futures::stream::select_all(
        listeners
            .into_iter()
            .map(tokio_stream::wrappers::TcpListenerStream::new),
    )
    .filter(move |conn| {
        let open = match conn {
            Ok(stream) => stream
                .local_addr()
                .map_or(true, |local| gate.accepts(local)),
            Err(_) => true,
        };
        std::future::ready(open)
    });
    let incoming = handshakes(
        incoming,
        tokio_rustls::TlsAcceptor::from(tls.context("no nodes in the spec")?),
    );
    let server = tonic::transport::Server::builder()
        .add_service(pb::node_agent_server::NodeAgentServer::new(fleet))
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned());
    tokio::spawn(server);
    Ok(())
}

/// The agent's server TLS settings (what tonic builds from `nodekeeper_agent::tls::server_config`:
/// the agent's certificate, client certificates required and chained to the CA, ALPN h2), with
/// a session cache of four sessions per hosted agent instead of 256 for all of them: rustls
/// stores each of the two tickets it sends after a handshake, and a real agent's cache holds
/// its controllers' sessions with room to spare.
fn server_tls(
    config: &nodekeeper_agent::Config,
    agents: usize,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&config.client_ca)? {
        roots.add(cert?)?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()?;
    let chain = CertificateDer::pem_file_iter(&config.tls_cert)?.collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&config.tls_key)?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    tls.alpn_protocols = vec![b"h2".to_vec()];
    tls.session_storage = rustls::server::ServerSessionMemoryCache::new(agents.max(64) * 4);
    Ok(Arc::new(tls))
}

/// The TLS connections of `incoming`: each handshake in its own task (as tonic's own TLS
/// server does them), bounded by the agent's 10 s handshake timeout; a failed one only closes
/// its connection.
fn handshakes<S>(
    incoming: S,
    acceptor: tokio_rustls::TlsAcceptor,
) -> tokio_stream::wrappers::ReceiverStream<
    std::io::Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
>
where
    S: futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        while let Some(conn) = incoming.next().await {
            let Ok(tcp) = conn else { continue };
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let accepted =
                    tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp))
                        .await;
                if let Ok(Ok(tls)) = accepted {
                    let _ = tx.send(Ok(tls)).await;
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[test]
#[ignore = "helper: the agents host of `cargo xtask bench fleet`, which starts it; not a test by itself"]
fn fleet_agents_host() {
    if std::env::var(ROLE_ENV).as_deref() != Ok(FLEET_ROLE) {
        return;
    }
    let spec = FleetSpec::from_env().expect("read the fleet spec");
    let shard = spec.shard_from_env().expect("read the shard");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async {
        let stop = tokio_util::sync::CancellationToken::new();
        host(&spec, shard.clone(), stop.clone())
            .await
            .expect("start agents");
        spec.write_ready(&shard).expect("write ready file");
        // Runs until the bench kills it.
        std::future::pending::<()>().await;
    });
}

/// Three agents in one process answer for their own nodes, over mTLS, by address.
#[tokio::test]
async fn calls_reach_the_agent_of_the_address_called() -> anyhow::Result<()> {
    let (dir, tls) = agent_pki()?;
    let port = nodekeeper_testkit::free_port();
    let b = 1 + rand::random::<u8>() % 250;
    let nodes: Vec<FleetNode> = (1..=3)
        .map(|i| FleetNode {
            name: format!("host-node-{i}"),
            ip: std::net::Ipv4Addr::new(127, 44, b, i),
        })
        .collect();
    let spec = FleetSpec {
        port,
        dir: dir.path().to_path_buf(),
        nodes,
    };
    let stop = tokio_util::sync::CancellationToken::new();
    host(&spec, 0..spec.nodes.len(), stop.clone()).await?;
    for node in &spec.nodes {
        let addr = SocketAddr::new(node.ip.into(), port);
        assert_eq!(reported_node(&tls, addr).await?, node.name);
    }
    assert_eq!(
        tls.handshakes(),
        (3, 0),
        "first contact is a full handshake"
    );
    // Second round: every agent's session is resumed.
    for node in &spec.nodes {
        let addr = SocketAddr::new(node.ip.into(), port);
        assert_eq!(reported_node(&tls, addr).await?, node.name);
    }
    assert_eq!(
        tls.handshakes(),
        (3, 3),
        "later connections resume the session"
    );
    // An outage takes exactly its agent off the network, and ends.
    let down = SocketAddr::new(spec.nodes[1].ip.into(), port);
    spec.set_outage(1, true)?;
    let refused = reported_node(&tls, down).await;
    assert!(
        refused.is_err(),
        "an agent in an outage answered: {refused:?}"
    );
    for i in [0, 2] {
        let addr = SocketAddr::new(spec.nodes[i].ip.into(), port);
        assert_eq!(reported_node(&tls, addr).await?, spec.nodes[i].name);
    }
    spec.set_outage(1, false)?;
    assert_eq!(reported_node(&tls, down).await?, spec.nodes[1].name);
    stop.cancel();
    Ok(())
}

/// Each hosted agent keeps its controller's TLS session, as a real agent does, however many
/// agents the host serves: the second call to every one of 300 agents resumes. (With one
/// rustls default cache of 256 sessions for the whole host, two stored per handshake, only the
/// none does: the round's 600 stored sessions evict each other.)
#[tokio::test]
async fn every_agent_of_a_large_host_resumes_its_session() -> anyhow::Result<()> {
    let (dir, tls) = agent_pki()?;
    let mut ips = nodekeeper_testkit::net::random_loopback_block(150);
    ips.extend(nodekeeper_testkit::net::random_loopback_block(150));
    let port = nodekeeper_testkit::net::port_free_on_all(&ips, nodekeeper_testkit::free_port())
        .context("a port free on every node address")?;
    let spec = FleetSpec {
        port,
        dir: dir.path().to_path_buf(),
        nodes: ips
            .iter()
            .enumerate()
            .map(|(i, ip)| FleetNode {
                name: format!("many-node-{i}"),
                ip: *ip,
            })
            .collect(),
    };
    let stop = tokio_util::sync::CancellationToken::new();
    host(&spec, 0..spec.nodes.len(), stop.clone()).await?;
    for round in 1..=2 {
        for node in &spec.nodes {
            let addr = SocketAddr::new(node.ip.into(), port);
            assert_eq!(reported_node(&tls, addr).await?, node.name, "round {round}");
        }
    }
    assert_eq!(
        tls.handshakes(),
        (300, 300),
        "(full, resumed) handshakes over two rounds of 300 agents"
    );
    stop.cancel();
    Ok(())
}

/// The rig's agents host, as the fleet bench starts it: this binary re-executed as
/// `fleet_agents_host`, split over processes by the bound per host (two here: nodes 0..2 and
/// 2..3), ready once every agent listens, each answering for its own node, and its fake sysctl
/// files where the rig says they are.
#[tokio::test]
async fn the_rig_starts_the_agents_host_and_each_agent_answers_for_its_node() -> anyhow::Result<()>
{
    use nodekeeper_controller::agent_client::AgentTls;
    use nodekeeper_controller::certs::{Leaf, generate_ca, issue};
    use nodekeeper_e2e::rig::{self, AgentsHost};
    let (ca_cert, ca_key) = generate_ca()?;
    let agent = issue(Leaf::Agent, &ca_cert, &ca_key)?;
    let controller = issue(Leaf::Controller, &ca_cert, &ca_key)?;
    let ips = nodekeeper_testkit::net::random_loopback_block(3);
    let port = nodekeeper_testkit::net::port_free_on_all(&ips, nodekeeper_testkit::free_port())
        .context("a port free on every node address")?;
    let nodes: Vec<FleetNode> = ips
        .iter()
        .enumerate()
        .map(|(i, ip)| FleetNode {
            name: format!("rig-node-{i}"),
            ip: *ip,
        })
        .collect();
    let tls = rig::AgentTls {
        cert: agent.cert.clone(),
        key: agent.key.clone(),
        ca: agent.ca.clone(),
    };
    let exe = std::env::current_exe()?;
    let host = AgentsHost::start(
        &exe,
        nodes.clone(),
        port,
        &tls,
        2,
        std::time::Duration::from_secs(60),
    )?;
    assert_eq!(host.pids().len(), 2, "3 agents, at most 2 per host");
    let client_tls = AgentTls::new(&controller.ca, &controller.cert, &controller.key);
    for (i, node) in nodes.iter().enumerate() {
        let addr = SocketAddr::new(node.ip.into(), port);
        assert_eq!(reported_node(&client_tls, addr).await?, node.name);
        let somaxconn = sysctl_path(&host.spec.agent(i).sysctl_root, "net.core.somaxconn");
        assert_eq!(std::fs::read_to_string(somaxconn)?, "8192\n");
    }
    Ok(())
}

/// A new CA, the agents' certificate, key and CA in the files a spec's directory holds (the
/// directory), and the controller's client identity from the same CA.
fn agent_pki() -> anyhow::Result<(
    tempfile::TempDir,
    nodekeeper_controller::agent_client::AgentTls,
)> {
    use nodekeeper_controller::certs::{Leaf, generate_ca, issue};
    let (ca_cert, ca_key) = generate_ca()?;
    let agent = issue(Leaf::Agent, &ca_cert, &ca_key)?;
    let controller = issue(Leaf::Controller, &ca_cert, &ca_key)?;
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("tls.crt"), &agent.cert)?;
    std::fs::write(dir.path().join("tls.key"), &agent.key)?;
    std::fs::write(dir.path().join("ca.crt"), &agent.ca)?;
    let tls = nodekeeper_controller::agent_client::AgentTls::new(
        &controller.ca,
        &controller.cert,
        &controller.key,
    );
    Ok((dir, tls))
}

/// The node name in the report of the agent at `addr`, over mTLS as the controller calls it.
async fn reported_node(
    tls: &nodekeeper_controller::agent_client::AgentTls,
    addr: SocketAddr,
) -> anyhow::Result<String> {
    use nodekeeper_controller::agent_client::{CallLimits, connect};
    let limits = CallLimits {
        timeout: std::time::Duration::from_secs(10),
        max_reply_bytes: 4 << 20,
    };
    let mut conn = connect(tls, addr, limits).await?;
    match conn.get_report(0).await?.result {
        Some(pb::get_report_response::Result::Report(report)) => Ok(report.node_name),
        other => anyhow::bail!("expected a report from {addr}, got {other:?}"),
    }
}
