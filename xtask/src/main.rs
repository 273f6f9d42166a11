//! `cargo xtask`: the project's own automation — code generation, the local control plane,
//! the VM used for VLAN tests, benchmarks and the demo.

mod codegen;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "nodekeeper project automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Regenerate the checked-in gRPC code (crates/api/src/generated) and CRDs (deploy/crds).
    Codegen,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Codegen => codegen::run(),
    }
}
