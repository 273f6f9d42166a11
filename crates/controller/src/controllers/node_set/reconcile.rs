//! One NodeSet reconcile: check the spec and the class, read the set's nodes and drains from
//! the caches, plan, then act — create machines (slow start, stopping at the first failure,
//! backing off), start drains (one NodeMaintenance per node), delete drained machines, replace
//! machines that never joined — and write the status if it changed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource as _, ResourceExt as _};
use nodekeeper_api::crd::common::{FieldError, format_field_errors};
use nodekeeper_api::crd::node_class::{self, NodeClassSpec};
use nodekeeper_api::crd::node_maintenance::NodePhase;
use nodekeeper_api::crd::node_set::{
    ANNOTATION_DRAINED_NODE, ANNOTATION_TEMPLATE_HASH, MachineProblem, NodeSetStatus, NodeTemplate,
    REASON_ABOVE_CAP, REASON_NODE_CLASS_NOT_FOUND, REASON_PROVIDER_FAILED, ScaleDown,
};
use nodekeeper_api::crd::{NodeMaintenance, NodeSet};
use nodekeeper_api::names::{
    API_VERSION, LABEL_NODE_CLASS, LABEL_NODE_SET, MANAGER_NODE_SET, REASON_INVALID_SPEC,
};
use sha2::{Digest as _, Sha256};
use tracing::{info, warn};

use super::Context;
use super::plan::{self, Health, Inputs, Leaving, MachineView};
use super::provider::{Deletion, Machine, MachineRequest, Provider, ProviderError};
use super::status::{self, Outcome};
use crate::controllers::node_maintenance::status::REASON_REFUSED;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("wait for the nodeset caches (nodes, nodemaintenances, nodeclasses) to list")]
    SyncCaches,
    #[error("write status of nodeset {name}: {source}")]
    WriteStatus { name: String, source: kube::Error },
    #[error("create nodemaintenance {name}: {source}")]
    CreateMaintenance { name: String, source: kube::Error },
    #[error("delete nodemaintenance {name}: {source}")]
    DeleteMaintenance { name: String, source: kube::Error },
}

pub fn error_policy(set: Arc<NodeSet>, error: &Error, _ctx: Arc<Context>) -> Action {
    warn!(%error, nodeset = %set.name_any(), "nodeset reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
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

/// The hash of what a node is made from (class spec and set template): ten hex digits. A node
/// whose `nodekeeper.dev/template-hash` differs is outdated and replaced.
pub fn template_hash(class: &NodeClassSpec, template: &NodeTemplate) -> String {
    let bytes = serde_json::to_vec(&(class, template)).unwrap_or_default();
    hex::encode(&Sha256::digest(&bytes)[..5])
}

/// The name of the NodeMaintenance that drains `node` for its set.
pub fn maintenance_name(node: &str) -> String {
    format!("nodeset-drain-{node}")
}

/// A new machine's name: the set's name (cut so the whole fits a label value) and five
/// characters that cannot spell words, as Kubernetes' generated names do.
fn machine_name(set: &str, taken: &HashSet<String>) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let prefix: String = set.chars().take(57).collect();
    let prefix = prefix.trim_end_matches(['-', '.']);
    loop {
        let suffix: String = (0..5)
            .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
            .collect();
        let name = format!("{prefix}-{suffix}");
        if !taken.contains(&name) {
            return name;
        }
    }
}

/// The reason kube-controller-manager's node lifecycle controller gives the `Ready=Unknown` it
/// writes on a Node whose kubelet has not posted status within its startup grace period (a
/// minute by default): such a node has not joined, although it has a Ready condition.
const REASON_NEVER_UPDATED: &str = "NodeStatusNeverUpdated";

fn health_of(node: &Node) -> Health {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match ready {
        None => Health::NeverJoined,
        Some(c) if c.reason.as_deref() == Some(REASON_NEVER_UPDATED) => Health::NeverJoined,
        Some(c) if c.status == "True" => Health::Ready,
        Some(_) => Health::NotReady,
    }
}

/// Where a node's drain stands, from its NodeMaintenance's status.
pub fn leaving_of(nm: &NodeMaintenance, node: &str) -> Leaving {
    let Some(s) = &nm.status else {
        return Leaving::Draining;
    };
    let name = nm.name_any();
    if let Some(c) = s
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready" && c.reason == REASON_REFUSED)
    {
        return Leaving::Stuck(format!("nodemaintenance {name} refused: {}", c.message));
    }
    match s.nodes.iter().find(|p| p.node == node) {
        Some(p) if p.phase == NodePhase::Drained => Leaving::Drained,
        Some(p) if p.phase == NodePhase::Failed => Leaving::Stuck(format!(
            "drain of node {node} failed (nodemaintenance {name}): {}",
            p.message
        )),
        Some(_) => Leaving::Draining,
        None if s.matched == 1 && s.drained == 1 => Leaving::Drained,
        None => Leaving::Draining,
    }
}

/// Since when the node is unhealthy for repair: Ready not `True`, or one of `conditions`
/// `False`; the earliest such transition. `None` when healthy or never joined.
fn unhealthy_since(node: &Node, conditions: &[String]) -> Option<i64> {
    let cs = node.status.as_ref()?.conditions.as_ref()?;
    // A node that never joined is the join timeout's, not repair's.
    if health_of(node) == Health::NeverJoined {
        return None;
    }
    cs.iter()
        .filter(|c| {
            (c.type_ == "Ready" && c.status != "True")
                || (conditions.contains(&c.type_) && c.status == "False")
        })
        .map(|c| {
            c.last_transition_time
                .as_ref()
                .map_or(0, |t| t.0.as_second())
        })
        .min()
}

fn machine_of(node: &Node) -> Machine {
    Machine {
        node_name: node.name_any(),
        provider_id: node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.clone())
            .unwrap_or_else(|| format!("{}{}", super::kwok::PROVIDER_ID_PREFIX, node.name_any())),
        node_set: node.labels().get(LABEL_NODE_SET).cloned(),
        created: None,
    }
}

async fn publish(ctx: &Context, set: &NodeSet, type_: EventType, reason: &str, note: String) {
    publish_event(&ctx.recorder, set, type_, reason, note).await;
}

/// Publishes an Event about `obj` (the reason is its action too); a failure is logged.
pub async fn publish_event<K: kube::Resource<DynamicType = ()>>(
    recorder: &kube::runtime::events::Recorder,
    obj: &K,
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
    if let Err(error) = recorder.publish(&event, &obj.object_ref(&())).await {
        warn!(%error, kind = %K::kind(&()), object = %obj.meta().name.as_deref().unwrap_or_default(), reason, "publishing an event failed");
    }
}

/// Writes the status when it differs from the stored one. Returns whether it wrote.
async fn write_status(
    api: &Api<NodeSet>,
    name: &str,
    current: Option<&NodeSetStatus>,
    status: &NodeSetStatus,
) -> Result<bool, Error> {
    if current == Some(status) {
        return Ok(false);
    }
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeSet",
        "status": status,
    });
    api.patch_status(
        name,
        &PatchParams::apply(MANAGER_NODE_SET).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| Error::WriteStatus {
        name: name.to_owned(),
        source,
    })?;
    Ok(true)
}

/// Writes a refusal and says when to look again.
async fn refuse(
    ctx: &Context,
    set: &NodeSet,
    reason: &'static str,
    message: String,
    again: Action,
) -> Result<Action, Error> {
    let name = set.name_any();
    let api: Api<NodeSet> = Api::all(ctx.client.clone());
    let s = status::build(
        &name,
        set.status.as_ref(),
        None,
        Vec::new(),
        0,
        &Outcome::Refused {
            reason,
            message: message.clone(),
        },
        set.meta().generation,
        &rfc3339(now_unix()),
    );
    if write_status(&api, &name, set.status.as_ref(), &s).await? {
        info!(nodeset = %name, reason, %message, "nodeset refused");
        publish(ctx, set, EventType::Warning, reason, message).await;
    }
    Ok(again)
}

pub async fn reconcile(set: Arc<NodeSet>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = set.name_any();
    if set.meta().deletion_timestamp.is_some() {
        // The nodes stay (deleting a set must not remove nodes without a drain; scale it to 0
        // first); its NodeMaintenances go with it (owner references).
        ctx.forget(&name);
        return Ok(Action::await_change());
    }

    // The spec: what the schema cannot check, and the controller's cap.
    let mut errors = set.spec.validate().err().unwrap_or_default();
    let above_cap = set.spec.replicas > ctx.max_replicas;
    if above_cap {
        errors.push(FieldError::new(
            "spec.replicas",
            format!(
                "{} is above the {} this controller allows (--nodeset-max-replicas, NODEKEEPER_NODESET_MAX_REPLICAS); lower spec.replicas or raise the cap",
                set.spec.replicas, ctx.max_replicas
            ),
        ));
    }
    let bounds = autoscaler_bounds(set.annotations(), set.spec.replicas);
    let out_of_bounds = !bounds.is_empty();
    errors.extend(bounds);
    if !errors.is_empty() {
        let reason = if out_of_bounds && errors.len() == 1 {
            REASON_OUT_OF_BOUNDS
        } else if above_cap && errors.len() == 1 {
            REASON_ABOVE_CAP
        } else {
            REASON_INVALID_SPEC
        };
        let message = format!("nodeset {name}: {}", format_field_errors(&errors));
        return refuse(&ctx, &set, reason, message, Action::await_change()).await;
    }

    let stores = ctx.stores().await?;
    // The class is needed only to create machines. Without a usable one nothing is created,
    // but the set still scales down, removes its drained machines (a machine is deleted by its
    // providerID) and cleans up its drains; the condition names what to fix.
    let class = stores
        .classes
        .get(&ObjectRef::new(&set.spec.node_class_name));
    let mut cannot_create: Option<(&'static str, String)> = None;
    let mut provider = None;
    match &class {
        None => {
            cannot_create = Some((
                REASON_NODE_CLASS_NOT_FOUND,
                format!(
                    "spec.nodeClassName: NodeClass {:?} does not exist; create it, or name an existing NodeClass. No machine is created until then; a scale-down and the removal of drained nodes go on",
                    set.spec.node_class_name
                ),
            ));
        }
        Some(class) => {
            // The Node record as the API server will check it: refused here, before a machine
            // is created whose Node could never be recorded.
            let node_errors = record_errors(&set, &class.name_any(), &class.spec);
            if !node_errors.is_empty() {
                cannot_create = Some((
                    REASON_INVALID_SPEC,
                    format!(
                        "nodeset {name}: {}; no machine is created until then",
                        format_field_errors(&node_errors)
                    ),
                ));
            }
            match ctx.provider(class.spec.provider) {
                Ok(p) => provider = Some(p),
                Err(error) => {
                    cannot_create.get_or_insert_with(|| {
                        (
                            REASON_PROVIDER_FAILED,
                            format!(
                                "spec.nodeClassName: NodeClass {}: {error}",
                                class.name_any()
                            ),
                        )
                    });
                }
            }
        }
    }
    let hash = class
        .as_ref()
        .map(|c| template_hash(&c.spec, &set.spec.template));
    // Validated above.
    let repair_after = set.spec.repair.after().ok().flatten();
    let join_timeout = ctx.join_timeout;
    let now = now_unix();

    // What the caches show of this set.
    let nodes: BTreeMap<String, Arc<Node>> = stores
        .nodes
        .state()
        .into_iter()
        .filter(|n| n.labels().get(LABEL_NODE_SET) == Some(&name))
        .map(|n| (n.name_any(), n))
        .collect();
    let maintenances: HashMap<String, Arc<NodeMaintenance>> = stores
        .maintenances
        .state()
        .into_iter()
        .filter(|m| m.labels().get(LABEL_NODE_SET) == Some(&name))
        .filter_map(|m| Some((m.annotations().get(ANNOTATION_DRAINED_NODE)?.clone(), m)))
        .collect();
    let (in_flight_names, deleting) = ctx.memory(&name, |mem| {
        let expiry = Duration::from_secs(120);
        mem.in_flight
            .retain(|n, at| !nodes.contains_key(n) && at.elapsed() < expiry);
        mem.deleting
            .retain(|n, at| nodes.contains_key(n) && at.elapsed() < expiry);
        (
            mem.in_flight.keys().cloned().collect::<HashSet<_>>(),
            mem.deleting.keys().cloned().collect::<HashSet<_>>(),
        )
    });
    let in_flight = u32::try_from(in_flight_names.len()).unwrap_or(u32::MAX);
    if let (Some(class), Some(provider)) = (&class, &provider)
        && !provider.machine_is_node()
    {
        sweep_orphans(
            &ctx,
            &set,
            provider,
            &class.spec,
            (&nodes, &stores.nodes),
            &in_flight_names,
        )
        .await;
    }
    let nm_api: Api<NodeMaintenance> = Api::all(ctx.client.clone());
    // A drain its NodeMaintenance refused (a drainTimeout above the maintenance's maximum)
    // never starts, and the maintenance is not changed in place. Once the set asks for another
    // drain, the refused one is replaced: deleted here (once: the cache shows it until the
    // watch delivers the deletion), created again from the set's spec when the plan next drains
    // the node.
    let mut replacing = HashSet::new();
    for (node, nm) in &maintenances {
        if !nodes.contains_key(node) || !refused_for_another_drain(nm, &set.spec.scale_down) {
            continue;
        }
        let m = nm.name_any();
        if !ctx.memory(&name, |mem| mem.deleted_maintenances.contains_key(&m)) {
            delete_maintenance(&nm_api, &m).await?;
            info!(nodeset = %name, node, maintenance = %m, "replacing a refused nodemaintenance: the set now asks for another drain");
            ctx.memory(&name, |mem| {
                mem.deleted_maintenances.insert(m, Instant::now())
            });
        }
        replacing.insert(node.clone());
    }
    let views: Vec<MachineView> = nodes
        .values()
        .map(|n| {
            let node = n.name_any();
            let leaving = if deleting.contains(&node) {
                Leaving::Deleting
            } else if replacing.contains(&node) {
                Leaving::Draining
            } else if let Some(nm) = maintenances.get(&node) {
                match leaving_of(nm, &node) {
                    Leaving::Stuck(why) => Leaving::Stuck(name_the_set_field(why, nm)),
                    other => other,
                }
            } else {
                Leaving::No
            };
            MachineView {
                created: n.creation_timestamp().map_or(now, |t| t.0.as_second()),
                health: health_of(n),
                // Without a class no node is outdated: nothing could replace it.
                updated: hash
                    .as_ref()
                    .is_none_or(|h| n.annotations().get(ANNOTATION_TEMPLATE_HASH) == Some(h)),
                unhealthy_since: unhealthy_since(n, &set.spec.repair.conditions),
                leaving,
                name: node,
            }
        })
        .collect();

    // A drain whose node is gone has done its work. Deleted once: the cache shows it until
    // the watch delivers the deletion, and a delete per reconcile meanwhile is a wasted write.
    let done: Vec<String> = ctx.memory(&name, |mem| {
        mem.deleted_maintenances.retain(|m, at| {
            at.elapsed() < Duration::from_secs(30)
                && maintenances.values().any(|nm| nm.name_any() == *m)
        });
        maintenances
            .iter()
            .filter(|(node, _)| !nodes.contains_key(*node))
            .map(|(_, nm)| nm.name_any())
            .filter(|m| !mem.deleted_maintenances.contains_key(m))
            .collect()
    });
    for m in done {
        delete_maintenance(&nm_api, &m).await?;
        ctx.memory(&name, |mem| {
            mem.deleted_maintenances.insert(m, Instant::now())
        });
    }

    let (max_total, min_ready) = set.spec.rollout_bounds();
    let plan = plan::plan(
        &views,
        Inputs {
            replicas: set.spec.replicas,
            max_total,
            min_ready,
            now,
            join_timeout_secs: i64::try_from(join_timeout.as_secs()).unwrap_or(i64::MAX),
            in_flight,
            repair: repair_after.map(|after| plan::Repair {
                after_secs: i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
                max_unhealthy: set.spec.repair.max_unhealthy(set.spec.replicas),
            }),
            can_create: cannot_create.is_none(),
        },
    );
    for node in &plan.repair {
        info!(nodeset = %name, node, "node unhealthy too long; draining it for replacement");
    }

    // Drained nodes whose machine no provider of this controller can delete (the class is
    // gone): each is a problem in the status, said there rather than logged every second.
    let mut undeletable: BTreeMap<String, String> = BTreeMap::new();
    // Machines that never joined: deleted at once (no pod can have run there) and replaced.
    let mut new_failed_joins = 0;
    let mut stalled = None;
    for node in &plan.replace {
        let machine = machine_of(&nodes[node]);
        let deleter = match deleter(&ctx, provider.as_ref(), &machine) {
            Ok(p) => p,
            Err(why) => {
                undeletable.insert(node.clone(), why);
                continue;
            }
        };
        ctx.calls.delete.fetch_add(1, Ordering::Relaxed);
        match deleter.delete(&machine).await {
            Ok(_) => {
                new_failed_joins += 1;
                let message = format!(
                    "machine {node} ({}) never joined: its kubelet did not report within {}; deleted, a new one replaces it",
                    machine.provider_id,
                    humantime::format_duration(join_timeout)
                );
                ctx.memory(&name, |mem| {
                    mem.deleting.insert(node.clone(), Instant::now());
                    mem.fail(message.clone());
                });
                if views.iter().any(|v| !v.updated && v.leaving == Leaving::No) {
                    stalled = Some(message.clone());
                }
                publish(
                    &ctx,
                    &set,
                    EventType::Warning,
                    "MachineNeverJoined",
                    message,
                )
                .await;
            }
            Err(error) => {
                warn!(%error, nodeset = %name, node, "deleting a machine that never joined failed")
            }
        }
    }

    for node in &plan.reclaim {
        delete_maintenance(&nm_api, &maintenances[node].name_any()).await?;
    }
    for node in &plan.drain {
        create_maintenance(&nm_api, &set, node).await?;
    }
    for node in &plan.remove {
        let machine = machine_of(&nodes[node]);
        let deleter = match deleter(&ctx, provider.as_ref(), &machine) {
            Ok(p) => p,
            Err(why) => {
                undeletable.insert(node.clone(), why);
                continue;
            }
        };
        ctx.calls.delete.fetch_add(1, Ordering::Relaxed);
        match deleter.delete(&machine).await {
            Ok(Deletion::Gone | Deletion::InProgress) => {
                ctx.memory(&name, |mem| {
                    mem.deleting.insert(node.clone(), Instant::now())
                });
            }
            Err(error) => {
                warn!(%error, nodeset = %name, node, "deleting a drained machine failed; retrying")
            }
        }
    }

    // Creates, unless the provider is backing off.
    let mut requeue = ctx.recheck;
    if let (true, Some(class), Some(provider), Some(hash)) =
        (plan.create > 0, &class, &provider, &hash)
    {
        match ctx.memory(&name, |mem| mem.backoff_left()) {
            Some(wait) => requeue = wait.max(ctx.recheck),
            None => {
                let mut taken: HashSet<String> = nodes.keys().cloned().collect();
                let requests: Vec<MachineRequest> = (0..plan.create)
                    .map(|_| {
                        let node_name = machine_name(&name, &taken);
                        taken.insert(node_name.clone());
                        request(&set, &class.name_any(), &class.spec, hash, node_name)
                    })
                    .collect();
                if let Err(error) = create_machines(&ctx, provider, &name, &requests).await {
                    let message = format!("provider {}: {error}", provider.kind());
                    warn!(nodeset = %name, %message, "creating machines failed; backing off");
                    ctx.memory(&name, |mem| mem.fail(message));
                    if let Some(wait) = ctx.memory(&name, |mem| mem.backoff_left()) {
                        requeue = wait;
                    }
                }
            }
        }
    }

    // Status.
    let mut problems = Vec::new();
    let mut blocked = None;
    for v in &views {
        let message = match &v.leaving {
            Leaving::Stuck(m) => {
                blocked.get_or_insert_with(|| m.clone());
                m.clone()
            }
            _ if undeletable.contains_key(&v.name) => undeletable[&v.name].clone(),
            Leaving::No if v.health == Health::NotReady => "not Ready".to_owned(),
            _ => continue,
        };
        problems.push(MachineProblem {
            node: v.name.clone(),
            message,
        });
    }
    let provider_error = ctx.memory(&name, |mem| mem.last_error.clone());
    let converged = plan.create == 0
        && plan.drain.is_empty()
        && plan.remove.is_empty()
        && plan.replace.is_empty()
        && plan.reclaim.is_empty()
        && in_flight == 0
        && plan.counts.draining == 0
        && plan.counts.replicas == set.spec.replicas
        && plan.counts.ready == set.spec.replicas
        && plan.counts.updated == set.spec.replicas;
    let outcome = Outcome::Acting {
        converged,
        provider_error,
        scale_down_blocked: blocked,
        repair_halted: plan.repair_halted.map(|n| {
            format!(
                "{n} nodes are unhealthy, more than spec.repair.maxUnhealthy allows ({}); repair waits until fewer are",
                set.spec.repair.max_unhealthy(set.spec.replicas)
            )
        }),
        rollout_stalled: stalled,
        cannot_create: cannot_create
            .clone()
            .map(|(reason, message)| status::CannotCreate {
                reason,
                message,
                short: plan.counts.replicas < set.spec.replicas,
            }),
    };
    let api: Api<NodeSet> = Api::all(ctx.client.clone());
    let s = status::build(
        &name,
        set.status.as_ref(),
        Some(plan.counts),
        problems,
        new_failed_joins,
        &outcome,
        set.meta().generation,
        &rfc3339(now),
    );
    let ready_before = ready_condition(set.status.as_ref());
    if write_status(&api, &name, set.status.as_ref(), &s).await? {
        if let Some((reason, message)) = &cannot_create {
            // Said once per new reason or message, as a refusal is.
            if ready_before != ready_condition(Some(&s)) {
                info!(nodeset = %name, reason, %message, "nodeset cannot create machines");
                publish(&ctx, &set, EventType::Warning, reason, message.clone()).await;
            }
        } else if let Outcome::Acting {
            provider_error: Some(error),
            ..
        } = &outcome
        {
            publish(
                &ctx,
                &set,
                EventType::Warning,
                REASON_PROVIDER_FAILED,
                error.clone(),
            )
            .await;
        }
    }
    Ok(Action::requeue(match (converged, &cannot_create) {
        // No event wakes a set when its class appears or is fixed: looked at again soon.
        (true, Some(_)) => ctx.resync.min(Duration::from_secs(10)),
        (true, None) => ctx.resync,
        (false, _) => requeue,
    }))
}

/// The message of the NodeMaintenance controller's refusal of `nm` (its spec is invalid; it
/// never acts), if it refused it.
fn refusal(nm: &NodeMaintenance) -> Option<&str> {
    nm.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == nodekeeper_api::names::CONDITION_READY && c.reason == REASON_REFUSED)
        .map(|c| c.message.as_str())
}

/// Whether `nm`, a drain the set started, was refused and the set now asks for a different one
/// (its `spec.scaleDown` changed since): then it is replaced.
fn refused_for_another_drain(nm: &NodeMaintenance, scale_down: &ScaleDown) -> bool {
    nm.meta().deletion_timestamp.is_none()
        && refusal(nm).is_some()
        && (nm.spec.drain_timeout != scale_down.drain_timeout
            || nm.spec.on_timeout != scale_down.on_timeout)
}

/// A stuck drain's message, naming the set's own field when the maintenance was refused for
/// the drain timeout it has from the set.
fn name_the_set_field(why: String, nm: &NodeMaintenance) -> String {
    match refusal(nm) {
        Some(m) if m.contains("spec.drainTimeout") => format!(
            "{why}; its drainTimeout {:?} is the set's spec.scaleDown.drainTimeout: set that to at most 168h, and the maintenance is replaced",
            nm.spec.drain_timeout
        ),
        _ => why,
    }
}

/// The reason and message of the stored `Ready` condition, if any.
fn ready_condition(status: Option<&NodeSetStatus>) -> Option<(String, String)> {
    status?
        .conditions
        .iter()
        .find(|c| c.type_ == nodekeeper_api::names::CONDITION_READY)
        .map(|c| (c.reason.clone(), c.message.clone()))
}

/// The provider that deletes `machine`: the class's, or without one (the class is gone, or its
/// provider unavailable) the one its providerID names. An error (why, and the fix: the node's
/// problem in the status) when this controller has none for it: the machine stays, and the next
/// reconcile tries again.
fn deleter(
    ctx: &Context,
    class_provider: Option<&Arc<dyn Provider>>,
    machine: &Machine,
) -> Result<Arc<dyn Provider>, String> {
    if let Some(p) = class_provider {
        return Ok(Arc::clone(p));
    }
    let id = &machine.provider_id;
    if id.starts_with(super::kwok::PROVIDER_ID_PREFIX) {
        Ok(Arc::clone(&ctx.kwok))
    } else if id.starts_with(super::oci::PROVIDER_ID_PREFIX) {
        ctx.oci.clone().ok_or_else(|| {
            format!(
                "drained, but its machine {id} is an OCI instance and this controller has no OCI provider ({}); fix the controller's OCI access, or name an existing NodeClass",
                ctx.oci_unavailable
            )
        })
    } else {
        Err(format!(
            "drained, but no provider of this controller knows its machine {id}; name an existing NodeClass, or delete the machine and the Node by hand"
        ))
    }
}

/// What the API server would refuse in the Node record of a machine of `set` made from class
/// `class_name` ([`super::provider::node_record`]): the class's and the template's labels and
/// taints, and the set's and class's names as the values of the labels naming them (a name may
/// have 253 characters, a label value 63). Checked before any machine is created: a record
/// refused after the launch leaves a machine no Node names, terminated and launched again on
/// every retry.
pub fn record_errors(set: &NodeSet, class_name: &str, class: &NodeClassSpec) -> Vec<FieldError> {
    let class_field = |f: &str| format!("NodeClass {class_name} spec.{f}");
    let mut errors = node_class::check_labels(&class_field("labels"), &class.labels);
    errors.extend(node_class::check_taints(
        &class_field("taints"),
        &class.taints,
        &[],
    ));
    errors.extend(node_class::check_labels(
        "spec.template.labels",
        &set.spec.template.labels,
    ));
    errors.extend(node_class::check_taints(
        "spec.template.taints",
        &set.spec.template.taints,
        &class.taints,
    ));
    let own = [
        (
            "metadata.name",
            LABEL_NODE_SET,
            set.name_any(),
            "recreate the set under a name of at most 63 characters",
        ),
        (
            "spec.nodeClassName",
            LABEL_NODE_CLASS,
            class_name.to_owned(),
            "name a NodeClass whose name has at most 63 characters",
        ),
    ];
    for (field, label, value, fix) in own {
        let checked = node_class::check_labels(field, &BTreeMap::from([(label.to_owned(), value)]));
        errors.extend(checked.into_iter().map(|e| FieldError {
            field: field.to_owned(),
            message: format!(
                "{}; every Node of the set carries it as the value of label {label}, and a label value has at most 63 characters: {fix}",
                e.message
            ),
        }));
    }
    errors
}

/// Whether a machine listed without a Node is old enough for the orphan sweep: made at least
/// `grace` before `now`. A machine whose age is unknown, or that the clock puts in the future, is
/// left alone: terminating a machine that is not an orphan costs a running node, leaving an
/// orphan for another sweep costs a minute's billing.
fn old_enough(created: Option<SystemTime>, now: SystemTime, grace: Duration) -> bool {
    created
        .and_then(|t| now.duration_since(t).ok())
        .is_some_and(|age| age >= grace)
}

/// Machines of the set at the provider without a Node (a crash between launch and record, or a
/// Node deleted by hand) are deleted: no pod can be running there, and nothing else would ever
/// remove them. Listed at most every [`super::ORPHAN_SWEEP`]. Left alone: machines being
/// created, machines younger than the orphan grace, and machines whose Node exists though the
/// cache does not show it in the set — its `nodekeeper.dev/nodeset` label removed (taken out of
/// the set, with its pods), or a watch running behind. Only a live read of the Node says it is
/// gone, so each candidate is read once before it is terminated.
///
/// The listing also shows this cluster's machines of other sets in the same place. Those are
/// their own set's to sweep while it exists; a machine without a Node whose set is gone (leaked
/// just before the set was deleted) has no other sweep, so it is terminated here, after the
/// same checks and a live read saying the set is gone. `nodes` is this set's nodes and the
/// cache of every set's.
async fn sweep_orphans(
    ctx: &Context,
    set: &NodeSet,
    provider: &Arc<dyn Provider>,
    class: &NodeClassSpec,
    (nodes, all_nodes): (&BTreeMap<String, Arc<Node>>, &Store<Node>),
    in_flight: &HashSet<String>,
) {
    let name = set.name_any();
    let due = ctx.memory(&name, |mem| {
        let due = mem
            .last_list
            .is_none_or(|t| t.elapsed() >= super::ORPHAN_SWEEP);
        if due {
            mem.last_list = Some(Instant::now());
        }
        due
    });
    if !due {
        return;
    }
    ctx.calls.list.fetch_add(1, Ordering::Relaxed);
    let machines = match provider.list(&name, class).await {
        Ok(m) => m,
        Err(error) => {
            warn!(%error, nodeset = %name, "listing the provider's machines failed; next sweep retries");
            return;
        }
    };
    let node_api: Api<Node> = Api::all(ctx.client.clone());
    // A machine said to be kept and no longer listed is forgotten (said again if it returns).
    ctx.memory(&name, |mem| {
        mem.kept_orphans
            .retain(|n| machines.iter().any(|m| m.node_name == *n))
    });
    let set_api: Api<NodeSet> = Api::all(ctx.client.clone());
    for m in machines {
        let other_set = m.node_set.as_deref().filter(|s| *s != name);
        if other_set.is_none()
            && (nodes.contains_key(&m.node_name) || in_flight.contains(&m.node_name))
        {
            continue;
        }
        if other_set.is_some() && all_nodes.get(&ObjectRef::new(&m.node_name)).is_some() {
            continue;
        }
        if !old_enough(m.created, SystemTime::now(), ctx.orphan_grace) {
            continue;
        }
        match node_api.get_opt(&m.node_name).await {
            Ok(None) => {}
            // Another set's node, wherever its label went: that set's business.
            Ok(Some(_)) if other_set.is_some() => continue,
            Ok(Some(_)) => {
                let first = ctx.memory(&name, |mem| mem.kept_orphans.insert(m.node_name.clone()));
                if first {
                    let message = format!(
                        "machine {} ({}) of nodeset {name} has a Node the set does not count (its {LABEL_NODE_SET} label was removed, or this controller's watch is behind); left running. If it was taken out of the set, delete the Node to have the machine terminated, or label it back",
                        m.node_name, m.provider_id
                    );
                    warn!(nodeset = %name, node = %m.node_name, provider_id = %m.provider_id, "machine's Node is outside the set; left running");
                    publish(ctx, set, EventType::Warning, "OrphanMachineKept", message).await;
                }
                continue;
            }
            Err(error) => {
                warn!(%error, nodeset = %name, node = %m.node_name, "reading the Node of a machine that seems orphaned failed; next sweep retries");
                continue;
            }
        }
        if let Some(other) = other_set {
            match set_api.get_opt(other).await {
                Ok(None) => {}
                Ok(Some(_)) => continue,
                Err(error) => {
                    warn!(%error, nodeset = %name, other, "reading the nodeset of a machine without a Node failed; next sweep retries");
                    continue;
                }
            }
        }
        ctx.calls.delete.fetch_add(1, Ordering::Relaxed);
        match provider.delete(&m).await {
            Ok(_) => {
                let message = match other_set {
                    None => format!(
                        "machine {} ({}) of nodeset {name} has no Node (never recorded, or the Node was deleted); deleted it",
                        m.node_name, m.provider_id
                    ),
                    Some(other) => format!(
                        "machine {} ({}) of nodeset {other}, which no longer exists, has no Node; deleted it",
                        m.node_name, m.provider_id
                    ),
                };
                warn!(nodeset = %name, node = %m.node_name, provider_id = %m.provider_id, "deleted a machine without a Node");
                publish(
                    ctx,
                    set,
                    EventType::Warning,
                    "OrphanMachineDeleted",
                    message,
                )
                .await;
            }
            Err(error) => {
                warn!(%error, nodeset = %name, node = %m.node_name, "deleting a machine without a Node failed; next sweep retries")
            }
        }
    }
}

/// Condition reason: `spec.replicas` is outside the autoscaler min/max annotations.
pub const REASON_OUT_OF_BOUNDS: &str = "ReplicasOutOfBounds";

/// Checks the cluster-autoscaler node-group bounds ([`super::ANNOTATION_MIN_SIZE`],
/// [`super::ANNOTATION_MAX_SIZE`]) a set may carry: each a whole number, min ≤ max, and
/// `replicas` within them. Each problem names the annotation or field and the fix.
pub fn autoscaler_bounds(annotations: &BTreeMap<String, String>, replicas: u32) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let mut read = |key: &str| -> Option<u32> {
        let raw = annotations.get(key)?;
        match raw.trim().parse::<u32>() {
            Ok(v) => Some(v),
            Err(_) => {
                errors.push(FieldError::new(
                    format!("metadata.annotations[{key}]"),
                    format!("{raw:?} is not a whole number of nodes; write e.g. \"3\""),
                ));
                None
            }
        }
    };
    let min = read(super::ANNOTATION_MIN_SIZE);
    let max = read(super::ANNOTATION_MAX_SIZE);
    match (min, max) {
        (Some(lo), Some(hi)) if lo > hi => errors.push(FieldError::new(
            format!("metadata.annotations[{}]", super::ANNOTATION_MIN_SIZE),
            format!("{lo} is above the max-size annotation {hi}; lower it or raise the max"),
        )),
        _ => {
            if let Some(lo) = min.filter(|lo| replicas < *lo) {
                errors.push(FieldError::new(
                    "spec.replicas",
                    format!(
                        "{replicas} is below the min-size annotation {lo} ({}); scale to at least {lo} or lower the annotation",
                        super::ANNOTATION_MIN_SIZE
                    ),
                ));
            }
            if let Some(hi) = max.filter(|hi| replicas > *hi) {
                errors.push(FieldError::new(
                    "spec.replicas",
                    format!(
                        "{replicas} is above the max-size annotation {hi} ({}); scale to at most {hi} or raise the annotation",
                        super::ANNOTATION_MAX_SIZE
                    ),
                ));
            }
        }
    }
    errors
}

/// What to ask the provider for: the class's and the template's labels and taints on top of
/// the set's own record.
fn request(
    set: &NodeSet,
    class_name: &str,
    class: &NodeClassSpec,
    hash: &str,
    node_name: String,
) -> MachineRequest {
    let mut labels = class.labels.clone();
    labels.extend(set.spec.template.labels.clone());
    let mut taints = class.taints.clone();
    taints.extend(set.spec.template.taints.iter().cloned());
    MachineRequest {
        node_name,
        node_set: set.name_any(),
        node_class: class_name.to_owned(),
        template_hash: hash.to_owned(),
        labels,
        taints,
        class: class.clone(),
    }
}

/// Creates machines in batches of 1, 2, 4, … (Kubernetes' slow start): a provider that fails
/// every create costs one call, not a flood; a batch with a failure ends the round.
async fn create_machines(
    ctx: &Context,
    provider: &Arc<dyn Provider>,
    set: &str,
    requests: &[MachineRequest],
) -> Result<(), ProviderError> {
    let mut batch = 1usize;
    let mut start = 0;
    while start < requests.len() {
        let chunk = &requests[start..(start + batch).min(requests.len())];
        ctx.memory(set, |mem| {
            for r in chunk {
                mem.in_flight.insert(r.node_name.clone(), Instant::now());
            }
        });
        // Owned futures collected first: a closure over borrowed requests inside the stream
        // trips the compiler's Send inference for the reconcile future.
        let calls: Vec<_> = chunk
            .iter()
            .map(|r| create_one(Arc::clone(provider), r.clone()))
            .collect();
        let results: Vec<(String, Result<Machine, ProviderError>)> = futures::stream::iter(calls)
            .buffer_unordered(ctx.create_concurrency)
            .collect()
            .await;
        let mut first_error = None;
        for (node, result) in results {
            match result {
                Ok(_) => {
                    ctx.calls.create_ok.fetch_add(1, Ordering::Relaxed);
                    ctx.memory(set, |mem| mem.succeed());
                }
                Err(error) => {
                    ctx.calls.create_failed.fetch_add(1, Ordering::Relaxed);
                    ctx.memory(set, |mem| mem.in_flight.remove(&node));
                    first_error.get_or_insert(error);
                }
            }
        }
        if let Some(error) = first_error {
            return Err(error);
        }
        start += chunk.len();
        batch = batch.saturating_mul(2);
    }
    Ok(())
}

async fn create_one(
    provider: Arc<dyn Provider>,
    request: MachineRequest,
) -> (String, Result<Machine, ProviderError>) {
    let result = provider.create(&request).await;
    (request.node_name, result)
}

/// A drain of one node through a NodeMaintenance in stage Drain, as the NodeSet and kube-node
/// controllers start it.
pub struct DrainOrder {
    /// The NodeMaintenance's name.
    pub name: String,
    /// The node drained (the `nodekeeper.dev/nodeset-node` annotation, how it is found again).
    pub node: String,
    /// The node's `kubernetes.io/hostname` label: the selector picks exactly that node.
    pub hostname: String,
    /// Labels the NodeMaintenance carries (how its controller's cache finds it).
    pub labels: BTreeMap<String, String>,
    /// Its owner reference (it goes with its owner).
    pub owner: serde_json::Value,
    pub drain_timeout: String,
    pub on_timeout: nodekeeper_api::crd::node_maintenance::OnTimeout,
    /// The maintenance's `spec.reason`.
    pub reason: String,
}

/// Starts the drain of `node`: a NodeMaintenance in stage Drain selecting exactly that node,
/// with the set's drain timeout and on-timeout action, owned by the set.
async fn create_maintenance(
    api: &Api<NodeMaintenance>,
    set: &NodeSet,
    node: &str,
) -> Result<(), Error> {
    start_drain(
        api,
        &DrainOrder {
            name: maintenance_name(node),
            node: node.to_owned(),
            hostname: node.to_owned(),
            labels: BTreeMap::from([(LABEL_NODE_SET.to_owned(), set.name_any())]),
            owner: serde_json::json!({
                "apiVersion": API_VERSION,
                "kind": "NodeSet",
                "name": set.name_any(),
                "uid": set.uid().unwrap_or_default(),
                "controller": true,
            }),
            drain_timeout: set.spec.scale_down.drain_timeout.clone(),
            on_timeout: set.spec.scale_down.on_timeout,
            reason: format!("nodeset {}: node {node} leaves the set", set.name_any()),
        },
    )
    .await
}

/// Creates the NodeMaintenance of a [`DrainOrder`] (one that exists already is left as it is).
pub async fn start_drain(api: &Api<NodeMaintenance>, order: &DrainOrder) -> Result<(), Error> {
    let name = order.name.clone();
    let body = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": "NodeMaintenance",
        "metadata": {
            "name": name,
            "labels": order.labels,
            "annotations": { ANNOTATION_DRAINED_NODE: order.node },
            "ownerReferences": [order.owner],
        },
        "spec": {
            "nodeSelector": { "matchLabels": { "kubernetes.io/hostname": order.hostname } },
            "stage": "Drain",
            "drainTimeout": order.drain_timeout,
            "onTimeout": order.on_timeout,
            // The selection is one node chosen by name; in a small cluster it can be every
            // node, which the maintenance would otherwise refuse.
            "allowBroadSelection": true,
            "reason": order.reason,
        },
    });
    let nm: NodeMaintenance =
        serde_json::from_value(body).map_err(|e| Error::CreateMaintenance {
            name: name.clone(),
            source: kube::Error::SerdeError(e),
        })?;
    match api.create(&PostParams::default(), &nm).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(Error::CreateMaintenance { name, source }),
    }
}

/// Deletes a NodeMaintenance (one that is gone already is fine).
pub async fn delete_maintenance(api: &Api<NodeMaintenance>, name: &str) -> Result<(), Error> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::DeleteMaintenance {
            name: name.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodekeeper_api::crd::node_maintenance::{NodeMaintenanceStatus, NodeProgress};

    /// A Node with the given Ready condition (status, reason), if any.
    fn node_ready(ready: Option<(&str, &str)>) -> Node {
        let conditions: Vec<serde_json::Value> = ready
            .into_iter()
            .map(|(status, reason)| {
                serde_json::json!({
                    "type": "Ready", "status": status, "reason": reason,
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                })
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n"},
            "status": {"conditions": conditions},
        }))
        .unwrap()
    }

    #[test]
    fn a_node_no_kubelet_ever_updated_never_joined() {
        // kube-controller-manager's node lifecycle controller writes Ready=Unknown with this
        // reason on a Node whose kubelet never posted status: still not joined, so the join
        // timeout (not repair) deals with it.
        let never = node_ready(Some(("Unknown", "NodeStatusNeverUpdated")));
        assert_eq!(health_of(&never), Health::NeverJoined);
        assert_eq!(unhealthy_since(&never, &[]), None);
        assert_eq!(health_of(&node_ready(None)), Health::NeverJoined);
        assert_eq!(unhealthy_since(&node_ready(None), &[]), None);
        // A kubelet that reported once and then stopped: NotReady, for repair.
        let lost = node_ready(Some(("Unknown", "NodeStatusUnknown")));
        assert_eq!(health_of(&lost), Health::NotReady);
        assert_eq!(unhealthy_since(&lost, &[]), Some(1_767_225_600));
        let down = node_ready(Some(("False", "KubeletNotReady")));
        assert_eq!(health_of(&down), Health::NotReady);
        assert_eq!(
            health_of(&node_ready(Some(("True", "KubeletReady")))),
            Health::Ready
        );
    }

    #[test]
    fn only_machines_older_than_the_grace_are_swept() {
        let now = UNIX_EPOCH + Duration::from_secs(10_000);
        let grace = Duration::from_secs(600);
        let at = |secs| Some(UNIX_EPOCH + Duration::from_secs(secs));
        assert!(old_enough(at(9_400), now, grace));
        assert!(old_enough(at(1), now, grace));
        assert!(!old_enough(at(9_401), now, grace));
        // Unknown age, or made "after" now by a skewed clock: left alone.
        assert!(!old_enough(None, now, grace));
        assert!(!old_enough(at(10_500), now, grace));
        assert!(old_enough(at(10_000), now, Duration::ZERO));
    }

    #[test]
    fn template_hash_follows_class_and_template_only() {
        let class: NodeClassSpec =
            serde_json::from_value(serde_json::json!({"provider": "kwok", "kwok": {}})).unwrap();
        let t = NodeTemplate::default();
        let a = template_hash(&class, &t);
        assert_eq!(a.len(), 10);
        assert_eq!(a, template_hash(&class, &t));
        let mut t2 = t.clone();
        t2.labels.insert("tier".into(), "web".into());
        assert_ne!(a, template_hash(&class, &t2));
    }

    #[test]
    fn autoscaler_bounds_are_read_and_checked() {
        let a = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let (min, max) = (
            super::super::ANNOTATION_MIN_SIZE,
            super::super::ANNOTATION_MAX_SIZE,
        );
        assert!(autoscaler_bounds(&a(&[]), 7).is_empty());
        assert!(autoscaler_bounds(&a(&[(min, "2"), (max, "10")]), 2).is_empty());
        assert!(autoscaler_bounds(&a(&[(min, "2"), (max, "10")]), 10).is_empty());
        let e = autoscaler_bounds(&a(&[(min, "2"), (max, "10")]), 11);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].field, "spec.replicas");
        assert!(
            e[0].message.contains("above the max-size annotation 10"),
            "{}",
            e[0].message
        );
        let e = autoscaler_bounds(&a(&[(min, "2")]), 1);
        assert!(
            e[0].message.contains("below the min-size annotation 2"),
            "{}",
            e[0].message
        );
        let e = autoscaler_bounds(&a(&[(min, "five")]), 1);
        assert_eq!(e[0].field, format!("metadata.annotations[{min}]"));
        let e = autoscaler_bounds(&a(&[(min, "5"), (max, "3")]), 4);
        assert_eq!(e.len(), 1);
        assert!(
            e[0].message.contains("above the max-size annotation 3"),
            "{}",
            e[0].message
        );
    }

    #[test]
    fn names_too_long_for_a_label_value_are_refused_before_any_machine() {
        // A set's and a class's names may have 253 characters; the Node record carries both as
        // label values, which have at most 63: refused before the launch, naming the field.
        let set = |name: &str| -> NodeSet {
            serde_json::from_value(serde_json::json!({
                "apiVersion": API_VERSION, "kind": "NodeSet",
                "metadata": {"name": name},
                "spec": {"nodeClassName": "c", "replicas": 1},
            }))
            .unwrap()
        };
        let class: NodeClassSpec =
            serde_json::from_value(serde_json::json!({"provider": "kwok", "kwok": {}})).unwrap();
        let ok = "s".repeat(63);
        assert_eq!(record_errors(&set(&ok), &"c".repeat(63), &class), vec![]);
        let e = record_errors(&set(&"s".repeat(64)), "c", &class);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].field, "metadata.name");
        assert!(
            e[0].message.contains(LABEL_NODE_SET) && e[0].message.contains("at most 63"),
            "{}",
            e[0].message
        );
        let e = record_errors(&set(&ok), &"c".repeat(253), &class);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].field, "spec.nodeClassName");
        assert!(e[0].message.contains(LABEL_NODE_CLASS), "{}", e[0].message);
        // The class's and template's own labels are still checked.
        let mut bad = set(&ok);
        bad.spec
            .template
            .labels
            .insert("team name".into(), "x".into());
        let e = format_field_errors(&record_errors(&bad, "c", &class));
        assert!(e.contains("spec.template.labels"), "{e}");
    }

    #[test]
    fn a_refused_drain_is_replaced_once_the_set_asks_for_another() {
        use nodekeeper_api::crd::common::Condition;
        let mut nm: NodeMaintenance = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "NodeMaintenance",
            "metadata": {"name": "nodeset-drain-a"},
            "spec": {
                "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "a"}},
                "drainTimeout": "200h",
            }
        }))
        .unwrap();
        let wants = |timeout: &str| -> ScaleDown {
            serde_json::from_value(serde_json::json!({ "drainTimeout": timeout })).unwrap()
        };
        // Not refused (yet): left alone, whatever the set asks.
        assert!(!refused_for_another_drain(&nm, &wants("1h")));
        let condition: Condition = serde_json::from_value(serde_json::json!({
            "type": "Ready", "status": "False", "reason": REASON_REFUSED,
            "message": "nodemaintenance nodeset-drain-a: spec.drainTimeout: must be at most 168h (a week)",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }))
        .unwrap();
        nm.status = Some(NodeMaintenanceStatus {
            conditions: vec![condition],
            ..Default::default()
        });
        // Refused, and the set still asks for the same drain: stuck, naming the set's field.
        assert!(!refused_for_another_drain(&nm, &wants("200h")));
        let Leaving::Stuck(why) = leaving_of(&nm, "a") else {
            panic!("{:?}", leaving_of(&nm, "a"));
        };
        let why = name_the_set_field(why, &nm);
        assert!(
            why.contains("spec.scaleDown.drainTimeout") && why.contains("168h"),
            "{why}"
        );
        // The set fixed: the refused maintenance is replaced.
        assert!(refused_for_another_drain(&nm, &wants("1h")));
        let mut on_timeout = wants("200h");
        on_timeout.on_timeout = nodekeeper_api::crd::node_maintenance::OnTimeout::Proceed;
        assert_ne!(on_timeout.on_timeout, nm.spec.on_timeout);
        assert!(refused_for_another_drain(&nm, &on_timeout));
        // A refusal for something else keeps its own words.
        nm.status.as_mut().unwrap().conditions[0].message =
            "spec.nodeSelector: matches nothing".into();
        let why = name_the_set_field("stuck".into(), &nm);
        assert_eq!(why, "stuck");
    }

    #[tokio::test]
    async fn without_a_class_a_machine_is_deleted_by_the_provider_its_id_names() {
        // Never contacted.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let recorder = kube::runtime::events::Recorder::new(client.clone(), "test".into());
        let ctx = Context::with_client(client, recorder, &super::super::Config::default());
        let machine = |id: &str| Machine {
            node_name: "n1".into(),
            provider_id: id.into(),
            node_set: Some("web".into()),
            created: None,
        };
        let kwok = deleter(&ctx, None, &machine("kwok://n1")).unwrap();
        assert!(Arc::ptr_eq(&kwok, &ctx.kwok));
        let why = deleter(&ctx, None, &machine("oci://ocid1.instance.oc1..a"))
            .err()
            .expect("no OCI provider here");
        assert!(
            why.contains("oci://ocid1.instance.oc1..a") && why.contains("--oci-endpoint"),
            "{why}"
        );
        assert!(deleter(&ctx, None, &machine("aws:///i-1")).is_err());
        // With a usable class, its provider deletes.
        let class: Arc<dyn Provider> = Arc::clone(&ctx.kwok);
        let p = deleter(&ctx, Some(&class), &machine("oci://ocid1.instance.oc1..a")).unwrap();
        assert!(Arc::ptr_eq(&p, &class));
    }

    #[test]
    fn machine_names_are_label_values_and_unique() {
        let long = "a".repeat(200);
        let mut taken = HashSet::new();
        for _ in 0..100 {
            let n = machine_name(&long, &taken);
            assert!(n.len() <= 63, "{n}");
            assert!(taken.insert(n));
        }
    }

    #[test]
    fn the_drain_state_comes_from_the_maintenance() {
        let mut nm: NodeMaintenance = serde_json::from_value(serde_json::json!({
            "apiVersion": API_VERSION, "kind": "NodeMaintenance",
            "metadata": {"name": "nodeset-drain-a"},
            "spec": {"nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "a"}}}
        }))
        .unwrap();
        assert_eq!(leaving_of(&nm, "a"), Leaving::Draining);
        let progress = |phase, message: &str| NodeProgress {
            node: "a".into(),
            phase,
            drain_start_time: None,
            pods_remaining: 0,
            blocking_pods: vec![],
            omitted_blocking_pods: 0,
            skipped_pods: vec![],
            omitted_skipped_pods: 0,
            local_storage_pods: vec![],
            message: message.into(),
        };
        nm.status = Some(NodeMaintenanceStatus {
            matched: 1,
            nodes: vec![progress(NodePhase::Draining, "")],
            ..Default::default()
        });
        assert_eq!(leaving_of(&nm, "a"), Leaving::Draining);
        nm.status.as_mut().unwrap().nodes = vec![progress(NodePhase::Drained, "")];
        assert_eq!(leaving_of(&nm, "a"), Leaving::Drained);
        nm.status.as_mut().unwrap().nodes =
            vec![progress(NodePhase::Failed, "timed out; 1 pod left")];
        match leaving_of(&nm, "a") {
            Leaving::Stuck(m) => assert!(m.contains("timed out"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
