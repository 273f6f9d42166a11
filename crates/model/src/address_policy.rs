//! The address policy of node probes: which addresses a `NetworkTest` may have the nodes probe.
//! Written once and applied twice — by the controller when it plans a test (a refusal names
//! `spec.targets[i]` and the fix) and again by the agent before it sends a single probe (a
//! refusal is `INVALID_ARGUMENT`).
//!
//! The rule:
//!
//! * The metadata service and every other link-local address (`169.254.0.0/16`, `fe80::/10`)
//!   are never an ordinary target. The metadata service is probed only through the explicit
//!   `metadataService` target, at the address the controller is configured with; the API server
//!   only through `apiServer` (or an address in the allowed ranges).
//! * Any other address must lie in an allowed range: the nodes' own InternalIPs, the cluster's pod
//!   and service ranges, and the ranges the tuning ConfigMap adds under `probeAllowedCidrs`.
//! * Everything else is refused.
//!
//! IPv4-mapped IPv6 addresses (`::ffff:169.254.169.254`) are judged as the IPv4 address they
//! carry, so the gate cannot be walked around by spelling.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An address range, `address/prefix`; a bare address is a one-address range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The range holding exactly `ip`.
    pub fn host(ip: IpAddr) -> Self {
        let ip = ip.to_canonical();
        Self {
            network: ip,
            prefix: max_prefix(ip),
        }
    }

    /// True for a one-address range.
    pub fn is_host(&self) -> bool {
        self.prefix == max_prefix(self.network)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// The fewest ranges holding exactly the addresses of `ranges`, sorted and disjoint: ranges inside
/// another are dropped and two halves of one range are joined, as often as they can be. Per-node
/// pod ranges handed out in order (`10.0.0.0/24`, `10.0.1.0/24`, … for 10,000 nodes) become a
/// handful, so a policy check and the list sent to every agent stay small at any cluster size.
pub fn collapse(mut ranges: Vec<Cidr>) -> Vec<Cidr> {
    ranges.sort();
    ranges.dedup();
    let mut out: Vec<Cidr> = Vec::with_capacity(ranges.len());
    for range in ranges {
        // Sorted by (network, prefix), a range's container, if any, is the last one kept.
        if out
            .last()
            .is_some_and(|last| last.prefix <= range.prefix && last.contains(range.network))
        {
            continue;
        }
        out.push(range);
        while let [.., low, high] = out[..] {
            let Some(parent) = low.joined(high) else {
                break;
            };
            out.truncate(out.len() - 2);
            out.push(parent);
        }
    }
    out
}

impl Cidr {
    /// The range of which `self` and `high` are the lower and upper halves.
    fn joined(self, high: Cidr) -> Option<Cidr> {
        if self.prefix != high.prefix || self.prefix == 0 {
            return None;
        }
        let parent = Cidr {
            network: Cidr::masked(self.network, self.prefix - 1),
            prefix: self.prefix - 1,
        };
        let upper = match (self.network, high.network) {
            (IpAddr::V4(low), IpAddr::V4(high)) => {
                u32::from(low).checked_add(1 << (32 - u32::from(self.prefix)))
                    == Some(u32::from(high))
            }
            (IpAddr::V6(low), IpAddr::V6(high)) => {
                u128::from(low).checked_add(1 << (128 - u32::from(self.prefix)))
                    == Some(u128::from(high))
            }
            _ => false,
        };
        (parent.network == self.network && upper).then_some(parent)
    }
}

fn max_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

impl FromStr for Cidr {
    type Err = String;

    /// Parses `10.0.0.0/8`, `fd00::/8` or a bare address. Host bits must be zero
    /// (`10.0.0.1/8` is refused: it usually means a typo in the prefix).
    fn from_str(s: &str) -> Result<Self, String> {
        let text = s.trim();
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an address range; write e.g. 10.0.0.0/16"))?;
        let ip = ip.to_canonical();
        let max = max_prefix(ip);
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= max => p,
                _ => return Err(format!("{s:?}: the prefix length must be 0–{max}")),
            },
        };
        let cidr = Cidr {
            network: ip,
            prefix,
        };
        let masked = Cidr::masked(ip, prefix);
        if masked != ip {
            return Err(format!(
                "{s:?} has host bits set; the range is {masked}/{prefix}"
            ));
        }
        Ok(cidr)
    }
}

impl Cidr {
    fn masked(ip: IpAddr, prefix: u8) -> IpAddr {
        match ip {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V4((u32::from(v4) & mask).into())
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V6((u128::from(v6) & mask).into())
            }
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl serde::Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Parses a list of ranges separated by commas or whitespace (the `probeAllowedCidrs` key, the
/// `--pod-cidrs`/`--service-cidrs` flags, the agent's request field).
pub fn parse_list(raw: &str) -> Result<Vec<Cidr>, String> {
    raw.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(Cidr::from_str)
        .collect()
}

/// True for `169.254.0.0/16` and `fe80::/10` (after unmapping IPv4-mapped addresses).
pub fn is_link_local(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// Why an address may not be probed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0} is the metadata service; probe it only with the target metadataService: true")]
    MetadataService(IpAddr),
    #[error(
        "{0} is link-local; node probes never go there (the metadata service is probed only with the target metadataService: true)"
    )]
    LinkLocal(IpAddr),
    #[error(
        "{ip} is outside the ranges node probes may reach ({allowed}); add a range holding it to probeAllowedCidrs in the tuning ConfigMap"
    )]
    NotAllowed { ip: IpAddr, allowed: String },
}

/// The most ranges a refusal lists; the count covers the rest.
const LISTED: usize = 6;

/// The ranges ordinary targets may lie in, and the metadata service address they may not be.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    /// As given (sorted, without duplicates): what a refusal describes.
    allowed: Vec<Cidr>,
    /// The same addresses as [`collapse`]d ranges: what `check` searches.
    disjoint: Vec<Cidr>,
    metadata_service: Option<IpAddr>,
}

impl AddressPolicy {
    /// `allowed`: node InternalIPs, pod and service ranges, `probeAllowedCidrs`.
    pub fn new(mut allowed: Vec<Cidr>, metadata_service: Option<IpAddr>) -> Self {
        allowed.sort();
        allowed.dedup();
        Self {
            disjoint: collapse(allowed.clone()),
            allowed,
            metadata_service: metadata_service.map(|ip| ip.to_canonical()),
        }
    }

    pub fn allowed(&self) -> &[Cidr] {
        &self.allowed
    }

    /// Whether an ordinary target (an `address`, a resolved `hostname` or `hostPort`, a URL's
    /// host, a DNS resolver) may be probed at `ip`.
    pub fn check(&self, ip: IpAddr) -> Result<(), Refusal> {
        let ip = ip.to_canonical();
        if self.metadata_service == Some(ip) {
            return Err(Refusal::MetadataService(ip));
        }
        if is_link_local(ip) {
            return Err(Refusal::LinkLocal(ip));
        }
        // Disjoint and sorted: only the last range starting at or below `ip` can hold it.
        let candidates = self.disjoint.partition_point(|c| c.network <= ip);
        if candidates > 0 && self.disjoint[candidates - 1].contains(ip) {
            return Ok(());
        }
        Err(Refusal::NotAllowed {
            ip,
            allowed: self.describe(),
        })
    }

    fn describe(&self) -> String {
        if self.allowed.is_empty() {
            return "none configured".into();
        }
        let mut s: Vec<String> = self
            .allowed
            .iter()
            .filter(|c| !c.is_host())
            .take(LISTED)
            .map(Cidr::to_string)
            .collect();
        let hosts = self.allowed.iter().filter(|c| c.is_host()).count();
        let ranges = self.allowed.len() - hosts;
        if ranges > LISTED {
            s.push(format!("{} more ranges", ranges - LISTED));
        }
        if hosts > 0 {
            s.push(format!("{hosts} node and endpoint addresses"));
        }
        s.join(", ")
    }
}

/// The agent's check of one address against the set the controller sent with the request: it
/// must lie in one of `allowed`, and a link-local address only in a one-address entry (how the
/// controller sends the metadata service for a `metadataService` target), never in a wider
/// range — so even a ConfigMap that lists `169.254.0.0/16` does not open the metadata service.
pub fn agent_permits(allowed: &[Cidr], ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    if is_link_local(ip) {
        allowed.iter().any(|c| c.is_host() && c.contains(ip))
    } else {
        allowed.iter().any(|c| c.contains(ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn policy() -> AddressPolicy {
        AddressPolicy::new(
            parse_list("10.244.0.0/16, 10.96.0.0/12 10.0.0.5").unwrap(),
            Some(ip("169.254.169.254")),
        )
    }

    #[test]
    fn ranges_parse_and_contain() {
        let c: Cidr = "10.96.0.0/12".parse().unwrap();
        assert!(c.contains(ip("10.96.0.10")) && c.contains(ip("10.111.255.255")));
        assert!(!c.contains(ip("10.112.0.0")) && !c.contains(ip("fd00::1")));
        let c: Cidr = "fd00::/8".parse().unwrap();
        assert!(c.contains(ip("fd12::1")) && !c.contains(ip("fe00::1")));
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().contains(ip("8.8.8.8")));
        assert_eq!(Cidr::host(ip("10.0.0.5")).to_string(), "10.0.0.5/32");
        assert!(
            "10.0.0.1/8"
                .parse::<Cidr>()
                .unwrap_err()
                .contains("host bits set; the range is 10.0.0.0/8")
        );
        assert!("10.0.0.0/33".parse::<Cidr>().unwrap_err().contains("0–32"));
        assert!("ten/8".parse::<Cidr>().is_err());
        assert!(parse_list("").unwrap().is_empty());
    }

    #[test]
    fn the_metadata_service_and_link_local_are_refused_as_ordinary_targets() {
        let p = policy();
        assert_eq!(
            p.check(ip("169.254.169.254")),
            Err(Refusal::MetadataService(ip("169.254.169.254")))
        );
        // The same address spelled as IPv4-mapped IPv6.
        assert_eq!(
            p.check(ip("::ffff:169.254.169.254")),
            Err(Refusal::MetadataService(ip("169.254.169.254")))
        );
        assert_eq!(
            p.check(ip("169.254.0.1")),
            Err(Refusal::LinkLocal(ip("169.254.0.1")))
        );
        assert_eq!(
            p.check(ip("fe80::1")),
            Err(Refusal::LinkLocal(ip("fe80::1")))
        );
        // Even when a configured range covers it.
        let wide = AddressPolicy::new(parse_list("0.0.0.0/0").unwrap(), None);
        assert!(matches!(
            wide.check(ip("169.254.169.254")),
            Err(Refusal::LinkLocal(_))
        ));
    }

    #[test]
    fn allowed_ranges_pass_and_the_rest_is_refused_with_the_fix() {
        let p = policy();
        for ok in ["10.244.3.7", "10.96.0.10", "10.0.0.5"] {
            assert_eq!(p.check(ip(ok)), Ok(()), "{ok}");
        }
        let e = p.check(ip("192.168.1.1")).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("192.168.1.1 is outside"), "{text}");
        assert!(
            text.contains("10.96.0.0/12") && text.contains("10.244.0.0/16"),
            "{text}"
        );
        assert!(text.contains("1 node and endpoint addresses"), "{text}");
        assert!(text.contains("probeAllowedCidrs"), "{text}");
        assert!(AddressPolicy::default().check(ip("10.0.0.1")).is_err());
    }

    #[test]
    fn the_agent_opens_link_local_only_for_a_one_address_entry() {
        let sent = parse_list("10.0.0.0/8 169.254.169.254").unwrap();
        assert!(agent_permits(&sent, ip("10.1.2.3")));
        assert!(agent_permits(&sent, ip("169.254.169.254")));
        assert!(!agent_permits(&sent, ip("169.254.169.253")));
        assert!(!agent_permits(&sent, ip("192.168.0.1")));
        let wide = parse_list("169.254.0.0/16 0.0.0.0/0").unwrap();
        assert!(!agent_permits(&wide, ip("169.254.169.254")));
        assert!(!agent_permits(&wide, ip("::ffff:169.254.169.254")));
        assert!(!agent_permits(&[], ip("10.0.0.1")));
    }

    #[test]
    fn collapse_joins_halves_and_drops_nested_ranges() {
        let c = |text: &str| collapse(parse_list(text).unwrap());
        let shown = |v: Vec<Cidr>| v.iter().map(Cidr::to_string).collect::<Vec<_>>().join(" ");
        assert_eq!(shown(c("10.0.1.0/24 10.0.0.0/24")), "10.0.0.0/23");
        assert_eq!(
            shown(c("10.0.0.0/24 10.0.1.0/24 10.0.2.0/24 10.0.3.0/24")),
            "10.0.0.0/22"
        );
        // Neighbours that are not two halves of one range stay apart.
        assert_eq!(
            shown(c("10.0.1.0/24 10.0.2.0/24")),
            "10.0.1.0/24 10.0.2.0/24"
        );
        assert_eq!(
            shown(c("10.0.0.0/8 10.1.2.3 10.200.0.0/16 11.0.0.1")),
            "10.0.0.0/8 11.0.0.1/32"
        );
        assert_eq!(
            shown(c("0.0.0.0/1 128.0.0.0/1 ::/1 8000::/1")),
            "0.0.0.0/0 ::/0"
        );
        assert_eq!(
            shown(c("10.0.0.0 10.0.0.1 fd00::1 fd00::")),
            "10.0.0.0/31 fd00::/127"
        );
        assert_eq!(shown(c("")), "");
        // 10,000 per-node /24 pod ranges handed out in order from 10.0.0.0/8 (as Python's
        // ipaddress.collapse_addresses also answers).
        let pods: Vec<Cidr> = (0..10_000u32)
            .map(|i| Cidr {
                network: IpAddr::V4((0x0a00_0000 + (i << 8)).into()),
                prefix: 24,
            })
            .collect();
        assert_eq!(
            shown(collapse(pods)),
            "10.0.0.0/11 10.32.0.0/14 10.36.0.0/15 10.38.0.0/16 10.39.0.0/20"
        );
    }

    /// The collapsed ranges hold exactly the addresses of the given ones, and the policy's
    /// search over them answers as a scan of the given ranges does.
    #[test]
    fn collapse_keeps_exactly_the_same_addresses() {
        // A small deterministic generator: many overlapping and adjacent ranges in 10.0.0.0/20.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |bound: u32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            u32::try_from(state % u64::from(bound)).unwrap()
        };
        for _ in 0..200 {
            let ranges: Vec<Cidr> = (0..next(40))
                .map(|_| {
                    let prefix = u8::try_from(20 + next(13)).unwrap();
                    let ip = IpAddr::V4((0x0a00_0000 + next(1 << 12)).into());
                    Cidr {
                        network: Cidr::masked(ip, prefix),
                        prefix,
                    }
                })
                .collect();
            let collapsed = collapse(ranges.clone());
            assert!(collapsed.windows(2).all(|w| w[0] < w[1]));
            let policy = AddressPolicy::new(ranges.clone(), None);
            for host in 0..(1u32 << 12) + 16 {
                let ip = IpAddr::V4((0x0a00_0000 + host).into());
                let given = ranges.iter().any(|c| c.contains(ip));
                let holders = collapsed.iter().filter(|c| c.contains(ip)).count();
                assert_eq!(
                    holders,
                    usize::from(given),
                    "{ip} in {ranges:?} → {collapsed:?}"
                );
                assert_eq!(policy.check(ip).is_ok(), given, "{ip}");
            }
        }
    }
}
