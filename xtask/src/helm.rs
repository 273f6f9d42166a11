//! `cargo xtask helm -- ARGS`: the pinned Helm (`xtask/tools/helm/go.mod`), built once from its Go
//! module into `~/.cache/nodekeeper/tools/` the way the control plane is, so a user (and the
//! install tests) need no Helm of their own to lint, render or install `deploy/helm/nodekeeper`.

use anyhow::{Context as _, bail};
use clap::Args;
use nodekeeper_e2e::gotool;

#[derive(Args)]
pub struct HelmArgs {
    /// Helm's arguments, after `--`.
    #[arg(last = true)]
    args: Vec<String>,
}

pub fn run(args: HelmArgs) -> anyhow::Result<()> {
    crate::deps::ensure(&[crate::deps::Requirement {
        command: "go",
        package: None,
        why: "builds the pinned Helm",
    }])?;
    let helm = gotool::ensure(&gotool::HELM, &mut |line| eprintln!("xtask: {line}"))?;
    let status = std::process::Command::new(&helm)
        .args(&args.args)
        .current_dir(crate::codegen::repo_root())
        .status()
        .with_context(|| format!("run {}", helm.display()))?;
    if !status.success() {
        bail!("helm {} failed ({status})", args.args.join(" "));
    }
    Ok(())
}
