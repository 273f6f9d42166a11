//! `cargo xtask demo`: nodekeeper end to end on this machine — a local control plane with
//! simulated (kwok) nodes and nodekeeper installed from `deploy/` (CRDs, `kubectl apply -k`),
//! one real `nodekeeper-agent` process per node listening on the node's loopback InternalIP, the
//! real `nodekeeper-controller` acting as the ServiceAccount `deploy/` created (kwok runs no
//! containers, so the Deployment's and DaemonSet's work is done by these processes), the fleet
//! status and Node conditions the controller produces, and a network test across the fleet. As root, what the controller
//! knows is shown by the built `kubectl nodekeeper` plugin, which reaches the controller as it
//! would in a cluster: through the API server's service proxy (a network namespace stands in for
//! the controller Pod's network, `nodekeeper_e2e::rig::service_proxy`); otherwise the demo reads
//! the controller's HTTP API directly and runs `deploy/examples/networktest-mesh.yaml`.
//!
//! This file holds the entry point and what the demo has running; `steps.rs` the six steps,
//! started through the rig of `nodekeeper_e2e::rig` like the e2e tests and the fleet bench;
//! `print.rs` how what the controller and the API server answer is shown.
//!
//! Everything it starts dies with it (Ctrl-C included): the control plane and our own children
//! get SIGKILL from the kernel when this process ends (the harness's parent-death signal), and
//! a normal exit or Ctrl-C stops them first, by pid (and removes the network namespace). All
//! traffic stays on 127.0.0.0/8 and, as root, inside that namespace's veth pair (10.254.x.y/30).

// The demo's output is its purpose.
#![allow(clippy::print_stdout)]

mod print;
mod steps;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use clap::Args;
use nodekeeper_e2e::controlplane::Cluster;
use nodekeeper_e2e::rig::Process;
use nodekeeper_e2e::rig::service_proxy::ExposedController;

use crate::deps;

/// Where the controller runs and the demo's objects go.
const NAMESPACE: &str = "nodekeeper";
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
    /// The local control plane's name: its state and the demo's logs go in
    /// `${XDG_CACHE_HOME:-~/.cache}/nodekeeper/clusters/<name>/`. Another name runs a second demo
    /// beside one kept with --keep.
    #[arg(long, env = "NODEKEEPER_DEMO_NAME", default_value = "demo",
          value_parser = cluster_name)]
    name: String,
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

/// A control plane name: it becomes a directory and part of process names.
fn cluster_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 40
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-');
    if ok {
        Ok(s.to_owned())
    } else {
        Err("use 1–40 lowercase letters, digits and '-', not starting with '-'".into())
    }
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
        "Building nodekeeper-agent, nodekeeper-controller and kubectl-nodekeeper (cargo build)",
    );
    deps::ensure(deps::DEMO)?;
    let bins = build_binaries()?;
    println!(
        "    {}\n    {}\n    {}",
        bins.agent.display(),
        bins.controller.display(),
        bins.plugin.display()
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
            result = steps::steps(args, &bins, &mut running) => result,
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
    /// The `kubectl nodekeeper` plugin.
    plugin: PathBuf,
}

/// Builds the three binaries with cargo's output on the terminal, and takes their paths from
/// cargo's own report (which honours `CARGO_TARGET_DIR` and config).
fn build_binaries() -> Result<Binaries> {
    let [agent, controller, plugin] = crate::cargo::build_executables(
        &crate::codegen::repo_root(),
        &[
            "build",
            "-p",
            "nodekeeper-agent",
            "-p",
            "nodekeeper-controller",
            "-p",
            "kubectl-nodekeeper",
            "--bins",
        ],
        [
            "nodekeeper-agent",
            "nodekeeper-controller",
            "kubectl-nodekeeper",
        ],
    )?;
    Ok(Binaries {
        agent,
        controller,
        plugin,
    })
}

/// What the demo has running. Dropping it (any exit path) stops the children, then the
/// control plane (unless detached by --keep).
#[derive(Default)]
struct Running {
    children: Vec<Process>,
    cluster: Option<Cluster>,
    /// The controller behind the service proxy (as root).
    exposed: Option<ExposedController>,
}

impl Running {
    fn stop(&mut self) {
        // SIGTERM to all first so they shut down in parallel, then reap, SIGKILL on a deadline.
        for p in &mut self.children {
            p.terminate();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for p in &mut self.children {
            p.wait_or_kill(deadline);
        }
        self.children.clear();
        self.exposed = None;
        // A WithThisProcess cluster stops when dropped; a detached one stays.
        self.cluster = None;
    }

    /// Fails when a child has exited, naming it, its last log line and its log.
    fn check_alive(&mut self) -> Result<()> {
        for p in &mut self.children {
            p.check_alive()?;
        }
        Ok(())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop();
    }
}
