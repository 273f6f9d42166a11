//! The nodekeeper controller-manager: leadership, the PKI, the Node watch, the fleet sweep that
//! pulls agent reports and writes Node conditions only on change, the tuning ConfigMap, and the
//! HTTP API and metrics. `main.rs` parses [`Cli`] and calls [`run`].

pub mod agent_client;
pub mod certs;
pub mod conditions;
pub mod configmap;
pub mod fleet;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod networktest;
// Temporary until the controller scaffold lands: the NodeMaintenance controller's folder.
#[path = "controllers/node_maintenance/mod.rs"]
pub mod node_maintenance;
pub mod schedule;
pub mod sweep;
pub mod view;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::agent_client::{AgentTls, CallLimits};
use crate::configmap::TuningState;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::networktest::ResultsStore;

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Json,
    Plain,
}

/// The nodekeeper controller-manager. Run two replicas: one holds the Lease and works, the other
/// waits to take over.
#[derive(Clone, Debug, Parser)]
#[command(name = "nodekeeper-controller", version, about, long_about = None)]
pub struct Cli {
    /// Namespace of the Lease, the certificate Secrets and the tuning ConfigMap.
    #[arg(long, env = "NODEKEEPER_NAMESPACE", default_value = "nodekeeper")]
    pub namespace: String,

    /// This replica's identity in the Lease (the Pod name in a cluster). Default: host name and PID.
    #[arg(long, env = "NODEKEEPER_IDENTITY")]
    pub identity: Option<String>,

    /// This replica's Pod name; when set, the leader labels its Pod `nodekeeper.dev/leader=true`
    /// so that the Service routes the HTTP API to it.
    #[arg(long, env = "NODEKEEPER_POD_NAME")]
    pub pod_name: Option<String>,

    /// Address of the HTTP API and metrics.
    #[arg(long, env = "NODEKEEPER_HTTP_LISTEN", default_value = "0.0.0.0:8080")]
    pub http_listen: SocketAddr,

    /// Port of the agents' gRPC servers on each node's InternalIP.
    #[arg(long, env = "NODEKEEPER_AGENT_PORT", default_value_t = 9443)]
    pub agent_port: u16,

    /// Only Nodes matching this label selector are managed (default: all).
    #[arg(long, env = "NODEKEEPER_NODE_SELECTOR")]
    pub node_selector: Option<String>,

    /// Name of the Lease.
    #[arg(
        long,
        env = "NODEKEEPER_LEASE_NAME",
        default_value = "nodekeeper-controller"
    )]
    pub lease_name: String,

    /// How long a Lease holder that stopped renewing keeps it.
    #[arg(long, env = "NODEKEEPER_LEASE_DURATION", default_value = "15s", value_parser = duration)]
    pub lease_duration: Duration,

    /// The leader gives up if it could not renew for this long.
    #[arg(long, env = "NODEKEEPER_RENEW_DEADLINE", default_value = "10s", value_parser = duration)]
    pub renew_deadline: Duration,

    /// Interval of Lease renewals and acquisition attempts. Each renewal is an API write, so
    /// this sets the controller's steady-state write rate: 5s is 0.2 writes/s (client-go's 2s
    /// would be 0.5/s, measured in BENCHMARKS.md).
    #[arg(long, env = "NODEKEEPER_RETRY_PERIOD", default_value = "5s", value_parser = duration)]
    pub retry_period: Duration,

    /// Name of the tuning ConfigMap in `--namespace`.
    #[arg(long, env = "NODEKEEPER_TUNING_CONFIGMAP", default_value = nodekeeper_model::tuning::CONFIGMAP_NAME)]
    pub tuning_configmap: String,

    /// Largest agent reply accepted, in bytes; a larger one counts as an invalid reply.
    #[arg(long, env = "NODEKEEPER_MAX_REPLY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_reply_bytes: usize,

    /// The API server as nodes reach it (`host:port`, e.g. `10.0.0.1:6443`), probed by a
    /// NetworkTest target `apiServer: true`. Unset by default: such a test then fails with a
    /// condition naming `spec.targets[i].apiServer`.
    #[arg(long, env = "NODEKEEPER_API_SERVER_ADDRESS")]
    pub api_server_address: Option<SocketAddr>,

    /// The cloud metadata service's IP address, probed by a NetworkTest target
    /// `metadataService: true`. Unset by default and never assumed: such a test then fails with a
    /// condition naming `spec.targets[i].metadataService`.
    #[arg(long, env = "NODEKEEPER_METADATA_SERVICE_ADDRESS")]
    pub metadata_service_address: Option<IpAddr>,

    /// Log line format.
    #[arg(
        long,
        env = "NODEKEEPER_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    pub log_format: LogFormat,

    /// Log filter in `tracing` env-filter syntax.
    #[arg(long, env = "NODEKEEPER_LOG", default_value = "info")]
    pub log: String,
}

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

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
}

/// Settings fixed for the life of the process.
#[derive(Clone, Debug)]
pub struct Settings {
    pub agent_port: u16,
    pub max_reply_bytes: usize,
}

/// Shared by every task of the controller.
pub struct Context {
    pub client: kube::Client,
    pub namespace: String,
    pub identity: String,
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    pub registry: Registry,
    pub fleet: Arc<Fleet>,
    pub tuning: watch::Receiver<Arc<TuningState>>,
    pub agent_tls: RwLock<Option<AgentTls>>,
    /// Full results of finished NetworkTests, served by the HTTP API.
    pub networktest_results: ResultsStore,
    pub is_leader: AtomicBool,
    pub cancel: CancellationToken,
}

impl Context {
    /// The tuning in force.
    pub fn tuning(&self) -> Arc<TuningState> {
        Arc::clone(&self.tuning.borrow())
    }

    /// The client TLS settings for agent calls (set once certificates are loaded).
    pub fn agent_tls(&self) -> AgentTls {
        self.agent_tls
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .expect("the sweep starts only after certificates are loaded")
    }

    fn set_agent_tls(&self, pem: &certs::Pem) {
        *self
            .agent_tls
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(AgentTls::new(&pem.ca, &pem.cert, &pem.key));
    }
}

fn init_tracing(cli: &Cli) {
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cli.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Plain => builder.try_init(),
    };
}

/// Labels this replica's Pod as leader or not (best effort; only with `--pod-name`).
async fn label_pod(client: &kube::Client, namespace: &str, pod: Option<&str>, leader: bool) {
    let Some(pod) = pod else { return };
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let body = serde_json::json!({ "metadata": { "labels": { "nodekeeper.dev/leader": leader.to_string() } } });
    if let Err(error) = api
        .patch(pod, &PatchParams::default(), &Patch::Merge(&body))
        .await
    {
        warn!(%error, pod, "labelling the Pod failed; the Service may route the HTTP API to a standby");
    }
}

/// Runs the controller until SIGTERM/SIGINT (Ok) or loss of the Lease (Err).
pub async fn run(cli: Cli) -> Result<(), Error> {
    init_tracing(&cli);
    if cli.renew_deadline >= cli.lease_duration || cli.retry_period >= cli.renew_deadline {
        return Err(Error::InvalidFlags(format!(
            "need --retry-period ({:?}) < --renew-deadline ({:?}) < --lease-duration ({:?})",
            cli.retry_period, cli.renew_deadline, cli.lease_duration
        )));
    }
    let identity = cli.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let client = kube::Client::try_default()
        .await
        .map_err(Error::ConnectKube)?;
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();

    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                Some(()) = async { match term.as_mut() { Some(t) => t.recv().await, None => std::future::pending().await } } => {}
            }
            info!("shutdown requested");
            cancel.cancel();
        });
    }

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let (tuning_tx, tuning_rx) = watch::channel(Arc::new(TuningState::defaults()));
    let ctx = Arc::new(Context {
        client: client.clone(),
        namespace: cli.namespace.clone(),
        identity: identity.clone(),
        settings: Settings {
            agent_port: cli.agent_port,
            max_reply_bytes: cli.max_reply_bytes,
        },
        metrics: Arc::clone(&metrics),
        registry,
        fleet: Arc::new(Fleet::default()),
        tuning: tuning_rx,
        agent_tls: RwLock::new(None),
        networktest_results: ResultsStore::default(),
        is_leader: AtomicBool::new(false),
        cancel: cancel.clone(),
    });

    let listener = tokio::net::TcpListener::bind(cli.http_listen)
        .await
        .map_err(|source| Error::BindHttp {
            addr: cli.http_listen,
            source,
        })?;
    info!(addr = %cli.http_listen, identity = %identity, "HTTP API listening");
    {
        let router = http::router(Arc::clone(&ctx));
        let cancel = cancel.clone();
        tracker.spawn(async move {
            let shutdown = async move { cancel.cancelled().await };
            if let Err(error) = axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
            {
                error!(%error, "HTTP API failed");
            }
        });
    }

    label_pod(&client, &cli.namespace, cli.pod_name.as_deref(), false).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &cli.namespace);
    let lease_config = leader::LeaderConfig {
        name: cli.lease_name.clone(),
        identity: identity.clone(),
        lease_duration: cli.lease_duration,
        renew_deadline: cli.renew_deadline,
        retry_period: cli.retry_period,
    };
    if !leader::acquire(&leases, &lease_config, &cancel).await {
        tracker.close();
        tracker.wait().await;
        return Ok(());
    }
    info!(identity = %identity, lease = %cli.lease_name, "leading");
    ctx.is_leader.store(true, Ordering::Relaxed);
    metrics.is_leader.set(1);
    label_pod(&client, &cli.namespace, cli.pod_name.as_deref(), true).await;

    // From here on this replica writes; everything below runs only while it leads.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cli.namespace);
    let leading = async {
        let (pem, _) = certs::ensure(&secrets).await?;
        ctx.set_agent_tls(&pem);

        tracker.spawn(fleet::watch_nodes(
            Api::<Node>::all(client.clone()),
            cli.node_selector.clone(),
            Arc::clone(&ctx.fleet),
            Arc::clone(&metrics),
            cancel.clone(),
        ));
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "nodekeeper-controller".into(),
                instance: Some(identity.clone()),
            },
        );
        tracker.spawn(configmap::watch_tuning(
            Api::<ConfigMap>::namespaced(client.clone(), &cli.namespace),
            cli.tuning_configmap.clone(),
            recorder,
            tuning_tx,
            Arc::clone(&metrics),
            cancel.clone(),
        ));
        tracker.spawn(sweep::run(Arc::clone(&ctx)));
        tracker.spawn(renew_certificates(Arc::clone(&ctx), secrets.clone()));
        tracker.spawn(condition_gauges(Arc::clone(&ctx)));
        tracker.spawn(networktest::reconcile::run(
            Arc::new(networktest::reconcile::Context {
                client: client.clone(),
                agent_port: cli.agent_port,
                call: probe_call(Arc::clone(&ctx)),
                env: networktest::Environment {
                    api_server: cli.api_server_address,
                    metadata_service: cli.metadata_service_address,
                },
                store: ctx.networktest_results.clone(),
                // Probe calls mostly wait (count × interval); 256 in flight finish a
                // 1,000-node mesh in four rounds.
                agent_concurrency: 256,
                test_concurrency: 4,
                namespace: None,
            }),
            cancel.clone(),
        ));

        leader::hold(&leases, &lease_config, &cancel)
            .await
            .map_err(Error::from)
    };
    let result = leading.await;
    if let Err(error) = &result {
        error!(%error, "stopping: this replica no longer leads");
    }
    cancel.cancel();
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(10), tracker.wait())
        .await
        .is_err()
    {
        warn!("tasks did not stop within 10s");
    }
    result
}

/// The NetworkTest reconciler's agent call: mutual TLS with the current certificates, the
/// reconciler's time budget as the whole-call timeout, and the configured reply limit. Only
/// agents of Nodes this controller manages (its `--node-selector`) are contacted: another
/// controller's nodes, or addresses outside the fleet, get an error naming the address instead.
fn probe_call(ctx: Arc<Context>) -> networktest::reconcile::AgentCall {
    Arc::new(move |endpoint: SocketAddr, request, budget| {
        let ctx = Arc::clone(&ctx);
        Box::pin(async move {
            let managed = ctx
                .fleet
                .lock()
                .values()
                .any(|e| e.address == Some(endpoint.ip()));
            if !managed {
                return Err(format!(
                    "{endpoint}: no node with this InternalIP is managed by this controller (check --node-selector); not contacted"
                ));
            }
            let limits = CallLimits {
                timeout: budget,
                max_reply_bytes: ctx.settings.max_reply_bytes,
            };
            let mut conn = agent_client::connect(&ctx.agent_tls(), endpoint, limits)
                .await
                .map_err(|e| e.to_string())?;
            conn.run_probes(request).await.map_err(|e| e.to_string())
        })
    })
}

/// Reissues leaves that near expiry while this replica leads.
async fn renew_certificates(ctx: Arc<Context>, secrets: Api<Secret>) {
    loop {
        tokio::select! {
            () = ctx.cancel.cancelled() => return,
            () = tokio::time::sleep(certs::RENEW_CHECK) => {}
        }
        match certs::ensure(&secrets).await {
            Ok((pem, renewed)) => {
                if renewed {
                    ctx.metrics.certificate_renewals.inc();
                }
                ctx.set_agent_tls(&pem);
            }
            Err(error) => warn!(%error, "certificate renewal check failed; retrying later"),
        }
    }
}

/// Refreshes the per-condition gauges (bounded labels: type × status).
async fn condition_gauges(ctx: Arc<Context>) {
    loop {
        tokio::select! {
            () = ctx.cancel.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(15)) => {}
        }
        let summary = ctx.fleet.summary();
        ctx.metrics
            .nodes_stale
            .set(i64::try_from(summary.stale).unwrap_or(i64::MAX));
        ctx.metrics.conditions.clear();
        for (key, count) in summary.conditions {
            let (condition, status) = key.split_once('=').unwrap_or((key.as_str(), ""));
            ctx.metrics
                .conditions
                .get_or_create(&metrics::ConditionLabels {
                    condition: condition.into(),
                    status: status.into(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_has_an_env_var_and_help() {
        use clap::CommandFactory;
        for arg in Cli::command().get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert!(
                env.as_deref().is_some_and(|e| e.starts_with("NODEKEEPER_")),
                "flag {id} has no NODEKEEPER_ env var"
            );
            assert!(arg.get_help().is_some(), "flag {id} has no help");
        }
    }
}
