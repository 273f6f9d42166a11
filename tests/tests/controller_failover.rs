//! What a user sees around failures, with real controller processes and real agents: a dead
//! agent shows in the summary and the metrics at once (its Node condition waits for
//! `staleAfter`), and a leader that shuts down cleanly takes its `nodekeeper.dev/leader` Pod
//! label off before it releases the Lease, so the Service never routes to a standby, and the
//! standby, which watches the Lease, takes it at once.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test controller_failover`.

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use controller_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, test_namespace, unique_name, wait_for};

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

fn group(prefix: &str) -> (BTreeMap<String, String>, String) {
    let group = unique_name(prefix);
    let labels = [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    (labels, format!("nodekeeper.dev/e2e-group={group}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agent_shows_in_the_summary_and_metrics_at_once() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-dead").await?;
    let (labels, selector) = group("dead");
    let ips = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-dead", 2, &labels, &ips).await?;
    let port = free_port();
    // The default staleAfter (15m) stands: the point is what shows before it.
    put_tuning(
        &client,
        &ns,
        &[("sweepInterval", "10s"), ("callTimeout", "2s")].into(),
    )
    .await?;
    let controller = ControllerProcess::start(&ns, "dead-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips) {
        agents.push(start_agent(node, SocketAddr::new((*ip).into(), port), &tls).await?);
    }
    for node in &nodes {
        wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            None,
            Duration::from_secs(60),
        )
        .await?;
    }
    let http = controller.http;
    let summary = || async move {
        let (status, body) = http_get(http, "/api/v1/summary").await?;
        anyhow::ensure!(status == 200, "/api/v1/summary answered {status}: {body}");
        Ok::<_, anyhow::Error>(serde_json::from_str::<serde_json::Value>(&body)?["fleet"].clone())
    };
    let before = summary().await?;
    assert_eq!(before["unreachable"], 0, "{before}");

    // Kill one agent. Its next read is due within the 10 s interval; the summary and the gauge
    // must say so then, not 15 minutes later.
    agents[1].stop();
    let dead = nodes[1].clone();
    let fleet = wait_for(
        "the summary to list the dead agent",
        Duration::from_secs(30),
        || {
            let dead = dead.clone();
            async move {
                let fleet = summary().await?;
                Ok((fleet["unreachable"] == 1
                    && fleet["unreachableNodes"] == serde_json::json!([dead]))
                .then_some(fleet))
            }
        },
    )
    .await?;
    assert_eq!(fleet["stale"], 0, "not stale before staleAfter: {fleet}");
    assert_eq!(
        metric(http, "nodekeeper_sweep_nodes_unreachable", &[]).await?,
        1.0
    );
    // The Node condition waits for staleAfter (README, "Dead agents").
    let node: k8s_openapi::api::core::v1::Node = Api::all(client.clone()).get(&dead).await?;
    assert_eq!(
        condition(&node, "NodekeeperReachable").map(|c| c.0),
        Some("True".to_owned())
    );
    drop(agents);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_shuts_down_takes_its_label_off_and_hands_over() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-label").await?;
    let (_labels, selector) = group("label");
    let port = free_port();
    put_tuning(&client, &ns, &[("sweepInterval", "10s")].into()).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for name in ["replica-a", "replica-b"] {
        pods.create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "nodekeeper-controller"}},
                "spec": {"containers": [{"name": "controller", "image": "nodekeeper-controller:test"}]},
            }))?,
        )
        .await?;
    }
    let env = |pod: &'static str| {
        vec![
            ("NODEKEEPER_LEASE_DURATION", "6s"),
            ("NODEKEEPER_RENEW_DEADLINE", "4s"),
            ("NODEKEEPER_RETRY_PERIOD", "1s"),
            ("NODEKEEPER_POD_NAME", pod),
        ]
    };
    let label = |pod: Pod| {
        pod.metadata
            .labels
            .and_then(|l| l.get("nodekeeper.dev/leader").cloned())
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let holder = || {
        let leases = leases.clone();
        async move {
            Ok::<_, anyhow::Error>(
                leases
                    .get_opt("nodekeeper-controller")
                    .await?
                    .and_then(|l| l.spec?.holder_identity),
            )
        }
    };
    // a starts alone, so it leads; then b stands by.
    let mut a = ControllerProcess::start(&ns, "replica-a", &selector, port, &env("replica-a"))?;
    wait_for(
        "replica-a to lead and label its Pod",
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move {
                let leads = holder().await?.as_deref() == Some("replica-a");
                let labelled = label(pods.get("replica-a").await?).as_deref() == Some("true");
                Ok((leads && labelled).then_some(()))
            }
        },
    )
    .await?;
    let b = ControllerProcess::start(&ns, "replica-b", &selector, port, &env("replica-b"))?;
    wait_for("replica-b to stand by", Duration::from_secs(30), || {
        let pods = pods.clone();
        async move {
            Ok((label(pods.get("replica-b").await?).as_deref() == Some("false")).then_some(()))
        }
    })
    .await?;

    // SIGTERM to the process this test started: a clean shutdown.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &a.pid().to_string()])
        .status()?;
    anyhow::ensure!(status.success(), "kill -TERM {} failed", a.pid());
    let exited = tokio::task::spawn_blocking(move || {
        let status = a.process.wait();
        (a, status)
    })
    .await?;
    let (_a, exit) = exited;
    let exited_at = std::time::Instant::now();
    assert!(exit?.success(), "replica-a exits cleanly on SIGTERM");
    assert_eq!(
        label(pods.get("replica-a").await?).as_deref(),
        Some("false"),
        "the old leader took its label off before it exited"
    );
    wait_for(
        "replica-b to take over and label its Pod",
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            async move {
                let leads = holder().await?.as_deref() == Some("replica-b");
                let labelled = label(pods.get("replica-b").await?).as_deref() == Some("true");
                Ok((leads && labelled).then_some(()))
            }
        },
    )
    .await?;
    // replica-b watches the Lease: it takes the released Lease at once, without waiting for a
    // poll or the lease duration (6 s).
    let took = exited_at.elapsed();
    eprintln!("replica-b leads and labelled its Pod {took:?} after replica-a exited");
    assert!(
        took < Duration::from_secs(3),
        "replica-b took {took:?} to lead after the release"
    );
    assert_eq!(
        label(pods.get("replica-a").await?).as_deref(),
        Some("false")
    );
    drop(b);
    Ok(())
}
