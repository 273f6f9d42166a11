//! Running cargo from inside `cargo xtask`.

use std::process::Command;

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
