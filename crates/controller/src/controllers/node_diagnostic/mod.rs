//! The `NodeDiagnostic` controller: troubleshooting bundles from the agents of the nodes a
//! NodeDiagnostic names, kept on the controller's own disk (never in etcd) and served by its HTTP
//! API. Files: the reconciler (`reconcile`), the status it writes as plain functions (`status`),
//! one node's stream to disk with its SHA-256 (`collect`), the bounded store with the
//! download route (`store`), and the collections that the watch's news of a deletion stops
//! (`deletions`). This file holds the [`Context`] and the [`Config`] (flags).
//!
//! Download, through the API server's service proxy, from the path in the NodeDiagnostic's
//! `status.nodes[].downloadPath` (it ends in the bundle's download token, see [`store`]):
//! `kubectl get --raw /api/v1/namespaces/nodekeeper/services/nodekeeper-controller:http/proxy/api/diagnostics/<ns>/<name>/<node>/<token> > bundle.tar.gz`

pub mod collect;
pub mod deletions;
pub mod reconcile;
pub mod status;
pub mod store;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Api;
use kube::runtime::controller::Action;
use kube::runtime::watcher;
use nodekeeper_api::crd::NodeDiagnostic;
use tokio::sync::watch;
use tracing::warn;

pub use reconcile::{Error, error_policy, reconcile};
pub use store::BundleStore;

use super::Reconciler;
use crate::shared::{Agents, Shared, TuningState};

/// The NodeDiagnostic controller's flags.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "node_diagnostic")]
pub struct Config {
    /// Directory for diagnostics bundles on the controller's own disk (an emptyDir in the
    /// Deployment); created on first use.
    #[arg(
        long,
        env = "NODEKEEPER_DIAGNOSTICS_DIR",
        default_value = "/var/lib/nodekeeper/diagnostics"
    )]
    pub diagnostics_dir: PathBuf,

    /// Total bytes of bundles kept in `--diagnostics-dir`; the oldest bundles of other
    /// NodeDiagnostics are evicted to make room, and a bundle that still does not fit fails
    /// (evicting nothing).
    #[arg(
        long,
        env = "NODEKEEPER_DIAGNOSTICS_MAX_BYTES",
        default_value_t = 2 * 1024 * 1024 * 1024
    )]
    pub diagnostics_max_bytes: u64,

    /// Bundles streamed at once by one NodeDiagnostic.
    #[arg(long, env = "NODEKEEPER_DIAGNOSTICS_CONCURRENCY", default_value_t = 8)]
    pub diagnostics_concurrency: usize,

    /// NodeDiagnostics collected at once.
    #[arg(
        long,
        env = "NODEKEEPER_NODEDIAGNOSTIC_CONCURRENCY",
        default_value_t = 2
    )]
    pub nodediagnostic_concurrency: u16,

    /// Longest time one node's bundle may take to arrive.
    #[arg(long, env = "NODEKEEPER_DIAGNOSTICS_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub diagnostics_timeout: Duration,
}

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

/// What the reconciler needs.
pub struct Context {
    pub client: kube::Client,
    pub agent_port: u16,
    pub agents: Arc<dyn Agents>,
    /// The tuning in force: bundle cap and default parts.
    pub tuning: watch::Receiver<Arc<TuningState>>,
    pub store: BundleStore,
    /// Bundles streamed at once per NodeDiagnostic.
    pub agent_concurrency: usize,
    pub object_concurrency: u16,
    /// Per-node deadline.
    pub timeout: Duration,
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
    /// The NodeDiagnostics this process finished, by UID, with their final status: the watch may
    /// still show the Running status (written before the final one), or writing the final one
    /// failed and is retried from here; either way they are not collected again.
    pub finished: Mutex<HashMap<String, reconcile::Finished>>,
    /// Set once the store was swept of the bundles of deleted NodeDiagnostics, before the first
    /// collection of this leadership (see `BundleStore::sweep`), by the first reconcile or, with
    /// none, after the watch's first list (`reconcile::sweep_at_start`).
    pub swept: tokio::sync::OnceCell<()>,
    /// The collections in flight, stopped by the watch's news of their object's deletion.
    pub deletions: deletions::Deletions,
}

impl Context {
    /// The controller's context in the running controller-manager; configures `store` (whose
    /// download route the HTTP API already serves) with the flags.
    pub fn new(shared: &Shared, config: &Config, store: &BundleStore) -> Self {
        if let Err(error) = store.configure(&config.diagnostics_dir, config.diagnostics_max_bytes) {
            warn!(%error, dir = %config.diagnostics_dir.display(), "diagnostics store not usable; bundles will fail");
        }
        Self {
            client: shared.client.clone(),
            agent_port: shared.agent_port,
            agents: shared.agents(),
            tuning: shared.tuning.clone(),
            store: store.clone(),
            agent_concurrency: config.diagnostics_concurrency,
            object_concurrency: config.nodediagnostic_concurrency,
            timeout: config.diagnostics_timeout,
            namespace: None,
            finished: Mutex::default(),
            swept: tokio::sync::OnceCell::new(),
            deletions: deletions::Deletions::default(),
        }
    }
}

impl Reconciler for Context {
    type Object = NodeDiagnostic;
    type Error = Error;
    const NAME: &'static str = "nodediagnostic";
    const CALLS_AGENTS: bool = true;

    fn api(&self) -> Api<NodeDiagnostic> {
        match &self.namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::all(self.client.clone()),
        }
    }

    fn concurrency(&self) -> u16 {
        self.object_concurrency
    }

    /// A deletion stops its object's collection in flight (see `deletions`).
    fn observe(&self, event: &watcher::Event<NodeDiagnostic>) {
        self.deletions.observe(event);
    }

    /// The store swept once the NodeDiagnostics are listed, with or without a reconcile.
    fn after_initial_list(ctx: Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        reconcile::sweep_at_start(ctx)
    }

    fn reconcile(
        obj: Arc<NodeDiagnostic>,
        ctx: Arc<Self>,
    ) -> impl Future<Output = Result<Action, Error>> + Send + 'static {
        reconcile(obj, ctx)
    }

    fn error_policy(obj: Arc<NodeDiagnostic>, error: &Error, ctx: Arc<Self>) -> Action {
        error_policy(obj, error, ctx)
    }
}

/// The controller as the scaffold runs it (`controllers::start`), against a fake API server on
/// 127.0.0.1 that lists and watches NodeDiagnostics and records every request: what happens at a
/// leadership start with no NodeDiagnostic, and while a bundle streams.
#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use axum::body::{Body, Bytes};
    use axum::extract::{Request, State};
    use axum::http::{Method, StatusCode, header};
    use axum::response::{IntoResponse as _, Response};
    use futures::StreamExt as _;
    use futures::future::BoxFuture;
    use nodekeeper_api::names::API_VERSION;
    use nodekeeper_proto::agent::v1 as pb;
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::shared::AgentNode;
    use crate::shared::agent_client::CallError;
    use crate::shared::agents::{DiagnosticsStream, Report, ReportRequest};
    use crate::shared::metrics::{ControllerLabels, ReconcileMetrics};

    const PATH: &str = "/apis/nodekeeper.dev/v1alpha1";

    /// What the fake API server holds and saw.
    #[derive(Default)]
    struct Fake {
        /// The NodeDiagnostics listed.
        objects: Vec<serde_json::Value>,
        /// Lines the first watch streams (JSON watch events); later watches stay silent.
        events: StdMutex<Option<mpsc::UnboundedReceiver<Bytes>>>,
        /// `<method> <path>` of every request.
        requests: StdMutex<Vec<String>>,
    }

    fn json(value: &serde_json::Value) -> Response {
        (
            [(header::CONTENT_TYPE, "application/json")],
            value.to_string(),
        )
            .into_response()
    }

    async fn answer(State(fake): State<Arc<Fake>>, request: Request) -> Response {
        let (method, uri) = (request.method().clone(), request.uri().clone());
        let query = uri.query().unwrap_or_default();
        fake.requests
            .lock()
            .unwrap()
            .push(format!("{method} {}", uri.path()));
        let metadata_only = request.headers().get(header::ACCEPT).is_some_and(|a| {
            a.to_str()
                .unwrap_or_default()
                .contains("PartialObjectMetadata")
        });
        let path = uri.path();
        if path == format!("{PATH}/nodediagnostics") && query.contains("watch=true") {
            let events = fake.events.lock().unwrap().take();
            let silent = futures::stream::pending::<Result<Bytes, std::io::Error>>();
            let lines = match events {
                Some(rx) => lines_of(rx).chain(silent).boxed(),
                None => silent.boxed(),
            };
            return Body::from_stream(lines).into_response();
        }
        if path == format!("{PATH}/nodediagnostics") {
            let (api_version, kind, items) = if metadata_only {
                let items = fake.objects.iter().map(|o| {
                    serde_json::json!({
                        "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                        "metadata": o["metadata"],
                    })
                });
                (
                    "meta.k8s.io/v1",
                    "PartialObjectMetadataList",
                    items.collect::<Vec<_>>(),
                )
            } else {
                (API_VERSION, "NodeDiagnosticList", fake.objects.clone())
            };
            let list = serde_json::json!({
                "apiVersion": api_version, "kind": kind,
                "metadata": {"resourceVersion": "2"}, "items": items,
            });
            return json(&list);
        }
        if path == "/api/v1/nodes/n1" {
            return json(&serde_json::json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "uid": "node-u1"},
                "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]},
            }));
        }
        // The object as listed, to a read (the collection must not need one) or a write.
        let object = format!("{PATH}/namespaces/ns/nodediagnostics/d");
        if (method == Method::GET && path == object)
            || (method == Method::PATCH && path.starts_with(&object))
        {
            return json(&fake.objects[0]);
        }
        let status = serde_json::json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "NotFound",
            "code": 404, "message": format!("{method} {path}: not served by this fake"),
        });
        (StatusCode::NOT_FOUND, json(&status)).into_response()
    }

    fn lines_of(
        mut rx: mpsc::UnboundedReceiver<Bytes>,
    ) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|line| line.map(Ok)))
    }

    /// Serves `fake` on 127.0.0.1; a client of it.
    async fn serve(fake: Arc<Fake>) -> kube::Client {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new().fallback(answer).with_state(fake);
        tokio::spawn(async move { axum::serve(listener, router).await });
        let url = format!("http://{addr}").parse().unwrap();
        kube::Client::try_from(kube::Config::new(url)).unwrap()
    }

    /// Agents whose bundle streams never end; `open` counts the streams alive.
    struct StuckAgents {
        open: Arc<()>,
        opened: tokio::sync::Notify,
    }

    impl Agents for StuckAgents {
        fn report<'a>(
            &'a self,
            _node: &'a AgentNode,
            _request: ReportRequest<'a>,
            _timeout: Duration,
        ) -> BoxFuture<'a, Report> {
            Box::pin(futures::future::pending::<Report>())
        }
        fn run_probes<'a>(
            &'a self,
            _node: &'a AgentNode,
            _request: pb::RunProbesRequest,
            _timeout: Duration,
        ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>> {
            Box::pin(futures::future::pending::<
                Result<pb::RunProbesResponse, CallError>,
            >())
        }
        fn apply_network<'a>(
            &'a self,
            _node: &'a AgentNode,
            _request: pb::ApplyNetworkRequest,
            _timeout: Duration,
        ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>> {
            Box::pin(futures::future::pending::<
                Result<pb::ApplyNetworkResponse, CallError>,
            >())
        }
        fn collect_diagnostics<'a>(
            &'a self,
            _node: &'a AgentNode,
            _request: pb::DiagnosticsRequest,
            _timeout: Duration,
        ) -> BoxFuture<'a, Result<DiagnosticsStream, CallError>> {
            let open = Arc::clone(&self.open);
            self.opened.notify_one();
            // A stream that never yields, holding `open` until it is dropped.
            type Next = Option<(Result<pb::DiagnosticsChunk, CallError>, Arc<()>)>;
            let never = |open: Arc<()>| async move {
                let _open = open;
                futures::future::pending::<Next>().await
            };
            let stream: DiagnosticsStream = futures::stream::unfold(open, never).boxed();
            Box::pin(async move { Ok(stream) })
        }
    }

    fn context(client: kube::Client, store: &BundleStore, agents: Arc<StuckAgents>) -> Context {
        let (_, tuning) = watch::channel(Arc::new(TuningState::defaults()));
        Context {
            client,
            agent_port: 4443,
            agents,
            tuning,
            store: store.clone(),
            agent_concurrency: 1,
            object_concurrency: 1,
            timeout: Duration::from_secs(600),
            namespace: None,
            finished: Mutex::default(),
            swept: tokio::sync::OnceCell::new(),
            deletions: deletions::Deletions::default(),
        }
    }

    fn agents() -> Arc<StuckAgents> {
        Arc::new(StuckAgents {
            open: Arc::new(()),
            opened: tokio::sync::Notify::new(),
        })
    }

    /// Polls `done` every 20 ms for up to `within`.
    async fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if done() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        done()
    }

    #[tokio::test]
    async fn a_new_leader_sweeps_the_store_with_no_nodediagnostic_in_the_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1 << 20).unwrap();
        // The bundle of an object deleted while another replica led.
        let gone = dir.path().join("ns/gone");
        std::fs::create_dir_all(&gone).unwrap();
        std::fs::write(gone.join("n1.tar.gz"), b"bundle").unwrap();
        std::fs::write(gone.join("n1.token"), store::new_token()).unwrap();
        std::fs::write(gone.join(".uid"), "u-gone").unwrap();

        let fake = Arc::new(Fake::default());
        let client = serve(Arc::clone(&fake)).await;
        let ctx = Arc::new(context(client, &store, agents()));
        let metrics = ReconcileMetrics::default();
        let shutdown = CancellationToken::new();
        let run = tokio::spawn(crate::controllers::start(
            ctx,
            metrics.clone(),
            shutdown.clone(),
        ));
        let swept = eventually(Duration::from_secs(10), || !gone.exists()).await;
        let requests = fake.requests.lock().unwrap().clone();
        assert!(
            swept,
            "the deleted object's bundle is still on disk; requests: {requests:?}"
        );
        // No reconcile did it: there was nothing to reconcile.
        let labels = ControllerLabels {
            controller: "nodediagnostic",
        };
        assert_eq!(metrics.runs.get_or_create(&labels).get(), 0);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("the controller stops on shutdown")
            .unwrap();
    }

    #[tokio::test]
    async fn a_collection_stops_when_the_watch_shows_its_deletion_without_reading_the_object() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1 << 30).unwrap();
        let object = |deleting: bool| {
            let mut o = serde_json::json!({
                "apiVersion": API_VERSION, "kind": "NodeDiagnostic",
                "metadata": {
                    "name": "d", "namespace": "ns", "uid": "u1", "resourceVersion": "2",
                    "finalizers": [nodekeeper_api::names::FINALIZER_DIAGNOSTIC_BUNDLES],
                },
                "spec": {"nodeName": "n1"},
            });
            if deleting {
                o["metadata"]["resourceVersion"] = "3".into();
                o["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:00Z".into();
            }
            o
        };
        let (events, rx) = mpsc::unbounded_channel();
        let fake = Arc::new(Fake {
            objects: vec![object(false)],
            events: StdMutex::new(Some(rx)),
            ..Fake::default()
        });
        let client = serve(Arc::clone(&fake)).await;
        let agents = agents();
        let ctx = Arc::new(context(client, &store, Arc::clone(&agents)));
        let shutdown = CancellationToken::new();
        let run = tokio::spawn(crate::controllers::start(
            ctx,
            ReconcileMetrics::default(),
            shutdown.clone(),
        ));
        tokio::time::timeout(Duration::from_secs(10), agents.opened.notified())
            .await
            .expect("the bundle stream opened");
        assert!(Arc::strong_count(&agents.open) > 1, "the stream is open");
        // Three seconds of streaming, then the object is deleted (its finalizer holds it).
        tokio::time::sleep(Duration::from_secs(3)).await;
        let event = serde_json::json!({"type": "MODIFIED", "object": object(true)});
        events.send(Bytes::from(format!("{event}\n"))).unwrap();
        let stopped = eventually(Duration::from_secs(2), || {
            Arc::strong_count(&agents.open) == 1
        })
        .await;
        let requests = fake.requests.lock().unwrap().clone();
        assert!(
            stopped,
            "the bundle stream still runs; requests: {requests:?}"
        );
        // Nothing read the object itself while its bundle streamed.
        let reads: Vec<&String> = requests
            .iter()
            .filter(|r| r.starts_with("GET ") && r.ends_with("/nodediagnostics/d"))
            .collect();
        assert!(reads.is_empty(), "{reads:?}");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("the controller stops on shutdown")
            .unwrap();
    }
}
