//! node-problem-detector's custom-plugin-monitor files run unchanged: every `invoke_interval`
//! each rule's program runs (at most `concurrency` at once) in its own process group with a
//! timeout after which the whole group is killed; exit 0 is OK, 1 a problem, anything else (a
//! signal, a timeout) unknown; the first `max_output_length` bytes of stdout are the message.
//! Output is read bounded: a plugin that prints megabytes is drained, not buffered.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::rules::RuleRefusal;
use super::state::{ConditionDefault, ConditionStatus, ProblemState, RuleType, SharedState, lock};
use super::{MonitorError, MonitorFile, invalid, parse_go_duration, parse_json};

/// NPD's defaults (pkg/custompluginmonitor/types/config.go).
const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_MAX_OUTPUT: usize = 80;
const DEFAULT_CONCURRENCY: usize = 3;
/// Bytes of stdout (and of stderr) kept before the message is cut, as NPD's 4 KiB read limit.
pub const MAX_READ_BYTES: usize = 4 * 1024;
/// Upper bounds that keep a configuration from exhausting the node.
const MAX_CONCURRENCY: usize = 32;
const MAX_PLUGIN_RULES: usize = 128;
/// How long a finished plugin's process group is reaped for (see [`reap_group`]).
const REAP_GRACE: Duration = Duration::from_millis(500);
const REAP_POLL: Duration = Duration::from_millis(20);

#[derive(Clone, Debug, Default, Deserialize)]
pub struct PluginGlobalConfig {
    pub invoke_interval: Option<String>,
    pub timeout: Option<String>,
    pub max_output_length: Option<usize>,
    pub concurrency: Option<usize>,
    pub enable_message_change_based_condition_update: Option<bool>,
    pub skip_initial_status: Option<bool>,
}

/// The JSON of a custom-plugin-monitor file as NPD reads it (unknown fields ignored).
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginMonitorFile {
    #[serde(flatten)]
    pub common: MonitorFile,
    #[serde(default)]
    pub plugin_config: PluginGlobalConfig,
}

/// One entry of `rules[]`.
#[derive(Clone, Debug, Deserialize)]
pub struct PluginRule {
    #[serde(rename = "type")]
    pub kind: RuleType,
    #[serde(default)]
    pub condition: String,
    pub reason: String,
    pub path: PathBuf,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub timeout: Option<String>,
}

#[derive(Clone, Debug)]
struct Rule {
    rule: PluginRule,
    timeout: Duration,
}

/// A loaded custom-plugin-monitor file.
#[derive(Clone, Debug)]
pub struct PluginMonitor {
    pub source: String,
    pub conditions: Vec<ConditionDefault>,
    pub interval: Duration,
    pub max_output: usize,
    pub concurrency: usize,
    pub message_change_update: bool,
    /// NPD's `skip_initial_status`: the conditions are not declared healthy at start, only
    /// reported once a plugin has said something about them.
    pub skip_initial_status: bool,
    rules: Vec<Rule>,
    /// Rules that run NPD's `log-counter` (the journal restart counters of
    /// `systemd-monitor-counter.json`): not executed, but counted natively by the journal
    /// reader from their arguments (see [`super::journal::Counter`]).
    pub log_counters: Vec<PluginRule>,
}

/// A plugin's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Problem,
    Unknown,
}

/// What one run of a plugin gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunResult {
    pub outcome: Outcome,
    pub message: String,
    pub timed_out: bool,
}

impl PluginMonitor {
    /// Parses a custom-plugin-monitor file. Relative plugin paths resolve against `base`, or
    /// against the working directory when `None` (as NPD resolves them).
    pub fn parse(
        origin: &str,
        json: &[u8],
        base: Option<&Path>,
    ) -> Result<(PluginMonitor, Vec<RuleRefusal>), MonitorError> {
        let file: PluginMonitorFile = parse_json(origin, json)?;
        let invalid = |field: &str, reason: String| invalid(origin, field, reason);
        let MonitorFile {
            source,
            conditions,
            rules: raw_rules,
            ..
        } = file.common.checked(origin, "custom")?;
        let g = &file.plugin_config;
        let duration = |field: &str, text: &Option<String>, default: Duration| match text {
            None => Ok(default),
            Some(t) => match parse_go_duration(t) {
                Ok(d) if d > Duration::ZERO => Ok(d),
                Ok(_) => Err(invalid(field, "must be greater than 0".into())),
                Err(reason) => Err(invalid(field, reason)),
            },
        };
        let interval = duration(
            "pluginConfig.invoke_interval",
            &g.invoke_interval,
            DEFAULT_INTERVAL,
        )?;
        let timeout = duration("pluginConfig.timeout", &g.timeout, DEFAULT_TIMEOUT)?;
        let max_output = g
            .max_output_length
            .unwrap_or(DEFAULT_MAX_OUTPUT)
            .min(MAX_READ_BYTES);
        let concurrency = match g.concurrency.unwrap_or(DEFAULT_CONCURRENCY) {
            0 => {
                return Err(invalid(
                    "pluginConfig.concurrency",
                    "must be at least 1".into(),
                ));
            }
            n => n.min(MAX_CONCURRENCY),
        };

        let mut refusals = Vec::new();
        let mut rules = Vec::new();
        let mut log_counters = Vec::new();
        for (i, value) in raw_rules.into_iter().enumerate() {
            let mut refuse =
                |item: String, reason: String| refusals.push(RuleRefusal { item, reason });
            if i >= MAX_PLUGIN_RULES {
                refuse(
                    format!("rules[{i}]"),
                    format!("more than {MAX_PLUGIN_RULES} rules in one file"),
                );
                continue;
            }
            let mut rule: PluginRule = match serde_json::from_value(value) {
                Ok(r) => r,
                Err(e) => {
                    refuse(format!("rules[{i}]"), format!("not a rule: {e}"));
                    continue;
                }
            };
            let item = format!("rules[{i}] ({})", rule.reason);
            let rule_timeout = match &rule.timeout {
                None => timeout,
                Some(t) => match parse_go_duration(t) {
                    Ok(d) if d > timeout => {
                        refuse(
                            item,
                            format!("timeout {t} is longer than pluginConfig.timeout"),
                        );
                        continue;
                    }
                    Ok(d) => d,
                    Err(reason) => {
                        refuse(item, format!("timeout: {reason}"));
                        continue;
                    }
                },
            };
            if rule.reason.is_empty() {
                refuse(item, "reason is empty; every rule needs a reason".into());
                continue;
            }
            if rule.kind == RuleType::Permanent
                && !conditions.iter().any(|c| c.kind == rule.condition)
            {
                refuse(
                    item,
                    format!(
                        "condition {:?} is not declared in conditions[]; add it there with its healthy reason",
                        rule.condition
                    ),
                );
                continue;
            }
            if rule.path.file_name().is_some_and(|n| n == "log-counter") {
                log_counters.push(rule);
                continue;
            }
            if let Some(base) = base
                && rule.path.is_relative()
            {
                rule.path = base.join(&rule.path);
            }
            if !rule.path.exists() {
                refuse(item, format!("path {} does not exist", rule.path.display()));
                continue;
            }
            rules.push(Rule {
                rule,
                timeout: rule_timeout,
            });
        }
        Ok((
            PluginMonitor {
                source,
                conditions,
                interval,
                max_output,
                concurrency,
                message_change_update: g
                    .enable_message_change_based_condition_update
                    .unwrap_or(false),
                skip_initial_status: g.skip_initial_status.unwrap_or(false),
                rules,
                log_counters,
            },
            refusals,
        ))
    }

    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Declares this file's conditions (healthy; not with `skip_initial_status`) and starts its
    /// reasons' counters.
    pub fn declare(&self, state: &mut ProblemState, now: SystemTime) {
        if !self.skip_initial_status {
            for c in &self.conditions {
                state.declare(&self.source, c, now);
            }
        }
        for r in &self.rules {
            state.init_counter(&r.rule.reason);
        }
    }

    /// Runs every rule once (at most `concurrency` at a time) and applies the results.
    pub async fn run_once(&self, state: &SharedState) {
        let limit = Arc::new(Semaphore::new(self.concurrency));
        let mut runs = tokio::task::JoinSet::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let limit = limit.clone();
            let rule = rule.clone();
            let max_output = self.max_output;
            runs.spawn(async move {
                let _permit = limit.acquire_owned().await;
                let result = exec(&rule.rule.path, &rule.rule.args, rule.timeout, max_output).await;
                (i, result)
            });
        }
        let mut results = Vec::with_capacity(self.rules.len());
        while let Some(done) = runs.join_next().await {
            if let Ok(r) = done {
                results.push(r);
            }
        }
        // Apply in rule order so that two rules on one condition resolve as in the file.
        results.sort_by_key(|(i, _)| *i);
        let now = SystemTime::now();
        let mut state = lock(state);
        for (i, result) in results {
            self.apply(&self.rules[i].rule, &result, &mut state, now);
        }
    }

    /// NPD's status rules: a temporary rule records a problem on any non-OK result; a permanent
    /// rule moves its condition, taking the default reason and message when it turns healthy.
    fn apply(
        &self,
        rule: &PluginRule,
        result: &RunResult,
        state: &mut ProblemState,
        now: SystemTime,
    ) {
        if result.outcome != Outcome::Ok {
            tracing::info!(source = %self.source, reason = %rule.reason, outcome = ?result.outcome, "plugin reports a problem");
        }
        match rule.kind {
            RuleType::Temporary => {
                if result.outcome != Outcome::Ok {
                    state.record(&self.source, &rule.reason, &result.message, now);
                }
            }
            RuleType::Permanent => {
                let default = self
                    .conditions
                    .iter()
                    .find(|c| c.kind == rule.condition)
                    .expect("checked at load");
                // Declared at start unless skip_initial_status; then at its first result.
                if self.skip_initial_status {
                    state.declare(&self.source, default, now);
                }
                let (status, reason, message) = match result.outcome {
                    Outcome::Problem => (
                        ConditionStatus::True,
                        rule.reason.as_str(),
                        result.message.as_str(),
                    ),
                    Outcome::Ok => (
                        ConditionStatus::False,
                        default.reason.as_str(),
                        default.message.as_str(),
                    ),
                    Outcome::Unknown => (
                        ConditionStatus::Unknown,
                        default.reason.as_str(),
                        result.message.as_str(),
                    ),
                };
                let changed = state.set_condition(&rule.condition, status, reason, message, now);
                if !changed && self.message_change_update && status == ConditionStatus::True {
                    state.set_condition_message(&rule.condition, message);
                }
            }
        }
    }

    /// Declares the conditions, then runs the rules every `interval` until `shutdown`.
    pub async fn run(self, state: SharedState, shutdown: CancellationToken) {
        self.declare(&mut lock(&state), SystemTime::now());
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.run_once(&state) => {}
            }
        }
    }
}

/// Starts `cmd`, trying again for a moment while the file is busy (`ETXTBSY`: open for writing
/// somewhere). That is brief and ordinary: a configuration tool replacing the plugin, or
/// another thread of this process forking while it writes a file (the child holds the
/// descriptor until its own exec). Reported as the plugin's failure only if it lasts.
async fn spawn(cmd: &mut tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    const TRIES: u32 = 6;
    let mut tries = 1;
    loop {
        match cmd.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < TRIES => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            started => return started,
        }
    }
}

/// Runs one plugin: its own process group, stdin closed, stdout kept up to [`MAX_READ_BYTES`]
/// (the rest drained and dropped), the group killed with SIGKILL at `timeout`.
pub async fn exec(path: &Path, args: &[String], timeout: Duration, max_output: usize) -> RunResult {
    let mut cmd = tokio::process::Command::new(path);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match spawn(&mut cmd).await {
        Ok(c) => c,
        Err(e) => {
            return RunResult {
                outcome: Outcome::Unknown,
                message: cut(&format!("start plugin {}: {e}", path.display()), max_output),
                timed_out: false,
            };
        }
    };
    let pgid = child.id();
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let work = async {
        let (out, _err) = tokio::join!(read_bounded(&mut stdout), read_bounded(&mut stderr));
        let status = child.wait().await;
        (out, status)
    };
    let finished = tokio::time::timeout(timeout, work).await;
    match finished {
        Ok((out, status)) => {
            if let Some(pgid) = pgid {
                reap_group(pgid).await;
            }
            let text = String::from_utf8_lossy(&out);
            let message = cut(text.trim(), max_output);
            let outcome = match status.ok().and_then(|s| s.code()) {
                Some(0) => Outcome::Ok,
                Some(1) => Outcome::Problem,
                _ => Outcome::Unknown,
            };
            RunResult {
                outcome,
                message,
                timed_out: false,
            }
        }
        Err(_) => {
            if let Some(pgid) = pgid {
                kill_group(pgid);
            }
            let _ = child.wait().await;
            if let Some(pgid) = pgid {
                reap_group(pgid).await;
            }
            tracing::warn!(plugin = %path.display(), ?timeout, "plugin timed out; process group killed");
            RunResult {
                outcome: Outcome::Unknown,
                message: cut(
                    &format!(
                        "Timeout when running plugin {:?}: killed after {timeout:?}",
                        path.display().to_string()
                    ),
                    max_output,
                ),
                timed_out: true,
            }
        }
    }
}

fn kill_group(pgid: u32) {
    let Ok(pgid) = i32::try_from(pgid) else {
        return;
    };
    // The group is the plugin's own (process_group(0)), so this reaches its children too.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Reaps what is left of a finished plugin's process group. In its container the agent is PID 1,
/// so a plugin's children that outlive it (or are killed with its group) become the agent's, and
/// nothing else would ever wait for them: each would stay a zombie, holding a PID. Waiting on the
/// group (`waitpid(-pgid)`) only touches that plugin's processes, never the children tokio waits
/// for (each plugin has a group of its own). It stops as soon as no process of the group is the
/// agent's child (`ECHILD`, at once where the agent is not PID 1 or a subreaper), or after
/// [`REAP_GRACE`] while some still run (a daemon a plugin leaves running is left alone).
async fn reap_group(pgid: u32) {
    use nix::errno::Errno;
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let Ok(pgid) = i32::try_from(pgid) else {
        return;
    };
    let group = nix::unistd::Pid::from_raw(-pgid);
    let deadline = tokio::time::Instant::now() + REAP_GRACE;
    loop {
        match waitpid(group, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {
                if tokio::time::Instant::now() >= deadline {
                    return;
                }
                tokio::time::sleep(REAP_POLL).await;
            }
            // One reaped; there may be more.
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => return,
        }
    }
}

/// Reads up to [`MAX_READ_BYTES`] and drains the rest, so a flood neither grows memory nor
/// blocks the plugin on a full pipe.
async fn read_bounded(reader: &mut (impl AsyncRead + Unpin)) -> Vec<u8> {
    let mut kept = Vec::with_capacity(256);
    let mut buf = [0u8; 8192];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => return kept,
            Ok(n) => {
                let room = MAX_READ_BYTES - kept.len();
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
}

fn cut(text: &str, max: usize) -> String {
    // NPD cuts at a byte index; here the cut lands on a character boundary and adds no marker,
    // so the message stays within max_output_length.
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}
