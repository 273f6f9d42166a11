//! Host network configuration: desired [`NetworkState`] → plan (pure diff against what the kernel
//! reports) → apply through rtnetlink → post-apply check → rollback on any failure.
//!
//! Entry point (also used by the qemu VLAN harness):
//!
//! ```no_run
//! # async fn f(desired: nodekeeper_model::network::NetworkState) -> Result<(), nodekeeper_netconf::NetconfError> {
//! use nodekeeper_netconf::{ApplyOptions, Netconf};
//! // Must run inside a tokio runtime, on a thread in the target network namespace.
//! let nc = Netconf::connect()?;
//! let report = nc.apply(&desired, &ApplyOptions::default()).await?;
//! assert!(report.outcome.is_success(), "{:?}", report.error);
//! # Ok(()) }
//! ```

pub mod check;
pub mod netlink;
pub mod observed;
pub mod plan;

use std::time::Duration;

pub use check::Target;
use nodekeeper_model::network::{LinkKind, NetworkState};
pub use observed::{LINK_ALIAS_PREFIX, NK_PROTOCOL, Observed};
pub use plan::{Plan, PlanError, Step, plan};

/// Errors that stop an apply before it changes anything.
#[derive(Debug, thiserror::Error)]
pub enum NetconfError {
    #[error("open rtnetlink socket: {0}")]
    Connect(#[source] std::io::Error),
    #[error("read {what} through netlink: {message}")]
    Read { what: &'static str, message: String },
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("{0}")]
    BadCheckTarget(String),
    /// The kernel cannot mark addresses as nodekeeper's (see [`check_kernel`]).
    #[error(
        "this node's kernel {release} is older than Linux {}.{}: it drops the IFA_PROTO mark \
         nodekeeper owns addresses by, so addresses it added could never be told apart and \
         removed; the desired state has {addresses} address(es) (spec.state.addresses or the OCI \
         VNIC layout): upgrade the node's kernel (Oracle Linux: UEK8) or leave addresses out",
        IFA_PROTO_SINCE.0,
        IFA_PROTO_SINCE.1
    )]
    KernelTooOld { release: String, addresses: usize },
    /// The kernel cannot mark policy rules as nodekeeper's (see [`check_kernel`]).
    #[error(
        "this node's kernel {release} is older than Linux {}.{}: it drops the FRA_PROTOCOL mark \
         nodekeeper owns policy rules by, so rules it added could never be told apart and \
         removed; the desired state has {rules} rule(s) (spec.state.rules or the OCI VNIC \
         layout): upgrade the node's kernel or leave rules out",
        FRA_PROTOCOL_SINCE.0,
        FRA_PROTOCOL_SINCE.1
    )]
    KernelTooOldForRules { release: String, rules: usize },
}

/// The first kernel that keeps `IFA_PROTO` on addresses (Linux 5.18).
pub const IFA_PROTO_SINCE: (u32, u32) = (5, 18);

/// The first kernel that keeps `FRA_PROTOCOL` on policy rules (Linux 4.17).
pub const FRA_PROTOCOL_SINCE: (u32, u32) = (4, 17);

/// Refuses a desired state with addresses on a kernel older than [`IFA_PROTO_SINCE`], or with
/// policy rules on one older than [`FRA_PROTOCOL_SINCE`] (`release` as `uname -r` prints it).
/// Such a kernel drops the protocol mark of an added address (rule) and reports protocol 0:
/// the plan would take nodekeeper's own objects for someone else's, never remove them, and
/// leave them out of the restore point. Decided by the release number because a probe would
/// have to add an object to this host (or a namespace) first; a release that cannot be read is
/// let through, as it says nothing either way.
pub fn check_kernel(release: &str, desired: &NetworkState) -> Result<(), NetconfError> {
    if desired.addresses.is_empty() && desired.rules.is_empty() {
        return Ok(());
    }
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().ok());
    let (Some(Some(major)), Some(Some(minor))) = (numbers.next(), numbers.next()) else {
        return Ok(());
    };
    if !desired.rules.is_empty() && (major, minor) < FRA_PROTOCOL_SINCE {
        return Err(NetconfError::KernelTooOldForRules {
            release: release.trim().to_string(),
            rules: desired.rules.len(),
        });
    }
    if !desired.addresses.is_empty() && (major, minor) < IFA_PROTO_SINCE {
        return Err(NetconfError::KernelTooOld {
            release: release.trim().to_string(),
            addresses: desired.addresses.len(),
        });
    }
    Ok(())
}

/// How to apply.
#[derive(Clone, Debug, Default)]
pub struct ApplyOptions {
    /// Plan only.
    pub dry_run: bool,
    /// Reachability targets that must answer after the apply, or everything is rolled back.
    pub check_targets: Vec<Target>,
    /// Deadline of the whole check; 5 s when zero.
    pub check_timeout: Duration,
    /// Test hook: fail (without sending it) the step with this index, as a kernel error would.
    #[doc(hidden)]
    pub fail_at_step: Option<usize>,
    /// Test hook: after this many steps (the plan's length: before the check), write the number
    /// to `hold_marker` (when given) and wait forever, so that a test can kill the process at
    /// exactly that point of the apply.
    #[doc(hidden)]
    pub hold_after_steps: Option<usize>,
    #[doc(hidden)]
    pub hold_marker: Option<std::path::PathBuf>,
}

impl ApplyOptions {
    /// The hold of [`ApplyOptions::hold_after_steps`], when `done` steps are made.
    async fn hold_if_asked(&self, done: usize) {
        if self.hold_after_steps != Some(done) {
            return;
        }
        tracing::warn!(
            steps = done,
            "test hook: holding the apply until the process is killed"
        );
        if let Some(marker) = &self.hold_marker
            && let Err(error) = std::fs::write(marker, done.to_string())
        {
            tracing::warn!(%error, marker = %marker.display(), "test hook: write the hold marker");
        }
        std::future::pending::<()>().await;
    }
}

/// How an apply ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Planned,
    Applied,
    RolledBack,
    RollbackFailed,
}

impl Outcome {
    pub fn is_success(self) -> bool {
        matches!(self, Outcome::Planned | Outcome::Applied)
    }
}

/// The result of [`Netconf::apply`].
#[derive(Clone, Debug)]
pub struct ApplyReport {
    /// The steps planned; after an apply, the steps made: the plan, then those made to
    /// converge (see [`Netconf::apply`]).
    pub plan: Plan,
    pub outcome: Outcome,
    /// What failed (the step, or the check), and for a failed rollback what remains.
    pub error: Option<String>,
    /// Netlink write requests made by this call.
    pub writes: u64,
}

/// A netlink connection to the calling thread's network namespace, with plan/apply/rollback.
#[derive(Clone)]
pub struct Netconf {
    link: netlink::Link,
    /// The kernel release (`/proc/sys/kernel/osrelease`; empty when unreadable), for
    /// [`check_kernel`].
    kernel: String,
}

impl Netconf {
    /// Opens the rtnetlink connection (spawned on the current tokio runtime).
    pub fn connect() -> Result<Self, NetconfError> {
        Ok(Self {
            link: netlink::Link::connect()?,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default(),
        })
    }

    /// Netlink writes made through this connection so far.
    pub fn writes(&self) -> u64 {
        self.link.writes()
    }

    /// Reads the current state.
    pub async fn observe(&self) -> Result<Observed, NetconfError> {
        self.link.observe().await
    }

    /// Plans `desired` against the current state; a state with addresses or rules is refused
    /// on a kernel that cannot mark them ([`check_kernel`]).
    pub async fn plan(&self, desired: &NetworkState) -> Result<Plan, NetconfError> {
        check_kernel(&self.kernel, desired)?;
        Ok(plan::plan(desired, &self.observe().await?)?)
    }

    /// Plans and (unless dry-run) applies; on a failed step or check, undoes every step already
    /// made (newest first, [`plan::rollback`]), then plans the way back to the state found
    /// ([`restore_point`]) and makes that too, for what the kernel removed by itself. An `Err`
    /// means nothing was changed.
    ///
    /// After the steps the host is read and planned again: the kernel undoes some changes by
    /// itself (a link left without IPv4 addresses loses its IPv4 routes; with
    /// `promote_secondaries` off, deleting a primary address deletes its secondaries), which a
    /// plan foresees only in part. What is left is made once more; a host that still differs
    /// after that is a failure naming what did not converge, and is rolled back.
    pub async fn apply(
        &self,
        desired: &NetworkState,
        opts: &ApplyOptions,
    ) -> Result<ApplyReport, NetconfError> {
        let start = self.writes();
        check_kernel(&self.kernel, desired)?;
        let before = self.observe().await?;
        let mut plan = plan::plan(desired, &before)?;
        if opts.dry_run || plan.is_empty() {
            let outcome = if opts.dry_run {
                Outcome::Planned
            } else {
                Outcome::Applied
            };
            return Ok(ApplyReport {
                plan,
                outcome,
                error: None,
                writes: 0,
            });
        }
        let mut done: Vec<Step> = Vec::new();
        let mut failed: Option<Step> = None;
        let mut failure = None;
        for (i, step) in plan.steps.iter().enumerate() {
            opts.hold_if_asked(i).await;
            let result = if opts.fail_at_step == Some(i) {
                Err(std::io::Error::other("injected failure"))
            } else {
                self.link.execute(step).await
            };
            match result {
                Ok(()) => {
                    tracing::debug!(op = step.op(), object = %step, "applied");
                    done.push(step.clone());
                }
                Err(e) => {
                    failure = Some(format!("step {} ({} {step}) failed: {e}", i + 1, step.op()));
                    if opts.fail_at_step != Some(i) {
                        failed = Some(step.clone());
                    }
                    break;
                }
            }
        }
        if failure.is_none() {
            opts.hold_if_asked(plan.steps.len()).await;
            if let Err(e) = self
                .converge(desired, &mut plan, &mut done, &mut failed)
                .await
            {
                failure = Some(e);
            }
        }
        if failure.is_none() && !opts.check_targets.is_empty() {
            let timeout = if opts.check_timeout.is_zero() {
                Duration::from_secs(5)
            } else {
                opts.check_timeout
            };
            if let Err(e) = check::check_all(&opts.check_targets, timeout).await {
                failure = Some(format!("post-apply check failed: {e}"));
            }
        }
        let Some(error) = failure else {
            return Ok(ApplyReport {
                plan,
                outcome: Outcome::Applied,
                error: None,
                writes: self.writes() - start,
            });
        };
        tracing::warn!(%error, steps = done.len(), "rolling back");
        let mut remaining = Vec::new();
        for inv in plan::rollback(&done, failed.as_ref()) {
            if let Err(e) = self.link.execute(&inv).await {
                remaining.push(format!("{} {inv}: {e}", inv.op()));
            }
        }
        if remaining.is_empty() {
            // The inverses undo the steps, not what the kernel removed along with them.
            let back = restore_point(desired, &before);
            let steps = match self.observe().await {
                Ok(now) => plan::plan(&back, &now)
                    .map(|p| p.steps)
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match steps {
                Ok(steps) => {
                    for step in steps {
                        tracing::warn!(op = step.op(), object = %step, "restoring what the kernel removed");
                        if let Err(e) = self.link.execute(&step).await {
                            remaining.push(format!("{} {step}: {e}", step.op()));
                        }
                    }
                }
                Err(e) => remaining.push(format!("plan the way back to the state before: {e}")),
            }
        }
        let (outcome, error) = if remaining.is_empty() {
            (Outcome::RolledBack, error)
        } else {
            (
                Outcome::RollbackFailed,
                format!("{error}; rollback could not {}", remaining.join("; ")),
            )
        };
        Ok(ApplyReport {
            plan,
            outcome,
            error: Some(error),
            writes: self.writes() - start,
        })
    }

    /// Reads the host after the plan's steps and plans again; makes what is left once (its
    /// steps are appended to `plan` and `done`), and fails when a second re-plan still finds
    /// steps, naming them.
    async fn converge(
        &self,
        desired: &NetworkState,
        plan: &mut Plan,
        done: &mut Vec<Step>,
        failed: &mut Option<Step>,
    ) -> Result<(), String> {
        for pass in 0..2 {
            let now = self
                .observe()
                .await
                .map_err(|e| format!("read the host again after applying: {e}"))?;
            let again =
                plan::plan(desired, &now).map_err(|e| format!("plan again after applying: {e}"))?;
            if again.is_empty() {
                return Ok(());
            }
            let left = again
                .steps
                .iter()
                .map(|s| format!("{} {s}", s.op()))
                .collect::<Vec<_>>()
                .join("; ");
            if pass > 0 {
                return Err(format!(
                    "the host did not converge: after applying the plan and then what the kernel \
                     had undone, planning again still finds {} step(s) ({left}); the kernel \
                     removes or refuses them, e.g. routes through a link that is down or has \
                     no address for their gateway",
                    again.steps.len()
                ));
            }
            tracing::warn!(steps = %left, "the kernel undid part of the apply; making it again");
            for step in again.steps {
                if let Err(e) = self.link.execute(&step).await {
                    let message = format!(
                        "step {} ({} {step}) failed: {e}",
                        plan.steps.len() + 1,
                        step.op()
                    );
                    plan.steps.push(step.clone());
                    *failed = Some(step);
                    return Err(message);
                }
                done.push(step.clone());
                plan.steps.push(step);
            }
        }
        Ok(())
    }

    /// What differs between `desired` and the host, one line per planned step (empty: no drift).
    pub async fn drift(&self, desired: &NetworkState) -> Result<Vec<String>, NetconfError> {
        Ok(self
            .plan(desired)
            .await?
            .steps
            .iter()
            .map(|s| format!("{} {s}", s.op()))
            .collect())
    }

    /// The observed state restricted to what `desired` names and what nodekeeper owns, in the
    /// model's own terms (for `ApplyNetworkResponse.observed_state_json`).
    pub async fn observed_state(
        &self,
        desired: &NetworkState,
    ) -> Result<NetworkState, NetconfError> {
        Ok(owned_state(desired, &self.observe().await?))
    }
}

/// Projects observed state onto the model: the links `desired` names (found by name or MAC) and
/// links nodekeeper created, owned addresses, routes and rules.
pub fn owned_state(desired: &NetworkState, obs: &Observed) -> NetworkState {
    use nodekeeper_model::network::{AddressSpec, LinkSpec, MacvlanMode, RouteSpec, RuleSpec};
    let mut out = NetworkState::default();
    let mut label = std::collections::BTreeMap::new();
    for l in &obs.links {
        let declared = desired.links.iter().find(|d| {
            d.kind == LinkKind::Existing
                && match &d.mac {
                    Some(m) => o_mac_eq(l.mac.as_deref(), m) && l.kind != "vlan" && !l.owned(),
                    None => d.name == l.name,
                }
        });
        if !(l.owned() || declared.is_some()) {
            continue;
        }
        let name = declared.map_or(l.name.clone(), |d| d.name.clone());
        label.insert(l.index, name.clone());
        let parent = l
            .parent_index
            .and_then(|i| obs.link_name(i))
            .map(str::to_string);
        let (kind, parent, vlan_id, mode, mac) = if !l.owned() {
            // The MAC only where the desired state matches by MAC: a link matched by name
            // shares its MAC with others (a bond and its ports, a NIC and its VLANs), so a
            // restore point matching by it could find another link or several.
            let mac = declared.and_then(|d| d.mac.as_ref()).and(l.mac.clone());
            (LinkKind::Existing, None, None, None, mac)
        } else if l.kind == "vlan" {
            (LinkKind::Vlan, parent, l.vlan_id, None, None)
        } else {
            let mode = match l.macvlan_mode.as_deref() {
                Some("private") => MacvlanMode::Private,
                Some("vepa") => MacvlanMode::Vepa,
                Some("passthru") => MacvlanMode::Passthru,
                _ => MacvlanMode::Bridge,
            };
            (LinkKind::Macvlan, parent, None, Some(mode), l.mac.clone())
        };
        out.links.push(LinkSpec {
            name,
            kind,
            mac,
            parent,
            vlan_id,
            macvlan_mode: mode,
            mtu: Some(l.mtu),
            up: Some(l.up),
        });
    }
    let lname = |i: u32| {
        label
            .get(&i)
            .cloned()
            .or_else(|| obs.link_name(i).map(str::to_string))
    };
    for a in obs.addresses.iter().filter(|a| a.protocol == NK_PROTOCOL) {
        if let Some(link) = lname(a.index) {
            out.addresses.push(AddressSpec {
                link,
                cidr: a.net.to_string(),
            });
        }
    }
    for r in obs.routes.iter().filter(|r| r.protocol == NK_PROTOCOL) {
        out.routes.push(RouteSpec {
            destination: if r.destination.prefix_len() == 0 && r.destination.addr().is_ipv4() {
                "default".into()
            } else {
                r.destination.to_string()
            },
            gateway: r.gateway.map(|g| g.to_string()),
            link: r.oif.and_then(lname),
            table: r.table,
            metric: Some(r.metric),
            on_link: r.on_link,
        });
    }
    for r in obs.rules.iter().filter(|r| r.protocol == NK_PROTOCOL) {
        out.rules.push(RuleSpec {
            from: r.from.map(|n| n.to_string()),
            to: r.to.map(|n| n.to_string()),
            table: r.table,
            priority: r.priority,
        });
    }
    out
}

/// What an apply of `desired` can change, as the host has it now: the state to return to when
/// that apply is cut short (the agent journals it before the first step, and applies it after a
/// restart that interrupted the apply). It is [`owned_state`], with every link that an owned
/// address or route sits on declared (an existing link, by name, left as it is), so that it is
/// itself a valid desired state. Applying it undoes any part of `desired` already applied:
/// what nodekeeper created since is deleted, what it deleted is created again, and the links
/// `desired` configures get their MTU and up/down state back. Applying it twice is the same as
/// once, so an interruption of the return itself is undone by starting it again.
pub fn restore_point(desired: &NetworkState, obs: &Observed) -> NetworkState {
    use nodekeeper_model::network::LinkSpec;
    let mut state = owned_state(desired, obs);
    let named: Vec<String> = state
        .addresses
        .iter()
        .map(|a| a.link.clone())
        .chain(state.routes.iter().filter_map(|r| r.link.clone()))
        .collect();
    for name in named {
        if !state.links.iter().any(|l| l.name == name) {
            state.links.push(LinkSpec {
                name,
                kind: LinkKind::Existing,
                mac: None,
                parent: None,
                vlan_id: None,
                macvlan_mode: None,
                mtu: None,
                up: None,
            });
        }
    }
    state
}

fn o_mac_eq(observed: Option<&str>, want: &str) -> bool {
    observed.is_some_and(|o| o.eq_ignore_ascii_case(want))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review nnc, finding 4: addresses are refused below Linux 5.18 (IFA_PROTO), naming the
    /// kernel and what to do; a state without addresses, a newer kernel and an unreadable
    /// release go through.
    #[test]
    fn addresses_need_a_kernel_that_keeps_ifa_proto() {
        let with: NetworkState = serde_json::from_value(serde_json::json!({
            "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02"}],
            "addresses": [{"link": "vnic1", "cidr": "10.0.20.33/24"}],
        }))
        .unwrap();
        let without = NetworkState {
            addresses: Vec::new(),
            ..with.clone()
        };
        let e = check_kernel("5.15.0-300.163.18.el9uek.x86_64\n", &with).unwrap_err();
        let m = e.to_string();
        for words in [
            "kernel 5.15.0-300.163.18.el9uek.x86_64 is older than Linux 5.18",
            "IFA_PROTO",
            "1 address(es)",
            "upgrade the node's kernel",
        ] {
            assert!(m.contains(words), "{words:?}: {m}");
        }
        assert!(check_kernel("5.17.15", &with).is_err());
        assert!(check_kernel("4.18.0-553.el8_10.x86_64", &with).is_err());
        for ok in [
            "5.18.0",
            "6.1.0-25-amd64",
            "6.12.0-100.el10uek.x86_64",
            "",
            "weird",
        ] {
            check_kernel(ok, &with).unwrap();
        }
        check_kernel("5.15.0", &without).unwrap();
    }

    /// Policy rules are refused below Linux 4.17 (FRA_PROTOCOL), naming the kernel, the field
    /// and what to do; from 4.17 on, or without rules, they go through.
    #[test]
    fn rules_need_a_kernel_that_keeps_fra_protocol() {
        let with: NetworkState = serde_json::from_value(serde_json::json!({
            "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}],
        }))
        .unwrap();
        let m = check_kernel("4.14.35-2047.el7uek.x86_64", &with)
            .unwrap_err()
            .to_string();
        for words in [
            "kernel 4.14.35-2047.el7uek.x86_64 is older than Linux 4.17",
            "FRA_PROTOCOL",
            "1 rule(s) (spec.state.rules",
            "upgrade the node's kernel or leave rules out",
        ] {
            assert!(m.contains(words), "{words:?}: {m}");
        }
        for ok in ["4.17.0", "5.4.0", ""] {
            check_kernel(ok, &with).unwrap();
        }
        check_kernel("4.14.0", &NetworkState::default()).unwrap();
    }

    /// The restore point keeps a link's MAC only where the desired state matches that link by
    /// MAC: one matched by name shares its MAC with others (a bond and its ports), and a
    /// restore point matching by it would find those.
    #[test]
    fn the_restore_point_matches_links_as_the_desired_state_does() {
        use crate::observed::ObservedLink;
        let nic = |index: u32, name: &str, mac: &str| ObservedLink {
            index,
            name: name.into(),
            mac: Some(mac.into()),
            mtu: 1500,
            up: true,
            oper_state: "up".into(),
            kind: String::new(),
            parent_index: None,
            vlan_id: None,
            macvlan_mode: None,
            alias: None,
        };
        let obs = Observed {
            links: vec![
                nic(2, "ens3", "02:00:17:0a:11:01"),
                nic(3, "bond0", "02:00:17:0a:11:01"),
                nic(4, "ens5", "02:00:17:0a:22:02"),
            ],
            ..Default::default()
        };
        let desired: NetworkState = serde_json::from_value(serde_json::json!({
            "links": [
                {"name": "bond0", "kind": "existing", "mtu": 9000},
                {"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000}
            ],
        }))
        .unwrap();
        let back = restore_point(&desired, &obs);
        let macs: Vec<(&str, Option<&str>)> = back
            .links
            .iter()
            .map(|l| (l.name.as_str(), l.mac.as_deref()))
            .collect();
        assert_eq!(
            macs,
            [("bond0", None), ("vnic1", Some("02:00:17:0a:22:02"))]
        );
        // And it plans back onto bond0 itself.
        let p = plan::plan(&back, &obs).unwrap();
        assert!(p.is_empty(), "{p:?}");
    }
}
