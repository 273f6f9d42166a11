//! The planner: a pure diff of observed state against desired state into ordered steps, and the
//! inverse of each step (used for rollback).
//!
//! Order: deletions first, most dependent first (rules → routes → addresses → links, child links
//! before parents), then additions (link settings, parents first → links, parents first →
//! addresses → routes → rules). Addresses that leave a link that stays are deleted after the
//! new addresses are added, and what the kernel removes by itself on the way (the routes of a
//! link left without IPv4 addresses or taken down, the IPv6 of a link below 1280 bytes) is
//! added again. Only objects nodekeeper owns (see [`crate::observed`]) are ever deleted; links
//! it does not own are only matched and, when asked, get their MTU and up/down state set.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use nodekeeper_model::network::{
    LinkKind, LinkSpec, MacvlanMode, NetworkState, format_errors, format_mac, parse_mac,
    parse_prefix,
};
use serde::Serialize;

use crate::observed::{LINK_ALIAS_PREFIX, NK_PROTOCOL, Observed, ObservedLink};

/// What a created link is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum CreatedKind {
    Vlan { id: u16 },
    Macvlan { mode: MacvlanMode },
}

/// Everything needed to create (or re-create) a link nodekeeper owns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LinkDef {
    pub name: String,
    pub kind: CreatedKind,
    /// The parent's kernel name.
    pub parent: String,
    pub mac: Option<[u8; 6]>,
    pub mtu: Option<u32>,
    pub up: bool,
}

/// An address on a link (by kernel name).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AddressDef {
    pub link: String,
    pub net: IpNet,
}

/// A route as nodekeeper writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RouteDef {
    pub table: u32,
    pub destination: IpNet,
    pub gateway: Option<IpAddr>,
    /// Kernel name of the outgoing link.
    pub link: Option<String>,
    pub metric: u32,
    pub on_link: bool,
}

/// A policy rule as nodekeeper writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RuleDef {
    pub v6: bool,
    pub priority: u32,
    pub from: Option<IpNet>,
    pub to: Option<IpNet>,
    pub table: u32,
}

/// One planned operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Step {
    DeleteRule(RuleDef),
    DeleteRoute(RouteDef),
    DeleteAddress(AddressDef),
    DeleteLink(LinkDef),
    CreateLink(LinkDef),
    /// Set MTU and/or up/down; `prev_*` are the values found, for rollback.
    SetLink {
        link: String,
        mtu: Option<u32>,
        up: Option<bool>,
        prev_mtu: u32,
        prev_up: bool,
        /// The links stacked on this one (VLANs, macvlans, and theirs) whose MTU the kernel
        /// lowers to `mtu` with it, with the MTU each had: the inverse raises this link only,
        /// so a rollback gives these theirs back ([`Step::undo`]).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        lowered: Vec<(String, u32)>,
    },
    AddAddress(AddressDef),
    AddRoute(RouteDef),
    AddRule(RuleDef),
}

impl Step {
    /// The operation name used in `PlanStep.op`.
    pub fn op(&self) -> &'static str {
        match self {
            Step::DeleteRule(_) => "delete-rule",
            Step::DeleteRoute(_) => "delete-route",
            Step::DeleteAddress(_) => "delete-address",
            Step::DeleteLink(_) => "delete-link",
            Step::CreateLink(_) => "create-link",
            Step::SetLink { .. } => "set-link",
            Step::AddAddress(_) => "add-address",
            Step::AddRoute(_) => "add-route",
            Step::AddRule(_) => "add-rule",
        }
    }

    /// The step that undoes this one.
    pub fn inverse(&self) -> Step {
        match self.clone() {
            Step::DeleteRule(r) => Step::AddRule(r),
            Step::AddRule(r) => Step::DeleteRule(r),
            Step::DeleteRoute(r) => Step::AddRoute(r),
            Step::AddRoute(r) => Step::DeleteRoute(r),
            Step::DeleteAddress(a) => Step::AddAddress(a),
            Step::AddAddress(a) => Step::DeleteAddress(a),
            Step::DeleteLink(l) => Step::CreateLink(l),
            Step::CreateLink(l) => Step::DeleteLink(l),
            Step::SetLink {
                link,
                mtu,
                up,
                prev_mtu,
                prev_up,
                lowered: _,
            } => Step::SetLink {
                link,
                mtu: mtu.map(|_| prev_mtu),
                up: up.map(|_| prev_up),
                prev_mtu: mtu.unwrap_or(prev_mtu),
                prev_up: up.unwrap_or(prev_up),
                lowered: Vec::new(),
            },
        }
    }

    /// The steps that undo this one: its [`Step::inverse`], and for a set-link that lowered
    /// the MTU, the links the kernel lowered with it set back to theirs (after their parent is
    /// raised again: a VLAN or macvlan may not be larger than its parent).
    pub fn undo(&self) -> Vec<Step> {
        let mut out = vec![self.inverse()];
        if let Step::SetLink {
            lowered,
            mtu: Some(mtu),
            ..
        } = self
        {
            out.extend(lowered.iter().map(|(link, prev)| Step::SetLink {
                link: link.clone(),
                mtu: Some(*prev),
                up: None,
                prev_mtu: *mtu,
                // Unused: `up` is not set.
                prev_up: true,
                lowered: Vec::new(),
            }));
        }
        out
    }
}

/// The steps that undo an apply cut short, in the order to make them: `done` are the steps
/// made (oldest first), `failed` the step that failed after them, if it may have been made in
/// part (a set-link sets the MTU before the up/down state, and a refused up/down leaves the new
/// MTU in place). Steps are undone newest first, except set-links: the plan makes those parents
/// first, and their undo must raise a parent's MTU before its children's (the kernel refuses a
/// child larger than its parent with EINVAL), so a run of them is undone in the plan's order.
pub fn rollback(done: &[Step], failed: Option<&Step>) -> Vec<Step> {
    let mut made: Vec<&Step> = done.iter().collect();
    if let Some(step @ Step::SetLink { .. }) = failed {
        made.push(step);
    }
    let is_set = |s: &Step| matches!(s, Step::SetLink { .. });
    let mut out = Vec::new();
    let mut end = made.len();
    while end > 0 {
        let mut start = end - 1;
        if is_set(made[start]) {
            while start > 0 && is_set(made[start - 1]) {
                start -= 1;
            }
            out.extend(made[start..end].iter().flat_map(|s| s.undo()));
        } else {
            out.push(made[start].inverse());
        }
        end = start;
    }
    out
}

fn fmt_route(f: &mut fmt::Formatter<'_>, r: &RouteDef) -> fmt::Result {
    write!(f, "{}", r.destination)?;
    if let Some(g) = r.gateway {
        write!(f, " via {g}")?;
    }
    if let Some(l) = &r.link {
        write!(f, " dev {l}")?;
    }
    write!(f, " table {}", r.table)?;
    if r.metric != 0 {
        write!(f, " metric {}", r.metric)?;
    }
    if r.on_link {
        write!(f, " onlink")?;
    }
    Ok(())
}

fn fmt_rule(f: &mut fmt::Formatter<'_>, r: &RuleDef) -> fmt::Result {
    write!(f, "priority {}", r.priority)?;
    if let Some(n) = r.from {
        write!(f, " from {n}")?;
    }
    if let Some(n) = r.to {
        write!(f, " to {n}")?;
    }
    write!(f, " lookup {}", r.table)
}

fn fmt_link(f: &mut fmt::Formatter<'_>, l: &LinkDef) -> fmt::Result {
    match &l.kind {
        CreatedKind::Vlan { id } => write!(f, "vlan {id} on {} ({})", l.parent, l.name)?,
        CreatedKind::Macvlan { mode } => write!(
            f,
            "macvlan {} on {} ({})",
            format!("{mode:?}").to_lowercase(),
            l.parent,
            l.name
        )?,
    }
    if let Some(m) = l.mac {
        write!(f, " address {}", format_mac(&m))?;
    }
    if let Some(m) = l.mtu {
        write!(f, " mtu {m}")?;
    }
    write!(f, " {}", if l.up { "up" } else { "down" })
}

impl fmt::Display for Step {
    /// The object in `ip`-like words (the `PlanStep.object` of the gRPC contract).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::DeleteRule(r) | Step::AddRule(r) => fmt_rule(f, r),
            Step::DeleteRoute(r) | Step::AddRoute(r) => fmt_route(f, r),
            Step::DeleteAddress(a) | Step::AddAddress(a) => write!(f, "{} dev {}", a.net, a.link),
            Step::DeleteLink(l) | Step::CreateLink(l) => fmt_link(f, l),
            Step::SetLink { link, mtu, up, .. } => {
                write!(f, "{link}")?;
                if let Some(m) = mtu {
                    write!(f, " mtu {m}")?;
                }
                if let Some(u) = up {
                    write!(f, " {}", if *u { "up" } else { "down" })?;
                }
                Ok(())
            }
        }
    }
}

/// Why a desired state cannot be planned. Nothing has been changed when this is returned.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    #[error("invalid desired state: {}", format_errors(.0))]
    Invalid(Vec<nodekeeper_model::network::ValidationError>),
    #[error("links[{index}] ({name}): {message}")]
    ResolveLink {
        index: usize,
        name: String,
        message: String,
    },
    /// Deleting a link takes every VLAN and macvlan on it along (the kernel removes upper
    /// devices with their lower one), so a link that carries an interface the plan keeps is
    /// never deleted.
    #[error(
        "link {link} was created by nodekeeper and this state {action} it, but {child} ({whose}) is on it and the kernel would delete {child} with it; {fix}"
    )]
    WouldTakeChild {
        link: String,
        /// "removes", or "re-creates" (a change of kind, VLAN id, parent or MAC).
        action: &'static str,
        child: String,
        whose: &'static str,
        fix: String,
    },
}

/// The ordered plan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub steps: Vec<Step>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// The kernel's default metric for a route of this family when none is given.
fn default_metric(net: &IpNet) -> u32 {
    if net.addr().is_ipv6() { 1024 } else { 0 }
}

/// The metric the kernel stores for a route given `metric`: IPv6 takes 0 to mean its default,
/// 1024 (an IPv6 route written with metric 0 is reported with 1024).
fn kernel_metric(net: &IpNet, metric: Option<u32>) -> u32 {
    match metric {
        Some(0) if net.addr().is_ipv6() => default_metric(net),
        Some(m) => m,
        None => default_metric(net),
    }
}

/// A rule's `from`/`to` as the kernel keeps it: a /0 prefix matches everything, and the kernel
/// sends no `FRA_SRC`/`FRA_DST` for it, so it reads back as no prefix at all.
fn rule_prefix(net: Option<IpNet>) -> Option<IpNet> {
    net.filter(|n| n.prefix_len() > 0)
}

/// The lowest MTU at which the kernel keeps IPv6 on a link (below it, it drops the link's
/// IPv6 addresses and routes).
pub const IPV6_MIN_MTU: u32 = 1280;

fn alias_for(name: &str) -> String {
    format!("{LINK_ALIAS_PREFIX}{name}")
}

/// Resolves each desired link to the kernel name it has (or will have).
fn resolve_links(
    desired: &NetworkState,
    observed: &Observed,
) -> Result<BTreeMap<String, String>, PlanError> {
    let mut map = BTreeMap::new();
    for (i, l) in desired.links.iter().enumerate() {
        let fail = |message: String| PlanError::ResolveLink {
            index: i,
            name: l.name.clone(),
            message,
        };
        match l.kind {
            LinkKind::Existing => {
                let kernel = if let Some(mac) = &l.mac {
                    let want = parse_mac(mac).map(|m| format_mac(&m));
                    // A VLAN inherits its parent's MAC, and links nodekeeper created are not
                    // "existing": neither may satisfy a match by MAC.
                    let found: Vec<&ObservedLink> = observed
                        .links
                        .iter()
                        .filter(|o| o.mac == want && o.kind != "vlan" && !o.owned())
                        .collect();
                    match found.as_slice() {
                        [one] => one.name.clone(),
                        [] => {
                            return Err(fail(format!("no interface with MAC {mac} on this host")));
                        }
                        many => {
                            return Err(fail(format!(
                                "MAC {mac} matches several interfaces ({}); match by name instead",
                                many.iter()
                                    .map(|o| o.name.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            )));
                        }
                    }
                } else {
                    match observed.link_by_name(&l.name) {
                        Some(o) if o.owned() => {
                            return Err(fail(format!(
                                "{} was created by nodekeeper; declare it as vlan or macvlan, not existing",
                                l.name
                            )));
                        }
                        Some(o) => o.name.clone(),
                        None => {
                            return Err(fail(format!(
                                "no interface named {} on this host",
                                l.name
                            )));
                        }
                    }
                };
                map.insert(l.name.clone(), kernel);
            }
            LinkKind::Vlan | LinkKind::Macvlan => {
                if let Some(o) = observed.link_by_name(&l.name)
                    && !o.owned()
                {
                    return Err(fail(format!(
                        "an interface named {} exists and was not created by nodekeeper; choose another name",
                        l.name
                    )));
                }
                map.insert(l.name.clone(), l.name.clone());
            }
        }
    }
    // Parents: another desired link, or an interface that exists now.
    for (i, l) in desired.links.iter().enumerate() {
        if let Some(parent) = &l.parent {
            if let Some(k) = map.get(parent) {
                let _ = k;
            } else {
                let problem = match observed.link_by_name(parent) {
                    None => "does not exist on this host and is not in links",
                    // Found by the fuzz campaign (fuzz/regressions/netconf): a link nodekeeper
                    // created that this state no longer names is deleted by the plan, so a
                    // child on it would be created on a parent that is gone.
                    Some(o) if o.owned() => {
                        "was created by nodekeeper for an earlier state and is removed by this one; add it to links or choose another parent"
                    }
                    Some(_) => continue,
                };
                return Err(PlanError::ResolveLink {
                    index: i,
                    name: l.name.clone(),
                    message: format!("parent {parent} {problem}"),
                });
            }
        }
    }
    Ok(map)
}

fn link_def(l: &LinkSpec, map: &BTreeMap<String, String>) -> LinkDef {
    let parent = l.parent.clone().unwrap_or_default();
    LinkDef {
        name: l.name.clone(),
        kind: match l.kind {
            LinkKind::Vlan => CreatedKind::Vlan {
                id: l.vlan_id.unwrap_or(0),
            },
            _ => CreatedKind::Macvlan {
                mode: l.macvlan_mode.unwrap_or_default(),
            },
        },
        parent: map.get(&parent).cloned().unwrap_or(parent),
        mac: l.mac.as_deref().and_then(parse_mac),
        mtu: l.mtu,
        up: l.up.unwrap_or(true),
    }
}

fn mode_name(mode: MacvlanMode) -> &'static str {
    match mode {
        MacvlanMode::Private => "private",
        MacvlanMode::Vepa => "vepa",
        MacvlanMode::Bridge => "bridge",
        MacvlanMode::Passthru => "passthru",
    }
}

fn parse_mode(s: &str) -> MacvlanMode {
    match s {
        "private" => MacvlanMode::Private,
        "vepa" => MacvlanMode::Vepa,
        "passthru" => MacvlanMode::Passthru,
        _ => MacvlanMode::Bridge,
    }
}

/// Describes an owned observed link as a [`LinkDef`] (for deletion, so it can be re-created).
pub fn observed_link_def(o: &ObservedLink, observed: &Observed) -> LinkDef {
    LinkDef {
        name: o.name.clone(),
        kind: if o.kind == "vlan" {
            CreatedKind::Vlan {
                id: o.vlan_id.unwrap_or(0),
            }
        } else {
            CreatedKind::Macvlan {
                mode: parse_mode(o.macvlan_mode.as_deref().unwrap_or("bridge")),
            }
        },
        parent: o
            .parent_index
            .and_then(|i| observed.link_name(i))
            .unwrap_or_default()
            .to_string(),
        mac: if o.kind == "vlan" {
            None
        } else {
            o.mac.as_deref().and_then(parse_mac)
        },
        mtu: Some(o.mtu),
        up: o.up,
    }
}

/// Does an owned observed link already match what is desired (so no re-creation is needed)?
fn link_matches(o: &ObservedLink, d: &LinkDef, observed: &Observed) -> bool {
    let parent_ok = o.parent_index.and_then(|i| observed.link_name(i)) == Some(d.parent.as_str());
    let kind_ok = match &d.kind {
        CreatedKind::Vlan { id } => o.kind == "vlan" && o.vlan_id == Some(*id),
        CreatedKind::Macvlan { mode } => {
            o.kind == "macvlan" && o.macvlan_mode.as_deref().unwrap_or("bridge") == mode_name(*mode)
        }
    };
    let mac_ok = d
        .mac
        .is_none_or(|m| o.mac.as_deref() == Some(format_mac(&m).as_str()));
    parent_ok && kind_ok && mac_ok && o.alias.as_deref() == Some(alias_for(&d.name).as_str())
}

/// Plans the changes that take `observed` to `desired`. Pure: no I/O.
pub fn plan(desired: &NetworkState, observed: &Observed) -> Result<Plan, PlanError> {
    desired.validate().map_err(PlanError::Invalid)?;
    let map = resolve_links(desired, observed)?;
    let kernel = |name: &str| map.get(name).cloned().unwrap_or_else(|| name.to_string());
    // A VLAN or macvlan may not be larger than its parent: the kernel refuses to create or
    // raise it (EINVAL) and lowers it with its parent. The model checks this where the parent
    // is in links by the same name; here the parent is known by its kernel name, however the
    // state names it (an existing link matched by MAC).
    for (i, l) in desired.links.iter().enumerate() {
        let Some(mtu) = l.mtu else { continue };
        // An existing link's parent is the kernel's (a VLAN or macvlan nodekeeper did not
        // create, declared to set its MTU).
        let parent = match (l.kind, l.parent.as_deref()) {
            (LinkKind::Existing, _) => observed
                .link_by_name(&kernel(&l.name))
                .filter(|o| follows_parent_mtu(o))
                .and_then(|o| o.parent_index)
                .and_then(|p| observed.link_name(p))
                .map(str::to_string),
            (_, parent) => parent.map(&kernel),
        };
        let Some(parent) = parent else { continue };
        if let Some(parent_mtu) = mtu_after(&parent, desired, observed, &kernel)
            && mtu > parent_mtu
        {
            return Err(PlanError::ResolveLink {
                index: i,
                name: l.name.clone(),
                message: format!(
                    "mtu {mtu} is larger than the MTU {parent_mtu} its parent {parent} has or is given; a VLAN or macvlan may not be larger than its parent: lower mtu or raise the parent's"
                ),
            });
        }
    }

    // Desired objects in kernel terms.
    let want_links: Vec<(&LinkSpec, LinkDef)> = desired
        .links
        .iter()
        .filter(|l| l.kind != LinkKind::Existing)
        .map(|l| (l, link_def(l, &map)))
        .collect();
    let want_addrs: Vec<AddressDef> = desired
        .addresses
        .iter()
        .map(|a| AddressDef {
            link: kernel(&a.link),
            net: a.cidr.parse().expect("validated"),
        })
        .collect();
    let want_routes: Vec<RouteDef> = desired
        .routes
        .iter()
        .map(|r| {
            let destination = r.destination_net().expect("validated").trunc();
            RouteDef {
                table: r.table,
                gateway: r.gateway.as_deref().map(|g| g.parse().expect("validated")),
                link: r.link.as_deref().map(kernel),
                metric: kernel_metric(&destination, r.metric),
                on_link: r.on_link,
                destination,
            }
        })
        .collect();
    let want_rules: Vec<RuleDef> = desired
        .rules
        .iter()
        .map(|r| {
            let from = r
                .from
                .as_deref()
                .map(|s| parse_prefix(s).expect("validated").trunc());
            let to =
                r.to.as_deref()
                    .map(|s| parse_prefix(s).expect("validated").trunc());
            RuleDef {
                v6: from.or(to).is_some_and(|n| n.addr().is_ipv6()),
                priority: r.priority,
                from: rule_prefix(from),
                to: rule_prefix(to),
                table: r.table,
            }
        })
        .collect();

    // Links to (re-)create, and owned links to delete.
    let mut create = Vec::new();
    let mut delete_links: Vec<&ObservedLink> = Vec::new();
    let mut recreated = BTreeSet::new();
    for (_, d) in &want_links {
        match observed.link_by_name(&d.name) {
            Some(o) if link_matches(o, d, observed) => {}
            Some(o) => {
                delete_links.push(o);
                recreated.insert(d.name.clone());
                create.push(d.clone());
            }
            None => create.push(d.clone()),
        }
    }
    // A link is re-created when its parent is.
    loop {
        let mut more = false;
        for (_, d) in &want_links {
            if recreated.contains(&d.parent)
                && !recreated.contains(&d.name)
                && !create.iter().any(|c| c.name == d.name)
            {
                if let Some(o) = observed.link_by_name(&d.name) {
                    delete_links.push(o);
                }
                recreated.insert(d.name.clone());
                create.push(d.clone());
                more = true;
            }
        }
        if !more {
            break;
        }
    }
    for o in observed.links.iter().filter(|o| o.owned()) {
        if !want_links.iter().any(|(_, d)| d.name == o.name)
            && !delete_links.iter().any(|x| x.index == o.index)
        {
            delete_links.push(o);
        }
    }
    let gone: BTreeSet<u32> = delete_links.iter().map(|o| o.index).collect();
    // Found by the fuzz campaign (fuzz/regressions/netconf): deleting a link removes its VLANs
    // and macvlans too, so every link on one the plan deletes must be deleted by the plan.
    for o in &observed.links {
        if gone.contains(&o.index) {
            continue;
        }
        let mut cur = o.parent_index;
        for _ in 0..16 {
            let Some(p) = cur else { break };
            if gone.contains(&p) {
                let link = observed.link_name(p).unwrap_or("?").to_string();
                let (action, keep) = if recreated.contains(&link) {
                    ("re-creates", format!("leave {link} as it is"))
                } else {
                    ("removes", format!("keep {link} in links"))
                };
                let (whose, fix) = if o.owned() {
                    ("created by nodekeeper and still wanted", keep)
                } else {
                    (
                        "not created by nodekeeper",
                        format!("{keep}, or delete {} yourself first", o.name),
                    )
                };
                return Err(PlanError::WouldTakeChild {
                    link,
                    action,
                    child: o.name.clone(),
                    whose,
                    fix,
                });
            }
            cur = observed.link_by_index(p).and_then(|x| x.parent_index);
        }
    }

    // Deletions: rules, routes, addresses of owned objects no longer wanted.
    let mut steps = Vec::new();
    for r in observed.rules.iter().filter(|r| r.protocol == NK_PROTOCOL) {
        let def = RuleDef {
            v6: r.v6,
            priority: r.priority,
            from: rule_prefix(r.from),
            to: rule_prefix(r.to),
            table: r.table,
        };
        if !want_rules.contains(&def) {
            steps.push(Step::DeleteRule(def));
        }
    }
    let mut kept_routes = Vec::new();
    for r in observed.routes.iter().filter(|r| r.protocol == NK_PROTOCOL) {
        let def = RouteDef {
            table: r.table,
            destination: r.destination,
            gateway: r.gateway,
            link: r
                .oif
                .and_then(|i| observed.link_name(i))
                .map(str::to_string),
            metric: r.metric,
            on_link: r.on_link,
        };
        let on_gone = r.oif.is_some_and(|i| gone.contains(&i));
        // A desired route without a link lets the kernel pick the outgoing link from the
        // gateway, and the kernel reports the one it picked: compare without it, or such a
        // route would never look present and be re-added on every apply.
        let wanted = want_routes.iter().find(|w| {
            **w == def
                || (w.link.is_none()
                    && **w
                        == RouteDef {
                            link: None,
                            ..def.clone()
                        })
        });
        if let Some(w) = wanted.filter(|_| !on_gone) {
            // With the link the kernel reports it on: a flush of that link takes it (below).
            kept_routes.push((w.clone(), def.link.clone()));
        } else {
            steps.push(Step::DeleteRoute(def));
        }
    }
    let mut present_addrs = Vec::new();
    // Addresses that go from a link that stays are deleted after the new ones are added: when
    // a link loses its last IPv4 address the kernel deletes every IPv4 route through it, in
    // every table and whoever added it (found by review: changing a VNIC's address .33 → .34
    // left table 101 without its default route).
    let mut late_deletes = Vec::new();
    for a in &observed.addresses {
        let Some(link) = observed.link_name(a.index) else {
            continue;
        };
        let def = AddressDef {
            link: link.to_string(),
            net: a.net,
        };
        let on_gone = gone.contains(&a.index);
        if a.protocol == NK_PROTOCOL {
            if want_addrs.contains(&def) && !on_gone {
                present_addrs.push(def);
            } else if on_gone
                || !want_addrs.iter().any(|w| w.link == def.link)
                || (a.net.addr().is_ipv6()
                    && want_addrs
                        .iter()
                        .any(|w| w.link == def.link && w.net.addr() == def.net.addr()))
            {
                // Nothing is added to this link, so nothing to wait for; and IPv6 holds an
                // address once per link whatever its prefix length: the old one goes before
                // the new one can be added.
                steps.push(Step::DeleteAddress(def));
            } else {
                late_deletes.push(Step::DeleteAddress(def));
            }
        } else if !on_gone {
            // Someone else's address that happens to be the one wanted: it is left alone and
            // counts as present (nodekeeper does not take it over, so never deletes it).
            present_addrs.push(def);
        }
    }
    // Children before parents.
    let depth = |o: &ObservedLink| {
        let mut d = 0;
        let mut cur = o.parent_index;
        while let Some(p) = cur {
            d += 1;
            cur = observed.link_by_index(p).and_then(|x| x.parent_index);
            if d > 16 {
                break;
            }
        }
        d
    };
    delete_links.sort_by_key(|o| (std::cmp::Reverse(depth(o)), o.name.clone()));
    for o in &delete_links {
        steps.push(Step::DeleteLink(observed_link_def(o, observed)));
    }

    // Link settings on existing (and kept owned) links, parents first and before any link is
    // created: a macvlan or VLAN may not be larger than its parent, so a parent's MTU is raised
    // before a child that needs it is created or raised (found by the fault campaign: A with
    // eth0 1500 + mv1 1500, then B with eth0 1400 and no mv1, then A again failed with EINVAL).
    let mut settings = Vec::new();
    // Links whose IPv4 / IPv6 routes (and, for IPv6, addresses) the kernel removes during this
    // plan: a link taken down loses its routes and IPv6 addresses, a link whose MTU drops below
    // 1280 its IPv6, and a link left without IPv4 addresses its IPv4 routes. What the plan
    // keeps there is added again after.
    let mut flushed_v4: BTreeSet<String> = BTreeSet::new();
    let mut flushed_v6: BTreeSet<String> = BTreeSet::new();
    for o in observed.links.iter().filter(|o| !gone.contains(&o.index)) {
        let v4_on =
            |a: &&crate::observed::ObservedAddress| a.index == o.index && a.net.addr().is_ipv4();
        let had_v4 = observed.addresses.iter().any(|a| v4_on(&a));
        let keeps_v4 = observed
            .addresses
            .iter()
            .filter(v4_on)
            .any(|a| a.protocol != NK_PROTOCOL)
            || want_addrs
                .iter()
                .any(|w| w.link == o.name && w.net.addr().is_ipv4());
        if had_v4 && !keeps_v4 {
            flushed_v4.insert(o.name.clone());
        }
    }
    for l in &desired.links {
        let k = kernel(&l.name);
        if create.iter().any(|c| c.name == k) {
            continue;
        }
        let Some(o) = observed.link_by_name(&k) else {
            continue;
        };
        let up = match l.kind {
            LinkKind::Existing => l.up,
            _ => Some(l.up.unwrap_or(true)),
        };
        let mtu = l.mtu.filter(|m| *m != o.mtu);
        let up = up.filter(|u| *u != o.up);
        if up == Some(false) {
            flushed_v4.insert(k.clone());
            flushed_v6.insert(k.clone());
        }
        if mtu.is_some_and(|m| m < IPV6_MIN_MTU) && o.mtu >= IPV6_MIN_MTU {
            flushed_v6.insert(k.clone());
        }
        // The kernel lowers the MTU of every link stacked on this one that is larger than
        // the new MTU; rollback gives them theirs back.
        let lowered = match mtu {
            Some(m) if m < o.mtu => observed
                .links
                .iter()
                .filter(|u| u.mtu > m && !gone.contains(&u.index) && stacked_on(u, o, observed))
                .map(|u| (u.name.clone(), u.mtu))
                .collect(),
            _ => Vec::new(),
        };
        if mtu.is_some() || up.is_some() {
            settings.push((
                depth(o),
                Step::SetLink {
                    link: k,
                    mtu,
                    up,
                    prev_mtu: o.mtu,
                    prev_up: o.up,
                    lowered,
                },
            ));
        }
    }
    kept_routes.retain(|(w, link)| {
        let flushed = if w.destination.addr().is_ipv4() {
            &flushed_v4
        } else {
            &flushed_v6
        };
        !link.as_ref().is_some_and(|l| flushed.contains(l))
    });
    present_addrs.retain(|a| !(a.net.addr().is_ipv6() && flushed_v6.contains(&a.link)));
    settings.sort_by_key(|(d, _)| *d);
    steps.extend(settings.into_iter().map(|(_, s)| s));

    // Creations, parents first (desired order is kept among independent links).
    let mut placed: BTreeSet<String> = BTreeSet::new();
    let mut pending = create;
    while !pending.is_empty() {
        let before = pending.len();
        let mut rest = Vec::new();
        for d in pending {
            let parent_pending = want_links.iter().any(|(_, w)| w.name == d.parent)
                && !placed.contains(&d.parent)
                && recreated_or_new(&d.parent, observed, &recreated);
            if parent_pending {
                rest.push(d);
            } else {
                placed.insert(d.name.clone());
                steps.push(Step::CreateLink(d));
            }
        }
        if rest.len() == before {
            // Unreachable after validation (cycles are refused); keep the order rather than loop.
            steps.extend(rest.into_iter().map(Step::CreateLink));
            break;
        }
        pending = rest;
    }

    for a in want_addrs {
        if !present_addrs.contains(&a) {
            steps.push(Step::AddAddress(a));
        }
    }
    steps.extend(late_deletes);
    for r in want_routes {
        if !kept_routes.iter().any(|(k, _)| *k == r) {
            steps.push(Step::AddRoute(r));
        }
    }
    for r in want_rules {
        let present = observed.rules.iter().any(|o| {
            o.protocol == NK_PROTOCOL
                && RuleDef {
                    v6: o.v6,
                    priority: o.priority,
                    from: rule_prefix(o.from),
                    to: rule_prefix(o.to),
                    table: o.table,
                } == r
        });
        if !present {
            steps.push(Step::AddRule(r));
        }
    }
    Ok(Plan { steps })
}

/// The MTU the link with kernel name `link` has after the plan, where known: its desired MTU,
/// else the one it has now (a link to be created without one gets its parent's), and never
/// more than its parent's after the plan (the kernel lowers a VLAN or macvlan with its parent).
fn mtu_after(
    link: &str,
    desired: &NetworkState,
    observed: &Observed,
    kernel: &dyn Fn(&str) -> String,
) -> Option<u32> {
    let mut link = link.to_string();
    let mut lowest: Option<u32> = None;
    for _ in 0..16 {
        let spec = desired.links.iter().find(|l| kernel(&l.name) == link);
        let now = observed.link_by_name(&link);
        if let Some(mtu) = spec.and_then(|l| l.mtu).or(now.map(|o| o.mtu)) {
            lowest = Some(lowest.map_or(mtu, |m| m.min(mtu)));
        }
        let parent = match spec {
            Some(l) if l.kind != LinkKind::Existing => l.parent.as_deref().map(kernel),
            _ => now
                .filter(|o| follows_parent_mtu(o))
                .and_then(|o| o.parent_index)
                .and_then(|p| observed.link_name(p))
                .map(str::to_string),
        };
        match parent {
            Some(p) => link = p,
            None => break,
        }
    }
    lowest
}

/// Does the kernel hold this link's MTU at or below its parent's (`parent_index`)? True for
/// the devices stacked on a lower one; not for a veth, whose IFLA_LINK is its peer.
pub fn follows_parent_mtu(o: &ObservedLink) -> bool {
    matches!(
        o.kind.as_str(),
        "vlan" | "macvlan" | "macvtap" | "ipvlan" | "ipvtap"
    )
}

/// Is `upper` stacked (directly or through others) on `lower`, so that the kernel lowers its
/// MTU with `lower`'s?
fn stacked_on(upper: &ObservedLink, lower: &ObservedLink, observed: &Observed) -> bool {
    let mut cur = Some(upper);
    for _ in 0..16 {
        match cur
            .filter(|c| follows_parent_mtu(c))
            .and_then(|c| c.parent_index)
        {
            Some(p) if p == lower.index => return true,
            Some(p) => cur = observed.link_by_index(p),
            None => return false,
        }
    }
    false
}

fn recreated_or_new(name: &str, observed: &Observed, recreated: &BTreeSet<String>) -> bool {
    recreated.contains(name) || observed.link_by_name(name).is_none()
}

/// The alias nodekeeper gives a created link (public for the applier).
pub fn link_alias(name: &str) -> String {
    alias_for(name)
}

mod simulate;
pub use simulate::simulate;

#[cfg(test)]
mod tests;
