//! The host network model: desired and observed state of links, addresses, routes and rules,
//! and its validation (so the controller can refuse a bad `NodeNetworkConfig` before any node
//! sees it, and the agent can refuse a bad `ApplyNetwork` before any change).
//!
//! The JSON form is camelCase. Example (a VM secondary VNIC):
//!
//! ```json
//! {
//!   "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true}],
//!   "addresses": [{"link": "vnic1", "cidr": "10.0.20.33/24"}],
//!   "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101}],
//!   "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}]
//! }
//! ```
//!
//! Every string that holds an address is kept as a string (not a parsed type) so that the JSON
//! schema embedded in the CRD stays plain; [`NetworkState::validate`] parses each one and names
//! the field that is wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Rule priorities nodekeeper may use. Rules it installs must lie in this range, which sits
/// between the kernel's `local` rule (0) and the `main`/`default` rules (32766/32767) and away
/// from the priorities other tools commonly pick (0–1000, 32000+).
pub const RULE_PRIORITY_MIN: u32 = 20000;
/// Upper end (inclusive) of [`RULE_PRIORITY_MIN`]'s range.
pub const RULE_PRIORITY_MAX: u32 = 20999;

/// The kernel's `main` routing table.
pub const TABLE_MAIN: u32 = 254;

/// Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// The most links a configured state (`NodeNetworkConfig.spec.state`) may list. The CRD schema
/// and [`NetworkState::check_sizes`] hold these caps; a node's whole state, with what `ociVnics`
/// adds, may be longer, so [`NetworkState::validate`] does not apply them.
pub const MAX_LINKS: usize = 64;
/// The most addresses a configured state may list.
pub const MAX_ADDRESSES: usize = 256;
/// The most routes a configured state may list.
pub const MAX_ROUTES: usize = 256;
/// The most rules a configured state may list.
pub const MAX_RULES: usize = 256;
/// The longest address or prefix text (`cidr`, `destination`, `gateway`, `from`, `to`); the
/// longest valid one, an IPv6 address with an embedded IPv4 address and a prefix length, is 49.
pub const ADDRESS_TEXT_MAX: usize = 64;
/// A MAC's text: six two-digit octets and five colons.
pub const MAC_TEXT_MAX: usize = 17;

/// The lowest MTU at which Linux keeps IPv6 on a link: below it the kernel drops the link's
/// IPv6 addresses and routes.
pub const IPV6_MIN_MTU: u32 = 1280;

/// The link-local range that carries OCI's metadata service, DNS, NTP and iSCSI boot volumes.
/// nodekeeper never routes it anywhere.
pub const LINK_LOCAL_V4: &str = "169.254.0.0/16";

/// The desired (or observed) host network state nodekeeper manages.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkState {
    /// Interfaces: existing ones (matched by name or MAC) whose MTU and state nodekeeper sets, and
    /// VLAN sub-interfaces and macvlans nodekeeper creates. Addresses and routes refer to these by
    /// `name`.
    #[serde(default)]
    #[schemars(length(max = MAX_LINKS))]
    pub links: Vec<LinkSpec>,
    /// IPv4 and IPv6 addresses, each on one of `links`.
    #[serde(default)]
    #[schemars(length(max = MAX_ADDRESSES))]
    pub addresses: Vec<AddressSpec>,
    /// Routes, in any routing table.
    #[serde(default)]
    #[schemars(length(max = MAX_ROUTES))]
    pub routes: Vec<RouteSpec>,
    /// Policy routing rules.
    #[serde(default)]
    #[schemars(length(max = MAX_RULES))]
    pub rules: Vec<RuleSpec>,
}

/// What kind of interface a link is.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum LinkKind {
    /// An interface nodekeeper does not create (a NIC, a veth): matched by `mac` when given,
    /// else by `name`. nodekeeper sets only its MTU and up/down state and never deletes it.
    Existing,
    /// An 802.1Q VLAN sub-interface on `parent` with `vlanId`, created by nodekeeper.
    Vlan,
    /// A macvlan on `parent`, created by nodekeeper, carrying `mac` when given.
    Macvlan,
}

/// How a macvlan forwards between its siblings on one parent.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum MacvlanMode {
    /// No traffic between macvlans on the same parent.
    Private,
    /// Traffic between siblings goes out to the adjacent switch.
    Vepa,
    /// Siblings reach each other directly (the usual choice, and the default).
    #[default]
    Bridge,
    /// One macvlan takes over the parent.
    Passthru,
}

/// One interface.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LinkSpec {
    /// For `vlan` and `macvlan`: the kernel interface name to create (at most 15 bytes). For
    /// `existing` without `mac`: the kernel name to match. For `existing` with `mac`: a label that
    /// addresses, routes and other links use to refer to this interface (the kernel name is
    /// whatever the interface with that MAC is called).
    #[schemars(length(max = IFNAME_MAX))]
    pub name: String,
    /// Whether nodekeeper creates this link (`vlan`, `macvlan`) or only configures it (`existing`).
    pub kind: LinkKind,
    /// Lower-case colon-separated MAC. For `existing`: match the interface by this address. For
    /// `macvlan`: the address to give it (OCI bare metal: the VNIC's `macAddr`). Not allowed for
    /// `vlan` (a VLAN takes its parent's address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAC_TEXT_MAX))]
    pub mac: Option<String>,
    /// For `vlan` and `macvlan`: the parent interface, either the `name` of another entry in
    /// `links` or the kernel name of an interface that already exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = IFNAME_MAX))]
    pub parent: Option<String>,
    /// For `vlan`: the 802.1Q VLAN id, 1–4094.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan_id: Option<u16>,
    /// For `macvlan`: the forwarding mode; `bridge` when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub macvlan_mode: Option<MacvlanMode>,
    /// MTU in bytes, 68–65535; left as it is when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 65535))]
    pub mtu: Option<u32>,
    /// Administrative state; left as it is when omitted (created links are brought up unless this
    /// is `false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub up: Option<bool>,
}

/// One address on one link.
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct AddressSpec {
    /// The `name` of the entry in `links` that carries the address.
    #[schemars(length(max = IFNAME_MAX))]
    pub link: String,
    /// Address and prefix length, e.g. `10.0.20.33/24` or `fd00:10:30::45/64`.
    #[schemars(length(max = ADDRESS_TEXT_MAX))]
    pub cidr: String,
}

/// One route.
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    /// Destination prefix (e.g. `10.0.0.0/8`), or `default` (IPv4 `0.0.0.0/0`; write `::/0` for
    /// IPv6).
    #[schemars(length(max = ADDRESS_TEXT_MAX))]
    pub destination: String,
    /// Next-hop address; omitted for a route straight out of `link`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = ADDRESS_TEXT_MAX))]
    pub gateway: Option<String>,
    /// The `name` of the entry in `links` the route leaves by. Required unless `gateway` alone
    /// determines it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = IFNAME_MAX))]
    pub link: Option<String>,
    /// Routing table id; 254 (`main`) when omitted. 0 and 255 (`local`) are refused.
    #[serde(default = "default_table")]
    #[schemars(range(max = u32::MAX))]
    pub table: u32,
    /// Route metric (priority); the kernel default (0 for IPv4, 1024 for IPv6) when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = u32::MAX))]
    pub metric: Option<u32>,
    /// Treat the gateway as directly reachable on `link` even if no prefix there covers it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub on_link: bool,
}

/// One policy routing rule: traffic matching `from`/`to` looks up `table`.
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct RuleSpec {
    /// Source prefix to match, e.g. `10.0.20.33/32`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = ADDRESS_TEXT_MAX))]
    pub from: Option<String>,
    /// Destination prefix to match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = ADDRESS_TEXT_MAX))]
    pub to: Option<String>,
    /// The routing table to look up.
    #[schemars(range(max = u32::MAX))]
    pub table: u32,
    /// Rule priority; must lie in nodekeeper's reserved range 20000–20999.
    #[schemars(range(min = RULE_PRIORITY_MIN, max = RULE_PRIORITY_MAX))]
    pub priority: u32,
}

fn default_table() -> u32 {
    TABLE_MAIN
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One problem in a [`NetworkState`], with the path of the field at fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationError {
    /// JSON-ish path, e.g. `links[2].vlanId`.
    pub path: String,
    /// What is wrong and what to do about it.
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for ValidationError {}

/// Joins validation errors into one line per problem, for logs and gRPC messages.
pub fn format_errors(errors: &[ValidationError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Parses a MAC written as six colon-separated hex octets.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for byte in &mut out {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

/// Formats a MAC the way the model stores it (lower case, colons).
pub fn format_mac(mac: &[u8]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl RouteSpec {
    /// The destination as a prefix (`default` is `0.0.0.0/0`).
    pub fn destination_net(&self) -> Option<IpNet> {
        if self.destination == "default" {
            return "0.0.0.0/0".parse().ok();
        }
        self.destination.parse().ok()
    }
}

/// Parses `a.b.c.d/n`, or a bare address as a host prefix.
pub fn parse_prefix(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from))
}

fn link_local_v4() -> IpNet {
    LINK_LOCAL_V4.parse().expect("constant prefix parses")
}

fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

impl NetworkState {
    /// The size caps of a configured state ([`MAX_LINKS`] and the rest): every list or text
    /// longer than a `NodeNetworkConfig` accepts, each naming its field. The CRD schema holds the
    /// same caps; this catches objects stored under an earlier CRD. Interface names are left to
    /// [`NetworkState::validate`], which refuses one over 15 bytes.
    pub fn check_sizes(&self) -> Vec<ValidationError> {
        let mut errs = Vec::new();
        for (path, len, max) in [
            ("links", self.links.len(), MAX_LINKS),
            ("addresses", self.addresses.len(), MAX_ADDRESSES),
            ("routes", self.routes.len(), MAX_ROUTES),
            ("rules", self.rules.len(), MAX_RULES),
        ] {
            if len > max {
                errs.push(ValidationError {
                    path: path.into(),
                    message: format!("{len} entries; at most {max} are accepted"),
                });
            }
        }
        let mut text = |path: String, value: Option<&str>, max: usize| {
            if let Some(value) = value
                && value.len() > max
            {
                errs.push(ValidationError {
                    path,
                    message: format!("{} bytes; at most {max} are accepted", value.len()),
                });
            }
        };
        for (i, l) in self.links.iter().enumerate() {
            text(format!("links[{i}].mac"), l.mac.as_deref(), MAC_TEXT_MAX);
            text(
                format!("links[{i}].parent"),
                l.parent.as_deref(),
                IFNAME_MAX,
            );
        }
        for (i, a) in self.addresses.iter().enumerate() {
            text(format!("addresses[{i}].link"), Some(&a.link), IFNAME_MAX);
            text(
                format!("addresses[{i}].cidr"),
                Some(&a.cidr),
                ADDRESS_TEXT_MAX,
            );
        }
        for (i, r) in self.routes.iter().enumerate() {
            text(
                format!("routes[{i}].destination"),
                Some(&r.destination),
                ADDRESS_TEXT_MAX,
            );
            text(
                format!("routes[{i}].gateway"),
                r.gateway.as_deref(),
                ADDRESS_TEXT_MAX,
            );
            text(format!("routes[{i}].link"), r.link.as_deref(), IFNAME_MAX);
        }
        for (i, r) in self.rules.iter().enumerate() {
            text(
                format!("rules[{i}].from"),
                r.from.as_deref(),
                ADDRESS_TEXT_MAX,
            );
            text(format!("rules[{i}].to"), r.to.as_deref(), ADDRESS_TEXT_MAX);
        }
        errs
    }

    /// Checks the whole state and returns every problem found, each naming its field. A state that
    /// passes can be planned; whether parents and MACs exist on the host is checked by the planner.
    pub fn validate(&self) -> Result<(), Vec<ValidationError>> {
        let mut errs = Vec::new();
        let mut err = |path: String, message: String| errs.push(ValidationError { path, message });

        // Links.
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        let mut macs: BTreeMap<String, usize> = BTreeMap::new();
        let mut vlans: BTreeMap<(&str, u16), usize> = BTreeMap::new();
        for (i, l) in self.links.iter().enumerate() {
            let p = format!("links[{i}]");
            if l.name.is_empty()
                || l.name.len() > IFNAME_MAX
                || l.name
                    .chars()
                    .any(|c| c.is_whitespace() || c == '/' || c == ':')
                || l.name == "."
                || l.name == ".."
            {
                err(
                    format!("{p}.name"),
                    format!(
                        "{:?} is not a valid interface name: use 1–15 bytes without spaces, '/' or ':'",
                        l.name
                    ),
                );
            }
            if let Some(j) = names.insert(&l.name, i) {
                err(
                    format!("{p}.name"),
                    format!(
                        "{:?} is also the name of links[{j}]; names must be unique",
                        l.name
                    ),
                );
            }
            if let Some(mac) = &l.mac {
                match parse_mac(mac) {
                    None => err(
                        format!("{p}.mac"),
                        format!(
                            "{mac:?} is not a MAC address; write six hex octets like 02:00:17:0a:22:02"
                        ),
                    ),
                    Some(m) => {
                        if m[0] & 1 == 1 {
                            err(
                                format!("{p}.mac"),
                                format!("{mac:?} is a multicast address; give a unicast MAC"),
                            );
                        }
                        if m == [0; 6] {
                            err(
                                format!("{p}.mac"),
                                "00:00:00:00:00:00 is not a usable MAC".into(),
                            );
                        }
                        let canon = format_mac(&m);
                        if let Some(j) = macs.insert(canon.clone(), i) {
                            err(
                                format!("{p}.mac"),
                                format!(
                                    "{canon} is also the MAC of links[{j}]; two links (VNICs) cannot share one MAC"
                                ),
                            );
                        }
                    }
                }
            }
            if let Some(mtu) = l.mtu
                && !(68..=65535).contains(&mtu)
            {
                err(
                    format!("{p}.mtu"),
                    format!("{mtu} is outside 68–65535 (68 is the IPv4 minimum)"),
                );
            }
            match l.kind {
                LinkKind::Existing => {
                    for (field, set) in [
                        ("parent", l.parent.is_some()),
                        ("vlanId", l.vlan_id.is_some()),
                        ("macvlanMode", l.macvlan_mode.is_some()),
                    ] {
                        if set {
                            err(
                                format!("{p}.{field}"),
                                format!(
                                    "only vlan or macvlan links take {field}; remove it or change kind"
                                ),
                            );
                        }
                    }
                }
                LinkKind::Vlan => {
                    match l.vlan_id {
                        None => err(
                            format!("{p}.vlanId"),
                            "a vlan link needs vlanId (1–4094)".into(),
                        ),
                        Some(id) if !(1..=4094).contains(&id) => err(
                            format!("{p}.vlanId"),
                            format!("{id} is not a usable 802.1Q VLAN id; use 1–4094"),
                        ),
                        Some(id) => {
                            if let Some(parent) = l.parent.as_deref()
                                && let Some(j) = vlans.insert((parent, id), i)
                            {
                                err(
                                    format!("{p}.vlanId"),
                                    format!("links[{j}] is already VLAN {id} on {parent:?}"),
                                );
                            }
                        }
                    }
                    if l.mac.is_some() {
                        err(
                            format!("{p}.mac"),
                            "a vlan link takes its parent's MAC; remove mac".into(),
                        );
                    }
                    if l.macvlan_mode.is_some() {
                        err(
                            format!("{p}.macvlanMode"),
                            "only macvlan links take macvlanMode".into(),
                        );
                    }
                }
                LinkKind::Macvlan => {
                    if l.vlan_id.is_some() {
                        err(format!("{p}.vlanId"), "only vlan links take vlanId".into());
                    }
                }
            }
            if matches!(l.kind, LinkKind::Vlan | LinkKind::Macvlan) {
                match l.parent.as_deref() {
                    None | Some("") => err(
                        format!("{p}.parent"),
                        format!("a {:?} link needs a parent interface", l.kind).to_lowercase(),
                    ),
                    Some(parent) if parent == l.name => err(
                        format!("{p}.parent"),
                        "a link cannot be its own parent".into(),
                    ),
                    Some(_) => {}
                }
            }
        }
        // Parent chains must end outside the list (no cycles).
        for (i, l) in self.links.iter().enumerate() {
            let mut seen = BTreeSet::new();
            let mut cur = l;
            while let Some(parent) = cur.parent.as_deref() {
                if !seen.insert(parent) {
                    err(
                        format!("links[{i}].parent"),
                        format!("parent chain of {:?} loops back through {parent:?}", l.name),
                    );
                    break;
                }
                match self.links.iter().find(|x| x.name == parent) {
                    Some(next) => cur = next,
                    None => break,
                }
            }
        }

        // MTUs the kernel would not keep: a VLAN or macvlan larger than its parent (EINVAL), and
        // IPv6 addresses on a link below 1280 bytes (the kernel drops them).
        for (i, l) in self.links.iter().enumerate() {
            let Some(mtu) = l.mtu else { continue };
            if let Some(parent) = l.parent.as_deref()
                && let Some((j, p)) = self
                    .links
                    .iter()
                    .enumerate()
                    .find(|(_, x)| x.name == parent)
                && let Some(parent_mtu) = p.mtu
                && mtu > parent_mtu
            {
                err(
                    format!("links[{i}].mtu"),
                    format!(
                        "{mtu} is larger than the MTU {parent_mtu} of its parent {parent:?} (links[{j}]); a {} link may not be larger than its parent: lower it or raise the parent's",
                        format!("{:?}", l.kind).to_lowercase()
                    ),
                );
            }
            if mtu < IPV6_MIN_MTU
                && let Some(k) = self.addresses.iter().position(|a| {
                    a.link == l.name && a.cidr.parse::<IpNet>().is_ok_and(|n| n.addr().is_ipv6())
                })
            {
                err(
                    format!("links[{i}].mtu"),
                    format!(
                        "{mtu} is below {IPV6_MIN_MTU}, the IPv6 minimum, and addresses[{k}] puts an IPv6 address on {:?}: the kernel would drop it; use an MTU of at least {IPV6_MIN_MTU} or leave IPv6 off this link",
                        l.name
                    ),
                );
            }
        }

        // Addresses.
        let mut addr_seen: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for (i, a) in self.addresses.iter().enumerate() {
            let p = format!("addresses[{i}]");
            if !names.contains_key(a.link.as_str()) {
                err(
                    format!("{p}.link"),
                    format!(
                        "no link named {:?} in links; add it there (kind existing for a NIC)",
                        a.link
                    ),
                );
            }
            match a.cidr.parse::<IpNet>() {
                Err(_) => err(
                    format!("{p}.cidr"),
                    format!(
                        "{:?} is not an address with prefix length, e.g. 10.0.20.33/24",
                        a.cidr
                    ),
                ),
                Ok(net) => {
                    let ip = net.addr();
                    if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
                        err(
                            format!("{p}.cidr"),
                            format!("{ip} cannot be assigned to an interface"),
                        );
                    }
                    if net.contains(&link_local_v4().network()) || link_local_v4().contains(&ip) {
                        err(
                            format!("{p}.cidr"),
                            format!(
                                "{} is in {LINK_LOCAL_V4}, which nodekeeper never touches",
                                a.cidr
                            ),
                        );
                    }
                    if let Some(j) = addr_seen.insert(ip, i) {
                        err(
                            format!("{p}.cidr"),
                            format!("{ip} is also assigned by addresses[{j}]"),
                        );
                    }
                }
            }
        }

        // Routes.
        let mut route_keys: BTreeMap<(u32, IpNet, Option<u32>), usize> = BTreeMap::new();
        let mut default_dev: BTreeMap<(u32, bool), (usize, Option<&str>)> = BTreeMap::new();
        for (i, r) in self.routes.iter().enumerate() {
            let p = format!("routes[{i}]");
            let dest = r.destination_net();
            match dest {
                None => err(
                    format!("{p}.destination"),
                    format!(
                        "{:?} is not a prefix; write e.g. 10.0.0.0/8 or default",
                        r.destination
                    ),
                ),
                Some(d) => {
                    if d.addr() != d.network() {
                        err(
                            format!("{p}.destination"),
                            format!("{d} has host bits set; write {}", d.trunc()),
                        );
                    }
                    if d.prefix_len() > 0 && overlaps(&d, &link_local_v4()) {
                        err(
                            format!("{p}.destination"),
                            format!(
                                "{d} overlaps {LINK_LOCAL_V4}, which must stay on the primary VNIC"
                            ),
                        );
                    }
                    if let Some(j) = route_keys.insert((r.table, d.trunc(), r.metric), i) {
                        err(
                            p.clone(),
                            format!("same table, destination and metric as routes[{j}]"),
                        );
                    }
                    if d.prefix_len() == 0 {
                        let key = (r.table, d.addr().is_ipv6());
                        if let Some((j, dev)) = default_dev.insert(key, (i, r.link.as_deref()))
                            && dev != r.link.as_deref()
                        {
                            err(
                                format!("{p}.table"),
                                format!(
                                    "table {} already has a default route via another link (routes[{j}]); give each VNIC its own table",
                                    r.table
                                ),
                            );
                        }
                    }
                }
            }
            if r.table == 0 || r.table == 255 {
                err(
                    format!("{p}.table"),
                    format!(
                        "table {} is reserved; use 1–252 or 256+ (254 is main)",
                        r.table
                    ),
                );
            }
            if let Some(link) = &r.link
                && !names.contains_key(link.as_str())
            {
                err(
                    format!("{p}.link"),
                    format!("no link named {link:?} in links; add it there"),
                );
            }
            match &r.gateway {
                None => {
                    if r.link.is_none() {
                        err(p.clone(), "a route needs a gateway, a link, or both".into());
                    }
                    if r.on_link {
                        err(format!("{p}.onLink"), "onLink needs a gateway".into());
                    }
                }
                Some(g) => match g.parse::<IpAddr>() {
                    Err(_) => err(
                        format!("{p}.gateway"),
                        format!("{g:?} is not an IP address"),
                    ),
                    Ok(gw) => {
                        if let Some(d) = dest
                            && d.addr().is_ipv6() != gw.is_ipv6()
                        {
                            err(
                                format!("{p}.gateway"),
                                format!(
                                    "gateway {gw} and destination {d} are of different IP families"
                                ),
                            );
                        }
                    }
                },
            }
        }

        // Rules.
        let mut rule_keys: BTreeMap<(u32, Option<&str>, Option<&str>), usize> = BTreeMap::new();
        for (i, r) in self.rules.iter().enumerate() {
            let p = format!("rules[{i}]");
            if !(RULE_PRIORITY_MIN..=RULE_PRIORITY_MAX).contains(&r.priority) {
                err(
                    format!("{p}.priority"),
                    format!(
                        "{} is outside nodekeeper's reserved range {RULE_PRIORITY_MIN}–{RULE_PRIORITY_MAX}",
                        r.priority
                    ),
                );
            }
            if let Some(j) = rule_keys.insert((r.priority, r.from.as_deref(), r.to.as_deref()), i) {
                err(
                    p.clone(),
                    format!("same priority, from and to as rules[{j}]; remove one"),
                );
            }
            if r.table == 0 || r.table == 255 {
                err(
                    format!("{p}.table"),
                    format!(
                        "table {} is reserved; use 1–252 or 256+ (254 is main)",
                        r.table
                    ),
                );
            }
            let from = r.from.as_deref().map(|s| (s, parse_prefix(s)));
            let to = r.to.as_deref().map(|s| (s, parse_prefix(s)));
            if from.is_none() && to.is_none() {
                err(
                    p.clone(),
                    "a rule needs from, to or both (a catch-all rule would capture all traffic)"
                        .into(),
                );
            }
            for (field, v) in [("from", &from), ("to", &to)] {
                match v {
                    Some((s, None)) => err(
                        format!("{p}.{field}"),
                        format!("{s:?} is not a prefix, e.g. 10.0.20.33/32"),
                    ),
                    // The kernel stores a /0 as no prefix at all: the rule would match every
                    // address on this side (and, with nothing on the other, all traffic).
                    Some((s, Some(n))) if n.prefix_len() == 0 => err(
                        format!("{p}.{field}"),
                        format!(
                            "{s} matches every address (a catch-all rule would capture all traffic); give a longer prefix, e.g. 10.0.20.33/32, or leave {field} out"
                        ),
                    ),
                    _ => {}
                }
            }
            if let (Some((_, Some(f))), Some((_, Some(t)))) = (&from, &to)
                && f.addr().is_ipv6() != t.addr().is_ipv6()
            {
                err(
                    format!("{p}.to"),
                    "from and to are of different IP families".into(),
                );
            }
            if let Some((_, Some(t))) = &to
                && overlaps(t, &link_local_v4())
                && r.table != TABLE_MAIN
            {
                err(
                    format!("{p}.table"),
                    format!("traffic to {LINK_LOCAL_V4} must stay in table main (254)"),
                );
            }
        }

        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm_state() -> NetworkState {
        serde_json::from_str(
            r#"{
              "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true}],
              "addresses": [{"link": "vnic1", "cidr": "10.0.20.33/24"}],
              "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101}],
              "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}]
            }"#,
        )
        .unwrap()
    }

    fn paths(s: &NetworkState) -> Vec<String> {
        s.validate()
            .unwrap_err()
            .into_iter()
            .map(|e| e.path)
            .collect()
    }

    #[test]
    fn good_state_validates_and_round_trips() {
        let s = vm_state();
        s.validate().unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"links\""));
        let back: NetworkState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        assert_eq!(s.routes[0].table, 101);
    }

    #[test]
    fn route_table_defaults_to_main() {
        let r: RouteSpec =
            serde_json::from_str(r#"{"destination":"10.0.0.0/8","link":"x"}"#).unwrap();
        assert_eq!(r.table, TABLE_MAIN);
    }

    #[test]
    fn vlan_ids_out_of_range_are_refused() {
        for id in [0u16, 4095] {
            let mut s = vm_state();
            s.links.push(LinkSpec {
                name: "v".into(),
                kind: LinkKind::Vlan,
                mac: None,
                parent: Some("vnic1".into()),
                vlan_id: Some(id),
                macvlan_mode: None,
                mtu: None,
                up: None,
            });
            assert_eq!(paths(&s), vec!["links[1].vlanId"]);
        }
    }

    #[test]
    fn small_mtu_duplicate_mac_and_bad_names_are_refused() {
        let mut s = vm_state();
        s.links[0].mtu = Some(67);
        let mut dup = s.links[0].clone();
        dup.name = "this-name-is-too-long".into();
        dup.mtu = None;
        dup.mac = Some("02:00:17:0A:22:02".into());
        s.links.push(dup);
        let errs = s.validate().unwrap_err();
        let p: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(p, vec!["links[0].mtu", "links[1].name", "links[1].mac"]);
        assert!(errs[2].message.contains("share one MAC"), "{}", errs[2]);
    }

    #[test]
    fn overlapping_tables_are_refused() {
        let mut s = vm_state();
        s.links.push(LinkSpec {
            name: "vnic2".into(),
            kind: LinkKind::Existing,
            mac: Some("02:00:17:0a:33:03".into()),
            parent: None,
            vlan_id: None,
            macvlan_mode: None,
            mtu: None,
            up: None,
        });
        s.routes.push(RouteSpec {
            destination: "default".into(),
            gateway: Some("10.0.30.1".into()),
            link: Some("vnic2".into()),
            table: 101,
            metric: Some(5),
            on_link: false,
        });
        let errs = s.validate().unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].path, "routes[1].table");
    }

    #[test]
    fn link_local_and_unknown_links_and_rule_range() {
        let mut s = vm_state();
        s.routes.push(RouteSpec {
            destination: "169.254.169.254/32".into(),
            gateway: None,
            link: Some("nope".into()),
            table: 254,
            metric: None,
            on_link: false,
        });
        s.rules.push(RuleSpec {
            from: None,
            to: None,
            table: 101,
            priority: 100,
        });
        s.addresses.push(AddressSpec {
            link: "vnic1".into(),
            cidr: "<null>".into(),
        });
        assert_eq!(
            paths(&s),
            vec![
                "addresses[1].cidr",
                "routes[1].destination",
                "routes[1].link",
                "rules[1].priority",
                "rules[1]"
            ]
        );
    }

    #[test]
    fn one_priority_may_hold_rules_of_both_families_but_not_the_same_rule_twice() {
        let mut s = vm_state();
        s.rules.push(RuleSpec {
            from: Some("fd00::33/128".into()),
            to: None,
            table: 101,
            priority: 20101,
        });
        s.validate().unwrap();
        s.rules.push(s.rules[0].clone());
        assert_eq!(paths(&s), vec!["rules[2]"]);
    }

    /// A rule `from`/`to` of length 0 matches everything; the kernel reads it back as no
    /// prefix, so such a rule would be a catch-all (and never settle). Refused, naming the field.
    #[test]
    fn rule_prefixes_of_length_zero_are_refused() {
        for (from, to, path) in [
            (Some("0.0.0.0/0"), None, "rules[0].from"),
            (None, Some("::/0"), "rules[0].to"),
            (Some("fd00::33/128"), Some("::/0"), "rules[0].to"),
        ] {
            let mut s = vm_state();
            s.rules[0].from = from.map(Into::into);
            s.rules[0].to = to.map(Into::into);
            let errs = s.validate().unwrap_err();
            assert_eq!(
                errs.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
                vec![path]
            );
            assert!(errs[0].message.contains("catch-all"), "{}", errs[0]);
        }
    }

    /// A child larger than its parent (the kernel refuses it) and an MTU below 1280 on a link
    /// with IPv6 addresses (the kernel drops them) are refused at `links[i].mtu`.
    #[test]
    fn mtus_the_kernel_would_not_keep_are_refused() {
        let mk = |name: &str, kind: LinkKind, parent: Option<&str>, mtu: u32| LinkSpec {
            name: name.into(),
            kind,
            mac: None,
            parent: parent.map(Into::into),
            vlan_id: (kind == LinkKind::Vlan).then_some(5),
            macvlan_mode: None,
            mtu: Some(mtu),
            up: None,
        };
        let mut s = NetworkState {
            links: vec![
                mk("eth0", LinkKind::Existing, None, 1500),
                mk("mv0", LinkKind::Macvlan, Some("eth0"), 9000),
                mk("mv0.5", LinkKind::Vlan, Some("mv0"), 9000),
            ],
            ..Default::default()
        };
        let errs = s.validate().unwrap_err();
        assert_eq!(errs.len(), 1, "{}", format_errors(&errs));
        assert_eq!(errs[0].path, "links[1].mtu");
        assert!(
            errs[0]
                .message
                .contains("larger than the MTU 1500 of its parent"),
            "{}",
            errs[0]
        );
        s.links[1].mtu = Some(1500);
        s.links[2].mtu = Some(1500);
        s.validate().unwrap();

        s.links[2].mtu = Some(1200);
        s.validate().unwrap();
        s.addresses.push(AddressSpec {
            link: "mv0.5".into(),
            cidr: "fd00::5/64".into(),
        });
        let errs = s.validate().unwrap_err();
        assert_eq!(errs.len(), 1, "{}", format_errors(&errs));
        assert_eq!(errs[0].path, "links[2].mtu");
        assert!(errs[0].message.contains("below 1280"), "{}", errs[0]);
        s.addresses[0].cidr = "10.0.5.5/24".into();
        s.validate().unwrap();
    }

    #[test]
    fn parent_cycles_are_refused() {
        let mk = |name: &str, parent: &str| LinkSpec {
            name: name.into(),
            kind: LinkKind::Macvlan,
            mac: None,
            parent: Some(parent.into()),
            vlan_id: None,
            macvlan_mode: None,
            mtu: None,
            up: None,
        };
        let s = NetworkState {
            links: vec![mk("a", "b"), mk("b", "a")],
            ..Default::default()
        };
        assert_eq!(paths(&s), vec!["links[0].parent", "links[1].parent"]);
    }

    #[test]
    fn schema_is_generated() {
        let schema = schemars::schema_for!(NetworkState);
        let json = serde_json::to_string(&schema).unwrap();
        assert!(json.contains("vlanId"));
        assert!(json.contains("Rule priority"));
    }
}
