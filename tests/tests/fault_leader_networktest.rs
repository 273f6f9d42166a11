//! Fault campaign (issue #20): the leader is SIGKILLed while a `NetworkTest` is probing across
//! real agents. On a control plane of this test's own, with the API server's audit log: two
//! controller replicas share the Lease, three agents on 127.x.y.z ping each other for ~30 s, and
//! the leader dies a few seconds into the run, after it wrote `Running`. Until then the audit
//! log shows the leader renewing once per retry period and the standby, which watches the
//! Lease, making no request on it (issue #18). The standby takes the Lease within 15 s (one
//! lease duration after the last renewal), runs the test again from the start (the dead
//! leader's results died with it), and writes the final status; the audit log shows exactly one
//! status write per phase change (`Running` by the old leader, the result by the new one) and
//! no Node condition written again by the new leader.
//!
//! Run (as root: the agents' ICMP):
//! `cargo xtask test -- -p nodekeeper-e2e --test fault_leader_networktest`.

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

mod controller_common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use controller_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_api::names::{MANAGER_NETWORK_TEST, MANAGER_NODE_CONDITIONS};
use nodekeeper_e2e::controlplane::{Lifetime, Options};
use nodekeeper_e2e::rig::{ControllerConfig, Output, Program};
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// Lease timings for this test: a standby watches the Lease and takes over one lease duration
/// after the leader's last renewal (`runtime/leader.rs`), 10 s here, so at most 10 s after the
/// kill, plus a request.
const LEASE: [(&str, &str); 3] = [
    ("NODEKEEPER_LEASE_DURATION", "10s"),
    ("NODEKEEPER_RENEW_DEADLINE", "7s"),
    ("NODEKEEPER_RETRY_PERIOD", "2s"),
];
/// The takeover bound the issue sets.
const TAKEOVER: Duration = Duration::from_secs(15);
/// The lease duration set in [`LEASE`] and its retry period.
const LEASE_DURATION: Duration = Duration::from_secs(10);
const RETRY_PERIOD: Duration = Duration::from_secs(2);
/// Probes per pair, one a second: the test runs ~30 s each time it is started.
const COUNT: u64 = 30;

/// One status or condition write as the audit log records it.
#[derive(Debug)]
struct Write {
    at: SystemTime,
    code: i64,
}

/// PATCHes of `resource`/`name`'s status by field manager `manager`, from the audit log (one line
/// per request, at ResponseComplete).
fn status_patches(
    audit_log: &Path,
    resource: &str,
    name: &str,
    manager: &str,
) -> anyhow::Result<Vec<Write>> {
    let text = std::fs::read_to_string(audit_log)?;
    let mut out = Vec::new();
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)?;
        let object = &event["objectRef"];
        if event["verb"] == "patch"
            && object["resource"] == resource
            && object["subresource"] == "status"
            && object["name"] == name
            && event["requestURI"]
                .as_str()
                .is_some_and(|uri| uri.contains(&format!("fieldManager={manager}")))
        {
            let stamp = event["requestReceivedTimestamp"]
                .as_str()
                .context("audit event without requestReceivedTimestamp")?;
            let at: k8s_openapi::jiff::Timestamp = stamp.parse()?;
            out.push(Write {
                at: SystemTime::from(at),
                code: event["responseStatus"]["code"].as_i64().unwrap_or(0),
            });
        }
    }
    Ok(out)
}

/// An audited request on the controllers' Lease: (verb, code, stage, User-Agent, received,
/// completed).
type LeaseRequest = (String, i64, String, String, SystemTime, SystemTime);

/// Every audited request on the Lease `nodekeeper-controller` in `namespace`. Each replica names
/// itself in its User-Agent (`nodekeeper-controller/<version> (<identity>)`).
fn lease_requests(audit_log: &Path, namespace: &str) -> anyhow::Result<Vec<LeaseRequest>> {
    let text = std::fs::read_to_string(audit_log)?;
    let mut out = Vec::new();
    let time = |event: &serde_json::Value, field: &str| -> anyhow::Result<SystemTime> {
        let stamp = event[field]
            .as_str()
            .with_context(|| format!("audit event without {field}"))?;
        Ok(SystemTime::from(
            stamp.parse::<k8s_openapi::jiff::Timestamp>()?,
        ))
    };
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)?;
        let object = &event["objectRef"];
        if object["resource"] == "leases"
            && object["namespace"] == namespace
            && object["name"] == "nodekeeper-controller"
        {
            out.push((
                event["verb"].as_str().unwrap_or_default().to_owned(),
                event["responseStatus"]["code"].as_i64().unwrap_or(0),
                event["stage"].as_str().unwrap_or_default().to_owned(),
                event["userAgent"].as_str().unwrap_or_default().to_owned(),
                time(&event, "requestReceivedTimestamp")?,
                time(&event, "stageTimestamp")?,
            ));
        }
    }
    Ok(out)
}

async fn holder(leases: &Api<Lease>) -> anyhow::Result<Option<String>> {
    Ok(leases
        .get_opt("nodekeeper-controller")
        .await?
        .and_then(|l| l.spec?.holder_identity))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_mid_networktest_finishes_it_without_a_second_write()
-> anyhow::Result<()> {
    nodekeeper_testkit::skip_unless_root!("needs root for the agents' ICMP sockets");
    let mut options = Options::new(
        format!("test-{}-ntkill", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(options)).await??;
    let audit_log = cp.audit_log().context("audit enabled")?;
    let client = cp.client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-ntkill").await?;
    let group = unique_name("ntkill");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(3);
    let nodes = create_simulated_nodes(&client, "nk-ntkill", 3, &labels, &ips).await?;
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &[("sweepInterval", "10s"), ("callTimeout", "2s")].into(),
    )
    .await?;

    let program = Program::this_test_binary(HELPER, "controller")?;
    let replica = |identity: &str| {
        let config = ControllerConfig {
            kubeconfig: cp.kubeconfig().to_owned(),
            namespace: ns.clone(),
            identity: identity.to_owned(),
            http: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port())),
            agent_port: port,
            node_selector: selector.clone(),
            log: Some("info,kube=warn".into()),
            env: LEASE
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            output: Output::Stderr,
        };
        ControllerProcess::spawn(&program, &config)
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    // a starts alone, so it leads; b then stands by.
    let mut a = replica("replica-a")?;
    wait_for("replica-a to lead", Duration::from_secs(60), || {
        let leases = leases.clone();
        async move { Ok((holder(&leases).await?.as_deref() == Some("replica-a")).then_some(())) }
    })
    .await?;
    let b = replica("replica-b")?;

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
            Some("AgentReachable"),
            Duration::from_secs(90),
        )
        .await?;
    }
    // The standby answers its own metrics only once it serves HTTP: make sure it is up and
    // standing by before the leader dies.
    let b_http = b.http;
    wait_for(
        "replica-b to stand by",
        Duration::from_secs(30),
        || async move {
            Ok(
                (metric(b_http, "nodekeeper_controller_is_leader", &[]).await? == 0.0)
                    .then_some(()),
            )
        },
    )
    .await?;

    // From when replica-b watches the Lease to the kill: a steady window for issue #18's
    // "quieter leadership" (counted below).
    wait_for(
        "replica-b's watch of the Lease in the audit log",
        Duration::from_secs(30),
        || {
            let (audit_log, ns) = (audit_log.clone(), ns.clone());
            async move {
                Ok(lease_requests(&audit_log, &ns)?
                    .iter()
                    .any(|r| r.0 == "watch" && r.3.ends_with("(replica-b)"))
                    .then_some(()))
            }
        },
    )
    .await?;
    let window_from = SystemTime::now();

    let api: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);
    let mesh = unique_name("mesh");
    nodekeeper_e2e::apply_spec(
        &api,
        &mesh,
        json!({"kind": "icmp",
            "nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-group": group}},
            "count": COUNT, "intervalMs": 1000, "timeoutMs": 1000,
            "targets": [{"peers": {"perNode": 2}}], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let phase = |nt: &NetworkTest| nt.status.as_ref().and_then(|s| s.phase);
    wait_for(
        "the leader to start the test",
        Duration::from_secs(60),
        || {
            let api = api.clone();
            let mesh = mesh.clone();
            async move { Ok((phase(&api.get(&mesh).await?) == Some(Phase::Running)).then_some(())) }
        },
    )
    .await?;
    // Probes in flight on every agent, a few seconds into a ~30 s run.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let running = api.get(&mesh).await?;
    assert_eq!(phase(&running), Some(Phase::Running), "still running");
    let node_writes_before: Vec<usize> = nodes
        .iter()
        .map(|n| status_patches(&audit_log, "nodes", n, MANAGER_NODE_CONDITIONS).map(|w| w.len()))
        .collect::<Result<_, _>>()?;

    let killed_at = SystemTime::now();
    let killed = Instant::now();
    a.kill();
    wait_for("replica-b to take the Lease", TAKEOVER * 2, || {
        let leases = leases.clone();
        async move { Ok((holder(&leases).await?.as_deref() == Some("replica-b")).then_some(())) }
    })
    .await?;
    let takeover = killed.elapsed();
    eprintln!("takeover after SIGKILL mid-NetworkTest: {takeover:?}");
    assert!(takeover <= TAKEOVER, "takeover took {takeover:?}");
    // The watch shows the last renewal as it is written: a lease duration after it, not polls
    // later; and never before the lease expired (the last renewal was at most a retry period
    // before the kill).
    assert!(
        takeover <= LEASE_DURATION + Duration::from_secs(1),
        "takeover took {takeover:?} (lease duration {LEASE_DURATION:?})"
    );
    assert!(
        takeover + RETRY_PERIOD + Duration::from_millis(250) >= LEASE_DURATION,
        "takeover after {takeover:?}: before the lease expired"
    );

    // The steady window before the kill, from the audit log: the leader renewed once per retry
    // period (one PUT each, nothing else), the standby made no request on the Lease (its watch
    // stayed open).
    let window = killed_at.duration_since(window_from)?;
    let in_window: Vec<LeaseRequest> = lease_requests(&audit_log, &ns)?
        .into_iter()
        .filter(|r| r.4 >= window_from && r.5 <= killed_at)
        .collect();
    let of = |who: &str| -> Vec<(String, i64)> {
        in_window
            .iter()
            .filter(|r| r.3.ends_with(&format!("({who})")))
            .map(|r| (r.0.clone(), r.1))
            .collect()
    };
    let leader_requests = of("replica-a");
    let most = (window.as_secs_f64() / RETRY_PERIOD.as_secs_f64()).floor() as usize + 1;
    eprintln!(
        "steady window {window:?}: the leader made {} requests on the Lease, the standby {}",
        leader_requests.len(),
        of("replica-b").len()
    );
    assert!(
        leader_requests
            .iter()
            .all(|r| *r == ("update".to_owned(), 200)),
        "the leader only renewed: {leader_requests:?}"
    );
    assert!(
        (1..=most).contains(&leader_requests.len()),
        "{} renewals in {window:?} at one per {RETRY_PERIOD:?}",
        leader_requests.len()
    );
    assert_eq!(
        of("replica-b"),
        vec![],
        "the standby neither read nor wrote the Lease while it watched"
    );

    // The new leader runs the test again from the start and finishes it.
    let done = wait_for(
        &format!("networktest {mesh} to finish"),
        Duration::from_secs(120),
        || {
            let api = api.clone();
            let mesh = mesh.clone();
            async move {
                let nt = api.get(&mesh).await?;
                Ok(phase(&nt)
                    .is_some_and(|p| matches!(p, Phase::Succeeded | Phase::Failed))
                    .then_some(nt))
            }
        },
    )
    .await?;
    let s = done.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:?}");
    assert_eq!((s.sources, s.sources_unreachable), (3, 0), "{s:?}");
    assert_eq!((s.pairs, s.pairs_failed), (6, 0), "{s:?}");
    // Every pair's full count: one complete run, not the dead leader's half added to it.
    assert_eq!((s.sent, s.received), (6 * COUNT, 6 * COUNT), "{s:?}");
    let start = running
        .status
        .as_ref()
        .and_then(|s| s.start_time.clone())
        .context("Running status carries its start time")?;
    assert_eq!(
        s.start_time,
        Some(start),
        "the start time is the first run's"
    );
    // The full results are served by the new leader.
    let (code, body) = http_get(b.http, &format!("/api/networktests/{ns}/{mesh}")).await?;
    assert_eq!(code, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(page["totalPairs"], 6, "{body}");

    // Anything written twice would show within seconds of the final status.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let writes = status_patches(&audit_log, "networktests", &mesh, MANAGER_NETWORK_TEST)?;
    assert_eq!(
        writes.len(),
        2,
        "one status write per phase change (Running, then the result): {writes:?}"
    );
    assert!(writes.iter().all(|w| w.code == 200), "{writes:?}");
    assert!(
        writes[0].at < killed_at && writes[1].at > killed_at,
        "Running by the old leader, the result by the new one: {writes:?} (killed at {killed_at:?})"
    );
    for (node, before) in nodes.iter().zip(node_writes_before) {
        let after = status_patches(&audit_log, "nodes", node, MANAGER_NODE_CONDITIONS)?;
        assert!(
            before <= 1,
            "{node}: {before} condition writes before the kill"
        );
        assert_eq!(
            after.len(),
            before,
            "{node}: the new leader wrote no condition again: {after:?}"
        );
    }
    drop((agents, b));
    Ok(())
}
