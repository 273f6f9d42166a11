//! The node report: indicator verdicts against thresholds (defaults and the controller's
//! overrides, judged with `nodekeeper_model::indicators`), GPU verdicts, and the report revision —
//! a hash of the content that matters (verdicts, messages, discrete state, values quantized to
//! each indicator's significance step), never of timestamps, nor of pods coming and going (pods'
//! host-side links are counted, not listed, and the revision takes in only whether there are any).

use std::fmt::Write as _;

use nodekeeper_model::indicators::{Threshold, Verdict, judge, levels, lower_is_worse, quantize};
use sha2::{Digest, Sha256};

use crate::collect::gpu::{Gpu, GpuReading};
use crate::collect::interfaces::Interface;
use crate::collect::oca::Plugin;
use crate::collect::{Measurement, Unit};
use crate::monitor::state::ProblemState;
use crate::network::NetworkStatus;
use crate::tunables::TunableStatus;

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

/// Judges one GPU: uncorrected ECC errors and temperature against their levels, then the health
/// facts (`collect::gpu::health`: lost, remapped rows, NVLink, PCIe width, AER, throttling, XID,
/// unreadable fields).
pub fn judge_gpu(gpu: &Gpu, overrides: &[Threshold]) -> (Verdict, String) {
    let (mut verdict, mut why) = crate::collect::gpu::health(gpu, std::time::SystemTime::now());
    let unknown = verdict == Verdict::Unspecified;
    if unknown {
        verdict = Verdict::Ok;
    }
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
    if unknown && verdict == Verdict::Ok {
        verdict = Verdict::Unspecified;
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
    /// Without pod links (`Interface::is_pod_link`), which are only counted.
    pub interfaces: Vec<Interface>,
    /// Pods' host-side links left out of `interfaces`; display only (see [`revision`]).
    pub pod_links: u32,
    pub gpu_present: bool,
    pub gpu_source: String,
    pub gpu_error: String,
    pub gpus: Vec<JudgedGpu>,
    /// `--expected-gpus`, and the verdict over all GPUs (fewer than expected is Critical).
    pub gpu_expected: Option<u32>,
    pub gpu_verdict: Verdict,
    pub gpu_message: String,
    pub plugins: Vec<Plugin>,
    /// Oracle Cloud Agent's version and where its plugin states were read (empty: no OCA).
    pub oca_version: String,
    pub oca_source: String,
    /// (collector, error), sorted.
    pub collector_errors: Vec<(String, String)>,
    pub system: SystemInfo,
    pub network: NetworkStatus,
    /// What the node problem monitors found (kernel log, custom plugins).
    pub problems: ProblemState,
}

/// What the collectors produced, before judging.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub measurements: Vec<Measurement>,
    pub gpu: GpuReading,
    /// Every link, pod links included, `managed` final: [`assemble`] counts the pod links.
    pub interfaces: Vec<Interface>,
    pub plugins: Vec<Plugin>,
    pub oca_version: String,
    pub oca_source: String,
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
    let gpus: Vec<JudgedGpu> = inputs
        .gpu
        .gpus
        .clone()
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
    let verdicts: Vec<Verdict> = gpus.iter().map(|g| g.verdict).collect();
    let (gpu_verdict, gpu_message) = crate::collect::gpu::judge_reading(&inputs.gpu, &verdicts);
    let mut collector_errors = inputs.collector_errors;
    collector_errors.sort();
    let mut interfaces = inputs.interfaces;
    let pod_links = crate::collect::interfaces::remove_pod_links(&mut interfaces);
    Report {
        gpu_expected: inputs.gpu.expected,
        gpu_verdict,
        gpu_message,
        indicators,
        interfaces,
        pod_links,
        gpu_present: inputs.gpu.present,
        gpu_source: inputs.gpu.source,
        gpu_error: inputs.gpu.error,
        gpus,
        plugins: inputs.plugins,
        oca_version: inputs.oca_version,
        oca_source: inputs.oca_source,
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
    // The pod link count changes with every pod scheduled or deleted; counted here it would make
    // nearly every read on a busy node a full report, for a number only displayed. Whether there
    // are any (a drained node or one without pod networking, against one running pods) is kept.
    let _ = writeln!(s, "pods {}", r.pod_links > 0);
    let _ = writeln!(
        s,
        "g {} {:?} {:?} {:?} {:?} {:?}",
        r.gpu_present, r.gpu_source, r.gpu_error, r.gpu_expected, r.gpu_verdict, r.gpu_message
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
    let _ = writeln!(s, "o {:?} {:?}", r.oca_version, r.oca_source);
    for e in &r.collector_errors {
        let _ = writeln!(s, "e {e:?}");
    }
    let _ = writeln!(s, "s {:?}", r.system);
    let _ = writeln!(s, "w {:?}", r.network);
    r.problems.fingerprint(&mut s);
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

    fn veth(name: &str, peer_netns: bool) -> Interface {
        Interface {
            name: name.into(),
            kind: "veth".into(),
            up: true,
            oper_state: "up".into(),
            peer_netns,
            ..Interface::default()
        }
    }

    fn with_links(interfaces: Vec<Interface>) -> Report {
        let ens3 = Interface {
            name: "ens3".into(),
            addresses: vec!["10.0.0.5/24".into()],
            ..Interface::default()
        };
        let inputs = Inputs {
            interfaces: [vec![ens3], interfaces].concat(),
            ..Inputs::default()
        };
        assemble(inputs, &[])
    }

    #[test]
    fn pods_coming_and_going_keep_the_revision() {
        let a = with_links(vec![veth("cali1", true), veth("cali2", true)]);
        let b = with_links(vec![
            veth("cali2", true),
            veth("cali3", true),
            veth("lxc9", true),
        ]);
        assert_eq!(revision(&a), revision(&b));
        assert_eq!((a.pod_links, b.pod_links), (2, 3));
        let names: Vec<&str> = b.interfaces.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["ens3"]);
        // No pods at all against some is a new revision; so is any other link changing.
        assert_ne!(revision(&a), revision(&with_links(vec![])));
        let c = with_links(vec![veth("cali1", true), veth("nkv0", false)]);
        assert_eq!(c.interfaces.len(), 2);
        assert_ne!(revision(&a), revision(&c));
        let mut managed = veth("nkv1", true);
        managed.managed = true;
        assert_ne!(
            revision(&a),
            revision(&with_links(vec![veth("cali1", true), managed]))
        );
    }

    #[test]
    fn indicators_sorted_by_name() {
        let r = sample(50.0);
        assert_eq!(r.indicators[0].name, "cpu.busy_percent");
        assert_eq!(r.indicators[1].name, "memory.available_percent");
    }
}
