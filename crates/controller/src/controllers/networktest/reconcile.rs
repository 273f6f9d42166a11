//! The `NetworkTest` reconciler: plans the test from the resource and the selected Nodes, asks the
//! agents (bounded concurrency and time), aggregates, keeps the full results in memory for the
//! HTTP API, and writes status only when the phase changes (Running, then Succeeded or Failed:
//! two writes per test, three at most). Deletes the test when its TTL after finishing has passed.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::{Resource as _, ResourceExt as _};
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::names::{API_VERSION, MANAGER_NETWORK_TEST};
use nodekeeper_model::address_policy::Cidr;
use tracing::{debug, info, warn};

use super::aggregate::aggregate;
use super::plan::{self, SourceNode, SpecError};
use super::status::{Event, Expiry, TestStatus, expiry, transition};
use super::store::StoredResults;
use super::{Context, crd, fanout, wire};
use crate::shared::AgentNode;
use crate::shared::agent_client::{CallError, CallOutcome};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("list nodes for networktest {test}: {source}")]
    ListNodes { test: String, source: kube::Error },
    #[error("write status of networktest {test}: {source}")]
    WriteStatus { test: String, source: kube::Error },
    #[error("delete expired networktest {test}: {source}")]
    DeleteExpired { test: String, source: kube::Error },
}

impl Error {
    /// Whether the NetworkTest was deleted while its status was being written (the status
    /// subresource answers 404): nothing is left to retry.
    pub fn test_is_gone(&self) -> bool {
        matches!(self, Error::WriteStatus { source: kube::Error::Api(s), .. } if s.code == 404)
    }
}

/// Nodes read per page while a test selects its sources. Read whole, a 10,000-node list is held
/// as decoded Nodes (about 27 KiB each) for the length of the test; page by page, only the
/// name, address and pod ranges of each stay.
const NODE_LIST_PAGE: u32 = 500;

/// The nodes `nt` selects, as sources (name and InternalIP), read page by page; without
/// `--pod-cidrs`, their pod ranges are added to `allowed`.
async fn select_sources(
    ctx: &Context,
    nt: &NetworkTest,
    test: &str,
    allowed: &mut Vec<Cidr>,
) -> Result<Vec<SourceNode>, Error> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let mut lp = ListParams::default()
        .labels(&nt.spec.node_selector.to_query())
        .limit(NODE_LIST_PAGE);
    let mut sources = Vec::new();
    loop {
        let page = nodes.list(&lp).await.map_err(|source| Error::ListNodes {
            test: test.to_owned(),
            source,
        })?;
        for node in &page.items {
            if ctx.policy.pod_cidrs_from_nodes {
                allowed.extend(
                    node.spec
                        .as_ref()
                        .and_then(|s| s.pod_cidrs.as_ref())
                        .into_iter()
                        .flatten()
                        .filter_map(|c| c.parse::<Cidr>().ok()),
                );
            }
            let facts = crate::shared::fleet::node_facts(node);
            match facts.address {
                Some(address) => sources.push(SourceNode {
                    name: facts.name,
                    address,
                }),
                None => {
                    warn!(%test, node = %facts.name, "node has no InternalIP; it cannot run probes")
                }
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => lp.continue_token = Some(token),
            None => return Ok(sources),
        }
    }
}

/// How often a running test checks that its object still exists.
const DELETED_POLL: Duration = Duration::from_secs(5);

/// Completes once the test `uid` is deleted (or its name holds another test): the run is then
/// cancelled. A failed read is not taken for a deletion. Read as a list of the one name (its
/// metadata only): the controller's role may list and watch tests, not get them.
async fn deleted(api: Api<NetworkTest>, name: String, uid: String) {
    let lp = ListParams::default().fields(&format!("metadata.name={name}"));
    loop {
        tokio::time::sleep(DELETED_POLL).await;
        match api.list_metadata(&lp).await {
            Ok(found) => {
                let found_uid = found.items.first().and_then(|nt| nt.uid());
                if fanout::run_is_cancelled(found_uid.as_deref(), &uid) {
                    return;
                }
            }
            Err(error) => {
                debug!(%error, %name, "could not check whether the networktest still exists")
            }
        }
    }
}

/// Logs the failure and retries in 30 s; a test deleted meanwhile is left alone.
pub fn error_policy(nt: Arc<NetworkTest>, error: &Error, _ctx: Arc<Context>) -> Action {
    if error.test_is_gone() {
        debug!(test = %nt.name_any(), "networktest deleted while its status was written; nothing to retry");
        return Action::await_change();
    }
    warn!(%error, test = %nt.name_any(), "networktest reconcile failed; retrying in 30s");
    Action::requeue(Duration::from_secs(30))
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

pub async fn reconcile(nt: Arc<NetworkTest>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = nt.namespace().unwrap_or_default();
    let name = nt.name_any();
    let uid = nt.uid().unwrap_or_default();
    let test = format!("{ns}/{name}");
    let api: Api<NetworkTest> = Api::namespaced(ctx.client.clone(), &ns);
    let generation = nt.meta().generation;
    let ttl = i64::from(nt.spec.ttl_seconds_after_finished);
    let current = crd::current(nt.status.as_ref());

    if current.as_ref().is_some_and(|s| s.phase.is_terminal()) {
        return match expiry(current.as_ref(), Some(ttl), now_unix()) {
            Expiry::Delete => {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: Some(uid.clone()),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                match api.delete(&name, &dp).await {
                    Ok(_) => info!(%test, "networktest deleted after its TTL"),
                    Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                    Err(source) => return Err(Error::DeleteExpired { test, source }),
                }
                ctx.store.remove(&ns, &name, &uid);
                Ok(Action::await_change())
            }
            Expiry::RecheckAfter(secs) => Ok(Action::requeue(Duration::from_secs(secs))),
            Expiry::Keep => Ok(Action::await_change()),
        };
    }
    let write = |status: TestStatus| {
        let api = api.clone();
        let name = name.clone();
        let test = test.clone();
        async move {
            let body = serde_json::json!({
                "apiVersion": API_VERSION,
                "kind": "NetworkTest",
                "status": crd::status(&status, generation),
            });
            api.patch_status(
                &name,
                &PatchParams::apply(MANAGER_NETWORK_TEST).force(),
                &Patch::Apply(&body),
            )
            .await
            .map_err(|source| Error::WriteStatus { test, source })?;
            Ok::<TestStatus, Error>(status)
        }
    };
    // This process finished the test: do not run it again (a restarted controller has no
    // results and does run it again). Either the watch has not shown the final status yet, or
    // writing it failed and it is written now from the results held.
    if let Some((stored, written)) = ctx.store.get_with_status(&ns, &name)
        && stored.uid == uid
    {
        return match after_store_hit(current.as_ref(), &stored, written) {
            StoreHit::WriteFinal(status) => {
                write(status).await?;
                ctx.store.mark_status_written(&ns, &name, &uid);
                info!(%test, "networktest final status written from the results held");
                Ok(Action::requeue(Duration::from_secs(
                    u64::try_from(ttl).unwrap_or(0),
                )))
            }
            StoreHit::WaitForWatch => Ok(Action::requeue(Duration::from_secs(5))),
        };
    }
    let reject = |e: SpecError| {
        let current = current.clone();
        let test = test.clone();
        async move {
            info!(%test, field = %e.field, reason = %e.reason, "networktest refused");
            if let Some(status) = transition(current.as_ref(), Event::Rejected(e), now_unix()) {
                write(status).await?;
            }
            Ok::<Action, Error>(Action::requeue(Duration::from_secs(
                u64::try_from(ttl).unwrap_or(0),
            )))
        }
    };

    let spec = match crd::spec(&nt.spec) {
        Ok(s) => s,
        Err(e) => return reject(e).await,
    };

    // Right after start or failover the policy lacks the node addresses and probeAllowedCidrs,
    // and the fleet which nodes are managed: a test planned now would be refused wrongly.
    let fleet_synced = ctx.policy.fleet.as_ref().map(|f| f.synced());
    let tuning_settled = ctx.policy.tuning.as_ref().map(|t| t.borrow().settled);
    if let Some(what) = waiting_for(fleet_synced, tuning_settled) {
        debug!(%test, "networktest waits for {what}");
        return Ok(Action::requeue(Duration::from_secs(2)));
    }

    let mut env = ctx.env.clone();
    env.allowed.extend(ctx.allowed_ranges());
    let listed = select_sources(&ctx, &nt, &test, &mut env.allowed).await?;
    // Only nodes this controller manages (its --node-selector) have agents it may call.
    let managed = {
        let fleet = ctx.policy.fleet.as_ref().map(|f| f.lock());
        managed_sources(listed, |n| fleet.as_ref().is_none_or(|f| f.contains_key(n)))
    };
    let sources = match managed {
        Ok(s) => s,
        Err(e) => return reject(e).await,
    };

    let mut names: Vec<String> = plan::hostnames_to_resolve(&spec)
        .into_iter()
        .map(|(_, h)| h)
        .collect();
    names.sort();
    names.dedup();
    let resolved = fanout::resolve(&names, Duration::from_secs(5)).await;
    let test_plan = match plan::plan(&spec, &sources, &env, &resolved, &uid) {
        Ok(p) => p,
        Err(e) => return reject(e).await,
    };

    let started = Event::Started {
        sources: test_plan.sources.len(),
        pairs: test_plan.pair_count(),
    };
    let running = match transition(current.as_ref(), started, now_unix()) {
        Some(status) => write(status).await?,
        // Running already (this is a restarted controller): run again, write nothing yet.
        None => current
            .clone()
            .expect("a status exists when no transition is needed"),
    };
    info!(%test, sources = test_plan.sources.len(), pairs = test_plan.pair_count(), "networktest running");

    let addresses: BTreeMap<String, IpAddr> = sources
        .iter()
        .map(|s| (s.name.clone(), s.address))
        .collect();
    let run_id = format!("{ns}/{name}/{uid}");
    let port = ctx.agent_port;
    let cancelled = deleted(api.clone(), name.clone(), uid.clone());
    let outcomes = fanout::fan_out_until(
        &test_plan,
        ctx.agent_concurrency,
        |source, targets, budget| {
            let node = AgentNode {
                endpoint: SocketAddr::new(addresses[&source], port),
                name: source.clone(),
            };
            let allowed = test_plan.allowed_for(&targets);
            let request = wire::request(&run_id, &test_plan.params, &targets, allowed);
            let agents = Arc::clone(&ctx.agents);
            async move {
                let response = agents
                    .run_probes(&node, request, budget)
                    .await
                    .map_err(|e| call_failure(&e))?;
                Ok(wire::pairs(&source, &targets, response))
            }
        },
        cancelled,
    )
    .await;
    let Some(outcomes) = outcomes else {
        info!(%test, "networktest deleted while running; its probes were cancelled");
        return Ok(Action::await_change());
    };
    let summary = aggregate(&test_plan, &outcomes);
    let pairs = fanout::flatten(&outcomes, &test_plan);
    let finished_at = now_unix();
    ctx.store.insert(
        &ns,
        &name,
        StoredResults {
            uid: uid.clone(),
            finished_unix: finished_at,
            summary: summary.clone(),
            pairs,
        },
    );
    info!(
        %test,
        pairs = summary.pairs,
        failed = summary.pairs_failed,
        loss_percent = summary.loss_percent,
        "networktest finished"
    );
    if let Some(status) = transition(Some(&running), Event::Finished(summary), finished_at) {
        write(status).await?;
    }
    ctx.store.mark_status_written(&ns, &name, &uid);
    Ok(Action::requeue(Duration::from_secs(
        u64::try_from(ttl).unwrap_or(0),
    )))
}

/// What the address policy and the managed set still wait for, if anything: the Node watch's
/// first full list (`fleet_synced`) and the tuning ConfigMap's first read (`tuning_settled`);
/// `None` for a source this context does not have.
pub fn waiting_for(
    fleet_synced: Option<bool>,
    tuning_settled: Option<bool>,
) -> Option<&'static str> {
    if fleet_synced == Some(false) {
        Some("the node list to sync")
    } else if tuning_settled == Some(false) {
        Some("the tuning ConfigMap to be read")
    } else {
        None
    }
}

/// The listed nodes this controller manages (`is_managed`), in order. Nodes it does not manage
/// are dropped before `spec.maxNodes` picks the sources: their agents are never called. None
/// managed while some matched is refused naming the selector and the flag.
pub fn managed_sources(
    listed: Vec<SourceNode>,
    is_managed: impl Fn(&str) -> bool,
) -> Result<Vec<SourceNode>, SpecError> {
    let matched = listed.len();
    let managed: Vec<SourceNode> = listed.into_iter().filter(|s| is_managed(&s.name)).collect();
    if managed.is_empty() && matched > 0 {
        return Err(SpecError {
            field: "spec.nodeSelector".into(),
            reason: format!(
                "matches {matched} nodes, none of which this controller manages (its --node-selector); select managed nodes, or widen the controller's --node-selector"
            ),
        });
    }
    Ok(managed)
}

/// A failed `RunProbes` call as a source's outcome: an agent that answered `InvalidArgument`
/// refused the request ([`fanout::REFUSED`]); anything else left the agent unheard.
fn call_failure(e: &CallError) -> String {
    if e.outcome == CallOutcome::Status && e.detail.starts_with("InvalidArgument") {
        format!("{}{e}", fanout::REFUSED)
    } else {
        e.to_string()
    }
}

/// What a reconcile does with a test whose results this process holds.
#[derive(Debug, Clone, PartialEq)]
pub enum StoreHit {
    /// The final status was not written (the write failed): write this.
    WriteFinal(TestStatus),
    /// The final status was written but the watch has not shown it yet: look again shortly.
    WaitForWatch,
}

/// Decides what to do with a test whose results are held: write the final status from them
/// when no write succeeded (else the test would read Running forever), or wait for the watch.
pub fn after_store_hit(
    current: Option<&TestStatus>,
    stored: &StoredResults,
    status_written: bool,
) -> StoreHit {
    if status_written {
        return StoreHit::WaitForWatch;
    }
    match transition(
        current,
        Event::Finished(stored.summary.clone()),
        stored.finished_unix,
    ) {
        Some(status) => StoreHit::WriteFinal(status),
        None => StoreHit::WaitForWatch,
    }
}

#[cfg(test)]
mod tests {
    use super::super::aggregate::aggregate;
    use super::super::plan::{ProbeKind, ProbeParams, TestPlan};
    use super::super::status::Phase;
    use super::*;

    fn stored(finished_unix: i64) -> StoredResults {
        let plan = TestPlan {
            ranges: Vec::new(),
            params: ProbeParams {
                kind: ProbeKind::Icmp,
                count: 1,
                interval_ms: 1,
                timeout_ms: 1,
                expected_status: vec![],
                max_mtu: 0,
            },
            sources: [("n0".to_owned(), vec![Default::default()])]
                .into_iter()
                .collect(),
        };
        let outcomes = [("n0".to_owned(), Err("refused".to_owned()))]
            .into_iter()
            .collect();
        StoredResults {
            uid: "u".into(),
            finished_unix,
            summary: aggregate(&plan, &outcomes),
            pairs: vec![],
        }
    }

    /// A final status write that failed leaves the results held and the test Running: the next
    /// reconcile writes the final status from them, stamped with when the test finished.
    #[test]
    fn a_failed_final_write_is_retried_from_the_results_held() {
        let running = transition(
            None,
            Event::Started {
                sources: 1,
                pairs: 1,
            },
            100,
        )
        .unwrap();
        let held = stored(160);
        match after_store_hit(Some(&running), &held, false) {
            StoreHit::WriteFinal(s) => {
                assert_eq!(s.phase, Phase::Failed);
                assert_eq!((s.start_unix, s.completion_unix), (Some(100), Some(160)));
                assert_eq!(s.summary, Some(held.summary.bounded()));
            }
            other => panic!("expected the final status to be written, got {other:?}"),
        }
        // Written already: only the watch is behind.
        assert_eq!(
            after_store_hit(Some(&running), &held, true),
            StoreHit::WaitForWatch
        );
    }

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("m", "r")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn tests_wait_until_the_policy_sources_are_ready() {
        assert_eq!(waiting_for(None, None), None);
        assert_eq!(waiting_for(Some(true), Some(true)), None);
        assert!(waiting_for(Some(false), Some(true)).is_some());
        assert!(waiting_for(Some(true), Some(false)).is_some());
        assert!(waiting_for(None, Some(false)).is_some());
    }

    #[test]
    fn only_managed_nodes_are_sources() {
        let node = |n: &str, a: &str| SourceNode {
            name: n.into(),
            address: a.parse().unwrap(),
        };
        let listed = vec![
            node("a", "10.0.0.1"),
            node("b", "10.0.0.2"),
            node("c", "10.0.0.3"),
        ];
        let got = managed_sources(listed.clone(), |n| n != "a").unwrap();
        assert_eq!(
            got.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["b", "c"]
        );
        // Before maxNodes: with maxNodes 1 the source is b, a managed node, not the unmanaged a.
        let spec = plan::TestSpec {
            kind: "icmp".into(),
            targets: vec![plan::TargetSpec::Address("10.0.0.2".into())],
            count: 1,
            interval_ms: 100,
            timeout_ms: 100,
            max_nodes: Some(1),
            port: None,
            resolver: None,
            expected_status: vec![],
            max_mtu: None,
        };
        let p = plan::plan(
            &spec,
            &got,
            &plan::Environment::default(),
            &BTreeMap::new(),
            "u",
        )
        .unwrap();
        assert_eq!(p.sources.keys().collect::<Vec<_>>(), ["b"]);
        let e = managed_sources(listed, |_| false).unwrap_err();
        assert_eq!(e.field, "spec.nodeSelector");
        assert!(e.reason.contains("--node-selector"), "{e}");
        assert_eq!(managed_sources(vec![], |_| false), Ok(vec![]));
    }

    #[test]
    fn an_invalid_argument_answer_is_a_refusal_not_an_unreachable_agent() {
        let err = |outcome, detail: &str| CallError {
            outcome,
            endpoint: "10.0.0.2:4443".parse().unwrap(),
            detail: detail.into(),
        };
        let refused = call_failure(&err(
            CallOutcome::Status,
            "InvalidArgument: max_mtu: 1000 is below the IPv6 minimum MTU 1280",
        ));
        assert!(fanout::is_refusal(&refused), "{refused}");
        assert_eq!(
            fanout::unanswered(&refused),
            "agent refused the request: 10.0.0.2:4443: InvalidArgument: max_mtu: 1000 is below the IPv6 minimum MTU 1280"
        );
        let down = call_failure(&err(CallOutcome::Connect, "connection refused"));
        assert!(!fanout::is_refusal(&down));
        assert_eq!(
            fanout::unanswered(&down),
            "agent unreachable: 10.0.0.2:4443: connection refused"
        );
    }

    #[test]
    fn only_a_status_write_answered_404_means_the_test_is_gone() {
        let write = |code| Error::WriteStatus {
            test: "ns/t".into(),
            source: api_error(code),
        };
        assert!(write(404).test_is_gone());
        assert!(!write(409).test_is_gone());
        assert!(!write(500).test_is_gone());
        let list = Error::ListNodes {
            test: "ns/t".into(),
            source: api_error(404),
        };
        assert!(!list.test_is_gone());
    }
}
