//! `cargo xtask bench netconf`: host network configuration of N secondary VNICs (VM layout:
//! MTU, up, address, own table with a default route, `from` rule; plus the rule keeping
//! 169.254.0.0/16 in main) in a private network namespace — apply from scratch, no-op re-apply
//! (counting netlink writes), and a failed apply that rolls back — and the same desired state
//! applied by `nmstatectl apply --kernel` (nmstatectl from crates.io, installed into a cache
//! directory outside the repo) in the same run. Writes its section (`## netconf`) in
//! BENCHMARKS.md. Needs root (it creates the namespace).

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use nodekeeper_model::network::NetworkState;
use nodekeeper_netconf::{ApplyOptions, Netconf, Outcome};
use nodekeeper_testkit::Netns;
use nodekeeper_testkit::netns::run;

/// `cargo xtask bench netconf` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct NetconfArgs {
    /// Secondary VNICs' worth of state.
    #[arg(long, default_value_t = 8, env = "NODEKEEPER_BENCH_VNICS")]
    pub vnics: u32,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 10, env = "NODEKEEPER_BENCH_ITERATIONS")]
    pub iterations: u32,
    /// Where nmstatectl is installed (`cargo install --root`) and built.
    #[arg(
        long,
        default_value = "/var/cache/nodekeeper-bench",
        env = "NODEKEEPER_BENCH_CACHE"
    )]
    pub cache: PathBuf,
    /// Skip the nmstatectl comparison.
    #[arg(long, env = "NODEKEEPER_BENCH_NO_NMSTATE")]
    pub no_nmstate: bool,
    /// Do not write BENCHMARKS.md.
    #[arg(long, env = "NODEKEEPER_BENCH_NO_WRITE")]
    pub no_write: bool,
}

const NMSTATE_VERSION: &str = "2.2.62";

/// Runs an `ip -batch` script in namespace `ns`, ignoring individual failures (`-force`).
fn batch(ns: &str, script: &str) -> anyhow::Result<()> {
    let mut child = Command::new("ip")
        .args(["-force", "-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(script.as_bytes())?;
    child.wait()?;
    Ok(())
}

/// The bench state. `full`: the whole VM layout; otherwise the subset `nmstatectl apply --kernel`
/// can apply (up, addresses, routes: its kernel mode sets neither MTU nor route rules).
fn desired(n: u32, full: bool) -> NetworkState {
    let mut links = Vec::new();
    let mut addresses = Vec::new();
    let mut routes = Vec::new();
    let mut rules = Vec::new();
    if full {
        rules.push(serde_json::json!({"to": "169.254.0.0/16", "table": 254, "priority": 20100}));
    }
    for i in 1..=n {
        let mut link = serde_json::json!({"name": format!("vnic{i}"), "kind": "existing", "mac": format!("02:00:17:0b:00:{i:02x}"), "up": true});
        if full {
            link["mtu"] = serde_json::json!(9000);
        }
        links.push(link);
        addresses.push(
            serde_json::json!({"link": format!("vnic{i}"), "cidr": format!("10.0.{i}.33/24")}),
        );
        routes.push(serde_json::json!({"destination": "default", "gateway": format!("10.0.{i}.1"), "link": format!("vnic{i}"), "table": 100 + i}));
        if full {
            rules.push(serde_json::json!({"from": format!("10.0.{i}.33/32"), "table": 100 + i, "priority": 20100 + i}));
        }
    }
    serde_json::from_value(serde_json::json!({"links": links, "addresses": addresses, "routes": routes, "rules": rules}))
        .expect("bench state is well-formed")
}

/// The same state in nmstate's YAML (`full` as in [`desired`]).
fn nmstate_yaml(n: u32, full: bool) -> String {
    let mut y = String::from("interfaces:\n");
    for i in 1..=n {
        let _ = write!(y, "- name: nic{i}\n  type: ethernet\n  state: up\n");
        if full {
            y.push_str("  mtu: 9000\n");
        }
        let _ = write!(
            y,
            "  ipv4:\n    enabled: true\n    dhcp: false\n    address:\n    - ip: 10.0.{i}.33\n      prefix-length: 24\n"
        );
    }
    y.push_str("routes:\n  config:\n");
    for i in 1..=n {
        let _ = write!(
            y,
            "  - destination: 0.0.0.0/0\n    next-hop-address: 10.0.{i}.1\n    next-hop-interface: nic{i}\n    table-id: {}\n",
            100 + i
        );
    }
    if full {
        y.push_str("route-rules:\n  config:\n  - ip-to: 169.254.0.0/16\n    route-table: 254\n    priority: 20100\n");
        for i in 1..=n {
            let _ = write!(
                y,
                "  - ip-from: 10.0.{i}.33/32\n    route-table: {}\n    priority: {}\n",
                100 + i,
                20100 + i
            );
        }
    }
    y
}

/// Puts the namespace back to "NICs present, nothing configured" (outside any timing).
fn reset(ns: &str, n: u32) -> anyhow::Result<()> {
    let mut s = String::new();
    for i in 1..=n {
        let _ = writeln!(s, "link set nic{i} down mtu 1500");
        let _ = writeln!(s, "addr flush dev nic{i}");
        let _ = writeln!(s, "route flush table {}", 100 + i);
        let _ = writeln!(s, "rule del priority {}", 20100 + i);
    }
    let _ = writeln!(s, "rule del priority 20100");
    batch(ns, &s)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Installs nmstatectl into the cache (once) and returns its path.
fn nmstatectl(cache: &Path) -> anyhow::Result<PathBuf> {
    let root = cache.join("nmstatectl");
    let bin = root.join("bin/nmstatectl");
    if bin.exists() {
        return Ok(bin);
    }
    eprintln!(
        "installing nmstatectl {NMSTATE_VERSION} into {} (cargo install; several minutes on a small machine)…",
        root.display()
    );
    let status = Command::new("cargo")
        .args([
            "install",
            "nmstatectl",
            "--version",
            NMSTATE_VERSION,
            "--locked",
            "--root",
        ])
        .arg(&root)
        .env("CARGO_TARGET_DIR", cache.join("nmstatectl-target"))
        .status()
        .context("run cargo install nmstatectl")?;
    ensure!(
        status.success() && bin.exists(),
        "cargo install nmstatectl {NMSTATE_VERSION} failed ({status})"
    );
    Ok(bin)
}

struct NkFigures {
    apply: Duration,
    reapply: Duration,
    rollback: Duration,
    remove: Duration,
    apply_writes: u64,
    reapply_writes: u64,
    rollback_writes: u64,
    steps: usize,
}

/// Runs nodekeeper's measurements on a thread inside the namespace.
fn bench_nodekeeper(ns: &Netns, n: u32, iterations: u32, full: bool) -> anyhow::Result<NkFigures> {
    let ns_name = ns.name().to_owned();
    let thread = ns
        .entry()
        .spawn_blocking(move || -> anyhow::Result<NkFigures> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let nc = Netconf::connect()?;
                let d = desired(n, full);
                let (mut apply, mut reapply, mut rollback, mut remove) =
                    (vec![], vec![], vec![], vec![]);
                let mut f = NkFigures {
                    apply: Duration::ZERO,
                    reapply: Duration::ZERO,
                    rollback: Duration::ZERO,
                    remove: Duration::ZERO,
                    apply_writes: 0,
                    reapply_writes: 0,
                    rollback_writes: 0,
                    steps: 0,
                };
                for _ in 0..iterations {
                    reset(&ns_name, n)?;
                    let t = Instant::now();
                    let r = nc.apply(&d, &ApplyOptions::default()).await?;
                    apply.push(t.elapsed());
                    ensure!(r.outcome == Outcome::Applied, "apply failed: {:?}", r.error);
                    f.apply_writes = r.writes;
                    f.steps = r.plan.steps.len();
                    let before = nc.writes();
                    let t = Instant::now();
                    let r = nc.apply(&d, &ApplyOptions::default()).await?;
                    reapply.push(t.elapsed());
                    ensure!(
                        r.plan.is_empty(),
                        "re-apply planned {} steps",
                        r.plan.steps.len()
                    );
                    f.reapply_writes = f.reapply_writes.max(nc.writes() - before);
                    let t = Instant::now();
                    nc.apply(&NetworkState::default(), &ApplyOptions::default())
                        .await?;
                    remove.push(t.elapsed());
                    reset(&ns_name, n)?;
                    let last = f.steps - 1;
                    let t = Instant::now();
                    let r = nc
                        .apply(
                            &d,
                            &ApplyOptions {
                                fail_at_step: Some(last),
                                ..Default::default()
                            },
                        )
                        .await?;
                    rollback.push(t.elapsed());
                    ensure!(
                        r.outcome == Outcome::RolledBack,
                        "rollback: {:?} {:?}",
                        r.outcome,
                        r.error
                    );
                    f.rollback_writes = r.writes;
                }
                // Leave the namespace unconfigured for the next tool.
                nc.apply(&NetworkState::default(), &ApplyOptions::default())
                    .await?;
                f.apply = median(&mut apply);
                f.reapply = median(&mut reapply);
                f.rollback = median(&mut rollback);
                f.remove = median(&mut remove);
                Ok(f)
            })
        });
    thread
        .join()
        .map_err(|_| anyhow::anyhow!("bench thread panicked"))?
}

/// nmstatectl on the subset it supports: medians of apply and no-op re-apply.
fn bench_nmstate(
    ns: &Netns,
    bin: &str,
    n: u32,
    iterations: u32,
    file: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let (mut apply, mut reapply) = (vec![], vec![]);
    for _ in 0..iterations {
        reset(ns.name(), n)?;
        for times in [&mut apply, &mut reapply] {
            let t = Instant::now();
            ns.exec(&[bin, "apply", "--kernel", file])
                .context("nmstatectl apply --kernel")?;
            times.push(t.elapsed());
        }
        // nmstate really did it: the last VNIC's table is there.
        let t = ns.ip(&["route", "show", "table", &(100 + n).to_string()])?;
        ensure!(
            t.contains(&format!("default via 10.0.{n}.1")),
            "nmstate left table {} as {t:?}",
            100 + n
        );
    }
    reset(ns.name(), n)?;
    Ok((median(&mut apply), median(&mut reapply)))
}

/// One attempt of nmstatectl on the full state: how long until it gave up, and its last line.
fn nmstate_full_attempt(
    ns: &Netns,
    bin: &str,
    n: u32,
    file: &str,
) -> anyhow::Result<(Duration, bool, String)> {
    reset(ns.name(), n)?;
    let t = Instant::now();
    let out = Command::new("ip")
        .args(["netns", "exec", ns.name(), bin, "apply", "--kernel", file])
        .output()?;
    let took = t.elapsed();
    let text = String::from_utf8_lossy(&out.stderr);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty() && !l.starts_with(' '))
        .unwrap_or("")
        .to_string();
    reset(ns.name(), n)?;
    Ok((took, out.status.success(), last))
}

pub fn run_bench(args: NetconfArgs) -> anyhow::Result<()> {
    ensure!(
        nodekeeper_testkit::is_root(),
        "bench netconf needs root (it creates a network namespace)"
    );
    ensure!((1..=200).contains(&args.vnics), "--vnics must be 1–200");
    ensure!(
        (1..=1000).contains(&args.iterations),
        "--iterations must be 1–1000"
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("repo root")?
        .to_path_buf();
    std::fs::create_dir_all(&args.cache)?;
    let nm_bin = if args.no_nmstate {
        None
    } else {
        Some(nmstatectl(&args.cache)?)
    };
    let n = args.vnics;

    let ns = Netns::new("nk-bench")?;
    ns.ip(&["link", "set", "lo", "up"])?;
    for i in 1..=n {
        let nic = format!("nic{i}");
        let peer = format!("nic{i}p");
        ns.ip(&[
            "link",
            "add",
            &nic,
            "address",
            &format!("02:00:17:0b:00:{i:02x}"),
            "type",
            "veth",
            "peer",
            "name",
            &peer,
        ])?;
        ns.ip(&["link", "set", &peer, "up"])?;
        ns.ip(&["addr", "add", &format!("10.0.{i}.1/24"), "dev", &peer])?;
    }
    eprintln!(
        "measuring nodekeeper, full VM layout ({n} VNICs, {} iterations)…",
        args.iterations
    );
    let nk_full = bench_nodekeeper(&ns, n, args.iterations, true)?;
    eprintln!("measuring nodekeeper, the subset nmstatectl --kernel supports…");
    let nk_sub = bench_nodekeeper(&ns, n, args.iterations, false)?;
    let nm = match &nm_bin {
        Some(bin) => {
            let bin = bin.to_string_lossy().into_owned();
            let version = run(&bin, &["--version"])
                .unwrap_or_default()
                .trim()
                .to_string();
            let sub_file = args.cache.join("nmstate-bench-subset.yml");
            let full_file = args.cache.join("nmstate-bench-full.yml");
            std::fs::write(&sub_file, nmstate_yaml(n, false))?;
            std::fs::write(&full_file, nmstate_yaml(n, true))?;
            eprintln!("measuring nmstatectl apply --kernel…");
            let sub = bench_nmstate(&ns, &bin, n, args.iterations, &sub_file.to_string_lossy())?;
            eprintln!("trying nmstatectl apply --kernel on the full state once…");
            let full = nmstate_full_attempt(&ns, &bin, n, &full_file.to_string_lossy())?;
            Some((sub, full, version))
        }
        None => None,
    };

    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let kernel = run("uname", &["-r"]).unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |c| c.get());
    let ratio = |a: Duration, b: Duration| format!("{:.1}×", b.as_secs_f64() / a.as_secs_f64());
    let mut r = String::new();
    let _ = writeln!(r, "## netconf\n");
    let _ = writeln!(
        r,
        "`cargo xtask bench netconf --vnics {n} --iterations {}` (as root) — {n} secondary VNICs in the VM layout (MTU 9000 + up, address, own table with a default route, `from` rule, plus the rule keeping 169.254.0.0/16 in main) in a private network namespace on veth pairs. Medians of {} runs. Machine: {cpus} CPUs shared with other work, Linux {}, nodekeeper built {profile}.\n",
        args.iterations,
        args.iterations,
        kernel.trim()
    );
    let _ = writeln!(
        r,
        "nodekeeper, full state:\n\n| measurement | time | netlink writes |\n|---|---|---|"
    );
    let _ = writeln!(
        r,
        "| apply from scratch ({} steps) | {} | {} |",
        nk_full.steps,
        ms(nk_full.apply),
        nk_full.apply_writes
    );
    let _ = writeln!(
        r,
        "| no-op re-apply | {} | {} |",
        ms(nk_full.reapply),
        nk_full.reapply_writes
    );
    let _ = writeln!(
        r,
        "| failed apply + rollback (injected failure at the last step) | {} | {} |",
        ms(nk_full.rollback),
        nk_full.rollback_writes
    );
    let _ = writeln!(
        r,
        "| remove everything nodekeeper owns | {} | |",
        ms(nk_full.remove)
    );
    match &nm {
        Some(((nm_apply, nm_reapply), (full_took, full_ok, full_last), version)) => {
            let _ = writeln!(
                r,
                "\nAgainst `nmstatectl apply --kernel` ({version}, crates.io {NMSTATE_VERSION}, `cargo install --locked`, run with `ip netns exec` and its default verification), on the subset its kernel mode applies — up, addresses, routes in per-VNIC tables; same run, same namespace:\n\n| measurement | nodekeeper | nmstatectl | nmstatectl / nodekeeper |\n|---|---|---|---|"
            );
            let _ = writeln!(
                r,
                "| apply from scratch | {} ({} writes) | {} | {} |",
                ms(nk_sub.apply),
                nk_sub.apply_writes,
                ms(*nm_apply),
                ratio(nk_sub.apply, *nm_apply)
            );
            let _ = writeln!(
                r,
                "| no-op re-apply | {} ({} writes) | {} | {} |",
                ms(nk_sub.reapply),
                nk_sub.reapply_writes,
                ms(*nm_reapply),
                ratio(nk_sub.reapply, *nm_reapply)
            );
            let _ = writeln!(
                r,
                "\nOn the full state nmstatectl {} after {} (`{}`): its kernel mode (nmstate {NMSTATE_VERSION}, `nispor_apply`) applies interfaces and routes but neither MTU nor route rules, so its verification fails. nmstatectl times include starting its process (through `ip netns exec`) and its own state query; nodekeeper's are calls on the agent's open netlink connection, as in production.",
                if *full_ok { "succeeded" } else { "failed" },
                ms(*full_took),
                full_last.replace('`', "'")
            );
        }
        None => {
            let _ = writeln!(r, "\nnmstatectl was not run (`--no-nmstate`).");
        }
    }
    println!("{r}");
    ensure!(
        nk_full.reapply_writes == 0 && nk_sub.reapply_writes == 0,
        "re-apply made netlink writes"
    );
    if !args.no_write {
        crate::benchmarks::write_section(&root, "netconf", &r)?;
        eprintln!("updated {}", root.join("BENCHMARKS.md").display());
    }
    Ok(())
}
