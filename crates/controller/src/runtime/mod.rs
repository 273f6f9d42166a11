//! The process around the controllers: [`run`] goes command line → tracing → Kubernetes client →
//! shutdown tree → HTTP API → Lease → (once leading) renewals, then certificates, then the leader
//! label, the shared watches and every controller. Losing the Lease ends the process (an error
//! from [`run`]), so the Pod restarts as a standby; SIGTERM/SIGINT end it cleanly after releasing
//! the Lease, and so does a failure to start leading (an error from [`run`]).
//!
//! The shutdown tree is one root [`CancellationToken`] (cancelled by a signal, by losing the
//! Lease, or by a fatal error) whose child tokens stop each task, and one [`TaskTracker`] that
//! `run` waits on (10 s at most) before returning.
//!
//! Files: [`cli`] (flags), [`logging`] (`--log-format`), [`signals`], [`leader`] (Lease and Pod
//! label), [`pki`] (certificate renewal), [`http`] (the HTTP API and metrics), [`crds`] (waiting
//! for the CRDs at start), [`cleanup`] (`--cleanup`, the uninstall Job).

pub mod cleanup;
pub mod cli;
pub mod crds;
pub mod http;
pub mod leader;
pub mod logging;
pub mod pki;
pub mod signals;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret};
use kube::Api;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, error, info, info_span, warn};

pub use cli::{Cli, LogFormat};

use crate::certs;
use crate::controllers::Controllers;
use crate::shared::{Fleet, Metrics, MtlsAgents, Shared, TuningState, fleet, lists, tuning};

/// Errors that end the process.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connect to the Kubernetes API: {0}")]
    ConnectKube(#[source] kube::Error),
    #[error("bind the HTTP API on {addr}: {source}")]
    BindHttp {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("invalid flags: {0}")]
    InvalidFlags(String),
    #[error(transparent)]
    Certificates(#[from] certs::CertError),
    #[error(transparent)]
    Leadership(#[from] leader::LeaderError),
    #[error("cleanup: {0}")]
    Cleanup(#[from] cleanup::CleanupError),
}

/// How long `run` waits for its tasks to stop.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Runs the controller until SIGTERM/SIGINT (Ok) or loss of the Lease (Err).
pub async fn run(cli: Cli) -> Result<(), Error> {
    logging::init(&cli);
    cli.check().map_err(Error::InvalidFlags)?;
    let identity = cli.identity();
    let mut kube_config = kube::Config::infer()
        .await
        .map_err(|e| Error::ConnectKube(kube::Error::InferConfig(e)))?;
    // Each replica names itself in its User-Agent, so an audit log tells the leader's requests
    // from a standby's (tests/tests/fault_leader_networktest.rs counts them).
    let agent = format!(
        "nodekeeper-controller/{} ({identity})",
        env!("CARGO_PKG_VERSION")
    );
    if let Ok(agent) = axum::http::HeaderValue::from_str(&agent) {
        kube_config
            .headers
            .push((axum::http::header::USER_AGENT, agent));
    }
    let cluster_url = kube_config.cluster_url.to_string();
    // The Lease's renewals get a client of their own (`leader::hold_apart`).
    let lease_kube_config = kube_config.clone();
    let client = kube::Client::try_from(kube_config).map_err(Error::ConnectKube)?;
    if cli.cleanup {
        let scope = cleanup::Scope {
            namespace: cli.namespace.clone(),
            lease_name: cli.lease_name.clone(),
            node_selector: cli.node_selector.clone(),
        };
        cleanup::run(&client, &scope).await?;
        return Ok(());
    }
    // NetworkTests' `apiServer` target: the flag, else the address this process reaches the
    // API server at (in a Pod, the `kubernetes` Service), so the shipped example works on the
    // shipped Deployment.
    let mut controllers_config = cli.controllers.clone();
    let api_server = &mut controllers_config.networktest.api_server_address;
    if api_server.is_none() {
        *api_server = crate::controllers::networktest::plan::api_server_from_url(&cluster_url);
    }
    match api_server {
        Some(addr) => {
            info!(%addr, from = if cli.controllers.networktest.api_server_address.is_some() { "flag" } else { "client" }, "API server address for NetworkTests")
        }
        None => {
            warn!(url = %cluster_url, "no API server address for NetworkTests: the API server URL is not an IP address; set --api-server-address")
        }
    }

    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    tracker.spawn(signals::cancel_on_signal(shutdown.clone()));

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let (tuning_tx, tuning_rx) = watch::channel(Arc::new(TuningState::defaults()));
    let fleet = Arc::new(Fleet::default());
    let agents = Arc::new(MtlsAgents::new(
        Arc::clone(&fleet),
        cli.max_reply_bytes,
        metrics.agents.clone(),
    ));
    let lease_annotations = leader::LeaseAnnotations::default();
    let shared = Shared {
        lease_annotations: lease_annotations.clone(),
        client: client.clone(),
        namespace: cli.namespace.clone(),
        identity: identity.clone(),
        agent_port: cli.agent_port,
        metrics: Arc::clone(&metrics),
        fleet: Arc::clone(&fleet),
        tuning: tuning_rx.clone(),
        agents: Arc::clone(&agents),
    };
    let controllers = Controllers::default();
    let is_leader = Arc::new(AtomicBool::new(false));

    let listener = bind_listen(cli.http_listen)
        .await
        .map_err(|source| Error::BindHttp {
            addr: cli.http_listen,
            source,
        })?;
    let listening = listener.local_addr().unwrap_or(cli.http_listen);
    info!(addr = %listening, identity = %identity, "HTTP API listening");
    {
        let router = http::router(
            Arc::new(http::Context {
                identity: identity.clone(),
                is_leader: Arc::clone(&is_leader),
                fleet: Arc::clone(&fleet),
                tuning: tuning_rx,
                registry,
                sweep: metrics.sweep.clone(),
            }),
            controllers.router(),
        );
        let stop = shutdown.child_token();
        tracker.spawn(async move {
            if let Err(error) = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
            {
                error!(%error, "HTTP API failed");
            }
        });
    }

    // Without the CRDs every controller's watch would fail: wait for them (serving /healthz).
    if !crds::wait_for_crds(&client, &shutdown).await {
        tracker.close();
        tracker.wait().await;
        return Ok(());
    }
    let pod = cli.pod_name.as_deref();
    leader::label_pod(&client, &cli.namespace, pod, false).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &cli.namespace);
    let lease_config = leader::LeaderConfig {
        name: cli.lease_name.clone(),
        identity: identity.clone(),
        lease_duration: cli.lease_duration,
        renew_deadline: cli.renew_deadline,
        retry_period: cli.retry_period,
        annotations: lease_annotations.clone(),
    };
    let Some(acquired) = leader::acquire(&leases, &lease_config, &shutdown).await else {
        tracker.close();
        tracker.wait().await;
        return Ok(());
    };
    info!(identity = %identity, lease = %cli.lease_name, previous = acquired.previous.as_deref().unwrap_or("none seen"), "leading");
    if let Some(at) = acquired.previous_renewed {
        fleet.set_previous_leader_renewed(at);
    }
    // Renewals start at once: the renew deadline counts from the write that took the Lease
    // (`acquired.sent`), and the start below (a list probe of up to 5 s, the certificate
    // Secrets on a possibly slow API server) must not eat into it. They stop on a token of
    // their own, only once this replica has stopped writing (below): stopped with the others at
    // a signal, the Lease could expire while reconciles wind down, and the standby lead beside
    // their last writes.
    let renewals = CancellationToken::new();
    let hold = leader::hold_apart(
        lease_kube_config,
        cli.namespace.clone(),
        lease_config.clone(),
        acquired.lease,
        acquired.sent,
        renewals.clone(),
    );
    let mut hold = std::pin::pin!(hold);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cli.namespace);
    let starting = async {
        // Before any watch starts: stream the big initial lists or page them
        // (`shared::lists`). Asked here, not at start, so that the API server is known to
        // answer (the Lease was just taken) and a standby started during an outage does not
        // settle for pages.
        let (mode, why) = lists::resolve(&client, cli.initial_lists).await;
        lists::set(mode);
        match (mode, cli.initial_lists) {
            (lists::Mode::Pages, lists::InitialLists::Auto) => {
                warn!(mode = mode.as_str(), reason = %why, "Node and Pod watches list in pages; every page costs the API server a walk over the rest of its cache (set --initial-lists=pages to skip this check)")
            }
            _ => {
                info!(mode = mode.as_str(), reason = %why, "how Node and Pod watches read their initial state")
            }
        }
        pki::ensure_bounded(&secrets, &metrics.runtime).await
    };
    // What ended the renewals when they ended before this replica stopped writing (the Lease
    // lost); `None` while they go on.
    let mut held: Option<Result<Lease, leader::LeaderError>> = None;
    let started = tokio::select! {
        // Lost before the start finished: nothing was started.
        lost = &mut hold => {
            held = Some(lost);
            None
        }
        // A signal before the start finished: nothing was started; released below.
        () = shutdown.cancelled() => None,
        started = starting => Some(started),
    };
    // From here on this replica writes; everything below runs only while it leads.
    let failure = match started {
        None => None,
        Some(Err(error)) => {
            // Still holding the Lease: release it below, so the standby (which may find the
            // certificates fine, or fail the same way) takes over at once.
            error!(%error, "could not start leading; releasing the lease");
            Some(Error::from(error))
        }
        Some(Ok((pem, _))) => {
            agents.set_tls(&pem);
            // Only now: the Service routes the HTTP API to a leader that is ready.
            is_leader.store(true, Ordering::Relaxed);
            metrics.runtime.is_leader.set(1);
            {
                // In its own task: a label patch tried again for up to half a minute must not
                // hold up the controllers; stopped with them, before the label is taken off
                // below.
                let (client, namespace, pod) =
                    (client.clone(), cli.namespace.clone(), cli.pod_name.clone());
                let stop = shutdown.child_token();
                tracker.spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = leader::label_pod(&client, &namespace, pod.as_deref(), true) => {}
                    }
                });
            }
            tracker.spawn(
                fleet::watch_nodes(
                    Api::<Node>::all(client.clone()),
                    cli.node_selector.clone(),
                    Arc::clone(&fleet),
                    metrics.sweep.clone(),
                    shutdown.child_token(),
                )
                .instrument(info_span!("node_watch")),
            );
            tracker.spawn(
                tuning::watch_tuning(
                    Api::<ConfigMap>::namespaced(client.clone(), &cli.namespace),
                    cli.tuning_configmap.clone(),
                    shared.recorder(),
                    tuning_tx,
                    metrics.tuning.clone(),
                    shutdown.child_token(),
                )
                .instrument(info_span!("tuning_watch")),
            );
            tracker.spawn(
                pki::renew_certificates(
                    secrets.clone(),
                    Arc::clone(&agents),
                    metrics.runtime.clone(),
                    pem,
                    shutdown.child_token(),
                )
                .instrument(info_span!("certificate_renewal")),
            );
            controllers.start(&shared, &controllers_config, &tracker, &shutdown);
            tokio::select! {
                lost = &mut hold => held = Some(lost),
                // A signal, or a fatal error elsewhere: the renewals go on below until the
                // tasks have stopped.
                () = shutdown.cancelled() => {}
            }
            None
        }
    };
    if let Some(Err(error)) = &held {
        error!(%error, "stopping: this replica no longer leads");
    }
    // The controllers stop at once: a replica that lost the Lease must not write while the
    // label patch below waits on a slow API server (the standby may lead
    // `--lease-duration` − `--renew-deadline` after the give-up).
    shutdown.cancel();
    // Off the Service first, then the Lease: the label never outlives the leadership, and the
    // standby (which labels itself once it holds the Lease) never shares it with this Pod.
    is_leader.store(false, Ordering::Relaxed);
    metrics.runtime.is_leader.set(0);
    leader::label_pod(&client, &cli.namespace, pod, false).await;
    // Reconciles in flight are dropped at their next wait (`controllers::start`); the Lease is
    // released only after they have stopped, so the standby never leads beside a write of ours.
    tracker.close();
    if tokio::time::timeout(STOP_GRACE, tracker.wait())
        .await
        .is_err()
    {
        warn!("tasks did not stop within 10s");
    }
    // Nothing of ours writes any more: the renewals may stop, and the Lease go.
    renewals.cancel();
    let result = match held {
        Some(held) => held,
        None => hold.await,
    }
    .map_err(Error::from);
    if let Ok(written) = &result {
        leader::release(&leases, &lease_config, written.clone()).await;
    }
    match failure {
        Some(error) => Err(error),
        None => result.map(|_| ()),
    }
}

/// Binds `--http-listen`. The default, `[::]`, takes IPv4 and IPv6 alike on Linux (IPv4 arrives
/// mapped, unless the host sets `net.ipv6.bindv6only`), so the kubelet's probes and the Service
/// reach it on single- and dual-stack clusters of either family; on a host without IPv6
/// (`ipv6.disable=1`), where it cannot be bound, it listens on `0.0.0.0` instead rather than
/// not start.
pub async fn bind_listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Err(error) => match nodekeeper_model::listen::ipv4_fallback(addr, &error) {
            Some(v4) => {
                warn!(%addr, %error, listen = %v4, "this host has no IPv6; listening on IPv4 only");
                tokio::net::TcpListener::bind(v4).await
            }
            None => Err(error),
        },
        bound => bound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;
    use std::net::IpAddr;

    /// The default `--http-listen` serves both families on this (Linux) host.
    #[tokio::test]
    #[allow(clippy::print_stdout)] // a skip prints `SKIPPED: <test>: <reason>`, the contract with CI
    async fn the_default_http_listen_address_takes_ipv4_and_ipv6() {
        let cli = Cli::parse_from(["nodekeeper-controller"]);
        assert_eq!(cli.http_listen, "[::]:8080".parse().unwrap());
        let listener = bind_listen("[::]:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        for client in ["127.0.0.1", "::1"] {
            let ip: IpAddr = client.parse().unwrap();
            // Containers often run with IPv6 off (`disable_ipv6`, no ::1) though the kernel has it.
            if ip.is_ipv6() && std::net::TcpListener::bind("[::1]:0").is_err() {
                println!(
                    "SKIPPED: the_default_http_listen_address_takes_ipv4_and_ipv6: this host has \
                     no IPv6 loopback (::1); the IPv4 half passed"
                );
                return;
            }
            let connect = tokio::net::TcpStream::connect(SocketAddr::new(ip, port));
            let (connected, accepted) = tokio::join!(connect, listener.accept());
            connected.unwrap_or_else(|e| panic!("connect over {client}: {e}"));
            let (_, from) = accepted.unwrap();
            assert_eq!(from.ip().to_canonical(), ip, "accepted over {client}");
        }
    }
}
