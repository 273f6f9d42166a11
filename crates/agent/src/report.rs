//! The node report: indicator verdicts against thresholds (defaults and the controller's
//! overrides), GPU verdicts, and the report revision — a hash of the content that matters
//! (verdicts, messages, discrete state, values quantized to each indicator's significance step),
//! never of timestamps.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::collect::gpu::{Gpu, GpuReading};
use crate::collect::interfaces::Interface;
use crate::collect::oca::Plugin;
use crate::collect::{Measurement, Unit};
use crate::tunables::TunableStatus;

/// How a figure compares with the rules in force.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum Verdict {
    /// Not evaluated; never treated as healthy.
    #[default]
    Unspecified,
    Ok,
    Warning,
    Critical,
}

/// An override of an indicator's warning and critical levels (from `SetRules`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Threshold {
    /// An indicator name, or a prefix ending in `*`.
    pub indicator: String,
    pub warning: f64,
    pub critical: f64,
}

/// The built-in view of one family of indicators.
#[derive(Clone, Copy, Debug)]
struct Family {
    /// Exact name, or `prefix*` / `*suffix` / `prefix*suffix`.
    pattern: &'static str,
    lower_is_worse: bool,
    warning: f64,
    critical: f64,
    /// Changes smaller than this are noise: values are rounded to it for the revision.
    step: f64,
}

const fn fam(
    pattern: &'static str,
    lower_is_worse: bool,
    warning: f64,
    critical: f64,
    step: f64,
) -> Family {
    Family {
        pattern,
        lower_is_worse,
        warning,
        critical,
        step,
    }
}

/// Default levels. Load is per CPU; PSI levels follow the kernel's guidance that sustained
/// `some` stalls in the tens of percent mean the workload is visibly slowed.
const FAMILIES: &[Family] = &[
    fam("load.*_per_cpu", false, 2.0, 4.0, 0.25),
    fam("cpu.busy_percent", false, 90.0, 98.0, 10.0),
    fam("memory.available_percent", true, 10.0, 5.0, 1.0),
    fam("psi.cpu.some_avg60", false, 40.0, 80.0, 5.0),
    fam("psi.memory.some_avg60", false, 10.0, 30.0, 2.0),
    fam("psi.memory.full_avg60", false, 5.0, 15.0, 2.0),
    fam("psi.io.some_avg60", false, 30.0, 60.0, 5.0),
    fam("psi.io.full_avg60", false, 10.0, 30.0, 2.0),
    fam("disk.*.inodes_used_percent", false, 80.0, 90.0, 1.0),
    fam("disk.*.used_percent", false, 80.0, 90.0, 1.0),
    fam("conntrack.used_percent", false, 75.0, 90.0, 1.0),
    fam("files.used_percent", false, 70.0, 90.0, 1.0),
    // A bool: 0 (not synchronised) is at or below the warning level; nothing reaches -1.
    fam("time.synchronized", true, 0.0, -1.0, 1.0),
    fam("time.max_error_seconds", false, 1.0, 5.0, 0.25),
    // Used for each GPU's verdict rather than as indicators of their own.
    fam("gpu.temperature_c", false, 85.0, 95.0, 5.0),
    fam("gpu.ecc_uncorrected", false, 1.0, 1.0, 1.0),
];

fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((prefix, suffix)) => {
            name.len() >= prefix.len() + suffix.len()
                && name.starts_with(prefix)
                && name.ends_with(suffix)
        }
    }
}

fn family(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| matches(f.pattern, name))
}

/// Whether a threshold's `indicator` names something the agent measures (or may measure: disk
/// names depend on the configured mounts). Used by rule validation.
pub fn known_indicator(pattern: &str) -> bool {
    if let Some(prefix) = pattern.strip_suffix('*') {
        return !prefix.contains('*');
    }
    !pattern.contains('*') && family(pattern).is_some()
}

/// Whether lower values of this indicator are worse.
pub fn lower_is_worse(name: &str) -> bool {
    family(name).is_some_and(|f| f.lower_is_worse)
}

/// The levels in force for one indicator: an exact override, else the longest matching prefix
/// override, else the default. `None` for an indicator with no levels (reported, not judged).
pub fn levels(name: &str, overrides: &[Threshold]) -> Option<(f64, f64)> {
    if let Some(t) = overrides.iter().rev().find(|t| t.indicator == name) {
        return Some((t.warning, t.critical));
    }
    let prefixed = overrides
        .iter()
        .rev()
        .filter_map(|t| t.indicator.strip_suffix('*').map(|p| (p, t)))
        .filter(|(p, _)| name.starts_with(p))
        .max_by_key(|(p, _)| p.len());
    if let Some((_, t)) = prefixed {
        return Some((t.warning, t.critical));
    }
    family(name).map(|f| (f.warning, f.critical))
}

fn step(name: &str) -> f64 {
    family(name).map_or(1.0, |f| f.step)
}

/// Rounds to the indicator's significance step.
pub fn quantize(name: &str, value: f64) -> f64 {
    let s = step(name);
    let q = (value / s).round() * s;
    // Avoid "-0" and float dust in messages and hashes.
    if q == 0.0 {
        0.0
    } else {
        (q * 1e6).round() / 1e6
    }
}

/// Judges `value` against (warning, critical) levels.
pub fn judge(value: f64, lower_is_worse: bool, (warning, critical): (f64, f64)) -> Verdict {
    let beyond = |level: f64| {
        if lower_is_worse {
            value <= level
        } else {
            value >= level
        }
    };
    if beyond(critical) {
        Verdict::Critical
    } else if beyond(warning) {
        Verdict::Warning
    } else {
        Verdict::Ok
    }
}

/// One judged indicator.
#[derive(Clone, Debug, PartialEq)]
pub struct Indicator {
    pub name: String,
    pub value: f64,
    pub unit: Unit,
    pub verdict: Verdict,
    /// Empty when OK; built from the quantized value so it changes only when the revision may.
    pub message: String,
}

fn describe(unit: Unit, q: f64) -> String {
    match unit {
        Unit::Percent => format!("{q}%"),
        Unit::Seconds => format!("{q}s"),
        Unit::Ratio => format!("{q}"),
        Unit::Bool => (if q >= 0.5 { "true" } else { "false" }).to_string(),
    }
}

/// Applies levels to one measurement.
pub fn evaluate(m: &Measurement, overrides: &[Threshold]) -> Indicator {
    let lower = lower_is_worse(&m.name);
    let (verdict, message) = match levels(&m.name, overrides) {
        None => (Verdict::Ok, String::new()),
        Some((warning, critical)) => {
            let verdict = judge(m.value, lower, (warning, critical));
            let message = if verdict == Verdict::Ok {
                String::new()
            } else {
                let cmp = if lower { "<=" } else { ">=" };
                let (word, level) = if verdict == Verdict::Critical {
                    ("critical", critical)
                } else {
                    ("warning", warning)
                };
                format!(
                    "{} is {}, {word} at {cmp} {}",
                    m.name,
                    describe(m.unit, quantize(&m.name, m.value)),
                    describe(m.unit, level)
                )
            };
            (verdict, message)
        }
    };
    Indicator {
        name: m.name.clone(),
        value: m.value,
        unit: m.unit,
        verdict,
        message,
    }
}

/// Judges one GPU: uncorrected ECC errors and temperature.
pub fn judge_gpu(gpu: &Gpu, overrides: &[Threshold]) -> (Verdict, String) {
    let mut verdict = Verdict::Ok;
    let mut why = Vec::new();
    for (name, value) in [
        ("gpu.ecc_uncorrected", gpu.ecc_uncorrected as f64),
        ("gpu.temperature_c", gpu.temperature_c),
    ] {
        if let Some(levels) = levels(name, overrides) {
            let v = judge(value, false, levels);
            if v > Verdict::Ok {
                let shown = if name == "gpu.temperature_c" {
                    quantize(name, value)
                } else {
                    value
                };
                why.push(format!("{name} is {shown}"));
            }
            verdict = verdict.max(v);
        }
    }
    (verdict, why.join("; "))
}

/// Static facts about the host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SystemInfo {
    pub kernel_release: String,
    pub boot_id: String,
    pub booted_at_unix: i64,
    pub cpus: u32,
    pub memory_total_bytes: u64,
}

/// The state of nodekeeper-managed host networking (filled by the network manager, issue 4).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct NetworkStatus {
    pub applied_generation: String,
    pub drifted: bool,
    pub drift: Vec<String>,
    pub reconverged_at_unix_ms: i64,
    pub last_error: String,
}

/// A judged GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct JudgedGpu {
    pub gpu: Gpu,
    pub verdict: Verdict,
    pub message: String,
}

/// The whole report, in plain data.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub node_name: String,
    pub agent_version: String,
    pub collected_at_unix_ms: i64,
    pub indicators: Vec<Indicator>,
    pub tunables: Vec<TunableStatus>,
    pub rules_revision: u64,
    pub interfaces: Vec<Interface>,
    pub gpu_present: bool,
    pub gpu_source: String,
    pub gpu_error: String,
    pub gpus: Vec<JudgedGpu>,
    pub plugins: Vec<Plugin>,
    /// (collector, error), sorted.
    pub collector_errors: Vec<(String, String)>,
    pub system: SystemInfo,
    pub network: NetworkStatus,
}

/// What the collectors produced, before judging.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub measurements: Vec<Measurement>,
    pub gpu: GpuReading,
    pub interfaces: Vec<Interface>,
    pub plugins: Vec<Plugin>,
    pub collector_errors: Vec<(String, String)>,
    pub system: SystemInfo,
}

/// Judges the inputs into a report (without tunables, which the caller adds).
pub fn assemble(inputs: Inputs, overrides: &[Threshold]) -> Report {
    let mut indicators: Vec<Indicator> = inputs
        .measurements
        .iter()
        .map(|m| evaluate(m, overrides))
        .collect();
    indicators.sort_by(|a, b| a.name.cmp(&b.name));
    let gpus = inputs
        .gpu
        .gpus
        .into_iter()
        .map(|gpu| {
            let (verdict, message) = judge_gpu(&gpu, overrides);
            JudgedGpu {
                gpu,
                verdict,
                message,
            }
        })
        .collect();
    let mut collector_errors = inputs.collector_errors;
    collector_errors.sort();
    Report {
        indicators,
        interfaces: inputs.interfaces,
        gpu_present: inputs.gpu.present,
        gpu_source: inputs.gpu.source,
        gpu_error: inputs.gpu.error,
        gpus,
        plugins: inputs.plugins,
        collector_errors,
        system: inputs.system,
        ..Report::default()
    }
}

/// The revision: a hash of everything in the report except timestamps of collection and raw
/// values finer than their significance step. Never 0 (0 means "no revision" to callers).
pub fn revision(r: &Report) -> u64 {
    let mut s = String::with_capacity(4096);
    // `write!` into a String cannot fail.
    let _ = writeln!(
        s,
        "node {} {} rules {}",
        r.node_name, r.agent_version, r.rules_revision
    );
    for i in &r.indicators {
        let _ = writeln!(
            s,
            "i {} {} {:?} {}",
            i.name,
            quantize(&i.name, i.value),
            i.verdict,
            i.message
        );
    }
    for t in &r.tunables {
        let _ = writeln!(
            s,
            "t {} {} {:?} {:?} {:?} {:?} {} {} {:?}",
            t.rule,
            t.key,
            t.current,
            t.verdict,
            t.expected,
            t.previous,
            t.repaired_at_unix_ms,
            t.conflict,
            t.error
        );
    }
    for i in &r.interfaces {
        let _ = writeln!(s, "n {i:?}");
    }
    let _ = writeln!(
        s,
        "g {} {:?} {:?}",
        r.gpu_present, r.gpu_source, r.gpu_error
    );
    for g in &r.gpus {
        let _ = writeln!(
            s,
            "g {} {} {} {} {} {} {} {:?} {:?}",
            g.gpu.index,
            g.gpu.uuid,
            g.gpu.model,
            g.gpu.memory_total_mib,
            // Memory in use and utilisation move constantly; 10% steps are what matters.
            (g.gpu.memory_used_mib as f64 / g.gpu.memory_total_mib.max(1) as f64 * 10.0).round(),
            quantize("gpu.temperature_c", g.gpu.temperature_c),
            (g.gpu.utilization_percent / 10.0).round(),
            g.verdict,
            g.message
        );
    }
    for p in &r.plugins {
        let _ = writeln!(s, "p {p:?}");
    }
    for e in &r.collector_errors {
        let _ = writeln!(s, "e {e:?}");
    }
    let _ = writeln!(s, "s {:?}", r.system);
    let _ = writeln!(s, "w {:?}", r.network);
    let digest = Sha256::digest(s.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(name: &str, value: f64, unit: Unit) -> Measurement {
        Measurement::new(name, value, unit)
    }

    #[test]
    fn default_levels_and_direction() {
        let i = evaluate(&m("memory.available_percent", 7.2, Unit::Percent), &[]);
        assert_eq!(i.verdict, Verdict::Warning);
        assert_eq!(
            i.message,
            "memory.available_percent is 7%, warning at <= 10%"
        );
        assert_eq!(
            evaluate(&m("memory.available_percent", 50.0, Unit::Percent), &[]).verdict,
            Verdict::Ok
        );
        assert_eq!(
            evaluate(&m("disk./var/lib.used_percent", 93.0, Unit::Percent), &[]).verdict,
            Verdict::Critical
        );
        assert_eq!(
            evaluate(&m("time.synchronized", 0.0, Unit::Bool), &[]).verdict,
            Verdict::Warning
        );
        assert_eq!(
            evaluate(&m("time.synchronized", 1.0, Unit::Bool), &[]).verdict,
            Verdict::Ok
        );
        assert_eq!(
            evaluate(&m("load.avg5_per_cpu", 4.5, Unit::Ratio), &[]).verdict,
            Verdict::Critical
        );
    }

    #[test]
    fn overrides_exact_beats_prefix_beats_default() {
        let overrides = vec![
            Threshold {
                indicator: "disk.*".into(),
                warning: 50.0,
                critical: 60.0,
            },
            Threshold {
                indicator: "disk./data.*".into(),
                warning: 95.0,
                critical: 99.0,
            },
            Threshold {
                indicator: "disk./.used_percent".into(),
                warning: 10.0,
                critical: 20.0,
            },
        ];
        assert_eq!(
            levels("disk./var.used_percent", &overrides),
            Some((50.0, 60.0))
        );
        assert_eq!(
            levels("disk./data.used_percent", &overrides),
            Some((95.0, 99.0))
        );
        assert_eq!(
            levels("disk./.used_percent", &overrides),
            Some((10.0, 20.0))
        );
        assert_eq!(
            levels("conntrack.used_percent", &overrides),
            Some((75.0, 90.0))
        );
        assert_eq!(levels("something.else", &overrides), None);
    }

    #[test]
    fn known_indicators() {
        assert!(known_indicator("disk./var/lib.used_percent"));
        assert!(known_indicator("psi.*"));
        assert!(known_indicator("memory.available_percent"));
        assert!(!known_indicator("memory.avail"));
        assert!(!known_indicator("a*b*"));
    }

    #[test]
    fn gpu_verdicts() {
        let cool = Gpu {
            temperature_c: 40.0,
            ..Gpu::default()
        };
        assert_eq!(judge_gpu(&cool, &[]).0, Verdict::Ok);
        let ecc = Gpu {
            ecc_uncorrected: 2,
            temperature_c: 40.0,
            ..Gpu::default()
        };
        let (v, msg) = judge_gpu(&ecc, &[]);
        assert_eq!(v, Verdict::Critical);
        assert!(msg.contains("ecc"), "{msg}");
        let hot = Gpu {
            temperature_c: 88.0,
            ..Gpu::default()
        };
        assert_eq!(judge_gpu(&hot, &[]).0, Verdict::Warning);
    }

    fn sample(mem: f64) -> Report {
        let inputs = Inputs {
            measurements: vec![
                m("memory.available_percent", mem, Unit::Percent),
                m("cpu.busy_percent", 12.0, Unit::Percent),
            ],
            ..Inputs::default()
        };
        assemble(inputs, &[])
    }

    #[test]
    fn revision_ignores_noise_and_time() {
        let a = sample(50.1);
        let mut b = sample(50.3);
        b.collected_at_unix_ms = 123_456;
        assert_eq!(revision(&a), revision(&b));
        // A move past the significance step, or a verdict change, is a new revision.
        assert_ne!(revision(&a), revision(&sample(52.0)));
        assert_ne!(revision(&a), revision(&sample(8.0)));
        let mut c = sample(50.1);
        c.collector_errors.push(("gpu".into(), "boom".into()));
        assert_ne!(revision(&a), revision(&c));
    }

    #[test]
    fn indicators_sorted_by_name() {
        let r = sample(50.0);
        assert_eq!(r.indicators[0].name, "cpu.busy_percent");
        assert_eq!(r.indicators[1].name, "memory.available_percent");
    }
}
