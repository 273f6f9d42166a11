//! `cargo xtask bench vnic`: one NodeNetworkConfig attaching one VNIC to each of N kwok nodes
//! with `maxUnavailable: 10%`, against the local OCI endpoint (signatures checked, 1 s attach)
//! and simulated agents. Starts a private control plane, runs the `bench_vnic` test of
//! `nodekeeper-e2e` (the controller must run in a binary that has the generated gRPC code, which
//! xtask must build without) and writes its section (`## vnic`) in BENCHMARKS.md: time to all
//! applied against the bound set by the attach latency × batches, cloud calls per node, API
//! writes per node, CPU.

use anyhow::{Context as _, bail};
use nodekeeper_e2e::{KUBECONFIG_ENV, Lifetime, Options, controlplane};
use serde_json::Value;

/// `cargo xtask bench vnic` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct VnicArgs {
    /// Simulated nodes, one VNIC each.
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// The simulated attach time (ATTACHING → ATTACHED) in seconds. The default, 1 s, is far
    /// below what OCI takes; a longer one shows how the rollout's time scales with it.
    #[arg(long, default_value_t = 1.0)]
    pub attach_latency: f64,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
    /// Build the benchmark (and so the controller it runs) without optimisation, as
    /// `cargo test` does; the default is a release build, the controller as it ships.
    #[arg(long)]
    pub debug: bool,
}

/// The targets when nothing fails.
const TARGET_CLOUD_CALLS: f64 = 3.0;
const TARGET_API_WRITES: f64 = 2.0;

pub fn run(args: VnicArgs) -> anyhow::Result<()> {
    if !(args.attach_latency > 0.0 && args.attach_latency <= 600.0) {
        bail!(
            "--attach-latency {}: give the simulated attach time in seconds, above 0 and at most 600",
            args.attach_latency
        );
    }
    let root = crate::codegen::repo_root();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let name = format!("bench-vnic-{}", std::process::id());
    let options = Options::new(name.clone(), Lifetime::WithThisProcess);
    let mut cluster = runtime
        .block_on(controlplane::up(&options, &mut |line| {
            eprintln!("xtask: {line}")
        }))
        .context("start the benchmark's control plane")?;
    let out = tempfile::NamedTempFile::new()?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let profile: &[&str] = if args.debug { &[] } else { &["--release"] };
    let status = crate::cargo::command(&cargo)
        .arg("test")
        .args(profile)
        .args([
            "-p",
            "nodekeeper-e2e",
            "--test",
            "node_network_config",
            "--",
            "--ignored",
            "--exact",
            "bench_vnic",
            "--nocapture",
        ])
        .env(KUBECONFIG_ENV, &cluster.kubeconfig)
        .env("NODEKEEPER_BENCH_VNIC_NODES", args.nodes.to_string())
        .env(
            "NODEKEEPER_BENCH_VNIC_ATTACH_MS",
            format!("{:.0}", args.attach_latency * 1000.0),
        )
        .env("NODEKEEPER_BENCH_OUT", out.path())
        .status()
        .context("run the bench_vnic test")?;
    cluster.stop();
    let _ = controlplane::down(&name, true);
    if !status.success() {
        bail!("bench_vnic failed; see its output above");
    }
    let figures: Value = serde_json::from_str(&std::fs::read_to_string(out.path())?)
        .context("read the benchmark's figures")?;
    let section = report(&figures, if args.debug { "Debug" } else { "Release" });
    println!("{section}");
    if !args.no_write {
        crate::benchmarks::write_section(&root, "vnic", &section)?;
    }
    Ok(())
}

fn report(f: &Value, build: &str) -> String {
    let num = |k: &str| f[k].as_f64().unwrap_or(f64::NAN);
    let n = num("nodes");
    let calls = num("cloud_calls_per_node");
    let writes = num("api_writes_per_node");
    let verdict = |ok: bool| if ok { "meets" } else { "misses" };
    let latency_flag = if (num("attach_delay_s") - 1.0).abs() > 1e-9 {
        format!(" --attach-latency {}", num("attach_delay_s"))
    } else {
        String::new()
    };
    let flag = format!(
        "{}{latency_flag}",
        if build == "Debug" { " --debug" } else { "" }
    );
    format!(
        "## vnic\n\n\
         `cargo xtask bench vnic --nodes {n}{flag}`: one NodeNetworkConfig, one VNIC on each of {n} kwok \
         nodes, `maxUnavailable: 10%` ({batches} batches), the local OCI endpoint (every request \
         signature-checked, ATTACHING → ATTACHED after {delay} s), simulated agents (a VNIC is on \
         the host once ATTACHED), the reconciler polling every {poll} s with its first look at a new attachment after \
         `--nnc-attach-latency {delay}s` (longer after looks that find it still ATTACHING, never shorter). {build} build, 2-core shared machine.\n\n\
         | figure | value | target |\n|---|---|---|\n\
         | time to all applied | {secs:.1} s | bound by attach latency × batches = {bound:.0} s |\n\
         | time above that bound | {above:.1} s ({per_batch_above:.2} s a batch; {ratio:.3} × the bound) | (what the controller, the API server and the endpoint add) |\n\
         | batches start every | {cadence} | the attach latency, {delay} s, when nothing but the attach is waited for |\n\
         | cloud calls per node | {calls:.2} ({ops}) | ≤ {TARGET_CLOUD_CALLS} ({cv}) |\n\
         | AttachVnic calls | {attach} for {n} nodes | one per node, never doubled |\n\
         | API writes per node | {writes:.2} ({total} in all: node conditions, status, finalizer) | ≤ {TARGET_API_WRITES} ({wv}) |\n\
         | CPU of the benchmark process | {cpu:.1} s | (controller, endpoint and simulated agents together) |\n\
         | CPU of kube-apiserver | {api_cpu:.1} s | (same 2 cores; {api_idle:.2} s per second before the rollout, with no rollout) |\n\
         | one request signature (RSA-2048, ring) | {sig:.2} ms | ({calls_all:.0} signed calls; the `rsa` crate, which signed them before: {sig_rsa:.2} ms) |\n\n\
         Where the time goes, batch by batch (seconds, from the endpoint's log: a batch is the \
         next {per_batch} AttachVnic calls; its looks are the GetVnicAttachment calls before the next batch's \
         first attach):\n\n\
         | batch | first attach at | attaches out in | last attach → first look | → last look | last look → next batch | looks |\n\
         |---|---|---|---|---|---|---|\n{rows}",
        above = num("seconds") - num("lower_bound_s"),
        ratio = num("seconds") / num("lower_bound_s"),
        cadence = cadence(&f["timeline"]),
        per_batch_above = (num("seconds") - num("lower_bound_s")) / num("batches"),
        batches = num("batches"),
        delay = num("attach_delay_s"),
        poll = num("poll_s"),
        secs = num("seconds"),
        bound = num("lower_bound_s"),
        ops = f["cloud_calls_by_operation"],
        cv = verdict(calls <= TARGET_CLOUD_CALLS),
        attach = f["attach_calls"],
        total = num("api_writes"),
        wv = verdict(writes <= TARGET_API_WRITES),
        cpu = num("process_cpu_s"),
        api_cpu = num("apiserver_cpu_s"),
        api_idle = num("apiserver_idle_cpu_per_s"),
        sig = num("signature_ms"),
        sig_rsa = num("signature_rsa_crate_ms"),
        calls_all = calls * n,
        per_batch = (n / num("batches")).ceil(),
        rows = timeline_rows(&f["timeline"]),
    )
}

/// The mean time from one batch's first attach to the next one's, in seconds, with its range.
fn cadence(timeline: &Value) -> String {
    let starts: Vec<f64> = timeline
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|b| b["start_s"].as_f64())
        .collect();
    let gaps: Vec<f64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    if gaps.is_empty() {
        return "–".to_owned();
    }
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    let (lo, hi) = gaps
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), g| (lo.min(*g), hi.max(*g)));
    format!("{mean:.2} s ({lo:.2}–{hi:.2} s)")
}

/// The per-batch rows of the timeline the benchmark measured, and a mean row.
fn timeline_rows(timeline: &Value) -> String {
    let batches = timeline.as_array().map(Vec::as_slice).unwrap_or_default();
    let cell = |v: &Value| v.as_f64().map_or("–".to_owned(), |x| format!("{x:.2}"));
    let mean = |key: &str| {
        let xs: Vec<f64> = batches.iter().filter_map(|b| b[key].as_f64()).collect();
        if xs.is_empty() {
            "–".to_owned()
        } else {
            format!("{:.2}", xs.iter().sum::<f64>() / xs.len() as f64)
        }
    };
    let mut rows = String::new();
    for (k, b) in batches.iter().enumerate() {
        rows += &format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            k + 1,
            cell(&b["start_s"]),
            cell(&b["attaching_s"]),
            cell(&b["to_first_look_s"]),
            cell(&b["to_last_look_s"]),
            cell(&b["to_next_batch_s"]),
            b["looks"]
        );
    }
    rows += &format!(
        "| mean | | {} | {} | {} | {} | |\n",
        mean("attaching_s"),
        mean("to_first_look_s"),
        mean("to_last_look_s"),
        mean("to_next_batch_s")
    );
    rows
}
