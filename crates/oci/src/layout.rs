//! The host-side layout of OCI secondary VNICs: a pure function from the metadata answers (and
//! the host's interfaces) to a desired [`NetworkState`].
//!
//! It lives here rather than in `nodekeeper-netconf` because it is about OCI's metadata, and both
//! crates depend only on `nodekeeper-api`, whose model it produces.
//!
//! - VM: the interface whose MAC is the VNIC's `macAddr` gets the VNIC's addresses, MTU, up, its
//!   own table with a default route via the virtual router, and `from <ip>` rules.
//! - Bare metal: a macvlan with the VNIC's MAC on physical NIC `nicIndex`, a VLAN `vlanTag` on
//!   it, the addresses on the VLAN, and the same table and rules.
//! - The primary VNIC (first in the answer) and `169.254.0.0/16` are never touched; a rule
//!   `to 169.254.0.0/16 lookup main` ahead of the VNIC rules keeps the metadata service on the
//!   primary VNIC even for traffic from a secondary address.

use std::collections::BTreeMap;

use nodekeeper_model::network::{
    AddressSpec, LINK_LOCAL_V4, LinkKind, LinkSpec, MacvlanMode, NetworkState, RULE_PRIORITY_MAX,
    RULE_PRIORITY_MIN, RouteSpec, RuleSpec, TABLE_MAIN, format_errors, format_mac, parse_mac,
};

use crate::metadata::{Instance, Vnic};

/// One interface of the host, as the agent reads it from sysfs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInterface {
    pub name: String,
    pub mac: String,
    /// PCI address (`/sys/class/net/<name>/device` link target) for physical NICs; `None` for
    /// virtual devices. Physical NICs sorted by PCI address are numbered like `nicIndex`.
    pub pci_address: Option<String>,
}

/// Knobs of the layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutOptions {
    /// VNIC number `i` (its position in the answer) uses table `table_base + i`.
    pub table_base: u32,
    /// The metadata-protecting rule uses this priority; VNIC `i` uses `rule_priority_base + i`.
    pub rule_priority_base: u32,
    /// MTU of VNIC interfaces (OCI uses 9000).
    pub mtu: u32,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        Self {
            table_base: 100,
            rule_priority_base: 20100,
            mtu: 9000,
        }
    }
}

/// The desired state for the VNICs that can be configured now, and what the rest wait for.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub desired: NetworkState,
    /// One line per VNIC left out for now, saying what it waits for.
    pub waiting: Vec<String>,
    /// The VNICs laid out in `desired`: (VNIC OCID, MAC).
    pub vnics: Vec<(String, String)>,
}

/// Why no layout can be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("vnics[{index}].{field}: {message}")]
    BadVnic {
        index: usize,
        field: String,
        message: String,
    },
    #[error("layout options: {0}")]
    BadOptions(String),
    #[error("the resulting state is invalid: {0}")]
    Invalid(String),
}

/// Builds the desired state of every secondary VNIC in `vnics` (the `/opc/v2/vnics/` answer).
pub fn secondary_vnics(
    instance: &Instance,
    vnics: &[Vnic],
    host: &[HostInterface],
    opts: &LayoutOptions,
) -> Result<Layout, LayoutError> {
    // Both bases come from the request: their sums with the VNIC count are checked, never
    // wrapped (a wrapped range would pass the checks below and number rules and tables at 0).
    let n = u32::try_from(vnics.len()).unwrap_or(u32::MAX);
    let priority_end = opts.rule_priority_base.checked_add(n);
    if opts.rule_priority_base < RULE_PRIORITY_MIN
        || priority_end.is_none_or(|end| end > RULE_PRIORITY_MAX)
    {
        return Err(LayoutError::BadOptions(format!(
            "rule_priority_base {}: rule priorities {}–{} for {n} VNICs leave nodekeeper's range \
             {RULE_PRIORITY_MIN}–{RULE_PRIORITY_MAX}",
            opts.rule_priority_base,
            opts.rule_priority_base,
            u64::from(opts.rule_priority_base) + u64::from(n)
        )));
    }
    if opts.table_base == 0 {
        return Err(LayoutError::BadOptions(
            "table_base 0: table 0 is not a routing table; use 1 or more".into(),
        ));
    }
    let Some(table_end) = opts.table_base.checked_add(n) else {
        return Err(LayoutError::BadOptions(format!(
            "table_base {}: the tables of {n} VNICs would pass the largest table number {}; \
             lower table_base",
            opts.table_base,
            u32::MAX
        )));
    };
    let tables = opts.table_base..table_end;
    if tables.contains(&TABLE_MAIN) || tables.contains(&253) || tables.contains(&255) {
        return Err(LayoutError::BadOptions(format!(
            "table_base {}: tables {}–{} overlap the kernel's reserved tables 253–255",
            opts.table_base,
            tables.start,
            tables.end.saturating_sub(1)
        )));
    }
    // Conflicts between VNICs are refused before anything else.
    let mut macs: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, v) in vnics.iter().enumerate() {
        if let Some(j) = macs.insert(v.mac_addr.as_str(), i) {
            return Err(LayoutError::BadVnic {
                index: i,
                field: "macAddr".into(),
                message: format!(
                    "{} is also the MAC of vnics[{j}]; two VNICs cannot share a MAC",
                    v.mac_addr
                ),
            });
        }
    }
    // No VNIC may carry an address another one has: above all the primary's, which is never
    // touched (laying it out on a secondary would steal the node's own address).
    let mut ips: BTreeMap<std::net::IpAddr, usize> = BTreeMap::new();
    for (i, v) in vnics.iter().enumerate() {
        let v4 = v
            .ipv4
            .iter()
            .map(|x| ("privateIp".to_string(), x.private_ip.into()));
        let v6 = v.ipv6.iter().flat_map(|x| {
            x.addresses
                .iter()
                .enumerate()
                .map(|(k, a)| (format!("ipv6Addresses[{k}]"), (*a).into()))
        });
        for (field, ip) in v4.chain(v6).collect::<Vec<(String, std::net::IpAddr)>>() {
            match ips.insert(ip, i) {
                Some(0) if i > 0 => {
                    return Err(LayoutError::BadVnic {
                        index: i,
                        field: field.clone(),
                        message: format!(
                            "{ip} is also an address of vnics[0]; the primary VNIC is never \
                             touched, so no secondary may reuse its address"
                        ),
                    });
                }
                Some(j) if j != i => {
                    return Err(LayoutError::BadVnic {
                        index: i,
                        field: field.clone(),
                        message: format!(
                            "{ip} is also an address of vnics[{j}]; two VNICs cannot share an address"
                        ),
                    });
                }
                _ => {}
            }
        }
    }

    let bare_metal = instance.is_bare_metal();
    let mut physical: Vec<&HostInterface> =
        host.iter().filter(|h| h.pci_address.is_some()).collect();
    physical.sort_by(|a, b| a.pci_address.cmp(&b.pci_address));
    let host_by_mac = |mac: &str| {
        host.iter()
            .find(|h| parse_mac(&h.mac).map(|m| format_mac(&m)).as_deref() == Some(mac))
    };

    let mut out = Layout {
        desired: NetworkState::default(),
        waiting: Vec::new(),
        vnics: Vec::new(),
    };
    for (i, v) in vnics.iter().enumerate().skip(1) {
        let table = opts.table_base + i as u32;
        let priority = opts.rule_priority_base + i as u32;
        let bad = |field: &str, message: String| LayoutError::BadVnic {
            index: i,
            field: field.into(),
            message,
        };
        let carrier = if bare_metal {
            let Some(nic) = v.nic_index else {
                return Err(bad(
                    "nicIndex",
                    "missing on a bare-metal shape: it says which physical NIC carries the VNIC"
                        .into(),
                ));
            };
            if v.vlan_tag == 0 {
                return Err(bad(
                    "vlanTag",
                    "0 on a bare-metal secondary VNIC, which needs its VLAN".into(),
                ));
            }
            let Some(parent) = physical.get(nic as usize) else {
                out.waiting.push(format!(
                    "vnics[{i}] ({}): waiting for physical NIC {nic} (the host shows {} physical NICs)",
                    v.vnic_id,
                    physical.len()
                ));
                continue;
            };
            let mv = format!("nkm{}", v.vlan_tag);
            let vl = format!("nkv{}", v.vlan_tag);
            out.desired.links.push(LinkSpec {
                name: mv.clone(),
                kind: LinkKind::Macvlan,
                mac: Some(v.mac_addr.clone()),
                parent: Some(parent.name.clone()),
                vlan_id: None,
                macvlan_mode: Some(MacvlanMode::Bridge),
                mtu: Some(opts.mtu),
                up: Some(true),
            });
            out.desired.links.push(LinkSpec {
                name: vl.clone(),
                kind: LinkKind::Vlan,
                mac: None,
                parent: Some(mv),
                vlan_id: Some(v.vlan_tag),
                macvlan_mode: None,
                mtu: Some(opts.mtu),
                up: Some(true),
            });
            vl
        } else {
            if host_by_mac(&v.mac_addr).is_none() {
                out.waiting.push(format!(
                    "vnics[{i}] ({}): waiting for an interface with MAC {} (the attachment is not visible to the guest yet)",
                    v.vnic_id, v.mac_addr
                ));
                continue;
            }
            let name = format!("vnic{i}");
            out.desired.links.push(LinkSpec {
                name: name.clone(),
                kind: LinkKind::Existing,
                mac: Some(v.mac_addr.clone()),
                parent: None,
                vlan_id: None,
                macvlan_mode: None,
                mtu: Some(opts.mtu),
                up: Some(true),
            });
            name
        };
        out.vnics.push((v.vnic_id.clone(), v.mac_addr.clone()));
        if let Some(v4) = &v.ipv4 {
            out.desired.addresses.push(AddressSpec {
                link: carrier.clone(),
                cidr: format!("{}/{}", v4.private_ip, v4.subnet.prefix_len()),
            });
            out.desired.routes.push(RouteSpec {
                destination: "default".into(),
                gateway: Some(v4.virtual_router_ip.to_string()),
                link: Some(carrier.clone()),
                table,
                metric: None,
                on_link: false,
            });
            out.desired.rules.push(RuleSpec {
                from: Some(format!("{}/32", v4.private_ip)),
                to: None,
                table,
                priority,
            });
        }
        if let Some(v6) = &v.ipv6 {
            for a in &v6.addresses {
                out.desired.addresses.push(AddressSpec {
                    link: carrier.clone(),
                    cidr: format!("{a}/{}", v6.subnet.prefix_len()),
                });
                out.desired.rules.push(RuleSpec {
                    from: Some(format!("{a}/128")),
                    to: None,
                    table,
                    priority,
                });
            }
            out.desired.routes.push(RouteSpec {
                destination: "::/0".into(),
                gateway: Some(v6.virtual_router_ip.to_string()),
                link: Some(carrier.clone()),
                table,
                metric: None,
                on_link: false,
            });
        }
    }
    if out
        .desired
        .rules
        .iter()
        .any(|r| r.from.as_deref().is_some_and(|f| !f.contains(':')))
    {
        out.desired.rules.insert(
            0,
            RuleSpec {
                from: None,
                to: Some(LINK_LOCAL_V4.into()),
                table: TABLE_MAIN,
                priority: opts.rule_priority_base,
            },
        );
    }
    out.desired
        .validate()
        .map_err(|e| LayoutError::Invalid(format_errors(&e)))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{parse_instance, parse_vnics};
    use pretty_assertions::assert_eq;

    fn fixture(name: &str) -> String {
        std::fs::read_to_string(format!(
            "{}/tests/fixtures/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    }

    fn vm() -> Instance {
        parse_instance(&fixture("instance-vm.json")).unwrap()
    }
    fn bm() -> Instance {
        parse_instance(&fixture("instance-bm.json")).unwrap()
    }

    fn iface(name: &str, mac: &str, pci: Option<&str>) -> HostInterface {
        HostInterface {
            name: name.into(),
            mac: mac.into(),
            pci_address: pci.map(Into::into),
        }
    }

    fn vm_host() -> Vec<HostInterface> {
        vec![
            iface("ens3", "02:00:17:0a:11:01", Some("0000:00:03.0")),
            iface("ens5", "02:00:17:0A:22:02", Some("0000:00:05.0")),
            iface("ens6", "02:00:17:0a:33:03", Some("0000:00:06.0")),
        ]
    }

    fn bm_host() -> Vec<HostInterface> {
        vec![
            iface("ens300f1", "b8:ce:f6:10:20:31", Some("0000:31:00.1")),
            iface("ens300f0", "b8:ce:f6:10:20:30", Some("0000:31:00.0")),
            iface("docker0", "02:42:00:00:00:01", None),
        ]
    }

    #[test]
    fn vm_layout_matches_by_mac_and_skips_the_primary() {
        let vnics = parse_vnics(&fixture("vnics-vm.json")).unwrap();
        let l = secondary_vnics(&vm(), &vnics, &vm_host(), &LayoutOptions::default()).unwrap();
        assert!(l.waiting.is_empty());
        let want: NetworkState = serde_json::from_str(
            r#"{
              "links": [
                {"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true},
                {"name": "vnic2", "kind": "existing", "mac": "02:00:17:0a:33:03", "mtu": 9000, "up": true}
              ],
              "addresses": [
                {"link": "vnic1", "cidr": "10.0.20.33/24"},
                {"link": "vnic2", "cidr": "10.0.30.45/23"},
                {"link": "vnic2", "cidr": "fd00:10:30::45/64"}
              ],
              "routes": [
                {"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101},
                {"destination": "default", "gateway": "10.0.30.1", "link": "vnic2", "table": 102},
                {"destination": "::/0", "gateway": "fd00:10:30::1", "link": "vnic2", "table": 102}
              ],
              "rules": [
                {"to": "169.254.0.0/16", "table": 254, "priority": 20100},
                {"from": "10.0.20.33/32", "table": 101, "priority": 20101},
                {"from": "10.0.30.45/32", "table": 102, "priority": 20102},
                {"from": "fd00:10:30::45/128", "table": 102, "priority": 20102}
              ]
            }"#,
        )
        .unwrap();
        assert_eq!(l.desired, want);
    }

    #[test]
    fn bm_layout_builds_macvlan_and_vlan_on_the_nic_by_index() {
        let vnics = parse_vnics(&fixture("vnics-bm.json")).unwrap();
        let l = secondary_vnics(&bm(), &vnics, &bm_host(), &LayoutOptions::default()).unwrap();
        type Row = (String, Option<String>, Option<u16>, Option<String>);
        let links: Vec<Row> = l
            .desired
            .links
            .iter()
            .map(|x| (x.name.clone(), x.parent.clone(), x.vlan_id, x.mac.clone()))
            .collect();
        assert_eq!(
            links,
            vec![
                (
                    "nkm21".into(),
                    Some("ens300f0".into()),
                    None,
                    Some("02:00:17:1b:08:21".into())
                ),
                ("nkv21".into(), Some("nkm21".into()), Some(21), None),
                (
                    "nkm37".into(),
                    Some("ens300f1".into()),
                    None,
                    Some("02:00:17:1b:10:09".into())
                ),
                ("nkv37".into(), Some("nkm37".into()), Some(37), None),
            ]
        );
        assert_eq!(
            l.desired.addresses[0],
            AddressSpec {
                link: "nkv21".into(),
                cidr: "10.1.8.21/22".into()
            }
        );
        assert_eq!(l.desired.routes[1].table, 102);
        assert_eq!(l.desired.rules.len(), 3);
    }

    #[test]
    fn vnic_without_interface_waits_and_the_rest_is_planned() {
        let vnics = parse_vnics(&fixture("vnics-vm.json")).unwrap();
        let host = &vm_host()[..2];
        let l = secondary_vnics(&vm(), &vnics, host, &LayoutOptions::default()).unwrap();
        assert_eq!(
            l.waiting,
            vec![
                "vnics[2] (ocid1.vnic.oc1.phx.example2third): waiting for an interface with MAC 02:00:17:0a:33:03 \
                 (the attachment is not visible to the guest yet)"
            ]
        );
        assert_eq!(l.desired.links.len(), 1);
        assert_eq!(l.desired.rules.len(), 2);
        // Only the VNIC laid out is named (what the agent tells the controller is on the host).
        assert_eq!(l.vnics.len(), 1);
        assert_eq!(l.vnics[0].1, "02:00:17:0a:22:02");
        assert_ne!(l.vnics[0].0, "ocid1.vnic.oc1.phx.example2third");
    }

    #[test]
    fn ipv6_only_vnic_gets_no_ipv4_and_no_imds_rule() {
        let vnics = parse_vnics(&fixture("vnics-vm-ipv6-only.json")).unwrap();
        let host = vec![iface("ens7", "02:00:17:0a:44:04", Some("0000:00:07.0"))];
        let l = secondary_vnics(&vm(), &vnics, &host, &LayoutOptions::default()).unwrap();
        assert_eq!(
            l.desired.addresses,
            vec![AddressSpec {
                link: "vnic1".into(),
                cidr: "fd00:10:40::44/64".into()
            }]
        );
        assert_eq!(l.desired.routes.len(), 1);
        assert_eq!(l.desired.routes[0].destination, "::/0");
        assert_eq!(l.desired.rules.len(), 1);
    }

    #[test]
    fn bad_inputs_give_precise_errors() {
        let e = parse_vnics(&fixture("vnics-vm-null-subnet.json"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "vnics[1].subnetCidrBlock: expected a CIDR, got \"<null>\" (the VNIC has an IPv4 privateIp)"
        );

        let vnics = parse_vnics(&fixture("vnics-bm-no-nic-index.json")).unwrap();
        let e = secondary_vnics(&bm(), &vnics, &bm_host(), &LayoutOptions::default())
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "vnics[1].nicIndex: missing on a bare-metal shape: it says which physical NIC carries the VNIC"
        );

        let vnics = parse_vnics(&fixture("vnics-vm-duplicate-mac.json")).unwrap();
        let e = secondary_vnics(&vm(), &vnics, &vm_host(), &LayoutOptions::default())
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "vnics[2].macAddr: 02:00:17:0a:22:02 is also the MAC of vnics[1]; two VNICs cannot share a MAC"
        );

        let vnics = parse_vnics(&fixture("vnics-vm.json")).unwrap();
        let opts = LayoutOptions {
            table_base: 253,
            ..Default::default()
        };
        assert!(matches!(
            secondary_vnics(&vm(), &vnics, &vm_host(), &opts),
            Err(LayoutError::BadOptions(_))
        ));
        let opts = LayoutOptions {
            mtu: 60,
            ..Default::default()
        };
        let e = secondary_vnics(&vm(), &vnics, &vm_host(), &opts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("links[0].mtu: 60 is outside 68–65535"), "{e}");
    }

    /// Bases near `u32::MAX` are refused naming the field, never wrapped (which would number
    /// the rules and tables from 0) nor a panic.
    #[test]
    fn bases_whose_ranges_overflow_are_refused_naming_the_field() {
        let vnics = parse_vnics(&fixture("vnics-vm.json")).unwrap();
        let n = vnics.len();
        let refused = |opts: LayoutOptions| match secondary_vnics(&vm(), &vnics, &vm_host(), &opts)
        {
            Err(LayoutError::BadOptions(m)) => m,
            other => panic!("{opts:?}: {other:?}"),
        };
        for base in [u32::MAX, u32::MAX - 1] {
            let m = refused(LayoutOptions {
                rule_priority_base: base,
                ..Default::default()
            });
            assert_eq!(
                m,
                format!(
                    "rule_priority_base {base}: rule priorities {base}–{} for {n} VNICs leave \
                     nodekeeper's range 20000–20999",
                    u64::from(base) + n as u64
                )
            );
            let m = refused(LayoutOptions {
                table_base: base,
                ..Default::default()
            });
            assert_eq!(
                m,
                format!(
                    "table_base {base}: the tables of {n} VNICs would pass the largest table \
                     number 4294967295; lower table_base"
                )
            );
        }
        let m = refused(LayoutOptions {
            table_base: 0,
            ..Default::default()
        });
        assert!(m.starts_with("table_base 0: "), "{m}");
        // The last base that fits is laid out.
        let l = secondary_vnics(
            &vm(),
            &vnics,
            &vm_host(),
            &LayoutOptions {
                table_base: u32::MAX - n as u32,
                rule_priority_base: RULE_PRIORITY_MAX - n as u32,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(!l.desired.routes.is_empty());
        assert!(
            l.desired
                .routes
                .iter()
                .all(|r| r.table >= u32::MAX - n as u32)
        );
    }

    #[test]
    fn dual_stack_and_multi_ipv6_vnics_get_one_rule_per_address_in_one_table() {
        let vnics = parse_vnics(&fixture("vnics-vm-dual-stack.json")).unwrap();
        let l = secondary_vnics(&vm(), &vnics, &vm_host(), &LayoutOptions::default()).unwrap();
        let rules: Vec<(Option<String>, u32, u32)> = l
            .desired
            .rules
            .iter()
            .map(|r| (r.from.clone(), r.table, r.priority))
            .collect();
        assert_eq!(
            rules,
            vec![
                (None, 254, 20100),
                (Some("10.0.20.33/32".into()), 101, 20101),
                (Some("fd00:10:20::33/128".into()), 101, 20101),
            ]
        );
        // The primary's addresses (v4 and v6) are nowhere in the layout.
        assert!(
            l.desired
                .addresses
                .iter()
                .all(|a| !a.cidr.starts_with("10.0.10.17/")
                    && !a.cidr.starts_with("fd00:10:10::17/")),
            "{:?}",
            l.desired.addresses
        );

        let vnics = parse_vnics(&fixture("vnics-vm-multi-ipv6.json")).unwrap();
        let l = secondary_vnics(&vm(), &vnics, &vm_host(), &LayoutOptions::default()).unwrap();
        let cidrs: Vec<&str> = l
            .desired
            .addresses
            .iter()
            .map(|a| a.cidr.as_str())
            .collect();
        assert_eq!(
            cidrs,
            vec![
                "10.0.20.33/24",
                "fd00:10:20::33/64",
                "fd00:10:20::34/64",
                "fd00:10:20::35/64"
            ]
        );
        assert_eq!(l.desired.rules.len(), 5);
        assert_eq!(l.desired.routes.len(), 2);
    }

    #[test]
    fn a_vnic_that_reuses_the_primary_address_is_refused() {
        for (file, field, ip) in [
            ("vnics-vm-reuses-primary-ip.json", "privateIp", "10.0.10.17"),
            (
                "vnics-vm-reuses-primary-ipv6.json",
                "ipv6Addresses[0]",
                "fd00:10:10::17",
            ),
        ] {
            let vnics = parse_vnics(&fixture(file)).unwrap();
            let e = secondary_vnics(&vm(), &vnics, &vm_host(), &LayoutOptions::default())
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!(
                    "vnics[1].{field}: {ip} is also an address of vnics[0]; the primary VNIC is \
                     never touched, so no secondary may reuse its address"
                ),
                "{file}"
            );
        }
    }

    #[test]
    fn bm_nic_index_beyond_the_host_waits() {
        let vnics = parse_vnics(&fixture("vnics-bm.json")).unwrap();
        let host = &bm_host()[1..];
        let l = secondary_vnics(&bm(), &vnics, host, &LayoutOptions::default()).unwrap();
        assert_eq!(
            l.waiting,
            vec![
                "vnics[2] (ocid1.vnic.oc1.iad.examplebm2): waiting for physical NIC 1 (the host shows 1 physical NICs)"
            ]
        );
        assert_eq!(l.desired.links.len(), 2);
    }
}
