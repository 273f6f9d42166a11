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
    CONTROLLER_USER, Programs, Rig, RigConfig, audit_counts, audit_end, audit_window, proc_usage,
    request_totals, rss_split,
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
    /// heaptrack hooks `malloc`, so the controller is built with its `system-allocator`
    /// feature (the C library's allocator instead of mimalloc, which a trace does not see): the
    /// RSS figures of such a run are that allocator's, plus the profiler's own memory.
    #[arg(long, value_name = "FILE")]
    pub heap_profile: Option<std::path::PathBuf>,
    /// Stop a fresh-fleet yardstick (the last figures measured) when the machine's available
    /// memory (MemAvailable) falls under this many MiB, and report it as not measured: each
    /// yardstick adds a field manager's entry to every Node, which the API server and kwok keep
    /// (at 65,000 nodes the second one outgrew 24 GiB).
    #[arg(long, default_value_t = 1024, value_name = "MIB")]
    pub yardstick_min_available: u64,
    /// Restart the controller this many times after the fresh fleet, one full sweep each, and
    /// report every restart sweep; the headline is their median. On this machine the same code
    /// sweeps in times that differ by half from run to run, so one sweep says little.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub restarts: u32,
    /// A second controller binary (e.g. built from another commit with
    /// `cargo build --release -p nodekeeper-controller` in a worktree) to compare with the one
    /// built here in the same rig: the restarts alternate between the two, the one built here
    /// last (the window measures it), and the report gives each side's sweeps and median.
    /// Give --restarts 4 or more for two sweeps a side.
    #[arg(long, value_name = "PATH")]
    pub compare_controller: Option<PathBuf>,
    /// Environment settings (KEY=VALUE, repeatable) of the compared restarts, with or without
    /// --compare-controller: e.g. `--compare-env MIMALLOC_PURGE_DELAY=100` compares an
    /// allocator setting.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_env)]
    pub compare_env: Vec<(String, String)>,
    /// Stop after the restart sweeps: no steady window, flip or yardsticks, and BENCHMARKS.md
    /// is not written. For comparing restart sweeps (a 10,000-node run then takes a third of
    /// the time).
    #[arg(long)]
    pub restarts_only: bool,
    /// Skip the fresh fleet's yardsticks (N status patches, three times over: at 65,000 nodes
    /// over half an hour, and most of the machine's memory); the report says they were not
    /// measured.
    #[arg(long)]
    pub no_yardsticks: bool,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

pub fn run(args: FleetArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    // The controller and the agents host run as release builds; this driver only creates
    // objects and reads figures, so its own build profile does not affect them.
    let programs = crate::fleet_rig::build(&root, args.agents_debug, args.heap_profile.is_some())?;
    if let Some(other) = &args.compare_controller {
        check_compared(other, &programs.controller)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    crate::fleet_rig::until_interrupted(&runtime, bench(args, root, programs))
}

/// Nodes of the rig whose nodekeeper conditions say what the bench expects of a healthy fleet.
pub(crate) async fn nodes_as_expected(client: &kube::Client) -> anyhow::Result<usize> {
    use k8s_openapi::api::core::v1::Node;
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    let lp = kube::api::ListParams::default()
        .labels(&format!("{}=fleet", crate::fleet_rig::GROUP_LABEL));
    Ok(api
        .list(&lp)
        .await?
        .items
        .iter()
        .filter(|node| node_as_expected(node))
        .count())
}

/// The instant the last of `n` fleet nodes showed NodekeeperReachable=True and
/// TunablesInBounds=True to one watch, within `limit`.
async fn watch_until_as_expected(
    client: kube::Client,
    n: usize,
    limit: Duration,
) -> anyhow::Result<Instant> {
    use futures::TryStreamExt as _;
    use k8s_openapi::api::core::v1::Node;
    use kube::runtime::watcher::{self, Event};
    let api: kube::Api<Node> = kube::Api::all(client);
    let config = watcher::Config::default()
        .labels(&format!("{}=fleet", crate::fleet_rig::GROUP_LABEL))
        .page_size(500);
    let mut ready = std::collections::HashSet::new();
    let mut stream = std::pin::pin!(watcher::watcher(api, config));
    let watch = async {
        while let Some(event) = stream.try_next().await? {
            let (Event::Apply(node) | Event::InitApply(node)) = event else {
                continue;
            };
            let name = kube::ResourceExt::name_any(&node);
            if node_as_expected(&node) {
                ready.insert(name);
            } else {
                ready.remove(&name);
            }
            if ready.len() >= n {
                return Ok::<_, anyhow::Error>(Instant::now());
            }
        }
        bail!("the node watch ended")
    };
    let outcome = tokio::time::timeout(limit, watch).await;
    match outcome {
        Ok(landed) => landed,
        Err(_) => bail!(
            "{} of {n} nodes showed their conditions within {limit:?}",
            ready.len()
        ),
    }
}

/// NodekeeperReachable=True and TunablesInBounds=True, what the benchmarks' healthy fleet shows.
fn node_as_expected(node: &k8s_openapi::api::core::v1::Node) -> bool {
    let has = |type_: &str| {
        node.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == type_ && c.status == "True"))
    };
    has("NodekeeperReachable") && has("TunablesInBounds")
}

async fn bench(args: FleetArgs, root: PathBuf, programs: Programs) -> anyhow::Result<()> {
    let n = args.nodes;
    let say = |text: String| eprintln!("[bench fleet] {text}");
    let rules = format!(
        "tunables:\n  - name: somaxconn\n    key: net.core.somaxconn\n    atLeast: 4096\n{}",
        crate::fleet_rig::HOST_NEUTRAL_THRESHOLDS
    );
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
    // Wait for what a user sees: every Node carrying the expected conditions, seen through one
    // watch opened now (before the first write can land), so the wait adds one list and the
    // events every other watcher gets anyway. Polling full Node lists instead cost the API
    // server a serialisation of every Node a quarter second, during the very writes measured.
    // Counting exactly N successful patches never ends when a write timed out (504) but landed,
    // and a failed write is retried within seconds, so the conditions are the truth to wait on.
    // The controller queues at most 1,024 writes, so its first pass over a fresh fleet ends
    // about when its writes do, at the API server's pace: on this machine about 100 a second.
    let fresh_bound = Duration::from_secs(900).max(Duration::from_millis(u64::try_from(n)? * 25));
    let as_expected = tokio::spawn(watch_until_as_expected(
        rig.client.clone(),
        n,
        fresh_bound.max(Duration::from_secs(1500)),
    ));
    let fresh_secs = rig.first_sweep(fresh_bound).await?;
    let reads_done = Instant::now();
    let http = rig.http;
    let last_landed = as_expected.await??;
    // A write that landed before the sweep's reads were done counts as 0 s after them.
    let written_after_reads = last_landed.saturating_duration_since(reads_done);
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
    // Until the last node showed its conditions to the watch.
    let fresh_written_secs = fresh_secs + written_after_reads.as_secs_f64();
    say(format!(
        "fresh fleet: every node read in {fresh_secs:.1} s, {fresh_patches:.0} condition patches by {fresh_written_secs:.1} s"
    ));

    // The controller that wrote the fresh fleet is stopped next: its peak is what a first
    // install costs (its queued writes and their reads).
    let fresh_hwm = proc_usage(rig.controller.pid()).map_or(0, |u| u.1);

    // The headline: a controller restart in a running cluster. Every node is read again and,
    // nothing having changed, nothing is written. With --compare-* the restarts alternate
    // between the two sides, the one built here last.
    let compared = args.compare_controller.is_some() || !args.compare_env.is_empty();
    let mut sweeps: Vec<RestartSweep> = Vec::new();
    for i in 0..args.restarts {
        let side = Side::of_restart(i, args.restarts, compared);
        let (binary, env) = match side {
            Side::Built => (None, &[][..]),
            Side::Compared => (args.compare_controller.as_deref(), &args.compare_env[..]),
        };
        if i > 0 {
            // A pause between restarts, so that each starts on a settled rig (the last sweep's
            // final calls answered and its connections closed).
            tokio::time::sleep(Duration::from_secs(15)).await;
        }
        let sweep = restart_sweep(&mut rig, binary, env, side).await?;
        say(format!(
            "full sweep after restart {} of {} ({}): {:.1} s, {:.0} condition patches; CPU: controller {:.1} s ({:.2} ms a node), {}",
            i + 1,
            args.restarts,
            side.name(),
            sweep.secs,
            sweep.patches,
            sweep.controller_cpu,
            sweep.controller_cpu * 1000.0 / n as f64,
            sweep.split_text()
        ));
        sweeps.push(sweep);
    }
    let built: Vec<&RestartSweep> = sweeps.iter().filter(|s| s.side == Side::Built).collect();
    let headline = median_sweep(&built);
    let (sweep_secs, restart_patches, restart_cpu) =
        (headline.secs, headline.patches, headline.controller_cpu);
    let sweep_cpu = headline.split.clone();
    let mut restart_rows = String::new();
    if sweeps.len() > 1 {
        for side in [Side::Built, Side::Compared] {
            let of_side: Vec<&RestartSweep> = sweeps.iter().filter(|s| s.side == side).collect();
            if of_side.is_empty() {
                continue;
            }
            let median = median_sweep(&of_side);
            let figure = format!("restart sweeps, {}", side.describe(&args));
            let value = format!(
                "{} s; median {:.1} s, controller CPU {:.1} s ({:.2} ms a node read), {}",
                of_side
                    .iter()
                    .map(|s| format!("{:.1}", s.secs))
                    .collect::<Vec<_>>()
                    .join(", "),
                median.secs,
                median.controller_cpu,
                median.controller_cpu * 1000.0 / n as f64,
                median.split_text()
            );
            say(format!("{figure}: {value}"));
            restart_rows.push_str(&format!("| {figure} | {value} |\n"));
        }
    } else {
        say(format!(
            "full sweep after a restart: {sweep_secs:.1} s, {restart_patches:.0} condition patches"
        ));
    }
    if args.restarts_only {
        return Ok(());
    }
    let pid = rig.controller.pid();
    let node_lease = rig.node_lease_seconds;
    let (client, audit, names, agents) = (&rig.client, &rig.audit, &rig.names, &rig.agents);
    // Let the sweep's tail settle before the window opens.
    tokio::time::sleep(Duration::from_secs(20)).await;

    // The window's clock runs from its first reading to its last, and every count in it is a
    // difference of two readings taken at its two ends.
    say(format!("steady window of {:?}", args.window));
    let window_start = Instant::now();
    let audit_from = audit_end(audit)?;
    let (_, _, cpu0) = proc_usage(pid)?;
    let totals0 = request_totals(client).await?;
    let patches0 = metric(http, "nodekeeper_conditions_patches_total", &[]).await?;
    let calls0 = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    let mut rss_max = 0;
    while window_start.elapsed() < args.window {
        tokio::time::sleep(Duration::from_secs(10).min(args.window)).await;
        rss_max = rss_max.max(proc_usage(pid)?.0);
    }
    let (rss, hwm, cpu1) = proc_usage(pid)?;
    let totals1 = request_totals(client).await?;
    let patches1 = metric(http, "nodekeeper_conditions_patches_total", &[]).await?;
    let calls1 = metric(http, "nodekeeper_sweep_agent_calls_total", &[]).await?;
    let audit_to = audit_end(audit)?;
    let window = window_start.elapsed().as_secs_f64();
    let (rss_anon, rss_file) = rss_split(pid)?;
    let (audit_window, audit_to, _) = audit_window(audit, audit_from, audit_to)?;
    let cpu_share = (cpu1 - cpu0) / window;
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
    // Said as soon as measured: the yardsticks run last and at the largest N may not finish.
    say(format!(
        "window of {window:.0} s: controller RSS {:.1} MiB ({:.1} anonymous, {:.1} file-backed; max sampled {:.1}), CPU {cpu_share:.3} cores, API requests {controller_total} ({:.3}/s), writes {controller_writes} ({:.3}/s)",
        rss as f64 / 1024.0,
        rss_anon as f64 / 1024.0,
        rss_file as f64 / 1024.0,
        rss_max as f64 / 1024.0,
        controller_total as f64 / window,
        controller_writes as f64 / window
    ));

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
    say(format!(
        "{k} nodes flipped unhealthy: all patched {flip_secs:.0} s after the flip; exactly those nodes, one patch each: {} ({} patches on {} nodes)",
        if exact { "yes" } else { "NO" },
        patched.len(),
        per_node.len()
    ));
    // The yardsticks for the fresh sweep: the same apiserver's time for N plain server-side
    // apply status patches on the same nodes, at the controller's write concurrency, under
    // their own field manager: one trivial condition each, and then as many conditions of the
    // same size as the controller's first write carried (its own conditions, renamed), so the
    // API server does the same work per patch; then those conditions again, renamed apart, as
    // strategic merge patches (no server-side apply), to show what the kind of patch costs.
    // Run last, so that they disturb nothing measured above.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let trivial = vec![
        json!({"type": "BenchPlain", "status": "True", "reason": "Bench",
        "message": "plain patch", "lastTransitionTime": now, "lastHeartbeatTime": now}),
    ];
    // A yardstick that runs the machine short of memory stops (`--yardstick-min-available`).
    let min_mib = args.yardstick_min_available;
    let plain = if args.no_yardsticks {
        Yardstick::Skipped
    } else {
        status_patches(client, names, PatchKind::Apply, &trivial, min_mib).await?
    };
    say(format!(
        "{n} plain status patches at concurrency {PLAIN_PATCH_CONCURRENCY}: {plain}"
    ));
    let alike_conditions = controller_conditions_renamed(client, &names[0]).await?;
    let alike_count = alike_conditions.len();
    let alike = match plain {
        Yardstick::Done(_) => {
            status_patches(client, names, PatchKind::Apply, &alike_conditions, min_mib).await?
        }
        Yardstick::Skipped => Yardstick::Skipped,
        Yardstick::Stopped { .. } | Yardstick::NotRun => Yardstick::NotRun,
    };
    say(format!(
        "{n} status patches of {alike_count} conditions like the controller's: {alike}"
    ));
    let merged = match alike {
        Yardstick::Done(_) => {
            let conditions = renamed(&alike_conditions, "Merge");
            status_patches(client, names, PatchKind::Merge, &conditions, min_mib).await?
        }
        Yardstick::Skipped => Yardstick::Skipped,
        Yardstick::Stopped { .. } | Yardstick::NotRun => Yardstick::NotRun,
    };
    say(format!(
        "{n} strategic merge status patches of the same {alike_count} conditions: {merged}"
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
        extra_flags(&args),
        if args.agents_debug { "the dev profile" } else { "release" },
        node_lease / 4,
    ));
    report.push_str("| figure | value |\n|---|---|\n");
    report.push_str(&format!(
        "| **full sweep after a controller restart** (leading → every node read once; conditions already in place{}) | **{sweep_secs:.1} s**, {restart_patches:.0} condition patches |\n",
        if built.len() > 1 { "; the median of the built controller's restarts below" } else { "" }
    ));
    report.push_str(&format!(
        "| CPU during that sweep: controller (from its start; {:.2} ms a node read) / {} | {restart_cpu:.1} s / {} |\n",
        restart_cpu * 1000.0 / n as f64,
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
    report.push_str(&restart_rows);
    report.push_str(&format!(
        "| first sweep of a fresh fleet (every node's conditions written for the first time) | {fresh_secs:.1} s, {fresh_patches:.0} condition patches |\n"
    ));
    report.push_str(&format!(
        "| fresh fleet: last first write landed / {n} plain SSA status patches (concurrency {PLAIN_PATCH_CONCURRENCY}, same apiserver) / ratio | {fresh_written_secs:.1} s / {} |\n",
        plain.against(fresh_written_secs)
    ));
    report.push_str(&format!(
        "| fresh fleet: last first write landed / {n} SSA status patches of {alike_count} conditions the size of the controller's (same concurrency and apiserver) / ratio | {fresh_written_secs:.1} s / {} |\n",
        alike.against(fresh_written_secs)
    ));
    report.push_str(&format!(
        "| fresh fleet: last first write landed / the same {n} patches as strategic merge patches (not server-side apply) / ratio | {fresh_written_secs:.1} s / {} |\n",
        merged.against(fresh_written_secs)
    ));
    report.push_str(&format!(
        "| fresh fleet: peak RSS (VmHWM) of the controller that wrote it | {:.1} MiB |\n",
        fresh_hwm as f64 / 1024.0
    ));
    report.push_str(&format!("| controller RSS at the end of the window / max sampled / peak (VmHWM) | {:.1} / {:.1} / {:.1} MiB |\n", rss as f64 / 1024.0, rss_max as f64 / 1024.0, hwm as f64 / 1024.0));
    report.push_str(&format!(
        "| of that RSS: anonymous (heap, stacks, relocated data) / file-backed (the binary's code and read-only data) | {:.1} / {:.1} MiB |\n",
        rss_anon as f64 / 1024.0,
        rss_file as f64 / 1024.0
    ));
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

/// The command's flags beyond `--nodes` and `--window`, as given, for the report.
fn extra_flags(args: &FleetArgs) -> String {
    let mut flags = String::new();
    if args.agents_debug {
        flags.push_str(" --agents-debug");
    }
    if args.restarts > 1 {
        flags.push_str(&format!(" --restarts {}", args.restarts));
    }
    if let Some(binary) = &args.compare_controller {
        flags.push_str(&format!(" --compare-controller {}", binary.display()));
    }
    for (key, value) in &args.compare_env {
        flags.push_str(&format!(" --compare-env {key}={value}"));
    }
    if args.no_yardsticks {
        flags.push_str(" --no-yardsticks");
    }
    flags
}

/// Refuses a compared controller that is missing or the very binary just built: two worktrees
/// sharing one `CARGO_TARGET_DIR` can leave cargo holding one build of the workspace's crates
/// for both, and the comparison would then measure a build against itself.
fn check_compared(other: &std::path::Path, built: &std::path::Path) -> anyhow::Result<()> {
    let other_bytes = std::fs::read(other).map_err(|e| {
        anyhow::anyhow!(
            "--compare-controller {}: {e}; give the path of a controller binary",
            other.display()
        )
    })?;
    if other_bytes == std::fs::read(built)? {
        bail!(
            "--compare-controller {} is the same binary as the controller just built ({}); build the other one with a CARGO_TARGET_DIR of its own (worktrees that share one can share one build of the workspace's crates)",
            other.display(),
            built.display()
        );
    }
    Ok(())
}

/// Which controller a restart starts: the one built here, or the one compared with it
/// (`--compare-controller`, `--compare-env`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Built,
    Compared,
}

impl Side {
    /// The side of restart `i` of `restarts`: alternating when `compared`, the last one always
    /// the built controller (whose window follows).
    fn of_restart(i: u32, restarts: u32, compared: bool) -> Side {
        if compared && (restarts - 1 - i) % 2 == 1 {
            Side::Compared
        } else {
            Side::Built
        }
    }

    fn name(self) -> &'static str {
        match self {
            Side::Built => "built",
            Side::Compared => "compared",
        }
    }

    /// What the side ran, for the report.
    fn describe(self, args: &FleetArgs) -> String {
        match self {
            Side::Built => "the controller built here".to_owned(),
            Side::Compared => {
                let mut parts = Vec::new();
                if let Some(binary) = &args.compare_controller {
                    parts.push(format!("`{}`", binary.display()));
                }
                for (key, value) in &args.compare_env {
                    parts.push(format!("`{key}={value}`"));
                }
                format!("compared ({})", parts.join(", "))
            }
        }
    }
}

/// One controller restart and its full sweep.
struct RestartSweep {
    side: Side,
    secs: f64,
    patches: f64,
    /// The controller's CPU from its start to the end of the sweep (its Node lists included).
    controller_cpu: f64,
    /// CPU of every other process of the rig over the same time.
    split: Vec<(String, f64)>,
}

impl RestartSweep {
    fn split_text(&self) -> String {
        self.split
            .iter()
            .map(|(name, cpu)| format!("{name} {cpu:.1} s"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The sweep of median duration (the lower middle one of an even count).
fn median_sweep<'a>(sweeps: &[&'a RestartSweep]) -> &'a RestartSweep {
    let mut sorted = sweeps.to_vec();
    sorted.sort_by(|a, b| a.secs.total_cmp(&b.secs));
    sorted[(sorted.len() - 1) / 2]
}

/// Restarts the controller (as `binary` with `env`, or as built) and waits for its full sweep,
/// taking the CPU every process of the rig used meanwhile. Every control-plane process shares
/// the machine's cores with the sweep; one that grows with the fleet is
/// kube-controller-manager, whose node lifecycle controller checks every Node every 5 s however
/// long the sweep takes.
async fn restart_sweep(
    rig: &mut Rig,
    binary: Option<&std::path::Path>,
    env: &[(String, String)],
    side: Side,
) -> anyhow::Result<RestartSweep> {
    let others = [
        "kube-apiserver",
        "etcd",
        "kwok",
        "kube-controller-manager",
        "kube-scheduler",
    ];
    let cpu_of = |pid: Option<u32>| pid.and_then(|p| proc_usage(p).ok()).map_or(0.0, |u| u.2);
    let agents_pids = rig.agents.pids();
    let agents_cpu = || agents_pids.iter().map(|p| cpu_of(Some(*p))).sum::<f64>();
    let usage = |rig: &Rig| -> Vec<f64> {
        others
            .iter()
            .map(|c| cpu_of(rig.cp.component_pid(c)))
            .chain([agents_cpu()])
            .collect()
    };
    let before = usage(rig);
    rig.restart_controller(binary, env)?;
    let secs = rig.first_sweep(Duration::from_secs(900)).await?;
    let controller_cpu = cpu_of(Some(rig.controller.pid()));
    let after = usage(rig);
    let names = others
        .iter()
        .map(|c| (*c).to_owned())
        .chain([match agents_pids.len() {
            1 => "agents host".to_owned(),
            k => format!("agents hosts ({k} processes)"),
        }]);
    let split = names
        .zip(after.iter().zip(&before).map(|(a, b)| a - b))
        .collect();
    let patches = metric(
        rig.http,
        "nodekeeper_conditions_patches_total",
        &["result=\"Ok\""],
    )
    .await?;
    Ok(RestartSweep {
        side,
        secs,
        patches,
        controller_cpu,
        split,
    })
}

/// The `## fleet` section's opening, written when BENCHMARKS.md has no such section yet.
const INTRO: &str = "## fleet\n\nThe controller against a local control plane with N kwok nodes and N real agents (mTLS, many per process, each on its own 127.x.y.z). Targets at 10,000 nodes: full sweep ≤ 30 s, controller RSS ≤ 200 MiB, steady-state writes ≤ 0.3/s, 0 requests from agents. Anchor: node-problem-detector's 5-minute heartbeat alone is ~33 Node patches/s at 10,000 nodes (10,000 / 300 s).\n";

/// The controller's writer pool bound (`controllers::nodes::sweep`), for a like-for-like yardstick.
const PLAIN_PATCH_CONCURRENCY: usize = 64;

/// The conditions the controller wrote on `node` (those its field manager owns in the status),
/// each renamed `Bench…` with a fresh timestamp: a patch as heavy as the controller's that
/// touches none of its conditions.
async fn controller_conditions_renamed(
    client: &kube::Client,
    node: &str,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use k8s_openapi::api::core::v1::Node;
    let node = kube::Api::<Node>::all(client.clone()).get(node).await?;
    let owned: Vec<String> = node
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.manager.as_deref() == Some(nodekeeper_api::names::MANAGER_NODE_CONDITIONS))
        .filter_map(|m| m.fields_v1.as_ref())
        .filter_map(|f| f.0.pointer("/f:status/f:conditions")?.as_object().cloned())
        .flat_map(|keys| keys.into_iter().map(|(k, _)| k))
        .filter_map(|k| {
            let key: serde_json::Value = serde_json::from_str(k.strip_prefix("k:")?).ok()?;
            Some(key.get("type")?.as_str()?.to_owned())
        })
        .collect();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let renamed: Vec<serde_json::Value> = node
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .filter(|c| owned.contains(&c.type_))
        .map(|c| {
            json!({"type": format!("Bench{}", c.type_), "status": c.status, "reason": c.reason,
                "message": c.message, "lastTransitionTime": now, "lastHeartbeatTime": now})
        })
        .collect();
    if renamed.is_empty() {
        bail!(
            "found no condition of field manager {} on the node",
            nodekeeper_api::names::MANAGER_NODE_CONDITIONS
        );
    }
    Ok(renamed)
}

/// `conditions` with each type prefixed `prefix` (`BenchReady` → `MergeBenchReady`): the same
/// patch on conditions no earlier yardstick wrote.
fn renamed(conditions: &[serde_json::Value], prefix: &str) -> Vec<serde_json::Value> {
    conditions
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let type_ = c["type"].as_str().unwrap_or_default();
            c["type"] = json!(format!("{prefix}{type_}"));
            c
        })
        .collect()
}

/// How a yardstick writes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum PatchKind {
    /// Server-side apply under the benchmark's own field manager, as the controller writes.
    Apply,
    /// A strategic merge patch (conditions merge by `type`), as `kubectl patch` sends.
    Merge,
}

/// What a yardstick measured.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Yardstick {
    /// Every patch answered, in this many seconds.
    Done(f64),
    /// Stopped when the machine's available memory fell under `--yardstick-min-available`
    /// (`available_mib` then).
    Stopped {
        after_secs: f64,
        done: usize,
        available_mib: u64,
        min_mib: u64,
    },
    /// Not started, because the one before it stopped.
    NotRun,
    /// Not started: `--no-yardsticks`.
    Skipped,
}

impl Yardstick {
    /// "yardstick s / ratio" of the controller's `secs` to this, or why there is none.
    fn against(&self, secs: f64) -> String {
        match self {
            Self::Done(y) => format!("{y:.1} s / {:.2}×", secs / y.max(1e-9)),
            Self::Stopped { .. } | Self::NotRun | Self::Skipped => format!("{self} / none"),
        }
    }
}

impl std::fmt::Display for Yardstick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Done(secs) => write!(f, "{secs:.1} s"),
            Self::Stopped {
                after_secs,
                done,
                available_mib,
                min_mib,
            } => write!(
                f,
                "not measured: stopped after {after_secs:.0} s and {done} patches, the machine's available memory down to {available_mib} MiB (under {min_mib})"
            ),
            Self::NotRun => write!(
                f,
                "not measured: the yardstick before it stopped short of memory"
            ),
            Self::Skipped => write!(f, "not measured (--no-yardsticks)"),
        }
    }
}

/// MemAvailable of `/proc/meminfo`, in MiB.
fn available_mib(meminfo: &str) -> Option<u64> {
    crate::fleet_rig::kib_field(meminfo, "MemAvailable:").map(|kib| kib / 1024)
}

/// One status patch of `conditions` (`kind`; under the benchmark's own field manager) on every
/// node in `names`, [`PLAIN_PATCH_CONCURRENCY`] at a time: the seconds they took, or where they
/// stopped because the machine ran short of memory (checked every 2 s, from the start).
async fn status_patches(
    client: &kube::Client,
    names: &[String],
    kind: PatchKind,
    conditions: &[serde_json::Value],
    min_mib: u64,
) -> anyhow::Result<Yardstick> {
    use futures::StreamExt as _;
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Patch, PatchParams};
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    let params = match kind {
        PatchKind::Apply => PatchParams::apply("nodekeeper-bench-plain").force(),
        PatchKind::Merge => PatchParams {
            field_manager: Some("nodekeeper-bench-merge".into()),
            ..PatchParams::default()
        },
    };
    let started = Instant::now();
    let mut patches = futures::stream::iter(names)
        .map(|name| {
            let body = json!({
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "status": {"conditions": conditions}
            });
            let (api, params) = (api.clone(), params.clone());
            async move {
                let patch = match kind {
                    PatchKind::Apply => Patch::Apply(&body),
                    PatchKind::Merge => Patch::Strategic(&body),
                };
                api.patch_status(name, &params, &patch).await
            }
        })
        .buffer_unordered(PLAIN_PATCH_CONCURRENCY);
    let (mut done, mut failed) = (0usize, 0usize);
    let mut check = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            next = patches.next() => match next {
                Some(result) => {
                    done += 1;
                    failed += usize::from(result.is_err());
                }
                None => break,
            },
            _ = check.tick() => {
                let meminfo = std::fs::read_to_string("/proc/meminfo")?;
                let available = available_mib(&meminfo)
                    .ok_or_else(|| anyhow::anyhow!("no MemAvailable in /proc/meminfo"))?;
                if available < min_mib {
                    return Ok(Yardstick::Stopped {
                        after_secs: started.elapsed().as_secs_f64(),
                        done,
                        available_mib: available,
                        min_mib,
                    });
                }
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    if failed > 0 {
        bail!(
            "{failed} of {} status patches ({kind:?}) failed",
            names.len()
        );
    }
    Ok(Yardstick::Done(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compared_restarts_alternate_and_the_built_controller_comes_last() {
        let sides = |restarts, compared| {
            (0..restarts)
                .map(|i| Side::of_restart(i, restarts, compared))
                .collect::<Vec<_>>()
        };
        use Side::{Built, Compared};
        assert_eq!(sides(4, true), [Compared, Built, Compared, Built]);
        assert_eq!(sides(5, true), [Built, Compared, Built, Compared, Built]);
        assert_eq!(sides(1, true), [Built]);
        assert_eq!(sides(3, false), [Built, Built, Built]);
    }

    #[test]
    fn the_median_sweep_is_the_lower_middle_one() {
        let sweep = |secs| RestartSweep {
            side: Side::Built,
            secs,
            patches: 0.0,
            controller_cpu: secs / 2.0,
            split: Vec::new(),
        };
        let sweeps = [sweep(9.0), sweep(7.0), sweep(12.0), sweep(8.0)];
        let refs: Vec<&RestartSweep> = sweeps.iter().collect();
        assert_eq!(median_sweep(&refs).secs, 8.0);
        assert_eq!(median_sweep(&refs[..3]).secs, 9.0);
        assert_eq!(median_sweep(&refs[..1]).secs, 9.0);
    }

    #[test]
    fn a_compared_controller_must_exist_and_differ_from_the_built_one() {
        let dir = tempfile::tempdir().unwrap();
        let (built, same, other) = (
            dir.path().join("built"),
            dir.path().join("same"),
            dir.path().join("other"),
        );
        std::fs::write(&built, b"controller A").unwrap();
        std::fs::write(&same, b"controller A").unwrap();
        std::fs::write(&other, b"controller B").unwrap();
        check_compared(&other, &built).unwrap();
        let error = check_compared(&same, &built).unwrap_err().to_string();
        assert!(
            error.contains("same binary") && error.contains("CARGO_TARGET_DIR"),
            "{error}"
        );
        let error = check_compared(&dir.path().join("missing"), &built)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--compare-controller") && error.contains("missing"),
            "{error}"
        );
    }

    #[test]
    fn compared_settings_are_key_value_pairs() {
        assert_eq!(
            parse_env("MIMALLOC_PURGE_DELAY=100"),
            Ok(("MIMALLOC_PURGE_DELAY".into(), "100".into()))
        );
        assert_eq!(parse_env("A="), Ok(("A".into(), String::new())));
        assert!(parse_env("=1").is_err());
        assert!(parse_env("NOVALUE").is_err());
    }

    #[test]
    fn available_memory_is_read_from_meminfo() {
        let meminfo = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:    2097152 kB\nBuffers:               0 kB\n";
        assert_eq!(available_mib(meminfo), Some(2048));
        assert_eq!(available_mib("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_stopped_yardstick_gives_no_ratio_and_says_why() {
        assert_eq!(Yardstick::Done(50.0).against(60.0), "50.0 s / 1.20×");
        let stopped = Yardstick::Stopped {
            after_secs: 601.4,
            done: 41_000,
            available_mib: 880,
            min_mib: 1024,
        };
        let said = stopped.against(455.0);
        assert!(said.ends_with(" / none"), "{said}");
        assert!(
            said.contains("41000 patches") && said.contains("880 MiB (under 1024)"),
            "{said}"
        );
        assert!(!said.contains('×'), "{said}");
        assert!(Yardstick::NotRun.against(455.0).ends_with(" / none"));
    }

    #[test]
    fn the_merge_yardstick_renames_the_conditions_and_keeps_the_rest() {
        let alike = vec![json!({"type": "BenchReady", "status": "True", "message": "m"})];
        let merged = renamed(&alike, "Merge");
        assert_eq!(merged[0]["type"], "MergeBenchReady");
        assert_eq!(merged[0]["status"], "True");
        assert_eq!(merged[0]["message"], "m");
    }
}
