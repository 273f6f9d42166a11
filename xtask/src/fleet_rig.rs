//! The simulated fleet the controller benchmarks run on (`cargo xtask bench fleet` and
//! `cargo xtask bench networktest`), built from the rig of `nodekeeper_e2e::rig`: a private local
//! control plane (audit log on) with N kwok nodes, each with a distinct 127.x.y.z InternalIP and
//! a real agent (the agent crate's service and mTLS) listening on it — up to 15,000 agents in
//! one process (the rig's `AgentsHost`: `tests/tests/controller_fleet_agents.rs`, built in
//! release; a larger fleet runs as several) behind one gRPC server with a listener per agent,
//! dispatched by local address — and the release
//! controller under its own ServiceAccount token, so the audit log tells its requests from
//! kwok's and the bench's.
//!
//! Every address is on 127.0.0.0/8; every process is started here and stopped by PID.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use nodekeeper_e2e::controlplane::{Lifetime, Options, nodes};
use nodekeeper_e2e::rig::{
    AGENTS_PER_HOST, AgentTls, AgentsHost, ControllerConfig, ControllerProcess, FleetNode, Output,
    Program, metric,
};
use nodekeeper_e2e::{ControlPlane, wait_for};
use serde_json::json;

use crate::cargo::build_executables;

pub const NAMESPACE: &str = "nodekeeper";
pub const GROUP_LABEL: &str = "nodekeeper.dev/bench";
pub const CONTROLLER_USER: &str = "system:serviceaccount:nodekeeper:nodekeeper-controller";

/// Indicator thresholds for the rig's rules (`rules.yaml`, after its tunables) that no real
/// disk reaches. Every simulated agent reads the one real host's filesystems, whose usage moves
/// with whatever else runs on the machine: crossing the default threshold flips the disk
/// condition of every simulated node at once (seen: 1,000 patches during the 1 % flip of
/// `bench fleet`, each a correct report of the shared disk, none the flip's). The benchmarks
/// measure the write path, so the only changes they see must be the ones they make.
pub const HOST_NEUTRAL_THRESHOLDS: &str =
    "thresholds:\n  - indicator: disk.*\n    warning: 101\n    critical: 102\n";

/// What a rig is made of.
#[derive(Clone, Debug)]
pub struct RigConfig {
    /// Names the private cluster (`bench-<what>-<pid>`).
    pub what: &'static str,
    pub nodes: usize,
    pub port: u16,
    /// The tuning ConfigMap's data.
    pub tuning: serde_json::Value,
    /// Run the measured controller under heaptrack's preload library, writing its raw trace
    /// here (see `bench fleet --heap-profile`).
    pub heap_profile: Option<PathBuf>,
}

/// Where Debian's `heaptrack` package puts the library that records every allocation.
const HEAPTRACK_PRELOAD: &str = "/usr/lib/heaptrack/libheaptrack_preload.so";

/// Runs a benchmark on `runtime` until it ends, or until this process gets SIGINT (Ctrl-C, or
/// `timeout -s INT`) or SIGTERM. On a signal the benchmark's future is dropped, and with it
/// its rig: the processes it started are killed and its work directories removed. Killed by
/// the signal instead, it left the agents' directory behind, 1.8 GiB at 65,000 nodes, until a
/// later run found the disk full.
pub fn until_interrupted<T>(
    runtime: &tokio::runtime::Runtime,
    work: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    use tokio::signal::unix::{SignalKind, signal};
    runtime.block_on(async {
        // Both handlers are in place before the work starts.
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        tokio::select! {
            result = work => result,
            _ = interrupt.recv() => bail!("interrupted (SIGINT); the rig is stopped and its files removed"),
            _ = terminate.recv() => bail!("terminated (SIGTERM); the rig is stopped and its files removed"),
        }
    })
}

/// The built programs: the release controller and the agents host.
pub struct Programs {
    pub controller: PathBuf,
    pub agents_host: PathBuf,
}

/// Builds the controller in release and the agents host (release unless `agents_debug`), and
/// finds both where cargo put them (which honours `CARGO_TARGET_DIR`). `system_allocator`
/// builds the controller with its `system-allocator` feature (the C library's `malloc` instead
/// of mimalloc), which a heap profiler that hooks `malloc` needs.
pub fn build(root: &Path, agents_debug: bool, system_allocator: bool) -> anyhow::Result<Programs> {
    let controller = build_controller(root, system_allocator)?;
    let mut args = vec![
        "test",
        "-p",
        "nodekeeper-e2e",
        "--test",
        "controller_fleet_agents",
        "--no-run",
    ];
    if !agents_debug {
        args.push("--release");
    }
    let [agents_host] = build_executables(root, &args, ["controller_fleet_agents"])?;
    Ok(Programs {
        controller,
        agents_host,
    })
}

/// Builds the release controller (with its `system-allocator` feature if asked) and returns
/// where cargo put it.
pub fn build_controller(root: &Path, system_allocator: bool) -> anyhow::Result<PathBuf> {
    let mut args = vec![
        "build",
        "--release",
        "-p",
        "nodekeeper-controller",
        "--bin",
        "nodekeeper-controller",
    ];
    if system_allocator {
        args.extend(["--features", "system-allocator"]);
    }
    let [controller] = build_executables(root, &args, ["nodekeeper-controller"])?;
    Ok(controller)
}

/// kube-controller-manager's client rate (requests a second, per controller) in the rig: its
/// node lifecycle controller makes two GETs and two PATCHes of each new Node for its taints
/// (20,006 of each for 10,000 Nodes, 2026-11-28), so at the default 20 a second the 65,000
/// Nodes of the largest run need over three hours of it (it was still at it an hour in: 5,772
/// GETs and 5,768 PATCHes in ten minutes). At 100, 10,000 Nodes were untainted 410 s after
/// their creation, kube-apiserver at a third of a core meanwhile; 65,000 should take about 45
/// minutes.
const CONTROLLER_MANAGER_QPS: u32 = 100;

/// The simulated kubelets' node Lease duration for N nodes: a kubelet's 40 s up to 400 nodes,
/// then long enough that kwok renews at most about 40 Leases a second (it renews every quarter
/// of the duration). Real kubelets renew every 10 s; at 10,000 nodes that is 1,000 writes a
/// second, which a 2-core machine also running etcd, the apiserver, kwok, every agent and the
/// controller cannot carry without distorting what is measured. The controller never reads
/// Leases of nodes, so this changes only the background load.
pub fn node_lease_seconds(nodes: usize) -> u32 {
    u32::try_from(nodes / 10).unwrap_or(u32::MAX).max(40)
}

/// Raises this process's open-file limit (inherited by everything the rig starts) to what N
/// nodes need: an agents host listens on one socket per node it serves (at most
/// [`AGENTS_PER_HOST`], so a larger fleet runs as several hosts), and the calls in flight (at
/// most 1024 at the NetworkTest default) hold more. Raising the hard limit needs
/// CAP_SYS_RESOURCE; without it the error says how.
fn raise_open_files(nodes: usize) -> anyhow::Result<()> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let want = u64::try_from(nodes.min(AGENTS_PER_HOST))
        .unwrap_or(u64::MAX)
        .saturating_add(2_048);
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft >= want {
        return Ok(());
    }
    setrlimit(Resource::RLIMIT_NOFILE, want, hard.max(want)).with_context(|| {
        format!(
            "{nodes} nodes need {want} open files and this process may open {soft} (hard limit {hard}); raising the hard limit needs CAP_SYS_RESOURCE: run the bench where a shell may `ulimit -Hn {want}`, or with fewer nodes"
        )
    })
}

/// A running rig. Dropping it stops the agents, the controller and the control plane.
pub struct Rig {
    pub client: kube::Client,
    pub audit: PathBuf,
    pub names: Vec<String>,
    pub agents: AgentsHost,
    pub controller: ControllerProcess,
    launch: (Program, ControllerConfig),
    /// The controller's HTTP API and metrics.
    pub http: SocketAddr,
    pub node_lease_seconds: u32,
    // Last: the control plane outlives everything that talks to it.
    pub cp: ControlPlane,
}

impl Rig {
    /// Starts the control plane, creates the nodes and waits until kwok has made them Ready,
    /// starts the controller (which creates the PKI), and starts the agents with its
    /// certificate, and then the controller that is measured. Its first sweep is under way
    /// when this returns.
    pub async fn start(
        config: &RigConfig,
        root: &Path,
        programs: &Programs,
        say: &dyn Fn(String),
    ) -> anyhow::Result<Rig> {
        let n = config.nodes;
        raise_open_files(n)?;
        let node_lease = node_lease_seconds(n);
        let mut options = Options::new(
            format!("bench-{}-{}", config.what, std::process::id()),
            Lifetime::WithThisProcess,
        );
        options.audit = true;
        options.max_requests_inflight = Some(2000);
        options.max_mutating_requests_inflight = Some(1000);
        options.node_lease_seconds = Some(node_lease);
        options.controller_manager_qps = Some(CONTROLLER_MANAGER_QPS);
        say(format!(
            "starting a private control plane (audit on, node Leases of {node_lease} s)"
        ));
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
        let kubeconfig = cp.kubeconfig().with_file_name("controller-kubeconfig.yaml");
        nodekeeper_e2e::install_crds(&client).await?;
        controller_kubeconfig(&client, root, cp.kubeconfig(), &kubeconfig).await?;

        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
        cms.patch(
            "nodekeeper-tuning",
            &PatchParams::apply("nodekeeper-bench").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "nodekeeper-tuning"}, "data": config.tuning})),
        )
        .await?;

        say(format!("creating {n} nodes"));
        let created = Instant::now();
        let names: Vec<String> = (0..n).map(|i| format!("bench-{i:05}")).collect();
        let ips: Vec<Ipv4Addr> = (0..n).map(node_ip).collect();
        let labels: BTreeMap<String, String> =
            [(GROUP_LABEL.to_owned(), "fleet".to_owned())].into();
        nodes::create(&client, &names, &ips, &labels).await?;
        // Ready is kwok's doing, at its own pace (at 65,000 on this 2-core machine 679-1,623
        // s); kube-controller-manager then lifts each Node's not-ready taint (see
        // `CONTROLLER_MANAGER_QPS`). Both are awaited, so that what is measured starts on a
        // settled cluster. The bound grows with the fleet at 15 Nodes a second (4,333 s at
        // 65,000).
        let ready_within = Duration::from_secs(1200.max(n as u64 / 15));
        nodes::wait_schedulable(&client, &names, ready_within).await?;
        say(format!(
            "{n} nodes created, Ready and untainted in {:.0?}",
            created.elapsed()
        ));

        let http: SocketAddr = "127.0.0.1:18080".parse()?;
        let launch = (
            Program::Binary(programs.controller.clone()),
            ControllerConfig {
                kubeconfig,
                namespace: NAMESPACE.into(),
                identity: "bench-controller".into(),
                http,
                agent_port: config.port,
                node_selector: format!("{GROUP_LABEL}=fleet"),
                // `NODEKEEPER_BENCH_CONTROLLER_LOG` (a NODEKEEPER_LOG filter) shows more, e.g.
                // `warn,nodekeeper_controller::controllers::nodes=info` for every condition patch.
                log: Some(
                    std::env::var("NODEKEEPER_BENCH_CONTROLLER_LOG")
                        .unwrap_or_else(|_| "warn".into()),
                ),
                env: Vec::new(),
                output: Output::Stderr,
            },
        );
        // A first controller creates the PKI the agents need; it is stopped once it has, so
        // that the measured controller starts with every agent listening. It selects no node:
        // running while the agents come up, it read the first of them and wrote their
        // conditions before the measured controller's "fresh" sweep (22 of 65,000 in one run).
        let pki_only = ControllerConfig {
            node_selector: format!("{GROUP_LABEL}=none"),
            ..launch.1.clone()
        };
        let mut pki_maker = ControllerProcess::spawn(&launch.0, &pki_only)?;
        let tls = AgentTls::wait(&client, NAMESPACE, Duration::from_secs(60)).await?;
        say(format!("starting {n} agents"));
        let fleet: Vec<FleetNode> = names
            .iter()
            .zip(&ips)
            .map(|(name, ip)| FleetNode {
                name: name.clone(),
                ip: *ip,
            })
            .collect();
        let agents = AgentsHost::start(
            &programs.agents_host,
            fleet,
            config.port,
            &tls,
            AGENTS_PER_HOST,
            // Each host makes its agents' files and binds their sockets one after another.
            Duration::from_secs(600).max(Duration::from_millis(u64::try_from(n)? * 20)),
        )?;
        pki_maker.stop();
        let mut launch = launch;
        if let Some(trace) = &config.heap_profile {
            if !Path::new(HEAPTRACK_PRELOAD).exists() {
                bail!("--heap-profile needs {HEAPTRACK_PRELOAD}; fix: apt-get install heaptrack");
            }
            launch
                .1
                .env
                .push(("LD_PRELOAD".into(), HEAPTRACK_PRELOAD.into()));
            launch
                .1
                .env
                .push(("DUMP_HEAPTRACK_OUTPUT".into(), trace.display().to_string()));
        }
        let controller = ControllerProcess::spawn(&launch.0, &launch.1)?;
        say(format!("{n} agents listening; controller started"));
        Ok(Rig {
            client,
            audit,
            names,
            agents,
            controller,
            launch,
            http,
            node_lease_seconds: node_lease,
            cp,
        })
    }

    /// Stops the controller with SIGTERM (it releases the Lease) and starts a new one, which
    /// leads at once: a controller restart in a running cluster.
    ///
    /// It starts as `binary` (`None`: the controller built) with `env` added to its
    /// environment, so that two controllers, or two settings, are compared in the same rig
    /// (`bench fleet --compare-controller`, `--compare-env`).
    pub fn restart_controller(
        &mut self,
        binary: Option<&Path>,
        env: &[(String, String)],
    ) -> anyhow::Result<()> {
        self.controller.stop();
        let program = binary.map_or_else(
            || self.launch.0.clone(),
            |binary| Program::Binary(binary.to_path_buf()),
        );
        let mut config = self.launch.1.clone();
        config.env.extend(env.iter().cloned());
        self.controller = ControllerProcess::spawn(&program, &config)?;
        Ok(())
    }

    /// Waits for the controller's first full sweep and returns its duration in seconds.
    ///
    /// Fails as soon as the controller has exited (one that lost its Lease stops, and never
    /// finishes the sweep), rather than at `within`, which is 27 minutes at 65,000 nodes.
    pub async fn first_sweep(&mut self, within: Duration) -> anyhow::Result<f64> {
        let http = self.http;
        let sweep = wait_for("the first full sweep", within, || async move {
            let s = metric(http, "nodekeeper_sweep_initial_sweep_seconds", &[]).await?;
            Ok((s > 0.0).then_some(s))
        });
        tokio::pin!(sweep);
        let mut liveness = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                secs = &mut sweep => return secs,
                _ = liveness.tick() => self
                    .controller
                    .process
                    .check_alive()
                    .context("the controller stopped before its first full sweep (its log is above)")?,
            }
        }
    }
}

/// The i-th node address: 127.100.0.1, 127.100.0.2, … (host part 1–254, never .0 or .255).
pub fn node_ip(i: usize) -> Ipv4Addr {
    nodekeeper_testkit::net::indexed_loopback(100, i)
}

/// RSS (KiB), peak RSS (KiB) and CPU seconds (user + system) of a process.
pub fn proc_usage(pid: u32) -> anyhow::Result<(u64, u64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| kib_field(&status, key).unwrap_or(0);
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

/// The resident set of a process split in two (KiB): anonymous memory (the heap, stacks, and
/// the pages of the binary written to at load, such as relocations) and file-backed memory
/// (mostly the binary's code and read-only data, which no per-node cut touches).
pub fn rss_split(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| {
        kib_field(&status, key).with_context(|| format!("no {key} in /proc/{pid}/status"))
    };
    Ok((kib("RssAnon:")?, kib("RssFile:")?))
}

/// The number on the line of `text` that starts with `key` (such as `"VmRSS:"`), in the
/// `Key:   1234 kB` form of `/proc/<pid>/status` and `/proc/meminfo`.
pub fn kib_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
}

/// `apiserver_request_total` summed by (verb, resource, subresource).
pub async fn request_totals(
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

/// Audit event counts by (user, verb, resource[/subresource]).
pub type AuditCounts = BTreeMap<(String, String, String), u64>;

/// Where the audit log ends now: a mark for [`audit_counts`], taken without reading the log.
///
/// A window's counts run from one mark to the next. Finding the mark by reading the log took
/// long at 65,000 nodes (650 MB of events by the run's end), and the requests made meanwhile
/// were counted in a window whose clock had not started: 17 Lease renewals in a 60 s window,
/// where the log shows one every 5 s.
pub fn audit_end(path: &Path) -> anyhow::Result<u64> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(meta.len()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// The audit events, parsed, whose lines began between the marks `from` and `to` (see
/// [`audit_window`]), and the mark after the last: whole lines only, so an event still being
/// written is left for the next read.
pub fn audit_lines(
    path: &Path,
    from: u64,
    to: u64,
) -> anyhow::Result<(Vec<serde_json::Value>, u64)> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && from == 0 => {
            return Ok((Vec::new(), 0));
        }
        Err(e) => return Err(e).with_context(|| format!("open {}", path.display())),
    };
    let len = file.metadata()?.len();
    if len < from {
        bail!(
            "{} has {len} bytes, fewer than the {from} already counted: it was rotated, so requests would go uncounted",
            path.display()
        );
    }
    // Start one byte early to see whether `from` falls on a line's start.
    let start = from.saturating_sub(1);
    file.seek(SeekFrom::Start(start))?;
    let mut bytes = Vec::with_capacity(usize::try_from(len - start).unwrap_or(0));
    file.read_to_end(&mut bytes)?;
    let mut at = if from > 0 {
        // Skip the rest of a line the mark split (or just the newline before `from`).
        match bytes.iter().position(|&b| b == b'\n') {
            Some(newline) => newline + 1,
            None => return Ok((Vec::new(), from)),
        }
    } else {
        0
    };
    let mut events = Vec::new();
    while start + (at as u64) < to {
        let Some(len) = bytes[at..].iter().position(|&b| b == b'\n') else {
            break;
        };
        if let Ok(event) = serde_json::from_slice(&bytes[at..at + len]) {
            events.push(event);
        }
        at += len + 1;
    }
    Ok((events, start + at as u64))
}

/// Audit events by (user, verb, resource[/subresource]) written from byte `from` on (a mark from
/// [`audit_end`] or from an earlier call); returns the counts, the mark where the events read
/// end, and the Nodes the controller patched the status of, in order. An event still being
/// written is left for the next call.
pub fn audit_counts(path: &Path, from: u64) -> anyhow::Result<(AuditCounts, u64, Vec<String>)> {
    audit_window(path, from, u64::MAX)
}

/// [`audit_counts`] of the events that began between two marks, `from` and `to`: an event the
/// mark `from` split (being written as it was taken) belongs to the window before, one that
/// `to` split to this one, so consecutive windows count each event once.
pub fn audit_window(
    path: &Path,
    from: u64,
    to: u64,
) -> anyhow::Result<(AuditCounts, u64, Vec<String>)> {
    let mut counts = BTreeMap::new();
    let mut patched_nodes = Vec::new();
    let (lines, end) = audit_lines(path, from, to)?;
    for event in lines {
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
    Ok((counts, end, patched_nodes))
}

/// Applies the controller's RBAC and its Lease's FlowSchema from deploy/controller and returns a
/// kubeconfig for its ServiceAccount, so its requests are counted apart from kwok's and the
/// bench's, and its renewals are queued as they are in an installed cluster.
pub async fn controller_kubeconfig(
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
            "FlowSchema",
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

#[cfg(test)]
mod tests {
    use super::{
        CONTROLLER_USER, HOST_NEUTRAL_THRESHOLDS, audit_counts, audit_end, audit_window,
        proc_usage, rss_split, until_interrupted,
    };

    fn event(user: &str, verb: &str, name: &str) -> String {
        serde_json::json!({
            "stage": "ResponseComplete",
            "user": {"username": user},
            "verb": verb,
            "objectRef": {"resource": "nodes", "subresource": "status", "name": name},
        })
        .to_string()
    }

    /// Each event is counted in exactly one of consecutive windows, however the marks fall:
    /// on a line's start, inside a line being written, or before a line's newline is.
    #[test]
    fn audit_windows_count_each_event_once() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let count = |(counts, _, _): &(super::AuditCounts, u64, Vec<String>)| -> u64 {
            counts.values().sum()
        };
        // No log yet: nothing counted, nothing fails.
        assert_eq!(audit_end(&path).unwrap(), 0);
        assert_eq!(count(&audit_counts(&path, 0).unwrap()), 0);

        let mut log = std::fs::File::create(&path).unwrap();
        let a = event(CONTROLLER_USER, "patch", "a");
        writeln!(log, "{a}").unwrap();
        let before = audit_end(&path).unwrap();
        // A mark taken in the middle of an event's line: the event began before it.
        let b = event(CONTROLLER_USER, "patch", "b");
        let (b1, b2) = b.split_at(b.len() / 2);
        write!(log, "{b1}").unwrap();
        let split = audit_end(&path).unwrap();
        write!(log, "{b2}").unwrap();
        // An event whose newline is not written yet is left for the next read.
        let read = audit_counts(&path, before).unwrap();
        assert_eq!((count(&read), read.1), (0, before));
        writeln!(log).unwrap();
        writeln!(log, "{}", event("kwok", "update", "c")).unwrap();
        let end = audit_end(&path).unwrap();
        writeln!(log, "{}", event(CONTROLLER_USER, "patch", "d")).unwrap();

        let first = audit_counts(&path, 0).unwrap();
        assert_eq!(first.2, ["a", "b", "d"]);
        assert_eq!(first.1, audit_end(&path).unwrap());
        // Windows [0, before), [before, split), [split, end), [end, ∞).
        let windows = [
            audit_window(&path, 0, before).unwrap(),
            audit_window(&path, before, split).unwrap(),
            audit_window(&path, split, end).unwrap(),
            audit_counts(&path, end).unwrap(),
        ];
        let names: Vec<Vec<String>> = windows.iter().map(|w| w.2.clone()).collect();
        assert_eq!(names, [vec!["a"], vec!["b"], vec![], vec!["d"]]);
        assert_eq!(windows.iter().map(count).collect::<Vec<_>>(), [1, 1, 1, 1]);
        assert_eq!(
            windows[2].0.keys().next().unwrap(),
            &(
                "kwok".to_owned(),
                "update".to_owned(),
                "nodes/status".to_owned()
            )
        );
        // A log shorter than a mark was rotated: an error, not a silent zero.
        std::fs::write(&path, "").unwrap();
        let error = audit_counts(&path, end).unwrap_err().to_string();
        assert!(error.contains("rotated"), "{error}");
    }

    #[test]
    fn a_signal_stops_the_benchmark_and_drops_its_rig() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        struct Rig(Arc<AtomicBool>);
        impl Drop for Rig {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        assert_eq!(until_interrupted(&runtime, async { Ok(7) }).unwrap(), 7);
        let dropped = Arc::new(AtomicBool::new(false));
        let rig = Rig(Arc::clone(&dropped));
        let error = until_interrupted(&runtime, async move {
            let _rig = rig;
            // SIGTERM, not SIGINT: no other test of this binary handles either, and once a
            // handler is in place the signal no longer ends the process.
            nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::SIGTERM)?;
            std::future::pending::<anyhow::Result<()>>().await
        })
        .unwrap_err();
        assert!(dropped.load(Ordering::SeqCst), "the rig was not dropped");
        assert!(error.to_string().contains("SIGTERM"), "{error}");
    }

    #[test]
    fn host_neutral_thresholds_are_rules_the_controller_accepts() {
        let rules = format!(
            "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n{HOST_NEUTRAL_THRESHOLDS}"
        );
        let data = [("rules.yaml".to_owned(), rules)].into_iter().collect();
        let config = nodekeeper_model::tuning::parse(&data).expect("the rig's rules parse");
        let disk = &config.rules.thresholds[0];
        assert_eq!(disk.indicator, "disk.*");
        // Above any percentage a disk can report.
        assert!(disk.warning > 100.0 && disk.critical > disk.warning);
    }

    #[test]
    fn this_process_rss_splits_into_its_anonymous_and_file_backed_parts() {
        let pid = std::process::id();
        let (anon, file) = rss_split(pid).expect("RssAnon and RssFile");
        assert!(
            anon > 0 && file > 0,
            "anonymous {anon} KiB, file-backed {file} KiB"
        );
        let (rss, peak, _) = proc_usage(pid).expect("VmRSS");
        // Read a moment apart, so only close; RssShmem, the third part, is nearly always 0 here.
        let parts = anon + file;
        assert!(rss > 0 && peak >= rss, "VmRSS {rss} KiB, VmHWM {peak} KiB");
        assert!(
            parts.abs_diff(rss) < rss / 4,
            "RssAnon + RssFile = {parts} KiB against VmRSS {rss} KiB"
        );
    }
}
