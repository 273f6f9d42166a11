//! A `NetworkTest` through the real `nodekeeper-controller` process: the controller's reconciler
//! calls real agents over mutual TLS (RunProbes), the agents ping each other on 127.x.y.z, the
//! status reaches `Succeeded`, and the controller's HTTP API serves the full per-pair results.
//! A target outside the address policy (the metadata service by address)
//! fails with a condition naming the field.
//!
//! Run (as root: the agents' ICMP uses a raw socket where a ping socket is not allowed):
//! `cargo test -p nodekeeper-e2e --test controller_networktest`.

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use controller_common::*;
use kube::Api;
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

async fn apply_test(
    api: &Api<NetworkTest>,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<()> {
    nodekeeper_e2e::apply_spec(api, name, spec).await
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

/// Each test runs its own controller, and every controller reconciles every NetworkTest: run
/// together, one would take the other's tests (over nodes it does not manage) and refuse them.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_runs_an_icmp_mesh_and_serves_the_full_results() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    nodekeeper_testkit::skip_unless_root!("needs root for the agents' ICMP sockets");
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-nettest").await?;
    let group = unique_name("nettest");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(3);
    let nodes = create_simulated_nodes(&client, "nk-nettest", 3, &labels, &ips).await?;
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([("sweepInterval", "10s"), ("callTimeout", "2s")]),
    )
    .await?;

    let controller = ControllerProcess::start(&ns, "nettest-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips) {
        agents.push(start_agent(node, SocketAddr::new((*ip).into(), port), &tls).await?);
    }
    // The controller knows every node and reaches its agent before the test starts.
    for node in &nodes {
        wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            Some("AgentReachable"),
            TIMEOUT,
        )
        .await?;
    }

    let api: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);
    let node_selector = json!({"matchLabels": {"nodekeeper.dev/e2e-group": group}});
    let mesh = unique_name("mesh");
    apply_test(
        &api,
        &mesh,
        json!({"kind": "icmp", "nodeSelector": node_selector, "count": 3, "intervalMs": 20,
            "timeoutMs": 1000, "targets": [{"peers": {"perNode": 2}}],
            "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &mesh).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:?}");
    // 3 nodes, each pinging both others.
    assert_eq!((s.sources, s.sources_unreachable), (3, 0), "{s:?}");
    assert_eq!((s.pairs, s.pairs_failed), (6, 0), "{s:?}");
    assert_eq!(s.success_percent, Some(100.0), "{s:?}");
    assert_eq!((s.sent, s.received), (18, 18), "{s:?}");

    // The full results, from the controller's memory.
    let (code, body) = http_get(controller.http, &format!("/api/networktests/{ns}/{mesh}")).await?;
    assert_eq!(code, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(page["totalPairs"], 6, "{body}");
    assert_eq!(page["summary"]["successRatePercent"], 100.0, "{body}");
    let pairs = page["pairs"].as_array().context("pairs")?;
    assert_eq!(pairs.len(), 6, "{body}");
    for node in &nodes {
        let from: Vec<&serde_json::Value> = pairs
            .iter()
            .filter(|p| p["source"] == node.as_str())
            .collect();
        assert_eq!(from.len(), 2, "{node} probes two peers: {body}");
        for p in from {
            assert_eq!(
                (p["sent"].as_u64(), p["received"].as_u64()),
                (Some(3), Some(3)),
                "{p}"
            );
            assert_eq!(p["error"], "", "{p}");
            assert_eq!(p["rttUs"].as_array().map(Vec::len), Some(3), "{p}");
        }
    }
    let (code, body) = http_get(
        controller.http,
        &format!("/api/networktests/{ns}/no-such-test"),
    )
    .await?;
    assert_eq!(code, 404, "{body}");

    // The controller scaffold counted the reconciles (by controller name only) and every probe
    // call through the agents service (by method and outcome).
    let http = controller.http;
    let nt = ["controller=\"networktest\""];
    assert!(metric(http, "nodekeeper_reconcile_runs_total", &nt).await? >= 1.0);
    assert!(metric(http, "nodekeeper_reconcile_seconds_count", &nt).await? >= 1.0);
    assert_eq!(
        metric(http, "nodekeeper_reconcile_failures_total", &nt).await?,
        0.0
    );
    let answered = ["method=\"RunProbes\"", "outcome=\"Answered\""];
    assert!(metric(http, "nodekeeper_agents_calls_total", &answered).await? >= 3.0);

    // The metadata service aimed at by address (the address policy's first rule): refused
    // with a condition naming the target and the fix, and not a single probe sent.
    let probes_before = metric(
        http,
        "nodekeeper_agents_calls_total",
        &["method=\"RunProbes\""],
    )
    .await?;
    let metadata = unique_name("metadata");
    apply_test(
        &api,
        &metadata,
        json!({"kind": "icmp", "nodeSelector": node_selector, "count": 1,
            "targets": [{"address": "169.254.169.254"}], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &metadata).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed), "{s:?}");
    let valid = s
        .conditions
        .iter()
        .find(|c| c.type_ == "SpecValid")
        .context("SpecValid condition")?;
    assert_eq!(valid.reason, "InvalidSpec", "{valid:?}");
    assert!(
        valid.message.starts_with("spec.targets[0].address")
            && valid.message.contains("link-local")
            && valid.message.contains("metadataService: true"),
        "{}",
        valid.message
    );
    assert_eq!((s.sources, s.pairs, s.sent), (0, 0, 0), "{s:?}");
    assert_eq!(
        metric(
            http,
            "nodekeeper_agents_calls_total",
            &["method=\"RunProbes\""]
        )
        .await?,
        probes_before,
        "no agent was asked to probe"
    );

    drop((agents, controller));
    Ok(())
}

/// A node the test's selector matches but the controller does not manage (outside its
/// `--node-selector`) is never a source: the sources are the managed nodes, picked before
/// `maxNodes`, so the first node by name (unmanaged) does not take a source's place and fail
/// as "not managed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmanaged_nodes_are_not_sources() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    nodekeeper_testkit::skip_unless_root!("needs root for the agents' ICMP sockets");
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-nettest-mg").await?;
    let group = unique_name("nettest-mg");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let ips = loopback_ips(3);
    let nodes = create_simulated_nodes(&client, "nk-nettest-mg", 3, &labels, &ips).await?;
    // Nodes are named `<base>-0..2`: `-0` sorts first and stays unmanaged.
    let node_api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for node in &nodes[1..] {
        node_api
            .patch(
                node,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"metadata": {"labels": {
                    "nodekeeper.dev/e2e-managed": "yes"}}})),
            )
            .await?;
    }
    let selector = format!("nodekeeper.dev/e2e-group={group},nodekeeper.dev/e2e-managed=yes");
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([("sweepInterval", "10s"), ("callTimeout", "2s")]),
    )
    .await?;
    let controller = ControllerProcess::start(&ns, "nettest-mg", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips).skip(1) {
        agents.push(start_agent(node, SocketAddr::new((*ip).into(), port), &tls).await?);
    }
    for node in &nodes[1..] {
        wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            Some("AgentReachable"),
            TIMEOUT,
        )
        .await?;
    }

    let api: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);
    let mesh = unique_name("mesh");
    apply_test(
        &api,
        &mesh,
        json!({"kind": "icmp",
            "nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-group": group}},
            "maxNodes": 2, "count": 2, "intervalMs": 20, "timeoutMs": 1000,
            "targets": [{"peers": {"perNode": 1}}], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &mesh).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:?}");
    assert_eq!((s.sources, s.sources_unreachable), (2, 0), "{s:?}");
    assert_eq!((s.pairs, s.pairs_failed), (2, 0), "{s:?}");

    let (code, body) = http_get(controller.http, &format!("/api/networktests/{ns}/{mesh}")).await?;
    assert_eq!(code, 200, "{body}");
    assert!(
        !body.contains(nodes[0].as_str()),
        "the unmanaged node {} is neither source nor peer: {body}",
        nodes[0]
    );

    drop((agents, controller));
    Ok(())
}
