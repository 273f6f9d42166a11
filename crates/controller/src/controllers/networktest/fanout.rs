//! Fan-out of a test plan to the source nodes' agents: at most `concurrency` calls at once, each
//! bounded by a time budget derived from the probe parameters, every source answered or given up.
//! The call itself (a `RunProbes` over mutual TLS) is passed in, so this stays free of tonic.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use futures::StreamExt as _;

use super::aggregate::PairResult;
use super::plan::{PlannedTarget, ProbeKind, ProbeParams, TestPlan};

/// Targets an agent probes at once: the agent's default, which the controller sends explicitly.
pub const AGENT_CONCURRENCY: u32 = nodekeeper_model::probe::DEFAULT_CONCURRENCY;
/// Slack on top of the computed budget for connection set-up and scheduling.
const SLACK: Duration = Duration::from_secs(5);
/// No single call may take longer than this, whatever the parameters say; [`super::plan::plan`]
/// refuses a spec whose calls would need longer.
pub const MAX_BUDGET: Duration = Duration::from_secs(15 * 60);
/// Path-MTU probes per target: at most ~18 sizes (bisection of 68..65535 plus the first tries),
/// each tried up to 3 times (the agent's limit).
const PMTU_SIZES: u64 = 18;
const PMTU_ATTEMPTS: u64 = 3;

/// How long one agent may take for `targets` targets with `params`: the time its probes can
/// take when every one of them times out, plus slack.
pub fn call_budget(params: &ProbeParams, targets: usize) -> Duration {
    needed_budget(params, targets).min(MAX_BUDGET)
}

/// [`call_budget`] before the cap of [`MAX_BUDGET`].
pub fn needed_budget(params: &ProbeParams, targets: usize) -> Duration {
    let per_probe = u64::from(params.timeout_ms) + u64::from(params.interval_ms);
    let probes_per_target = match params.kind {
        ProbeKind::PathMtu => PMTU_SIZES * u64::from(params.count).min(PMTU_ATTEMPTS),
        _ => u64::from(params.count),
    };
    let waves = (targets as u64)
        .div_ceil(u64::from(AGENT_CONCURRENCY))
        .max(1);
    let ms = waves
        .saturating_mul(probes_per_target)
        .saturating_mul(per_probe);
    Duration::from_millis(ms) + SLACK
}

/// Calls `call(source, targets, budget)` for every source of `plan`, at most `concurrency` at
/// once, and returns each source's results or the reason it has none (including a call that
/// outlived its budget).
pub async fn fan_out<F, Fut>(
    plan: &TestPlan,
    concurrency: usize,
    call: F,
) -> BTreeMap<String, Result<Vec<PairResult>, String>>
where
    F: Fn(String, Vec<PlannedTarget>, Duration) -> Fut,
    Fut: Future<Output = Result<Vec<PairResult>, String>>,
{
    // The futures are made up front (they do nothing until polled): a borrowing closure inside a
    // stream adapter would make the reconciler's future fail its `Send` bound.
    let calls: Vec<_> = plan
        .sources
        .iter()
        .map(|(source, targets)| {
            let budget = call_budget(&plan.params, targets.len());
            let call = call(source.clone(), targets.clone(), budget);
            let source = source.clone();
            async move {
                let outcome = match tokio::time::timeout(budget, call).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("no answer within {budget:?}")),
                };
                (source, outcome)
            }
        })
        .collect();
    futures::stream::iter(calls)
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

/// [`fan_out`] until `cancelled` completes (the test was deleted): then every call still in
/// flight is dropped, which cancels its gRPC request and so the agent's probes, and `None` is
/// returned: a cancelled run has no results.
pub async fn fan_out_until<F, Fut, C>(
    plan: &TestPlan,
    concurrency: usize,
    call: F,
    cancelled: C,
) -> Option<BTreeMap<String, Result<Vec<PairResult>, String>>>
where
    F: Fn(String, Vec<PlannedTarget>, Duration) -> Fut,
    Fut: Future<Output = Result<Vec<PairResult>, String>>,
    C: Future<Output = ()>,
{
    tokio::select! {
        outcomes = fan_out(plan, concurrency, call) => Some(outcomes),
        () = cancelled => None,
    }
}

/// Whether the run of the test `uid` is to stop: its object is gone, or the name now holds
/// another test (`found` is the uid the name has now, `None` when absent).
pub fn run_is_cancelled(found: Option<&str>, uid: &str) -> bool {
    found != Some(uid)
}

/// Resolves `names` with the controller's resolver, at most 16 at once, each within `timeout`.
/// A name that does not resolve (or not in time) is absent from the result; [`super::plan::plan`]
/// then names the field that holds it.
pub async fn resolve(
    names: &[String],
    timeout: Duration,
) -> BTreeMap<String, Vec<std::net::IpAddr>> {
    let lookups: Vec<_> = names
        .iter()
        .cloned()
        .map(|name| async move {
            // Port 0 only satisfies the resolver's signature; no connection is made.
            let addrs: Vec<std::net::IpAddr> = {
                let found =
                    tokio::time::timeout(timeout, tokio::net::lookup_host((name.as_str(), 0)));
                match found.await {
                    Ok(Ok(it)) => it.map(|sa| sa.ip()).collect(),
                    _ => Vec::new(),
                }
            };
            (name, addrs)
        })
        .collect();
    let all: Vec<(String, Vec<std::net::IpAddr>)> = futures::stream::iter(lookups)
        .buffer_unordered(16)
        .collect()
        .await;
    all.into_iter()
        .filter(|(_, addrs)| !addrs.is_empty())
        .collect()
}

/// How a source whose agent answered the call with a refusal (`InvalidArgument`: the request
/// is one it will not run) is described: the agent is reachable, and the message says what to
/// change. [`unanswered`] and [`super::aggregate::aggregate`] tell these from unreachable agents.
pub const REFUSED: &str = "agent refused the request: ";

/// Whether a source's failure (the `Err` of its outcome) is the agent's refusal ([`REFUSED`]).
pub fn is_refusal(error: &str) -> bool {
    error.starts_with(REFUSED)
}

/// The error of each pair of a source whose call failed with `error`.
pub fn unanswered(error: &str) -> String {
    if is_refusal(error) {
        error.to_owned()
    } else {
        format!("agent unreachable: {error}")
    }
}

/// Every pair's result in one list, sorted by source then target id: what the HTTP API serves.
pub fn flatten(
    outcomes: &BTreeMap<String, Result<Vec<PairResult>, String>>,
    plan: &TestPlan,
) -> Vec<PairResult> {
    let mut pairs = Vec::with_capacity(plan.pair_count());
    for (source, targets) in &plan.sources {
        let returned = match outcomes.get(source) {
            Some(Ok(r)) => Some(r),
            _ => None,
        };
        for t in targets {
            let found = returned.and_then(|r| r.iter().find(|p| p.target_id == t.id));
            pairs.push(match found {
                Some(p) => PairResult {
                    source: source.clone(),
                    ..p.clone()
                },
                None => PairResult {
                    source: source.clone(),
                    target_id: t.id.clone(),
                    error: match outcomes.get(source) {
                        Some(Err(e)) => unanswered(e),
                        Some(Ok(_)) => "the agent returned no result for this target".into(),
                        None => "agent gave no answer".into(),
                    },
                    ..Default::default()
                },
            });
        }
    }
    pairs.sort_by(|a, b| {
        a.source
            .cmp(&b.source)
            .then_with(|| a.target_id.cmp(&b.target_id))
    });
    pairs
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn params(kind: ProbeKind, count: u32) -> ProbeParams {
        ProbeParams {
            kind,
            count,
            interval_ms: 100,
            timeout_ms: 400,
            expected_status: vec![],
            max_mtu: 0,
        }
    }

    #[test]
    fn budgets() {
        // 3 probes × 500 ms, one wave, plus 5 s.
        assert_eq!(
            call_budget(&params(ProbeKind::Icmp, 3), 10),
            Duration::from_millis(6_500)
        );
        // 17 targets need two waves of 16.
        assert_eq!(
            call_budget(&params(ProbeKind::Icmp, 3), 17),
            Duration::from_millis(8_000)
        );
        // Path MTU: 18 sizes × min(count, 3) attempts.
        assert_eq!(
            call_budget(&params(ProbeKind::PathMtu, 10), 1),
            Duration::from_millis(32_000)
        );
        let huge = ProbeParams {
            timeout_ms: 30_000,
            interval_ms: 60_000,
            ..params(ProbeKind::Icmp, 100)
        };
        assert_eq!(call_budget(&huge, 1_000), MAX_BUDGET);
    }

    fn plan(sources: usize) -> TestPlan {
        TestPlan {
            ranges: Vec::new(),
            params: ProbeParams {
                timeout_ms: 1,
                interval_ms: 1,
                ..params(ProbeKind::Tcp, 1)
            },
            sources: (0..sources)
                .map(|i| {
                    (
                        format!("n{i:02}"),
                        vec![PlannedTarget {
                            id: "t".into(),
                            ..Default::default()
                        }],
                    )
                })
                .collect(),
        }
    }

    #[tokio::test]
    async fn bounded_concurrency_and_timeouts() {
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let p = plan(10);
        let out = fan_out(&p, 3, |source, targets, _budget| {
            let (running, peak) = (running.clone(), peak.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                // n09 hangs past its budget (about 5 s); n08's agent is down.
                let wait = if source == "n09" { 60_000 } else { 50 };
                tokio::time::sleep(Duration::from_millis(wait)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                if source == "n08" {
                    return Err("connect: connection refused".into());
                }
                Ok(targets
                    .iter()
                    .map(|t| PairResult {
                        target_id: t.id.clone(),
                        sent: 1,
                        received: 1,
                        ..Default::default()
                    })
                    .collect())
            }
        })
        .await;
        assert_eq!(out.len(), 10);
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        assert!(out["n00"].as_ref().is_ok_and(|r| r.len() == 1));
        assert_eq!(out["n08"], Err("connect: connection refused".to_owned()));
        assert!(
            out["n09"]
                .as_ref()
                .is_err_and(|e| e.starts_with("no answer within"))
        );
    }

    /// A cancelled fan-out drops every call still in flight (which cancels the gRPC requests)
    /// and has no results.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_fan_out_drops_its_calls() {
        struct Dropped(Arc<AtomicUsize>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let started = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicUsize::new(0));
        let p = TestPlan {
            params: ProbeParams {
                interval_ms: 1_000,
                timeout_ms: 1_000,
                ..params(ProbeKind::Icmp, 100)
            },
            ..plan(3)
        };
        let out = fan_out_until(
            &p,
            8,
            |_, targets, _| {
                let (started, dropped, finished) =
                    (started.clone(), dropped.clone(), finished.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    let _guard = Dropped(dropped);
                    tokio::time::sleep(Duration::from_secs(200)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                    Ok(targets.iter().map(|_| PairResult::default()).collect())
                }
            },
            tokio::time::sleep(Duration::from_secs(10)),
        )
        .await;
        assert!(out.is_none());
        assert_eq!(started.load(Ordering::SeqCst), 3);
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            3,
            "every call in flight is dropped"
        );
        assert_eq!(finished.load(Ordering::SeqCst), 0);
        // Not cancelled: the outcomes.
        let out = fan_out_until(
            &plan(2),
            8,
            |_, _, _| async { Ok(vec![]) },
            std::future::pending(),
        )
        .await;
        assert_eq!(out.map(|o| o.len()), Some(2));
    }

    #[test]
    fn a_run_stops_when_its_object_is_gone_or_replaced() {
        assert!(!run_is_cancelled(Some("u1"), "u1"));
        assert!(run_is_cancelled(None, "u1"));
        assert!(run_is_cancelled(Some("u2"), "u1"));
    }

    #[tokio::test]
    async fn resolve_keeps_only_names_that_resolve() {
        // `localhost` resolves from /etc/hosts and an empty name fails inside getaddrinfo: neither
        // sends a query, so the test stays off the network.
        let names = vec!["localhost".to_owned(), String::new()];
        let got = resolve(&names, Duration::from_secs(5)).await;
        assert!(
            got.get("localhost")
                .is_some_and(|a| a.iter().all(|ip| ip.is_loopback())),
            "{got:?}"
        );
        assert!(!got.contains_key(""));
    }

    #[test]
    fn flatten_covers_every_planned_pair() {
        let mut outcomes = BTreeMap::new();
        outcomes.insert(
            "n00".to_owned(),
            Ok(vec![PairResult {
                target_id: "t".into(),
                sent: 1,
                received: 1,
                ..Default::default()
            }]),
        );
        outcomes.insert("n01".to_owned(), Err("refused".to_owned()));
        outcomes.insert(
            "n02".to_owned(),
            Err(format!("{REFUSED}InvalidArgument: max_mtu: too small")),
        );
        let pairs = flatten(&outcomes, &plan(4));
        assert_eq!(pairs.len(), 4);
        assert_eq!((pairs[0].source.as_str(), pairs[0].received), ("n00", 1));
        assert_eq!(pairs[1].error, "agent unreachable: refused");
        assert_eq!(
            pairs[2].error,
            "agent refused the request: InvalidArgument: max_mtu: too small"
        );
        assert_eq!(pairs[3].error, "agent gave no answer");
    }
}
