//! The `NodeDiagnostic` reconciler: a finalizer guards the bundles on disk (deleted with the
//! object); the spec is checked (parts, node cap); the nodes are resolved; status goes Running;
//! each node's bundle streams from its agent to disk with bounded concurrency; status goes
//! Succeeded or Failed (two writes per collection). Past its TTL the object is deleted, and the
//! finalizer then deletes its bundles. An object deleted while its bundles stream stops them at
//! once, as the controller's watch shows the deletion (`deletions`; the finalizer then runs),
//! and a final status whose write failed is written again from what this process holds, not
//! collected again. The bundles of objects deleted while another replica led are removed once
//! per leadership, after the watch's first list ([`sweep_at_start`]), before any collection.

use std::collections::HashMap;
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
use tracing::{debug, info, warn};

use super::status::{self, Expiry, Storage};
use super::{Context, collect};
use crate::controllers::Reconciler as _;
use crate::shared::AgentNode;
use crate::shared::agent_client::{CallError, CallOutcome};

/// UIDs remembered as finished by this process (see `Context::finished`).
const MAX_REMEMBERED: usize = 4096;

/// How long the sweep at a leadership start waits after a failed list before trying again.
const SWEEP_RETRY: Duration = Duration::from_secs(30);

/// A collection this process finished (see `Context::finished`).
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    /// The final status.
    pub status: NodeDiagnosticStatus,
    /// Whether writing it succeeded.
    pub written: bool,
}

/// What a reconcile does with an object whose collection this process finished.
#[derive(Clone, Debug, PartialEq)]
pub enum AfterFinish {
    /// Writing the final status failed: write it again (the bundles are on disk already).
    WriteFinal(NodeDiagnosticStatus),
    /// It is written; the watch has not shown it yet: look again shortly.
    WaitForWatch,
}

/// Decides for an object this process finished: never collect again; write the final status if
/// no write of it succeeded (else the object would read Running until the next leader).
pub fn after_finish(held: &Finished) -> AfterFinish {
    if held.written {
        AfterFinish::WaitForWatch
    } else {
        AfterFinish::WriteFinal(held.status.clone())
    }
}

/// Whether the collection of the object `uid` is to stop: `found` (the object under its name
/// as the watch shows it now) is gone, is being deleted, or is another object.
pub fn collection_cancelled(found: Option<&NodeDiagnostic>, uid: &str) -> bool {
    found.is_none_or(|o| o.metadata.deletion_timestamp.is_some() || o.uid().as_deref() != Some(uid))
}

/// `collection`'s output, or `None` once `deleted` completes first: the collection is dropped
/// where it waits (every agent stream with it).
async fn unless_deleted<T>(
    collection: impl Future<Output = T>,
    deleted: impl Future<Output = ()>,
) -> Option<T> {
    tokio::select! {
        output = collection => Some(output),
        () = deleted => None,
    }
}

/// Gathers `bundles` as they arrive, writing the nodes done so far into the Running status
/// (`write`, which says whether it succeeded) at most every [`status::PROGRESS_EVERY`], and only
/// when some node finished since the last write.
async fn with_progress<S, W, Fut>(
    bundles: S,
    running: &NodeDiagnosticStatus,
    mut write: W,
) -> Vec<(NodeBundle, Storage)>
where
    S: futures::Stream<Item = (NodeBundle, Storage)>,
    W: FnMut(NodeDiagnosticStatus) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut bundles = std::pin::pin!(bundles);
    let mut results: Vec<(NodeBundle, Storage)> = Vec::new();
    let mut shown = 0;
    let mut next_write = tokio::time::Instant::now();
    loop {
        let item = if shown < results.len() {
            // Biased: what has arrived is taken first, so the last node ends the loop (the final
            // status shows it) rather than a progress write.
            tokio::select! {
                biased;
                item = bundles.next() => item,
                () = tokio::time::sleep_until(next_write) => {
                    let done: Vec<NodeBundle> = results.iter().map(|(b, _)| b.clone()).collect();
                    if write(status::progress(running, &done)).await {
                        shown = done.len();
                    }
                    next_write = tokio::time::Instant::now() + status::PROGRESS_EVERY;
                    continue;
                }
            }
        } else {
            bundles.next().await
        };
        match item {
            Some(result) => results.push(result),
            None => return results,
        }
    }
}

/// A node list the API server answered 400 (Bad Request): it refused `spec.nodeSelector`, which
/// no retry changes. `validate` catches what it knows; this names the rest, as a refusal.
pub fn selector_refused(error: &kube::Error) -> Option<FieldError> {
    match error {
        kube::Error::Api(status) if status.code == 400 => Some(FieldError::new(
            "spec.nodeSelector",
            format!(
                "the API server refused the selector when listing nodes: {}",
                status.message
            ),
        )),
        _ => None,
    }
}

/// A stream that could not be opened, as the node's reason: what the agent answered when it
/// answered (an older agent without the call, a refused request), "unreachable" only when no
/// answer came.
pub fn open_failure(e: &CallError) -> String {
    let code = e.detail.split(':').next().unwrap_or_default();
    match e.outcome {
        CallOutcome::Connect | CallOutcome::Timeout => format!("agent unreachable: {e}"),
        CallOutcome::Tls => format!(
            "TLS handshake with the agent failed (check the agent and controller certificates): {e}"
        ),
        CallOutcome::NotManaged => e.detail.clone(),
        _ if code == "Unimplemented" => format!(
            "the agent does not serve diagnostics bundles (an older agent version? upgrade it): {e}"
        ),
        _ if matches!(
            code,
            "InvalidArgument" | "FailedPrecondition" | "PermissionDenied" | "ResourceExhausted"
        ) =>
        {
            format!("the agent refused the request: {e}")
        }
        _ => format!("the agent answered with an error: {e}"),
    }
}

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
    #[error("list nodediagnostics to remove the bundles of deleted ones: {source}")]
    Sweep { source: kube::Error },
    #[error("nodediagnostic finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

/// Logs the failure and retries in 30 s.
pub fn error_policy(obj: Arc<NodeDiagnostic>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, object = %obj.name_any(), "nodediagnostic reconcile failed; retrying in 30s");
    Action::requeue(Duration::from_secs(30))
}

pub async fn reconcile(obj: Arc<NodeDiagnostic>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Every reconcile waits for the one sweep (so no collection races it); a failed one is
    // tried again by the next.
    ctx.swept.get_or_try_init(|| sweep(&ctx)).await?;
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

/// The sweep when this replica starts leading, once the watch has listed the NodeDiagnostics
/// (the scaffold's `after_initial_list`): also when there is none, so no reconcile comes to sweep
/// first, and the bundles of deleted objects would otherwise stay on disk, count against
/// `--diagnostics-max-bytes` and download with their old tokens. Reconciles wait on the same
/// `Context::swept`; a failed sweep is tried again every [`SWEEP_RETRY`] (and by any reconcile).
pub async fn sweep_at_start(ctx: Arc<Context>) {
    loop {
        match ctx.swept.get_or_try_init(|| sweep(&ctx)).await {
            Ok(()) => return,
            Err(error) => {
                warn!(%error, "could not sweep the diagnostics store; retrying in 30s");
                tokio::time::sleep(SWEEP_RETRY).await;
            }
        }
    }
}

/// Removes the bundles on this replica's disk of NodeDiagnostics that no longer exist (deleted,
/// their finalizer run, while another replica led), or whose name now holds another object.
async fn sweep(ctx: &Context) -> Result<(), Error> {
    let list = ctx
        .api()
        .list_metadata(&ListParams::default())
        .await
        .map_err(|source| Error::Sweep { source })?;
    let live: HashMap<(String, String), String> = list
        .items
        .iter()
        .map(|o| {
            let key = (o.namespace().unwrap_or_default(), o.name_any());
            (key, o.uid().unwrap_or_default())
        })
        .collect();
    let only = ctx.namespace.as_deref();
    let removed = ctx
        .store
        .sweep(|ns, name, owner| bundles_kept(&live, only, ns, name, owner));
    if !removed.is_empty() {
        info!(
            objects = removed.len(),
            "removed the bundles of deleted nodediagnostics"
        );
    }
    Ok(())
}

/// Whether the bundles in `<ns>/<name>` (of the object `owner`, when recorded) belong to a live
/// object: one in `live` (by namespace and name, its UID) with that UID. Namespaces this
/// controller does not watch (`only`) are left alone.
pub fn bundles_kept(
    live: &HashMap<(String, String), String>,
    only: Option<&str>,
    ns: &str,
    name: &str,
    owner: Option<&str>,
) -> bool {
    only.is_some_and(|only| only != ns)
        || live
            .get(&(ns.to_owned(), name.to_owned()))
            .is_some_and(|uid| owner.is_none_or(|owner| owner == uid))
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
    // From here on, the watch's news of a deletion stops the collection (see `deletions`).
    let collecting = ctx.deletions.collecting(&uid);
    let held = ctx
        .finished
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&uid)
        .map(after_finish);
    match held {
        // Finished here; the watch has not shown the final status yet.
        Some(AfterFinish::WaitForWatch) => return Ok(Action::requeue(Duration::from_secs(2))),
        Some(AfterFinish::WriteFinal(done)) => {
            write_status(&api, &name, &object, current, &done).await?;
            mark_written(ctx, &uid);
            info!(%object, "nodediagnostic final status written from the results held");
            return Ok(requeue_after_ttl(ttl));
        }
        None => {}
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
        let list = match nodes_api.list(&lp).await {
            Ok(list) => list,
            Err(e) => match selector_refused(&e) {
                Some(refusal) => return refuse(refusal).await,
                None => return Err(read_error(e)),
            },
        };
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
    if let Err(error) = ctx.store.set_owner(&ns, &name, &uid) {
        warn!(%error, %object, "could not record the owner of the bundles' directory");
    }

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
    let bundles = futures::stream::iter(nodes)
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
        .buffer_unordered(ctx.agent_concurrency.max(1));
    let collection = with_progress(bundles, &running, |next| {
        let (api, name, object) = (api.clone(), name.clone(), object.clone());
        async move {
            let written = write_status(&api, &name, &object, None, &next).await;
            if let Err(error) = &written {
                debug!(%error, %object, "could not write the collection's progress");
            }
            written.is_ok()
        }
    });
    // Deleted meanwhile: every stream is dropped here, and the finalizer (the next reconcile,
    // queued by the deletion) deletes what reached the disk.
    let Some(results) = unless_deleted(collection, collecting.cancelled()).await else {
        info!(%object, "nodediagnostic deleted while collecting; its bundle streams were cancelled");
        return Ok(Action::await_change());
    };
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
    {
        let mut finished = ctx.finished.lock().unwrap_or_else(PoisonError::into_inner);
        // Bounded: an entry only matters until the watch shows the final status (seconds, or
        // until a failed write succeeds); a full map is cleared rather than grown.
        if finished.len() >= MAX_REMEMBERED {
            finished.clear();
        }
        finished.insert(
            uid.clone(),
            Finished {
                status: done.clone(),
                written: false,
            },
        );
    }
    // The objects whose bundles made room for these say so now, not at their TTL (and before
    // this object's own write, which may fail and is then retried without them).
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
    // Held before the write: a failed write is retried (error_policy) from the status held.
    write_status(&api, &name, &object, Some(&running), &done).await?;
    mark_written(ctx, &uid);
    Ok(requeue_after_ttl(ttl))
}

/// Records that the final status of `uid` is written.
fn mark_written(ctx: &Context, uid: &str) {
    if let Some(held) = ctx
        .finished
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_mut(uid)
    {
        held.written = true;
    }
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
        Err(mut full) => {
            // What was evicted before the room fell short is told to its objects all the same.
            storage.evicted = std::mem::take(&mut full.evicted);
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
            return (failed(&node_name, open_failure(&e)), storage);
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

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use nodekeeper_api::crd::NodeDiagnosticSpec;

    use super::*;

    fn object(uid: &str, deleting: bool) -> NodeDiagnostic {
        let mut o = NodeDiagnostic::new(
            "d",
            serde_json::from_value::<NodeDiagnosticSpec>(serde_json::json!({"nodeName": "n1"}))
                .unwrap(),
        );
        o.metadata.uid = Some(uid.into());
        if deleting {
            o.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        }
        o
    }

    #[test]
    fn a_collection_stops_once_its_object_is_deleted_or_replaced() {
        assert!(!collection_cancelled(Some(&object("u1", false)), "u1"));
        // Deleted (the finalizer holds it, marked), gone, or the name holds another object.
        assert!(collection_cancelled(Some(&object("u1", true)), "u1"));
        assert!(collection_cancelled(None, "u1"));
        assert!(collection_cancelled(Some(&object("u2", false)), "u1"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_deleted_objects_collection_is_dropped_where_it_waits() {
        // Nothing reads the object: the controller's watch shows an update (no deletion) at
        // 1 s, then at 2.5 s the object marked for deletion (its finalizer holds it).
        let deletions = super::super::deletions::Deletions::default();
        let collecting = deletions.collecting("u1");
        let watch = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            deletions.observe(&kube::runtime::watcher::Event::Apply(object("u1", false)));
            tokio::time::sleep(Duration::from_millis(1500)).await;
            deletions.observe(&kube::runtime::watcher::Event::Apply(object("u1", true)));
            futures::future::pending::<()>().await;
        };
        // A bundle stream that never ends, holding a reservation as a real one does.
        let dropped = Arc::new(());
        let held = Arc::clone(&dropped);
        let stuck = async move {
            let _held = held;
            futures::future::pending::<Vec<(NodeBundle, Storage)>>().await
        };
        let started = tokio::time::Instant::now();
        let outcome = tokio::select! {
            outcome = unless_deleted(stuck, collecting.cancelled()) => outcome,
            () = watch => unreachable!("the watch feeder never ends"),
        };
        assert_eq!(outcome, None);
        // Stopped when the watch showed the deletion, not at the next tick of a poll.
        assert_eq!(started.elapsed(), Duration::from_millis(2500));
        assert_eq!(Arc::strong_count(&dropped), 1, "the collection was dropped");
        // A collection that ends first gives its results.
        let done = unless_deleted(async { 7 }, futures::future::pending()).await;
        assert_eq!(done, Some(7));
    }

    #[test]
    fn a_node_list_answered_400_refuses_the_selector() {
        let api_error = |code: u16| {
            kube::Error::Api(
                kube::core::Status::failure(
                    "unable to parse requirement: invalid label key",
                    "BadRequest",
                )
                .with_code(code)
                .boxed(),
            )
        };
        let refusal = selector_refused(&api_error(400)).unwrap();
        assert_eq!(refusal.field, "spec.nodeSelector");
        assert!(refusal.message.contains("invalid label key"), "{refusal}");
        for code in [403, 429, 500, 503] {
            assert!(selector_refused(&api_error(code)).is_none(), "{code}");
        }
    }

    #[test]
    fn only_the_bundles_of_live_objects_are_kept() {
        let live: HashMap<(String, String), String> =
            [(("ns".to_owned(), "d".to_owned()), "u1".to_owned())].into();
        assert!(bundles_kept(&live, None, "ns", "d", Some("u1")));
        // Stored before owners were recorded: kept while the name lives.
        assert!(bundles_kept(&live, None, "ns", "d", None));
        // An earlier object of the same name, a deleted one.
        assert!(!bundles_kept(&live, None, "ns", "d", Some("u0")));
        assert!(!bundles_kept(&live, None, "ns", "gone", Some("u2")));
        assert!(!bundles_kept(&live, None, "other", "d", None));
        // A controller watching one namespace leaves the others alone.
        assert!(bundles_kept(&live, Some("ns2"), "other", "gone", None));
        assert!(!bundles_kept(&live, Some("ns"), "ns", "gone", None));
    }

    #[tokio::test(start_paused = true)]
    async fn progress_is_written_at_most_every_few_seconds_and_only_when_nodes_finished() {
        let nodes: Vec<String> = (1..=4).map(|i| format!("n{i}")).collect();
        let running = status::running(None, &nodes, Some(1), 100);
        let start = tokio::time::Instant::now();
        // Nodes finish at 1 s, 2 s, 3 s and 20 s.
        let bundles = futures::stream::iter([1u64, 2, 3, 20].into_iter().enumerate()).then(
            move |(i, at)| async move {
                tokio::time::sleep_until(start + Duration::from_secs(at)).await;
                let node = format!("n{}", i + 1);
                let bundle = status::without_bundle(&node, Phase::Succeeded, String::new());
                (bundle, Storage::default())
            },
        );
        let writes = std::sync::Mutex::new(Vec::new());
        let results = with_progress(bundles, &running, |next| {
            let done = next
                .nodes
                .iter()
                .filter(|n| n.phase == Phase::Succeeded)
                .count();
            writes
                .lock()
                .unwrap()
                .push((start.elapsed().as_secs(), done));
            async { true }
        })
        .await;
        assert_eq!(results.len(), 4);
        // At 1 s (the first node), at 6 s (the two since), none while nothing finished; the
        // last node is the final status's.
        assert_eq!(*writes.lock().unwrap(), vec![(1, 1), (6, 3)]);
    }

    #[test]
    fn a_failed_final_write_is_written_again_not_collected_again() {
        let done = NodeDiagnosticStatus {
            phase: Some(Phase::Succeeded),
            node_count: 1,
            ..NodeDiagnosticStatus::default()
        };
        let mut held = Finished {
            status: done.clone(),
            written: false,
        };
        assert_eq!(after_finish(&held), AfterFinish::WriteFinal(done));
        held.written = true;
        assert_eq!(after_finish(&held), AfterFinish::WaitForWatch);
    }

    #[test]
    fn a_failed_open_says_what_the_agent_answered() {
        let err = |outcome, detail: &str| CallError {
            outcome,
            endpoint: "10.0.0.2:4443".parse().unwrap(),
            detail: detail.into(),
        };
        let reason = open_failure(&err(
            CallOutcome::InvalidReply,
            "Unimplemented: unknown method CollectDiagnostics",
        ));
        assert!(
            reason.starts_with("the agent does not serve diagnostics bundles")
                && reason.contains("upgrade")
                && reason.contains("10.0.0.2:4443: Unimplemented"),
            "{reason}"
        );
        for detail in [
            "FailedPrecondition: this agent serves node other, not n1",
            "InvalidArgument: parts: unknown part \"x\"",
        ] {
            let reason = open_failure(&err(CallOutcome::Status, detail));
            assert!(
                reason.starts_with("the agent refused the request") && reason.contains(detail),
                "{reason}"
            );
        }
        let reason = open_failure(&err(CallOutcome::Status, "Internal: boom"));
        assert!(
            reason.starts_with("the agent answered with an error"),
            "{reason}"
        );
        for outcome in [CallOutcome::Connect, CallOutcome::Timeout] {
            let reason = open_failure(&err(outcome, "connection refused"));
            assert_eq!(
                reason,
                "agent unreachable: 10.0.0.2:4443: connection refused"
            );
        }
        let reason = open_failure(&err(CallOutcome::Tls, "invalid peer certificate"));
        assert!(reason.contains("certificate"), "{reason}");
        assert!(!reason.contains("unreachable"), "{reason}");
    }
}
