//! Go tools the tests run besides the control plane (Helm), each pinned by a Go module under
//! `xtask/tools/<name>/`, built once with the machine's Go toolchain the way the control plane
//! is (`controlplane::binaries`) and cached under `~/.cache/nodekeeper/tools/`, keyed by the
//! pinned version and a hash of the module's `go.mod`/`go.sum`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use nix::fcntl::{Flock, FlockArg};
use sha2::{Digest as _, Sha256};

use crate::controlplane::binaries::{cache_root, required_version};

/// One pinned Go command.
#[derive(Debug, Clone, Copy)]
pub struct GoTool {
    /// File name of the binary.
    pub name: &'static str,
    /// Directory under `xtask/tools/` holding the pinning `go.mod`.
    pub module: &'static str,
    /// Go module whose required version names the cache directory.
    pub pin: &'static str,
    /// Go package path of the `main` package.
    pub package: &'static str,
    /// Rough cold build time on a 2-core machine, shown so a first run does not look hung.
    pub cold_minutes: u32,
}

/// Helm, for `helm lint` / `helm template` of `deploy/helm/nodekeeper`.
pub const HELM: GoTool = GoTool {
    name: "helm",
    module: "helm",
    pin: "helm.sh/helm/v3",
    package: "helm.sh/helm/v3/cmd/helm",
    cold_minutes: 8,
};

/// `xtask/tools/` in this checkout.
pub fn tools_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("xtask")
        .join("tools")
}

/// The cached binary of `tool`, built first when missing. Concurrent callers serialise on a
/// lock file; `progress` receives a line when a build starts and ends.
pub fn ensure(tool: &GoTool, progress: &mut dyn FnMut(&str)) -> anyhow::Result<PathBuf> {
    let module_dir = tools_dir().join(tool.module);
    let go_mod = fs::read_to_string(module_dir.join("go.mod"))
        .with_context(|| format!("read {}/go.mod", module_dir.display()))?;
    let go_sum = fs::read_to_string(module_dir.join("go.sum"))
        .with_context(|| format!("read {}/go.sum", module_dir.display()))?;
    let version = required_version(&go_mod, tool.pin).with_context(|| {
        format!(
            "{}/go.mod does not require {}",
            module_dir.display(),
            tool.pin
        )
    })?;
    let mut hasher = Sha256::new();
    hasher.update(go_mod.as_bytes());
    hasher.update(go_sum.as_bytes());
    let hash = hex::encode(&hasher.finalize()[..6]);
    let dir = cache_root()
        .join("tools")
        .join(format!("{}-{version}-{hash}", tool.name));
    let binary = dir.join(tool.name);
    if binary.is_file() {
        return Ok(binary);
    }
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".build.lock"))
        .context("open the build lock")?;
    let _lock = Flock::lock(lock, FlockArg::LockExclusive)
        .map_err(|(_, errno)| anyhow::anyhow!("lock {}: {errno}", dir.display()))?;
    if binary.is_file() {
        return Ok(binary);
    }
    progress(&format!(
        "building {} {version} from its Go module into {} (~{} minutes on 2 cores the first time)…",
        tool.name,
        dir.display(),
        tool.cold_minutes
    ));
    let partial = dir.join(format!(".{}.partial", tool.name));
    let out = Command::new("go")
        .args(["build", "-trimpath", "-o"])
        .arg(&partial)
        .arg(tool.package)
        .current_dir(&module_dir)
        // The repository is not a Go workspace; a GOWORK from the environment must not leak in.
        .env("GOWORK", "off")
        .stdin(Stdio::null())
        .output()
        .context("run `go build`: install the Go toolchain (version in xtask/tools/*/go.mod)")?;
    let _ = fs::write(dir.join("build.log"), &out.stderr);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        bail!(
            "go build {} failed ({}):\n{}",
            tool.package,
            out.status,
            lines[lines.len().saturating_sub(15)..].join("\n")
        );
    }
    fs::rename(&partial, &binary).with_context(|| format!("move to {}", binary.display()))?;
    progress(&format!("built {}", binary.display()));
    Ok(binary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helm_pin_is_readable() {
        let go_mod = fs::read_to_string(tools_dir().join(HELM.module).join("go.mod")).unwrap();
        let version = required_version(&go_mod, HELM.pin).expect("helm is pinned");
        assert!(version.starts_with("v3."), "{version}");
    }
}
