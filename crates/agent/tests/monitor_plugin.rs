//! NPD custom-plugin-monitor files run by the agent with small shell scripts: exit 0/1/other as
//! OK/problem/unknown, output as the message (cut to `max_output_length`), a hung plugin and its
//! children killed at the timeout, a 10 MiB flood cut without buffering it, concurrency and the
//! invoke interval honoured, and bad rules refused with the reason.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nodekeeper_agent::monitor::plugin::{self, Outcome, PluginMonitor};
use nodekeeper_agent::monitor::state::{ConditionStatus, ProblemState, lock};
use tokio_util::sync::CancellationToken;

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A custom-plugin file with one permanent and one temporary rule on the same script.
fn config(path: &Path, extra: &str) -> String {
    format!(
        r#"{{
          "plugin": "custom",
          "pluginConfig": {{"invoke_interval": "30s", "timeout": "2s", "max_output_length": 80,
                            "concurrency": 3 {extra}}},
          "source": "test-custom-plugin-monitor",
          "metricsReporting": true,
          "conditions": [{{"type": "DiskProblem", "reason": "DiskIsOk", "message": "disk is fine"}}],
          "rules": [
            {{"type": "temporary", "reason": "DiskIsBad", "path": "{p}", "timeout": "2s"}},
            {{"type": "permanent", "condition": "DiskProblem", "reason": "DiskIsBad", "path": "{p}"}}
          ]
        }}"#,
        p = path.display()
    )
}

async fn run_once(json: &str) -> ProblemState {
    let (monitor, refused) = PluginMonitor::parse("test.json", json.as_bytes(), None).unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    let shared = ProblemState::new_shared();
    for c in &monitor.conditions {
        lock(&shared).declare(&monitor.source, c, std::time::SystemTime::now());
    }
    monitor.run_once(&shared).await;
    lock(&shared).clone()
}

#[tokio::test]
async fn exit_codes_map_to_ok_problem_and_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let ok = script(dir.path(), "ok.sh", "echo 'disk sda is fine'; exit 0");
    let state = run_once(&config(&ok, "")).await;
    let c = state.condition("DiskProblem").unwrap();
    assert_eq!(
        (c.status, c.reason.as_str(), c.message.as_str()),
        (ConditionStatus::False, "DiskIsOk", "disk is fine")
    );
    assert_eq!(state.counter("DiskIsBad"), 0);

    let bad = script(
        dir.path(),
        "bad.sh",
        "echo '  sda: 12 reallocated sectors  '; exit 1",
    );
    let state = run_once(&config(&bad, "")).await;
    let c = state.condition("DiskProblem").unwrap();
    assert_eq!(
        (c.status, c.reason.as_str(), c.message.as_str()),
        (
            ConditionStatus::True,
            "DiskIsBad",
            "sda: 12 reallocated sectors"
        )
    );
    // Counted twice, as NPD's problem_counter does: the temporary rule's problem and the
    // condition turning True, both under the reason the two rules share.
    assert_eq!(state.counter("DiskIsBad"), 2);

    let unknown = script(dir.path(), "unknown.sh", "echo 'smartctl missing'; exit 3");
    let state = run_once(&config(&unknown, "")).await;
    let c = state.condition("DiskProblem").unwrap();
    assert_eq!(
        (c.status, c.reason.as_str(), c.message.as_str()),
        (ConditionStatus::Unknown, "DiskIsOk", "smartctl missing")
    );
    // NPD counts a temporary problem for any result that is not OK.
    assert_eq!(state.counter("DiskIsBad"), 1);
}

#[tokio::test]
async fn the_condition_message_does_not_follow_a_drifting_output() {
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("n");
    let drift = script(
        dir.path(),
        "drift.sh",
        &format!(
            "echo x >> {c}; echo \"$(wc -l < {c}) bad sectors\"; exit 1",
            c = counter.display()
        ),
    );
    let (monitor, _) = PluginMonitor::parse("t.json", config(&drift, "").as_bytes(), None).unwrap();
    let shared = ProblemState::new_shared();
    for c in &monitor.conditions {
        lock(&shared).declare(&monitor.source, c, std::time::SystemTime::now());
    }
    monitor.run_once(&shared).await;
    let first = lock(&shared).condition("DiskProblem").unwrap().clone();
    let revision = lock(&shared).revision();
    monitor.run_once(&shared).await;
    let second = lock(&shared).condition("DiskProblem").unwrap().clone();
    assert_eq!(
        first, second,
        "message and transition stay while status and reason stay"
    );
    assert!(first.message.ends_with("bad sectors"), "{}", first.message);
    // Only the temporary record moved the state.
    assert_eq!(lock(&shared).revision(), revision + 1);
}

/// A plugin file open for writing somewhere (a tool replacing it; another thread's child between
/// fork and exec holding the descriptor) cannot be executed for that moment (`ETXTBSY`): the run
/// waits for it instead of reporting the plugin as failed.
#[tokio::test]
async fn a_plugin_being_written_runs_once_the_writer_closes_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = script(dir.path(), "ok.sh", "echo fine; exit 0");
    let writer = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(80));
        drop(writer);
    });
    let result = plugin::exec(&path, &[], Duration::from_secs(5), 200).await;
    release.join().unwrap();
    assert_eq!(result.outcome, Outcome::Ok, "{}", result.message);
    assert_eq!(result.message, "fine");
}

#[tokio::test]
async fn a_hung_plugin_and_its_children_are_killed_at_the_timeout() {
    // As the agent is PID 1 in its container, this process adopts the orphans of its children
    // (the plugin's background child once the plugin dies), so a child left unreaped stays here
    // as a zombie instead of being reaped by init.
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let hang = script(
        dir.path(),
        "hang.sh",
        &format!(
            "sleep 1000 & echo $! > {p}; echo started; sleep 1000",
            p = pids.display()
        ),
    );
    let started = Instant::now();
    let result = plugin::exec(&hang, &[], Duration::from_millis(500), 200).await;
    let took = started.elapsed();
    assert!(result.timed_out, "{}", result.message);
    assert_eq!(result.outcome, Outcome::Unknown);
    assert!(
        result.message.starts_with("Timeout when running plugin"),
        "{}",
        result.message
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // The background child was in the plugin's process group and died with it.
    let child: u32 = std::fs::read_to_string(&pids)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let state = std::fs::read_to_string(format!("/proc/{child}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(") ")
                    .next()
                    .map(|r| r.chars().next().unwrap_or('?'))
            });
        // Gone: killed and reaped (a zombie 'Z' would be this process's, never reaped).
        if state.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "child {child} still running: {state:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn a_10_mib_flood_is_cut_not_buffered() {
    let dir = tempfile::tempdir().unwrap();
    // 10 MiB on stdout and 10 MiB on stderr, then a problem verdict.
    let flood = script(
        dir.path(),
        "flood.sh",
        "head -c 10485760 /dev/zero | tr '\\0' 'y'; head -c 10485760 /dev/zero >&2; exit 1",
    );
    let result = plugin::exec(&flood, &[], Duration::from_secs(20), 80).await;
    assert!(!result.timed_out);
    assert_eq!(result.outcome, Outcome::Problem);
    assert_eq!(result.message, "y".repeat(80));
}

#[tokio::test]
async fn a_plugin_that_cannot_start_is_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let not_exec = dir.path().join("plain.txt");
    std::fs::write(&not_exec, "echo hi").unwrap();
    let result = plugin::exec(&not_exec, &[], Duration::from_secs(1), 200).await;
    assert_eq!(result.outcome, Outcome::Unknown);
    assert!(
        result.message.contains("start plugin"),
        "{}",
        result.message
    );
}

/// Three one-second plugins: with concurrency 1 they run one after another; with 3, together.
#[tokio::test]
async fn concurrency_limits_plugins_running_at_once() {
    for (concurrency, overlapped) in [(1, false), (3, true)] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        let slow = script(
            dir.path(),
            "slow.sh",
            &format!(
                "echo start >> {l}; sleep 1; echo end >> {l}; exit 0",
                l = log.display()
            ),
        );
        let json = format!(
            r#"{{"plugin": "custom", "source": "s",
                "pluginConfig": {{"timeout": "5s", "concurrency": {concurrency}}},
                "rules": [
                  {{"type": "temporary", "reason": "A", "path": "{p}"}},
                  {{"type": "temporary", "reason": "B", "path": "{p}"}},
                  {{"type": "temporary", "reason": "C", "path": "{p}"}}]}}"#,
            p = slow.display()
        );
        run_once(&json).await;
        let lines = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = lines.lines().collect();
        assert_eq!(lines.len(), 6);
        let together = lines[..3].iter().all(|l| *l == "start");
        let serial = lines == ["start", "end", "start", "end", "start", "end"];
        assert_eq!(
            (together, serial),
            (overlapped, !overlapped),
            "concurrency {concurrency}: {lines:?}"
        );
    }
}

#[tokio::test]
async fn plugins_run_every_interval_until_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let tick = script(
        dir.path(),
        "tick.sh",
        &format!("echo run >> {}; exit 1", log.display()),
    );
    let json = config(&tick, "")
        .replace("\"30s\"", "\"200ms\"")
        .replace("\"2s\"", "\"150ms\"");
    let (monitor, refused) = PluginMonitor::parse("t.json", json.as_bytes(), None).unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    let shared = ProblemState::new_shared();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(monitor.run(shared.clone(), shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    let runs = std::fs::read_to_string(&log).unwrap().lines().count();
    // Two rules per round; rounds at 0, 200, …, 1000 ms give 5 or 6 of them on a loaded machine.
    assert!((6..=12).contains(&runs), "{runs} runs");
    let after = std::fs::read_to_string(&log).unwrap().lines().count();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        std::fs::read_to_string(&log).unwrap().lines().count(),
        after,
        "stopped"
    );
    assert_eq!(
        lock(&shared).condition("DiskProblem").unwrap().status,
        ConditionStatus::True
    );
}

#[test]
fn bad_rules_and_files_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let ok = script(dir.path(), "ok.sh", "exit 0");
    let json = format!(
        r#"{{"plugin": "custom", "source": "s", "pluginConfig": {{"timeout": "5s"}},
            "conditions": [{{"type": "C", "reason": "Fine"}}],
            "rules": [
              {{"type": "temporary", "reason": "Slow", "path": "{p}", "timeout": "1m"}},
              {{"type": "temporary", "reason": "Missing", "path": "{d}/nope.sh"}},
              {{"type": "permanent", "condition": "Undeclared", "reason": "X", "path": "{p}"}},
              {{"type": "temporary", "reason": "Good", "path": "{p}"}}]}}"#,
        p = ok.display(),
        d = dir.path().display()
    );
    let (monitor, refused) = PluginMonitor::parse("s.json", json.as_bytes(), None).unwrap();
    assert_eq!(monitor.rule_count(), 1);
    let reasons: Vec<(&str, &str)> = refused
        .iter()
        .map(|r| (r.item.as_str(), r.reason.as_str()))
        .collect();
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    assert!(
        reasons[0].1.contains("longer than pluginConfig.timeout"),
        "{reasons:?}"
    );
    assert!(reasons[1].1.contains("does not exist"), "{reasons:?}");
    assert!(reasons[2].1.contains("not declared"), "{reasons:?}");

    let err = PluginMonitor::parse(
        "c.json",
        br#"{"plugin":"custom","source":"s","pluginConfig":{"concurrency":0}}"#,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("pluginConfig.concurrency"), "{err}");
    let err = PluginMonitor::parse(
        "i.json",
        br#"{"plugin":"custom","source":"s","pluginConfig":{"invoke_interval":"often"}}"#,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("invoke_interval"), "{err}");
}

/// `skip_initial_status`: the condition is not reported healthy before the plugin ran; it
/// appears with the plugin's first result.
#[tokio::test]
async fn skip_initial_status_reports_nothing_before_the_first_run() {
    let dir = tempfile::tempdir().unwrap();
    let bad = script(dir.path(), "bad.sh", "echo 'disk sda is failing'; exit 1");
    let json = config(&bad, r#", "skip_initial_status": true"#);
    let (monitor, refused) = PluginMonitor::parse("test.json", json.as_bytes(), None).unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    let shared = ProblemState::new_shared();
    monitor.declare(&mut lock(&shared), std::time::SystemTime::now());
    assert!(lock(&shared).condition("DiskProblem").is_none());
    monitor.run_once(&shared).await;
    let c = lock(&shared).condition("DiskProblem").cloned().unwrap();
    assert_eq!(
        (c.status, c.reason.as_str()),
        (ConditionStatus::True, "DiskIsBad")
    );
    // Without it, the condition is declared healthy at once.
    let (monitor, _) =
        PluginMonitor::parse("test.json", config(&bad, "").as_bytes(), None).unwrap();
    let shared = ProblemState::new_shared();
    monitor.declare(&mut lock(&shared), std::time::SystemTime::now());
    assert_eq!(
        lock(&shared).condition("DiskProblem").unwrap().status,
        ConditionStatus::False
    );
}
