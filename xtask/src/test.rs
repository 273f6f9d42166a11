//! `cargo xtask test`: the whole test suite — the one command CI runs.
//!
//! It installs missing host prerequisites, builds the pinned control plane if the cache lacks it,
//! starts **one** control plane for the whole run, and runs `cargo test --workspace` with
//! `NODEKEEPER_TEST_KUBECONFIG` pointing at it, so every test binary shares it instead of starting
//! its own. The control plane dies with this process however the run ends.

use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use clap::Args;
use nodekeeper_e2e::{KUBECONFIG_ENV, Lifetime, Options, controlplane};

use crate::deps;

#[derive(Args)]
pub struct TestArgs {
    /// Arguments for `cargo test`, after `--`: e.g. `-- -p nodekeeper-agent` for one package, or
    /// `-- -p nodekeeper-e2e -- pdb` for the tests whose names contain `pdb`.
    #[arg(last = true)]
    cargo_args: Vec<String>,
}

pub fn run(args: TestArgs) -> Result<()> {
    let started = Instant::now();
    deps::ensure(deps::TEST)?;
    deps::ensure_python_oci()?;
    if !nodekeeper_testkit::is_root() {
        eprintln!(
            "xtask: not running as root: network-namespace and VM tests will report SKIPPED (CI runs them as root)"
        );
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let name = format!("test-suite-{}", std::process::id());
    let options = Options::new(name.clone(), Lifetime::WithThisProcess);
    let mut cluster = runtime
        .block_on(controlplane::up(&options, &mut |line| {
            eprintln!("xtask: {line}")
        }))
        .context("start the test control plane")?;
    eprintln!(
        "xtask: control plane `{name}` ready at {} after {:.0}s; running the test suite",
        cluster.apiserver_url(),
        started.elapsed().as_secs_f64()
    );

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = crate::cargo::command(&cargo);
    command.args(["test", "--no-fail-fast"]);
    // The whole workspace unless the arguments pick packages (`-- -p nodekeeper-e2e --test x`).
    let picks_packages = args
        .cargo_args
        .iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "-p" || a == "--package" || a.starts_with("--package="));
    if !picks_packages {
        command.arg("--workspace");
    }
    command.args(&args.cargo_args);
    command.env(KUBECONFIG_ENV, &cluster.kubeconfig);
    // The fuzz campaign (fuzz/tests/campaign.rs) runs with the suite: a bounded few seconds per
    // target from a fixed seed, so CI is repeatable; `cargo xtask fuzz` runs it longer.
    if std::env::var_os("NODEKEEPER_FUZZ_SECONDS").is_none() {
        command.env("NODEKEEPER_FUZZ_SECONDS", "5");
    }
    let status = command.status().context("run cargo test")?;

    cluster.stop();
    let _ = controlplane::down(&name, true);
    eprintln!(
        "xtask: test suite finished in {:.0}s ({status})",
        started.elapsed().as_secs_f64()
    );
    if !status.success() {
        bail!("the test suite failed; see the failing tests above");
    }
    Ok(())
}
