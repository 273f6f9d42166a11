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

/// The CA rotation of `certs` (and the README's Certificates section), step by step against the
/// API server: after each edit of the CA Secret and the leader's check, the agent's leaf is
/// trusted by the controller's bundle and the controller's leaf by the agent's, so no step
/// leaves a pair of peers without a common trust anchor; the leaves are reissued only when the
/// signing CA changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_rotation_keeps_a_common_trust_anchor_at_every_step() -> anyhow::Result<()> {
    use nodekeeper_controller::certs::{ensure, generate_ca, issued_by};
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-rotate").await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let text = |s: &Secret, k: &str| {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .unwrap_or_default()
    };
    let pems = |bundle: &str| -> Vec<String> {
        bundle
            .split_inclusive("-----END CERTIFICATE-----\n")
            .filter(|p| p.contains("BEGIN CERTIFICATE"))
            .map(|p| p.trim_start().to_owned())
            .collect()
    };
    // (agent leaf, agent's trust, controller leaf, controller's trust), read back.
    let leaves = || async {
        let agent = secrets.get("nodekeeper-agent-tls").await?;
        let controller = secrets.get("nodekeeper-controller-tls").await?;
        anyhow::Ok((
            text(&agent, "tls.crt"),
            text(&agent, "ca.crt"),
            text(&controller, "tls.crt"),
            text(&controller, "ca.crt"),
        ))
    };
    let trusted = |leaf: &str, bundle: &str| pems(bundle).iter().any(|ca| issued_by(leaf, ca));
    let edit_ca = |changes: Vec<(&'static str, String)>| {
        let secrets = secrets.clone();
        async move {
            let mut ca = secrets.get("nodekeeper-ca").await?;
            for (k, v) in changes {
                ca.data
                    .get_or_insert_default()
                    .insert(k.into(), k8s_openapi::ByteString(v.into_bytes()));
            }
            secrets
                .replace("nodekeeper-ca", &PostParams::default(), &ca)
                .await?;
            anyhow::Ok(())
        }
    };

    let (first, _) = ensure(&secrets).await?;
    let old_ca = text(&secrets.get("nodekeeper-ca").await?, "tls.crt");
    let (agent0, _, controller0, _) = leaves().await?;
    let (new_ca, new_key) = generate_ca()?;

    // 1. Both CAs in the CA Secret's bundle: both leaves trust both, and keep their certificates.
    edit_ca(vec![("ca.crt", format!("{old_ca}{new_ca}"))]).await?;
    let (pem, renewed) = ensure(&secrets).await?;
    assert!(!renewed, "a new bundle reissues nothing");
    let (agent1, agent_trust, controller1, controller_trust) = leaves().await?;
    assert_eq!((&agent1, &controller1), (&agent0, &controller0));
    for bundle in [&agent_trust, &controller_trust, &pem.ca] {
        assert_eq!(pems(bundle).len(), 2, "{bundle}");
    }
    assert!(trusted(&agent1, &controller_trust) && trusted(&controller1, &agent_trust));

    // 2. The new CA signs: both leaves are reissued from it; peers still serving the old leaf
    //    are trusted through the bundle.
    edit_ca(vec![("tls.crt", new_ca.clone()), ("tls.key", new_key)]).await?;
    let (pem, renewed) = ensure(&secrets).await?;
    assert!(renewed, "leaves of the old CA are reissued");
    let (agent2, agent_trust, controller2, controller_trust) = leaves().await?;
    assert!(issued_by(&agent2, &new_ca) && issued_by(&controller2, &new_ca));
    assert_eq!(pem.cert, controller2);
    for (leaf, bundle) in [
        (&agent2, &pem.ca),
        (&agent0, &pem.ca),
        (&controller2, &agent_trust),
        (&controller0, &agent_trust),
        (&agent2, &controller_trust),
    ] {
        assert!(trusted(leaf, bundle), "every leaf in use is trusted");
    }

    // 3. The old CA dropped: the bundles hold the new one only; the leaves stay.
    edit_ca(vec![("ca.crt", new_ca.clone())]).await?;
    let (pem, renewed) = ensure(&secrets).await?;
    assert!(!renewed);
    let (agent3, agent_trust, controller3, _) = leaves().await?;
    assert_eq!((&agent3, &controller3), (&agent2, &controller2));
    assert_eq!(pems(&agent_trust), std::slice::from_ref(&new_ca));
    assert_eq!(pems(&pem.ca), std::slice::from_ref(&new_ca));
    assert!(
        !trusted(&agent0, &pem.ca),
        "the old CA's leaves are no longer trusted"
    );
    assert_ne!(first.ca, pem.ca);
    Ok(())
}

/// A CA Secret that cannot sign (rotation step 2 half done: the new certificate with the old
/// key) is refused before anything is written: `ensure` names the Secret and the field, and
/// both leaves stay as they were, still chained to the CA that signed them. Without the check
/// the leaves were reissued with a signature no peer accepts, on every check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_secret_whose_key_is_not_its_certificates_is_refused_and_nothing_changes()
-> anyhow::Result<()> {
    use nodekeeper_controller::certs::{CertError, ensure, generate_ca};
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-badca").await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    ensure(&secrets).await?;
    let versions = || async {
        let mut out = Vec::new();
        for name in ["nodekeeper-agent-tls", "nodekeeper-controller-tls"] {
            out.push(secrets.get(name).await?.metadata.resource_version);
        }
        anyhow::Ok(out)
    };
    let before = versions().await?;
    let (new_ca, _) = generate_ca()?;
    let mut ca = secrets.get("nodekeeper-ca").await?;
    ca.data.get_or_insert_default().insert(
        "tls.crt".into(),
        k8s_openapi::ByteString(new_ca.into_bytes()),
    );
    secrets
        .replace("nodekeeper-ca", &PostParams::default(), &ca)
        .await?;
    for _ in 0..2 {
        match ensure(&secrets).await {
            Err(error @ CertError::BadCa { field, .. }) => {
                assert_eq!(field, "tls.key", "{error}");
                assert!(error.to_string().contains("nodekeeper-ca"), "{error}");
            }
            other => panic!("expected the CA Secret refused, got {other:?}"),
        }
    }
    assert_eq!(versions().await?, before, "no leaf was written");
    Ok(())
}

/// A replica that takes the Lease but cannot start leading (here: a CA Secret whose key is not
/// its certificate's) releases the Lease before it exits, so the standby need not wait a lease
/// duration, and never labels its Pod leader (the label means "ready to serve").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_cannot_start_releases_the_lease_and_is_never_labelled() -> anyhow::Result<()>
{
    use nodekeeper_controller::certs::generate_ca;
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-nostart").await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let (cert, _) = generate_ca()?;
    let (_, other_key) = generate_ca()?;
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": {"name": "nodekeeper-ca"},
                "type": "kubernetes.io/tls",
                "stringData": {"tls.crt": cert, "tls.key": other_key},
            }))?,
        )
        .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({
            "metadata": {"name": "replica-a", "labels": {"app.kubernetes.io/name": "nodekeeper-controller"}},
            "spec": {"containers": [{"name": "controller", "image": "nodekeeper-controller:test"}]},
        }))?,
    )
    .await?;
    let env = [
        ("NODEKEEPER_LEASE_DURATION", "30s"),
        ("NODEKEEPER_RENEW_DEADLINE", "20s"),
        ("NODEKEEPER_RETRY_PERIOD", "2s"),
        ("NODEKEEPER_POD_NAME", "replica-a"),
    ];
    let selector = format!("nodekeeper.dev/e2e-group={}", unique_name("nostart"));
    let mut a = ControllerProcess::start(&ns, "replica-a", &selector, free_port(), &env)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while a.process.check_alive().is_ok() {
        anyhow::ensure!(Instant::now() < deadline, "the controller did not exit");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let lease = leases
        .get_opt("nodekeeper-controller")
        .await?
        .ok_or_else(|| anyhow::anyhow!("the controller never took the Lease"))?;
    let spec = lease.spec.unwrap_or_default();
    assert!(spec.acquire_time.is_some(), "it took the Lease: {spec:?}");
    assert_eq!(spec.holder_identity, None, "and released it before exiting");
    let pod = pods.get("replica-a").await?;
    assert_ne!(leader_label(&pod).as_deref(), Some("true"));
    Ok(())
}

/// A Lease deleted under its holder is not taken at once: the holder learns of the loss only at
/// its next renewal (and writes until then), so the standby creates it only once the holder's
/// record, as it last saw it change, would have expired; by then the holder has given up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_lease_is_taken_only_after_its_holders_record_would_have_expired()
-> anyhow::Result<()> {
    use kube::api::DeleteParams;
    use nodekeeper_controller::runtime::leader::{self, LeaderConfig};
    use tokio_util::sync::CancellationToken;
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-deleted").await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let timing = |identity: &str| LeaderConfig {
        name: "deleted".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(6),
        renew_deadline: Duration::from_secs(4),
        retry_period: Duration::from_secs(2),
        annotations: Default::default(),
    };
    let (a, b) = (timing("replica-a"), timing("replica-b"));
    let never = CancellationToken::new();
    let acquired = leader::acquire(&leases, &a, &never)
        .await
        .ok_or_else(|| anyhow::anyhow!("the first replica takes the free Lease"))?;
    let holding = tokio::spawn({
        let (api, a, never) = (leases.clone(), a.clone(), never.clone());
        async move {
            let held = leader::hold(&api, &a, acquired.lease, acquired.sent, &never).await;
            (held, Instant::now())
        }
    });
    let standby = tokio::spawn({
        let (api, b) = (leases.clone(), b.clone());
        async move {
            let taken = leader::acquire(&api, &b, &CancellationToken::new()).await;
            (taken, Instant::now())
        }
    });
    // The standby has seen a few renewals.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!standby.is_finished(), "the standby took a renewed Lease");
    leases.delete("deleted", &DeleteParams::default()).await?;
    let deleted = Instant::now();
    let (taken, taken_at) = standby.await?;
    let taken = taken.ok_or_else(|| anyhow::anyhow!("the standby takes the Lease"))?;
    assert_eq!(taken.previous.as_deref(), Some("replica-a"));
    // The last renewal the standby saw was at most a retry period before the deletion.
    let waited = taken_at - deleted;
    assert!(
        waited >= a.lease_duration - a.retry_period - Duration::from_millis(500),
        "the standby created the deleted Lease {waited:?} after the deletion"
    );
    let (held, lost_at) = holding.await?;
    assert!(held.is_err(), "the holder noticed the loss: {held:?}");
    assert!(
        lost_at <= taken_at,
        "the holder gave up ({:?} after the deletion) before the standby led ({waited:?})",
        lost_at - deleted
    );
    Ok(())
}

/// A leader that stops cleanly keeps renewing the Lease until its tasks have stopped and only
/// then releases it. Here its Pod does not exist, so taking the leader label off is refused and
/// tried again for about 7 s, longer than the 4 s lease: had the renewals stopped at SIGTERM,
/// the Lease would have expired while the replica was still winding down, and a standby could
/// have led beside its last writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_leader_renews_the_lease_until_it_has_stopped() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-stopping").await?;
    let env = [
        ("NODEKEEPER_LEASE_DURATION", "4s"),
        ("NODEKEEPER_RENEW_DEADLINE", "3s"),
        ("NODEKEEPER_RETRY_PERIOD", "1s"),
        // No such Pod: every label patch is refused, four tries over about 7 s.
        ("NODEKEEPER_POD_NAME", "replica-gone"),
    ];
    let selector = format!("nodekeeper.dev/e2e-group={}", unique_name("stopping"));
    let mut a = ControllerProcess::start(&ns, "replica-a", &selector, free_port(), &env)?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let identity = a.identity.clone();
    wait_for("the Lease taken", Duration::from_secs(60), || {
        let (leases, identity) = (leases.clone(), identity.clone());
        async move { Ok(holder(&leases).await?.filter(|h| *h == identity)) }
    })
    .await?;
    // Leading for a while: past the start (certificates, list probe) into renewals.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let renewed = |lease: &Lease| {
        let spec = lease.spec.as_ref();
        let held = spec.and_then(|s| s.holder_identity.as_deref()) == Some(identity.as_str());
        let at = spec
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.as_millisecond())
            .unwrap_or(0);
        held.then_some(at)
    };
    let before = renewed(&leases.get("nodekeeper-controller").await?)
        .ok_or_else(|| anyhow::anyhow!("the replica no longer holds the Lease"))?;
    a.process.terminate();
    let stopping = Instant::now();
    let deadline = stopping + Duration::from_secs(40);
    let mut latest = before;
    while a.process.check_alive().is_ok() {
        anyhow::ensure!(Instant::now() < deadline, "the controller did not exit");
        if let Some(at) = renewed(&leases.get("nodekeeper-controller").await?) {
            latest = latest.max(at);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let wound_down = stopping.elapsed();
    assert!(
        wound_down >= Duration::from_secs(5),
        "the wind-down took {wound_down:?}; the test needs one longer than the 4 s lease"
    );
    // The last renewal before SIGTERM was at most a retry period (1 s) before it.
    assert!(
        latest >= before + 2000,
        "no renewal after SIGTERM while the replica wound down for {wound_down:?} \
         (last renewal {} ms after the one before SIGTERM)",
        latest - before
    );
    assert_eq!(holder(&leases).await?, None, "released once it had stopped");
    Ok(())
}
