//! The `NodeMaintenance` reconciler: reads the selected and the held Nodes, refuses unsafe
//! selections before touching any, moves each node's hold as the stage wants (cordon with the
//! prior state recorded, drain by plan through the Eviction subresource for a bounded time,
//! timeouts, release), writes Node metadata, Node conditions and the status only when they
//! change, and restores the nodes when the object is deleted (finalizer).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource as _, ResourceExt as _};
use nodekeeper_api::crd::NodeMaintenance;
use nodekeeper_api::crd::common::format_field_errors;
use nodekeeper_api::crd::node_maintenance::{
    BlockReason, BlockingPod, NodeMaintenanceStatus, NodePhase, SkippedPod, Stage,
};
use nodekeeper_api::names::{
    ANNOTATION_MAINTENANCE, API_VERSION, LABEL_MAINTAINED, MANAGER_NODE_MAINTENANCE,
};
use tracing::{info, warn};

use super::Context;
use super::admission::{self, CONTROL_PLANE_LABEL, Selection};
use super::eviction::{Admit, Budget, EvictionAnswer, admit, classify};
use super::plan::{self, DeadlineStep, Owner, PodFacts, Rules};
use super::record::{self, Hold, HoldPhase, NodeRecord};
use super::stage::{self, Limits, NodeHold, Target};
use super::status::{self, NodeView, Outcome};

/// Finalizer: the nodes are restored before the object goes.
pub const FINALIZER: &str = "nodekeeper.dev/node-maintenance";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("list nodes for nodemaintenance {name}: {source}")]
    ListNodes { name: String, source: kube::Error },
    #[error("list pods on node {node}: {source}")]
    ListPods { node: String, source: kube::Error },
    #[error("write node {node} for nodemaintenance {name}: {source}")]
    WriteNode {
        name: String,
        node: String,
        source: kube::Error,
    },
    #[error("write status of nodemaintenance {name}: {source}")]
    WriteStatus { name: String, source: kube::Error },
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
    node: Node,
    selected: bool,
    record: Option<NodeRecord>,
}

fn record_of(node: &Node) -> Option<NodeRecord> {
    NodeRecord::parse(
        node.annotations()
            .get(ANNOTATION_MAINTENANCE)
            .map(String::as_str),
    )
}

fn unschedulable(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
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
    let client = ctx.kube().await;
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let nodes_api: Api<Node> = Api::all(client.clone());

    // Deleted: let go of every node this maintenance holds, then of the object.
    if nm.meta().deletion_timestamp.is_some() {
        if nm.finalizers().iter().any(|f| f == FINALIZER) {
            let held = held_nodes(&nodes_api, &name).await?;
            let count = held.len();
            let mut uncordoned = 0;
            for mut seen in held {
                if write_node(&nodes_api, &name, &mut seen, Target::Release, None).await? {
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
            set_finalizer(&api, &name, false).await?;
        }
        return Ok(Action::await_change());
    }

    let generation = nm.meta().generation;
    let stage = nm.spec.stage;
    let current = nm.status.clone();

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
            if write_status(&api, &name, current.as_ref(), &s).await? {
                publish(&ctx, &nm, EventType::Warning, "InvalidSpec", message).await;
            }
            return Ok(Action::await_change());
        }
    };
    let rules = Rules::from_spec(&nm.spec, timeout);

    if matches!(stage, Stage::Cordon | Stage::Drain)
        && !nm.finalizers().iter().any(|f| f == FINALIZER)
    {
        set_finalizer(&api, &name, true).await?;
    }

    // The selected nodes and every node any maintenance holds.
    let selector = nm.spec.node_selector.to_query();
    let list_err = |source| Error::ListNodes {
        name: name.clone(),
        source,
    };
    let selected = nodes_api
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(list_err)?;
    let maintained = nodes_api
        .list(&ListParams::default().labels(&format!("{LABEL_MAINTAINED}=true")))
        .await
        .map_err(list_err)?;
    let matched = u32::try_from(selected.items.len()).unwrap_or(u32::MAX);
    let cluster_draining = maintained
        .items
        .iter()
        .filter(|n| record_of(n).is_some_and(|r| r.draining()))
        .count();
    let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
    for node in selected.items {
        let record = record_of(&node);
        seen.insert(
            node.name_any(),
            Seen {
                node,
                selected: true,
                record,
            },
        );
    }
    for node in maintained.items {
        let record = record_of(&node);
        if record.as_ref().is_some_and(|r| r.hold(&name).is_some()) {
            seen.entry(node.name_any()).or_insert(Seen {
                node,
                selected: false,
                record,
            });
        }
    }
    let holding = seen
        .values()
        .any(|s| s.record.as_ref().is_some_and(|r| r.hold(&name).is_some()));

    // Admission safety: checked before the first node is touched.
    let limits = ctx.limits();
    if matches!(stage, Stage::Cordon | Stage::Drain) && !holding && matched > 0 {
        let selection = selection(&nodes_api, &seen, matched)
            .await
            .map_err(list_err)?;
        if let Err(refusal) = admission::check(
            selection,
            limits.max_selected_nodes,
            nm.spec.allow_broad_selection,
        ) {
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
            if write_status(&api, &name, current.as_ref(), &s).await? {
                publish(&ctx, &nm, EventType::Warning, "Refused", message).await;
            }
            // The cluster may change (a node added); look again now and then.
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    }

    let holds: Vec<NodeHold> = seen
        .iter()
        .map(|(node, s)| NodeHold {
            node: node.clone(),
            selected: s.selected,
            hold: s
                .record
                .as_ref()
                .and_then(|r| r.hold(&name))
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

    let now = now_unix();
    let mut views = Vec::new();
    let mut requeue = Duration::from_secs(300);
    let mut draining = Vec::new();
    for (hold, target) in holds.iter().zip(targets) {
        let s = seen
            .get_mut(&hold.node)
            .expect("every hold comes from a seen node");
        match target {
            Target::Release => {
                if hold.hold.is_some() {
                    write_node(&nodes_api, &name, s, Target::Release, None).await?;
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
                write_node(&nodes_api, &name, s, Target::Hold(phase), Some(new.clone())).await?;
                if phase == HoldPhase::Waiting {
                    requeue = requeue.min(ctx.drain_recheck * 2);
                }
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

    // Drain the nodes whose turn it is, concurrently, each for a bounded time.
    let jobs: Vec<Seen> = draining
        .iter()
        .filter_map(|node| seen.remove(node))
        .collect();
    let budgets = if jobs.is_empty() {
        Vec::new()
    } else {
        read_budgets(&client).await
    };
    let budgets = std::sync::Mutex::new(budgets);
    let results: Vec<Result<(NodeView, Option<Duration>), Error>> = futures::stream::iter(
        jobs.into_iter()
            .map(|s| drain_node(&ctx, &nodes_api, &nm, s, &rules, &budgets, now)),
    )
    .buffer_unordered(16)
    .collect()
    .await;
    for result in results {
        let (view, recheck) = result?;
        if let Some(recheck) = recheck {
            requeue = requeue.min(recheck);
        }
        views.push(view);
    }

    let s = status::build(
        stage,
        &Outcome::Acting,
        matched,
        views,
        generation,
        current.as_ref(),
        &rfc3339(now),
    );
    write_status(&api, &name, current.as_ref(), &s).await?;
    Ok(Action::requeue(requeue.max(Duration::from_millis(500))))
}

/// Counts for the admission check: every node and the control-plane nodes (metadata only).
async fn selection(
    nodes_api: &Api<Node>,
    seen: &BTreeMap<String, Seen>,
    matched: u32,
) -> Result<Selection, kube::Error> {
    let all = nodes_api.list_metadata(&ListParams::default()).await?;
    let control_plane: BTreeSet<String> = nodes_api
        .list_metadata(&ListParams::default().labels(CONTROL_PLANE_LABEL))
        .await?
        .items
        .iter()
        .map(|n| n.name_any())
        .collect();
    let selected_cp = seen
        .iter()
        .filter(|(n, s)| s.selected && control_plane.contains(*n))
        .count();
    Ok(Selection {
        selected: matched,
        total: u32::try_from(all.items.len()).unwrap_or(u32::MAX),
        selected_control_plane: u32::try_from(selected_cp).unwrap_or(u32::MAX),
        total_control_plane: u32::try_from(control_plane.len()).unwrap_or(u32::MAX),
    })
}

/// The nodes `name` holds, for the finalizer.
async fn held_nodes(nodes_api: &Api<Node>, name: &str) -> Result<Vec<Seen>, Error> {
    let list = nodes_api
        .list(&ListParams::default().labels(&format!("{LABEL_MAINTAINED}=true")))
        .await
        .map_err(|source| Error::ListNodes {
            name: name.to_owned(),
            source,
        })?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|node| {
            let record = record_of(&node)?;
            record.hold(name)?;
            Some(Seen {
                node,
                selected: false,
                record: Some(record),
            })
        })
        .collect())
}

/// Applies this maintenance's wish for one node: its hold (or its release) in the record, the
/// cordon that follows from the record, and the KEP-5683 conditions. Writes only what differs
/// from the node as read. Returns whether a release uncordoned the node.
async fn write_node(
    nodes_api: &Api<Node>,
    name: &str,
    seen: &mut Seen,
    target: Target,
    hold: Option<Hold>,
) -> Result<bool, Error> {
    let node_name = seen.node.name_any();
    let current_owned = seen.record.clone();
    let current = current_owned.as_ref();
    let was_unschedulable = unschedulable(&seen.node);
    let (record, uncordoned) = match (target, hold) {
        (Target::Hold(_), Some(hold)) => (
            Some(record::set_hold(current, was_unschedulable, name, hold)),
            false,
        ),
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
    let labelled = seen.node.labels().get(LABEL_MAINTAINED).map(String::as_str) == Some("true");
    let err = |source| Error::WriteNode {
        name: name.to_owned(),
        node: node_name.clone(),
        source,
    };

    let params = PatchParams::apply(MANAGER_NODE_MAINTENANCE).force();
    if record.as_ref() != current
        || want_unschedulable != was_unschedulable
        || labelled != record.is_some()
    {
        // Fields this manager stops applying are removed by server-side apply when it alone
        // owned them: the annotation, the label, and `spec.unschedulable` when nodekeeper's
        // cordon was the only one. A cordon someone else set stays.
        // The resourceVersion read makes the apply conditional: two maintenances writing one
        // node's record at once cannot lose each other's hold (the loser retries).
        let mut metadata = serde_json::json!({
            "name": node_name,
            "resourceVersion": seen.node.resource_version(),
        });
        if let Some(r) = &record {
            metadata["annotations"] =
                serde_json::json!({ ANNOTATION_MAINTENANCE: r.to_annotation() });
            metadata["labels"] = serde_json::json!({ LABEL_MAINTAINED: "true" });
        }
        let mut body = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": metadata,
        });
        if want_unschedulable {
            body["spec"] = serde_json::json!({ "unschedulable": true });
        }
        seen.node = nodes_api
            .patch(&node_name, &params, &Patch::Apply(&body))
            .await
            .map_err(err)?;
        info!(maintenance = %name, node = %node_name, unschedulable = want_unschedulable, holders = record.as_ref().map_or(0, |r| r.holders.len()), "node hold written");
    }

    let desired = record::node_conditions(record.as_ref());
    if conditions_differ(&seen.node, &desired) {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let existing = seen
            .node
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
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
        seen.node = nodes_api
            .patch_status(&node_name, &params, &Patch::Apply(&body))
            .await
            .map_err(err)?;
    }
    seen.record = record;
    Ok(uncordoned)
}

const MAINTENANCE_CONDITIONS: [&str; 4] = [
    nodekeeper_api::names::NODE_CONDITION_MAINTENANCE_PLANNED,
    nodekeeper_api::names::NODE_CONDITION_MAINTENANCE_IN_PROGRESS,
    nodekeeper_api::names::NODE_CONDITION_DRAIN_IN_PROGRESS,
    nodekeeper_api::names::NODE_CONDITION_DRAINED,
];

fn conditions_differ(node: &Node, desired: &[record::NodeCondition]) -> bool {
    let existing = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .filter(|c| MAINTENANCE_CONDITIONS.contains(&c.type_.as_str()))
                .map(|c| {
                    (
                        c.type_.clone(),
                        c.status.clone(),
                        c.reason.clone().unwrap_or_default(),
                        c.message.clone().unwrap_or_default(),
                    )
                })
                .collect::<BTreeSet<_>>()
        })
        .unwrap_or_default();
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
        local_storage: spec
            .and_then(|s| s.volumes.as_ref())
            .is_some_and(|vs| vs.iter().any(|v| v.empty_dir.is_some())),
        grace_seconds: spec
            .and_then(|s| s.termination_grace_period_seconds)
            .unwrap_or(30),
    }
}

/// One node's drain step: plan, deadline, evictions (bounded in time), and the hold that
/// follows. Returns the node's view and when to look again.
async fn drain_node(
    ctx: &Context,
    nodes_api: &Api<Node>,
    nm: &NodeMaintenance,
    mut seen: Seen,
    rules: &Rules,
    budgets: &std::sync::Mutex<Vec<Budget>>,
    now: i64,
) -> Result<(NodeView, Option<Duration>), Error> {
    let name = nm.name_any();
    let node = seen.node.name_any();
    let previous = seen.record.as_ref().and_then(|r| r.hold(&name)).cloned();
    let started = previous
        .as_ref()
        .filter(|p| p.phase == HoldPhase::Draining)
        .and_then(|p| p.drain_start);
    let drain_start = started.unwrap_or(now);
    let mut hold = Hold {
        phase: HoldPhase::Draining,
        drain_start: Some(drain_start),
        note: String::new(),
        reason: nm.spec.reason.clone(),
    };
    if started.is_none() {
        // Cordon (and record the start) before the first eviction, so that no replacement
        // lands on this node.
        write_node(
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

    let client = ctx.kube().await;
    let pods_api: Api<Pod> = Api::all(client.clone());
    let pods = pods_api
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|source| Error::ListPods {
            node: node.clone(),
            source,
        })?
        .items;
    let facts: Vec<PodFacts> = pods.iter().map(pod_facts).collect();
    let node_plan = plan::plan_node(&facts, rules);
    let elapsed = Duration::from_secs(u64::try_from(now - drain_start).unwrap_or(0));

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

    let mut recheck = Some(ctx.drain_recheck);
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
        publish(
            ctx,
            nm,
            EventType::Normal,
            "NodeDrained",
            format!("node {node}: drained"),
        )
        .await;
    } else {
        match plan::deadline_step(&node_plan, &facts, rules, elapsed) {
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
                // Spend the budgets here first: a pod whose budget allows nothing now is not
                // sent (it would only earn a 429), and is reported as waiting on that budget.
                let mut send = Vec::new();
                let mut answers = Vec::new();
                {
                    let mut budgets = budgets
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for &i in &node_plan.evict {
                        match admit(&mut budgets, &facts[i].namespace, &facts[i].labels) {
                            Admit::Send => send.push(i),
                            Admit::Wait { pdb, message } => answers.push((
                                i,
                                EvictionAnswer::Blocked {
                                    pdb: Some(pdb),
                                    message,
                                },
                            )),
                        }
                    }
                }
                answers.extend(evict(ctx, &facts, &pods, &send).await);
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
                        EvictionAnswer::Blocked { pdb, message } => blocking.push(BlockingPod {
                            namespace: pod.namespace.clone(),
                            name: pod.name.clone(),
                            reason: BlockReason::PodDisruptionBudget,
                            pdb,
                            message: truncate(&message, 500),
                        }),
                        EvictionAnswer::Failed { message } => blocking.push(BlockingPod {
                            namespace: pod.namespace.clone(),
                            name: pod.name.clone(),
                            reason: BlockReason::EvictionFailed,
                            pdb: None,
                            message: truncate(&message, 500),
                        }),
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
                recheck = Some(ctx.drain_recheck.min(recheck_in));
            }
        }
    }
    view.message = hold.note.clone();
    write_node(
        nodes_api,
        &name,
        &mut seen,
        Target::Hold(hold.phase),
        Some(hold),
    )
    .await?;
    Ok((view, recheck))
}

/// Every PodDisruptionBudget with its allowance now. A failed read gives none: the evictions
/// are then sent and the API server enforces the budgets itself (429s).
async fn read_budgets(client: &kube::Client) -> Vec<Budget> {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use nodekeeper_api::crd::LabelSelector;
    let api: Api<PodDisruptionBudget> = Api::all(client.clone());
    let list = match api.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(error) => {
            warn!(%error, "listing PodDisruptionBudgets failed; evictions go to the API server unfiltered");
            return Vec::new();
        }
    };
    list.items
        .iter()
        .filter_map(|pdb| {
            let selector = match pdb.spec.as_ref()?.selector.as_ref() {
                None => None,
                // Through JSON: the same shape, and an expression this controller cannot read
                // drops the budget from the local check (the API server still enforces it).
                Some(s) => Some(
                    serde_json::from_value::<LabelSelector>(serde_json::to_value(s).ok()?).ok()?,
                ),
            };
            Some(Budget {
                namespace: pdb.namespace().unwrap_or_default(),
                name: pdb.name_any(),
                selector,
                allowed: pdb
                    .status
                    .as_ref()
                    .and_then(|s| s.disruptions_allowed)
                    .unwrap_or(0),
            })
        })
        .collect()
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
    pods: &[Pod],
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
        let overdue = pods[*i]
            .metadata
            .deletion_timestamp
            .as_ref()
            .is_some_and(|t| t.0.as_second() < now);
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

fn uid(pod: &Pod) -> Option<String> {
    pod.metadata.uid.clone()
}

/// Evicts the given pods through the Eviction subresource, 8 at a time, for at most the
/// reconcile's eviction budget; pods not reached are tried at the next reconcile. Each eviction
/// carries the pod's UID as a precondition, so a replacement with the same name (a StatefulSet's)
/// is never evicted by mistake.
async fn evict(
    ctx: &Context,
    facts: &[PodFacts],
    pods: &[Pod],
    which: &[usize],
) -> Vec<(usize, EvictionAnswer)> {
    let client = ctx.kube().await;
    let attempts = futures::stream::iter(which.iter().copied().map(|i| {
        let api: Api<Pod> = Api::namespaced(client.clone(), &facts[i].namespace);
        let params = EvictParams {
            delete_options: Some(DeleteParams {
                preconditions: Some(Preconditions {
                    uid: uid(&pods[i]),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            }),
            ..EvictParams::default()
        };
        let name = facts[i].name.clone();
        async move {
            let answer = match api.evict(&name, &params).await {
                Ok(_) => EvictionAnswer::Evicted,
                Err(kube::Error::Api(status)) => {
                    let causes: Vec<String> = status
                        .details
                        .as_ref()
                        .map(|d| d.causes.iter().map(|c| c.message.clone()).collect())
                        .unwrap_or_default();
                    // A UID precondition that fails means the pod we listed is gone.
                    if status.code == 409 && status.message.contains("UID") {
                        EvictionAnswer::Gone
                    } else {
                        classify(status.code, &status.message, &causes)
                    }
                }
                Err(error) => EvictionAnswer::Failed {
                    message: error.to_string(),
                },
            };
            (i, answer)
        }
    }))
    .buffer_unordered(8);
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
async fn force_delete(ctx: &Context, facts: &[PodFacts], pods: &[Pod], which: &[usize]) -> usize {
    let client = ctx.kube().await;
    let mut deleted = 0;
    for &i in which {
        let api: Api<Pod> = Api::namespaced(client.clone(), &facts[i].namespace);
        let grace = u32::try_from(plan::force_grace(&facts[i])).unwrap_or(u32::MAX);
        let params = DeleteParams {
            grace_period_seconds: Some(grace),
            preconditions: Some(Preconditions {
                uid: uid(&pods[i]),
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

/// Writes the status when it differs from the stored one. Returns whether it wrote.
async fn write_status(
    api: &Api<NodeMaintenance>,
    name: &str,
    current: Option<&NodeMaintenanceStatus>,
    status: &NodeMaintenanceStatus,
) -> Result<bool, Error> {
    if current == Some(status) {
        return Ok(false);
    }
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeMaintenance",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(MANAGER_NODE_MAINTENANCE).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| Error::WriteStatus {
        name: name.to_owned(),
        source,
    })?;
    Ok(true)
}

/// Adds or removes the finalizer (server-side apply of this manager's one list entry).
async fn set_finalizer(api: &Api<NodeMaintenance>, name: &str, present: bool) -> Result<(), Error> {
    let finalizers: Vec<&str> = if present { vec![FINALIZER] } else { vec![] };
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeMaintenance",
        "metadata": { "name": name, "finalizers": finalizers },
    });
    match api
        .patch(
            name,
            &PatchParams::apply(MANAGER_NODE_MAINTENANCE).force(),
            &Patch::Apply(&body),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::WriteFinalizer {
            name: name.to_owned(),
            source,
        }),
    }
}
