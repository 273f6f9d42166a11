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
    // This process finished the test but the watch has not shown the final status yet: do not
    // run it again (a restarted controller has no results and does run it again).
    if ctx.store.get(&ns, &name).is_some_and(|r| r.uid == uid) {
        return Ok(Action::requeue(Duration::from_secs(5)));
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

    let mut env = ctx.env.clone();
    env.allowed.extend(ctx.allowed_ranges());
    let sources = select_sources(&ctx, &nt, &test, &mut env.allowed).await?;

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
    let outcomes = fanout::fan_out(
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
                    .map_err(|e| e.to_string())?;
                Ok(wire::pairs(&source, &targets, response))
            }
        },
    )
    .await;
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
    Ok(Action::requeue(Duration::from_secs(
        u64::try_from(ttl).unwrap_or(0),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("m", "r")
                .with_code(code)
                .boxed(),
        )
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
