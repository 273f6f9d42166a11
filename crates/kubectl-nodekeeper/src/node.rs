//! `node NAME`: one node's full report as the controller holds it (through the service proxy):
//! whether the agent answers (or went stale) and refuses the tuning rules, its conditions,
//! indicators with verdicts, tunables, interfaces with nodekeeper's own marked (pods' veths only
//! counted), GPUs and plugins. `-o json|yaml` passes the controller's JSON on unchanged.

use k8s_openapi::api::core::v1::Node;
use kube::Api;

use crate::Outcome;
use crate::connect::Connection;
use crate::controller_api::{self, Answer, NodeDetail};
use crate::error::Error;
use crate::render::{self, Cell, Output, Table, verdict_word};

#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  kubectl nodekeeper node worker-7\n  kubectl nodekeeper node worker-7 -o wide   # MACs, previous values, GPU UUIDs\n  kubectl nodekeeper node worker-7 -o json | jq '.report.tunables'"
)]
pub struct Args {
    /// The node's name (as in `kubectl get nodes`).
    pub name: String,
}

pub async fn run(conn: &Connection, args: &Args, out: &Output) -> Result<Outcome, Error> {
    let name = args.name.as_str();
    if name.is_empty() || name.contains('/') {
        return Err(Error::NodeNotFound {
            name: name.to_owned(),
        });
    }
    let value = match controller_api::get(conn, &format!("/api/v1/nodes/{name}")).await? {
        Answer::Found(value) => value,
        Answer::NotFound(detail) => {
            // Tell an unknown node from one the controller does not manage.
            let nodes: Api<Node> = Api::all(conn.client.clone());
            let exists = nodes
                .get_opt(name)
                .await
                .map_err(|e| conn.error(&format!("get node {name}"), e))?
                .is_some();
            return Err(if exists {
                Error::NodeNotManaged {
                    name: name.to_owned(),
                    detail,
                }
            } else {
                Error::NodeNotFound {
                    name: name.to_owned(),
                }
            });
        }
    };
    if let Some(text) = out.structured(&value) {
        render::print(&text)?;
        return Ok(Outcome::Ok);
    }
    let detail: NodeDetail =
        serde_json::from_value(value).map_err(|e| Error::UnexpectedAnswer {
            what: format!("the controller's report for node {name}"),
            detail: e.to_string(),
        })?;
    render::print(&format(&detail, out))?;
    Ok(Outcome::Ok)
}

/// Renders a node's report as tables.
pub fn format(d: &NodeDetail, out: &Output) -> String {
    let wide = out.wide();
    let mut facts = vec![
        ("Node", d.name.clone()),
        ("Address", d.address.clone().unwrap_or_else(|| "-".into())),
    ];
    if let Some(r) = &d.report {
        facts.push(("Agent", r.agent_version.clone()));
        facts.push((
            "Report",
            format!(
                "revision {}, collected {}{}",
                r.revision,
                render::unix_ms(r.collected_at_unix_ms),
                if d.stale { " (stale)" } else { "" }
            ),
        ));
        facts.push((
            "System",
            format!(
                "kernel {}, {} CPUs, {} MiB",
                r.system.kernel_release,
                r.system.cpus,
                r.system.memory_total_bytes / (1024 * 1024)
            ),
        ));
    } else if d.stale {
        // The controller drops a stale node's last report, so "no report" is not "never read".
        facts.push((
            "Report",
            "none: stale, no good answer from the agent for longer than staleAfter (the \
             controller drops the last report of a stale node)"
                .into(),
        ));
    } else {
        facts.push((
            "Report",
            "none yet: the controller has not read this node's agent".into(),
        ));
    }
    if d.consecutive_failures > 0 || d.last_failure.is_some() {
        let last = d
            .last_failure
            .as_ref()
            .map(|f| format!(", last: {} ({})", f.outcome, f.detail))
            .unwrap_or_default();
        facts.push((
            "Failures",
            format!("{} in a row{last}", d.consecutive_failures),
        ));
    }
    if let Some(refusal) = &d.rules_refused {
        facts.push((
            "Rules refused",
            format!(
                "revision {}: {} (the agent keeps its previous rules; fix the rule in ConfigMap \
                 nodekeeper-tuning)",
                refusal.revision, refusal.error
            ),
        ));
    }
    let mut text = render::key_values(&facts);

    let mut t = Table::new(&["TYPE", "STATUS", "REASON", "MESSAGE"]);
    for c in &d.conditions {
        t.row(vec![
            c.type_.as_str().into(),
            Cell::verdict(&c.status),
            c.reason.as_str().into(),
            c.message.as_str().into(),
        ]);
    }
    text.push_str(&render::section(out, "CONDITIONS", &t.render_or_empty(out)));

    let Some(r) = &d.report else {
        return text;
    };

    let mut t = Table::new(&["INDICATOR", "VALUE", "VERDICT", "MESSAGE"]);
    for i in &r.indicators {
        let value = with_unit(i.value, &i.unit);
        t.row(vec![
            i.name.as_str().into(),
            value.into(),
            Cell::verdict(verdict_word(&i.verdict)),
            i.message.as_str().into(),
        ]);
    }
    text.push_str(&render::section(out, "INDICATORS", &t.render_or_empty(out)));

    let mut headers = vec!["RULE", "KEY", "CURRENT", "EXPECTED", "VERDICT"];
    if wide {
        headers.extend(["PREVIOUS", "REPAIRED"]);
    }
    headers.push("NOTE");
    let mut t = Table::new(&headers);
    for tun in &r.tunables {
        let mut row: Vec<Cell> = vec![
            tun.rule.as_str().into(),
            tun.key.as_str().into(),
            tun.current.as_str().into(),
            tun.expected.as_str().into(),
            Cell::verdict(verdict_word(&tun.verdict)),
        ];
        if wide {
            row.push(dash(&tun.previous).into());
            row.push(render::unix_ms(tun.repaired_at_unix_ms).into());
        }
        let note = if !tun.error.is_empty() {
            tun.error.clone()
        } else if tun.conflict {
            "changed back by something else after repair".into()
        } else if tun.repaired_at_unix_ms > 0 {
            "repaired".into()
        } else {
            String::new()
        };
        row.push(note.into());
        t.row(row);
    }
    text.push_str(&render::section(out, "TUNABLES", &t.render_or_empty(out)));

    let mut headers = vec![
        "INTERFACE",
        "KIND",
        "MTU",
        "STATE",
        "ADDRESSES",
        "NODEKEEPER",
    ];
    if wide {
        headers.splice(1..1, ["INDEX", "MAC"]);
    }
    let mut t = Table::new(&headers);
    for i in &r.interfaces {
        let mut row: Vec<Cell> = vec![i.name.as_str().into()];
        if wide {
            row.push(i.index.to_string().into());
            row.push(dash(&i.mac).into());
        }
        let state = match (i.up, i.oper_state.as_str()) {
            (false, _) => "down".to_owned(),
            (true, oper) if oper.is_empty() || oper.eq_ignore_ascii_case("up") => "up".to_owned(),
            // Administratively up but not passing traffic (no carrier, dormant, ...).
            (true, oper) => format!("up ({})", oper.to_ascii_lowercase()),
        };
        row.extend([
            Cell::from(dash(&i.kind)),
            i.mtu.to_string().into(),
            state.into(),
            Cell::from(if i.addresses.is_empty() {
                "-".to_owned()
            } else {
                i.addresses.join(",")
            }),
            // What nodekeeper configured on this host (and would change or roll back).
            if i.managed {
                Cell::verdict("yes")
            } else {
                Cell::from("-")
            },
        ]);
        t.row(row);
    }
    let mut body = t.render_or_empty(out);
    // The agent leaves pods' host-side links out of its list (one per pod, they come and go with
    // pods) and sends their number.
    if r.pod_links > 0 {
        let links = if r.pod_links == 1 { "link" } else { "links" };
        body.push_str(&format!(
            "and {} pod {links} (host-side veths of pods, not listed)\n",
            r.pod_links
        ));
    }
    text.push_str(&render::section(out, "INTERFACES", &body));

    let gpu_body = if r.gpu.gpus.is_empty() {
        let mut line = if r.gpu.present {
            "GPUs reported present, but none listed".to_owned()
        } else {
            "no GPU".to_owned()
        };
        if !r.gpu.source.is_empty() {
            line.push_str(&format!(" (source: {})", r.gpu.source));
        }
        if !r.gpu.error.is_empty() {
            line.push_str(&format!("; error: {}", r.gpu.error));
        }
        line.push('\n');
        line.push_str(&gpu_overall(&r.gpu));
        line
    } else {
        let mut headers = vec!["GPU", "MODEL", "MEMORY", "TEMP", "UTIL", "VERDICT"];
        if wide {
            headers.extend(["UUID", "ECC", "XID"]);
        }
        headers.push("MESSAGE");
        let mut t = Table::new(&headers);
        for g in &r.gpu.gpus {
            let mut row: Vec<Cell> = vec![
                g.index.to_string().into(),
                g.model.as_str().into(),
                format!("{}/{} MiB", g.memory_used_mib, g.memory_total_mib).into(),
                format!("{}C", trim_float(g.temperature_c)).into(),
                format!("{}%", trim_float(g.utilization_percent)).into(),
                Cell::verdict(verdict_word(&g.verdict)),
            ];
            if wide {
                row.push(g.uuid.as_str().into());
                row.push(g.ecc_uncorrected.to_string().into());
                row.push(g.xid_events.to_string().into());
            }
            row.push(g.message.as_str().into());
            t.row(row);
        }
        let mut body = t.render(out);
        // A partial reading: some GPUs listed, the rest not read.
        if !r.gpu.error.is_empty() {
            body.push_str(&format!("error: {}\n", r.gpu.error));
        }
        body.push_str(&gpu_overall(&r.gpu));
        body
    };
    text.push_str(&render::section(out, "GPUS", &gpu_body));

    let mut t = Table::new(&["PLUGIN", "STATE", "VERDICT", "MESSAGE"]);
    for p in &r.plugins {
        t.row(vec![
            p.name.as_str().into(),
            p.state.as_str().into(),
            Cell::verdict(verdict_word(&p.verdict)),
            p.message.as_str().into(),
        ]);
    }
    text.push_str(&render::section(out, "PLUGINS", &t.render_or_empty(out)));

    if !r.collector_errors.is_empty() {
        let mut t = Table::new(&["COLLECTOR", "ERROR"]);
        for (collector, error) in &r.collector_errors {
            t.row(vec![collector.as_str().into(), error.as_str().into()]);
        }
        text.push_str(&render::section(out, "COLLECTOR ERRORS", &t.render(out)));
    }
    text
}

/// The agent's word over all GPUs when it says more than the GPUs listed do: fewer GPUs than
/// `--expected-gpus`, which no single GPU's verdict can say. Empty otherwise.
fn gpu_overall(gpu: &controller_api::Gpu) -> String {
    // Without GPUs and without an expected count the agent repeats the reading's error, which
    // is already shown.
    if gpu.message.is_empty() || gpu.message == gpu.error {
        return String::new();
    }
    format!(
        "all GPUs: {}: {}\n",
        verdict_word(&gpu.verdict),
        gpu.message
    )
}

/// An indicator's value with its unit as a person writes it: `91.4%`, `16s`, `1.74`, `false`.
fn with_unit(value: f64, unit: &str) -> String {
    match unit {
        "percent" | "%" => format!("{}%", trim_float(value)),
        "seconds" | "s" => format!("{}s", trim_float(value)),
        "bool" => (if value == 0.0 { "false" } else { "true" }).to_owned(),
        "" | "ratio" | "count" => trim_float(value),
        other => format!("{} {other}", trim_float(value)),
    }
}

fn dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

/// `12`, `0.75`, `3.1` — no trailing zeros, at most two decimals.
fn trim_float(v: f64) -> String {
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_owned()
    } else {
        s.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::OutputFormat;

    fn sample() -> NodeDetail {
        serde_json::from_value(sample_json()).unwrap()
    }

    fn sample_json() -> serde_json::Value {
        serde_json::json!({
            "name": "worker-7",
            "address": "10.0.4.7",
            "stale": false,
            "consecutiveFailures": 0,
            "conditions": [
                {"type": "NodekeeperReachable", "status": "True", "reason": "AgentReachable", "message": ""},
                {"type": "TunablesInBounds", "status": "False", "reason": "TunablesOutOfBounds", "message": "somaxconn: 128, want >= 4096"}
            ],
            "report": {
                "nodeName": "worker-7", "agentVersion": "0.1.0", "revision": 12,
                "collectedAtUnixMs": 1700000000000i64,
                "indicators": [
                    {"name": "load1-per-cpu", "value": 0.25, "unit": "ratio", "verdict": "ok"},
                    {"name": "memory-available", "value": 3.5, "unit": "percent", "verdict": "critical", "message": "below 5%"}
                ],
                "tunables": [
                    {"rule": "somaxconn", "key": "net.core.somaxconn", "current": "128", "expected": ">= 4096", "verdict": "critical"}
                ],
                "interfaces": [
                    {"name": "eth0", "index": 2, "mac": "02:00:00:00:00:01", "mtu": 9000, "up": true, "operState": "UP", "kind": "", "addresses": ["10.0.4.7/24"], "managed": false},
                    {"name": "eth0.100", "index": 5, "mac": "02:00:00:00:00:01", "mtu": 9000, "up": true, "operState": "UP", "kind": "vlan", "addresses": ["192.168.100.7/24"], "managed": true}
                ],
                "podLinks": 37,
                "gpu": {"present": false, "source": "nvidia-smi", "gpus": []},
                "plugins": [{"name": "Compute Instance Monitoring", "state": "RUNNING", "verdict": "ok"}],
                "collectorErrors": [["pressure", "no /proc/pressure: kernel without PSI"]],
                "system": {"kernelRelease": "6.8.0", "cpus": 16, "memoryTotalBytes": 68719476736u64}
            }
        })
    }

    #[test]
    fn piped_output_matches_the_golden_file() {
        let text = format(&sample(), &Output::plain(OutputFormat::Table));
        crate::golden::check("node", &text);
    }

    #[test]
    fn wide_adds_columns_and_a_missing_report_is_said() {
        let text = format(&sample(), &Output::plain(OutputFormat::Wide));
        assert!(text.contains("02:00:00:00:00:01"), "{text}");
        let mut d = sample();
        d.report = None;
        let text = format(&d, &Output::plain(OutputFormat::Table));
        assert!(text.contains("none yet"), "{text}");
        assert!(!text.contains("INDICATORS"), "{text}");
    }

    /// The controller's page of a node whose agent went stale: the sweep drops the report.
    fn stale_sample() -> NodeDetail {
        serde_json::from_value(serde_json::json!({
            "name": "worker-7",
            "address": "10.0.4.7",
            "stale": true,
            "consecutiveFailures": 6,
            "lastFailure": {"outcome": "Unreachable", "detail": "connect: connection refused"},
            "rulesRefused": null,
            "conditions": [
                {"type": "NodekeeperReachable", "status": "False", "reason": "AgentUnreachable",
                 "message": "the nodekeeper agent at 10.0.4.7:9443 has not answered for more than 15m"}
            ],
            "report": null
        }))
        .unwrap()
    }

    #[test]
    fn a_stale_node_is_not_called_never_read() {
        let text = format(&stale_sample(), &Output::plain(OutputFormat::Table));
        let report = text.lines().find(|l| l.starts_with("Report:")).unwrap();
        assert!(report.contains("stale"), "{text}");
        assert!(report.contains("staleAfter"), "{text}");
        assert!(!report.contains("not read"), "{text}");
        assert!(
            text.contains("6 in a row, last: Unreachable (connect: connection refused)"),
            "{text}"
        );
        // A node never read and not yet stale still says so.
        let mut d = stale_sample();
        d.stale = false;
        let text = format(&d, &Output::plain(OutputFormat::Table));
        assert!(
            text.contains("none yet: the controller has not read"),
            "{text}"
        );
    }

    #[test]
    fn says_which_rules_revision_the_agent_refuses_and_why() {
        let mut value = sample_json();
        value["rulesRefused"] = serde_json::json!({
            "revision": 7,
            "error": "rule \"somaxconn\" (#1): field `key`: no such sysctl"
        });
        let d: NodeDetail = serde_json::from_value(value).unwrap();
        let text = format(&d, &Output::plain(OutputFormat::Table));
        let line = text
            .lines()
            .find(|l| l.starts_with("Rules refused:"))
            .unwrap_or_else(|| panic!("no refusal line: {text}"));
        assert!(
            line.contains("revision 7: rule \"somaxconn\" (#1): field `key`: no such sysctl"),
            "{line}"
        );
        assert!(line.contains("ConfigMap nodekeeper-tuning"), "{line}");
        // None refused (the controller serves null): no line.
        let text = format(&sample(), &Output::plain(OutputFormat::Table));
        assert!(!text.contains("Rules refused"), "{text}");
    }

    #[test]
    fn missing_gpus_are_said_with_or_without_a_gpu_listed() {
        let mut value = sample_json();
        value["report"]["gpu"] = serde_json::json!({
            "present": false, "source": "nvidia-smi", "gpus": [],
            "expected": 8, "verdict": "critical", "message": "expected 8 GPUs, found 0"
        });
        let d: NodeDetail = serde_json::from_value(value.clone()).unwrap();
        let text = format(&d, &Output::plain(OutputFormat::Table));
        assert!(
            text.contains(
                "no GPU (source: nvidia-smi)\nall GPUs: critical: expected 8 GPUs, found 0\n"
            ),
            "{text}"
        );
        value["report"]["gpu"] = serde_json::json!({
            "present": true, "source": "nvml", "error": "GPU 1: unknown error",
            "gpus": [{"index": 0, "uuid": "GPU-0", "model": "H100", "verdict": "ok"}],
            "expected": 2, "verdict": "critical",
            "message": "expected 2 GPUs, found 1 (GPU 1: unknown error)"
        });
        let d: NodeDetail = serde_json::from_value(value).unwrap();
        let text = format(&d, &Output::plain(OutputFormat::Table));
        assert!(text.contains("error: GPU 1: unknown error\n"), "{text}");
        assert!(
            text.contains("all GPUs: critical: expected 2 GPUs, found 1 (GPU 1: unknown error)"),
            "{text}"
        );
        // Without an expected count the agent's word repeats the error: said once.
        let d: NodeDetail = serde_json::from_value({
            let mut v = sample_json();
            v["report"]["gpu"] = serde_json::json!({
                "present": false, "source": "nvml", "error": "nvmlInit: no driver", "gpus": [],
                "verdict": "unspecified", "message": "nvmlInit: no driver"
            });
            v
        })
        .unwrap();
        let text = format(&d, &Output::plain(OutputFormat::Table));
        assert_eq!(text.matches("nvmlInit: no driver").count(), 1, "{text}");
    }
}
