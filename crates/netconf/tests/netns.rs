//! Real-kernel tests of apply, re-apply, rollback, ownership and drift, each in a fresh network
//! namespace with veth pairs and macvlans. Root only; VLAN creation is exercised too and is
//! expected to fail cleanly (and roll back) on kernels without 8021q.

use std::time::Duration;

use nodekeeper_model::network::NetworkState;
use nodekeeper_netconf::{ApplyOptions, Netconf, Outcome, Target};
use nodekeeper_testkit::{Netns, skip_unless_root};
use pretty_assertions::assert_eq;

/// A fresh namespace with loopback up and IPv6 DAD off (DAD would flip address flags between
/// two dumps; nothing here needs it).
fn test_ns() -> Netns {
    Netns::with_loopback("nk-test").expect("create a network namespace")
}

/// Everything `ip` can show about links, addresses, routes and rules, as JSON text.
fn dump(ns: &Netns) -> String {
    let mut out = String::new();
    for args in [
        &["-j", "-d", "link", "show"][..],
        &["-j", "addr", "show"],
        &["-j", "-4", "route", "show", "table", "all"],
        &["-j", "-6", "route", "show", "table", "all"],
        &["-j", "-4", "rule", "show"],
        &["-j", "-6", "rule", "show"],
    ] {
        out.push_str(&ns.ip(args).unwrap());
        out.push('\n');
    }
    out
}

/// The dump without interface indexes (a re-created link gets a new one).
fn dump_without_indexes(ns: &Netns) -> String {
    let mut out = String::new();
    for line in dump(ns).lines().filter(|l| !l.trim().is_empty()) {
        let mut v: serde_json::Value = serde_json::from_str(line).unwrap();
        strip(&mut v);
        out.push_str(&v.to_string());
        out.push('\n');
    }
    out
}

fn strip(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("ifindex");
            m.remove("link_index");
            m.values_mut().for_each(strip);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
        _ => {}
    }
}

/// Two veth pairs standing in for NICs: `nic0` (MAC 02:00:17:0a:22:02, the "VM secondary VNIC")
/// with peer `nic0p` playing the virtual router 10.0.20.1, and `nic1` as a bare-metal parent.
fn setup_nics(ns: &Netns) {
    ns.ip(&[
        "link",
        "add",
        "nic0",
        "address",
        "02:00:17:0a:22:02",
        "type",
        "veth",
        "peer",
        "name",
        "nic0p",
    ])
    .unwrap();
    ns.ip(&[
        "link",
        "add",
        "nic1",
        "address",
        "02:00:17:0a:33:01",
        "type",
        "veth",
        "peer",
        "name",
        "nic1p",
    ])
    .unwrap();
    // Real NICs are up before nodekeeper sees them. (Taking a veth down and up again also makes
    // the kernel add and remove IPv6 link-local state on its peer, which is not nodekeeper's.)
    ns.ip(&["link", "set", "nic0", "up"]).unwrap();
    ns.ip(&["link", "set", "nic0p", "up"]).unwrap();
    ns.ip(&["link", "set", "nic1", "up"]).unwrap();
    ns.ip(&["link", "set", "nic1p", "up"]).unwrap();
    ns.ip(&["addr", "add", "10.0.20.1/24", "dev", "nic0p"])
        .unwrap();
    // Let carrier and operstate changes settle (linkwatch may take up to a second) so that two
    // dumps differ only by what the code under test did.
    std::thread::sleep(Duration::from_millis(1500));
}

fn desired() -> NetworkState {
    serde_json::from_str(
        r#"{
          "links": [
            {"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true},
            {"name": "nkm30", "kind": "macvlan", "parent": "nic1", "mac": "02:00:17:0a:33:03"}
          ],
          "addresses": [
            {"link": "vnic1", "cidr": "10.0.20.33/24"},
            {"link": "nkm30", "cidr": "10.0.30.45/23"},
            {"link": "nkm30", "cidr": "fd00:10:30::45/64"}
          ],
          "routes": [
            {"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101},
            {"destination": "default", "gateway": "10.0.30.1", "link": "nkm30", "table": 102, "onLink": true},
            {"destination": "::/0", "gateway": "fd00:10:30::1", "link": "nkm30", "table": 102}
          ],
          "rules": [
            {"from": "10.0.20.33/32", "table": 101, "priority": 20101},
            {"from": "10.0.30.45/32", "table": 102, "priority": 20102},
            {"from": "fd00:10:30::45/128", "table": 102, "priority": 20102}
          ]
        }"#,
    )
    .unwrap()
}

#[test]
fn apply_then_reapply_makes_no_writes_then_removal_cleans_up() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let (first, second, writes_between) = ns.run(|| async {
        let nc = Netconf::connect().unwrap();
        let first = nc
            .apply(&desired(), &ApplyOptions::default())
            .await
            .unwrap();
        let before = nc.writes();
        let second = nc
            .apply(&desired(), &ApplyOptions::default())
            .await
            .unwrap();
        (first, second, nc.writes() - before)
    });
    assert_eq!(first.outcome, Outcome::Applied, "{:?}", first.error);
    assert!(first.writes >= 10, "{}", first.writes);
    assert!(second.plan.is_empty(), "{:?}", second.plan);
    assert_eq!((second.writes, writes_between), (0, 0));

    // Read back with iproute2.
    let link: serde_json::Value =
        serde_json::from_str(&ns.ip(&["-j", "-d", "link", "show", "nkm30"]).unwrap()).unwrap();
    assert_eq!(link[0]["address"], "02:00:17:0a:33:03");
    assert_eq!(link[0]["ifalias"], "nodekeeper:nkm30");
    assert_eq!(link[0]["linkinfo"]["info_kind"], "macvlan");
    let nic0: serde_json::Value =
        serde_json::from_str(&ns.ip(&["-j", "link", "show", "nic0"]).unwrap()).unwrap();
    assert_eq!(nic0[0]["mtu"], 9000);
    assert!(
        ns.ip(&["-4", "addr", "show", "dev", "nic0"])
            .unwrap()
            .contains("10.0.20.33/24")
    );
    let t101 = ns.ip(&["route", "show", "table", "101"]).unwrap();
    assert_eq!(t101.trim(), "default via 10.0.20.1 dev nic0 proto 176");
    let t102v6 = ns.ip(&["-6", "route", "show", "table", "102"]).unwrap();
    assert!(
        t102v6.contains("default via fd00:10:30::1 dev nkm30 proto 176"),
        "{t102v6}"
    );
    let rules = ns.ip(&["rule", "show"]).unwrap();
    assert!(
        rules.contains("20101:\tfrom 10.0.20.33 lookup 101 proto 176"),
        "{rules}"
    );

    // Removing everything removes only what nodekeeper owns.
    let report = ns.run(|| async {
        Netconf::connect()
            .unwrap()
            .apply(&NetworkState::default(), &ApplyOptions::default())
            .await
            .unwrap()
    });
    assert_eq!(report.outcome, Outcome::Applied, "{:?}", report.error);
    assert!(ns.ip(&["link", "show", "nkm30"]).is_err());
    assert_eq!(ns.ip(&["route", "show", "table", "101"]).unwrap(), "");
    assert!(!ns.ip(&["rule", "show"]).unwrap().contains("proto 176"));
    assert!(
        !ns.ip(&["addr", "show", "dev", "nic0"])
            .unwrap()
            .contains("10.0.20.33")
    );
    assert!(
        ns.ip(&["addr", "show", "dev", "nic0p"])
            .unwrap()
            .contains("10.0.20.1/24")
    );
}

#[test]
fn foreign_routes_rules_links_and_addresses_are_untouched() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    // Foreign objects: in nodekeeper's tables, in its rule priority range, on its NICs.
    ns.ip(&[
        "link",
        "add",
        "link",
        "nic1",
        "name",
        "mvforeign",
        "type",
        "macvlan",
        "mode",
        "bridge",
    ])
    .unwrap();
    ns.ip(&["link", "set", "mvforeign", "alias", "someone-else", "up"])
        .unwrap();
    ns.ip(&["addr", "add", "192.168.7.7/24", "dev", "mvforeign"])
        .unwrap();
    ns.ip(&["addr", "add", "172.16.0.9/16", "dev", "nic0"])
        .unwrap();
    ns.ip(&[
        "route",
        "add",
        "10.99.0.0/16",
        "via",
        "192.168.7.1",
        "table",
        "101",
        "proto",
        "static",
    ])
    .unwrap();
    ns.ip(&[
        "rule",
        "add",
        "from",
        "192.168.7.7",
        "lookup",
        "101",
        "priority",
        "20050",
    ])
    .unwrap();
    ns.ip(&[
        "rule",
        "add",
        "to",
        "10.55.0.0/16",
        "lookup",
        "main",
        "priority",
        "20102",
    ])
    .unwrap();
    let mut d = desired();
    // Leave nic0's MTU and state as they are so that the final dump can be compared exactly.
    d.links[0].mtu = None;
    d.links[0].up = None;
    ns.ip(&["link", "set", "nic0", "up"]).unwrap();
    let before = dump(&ns);
    let (a, b) = ns.run(move || async move {
        let nc = Netconf::connect().unwrap();
        let a = nc.apply(&d, &ApplyOptions::default()).await.unwrap();
        let b = nc
            .apply(&NetworkState::default(), &ApplyOptions::default())
            .await
            .unwrap();
        (a, b)
    });
    assert_eq!(a.outcome, Outcome::Applied, "{:?}", a.error);
    assert_eq!(b.outcome, Outcome::Applied, "{:?}", b.error);
    assert!(
        b.plan
            .steps
            .iter()
            .all(|s| !s.to_string().contains("foreign") && !s.to_string().contains("192.168.7"))
    );
    assert_eq!(dump(&ns), before);
}

#[test]
fn injected_failure_at_every_step_restores_the_exact_previous_state() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let before = dump(&ns);
    let steps = ns.run(|| async {
        Netconf::connect()
            .unwrap()
            .plan(&desired())
            .await
            .unwrap()
            .steps
            .len()
    });
    assert!(steps >= 10);
    for k in 0..steps {
        let r = ns.run(move || async move {
            let opts = ApplyOptions {
                fail_at_step: Some(k),
                ..Default::default()
            };
            Netconf::connect()
                .unwrap()
                .apply(&desired(), &opts)
                .await
                .unwrap()
        });
        assert_eq!(r.outcome, Outcome::RolledBack, "step {k}: {:?}", r.error);
        assert!(r.error.as_deref().unwrap().contains("injected failure"));
        assert_eq!(dump(&ns), before, "after failing step {k}");
    }
}

#[test]
fn failure_while_changing_an_applied_state_restores_it() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let applied = ns.run(|| async {
        Netconf::connect()
            .unwrap()
            .apply(&desired(), &ApplyOptions::default())
            .await
            .unwrap()
    });
    assert_eq!(applied.outcome, Outcome::Applied);
    let before = dump_without_indexes(&ns);
    // A changed state that deletes (and re-creates) links, addresses, routes and rules; the last
    // step is made to fail.
    let mut changed = desired();
    changed.links[1].macvlan_mode = Some(nodekeeper_model::network::MacvlanMode::Private);
    changed.links[0].mtu = Some(1500);
    changed.rules.remove(0);
    changed.routes[0].gateway = Some("10.0.20.254".into());
    let r = ns.run(move || async move {
        let nc = Netconf::connect().unwrap();
        let n = nc.plan(&changed).await.unwrap().steps.len();
        nc.apply(
            &changed,
            &ApplyOptions {
                fail_at_step: Some(n - 1),
                ..Default::default()
            },
        )
        .await
        .unwrap()
    });
    assert_eq!(r.outcome, Outcome::RolledBack, "{:?}", r.error);
    let ops: Vec<&str> = r.plan.steps.iter().map(|s| s.op()).collect();
    for op in [
        "delete-rule",
        "delete-route",
        "delete-address",
        "delete-link",
        "create-link",
        "set-link",
    ] {
        assert!(ops.contains(&op), "{ops:?} lacks {op}");
    }
    assert_eq!(dump_without_indexes(&ns), before);
}

#[test]
fn kernel_refusal_mid_plan_rolls_back() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    // A foreign route holds table 102's default slot (same metric): the kernel refuses nodekeeper's
    // default route there with EEXIST, after links, settings and addresses were already changed.
    ns.ip(&["route", "add", "unreachable", "default", "table", "102"])
        .unwrap();
    let before = dump(&ns);
    let r = ns.run(|| async {
        Netconf::connect()
            .unwrap()
            .apply(&desired(), &ApplyOptions::default())
            .await
            .unwrap()
    });
    assert_eq!(r.outcome, Outcome::RolledBack, "{:?}", r.error);
    let e = r.error.unwrap();
    assert!(
        e.contains(
            "(add-route 0.0.0.0/0 via 10.0.30.1 dev nkm30 table 102 onlink) failed: File exists"
        ),
        "{e}"
    );
    let failed_at: usize = e
        .trim_start_matches("step ")
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        failed_at > 5,
        "the refusal should come mid-plan, came at step {failed_at}"
    );
    assert_eq!(dump(&ns), before);
}

#[test]
fn failed_reachability_check_rolls_back_and_passing_check_keeps() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let before = dump(&ns);
    let r = ns.run(|| async {
        let opts = ApplyOptions {
            check_targets: vec!["10.0.30.1".parse::<Target>().unwrap()],
            check_timeout: Duration::from_millis(800),
            ..Default::default()
        };
        Netconf::connect()
            .unwrap()
            .apply(&desired(), &opts)
            .await
            .unwrap()
    });
    assert_eq!(r.outcome, Outcome::RolledBack);
    assert!(
        r.error
            .as_deref()
            .unwrap()
            .contains("post-apply check failed: icmp 10.0.30.1"),
        "{:?}",
        r.error
    );
    assert_eq!(dump(&ns), before);

    // The "virtual router" on nic0p answers pings from the VNIC.
    let r = ns.run(|| async {
        let opts = ApplyOptions {
            check_targets: vec!["10.0.20.1".parse::<Target>().unwrap()],
            check_timeout: Duration::from_secs(3),
            ..Default::default()
        };
        Netconf::connect()
            .unwrap()
            .apply(&desired(), &opts)
            .await
            .unwrap()
    });
    assert_eq!(r.outcome, Outcome::Applied, "{:?}", r.error);
}

#[test]
fn drift_is_detected_and_reconverged() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let r = ns.run(|| async {
        Netconf::connect()
            .unwrap()
            .apply(&desired(), &ApplyOptions::default())
            .await
            .unwrap()
    });
    assert_eq!(r.outcome, Outcome::Applied);
    ns.ip(&["route", "del", "default", "table", "101"]).unwrap();
    ns.ip(&["link", "set", "nic0", "mtu", "1500"]).unwrap();
    let (drift, fixed, after) = ns.run(|| async {
        let nc = Netconf::connect().unwrap();
        let drift = nc.drift(&desired()).await.unwrap();
        let fixed = nc
            .apply(&desired(), &ApplyOptions::default())
            .await
            .unwrap();
        (drift, fixed, nc.drift(&desired()).await.unwrap())
    });
    assert_eq!(
        drift,
        vec![
            "set-link nic0 mtu 9000".to_string(),
            "add-route 0.0.0.0/0 via 10.0.20.1 dev nic0 table 101".to_string()
        ]
    );
    assert_eq!(fixed.outcome, Outcome::Applied);
    assert!(after.is_empty(), "{after:?}");
}

#[test]
fn a_gateway_route_without_a_link_is_applied_once() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    // The kernel picks the outgoing link from the gateway and reports it; the second apply
    // must see the route as present.
    let mut d = desired();
    d.routes.push(
        serde_json::from_value(serde_json::json!({
            "destination": "fd00:99::/64", "gateway": "fd00:10:30::1", "table": 102
        }))
        .unwrap(),
    );
    let (first, drift, second) = ns.run(move || async move {
        let nc = Netconf::connect().unwrap();
        let first = nc.apply(&d, &ApplyOptions::default()).await.unwrap();
        let drift = nc.drift(&d).await.unwrap();
        let second = nc.apply(&d, &ApplyOptions::default()).await.unwrap();
        (first, drift, second)
    });
    assert_eq!(first.outcome, Outcome::Applied, "{:?}", first.error);
    let t102 = ns.ip(&["-6", "route", "show", "table", "102"]).unwrap();
    assert!(
        t102.contains("fd00:99::/64 via fd00:10:30::1 dev nkm30 proto 176"),
        "{t102}"
    );
    assert!(drift.is_empty(), "{drift:?}");
    assert!(second.plan.is_empty(), "{:?}", second.plan);
    assert_eq!(second.writes, 0);
}

#[test]
#[allow(clippy::print_stdout)]
fn vlan_goes_through_the_same_path_and_fails_cleanly_without_8021q() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let before = dump(&ns);
    let d: NetworkState = serde_json::from_str(
        r#"{
          "links": [
            {"name": "nkm21", "kind": "macvlan", "parent": "nic1", "mac": "02:00:17:1b:08:21"},
            {"name": "nkv21", "kind": "vlan", "parent": "nkm21", "vlanId": 21}
          ],
          "addresses": [{"link": "nkv21", "cidr": "10.1.8.21/22"}],
          "routes": [{"destination": "default", "gateway": "10.1.8.1", "link": "nkv21", "table": 121}],
          "rules": [{"from": "10.1.8.21/32", "table": 121, "priority": 20121}]
        }"#,
    )
    .unwrap();
    let r = ns.run(move || async move {
        Netconf::connect()
            .unwrap()
            .apply(&d, &ApplyOptions::default())
            .await
            .unwrap()
    });
    let vlan_supported = std::path::Path::new("/proc/net/vlan").exists();
    if vlan_supported {
        assert_eq!(r.outcome, Outcome::Applied, "{:?}", r.error);
        let v: serde_json::Value =
            serde_json::from_str(&ns.ip(&["-j", "-d", "link", "show", "nkv21"]).unwrap()).unwrap();
        assert_eq!(v[0]["linkinfo"]["info_data"]["id"], 21);
    } else {
        println!("kernel has no 8021q: checking that the VLAN step fails and rolls back");
        assert_eq!(r.outcome, Outcome::RolledBack, "{:?}", r.error);
        let e = r.error.unwrap();
        assert!(
            e.contains("step 2 (create-link vlan 21 on nkm21 (nkv21)"),
            "{e}"
        );
        assert_eq!(dump(&ns), before);
    }
}

/// A state that raises a NIC's MTU and puts a macvlan of that MTU on it applies after a state
/// that lowered the NIC and had no macvlan: the kernel refuses a macvlan larger than its parent,
/// so the NIC is raised first (found by the agent fault campaign: A, then B, then A failed).
#[test]
fn a_macvlan_is_created_after_its_parent_mtu_is_raised() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let a: NetworkState = serde_json::from_str(
        r#"{"links": [
              {"name": "nic1", "kind": "existing", "mtu": 1500},
              {"name": "nkm40", "kind": "macvlan", "parent": "nic1", "mtu": 1500}
           ]}"#,
    )
    .unwrap();
    let b: NetworkState =
        serde_json::from_str(r#"{"links": [{"name": "nic1", "kind": "existing", "mtu": 1400}]}"#)
            .unwrap();
    let outcomes = ns.run(move || async move {
        let nc = Netconf::connect().unwrap();
        let mut out = Vec::new();
        for state in [&a, &b, &a] {
            let r = nc.apply(state, &ApplyOptions::default()).await.unwrap();
            out.push((r.outcome, r.error));
        }
        out
    });
    for (i, (outcome, error)) in outcomes.iter().enumerate() {
        assert_eq!(*outcome, Outcome::Applied, "apply {i}: {error:?}");
    }
    let links = ns.ip(&["-o", "link", "show"]).unwrap();
    assert!(
        links
            .lines()
            .any(|l| l.contains("nkm40@nic1") && l.contains("mtu 1500")),
        "{links}"
    );
}

/// The VM VNIC of [`desired`] alone, with `ip` as its address (and source rule).
fn vnic_with(ip: &str) -> NetworkState {
    serde_json::from_value(serde_json::json!({
        "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02"}],
        "addresses": [{"link": "vnic1", "cidr": format!("{ip}/24")}],
        "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101}],
        "rules": [{"from": format!("{ip}/32"), "table": 101, "priority": 20101}]
    }))
    .unwrap()
}

/// Changing a VNIC's address (.33 → .34) keeps table 101's default route. The kernel deletes
/// every IPv4 route through a link that loses its last IPv4 address: the plan adds the new
/// address before it deletes the old one, so with `promote_secondaries` on (.34 takes .33's
/// place as primary) nothing is lost, not even someone else's route through the VNIC. With it
/// off, deleting the primary .33 deletes the secondary .34 too and the routes go with them: the
/// apply reads the host again and makes what the kernel undid once more.
#[test]
fn changing_a_vnics_address_keeps_its_tables_routes() {
    skip_unless_root!("needs root to create network namespaces");
    for promote in ["1", "0"] {
        let ns = test_ns();
        setup_nics(&ns);
        for key in ["all", "nic0"] {
            ns.set_sysctl(&format!("net.ipv4.conf.{key}.promote_secondaries"), promote)
                .unwrap();
        }
        let first = ns.run(|| async {
            let nc = Netconf::connect().unwrap();
            let opts = ApplyOptions::default();
            nc.apply(&vnic_with("10.0.20.33"), &opts).await.unwrap()
        });
        assert_eq!(first.outcome, Outcome::Applied, "{:?}", first.error);
        // Someone else's route through the VNIC.
        ns.ip(&[
            "route",
            "add",
            "198.51.100.0/24",
            "via",
            "10.0.20.1",
            "dev",
            "nic0",
            "table",
            "200",
        ])
        .unwrap();
        let (second, third) = ns.run(|| async {
            let nc = Netconf::connect().unwrap();
            let opts = ApplyOptions::default();
            let second = nc.apply(&vnic_with("10.0.20.34"), &opts).await.unwrap();
            let third = nc.apply(&vnic_with("10.0.20.34"), &opts).await.unwrap();
            (second, third)
        });
        assert_eq!(second.outcome, Outcome::Applied, "{:?}", second.error);
        let t101 = ns.ip(&["route", "show", "table", "101"]).unwrap();
        assert_eq!(
            t101.trim(),
            "default via 10.0.20.1 dev nic0 proto 176",
            "promote_secondaries {promote}"
        );
        let addrs = ns.ip(&["-4", "addr", "show", "dev", "nic0"]).unwrap();
        assert!(
            addrs.contains("10.0.20.34/24") && !addrs.contains("10.0.20.33"),
            "{addrs}"
        );
        assert_eq!((third.plan.steps.len(), third.writes), (0, 0));
        let ops: Vec<String> = second
            .plan
            .steps
            .iter()
            .map(|s| format!("{} {s}", s.op()))
            .collect();
        if promote == "1" {
            // Nothing for the kernel to undo: one pass, and the foreign route is still there.
            assert_eq!(
                ops,
                [
                    "delete-rule priority 20101 from 10.0.20.33/32 lookup 101",
                    "add-address 10.0.20.34/24 dev nic0",
                    "delete-address 10.0.20.33/24 dev nic0",
                    "add-rule priority 20101 from 10.0.20.34/32 lookup 101",
                ]
            );
            let t200 = ns.ip(&["route", "show", "table", "200"]).unwrap();
            assert!(t200.contains("198.51.100.0/24 via 10.0.20.1"), "{t200}");
        } else {
            assert!(
                ops.contains(&"add-route 0.0.0.0/0 via 10.0.20.1 dev nic0 table 101".to_string()),
                "the second pass adds the route the kernel removed: {ops:?}"
            );
        }
    }
}

/// Rolling back a lowered MTU raises the parent before its children (the kernel refuses a
/// macvlan larger than its parent), and gives the links the kernel lowered with the parent —
/// nodekeeper's and someone else's — their MTU back.
#[test]
fn rollback_of_a_lowered_mtu_raises_parents_first_and_restores_their_children() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    let big: NetworkState = serde_json::from_str(
        r#"{"links": [
              {"name": "nic1", "kind": "existing", "mtu": 9000},
              {"name": "nkm30", "kind": "macvlan", "parent": "nic1", "mac": "02:00:17:0a:33:03", "mtu": 9000}
           ]}"#,
    )
    .unwrap();
    let applied = ns.run(move || async move {
        Netconf::connect()
            .unwrap()
            .apply(&big, &ApplyOptions::default())
            .await
            .unwrap()
    });
    assert_eq!(applied.outcome, Outcome::Applied, "{:?}", applied.error);
    ns.ip(&[
        "link", "add", "link", "nic1", "name", "theirs", "mtu", "9000", "type", "macvlan",
    ])
    .unwrap();
    let before = dump(&ns);
    let small: NetworkState = serde_json::from_str(
        r#"{"links": [
              {"name": "nic1", "kind": "existing", "mtu": 1500},
              {"name": "nkm30", "kind": "macvlan", "parent": "nic1", "mac": "02:00:17:0a:33:03", "mtu": 1500}
           ],
           "addresses": [{"link": "nkm30", "cidr": "10.0.30.45/23"}]}"#,
    )
    .unwrap();
    let r = ns.run(move || async move {
        let nc = Netconf::connect().unwrap();
        let steps = nc.plan(&small).await.unwrap().steps.len();
        let opts = ApplyOptions {
            fail_at_step: Some(steps - 1),
            ..Default::default()
        };
        nc.apply(&small, &opts).await.unwrap()
    });
    let ops: Vec<&str> = r.plan.steps.iter().map(|s| s.op()).collect();
    assert_eq!(ops, ["set-link", "set-link", "add-address"]);
    assert_eq!(r.outcome, Outcome::RolledBack, "{:?}", r.error);
    assert_eq!(dump(&ns), before);
}

/// A set-link whose MTU the kernel took and whose "up" it refused (a macvlan with its parent's
/// MAC cannot come up: EADDRINUSE) is undone too: the MTU goes back.
#[test]
fn a_set_link_refused_half_way_is_undone() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = test_ns();
    setup_nics(&ns);
    ns.ip(&[
        "link",
        "add",
        "link",
        "nic1",
        "name",
        "mvt",
        "address",
        "02:00:17:0a:33:01",
        "type",
        "macvlan",
    ])
    .unwrap();
    let before = dump(&ns);
    let desired: NetworkState = serde_json::from_str(
        r#"{"links": [{"name": "mvt", "kind": "existing", "mtu": 1400, "up": true}]}"#,
    )
    .unwrap();
    let r = ns.run(move || async move {
        Netconf::connect()
            .unwrap()
            .apply(&desired, &ApplyOptions::default())
            .await
            .unwrap()
    });
    assert_eq!(r.outcome, Outcome::RolledBack, "{:?}", r.error);
    assert!(
        r.error
            .as_deref()
            .unwrap()
            .contains("(set-link mvt mtu 1400 up) failed"),
        "{:?}",
        r.error
    );
    assert_eq!(dump(&ns), before);
}
