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
//!   monitors under the shutdown token, the listener, and the server generations it hands
//!   connections to (one per set of TLS files).
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
use std::time::Duration;

use nodekeeper_proto::agent::v1::node_agent_server::NodeAgentServer;
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
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
/// volume) new connections get a server with them at once, on the same listener, while calls in
/// flight finish on the previous one.
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
    // Held until the agent returns: `--cleanup` refuses meanwhile.
    let _lock = lock_state_dir(&config.state_dir).await?;
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
        Some(listener) => serve_listener(&config, &agent, &tasks, listener, false, &shutdown).await,
        None => match bind_listen(config.listen).await {
            Ok(listener) => {
                serve_listener(&config, &agent, &tasks, listener, true, &shutdown).await
            }
            Err(source) => Err(Error::Bind {
                addr: config.listen,
                source,
            }),
        },
    };
    background.cancel();
    tasks.close();
    tasks.wait().await;
    served
}

/// Takes `<state-dir>/agent.lock` ([`cleanup::StateLock`]), so that `--cleanup` refuses while the
/// agent runs (its drift loop would put back what the cleanup removes). Another holder is waited
/// for a few seconds: an agent being replaced releases it when its process ends.
async fn lock_state_dir(state_dir: &std::path::Path) -> Result<cleanup::StateLock, Error> {
    let path = state_dir.join(cleanup::LOCK_FILE);
    for attempt in 0..20 {
        match cleanup::StateLock::try_take(state_dir) {
            Ok(Some(lock)) => return Ok(lock),
            Ok(None) if attempt == 0 => warn!(
                path = %path.display(),
                "another nodekeeper-agent or its --cleanup holds the state directory; waiting"
            ),
            Ok(None) => {}
            Err(error) => {
                return Err(Error::LockStateDir {
                    path,
                    reason: error.to_string(),
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(Error::LockStateDir {
        path,
        reason: "held by another nodekeeper-agent, or its --cleanup, on this host for 10s; two \
                 agents must not share a --state-dir: stop the other one (or let the cleanup end) \
                 and start again"
            .into(),
    })
}

/// Serves on `listener` until `shutdown`; with `reload`, checks the TLS files every
/// `--tls-reload-interval` and serves new connections with them once they change.
///
/// The listener is accepted on here, for the whole life of the agent, and each connection is
/// handed to the newest server generation (one per set of TLS files). A reload starts the next
/// generation and retires the previous one, which finishes its calls in flight (a `RunProbes` of
/// many minutes, a diagnostics stream) in a task of its own and then ends: the port never closes
/// for a reload, so sweeps, `ApplyNetwork` and the kubelet's TCP liveness probe are answered
/// throughout. (Stopping the server and binding again, as before, closed the port until the
/// longest call in flight ended.) New files that cannot be used (unreadable mid-update, not PEM, a
/// key that does not match its certificate) are ignored, with a warning, until they change again.
async fn serve_listener(
    config: &Config,
    agent: &Arc<Agent>,
    tasks: &TaskTracker,
    listener: TcpListener,
    reload: bool,
    shutdown: &CancellationToken,
) -> Result<(), Error> {
    let addr = listener.local_addr().ok();
    // Without TCP_NODELAY small responses wait on the peer's delayed ACK (~40 ms).
    let mut incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    let mut files = tls::fingerprint(config);
    let mut current = Generation::start(config, agent, tasks, shutdown)?;
    info!(?addr, node = %config.node_name, "serving");
    let mut tick = tokio::time::interval(config.tls_reload_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = incoming.next() => {
                // `TcpIncoming` never ends; an accept error goes to the server, which logs it
                // and goes on, as it did when it held the listener itself.
                let Some(accepted) = accepted else { break };
                if current.connections.send(accepted).await.is_err() {
                    // The generation stopped on its own (an error, returned below).
                    break;
                }
            }
            _ = tick.tick(), if reload => {
                let now = tls::fingerprint(config);
                // Unreadable (a Secret volume mid-update) or unchanged: nothing to do yet.
                if now.is_none() || now == files {
                    continue;
                }
                files = now;
                match Generation::start(config, agent, tasks, shutdown) {
                    Ok(next) => {
                        info!(
                            "TLS files changed; new connections get the new certificates, calls \
                             in flight finish with the old"
                        );
                        std::mem::replace(&mut current, next).retire(tasks, shutdown);
                    }
                    Err(error) => warn!(
                        %error,
                        "TLS files changed but cannot be used; serving with the previous ones \
                         until they change again"
                    ),
                }
            }
        }
    }
    // Closes the port: nothing is accepted after shutdown.
    drop(incoming);
    current.finish().await
}

/// One server generation: the agent served with the TLS files as they were when it started, on
/// the connections sent to it. On shutdown its health service reports NOT_SERVING first, then
/// its calls in flight finish.
struct Generation {
    connections: tokio::sync::mpsc::Sender<std::io::Result<TcpStream>>,
    served: tokio::task::JoinHandle<Result<(), Error>>,
}

impl Generation {
    /// Reads the TLS files and starts serving what arrives on `connections`; fails, serving
    /// nothing, when the files cannot be used.
    fn start(
        config: &Config,
        agent: &Arc<Agent>,
        tasks: &TaskTracker,
        shutdown: &CancellationToken,
    ) -> Result<Self, Error> {
        let tls = tls::server_config(config)?;
        let max = config.max_message_bytes;
        let diagnostics = Arc::new(diag::Diagnostics::new(Arc::clone(agent), config));
        let svc = NodeAgentServer::new(
            service::AgentService::new(Arc::clone(agent))
                .with_diagnostics(diagnostics)
                .with_probe_options(config.probe_options()),
        )
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
        let (reporter, health) = tonic_health::server::health_reporter();
        // Builds the TLS acceptor now, so that a key that does not match its certificate fails
        // here rather than at the first handshake.
        let router = Server::builder()
            .tls_config(tls)?
            .add_service(health)
            .add_service(svc);

        let (connections, incoming) = tokio::sync::mpsc::channel(16);
        let shutdown = shutdown.clone();
        let served = tasks.spawn(async move {
            reporter
                .set_serving::<NodeAgentServer<service::AgentService>>()
                .await;
            reporter
                .set_service_status("", tonic_health::ServingStatus::Serving)
                .await;
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
            // The stream ends when the generation is retired: tonic then stops taking
            // connections from it and lets the open ones finish (gracefully, as on `signal`).
            router
                .serve_with_incoming_shutdown(ReceiverStream::new(incoming), signal)
                .await?;
            info!("stopped");
            Ok(())
        });
        Ok(Self {
            connections,
            served,
        })
    }

    /// Takes no more connections: those already sent to it finish their TLS handshakes (hence
    /// the wait, as long as the handshake timeout), then every call in flight runs to its end,
    /// in the generation's own task, and the generation ends.
    fn retire(self, tasks: &TaskTracker, shutdown: &CancellationToken) {
        let Self { connections, .. } = self;
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(tls::HANDSHAKE_TIMEOUT) => {}
                // The generation stops on shutdown by itself; the agent need not wait here.
                () = shutdown.cancelled() => {}
            }
            drop(connections);
        });
    }

    /// Waits for the generation to stop (it stops on shutdown, or on an error).
    async fn finish(self) -> Result<(), Error> {
        let Self {
            connections,
            served,
        } = self;
        let result = served.await;
        drop(connections);
        match result {
            Ok(served) => served,
            Err(join) => std::panic::resume_unwind(join.into_panic()),
        }
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
