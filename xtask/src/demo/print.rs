//! How the demo shows what the controller's HTTP API and the API server answer: the fleet
//! summary, each node's report and tunables, the Node conditions, and a NetworkTest's status and
//! per-pair results.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;

use k8s_openapi::api::core::v1::Node;
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::names;
use serde_json::Value;

pub(super) fn print_summary(summary: &Value, http: SocketAddr) {
    let fleet = &summary["fleet"];
    println!();
    println!("    Fleet summary (GET http://{http}/api/v1/summary):");
    println!(
        "      nodes {}  read {}  stale {}  without InternalIP {}",
        fleet["nodes"], fleet["read"], fleet["stale"], fleet["withoutInternalIp"]
    );
    if let Some(conditions) = fleet["conditions"].as_object() {
        let list: Vec<String> = conditions
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        println!("      conditions  {}", list.join("  "));
    }
    match fleet["tunablesOutOfBounds"].as_object() {
        Some(out) if !out.is_empty() => {
            let list: Vec<String> = out
                .iter()
                .map(|(k, v)| format!("{k}: {v} node(s)"))
                .collect();
            println!("      tunables out of bounds  {}", list.join("  "));
        }
        _ => println!("      tunables out of bounds  none"),
    }
    if let Some(seconds) = summary["initialSweepSeconds"].as_f64() {
        println!("      first sweep of the fleet took {seconds:.2}s");
    }
}

/// An indicator's value for people: `93%`, `16.0s`, `2.27`.
fn with_unit(value: Option<f64>, unit: &str) -> String {
    let Some(v) = value else { return "?".into() };
    match unit {
        "percent" => format!("{v:.0}%"),
        "seconds" => format!("{v:.1}s"),
        "bool" => (if v == 0.0 { "false" } else { "true" }).into(),
        "" | "ratio" => format!("{v:.2}"),
        other => format!("{v:.2} {other}"),
    }
}

fn verdict_counts(items: &Value) -> String {
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for item in items.as_array().into_iter().flatten() {
        *counts
            .entry(item["verdict"].as_str().unwrap_or("?"))
            .or_default() += 1;
    }
    let get = |k: &str| counts.get(k).copied().unwrap_or(0);
    format!(
        "{} ok, {} warn, {} crit",
        get("ok"),
        get("warning"),
        get("critical")
    )
}

fn condition_of<'a>(detail: &'a Value, type_: &str) -> Option<&'a Value> {
    detail["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

pub(super) fn print_nodes(details: &[Value], http: SocketAddr) {
    println!();
    println!("    Nodes as the controller sees them (GET http://{http}/api/v1/nodes/<name>):");
    println!(
        "      {:<8} {:<12} {:<10} {:<26} {:<22} {:>9} {:>9}",
        "NODE", "ADDRESS", "REACHABLE", "TUNABLES", "INDICATORS", "LOAD1/CPU", "MEM AVAIL"
    );
    for d in details {
        let status = |t: &str| {
            condition_of(d, t)
                .map(|c| {
                    format!(
                        "{} {}",
                        c["status"].as_str().unwrap_or("?"),
                        c["reason"].as_str().unwrap_or("")
                    )
                })
                .unwrap_or_else(|| "-".into())
        };
        let indicator = |name: &str| {
            d["report"]["indicators"]
                .as_array()
                .and_then(|a| a.iter().find(|i| i["name"] == name))
                .and_then(|i| i["value"].as_f64())
        };
        println!(
            "      {:<8} {:<12} {:<10} {:<26} {:<22} {:>9} {:>9}",
            d["name"].as_str().unwrap_or("?"),
            d["address"].as_str().unwrap_or("-"),
            condition_of(d, names::NODE_CONDITION_REACHABLE)
                .and_then(|c| c["status"].as_str())
                .unwrap_or("-"),
            status(names::NODE_CONDITION_TUNABLES_IN_BOUNDS),
            verdict_counts(&d["report"]["indicators"]),
            indicator("load.avg1_per_cpu").map_or("-".into(), |v| format!("{v:.2}")),
            indicator("memory.available_percent").map_or("-".into(), |v| format!("{v:.0}%")),
        );
    }
    if let Some(first) = details.first() {
        let flagged: Vec<String> = first["report"]["indicators"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|i| i["verdict"] != "ok")
            .map(|i| {
                format!(
                    "{} {} {}",
                    i["name"].as_str().unwrap_or("?"),
                    with_unit(i["value"].as_f64(), i["unit"].as_str().unwrap_or("")),
                    i["verdict"].as_str().unwrap_or("?"),
                )
            })
            .collect();
        println!(
            "      Every agent reads this machine's /proc, so their indicators agree; not ok on {}: {}",
            first["name"].as_str().unwrap_or("?"),
            if flagged.is_empty() {
                "none".into()
            } else {
                flagged.join(", ")
            }
        );
    }
    println!();
    println!(
        "    Tunables per node (rules from the tuning ConfigMap, evaluated and repaired by each agent):"
    );
    for d in details {
        let mut line = String::new();
        for t in d["report"]["tunables"].as_array().into_iter().flatten() {
            let _ = write!(
                line,
                "{}={} {}",
                t["key"].as_str().unwrap_or("?"),
                t["current"].as_str().unwrap_or("?"),
                t["verdict"].as_str().unwrap_or("?")
            );
            if let Some(previous) = t["previous"].as_str().filter(|p| !p.is_empty()) {
                let _ = write!(line, " (repaired from {previous})");
            } else if t["verdict"] != "ok" {
                let _ = write!(line, " (want {})", t["expected"].as_str().unwrap_or("?"));
            }
            line.push_str("; ");
        }
        println!(
            "      {:<8} {}",
            d["name"].as_str().unwrap_or("?"),
            line.trim_end_matches("; ")
        );
    }
}

/// The nodekeeper-owned conditions on the Node objects, as `kubectl get node` shows them.
pub(super) fn print_conditions(nodes: &[Node]) {
    const OWNED: [&str; 7] = [
        names::NODE_CONDITION_REACHABLE,
        names::NODE_CONDITION_TUNABLES_IN_BOUNDS,
        names::NODE_CONDITION_NETWORK_READY,
        names::NODE_CONDITION_GPU_HEALTHY,
        names::NODE_CONDITION_MAINTENANCE_IN_PROGRESS,
        names::NODE_CONDITION_DRAIN_IN_PROGRESS,
        names::NODE_CONDITION_DRAINED,
    ];
    println!();
    println!(
        "    Node conditions written by nodekeeper (from the API server: kubectl get node <name> -o yaml):"
    );
    for node in nodes {
        let name = node.metadata.name.as_deref().unwrap_or("?");
        for c in node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| OWNED.contains(&c.type_.as_str()))
        {
            println!(
                "      {:<8} {:<20} {:<6} {:<20} {}",
                name,
                c.type_,
                c.status,
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or("")
            );
        }
    }
}

pub(super) fn print_network_test(test: &NetworkTest) {
    let Some(s) = &test.status else { return };
    let phase = s.phase.map_or("-".to_owned(), |p| format!("{p:?}"));
    println!(
        "    phase {phase}  nodes {} (unreachable {})  pairs {} (failed {})  success {}  loss {}",
        s.sources,
        s.sources_unreachable,
        s.pairs,
        s.pairs_failed,
        s.success_percent.map_or("-".into(), |v| format!("{v:.1}%")),
        s.loss_percent.map_or("-".into(), |v| format!("{v:.1}%")),
    );
    match &s.latency {
        Some(l) => println!(
            "    latency p50 {}µs  p95 {}µs  max {}µs  ({} of {} probes answered)",
            l.p50_us, l.p95_us, l.max_us, s.received, s.sent
        ),
        None => println!("    no probe was answered ({} sent)", s.sent),
    }
    if s.worst_failures.is_empty() {
        println!("    failing pairs: none");
    } else {
        println!("    failing pairs (worst first):");
        for f in &s.worst_failures {
            println!(
                "      {} -> {}: {:.0}% lost, {}",
                f.source, f.target, f.loss_percent, f.error
            );
        }
        if s.omitted_failures > 0 {
            println!("      … and {} more", s.omitted_failures);
        }
    }
}

/// The per-pair results the controller keeps in memory.
pub(super) fn print_pairs(page: &Value) {
    let pairs = page["pairs"].as_array().map_or(&[][..], Vec::as_slice);
    println!(
        "    Pairs (from the controller; {} in all):",
        page["totalPairs"].as_u64().unwrap_or(pairs.len() as u64)
    );
    for p in pairs.iter().take(12) {
        let rtts: Vec<String> = p["rttUs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .map(|v| format!("{v}µs"))
            .collect();
        let error = p["error"].as_str().filter(|e| !e.is_empty());
        println!(
            "      {:<8} -> {:<14} {}/{} answered  rtt {}{}",
            p["source"].as_str().unwrap_or("?"),
            p["targetId"].as_str().unwrap_or("?"),
            p["received"],
            p["sent"],
            if rtts.is_empty() {
                "-".into()
            } else {
                rtts.join(" ")
            },
            error.map(|e| format!("  error: {e}")).unwrap_or_default()
        );
    }
    if pairs.len() > 12 {
        println!("      …");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indicator_units_read_naturally() {
        assert_eq!(with_unit(Some(93.4), "percent"), "93%");
        assert_eq!(with_unit(Some(16.0), "seconds"), "16.0s");
        assert_eq!(with_unit(Some(0.0), "bool"), "false");
        assert_eq!(with_unit(Some(2.271), "ratio"), "2.27");
        assert_eq!(with_unit(None, "percent"), "?");
    }
}
