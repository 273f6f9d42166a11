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
            link(2, "ens3", "02:00:17:0a:11:01"),
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
            prev_up: true
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
