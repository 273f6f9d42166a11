//! Oracle Cloud Agent (OCA) plugin state and OCA's version.
//!
//! **What OCA itself writes on the node.** OCA publishes no state file; what it does write is
//! its log, `/var/log/oracle-cloud-agent/agent.log` (Oracle Linux, RPM install) or
//! `/var/snap/oracle-cloud-agent/common/log/agent.log` (Ubuntu, snap install; its plugin
//! executables live under `/var/snap/oracle-cloud-agent/common/`), where its plugin supervisor
//! logs one line per plugin and health check (Go `log` format, UTC on OCI images):
//!
//! ```text
//! 2023/12/29 18:30:48.004902 health.go:107: health check of plugin:[bastions], desiredState:[Enable], currentState:[notStarted], status:[yet to start] version:[v0.0.0] err:[<nil>]
//! ```
//!
//! (as quoted in Canonical's Ubuntu-on-OCI guide, github.com/canonical/ubuntu-cloud-docs,
//! `oracle/oracle-how-to/use-bastion-to-access-VM.rst`; Oracle's "Troubleshooting Oracle Cloud
//! Agent" page, docs.oracle.com/en-us/iaas/Content/Compute/Tasks/manage-plugins-troubleshooting.htm,
//! names the log directories and the package: `rpm -q oracle-cloud-agent` on Oracle Linux,
//! `snap list oracle-cloud-agent` on Ubuntu). The latest line per plugin is its state, its time
//! the `updatedAt`. OCA's version comes from the package: the snap's `meta/snap.yaml`, dpkg's
//! status file, or `rpm -q` where `rpm` is on the agent's PATH.
//!
//! **The fallback** is nodekeeper's own documented format (see the crate README), for nodes where
//! the log is not readable: a small exporter, or the image build, writes one file per plugin named
//! `<anything>.json`:
//!
//! ```json
//! { "name": "Compute Instance Monitoring", "state": "RUNNING",
//!   "message": "", "updatedAt": "2026-11-21T17:00:00Z" }
//! ```
//!
//! `name` and `state` are required; `message` and `updatedAt` are optional; unknown fields are
//! ignored. Only regular files directly in the directory are read: symbolic links, files over
//! 64 KiB and more than 256 files are refused, so the directory cannot point the agent elsewhere.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use nodekeeper_model::indicators::Verdict;

/// Largest plugin file read.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// Most plugin files read.
pub const MAX_FILES: usize = 256;

/// One plugin as written by the exporter.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PluginFile {
    pub name: String,
    pub state: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub updated_at: Option<String>,
}

/// One plugin with its verdict. (Its `updatedAt` is judged, not kept: a time that moves on every
/// health check would change the report's revision each time.)
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plugin {
    pub name: String,
    pub state: String,
    pub message: String,
    pub verdict: Verdict,
    /// The plugin's version where OCA's log gives it.
    pub version: String,
}

/// A plugin whose state was last updated longer ago than this is judged stale (Warning): the
/// agent, or the exporter writing the files, may have stopped.
pub const STALE_AFTER: Duration = Duration::from_secs(15 * 60);

/// Marks `plugin` stale when `updated` is older than [`STALE_AFTER`] (the message names the
/// limit, not the age, so it does not change while the state stays stale).
pub fn judge_staleness(plugin: &mut Plugin, updated: Option<SystemTime>, now: SystemTime) {
    let Some(updated) = updated else { return };
    if now.duration_since(updated).unwrap_or_default() > STALE_AFTER {
        plugin.verdict = plugin.verdict.max(Verdict::Warning);
        let note = format!(
            "state not updated for more than {} minutes",
            STALE_AFTER.as_secs() / 60
        );
        plugin.message = if plugin.message.is_empty() {
            note
        } else {
            format!("{}; {note}", plugin.message)
        };
    }
}

/// Parses an RFC 3339 UTC time (`2026-11-21T17:00:00Z`, fractions allowed) or OCA's log time
/// (`2023/12/29 18:30:48.004902`, UTC).
pub fn parse_time(text: &str) -> Option<SystemTime> {
    let t = text.trim();
    let t = t.strip_suffix('Z').unwrap_or(t);
    let (date, time) = t.split_once(['T', ' '])?;
    let mut d = date.split(['-', '/']).map(|p| p.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut h = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (h.next()??, h.next()??, h.next()??);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&da) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + da - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days * 86_400 + hh * 3600 + mm * 60 + ss).ok()?;
    let micros: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros))
}

/// Judges a plugin's state word. A disabled plugin was turned off on purpose, so it is fine;
/// a stopped one may be restarting; invalid or failed ones need attention.
pub fn judge(state: &str) -> (Verdict, Option<String>) {
    match state.to_ascii_uppercase().as_str() {
        "RUNNING" | "DISABLED" => (Verdict::Ok, None),
        "STOPPED" | "STARTING" | "STOPPING" => {
            (Verdict::Warning, Some(format!("plugin is {state}")))
        }
        "INVALID" | "FAILED" | "ERROR" | "CRASHED" => {
            (Verdict::Critical, Some(format!("plugin is {state}")))
        }
        _ => (
            Verdict::Warning,
            Some(format!("unknown plugin state {state:?}")),
        ),
    }
}

/// Parses one plugin file (its `updatedAt` judged against `now`).
pub fn parse_at(text: &str, now: SystemTime) -> Result<Plugin, String> {
    let updated = serde_json::from_str::<PluginFile>(text)
        .ok()
        .and_then(|f| f.updated_at)
        .map(|t| parse_time(&t).ok_or_else(|| format!("updatedAt {t:?} is not an RFC 3339 time")))
        .transpose()?;
    let mut plugin = parse(text)?;
    judge_staleness(&mut plugin, updated, now);
    Ok(plugin)
}

/// Parses one plugin file.
pub fn parse(text: &str) -> Result<Plugin, String> {
    let file: PluginFile =
        serde_json::from_str(text).map_err(|e| format!("not a plugin state object: {e}"))?;
    if file.name.trim().is_empty() {
        return Err("field `name` is empty".into());
    }
    if file.state.trim().is_empty() {
        return Err("field `state` is empty".into());
    }
    let (verdict, why) = judge(file.state.trim());
    let message = match (why, file.message.trim()) {
        (None, m) => m.to_string(),
        (Some(w), "") => w,
        (Some(w), m) => format!("{w}: {m}"),
    };
    Ok(Plugin {
        name: file.name.trim().to_string(),
        state: file.state.trim().to_string(),
        message,
        verdict,
        version: String::new(),
    })
}

/// Per-file failures: (file name, reason).
pub type FileErrors = Vec<(String, String)>;

/// Reads the directory: plugins sorted by name, and per-file failures.
pub fn collect(dir: &Path) -> Result<(Vec<Plugin>, FileErrors), std::io::Error> {
    collect_at(dir, SystemTime::now())
}

/// [`collect`] with staleness judged against `now`.
pub fn collect_at(
    dir: &Path,
    now: SystemTime,
) -> Result<(Vec<Plugin>, FileErrors), std::io::Error> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .collect();
    entries.sort_by_key(std::fs::DirEntry::file_name);
    let mut plugins = Vec::new();
    let mut errors = Vec::new();
    if entries.len() > MAX_FILES {
        errors.push((
            dir.display().to_string(),
            format!(
                "{} plugin files; only the first {MAX_FILES} are read",
                entries.len()
            ),
        ));
        entries.truncate(MAX_FILES);
    }
    for entry in entries {
        let file = entry.file_name().to_string_lossy().into_owned();
        let outcome = (|| {
            // symlink_metadata: a link is refused rather than followed.
            let meta = std::fs::symlink_metadata(entry.path()).map_err(|e| e.to_string())?;
            if !meta.file_type().is_file() {
                return Err("not a regular file (symbolic links are not followed)".to_string());
            }
            if meta.len() > MAX_FILE_BYTES {
                return Err(format!(
                    "{} bytes; at most {MAX_FILE_BYTES} are read",
                    meta.len()
                ));
            }
            parse_at(
                &std::fs::read_to_string(entry.path()).map_err(|e| e.to_string())?,
                now,
            )
        })();
        match outcome {
            Ok(p) => plugins.push(p),
            Err(e) => errors.push((file, e)),
        }
    }
    plugins.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((plugins, errors))
}

/// The end of OCA's log read (the health lines repeat, so the latest of each plugin is near the
/// end; a log rotated moments ago may hold none yet).
pub const LOG_TAIL_BYTES: u64 = 256 * 1024;

/// One health-check line of OCA's `agent.log`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthLine {
    pub at: Option<SystemTime>,
    pub plugin: String,
    pub desired: String,
    pub current: String,
    pub status: String,
    pub version: String,
    pub err: String,
}

/// The text between `key[` and the next `]`.
fn bracketed<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(key)? + key.len();
    let rest = &line[start..];
    Some(&rest[..rest.find(']')?])
}

/// Parses a `health check of plugin:[…]` line; `None` for any other line.
pub fn parse_health_line(line: &str) -> Option<HealthLine> {
    if !line.contains("health check of plugin:[") {
        return None;
    }
    // `2023/12/29 18:30:48.004902 health.go:107: …`: the first two words are the time.
    let mut words = line.split_whitespace();
    let at = match (words.next(), words.next()) {
        (Some(d), Some(t)) => parse_time(&format!("{d} {t}")),
        _ => None,
    };
    Some(HealthLine {
        at,
        plugin: bracketed(line, "plugin:[")?.to_owned(),
        desired: bracketed(line, "desiredState:[").unwrap_or("").to_owned(),
        current: bracketed(line, "currentState:[").unwrap_or("").to_owned(),
        status: bracketed(line, "status:[").unwrap_or("").to_owned(),
        version: bracketed(line, "version:[").unwrap_or("").to_owned(),
        err: bracketed(line, "err:[").unwrap_or("").to_owned(),
    })
}

/// Judges one health line: a plugin OCA was told to disable is fine whatever it does; an enabled
/// one must be running; an error reported with a plugin that is not running is critical.
pub fn judge_health(h: &HealthLine) -> Plugin {
    let disabled = h.desired.eq_ignore_ascii_case("disable");
    let running = h.current.eq_ignore_ascii_case("running");
    let err = match h.err.trim() {
        "" | "<nil>" => "",
        e => e,
    };
    let (state, verdict) = if disabled {
        ("DISABLED".to_owned(), Verdict::Ok)
    } else if running {
        ("RUNNING".to_owned(), Verdict::Ok)
    } else if !err.is_empty() {
        (h.current.clone(), Verdict::Critical)
    } else {
        (h.current.clone(), Verdict::Warning)
    };
    let message = match (verdict, err) {
        (Verdict::Ok, _) => String::new(),
        (_, "") => format!("plugin is {}: {}", h.current, h.status),
        (_, e) => format!("plugin is {}: {}: {e}", h.current, h.status),
    };
    Plugin {
        name: h.plugin.clone(),
        state,
        message,
        verdict,
        version: h.version.clone(),
    }
}

/// Reads the last [`LOG_TAIL_BYTES`] of OCA's log: the latest state of each plugin (sorted by
/// name, staleness judged against `now`). `Ok(None)` when the log has no health line.
pub fn collect_log(path: &Path, now: SystemTime) -> std::io::Result<Option<Vec<Plugin>>> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))?;
    let mut tail = Vec::new();
    file.take(LOG_TAIL_BYTES).read_to_end(&mut tail)?;
    let text = String::from_utf8_lossy(&tail);
    let mut latest = std::collections::BTreeMap::new();
    for line in text.lines() {
        if let Some(h) = parse_health_line(line) {
            latest.insert(h.plugin.clone(), h);
        }
    }
    if latest.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        latest
            .values()
            .map(|h| {
                let mut p = judge_health(h);
                judge_staleness(&mut p, h.at, now);
                p
            })
            .collect(),
    ))
}

/// Where OCA's own files are looked for (each under the host root).
pub const AGENT_LOGS: &[&str] = &[
    "/var/log/oracle-cloud-agent/agent.log",
    "/var/snap/oracle-cloud-agent/common/log/agent.log",
];
const SNAP_META: &str = "/snap/oracle-cloud-agent/current/meta/snap.yaml";
const DPKG_STATUS: &str = "/var/lib/dpkg/status";

/// How long a version read from the package files is reused (dpkg's status file is large and
/// `rpm` is a process; reports are collected up to once a second).
const VERSION_TTL: Duration = Duration::from_secs(600);

/// [`version`], reused for [`VERSION_TTL`].
pub fn cached_version(host_root: &Path) -> String {
    type Cached = Option<(std::time::Instant, PathBuf, String)>;
    static CACHE: std::sync::Mutex<Cached> = std::sync::Mutex::new(None);
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((at, root, v)) = cache.as_ref()
        && root == host_root
        && at.elapsed() < VERSION_TTL
    {
        return v.clone();
    }
    let v = version(host_root);
    *cache = Some((std::time::Instant::now(), host_root.to_owned(), v.clone()));
    v
}

/// OCA's installed version from its package, or empty.
pub fn version(host_root: &Path) -> String {
    let under = |p: &str| host_root.join(p.trim_start_matches('/'));
    if let Ok(meta) = std::fs::read_to_string(under(SNAP_META))
        && let Some(v) = meta.lines().find_map(|l| l.strip_prefix("version:"))
    {
        return v.trim().trim_matches(['\'', '"']).to_owned();
    }
    if let Ok(status) = std::fs::read_to_string(under(DPKG_STATUS))
        && let Some(v) = status
            .split("\n\n")
            .find(|stanza| stanza.lines().any(|l| l == "Package: oracle-cloud-agent"))
            .and_then(|stanza| stanza.lines().find_map(|l| l.strip_prefix("Version: ")))
    {
        return v.trim().to_owned();
    }
    rpm_version(host_root).unwrap_or_default()
}

fn rpm_version(host_root: &Path) -> Option<String> {
    let rpm = super::gpu::locate(Path::new("rpm"))?;
    let out = std::process::Command::new(rpm)
        .arg(format!("--root={}", host_root.display()))
        .args(["-q", "--qf", "%{VERSION}-%{RELEASE}", "oracle-cloud-agent"])
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Where OCA state is read.
#[derive(Clone, Debug, Default)]
pub struct OcaConfig {
    /// The host's root as the agent sees it (OCA's log and package files are under it).
    pub host_root: PathBuf,
    /// nodekeeper's plugin-file directory, read where OCA's log is not found.
    pub plugin_dir: Option<PathBuf>,
}

/// What was found about OCA.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OcaReading {
    pub plugins: Vec<Plugin>,
    /// (file, reason) per file that could not be read.
    pub errors: FileErrors,
    /// OCA's package version, or empty.
    pub version: String,
    /// Where the plugin states came from: the log's path, the plugin directory, or empty.
    pub source: String,
}

/// OCA's log first, the plugin-file directory as the fallback. No OCA on the node is an empty
/// reading, not an error.
pub fn collect_all(config: &OcaConfig, now: SystemTime) -> OcaReading {
    let mut reading = OcaReading {
        version: cached_version(&config.host_root),
        ..OcaReading::default()
    };
    for log in AGENT_LOGS {
        let path = config.host_root.join(log.trim_start_matches('/'));
        match collect_log(&path, now) {
            Ok(Some(plugins)) => {
                reading.plugins = plugins;
                reading.source = log.to_string();
                return reading;
            }
            Ok(None) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => reading.errors.push((log.to_string(), format!("read: {e}"))),
        }
    }
    if let Some(dir) = &config.plugin_dir {
        match collect_at(dir, now) {
            Ok((plugins, errors)) => {
                reading.plugins = plugins;
                reading.errors.extend(errors);
                reading.source = dir.display().to_string();
            }
            Err(e) => reading
                .errors
                .push((dir.display().to_string(), format!("read: {e}"))),
        }
    }
    reading
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oca")
    }

    #[test]
    fn reads_shipped_fixtures() {
        // Within 15 minutes of every fixture's updatedAt (16:40 to 17:00): none is stale.
        let now = parse_time("2026-11-21T16:54:00Z").unwrap();
        let (plugins, errors) = collect_at(&fixtures(), now).unwrap();
        let names: Vec<_> = plugins
            .iter()
            .map(|p| (p.name.as_str(), p.verdict))
            .collect();
        assert_eq!(
            names,
            vec![
                ("Compute Instance Monitoring", Verdict::Ok),
                ("Compute Instance Run Command", Verdict::Ok),
                ("Custom Logs Monitoring", Verdict::Warning),
                ("OS Management Service Agent", Verdict::Critical),
            ]
        );
        assert_eq!(
            plugins[3].message,
            "plugin is INVALID: unable to reach the service endpoint"
        );
        // The fixture set includes one broken file, reported by name, not failing the rest.
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, "zz-broken.json");
        assert!(errors[0].1.contains("state"), "{errors:?}");
    }

    #[test]
    fn refuses_links_and_large_files() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("link.json")).unwrap();
        std::fs::write(
            dir.path().join("big.json"),
            vec![b' '; MAX_FILE_BYTES as usize + 1],
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let (plugins, errors) = collect(dir.path()).unwrap();
        assert!(plugins.is_empty());
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors
                .iter()
                .any(|(f, e)| f == "link.json" && e.contains("symbolic"))
        );
        assert!(
            errors
                .iter()
                .any(|(f, e)| f == "big.json" && e.contains("bytes"))
        );
    }

    #[test]
    fn judges_states() {
        assert_eq!(judge("RUNNING").0, Verdict::Ok);
        assert_eq!(judge("disabled").0, Verdict::Ok);
        assert_eq!(judge("STOPPED").0, Verdict::Warning);
        assert_eq!(judge("INVALID").0, Verdict::Critical);
        assert_eq!(judge("SLEEPING").0, Verdict::Warning);
        assert!(
            parse(r#"{"name":"","state":"RUNNING"}"#)
                .unwrap_err()
                .contains("name")
        );
        assert!(parse("[]").is_err());
    }

    #[test]
    fn times_as_oca_and_rfc3339_write_them() {
        let t = |s| {
            parse_time(s).map(|t| {
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap()
                    .as_micros()
            })
        };
        assert_eq!(t("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(t("2026-11-21T17:00:00Z"), Some(1_795_280_400_000_000));
        assert_eq!(t("2026/11/21 17:00:00.000250"), Some(1_795_280_400_000_250));
        assert_eq!(t("2024-02-29T12:00:00.5Z"), Some(1_709_208_000_500_000));
        assert_eq!(t("yesterday"), None);
        assert_eq!(t("2026-13-01T00:00:00Z"), None);
    }

    #[test]
    fn a_stale_plugin_file_is_a_warning_with_a_steady_message() {
        let text = r#"{"name":"Compute Instance Monitoring","state":"RUNNING","updatedAt":"2026-11-21T17:00:00Z"}"#;
        let at = |m: u64| parse_time("2026-11-21T17:00:00Z").unwrap() + Duration::from_secs(60 * m);
        assert_eq!(parse_at(text, at(5)).unwrap().verdict, Verdict::Ok);
        let stale = parse_at(text, at(20)).unwrap();
        assert_eq!(stale.verdict, Verdict::Warning);
        assert_eq!(stale.message, "state not updated for more than 15 minutes");
        assert_eq!(parse_at(text, at(90)).unwrap(), stale);
        let bad = r#"{"name":"X","state":"RUNNING","updatedAt":"noon"}"#;
        assert!(parse_at(bad, at(0)).unwrap_err().contains("updatedAt"));
    }

    #[test]
    fn oca_health_lines() {
        let h = parse_health_line(
            "2023/12/29 18:30:48.004902 health.go:107: health check of plugin:[bastions], \
             desiredState:[Enable], currentState:[notStarted], status:[yet to start] \
             version:[v0.0.0] err:[<nil>]",
        )
        .unwrap();
        assert_eq!(
            (h.plugin.as_str(), h.desired.as_str(), h.current.as_str()),
            ("bastions", "Enable", "notStarted")
        );
        assert_eq!(
            (h.status.as_str(), h.err.as_str()),
            ("yet to start", "<nil>")
        );
        assert_eq!(h.at, parse_time("2023-12-29T18:30:48.004902Z"));
        let p = judge_health(&h);
        assert_eq!(
            (p.state.as_str(), p.verdict),
            ("notStarted", Verdict::Warning)
        );
        assert_eq!(p.message, "plugin is notStarted: yet to start");
        assert!(
            parse_health_line("2023/12/29 18:30:48 health.go:137: starting plugin:[x]").is_none()
        );
    }

    #[test]
    fn reads_the_agent_log_then_falls_back_to_the_plugin_files() {
        let (empty, root) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let now = parse_time("2026-11-21T17:05:00Z").unwrap();
        // No OCA at all: nothing, and no error.
        let config = OcaConfig {
            host_root: empty.path().to_owned(),
            plugin_dir: None,
        };
        assert_eq!(collect_all(&config, now), OcaReading::default());
        // Only the plugin files: they are read.
        let with_dir = OcaConfig {
            plugin_dir: Some(fixtures()),
            ..config.clone()
        };
        let r = collect_all(&with_dir, now);
        assert_eq!(r.plugins.len(), 4);
        assert_eq!(r.source, fixtures().display().to_string());
        // OCA's log (snap layout) and its snap metadata: the log wins.
        let with_dir = OcaConfig {
            host_root: root.path().to_owned(),
            ..with_dir
        };
        let log_dir = root.path().join("var/snap/oracle-cloud-agent/common/log");
        std::fs::create_dir_all(&log_dir).unwrap();
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/oca-log/agent.log"),
            log_dir.join("agent.log"),
        )
        .unwrap();
        let meta = root.path().join("snap/oracle-cloud-agent/current/meta");
        std::fs::create_dir_all(&meta).unwrap();
        std::fs::write(
            meta.join("snap.yaml"),
            "name: oracle-cloud-agent\nversion: '1.51.0-12'\n",
        )
        .unwrap();
        let r = collect_all(&with_dir, now);
        assert_eq!(
            r.source,
            "/var/snap/oracle-cloud-agent/common/log/agent.log"
        );
        assert_eq!(r.version, "1.51.0-12");
        let got: Vec<_> = r
            .plugins
            .iter()
            .map(|p| {
                (
                    p.name.as_str(),
                    p.state.as_str(),
                    p.verdict,
                    p.version.as_str(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("bastions", "RUNNING", Verdict::Ok, "1.51.0"),
                ("gomon", "RUNNING", Verdict::Ok, "1.51.0"),
                ("oci-hpc", "RUNNING", Verdict::Ok, "2.1.0"),
                ("osms", "DISABLED", Verdict::Ok, "v0.0.0"),
                ("runcommand", "stopped", Verdict::Critical, "1.51.0"),
            ]
        );
        assert_eq!(
            r.plugins[4].message,
            "plugin is stopped: exited: exit status 2"
        );
        // Twenty minutes on, every plugin is stale.
        let later = now + Duration::from_secs(20 * 60);
        let r = collect_all(&with_dir, later);
        assert!(
            r.plugins.iter().all(|p| p.verdict >= Verdict::Warning),
            "{r:?}"
        );
    }

    #[test]
    fn version_from_dpkg_status() {
        let root = tempfile::tempdir().unwrap();
        let dpkg = root.path().join("var/lib/dpkg");
        std::fs::create_dir_all(&dpkg).unwrap();
        std::fs::write(
            dpkg.join("status"),
            "Package: bash\nVersion: 5.2\n\nPackage: oracle-cloud-agent\nStatus: install ok installed\nVersion: 1.50.0-3\n",
        )
        .unwrap();
        assert_eq!(version(root.path()), "1.50.0-3");
    }
}
