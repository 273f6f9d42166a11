//! Unit tests of the planner: pure, no root.

use nodekeeper_model::network::NetworkState;
use pretty_assertions::assert_eq;

use super::*;
use crate::observed::{ObservedAddress, ObservedRoute, ObservedRule};

fn link(index: u32, name: &str, mac: &str) -> ObservedLink {
    ObservedLink {
        index,
        name: name.into(),
        mac: Some(mac.into()),
        mtu: 1500,
        up: true,
        oper_state: "up".into(),
        kind: "veth".into(),
        parent_index: None,
        vlan_id: None,
        macvlan_mode: None,
        alias: None,
    }
}

fn host() -> Observed {
    Observed {
        links: vec![
            link(1, "lo", "00:00:00:00:00:00"),
            // A bare-metal NIC: the VNIC macvlans on it take 9000 bytes.
            ObservedLink {
                mtu: 9000,
                ..link(2, "ens3", "02:00:17:0a:11:01")
            },
            ObservedLink {
                up: false,
                ..link(3, "ens5", "02:00:17:0a:22:02")
            },
        ],
        addresses: vec![ObservedAddress {
            index: 2,
            net: "10.0.10.17/24".parse().unwrap(),
            protocol: 0,
        }],
        routes: vec![ObservedRoute {
            table: 254,
            destination: "0.0.0.0/0".parse().unwrap(),
            gateway: Some("10.0.10.1".parse().unwrap()),
            oif: Some(2),
            metric: 0,
            protocol: 16,
            on_link: false,
        }],
        rules: vec![],
    }
}

fn vm_desired() -> NetworkState {
    serde_json::from_str(
        r#"{
          "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true}],
          "addresses": [{"link": "vnic1", "cidr": "10.0.20.33/24"}],
          "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101}],
          "rules": [{"from": "10.0.20.33", "table": 101, "priority": 20101}]
        }"#,
    )
    .unwrap()
}

fn bm_desired() -> NetworkState {
    serde_json::from_str(
        r#"{
          "links": [
            {"name": "nkv21", "kind": "vlan", "parent": "nkm21", "vlanId": 21, "mtu": 9000},
            {"name": "nkm21", "kind": "macvlan", "parent": "ens3", "mac": "02:00:17:1b:08:21", "mtu": 9000}
          ],
          "addresses": [{"link": "nkv21", "cidr": "10.1.8.21/22"}],
          "routes": [{"destination": "default", "gateway": "10.1.8.1", "link": "nkv21", "table": 121}],
          "rules": [{"from": "10.1.8.21/32", "table": 121, "priority": 20121}]
        }"#,
    )
    .unwrap()
}

fn ops(p: &Plan) -> Vec<String> {
    p.steps.iter().map(|s| format!("{} {s}", s.op())).collect()
}

/// A perfect apply of `plan` on `obs` (see [`super::simulate`]).
fn simulate(obs: Observed, plan: &Plan) -> Observed {
    super::simulate(obs, plan).expect("the plan's links exist when its steps name them")
}

#[test]
fn vm_vnic_plans_settings_then_address_route_rule() {
    let p = plan(&vm_desired(), &host()).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "set-link ens5 mtu 9000 up",
            "add-address 10.0.20.33/24 dev ens5",
            "add-route 0.0.0.0/0 via 10.0.20.1 dev ens5 table 101",
            "add-rule priority 20101 from 10.0.20.33/32 lookup 101",
        ]
    );
}

#[test]
fn applied_state_plans_nothing() {
    for desired in [vm_desired(), bm_desired()] {
        let p = plan(&desired, &host()).unwrap();
        assert!(!p.is_empty());
        let after = simulate(host(), &p);
        assert_eq!(plan(&desired, &after).unwrap(), Plan::default());
    }
}

#[test]
fn bare_metal_creates_parents_first() {
    let p = plan(&bm_desired(), &host()).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "create-link macvlan bridge on ens3 (nkm21) address 02:00:17:1b:08:21 mtu 9000 up",
            "create-link vlan 21 on nkm21 (nkv21) mtu 9000 up",
            "add-address 10.1.8.21/22 dev nkv21",
            "add-route 0.0.0.0/0 via 10.1.8.1 dev nkv21 table 121",
            "add-rule priority 20121 from 10.1.8.21/32 lookup 121",
        ]
    );
}

#[test]
fn owned_objects_are_removed_most_dependent_first() {
    let applied = simulate(host(), &plan(&bm_desired(), &host()).unwrap());
    let p = plan(&NetworkState::default(), &applied).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "delete-rule priority 20121 from 10.1.8.21/32 lookup 121",
            "delete-route 0.0.0.0/0 via 10.1.8.1 dev nkv21 table 121",
            "delete-address 10.1.8.21/22 dev nkv21",
            "delete-link vlan 21 on nkm21 (nkv21) mtu 9000 up",
            "delete-link macvlan bridge on ens3 (nkm21) address 02:00:17:1b:08:21 mtu 9000 up",
        ]
    );
    // And the inverses, newest first, rebuild it.
    let inv: Vec<String> = p
        .steps
        .iter()
        .rev()
        .map(|s| s.inverse().op().to_string())
        .collect();
    assert_eq!(
        inv,
        vec![
            "create-link",
            "create-link",
            "add-address",
            "add-route",
            "add-rule"
        ]
    );
}

#[test]
fn foreign_objects_are_never_planned() {
    let mut obs = host();
    obs.links.push(ObservedLink {
        kind: "macvlan".into(),
        parent_index: Some(2),
        macvlan_mode: Some("bridge".into()),
        alias: Some("someone-else".into()),
        ..link(9, "mv-foreign", "02:aa:00:00:00:09")
    });
    obs.addresses.push(ObservedAddress {
        index: 9,
        net: "192.168.5.5/24".parse().unwrap(),
        protocol: 0,
    });
    obs.routes.push(ObservedRoute {
        table: 101,
        destination: "0.0.0.0/0".parse().unwrap(),
        gateway: Some("192.168.5.1".parse().unwrap()),
        oif: Some(9),
        metric: 7,
        protocol: 4,
        on_link: false,
    });
    obs.rules.push(ObservedRule {
        v6: false,
        priority: 20101,
        from: Some("192.168.5.5/32".parse().unwrap()),
        to: None,
        table: 101,
        protocol: 0,
    });
    assert_eq!(
        plan(&NetworkState::default(), &obs).unwrap(),
        Plan::default()
    );
    // With the VM VNIC desired, only nodekeeper's own objects are planned.
    assert_eq!(
        plan(&vm_desired(), &obs).unwrap(),
        plan(&vm_desired(), &host()).unwrap()
    );
}

#[test]
fn changed_gateway_replaces_the_route_and_set_link_inverts() {
    let applied = simulate(host(), &plan(&vm_desired(), &host()).unwrap());
    let mut d = vm_desired();
    d.routes[0].gateway = Some("10.0.20.254".into());
    d.links[0].mtu = Some(1500);
    let p = plan(&d, &applied).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "delete-route 0.0.0.0/0 via 10.0.20.1 dev ens5 table 101",
            "set-link ens5 mtu 1500",
            "add-route 0.0.0.0/0 via 10.0.20.254 dev ens5 table 101",
        ]
    );
    assert_eq!(
        p.steps[1].inverse(),
        Step::SetLink {
            link: "ens5".into(),
            mtu: Some(9000),
            up: None,
            prev_mtu: 1500,
            prev_up: true,
            lowered: Vec::new(),
        }
    );
}

#[test]
fn missing_parent_mac_and_name_clash_are_errors() {
    let mut d = bm_desired();
    d.links[1].parent = Some("ens9".into());
    let e = plan(&d, &host()).unwrap_err().to_string();
    assert_eq!(
        e,
        "links[1] (nkm21): parent ens9 does not exist on this host and is not in links"
    );

    let mut d = vm_desired();
    d.links[0].mac = Some("02:00:17:0a:99:99".into());
    let e = plan(&d, &host()).unwrap_err().to_string();
    assert_eq!(
        e,
        "links[0] (vnic1): no interface with MAC 02:00:17:0a:99:99 on this host"
    );

    let mut d = bm_desired();
    d.links[1].name = "ens5".into();
    d.links[0].parent = Some("ens5".into());
    let e = plan(&d, &host()).unwrap_err().to_string();
    assert!(
        e.contains("was not created by nodekeeper; choose another name"),
        "{e}"
    );

    let mut d = bm_desired();
    d.links[0].vlan_id = Some(4095);
    let e = plan(&d, &host()).unwrap_err().to_string();
    assert!(
        e.starts_with("invalid desired state: links[0].vlanId: 4095"),
        "{e}"
    );
}

#[test]
fn changed_vlan_id_recreates_the_link() {
    let applied = simulate(host(), &plan(&bm_desired(), &host()).unwrap());
    let mut d = bm_desired();
    d.links[0].vlan_id = Some(22);
    let p = plan(&d, &applied).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "delete-route 0.0.0.0/0 via 10.1.8.1 dev nkv21 table 121",
            "delete-address 10.1.8.21/22 dev nkv21",
            "delete-link vlan 21 on nkm21 (nkv21) mtu 9000 up",
            "create-link vlan 22 on nkm21 (nkv21) mtu 9000 up",
            "add-address 10.1.8.21/22 dev nkv21",
            "add-route 0.0.0.0/0 via 10.1.8.1 dev nkv21 table 121",
        ]
    );
}

/// Someone else's VLAN on a macvlan nodekeeper made: dropping the macvlan from the state, or
/// changing it so that it must be re-created, would take their VLAN with it (the kernel deletes
/// upper devices with their lower one). The plan is refused, naming both and the fix.
#[test]
fn a_link_carrying_someone_elses_interface_is_never_deleted() {
    let mut applied = simulate(host(), &plan(&bm_desired(), &host()).unwrap());
    let nkm21 = applied.link_by_name("nkm21").unwrap().index;
    applied.links.push(ObservedLink {
        kind: "vlan".into(),
        parent_index: Some(nkm21),
        vlan_id: Some(99),
        ..link(90, "theirs.99", "02:00:17:1b:08:21")
    });

    let e = plan(&NetworkState::default(), &applied)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "link nkm21 was created by nodekeeper and this state removes it, but theirs.99 (not \
         created by nodekeeper) is on it and the kernel would delete theirs.99 with it; keep \
         nkm21 in links, or delete theirs.99 yourself first"
    );

    let mut d = bm_desired();
    d.links[1].mac = Some("02:00:17:1b:08:99".into());
    let e = plan(&d, &applied).unwrap_err().to_string();
    assert!(
        e.contains("this state re-creates it") && e.contains("leave nkm21 as it is"),
        "{e}"
    );

    // Without the foreign VLAN both plans go through, and leave nothing behind.
    applied.links.retain(|l| l.name != "theirs.99");
    let p = plan(&NetworkState::default(), &applied).unwrap();
    let after = simulate(applied, &p);
    assert!(after.links.iter().all(|l| !l.owned()));
}

#[test]
fn a_route_without_a_link_matches_the_link_the_kernel_picked() {
    // The kernel resolves a gateway route's outgoing link and reports it (oif): the planner
    // must not read that as a different route and add it again on every apply.
    let mut d = vm_desired();
    d.addresses.push(
        serde_json::from_value(serde_json::json!({"link": "vnic1", "cidr": "2001:db8:20::33/64"}))
            .unwrap(),
    );
    d.routes.push(
        serde_json::from_value(serde_json::json!({
            "destination": "2001:db8:99::/64", "gateway": "2001:db8:20::1", "table": 101
        }))
        .unwrap(),
    );
    let p = plan(&d, &host()).unwrap();
    assert!(
        ops(&p).contains(
            &"add-route 2001:db8:99::/64 via 2001:db8:20::1 table 101 metric 1024".to_string()
        ),
        "{:?}",
        ops(&p)
    );
    let mut after = simulate(host(), &p);
    for r in after
        .routes
        .iter_mut()
        .filter(|r| r.destination == "2001:db8:99::/64".parse::<IpNet>().unwrap())
    {
        assert_eq!(r.oif, None, "the simulation keeps what the plan said");
        r.oif = Some(3); // ens5, as the kernel reports it
    }
    assert_eq!(plan(&d, &after).unwrap(), Plan::default());

    // A changed gateway is still a different route: replaced, not kept.
    d.routes[1].gateway = Some("2001:db8:20::fe".into());
    let again = ops(&plan(&d, &after).unwrap());
    assert_eq!(
        again,
        vec![
            "delete-route 2001:db8:99::/64 via 2001:db8:20::1 dev ens5 table 101 metric 1024",
            "add-route 2001:db8:99::/64 via 2001:db8:20::fe table 101 metric 1024",
        ]
    );
}

/// A macvlan may not be larger than its parent: a parent's MTU is raised before a child is
/// created on it (the kernel answers EINVAL otherwise), and settings go parents first.
#[test]
fn a_parents_mtu_is_raised_before_a_child_is_created_on_it() {
    let mut obs = host();
    obs.links[1].mtu = 1400;
    let desired: NetworkState = serde_json::from_str(
        r#"{"links": [
              {"name": "mv1", "kind": "macvlan", "parent": "ens3", "mtu": 1500},
              {"name": "ens3", "kind": "existing", "mtu": 1500}
           ]}"#,
    )
    .unwrap();
    let p = plan(&desired, &obs).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "set-link ens3 mtu 1500",
            "create-link macvlan bridge on ens3 (mv1) mtu 1500 up",
        ]
    );
}

/// The kernel deletes every IPv4 route through a link that loses its last IPv4 address. A
/// changed address is added before the old one is deleted, so the link never has none and
/// the route stays (found by review: .33 → .34 left table 101 without its default route).
#[test]
fn a_changed_address_is_added_before_the_old_one_goes() {
    let applied = simulate(host(), &plan(&vm_desired(), &host()).unwrap());
    let mut d = vm_desired();
    d.addresses[0].cidr = "10.0.20.34/24".into();
    d.rules[0].from = Some("10.0.20.34/32".into());
    let p = plan(&d, &applied).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "delete-rule priority 20101 from 10.0.20.33/32 lookup 101",
            "add-address 10.0.20.34/24 dev ens5",
            "delete-address 10.0.20.33/24 dev ens5",
            "add-rule priority 20101 from 10.0.20.34/32 lookup 101",
        ]
    );
    let after = simulate(applied, &p);
    assert_eq!(after.routes.iter().filter(|r| r.table == 101).count(), 1);
    assert_eq!(plan(&d, &after).unwrap(), Plan::default());
}

/// IPv6 holds one address once per link whatever its prefix length, so a changed prefix
/// length deletes the old address first.
#[test]
fn a_changed_ipv6_prefix_length_deletes_first() {
    let mut d = vm_desired();
    d.addresses[0].cidr = "fd00:10:20::33/64".into();
    d.rules.clear();
    let applied = simulate(host(), &plan(&d, &host()).unwrap());
    d.addresses[0].cidr = "fd00:10:20::33/96".into();
    assert_eq!(
        ops(&plan(&d, &applied).unwrap()),
        vec![
            "delete-address fd00:10:20::33/64 dev ens5",
            "add-address fd00:10:20::33/96 dev ens5",
        ]
    );
}

/// A link left without IPv4 addresses, or taken down, loses its routes in the kernel (the
/// simulation does the same): the plan adds the routes it keeps there again, so that planning
/// after it finds nothing to do.
#[test]
fn routes_the_kernel_flushes_are_added_again() {
    let mut d = vm_desired();
    d.routes.push(
        serde_json::from_value(serde_json::json!({
            "destination": "::/0", "gateway": "fe80::1", "link": "vnic1", "table": 101
        }))
        .unwrap(),
    );
    let applied = simulate(host(), &plan(&d, &host()).unwrap());

    // The simulation flushes as the kernel does: the last IPv4 address takes the IPv4 routes.
    let last = Plan {
        steps: vec![Step::DeleteAddress(AddressDef {
            link: "ens5".into(),
            net: "10.0.20.33/24".parse().unwrap(),
        })],
    };
    let flushed = simulate(applied.clone(), &last);
    assert_eq!(
        flushed
            .routes
            .iter()
            .filter(|r| r.oif == Some(3))
            .map(|r| r.destination.to_string())
            .collect::<Vec<_>>(),
        vec!["::/0"]
    );

    // No address any more: the IPv4 route is flushed with the address and added again.
    let mut none = d.clone();
    none.addresses.clear();
    none.routes[0].on_link = true;
    let p = plan(&none, &applied).unwrap();
    let after = simulate(applied.clone(), &p);
    assert_eq!(
        plan(&none, &after).unwrap(),
        Plan::default(),
        "{:?}",
        ops(&p)
    );
    // ... which takes the route away in the simulation when the plan does not add it.
    let mut kept_route_only = d.clone();
    kept_route_only.addresses.clear();
    let p = plan(&kept_route_only, &applied).unwrap();
    assert!(
        ops(&p).contains(&"add-route 0.0.0.0/0 via 10.0.20.1 dev ens5 table 101".to_string()),
        "{:?}",
        ops(&p)
    );

    // Down: both families' routes go, and are planned again.
    let mut down = d.clone();
    down.links[0].up = Some(false);
    let p = plan(&down, &applied).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "set-link ens5 down",
            "add-route 0.0.0.0/0 via 10.0.20.1 dev ens5 table 101",
            "add-route ::/0 via fe80::1 dev ens5 table 101 metric 1024",
        ]
    );
    assert_eq!(
        plan(&down, &simulate(applied, &p)).unwrap(),
        Plan::default()
    );
}

/// The kernel stores an IPv6 route written with metric 0 with its default, 1024: the plan
/// writes 1024, so that a re-apply finds the route present.
#[test]
fn ipv6_metric_zero_is_the_kernels_1024() {
    let mut d = vm_desired();
    d.routes.push(
        serde_json::from_value(serde_json::json!({
            "destination": "::/0", "gateway": "fe80::1", "link": "vnic1", "table": 101, "metric": 0
        }))
        .unwrap(),
    );
    let p = plan(&d, &host()).unwrap();
    assert!(
        ops(&p).contains(&"add-route ::/0 via fe80::1 dev ens5 table 101 metric 1024".to_string()),
        "{:?}",
        ops(&p)
    );
}

/// A lowered MTU records the links the kernel lowers with it (the macvlan, and the VLAN on
/// it); rolling back raises the parent first and then gives each its MTU back; a set-link that
/// failed (and may have set the MTU) is undone as well.
#[test]
fn rollback_raises_parents_first_and_restores_lowered_children() {
    let mut applied = simulate(host(), &plan(&bm_desired(), &host()).unwrap());
    applied.links[1].mtu = 9000; // ens3
    let mut d = bm_desired();
    d.links.push(
        serde_json::from_value(
            serde_json::json!({"name": "ens3", "kind": "existing", "mtu": 1500}),
        )
        .unwrap(),
    );
    d.links[1].mtu = Some(1500); // nkm21
    d.links[0].mtu = Some(1500); // nkv21
    let p = plan(&d, &applied).unwrap();
    assert_eq!(
        ops(&p),
        vec![
            "set-link ens3 mtu 1500",
            "set-link nkm21 mtu 1500",
            "set-link nkv21 mtu 1500",
        ]
    );
    let Step::SetLink { lowered, .. } = &p.steps[0] else {
        panic!("{:?}", p.steps[0]);
    };
    assert_eq!(
        lowered,
        &vec![("nkm21".to_string(), 9000), ("nkv21".to_string(), 9000)]
    );
    let after = simulate(applied, &p);
    assert!(after.links.iter().all(|l| l.name == "lo" || l.mtu == 1500));

    // All made: undone parents first, the lowered links right after their parent.
    let undo: Vec<String> = rollback(&p.steps, None)
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        undo,
        vec![
            "ens3 mtu 9000",
            "nkm21 mtu 9000",
            "nkv21 mtu 9000",
            "nkm21 mtu 9000",
            "nkv21 mtu 9000",
            "nkv21 mtu 9000",
        ]
    );
    // The second failed: it is undone too, after its parent; an add that failed is not.
    let undo: Vec<String> = rollback(&p.steps[..1], Some(&p.steps[1]))
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        undo,
        vec![
            "ens3 mtu 9000",
            "nkm21 mtu 9000",
            "nkv21 mtu 9000",
            "nkm21 mtu 9000",
            "nkv21 mtu 9000",
        ]
    );
    let add = Step::AddAddress(AddressDef {
        link: "ens3".into(),
        net: "10.0.0.1/24".parse().unwrap(),
    });
    assert_eq!(rollback(&[], Some(&add)), Vec::new());
}

/// A VLAN or macvlan larger than its parent after the plan is refused, however the state
/// names the parent (here an existing link matched by MAC, which the model cannot see is the
/// parent), and also when the parent is lowered by a link further down: the kernel would
/// refuse the child (EINVAL) or lower it, and the plan would never settle.
#[test]
fn a_child_larger_than_its_parent_after_the_plan_is_refused() {
    let desired: NetworkState = serde_json::from_str(
        r#"{"links": [
              {"name": "uplink", "kind": "existing", "mac": "02:00:17:0a:11:01", "mtu": 1500},
              {"name": "mv1", "kind": "macvlan", "parent": "ens3", "mtu": 9000}
           ]}"#,
    )
    .unwrap();
    let e = plan(&desired, &host()).unwrap_err().to_string();
    assert_eq!(
        e,
        "links[1] (mv1): mtu 9000 is larger than the MTU 1500 its parent ens3 has or is given; \
         a VLAN or macvlan may not be larger than its parent: lower mtu or raise the parent's"
    );

    // Someone else's macvlan on ens3 carries ours: lowering ens3 lowers theirs, and ours.
    let mut obs = host();
    obs.links[1].mtu = 9000;
    obs.links.push(ObservedLink {
        kind: "macvlan".into(),
        parent_index: Some(2),
        mtu: 9000,
        ..link(9, "theirs", "02:aa:00:00:00:09")
    });
    let desired: NetworkState = serde_json::from_str(
        r#"{"links": [
              {"name": "ens3", "kind": "existing", "mtu": 1500},
              {"name": "mv1", "kind": "macvlan", "parent": "theirs", "mtu": 9000}
           ]}"#,
    )
    .unwrap();
    let e = plan(&desired, &obs).unwrap_err().to_string();
    assert!(
        e.contains("mtu 9000 is larger than the MTU 1500 its parent theirs"),
        "{e}"
    );
}
