//! The targets and their invariants. Each takes raw bytes (as an attacker or a broken peer
//! would send them), and panics only on a bug: a panic inside the code under test, or an
//! invariant that does not hold.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;

use nodekeeper_model::address_policy::{Cidr, agent_permits, is_link_local};
use nodekeeper_model::network::{LinkKind, NetworkState, format_mac, parse_mac};
use nodekeeper_netconf::observed::{ObservedAddress, ObservedLink, ObservedRoute, ObservedRule};
use nodekeeper_netconf::plan::{Plan, Step, link_alias};
use nodekeeper_netconf::{NK_PROTOCOL, Observed};
use nodekeeper_proto::agent::v1 as pb;

use crate::Target;

/// Every target, by name.
pub const ALL: &[Target] = &[IMDS, TUNING, NETWORKTEST, NETCONF, AGENT];

/// Splits `input` at the first `\n===\n` (the corpus files' separator between parts).
fn parts(input: &[u8]) -> (String, Vec<u8>) {
    let sep = b"\n===\n";
    match input.windows(sep.len()).position(|w| w == sep) {
        Some(at) => (
            String::from_utf8_lossy(&input[..at]).into_owned(),
            input[at + sep.len()..].to_vec(),
        ),
        None => (String::from_utf8_lossy(input).into_owned(), Vec::new()),
    }
}

// ---------------------------------------------------------------------------------------------
// IMDS answers → VNIC layout → network plan.

pub const IMDS: Target = Target {
    name: "imds",
    run: imds,
    seeds: imds_seeds,
    dictionary: &[
        "\"vnicId\"",
        "\"macAddr\"",
        "\"privateIp\"",
        "\"subnetCidrBlock\"",
        "\"virtualRouterIp\"",
        "\"vlanTag\"",
        "\"nicIndex\"",
        "\"ipv6Addresses\"",
        "\"ipv6SubnetCidrBlock\"",
        "\"ipv6VirtualRouterIp\"",
        "\"shape\"",
        "\"BM.Standard.E5.192\"",
        "\"VM.Standard.E4.Flex\"",
        "02:00:17:0a:11:01",
        "10.0.0.0/8",
        "10.0.10.17",
        "/32",
        "/0",
        "2001:db8::/64",
    ],
    max_len: 16 << 10,
};

fn imds_seeds() -> Vec<Vec<u8>> {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crates/oci/tests/fixtures");
    let read = |name: &str| std::fs::read_to_string(fixtures.join(name)).unwrap_or_default();
    let mut out = Vec::new();
    for (instance, vnics) in [
        ("instance-vm.json", "vnics-vm.json"),
        ("instance-vm.json", "vnics-vm-dual-stack.json"),
        ("instance-vm.json", "vnics-vm-multi-ipv6.json"),
        ("instance-vm.json", "vnics-vm-ipv6-only.json"),
        ("instance-vm.json", "vnics-vm-reuses-primary-ip.json"),
        ("instance-bm.json", "vnics-bm.json"),
    ] {
        out.push(format!("{}\n===\n{}", read(instance), read(vnics)).into_bytes());
    }
    out
}

fn imds(input: &[u8]) {
    let (instance, vnics) = parts(input);
    let vnics = String::from_utf8_lossy(&vnics);
    let instance = nodekeeper_oci::parse_instance(&instance);
    let vnics = nodekeeper_oci::parse_vnics(&vnics);
    // Errors are rendered into statuses and logs: that must not panic either.
    let (instance, vnics) = match (instance, vnics) {
        (Ok(i), Ok(v)) => (i, v),
        (i, v) => {
            let _ = (
                i.err().map(|e| e.to_string()),
                v.err().map(|e| e.to_string()),
            );
            return;
        }
    };
    // The host shows each VNIC's MAC on a physical NIC, numbered like nicIndex.
    let mut host: Vec<nodekeeper_oci::HostInterface> = vnics
        .iter()
        .enumerate()
        .map(|(i, v)| nodekeeper_oci::HostInterface {
            name: format!("ens{}", i + 3),
            mac: v.mac_addr.clone(),
            pci_address: Some(format!("0000:{i:02x}:00.0")),
        })
        .collect();
    host.truncate(8);
    let layout = match nodekeeper_oci::secondary_vnics(
        &instance,
        &vnics,
        &host,
        &nodekeeper_oci::LayoutOptions::default(),
    ) {
        Ok(layout) => layout,
        Err(error) => {
            let _ = error.to_string();
            return;
        }
    };
    if let Err(errors) = layout.desired.validate() {
        panic!("the layout produced a state its own validator refuses: {errors:?}");
    }
    // The primary VNIC (the first) is never touched: neither its MAC nor its addresses appear.
    if let Some(primary) = vnics.first() {
        let primary_ips: BTreeSet<IpAddr> = primary
            .ipv4
            .iter()
            .map(|v| IpAddr::from(v.private_ip))
            .chain(
                primary
                    .ipv6
                    .iter()
                    .flat_map(|v| v.addresses.iter().map(|a| IpAddr::from(*a))),
            )
            .collect();
        for l in &layout.desired.links {
            let mac = l.mac.as_deref().and_then(parse_mac).map(|m| format_mac(&m));
            assert!(
                l.kind != LinkKind::Existing || mac.as_deref() != Some(primary.mac_addr.as_str()),
                "the layout configures the primary VNIC's interface: {l:?}"
            );
        }
        for a in &layout.desired.addresses {
            let ip = a
                .cidr
                .split('/')
                .next()
                .and_then(|s| s.parse::<IpAddr>().ok());
            assert!(
                ip.is_none_or(|ip| !primary_ips.contains(&ip)),
                "the layout puts the primary's address {} on a secondary",
                a.cidr
            );
        }
    }
    // The layout is planned against the host as the agent would see it.
    let observed = host_as_observed(&host);
    check_plan(&layout.desired, &observed);
}

fn host_as_observed(host: &[nodekeeper_oci::HostInterface]) -> Observed {
    let mut links = vec![plain_link(1, "lo", "00:00:00:00:00:00")];
    for (i, h) in host.iter().enumerate() {
        links.push(plain_link(i as u32 + 2, &h.name, &h.mac));
    }
    Observed {
        links,
        ..Observed::default()
    }
}

fn plain_link(index: u32, name: &str, mac: &str) -> ObservedLink {
    ObservedLink {
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
    }
}

// ---------------------------------------------------------------------------------------------
// The tuning ConfigMap: the controller's parse, and the agent's SetRules on what it accepts.

pub const TUNING: Target = Target {
    name: "tuning",
    run: tuning,
    seeds: tuning_seeds,
    dictionary: &[
        "### rules.yaml\n",
        "### sweepInterval\n",
        "### staleAfter\n",
        "### concurrency\n",
        "### features.repair\n",
        "### probeAllowedCidrs\n",
        "### diagnostics.parts\n",
        "tunables:\n",
        "thresholds:\n",
        "  - name: ",
        "    key: ",
        "    atLeast: ",
        "    atMost: ",
        "    equal: ",
        "    oneOf: [",
        "    repair: true\n",
        "    repairMaxPerHour: ",
        "    severity: critical\n",
        "  - indicator: ",
        "    warning: ",
        "    critical: ",
        "net.core.somaxconn",
        "vm.swappiness",
        "net.ipv4.ip_forward",
        "load1PerCpu",
        "memoryAvailablePercent",
        "1h",
        "10s",
        "0s",
        "24h1s",
    ],
    max_len: 8 << 10,
};

fn tuning_seeds() -> Vec<Vec<u8>> {
    vec![
        b"### sweepInterval\n30s\n### staleAfter\n2m\n### concurrency\n64\n### features.repair\ntrue\n### rules.yaml\ntunables:\n  - name: backlog\n    key: net.core.somaxconn\n    atLeast: 4096\n    repair: true\n  - name: forward\n    key: net.ipv4.ip_forward\n    equal: 1\n  - name: swap\n    key: vm.swappiness\n    oneOf: [0, 1, 10]\n    severity: critical\nthresholds:\n  - indicator: load1PerCpu\n    warning: 2\n    critical: 4\n".to_vec(),
        b"### rules.yaml\ntunables:\n  - name: a\n    key: net.core.rmem_max\n    atLeast: 1024\n  - name: b\n    key: net.core.rmem_max\n    atMost: 8192\n".to_vec(),
        b"### probeAllowedCidrs\n10.0.0.0/8, fd00::/8\n### diagnostics.parts\nkmsg,report\n".to_vec(),
    ]
}

/// `### key` lines start a key; the lines after it, up to the next, are its value.
fn configmap_data(text: &str) -> BTreeMap<String, String> {
    let mut data = BTreeMap::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    for line in text.split('\n') {
        if let Some(key) = line.strip_prefix("### ") {
            if let Some((k, v)) = current.take() {
                data.insert(k, v.join("\n"));
            }
            current = Some((key.to_owned(), Vec::new()));
        } else if let Some((_, v)) = current.as_mut() {
            v.push(line);
        }
    }
    if let Some((k, v)) = current {
        data.insert(k, v.join("\n"));
    }
    data
}

fn tuning(input: &[u8]) {
    let data = configmap_data(&String::from_utf8_lossy(input));
    let config = match nodekeeper_model::tuning::parse(&data) {
        Ok(config) => config,
        Err(error) => {
            assert!(!error.problems().is_empty(), "a refusal names no problem");
            let _ = error.to_string();
            return;
        }
    };
    let revision = config.rules.revision();
    assert_eq!(
        nodekeeper_model::tuning::parse(&data).map(|c| c.rules.revision()),
        Ok(revision),
        "the same ConfigMap gives another revision"
    );
    // One validator on both sides: what the controller accepts, an agent whose node has every
    // key takes.
    agent_harness(|h| {
        for rule in &config.rules.tunables {
            if !h.add_sysctl(&rule.key) {
                // This node cannot have the key (a group of sysctls here): a node-specific
                // refusal, not a disagreement between the validators.
                return;
            }
        }
        let request =
            nodekeeper_controller::shared::agents::set_rules_request(&config.rules, revision);
        match h.set_rules(request) {
            Ok(active) => assert_eq!(active, revision),
            Err(status) => panic!(
                "the controller accepted rules that an agent with every key refuses: {status:?}"
            ),
        }
    });
}

// ---------------------------------------------------------------------------------------------
// NetworkTest spec → the controller's plan, against the address policy the agent enforces.

pub const NETWORKTEST: Target = Target {
    name: "networktest",
    run: networktest,
    seeds: networktest_seeds,
    dictionary: &[
        "{\"address\": \"",
        "{\"hostPort\": \"",
        "{\"hostname\": \"",
        "{\"url\": \"",
        "{\"apiServer\": true}",
        "{\"metadataService\": true}",
        "{\"peers\": {\"perNode\": 3}}",
        "\"kind\": \"tcp\"",
        "\"kind\": \"http\"",
        "\"kind\": \"dns\"",
        "\"kind\": \"pathMtu\"",
        "\"port\": ",
        "\"resolver\": \"",
        "\"maxNodes\": ",
        "\"expectedStatus\": [",
        "http://169.254.169.254/opc/v2/",
        "https://[fe80::1%25eth0]:443/",
        "http://10.0.0.2:80/",
        "metadata.internal",
        "10.0.0.1",
        "10.244.1.7",
        "10.96.0.1:443",
        "[::1]:53",
        "8.8.8.8",
        "0x7f.1",
        "127.1",
        "localhost",
    ],
    max_len: 8 << 10,
};

fn networktest_seeds() -> Vec<Vec<u8>> {
    [
        r#"{"nodeSelector": {}, "kind": "icmp", "targets": [{"peers": {"perNode": 2}}, {"address": "10.244.1.7"}]}"#,
        r#"{"kind": "tcp", "port": 443, "targets": [{"apiServer": true}, {"hostPort": "10.0.0.2:10250"}, {"hostname": "svc.cluster.local"}]}"#,
        r#"{"kind": "http", "expectedStatus": [200, 204], "targets": [{"url": "http://10.96.0.10:8080/healthz"}, {"metadataService": true}]}"#,
        r#"{"kind": "dns", "resolver": "10.96.0.10", "targets": [{"hostname": "kubernetes.default.svc.cluster.local"}]}"#,
        r#"{"kind": "pathMtu", "maxMtu": 9000, "targets": [{"peers": {"perNode": 1}}]}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn networktest(input: &[u8]) {
    use nodekeeper_controller::controllers::networktest::{
        Environment, SourceNode, TargetSpec, crd, plan,
    };
    let Ok(spec) =
        serde_json::from_slice::<nodekeeper_api::crd::network_test::NetworkTestSpec>(input)
    else {
        return;
    };
    let spec = match crd::spec(&spec) {
        Ok(spec) => spec,
        Err(error) => {
            assert!(!error.field.is_empty(), "a refusal names no field: {error}");
            return;
        }
    };
    let nodes: Vec<SourceNode> = (1..=3)
        .map(|i| SourceNode {
            name: format!("node-{i}"),
            address: IpAddr::from([10, 0, 0, i]),
        })
        .collect();
    let metadata: IpAddr = [169, 254, 169, 254].into();
    let allowed: Vec<Cidr> = ["10.244.0.0/16", "10.96.0.0/12"]
        .iter()
        .filter_map(|c| nodekeeper_model::address_policy::parse_list(c).ok())
        .flatten()
        .collect();
    let env = Environment {
        api_server: Some("10.96.0.1:443".parse().expect("a socket address")),
        metadata_service: Some(metadata),
        allowed: allowed.clone(),
        // The in-cluster default: `apiServer` over ICMP or path MTU is refused.
        api_server_is_service: true,
    };
    // What the cluster's resolver would answer, including hostile answers.
    let resolved: BTreeMap<String, Vec<IpAddr>> = plan::hostnames_to_resolve(&spec)
        .into_iter()
        .enumerate()
        .map(|(i, (_, name))| {
            let answer: IpAddr = match i % 4 {
                0 => [10, 244, 1, 9].into(),
                1 => metadata,
                2 => [8, 8, 8, 8].into(),
                _ => "fe80::1".parse().expect("an address"),
            };
            (name, vec![answer])
        })
        .collect();
    let Ok(test) = plan(&spec, &nodes, &env, &resolved, "uid-1") else {
        return;
    };
    let asked_metadata = spec.targets.contains(&TargetSpec::MetadataService);
    let node_ips: BTreeSet<IpAddr> = nodes.iter().map(|n| n.address).collect();
    for (source, targets) in &test.sources {
        let sent: Vec<Cidr> = test
            .allowed_for(targets)
            .iter()
            .map(|c| {
                nodekeeper_model::address_policy::parse_list(c).expect("the controller sends CIDRs")
                    [0]
            })
            .collect();
        for t in targets {
            let ip = t
                .address
                .parse::<IpAddr>()
                .ok()
                .or_else(|| plan::url_host(&t.url).and_then(|h| h.parse().ok()));
            let Some(ip) = ip else { continue };
            let ip = ip.to_canonical();
            if is_link_local(ip) || ip == metadata {
                assert!(
                    asked_metadata && ip == metadata,
                    "{source} would probe link-local {ip} ({t:?}) without a metadataService target"
                );
            } else {
                assert!(
                    node_ips.contains(&ip)
                        || allowed.iter().any(|c| c.contains(ip))
                        || Some(ip) == env.api_server.map(|a| a.ip()),
                    "{source} would probe {ip} ({t:?}), outside the address policy"
                );
            }
            assert!(
                agent_permits(&sent, ip),
                "the agent would refuse {ip} that the controller planned ({t:?}, sent {sent:?})"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// netconf's planner on random observed and desired states.

pub const NETCONF: Target = Target {
    name: "netconf",
    run: netconf,
    seeds: netconf_seeds,
    dictionary: &[
        "{\"name\": \"vnic1\", \"kind\": \"existing\", \"mac\": \"02:00:17:0a:22:02\"}",
        "{\"name\": \"nkm21\", \"kind\": \"macvlan\", \"parent\": \"ens3\"}",
        "{\"name\": \"nkv21\", \"kind\": \"vlan\", \"parent\": \"nkm21\", \"vlanId\": 21}",
        "{\"link\": \"vnic1\", \"cidr\": \"10.0.20.33/24\"}",
        "{\"destination\": \"default\", \"gateway\": \"10.0.20.1\", \"link\": \"vnic1\", \"table\": 101}",
        "{\"from\": \"10.0.20.33\", \"table\": 101, \"priority\": 20101}",
        "\"mtu\": 9000",
        "\"up\": false",
        "\"onLink\": true",
        "\"metric\": 100",
        "\"table\": 254",
        "ens3",
        "ens5",
        "lo",
        "2001:db8::5/64",
        "fe80::1/64",
        "\"macvlanMode\": \"private\"",
    ],
    max_len: 8 << 10,
};

fn netconf_seeds() -> Vec<Vec<u8>> {
    [
        r#"{"links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true}], "addresses": [{"link": "vnic1", "cidr": "10.0.20.33/24"}], "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101}], "rules": [{"from": "10.0.20.33", "table": 101, "priority": 20101}]}"#,
        r#"{"links": [{"name": "nkv21", "kind": "vlan", "parent": "nkm21", "vlanId": 21, "mtu": 9000}, {"name": "nkm21", "kind": "macvlan", "parent": "ens3", "mac": "02:00:17:1b:08:21", "mtu": 9000}], "addresses": [{"link": "nkv21", "cidr": "10.1.8.21/22"}], "routes": [{"destination": "default", "gateway": "10.1.8.1", "link": "nkv21", "table": 121}], "rules": [{"from": "10.1.8.21/32", "table": 121, "priority": 20121}]}
===
\x03\x01\x02\x03\x04\x05\x06\x07\x08\x09"#,
        "{}\n===\n\u{5}\u{1}\u{3}\u{2}\u{7}\u{1}\u{1}\u{2}\u{3}\u{1}\u{1}\u{1}\u{1}\u{1}\u{1}\u{1}",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// Reads bytes as choices; zeros once they run out.
struct Choices<'a>(&'a [u8]);

impl Choices<'_> {
    fn pick(&mut self, n: usize) -> usize {
        let Some((first, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        usize::from(*first) % n.max(1)
    }
}

/// A host: the planner tests' VM (lo, ens3 at MTU 9000 with its address and default route, ens5
/// down: a bare-metal layout's macvlans at 9000 need a parent at least as large),
/// plus links, addresses, routes and rules chosen by `bytes` — some nodekeeper's (alias,
/// protocol 176), most not.
fn observed_from(bytes: &[u8]) -> Observed {
    let mut c = Choices(bytes);
    let mut obs = Observed {
        links: vec![
            plain_link(1, "lo", "00:00:00:00:00:00"),
            ObservedLink {
                mtu: 9000,
                ..plain_link(2, "ens3", "02:00:17:0a:11:01")
            },
            ObservedLink {
                up: false,
                ..plain_link(3, "ens5", "02:00:17:0a:22:02")
            },
        ],
        addresses: vec![ObservedAddress {
            index: 2,
            net: "10.0.10.17/24".parse().expect("a prefix"),
            protocol: 0,
        }],
        routes: vec![ObservedRoute {
            table: 254,
            destination: "0.0.0.0/0".parse().expect("a prefix"),
            gateway: Some([10, 0, 10, 1].into()),
            oif: Some(2),
            metric: 0,
            protocol: 16,
            on_link: false,
        }],
        rules: Vec::new(),
    };
    let names = ["nkm21", "nkv21", "vnic1", "eth9", "nkm22", "ens6"];
    for k in 0..c.pick(5) {
        let name = names[c.pick(names.len())];
        if obs.link_by_name(name).is_some() {
            continue;
        }
        let index = 4 + k as u32;
        let kind = ["", "veth", "vlan", "macvlan"][c.pick(4)];
        let parent =
            (kind == "vlan" || kind == "macvlan").then(|| 2 + c.pick(index as usize - 2) as u32);
        obs.links.push(ObservedLink {
            index,
            name: name.into(),
            mac: Some(format!("02:00:17:1b:08:{:02x}", c.pick(256))),
            mtu: [1500, 9000, 1400][c.pick(3)],
            up: c.pick(2) == 0,
            oper_state: "up".into(),
            kind: kind.into(),
            parent_index: parent,
            vlan_id: (kind == "vlan").then(|| [21, 22, 100][c.pick(3)]),
            macvlan_mode: (kind == "macvlan").then(|| ["bridge", "private"][c.pick(2)].into()),
            alias: (c.pick(2) == 0).then(|| link_alias(name)),
        });
    }
    let indices: Vec<u32> = obs.links.iter().map(|l| l.index).collect();
    let proto = |c: &mut Choices<'_>| [NK_PROTOCOL, 0, 16, 2][c.pick(4)];
    let nets = [
        "10.0.20.33/24",
        "10.1.8.21/22",
        "2001:db8::5/64",
        "10.0.10.18/24",
        "fe80::1/64",
    ];
    for _ in 0..c.pick(4) {
        obs.addresses.push(ObservedAddress {
            index: indices[c.pick(indices.len())],
            net: nets[c.pick(nets.len())].parse().expect("a prefix"),
            protocol: proto(&mut c),
        });
    }
    let dests = ["0.0.0.0/0", "10.0.20.0/24", "::/0", "10.1.8.0/22"];
    let gateways: [Option<IpAddr>; 3] = [
        None,
        Some([10, 0, 20, 1].into()),
        Some([10, 1, 8, 1].into()),
    ];
    for _ in 0..c.pick(4) {
        obs.routes.push(ObservedRoute {
            table: [254, 101, 121, 100][c.pick(4)],
            destination: dests[c.pick(dests.len())].parse().expect("a prefix"),
            gateway: gateways[c.pick(3)],
            oif: Some(indices[c.pick(indices.len())]),
            metric: [0, 1024, 100][c.pick(3)],
            protocol: proto(&mut c),
            on_link: c.pick(4) == 0,
        });
    }
    let froms = ["10.0.20.33/32", "10.1.8.21/32", "2001:db8::5/128"];
    for _ in 0..c.pick(4) {
        let from: ipnet::IpNet = froms[c.pick(froms.len())].parse().expect("a prefix");
        obs.rules.push(ObservedRule {
            v6: from.addr().is_ipv6(),
            priority: [20101, 20121, 32766, 20100][c.pick(4)],
            from: Some(from),
            to: None,
            table: [101, 121, 254][c.pick(3)],
            protocol: proto(&mut c),
        });
    }
    obs
}

fn netconf(input: &[u8]) {
    let (desired, bytes) = parts(input);
    let Ok(desired) = serde_json::from_str::<NetworkState>(&desired) else {
        return;
    };
    check_plan(&desired, &observed_from(&bytes));
}

/// The planner's invariants for `desired` on `observed`: it never deletes or changes an object
/// nodekeeper does not own or the desired state does not name, and once its plan is applied
/// there is nothing left to do.
fn check_plan(desired: &NetworkState, observed: &Observed) {
    let plan = match nodekeeper_netconf::plan(desired, observed) {
        Ok(plan) => plan,
        Err(error) => {
            let _ = error.to_string();
            return;
        }
    };
    let desired_macs: BTreeSet<String> = desired
        .links
        .iter()
        .filter_map(|l| l.mac.as_deref().and_then(parse_mac))
        .map(|m| format_mac(&m))
        .collect();
    let desired_names: BTreeSet<&str> = desired.links.iter().map(|l| l.name.as_str()).collect();
    let named = |link: &str| {
        observed.link_by_name(link).is_none_or(|l| {
            l.owned()
                || desired_names.contains(l.name.as_str())
                || l.mac.as_ref().is_some_and(|m| desired_macs.contains(m))
        })
    };
    let index_of = |name: &str| observed.link_by_name(name).map(|l| l.index);
    for step in &plan.steps {
        let ok = match step {
            Step::DeleteLink(l) => observed
                .link_by_name(&l.name)
                .is_some_and(ObservedLink::owned),
            Step::DeleteAddress(a) => observed.addresses.iter().any(|o| {
                Some(o.index) == index_of(&a.link) && o.net == a.net && o.protocol == NK_PROTOCOL
            }),
            Step::DeleteRoute(r) => observed.routes.iter().any(|o| {
                o.table == r.table && o.destination == r.destination && o.protocol == NK_PROTOCOL
            }),
            Step::DeleteRule(r) => observed.rules.iter().any(|o| {
                o.priority == r.priority && o.table == r.table && o.protocol == NK_PROTOCOL
            }),
            Step::SetLink { link, .. } => named(link),
            Step::CreateLink(_) | Step::AddAddress(_) | Step::AddRoute(_) | Step::AddRule(_) => {
                true
            }
        };
        assert!(
            ok,
            "the plan touches an object nodekeeper does not own or was not asked for: {step:?}\nobserved: {observed:?}"
        );
    }
    let after = match nodekeeper_netconf::plan::simulate(observed.clone(), &plan) {
        Ok(after) => after,
        Err(problem) => panic!("{problem}\nplan: {plan:?}\nobserved: {observed:?}"),
    };
    // Deleting a link takes its VLANs and macvlans along: no link nodekeeper does not own may
    // go that way either.
    for o in observed.links.iter().filter(|o| !o.owned()) {
        assert!(
            after.links.iter().any(|a| a.index == o.index),
            "applying the plan removes {}, which nodekeeper does not own\nplan: {plan:?}\nobserved: {observed:?}",
            o.name
        );
    }
    match nodekeeper_netconf::plan(desired, &after) {
        Ok(again) => assert_eq!(
            again,
            Plan::default(),
            "re-planning after the plan was applied is not empty\nfirst plan: {plan:?}\nafter: {after:?}"
        ),
        Err(error) => panic!("re-planning after the plan was applied fails: {error}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The agent's gRPC requests, as protobuf bytes: SetRules through the service, RunProbes through
// its validation (running the probes would send traffic; the request check is what matters).

pub const AGENT: Target = Target {
    name: "agent",
    run: agent,
    seeds: agent_seeds,
    dictionary: &[
        "net.core.somaxconn",
        "0.0.0.0/0",
        "169.254.169.254/32",
        "10.0.0.0/8",
        "::/0",
        "http://10.0.0.1/",
    ],
    max_len: 8 << 10,
};

fn agent_seeds() -> Vec<Vec<u8>> {
    use prost::Message as _;
    let rules = pb::SetRulesRequest {
        revision: 42,
        rules: vec![pb::TunableRule {
            name: "backlog".into(),
            key: "net.core.somaxconn".into(),
            comparison: 2,
            values: vec!["4096".into()],
            repair: false,
            repair_max_per_hour: 1,
            severity: 2,
        }],
        ..Default::default()
    };
    let probes = pb::RunProbesRequest {
        kind: 2,
        targets: vec![
            pb::ProbeTarget {
                id: "a".into(),
                address: "10.0.0.2".into(),
                port: 443,
                ..Default::default()
            },
            pb::ProbeTarget {
                id: "m".into(),
                address: "169.254.169.254".into(),
                port: 80,
                ..Default::default()
            },
        ],
        count: 3,
        interval_ms: 100,
        timeout_ms: 1000,
        allowed_cidrs: vec!["10.0.0.0/8".into(), "169.254.169.254/32".into()],
        ..Default::default()
    };
    let mut a = vec![0];
    a.extend(rules.encode_to_vec());
    let mut b = vec![1];
    b.extend(probes.encode_to_vec());
    vec![a, b]
}

fn agent(input: &[u8]) {
    use prost::Message as _;
    let Some((which, body)) = input.split_first() else {
        return;
    };
    if which % 2 == 0 {
        let Ok(request) = pb::SetRulesRequest::decode(body) else {
            return;
        };
        let revision = request.revision;
        agent_harness(|h| match h.set_rules(request) {
            Ok(active) => assert!(
                active == revision && active != 0,
                "took {revision} as {active}"
            ),
            Err(status) => assert!(
                matches!(
                    status.code(),
                    tonic::Code::InvalidArgument | tonic::Code::Internal
                ) && !status.message().is_empty(),
                "a refused SetRules must be INVALID_ARGUMENT with a message: {status:?}"
            ),
        });
    } else {
        let Ok(request) = pb::RunProbesRequest::decode(body) else {
            return;
        };
        let Ok(plan) = nodekeeper_agent::probes::validate::plan(&request) else {
            return;
        };
        let allowed: Vec<Cidr> = request
            .allowed_cidrs
            .iter()
            .filter_map(|c| nodekeeper_model::address_policy::parse_list(c).ok())
            .flatten()
            .collect();
        use nodekeeper_agent::probes::validate::Target as T;
        for target in &plan.targets {
            let ip = match target {
                T::Icmp { addr, .. } | T::PathMtu { addr, .. } => Some(*addr),
                T::Tcp { addr, .. } => Some(addr.ip()),
                T::Dns { resolver, .. } => resolver.map(|r| r.ip()),
                T::Http { url, .. } => url
                    .host()
                    .and_then(|h| h.trim_matches(['[', ']']).parse().ok()),
            };
            if let Some(ip) = ip {
                assert!(
                    agent_permits(&allowed, ip),
                    "the agent accepted {target:?} outside the policy it was sent ({allowed:?})"
                );
            }
        }
    }
}

/// A real agent (the agent crate's `AgentService`) on a private sysctl tree, kept per thread.
struct AgentHarness {
    runtime: tokio::runtime::Runtime,
    service: nodekeeper_agent::service::AgentService,
    sysctl_root: PathBuf,
    _dir: tempfile::TempDir,
}

impl AgentHarness {
    fn new() -> Self {
        use clap::Parser as _;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let sysctl_root = dir.path().join("sysctl");
        std::fs::create_dir_all(&sysctl_root).expect("create the sysctl root");
        let p = |name: &str| dir.path().join(name).display().to_string();
        let config = nodekeeper_agent::Config::try_parse_from([
            "nodekeeper-agent".to_owned(),
            "--listen=127.0.0.1:0".to_owned(),
            "--node-name=fuzz".to_owned(),
            format!("--tls-cert={}", p("tls.crt")),
            format!("--tls-key={}", p("tls.key")),
            format!("--client-ca={}", p("ca.crt")),
            format!("--state-dir={}", p("state")),
            format!("--sysctl-root={}", sysctl_root.display()),
            format!("--proc-root={}", p("proc")),
        ])
        .expect("agent flags");
        let agent = std::sync::Arc::new(nodekeeper_agent::agent::Agent::new(&config));
        Self {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime"),
            service: nodekeeper_agent::service::AgentService::new(agent),
            sysctl_root,
            _dir: dir,
        }
    }

    /// Gives this node sysctl `key`; false when the tree cannot hold it (a group here).
    fn add_sysctl(&self, key: &str) -> bool {
        let path = key
            .split('.')
            .fold(self.sysctl_root.clone(), |p, part| p.join(part));
        if path.is_file() {
            return true;
        }
        path.parent()
            .is_some_and(|parent| std::fs::create_dir_all(parent).is_ok())
            && std::fs::write(&path, "0\n").is_ok()
    }

    fn set_rules(&self, request: pb::SetRulesRequest) -> Result<u64, tonic::Status> {
        use pb::node_agent_server::NodeAgent as _;
        self.runtime
            .block_on(self.service.set_rules(tonic::Request::new(request)))
            .map(|r| r.into_inner().active_revision)
    }
}

fn agent_harness(f: impl FnOnce(&AgentHarness)) {
    thread_local! {
        static HARNESS: AgentHarness = AgentHarness::new();
    }
    HARNESS.with(f);
}
