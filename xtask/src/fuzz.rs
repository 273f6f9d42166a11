//! `cargo xtask fuzz`: a longer run of the fuzz campaign (`fuzz/`) than the few seconds per
//! target the test suite gives it, from a fresh seed each time unless one is given. A failing
//! input lands in `fuzz/artifacts/<target>/`; fixed, it moves to `fuzz/regressions/<target>/`.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, bail};
use clap::Args;

/// The campaign's targets (the test names in `fuzz/tests/campaign.rs`).
pub const TARGETS: [&str; 5] = ["imds", "tuning", "networktest", "netconf", "agent"];

#[derive(Args)]
pub struct FuzzArgs {
    /// Only this target (imds, tuning, networktest, netconf, agent); all by default.
    #[arg(long, env = "NODEKEEPER_FUZZ_TARGET")]
    target: Option<String>,
    /// Seconds of mutation per target.
    #[arg(long, env = "NODEKEEPER_FUZZ_SECONDS", default_value_t = 60)]
    seconds: u64,
    /// The mutator's seed; a fresh one (printed) by default.
    #[arg(long, env = "NODEKEEPER_FUZZ_SEED")]
    seed: Option<u64>,
    /// Build optimised: several times more inputs per second, after a release build of every
    /// dependency (minutes on 2 cores the first time).
    #[arg(long, env = "NODEKEEPER_FUZZ_RELEASE")]
    release: bool,
}

pub fn run(args: FuzzArgs) -> Result<()> {
    if let Some(t) = &args.target
        && !TARGETS.contains(&t.as_str())
    {
        bail!(
            "--target {t:?} is not a fuzz target; use one of {}",
            TARGETS.join(", ")
        );
    }
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!(
        "xtask: fuzzing for {}s per target with seed {seed} (repeat with --seed {seed})",
        args.seconds
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = crate::cargo::command(&cargo);
    command.arg("test");
    if args.release {
        // Tests keep unwinding panics even in this profile, which the campaign needs to report
        // a failing input.
        command.arg("--release");
    }
    command.args(["-p", "nodekeeper-fuzz", "--test", "campaign", "--"]);
    match &args.target {
        Some(t) => command.args(["--exact", t.as_str()]),
        None => command.args(TARGETS),
    };
    command.args(["--nocapture", "--test-threads=1"]);
    command
        .env("NODEKEEPER_FUZZ_SECONDS", args.seconds.to_string())
        .env("NODEKEEPER_FUZZ_SEED", seed.to_string())
        .env("NODEKEEPER_FUZZ_MAX_EXECS", u64::MAX.to_string());
    let status = command.status().context("run the fuzz campaign")?;
    if !status.success() {
        bail!("the fuzz campaign found a failing input (seed {seed}); see above");
    }
    Ok(())
}
