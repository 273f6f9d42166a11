//! The fleet as the controller holds it in memory: one small entry per Node (its agent address,
//! the nodekeeper conditions it carries, its schedule and last report), fed by a Node watch.
//!
//! Trimming: the watch decodes each Node event and keeps only what the controller uses (name,
//! InternalIP, resourceVersion and nodekeeper's own conditions); the decoded object is dropped at
//! once. There is no reflector store, so managedFields, images, labels, other conditions and
//! the rest of the Node never stay in memory — at 10,000 nodes that is the difference between
//! a few MiB and several hundred. A metadata-only watch would not do: the InternalIP and the
//! conditions live in `status`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use nodekeeper_api::crd::common::LabelSelector;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::agent_client::CallOutcome;
use super::metrics::{ReasonLabels, SkipReason, SweepMetrics};
use crate::conditions::{Condition, OWNED_TYPES, Status, Written};
use crate::schedule::NodeSchedule;
use crate::view::StoredReport;

/// What the controller keeps of one Node object.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeFacts {
    pub name: String,
    pub address: Option<IpAddr>,
    pub resource_version: u64,
    pub written: Vec<Written>,
    /// Condition types another writer keeps up to date on this Node ([`left_to_others`]),
    /// sorted; usually none.
    pub foreign: Vec<String>,
}

/// How recent another writer's heartbeat on a condition must be for the type to be left to it.
/// node-problem-detector writes every condition it owns at least every 5 minutes
/// (`--k8s-exporter-heartbeat-period`, its condition manager's forced sync), each time with a new
/// `lastHeartbeatTime`; three missed heartbeats mean it is gone, and its types are taken over.
pub const FOREIGN_HEARTBEAT_FRESH: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// The condition types on `node` that another field manager owns and keeps alive (a
/// `lastHeartbeatTime` within [`FOREIGN_HEARTBEAT_FRESH`] of `now_unix`), other than the
/// kubelet's and nodekeeper's own reserved types. During a migration node-problem-detector may
/// run beside the agent and write the same types (`KernelDeadlock`, …); written by both, each
/// write would take the field from the other, about two writes per node per NPD heartbeat. Such
/// a type is left to the other writer until its heartbeat stops.
pub fn left_to_others(node: &Node, ours: &BTreeSet<String>, now_unix: i64) -> Vec<String> {
    let fresh_after = now_unix - FOREIGN_HEARTBEAT_FRESH.as_secs() as i64;
    let mut out: Vec<String> = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| {
            !ours.contains(&c.type_)
                && !nodekeeper_model::tuning::RESERVED_CONDITION_TYPES.contains(&c.type_.as_str())
                && c.last_heartbeat_time
                    .as_ref()
                    .is_some_and(|t| t.0.as_second() >= fresh_after)
        })
        .map(|c| c.type_.clone())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Extracts [`NodeFacts`] from a Node: the first InternalIP, and only nodekeeper's conditions.
pub fn node_facts(node: &Node) -> NodeFacts {
    let status = node.status.as_ref();
    let address = status
        .and_then(|s| s.addresses.as_ref())
        .and_then(|addrs| addrs.iter().find(|a| a.type_ == "InternalIP"))
        .and_then(|a| a.address.parse::<IpAddr>().ok());
    // Problem types are open-ended (any rule file may declare one): ours are those our field
    // manager applied, as the Node's managedFields say.
    let managed = crate::conditions::managed_condition_types(
        node.metadata.managed_fields.as_deref().unwrap_or_default(),
    );
    let now_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let foreign = left_to_others(node, &managed, now_unix);
    let written = status
        .and_then(|s| s.conditions.as_ref())
        .map(|conds| {
            conds
                .iter()
                .filter(|c| OWNED_TYPES.contains(&c.type_.as_str()) || managed.contains(&c.type_))
                .map(|c| Written {
                    condition: Condition {
                        type_: c.type_.clone(),
                        status: Status::parse(&c.status),
                        reason: c.reason.clone().unwrap_or_default(),
                        message: c.message.clone().unwrap_or_default(),
                    },
                    last_transition_time: c.last_transition_time.as_ref().map(|t| t.0.to_string()),
                })
                .collect()
        })
        .unwrap_or_default();
    NodeFacts {
        name: node.metadata.name.clone().unwrap_or_default(),
        address,
        // resourceVersions are opaque to clients in general; the Kubernetes apiserver's are etcd
        // revisions, which order events. An unparsable one (0) is always accepted.
        resource_version: node
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        written,
        foreign,
    }
}

/// The nodekeeper conditions last written on a Node, as one shared list: most nodes carry the
/// same ones (messages name no per-node value, and a first write gives every condition of a
/// node the same transition time), so the fleet keeps each distinct list once
/// ([`Fleet::observe`]) and an entry holds a pointer to it. Unshared, seven conditions cost a
/// node about 1.9 KiB (heaptrack, 1,000-node fleet bench).
pub type WrittenSet = Arc<[Written]>;

/// One node's entry.
#[derive(Debug)]
pub struct NodeEntry {
    pub address: Option<IpAddr>,
    pub resource_version: u64,
    pub written: WrittenSet,
    /// Condition types another writer keeps alive on this Node: not written by nodekeeper
    /// ([`left_to_others`]). `None` on almost every node.
    pub foreign: Option<Arc<[String]>>,
    pub schedule: NodeSchedule,
    /// The last report read, kept encoded (see [`StoredReport`]).
    pub report: Option<StoredReport>,
    /// The last failure's class and text (for the HTTP API and logs), cleared on success.
    pub last_failure: Option<(CallOutcome, String)>,
    /// The rules revision this agent refused on its merits (INVALID_ARGUMENT) and why; that
    /// revision is not pushed again. Cleared when the agent takes a revision.
    pub rules_refusal: Option<RulesRefusal>,
    pub stale: bool,
}

/// Rules the controller accepted and an agent still refused: the agent checks what only the
/// node can tell (a sysctl this kernel lacks, its own version's limits), so the shared validator
/// at the controller cannot catch everything. Shown on the node's page of the HTTP API, counted
/// in the summary and the `nodekeeper_sweep_nodes_refusing_rules` gauge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RulesRefusal {
    pub revision: u64,
    /// The agent's message (it names the rule and the field).
    pub error: String,
}

/// What became of pushing rules to one agent during a read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RulesNews {
    /// Nothing pushed, or the call failed for another reason: what was known stays.
    Nothing,
    /// The agent took a revision: any earlier refusal is over.
    Accepted,
    Refused(RulesRefusal),
}

impl NodeEntry {
    /// Records what became of a rules push. Returns +1 when this node starts refusing rules,
    /// -1 when it stops, 0 otherwise (for the gauge).
    pub fn note_rules(&mut self, news: RulesNews) -> i64 {
        let before = self.rules_refusal.is_some();
        match news {
            RulesNews::Nothing => {}
            RulesNews::Accepted => self.rules_refusal = None,
            RulesNews::Refused(refusal) => {
                // The agent's text is untrusted: kept short (the summary lists many nodes).
                let error = nodekeeper_model::text::truncate(&refusal.error, 512).into_owned();
                self.rules_refusal = Some(RulesRefusal { error, ..refusal });
            }
        }
        i64::from(self.rules_refusal.is_some()) - i64::from(before)
    }

    /// The revision not to push again (0: none).
    pub fn refused_revision(&self) -> u64 {
        self.rules_refusal.as_ref().map_or(0, |r| r.revision)
    }
}

/// How far the sweep got through the fleet ([`Fleet::read_progress`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadProgress {
    /// Nodes whose report the controller holds: their agent answered, and has not been stale
    /// since (a stale node's report is dropped).
    pub read: usize,
    /// Nodes with an address whose agent was called to the end at least once, answered or not.
    pub called: usize,
    /// Nodes with an address: the ones the sweep calls.
    pub reachable: usize,
}

impl ReadProgress {
    /// The first full sweep is done once every node with an address was called: an agent that
    /// does not answer is something the sweep found out, not a part of it still to do (counting
    /// only answers, one dead agent kept the first sweep unfinished for good).
    pub fn first_sweep_done(&self) -> bool {
        self.reachable > 0 && self.called >= self.reachable
    }
}

/// A node whose agent is due for a read.
#[derive(Clone, Debug)]
pub struct Job {
    pub name: String,
    pub endpoint: SocketAddr,
    pub cached_revision: Option<u64>,
    pub agent_rules_revision: Option<u64>,
    pub rules_refused: u64,
}

/// The fleet.
#[derive(Default)]
pub struct Fleet {
    nodes: Mutex<HashMap<String, NodeEntry>>,
    /// Every distinct [`WrittenSet`] an entry holds (see [`Interned`]). Locked after `nodes`.
    written: Mutex<Interned>,
    synced: AtomicBool,
    /// Every distinct [`NodeEntry::foreign`] list ([`Fleet::foreign_set`]).
    foreign_sets: Mutex<HashSet<Arc<[String]>>>,
    /// Woken when `synced` turns true ([`Fleet::wait_synced`]).
    synced_notify: tokio::sync::Notify,
    /// The previous leader's last Lease renewal (local clock), set once at takeover before the
    /// Node watch starts: see [`NodeSchedule::inherited_since`].
    previous_leader_renewed: Mutex<Option<Instant>>,
    /// The nodes found due by the last scan ([`Fleet::take_due`]). Locked before `nodes`.
    due: Mutex<DueQueue>,
    /// `--node-selector`, parsed, as the Node watch selects with it; `None`: every Node.
    selection: Mutex<Option<LabelSelector>>,
    /// Nodes that may have left the selection, for the cleaner of their conditions
    /// ([`Fleet::take_maybe_left`]); with `maybe_left_notify`, woken when one is added.
    maybe_left: Mutex<BTreeSet<String>>,
    maybe_left_notify: tokio::sync::Notify,
}

/// How old [`Fleet::take_due`]'s queue may get before it is scanned again while not used up.
pub const RESCAN: std::time::Duration = std::time::Duration::from_secs(2);

/// How soon after a scan a used-up queue may be scanned again. At rest nodes fall due one by
/// one, so every call found the queue used up and scanned the whole fleet for the one or two
/// due since: at 65,000 nodes (about 180 reads a second, each scan 6–7 ms) that was 31–45 % of
/// the controller's profile samples at rest. A node that falls due just after a scan now waits
/// at most this long, against a sweep interval of minutes.
pub const RESCAN_USED_UP: std::time::Duration = std::time::Duration::from_secs(1);

/// Nodes that were due at the last scan, the latest first (the earliest is popped first).
#[derive(Debug, Default)]
struct DueQueue {
    names: Vec<(Instant, String)>,
    scanned: Option<Instant>,
}

impl DueQueue {
    /// Capacity kept once the queue is used up; a larger buffer is freed.
    const KEPT_CAPACITY: usize = 1024;

    fn scan(&mut self, nodes: &HashMap<String, NodeEntry>, now: Instant) {
        self.names.clear();
        self.names.extend(
            nodes
                .iter()
                .filter(|(_, e)| e.address.is_some() && e.schedule.is_due(now))
                .map(|(name, e)| (e.schedule.next_due, name.clone())),
        );
        self.names
            .sort_unstable_by_key(|(due, _)| std::cmp::Reverse(*due));
        self.scanned = Some(now);
    }
}

/// The distinct condition lists of the fleet's entries. A list no entry holds any more is dropped
/// when the last entry lets go of it, or, if a writer still held a copy then, at the next sweep
/// of the set, which runs whenever the set has doubled since the last one.
#[derive(Debug)]
struct Interned {
    sets: HashSet<WrittenSet>,
    sweep_at: usize,
}

impl Default for Interned {
    fn default() -> Self {
        Self {
            sets: HashSet::new(),
            sweep_at: Self::MIN_SWEEP,
        }
    }
}

impl Interned {
    const MIN_SWEEP: usize = 64;

    /// The shared copy of `written`.
    fn get(&mut self, written: Vec<Written>) -> WrittenSet {
        if let Some(set) = self.sets.get(written.as_slice()) {
            return Arc::clone(set);
        }
        if self.sets.len() >= self.sweep_at {
            self.sets.retain(|set| Arc::strong_count(set) > 1);
            self.sweep_at = (self.sets.len() * 2).max(Self::MIN_SWEEP);
        }
        let set: WrittenSet = written.into();
        self.sets.insert(Arc::clone(&set));
        set
    }

    /// Forgets `set` when the caller's copy is the last outside this set.
    fn release(&mut self, set: WrittenSet) {
        if Arc::strong_count(&set) == 2 {
            self.sets.remove(&set);
        }
    }
}

impl Fleet {
    fn interned(&self) -> std::sync::MutexGuard<'_, Interned> {
        self.written.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The shared copy of a node's [`NodeEntry::foreign`] types: nodes beside the same other
    /// writer carry the same few types, kept once.
    fn foreign_set(&self, types: Vec<String>) -> Option<Arc<[String]>> {
        if types.is_empty() {
            return None;
        }
        let mut sets = self
            .foreign_sets
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(set) = sets.get(types.as_slice()) {
            return Some(Arc::clone(set));
        }
        // Sets no node holds any more are dropped before the list grows.
        if sets.len() >= 64 {
            sets.retain(|set| Arc::strong_count(set) > 1);
        }
        let set: Arc<[String]> = types.into();
        sets.insert(Arc::clone(&set));
        Some(set)
    }

    /// Distinct condition lists held for the fleet's entries (at most one per node).
    pub fn distinct_written(&self) -> usize {
        self.interned().sets.len()
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, NodeEntry>> {
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// True once the initial Node list has been read.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    /// Marks the initial Node list read; returns whether it was not before.
    fn mark_synced(&self) -> bool {
        let first = !self.synced.swap(true, Ordering::Relaxed);
        if first {
            self.synced_notify.notify_waiters();
        }
        first
    }

    /// Returns once the initial Node list has been read. Until then the fleet is partial: a
    /// managed node missing from it would be refused as not managed.
    pub async fn wait_synced(&self) {
        loop {
            let notified = self.synced_notify.notified();
            tokio::pin!(notified);
            // Registered before the check, so a `mark_synced` between the two is not missed.
            notified.as_mut().enable();
            if self.synced() {
                return;
            }
            notified.await;
        }
    }

    /// Sets the label selector the Node watch selects with (`--node-selector`); a selector that
    /// does not parse (refused at start, by the runtime's flag checks) leaves none, so no
    /// node is ever taken for one that left.
    pub fn set_selection(&self, selector: &str) {
        let parsed = match nodekeeper_api::selector::parse(selector) {
            Ok(parsed) => Some(parsed).filter(|p| *p != LabelSelector::default()),
            Err(error) => {
                warn!(%error, selector, "--node-selector does not parse; nodes that leave it keep their conditions");
                None
            }
        };
        *self
            .selection
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = parsed;
    }

    /// The label selector the Node watch selects with; `None`: every Node.
    pub fn selection(&self) -> Option<LabelSelector> {
        self.selection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Notes nodes that may have left the selection, when there is one: the Node watch no
    /// longer reports them, and only a read tells a node that left from one deleted.
    pub fn note_maybe_left(&self, names: impl IntoIterator<Item = String>) {
        if self
            .selection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
        {
            return;
        }
        let mut left = self
            .maybe_left
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let before = left.len();
        left.extend(names);
        if left.len() > before {
            self.maybe_left_notify.notify_one();
        }
    }

    /// Takes the nodes noted by [`Fleet::note_maybe_left`] since the last call.
    pub fn take_maybe_left(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .maybe_left
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
        .into_iter()
        .collect()
    }

    /// Returns once a node may have left the selection (at once if one is noted and not taken).
    /// One waiter at a time.
    pub async fn wait_maybe_left(&self) {
        loop {
            if !self
                .maybe_left
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
            {
                return;
            }
            // `notify_one` keeps a permit when nobody waits: a name noted between the check
            // and this wait is not missed.
            self.maybe_left_notify.notified().await;
        }
    }

    /// Records when the previous leader last renewed the Lease; call before the Node watch.
    pub fn set_previous_leader_renewed(&self, at: Instant) {
        *self
            .previous_leader_renewed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(at);
    }

    /// A new entry's schedule, carrying over what a previous leader left on the Node: a
    /// `NodekeeperReachable` it wrote means it was reading the node until it last renewed the
    /// Lease (True) or had found it stale (False).
    fn schedule_for(&self, written: &[Written], now: Instant) -> NodeSchedule {
        let mut schedule = NodeSchedule::new(now);
        let reachable = written
            .iter()
            .find(|w| w.condition.type_ == crate::conditions::REACHABLE);
        match reachable.map(|w| w.condition.status) {
            Some(Status::True) => {
                schedule.inherited_since = *self
                    .previous_leader_renewed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
            }
            Some(Status::False) => schedule.inherited_stale = true,
            _ => {}
        }
        schedule
    }

    /// Records a Node as seen by the watch. Returns false when it has no usable InternalIP.
    pub fn observe(&self, facts: NodeFacts, now: Instant) -> bool {
        self.record(facts, now, true)
    }

    /// Records a Node as a write's response returned it: an entry is updated, never created.
    /// The Node watch may have removed the node (deleted) between the write and its response;
    /// the response must not bring it back into the fleet.
    pub fn observe_written(&self, facts: NodeFacts, now: Instant) {
        self.record(facts, now, false);
    }

    fn record(&self, facts: NodeFacts, now: Instant, insert: bool) -> bool {
        let has_address = facts.address.is_some();
        let mut nodes = self.lock();
        match nodes.get_mut(&facts.name) {
            Some(entry) => {
                // An event older than what a patch response already told us must not undo it.
                if facts.resource_version == 0 || facts.resource_version >= entry.resource_version {
                    entry.address = facts.address;
                    entry.resource_version = facts.resource_version;
                    if entry.foreign.as_deref().unwrap_or_default() != facts.foreign.as_slice() {
                        entry.foreign = self.foreign_set(facts.foreign);
                    }
                    if *entry.written != *facts.written {
                        let mut interned = self.interned();
                        let old =
                            std::mem::replace(&mut entry.written, interned.get(facts.written));
                        interned.release(old);
                    }
                }
            }
            None if !insert => {}
            None => {
                let schedule = self.schedule_for(&facts.written, now);
                let written = self.interned().get(facts.written);
                let foreign = self.foreign_set(facts.foreign);
                nodes.insert(
                    facts.name,
                    NodeEntry {
                        address: facts.address,
                        resource_version: facts.resource_version,
                        written,
                        foreign,
                        schedule,
                        report: None,
                        last_failure: None,
                        rules_refusal: None,
                        stale: false,
                    },
                );
            }
        }
        has_address
    }

    pub fn remove(&self, name: &str) {
        let mut nodes = self.lock();
        if let Some(entry) = nodes.remove(name) {
            self.interned().release(entry.written);
        }
    }

    /// Drops entries for Nodes that a fresh list no longer contains.
    pub fn retain(&self, names: &HashSet<String>) {
        let mut nodes = self.lock();
        let mut gone = Vec::new();
        nodes.retain(|name, entry| {
            let keep = names.contains(name);
            if !keep {
                gone.push(Arc::clone(&entry.written));
            }
            keep
        });
        drop(nodes);
        // Each `gone` copy is one more than `release` expects while its entry lived; the entry
        // is dropped now, so the count is the same.
        let mut interned = self.interned();
        for set in gone {
            interned.release(set);
        }
    }

    /// Takes up to `max` due nodes (earliest first), marking them in flight.
    ///
    /// The nodes due are found by a scan of the fleet, kept in a queue that later calls take
    /// from: after a controller start every node is due and this runs after every sixteenth
    /// completed call, so a scan per call made a 65,000-node sweep scan the fleet 4,000 times
    /// (6–7 ms each, under the fleet's lock). The queue is scanned again once it is used up or
    /// [`RESCAN`] old, so a node that falls due while it is full waits at most that long for
    /// its place in the order; each name taken from it is checked against its entry. A used-up
    /// queue is scanned again at most once a call and once every [`RESCAN_USED_UP`].
    pub fn take_due(&self, now: Instant, max: usize, port: u16) -> Vec<Job> {
        if max == 0 {
            return Vec::new();
        }
        let mut queue = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        let mut nodes = self.lock();
        let old = queue
            .scanned
            .is_none_or(|at| now.saturating_duration_since(at) >= RESCAN);
        let mut scanned = false;
        if old {
            queue.scan(&nodes, now);
            scanned = true;
        }
        let mut jobs = Vec::new();
        while jobs.len() < max {
            let Some((_, name)) = queue.names.pop() else {
                let recent = queue
                    .scanned
                    .is_some_and(|at| now.saturating_duration_since(at) < RESCAN_USED_UP);
                if scanned || recent {
                    break;
                }
                queue.scan(&nodes, now);
                scanned = true;
                continue;
            };
            let Some(entry) = nodes.get_mut(&name) else {
                continue;
            };
            let Some(address) = entry.address.filter(|_| entry.schedule.is_due(now)) else {
                continue;
            };
            entry.schedule.start(now);
            jobs.push(Job {
                endpoint: SocketAddr::new(address, port),
                cached_revision: entry.report.as_ref().map(|r| r.revision),
                agent_rules_revision: entry.report.as_ref().map(|r| r.rules_revision),
                rules_refused: entry.refused_revision(),
                name,
            });
        }
        if queue.names.is_empty() && queue.names.capacity() > DueQueue::KEPT_CAPACITY {
            // A whole fleet's worth after a start: not worth holding at rest.
            queue.names = Vec::new();
        }
        jobs
    }

    /// The sweep's test for its first full pass (see [`ReadProgress`]), made on its ticks, so a
    /// plain count (no allocation, no decoding) under the lock.
    pub fn read_progress(&self) -> ReadProgress {
        let nodes = self.lock();
        nodes.values().fold(ReadProgress::default(), |p, e| {
            let called = e.address.is_some()
                && (e.schedule.last_success.is_some() || e.schedule.failures > 0);
            ReadProgress {
                read: p.read + usize::from(e.report.is_some()),
                called: p.called + usize::from(called),
                reachable: p.reachable + usize::from(e.address.is_some()),
            }
        })
    }

    pub fn summary(&self) -> FleetSummary {
        let nodes = self.lock();
        let mut s = FleetSummary {
            nodes: nodes.len(),
            ..FleetSummary::default()
        };
        // Counted by borrowed keys under the lock: no allocation per node.
        let mut conditions: std::collections::BTreeMap<(&str, &str), usize> = Default::default();
        let mut tunables: std::collections::BTreeMap<&str, usize> = Default::default();
        for (name, entry) in nodes.iter() {
            if entry.address.is_none() {
                s.without_internal_ip += 1;
            }
            if entry.report.is_some() {
                s.read += 1;
            }
            if entry.stale {
                s.stale += 1;
            }
            if entry.last_failure.is_some() {
                s.unreachable += 1;
                s.unreachable_nodes.push(name.clone());
            }
            if entry.rules_refusal.is_some() {
                s.refusing_rules += 1;
                s.refusing_rules_nodes.push(name.clone());
            }
            for w in entry.written.iter() {
                *conditions
                    .entry((w.condition.type_.as_str(), w.condition.status.as_str()))
                    .or_default() += 1;
            }
            if let Some(report) = &entry.report {
                for rule in report.flagged_tunables() {
                    *tunables.entry(rule.as_str()).or_default() += 1;
                }
            }
        }
        s.conditions = conditions
            .into_iter()
            .map(|((type_, status), n)| (format!("{type_}={status}"), n))
            .collect();
        s.tunables_out_of_bounds = tunables
            .into_iter()
            .map(|(rule, n)| (rule.to_owned(), n))
            .collect();
        for list in [&mut s.unreachable_nodes, &mut s.refusing_rules_nodes] {
            list.sort_unstable();
            list.truncate(MAX_LISTED);
        }
        s
    }
}

/// The most node names a summary lists; the counts cover the rest.
pub const MAX_LISTED: usize = 50;

/// Fleet-wide counts served by `/api/v1/summary`.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetSummary {
    pub nodes: usize,
    pub read: usize,
    pub stale: usize,
    /// Nodes whose agent's latest call failed, counted at once (before `staleAfter` turns
    /// their condition False).
    pub unreachable: usize,
    /// Up to [`MAX_LISTED`] of them by name, sorted (a map's first few would change from call
    /// to call).
    pub unreachable_nodes: Vec<String>,
    /// Nodes whose agent refuses the rules the controller accepted (see [`RulesRefusal`]); each
    /// node's page says why.
    pub refusing_rules: usize,
    /// Up to [`MAX_LISTED`] of them by name, sorted.
    pub refusing_rules_nodes: Vec<String>,
    pub without_internal_ip: usize,
    /// `Type=Status` → nodes, for nodekeeper's conditions as found on the Nodes.
    pub conditions: std::collections::BTreeMap<String, usize>,
    /// Rule name → nodes where it is out of bounds.
    pub tunables_out_of_bounds: std::collections::BTreeMap<String, usize>,
}

/// The label selector the Node watch sends: `--node-selector` as parsed, written back
/// ([`LabelSelector::to_query`]), so that the API server selects with the very selector the
/// cleaner matches locally (`Fleet::selection`); one that does not parse (refused at start) goes
/// as given.
fn watch_query(selector: &str) -> String {
    nodekeeper_api::selector::parse(selector).map_or_else(|_| selector.to_owned(), |p| p.to_query())
}

/// Watches Nodes (optionally only those matching `selector`) into `fleet` until cancelled.
pub async fn watch_nodes(
    api: Api<Node>,
    selector: Option<String>,
    fleet: Arc<Fleet>,
    metrics: SweepMetrics,
    cancel: CancellationToken,
) {
    let mut config = super::lists::nodes();
    if let Some(selector) = selector {
        fleet.set_selection(&selector);
        config = config.labels(&watch_query(&selector));
    }
    let stream = watcher(api, config).default_backoff();
    futures::pin_mut!(stream);
    let started = Instant::now();
    let mut listing: HashSet<String> = HashSet::new();
    // Names already reported as lacking an InternalIP, so the log names each once.
    let mut warned: HashSet<String> = HashSet::new();
    let observe = |node: &Node, warned: &mut HashSet<String>| {
        let facts = node_facts(node);
        let name = facts.name.clone();
        if !fleet.observe(facts, Instant::now()) {
            metrics
                .nodes_skipped
                .get_or_create(&ReasonLabels {
                    reason: SkipReason::NoInternalIp,
                })
                .inc();
            if warned.insert(name.clone()) {
                warn!(node = %name, "node has no InternalIP address; its agent cannot be reached and it is skipped");
            }
        } else {
            warned.remove(&name);
        }
        name
    };
    loop {
        let event = tokio::select! {
            () = cancel.cancelled() => return,
            event = stream.try_next() => event,
        };
        match event {
            Ok(Some(watcher::Event::Init)) => listing.clear(),
            Ok(Some(watcher::Event::InitApply(node))) => {
                listing.insert(observe(&node, &mut warned));
            }
            Ok(Some(watcher::Event::InitDone)) => {
                if fleet.selection().is_some() {
                    // Nodes gone from a relist (the watch fell behind) were deleted or left the
                    // selection meanwhile; rare, and each costs the cleaner one read.
                    let dropped: Vec<String> = fleet
                        .lock()
                        .keys()
                        .filter(|name| !listing.contains(*name))
                        .cloned()
                        .collect();
                    fleet.note_maybe_left(dropped);
                }
                fleet.retain(&listing);
                listing.clear();
                if fleet.mark_synced() {
                    info!(
                        nodes = fleet.lock().len(),
                        seconds = started.elapsed().as_secs_f64(),
                        "initial node list read"
                    );
                }
            }
            Ok(Some(watcher::Event::Apply(node))) => {
                observe(&node, &mut warned);
            }
            Ok(Some(watcher::Event::Delete(node))) => {
                if let Some(name) = node.metadata.name.as_deref() {
                    fleet.remove(name);
                    // A label-selector watch reports a Node whose labels stopped matching as
                    // deleted, and with its previous labels (the API server's watch cache sends
                    // the previous object, `cacheWatcher.convertToWatchEvent`): the event cannot
                    // tell it from a deletion, so the cleaner reads the Node
                    // (`controllers::nodes::unselected`). Without a selector, a no-op.
                    fleet.note_maybe_left([name.to_owned()]);
                }
            }
            Ok(None) => return,
            Err(error) => warn!(%error, "node watch failed; retrying with backoff"),
        }
        metrics
            .nodes_known
            .set(i64::try_from(fleet.lock().len()).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::Duration;

    fn node(rv: &str, ip: Option<&str>, conditions: serde_json::Value) -> Node {
        let addresses = ip.map(|ip| json!([{"type": "Hostname", "address": "h"}, {"type": "InternalIP", "address": ip}]));
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "resourceVersion": rv, "managedFields": [{"manager": "kubelet"}]},
            "status": {"addresses": addresses, "conditions": conditions},
        }))
        .unwrap()
    }

    #[test]
    fn keeps_only_the_internal_ip_and_our_conditions() {
        let n = node(
            "17",
            Some("127.1.0.4"),
            json!([
                {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                {"type": "NodekeeperReachable", "status": "False", "reason": "AgentUnreachable", "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ]),
        );
        let facts = node_facts(&n);
        assert_eq!(facts.address, Some("127.1.0.4".parse().unwrap()));
        assert_eq!(facts.resource_version, 17);
        assert_eq!(facts.written.len(), 1);
        assert_eq!(facts.written[0].condition.status, Status::False);
        assert_eq!(
            facts.written[0].last_transition_time.as_deref(),
            Some("2026-01-01T00:00:00Z")
        );
    }

    #[test]
    fn nodes_without_internal_ip_are_kept_but_never_due() {
        let fleet = Fleet::default();
        let now = Instant::now();
        assert!(!fleet.observe(node_facts(&node("1", None, json!([]))), now));
        assert!(fleet.take_due(now, 10, 9443).is_empty());
        assert!(fleet.observe(node_facts(&node("2", Some("127.1.0.4"), json!([]))), now));
        // Found by the next scan of the fleet (at most RESCAN_USED_UP after the last).
        let next_scan = now + RESCAN_USED_UP;
        let jobs = fleet.take_due(next_scan, 10, 9443);
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].endpoint, "127.1.0.4:9443".parse().unwrap());
        // In flight now: not handed out twice.
        assert!(fleet.take_due(next_scan + RESCAN, 10, 9443).is_empty());
    }

    #[test]
    fn types_another_writer_keeps_alive_are_left_to_it() {
        let now: i64 = 1_800_000_000;
        let at = |secs_ago: i64| {
            k8s_openapi::jiff::Timestamp::from_second(now - secs_ago)
                .unwrap()
                .to_string()
        };
        let n: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1"},
            "status": {"conditions": [
                {"type": "KernelDeadlock", "status": "True", "lastHeartbeatTime": at(60)},
                {"type": "ReadonlyFilesystem", "status": "False", "lastHeartbeatTime": at(14 * 60)},
                // NPD gone: its last heartbeat more than 15 minutes ago.
                {"type": "FrequentKubeletRestart", "status": "False", "lastHeartbeatTime": at(16 * 60)},
                // No heartbeat at all: nothing says another writer keeps it alive.
                {"type": "CustomThing", "status": "False"},
                // Ours (our field manager owns it), and the kubelet's.
                {"type": "XfsShutdown", "status": "False", "lastHeartbeatTime": at(1)},
                {"type": "Ready", "status": "True", "lastHeartbeatTime": at(1)},
                {"type": "NodekeeperReachable", "status": "True", "lastHeartbeatTime": at(1)},
            ]},
        }))
        .unwrap();
        let ours: BTreeSet<String> = ["XfsShutdown".to_string()].into();
        assert_eq!(
            left_to_others(&n, &ours, now),
            ["KernelDeadlock", "ReadonlyFilesystem"]
        );

        // The fleet keeps one shared copy per distinct list, and none for most nodes.
        let fleet = Fleet::default();
        let mut facts = node_facts(&node("1", Some("127.1.0.4"), json!([])));
        assert!(facts.foreign.is_empty());
        facts.foreign = vec!["KernelDeadlock".into()];
        fleet.observe(facts.clone(), Instant::now());
        facts.name = "n2".into();
        fleet.observe(facts, Instant::now());
        let nodes = fleet.lock();
        let (a, b) = (
            nodes["n1"].foreign.clone().unwrap(),
            nodes["n2"].foreign.clone().unwrap(),
        );
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, ["KernelDeadlock".to_string()]);
    }

    #[test]
    fn a_write_response_does_not_bring_back_a_node_the_watch_removed() {
        let fleet = Fleet::default();
        let now = Instant::now();
        fleet.observe(node_facts(&node("1", Some("127.1.0.4"), json!([]))), now);
        // The watch's Delete lands between the condition patch and its response.
        fleet.remove("n1");
        fleet.observe_written(node_facts(&node("2", Some("127.1.0.4"), json!([]))), now);
        assert!(fleet.lock().get("n1").is_none());
        // A node still in the fleet takes the response's resourceVersion.
        fleet.observe(node_facts(&node("3", Some("127.1.0.4"), json!([]))), now);
        fleet.observe_written(node_facts(&node("4", Some("127.1.0.4"), json!([]))), now);
        assert_eq!(fleet.lock()["n1"].resource_version, 4);
    }

    #[tokio::test]
    async fn nodes_that_may_have_left_are_noted_only_under_a_selector() {
        let fleet = Fleet::default();
        // Every Node selected (no flag, or an empty one): none can leave, nothing is noted.
        fleet.note_maybe_left(["n1".to_owned()]);
        fleet.set_selection("");
        fleet.note_maybe_left(["n1".to_owned()]);
        assert!(fleet.selection().is_none());
        assert!(fleet.take_maybe_left().is_empty());
        fleet.set_selection("pool=gpu");
        assert!(fleet.selection().is_some());
        fleet.note_maybe_left(["n2".to_owned(), "n1".to_owned()]);
        fleet.note_maybe_left(["n1".to_owned()]);
        // Noted before the wait: it returns at once.
        tokio::time::timeout(std::time::Duration::from_secs(5), fleet.wait_maybe_left())
            .await
            .expect("woken");
        assert_eq!(fleet.take_maybe_left(), ["n1", "n2"]);
        assert!(fleet.take_maybe_left().is_empty());
    }

    #[tokio::test]
    async fn waiting_for_the_initial_list_ends_when_it_is_read() {
        let fleet = Arc::new(Fleet::default());
        let waiter = tokio::spawn({
            let fleet = Arc::clone(&fleet);
            async move { fleet.wait_synced().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        assert!(fleet.mark_synced());
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap();
        // Once read, it returns at once; a second mark is not a first.
        fleet.wait_synced().await;
        assert!(!fleet.mark_synced());
    }

    /// Adds node `name` with an address, observed at `seen` and due at `due`.
    fn add_due(fleet: &Fleet, name: &str, seen: Instant, due: Instant) {
        let mut facts = node_facts(&node("1", Some("127.1.0.4"), json!([])));
        facts.name = name.into();
        fleet.observe(facts, seen);
        fleet.lock().get_mut(name).unwrap().schedule.next_due = due;
    }

    #[test]
    fn the_earliest_due_nodes_are_taken_first() {
        let fleet = Fleet::default();
        let t0 = Instant::now();
        for i in 0..50u64 {
            // Node i is due i seconds after t0.
            add_due(
                &fleet,
                &format!("n{i}"),
                t0,
                t0 + std::time::Duration::from_secs(i),
            );
        }
        let now = t0 + std::time::Duration::from_secs(100);
        let mut names: Vec<String> = fleet
            .take_due(now, 5, 9443)
            .into_iter()
            .map(|j| j.name)
            .collect();
        names.sort();
        assert_eq!(names, ["n0", "n1", "n2", "n3", "n4"]);
        assert_eq!(fleet.take_due(now, 100, 9443).len(), 45);
    }

    /// The queue of due nodes: taken from until used up, each name checked against its entry
    /// (gone, in flight or rescheduled since the scan: skipped), and scanned again when used up
    /// ([`RESCAN_USED_UP`] after the last scan) or [`RESCAN`] old.
    #[test]
    fn due_nodes_are_queued_and_checked_when_taken() {
        let fleet = Fleet::default();
        let t0 = Instant::now();
        let add = |name: &str, due: Instant| add_due(&fleet, name, t0, due);
        for i in 0..10u64 {
            add(&format!("n{i}"), t0 + std::time::Duration::from_millis(i));
        }
        let now = t0 + std::time::Duration::from_secs(1);
        let names = |jobs: Vec<Job>| jobs.into_iter().map(|j| j.name).collect::<Vec<_>>();
        assert_eq!(names(fleet.take_due(now, 2, 9443)), ["n0", "n1"]);
        // Since the scan: n2 deleted, n3 rescheduled, and a new node due before all others.
        fleet.remove("n2");
        fleet.lock().get_mut("n3").unwrap().schedule.next_due = now + RESCAN;
        add("early", t0);
        // Within RESCAN the queue is used first, past the gone and rescheduled ones ...
        assert_eq!(names(fleet.take_due(now, 2, 9443)), ["n4", "n5"]);
        // ... and once used up, it is not scanned again so soon after the last scan ...
        assert_eq!(
            names(fleet.take_due(now, 10, 9443)),
            ["n6", "n7", "n8", "n9"]
        );
        assert!(fleet.take_due(now, 10, 9443).is_empty());
        // ... but RESCAN_USED_UP later, and then the newcomer is found.
        let soon = now + RESCAN_USED_UP;
        assert_eq!(names(fleet.take_due(soon, 10, 9443)), ["early"]);
        assert!(fleet.take_due(soon, 10, 9443).is_empty());
        // A queue RESCAN old is scanned again before it is used: the earliest comes first.
        for name in ["n0", "n1", "n4"] {
            let mut nodes = fleet.lock();
            let schedule = &mut nodes.get_mut(name).unwrap().schedule;
            schedule.in_flight = false;
            schedule.next_due = now + RESCAN;
        }
        fleet.lock().get_mut("n3").unwrap().schedule.next_due = now + RESCAN;
        fleet.lock().get_mut("n1").unwrap().schedule.next_due = now;
        let later = now + RESCAN;
        assert_eq!(names(fleet.take_due(later, 1, 9443)), ["n1"]);
        let mut rest = names(fleet.take_due(later, 10, 9443));
        rest.sort();
        assert_eq!(rest, ["n0", "n3", "n4"]);
    }

    /// At rest nodes fall due one at a time; a call soon after a scan finds the queue used up
    /// and does not scan the fleet again for them: they wait at most RESCAN_USED_UP.
    #[test]
    fn a_used_up_queue_is_scanned_again_at_most_once_a_rescan_gap() {
        let fleet = Fleet::default();
        let t0 = Instant::now();
        for i in 0..3u64 {
            let due = t0 + std::time::Duration::from_millis(100 * i);
            add_due(&fleet, &format!("n{i}"), t0, due);
        }
        let names = |jobs: Vec<Job>| jobs.into_iter().map(|j| j.name).collect::<Vec<_>>();
        assert_eq!(names(fleet.take_due(t0, 10, 9443)), ["n0"]);
        // n1 and n2 fall due within RESCAN_USED_UP of that scan: not looked for yet.
        let mut at = t0 + std::time::Duration::from_millis(250);
        while at < t0 + RESCAN_USED_UP {
            assert!(
                fleet.take_due(at, 10, 9443).is_empty(),
                "scanned again at {at:?}"
            );
            at += std::time::Duration::from_millis(250);
        }
        let mut found = names(fleet.take_due(t0 + RESCAN_USED_UP, 10, 9443));
        found.sort();
        assert_eq!(found, ["n1", "n2"]);
    }

    /// A start's queue (every node) is not held once used up.
    #[test]
    fn a_used_up_queue_gives_its_memory_back() {
        let fleet = Fleet::default();
        let now = Instant::now();
        for i in 0..3000 {
            let mut facts = node_facts(&node("1", Some("127.1.0.4"), json!([])));
            facts.name = format!("n{i}");
            fleet.observe(facts, now);
        }
        assert_eq!(fleet.take_due(now, 2000, 9443).len(), 2000);
        assert!(fleet.due.lock().unwrap().names.capacity() >= 1000);
        assert_eq!(fleet.take_due(now, 2000, 9443).len(), 1000);
        assert_eq!(fleet.due.lock().unwrap().names.capacity(), 0);
    }

    /// Regression: the first sweep counted nodes holding a report, so one node whose agent
    /// never answered kept it unfinished (`initialSweepSeconds` 0, no "first full sweep done")
    /// for as long as the controller led.
    #[test]
    fn a_dead_agent_does_not_hold_up_the_first_sweep() {
        use crate::view::{NodeView, StoredReport};
        let fleet = Fleet::default();
        let now = Instant::now();
        let interval = Duration::from_secs(60);
        for (name, address) in [
            ("n1", "127.1.0.4"),
            ("n2", "127.1.0.5"),
            ("n3", "127.1.0.6"),
        ] {
            let mut facts = node_facts(&node("1", Some(address), json!([])));
            facts.name = name.into();
            fleet.observe(facts, now);
        }
        let jobs = fleet.take_due(now, 10, 9443);
        assert_eq!(jobs.len(), 3);
        {
            let mut nodes = fleet.lock();
            for name in ["n1", "n2"] {
                let entry = nodes.get_mut(name).unwrap();
                entry.schedule.succeeded(now, interval, 0.5);
                entry.report = Some(StoredReport::of(&NodeView::default()));
            }
        }
        // n3 is still in flight: the first sweep is not done.
        assert!(!fleet.read_progress().first_sweep_done());
        fleet
            .lock()
            .get_mut("n3")
            .unwrap()
            .schedule
            .failed(now, interval, 0.5);
        let progress = fleet.read_progress();
        assert_eq!(
            progress,
            ReadProgress {
                read: 2,
                called: 3,
                reachable: 3
            }
        );
        assert!(progress.first_sweep_done());
        assert!(!ReadProgress::default().first_sweep_done(), "no nodes yet");
    }

    /// The sweep's progress count and the summary's tunables agree with the reports stored,
    /// without decoding them.
    #[test]
    fn read_progress_and_flagged_tunables_follow_the_stored_reports() {
        use crate::view::{NodeView, StoredReport, TunableView, Verdict};
        let fleet = Fleet::default();
        let now = Instant::now();
        for (name, address) in [
            ("n1", Some("127.1.0.4")),
            ("n2", Some("127.1.0.5")),
            ("n3", None),
        ] {
            let mut facts = node_facts(&node("1", address, json!([])));
            facts.name = name.into();
            fleet.observe(facts, now);
        }
        let progress = |read, called| ReadProgress {
            read,
            called,
            reachable: 2,
        };
        assert_eq!(fleet.read_progress(), progress(0, 0));
        let tunable = |rule: &str, verdict| TunableView {
            rule: rule.into(),
            key: "net.core.somaxconn".into(),
            current: "128".into(),
            verdict,
            expected: ">= 4096".into(),
            previous: String::new(),
            repaired_at_unix_ms: 0,
            conflict: false,
            error: String::new(),
        };
        let view = NodeView {
            tunables: vec![
                tunable("somaxconn", Verdict::Warning),
                tunable("rmem", Verdict::Ok),
                tunable("wmem", Verdict::Critical),
            ],
            ..NodeView::default()
        };
        let answered = |name: &str, view: &NodeView| {
            let mut nodes = fleet.lock();
            let entry = nodes.get_mut(name).unwrap();
            entry.schedule.start(now);
            entry.schedule.succeeded(now, Duration::from_secs(60), 0.5);
            entry.report = Some(StoredReport::of(view));
        };
        answered("n1", &view);
        assert_eq!(fleet.read_progress(), progress(1, 1));
        answered("n2", &NodeView::default());
        assert_eq!(fleet.read_progress(), progress(2, 2));
        let s = fleet.summary();
        assert_eq!(s.read, 2);
        assert_eq!(
            s.tunables_out_of_bounds.into_iter().collect::<Vec<_>>(),
            [("somaxconn".to_owned(), 1), ("wmem".to_owned(), 1)]
        );
    }

    #[test]
    fn an_unreachable_agent_shows_in_the_summary_at_once() {
        let fleet = Fleet::default();
        let now = Instant::now();
        for name in ["n2", "n1", "n3"] {
            let mut facts = node_facts(&node("1", Some("127.1.0.4"), json!([])));
            facts.name = name.into();
            fleet.observe(facts, now);
        }
        let s = fleet.summary();
        assert_eq!((s.unreachable, s.stale), (0, 0));
        // One failed call, long before staleAfter: counted and named, not stale.
        for name in ["n3", "n1"] {
            fleet.lock().get_mut(name).unwrap().last_failure =
                Some((CallOutcome::Connect, "connect: refused".into()));
        }
        let s = fleet.summary();
        assert_eq!((s.unreachable, s.stale), (2, 0));
        assert_eq!(s.unreachable_nodes, ["n1", "n3"]);
    }

    #[test]
    fn an_agent_refusing_rules_is_counted_until_it_takes_a_revision() {
        let fleet = Fleet::default();
        let now = Instant::now();
        for name in ["n1", "n2"] {
            let mut facts = node_facts(&node("1", Some("127.1.0.4"), json!([])));
            facts.name = name.into();
            fleet.observe(facts, now);
        }
        let refused = RulesNews::Refused(RulesRefusal {
            revision: 7,
            error: format!("rule \"x\" field `key`: {}", "é".repeat(400)),
        });
        {
            let mut nodes = fleet.lock();
            let n2 = nodes.get_mut("n2").unwrap();
            assert_eq!(n2.note_rules(refused.clone()), 1);
            assert_eq!(n2.note_rules(refused), 0, "still refusing: no second count");
            assert_eq!(n2.note_rules(RulesNews::Nothing), 0);
            assert!(n2.rules_refusal.as_ref().unwrap().error.len() <= 512 + 3);
            assert_eq!(n2.refused_revision(), 7);
        }
        let s = fleet.summary();
        assert_eq!(
            (s.refusing_rules, s.refusing_rules_nodes.clone()),
            (1, vec!["n2".to_owned()])
        );
        // The refused revision is not pushed again.
        let jobs = fleet.take_due(now, 10, 9443);
        let n2 = jobs.iter().find(|j| j.name == "n2").unwrap();
        assert_eq!(n2.rules_refused, 7);
        assert_eq!(
            fleet
                .lock()
                .get_mut("n2")
                .unwrap()
                .note_rules(RulesNews::Accepted),
            -1
        );
        assert_eq!(fleet.summary().refusing_rules, 0);
    }

    #[test]
    fn a_new_leader_inherits_the_previous_leaders_staleness_clock() {
        let fleet = Fleet::default();
        let renewed = Instant::now();
        let now = renewed + std::time::Duration::from_secs(60);
        fleet.set_previous_leader_renewed(renewed);
        let with = |name: &str, status: &str| {
            let mut facts = node_facts(&node(
                "1",
                Some("127.1.0.4"),
                json!([{"type": "NodekeeperReachable", "status": status, "reason": "r", "message": "m"}]),
            ));
            facts.name = name.into();
            facts
        };
        fleet.observe(with("was-read", "True"), now);
        fleet.observe(with("was-stale", "False"), now);
        let mut never = node_facts(&node("1", Some("127.1.0.4"), json!([])));
        never.name = "never-read".into();
        fleet.observe(never, now);
        let nodes = fleet.lock();
        assert_eq!(nodes["was-read"].schedule.inherited_since, Some(renewed));
        assert!(!nodes["was-read"].schedule.inherited_stale);
        assert!(nodes["was-stale"].schedule.inherited_stale);
        // A node no leader ever read starts its clock at this replica's first attempt.
        assert_eq!(nodes["never-read"].schedule.inherited_since, None);
        assert!(!nodes["never-read"].schedule.inherited_stale);
    }

    #[test]
    fn nodes_with_the_same_conditions_share_one_list() {
        let fleet = Fleet::default();
        let now = Instant::now();
        let conditions = |status: &str| {
            json!([
                {"type": "NodekeeperReachable", "status": status, "reason": "AgentReachable", "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "TunablesInBounds", "status": "True", "reason": "InBounds", "message": "all 3 rules in bounds", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ])
        };
        let facts = |name: &str, rv: &str, status: &str| {
            let mut facts = node_facts(&node(rv, Some("127.1.0.4"), conditions(status)));
            facts.name = name.into();
            facts
        };
        for i in 0..100 {
            fleet.observe(facts(&format!("n{i}"), "1", "True"), now);
        }
        assert_eq!(fleet.distinct_written(), 1);
        {
            let nodes = fleet.lock();
            assert!(Arc::ptr_eq(&nodes["n0"].written, &nodes["n99"].written));
            assert_eq!(nodes["n0"].written.len(), 2);
        }
        // One node's conditions change: it gets a list of its own, the others keep theirs.
        fleet.observe(facts("n7", "2", "False"), now);
        assert_eq!(fleet.distinct_written(), 2);
        assert_eq!(
            fleet.lock()["n7"].written[0].condition.status,
            Status::False
        );
        assert_eq!(fleet.lock()["n8"].written[0].condition.status, Status::True);
        // ... and back: the list it had alone is dropped.
        fleet.observe(facts("n7", "3", "True"), now);
        assert_eq!(fleet.distinct_written(), 1);
        fleet.observe(facts("n7", "4", "False"), now);
        fleet.remove("n7");
        assert_eq!(fleet.distinct_written(), 1);
        fleet.observe(facts("n7", "5", "False"), now);
        fleet.retain(
            &(0..100)
                .filter(|&i| i != 7)
                .map(|i| format!("n{i}"))
                .collect(),
        );
        assert_eq!(fleet.distinct_written(), 1);
        fleet.retain(&HashSet::new());
        assert_eq!(fleet.distinct_written(), 0);
    }

    #[test]
    fn lists_a_writer_still_held_are_dropped_later() {
        let fleet = Fleet::default();
        let now = Instant::now();
        let mut first = node_facts(&node("1", Some("127.1.0.4"), json!([])));
        first.name = "n1".into();
        fleet.observe(first, now);
        for i in 0..200u32 {
            let mut facts = node_facts(&node("1", Some("127.1.0.4"), json!([])));
            facts.name = "n1".into();
            facts.resource_version = u64::from(i) + 2;
            facts.written = vec![Written {
                condition: Condition {
                    type_: "NodekeeperReachable".into(),
                    status: Status::True,
                    reason: format!("r{i}"),
                    message: String::new(),
                },
                last_transition_time: None,
            }];
            // A condition writer holds the list the node had while it is replaced.
            let held = Arc::clone(&fleet.lock()["n1"].written);
            fleet.observe(facts, now);
            drop(held);
            assert!(fleet.distinct_written() <= 2 * Interned::MIN_SWEEP, "{i}");
        }
    }

    #[test]
    fn older_events_do_not_undo_newer_state() {
        let fleet = Fleet::default();
        let now = Instant::now();
        let reachable = json!([{"type": "NodekeeperReachable", "status": "True", "reason": "AgentReachable", "message": "m"}]);
        fleet.observe(node_facts(&node("10", Some("127.1.0.4"), reachable)), now);
        fleet.observe(node_facts(&node("9", Some("127.1.0.4"), json!([]))), now);
        assert_eq!(fleet.lock()["n1"].written.len(), 1);
        fleet.observe(node_facts(&node("11", Some("127.1.0.4"), json!([]))), now);
        assert!(fleet.lock()["n1"].written.is_empty());
    }

    #[test]
    fn the_watch_selects_with_the_selector_the_cleaner_matches() {
        for (given, sent) in [
            ("pool notin (gpu,)", "pool notin (gpu,)"),
            ("pool in(a),\t!spot", "pool in (a),!spot"),
            ("zone in (), a==b", "a=b,zone in ()"),
        ] {
            assert_eq!(watch_query(given), sent, "{given:?}");
            let fleet = Fleet::default();
            fleet.set_selection(given);
            assert_eq!(
                fleet.selection().map(|s| s.to_query()).as_deref(),
                Some(sent),
                "{given:?}"
            );
        }
        // Refused at start; sent as given rather than dropped.
        assert_eq!(watch_query("zone in (a"), "zone in (a");
    }
}
