//! The nodekeeper node agent: a mutual-TLS gRPC server (`NodeAgent`) that reports node health,
//! holds sysctl tunables in bounds, and (with issues 4 and 5) applies host networking and runs
//! probes. It never calls the Kubernetes API.

pub mod agent;
pub mod collect;
pub mod config;
pub mod diag;
pub mod network;
pub mod probes;
pub mod report;
pub mod service;
pub mod tls;
pub mod tunables;

use std::path::PathBuf;
use std::sync::Arc;

use nodekeeper_proto::agent::v1::node_agent_server::NodeAgentServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tracing::info;

pub use config::Config;

/// Everything that can go wrong in the agent outside a single collector.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {flag}: {reason}")]
    InvalidConfig { flag: &'static str, reason: String },
    #[error("read {flag} {path}: {source}")]
    ReadTls {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("rules refused, previous rules stay in force: {0}")]
    InvalidRules(String),
    #[error("save state to {path}: {source}")]
    SaveState {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("run probes: {0}")]
    RunProbes(#[from] probes::ProbeError),
    #[error("serve gRPC: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Runs the agent until `shutdown` is cancelled. When the TLS files change (a reissued
/// certificate in the Secret volume) the server stops gracefully and starts again with them.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    loop {
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|source| Error::Bind {
                addr: config.listen,
                source,
            })?;
        let generation = shutdown.child_token();
        let watcher = tokio::spawn(tls::watch(config.clone(), generation.clone()));
        let served = serve(config.clone(), listener, generation).await;
        watcher.abort();
        served?;
        if shutdown.is_cancelled() {
            return Ok(());
        }
        info!("TLS files changed; serving again with the new certificates");
    }
}

/// Serves on an already bound listener (tests bind port 0 and read the address back). On
/// shutdown the health service reports NOT_SERVING first, then in-flight calls finish.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    config.validate()?;
    let tls = tls::server_config(&config)?;
    let addr = listener.local_addr().ok();
    let agent = Arc::new(agent::Agent::new(&config));
    let max = config.max_message_bytes;
    let diagnostics = Arc::new(diag::Diagnostics::new(Arc::clone(&agent), &config));
    let svc = NodeAgentServer::new(service::AgentService::new(agent).with_diagnostics(diagnostics))
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<NodeAgentServer<service::AgentService>>()
        .await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    info!(?addr, node = %config.node_name, "serving");
    let signal = async move {
        shutdown.cancelled().await;
        info!("shutting down: reporting NOT_SERVING, finishing calls in flight");
        reporter
            .set_not_serving::<NodeAgentServer<service::AgentService>>()
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
    };
    Server::builder()
        .tls_config(tls)?
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY small responses wait on the peer's delayed ACK (~40 ms).
            TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .with_keepalive(Some(std::time::Duration::from_secs(60))),
            signal,
        )
        .await?;
    info!("stopped");
    Ok(())
}
