//! Turns a `RunProbesRequest` into a checked `Plan`, or an error naming the first bad field.
//! Every limit of the proto contract is enforced here, before anything is sent; the limits,
//! defaults and name rules are `nodekeeper_model::probe`'s, the ones the controller and the
//! `NetworkTest` schema use.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use nodekeeper_model::address_policy::{Cidr, agent_permits};
use nodekeeper_model::probe::{
    DEFAULT_CONCURRENCY, DEFAULT_INTERVAL_MS, DEFAULT_MAX_MTU, MAX_CONCURRENCY, MAX_COUNT,
    MAX_INTERVAL_MS, MAX_MTU, MAX_TARGETS, MAX_TIMEOUT_MS, MIN_MTU_V4, MIN_MTU_V6, check_hostname,
    check_url,
};
use nodekeeper_proto::agent::v1::{ProbeKind, RunProbesRequest};

use super::ProbeError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Icmp,
    Tcp,
    Dns,
    Http,
    PathMtu,
}

/// One checked target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Icmp {
        id: String,
        addr: IpAddr,
    },
    Tcp {
        id: String,
        addr: SocketAddr,
    },
    /// `resolver` is `None` when the node's configured resolver is to be used.
    Dns {
        id: String,
        resolver: Option<SocketAddr>,
        name: String,
    },
    Http {
        id: String,
        url: http::Uri,
    },
    PathMtu {
        id: String,
        addr: IpAddr,
    },
}

/// A checked request.
#[derive(Debug, Clone)]
pub struct Plan {
    pub kind: Kind,
    pub targets: Vec<Target>,
    pub count: u32,
    pub interval: Duration,
    pub timeout: Duration,
    pub concurrency: usize,
    /// HTTP statuses counted as success; empty means 200–399.
    pub expected_status: Vec<u16>,
    pub max_mtu: u32,
    /// The address policy sent in `allowed_cidrs`, parsed. Kept for the addresses only known
    /// after the plan: the node resolves an HTTP URL's host name itself, possibly to addresses the
    /// controller never saw (split-horizon DNS, rebinding), and each must pass this again.
    pub allowed: Vec<Cidr>,
}

pub fn plan(req: &RunProbesRequest) -> Result<Plan, ProbeError> {
    let kind = match ProbeKind::try_from(req.kind) {
        Ok(ProbeKind::Icmp) => Kind::Icmp,
        Ok(ProbeKind::Tcp) => Kind::Tcp,
        Ok(ProbeKind::Dns) => Kind::Dns,
        Ok(ProbeKind::Http) => Kind::Http,
        Ok(ProbeKind::PathMtu) => Kind::PathMtu,
        Ok(ProbeKind::Unspecified) => {
            return Err(ProbeError::invalid(
                "kind",
                "must be set (ICMP, TCP, DNS, HTTP or PATH_MTU)",
            ));
        }
        Err(_) => {
            return Err(ProbeError::invalid(
                "kind",
                format!(
                    "unknown probe kind {}; use ICMP, TCP, DNS, HTTP or PATH_MTU",
                    req.kind
                ),
            ));
        }
    };
    if req.targets.is_empty() {
        return Err(ProbeError::invalid(
            "targets",
            "must name at least one target",
        ));
    }
    if req.targets.len() > MAX_TARGETS {
        return Err(ProbeError::invalid(
            "targets",
            format!(
                "{} targets given, at most {MAX_TARGETS} per call; split the run",
                req.targets.len()
            ),
        ));
    }
    if req.count == 0 || req.count > MAX_COUNT {
        return Err(ProbeError::invalid(
            "count",
            format!(
                "{} is out of range; probes per target must be 1–{MAX_COUNT}",
                req.count
            ),
        ));
    }
    if req.timeout_ms == 0 || req.timeout_ms > MAX_TIMEOUT_MS {
        return Err(ProbeError::invalid(
            "timeout_ms",
            format!(
                "{} is out of range; use 1–{MAX_TIMEOUT_MS} milliseconds",
                req.timeout_ms
            ),
        ));
    }
    if req.interval_ms > MAX_INTERVAL_MS {
        return Err(ProbeError::invalid(
            "interval_ms",
            format!(
                "{} is too long; use at most {MAX_INTERVAL_MS} milliseconds",
                req.interval_ms
            ),
        ));
    }
    if req.concurrency > MAX_CONCURRENCY {
        return Err(ProbeError::invalid(
            "concurrency",
            format!(
                "{} is too high; use at most {MAX_CONCURRENCY} (0 means {DEFAULT_CONCURRENCY})",
                req.concurrency
            ),
        ));
    }
    let max_mtu = match req.max_mtu {
        0 => DEFAULT_MAX_MTU,
        m if (MIN_MTU_V4..=MAX_MTU).contains(&m) => m,
        m => {
            return Err(ProbeError::invalid(
                "max_mtu",
                format!(
                    "{m} is out of range; use {MIN_MTU_V4}–{MAX_MTU} (0 means {DEFAULT_MAX_MTU})"
                ),
            ));
        }
    };
    let mut expected_status = Vec::with_capacity(req.expected_status.len());
    for (i, &s) in req.expected_status.iter().enumerate() {
        match u16::try_from(s) {
            Ok(code) if (100..=599).contains(&code) => expected_status.push(code),
            _ => {
                return Err(ProbeError::invalid(
                    format!("expected_status[{i}]"),
                    format!("{s} is not an HTTP status code (100–599)"),
                ));
            }
        }
    }

    // The address policy, checked again here so that nothing outside it is probed whatever
    // the caller planned (see nodekeeper_model::address_policy).
    let mut allowed = Vec::with_capacity(req.allowed_cidrs.len());
    for (i, c) in req.allowed_cidrs.iter().enumerate() {
        allowed.push(
            c.parse::<Cidr>()
                .map_err(|r| ProbeError::invalid(format!("allowed_cidrs[{i}]"), r))?,
        );
    }
    if allowed.is_empty() {
        return Err(ProbeError::invalid(
            "allowed_cidrs",
            "is empty, so every target is outside the address policy; the controller sends the ranges probes may reach",
        ));
    }
    let permit = |ip: IpAddr, field: String| {
        if agent_permits(&allowed, ip) {
            Ok(())
        } else {
            Err(ProbeError::invalid(
                field,
                format!("{ip} is outside the address policy sent in allowed_cidrs; not probed"),
            ))
        }
    };

    let mut targets = Vec::with_capacity(req.targets.len());
    for (i, t) in req.targets.iter().enumerate() {
        let field = |name: &str| format!("targets[{i}].{name}");
        let id = if t.id.is_empty() {
            default_id(t)
        } else {
            t.id.clone()
        };
        let target = match kind {
            Kind::Icmp => Target::Icmp {
                id,
                addr: parse_ip(&t.address, &field("address"))?,
            },
            Kind::PathMtu => {
                let addr = parse_ip(&t.address, &field("address"))?;
                if addr.is_ipv6() && max_mtu < MIN_MTU_V6 {
                    return Err(ProbeError::invalid(
                        "max_mtu",
                        format!(
                            "{max_mtu} is below the IPv6 minimum MTU {MIN_MTU_V6} needed by {}",
                            field("address")
                        ),
                    ));
                }
                Target::PathMtu { id, addr }
            }
            Kind::Tcp => {
                let ip = parse_ip(&t.address, &field("address"))?;
                let port = parse_port(t.port, &field("port"))?;
                if port == 0 {
                    return Err(ProbeError::invalid(
                        field("port"),
                        "must be set (1–65535) for TCP",
                    ));
                }
                Target::Tcp {
                    id,
                    addr: SocketAddr::new(ip, port),
                }
            }
            Kind::Dns => {
                let port = match parse_port(t.port, &field("port"))? {
                    0 => 53,
                    p => p,
                };
                let resolver = if t.address.is_empty() {
                    None
                } else {
                    Some(SocketAddr::new(
                        parse_ip(&t.address, &field("address"))?,
                        port,
                    ))
                };
                check_hostname(&t.hostname)
                    .map_err(|reason| ProbeError::invalid(field("hostname"), reason))?;
                Target::Dns {
                    id,
                    resolver,
                    name: t.hostname.trim_end_matches('.').to_owned(),
                }
            }
            Kind::Http => Target::Http {
                id,
                url: parse_url(&t.url).map_err(|r| ProbeError::invalid(field("url"), r))?,
            },
        };
        match &target {
            Target::Icmp { addr, .. } | Target::PathMtu { addr, .. } => {
                permit(*addr, field("address"))?
            }
            Target::Tcp { addr, .. } => permit(addr.ip(), field("address"))?,
            Target::Dns {
                resolver: Some(r), ..
            } => permit(r.ip(), field("address"))?,
            // The node's own resolver is its configuration, not the caller's choice.
            Target::Dns { resolver: None, .. } => {}
            Target::Http { url, .. } => {
                let host = url.host().unwrap_or_default();
                let host = host.trim_start_matches('[').trim_end_matches(']');
                // A host name is checked once resolved, on every probe (http::get).
                if let Ok(ip) = host.parse::<IpAddr>() {
                    permit(ip, field("url"))?;
                }
            }
        }
        targets.push(target);
    }

    let concurrency = match req.concurrency {
        0 => DEFAULT_CONCURRENCY,
        c => c,
    } as usize;
    Ok(Plan {
        kind,
        targets,
        count: req.count,
        interval: Duration::from_millis(u64::from(if req.interval_ms == 0 {
            DEFAULT_INTERVAL_MS
        } else {
            req.interval_ms
        })),
        timeout: Duration::from_millis(u64::from(req.timeout_ms)),
        concurrency,
        expected_status,
        max_mtu,
        allowed,
    })
}

/// A target without a caller-chosen id is named by what it points at.
fn default_id(t: &nodekeeper_proto::agent::v1::ProbeTarget) -> String {
    [&t.url, &t.hostname, &t.address]
        .into_iter()
        .find(|s| !s.is_empty())
        .cloned()
        .unwrap_or_default()
}

fn parse_ip(s: &str, field: &str) -> Result<IpAddr, ProbeError> {
    if s.is_empty() {
        return Err(ProbeError::invalid(field, "must be set to an IP address"));
    }
    let ip: IpAddr = s
        .parse()
        .map_err(|_| ProbeError::invalid(field, format!("{s:?} is not an IP address")))?;
    if ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::from([255, 255, 255, 255]) {
        return Err(ProbeError::invalid(
            field,
            format!("{ip} is not a unicast address"),
        ));
    }
    Ok(ip)
}

fn parse_port(p: u32, field: &str) -> Result<u16, ProbeError> {
    u16::try_from(p).map_err(|_| ProbeError::invalid(field, format!("{p} is not a port (0–65535)")))
}

/// Accepts `http://` and `https://` URLs with a host; the reason names what is wrong otherwise.
/// The shape is checked by the model's [`check_url`] (the rule the controller applies too), then
/// the URL is parsed fully.
pub fn parse_url(s: &str) -> Result<http::Uri, String> {
    check_url(s)?;
    let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(format!(
                "scheme {other:?} is not supported; use http or https"
            ));
        }
        None => return Err(format!("{s:?} has no scheme; use http:// or https://")),
    }
    match uri.authority() {
        Some(a) if a.as_str().contains('@') => {
            Err("user information in URLs is not supported (it would be sent in the clear)".into())
        }
        Some(a) if !a.host().is_empty() => Ok(uri),
        _ => Err(format!("{s:?} has no host")),
    }
}

#[cfg(test)]
mod tests {
    use nodekeeper_proto::agent::v1::ProbeTarget;

    use super::*;

    fn req(kind: ProbeKind, targets: Vec<ProbeTarget>) -> RunProbesRequest {
        RunProbesRequest {
            run_id: "ns/t/uid".into(),
            kind: kind as i32,
            targets,
            count: 3,
            timeout_ms: 500,
            allowed_cidrs: vec!["0.0.0.0/0".into(), "::/0".into()],
            ..RunProbesRequest::default()
        }
    }

    fn addr(a: &str) -> ProbeTarget {
        ProbeTarget {
            address: a.into(),
            ..ProbeTarget::default()
        }
    }

    fn err_field(r: Result<Plan, ProbeError>) -> String {
        match r {
            Err(ProbeError::InvalidRequest { field, .. }) => field,
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_applied() {
        let p = plan(&req(ProbeKind::PathMtu, vec![addr("10.0.0.1")])).unwrap();
        assert_eq!(p.interval, Duration::from_millis(200));
        assert_eq!(p.concurrency, 16);
        assert_eq!(p.max_mtu, 9000);
        assert_eq!(
            p.targets,
            vec![Target::PathMtu {
                id: "10.0.0.1".into(),
                addr: "10.0.0.1".parse().unwrap()
            }]
        );
    }

    #[test]
    fn kind_must_be_known() {
        assert_eq!(
            err_field(plan(&req(ProbeKind::Unspecified, vec![addr("10.0.0.1")]))),
            "kind"
        );
        let mut r = req(ProbeKind::Icmp, vec![addr("10.0.0.1")]);
        r.kind = 42;
        let e = plan(&r).unwrap_err().to_string();
        assert!(
            e.contains("kind") && e.contains("unknown probe kind 42"),
            "{e}"
        );
    }

    #[test]
    fn counts_and_timeouts_are_bounded() {
        let mut r = req(ProbeKind::Icmp, vec![addr("10.0.0.1")]);
        r.count = 0;
        assert_eq!(err_field(plan(&r)), "count");
        r.count = 101;
        assert_eq!(err_field(plan(&r)), "count");
        r.count = 1;
        r.timeout_ms = 0;
        assert_eq!(err_field(plan(&r)), "timeout_ms");
        r.timeout_ms = 30_001;
        assert_eq!(err_field(plan(&r)), "timeout_ms");
        r.timeout_ms = 100;
        r.concurrency = 1000;
        assert_eq!(err_field(plan(&r)), "concurrency");
        r.concurrency = 0;
        r.max_mtu = 67;
        assert_eq!(err_field(plan(&r)), "max_mtu");
    }

    #[test]
    fn too_many_or_no_targets_are_refused() {
        assert_eq!(err_field(plan(&req(ProbeKind::Icmp, vec![]))), "targets");
        let many = (0..10_000)
            .map(|i| addr(&format!("10.0.{}.{}", i / 250, i % 250 + 1)))
            .collect();
        let e = plan(&req(ProbeKind::Icmp, many)).unwrap_err().to_string();
        assert!(e.contains("10000 targets given, at most 1000"), "{e}");
    }

    #[test]
    fn addresses_must_be_unicast_ips() {
        assert_eq!(
            err_field(plan(&req(
                ProbeKind::Icmp,
                vec![addr("10.0.0.1"), addr("example.com")]
            ))),
            "targets[1].address"
        );
        assert_eq!(
            err_field(plan(&req(ProbeKind::Icmp, vec![addr("0.0.0.0")]))),
            "targets[0].address"
        );
        assert_eq!(
            err_field(plan(&req(ProbeKind::Icmp, vec![addr("224.0.0.1")]))),
            "targets[0].address"
        );
        assert_eq!(
            err_field(plan(&req(ProbeKind::Icmp, vec![addr("")]))),
            "targets[0].address"
        );
    }

    #[test]
    fn tcp_needs_a_port() {
        assert_eq!(
            err_field(plan(&req(ProbeKind::Tcp, vec![addr("127.0.0.1")]))),
            "targets[0].port"
        );
        let t = ProbeTarget {
            address: "127.0.0.1".into(),
            port: 70_000,
            ..ProbeTarget::default()
        };
        assert_eq!(
            err_field(plan(&req(ProbeKind::Tcp, vec![t]))),
            "targets[0].port"
        );
        let t = ProbeTarget {
            id: "api".into(),
            address: "::1".into(),
            port: 6443,
            ..ProbeTarget::default()
        };
        let p = plan(&req(ProbeKind::Tcp, vec![t])).unwrap();
        assert_eq!(
            p.targets,
            vec![Target::Tcp {
                id: "api".into(),
                addr: "[::1]:6443".parse().unwrap()
            }]
        );
    }

    #[test]
    fn dns_targets() {
        let t = ProbeTarget {
            hostname: "svc.cluster.local.".into(),
            address: "10.96.0.10".into(),
            ..ProbeTarget::default()
        };
        let p = plan(&req(ProbeKind::Dns, vec![t])).unwrap();
        assert_eq!(
            p.targets,
            vec![Target::Dns {
                id: "svc.cluster.local.".into(),
                resolver: Some("10.96.0.10:53".parse().unwrap()),
                name: "svc.cluster.local".into()
            }]
        );
        let t = ProbeTarget {
            hostname: "bad name".into(),
            ..ProbeTarget::default()
        };
        assert_eq!(
            err_field(plan(&req(ProbeKind::Dns, vec![t]))),
            "targets[0].hostname"
        );
        let t = ProbeTarget {
            hostname: format!("{}.com", "a".repeat(64)),
            ..ProbeTarget::default()
        };
        assert_eq!(
            err_field(plan(&req(ProbeKind::Dns, vec![t]))),
            "targets[0].hostname"
        );
        let t = ProbeTarget {
            hostname: "ok.example".into(),
            ..ProbeTarget::default()
        };
        let p = plan(&req(ProbeKind::Dns, vec![t])).unwrap();
        assert!(matches!(&p.targets[0], Target::Dns { resolver: None, .. }));
    }

    #[test]
    fn http_urls() {
        let url = |u: &str| ProbeTarget {
            url: u.into(),
            ..ProbeTarget::default()
        };
        assert!(
            plan(&req(
                ProbeKind::Http,
                vec![url("https://kubernetes.default.svc/healthz")]
            ))
            .is_ok()
        );
        assert!(plan(&req(ProbeKind::Http, vec![url("http://[::1]:8080/")])).is_ok());
        let e = plan(&req(ProbeKind::Http, vec![url("ftp://example.com/")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("targets[0].url") && e.contains("scheme \"ftp\" is not supported"),
            "{e}"
        );
        assert_eq!(
            err_field(plan(&req(ProbeKind::Http, vec![url("example.com/x")]))),
            "targets[0].url"
        );
        assert_eq!(
            err_field(plan(&req(
                ProbeKind::Http,
                vec![url("http://u:p@example.com/")]
            ))),
            "targets[0].url"
        );
        assert_eq!(
            err_field(plan(&req(ProbeKind::Http, vec![url("")]))),
            "targets[0].url"
        );
        let mut r = req(ProbeKind::Http, vec![url("http://127.0.0.1/")]);
        r.expected_status = vec![200, 600];
        assert_eq!(err_field(plan(&r)), "expected_status[1]");
    }

    #[test]
    fn targets_outside_the_address_policy_are_refused_before_any_probe() {
        let policy = |cidrs: &[&str], kind, targets| {
            let mut r = req(kind, targets);
            r.allowed_cidrs = cidrs.iter().map(|c| (*c).to_owned()).collect();
            plan(&r)
        };
        let nodes = ["10.0.0.0/24"];
        assert!(policy(&nodes, ProbeKind::Icmp, vec![addr("10.0.0.7")]).is_ok());
        // The metadata service by address, in any spelling, and outside addresses.
        for a in ["169.254.169.254", "::ffff:169.254.169.254", "192.168.1.1"] {
            let e = policy(&nodes, ProbeKind::Icmp, vec![addr("10.0.0.7"), addr(a)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("targets[1].address") && e.contains("outside the address policy"),
                "{a}: {e}"
            );
        }
        // A wide range never opens link-local; the one-address entry the controller sends for
        // metadataService does.
        let wide = ["0.0.0.0/0", "169.254.0.0/16"];
        assert!(policy(&wide, ProbeKind::Icmp, vec![addr("169.254.169.254")]).is_err());
        let md = ["10.0.0.0/24", "169.254.169.254"];
        assert!(policy(&md, ProbeKind::Icmp, vec![addr("169.254.169.254")]).is_ok());
        // URL hosts given as addresses and DNS resolvers are checked too.
        let url = ProbeTarget {
            url: "http://169.254.169.254/latest".into(),
            ..ProbeTarget::default()
        };
        let e = policy(&nodes, ProbeKind::Http, vec![url]);
        assert_eq!(err_field(e), "targets[0].url");
        let mut dns = addr("192.168.0.53");
        dns.hostname = "example.com".into();
        assert_eq!(
            err_field(policy(&nodes, ProbeKind::Dns, vec![dns])),
            "targets[0].address"
        );
        // No policy sent: nothing passes, and the field is named.
        assert_eq!(
            err_field(policy(&[], ProbeKind::Icmp, vec![addr("10.0.0.7")])),
            "allowed_cidrs"
        );
        assert_eq!(
            err_field(policy(
                &["10.0.0.1/8"],
                ProbeKind::Icmp,
                vec![addr("10.0.0.7")]
            )),
            "allowed_cidrs[0]"
        );
    }

    #[test]
    fn ipv6_path_mtu_needs_room() {
        let mut r = req(ProbeKind::PathMtu, vec![addr("fd00::1")]);
        r.max_mtu = 1000;
        assert_eq!(err_field(plan(&r)), "max_mtu");
    }
}
