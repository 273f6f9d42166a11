//! Sysctl tunables: validation of the controller's rule set (with the tuning model's own checks
//! and limits, `nodekeeper_model::tuning`, plus what only the node can tell: whether the key
//! exists here), evaluation against `/proc/sys`,
//! repair with a per-rule rate limit, conflict detection (someone else changed a repaired key
//! back: the agent backs off), and persistence of the rules and repair history in a state file
//! written atomically.
//!
//! The state file also keeps, per sysctl key, what uninstall puts back ([`KeyRecord`]): the value
//! found before nodekeeper's first repair and the value it wrote last. That record is kept apart
//! from the rules on purpose: rules change and go (repair switched off, a bound edited, a rule
//! deleted), and each change starts a rule's runtime afresh, but the value nodekeeper left on the
//! node stays until someone changes it.

use std::collections::{BTreeMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use nodekeeper_model::indicators::{Threshold, Verdict, check_threshold};
use nodekeeper_model::tuning::{
    self, MAX_RULES, MAX_THRESHOLDS, check_repair_max_per_hour, check_repairable, check_rule_name,
    check_sysctl_key, check_values, normalize_value,
};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::error::Error;

/// The window of the repair rate limit.
const HOUR_MS: i64 = 3_600_000;
/// Name of the state file inside `--state-dir`.
pub const STATE_FILE: &str = "rules.json";

/// How a rule compares the key's value with its expected values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Comparison {
    Equal,
    AtLeast,
    AtMost,
    OneOf,
}

/// One validated rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub name: String,
    pub key: String,
    pub comparison: Comparison,
    /// Whitespace-normalised.
    pub values: Vec<String>,
    pub repair: bool,
    /// At least 1.
    pub repair_max_per_hour: u32,
    /// Warning or Critical.
    pub severity: Verdict,
}

/// A validated rule set as installed by `SetRules`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuleSet {
    pub revision: u64,
    pub rules: Vec<Rule>,
    pub thresholds: Vec<Threshold>,
}

/// A rule as received, before validation. Enum fields carry the proto's numbers so that an
/// unknown number can be named in the error.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RawRule {
    pub name: String,
    pub key: String,
    /// `Comparison` in the proto: 0 unspecified, 1 equal, 2 at least, 3 at most, 4 one of.
    pub comparison: i32,
    pub values: Vec<String>,
    pub repair: bool,
    pub repair_max_per_hour: u32,
    /// `Verdict` in the proto: 0 unspecified (= warning), 1 ok, 2 warning, 3 critical.
    pub severity: i32,
}

/// A rule set as received.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RawRuleSet {
    pub revision: u64,
    pub rules: Vec<RawRule>,
    pub thresholds: Vec<Threshold>,
}

/// One rule's outcome in the report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct TunableStatus {
    pub rule: String,
    pub key: String,
    pub current: String,
    pub verdict: Verdict,
    pub expected: String,
    pub previous: String,
    pub repaired_at_unix_ms: i64,
    pub conflict: bool,
    pub error: String,
}

/// What the agent remembers about one rule between evaluations (and restarts).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleRuntime {
    /// The value found before the last repair.
    pub previous: String,
    pub repaired_at_unix_ms: i64,
    /// The value the agent last wrote, while it still stands.
    pub written: Option<String>,
    /// Someone changed a repaired value back; no more repairs until the rule changes.
    pub conflict: bool,
    /// Repair times within the last hour, for the rate limit.
    pub repairs_unix_ms: Vec<i64>,
    /// The kernel's boot id (`kernel/random/boot_id`) when `written` and `conflict` were last
    /// judged. A reboot resets `/proc/sys`, so a value written in an earlier boot no longer
    /// stands and a boot-default value is nobody "changing it back"; empty in files written
    /// before this field existed, which are judged as from another boot.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
}

/// The kernel's boot id under `sysctl_root` (`kernel/random/boot_id`); None where the tree has
/// none (a test's fake tree), and then nothing is judged by it.
fn boot_id(sysctl_root: &Path) -> Option<String> {
    std::fs::read_to_string(sysctl_root.join("kernel/random/boot_id"))
        .ok()
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
}

/// Starts a rule's runtime on a new boot: nodekeeper's last write and a conflict over it belong
/// to the boot they happened in. The repair times stay, so the hourly rate limit still counts
/// repairs made before the reboot. True when something the state file holds changed.
fn enter_boot(rt: &mut RuleRuntime, boot: &str) -> bool {
    if rt.boot_id == boot {
        return false;
    }
    let stale = rt.written.is_some() || rt.conflict;
    if stale {
        info!(previous_boot = %rt.boot_id, boot, "the node rebooted; forgetting the value written before it");
    }
    rt.written = None;
    rt.conflict = false;
    rt.boot_id = boot.to_owned();
    stale
}

/// What nodekeeper's repairs did to one sysctl key, whatever rules come and go: what
/// `nodekeeper-agent --cleanup` restores.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// The value found before nodekeeper's first repair of the key (or, when someone else
    /// changed the key after a repair, before the next repair: their value is the one to keep).
    pub original: String,
    /// The value nodekeeper wrote last, as the kernel read it back.
    pub written: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct StateFile {
    version: u32,
    rules: RuleSet,
    runtime: BTreeMap<String, RuleRuntime>,
    /// Per sysctl key. Absent in files written before the record existed: then it is rebuilt
    /// from the rules' runtimes ([`legacy_records`]), the best those files know. Unknown fields
    /// are ignored by serde, so an older agent still loads a newer file.
    #[serde(default)]
    repaired: Option<BTreeMap<String, KeyRecord>>,
}

impl StateFile {
    fn take_records(&mut self) -> BTreeMap<String, KeyRecord> {
        self.repaired
            .take()
            .unwrap_or_else(|| legacy_records(&self.rules, &self.runtime))
    }
}

fn refuse(index: usize, name: &str, field: &str, reason: impl std::fmt::Display) -> Error {
    let who = if name.is_empty() {
        format!("rule #{}", index + 1)
    } else {
        format!("rule {name:?} (#{})", index + 1)
    };
    Error::InvalidRules(format!("{who}: field `{field}`: {reason}"))
}

/// Why a key names no sysctl file on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyProblem {
    /// Nothing at the key's path: the kernel lacks it, or not yet (a module not loaded, an
    /// interface not up). Reported per rule, and the next evaluation looks again.
    Missing(String),
    /// The key can never name a sysctl here: a bad shape, a group of keys, a path leading out.
    Invalid(String),
}

impl std::fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyProblem::Missing(why) | KeyProblem::Invalid(why) => f.write_str(why),
        }
    }
}

/// The file behind a dotted key, checked to be a sysctl under `root`: the model's shape check
/// first, then that the key exists on this node and resolves inside `root`.
pub fn sysctl_path(root: &Path, key: &str) -> Result<PathBuf, String> {
    resolve_key(root, key).map_err(|e| e.to_string())
}

/// [`sysctl_path`], saying whether the key is only missing for now.
pub fn resolve_key(root: &Path, key: &str) -> Result<PathBuf, KeyProblem> {
    check_sysctl_key(key).map_err(KeyProblem::Invalid)?;
    let path = tuning::sysctl_components(key).fold(root.to_path_buf(), |p, name| p.join(name));
    let meta = std::fs::metadata(&path).map_err(|_| {
        KeyProblem::Missing(format!(
            "{key:?} is not a known sysctl (no {} on this node)",
            path.display()
        ))
    })?;
    if !meta.is_file() {
        return Err(KeyProblem::Invalid(format!(
            "{key:?} is a group of sysctls, not a single key"
        )));
    }
    // Belt and braces: the components above cannot leave the root, and neither may links.
    let real = path
        .canonicalize()
        .map_err(|e| KeyProblem::Missing(format!("resolve {}: {e}", path.display())))?;
    let real_root = root
        .canonicalize()
        .map_err(|e| KeyProblem::Invalid(format!("resolve {}: {e}", root.display())))?;
    if !real.starts_with(&real_root) {
        return Err(KeyProblem::Invalid(format!(
            "{key:?} resolves outside {}",
            root.display()
        )));
    }
    Ok(path)
}

fn describe_expected(rule: &Rule) -> String {
    match rule.comparison {
        Comparison::Equal => format!("= {}", rule.values[0]),
        Comparison::AtLeast => format!(">= {}", rule.values[0]),
        Comparison::AtMost => format!("<= {}", rule.values[0]),
        Comparison::OneOf => format!("one of {}", rule.values.join(" | ")),
    }
}

/// Validates a whole rule set. The first problem found is returned, naming the rule (or
/// threshold) and field; nothing is installed unless everything is valid.
pub fn validate(raw: &RawRuleSet, sysctl_root: &Path) -> Result<RuleSet, Error> {
    if raw.revision == 0 {
        return Err(Error::InvalidRules(
            "field `revision`: 0 is not a valid revision; send the ConfigMap content hash".into(),
        ));
    }
    if raw.rules.len() > MAX_RULES {
        return Err(Error::InvalidRules(format!(
            "field `rules`: {} rules; at most {MAX_RULES}",
            raw.rules.len()
        )));
    }
    if raw.thresholds.len() > MAX_THRESHOLDS {
        return Err(Error::InvalidRules(format!(
            "field `thresholds`: {} thresholds; at most {MAX_THRESHOLDS}",
            raw.thresholds.len()
        )));
    }
    let mut names = HashSet::new();
    let mut rules = Vec::with_capacity(raw.rules.len());
    let mut models = Vec::with_capacity(raw.rules.len());
    for (i, r) in raw.rules.iter().enumerate() {
        let name = r.name.trim();
        check_rule_name(name).map_err(|e| refuse(i, name, "name", e))?;
        if !names.insert(name.to_string()) {
            return Err(refuse(
                i,
                name,
                "name",
                "is used by an earlier rule; names must be unique",
            ));
        }
        // A key missing on this node is not a reason to refuse the whole set: the other rules
        // apply, this one reports the missing key, and a later evaluation finds it once the
        // module is loaded or the interface is up.
        match resolve_key(sysctl_root, r.key.trim()) {
            Ok(_) | Err(KeyProblem::Missing(_)) => {}
            Err(e @ KeyProblem::Invalid(_)) => return Err(refuse(i, name, "key", e)),
        }
        // Keys that run programs as root or guard the kernel are checked, never written (the
        // model's list, which the controller applies to the ConfigMap too).
        if r.repair {
            check_repairable(r.key.trim()).map_err(|e| refuse(i, name, "repair", e))?;
        }
        let (comparison, model) = match r.comparison {
            1 => (Comparison::Equal, tuning::Comparison::Equal),
            2 => (Comparison::AtLeast, tuning::Comparison::AtLeast),
            3 => (Comparison::AtMost, tuning::Comparison::AtMost),
            4 => (Comparison::OneOf, tuning::Comparison::OneOf),
            0 => {
                return Err(refuse(
                    i,
                    name,
                    "comparison",
                    "is unspecified; use EQUAL, AT_LEAST, AT_MOST or ONE_OF",
                ));
            }
            n => {
                return Err(refuse(
                    i,
                    name,
                    "comparison",
                    format!("{n} is not a known comparison"),
                ));
            }
        };
        let values: Vec<String> = r.values.iter().map(|v| normalize_value(v)).collect();
        check_values(model, &values).map_err(|e| refuse(i, name, "values", e))?;
        models.push(model);
        let severity = match r.severity {
            0 | 2 => Verdict::Warning,
            3 => Verdict::Critical,
            1 => {
                return Err(refuse(
                    i,
                    name,
                    "severity",
                    "OK is not a severity; use WARNING or CRITICAL",
                ));
            }
            n => {
                return Err(refuse(
                    i,
                    name,
                    "severity",
                    format!("{n} is not a known verdict"),
                ));
            }
        };
        // 0 is the proto's "unset", which means once an hour.
        let repair_max_per_hour = r.repair_max_per_hour.max(1);
        check_repair_max_per_hour(repair_max_per_hour)
            .map_err(|e| refuse(i, name, "repair_max_per_hour", e))?;
        rules.push(Rule {
            name: name.to_string(),
            key: r.key.trim().to_string(),
            comparison,
            values,
            repair: r.repair,
            repair_max_per_hour,
            severity,
        });
    }
    // The controller refuses contradictory rules with the same shared check; an agent asked
    // directly refuses them too rather than fighting itself over a sysctl.
    let view: Vec<(&str, &str, tuning::Comparison, &[String])> = rules
        .iter()
        .zip(&models)
        .map(|(r, m)| (r.name.as_str(), r.key.as_str(), *m, r.values.as_slice()))
        .collect();
    tuning::check_compatible(&view)
        .map_err(|e| Error::InvalidRules(format!("field `rules`: {e}")))?;
    for (i, t) in raw.thresholds.iter().enumerate() {
        check_threshold(t).map_err(|(field, reason)| {
            Error::InvalidRules(format!(
                "threshold {:?} (#{}): field `{field}`: {reason}",
                t.indicator,
                i + 1
            ))
        })?;
    }
    Ok(RuleSet {
        revision: raw.revision,
        rules,
        thresholds: raw.thresholds.clone(),
    })
}

/// Compares a normalised value with a rule. `Err` when the value cannot be compared.
pub fn in_bounds(rule: &Rule, current: &str) -> Result<bool, String> {
    let integer = |v: &str| {
        tuning::parse_integer(v).ok_or_else(|| {
            format!("value {v:?} is not a single integer; use EQUAL or ONE_OF for this key")
        })
    };
    Ok(match rule.comparison {
        Comparison::Equal => current == rule.values[0],
        Comparison::OneOf => rule.values.iter().any(|v| v == current),
        Comparison::AtLeast => integer(current)? >= integer(&rule.values[0])?,
        Comparison::AtMost => integer(current)? <= integer(&rule.values[0])?,
    })
}

/// The rules in force and what the agent remembers about them.
#[derive(Debug)]
pub struct Tunables {
    sysctl_root: PathBuf,
    state_file: PathBuf,
    set: Option<RuleSet>,
    runtime: BTreeMap<String, RuleRuntime>,
    /// Per sysctl key; never dropped with the rules.
    records: BTreeMap<String, KeyRecord>,
}

impl Tunables {
    /// Loads the rules kept in `state_dir`. A missing file means no rules yet; an unreadable one
    /// is logged and ignored (the controller pushes the rules again on its next pass).
    pub fn load(sysctl_root: PathBuf, state_dir: &Path) -> Self {
        let state_file = state_dir.join(STATE_FILE);
        let mut me = Self {
            sysctl_root,
            state_file,
            set: None,
            runtime: BTreeMap::new(),
            records: BTreeMap::new(),
        };
        match std::fs::read(&me.state_file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(error = %e, path = %me.state_file.display(), "cannot read the state file; starting without rules")
            }
            Ok(bytes) => match serde_json::from_slice::<StateFile>(&bytes) {
                Ok(mut state) if state.version == 1 => {
                    info!(
                        revision = state.rules.revision,
                        rules = state.rules.rules.len(),
                        "restored rules from the state file"
                    );
                    me.records = state.take_records();
                    me.set = Some(state.rules);
                    me.runtime = state.runtime;
                }
                Ok(state) => warn!(
                    version = state.version,
                    "state file has an unknown version; starting without rules"
                ),
                Err(e) => {
                    warn!(error = %e, path = %me.state_file.display(), "state file is corrupt; starting without rules")
                }
            },
        }
        me
    }

    /// The revision of the rules in force; 0 without rules.
    pub fn revision(&self) -> u64 {
        self.set.as_ref().map_or(0, |s| s.revision)
    }

    /// Threshold overrides in force.
    pub fn thresholds(&self) -> &[Threshold] {
        self.set.as_ref().map_or(&[], |s| &s.thresholds)
    }

    /// Validates and installs a rule set, persisting it first: if either step fails the previous
    /// rules stay in force. Rules that did not change keep their repair history and conflict
    /// state; a changed or new rule starts afresh. The per-key record of what repairs changed
    /// is kept whatever the rules become.
    pub fn set_rules(&mut self, raw: &RawRuleSet) -> Result<u64, Error> {
        let set = validate(raw, &self.sysctl_root)?;
        let old: BTreeMap<&str, &Rule> = self
            .set
            .iter()
            .flat_map(|s| s.rules.iter().map(|r| (r.name.as_str(), r)))
            .collect();
        let runtime: BTreeMap<String, RuleRuntime> = set
            .rules
            .iter()
            .filter_map(|r| {
                let same = old.get(r.name.as_str()).is_some_and(|o| *o == r);
                let kept = self.runtime.get(&r.name).filter(|_| same).cloned();
                kept.map(|rt| (r.name.clone(), rt))
            })
            .collect();
        write_state(&self.state_file, &set, &runtime, &self.records)?;
        let revision = set.revision;
        info!(
            revision,
            rules = set.rules.len(),
            thresholds = set.thresholds.len(),
            "installed rules"
        );
        self.set = Some(set);
        self.runtime = runtime;
        Ok(revision)
    }

    /// Evaluates every rule, repairing where allowed, and returns the statuses in rule order.
    /// Runs in the calling thread's network namespace (which `/proc/sys/net` reflects).
    pub fn evaluate(&mut self, now_unix_ms: i64) -> Vec<TunableStatus> {
        let Some(set) = &self.set else {
            return Vec::new();
        };
        let mut changed = false;
        if let Some(boot) = boot_id(&self.sysctl_root) {
            for rule in &set.rules {
                changed |= enter_boot(self.runtime.entry(rule.name.clone()).or_default(), &boot);
            }
        }
        let mut out = Vec::with_capacity(set.rules.len());
        for rule in &set.rules {
            // The agent's own last write to this key, by any rule: a value equal to it is not
            // "someone else" changing the key.
            let own_last = set
                .rules
                .iter()
                .filter(|r| r.key == rule.key)
                .filter_map(|r| self.runtime.get(&r.name))
                .filter_map(|rt| rt.written.clone().map(|w| (rt.repaired_at_unix_ms, w)))
                .max()
                .map(|(_, w)| w);
            let rt = self.runtime.entry(rule.name.clone()).or_default();
            let (status, rt_changed) = evaluate_rule(
                &self.sysctl_root,
                rule,
                rt,
                &mut self.records,
                own_last.as_deref(),
                now_unix_ms,
            );
            changed |= rt_changed;
            out.push(status);
        }
        if changed && let Err(e) = write_state(&self.state_file, set, &self.runtime, &self.records)
        {
            warn!(error = %e, "cannot persist repair history");
        }
        out
    }
}

fn evaluate_rule(
    root: &Path,
    rule: &Rule,
    rt: &mut RuleRuntime,
    records: &mut BTreeMap<String, KeyRecord>,
    own_last: Option<&str>,
    now: i64,
) -> (TunableStatus, bool) {
    let mut status = TunableStatus {
        rule: rule.name.clone(),
        key: rule.key.clone(),
        expected: describe_expected(rule),
        previous: rt.previous.clone(),
        repaired_at_unix_ms: rt.repaired_at_unix_ms,
        conflict: rt.conflict,
        ..TunableStatus::default()
    };
    let path = match sysctl_path(root, &rule.key) {
        Ok(p) => p,
        Err(e) => {
            status.error = format!("key {e}");
            return (status, false);
        }
    };
    let read = |p: &Path| std::fs::read_to_string(p).map(|v| normalize_value(&v));
    let current = match read(&path) {
        Ok(v) => v,
        Err(e) => {
            status.error = format!("read {}: {e}", path.display());
            return (status, false);
        }
    };
    status.current = current.clone();
    let mut changed = false;
    // Back at the value nodekeeper found (a reboot resets /proc/sys, or someone put it back):
    // nothing of nodekeeper's stands on the key any more, so uninstall has nothing to restore.
    if records
        .get(&rule.key)
        .is_some_and(|r| current == r.original && current != r.written)
    {
        records.remove(&rule.key);
        changed = true;
    }
    let ok = match in_bounds(rule, &current) {
        Ok(ok) => ok,
        Err(e) => {
            status.error = e;
            return (status, changed);
        }
    };
    if ok {
        status.verdict = Verdict::Ok;
        return (status, changed);
    }
    status.verdict = rule.severity;
    // Out of bounds after the agent wrote an in-bounds value: someone set it back.
    if let Some(written) = &rt.written
        && *written != current
        && own_last != Some(current.as_str())
        && !rt.conflict
    {
        warn!(rule = %rule.name, key = %rule.key, %current, %written, "value changed back by someone else; backing off");
        rt.conflict = true;
        changed = true;
    }
    status.conflict = rt.conflict;
    if rt.conflict {
        status.error = format!(
            "changed back to {current:?} by someone else after nodekeeper wrote {:?}; not repairing until the rule changes",
            rt.written.as_deref().unwrap_or("")
        );
        return (status, changed);
    }
    if !rule.repair {
        return (status, changed);
    }
    // Rules are validated when installed, but a state file written before a key joined the
    // never-repaired list is restored as it was: the write itself is refused here too.
    if let Err(e) = check_repairable(&rule.key) {
        status.error = format!("not repaired: {e}");
        return (status, changed);
    }
    let before = rt.repairs_unix_ms.len();
    rt.repairs_unix_ms.retain(|t| now - t < HOUR_MS);
    changed |= rt.repairs_unix_ms.len() != before;
    if rt.repairs_unix_ms.len() >= rule.repair_max_per_hour as usize {
        status.error = format!(
            "repair rate limit reached ({} per hour)",
            rule.repair_max_per_hour
        );
        return (status, changed);
    }
    let value = &rule.values[0];
    rt.repairs_unix_ms.push(now);
    if let Err(e) = std::fs::write(&path, format!("{value}\n")) {
        status.error = format!("write {}: {e}", path.display());
        return (status, true);
    }
    info!(rule = %rule.name, key = %rule.key, previous = %current, %value, "repaired sysctl");
    // The first repair of the key records what was there; a later one (a rule edited, another
    // rule on the key) keeps that original while the key still holds nodekeeper's last value. A
    // key someone else changed since holds their value, which is then the one to restore.
    let record = records
        .entry(rule.key.clone())
        .or_insert_with(|| KeyRecord {
            original: current.clone(),
            written: current.clone(),
        });
    if record.written != current {
        record.original = current.clone();
    }
    record.written = value.clone();
    rt.previous = current;
    rt.repaired_at_unix_ms = now;
    rt.written = Some(value.clone());
    status.previous = rt.previous.clone();
    status.repaired_at_unix_ms = now;
    match read(&path) {
        Ok(after) => {
            status.current = after.clone();
            match in_bounds(rule, &after) {
                Ok(true) => status.verdict = Verdict::Ok,
                Ok(false) => {
                    status.error =
                        format!("the kernel kept {after:?} after nodekeeper wrote {value:?}")
                }
                Err(e) => status.error = e,
            }
            // What stands is what later reads are compared with.
            if let Some(record) = records.get_mut(&rule.key) {
                record.written = after.clone();
            }
            rt.written = Some(after);
        }
        Err(e) => status.error = format!("read back {}: {e}", path.display()),
    }
    (status, true)
}

/// One sysctl key as nodekeeper's repairs left it, from the state file: what
/// `nodekeeper-agent --cleanup` puts back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repair {
    pub key: String,
    /// The value found before nodekeeper's first repair of the key.
    pub original: String,
    /// The value nodekeeper wrote last (as the kernel read it back).
    pub written: String,
}

/// The repairs recorded in `state_dir`, one per key, whether or not a rule on the key is still
/// in force or still repairs; none without a state file.
pub fn repairs(state_dir: &Path) -> Result<Vec<Repair>, String> {
    let path = state_dir.join(STATE_FILE);
    let bytes = match std::fs::read(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("read {}: {e}", path.display())),
        Ok(b) => b,
    };
    let mut state: StateFile = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not nodekeeper's state file: {e}", path.display()))?;
    Ok(state
        .take_records()
        .into_iter()
        .map(|(key, r)| Repair {
            key,
            original: r.original,
            written: r.written,
        })
        .collect())
}

/// The per-key record a state file from before [`KeyRecord`] implies: for each key, the earliest
/// repair's `previous` and the latest one's `written` among the rules it still holds (what
/// such a file can tell; a rule already dropped took its part with it).
fn legacy_records(
    set: &RuleSet,
    runtime: &BTreeMap<String, RuleRuntime>,
) -> BTreeMap<String, KeyRecord> {
    let mut by_key: BTreeMap<&str, Vec<&RuleRuntime>> = BTreeMap::new();
    for rule in &set.rules {
        if let Some(rt) = runtime.get(&rule.name)
            && rt.written.is_some()
            && rt.repaired_at_unix_ms > 0
        {
            by_key.entry(&rule.key).or_default().push(rt);
        }
    }
    by_key
        .into_iter()
        .filter_map(|(key, mut rts)| {
            rts.sort_by_key(|rt| rt.repaired_at_unix_ms);
            Some((
                key.to_owned(),
                KeyRecord {
                    original: rts.first()?.previous.clone(),
                    written: rts.last()?.written.clone()?,
                },
            ))
        })
        .collect()
}

/// Writes the state file atomically: a temporary file in the same directory, synced, renamed
/// over the old one, then the directory synced so the rename survives a crash.
fn write_state(
    path: &Path,
    set: &RuleSet,
    runtime: &BTreeMap<String, RuleRuntime>,
    records: &BTreeMap<String, KeyRecord>,
) -> Result<(), Error> {
    let save = |e: std::io::Error| Error::SaveState {
        path: path.to_path_buf(),
        source: e,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(save)?;
    let state = StateFile {
        version: 1,
        rules: set.clone(),
        runtime: runtime.clone(),
        repaired: Some(records.clone()),
    };
    let bytes = serde_json::to_vec_pretty(&state).map_err(|e| save(std::io::Error::other(e)))?;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(save)?;
    f.write_all(&bytes).map_err(save)?;
    f.sync_all().map_err(save)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(save)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(save)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysctl tree in a temporary directory: lets the repair logic be tested without
    /// root and without touching the host.
    fn fake_root() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let core = dir.path().join("net/core");
        std::fs::create_dir_all(&core).unwrap();
        std::fs::write(core.join("somaxconn"), "128\n").unwrap();
        std::fs::create_dir_all(dir.path().join("net/ipv4")).unwrap();
        std::fs::write(
            dir.path().join("net/ipv4/tcp_rmem"),
            "4096\t131072\t6291456\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("net/ipv4/ip_forward"), "0\n").unwrap();
        dir
    }

    fn rule(name: &str, key: &str, comparison: i32, values: &[&str], repair: bool) -> RawRule {
        RawRule {
            name: name.into(),
            key: key.into(),
            comparison,
            values: values.iter().map(|v| v.to_string()).collect(),
            repair,
            ..RawRule::default()
        }
    }

    fn set(rules: Vec<RawRule>) -> RawRuleSet {
        RawRuleSet {
            revision: 7,
            rules,
            thresholds: vec![],
        }
    }

    #[test]
    fn refuses_bad_rules_naming_rule_and_field() {
        let root = fake_root();
        let cases: Vec<(RawRuleSet, &str)> = vec![
            // A key this node lacks is not refused (see
            // `a_missing_key_is_the_rules_error_not_the_sets`); one the agent cannot see is.
            (
                set(vec![rule("a", "kernel.shmmax", 2, &["1"], false)]),
                "rule \"a\" (#1): field `key`: kernel.shmmax is kept per IPC namespace",
            ),
            (
                set(vec![rule(
                    "a",
                    "net.core/../../etc/passwd",
                    1,
                    &["1"],
                    false,
                )]),
                "field `key`: \"net.core/../../etc/passwd\" has an empty component",
            ),
            (
                set(vec![rule("a", "net.core./.x", 1, &["1"], false)]),
                "field `key`: \"net.core./.x\" has a component that names `.` or `..`",
            ),
            (
                set(vec![rule("a", "/etc/passwd", 1, &["1"], false)]),
                "field `key`: \"/etc/passwd\" is a path",
            ),
            (
                set(vec![rule("a", "net..core", 1, &["1"], false)]),
                "empty component",
            ),
            (
                set(vec![rule("a", "net.core", 1, &["1"], false)]),
                "is a group of sysctls",
            ),
            (
                set(vec![rule("a", "net.core.somaxconn", 0, &["1"], false)]),
                "field `comparison`: is unspecified",
            ),
            (
                set(vec![rule("a", "net.core.somaxconn", 9, &["1"], false)]),
                "field `comparison`: 9 is not",
            ),
            (
                set(vec![rule("a", "net.core.somaxconn", 2, &[], false)]),
                "field `values`: is empty",
            ),
            (
                set(vec![rule("a", "net.core.somaxconn", 2, &["1", "2"], false)]),
                "field `values`: has 2 values",
            ),
            (
                set(vec![rule("a", "net.core.somaxconn", 2, &["lots"], false)]),
                "\"lots\" is not an integer",
            ),
            (
                set(vec![rule(
                    "a",
                    "net.core.somaxconn",
                    1,
                    &["1\u{0}2"],
                    false,
                )]),
                "field `values`: values are at most 256 printable",
            ),
            (
                set(vec![rule("", "net.core.somaxconn", 1, &["1"], false)]),
                "rule #1: field `name`: is empty",
            ),
            (
                set(vec![
                    rule("big", "net.core.somaxconn", 2, &["4096"], true),
                    rule("small", "net.core.somaxconn", 3, &["1024"], true),
                ]),
                "field `rules`: rules \"big\" and \"small\" both bound net.core.somaxconn",
            ),
            (
                set(vec![
                    rule("a", "net.core.somaxconn", 1, &["1"], false),
                    rule("a", "net.ipv4.ip_forward", 1, &["1"], false),
                ]),
                "rule \"a\" (#2): field `name`: is used by an earlier rule",
            ),
            (
                set(vec![RawRule {
                    severity: 1,
                    ..rule("a", "net.core.somaxconn", 1, &["1"], false)
                }]),
                "field `severity`",
            ),
            (
                set(vec![RawRule {
                    repair_max_per_hour: 1000,
                    ..rule("a", "net.core.somaxconn", 1, &["1"], false)
                }]),
                "field `repair_max_per_hour`",
            ),
            (
                RawRuleSet {
                    revision: 0,
                    ..set(vec![])
                },
                "field `revision`",
            ),
            (
                RawRuleSet {
                    thresholds: vec![Threshold {
                        indicator: "bogus".into(),
                        warning: 1.0,
                        critical: 2.0,
                    }],
                    ..set(vec![])
                },
                "threshold \"bogus\" (#1): field `indicator`",
            ),
            (
                RawRuleSet {
                    thresholds: vec![Threshold {
                        indicator: "memory.available_percent".into(),
                        warning: 5.0,
                        critical: 10.0,
                    }],
                    ..set(vec![])
                },
                "field `critical`: must be at or below",
            ),
            (
                RawRuleSet {
                    thresholds: vec![Threshold {
                        indicator: "disk.*".into(),
                        warning: f64::NAN,
                        critical: 2.0,
                    }],
                    ..set(vec![])
                },
                "finite",
            ),
        ];
        let state = tempfile::tempdir().unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        let good = set(vec![rule("keep", "net.core.somaxconn", 2, &["64"], false)]);
        assert_eq!(t.set_rules(&good).unwrap(), 7);
        let before = std::fs::read(state.path().join(STATE_FILE)).unwrap();
        for (raw, want) in cases {
            let err = t.set_rules(&raw).unwrap_err().to_string();
            assert!(err.contains(want), "expected {want:?} in {err:?}");
            // The previous rules stay in force and on disk.
            assert_eq!(t.revision(), 7);
            assert_eq!(t.evaluate(0)[0].rule, "keep");
            assert_eq!(
                std::fs::read(state.path().join(STATE_FILE)).unwrap(),
                before
            );
        }
        assert_eq!(
            std::fs::read_to_string(root.path().join("net/core/somaxconn")).unwrap(),
            "128\n"
        );
    }

    #[test]
    fn keys_that_run_programs_are_checked_but_never_repaired() {
        let root = fake_root();
        let kernel = root.path().join("kernel");
        std::fs::create_dir_all(&kernel).unwrap();
        std::fs::write(kernel.join("core_pattern"), "core\n").unwrap();
        let evil = set(vec![rule(
            "cores",
            "kernel.core_pattern",
            1,
            &["|/bin/sh -c id"],
            true,
        )]);
        let err = validate(&evil, root.path()).unwrap_err();
        assert!(matches!(err, Error::InvalidRules(_)), "{err:?}");
        let err = err.to_string();
        assert!(
            err.contains("rule \"cores\" (#1): field `repair`: kernel.core_pattern names a program the kernel runs as root")
                && err.contains("drop repair from this rule"),
            "{err}"
        );
        // Checking the key is allowed.
        let check = set(vec![rule(
            "cores",
            "kernel.core_pattern",
            1,
            &["|/bin/sh -c id"],
            false,
        )]);
        assert!(validate(&check, root.path()).is_ok());

        // A repairing rule restored from an older state file is not acted on either.
        let state = tempfile::tempdir().unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        t.set_rules(&check).unwrap();
        t.set.as_mut().unwrap().rules[0].repair = true;
        let s = t.evaluate(1_000);
        assert!(s[0].error.contains("not repaired"), "{s:?}");
        assert_eq!(
            std::fs::read_to_string(kernel.join("core_pattern")).unwrap(),
            "core\n"
        );
    }

    #[test]
    fn limits_and_names_are_the_tuning_models() {
        let root = fake_root();
        let many = set(vec![
            rule("a", "net.core.somaxconn", 1, &["1"], false);
            tuning::MAX_RULES + 1
        ]);
        let err = validate(&many, root.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "field `rules`: {} rules; at most {}",
                tuning::MAX_RULES + 1,
                tuning::MAX_RULES
            )),
            "{err}"
        );
        // A name the ConfigMap parser refuses is refused here too, with the same reason.
        let upper = set(vec![rule(
            "Somaxconn",
            "net.core.somaxconn",
            1,
            &["1"],
            false,
        )]);
        let err = validate(&upper, root.path()).unwrap_err().to_string();
        let model = check_rule_name("Somaxconn").unwrap_err();
        assert!(err.contains(&model), "{err}");
    }

    #[test]
    fn the_real_proc_sys_validates_keys() {
        let root = Path::new("/proc/sys");
        assert!(sysctl_path(root, "net.core.somaxconn").is_ok());
        assert!(sysctl_path(root, "kernel.nodekeeper_no_such_key").is_err());
        assert!(sysctl_path(root, "..").is_err());
    }

    #[test]
    fn comparisons() {
        let r = |comparison, values: &[&str]| Rule {
            name: "r".into(),
            key: "k".into(),
            comparison,
            values: values.iter().map(|v| v.to_string()).collect(),
            repair: false,
            repair_max_per_hour: 1,
            severity: Verdict::Warning,
        };
        assert!(in_bounds(&r(Comparison::AtLeast, &["4096"]), "8192").unwrap());
        assert!(!in_bounds(&r(Comparison::AtLeast, &["4096"]), "128").unwrap());
        assert!(in_bounds(&r(Comparison::AtMost, &["10"]), "10").unwrap());
        assert!(
            in_bounds(
                &r(Comparison::Equal, &["4096 131072 6291456"]),
                "4096 131072 6291456"
            )
            .unwrap()
        );
        assert!(in_bounds(&r(Comparison::OneOf, &["1", "2"]), "2").unwrap());
        assert!(in_bounds(&r(Comparison::AtLeast, &["1"]), "1 2").is_err());
        // Unsigned 64-bit values (kernel.shmmax's default) compare as integers.
        let big = "18446744073692774399";
        assert!(in_bounds(&r(Comparison::AtLeast, &[big]), big).unwrap());
        assert!(!in_bounds(&r(Comparison::AtMost, &["4096"]), big).unwrap());
        assert!(in_bounds(&r(Comparison::AtLeast, &["-1"]), "0").unwrap());
    }

    /// Regression: one key the node lacked (a module not loaded yet) refused the whole set, and
    /// the controller never pushed that revision again.
    #[test]
    fn a_missing_key_is_the_rules_error_not_the_sets() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        let revision = t
            .set_rules(&set(vec![
                rule(
                    "conntrack",
                    "net.netfilter.nf_conntrack_max",
                    2,
                    &["1000"],
                    true,
                ),
                rule("backlog", "net.core.somaxconn", 2, &["64"], false),
            ]))
            .unwrap();
        assert_eq!(revision, 7);
        let s = t.evaluate(1_000);
        assert_eq!(s[0].verdict, Verdict::Unspecified, "{s:?}");
        assert!(s[0].error.contains("is not a known sysctl"), "{s:?}");
        assert_eq!(s[1].verdict, Verdict::Ok, "the other rules apply: {s:?}");
        // The module loads: the next evaluation finds the key and repairs it.
        let dir = root.path().join("net/netfilter");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("nf_conntrack_max"), "10\n").unwrap();
        let s = t.evaluate(2_000);
        assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
        assert_eq!(
            std::fs::read_to_string(dir.join("nf_conntrack_max")).unwrap(),
            "1000\n"
        );
    }

    /// A name holding dots (VLAN interface `eth0.100`) is written with `/`, as in sysctl.d.
    #[test]
    fn a_slash_in_a_key_is_a_dot_in_the_name() {
        let root = fake_root();
        let dir = root.path().join("net/ipv4/conf/eth0.100");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rp_filter"), "1\n").unwrap();
        let key = "net.ipv4.conf.eth0/100.rp_filter";
        assert_eq!(
            sysctl_path(root.path(), key).unwrap(),
            dir.join("rp_filter")
        );
        let state = tempfile::tempdir().unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        t.set_rules(&set(vec![rule("vlan-rp", key, 1, &["2"], true)]))
            .unwrap();
        let s = t.evaluate(1_000);
        assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
        assert_eq!(
            std::fs::read_to_string(dir.join("rp_filter")).unwrap(),
            "2\n"
        );
    }

    /// Regression (issue 20, defect 2): a value the agent itself wrote (for another rule on the
    /// same key) is not "changed back by someone else".
    #[test]
    fn the_agents_own_write_is_not_a_conflict() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let key = root.path().join("net/core/somaxconn");
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        // Compatible bounds (200 satisfies both); from 128 "low" writes 100, then "pick" 50.
        t.set_rules(&set(vec![
            rule("low", "net.core.somaxconn", 2, &["100"], true),
            rule("pick", "net.core.somaxconn", 4, &["50", "200"], true),
        ]))
        .unwrap();
        std::fs::write(&key, "10\n").unwrap();
        let s = t.evaluate(1_000);
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "50\n", "{s:?}");
        let s = t.evaluate(2_000);
        assert!(!s[0].conflict, "{s:?}");
        assert!(!s[0].error.contains("someone else"), "{s:?}");
        // Someone else's value still is a conflict.
        std::fs::write(&key, "7\n").unwrap();
        let s = t.evaluate(3_000);
        assert!(s.iter().any(|x| x.conflict), "{s:?}");
    }

    /// Regression: after a reboot the restored `written` differed from the boot's value, so
    /// every repaired rule read "changed back by someone else" and was never repaired again.
    #[test]
    fn a_reboot_is_not_a_conflict_but_the_rate_limit_still_counts() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let key = root.path().join("net/core/somaxconn");
        let boot = root.path().join("kernel/random/boot_id");
        std::fs::create_dir_all(boot.parent().unwrap()).unwrap();
        std::fs::write(&boot, "aaaa-1\n").unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        t.set_rules(&set(vec![RawRule {
            repair_max_per_hour: 2,
            ..rule("somaxconn", "net.core.somaxconn", 2, &["4096"], true)
        }]))
        .unwrap();
        assert_eq!(t.evaluate(1_000)[0].verdict, Verdict::Ok);
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "4096\n");

        // The node reboots: /proc/sys is back at the kernel's default, the agent restarts.
        std::fs::write(&boot, "bbbb-2\n").unwrap();
        std::fs::write(&key, "128\n").unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        let s = t.evaluate(2_000);
        assert!(!s[0].conflict, "{s:?}");
        assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "4096\n");

        // Within this boot, someone else setting it back still is a conflict.
        std::fs::write(&key, "256\n").unwrap();
        let s = t.evaluate(3_000);
        assert!(s[0].conflict, "{s:?}");
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "256\n");

        // Another reboot clears the conflict, but the two repairs of the last hour (one per
        // boot) still count against the limit of two.
        std::fs::write(&boot, "cccc-3\n").unwrap();
        std::fs::write(&key, "128\n").unwrap();
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        let s = t.evaluate(4_000);
        assert!(!s[0].conflict, "{s:?}");
        assert!(s[0].error.contains("rate limit"), "{s:?}");
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "128\n");
        let s = t.evaluate(1_000 + HOUR_MS);
        assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
    }

    #[test]
    fn repairs_rate_limits_and_backs_off_on_a_fake_tree() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let key = root.path().join("net/core/somaxconn");
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        t.set_rules(&set(vec![
            rule("somaxconn", "net.core.somaxconn", 2, &["4096"], true),
            rule(
                "rmem",
                "net.ipv4.tcp_rmem",
                1,
                &["4096 131072 6291456"],
                false,
            ),
            rule("forward", "net.ipv4.ip_forward", 1, &["1"], false),
        ]))
        .unwrap();
        let s = t.evaluate(1_000);
        assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
        assert_eq!(s[0].current, "4096");
        assert_eq!(s[0].previous, "128");
        assert_eq!(s[0].repaired_at_unix_ms, 1_000);
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "4096\n");
        assert_eq!(s[1].verdict, Verdict::Ok);
        // Not allowed to repair: reported, left alone.
        assert_eq!(s[2].verdict, Verdict::Warning);
        assert_eq!(s[2].expected, "= 1");
        assert_eq!(
            std::fs::read_to_string(root.path().join("net/ipv4/ip_forward")).unwrap(),
            "0\n"
        );

        // Someone sets it back: conflict, and the agent does not write again.
        std::fs::write(&key, "256\n").unwrap();
        let s = t.evaluate(2_000);
        assert!(s[0].conflict, "{s:?}");
        assert_eq!(s[0].verdict, Verdict::Warning);
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "256\n");
        assert!(t.evaluate(3_000)[0].conflict);
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "256\n");

        // Rules survive a restart, with the conflict remembered.
        let mut again = Tunables::load(root.path().to_path_buf(), state.path());
        assert_eq!(again.revision(), 7);
        assert!(again.evaluate(4_000)[0].conflict);

        // A changed rule starts afresh: repair once, then the hourly limit holds.
        let mut changed = set(vec![RawRule {
            repair_max_per_hour: 1,
            ..rule("somaxconn", "net.core.somaxconn", 2, &["2048"], true)
        }]);
        changed.revision = 8;
        again.set_rules(&changed).unwrap();
        let s = again.evaluate(5_000);
        assert!(!s[0].conflict && s[0].verdict == Verdict::Ok, "{s:?}");
        assert_eq!(s[0].previous, "256");
        // The agent's own value is replaced by another out-of-bounds one by a different writer
        // → conflict; after the rule changes again the hourly limit still counts past repairs.
        std::fs::write(&key, "100\n").unwrap();
        assert!(again.evaluate(6_000)[0].conflict);
    }

    /// Regression: turning repair off or editing a rule dropped the rule's runtime, and with it
    /// the only record of the value uninstall restores.
    #[test]
    fn the_original_value_outlives_rule_edits_repair_off_and_restarts() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let key = root.path().join("net/core/somaxconn");
        let record = |dir: &Path| repairs(dir).unwrap();
        let somaxconn = |original: &str, written: &str| Repair {
            key: "net.core.somaxconn".into(),
            original: original.into(),
            written: written.into(),
        };
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        // 128 → 4096, then the rule is edited to ask for more: 4096 → 8192.
        t.set_rules(&set(vec![rule(
            "backlog",
            "net.core.somaxconn",
            2,
            &["4096"],
            true,
        )]))
        .unwrap();
        t.evaluate(1_000);
        assert_eq!(record(state.path()), [somaxconn("128", "4096")]);
        let mut edited = set(vec![rule(
            "backlog",
            "net.core.somaxconn",
            2,
            &["8192"],
            true,
        )]);
        edited.revision = 8;
        t.set_rules(&edited).unwrap();
        t.evaluate(2_000);
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "8192\n");
        assert_eq!(record(state.path()), [somaxconn("128", "8192")]);
        // Repair switched off: every rule changes and its runtime starts afresh; the record
        // stays, through a restart and a rule set without the key at all.
        let mut off = set(vec![rule(
            "backlog",
            "net.core.somaxconn",
            2,
            &["8192"],
            false,
        )]);
        off.revision = 9;
        t.set_rules(&off).unwrap();
        t.evaluate(3_000);
        assert_eq!(record(state.path()), [somaxconn("128", "8192")]);
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        let mut none = set(vec![]);
        none.revision = 10;
        t.set_rules(&none).unwrap();
        t.evaluate(4_000);
        assert_eq!(record(state.path()), [somaxconn("128", "8192")]);

        // Someone else's value is the one to keep: a repair after it records it as original.
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        std::fs::write(&key, "1000\n").unwrap();
        let mut again = set(vec![rule(
            "backlog",
            "net.core.somaxconn",
            2,
            &["4096"],
            true,
        )]);
        again.revision = 11;
        t.set_rules(&again).unwrap();
        t.evaluate(5_000);
        assert_eq!(record(state.path()), [somaxconn("1000", "4096")]);
        // Back at the original (a reboot resets /proc/sys): nothing of nodekeeper's stands,
        // and the record goes, once a rule reads the key.
        let mut check = set(vec![rule(
            "backlog",
            "net.core.somaxconn",
            2,
            &["64"],
            false,
        )]);
        check.revision = 12;
        t.set_rules(&check).unwrap();
        std::fs::write(&key, "1000\n").unwrap();
        t.evaluate(6_000);
        assert_eq!(record(state.path()), []);
    }

    /// A state file written before the per-key record existed still loads, and its repairs are
    /// still restored by uninstall (from the rules' runtimes, as before).
    #[test]
    fn an_old_state_file_keeps_its_repairs() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let old = r#"{
          "version": 1,
          "rules": {"revision": 7, "rules": [{"name": "backlog", "key": "net.core.somaxconn",
            "comparison": "AtLeast", "values": ["4096"], "repair": true,
            "repair_max_per_hour": 1, "severity": "Warning"}], "thresholds": []},
          "runtime": {"backlog": {"previous": "128", "repaired_at_unix_ms": 1000,
            "written": "4096", "conflict": false, "repairs_unix_ms": [1000]}}
        }"#;
        std::fs::write(state.path().join(STATE_FILE), old).unwrap();
        std::fs::write(root.path().join("net/core/somaxconn"), "4096\n").unwrap();
        let expected = vec![Repair {
            key: "net.core.somaxconn".into(),
            original: "128".into(),
            written: "4096".into(),
        }];
        assert_eq!(repairs(state.path()).unwrap(), expected);
        // Loaded by the agent, then repair switched off: the record carries over.
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        assert_eq!(t.revision(), 7);
        let mut off = set(vec![rule(
            "backlog",
            "net.core.somaxconn",
            2,
            &["4096"],
            false,
        )]);
        off.revision = 8;
        t.set_rules(&off).unwrap();
        assert_eq!(repairs(state.path()).unwrap(), expected);
    }

    #[test]
    fn rate_limit_counts_repairs_within_the_hour() {
        let root = fake_root();
        let state = tempfile::tempdir().unwrap();
        let key = root.path().join("net/core/somaxconn");
        let mut t = Tunables::load(root.path().to_path_buf(), state.path());
        t.set_rules(&set(vec![rule(
            "s",
            "net.core.somaxconn",
            2,
            &["4096"],
            true,
        )]))
        .unwrap();
        // A repair at t=0 is still within the hour at t=1s.
        let rt = t.runtime.entry("s".into()).or_default();
        rt.repairs_unix_ms = vec![0];
        let s = t.evaluate(1_000);
        assert!(s[0].error.contains("rate limit"), "{s:?}");
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "128\n");
        // An hour later the limit has passed.
        let s = t.evaluate(HOUR_MS + 1);
        assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
    }
}
