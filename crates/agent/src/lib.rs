//! The nodekeeper node agent: a mutual-TLS gRPC server (`NodeAgent`) that reports node health,
//! holds sysctl tunables in bounds, applies host networking (and keeps it applied) and runs
//! network probes. It never calls the Kubernetes API.
//!
//! What lives where, from the bottom up (a module uses only those above it in this list; test
//! modules may drive a module through the ones that use it):
//! - `nodekeeper_model` (another crate): indicator families, levels and verdicts
//!   (`indicators`), the tuning rules' checks and limits (`tuning`), probe limits (`probe`), the
//!   host network model (`network`) — the rules the controller applies too;
//! - [`collect`]: the collectors (procfs, statvfs, netlink, `nvidia-smi`, plugin files), plain
//!   measurements with no verdicts;
//! - [`probes`]: `RunProbes` — request validation and the ICMP, TCP, DNS, HTTP and path-MTU probes;
//! - [`network`]: the host network manager — `ApplyNetwork`, the applied state, its status, which
//!   links it manages, and the drift loop (through `nodekeeper_netconf`);
//! - [`error`]: the agent's one error type;
//! - [`tunables`]: `SetRules` validation, evaluation and repair of sysctls, the state file;
//! - [`monitor`]: node problems in node-problem-detector's terms — the kernel-log monitor and
//!   custom plugins (NPD's own rule files), kubelet and runtime health, NPD's problem metrics;
//! - [`report`]: judging the measurements into a report, and its revision;
//! - [`config`] (flags) and [`tls`] (mutual TLS, the file watch that triggers a reload);
//! - [`agent`]: the state shared by every call, built once per process;
//! - [`service`]: the gRPC service — proto conversions, and the one place errors become
//!   `tonic::Status`;
//! - [`cleanup`]: `--cleanup`, reverting what the agent changed on the host (uninstall);
//! - this file: [`run`] and [`serve`] — the agent built once, its drift loop and problem
//!   monitors under the shutdown token, and the server generations (one per set of TLS files).
//!
//! Tests that need root run in network namespaces they create and report `SKIPPED` otherwise
//! (the README's "Try it"); the crate README lists the flags and the plugin file format.

pub mod agent;
pub mod cleanup;
pub mod collect;
pub mod config;
pub mod diag;
pub mod error;
pub mod monitor;
pub mod network;
pub mod probes;
pub mod report;
pub mod service;
pub mod tls;
pub mod tunables;

use std::net::SocketAddr;
use std::sync::Arc;

use nodekeeper_proto::agent::v1::node_agent_server::NodeAgentServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tracing::{info, warn};

use crate::agent::Agent;

pub use config::Config;
pub use error::Error;

/// Runs the agent until `shutdown` is cancelled. The agent (its rules, applied network state and
/// drift loop) is built once; when the TLS files change (a reissued certificate in the Secret
/// volume) only the server stops gracefully and starts again with them.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    with_agent(config, shutdown, None).await
}

/// Serves on an already bound listener (tests bind port 0 and read the address back), with the
/// agent and its drift loop as [`run`] has them. The TLS files are read once (no reload: [`run`]
/// does that).
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    with_agent(config, shutdown, Some(listener)).await
}

/// Builds the agent once, starts its drift loop under a child of `shutdown`, serves (on
/// `listener`, or on `--listen` with TLS reloads), then stops the loop and waits for it.
async fn with_agent(
    config: Config,
    shutdown: CancellationToken,
    listener: Option<TcpListener>,
) -> Result<(), Error> {
    config.validate()?;
    let agent = Arc::new(Agent::new(&config));
    let tasks = TaskTracker::new();
    // Cancelled when serving ends for any reason, not only on `shutdown`.
    let background = shutdown.child_token();
    let drift = Arc::clone(&agent);
    let interval = config.drift_interval;
    let stop = background.clone();
    tasks.spawn(async move { drift.network().drift_loop(interval, stop).await });
    monitor::start(&config.monitors(), agent.problems(), &background, &tasks).await;
    let served = match listener {
        Some(listener) => serve_once(&config, &agent, listener, shutdown).await,
        None => serve_reloading(&config, &agent, &tasks, &shutdown).await,
    };
    background.cancel();
    tasks.close();
    tasks.wait().await;
    served
}

/// Serves on `--listen` until `shutdown`, starting over with new certificates whenever the TLS
/// files change.
async fn serve_reloading(
    config: &Config,
    agent: &Arc<Agent>,
    tasks: &TaskTracker,
    shutdown: &CancellationToken,
) -> Result<(), Error> {
    loop {
        let listener = bind_listen(config.listen)
            .await
            .map_err(|source| Error::Bind {
                addr: config.listen,
                source,
            })?;
        let generation = shutdown.child_token();
        tasks.spawn(tls::watch(config.clone(), generation.clone()));
        let served = serve_once(config, agent, listener, generation.clone()).await;
        // Stops the watcher when serving ended on its own (an error).
        generation.cancel();
        served?;
        if shutdown.is_cancelled() {
            return Ok(());
        }
        info!("TLS files changed; serving again with the new certificates");
    }
}

/// Binds `--listen`. The default, `[::]`, takes IPv4 and IPv6 alike on Linux (IPv4 arrives
/// mapped, unless the host sets `net.ipv6.bindv6only`); on a host without IPv6
/// (`ipv6.disable=1`), where it cannot be bound, the agent listens on `0.0.0.0` instead rather
/// than not start.
pub async fn bind_listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Err(error) => match nodekeeper_model::listen::ipv4_fallback(addr, &error) {
            Some(v4) => {
                warn!(%addr, %error, listen = %v4, "this host has no IPv6; listening on IPv4 only");
                TcpListener::bind(v4).await
            }
            None => Err(error),
        },
        bound => bound,
    }
}

/// One server generation: serves `agent` with the TLS files as they are now until `shutdown`.
/// On shutdown the health service reports NOT_SERVING first, then in-flight calls finish.
async fn serve_once(
    config: &Config,
    agent: &Arc<Agent>,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let tls = tls::server_config(config)?;
    let addr = listener.local_addr().ok();
    let agent = Arc::clone(agent);
    let max = config.max_message_bytes;
    let diagnostics = Arc::new(diag::Diagnostics::new(Arc::clone(&agent), config));
    let svc = NodeAgentServer::new(
        service::AgentService::new(agent)
            .with_diagnostics(diagnostics)
            .with_probe_options(config.probe_options()),
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    /// The default listen address serves both families on this (Linux) host.
    #[tokio::test]
    async fn the_default_listen_address_takes_ipv4_and_ipv6() {
        let default: SocketAddr = "[::]:9443".parse().unwrap();
        let config = <Config as clap::Parser>::try_parse_from([
            "nodekeeper-agent",
            "--node-name=n1",
            "--tls-cert=/c",
            "--tls-key=/k",
            "--client-ca=/ca",
        ])
        .unwrap();
        assert_eq!(config.listen, default, "the default --listen");
        let listener = bind_listen("[::]:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        for client in ["127.0.0.1", "::1"] {
            let ip: IpAddr = client.parse().unwrap();
            // Containers often run with IPv6 off (`disable_ipv6`, no ::1) though the kernel has it.
            if ip.is_ipv6() && std::net::TcpListener::bind("[::1]:0").is_err() {
                nodekeeper_testkit::skip!(
                    "this host has no IPv6 loopback (::1); the IPv4 half passed"
                );
            }
            let connect = tokio::net::TcpStream::connect(SocketAddr::new(ip, port));
            let (connected, accepted) = tokio::join!(connect, listener.accept());
            connected.unwrap_or_else(|e| panic!("connect over {client}: {e}"));
            let (_, from) = accepted.unwrap();
            assert_eq!(from.ip().to_canonical(), ip, "accepted over {client}");
        }
    }
}
