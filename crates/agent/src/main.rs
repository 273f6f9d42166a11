//! `nodekeeper-agent`: parses flags, sets up logging and signals, and calls the library's `run` (or,
//! with `--cleanup`, the host cleanup of the uninstall).

use anyhow::Context as _;
use clap::Parser as _;
use nodekeeper_agent::cleanup::{self, CleanupArgs};
use nodekeeper_agent::config::{Config, LogFormat};
use tokio_util::sync::CancellationToken;

fn main() -> anyhow::Result<()> {
    if cleanup::requested() {
        return run_cleanup(CleanupArgs::parse());
    }
    let config = Config::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&config.log).context("parse --log")?;
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Plain => logs.init(),
    }
    // One thread serves a handful of calls a minute from one controller; it keeps RSS small.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async {
        let shutdown = CancellationToken::new();
        let on_signal = shutdown.clone();
        tokio::spawn(async move {
            signalled().await;
            on_signal.cancel();
        });
        nodekeeper_agent::run(config, shutdown)
            .await
            .context("nodekeeper-agent")
    })
}

/// Returns on SIGTERM or SIGINT.
async fn signalled() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// `--cleanup`: revert the host, then exit (or wait for a signal with `--cleanup-hold`).
#[allow(clippy::print_stdout)] // the cleanup's report is on stdout
fn run_cleanup(args: CleanupArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async {
        cleanup::run(&args)
            .await
            .context("nodekeeper-agent --cleanup")?;
        if args.cleanup_hold {
            println!("holding until stopped (--cleanup-hold)");
            signalled().await;
        }
        Ok(())
    })
}
