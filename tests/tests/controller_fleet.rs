//! The controller against the real control plane with real agents: conditions are written once
//! per change and never as a heartbeat, a silent agent turns stale, rules reach agents by
//! revision, a bad tuning ConfigMap is refused with a Warning Event naming the key while the last
//! good configuration stays in force, and the HTTP API serves reports from memory.
//!
//! Run: `cargo test -p nodekeeper-e2e --test controller_fleet` (starts its own control plane, or
//! uses the one named by `NODEKEEPER_TEST_KUBECONFIG`).

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use controller_common::*;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::ListParams;
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, test_namespace, unique_name, wait_for};

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_writes_on_change_only_pushes_rules_and_refuses_bad_tuning() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-fleet").await?;
    let group = unique_name("fleet");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(3);
    let nodes = create_simulated_nodes(&client, "nk-fleet", 3, &labels, &ips).await?;
    let port = free_port();

    // A fast schedule so the test sees several sweeps; staleness at its minimum.
    let rules = "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n";
    let mut tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "10s"),
        ("callTimeout", "2s"),
        ("rules.yaml", rules),
    ]
    .into();
    put_tuning(&client, &ns, &tuning).await?;

    let controller = ControllerProcess::start(&ns, "fleet-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    // Agents for nodes 0 and 1; node 2 has none and must turn stale.
    let a0 = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    let a1 = start_agent(&nodes[1], SocketAddr::new(ips[1].into(), port), &tls).await?;
    a0.set_sysctl("net.core.somaxconn", "128")?;
    a1.set_sysctl("net.core.somaxconn", "8192")?;

    let t = Duration::from_secs(90);
    wait_condition(
        &client,
        &nodes[0],
        "NodekeeperReachable",
        "True",
        Some("AgentReachable"),
        t,
    )
    .await?;
    let (_, _, msg) = wait_condition(
        &client,
        &nodes[0],
        "TunablesInBounds",
        "False",
        Some("TunablesOutOfBounds"),
        t,
    )
    .await?;
    assert!(msg.contains("somaxconn"), "message names the rule: {msg}");
    wait_condition(
        &client,
        &nodes[1],
        "TunablesInBounds",
        "True",
        Some("TunablesInBounds"),
        t,
    )
    .await?;
    let (_, _, msg) = wait_condition(
        &client,
        &nodes[2],
        "NodekeeperReachable",
        "False",
        Some("AgentUnreachable"),
        t,
    )
    .await?;
    assert!(
        msg.contains(&ips[2].to_string()),
        "message names the address: {msg}"
    );

    // Each node was patched exactly once (nodes 0 and 1 straight to their final state, node 2
    // once when stale); rules went once to each live agent.
    let http = controller.http;
    let patches = metric(
        http,
        "nodekeeper_conditions_patches_total",
        &["result=\"Ok\""],
    )
    .await?;
    let set_rules = metric(
        http,
        "nodekeeper_sweep_set_rules_calls_total",
        &["result=\"Ok\""],
    )
    .await?;
    assert_eq!(set_rules, 2.0, "one SetRules per live agent");
    // Node 0 may be written once before its agent held the rules (TunablesInBounds from the
    // agent's empty rule set) and once after; nodes 1 and 2 once each.
    assert!((3.0..=4.0).contains(&patches), "patches so far: {patches}");

    // Steady state: three more sweep intervals, calls continue, writes do not.
    let calls_before = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    tokio::time::sleep(Duration::from_secs(30)).await;
    let calls_after = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    assert!(
        calls_after >= calls_before + 4.0,
        "agents keep being read: {calls_before} → {calls_after}"
    );
    assert_eq!(
        metric(http, "nodekeeper_conditions_patches_total", &[]).await?,
        patches,
        "no write without a change"
    );
    assert_eq!(
        metric(http, "nodekeeper_sweep_set_rules_calls_total", &[]).await?,
        set_rules,
        "an agent holding the revision is not called again"
    );
    assert!(
        metric(
            http,
            "nodekeeper_sweep_agent_calls_total",
            &["outcome=\"Unchanged\""]
        )
        .await?
            >= 2.0
    );

    // A change on one node writes that node only, once.
    a1.set_sysctl("net.core.somaxconn", "100")?;
    wait_condition(
        &client,
        &nodes[1],
        "TunablesInBounds",
        "False",
        Some("TunablesOutOfBounds"),
        t,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        metric(http, "nodekeeper_conditions_patches_total", &[]).await?,
        patches + 1.0
    );

    // The HTTP API serves the report from memory.
    let (status, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[0])).await?;
    assert_eq!(status, 200, "{body}");
    let node: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(node["report"]["nodeName"], nodes[0].as_str());
    assert_eq!(node["report"]["tunables"][0]["rule"], "somaxconn");
    let (status, body) = http_get(http, "/api/v1/summary").await?;
    assert_eq!(status, 200, "{body}");
    let summary: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(summary["fleet"]["nodes"], 3);
    assert_eq!(summary["fleet"]["stale"], 1);
    assert_eq!(http_get(http, "/api/v1/nodes/no-such-node").await?.0, 404);

    // An invalid ConfigMap: refused with a Warning Event naming each bad key; the last good
    // configuration (10s sweeps) stays in force.
    tuning.insert("sweepInterval", "soon");
    tuning.insert("colour", "red");
    put_tuning(&client, &ns, &tuning).await?;
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let note = wait_for(
        "a Warning Event InvalidTuning",
        Duration::from_secs(30),
        || {
            let events = events.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(list
                    .items
                    .into_iter()
                    .find(|e| {
                        e.reason.as_deref() == Some("InvalidTuning")
                            && e.type_.as_deref() == Some("Warning")
                    })
                    .and_then(|e| e.note))
            }
        },
    )
    .await?;
    assert!(
        note.contains("key `sweepInterval`") && note.contains("key `colour`"),
        "{note}"
    );
    let (_, body) = http_get(http, "/api/v1/summary").await?;
    let summary: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(summary["tuning"]["config"]["sweepInterval"], "10s");
    assert!(
        summary["tuning"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .contains("colour")
    );
    let reads = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert!(
        metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await? >= reads + 2.0,
        "sweeps go on under the last good configuration ({:?})",
        started.elapsed()
    );

    drop((a0, a1, controller));
    Ok(())
}

/// A controller that starts (or takes over) while the tuning ConfigMap is invalid has read no good
/// configuration: it pushes no rules (the agents keep theirs) and leaves TunablesInBounds as it
/// is, and its Warning Event does not call the defaults a good configuration. Deleting the
/// ConfigMap then means the defaults: their empty rule set goes out.
///
/// Regression: the new leader published the defaults as settled and pushed their empty rule set
/// to the whole fleet, rewriting every node's TunablesInBounds.
///
/// Run: `cargo xtask test -- -p nodekeeper-e2e --test controller_fleet -- a_controller_starting_on_a_refused_configmap`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_starting_on_a_refused_configmap_keeps_the_fleets_rules() -> anyhow::Result<()>
{
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-badstart").await?;
    let group = unique_name("badstart");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, "nk-badstart", 1, &labels, &ips).await?;
    let port = free_port();

    let rules = "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n";
    let mut tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "30s"),
        ("callTimeout", "2s"),
        ("rules.yaml", rules),
    ]
    .into();
    put_tuning(&client, &ns, &tuning).await?;
    let mut first = ControllerProcess::start(&ns, "badstart-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let a0 = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    a0.set_sysctl("net.core.somaxconn", "128")?;
    let t = Duration::from_secs(90);
    // The agent holds the rule: the node is out of bounds by it.
    let (_, _, held) = wait_condition(
        &client,
        &nodes[0],
        "TunablesInBounds",
        "False",
        Some("TunablesOutOfBounds"),
        t,
    )
    .await?;
    assert!(held.contains("somaxconn"), "{held}");

    // The ConfigMap turns invalid while no controller runs; a new one starts on it.
    first.stop();
    tuning.insert("sweepInterval", "soon");
    put_tuning(&client, &ns, &tuning).await?;
    let second = ControllerProcess::start(&ns, "badstart-b", &selector, port, &[])?;
    let http = second.http;
    wait_for(
        "the new leader's first reports",
        Duration::from_secs(60),
        || async move {
            let reports = metric(
                http,
                "nodekeeper_sweep_agent_calls_total",
                &["outcome=\"Report\""],
            )
            .await?;
            let unchanged = metric(
                http,
                "nodekeeper_sweep_agent_calls_total",
                &["outcome=\"Unchanged\""],
            )
            .await?;
            // A new leader's first read of a node is a full report, and a push (had there
            // been one) goes out in the same call (`MtlsAgents::report`).
            Ok((reports + unchanged >= 1.0).then_some(()))
        },
    )
    .await?;
    assert_eq!(
        metric(http, "nodekeeper_sweep_set_rules_calls_total", &[]).await?,
        0.0,
        "no SetRules (above all, not the defaults' empty rule set) without a good configuration"
    );
    let (status, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[0])).await?;
    assert_eq!(status, 200, "{body}");
    let node: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(
        node["report"]["tunables"][0]["rule"], "somaxconn",
        "the agent keeps its rules: {body}"
    );
    let api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    assert_eq!(
        condition(&api.get(&nodes[0]).await?, "TunablesInBounds"),
        Some(("False".into(), "TunablesOutOfBounds".into(), held)),
        "TunablesInBounds is not rewritten"
    );
    let (_, body) = http_get(http, "/api/v1/summary").await?;
    let summary: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(summary["tuning"]["good"], false, "{body}");
    assert!(
        summary["tuning"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .contains("sweepInterval"),
        "{body}"
    );
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let note = wait_for(
        "the new leader's Warning Event InvalidTuning",
        Duration::from_secs(30),
        || {
            let events = events.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(list
                    .items
                    .into_iter()
                    .filter_map(|e| {
                        (e.reason.as_deref() == Some("InvalidTuning")
                            && e.type_.as_deref() == Some("Warning"))
                        .then_some(e.note?)
                    })
                    .find(|note| note.contains("no valid configuration")))
            }
        },
    )
    .await?;
    assert!(
        note.contains("key `sweepInterval`") && !note.contains("stays in force"),
        "{note}"
    );

    // (A deleted ConfigMap means the defaults, pushed as the empty rule set: the unit tests of
    // `shared::tuning` show it; here the node would not be read again before the defaults'
    // 5-minute sweep interval.)
    drop((a0, second));
    Ok(())
}
