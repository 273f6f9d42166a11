//! The OCI bare-metal VNIC layout (macvlan with the VNIC's MAC on the NIC, an 802.1Q VLAN on the
//! macvlan, address, own routing table and `from` rule, MTU 9000) on a real 802.1Q kernel: this
//! machine's kernel has no VLAN support, so the test boots Debian's kernel under qemu with an
//! initramfs holding this very test binary, which runs the guest half and reports on the serial
//! console.

mod vm;

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

/// The test's own name, which the guest run selects with `--exact`.
const TEST_NAME: &str = "bare_metal_vnic_layout_on_a_real_8021q_kernel";

/// Printed by the guest half when every check passed; the host requires it besides exit status 0,
/// so a guest run that selected no test (and so "passed") cannot count as a pass.
const GUEST_OK: &str = "NODEKEEPER-VLAN-GUEST-OK";

/// Generous for TCG software emulation on a busy 2-core machine, where boot to verdict took
/// 14–33 s; qemu is killed when it passes.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn bare_metal_vnic_layout_on_a_real_8021q_kernel() -> Result<()> {
    if std::env::var_os(vm::GUEST_ENV).is_some() {
        return guest::run();
    }
    nodekeeper_testkit::skip_unless_root!("needs root (qemu, apt-get download of the kernel)");
    if let Some(reason) = vm::missing_host_tool() {
        nodekeeper_testkit::skip!(reason);
    }
    let program = vm::GuestProgram {
        binary: std::env::current_exe().context("locate this test binary")?,
        args: vec![
            TEST_NAME.into(),
            "--exact".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ],
        env: vec![("RUST_BACKTRACE".into(), "0".into())],
    };
    let echo = std::env::var_os("NODEKEEPER_VM_ECHO").is_some();
    let outcome = vm::run_in_vm(&program, BOOT_TIMEOUT, echo)?;
    let accel = if outcome.kvm { "kvm" } else { "tcg" };
    eprintln!(
        "vm: verdict {:?} after {:.1} s from qemu start ({accel})",
        outcome.verdict,
        outcome.boot_to_verdict.as_secs_f64()
    );
    let tail = vm::console_tail(&outcome.console, 60);
    ensure!(
        outcome.verdict.is_some(),
        "no verdict from the guest within {BOOT_TIMEOUT:?}; console:\n{tail}"
    );
    ensure!(
        outcome.exit_code() == Some(0),
        "guest failed ({:?}); console:\n{tail}",
        outcome.verdict
    );
    ensure!(
        outcome.console.contains(GUEST_OK),
        "guest exited 0 but never printed {GUEST_OK} (did it run the test?); console:\n{tail}"
    );
    Ok(())
}

/// The half that runs inside the VM, as root, with the guest's network namespaces to itself.
///
/// Layout under test: the bare-metal shape of OCI's `vnics-bm.json` sample (what
/// `nodekeeper_oci::layout::secondary_vnics` produces for it): VNIC 1 (`vlanTag` 21, `nicIndex` 0)
/// and VNIC 2 (`vlanTag` 37, `nicIndex` 1). Physical NIC 0 is a veth whose peer sits in a second
/// namespace playing OCI's virtual router on VLAN 21 only, so the post-apply reachability check
/// answers only if frames really leave tagged 21; NIC 1 is a dummy.
mod guest {
    use super::*;

    use std::net::{IpAddr, Ipv4Addr};
    use std::os::fd::AsRawFd;

    use futures::TryStreamExt;
    use netlink_packet_route::link::{
        InfoData, InfoKind, InfoVlan, LinkAttribute, LinkInfo, LinkMessage, VlanProtocol,
    };
    use nodekeeper_model::network::NetworkState;
    use nodekeeper_netconf::{ApplyOptions, Netconf, Observed, Outcome, Target};
    use nodekeeper_testkit::Netns;
    use pretty_assertions::assert_eq;
    use rtnetlink::{LinkDummy, LinkUnspec, LinkVeth, LinkVlan};

    const MTU: u32 = 9000;

    /// The desired state, exactly as the OCI layout writes it for the bare-metal sample.
    fn desired() -> Result<NetworkState> {
        let state: NetworkState = serde_json::from_str(
            r#"{
              "links": [
                {"name": "nkm21", "kind": "macvlan", "mac": "02:00:17:1b:08:21", "parent": "nic0",
                 "macvlanMode": "bridge", "mtu": 9000, "up": true},
                {"name": "nkv21", "kind": "vlan", "parent": "nkm21", "vlanId": 21, "mtu": 9000, "up": true},
                {"name": "nkm37", "kind": "macvlan", "mac": "02:00:17:1b:10:09", "parent": "nic1",
                 "macvlanMode": "bridge", "mtu": 9000, "up": true},
                {"name": "nkv37", "kind": "vlan", "parent": "nkm37", "vlanId": 37, "mtu": 9000, "up": true}
              ],
              "addresses": [
                {"link": "nkv21", "cidr": "10.1.8.21/22"},
                {"link": "nkv37", "cidr": "10.1.16.9/24"}
              ],
              "routes": [
                {"destination": "default", "gateway": "10.1.8.1", "link": "nkv21", "table": 101},
                {"destination": "default", "gateway": "10.1.16.1", "link": "nkv37", "table": 102}
              ],
              "rules": [
                {"to": "169.254.0.0/16", "table": 254, "priority": 20100},
                {"from": "10.1.8.21/32", "table": 101, "priority": 20101},
                {"from": "10.1.16.9/32", "table": 102, "priority": 20102}
              ]
            }"#,
        )?;
        if let Err(errors) = state.validate() {
            bail!(
                "test layout is invalid: {}",
                nodekeeper_model::network::format_errors(&errors)
            );
        }
        Ok(state)
    }

    pub fn run() -> Result<()> {
        // IPv6 duplicate address detection would change address flags between two reads.
        for knob in ["all", "default"] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{knob}/accept_dad"), "0")?;
        }
        // OCI's virtual router; anonymous, since the guest has no iproute2.
        let router = Netns::anonymous()?;
        block_on(setup_nics(&router))?;
        router.run(setup_router)?;
        block_on(exercise())?;
        // Printed only when every check above passed.
        eprintln!("{GUEST_OK}");
        Ok(())
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("build a tokio runtime")
            .block_on(f)
    }

    async fn rtnl() -> Result<rtnetlink::Handle> {
        let (connection, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(connection);
        Ok(handle)
    }

    /// NIC 0: veth `nic0` with its peer moved into the router namespace; NIC 1: dummy `nic1`.
    async fn setup_nics(router: &Netns) -> Result<()> {
        let handle = rtnl().await?;
        handle
            .link()
            .add(LinkVeth::new("nic0", "nic0p").mtu(MTU).up().build())
            .execute()
            .await
            .context("create veth nic0")?;
        let peer = link(&handle, "nic0p").await?.header.index;
        handle
            .link()
            .set(LinkUnspec::new_with_index(peer).mtu(MTU).build())
            .execute()
            .await?;
        handle
            .link()
            .set(
                LinkUnspec::new_with_index(peer)
                    .setns_by_fd(router.file().as_raw_fd())
                    .build(),
            )
            .execute()
            .await
            .context("move nic0p into the router namespace")?;
        handle
            .link()
            .add(LinkDummy::new("nic1").mtu(MTU).up().build())
            .execute()
            .await?;
        Ok(())
    }

    /// OCI's virtual router for VNIC 1, reachable only through VLAN 21 on the wire.
    async fn setup_router() -> Result<()> {
        let handle = rtnl().await?;
        let lo = link(&handle, "lo").await?.header.index;
        handle
            .link()
            .set(LinkUnspec::new_with_index(lo).up().build())
            .execute()
            .await?;
        let nic = link(&handle, "nic0p").await?.header.index;
        handle
            .link()
            .set(LinkUnspec::new_with_index(nic).up().build())
            .execute()
            .await?;
        handle
            .link()
            .add(LinkVlan::new("nic0p.21", nic, 21).mtu(MTU).up().build())
            .execute()
            .await
            .context("create the router's VLAN 21")?;
        let vlan = link(&handle, "nic0p.21").await?.header.index;
        handle
            .address()
            .add(vlan, IpAddr::V4(Ipv4Addr::new(10, 1, 8, 1)), 22)
            .execute()
            .await?;
        Ok(())
    }

    async fn exercise() -> Result<()> {
        let desired = desired()?;
        let nc = Netconf::connect()?;
        // Carrier and operstate changes settle within a second (linkwatch); only then does a read
        // show what the code under test changes and nothing else.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let before = nc.observe().await?;

        // 1. Rollback on this kernel: nobody answers at 10.1.8.99, so the post-apply check fails
        //    after every link, address, route and rule was made, and all of it must be undone.
        let failed = nc
            .apply(&desired, &check(Ipv4Addr::new(10, 1, 8, 99), 1500))
            .await?;
        assert_eq!(failed.outcome, Outcome::RolledBack, "{:?}", failed.error);
        let steps = failed.plan.steps.len();
        ensure!(
            steps >= 11,
            "plan has only {steps} steps: {:?}",
            failed.plan
        );
        ensure!(
            failed
                .error
                .as_deref()
                .is_some_and(|e| e.contains("post-apply check failed")),
            "{:?}",
            failed.error
        );
        assert_eq!(
            nc.observe().await?,
            before,
            "state after the rolled-back apply"
        );
        eprintln!(
            "guest: apply with a failing check rolled back {steps} steps to the exact previous state"
        );

        // 2. Apply for real; the router answers only on VLAN 21, so this check proves tagging.
        let applied = nc
            .apply(&desired, &check(Ipv4Addr::new(10, 1, 8, 1), 5000))
            .await?;
        assert_eq!(applied.outcome, Outcome::Applied, "{:?}", applied.error);
        eprintln!(
            "guest: applied {} steps with {} netlink writes; 10.1.8.1 answered over VLAN 21",
            applied.plan.steps.len(),
            applied.writes
        );

        // 3. Read back through netconf's observer, and the VLAN protocol straight from netlink.
        let observed = nc.observe().await?;
        verify(&observed)?;
        let handle = rtnl().await?;
        for (name, id) in [("nkv21", 21), ("nkv37", 37)] {
            let data = vlan_data(&link(&handle, name).await?)?;
            ensure!(data.contains(&InfoVlan::Id(id)), "{name}: {data:?}");
            ensure!(
                data.contains(&InfoVlan::Protocol(VlanProtocol::Ieee8021Q)),
                "{name}: {data:?}"
            );
        }

        // 4. Re-apply: nothing to do, nothing written.
        let writes_before = nc.writes();
        let again = nc.apply(&desired, &ApplyOptions::default()).await?;
        assert_eq!(again.outcome, Outcome::Applied, "{:?}", again.error);
        ensure!(again.plan.is_empty(), "re-apply planned {:?}", again.plan);
        assert_eq!((again.writes, nc.writes() - writes_before), (0, 0));
        ensure!(
            nc.drift(&desired).await?.is_empty(),
            "drift right after apply"
        );

        // 5. Remove: the empty desired state takes away exactly what nodekeeper made.
        let removed = nc
            .apply(&NetworkState::default(), &ApplyOptions::default())
            .await?;
        assert_eq!(removed.outcome, Outcome::Applied, "{:?}", removed.error);
        assert_eq!(
            nc.observe().await?,
            before,
            "state after removing the layout"
        );
        eprintln!("guest: re-apply wrote nothing; removal restored the exact previous state");
        Ok(())
    }

    fn check(target: Ipv4Addr, timeout_ms: u64) -> ApplyOptions {
        ApplyOptions {
            check_targets: vec![Target::Icmp(IpAddr::V4(target))],
            check_timeout: Duration::from_millis(timeout_ms),
            ..Default::default()
        }
    }

    /// The bare-metal layout, as a user would check it with `ip -d link`, `ip addr`, `ip route
    /// show table N` and `ip rule`.
    fn verify(obs: &Observed) -> Result<()> {
        let get = |name: &str| {
            obs.link_by_name(name)
                .with_context(|| format!("link {name} missing"))
        };
        for (nic, mv, mac, vl, id, cidr, gw, table, prio) in [
            (
                "nic0",
                "nkm21",
                "02:00:17:1b:08:21",
                "nkv21",
                21,
                "10.1.8.21/22",
                "10.1.8.1",
                101,
                20101,
            ),
            (
                "nic1",
                "nkm37",
                "02:00:17:1b:10:09",
                "nkv37",
                37,
                "10.1.16.9/24",
                "10.1.16.1",
                102,
                20102,
            ),
        ] {
            let (nic, mv, vl) = (get(nic)?, get(mv)?, get(vl)?);
            ensure!(
                mv.kind == "macvlan" && mv.macvlan_mode.as_deref() == Some("bridge"),
                "{mv:?}"
            );
            ensure!(
                mv.parent_index == Some(nic.index),
                "{} is not on {}: {mv:?}",
                mv.name,
                nic.name
            );
            ensure!(mv.mac.as_deref() == Some(mac), "{mv:?}");
            ensure!(vl.kind == "vlan" && vl.vlan_id == Some(id), "{vl:?}");
            ensure!(
                vl.parent_index == Some(mv.index),
                "{} is not on {}: {vl:?}",
                vl.name,
                mv.name
            );
            // A VLAN device sends with its parent's MAC: the VNIC's MAC leaves the NIC, tagged.
            ensure!(vl.mac.as_deref() == Some(mac), "{vl:?}");
            for l in [mv, vl] {
                ensure!(l.mtu == MTU && l.up && l.owned(), "{l:?}");
            }
            ensure!(
                obs.addresses
                    .iter()
                    .any(|a| a.index == vl.index && a.net.to_string() == cidr),
                "{cidr} not on {}",
                vl.name
            );
            ensure!(
                obs.routes.iter().any(|r| r.table == table
                    && r.destination.prefix_len() == 0
                    && r.gateway.map(|g| g.to_string()).as_deref() == Some(gw)
                    && r.oif == Some(vl.index)),
                "no default via {gw} dev {} in table {table}: {:?}",
                vl.name,
                obs.routes
                    .iter()
                    .filter(|r| r.table == table)
                    .collect::<Vec<_>>()
            );
            let from: ipnet::IpNet =
                format!("{}/32", cidr.split('/').next().unwrap_or_default()).parse()?;
            ensure!(
                obs.rules
                    .iter()
                    .any(|r| r.priority == prio && r.table == table && r.from == Some(from)),
                "no rule {prio}: from {from} lookup {table}"
            );
        }
        let link_local: ipnet::IpNet = "169.254.0.0/16".parse()?;
        ensure!(
            obs.rules
                .iter()
                .any(|r| r.priority == 20100 && r.table == 254 && r.to == Some(link_local)),
            "no rule 20100: to 169.254.0.0/16 lookup main"
        );
        Ok(())
    }

    async fn link(handle: &rtnetlink::Handle, name: &str) -> Result<LinkMessage> {
        let mut links = handle.link().get().match_name(name.to_owned()).execute();
        match links.try_next().await? {
            Some(link) => Ok(link),
            None => bail!("link {name} not found"),
        }
    }

    fn vlan_data(link: &LinkMessage) -> Result<Vec<InfoVlan>> {
        let info = link
            .attributes
            .iter()
            .find_map(|a| match a {
                LinkAttribute::LinkInfo(info) => Some(info.clone()),
                _ => None,
            })
            .unwrap_or_default();
        ensure!(
            info.iter()
                .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Vlan))),
            "not a vlan: {info:?}"
        );
        info.into_iter()
            .find_map(|i| match i {
                LinkInfo::Data(InfoData::Vlan(d)) => Some(d),
                _ => None,
            })
            .context("vlan link without vlan data")
    }
}
