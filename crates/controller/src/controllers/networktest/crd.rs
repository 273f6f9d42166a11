//! Conversion between the `NetworkTest` resource (`nodekeeper_api::crd`) and this module's plain
//! data: spec in, status out (and back, to know the current phase).

use nodekeeper_api::crd::common::{Condition as CrdCondition, ConditionStatus};
use nodekeeper_api::crd::network_test::{
    Latency as CrdLatency, NetworkTestSpec, NetworkTestStatus, PairFailure, Phase as CrdPhase,
    TargetSummary as CrdTargetSummary,
};

use super::aggregate::{Latency, Summary};
use super::plan::{SpecError, TargetSpec, TestSpec};
use super::status::{Condition, Phase, TestStatus};

/// The spec as plain data. A target that sets no field or several (which the schema refuses)
/// is an error naming it.
pub fn spec(s: &NetworkTestSpec) -> Result<TestSpec, SpecError> {
    // Checked as the API server will check it when the nodes are listed: a bad key or value is
    // the spec's error, not a list answered 400 and retried for ever.
    nodekeeper_api::crd::common::check_selector("spec.nodeSelector", &s.node_selector).map_err(
        |e| SpecError {
            field: e.field,
            reason: e.message,
        },
    )?;
    let mut targets = Vec::with_capacity(s.targets.len());
    for (i, t) in s.targets.iter().enumerate() {
        let mut set: Vec<TargetSpec> = Vec::new();
        if let Some(a) = &t.address {
            set.push(TargetSpec::Address(a.clone()));
        }
        if let Some(hp) = &t.host_port {
            set.push(TargetSpec::HostPort(hp.clone()));
        }
        if let Some(h) = &t.hostname {
            set.push(TargetSpec::Hostname(h.clone()));
        }
        if let Some(u) = &t.url {
            set.push(TargetSpec::Url(u.clone()));
        }
        if t.api_server == Some(true) {
            set.push(TargetSpec::ApiServer);
        }
        if t.metadata_service == Some(true) {
            set.push(TargetSpec::MetadataService);
        }
        if let Some(p) = &t.peers {
            set.push(TargetSpec::Peers {
                per_node: i64::from(p.per_node),
            });
        }
        if set.len() != 1 {
            return Err(SpecError {
                field: format!("spec.targets[{i}]"),
                reason: "set exactly one of address, hostPort, hostname, url, apiServer, metadataService, peers"
                    .into(),
            });
        }
        targets.extend(set);
    }
    Ok(TestSpec {
        kind: s.kind.as_str().to_owned(),
        targets,
        count: i64::from(s.count),
        interval_ms: i64::from(s.interval_ms),
        timeout_ms: i64::from(s.timeout_ms),
        max_nodes: Some(i64::from(s.max_nodes)),
        port: s.port.map(i64::from),
        resolver: s.resolver.clone(),
        expected_status: s.expected_status.iter().map(|c| i64::from(*c)).collect(),
        max_mtu: s.max_mtu.map(i64::from),
    })
}

fn rfc3339(unix: i64) -> String {
    let t =
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(u64::try_from(unix).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

fn unix(s: &str) -> Option<i64> {
    let t = humantime::parse_rfc3339_weak(s).ok()?;
    t.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs() as i64)
}

fn latency(l: Option<Latency>) -> Option<CrdLatency> {
    l.map(|l| CrdLatency {
        p50_us: l.p50_us,
        p95_us: l.p95_us,
        max_us: l.max_us,
    })
}

/// The status object written to the resource (`summary` is already bounded by the transition).
pub fn status(s: &TestStatus, generation: Option<i64>) -> NetworkTestStatus {
    let phase = match s.phase {
        Phase::Pending => CrdPhase::Pending,
        Phase::Running => CrdPhase::Running,
        Phase::Succeeded => CrdPhase::Succeeded,
        Phase::Failed => CrdPhase::Failed,
    };
    let conditions = s
        .conditions
        .iter()
        .map(|c| CrdCondition {
            type_: c.type_.clone(),
            status: if c.status == "True" {
                ConditionStatus::True
            } else {
                ConditionStatus::False
            },
            reason: c.reason.clone(),
            message: c.message.clone(),
            last_transition_time: rfc3339(c.last_transition_unix),
            observed_generation: generation,
        })
        .collect();
    let mut out = NetworkTestStatus {
        phase: Some(phase),
        start_time: s.start_unix.map(rfc3339),
        completion_time: s.completion_unix.map(rfc3339),
        conditions,
        observed_generation: generation,
        ..NetworkTestStatus::default()
    };
    if let Some(sum) = &s.summary {
        fill_summary(&mut out, sum);
    }
    out
}

fn fill_summary(out: &mut NetworkTestStatus, s: &Summary) {
    out.sources = s.sources;
    out.sources_unreachable = s.sources_unreachable;
    out.pairs = s.pairs;
    out.pairs_failed = s.pairs_failed;
    out.success_percent = Some(s.success_rate_percent);
    out.sent = s.sent;
    out.received = s.received;
    out.loss_percent = Some(s.loss_percent);
    out.latency = latency(s.latency);
    out.path_mtu_min = s.path_mtu_min;
    out.targets = s
        .targets
        .iter()
        .map(|t| CrdTargetSummary {
            target: t.target_id.clone(),
            pairs: t.pairs,
            pairs_failed: t.pairs_failed,
            loss_percent: t.loss_percent,
            latency: latency(t.latency),
            path_mtu_min: t.path_mtu_min,
        })
        .collect();
    out.targets_omitted = s.targets_omitted;
    out.worst_failures = s
        .failures
        .iter()
        .map(|f| PairFailure {
            source: f.source.clone(),
            target: f.target_id.clone(),
            // The schema caps an error at 1024 characters; cut on a character boundary.
            error: f.error.chars().take(1024).collect(),
            loss_percent: f.loss_percent,
        })
        .collect();
    out.omitted_failures = s.failures_omitted;
}

/// What the phase machine needs to know of the stored status: phase, times and conditions.
/// (`summary` is not read back: a finished test's status is never rewritten.)
pub fn current(s: Option<&NetworkTestStatus>) -> Option<TestStatus> {
    let s = s?;
    let phase = match s.phase? {
        CrdPhase::Pending => Phase::Pending,
        CrdPhase::Running => Phase::Running,
        CrdPhase::Succeeded => Phase::Succeeded,
        CrdPhase::Failed => Phase::Failed,
    };
    Some(TestStatus {
        phase,
        start_unix: s.start_time.as_deref().and_then(unix),
        completion_unix: s.completion_time.as_deref().and_then(unix),
        conditions: s
            .conditions
            .iter()
            .map(|c| Condition {
                type_: c.type_.clone(),
                status: match c.status {
                    ConditionStatus::True => "True".into(),
                    ConditionStatus::False => "False".into(),
                    ConditionStatus::Unknown => "Unknown".into(),
                },
                reason: c.reason.clone(),
                message: c.message.clone(),
                last_transition_unix: unix(&c.last_transition_time).unwrap_or(0),
            })
            .collect(),
        summary: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::status::{Event, transition};
    use super::*;

    fn crd_spec(v: serde_json::Value) -> NetworkTestSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_node_selector_the_api_server_would_refuse_is_the_specs_error() {
        let with = |selector: serde_json::Value| {
            spec(&crd_spec(serde_json::json!({
                "kind": "icmp", "targets": [{"peers": {"perNode": 1}}], "nodeSelector": selector
            })))
        };
        assert!(with(serde_json::json!({"matchLabels": {"pool": "gpu"}})).is_ok());
        let e = with(serde_json::json!({"matchLabels": {"bad key": "x"}})).unwrap_err();
        assert_eq!(
            e.field, "spec.nodeSelector.matchLabels[\"bad key\"]",
            "{e:?}"
        );
        let e = with(serde_json::json!({"matchLabels": {"pool": "a b"}})).unwrap_err();
        assert!(e.field.starts_with("spec.nodeSelector"), "{e:?}");
    }

    #[test]
    fn spec_maps_every_target_kind() {
        let s = crd_spec(serde_json::json!({
            "kind": "tcp",
            "port": 443,
            "targets": [
                {"address": "10.0.0.1"}, {"hostPort": "a.example:80"}, {"hostname": "b.example"},
                {"apiServer": true}, {"metadataService": true}, {"peers": {"perNode": 2}}
            ]
        }));
        let t = spec(&s).unwrap();
        assert_eq!(t.kind, "tcp");
        assert_eq!(t.port, Some(443));
        assert_eq!(t.max_nodes, Some(100));
        assert_eq!(
            t.targets,
            vec![
                TargetSpec::Address("10.0.0.1".into()),
                TargetSpec::HostPort("a.example:80".into()),
                TargetSpec::Hostname("b.example".into()),
                TargetSpec::ApiServer,
                TargetSpec::MetadataService,
                TargetSpec::Peers { per_node: 2 },
            ]
        );
        let bad = crd_spec(
            serde_json::json!({"kind": "icmp", "targets": [{"address": "10.0.0.1", "hostname": "x"}, {}]}),
        );
        assert_eq!(spec(&bad).unwrap_err().field, "spec.targets[0]");
    }

    #[test]
    fn status_round_trip_keeps_phase_and_times() {
        let running = transition(
            None,
            Event::Started {
                sources: 2,
                pairs: 4,
            },
            1_795_000_000,
        )
        .unwrap();
        let crd = status(&running, Some(1));
        assert_eq!(crd.phase, Some(CrdPhase::Running));
        assert_eq!(crd.start_time.as_deref(), Some("2026-11-18T11:06:40Z"));
        assert_eq!(crd.conditions.len(), 2);
        let back = current(Some(&crd)).unwrap();
        assert_eq!(back.phase, Phase::Running);
        assert_eq!(back.start_unix, Some(1_795_000_000));
        assert_eq!(back.conditions, running.conditions);
        // Nothing to write again for the same phase, even after the round trip.
        assert!(
            transition(
                Some(&back),
                Event::Started {
                    sources: 2,
                    pairs: 4
                },
                1_795_000_100
            )
            .is_none()
        );
    }
}
