//! Node problems end to end, node-problem-detector style: real agents whose kernel-log monitor
//! reads a file standing in for `/dev/kmsg`, the controller, and a private control plane with
//! audit logging and kwok nodes. A kernel-log problem on one node becomes that node's condition
//! within one sweep and one write (PATCHes counted in the apiserver's audit log); a temporary
//! problem becomes one Node Event; an indicator verdict (open file handles) sets the condition
//! its `signals.*` key names, with one write and one Event per transition; a flood is capped by
//! the per-node Event budget and counted as suppressed; a drifting tunable value causes no write; the problem clearing (the node
//! "reboots": the agent restarts with a fresh kernel log) sets the condition back to False; and a
//! controller restart writes nothing and replays no Event.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test node_problems`.

mod controller_common;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use controller_common::*;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use nodekeeper_e2e::controlplane::{Lifetime, Options};
use nodekeeper_e2e::rig::{ControllerConfig, Output, Program};
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use nodekeeper_model::tuning::Signal;

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// The sweep interval of this test; "within one sweep" is measured against it.
const SWEEP: Duration = Duration::from_secs(10);
/// Node Events per node per hour in this test.
const BUDGET: u64 = 4;
/// The condition writer's field manager.
const MANAGER: &str = nodekeeper_api::names::MANAGER_NODE_CONDITIONS;

/// A file standing in for `/dev/kmsg`: records appended as the kernel formats them
/// (`prio,seq,usec-since-boot,flags;message`).
struct Kmsg {
    path: PathBuf,
    seq: u64,
}

impl Kmsg {
    fn create(path: PathBuf) -> anyhow::Result<Kmsg> {
        std::fs::write(&path, b"")?;
        Ok(Kmsg { path, seq: 0 })
    }

    fn append(&mut self, messages: &[&str]) -> anyhow::Result<()> {
        let uptime = std::fs::read_to_string("/proc/uptime")?;
        let secs: f64 = uptime
            .split_whitespace()
            .next()
            .and_then(|s| s.parse().ok())
            .context("parse /proc/uptime")?;
        let usec = (secs * 1e6) as u64;
        let mut file = std::fs::OpenOptions::new().append(true).open(&self.path)?;
        let mut text = String::new();
        for m in messages {
            self.seq += 1;
            text.push_str(&format!("3,{},{usec},-;{m}\n", self.seq));
        }
        file.write_all(text.as_bytes())?;
        Ok(())
    }

    /// Appends records stamped `usec` after boot, however that compares with those before.
    fn append_at(&mut self, usec: u64, messages: &[&str]) -> anyhow::Result<()> {
        let mut file = std::fs::OpenOptions::new().append(true).open(&self.path)?;
        let mut text = String::new();
        for m in messages {
            self.seq += 1;
            text.push_str(&format!("3,{},{usec},-;{m}\n", self.seq));
        }
        file.write_all(text.as_bytes())?;
        Ok(())
    }
}

/// Microseconds since boot now, as [`Kmsg::append`] stamps its records.
fn uptime_usec() -> anyhow::Result<u64> {
    let uptime = std::fs::read_to_string("/proc/uptime")?;
    let secs: f64 = uptime
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .context("parse /proc/uptime")?;
    Ok((secs * 1e6) as u64)
}

/// Condition PATCHes by nodekeeper's field manager on `node`'s status, from the audit log.
fn condition_patches(audit_log: &Path, node: &str) -> anyhow::Result<usize> {
    let text = std::fs::read_to_string(audit_log)?;
    let mut n = 0;
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)?;
        let object = &event["objectRef"];
        if event["verb"] == "patch"
            && object["resource"] == "nodes"
            && object["subresource"] == "status"
            && object["name"] == node
            && event["requestURI"]
                .as_str()
                .is_some_and(|uri| uri.contains(&format!("fieldManager={MANAGER}")))
        {
            n += 1;
        }
    }
    Ok(n)
}

/// Node `node`'s Events with `reason`, counting a series as its count: (events, notes).
async fn node_events(
    client: &kube::Client,
    node: &str,
    reason: &str,
) -> anyhow::Result<(u64, Vec<String>)> {
    let api: Api<Event> = Api::namespaced(client.clone(), "default");
    let mut count = 0;
    let mut notes = Vec::new();
    for e in api.list(&Default::default()).await?.items {
        let about = e.regarding.as_ref();
        if about.and_then(|r| r.name.as_deref()) == Some(node)
            && about.and_then(|r| r.kind.as_deref()) == Some("Node")
            && e.reason.as_deref() == Some(reason)
        {
            count += e.series.as_ref().map_or(1, |s| s.count.max(1) as u64);
            notes.extend(e.note);
        }
    }
    Ok((count, notes))
}

/// Starts an agent for `node` reading `kmsg`, retrying while a stopped one still holds the port.
async fn agent(
    node: &str,
    addr: SocketAddr,
    tls: &(String, String, String),
    kmsg: &Path,
) -> anyhow::Result<AgentHandle> {
    let extra = [
        format!("--kmsg-path={}", kmsg.display()),
        // No kubelet or runtime here: their checks would report them unhealthy.
        "--health-checks=false".to_owned(),
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match start_agent_with(node, addr, tls, &extra).await {
            Ok(a) => return Ok(a),
            Err(e) if Instant::now() < deadline => {
                eprintln!("agent for {node} not started yet ({e:#}); retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_log_problems_become_conditions_and_budgeted_events() -> anyhow::Result<()> {
    let mut options = Options::new(
        format!("test-{}-npd", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(options)).await??;
    let audit_log = cp.audit_log().context("audit enabled")?;
    let client = cp.client().await?;
    // The controller waits for its CRDs before it starts.
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-npd").await?;
    let group = unique_name("npd");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let ips: Vec<Ipv4Addr> = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-npd", 2, &labels, &ips).await?;
    let port = free_port();

    let rules = "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n";
    let budget = BUDGET.to_string();
    // Signals off but one: the others' verdicts come from this machine's disks and clock, which
    // the test does not control (the unit tests cover them). File handles are read from the
    // agent's own copy of /proc, which the test writes.
    let mut tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "30s"),
        ("callTimeout", "2s"),
        ("rules.yaml", rules),
        ("problems.eventsPerNodePerHour", budget.as_str()),
    ]
    .into();
    for signal in Signal::ALL {
        if signal != Signal::FileHandles {
            tuning.insert(signal.key(), "");
        }
    }
    put_tuning(&client, &ns, &tuning).await?;

    let config = ControllerConfig {
        kubeconfig: cp.kubeconfig().to_owned(),
        namespace: ns.clone(),
        identity: "npd-a".into(),
        http: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port())),
        agent_port: port,
        node_selector: format!("nodekeeper.dev/e2e-group={group}"),
        log: Some("info,kube=warn".into()),
        env: Vec::new(),
        output: Output::Stderr,
    };
    // "controller" is the role `run_as_controller_if_asked` answers to.
    let controller =
        ControllerProcess::spawn(&Program::this_test_binary(HELPER, "controller")?, &config)?;
    let http = controller.http;
    let tls = agent_tls(&client, &ns).await?;
    let dir = tempfile::tempdir()?;
    let mut kmsg0 = Kmsg::create(dir.path().join("kmsg0"))?;
    let mut kmsg1 = Kmsg::create(dir.path().join("kmsg1"))?;
    let addr = |i: usize| SocketAddr::new(ips[i].into(), port);
    let a0 = agent(&nodes[0], addr(0), &tls, &kmsg0.path).await?;
    let a1 = agent(&nodes[1], addr(1), &tls, &kmsg1.path).await?;
    a0.set_sysctl("net.core.somaxconn", "128")?;
    a1.set_sysctl("net.core.somaxconn", "8192")?;

    // Settled: every declared NPD condition is on both nodes, healthy (NPD's default reasons).
    let t = Duration::from_secs(90);
    for node in &nodes {
        for (type_, reason) in [
            ("KernelDeadlock", "KernelHasNoDeadlock"),
            ("ReadonlyFilesystem", "FilesystemIsNotReadOnly"),
            ("FileHandleUsageHigh", "FileHandleUsageNormal"),
        ] {
            wait_condition(&client, node, type_, "False", Some(reason), t).await?;
        }
    }
    wait_condition(
        &client,
        &nodes[0],
        "TunablesInBounds",
        "False",
        Some("TunablesOutOfBounds"),
        t,
    )
    .await?;
    // A sweep more, so that no first-read write is still on its way.
    tokio::time::sleep(SWEEP + Duration::from_secs(3)).await;
    let settled = [
        condition_patches(&audit_log, &nodes[0])?,
        condition_patches(&audit_log, &nodes[1])?,
    ];
    assert!(settled[0] >= 1 && settled[1] >= 1, "{settled:?}");

    // A drifting tunable value, same verdict: the controller reads it and writes nothing.
    a0.set_sysctl("net.core.somaxconn", "129")?;
    wait_for(
        "the controller to hold somaxconn = 129",
        Duration::from_secs(40),
        || async {
            let (_, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[0])).await?;
            let node: serde_json::Value = serde_json::from_str(&body)?;
            Ok((node["report"]["tunables"][0]["current"] == "129").then_some(()))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        condition_patches(&audit_log, &nodes[0])?,
        settled[0],
        "a drifting value is no write"
    );
    let (_, _, message) = controller_common::condition(
        &Api::all(client.clone()).get(&nodes[0]).await?,
        "TunablesInBounds",
    )
    .context("TunablesInBounds on node 0")?;
    assert!(
        !message.contains("128") && !message.contains("129"),
        "no current value in the message: {message}"
    );

    // A hung task in node 0's kernel log (the kernel's own wording): NPD's KernelDeadlock rule
    // makes it a condition, and its TaskHung rule a temporary problem.
    let started = Instant::now();
    let hung_usec = uptime_usec()?;
    kmsg0.append(&["INFO: task docker:2931 blocked for more than 120 seconds."])?;
    let (_, _, message) = wait_condition(
        &client,
        &nodes[0],
        "KernelDeadlock",
        "True",
        Some("DockerHung"),
        Duration::from_secs(60),
    )
    .await?;
    let took = started.elapsed();
    assert!(
        took <= SWEEP + Duration::from_secs(5),
        "within one sweep ({SWEEP:?}) and the write: took {took:?}"
    );
    assert!(message.contains("blocked for more than"), "{message}");
    tokio::time::sleep(SWEEP + Duration::from_secs(3)).await;
    assert_eq!(
        condition_patches(&audit_log, &nodes[0])?,
        settled[0] + 1,
        "one write for the problem"
    );
    assert_eq!(
        condition_patches(&audit_log, &nodes[1])?,
        settled[1],
        "the other node is not written"
    );
    let (n, notes) = node_events(&client, &nodes[0], "DockerHung").await?;
    assert_eq!(n, 1, "one Event for the condition turning True: {notes:?}");
    assert_eq!(node_events(&client, &nodes[0], "TaskHung").await?.0, 1);

    // A temporary problem recorded after the TaskHung one but stamped a second before it, as a
    // source whose clock lags the kernel log's stamps them (the journal's, a plugin runner's).
    // The controller goes by the agent's numbering: one Event, neither skipped for its older
    // stamp nor handed out again on later reads. (Node 0's third Event; the recovery below is
    // its fourth, within the budget of 4.)
    kmsg0.append_at(
        hung_usec.saturating_sub(1_000_000),
        &["unregister_netdevice: waiting for eth0 to become free. Usage count = 1"],
    )?;
    let (n, notes) = wait_for(
        "node 0's UnregisterNetDevice Event",
        Duration::from_secs(40),
        || async {
            let found = node_events(&client, &nodes[0], "UnregisterNetDevice").await?;
            Ok((found.0 > 0).then_some(found))
        },
    )
    .await?;
    assert_eq!(n, 1, "{notes:?}");
    tokio::time::sleep(SWEEP + Duration::from_secs(3)).await;
    assert_eq!(
        node_events(&client, &nodes[0], "UnregisterNetDevice")
            .await?
            .0,
        1,
        "an Event handed out once is not handed out again"
    );

    // A signal: node 1's open file handles at 95% of the maximum (critical at 90%) turn the
    // condition `signals.fileHandles` names True, with one write and one Warning Event; back at
    // 2%, False again, one more write and a Normal Event.
    // `start_agent_with` keeps the agent's copy of /proc beside its sysctl tree.
    let file_nr = a1
        .sysctl_root
        .parent()
        .context("agent dir")?
        .join("proc/sys/fs/file-nr");
    std::fs::write(&file_nr, "95000\t0\t100000\n")?;
    let (_, _, message) = wait_condition(
        &client,
        &nodes[1],
        "FileHandleUsageHigh",
        "True",
        Some("FileHandleUsageCritical"),
        Duration::from_secs(60),
    )
    .await?;
    assert_eq!(message, "1 of 1 out of bounds: files.used_percent critical");
    std::fs::write(&file_nr, "2000\t0\t100000\n")?;
    wait_condition(
        &client,
        &nodes[1],
        "FileHandleUsageHigh",
        "False",
        Some("FileHandleUsageNormal"),
        Duration::from_secs(60),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        condition_patches(&audit_log, &nodes[1])?,
        settled[1] + 2,
        "one write per signal transition"
    );
    assert_eq!(
        node_events(&client, &nodes[1], "FileHandleUsageCritical")
            .await?
            .0,
        1
    );
    assert_eq!(
        node_events(&client, &nodes[1], "FileHandleUsageNormal")
            .await?
            .0,
        1
    );

    // One temporary problem on node 1: one Event, no condition write.
    kmsg1.append(&["Out of memory: Killed process 4242 (stress-ng) total-vm:8388608kB, anon-rss:8126464kB, file-rss:1024kB, shmem-rss:0kB, UID:0 pgtables:16000kB oom_score_adj:0"])?;
    let (n, notes) = wait_for(
        "node 1's OOMKilling Event",
        Duration::from_secs(40),
        || async {
            let found = node_events(&client, &nodes[1], "OOMKilling").await?;
            Ok((found.0 > 0).then_some(found))
        },
    )
    .await?;
    assert_eq!(n, 1, "{notes:?}");
    assert!(
        notes[0].contains("Killed process 4242 (stress-ng)"),
        "{notes:?}"
    );

    // A flood of 20 on node 1: the budget (4 per hour, 3 used) lets one more through; the rest
    // are counted as suppressed.
    let suppressed_before = metric(
        http,
        "nodekeeper_problems_events_total",
        &["result=\"Suppressed\""],
    )
    .await
    .unwrap_or(0.0);
    let lines: Vec<String> = (0..20)
        .map(|i| format!("Out of memory: Killed process {} (worker) total-vm:1048576kB, anon-rss:1000000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:2000kB oom_score_adj:0", 5000 + i))
        .collect();
    kmsg1.append(&lines.iter().map(String::as_str).collect::<Vec<_>>())?;
    wait_for(
        "20 more problems handled on node 1",
        Duration::from_secs(40),
        || async {
            let s = metric(
                http,
                "nodekeeper_problems_events_total",
                &["result=\"Suppressed\""],
            )
            .await
            .unwrap_or(0.0);
            Ok((s >= suppressed_before + 19.0).then_some(()))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        node_events(&client, &nodes[1], "OOMKilling").await?.0,
        BUDGET - 2,
        "the budget caps the flood"
    );
    assert_eq!(
        metric(
            http,
            "nodekeeper_problems_events_total",
            &["result=\"Suppressed\""]
        )
        .await?,
        suppressed_before + 19.0
    );
    assert_eq!(
        condition_patches(&audit_log, &nodes[1])?,
        settled[1] + 2,
        "temporary problems write no condition"
    );
    // NPD's metrics at the controller, under NPD's names: 21 OOM kills, one node deadlocked.
    assert_eq!(
        metric(http, "problem_counter", &["reason=\"OOMKilling\""]).await?,
        21.0
    );
    assert_eq!(
        metric(
            http,
            "problem_counter",
            &["reason=\"FileHandleUsageCritical\""]
        )
        .await?,
        1.0
    );
    let gauge = wait_for(
        "problem_gauge for KernelDeadlock",
        Duration::from_secs(30),
        || async {
            let v = metric(
                http,
                "problem_gauge",
                &["type=\"KernelDeadlock\"", "reason=\"DockerHung\""],
            )
            .await
            .unwrap_or(0.0);
            Ok((v > 0.0).then_some(v))
        },
    )
    .await?;
    assert_eq!(gauge, 1.0);

    // Node 0 "reboots": a fresh kernel log, the agent restarted. The condition goes back to
    // False with NPD's default reason, and a Normal Event says so.
    a0.stop();
    drop(a0);
    let kmsg0b = Kmsg::create(dir.path().join("kmsg0-after-reboot"))?;
    let a0 = agent(&nodes[0], addr(0), &tls, &kmsg0b.path).await?;
    a0.set_sysctl("net.core.somaxconn", "129")?;
    wait_condition(
        &client,
        &nodes[0],
        "KernelDeadlock",
        "False",
        Some("KernelHasNoDeadlock"),
        Duration::from_secs(60),
    )
    .await?;
    let (n, notes) = wait_for(
        "node 0's recovery Event",
        Duration::from_secs(30),
        || async {
            let found = node_events(&client, &nodes[0], "KernelHasNoDeadlock").await?;
            Ok((found.0 > 0).then_some(found))
        },
    )
    .await?;
    assert_eq!(n, 1, "{notes:?}");
    assert!(
        notes[0].starts_with("KernelDeadlock is now False"),
        "{notes:?}"
    );

    // A controller restart: the new leader finds the problem conditions it owns on the Nodes
    // (by their managedFields) and writes nothing, and replays no Event.
    tokio::time::sleep(SWEEP + Duration::from_secs(3)).await;
    let before = [
        condition_patches(&audit_log, &nodes[0])?,
        condition_patches(&audit_log, &nodes[1])?,
    ];
    let events_before = [
        node_events(&client, &nodes[0], "DockerHung").await?.0,
        node_events(&client, &nodes[1], "OOMKilling").await?.0,
    ];
    let mut controller = controller;
    controller.stop();
    let config = ControllerConfig {
        identity: "npd-b".into(),
        http: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port())),
        ..config
    };
    let controller =
        ControllerProcess::spawn(&Program::this_test_binary(HELPER, "controller")?, &config)?;
    wait_for(
        "the new leader to read both nodes",
        Duration::from_secs(60),
        || async {
            let read = metric(controller.http, "nodekeeper_sweep_nodes_read", &[]).await?;
            Ok((read >= 2.0).then_some(()))
        },
    )
    .await?;
    tokio::time::sleep(SWEEP + Duration::from_secs(3)).await;
    assert_eq!(
        [
            condition_patches(&audit_log, &nodes[0])?,
            condition_patches(&audit_log, &nodes[1])?,
        ],
        before,
        "no write after a restart"
    );
    assert_eq!(
        [
            node_events(&client, &nodes[0], "DockerHung").await?.0,
            node_events(&client, &nodes[1], "OOMKilling").await?.0,
        ],
        events_before,
        "no Event replayed"
    );

    drop((a0, a1, controller, kmsg0, kmsg1));
    Ok(())
}

/// node-problem-detector's write of `type_` on `node`: status `True` with `heartbeat` as its
/// `lastHeartbeatTime`, under NPD's field manager (a strategic merge of the conditions, as NPD's
/// condition manager does).
async fn npd_writes(
    client: &kube::Client,
    node: &str,
    type_: &str,
    heartbeat: k8s_openapi::jiff::Timestamp,
) -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};
    let api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let at = heartbeat.to_string();
    let body = serde_json::json!({ "status": { "conditions": [{
        "type": type_, "status": "True", "reason": "DockerHung",
        "message": "task docker:7 blocked for more than 120 seconds.",
        "lastHeartbeatTime": at, "lastTransitionTime": at,
    }] } });
    let params = PatchParams {
        field_manager: Some("node-problem-detector".into()),
        ..PatchParams::default()
    };
    api.patch_status(node, &params, &Patch::Strategic(&body))
        .await?;
    Ok(())
}

/// During a migration node-problem-detector may run beside the agent and keep the same condition
/// types (`KernelDeadlock`, …) on the Node. A type another writer keeps alive (a fresh
/// `lastHeartbeatTime` under its own field manager) is left to it: written by both, each write
/// would take the field back from the other, about two writes per node per NPD heartbeat. Once
/// the other writer's heartbeat is older than 15 minutes (NPD removed), nodekeeper takes the type
/// over at its next read of the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_condition_type_another_writer_keeps_alive_is_left_to_it() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-npdside").await?;
    let group = unique_name("npdside");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let ips: Vec<Ipv4Addr> = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, "nk-npdside", 1, &labels, &ips).await?;
    let node = &nodes[0];
    let port = free_port();
    let mut tuning: BTreeMap<&str, &str> = [
        ("sweepInterval", "10s"),
        ("staleAfter", "30s"),
        ("callTimeout", "2s"),
    ]
    .into();
    for signal in Signal::ALL {
        tuning.insert(signal.key(), "");
    }
    put_tuning(&client, &ns, &tuning).await?;
    // NPD is there first, with a problem nodekeeper's agent does not see.
    npd_writes(
        &client,
        node,
        "KernelDeadlock",
        k8s_openapi::jiff::Timestamp::now(),
    )
    .await?;

    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let _controller = ControllerProcess::start(&ns, "npdside-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let dir = tempfile::tempdir()?;
    let kmsg = Kmsg::create(dir.path().join("kmsg"))?;
    let _agent = agent(node, SocketAddr::new(ips[0].into(), port), &tls, &kmsg.path).await?;

    // nodekeeper's first write of this node carries the kernel monitor's other types, not the
    // one NPD keeps: NPD's verdict stands, and nodekeeper's field manager does not own it.
    let t = Duration::from_secs(90);
    wait_condition(
        &client,
        node,
        "ReadonlyFilesystem",
        "False",
        Some("FilesystemIsNotReadOnly"),
        t,
    )
    .await?;
    let api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let owned_by_us = |n: &k8s_openapi::api::core::v1::Node| {
        nodekeeper_controller::conditions::managed_condition_types(
            n.metadata.managed_fields.as_deref().unwrap_or_default(),
        )
    };
    let now = api.get(node).await?;
    let deadlock = now
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "KernelDeadlock"))
        .context("KernelDeadlock on the node")?;
    assert_eq!(
        (deadlock.status.as_str(), deadlock.reason.as_deref()),
        ("True", Some("DockerHung")),
        "NPD's verdict was overwritten"
    );
    let ours = owned_by_us(&now);
    assert!(ours.contains("ReadonlyFilesystem"), "{ours:?}");
    assert!(!ours.contains("KernelDeadlock"), "{ours:?}");
    // The node's page says which types are left to another writer.
    let (status, body) = http_get(_controller.http, &format!("/api/v1/nodes/{node}")).await?;
    assert_eq!(status, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(
        page["conditionsLeftToOthers"],
        serde_json::json!(["KernelDeadlock"]),
        "{page}"
    );

    // NPD stops: its last heartbeat an hour old. nodekeeper takes the type over.
    let hour_ago = k8s_openapi::jiff::Timestamp::from_second(
        k8s_openapi::jiff::Timestamp::now().as_second() - 3600,
    )?;
    npd_writes(&client, node, "KernelDeadlock", hour_ago).await?;
    wait_condition(
        &client,
        node,
        "KernelDeadlock",
        "False",
        Some("KernelHasNoDeadlock"),
        t,
    )
    .await?;
    assert!(owned_by_us(&api.get(node).await?).contains("KernelDeadlock"));
    Ok(())
}
