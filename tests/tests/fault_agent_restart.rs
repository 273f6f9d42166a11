//! Fault campaign (issue #20): the agent process is SIGKILLed in the middle of `ApplyNetwork`
//! and started again; the host must end in the old state or the new one, never between.
//!
//! A network namespace stands in for the node; the agent is this test binary re-executed as
//! `nodekeeper-agent` inside it (its real gRPC server over mutual TLS, its real netlink apply),
//! and the test calls it as the controller does. The new state differs from the old one in a
//! dozen netlink steps (a macvlan removed and another created, an MTU, addresses, routes, rules).
//! For every point of that apply — after 0, 1, …, all of its steps — the agent is held there by
//! a test hook of debug builds (`NODEKEEPER_TEST_HOLD_APPLY_AFTER_STEPS`, compiled out of
//! release builds; see `crates/agent/src/network.rs`), the host is read with `ip -j` and shown to
//! be between the two states, the agent is killed with SIGKILL and started again, and the host is
//! read back: it is in the old state exactly, the agent reports the old generation applied and
//! the interruption in `last_error`, and applying the new state again then succeeds.
//!
//! Run (as root): `cargo xtask test -- -p nodekeeper-e2e --test fault_agent_restart`.

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use nodekeeper_controller::agent_client::{self, AgentConnection, AgentTls, CallLimits};
use nodekeeper_controller::certs::{self, Leaf};
use nodekeeper_e2e::rig::{Output, Process, Program, ROLE_ENV};
use nodekeeper_proto::agent::v1 as pb;
use nodekeeper_testkit::{Netns, skip_unless_root};
use serde_json::Value;

/// The helper test that turns this binary into an agent, and its role.
const HELPER: &str = "run_as_agent";
const ROLE: &str = "agent";

#[test]
#[ignore = "helper: re-executed by the test in this file as an agent process inside its network namespace; not a test by itself"]
fn run_as_agent() {
    if std::env::var(ROLE_ENV).as_deref() != Ok(ROLE) {
        return;
    }
    use clap::Parser as _;
    // Every flag from its NODEKEEPER_… variable, as the DaemonSet sets them.
    let config = nodekeeper_agent::Config::parse_from(["nodekeeper-agent"]);
    // One thread, as the agent's own main has it.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let shutdown = tokio_util::sync::CancellationToken::new();
    if let Err(error) = runtime.block_on(nodekeeper_agent::run(config, shutdown)) {
        eprintln!("nodekeeper-agent: {error}");
        std::process::exit(1);
    }
}

const OLD: &str = r#"{
  "links": [
    {"name": "eth0", "kind": "existing", "mtu": 1500, "up": true},
    {"name": "mv1", "kind": "macvlan", "parent": "eth0", "mac": "02:00:00:00:01:01", "mtu": 1500, "up": true}
  ],
  "addresses": [{"link": "eth0", "cidr": "10.9.0.2/24"}, {"link": "mv1", "cidr": "10.9.1.2/24"}],
  "routes": [
    {"destination": "10.20.0.0/16", "gateway": "10.9.1.1", "link": "mv1", "table": 100},
    {"destination": "default", "gateway": "10.9.0.1", "link": "eth0", "table": 101}
  ],
  "rules": [{"from": "10.9.1.2/32", "table": 100, "priority": 20100}]
}"#;

const NEW: &str = r#"{
  "links": [
    {"name": "eth0", "kind": "existing", "mtu": 1500, "up": true},
    {"name": "eth1", "kind": "existing", "mtu": 9000, "up": true},
    {"name": "mv2", "kind": "macvlan", "parent": "eth1", "mac": "02:00:00:00:02:02", "mtu": 1500, "up": true}
  ],
  "addresses": [
    {"link": "eth0", "cidr": "10.9.0.2/24"},
    {"link": "eth1", "cidr": "10.9.3.2/24"},
    {"link": "mv2", "cidr": "10.9.2.2/24"}
  ],
  "routes": [
    {"destination": "10.30.0.0/16", "gateway": "10.9.2.1", "link": "mv2", "table": 102},
    {"destination": "default", "gateway": "10.9.0.1", "link": "eth0", "table": 101}
  ],
  "rules": [
    {"from": "10.9.2.2/32", "table": 102, "priority": 20102},
    {"from": "10.9.3.2/32", "table": 101, "priority": 20103}
  ]
}"#;

const OLD_GENERATION: &str = "uid-1/1";
const NEW_GENERATION: &str = "uid-1/2";

fn request(json: &str, generation: &str) -> pb::ApplyNetworkRequest {
    pb::ApplyNetworkRequest {
        desired_state_json: json.into(),
        generation: generation.into(),
        ..Default::default()
    }
}

fn array(v: Value) -> Vec<Value> {
    match v {
        Value::Array(a) => a,
        _ => Vec::new(),
    }
}

/// The namespace's network state as `ip -j` reads it, one comparable line per object (no
/// interface indexes, counters or timers), sorted.
fn host_state(ns: &Netns) -> anyhow::Result<Vec<String>> {
    let read = |args: &[&str]| -> anyhow::Result<Vec<Value>> {
        let text = ns.ip(args)?;
        Ok(array(serde_json::from_str(&text).with_context(|| {
            format!("parse `ip {}`: {text}", args.join(" "))
        })?))
    };
    let mut out = Vec::new();
    for l in read(&["-j", "-d", "link", "show"])? {
        if l["ifname"] == "lo" {
            continue;
        }
        let up = array(l["flags"].clone()).iter().any(|f| f == "UP");
        out.push(format!(
            "link {} kind={} mtu={} up={up} mac={} parent={} alias={}",
            l["ifname"],
            l["linkinfo"]["info_kind"],
            l["mtu"],
            l["address"],
            l["link"],
            l["ifalias"]
        ));
    }
    for l in read(&["-j", "addr", "show"])? {
        for a in array(l["addr_info"].clone()) {
            if a["scope"] == "global" {
                out.push(format!(
                    "address {} {}/{}",
                    l["ifname"], a["local"], a["prefixlen"]
                ));
            }
        }
    }
    for r in read(&["-4", "-j", "route", "show", "table", "all"])? {
        if r["table"] == "local" || r["type"] == "broadcast" || r["type"] == "local" {
            continue;
        }
        out.push(format!(
            "route {} via {} dev {} table {} proto {}",
            r["dst"], r["gateway"], r["dev"], r["table"], r["protocol"]
        ));
    }
    for r in read(&["-4", "-j", "rule", "show"])? {
        out.push(format!(
            "rule {} from {}/{} to {} table {}",
            r["priority"], r["src"], r["srclen"], r["dst"], r["table"]
        ));
    }
    out.sort();
    Ok(out)
}

/// The certificates of one run: the agent's server identity and the controller's client one.
struct Pki {
    dir: tempfile::TempDir,
    client: AgentTls,
}

impl Pki {
    fn new() -> anyhow::Result<Pki> {
        let (ca, ca_key) = certs::generate_ca()?;
        let agent = certs::issue(Leaf::Agent, &ca, &ca_key)?;
        let controller = certs::issue(Leaf::Controller, &ca, &ca_key)?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("tls.crt"), &agent.cert)?;
        std::fs::write(dir.path().join("tls.key"), &agent.key)?;
        std::fs::write(dir.path().join("ca.crt"), &ca)?;
        Ok(Pki {
            dir,
            client: AgentTls::new(&ca, &controller.cert, &controller.key),
        })
    }
}

/// One agent process in the namespace (started from a thread inside it, so it inherits it).
struct AgentProcess {
    process: Process,
    addr: SocketAddr,
}

/// Starts the agent on `127.0.0.1:port` with its state in `state_dir`; `hold` is the test hook
/// (after how many steps to hold every apply, and the marker file it writes then).
fn start_agent(
    pki: &Pki,
    state_dir: &Path,
    port: u16,
    hold: Option<(usize, &Path)>,
) -> anyhow::Result<AgentProcess> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let file = |name: &str| pki.dir.path().join(name).into_os_string();
    let kmsg = state_dir.with_extension("kmsg");
    std::fs::write(&kmsg, "")?;
    let mut env: Vec<(String, std::ffi::OsString)> = vec![
        (ROLE_ENV.into(), ROLE.into()),
        ("NODEKEEPER_LISTEN".into(), addr.to_string().into()),
        ("NODEKEEPER_NODE_NAME".into(), "fault-node".into()),
        ("NODEKEEPER_TLS_CERT".into(), file("tls.crt")),
        ("NODEKEEPER_TLS_KEY".into(), file("tls.key")),
        ("NODEKEEPER_CLIENT_CA".into(), file("ca.crt")),
        ("NODEKEEPER_STATE_DIR".into(), state_dir.into()),
        ("NODEKEEPER_KMSG_PATH".into(), kmsg.into()),
        ("NODEKEEPER_HEALTH_CHECKS".into(), "false".into()),
        (
            "NODEKEEPER_NVIDIA_SMI".into(),
            "/nonexistent/nvidia-smi".into(),
        ),
        // No drift re-convergence during the test: what the host shows is the apply's doing.
        ("NODEKEEPER_DRIFT_INTERVAL".into(), "60m".into()),
    ];
    if let Some((steps, marker)) = hold {
        env.push((
            "NODEKEEPER_TEST_HOLD_APPLY_AFTER_STEPS".into(),
            steps.to_string().into(),
        ));
        env.push((
            "NODEKEEPER_TEST_HOLD_APPLY_MARKER".into(),
            marker.as_os_str().to_owned(),
        ));
    }
    let program = Program::this_test_binary(HELPER, ROLE)?;
    let process = Process::start("nodekeeper-agent", &program, &[], &env, &Output::Stderr)?;
    Ok(AgentProcess { process, addr })
}

impl AgentProcess {
    /// A connection, retried while the agent starts.
    async fn connect(&mut self, pki: &Pki) -> anyhow::Result<AgentConnection> {
        let limits = CallLimits {
            timeout: Duration::from_secs(30),
            max_reply_bytes: 4 << 20,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.process.check_alive()?;
            match agent_client::connect(&pki.client, self.addr, limits).await {
                Ok(mut c) => {
                    // Connected is not serving yet: a report answers once it serves.
                    if c.get_report(0).await.is_ok() {
                        return Ok(c);
                    }
                }
                Err(e) if Instant::now() > deadline => bail!("connect to the agent: {e}"),
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The agent's network status, from its report.
async fn network_status(conn: &mut AgentConnection) -> anyhow::Result<pb::NetworkStatus> {
    let response = conn.get_report(0).await?;
    match response.result {
        Some(pb::get_report_response::Result::Report(r)) => {
            r.network.context("report without network status")
        }
        other => bail!("asked for a full report, got {other:?}"),
    }
}

async fn apply(
    conn: &mut AgentConnection,
    json: &str,
    generation: &str,
) -> anyhow::Result<pb::ApplyNetworkResponse> {
    let r = conn.apply_network(request(json, generation)).await?;
    anyhow::ensure!(
        r.outcome == pb::ApplyOutcome::Applied as i32,
        "apply {generation}: {:?} {}",
        r.outcome,
        r.message
    );
    Ok(r)
}

#[test]
fn an_agent_killed_mid_apply_leaves_the_old_state_or_the_new_never_between() {
    skip_unless_root!("needs root to create network namespaces");
    let ns = Arc::new(Netns::with_loopback("nk-fault-apply").expect("network namespace"));
    for (dev, peer, gateway) in [
        ("eth0", "eth0p", "10.9.0.1/24"),
        ("eth1", "eth1p", "10.9.3.1/24"),
    ] {
        ns.ip(&["link", "add", dev, "type", "veth", "peer", "name", peer])
            .unwrap();
        ns.ip(&["link", "set", dev, "up"]).unwrap();
        ns.address_up(peer, gateway).unwrap();
    }
    let inside = Arc::clone(&ns);
    ns.run(move || async move { scenario(&inside).await })
        .expect("the scenario");
}

async fn scenario(ns: &Netns) -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let dir = tempfile::tempdir()?;
    let state_dir = dir.path().join("state");
    let journal: PathBuf = state_dir.join(nodekeeper_agent::network::JOURNAL_FILE);
    let mut port = 9400;
    let mut next_port = || {
        port += 1;
        port
    };

    // The two states, as the kernel shows them once applied in full.
    let mut agent = start_agent(&pki, &state_dir, next_port(), None)?;
    let mut conn = agent.connect(&pki).await?;
    apply(&mut conn, OLD, OLD_GENERATION).await?;
    let old = host_state(ns)?;
    let steps = apply(&mut conn, NEW, NEW_GENERATION).await?.plan.len();
    let new = host_state(ns)?;
    assert!(steps >= 8, "a plan of many steps: {steps}");
    apply(&mut conn, OLD, OLD_GENERATION).await?;
    // The old state does not name eth1, so applying it leaves eth1's MTU as the new state set
    // it; an interrupted apply is undone to the letter, eth1 included (see the loop).
    ns.ip(&["link", "set", "eth1", "mtu", "1500"])?;
    assert_eq!(host_state(ns)?, old, "the old state applies again");
    drop(conn);
    agent.process.kill();

    for held in 0..=steps {
        let marker = dir.path().join(format!("held-{held}"));
        let mut agent = start_agent(&pki, &state_dir, next_port(), Some((held, &marker)))?;
        let mut conn = agent.connect(&pki).await?;
        let call =
            tokio::spawn(async move { conn.apply_network(request(NEW, NEW_GENERATION)).await });
        let deadline = Instant::now() + Duration::from_secs(30);
        while !marker.exists() {
            agent.process.check_alive()?;
            anyhow::ensure!(
                Instant::now() < deadline,
                "the agent did not reach step {held} of the apply"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mid = host_state(ns)?;
        if held > 0 && held < steps {
            // The kill point is a real one: the host is in neither state there.
            assert!(
                mid != old && mid != new,
                "after {held} of {steps} steps the host is between the states: {mid:#?}"
            );
        }
        agent.process.kill();
        let answer = call.await?;
        assert!(answer.is_err(), "the killed agent answered: {answer:?}");
        let kept = std::fs::read_to_string(&journal)?;
        assert!(
            kept.contains("\"pending\":{"),
            "the apply in progress is journalled: {kept}"
        );

        // Started again, the agent returns the host to the old state before anything else.
        let mut agent = start_agent(&pki, &state_dir, next_port(), None)?;
        let mut conn = agent.connect(&pki).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            let status = network_status(&mut conn).await?;
            if status.last_error.contains("cut short") {
                break status;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "no word of the interrupted apply after the restart: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            host_state(ns)?,
            old,
            "killed after {held} of {steps} steps and restarted: the old state, exactly"
        );
        assert_eq!(status.applied_generation, OLD_GENERATION, "{status:?}");
        assert!(
            status.last_error.contains(NEW_GENERATION),
            "{}",
            status.last_error
        );
        eprintln!("killed after {held}/{steps} steps: back in the old state");
        drop(conn);
        agent.process.kill();
    }

    // The controller asks again (it sees the old generation applied): the new state, in full.
    let mut agent = start_agent(&pki, &state_dir, next_port(), None)?;
    let mut conn = agent.connect(&pki).await?;
    apply(&mut conn, NEW, NEW_GENERATION).await?;
    assert_eq!(host_state(ns)?, new);
    let status = network_status(&mut conn).await?;
    assert_eq!(
        (
            status.applied_generation.as_str(),
            status.last_error.as_str()
        ),
        (NEW_GENERATION, "")
    );
    drop(conn);
    // Killed after a finished apply: nothing to undo; the restarted agent knows what it
    // applied and leaves the host as it is.
    agent.process.kill();
    let mut agent = start_agent(&pki, &state_dir, next_port(), None)?;
    let mut conn = agent.connect(&pki).await?;
    let status = network_status(&mut conn).await?;
    assert_eq!(
        (
            status.applied_generation.as_str(),
            status.last_error.as_str()
        ),
        (NEW_GENERATION, "")
    );
    assert_eq!(host_state(ns)?, new);
    drop(conn);
    agent.process.kill();
    Ok(())
}
