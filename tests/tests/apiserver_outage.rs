//! Fault campaign (issue #20): kube-apiserver away for a minute, on a control plane of this test's
//! own (stopping the shared one would fail every other test). The leader cannot renew its Lease
//! and exits, as designed (its Pod restarts as a standby); a replica started while the API server
//! is still away waits for it instead of exiting (no crash loop); once the API server answers
//! again, that replica takes over, reads the fleet and writes nothing that did not change — the
//! node's condition keeps its status and transition time.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test apiserver_outage`.

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use controller_common::*;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use nodekeeper_e2e::{
    ControlPlane, Lifetime, Options, create_simulated_nodes, install_crds, test_namespace,
    unique_name, wait_for,
};

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// How long the API server is away.
const OUTAGE: Duration = Duration::from_secs(60);

/// Keeps kube-apiserver stopped (SIGSTOP: it holds its connections and answers nothing, like a
/// hung or partitioned server) until dropped, whatever happens to the test.
struct Paused(Pid);

impl Paused {
    fn new(pid: u32) -> anyhow::Result<Self> {
        let pid = Pid::from_raw(i32::try_from(pid)?);
        kill(pid, Signal::SIGSTOP)?;
        Ok(Self(pid))
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = kill(self.0, Signal::SIGCONT);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minute_without_the_api_server_ends_in_one_clean_takeover() -> anyhow::Result<()> {
    let name = format!("test-{}-outage", std::process::id());
    let cp = ControlPlane::start(Options::new(name, Lifetime::WithThisProcess))?;
    let client = cp.client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-outage").await?;
    let group = unique_name("outage");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, "nk-outage", 1, &labels, &ips).await?;
    let node = &nodes[0];
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &[
            ("sweepInterval", "10s"),
            ("staleAfter", "5m"),
            ("callTimeout", "2s"),
        ]
        .into(),
    )
    .await?;
    let logs = tempfile::tempdir()?;
    let mut a = spawn_logged(
        &cp,
        &ns,
        "outage-a",
        &selector,
        port,
        &logs.path().join("a.log"),
    )?;
    let tls = agent_tls(&client, &ns).await?;
    let _agent = start_agent(node, SocketAddr::new(ips[0].into(), port), &tls).await?;
    let t = Duration::from_secs(90);
    let (_, _, _) = wait_condition(
        &client,
        node,
        "NodekeeperReachable",
        "True",
        Some("AgentReachable"),
        t,
    )
    .await?;
    let transition = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "NodekeeperReachable"))
            .and_then(|c| c.last_transition_time.clone())
    };
    let nodes_api: Api<Node> = Api::all(client.clone());
    let before = transition(&nodes_api.get(node).await?);
    assert!(before.is_some());

    // The outage.
    let apiserver = cp
        .component_pid("kube-apiserver")
        .ok_or_else(|| anyhow::anyhow!("no kube-apiserver pid"))?;
    let stopped = Instant::now();
    let paused = Paused::new(apiserver)?;
    // The leader gives up once it cannot renew within its deadline, and exits.
    wait_for("the leader to give up its Lease and exit", OUTAGE, || {
        let exited = a.process.check_alive().is_err();
        async move { Ok(exited.then_some(())) }
    })
    .await?;
    let log_a = std::fs::read_to_string(logs.path().join("a.log"))?;
    assert!(log_a.contains("lost the lease"), "why it exited: {log_a}");
    // Its replacement starts while the API server is still away, and waits.
    let mut b = spawn_logged(
        &cp,
        &ns,
        "outage-b",
        &selector,
        port,
        &logs.path().join("b.log"),
    )?;
    tokio::time::sleep(
        OUTAGE
            .saturating_sub(stopped.elapsed())
            .max(Duration::from_secs(15)),
    )
    .await;
    b.process
        .check_alive()
        .map_err(|e| anyhow::anyhow!("a controller started during the outage must wait: {e}"))?;
    let outage = stopped.elapsed();
    drop(paused);

    // Back: the new replica takes over and reads the node; nothing changed, nothing is written.
    let http = b.http;
    let page = wait_for(
        "the new leader to read the node",
        Duration::from_secs(120),
        || async {
            let (status, body) = http_get(http, &format!("/api/v1/nodes/{node}")).await?;
            let page: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            Ok((status == 200 && page["report"]["nodeName"] == node.as_str()).then_some(page))
        },
    )
    .await?;
    assert_eq!(page["stale"], false, "{page}");
    b.process.check_alive()?;
    let after = nodes_api.get(node).await?;
    assert_eq!(
        condition(&after, "NodekeeperReachable").map(|c| c.0),
        Some("True".to_owned())
    );
    assert_eq!(
        transition(&after),
        before,
        "the condition was not flipped by the outage"
    );
    eprintln!(
        "API server stopped for {:.0}s; the new leader read the node again",
        outage.as_secs_f64()
    );
    drop((a, b));
    Ok(())
}
