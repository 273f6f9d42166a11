//! The controllers, one folder each, and the one way they are started.
//!
//! A watch-reconcile controller is a folder `controllers/<name>/` whose `Context` (what its
//! reconcile needs: client, agents, configuration, …) implements [`Reconciler`]: the watched
//! kind, a fixed `NAME`, `reconcile(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action, Error>` and
//! `error_policy`. [`start`] runs it with kube's `Controller`, and gives every controller the
//! same span per reconcile (`controller`, `object`, `namespace` as fields), the same reconcile
//! metrics (`nodekeeper_reconcile_{runs,failures}_total` and `nodekeeper_reconcile_seconds`,
//! labelled by controller name only) and graceful shutdown on the token.
//!
//! # Adding a controller
//!
//! 1. Create `controllers/<name>/mod.rs` with its `Context`, `reconcile`, `error_policy` and
//!    `impl Reconciler for Context`; business logic goes in plain functions beside it. If it has
//!    flags, give it a `#[derive(clap::Args)] #[group(id = "<name>")] Config` (a unique group
//!    id: clap refuses two groups of the same name) and add it as a field of [`Config`] here
//!    (flags `--<name>-…`, env `NODEKEEPER_<NAME>_…`).
//! 2. Add `pub mod <name>;` below and ONE registration line in [`Controllers::start`]:
//!    `r.add(<name>::Context::new(shared, &config.<name>));`, and its `NAME` to [`NAMES`] (what
//!    `--controllers` accepts; a test checks the list against the controllers).
//!
//! Nothing else in the crate changes: the runtime calls [`Controllers::start`] once this replica
//! leads, and stops everything through the token when it no longer does. (Outside the crate, a
//! new watched kind needs its RBAC rules in `deploy/controller/controller.yaml`.)
//!
//! # The one exception: the node sweep
//!
//! [`nodes`] is not a watch-reconcile controller: it is a scheduler over the agents (every node's
//! agent read on a jittered interval, conditions written on change), fed by the fleet's Node
//! watch in [`crate::shared::fleet`]. It is started from the same place, as its own task.

pub mod kube_node;
pub mod networktest;
pub mod node_diagnostic;
pub mod node_maintenance;
pub mod node_network_config;
pub mod node_set;
pub mod nodes;

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt as _;
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, reflector};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument as _, info, warn};

use crate::shared::Shared;
use crate::shared::metrics::ReconcileMetrics;

/// Every controller's flags, flattened into the command line.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "controllers")]
pub struct Config {
    /// Which watch-reconcile controllers run, as kube-controller-manager's flag of the same
    /// name: `*` (all, the default), names (`networktest,nodemaintenance`), or `*` with some
    /// turned off (`*,-nodeset`). Names: networktest, nodemaintenance, nodediagnostic,
    /// nodenetworkconfig, nodeset, kubenode. The node sweep always runs. A controller that is
    /// off watches nothing: its objects are left as they are.
    #[arg(
        id = "enabled_controllers",
        long = "controllers",
        env = "NODEKEEPER_CONTROLLERS",
        value_delimiter = ',',
        default_value = "*"
    )]
    pub enabled: Vec<String>,
    #[command(flatten)]
    pub networktest: networktest::Config,
    #[command(flatten)]
    pub node_maintenance: node_maintenance::Config,
    #[command(flatten)]
    pub node_diagnostic: node_diagnostic::Config,
    #[command(flatten)]
    pub node_network_config: node_network_config::Config,
    #[command(flatten)]
    pub node_set: node_set::Config,
}

/// The names `--controllers` takes, each a controller's [`Reconciler::NAME`].
pub const NAMES: [&str; 6] = [
    "networktest",
    "nodemaintenance",
    "nodediagnostic",
    "nodenetworkconfig",
    "nodeset",
    "kubenode",
];

impl Config {
    /// Refuses an unknown name in `--controllers`, naming the known ones.
    pub fn check(&self) -> Result<(), String> {
        for item in &self.enabled {
            let name = item.trim().trim_start_matches('-');
            if name != "*" && !NAMES.contains(&name) {
                return Err(format!(
                    "--controllers: unknown controller {name:?}; the names are {}, or * for all",
                    NAMES.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// Whether `--controllers` turns on the controller `name`: named, or `*` and not `-name`.
    pub fn runs(&self, name: &str) -> bool {
        let items: Vec<&str> = self.enabled.iter().map(|i| i.trim()).collect();
        let off = items.iter().any(|i| i.strip_prefix('-') == Some(name));
        !off && items.iter().any(|i| *i == "*" || *i == name)
    }
}

/// A watch-reconcile controller, implemented by its `Context`.
pub trait Reconciler: Send + Sync + Sized + 'static {
    /// The watched kind.
    type Object: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static;
    type Error: std::error::Error + Send + Sync + 'static;
    /// Fixed name: the `controller` label of the reconcile metrics and field of the span.
    const NAME: &'static str;
    /// Whether its reconciles call agents. Such a controller starts once the fleet's initial
    /// Node list is read: before that, a managed node missing from the fleet would be refused as
    /// not managed (a failover at 65,000 nodes reads that list for minutes).
    const CALLS_AGENTS: bool = false;

    /// Where the watched objects are (all namespaces or one).
    fn api(&self) -> Api<Self::Object>;
    /// Which objects are watched.
    fn watcher_config(&self) -> watcher::Config {
        watcher::Config::default()
    }
    /// Objects reconciled at once.
    fn concurrency(&self) -> u16;
    /// Whether the controller caches `obj` and reconciles it. An object it does not keep must
    /// be one whose reconcile would do nothing: it leaves the cache (an update that settles it
    /// reads as its deletion) and comes back with the change that gives it work. Every object
    /// by default; kubenode, which must watch every Node to find the few it acts on, keeps those
    /// few, where its cache held all 10,000 (about 0.7 KiB a Node).
    fn keeps(&self, _obj: &Self::Object) -> bool {
        true
    }
    /// Other events that wake every object up (e.g. watches of other kinds whose changes
    /// concern the objects; kube's per-object `reconcile_on` is still an unstable feature);
    /// polled while the controller runs. None by default.
    fn reconcile_all_on(&self) -> Option<futures::stream::BoxStream<'static, ()>> {
        None
    }
    /// Sees every watch event (the initial lists' `Init`, `InitApply` and `InitDone` too) as
    /// the cache will, before it does; called on the controller's task, so it must not block.
    /// For what a reconcile in flight cannot learn otherwise: kube runs no second reconcile of
    /// an object while one is in flight, so that one is not told of its object's changes (its
    /// deletion, say) but by reading the object again. Nothing by default.
    fn observe(&self, _event: &watcher::Event<Self::Object>) {}
    /// Work done once per start, after the watch's first initial list is read: so also when it
    /// lists no object and no reconcile ever runs (cleaning up after objects deleted while
    /// another replica led, say). It runs beside the reconciles and is dropped with them when
    /// `shutdown` fires. Nothing by default.
    fn after_initial_list(_ctx: Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        async {}
    }
    fn reconcile(
        obj: Arc<Self::Object>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Self::Error>> + Send + 'static;
    fn error_policy(obj: Arc<Self::Object>, error: &Self::Error, ctx: Arc<Self>) -> Action;
}

/// Runs controller `C` until `shutdown`: each reconcile in a span naming the object, counted and
/// timed in `metrics` under `C::NAME`. A reconcile in flight when `shutdown` fires is dropped
/// where it waits: a replica that no longer leads must not go on writing (the standby may lead
/// `--lease-duration` − `--renew-deadline` after the give-up), and every reconcile is written to
/// be picked up again from the objects' state by the next leader.
pub async fn start<C: Reconciler>(
    ctx: Arc<C>,
    metrics: ReconcileMetrics,
    shutdown: CancellationToken,
) {
    let config = ControllerConfig::default().concurrency(ctx.concurrency().max(1));
    let objects = metrics.objects.clone();
    let stop = shutdown.clone();
    let reconcile = move |obj: Arc<C::Object>, ctx: Arc<C>| {
        let span = tracing::info_span!(
            "reconcile",
            controller = C::NAME,
            object = %obj.name_any(),
            namespace = obj.namespace().unwrap_or_default(),
        );
        let metrics = metrics.clone();
        let stop = stop.clone();
        async move {
            let started = Instant::now();
            let Some(result) = unless_stopped(&stop, C::reconcile(obj, ctx)).await else {
                info!("reconcile stopped: this replica no longer leads");
                return Ok(Action::await_change());
            };
            metrics.record(C::NAME, result.is_ok(), started.elapsed().as_secs_f64());
            result
        }
        .instrument(span)
    };
    info!(controller = C::NAME, "controller starting");
    // `Controller::new`'s own watch → reflector → trigger chain, with `keeps` between the watch
    // and the cache (`for_stream` is behind kube's `unstable-runtime-stream-control`).
    let (reader, writer) = reflector::store();
    let filter = Arc::clone(&ctx);
    // Fired at the end of the first initial list, for `after_initial_list`.
    let (listed, first_list) = tokio::sync::oneshot::channel::<()>();
    let mut listed = Some(listed);
    let events = watcher::watcher(ctx.api(), ctx.watcher_config()).filter_map(move |event| {
        let event = match event {
            Ok(watcher::Event::InitApply(obj)) if !filter.keeps(&obj) => None,
            Ok(watcher::Event::Apply(obj)) if !filter.keeps(&obj) => {
                Some(Ok(watcher::Event::Delete(obj)))
            }
            event => Some(event),
        };
        if let Some(Ok(event)) = &event {
            filter.observe(event);
            if matches!(event, watcher::Event::InitDone)
                && let Some(listed) = listed.take()
            {
                let _ = listed.send(());
            }
        }
        futures::future::ready(event)
    });
    // Ends with the watch (its sender dropped) if the list never completes.
    let after_list = {
        let (ctx, stop) = (Arc::clone(&ctx), shutdown.clone());
        async move {
            if first_list.await.is_ok() {
                unless_stopped(&stop, C::after_initial_list(ctx)).await;
            }
        }
    };
    let triggers = reflector(writer, events).applied_objects();
    let mut controller = Controller::for_stream(triggers, reader).with_config(config);
    // Status gauges from this controller's own cache, until it stops (metrics::ObjectStatus).
    let _status_gauges = objects.track(controller.store());
    if let Some(trigger) = ctx.reconcile_all_on() {
        controller = controller.reconcile_all_on(trigger);
    }
    let run = controller
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, C::error_policy, ctx)
        .for_each(|result| {
            // Reconcile errors are logged by each error_policy; a failing watch would otherwise
            // retry (with backoff) in silence. A 403 here carries the API server's "cannot
            // <verb> resource <resource>", naming what the ClusterRole lacks.
            if let Err(kube::runtime::controller::Error::QueueError(error)) = result {
                warn!(controller = C::NAME, %error, "watch failed; retrying with backoff");
            }
            futures::future::ready(())
        });
    futures::future::join(run, after_list).await;
    info!(controller = C::NAME, "controller stopped");
}

/// `reconcile`'s output, or `None` once `stop` fires first: the reconcile is dropped where it
/// waits (an agent call, an API request), and what it did not do is left to the next leader.
pub(crate) async fn unless_stopped<F: Future>(
    stop: &CancellationToken,
    reconcile: F,
) -> Option<F::Output> {
    tokio::select! {
        biased;
        () = stop.cancelled() => None,
        output = reconcile => Some(output),
    }
}

/// State of the controllers that outlives leadership (served by the HTTP API on a standby too),
/// and the registration of every controller.
#[derive(Default)]
pub struct Controllers {
    networktest_results: networktest::ResultsStore,
    diagnostic_bundles: node_diagnostic::BundleStore,
}

impl Controllers {
    /// The routes controllers add to the HTTP API.
    pub fn router(&self) -> axum::Router {
        networktest::store::router(self.networktest_results.clone())
            .merge(self.diagnostic_bundles.router())
    }

    /// Starts every controller under `tracker`; each stops when `shutdown` fires. Called once
    /// this replica leads and the agent certificates are loaded.
    pub fn start(
        &self,
        shared: &Shared,
        config: &Config,
        tracker: &TaskTracker,
        shutdown: &CancellationToken,
    ) {
        // The one exception (see the module doc): the sweep schedules agent reads itself.
        let sweep = Arc::new(nodes::Context::new(shared));
        let run = nodes::sweep::run(Arc::clone(&sweep), shutdown.child_token());
        tracker.spawn(run.instrument(tracing::info_span!("sweep")));
        let gauges = nodes::condition_gauges(sweep, shutdown.child_token());
        tracker.spawn(gauges.instrument(tracing::info_span!("condition_gauges")));
        // Nodes outside --node-selector lose the sweep's conditions (nothing without a selector).
        let unselected = nodes::unselected::Context::new(shared);
        let run = nodes::unselected::run(Arc::new(unselected), shutdown.child_token());
        tracker.spawn(run.instrument(tracing::info_span!("unselected_nodes")));

        // Watch-reconcile controllers: one registration line each.
        let r = Registrar {
            shared,
            tracker,
            shutdown,
            config,
        };
        r.add(networktest::Context::new(
            shared,
            &config.networktest,
            &self.networktest_results,
        ));
        r.add(node_maintenance::Context::new(
            shared,
            &config.node_maintenance,
        ));
        r.add(node_diagnostic::Context::new(
            shared,
            &config.node_diagnostic,
            &self.diagnostic_bundles,
        ));
        r.add(node_network_config::Context::new(
            shared,
            &config.node_network_config,
        ));
        r.add(node_set::Context::new(
            shared,
            &config.node_set,
            &config.node_network_config.cloud,
        ));
        r.add(kube_node::Context::for_cluster(
            shared,
            &config.node_network_config.cloud,
            config.node_set.cluster_id.as_deref(),
        ));
    }
}

/// Starts watch-reconcile controllers with [`start`] under the runtime's tracker and token.
struct Registrar<'a> {
    shared: &'a Shared,
    tracker: &'a TaskTracker,
    shutdown: &'a CancellationToken,
    config: &'a Config,
}

impl Registrar<'_> {
    fn add<C: Reconciler>(&self, ctx: C) {
        if !self.config.runs(C::NAME) {
            info!(controller = C::NAME, "controller off (--controllers)");
            return;
        }
        let metrics = self.shared.metrics.reconcile.clone();
        let shutdown = self.shutdown.child_token();
        let fleet = C::CALLS_AGENTS.then(|| Arc::clone(&self.shared.fleet));
        self.tracker.spawn(async move {
            if let Some(fleet) = fleet {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = fleet.wait_synced() => {}
                }
            }
            start(Arc::new(ctx), metrics, shutdown).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(flag: &[&str]) -> Config {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            controllers: Config,
        }
        let args = std::iter::once("x").chain(flag.iter().copied());
        <Cli as clap::Parser>::try_parse_from(args)
            .unwrap()
            .controllers
    }

    #[tokio::test]
    async fn a_reconcile_in_flight_is_dropped_when_leadership_ends() {
        let stop = CancellationToken::new();
        assert_eq!(unless_stopped(&stop, async { 7 }).await, Some(7));
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let flag = Flag(Arc::clone(&dropped));
        let slow = async move {
            let _flag = flag;
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
            1
        };
        let canceller = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            canceller.cancel();
        });
        let started = Instant::now();
        assert_eq!(unless_stopped(&stop, slow).await, None);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn controllers_are_picked_as_kube_controller_manager_picks_them() {
        let all = config(&[]);
        assert!(NAMES.iter().all(|n| all.runs(n)));
        let some = config(&["--controllers=networktest,nodemaintenance"]);
        assert!(some.runs("networktest") && some.runs("nodemaintenance"));
        assert!(!some.runs("nodeset"));
        let but = config(&["--controllers=*,-nodeset,-nodenetworkconfig"]);
        assert!(but.runs("networktest") && !but.runs("nodeset") && !but.runs("nodenetworkconfig"));
        for c in [&all, &some, &but] {
            c.check().unwrap();
        }
        let e = config(&["--controllers=*,-nodesets"]).check().unwrap_err();
        assert!(e.contains("\"nodesets\"") && e.contains("nodeset,"), "{e}");
    }

    #[test]
    fn the_names_are_the_controllers_own() {
        assert_eq!(
            NAMES,
            [
                <networktest::Context as Reconciler>::NAME,
                <node_maintenance::Context as Reconciler>::NAME,
                <node_diagnostic::Context as Reconciler>::NAME,
                <node_network_config::Context as Reconciler>::NAME,
                <node_set::Context as Reconciler>::NAME,
                <kube_node::Context as Reconciler>::NAME,
            ]
        );
    }
}
