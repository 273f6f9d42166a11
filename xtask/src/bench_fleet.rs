//! `cargo xtask bench fleet --nodes N`: the controller on the simulated fleet of
//! [`crate::fleet_rig`] (N kwok nodes, N real agents on 127.x.y.z). Measures the first full sweep,
//! controller RSS and CPU, the API requests by verb and resource over a steady window
//! (`apiserver_request_total`, and the audit log by user to separate the controller from kwok),
//! then makes 1 % of the nodes unhealthy and checks that exactly those Nodes get one patch each.
//! Writes its section (`## fleet`) in BENCHMARKS.md.
//!
//! The controller and the agents host are built and run in release.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use nodekeeper_e2e::rig::metric;
use nodekeeper_e2e::wait_for;

use crate::fleet_rig::{
    CONTROLLER_USER, Programs, Rig, RigConfig, audit_counts, proc_usage, request_totals,
};

/// `cargo xtask bench fleet` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct FleetArgs {
    /// Simulated nodes (and agents).
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Length of the steady-state window in which API requests are counted.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub window: Duration,
    /// Percentage of nodes made unhealthy after the window.
    #[arg(long, default_value_t = 1.0)]
    pub unhealthy_percent: f64,
    /// Agent port on every node address.
    #[arg(long, default_value_t = 9443)]
    pub port: u16,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
    /// Build the agents host in the dev profile instead of release (a shorter build on a busy
    /// machine; the agents then answer more slowly, which can only lengthen the sweep).
    #[arg(long)]
    pub agents_debug: bool,
    /// Record every allocation of the measured controller (the one started after the fresh
    /// sweep, whose restart sweep and window are reported) with heaptrack's preload library
    /// (Debian package `heaptrack`), writing the raw trace to this file. Build with
    /// `CARGO_PROFILE_RELEASE_STRIP=none` for function names, then read the peak and, from a
    /// copy taken during the window, the live heap:
    /// `heaptrack_interpret < FILE | gzip > FILE.gz && heaptrack_print FILE.gz`.
    /// The RSS figures of such a run include the profiler's own memory.
    #[arg(long, value_name = "FILE")]
    pub heap_profile: Option<std::path::PathBuf>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

pub fn run(args: FleetArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    // The controller and the agents host run as release builds; this driver only creates
    // objects and reads figures, so its own build profile does not affect them.
    let programs = crate::fleet_rig::build(&root, args.agents_debug)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench(args, root, programs))
}

/// Nodes of the rig whose nodekeeper conditions say what the bench expects of a healthy fleet.
pub(crate) async fn nodes_as_expected(client: &kube::Client) -> anyhow::Result<usize> {
    use k8s_openapi::api::core::v1::Node;
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    let lp = kube::api::ListParams::default()
        .labels(&format!("{}=fleet", crate::fleet_rig::GROUP_LABEL));
    let has = |node: &Node, type_: &str| {
        node.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == type_ && c.status == "True"))
    };
    Ok(api
        .list(&lp)
        .await?
        .items
        .iter()
        .filter(|node| has(node, "NodekeeperReachable") && has(node, "TunablesInBounds"))
        .count())
}

async fn bench(args: FleetArgs, root: PathBuf, programs: Programs) -> anyhow::Result<()> {
    let n = args.nodes;
    let say = |text: String| eprintln!("[bench fleet] {text}");
    let rules = "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n";
    let config = RigConfig {
        what: "fleet",
        nodes: n,
        port: args.port,
        tuning: json!({"sweepInterval": "5m", "staleAfter": "15m", "concurrency": "256",
            "callTimeout": "10s", "rules.yaml": rules}),
        heap_profile: args.heap_profile.clone(),
    };
    let mut rig = Rig::start(&config, &root, &programs, &say).await?;
    say("waiting for the first sweep of a fresh fleet (it writes every node's conditions)".into());
    let fresh_secs = rig.first_sweep(Duration::from_secs(900)).await?;
    let reads_done = Instant::now();
    let http = rig.http;
    // Wait for what a user sees: every Node carrying the expected conditions. Counting exactly
    // N successful patches never ends when a write timed out (504) but landed, and a failed
    // write is retried within seconds, so the conditions are the truth to wait on.
    let client = rig.client.clone();
    wait_for(
        "every node's conditions (NodekeeperReachable=True, TunablesInBounds=True)",
        Duration::from_secs(600),
        || {
            let client = client.clone();
            async move { Ok((nodes_as_expected(&client).await? >= n).then_some(())) }
        },
    )
    .await?;
    let fresh_patches = metric(
        http,
        "nodekeeper_conditions_patches_total",
        &["result=\"Ok\""],
    )
    .await?;
    let failed_patches =
        metric(http, "nodekeeper_conditions_patches_total", &[]).await? - fresh_patches;
    if failed_patches > 0.0 {
        say(format!(
            "{failed_patches:.0} condition patches failed and were retried"
        ));
    }
    // Until the last first write landed (the patches counter is polled every 100 ms or so).
    let fresh_written_secs = fresh_secs + reads_done.elapsed().as_secs_f64();
    say(format!(
        "fresh fleet: every node read in {fresh_secs:.1} s, {fresh_patches:.0} condition patches by {fresh_written_secs:.1} s"
    ));

    // The headline: a controller restart in a running cluster. Every node is read again and,
    // nothing having changed, nothing is written.
    let others = ["kube-apiserver", "etcd", "kwok"];
    let cpu_of = |pid: Option<u32>| pid.and_then(|p| proc_usage(p).ok()).map_or(0.0, |u| u.2);
    let agents_pid = rig.agents.pid();
    let before: Vec<f64> = others
        .iter()
        .map(|c| cpu_of(rig.cp.component_pid(c)))
        .chain([cpu_of(Some(agents_pid))])
        .collect();
    rig.restart_controller()?;
    say("controller restarted; waiting for its full sweep".into());
    let sweep_secs = rig.first_sweep(Duration::from_secs(900)).await?;
    let pid = rig.controller.pid();
    let restart_cpu = cpu_of(Some(pid));
    let sweep_cpu: Vec<(String, f64)> = others
        .iter()
        .map(|c| cpu_of(rig.cp.component_pid(c)))
        .chain([cpu_of(Some(agents_pid))])
        .zip(&before)
        .zip(
            others
                .iter()
                .map(|c| (*c).to_owned())
                .chain(["agents host".to_owned()]),
        )
        .map(|((after, before), name)| (name, after - before))
        .collect();
    let restart_patches = metric(
        http,
        "nodekeeper_conditions_patches_total",
        &["result=\"Ok\""],
    )
    .await?;
    say(format!(
        "full sweep after a restart: {sweep_secs:.1} s, {restart_patches:.0} condition patches"
    ));
    let node_lease = rig.node_lease_seconds;
    let (client, audit, names, agents) = (&rig.client, &rig.audit, &rig.names, &rig.agents);
    // Let the sweep's tail settle before the window opens.
    tokio::time::sleep(Duration::from_secs(20)).await;

    let (_, _, cpu0) = proc_usage(pid)?;
    let totals0 = request_totals(client).await?;
    let (_, audit_from, _) = audit_counts(audit, 0)?;
    let patches0 = metric(http, "nodekeeper_conditions_patches_total", &[]).await?;
    let calls0 = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    say(format!("steady window of {:?}", args.window));
    let window_start = Instant::now();
    let mut rss_max = 0;
    while window_start.elapsed() < args.window {
        tokio::time::sleep(Duration::from_secs(10)).await;
        rss_max = rss_max.max(proc_usage(pid)?.0);
    }
    let window = window_start.elapsed().as_secs_f64();
    let (rss, hwm, cpu1) = proc_usage(pid)?;
    let totals1 = request_totals(client).await?;
    let (audit_window, audit_to, _) = audit_counts(audit, audit_from)?;
    let patches1 = metric(http, "nodekeeper_conditions_patches_total", &[]).await?;
    let calls1 = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    let cpu_share = (cpu1 - cpu0) / window;

    // Flip 1 % unhealthy and wait for exactly those patches.
    let k = ((n as f64) * args.unhealthy_percent / 100.0)
        .round()
        .max(1.0) as usize;
    let step = n / k;
    let flipped: Vec<usize> = (0..k).map(|j| j * step).collect();
    for &i in &flipped {
        agents
            .spec
            .agent(i)
            .write_sysctl("net.core.somaxconn", "128")?;
    }
    let flip_start = Instant::now();
    let expected: std::collections::BTreeSet<String> =
        flipped.iter().map(|&i| names[i].clone()).collect();
    let after = wait_for(
        "the flipped nodes' patches",
        Duration::from_secs(420),
        || {
            let audit = audit.to_path_buf();
            let expected = expected.clone();
            async move {
                let (_, _, patched) = audit_counts(&audit, audit_to)?;
                let set: std::collections::BTreeSet<String> = patched.iter().cloned().collect();
                Ok(expected.is_subset(&set).then_some(patched))
            }
        },
    )
    .await?;
    let flip_secs = flip_start.elapsed().as_secs_f64();
    // A little longer, so a second patch would show.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (_, _, patched) = audit_counts(audit, audit_to)?;
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    for name in &patched {
        *per_node.entry(name.clone()).or_default() += 1;
    }
    let exact = per_node
        .keys()
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        == expected
        && per_node.values().all(|&c| c == 1);
    let _ = after;
    // The yardstick for the fresh sweep: the same apiserver's time for N plain server-side
    // apply status patches of one trivial condition on the same nodes, at the controller's
    // write concurrency. Run last, so that it disturbs nothing measured above.
    let plain_secs = plain_status_patches(client, names, PLAIN_PATCH_CONCURRENCY).await?;
    say(format!(
        "{n} plain status patches at concurrency {PLAIN_PATCH_CONCURRENCY}: {plain_secs:.1} s"
    ));
    drop(rig);

    // Report.
    let mut report = String::new();
    let host_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    report.push_str(&format!("### N = {n}\n\n"));
    report.push_str(&format!(
        "Command: `cargo xtask bench fleet --nodes {n} --window {}{}`; controller built in release, agents host in {}; machine: {host_cpus} cores shared with the control plane, kwok and all {n} agents. The simulated kubelets' node Leases last {node_lease} s (kwok renews each every {} s; see `fleet_rig::node_lease_seconds`).\n\n",
        nodekeeper_model::tuning::format_duration(args.window),
        if args.agents_debug { " --agents-debug" } else { "" },
        if args.agents_debug { "the dev profile" } else { "release" },
        node_lease / 4,
    ));
    report.push_str("| figure | value |\n|---|---|\n");
    report.push_str(&format!(
        "| **full sweep after a controller restart** (leading → every node read once; conditions already in place) | **{sweep_secs:.1} s**, {restart_patches:.0} condition patches |\n"
    ));
    report.push_str(&format!(
        "| CPU during that sweep: controller (from its start) / {} | {restart_cpu:.1} s / {} |\n",
        sweep_cpu
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(" / "),
        sweep_cpu
            .iter()
            .map(|(_, c)| format!("{c:.1} s"))
            .collect::<Vec<_>>()
            .join(" / "),
    ));
    report.push_str(&format!(
        "| first sweep of a fresh fleet (every node's conditions written for the first time) | {fresh_secs:.1} s, {fresh_patches:.0} condition patches |\n"
    ));
    report.push_str(&format!(
        "| fresh fleet: last first write landed / {n} plain SSA status patches (concurrency {PLAIN_PATCH_CONCURRENCY}, same apiserver) / ratio | {fresh_written_secs:.1} s / {plain_secs:.1} s / {:.2}× |\n",
        fresh_written_secs / plain_secs.max(1e-9)
    ));
    report.push_str(&format!("| controller RSS at the end of the window / max sampled / peak (VmHWM) | {:.1} / {:.1} / {:.1} MiB |\n", rss as f64 / 1024.0, rss_max as f64 / 1024.0, hwm as f64 / 1024.0));
    report.push_str(&format!(
        "| controller CPU in the window | {:.3} cores ({:.1} s in {window:.0} s) |\n",
        cpu_share,
        cpu1 - cpu0
    ));
    report.push_str(&format!(
        "| agent calls in the window | {:.0} ({:.2}/s) |\n",
        calls1 - calls0,
        (calls1 - calls0) / window
    ));
    report.push_str(&format!(
        "| condition patches in the window (controller metric) | {:.0} ({:.3}/s) |\n",
        patches1 - patches0,
        (patches1 - patches0) / window
    ));
    let controller_total: u64 = audit_window
        .iter()
        .filter(|((u, _, _), _)| u == CONTROLLER_USER)
        .map(|(_, c)| c)
        .sum();
    let controller_writes: u64 = audit_window
        .iter()
        .filter(|((u, v, _), _)| {
            u == CONTROLLER_USER && ["create", "update", "patch", "delete"].contains(&v.as_str())
        })
        .map(|(_, c)| c)
        .sum();
    report.push_str(&format!("| controller API requests in the window (audit) | {controller_total} ({:.3}/s), writes {controller_writes} ({:.3}/s) |\n", controller_total as f64 / window, controller_writes as f64 / window));
    let agent_requests: u64 = audit_window
        .iter()
        .filter(|((u, _, _), _)| u.contains("agent"))
        .map(|(_, c)| c)
        .sum();
    report.push_str(&format!(
        "| API requests from agents | {agent_requests} (agents have no Kubernetes client) |\n"
    ));
    report.push_str(&format!("| 1 % flipped unhealthy: nodes | {k}; all patched {flip_secs:.0} s after the flip; exactly those nodes, one patch each: **{}** ({} patches on {} nodes) |\n\n", if exact { "yes" } else { "NO" }, patched.len(), per_node.len()));
    report.push_str("Controller requests in the window by verb and resource (audit log, user `");
    report.push_str(CONTROLLER_USER);
    report.push_str("`):\n\n| verb | resource | requests |\n|---|---|---|\n");
    for ((user, verb, resource), count) in &audit_window {
        if user == CONTROLLER_USER {
            report.push_str(&format!("| {verb} | {resource} | {count} |\n"));
        }
    }
    report.push_str("\nAll clients in the window by verb and resource (`apiserver_request_total` deltas; kwok's heartbeats dominate):\n\n| verb | resource | requests | per second |\n|---|---|---|---|\n");
    for (key, v1) in &totals1 {
        let delta = v1 - totals0.get(key).copied().unwrap_or(0.0);
        if delta >= 1.0 {
            let resource = if key.2.is_empty() {
                key.1.clone()
            } else {
                format!("{}/{}", key.1, key.2)
            };
            report.push_str(&format!(
                "| {} | {resource} | {delta:.0} | {:.2} |\n",
                key.0,
                delta / window
            ));
        }
    }
    report.push('\n');
    println!("{report}");
    if !args.no_write {
        crate::benchmarks::write_subsection(&root, "fleet", INTRO, &format!("N = {n}"), &report)?;
    }
    if !exact {
        bail!("the flipped nodes did not get exactly one patch each: {per_node:?}");
    }
    Ok(())
}

/// The `## fleet` section's opening, written when BENCHMARKS.md has no such section yet.
const INTRO: &str = "## fleet\n\nThe controller against a local control plane with N kwok nodes and N real agents (mTLS, many per process, each on its own 127.x.y.z). Targets at 10,000 nodes: full sweep ≤ 30 s, controller RSS ≤ 200 MiB, steady-state writes ≤ 0.3/s, 0 requests from agents. Anchor: node-problem-detector's 5-minute heartbeat alone is ~33 Node patches/s at 10,000 nodes (10,000 / 300 s).\n";

/// The controller's writer pool bound (`controllers::nodes::sweep`), for a like-for-like yardstick.
const PLAIN_PATCH_CONCURRENCY: usize = 64;

/// Seconds for one server-side-apply status patch (one trivial condition, its own field manager)
/// on every node in `names`, `concurrency` at a time.
async fn plain_status_patches(
    client: &kube::Client,
    names: &[String],
    concurrency: usize,
) -> anyhow::Result<f64> {
    use futures::StreamExt as _;
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams};
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    let params = PatchParams::apply("nodekeeper-bench-plain").force();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let started = Instant::now();
    let results: Vec<Result<Node, kube::Error>> = futures::stream::iter(names)
        .map(|name| {
            let body = json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "status": {"conditions": [{"type": "BenchPlain", "status": "True",
                    "reason": "Bench", "message": "plain patch", "lastTransitionTime": now,
                    "lastHeartbeatTime": now}]}
            });
            let (api, params) = (api.clone(), params.clone());
            async move { api.patch_status(name, &params, &Patch::Apply(&body)).await }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let secs = started.elapsed().as_secs_f64();
    let failed = results.iter().filter(|r| r.is_err()).count();
    if failed > 0 {
        bail!("{failed} of {} plain status patches failed", names.len());
    }
    Ok(secs)
}
