//! Shared pieces of the controller end-to-end tests, on the rig of `nodekeeper_e2e::rig`:
//! controller processes (this test binary re-executed as `nodekeeper-controller`) and real
//! in-process agent servers on 127.x.y.z with the certificates the controller created — the two
//! parts that link the controller and agent crates, which the rig's library must not.
// Each test binary uses a different part of this module.
#![allow(dead_code, unused_imports)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use nodekeeper_e2e::rig::{AgentSetup, AgentTls, ControllerConfig, Output, Program};
pub use nodekeeper_e2e::rig::{ControllerProcess, ROLE_ENV, http_get, metric, sum_metric};
use nodekeeper_e2e::{ControlPlane, wait_for};
pub use nodekeeper_testkit::free_port;
use tokio_util::sync::CancellationToken;

/// Name of the ignored helper test that turns this binary into a controller.
pub const HELPER: &str = "run_as_controller";
/// The role of a re-executed controller process.
const ROLE: &str = "controller";

/// The helper's body: runs the controller with its flags taken from `NODEKEEPER_…` variables.
/// Call it from an `#[ignore]`d test named [`HELPER`].
pub fn run_as_controller_if_asked() {
    if std::env::var(ROLE_ENV).as_deref() != Ok(ROLE) {
        return;
    }
    use clap::Parser;
    let cli = nodekeeper_controller::Cli::parse_from(["nodekeeper-controller"]);
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let result = runtime.block_on(nodekeeper_controller::run(cli));
    match result {
        Ok(()) => std::process::exit(0),
        Err(error) => {
            eprintln!("nodekeeper-controller: {error}");
            std::process::exit(1);
        }
    }
}

/// Starting the rig's controller the way these tests do.
pub trait StartController: Sized {
    /// Starts this test binary as a controller against the shared control plane, with `env`
    /// added to its environment.
    fn start(
        namespace: &str,
        identity: &str,
        selector: &str,
        agent_port: u16,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self>;
}

impl StartController for ControllerProcess {
    fn start(
        namespace: &str,
        identity: &str,
        selector: &str,
        agent_port: u16,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let mut config = controller_config(
            ControlPlane::shared(),
            namespace,
            identity,
            selector,
            agent_port,
            Output::Stderr,
        );
        config.env = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ControllerProcess::spawn(&Program::this_test_binary(HELPER, ROLE)?, &config)
    }
}

/// Starts this test binary as a controller against `cp` (a control plane of the test's own),
/// logging to `log` at info.
pub fn spawn_logged(
    cp: &ControlPlane,
    namespace: &str,
    identity: &str,
    selector: &str,
    agent_port: u16,
    log: &Path,
) -> anyhow::Result<ControllerProcess> {
    let config = controller_config(
        cp,
        namespace,
        identity,
        selector,
        agent_port,
        Output::Log(log.to_owned()),
    );
    ControllerProcess::spawn(&Program::this_test_binary(HELPER, ROLE)?, &config)
}

/// A controller on `cp` managing the Nodes `selector` matches, logging at info to `output`.
fn controller_config(
    cp: &ControlPlane,
    namespace: &str,
    identity: &str,
    selector: &str,
    agent_port: u16,
    output: Output,
) -> ControllerConfig {
    ControllerConfig {
        kubeconfig: cp.kubeconfig().to_owned(),
        namespace: namespace.to_owned(),
        identity: identity.to_owned(),
        http: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port())),
        agent_port,
        node_selector: selector.to_owned(),
        log: Some("info,kube=warn".into()),
        env: Vec::new(),
        output,
    }
}

/// Waits for the controller's Secrets and returns the agent's (cert, key, ca) PEM.
pub async fn agent_tls(
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<(String, String, String)> {
    let tls = AgentTls::wait(client, namespace, Duration::from_secs(60)).await?;
    Ok((tls.cert, tls.key, tls.ca))
}

/// A real agent (the agent crate's gRPC service) serving one simulated node.
pub struct AgentHandle {
    pub node: String,
    pub addr: SocketAddr,
    pub sysctl_root: PathBuf,
    setup: AgentSetup,
    stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl AgentHandle {
    /// Writes a fake sysctl value this agent reads (e.g. `net.core.somaxconn`).
    pub fn set_sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        self.setup.write_sysctl(key, value)
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts a real agent for `node` on `addr` with the given PEMs (cert, key, client CA).
pub async fn start_agent(
    node: &str,
    addr: SocketAddr,
    tls: &(String, String, String),
) -> anyhow::Result<AgentHandle> {
    start_agent_with(node, addr, tls, &[]).await
}

/// [`start_agent`] with more agent flags (`--flag=value`), given after the defaults.
pub async fn start_agent_with(
    node: &str,
    addr: SocketAddr,
    tls: &(String, String, String),
    extra: &[String],
) -> anyhow::Result<AgentHandle> {
    let dir = tempfile::tempdir()?;
    let tls = AgentTls {
        cert: tls.0.clone(),
        key: tls.1.clone(),
        ca: tls.2.clone(),
    };
    tls.write_to(dir.path())?;
    let mut setup = AgentSetup::new(node, addr, dir.path(), dir.path());
    setup.proc_root = Some(frozen_proc(dir.path())?);
    setup.create_dirs()?;
    use clap::Parser;
    let mut args = setup.args();
    args.extend(extra.iter().map(Into::into));
    let config = nodekeeper_agent::Config::try_parse_from(args)?;
    let stop = CancellationToken::new();
    // The agent crate's own server, on a listener bound to this node's address.
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind agent on {addr}"))?;
    let shutdown = stop.clone();
    let name = node.to_owned();
    tokio::spawn(async move {
        if let Err(error) = nodekeeper_agent::serve(config, listener, shutdown).await {
            eprintln!("agent {name}: {error}");
        }
    });
    Ok(AgentHandle {
        node: node.to_owned(),
        addr,
        sysctl_root: setup.sysctl_root.clone(),
        setup,
        stop,
        _dir: dir,
    })
}

/// Distinct loopback addresses for one test: 127.<a>.<b>.<1..=n>, random a/b so concurrent
/// runs do not collide.
pub use nodekeeper_testkit::net::random_loopback_block as loopback_ips;

/// The nodekeeper condition `type_` on a Node: (status, reason).
pub fn condition(node: &Node, type_: &str) -> Option<(String, String, String)> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                c.status.clone(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
}

/// Waits until `node`'s condition `type_` has `status` (and `reason`, if given).
pub async fn wait_condition(
    client: &kube::Client,
    node: &str,
    type_: &str,
    status: &str,
    reason: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<(String, String, String)> {
    let api: Api<Node> = Api::all(client.clone());
    wait_for(
        &format!("{node} {type_}={status} {reason:?}"),
        timeout,
        || {
            let api = api.clone();
            async move {
                let n = api.get(node).await?;
                // Not there yet: the condition as it is now is the error a timeout reports.
                match condition(&n, type_) {
                    Some((s, r, m)) if s == status && reason.is_none_or(|want| want == r) => {
                        Ok(Some((s, r, m)))
                    }
                    now => Err(anyhow::anyhow!("{type_} is now {now:?}")),
                }
            }
        },
    )
    .await
}

/// Creates the tuning ConfigMap (or replaces its data).
pub async fn put_tuning(
    client: &kube::Client,
    namespace: &str,
    data: &BTreeMap<&str, &str>,
) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Patch, PatchParams};
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let body = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": { "name": "nodekeeper-tuning" },
        "data": data,
    });
    api.patch(
        "nodekeeper-tuning",
        &PatchParams::apply("nodekeeper-e2e").force(),
        &Patch::Apply(&body),
    )
    .await?;
    Ok(())
}

pub type Shared<T> = Arc<T>;

/// A copy of this machine's `/proc` files the agent reads, taken once and never updated.
///
/// These tests count writes and "unchanged" answers, so a report must change only when the test
/// changes something. The live `/proc` does not hold still while other work runs on the machine:
/// load and CPU use move by more than their significance steps, and an agent reading them reports
/// a new revision, as it should.
fn frozen_proc(dir: &Path) -> anyhow::Result<PathBuf> {
    let root = dir.join("proc");
    for file in [
        "loadavg",
        "stat",
        "meminfo",
        "pressure/cpu",
        "pressure/memory",
        "pressure/io",
        "sys/kernel/osrelease",
        "sys/kernel/random/boot_id",
        "sys/fs/file-nr",
        "sys/net/netfilter/nf_conntrack_count",
        "sys/net/netfilter/nf_conntrack_max",
    ] {
        // A file this kernel lacks stays missing: the agent reports that collector's error.
        let Ok(text) = std::fs::read_to_string(Path::new("/proc").join(file)) else {
            continue;
        };
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().expect("a file under the root"))?;
        std::fs::write(path, text)?;
    }
    Ok(root)
}

/// A Deployment `web` of `replicas` pods on the nodes labelled `selector` (`(key, value)`) in
/// `ns`, behind a PodDisruptionBudget allowing `max_unavailable`: what a drain must respect. The
/// pods never pull an image (kwok runs them).
#[allow(dead_code)]
pub async fn pods_behind_a_budget(
    client: &kube::Client,
    ns: &str,
    selector: (&str, &str),
    replicas: i32,
    max_unavailable: i32,
) -> anyhow::Result<()> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use kube::api::PostParams;
    let deploy: Deployment = serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": "web" },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": "web" } },
            "template": {
                "metadata": { "labels": { "app": "web" } },
                "spec": {
                    "nodeSelector": { selector.0: selector.1 },
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{ "name": "c", "image": "registry.invalid/nothing:1" }],
                },
            },
        },
    }))?;
    Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &deploy)
        .await?;
    let pdb: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": { "name": "web" },
        "spec": { "selector": { "matchLabels": { "app": "web" } }, "maxUnavailable": max_unavailable },
    }))?;
    Api::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pdb)
        .await?;
    Ok(())
}
