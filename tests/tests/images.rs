//! The shipped images, run: podman loads the OCI archives `cargo xtask test` builds (static musl
//! release binaries on an empty base, `cargo xtask image`) and runs them. Both answer
//! `--version`; the agent runs as `deploy/agent/daemonset.yaml` runs it (host network, read-only
//! root, every capability dropped but the DaemonSet's, its env and host mounts, its memory limit)
//! until a controller certificate of the same CA gets a report from it over mutual TLS on
//! 127.0.0.1, and one of another CA is refused. On a network-namespace node, the agent
//! container lays out network state (ApplyNetwork) and the uninstall's cleanup DaemonSet
//! (`deploy/uninstall/agent-cleanup.yaml`), run from the same image in that namespace with the
//! agent's state directory, removes what the agent made and leaves the rest. The uninstall Job's
//! container is in `install_cleanup.rs`.
//!
//! Needs root (podman); skipped otherwise. Run: `cargo xtask test -- -p nodekeeper-e2e --test
//! images` (it builds the images first), or `cargo xtask image --smoke`.

mod podman_common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use nodekeeper_controller::agent_client::{self, AgentTls, CallLimits};
use nodekeeper_controller::certs::{self, Leaf};
use nodekeeper_e2e::install::{documents, repo};
use nodekeeper_proto::agent::v1::get_report_response::Result as Reply;
use nodekeeper_proto::agent::v1::{ApplyNetworkRequest, ApplyOutcome};
use podman_common::{PodRun, ensure_image, load, podman_run, world_readable};
use serde_json::Value;

/// The Pod template's spec of `kind`/`name` in `file` (relative to the repository).
fn pod_spec(file: &str, kind: &str, name: &str) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(repo().join(file))?;
    documents(&text)?
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .map(|o| o["spec"]["template"]["spec"].clone())
        .with_context(|| format!("no {kind} {name} in {file}"))
}

/// `--version` of the image, as its only argument: the binary's name and version.
fn version(component: &str) -> anyhow::Result<()> {
    let image = load(component)?;
    let out = podman_run(&[
        "--rm".into(),
        "--network=none".into(),
        image,
        "--version".into(),
    ])?;
    let want = format!("nodekeeper-{component} {}", env!("CARGO_PKG_VERSION"));
    ensure!(
        out.trim() == want,
        "--version printed {out:?}, want {want:?}"
    );
    Ok(())
}

/// The agent DaemonSet's Pod for one node, as the test sets it up: the agent image, the
/// manifest's Pod template, a fresh CA with the agent's and the controller's certificates (what
/// the controller writes into `nodekeeper-agent-tls`), and the test's own directories for the
/// hostPaths the DaemonSet would create (state, OCA plugins, the volatile journal); /proc, /,
/// /dev/kmsg and /var/log are the host's, read-only as the DaemonSet mounts them.
struct AgentNode {
    image: String,
    pod: Value,
    ca: String,
    controller: certs::Pem,
    volumes: BTreeMap<&'static str, PathBuf>,
    /// Holds the directories above until the test ends.
    _work: tempfile::TempDir,
}

impl AgentNode {
    fn new() -> anyhow::Result<Self> {
        let image = load("agent")?;
        let pod = pod_spec(
            "deploy/agent/daemonset.yaml",
            "DaemonSet",
            "nodekeeper-agent",
        )?;
        ensure_image(&pod, "nodekeeper-agent")?;
        let (ca, ca_key) = certs::generate_ca()?;
        let agent = certs::issue(Leaf::Agent, &ca, &ca_key)?;
        let controller = certs::issue(Leaf::Controller, &ca, &ca_key)?;
        let work = tempfile::tempdir()?;
        let mut volumes = BTreeMap::new();
        for name in ["tls", "probe-ca", "state", "oca", "journal-runtime"] {
            let path = work.path().join(name);
            std::fs::create_dir(&path)?;
            volumes.insert(name, path);
        }
        std::fs::write(volumes["tls"].join("tls.crt"), &agent.cert)?;
        std::fs::write(volumes["tls"].join("tls.key"), &agent.key)?;
        std::fs::write(volumes["tls"].join("ca.crt"), &ca)?;
        // The kube-root-ca.crt ConfigMap's projection: any CA the probes may trust.
        std::fs::write(volumes["probe-ca"].join("ca.crt"), &ca)?;
        world_readable(work.path())?;
        Ok(Self {
            image,
            pod,
            ca,
            controller,
            volumes,
            _work: work,
        })
    }

    /// The Pod on node `node`, its gRPC on 127.0.0.1:`port` of `network` (the host's when
    /// `None`) instead of 0.0.0.0:9443 (tests listen on loopback only, and 9443 may be taken
    /// on this machine).
    fn run(&self, node: &str, port: u16, network: Option<String>) -> PodRun<'_> {
        PodRun {
            pod: &self.pod,
            image: &self.image,
            fields: BTreeMap::from([
                ("spec.nodeName", node.to_owned()),
                ("status.hostIP", "127.0.0.1".to_owned()),
            ]),
            volumes: self.volumes.clone(),
            env_overrides: BTreeMap::from([("NODEKEEPER_LISTEN", format!("127.0.0.1:{port}"))]),
            network,
            service_account: None,
        }
    }

    /// The controller's side of mutual TLS.
    fn client(&self) -> AgentTls {
        AgentTls::new(&self.ca, &self.controller.cert, &self.controller.key)
    }
}

#[test]
fn controller_image_answers_version() -> anyhow::Result<()> {
    nodekeeper_testkit::skip_unless_root!("needs root: podman runs the images");
    version("controller")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_image_serves_mutual_tls_as_its_daemonset_runs_it() -> anyhow::Result<()> {
    nodekeeper_testkit::skip_unless_root!("needs root: podman runs the images");
    version("agent")?;
    let node = AgentNode::new()?;
    let port = nodekeeper_testkit::free_port();
    // Metrics, too, on a free port of 127.0.0.1 instead of $(NODE_IP):9444.
    let metrics = nodekeeper_testkit::free_port();
    let mut run = node.run("smoke", port, None);
    run.env_overrides
        .insert("NODEKEEPER_METRICS_LISTEN", format!("127.0.0.1:{metrics}"));
    let container = run.start("nk-agent-smoke")?;

    let endpoint = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let limits = CallLimits {
        timeout: Duration::from_secs(5),
        max_reply_bytes: 4 * 1024 * 1024,
    };
    let client = node.client();
    let report = nodekeeper_e2e::wait_for(
        "a report from the agent container over mutual TLS",
        Duration::from_secs(60),
        || {
            let client = &client;
            let container = &container;
            async move {
                anyhow::ensure!(
                    container.running(),
                    "the agent container stopped; its log:\n{}",
                    container.logs()
                );
                match agent_client::connect(client, endpoint, limits).await {
                    Ok(mut connection) => Ok(connection.get_report(0).await.ok()),
                    Err(_) => Ok(None),
                }
            }
        },
    )
    .await
    .with_context(|| container.logs())?;
    let Some(Reply::Report(report)) = report.result else {
        anyhow::bail!("the first report is not a full report: {report:?}");
    };
    ensure!(
        report.node_name == "smoke",
        "the report names node {:?}, want the fieldRef's `smoke`",
        report.node_name
    );
    // Read from the host's /proc through the DaemonSet's read-only mount.
    ensure!(
        !report.indicators.is_empty(),
        "the report has no indicators: {report:?}"
    );

    // Mutual: a controller certificate from another CA is refused.
    let (other_ca, other_key) = certs::generate_ca()?;
    let stranger = certs::issue(Leaf::Controller, &other_ca, &other_key)?;
    let refused = AgentTls::new(&node.ca, &stranger.cert, &stranger.key);
    let attempt = match agent_client::connect(&refused, endpoint, limits).await {
        Ok(mut connection) => connection.get_report(0).await.map(|_| ()),
        Err(e) => Err(e),
    };
    ensure!(
        attempt.is_err(),
        "the agent answered a controller certificate of another CA"
    );

    // Its /metrics (plain HTTP).
    let body = http_get(SocketAddr::from((Ipv4Addr::LOCALHOST, metrics)), "/metrics").await?;
    ensure!(
        body.contains("problem_gauge"),
        "the agent's /metrics has no problem_gauge:\n{body}"
    );
    ensure!(container.running(), "{}", container.logs());
    eprintln!(
        "the agent image served mutual TLS on {endpoint} under podman (report of node {}); its log:\n{}",
        report.node_name,
        container.logs()
    );
    Ok(())
}

/// What the agent lays out on the netns node: a macvlan of its own on `nic0` (a NIC it did
/// not create), addresses on both, a route in table 101 and a rule for it.
const DESIRED: &str = r#"{
  "links": [{"name": "nic0", "kind": "existing"},
            {"name": "nkm0", "kind": "macvlan", "parent": "nic0", "up": true}],
  "addresses": [{"link": "nic0", "cidr": "10.0.20.33/24"},
                {"link": "nkm0", "cidr": "10.0.30.5/24"}],
  "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "nic0", "table": 101}],
  "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}]
}"#;

#[test]
fn agent_image_cleanup_daemonset_reverts_what_the_agent_container_laid_out_on_a_netns_node()
-> anyhow::Result<()> {
    nodekeeper_testkit::skip_unless_root!("needs root: podman and network namespaces");
    let node = AgentNode::new()?;
    let cleanup_pod = pod_spec(
        "deploy/uninstall/agent-cleanup.yaml",
        "DaemonSet",
        "nodekeeper-agent-cleanup",
    )?;
    let ns = nodekeeper_testkit::Netns::with_loopback("nk-img")?;
    let ip = |args: &[&str]| ns.ip(args).map_err(anyhow::Error::from);
    ip(&[
        "link", "add", "nic0", "type", "veth", "peer", "name", "nic0p",
    ])?;
    ip(&["link", "set", "nic0", "up"])?;
    ip(&["link", "set", "nic0p", "up"])?;
    // Someone else's address and rule, which the cleanup must leave.
    ip(&["addr", "add", "192.0.2.10/24", "dev", "nic0"])?;
    let rule = "from 192.0.2.10 table 200 priority 20200";
    ip(&["rule", "add"]
        .into_iter()
        .chain(rule.split(' '))
        .collect::<Vec<_>>())?;

    let network = format!("ns:/run/netns/{}", ns.name());

    // The agent, in the node's namespace (its host network), listening on that loopback.
    let port = nodekeeper_testkit::free_port();
    let agent_run = node.run("netns-node", port, Some(network.clone()));
    let container = agent_run.start("nk-agent-netns")?;
    let endpoint = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let client = node.client();
    let name = container.name.clone();
    let applied = ns.run(move || async move {
        let limits = CallLimits {
            timeout: Duration::from_secs(10),
            max_reply_bytes: 4 * 1024 * 1024,
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut connection = loop {
            match agent_client::connect(&client, endpoint, limits).await {
                Ok(c) => break c,
                Err(e) if tokio::time::Instant::now() > deadline => {
                    return Err(anyhow::anyhow!(
                        "agent container {name} never answered: {e}"
                    ));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
            }
        };
        connection
            .apply_network(ApplyNetworkRequest {
                desired_state_json: DESIRED.to_owned(),
                generation: "1".to_owned(),
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("ApplyNetwork: {e}"))
    });
    let applied = applied.with_context(|| container.logs())?;
    ensure!(
        applied.outcome == ApplyOutcome::Applied as i32,
        "ApplyNetwork: {applied:?}"
    );
    ensure!(ip(&["-o", "link", "show"])?.contains("nkm0"));
    ensure!(ip(&["addr", "show", "dev", "nic0"])?.contains("10.0.20.33/24"));
    // The uninstall's step 2: the agent DaemonSet is deleted.
    drop(container);

    // The cleanup DaemonSet's Pod on that node, with the agent's state directory (the same
    // hostPath in both manifests) and the node's /proc/sys, as the manifest mounts it.
    let host_path = |pod: &Value| {
        pod["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == "state"))
            .map(|v| v["hostPath"]["path"].clone())
    };
    ensure!(
        host_path(&cleanup_pod).is_some() && host_path(&cleanup_pod) == host_path(&node.pod),
        "the cleanup reads another state directory than the agent writes"
    );
    let cleanup_run = PodRun {
        pod: &cleanup_pod,
        image: &node.image,
        fields: BTreeMap::new(),
        volumes: BTreeMap::from([("state", node.volumes["state"].clone())]),
        env_overrides: BTreeMap::new(),
        network: Some(network),
        service_account: None,
    };
    let cleanup = cleanup_run.start("nk-agent-cleanup")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let log = loop {
        let log = cleanup.logs();
        if log.contains("cleanup done") {
            break log;
        }
        ensure!(
            cleanup.running() && std::time::Instant::now() < deadline,
            "no `cleanup done` from the cleanup container; its log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    // It holds (NODEKEEPER_CLEANUP_HOLD), so the DaemonSet's Pod stays Running with its log.
    ensure!(cleanup.running(), "the cleanup container exited:\n{log}");
    eprintln!("the cleanup DaemonSet's container on the netns node:\n{log}");

    ensure!(!ip(&["-o", "link", "show"])?.contains("nkm0"), "{log}");
    let addrs = ip(&["addr", "show", "dev", "nic0"])?;
    ensure!(
        addrs.contains("192.0.2.10/24") && !addrs.contains("10.0.20.33"),
        "{addrs}"
    );
    ensure!(ip(&["route", "show", "table", "101"])?.trim().is_empty());
    let rules = ip(&["rule", "show"])?;
    ensure!(
        rules.contains("20200") && !rules.contains("20101"),
        "{rules}"
    );
    Ok(())
}

/// A plain HTTP/1.0 GET: the response's body.
async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut text)).await??;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or(text))
}
