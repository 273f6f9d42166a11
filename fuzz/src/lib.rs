//! Fuzz targets for every input nodekeeper takes from outside, and the bounded campaign that
//! runs them in the ordinary test suite (`cargo xtask test`, which CI runs) and for longer with
//! `cargo xtask fuzz`.
//!
//! Why not cargo-fuzz: it needs a nightly toolchain and libFuzzer built with the sanitizer
//! runtime; CI and the development machines build with stable Rust only, and a second, nightly
//! build of the agent and the controller would double the build on a 2-core machine. So the
//! campaign is structure-aware but coverage-less: each target starts from checked-in seeds (its
//! `corpus/<target>/` files and the seeds built in code), applies seeded random mutations (byte
//! flips, splices, dictionary tokens such as `169.254.169.254`, multibyte characters, huge
//! numbers) for a time budget, and checks the target's invariants on every input — not only
//! "does not panic" but what the input must never achieve (an address outside the policy
//! planned, an object nodekeeper does not own deleted, rules the controller accepts and an agent
//! with the keys refuses). A failing input is written to `fuzz/artifacts/<target>/` and the run
//! fails naming it; fixed ones move to `fuzz/regressions/<target>/`, replayed on every run.
//! Runs are reproducible: the seed is printed and can be given back (`NODEKEEPER_FUZZ_SEED`).

pub mod mutate;
pub mod targets;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use mutate::Rng;

/// One fuzz target.
pub struct Target {
    pub name: &'static str,
    /// Checks one input; panics (an assertion or a bug) on a violation.
    pub run: fn(&[u8]),
    /// Inputs that reach deep into the target, besides the corpus files.
    pub seeds: fn() -> Vec<Vec<u8>>,
    /// Tokens the mutator inserts.
    pub dictionary: &'static [&'static str],
    /// Inputs longer than this are cut (the targets' own limits are far below).
    pub max_len: usize,
}

/// `fuzz/` in this checkout.
pub fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// The files of `dir`, sorted by name (a missing directory is empty).
pub fn read_dir_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter_map(|p| std::fs::read(&p).ok().map(|b| (p, b)))
        .collect();
    out.sort();
    out
}

/// What a campaign did.
#[derive(Debug, Default)]
pub struct Stats {
    pub replayed: usize,
    pub executions: u64,
    pub elapsed: Duration,
}

/// A failing input: where it was written and what the target said.
#[derive(Debug)]
pub struct Crash {
    pub artifact: PathBuf,
    pub message: String,
}

impl std::fmt::Display for Crash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\ninput written to {} — reproduce with `cargo test -p nodekeeper-fuzz --test campaign -- --exact replay --nocapture` after copying it to fuzz/regressions/<target>/, then fix and keep it there",
            self.message,
            self.artifact.display()
        )
    }
}

/// Runs `input` through `target`, turning a panic into its message.
pub fn check(target: &Target, input: &[u8]) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (target.run)(input))).map_err(
        |payload| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panic without a message".to_owned())
        },
    )
}

fn save_crash(target: &Target, input: &[u8], message: String) -> Crash {
    use sha2::Digest as _;
    let dir = fuzz_dir().join("artifacts").join(target.name);
    let name = format!("crash-{}", &hex::encode(sha2::Sha256::digest(input))[..16]);
    let artifact = dir.join(name);
    let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&artifact, input));
    Crash { artifact, message }
}

/// Replays the regressions and the corpus, then mutates for `budget` (or `max_executions`) from
/// `seed`. Stops at the first failing input.
pub fn campaign(
    target: &Target,
    budget: Duration,
    max_executions: u64,
    seed: u64,
) -> Result<Stats, Crash> {
    let started = Instant::now();
    let mut stats = Stats::default();
    let dir = fuzz_dir();
    let mut pool: Vec<Vec<u8>> = (target.seeds)();
    for sub in ["regressions", "corpus"] {
        pool.extend(
            read_dir_files(&dir.join(sub).join(target.name))
                .into_iter()
                .map(|(_, b)| b),
        );
    }
    for input in &pool {
        stats.replayed += 1;
        if let Err(message) = check(target, input) {
            return Err(save_crash(target, input, message));
        }
    }
    if pool.is_empty() {
        pool.push(Vec::new());
    }
    let mut rng = Rng::new(seed);
    while started.elapsed() < budget && stats.executions < max_executions {
        let base = &pool[rng.below(pool.len())];
        let input = mutate::mutate(&mut rng, base, &pool, target.dictionary, target.max_len);
        stats.executions += 1;
        if let Err(message) = check(target, &input) {
            return Err(save_crash(target, &input, message));
        }
    }
    stats.elapsed = started.elapsed();
    Ok(stats)
}
