//! `NetworkTest` end to end on real parts: the real kube-apiserver (CRDs from `deploy/crds/`),
//! kwok-simulated Nodes whose InternalIPs are the addresses of network-namespace "nodes", the
//! NetworkTest reconciler of the controller crate, and the agent's real probe code running inside
//! each node's namespace. Only the gRPC hop between controller and agent is left out: the
//! reconciler's agent call runs `nodekeeper_agent::probes::run` in the source node's namespace.
//!
//! ```text
//!  n0 10.88.0.10 ─┐
//!                 ├─ bridge (in ns sw) ── 10.88.0.1 R 10.88.1.1 ── veth mtu 1400 ── 10.88.1.2 n2
//!  n1 10.88.0.11 ─┘                         (R blackholes 10.88.9.0/24)
//! ```
//! n1 also blackholes n2's address in its own table: the one failing node pair.

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use futures::future::BoxFuture;
use kube::Api;
use kube::api::{DeleteParams, WatchEvent, WatchParams};
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_controller::agent_client::{CallError, CallOutcome};
use nodekeeper_controller::controllers::networktest::plan::Environment;
use nodekeeper_controller::controllers::networktest::store::ResultsStore;
use nodekeeper_controller::controllers::{self, networktest};
use nodekeeper_controller::shared::agents::{AgentNode, Agents, Report, RulesOutcome};
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use nodekeeper_proto::agent::v1 as pb;
use nodekeeper_testkit::{Netns, NetnsEntry, skip_unless_root};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_secs(90);

/// The namespaces of the picture above; deleted on drop.
struct Topology {
    _namespaces: Vec<Netns>,
    /// Node address → a way into its namespace.
    by_address: BTreeMap<IpAddr, NetnsEntry>,
}

const N0: Ipv4Addr = Ipv4Addr::new(10, 88, 0, 10);
const N1: Ipv4Addr = Ipv4Addr::new(10, 88, 0, 11);
const N2: Ipv4Addr = Ipv4Addr::new(10, 88, 1, 2);
const R: &str = "10.88.0.1";
const HOLE: &str = "10.88.9.9";

impl Topology {
    fn create() -> anyhow::Result<Self> {
        let new = |s: &str| -> anyhow::Result<Netns> {
            let ns = Netns::new(&format!("nknt-{s}"))?;
            ns.ip(&["link", "set", "lo", "up"])?;
            Ok(ns)
        };
        let (sw, r, n0, n1, n2) = (new("sw")?, new("r")?, new("n0")?, new("n1")?, new("n2")?);
        sw.ip(&["link", "add", "br0", "type", "bridge"])?;
        sw.ip(&["link", "set", "br0", "up"])?;
        for (ns, port, addr) in [
            (&n0, "p0", "10.88.0.10/24"),
            (&n1, "p1", "10.88.0.11/24"),
            (&r, "pr", "10.88.0.1/24"),
        ] {
            ns.add_veth("eth0", &[], port, Some(&sw))?;
            sw.ip(&["link", "set", port, "master", "br0", "up"])?;
            ns.address_up("eth0", addr)?;
        }
        r.add_veth("eth1", &["mtu", "1400"], "eth0", Some(&n2))?;
        n2.ip(&["link", "set", "eth0", "mtu", "1400"])?;
        r.address_up("eth1", "10.88.1.1/24")?;
        n2.address_up("eth0", "10.88.1.2/24")?;
        r.set_sysctl("net.ipv4.ip_forward", "1")?;
        r.ip(&["route", "add", "blackhole", "10.88.9.0/24"])?;
        for ns in [&n0, &n1] {
            ns.ip(&["route", "add", "10.88.0.0/16", "via", R])?;
        }
        n2.ip(&["route", "add", "10.88.0.0/16", "via", "10.88.1.1"])?;
        n1.ip(&["route", "add", "blackhole", &format!("{N2}/32")])?;
        let by_address = BTreeMap::from([
            (N0.into(), n0.entry()),
            (N1.into(), n1.entry()),
            (N2.into(), n2.entry()),
        ]);
        Ok(Self {
            _namespaces: vec![sw, r, n0, n1, n2],
            by_address,
        })
    }
}

/// The reconciler's agents: the probe request runs inside the namespace of the node whose
/// address the endpoint names, on a thread of its own with a current-thread runtime.
struct NetnsAgents {
    /// Node address → a way into its namespace.
    by_address: BTreeMap<IpAddr, NetnsEntry>,
}

fn call_error(endpoint: SocketAddr, detail: String) -> CallError {
    CallError {
        outcome: CallOutcome::Connect,
        endpoint,
        detail,
    }
}

impl Agents for NetnsAgents {
    fn run_probes<'a>(
        &'a self,
        node: &'a AgentNode,
        req: pb::RunProbesRequest,
        budget: Duration,
    ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>> {
        let endpoint = node.endpoint;
        Box::pin(async move {
            let ns = self
                .by_address
                .get(&endpoint.ip())
                .cloned()
                .ok_or_else(|| call_error(endpoint, "no agent here".into()))?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            // A thread that cannot enter the namespace panics and drops `tx`.
            ns.spawn(move || async move {
                let result = nodekeeper_agent::probes::run(req)
                    .await
                    .map_err(|e| e.to_string());
                let _ = tx.send(result);
            });
            match tokio::time::timeout(budget, rx).await {
                Ok(Ok(r)) => r.map_err(|e| call_error(endpoint, e)),
                Ok(Err(_)) => Err(call_error(endpoint, "agent thread died".into())),
                Err(_) => Err(call_error(endpoint, format!("no answer within {budget:?}"))),
            }
        })
    }

    // The NetworkTest reconciler reads no reports and applies no network state.
    fn report<'a>(
        &'a self,
        node: &'a AgentNode,
        _: nodekeeper_controller::shared::agents::ReportRequest<'a>,
        _: Duration,
    ) -> BoxFuture<'a, Report> {
        no_report(node)
    }

    fn apply_network<'a>(
        &'a self,
        node: &'a AgentNode,
        _: pb::ApplyNetworkRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>> {
        no_network(node)
    }

    fn collect_diagnostics<'a>(
        &'a self,
        node: &'a AgentNode,
        _: pb::DiagnosticsRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<nodekeeper_controller::shared::agents::DiagnosticsStream, CallError>>
    {
        no_diagnostics(node)
    }
}

/// The calls the NetworkTest reconciler never makes, answered with an error by this file's
/// fake agents.
fn no_report(node: &AgentNode) -> BoxFuture<'static, Report> {
    let view = Err(call_error(node.endpoint, "no reports in this test".into()));
    Box::pin(std::future::ready(Report {
        view,
        rules: RulesOutcome::NotPushed,
    }))
}

fn no_network(node: &AgentNode) -> BoxFuture<'static, Result<pb::ApplyNetworkResponse, CallError>> {
    let error = call_error(node.endpoint, "no network state in this test".into());
    Box::pin(std::future::ready(Err(error)))
}

fn no_diagnostics(
    node: &AgentNode,
) -> BoxFuture<'static, Result<nodekeeper_controller::shared::agents::DiagnosticsStream, CallError>>
{
    let error = call_error(node.endpoint, "no diagnostics in this test".into());
    Box::pin(std::future::ready(Err(error)))
}

fn netns_agents(by_address: BTreeMap<IpAddr, NetnsEntry>) -> Arc<dyn Agents> {
    Arc::new(NetnsAgents { by_address })
}

fn start_reconciler(
    client: kube::Client,
    namespace: &str,
    agents: Arc<dyn Agents>,
    env: Environment,
) -> (ResultsStore, CancellationToken) {
    let store = ResultsStore::default();
    let cancel = CancellationToken::new();
    let ctx = Arc::new(networktest::Context {
        client,
        agent_port: 9443,
        agents,
        env,
        store: store.clone(),
        agent_concurrency: 8,
        test_concurrency: 4,
        namespace: Some(namespace.to_owned()),
        policy: Default::default(),
    });
    tokio::spawn(controllers::start(ctx, Default::default(), cancel.clone()));
    (store, cancel)
}

async fn finished(api: &Api<NetworkTest>, name: &str) -> anyhow::Result<NetworkTest> {
    wait_for(&format!("networktest {name} to finish"), TIMEOUT, || {
        let api = api.clone();
        async move {
            let nt = api.get(name).await?;
            let done = nt
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| matches!(p, Phase::Succeeded | Phase::Failed));
            Ok(done.then_some(nt))
        }
    })
    .await
}

/// Creates a NetworkTest from raw JSON (as `kubectl apply` would send it).
async fn create_test(
    client: &kube::Client,
    ns: &str,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<()> {
    let body = json!({
        "apiVersion": "nodekeeper.dev/v1alpha1",
        "kind": "NetworkTest",
        "metadata": { "name": name },
        "spec": spec,
    });
    raw_create(client, ns, &body)
        .await
        .with_context(|| format!("create networktest {ns}/{name}"))
}

#[tokio::test]
async fn bad_input_is_refused_by_the_schema_or_fails_naming_the_field() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nt-bad").await?;
    let api: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);

    // Refused by the API server (schema and CEL rules): nothing is created.
    let many: Vec<serde_json::Value> = (0..10_000)
        .map(|i| json!({"address": format!("10.1.{}.{}", i / 250, i % 250 + 1)}))
        .collect();
    for (what, spec, expect) in [
        (
            "unknown kind",
            json!({"kind": "udp", "targets": [{"address": "10.0.0.1"}]}),
            "kind",
        ),
        (
            "zero count",
            json!({"kind": "icmp", "count": 0, "targets": [{"address": "10.0.0.1"}]}),
            "count",
        ),
        (
            "negative count",
            json!({"kind": "icmp", "count": -3, "targets": [{"address": "10.0.0.1"}]}),
            "count",
        ),
        (
            "10,000 targets",
            json!({"kind": "icmp", "targets": many}),
            "targets",
        ),
        (
            "bad URL scheme",
            json!({"kind": "http", "targets": [{"url": "ftp://10.0.0.1/"}]}),
            "url",
        ),
    ] {
        // Sent as raw JSON: the typed client could not even express some of these.
        let body = json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NetworkTest",
            "metadata": {"name": unique_name("bad")}, "spec": spec,
        });
        let err = match raw_create(&client, &ns, &body).await {
            Ok(()) => bail!("{what}: the API server accepted it"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains(expect), "{what}: {err}");
    }

    // Accepted by the schema, refused by the controller: Failed with a condition naming the field.
    let (_store, cancel) = start_reconciler(
        client.clone(),
        &ns,
        netns_agents(BTreeMap::new()),
        Environment::default(),
    );
    let none = unique_name("no-nodes");
    let spec = json!({"kind": "icmp", "nodeSelector": {"matchLabels": {"nodekeeper.dev/pool": unique_name("empty")}}, "targets": [{"address": "10.0.0.1"}]});
    create_test(&client, &ns, &none, spec).await?;
    let md = unique_name("metadata");
    let pool = unique_name("pool");
    let labels = BTreeMap::from([("nodekeeper.dev/pool".to_owned(), pool.clone())]);
    create_simulated_nodes(&client, "nt-bad", 1, &labels, &[]).await?;
    let spec = json!({"kind": "icmp", "nodeSelector": {"matchLabels": {"nodekeeper.dev/pool": pool}}, "targets": [{"metadataService": true}], "ttlSecondsAfterFinished": 2});
    create_test(&client, &ns, &md, spec).await?;

    for (name, field, reason) in [
        (&none, "spec.nodeSelector", "NoMatchingNodes"),
        (&md, "spec.targets[0].metadataService", "InvalidSpec"),
    ] {
        let nt = finished(&api, name).await?;
        let status = nt.status.context("status")?;
        assert_eq!(status.phase, Some(Phase::Failed), "{name}");
        let valid = status
            .conditions
            .iter()
            .find(|c| c.type_ == "SpecValid")
            .context("SpecValid condition")?;
        assert_eq!(valid.reason, reason, "{name}");
        assert!(
            valid.message.starts_with(field),
            "{name}: {}",
            valid.message
        );
    }
    // The TTL after finishing deletes the test.
    wait_for(
        &format!("networktest {md} deleted after its TTL"),
        TIMEOUT,
        || {
            let api = api.clone();
            let md = md.clone();
            async move { Ok(api.get_opt(&md).await?.is_none().then_some(())) }
        },
    )
    .await?;
    api.delete(&none, &DeleteParams::default()).await?;
    cancel.cancel();
    Ok(())
}

async fn raw_create(
    client: &kube::Client,
    ns: &str,
    body: &serde_json::Value,
) -> anyhow::Result<()> {
    let req = http::Request::post(format!(
        "/apis/nodekeeper.dev/v1alpha1/namespaces/{ns}/networktests"
    ))
    .header("content-type", "application/json")
    .body(serde_json::to_vec(body)?)?;
    client.request::<serde_json::Value>(req).await?;
    Ok(())
}

#[tokio::test]
async fn netns_nodes_report_the_failed_pair_the_loss_and_the_mtu() -> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let topo = Topology::create()?;
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nt-netns").await?;
    let api: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);
    let pool = unique_name("pool");
    let labels = BTreeMap::from([("nodekeeper.dev/pool".to_owned(), pool.clone())]);
    let nodes = create_simulated_nodes(&client, "ntn", 3, &labels, &[N0, N1, N2]).await?;
    // The address policy allows the topology's own range (the blackholed address included).
    let (store, cancel) = start_reconciler(
        client.clone(),
        &ns,
        netns_agents(topo.by_address.clone()),
        Environment {
            allowed: vec!["10.88.0.0/16".parse().map_err(anyhow::Error::msg)?],
            ..Environment::default()
        },
    );
    let selector = json!({"matchLabels": {"nodekeeper.dev/pool": pool}});

    // ICMP between all nodes (peers) and to a blackholed address.
    let mesh = unique_name("mesh");
    let spec = json!({"kind": "icmp", "nodeSelector": selector, "count": 3, "intervalMs": 20, "timeoutMs": 500,
        "targets": [{"peers": {"perNode": 2}}, {"address": HOLE}]});
    // Count the writes to the object from its creation on: status must be written once per
    // phase change (Running, then Failed), never more.
    let wp = WatchParams::default()
        .fields(&format!("metadata.name={mesh}"))
        .timeout(120);
    let mut events = api.watch(&wp, "0").await?.boxed();
    let writes = tokio::spawn(async move {
        let mut writes = 0;
        let mut quiet_until = None;
        loop {
            let deadline = quiet_until.unwrap_or_else(|| tokio::time::Instant::now() + TIMEOUT);
            match tokio::time::timeout_at(deadline, events.next()).await {
                Ok(Some(Ok(WatchEvent::Modified(nt)))) => {
                    writes += 1;
                    let terminal = nt
                        .status
                        .and_then(|s| s.phase)
                        .is_some_and(|p| matches!(p, Phase::Succeeded | Phase::Failed));
                    if terminal && quiet_until.is_none() {
                        // Anything written after the final status would show within seconds.
                        quiet_until = Some(tokio::time::Instant::now() + Duration::from_secs(5));
                    }
                }
                Ok(Some(Ok(_))) => {}
                _ => return writes,
            }
        }
    });
    create_test(&client, &ns, &mesh, spec).await?;
    let nt = finished(&api, &mesh).await?;
    let s = nt.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed));
    assert_eq!((s.sources, s.pairs), (3, 9), "{s:?}");
    // Failing: every node → the blackholed address, and n1 ↔ n2 (n1's blackhole route to n2
    // also drops its replies to n2); nothing else.
    let mut failed: Vec<(String, String)> = s
        .worst_failures
        .iter()
        .map(|f| (f.source.clone(), f.target.clone()))
        .collect();
    failed.sort();
    let mut expected: Vec<(String, String)> =
        nodes.iter().map(|n| (n.clone(), HOLE.to_owned())).collect();
    expected.push((nodes[1].clone(), format!("node/{}", nodes[2])));
    expected.push((nodes[2].clone(), format!("node/{}", nodes[1])));
    expected.sort();
    assert_eq!(failed, expected);
    assert_eq!(s.pairs_failed, 5);
    assert!(
        s.worst_failures.iter().all(|f| f.loss_percent == 100.0),
        "{s:?}"
    );
    // 9 pairs × 3 probes; 4 pairs answered every probe.
    assert_eq!((s.sent, s.received), (27, 12), "{s:?}");
    assert_eq!(s.loss_percent, Some(55.56));
    let hole = s
        .targets
        .iter()
        .find(|t| t.target == HOLE)
        .context("blackholed target summary")?;
    assert_eq!((hole.pairs_failed, hole.loss_percent), (3, 100.0));
    // The peers are one row, as the spec names them, not one row per node.
    let rows: Vec<&str> = s.targets.iter().map(|t| t.target.as_str()).collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let peers = s
        .targets
        .iter()
        .find(|t| t.target == "peers")
        .context("peers summary")?;
    assert_eq!((peers.pairs, peers.pairs_failed), (6, 2), "{peers:?}");
    assert!(
        s.latency
            .is_some_and(|l| l.p50_us > 0 && l.p50_us <= l.p95_us && l.p95_us <= l.max_us)
    );
    assert_eq!(
        writes.await?,
        2,
        "status writes for one test: Running, then the final phase"
    );
    // The full per-pair results are in the controller's memory for its HTTP API.
    let full = store
        .get(&ns, &mesh)
        .context("results kept for the HTTP API")?;
    assert_eq!(full.pairs.len(), 9);

    // Path MTU from the bridge nodes to n2, behind the 1400-byte link.
    let mtu = unique_name("mtu");
    // maxNodes 1: the first node by name, n0.
    let spec = json!({"kind": "pathMtu", "nodeSelector": selector, "maxNodes": 1,
        "count": 1, "timeoutMs": 500, "maxMtu": 1500, "targets": [{"address": N2.to_string()}, {"address": R}]});
    create_test(&client, &ns, &mtu, spec).await?;
    let s = finished(&api, &mtu).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:?}");
    assert_eq!(s.sources, 1);
    let to_n2 = s
        .targets
        .iter()
        .find(|t| t.target == N2.to_string())
        .context("n2 summary")?;
    assert_eq!(to_n2.path_mtu_min, Some(1400));
    let to_r = s
        .targets
        .iter()
        .find(|t| t.target == R)
        .context("router summary")?;
    assert_eq!(to_r.path_mtu_min, Some(1500));
    assert_eq!(s.path_mtu_min, Some(1400));

    cancel.cancel();
    drop(topo);
    Ok(())
}

/// Agents whose probe calls never finish: each call counts itself started, and dropped when
/// the reconciler lets go of it (which, over gRPC, cancels the agent's probes).
struct HangingAgents {
    started: Arc<std::sync::atomic::AtomicUsize>,
    dropped: Arc<std::sync::atomic::AtomicUsize>,
}

/// Counts a drop of the call that holds it.
struct DropCount(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for DropCount {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Agents for HangingAgents {
    fn run_probes<'a>(
        &'a self,
        _: &'a AgentNode,
        _: pb::RunProbesRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>> {
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let guard = DropCount(Arc::clone(&self.dropped));
        Box::pin(async move {
            let _guard = guard;
            std::future::pending().await
        })
    }

    fn report<'a>(
        &'a self,
        node: &'a AgentNode,
        _: nodekeeper_controller::shared::agents::ReportRequest<'a>,
        _: Duration,
    ) -> BoxFuture<'a, Report> {
        no_report(node)
    }

    fn apply_network<'a>(
        &'a self,
        node: &'a AgentNode,
        _: pb::ApplyNetworkRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>> {
        no_network(node)
    }

    fn collect_diagnostics<'a>(
        &'a self,
        node: &'a AgentNode,
        _: pb::DiagnosticsRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<nodekeeper_controller::shared::agents::DiagnosticsStream, CallError>>
    {
        no_diagnostics(node)
    }
}

/// Deleting a running NetworkTest stops its run: every agent call in flight is dropped (over
/// gRPC that cancels the probes on the agent), and no results are kept for it.
#[tokio::test]
async fn deleting_a_running_test_cancels_its_agent_calls() -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nt-cancel").await?;
    let pool = unique_name("pool");
    let labels = BTreeMap::from([("nodekeeper.dev/pool".to_owned(), pool.clone())]);
    create_simulated_nodes(&client, "ntc", 2, &labels, &[]).await?;
    let started = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let agents = Arc::new(HangingAgents {
        started: Arc::clone(&started),
        dropped: Arc::clone(&dropped),
    });
    let (store, cancel) = start_reconciler(client.clone(), &ns, agents, Environment::default());
    let api: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);

    // Two nodes pinging each other for minutes: running until deleted.
    let name = unique_name("long");
    let spec = json!({"kind": "icmp", "nodeSelector": {"matchLabels": {"nodekeeper.dev/pool": pool}},
        "count": 100, "intervalMs": 5000, "timeoutMs": 1000, "targets": [{"peers": {"perNode": 1}}]});
    create_test(&client, &ns, &name, spec).await?;
    wait_for("both agents to be asked", TIMEOUT, || {
        let started = Arc::clone(&started);
        async move { Ok((started.load(Ordering::SeqCst) == 2).then_some(())) }
    })
    .await?;
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        0,
        "nothing dropped while it runs"
    );

    api.delete(&name, &DeleteParams::default()).await?;
    // The run checks for its object every 5 s.
    wait_for(
        "the agent calls to be dropped",
        Duration::from_secs(30),
        || {
            let dropped = Arc::clone(&dropped);
            async move { Ok((dropped.load(Ordering::SeqCst) == 2).then_some(())) }
        },
    )
    .await?;
    assert!(
        store.get(&ns, &name).is_none(),
        "a cancelled run keeps no results"
    );
    // Not run again: the object is gone.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(started.load(Ordering::SeqCst), 2);
    cancel.cancel();
    Ok(())
}
