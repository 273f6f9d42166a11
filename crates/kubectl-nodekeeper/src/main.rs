//! `kubectl-nodekeeper`: parses the command line and runs it; the exit code says how it went
//! (see [`kubectl_nodekeeper::exit`]).

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    kubectl_nodekeeper::main(kubectl_nodekeeper::Cli::parse())
}
