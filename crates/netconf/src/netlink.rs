//! The rtnetlink side: one connection per [`Netconf`], state dumps into [`Observed`], and one
//! netlink write per plan step (two for a created link: create, then alias), each counted.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use ipnet::IpNet;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::address::{
    AddressAttribute, AddressMessage, AddressProtocol, AddressScope,
};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoMacVlan, InfoVlan, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
    MacVlanMode,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
    RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use nodekeeper_model::network::{MacvlanMode as ApiMode, format_mac};
use rtnetlink::Handle;

use crate::NetconfError;
use crate::observed::{
    NK_PROTOCOL, Observed, ObservedAddress, ObservedLink, ObservedRoute, ObservedRule,
};
use crate::plan::{AddressDef, CreatedKind, LinkDef, RouteDef, RuleDef, Step, link_alias};

/// A netlink connection to the network namespace of the thread that opened it.
#[derive(Clone)]
pub struct Link {
    handle: Handle,
    writes: Arc<AtomicU64>,
}

fn errno_error(code: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(code.abs())
}

impl Link {
    /// Opens the connection and spawns its task on the current tokio runtime.
    pub fn connect() -> Result<Self, NetconfError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetconfError::Connect)?;
        tokio::spawn(conn);
        Ok(Self {
            handle,
            writes: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Netlink write requests sent so far through this connection.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    async fn dump(
        &self,
        what: &'static str,
        msg: RouteNetlinkMessage,
    ) -> Result<Vec<RouteNetlinkMessage>, NetconfError> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let mut handle = self.handle.clone();
        let mut resp = handle.request(req).map_err(|e| NetconfError::Read {
            what,
            message: e.to_string(),
        })?;
        let mut out = Vec::new();
        while let Some(m) = resp.next().await {
            match m.payload {
                NetlinkPayload::InnerMessage(x) => out.push(x),
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    return Err(NetconfError::Read {
                        what,
                        message: errno_error(e.raw_code()).to_string(),
                    });
                }
                _ => {}
            }
        }
        Ok(out)
    }

    async fn write(&self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), std::io::Error> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        let mut handle = self.handle.clone();
        let mut resp = handle
            .request(req)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        while let Some(m) = resp.next().await {
            if let NetlinkPayload::Error(e) = m.payload
                && e.code.is_some()
            {
                return Err(errno_error(e.raw_code()));
            }
        }
        Ok(())
    }

    /// Reads links, addresses, routes (all tables, both families) and rules.
    pub async fn observe(&self) -> Result<Observed, NetconfError> {
        let mut obs = Observed::default();
        for m in self
            .dump(
                "links",
                RouteNetlinkMessage::GetLink(LinkMessage::default()),
            )
            .await?
        {
            if let RouteNetlinkMessage::NewLink(l) = m {
                obs.links.push(parse_link(&l));
            }
        }
        for m in self
            .dump(
                "addresses",
                RouteNetlinkMessage::GetAddress(AddressMessage::default()),
            )
            .await?
        {
            if let RouteNetlinkMessage::NewAddress(a) = m
                && let Some(a) = parse_address(&a)
            {
                obs.addresses.push(a);
            }
        }
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut msg = RouteMessage::default();
            msg.header.address_family = family;
            for m in self
                .dump("routes", RouteNetlinkMessage::GetRoute(msg))
                .await?
            {
                if let RouteNetlinkMessage::NewRoute(r) = m
                    && let Some(r) = parse_route(&r)
                {
                    obs.routes.push(r);
                }
            }
            let mut msg = RuleMessage::default();
            msg.header.family = family;
            for m in self
                .dump("rules", RouteNetlinkMessage::GetRule(msg))
                .await?
            {
                if let RouteNetlinkMessage::NewRule(r) = m {
                    obs.rules.push(parse_rule(&r));
                }
            }
        }
        obs.links.sort_by_key(|l| l.index);
        Ok(obs)
    }

    async fn index_of(&self, name: &str) -> Result<u32, std::io::Error> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetLink(msg));
        req.header.flags = NLM_F_REQUEST;
        let mut handle = self.handle.clone();
        let mut resp = handle
            .request(req)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        while let Some(m) = resp.next().await {
            match m.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                    return Ok(l.header.index);
                }
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    return Err(std::io::Error::other(format!(
                        "no interface named {name}: {}",
                        errno_error(e.raw_code())
                    )));
                }
                _ => {}
            }
        }
        Err(std::io::Error::other(format!("no interface named {name}")))
    }

    /// Performs one plan step.
    pub async fn execute(&self, step: &Step) -> Result<(), std::io::Error> {
        match step {
            Step::CreateLink(d) => self.create_link(d).await,
            Step::DeleteLink(d) => {
                let index = self.index_of(&d.name).await?;
                let mut msg = LinkMessage::default();
                msg.header.index = index;
                self.write(RouteNetlinkMessage::DelLink(msg), 0).await
            }
            Step::SetLink { link, mtu, up, .. } => {
                let mut msg = LinkMessage::default();
                msg.header.index = self.index_of(link).await?;
                if let Some(m) = mtu {
                    msg.attributes.push(LinkAttribute::Mtu(*m));
                }
                if let Some(u) = up {
                    msg.header.change_mask = LinkFlags::Up;
                    if *u {
                        msg.header.flags = LinkFlags::Up;
                    }
                }
                self.write(RouteNetlinkMessage::SetLink(msg), 0).await
            }
            Step::AddAddress(a) => {
                let msg = self.address_message(a).await?;
                self.write(
                    RouteNetlinkMessage::NewAddress(msg),
                    NLM_F_CREATE | NLM_F_EXCL,
                )
                .await
            }
            Step::DeleteAddress(a) => {
                let msg = self.address_message(a).await?;
                self.write(RouteNetlinkMessage::DelAddress(msg), 0).await
            }
            Step::AddRoute(r) => {
                let msg = self.route_message(r).await?;
                self.write(
                    RouteNetlinkMessage::NewRoute(msg),
                    NLM_F_CREATE | NLM_F_EXCL,
                )
                .await
            }
            Step::DeleteRoute(r) => {
                let msg = self.route_message(r).await?;
                self.write(RouteNetlinkMessage::DelRoute(msg), 0).await
            }
            Step::AddRule(r) => {
                self.write(
                    RouteNetlinkMessage::NewRule(rule_message(r)),
                    NLM_F_CREATE | NLM_F_EXCL,
                )
                .await
            }
            Step::DeleteRule(r) => {
                self.write(RouteNetlinkMessage::DelRule(rule_message(r)), 0)
                    .await
            }
        }
    }

    async fn create_link(&self, d: &LinkDef) -> Result<(), std::io::Error> {
        let parent = self.index_of(&d.parent).await?;
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(d.name.clone()));
        msg.attributes.push(LinkAttribute::Link(parent));
        if let Some(mac) = d.mac {
            msg.attributes.push(LinkAttribute::Address(mac.to_vec()));
        }
        if let Some(mtu) = d.mtu {
            msg.attributes.push(LinkAttribute::Mtu(mtu));
        }
        let (kind, data) = match &d.kind {
            // VLANs go through exactly this path; on a kernel without 8021q the create fails with
            // EOPNOTSUPP and the apply rolls back.
            CreatedKind::Vlan { id } => (InfoKind::Vlan, InfoData::Vlan(vec![InfoVlan::Id(*id)])),
            CreatedKind::Macvlan { mode } => (
                InfoKind::MacVlan,
                InfoData::MacVlan(vec![InfoMacVlan::Mode(match mode {
                    ApiMode::Private => MacVlanMode::Private,
                    ApiMode::Vepa => MacVlanMode::Vepa,
                    ApiMode::Bridge => MacVlanMode::Bridge,
                    ApiMode::Passthru => MacVlanMode::Passthrough,
                })]),
            ),
        };
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(kind),
            LinkInfo::Data(data),
        ]));
        if d.up {
            msg.header.flags = LinkFlags::Up;
            msg.header.change_mask = LinkFlags::Up;
        }
        self.write(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL)
            .await?;
        // The kernel ignores IFLA_IFALIAS on creation, so the ownership mark is a second write.
        let mut set = LinkMessage::default();
        set.header.index = self.index_of(&d.name).await?;
        set.attributes
            .push(LinkAttribute::IfAlias(link_alias(&d.name)));
        if let Err(e) = self
            .write(RouteNetlinkMessage::SetLink(set.clone()), 0)
            .await
        {
            // An unmarked link would be foreign to every later plan: remove it again.
            let mut del = LinkMessage::default();
            del.header.index = set.header.index;
            let _ = self.write(RouteNetlinkMessage::DelLink(del), 0).await;
            return Err(e);
        }
        Ok(())
    }

    async fn address_message(&self, a: &AddressDef) -> Result<AddressMessage, std::io::Error> {
        let mut msg = AddressMessage::default();
        msg.header.index = self.index_of(&a.link).await?;
        msg.header.prefix_len = a.net.prefix_len();
        msg.header.family = family(&a.net.addr());
        msg.header.scope = AddressScope::Universe;
        msg.attributes.push(AddressAttribute::Local(a.net.addr()));
        // IFA_ADDRESS equal to IFA_LOCAL: no peer address (what `ip addr add` sends too).
        msg.attributes.push(AddressAttribute::Address(a.net.addr()));
        if let IpNet::V4(n) = a.net
            && n.prefix_len() < 31
        {
            msg.attributes
                .push(AddressAttribute::Broadcast(n.broadcast()));
        }
        msg.attributes
            .push(AddressAttribute::Protocol(AddressProtocol::from(
                NK_PROTOCOL,
            )));
        Ok(msg)
    }

    async fn route_message(&self, r: &RouteDef) -> Result<RouteMessage, std::io::Error> {
        let mut msg = RouteMessage::default();
        let h = &mut msg.header;
        h.address_family = family(&r.destination.addr());
        h.destination_prefix_length = r.destination.prefix_len();
        h.protocol = RouteProtocol::from(NK_PROTOCOL);
        h.kind = RouteType::Unicast;
        h.scope = if r.gateway.is_some() {
            RouteScope::Universe
        } else {
            RouteScope::Link
        };
        h.table = u8::try_from(r.table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC);
        if r.on_link {
            h.flags = RouteFlags::Onlink;
        }
        if r.destination.prefix_len() > 0 {
            msg.attributes
                .push(RouteAttribute::Destination(RouteAddress::from(
                    r.destination.addr(),
                )));
        }
        msg.attributes.push(RouteAttribute::Table(r.table));
        if let Some(g) = r.gateway {
            msg.attributes
                .push(RouteAttribute::Gateway(RouteAddress::from(g)));
        }
        if let Some(l) = &r.link {
            msg.attributes
                .push(RouteAttribute::Oif(self.index_of(l).await?));
        }
        msg.attributes.push(RouteAttribute::Priority(r.metric));
        Ok(msg)
    }
}

fn family(ip: &IpAddr) -> AddressFamily {
    if ip.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    }
}

fn rule_message(r: &RuleDef) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = if r.v6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    msg.header.action = RuleAction::ToTable;
    msg.header.table = u8::try_from(r.table).unwrap_or(0);
    msg.attributes.push(RuleAttribute::Table(r.table));
    msg.attributes.push(RuleAttribute::Priority(r.priority));
    msg.attributes
        .push(RuleAttribute::Protocol(RouteProtocol::from(NK_PROTOCOL)));
    if let Some(n) = r.from {
        msg.header.src_len = n.prefix_len();
        msg.attributes.push(RuleAttribute::Source(n.addr()));
    }
    if let Some(n) = r.to {
        msg.header.dst_len = n.prefix_len();
        msg.attributes.push(RuleAttribute::Destination(n.addr()));
    }
    msg
}

fn parse_link(l: &LinkMessage) -> ObservedLink {
    let mut o = ObservedLink {
        index: l.header.index,
        name: String::new(),
        mac: None,
        mtu: 0,
        up: l.header.flags.contains(LinkFlags::Up),
        oper_state: String::new(),
        kind: String::new(),
        parent_index: None,
        vlan_id: None,
        macvlan_mode: None,
        alias: None,
    };
    let mut other_netns = false;
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => o.name = n.clone(),
            LinkAttribute::Address(m) if m.len() == 6 => o.mac = Some(format_mac(m)),
            LinkAttribute::Mtu(m) => o.mtu = *m,
            LinkAttribute::OperState(s) => o.oper_state = format!("{s:?}").to_lowercase(),
            LinkAttribute::Link(p) if *p != 0 => o.parent_index = Some(*p),
            LinkAttribute::IfAlias(a) => o.alias = Some(a.clone()),
            LinkAttribute::LinkNetNsId(_) => other_netns = true,
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    match i {
                        LinkInfo::Kind(k) => o.kind = k.to_string(),
                        LinkInfo::Data(InfoData::Vlan(v)) => {
                            for x in v {
                                if let InfoVlan::Id(id) = x {
                                    o.vlan_id = Some(*id);
                                }
                            }
                        }
                        LinkInfo::Data(InfoData::MacVlan(v)) => {
                            for x in v {
                                if let InfoMacVlan::Mode(m) = x {
                                    o.macvlan_mode = Some(
                                        match m {
                                            MacVlanMode::Private => "private",
                                            MacVlanMode::Vepa => "vepa",
                                            MacVlanMode::Bridge => "bridge",
                                            MacVlanMode::Passthrough => "passthru",
                                            MacVlanMode::Source => "source",
                                            _ => "other",
                                        }
                                        .to_string(),
                                    );
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    // With IFLA_LINK_NETNSID, IFLA_LINK is an index in another namespace (a veth whose peer is
    // in a pod): no parent here, or the plan would take a pod's interface for a child of
    // whatever link has that index in this one.
    if other_netns {
        o.parent_index = None;
    }
    o
}

fn parse_address(a: &AddressMessage) -> Option<ObservedAddress> {
    let mut local = None;
    let mut address = None;
    let mut protocol = 0;
    for attr in &a.attributes {
        match attr {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Address(ip) => address = Some(*ip),
            AddressAttribute::Protocol(p) => protocol = u8::from(*p),
            _ => {}
        }
    }
    let ip = local.or(address)?;
    Some(ObservedAddress {
        index: a.header.index,
        net: IpNet::new(ip, a.header.prefix_len).ok()?,
        protocol,
    })
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v) => Some(IpAddr::V4(*v)),
        RouteAddress::Inet6(v) => Some(IpAddr::V6(*v)),
        _ => None,
    }
}

fn parse_route(r: &RouteMessage) -> Option<ObservedRoute> {
    if r.header.kind != RouteType::Unicast {
        return None;
    }
    let v6 = r.header.address_family == AddressFamily::Inet6;
    let mut dest = None;
    let mut o = ObservedRoute {
        table: u32::from(r.header.table),
        destination: if v6 {
            "::/0".parse().ok()?
        } else {
            "0.0.0.0/0".parse().ok()?
        },
        gateway: None,
        oif: None,
        metric: 0,
        protocol: u8::from(r.header.protocol),
        on_link: r.header.flags.contains(RouteFlags::Onlink),
    };
    for a in &r.attributes {
        match a {
            RouteAttribute::Destination(d) => dest = route_ip(d),
            RouteAttribute::Gateway(g) => o.gateway = route_ip(g),
            RouteAttribute::Oif(i) => o.oif = Some(*i),
            RouteAttribute::Priority(p) => o.metric = *p,
            RouteAttribute::Table(t) => o.table = *t,
            _ => {}
        }
    }
    if let Some(d) = dest {
        o.destination = IpNet::new(d, r.header.destination_prefix_length).ok()?;
    }
    Some(o)
}

fn parse_rule(r: &RuleMessage) -> ObservedRule {
    let v6 = r.header.family == AddressFamily::Inet6;
    let mut o = ObservedRule {
        v6,
        priority: 0,
        from: None,
        to: None,
        table: u32::from(r.header.table),
        protocol: 0,
    };
    for a in &r.attributes {
        match a {
            RuleAttribute::Priority(p) => o.priority = *p,
            RuleAttribute::Table(t) => o.table = *t,
            RuleAttribute::Protocol(p) => o.protocol = u8::from(*p),
            RuleAttribute::Source(ip) => o.from = IpNet::new(*ip, r.header.src_len).ok(),
            RuleAttribute::Destination(ip) => o.to = IpNet::new(*ip, r.header.dst_len).ok(),
            _ => {}
        }
    }
    o
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    /// A veth whose peer is in another namespace (a pod's) carries IFLA_LINK with
    /// IFLA_LINK_NETNSID: the index is the peer's there, not a parent here.
    #[test]
    fn a_link_index_in_another_namespace_is_no_parent() {
        let mut msg = LinkMessage::default();
        msg.header.index = 7;
        msg.attributes
            .push(LinkAttribute::IfName("veth1a2b".into()));
        msg.attributes.push(LinkAttribute::Link(3));
        assert_eq!(parse_link(&msg).parent_index, Some(3));
        msg.attributes.push(LinkAttribute::LinkNetNsId(0));
        assert_eq!(parse_link(&msg).parent_index, None);
    }
}

#[cfg(test)]
mod tests {
    //! The netlink messages against a real kernel, in a fresh network namespace (root only).

    use nodekeeper_model::network::NetworkState;
    use nodekeeper_testkit::{Netns, skip_unless_root};

    use crate::{ApplyOptions, Netconf, Outcome};

    /// `(table, gateway, dev)` of the IPv6 default routes, from `ip -6 -j route show table all`.
    fn v6_defaults(ns: &Netns) -> Vec<(String, String, String)> {
        let out = ns
            .ip(&["-6", "-j", "route", "show", "table", "all"])
            .unwrap();
        let routes: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        routes
            .iter()
            .filter(|r| r["dst"] == "default")
            .map(|r| {
                (
                    r["table"].as_str().unwrap_or("main").to_string(),
                    r["gateway"].as_str().unwrap_or("").to_string(),
                    r["dev"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn ipv6_default_routes_apply_in_every_form() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = Netns::with_loopback("nk-test-v6route").unwrap();
        ns.ip(&[
            "link", "add", "nic0", "type", "veth", "peer", "name", "nic0p",
        ])
        .unwrap();
        for l in ["nic0", "nic0p"] {
            ns.ip(&["link", "set", l, "up"]).unwrap();
        }
        let desired: NetworkState = serde_json::from_str(
            r#"{
              "links": [{"name": "nic0", "kind": "existing"}],
              "addresses": [{"link": "nic0", "cidr": "fd00:10:40::5/64"}],
              "routes": [
                {"destination": "::/0", "gateway": "fd00:10:40::1", "link": "nic0", "table": 111},
                {"destination": "::/0", "gateway": "fd00:99::1", "link": "nic0", "table": 113, "onLink": true},
                {"destination": "::/0", "link": "nic0", "table": 114},
                {"destination": "::/0", "gateway": "fe80::200:17ff:fe00:1", "link": "nic0", "table": 115},
                {"destination": "::/0", "gateway": "fd00:10:40::1", "link": "nic0", "table": 116, "metric": 100}
              ]
            }"#,
        )
        .unwrap();
        let again = desired.clone();
        let report = ns.run(move || async move {
            let nc = Netconf::connect().unwrap();
            nc.apply(&desired, &ApplyOptions::default()).await.unwrap()
        });
        assert_eq!(report.outcome, Outcome::Applied, "{:?}", report.error);
        let mut got = v6_defaults(&ns);
        got.sort();
        assert_eq!(
            got,
            [
                ("111".into(), "fd00:10:40::1".into(), "nic0".into()),
                ("113".into(), "fd00:99::1".into(), "nic0".into()),
                ("114".into(), String::new(), "nic0".into()),
                ("115".into(), "fe80::200:17ff:fe00:1".into(), "nic0".into()),
                ("116".into(), "fd00:10:40::1".into(), "nic0".into()),
            ]
        );
        // Re-applying writes nothing; an empty state removes every route again.
        let (reapplied, removed) = ns.run(move || async move {
            let nc = Netconf::connect().unwrap();
            let opts = ApplyOptions::default();
            let second = nc.apply(&again, &opts).await.unwrap();
            let third = nc.apply(&NetworkState::default(), &opts).await.unwrap();
            (second, third)
        });
        assert_eq!(
            (reapplied.outcome, reapplied.writes),
            (Outcome::Applied, 0),
            "{:?}",
            reapplied.plan
        );
        assert_eq!(removed.outcome, Outcome::Applied, "{:?}", removed.error);
        assert_eq!(v6_defaults(&ns), []);
    }

    /// A dual-stack OCI VNIC as the layout makes it: both families' addresses, default routes
    /// and source rules in the VNIC's one table.
    #[test]
    fn a_dual_stack_vnic_layout_applies() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = Netns::with_loopback("nk-test-dualstack").unwrap();
        ns.ip(&[
            "link",
            "add",
            "ens5",
            "address",
            "02:00:17:0a:22:02",
            "type",
            "veth",
            "peer",
            "name",
            "ens5p",
        ])
        .unwrap();
        ns.ip(&["link", "set", "ens5p", "up"]).unwrap();
        let desired: NetworkState = serde_json::from_str(
            r#"{
              "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true}],
              "addresses": [
                {"link": "vnic1", "cidr": "10.0.20.33/24"},
                {"link": "vnic1", "cidr": "fd00:10:20::33/64"}
              ],
              "routes": [
                {"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101},
                {"destination": "::/0", "gateway": "fd00:10:20::1", "link": "vnic1", "table": 101}
              ],
              "rules": [
                {"from": "10.0.20.33/32", "table": 101, "priority": 20101},
                {"from": "fd00:10:20::33/128", "table": 101, "priority": 20101}
              ]
            }"#,
        )
        .unwrap();
        let report = ns.run(move || async move {
            let nc = Netconf::connect().unwrap();
            nc.apply(&desired, &ApplyOptions::default()).await.unwrap()
        });
        assert_eq!(report.outcome, Outcome::Applied, "{:?}", report.error);
        assert_eq!(
            v6_defaults(&ns),
            [("101".into(), "fd00:10:20::1".into(), "ens5".into())]
        );
    }
}
