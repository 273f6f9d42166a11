//! The `NodeMaintenance` reconciler: reads the selected and the held Nodes from the watch cache
//! (`cache`), refuses unsafe selections before touching any, moves each node's hold as the
//! stage wants (cordon and taint with the prior state recorded, drain by plan through the
//! Eviction subresource, timeouts, release), writes Node metadata, Node conditions and the
//! status only when they change, and restores the nodes when the object is deleted
//! (finalizer). It is woken by the watches (a pod leaving a draining node, a budget allowing
//! again, a held node changing), not by polling; a slow requeue is only the safety net.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, NodeCondition, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource as _, ResourceExt as _};
use nodekeeper_api::crd::common::format_field_errors;
use nodekeeper_api::crd::node_maintenance::{
    BlockReason, BlockingPod, NodeMaintenanceStatus, NodePhase, SkippedPod, Stage,
};
use nodekeeper_api::crd::{LabelSelector, NodeMaintenance};
use nodekeeper_api::names::{
    ANNOTATION_MAINTENANCE, API_VERSION, LABEL_MAINTAINED, MANAGER_NODE_MAINTENANCE,
};
use tracing::{info, warn};

use super::admission::{self, CONTROL_PLANE_LABEL, Selection};
use super::cache::{CachedNode, CachedPod, NodeFacts, NotReady};
use super::eviction::{self, Admit, EvictionAnswer, admit};
use super::plan::{self, DeadlineStep, Owner, PodFacts, Rules};
use super::record::{self, Hold, HoldPhase, NodeRecord};
use super::stage::{self, Limits, NodeHold, Target};
use super::status::{self, NodeView, Outcome};
use super::{Context, TuningLimits};

/// Finalizer: the nodes are restored before the object goes.
pub const FINALIZER: &str = "nodekeeper.dev/node-maintenance";

/// How long a reconcile waits for the watches' first lists before it gives up and retries.
const CACHE_WAIT: Duration = Duration::from_secs(60);
/// How many holders missing from the maintenances' watch one reconcile asks the API server
/// about ([`release_orphans`]).
const ORPHAN_CHECKS: usize = 4;
/// How often a node write that lost a race (409) is tried again, each from a fresh read.
const WRITE_ATTEMPTS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("read the cluster for nodemaintenance {name}: {source}")]
    Cache { name: String, source: NotReady },
    #[error("write node {node} for nodemaintenance {name}: {source}")]
    WriteNode {
        name: String,
        node: String,
        source: kube::Error,
    },
    #[error("write status of nodemaintenance {name}: {source}")]
    WriteStatus { name: String, source: kube::Error },
    #[error("list the pods on node {node} for nodemaintenance {name}: {source}")]
    ListPods {
        name: String,
        node: String,
        source: kube::Error,
    },
    #[error("update finalizer of nodemaintenance {name}: {source}")]
    WriteFinalizer { name: String, source: kube::Error },
}

pub fn error_policy(nm: Arc<NodeMaintenance>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, maintenance = %nm.name_any(), "nodemaintenance reconcile failed; retrying in 10s");
    Action::requeue(Duration::from_secs(10))
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn rfc3339(unix: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_secs(u64::try_from(unix).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

/// One node as read this time.
struct Seen {
    node: Arc<NodeFacts>,
    selected: bool,
    record: Option<NodeRecord>,
}

impl Seen {
    fn of(cached: CachedNode, selected: bool) -> Self {
        Self {
            node: cached.node,
            selected,
            record: cached.record,
        }
    }
}

fn record_of(node: &Node) -> Option<NodeRecord> {
    NodeRecord::parse(
        node.annotations()
            .get(ANNOTATION_MAINTENANCE)
            .map(String::as_str),
    )
}

async fn publish(
    ctx: &Context,
    nm: &NodeMaintenance,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: reason.into(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &nm.object_ref(&())).await {
        warn!(%error, maintenance = %nm.name_any(), reason, "publishing an event failed");
    }
}

pub async fn reconcile(nm: Arc<NodeMaintenance>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = nm.name_any();
    let uid = nm.uid().unwrap_or_default();
    let client = ctx.kube().await;
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let nodes_api: Api<Node> = Api::all(client.clone());
    // Nothing is decided on a cache that has not listed yet (an empty pod list would read as
    // "drained"). The caches run only while a maintenance exists: this one may be seen here
    // before their own watch of the maintenances shows it.
    ctx.cache.want();
    ctx.cache
        .wait_ready(CACHE_WAIT)
        .await
        .map_err(|source| Error::Cache {
            name: name.clone(),
            source,
        })?;

    // Deleted: let go of every node this maintenance holds, then of the object.
    if nm.meta().deletion_timestamp.is_some() {
        if nm.finalizers().iter().any(|f| f == FINALIZER) {
            let held: Vec<Seen> = ctx
                .cache
                .held_nodes()
                .into_iter()
                .filter(|n| n.record.as_ref().is_some_and(|r| r.hold(&name).is_some()))
                .map(|n| Seen::of(n, false))
                .collect();
            let count = held.len();
            let mut uncordoned = 0;
            for mut seen in held {
                if write_node(&ctx, &nodes_api, &name, &mut seen, Target::Release, None).await? {
                    uncordoned += 1;
                }
            }
            if count > 0 {
                publish(
                    &ctx,
                    &nm,
                    EventType::Normal,
                    "NodesRestored",
                    format!("deleted while holding {count} nodes; released them, {uncordoned} uncordoned (a node cordoned before, or still held by another maintenance, stays cordoned)"),
                )
                .await;
            }
            set_finalizer(&api, &nm, false).await?;
        }
        ctx.cache.know(&name, false);
        ctx.forget_status(&uid);
        return Ok(Action::await_change());
    }
    ctx.cache.know(&name, true);
    release_orphans(&ctx, &api, &nodes_api, &name).await;

    let generation = nm.meta().generation;
    let stage = nm.spec.stage;
    // What this replica last wrote is newer than the object the reconcile was handed when the
    // watch has not caught up with that write yet.
    let current = ctx.last_status(&uid).or_else(|| nm.status.clone());

    // A spec the controller cannot act on is refused; no node or pod is touched.
    let timeout = match nm
        .spec
        .validate()
        .and_then(|()| nm.spec.drain_timeout().map_err(|e| vec![e]))
    {
        Ok(t) => t,
        Err(errors) => {
            let message = format_field_errors(&errors);
            let s = status::build(
                stage,
                &Outcome::Refused(message.clone()),
                current.as_ref().map_or(0, |c| c.matched),
                Vec::new(),
                generation,
                current.as_ref(),
                &rfc3339(now_unix()),
            );
            if write_status(&ctx, &api, &nm, current.as_ref(), &s, true)
                .await?
                .written
            {
                publish(&ctx, &nm, EventType::Warning, "InvalidSpec", message).await;
            }
            return Ok(Action::await_change());
        }
    };
    let rules = Rules::from_spec(&nm.spec, timeout);

    if matches!(stage, Stage::Cordon | Stage::Drain)
        && !nm.finalizers().iter().any(|f| f == FINALIZER)
        && set_finalizer(&api, &nm, true).await? == Finalizer::Gone
    {
        // Deleted (or deleted and made again) since the watch showed it, before it had the
        // finalizer: it is gone for good and no reconcile will see its deletion, so a node
        // cordoned now would stay cordoned, held by a maintenance that no longer exists.
        // Nothing has been touched yet; a new object of the same name has its own reconcile.
        info!(maintenance = %name, "nodemaintenance deleted before its finalizer was added; nothing to do");
        ctx.cache.know(&name, false);
        ctx.forget_status(&uid);
        return Ok(Action::await_change());
    }

    // The selected nodes and every node this maintenance holds, from the cache.
    let selector = &nm.spec.node_selector;
    let limits = ctx.limits();
    let mut scan = Scan::of(&ctx, &name, selector);
    // Promotions to Draining are serialised across the concurrent reconciles: the cluster-wide
    // ceiling is a count read here and raised by the Draining holds written later (in
    // `start_node`), so two maintenances reading the same count would both take the last slot.
    // Only a reconcile that would promote a node takes the lock, and it reads the nodes again
    // under it (every hold written under the lock is in the cache by then: `wrote_node`). It is
    // held until the first-time Draining holds are written, before any eviction.
    let mut promotion = None;
    if stage == Stage::Drain && scan.targets(&name, &nm, stage, limits).promotes {
        promotion = Some(ctx.promotion.lock().await);
        scan = Scan::of(&ctx, &name, selector);
    }
    let Scan {
        matched,
        cluster_draining,
        control_plane,
        selected_control_plane,
        total,
        mut seen,
    } = scan;
    let total_nodes = u32::try_from(total).unwrap_or(u32::MAX);
    let holding = seen
        .values()
        .any(|s| s.record.as_ref().is_some_and(|r| r.hold(&name).is_some()));

    // Admission safety: checked before the first node is touched.
    if matches!(stage, Stage::Cordon | Stage::Drain) && !holding && matched > 0 {
        let selection = Selection {
            selected: matched,
            total: total_nodes,
            selected_control_plane,
            total_control_plane: control_plane,
        };
        if let Err(refusal) = admission::check(
            selection,
            limits.max_selected_nodes,
            nm.spec.allow_broad_selection,
        ) {
            drop(promotion);
            let message = refusal.to_string();
            info!(maintenance = %name, %message, "nodemaintenance refused");
            let s = status::build(
                stage,
                &Outcome::Refused(message.clone()),
                matched,
                Vec::new(),
                generation,
                current.as_ref(),
                &rfc3339(now_unix()),
            );
            if write_status(&ctx, &api, &nm, current.as_ref(), &s, true)
                .await?
                .written
            {
                publish(&ctx, &nm, EventType::Warning, "Refused", message).await;
            }
            // A node added or relabelled wakes it through the node watch; this is the net.
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    }

    let Planned { holds, targets, .. } =
        Scan::plan(&seen, cluster_draining, &name, &nm, stage, limits);

    let now = now_unix();
    let mut views = Vec::new();
    // The safety net only: the watches wake the maintenance when something it waits for
    // changes.
    let mut requeue = Duration::from_secs(300);
    let mut draining = Vec::new();
    for (hold, target) in holds.iter().zip(targets) {
        let s = seen
            .get_mut(&hold.node)
            .expect("every hold comes from a seen node");
        match target {
            Target::Release => {
                if hold.hold.is_some() {
                    write_node(&ctx, &nodes_api, &name, s, Target::Release, None).await?;
                }
                if hold.selected && stage != Stage::Idle {
                    views.push(NodeView::phase_only(&hold.node, NodePhase::Released));
                }
            }
            Target::Hold(HoldPhase::Draining) => draining.push(hold.node.clone()),
            Target::Hold(phase) => {
                let previous = s.record.as_ref().and_then(|r| r.hold(&name)).cloned();
                let new = Hold {
                    phase,
                    drain_start: previous.as_ref().and_then(|p| p.drain_start),
                    note: previous.map(|p| p.note).unwrap_or_default(),
                    reason: nm.spec.reason.clone(),
                };
                write_node(
                    &ctx,
                    &nodes_api,
                    &name,
                    s,
                    Target::Hold(phase),
                    Some(new.clone()),
                )
                .await?;
                let mut view = NodeView::phase_only(
                    &hold.node,
                    match phase {
                        HoldPhase::Waiting => NodePhase::Waiting,
                        HoldPhase::Cordoned if stage == Stage::Drain => NodePhase::Waiting,
                        HoldPhase::Cordoned => NodePhase::Cordoned,
                        HoldPhase::Drained => NodePhase::Drained,
                        HoldPhase::Failed => NodePhase::Failed,
                        HoldPhase::Draining => NodePhase::Draining,
                    },
                );
                view.drain_start = new.drain_start.map(rfc3339);
                view.message = new.note;
                views.push(view);
            }
        }
    }

    // Drain the nodes whose turn it is.
    let jobs: Vec<Seen> = draining
        .iter()
        .filter_map(|node| seen.remove(node))
        .collect();
    let outcome = drain(&ctx, &nodes_api, &nm, jobs, &rules, now, promotion).await?;
    if let Some(recheck) = outcome.recheck {
        requeue = requeue.min(recheck);
    }
    views.extend(outcome.views);

    let s = status::build(
        stage,
        &Outcome::Acting,
        matched,
        views,
        generation,
        current.as_ref(),
        &rfc3339(now),
    );
    let written = write_status(&ctx, &api, &nm, current.as_ref(), &s, false).await?;
    if let Some(pending) = written.pending {
        requeue = requeue.min(pending);
    }
    if outcome.freed_slot {
        // A node finished: the next one takes its slot now, not at the next event.
        requeue = Duration::ZERO;
    }
    Ok(Action::requeue(requeue))
}

/// The nodes as one reconcile reads them from the cache.
struct Scan {
    /// Nodes the selector picks.
    matched: u32,
    /// Nodes draining now under every maintenance.
    cluster_draining: usize,
    control_plane: u32,
    selected_control_plane: u32,
    /// Nodes in the cluster.
    total: usize,
    /// The selected nodes and every node this maintenance holds.
    seen: BTreeMap<String, Seen>,
}

/// Each node's hold and what this maintenance wants for it.
struct Planned {
    holds: Vec<NodeHold>,
    targets: Vec<Target>,
    /// Some node not draining yet is to start draining now.
    promotes: bool,
}

impl Scan {
    fn of(ctx: &Context, name: &str, selector: &LabelSelector) -> Self {
        let mut scan = Self {
            matched: 0,
            cluster_draining: 0,
            control_plane: 0,
            selected_control_plane: 0,
            total: 0,
            seen: BTreeMap::new(),
        };
        ctx.cache.scan_nodes(|cached| {
            scan.total += 1;
            let selected = selector.matches(&cached.node.labels);
            let cp = cached.node.labels.contains_key(CONTROL_PLANE_LABEL);
            scan.control_plane += u32::from(cp);
            scan.selected_control_plane += u32::from(cp && selected);
            scan.matched += u32::from(selected);
            if cached.record.as_ref().is_some_and(NodeRecord::draining) {
                scan.cluster_draining += 1;
            }
            let holds = cached
                .record
                .as_ref()
                .is_some_and(|r| r.hold(name).is_some());
            if selected || holds {
                scan.seen
                    .insert(cached.node.name.clone(), Seen::of(cached.clone(), selected));
            }
        });
        scan
    }

    fn targets(
        &self,
        name: &str,
        nm: &NodeMaintenance,
        stage: Stage,
        limits: TuningLimits,
    ) -> Planned {
        Self::plan(&self.seen, self.cluster_draining, name, nm, stage, limits)
    }

    fn plan(
        seen: &BTreeMap<String, Seen>,
        cluster_draining: usize,
        name: &str,
        nm: &NodeMaintenance,
        stage: Stage,
        limits: TuningLimits,
    ) -> Planned {
        let holds: Vec<NodeHold> = seen
            .iter()
            .map(|(node, s)| NodeHold {
                node: node.clone(),
                selected: s.selected,
                hold: s
                    .record
                    .as_ref()
                    .and_then(|r| r.hold(name))
                    .map(|h| h.phase),
            })
            .collect();
        let targets = stage::targets(
            stage,
            &holds,
            Limits {
                max_concurrent: nm.spec.max_concurrent_nodes,
                cluster_ceiling: limits.max_concurrent_nodes,
                cluster_draining: u32::try_from(cluster_draining).unwrap_or(u32::MAX),
            },
        );
        let promotes = holds.iter().zip(&targets).any(|(h, t)| {
            *t == Target::Hold(HoldPhase::Draining) && h.hold != Some(HoldPhase::Draining)
        });
        Planned {
            holds,
            targets,
            promotes,
        }
    }
}

/// Applies this maintenance's wish for one node: its hold (or its release) in the record, the
/// cordon and the maintenance taint that follow from the record, and the KEP-5683 conditions.
/// Writes only what differs from the node as read; a write that lost a race with another
/// writer (409) is redone from a fresh read. Returns whether a release uncordoned the node.
async fn write_node(
    ctx: &Context,
    nodes_api: &Api<Node>,
    name: &str,
    seen: &mut Seen,
    target: Target,
    hold: Option<Hold>,
) -> Result<bool, Error> {
    let node_name = seen.node.name.clone();
    let err = |source| Error::WriteNode {
        name: name.to_owned(),
        node: node_name.clone(),
        source,
    };
    let mut attempt = 0;
    loop {
        attempt += 1;
        match write_node_once(ctx, nodes_api, name, seen, target, hold.clone()).await {
            Ok(uncordoned) => return Ok(uncordoned),
            Err(kube::Error::Api(s)) if s.code == 409 && attempt < WRITE_ATTEMPTS => {
                let fresh = nodes_api.get(&node_name).await.map_err(err)?;
                ctx.cache.wrote_node(fresh.clone());
                seen.record = record_of(&fresh);
                seen.node = Arc::new(NodeFacts::of(fresh));
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
            Err(source) => return Err(err(source)),
        }
    }
}

async fn write_node_once(
    ctx: &Context,
    nodes_api: &Api<Node>,
    name: &str,
    seen: &mut Seen,
    target: Target,
    hold: Option<Hold>,
) -> Result<bool, kube::Error> {
    let node_name = seen.node.name.clone();
    let current_owned = seen.record.clone();
    let current = current_owned.as_ref();
    let was_unschedulable = seen.node.unschedulable;
    let taints_now = seen.node.taints.clone();
    let (record, uncordoned) = match (target, hold) {
        (Target::Hold(_), Some(hold)) => {
            let mut r = record::set_hold(current, was_unschedulable, name, hold);
            if current.is_none() {
                // The first hold: what nodekeeper's taints were, to put back on release.
                r.prior_taints = record::nodekeeper_taints(&taints_now);
            }
            (Some(r), false)
        }
        _ => match current {
            Some(r) => {
                let rel = record::release(r, name);
                (rel.record, rel.uncordon && was_unschedulable)
            }
            None => return Ok(false),
        },
    };
    let prior = current.map_or(was_unschedulable, |r| r.prior_unschedulable);
    let want_unschedulable = record
        .as_ref()
        .map_or(prior, NodeRecord::wants_unschedulable);
    let prior_taints = current
        .or(record.as_ref())
        .map(|r| r.prior_taints.clone())
        .unwrap_or_default();
    let want_taints = record::taints(
        &taints_now,
        &prior_taints,
        record.as_ref().is_some_and(NodeRecord::held_cordoned),
        record.is_none(),
    );
    let labelled = seen.node.labels.get(LABEL_MAINTAINED).map(String::as_str) == Some("true");

    let params = PatchParams::apply(MANAGER_NODE_MAINTENANCE).force();
    if record.as_ref() != current
        || want_unschedulable != was_unschedulable
        || labelled != record.is_some()
        || want_taints != taints_now
    {
        // Fields this manager stops applying are removed by server-side apply when it alone
        // owned them: the annotation, the label, and `spec.unschedulable` when nodekeeper's
        // cordon was the only one. A cordon someone else set stays.
        // `spec.taints` is an atomic list: it is always applied whole (everyone's taints as
        // read, with the maintenance taint added or removed), never left out, so that no apply
        // removes a list this manager came to own.
        // The resourceVersion read makes the apply conditional: two writers of one node
        // cannot lose each other's hold or taint (the loser reads again and retries).
        // The uid keeps the apply on this Node: an apply to a Node deleted meanwhile would
        // otherwise create a new, empty one (the resourceVersion does not stop a create).
        let mut metadata = serde_json::json!({
            "name": node_name,
            "uid": seen.node.uid,
            "resourceVersion": seen.node.resource_version,
        });
        if let Some(r) = &record {
            metadata["annotations"] =
                serde_json::json!({ ANNOTATION_MAINTENANCE: r.to_annotation() });
            metadata["labels"] = serde_json::json!({ LABEL_MAINTAINED: "true" });
        }
        let mut spec = serde_json::json!({ "taints": want_taints });
        if want_unschedulable {
            spec["unschedulable"] = serde_json::json!(true);
        }
        let body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": metadata,
            "spec": spec,
        });
        let written = nodes_api
            .patch(&node_name, &params, &Patch::Apply(&body))
            .await?;
        ctx.cache.wrote_node(written.clone());
        seen.node = Arc::new(NodeFacts::of(written));
        info!(maintenance = %name, node = %node_name, unschedulable = want_unschedulable, holders = record.as_ref().map_or(0, |r| r.holders.len()), "node hold written");
    }
    // From here on the node as written is what later writes compare against.
    seen.record = record.clone();

    let desired = record::node_conditions(record.as_ref());
    if conditions_differ(&seen.node.conditions, &desired) {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let existing = &seen.node.conditions;
        let conditions: Vec<serde_json::Value> = desired
            .iter()
            .map(|c| {
                let status = if c.status { "True" } else { "False" };
                let transition = existing
                    .iter()
                    .find(|e| e.type_ == c.type_ && e.status == status)
                    .and_then(|e| e.last_transition_time.as_ref())
                    .map_or_else(|| now.clone(), |t| t.0.to_string());
                serde_json::json!({
                    "type": c.type_,
                    "status": status,
                    "reason": c.reason,
                    "message": c.message,
                    "lastTransitionTime": transition,
                    "lastHeartbeatTime": now,
                })
            })
            .collect();
        let mut body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": node_name },
        });
        if !conditions.is_empty() {
            body["status"] = serde_json::json!({ "conditions": conditions });
        }
        let written = nodes_api
            .patch_status(&node_name, &params, &Patch::Apply(&body))
            .await?;
        ctx.cache.wrote_node(written.clone());
        seen.node = Arc::new(NodeFacts::of(written));
    }
    Ok(uncordoned)
}

/// The maintenance conditions on a Node (the ones this controller owns).
pub const MAINTENANCE_CONDITIONS: [&str; 4] = [
    nodekeeper_api::names::NODE_CONDITION_MAINTENANCE_PLANNED,
    nodekeeper_api::names::NODE_CONDITION_MAINTENANCE_IN_PROGRESS,
    nodekeeper_api::names::NODE_CONDITION_DRAIN_IN_PROGRESS,
    nodekeeper_api::names::NODE_CONDITION_DRAINED,
];

fn conditions_differ(existing: &[NodeCondition], desired: &[record::NodeCondition]) -> bool {
    let existing: BTreeSet<_> = existing
        .iter()
        .filter(|c| MAINTENANCE_CONDITIONS.contains(&c.type_.as_str()))
        .map(|c| {
            (
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
        .collect();
    let want: BTreeSet<_> = desired
        .iter()
        .map(|c| {
            (
                c.type_.to_owned(),
                if c.status { "True" } else { "False" }.to_owned(),
                c.reason.to_owned(),
                c.message.clone(),
            )
        })
        .collect();
    existing != want
}

/// The plan's view of one pod.
pub fn pod_facts(pod: &Pod) -> PodFacts {
    let owner = pod
        .metadata
        .owner_references
        .as_ref()
        .and_then(|os| os.iter().find(|o| o.controller == Some(true)))
        .map_or(Owner::None, |o| {
            if o.kind == "DaemonSet" {
                Owner::DaemonSet
            } else {
                Owner::Controller
            }
        });
    let spec = pod.spec.as_ref();
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("");
    PodFacts {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        labels: pod.labels().clone(),
        owner,
        mirror: pod
            .annotations()
            .contains_key("kubernetes.io/config.mirror"),
        priority: spec.and_then(|s| s.priority).unwrap_or(0),
        finished: matches!(phase, "Succeeded" | "Failed"),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        healthy: phase == "Running"
            && pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        local_storage: spec
            .and_then(|s| s.volumes.as_ref())
            .is_some_and(|vs| vs.iter().any(|v| v.empty_dir.is_some())),
        grace_seconds: spec
            .and_then(|s| s.termination_grace_period_seconds)
            .unwrap_or(30),
    }
}
/// What draining this time came to.
#[derive(Default)]
struct DrainOutcome {
    views: Vec<NodeView>,
    /// When to look again at the latest, without an event.
    recheck: Option<Duration>,
    /// A node left its drain slot (drained): the next may start at once.
    freed_slot: bool,
}

/// One draining node between its plan and its write.
struct Job {
    seen: Seen,
    node: String,
    hold: Hold,
    view: NodeView,
    pods: Vec<CachedPod>,
    facts: Vec<PodFacts>,
    plan: plan::NodePlan,
    step: DeadlineStep,
    /// When the next pod terminating on an unreachable node is to be counted gone.
    gone_in: Option<Duration>,
    /// Pods admitted against their budgets, to evict now.
    send: Vec<usize>,
    answers: Vec<(usize, EvictionAnswer)>,
}

/// Drains the nodes whose turn it is. Every node is planned from the cache; the evictions the
/// budgets allow now are admitted node by node, the longest-draining node first (so nodes
/// finish one after another and free their slots early, rather than all at the end), then sent
/// together, concurrently, for a bounded time; then each node's hold and view follow.
///
/// `promotion` is the lock taken to promote nodes to Draining: it is let go once their Draining
/// holds are written, before the first eviction.
async fn drain(
    ctx: &Context,
    nodes_api: &Api<Node>,
    nm: &NodeMaintenance,
    seen: Vec<Seen>,
    rules: &Rules,
    now: i64,
    promotion: Option<tokio::sync::MutexGuard<'_, ()>>,
) -> Result<DrainOutcome, Error> {
    let mut out = DrainOutcome::default();
    if seen.is_empty() {
        return Ok(out);
    }
    let started: Vec<Result<Job, Error>> = futures::stream::iter(
        seen.into_iter()
            .map(|s| start_node(ctx, nodes_api, nm, s, rules, now)),
    )
    .buffer_unordered(16)
    .collect()
    .await;
    drop(promotion);
    let mut jobs = Vec::with_capacity(started.len());
    for job in started {
        jobs.push(job?);
    }
    jobs.sort_by(|a, b| (a.hold.drain_start, &a.node).cmp(&(b.hold.drain_start, &b.node)));

    // Spend the budgets here first: a pod whose budget allows nothing now is not sent (it
    // would only earn a 429), and is reported as waiting on that budget.
    let mut budgets = ctx.cache.budgets();
    let snapshot = budgets.clone();
    for job in &mut jobs {
        if !matches!(job.step, DeadlineStep::Continue { .. }) {
            continue;
        }
        for &i in &job.plan.evict {
            let pod = &job.facts[i];
            match admit(&mut budgets, pod) {
                Admit::Send => job.send.push(i),
                Admit::Wait { pdb, message } => job.answers.push((
                    i,
                    EvictionAnswer::Blocked {
                        pdb: Some(pdb),
                        message,
                    },
                )),
            }
        }
    }

    let sends: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| job.send.iter().map(move |&i| (j, i)))
        .collect();
    let sent = sends.len();
    let answers = evict(ctx, &jobs, &sends).await;
    if answers.len() < sent {
        // The time bound cut the round short: the rest go at once in the next.
        out.recheck = Some(Duration::ZERO);
    }
    let mut evicted_uids = Vec::new();
    let mut spent: BTreeMap<(String, String), i32> = BTreeMap::new();
    for (j, i, answer) in answers {
        let job = &mut jobs[j];
        if answer == EvictionAnswer::Evicted {
            evicted_uids.extend(job.pods[i].uid.clone());
            let pod = &job.facts[i];
            // Only a healthy pod's eviction takes an allowance: the API server evicts the
            // others without counting them against the budget.
            if let Some(key) = super::eviction::sole_budget(&snapshot, &pod.namespace, &pod.labels)
                .filter(|_| pod.healthy)
            {
                *spent.entry(key).or_default() += 1;
            }
        }
        job.answers.push((i, answer));
    }
    ctx.cache.evicted(evicted_uids);
    ctx.cache.spent(
        &spent
            .into_iter()
            .map(|((ns, name), n)| (ns, name, n))
            .collect::<Vec<_>>(),
    );

    for job in jobs {
        let (view, recheck, drained) = finish_node(ctx, nodes_api, nm, job, now).await?;
        if let Some(r) = recheck {
            out.recheck = Some(out.recheck.map_or(r, |o| o.min(r)));
        }
        out.freed_slot |= drained;
        out.views.push(view);
    }
    Ok(out)
}

/// A draining node's first half: the cordon and the recorded start (first time only), its pods
/// from the cache, its plan and where it stands against its deadline.
async fn start_node(
    ctx: &Context,
    nodes_api: &Api<Node>,
    nm: &NodeMaintenance,
    mut seen: Seen,
    rules: &Rules,
    now: i64,
) -> Result<Job, Error> {
    let name = nm.name_any();
    let node = seen.node.name.clone();
    let previous = seen.record.as_ref().and_then(|r| r.hold(&name)).cloned();
    let started = previous
        .as_ref()
        .filter(|p| p.phase == HoldPhase::Draining)
        .and_then(|p| p.drain_start);
    let drain_start = started.unwrap_or(now);
    let hold = Hold {
        phase: HoldPhase::Draining,
        drain_start: Some(drain_start),
        note: String::new(),
        reason: nm.spec.reason.clone(),
    };
    if started.is_none() {
        // Cordon (and record the start) before the first eviction, so that no replacement
        // lands on this node.
        write_node(
            ctx,
            nodes_api,
            &name,
            &mut seen,
            Target::Hold(HoldPhase::Draining),
            Some(hold.clone()),
        )
        .await?;
        publish(
            ctx,
            nm,
            EventType::Normal,
            "DrainStarted",
            format!("node {node}: cordoned, drain started"),
        )
        .await;
    }

    // On a node whose kubelet is unreachable, a pod terminating longer than the wait past its
    // deletion time is counted gone: nothing will ever confirm its deletion.
    let unreachable = seen
        .node
        .taints
        .iter()
        .any(|t| t.key == plan::TAINT_UNREACHABLE);
    let wait = i64::try_from(ctx.unreachable_pod_wait.as_secs()).unwrap_or(i64::MAX);
    let gone_at = |p: &CachedPod| {
        p.deletion
            .filter(|_| unreachable && p.facts.terminating)
            .map(|t| t.saturating_add(wait))
    };
    let plan_of = |pods: &[CachedPod]| -> (Vec<PodFacts>, plan::NodePlan) {
        let facts: Vec<PodFacts> = pods.iter().map(|p| p.facts.clone()).collect();
        let node_plan = plan::plan_node_counting_gone(&facts, rules, |i| {
            gone_at(&pods[i]).is_some_and(|at| at <= now)
        });
        (facts, node_plan)
    };
    let mut pods = ctx.cache.pods_on(&node);
    let (mut facts, mut node_plan) = plan_of(&pods);
    if node_plan.drained() {
        // "Drained" is final: the node is never looked at again. The pod watch may not have
        // shown a pod bound just before the cordon yet (above, in this very reconcile), so the
        // cache's "nothing left" is confirmed by one list from the API server, as `kubectl
        // drain` lists after cordoning. It happens once per node, when its drain ends.
        pods = list_pods_on(ctx, &name, &node).await?;
        (facts, node_plan) = plan_of(&pods);
    }
    // Look again when the next such pod is to be counted gone: no event says so.
    let gone_in = node_plan
        .terminating
        .iter()
        .filter_map(|i| gone_at(&pods[*i]))
        .map(|at| Duration::from_secs(u64::try_from(at - now).unwrap_or(0) + 1))
        .min();
    let elapsed = Duration::from_secs(u64::try_from(now - drain_start).unwrap_or(0));
    let step = if node_plan.drained() {
        DeadlineStep::Continue {
            delete: Vec::new(),
            recheck_in: Duration::ZERO,
        }
    } else {
        plan::deadline_step(&node_plan, &facts, rules, elapsed)
    };

    let mut view = NodeView::phase_only(&node, NodePhase::Draining);
    view.drain_start = Some(rfc3339(drain_start));
    view.skipped = node_plan
        .skipped
        .iter()
        .map(|(i, reason)| SkippedPod {
            namespace: facts[*i].namespace.clone(),
            name: facts[*i].name.clone(),
            reason: *reason,
        })
        .collect();
    view.local_storage = node_plan
        .local_storage
        .iter()
        .map(|i| facts[*i].key())
        .collect();
    view.pods_remaining = u32::try_from(node_plan.remaining.len()).unwrap_or(u32::MAX);
    Ok(Job {
        seen,
        node,
        hold,
        view,
        pods,
        facts,
        plan: node_plan,
        step,
        gone_in,
        send: Vec::new(),
        answers: Vec::new(),
    })
}

/// The pods bound to `node`, read from the API server rather than the cache (a consistent
/// read: the API server serves it from its watch cache once that has caught up, else from
/// etcd). Pods this replica evicted need no memory here: the answer carries their
/// deletionTimestamp.
async fn list_pods_on(ctx: &Context, name: &str, node: &str) -> Result<Vec<CachedPod>, Error> {
    let api: Api<Pod> = Api::all(ctx.kube().await);
    let params = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    let list = api.list(&params).await.map_err(|source| Error::ListPods {
        name: name.to_owned(),
        node: node.to_owned(),
        source,
    })?;
    let mut pods: Vec<CachedPod> = list.items.iter().map(CachedPod::new).collect();
    pods.sort_by(|a, b| {
        (&a.facts.namespace, &a.facts.name).cmp(&(&b.facts.namespace, &b.facts.name))
    });
    Ok(pods)
}

/// A draining node's second half: what the answers and the deadline make of it (drained,
/// failed, still blocked and by what), its Events, and its hold written if it changed. Returns
/// its view, when to look again, and whether it left its drain slot drained.
async fn finish_node(
    ctx: &Context,
    nodes_api: &Api<Node>,
    nm: &NodeMaintenance,
    job: Job,
    now: i64,
) -> Result<(NodeView, Option<Duration>, bool), Error> {
    let Job {
        mut seen,
        node,
        mut hold,
        mut view,
        pods,
        facts,
        plan: node_plan,
        step,
        gone_in,
        answers,
        ..
    } = job;
    let name = nm.name_any();
    let mut recheck = Some(ctx.drain_recheck);
    let mut drained = false;
    let left = |idx: &[usize]| -> String {
        let names: Vec<String> = idx.iter().take(5).map(|i| facts[*i].key()).collect();
        let more = idx.len().saturating_sub(5);
        if more > 0 {
            format!("{} and {more} more", names.join(", "))
        } else {
            names.join(", ")
        }
    };

    if node_plan.drained() {
        hold.phase = HoldPhase::Drained;
        view.phase = NodePhase::Drained;
        recheck = None;
        drained = true;
        publish(
            ctx,
            nm,
            EventType::Normal,
            "NodeDrained",
            format!("node {node}: drained"),
        )
        .await;
    } else {
        match step {
            DeadlineStep::Fail => {
                hold.phase = HoldPhase::Failed;
                hold.note = format!(
                    "drain timed out after {}; onTimeout Fail: evictions stopped, node stays cordoned; pods left: {}",
                    nm.spec.drain_timeout,
                    left(&node_plan.remaining)
                );
                view.phase = NodePhase::Failed;
                recheck = None;
                publish(
                    ctx,
                    nm,
                    EventType::Warning,
                    "DrainTimedOut",
                    format!("node {node}: {}", hold.note),
                )
                .await;
            }
            DeadlineStep::Proceed => {
                hold.phase = HoldPhase::Drained;
                hold.note = format!(
                    "drain timed out after {}; onTimeout Proceed: counted drained with pods left: {}",
                    nm.spec.drain_timeout,
                    left(&node_plan.remaining)
                );
                view.phase = NodePhase::Drained;
                recheck = None;
                drained = true;
                publish(
                    ctx,
                    nm,
                    EventType::Warning,
                    "DrainTimedOut",
                    format!("node {node}: {}", hold.note),
                )
                .await;
            }
            DeadlineStep::ForceDelete { delete } | DeadlineStep::Continue { delete, .. }
                if !delete.is_empty() =>
            {
                let deleted = force_delete(ctx, &facts, &pods, &delete).await;
                if deleted > 0 {
                    publish(
                        ctx,
                        nm,
                        EventType::Warning,
                        "PodsForceDeleted",
                        format!("node {node}: {deleted} pods deleted past their PodDisruptionBudgets (onTimeout ForceDelete), each with its own grace period"),
                    )
                    .await;
                }
                view.blocking = blocking_without_eviction(&node_plan, &facts, &pods, now);
                recheck = Some(Duration::from_secs(1));
            }
            DeadlineStep::ForceDelete { .. } => {
                view.blocking = blocking_without_eviction(&node_plan, &facts, &pods, now);
            }
            DeadlineStep::Continue { recheck_in, .. } => {
                let mut blocking = blocking_without_eviction(&node_plan, &facts, &pods, now);
                let mut evicted_local = Vec::new();
                for (i, answer) in answers {
                    let pod = &facts[i];
                    match answer {
                        EvictionAnswer::Evicted => {
                            if pod.local_storage {
                                evicted_local.push(pod.key());
                            }
                        }
                        EvictionAnswer::Gone => {}
                        EvictionAnswer::Blocked { pdb, message } => {
                            if pdb.is_none() {
                                // Not a budget (the API server's own limits, or two budgets):
                                // no budget event will say when to try again.
                                recheck = Some(Duration::from_secs(1));
                            }
                            blocking.push(BlockingPod {
                                namespace: pod.namespace.clone(),
                                name: pod.name.clone(),
                                reason: BlockReason::PodDisruptionBudget,
                                pdb,
                                message: truncate(&message, 500),
                            });
                        }
                        EvictionAnswer::Failed { message } => {
                            recheck = Some(Duration::from_secs(5));
                            blocking.push(BlockingPod {
                                namespace: pod.namespace.clone(),
                                name: pod.name.clone(),
                                reason: BlockReason::EvictionFailed,
                                pdb: None,
                                message: truncate(&message, 500),
                            });
                        }
                    }
                }
                if !evicted_local.is_empty() {
                    publish(
                        ctx,
                        nm,
                        EventType::Normal,
                        "EvictedWithLocalStorage",
                        format!(
                            "node {node}: evicted pods whose emptyDir data is gone with them: {}",
                            evicted_local.join(", ")
                        ),
                    )
                    .await;
                }
                view.blocking = blocking;
                recheck = recheck.map(|r| r.min(recheck_in));
            }
        }
    }
    if let Some(gone_in) = gone_in {
        recheck = recheck.map(|r| r.min(gone_in));
    }
    view.message = hold.note.clone();
    write_node(
        ctx,
        nodes_api,
        &name,
        &mut seen,
        Target::Hold(hold.phase),
        Some(hold),
    )
    .await?;
    Ok((view, recheck, drained))
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Blocking pods known without asking the API: waited-for, bare (not allowed), and pods
/// terminating past their own grace period.
fn blocking_without_eviction(
    plan: &plan::NodePlan,
    facts: &[PodFacts],
    pods: &[CachedPod],
    now: i64,
) -> Vec<BlockingPod> {
    let entry = |i: usize, reason, message: String| BlockingPod {
        namespace: facts[i].namespace.clone(),
        name: facts[i].name.clone(),
        reason,
        pdb: None,
        message,
    };
    let mut out: Vec<BlockingPod> = plan
        .waiting
        .iter()
        .map(|i| {
            entry(
                *i,
                BlockReason::WaitingForCompletion,
                "matches spec.waitForPods; waiting for it to finish".into(),
            )
        })
        .collect();
    out.extend(plan.standalone.iter().map(|i| {
        entry(
            *i,
            BlockReason::StandalonePod,
            "no controller would recreate it; set spec.allowStandalonePods: true to evict it, or delete it".into(),
        )
    }));
    for i in &plan.terminating {
        // Terminating within its grace period is normal; past it, a person may need to look.
        let overdue = pods[*i].deletion.is_some_and(|t| t < now);
        if overdue && !plan.waiting.contains(i) && !plan.standalone.contains(i) {
            out.push(entry(
                *i,
                BlockReason::Terminating,
                "still terminating past its grace period".into(),
            ));
        }
    }
    out
}

/// Evicts the given pods (job, pod index) through the Eviction subresource, 32 at a time
/// across the nodes, for at most the reconcile's eviction budget; pods not reached are tried
/// at the next reconcile. Each eviction carries the pod's UID as a precondition, so a
/// replacement with the same name (a StatefulSet's) is never evicted by mistake.
async fn evict(
    ctx: &Context,
    jobs: &[Job],
    which: &[(usize, usize)],
) -> Vec<(usize, usize, EvictionAnswer)> {
    let client = ctx.kube().await;
    let attempts = futures::stream::iter(which.iter().copied().map(|(j, i)| {
        let pod = &jobs[j].pods[i];
        let api: Api<Pod> = Api::namespaced(client.clone(), &pod.facts.namespace);
        let name = pod.facts.name.clone();
        let namespace = pod.facts.namespace.clone();
        let uid = pod.uid.clone();
        async move {
            let answer = eviction::send(&api, &name, uid.as_deref()).await;
            if answer == EvictionAnswer::Evicted {
                info!(%namespace, pod = %name, uid = uid.as_deref().unwrap_or(""), "pod evicted");
            }
            (j, i, answer)
        }
    }))
    .buffer_unordered(32);
    let mut answers = Vec::new();
    let collect = async {
        let mut attempts = attempts;
        while let Some(a) = attempts.next().await {
            answers.push(a);
        }
    };
    let _ = tokio::time::timeout(ctx.eviction_budget, collect).await;
    answers
}

/// Deletes the given pods with their own grace period (never 0), past their budgets.
async fn force_delete(
    ctx: &Context,
    facts: &[PodFacts],
    pods: &[CachedPod],
    which: &[usize],
) -> usize {
    let client = ctx.kube().await;
    let mut deleted = 0;
    for &i in which {
        let api: Api<Pod> = Api::namespaced(client.clone(), &facts[i].namespace);
        let grace = u32::try_from(plan::force_grace(&facts[i])).unwrap_or(u32::MAX);
        let params = DeleteParams {
            grace_period_seconds: Some(grace),
            preconditions: Some(Preconditions {
                uid: pods[i].uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&facts[i].name, &params).await {
            Ok(_) => deleted += 1,
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(error) => {
                warn!(%error, pod = %facts[i].key(), "force delete failed; retrying next reconcile")
            }
        }
    }
    deleted
}

/// What [`write_status`] did.
struct StatusWrite {
    written: bool,
    /// A change held back: write it after this long (unless something else comes first).
    pending: Option<Duration>,
}

/// At most one status write per this interval while only the phases and counts change.
const STATUS_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// At most one status write per this interval while only details change (pods remaining,
/// which pods block and why, the `Blocked` condition): during a drain behind budgets they
/// change with every eviction, and a block that lasts less than this is not one a person acts
/// on.
const STATUS_DETAIL_INTERVAL: Duration = Duration::from_secs(10);

/// Writes the status when it differs from the last one written, coalesced: a change of what a
/// person acts on (phases, counts, `Ready`/`Progressing`) at most once per
/// [`STATUS_MIN_INTERVAL`], a change of details only at most once per
/// [`STATUS_DETAIL_INTERVAL`]; `urgent` (a refusal) at once. A held-back change is reported as
/// `pending` so the reconcile comes back to write it.
async fn write_status(
    ctx: &Context,
    api: &Api<NodeMaintenance>,
    nm: &NodeMaintenance,
    current: Option<&NodeMaintenanceStatus>,
    status: &NodeMaintenanceStatus,
    urgent: bool,
) -> Result<StatusWrite, Error> {
    let name = nm.name_any();
    let uid = nm.uid().unwrap_or_default();
    if current == Some(status) {
        return Ok(StatusWrite {
            written: false,
            pending: None,
        });
    }
    let acted_on = current.is_none_or(|c| status::acted_on(c) != status::acted_on(status));
    let wait = match ctx.since_status_write(&uid) {
        Some(_) if urgent => Duration::ZERO,
        Some(since) if acted_on => STATUS_MIN_INTERVAL.saturating_sub(since),
        Some(since) => STATUS_DETAIL_INTERVAL.saturating_sub(since),
        None => Duration::ZERO,
    };
    if !wait.is_zero() {
        return Ok(StatusWrite {
            written: false,
            pending: Some(wait),
        });
    }
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeMaintenance",
        "status": status,
    });
    api.patch_status(
        &name,
        &PatchParams::apply(MANAGER_NODE_MAINTENANCE).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| Error::WriteStatus {
        name: name.clone(),
        source,
    })?;
    ctx.remember_status(&uid, status.clone());
    Ok(StatusWrite {
        written: true,
        pending: None,
    })
}

/// Releases the holds of maintenances that no longer exist. A maintenance deleted before its
/// finalizer was added is never reconciled again, and a hold it wrote first (a race that
/// [`set_finalizer`]'s answer now closes, but a replica from before that fix, or a hand-made
/// record, can leave behind) would keep its node cordoned and, while Draining, a slot of
/// `maintenance.maxConcurrentNodes` taken for good. A holder is taken as gone only when the
/// metadata watch has listed the maintenances without it *and* the API server, asked now,
/// has no object of that name: a maintenance just created, or being deleted (its finalizer
/// still there), is left alone. Failures are logged and tried again at the next reconcile.
///
/// At most [`ORPHAN_CHECKS`] holders are asked about per reconcile: a holder the watch has not
/// shown yet exists almost always, and a burst of new maintenances must not become a burst of
/// requests; a real orphan is found again by the next reconcile.
async fn release_orphans(
    ctx: &Context,
    api: &Api<NodeMaintenance>,
    nodes_api: &Api<Node>,
    name: &str,
) {
    let unknown = ctx.cache.unknown_holders().into_iter();
    for (holder, nodes) in unknown.filter(|(h, _)| h != name).take(ORPHAN_CHECKS) {
        let params = kube::api::ListParams::default().fields(&format!("metadata.name={holder}"));
        match api.list_metadata(&params).await {
            Ok(list) if list.items.is_empty() => {}
            Ok(_) => continue,
            Err(error) => {
                warn!(%error, holder = %holder, "checking whether a node's holder still exists failed");
                continue;
            }
        }
        for node in nodes {
            let node_name = node.node.name.clone();
            let mut seen = Seen::of(node, false);
            // One attempt, from the node as cached: a conflict means the node changed, and the
            // next reconcile looks again (a retry from a fresh read could take away the hold of
            // a new maintenance of the same name written meanwhile).
            match write_node_once(ctx, nodes_api, &holder, &mut seen, Target::Release, None).await {
                Ok(_) => {
                    warn!(maintenance = %holder, node = %node_name, "released a node held by a nodemaintenance that no longer exists");
                }
                Err(error) => {
                    warn!(%error, maintenance = %holder, node = %node_name, "releasing a node held by a nodemaintenance that no longer exists failed; retrying at the next reconcile");
                }
            }
        }
    }
}

/// What [`set_finalizer`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finalizer {
    /// Written on this object.
    Written,
    /// The object is gone (404), or gone and made again under the same name (409, uid
    /// mismatch).
    Gone,
}

/// Adds or removes the finalizer (server-side apply of this manager's one list entry) on this
/// object only: with its uid, an apply to an object deleted meanwhile is refused (409) instead of
/// trying to create a new one.
async fn set_finalizer(
    api: &Api<NodeMaintenance>,
    nm: &NodeMaintenance,
    present: bool,
) -> Result<Finalizer, Error> {
    let name = nm.name_any();
    let name = name.as_str();
    let finalizers: Vec<&str> = if present { vec![FINALIZER] } else { vec![] };
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeMaintenance",
        "metadata": { "name": name, "uid": nm.uid(), "finalizers": finalizers },
    });
    match api
        .patch(
            name,
            &PatchParams::apply(MANAGER_NODE_MAINTENANCE).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(Finalizer::Written),
        // Gone (404), or gone and made again under the same name (409, uid mismatch): nothing
        // of this object is left to finalize, and nothing may be done for it either.
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(Finalizer::Gone),
        Err(source) => Err(Error::WriteFinalizer {
            name: name.to_owned(),
            source,
        }),
    }
}
