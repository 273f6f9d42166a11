//! The journal reader: node-problem-detector's `journald` rule files (`systemd-monitor.json`:
//! kubelet and container-runtime starts as Events) and its `log-counter` restart counters
//! (`systemd-monitor-counter.json`: `FrequentKubeletRestart`, `FrequentContainerdRestart`), fed
//! from one `journalctl --output=json --follow` child process.
//!
//! Why a `journalctl` child rather than reading the journal files: the files are a binary format
//! with hash tables, entry arrays, per-object compression (xz, lz4, zstd) and rotation, which
//! libsystemd reads and nothing in this crate does; `journalctl -o json` is its documented,
//! stable text interface, present wherever the journal is, and one child costs a few MiB. The
//! child is asked only for the fields used (`--output-fields`), filtered to the identifiers the
//! rules name (`SYSLOG_IDENTIFIER=…`, as NPD's watcher filters), started at the earliest rule's
//! start time (`--since=@…`: boot + `delay` or now − `lookback`, whichever is later, as NPD)
//! and, when it has to be started again, right after the last entry read (`--after-cursor`), so
//! a restart neither re-fires old lines nor loses new ones.
//!
//! A journal that cannot be read (no `journalctl`, no journal directory, the child exiting) is
//! a report entry (a refusal under [`ORIGIN`]) and turns the restart conditions `Unknown`, never
//! healthy; everything else keeps running and the child is retried every 30 s.

use std::collections::VecDeque;
use std::io::{BufReader, ErrorKind};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use regex::Regex;
use serde::Deserialize;

use super::kmsg::{Line, Running, read_line_bounded, start_thread};
use super::plugin::PluginRule;
use super::rules::LogMonitor;
use super::state::{ConditionDefault, ConditionStatus, ProblemState, SharedState, lock};
use super::{parse_go_duration, unix_ms};

/// The refusal origin of everything the journal reader reports.
pub const ORIGIN: &str = "journal";
/// Longest JSON line read; longer ones are skipped (with `--output-fields` a line is small).
pub const MAX_LINE_BYTES: usize = 16 * 1024;
/// Restart-pattern matches kept per counter (the oldest go first); far above any threshold.
pub const MAX_COUNTER_EVENTS: usize = 1024;
/// How long to wait before starting `journalctl` again after it ended.
pub const RETRY: Duration = Duration::from_secs(30);
/// How often the counters are judged while the journal is quiet (matches age out of the window).
const EVALUATE_EVERY: Duration = Duration::from_secs(10);
const IDLE_POLL: Duration = Duration::from_millis(100);
/// The stderr kept from a failed `journalctl`.
const MAX_STDERR: usize = 2048;

/// Where the journal is read.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// The `journalctl` program (resolved; a missing one is reported, not an error).
    pub journalctl: PathBuf,
    /// The journal directory (`--directory`); `None`: the rule files' `logPath`, else the
    /// first of `/var/log/journal` and `/run/log/journal` that exists.
    pub directory: Option<PathBuf>,
}

/// One NPD `log-counter` rule counted natively: matches of `pattern` minus matches of
/// `revert_pattern` among the entries of `identifier` stamped after boot + `delay` and within
/// `lookback`; `count` or more turns the condition True (NPD's `log-counter` exit 1).
#[derive(Debug)]
pub struct Counter {
    pub source: String,
    pub condition: ConditionDefault,
    pub reason: String,
    pub identifier: String,
    pub log_path: String,
    pub lookback: Duration,
    pub delay: Duration,
    pub threshold: i64,
    pattern: Regex,
    revert: Option<Regex>,
    events: VecDeque<(SystemTime, i8)>,
}

fn compile_line_pattern(flag: &str, pattern: &str) -> Result<Regex, String> {
    // NPD's log-counter matches `pattern\z` against its buffer of lines; the shipped patterns
    // hold no newline, so matching each line's end is the same.
    Regex::new(&format!("{pattern}\\z"))
        .map_err(|e| format!("{flag} {pattern:?} is not a valid regex: {e}"))
}

impl Counter {
    /// Reads a `log-counter` rule's arguments (`--name=value` or `--name value`).
    pub fn from_rule(
        source: &str,
        rule: &PluginRule,
        conditions: &[ConditionDefault],
    ) -> Result<Counter, String> {
        let mut flags = std::collections::BTreeMap::new();
        let mut args = rule.args.iter();
        while let Some(arg) = args.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(format!("argument {arg:?} is not a --flag"));
            };
            let (name, value) = match flag.split_once('=') {
                Some((n, v)) => (n, v.to_owned()),
                None => (
                    flag,
                    args.next()
                        .ok_or_else(|| format!("--{flag} has no value"))?
                        .clone(),
                ),
            };
            match name {
                "journald-source" | "log-path" | "lookback" | "delay" | "count" | "pattern"
                | "revert-pattern" => {
                    flags.insert(name.to_owned(), value);
                }
                // klog's flags change nothing counted.
                "v" | "vmodule" | "logtostderr" => {}
                other => return Err(format!("log-counter has no flag --{other}")),
            }
        }
        let get = |n: &str| flags.get(n).map(String::as_str).unwrap_or("");
        let duration = |n: &str| match get(n) {
            "" => Ok(Duration::ZERO),
            t => parse_go_duration(t).map_err(|e| format!("--{n}: {e}")),
        };
        let identifier = get("journald-source").to_owned();
        if identifier.is_empty() {
            return Err("--journald-source is empty; name the SYSLOG_IDENTIFIER to read".into());
        }
        if get("pattern").is_empty() {
            return Err("--pattern is empty".into());
        }
        let threshold = match get("count") {
            "" => 1,
            t => t
                .parse::<i64>()
                .map_err(|_| format!("--count {t:?} is not a whole number"))?,
        };
        let condition = conditions
            .iter()
            .find(|c| c.kind == rule.condition)
            .cloned()
            .ok_or_else(|| format!("condition {:?} is not declared", rule.condition))?;
        Ok(Counter {
            source: source.to_owned(),
            condition,
            reason: rule.reason.clone(),
            identifier,
            log_path: get("log-path").to_owned(),
            lookback: duration("lookback")?,
            delay: duration("delay")?,
            threshold,
            pattern: compile_line_pattern("--pattern", get("pattern"))?,
            revert: match get("revert-pattern") {
                "" => None,
                p => Some(compile_line_pattern("--revert-pattern", p)?),
            },
            events: VecDeque::new(),
        })
    }

    /// The earliest entry counted now: boot + delay or now − lookback, whichever is later.
    pub fn start_time(&self, boot: SystemTime, now: SystemTime) -> SystemTime {
        let lookback = now.checked_sub(self.lookback).unwrap_or(now);
        super::add_or_never(boot, self.delay).max(lookback)
    }

    /// Takes one entry of this counter's identifier.
    pub fn observe(&mut self, message: &str, at: SystemTime) {
        let mut delta = 0i8;
        if self.pattern.is_match(message) {
            delta += 1;
        }
        if self.revert.as_ref().is_some_and(|r| r.is_match(message)) {
            delta -= 1;
        }
        if delta != 0 {
            if self.events.len() == MAX_COUNTER_EVENTS {
                self.events.pop_front();
            }
            self.events.push_back((at, delta));
        }
    }

    /// Matches minus reverts in the window, dropping those that left it.
    pub fn count(&mut self, boot: SystemTime, now: SystemTime) -> i64 {
        let start = self.start_time(boot, now);
        while self.events.front().is_some_and(|(t, _)| *t < start) {
            self.events.pop_front();
        }
        self.events
            .iter()
            .filter(|(t, _)| *t <= now)
            .map(|(_, d)| i64::from(*d))
            .sum()
    }

    /// Sets the condition from the count (the message names the window and threshold, not the
    /// count, though it changes only with the status anyway).
    pub fn judge(&mut self, boot: SystemTime, now: SystemTime, state: &mut ProblemState) {
        let count = self.count(boot, now);
        if count >= self.threshold {
            let message = format!(
                "{count} journal entries of {} matching the restart pattern within {:?}, \
                 which meets the threshold of {}",
                self.identifier, self.lookback, self.threshold
            );
            state.set_condition(
                &self.condition.kind,
                ConditionStatus::True,
                &self.reason,
                &message,
                now,
            );
        } else {
            state.set_condition(
                &self.condition.kind,
                ConditionStatus::False,
                &self.condition.reason,
                &self.condition.message,
                now,
            );
        }
    }

    /// Turns the condition Unknown: the journal cannot be read, so nothing is known.
    pub fn unknown(&self, why: &str, now: SystemTime, state: &mut ProblemState) {
        state.set_condition(
            &self.condition.kind,
            ConditionStatus::Unknown,
            &self.condition.reason,
            why,
            now,
        );
    }
}

/// One `journalctl -o json` line, with only the fields read.
#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "__CURSOR", default)]
    cursor: Option<String>,
    #[serde(rename = "__REALTIME_TIMESTAMP", default)]
    realtime: Option<String>,
    #[serde(rename = "SYSLOG_IDENTIFIER", default)]
    identifier: Option<serde_json::Value>,
    #[serde(rename = "MESSAGE", default)]
    message: Option<serde_json::Value>,
}

/// A journal field as `journalctl -o json` writes it: a string, an array of bytes (not valid
/// UTF-8), or an array of those (the field repeated); the first value is taken.
fn field_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) if items.iter().all(serde_json::Value::is_u64) => {
            let bytes: Vec<u8> = items
                .iter()
                .filter_map(|v| v.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect();
            Some(String::from_utf8_lossy(&bytes).into_owned())
        }
        serde_json::Value::Array(items) => items.first().and_then(field_text),
        _ => None,
    }
}

/// What one read loop saw (for tests and logs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JournalStats {
    pub entries: u64,
    pub skipped_before_start: u64,
    pub malformed: u64,
    pub too_long: u64,
    pub starts: u64,
    /// Times the journal was found unreadable (each retry counts).
    pub unreadable: u64,
}

/// Reads the journal for the `journald` rule files and the restart counters.
pub struct JournalReader {
    pub config: JournalConfig,
    pub boot: SystemTime,
    pub monitors: Vec<LogMonitor>,
    pub counters: Vec<Counter>,
    pub state: SharedState,
    pub stop: Arc<AtomicBool>,
    /// Stop when `journalctl` ends instead of starting it again (tests).
    pub stop_at_end: bool,
    /// Wait before starting `journalctl` again ([`RETRY`]).
    pub retry: Duration,
    pub caught_up: Option<tokio::sync::oneshot::Sender<()>>,
}

impl JournalReader {
    /// The directory read: the flag, else the files' `logPath`, else the usual places.
    pub fn directory(&self) -> Option<PathBuf> {
        if let Some(d) = &self.config.directory {
            return Some(d.clone());
        }
        let from_files = self
            .monitors
            .iter()
            .map(|m| m.log_path.as_str())
            .chain(self.counters.iter().map(|c| c.log_path.as_str()))
            .find(|p| !p.is_empty())
            .map(PathBuf::from);
        from_files
            .into_iter()
            .chain(["/var/log/journal", "/run/log/journal"].map(PathBuf::from))
            .find(|p| p.is_dir())
    }

    /// The identifiers asked for (sorted, deduplicated).
    fn identifiers(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .monitors
            .iter()
            .filter_map(|m| m.identifier.clone())
            .chain(self.counters.iter().map(|c| c.identifier.clone()))
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// `journalctl`'s arguments: after `cursor` when there is one, else since `since`.
    pub fn arguments(
        &self,
        directory: Option<&Path>,
        cursor: Option<&str>,
        since: SystemTime,
    ) -> Vec<String> {
        let mut args = vec![
            "--output=json".to_owned(),
            "--output-fields=MESSAGE,SYSLOG_IDENTIFIER".to_owned(),
            "--follow".to_owned(),
            "--no-pager".to_owned(),
            "--quiet".to_owned(),
            // `--follow` alone limits journalctl (v250 on) to the current boot and makes it exit
            // on a journal that has none yet; `--merge` lifts that, so every boot in the window
            // is read and an empty journal is waited on.
            "--merge".to_owned(),
        ];
        if let Some(d) = directory {
            args.push(format!("--directory={}", d.display()));
        }
        match cursor {
            Some(c) => args.push(format!("--after-cursor={c}")),
            None => args.push(format!("--since=@{}", unix_ms(since) / 1000)),
        }
        args.extend(
            self.identifiers()
                .into_iter()
                .map(|id| format!("SYSLOG_IDENTIFIER={id}")),
        );
        args
    }

    /// Marks the journal unreadable: one refusal entry (replacing the previous one, listed and
    /// logged once per distinct error rather than on every retry) and the restart conditions
    /// Unknown.
    fn unreadable(&mut self, why: &str, stats: &mut JournalStats) {
        self.signal_caught_up();
        stats.unreadable += 1;
        let now = SystemTime::now();
        let mut state = lock(&self.state);
        state.refuse_once(ORIGIN, why);
        for c in &self.counters {
            c.unknown(&format!("journal not readable: {why}"), now, &mut state);
        }
    }

    fn signal_caught_up(&mut self) {
        if let Some(tx) = self.caught_up.take() {
            let _ = tx.send(());
        }
    }

    fn sleep(&self, total: Duration) {
        let deadline = Instant::now() + total;
        while Instant::now() < deadline && !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(IDLE_POLL.min(total));
        }
    }

    /// Runs on the calling thread until stopped.
    pub fn run(mut self) -> JournalStats {
        let mut stats = JournalStats::default();
        let now = SystemTime::now();
        {
            let mut state = lock(&self.state);
            for m in &self.monitors {
                m.declare(&mut state, now);
            }
            for c in &self.counters {
                state.declare(&c.source, &c.condition, now);
                state.init_counter(&c.reason);
            }
        }
        let starts: Vec<SystemTime> = self
            .monitors
            .iter()
            .map(|m| m.start_time(self.boot, now))
            .collect();
        let since = starts
            .iter()
            .copied()
            .chain(self.counters.iter().map(|c| c.start_time(self.boot, now)))
            .min()
            .unwrap_or(now);
        let mut cursor: Option<String> = None;
        while !self.stop.load(Ordering::Relaxed) {
            let directory = self.directory();
            if directory.is_none() {
                self.unreadable(
                    "no journal directory (/var/log/journal or /run/log/journal); mount the \
                     host's journal into the agent or set --journal-dir",
                    &mut stats,
                );
            } else {
                let args = self.arguments(directory.as_deref(), cursor.as_deref(), since);
                match self.spawn(&args) {
                    Ok(child) => {
                        stats.starts += 1;
                        let why = self.follow(child, &starts, &mut stats, &mut cursor);
                        if let Some(why) = why {
                            self.unreadable(&why, &mut stats);
                        }
                    }
                    Err(why) => self.unreadable(&why, &mut stats),
                }
            }
            if self.stop_at_end {
                break;
            }
            self.sleep(self.retry);
        }
        stats
    }

    fn spawn(&self, args: &[String]) -> Result<Child, String> {
        let program = &self.config.journalctl;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                format!(
                    "start {}: {e}; journal rules and restart counts do not run",
                    program.display()
                )
            })?;
        tracing::info!(program = %program.display(), ?args, "journal reader started");
        Ok(child)
    }

    /// Reads the child's lines until it ends or a stop is requested. Returns why the journal
    /// could not be read when the child ended on its own.
    fn follow(
        &mut self,
        mut child: Child,
        starts: &[SystemTime],
        stats: &mut JournalStats,
        cursor: &mut Option<String>,
    ) -> Option<String> {
        let stdout = child.stdout.take().expect("piped");
        // Read while it runs: a journalctl that writes more than a pipe holds (64 KiB) to stderr
        // would otherwise block there and never print another entry.
        let stderr = child.stderr.take().map(|err| {
            std::thread::Builder::new()
                .name("journal-stderr".into())
                .spawn(move || drain_keeping(err, MAX_STDERR))
        });
        // Non-blocking, so that a stop request and the counters' clock are seen while idle.
        let flags = nix::fcntl::fcntl(&stdout, nix::fcntl::FcntlArg::F_GETFL).unwrap_or(0);
        let _ = nix::fcntl::fcntl(
            &stdout,
            nix::fcntl::FcntlArg::F_SETFL(
                nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK,
            ),
        );
        let mut reader = BufReader::with_capacity(64 * 1024, stdout);
        let mut pending = Line::default();
        let mut last_judged = Instant::now();
        let mut read_any = false;
        let ended = loop {
            if self.stop.load(Ordering::Relaxed) {
                break false;
            }
            match read_line_bounded(&mut reader, &mut pending, MAX_LINE_BYTES) {
                Ok(true) => {
                    read_any = true;
                    if pending.truncated {
                        stats.too_long += 1;
                    } else {
                        self.handle(&pending.bytes, starts, stats, cursor);
                    }
                    pending.clear();
                }
                // End of the pipe: journalctl exited.
                Ok(false) => break true,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Idle: the backlog is read.
                    if read_any || last_judged.elapsed() > Duration::from_millis(500) {
                        self.judge_counters();
                        self.signal_caught_up();
                        lock(&self.state).clear_refusals(ORIGIN);
                        last_judged = Instant::now();
                        read_any = false;
                    }
                    std::thread::sleep(IDLE_POLL);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    break {
                        tracing::warn!(error = %e, "read journalctl output");
                        true
                    };
                }
            }
            if last_judged.elapsed() > EVALUATE_EVERY {
                self.judge_counters();
                last_judged = Instant::now();
            }
        };
        if !ended {
            // The stderr thread ends when the killed child's pipe closes; it is not waited for.
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        self.judge_counters();
        let status = child.wait();
        let stderr = match stderr {
            Some(Ok(thread)) => thread.join().unwrap_or_default(),
            Some(Err(e)) => format!("(stderr not read: {e})").into_bytes(),
            None => Vec::new(),
        };
        let said = String::from_utf8_lossy(&stderr);
        let said = said.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
        Some(format!(
            "{} ended ({status}){}{said}",
            self.config.journalctl.display(),
            if said.is_empty() { "" } else { ": " }
        ))
    }

    fn judge_counters(&mut self) {
        if self.counters.is_empty() {
            return;
        }
        let now = SystemTime::now();
        let mut state = lock(&self.state);
        for c in &mut self.counters {
            c.judge(self.boot, now, &mut state);
        }
    }

    fn handle(
        &mut self,
        line: &[u8],
        starts: &[SystemTime],
        stats: &mut JournalStats,
        cursor: &mut Option<String>,
    ) {
        let Ok(entry) = serde_json::from_slice::<Entry>(line) else {
            stats.malformed += 1;
            return;
        };
        if let Some(c) = entry.cursor {
            *cursor = Some(c);
        }
        let (Some(at), Some(message)) = (
            entry
                .realtime
                .and_then(|t| t.parse::<u64>().ok())
                .map(|us| SystemTime::UNIX_EPOCH + Duration::from_micros(us)),
            entry.message.as_ref().and_then(field_text),
        ) else {
            stats.malformed += 1;
            return;
        };
        let identifier = entry.identifier.as_ref().and_then(field_text);
        let message = message.trim();
        stats.entries += 1;
        let mut state = None;
        for (monitor, start) in self.monitors.iter_mut().zip(starts) {
            if monitor.identifier != identifier {
                continue;
            }
            if at < *start {
                stats.skipped_before_start += 1;
                continue;
            }
            let guard = state.get_or_insert_with(|| lock(&self.state));
            monitor.process(message, at, guard);
        }
        drop(state);
        for c in &mut self.counters {
            if Some(&c.identifier) == identifier.as_ref() {
                c.observe(message, at);
            }
        }
    }
}

/// Reads `from` to its end, keeping the first `max` bytes and dropping the rest.
fn drain_keeping(mut from: impl std::io::Read, max: usize) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return kept,
            Ok(n) => {
                let room = max.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return kept,
        }
    }
}

/// Starts the journal reader on its own thread.
pub fn spawn(
    config: JournalConfig,
    boot: SystemTime,
    monitors: Vec<LogMonitor>,
    counters: Vec<Counter>,
    state: SharedState,
) -> Running<JournalStats> {
    start_thread("journal", move |stop, tx| {
        JournalReader {
            config,
            boot,
            monitors,
            counters,
            state,
            stop,
            stop_at_end: false,
            retry: RETRY,
            caught_up: Some(tx),
        }
        .run()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_fields_as_journalctl_writes_them() {
        assert_eq!(field_text(&serde_json::json!("a")), Some("a".into()));
        assert_eq!(
            field_text(&serde_json::json!([104, 105, 255])),
            Some("hi\u{fffd}".into())
        );
        assert_eq!(field_text(&serde_json::json!(["x", "y"])), Some("x".into()));
        assert_eq!(field_text(&serde_json::Value::Null), None);
    }
}
