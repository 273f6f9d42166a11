//! A `NetworkTest` spec, as plain data, checked and expanded into what each source node probes.
//! Only addresses the spec names are ever produced: the API server and the metadata service appear
//! only when a target asks for them, and then only at the addresses the controller is configured with.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use nodekeeper_model::address_policy::{self, AddressPolicy, Cidr, is_link_local};
use nodekeeper_model::probe::{
    MAX_COUNT, MAX_INTERVAL_MS, MAX_MTU, MAX_PEERS_PER_NODE, MAX_SOURCE_NODES, MAX_TARGETS,
    MAX_TIMEOUT_MS, MIN_MTU_V4, MIN_MTU_V6, check_hostname, check_url,
};

use super::{fanout, peers};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProbeKind {
    Icmp,
    Tcp,
    Dns,
    Http,
    PathMtu,
}

impl ProbeKind {
    /// Parses the spec's spelling (`icmp`, `tcp`, `dns`, `http`, `pathMtu`).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "icmp" => Self::Icmp,
            "tcp" => Self::Tcp,
            "dns" => Self::Dns,
            "http" => Self::Http,
            "pathMtu" => Self::PathMtu,
            _ => return None,
        })
    }
}

/// One entry of `spec.targets`, as the user wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetSpec {
    /// An IP address.
    Address(String),
    /// `address:port` or `hostname:port` (IPv6 as `[addr]:port`).
    HostPort(String),
    /// A DNS name: the name to query for `dns`, resolved by the controller for the other kinds.
    Hostname(String),
    /// An `http://` or `https://` URL.
    Url(String),
    /// The Kubernetes API server, at the address the controller is configured with.
    ApiServer,
    /// The instance metadata service, at the address the controller is configured with. Never
    /// added unless a target names it.
    MetadataService,
    /// Other selected nodes: up to `per_node` each, chosen by [`peers::select`].
    Peers { per_node: i64 },
}

/// The parts of a `NetworkTest` spec the plan is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct TestSpec {
    /// Spelling as in the resource; checked here.
    pub kind: String,
    pub targets: Vec<TargetSpec>,
    pub count: i64,
    pub interval_ms: i64,
    pub timeout_ms: i64,
    /// The most source nodes used; `None` means all selected (up to [`MAX_SOURCE_NODES`]).
    pub max_nodes: Option<i64>,
    /// TCP: the port for `address`, `peers` and `metadataService` targets without one
    /// (`apiServer` always uses the API server's own port).
    pub port: Option<i64>,
    /// DNS: the resolver address; `None` means each node's configured resolver.
    pub resolver: Option<String>,
    /// HTTP: accepted status codes; empty means 200–399.
    pub expected_status: Vec<i64>,
    /// pathMtu: the largest size tried.
    pub max_mtu: Option<i64>,
}

/// What the controller knows about the cluster, from its configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    /// The API server as nodes reach it (`host:port`).
    pub api_server: Option<SocketAddr>,
    /// `api_server` is a Service ClusterIP (the `kubernetes` Service, the default inside a Pod):
    /// kube-proxy forwards only its TCP port there, so ICMP to it is never answered.
    pub api_server_is_service: bool,
    /// The metadata service's address, from configuration only.
    pub metadata_service: Option<IpAddr>,
    /// Where ordinary targets may be, besides the selected nodes' own addresses (which [`plan`]
    /// adds): the pod and service ranges, the other nodes' InternalIPs and `probeAllowedCidrs`
    /// (see [`nodekeeper_model::address_policy`]). Empty: only the selected nodes.
    pub allowed: Vec<Cidr>,
}

/// The API server address the controller itself uses, when it is an IP address: in a Pod that
/// is `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT` (the `kubernetes` Service, which
/// nodes reach too), outside a cluster the kubeconfig's server. A host name gives `None`: nodes
/// may resolve it differently, so `--api-server-address` must say.
pub fn api_server_from_url(url: &str) -> Option<SocketAddr> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split('/').next()?;
    let default_port = match scheme {
        "https" => 443,
        "http" => 80,
        _ => return None,
    };
    if let Ok(sa) = authority.parse::<SocketAddr>() {
        return Some(sa);
    }
    let host = authority.trim_start_matches('[').trim_end_matches(']');
    host.parse::<IpAddr>()
        .ok()
        .map(|ip| SocketAddr::new(ip, default_port))
}

/// A node that may run the test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceNode {
    pub name: String,
    /// The address its agent listens on and peers probe.
    pub address: IpAddr,
}

/// A bad spec: the field (JSON path from `spec`) and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SpecError {
    pub field: String,
    pub reason: String,
}

fn bad(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError {
        field: field.into(),
        reason: reason.into(),
    }
}

/// One probe target, as sent to an agent (mirrors the proto's `ProbeTarget`).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct PlannedTarget {
    /// Echoed back in results, e.g. `node/worker-3`, `apiServer`, `10.0.0.5`.
    pub id: String,
    pub address: String,
    pub port: u16,
    pub hostname: String,
    pub url: String,
    /// A URL's host name as the controller resolved it (every address passed the policy): the
    /// agent resolves it again and must be allowed these too (see [`TestPlan::allowed_for`]).
    pub resolved: Vec<IpAddr>,
}

/// The checked probe parameters shared by every source node (mirrors `RunProbesRequest`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeParams {
    pub kind: ProbeKind,
    pub count: u32,
    pub interval_ms: u32,
    pub timeout_ms: u32,
    pub expected_status: Vec<u32>,
    pub max_mtu: u32,
}

/// The whole test: parameters and, per source node (sorted by name), its targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestPlan {
    pub params: ProbeParams,
    pub sources: BTreeMap<String, Vec<PlannedTarget>>,
    /// The ranges of the address policy (one-address entries left out: [`Self::allowed_for`]
    /// sends those a source needs, so a 10,000-node policy does not travel in every request).
    pub ranges: Vec<Cidr>,
}

impl TestPlan {
    pub fn pair_count(&self) -> usize {
        self.sources.values().map(Vec::len).sum()
    }

    /// The address policy sent to the agent with `targets` (`allowed_cidrs`): the ranges, plus
    /// a one-address entry for each target address outside them. Every target passed the
    /// policy in [`plan`]; the agent checks them again against this.
    pub fn allowed_for(&self, targets: &[PlannedTarget]) -> Vec<String> {
        let mut sent: std::collections::BTreeSet<Cidr> = self.ranges.iter().copied().collect();
        for t in targets {
            let ip = t
                .address
                .parse::<IpAddr>()
                .ok()
                .or_else(|| url_host_ip(&t.url));
            // A URL's host name resolving to a node's address (a one-address entry of the
            // policy) is sent too, or the agent would refuse the name's every address.
            for ip in ip.into_iter().chain(t.resolved.iter().copied()) {
                if is_link_local(ip) || !self.ranges.iter().any(|c| c.contains(ip)) {
                    sent.insert(Cidr::host(ip));
                }
            }
        }
        sent.iter().map(Cidr::to_string).collect()
    }
}

/// The host of an `http(s)://` URL when it is an IP address.
fn url_host_ip(url: &str) -> Option<IpAddr> {
    url_host(url)?.parse().ok()
}

/// The host of an `http(s)://` URL (brackets of an IPv6 address removed).
pub fn url_host(url: &str) -> Option<&str> {
    let (_, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split_once(']').map(|(h, _)| h);
    }
    let host = authority.split(':').next()?;
    (!host.is_empty()).then_some(host)
}

/// Checks the parameters of `spec` (everything but the targets' resolution).
pub fn check_params(spec: &TestSpec) -> Result<ProbeParams, SpecError> {
    let kind = ProbeKind::parse(&spec.kind).ok_or_else(|| {
        bad(
            "spec.kind",
            format!(
                "unknown probe kind {:?}; use icmp, tcp, dns, http or pathMtu",
                spec.kind
            ),
        )
    })?;
    let ranged = |field: &str, v: i64, lo: i64, hi: i64| -> Result<u32, SpecError> {
        if (lo..=hi).contains(&v) {
            Ok(v as u32)
        } else {
            Err(bad(field, format!("{v} is out of range; use {lo}–{hi}")))
        }
    };
    let count = ranged("spec.count", spec.count, 1, MAX_COUNT.into())?;
    let timeout_ms = ranged("spec.timeoutMs", spec.timeout_ms, 1, MAX_TIMEOUT_MS.into())?;
    let interval_ms = ranged(
        "spec.intervalMs",
        spec.interval_ms,
        1,
        MAX_INTERVAL_MS.into(),
    )?;
    if let Some(n) = spec.max_nodes {
        ranged("spec.maxNodes", n, 1, MAX_SOURCE_NODES.into())?;
    }
    let mut expected_status = Vec::new();
    for (i, s) in spec.expected_status.iter().enumerate() {
        expected_status.push(ranged(&format!("spec.expectedStatus[{i}]"), *s, 100, 599)?);
    }
    let max_mtu = match spec.max_mtu {
        None => 0,
        Some(m) => ranged("spec.maxMtu", m, MIN_MTU_V4.into(), MAX_MTU.into())?,
    };
    if spec.targets.is_empty() {
        return Err(bad("spec.targets", "must name at least one target"));
    }
    if spec.targets.len() > MAX_TARGETS {
        return Err(bad(
            "spec.targets",
            format!(
                "{} entries, at most {MAX_TARGETS}; split the test",
                spec.targets.len()
            ),
        ));
    }
    Ok(ProbeParams {
        kind,
        count,
        interval_ms,
        timeout_ms,
        expected_status,
        max_mtu,
    })
}

/// The hostnames the controller must resolve before [`plan`] (for every kind but `dns`, whose
/// hostnames are what the agents query), each with the field that names it.
pub fn hostnames_to_resolve(spec: &TestSpec) -> Vec<(String, String)> {
    if ProbeKind::parse(&spec.kind) == Some(ProbeKind::Dns) {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, t) in spec.targets.iter().enumerate() {
        match t {
            TargetSpec::Hostname(h) => out.push((format!("spec.targets[{i}].hostname"), h.clone())),
            TargetSpec::HostPort(hp) => {
                if let Some((host, _)) = split_host_port(hp)
                    && host.parse::<IpAddr>().is_err()
                {
                    out.push((format!("spec.targets[{i}].hostPort"), host.to_owned()));
                }
            }
            // Resolved only to check the address policy: the agent connects by name.
            TargetSpec::Url(u) => {
                if let Some(host) = url_host(u)
                    && host.parse::<IpAddr>().is_err()
                {
                    out.push((format!("spec.targets[{i}].url"), host.to_owned()));
                }
            }
            _ => {}
        }
    }
    out
}

/// Expands `spec` into each source's targets. `nodes` are the nodes the selector matched (any
/// order); `resolved` holds the addresses of the names [`hostnames_to_resolve`] listed (a name
/// missing from it did not resolve); `seed` is the test's uid.
pub fn plan(
    spec: &TestSpec,
    nodes: &[SourceNode],
    env: &Environment,
    resolved: &BTreeMap<String, Vec<IpAddr>>,
    seed: &str,
) -> Result<TestPlan, SpecError> {
    let params = check_params(spec)?;
    let kind = params.kind;
    let mut nodes: Vec<&SourceNode> = nodes.iter().collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    nodes.dedup_by(|a, b| a.name == b.name);
    if nodes.is_empty() {
        return Err(bad(
            "spec.nodeSelector",
            "matches no nodes; check the labels or wait for the nodes to join",
        ));
    }
    let cap = spec.max_nodes.unwrap_or(MAX_SOURCE_NODES.into()) as usize;
    // The first `cap` by name: deterministic, so a re-reconcile picks the same sources.
    nodes.truncate(cap);
    let port = match spec.port {
        None => None,
        Some(p) if (1..=65_535).contains(&p) => Some(p as u16),
        Some(p) => return Err(bad("spec.port", format!("{p} is not a port (1–65535)"))),
    };

    // The address policy: the selected nodes' own addresses and the configured ranges.
    let mut allowed = env.allowed.clone();
    allowed.extend(nodes.iter().map(|n| Cidr::host(n.address)));
    let policy = AddressPolicy::new(allowed, env.metadata_service);
    let permit = |ip: IpAddr, field: String| {
        policy
            .check(ip)
            .map_err(|refusal| bad(field, refusal.to_string()))
    };
    if let Some(r) = &spec.resolver {
        let ip = parse_ip(r).map_err(|reason| bad("spec.resolver", reason))?;
        permit(ip, "spec.resolver".into())?;
    }
    // Targets that are the same for every source, in spec order; `peers` is expanded per node.
    let mut common: Vec<PlannedTarget> = Vec::new();
    let mut peers_per_node = None;
    for (i, t) in spec.targets.iter().enumerate() {
        let field = |name: &str| format!("spec.targets[{i}].{name}");
        let kind_word = &spec.kind;
        match t {
            TargetSpec::Address(a) => {
                let ip = parse_ip(a).map_err(|r| bad(field("address"), r))?;
                permit(ip, field("address"))?;
                common.push(addressed(kind, a.clone(), ip, port, &field("address"))?);
            }
            TargetSpec::HostPort(hp) => {
                let (host, p) = split_host_port(hp).ok_or_else(|| {
                    bad(
                        field("hostPort"),
                        format!("{hp:?} is not host:port (IPv6 as [address]:port)"),
                    )
                })?;
                if kind != ProbeKind::Tcp {
                    return Err(bad(
                        field("hostPort"),
                        format!("host:port targets are for tcp, not {kind_word}"),
                    ));
                }
                let ip = match host.parse::<IpAddr>() {
                    Ok(ip) => ip,
                    Err(_) => first_resolved(resolved, host).ok_or_else(|| {
                        bad(field("hostPort"), format!("{host:?} does not resolve"))
                    })?,
                };
                permit(ip, field("hostPort"))?;
                common.push(PlannedTarget {
                    id: hp.clone(),
                    address: ip.to_string(),
                    port: p,
                    ..Default::default()
                });
            }
            TargetSpec::Hostname(h) => {
                check_hostname(h).map_err(|r| bad(field("hostname"), r))?;
                if kind == ProbeKind::Dns {
                    common.push(PlannedTarget {
                        id: h.clone(),
                        address: spec.resolver.clone().unwrap_or_default(),
                        hostname: h.clone(),
                        ..Default::default()
                    });
                } else if kind == ProbeKind::Http {
                    return Err(bad(
                        field("hostname"),
                        "http probes take URLs; write the target as url",
                    ));
                } else {
                    let ip = first_resolved(resolved, h)
                        .ok_or_else(|| bad(field("hostname"), format!("{h:?} does not resolve")))?;
                    permit(ip, field("hostname"))?;
                    common.push(addressed(kind, h.clone(), ip, port, &field("hostname"))?);
                }
            }
            TargetSpec::Url(u) => {
                if kind != ProbeKind::Http {
                    return Err(bad(
                        field("url"),
                        format!("URL targets are for http, not {kind_word}"),
                    ));
                }
                check_url(u).map_err(|r| bad(field("url"), r))?;
                let host = url_host(u).unwrap_or_default();
                let addresses = match host.parse::<IpAddr>() {
                    Ok(ip) => vec![ip],
                    Err(_) => resolved.get(host).cloned().unwrap_or_default(),
                };
                if addresses.is_empty() {
                    return Err(bad(
                        field("url"),
                        format!(
                            "{host:?} does not resolve, so it cannot be checked against the address policy; use a name the controller resolves, or the address"
                        ),
                    ));
                }
                // Every address the name has: a node may resolve it to any of them.
                for ip in &addresses {
                    permit(*ip, field("url"))?;
                }
                let by_name = host.parse::<IpAddr>().is_err();
                common.push(PlannedTarget {
                    id: u.clone(),
                    url: u.clone(),
                    resolved: if by_name { addresses } else { Vec::new() },
                    ..Default::default()
                });
            }
            TargetSpec::ApiServer => {
                let api = env.api_server.ok_or_else(|| {
                    bad(
                        field("apiServer"),
                        "the controller knows no API server address (its own API server URL is a host name); set --api-server-address (NODEKEEPER_API_SERVER_ADDRESS) on the controller",
                    )
                })?;
                common.push(match kind {
                    ProbeKind::Http => PlannedTarget {
                        id: "apiServer".into(),
                        url: format!("https://{api}/livez"),
                        ..Default::default()
                    },
                    // The API server's own port: `spec.port` is for the other targets (a
                    // Service ClusterIP answers on no other port anyway).
                    ProbeKind::Tcp => PlannedTarget {
                        id: "apiServer".into(),
                        address: api.ip().to_string(),
                        port: api.port(),
                        ..Default::default()
                    },
                    ProbeKind::Dns => {
                        return Err(bad(
                            field("apiServer"),
                            "dns probes take hostnames, not the API server",
                        ));
                    }
                    ProbeKind::Icmp | ProbeKind::PathMtu if env.api_server_is_service => {
                        return Err(bad(
                            field("apiServer"),
                            format!(
                                "the controller's API server address {api} is the kubernetes Service's ClusterIP, where only TCP port {} is answered (kube-proxy does not answer {kind_word} there); probe it with kind tcp or http, or set --api-server-address (NODEKEEPER_API_SERVER_ADDRESS) on the controller to an address nodes reach the API server at directly",
                                api.port()
                            ),
                        ));
                    }
                    ProbeKind::Icmp | ProbeKind::PathMtu => PlannedTarget {
                        id: "apiServer".into(),
                        address: api.ip().to_string(),
                        ..Default::default()
                    },
                });
            }
            TargetSpec::MetadataService => {
                let md = env.metadata_service.ok_or_else(|| {
                    bad(
                        field("metadataService"),
                        "the controller has no metadata service address configured",
                    )
                })?;
                common.push(match kind {
                    ProbeKind::Http => PlannedTarget {
                        id: "metadataService".into(),
                        url: format!("http://{}/", SocketAddr::new(md, 80)),
                        ..Default::default()
                    },
                    ProbeKind::Dns => {
                        return Err(bad(
                            field("metadataService"),
                            "dns probes take hostnames, not the metadata service",
                        ));
                    }
                    _ => addressed(
                        kind,
                        "metadataService".into(),
                        md,
                        port.or(Some(80)),
                        &field("metadataService"),
                    )?,
                });
            }
            TargetSpec::Peers { per_node } => {
                if !(1..=i64::from(MAX_PEERS_PER_NODE)).contains(per_node) {
                    return Err(bad(
                        field("peers"),
                        format!(
                            "{per_node} peers per node is out of range; use 1–{}",
                            MAX_PEERS_PER_NODE
                        ),
                    ));
                }
                match kind {
                    ProbeKind::Dns | ProbeKind::Http => {
                        return Err(bad(
                            field("peers"),
                            format!("peers are probed with icmp, tcp or pathMtu, not {kind_word}"),
                        ));
                    }
                    ProbeKind::Tcp if port.is_none() => {
                        return Err(bad("spec.port", "tcp probes of peers need spec.port"));
                    }
                    _ => {}
                }
                if peers_per_node.is_some() {
                    return Err(bad(field("peers"), "peers may be given once"));
                }
                // With one source there is no peer: the agent would be sent an empty target
                // list and refuse it, which would read as an unreachable agent.
                if nodes.len() < 2 {
                    return Err(bad(
                        field("peers"),
                        format!(
                            "a peers test needs at least two selected nodes, and {} selected; \
                             widen spec.nodeSelector (or raise spec.maxNodes), or name the \
                             targets with address",
                            nodes.len()
                        ),
                    ));
                }
                peers_per_node = Some(*per_node as u32);
            }
        }
    }

    // Results are matched to targets by id, so two entries naming the same thing would merge.
    let mut seen = BTreeMap::new();
    for (i, t) in common.iter().enumerate() {
        if let Some(first) = seen.insert(t.id.clone(), i) {
            return Err(bad(
                "spec.targets",
                format!(
                    "{:?} is listed twice (entries {first} and {i}); remove one",
                    t.id
                ),
            ));
        }
    }
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let selection = peers_per_node.map(|k| peers::select(&names, k, seed));
    let mut sources = BTreeMap::new();
    for (i, node) in nodes.iter().enumerate() {
        let mut targets = common.clone();
        if let Some(sel) = &selection {
            for &p in &sel[i] {
                let peer = nodes[p];
                targets.push(PlannedTarget {
                    id: format!("node/{}", peer.name),
                    address: peer.address.to_string(),
                    port: if kind == ProbeKind::Tcp {
                        port.unwrap_or_default()
                    } else {
                        0
                    },
                    ..Default::default()
                });
            }
        }
        if targets.len() > MAX_TARGETS {
            return Err(bad(
                "spec.targets",
                format!("{} targets per node, at most {MAX_TARGETS}", targets.len()),
            ));
        }
        sources.insert(node.name.clone(), targets);
    }
    // The agent refuses the whole request when one IPv6 target cannot take `maxMtu`.
    if kind == ProbeKind::PathMtu && params.max_mtu != 0 && params.max_mtu < MIN_MTU_V6 {
        let v6 = sources
            .values()
            .flatten()
            .find(|t| t.address.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv6()));
        if let Some(t) = v6 {
            return Err(bad(
                "spec.maxMtu",
                format!(
                    "{} is below the IPv6 minimum MTU {MIN_MTU_V6}, and target {:?} is IPv6; raise spec.maxMtu to at least {MIN_MTU_V6}, or test the IPv6 targets separately",
                    params.max_mtu, t.id
                ),
            ));
        }
    }
    // Each agent call is cut off after `MAX_BUDGET`: a spec needing longer would run to the end
    // and then read as every agent unreachable.
    let most_targets = sources.values().map(Vec::len).max().unwrap_or(0);
    let needed = fanout::needed_budget(&params, most_targets);
    if needed > fanout::MAX_BUDGET {
        return Err(bad(
            "spec.count",
            format!(
                "{} probes every {} ms (timeout {} ms) to {most_targets} targets per node take up to {} s per node, more than the {} s a node may take; lower spec.count or spec.intervalMs (or spec.timeoutMs), or split the targets",
                params.count,
                params.interval_ms,
                params.timeout_ms,
                needed.as_secs(),
                fanout::MAX_BUDGET.as_secs()
            ),
        ));
    }
    // Collapsed: without `--pod-cidrs` every selected node adds its own pod range, and each
    // agent is sent all of them.
    let ranges = address_policy::collapse(
        policy
            .allowed()
            .iter()
            .filter(|c| !c.is_host())
            .copied()
            .collect(),
    );
    Ok(TestPlan {
        params,
        sources,
        ranges,
    })
}

/// A target at an IP address for kinds that take one (`icmp`, `pathMtu`, `tcp` with a port).
fn addressed(
    kind: ProbeKind,
    id: String,
    ip: IpAddr,
    port: Option<u16>,
    field: &str,
) -> Result<PlannedTarget, SpecError> {
    match kind {
        ProbeKind::Icmp | ProbeKind::PathMtu => Ok(PlannedTarget {
            id,
            address: ip.to_string(),
            ..Default::default()
        }),
        ProbeKind::Tcp => {
            let port = port.ok_or_else(|| {
                bad(
                    field,
                    "tcp probes need a port: write host:port or set spec.port",
                )
            })?;
            Ok(PlannedTarget {
                id,
                address: ip.to_string(),
                port,
                ..Default::default()
            })
        }
        ProbeKind::Dns => Err(bad(
            field,
            "dns probes take hostnames; give the resolver in spec.resolver",
        )),
        ProbeKind::Http => Err(bad(field, "http probes take URLs")),
    }
}

fn first_resolved(resolved: &BTreeMap<String, Vec<IpAddr>>, name: &str) -> Option<IpAddr> {
    resolved.get(name).and_then(|v| v.first().copied())
}

fn parse_ip(s: &str) -> Result<IpAddr, String> {
    let ip: IpAddr = s
        .parse()
        .map_err(|_| format!("{s:?} is not an IP address"))?;
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(format!("{ip} is not a unicast address"));
    }
    Ok(ip)
}

/// Splits `host:port` / `[v6]:port`; the port must be 1–65535.
pub fn split_host_port(s: &str) -> Option<(&str, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:")?;
        (h, p)
    } else {
        let (h, p) = s.rsplit_once(':')?;
        if h.contains(':') {
            return None;
        }
        (h, p)
    };
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!host.is_empty()).then_some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: &str, targets: Vec<TargetSpec>) -> TestSpec {
        TestSpec {
            kind: kind.into(),
            targets,
            count: 3,
            interval_ms: 100,
            timeout_ms: 1000,
            max_nodes: None,
            port: None,
            resolver: None,
            expected_status: vec![],
            max_mtu: None,
        }
    }

    fn nodes(n: usize) -> Vec<SourceNode> {
        (0..n)
            .map(|i| SourceNode {
                name: format!("w{i}"),
                address: format!("10.0.0.{}", i + 1).parse().unwrap(),
            })
            .collect()
    }

    fn field_of(r: Result<TestPlan, SpecError>) -> String {
        r.expect_err("expected a spec error").field
    }

    /// The ranges the tests' targets lie in.
    fn env() -> Environment {
        Environment {
            allowed: nodekeeper_model::address_policy::parse_list("10.0.0.0/8 fd00::/8").unwrap(),
            ..Environment::default()
        }
    }

    fn no_dns() -> BTreeMap<String, Vec<IpAddr>> {
        BTreeMap::new()
    }

    #[test]
    fn bad_parameters_name_the_field() {
        let t = vec![TargetSpec::Address("10.0.0.9".into())];
        let env = env();
        let mut s = spec("ping", t.clone());
        assert_eq!(
            field_of(plan(&s, &nodes(1), &env, &no_dns(), "u")),
            "spec.kind"
        );
        for (field, f) in [
            (
                "spec.count",
                (|s: &mut TestSpec| s.count = 0) as fn(&mut TestSpec),
            ),
            ("spec.count", |s| s.count = -5),
            ("spec.count", |s| s.count = 101),
            ("spec.timeoutMs", |s| s.timeout_ms = 0),
            ("spec.intervalMs", |s| s.interval_ms = -1),
            ("spec.maxNodes", |s| s.max_nodes = Some(0)),
            ("spec.maxMtu", |s| s.max_mtu = Some(10)),
            ("spec.expectedStatus[0]", |s| s.expected_status = vec![42]),
        ] {
            s = spec("icmp", t.clone());
            f(&mut s);
            assert_eq!(field_of(plan(&s, &nodes(1), &env, &no_dns(), "u")), field);
        }
    }

    /// A spec whose agent calls would outlive the fan-out's cut-off is refused up front, not
    /// run to a test where every node reads as unreachable.
    #[test]
    fn specs_longer_than_a_call_may_take_are_refused() {
        let mut s = spec("icmp", vec![TargetSpec::Address("10.0.0.9".into())]);
        s.count = 100;
        s.interval_ms = 60_000;
        let e = plan(&s, &nodes(1), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.count");
        assert!(
            e.reason.contains("spec.intervalMs") && e.reason.contains("900 s"),
            "{e}"
        );
        // Just inside the limit: 14 probes × 61 s plus slack.
        s.count = 14;
        s.timeout_ms = 1_000;
        assert!(plan(&s, &nodes(1), &env(), &no_dns(), "u").is_ok());
    }

    /// The agent refuses a pathMtu request whose maxMtu an IPv6 target cannot take; the
    /// controller refuses it first, naming the field, instead of reading every node unreachable.
    #[test]
    fn path_mtu_below_the_ipv6_minimum_is_refused_for_ipv6_targets() {
        let mut s = spec(
            "pathMtu",
            vec![
                TargetSpec::Address("10.0.0.9".into()),
                TargetSpec::Address("fd00::9".into()),
            ],
        );
        s.max_mtu = Some(1_000);
        let e = plan(&s, &nodes(1), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.maxMtu");
        assert!(
            e.reason.contains("1280") && e.reason.contains("fd00::9"),
            "{e}"
        );
        // IPv4 only, or a large enough maxMtu: fine.
        s.targets.pop();
        assert!(plan(&s, &nodes(1), &env(), &no_dns(), "u").is_ok());
        s.targets.push(TargetSpec::Address("fd00::9".into()));
        s.max_mtu = Some(1_280);
        assert!(plan(&s, &nodes(1), &env(), &no_dns(), "u").is_ok());
    }

    #[test]
    fn ten_thousand_targets_are_refused() {
        let many = (0..10_000)
            .map(|i| TargetSpec::Address(format!("10.1.{}.{}", i / 200, i % 200 + 1)))
            .collect();
        let e = plan(&spec("icmp", many), &nodes(1), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets");
        assert!(e.reason.contains("10000 entries, at most 1000"), "{e}");
    }

    #[test]
    fn no_matching_nodes_fails_on_the_selector() {
        let s = spec("icmp", vec![TargetSpec::Address("10.0.0.9".into())]);
        assert_eq!(
            field_of(plan(&s, &[], &env(), &no_dns(), "u")),
            "spec.nodeSelector"
        );
    }

    #[test]
    fn unresolvable_hostname_and_bad_url() {
        let env = env();
        let s = spec("icmp", vec![TargetSpec::Hostname("nope.invalid".into())]);
        let e = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.reason.as_str()),
            (
                "spec.targets[0].hostname",
                "\"nope.invalid\" does not resolve"
            )
        );
        let mut resolved = BTreeMap::new();
        resolved.insert("ok.example".to_owned(), vec!["10.9.9.9".parse().unwrap()]);
        let s = spec("icmp", vec![TargetSpec::Hostname("ok.example".into())]);
        let p = plan(&s, &nodes(1), &env, &resolved, "u").unwrap();
        assert_eq!(p.sources["w0"][0].address, "10.9.9.9");
        let s = spec("http", vec![TargetSpec::Url("gopher://x/".into())]);
        let e = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets[0].url");
        assert!(e.reason.contains("scheme \"gopher\""));
    }

    #[test]
    fn metadata_and_api_server_only_when_asked_and_configured() {
        let env = Environment {
            api_server: Some("10.96.0.1:443".parse().unwrap()),
            metadata_service: Some("127.0.0.53".parse().unwrap()),
            allowed: env().allowed,
            ..Environment::default()
        };
        let s = spec("icmp", vec![TargetSpec::Address("10.0.0.9".into())]);
        let p = plan(&s, &nodes(2), &env, &no_dns(), "u").unwrap();
        for targets in p.sources.values() {
            assert_eq!(
                targets
                    .iter()
                    .map(|t| t.address.as_str())
                    .collect::<Vec<_>>(),
                vec!["10.0.0.9"]
            );
        }
        let s = spec(
            "http",
            vec![TargetSpec::ApiServer, TargetSpec::MetadataService],
        );
        let p = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap();
        let urls: Vec<_> = p.sources["w0"].iter().map(|t| t.url.as_str()).collect();
        assert_eq!(
            urls,
            vec!["https://10.96.0.1:443/livez", "http://127.0.0.53:80/"]
        );
        let s = spec("icmp", vec![TargetSpec::MetadataService]);
        let e = plan(&s, &nodes(1), &Environment::default(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets[0].metadataService");
    }

    /// The kubernetes Service's ClusterIP answers TCP on its port only: icmp and pathMtu to it
    /// are refused naming the flag that gives a direct address, and tcp uses the API server's
    /// own port, not `spec.port`.
    #[test]
    fn the_api_server_as_a_service_is_probed_over_tcp_only() {
        let service = Environment {
            api_server: Some("10.96.0.1:443".parse().unwrap()),
            api_server_is_service: true,
            ..env()
        };
        for kind in ["icmp", "pathMtu"] {
            let s = spec(kind, vec![TargetSpec::ApiServer]);
            let e = plan(&s, &nodes(1), &service, &no_dns(), "u").unwrap_err();
            assert_eq!(e.field, "spec.targets[0].apiServer", "{kind}");
            assert!(
                e.reason.contains("--api-server-address") && e.reason.contains("ClusterIP"),
                "{e}"
            );
        }
        let mut s = spec(
            "tcp",
            vec![
                TargetSpec::ApiServer,
                TargetSpec::Address("10.0.0.9".into()),
            ],
        );
        s.port = Some(6443);
        let p = plan(&s, &nodes(1), &service, &no_dns(), "u").unwrap();
        let ports: Vec<_> = p.sources["w0"]
            .iter()
            .map(|t| (t.id.as_str(), t.port))
            .collect();
        assert_eq!(ports, [("apiServer", 443), ("10.0.0.9", 6443)]);
        // A direct address (--api-server-address) takes icmp.
        let direct = Environment {
            api_server: Some("10.0.0.1:6443".parse().unwrap()),
            ..env()
        };
        let s = spec("icmp", vec![TargetSpec::ApiServer]);
        let p = plan(&s, &nodes(1), &direct, &no_dns(), "u").unwrap();
        assert_eq!(p.sources["w0"][0].address, "10.0.0.1");
    }

    #[test]
    fn peers_expand_per_node_and_cap_sources() {
        let mut s = spec(
            "icmp",
            vec![
                TargetSpec::Address("10.0.0.200".into()),
                TargetSpec::Peers { per_node: 2 },
            ],
        );
        s.max_nodes = Some(4);
        let p = plan(&s, &nodes(6), &env(), &no_dns(), "uid-7").unwrap();
        assert_eq!(p.sources.len(), 4);
        // Sorted by name, the first four are w0..w3; peers are among those four only.
        for (name, targets) in &p.sources {
            assert_eq!(targets.len(), 3, "{name}: {targets:?}");
            assert_eq!(targets[0].address, "10.0.0.200");
            for t in &targets[1..] {
                assert!(t.id.starts_with("node/w") && t.id != format!("node/{name}"));
                let peer = t.id.trim_start_matches("node/");
                assert!(
                    p.sources.contains_key(peer),
                    "peer {peer} is not a selected source"
                );
            }
        }
        assert_eq!(p.pair_count(), 12);
        assert_eq!(p, plan(&s, &nodes(6), &env(), &no_dns(), "uid-7").unwrap());
    }

    #[test]
    fn kind_and_target_must_fit() {
        let env = env();
        let s = spec("tcp", vec![TargetSpec::Address("10.0.0.9".into())]);
        assert!(
            plan(&s, &nodes(1), &env, &no_dns(), "u")
                .unwrap_err()
                .reason
                .contains("need a port")
        );
        let s = spec("tcp", vec![TargetSpec::HostPort("[fd00::1]:443".into())]);
        let p = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap();
        assert_eq!(
            (p.sources["w0"][0].address.as_str(), p.sources["w0"][0].port),
            ("fd00::1", 443)
        );
        let s = spec("http", vec![TargetSpec::Peers { per_node: 1 }]);
        assert_eq!(
            field_of(plan(&s, &nodes(2), &env, &no_dns(), "u")),
            "spec.targets[0].peers"
        );
        let s = spec("tcp", vec![TargetSpec::Peers { per_node: 1 }]);
        assert_eq!(
            field_of(plan(&s, &nodes(2), &env, &no_dns(), "u")),
            "spec.port"
        );
        let s = spec("icmp", vec![TargetSpec::Peers { per_node: 0 }]);
        assert_eq!(
            field_of(plan(&s, &nodes(2), &env, &no_dns(), "u")),
            "spec.targets[0].peers"
        );
        let mut s = spec(
            "dns",
            vec![TargetSpec::Hostname(
                "kubernetes.default.svc.cluster.local".into(),
            )],
        );
        s.resolver = Some("10.96.0.10".into());
        let p = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap();
        assert_eq!(p.sources["w0"][0].address, "10.96.0.10");
        assert!(hostnames_to_resolve(&s).is_empty());
    }

    #[test]
    fn peers_on_a_single_selected_node_names_the_field_and_the_fix() {
        let s = spec("icmp", vec![TargetSpec::Peers { per_node: 1 }]);
        let e = plan(&s, &nodes(1), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets[0].peers");
        assert!(
            e.reason.contains("at least two selected nodes") && e.reason.contains("1 selected"),
            "{e}"
        );
        // maxNodes 1 over many matching nodes is the same single source.
        let mut s = spec("icmp", vec![TargetSpec::Peers { per_node: 1 }]);
        s.max_nodes = Some(1);
        let e = plan(&s, &nodes(5), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets[0].peers");
        assert!(
            plan(
                &spec("icmp", vec![TargetSpec::Peers { per_node: 1 }]),
                &nodes(2),
                &env(),
                &no_dns(),
                "u"
            )
            .is_ok()
        );
    }

    #[test]
    fn duplicate_targets_are_refused() {
        let s = spec(
            "icmp",
            vec![
                TargetSpec::Address("10.0.0.9".into()),
                TargetSpec::Address("10.0.0.9".into()),
            ],
        );
        let e = plan(&s, &nodes(1), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets");
        assert!(e.reason.contains("listed twice"), "{e}");
    }

    #[test]
    fn the_api_server_address_comes_from_the_controllers_own_url() {
        let got = |u| api_server_from_url(u).map(|a| a.to_string());
        assert_eq!(
            got("https://10.96.0.1:443").as_deref(),
            Some("10.96.0.1:443")
        );
        assert_eq!(got("https://10.96.0.1").as_deref(), Some("10.96.0.1:443"));
        assert_eq!(
            got("https://127.0.0.1:36443/").as_deref(),
            Some("127.0.0.1:36443")
        );
        assert_eq!(
            got("https://[fd00::1]:6443").as_deref(),
            Some("[fd00::1]:6443")
        );
        assert_eq!(got("https://[fd00::1]").as_deref(), Some("[fd00::1]:443"));
        assert_eq!(got("https://api.example.com:6443"), None);
        assert_eq!(got("not a url"), None);
    }

    #[test]
    fn the_metadata_service_by_address_is_refused_naming_the_target_and_the_fix() {
        let env = Environment {
            metadata_service: Some("169.254.169.254".parse().unwrap()),
            ..env()
        };
        for a in ["169.254.169.254", "::ffff:169.254.169.254"] {
            let s = spec(
                "icmp",
                vec![
                    TargetSpec::Address("10.0.0.9".into()),
                    TargetSpec::Address(a.into()),
                ],
            );
            let e = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap_err();
            assert_eq!(e.field, "spec.targets[1].address", "{a}");
            assert!(e.reason.contains("metadataService: true"), "{e}");
        }
        let s = spec("icmp", vec![TargetSpec::Address("169.254.10.1".into())]);
        let e = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap_err();
        assert!(e.reason.contains("link-local"), "{e}");
        // A URL, a host:port and a name that resolves there are refused the same way.
        let s = spec(
            "http",
            vec![TargetSpec::Url("http://169.254.169.254/latest/".into())],
        );
        assert_eq!(
            field_of(plan(&s, &nodes(1), &env, &no_dns(), "u")),
            "spec.targets[0].url"
        );
        let s = spec(
            "tcp",
            vec![TargetSpec::HostPort("169.254.169.254:80".into())],
        );
        assert_eq!(
            field_of(plan(&s, &nodes(1), &env, &no_dns(), "u")),
            "spec.targets[0].hostPort"
        );
        let mut resolved = BTreeMap::new();
        resolved.insert(
            "metadata.example".to_owned(),
            vec!["169.254.169.254".parse().unwrap()],
        );
        let s = spec(
            "http",
            vec![TargetSpec::Url("http://metadata.example/".into())],
        );
        assert_eq!(hostnames_to_resolve(&s).len(), 1);
        assert_eq!(
            field_of(plan(&s, &nodes(1), &env, &resolved, "u")),
            "spec.targets[0].url"
        );
        // Only through the explicit target, which is sent to the agent as one address.
        let s = spec("icmp", vec![TargetSpec::MetadataService]);
        let p = plan(&s, &nodes(1), &env, &no_dns(), "u").unwrap();
        let sent = p.allowed_for(&p.sources["w0"]);
        assert!(sent.contains(&"169.254.169.254/32".to_owned()), "{sent:?}");
    }

    #[test]
    fn addresses_outside_the_allowed_ranges_are_refused() {
        let s = spec("icmp", vec![TargetSpec::Address("192.168.7.7".into())]);
        let e = plan(&s, &nodes(2), &env(), &no_dns(), "u").unwrap_err();
        assert_eq!(e.field, "spec.targets[0].address");
        assert!(
            e.reason.contains("outside") && e.reason.contains("probeAllowedCidrs"),
            "{e}"
        );
        let mut s = spec("dns", vec![TargetSpec::Hostname("a.example".into())]);
        s.resolver = Some("192.168.0.53".into());
        assert_eq!(
            field_of(plan(&s, &nodes(1), &env(), &no_dns(), "u")),
            "spec.resolver"
        );
        // The selected nodes are always allowed: peers and node addresses need no range.
        let bare = Environment::default();
        let s = spec(
            "icmp",
            vec![
                TargetSpec::Address("10.0.0.2".into()),
                TargetSpec::Peers { per_node: 1 },
            ],
        );
        let p = plan(&s, &nodes(2), &bare, &no_dns(), "u").unwrap();
        // The agent is sent the ranges and the one addresses its targets need, nothing else.
        assert_eq!(p.allowed_for(&p.sources["w0"]), ["10.0.0.2/32".to_owned()]);
        let p = plan(&s, &nodes(2), &env(), &no_dns(), "u").unwrap();
        assert_eq!(
            p.allowed_for(&p.sources["w0"]),
            ["10.0.0.0/8".to_owned(), "fd00::/8".to_owned()]
        );
    }

    /// Without `--pod-cidrs` every selected node brings its own pod range; an agent is sent
    /// them collapsed (2,000 /24s handed out in order become six ranges, as Python's
    /// `ipaddress.collapse_addresses` also answers), not one entry per node, plus its peers'
    /// addresses; every pod address stays allowed.
    #[test]
    fn per_node_pod_ranges_are_sent_collapsed() {
        let pod_range = |i: u32| -> Cidr {
            let net = std::net::Ipv4Addr::from(0x0a80_0000 + (i << 8));
            format!("{net}/24").parse().unwrap()
        };
        let env = Environment {
            allowed: (0..2_000).map(pod_range).collect(),
            ..Environment::default()
        };
        let s = spec("icmp", vec![TargetSpec::Peers { per_node: 3 }]);
        let p = plan(&s, &nodes(50), &env, &no_dns(), "u").unwrap();
        let sent = p.allowed_for(&p.sources["w0"]);
        let (hosts, ranges): (Vec<_>, Vec<_>) = sent.iter().partition(|r| r.ends_with("/32"));
        assert_eq!(
            ranges,
            [
                "10.128.0.0/14",
                "10.132.0.0/15",
                "10.134.0.0/16",
                "10.135.0.0/17",
                "10.135.128.0/18",
                "10.135.192.0/20"
            ]
        );
        assert_eq!(hosts.len(), 3, "{sent:?}");
        let s = spec("icmp", vec![TargetSpec::Address("10.135.207.9".into())]);
        assert!(plan(&s, &nodes(1), &env, &no_dns(), "u").is_ok());
        let s = spec("icmp", vec![TargetSpec::Address("10.135.208.9".into())]);
        assert!(plan(&s, &nodes(1), &env, &no_dns(), "u").is_err());
    }

    /// A URL whose host name resolves to a node's address (a one-address entry of the policy,
    /// not a range) sends the agent that address, which checks the name's addresses again.
    #[test]
    fn a_url_naming_a_node_sends_the_agent_its_address() {
        let mut resolved = BTreeMap::new();
        resolved.insert(
            "w1.nodes.example".to_owned(),
            vec!["10.0.0.2".parse().unwrap()],
        );
        let s = spec(
            "http",
            vec![TargetSpec::Url(
                "http://w1.nodes.example:10256/healthz".into(),
            )],
        );
        let p = plan(&s, &nodes(2), &Environment::default(), &resolved, "u").unwrap();
        assert_eq!(p.allowed_for(&p.sources["w0"]), ["10.0.0.2/32".to_owned()]);
        // Inside a range: nothing more to send.
        let p = plan(&s, &nodes(2), &env(), &resolved, "u").unwrap();
        assert_eq!(
            p.allowed_for(&p.sources["w0"]),
            ["10.0.0.0/8".to_owned(), "fd00::/8".to_owned()]
        );
    }

    #[test]
    fn url_hosts() {
        assert_eq!(url_host("http://10.0.0.1:8080/x"), Some("10.0.0.1"));
        assert_eq!(url_host("https://[fd00::1]:443/"), Some("fd00::1"));
        assert_eq!(url_host("http://u@a.example?q"), Some("a.example"));
        assert_eq!(url_host("nonsense"), None);
    }

    #[test]
    fn host_port_splitting() {
        assert_eq!(split_host_port("a.b:80"), Some(("a.b", 80)));
        assert_eq!(split_host_port("[::1]:443"), Some(("::1", 443)));
        assert_eq!(split_host_port("::1:443"), None);
        assert_eq!(split_host_port("a:0"), None);
        assert_eq!(split_host_port(":80"), None);
    }
}
