//! The node problem monitors as the agent runs them (flags `--kmsg-path`,
//! `--monitor-config-dir`): a kernel line and a custom plugin's verdict reach the report (and its
//! proto form), the first report already holds the kernel log's backlog, and a plugin whose output
//! drifts does not move the reported condition.

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser as _;
use nodekeeper_agent::Config;
use nodekeeper_agent::agent::Agent;
use nodekeeper_agent::monitor;
use nodekeeper_agent::monitor::state::ConditionStatus;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

fn uptime_us() -> u128 {
    let text = std::fs::read_to_string("/proc/uptime").unwrap();
    let secs: f64 = text.split_whitespace().next().unwrap().parse().unwrap();
    (secs * 1e6) as u128
}

fn config(dir: &Path, kmsg: &Path, monitors: &Path, metrics: std::net::SocketAddr) -> Config {
    std::fs::create_dir_all(dir.join("state")).unwrap();
    Config::try_parse_from([
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        "--tls-cert=/nonexistent/tls.crt".into(),
        "--tls-key=/nonexistent/tls.key".into(),
        "--client-ca=/nonexistent/ca.crt".into(),
        format!("--state-dir={}", dir.join("state").display()),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
        "--report-max-age=60s".into(),
        format!("--kmsg-path={}", kmsg.display()),
        format!("--monitor-config-dir={}", monitors.display()),
        // No kubelet here; monitor_health.rs covers those checks.
        "--health-checks=false".into(),
        format!("--metrics-listen={metrics}"),
    ])
    .unwrap()
}

async fn get_metrics(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn kernel_lines_and_plugins_reach_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    // The backlog: a read-only remount 10 s ago.
    let ts = uptime_us() - 10_000_000;
    std::fs::write(
        &kmsg,
        format!("2,100,{ts},-;EXT4-fs (sda1): Remounting filesystem read-only\n"),
    )
    .unwrap();
    let monitors = dir.path().join("monitors");
    std::fs::create_dir(&monitors).unwrap();
    let counter = dir.path().join("runs");
    let plugin = dir.path().join("rdma.sh");
    // A check whose output drifts on every run (a counter), always a problem.
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\necho x >> {c}\necho \"mlx5_0 down, $(wc -l < {c}) checks\"\nexit 1\n",
            c = counter.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(
        monitors.join("rdma.json"),
        format!(
            r#"{{"plugin": "custom", "source": "rdma-monitor",
                "pluginConfig": {{"invoke_interval": "200ms", "timeout": "5s"}},
                "conditions": [{{"type": "RdmaLinkDown", "reason": "RdmaLinksUp", "message": "all RDMA links up"}}],
                "rules": [{{"type": "permanent", "condition": "RdmaLinkDown", "reason": "RdmaLinkIsDown",
                            "path": "{}"}}]}}"#,
            plugin.display()
        ),
    )
    .unwrap();

    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let config = config(dir.path(), &kmsg, &monitors, metrics);
    let agent = Agent::new(&config);
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    monitor::start(&config.monitors(), agent.problems(), &shutdown, &tasks).await;

    // The backlog is in the first report.
    let (first_rev, report) = agent.report(0).await;
    let report = report.unwrap();
    let c = report.problems.condition("ReadonlyFilesystem").unwrap();
    assert_eq!(
        (c.status, c.reason.as_str()),
        (ConditionStatus::True, "FilesystemIsReadOnly")
    );
    let pb = nodekeeper_agent::service::to_proto(&report)
        .problems
        .unwrap();
    let ro = pb
        .conditions
        .iter()
        .find(|c| c.r#type == "ReadonlyFilesystem")
        .unwrap();
    assert_eq!(
        (ro.status.as_str(), ro.reason.as_str()),
        ("True", "FilesystemIsReadOnly")
    );
    assert_eq!(
        ro.message,
        "EXT4-fs (sda1): Remounting filesystem read-only"
    );
    assert!(pb.refused.is_empty(), "{:?}", pb.refused);

    // NPD's problem metrics, under NPD's names, on /metrics.
    let text = get_metrics(metrics).await;
    for line in [
        "HTTP/1.1 200 OK",
        "problem_gauge{reason=\"FilesystemIsReadOnly\",type=\"ReadonlyFilesystem\"} 1",
        "problem_gauge{reason=\"KernelHasNoDeadlock\",type=\"KernelDeadlock\"} 0",
        "problem_counter{reason=\"FilesystemIsReadOnly\"} 1",
        "problem_counter{reason=\"OOMKilling\"} 0",
    ] {
        assert!(
            text.lines().any(|l| l.trim() == line),
            "{line:?} missing from\n{text}"
        );
    }

    // A new kernel line moves the revision even within --report-max-age.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .unwrap();
    let ts = uptime_us();
    f.write_all(
        format!("3,101,{ts},-;INFO: task kworker/0:1:77 blocked for more than 120 seconds.\n")
            .as_bytes(),
    )
    .unwrap();
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(10);
    let report = loop {
        let (rev, report) = agent.report(first_rev).await;
        if let Some(r) = report
            && r.problems.counter("TaskHung") == 1
        {
            assert_ne!(rev, first_rev);
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "TaskHung not reported within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let pb = nodekeeper_agent::service::to_proto(&report)
        .problems
        .unwrap();
    assert_eq!(
        pb.counts
            .iter()
            .find(|c| c.reason == "TaskHung")
            .map(|c| c.count),
        Some(1)
    );
    assert_eq!(pb.recent.last().unwrap().reason, "TaskHung");

    // The plugin ran several times with a different output each time; the condition kept the
    // message of its first transition.
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(&counter).map_or(0, |s| s.lines().count()) < 4 {
        assert!(
            Instant::now() < deadline,
            "plugin did not run 4 times within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, report) = agent.report(0).await;
    let c = report
        .unwrap()
        .problems
        .condition("RdmaLinkDown")
        .unwrap()
        .clone();
    assert_eq!(
        (c.status, c.reason.as_str()),
        (ConditionStatus::True, "RdmaLinkIsDown")
    );
    assert_eq!(c.message, "mlx5_0 down, 1 checks");

    shutdown.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .unwrap();
}

#[test]
fn monitor_flags_have_defaults_and_an_off_switch() {
    let base = [
        "nodekeeper-agent",
        "--node-name=n",
        "--tls-cert=/a",
        "--tls-key=/b",
        "--client-ca=/c",
    ];
    let c = Config::try_parse_from(base).unwrap();
    let m = c.monitors();
    assert_eq!(m.kmsg_path.as_deref(), Some(Path::new("/dev/kmsg")));
    assert_eq!(m.config_dir, None);
    let j = m.journal.expect("the journal monitor is on by default");
    assert_eq!(j.directory, None);
    assert!(j.journalctl.ends_with("journalctl"), "{j:?}");
    let c = Config::try_parse_from(base.iter().copied().chain(["--kernel-monitor=false"])).unwrap();
    assert_eq!(c.monitors().kmsg_path, None);
    let c = Config::try_parse_from(
        base.iter()
            .copied()
            .chain(["--journal-dir=/host/var/log/journal"]),
    )
    .unwrap();
    assert_eq!(
        c.monitors().journal.unwrap().directory.as_deref(),
        Some(Path::new("/host/var/log/journal"))
    );
    let c = Config::try_parse_from(base.iter().copied().chain(["--journal=false"])).unwrap();
    assert!(c.monitors().journal.is_none());
}
