//! Health indicators and their verdicts, written once: the indicator families the agent reports,
//! their default warning and critical levels and direction, which names a threshold override may
//! use ([`known_indicator`], [`check_threshold`]), the levels in force ([`levels`]), judging a
//! value ([`judge`]) and the significance step a value is rounded to ([`quantize`]). The agent
//! judges its measurements with these; the controller's ConfigMap parser refuses what the agent
//! would refuse with the same functions.

use serde::{Deserialize, Serialize};

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

/// An override of an indicator's warning and critical levels (the tuning ConfigMap's
/// `thresholds`, pushed to agents with `SetRules`).
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

/// The families whose indicators can start with `prefix`.
fn families_under(prefix: &str) -> impl Iterator<Item = &'static Family> + '_ {
    FAMILIES.iter().filter(move |f| {
        // The family's fixed start; anything may follow it where it has a `*`.
        let (start, wild) = match f.pattern.split_once('*') {
            Some((start, _)) => (start, true),
            None => (f.pattern, false),
        };
        start.starts_with(prefix) || (wild && prefix.starts_with(start))
    })
}

/// Whether a threshold's `indicator` names something the agent measures (or may measure: disk
/// names depend on the configured mounts). A prefix (`disk.*`, `psi.*`, `*`) is known when some
/// indicator the agent reports can start with it.
pub fn known_indicator(pattern: &str) -> bool {
    if let Some(prefix) = pattern.strip_suffix('*') {
        return !prefix.contains('*') && families_under(prefix).next().is_some();
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

/// Checks one threshold override; on refusal, the field at fault (`indicator`, `warning` or
/// `critical`) and why. The ConfigMap parser and the agent's `SetRules` both call this, so an
/// override one accepts the other accepts too.
pub fn check_threshold(t: &Threshold) -> Result<(), (&'static str, String)> {
    if !known_indicator(&t.indicator) {
        return Err((
            "indicator",
            format!(
                "{:?} is not an indicator the agent reports; use a name such as \
                 memory.available_percent or a prefix ending in `*` such as disk.*",
                t.indicator
            ),
        ));
    }
    for (field, value) in [("warning", t.warning), ("critical", t.critical)] {
        if !value.is_finite() {
            return Err((field, format!("{value} is not a finite number")));
        }
    }
    // One pair of levels cannot judge indicators where higher is worse and ones where lower is
    // worse alike: `time.*` at (1, 5) would call a synchronised clock (time.synchronized = 1)
    // Warning. Such a prefix is refused, naming the indicators it covers.
    if let Some(prefix) = t.indicator.strip_suffix('*') {
        let (lower, higher): (Vec<&Family>, Vec<&Family>) =
            families_under(prefix).partition(|f| f.lower_is_worse);
        if !lower.is_empty() && !higher.is_empty() {
            let names =
                |fs: &[&Family]| fs.iter().map(|f| f.pattern).collect::<Vec<_>>().join(", ");
            return Err((
                "indicator",
                format!(
                    "{:?} covers indicators where higher is worse ({}) and ones where lower is \
                     worse ({}), which one pair of levels cannot judge; give thresholds for \
                     these by name or by a narrower prefix",
                    t.indicator,
                    names(&higher),
                    names(&lower)
                ),
            ));
        }
    }
    // A prefix's levels are not checked against a direction (mixed ones are refused above).
    if !t.indicator.ends_with('*') {
        let lower = lower_is_worse(&t.indicator);
        if (lower && t.critical > t.warning) || (!lower && t.critical < t.warning) {
            let word = if lower { "at or below" } else { "at or above" };
            return Err((
                "critical",
                format!("must be {word} `warning` for this indicator"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(indicator: &str, warning: f64, critical: f64) -> Threshold {
        Threshold {
            indicator: indicator.into(),
            warning,
            critical,
        }
    }

    #[test]
    fn default_levels_and_direction() {
        assert_eq!(
            judge(7.2, true, levels("memory.available_percent", &[]).unwrap()),
            Verdict::Warning
        );
        assert_eq!(
            judge(
                93.0,
                false,
                levels("disk./var/lib.used_percent", &[]).unwrap()
            ),
            Verdict::Critical
        );
        assert!(lower_is_worse("time.synchronized"));
        assert!(!lower_is_worse("load.avg5_per_cpu"));
    }

    #[test]
    fn overrides_exact_beats_prefix_beats_default() {
        let overrides = vec![
            t("disk.*", 50.0, 60.0),
            t("disk./data.*", 95.0, 99.0),
            t("disk./.used_percent", 10.0, 20.0),
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
        for known in [
            "disk./var/lib.used_percent",
            "psi.*",
            "disk.*",
            "disk./data.*",
            "load.*",
            "lo*",
            "*",
            "memory.available_percent",
        ] {
            assert!(known_indicator(known), "{known}");
        }
        for unknown in ["memory.avail", "a*b*", "bogus*", "memory.x*", "", "di*sk"] {
            assert!(!known_indicator(unknown), "{unknown}");
        }
    }

    #[test]
    fn thresholds_are_checked_field_by_field() {
        assert_eq!(check_threshold(&t("disk.*", 80.0, 90.0)), Ok(()));
        assert_eq!(
            check_threshold(&t("bogus", 1.0, 2.0)).unwrap_err().0,
            "indicator"
        );
        assert_eq!(
            check_threshold(&t("disk.*", f64::NAN, 2.0)).unwrap_err().0,
            "warning"
        );
        let (field, why) = check_threshold(&t("memory.available_percent", 5.0, 10.0)).unwrap_err();
        assert_eq!(field, "critical");
        assert!(why.contains("at or below"), "{why}");
        let (field, why) = check_threshold(&t("conntrack.used_percent", 90.0, 75.0)).unwrap_err();
        assert_eq!(field, "critical");
        assert!(why.contains("at or above"), "{why}");
    }

    #[test]
    fn a_prefix_covering_both_directions_is_refused() {
        for mixed in ["*", "time.*", "t*", "time*"] {
            let (field, why) = check_threshold(&t(mixed, 1.0, 5.0)).unwrap_err();
            assert_eq!(field, "indicator", "{mixed}");
            for part in ["time.synchronized", "time.max_error_seconds", "by name"] {
                assert!(why.contains(part), "{mixed}: {part:?} missing from {why}");
            }
        }
        // What such a prefix would have done: a synchronised clock judged Critical.
        let levels = levels("time.synchronized", &[t("time.*", 1.0, 5.0)]).unwrap();
        assert_eq!(judge(1.0, true, levels), Verdict::Critical);
        for uniform in [
            "disk.*",
            "psi.*",
            "lo*",
            "time.max*",
            "time.sync*",
            "m*",
            "gpu.*",
        ] {
            assert_eq!(check_threshold(&t(uniform, 1.0, 5.0)), Ok(()), "{uniform}");
        }
    }

    #[test]
    fn quantize_rounds_to_the_step() {
        assert_eq!(quantize("memory.available_percent", 50.4), 50.0);
        assert_eq!(quantize("load.avg1_per_cpu", 1.13), 1.25);
        assert_eq!(quantize("unknown", -0.2), 0.0);
    }
}
