//! The `kubectl nodekeeper` plugin: one command line for nodekeeper that talks only to the API
//! server — custom resources directly, the controller's HTTP API through the API server's
//! service proxy — and never to an agent.
//!
//! Each verb is a module with an `Args` struct and an `async fn run`; adding a verb means a
//! module and one variant of [`cli::Command`].

pub mod cli;
pub mod connect;
pub mod controller_api;
pub mod diag;
pub mod error;
pub mod live;
pub mod maintain;
pub mod named_nodes;
pub mod netcheck;
pub mod node;
pub mod render;
pub mod selector;
pub mod status;
pub mod targets;

#[cfg(test)]
mod golden;

use std::io::Write as _;
use std::process::ExitCode;

pub use cli::Cli;
pub use error::Error;

/// Exit codes, as documented in `--help`.
pub mod exit {
    /// Done, and what was checked is fine.
    pub const OK: u8 = 0;
    /// Done, and what was checked failed (a netcheck with failing pairs, a drain that timed
    /// out, a bundle that could not be collected).
    pub const FAILED: u8 = 1;
    /// Not done: bad usage, no connection, no permission, an object refused, the controller not
    /// reachable.
    pub const ERROR: u8 = 2;
    /// Interrupted (Ctrl-C) before the result was in.
    pub const INTERRUPTED: u8 = 130;
}

/// How a verb that ran to its end went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Failed,
    Interrupted,
}

/// Runs `cli` and returns the process's exit code; errors are printed as one line on stderr.
pub fn main(cli: Cli) -> ExitCode {
    if let cli::Command::Completion(args) = &cli.command {
        let mut command = <Cli as clap::CommandFactory>::command();
        let mut out = Vec::new();
        clap_complete::generate(args.shell, &mut command, "kubectl-nodekeeper", &mut out);
        return match std::io::stdout().lock().write_all(&out) {
            Ok(()) => ExitCode::from(exit::OK),
            Err(error) => report(&Error::WriteOutput(error)),
        };
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => return report(&Error::StartRuntime(error)),
    };
    match runtime.block_on(run(cli)) {
        Ok(Outcome::Ok) => ExitCode::from(exit::OK),
        Ok(Outcome::Failed) => ExitCode::from(exit::FAILED),
        Ok(Outcome::Interrupted) => ExitCode::from(exit::INTERRUPTED),
        // A reader that went away (`| head`) is not an error worth a message.
        Err(Error::WriteOutput(error)) if error.kind() == std::io::ErrorKind::BrokenPipe => {
            ExitCode::from(exit::OK)
        }
        Err(error) => report(&error),
    }
}

fn report(error: &Error) -> ExitCode {
    let _ = writeln!(std::io::stderr().lock(), "error: {error}");
    ExitCode::from(exit::ERROR)
}

/// Runs one verb.
pub async fn run(cli: Cli) -> Result<Outcome, Error> {
    let out = render::Output::new(cli.global.output);
    if let cli::Command::Completion(_) = cli.command {
        return Ok(Outcome::Ok);
    }
    let conn = connect::connect(&cli.global).await?;
    match cli.command {
        cli::Command::Status(args) => status::run(&conn, &args, &out).await,
        cli::Command::Node(args) => node::run(&conn, &args, &out).await,
        cli::Command::Netcheck(args) => netcheck::run(&conn, &args, &out).await,
        cli::Command::Maintain(args) => maintain::run(&conn, &args, &out).await,
        cli::Command::Diag(args) => diag::run(&conn, &args, &out).await,
        cli::Command::Completion(_) => Ok(Outcome::Ok),
    }
}
