//! Leadership and certificates with real processes: two controller replicas share one Lease,
//! only the holder writes, killing the holder hands over within the lease duration without a
//! second write of any condition, and the leader's Pod label (which the Service selects)
//! follows the Lease; and two replicas creating the PKI at once end with one CA.
//!
//! Run: `cargo test -p nodekeeper-e2e --test controller_leader`.

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use controller_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::PostParams;
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, test_namespace, unique_name, wait_for};

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

fn leader_label(pod: &Pod) -> Option<String> {
    pod.metadata
        .labels
        .as_ref()?
        .get("nodekeeper.dev/leader")
        .cloned()
}

async fn holder(leases: &Api<Lease>) -> anyhow::Result<Option<String>> {
    Ok(leases
        .get_opt("nodekeeper-controller")
        .await?
        .and_then(|l| l.spec?.holder_identity))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_hands_over_without_writing_twice() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-leader").await?;
    let group = unique_name("leader");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(3);
    let nodes = create_simulated_nodes(&client, "nk-leader", 3, &labels, &ips).await?;
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &[
            ("sweepInterval", "10s"),
            ("staleAfter", "30s"),
            ("callTimeout", "2s"),
        ]
        .into(),
    )
    .await?;

    // Short lease timings keep the test short; the arithmetic is the production one.
    let lease_duration = Duration::from_secs(6);
    let retry = Duration::from_secs(1);
    let timing = [
        ("NODEKEEPER_LEASE_DURATION", "6s"),
        ("NODEKEEPER_RENEW_DEADLINE", "4s"),
        ("NODEKEEPER_RETRY_PERIOD", "1s"),
    ];
    // Each replica's Pod (as the Deployment would have made it), so the leader label that
    // routes the Service to the leader can be checked.
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
    let with_pod = |pod: &'static str| {
        let mut env: Vec<(&str, &str)> = timing.to_vec();
        env.push(("NODEKEEPER_POD_NAME", pod));
        env
    };
    // Both replicas start together: they race for the Lease and for the PKI.
    let mut a =
        ControllerProcess::start(&ns, "replica-a", &selector, port, &with_pod("replica-a"))?;
    let mut b =
        ControllerProcess::start(&ns, "replica-b", &selector, port, &with_pod("replica-b"))?;

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let first = wait_for("a Lease holder", Duration::from_secs(60), || {
        let leases = leases.clone();
        async move { holder(&leases).await }
    })
    .await?;
    let (leader, standby) = if first == a.identity {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert_eq!(first, leader.identity);

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
    // Only the holder acts: it wrote each node once; the standby wrote and read nothing.
    let leader_http = leader.http;
    wait_for(
        "the leader's writes to settle",
        Duration::from_secs(30),
        || async move {
            Ok(
                (metric(leader_http, "nodekeeper_conditions_patches_total", &[]).await? >= 3.0)
                    .then_some(()),
            )
        },
    )
    .await?;
    assert_eq!(
        metric(leader.http, "nodekeeper_conditions_patches_total", &[]).await?,
        3.0
    );
    assert_eq!(
        metric(standby.http, "nodekeeper_conditions_patches_total", &[]).await?,
        0.0
    );
    assert_eq!(
        metric(standby.http, "nodekeeper_sweep_agent_calls_total", &[]).await?,
        0.0
    );
    assert_eq!(
        metric(standby.http, "nodekeeper_controller_is_leader", &[]).await?,
        0.0
    );
    assert_eq!(http_get(standby.http, "/api/v1/summary").await?.0, 503);
    // The Service selects `nodekeeper.dev/leader=true`: only the leader's Pod carries it.
    let leader_pod = leader.identity.clone();
    let standby_pod = standby.identity.clone();
    wait_for("the leader's Pod label", Duration::from_secs(30), || {
        let pods = pods.clone();
        let (leader_pod, standby_pod) = (leader_pod.clone(), standby_pod.clone());
        async move {
            let l = leader_label(&pods.get(&leader_pod).await?);
            let s = leader_label(&pods.get(&standby_pod).await?);
            Ok((l.as_deref() == Some("true") && s.as_deref() == Some("false")).then_some(()))
        }
    })
    .await?;

    // Kill the leader (SIGKILL, no release) and time the handover.
    let killed = Instant::now();
    leader.kill();
    let standby_id = standby.identity.clone();
    let new_holder = wait_for("the standby to take the Lease", lease_duration * 3, || {
        let leases = leases.clone();
        let standby_id = standby_id.clone();
        async move { Ok(holder(&leases).await?.filter(|h| *h == standby_id)) }
    })
    .await?;
    let handover = killed.elapsed();
    assert_eq!(new_holder, standby.identity);
    // Local-clock expiry: the standby watches the Lease, so it sees the last renewal (at most a
    // retry period before the kill) as it is written and takes over a lease duration later: not
    // before the lease expired, and not polls later (it used to poll every second).
    assert!(
        handover + retry + Duration::from_millis(250) >= lease_duration,
        "handover took {handover:?}: before the lease expired"
    );
    assert!(
        handover <= lease_duration + Duration::from_secs(1),
        "handover took {handover:?}"
    );
    eprintln!("handover after SIGKILL: {handover:?} (lease duration {lease_duration:?})");

    // The new leader rebuilds its state from the Nodes and the agents: it reads every agent
    // and writes nothing, because nothing changed.
    let new_http = standby.http;
    wait_for(
        "the new leader to read every agent",
        Duration::from_secs(60),
        || async move {
            Ok((metric(new_http, "nodekeeper_sweep_nodes_read", &[]).await? >= 3.0).then_some(()))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(metric(standby.http, "nodekeeper_sweep_agent_calls_total", &[]).await? >= 3.0);
    assert_eq!(
        leader_label(&pods.get(&standby.identity).await?).as_deref(),
        Some("true"),
        "the new leader labels its Pod, so the Service follows the handover"
    );
    assert_eq!(
        metric(standby.http, "nodekeeper_conditions_patches_total", &[]).await?,
        0.0,
        "no condition written twice"
    );

    // One CA, and both leaves chain to it.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let field = |s: &Secret, k: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| b.0.clone())
            .unwrap_or_default()
    };
    let ca = secrets.get("nodekeeper-ca").await?;
    for leaf in ["nodekeeper-agent-tls", "nodekeeper-controller-tls"] {
        assert_eq!(
            field(&secrets.get(leaf).await?, "ca.crt"),
            field(&ca, "tls.crt"),
            "{leaf} chains to the one CA"
        );
    }
    drop(agents);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_creating_the_pki_at_once_end_with_one_ca() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-pki").await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let (a, b) = tokio::join!(
        nodekeeper_controller::certs::ensure(&secrets),
        nodekeeper_controller::certs::ensure(&secrets)
    );
    let (a, _) = a?;
    let (b, _) = b?;
    assert_eq!(a.ca, b.ca, "both replicas ended with the same CA");
    assert_eq!(a.cert, b.cert, "and the same controller certificate");
    // Idempotent: a third run changes nothing.
    let before = secrets
        .get("nodekeeper-agent-tls")
        .await?
        .metadata
        .resource_version;
    let (c, renewed) = nodekeeper_controller::certs::ensure(&secrets).await?;
    assert!(!renewed);
    assert_eq!(c, a);
    assert_eq!(
        secrets
            .get("nodekeeper-agent-tls")
            .await?
            .metadata
            .resource_version,
        before
    );

    // Renewal: a leaf that can no longer be read as a valid certificate (as one past two thirds
    // of its validity is treated) is reissued from the same CA, in place.
    let mut agent_secret = secrets.get("nodekeeper-agent-tls").await?;
    agent_secret.data.get_or_insert_default().insert(
        "tls.crt".into(),
        k8s_openapi::ByteString(b"expired".to_vec()),
    );
    secrets
        .replace(
            "nodekeeper-agent-tls",
            &PostParams::default(),
            &agent_secret,
        )
        .await?;
    let (d, renewed) = nodekeeper_controller::certs::ensure(&secrets).await?;
    assert!(renewed, "the unreadable agent leaf was reissued");
    assert_eq!(d.ca, a.ca, "renewal keeps the CA");
    let reissued = secrets.get("nodekeeper-agent-tls").await?;
    let pem = |k: &str| {
        String::from_utf8(
            reissued
                .data
                .as_ref()
                .and_then(|m| m.get(k))
                .map(|b| b.0.clone())
                .unwrap_or_default(),
        )
        .unwrap_or_default()
    };
    assert!(pem("tls.crt").starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(!nodekeeper_controller::certs::needs_renewal(
        &pem("tls.crt"),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs() as i64
    ));
    assert_eq!(pem("ca.crt"), a.ca);
    Ok(())
}
