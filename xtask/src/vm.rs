//! `cargo xtask vm`: caches the Debian kernel and modules the 802.1Q VLAN tests boot under qemu,
//! and can boot a smoke check or any host binary in that VM. The launcher itself lives in
//! `crates/netconf/tests/vm/mod.rs`, shared with the VLAN test, so there is one implementation.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;

#[path = "../../crates/netconf/tests/vm/mod.rs"]
mod launcher;

#[derive(Debug, Args)]
pub struct VmArgs {
    /// Resolve `linux-image-amd64` again and re-download when it points at a newer kernel.
    #[arg(long, env = "NODEKEEPER_VM_REFRESH")]
    refresh: bool,
    /// After preparing, boot the VM and create a dummy → macvlan → 802.1Q VLAN stack with busybox
    /// `ip`, proving the kernel, modules and initramfs work without any Rust test binary.
    #[arg(long, env = "NODEKEEPER_VM_SMOKE")]
    smoke: bool,
    /// Boot this host binary (copied with the libraries `ldd` lists) as the guest program.
    #[arg(long, env = "NODEKEEPER_VM_RUN", conflicts_with = "smoke")]
    run: Option<PathBuf>,
    /// Seconds to wait for the guest's verdict before killing qemu.
    #[arg(long, env = "NODEKEEPER_VM_TIMEOUT", default_value_t = 120)]
    timeout: u64,
    /// Arguments for the `--run` binary.
    #[arg(last = true)]
    args: Vec<String>,
}

/// The busybox shell script the smoke boot runs: the bare-metal stack built with busybox `ip`
/// (which has no `-d`, hence the read-back through `/proc/net/vlan/config`).
const SMOKE_SCRIPT: &str = "set -e
ip link add name nic0 type dummy
ip link set nic0 mtu 9000 up
ip link add link nic0 name vnic0 type macvlan
ip link set vnic0 address 02:00:17:00:00:05 mtu 9000 up
ip link add link vnic0 name vnic0.100 type vlan id 100
ip link set vnic0.100 mtu 9000 up
cat /proc/net/vlan/config
grep -Eq '^vnic0[.]100 +[|] 100 +[|] vnic0$' /proc/net/vlan/config
ip link show vnic0.100 | grep -q 'mtu 9000'
ip link show vnic0.100 | grep -q '02:00:17:00:00:05'
echo 'smoke: 802.1Q VLAN 100 on macvlan vnic0 on dummy nic0 is up with MTU 9000'
";

pub fn run(args: VmArgs) -> Result<()> {
    if let Some(reason) = launcher::missing_host_tool() {
        bail!("{reason}");
    }
    let kernel = launcher::prepare_kernel(args.refresh)?;
    eprintln!(
        "kernel {} at {}; modules in load order: {}",
        kernel.package,
        kernel.vmlinuz.display(),
        kernel
            .modules
            .iter()
            .filter_map(|m| m.file_name()?.to_str())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let program = if args.smoke {
        let busybox = launcher::find_busybox().ok_or_else(|| {
            anyhow::anyhow!("busybox is not installed; fix: {}", launcher::BUSYBOX_FIX)
        })?;
        launcher::GuestProgram {
            binary: busybox,
            args: vec!["sh".into(), "-c".into(), SMOKE_SCRIPT.into()],
            env: Vec::new(),
        }
    } else if let Some(binary) = args.run {
        launcher::GuestProgram {
            binary,
            args: args.args,
            env: Vec::new(),
        }
    } else {
        return Ok(());
    };
    let outcome = launcher::run_in_vm(&program, Duration::from_secs(args.timeout), true)?;
    let accel = if outcome.kvm { "kvm" } else { "tcg" };
    match outcome.exit_code() {
        Some(0) => {
            eprintln!(
                "vm: guest program succeeded; boot to verdict {:.1} s ({accel})",
                outcome.boot_to_verdict.as_secs_f64()
            );
            Ok(())
        }
        _ => bail!(
            "vm: guest verdict {:?} after {:.1} s ({accel}); console tail:\n{}",
            outcome.verdict,
            outcome.boot_to_verdict.as_secs_f64(),
            launcher::console_tail(&outcome.console, 40)
        ),
    }
}
