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
