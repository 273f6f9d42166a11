//! Conversion between the plan's plain data and the `RunProbes` messages of the agent contract.

use nodekeeper_proto::agent::v1 as pb;

use super::aggregate::PairResult;
use super::fanout::AGENT_CONCURRENCY;
use super::plan::{PlannedTarget, ProbeKind, ProbeParams};

/// The request one source's agent receives.
pub fn request(
    run_id: &str,
    params: &ProbeParams,
    targets: &[PlannedTarget],
) -> pb::RunProbesRequest {
    let kind = match params.kind {
        ProbeKind::Icmp => pb::ProbeKind::Icmp,
        ProbeKind::Tcp => pb::ProbeKind::Tcp,
        ProbeKind::Dns => pb::ProbeKind::Dns,
        ProbeKind::Http => pb::ProbeKind::Http,
        ProbeKind::PathMtu => pb::ProbeKind::PathMtu,
    };
    pb::RunProbesRequest {
        run_id: run_id.to_owned(),
        kind: kind as i32,
        targets: targets
            .iter()
            .map(|t| pb::ProbeTarget {
                id: t.id.clone(),
                address: t.address.clone(),
                port: u32::from(t.port),
                hostname: t.hostname.clone(),
                url: t.url.clone(),
            })
            .collect(),
        count: params.count,
        interval_ms: params.interval_ms,
        timeout_ms: params.timeout_ms,
        concurrency: AGENT_CONCURRENCY,
        expected_status: params.expected_status.clone(),
        max_mtu: params.max_mtu,
    }
}

/// The agent's answer as pairs from `source`. Results for targets that were not asked for are
/// dropped (aggregation counts only planned pairs).
pub fn pairs(
    source: &str,
    targets: &[PlannedTarget],
    response: pb::RunProbesResponse,
) -> Vec<PairResult> {
    response
        .results
        .into_iter()
        .filter(|r| targets.iter().any(|t| t.id == r.target_id))
        .map(|r| PairResult {
            source: source.to_owned(),
            target_id: r.target_id,
            sent: r.sent,
            received: r.received.min(r.sent),
            rtt_us: r.rtt_us,
            path_mtu: r.path_mtu,
            http_status: r.http_status,
            answers: r.answers,
            error: r.error,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let params = ProbeParams {
            kind: ProbeKind::PathMtu,
            count: 2,
            interval_ms: 50,
            timeout_ms: 700,
            expected_status: vec![],
            max_mtu: 1500,
        };
        let targets = vec![PlannedTarget {
            id: "node/b".into(),
            address: "10.0.0.2".into(),
            ..Default::default()
        }];
        let req = request("ns/t/uid", &params, &targets);
        assert_eq!(req.kind, pb::ProbeKind::PathMtu as i32);
        assert_eq!(
            (req.count, req.timeout_ms, req.max_mtu, req.concurrency),
            (2, 700, 1500, AGENT_CONCURRENCY)
        );
        assert_eq!(req.targets[0].address, "10.0.0.2");
        let resp = pb::RunProbesResponse {
            run_id: req.run_id,
            results: vec![
                pb::TargetResult {
                    target_id: "node/b".into(),
                    sent: 3,
                    received: 9,
                    path_mtu: 1400,
                    ..Default::default()
                },
                pb::TargetResult {
                    target_id: "not-asked".into(),
                    ..Default::default()
                },
            ],
        };
        let p = pairs("a", &targets, resp);
        assert_eq!(p.len(), 1);
        assert_eq!(
            (p[0].source.as_str(), p[0].received, p[0].path_mtu),
            ("a", 3, 1400)
        );
    }
}
