//! Shared pieces of the controller end-to-end tests: controller processes (this test binary
//! re-executed as `nodekeeper-controller`), real in-process agent servers on 127.x.y.z with the
//! certificates the controller created, and readers for the controller's HTTP API and metrics.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::Api;
use nodekeeper_e2e::{ControlPlane, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Name of the ignored helper test that turns this binary into a controller.
pub const HELPER: &str = "run_as_controller";
/// Set in the environment of a re-executed controller process.
pub const ROLE_ENV: &str = "NODEKEEPER_E2E_ROLE";

/// The helper's body: runs the controller with its flags taken from `NODEKEEPER_…` variables.
/// Call it from an `#[ignore]`d test named [`HELPER`].
pub fn run_as_controller_if_asked() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("controller") {
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

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A controller process.
pub struct ControllerProcess {
    pub child: Child,
    pub identity: String,
    pub http: SocketAddr,
}

impl ControllerProcess {
    /// Starts this test binary as a controller with `env` added to its environment.
    pub fn start(
        namespace: &str,
        identity: &str,
        selector: &str,
        agent_port: u16,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse()?;
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args([
            "--ignored",
            "--exact",
            HELPER,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, "controller")
        .env("KUBECONFIG", ControlPlane::shared().kubeconfig())
        .env("NODEKEEPER_NAMESPACE", namespace)
        .env("NODEKEEPER_IDENTITY", identity)
        .env("NODEKEEPER_HTTP_LISTEN", http.to_string())
        .env("NODEKEEPER_AGENT_PORT", agent_port.to_string())
        .env("NODEKEEPER_NODE_SELECTOR", selector)
        .env("NODEKEEPER_LOG_FORMAT", "plain")
        .env("NODEKEEPER_LOG", "info,kube=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().context("start controller process")?;
        Ok(Self {
            child,
            identity: identity.to_owned(),
            http,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no clean shutdown, no Lease release.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A plain HTTP/1.0 GET against the controller; returns (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await??;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: controller\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end")?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    Ok((status, body.to_owned()))
}

/// Sum of a metric's samples whose line contains every one of `matchers` (e.g. `result="ok"`).
pub async fn metric(addr: SocketAddr, name: &str, matchers: &[&str]) -> anyhow::Result<f64> {
    let (status, body) = http_get(addr, "/metrics").await?;
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    Ok(sum_metric(&body, name, matchers))
}

pub fn sum_metric(text: &str, name: &str, matchers: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| matchers.iter().all(|m| l.contains(m)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits for the controller's Secrets and returns the agent's (cert, key, ca) PEM.
pub async fn agent_tls(
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<(String, String, String)> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret = wait_for(
        "Secret nodekeeper-agent-tls",
        Duration::from_secs(60),
        || {
            let secrets = secrets.clone();
            async move { Ok(secrets.get_opt("nodekeeper-agent-tls").await?) }
        },
    )
    .await?;
    let data = secret.data.unwrap_or_default();
    let get = |k: &str| -> anyhow::Result<String> {
        Ok(String::from_utf8(
            data.get(k)
                .with_context(|| format!("agent Secret has no {k}"))?
                .0
                .clone(),
        )?)
    };
    Ok((get("tls.crt")?, get("tls.key")?, get("ca.crt")?))
}

/// A real agent (the agent crate's gRPC service) serving one simulated node.
pub struct AgentHandle {
    pub node: String,
    pub addr: SocketAddr,
    pub sysctl_root: PathBuf,
    stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl AgentHandle {
    /// Writes a fake sysctl value this agent reads (e.g. `net.core.somaxconn`).
    pub fn set_sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        let path = self.sysctl_root.join(key.replace('.', "/"));
        std::fs::create_dir_all(path.parent().unwrap())?;
        std::fs::write(&path, format!("{value}\n"))?;
        Ok(())
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
    let write = |name: &str, text: &str| -> anyhow::Result<PathBuf> {
        let p = dir.path().join(name);
        std::fs::write(&p, text)?;
        Ok(p)
    };
    let cert = write("tls.crt", &tls.0)?;
    let key = write("tls.key", &tls.1)?;
    let ca = write("ca.crt", &tls.2)?;
    let sysctl_root = dir.path().join("sysctl");
    let state_dir = dir.path().join("state");
    let proc_root = frozen_proc(dir.path())?;
    std::fs::create_dir_all(&sysctl_root)?;
    std::fs::create_dir_all(&state_dir)?;
    let s = |p: &Path| p.display().to_string();
    use clap::Parser;
    let defaults = [
        "nodekeeper-agent".into(),
        format!("--listen={addr}"),
        format!("--node-name={node}"),
        format!("--tls-cert={}", s(&cert)),
        format!("--tls-key={}", s(&key)),
        format!("--client-ca={}", s(&ca)),
        format!("--state-dir={}", s(&state_dir)),
        format!("--sysctl-root={}", s(&sysctl_root)),
        format!("--proc-root={}", s(&proc_root)),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
    ];
    let config = nodekeeper_agent::Config::try_parse_from(defaults.iter().chain(extra))?;
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
        sysctl_root,
        stop,
        _dir: dir,
    })
}

/// Distinct loopback addresses for one test: 127.<a>.<b>.<1..=n>, random a/b so concurrent
/// runs do not collide.
pub fn loopback_ips(n: usize) -> Vec<Ipv4Addr> {
    let a = 50 + (rand::random::<u8>() % 100);
    let b = rand::random::<u8>();
    (0..n)
        .map(|i| Ipv4Addr::new(127, a, b, u8::try_from(i + 1).unwrap()))
        .collect()
}

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
                Ok(condition(&n, type_)
                    .filter(|(s, r, _)| s == status && reason.is_none_or(|want| want == r)))
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
