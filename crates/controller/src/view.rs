//! The controller's own copy of a node report: plain data, serialisable as the HTTP API's JSON,
//! converted from the gRPC message in exactly one place ([`NodeView::from_proto`]) where a
//! malformed reply is refused rather than half-used.

use nodekeeper_proto::agent::v1 as pb;
use serde::Serialize;

/// How an indicator, tunable, GPU or plugin compares with the rules.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Not evaluated; never treated as healthy.
    #[default]
    Unspecified,
    Ok,
    Warning,
    Critical,
}

impl Verdict {
    fn from_i32(value: i32) -> Verdict {
        match pb::Verdict::try_from(value) {
            Ok(pb::Verdict::Ok) => Verdict::Ok,
            Ok(pb::Verdict::Warning) => Verdict::Warning,
            Ok(pb::Verdict::Critical) => Verdict::Critical,
            // Unknown future values are "not evaluated", the safe reading.
            _ => Verdict::Unspecified,
        }
    }

    fn to_i32(self) -> i32 {
        match self {
            Verdict::Unspecified => pb::Verdict::Unspecified as i32,
            Verdict::Ok => pb::Verdict::Ok as i32,
            Verdict::Warning => pb::Verdict::Warning as i32,
            Verdict::Critical => pb::Verdict::Critical as i32,
        }
    }

    pub fn word(self) -> &'static str {
        match self {
            Verdict::Unspecified => "not evaluated",
            Verdict::Ok => "ok",
            Verdict::Warning => "warning",
            Verdict::Critical => "critical",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IndicatorView {
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TunableView {
    pub rule: String,
    pub key: String,
    pub current: String,
    pub verdict: Verdict,
    pub expected: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub previous: String,
    #[serde(skip_serializing_if = "is_zero")]
    pub repaired_at_unix_ms: i64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub conflict: bool,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InterfaceView {
    pub name: String,
    pub index: u32,
    pub mac: String,
    pub mtu: u32,
    pub up: bool,
    pub oper_state: String,
    pub kind: String,
    pub addresses: Vec<String>,
    pub managed: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuView {
    pub present: bool,
    pub source: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
    pub gpus: Vec<GpuInfo>,
    /// `--expected-gpus` on the agent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<u32>,
    /// The agent's verdict over all GPUs: the worst GPU's, or Critical when fewer GPUs than
    /// expected were found (which no single GPU's verdict can say).
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub temperature_c: f64,
    pub utilization_percent: f64,
    pub ecc_uncorrected: u64,
    pub xid_events: u64,
    pub verdict: Verdict,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginView {
    pub name: String,
    pub state: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    pub verdict: Verdict,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SystemView {
    pub kernel_release: String,
    pub boot_id: String,
    pub booted_at_unix: i64,
    pub cpus: u32,
    pub memory_total_bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkView {
    pub applied_generation: String,
    pub drifted: bool,
    pub drift: Vec<String>,
    pub reconverged_at_unix_ms: i64,
    pub last_error: String,
}

/// A permanent node problem as the agent's node-problem-detector monitors report it
/// (problem polarity: `True` means the problem is present).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProblemConditionView {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    pub source: String,
    pub transition_unix_ms: i64,
}

/// A temporary node problem (NPD sends these as Events).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProblemEventView {
    pub source: String,
    pub reason: String,
    pub message: String,
    pub timestamp_unix_ms: i64,
    /// The order the agent recorded it in within `ProblemsView::sequence_epoch`; 0 from an
    /// agent that does not number its problems.
    pub sequence: u64,
}

/// What the agent's node-problem-detector-compatible monitors found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProblemsView {
    pub conditions: Vec<ProblemConditionView>,
    /// Problems since the agent started, by reason.
    pub counts: Vec<(String, u64)>,
    /// The latest temporary problems, oldest first.
    pub recent: Vec<ProblemEventView>,
    /// Rule files, rules and plugins that do not run: (origin, item, reason).
    pub refused: Vec<(String, String, String)>,
    pub refused_dropped: u64,
    pub lost_records: u64,
    /// Which agent process numbered `recent` (a new one after each agent restart); 0 from an
    /// agent that does not number its problems.
    pub sequence_epoch: u64,
}

/// One node's report as the controller keeps it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    pub node_name: String,
    pub agent_version: String,
    pub revision: u64,
    pub collected_at_unix_ms: i64,
    pub indicators: Vec<IndicatorView>,
    pub tunables: Vec<TunableView>,
    pub rules_revision: u64,
    pub interfaces: Vec<InterfaceView>,
    /// Pods' host-side links, counted by the agent and left out of `interfaces`.
    pub pod_links: u32,
    pub gpu: GpuView,
    pub plugins: Vec<PluginView>,
    pub collector_errors: Vec<(String, String)>,
    pub system: SystemView,
    pub network: NetworkView,
    pub problems: ProblemsView,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// Why a reply cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidReport {
    #[error("reply has neither a report nor `unchanged`")]
    Empty,
    #[error("reply says `unchanged` but the controller holds no report for revision {0}")]
    UnchangedWithoutCopy(u64),
    #[error(
        "report is for node {reported:?}, not {expected:?}: the agent at this address belongs to another node"
    )]
    WrongNode { expected: String, reported: String },
    #[error("report revision is 0, which the contract reserves for \"none\"")]
    ZeroRevision,
}

impl NodeView {
    /// Converts a reply for node `expected`. `cached` is the copy the controller already holds
    /// (for the `unchanged` variant). Returns `None` when `cached` is still current.
    pub fn from_reply(
        expected: &str,
        reply: pb::GetReportResponse,
        cached_revision: Option<u64>,
    ) -> Result<Option<NodeView>, InvalidReport> {
        if reply.revision == 0 {
            return Err(InvalidReport::ZeroRevision);
        }
        match reply.result {
            None => Err(InvalidReport::Empty),
            Some(pb::get_report_response::Result::Unchanged(_)) => {
                if cached_revision == Some(reply.revision) {
                    Ok(None)
                } else {
                    Err(InvalidReport::UnchangedWithoutCopy(reply.revision))
                }
            }
            Some(pb::get_report_response::Result::Report(report)) => {
                if report.node_name != expected {
                    return Err(InvalidReport::WrongNode {
                        expected: expected.to_owned(),
                        reported: report.node_name,
                    });
                }
                Ok(Some(NodeView::from_proto(reply.revision, report)))
            }
        }
    }

    /// The one conversion from the gRPC message.
    pub fn from_proto(revision: u64, r: pb::NodeReport) -> NodeView {
        let gpu = r.gpu.unwrap_or_default();
        let system = r.system.unwrap_or_default();
        let network = r.network.unwrap_or_default();
        let problems = r.problems.unwrap_or_default();
        NodeView {
            node_name: r.node_name,
            agent_version: r.agent_version,
            revision,
            collected_at_unix_ms: r.collected_at_unix_ms,
            indicators: r
                .indicators
                .into_iter()
                .map(|i| IndicatorView {
                    verdict: Verdict::from_i32(i.verdict),
                    name: i.name,
                    value: i.value,
                    unit: i.unit,
                    message: i.message,
                })
                .collect(),
            tunables: r
                .tunables
                .into_iter()
                .map(|t| TunableView {
                    verdict: Verdict::from_i32(t.verdict),
                    rule: t.rule,
                    key: t.key,
                    current: t.current,
                    expected: t.expected,
                    previous: t.previous,
                    repaired_at_unix_ms: t.repaired_at_unix_ms,
                    conflict: t.conflict,
                    error: t.error,
                })
                .collect(),
            rules_revision: r.rules_revision,
            interfaces: r
                .interfaces
                .into_iter()
                .map(|i| InterfaceView {
                    name: i.name,
                    index: i.index,
                    mac: i.mac,
                    mtu: i.mtu,
                    up: i.up,
                    oper_state: i.oper_state,
                    kind: i.kind,
                    addresses: i.addresses,
                    managed: i.managed,
                })
                .collect(),
            pod_links: r.pod_links,
            gpu: GpuView {
                present: gpu.present,
                source: gpu.source,
                error: gpu.error,
                gpus: gpu
                    .gpus
                    .into_iter()
                    .map(|g| GpuInfo {
                        verdict: Verdict::from_i32(g.verdict),
                        index: g.index,
                        uuid: g.uuid,
                        model: g.model,
                        memory_total_mib: g.memory_total_mib,
                        memory_used_mib: g.memory_used_mib,
                        temperature_c: g.temperature_c,
                        utilization_percent: g.utilization_percent,
                        ecc_uncorrected: g.ecc_uncorrected,
                        xid_events: g.xid_events,
                        message: g.message,
                    })
                    .collect(),
                expected: gpu.expected_count,
                verdict: Verdict::from_i32(gpu.verdict),
                message: gpu.message,
            },
            plugins: r
                .plugins
                .into_iter()
                .map(|p| PluginView {
                    verdict: Verdict::from_i32(p.verdict),
                    name: p.name,
                    state: p.state,
                    message: p.message,
                })
                .collect(),
            collector_errors: r
                .collector_errors
                .into_iter()
                .map(|e| (e.collector, e.error))
                .collect(),
            system: SystemView {
                kernel_release: system.kernel_release,
                boot_id: system.boot_id,
                booted_at_unix: system.booted_at_unix,
                cpus: system.cpus,
                memory_total_bytes: system.memory_total_bytes,
            },
            network: NetworkView {
                applied_generation: network.applied_generation,
                drifted: network.drifted,
                drift: network.drift,
                reconverged_at_unix_ms: network.reconverged_at_unix_ms,
                last_error: network.last_error,
            },
            problems: ProblemsView {
                conditions: problems
                    .conditions
                    .into_iter()
                    .map(|c| ProblemConditionView {
                        type_: c.r#type,
                        status: c.status,
                        reason: c.reason,
                        message: c.message,
                        source: c.source,
                        transition_unix_ms: c.transition_unix_ms,
                    })
                    .collect(),
                counts: problems
                    .counts
                    .into_iter()
                    .map(|c| (c.reason, c.count))
                    .collect(),
                recent: problems
                    .recent
                    .into_iter()
                    .map(|e| ProblemEventView {
                        source: e.source,
                        reason: e.reason,
                        message: e.message,
                        timestamp_unix_ms: e.timestamp_unix_ms,
                        sequence: e.sequence,
                    })
                    .collect(),
                refused: problems
                    .refused
                    .into_iter()
                    .map(|r| (r.origin, r.item, r.reason))
                    .collect(),
                refused_dropped: problems.refused_dropped,
                lost_records: problems.lost_records,
                sequence_epoch: problems.sequence_epoch,
            },
        }
    }
}

/// A report as the fleet keeps it between reads: the encoded gRPC message, decoded into a
/// [`NodeView`] when something reads it (a condition check, the HTTP API). The fleet holds one
/// per node for the whole life of the process; decoded, every string of it is an allocation of
/// its own, and at 1,000 simulated nodes the views were the largest part of the controller's
/// steady heap (3.5 KiB a node, heaptrack); encoded, the same report is a few hundred bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredReport {
    pub revision: u64,
    pub rules_revision: u64,
    encoded: Box<[u8]>,
    /// The rules of the tunables out of bounds (Warning or Critical), for the fleet summary,
    /// which would otherwise decode every node's report while it holds the fleet's lock (at
    /// 65,000 nodes that stalled the sweep; issue #18). Usually empty, which allocates nothing.
    flagged_tunables: Box<[String]>,
}

impl StoredReport {
    pub fn of(view: &NodeView) -> Self {
        use prost::Message as _;
        Self {
            revision: view.revision,
            rules_revision: view.rules_revision,
            encoded: view.to_proto().encode_to_vec().into_boxed_slice(),
            flagged_tunables: view
                .tunables
                .iter()
                .filter(|t| matches!(t.verdict, Verdict::Warning | Verdict::Critical))
                .map(|t| t.rule.clone())
                .collect(),
        }
    }

    /// The rules of this report's tunables out of bounds (Warning or Critical).
    pub fn flagged_tunables(&self) -> &[String] {
        &self.flagged_tunables
    }

    /// The view again, equal to the one stored.
    pub fn view(&self) -> NodeView {
        use prost::Message as _;
        // These bytes were encoded by `of` from a well-formed message; decoding them cannot fail
        // short of memory corruption.
        let report = pb::NodeReport::decode(&*self.encoded)
            .expect("a report encoded by StoredReport::of decodes");
        NodeView::from_proto(self.revision, report)
    }

    /// Bytes held for the report.
    pub fn encoded_len(&self) -> usize {
        self.encoded.len()
    }
}

impl NodeView {
    /// The gRPC message this view converts from ([`NodeView::from_proto`] of it gives the view
    /// back); the revision travels beside it.
    pub fn to_proto(&self) -> pb::NodeReport {
        let v = self;
        pb::NodeReport {
            node_name: v.node_name.clone(),
            agent_version: v.agent_version.clone(),
            collected_at_unix_ms: v.collected_at_unix_ms,
            indicators: v
                .indicators
                .iter()
                .map(|i| pb::Indicator {
                    name: i.name.clone(),
                    value: i.value,
                    unit: i.unit.clone(),
                    verdict: i.verdict.to_i32(),
                    message: i.message.clone(),
                })
                .collect(),
            tunables: v
                .tunables
                .iter()
                .map(|t| pb::TunableStatus {
                    rule: t.rule.clone(),
                    key: t.key.clone(),
                    current: t.current.clone(),
                    verdict: t.verdict.to_i32(),
                    expected: t.expected.clone(),
                    previous: t.previous.clone(),
                    repaired_at_unix_ms: t.repaired_at_unix_ms,
                    conflict: t.conflict,
                    error: t.error.clone(),
                })
                .collect(),
            rules_revision: v.rules_revision,
            interfaces: v
                .interfaces
                .iter()
                .map(|i| pb::ObservedInterface {
                    name: i.name.clone(),
                    index: i.index,
                    mac: i.mac.clone(),
                    mtu: i.mtu,
                    up: i.up,
                    oper_state: i.oper_state.clone(),
                    kind: i.kind.clone(),
                    addresses: i.addresses.clone(),
                    managed: i.managed,
                })
                .collect(),
            pod_links: v.pod_links,
            gpu: Some(pb::GpuState {
                present: v.gpu.present,
                source: v.gpu.source.clone(),
                error: v.gpu.error.clone(),
                gpus: v
                    .gpu
                    .gpus
                    .iter()
                    .map(|g| pb::Gpu {
                        index: g.index,
                        uuid: g.uuid.clone(),
                        model: g.model.clone(),
                        memory_total_mib: g.memory_total_mib,
                        memory_used_mib: g.memory_used_mib,
                        temperature_c: g.temperature_c,
                        utilization_percent: g.utilization_percent,
                        ecc_uncorrected: g.ecc_uncorrected,
                        xid_events: g.xid_events,
                        verdict: g.verdict.to_i32(),
                        message: g.message.clone(),
                        ..Default::default()
                    })
                    .collect(),
                expected_count: v.gpu.expected,
                verdict: v.gpu.verdict.to_i32(),
                message: v.gpu.message.clone(),
            }),
            plugins: v
                .plugins
                .iter()
                .map(|p| pb::PluginState {
                    name: p.name.clone(),
                    state: p.state.clone(),
                    message: p.message.clone(),
                    verdict: p.verdict.to_i32(),
                    ..Default::default()
                })
                .collect(),
            collector_errors: v
                .collector_errors
                .iter()
                .map(|(collector, error)| pb::CollectorError {
                    collector: collector.clone(),
                    error: error.clone(),
                })
                .collect(),
            system: Some(pb::SystemInfo {
                kernel_release: v.system.kernel_release.clone(),
                boot_id: v.system.boot_id.clone(),
                booted_at_unix: v.system.booted_at_unix,
                cpus: v.system.cpus,
                memory_total_bytes: v.system.memory_total_bytes,
            }),
            network: Some(pb::NetworkStatus {
                applied_generation: v.network.applied_generation.clone(),
                drifted: v.network.drifted,
                drift: v.network.drift.clone(),
                reconverged_at_unix_ms: v.network.reconverged_at_unix_ms,
                last_error: v.network.last_error.clone(),
            }),
            problems: Some(pb::NodeProblems {
                conditions: v
                    .problems
                    .conditions
                    .iter()
                    .map(|c| pb::ProblemCondition {
                        r#type: c.type_.clone(),
                        status: c.status.clone(),
                        reason: c.reason.clone(),
                        message: c.message.clone(),
                        source: c.source.clone(),
                        transition_unix_ms: c.transition_unix_ms,
                    })
                    .collect(),
                counts: v
                    .problems
                    .counts
                    .iter()
                    .map(|(reason, count)| pb::ProblemCount {
                        reason: reason.clone(),
                        count: *count,
                    })
                    .collect(),
                recent: v
                    .problems
                    .recent
                    .iter()
                    .map(|e| pb::ProblemEvent {
                        source: e.source.clone(),
                        reason: e.reason.clone(),
                        message: e.message.clone(),
                        timestamp_unix_ms: e.timestamp_unix_ms,
                        sequence: e.sequence,
                    })
                    .collect(),
                refused: v
                    .problems
                    .refused
                    .iter()
                    .map(|(origin, item, reason)| pb::MonitorRefusal {
                        origin: origin.clone(),
                        item: item.clone(),
                        reason: reason.clone(),
                    })
                    .collect(),
                refused_dropped: v.problems.refused_dropped,
                lost_records: v.problems.lost_records,
                sequence_epoch: v.problems.sequence_epoch,
            }),
            // What `from_proto` does not keep is left out here too.
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(revision: u64, node: &str) -> pb::GetReportResponse {
        pb::GetReportResponse {
            revision,
            result: Some(pb::get_report_response::Result::Report(pb::NodeReport {
                node_name: node.into(),
                tunables: vec![pb::TunableStatus {
                    rule: "r".into(),
                    verdict: 3,
                    ..Default::default()
                }],
                indicators: vec![pb::Indicator {
                    name: "x".into(),
                    verdict: 42,
                    ..Default::default()
                }],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn converts_a_report_and_reads_unknown_verdicts_as_unspecified() {
        let view = NodeView::from_reply("n1", reply(7, "n1"), None)
            .unwrap()
            .unwrap();
        assert_eq!(view.revision, 7);
        assert_eq!(view.tunables[0].verdict, Verdict::Critical);
        assert_eq!(view.indicators[0].verdict, Verdict::Unspecified);
    }

    #[test]
    fn carries_the_node_problems() {
        let mut r = reply(3, "n1");
        if let Some(pb::get_report_response::Result::Report(report)) = &mut r.result {
            report.problems = full_report().problems;
        }
        let view = NodeView::from_reply("n1", r, None).unwrap().unwrap();
        let p = &view.problems;
        assert_eq!(p.conditions[0].type_, "KernelDeadlock");
        assert_eq!(p.conditions[0].status, "True");
        assert_eq!(p.counts, vec![("OOMKilling".to_string(), 2)]);
        assert_eq!(p.recent[0].timestamp_unix_ms, 8);
        assert_eq!((p.sequence_epoch, p.recent[0].sequence), (9, 3));
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["problems"]["conditions"][0]["type"], "KernelDeadlock");
    }

    #[test]
    fn refuses_a_report_for_another_node() {
        let err = NodeView::from_reply("n1", reply(7, "n2"), None).unwrap_err();
        assert!(matches!(err, InvalidReport::WrongNode { .. }));
        assert!(err.to_string().contains("\"n2\""));
    }

    #[test]
    fn unchanged_needs_a_matching_copy() {
        let unchanged = |rev| pb::GetReportResponse {
            revision: rev,
            result: Some(pb::get_report_response::Result::Unchanged(pb::Unchanged {})),
        };
        assert_eq!(NodeView::from_reply("n1", unchanged(5), Some(5)), Ok(None));
        assert_eq!(
            NodeView::from_reply("n1", unchanged(5), Some(4)),
            Err(InvalidReport::UnchangedWithoutCopy(5))
        );
        assert_eq!(
            NodeView::from_reply("n1", unchanged(0), Some(0)),
            Err(InvalidReport::ZeroRevision)
        );
        let empty = pb::GetReportResponse {
            revision: 3,
            result: None,
        };
        assert_eq!(
            NodeView::from_reply("n1", empty, None),
            Err(InvalidReport::Empty)
        );
    }

    /// Every field the view keeps set to a value of its own, so that a field lost on the way
    /// fails the comparison.
    fn full_report() -> pb::NodeReport {
        pb::NodeReport {
            node_name: "n1".into(),
            agent_version: "0.1.0".into(),
            collected_at_unix_ms: 1_700_000_000_123,
            indicators: vec![pb::Indicator {
                name: "conntrack".into(),
                value: 0.5,
                unit: "ratio".into(),
                verdict: pb::Verdict::Warning as i32,
                message: "half full".into(),
            }],
            tunables: vec![pb::TunableStatus {
                rule: "somaxconn".into(),
                key: "net.core.somaxconn".into(),
                current: "4096".into(),
                verdict: pb::Verdict::Critical as i32,
                expected: ">= 8192".into(),
                previous: "128".into(),
                repaired_at_unix_ms: 17,
                conflict: true,
                error: "read-only".into(),
            }],
            rules_revision: 9,
            interfaces: vec![pb::ObservedInterface {
                name: "vnic1".into(),
                index: 4,
                mac: "02:00:17:00:00:01".into(),
                mtu: 9000,
                up: true,
                oper_state: "up".into(),
                kind: "macvlan".into(),
                addresses: vec!["10.0.1.5/24".into()],
                managed: true,
            }],
            pod_links: 37,
            gpu: Some(pb::GpuState {
                present: true,
                source: "nvidia-smi".into(),
                error: "partial".into(),
                gpus: vec![pb::Gpu {
                    index: 1,
                    uuid: "GPU-1".into(),
                    model: "H100".into(),
                    memory_total_mib: 81559,
                    memory_used_mib: 12,
                    temperature_c: 31.5,
                    utilization_percent: 2.5,
                    ecc_uncorrected: 3,
                    xid_events: 4,
                    verdict: pb::Verdict::Ok as i32,
                    message: "fine".into(),
                    ..Default::default()
                }],
                expected_count: Some(8),
                verdict: pb::Verdict::Critical as i32,
                message: "expected 8 GPUs, found 1".into(),
            }),
            plugins: vec![pb::PluginState {
                name: "Compute Instance Monitoring".into(),
                state: "RUNNING".into(),
                message: "m".into(),
                verdict: pb::Verdict::Ok as i32,
                ..Default::default()
            }],
            collector_errors: vec![pb::CollectorError {
                collector: "gpu".into(),
                error: "timeout".into(),
            }],
            system: Some(pb::SystemInfo {
                kernel_release: "6.1.0".into(),
                boot_id: "b".into(),
                booted_at_unix: 5,
                cpus: 192,
                memory_total_bytes: 1 << 40,
            }),
            network: Some(pb::NetworkStatus {
                applied_generation: "uid/3".into(),
                drifted: true,
                drift: vec!["route 0.0.0.0/0 table 100".into()],
                reconverged_at_unix_ms: 6,
                last_error: "e".into(),
            }),
            problems: Some(pb::NodeProblems {
                conditions: vec![pb::ProblemCondition {
                    r#type: "KernelDeadlock".into(),
                    status: "True".into(),
                    reason: "DockerHung".into(),
                    message: "task hung".into(),
                    source: "kernel-monitor".into(),
                    transition_unix_ms: 7,
                }],
                counts: vec![pb::ProblemCount {
                    reason: "OOMKilling".into(),
                    count: 2,
                }],
                recent: vec![pb::ProblemEvent {
                    source: "kernel-monitor".into(),
                    reason: "OOMKilling".into(),
                    message: "killed".into(),
                    timestamp_unix_ms: 8,
                    sequence: 3,
                }],
                refused: vec![pb::MonitorRefusal {
                    origin: "custom".into(),
                    item: "rule 1".into(),
                    reason: "bad regex".into(),
                }],
                refused_dropped: 1,
                lost_records: 2,
                sequence_epoch: 9,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_stored_report_gives_back_the_view_it_stored_in_fewer_bytes() {
        let view = NodeView::from_proto(12, full_report());
        // The verdict over all GPUs is kept: it alone says that GPUs are missing.
        assert_eq!(
            (
                view.gpu.verdict,
                view.gpu.expected,
                view.gpu.message.as_str()
            ),
            (Verdict::Critical, Some(8), "expected 8 GPUs, found 1")
        );
        let stored = StoredReport::of(&view);
        assert_eq!(stored.view(), view);
        assert_eq!((stored.revision, stored.rules_revision), (12, 9));
        // Every list holds one item and every string is short: the encoding is the strings
        // plus a few bytes of framing each, where the view spends a heap block per string.
        assert!(
            stored.encoded_len() < 1024,
            "{} bytes",
            stored.encoded_len()
        );
        // A field the view does not keep is not needed to give it back.
        let mut report = full_report();
        report.oca_version = "1.40".into();
        assert_eq!(
            StoredReport::of(&NodeView::from_proto(12, report)).view(),
            view
        );
    }
}
