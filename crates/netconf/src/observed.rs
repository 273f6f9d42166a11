//! Observed host network state as plain data (no netlink types), and the ownership marks that
//! say which of it nodekeeper owns.
//!
//! Ownership marks, chosen so that ownership survives an agent restart without any state file:
//! - routes, policy rules and addresses carry the protocol number [`NK_PROTOCOL`] (`RTM_*ROUTE`
//!   `rtm_protocol`, `FRA_PROTOCOL`, and `IFA_PROTO` — the last needs Linux ≥ 5.18, so a state
//!   with addresses is refused on older kernels, [`crate::check_kernel`]). Addresses on
//!   NICs nodekeeper did not create (the VM secondary VNIC) are thus owned individually, which a
//!   label could not do for IPv6 and a state file could lose;
//! - links nodekeeper creates carry the alias (`IFLA_IFALIAS`) `nodekeeper:<name>`;
//! - rules must also lie in the reserved priority range of the api crate (validated).
//!
//! Links nodekeeper did not create are never owned: it only sets their MTU and up/down state.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;

/// The protocol number marking routes, rules and addresses as nodekeeper's. 176 is not listed in
/// iproute2's `rt_protos` (which assigns 0–18, 42, 99, 186–192) nor used by the kernel's
/// `IFAPROT_*` values (1–3).
pub const NK_PROTOCOL: u8 = 176;

/// Prefix of the alias nodekeeper puts on links it creates.
pub const LINK_ALIAS_PREFIX: &str = "nodekeeper:";

/// One interface as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ObservedLink {
    pub index: u32,
    pub name: String,
    /// Lower-case colon form; `None` for links without a hardware address.
    pub mac: Option<String>,
    pub mtu: u32,
    /// IFF_UP.
    pub up: bool,
    /// `up`, `down`, `lowerlayerdown`, `unknown`, ...
    pub oper_state: String,
    /// `vlan`, `macvlan`, `veth`, ...; empty for physical devices.
    pub kind: String,
    /// IFLA_LINK: the parent's index for vlan and macvlan (`None` when the kernel gives it as an
    /// index in another network namespace, IFLA_LINK_NETNSID: a veth whose peer is elsewhere).
    pub parent_index: Option<u32>,
    pub vlan_id: Option<u16>,
    /// `private`, `vepa`, `bridge`, `passthru`, `source` for macvlans.
    pub macvlan_mode: Option<String>,
    pub alias: Option<String>,
}

impl ObservedLink {
    /// True when nodekeeper created this link.
    pub fn owned(&self) -> bool {
        self.alias
            .as_deref()
            .is_some_and(|a| a.starts_with(LINK_ALIAS_PREFIX))
    }
}

/// One address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ObservedAddress {
    pub index: u32,
    /// Address with prefix length.
    pub net: IpNet,
    /// IFA_PROTO; 0 when absent.
    pub protocol: u8,
}

/// One unicast route.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ObservedRoute {
    pub table: u32,
    pub destination: IpNet,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
    /// RTA_PRIORITY; 0 when absent.
    pub metric: u32,
    pub protocol: u8,
    pub on_link: bool,
}

/// One policy rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ObservedRule {
    pub v6: bool,
    pub priority: u32,
    pub from: Option<IpNet>,
    pub to: Option<IpNet>,
    pub table: u32,
    pub protocol: u8,
}

/// Everything read from one network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Observed {
    pub links: Vec<ObservedLink>,
    pub addresses: Vec<ObservedAddress>,
    pub routes: Vec<ObservedRoute>,
    pub rules: Vec<ObservedRule>,
}

impl Observed {
    pub fn link_by_name(&self, name: &str) -> Option<&ObservedLink> {
        self.links.iter().find(|l| l.name == name)
    }
    pub fn link_by_index(&self, index: u32) -> Option<&ObservedLink> {
        self.links.iter().find(|l| l.index == index)
    }
    pub fn link_name(&self, index: u32) -> Option<&str> {
        self.link_by_index(index).map(|l| l.name.as_str())
    }
}
