//! `cargo xtask bench networktest`: a peers mesh `NetworkTest` on the simulated fleet of
//! [`crate::fleet_rig`] (N kwok nodes, N real agents on 127.x.y.z, the release controller).
//! Measures the time from `create` to `Succeeded` (watched, not polled), the status writes the
//! controller made for the test (from the apiserver's audit log, by the controller's own
//! ServiceAccount), and the controller's CPU time over the run. Every probe goes from the agents
//! host to another node's 127.x.y.z address. Writes its section (`## networktest`) in
//! BENCHMARKS.md.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kube::Api;
use kube::api::PostParams;
use kube::runtime::wait::await_condition;
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::crd::network_test::Phase;
use serde_json::json;

use crate::fleet_rig::{
    CONTROLLER_USER, GROUP_LABEL, NAMESPACE, Programs, Rig, RigConfig, audit_counts, audit_end,
    proc_usage,
};

/// `cargo xtask bench networktest` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct NetworkTestArgs {
    /// Simulated nodes (and agents); every one is a source.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Peers each node probes (`targets: [{peers: {perNode: K}}]`).
    #[arg(long, default_value_t = 3)]
    pub peers: u32,
    /// Probe kind: icmp or tcp (tcp connects to the peers' agent port).
    #[arg(long, default_value = "icmp", value_parser = ["icmp", "tcp"])]
    pub kind: String,
    /// Probes per pair (`spec.count`).
    #[arg(long, default_value_t = 3)]
    pub count: u32,
    /// Pause between two probes of a pair (`spec.intervalMs`).
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u32,
    /// Tests run one after the other (each on the warm fleet); the report gives every run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub runs: u32,
    /// Agent port on every node address.
    #[arg(long, default_value_t = 9443)]
    pub port: u16,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
    /// Build the agents host in the dev profile instead of release.
    #[arg(long)]
    pub agents_debug: bool,
}

/// The targets of the issue: time to `Succeeded` and status writes per test.
const TARGET_SECONDS: f64 = 10.0;
const TARGET_WRITES: u64 = 3;

pub fn run(args: NetworkTestArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    let programs = crate::fleet_rig::build(&root, args.agents_debug, false)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    crate::fleet_rig::until_interrupted(&runtime, bench(args, root, programs))
}

/// One test's figures.
struct RunResult {
    seconds: f64,
    cpu_seconds: f64,
    status_writes: u64,
    other_writes: u64,
    sources: u32,
    pairs: u32,
    pairs_failed: u32,
    success_percent: f64,
    p50_us: u32,
    p95_us: u32,
    sent: u64,
    received: u64,
}

async fn bench(args: NetworkTestArgs, root: PathBuf, programs: Programs) -> anyhow::Result<()> {
    let say = |text: String| eprintln!("[bench networktest] {text}");
    let config = RigConfig {
        what: "networktest",
        nodes: args.nodes,
        port: args.port,
        tuning: json!({"sweepInterval": "5m", "staleAfter": "15m", "concurrency": "256",
            "callTimeout": "10s"}),
        heap_profile: None,
    };
    let mut rig = Rig::start(&config, &root, &programs, &say).await?;
    // Measure on a settled controller: its first sweep (every agent read once) is over.
    let sweep = rig.first_sweep(Duration::from_secs(900)).await?;
    say(format!(
        "first full sweep done in {sweep:.1} s; waiting for its condition writes to end"
    ));
    // The sweep's reads are done, its writes (every node's conditions, 10,000 at 10,000 nodes)
    // go on for a while: a test started among them would measure the API server's queue.
    let settled = settle(rig.http, Duration::from_secs(5), Duration::from_secs(300)).await?;
    say(format!(
        "no condition write for 5 s, {settled:.1} s after the sweep"
    ));

    let api: Api<NetworkTest> = Api::namespaced(rig.client.clone(), NAMESPACE);
    let mut results = Vec::new();
    for run in 1..=args.runs {
        let name = format!("mesh-bench-{run}");
        let result = one_test(&rig, &api, &name, &args).await?;
        say(format!(
            "run {run}: Succeeded in {:.2} s, {} status writes, controller CPU {:.2} s, {} pairs",
            result.seconds, result.status_writes, result.cpu_seconds, result.pairs
        ));
        results.push(result);
    }
    drop(rig);

    let report = render(&args, &results);
    println!("{report}");
    if !args.no_write {
        crate::benchmarks::write_section(&root, "networktest", &report)?;
    }
    let worst_seconds = results.iter().map(|r| r.seconds).fold(0.0, f64::max);
    let worst_writes = results.iter().map(|r| r.status_writes).max().unwrap_or(0);
    if worst_writes > TARGET_WRITES {
        bail!("a test took {worst_writes} status writes; the target is at most {TARGET_WRITES}");
    }
    if worst_seconds > TARGET_SECONDS {
        eprintln!(
            "[bench networktest] the slowest run took {worst_seconds:.1} s, over the {TARGET_SECONDS} s target"
        );
    }
    Ok(())
}

/// Waits until the controller's condition patch counter has not moved for `quiet`, at most
/// `within`; returns how long that took.
async fn settle(
    http: std::net::SocketAddr,
    quiet: Duration,
    within: Duration,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut last = (f64::NAN, Instant::now());
    loop {
        let patches =
            nodekeeper_e2e::rig::metric(http, "nodekeeper_conditions_patches_total", &[]).await?;
        if patches != last.0 {
            last = (patches, Instant::now());
        } else if last.1.elapsed() >= quiet {
            return Ok(started.elapsed().as_secs_f64());
        }
        if started.elapsed() > within {
            bail!("the controller was still writing node conditions after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Creates one mesh test, waits for it to finish, and reads its figures.
async fn one_test(
    rig: &Rig,
    api: &Api<NetworkTest>,
    name: &str,
    args: &NetworkTestArgs,
) -> anyhow::Result<RunResult> {
    let mut spec = json!({
        "nodeSelector": {"matchLabels": {GROUP_LABEL: "fleet"}},
        "maxNodes": args.nodes,
        "kind": args.kind,
        "targets": [{"peers": {"perNode": args.peers}}],
        "count": args.count,
        "intervalMs": args.interval_ms,
        "timeoutMs": 1000,
        "ttlSecondsAfterFinished": 3600,
    });
    if args.kind == "tcp" {
        spec["port"] = json!(args.port);
    }
    let test: NetworkTest = serde_json::from_value(json!({
        "apiVersion": "nodekeeper.dev/v1alpha1",
        "kind": "NetworkTest",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }))?;
    let audit_from = audit_end(&rig.audit)?;
    let (_, _, cpu0) = proc_usage(rig.controller.pid())?;
    let started = Instant::now();
    api.create(&PostParams::default(), &test)
        .await
        .with_context(|| format!("create NetworkTest {NAMESPACE}/{name}"))?;
    let finished = tokio::time::timeout(
        Duration::from_secs(300),
        await_condition(api.clone(), name, |t: Option<&NetworkTest>| {
            matches!(
                t.and_then(|t| t.status.as_ref()).and_then(|s| s.phase),
                Some(Phase::Succeeded | Phase::Failed)
            )
        }),
    )
    .await
    .with_context(|| format!("NetworkTest {name} did not finish within 5 minutes"))??;
    let seconds = started.elapsed().as_secs_f64();
    let (_, _, cpu1) = proc_usage(rig.controller.pid())?;
    let status = finished
        .and_then(|t| t.status)
        .with_context(|| format!("NetworkTest {name} finished without a status"))?;
    if status.phase != Some(Phase::Succeeded) {
        bail!(
            "NetworkTest {name} ended {:?} on loopback, where every pair should answer: {} of {} pairs failed, conditions {:?}",
            status.phase,
            status.pairs_failed,
            status.pairs,
            status.conditions
        );
    }
    // A later write would show here too: wait a little before counting.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (counts, _, _) = audit_counts(&rig.audit, audit_from)?;
    let writes = |resource: &str| -> u64 {
        counts
            .iter()
            .filter(|((user, verb, res), _)| {
                user == CONTROLLER_USER
                    && res == resource
                    && ["create", "update", "patch", "delete"].contains(&verb.as_str())
            })
            .map(|(_, c)| c)
            .sum()
    };
    let (p50_us, p95_us) = status
        .latency
        .as_ref()
        .map_or((0, 0), |l| (l.p50_us, l.p95_us));
    Ok(RunResult {
        seconds,
        cpu_seconds: cpu1 - cpu0,
        status_writes: writes("networktests/status"),
        other_writes: writes("networktests"),
        sources: status.sources,
        pairs: status.pairs,
        pairs_failed: status.pairs_failed,
        success_percent: status.success_percent.unwrap_or(0.0),
        p50_us,
        p95_us,
        sent: status.sent,
        received: status.received,
    })
}

fn render(args: &NetworkTestArgs, results: &[RunResult]) -> String {
    let host_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mut out = String::from("## networktest\n\n");
    out.push_str(&format!(
        "A `NetworkTest` with `targets: [{{peers: {{perNode: {}}}}}]`, kind `{}`, count {}, interval {} ms, over every node of the simulated fleet (`crate::fleet_rig`: kwok nodes, real agents with mTLS on distinct 127.x.y.z addresses, the release controller under its own ServiceAccount). Time is from the `create` call returning to the watch seeing `Succeeded`; writes are the controller's requests to the test in the apiserver's audit log; CPU is the controller's user+system time over the same span. Targets: ≤ {TARGET_SECONDS} s and ≤ {TARGET_WRITES} status writes.\n\n",
        args.peers, args.kind, args.count, args.interval_ms
    ));
    out.push_str(&format!(
        "Command: `cargo xtask bench networktest --nodes {} --peers {} --kind {} --count {} --interval-ms {} --runs {}`{}; machine: {host_cpus} cores shared with the control plane, kwok and all {} agents.\n\n",
        args.nodes,
        args.peers,
        args.kind,
        args.count,
        args.interval_ms,
        args.runs,
        if args.agents_debug { " --agents-debug" } else { "" },
        args.nodes
    ));
    out.push_str("| run | create → Succeeded | status writes | other writes to the test | controller CPU | sources | pairs (failed) | probes sent / answered | success | p50 / p95 latency |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (i, r) in results.iter().enumerate() {
        out.push_str(&format!(
            "| {} | {:.2} s | {} | {} | {:.2} s | {} | {} ({}) | {} / {} | {:.1} % | {} / {} µs |\n",
            i + 1,
            r.seconds,
            r.status_writes,
            r.other_writes,
            r.cpu_seconds,
            r.sources,
            r.pairs,
            r.pairs_failed,
            r.sent,
            r.received,
            r.success_percent,
            r.p50_us,
            r.p95_us
        ));
    }
    out.push('\n');
    out
}
