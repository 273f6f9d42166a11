//! Refused tuning is visible where a user looks, on the real control plane: every new refusal of
//! the tuning ConfigMap is a Warning Event of its own whose note names the key (and, inside
//! `rules.yaml`, the rule and the field) — not a bump of the first refusal's series — and an
//! agent that refuses rules the controller accepted (a sysctl its node lacks) is named on the
//! node's page of the HTTP API, counted in the fleet summary and in
//! `nodekeeper_sweep_nodes_refusing_rules`, until it takes a later revision or the ConfigMap
//! goes back to the revision it kept.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test tuning_refusals`.

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

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

/// The controller's summary, as JSON.
async fn summary(http: SocketAddr) -> anyhow::Result<serde_json::Value> {
    let (status, body) = http_get(http, "/api/v1/summary").await?;
    anyhow::ensure!(status == 200, "summary: {status} {body}");
    Ok(serde_json::from_str(&body)?)
}

/// The `InvalidTuning` Warning Events in `ns`: (name, action, note).
async fn refusal_events(events: &Api<Event>) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some("InvalidTuning") && e.type_.as_deref() == Some("Warning")
        })
        .map(|e| {
            (
                e.metadata.name.unwrap_or_default(),
                e.action.unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_is_its_own_event_and_a_refusing_agent_is_counted() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-refuse").await?;
    let group = unique_name("refuse");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-refuse", 2, &labels, &ips).await?;
    let port = free_port();

    // Valid for the controller; on node 1 `net.core.somaxconn` is a directory (a group of
    // sysctls, as `net/core` is), which its agent refuses. (A key a node merely lacks is not a
    // refusal: that rule reports it and the others apply.)
    let rules_v1 = "tunables:\n  - name: backlog\n    key: net.core.somaxconn\n    atLeast: 1024\n";
    let mut tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "30s"),
        ("callTimeout", "2s"),
        ("rules.yaml", rules_v1),
    ]
    .into();
    put_tuning(&client, &ns, &tuning).await?;
    let controller = ControllerProcess::start(&ns, "refuse-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let a0 = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    let a1 = start_agent(&nodes[1], SocketAddr::new(ips[1].into(), port), &tls).await?;
    a0.set_sysctl("net.core.somaxconn", "4096")?;
    let somaxconn_1 = a1.sysctl_root.join("net/core/somaxconn");
    std::fs::create_dir_all(&somaxconn_1)?;
    let http = controller.http;

    // The refusing agent: counted and named in the summary, its reason on its node's page.
    let t = Duration::from_secs(60);
    let fleet = wait_for("the summary counts one agent refusing rules", t, || async {
        let s = summary(http).await?;
        Ok((s["fleet"]["refusingRules"] == 1).then(|| s["fleet"].clone()))
    })
    .await?;
    assert_eq!(fleet["refusingRulesNodes"], serde_json::json!([nodes[1]]));
    let (_, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[1])).await?;
    let page: serde_json::Value = serde_json::from_str(&body)?;
    let why = page["rulesRefused"]["error"].as_str().unwrap_or_default();
    assert!(
        why.contains("backlog") && why.contains("key") && why.contains("net.core.somaxconn"),
        "the node's page says which rule and field the agent refused: {page}"
    );
    let (_, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[0])).await?;
    let page: serde_json::Value = serde_json::from_str(&body)?;
    assert!(page["rulesRefused"].is_null(), "{page}");
    assert_eq!(
        metric(http, "nodekeeper_sweep_nodes_refusing_rules", &[]).await?,
        1.0
    );

    // The node gains the sysctl and a new revision goes out: taken, no longer counted.
    std::fs::remove_dir(&somaxconn_1)?;
    a1.set_sysctl("net.core.somaxconn", "4096")?;
    let rules_v2 = "tunables:\n  - name: backlog\n    key: net.core.somaxconn\n    atLeast: 2048\n";
    tuning.insert("rules.yaml", rules_v2);
    put_tuning(&client, &ns, &tuning).await?;
    wait_for("no agent refuses the new revision", t, || async {
        let s = summary(http).await?;
        Ok((s["fleet"]["refusingRules"] == 0).then_some(()))
    })
    .await?;
    wait_for("the gauge follows", Duration::from_secs(30), || async {
        Ok(
            (metric(http, "nodekeeper_sweep_nodes_refusing_rules", &[]).await? == 0.0)
                .then_some(()),
        )
    })
    .await?;

    // Two different bad versions of the ConfigMap: two Events, each with its own note.
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    tuning.insert("sweepInterval", "soon");
    put_tuning(&client, &ns, &tuning).await?;
    let first = wait_for("the first refusal's Event", t, || async {
        Ok(refusal_events(&events).await?.into_iter().next())
    })
    .await?;
    assert!(first.2.contains("key `sweepInterval`"), "{first:?}");
    tuning.insert("sweepInterval", "10s");
    let rules_bad =
        "tunables:\n  - name: backlog\n    key: net.core.somaxconn\n    atLeast: plenty\n";
    tuning.insert("rules.yaml", rules_bad);
    put_tuning(&client, &ns, &tuning).await?;
    let all = wait_for("a second Event for the second refusal", t, || async {
        let all = refusal_events(&events).await?;
        Ok((all.len() >= 2).then_some(all))
    })
    .await?;
    let second = all
        .iter()
        .find(|e| e.0 != first.0)
        .expect("two distinct Events");
    assert!(
        second
            .2
            .contains("key `rules.yaml: tunables[0].atLeast` (rule \"backlog\")"),
        "the second Event names the rule and the field: {second:?}"
    );
    assert!(!second.2.contains("sweepInterval"), "{second:?}");
    assert_ne!(first.1, second.1, "distinct refusals, distinct series");
    // The first Event still says what was wrong then.
    let again = all
        .iter()
        .find(|e| e.0 == first.0)
        .expect("first Event kept");
    assert_eq!(again.2, first.2);
    assert_eq!(all.len(), 2, "{all:?}");
    // The last good configuration (v2, 10s sweeps) stays in force.
    let s = summary(http).await?;
    assert_eq!(s["tuning"]["config"]["sweepInterval"], "10s");
    assert!(
        s["tuning"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .contains("tunables[0].atLeast"),
        "{s}"
    );

    drop((a0, a1, controller));
    Ok(())
}

/// A refusal ends when the ConfigMap goes back to the rules the refusing agent kept: the agent
/// is then not pushed to (it holds the revision wanted), and nothing is refused any more.
/// Regression: the refusal stayed counted (summary, gauge, `NodekeeperAgentsRefusingRules`)
/// until the controller restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_ends_when_the_rules_go_back_to_what_the_agent_holds() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-revert").await?;
    let group = unique_name("revert");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-revert", 2, &labels, &ips).await?;
    let port = free_port();

    let rules_v1 = "tunables:\n  - name: backlog\n    key: net.core.somaxconn\n    atLeast: 1024\n";
    let mut tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "30s"),
        ("callTimeout", "2s"),
        ("rules.yaml", rules_v1),
    ]
    .into();
    put_tuning(&client, &ns, &tuning).await?;
    let controller = ControllerProcess::start(&ns, "revert-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let a0 = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    let a1 = start_agent(&nodes[1], SocketAddr::new(ips[1].into(), port), &tls).await?;
    for agent in [&a0, &a1] {
        agent.set_sysctl("net.core.somaxconn", "4096")?;
    }
    let http = controller.http;
    let t = Duration::from_secs(60);

    // Node 1's agent takes v1.
    let node_1_rules = || async {
        let (_, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[1])).await?;
        let page: serde_json::Value = serde_json::from_str(&body)?;
        anyhow::Ok(page)
    };
    let held = wait_for("node 1's agent holds v1", t, || async {
        let page = node_1_rules().await?;
        let report = &page["report"];
        let took = report["tunables"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["rule"] == "backlog"));
        Ok(took.then(|| report["rulesRevision"].clone()))
    })
    .await?;

    // v2 adds a rule whose key is a directory on node 1 (a group of sysctls): its agent refuses
    // v2 and keeps v1. On node 0 the key is merely missing, which is no refusal.
    std::fs::create_dir_all(a1.sysctl_root.join("net/core/busy"))?;
    let rules_v2 = "tunables:\n  - name: backlog\n    key: net.core.somaxconn\n    atLeast: 1024\n  - name: busy\n    key: net.core.busy\n    atLeast: 50\n";
    tuning.insert("rules.yaml", rules_v2);
    put_tuning(&client, &ns, &tuning).await?;
    let fleet = wait_for("node 1's agent refuses v2", t, || async {
        let s = summary(http).await?;
        Ok((s["fleet"]["refusingRules"] == 1).then(|| s["fleet"].clone()))
    })
    .await?;
    assert_eq!(fleet["refusingRulesNodes"], serde_json::json!([nodes[1]]));
    let page = node_1_rules().await?;
    assert_eq!(
        page["report"]["rulesRevision"], held,
        "v1 stays in force on node 1: {page}"
    );

    // Back to v1, which node 1's agent still holds: nothing is refused any more.
    tuning.insert("rules.yaml", rules_v1);
    put_tuning(&client, &ns, &tuning).await?;
    wait_for(
        "the refusal ends with the ConfigMap back at v1",
        t,
        || async {
            let s = summary(http).await?;
            Ok((s["fleet"]["refusingRules"] == 0).then_some(()))
        },
    )
    .await?;
    let page = node_1_rules().await?;
    assert!(page["rulesRefused"].is_null(), "{page}");
    wait_for("the gauge follows", Duration::from_secs(30), || async {
        Ok(
            (metric(http, "nodekeeper_sweep_nodes_refusing_rules", &[]).await? == 0.0)
                .then_some(()),
        )
    })
    .await?;

    drop((a0, a1, controller));
    Ok(())
}
