//! `NodeDiagnostic` end to end: the real `nodekeeper-controller` process collects bundles over
//! mutual TLS from real agents on 127.x.y.z, stores them on its own disk, and serves them from its
//! HTTP API. The test downloads each bundle, checks its size and SHA-256 against the status,
//! untars it with the system's `tar`, finds every file the manifest lists, and finds none of the
//! secrets it planted (a token in the kubelet environment file the agents are pointed at, a token
//! and an AWS key id in a kernel log line). A node whose agent does not answer fails with the
//! reason while the others succeed; an unknown part and a selector over the cap are refused
//! naming the field; deleting the object deletes its bundles; the TTL deletes the object. A bundle
//! downloads only from its status path (which carries its token): the guessable path without the
//! token answers 404. A store with room for one bundle evicts the older one, and the older
//! object's status says so. A controller that starts leading removes the bundles of objects
//! deleted meanwhile, also with no NodeDiagnostic in the cluster.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test node_diagnostic`.

// A skipped test prints `SKIPPED: <reason>`: that line is the contract with CI.
#![allow(clippy::print_stdout)]

mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use controller_common::*;
use kube::Api;
use kube::api::DeleteParams;
use nodekeeper_api::crd::node_diagnostic::Phase;
use nodekeeper_api::crd::{ConditionStatus, NodeDiagnostic};
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const TIMEOUT: Duration = Duration::from_secs(90);

/// Every controller reconciles every NodeDiagnostic in the cluster (one controller per cluster is
/// the product's shape), so the tests in this file that start one take turns.
static ONE_CONTROLLER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const ENV_SECRET: &str = "planted-env-secret-6f1c";
const LOG_SECRET: &str = "planted-log-secret-93ab";
const AWS_KEY_ID: &str = "AKIAPLANTEDKEY123456";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

async fn apply(
    api: &Api<NodeDiagnostic>,
    name: &str,
    spec: serde_json::Value,
) -> anyhow::Result<()> {
    nodekeeper_e2e::apply_spec(api, name, spec).await
}

async fn finished(api: &Api<NodeDiagnostic>, name: &str) -> anyhow::Result<NodeDiagnostic> {
    wait_for(&format!("nodediagnostic {name} to finish"), TIMEOUT, || {
        let api = api.clone();
        async move {
            let d = api.get(name).await?;
            let done = d
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| matches!(p, Phase::Succeeded | Phase::Failed));
            Ok(done.then_some(d))
        }
    })
    .await
}

/// A GET whose body is kept as bytes (a bundle is binary): (status, content-length, body).
async fn get_bytes(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Option<u64>, Vec<u8>)> {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await??;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: controller\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut buf)).await??;
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no HTTP header end")?;
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())
            .flatten()
    });
    Ok((status, length, buf[end + 4..].to_vec()))
}

/// Files the agents read: a kernel log and a kubelet environment file, both holding secrets.
fn plant_secrets(root: &Path) -> anyhow::Result<Vec<String>> {
    let kmsg = root.join("kmsg");
    std::fs::write(
        &kmsg,
        format!(
            "6,1,1000000,-;eth0: link becomes ready\n\
             4,2,2000000,-;kubelet: retrying with Authorization: Bearer {LOG_SECRET}\n\
             4,3,3000000,-;cloud-init: using access key {AWS_KEY_ID}\n"
        ),
    )?;
    let env = root.join("host/etc/default/kubelet");
    std::fs::create_dir_all(env.parent().context("parent")?)?;
    std::fs::write(
        &env,
        format!("KUBELET_EXTRA_ARGS=--v=2\nKUBELET_BOOTSTRAP_TOKEN={ENV_SECRET}\n"),
    )?;
    Ok(vec![
        format!("--diagnostics-kmsg={}", kmsg.display()),
        format!("--host-root={}", root.join("host").display()),
        "--diagnostics-files=/etc/default/kubelet".into(),
        // This machine's journal is not the simulated node's; the manifest says "skipped".
        "--diagnostics-journalctl=/nonexistent/journalctl".into(),
    ])
}

/// Downloads one node's bundle, checks it against the status, untars it and checks its content.
async fn check_bundle(
    controller: SocketAddr,
    bundle: &nodekeeper_api::crd::node_diagnostic::NodeBundle,
    work: &Path,
) -> anyhow::Result<()> {
    let node = &bundle.node;
    let (code, length, body) = get_bytes(controller, &bundle.download_path).await?;
    if code != 200 {
        bail!(
            "{node}: download answered {code}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    assert_eq!(length, Some(body.len() as u64), "{node}: content-length");
    assert_eq!(
        body.len() as u64,
        bundle.size_bytes,
        "{node}: size in status"
    );
    assert_eq!(
        hex::encode(Sha256::digest(&body)),
        bundle.sha256,
        "{node}: sha256 in status"
    );

    let dir = work.join(node);
    std::fs::create_dir_all(&dir)?;
    let file = work.join(format!("{node}.tar.gz"));
    std::fs::write(&file, &body)?;
    let out = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&file)
        .arg("-C")
        .arg(&dir)
        .output()?;
    assert!(
        out.status.success(),
        "{node}: tar: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One top directory, `<node>-<unix ms>/`.
    let top = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .next()
        .context("empty bundle")?;
    assert!(
        top.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&format!("{node}-")),
        "{}",
        top.display()
    );
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(top.join("manifest.json"))?)?;
    assert_eq!(manifest["node"], node.as_str());
    let parts = manifest["parts"].as_array().context("parts")?;
    let status = |name: &str| {
        parts
            .iter()
            .find(|p| p["name"] == name)
            .map(|p| p["status"].as_str().unwrap_or_default().to_owned())
    };
    for name in [
        "report",
        "kernel-log",
        "sysctl",
        "disk",
        "node-files",
        "network",
    ] {
        assert_eq!(
            status(name).as_deref(),
            Some("ok"),
            "{node}: part {name}: {manifest}"
        );
    }
    assert_eq!(status("journal").as_deref(), Some("skipped"), "{manifest}");
    // Every file the manifest lists is in the bundle, with the listed size.
    let mut listed = 0;
    for p in parts {
        for f in p["files"].as_array().context("files")? {
            let path = top.join(f["name"].as_str().context("name")?);
            let len = std::fs::metadata(&path)
                .with_context(|| format!("{node}: listed file {} missing", path.display()))?
                .len();
            assert_eq!(Some(len), f["bytes"].as_u64(), "{}", path.display());
            listed += 1;
        }
    }
    assert!(listed >= 8, "{node}: only {listed} files listed");
    let sysctl = std::fs::read_to_string(top.join("sysctl.txt"))?;
    assert!(sysctl.contains("net.core.somaxconn = 4096"), "{sysctl}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(top.join("report.json"))?)?;
    assert_eq!(report["nodeName"], node.as_str());
    // The redaction filter: no planted secret anywhere, the redacted lines still there.
    let mut stack = vec![top.clone()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let text = String::from_utf8_lossy(&std::fs::read(&path)?).into_owned();
            for secret in [ENV_SECRET, LOG_SECRET, AWS_KEY_ID] {
                assert!(
                    !text.contains(secret),
                    "{node}: {secret} in {}",
                    path.display()
                );
            }
        }
    }
    let env = std::fs::read_to_string(top.join("files/etc/default/kubelet"))?;
    assert!(env.contains("KUBELET_BOOTSTRAP_TOKEN=[REDACTED]"), "{env}");
    let kernel = std::fs::read_to_string(top.join("kernel-log.txt"))?;
    assert!(kernel.contains("eth0: link becomes ready"), "{kernel}");
    assert!(kernel.contains("Authorization: [REDACTED]"), "{kernel}");
    Ok(())
}

/// One test's world: a namespace with the tuning ConfigMap (`diagnostics.maxBundleBytes` =
/// `max_bundle`), a fresh node group label, and a controller managing that group with its bundle
/// store in a temporary directory (`extra_env` added to its environment).
struct DiagWorld {
    client: kube::Client,
    ns: String,
    labels: BTreeMap<String, String>,
    port: u16,
    store: tempfile::TempDir,
    controller: ControllerProcess,
}

async fn diag_world(
    prefix: &str,
    max_bundle: &str,
    extra_env: &[(&str, &str)],
) -> anyhow::Result<DiagWorld> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, prefix).await?;
    let group = unique_name(prefix);
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([
            ("sweepInterval", "10s"),
            ("callTimeout", "2s"),
            ("diagnostics.maxBundleBytes", max_bundle),
        ]),
    )
    .await?;
    let store = tempfile::tempdir()?;
    let store_dir = store.path().display().to_string();
    let mut env = vec![("NODEKEEPER_DIAGNOSTICS_DIR", store_dir.as_str())];
    env.extend_from_slice(extra_env);
    let managed = format!("nodekeeper.dev/e2e-group={group}");
    let controller = ControllerProcess::start(&ns, prefix, &managed, port, &env)?;
    Ok(DiagWorld {
        client,
        ns,
        labels,
        port,
        store,
        controller,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundles_are_collected_stored_downloaded_and_deleted() -> anyhow::Result<()> {
    if std::process::Command::new("tar")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("SKIPPED: needs the tar command to untar the downloaded bundles");
        return Ok(());
    }
    let _turn = ONE_CONTROLLER.lock().await;
    let DiagWorld {
        client,
        ns,
        labels,
        port,
        store,
        controller,
    } = diag_world("nk-diag", "8388608", &[]).await?;
    let group = labels["nodekeeper.dev/e2e-group"].clone();
    let ips = loopback_ips(4);
    // Nodes 0–2 get agents; node 3's agent never answers (nothing listens on its address).
    let mut with_agents = labels.clone();
    with_agents.insert("nodekeeper.dev/e2e-agents".into(), group.clone());
    let mut nodes = create_simulated_nodes(&client, "nk-diag", 3, &with_agents, &ips[..3]).await?;
    nodes.extend(create_simulated_nodes(&client, "nk-diag-silent", 1, &labels, &ips[3..]).await?);
    let tls = agent_tls(&client, &ns).await?;
    let planted = tempfile::tempdir()?;
    let extra = plant_secrets(planted.path())?;
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips).take(3) {
        let addr = SocketAddr::new((*ip).into(), port);
        let agent = start_agent_with(node, addr, &tls, &extra).await?;
        // The agents' sysctl trees are their own; give the sysctl part something to read.
        agent.set_sysctl("net.core.somaxconn", "4096")?;
        agents.push(agent);
    }
    for node in &nodes[..3] {
        wait_condition(&client, node, "NodekeeperReachable", "True", None, TIMEOUT).await?;
    }

    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);
    let work = tempfile::tempdir()?;

    // Three nodes with agents: Succeeded, three bundles that check out.
    let three = unique_name("three");
    let selector = json!({"matchExpressions": [
        {"key": "nodekeeper.dev/e2e-group", "operator": "In", "values": [group]}
    ]});
    apply(
        &api,
        &three,
        json!({"nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-agents": group}},
               "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let d = finished(&api, &three).await?;
    let s = d.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:#?}");
    assert_eq!(
        (s.node_count, s.failed_count, s.nodes.len()),
        (3, 0, 3),
        "{s:#?}"
    );
    for bundle in &s.nodes {
        assert_eq!(bundle.phase, Phase::Succeeded, "{bundle:?}");
        // The path carries the bundle's download token (32 hex digits) after the node.
        let guessable = format!("/api/diagnostics/{ns}/{three}/{}", bundle.node);
        let token = bundle
            .download_path
            .strip_prefix(&format!("{guessable}/"))
            .with_context(|| format!("{bundle:?}"))?;
        assert!(
            token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()),
            "{bundle:?}"
        );
        // Without the token, or with another, the bundle does not exist.
        let (code, _, body) = get_bytes(controller.http, &guessable).await?;
        assert_eq!(code, 404, "{}", String::from_utf8_lossy(&body));
        let (code, _, _) =
            get_bytes(controller.http, &format!("{guessable}/{}", "0".repeat(32))).await?;
        assert_eq!(code, 404);
        check_bundle(controller.http, bundle, work.path()).await?;
    }
    let three_paths: Vec<String> = s.nodes.iter().map(|b| b.download_path.clone()).collect();
    let storage = s
        .conditions
        .iter()
        .find(|c| c.type_ == "StorageAvailable")
        .context("StorageAvailable")?;
    assert_eq!(storage.reason, "Room", "{storage:?}");

    // All four: the one without an agent fails with the reason, the others still succeed.
    let four = unique_name("four");
    apply(
        &api,
        &four,
        json!({"nodeSelector": selector, "parts": ["report", "sysctl"], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &four).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed), "{s:#?}");
    assert_eq!((s.node_count, s.failed_count), (4, 1), "{s:#?}");
    for bundle in &s.nodes {
        if bundle.node == nodes[3] {
            assert_eq!(bundle.phase, Phase::Failed, "{bundle:?}");
            assert!(bundle.reason.starts_with("agent unreachable"), "{bundle:?}");
            assert!(bundle.download_path.is_empty() && bundle.sha256.is_empty());
        } else {
            assert_eq!(bundle.phase, Phase::Succeeded, "{bundle:?}");
            let (code, _, body) = get_bytes(controller.http, &bundle.download_path).await?;
            assert_eq!(code, 200);
            assert_eq!(hex::encode(Sha256::digest(&body)), bundle.sha256);
        }
    }

    // Bad input, refused naming the field.
    let bad = unique_name("badpart");
    apply(
        &api,
        &bad,
        json!({"nodeName": nodes[0], "parts": ["report", "dmesg"], "ttlSecondsAfterFinished": 3}),
    )
    .await?;
    let s = finished(&api, &bad).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed));
    let valid = s
        .conditions
        .iter()
        .find(|c| c.type_ == "SpecValid")
        .context("SpecValid")?;
    assert_eq!(valid.reason, "InvalidSpec");
    assert!(
        valid
            .message
            .starts_with("spec.parts[1]: unknown part \"dmesg\""),
        "{}",
        valid.message
    );
    // Its TTL of 3 s deletes it.
    wait_for("the expired nodediagnostic to be deleted", TIMEOUT, || {
        let api = api.clone();
        let bad = bad.clone();
        async move { Ok(api.get_opt(&bad).await?.is_none().then_some(())) }
    })
    .await?;

    let many_group = unique_name("many");
    let many_labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-many".to_string(), many_group.clone())].into();
    create_simulated_nodes(&client, "nk-many", 51, &many_labels, &[]).await?;
    let over = unique_name("over");
    apply(
        &api,
        &over,
        json!({"nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-many": many_group}}, "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &over).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed));
    let valid = s
        .conditions
        .iter()
        .find(|c| c.type_ == "SpecValid")
        .context("SpecValid")?;
    assert!(
        valid
            .message
            .starts_with("spec.nodeSelector: matches more than 50 nodes"),
        "{}",
        valid.message
    );
    assert!(s.nodes.is_empty(), "nothing collected: {s:?}");

    // Deleting the object deletes its bundles (the finalizer), and the download says so.
    let three_dir = store.path().join(&ns).join(&three);
    assert!(three_dir.is_dir());
    api.delete(&three, &DeleteParams::default()).await?;
    wait_for("the deleted nodediagnostic to be gone", TIMEOUT, || {
        let api = api.clone();
        let three = three.clone();
        async move { Ok(api.get_opt(&three).await?.is_none().then_some(())) }
    })
    .await?;
    assert!(
        !three_dir.exists(),
        "bundles left in {}",
        three_dir.display()
    );
    let (code, _, _) = get_bytes(
        controller.http,
        &format!("/api/diagnostics/{ns}/{three}/{}", nodes[0]),
    )
    .await?;
    assert_eq!(code, 404);
    // The paths that downloaded before (with their tokens) find nothing now.
    for path in &three_paths {
        let (code, _, _) = get_bytes(controller.http, path).await?;
        assert_eq!(code, 404, "{path}");
    }
    let (code, _, _) = get_bytes(controller.http, "/api/diagnostics/x/..%2f/y").await?;
    assert!(code == 400 || code == 404, "{code}");

    drop((agents, controller));
    Ok(())
}

/// A store with room for one bundle: the second NodeDiagnostic evicts the first one's bundle
/// (its own status says `OlderBundlesEvicted`), and the first one's status stops pointing at a
/// download that would answer 410: no download path, the reason, `BundlesAvailable=False`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_bundle_is_reported_in_its_own_objects_status() -> anyhow::Result<()> {
    let _turn = ONE_CONTROLLER.lock().await;
    // The smallest bundle cap the tuning ConfigMap accepts (`diagnostics::MIN_BUNDLE_BYTES`), and
    // a store with room for exactly one bundle being written: any stored bundle must make way.
    let min_bundle = "65536";
    let DiagWorld {
        client,
        ns,
        labels,
        port,
        store: _store,
        controller,
    } = diag_world(
        "nk-diag-evict",
        min_bundle,
        &[("NODEKEEPER_DIAGNOSTICS_MAX_BYTES", min_bundle)],
    )
    .await?;
    let ips = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, "nk-evict", 1, &labels, &ips).await?;
    let tls = agent_tls(&client, &ns).await?;
    let agent = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    wait_condition(
        &client,
        &nodes[0],
        "NodekeeperReachable",
        "True",
        None,
        TIMEOUT,
    )
    .await?;

    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);
    let spec = json!({"nodeName": nodes[0], "parts": ["report"], "ttlSecondsAfterFinished": 600});
    let first = unique_name("first");
    apply(&api, &first, spec.clone()).await?;
    let s = finished(&api, &first).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:#?}");
    let old_path = s.nodes[0].download_path.clone();
    assert!(!old_path.is_empty(), "{s:#?}");

    let second = unique_name("second");
    apply(&api, &second, spec).await?;
    let s = finished(&api, &second).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:#?}");
    let storage = s
        .conditions
        .iter()
        .find(|c| c.type_ == "StorageAvailable")
        .context("StorageAvailable")?;
    assert_eq!(storage.reason, "OlderBundlesEvicted", "{storage:?}");
    assert!(storage.message.contains(&first), "{storage:?}");

    let evicted = wait_for("the evicted object's status to say so", TIMEOUT, || {
        let api = api.clone();
        let first = first.clone();
        async move {
            let s = api.get(&first).await?.status.context("status")?;
            Ok(s.nodes[0].download_path.is_empty().then_some(s))
        }
    })
    .await?;
    assert_eq!(evicted.phase, Some(Phase::Succeeded), "{evicted:#?}");
    assert!(
        evicted.nodes[0].reason.contains("evicted to make room"),
        "{evicted:#?}"
    );
    let available = evicted
        .conditions
        .iter()
        .find(|c| c.type_ == "BundlesAvailable")
        .context("BundlesAvailable")?;
    assert_eq!(
        (available.status, available.reason.as_str()),
        (ConditionStatus::False, "BundlesGone"),
        "{available:?}"
    );
    let (code, _, _) = get_bytes(controller.http, &old_path).await?;
    assert_eq!(code, 410);
    drop((agent, controller));
    Ok(())
}

/// The address the controller files under a node answers for another one (an instance gone and
/// its address reused): the controller names the node in its call, the agent refuses, and no
/// bundle is filed under the wrong node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_serving_another_node_gives_no_bundle() -> anyhow::Result<()> {
    let _turn = ONE_CONTROLLER.lock().await;
    let DiagWorld {
        client,
        ns,
        labels,
        port,
        store: _store,
        controller,
    } = diag_world("nk-diag-other", "1048576", &[]).await?;
    let ips = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, "nk-other", 1, &labels, &ips).await?;
    let tls = agent_tls(&client, &ns).await?;
    let agent = start_agent(
        "nk-other-newcomer",
        SocketAddr::new(ips[0].into(), port),
        &tls,
    )
    .await?;

    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);
    let name = unique_name("other");
    apply(
        &api,
        &name,
        json!({"nodeName": nodes[0], "parts": ["report"], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &name).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed), "{s:#?}");
    assert!(s.nodes[0].download_path.is_empty(), "{s:#?}");
    assert!(
        s.nodes[0]
            .reason
            .contains(&format!("serves node nk-other-newcomer, not {}", nodes[0])),
        "{s:#?}"
    );
    drop((agent, controller));
    Ok(())
}

/// Deleting a NodeDiagnostic while its bundle streams stops them at once: the object (held by
/// its finalizer) is gone within seconds, not when the slow part ends, and nothing of it is left
/// on the controller's disk. And a selector the API server would refuse is refused at once,
/// `SpecValid=False` naming the field, not retried for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_collection_stops_at_once_and_a_bad_selector_is_refused() -> anyhow::Result<()> {
    let _turn = ONE_CONTROLLER.lock().await;
    let DiagWorld {
        client,
        ns,
        labels,
        port,
        store,
        controller,
    } = diag_world("nk-diag-cancel", "1048576", &[]).await?;

    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);
    let bad = unique_name("badsel");
    apply(
        &api,
        &bad,
        json!({"nodeSelector": {"matchLabels": {"bad key!": "x"}}, "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &bad).await?.status.context("status")?;
    assert_eq!(s.phase, Some(Phase::Failed), "{s:#?}");
    let valid = s
        .conditions
        .iter()
        .find(|c| c.type_ == "SpecValid")
        .context("SpecValid")?;
    assert_eq!(
        (valid.status, valid.reason.as_str()),
        (ConditionStatus::False, "InvalidSpec"),
        "{valid:?}"
    );
    assert!(
        valid
            .message
            .starts_with("spec.nodeSelector.matchLabels[\"bad key!\"]"),
        "{}",
        valid.message
    );

    // An agent whose journal part takes 9 s (under the agent's 10 s cap per part).
    let ips = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, "nk-cancel", 1, &labels, &ips).await?;
    let tls = agent_tls(&client, &ns).await?;
    let scripts = tempfile::tempdir()?;
    let journalctl = scripts.path().join("journalctl");
    std::fs::write(&journalctl, "#!/bin/sh\nsleep 9\n")?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&journalctl, std::fs::Permissions::from_mode(0o755))?;
    }
    let extra = vec![format!("--diagnostics-journalctl={}", journalctl.display())];
    let agent = start_agent_with(
        &nodes[0],
        SocketAddr::new(ips[0].into(), port),
        &tls,
        &extra,
    )
    .await?;
    wait_condition(
        &client,
        &nodes[0],
        "NodekeeperReachable",
        "True",
        None,
        TIMEOUT,
    )
    .await?;

    let slow = unique_name("slow");
    apply(
        &api,
        &slow,
        json!({"nodeName": nodes[0], "parts": ["journal"], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    wait_for("the nodediagnostic to be Running", TIMEOUT, || {
        let api = api.clone();
        let slow = slow.clone();
        async move {
            let phase = api.get(&slow).await?.status.and_then(|s| s.phase);
            Ok((phase == Some(Phase::Running)).then_some(()))
        }
    })
    .await?;
    let deleted_at = std::time::Instant::now();
    api.delete(&slow, &DeleteParams::default()).await?;
    // Without cancelling, the finalizer runs only once the 9 s part has ended.
    wait_for(
        "the collecting nodediagnostic to be gone",
        Duration::from_secs(5),
        || {
            let api = api.clone();
            let slow = slow.clone();
            async move { Ok(api.get_opt(&slow).await?.is_none().then_some(())) }
        },
    )
    .await?;
    assert!(
        deleted_at.elapsed() < Duration::from_secs(6),
        "{:?}",
        deleted_at.elapsed()
    );
    assert!(
        !store.path().join(&ns).join(&slow).exists(),
        "the cancelled collection left files on the controller's disk"
    );
    drop((agent, controller));
    Ok(())
}

/// A NodeDiagnostic deleted while another replica led had its finalizer run there, and its
/// bundles stay on the disk of the replica that collected them. When that replica leads again it
/// removes them at once, after its first list of NodeDiagnostics, also when the cluster holds
/// none (so no reconcile ever runs to do it): they no longer count against
/// `--diagnostics-max-bytes` nor download with their old token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_removes_the_bundles_of_deleted_objects_with_none_in_the_cluster()
-> anyhow::Result<()> {
    let _turn = ONE_CONTROLLER.lock().await;
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    // No NodeDiagnostic in the cluster, else one's reconcile would sweep the store first: what
    // the other tests here left (they run one at a time, under ONE_CONTROLLER, and none runs
    // now) goes, finalizer and all.
    let all: Api<NodeDiagnostic> = Api::all(client.clone());
    for left in all.list(&Default::default()).await?.items {
        let ns = kube::ResourceExt::namespace(&left).context("namespace")?;
        let name = kube::ResourceExt::name_any(&left);
        let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);
        let unheld = json!({"metadata": {"finalizers": null}});
        let params = kube::api::PatchParams::default();
        match api
            .patch(&name, &params, &kube::api::Patch::Merge(&unheld))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(e) => return Err(e.into()),
        }
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    wait_for("no nodediagnostic in the cluster", TIMEOUT, || {
        let all = all.clone();
        async move {
            Ok(all
                .list(&Default::default())
                .await?
                .items
                .is_empty()
                .then_some(()))
        }
    })
    .await?;

    // The bundle of `<ns>/gone`, collected by this replica before another one led and deleted
    // the object.
    let ns = test_namespace(&client, "nk-diag-sweep").await?;
    let store = tempfile::tempdir()?;
    let gone = store.path().join(&ns).join("gone");
    std::fs::create_dir_all(&gone)?;
    let token = "0123456789abcdef0123456789abcdef";
    std::fs::write(
        gone.join("n1.tar.gz"),
        "a bundle of a deleted nodediagnostic",
    )?;
    std::fs::write(gone.join("n1.token"), token)?;
    std::fs::write(gone.join(".uid"), "5e1f0a52-0000-4000-8000-000000000001")?;
    let store_dir = store.path().display().to_string();
    let managed = format!("nodekeeper.dev/e2e-group={}", unique_name("nk-diag-sweep"));
    let controller = ControllerProcess::start(
        &ns,
        "nk-diag-sweep",
        &managed,
        free_port(),
        &[("NODEKEEPER_DIAGNOSTICS_DIR", store_dir.as_str())],
    )?;
    wait_for(
        "the deleted object's bundles to be removed",
        TIMEOUT,
        || {
            let gone = gone.clone();
            async move { Ok((!gone.exists()).then_some(())) }
        },
    )
    .await?;
    let (code, _, _) = get_bytes(
        controller.http,
        &format!("/api/diagnostics/{ns}/gone/n1/{token}"),
    )
    .await?;
    assert_eq!(code, 404, "the removed bundle still downloads");
    // No reconcile did it: there was nothing to reconcile.
    let runs = metric(
        controller.http,
        "nodekeeper_reconcile_runs_total",
        &["controller=\"nodediagnostic\""],
    )
    .await?;
    assert_eq!(runs, 0.0);
    drop(controller);
    Ok(())
}

/// Pseudo-random lowercase text (compresses to about 60 %, like busy logs), as kmsg records.
fn noisy_kmsg(bytes: usize) -> String {
    let mut seed = 0x2545_f491_u32;
    let mut out = String::with_capacity(bytes + 100);
    let mut i = 0u64;
    while out.len() < bytes {
        let mut line = String::with_capacity(100);
        for _ in 0..80 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            line.push(char::from(b'a' + (seed % 26) as u8));
        }
        out.push_str(&format!("6,{i},{i}000,-;{line}\n"));
        i += 1;
    }
    out
}

/// `VmRSS` or `VmHWM` (peak) of a process, in KiB.
fn memory_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim_start_matches(':')
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// Benchmark (not a timed test): one node's bundle time and size, then the controller's RSS while
/// 50 bundles of about 2 MB stream at once. Prints the figures for BENCHMARKS.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: cargo xtask test -- -p nodekeeper-e2e --test node_diagnostic -- --ignored --exact bench_bundles --nocapture"]
async fn bench_bundles() -> anyhow::Result<()> {
    const NODES: usize = 50;
    let _turn = ONE_CONTROLLER.lock().await;
    // The kernel log each agent holds; the bundle is mostly this, compressed to about 60 %.
    let kmsg_mib: usize = std::env::var("NODEKEEPER_BENCH_KMSG_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let kmsg_bytes = kmsg_mib << 20;
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-diag-bench").await?;
    let group = unique_name("diagbench");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let ips = loopback_ips(NODES);
    let nodes = create_simulated_nodes(&client, "nk-dbench", NODES, &labels, &ips).await?;
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([("sweepInterval", "5m"), ("callTimeout", "5s")]),
    )
    .await?;
    let store = tempfile::tempdir()?;
    let store_dir = store.path().display().to_string();
    let controller = ControllerProcess::start(
        &ns,
        "diag-bench",
        &format!("nodekeeper.dev/e2e-group={group}"),
        port,
        &[
            ("NODEKEEPER_DIAGNOSTICS_DIR", &store_dir),
            ("NODEKEEPER_DIAGNOSTICS_CONCURRENCY", "50"),
            ("NODEKEEPER_LOG", "warn"),
        ],
    )?;
    let tls = agent_tls(&client, &ns).await?;
    let files = tempfile::tempdir()?;
    std::fs::write(files.path().join("kmsg"), noisy_kmsg(kmsg_bytes))?;
    let extra = vec![
        format!("--diagnostics-kmsg={}", files.path().join("kmsg").display()),
        "--diagnostics-journalctl=/nonexistent/journalctl".into(),
    ];
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips) {
        agents
            .push(start_agent_with(node, SocketAddr::new((*ip).into(), port), &tls, &extra).await?);
    }
    for node in &nodes {
        wait_condition(&client, node, "NodekeeperReachable", "True", None, TIMEOUT).await?;
    }
    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &ns);

    let one = unique_name("one");
    let started = std::time::Instant::now();
    apply(
        &api,
        &one,
        json!({"nodeName": nodes[0], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &one).await?.status.context("status")?;
    let one_took = started.elapsed();
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:?}");
    let one_size = s.nodes[0].size_bytes;
    let (code, _, body) = get_bytes(controller.http, &s.nodes[0].download_path).await?;
    assert_eq!(code, 200);
    let listing = std::process::Command::new("sh")
        .arg("-c")
        .arg("tar -xzOf - --wildcards '*/manifest.json'")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write as _;
            c.stdin.take().expect("piped").write_all(&body)?;
            c.wait_with_output()
        })?;
    let manifest: serde_json::Value = serde_json::from_slice(&listing.stdout)?;
    for p in manifest["parts"].as_array().context("parts")? {
        println!(
            "BENCH part {}: {} {} bytes {} ms {}",
            p["name"], p["status"], p["bytes"], p["durationMs"], p["reason"]
        );
    }

    let rss_before = memory_kib(controller.pid(), "VmRSS")?;
    let all = unique_name("all");
    let started = std::time::Instant::now();
    apply(
        &api,
        &all,
        json!({"nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-group": group}}, "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    let s = finished(&api, &all).await?.status.context("status")?;
    let all_took = started.elapsed();
    assert_eq!(s.phase, Some(Phase::Succeeded), "{s:?}");
    let total: u64 = s.nodes.iter().map(|n| n.size_bytes).sum();
    // Which parts the overloaded agents could not finish (all 50 share this machine's cores).
    let mut reasons = BTreeMap::<&str, usize>::new();
    for n in &s.nodes {
        *reasons.entry(n.reason.as_str()).or_default() += 1;
    }
    for (reason, count) in reasons {
        println!("BENCH note: {count} nodes: {reason}");
    }
    let peak = memory_kib(controller.pid(), "VmHWM")?;
    println!(
        "BENCH node_diagnostic: one node (all parts, {} MiB kernel log): {:.2} s, bundle {} bytes",
        kmsg_mib,
        one_took.as_secs_f64(),
        one_size
    );
    println!(
        "BENCH node_diagnostic: {NODES} nodes at once: {:.2} s, {} bytes streamed in all; controller RSS before {} KiB, peak (VmHWM) {} KiB, growth {} KiB",
        all_took.as_secs_f64(),
        total,
        rss_before,
        peak,
        peak.saturating_sub(rss_before)
    );
    drop((agents, controller));
    Ok(())
}
