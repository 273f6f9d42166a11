//! Proof that the local control plane is a real one: kwok nodes become Ready with their own
//! addresses and leases, a Deployment's pods are scheduled onto them and run, and a
//! PodDisruptionBudget refuses an eviction (429) until the budget allows it. Plus the bad-input
//! path of `cluster up`: a taken port.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Api;
use kube::api::{EvictParams, ListParams, Patch, PatchParams, PostParams};
use nodekeeper_e2e::controlplane::{self, Lifetime, Options};
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, test_namespace, unique_name, wait_for};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);

#[tokio::test]
async fn simulated_nodes_become_ready_with_their_address_and_lease() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let pool = unique_name("pool");
    let labels = BTreeMap::from([("nodekeeper.dev/test-pool".to_owned(), pool.clone())]);
    let ips = [
        Ipv4Addr::new(127, 1, 200, 1),
        Ipv4Addr::new(127, 1, 200, 2),
        Ipv4Addr::new(127, 1, 200, 3),
    ];
    let names = create_simulated_nodes(&client, "ready", 3, &labels, &ips).await?;

    let nodes: Api<Node> = Api::all(client.clone());
    for (name, ip) in names.iter().zip(ips) {
        let node = nodes.get(name).await?;
        let status = node.status.context("node has status")?;
        let ready = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Ready");
        assert_eq!(
            ready.map(|c| c.status).as_deref(),
            Some("True"),
            "{name} Ready"
        );
        let internal = status
            .addresses
            .unwrap_or_default()
            .into_iter()
            .find(|a| a.type_ == "InternalIP");
        assert_eq!(
            internal.map(|a| a.address),
            Some(ip.to_string()),
            "{name} keeps the InternalIP it was created with"
        );
        assert_eq!(
            status.node_info.map(|i| i.operating_system).as_deref(),
            Some("linux")
        );
    }
    // Liveness between the (rare) status heartbeats is the node Lease, which kwok renews.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    for name in &names {
        let lease = wait_for(&format!("Lease for {name}"), TIMEOUT, || {
            let leases = leases.clone();
            async move { Ok(leases.get_opt(name).await?) }
        })
        .await?;
        let spec = lease.spec.context("lease spec")?;
        assert_eq!(
            spec.lease_duration_seconds,
            Some(40),
            "{name}: kwok's --node-lease-duration-seconds"
        );
        assert!(spec.renew_time.is_some(), "{name}: lease renewed");
    }
    // Only labelled nodes are kwok's: an unlabelled node stays without a Ready condition.
    let plain = unique_name("not-simulated");
    let node: Node = serde_json::from_value(
        json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": plain } }),
    )?;
    nodes.create(&PostParams::default(), &node).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let plain_node = nodes.get(&plain).await?;
    assert!(
        !controlplane::nodes::is_ready(&plain_node),
        "kwok must not manage a node without the label"
    );
    nodes.delete(&plain, &Default::default()).await?;
    Ok(())
}

fn deployment(name: &str, pool: &str, replicas: i32) -> anyhow::Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "nodeSelector": { "nodekeeper.dev/test-pool": pool },
                    "containers": [{ "name": "app", "image": "registry.invalid/app:1" }],
                },
            },
        },
    }))?)
}

/// Waits until exactly `n` pods of `app` are Running and Ready on nodes of `nodes`; returns them.
async fn wait_running(
    pods: &Api<Pod>,
    app: &str,
    n: usize,
    nodes: &[String],
) -> anyhow::Result<Vec<Pod>> {
    let running = wait_for(&format!("{n} Running pods of {app}"), TIMEOUT, || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels(&format!("app={app}")))
                .await?;
            let running: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter(|p| {
                    let status = p.status.as_ref();
                    let phase_running = status.and_then(|s| s.phase.as_deref()) == Some("Running");
                    let ready = status
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        });
                    phase_running && ready
                })
                .collect();
            Ok((running.len() == n).then_some(running))
        }
    })
    .await?;
    for pod in &running {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        assert!(
            nodes.contains(&node),
            "pod scheduled onto {node}, not one of {nodes:?}"
        );
    }
    Ok(running)
}

#[tokio::test]
async fn deployment_pods_are_scheduled_onto_simulated_nodes_and_run() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "deploy").await?;
    let pool = unique_name("pool");
    let labels = BTreeMap::from([("nodekeeper.dev/test-pool".to_owned(), pool.clone())]);
    let nodes = create_simulated_nodes(&client, "deploy", 2, &labels, &[]).await?;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(&PostParams::default(), &deployment("web", &pool, 3)?)
        .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let running = wait_running(&pods, "web", 3, &nodes).await?;
    for pod in &running {
        let status = pod.status.as_ref().context("pod status")?;
        assert!(status.pod_ip.is_some(), "kwok gives running pods an IP");
        let host_ip = status.host_ip.clone().unwrap_or_default();
        assert!(
            host_ip.starts_with("127.1."),
            "hostIP {host_ip} is the node's InternalIP"
        );
    }
    let ready = wait_for("Deployment web to report 3 ready replicas", TIMEOUT, || {
        let deployments = deployments.clone();
        async move {
            let d = deployments.get("web").await?;
            let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
            Ok((ready == 3).then_some(ready))
        }
    })
    .await?;
    assert_eq!(ready, 3);
    Ok(())
}

fn api_error_code(result: &Result<kube::core::response::Status, kube::Error>) -> Option<u16> {
    match result {
        Err(kube::Error::Api(status)) => Some(status.code),
        _ => None,
    }
}

#[tokio::test]
async fn pod_disruption_budget_blocks_eviction_until_the_budget_permits() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "pdb").await?;
    let pool = unique_name("pool");
    let labels = BTreeMap::from([("nodekeeper.dev/test-pool".to_owned(), pool.clone())]);
    let nodes = create_simulated_nodes(&client, "pdb", 2, &labels, &[]).await?;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(&PostParams::default(), &deployment("db", &pool, 2)?)
        .await?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": { "name": "db" },
        "spec": { "minAvailable": 2, "selector": { "matchLabels": { "app": "db" } } },
    }))?;
    pdbs.create(&PostParams::default(), &pdb).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let running = wait_running(&pods, "db", 2, &nodes).await?;

    // The disruption controller (kube-controller-manager) must have computed the budget.
    let healthy_allowed = |want_allowed: i32| {
        let pdbs = pdbs.clone();
        move || {
            let pdbs = pdbs.clone();
            async move {
                let status = pdbs.get("db").await?.status.unwrap_or_default();
                Ok((status.current_healthy == Some(2 + want_allowed)
                    && status.disruptions_allowed == Some(want_allowed))
                .then_some(()))
            }
        }
    };
    wait_for(
        "PDB db: 2 healthy, 0 disruptions allowed",
        TIMEOUT,
        healthy_allowed(0),
    )
    .await?;

    let victim = running[0].metadata.name.clone().context("pod name")?;
    let refused = pods.evict(&victim, &EvictParams::default()).await;
    assert_eq!(
        api_error_code(&refused),
        Some(429),
        "eviction past the budget is refused: {refused:?}"
    );
    if let Err(kube::Error::Api(status)) = &refused {
        assert!(
            status.message.contains("disruption budget"),
            "message names the budget: {}",
            status.message
        );
    }
    assert!(
        pods.get_opt(&victim).await?.is_some(),
        "a refused eviction leaves the pod"
    );

    // One more replica makes one disruption affordable.
    deployments
        .patch(
            "db",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": 3 } })),
        )
        .await?;
    wait_running(&pods, "db", 3, &nodes).await?;
    wait_for(
        "PDB db: 3 healthy, 1 disruption allowed",
        TIMEOUT,
        healthy_allowed(1),
    )
    .await?;
    pods.evict(&victim, &EvictParams::default())
        .await
        .context("eviction within the budget is allowed")?;
    // kwok plays the kubelet: the evicted pod goes away, and the Deployment replaces it.
    wait_for(&format!("evicted pod {victim} to be gone"), TIMEOUT, || {
        let pods = pods.clone();
        let victim = victim.clone();
        async move { Ok(pods.get_opt(&victim).await?.is_none().then_some(())) }
    })
    .await?;
    wait_running(&pods, "db", 3, &nodes).await?;
    Ok(())
}

#[tokio::test]
async fn cluster_up_on_a_taken_port_names_the_port_and_the_fix() -> anyhow::Result<()> {
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port();
    let mut options = Options::new(
        format!("test-{}-taken-port", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.apiserver_port = Some(port);
    let error = controlplane::up(&options, &mut |_| {})
        .await
        .expect_err("a taken port must be refused");
    assert_eq!(
        error.to_string(),
        format!(
            "port {port} on 127.0.0.1 is in use: run `cargo xtask cluster down` or pass --port"
        )
    );
    // Nothing was started for it.
    assert!(controlplane::read_state(&options.name).is_err());
    Ok(())
}

#[tokio::test]
async fn opt_in_audit_log_counts_requests_by_user() -> anyhow::Result<()> {
    let mut options = Options::new(
        format!("test-{}-audit", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    // A private control plane; `start` blocks, so keep it off this test's runtime thread.
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(options)).await??;
    let audit_log = cp.audit_log().context("audit enabled")?;
    let client = cp.client().await?;
    let names = create_simulated_nodes(&client, "audited", 1, &BTreeMap::new(), &[]).await?;
    let by_user = wait_for(
        "audit events from nodekeeper-admin and kwok",
        TIMEOUT,
        || {
            let audit_log = audit_log.clone();
            async move {
                let text = std::fs::read_to_string(&audit_log).unwrap_or_default();
                let mut by_user = BTreeMap::<String, usize>::new();
                for line in text.lines() {
                    let event: serde_json::Value = serde_json::from_str(line)?;
                    if let Some(user) = event["user"]["username"].as_str() {
                        *by_user.entry(user.to_owned()).or_default() += 1;
                    }
                }
                let seen = by_user.contains_key("nodekeeper-admin") && by_user.contains_key("kwok");
                Ok(seen.then_some(by_user))
            }
        },
    )
    .await?;
    // The test's own node creation is attributed to the admin user, kwok's status writes to kwok.
    assert!(by_user["nodekeeper-admin"] >= 1, "{by_user:?}");
    assert!(by_user["kwok"] >= 1, "{by_user:?}");
    assert_eq!(names.len(), 1);
    assert!(
        ControlPlane::shared().audit_log().is_none(),
        "the shared control plane runs without audit"
    );
    Ok(())
}

/// The server reports the pinned Kubernetes version as semver (the build stamps it; left at the
/// source default, `v0.0.0-master+$Format:%H$`, `kubectl version` fails on it), and the built
/// `kubectl version` reads it without error.
#[tokio::test]
async fn the_server_reports_its_pinned_version_and_kubectl_version_works() -> anyhow::Result<()> {
    use nodekeeper_e2e::controlplane::binaries;
    let (pins, _) = binaries::cache_key(&binaries::controlplane_dir())?;
    let client = ControlPlane::shared().client().await?;
    let info = client.apiserver_version().await?;
    assert_eq!(info.git_version, pins.kubernetes, "{info:?}");
    let numeric = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    assert!(numeric(&info.major) && numeric(&info.minor), "{info:?}");
    assert!(
        pins.kubernetes
            .starts_with(&format!("v{}.{}.", info.major, info.minor)),
        "{info:?}"
    );
    let kubectl = binaries::ensure(&mut |_| {})?.path("kubectl");
    let out = std::process::Command::new(kubectl)
        .args(["version", "--output=json"])
        .env("KUBECONFIG", ControlPlane::shared().kubeconfig())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl version: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: serde_json::Value = serde_json::from_str(&stdout)?;
    assert_eq!(
        parsed["serverVersion"]["gitVersion"],
        pins.kubernetes.as_str()
    );
    assert_eq!(
        parsed["clientVersion"]["gitVersion"],
        pins.kubernetes.as_str()
    );
    Ok(())
}
