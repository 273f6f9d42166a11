//! Aggregation of per-pair probe results into per-target and overall figures: success rate, loss,
//! latency p50/p95/max, smallest path MTU, and the worst failing source→target pairs (bounded).

use std::collections::BTreeMap;

use super::fanout;
use super::plan::TestPlan;

/// At most this many failing pairs (and per-target summaries) are listed in status; the rest are
/// counted. The complete lists stay available from the controller's HTTP API.
pub const MAX_LISTED: usize = 50;

/// One source→target result, as an agent returned it (mirrors the proto's `TargetResult`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PairResult {
    pub source: String,
    pub target_id: String,
    pub sent: u32,
    pub received: u32,
    pub rtt_us: Vec<u32>,
    pub path_mtu: u32,
    pub http_status: u32,
    pub answers: Vec<String>,
    pub error: String,
}

impl PairResult {
    /// A pair succeeded when some probe was answered and the agent reported no error. (For path
    /// MTU, unanswered oversized probes are part of the method, and the agent reports an error
    /// only when nothing got through.)
    pub fn succeeded(&self) -> bool {
        self.error.is_empty() && self.received > 0
    }

    fn loss_percent(&self) -> f64 {
        loss_percent(u64::from(self.sent), u64::from(self.received))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Latency {
    pub p50_us: u32,
    pub p95_us: u32,
    pub max_us: u32,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetSummary {
    pub target_id: String,
    pub pairs: u32,
    pub pairs_failed: u32,
    pub sent: u64,
    pub received: u64,
    pub loss_percent: f64,
    pub latency: Option<Latency>,
    /// The smallest path MTU any source found (pathMtu only; sources that found none excluded).
    pub path_mtu_min: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FailedPair {
    pub source: String,
    pub target_id: String,
    pub sent: u32,
    pub received: u32,
    pub loss_percent: f64,
    pub error: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub sources: u32,
    /// Sources whose agent could not be asked or did not answer.
    pub sources_unreachable: u32,
    pub pairs: u32,
    pub pairs_failed: u32,
    /// Succeeded pairs over all pairs, in percent.
    pub success_rate_percent: f64,
    pub sent: u64,
    pub received: u64,
    pub loss_percent: f64,
    pub latency: Option<Latency>,
    pub path_mtu_min: Option<u32>,
    /// Per target, worst first (most failed pairs, then highest loss, then id).
    pub targets: Vec<TargetSummary>,
    pub targets_omitted: u32,
    /// Failing pairs, worst first (highest loss, then fewest received, then source and target).
    pub failures: Vec<FailedPair>,
    pub failures_omitted: u32,
}

impl Summary {
    /// The same summary with both lists cut to [`MAX_LISTED`] and the rest counted: what goes
    /// into the resource's status.
    pub fn bounded(&self) -> Self {
        let mut s = self.clone();
        s.targets_omitted += s.targets.len().saturating_sub(MAX_LISTED) as u32;
        s.targets.truncate(MAX_LISTED);
        s.failures_omitted += s.failures.len().saturating_sub(MAX_LISTED) as u32;
        s.failures.truncate(MAX_LISTED);
        s
    }
}

/// Aggregates what the agents returned. `outcomes` maps each source to its agent's results, or to
/// the error that kept it from answering; a source of the plan with no entry counts as unreachable.
/// Each planned pair is counted exactly once: a pair the agent did not return is a failure.
pub fn aggregate(
    plan: &TestPlan,
    outcomes: &BTreeMap<String, Result<Vec<PairResult>, String>>,
) -> Summary {
    let mut pairs: Vec<PairResult> = Vec::with_capacity(plan.pair_count());
    let mut sources_unreachable = 0;
    for (source, targets) in &plan.sources {
        match outcomes.get(source) {
            Some(Ok(results)) => {
                let by_id: BTreeMap<&str, &PairResult> =
                    results.iter().map(|r| (r.target_id.as_str(), r)).collect();
                for t in targets {
                    pairs.push(match by_id.get(t.id.as_str()) {
                        Some(r) => PairResult {
                            source: source.clone(),
                            ..(*r).clone()
                        },
                        None => missing(
                            source,
                            &t.id,
                            "the agent returned no result for this target",
                        ),
                    });
                }
            }
            Some(Err(e)) => {
                // An agent that refused the request answered: the spec, not the node, is at fault.
                if !fanout::is_refusal(e) {
                    sources_unreachable += 1;
                }
                let error = fanout::unanswered(e);
                pairs.extend(targets.iter().map(|t| missing(source, &t.id, &error)));
            }
            None => {
                sources_unreachable += 1;
                pairs.extend(
                    targets
                        .iter()
                        .map(|t| missing(source, &t.id, "agent gave no answer")),
                );
            }
        }
    }

    let mut all_rtt = Vec::new();
    let mut per_target: BTreeMap<&str, (Vec<&PairResult>, Vec<u32>)> = BTreeMap::new();
    for p in &pairs {
        all_rtt.extend_from_slice(&p.rtt_us);
        let entry = per_target.entry(summary_row(&p.target_id)).or_default();
        entry.0.push(p);
        entry.1.extend_from_slice(&p.rtt_us);
    }

    let mut targets: Vec<TargetSummary> = per_target
        .into_iter()
        .map(|(id, (ps, mut rtt))| {
            let sent = ps.iter().map(|p| u64::from(p.sent)).sum();
            let received = ps.iter().map(|p| u64::from(p.received)).sum();
            TargetSummary {
                target_id: id.to_owned(),
                pairs: ps.len() as u32,
                pairs_failed: ps.iter().filter(|p| !p.succeeded()).count() as u32,
                sent,
                received,
                loss_percent: loss_percent(sent, received),
                latency: latency(&mut rtt),
                path_mtu_min: ps.iter().map(|p| p.path_mtu).filter(|m| *m > 0).min(),
            }
        })
        .collect();
    targets.sort_by(|a, b| {
        b.pairs_failed
            .cmp(&a.pairs_failed)
            .then(b.loss_percent.total_cmp(&a.loss_percent))
            .then_with(|| a.target_id.cmp(&b.target_id))
    });

    let mut failures: Vec<FailedPair> = pairs
        .iter()
        .filter(|p| !p.succeeded())
        .map(|p| FailedPair {
            source: p.source.clone(),
            target_id: p.target_id.clone(),
            sent: p.sent,
            received: p.received,
            loss_percent: p.loss_percent(),
            error: p.error.clone(),
        })
        .collect();
    failures.sort_by(|a, b| {
        b.loss_percent
            .total_cmp(&a.loss_percent)
            .then(a.received.cmp(&b.received))
            .then_with(|| a.source.cmp(&b.source))
            .then_with(|| a.target_id.cmp(&b.target_id))
    });

    let sent: u64 = pairs.iter().map(|p| u64::from(p.sent)).sum();
    let received: u64 = pairs.iter().map(|p| u64::from(p.received)).sum();
    let n = pairs.len() as u32;
    let failed = failures.len() as u32;
    Summary {
        sources: plan.sources.len() as u32,
        sources_unreachable,
        pairs: n,
        pairs_failed: failed,
        success_rate_percent: if n == 0 {
            0.0
        } else {
            round2(f64::from(n - failed) * 100.0 / f64::from(n))
        },
        sent,
        received,
        loss_percent: loss_percent(sent, received),
        latency: latency(&mut all_rtt),
        path_mtu_min: pairs.iter().map(|p| p.path_mtu).filter(|m| *m > 0).min(),
        targets,
        targets_omitted: 0,
        failures,
        failures_omitted: 0,
    }
}

/// The row of `targets` a pair counts under: the target as the spec names it, so every peer
/// (`node/<name>`) counts under one `peers` row, as a mesh's status would otherwise list one row
/// per node, crowd out the spec's other targets past [`MAX_LISTED`], and show per-node figures
/// that belong in `failures` and the HTTP API.
fn summary_row(target_id: &str) -> &str {
    if target_id.starts_with(PEER_PREFIX) {
        "peers"
    } else {
        target_id
    }
}

/// The id prefix of a peer target ([`super::plan::plan`] names peers `node/<name>`).
const PEER_PREFIX: &str = "node/";

fn missing(source: &str, target: &str, why: &str) -> PairResult {
    PairResult {
        source: source.to_owned(),
        target_id: target.to_owned(),
        error: why.to_owned(),
        ..Default::default()
    }
}

/// Lost over sent, in percent, two decimals; 100 when nothing was sent (nothing got through).
fn loss_percent(sent: u64, received: u64) -> f64 {
    if sent == 0 {
        return 100.0;
    }
    round2(sent.saturating_sub(received) as f64 * 100.0 / sent as f64)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Nearest-rank percentiles (the smallest sample with at least p % of samples at or below it).
fn latency(samples: &mut [u32]) -> Option<Latency> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let rank = |p: usize| samples[(samples.len() * p).div_ceil(100).max(1) - 1];
    Some(Latency {
        p50_us: rank(50),
        p95_us: rank(95),
        max_us: samples[samples.len() - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::super::plan::{PlannedTarget, ProbeKind, ProbeParams};
    use super::*;

    fn plan_of(sources: &[(&str, &[&str])]) -> TestPlan {
        TestPlan {
            ranges: Vec::new(),
            params: ProbeParams {
                kind: ProbeKind::Icmp,
                count: 4,
                interval_ms: 100,
                timeout_ms: 500,
                expected_status: vec![],
                max_mtu: 0,
            },
            sources: sources
                .iter()
                .map(|(s, ts)| {
                    (
                        s.to_string(),
                        ts.iter()
                            .map(|t| PlannedTarget {
                                id: t.to_string(),
                                ..Default::default()
                            })
                            .collect(),
                    )
                })
                .collect(),
        }
    }

    fn ok(target: &str, rtt: &[u32]) -> PairResult {
        PairResult {
            target_id: target.into(),
            sent: rtt.len() as u32,
            received: rtt.len() as u32,
            rtt_us: rtt.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let mut v: Vec<u32> = (1..=100).rev().collect();
        assert_eq!(
            latency(&mut v),
            Some(Latency {
                p50_us: 50,
                p95_us: 95,
                max_us: 100
            })
        );
        assert_eq!(
            latency(&mut [7]),
            Some(Latency {
                p50_us: 7,
                p95_us: 7,
                max_us: 7
            })
        );
        assert_eq!(
            latency(&mut [1, 2]),
            Some(Latency {
                p50_us: 1,
                p95_us: 2,
                max_us: 2
            })
        );
        assert_eq!(latency(&mut []), None);
    }

    #[test]
    fn per_target_and_overall_figures() {
        let plan = plan_of(&[("a", &["x", "hole"]), ("b", &["x", "hole"])]);
        let lost = |t: &str| PairResult {
            target_id: t.into(),
            sent: 4,
            received: 0,
            error: "send echo request to 10.9.0.1: Invalid argument".into(),
            ..Default::default()
        };
        let mut outcomes = BTreeMap::new();
        outcomes.insert(
            "a".to_owned(),
            Ok(vec![ok("x", &[100, 200, 300, 400]), lost("hole")]),
        );
        outcomes.insert(
            "b".to_owned(),
            Ok(vec![ok("x", &[500, 600, 700, 800]), lost("hole")]),
        );
        let s = aggregate(&plan, &outcomes);
        assert_eq!((s.pairs, s.pairs_failed, s.sources_unreachable), (4, 2, 0));
        assert_eq!(s.success_rate_percent, 50.0);
        assert_eq!((s.sent, s.received, s.loss_percent), (16, 8, 50.0));
        assert_eq!(
            s.latency,
            Some(Latency {
                p50_us: 400,
                p95_us: 800,
                max_us: 800
            })
        );
        assert_eq!(s.targets[0].target_id, "hole");
        assert_eq!(s.targets[0].loss_percent, 100.0);
        assert_eq!(s.targets[1].loss_percent, 0.0);
        assert_eq!(
            s.targets[1].latency,
            Some(Latency {
                p50_us: 400,
                p95_us: 800,
                max_us: 800
            })
        );
        let failed: Vec<_> = s
            .failures
            .iter()
            .map(|f| (f.source.as_str(), f.target_id.as_str()))
            .collect();
        assert_eq!(failed, vec![("a", "hole"), ("b", "hole")]);
    }

    #[test]
    fn unreachable_agents_and_missing_results_are_failures() {
        let plan = plan_of(&[("a", &["x"]), ("b", &["x", "y"]), ("c", &["x"])]);
        let mut outcomes = BTreeMap::new();
        outcomes.insert("a".to_owned(), Ok(vec![ok("x", &[10])]));
        outcomes.insert(
            "b".to_owned(),
            Err("connect: connection refused".to_owned()),
        );
        // c: the agent answered but left a target out.
        outcomes.insert("c".to_owned(), Ok(vec![]));
        let s = aggregate(&plan, &outcomes);
        assert_eq!((s.pairs, s.pairs_failed, s.sources_unreachable), (4, 3, 1));
        assert!(
            s.failures
                .iter()
                .any(|f| f.source == "b" && f.error.contains("agent unreachable: connect"))
        );
        assert!(
            s.failures
                .iter()
                .any(|f| f.source == "c" && f.error.contains("no result"))
        );
    }

    /// An agent that refused the request (InvalidArgument) answered: its pairs fail with the
    /// refusal, and it does not count as unreachable.
    #[test]
    fn a_refusing_agent_is_not_unreachable() {
        let plan = plan_of(&[("a", &["x"]), ("b", &["x"])]);
        let mut outcomes = BTreeMap::new();
        outcomes.insert("a".to_owned(), Ok(vec![ok("x", &[10])]));
        outcomes.insert(
            "b".to_owned(),
            Err(format!(
                "{}10.0.0.2:4443: InvalidArgument: max_mtu: too small",
                fanout::REFUSED
            )),
        );
        let s = aggregate(&plan, &outcomes);
        assert_eq!((s.pairs, s.pairs_failed, s.sources_unreachable), (2, 1, 0));
        assert_eq!(
            s.failures[0].error,
            "agent refused the request: 10.0.0.2:4443: InvalidArgument: max_mtu: too small"
        );
    }

    /// Peers are one row of the spec, `peers`, whatever node each pair reached; failures still
    /// name the peer.
    #[test]
    fn peer_rows_are_one_peers_row() {
        let plan = plan_of(&[
            ("a", &["10.0.0.9", "node/b", "node/c"]),
            ("b", &["10.0.0.9", "node/a", "node/c"]),
        ]);
        let lost = |t: &str| PairResult {
            target_id: t.into(),
            sent: 4,
            error: "timeout".into(),
            ..Default::default()
        };
        let mut outcomes = BTreeMap::new();
        outcomes.insert(
            "a".to_owned(),
            Ok(vec![
                ok("10.0.0.9", &[5]),
                ok("node/b", &[10]),
                lost("node/c"),
            ]),
        );
        outcomes.insert(
            "b".to_owned(),
            Ok(vec![
                ok("10.0.0.9", &[5]),
                ok("node/a", &[30]),
                ok("node/c", &[20]),
            ]),
        );
        let s = aggregate(&plan, &outcomes);
        let rows: Vec<_> = s
            .targets
            .iter()
            .map(|t| (t.target_id.as_str(), t.pairs, t.pairs_failed))
            .collect();
        assert_eq!(rows, [("peers", 4, 1), ("10.0.0.9", 2, 0)]);
        assert_eq!(
            s.targets[0].latency.map(|l| l.max_us),
            Some(30),
            "{:?}",
            s.targets[0]
        );
        assert_eq!(s.failures[0].target_id, "node/c");
    }

    #[test]
    fn lists_are_bounded_with_counts() {
        let targets: Vec<String> = (0..120).map(|i| format!("t{i:03}")).collect();
        let refs: Vec<&str> = targets.iter().map(String::as_str).collect();
        let plan = plan_of(&[("a", &refs)]);
        let results = targets
            .iter()
            .enumerate()
            .map(|(i, t)| PairResult {
                target_id: t.clone(),
                sent: 100,
                received: i as u32 % 100,
                error: if i % 100 == 99 {
                    String::new()
                } else {
                    "timeout".into()
                },
                ..Default::default()
            })
            .collect();
        let mut outcomes = BTreeMap::new();
        outcomes.insert("a".to_owned(), Ok(results));
        let full = aggregate(&plan, &outcomes);
        assert_eq!(full.failures.len(), 119);
        // Worst first: received 0 (targets t000 and t100) lead.
        assert_eq!(full.failures[0].target_id, "t000");
        assert_eq!(full.failures[1].target_id, "t100");
        let b = full.bounded();
        assert_eq!((b.failures.len(), b.failures_omitted), (50, 69));
        assert_eq!((b.targets.len(), b.targets_omitted), (50, 70));
        assert_eq!(b.pairs_failed, 119);
    }

    #[test]
    fn path_mtu_minimum() {
        let plan = plan_of(&[("a", &["p"]), ("b", &["p"])]);
        let mut outcomes = BTreeMap::new();
        outcomes.insert(
            "a".to_owned(),
            Ok(vec![PairResult {
                path_mtu: 1500,
                ..ok("p", &[50])
            }]),
        );
        outcomes.insert(
            "b".to_owned(),
            Ok(vec![PairResult {
                path_mtu: 1400,
                ..ok("p", &[60])
            }]),
        );
        let s = aggregate(&plan, &outcomes);
        assert_eq!(s.path_mtu_min, Some(1400));
        assert_eq!(s.targets[0].path_mtu_min, Some(1400));
    }
}
