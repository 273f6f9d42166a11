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
    allowed: Vec<Cidr>,
    metadata_service: Option<IpAddr>,
}

impl AddressPolicy {
    /// `allowed`: node InternalIPs, pod and service ranges, `probeAllowedCidrs`.
    pub fn new(mut allowed: Vec<Cidr>, metadata_service: Option<IpAddr>) -> Self {
        allowed.sort();
        allowed.dedup();
        Self {
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
        if self.allowed.iter().any(|c| c.contains(ip)) {
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
}
