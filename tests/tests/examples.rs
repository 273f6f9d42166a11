//! The examples in `deploy/examples/` are what users `kubectl apply` first, so each must be
//! accepted by a real kube-apiserver with the CRDs from `deploy/crds/`: every document is
//! server-side applied with `dryRun=All` (full validation, OpenAPI schema and CEL rules, nothing
//! stored) into a test namespace. And each must do what its comment says on the shipped install:
//! [`every_example_does_what_its_comment_says`] applies them for real, to a controller started
//! with the Deployment's configuration (no API server address flag) and real agents.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test examples`.

mod controller_common;

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use kube::api::{DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::discovery::{self, Scope};
use kube::{Api, Client};
use nodekeeper_api::crd::NetworkTestSpec;
use nodekeeper_e2e::{ControlPlane, install_crds, test_namespace};
use serde::Deserialize as _;

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    controller_common::run_as_controller_if_asked();
}

/// The NetworkTest examples the README and `cargo xtask demo` refer to.
const NETWORK_TESTS: [&str; 4] = [
    "networktest-mesh.yaml",
    "networktest-apiserver.yaml",
    "networktest-dns.yaml",
    "networktest-mtu.yaml",
];

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("examples")
}

/// The non-empty YAML documents of one file.
fn documents(path: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut out = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_json::Value::deserialize(document)
            .with_context(|| format!("parse {}", path.display()))?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// Server-side applies `object` with `dryRun=All` into `namespace` (when the kind is
/// namespaced) and returns what the apiserver would store.
async fn dry_run_apply(
    client: &Client,
    namespace: &str,
    mut object: serde_json::Value,
) -> anyhow::Result<DynamicObject> {
    let api_version = object["apiVersion"]
        .as_str()
        .context("document without apiVersion")?
        .to_owned();
    let kind = object["kind"]
        .as_str()
        .context("document without kind")?
        .to_owned();
    let name = object["metadata"]["name"]
        .as_str()
        .context("document without metadata.name")?
        .to_owned();
    let (group, version) = api_version
        .split_once('/')
        .unwrap_or(("", api_version.as_str()));
    let gvk = GroupVersionKind::gvk(group, version, &kind);
    let (resource, caps) = discovery::pinned_kind(client, &gvk)
        .await
        .with_context(|| format!("discover {api_version} {kind}"))?;
    let api: Api<DynamicObject> = if caps.scope == Scope::Namespaced {
        object["metadata"]["namespace"] = namespace.into();
        Api::namespaced_with(client.clone(), namespace, &resource)
    } else {
        Api::all_with(client.clone(), &resource)
    };
    let params = PatchParams::apply("nodekeeper-e2e-examples").dry_run();
    Ok(api.patch(&name, &params, &Patch::Apply(&object)).await?)
}

#[tokio::test]
async fn every_example_is_accepted_by_the_apiserver() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let namespace = test_namespace(&client, "examples").await?;

    let dir = examples_dir();
    for file in NETWORK_TESTS {
        if !dir.join(file).is_file() {
            bail!("deploy/examples/{file} is missing; the README and `cargo xtask demo` use it");
        }
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();

    let mut network_tests = 0;
    for file in &files {
        let documents = documents(file)?;
        assert!(!documents.is_empty(), "{} holds no object", file.display());
        for document in documents {
            let stored = dry_run_apply(&client, &namespace, document.clone())
                .await
                .with_context(|| format!("apiserver refused {}", file.display()))?;
            assert_eq!(
                stored.metadata.name.as_deref(),
                document["metadata"]["name"].as_str(),
                "{}",
                file.display()
            );
            if document["kind"] == "NetworkTest" {
                // What the apiserver would store (defaults filled in) is also what the
                // controller will read.
                let spec: NetworkTestSpec = serde_json::from_value(stored.data["spec"].clone())
                    .with_context(|| format!("{}: stored spec does not parse", file.display()))?;
                assert!(!spec.targets.is_empty(), "{}", file.display());
                network_tests += 1;
            }
        }
    }
    assert!(
        network_tests >= NETWORK_TESTS.len(),
        "{network_tests} NetworkTests found"
    );
    Ok(())
}

/// The dry run above proves something only if the apiserver validates: the mesh example with a
/// probe kind that cannot take peers must be refused, with the CRD's message.
#[tokio::test]
async fn a_broken_example_is_refused_by_the_apiserver() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let namespace = test_namespace(&client, "examples-bad").await?;

    let mut mesh = documents(&examples_dir().join("networktest-mesh.yaml"))?
        .pop()
        .context("mesh example is empty")?;
    mesh["spec"]["kind"] = "dns".into();
    let error = dry_run_apply(&client, &namespace, mesh)
        .await
        .expect_err("a dns NetworkTest with peers targets must be refused");
    let message = format!("{error:#}");
    assert!(
        message.contains("kind dns takes hostname targets"),
        "unexpected refusal: {message}"
    );
    Ok(())
}

/// A minimal DNS server on `addr` (UDP port 53) for the dns example: every A query is answered
/// with 127.0.0.1, every other type with no records. Stops when the task is aborted.
async fn stub_dns(addr: std::net::Ipv4Addr) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let socket = tokio::net::UdpSocket::bind((addr, 53))
        .await
        .with_context(|| format!("bind a DNS stub on {addr}:53"))?;
    Ok(tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            let q = &buf[..n];
            // Header, then the question's labels up to the root, then type and class.
            let mut end = 12;
            while end < n && q[end] != 0 {
                end += 1 + usize::from(q[end]);
            }
            if end + 5 > n {
                continue;
            }
            let qtype = u16::from_be_bytes([q[end + 1], q[end + 2]]);
            let question_end = end + 5;
            let mut reply = Vec::with_capacity(question_end + 16);
            reply.extend_from_slice(&q[..2]);
            reply.extend_from_slice(&[0x81, 0x80, 0, 1, 0, u8::from(qtype == 1), 0, 0, 0, 0]);
            reply.extend_from_slice(&q[12..question_end]);
            if qtype == 1 {
                reply.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 127, 0, 0, 1]);
            }
            let _ = socket.send_to(&reply, peer).await;
        }
    }))
}

/// Every example, applied for real to the shipped configuration: the tuning ConfigMap (its rules
/// are checked, and with repair off as shipped nothing is written), and each NetworkTest finishes
/// `Succeeded` with every pair answered — the API server test included, with no API server
/// address configured (the controller discovers it, as it would in the Deployment).
///
/// Two changes keep the traffic on 127.0.0.0/8: each test's `nodeSelector` picks this test's
/// nodes only (the shared control plane holds other tests' nodes), and the dns example's
/// `resolver` is a stub DNS server on a loopback address, inside the controller's Service range
/// (`NODEKEEPER_SERVICE_CIDRS`, which the Deployment sets too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_does_what_its_comment_says() -> anyhow::Result<()> {
    use controller_common::*;
    use kube::api::PostParams;
    use nodekeeper_api::crd::NetworkTest;
    use nodekeeper_api::crd::network_test::Phase;
    use nodekeeper_e2e::{create_simulated_nodes, unique_name, wait_for};
    use std::collections::BTreeMap;
    use std::net::SocketAddr;
    use std::time::Duration;

    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "examples-run").await?;
    let group = unique_name("ex");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(4);
    let nodes = create_simulated_nodes(&client, "ex", 3, &labels, &ips[..3]).await?;
    let port = free_port();

    // The tuning example as shipped, into the test's namespace.
    let mut tuning = documents(&examples_dir().join("tuning-configmap.yaml"))?
        .pop()
        .context("tuning example is empty")?;
    tuning["metadata"]["namespace"] = ns.clone().into();
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), &ns);
    configmaps
        .create(&PostParams::default(), &serde_json::from_value(tuning)?)
        .await?;

    // The Deployment sets no API server address; neither does this. Its Service range is
    // where the stub DNS server stands in for kube-dns.
    let service_range = format!("{}/32", ips[3]);
    let controller = ControllerProcess::start(
        &ns,
        "examples",
        &selector,
        port,
        &[("NODEKEEPER_SERVICE_CIDRS", service_range.as_str())],
    )?;
    let tls = agent_tls(&client, &ns).await?;
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips) {
        let agent = start_agent(node, SocketAddr::new((*ip).into(), port), &tls).await?;
        agent.set_sysctl("net.ipv4.ip_forward", "1")?;
        agent.set_sysctl("vm.swappiness", "10")?;
        agent.set_sysctl("net.core.somaxconn", "4096")?;
        agents.push(agent);
    }
    // Node 0 is out of bounds on the rule that asks for repair: the example keeps repair off,
    // so the rule is checked and reported and the value stays.
    agents[0].set_sysctl("net.core.somaxconn", "128")?;
    let (_, reason, message) = wait_condition(
        &client,
        &nodes[0],
        "TunablesInBounds",
        "False",
        None,
        Duration::from_secs(60),
    )
    .await?;
    assert!(message.contains("somaxconn"), "{reason}: {message}");
    wait_condition(
        &client,
        &nodes[1],
        "TunablesInBounds",
        "True",
        None,
        Duration::from_secs(60),
    )
    .await?;
    let somaxconn = std::fs::read_to_string(agents[0].sysctl_root.join("net/core/somaxconn"))?;
    assert_eq!(
        somaxconn.trim(),
        "128",
        "repair is off in the example: nothing written"
    );
    let (_, summary) = http_get(controller.http, "/api/v1/summary").await?;
    let summary: serde_json::Value = serde_json::from_str(&summary)?;
    assert_eq!(
        summary["tuning"]["config"]["features"]["repair"], false,
        "{summary}"
    );
    assert!(
        summary["tuning"]["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("ConfigMap")),
        "the example is in force: {summary}"
    );

    let dns = stub_dns(ips[3]).await?;
    let tests: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);
    for file in NETWORK_TESTS {
        let mut test = documents(&examples_dir().join(file))?
            .pop()
            .with_context(|| format!("{file} is empty"))?;
        test["metadata"]["namespace"] = ns.clone().into();
        test["spec"]["nodeSelector"] = serde_json::json!({ "matchLabels": labels });
        if test["spec"]["kind"] == "dns" {
            test["spec"]["resolver"] = ips[3].to_string().into();
        }
        let name = test["metadata"]["name"]
            .as_str()
            .context("no name")?
            .to_owned();
        tests
            .create(&PostParams::default(), &serde_json::from_value(test)?)
            .await
            .with_context(|| format!("create {file}"))?;
        let status = wait_for(
            &format!("{file} to finish"),
            Duration::from_secs(120),
            || {
                let tests = tests.clone();
                let name = name.clone();
                async move {
                    let status = tests.get(&name).await?.status.unwrap_or_default();
                    Ok(
                        matches!(status.phase, Some(Phase::Succeeded | Phase::Failed))
                            .then_some(status),
                    )
                }
            },
        )
        .await?;
        assert_eq!(
            status.phase,
            Some(Phase::Succeeded),
            "{file}: {:?}",
            status.conditions
        );
        assert_eq!(status.success_percent, Some(100.0), "{file}: {status:?}");
        assert_eq!(status.sources, 3, "{file}: every selected node ran it");
        if file == "networktest-mtu.yaml" {
            // Loopback's MTU is 65536: every path takes the example's largest size.
            assert_eq!(status.path_mtu_min, Some(9000), "{file}: {status:?}");
        }
    }
    dns.abort();
    drop(agents);
    Ok(())
}
