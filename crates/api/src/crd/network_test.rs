//! `NetworkTest`: an on-demand network test run from the nodes a selector picks, and its
//! aggregated result.

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, LabelSelector, MAX_LISTED, conditions_schema};

// The limits are the model's, so the schema, the controller and the agent agree.
use nodekeeper_model::probe::{MAX_COUNT, MAX_INTERVAL_MS, MAX_MTU, MAX_TIMEOUT_MS, MIN_MTU_V4};
pub use nodekeeper_model::probe::{MAX_PEERS_PER_NODE, MAX_SOURCE_NODES, MAX_TARGETS};

/// Asks the nodes a selector picks to probe targets (addresses, names, URLs, the API server, the
/// metadata service, or each other) and reports aggregated latency, loss and the worst failures.
/// A NetworkTest is one run: its spec cannot change; create a new one to test again.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NetworkTest",
    plural = "networktests",
    singular = "networktest",
    shortname = "nt",
    category = "nodekeeper",
    namespaced,
    status = "NetworkTestStatus",
    derive = "PartialEq",
    doc = "An on-demand network test run from selected nodes, with its aggregated result.",
    printcolumn(name = "Kind", type_ = "string", json_path = ".spec.kind"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".status.sources"),
    printcolumn(
        name = "Success",
        type_ = "number",
        json_path = ".status.successPercent",
        description = "Succeeded source→target pairs, in percent"
    ),
    printcolumn(
        name = "P95us",
        type_ = "integer",
        json_path = ".status.latency.p95Us",
        description = "95th percentile latency of successful probes, in microseconds"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self == oldSelf",
        "message": "spec is immutable: a NetworkTest is one run; create a new NetworkTest to test again"
    },
    {
        "rule": "self.kind == 'tcp' || self.targets.all(t, !has(t.hostPort))",
        "message": "spec.targets: hostPort targets are for kind tcp; write the target as address or hostname"
    },
    {
        "rule": "self.kind == 'http' || self.targets.all(t, !has(t.url))",
        "message": "spec.targets: url targets are for kind http; write the target as address or hostname"
    },
    {
        "rule": "self.kind != 'http' || self.targets.all(t, has(t.url) || has(t.apiServer) || has(t.metadataService))",
        "message": "spec.targets: kind http takes url, apiServer or metadataService targets"
    },
    {
        "rule": "self.kind != 'dns' || self.targets.all(t, has(t.hostname))",
        "message": "spec.targets: kind dns takes hostname targets; give the resolver in spec.resolver"
    },
    {
        "rule": "self.targets.filter(t, has(t.peers)).size() <= 1",
        "message": "spec.targets: give peers at most once"
    },
    {
        "rule": "self.kind != 'tcp' || has(self.port) || self.targets.all(t, !has(t.address) && !has(t.hostname) && !has(t.peers))",
        "message": "spec.port: kind tcp needs spec.port for address, hostname and peers targets (or write each target as hostPort)"
    },
    {
        "rule": "self.kind == 'dns' || !has(self.resolver)",
        "message": "spec.resolver is only for kind dns; remove it"
    },
    {
        "rule": "self.kind == 'http' || !has(self.expectedStatus) || size(self.expectedStatus) == 0",
        "message": "spec.expectedStatus is only for kind http; remove it"
    },
    {
        "rule": "self.kind == 'pathMtu' || !has(self.maxMtu)",
        "message": "spec.maxMtu is only for kind pathMtu; remove it"
    }
]))]
pub struct NetworkTestSpec {
    /// The nodes that run the probes (an empty selector picks every node), at most `maxNodes`
    /// of them, chosen deterministically.
    #[serde(default)]
    pub node_selector: LabelSelector,
    /// The most nodes that run the probes.
    #[serde(default = "default_max_nodes")]
    #[schemars(range(min = 1, max = MAX_SOURCE_NODES))]
    pub max_nodes: u32,
    /// The probe: `icmp` (echo), `tcp` (connect), `dns` (A/AAAA query), `http` (GET of a URL), or
    /// `pathMtu` (largest packet that passes with don't-fragment set).
    pub kind: ProbeKind,
    /// What to probe. Each entry names exactly one target.
    #[schemars(length(min = 1, max = MAX_TARGETS))]
    pub targets: Vec<Target>,
    /// Probes sent to each target from each node.
    #[serde(default = "default_count")]
    #[schemars(range(min = 1, max = MAX_COUNT))]
    pub count: u32,
    /// Pause between two probes to one target, in milliseconds.
    #[serde(default = "default_interval_ms")]
    #[schemars(range(min = 1, max = MAX_INTERVAL_MS))]
    pub interval_ms: u32,
    /// Timeout of each probe, in milliseconds.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 1, max = MAX_TIMEOUT_MS))]
    pub timeout_ms: u32,
    /// For `tcp`: the port of `address`, `hostname`, `peers` and `metadataService` targets
    /// (`hostPort` targets carry their own; `apiServer` always uses the API server's own port and
    /// ignores this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u32>,
    /// For `dns`: the resolver's IP address. Unset means each node's own resolver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 45), extend("x-kubernetes-validations" = [
        {"rule": "isIP(self)", "message": "spec.resolver must be an IPv4 or IPv6 address"}
    ]))]
    pub resolver: Option<String>,
    /// For `http`: the status codes that count as success. Empty means 200–399.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(range(min = 100, max = 599)))]
    pub expected_status: Vec<u32>,
    /// For `pathMtu`: the largest packet size tried, in bytes. Unset means 9000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MIN_MTU_V4, max = MAX_MTU))]
    pub max_mtu: Option<u32>,
    /// Seconds after the test finishes before the controller deletes it. 0 deletes it as soon as
    /// it finishes.
    #[serde(default = "default_ttl")]
    #[schemars(range(min = 0, max = 604800))]
    pub ttl_seconds_after_finished: u32,
}

fn default_max_nodes() -> u32 {
    100
}
fn default_count() -> u32 {
    3
}
fn default_interval_ms() -> u32 {
    200
}
fn default_timeout_ms() -> u32 {
    1000
}
fn default_ttl() -> u32 {
    3600
}

/// The probe kind.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ProbeKind {
    /// ICMP echo.
    Icmp,
    /// TCP connect; latency is the connect time.
    Tcp,
    /// A DNS A/AAAA query for each hostname target.
    Dns,
    /// An HTTP(S) GET of each URL target.
    Http,
    /// Path-MTU discovery.
    PathMtu,
}

impl ProbeKind {
    /// The spelling used in the resource (`icmp`, `tcp`, `dns`, `http`, `pathMtu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Icmp => "icmp",
            Self::Tcp => "tcp",
            Self::Dns => "dns",
            Self::Http => "http",
            Self::PathMtu => "pathMtu",
        }
    }
}

/// One probe target: exactly one of the fields.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "[has(self.address), has(self.hostPort), has(self.hostname), has(self.url), has(self.apiServer), has(self.metadataService), has(self.peers)].exists_one(x, x)",
        "message": "spec.targets[]: set exactly one of address, hostPort, hostname, url, apiServer, metadataService, peers"
    },
    {
        "rule": "(!has(self.apiServer) || self.apiServer) && (!has(self.metadataService) || self.metadataService)",
        "message": "spec.targets[]: apiServer and metadataService may only be true; leave them out instead of false"
    }
]))]
pub struct Target {
    /// An IPv4 or IPv6 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 45), extend("x-kubernetes-validations" = [
        {"rule": "isIP(self)", "message": "spec.targets[].address must be an IPv4 or IPv6 address (write names as hostname)"}
    ]))]
    pub address: Option<String>,
    /// `host:port` for `tcp`, where host is an address or a DNS name (IPv6 as `[address]:port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 261),
        regex(
            pattern = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?):[0-9]{1,5}$"
        )
    )]
    pub host_port: Option<String>,
    /// A DNS name: queried for `dns`; resolved by the controller and probed for the other kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = nodekeeper_model::probe::MAX_HOSTNAME_LEN),
        regex(
            pattern = r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*\.?$"
        )
    )]
    pub hostname: Option<String>,
    /// An `http://` or `https://` URL, for `http`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = nodekeeper_model::probe::MAX_URL_LEN), extend("x-kubernetes-validations" = [
        {"rule": "isURL(self) && url(self).getScheme() in ['http', 'https']", "message": "spec.targets[].url must be an absolute http:// or https:// URL"}
    ]))]
    pub url: Option<String>,
    /// `true`: the Kubernetes API server, at the address the controller is configured with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_server: Option<bool>,
    /// `true`: the instance metadata service, at the address the controller is configured with.
    /// Never probed unless a target asks for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_service: Option<bool>,
    /// Other nodes of the test: each node probes up to `perNode` of them (`icmp`, `tcp`, `pathMtu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<Peers>,
}

/// Node-to-node probing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Peers {
    /// How many other nodes each node probes.
    #[serde(default = "default_per_node")]
    #[schemars(range(min = 1, max = MAX_PEERS_PER_NODE))]
    pub per_node: u32,
}

fn default_per_node() -> u32 {
    3
}

/// Where a test is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Accepted, not started (or waiting for nodes).
    Pending,
    /// Probes are running.
    Running,
    /// Every probed pair succeeded.
    Succeeded,
    /// The spec was invalid, or some pair failed (see `worstFailures`).
    Failed,
}

/// Latency figures of the successful probes, in microseconds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Latency {
    /// Median, in microseconds.
    pub p50_us: u32,
    /// 95th percentile, in microseconds.
    pub p95_us: u32,
    /// Maximum, in microseconds.
    pub max_us: u32,
}

/// Results toward one target, over all source nodes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetSummary {
    /// The target as the spec names it (`10.0.0.1`, `https://…`, `apiServer`, `peers`).
    #[schemars(length(max = 2048))]
    pub target: String,
    /// Source→target pairs probed.
    pub pairs: u32,
    /// Pairs where some probe failed.
    pub pairs_failed: u32,
    /// Lost probes over sent probes, in percent.
    pub loss_percent: f64,
    /// Latency of the successful probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<Latency>,
    /// `pathMtu`: the smallest path MTU found, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_mtu_min: Option<u32>,
}

/// One failing source→target pair.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PairFailure {
    /// The source node's name.
    #[schemars(length(max = 253))]
    pub source: String,
    /// The target as the spec names it (for peers, `node/<name>`).
    #[schemars(length(max = 2048))]
    pub target: String,
    /// The last error seen.
    #[schemars(length(max = 1024))]
    pub error: String,
    /// Lost probes over sent probes, in percent.
    pub loss_percent: f64,
}

/// The aggregated result.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkTestStatus {
    /// Pending, Running, Succeeded or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// When probing started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub start_time: Option<String>,
    /// When the test finished (RFC 3339); the TTL counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub completion_time: Option<String>,
    /// Source nodes that ran (or were asked to run) the probes.
    #[serde(default)]
    pub sources: u32,
    /// Source nodes whose agent could not be reached or did not answer.
    #[serde(default)]
    pub sources_unreachable: u32,
    /// Source→target pairs probed.
    #[serde(default)]
    pub pairs: u32,
    /// Pairs where some probe failed.
    #[serde(default)]
    pub pairs_failed: u32,
    /// Succeeded pairs over all pairs, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success_percent: Option<f64>,
    /// Probes sent, over all pairs.
    #[serde(default)]
    pub sent: u64,
    /// Probes answered, over all pairs.
    #[serde(default)]
    pub received: u64,
    /// Lost probes over sent probes, in percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_percent: Option<f64>,
    /// Latency of all successful probes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<Latency>,
    /// `pathMtu`: the smallest path MTU any source found, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_mtu_min: Option<u32>,
    /// Per target, worst first; at most 50 (the rest are counted in `targetsOmitted`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub targets: Vec<TargetSummary>,
    /// Targets not listed in `targets`.
    #[serde(default)]
    pub targets_omitted: u32,
    /// The worst failing pairs (highest loss first); at most 50 (the rest are counted in
    /// `omittedFailures`). Full results: the controller's `/api/networktests/…` endpoint.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub worst_failures: Vec<PairFailure>,
    /// Failing pairs not listed in `worstFailures`.
    #[serde(default)]
    pub omitted_failures: u32,
    /// `SpecValid` and `Complete`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

const _: () = assert!(MAX_LISTED == 50, "the schema's maxItems above say 50");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_spec_gets_documented_defaults() {
        let spec: NetworkTestSpec = serde_json::from_value(serde_json::json!({
            "kind": "icmp",
            "targets": [{"address": "10.0.0.1"}, {"peers": {}}]
        }))
        .unwrap();
        assert_eq!(spec.max_nodes, 100);
        assert_eq!(spec.count, 3);
        assert_eq!(spec.interval_ms, 200);
        assert_eq!(spec.timeout_ms, 1000);
        assert_eq!(spec.ttl_seconds_after_finished, 3600);
        assert_eq!(spec.targets[1].peers, Some(Peers { per_node: 3 }));
        assert_eq!(spec.kind.as_str(), "icmp");
        assert_eq!(spec.node_selector, LabelSelector::default());
    }

    #[test]
    fn spec_and_status_round_trip() {
        let spec: NetworkTestSpec = serde_json::from_value(serde_json::json!({
            "nodeSelector": {"matchLabels": {"pool": "a"}},
            "kind": "http",
            "targets": [{"url": "https://example.invalid/"}, {"apiServer": true}],
            "expectedStatus": [200, 204],
        }))
        .unwrap();
        let mut nt = NetworkTest::new("t", spec);
        nt.status = Some(NetworkTestStatus {
            phase: Some(Phase::Failed),
            sources: 2,
            pairs: 4,
            pairs_failed: 1,
            success_percent: Some(75.0),
            latency: Some(Latency {
                p50_us: 10,
                p95_us: 20,
                max_us: 30,
            }),
            worst_failures: vec![PairFailure {
                source: "n1".into(),
                target: "apiServer".into(),
                error: "connection refused".into(),
                loss_percent: 100.0,
            }],
            ..Default::default()
        });
        let json = serde_json::to_value(&nt).unwrap();
        assert_eq!(json["apiVersion"], "nodekeeper.dev/v1alpha1");
        assert_eq!(json["status"]["latency"]["p95Us"], 20);
        assert_eq!(json["status"]["worstFailures"][0]["lossPercent"], 100.0);
        let back: NetworkTest = serde_json::from_value(json).unwrap();
        assert_eq!(back, nt);
    }

    #[test]
    fn unknown_kind_is_refused_by_serde() {
        let err = serde_json::from_value::<NetworkTestSpec>(serde_json::json!({
            "kind": "udp", "targets": [{"address": "10.0.0.1"}]
        }))
        .unwrap_err();
        assert!(err.to_string().contains("unknown variant `udp`"), "{err}");
    }
}
