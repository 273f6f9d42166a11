//! `cargo xtask`: the project's own automation — code generation, the local control plane,
//! the VM used for VLAN tests, benchmarks and the demo.

// A command-line tool: its reports (benchmark sections, `cluster env`) are its standard output.
#![allow(clippy::print_stdout)]

mod bench_agent;
mod bench_drain;
mod bench_fleet;
mod bench_netconf;
mod bench_networktest;
mod bench_nodeset;
mod bench_soak;
mod bench_vnic;
mod benchmarks;
mod cargo;
mod cluster;
mod codegen;
mod demo;
mod deps;
mod fleet_rig;
mod fuzz;
mod helm;
mod image;
mod layering;
mod test;
mod vm;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "nodekeeper project automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Regenerate the checked-in gRPC code (crates/proto/src/generated) and CRDs (deploy/crds).
    Codegen(codegen::CodegenArgs),
    /// The local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok) on 127.0.0.1.
    Cluster(cluster::ClusterArgs),
    /// Cache Debian's kernel and modules for the 802.1Q VLAN tests under qemu; optionally boot it.
    Vm(vm::VmArgs),
    /// Benchmarks: print figures and update their section of BENCHMARKS.md.
    #[command(subcommand)]
    Bench(Bench),
    /// Run the whole test suite against one freshly started local control plane (what CI runs).
    /// Run as root so that network-namespace and VM tests run instead of reporting SKIPPED.
    Test(test::TestArgs),
    /// Run nodekeeper end to end on this machine: a local control plane with simulated nodes, a
    /// real agent per node, the controller, the fleet summary and a NetworkTest.
    Demo(demo::DemoArgs),
    /// Run the fuzz campaign (fuzz/) for longer than the test suite does, from a fresh seed.
    Fuzz(fuzz::FuzzArgs),
    /// Build reproducible OCI image archives of the agent and the controller (static musl
    /// binaries on an empty base, from deploy/images/*.Containerfile), without a container daemon.
    Image(image::ImageArgs),
    /// Run the pinned Helm (built from xtask/tools/helm into ~/.cache/nodekeeper), e.g.
    /// `cargo xtask helm -- template nodekeeper deploy/helm/nodekeeper -n nodekeeper`.
    Helm(helm::HelmArgs),
}

#[derive(Subcommand)]
enum Bench {
    /// The node agent: idle/loaded RSS, CPU, GetReport latency, binary size; vs node-problem-detector.
    Agent(bench_agent::AgentArgs),
    /// The controller against N kwok nodes with N real agents: sweep time, RSS, CPU, API requests.
    Fleet(bench_fleet::FleetArgs),
    /// A peers-mesh NetworkTest over N simulated nodes: time to Succeeded, status writes, CPU.
    Networktest(bench_networktest::NetworkTestArgs),
    /// Host network configuration: apply, no-op re-apply and rollback of N VNICs vs nmstatectl.
    Netconf(bench_netconf::NetconfArgs),
    /// A NodeMaintenance draining N kwok nodes behind PDBs: time vs the PDB bound, requests per pod.
    Drain(bench_drain::DrainArgs),
    /// One NodeNetworkConfig attaching a VNIC to N kwok nodes: time, cloud calls, API writes.
    Vnic(bench_vnic::VnicArgs),
    /// A kwok NodeSet scaled 0 → N → 0 (drained): time, API writes and provider calls per node, RSS.
    Nodeset(bench_nodeset::NodesetArgs),
    /// N kwok nodes with N real agents for M minutes, agents flapping at random: RSS over time, writes vs budget.
    Soak(bench_soak::SoakArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Codegen(args) => codegen::run(&args),
        Command::Cluster(args) => cluster::run(args),
        Command::Vm(args) => vm::run(args),
        Command::Test(args) => test::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Fuzz(args) => fuzz::run(args),
        Command::Image(args) => image::run(args),
        Command::Helm(args) => helm::run(args),
        Command::Bench(Bench::Agent(args)) => bench_agent::run(args),
        Command::Bench(Bench::Fleet(args)) => bench_fleet::run(args),
        Command::Bench(Bench::Networktest(args)) => bench_networktest::run(args),
        Command::Bench(Bench::Netconf(args)) => bench_netconf::run_bench(args),
        Command::Bench(Bench::Drain(args)) => bench_drain::run(args),
        Command::Bench(Bench::Vnic(args)) => bench_vnic::run(args),
        Command::Bench(Bench::Nodeset(args)) => bench_nodeset::run(args),
        Command::Bench(Bench::Soak(args)) => bench_soak::run(args),
    }
}
