//! `cargo xtask bench soak --nodes N --minutes M`: the controller on the simulated fleet of
//! [`crate::fleet_rig`] for M minutes while agents flap at random (seeded), two ways:
//!
//! - a *tunable flap* makes one node's agent report a tunable out of bounds for two to three
//!   sweep intervals, then back in bounds (`TunablesInBounds` False, then True);
//! - an *agent outage* takes one node's agent off the network (the agents host closes every
//!   connection to it as soon as it is accepted) for longer than `staleAfter`, then brings it
//!   back (`NodekeeperReachable` False, then True).
//!
//! Samples the controller's RSS over the run (a leak shows as a slope), counts its API writes in
//! the audit log against the write budget, and checks that every flap is reflected exactly once:
//! one successful Node condition patch when it starts and one when it ends, on that node only.
//! Writes its section (`## soak`) in BENCHMARKS.md.
//!
//! The controller and the agents host are built and run in release. Every flap is a file write
//! in the agents host's work directory; nothing leaves 127.0.0.0/8.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use nodekeeper_e2e::wait_for;

// Every node reachable with its tunables in bounds: the fleet bench's check.
use crate::bench_fleet::nodes_as_expected as all_in_bounds;
use crate::fleet_rig::{
    CONTROLLER_USER, Programs, Rig, RigConfig, audit_counts, audit_end, audit_lines, proc_usage,
};

/// `cargo xtask bench soak` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct SoakArgs {
    /// Simulated nodes (and agents).
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Length of the soak, in minutes (the figure is 30).
    #[arg(long, default_value_t = 30)]
    pub minutes: u64,
    /// Tunable flaps started per minute, each on a node picked at random.
    #[arg(long, default_value_t = 6)]
    pub flaps_per_minute: u32,
    /// Agent outages started per minute, each on a node picked at random among those with no
    /// flap or outage under way (0: none). An outage lasts the tuning's `staleAfter` (twice the
    /// sweep interval in the soak) plus two to three sweep intervals, so that the controller both
    /// gives the node up and sees it come back.
    #[arg(long, default_value_t = 2)]
    pub outages_per_minute: u32,
    /// Seed of the random choices (which node flaps, and for how long).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The tuning's `sweepInterval` (every agent read at least this often). A flap lasts two to
    /// three intervals, so that the sweep sees both of its edges. The soak's `staleAfter` is
    /// twice this.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// How often the controller's RSS is sampled.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub sample_every: Duration,
    /// Agent port on every node address.
    #[arg(long, default_value_t = 9443)]
    pub port: u16,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
    /// Build the agents host in the dev profile instead of release.
    #[arg(long)]
    pub agents_debug: bool,
    /// Build the controller in the dev profile too (a short build on a busy machine). Its RSS
    /// and CPU are then a debug build's; the slope, the writes and the flaps mean the same.
    #[arg(long)]
    pub debug_builds: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

/// The write budget of DESIGN.md ("≤ 1 API write per second on average", at 10,000 nodes).
const WRITE_BUDGET_PER_SEC: f64 = 1.0;

/// The tunable a flap moves out of bounds and back (the rule in the soak's tuning).
const KEY: &str = "net.core.somaxconn";
const IN_BOUNDS: &str = "4096";
const OUT_OF_BOUNDS: &str = "128";

pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    if args.nodes == 0 || args.minutes == 0 || args.flaps_per_minute == 0 {
        bail!("--nodes, --minutes and --flaps-per-minute must be at least 1");
    }
    let root = crate::codegen::repo_root();
    let programs = if args.debug_builds {
        let [controller] = crate::cargo::build_executables(
            &root,
            &[
                "build",
                "-p",
                "nodekeeper-controller",
                "--bin",
                "nodekeeper-controller",
            ],
            ["nodekeeper-controller"],
        )?;
        let [agents_host] = crate::cargo::build_executables(
            &root,
            &[
                "test",
                "-p",
                "nodekeeper-e2e",
                "--test",
                "controller_fleet_agents",
                "--no-run",
            ],
            ["controller_fleet_agents"],
        )?;
        Programs {
            controller,
            agents_host,
        }
    } else {
        crate::fleet_rig::build(&root, args.agents_debug, false)?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    crate::fleet_rig::until_interrupted(&runtime, soak(args, root, programs))
}

/// SplitMix64: a few lines of seeded randomness, so that a run can be repeated exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Successful and failed condition patches by the controller on each Node's status, from the
/// audit log's mark `from` on.
fn node_patches(audit: &Path, from: u64) -> anyhow::Result<BTreeMap<String, (usize, usize)>> {
    let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for event in audit_lines(audit, from, u64::MAX)?.0 {
        let object = &event["objectRef"];
        if event["stage"] == "ResponseComplete"
            && event["user"]["username"] == CONTROLLER_USER
            && event["verb"] == "patch"
            && object["resource"] == "nodes"
            && object["subresource"] == "status"
        {
            let name = object["name"].as_str().unwrap_or_default().to_owned();
            let entry = out.entry(name).or_default();
            if event["responseStatus"]["code"].as_i64() == Some(200) {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    Ok(out)
}

/// Least-squares slope of `(seconds, MiB)` samples, in MiB per hour.
fn slope_per_hour(samples: &[(f64, f64)]) -> f64 {
    let n = samples.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (sx, sy) = samples
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (num, den) = samples.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    if den == 0.0 { 0.0 } else { num / den * 3600.0 }
}

/// One node out of bounds until `until`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// A tunable out of bounds.
    Tunable,
    /// The agent off the network.
    Outage,
}

struct Flap {
    node: usize,
    kind: Kind,
    until: Instant,
}

async fn soak(args: SoakArgs, root: std::path::PathBuf, programs: Programs) -> anyhow::Result<()> {
    let n = args.nodes;
    let say = |text: String| eprintln!("[bench soak] {text}");
    let interval = args.sweep_interval;
    let stale_after = interval * 2;
    let rules = format!(
        "tunables:\n  - name: somaxconn\n    key: {KEY}\n    atLeast: {IN_BOUNDS}\n{}",
        crate::fleet_rig::HOST_NEUTRAL_THRESHOLDS
    );
    let config = RigConfig {
        what: "soak",
        nodes: n,
        port: args.port,
        tuning: json!({"sweepInterval": nodekeeper_model::tuning::format_duration(interval),
            "staleAfter": nodekeeper_model::tuning::format_duration(stale_after),
            "concurrency": "256", "callTimeout": "10s", "rules.yaml": rules}),
        heap_profile: None,
    };
    let mut rig = Rig::start(&config, &root, &programs, &say).await?;
    rig.first_sweep(Duration::from_secs(900)).await?;
    let client = rig.client.clone();
    wait_for(
        "every node's conditions in place",
        Duration::from_secs(600),
        || {
            let client = client.clone();
            async move { Ok((all_in_bounds(&client).await? >= n).then_some(())) }
        },
    )
    .await?;
    // Let the fresh fleet's writes finish before the soak opens.
    tokio::time::sleep(Duration::from_secs(20)).await;

    let pid = rig.controller.pid();
    let audit = rig.audit.clone();
    let audit_from = audit_end(&audit)?;
    let (_, _, cpu0) = proc_usage(pid)?;
    let soak = Duration::from_secs(args.minutes * 60);
    let flap_gap = Duration::from_secs_f64(60.0 / f64::from(args.flaps_per_minute));
    let outage_gap = (args.outages_per_minute > 0)
        .then(|| Duration::from_secs_f64(60.0 / f64::from(args.outages_per_minute)));
    let mut rng = Rng(args.seed);
    let mut down: Vec<Flap> = Vec::new();
    // Ended flaps per node, by kind.
    let mut flaps: BTreeMap<String, usize> = BTreeMap::new();
    let mut outages: BTreeMap<String, usize> = BTreeMap::new();
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let started = Instant::now();
    let mut next_flap = started;
    let mut next_outage = started + outage_gap.unwrap_or_default() / 2;
    let mut next_sample = started;
    say(format!(
        "soaking for {} min: a tunable flap every {flap_gap:.0?}, each lasting 2–3 sweep intervals of {interval:?}; {} (seed {})",
        args.minutes,
        match outage_gap {
            Some(gap) => format!(
                "an agent outage every {gap:.0?}, each lasting staleAfter ({stale_after:?}) plus 2–3 sweep intervals"
            ),
            None => "no agent outages".to_owned(),
        },
        args.seed
    ));
    // Flaps start only within the soak; the last ones are let run to their end, so that every
    // flap has both edges.
    while started.elapsed() < soak || !down.is_empty() {
        let now = Instant::now();
        let mut starting = Vec::new();
        if started.elapsed() < soak && now >= next_flap {
            next_flap += flap_gap;
            starting.push(Kind::Tunable);
        }
        if let Some(gap) = outage_gap
            && started.elapsed() < soak
            && now >= next_outage
        {
            next_outage += gap;
            starting.push(Kind::Outage);
        }
        for kind in starting {
            // A node with nothing under way; with every node busy, this flap is skipped.
            let free: Vec<usize> = (0..n)
                .filter(|i| !down.iter().any(|f| f.node == *i))
                .collect();
            if free.is_empty() {
                continue;
            }
            let node = free[rng.below(free.len() as u64) as usize];
            let jitter = interval.mul_f64(rng.below(1000) as f64 / 1000.0);
            let hold = match kind {
                Kind::Tunable => {
                    rig.agents
                        .spec
                        .agent(node)
                        .write_sysctl(KEY, OUT_OF_BOUNDS)?;
                    interval * 2 + jitter
                }
                Kind::Outage => {
                    rig.agents.spec.set_outage(node, true)?;
                    stale_after + interval * 2 + jitter
                }
            };
            down.push(Flap {
                node,
                kind,
                until: now + hold,
            });
        }
        let mut ended = Vec::new();
        down.retain(|f| {
            let over = now >= f.until;
            if over {
                ended.push((f.node, f.kind));
            }
            !over
        });
        for (node, kind) in ended {
            let name = rig.names[node].clone();
            match kind {
                Kind::Tunable => {
                    rig.agents.spec.agent(node).write_sysctl(KEY, IN_BOUNDS)?;
                    *flaps.entry(name).or_default() += 1;
                }
                Kind::Outage => {
                    rig.agents.spec.set_outage(node, false)?;
                    *outages.entry(name).or_default() += 1;
                }
            }
        }
        if now >= next_sample {
            next_sample += args.sample_every;
            let rss = proc_usage(pid)?.0 as f64 / 1024.0;
            samples.push((started.elapsed().as_secs_f64(), rss));
            say(format!(
                "{:>5.0} s: controller RSS {rss:.1} MiB; under way: {} tunable flaps, {} agent outages; done: {} flaps, {} outages",
                started.elapsed().as_secs_f64(),
                down.iter().filter(|f| f.kind == Kind::Tunable).count(),
                down.iter().filter(|f| f.kind == Kind::Outage).count(),
                flaps.values().sum::<usize>(),
                outages.values().sum::<usize>()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let flapped_secs = started.elapsed().as_secs_f64();
    say("every flap ended; waiting until every node shows it".into());
    let client = rig.client.clone();
    wait_for(
        "every node's conditions back in bounds",
        interval * 3 + Duration::from_secs(120),
        || {
            let client = client.clone();
            async move { Ok((all_in_bounds(&client).await? >= n).then_some(())) }
        },
    )
    .await?;
    // A second write for any edge would show within a sweep interval.
    tokio::time::sleep(interval + Duration::from_secs(10)).await;
    let total_secs = started.elapsed().as_secs_f64();
    let (rss_end, hwm, cpu1) = proc_usage(pid)?;
    samples.push((total_secs, rss_end as f64 / 1024.0));
    let (window, _, _) = audit_counts(&audit, audit_from)?;
    let patches = node_patches(&audit, audit_from)?;
    drop(rig);

    // Every flap and outage reflected once: two successful patches each, on those nodes only.
    let flap_count: usize = flaps.values().sum();
    let outage_count: usize = outages.values().sum();
    let mut wrong: Vec<String> = Vec::new();
    let nodes: BTreeSet<&String> = flaps
        .keys()
        .chain(outages.keys())
        .chain(patches.keys())
        .collect();
    for node in nodes {
        let (f, o) = (
            flaps.get(node).copied().unwrap_or(0),
            outages.get(node).copied().unwrap_or(0),
        );
        let got = patches.get(node).map_or(0, |p| p.0);
        if got != 2 * (f + o) {
            wrong.push(format!(
                "{node}: {got} patches for {f} tunable flaps and {o} agent outages"
            ));
        }
    }
    let failed: usize = patches.values().map(|p| p.1).sum();
    let ok_patches: usize = patches.values().map(|p| p.0).sum();
    let writes: BTreeMap<String, u64> = window
        .iter()
        .filter(|((u, v, _), _)| {
            u == CONTROLLER_USER && ["create", "update", "patch", "delete"].contains(&v.as_str())
        })
        .fold(BTreeMap::new(), |mut m, ((_, v, r), c)| {
            *m.entry(format!("{v} {r}")).or_default() += c;
            m
        });
    let write_total: u64 = writes.values().sum();
    let write_rate = write_total as f64 / total_secs;
    let requests: u64 = window
        .iter()
        .filter(|((u, _, _), _)| u == CONTROLLER_USER)
        .map(|(_, c)| c)
        .sum();
    let rss: Vec<f64> = samples.iter().map(|s| s.1).collect();
    let rss_max = rss.iter().copied().fold(0.0, f64::max);
    let slope = slope_per_hour(&samples);
    let half = samples.len() / 2;
    let mean = |s: &[(f64, f64)]| s.iter().map(|x| x.1).sum::<f64>() / s.len().max(1) as f64;
    let (first_half, second_half) = (mean(&samples[..half]), mean(&samples[half..]));

    let host_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mut report = String::new();
    report.push_str(&format!(
        "### N = {n}, {} min\n\nCommand: `cargo xtask bench soak --nodes {n} --minutes {} --flaps-per-minute {} --outages-per-minute {} --seed {} --sweep-interval {}{}`; staleAfter {}; controller built in {}, agents host in {}; machine: {host_cpus} cores shared with the control plane, kwok, all {n} agents{}.\n\n",
        args.minutes,
        args.minutes,
        args.flaps_per_minute,
        args.outages_per_minute,
        args.seed,
        nodekeeper_model::tuning::format_duration(interval),
        if args.debug_builds {
            " --debug-builds"
        } else if args.agents_debug {
            " --agents-debug"
        } else {
            ""
        },
        nodekeeper_model::tuning::format_duration(stale_after),
        if args.debug_builds { "the dev profile (unoptimised: RSS and CPU are a debug build's)" } else { "release" },
        if args.debug_builds || args.agents_debug { "the dev profile" } else { "release" },
        if args.minutes < 30 {
            format!(" and other builds. **The issue's 30-minute soak was not run here: this run lasted {} minutes of flapping** (plus the tail that lets the last flaps end and show)", args.minutes)
        } else {
            String::new()
        },
    ));
    report.push_str("| figure | value |\n|---|---|\n");
    report.push_str(&format!(
        "| soak (flaps started for {} min; until every flap ended and showed) | {total_secs:.0} s ({flapped_secs:.0} s of flapping) |\n",
        args.minutes
    ));
    report.push_str(&format!(
        "| controller RSS: first / last / max sample | {:.1} / {:.1} / {rss_max:.1} MiB (peak VmHWM {:.1} MiB) |\n",
        rss.first().copied().unwrap_or(0.0),
        rss.last().copied().unwrap_or(0.0),
        hwm as f64 / 1024.0
    ));
    report.push_str(&format!(
        "| controller RSS: mean of the first half / second half of the samples; least-squares slope | {first_half:.1} / {second_half:.1} MiB; {slope:+.1} MiB/h |\n"
    ));
    report.push_str(&format!(
        "| controller CPU over the soak | {:.1} s ({:.3} cores) |\n",
        cpu1 - cpu0,
        (cpu1 - cpu0) / total_secs
    ));
    report.push_str(&format!(
        "| tunable flaps (a tunable out of bounds for 2–3 sweep intervals, then back) | {flap_count} on {} nodes |\n",
        flaps.len()
    ));
    report.push_str(&format!(
        "| agent outages (connections to the agent cut for staleAfter + 2–3 sweep intervals, then answered) | {outage_count} on {} nodes |\n",
        outages.len()
    ));
    report.push_str(&format!(
        "| condition patches (successful / failed) | {ok_patches} / {failed}; expected {} (two per flap or outage) |\n",
        2 * (flap_count + outage_count)
    ));
    report.push_str(&format!(
        "| every flap and outage reflected once (one patch per edge, on those nodes only) | **{}**{} |\n",
        if wrong.is_empty() { "yes" } else { "NO" },
        if wrong.is_empty() {
            String::new()
        } else {
            format!(
                ": {}",
                wrong.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            )
        }
    ));
    report.push_str(&format!(
        "| controller API writes (audit) / budget | {write_total} ({write_rate:.3}/s) / {WRITE_BUDGET_PER_SEC}/s: **{}** |\n",
        if write_rate <= WRITE_BUDGET_PER_SEC {
            "within"
        } else {
            "OVER"
        }
    ));
    report.push_str(&format!(
        "| controller API requests (audit) | {requests} ({:.2}/s) |\n\n",
        requests as f64 / total_secs
    ));
    report.push_str("Controller writes by verb and resource:\n\n| write | count |\n|---|---|\n");
    for (what, count) in &writes {
        report.push_str(&format!("| {what} | {count} |\n"));
    }
    report.push_str("\nController RSS over time:\n\n| s | MiB |\n|---|---|\n");
    for (t, mib) in &samples {
        report.push_str(&format!("| {t:.0} | {mib:.1} |\n"));
    }
    report.push('\n');
    println!("{report}");
    if !args.no_write {
        crate::benchmarks::write_subsection(
            &root,
            "soak",
            INTRO,
            &format!("N = {n}, {} min", args.minutes),
            &report,
        )?;
    }
    if !wrong.is_empty() {
        bail!("flaps not reflected exactly once: {}", wrong.join("; "));
    }
    Ok(())
}

/// The `## soak` section's opening, written when BENCHMARKS.md has no such section yet.
const INTRO: &str = "## soak\n\nThe controller on N kwok nodes with N real agents (the fleet rig) for a fixed time while agents flap at random (seeded): a tunable flap puts one node's tunable out of bounds for two to three sweep intervals and back; an agent outage (runs from the outage change on) cuts every connection to one node's agent for longer than staleAfter, then lets it answer again. Looked for: controller RSS flat over time (no leak), API writes within the budget of DESIGN.md (≤ 1 write/s on average at 10,000 nodes), every flap reflected exactly once (one Node condition patch per edge, on that node only). The issue asks for 1,000 nodes for 30 minutes.\n";
