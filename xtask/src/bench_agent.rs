//! `cargo xtask bench agent`: the node agent's footprint and latency, and node-problem-detector's
//! footprint measured in the same run for comparison. Writes its section (`## agent`) in
//! BENCHMARKS.md.
//!
//! The agent is the release binary on 127.0.0.1 with throwaway certificates; the load comes from
//! the agent crate's `bench_client` example (so that xtask needs no gRPC code). RSS is VmRSS from
//! `/proc/<pid>/status`, CPU the utime+stime ticks from `/proc/<pid>/stat`. node-problem-detector
//! is built from its Go module (source from the module proxy, cached under ~/.cache) and run
//! standalone with its shipped system-stats and kernel (kmsg) monitor configs.
//!
//! `--kmsg` measures the kernel-log monitor instead: the agent and NPD, one after the other, each
//! fed the same generated kernel records (`--kmsg-rate` lines/s for `--kmsg-seconds`) through a
//! FIFO standing in for `/dev/kmsg`, one record per write as the kernel hands them out. The agent
//! is pointed at the FIFO with `--kmsg-path`; NPD opens `/dev/kmsg` by name, so it runs in a
//! mount namespace of its own (`unshare --mount`) where the FIFO is bind-mounted over
//! `/dev/kmsg`. Both count the problem lines in `problem_counter`, scraped at the end to show
//! each processed the whole feed. Written as the `### kmsg monitor` block of `## agent`.

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};

/// Ticks per second in `/proc/<pid>/stat` (USER_HZ, 100 on every Linux ABI nodekeeper targets).
const USER_HZ: f64 = 100.0;

#[derive(clap::Args)]
pub struct AgentArgs {
    /// GetReport calls per second during the load phase.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Length of the load phase in seconds.
    #[arg(long, default_value_t = 30)]
    seconds: u32,
    /// node-problem-detector release (a tag of its Go module k8s.io/node-problem-detector); the
    /// release the agent's built-in rules come from.
    #[arg(long, default_value = "v1.36.0")]
    npd_version: String,
    /// Measure the kernel-log monitor (agent vs NPD on the same kmsg feed) instead of GetReport.
    #[arg(long)]
    kmsg: bool,
    /// Kernel records per second fed in `--kmsg` mode.
    #[arg(long, default_value_t = 1000)]
    kmsg_rate: u32,
    /// How long the feed lasts in `--kmsg` mode, in seconds.
    #[arg(long, default_value_t = 60)]
    kmsg_seconds: u32,
    /// Skip node-problem-detector.
    #[arg(long)]
    no_npd: bool,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    no_write: bool,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

fn run_ok(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("run {cmd:?}"))?;
    ensure!(status.success(), "{cmd:?} failed: {status}");
    Ok(())
}

/// VmRSS in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    crate::fleet_rig::kib_field(&status, "VmRSS:").context("no VmRSS")
}

/// utime + stime in ticks.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').context("odd stat")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Ok(f[11].parse::<u64>()? + f[12].parse::<u64>()?)
}

fn wait_for_port(port: u16, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("process exited early: {status}");
        }
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("nothing listened on 127.0.0.1:{port} within 20s")
}

fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

struct Agent {
    child: Child,
    port: u16,
}

fn start_agent(bin: &Path, work: &Path, certs: &Path, extra: &[&str]) -> anyhow::Result<Agent> {
    let port = nodekeeper_testkit::free_port();
    let state = work.join(format!("state-{port}"));
    let log = std::fs::File::create(work.join(format!("agent-{port}.log")))?;
    let mut child = Command::new(bin)
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg("--node-name=bench")
        .arg(format!("--tls-cert={}", certs.join("tls.crt").display()))
        .arg(format!("--tls-key={}", certs.join("tls.key").display()))
        .arg(format!("--client-ca={}", certs.join("ca.crt").display()))
        .arg(format!("--state-dir={}", state.display()))
        .arg("--log=warn")
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("start nodekeeper-agent")?;
    wait_for_port(port, &mut child)?;
    Ok(Agent { child, port })
}

struct Load {
    json: serde_json::Value,
    rss_max_kib: u64,
    cpu_percent: f64,
}

/// Runs the client against `agent`, sampling the agent's RSS twice a second meanwhile.
fn drive(
    client: &Path,
    certs: &Path,
    agent: &Agent,
    rate: u32,
    seconds: u32,
    full_only: bool,
) -> anyhow::Result<Load> {
    let pid = agent.child.id();
    let cpu0 = cpu_ticks(pid)?;
    let t0 = Instant::now();
    let mut cmd = Command::new(client);
    cmd.args(["load", "--addr", &format!("127.0.0.1:{}", agent.port)])
        .arg("--certs")
        .arg(certs)
        .args([
            "--rate",
            &rate.to_string(),
            "--seconds",
            &seconds.to_string(),
        ]);
    if full_only {
        cmd.arg("--full-only");
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("start bench_client")?;
    let mut rss_max = 0;
    let deadline = Instant::now() + Duration::from_secs(u64::from(seconds) * 3 + 30);
    let status = loop {
        rss_max = rss_max.max(rss_kib(pid)?);
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("bench_client did not finish in time");
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let wall = t0.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(pid)? - cpu0) as f64 / USER_HZ;
    let mut out = String::new();
    child
        .stdout
        .take()
        .context("no stdout")?
        .read_to_string(&mut out)?;
    ensure!(status.success(), "bench_client failed: {status}");
    Ok(Load {
        json: serde_json::from_str(out.trim())
            .with_context(|| format!("bench_client printed {out:?}"))?,
        rss_max_kib: rss_max,
        cpu_percent: cpu / wall * 100.0,
    })
}

/// Builds node-problem-detector from its Go module once and caches the binary outside the repo.
fn build_npd(version: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    let cache = home
        .join(".cache/nodekeeper")
        .join(format!("node-problem-detector-{version}"));
    let bin = cache.join("node-problem-detector");
    let src = cache.join("src");
    if bin.exists() && src.join("config").exists() {
        return Ok((bin, src));
    }
    std::fs::create_dir_all(&cache)?;
    let module = format!("k8s.io/node-problem-detector@{version}");
    eprintln!("building {module} (once; cached in {})", cache.display());
    // The module is not in the checksum database the proxy serves, so verification is skipped
    // for this one module; the binary is only run locally, for comparison.
    let out = Command::new("go")
        .args(["mod", "download", "-json", &module])
        .env("GONOSUMDB", "k8s.io/node-problem-detector")
        .env("GOFLAGS", "-mod=mod")
        .current_dir(&cache)
        .output()
        .context("run go mod download")?;
    let info: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parse go mod download output")?;
    if let Some(e) = info.get("Error") {
        bail!("go mod download {module}: {e}");
    }
    let dir = info["Dir"]
        .as_str()
        .context("go mod download gave no Dir")?;
    let _ = std::fs::remove_dir_all(&src);
    run_ok(Command::new("cp").args(["-r", dir]).arg(&src))?;
    run_ok(Command::new("chmod").args(["-R", "u+w"]).arg(&src))?;
    // The module's vendor/ holds only modules.txt; fetch dependencies through the proxy.
    let _ = std::fs::remove_dir_all(src.join("vendor"));
    run_ok(
        Command::new("go")
            .args(["build", "-mod=mod", "-o"])
            .arg(&bin)
            .arg("./cmd/nodeproblemdetector")
            .env("CGO_ENABLED", "0")
            .env("GONOSUMDB", "k8s.io/node-problem-detector")
            .current_dir(&src),
    )?;
    Ok((bin, src))
}

struct Npd {
    /// How the run departs from NPD's shipped configs, if it must.
    deviation: Option<String>,
    idle_kib: u64,
    max_kib: u64,
    cpu_percent: f64,
    observed_s: u64,
}

fn measure_npd(version: &str, work: &Path, seconds: u32) -> anyhow::Result<Npd> {
    let (bin, src) = build_npd(version)?;
    let mut stats_config = src.join("config/system-stats-monitor.json");
    let mut deviation = None;
    // NPD's os-feature collector exits fatally without /proc/modules (kernels built without
    // loadable modules, like this machine's); then its section is left out of a copy of the
    // shipped config, and the report says so.
    if !Path::new("/proc/modules").exists() {
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&stats_config)?)?;
        config
            .as_object_mut()
            .context("system-stats-monitor.json is not an object")?
            .remove("osFeature");
        stats_config = work.join("system-stats-monitor.json");
        std::fs::write(&stats_config, serde_json::to_vec_pretty(&config)?)?;
        deviation = Some(
            "this kernel has no /proc/modules, on which NPD's `osFeature` collector exits fatally, so that one \
             section was removed from the shipped `system-stats-monitor.json` (cpu, disk, host and memory kept)"
                .to_string(),
        );
    }
    let (port, prom) = (
        nodekeeper_testkit::free_port(),
        nodekeeper_testkit::free_port(),
    );
    let log = std::fs::File::create(work.join("npd.log"))?;
    let mut child = Command::new(&bin)
        .arg("--enable-k8s-exporter=false")
        .arg("--hostname-override=bench")
        .arg(format!(
            "--config.system-stats-monitor={}",
            stats_config.display()
        ))
        .arg(format!(
            "--config.system-log-monitor={}",
            src.join("config/kernel-monitor.json").display()
        ))
        .args(["--address=127.0.0.1", &format!("--port={port}")])
        .args([
            "--prometheus-address=127.0.0.1",
            &format!("--prometheus-port={prom}"),
        ])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("start node-problem-detector")?;
    // With the Kubernetes exporter off, NPD serves nothing on `--port` (that server belongs to the
    // exporter); its Prometheus endpoint is what shows it is up.
    wait_for_port(prom, &mut child)?;
    let pid = child.id();
    std::thread::sleep(Duration::from_secs(5));
    let idle = rss_kib(pid)?;
    // Observe as long as the agent's load phase plus its idle wait, with one scrape of its
    // Prometheus endpoint half-way (what a node-exporter-style setup does every interval).
    let observed = u64::from(seconds) + 5;
    let cpu0 = cpu_ticks(pid)?;
    let t0 = Instant::now();
    let mut max = idle;
    let mut scraped = false;
    while t0.elapsed() < Duration::from_secs(observed) {
        if let Some(status) = child.try_wait()? {
            bail!(
                "node-problem-detector exited: {status}; see {}",
                work.join("npd.log").display()
            );
        }
        max = max.max(rss_kib(pid)?);
        if !scraped && t0.elapsed() > Duration::from_secs(observed / 2) {
            let _ = std::net::TcpStream::connect(("127.0.0.1", prom)).map(|mut s| {
                use std::io::Write as _;
                let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
                let _ = std::io::copy(&mut s, &mut std::io::sink());
            });
            scraped = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let cpu = (cpu_ticks(pid)? - cpu0) as f64 / USER_HZ;
    let cpu_percent = cpu / t0.elapsed().as_secs_f64() * 100.0;
    stop(child);
    Ok(Npd {
        deviation,
        idle_kib: idle,
        max_kib: max,
        cpu_percent,
        observed_s: observed,
    })
}

fn f(v: &serde_json::Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .unwrap_or(f64::NAN)
}

/// Ordinary kernel lines (matching no default rule), in the kernel's own wording.
const BENIGN: &[&str] = &[
    "IPv6: ADDRCONF(NETDEV_CHANGE): veth1a2b3c4d: link becomes ready",
    "cni0: port 3(veth1a2b3c4d) entered forwarding state",
    "eth0: renamed from tmp5f6e7d",
    "audit: type=1400 audit(1763890000.123:456): apparmor=\"DENIED\" operation=\"open\" \
     profile=\"cri-containerd.apparmor.d\" name=\"/proc/sys/kernel/random/boot_id\" pid=1234 comm=\"runc\"",
    "overlayfs: upperdir is in-use as upperdir/workdir of another mount, accessing files from both \
     mounts will result in undefined behavior.",
    "TCP: request_sock_TCP: Possible SYN flooding on port 443. Sending cookies.  Check SNMP counters.",
    "nf_conntrack: nf_conntrack: table full, dropping packet",
    "EXT4-fs (sda1): mounted filesystem with ordered data mode. Quota mode: none.",
];

/// Every this many records one is an OOM kill (a temporary rule of kernel-monitor.json).
const PROBLEM_EVERY: u64 = 100;

/// The `n`th record's message.
fn kmsg_message(n: u64) -> String {
    if n % PROBLEM_EVERY == PROBLEM_EVERY - 1 {
        format!(
            "Out of memory: Killed process {} (stress-ng) total-vm:8426496kB, anon-rss:7845632kB, \
             file-rss:4kB, shmem-rss:0kB, UID:0 pgtables:15440kB oom_score_adj:0",
            10_000 + n
        )
    } else {
        BENIGN[(n % BENIGN.len() as u64) as usize].to_owned()
    }
}

/// Writes `rate × seconds` records to the FIFO, one write per record, paced to the rate. Opening
/// the FIFO waits for the reader. Returns the records written.
fn feed_kmsg(fifo: &Path, rate: u32, seconds: u32) -> anyhow::Result<u64> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    // Opened non-blocking (a FIFO without a reader answers ENXIO at once) and retried for at
    // most 30 s, then switched to blocking writes, so a consumer that never opens its input
    // cannot hang the benchmark.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
            .open(fifo)
        {
            Ok(f) => break f,
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(nix::libc::ENXIO) => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("open {} for writing", fifo.display()));
            }
        }
    };
    nix::fcntl::fcntl(
        &out,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
    )
    .context("make the FIFO writes blocking")?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")?
        .split_whitespace()
        .next()
        .context("odd /proc/uptime")?
        .parse()?;
    let start = Instant::now();
    let total = u64::from(rate) * u64::from(seconds);
    for n in 0..total {
        let due = Duration::from_secs_f64(n as f64 / f64::from(rate));
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let ts = ((uptime + start.elapsed().as_secs_f64()) * 1e6) as u64;
        let record = format!("{},{},{ts},-;{}\n", 3, 1_000_000 + n, kmsg_message(n));
        out.write_all(record.as_bytes())?;
    }
    Ok(total)
}

/// `problem_counter{reason="OOMKilling"}` from a Prometheus endpoint on 127.0.0.1.
fn oom_counter(port: u16) -> Option<u64> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines()
        .find(|l| l.starts_with("problem_counter{reason=\"OOMKilling\"}"))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .map(|v| v as u64)
}

/// One consumer's figures over the feed.
struct KmsgRun {
    idle_kib: u64,
    max_kib: u64,
    cpu_percent: f64,
    fed: u64,
    seconds: f64,
    oom_counted: Option<u64>,
}

/// Feeds the FIFO while sampling `pid`'s RSS; `metrics` is the consumer's Prometheus port.
fn measure_kmsg(pid: u32, fifo: &Path, metrics: u16, args: &AgentArgs) -> anyhow::Result<KmsgRun> {
    std::thread::sleep(Duration::from_secs(3));
    let idle_kib = rss_kib(pid)?;
    let cpu0 = cpu_ticks(pid)?;
    let t0 = Instant::now();
    let (rate, seconds, path) = (args.kmsg_rate, args.kmsg_seconds, fifo.to_owned());
    let feeder = std::thread::spawn(move || feed_kmsg(&path, rate, seconds));
    let mut max_kib = idle_kib;
    // A consumer that stops reading would block the feeder on a full pipe: give up then.
    let give_up = t0 + Duration::from_secs(u64::from(args.kmsg_seconds) * 3 + 30);
    while !feeder.is_finished() {
        ensure!(
            Instant::now() < give_up,
            "the kmsg feed did not finish: the consumer stopped reading"
        );
        max_kib = max_kib.max(rss_kib(pid)?);
        std::thread::sleep(Duration::from_millis(500));
    }
    let fed = feeder
        .join()
        .map_err(|_| anyhow::anyhow!("feeder panicked"))??;
    // The reader may still be working through what the FIFO holds: wait for the counter to
    // settle (bounded), and count that time too.
    let expected = fed / PROBLEM_EVERY;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut oom = oom_counter(metrics);
    while oom.is_none_or(|n| n < expected) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        max_kib = max_kib.max(rss_kib(pid)?);
        oom = oom_counter(metrics);
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cpu = (cpu_ticks(pid)? - cpu0) as f64 / USER_HZ;
    Ok(KmsgRun {
        idle_kib,
        max_kib,
        cpu_percent: cpu / seconds * 100.0,
        fed,
        seconds,
        oom_counted: oom,
    })
}

// A benchmark's figures are its output.
#[allow(clippy::print_stdout)]
fn run_kmsg(args: &AgentArgs) -> anyhow::Result<()> {
    let root = root();
    run_ok(
        Command::new(env!("CARGO"))
            .args(["build", "--release", "-p", "nodekeeper-agent"])
            .args(["--example", "bench_client"])
            .current_dir(&root),
    )?;
    run_ok(
        Command::new(env!("CARGO"))
            .args([
                "build",
                "--release",
                "-p",
                "nodekeeper-agent",
                "--bin",
                "nodekeeper-agent",
            ])
            .current_dir(&root),
    )?;
    let target = target_dir(&root).join("release");
    let (bin, client) = (
        target.join("nodekeeper-agent"),
        target.join("examples/bench_client"),
    );
    let work = tempfile::tempdir()?;
    let certs = work.path().join("certs");
    run_ok(Command::new(&client).arg("certs").arg(&certs))?;
    let mkfifo = |name: &str| -> anyhow::Result<PathBuf> {
        let path = work.path().join(name);
        run_ok(Command::new("mkfifo").arg(&path))?;
        Ok(path)
    };

    // The agent: only the kernel-log monitor runs (no journal, no health checks, no GetReport).
    let fifo = mkfifo("kmsg-agent")?;
    let metrics = nodekeeper_testkit::free_port();
    let agent = start_agent(
        &bin,
        work.path(),
        &certs,
        &[
            &format!("--kmsg-path={}", fifo.display()),
            &format!("--metrics-listen=127.0.0.1:{metrics}"),
            "--journal=false",
            "--health-checks=false",
        ],
    )?;
    let ours = measure_kmsg(agent.child.id(), &fifo, metrics, args);
    stop(agent.child);
    let ours = ours?;

    // NPD: its shipped kernel-monitor.json only, /dev/kmsg being the FIFO in its namespace.
    let (npd_bin, src) = build_npd(&args.npd_version)?;
    let fifo = mkfifo("kmsg-npd")?;
    let prom = nodekeeper_testkit::free_port();
    let script = format!(
        "mount --bind {fifo} /dev/kmsg && exec {bin} --enable-k8s-exporter=false \
         --hostname-override=bench --config.system-log-monitor={config} --address=127.0.0.1 \
         --port={port} --prometheus-address=127.0.0.1 --prometheus-port={prom}",
        fifo = fifo.display(),
        bin = npd_bin.display(),
        config = src.join("config/kernel-monitor.json").display(),
        port = nodekeeper_testkit::free_port(),
    );
    let log = std::fs::File::create(work.path().join("npd-kmsg.log"))?;
    let mut child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("start node-problem-detector under unshare --mount (needs root)")?;
    wait_for_port(prom, &mut child)?;
    let theirs = measure_kmsg(child.id(), &fifo, prom, args);
    stop(child);
    let theirs = theirs?;

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let mut r = String::new();
    let _ = writeln!(r, "### kmsg monitor\n");
    let _ = writeln!(
        r,
        "`cargo xtask bench agent --kmsg --kmsg-rate {} --kmsg-seconds {}` (as root). The same generated \
         kernel records (1 in {PROBLEM_EVERY} an OOM kill, the rest ordinary lines matching no rule) fed at \
         {} lines/s for {} s through a FIFO standing in for `/dev/kmsg`, one record per write: first to \
         the agent (`--kmsg-path`; built-in NPD {} kernel-monitor and readonly-monitor rules; journal and \
         health checks off; no GetReport calls), then to node-problem-detector {} (its shipped \
         `config/kernel-monitor.json` only; the FIFO bind-mounted over `/dev/kmsg` in a mount namespace \
         of its own). CPU is utime+stime over the feed and the drain after it (100% = one core); RSS is \
         VmRSS. Machine: {cpus} CPUs, Linux {}, load average at the end {} — shared with seven other \
         engineers' builds and tests, so CPU figures are indicative, the ratio more than the values.\n",
        args.kmsg_rate,
        args.kmsg_seconds,
        args.kmsg_rate,
        args.kmsg_seconds,
        nodekeeper_agent_npd_version(),
        args.npd_version,
        kernel.trim(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
    );
    let _ = writeln!(
        r,
        "| measurement | nodekeeper-agent | node-problem-detector | agent / NPD |"
    );
    let _ = writeln!(r, "|---|---|---|---|");
    let row = |r: &mut String, what: &str, a: String, b: String, ratio: String| {
        let _ = writeln!(r, "| {what} | {a} | {b} | {ratio} |");
    };
    row(
        &mut r,
        "RSS before the feed",
        mib(ours.idle_kib),
        mib(theirs.idle_kib),
        format!("{:.2}", ours.idle_kib as f64 / theirs.idle_kib as f64),
    );
    row(
        &mut r,
        "max RSS during the feed",
        mib(ours.max_kib),
        mib(theirs.max_kib),
        format!("{:.2}", ours.max_kib as f64 / theirs.max_kib as f64),
    );
    row(
        &mut r,
        "CPU during the feed",
        format!("{:.1}% over {:.0} s", ours.cpu_percent, ours.seconds),
        format!("{:.1}% over {:.0} s", theirs.cpu_percent, theirs.seconds),
        format!("{:.2}", ours.cpu_percent / theirs.cpu_percent),
    );
    let counted = |k: &KmsgRun| {
        k.oom_counted.map_or("not scraped".to_owned(), |n| {
            format!("{n} of {}", k.fed / PROBLEM_EVERY)
        })
    };
    row(
        &mut r,
        "OOM kills counted (`problem_counter`)",
        counted(&ours),
        counted(&theirs),
        String::new(),
    );
    let met = |v: f64| if v <= 0.5 { "met" } else { "NOT met" };
    let cpu_ratio = ours.cpu_percent / theirs.cpu_percent;
    let rss_ratio = ours.max_kib as f64 / theirs.max_kib as f64;
    let _ = writeln!(
        r,
        "\nTargets: agent CPU ≤ ½ of NPD's — {} ({cpu_ratio:.2}); agent max RSS ≤ ½ of NPD's — {} \
         ({rss_ratio:.2}).",
        met(cpu_ratio),
        met(rss_ratio)
    );
    println!("{r}");
    if !args.no_write {
        let intro = "## agent\n";
        crate::benchmarks::write_subsection(&root, "agent", intro, "kmsg monitor", &r)?;
        eprintln!("updated {}", root.join("BENCHMARKS.md").display());
    }
    Ok(())
}

/// The NPD release the agent's built-in rules come from (kept in step with the agent crate's
/// `monitor::NPD_VERSION`; xtask does not link the agent).
fn nodekeeper_agent_npd_version() -> &'static str {
    "v1.36.0"
}

// A benchmark's figures are its output.
#[allow(clippy::print_stdout)]
pub fn run(args: AgentArgs) -> anyhow::Result<()> {
    if args.kmsg {
        return run_kmsg(&args);
    }
    let root = root();
    // Two builds: the example pulls in dev-dependencies, whose features would otherwise be
    // unified into the measured binary; the binary is built on its own, as it ships.
    for what in [["--example", "bench_client"], ["--bin", "nodekeeper-agent"]] {
        run_ok(
            Command::new(env!("CARGO"))
                .args(["build", "--release", "-p", "nodekeeper-agent"])
                .args(what)
                .current_dir(&root),
        )?;
    }
    let target = target_dir(&root).join("release");
    let bin = target.join("nodekeeper-agent");
    let client = target.join("examples/bench_client");
    let size = std::fs::metadata(&bin)?.len();

    let work = tempfile::tempdir()?;
    let certs = work.path().join("certs");
    run_ok(Command::new(&client).arg("certs").arg(&certs))?;

    // Phase 1: idle, then the steady load, then idle again.
    let mut agent = start_agent(&bin, work.path(), &certs, &[])?;
    std::thread::sleep(Duration::from_secs(5));
    let idle_start = rss_kib(agent.child.id())?;
    let load = drive(&client, &certs, &agent, args.rate, args.seconds, false)?;
    std::thread::sleep(Duration::from_secs(5));
    let idle_after = rss_kib(agent.child.id())?;
    if let Ok(Some(status)) = agent.child.try_wait() {
        bail!("the agent exited during the run: {status}");
    }
    stop(agent.child);

    // Phase 2: every call a fresh collection (--report-max-age=0), to show what collecting costs.
    agent = start_agent(&bin, work.path(), &certs, &["--report-max-age=0ms"])?;
    let fresh = drive(&client, &certs, &agent, 20, 10, true)?;
    stop(agent.child);

    let npd = if args.no_npd {
        None
    } else {
        Some(measure_npd(&args.npd_version, work.path(), args.seconds)?)
    };

    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let j = &load.json;
    let mut r = String::new();
    let _ = writeln!(r, "## agent\n");
    let _ = writeln!(
        r,
        "`cargo xtask bench agent --rate {} --seconds {}` (as root, for node-problem-detector's /dev/kmsg). \
         Machine: {cpus} CPUs shared with other work, Linux {}, release build. One process each, measured \
         in the same run; RSS is VmRSS, CPU is utime+stime over wall time (100% = one core).\n",
        args.rate,
        args.seconds,
        kernel.trim()
    );
    let _ = writeln!(r, "| measurement | nodekeeper-agent |");
    let _ = writeln!(r, "|---|---|");
    let _ = writeln!(
        r,
        "| stripped binary size | {:.1} MiB |",
        size as f64 / 1024.0 / 1024.0
    );
    let _ = writeln!(r, "| idle RSS (5 s after start) | {} |", mib(idle_start));
    let _ = writeln!(
        r,
        "| max RSS under {} GetReport/s for {} s | {} |",
        args.rate,
        args.seconds,
        mib(load.rss_max_kib)
    );
    let _ = writeln!(r, "| idle RSS after the load | {} |", mib(idle_after));
    let _ = writeln!(r, "| CPU under that load | {:.1}% |", load.cpu_percent);
    let _ = writeln!(
        r,
        "| GetReport changed (full report, {} bytes) p50 / p99 | {:.2} / {:.2} ms ({} calls) |",
        j["full_report_bytes"],
        f(j, &["changed", "p50_ms"]),
        f(j, &["changed", "p99_ms"]),
        j["changed"]["count"]
    );
    let _ = writeln!(
        r,
        "| GetReport unchanged p50 / p99 | {:.2} / {:.2} ms ({} calls) |",
        f(j, &["unchanged", "p50_ms"]),
        f(j, &["unchanged", "p99_ms"]),
        j["unchanged"]["count"]
    );
    let _ = writeln!(
        r,
        "| GetReport with a fresh collection each call (`--report-max-age=0ms`, 20/s for 10 s) p50 / p99 | {:.2} / {:.2} ms |",
        f(&fresh.json, &["changed", "p50_ms"]),
        f(&fresh.json, &["changed", "p99_ms"]),
    );
    let _ = writeln!(
        r,
        "\nCalls alternate between asking with revision 0 (the full report) and with the revision just \
         received (the small `unchanged` answer); by default the agent reuses a collection for 1 s \
         (`--report-max-age`), so about one call in {} collects afresh. Latency is measured in the client \
         over one mutual-TLS connection on loopback.",
        args.rate
    );
    match &npd {
        Some(n) => {
            let ratio = idle_start as f64 / n.idle_kib as f64;
            let _ = writeln!(
                r,
                "\nnode-problem-detector {} (built from its Go module with `CGO_ENABLED=0`; run with \
                 `--enable-k8s-exporter=false` and its shipped `config/system-stats-monitor.json` and \
                 `config/kernel-monitor.json`), same run:\n",
                args.npd_version
            );
            if let Some(d) = &n.deviation {
                let _ = writeln!(r, "Deviation: {d}.\n");
            }
            let _ = writeln!(r, "| measurement | node-problem-detector | agent / NPD |");
            let _ = writeln!(r, "|---|---|---|");
            let _ = writeln!(
                r,
                "| idle RSS (5 s after start) | {} | {:.2} |",
                mib(n.idle_kib),
                ratio
            );
            let _ = writeln!(
                r,
                "| max RSS over the next {} s (one Prometheus scrape) | {} | {:.2} (agent under load) |",
                n.observed_s,
                mib(n.max_kib),
                load.rss_max_kib as f64 / n.max_kib as f64
            );
            let _ = writeln!(r, "| CPU over that window | {:.1}% | |", n.cpu_percent);
            let _ = writeln!(
                r,
                "\nTargets: agent idle RSS ≤ 12 MiB — {}; ≤ ⅓ of node-problem-detector's — {} ({:.2}); \
                 unchanged GetReport p99 ≤ 5 ms — {}.",
                if idle_start <= 12 * 1024 {
                    "met"
                } else {
                    "NOT met"
                },
                if ratio <= 1.0 / 3.0 { "met" } else { "NOT met" },
                ratio,
                if f(j, &["unchanged", "p99_ms"]) <= 5.0 {
                    "met"
                } else {
                    "NOT met"
                },
            );
        }
        None => {
            let _ = writeln!(r, "\nnode-problem-detector was not run (`--no-npd`).");
        }
    }
    println!("{r}");
    if !args.no_write {
        crate::benchmarks::write_section(&root, "agent", &r)?;
        eprintln!("updated {}", root.join("BENCHMARKS.md").display());
    }
    Ok(())
}
