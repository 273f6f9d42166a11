//! A model of the kernel for checking plans without one: the planner's tests and the fuzz
//! campaign (`fuzz/`) apply a plan to an observed state with [`simulate`] and check that
//! planning again from the result finds nothing to do.

use nodekeeper_model::network::format_mac;

use super::{CreatedKind, IPV6_MIN_MTU, Plan, Step, follows_parent_mtu, link_alias, mode_name};
use crate::observed::{ObservedAddress, ObservedLink, ObservedRoute, ObservedRule};
use crate::{NK_PROTOCOL, Observed};

/// What the kernel would report after a perfect apply of `plan` on `obs`: links, addresses,
/// routes and rules added and removed as the steps say, with the kernel's own cascades: deleting
/// a link removes what is on it and the links stacked on it; deleting a link's last IPv4
/// address removes every IPv4 route through it; taking a link down removes its routes and IPv6
/// addresses (`keep_addr_on_down` 0, the default); an MTU below 1280 removes its IPv6 addresses
/// and routes; lowering an MTU lowers the links stacked on it that are larger. Errors when a
/// step names a link that is not there at that point of the plan.
pub fn simulate(mut obs: Observed, plan: &Plan) -> Result<Observed, String> {
    let index = |obs: &Observed, name: &str| {
        obs.link_by_name(name)
            .map(|l| l.index)
            .ok_or_else(|| format!("the plan names link {name:?}, which is not there at that step"))
    };
    for step in &plan.steps {
        match step {
            Step::DeleteLink(d) => {
                // The kernel removes the link, what is on it and the links stacked on it.
                let mut gone = vec![index(&obs, &d.name)?];
                while let Some(i) = gone.pop() {
                    gone.extend(
                        obs.links
                            .iter()
                            .filter(|l| l.parent_index == Some(i))
                            .map(|l| l.index),
                    );
                    obs.links.retain(|l| l.index != i);
                    obs.addresses.retain(|a| a.index != i);
                    obs.routes.retain(|r| r.oif != Some(i));
                }
            }
            Step::DeleteAddress(a) => {
                let i = index(&obs, &a.link)?;
                obs.addresses.retain(|o| !(o.index == i && o.net == a.net));
                let v4_left = obs
                    .addresses
                    .iter()
                    .any(|o| o.index == i && o.net.addr().is_ipv4());
                if a.net.addr().is_ipv4() && !v4_left {
                    obs.routes
                        .retain(|r| !(r.oif == Some(i) && r.destination.addr().is_ipv4()));
                }
            }
            Step::DeleteRoute(r) => {
                let oif = r.link.as_deref().map(|l| index(&obs, l)).transpose()?;
                obs.routes.retain(|o| {
                    !(o.table == r.table
                        && o.destination == r.destination
                        && o.gateway == r.gateway
                        && (oif.is_none() || o.oif == oif)
                        && o.metric == r.metric)
                });
            }
            Step::DeleteRule(r) => obs.rules.retain(|o| {
                !(o.v6 == r.v6
                    && o.priority == r.priority
                    && o.from == r.from
                    && o.to == r.to
                    && o.table == r.table)
            }),
            Step::CreateLink(d) => {
                let new_index = obs.links.iter().map(|l| l.index).max().unwrap_or(0) + 1;
                let parent = index(&obs, &d.parent)?;
                let parent_mac = obs.link_by_index(parent).and_then(|l| l.mac.clone());
                // A VLAN or macvlan created without an MTU gets its parent's.
                let parent_mtu = obs.link_by_index(parent).map_or(1500, |l| l.mtu);
                obs.links.push(ObservedLink {
                    index: new_index,
                    name: d.name.clone(),
                    mac: d.mac.map(|m| format_mac(&m)).or(parent_mac),
                    mtu: d.mtu.unwrap_or(parent_mtu),
                    up: d.up,
                    oper_state: "up".into(),
                    kind: match d.kind {
                        CreatedKind::Vlan { .. } => "vlan".into(),
                        CreatedKind::Macvlan { .. } => "macvlan".into(),
                    },
                    parent_index: Some(parent),
                    vlan_id: match d.kind {
                        CreatedKind::Vlan { id } => Some(id),
                        CreatedKind::Macvlan { .. } => None,
                    },
                    macvlan_mode: match d.kind {
                        CreatedKind::Vlan { .. } => None,
                        CreatedKind::Macvlan { mode } => Some(mode_name(mode).into()),
                    },
                    alias: Some(link_alias(&d.name)),
                });
            }
            Step::SetLink { link, mtu, up, .. } => {
                let i = index(&obs, link)?;
                let l = obs
                    .links
                    .iter_mut()
                    .find(|l| l.index == i)
                    .expect("looked up");
                let (was_up, was_mtu) = (l.up, l.mtu);
                if let Some(m) = mtu {
                    l.mtu = *m;
                }
                if let Some(u) = up {
                    l.up = *u;
                }
                if was_up && *up == Some(false) {
                    obs.routes.retain(|r| r.oif != Some(i));
                    obs.addresses
                        .retain(|a| !(a.index == i && a.net.addr().is_ipv6()));
                }
                if let Some(m) = *mtu {
                    if m < IPV6_MIN_MTU && was_mtu >= IPV6_MIN_MTU {
                        obs.routes
                            .retain(|r| !(r.oif == Some(i) && r.destination.addr().is_ipv6()));
                        obs.addresses
                            .retain(|a| !(a.index == i && a.net.addr().is_ipv6()));
                    }
                    // Stacked links follow a lowered parent down, and theirs follow them.
                    let mut lower = vec![i];
                    while let Some(p) = lower.pop() {
                        for u in obs
                            .links
                            .iter_mut()
                            .filter(|u| u.parent_index == Some(p) && follows_parent_mtu(u))
                        {
                            if u.mtu > m {
                                u.mtu = m;
                            }
                            lower.push(u.index);
                        }
                    }
                }
            }
            Step::AddAddress(a) => {
                let i = index(&obs, &a.link)?;
                obs.addresses.push(ObservedAddress {
                    index: i,
                    net: a.net,
                    protocol: NK_PROTOCOL,
                });
            }
            Step::AddRoute(r) => {
                let oif = r.link.as_deref().map(|l| index(&obs, l)).transpose()?;
                obs.routes.push(ObservedRoute {
                    table: r.table,
                    destination: r.destination,
                    gateway: r.gateway,
                    oif,
                    metric: r.metric,
                    protocol: NK_PROTOCOL,
                    on_link: r.on_link,
                });
            }
            Step::AddRule(r) => obs.rules.push(ObservedRule {
                v6: r.v6,
                priority: r.priority,
                from: r.from,
                to: r.to,
                table: r.table,
                protocol: NK_PROTOCOL,
            }),
        }
    }
    Ok(obs)
}
