//! Network interfaces as the kernel reports them: a read-only rtnetlink dump of links and
//! addresses in the agent's network namespace (the host's, with hostNetwork), and which of them
//! are pods' host-side links ([`Interface::is_pod_link`]), which the report counts, not lists.

use std::collections::BTreeMap;
use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkInfo, LinkMessage};

use super::CollectError;

/// One interface, in the proto's `ObservedInterface` terms.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub mac: String,
    pub mtu: u32,
    pub up: bool,
    pub oper_state: String,
    pub kind: String,
    /// CIDR strings, sorted.
    pub addresses: Vec<String>,
    /// True when nodekeeper created this link (its alias carries netconf's ownership mark) or
    /// configures it (the agent adds what the network manager's applied state names).
    pub managed: bool,
    /// The link's peer or parent lives in another network namespace (the kernel sends
    /// IFLA_LINK_NETNSID): for a veth, the other end was moved into a container's namespace.
    pub peer_netns: bool,
}

impl Interface {
    /// A pod's host-side link: a veth (or netkit, Cilium's replacement for it) whose peer is in
    /// another network namespace, and that nodekeeper does not manage. CNI plugins create one
    /// per pod (cali*, lxc*, veth*, ...) and delete it with the pod, so listing them would make
    /// the report change with every pod and grow with the pod count; the report counts them
    /// instead. nodekeeper's own veths stay listed whatever their peer.
    pub fn is_pod_link(&self) -> bool {
        self.peer_netns && !self.managed && matches!(self.kind.as_str(), "veth" | "netkit")
    }
}

/// Takes the pod links ([`Interface::is_pod_link`]) out of `interfaces`, keeping the order of the
/// rest; returns how many there were.
pub fn remove_pod_links(interfaces: &mut Vec<Interface>) -> u32 {
    let before = interfaces.len();
    interfaces.retain(|i| !i.is_pod_link());
    u32::try_from(before - interfaces.len()).unwrap_or(u32::MAX)
}

/// Formats a hardware address as lower-case colon-separated hex; all-zero (loopback) is "none".
pub fn format_mac(bytes: &[u8]) -> String {
    if bytes.iter().all(|b| *b == 0) {
        return String::new();
    }
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Converts one link message; `None` for a link without a name.
pub fn from_link(msg: &LinkMessage) -> Option<Interface> {
    let mut iface = Interface {
        index: msg.header.index,
        up: msg.header.flags.contains(LinkFlags::Up),
        ..Interface::default()
    };
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(name) => iface.name = name.clone(),
            LinkAttribute::Address(mac) => iface.mac = format_mac(mac),
            LinkAttribute::Mtu(mtu) => iface.mtu = *mtu,
            LinkAttribute::OperState(state) => iface.oper_state = state.to_string().to_lowercase(),
            LinkAttribute::IfAlias(alias) => {
                iface.managed = alias.starts_with(nodekeeper_netconf::LINK_ALIAS_PREFIX);
            }
            LinkAttribute::LinkNetNsId(_) => iface.peer_netns = true,
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::Kind(kind) = info {
                        iface.kind = kind.to_string();
                    }
                }
            }
            _ => {}
        }
    }
    (!iface.name.is_empty()).then_some(iface)
}

/// The (interface index, CIDR) of one address message. IPv4 point-to-point links carry the
/// local address in IFA_LOCAL and the peer in IFA_ADDRESS, so IFA_LOCAL wins when present.
pub fn from_address(msg: &AddressMessage) -> Option<(u32, String)> {
    let mut address: Option<IpAddr> = None;
    for attr in &msg.attributes {
        match attr {
            AddressAttribute::Local(ip) => address = Some(*ip),
            AddressAttribute::Address(ip) if address.is_none() => address = Some(*ip),
            _ => {}
        }
    }
    address.map(|ip| (msg.header.index, format!("{ip}/{}", msg.header.prefix_len)))
}

/// Dumps links and addresses and joins them, sorted by name.
pub async fn collect() -> Result<Vec<Interface>, CollectError> {
    let netlink = |e: rtnetlink::Error| CollectError::Netlink(e.to_string());
    let (connection, handle, _) =
        rtnetlink::new_connection().map_err(|e| CollectError::Netlink(e.to_string()))?;
    let task = tokio::spawn(connection);
    let result = async {
        let links: Vec<LinkMessage> = handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(netlink)?;
        let addresses: Vec<AddressMessage> = handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(netlink)?;
        Ok::<_, CollectError>((links, addresses))
    }
    .await;
    drop(handle);
    task.abort();
    let (links, addresses) = result?;
    Ok(join(&links, &addresses))
}

/// Attaches addresses to their links and sorts by name.
pub fn join(links: &[LinkMessage], addresses: &[AddressMessage]) -> Vec<Interface> {
    let mut by_index: BTreeMap<u32, Interface> = links
        .iter()
        .filter_map(from_link)
        .map(|i| (i.index, i))
        .collect();
    for (index, cidr) in addresses.iter().filter_map(from_address) {
        if let Some(iface) = by_index.get_mut(&index) {
            iface.addresses.push(cidr);
        }
    }
    let mut out: Vec<Interface> = by_index.into_values().collect();
    for iface in &mut out {
        iface.addresses.sort();
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::link::{InfoKind, State};

    #[test]
    fn formats_mac() {
        assert_eq!(
            format_mac(&[0x02, 0, 0x17, 0xAB, 0xcd, 1]),
            "02:00:17:ab:cd:01"
        );
        assert_eq!(format_mac(&[0; 6]), "");
    }

    #[test]
    fn joins_links_and_addresses() {
        let mut link = LinkMessage::default();
        link.header.index = 2;
        link.header.flags = LinkFlags::Up;
        link.attributes = vec![
            LinkAttribute::IfName("ens3".into()),
            LinkAttribute::Mtu(9000),
            LinkAttribute::OperState(State::Up),
            LinkAttribute::Address(vec![2, 0, 0x17, 1, 2, 3]),
        ];
        let mut addr = AddressMessage::default();
        addr.header.index = 2;
        addr.header.prefix_len = 24;
        addr.attributes = vec![AddressAttribute::Address("10.0.0.5".parse().unwrap())];
        let mut stray = AddressMessage::default();
        stray.header.index = 99;
        stray.attributes = vec![AddressAttribute::Address("10.9.9.9".parse().unwrap())];
        let mut created = LinkMessage::default();
        created.header.index = 3;
        created.attributes = vec![
            LinkAttribute::IfName("nkm0".into()),
            LinkAttribute::IfAlias("nodekeeper:nkm0".into()),
        ];
        let mut foreign = LinkMessage::default();
        foreign.header.index = 4;
        foreign.attributes = vec![
            LinkAttribute::IfName("other".into()),
            LinkAttribute::IfAlias("someone else's".into()),
        ];
        let out = join(&[link, created, foreign], &[addr, stray]);
        assert_eq!(
            out[0],
            Interface {
                name: "ens3".into(),
                index: 2,
                mac: "02:00:17:01:02:03".into(),
                mtu: 9000,
                up: true,
                oper_state: "up".into(),
                kind: String::new(),
                addresses: vec!["10.0.0.5/24".into()],
                managed: false,
                peer_netns: false,
            }
        );
        let managed: Vec<(&str, bool)> = out.iter().map(|i| (i.name.as_str(), i.managed)).collect();
        assert_eq!(
            managed,
            vec![("ens3", false), ("nkm0", true), ("other", false)]
        );
    }

    fn link(index: u32, name: &str, kind: InfoKind, netns_id: Option<i32>) -> LinkMessage {
        let mut link = LinkMessage::default();
        link.header.index = index;
        link.attributes = vec![
            LinkAttribute::IfName(name.into()),
            LinkAttribute::LinkInfo(vec![LinkInfo::Kind(kind)]),
        ];
        link.attributes
            .extend(netns_id.map(LinkAttribute::LinkNetNsId));
        link
    }

    #[test]
    fn a_veth_with_its_peer_elsewhere_is_a_pod_link() {
        let pod = from_link(&link(7, "cali1234", InfoKind::Veth, Some(3))).unwrap();
        assert!(pod.peer_netns && pod.is_pod_link(), "{pod:?}");
        // Both ends here: not a pod's.
        let local = from_link(&link(8, "veth-a", InfoKind::Veth, None)).unwrap();
        assert!(!local.peer_netns && !local.is_pod_link(), "{local:?}");
        // A VLAN whose parent is elsewhere is not a pod link: only veth and netkit are.
        let vlan = from_link(&link(9, "vlan9", InfoKind::Vlan, Some(3))).unwrap();
        assert!(vlan.peer_netns && !vlan.is_pod_link(), "{vlan:?}");
        let netkit = from_link(&link(10, "lxc1", InfoKind::Netkit, Some(4))).unwrap();
        assert!(netkit.is_pod_link(), "{netkit:?}");
        // nodekeeper's own veth stays listed wherever its peer is.
        let mut ours = link(11, "nkv0", InfoKind::Veth, Some(3));
        ours.attributes
            .push(LinkAttribute::IfAlias("nodekeeper:nkv0".into()));
        let ours = from_link(&ours).unwrap();
        assert!(ours.managed && !ours.is_pod_link(), "{ours:?}");

        let mut all = vec![local, pod, ours, netkit, vlan];
        assert_eq!(remove_pod_links(&mut all), 2);
        let names: Vec<&str> = all.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["veth-a", "nkv0", "vlan9"]);
    }

    /// A real veth pair with one end moved into another namespace, seen from a namespace that
    /// stands in for the host: the host-side end is counted in the report, not listed, and a veth
    /// with both ends here, and nodekeeper's own veth to elsewhere, stay listed. Only namespaces
    /// this test creates are touched.
    #[test]
    fn a_pods_veth_is_counted_not_listed() -> Result<(), nodekeeper_testkit::Error> {
        nodekeeper_testkit::skip_unless_root!("needs root to create network namespaces");
        let host = nodekeeper_testkit::Netns::new("nk-podlinks-host")?;
        let pod = nodekeeper_testkit::Netns::new("nk-podlinks-pod")?;
        host.add_veth("nkpod0", &[], "eth0", Some(&pod))?;
        host.add_veth("nkloc0", &[], "nkloc1", None)?;
        host.add_veth("nkown0", &[], "eth1", Some(&pod))?;
        host.ip(&["link", "set", "nkown0", "alias", "nodekeeper:nkown0"])?;
        let interfaces = host.run(|| async { collect().await.expect("dump links") });
        let by_name = |name: &str| interfaces.iter().find(|i| i.name == name).cloned();
        assert!(
            by_name("nkpod0").is_some_and(|i| i.is_pod_link()),
            "{interfaces:?}"
        );
        let report = crate::report::assemble(
            crate::report::Inputs {
                interfaces,
                ..Default::default()
            },
            &[],
        );
        let names: Vec<&str> = report.interfaces.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            ["lo", "nkloc0", "nkloc1", "nkown0"],
            "{:?}",
            report.interfaces
        );
        assert_eq!(report.pod_links, 1);
        Ok(())
    }

    #[tokio::test]
    async fn dumps_this_namespace() {
        let out = collect().await.unwrap();
        let lo = out
            .iter()
            .find(|i| i.name == "lo")
            .expect("every namespace has lo");
        assert!(lo.addresses.iter().any(|a| a == "127.0.0.1/8"), "{lo:?}");
    }
}
