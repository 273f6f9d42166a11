//! Running cargo from inside `cargo xtask`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// A `cargo` command without the variables `cargo run` put into xtask's own environment.
///
/// Cargo sets `CARGO_MANIFEST_DIR`, `CARGO_PKG_*` and friends for the program it runs. Passed on
/// to a nested cargo, they reach build scripts (ring's reruns when `CARGO_MANIFEST_DIR` changes),
/// so the nested build and the next ordinary build each rebuild ring, rustls, kube and their
/// dependents.
pub fn command(cargo: &str) -> Command {
    let mut command = Command::new(cargo);
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_BIN_",
            "CARGO_CRATE_",
        ]
        .iter()
        .any(|prefix| key.starts_with(prefix))
            || key == "CARGO_PRIMARY_PACKAGE"
        {
            command.env_remove(key);
        }
    }
    command
}

/// Runs `cargo <args>` in `root` (compiler output on the terminal) and returns the executables
/// cargo reports for the named targets, in the order of `names`. Cargo's own report honours
/// `CARGO_TARGET_DIR`, profiles and config, so no path is guessed.
pub fn build_executables<const N: usize>(
    root: &Path,
    args: &[&str],
    names: [&str; N],
) -> anyhow::Result<[PathBuf; N]> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = command(&cargo)
        .current_dir(root)
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("run {cargo} {}", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "`cargo {}` failed; see the compiler output above",
            args.join(" ")
        );
    }
    let messages: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let find = |name: &str| {
        messages
            .iter()
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .with_context(|| format!("`cargo {}` named no executable for {name}", args.join(" ")))
    };
    let mut found = Vec::with_capacity(N);
    for name in names {
        found.push(find(name)?);
    }
    Ok(found.try_into().expect("one path per name"))
}
