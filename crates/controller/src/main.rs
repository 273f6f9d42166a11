//! `nodekeeper-controller`: parses the command line and runs the controller. Exits non-zero when
//! it loses the Lease, so that the Pod restarts as a standby.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = nodekeeper_controller::Cli::parse();
    nodekeeper_controller::run(cli).await?;
    Ok(())
}
