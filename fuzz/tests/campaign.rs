//! The fuzz campaign as part of the test suite: every target replays its regressions and corpus,
//! then mutates for a bounded time (`NODEKEEPER_FUZZ_SECONDS`, default 3 per target; at most
//! `NODEKEEPER_FUZZ_MAX_EXECS`, default 200,000) from a seed (`NODEKEEPER_FUZZ_SEED`, default
//! fixed so CI is reproducible; `cargo xtask fuzz` draws a fresh one). Longer campaigns:
//! `cargo xtask fuzz --seconds 600`.

use std::time::Duration;

use nodekeeper_fuzz::targets::ALL;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run(name: &str) {
    let target = ALL
        .iter()
        .find(|t| t.name == name)
        .expect("a target of that name");
    let seconds = env_u64("NODEKEEPER_FUZZ_SECONDS", 3);
    let max = env_u64("NODEKEEPER_FUZZ_MAX_EXECS", 200_000);
    let seed = env_u64("NODEKEEPER_FUZZ_SEED", 0x6e6f_6465_6b65_6570);
    match nodekeeper_fuzz::campaign(target, Duration::from_secs(seconds), max, seed) {
        Ok(stats) => eprintln!(
            "fuzz {name}: {} corpus inputs replayed, {} mutants in {:.1}s (seed {seed})",
            stats.replayed,
            stats.executions,
            stats.elapsed.as_secs_f64()
        ),
        Err(crash) => panic!("fuzz {name} (seed {seed}): {crash}"),
    }
}

#[test]
fn imds() {
    run("imds");
}

#[test]
fn tuning() {
    run("tuning");
}

#[test]
fn networktest() {
    run("networktest");
}

#[test]
fn netconf() {
    run("netconf");
}

#[test]
fn agent() {
    run("agent");
}

/// Every file under `fuzz/regressions/` (inputs that once failed, now fixed) passes its target.
#[test]
fn replay() {
    for target in ALL {
        let dir = nodekeeper_fuzz::fuzz_dir()
            .join("regressions")
            .join(target.name);
        for (path, input) in nodekeeper_fuzz::read_dir_files(&dir) {
            if let Err(message) = nodekeeper_fuzz::check(target, &input) {
                panic!("{}: {message}", path.display());
            }
        }
    }
}
