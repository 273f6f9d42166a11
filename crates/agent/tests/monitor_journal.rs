//! The journal monitor fed by a stand-in `journalctl` (a shell script that records its arguments
//! and prints `journalctl -o json` lines in systemd's own wording for unit starts and stops):
//! NPD's built-in `systemd-monitor.json` turns kubelet/containerd starts into Events, and the
//! `systemd-monitor-counter.json` restart counters turn `FrequentKubeletRestart` True at five
//! starts in 20 minutes while planned stops (the revert pattern) cancel starts. Also: lines
//! before the lookback do not fire, a restarted `journalctl` continues after the last cursor, and
//! a journal that cannot be read (no program, no directory) is a report entry with the restart
//! conditions Unknown. The real `journalctl`, where installed, accepts the arguments.

// A skipped test prints `SKIPPED: <reason>`: that line is the contract with CI.
#![allow(clippy::print_stdout)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use nodekeeper_agent::monitor::journal::{JournalConfig, JournalReader, JournalStats, ORIGIN};
use nodekeeper_agent::monitor::state::{ConditionStatus, ProblemState, SharedState, lock};
use nodekeeper_agent::monitor::{self};

/// Unit start/stop messages as systemd (v249 on) logs them under `SYSLOG_IDENTIFIER=systemd`.
const KUBELET_STARTED: &str = "Started kubelet.service - kubelet: The Kubernetes Node Agent.";
const CONTAINERD_STARTING: &str = "Starting containerd.service - containerd container runtime...";
const CONTAINERD_STOPPING: &str = "Stopping containerd.service - containerd container runtime...";

/// One `journalctl -o json --output-fields=MESSAGE,SYSLOG_IDENTIFIER` line, `age` before now.
fn entry(cursor: u32, age: Duration, identifier: &str, message: &str) -> String {
    let us = (SystemTime::now() - age)
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros();
    serde_json::json!({
        "__CURSOR": format!("s=abc;i={cursor}"),
        "__REALTIME_TIMESTAMP": us.to_string(),
        "__MONOTONIC_TIMESTAMP": "1",
        "_BOOT_ID": "0f3b",
        "SYSLOG_IDENTIFIER": identifier,
        "MESSAGE": message,
    })
    .to_string()
}

fn minutes(n: u64) -> Duration {
    Duration::from_secs(60 * n)
}

/// A stand-in `journalctl`: appends its arguments (one per line, then `--`) to `args`, prints
/// `first` on its first run and `later` on the next ones, then waits as `--follow` does (or
/// exits with `exit_first` on its first run when set).
fn fake_journalctl(dir: &Path, first: &str, later: &str, exit_first: Option<u8>) -> PathBuf {
    std::fs::write(dir.join("first"), first).unwrap();
    std::fs::write(dir.join("later"), later).unwrap();
    let d = dir.display();
    let exit = exit_first.map_or(String::new(), |c| {
        format!("echo 'Journal file rotated away' >&2; exit {c}")
    });
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$@\" -- >> {d}/args\n\
         if [ -e {d}/ran ]; then cat {d}/later; exec sleep 30; fi\n\
         touch {d}/ran\ncat {d}/first\n{}\nexec sleep 30\n",
        if exit.is_empty() { String::new() } else { exit }
    );
    let path = dir.join("journalctl");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

struct Run {
    stop_at_end: bool,
    shared: SharedState,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<JournalStats>,
}

impl Run {
    fn start(journalctl: &Path, directory: Option<&Path>, stop_at_end: bool) -> Run {
        let shared = ProblemState::new_shared();
        let loaded = monitor::load(None, &mut lock(&shared));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = JournalReader {
            config: JournalConfig {
                journalctl: journalctl.to_owned(),
                directory: directory.map(Path::to_owned),
            },
            // Booted an hour ago: the kubelet counter's 5-minute delay is long past.
            boot: SystemTime::now() - minutes(60),
            monitors: loaded.journal_monitors,
            counters: loaded.counters,
            state: shared.clone(),
            stop: stop.clone(),
            stop_at_end,
            retry: Duration::from_millis(200),
            caught_up: None,
        };
        let thread = std::thread::spawn(move || reader.run());
        Run {
            stop_at_end,
            shared,
            stop,
            thread,
        }
    }

    /// Waits (at most 10 s) until `done` holds for the state.
    fn wait_for(&self, what: &str, done: impl Fn(&ProblemState) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(&lock(&self.shared)) {
            assert!(
                Instant::now() < deadline,
                "{what} not seen: {:#?}",
                lock(&self.shared)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the reader (one started with `stop_at_end` ends on its own) and returns its state.
    fn finish(self) -> (ProblemState, JournalStats) {
        if !self.stop_at_end {
            self.stop.store(true, Ordering::Relaxed);
        }
        let stats = self.thread.join().unwrap();
        let state = lock(&self.shared).clone();
        (state, stats)
    }
}

fn status(state: &ProblemState, kind: &str) -> (ConditionStatus, String) {
    let c = state
        .condition(kind)
        .unwrap_or_else(|| panic!("{kind} not declared"));
    (c.status, c.reason.clone())
}

#[test]
fn service_starts_are_events_and_frequent_restarts_a_condition() {
    let dir = tempfile::tempdir().unwrap();
    let journal_dir = dir.path().join("journal");
    std::fs::create_dir(&journal_dir).unwrap();
    let mut lines = Vec::new();
    let mut cursor = 0;
    let mut push = |age: Duration, id: &str, msg: &str| {
        cursor += 1;
        lines.push(entry(cursor, age, id, msg));
    };
    // Two hours ago: before every lookback, so neither an Event nor a count.
    push(minutes(120), "systemd", KUBELET_STARTED);
    // Five kubelet starts within 20 minutes: the threshold.
    for age in [15, 12, 9, 6, 3] {
        push(minutes(age), "systemd", KUBELET_STARTED);
    }
    // containerd started four times but stopped on purpose twice: 4 − 2 = 2 < 5.
    for age in [4, 3, 2, 1] {
        if age > 2 {
            push(minutes(age), "systemd", CONTAINERD_STOPPING);
        }
        push(minutes(age), "systemd", CONTAINERD_STARTING);
    }
    // Another identifier with the same words is not systemd's.
    push(minutes(1), "kubelet", KUBELET_STARTED);
    lines.push("not json".into());
    let fake = fake_journalctl(dir.path(), &(lines.join("\n") + "\n"), "", None);

    let run = Run::start(&fake, Some(&journal_dir), false);
    run.wait_for("FrequentKubeletRestart", |s| {
        s.condition("FrequentKubeletRestart")
            .is_some_and(|c| c.status == ConditionStatus::True)
    });
    let (state, stats) = run.finish();
    assert_eq!(
        status(&state, "FrequentKubeletRestart"),
        (ConditionStatus::True, "FrequentKubeletRestart".into())
    );
    assert_eq!(
        status(&state, "FrequentContainerdRestart"),
        (ConditionStatus::False, "NoFrequentContainerdRestart".into())
    );
    assert_eq!(
        status(&state, "FrequentDockerRestart"),
        (ConditionStatus::False, "NoFrequentDockerRestart".into())
    );
    // systemd-monitor.json: each start within its 5-minute lookback is an Event.
    assert_eq!(state.counter("KubeletStart"), 1, "{:?}", state.counters());
    assert_eq!(state.counter("ContainerdStart"), 4);
    assert_eq!(state.counter("FrequentKubeletRestart"), 1);
    assert!(
        state.refusals().iter().all(|r| r.origin != ORIGIN),
        "{:?}",
        state.refusals()
    );
    assert_eq!(stats.malformed, 1);
    assert_eq!(stats.entries, 13);
    assert_eq!(stats.starts, 1);

    // journalctl was asked for JSON from the journal directory, systemd's entries only, from the
    // earliest rule's start (the counters' 20 minutes), following.
    let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
    let args: Vec<&str> = args.lines().collect();
    for expected in [
        "--output=json",
        "--follow",
        "--merge",
        "SYSLOG_IDENTIFIER=systemd",
    ] {
        assert!(args.contains(&expected), "{expected} not in {args:?}");
    }
    assert!(args.contains(&format!("--directory={}", journal_dir.display()).as_str()));
    let since: u64 = args
        .iter()
        .find_map(|a| a.strip_prefix("--since=@"))
        .expect("--since")
        .parse()
        .unwrap();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        (now - 20 * 60 - 5..=now - 20 * 60 + 1).contains(&since),
        "{since} vs {now}"
    );
}

#[test]
fn a_restarted_journalctl_continues_after_the_last_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let journal_dir = dir.path().join("journal");
    std::fs::create_dir(&journal_dir).unwrap();
    let first = [
        entry(1, minutes(2), "systemd", KUBELET_STARTED),
        entry(2, minutes(1), "systemd", CONTAINERD_STARTING),
    ]
    .join("\n")
        + "\n";
    let later = entry(3, Duration::from_secs(10), "systemd", KUBELET_STARTED) + "\n";
    let fake = fake_journalctl(dir.path(), &first, &later, Some(1));
    let run = Run::start(&fake, Some(&journal_dir), false);
    run.wait_for("the second start's entry", |s| {
        s.counter("KubeletStart") == 2
    });
    // After the restart, the journal is readable again: the refusal is gone.
    run.wait_for("the refusal cleared", |s| {
        s.refusals().iter().all(|r| r.origin != ORIGIN)
    });
    let (state, stats) = run.finish();
    assert_eq!(stats.starts, 2);
    assert_eq!(state.counter("KubeletStart"), 2);
    assert_eq!(state.counter("ContainerdStart"), 1);
    let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
    let runs: Vec<&str> = args.split("--\n").filter(|r| !r.is_empty()).collect();
    assert_eq!(runs.len(), 2, "{args}");
    assert!(runs[0].contains("--since=@"), "{}", runs[0]);
    assert!(
        runs[1].contains("--after-cursor=s=abc;i=2\n"),
        "{}",
        runs[1]
    );
    assert!(!runs[1].contains("--since"), "{}", runs[1]);
}

#[test]
fn a_journal_that_cannot_be_read_is_a_report_entry_and_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let run = Run::start(Path::new("/nonexistent/journalctl"), Some(dir.path()), true);
    let (state, stats) = run.finish();
    assert_eq!(stats.starts, 0);
    let refusal = state
        .refusals()
        .iter()
        .find(|r| r.origin == ORIGIN)
        .expect("a journal refusal");
    assert!(
        refusal.reason.contains("/nonexistent/journalctl"),
        "{refusal:?}"
    );
    for kind in ["FrequentKubeletRestart", "FrequentContainerdRestart"] {
        let c = state.condition(kind).unwrap();
        assert_eq!(c.status, ConditionStatus::Unknown, "{c:?}");
        assert!(c.message.contains("journal not readable"), "{c:?}");
    }
}

fn real_journalctl() -> Option<PathBuf> {
    let found = ["/usr/bin/journalctl", "/bin/journalctl"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    if found.is_none() {
        println!("SKIPPED: journalctl is not installed on this machine");
    }
    found
}

#[test]
fn the_real_journalctl_accepts_the_arguments_and_reports_a_missing_directory() {
    let Some(journalctl) = real_journalctl() else {
        return;
    };
    // An empty journal directory: journalctl waits for entries; nothing is refused and the
    // restart conditions are judged healthy once the (empty) backlog is read.
    let dir = tempfile::tempdir().unwrap();
    let run = Run::start(&journalctl, Some(dir.path()), false);
    run.wait_for("healthy restart conditions", |s| {
        s.refusals().is_empty()
            && s.condition("FrequentKubeletRestart")
                .is_some_and(|c| c.status == ConditionStatus::False)
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !run.thread.is_finished(),
        "journalctl ended on an empty journal"
    );
    let (state, stats) = run.finish();
    assert_eq!(stats.starts, 1);
    assert!(state.refusals().is_empty(), "{:?}", state.refusals());

    // A directory that is not there: journalctl's own words land in the report.
    let run = Run::start(&journalctl, Some(&dir.path().join("missing")), true);
    let (state, _) = run.finish();
    let refusal = state
        .refusals()
        .iter()
        .find(|r| r.origin == ORIGIN)
        .expect("a journal refusal");
    assert!(refusal.reason.contains("missing"), "{refusal:?}");
    assert_eq!(
        state.condition("FrequentKubeletRestart").unwrap().status,
        ConditionStatus::Unknown
    );
}

/// A journal that stays unreadable is listed (and logged) once per distinct error, not on
/// every retry: the state does not move while the same error repeats.
#[test]
fn the_same_error_on_every_retry_is_listed_once() {
    let dir = tempfile::tempdir().unwrap();
    let run = Run::start(
        Path::new("/nonexistent/journalctl"),
        Some(dir.path()),
        false,
    );
    run.wait_for("the refusal", |s| {
        s.refusals().iter().any(|r| r.origin == ORIGIN)
    });
    let revision = lock(&run.shared).revision();
    // Retries every 200 ms: several happen meanwhile.
    std::thread::sleep(Duration::from_millis(1200));
    let (state, stats) = run.finish();
    assert!(stats.unreadable >= 4, "{stats:?}");
    assert_eq!(state.revision(), revision, "{state:#?}");
    assert_eq!(
        state
            .refusals()
            .iter()
            .filter(|r| r.origin == ORIGIN)
            .count(),
        1
    );
}

/// A `journalctl` that writes more to stderr than a pipe holds (64 KiB) before its entries
/// is not left blocked on the pipe: stderr is read while it runs.
#[test]
fn a_journalctl_flooding_stderr_is_not_blocked() {
    let dir = tempfile::tempdir().unwrap();
    let journal_dir = dir.path().join("journal");
    std::fs::create_dir(&journal_dir).unwrap();
    let d = dir.path().display();
    std::fs::write(
        dir.path().join("entries"),
        entry(1, minutes(1), "systemd", KUBELET_STARTED) + "\n",
    )
    .unwrap();
    let path = dir.path().join("journalctl");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nhead -c 200000 /dev/zero | tr '\\0' w >&2\ncat {d}/entries\nexec sleep 30\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = Run::start(&path, Some(&journal_dir), false);
    run.wait_for("the entry printed after the stderr flood", |s| {
        s.counter("KubeletStart") == 1
    });
    run.finish();
}
