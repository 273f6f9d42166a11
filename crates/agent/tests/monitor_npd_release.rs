//! node-problem-detector's own release configuration, fetched by this test from NPD's Go module
//! (`go mod download k8s.io/node-problem-detector@NPD_VERSION`, cached under
//! ~/.cache/nodekeeper) and never copied into this repository: its kmsg rule files equal the
//! built-in defaults and run on a kernel line; its custom-plugin files parse, load every rule whose
//! program exists, and run; files for monitors nodekeeper does not run are refused by name.

// A skipped test prints `SKIPPED: <reason>`: that line is the contract with CI.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use nodekeeper_agent::monitor::plugin::{self, Outcome, PluginMonitor};
use nodekeeper_agent::monitor::rules::LogMonitor;
use nodekeeper_agent::monitor::state::{ConditionStatus, ProblemState, lock};
use nodekeeper_agent::monitor::{self, NPD_VERSION, journal};

/// The release's `config/` directory (with the module root as its parent), or why not.
fn release_config() -> Result<PathBuf, String> {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    let cache = home
        .join(".cache/nodekeeper")
        .join(format!("node-problem-detector-config-{NPD_VERSION}"));
    let config = cache.join("config");
    if config.join("kernel-monitor.json").exists() {
        return Ok(config);
    }
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let module = format!("k8s.io/node-problem-detector@{NPD_VERSION}");
    // The module is not in the checksum database the proxy serves; only its JSON and scripts are
    // read here, so verification is skipped for this one module.
    let out = Command::new("go")
        .args(["mod", "download", "-json", &module])
        .env("GONOSUMDB", "k8s.io/node-problem-detector")
        .env("GOFLAGS", "-mod=mod")
        .current_dir(work.path())
        .output()
        .map_err(|e| format!("run go: {e}"))?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "go mod download {module} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(e) = info.get("Error") {
        return Err(format!("go mod download {module}: {e}"));
    }
    let dir = info["Dir"].as_str().ok_or("go mod download gave no Dir")?;
    let staging = home
        .join(".cache/nodekeeper")
        .join(format!(".npd-config-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| e.to_string())?;
    let copied = Command::new("cp")
        .arg("-r")
        .arg(Path::new(dir).join("config"))
        .arg(&staging)
        .status()
        .map_err(|e| e.to_string())?;
    if !copied.success() {
        return Err(format!("copy {dir}/config failed"));
    }
    // The module cache is read-only and keeps no execute bits; NPD's image ships the plugin
    // scripts executable, so the copy does too.
    let _ = Command::new("chmod")
        .args(["-R", "u+w"])
        .arg(&staging)
        .status();
    for entry in std::fs::read_dir(staging.join("config/plugin")).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let _ = Command::new("chmod").arg("u+x").arg(&path).status();
    }
    // Another test binary may have finished first; either copy serves.
    if let Err(e) = std::fs::rename(&staging, &cache) {
        let _ = std::fs::remove_dir_all(&staging);
        if !config.join("kernel-monitor.json").exists() {
            return Err(format!("move the copy to {}: {e}", cache.display()));
        }
    }
    Ok(config)
}

fn config_or_skip() -> Option<PathBuf> {
    // Both tests need it; fetch once per test binary.
    static CONFIG: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    match CONFIG.get_or_init(release_config).clone() {
        Ok(c) => Some(c),
        Err(reason) if std::env::var_os("CI").is_none() => {
            println!(
                "SKIPPED: node-problem-detector {NPD_VERSION} configuration unavailable: {reason}"
            );
            None
        }
        Err(reason) => {
            panic!("node-problem-detector {NPD_VERSION} configuration unavailable in CI: {reason}")
        }
    }
}

fn plugin_of(path: &Path) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    Some(v.get("plugin")?.as_str()?.to_owned())
}

#[test]
fn release_kmsg_rule_files_equal_the_builtin_defaults_and_run() {
    let Some(config) = config_or_skip() else {
        return;
    };
    for (name, builtin) in [
        ("kernel-monitor.json", monitor::DEFAULT_KERNEL_MONITOR),
        ("readonly-monitor.json", monitor::DEFAULT_READONLY_MONITOR),
        ("systemd-monitor.json", monitor::DEFAULT_SYSTEMD_MONITOR),
    ] {
        let bytes = std::fs::read(config.join(name)).unwrap();
        let release: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let ours: serde_json::Value = serde_json::from_str(builtin).unwrap();
        assert_eq!(release, ours, "{name} differs from NPD {NPD_VERSION}");
        let (_, refused) = LogMonitor::parse(name, &bytes).unwrap();
        assert!(refused.is_empty(), "{name}: {refused:?}");
    }

    // The release directory as a monitor directory: its kmsg files replace the built-in ones
    // (same sources), and a kernel line moves the release rule's condition.
    let shared = ProblemState::new_shared();
    let loaded = monitor::load(Some(&config), &mut lock(&shared));
    let sources: Vec<_> = loaded
        .log_monitors
        .iter()
        .map(|m| m.source.as_str())
        .collect();
    // Ours stays beside them (it has a source of its own).
    assert_eq!(
        sources,
        [
            "kernel-monitor-modern",
            "kernel-monitor",
            "readonly-monitor"
        ]
    );
    // Its journald files load as journal monitors, each on its SYSLOG_IDENTIFIER.
    let mut journald: Vec<_> = loaded
        .journal_monitors
        .iter()
        .map(|m| (m.source.as_str(), m.identifier.as_deref().unwrap_or("")))
        .collect();
    journald.sort();
    assert_eq!(
        journald,
        [
            ("abrt-adaptor", "abrt-notification"),
            ("docker-monitor", "dockerd"),
            ("systemd-monitor", "systemd"),
        ]
    );
    let dir = tempfile::tempdir().unwrap();
    let kmsg = dir.path().join("kmsg");
    std::fs::write(
        &kmsg,
        "2,5,3599000000,-;EXT4-fs (sda1): Remounting filesystem read-only\n",
    )
    .unwrap();
    nodekeeper_agent::monitor::kmsg::KmsgReader {
        path: kmsg,
        boot: SystemTime::now() - Duration::from_secs(3600),
        monitors: loaded.log_monitors,
        state: shared.clone(),
        stop: Default::default(),
        stop_at_end: true,
        caught_up: None,
        persist: None,
    }
    .run();
    let state = lock(&shared);
    let c = state.condition("ReadonlyFilesystem").unwrap();
    assert_eq!(
        (c.status, c.reason.as_str()),
        (ConditionStatus::True, "FilesystemIsReadOnly")
    );

    // Files for monitors nodekeeper does not run are refused by name, each with its reason.
    for r in state.refusals() {
        assert!(!r.reason.is_empty());
    }
    for name in [
        "kernel-monitor-filelog.json",
        "docker-monitor-filelog.json",
        "system-stats-monitor.json",
    ] {
        let refusal = state.refusals().iter().find(|r| r.origin.ends_with(name));
        let refusal =
            refusal.unwrap_or_else(|| panic!("{name} not refused: {:?}", state.refusals()));
        assert!(refusal.reason.contains("not supported"), "{refusal:?}");
    }
}

#[tokio::test]
async fn release_custom_plugin_files_parse_and_run() {
    let Some(config) = config_or_skip() else {
        return;
    };
    let root = config.parent().unwrap();
    let mut files: Vec<_> = std::fs::read_dir(&config)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| plugin_of(p).as_deref() == Some("custom"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(path).unwrap();
        // NPD resolves `./config/plugin/…` against its working directory, the module root here.
        let (monitor, refused) = PluginMonitor::parse(&name, &bytes, Some(root))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Rules are refused only for a program that is not on this machine
        // (/home/kubernetes/bin/…, Windows paths), never for their format.
        for r in &refused {
            assert!(r.reason.contains("does not exist"), "{name}: {r:?}");
        }
        if name.starts_with("health-checker") {
            assert!(
                !refused.is_empty(),
                "{name}: its program should be missing here"
            );
        }
        // NPD's log-counter rules are not run as programs but counted from the journal.
        if name.contains("counter") {
            assert!(!monitor.log_counters.is_empty(), "{name}");
            for rule in &monitor.log_counters {
                let counter =
                    journal::Counter::from_rule(&monitor.source, rule, &monitor.conditions)
                        .unwrap_or_else(|e| panic!("{name}: {}: {e}", rule.reason));
                assert!(counter.threshold >= 1 && counter.lookback > Duration::ZERO);
            }
        }
        if name == "systemd-monitor-counter.json" {
            let release: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let ours: serde_json::Value =
                serde_json::from_str(monitor::DEFAULT_SYSTEMD_MONITOR_COUNTER).unwrap();
            assert_eq!(release, ours, "{name} differs from NPD {NPD_VERSION}");
        }
        // Run the plugin that only looks at this machine and says what it saw by its exit code
        // (the network one resolves DNS names, which tests do not do; iptables_mode.sh prints
        // its verdict and always exits 0, so running it would show nothing).
        if name != "custom-plugin-monitor.json" {
            continue;
        }
        assert!(monitor.rule_count() > 0, "{name}");
        let shared = ProblemState::new_shared();
        for c in &monitor.conditions {
            lock(&shared).declare(&monitor.source, c, SystemTime::now());
        }
        let before = lock(&shared).revision();
        tokio::time::timeout(Duration::from_secs(30), monitor.run_once(&shared))
            .await
            .unwrap_or_else(|_| panic!("{name} did not finish"));
        let state = lock(&shared).clone();
        // check_ntp.sh answers on every machine: running (OK), not running (problem: the
        // condition True and an NTPIsDown record) or no systemctl (unknown: a record only).
        let c = state.condition("NTPProblem").unwrap();
        let down = state.counter("NTPIsDown");
        match c.status {
            ConditionStatus::False => assert_eq!((down, c.reason.as_str()), (0, "NTPIsUp")),
            // The temporary rule's problem and the condition's transition share the reason.
            ConditionStatus::True => assert_eq!((down, c.reason.as_str()), (2, "NTPIsDown")),
            ConditionStatus::Unknown => assert_eq!(down, 1),
        }
        assert!(c.status == ConditionStatus::False || state.revision() > before);
        assert!(
            c.message.contains("ntp") || c.message.contains("systemctl"),
            "{c:?}"
        );
        let status = c.status;
        // The same script run directly agrees (and shows it ran even when all is healthy).
        let script = root.join("config/plugin/check_ntp.sh");
        let direct = plugin::exec(&script, &[], Duration::from_secs(5), 80).await;
        let expected = match status {
            ConditionStatus::False => Outcome::Ok,
            ConditionStatus::True => Outcome::Problem,
            ConditionStatus::Unknown => Outcome::Unknown,
        };
        assert_eq!(direct.outcome, expected, "{direct:?}");
        assert!(
            direct.message.contains("ntp") || direct.message.contains("systemctl"),
            "{direct:?}"
        );
    }
}
