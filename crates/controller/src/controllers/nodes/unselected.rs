//! Nodes outside the controller's `--node-selector` lose the conditions the sweep wrote on them
//! (leader only, like the sweep; stopped with it when leadership ends).
//!
//! A node leaves the selection in two ways:
//! - live, when its labels change: the Node watch reports it deleted ([`Fleet::note_maybe_left`]
//!   says why the event alone cannot tell), and the node is read: gone means deleted, present
//!   and not matching means it left. A condition write of the sweep's already in flight when it
//!   left may land after the removal, so such a node is read once more [`SETTLE`] later.
//! - while no controller ran, when it restarts with a narrower selector (a changed Helm value):
//!   once per leadership start, after the fleet's initial Node list, a metadata-only read of
//!   the Nodes the previous selector selected finds those outside the new one on which the
//!   sweep's field manager owns conditions ([`scan`]). The selector in force is recorded on the
//!   leader Lease ([`RECORD_ANNOTATION`]) once its nodes are clean, so the next start knows what
//!   changed. Without a record (a first start, or an upgrade from a version that kept none)
//!   nothing is scanned: nodes outside the selector may be another nodekeeper's (each end-to-end
//!   test runs its own controller, with its own selector, in one cluster), and only the nodes
//!   this installation selected before are its to clean.
//!
//! The removal is one server-side apply by the sweep's field manager that lists no conditions
//! ([`release_body`]): the apply releases every condition the manager owned, and the API server
//! removes those no other manager owns (`status.conditions` is a map list keyed by `type`, so
//! each condition's fields are owned separately). A condition another manager also wrote stays,
//! as do nodekeeper's other managers' taints, labels and conditions (maintenance): only the
//! sweep's own conditions go. The apply carries the resourceVersion the decision was made on, so
//! a node that came back into the selection meanwhile is read again (409) and left alone.
//! Without a selector every node is selected: nothing is cleaned, and the record says so.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt as _, watcher};
use nodekeeper_api::crd::common::LabelSelector;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::conditions;
use crate::controllers::unless_stopped;
use crate::shared::{Fleet, LeaseAnnotations, Shared, lists};

/// Attempts per node: a conflict (the Node changed between its read and the write) reads it
/// again; any other failure is tried again after a pause.
const ATTEMPTS: u32 = 5;

/// Nodes cleaned at once: a few writes beside the sweep's own (64), so that a start that finds
/// tens of thousands of nodes to clean paces itself instead of crowding the API server.
const CONCURRENCY: usize = 8;

/// How long after a node left it is read once more (see the module doc).
pub const SETTLE: Duration = Duration::from_secs(30);

/// Nodes per page when the start scan lists in pages (metadata only: a few KiB a Node).
const SCAN_PAGE: u32 = 500;

/// A progress line every this many nodes cleaned by the start scan.
const PROGRESS_EVERY: usize = 1000;

/// The annotation of the leader Lease that records the selector the sweep last ran with once
/// the nodes outside it were clean, in the API's query syntax (empty: every Node). On the Lease
/// because it is this installation's (each leader reads it, the uninstall cleanup deletes it) and
/// the Role may read and update it. Written by the leader's own renewals
/// (`runtime::leader::LeaderConfig::annotations`), so recording it costs no request.
pub const RECORD_ANNOTATION: &str = "nodekeeper.dev/node-selector";

/// What the cleaner needs.
pub struct Context {
    pub client: kube::Client,
    /// The controller's namespace, where the leader Lease is.
    pub namespace: String,
    /// This replica's identity: the leader Lease is the one it holds.
    pub identity: String,
    pub fleet: Arc<Fleet>,
    /// What the leader's next Lease renewal writes: the record goes there.
    pub lease_annotations: LeaseAnnotations,
}

impl Context {
    pub fn new(shared: &Shared) -> Self {
        Self {
            client: shared.client.clone(),
            namespace: shared.namespace.clone(),
            identity: shared.identity.clone(),
            fleet: Arc::clone(&shared.fleet),
            lease_annotations: Arc::clone(&shared.lease_annotations),
        }
    }
}

/// The selector a record holds; `None` without one, or with one that no longer parses.
pub fn recorded(record: Option<&Lease>) -> Option<LabelSelector> {
    let text = record?
        .metadata
        .annotations
        .as_ref()?
        .get(RECORD_ANNOTATION)?;
    nodekeeper_api::selector::parse(text).ok()
}

/// The selector whose nodes the start scan reads, if any: the previous one, when the sweep ran
/// with one before (`previous`) and now selects differently (`current`; `None`: every Node, so
/// nothing is outside).
pub fn to_scan(
    previous: Option<LabelSelector>,
    current: Option<&LabelSelector>,
) -> Option<LabelSelector> {
    let current = current?;
    previous.filter(|previous| previous != current)
}

/// The condition types the sweep's field manager owns on a Node that `selection` does not
/// select: what must come off it. Empty for a selected Node, and for one the sweep never wrote.
pub fn to_remove(selection: &LabelSelector, meta: &ObjectMeta) -> BTreeSet<String> {
    let no_labels = BTreeMap::new();
    if selection.matches(meta.labels.as_ref().unwrap_or(&no_labels)) {
        return BTreeSet::new();
    }
    conditions::managed_condition_types(meta.managed_fields.as_deref().unwrap_or_default())
}

/// The apply to `nodes/{name}/status` by the sweep's field manager that releases its conditions
/// (it lists none), conditional on `resource_version`.
pub fn release_body(name: &str, resource_version: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name, "resourceVersion": resource_version },
    })
}

/// What became of one node.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Deleted: nothing to do.
    Gone,
    /// In the selection (again): the sweep's.
    Selected,
    /// Outside the selection, with none of the sweep's conditions.
    Clean,
    /// Outside the selection: these conditions were released (not listed: found by the scan).
    Removed(BTreeSet<String>),
    /// Every attempt failed; the last error.
    Failed(String),
}

impl Outcome {
    /// Whether the node exists outside the selection.
    fn unselected(&self) -> bool {
        matches!(self, Outcome::Clean | Outcome::Removed(_))
    }
}

/// Takes the sweep's conditions off node `name` if it is outside `selection`. `scanned`: the
/// resourceVersion at which the start scan found it outside with conditions, for a first write
/// without a read (a node changed since is read by the conflict).
async fn clean(
    api: &Api<Node>,
    selection: &LabelSelector,
    name: &str,
    mut scanned: Option<String>,
) -> Outcome {
    let mut last = String::new();
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(200) * attempt).await;
        }
        let (version, types) = match scanned.take() {
            // Not listed again: the scan keeps only names and versions (see `scan`).
            Some(version) => (version, BTreeSet::new()),
            None => {
                let meta = match api.get_metadata_opt(name).await {
                    Ok(Some(partial)) => partial.metadata,
                    Ok(None) => return Outcome::Gone,
                    Err(error) => {
                        last = format!("read the node: {error}");
                        continue;
                    }
                };
                let no_labels = BTreeMap::new();
                if selection.matches(meta.labels.as_ref().unwrap_or(&no_labels)) {
                    return Outcome::Selected;
                }
                let types = to_remove(selection, &meta);
                if types.is_empty() {
                    return Outcome::Clean;
                }
                (meta.resource_version.unwrap_or_default(), types)
            }
        };
        let body = release_body(name, &version);
        let params = PatchParams::apply(conditions::FIELD_MANAGER);
        match api.patch_status(name, &params, &Patch::Apply(&body)).await {
            Ok(_) => return Outcome::Removed(types),
            Err(kube::Error::Api(status)) if status.code == 404 => return Outcome::Gone,
            // 409: changed since it was read (labels, or another write): read it again.
            Err(error) => last = format!("remove its conditions: {error}"),
        }
    }
    Outcome::Failed(last)
}

/// Logs what became of `name` (`why`: how it was found).
fn log(name: &str, why: &'static str, outcome: &Outcome) {
    match outcome {
        Outcome::Removed(types) if types.is_empty() => {
            info!(node = %name, found = why, "node is outside --node-selector; the sweep's conditions removed")
        }
        Outcome::Removed(types) => {
            info!(node = %name, found = why, conditions = ?types, "node is outside --node-selector; the sweep's conditions removed")
        }
        Outcome::Failed(error) => {
            warn!(node = %name, found = why, %error, "node is outside --node-selector and its conditions could not be removed; the next leader's start tries again")
        }
        other => {
            debug!(node = %name, found = why, outcome = ?other, "node checked against --node-selector")
        }
    }
}

/// Nodes the start scan found to clean.
#[derive(Debug, Default)]
struct ScanTotals {
    seen: usize,
    found: usize,
    removed: usize,
    failed: usize,
}

/// The start scan: the metadata of every Node `previous` selects read once, those outside
/// `selection` on which the sweep's field manager owns conditions cleaned, [`CONCURRENCY`] at a
/// time. `failed` counts the nodes left as they were.
///
/// Cost at 65,000 Nodes (a previous selector that selected all of them): one streamed pass over
/// the API server's Node cache (WatchList), or 130 pages of [`SCAN_PAGE`] (about 4 million object
/// visits, a fifth of one paged Node-watch listing at 100 a page, `shared::lists`); metadata
/// only, a few KiB a Node with its managedFields, decoded one at a time (or a page, ~2.5 MiB, at
/// a time) and dropped. Only the name and resourceVersion of a node to clean are kept (tens of
/// bytes). Then one write per node to clean, [`CONCURRENCY`] at a time: 65,000 of them at about
/// 20 ms each take under 3 minutes. Only when the selector changed since the last start, and
/// after the fleet's own initial list, so the two big reads do not overlap.
async fn scan(ctx: &Context, previous: &LabelSelector, selection: &LabelSelector) -> ScanTotals {
    let started = Instant::now();
    let api: Api<Node> = Api::all(ctx.client.clone());
    let config = match lists::mode() {
        lists::Mode::Stream => lists::nodes(),
        lists::Mode::Pages => watcher::Config::default().page_size(SCAN_PAGE),
    };
    // Only the nodes the previous selector selected (all of them, if it was empty).
    let config = config.labels(&previous.to_query());
    // `Api<PartialObjectMeta<_>>` asks for metadata only.
    let metadata: Api<PartialObjectMeta<Node>> = Api::all(ctx.client.clone());
    let stream = watcher(metadata, config).default_backoff();
    futures::pin_mut!(stream);
    let mut totals = ScanTotals::default();
    // (name, resourceVersion) of each node to clean.
    let mut found: Vec<(String, String)> = Vec::new();
    loop {
        match stream.try_next().await {
            Ok(Some(watcher::Event::InitApply(partial))) => {
                totals.seen += 1;
                let meta = partial.metadata;
                if !to_remove(selection, &meta).is_empty() {
                    found.push((
                        meta.name.unwrap_or_default(),
                        meta.resource_version.unwrap_or_default(),
                    ));
                }
            }
            Ok(Some(watcher::Event::Init)) => {
                totals.seen = 0;
                found.clear();
            }
            Ok(Some(watcher::Event::InitDone) | None) => break,
            // Past the initial list: the watch's own events are the Node watch's business.
            Ok(Some(_)) => {}
            Err(error) => {
                warn!(%error, "reading the Nodes outside --node-selector failed; retrying with backoff")
            }
        }
    }
    totals.found = found.len();
    info!(
        nodes = totals.seen,
        outside_with_conditions = totals.found,
        seconds = started.elapsed().as_secs_f64(),
        "nodes outside --node-selector read"
    );
    if found.is_empty() {
        return totals;
    }
    let api = &api;
    let mut outcomes = futures::stream::iter(found)
        .map(|(name, version)| async move {
            let outcome = clean(api, selection, &name, Some(version)).await;
            (name, outcome)
        })
        .buffer_unordered(CONCURRENCY);
    let mut done = 0;
    while let Some((name, outcome)) = outcomes.next().await {
        log(&name, "at start", &outcome);
        match outcome {
            Outcome::Removed(_) => totals.removed += 1,
            Outcome::Failed(_) => totals.failed += 1,
            _ => {}
        }
        done += 1;
        if done % PROGRESS_EVERY == 0 {
            info!(
                done,
                of = totals.found,
                removed = totals.removed,
                failed = totals.failed,
                "cleaning nodes outside --node-selector"
            );
        }
    }
    info!(
        nodes = totals.found,
        removed = totals.removed,
        failed = totals.failed,
        seconds = started.elapsed().as_secs_f64(),
        "nodes outside --node-selector cleaned"
    );
    totals
}

/// Once per leadership start: reads the record of the previous selector, scans the nodes it
/// selected when the selector changed, and records the selector in force once they are clean
/// (a scan that left a node as it was is done again by the next start).
async fn start(ctx: &Context, selection: Option<&LabelSelector>) {
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    // The Lease this replica holds (its name is the runtime's `--lease-name`): one small list.
    let held = match leases.list(&ListParams::default()).await {
        Ok(list) => list.items.into_iter().find(|lease| {
            lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref())
                == Some(ctx.identity.as_str())
        }),
        Err(error) => {
            warn!(%error, namespace = %ctx.namespace, "reading the leader Lease failed; nodes that left --node-selector while no controller ran keep the sweep's conditions until the next start");
            return;
        }
    };
    let Some(lease) = held else {
        warn!(namespace = %ctx.namespace, identity = %ctx.identity, "no Lease held by this replica; the --node-selector in force is not recorded");
        return;
    };
    let query = selection.map(LabelSelector::to_query).unwrap_or_default();
    let mut clean = true;
    if let Some(current) = selection
        && let Some(previous) = to_scan(recorded(Some(&lease)), selection)
    {
        info!(previous = %previous.to_query(), now = %query, "--node-selector changed; removing the sweep's conditions from the nodes it no longer selects");
        clean = scan(ctx, &previous, current).await.failed == 0;
    }
    if !clean {
        return;
    }
    // Written by the leader's next renewal (within `--retry-period`), not by a write of its
    // own: a second writer on the Lease would cost the renewal a conflict and a read.
    ctx.lease_annotations
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(RECORD_ANNOTATION.to_owned(), query);
}

/// Runs until `shutdown`: the start ([`start`]), then the nodes the Node watch may have lost.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        () = ctx.fleet.wait_synced() => {}
    }
    // Set by the Node watch before its first event.
    let selection = ctx.fleet.selection();
    if unless_stopped(&shutdown, start(&ctx, selection.as_ref()))
        .await
        .is_none()
    {
        return;
    }
    // Every Node selected: none can leave.
    let Some(selection) = selection else {
        return;
    };
    let api: Api<Node> = Api::all(ctx.client.clone());
    // Nodes that left, read once more at the instant given (see the module doc).
    let mut again: VecDeque<(tokio::time::Instant, String)> = VecDeque::new();
    loop {
        let next = again.front().map(|(at, _)| *at);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = ctx.fleet.wait_maybe_left() => {}
            () = tokio::time::sleep_until(next.unwrap_or_else(tokio::time::Instant::now)), if next.is_some() => {}
        }
        let now = tokio::time::Instant::now();
        let mut work: Vec<(String, bool)> = ctx
            .fleet
            .take_maybe_left()
            .into_iter()
            .map(|name| (name, false))
            .collect();
        while again.front().is_some_and(|(at, _)| *at <= now) {
            let (_, name) = again.pop_front().expect("checked");
            if !work.iter().any(|(n, _)| *n == name) {
                work.push((name, true));
            }
        }
        let (selection, api) = (&selection, &api);
        let batch = futures::stream::iter(work)
            .map(|(name, second)| async move {
                let outcome = clean(api, selection, &name, None).await;
                (name, second, outcome)
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<_>>();
        let Some(outcomes) = unless_stopped(&shutdown, batch).await else {
            return;
        };
        let settle_at = tokio::time::Instant::now() + SETTLE;
        for (name, second, outcome) in outcomes {
            log(&name, if second { "again" } else { "left" }, &outcome);
            if !second && outcome.unselected() {
                again.push_back((settle_at, name));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(labels: serde_json::Value, managed: serde_json::Value) -> ObjectMeta {
        serde_json::from_value(json!({
            "name": "n1",
            "resourceVersion": "7",
            "labels": labels,
            "managedFields": managed,
        }))
        .unwrap()
    }

    fn entry(manager: &str, subresource: &str, types: &[&str]) -> serde_json::Value {
        let conditions: serde_json::Map<String, serde_json::Value> = types
            .iter()
            .map(|t| {
                (
                    format!("k:{{\"type\":\"{t}\"}}"),
                    json!({".": {}, "f:status": {}}),
                )
            })
            .collect();
        json!({
            "manager": manager,
            "operation": if manager == conditions::FIELD_MANAGER { "Apply" } else { "Update" },
            "subresource": subresource,
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:conditions": conditions}},
        })
    }

    fn selection(selector: &str) -> LabelSelector {
        nodekeeper_api::selector::parse(selector).unwrap()
    }

    #[test]
    fn only_unselected_nodes_with_the_sweeps_conditions_are_cleaned() {
        let sweep = conditions::FIELD_MANAGER;
        let managed = json!([
            entry("kubelet", "status", &["Ready", "MemoryPressure"]),
            entry(sweep, "status", &["NodekeeperReachable", "KernelDeadlock"]),
            entry(
                "nodekeeper-nodemaintenance",
                "status",
                &["MaintenanceScheduled"]
            ),
        ]);
        let sel = selection("pool=gpu,!spot");
        let want: BTreeSet<String> = ["KernelDeadlock", "NodekeeperReachable"]
            .map(str::to_owned)
            .into();
        // Left the selection: its label changed, or a label it must not carry was added.
        for labels in [
            json!({"pool": "cpu"}),
            json!({}),
            json!({"pool": "gpu", "spot": ""}),
        ] {
            assert_eq!(
                to_remove(&sel, &meta(labels.clone(), managed.clone())),
                want,
                "{labels}"
            );
        }
        // Selected: the sweep's.
        assert!(to_remove(&sel, &meta(json!({"pool": "gpu"}), managed.clone())).is_empty());
        // Unselected, but the sweep never wrote it: only other managers' conditions.
        let others = json!([
            entry("kubelet", "status", &["Ready"]),
            entry(
                "nodekeeper-nodemaintenance",
                "status",
                &["MaintenanceScheduled"]
            ),
            // The sweep's manager, but not its status apply (never the case; not its conditions).
            entry(sweep, "", &["NodekeeperReachable"]),
        ]);
        assert!(to_remove(&sel, &meta(json!({"pool": "cpu"}), others)).is_empty());
        assert!(to_remove(&sel, &meta(json!({"pool": "cpu"}), json!(null))).is_empty());
    }

    #[test]
    fn only_a_changed_selector_is_scanned_and_only_its_nodes() {
        let record = |text: Option<&str>| -> Lease {
            serde_json::from_value(json!({
                "metadata": {"name": "nodekeeper-controller", "annotations": text.map(|t| json!({RECORD_ANNOTATION: t}))},
            }))
            .unwrap()
        };
        let (wide, narrow) = (selection("pool"), selection("pool in (gpu)"));
        assert_eq!(recorded(Some(&record(Some("pool")))), Some(wide.clone()));
        assert_eq!(
            recorded(Some(&record(Some("")))),
            Some(LabelSelector::default())
        );
        assert_eq!(recorded(Some(&record(None))), None);
        assert_eq!(recorded(Some(&record(Some("a=b,,c")))), None);
        assert_eq!(recorded(None), None);
        // Narrowed: the nodes the previous selector selected are read.
        assert_eq!(
            to_scan(Some(wide.clone()), Some(&narrow)),
            Some(wide.clone())
        );
        // From every Node to some: every Node is read.
        assert_eq!(
            to_scan(Some(LabelSelector::default()), Some(&narrow)),
            Some(LabelSelector::default())
        );
        // Unchanged, widened to every Node, or never recorded: nothing.
        assert_eq!(to_scan(Some(narrow.clone()), Some(&narrow)), None);
        assert_eq!(to_scan(Some(narrow.clone()), None), None);
        assert_eq!(to_scan(None, Some(&narrow)), None);
        // Written as the query syntax, it reads back the same.
        assert_eq!(
            recorded(Some(&record(Some(&narrow.to_query())))),
            Some(narrow)
        );
    }

    #[test]
    fn the_release_lists_no_conditions_and_is_conditional() {
        let body = release_body("n1", "42");
        assert_eq!(body["metadata"]["resourceVersion"], "42");
        assert_eq!(body["kind"], "Node");
        // No `status` at all: the apply owns nothing, so every condition it owned is released.
        assert!(body.get("status").is_none(), "{body}");
    }

    #[test]
    fn an_outcome_outside_the_selection_is_read_once_more() {
        assert!(Outcome::Clean.unselected());
        assert!(Outcome::Removed(BTreeSet::new()).unselected());
        assert!(!Outcome::Gone.unselected());
        assert!(!Outcome::Selected.unselected());
        assert!(!Outcome::Failed(String::new()).unselected());
    }
}
