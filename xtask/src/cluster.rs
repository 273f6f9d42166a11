//! `cargo xtask cluster up|down|status|env`: the local control plane for development and demos,
//! a thin CLI over `nodekeeper_e2e::controlplane` (the same code the tests use).

// Printing the cluster's status and the `export` line is this command's output.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Args, Subcommand};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;
use nodekeeper_e2e::controlplane::{self, Lifetime, Options, nodes};

#[derive(Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    command: ClusterCommand,
    /// Cluster name: its state lives in ${XDG_CACHE_HOME:-~/.cache}/nodekeeper/clusters/<name>/.
    #[arg(
        long,
        global = true,
        env = "NODEKEEPER_CLUSTER_NAME",
        default_value = "dev"
    )]
    name: String,
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Build (first run only) and start etcd, kube-apiserver, kube-controller-manager,
    /// kube-scheduler and kwok on 127.0.0.1, then create simulated nodes.
    Up(UpArgs),
    /// Stop the processes `up` started (only those pids).
    Down {
        /// Also delete the cluster's state: certificates, etcd data, logs, kubeconfig.
        #[arg(long, env = "NODEKEEPER_CLUSTER_PURGE")]
        purge: bool,
    },
    /// Show components, their pids, and the simulated nodes.
    Status,
    /// Print `export KUBECONFIG=…` for the cluster (use with `eval "$(cargo xtask cluster env)"`).
    Env,
}

#[derive(Args)]
struct UpArgs {
    /// kube-apiserver port on 127.0.0.1 [default: 6443 when free, else the port the cluster had
    /// or a free one]. Given explicitly, a taken port is an error.
    #[arg(long, env = "NODEKEEPER_CLUSTER_PORT")]
    port: Option<u16>,
    /// Simulated (kwok) nodes to create, labelled nodekeeper.dev/simulated=true, node i with
    /// InternalIP 127.1.x.y.
    #[arg(long, env = "NODEKEEPER_CLUSTER_NODES", default_value_t = 3)]
    nodes: u32,
    /// Log every API request to <state>/audit.log (JSON, Metadata level) to count requests per user.
    #[arg(long, env = "NODEKEEPER_CLUSTER_AUDIT")]
    audit: bool,
    /// kube-apiserver --max-requests-inflight (default 400); raise for 10,000-node fleets.
    #[arg(long, env = "NODEKEEPER_CLUSTER_MAX_REQUESTS_INFLIGHT")]
    max_requests_inflight: Option<u32>,
    /// kube-apiserver --max-mutating-requests-inflight (default 200).
    #[arg(long, env = "NODEKEEPER_CLUSTER_MAX_MUTATING_REQUESTS_INFLIGHT")]
    max_mutating_requests_inflight: Option<u32>,
}

/// Runs the subcommand. Failures are reported as one `error: …` line that says what to do (no
/// backtrace, whatever RUST_BACKTRACE says) and exit status 1.
pub fn run(args: ClusterArgs) -> anyhow::Result<()> {
    if let Err(error) = dispatch(args) {
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
    Ok(())
}

fn dispatch(args: ClusterArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match args.command {
        ClusterCommand::Up(up) => runtime.block_on(up_cmd(&args.name, up)),
        ClusterCommand::Down { purge } => down_cmd(&args.name, purge),
        ClusterCommand::Status => runtime.block_on(status_cmd(&args.name)),
        ClusterCommand::Env => {
            let kubeconfig = controlplane::state_dir(&args.name).join("kubeconfig");
            controlplane::read_state(&args.name)?;
            println!("export KUBECONFIG={}", kubeconfig.display());
            Ok(())
        }
    }
}

async fn up_cmd(name: &str, args: UpArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut options = Options::new(name, Lifetime::Detached);
    options.apiserver_port = args.port.or_else(preferred_port);
    options.audit = args.audit;
    options.max_requests_inflight = args.max_requests_inflight;
    options.max_mutating_requests_inflight = args.max_mutating_requests_inflight;
    let cluster = controlplane::up(&options, &mut |line| eprintln!("{line}")).await?;
    eprintln!(
        "control plane ready in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let client = controlplane::client_from_kubeconfig(&cluster.kubeconfig).await?;
    let api: Api<Node> = Api::all(client.clone());
    // A restarted cluster keeps its etcd data, and with it the nodes made last time.
    let mut wanted = Vec::new();
    let mut missing = Vec::new();
    let mut ips = Vec::new();
    for i in 0..args.nodes {
        let node = format!("sim-{i}");
        if api.get_opt(&node).await?.is_none() {
            missing.push(node.clone());
            ips.push(controlplane::simulated_node_ip(i));
        }
        wanted.push(node);
    }
    nodes::create(&client, &missing, &ips, &BTreeMap::new()).await?;
    nodes::wait_ready(&client, &wanted, Duration::from_secs(60)).await?;
    eprintln!(
        "{} simulated node(s) Ready; cluster `{name}` up in {:.1}s (logs in {})",
        wanted.len(),
        started.elapsed().as_secs_f64(),
        cluster.state_dir.join("logs").display()
    );
    if let Some(audit) = cluster.audit_log() {
        eprintln!("audit log: {}", audit.display());
    }
    eprintln!(
        "kubectl: {}",
        controlplane::binaries::ensure(&mut |_| {})?
            .path("kubectl")
            .display()
    );
    println!("export KUBECONFIG={}", cluster.kubeconfig.display());
    Ok(())
}

/// The conventional port when it is free; otherwise `None`, and `up` keeps the port this cluster
/// had or picks a free one — so a second user (or a second cluster) on the machine does not fail
/// on a fixed 6443.
fn preferred_port() -> Option<u16> {
    const CONVENTIONAL: u16 = 6443;
    if nodekeeper_testkit::net::port_is_free(std::net::Ipv4Addr::LOCALHOST, CONVENTIONAL) {
        Some(CONVENTIONAL)
    } else {
        eprintln!("port {CONVENTIONAL} is taken; kube-apiserver gets another (see the kubeconfig)");
        None
    }
}

fn down_cmd(name: &str, purge: bool) -> anyhow::Result<()> {
    let stopped = controlplane::down(name, purge)?;
    for component in &stopped {
        println!("stopped {} (pid {})", component.name, component.pid);
    }
    if stopped.is_empty() {
        println!("cluster `{name}`: nothing was running");
    }
    if purge {
        println!("removed {}", controlplane::state_dir(name).display());
    }
    Ok(())
}

async fn status_cmd(name: &str) -> anyhow::Result<()> {
    let state = controlplane::read_state(name)?;
    let dir = controlplane::state_dir(name);
    println!(
        "cluster `{name}`: https://127.0.0.1:{}  state {}",
        state.ports.apiserver,
        dir.display()
    );
    if state.components.is_empty() {
        println!("  stopped (start it with `cargo xtask cluster up`)");
        return Ok(());
    }
    let mut apiserver_up = false;
    for c in &state.components {
        let running = c.is_running();
        apiserver_up |= running && c.name == "kube-apiserver";
        println!(
            "  {:<24} pid {:<8} {}",
            c.name,
            c.pid,
            if running { "running" } else { "NOT RUNNING" }
        );
    }
    if !apiserver_up {
        return Ok(());
    }
    let client = controlplane::client_from_kubeconfig(&dir.join("kubeconfig")).await?;
    let list = Api::<Node>::all(client)
        .list(&ListParams::default().labels(&format!("{}=true", nodes::SIMULATED_LABEL)))
        .await
        .context("list simulated nodes")?;
    println!("  simulated nodes: {}", list.items.len());
    for node in list.items.iter().take(50) {
        let ip = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
            .map(|a| a.address.as_str())
            .unwrap_or("-");
        let ready = if nodes::is_ready(node) {
            "Ready"
        } else {
            "NotReady"
        };
        println!(
            "    {:<24} {:<9} {ip}",
            node.metadata.name.as_deref().unwrap_or("?"),
            ready
        );
    }
    if list.items.len() > 50 {
        println!("    … and {} more", list.items.len() - 50);
    }
    Ok(())
}
