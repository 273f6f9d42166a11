//! What the maintenance controller knows of the cluster between reconciles: the Nodes, the
//! scheduled Pods indexed by node, and the PodDisruptionBudgets, each kept by one watch instead
//! of lists on every reconcile, and trimmed to what a drain reads (at 10,000 nodes a full Node
//! or Pod cache would be most of the process's memory). The same watches wake the maintenances
//! that care: a pod on a node one of them drains changed or left, a budget allows a disruption
//! again, a held node changed, a node's labels changed (a selector may pick it now).
//!
//! The three watches run only while some NodeMaintenance exists, or existed less than a grace
//! period ago: a cluster has one only now and then, and between maintenances a copy of every
//! Node and every scheduled Pod would be the controller's largest cost per node (and per pod)
//! for nothing. Which maintenances exist comes from a watch of their metadata rather than from
//! the reconciles: a maintenance deleted without a finalizer is never reconciled again, so the
//! reconciles alone could not tell when the last one went. When the grace period has passed
//! with none, the watches stop and their maps are dropped; the next maintenance lists again.
//!
//! It also remembers what this replica did that the watches have not shown yet — pods it
//! evicted, budget allowances it spent — so that a reconcile running before the watch event
//! neither evicts a pod twice nor sends an eviction its budget would refuse (429). Those
//! memories are short-lived: the watch event replaces them, and they expire on their own if the
//! event never comes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Node, NodeCondition, Pod, Taint};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ObjectMeta, PartialObjectMeta};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Resource as _, ResourceExt as _};
use nodekeeper_api::crd::{LabelSelector, NodeMaintenance};
use nodekeeper_api::names::ANNOTATION_MAINTENANCE;
use tokio::sync::{Notify, watch};
use tracing::{info, warn};

use super::eviction::Budget;
use super::plan::PodFacts;
use super::reconcile::{MAINTENANCE_CONDITIONS, pod_facts};
use super::record::{HoldPhase, NodeRecord};
use crate::shared::metrics::MaintenanceMetrics;

/// How long an eviction this replica sent counts the pod as terminating when the pod watch has
/// not said so yet.
const EVICTED_MEMORY: Duration = Duration::from_secs(60);
/// How long a budget allowance this replica spent counts when the budget watch shows no newer
/// status (an eviction that was accepted always moves the budget's status on).
const SPENT_MEMORY: Duration = Duration::from_secs(10);

/// How long the node, pod and budget watches keep running after the last NodeMaintenance is
/// gone (`--maintenance-cache-grace`): a `kubectl delete` and apply again, or the next
/// maintenance of a rollout, finds them listed instead of listing every Pod of the cluster
/// again.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(300);

const NODES: u8 = 1;
const PODS: u8 = 2;
const BUDGETS: u8 = 4;
const ALL: u8 = NODES | PODS | BUDGETS;

/// The cache was not filled in time.
#[derive(Debug, thiserror::Error)]
#[error("wait for the node, pod and PodDisruptionBudget watches to list (after {0:?})")]
pub struct NotReady(Duration);

/// One Node as the reconciler reads it: name, uid, resourceVersion, labels,
/// `spec.unschedulable` and taints, and the maintenance conditions; nodekeeper's maintenance
/// annotation is kept parsed, in [`CachedNode::record`]. A struct of its own rather than a
/// trimmed `Node`: a `Node` is over a kilobyte inline however little it holds, once per node of
/// the cluster while a maintenance exists.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeFacts {
    pub name: String,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub unschedulable: bool,
    pub taints: Vec<Taint>,
    /// Only the maintenance conditions (`MAINTENANCE_CONDITIONS`).
    pub conditions: Vec<NodeCondition>,
}

impl NodeFacts {
    /// What the reconciler reads of `node`; the rest (images, addresses, other annotations and
    /// conditions, managedFields) is dropped.
    pub fn of(node: Node) -> Self {
        let Node {
            metadata,
            spec,
            status,
        } = node;
        let spec = spec.unwrap_or_default();
        // A decoded list may keep spare room; these live as long as the cache.
        let mut taints = spec.taints.unwrap_or_default();
        taints.shrink_to_fit();
        let conditions = status.and_then(|s| s.conditions).unwrap_or_default();
        Self {
            name: metadata.name.unwrap_or_default(),
            uid: metadata.uid,
            resource_version: metadata.resource_version,
            labels: metadata.labels.unwrap_or_default(),
            unschedulable: spec.unschedulable.unwrap_or(false),
            taints,
            conditions: crate::shared::filter_exact(conditions, |c| {
                MAINTENANCE_CONDITIONS.contains(&c.type_.as_str())
            }),
        }
    }
}

/// One Node with its record parsed. The facts are behind an `Arc`: each reconcile's view of
/// the nodes it holds shares them with the cache.
#[derive(Clone, Debug)]
pub struct CachedNode {
    pub node: Arc<NodeFacts>,
    pub record: Option<NodeRecord>,
    rv: u64,
}

impl CachedNode {
    fn new(node: Node) -> Self {
        let record = NodeRecord::parse(
            node.annotations()
                .get(ANNOTATION_MAINTENANCE)
                .map(String::as_str),
        );
        let rv = resource_version(node.meta());
        Self {
            node: Arc::new(NodeFacts::of(node)),
            record,
            rv,
        }
    }

    /// The same as far as the controller cares (the resourceVersion aside).
    fn same(&self, other: &CachedNode) -> bool {
        let (a, b) = (&*self.node, &*other.node);
        self.record == other.record
            && (
                &a.name,
                &a.uid,
                &a.labels,
                a.unschedulable,
                &a.taints,
                &a.conditions,
            ) == (
                &b.name,
                &b.uid,
                &b.labels,
                b.unschedulable,
                &b.taints,
                &b.conditions,
            )
    }
}

fn resource_version(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// One scheduled Pod as the plan sees it, with what eviction and deletion need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedPod {
    pub facts: PodFacts,
    pub uid: Option<String>,
    /// `metadata.deletionTimestamp` in Unix seconds.
    pub deletion: Option<i64>,
}

impl CachedPod {
    pub fn new(pod: &Pod) -> Self {
        Self {
            facts: pod_facts(pod),
            uid: pod.metadata.uid.clone(),
            deletion: pod
                .metadata
                .deletion_timestamp
                .as_ref()
                .map(|t| t.0.as_second()),
        }
    }
}

#[derive(Clone, Debug)]
struct CachedBudget {
    budget: Budget,
    rv: u64,
    /// Allowances this replica spent since the status cached here was written.
    spent: i32,
    spent_at: Option<Instant>,
}

/// A budget as read from a PodDisruptionBudget; `None` for one whose selector this controller
/// cannot read (the API server still enforces it: the eviction gets a 429).
fn budget_of(pdb: &PodDisruptionBudget) -> Option<Budget> {
    let selector = match pdb.spec.as_ref()?.selector.as_ref() {
        None => None,
        // Through JSON: the same shape.
        Some(s) => {
            Some(serde_json::from_value::<LabelSelector>(serde_json::to_value(s).ok()?).ok()?)
        }
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
}

type PodKey = (String, String);

#[derive(Default)]
struct State {
    nodes: HashMap<String, CachedNode>,
    /// Nodes that carry a maintenance record.
    held: HashSet<String>,
    /// Scheduled pods by node, then by (namespace, name).
    pods: HashMap<String, HashMap<PodKey, CachedPod>>,
    pod_node: HashMap<PodKey, String>,
    budgets: HashMap<PodKey, CachedBudget>,
    /// Pod UIDs this replica evicted, until the pod watch shows them going.
    evicted: HashMap<String, Instant>,
    /// Maintenances this replica has reconciled (woken when any node's labels change).
    known: BTreeSet<String>,
    /// The NodeMaintenances that exist, from their metadata watch: while there is one, the
    /// other watches run.
    maintenances: BTreeSet<String>,
    maintenances_init: Option<BTreeSet<String>>,
    /// The metadata watch has listed the maintenances once: a holder missing from
    /// `maintenances` since may be gone.
    maintenances_listed: bool,
    /// When the last maintenance went, or a reconcile last asked for the watches: they run
    /// until the grace period has passed since.
    wanted_at: Option<Instant>,
    nodes_init: Option<HashMap<String, CachedNode>>,
    pods_init: Option<Vec<(String, PodKey, CachedPod)>>,
    budgets_init: Option<HashMap<PodKey, CachedBudget>>,
}

impl State {
    /// Maintenances holding `node` in `Draining`.
    fn draining_holders(&self, node: &str) -> Vec<String> {
        self.nodes
            .get(node)
            .and_then(|n| n.record.as_ref())
            .map(|r| {
                r.holders
                    .iter()
                    .filter(|(_, h)| h.phase == HoldPhase::Draining)
                    .map(|(name, _)| name.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Maintenances draining any node.
    fn all_draining(&self) -> BTreeSet<String> {
        self.held
            .iter()
            .flat_map(|n| self.draining_holders(n))
            .collect()
    }

    fn holders(node: Option<&CachedNode>) -> impl Iterator<Item = String> + '_ {
        node.and_then(|n| n.record.as_ref())
            .into_iter()
            .flat_map(|r| r.holders.keys().cloned())
    }

    /// Stores a node unless what is stored is newer; returns the maintenances to wake.
    fn put_node(&mut self, new: CachedNode) -> Vec<String> {
        let name = new.node.name.clone();
        let old = self.nodes.get(&name);
        if old.is_some_and(|o| o.rv > new.rv) {
            return Vec::new();
        }
        let mut wake: BTreeSet<String> = BTreeSet::new();
        match old {
            Some(o) if o.same(&new) => {}
            Some(o) => {
                wake.extend(Self::holders(Some(o)));
                wake.extend(Self::holders(Some(&new)));
                if o.node.labels != new.node.labels {
                    wake.extend(self.known.iter().cloned());
                }
            }
            None => {
                wake.extend(Self::holders(Some(&new)));
                wake.extend(self.known.iter().cloned());
            }
        }
        if new.record.is_some() {
            self.held.insert(name.clone());
        } else {
            self.held.remove(&name);
        }
        self.nodes.insert(name, new);
        wake.into_iter().collect()
    }

    fn put_pod(&mut self, node: String, key: PodKey, pod: CachedPod) -> Vec<String> {
        if pod.deletion.is_some()
            && let Some(uid) = &pod.uid
        {
            self.evicted.remove(uid);
        }
        let before = self.pod_node.insert(key.clone(), node.clone());
        if let Some(before) = before.filter(|b| *b != node)
            && let Some(m) = self.pods.get_mut(&before)
        {
            m.remove(&key);
        }
        let slot = self.pods.entry(node.clone()).or_default();
        if slot.get(&key) == Some(&pod) {
            return Vec::new();
        }
        slot.insert(key, pod);
        self.draining_holders(&node)
    }

    fn remove_pod(&mut self, key: &PodKey, uid: Option<&str>) -> Vec<String> {
        if let Some(uid) = uid {
            self.evicted.remove(uid);
        }
        let Some(node) = self.pod_node.remove(key) else {
            return Vec::new();
        };
        if let Some(m) = self.pods.get_mut(&node) {
            m.remove(key);
            if m.is_empty() {
                self.pods.remove(&node);
            }
        }
        self.draining_holders(&node)
    }

    fn put_budget(&mut self, key: PodKey, new: CachedBudget) -> Vec<String> {
        let old = self.budgets.get(&key);
        if old.is_some_and(|o| o.rv > new.rv) {
            return Vec::new();
        }
        // Only a budget allowing more (or selecting differently) can let a drain go on; the
        // status after an eviction (allowing less) wakes nobody.
        let freed = old.is_none_or(|o| {
            new.budget.allowed > o.budget.allowed || new.budget.selector != o.budget.selector
        });
        self.budgets.insert(key, new);
        if freed {
            self.all_draining().into_iter().collect()
        } else {
            Vec::new()
        }
    }
}

/// What the trigger stream does with the node, pod and budget watches.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Start,
    Stop,
    /// As they are, until this moment (when they may have to stop) or the next event.
    Keep(Option<Instant>),
}

/// The watches are wanted while a maintenance exists and for `grace` after they were last
/// wanted.
fn step(
    running: bool,
    maintenances: usize,
    wanted_at: Option<Instant>,
    grace: Duration,
    now: Instant,
) -> Step {
    let until = wanted_at.map(|at| at + grace).filter(|until| now < *until);
    let wanted = maintenances > 0 || until.is_some();
    match (running, wanted) {
        (false, true) => Step::Start,
        (true, false) => Step::Stop,
        (true, true) if maintenances == 0 => Step::Keep(until),
        _ => Step::Keep(None),
    }
}

/// The watches' state, shared by the trigger stream (which feeds it) and the reconciles.
pub struct Cache {
    state: Mutex<State>,
    ready: watch::Sender<u8>,
    /// Wakes the trigger stream when a reconcile asks for the watches ([`Cache::want`]).
    wanted: Notify,
    grace: Duration,
    gauges: MaintenanceMetrics,
}

impl Default for Cache {
    fn default() -> Self {
        Self::new(DEFAULT_GRACE, MaintenanceMetrics::default())
    }
}

impl Cache {
    /// An empty cache whose watches stop `grace` after the last maintenance went.
    pub fn new(grace: Duration, gauges: MaintenanceMetrics) -> Self {
        Self {
            state: Mutex::default(),
            ready: watch::Sender::new(0),
            wanted: Notify::new(),
            grace,
            gauges,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks one watch as listed; called with the state locked, whose counts it logs once the
    /// last of the three has listed.
    fn set_ready(&self, bit: u8, s: &State) {
        let mut filled = false;
        self.ready.send_modify(|r| {
            filled = *r != ALL && *r | bit == ALL;
            *r |= bit;
        });
        if filled {
            info!(
                nodes = s.nodes.len(),
                pods = s.pod_node.len(),
                budgets = s.budgets.len(),
                "nodemaintenance: node, pod and PodDisruptionBudget caches listed"
            );
        }
    }

    fn set_gauges(&self) {
        let s = self.lock();
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.gauges.cached_nodes.set(count(s.nodes.len()));
        self.gauges.cached_pods.set(count(s.pod_node.len()));
    }

    /// A reconcile needs the watches: they start if they were stopped, and run for at least
    /// the grace period from now (a reconcile may come before the metadata watch has shown its
    /// maintenance).
    pub fn want(&self) {
        self.lock().wanted_at = Some(Instant::now());
        self.wanted.notify_one();
    }

    /// What the trigger stream does next with the watches.
    fn step(&self, running: bool) -> Step {
        let s = self.lock();
        step(
            running,
            s.maintenances.len(),
            s.wanted_at,
            self.grace,
            Instant::now(),
        )
    }

    /// Forgets everything the stopped watches had brought, releasing the maps' memory (new,
    /// empty maps replace them: a cleared map keeps its capacity), and the counts it held.
    fn release(&self) -> (usize, usize) {
        self.ready.send_replace(0);
        let mut s = self.lock();
        let counts = (s.nodes.len(), s.pod_node.len());
        *s = State {
            maintenances: std::mem::take(&mut s.maintenances),
            maintenances_init: s.maintenances_init.take(),
            maintenances_listed: s.maintenances_listed,
            wanted_at: s.wanted_at,
            ..State::default()
        };
        drop(s);
        self.set_gauges();
        counts
    }

    /// Keeps the set of NodeMaintenances that exist.
    fn on_maintenance(
        &self,
        event: Result<Event<PartialObjectMeta<NodeMaintenance>>, watcher::Error>,
    ) {
        let event = match event {
            Ok(e) => e,
            Err(error) => {
                warn!(%error, "nodemaintenance: NodeMaintenance metadata watch failed; it restarts");
                return;
            }
        };
        let mut s = self.lock();
        let before = s.maintenances.len();
        match event {
            Event::Init => s.maintenances_init = Some(BTreeSet::new()),
            Event::InitApply(m) => {
                if let Some(buffer) = s.maintenances_init.as_mut() {
                    buffer.insert(m.name_any());
                }
            }
            Event::InitDone => {
                if let Some(buffer) = s.maintenances_init.take() {
                    s.maintenances = buffer;
                    s.maintenances_listed = true;
                }
            }
            Event::Apply(m) => {
                s.maintenances.insert(m.name_any());
            }
            Event::Delete(m) => {
                s.maintenances.remove(&m.name_any());
            }
        }
        if before > 0 && s.maintenances.is_empty() {
            s.wanted_at = Some(Instant::now());
        }
    }

    /// Waits until every watch has listed once.
    pub async fn wait_ready(&self, limit: Duration) -> Result<(), NotReady> {
        let mut rx = self.ready.subscribe();
        match tokio::time::timeout(limit, rx.wait_for(|r| *r == ALL)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(NotReady(limit)),
        }
    }

    /// Remembers a maintenance (so that node label changes wake it) or forgets a deleted one.
    pub fn know(&self, name: &str, present: bool) {
        let mut s = self.lock();
        if present {
            if !s.known.contains(name) {
                s.known.insert(name.to_owned());
            }
        } else {
            s.known.remove(name);
        }
    }

    /// Every node (trimmed) with its record.
    pub fn nodes(&self) -> Vec<CachedNode> {
        self.lock().nodes.values().cloned().collect()
    }

    /// Visits every cached node under the lock, without copying it: a reconcile looks at every
    /// node (selection, cluster-wide counts) but keeps only a few, and copying all of them for
    /// every one of a thousand maintenances made a scale-down CPU-bound (`bench nodeset`).
    /// `visit` must not block.
    pub fn scan_nodes(&self, mut visit: impl FnMut(&CachedNode)) {
        for node in self.lock().nodes.values() {
            visit(node);
        }
    }

    /// Whether the NodeMaintenance metadata watch has listed once.
    pub fn maintenances_listed(&self) -> bool {
        self.lock().maintenances_listed
    }

    /// The nodes held by a maintenance the NodeMaintenance metadata watch does not show, by
    /// that maintenance's name; nothing before that watch has listed. Such a holder may be
    /// gone without having released its nodes (deleted before its finalizer was added), or
    /// merely not shown yet (just created): only the API server can tell.
    pub fn unknown_holders(&self) -> BTreeMap<String, Vec<CachedNode>> {
        let s = self.lock();
        let mut out: BTreeMap<String, Vec<CachedNode>> = BTreeMap::new();
        if !s.maintenances_listed {
            return out;
        }
        for node in s.held.iter().filter_map(|n| s.nodes.get(n)) {
            for holder in State::holders(Some(node)) {
                if !s.maintenances.contains(&holder) {
                    out.entry(holder).or_default().push(node.clone());
                }
            }
        }
        out
    }

    /// The nodes that carry a maintenance record.
    pub fn held_nodes(&self) -> Vec<CachedNode> {
        let s = self.lock();
        s.held
            .iter()
            .filter_map(|n| s.nodes.get(n).cloned())
            .collect()
    }

    /// A node this replica just wrote (the API's answer), so that the next reconcile does not
    /// read the older copy before the watch brings the new one.
    pub fn wrote_node(&self, node: Node) {
        self.lock().put_node(CachedNode::new(node));
    }

    /// The pods on `node`; a pod this replica evicted counts as terminating even before the
    /// watch says so.
    pub fn pods_on(&self, node: &str) -> Vec<CachedPod> {
        let s = self.lock();
        let now = Instant::now();
        let mut pods: Vec<CachedPod> = s
            .pods
            .get(node)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        for p in &mut pods {
            let evicted = p
                .uid
                .as_ref()
                .and_then(|u| s.evicted.get(u))
                .is_some_and(|at| now.duration_since(*at) < EVICTED_MEMORY);
            if evicted {
                p.facts.terminating = true;
            }
        }
        // A stable order: the plan and the status list pods the same way every time.
        pods.sort_by(|a, b| {
            (&a.facts.namespace, &a.facts.name).cmp(&(&b.facts.namespace, &b.facts.name))
        });
        pods
    }

    /// Pods this replica evicted (accepted by the API server).
    pub fn evicted(&self, uids: impl IntoIterator<Item = String>) {
        let mut s = self.lock();
        let now = Instant::now();
        s.evicted
            .retain(|_, at| now.duration_since(*at) < EVICTED_MEMORY);
        for uid in uids {
            s.evicted.insert(uid, now);
        }
    }

    /// Every budget with what it allows now, less what this replica spent since its status was
    /// written.
    pub fn budgets(&self) -> Vec<Budget> {
        let now = Instant::now();
        self.lock()
            .budgets
            .values()
            .map(|b| {
                let mut budget = b.budget.clone();
                if b.spent_at
                    .is_some_and(|at| now.duration_since(at) < SPENT_MEMORY)
                {
                    budget.allowed -= b.spent;
                }
                budget
            })
            .collect()
    }

    /// Allowances spent by accepted evictions, per budget (namespace, name).
    pub fn spent(&self, spent: &[(String, String, i32)]) {
        let mut s = self.lock();
        let now = Instant::now();
        for (ns, name, n) in spent {
            if let Some(b) = s.budgets.get_mut(&(ns.clone(), name.clone())) {
                if b.spent_at
                    .is_none_or(|at| now.duration_since(at) >= SPENT_MEMORY)
                {
                    b.spent = 0;
                }
                b.spent += n;
                b.spent_at = Some(now);
            }
        }
    }

    fn on_node(&self, event: Result<Event<Node>, watcher::Error>) -> Vec<String> {
        let event = match event {
            Ok(e) => e,
            Err(error) => {
                warn!(%error, "nodemaintenance: node watch failed; it restarts");
                return Vec::new();
            }
        };
        let mut s = self.lock();
        match event {
            Event::Init => {
                s.nodes_init = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(node) => {
                let c = CachedNode::new(node);
                if let Some(buffer) = s.nodes_init.as_mut() {
                    buffer.insert(c.node.name.clone(), c);
                }
                Vec::new()
            }
            Event::InitDone => {
                if let Some(buffer) = s.nodes_init.take() {
                    s.held = buffer
                        .iter()
                        .filter(|(_, n)| n.record.is_some())
                        .map(|(k, _)| k.clone())
                        .collect();
                    s.nodes = buffer;
                }
                self.set_ready(NODES, &s);
                s.known.iter().cloned().collect()
            }
            Event::Apply(node) => s.put_node(CachedNode::new(node)),
            Event::Delete(node) => {
                let name = node.name_any();
                let old = s.nodes.remove(&name);
                s.held.remove(&name);
                let mut wake: BTreeSet<String> = State::holders(old.as_ref()).collect();
                wake.extend(s.known.iter().cloned());
                wake.into_iter().collect()
            }
        }
    }

    fn on_pod(&self, event: Result<Event<Pod>, watcher::Error>) -> Vec<String> {
        let event = match event {
            Ok(e) => e,
            Err(error) => {
                warn!(%error, "nodemaintenance: pod watch failed; it restarts");
                return Vec::new();
            }
        };
        let key = |p: &Pod| (p.namespace().unwrap_or_default(), p.name_any());
        let node = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.clone());
        let mut s = self.lock();
        match event {
            Event::Init => {
                s.pods_init = Some(Vec::new());
                Vec::new()
            }
            Event::InitApply(pod) => {
                if let (Some(n), Some(buffer)) = (node(&pod), s.pods_init.as_mut()) {
                    buffer.push((n, key(&pod), CachedPod::new(&pod)));
                }
                Vec::new()
            }
            Event::InitDone => {
                if let Some(buffer) = s.pods_init.take() {
                    s.pods.clear();
                    s.pod_node.clear();
                    for (n, k, p) in buffer {
                        s.pod_node.insert(k.clone(), n.clone());
                        s.pods.entry(n).or_default().insert(k, p);
                    }
                }
                self.set_ready(PODS, &s);
                s.known.iter().cloned().collect()
            }
            Event::Apply(pod) => match node(&pod) {
                Some(n) => s.put_pod(n, key(&pod), CachedPod::new(&pod)),
                None => Vec::new(),
            },
            Event::Delete(pod) => s.remove_pod(&key(&pod), pod.metadata.uid.as_deref()),
        }
    }

    fn on_budget(&self, event: Result<Event<PodDisruptionBudget>, watcher::Error>) -> Vec<String> {
        let event = match event {
            Ok(e) => e,
            Err(error) => {
                warn!(%error, "nodemaintenance: PodDisruptionBudget watch failed; it restarts");
                return Vec::new();
            }
        };
        let cached = |pdb: &PodDisruptionBudget| {
            budget_of(pdb).map(|budget| CachedBudget {
                budget,
                rv: resource_version(pdb.meta()),
                spent: 0,
                spent_at: None,
            })
        };
        let key = |p: &PodDisruptionBudget| (p.namespace().unwrap_or_default(), p.name_any());
        let mut s = self.lock();
        match event {
            Event::Init => {
                s.budgets_init = Some(HashMap::new());
                Vec::new()
            }
            Event::InitApply(pdb) => {
                if let (Some(b), Some(buffer)) = (cached(&pdb), s.budgets_init.as_mut()) {
                    buffer.insert(key(&pdb), b);
                }
                Vec::new()
            }
            Event::InitDone => {
                if let Some(buffer) = s.budgets_init.take() {
                    s.budgets = buffer;
                }
                self.set_ready(BUDGETS, &s);
                s.known.iter().cloned().collect()
            }
            Event::Apply(pdb) => match cached(&pdb) {
                Some(b) => s.put_budget(key(&pdb), b),
                None => {
                    s.budgets.remove(&key(&pdb));
                    s.all_draining().into_iter().collect()
                }
            },
            Event::Delete(pdb) => {
                s.budgets.remove(&key(&pdb));
                s.all_draining().into_iter().collect()
            }
        }
    }

    /// The node, pod and budget watches, feeding this cache, as one stream of the
    /// maintenances each event wakes.
    fn watches(self: &Arc<Self>, client: &kube::Client) -> BoxStream<'static, Vec<String>> {
        // Nodes and Pods are streamed on the watch where the API server can, else listed in
        // pages at the most recent resourceVersion (`shared::lists`). Never one list at
        // resourceVersion 0 (`any_semantic`): the API server's watch cache ignores its page size
        // (kubernetes/kubernetes#96182), so every Pod of the cluster (hundreds of thousands at
        // 10,000 nodes) would arrive in one response and be decoded at once, a peak of gigabytes
        // in this process at each (re)list. PodDisruptionBudgets are few and use it.
        let c = Arc::clone(self);
        let nodes = watcher::watcher(
            Api::<Node>::all(client.clone()),
            crate::shared::lists::nodes(),
        )
        .default_backoff()
        .map(move |e| c.on_node(e));
        let c = Arc::clone(self);
        let pods = watcher::watcher(
            Api::<Pod>::all(client.clone()),
            crate::shared::lists::pods(),
        )
        .default_backoff()
        .map(move |e| c.on_pod(e));
        let c = Arc::clone(self);
        let budgets = watcher::watcher(
            Api::<PodDisruptionBudget>::all(client.clone()),
            watcher::Config::default().any_semantic(),
        )
        .default_backoff()
        .map(move |e| c.on_budget(e));
        futures::stream::select_all([nodes.boxed(), pods.boxed(), budgets.boxed()]).boxed()
    }

    /// The watches feeding this cache as one stream with an item each time some maintenance
    /// should look again. They run while the controller polls the stream, i.e. while this
    /// replica leads: the NodeMaintenance metadata watch always, the node, pod and budget
    /// watches while a maintenance exists (and for the grace period after). The item wakes
    /// every maintenance (kube's per-object trigger is an unstable feature); there are few, and
    /// a reconcile with nothing to do reads only this cache and writes nothing, while the event
    /// that concerns none is dropped here.
    pub fn triggers(self: &Arc<Self>, client: &kube::Client) -> BoxStream<'static, ()> {
        let c = Arc::clone(self);
        // Metadata only: whether a maintenance exists is all this watch is for. A consistent
        // list (there are few maintenances): one from the API server's watch cache can be older
        // than the cache's window and fail the watch that follows, right after the CRD came.
        let maintenances = watcher::watcher(
            Api::<PartialObjectMeta<NodeMaintenance>>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .map(move |e| c.on_maintenance(e))
        .boxed();
        let driver = Driver {
            cache: Arc::clone(self),
            client: client.clone(),
            maintenances,
            watches: None,
        };
        futures::stream::unfold(driver, Driver::next).boxed()
    }
}

/// The state of [`Cache::triggers`]' stream: the watches it runs now.
struct Driver {
    cache: Arc<Cache>,
    client: kube::Client,
    maintenances: BoxStream<'static, ()>,
    /// The node, pod and budget watches, while they run. Dropping the stream ends them.
    watches: Option<BoxStream<'static, Vec<String>>>,
}

impl Driver {
    /// Runs the watches until one wakes some maintenance; starts and stops the node, pod and
    /// budget watches on the way as the maintenances come and go.
    async fn next(mut self) -> Option<((), Self)> {
        loop {
            let until = match self.cache.step(self.watches.is_some()) {
                Step::Start => {
                    info!(
                        "nodemaintenance: a NodeMaintenance exists; starting the node, pod and PodDisruptionBudget caches"
                    );
                    self.watches = Some(self.cache.watches(&self.client));
                    continue;
                }
                Step::Stop => {
                    self.watches = None;
                    let (nodes, pods) = self.cache.release();
                    info!(
                        nodes,
                        pods,
                        grace = ?self.cache.grace,
                        "nodemaintenance: no NodeMaintenance for the grace period; stopped the node, pod and PodDisruptionBudget caches and released them"
                    );
                    continue;
                }
                Step::Keep(until) => until,
            };
            let Self {
                cache,
                maintenances,
                watches,
                ..
            } = &mut self;
            let woken = async {
                match watches.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            let stop = async {
                match until {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            // `None` when a watch stream ended (watcher streams never do; this one ends with
            // them), else whether some maintenance is woken.
            let wake = tokio::select! {
                event = maintenances.next() => event.map(|()| false),
                names = woken => names.map(|n| !n.is_empty()),
                () = cache.wanted.notified() => Some(false),
                () = stop => Some(false),
            };
            if self.watches.is_some() {
                self.cache.set_gauges();
            }
            if wake? {
                return Some(((), self));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controllers::node_maintenance::record::{Hold, set_hold};

    fn node(name: &str, rv: u64, record: Option<&NodeRecord>) -> Node {
        let mut annotations = std::collections::BTreeMap::new();
        if let Some(r) = record {
            annotations.insert(ANNOTATION_MAINTENANCE.to_owned(), r.to_annotation());
        }
        annotations.insert("big".to_owned(), "x".repeat(100));
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.to_string()),
                annotations: Some(annotations),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    fn pod(name: &str, node: &str, uid: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "uid": uid,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                    "uid": "rs", "controller": true}]},
            "spec": {"nodeName": node, "containers": []},
        }))
        .unwrap()
    }

    fn draining(holder: &str) -> NodeRecord {
        let hold = Hold {
            phase: HoldPhase::Draining,
            drain_start: Some(1),
            note: String::new(),
            reason: String::new(),
        };
        set_hold(None, false, holder, hold)
    }

    #[test]
    fn pod_events_wake_the_maintenance_draining_their_node_only() {
        let cache = Cache::default();
        let r = draining("m");
        cache.on_node(Ok(Event::Apply(node("n1", 5, Some(&r)))));
        cache.on_node(Ok(Event::Apply(node("n2", 5, None))));
        assert_eq!(cache.on_pod(Ok(Event::Apply(pod("a", "n1", "u1")))), ["m"]);
        assert!(
            cache
                .on_pod(Ok(Event::Apply(pod("b", "n2", "u2"))))
                .is_empty()
        );
        // The same pod again (a status change the plan does not read): nobody woken.
        assert!(
            cache
                .on_pod(Ok(Event::Apply(pod("a", "n1", "u1"))))
                .is_empty()
        );
        assert_eq!(cache.pods_on("n1").len(), 1);
        // Evicted here: terminating at once, before the watch says so.
        cache.evicted(["u1".to_owned()]);
        assert!(cache.pods_on("n1")[0].facts.terminating);
        assert_eq!(cache.on_pod(Ok(Event::Delete(pod("a", "n1", "u1")))), ["m"]);
        assert!(cache.pods_on("n1").is_empty());
        // The maintenance annotation is kept, parsed.
        let n1 = &cache
            .nodes()
            .into_iter()
            .find(|n| n.node.name == "n1")
            .unwrap();
        assert!(n1.record.is_some());
        assert_eq!(cache.held_nodes().len(), 1);
    }

    #[test]
    fn an_older_node_never_replaces_a_newer_one() {
        let cache = Cache::default();
        cache.wrote_node(node("n1", 9, Some(&draining("m"))));
        // A watch event from before this replica's write arrives late.
        cache.on_node(Ok(Event::Apply(node("n1", 7, None))));
        assert!(cache.held_nodes()[0].record.is_some());
    }

    #[test]
    fn spent_allowances_count_until_the_budget_moves_on() {
        let cache = Cache::default();
        cache.on_node(Ok(Event::Apply(node("n1", 1, Some(&draining("m"))))));
        let pdb = |rv: u64, allowed: i32| -> PodDisruptionBudget {
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "ns", "name": "web", "resourceVersion": rv.to_string()},
                "spec": {"selector": {"matchLabels": {"app": "web"}}},
                "status": {"disruptionsAllowed": allowed, "currentHealthy": 3, "desiredHealthy": 2,
                    "expectedPods": 3, "observedGeneration": 1},
            }))
            .unwrap()
        };
        // A budget allowing a disruption wakes the draining maintenance.
        assert_eq!(cache.on_budget(Ok(Event::Apply(pdb(1, 1)))), ["m"]);
        cache.spent(&[("ns".into(), "web".into(), 1)]);
        assert_eq!(cache.budgets()[0].allowed, 0);
        // The status after the eviction (allowing nothing): no wake-up, nothing spent twice.
        assert!(cache.on_budget(Ok(Event::Apply(pdb(2, 0)))).is_empty());
        assert_eq!(cache.budgets()[0].allowed, 0);
        // A replacement is Ready: allowed again, and woken.
        assert_eq!(cache.on_budget(Ok(Event::Apply(pdb(3, 1)))), ["m"]);
        assert_eq!(cache.budgets()[0].allowed, 1);
    }

    #[tokio::test]
    async fn ready_only_after_every_watch_listed() {
        let cache = Cache::default();
        cache.on_node(Ok(Event::Init));
        cache.on_node(Ok(Event::InitDone));
        cache.on_pod(Ok(Event::Init));
        cache.on_pod(Ok(Event::InitApply(pod("a", "n1", "u1"))));
        cache.on_pod(Ok(Event::InitDone));
        assert!(cache.wait_ready(Duration::from_millis(10)).await.is_err());
        cache.on_budget(Ok(Event::Init));
        cache.on_budget(Ok(Event::InitDone));
        assert!(cache.wait_ready(Duration::from_millis(10)).await.is_ok());
        assert_eq!(cache.pods_on("n1").len(), 1);
    }

    #[test]
    fn the_watches_run_while_a_maintenance_exists_and_for_the_grace_after() {
        let grace = Duration::from_secs(300);
        let t0 = Instant::now();
        let later = |s: u64| t0 + Duration::from_secs(s);
        // A cluster that never had a maintenance: nothing runs.
        assert_eq!(step(false, 0, None, grace, t0), Step::Keep(None));
        // One appears (or a reconcile asked): start, and keep while one exists.
        assert_eq!(step(false, 1, None, grace, t0), Step::Start);
        assert_eq!(step(false, 0, Some(t0), grace, t0), Step::Start);
        assert_eq!(step(true, 2, Some(t0), grace, later(900)), Step::Keep(None));
        // The last went at t0: kept until the grace period has passed, then stopped.
        assert_eq!(
            step(true, 0, Some(t0), grace, later(10)),
            Step::Keep(Some(later(300)))
        );
        assert_eq!(step(true, 0, Some(t0), grace, later(300)), Step::Stop);
        assert_eq!(
            step(false, 0, Some(t0), grace, later(301)),
            Step::Keep(None)
        );
    }

    #[tokio::test]
    async fn released_caches_hold_nothing_and_list_again() {
        let gauges = MaintenanceMetrics::default();
        let cache = Cache::new(Duration::from_secs(1), gauges.clone());
        let meta = |name: &str| PartialObjectMeta::<NodeMaintenance> {
            types: None,
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        };
        cache.on_maintenance(Ok(Event::Init));
        cache.on_maintenance(Ok(Event::InitApply(meta("m"))));
        cache.on_maintenance(Ok(Event::InitDone));
        assert_eq!(cache.step(false), Step::Start);
        let fill = |cache: &Cache| {
            cache.on_node(Ok(Event::Init));
            cache.on_node(Ok(Event::InitApply(node("n1", 1, Some(&draining("m"))))));
            cache.on_node(Ok(Event::InitDone));
            cache.on_pod(Ok(Event::Init));
            cache.on_pod(Ok(Event::InitApply(pod("a", "n1", "u1"))));
            cache.on_pod(Ok(Event::InitDone));
            cache.on_budget(Ok(Event::Init));
            cache.on_budget(Ok(Event::InitDone));
            cache.set_gauges();
        };
        fill(&cache);
        assert!(cache.wait_ready(Duration::from_millis(10)).await.is_ok());
        assert_eq!(
            (gauges.cached_nodes.get(), gauges.cached_pods.get()),
            (1, 1)
        );
        // The last maintenance goes: the watches stay for the grace period.
        cache.on_maintenance(Ok(Event::Delete(meta("m"))));
        assert!(matches!(cache.step(true), Step::Keep(Some(_))));
        cache.lock().wanted_at = Some(Instant::now() - Duration::from_secs(2));
        assert_eq!(cache.step(true), Step::Stop);
        assert_eq!(cache.release(), (1, 1));
        assert_eq!(
            (gauges.cached_nodes.get(), gauges.cached_pods.get()),
            (0, 0)
        );
        assert!(cache.nodes().is_empty() && cache.pods_on("n1").is_empty());
        {
            let s = cache.lock();
            assert_eq!(
                s.nodes.capacity() + s.pods.capacity() + s.pod_node.capacity(),
                0
            );
        }
        // A reconcile that comes now waits for the next list.
        assert!(cache.wait_ready(Duration::from_millis(10)).await.is_err());
        // A new maintenance: started again, and ready once listed.
        cache.on_maintenance(Ok(Event::Apply(meta("m2"))));
        assert_eq!(cache.step(false), Step::Start);
        fill(&cache);
        assert!(cache.wait_ready(Duration::from_millis(10)).await.is_ok());
        assert_eq!(cache.pods_on("n1").len(), 1);
    }

    #[test]
    fn a_reconcile_asks_for_the_watches_before_their_watch_shows_its_maintenance() {
        let cache = Cache::new(Duration::from_secs(60), MaintenanceMetrics::default());
        assert_eq!(cache.step(false), Step::Keep(None));
        cache.want();
        assert_eq!(cache.step(false), Step::Start);
        assert!(matches!(cache.step(true), Step::Keep(Some(_))));
    }

    #[test]
    fn node_facts_are_a_fraction_of_a_node() {
        // Per node of the cluster while a maintenance exists: the inline part alone, before
        // the labels and strings both keep.
        let (facts, node) = (size_of::<NodeFacts>(), size_of::<Node>());
        assert!(
            facts * 4 < node,
            "NodeFacts {facts} bytes, Node {node} bytes"
        );
    }
}
