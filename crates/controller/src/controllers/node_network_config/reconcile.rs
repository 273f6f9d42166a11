//! The NodeNetworkConfig reconciler. One pass: check the spec, pick the selected nodes, start the
//! next batch ([`next_batch`]), then move every node in progress one or more steps on without
//! waiting for the cloud (attach one VNIC at a time per instance, look at the attachment again
//! on a later pass until ATTACHED, apply the host side through the agent, detach what the spec
//! no longer lists after its host side is gone), write the node's `NodeNetworkReady` condition
//! and the object's status when they change, and requeue. A failed node is tried again after
//! a backoff ([`retry_delay`]), still counted as failing until it succeeds. A node that leaves
//! the selector (or is kept by an older object that also selects it) loses this object's host
//! side, then its VNICs, as on deletion. Deleting the object removes its host side and detaches
//! the VNICs carrying its owner tag (finalizer), nothing else.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Resource as _, ResourceExt as _};
use nodekeeper_api::crd::node_network_config::{NodeNetworkConfigSpec, OciVnic};
use nodekeeper_api::crd::{NodeNetworkConfig, format_field_errors};
use nodekeeper_api::names::{
    API_VERSION, FINALIZER_NODE_NETWORK_CONFIG, LABEL_INSTANCE_TYPE, MANAGER_NODE_NETWORK_CONFIG,
    NODE_CONDITION_NETWORK_READY, REASON_CLOUD_NOT_CONFIGURED, REASON_INVALID_SPEC,
    REASON_NETWORK_APPLY_FAILED, REASON_NETWORK_CONVERGED, REASON_VNIC_ATTACH_FAILED,
};
use nodekeeper_oci::compute::{ComputeError, VnicAttachmentState};
use nodekeeper_proto::agent::v1 as pb;
use serde_json::json;
use tracing::{debug, info, warn};

use super::Context;
use super::cloud::{Cloud, CloudAccess, instance_id};
use super::plan::{NodeFacts, plan_node};
use super::rollout::{NodePhase, NodeState, next_batch, retry_delay};
use super::status::{NodeReport, blocked_status, conflict_message, next_status};
use crate::shared::AgentNode;
use crate::shared::agent_client::CallOutcome;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("write status of nodenetworkconfig {object}: {source}")]
    WriteStatus { object: String, source: kube::Error },
    #[error("update finalizer of nodenetworkconfig {object}: {source}")]
    UpdateFinalizer { object: String, source: kube::Error },
    #[error("nodenetworkconfig {object}: the Node cache did not fill within 30 s")]
    WaitNodes { object: String },
    #[error("list nodenetworkconfigs (to find nodes another one selects): {source}")]
    ListObjects { source: kube::Error },
}

/// Logs the failure and retries in 10 s.
pub fn error_policy(obj: Arc<NodeNetworkConfig>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, object = %obj.name_any(), "nodenetworkconfig reconcile failed; retrying in 10s");
    Action::requeue(std::time::Duration::from_secs(10))
}

/// The next thing one node waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Work {
    /// List the instance's attachments and plan.
    Observe,
    /// Attachment `id` should become ATTACHED; then attach `rest` (indices into the attach
    /// list) one by one, then apply.
    WaitAttach {
        id: String,
        rest: Vec<usize>,
        detach: Vec<Detach>,
    },
    /// Apply the host side, leaving out the VNICs in `detach`.
    Apply {
        detach: Vec<Detach>,
    },
    /// Detach these (their host side is gone), one per pass.
    Detach {
        rest: Vec<Detach>,
    },
    Done,
}

/// An attachment to detach and its VNIC's MAC (to leave its host side out).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Detach {
    id: String,
    mac: Option<String>,
}

/// One selected node in one object's rollout.
#[derive(Clone, Debug)]
pub(crate) struct NodeRun {
    /// `<uid>/<generation>` this run is for.
    target: String,
    phase: NodePhase,
    attached: bool,
    work: Work,
    /// Cloud calls spent on this node for `target`.
    calls: u32,
    started: Instant,
    instance: Option<String>,
    /// An apply reached the host (so the finalizer removes the host side).
    host_touched: bool,
    /// The last apply was refused by the agent before it changed anything (a desired state
    /// this host cannot take): a host failure for the condition, with nothing to remove.
    host_refused: bool,
    /// The attachments of the VNICs this object keeps on the node (id, VNIC id), as found by
    /// the observation and as they became ATTACHED: the apply is complete once each one's VNIC
    /// is on the host.
    keep: Vec<(String, Option<String>)>,
    /// When the attachment being waited for was requested, and when to look at it next.
    attach_requested: Option<Instant>,
    next_look: Option<Instant>,
    /// Failures in a row on `target`, when the failed node is tried next, and whether that try
    /// is under way (the node stays `Failed` meanwhile).
    failures: u32,
    retry_at: Option<Instant>,
    retrying: bool,
}

impl NodeRun {
    fn new(target: &str) -> Self {
        Self {
            target: target.to_string(),
            phase: NodePhase::Pending,
            attached: false,
            work: Work::Observe,
            calls: 0,
            started: Instant::now(),
            instance: None,
            host_touched: false,
            host_refused: false,
            keep: Vec::new(),
            attach_requested: None,
            next_look: None,
            failures: 0,
            retry_at: None,
            retrying: false,
        }
    }

    /// Whether the reconciler steps this node: it is rolling out, or a failed node being
    /// tried again.
    fn stepping(&self) -> bool {
        self.phase == NodePhase::InProgress || self.retrying
    }

    /// A failed node whose backoff is over starts again from the observation, keeping its
    /// `Failed` phase (and so its place against the threshold) until it succeeds.
    fn retry_if_due(&mut self, now: Instant) -> bool {
        let due = matches!(self.phase, NodePhase::Failed { .. })
            && !self.retrying
            && self.retry_at.is_some_and(|t| t <= now);
        if due {
            self.retrying = true;
            self.work = Work::Observe;
            self.started = now;
            self.attach_requested = None;
            self.next_look = None;
        }
        due
    }

    /// Books the end of a step that reached `Work::Done`: a failure sets the next try.
    fn finished(&mut self, now: Instant, base: std::time::Duration, cap: std::time::Duration) {
        self.retrying = false;
        if matches!(self.phase, NodePhase::Failed { .. }) {
            self.failures = self.failures.saturating_add(1);
            self.retry_at = Some(now + retry_delay(self.failures, base, cap));
        } else {
            self.failures = 0;
            self.retry_at = None;
        }
    }

    /// An attach was just requested: the first look waits for the expected attach time.
    fn attach_requested(&mut self, cloud: &Cloud) {
        let now = Instant::now();
        self.attach_requested = Some(now);
        self.next_look = Some(now + cloud.expected_attach_latency());
    }

    fn fail(&mut self, error: String, rolled_back: bool) {
        self.phase = NodePhase::Failed { error, rolled_back };
        self.work = Work::Done;
    }
}

/// One object's nodes: those it selects, and those it no longer selects where what it put is
/// being removed.
#[derive(Debug, Default)]
pub(crate) struct ObjectRun {
    nodes: BTreeMap<String, NodeRun>,
    leaving: BTreeMap<String, NodeRun>,
    /// Node conditions still being written, carried from pass to pass.
    writes: Option<ConditionWrites>,
}

/// The `NodeNetworkReady` writes of finished nodes, made beside the rollout rather than in its
/// path: a node's place goes to the next node as soon as its own work is over, and a pass does
/// not wait for the writes of the nodes it finished unless the rollout is over (then the
/// object's status, written after them, never runs ahead of its nodes' conditions).
#[derive(Debug)]
struct ConditionWrites {
    tasks: tokio::task::JoinSet<()>,
    /// At most this many writes at once.
    permits: Arc<tokio::sync::Semaphore>,
}

impl ConditionWrites {
    fn new(at_once: usize) -> Self {
        Self {
            tasks: tokio::task::JoinSet::new(),
            permits: Arc::new(tokio::sync::Semaphore::new(at_once.max(1))),
        }
    }

    fn spawn(&mut self, ctx: &Arc<Context>, info: &NodeInfo, run: &NodeRun) {
        let (ctx, info, run) = (Arc::clone(ctx), info.clone(), run.clone());
        let permits = Arc::clone(&self.permits);
        self.tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            write_node_condition(&ctx, &info, &run).await;
        });
        // Forget the finished ones, so that a long rollout keeps only the writes under way.
        while self.tasks.try_join_next().is_some() {}
    }

    async fn wait(&mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// What the reconciler reads of a Node.
#[derive(Clone, Debug)]
struct NodeInfo {
    name: String,
    labels: BTreeMap<String, String>,
    provider_id: Option<String>,
    address: Option<IpAddr>,
    /// `NodeNetworkReady` as the Node carries it: status, reason, message, transition time.
    ready: Option<(String, String, String, Option<String>)>,
}

fn node_info(n: &Node) -> NodeInfo {
    let status = n.status.as_ref();
    NodeInfo {
        name: n.name_any(),
        labels: n.labels().clone(),
        provider_id: n.spec.as_ref().and_then(|s| s.provider_id.clone()),
        address: status
            .and_then(|s| s.addresses.as_ref())
            .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
            .and_then(|a| a.address.parse().ok()),
        ready: status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == NODE_CONDITION_NETWORK_READY))
            .map(|c| {
                (
                    c.status.clone(),
                    c.reason.clone().unwrap_or_default(),
                    c.message.clone().unwrap_or_default(),
                    c.last_transition_time.as_ref().map(|t| t.0.to_string()),
                )
            }),
    }
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

pub async fn reconcile(obj: Arc<NodeNetworkConfig>, ctx: Arc<Context>) -> Result<Action, Error> {
    let began = Instant::now();
    let name = obj.name_any();
    let api: Api<NodeNetworkConfig> = Api::all(ctx.client.clone());
    if tokio::time::timeout(
        std::time::Duration::from_secs(30),
        ctx.nodes.store().wait_until_ready(),
    )
    .await
    .is_err()
    {
        return Err(Error::WaitNodes { object: name });
    }
    if obj.meta().deletion_timestamp.is_some() {
        return cleanup(&obj, &ctx, &api).await;
    }
    if !obj
        .finalizers()
        .iter()
        .any(|f| f == FINALIZER_NODE_NETWORK_CONFIG)
    {
        let mut finalizers = obj.finalizers().to_vec();
        finalizers.push(FINALIZER_NODE_NETWORK_CONFIG.to_string());
        set_finalizers(&api, &obj, finalizers).await?;
    }
    let spec = &obj.spec;
    let generation = obj.meta().generation;
    let previous = obj.status.clone().unwrap_or_default();
    let others: Vec<NodeNetworkConfig> = api
        .list(&ListParams::default())
        .await
        .map_err(|source| Error::ListObjects { source })?
        .items
        .into_iter()
        .filter(|o| o.uid() != obj.uid())
        .collect();
    let mut nodes = selected(&ctx, spec);
    let claimed = claimed_by_older(&obj, &others, &nodes);
    nodes.retain(|n| !claimed.contains_key(&n.name));
    let conflict = conflict_message(&name, &claimed);
    let matched = u32::try_from(nodes.len()).unwrap_or(u32::MAX);

    // Objects that cannot be rolled out change nothing anywhere.
    let blocked = match spec.validate() {
        Err(errors) => Some((REASON_INVALID_SPEC, format_field_errors(&errors))),
        Ok(()) if !attach_list(spec).is_empty() => ctx
            .cloud
            .unavailable()
            .map(|m| (REASON_CLOUD_NOT_CONFIGURED, m)),
        Ok(()) => None,
    };
    if let Some((reason, message)) = blocked {
        info!(object = %name, %reason, %message, "nodenetworkconfig not rolled out");
        if let Some(s) = blocked_status(&previous, matched, generation, reason, &message, &now()) {
            write_status(&api, &name, &s).await?;
        }
        return Ok(Action::requeue(ctx.settings.resync));
    }

    let uid = obj.uid().unwrap_or_default();
    let target = format!("{uid}/{}", generation.unwrap_or(0));
    let (mut runs, mut leaving, writes) = take_runs(&ctx, &uid, &nodes, &target);
    let mut writes = writes.unwrap_or_else(|| ConditionWrites::new(ctx.settings.node_concurrency));
    let now_instant = Instant::now();
    for (n, r) in runs.iter_mut() {
        if r.retry_if_due(now_instant) {
            info!(object = %name, node = %n, failures = r.failures, "retrying failed node");
        }
    }

    // Step every node in progress, a bounded number at once, each as soon as it can move: a
    // node that finishes frees its place at once (the next node starts in the same pass; its
    // Node condition is written beside), and a look that falls due while the pass goes on is
    // taken then. The pass goes on while looks fall due within a poll interval, up to
    // `MAX_PASS` (or the poll interval, if longer). So one node's cycle never waits for the
    // slowest node of its pass, nor for a poll, and a rollout whose looks come one after
    // another is not cut every poll interval into passes that each list the objects and write
    // the status.
    let by_name: HashMap<&str, &NodeInfo> = nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let owner = name.clone();
    let pass_started = Instant::now();
    let pass_end = pass_started + ctx.settings.poll.max(MAX_PASS);
    let mut finished = Vec::new();
    let (mut stepped_count, mut started_count) = (0, 0);
    started_count += start_next(&mut runs, spec, &mut VecDeque::new());
    // The nodes to step now, and those to step when their look falls due.
    let mut ready: VecDeque<String> = runs
        .iter()
        .filter(|(_, r)| r.stepping())
        .map(|(n, _)| n.clone())
        .collect();
    let mut waiting: Vec<(Instant, String)> = Vec::new();
    let mut in_flight = FuturesUnordered::new();
    loop {
        while in_flight.len() < ctx.settings.node_concurrency {
            let Some(n) = ready.pop_front() else {
                break;
            };
            let (Some(run), Some(info)) = (runs.get(&n).cloned(), by_name.get(n.as_str())) else {
                continue;
            };
            let info = (*info).clone();
            let ctx = Arc::clone(&ctx);
            let owner = owner.clone();
            in_flight.push(async move {
                let mut run = run;
                step(&ctx, &owner, spec, &info, &mut run).await;
                (n, run)
            });
        }
        // Past the pass's end, the looks that fall due are the next pass's.
        let open = Instant::now() < pass_end;
        let due = waiting.iter().map(|(t, ..)| *t).min().filter(|_| open);
        let done = match (in_flight.is_empty(), due) {
            (true, None) => break,
            // Nothing under way: wait for the next look only if it falls due within a poll
            // interval and before the pass's end; the others are the next pass's.
            (true, Some(t)) if t > (Instant::now() + ctx.settings.poll).min(pass_end) => break,
            (true, Some(t)) => {
                tokio::time::sleep_until(t.into()).await;
                None
            }
            (false, None) => in_flight.next().await,
            (false, Some(t)) => tokio::select! {
                done = in_flight.next() => done,
                () = tokio::time::sleep_until(t.into()) => None,
            },
        };
        let now = Instant::now();
        waiting.retain(|(t, n)| {
            let keep = *t > now || now >= pass_end;
            if !keep {
                ready.push_back(n.clone());
            }
            keep
        });
        let Some((n, mut run)) = done else {
            continue;
        };
        stepped_count += 1;
        if run.work == Work::Done {
            // The node's own work is over: its condition is written beside the rollout, and
            // its place goes to the next node at once instead of after that write.
            if let Some(info) = by_name.get(n.as_str()) {
                writes.spawn(&ctx, info, &run);
            }
            run.finished(
                now,
                ctx.settings.retry_backoff,
                ctx.settings.retry_backoff_max,
            );
            ctx.metrics.calls_per_node.observe(f64::from(run.calls));
            info!(object = %name, node = %n, phase = ?run.phase, cloud_calls = run.calls, failures = run.failures, "node finished");
            finished.push(n.clone());
            runs.insert(n, run);
            if now < pass_end {
                started_count += start_next(&mut runs, spec, &mut ready);
            }
            continue;
        }
        // A look at an attachment, taken when it falls due if the pass is still going on
        // then (other nodes under way, or before the pass's end).
        if let Some(t) = run.next_look {
            waiting.push((t, n.clone()));
        }
        runs.insert(n, run);
    }
    drop(in_flight);
    let steps_took = pass_started.elapsed();

    // Nodes no longer selected: their host side, then this object's VNICs, go.
    if !leaving.is_empty() {
        // (after the conditions being written: one of them may be a leaving node's)
        writes.wait().await;
        leaving = leave(&ctx, &name, &others, leaving).await;
    }

    let paused = next_batch(&states_of(&runs), &spec.rollout).paused;
    let reports: Vec<NodeReport<'_>> = runs
        .iter()
        .map(|(n, r)| NodeReport {
            name: n,
            attached: r.attached,
            phase: &r.phase,
        })
        .collect();
    let status = next_status(
        &previous,
        &reports,
        paused.as_ref(),
        conflict.as_deref(),
        generation,
        &now(),
    );
    let busy = !leaving.is_empty()
        || runs
            .values()
            .any(|r| r.stepping() || (r.phase == NodePhase::Pending && paused.is_none()));
    // A failed node waits for its retry: look again then (or at the resync, if sooner).
    let next_retry = runs
        .values()
        .filter(|r| !r.retrying)
        .filter_map(|r| r.retry_at)
        .min()
        .map(|t| t.saturating_duration_since(Instant::now()));
    // A first look at a new attachment is due at its expected attach time: the pass comes
    // then, not at the next poll (up to a poll interval later, for a whole batch).
    let next_look = runs
        .values()
        .filter(|r| r.stepping())
        .filter_map(|r| r.next_look)
        .min()
        .map(|t| {
            t.saturating_duration_since(Instant::now())
                .max(MIN_PASS_GAP)
        });
    if !busy {
        writes.wait().await;
    }
    put_runs(&ctx, &uid, runs, leaving, Some(writes));
    let wrote_status = status.is_some();
    if let Some(s) = status {
        write_status(&api, &name, &s).await?;
    }
    // Where a pass's time goes (the benchmark reads these with NODEKEEPER_LOG=…=debug).
    debug!(
        object = %name,
        prelude_ms = (pass_started - began).as_millis() as u64,
        stepped = stepped_count,
        started = started_count,
        finished = finished.len(),
        steps_ms = steps_took.as_millis() as u64,
        wrote_status,
        pass_ms = began.elapsed().as_millis() as u64,
        "nodenetworkconfig pass"
    );
    let wait = if busy {
        ctx.settings.poll
    } else {
        ctx.settings.resync
    };
    let wait = next_look.map_or(wait, |look| wait.min(look));
    Ok(Action::requeue(
        next_retry.map_or(wait, |r| wait.min(r.max(ctx.settings.poll))),
    ))
}

/// The selected nodes that an older NodeNetworkConfig (created earlier; the lower name on a
/// tie) also selects, each with that object's name: a node's agent holds one desired network
/// state, so one object configures a node and the younger leaves it alone. An object being
/// deleted keeps its nodes until its cleanup is done.
fn claimed_by_older(
    this: &NodeNetworkConfig,
    others: &[NodeNetworkConfig],
    nodes: &[NodeInfo],
) -> BTreeMap<String, String> {
    let age = |o: &NodeNetworkConfig| {
        (
            o.meta().creation_timestamp.as_ref().map(|t| t.0),
            o.name_any(),
        )
    };
    let mine = age(this);
    let mut older: Vec<&NodeNetworkConfig> = others.iter().filter(|o| age(o) < mine).collect();
    older.sort_by_key(|o| age(o));
    nodes
        .iter()
        .filter_map(|n| {
            older
                .iter()
                .find(|o| o.spec.node_selector.matches(&n.labels))
                .map(|o| (n.name.clone(), o.name_any()))
        })
        .collect()
}

/// One cleanup step on each node that left the selector; returns those not done yet. The host
/// side is left alone where another object selects the node now (its apply replaced ours: the
/// agent holds one desired state); this object's VNICs are detached either way. A node that is
/// done loses the `NodeNetworkReady` condition this controller wrote, unless another object
/// configures it.
async fn leave(
    ctx: &Arc<Context>,
    owner: &str,
    others: &[NodeNetworkConfig],
    leaving: BTreeMap<String, NodeRun>,
) -> BTreeMap<String, NodeRun> {
    let all: HashMap<String, NodeInfo> = ctx
        .nodes
        .store()
        .state()
        .iter()
        .map(|n| (n.name_any(), node_info(n)))
        .collect();
    let results: Vec<(String, NodeRun, bool)> = futures::stream::iter(leaving)
        .map(|(node, mut run)| {
            let info = all.get(&node).cloned();
            let ctx = Arc::clone(ctx);
            async move {
                // A Node deleted meanwhile has nothing left to clean through its agent; its
                // instance's VNICs go with the instance.
                let Some(info) = info else {
                    return (node, run, true);
                };
                let elsewhere = others
                    .iter()
                    .any(|o| o.spec.node_selector.matches(&info.labels));
                if elsewhere {
                    run.host_touched = false;
                }
                let done = cleanup_node(&ctx, owner, &info, &mut run).await;
                if done {
                    info!(object = %owner, node = %node, "node left the selector; cleaned");
                    if !elsewhere {
                        clear_node_condition(&ctx, &info).await;
                    }
                }
                (node, run, done)
            }
        })
        .buffer_unordered(ctx.settings.node_concurrency)
        .collect()
        .await;
    results
        .into_iter()
        .filter(|(_, _, done)| !done)
        .map(|(n, r, _)| (n, r))
        .collect()
}

/// Drops the `NodeNetworkReady` condition this controller's field manager owns on the Node
/// (an apply without it; a condition the node sweep also writes stays).
async fn clear_node_condition(ctx: &Context, info: &NodeInfo) {
    if info.ready.is_none() {
        return;
    }
    let body = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": info.name},
        "status": {"conditions": []},
    });
    let api: Api<Node> = Api::all(ctx.client.clone());
    let params = PatchParams::apply(MANAGER_NODE_NETWORK_CONFIG).force();
    if let Err(error) = api
        .patch_status(&info.name, &params, &Patch::Apply(&body))
        .await
    {
        warn!(%error, node = %info.name, "remove NodeNetworkReady failed");
    }
}

/// How long one pass may go on stepping nodes and taking looks as they fall due (unless the
/// poll interval is longer): a node that finishes starts the next, which may finish at once
/// (nothing to attach) and start another, and so on until then. The object's status is
/// written, and a change of its spec seen, at least this often while a rollout goes on.
const MAX_PASS: std::time::Duration = std::time::Duration::from_secs(2);

/// Starts the nodes the rollout lets start now (marks them in progress) and queues them to be
/// stepped; returns how many.
fn start_next(
    runs: &mut BTreeMap<String, NodeRun>,
    spec: &NodeNetworkConfigSpec,
    ready: &mut VecDeque<String>,
) -> usize {
    let decision = next_batch(&states_of(runs), &spec.rollout);
    for n in &decision.start {
        if let Some(r) = runs.get_mut(n) {
            r.phase = NodePhase::InProgress;
            r.started = Instant::now();
            ready.push_back(n.clone());
        }
    }
    decision.start.len()
}

/// The nodes' phases as the rollout arithmetic reads them.
fn states_of(runs: &BTreeMap<String, NodeRun>) -> Vec<NodeState> {
    runs.iter()
        .map(|(n, r)| NodeState {
            name: n.clone(),
            phase: r.phase.clone(),
        })
        .collect()
}

fn attach_list(spec: &NodeNetworkConfigSpec) -> &[OciVnic] {
    spec.oci_vnics.as_ref().map_or(&[], |v| v.attach.as_slice())
}

/// The nodes the selector picks, by name.
fn selected(ctx: &Context, spec: &NodeNetworkConfigSpec) -> Vec<NodeInfo> {
    let mut nodes: Vec<NodeInfo> = ctx
        .nodes
        .store()
        .state()
        .iter()
        .filter(|n| spec.node_selector.matches(n.labels()))
        .map(|n| node_info(n))
        .collect();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    nodes
}

/// This object's node runs for the selected nodes (kept when they are for `target`, reset
/// otherwise), and the nodes it left: those it ran on and no longer selects, plus, after a
/// restart, those whose `NodeNetworkReady` still names this object's host side.
fn take_runs(
    ctx: &Context,
    uid: &str,
    nodes: &[NodeInfo],
    target: &str,
) -> (
    BTreeMap<String, NodeRun>,
    BTreeMap<String, NodeRun>,
    Option<ConditionWrites>,
) {
    let mut all = ctx.runs.lock().unwrap_or_else(PoisonError::into_inner);
    let mut old = all.remove(uid).unwrap_or_default();
    drop(all);
    let selected: std::collections::HashSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    let mut leaving = std::mem::take(&mut old.leaving);
    leaving.retain(|n, _| !selected.contains(n.as_str()));
    for (n, r) in &old.nodes {
        if !selected.contains(n.as_str()) {
            leaving.entry(n.clone()).or_insert_with(|| r.clone());
        }
    }
    for n in ctx.nodes.store().state() {
        let info = node_info(&n);
        if !selected.contains(info.name.as_str())
            && !leaving.contains_key(&info.name)
            && touched_per_node_condition(&info, uid)
        {
            leaving.insert(
                info.name.clone(),
                NodeRun {
                    host_touched: true,
                    ..NodeRun::new("")
                },
            );
        }
    }
    let runs = nodes
        .iter()
        .map(|n| {
            let run = match old.nodes.get(&n.name) {
                Some(r) if r.target == target => r.clone(),
                Some(r) => NodeRun {
                    host_touched: r.host_touched,
                    instance: r.instance.clone(),
                    ..NodeRun::new(target)
                },
                None if applied_per_node_condition(n, target) => NodeRun {
                    phase: NodePhase::Applied,
                    attached: true,
                    work: Work::Done,
                    host_touched: true,
                    ..NodeRun::new(target)
                },
                None => NodeRun::new(target),
            };
            (n.name.clone(), run)
        })
        .collect();
    (runs, leaving, old.writes)
}

/// Whether the Node says this very generation is applied (the condition this controller writes
/// names it): a restarted controller resumes there instead of rolling every node out again.
/// The shortest requeue for a due first look: the looks of one batch, due a few milliseconds
/// apart, are taken together in one pass.
const MIN_PASS_GAP: std::time::Duration = std::time::Duration::from_millis(50);

/// How this controller's `NodeNetworkReady` messages begin: converged, and failed.
const APPLIED_AT_GENERATION: &str = "host networking at generation ";
const FAILED_AT_GENERATION: &str = "failed at generation ";

/// Whether the Node's `NodeNetworkReady` names a generation of the object with this UID, in
/// any of its messages: this controller's converged and failed ones, and the node sweep's
/// converged, drifted and apply-failed ones, which name the generation the agent holds (see
/// `conditions::network_condition`). After a restart this is how the controller knows that the
/// object's host side may be on the node: a deleted object removes it there, and a node that
/// is no longer selected is cleaned (its host side, then this object's VNICs). One test for
/// both: were they to differ, a node one of them missed would keep the host side for good.
fn touched_per_node_condition(n: &NodeInfo, uid: &str) -> bool {
    !uid.is_empty()
        && n.ready
            .as_ref()
            .is_some_and(|(_, _, message, _)| message.contains(&format!("generation {uid}/")))
}

fn applied_per_node_condition(n: &NodeInfo, target: &str) -> bool {
    n.ready
        .as_ref()
        .is_some_and(|(status, reason, message, _)| {
            status == "True"
                && reason == REASON_NETWORK_CONVERGED
                && *message == format!("{APPLIED_AT_GENERATION}{target}")
        })
}

fn put_runs(
    ctx: &Context,
    uid: &str,
    nodes: BTreeMap<String, NodeRun>,
    leaving: BTreeMap<String, NodeRun>,
    writes: Option<ConditionWrites>,
) {
    ctx.runs
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(
            uid.to_string(),
            ObjectRun {
                nodes,
                leaving,
                writes,
            },
        );
}

/// Moves one node on as far as it can go without waiting.
async fn step(
    ctx: &Context,
    owner: &str,
    spec: &NodeNetworkConfigSpec,
    info: &NodeInfo,
    run: &mut NodeRun,
) {
    let desired = attach_list(spec);
    let cloud = match &ctx.cloud {
        CloudAccess::On(c) => Some(Arc::clone(c)),
        _ => None,
    };
    // At most a handful of transitions per pass; each either waits or moves on.
    for _ in 0..8 {
        let work = run.work.clone();
        match work {
            Work::Done => return,
            Work::Observe => {
                let Some(cloud) = &cloud else {
                    // No cloud side: host side only.
                    run.attached = true;
                    run.work = Work::Apply { detach: Vec::new() };
                    continue;
                };
                match observe(
                    cloud,
                    owner,
                    desired,
                    info,
                    run,
                    ctx.settings.attach_timeout,
                )
                .await
                {
                    Ok(true) => continue,
                    Ok(false) => return,
                    Err(e) => return run.fail(e, false),
                }
            }
            Work::WaitAttach { id, rest, detach } => {
                let Some(cloud) = &cloud else { return };
                if run.started.elapsed() > ctx.settings.attach_timeout {
                    return run.fail(
                        format!(
                            "vnic attachment {id} is not ATTACHED after {}s; look at the \
                             attachment in OCI (subnet capacity, shape limit) and fix the spec or \
                             the node",
                            ctx.settings.attach_timeout.as_secs()
                        ),
                        false,
                    );
                }
                if run.next_look.is_some_and(|t| Instant::now() < t) {
                    return;
                }
                let a = match cloud.attachment(&id, &mut run.calls).await {
                    Ok(a) => a,
                    Err(e) => return run.fail(cloud_error("GetVnicAttachment", &e), false),
                };
                match a.lifecycle_state {
                    VnicAttachmentState::Attached if a.vnic_id.is_some() => {
                        if let Some(t) = run.attach_requested.take() {
                            cloud.observe_first_look(true, t.elapsed());
                        }
                        run.next_look = None;
                        run.keep.retain(|(kept, _)| *kept != id);
                        run.keep.push((id.clone(), a.vnic_id.clone()));
                    }
                    s if s.is_gone() => {
                        return run.fail(
                            format!(
                                "vnic attachment {id} went {s:?} instead of ATTACHED: OCI \
                                 refused the attach; check the subnet, its free addresses, the \
                                 NSGs and the shape's VNIC limit"
                            ),
                            false,
                        );
                    }
                    _ => {
                        // Too early: later looks follow the poll interval (in this pass, if
                        // it is still going on then).
                        if let Some(t) = run.attach_requested.take() {
                            cloud.observe_first_look(false, t.elapsed());
                        }
                        run.next_look = Some(Instant::now() + ctx.settings.poll);
                        return;
                    }
                }
                match rest.split_first() {
                    Some((&next, more)) => {
                        let instance = run.instance.clone().unwrap_or_default();
                        match cloud
                            .attach(&instance, owner, &desired[next], &mut run.calls)
                            .await
                        {
                            Ok(a) => {
                                run.attach_requested(cloud);
                                run.work = Work::WaitAttach {
                                    id: a.id,
                                    rest: more.to_vec(),
                                    detach,
                                };
                                return;
                            }
                            // The instance is still being modified: try again next pass, until
                            // the attach timeout.
                            Err(e @ ComputeError::Conflict { .. }) => {
                                if let Some(error) = conflict_outlasted(
                                    run,
                                    ctx.settings.attach_timeout,
                                    attach_error(next, &desired[next], &e),
                                ) {
                                    return run.fail(error, false);
                                }
                                return;
                            }
                            Err(e) => {
                                return run.fail(attach_error(next, &desired[next], &e), false);
                            }
                        }
                    }
                    None => run.work = Work::Apply { detach },
                }
            }
            Work::Apply { detach } => {
                run.attached = true;
                match apply(ctx, spec, info, run, &detach).await {
                    Ok(true) if detach.is_empty() => {
                        run.phase = NodePhase::Applied;
                        run.work = Work::Done;
                        return;
                    }
                    Ok(true) => run.work = Work::Detach { rest: detach },
                    Ok(false) => return,
                    Err((e, rolled_back)) => return run.fail(e, rolled_back),
                }
            }
            Work::Detach { rest } => {
                let Some(cloud) = &cloud else { return };
                let Some((first, more)) = rest.split_first() else {
                    run.phase = NodePhase::Applied;
                    run.work = Work::Done;
                    return;
                };
                let instance = run.instance.clone().unwrap_or_default();
                match cloud.detach(&instance, &first.id, &mut run.calls).await {
                    Ok(()) => {
                        info!(node = %info.name, attachment = %first.id, "vnic detached");
                        run.work = Work::Detach {
                            rest: more.to_vec(),
                        };
                        if more.is_empty() {
                            continue;
                        }
                        return;
                    }
                    Err(e @ ComputeError::Conflict { .. }) => {
                        if let Some(error) = conflict_outlasted(
                            run,
                            ctx.settings.attach_timeout,
                            cloud_error("DetachVnic", &e),
                        ) {
                            return run.fail(error, false);
                        }
                        return;
                    }
                    Err(e) => return run.fail(cloud_error("DetachVnic", &e), false),
                }
            }
        }
    }
}

/// Lists the node's attachments, plans, and attaches the first missing VNIC. `Ok(true)`: moved
/// on without waiting.
async fn observe(
    cloud: &Cloud,
    owner: &str,
    desired: &[OciVnic],
    info: &NodeInfo,
    run: &mut NodeRun,
    attach_timeout: std::time::Duration,
) -> Result<bool, String> {
    let instance = instance_id(info.provider_id.as_deref())?;
    run.instance = Some(instance.clone());
    let facts = cloud
        .instance(
            &instance,
            info.labels.get(LABEL_INSTANCE_TYPE).map(String::as_str),
            &mut run.calls,
        )
        .await
        .map_err(|e| cloud_error("GetInstance", &e))?;
    let seen = cloud
        .attachments(&facts, &instance, &mut run.calls)
        .await
        .map_err(|e| cloud_error("ListVnicAttachments", &e))?;
    let plan = plan_node(
        owner,
        desired,
        &NodeFacts {
            node: info.name.clone(),
            shape: facts.shape.clone(),
            max_vnics: None,
            attachments: seen.iter().map(|s| s.found.clone()).collect(),
        },
    )
    .map_err(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    run.keep = plan
        .keep
        .iter()
        .map(|(_, id, _)| {
            let vnic_id = seen.iter().find(|s| &s.found.id == id);
            (id.clone(), vnic_id.and_then(|s| s.vnic_id.clone()))
        })
        .collect();
    let mut detach = Vec::new();
    for id in &plan.detach {
        let mac = match seen.iter().find(|s| &s.found.id == id) {
            Some(s) => cloud
                .mac_of(s, &mut run.calls)
                .await
                .map_err(|e| cloud_error("GetVnic", &e))?,
            None => None,
        };
        detach.push(Detach {
            id: id.clone(),
            mac,
        });
    }
    if let Some((&first, rest)) = plan.attach.split_first() {
        return match cloud
            .attach(&instance, owner, &desired[first], &mut run.calls)
            .await
        {
            Ok(a) => {
                run.attach_requested(cloud);
                info!(node = %info.name, vnic = %desired[first].display_name, attachment = %a.id, "vnic attach requested");
                run.work = Work::WaitAttach {
                    id: a.id,
                    rest: rest.to_vec(),
                    detach,
                };
                Ok(false)
            }
            Err(e @ ComputeError::Conflict { .. }) => {
                match conflict_outlasted(
                    run,
                    attach_timeout,
                    attach_error(first, &desired[first], &e),
                ) {
                    Some(error) => Err(error),
                    None => Ok(false),
                }
            }
            Err(e) => Err(attach_error(first, &desired[first], &e)),
        };
    }
    if let Some((_, id, _)) = plan.keep.iter().find(|(_, _, attached)| !attached) {
        run.work = Work::WaitAttach {
            id: id.clone(),
            rest: Vec::new(),
            detach,
        };
        return Ok(false);
    }
    if !plan.waiting.is_empty() {
        // A namesake is still detaching: look again next pass.
        return Ok(false);
    }
    run.work = Work::Apply { detach };
    Ok(true)
}

/// A 409 Conflict means another change to the instance is under way, and the step is tried
/// again next pass; but not forever: once the node has been at it longer than the attach
/// timeout (counted from its start, as the wait for ATTACHED is), it fails with OCI's answer
/// (`error`), so that it shows in the failing nodes and is retried with backoff instead of
/// holding a maxUnavailable place in progress for good.
fn conflict_outlasted(
    run: &NodeRun,
    attach_timeout: std::time::Duration,
    error: String,
) -> Option<String> {
    (run.started.elapsed() > attach_timeout).then(|| {
        format!(
            "{error}; still refused after {}s: find what keeps changing the instance (another \
             attach or detach, a console, CLI or Terraform change) and let it finish",
            attach_timeout.as_secs()
        )
    })
}

fn cloud_error(operation: &str, e: &ComputeError) -> String {
    let what = match e.status() {
        Some(400) => "; fix the spec field OCI names",
        Some(401) => "; the controller's OCI credentials were refused: renew them",
        Some(404) => {
            "; the resource does not exist or the controller's OCI policy does not allow it \
             (code NotAuthorizedOrNotFound): check the OCID and the policy"
        }
        _ => "",
    };
    // The service's errors name their operation already; the others do not.
    let text = e.to_string();
    if text.starts_with(&format!("{operation}: ")) {
        format!("{text}{what}")
    } else {
        format!("{operation}: {text}{what}")
    }
}

fn attach_error(index: usize, vnic: &OciVnic, e: &ComputeError) -> String {
    format!(
        "spec.ociVnics.attach[{index}] ({}): {}",
        vnic.display_name,
        cloud_error("AttachVnic", e)
    )
}

/// Applies the host side. `Ok(true)`: applied and every VNIC to keep is laid out; `Ok(false)`:
/// a VNIC's interface is not visible yet (try again next pass); `Err((message, rolled_back))`.
async fn apply(
    ctx: &Context,
    spec: &NodeNetworkConfigSpec,
    info: &NodeInfo,
    run: &mut NodeRun,
    detach: &[Detach],
) -> Result<bool, (String, bool)> {
    let Some(address) = info.address else {
        return Err((
            "the Node has no InternalIP address, so its agent cannot be reached".into(),
            false,
        ));
    };
    let node = AgentNode {
        name: info.name.clone(),
        endpoint: SocketAddr::new(address, ctx.agent_port),
    };
    let request = apply_request(spec, &info.name, &run.target, detach);
    run.host_refused = false;
    let response = match ctx
        .agents
        .apply_network(&node, request, ctx.settings.apply_timeout)
        .await
    {
        Ok(r) => r,
        Err(e) => {
            // An answer with an error status: the agent refused the desired state.
            run.host_refused = e.outcome == CallOutcome::Status;
            return Err((format!("ApplyNetwork on the agent: {e}"), false));
        }
    };
    run.host_touched = true;
    match pb::ApplyOutcome::try_from(response.outcome) {
        Ok(pb::ApplyOutcome::Applied) => {}
        Ok(pb::ApplyOutcome::RolledBack) => return Err((response.message, true)),
        _ => {
            return Err((
                format!("apply failed and so did the rollback: {}", response.message),
                false,
            ));
        }
    }
    // The metadata service and the interfaces lag the attach: the agent leaves a VNIC out
    // until both show it. Each VNIC to keep must be on a link the agent observed, found by its
    // MAC: the observed state also holds the node's other links (its primary NIC, VNICs of
    // other objects or attached by hand), so a count of MACs would take one of those for a
    // VNIC still missing.
    let want = attach_list(spec).len();
    if want > 0 && !all_reported(&run.keep, want, &response.oci_vnic_ids) {
        // Not all named by the agent (one that predates `oci_vnic_ids` names none): found by
        // MAC instead, one GetVnic per VNIC the first time.
        let mut kept = Vec::new();
        if let CloudAccess::On(cloud) = &ctx.cloud {
            for (id, vnic_id) in run.keep.clone() {
                match cloud
                    .attachment_mac(&id, vnic_id.as_deref(), &mut run.calls)
                    .await
                {
                    Ok(Some(mac)) => kept.push(mac),
                    // No VNIC id yet: it is not ATTACHED, so it cannot be on the host.
                    Ok(None) => {}
                    Err(e) => return Err((cloud_error("GetVnic", &e), false)),
                }
            }
        }
        let missing = not_on_host(&kept, &response.observed_state_json);
        if !missing.is_empty() || kept.len() < want {
            if run.started.elapsed() > ctx.settings.attach_timeout {
                // The apply itself succeeded and stays: nothing was rolled back.
                return Err((
                    format!(
                        "{} of {want} VNICs of spec.ociVnics.attach are ATTACHED in OCI but not \
                         visible on the host after {}s (instance metadata or interface \
                         missing{}); check the node's metadata service and the VNIC's driver",
                        kept.len() - missing.len(),
                        ctx.settings.attach_timeout.as_secs(),
                        if missing.is_empty() {
                            String::new()
                        } else {
                            format!(" for MAC {}", missing.join(", "))
                        },
                    ),
                    false,
                ));
            }
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether the agent named every VNIC this object keeps on the node (`keep`: attachment id and,
/// once ATTACHED, its VNIC's OCID; `want` of them) among those it laid out (`oci_vnic_ids`).
fn all_reported(keep: &[(String, Option<String>)], want: usize, oci_vnic_ids: &[String]) -> bool {
    keep.len() >= want
        && keep.iter().all(|(_, vnic)| {
            vnic.as_ref()
                .is_some_and(|v| oci_vnic_ids.iter().any(|id| id == v))
        })
}

/// The MACs of `kept` (the VNICs this object keeps on the node) that no link of the agent's
/// observed state (`ApplyNetworkResponse.observed_state_json`) carries. An observed state that
/// cannot be read shows nothing: every VNIC is missing.
fn not_on_host(kept: &[String], observed_state_json: &str) -> Vec<String> {
    let observed: nodekeeper_model::network::NetworkState =
        serde_json::from_str(observed_state_json).unwrap_or_default();
    let on_host: std::collections::HashSet<String> = observed
        .links
        .iter()
        .filter_map(|l| l.mac.as_ref().map(|m| m.to_lowercase()))
        .collect();
    kept.iter()
        .filter(|m| !on_host.contains(&m.to_lowercase()))
        .cloned()
        .collect()
}

fn apply_request(
    spec: &NodeNetworkConfigSpec,
    node: &str,
    target: &str,
    detach: &[Detach],
) -> pb::ApplyNetworkRequest {
    pb::ApplyNetworkRequest {
        desired_state_json: spec
            .state
            .as_ref()
            .and_then(|s| serde_json::to_string(s).ok())
            .unwrap_or_else(|| "{}".into()),
        dry_run: false,
        generation: target.to_string(),
        check_targets: spec.check_targets.clone(),
        check_timeout_ms: spec.check_timeout_ms,
        oci_vnics: spec.oci_vnics.as_ref().map(|o| pb::OciVnics {
            enabled: true,
            mtu: o.mtu,
            table_base: o.table_base,
            rule_priority_base: o.rule_priority_base,
            exclude_macs: detach.iter().filter_map(|d| d.mac.clone()).collect(),
        }),
        // An agent serving another node than this one refuses, changing nothing.
        node_name: node.to_string(),
    }
}

/// The `NodeNetworkReady` condition a finished node should carry. Host outcomes use the same
/// reason and message as the node sweep derives from the agent's report, so the two writers
/// agree instead of taking turns.
fn node_condition(run: &NodeRun) -> Option<(&'static str, &'static str, String)> {
    match &run.phase {
        NodePhase::Applied => Some((
            "True",
            REASON_NETWORK_CONVERGED,
            format!("{APPLIED_AT_GENERATION}{}", run.target),
        )),
        // A failure names the generation too, so that a restarted controller still knows this
        // object touched the node (it may hold VNICs of ours) when the node leaves the selector.
        NodePhase::Failed { error, .. } if run.host_touched || run.host_refused => Some((
            "False",
            REASON_NETWORK_APPLY_FAILED,
            format!("{FAILED_AT_GENERATION}{}: {error}", run.target),
        )),
        NodePhase::Failed { error, .. } => Some((
            "False",
            REASON_VNIC_ATTACH_FAILED,
            format!("{FAILED_AT_GENERATION}{}: {error}", run.target),
        )),
        _ => None,
    }
}

async fn write_node_condition(ctx: &Context, info: &NodeInfo, run: &NodeRun) {
    let Some((status, reason, message)) = node_condition(run) else {
        return;
    };
    let message = super::status::truncate(&message, 1024);
    let unchanged = info
        .ready
        .as_ref()
        .is_some_and(|(s, r, m, _)| s == status && r == reason && *m == message);
    if unchanged {
        return;
    }
    let now = now();
    let transition = info
        .ready
        .as_ref()
        .filter(|(s, ..)| s == status)
        .and_then(|(.., t)| t.clone())
        .unwrap_or_else(|| now.clone());
    let body = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": info.name},
        "status": {"conditions": [{
            "type": NODE_CONDITION_NETWORK_READY,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": transition,
            "lastHeartbeatTime": now,
        }]},
    });
    let api: Api<Node> = Api::all(ctx.client.clone());
    let params = PatchParams::apply(MANAGER_NODE_NETWORK_CONFIG).force();
    if let Err(error) = api
        .patch_status(&info.name, &params, &Patch::Apply(&body))
        .await
    {
        warn!(%error, node = %info.name, "write NodeNetworkReady failed");
    }
}

async fn write_status(
    api: &Api<NodeNetworkConfig>,
    name: &str,
    status: &nodekeeper_api::crd::node_network_config::NodeNetworkConfigStatus,
) -> Result<(), Error> {
    let body = json!({
        "apiVersion": API_VERSION,
        "kind": "NodeNetworkConfig",
        "metadata": {"name": name},
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(MANAGER_NODE_NETWORK_CONFIG).force(),
        &Patch::Apply(&body),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::WriteStatus {
        object: name.to_string(),
        source,
    })
}

async fn set_finalizers(
    api: &Api<NodeNetworkConfig>,
    obj: &NodeNetworkConfig,
    finalizers: Vec<String>,
) -> Result<(), Error> {
    // A merge patch carrying resourceVersion fails on a concurrent change instead of losing it.
    let body = json!({"metadata": {
        "finalizers": finalizers,
        "resourceVersion": obj.resource_version(),
    }});
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&body),
    )
    .await
    .map(|_| ())
    .map_err(|source| Error::UpdateFinalizer {
        object: obj.name_any(),
        source,
    })
}

/// Deletion: remove the host side where this object applied it, detach the VNICs carrying its
/// owner tag (one per instance per pass), then let the object go.
async fn cleanup(
    obj: &NodeNetworkConfig,
    ctx: &Arc<Context>,
    api: &Api<NodeNetworkConfig>,
) -> Result<Action, Error> {
    if !obj
        .finalizers()
        .iter()
        .any(|f| f == FINALIZER_NODE_NETWORK_CONFIG)
    {
        return Ok(Action::await_change());
    }
    let name = obj.name_any();
    let uid = obj.uid().unwrap_or_default();
    let object_run = ctx
        .runs
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&uid)
        .unwrap_or_default();
    // A condition write still under way must not land after the cleanup removed it.
    if let Some(mut writes) = object_run.writes {
        writes.wait().await;
    }
    let mut runs = object_run.nodes;
    runs.extend(object_run.leaving);
    let mut nodes = selected(ctx, &obj.spec);
    let all: HashMap<String, NodeInfo> = ctx
        .nodes
        .store()
        .state()
        .iter()
        .map(|n| (n.name_any(), node_info(n)))
        .collect();
    for n in runs.keys() {
        if !nodes.iter().any(|x| &x.name == n)
            && let Some(i) = all.get(n)
        {
            nodes.push(i.clone());
        }
    }
    let results: Vec<(String, NodeRun, bool)> = futures::stream::iter(nodes)
        .map(|info| {
            let run = runs.remove(&info.name);
            let ctx = Arc::clone(ctx);
            let name = name.clone();
            let uid = uid.clone();
            async move {
                let mut run = run.unwrap_or_else(|| NodeRun {
                    // After a restart the Node's condition tells whether this object's host
                    // side is there.
                    host_touched: touched_per_node_condition(&info, &uid),
                    ..NodeRun::new("")
                });
                let done = cleanup_node(&ctx, &name, &info, &mut run).await;
                (info.name, run, done)
            }
        })
        .buffer_unordered(ctx.settings.node_concurrency)
        .collect()
        .await;
    let pending = results.iter().filter(|(_, _, done)| !done).count();
    if pending > 0 {
        let keep: BTreeMap<String, NodeRun> = results
            .into_iter()
            .filter(|(_, _, done)| !done)
            .map(|(n, r, _)| (n, r))
            .collect();
        put_runs(ctx, &uid, keep, BTreeMap::new(), None);
        info!(object = %name, pending, "nodenetworkconfig cleanup in progress");
        return Ok(Action::requeue(ctx.settings.poll));
    }
    let finalizers: Vec<String> = obj
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER_NODE_NETWORK_CONFIG)
        .cloned()
        .collect();
    set_finalizers(api, obj, finalizers).await?;
    info!(object = %name, "nodenetworkconfig cleaned up");
    Ok(Action::await_change())
}

/// One node's cleanup step; true when nothing of this object is left on it.
async fn cleanup_node(ctx: &Context, owner: &str, info: &NodeInfo, run: &mut NodeRun) -> bool {
    if run.host_touched
        && let Some(address) = info.address
    {
        let node = AgentNode {
            name: info.name.clone(),
            endpoint: SocketAddr::new(address, ctx.agent_port),
        };
        // The agent holds one desired state: an empty one removes what nodekeeper configured.
        let request = pb::ApplyNetworkRequest {
            desired_state_json: "{}".into(),
            generation: String::new(),
            node_name: info.name.clone(),
            ..Default::default()
        };
        match ctx
            .agents
            .apply_network(&node, request, ctx.settings.apply_timeout)
            .await
        {
            Ok(r) if r.outcome == pb::ApplyOutcome::Applied as i32 => run.host_touched = false,
            // The agent answered that the removal failed (and was rolled back, or not even
            // that): the host still routes through this object's VNICs, and detaching them now
            // would leave its rules and routes pointing at interfaces that are gone, re-applied
            // by the agent's drift loop for good. The removal is asked again next pass.
            Ok(r) => {
                warn!(node = %info.name, object = %owner, outcome = r.outcome, message = %r.message, "host cleanup failed on the agent; VNICs kept until it succeeds");
                return false;
            }
            // An unreachable agent must not hold the object forever: the VNICs still go.
            Err(error) => {
                warn!(%error, node = %info.name, "host cleanup failed; detaching anyway");
                run.host_touched = false;
            }
        }
    }
    let CloudAccess::On(cloud) = &ctx.cloud else {
        return true;
    };
    let Ok(instance) = instance_id(info.provider_id.as_deref()) else {
        return true;
    };
    let facts = match cloud
        .instance(
            &instance,
            info.labels.get(LABEL_INSTANCE_TYPE).map(String::as_str),
            &mut run.calls,
        )
        .await
    {
        Ok(f) => f,
        Err(error) => {
            warn!(%error, node = %info.name, "cleanup: read instance");
            return false;
        }
    };
    let seen = match cloud.attachments(&facts, &instance, &mut run.calls).await {
        Ok(s) => s,
        Err(error) => {
            warn!(%error, node = %info.name, "cleanup: list attachments");
            return false;
        }
    };
    let ours: Vec<_> = seen
        .iter()
        .filter(|s| s.found.owner.as_deref() == Some(owner))
        .collect();
    let Some(first) = ours
        .iter()
        .find(|s| s.found.state == super::plan::AttachmentState::Attached)
    else {
        // Nothing attached of ours; an attach still in progress is detached next pass.
        return !ours
            .iter()
            .any(|s| s.found.state == super::plan::AttachmentState::Attaching);
    };
    match cloud
        .detach(&instance, &first.found.id, &mut run.calls)
        .await
    {
        Ok(()) => {
            info!(node = %info.name, attachment = %first.found.id, "vnic detached (object deleted)")
        }
        Err(ComputeError::Conflict { .. }) => {}
        Err(error) => warn!(%error, node = %info.name, "cleanup: detach"),
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodekeeper_api::crd::node_network_config::OciVnics;

    fn spec(attach: usize) -> NodeNetworkConfigSpec {
        serde_json::from_value(json!({
            "nodeSelector": {},
            "ociVnics": {"attach": (0..attach).map(|i| json!({
                "displayName": format!("v{i}"),
                "subnetId": "ocid1.subnet.oc1.phx.aaaa",
            })).collect::<Vec<_>>()},
            "checkTargets": ["10.0.0.1"],
        }))
        .unwrap()
    }

    #[test]
    fn the_apply_request_carries_the_layout_knobs_and_the_macs_to_leave_out() {
        let s = spec(1);
        let r = apply_request(
            &s,
            "n1",
            "uid/3",
            &[Detach {
                id: "a".into(),
                mac: Some("02:00:17:00:00:01".into()),
            }],
        );
        assert_eq!(r.desired_state_json, "{}");
        assert_eq!(r.generation, "uid/3");
        assert_eq!(r.node_name, "n1");
        assert_eq!(r.check_targets, ["10.0.0.1"]);
        let o = r.oci_vnics.unwrap();
        assert!(o.enabled);
        let d = OciVnics::default();
        assert_eq!((o.mtu, o.table_base), (d.mtu, d.table_base));
        assert_eq!(o.exclude_macs, ["02:00:17:00:00:01"]);
    }

    #[test]
    fn node_conditions_match_the_sweeps_words_for_host_outcomes() {
        let mut run = NodeRun::new("uid/3");
        assert_eq!(node_condition(&run), None);
        run.phase = NodePhase::Applied;
        assert_eq!(
            node_condition(&run).unwrap(),
            (
                "True",
                REASON_NETWORK_CONVERGED,
                "host networking at generation uid/3".to_string()
            )
        );
        run.fail("spec.ociVnics.attach[0].nicIndex: …".into(), false);
        assert_eq!(node_condition(&run).unwrap().1, REASON_VNIC_ATTACH_FAILED);
        // The agent refused the desired state before changing anything: a host failure.
        run.host_refused = true;
        run.fail(
            "FailedPrecondition: links[2] (nkm119): mtu 9000 …".into(),
            false,
        );
        assert_eq!(node_condition(&run).unwrap().1, REASON_NETWORK_APPLY_FAILED);
        run.host_refused = false;
        run.host_touched = true;
        run.fail("check 10.0.0.1 failed".into(), true);
        assert_eq!(node_condition(&run).unwrap().1, REASON_NETWORK_APPLY_FAILED);
    }

    #[test]
    fn a_restart_resumes_nodes_whose_condition_names_this_generation() {
        let node = |status: &str, message: &str| NodeInfo {
            name: "n1".into(),
            labels: BTreeMap::new(),
            provider_id: None,
            address: None,
            ready: Some((
                status.into(),
                REASON_NETWORK_CONVERGED.into(),
                message.into(),
                None,
            )),
        };
        assert!(applied_per_node_condition(
            &node("True", "host networking at generation uid/3"),
            "uid/3"
        ));
        assert!(!applied_per_node_condition(
            &node("True", "host networking at generation uid/2"),
            "uid/3"
        ));
        assert!(!applied_per_node_condition(
            &node("False", "host networking at generation uid/3"),
            "uid/3"
        ));
    }

    #[test]
    fn a_restart_cleans_a_leaving_node_this_object_touched_even_if_it_failed() {
        let node = |reason: &str, message: &str| NodeInfo {
            name: "n1".into(),
            labels: BTreeMap::new(),
            provider_id: None,
            address: None,
            ready: Some(("False".into(), reason.into(), message.into(), None)),
        };
        let mut run = NodeRun::new("uid/3");
        run.fail("AttachVnic: 500".into(), false);
        let (_, reason, message) = node_condition(&run).unwrap();
        assert!(touched_per_node_condition(&node(reason, &message), "uid"));
        run.host_touched = true;
        run.fail("check 10.0.0.1 failed".into(), true);
        let (_, reason, message) = node_condition(&run).unwrap();
        assert!(touched_per_node_condition(&node(reason, &message), "uid"));
        assert!(!touched_per_node_condition(&node(reason, &message), "ui"));
        assert!(!touched_per_node_condition(
            &node(reason, &message),
            "other"
        ));
        // Converged at an older generation: ours as well.
        assert!(touched_per_node_condition(
            &node(
                REASON_NETWORK_CONVERGED,
                "host networking at generation uid/2"
            ),
            "uid"
        ));
        // A failure that names no generation (the agent holds none) names no object.
        assert!(!touched_per_node_condition(
            &node(REASON_NETWORK_APPLY_FAILED, "add-route failed"),
            "uid"
        ));
    }

    /// The node sweep rewrites `NodeNetworkReady` from the
    /// agent's report (drifted, or the agent's last error after a failed apply that it rolled
    /// back); the host side of the generation the agent holds is still there, and a restarted
    /// controller must still find it by the object's UID, for deletion and for a node that
    /// leaves the selector alike.
    #[test]
    fn a_restart_finds_this_objects_host_side_under_the_sweeps_words() {
        use crate::conditions::{Observation, desired_conditions};
        use crate::view::NodeView;
        let sweep = |view: &NodeView| {
            let c = desired_conditions(
                Observation::Fresh(view),
                &nodekeeper_model::tuning::TuningConfig::default(),
                &[],
            )
            .unwrap()
            .into_iter()
            .find(|c| c.type_ == NODE_CONDITION_NETWORK_READY)
            .unwrap();
            NodeInfo {
                name: "n1".into(),
                labels: BTreeMap::new(),
                provider_id: None,
                address: None,
                ready: Some(("False".into(), c.reason, c.message, None)),
            }
        };
        let mut view = NodeView::default();
        view.network.applied_generation = "uid/2".into();
        assert!(touched_per_node_condition(&sweep(&view), "uid"));
        // A drift, repaired or not.
        view.network.drifted = true;
        view.network.drift = vec!["add-route 0.0.0.0/0 via 10.0.20.1 dev ens5 table 101".into()];
        assert!(touched_per_node_condition(&sweep(&view), "uid"));
        // Generation 3 failed and was rolled back: generation 2 stays on the host.
        view.network.last_error = "post-apply check failed: icmp 10.0.20.1: no answer".into();
        let info = sweep(&view);
        assert!(touched_per_node_condition(&info, "uid"), "{info:?}");
        assert!(!touched_per_node_condition(&info, "other"));
    }

    /// The observed state holds the node's other links too
    /// (the primary NIC, another object's VNIC); they do not stand in for a VNIC still missing.
    #[test]
    fn a_vnic_is_on_the_host_only_when_a_link_has_its_mac() {
        let observed = json!({"links": [
            {"name": "ens3", "kind": "existing", "mac": "02:00:17:0a:11:01"},
            {"name": "vnic0", "kind": "existing", "mac": "02:00:17:0a:22:02"},
            {"name": "other", "kind": "existing", "mac": "02:00:17:0a:44:04"},
        ]})
        .to_string();
        // Two VNICs kept, three MACs observed, one of the two VNICs missing.
        let kept = [
            "02:00:17:0A:22:02".to_string(),
            "02:00:17:0A:33:03".to_string(),
        ];
        assert_eq!(not_on_host(&kept, &observed), ["02:00:17:0A:33:03"]);
        assert!(not_on_host(&kept[..1], &observed).is_empty());
        assert_eq!(not_on_host(&kept, "not json"), kept);
    }

    #[test]
    fn vnics_the_agent_names_need_no_cloud_call() {
        let keep = |v: &[(&str, Option<&str>)]| -> Vec<(String, Option<String>)> {
            v.iter()
                .map(|(a, v)| ((*a).to_owned(), v.map(str::to_owned)))
                .collect()
        };
        let ids = |v: &[&str]| -> Vec<String> { v.iter().map(|s| (*s).to_owned()).collect() };
        let both = keep(&[("att1", Some("vnic1")), ("att2", Some("vnic2"))]);
        assert!(all_reported(&both, 2, &ids(&["vnic2", "other", "vnic1"])));
        // One missing, one not ATTACHED yet, one attachment short, or an agent naming none.
        assert!(!all_reported(&both, 2, &ids(&["vnic1", "other"])));
        let pending = keep(&[("att1", Some("vnic1")), ("att2", None)]);
        assert!(!all_reported(&pending, 2, &ids(&["vnic1"])));
        assert!(!all_reported(&both[..1], 2, &ids(&["vnic1", "vnic2"])));
        assert!(!all_reported(&both, 2, &[]));
    }

    #[test]
    fn cloud_errors_say_what_to_do() {
        let e = ComputeError::Service {
            operation: "AttachVnic",
            status: 404,
            code: "NotAuthorizedOrNotFound".into(),
            message: "subnet not found".into(),
            request_id: "r1".into(),
            attempts: 1,
        };
        let m = attach_error(1, &spec(2).oci_vnics.unwrap().attach[1], &e);
        assert!(
            m.starts_with("spec.ociVnics.attach[1] (v1): AttachVnic:"),
            "{m}"
        );
        assert!(
            m.contains("NotAuthorizedOrNotFound") && m.contains("check the OCID"),
            "{m}"
        );
    }
}
