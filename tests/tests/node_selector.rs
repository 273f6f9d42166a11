//! `--node-selector` against the real control plane: a node whose labels stop matching loses the
//! conditions the sweep wrote on it (and keeps another writer's), while a node still selected
//! keeps its own; a controller restarted in the same namespace with a narrower selector takes
//! the sweep's conditions off the nodes the previous selector selected and the new one does not
//! (the previous selector is recorded on the leader Lease), and records the new one; and a
//! malformed selector stops the controller at start with a message naming the flag, the bad part
//! and an example.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test node_selector`.

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use controller_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;
use kube::api::{Patch, PatchParams};
use nodekeeper_controller::controllers::nodes::unselected::RECORD_ANNOTATION;
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, test_namespace, unique_name, wait_for};
use serde_json::json;

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// The label that selects this test's nodes.
const GROUP: &str = "nodekeeper.dev/e2e-group";
/// A second label, to narrow the selection.
const POOL: &str = "nodekeeper.dev/e2e-pool";

/// A fast sweep, so conditions are written within seconds.
async fn fast_tuning(client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "10s"),
        ("callTimeout", "2s"),
    ]
    .into();
    put_tuning(client, ns, &tuning).await
}

/// Whether the sweep's field manager owns any condition of `node`'s (an emptied managedFields
/// entry, if the API server kept one, owns none).
fn sweep_owns_status(node: &Node) -> bool {
    let managed = node.metadata.managed_fields.as_deref().unwrap_or_default();
    !nodekeeper_controller::conditions::managed_condition_types(managed).is_empty()
}

/// Waits until `node` carries none of the sweep's conditions: no `NodekeeperReachable`, and
/// nothing in its status owned by the sweep's field manager.
async fn wait_cleaned(
    client: &kube::Client,
    node: &str,
    timeout: Duration,
) -> anyhow::Result<Node> {
    let api: Api<Node> = Api::all(client.clone());
    wait_for(
        &format!("{node} without the sweep's conditions"),
        timeout,
        || {
            let api = api.clone();
            async move {
                let n = api.get(node).await?;
                match (condition(&n, "NodekeeperReachable"), sweep_owns_status(&n)) {
                    (None, false) => Ok(Some(n)),
                    now => Err(anyhow::anyhow!(
                        "(NodekeeperReachable, sweep owns status) is now {now:?}"
                    )),
                }
            }
        },
    )
    .await
}

/// Waits until the controller in `ns` has recorded `selector` as the one in force (on its
/// leader Lease).
async fn wait_recorded(client: &kube::Client, ns: &str, selector: &str) -> anyhow::Result<()> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    wait_for(
        &format!("{selector:?} recorded"),
        Duration::from_secs(30),
        || {
            let leases = leases.clone();
            async move {
                // On the leader Lease, the only one in the namespace.
                let recorded: Vec<Option<String>> = leases
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .map(|l| l.metadata.annotations?.get(RECORD_ANNOTATION).cloned())
                    .collect();
                if recorded.iter().any(|r| r.as_deref() == Some(selector)) {
                    Ok(Some(()))
                } else {
                    Err(anyhow::anyhow!("recorded now: {recorded:?}"))
                }
            }
        },
    )
    .await
}

/// Sets (`Some`) or removes (`None`) label `key` on `node`.
async fn set_label(
    client: &kube::Client,
    node: &str,
    key: &str,
    value: Option<&str>,
) -> anyhow::Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let patch = json!({"metadata": {"labels": {key: value}}});
    api.patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_leaves_the_selector_loses_the_sweeps_conditions() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-sel-live").await?;
    let group = unique_name("sel-live");
    let labels: BTreeMap<String, String> = [(GROUP.to_string(), group.clone())].into();
    let ips = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-sel-live", 2, &labels, &ips).await?;
    let port = free_port();
    fast_tuning(&client, &ns).await?;

    let mut controller =
        ControllerProcess::start(&ns, "sel-live", &format!("{GROUP}={group}"), port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let _a0 = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    let _a1 = start_agent(&nodes[1], SocketAddr::new(ips[1].into(), port), &tls).await?;
    let t = Duration::from_secs(90);
    for node in &nodes {
        wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            Some("AgentReachable"),
            t,
        )
        .await?;
    }

    // Another writer's condition on the node that will leave: not the sweep's, so it stays.
    let api: Api<Node> = Api::all(client.clone());
    let other = json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": nodes[0]},
        "status": {"conditions": [{
            "type": "E2eOtherWriter", "status": "True", "reason": "Written", "message": "by e2e",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]},
    });
    api.patch_status(
        &nodes[0],
        &PatchParams::apply("e2e-other-writer"),
        &Patch::Apply(&other),
    )
    .await?;

    // Node 0 leaves the selection: its label goes.
    set_label(&client, &nodes[0], GROUP, None).await?;
    let cleaned = wait_cleaned(&client, &nodes[0], Duration::from_secs(60)).await?;
    assert!(
        condition(&cleaned, "E2eOtherWriter").is_some(),
        "another writer's condition stays: {:?}",
        cleaned.status.and_then(|s| s.conditions)
    );
    controller.process.check_alive()?;

    // Node 1, still selected, keeps the sweep's conditions, a sweep and more later.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let n1 = api.get(&nodes[1]).await?;
    assert_eq!(
        condition(&n1, "NodekeeperReachable")
            .map(|(s, _, _)| s)
            .as_deref(),
        Some("True"),
        "the selected node keeps its conditions"
    );
    assert!(sweep_owns_status(&n1));
    // And node 0 stays clean: the sweep reads it no more (nor writes it again after SETTLE's
    // second look, which finds nothing to do).
    let n0 = api.get(&nodes[0]).await?;
    assert_eq!(condition(&n0, "NodekeeperReachable"), None);
    controller.stop();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restarted_with_a_narrower_selector_cleans_the_nodes_outside_it()
-> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-sel-start").await?;
    let group = unique_name("sel-start");
    let labels: BTreeMap<String, String> = [(GROUP.to_string(), group.clone())].into();
    let ips = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-sel-start", 2, &labels, &ips).await?;
    set_label(&client, &nodes[0], POOL, Some("a")).await?;
    set_label(&client, &nodes[1], POOL, Some("b")).await?;
    let port = free_port();
    fast_tuning(&client, &ns).await?;

    // The first controller manages both nodes, and records its selector on its Lease (only
    // the nodes a recorded selector selected are scanned at a later start: nodes outside this
    // test's group are other tests').
    let wide_selector = format!("{GROUP}={group}");
    let mut wide = ControllerProcess::start(&ns, "sel-wide", &wide_selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let _a0 = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    let _a1 = start_agent(&nodes[1], SocketAddr::new(ips[1].into(), port), &tls).await?;
    let t = Duration::from_secs(90);
    for node in &nodes {
        wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            Some("AgentReachable"),
            t,
        )
        .await?;
    }
    wait_recorded(&client, &ns, &wide_selector).await?;
    // Stopped cleanly (the Lease released): nothing removed while no controller runs.
    wide.stop();
    let api: Api<Node> = Api::all(client.clone());
    assert!(sweep_owns_status(&api.get(&nodes[1]).await?));

    // Restarted with pool a only: node 1 is now outside and loses the sweep's conditions.
    let mut narrow = ControllerProcess::start(
        &ns,
        "sel-narrow",
        &format!("{GROUP}={group},{POOL} in (a)"),
        port,
        &[],
    )?;
    wait_cleaned(&client, &nodes[1], Duration::from_secs(90)).await?;
    narrow.process.check_alive()?;
    // The narrower selector is recorded once its nodes are clean.
    wait_recorded(&client, &ns, &format!("{GROUP}={group},{POOL} in (a)")).await?;
    let n0 = api.get(&nodes[0]).await?;
    assert_eq!(
        condition(&n0, "NodekeeperReachable")
            .map(|(s, _, _)| s)
            .as_deref(),
        Some("True"),
        "the node still selected keeps its conditions"
    );
    narrow.stop();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_selector_stops_the_controller_at_start() -> anyhow::Result<()> {
    let cp = ControlPlane::shared();
    let client = cp.client().await?;
    let ns = test_namespace(&client, "nk-sel-bad").await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("controller.log");
    let mut controller = spawn_logged(cp, &ns, "sel-bad", "pool=gpu,,zone=a", free_port(), &log)?;
    let status = tokio::task::block_in_place(|| controller.process.wait())?;
    assert!(!status.success(), "refused: {status}");
    let text = std::fs::read_to_string(&log)?;
    for part in [
        "--node-selector \"pool=gpu,,zone=a\"",
        "empty requirement",
        "e.g. `",
    ] {
        assert!(text.contains(part), "the log names {part:?}: {text}");
    }
    Ok(())
}
