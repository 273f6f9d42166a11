//! Host prerequisites: the commands `cargo xtask test` and `cargo xtask demo` need from the machine,
//! and installing the Debian packages that provide them when we run as root.
//!
//! Everything else the project needs (the Kubernetes control plane, the VM kernel, nmstatectl,
//! node-problem-detector) is built or fetched from package registries by the xtask command that
//! uses it and cached outside the repository.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, Result, bail};

/// A command the project runs, and the Debian package that provides it.
#[derive(Debug, Clone, Copy)]
pub struct Requirement {
    pub command: &'static str,
    /// `None` for toolchains that do not come from Debian's packages on this project's machines.
    pub package: Option<&'static str>,
    pub why: &'static str,
}

/// What the full test suite needs.
pub const TEST: &[Requirement] = &[
    Requirement {
        command: "go",
        package: None,
        why: "builds the local Kubernetes control plane",
    },
    SETPRIV,
    Requirement {
        command: "ip",
        package: Some("iproute2"),
        why: "creates network namespaces for netlink tests",
    },
    Requirement {
        command: "qemu-system-x86_64",
        package: Some("qemu-system-x86"),
        why: "boots Debian's kernel for 802.1Q VLAN tests",
    },
    Requirement {
        command: "busybox",
        package: Some("busybox-static"),
        why: "the init of the VLAN test VM",
    },
    Requirement {
        command: "promtool",
        package: Some("prometheus"),
        why: "checks and unit-tests the chart's alert rules",
    },
    Requirement {
        command: "prometheus",
        package: Some("prometheus"),
        why: "scrapes a live controller and agent and answers the dashboard's queries",
    },
    // The VM's kernel comes from `apt-get download` (no install) and is unpacked with `dpkg-deb`;
    // its initramfs is packed by our own cpio writer, so neither needs a package of its own.
];

/// What the local demo needs.
pub const DEMO: &[Requirement] = &[
    Requirement {
        command: "go",
        package: None,
        why: "builds the local Kubernetes control plane",
    },
    SETPRIV,
];

/// What `cargo xtask image --smoke` needs: podman, and runc for hosts whose cgroups are mounted
/// in hybrid mode (v1 controllers beside a v2 `unified` tree), which Debian's default runtime
/// crun refuses ("cgroups in hybrid mode not supported").
pub const IMAGE_SMOKE: &[Requirement] = &[
    Requirement {
        command: "podman",
        package: Some("podman"),
        why: "loads and runs the images",
    },
    Requirement {
        command: "runc",
        package: Some("runc"),
        why: "runs containers where crun refuses the host's hybrid cgroups",
    },
];

/// The control plane's processes are started through `setpriv --pdeathsig` so they die with the
/// process that started them.
const SETPRIV: Requirement = Requirement {
    command: "setpriv",
    package: Some("util-linux"),
    why: "ties the control plane's lifetime to ours",
};

/// Makes sure every requirement is on `PATH`, installing missing Debian packages when running as
/// root with apt available; otherwise fails with one line naming the fix.
pub fn ensure(requirements: &[Requirement]) -> Result<()> {
    let missing: Vec<&Requirement> = requirements
        .iter()
        .filter(|r| which(r.command).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if let Some(r) = missing.iter().find(|r| r.package.is_none()) {
        bail!(
            "`{}` not found on PATH ({}): install the {} toolchain (version in xtask/controlplane/*/go.mod) and retry",
            r.command,
            r.why,
            r.command
        );
    }
    let mut packages: Vec<&str> = missing.iter().filter_map(|r| r.package).collect();
    packages.dedup();
    let install = format!(
        "apt-get install -y --no-install-recommends {}",
        packages.join(" ")
    );
    if !nodekeeper_testkit::is_root() || which("apt-get").is_none() {
        let needs: Vec<String> = missing
            .iter()
            .map(|r| format!("{} ({})", r.command, r.why))
            .collect();
        bail!(
            "missing {}: run `sudo apt-get update && sudo {install}` and retry",
            needs.join(", ")
        );
    }
    eprintln!("xtask: installing Debian packages: {}", packages.join(" "));
    run_apt(&["update", "-qq"])?;
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&packages);
    run_apt(&args)?;
    if let Some(r) = requirements.iter().find(|r| which(r.command).is_none()) {
        bail!(
            "`{}` is still missing after `{install}`: install it by hand and retry",
            r.command
        );
    }
    Ok(())
}

/// Oracle's Python SDK, the reference that `crates/oci/tests/signer_python.rs` compares our request
/// signatures with, pinned to the version the signing facts were checked against
/// (`shared/oci/compute-api.md` §6).
pub const PYTHON_OCI: &str = "oci==2.189.0";

/// Python with `venv`, for the virtual environment that holds [`PYTHON_OCI`].
const PYTHON3_VENV: Requirement = Requirement {
    command: "python3",
    package: Some("python3-venv"),
    why: "runs Oracle's Python SDK, the reference for OCI request signatures",
};

/// `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/python-oci`: the virtual environment the signer
/// test looks for (it finds it by the same rule).
pub fn python_oci_venv() -> PathBuf {
    nodekeeper_e2e::controlplane::binaries::cache_root().join("python-oci")
}

/// Makes sure [`python_oci_venv`] exists and imports `oci`, creating it and installing
/// [`PYTHON_OCI`] from PyPI when not. Part of what `cargo xtask test` installs.
pub fn ensure_python_oci() -> Result<()> {
    let venv = python_oci_venv();
    let python = venv.join("bin").join("python3");
    let imports = |python: &std::path::Path| {
        Command::new(python)
            .args(["-c", "import oci"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if imports(&python) {
        return Ok(());
    }
    ensure(&[PYTHON3_VENV])?;
    eprintln!("xtask: installing {PYTHON_OCI} into {}", venv.display());
    let status = Command::new("python3")
        .args(["-m", "venv", "--clear"])
        .arg(&venv)
        .status()
        .context("run python3 -m venv")?;
    if !status.success() {
        bail!(
            "`python3 -m venv {}` failed ({status}): install python3-venv (`apt-get install python3-venv`) and retry",
            venv.display()
        );
    }
    let status = Command::new(venv.join("bin").join("pip"))
        .args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            PYTHON_OCI,
        ])
        .status()
        .context("run pip install")?;
    if !status.success() || !imports(&python) {
        bail!(
            "`pip install {PYTHON_OCI}` into {} failed ({status}): check that PyPI is reachable and retry",
            venv.display()
        );
    }
    Ok(())
}

fn run_apt(args: &[&str]) -> Result<()> {
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("run apt-get")?;
    if !status.success() {
        bail!("`apt-get {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

/// The first executable named `command` on `PATH`.
pub fn which(command: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(command))
        .find(|candidate| {
            use std::os::unix::fs::PermissionsExt as _;
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_finds_sh_and_not_nonsense() {
        assert!(which("sh").is_some());
        assert!(which("nodekeeper-no-such-command").is_none());
    }

    #[test]
    fn missing_toolchain_is_one_line_with_the_fix() {
        let error = ensure(&[Requirement {
            command: "nodekeeper-no-such-go",
            package: None,
            why: "testing",
        }])
        .unwrap_err()
        .to_string();
        assert!(!error.contains('\n'), "{error}");
        assert!(
            error.contains("nodekeeper-no-such-go") && error.contains("install"),
            "{error}"
        );
    }
}
