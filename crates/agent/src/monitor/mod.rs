//! Node problem monitors that read node-problem-detector's (NPD) own configuration files: the
//! kernel-log monitor (`plugin: "kmsg"` rule files), the journal monitor (`plugin: "journald"`
//! rule files and NPD's `log-counter` restart counters) and custom plugins (`plugin: "custom"`),
//! feeding one bounded [`state::ProblemState`] that the report reads.
//!
//! The built-in rules are NPD v1.36.0's `config/kernel-monitor.json`,
//! `config/readonly-monitor.json`, `config/systemd-monitor.json` and
//! `config/systemd-monitor-counter.json` (github.com/kubernetes/node-problem-detector, tag
//! v1.36.0, commit 19d58b0e), kept as data in `defaults/` with the same condition types, reasons,
//! patterns and polarity, so alerts and remediation keyed on NPD's conditions keep working. A
//! file in the configuration directory with the same `source` replaces a built-in one.
//!
//! NPD's `KernelOops` rules match only the wording of kernels before 5.2 on builds without
//! PREEMPT or page-table isolation. `defaults/kernel-monitor-modern.json` (source
//! `kernel-monitor-modern`, ours, not NPD's) adds the same reason for today's wording, so the
//! NPD-derived files stay byte for byte NPD's.

pub mod health;
pub mod journal;
pub mod kmsg;
pub mod metrics;
pub mod persist;
pub mod plugin;
pub mod rules;
pub mod state;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nodekeeper_proto::agent::v1 as pb;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use plugin::PluginMonitor;
use rules::{LogMonitor, RuleRefusal};
use state::{ProblemState, SharedState, lock};

/// The node-problem-detector release the built-in rules come from (its Go module version).
pub const NPD_VERSION: &str = "v1.36.0";
/// NPD v1.36.0 `config/kernel-monitor.json`.
pub const DEFAULT_KERNEL_MONITOR: &str = include_str!("defaults/kernel-monitor.json");
/// NPD v1.36.0 `config/readonly-monitor.json`.
pub const DEFAULT_READONLY_MONITOR: &str = include_str!("defaults/readonly-monitor.json");
/// `KernelOops` for kernels NPD's rules miss: x86 `show_fault_oops()` since 5.2 and
/// `__die_header()` with PREEMPT, PTI/NOPTI and (6.9 on) the `Oops: ` prefix.
pub const DEFAULT_KERNEL_MONITOR_MODERN: &str = include_str!("defaults/kernel-monitor-modern.json");
/// NPD v1.36.0 `config/systemd-monitor.json` (journald: kubelet/runtime starts as Events).
pub const DEFAULT_SYSTEMD_MONITOR: &str = include_str!("defaults/systemd-monitor.json");
/// NPD v1.36.0 `config/systemd-monitor-counter.json` (`FrequentKubeletRestart`,
/// `FrequentDockerRestart`, `FrequentContainerdRestart` from journal restart counts).
pub const DEFAULT_SYSTEMD_MONITOR_COUNTER: &str =
    include_str!("defaults/systemd-monitor-counter.json");

/// Configuration files read from a directory at most; more are refused.
const MAX_FILES: usize = 64;
/// Larger configuration files are refused.
const MAX_FILE_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("parse monitor file {origin}: {reason}")]
    ParseFile { origin: String, reason: String },
    #[error("monitor file {origin}: field {field}: {reason}")]
    InvalidFile {
        origin: String,
        field: String,
        reason: String,
    },
}

/// Parses a Go duration (`300ms`, `5m`, `1h30m`, `1.5s`) as NPD's files write them.
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration like \"30s\", \"5m\" or \"1h30m\"");
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let mut rest = text;
    let mut total = 0f64;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let value: f64 = rest[..num_end].parse().map_err(|_| bad())?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += value * scale;
        rest = &rest[unit_end..];
    }
    // Go's time.Duration is an int64 of nanoseconds; NPD refuses anything longer, and a longer
    // one here would overflow the time arithmetic it feeds (boot + delay).
    if total > GO_MAX_DURATION_SECS {
        return Err(format!(
            "{text:?} is longer than the longest duration Go accepts (2562047h47m16.854775807s)"
        ));
    }
    Duration::try_from_secs_f64(total).map_err(|_| bad())
}

/// Go's longest `time.Duration` (`math.MaxInt64` nanoseconds, 2562047h47m16.854775807s) in
/// seconds, as near as an f64 gets.
#[allow(clippy::cast_precision_loss)]
const GO_MAX_DURATION_SECS: f64 = i64::MAX as f64 / 1e9;

/// `t + d`, or far in the future (a hundred years after `t`) where that is not representable:
/// a start time that never comes, rather than a panic.
pub(crate) fn add_or_never(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(t)
}

/// The fields every NPD monitor file has.
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct MonitorFile {
    #[serde(default)]
    pub plugin: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub conditions: Vec<state::ConditionDefault>,
    /// Parsed one by one, so that one bad rule is refused alone.
    #[serde(default)]
    pub rules: Vec<serde_json::Value>,
}

impl MonitorFile {
    /// Checks the fields both kinds of file share; `plugin` must be `expected`.
    fn checked(self, origin: &str, expected: &str) -> Result<MonitorFile, MonitorError> {
        if self.plugin != expected {
            return Err(invalid(
                origin,
                "plugin",
                format!(
                    "{:?} where {expected:?} was expected; nodekeeper reads the kernel log \
                     (\"kmsg\"), the journal (\"journald\") and runs custom plugins (\"custom\")",
                    self.plugin
                ),
            ));
        }
        if self.source.is_empty() {
            return Err(invalid(
                origin,
                "source",
                "must name the monitor (e.g. \"kernel-monitor\")".into(),
            ));
        }
        Ok(self)
    }
}

fn invalid(origin: &str, field: &str, reason: String) -> MonitorError {
    MonitorError::InvalidFile {
        origin: origin.to_owned(),
        field: field.to_owned(),
        reason,
    }
}

fn parse_json<T: serde::de::DeserializeOwned>(
    origin: &str,
    json: &[u8],
) -> Result<T, MonitorError> {
    serde_json::from_slice(json).map_err(|e| MonitorError::ParseFile {
        origin: origin.to_owned(),
        reason: e.to_string(),
    })
}

/// Where the monitors read from.
#[derive(Clone, Debug, Default)]
pub struct MonitorConfig {
    /// The kernel log (`/dev/kmsg`); `None` turns the kernel-log monitor off.
    pub kmsg_path: Option<PathBuf>,
    /// A directory of NPD `*.json` monitor files (kmsg rule files and custom-plugin files).
    pub config_dir: Option<PathBuf>,
    /// The journal (service rules and restart counters); `None` turns the journal monitor off.
    pub journal: Option<journal::JournalConfig>,
    /// The built-in kubelet and container-runtime checks; `None` turns them off.
    pub health: Option<health::HealthConfig>,
    /// Where `/metrics` (NPD's problem metrics) is served; `None`: not served.
    pub metrics: Option<std::net::SocketAddr>,
    /// The agent's state directory, where the kernel-log monitor keeps its `True` conditions
    /// across restarts on one boot; `None`: not kept.
    pub state_dir: Option<PathBuf>,
}

/// The monitor files that loaded.
#[derive(Debug, Default)]
pub struct Loaded {
    /// `kmsg` rule files.
    pub log_monitors: Vec<LogMonitor>,
    /// `journald` rule files.
    pub journal_monitors: Vec<LogMonitor>,
    /// `log-counter` rules of custom-plugin files, counted from the journal.
    pub counters: Vec<journal::Counter>,
    pub plugin_monitors: Vec<PluginMonitor>,
}

impl Loaded {
    /// Adds a log monitor to its list, replacing a loaded one with the same `source`.
    fn add_log_monitor(&mut self, m: LogMonitor) {
        let list = if m.identifier.is_some() {
            &mut self.journal_monitors
        } else {
            &mut self.log_monitors
        };
        list.retain(|old| old.source != m.source);
        list.push(m);
    }

    /// Adds a custom-plugin file: its `log-counter` rules become journal counters (replacing
    /// those of a loaded file with the same `source`), the rest runs as plugins.
    fn add_plugin_monitor(&mut self, origin: &str, mut m: PluginMonitor, state: &mut ProblemState) {
        let rules = std::mem::take(&mut m.log_counters);
        if !rules.is_empty() {
            self.counters.retain(|c| c.source != m.source);
        }
        for (i, rule) in rules.iter().enumerate() {
            match journal::Counter::from_rule(&m.source, rule, &m.conditions) {
                Ok(c) => self.counters.push(c),
                Err(reason) => state.refuse(
                    origin,
                    &format!("log-counter {i} ({})", rule.reason),
                    &reason,
                ),
            }
        }
        if m.rule_count() > 0 || rules.is_empty() {
            self.plugin_monitors.push(m);
        }
    }
}

fn record_refusals(state: &mut ProblemState, origin: &str, refusals: Vec<RuleRefusal>) {
    for r in refusals {
        state.refuse(origin, &r.item, &r.reason);
    }
}

/// Loads the built-in rule files and those in `dir`. Whatever is refused (a whole file or one
/// rule) is listed in `state` with the reason; the rest loads.
pub fn load(dir: Option<&Path>, state: &mut ProblemState) -> Loaded {
    let mut loaded = Loaded::default();
    for (origin, json) in [
        ("builtin:kernel-monitor.json", DEFAULT_KERNEL_MONITOR),
        ("builtin:readonly-monitor.json", DEFAULT_READONLY_MONITOR),
        (
            "builtin:kernel-monitor-modern.json",
            DEFAULT_KERNEL_MONITOR_MODERN,
        ),
        ("builtin:systemd-monitor.json", DEFAULT_SYSTEMD_MONITOR),
        (
            "builtin:systemd-monitor-counter.json",
            DEFAULT_SYSTEMD_MONITOR_COUNTER,
        ),
    ] {
        load_one(origin, json.as_bytes(), state, &mut loaded);
    }
    let Some(dir) = dir else { return loaded };
    let mut files = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect::<Vec<_>>(),
        Err(e) => {
            state.refuse(
                &dir.display().to_string(),
                "",
                &format!("read monitor directory: {e}"),
            );
            return loaded;
        }
    };
    files.sort();
    for (i, path) in files.into_iter().enumerate() {
        let origin = path.display().to_string();
        if i >= MAX_FILES {
            state.refuse(
                &origin,
                "",
                &format!("more than {MAX_FILES} monitor files; not read"),
            );
            continue;
        }
        match read_file(&path) {
            Ok(bytes) => load_one(&origin, &bytes, state, &mut loaded),
            Err(reason) => state.refuse(&origin, "", &reason),
        }
    }
    loaded
}

fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("read: {e}"))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "{} bytes is more than {MAX_FILE_BYTES}",
            meta.len()
        ));
    }
    std::fs::read(path).map_err(|e| format!("read: {e}"))
}

/// Loads one file by its `plugin` field; a kmsg file replaces a loaded one with the same `source`.
fn load_one(origin: &str, bytes: &[u8], state: &mut ProblemState, loaded: &mut Loaded) {
    #[derive(serde::Deserialize)]
    struct Kind {
        #[serde(default)]
        plugin: String,
    }
    let kind = match serde_json::from_slice::<Kind>(bytes) {
        Ok(k) => k.plugin,
        Err(e) => {
            state.refuse(origin, "", &format!("not a monitor file: {e}"));
            return;
        }
    };
    match kind.as_str() {
        "kmsg" | "journald" => match LogMonitor::parse(origin, bytes) {
            Ok((m, refusals)) => {
                record_refusals(state, origin, refusals);
                loaded.add_log_monitor(m);
            }
            Err(e) => state.refuse(origin, "", &e.to_string()),
        },
        "custom" => match PluginMonitor::parse(origin, bytes, None) {
            Ok((m, refusals)) => {
                record_refusals(state, origin, refusals);
                loaded.add_plugin_monitor(origin, m, state);
            }
            Err(e) => state.refuse(origin, "", &e.to_string()),
        },
        other => state.refuse(
            origin,
            "plugin",
            &format!(
                "{other:?} is not supported; nodekeeper runs \"kmsg\" and \"journald\" rule \
                 files and \"custom\" plugins"
            ),
        ),
    }
}

/// How long [`start`] waits for the kernel log's backlog to be read.
const CATCH_UP: Duration = Duration::from_secs(5);

/// Loads the monitors into `shared` (their conditions declared healthy) and starts them under
/// `shutdown`: the kernel-log reader on a thread of its own (stopped through its flag), each
/// plugin file as a task on `tasks`. Returns once the kernel log's backlog (the lookback window)
/// has been read, or after 5 s, so the first report already shows it.
pub async fn start(
    config: &MonitorConfig,
    shared: &SharedState,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
) {
    let loaded = load(config.config_dir.as_deref(), &mut lock(shared));
    {
        let mut state = lock(shared);
        let now = SystemTime::now();
        for m in &loaded.log_monitors {
            m.declare(&mut state, now);
        }
        for m in &loaded.plugin_monitors {
            m.declare(&mut state, now);
        }
    }
    tracing::info!(
        kernel_rule_files = loaded.log_monitors.len(),
        journal_rule_files = loaded.journal_monitors.len(),
        journal_counters = loaded.counters.len(),
        plugin_files = loaded.plugin_monitors.len(),
        kmsg = ?config.kmsg_path,
        "node problem monitors loaded"
    );
    let boot = kmsg::boot_time().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "boot time unknown; log lookback counts from now");
        SystemTime::now()
    });
    let mut caught_up = Vec::new();
    let stop_on_shutdown = |stop: std::sync::Arc<std::sync::atomic::AtomicBool>| {
        let token = shutdown.clone();
        tasks.spawn(async move {
            token.cancelled().await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    };
    if let Some(path) = &config.kmsg_path {
        let persist = config.state_dir.as_deref().and_then(|dir| {
            persist::boot_id()
                .map_err(|error| {
                    tracing::warn!(%error, "read the boot id; kernel-log conditions are not kept across restarts");
                })
                .ok()
                .map(|id| persist::Persist::new(dir, id))
        });
        let running = kmsg::spawn(path, boot, loaded.log_monitors, shared.clone(), persist);
        stop_on_shutdown(running.stop);
        caught_up.push(running.caught_up);
    }
    if let Some(journal) = &config.journal
        && !(loaded.journal_monitors.is_empty() && loaded.counters.is_empty())
    {
        let running = journal::spawn(
            journal.clone(),
            boot,
            loaded.journal_monitors,
            loaded.counters,
            shared.clone(),
        );
        stop_on_shutdown(running.stop);
        caught_up.push(running.caught_up);
    }
    for m in loaded.plugin_monitors {
        tasks.spawn(m.run(shared.clone(), shutdown.clone()));
    }
    if let Some(h) = &config.health {
        tasks.spawn(health::run(h.clone(), shared.clone(), shutdown.clone()));
    }
    if let Some(addr) = config.metrics {
        match metrics::bind(addr).await {
            Ok(listener) => {
                tasks.spawn(metrics::serve(listener, shared.clone(), shutdown.clone()));
            }
            Err(e) => {
                tracing::error!(%addr, error = %e, "metrics endpoint not served");
                lock(shared).refuse("--metrics-listen", &addr.to_string(), &format!("bind: {e}"));
            }
        }
    }
    if !caught_up.is_empty()
        && tokio::time::timeout(CATCH_UP, futures::future::join_all(caught_up))
            .await
            .is_err()
    {
        tracing::warn!("log backlogs not read within {CATCH_UP:?}; serving meanwhile");
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The report's view of the state.
pub fn to_proto(p: &ProblemState) -> pb::NodeProblems {
    pb::NodeProblems {
        conditions: p
            .conditions()
            .map(|c| pb::ProblemCondition {
                r#type: c.kind.clone(),
                status: c.status.as_str().to_owned(),
                reason: c.reason.clone(),
                message: c.message.clone(),
                source: c.source.clone(),
                transition_unix_ms: unix_ms(c.transition),
            })
            .collect(),
        counts: p
            .counters()
            .iter()
            .map(|(reason, count)| pb::ProblemCount {
                reason: reason.clone(),
                count: *count,
            })
            .collect(),
        recent: p
            .recent()
            .map(|e| pb::ProblemEvent {
                source: e.source.clone(),
                reason: e.reason.clone(),
                message: e.message.clone(),
                timestamp_unix_ms: unix_ms(e.timestamp),
                sequence: e.sequence,
            })
            .collect(),
        refused: p
            .refusals()
            .iter()
            .map(|r| pb::MonitorRefusal {
                origin: r.origin.clone(),
                item: r.item.clone(),
                reason: r.reason.clone(),
            })
            .collect(),
        refused_dropped: p.refusals_dropped(),
        lost_records: p.lost_records(),
        sequence_epoch: p.sequence_epoch(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_go_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_go_duration("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(parse_go_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("0"), Ok(Duration::ZERO));
        assert!(parse_go_duration("5").is_err());
        assert!(parse_go_duration("five minutes").is_err());
        assert!(parse_go_duration("").is_err());
        // Go's limit (int64 nanoseconds): 2562047h is accepted, more is refused, not a panic later.
        assert_eq!(
            parse_go_duration("2562047h"),
            Ok(Duration::from_secs(2_562_047 * 3600))
        );
        for absurd in ["2562048h", "2562047h48m", "99999999999999999999999h"] {
            let err = parse_go_duration(absurd).unwrap_err();
            assert!(err.contains("longest duration"), "{absurd}: {err}");
        }
    }

    #[test]
    fn an_absurd_delay_is_refused_and_never_panics() {
        let err = LogMonitor::parse(
            "d.json",
            br#"{"plugin":"kmsg","source":"s","delay":"2562048h"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("field delay"), "{err}");
        // A delay set past the parser (the fields are public) cannot overflow the start time.
        let (mut m, _) =
            LogMonitor::parse("d.json", br#"{"plugin":"kmsg","source":"s","delay":"1h"}"#).unwrap();
        m.delay = Duration::MAX;
        let now = SystemTime::now();
        assert!(m.start_time(now, now) > now);
    }

    #[test]
    fn builtin_defaults_load_without_refusals() {
        let mut state = ProblemState::default();
        let loaded = load(None, &mut state);
        assert_eq!(state.refusals(), &[]);
        let sources: Vec<_> = loaded
            .log_monitors
            .iter()
            .map(|m| m.source.as_str())
            .collect();
        assert_eq!(
            sources,
            [
                "kernel-monitor",
                "readonly-monitor",
                "kernel-monitor-modern"
            ]
        );
        assert_eq!(loaded.log_monitors[0].rule_count(), 14);
        assert_eq!(loaded.log_monitors[1].rule_count(), 1);
        assert_eq!(loaded.log_monitors[2].rule_count(), 3);
        assert_eq!(loaded.journal_monitors.len(), 1);
        assert_eq!(loaded.journal_monitors[0].source, "systemd-monitor");
        assert_eq!(
            loaded.journal_monitors[0].identifier.as_deref(),
            Some("systemd")
        );
        let counted: Vec<_> = loaded
            .counters
            .iter()
            .map(|c| (c.condition.kind.as_str(), c.threshold, c.lookback, c.delay))
            .collect();
        let m = |n: u64| Duration::from_secs(60 * n);
        assert_eq!(
            counted,
            [
                ("FrequentKubeletRestart", 5, m(20), m(5)),
                ("FrequentDockerRestart", 5, m(20), m(0)),
                ("FrequentContainerdRestart", 5, m(20), m(0)),
            ]
        );
        // The counter file has only log-counter rules: nothing is left to run as a plugin.
        assert!(loaded.plugin_monitors.is_empty());
    }

    #[test]
    fn the_report_carries_the_problems_numbers_and_their_epoch() {
        let mut state = ProblemState::with_epoch(42);
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(10);
        state.record("kernel-monitor", "OOMKilling", "a", t);
        state.record("custom-plugin", "Custom", "b", t - Duration::from_secs(1));
        let p = to_proto(&state);
        assert_eq!(p.sequence_epoch, 42);
        let recent: Vec<_> = p
            .recent
            .iter()
            .map(|e| (e.reason.as_str(), e.sequence, e.timestamp_unix_ms))
            .collect();
        assert_eq!(recent, [("OOMKilling", 1, 10_000), ("Custom", 2, 9_000)]);
    }
}
