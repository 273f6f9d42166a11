//! `cargo xtask bench fleet --nodes N`: the controller against a private local control plane
//! with N kwok nodes, each with a distinct 127.x.y.z InternalIP and a real agent (the agent
//! crate's service and mTLS) listening on it — all N agents in one process
//! (`tests/tests/controller_fleet_agents.rs`, built in release) behind one gRPC server with N
//! listeners, dispatched by local address. Measures the first full sweep,
//! controller RSS and CPU, the API requests by verb and resource over a steady window
//! (`apiserver_request_total`, and the audit log by user to separate the controller from kwok),
//! then makes 1 % of the nodes unhealthy and checks that exactly those Nodes get one patch each.
//! Writes its section (`## fleet`) in BENCHMARKS.md.
//!
//! The controller and the agents host are built and run in release.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Secret, ServiceAccount};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use nodekeeper_e2e::controlplane::{Lifetime, Options};
use nodekeeper_e2e::{ControlPlane, wait_for};
use serde_json::json;

/// `cargo xtask bench fleet` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct FleetArgs {
    /// Simulated nodes (and agents).
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Length of the steady-state window in which API requests are counted.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub window: Duration,
    /// Percentage of nodes made unhealthy after the window.
    #[arg(long, default_value_t = 1.0)]
    pub unhealthy_percent: f64,
    /// Agent port on every node address.
    #[arg(long, default_value_t = 9443)]
    pub port: u16,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
    /// Build the agents host in the dev profile instead of release (a shorter build on a busy
    /// machine; the agents then answer more slowly, which can only lengthen the sweep).
    #[arg(long)]
    pub agents_debug: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    nodekeeper_api::tuning::parse_duration(s)
}

const NAMESPACE: &str = "nodekeeper";
const GROUP_LABEL: &str = "nodekeeper.dev/bench";
const CONTROLLER_USER: &str = "system:serviceaccount:nodekeeper:nodekeeper-controller";

/// The i-th node address: 127.100.0.1, 127.100.0.2, … (host part 1–254, never .0 or .255).
pub fn node_ip(i: usize) -> Ipv4Addr {
    let per_b = 254;
    let per_a = per_b * 256;
    let a = 100 + i / per_a;
    let b = (i / per_b) % 256;
    let c = i % per_b + 1;
    Ipv4Addr::new(
        127,
        u8::try_from(a).unwrap_or(255),
        u8::try_from(b).unwrap_or(0),
        u8::try_from(c).unwrap_or(1),
    )
}

pub fn run(args: FleetArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    // The controller and the agents host run as release builds; this driver only creates
    // objects and reads figures, so its own build profile does not affect them.
    let status = Command::new("cargo")
        .current_dir(&root)
        .args(["build", "--release", "-p", "nodekeeper-controller"])
        .status()?;
    if !status.success() {
        bail!("building nodekeeper-controller failed");
    }
    let host = build_agents_host(&root, !args.agents_debug)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench(args, root, host))
}

/// The agents host: `tests/tests/controller_fleet_agents.rs` built in release, serving every
/// node's agent from one process (see that file). Its work directory holds each node's fake
/// sysctl tree, which the bench edits to make a node unhealthy.
struct Agents {
    child: Child,
    work: tempfile::TempDir,
}

impl Agents {
    fn sysctl(&self, i: usize) -> PathBuf {
        self.work
            .path()
            .join(format!("n{i}"))
            .join("sysctl")
            .join("net/core/somaxconn")
    }
}

impl Drop for Agents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Builds the agents host (release unless `--agents-debug`) and returns its path.
fn build_agents_host(root: &Path, release: bool) -> anyhow::Result<PathBuf> {
    let mut args = vec![
        "test",
        "-p",
        "nodekeeper-e2e",
        "--test",
        "controller_fleet_agents",
        "--no-run",
        "--message-format=json",
    ];
    if release {
        args.push("--release");
    }
    let output = Command::new("cargo")
        .current_dir(root)
        .args(&args)
        .stderr(Stdio::inherit())
        .output()?;
    if !output.status.success() {
        bail!("building the agents host failed");
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| {
            m["reason"] == "compiler-artifact" && m["target"]["name"] == "controller_fleet_agents"
        })
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo named no executable for controller_fleet_agents")
}

fn start_agents(
    host: &Path,
    names: &[String],
    port: u16,
    tls: &BTreeMap<String, String>,
) -> anyhow::Result<Agents> {
    let work = tempfile::tempdir()?;
    for (k, v) in tls {
        std::fs::write(work.path().join(k), v)?;
    }
    let nodes: Vec<serde_json::Value> = names
        .iter()
        .enumerate()
        .map(|(i, name)| json!({"name": name, "ip": node_ip(i).to_string()}))
        .collect();
    let spec = work.path().join("spec.json");
    std::fs::write(
        &spec,
        serde_json::to_vec(&json!({"port": port, "dir": work.path(), "nodes": nodes}))?,
    )?;
    let mut child = Command::new(host)
        .args([
            "--ignored",
            "--exact",
            "fleet_agents_host",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("NODEKEEPER_E2E_ROLE", "fleet-agents")
        .env("NODEKEEPER_FLEET_SPEC", &spec)
        .stdout(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(600);
    while Instant::now() < deadline {
        if work.path().join("ready").exists() {
            return Ok(Agents { child, work });
        }
        if let Some(status) = child.try_wait()? {
            bail!("the agents host exited before it was ready ({status})");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = child.kill();
    bail!("the agents host was not ready within 10 minutes")
}

/// RSS (KiB), peak RSS (KiB) and CPU seconds (user + system) of a process.
fn proc_usage(pid: u32) -> anyhow::Result<(u64, u64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // Fields after the command: state is [0], utime [11], stime [12] (man 5 proc: 14 and 15).
    let ticks: f64 = fields
        .get(11)
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
    Ok((kib("VmRSS:"), kib("VmHWM:"), ticks / 100.0))
}

/// `apiserver_request_total` summed by (verb, resource, subresource).
async fn request_totals(
    client: &kube::Client,
) -> anyhow::Result<BTreeMap<(String, String, String), f64>> {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    let mut totals = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(&format!("{name}=\"")[..])
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or_default()
                .to_owned()
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        *totals
            .entry((label("verb"), label("resource"), label("subresource")))
            .or_default() += value;
    }
    Ok(totals)
}

/// Audit events by (user, verb, resource[/subresource]) from `from_line` on; returns the counts
/// and the number of lines read.
fn audit_counts(
    path: &Path,
    from_line: usize,
) -> anyhow::Result<(BTreeMap<(String, String, String), u64>, usize, Vec<String>)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut counts = BTreeMap::new();
    let mut patched_nodes = Vec::new();
    let mut n = 0;
    for line in text.lines() {
        n += 1;
        if n <= from_line {
            continue;
        }
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if event["stage"] != "ResponseComplete" {
            continue;
        }
        let user = event["user"]["username"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let verb = event["verb"].as_str().unwrap_or_default().to_owned();
        let obj = &event["objectRef"];
        let mut resource = obj["resource"].as_str().unwrap_or_default().to_owned();
        if let Some(sub) = obj["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        if user == CONTROLLER_USER && verb == "patch" && resource == "nodes/status" {
            patched_nodes.push(obj["name"].as_str().unwrap_or_default().to_owned());
        }
        *counts.entry((user, verb, resource)).or_default() += 1;
    }
    Ok((counts, n, patched_nodes))
}

/// Applies the controller's RBAC from deploy/controller and returns a kubeconfig for its
/// ServiceAccount, so its requests are counted apart from kwok's and the bench's.
async fn controller_kubeconfig(
    client: &kube::Client,
    root: &Path,
    admin: &Path,
    out: &Path,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(root.join("deploy/controller/controller.yaml"))?;
    use serde::Deserialize as _;
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_json::Value::deserialize(doc)?;
        let kind = value["kind"].as_str().unwrap_or_default();
        if ![
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ]
        .contains(&kind)
        {
            continue;
        }
        let obj: kube::api::DynamicObject = serde_json::from_value(value.clone())?;
        let gvk = kube::api::GroupVersionKind::try_from(obj.types.as_ref().context("no types")?)?;
        let (ar, _) = kube::discovery::pinned_kind(client, &gvk).await?;
        let api: Api<kube::api::DynamicObject> = match obj.metadata.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        let name = obj.metadata.name.clone().context("no name")?;
        api.patch(
            &name,
            &PatchParams::apply("nodekeeper-bench").force(),
            &Patch::Apply(&value),
        )
        .await?;
    }
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let token = sas
        .create_token_request(
            "nodekeeper-controller",
            &PostParams::default(),
            &serde_json::from_value(
                json!({"spec": {"expirationSeconds": 86400, "audiences": []}}),
            )?,
        )
        .await?
        .status
        .context("token request without status")?
        .token;
    let kubeconfig = kube::config::Kubeconfig::read_from(admin)?;
    let cluster = kubeconfig
        .clusters
        .first()
        .and_then(|c| c.cluster.clone())
        .context("admin kubeconfig has no cluster")?;
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": cluster.server,
            "certificate-authority-data": cluster.certificate_authority_data,
            "certificate-authority": cluster.certificate_authority,
        }}],
        "users": [{"name": "controller", "user": {"token": token}}],
        "contexts": [{"name": "controller", "context": {"cluster": "local", "user": "controller"}}],
        "current-context": "controller",
    });
    std::fs::write(out, serde_yaml::to_string(&config)?)?;
    Ok(())
}

async fn metric(addr: SocketAddr, name: &str, matcher: &str) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body
        .lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(matcher))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

async fn bench(args: FleetArgs, root: PathBuf, host: PathBuf) -> anyhow::Result<()> {
    let n = args.nodes;
    let say = |text: String| eprintln!("[bench fleet] {text}");
    let mut options = Options::new(
        format!("bench-fleet-{}", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    options.max_requests_inflight = Some(2000);
    options.max_mutating_requests_inflight = Some(1000);
    say("starting a private control plane (audit on)".into());
    let cp = ControlPlane::start(options)?;
    let client = cp.client().await?;
    let audit = cp.audit_log().context("audit log")?;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?,
        )
        .await?;
    wait_for("default ServiceAccount", Duration::from_secs(60), || {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
        async move { Ok(sas.get_opt("default").await?.map(|_| ())) }
    })
    .await?;
    let kubeconfig = std::env::temp_dir().join(format!(
        "nodekeeper-bench-controller-{}.yaml",
        std::process::id()
    ));
    controller_kubeconfig(&client, &root, cp.kubeconfig(), &kubeconfig).await?;

    let rules = "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n";
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    cms.patch(
        "nodekeeper-tuning",
        &PatchParams::apply("nodekeeper-bench").force(),
        &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nodekeeper-tuning"},
            "data": {"sweepInterval": "5m", "staleAfter": "15m", "concurrency": "256", "callTimeout": "10s", "rules.yaml": rules}})),
    )
    .await?;

    // Nodes, created 32 at a time.
    let created = Instant::now();
    let names: Vec<String> = (0..n).map(|i| format!("bench-{i:05}")).collect();
    let labels: BTreeMap<String, String> = [(GROUP_LABEL.to_owned(), "fleet".to_owned())].into();
    let nodes: Api<Node> = Api::all(client.clone());
    futures::stream::iter(names.iter().enumerate().map(|(i, name)| {
        let nodes = nodes.clone();
        let body = nodekeeper_e2e::controlplane::nodes::simulated_node(name, node_ip(i), &labels);
        async move {
            let node: Node = serde_json::from_value(body)?;
            nodes.create(&PostParams::default(), &node).await?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await?;
    wait_for("every node Ready (kwok)", Duration::from_secs(600), || {
        let nodes = nodes.clone();
        async move {
            let list = nodes
                .list(&ListParams::default().labels(&format!("{GROUP_LABEL}=fleet")))
                .await?;
            let ready = list
                .items
                .iter()
                .filter(|n| nodekeeper_e2e::controlplane::nodes::is_ready(n))
                .count();
            Ok((ready == n).then_some(()))
        }
    })
    .await?;
    say(format!(
        "{n} nodes created and Ready in {:.0?}",
        created.elapsed()
    ));

    let binary = root.join("target/release/nodekeeper-controller");
    let http: SocketAddr = "127.0.0.1:18080".parse()?;
    let start_controller = || -> anyhow::Result<ControllerChild> {
        Ok(ControllerChild(
            Command::new(&binary)
                .env("KUBECONFIG", &kubeconfig)
                .env("NODEKEEPER_NAMESPACE", NAMESPACE)
                .env("NODEKEEPER_IDENTITY", "bench-controller")
                .env("NODEKEEPER_HTTP_LISTEN", http.to_string())
                .env("NODEKEEPER_AGENT_PORT", args.port.to_string())
                .env("NODEKEEPER_NODE_SELECTOR", format!("{GROUP_LABEL}=fleet"))
                .env("NODEKEEPER_LOG_FORMAT", "plain")
                .env("NODEKEEPER_LOG", "warn")
                .stdout(Stdio::null())
                .spawn()
                .context("start the controller")?,
        ))
    };
    // A first controller creates the PKI the agents need.
    let mut controller = start_controller()?;

    // The agents use the certificate the controller created.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NAMESPACE);
    let secret = wait_for(
        "Secret nodekeeper-agent-tls",
        Duration::from_secs(60),
        || {
            let secrets = secrets.clone();
            async move { Ok(secrets.get_opt("nodekeeper-agent-tls").await?) }
        },
    )
    .await?;
    let tls: BTreeMap<String, String> = secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
        .collect();
    let agents = start_agents(&host, &names, args.port, &tls)?;
    // Restart the controller (SIGTERM releases the Lease) so that its first sweep is measured
    // with every agent already listening, as after a controller restart in a running cluster.
    controller.stop();
    let mut controller = start_controller()?;
    let pid = controller.0.id();
    let agents_ready = Instant::now();
    say(format!(
        "{n} agents listening; controller restarted; waiting for the first full sweep"
    ));

    let sweep_secs = wait_for(
        "the first full sweep",
        Duration::from_secs(900),
        || async move {
            let s = metric(http, "nodekeeper_sweep_initial_sweep_seconds", "").await?;
            Ok((s > 0.0).then_some(s))
        },
    )
    .await?;
    let since_agents = agents_ready.elapsed();
    say(format!(
        "first full sweep: {sweep_secs:.1} s after the controller led ({since_agents:.0?} after the agents listened)"
    ));
    // Let the initial writes land before the window opens.
    tokio::time::sleep(Duration::from_secs(20)).await;

    let (_, _, cpu0) = proc_usage(pid)?;
    let totals0 = request_totals(&client).await?;
    let (_, audit_from, _) = audit_counts(&audit, 0)?;
    let patches0 = metric(http, "nodekeeper_conditions_patches_total", "").await?;
    let calls0 = metric(http, "nodekeeper_sweep_agent_calls_total", "").await?;
    say(format!("steady window of {:?}", args.window));
    let window_start = Instant::now();
    let mut rss_max = 0;
    while window_start.elapsed() < args.window {
        tokio::time::sleep(Duration::from_secs(10)).await;
        rss_max = rss_max.max(proc_usage(pid)?.0);
    }
    let window = window_start.elapsed().as_secs_f64();
    let (rss, hwm, cpu1) = proc_usage(pid)?;
    let totals1 = request_totals(&client).await?;
    let (audit_window, audit_to, _) = audit_counts(&audit, audit_from)?;
    let patches1 = metric(http, "nodekeeper_conditions_patches_total", "").await?;
    let calls1 = metric(http, "nodekeeper_sweep_agent_calls_total", "").await?;
    let cpu_share = (cpu1 - cpu0) / window;

    // Flip 1 % unhealthy and wait for exactly those patches.
    let k = ((n as f64) * args.unhealthy_percent / 100.0)
        .round()
        .max(1.0) as usize;
    let step = n / k;
    let flipped: Vec<usize> = (0..k).map(|j| j * step).collect();
    for &i in &flipped {
        std::fs::write(agents.sysctl(i), "128\n")?;
    }
    let flip_start = Instant::now();
    let expected: std::collections::BTreeSet<String> =
        flipped.iter().map(|&i| names[i].clone()).collect();
    let after = wait_for(
        "the flipped nodes' patches",
        Duration::from_secs(420),
        || {
            let audit = audit.clone();
            let expected = expected.clone();
            async move {
                let (_, _, patched) = audit_counts(&audit, audit_to)?;
                let set: std::collections::BTreeSet<String> = patched.iter().cloned().collect();
                Ok(expected.is_subset(&set).then_some(patched))
            }
        },
    )
    .await?;
    let flip_secs = flip_start.elapsed().as_secs_f64();
    // A little longer, so a second patch would show.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (_, _, patched) = audit_counts(&audit, audit_to)?;
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for name in &patched {
        *per_node.entry(name.clone()).or_default() += 1;
    }
    let exact = per_node
        .keys()
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        == expected
        && per_node.values().all(|&c| c == 1);
    let _ = after;
    drop(agents);
    controller.stop();

    // Report.
    let mut report = String::new();
    let host_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    report.push_str(&format!("### N = {n}\n\n"));
    report.push_str(&format!(
        "Command: `cargo xtask bench fleet --nodes {n} --window {}{}`; controller built in release, agents host in {}; machine: {host_cpus} cores shared with the control plane, kwok and all {n} agents (and, during this run, other builds).\n\n",
        nodekeeper_api::tuning::format_duration(args.window),
        if args.agents_debug { " --agents-debug" } else { "" },
        if args.agents_debug { "the dev profile" } else { "release" },
    ));
    report.push_str("| figure | value |\n|---|---|\n");
    report.push_str(&format!(
        "| first full sweep (controller leading → every node read once) | {sweep_secs:.1} s |\n"
    ));
    report.push_str(&format!("| controller RSS at the end of the window / max sampled / peak (VmHWM) | {:.1} / {:.1} / {:.1} MiB |\n", rss as f64 / 1024.0, rss_max as f64 / 1024.0, hwm as f64 / 1024.0));
    report.push_str(&format!(
        "| controller CPU in the window | {:.3} cores ({:.1} s in {window:.0} s) |\n",
        cpu_share,
        cpu1 - cpu0
    ));
    report.push_str(&format!(
        "| agent calls in the window | {:.0} ({:.2}/s) |\n",
        calls1 - calls0,
        (calls1 - calls0) / window
    ));
    report.push_str(&format!(
        "| condition patches in the window (controller metric) | {:.0} ({:.3}/s) |\n",
        patches1 - patches0,
        (patches1 - patches0) / window
    ));
    let controller_total: u64 = audit_window
        .iter()
        .filter(|((u, _, _), _)| u == CONTROLLER_USER)
        .map(|(_, c)| c)
        .sum();
    let controller_writes: u64 = audit_window
        .iter()
        .filter(|((u, v, _), _)| {
            u == CONTROLLER_USER && ["create", "update", "patch", "delete"].contains(&v.as_str())
        })
        .map(|(_, c)| c)
        .sum();
    report.push_str(&format!("| controller API requests in the window (audit) | {controller_total} ({:.3}/s), writes {controller_writes} ({:.3}/s) |\n", controller_total as f64 / window, controller_writes as f64 / window));
    let agent_requests: u64 = audit_window
        .iter()
        .filter(|((u, _, _), _)| u.contains("agent"))
        .map(|(_, c)| c)
        .sum();
    report.push_str(&format!(
        "| API requests from agents | {agent_requests} (agents have no Kubernetes client) |\n"
    ));
    report.push_str(&format!("| 1 % flipped unhealthy: nodes | {k}; all patched {flip_secs:.0} s after the flip; exactly those nodes, one patch each: **{}** ({} patches on {} nodes) |\n\n", if exact { "yes" } else { "NO" }, patched.len(), per_node.len()));
    report.push_str("Controller requests in the window by verb and resource (audit log, user `");
    report.push_str(CONTROLLER_USER);
    report.push_str("`):\n\n| verb | resource | requests |\n|---|---|---|\n");
    for ((user, verb, resource), count) in &audit_window {
        if user == CONTROLLER_USER {
            report.push_str(&format!("| {verb} | {resource} | {count} |\n"));
        }
    }
    report.push_str("\nAll clients in the window by verb and resource (`apiserver_request_total` deltas; kwok's heartbeats dominate):\n\n| verb | resource | requests | per second |\n|---|---|---|---|\n");
    for (key, v1) in &totals1 {
        let delta = v1 - totals0.get(key).copied().unwrap_or(0.0);
        if delta >= 1.0 {
            let resource = if key.2.is_empty() {
                key.1.clone()
            } else {
                format!("{}/{}", key.1, key.2)
            };
            report.push_str(&format!(
                "| {} | {resource} | {delta:.0} | {:.2} |\n",
                key.0,
                delta / window
            ));
        }
    }
    report.push('\n');
    println!("{report}");
    if !args.no_write {
        write_section(&root, n, &report)?;
    }
    if !exact {
        bail!("the flipped nodes did not get exactly one patch each: {per_node:?}");
    }
    Ok(())
}

struct ControllerChild(Child);

impl ControllerChild {
    fn stop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ControllerChild {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Replaces `### N = n` inside `## fleet` in BENCHMARKS.md (creating either as needed).
fn write_section(root: &Path, n: usize, report: &str) -> anyhow::Result<()> {
    let path = root.join("BENCHMARKS.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_owned());
    let header = "## fleet\n";
    let intro = "## fleet\n\nThe controller against a local control plane with N kwok nodes and N real agents (mTLS, many per process, each on its own 127.x.y.z). Targets at 10,000 nodes: full sweep ≤ 30 s, controller RSS ≤ 200 MiB, steady-state writes ≤ 0.3/s, 0 requests from agents. Anchor: node-problem-detector's 5-minute heartbeat alone is ~33 Node patches/s at 10,000 nodes (10,000 / 300 s).\n\n";
    let (before, section, after) = match text.find(header) {
        Some(start) => {
            let rest = &text[start + header.len()..];
            let end = rest
                .find("\n## ")
                .map_or(text.len(), |e| start + header.len() + e + 1);
            (
                text[..start].to_owned(),
                text[start..end].to_owned(),
                text[end..].to_owned(),
            )
        }
        None => (
            format!("{}\n\n", text.trim_end()),
            intro.to_owned(),
            String::new(),
        ),
    };
    let sub = format!("### N = {n}\n");
    let section = match section.find(&sub) {
        Some(s) => {
            let rest = &section[s + sub.len()..];
            let e = rest
                .find("\n### ")
                .map_or(section.len(), |e| s + sub.len() + e + 1);
            format!("{}{}{}", &section[..s], report, &section[e..])
        }
        None => format!("{}\n{}", section.trim_end(), format!("\n\n{report}")),
    };
    std::fs::write(
        &path,
        format!("{before}{}{after}", section.trim_end().to_owned() + "\n"),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ips_are_distinct_loopback_host_addresses() {
        let ips: std::collections::HashSet<Ipv4Addr> = (0..70_000).map(node_ip).collect();
        assert_eq!(ips.len(), 70_000);
        assert!(
            ips.iter()
                .all(|ip| ip.octets()[0] == 127 && ip.octets()[3] != 0 && ip.octets()[3] != 255)
        );
    }
}
