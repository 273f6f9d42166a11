//! `cargo xtask demo`: nodekeeper end to end on this machine — a local control plane with
//! simulated (kwok) nodes, one real `nodekeeper-agent` process per node listening on the node's
//! loopback InternalIP, the real `nodekeeper-controller`, the fleet summary and Node conditions
//! the controller produces, and a NetworkTest from `deploy/examples/` run across the fleet.
//!
//! Everything it starts dies with it (Ctrl-C included): the control plane and our own children
//! get SIGKILL from the kernel when this process ends (the harness's parent-death signal), and
//! a normal exit or Ctrl-C stops them first, by pid. All traffic stays on 127.0.0.0/8.

// The demo's output is its purpose.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::Args;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Secret};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_api::names;
use nodekeeper_e2e::controlplane::{self, Cluster, Lifetime, Options, nodes, process};
use serde::Deserialize as _;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::deps;

/// The control plane's name: its state (and the demo's files) live in
/// `${XDG_CACHE_HOME:-~/.cache}/nodekeeper/clusters/demo/`.
const CLUSTER: &str = "demo";
/// Where the controller runs and the demo's objects go.
const NAMESPACE: &str = "nodekeeper";
/// The Secret the controller creates with the agents' certificate (`crates/controller/src/certs.rs`).
const AGENT_SECRET: &str = "nodekeeper-agent-tls";
/// The NetworkTest the demo runs.
const NETWORK_TEST_EXAMPLE: &str = "networktest-mesh.yaml";
/// The tuning ConfigMap's sweep interval for the demo (the example says 5m): the smallest the
/// controller accepts, so that a change shows within seconds.
const DEMO_SWEEP_INTERVAL: &str = "10s";
/// Field manager of the demo's server-side applies.
const FIELD_MANAGER: &str = "nodekeeper-demo";
/// Most simulated nodes: each has its own agent process.
const MAX_NODES: u32 = 100;

#[derive(Args)]
pub struct DemoArgs {
    /// Simulated nodes, each with its own `nodekeeper-agent` process on 127.1.x.y.
    #[arg(long, env = "NODEKEEPER_DEMO_NODES", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_NODES)))]
    nodes: u32,
    /// Leave the control plane (and the objects the demo made) running afterwards; stop it with
    /// `cargo xtask cluster down --name demo`. The controller and agents stop with the demo.
    #[arg(long, env = "NODEKEEPER_DEMO_KEEP")]
    keep: bool,
    /// After the demo, keep the controller and agents running until Ctrl-C, to explore the
    /// controller's HTTP API and the cluster with kubectl.
    #[arg(long, env = "NODEKEEPER_DEMO_WAIT")]
    wait: bool,
    /// Longest wait for each step (controller leadership, agents read, the NetworkTest), in
    /// seconds.
    #[arg(long, env = "NODEKEEPER_DEMO_TIMEOUT", default_value_t = 90)]
    timeout: u64,
}

/// Runs the demo. A failure is one `error: …` line and exit status 1.
pub fn run(args: DemoArgs) -> Result<()> {
    if let Err(error) = demo(&args) {
        println!();
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
    Ok(())
}

fn demo(args: &DemoArgs) -> Result<()> {
    let started = Instant::now();
    step(
        1,
        "Building nodekeeper-agent and nodekeeper-controller (cargo build)",
    );
    deps::ensure(deps::DEMO)?;
    let bins = build_binaries()?;
    println!(
        "    {}\n    {}",
        bins.agent.display(),
        bins.controller.display()
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut running = Running::default();
        // Ctrl-C also reaches the children (same process group) and the control plane (unless
        // --keep detached it); dropping `running` then stops whatever is left, by pid.
        let result = tokio::select! {
            // Steps first: in --wait mode they take Ctrl-C as the normal end.
            biased;
            result = steps(args, &bins, &mut running) => result,
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted by Ctrl-C")),
        };
        println!();
        let what = if args.keep {
            "the agents and the controller (the control plane stays: --keep)"
        } else {
            "the agents, the controller and the control plane"
        };
        println!("==> Stopping {what}");
        running.stop();
        result?;
        println!(
            "==> Demo finished in {:.0}s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    })
}

fn step(n: u32, title: &str) {
    println!();
    println!("==> [{n}/6] {title}");
}

struct Binaries {
    agent: PathBuf,
    controller: PathBuf,
}

/// Builds both binaries with cargo's output on the terminal, and takes their paths from
/// cargo's own report (which honours `CARGO_TARGET_DIR` and config).
fn build_binaries() -> Result<Binaries> {
    let [agent, controller] = crate::cargo::build_executables(
        &crate::codegen::repo_root(),
        &[
            "build",
            "-p",
            "nodekeeper-agent",
            "-p",
            "nodekeeper-controller",
            "--bins",
        ],
        ["nodekeeper-agent", "nodekeeper-controller"],
    )?;
    Ok(Binaries { agent, controller })
}

/// A process the demo started and owns: stopped by pid through its `Child` handle, which we
/// never reap before stopping, so the pid cannot belong to anyone else.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

/// What the demo has running. Dropping it (any exit path) stops the children, then the
/// control plane (unless detached by --keep).
#[derive(Default)]
struct Running {
    children: Vec<Proc>,
    cluster: Option<Cluster>,
}

impl Running {
    fn stop(&mut self) {
        // SIGTERM to all first so they shut down in parallel, then reap, SIGKILL on a deadline.
        for p in &self.children {
            if let Ok(pid) = i32::try_from(p.child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for p in &mut self.children {
            while matches!(p.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(p.child.try_wait(), Ok(None)) {
                let _ = p.child.kill();
            }
            let _ = p.child.wait();
        }
        self.children.clear();
        // A WithThisProcess cluster stops when dropped; a detached one stays.
        self.cluster = None;
    }

    /// Fails when a child has exited, naming it, its last log line and its log.
    fn check_alive(&mut self) -> Result<()> {
        for p in &mut self.children {
            if let Some(status) = p.child.try_wait()? {
                bail!(
                    "{} exited ({status}); last log line: {:?}; full log: {}",
                    p.name,
                    last_line(&p.log),
                    p.log.display()
                );
            }
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}

fn last_line(path: &Path) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

/// One simulated node: its name, address, and the agent's files.
struct SimNode {
    name: String,
    ip: Ipv4Addr,
    dir: PathBuf,
}

async fn steps(args: &DemoArgs, bins: &Binaries, running: &mut Running) -> Result<()> {
    let timeout = Duration::from_secs(args.timeout);

    // 2. The control plane.
    step(
        2,
        &format!(
            "Starting the local control plane `{CLUSTER}` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok)"
        ),
    );
    let state = controlplane::read_state(CLUSTER).ok();
    if let Some(api) = state
        .iter()
        .flat_map(|s| &s.components)
        .find(|c| c.name == "kube-apiserver" && c.is_running())
    {
        bail!(
            "the `{CLUSTER}` control plane is still running (kube-apiserver pid {}, left by `cargo xtask demo --keep`?): stop it with `cargo xtask cluster down --name {CLUSTER}` and retry",
            api.pid
        );
    }
    // A fresh cluster every time: no Nodes, Secrets or NetworkTests left from an earlier run.
    controlplane::down(CLUSTER, true).context("remove the previous demo cluster's state")?;
    let lifetime = if args.keep {
        Lifetime::Detached
    } else {
        Lifetime::WithThisProcess
    };
    let t = Instant::now();
    let cluster = controlplane::up(&Options::new(CLUSTER, lifetime), &mut |line| {
        println!("    {line}")
    })
    .await
    .context("start the local control plane")?;
    let kubeconfig = cluster.kubeconfig.clone();
    let apiserver = cluster.apiserver_url();
    let apiserver_port = cluster.state.ports.apiserver;
    let state_dir = cluster.state_dir.clone();
    running.cluster = Some(cluster);
    println!(
        "    control plane ready at {apiserver} in {:.1}s (logs in {})",
        t.elapsed().as_secs_f64(),
        state_dir.join("logs").display()
    );
    if args.keep {
        println!(
            "    --keep: it stays up after the demo; use it with `export KUBECONFIG={}`, stop it with `cargo xtask cluster down --name {CLUSTER}`",
            kubeconfig.display()
        );
    }
    let client = controlplane::client_from_kubeconfig(&kubeconfig).await?;
    let crds = nodekeeper_e2e::install_crds(&client).await?;
    println!("    CRDs installed from deploy/crds/: {}", crds.join(", "));
    apply(
        &Api::<Namespace>::all(client.clone()),
        NAMESPACE,
        &json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": NAMESPACE } }),
    )
    .await?;
    let mut tuning = read_example("tuning-configmap.yaml")?;
    tuning["metadata"]["namespace"] = NAMESPACE.into();
    tuning["data"]["sweepInterval"] = DEMO_SWEEP_INTERVAL.into();
    let tuning_name = tuning["metadata"]["name"]
        .as_str()
        .context("deploy/examples/tuning-configmap.yaml has no metadata.name")?
        .to_owned();
    apply(
        &Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE),
        &tuning_name,
        &tuning,
    )
    .await?;
    println!(
        "    namespace {NAMESPACE}; ConfigMap {NAMESPACE}/{tuning_name} from deploy/examples/tuning-configmap.yaml (sweepInterval {DEMO_SWEEP_INTERVAL} instead of 5m, so the demo need not wait)"
    );

    // 3. The controller.
    let demo_dir = state_dir.join("nodekeeper");
    std::fs::create_dir_all(&demo_dir).with_context(|| format!("create {}", demo_dir.display()))?;
    let http = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port(Ipv4Addr::LOCALHOST)?));
    let sim: Vec<SimNode> = (0..args.nodes)
        .map(|i| SimNode {
            name: format!("sim-{i}"),
            ip: controlplane::simulated_node_ip(i),
            dir: demo_dir.join("agents").join(format!("sim-{i}")),
        })
        .collect();
    let agent_port = agent_port(&sim)?;
    let controller_log = demo_dir.join("controller.log");
    step(3, "Starting nodekeeper-controller");
    let t = Instant::now();
    let controller_args: Vec<String> = vec![
        format!("--namespace={NAMESPACE}"),
        format!("--http-listen={http}"),
        format!("--agent-port={agent_port}"),
        format!("--node-selector={}=true", nodes::SIMULATED_LABEL),
        // For `apiServer: true` targets (deploy/examples/networktest-apiserver.yaml).
        format!("--api-server-address=127.0.0.1:{apiserver_port}"),
        "--identity=demo-controller".into(),
        "--log-format=plain".into(),
    ];
    let child = process::spawn(
        &bins.controller,
        &controller_args,
        &[
            ("KUBECONFIG", kubeconfig.as_path()),
            // Plain log files, without terminal colour codes.
            ("NO_COLOR", Path::new("1")),
        ],
        &controller_log,
        Lifetime::WithThisProcess,
    )?;
    println!(
        "    pid {}  HTTP API http://{http}  agents on port {agent_port}  log {}",
        child.id(),
        controller_log.display()
    );
    running.children.push(Proc {
        name: "nodekeeper-controller".into(),
        child,
        log: controller_log.clone(),
    });
    wait_until(
        running,
        "the controller to lead (/readyz)",
        timeout,
        &controller_log,
        move || async move {
            Ok(matches!(http_get(http, "/readyz").await, Ok((200, body)) if body.contains("leader")))
        },
    )
    .await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NAMESPACE);
    let secrets = &secrets;
    let secret = wait_until_some(
        running,
        &format!("the controller to create Secret {NAMESPACE}/{AGENT_SECRET}"),
        timeout,
        &controller_log,
        move || async move { Ok(secrets.get_opt(AGENT_SECRET).await?) },
    )
    .await?;
    let tls_dir = demo_dir.join("tls");
    std::fs::create_dir_all(&tls_dir)?;
    for file in ["tls.crt", "tls.key", "ca.crt"] {
        let bytes = secret
            .data
            .as_ref()
            .and_then(|d| d.get(file))
            .with_context(|| format!("Secret {NAMESPACE}/{AGENT_SECRET} has no {file}"))?;
        std::fs::write(tls_dir.join(file), &bytes.0)
            .with_context(|| format!("write {}", tls_dir.join(file).display()))?;
    }
    println!(
        "    leading after {:.1}s; it created its CA and the agents' certificate (Secret {NAMESPACE}/{AGENT_SECRET}, copied to {})",
        t.elapsed().as_secs_f64(),
        tls_dir.display()
    );

    // 4. The agents, then the Nodes they stand for: the controller finds every agent already
    // listening when it first sees the Node.
    step(
        4,
        &format!(
            "Starting {} nodekeeper-agent(s) and their simulated Nodes",
            sim.len()
        ),
    );
    println!(
        "    Each agent reads this machine's /proc; its sysctls are a small file tree of its own (so repairs touch no real setting), seeded to give the tuning rules something to find:"
    );
    for (i, node) in sim.iter().enumerate() {
        let (sysctls, note) = seed_sysctls(i);
        let sysctl_root = node.dir.join("sysctl");
        for (key, value) in &sysctls {
            let path = key
                .split('.')
                .fold(sysctl_root.clone(), |p, part| p.join(part));
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&path, format!("{value}\n"))
                .with_context(|| format!("write {}", path.display()))?;
        }
        let state = node.dir.join("state");
        std::fs::create_dir_all(&state)?;
        let log = node.dir.join("agent.log");
        let listen = SocketAddr::from((node.ip, agent_port));
        let agent_args: Vec<String> = vec![
            format!("--listen={listen}"),
            format!("--node-name={}", node.name),
            format!("--tls-cert={}", tls_dir.join("tls.crt").display()),
            format!("--tls-key={}", tls_dir.join("tls.key").display()),
            format!("--client-ca={}", tls_dir.join("ca.crt").display()),
            format!("--state-dir={}", state.display()),
            format!("--sysctl-root={}", sysctl_root.display()),
            "--log-format=plain".into(),
        ];
        let child = process::spawn(
            &bins.agent,
            &agent_args,
            &[("NO_COLOR", Path::new("1"))],
            &log,
            Lifetime::WithThisProcess,
        )?;
        println!(
            "    {:<8} {listen:<18} pid {:<8} {note}",
            node.name,
            child.id()
        );
        running.children.push(Proc {
            name: format!("nodekeeper-agent for {}", node.name),
            child,
            log,
        });
    }
    for node in &sim {
        let addr = SocketAddr::from((node.ip, agent_port));
        let log = node.dir.join("agent.log");
        wait_until(
            running,
            &format!("the agent of {} to listen on {addr}", node.name),
            timeout,
            &log,
            move || async move { Ok(tokio::net::TcpStream::connect(addr).await.is_ok()) },
        )
        .await?;
    }
    println!(
        "    agents listening (mutual TLS; logs in {}/<node>/agent.log)",
        demo_dir.join("agents").display()
    );
    let names: Vec<String> = sim.iter().map(|n| n.name.clone()).collect();
    let ips: Vec<Ipv4Addr> = sim.iter().map(|n| n.ip).collect();
    let created = Instant::now();
    nodes::create(&client, &names, &ips, &BTreeMap::new()).await?;
    nodes::wait_ready(&client, &names, timeout).await?;
    println!(
        "    Nodes {} created (label {}=true) and Ready (kwok)",
        names.join(", "),
        nodes::SIMULATED_LABEL
    );

    // 5. The controller reads every agent and writes conditions.
    step(5, "Waiting for the controller to read every agent");
    let n = sim.len() as u64;
    let summary = wait_until_some(
        running,
        &format!("the controller to report all {n} nodes NodekeeperReachable=True with TunablesInBounds evaluated (/api/v1/summary)"),
        timeout,
        &controller_log,
        move || async move {
            let Ok((200, body)) = http_get(http, "/api/v1/summary").await else {
                return Ok(None);
            };
            let summary: Value = serde_json::from_str(&body)?;
            let count = |key: &str| summary["fleet"]["conditions"][key].as_u64().unwrap_or(0);
            let reachable = count("NodekeeperReachable=True");
            let tunables = count("TunablesInBounds=True") + count("TunablesInBounds=False");
            Ok((reachable == n && tunables == n).then_some(summary))
        },
    )
    .await?;
    println!(
        "    all {n} agents read, and their conditions written, within {:.1}s of their Nodes' creation",
        created.elapsed().as_secs_f64()
    );
    print_summary(&summary, http);
    let mut details = Vec::new();
    for node in &sim {
        let (status, body) = http_get(http, &format!("/api/v1/nodes/{}", node.name)).await?;
        if status != 200 {
            bail!(
                "GET http://{http}/api/v1/nodes/{} answered {status}: {}",
                node.name,
                body.trim()
            );
        }
        details.push(serde_json::from_str::<Value>(&body)?);
    }
    print_nodes(&details, http);
    print_conditions(&client).await?;

    // 6. A NetworkTest across the fleet.
    step(
        6,
        &format!(
            "Running NetworkTest {NAMESPACE}/mesh (deploy/examples/{NETWORK_TEST_EXAMPLE}) across the simulated fleet"
        ),
    );
    let mut test = read_example(NETWORK_TEST_EXAMPLE)?;
    test["metadata"]["namespace"] = NAMESPACE.into();
    let test_name = test["metadata"]["name"]
        .as_str()
        .with_context(|| format!("deploy/examples/{NETWORK_TEST_EXAMPLE} has no metadata.name"))?
        .to_owned();
    let tests: Api<NetworkTest> = Api::namespaced(client.clone(), NAMESPACE);
    apply(&tests, &test_name, &test).await?;
    let (tests, test_name) = (&tests, test_name.as_str());
    println!(
        "    applied: kind {}, targets {}",
        test["spec"]["kind"].as_str().unwrap_or("?"),
        test["spec"]["targets"]
    );
    let t = Instant::now();
    // A controller running the NetworkTest reconciler writes `Running` within seconds; without
    // one the test would wait out the whole timeout for nothing.
    wait_until(
        running,
        &format!("the controller to pick up NetworkTest {NAMESPACE}/{test_name} (any status.phase)"),
        timeout.min(Duration::from_secs(20)),
        &controller_log,
        move || async move {
            let test = tests.get(test_name).await?;
            Ok(test.status.as_ref().and_then(|s| s.phase).is_some())
        },
    )
    .await
    .context(
        "the controller did not pick up the NetworkTest (does this build of nodekeeper-controller run the NetworkTest reconciler? `grep -n networktest crates/controller/src/controllers/mod.rs`)",
    )?;
    let done = wait_until_some(
        running,
        &format!(
            "NetworkTest {NAMESPACE}/{test_name} to finish (status.phase Succeeded or Failed)"
        ),
        timeout,
        &controller_log,
        move || async move {
            let test = tests.get(test_name).await?;
            let finished = test
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| matches!(p, Phase::Succeeded | Phase::Failed));
            Ok(finished.then_some(test))
        },
    )
    .await?;
    println!("    finished in {:.1}s", t.elapsed().as_secs_f64());
    print_network_test(&done);
    let path = format!("/api/networktests/{NAMESPACE}/{test_name}");
    match http_get(http, &path).await {
        Ok((200, body)) => print_pairs(&serde_json::from_str(&body)?),
        Ok((status, body)) => println!("    GET {path}: {status} {}", body.trim()),
        Err(error) => println!("    GET {path}: {error:#}"),
    }
    println!(
        "    Status is what etcd holds (bounded); every pair's result is served by the controller:"
    );
    println!("      curl http://{http}{path}");
    println!(
        "    (in a cluster: kubectl get --raw /api/v1/namespaces/nodekeeper/services/nodekeeper-controller:http/proxy{path})"
    );

    if args.keep || args.wait {
        let kubectl = controlplane::binaries::ensure(&mut |_| {})
            .map(|b| b.path("kubectl"))
            .unwrap_or_else(|_| PathBuf::from("kubectl"));
        println!();
        println!("==> Explore");
        println!("    export KUBECONFIG={}", kubeconfig.display());
        println!(
            "    {} get nodes -o wide; {} get networktests -n {NAMESPACE}",
            kubectl.display(),
            kubectl.display()
        );
        if args.keep {
            println!("    stop the control plane: cargo xtask cluster down --name {CLUSTER}");
        }
    }
    if args.wait {
        println!(
            "    controller: curl http://{http}/api/v1/summary  (/api/v1/nodes/<name>, /metrics)"
        );
        println!("    press Ctrl-C to stop the agents and the controller");
        // Ctrl-C is how this mode ends, so it is a success here.
        let mut interrupted = std::pin::pin!(tokio::signal::ctrl_c());
        loop {
            tokio::select! {
                _ = &mut interrupted => break,
                () = tokio::time::sleep(Duration::from_secs(1)) => running.check_alive()?,
            }
        }
    }
    Ok(())
}

/// The sysctls of simulated node `i` and what is notable about them: node 0's
/// `net.core.somaxconn` is below the example's rule (which allows repair), node 1's
/// `net.ipv4.ip_forward` is off (a critical rule, no repair), node 2's `vm.swappiness` is above
/// its bound (a warning); every other value is within the example's rules.
fn seed_sysctls(i: usize) -> (Vec<(&'static str, &'static str)>, &'static str) {
    let mut sysctls = vec![
        ("net.core.somaxconn", "4096"),
        ("net.ipv4.ip_forward", "1"),
        ("vm.swappiness", "10"),
    ];
    let note = match i {
        0 => {
            sysctls[0].1 = "128";
            "net.core.somaxconn=128 (rule: >= 4096, repair allowed)"
        }
        1 => {
            sysctls[1].1 = "0";
            "net.ipv4.ip_forward=0 (rule: = 1, critical, no repair)"
        }
        2 => {
            sysctls[2].1 = "60";
            "vm.swappiness=60 (rule: <= 10, warning)"
        }
        _ => "all within the rules",
    };
    (sysctls, note)
}

/// The agents' port: 9443 (the default) when it is free on every node address, else a port free
/// on all of them.
fn agent_port(sim: &[SimNode]) -> Result<u16> {
    let free_on_all = |port: u16| {
        sim.iter()
            .all(|n| TcpListener::bind(SocketAddrV4::new(n.ip, port)).is_ok())
    };
    if free_on_all(9443) {
        return Ok(9443);
    }
    for _ in 0..20 {
        let port = free_port(sim[0].ip)?;
        if free_on_all(port) {
            return Ok(port);
        }
    }
    bail!("found no port free on every simulated node address (127.1.x.y)")
}

fn free_port(ip: Ipv4Addr) -> Result<u16> {
    Ok(TcpListener::bind(SocketAddrV4::new(ip, 0))
        .with_context(|| format!("find a free port on {ip}"))?
        .local_addr()?
        .port())
}

/// Polls `check` every 250 ms until it says true, failing after `timeout` or when a child
/// exits; the error names what was awaited and the log to read.
async fn wait_until<F, Fut>(
    running: &mut Running,
    what: &str,
    timeout: Duration,
    log: &Path,
    mut check: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    wait_until_some(running, what, timeout, log, || {
        let fut = check();
        async move { Ok(fut.await?.then_some(())) }
    })
    .await
}

async fn wait_until_some<T, F, Fut>(
    running: &mut Running,
    what: &str,
    timeout: Duration,
    log: &Path,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        running.check_alive()?;
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last_error = Some(format!("{error:#}")),
        }
        if Instant::now() > deadline {
            let last = last_error
                .map(|e| format!(" (last error: {e})"))
                .unwrap_or_default();
            bail!(
                "timed out after {}s waiting for {what}{last}; see {}",
                timeout.as_secs(),
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A plain HTTP/1.0 GET against the controller on loopback; returns (status, body).
async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let io = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        anyhow::Ok(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(10), io)
        .await
        .with_context(|| format!("GET http://{addr}{path} timed out"))??;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET http://{addr}{path}: no HTTP header"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("GET http://{addr}{path}: no status"))?;
    Ok((status, body.to_owned()))
}

/// Server-side applies `object` as the demo's field manager.
async fn apply<K>(api: &Api<K>, name: &str, object: &Value) -> Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .with_context(|| {
        format!(
            "apply {} {name}",
            object["kind"].as_str().unwrap_or("object")
        )
    })
}

/// The single document of `deploy/examples/<file>`.
fn read_example(file: &str) -> Result<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("examples")
        .join(file);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let mut documents = serde_yaml::Deserializer::from_str(&text)
        .map(Value::deserialize)
        .filter(|d| !matches!(d, Ok(Value::Null)));
    let first = documents
        .next()
        .with_context(|| format!("{} holds no object", path.display()))?
        .with_context(|| format!("parse {}", path.display()))?;
    if documents.next().is_some() {
        bail!(
            "{} holds more than one object; the demo expects one",
            path.display()
        );
    }
    Ok(first)
}

fn print_summary(summary: &Value, http: SocketAddr) {
    let fleet = &summary["fleet"];
    println!();
    println!("    Fleet summary (GET http://{http}/api/v1/summary):");
    println!(
        "      nodes {}  read {}  stale {}  without InternalIP {}",
        fleet["nodes"], fleet["read"], fleet["stale"], fleet["withoutInternalIp"]
    );
    if let Some(conditions) = fleet["conditions"].as_object() {
        let list: Vec<String> = conditions
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        println!("      conditions  {}", list.join("  "));
    }
    match fleet["tunablesOutOfBounds"].as_object() {
        Some(out) if !out.is_empty() => {
            let list: Vec<String> = out
                .iter()
                .map(|(k, v)| format!("{k}: {v} node(s)"))
                .collect();
            println!("      tunables out of bounds  {}", list.join("  "));
        }
        _ => println!("      tunables out of bounds  none"),
    }
    if let Some(seconds) = summary["initialSweepSeconds"].as_f64() {
        println!("      first sweep of the fleet took {seconds:.2}s");
    }
}

/// An indicator's value for people: `93%`, `16.0s`, `2.27`.
fn with_unit(value: Option<f64>, unit: &str) -> String {
    let Some(v) = value else { return "?".into() };
    match unit {
        "percent" => format!("{v:.0}%"),
        "seconds" => format!("{v:.1}s"),
        "bool" => (if v == 0.0 { "false" } else { "true" }).into(),
        "" | "ratio" => format!("{v:.2}"),
        other => format!("{v:.2} {other}"),
    }
}

fn verdict_counts(items: &Value) -> String {
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for item in items.as_array().into_iter().flatten() {
        *counts
            .entry(item["verdict"].as_str().unwrap_or("?"))
            .or_default() += 1;
    }
    let get = |k: &str| counts.get(k).copied().unwrap_or(0);
    format!(
        "{} ok, {} warn, {} crit",
        get("ok"),
        get("warning"),
        get("critical")
    )
}

fn condition_of<'a>(detail: &'a Value, type_: &str) -> Option<&'a Value> {
    detail["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn print_nodes(details: &[Value], http: SocketAddr) {
    println!();
    println!("    Nodes as the controller sees them (GET http://{http}/api/v1/nodes/<name>):");
    println!(
        "      {:<8} {:<12} {:<10} {:<26} {:<22} {:>9} {:>9}",
        "NODE", "ADDRESS", "REACHABLE", "TUNABLES", "INDICATORS", "LOAD1/CPU", "MEM AVAIL"
    );
    for d in details {
        let status = |t: &str| {
            condition_of(d, t)
                .map(|c| {
                    format!(
                        "{} {}",
                        c["status"].as_str().unwrap_or("?"),
                        c["reason"].as_str().unwrap_or("")
                    )
                })
                .unwrap_or_else(|| "-".into())
        };
        let indicator = |name: &str| {
            d["report"]["indicators"]
                .as_array()
                .and_then(|a| a.iter().find(|i| i["name"] == name))
                .and_then(|i| i["value"].as_f64())
        };
        println!(
            "      {:<8} {:<12} {:<10} {:<26} {:<22} {:>9} {:>9}",
            d["name"].as_str().unwrap_or("?"),
            d["address"].as_str().unwrap_or("-"),
            condition_of(d, names::NODE_CONDITION_REACHABLE)
                .and_then(|c| c["status"].as_str())
                .unwrap_or("-"),
            status(names::NODE_CONDITION_TUNABLES_IN_BOUNDS),
            verdict_counts(&d["report"]["indicators"]),
            indicator("load.avg1_per_cpu").map_or("-".into(), |v| format!("{v:.2}")),
            indicator("memory.available_percent").map_or("-".into(), |v| format!("{v:.0}%")),
        );
    }
    if let Some(first) = details.first() {
        let flagged: Vec<String> = first["report"]["indicators"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| i["verdict"] != "ok")
            .map(|i| {
                format!(
                    "{} {} {}",
                    i["name"].as_str().unwrap_or("?"),
                    with_unit(i["value"].as_f64(), i["unit"].as_str().unwrap_or("")),
                    i["verdict"].as_str().unwrap_or("?"),
                )
            })
            .collect();
        println!(
            "      Every agent reads this machine's /proc, so their indicators agree; not ok on {}: {}",
            first["name"].as_str().unwrap_or("?"),
            if flagged.is_empty() {
                "none".into()
            } else {
                flagged.join(", ")
            }
        );
    }
    println!();
    println!(
        "    Tunables per node (rules from the tuning ConfigMap, evaluated and repaired by each agent):"
    );
    for d in details {
        let mut line = String::new();
        for t in d["report"]["tunables"].as_array().into_iter().flatten() {
            let _ = write!(
                line,
                "{}={} {}",
                t["key"].as_str().unwrap_or("?"),
                t["current"].as_str().unwrap_or("?"),
                t["verdict"].as_str().unwrap_or("?")
            );
            if let Some(previous) = t["previous"].as_str().filter(|p| !p.is_empty()) {
                let _ = write!(line, " (repaired from {previous})");
            } else if t["verdict"] != "ok" {
                let _ = write!(line, " (want {})", t["expected"].as_str().unwrap_or("?"));
            }
            line.push_str("; ");
        }
        println!(
            "      {:<8} {}",
            d["name"].as_str().unwrap_or("?"),
            line.trim_end_matches("; ")
        );
    }
}

/// The nodekeeper-owned conditions on the Node objects, as `kubectl get node` shows them.
async fn print_conditions(client: &kube::Client) -> Result<()> {
    const OWNED: [&str; 7] = [
        names::NODE_CONDITION_REACHABLE,
        names::NODE_CONDITION_TUNABLES_IN_BOUNDS,
        names::NODE_CONDITION_NETWORK_READY,
        names::NODE_CONDITION_GPU_HEALTHY,
        names::NODE_CONDITION_MAINTENANCE_IN_PROGRESS,
        names::NODE_CONDITION_DRAIN_IN_PROGRESS,
        names::NODE_CONDITION_DRAINED,
    ];
    let list = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{}=true", nodes::SIMULATED_LABEL)))
        .await
        .context("list the simulated Nodes")?;
    println!();
    println!(
        "    Node conditions written by nodekeeper (from the API server: kubectl get node <name> -o yaml):"
    );
    for node in &list.items {
        let name = node.metadata.name.as_deref().unwrap_or("?");
        for c in node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| OWNED.contains(&c.type_.as_str()))
        {
            println!(
                "      {:<8} {:<20} {:<6} {:<20} {}",
                name,
                c.type_,
                c.status,
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or("")
            );
        }
    }
    Ok(())
}

fn print_network_test(test: &NetworkTest) {
    let Some(s) = &test.status else { return };
    let phase = s.phase.map_or("-".to_owned(), |p| format!("{p:?}"));
    println!(
        "    phase {phase}  nodes {} (unreachable {})  pairs {} (failed {})  success {}  loss {}",
        s.sources,
        s.sources_unreachable,
        s.pairs,
        s.pairs_failed,
        s.success_percent.map_or("-".into(), |v| format!("{v:.1}%")),
        s.loss_percent.map_or("-".into(), |v| format!("{v:.1}%")),
    );
    match &s.latency {
        Some(l) => println!(
            "    latency p50 {}µs  p95 {}µs  max {}µs  ({} of {} probes answered)",
            l.p50_us, l.p95_us, l.max_us, s.received, s.sent
        ),
        None => println!("    no probe was answered ({} sent)", s.sent),
    }
    if s.worst_failures.is_empty() {
        println!("    failing pairs: none");
    } else {
        println!("    failing pairs (worst first):");
        for f in &s.worst_failures {
            println!(
                "      {} -> {}: {:.0}% lost, {}",
                f.source, f.target, f.loss_percent, f.error
            );
        }
        if s.omitted_failures > 0 {
            println!("      … and {} more", s.omitted_failures);
        }
    }
}

/// The per-pair results the controller keeps in memory.
fn print_pairs(page: &Value) {
    let pairs = page["pairs"].as_array().map_or(&[][..], Vec::as_slice);
    println!(
        "    Pairs (from the controller; {} in all):",
        page["totalPairs"].as_u64().unwrap_or(pairs.len() as u64)
    );
    for p in pairs.iter().take(12) {
        let rtts: Vec<String> = p["rttUs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .map(|v| format!("{v}µs"))
            .collect();
        let error = p["error"].as_str().filter(|e| !e.is_empty());
        println!(
            "      {:<8} -> {:<14} {}/{} answered  rtt {}{}",
            p["source"].as_str().unwrap_or("?"),
            p["targetId"].as_str().unwrap_or("?"),
            p["received"],
            p["sent"],
            if rtts.is_empty() {
                "-".into()
            } else {
                rtts.join(" ")
            },
            error.map(|e| format!("  error: {e}")).unwrap_or_default()
        );
    }
    if pairs.len() > 12 {
        println!("      …");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_examples_the_demo_edits_have_the_fields_it_sets() {
        let tuning = read_example("tuning-configmap.yaml").unwrap();
        assert_eq!(tuning["kind"], "ConfigMap");
        assert!(
            tuning["data"]["sweepInterval"].is_string(),
            "the demo shortens data.sweepInterval; the example must name it"
        );
        assert!(tuning["metadata"]["name"].is_string());
        let mesh = read_example(NETWORK_TEST_EXAMPLE).unwrap();
        assert_eq!(mesh["kind"], "NetworkTest");
        assert!(mesh["metadata"]["name"].is_string());
    }

    #[test]
    fn only_the_first_three_nodes_are_seeded_out_of_bounds() {
        let values = |i| seed_sysctls(i).0;
        assert_eq!(values(0)[0], ("net.core.somaxconn", "128"));
        assert_eq!(values(1)[1], ("net.ipv4.ip_forward", "0"));
        assert_eq!(values(2)[2], ("vm.swappiness", "60"));
        assert_eq!(
            values(3),
            vec![
                ("net.core.somaxconn", "4096"),
                ("net.ipv4.ip_forward", "1"),
                ("vm.swappiness", "10")
            ]
        );
    }

    #[test]
    fn indicator_units_read_naturally() {
        assert_eq!(with_unit(Some(93.4), "percent"), "93%");
        assert_eq!(with_unit(Some(16.0), "seconds"), "16.0s");
        assert_eq!(with_unit(Some(0.0), "bool"), "false");
        assert_eq!(with_unit(Some(2.271), "ratio"), "2.27");
        assert_eq!(with_unit(None, "percent"), "?");
    }
}
