//! The `NodeDiagnostic` reconciler: a finalizer guards the bundles on disk (deleted with the
//! object); the spec is checked (parts, node cap); the nodes are resolved; status goes Running;
//! each node's bundle streams from its agent to disk with bounded concurrency; status goes
//! Succeeded or Failed (two writes per collection). Past its TTL the object is deleted, and the
//! finalizer then deletes its bundles.

use std::net::SocketAddr;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::{Resource as _, ResourceExt as _};
use nodekeeper_api::crd::node_diagnostic::{NodeBundle, NodeDiagnosticStatus, Phase};
use nodekeeper_api::crd::{FieldError, NodeDiagnostic};
use nodekeeper_api::names::{API_VERSION, FINALIZER_DIAGNOSTIC_BUNDLES, MANAGER_NODE_DIAGNOSTIC};
use nodekeeper_model::diagnostics::MAX_NODES;
use nodekeeper_proto::agent::v1 as pb;
use tracing::{info, warn};

use super::status::{self, Expiry, Storage};
use super::{Context, collect};
use crate::shared::AgentNode;

/// UIDs remembered as finished by this process (see `Context::finished`).
const MAX_REMEMBERED: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("read nodes for nodediagnostic {object}: {source}")]
    ReadNodes { object: String, source: kube::Error },
    #[error("write status of nodediagnostic {object}: {source}")]
    WriteStatus { object: String, source: kube::Error },
    #[error("delete expired nodediagnostic {object}: {source}")]
    DeleteExpired { object: String, source: kube::Error },
    #[error("delete bundles of nodediagnostic {object}: {source}")]
    DeleteBundles {
        object: String,
        source: std::io::Error,
    },
    #[error("nodediagnostic finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

/// Logs the failure and retries in 30 s.
pub fn error_policy(obj: Arc<NodeDiagnostic>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, object = %obj.name_any(), "nodediagnostic reconcile failed; retrying in 30s");
    Action::requeue(Duration::from_secs(30))
}

pub async fn reconcile(obj: Arc<NodeDiagnostic>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = obj.namespace().unwrap_or_default();
    let api: Api<NodeDiagnostic> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER_DIAGNOSTIC_BUNDLES, obj, |event| async {
        match event {
            FinalizerEvent::Apply(obj) => apply(obj, &ctx).await,
            FinalizerEvent::Cleanup(obj) => cleanup(&obj, &ctx),
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn cleanup(obj: &NodeDiagnostic, ctx: &Context) -> Result<Action, Error> {
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    ctx.store
        .remove_object(&ns, &name)
        .map_err(|source| Error::DeleteBundles {
            object: format!("{ns}/{name}"),
            source,
        })?;
    if let Some(uid) = obj.uid() {
        ctx.finished
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&uid);
    }
    info!(object = %format!("{ns}/{name}"), "nodediagnostic bundles deleted");
    Ok(Action::await_change())
}

async fn write_status(
    api: &Api<NodeDiagnostic>,
    name: &str,
    object: &str,
    current: Option<&NodeDiagnosticStatus>,
    next: &NodeDiagnosticStatus,
) -> Result<(), Error> {
    if current == Some(next) {
        return Ok(());
    }
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeDiagnostic",
        "status": next,
    });
    api.patch_status(
        name,
        &PatchParams::apply(MANAGER_NODE_DIAGNOSTIC).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| Error::WriteStatus {
        object: object.to_owned(),
        source,
    })?;
    Ok(())
}

fn requeue_after_ttl(ttl: u32) -> Action {
    Action::requeue(Duration::from_secs(u64::from(ttl).max(1)))
}

async fn apply(obj: Arc<NodeDiagnostic>, ctx: &Context) -> Result<Action, Error> {
    let ns = obj.namespace().unwrap_or_default();
    let name = obj.name_any();
    let object = format!("{ns}/{name}");
    let api: Api<NodeDiagnostic> = Api::namespaced(ctx.client.clone(), &ns);
    let generation = obj.meta().generation;
    let ttl = obj.spec.ttl_seconds_after_finished;
    let current = obj.status.as_ref();

    if let Some(done) = current.filter(|s| status::is_terminal(Some(s))) {
        mark_gone(ctx, &api, &ns, &name, done).await?;
        return match status::expiry(done, ttl, status::now_unix()) {
            Expiry::RecheckAfter(after) => Ok(Action::requeue(after)),
            Expiry::Delete => {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: obj.uid(),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                match api.delete(&name, &dp).await {
                    Ok(_) => info!(%object, "nodediagnostic deleted after its TTL"),
                    Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                    Err(source) => return Err(Error::DeleteExpired { object, source }),
                }
                Ok(Action::await_change())
            }
        };
    }

    let uid = obj.uid().unwrap_or_default();
    if ctx
        .finished
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&uid)
    {
        // Finished here; the watch has not shown the final status yet.
        return Ok(Action::requeue(Duration::from_secs(2)));
    }

    let refuse = |e: FieldError| {
        let api = api.clone();
        let (name, object) = (name.clone(), object.clone());
        async move {
            info!(%object, field = %e.field, reason = %e.message, "nodediagnostic refused");
            let next = status::refused(current, &e, generation, status::now_unix());
            write_status(&api, &name, &object, current, &next).await?;
            Ok::<Action, Error>(requeue_after_ttl(ttl))
        }
    };
    if let Err(e) = obj.spec.validate() {
        return refuse(e).await;
    }

    // The nodes: one by name (a missing one fails, named), or a selector cut at the cap + 1.
    let nodes_api: Api<Node> = Api::all(ctx.client.clone());
    let read_error = |source| Error::ReadNodes {
        object: object.clone(),
        source,
    };
    let mut missing = Vec::new();
    let nodes: Vec<Node> = if let Some(node) = &obj.spec.node_name {
        match nodes_api.get_opt(node).await.map_err(read_error)? {
            Some(n) => vec![n],
            None => {
                missing.push(node.clone());
                Vec::new()
            }
        }
    } else {
        let selector = obj.spec.node_selector.clone().unwrap_or_default();
        let lp = ListParams::default()
            .labels(&selector.to_query())
            .limit(u32::try_from(MAX_NODES + 1).unwrap_or(u32::MAX));
        let list = nodes_api.list(&lp).await.map_err(read_error)?;
        let more = list
            .metadata
            .continue_
            .as_deref()
            .is_some_and(|c| !c.is_empty());
        let matched = list.items.len() + usize::from(more);
        if let Err(e) = status::check_selection(matched) {
            return refuse(e).await;
        }
        list.items
    };

    let mut names: Vec<String> = nodes.iter().map(|n| n.name_any()).collect();
    names.extend(missing.iter().cloned());
    let running = status::running(current, &names, generation, status::now_unix());
    write_status(&api, &name, &object, current, &running).await?;
    info!(%object, nodes = names.len(), "nodediagnostic collecting");

    let (request, max_bundle, call_timeout) = {
        let tuning = ctx.tuning.borrow();
        let d = &tuning.config.diagnostics;
        let parts = if obj.spec.parts.is_empty() {
            d.parts.clone()
        } else {
            obj.spec.parts.clone()
        };
        (
            pb::DiagnosticsRequest {
                parts,
                max_bundle_bytes: d.max_bundle_bytes,
                ..Default::default()
            },
            d.max_bundle_bytes,
            tuning.config.call_timeout,
        )
    };
    let results: Vec<(NodeBundle, Storage)> = futures::stream::iter(nodes)
        .map(|node| {
            collect_node(
                ctx,
                &ns,
                &name,
                node,
                request.clone(),
                max_bundle,
                call_timeout,
            )
        })
        .buffer_unordered(ctx.agent_concurrency.max(1))
        .collect()
        .await;
    let mut storage = Storage::default();
    let mut bundles = Vec::with_capacity(results.len() + missing.len());
    for (bundle, s) in results {
        storage.evicted.extend(s.evicted);
        storage.full = storage.full.or(s.full);
        bundles.push(bundle);
    }
    for node in missing {
        bundles.push(failed(
            &node,
            format!("node {node} does not exist (spec.nodeName)"),
        ));
    }
    let evicted_objects: std::collections::BTreeSet<(String, String)> = storage
        .evicted
        .iter()
        .filter_map(|e| {
            let mut it = e.splitn(3, '/');
            Some((it.next()?.to_owned(), it.next()?.to_owned()))
        })
        .filter(|(n, o)| *n != ns || *o != name)
        .collect();
    let done = status::finished(
        Some(&running),
        bundles,
        &storage,
        generation,
        status::now_unix(),
    );
    info!(%object, phase = ?done.phase, failed = done.failed_count, "nodediagnostic finished");
    write_status(&api, &name, &object, Some(&running), &done).await?;
    {
        let mut finished = ctx.finished.lock().unwrap_or_else(PoisonError::into_inner);
        // Bounded: an entry only matters until the watch shows the final status (seconds); a
        // full set is cleared rather than grown.
        if finished.len() >= MAX_REMEMBERED {
            finished.clear();
        }
        finished.insert(uid);
    }
    // The objects whose bundles made room for these say so now, not at their TTL.
    for (other_ns, other) in evicted_objects {
        let other_api: Api<NodeDiagnostic> = Api::namespaced(ctx.client.clone(), &other_ns);
        let marked = match other_api.get_opt(&other).await {
            Ok(Some(o)) => match o.status.as_ref().filter(|s| status::is_terminal(Some(s))) {
                Some(done) => mark_gone(ctx, &other_api, &other_ns, &other, done).await,
                None => Ok(()),
            },
            Ok(None) => Ok(()),
            Err(source) => Err(Error::WriteStatus {
                object: format!("{other_ns}/{other}"),
                source,
            }),
        };
        if let Err(error) = marked {
            warn!(%error, %object, "could not mark evicted bundles in the other nodediagnostic's status");
        }
    }
    Ok(requeue_after_ttl(ttl))
}

/// Writes into a finished status which of its bundles are no longer on this controller's disk
/// (evicted for newer ones, or never here: a restart without the disk, another replica leading),
/// so nobody is pointed at a download that answers 410/404. Nothing is written when every bundle
/// is still there or already marked.
async fn mark_gone(
    ctx: &Context,
    api: &Api<NodeDiagnostic>,
    ns: &str,
    name: &str,
    done: &NodeDiagnosticStatus,
) -> Result<(), Error> {
    let gone: Vec<(String, &str)> = done
        .nodes
        .iter()
        .filter(|n| n.phase == Phase::Succeeded && !n.download_path.is_empty())
        .filter_map(|n| {
            ctx.store
                .missing_bundle(ns, name, &n.node)
                .map(|why| (n.node.clone(), why))
        })
        .collect();
    if gone.is_empty() {
        return Ok(());
    }
    let object = format!("{ns}/{name}");
    info!(%object, nodes = gone.len(), "nodediagnostic bundles gone; status updated");
    let next = status::bundles_gone(done, &gone, status::now_unix());
    write_status(api, name, &object, Some(done), &next).await
}

fn failed(node: &str, reason: String) -> NodeBundle {
    status::without_bundle(node, Phase::Failed, reason)
}

/// One node: room on disk, the agent's stream, the file. Every failure is this node's reason.
async fn collect_node(
    ctx: &Context,
    ns: &str,
    name: &str,
    node: Node,
    request: pb::DiagnosticsRequest,
    max_bundle: u64,
    call_timeout: Duration,
) -> (NodeBundle, Storage) {
    let facts = crate::shared::fleet::node_facts(&node);
    let node_name = facts.name;
    let mut storage = Storage::default();
    let Some(address) = facts.address else {
        return (
            failed(
                &node_name,
                "the node has no InternalIP: its agent cannot be reached".into(),
            ),
            storage,
        );
    };
    let reservation = match ctx.store.reserve(ns, name, max_bundle) {
        Ok(r) => r,
        Err(full) => {
            storage.full = Some(full.to_string());
            return (failed(&node_name, full.to_string()), storage);
        }
    };
    storage.evicted = reservation.evicted.clone();
    let Some(path) = ctx.store.bundle_path(ns, name, &node_name) else {
        return (
            failed(&node_name, "the diagnostics store is not configured".into()),
            storage,
        );
    };
    let agent = AgentNode {
        name: node_name.clone(),
        endpoint: SocketAddr::new(address, ctx.agent_port),
    };
    let stream = match ctx
        .agents
        .collect_diagnostics(&agent, request, call_timeout)
        .await
    {
        Ok(s) => s,
        Err(e) => {
            return (
                failed(&node_name, format!("agent unreachable: {e}")),
                storage,
            );
        }
    };
    let stored = collect::to_file(stream, &path, max_bundle, ctx.timeout).await;
    drop(reservation);
    match stored {
        Ok(stored) => {
            let s = &stored.summary;
            let reason = if s.parts_failed + s.parts_truncated > 0 {
                format!(
                    "{} parts ok, {} failed, {} skipped, {} truncated; see manifest.json",
                    s.parts_ok, s.parts_failed, s.parts_skipped, s.parts_truncated
                )
            } else {
                String::new()
            };
            (
                NodeBundle {
                    node: node_name.clone(),
                    phase: Phase::Succeeded,
                    size_bytes: stored.size,
                    sha256: stored.sha256,
                    download_path: status::download_path(ns, name, &node_name, &stored.token),
                    reason,
                },
                storage,
            )
        }
        Err(reason) => (failed(&node_name, reason), storage),
    }
}
