//! `status`: the fleet at a glance — the controller's counts (through the service proxy), the
//! active NetworkTests and NodeMaintenances (from the API), and with `-o wide` the nodes whose
//! nodekeeper conditions are not True. `--watch` refreshes until Ctrl-C.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, ListParams};
use kube::core::Resource as _;
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_api::crd::{NetworkTest, NodeMaintenance};
use nodekeeper_api::names;
use serde::Serialize;

use crate::Outcome;
use crate::connect::Connection;
use crate::controller_api::{self, Answer, Summary};
use crate::error::Error;
use crate::render::{self, Cell, Output, Table};

/// Shortest and longest `--interval`: faster would load the API server for no news (the
/// controller refreshes each node at most every few minutes); slower is not watching.
const MIN_INTERVAL: Duration = Duration::from_secs(1);
const MAX_INTERVAL: Duration = Duration::from_secs(600);
/// Rows listed per section before "and N more".
const MAX_ROWS: usize = 50;
/// The Node conditions nodekeeper writes.
const OWNED_CONDITIONS: [&str; 4] = [
    names::NODE_CONDITION_REACHABLE,
    names::NODE_CONDITION_TUNABLES_IN_BOUNDS,
    names::NODE_CONDITION_GPU_HEALTHY,
    names::NODE_CONDITION_NETWORK_READY,
];

#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  kubectl nodekeeper status\n  kubectl nodekeeper status -o wide      # also the nodes with a condition not True\n  kubectl nodekeeper status --watch --interval 10s"
)]
pub struct Args {
    /// Refresh until Ctrl-C (which exits 0).
    #[arg(short = 'w', long, env = "NODEKEEPER_WATCH")]
    pub watch: bool,
    /// Time between refreshes with --watch (1s to 10m).
    #[arg(long, env = "NODEKEEPER_INTERVAL", default_value = "5s", value_parser = interval)]
    pub interval: Duration,
}

fn interval(s: &str) -> Result<Duration, String> {
    let d = crate::cli::duration(s)?;
    if (MIN_INTERVAL..=MAX_INTERVAL).contains(&d) {
        Ok(d)
    } else {
        Err("the interval must be between 1s and 10m".into())
    }
}

/// What `status` shows; also its `-o json|yaml` form.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusView {
    pub controller: Summary,
    pub network_tests: Vec<TestRow>,
    pub node_maintenances: Vec<MaintenanceRow>,
    /// Only with `-o wide`: nodes with a nodekeeper condition that is not True.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem_nodes: Option<Vec<ProblemNode>>,
    /// Problem nodes not listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem_nodes_omitted: Option<usize>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TestRow {
    pub namespace: String,
    pub name: String,
    pub kind: String,
    pub phase: String,
    pub sources: u32,
    pub age_seconds: Option<i64>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceRow {
    pub name: String,
    pub stage: String,
    pub matched: u64,
    pub cordoned: u64,
    pub drained: u64,
    pub blocked: u64,
    pub failed: u64,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProblemNode {
    pub node: String,
    pub condition: String,
    pub status: String,
    pub reason: String,
}

pub async fn run(conn: &Connection, args: &Args, out: &Output) -> Result<Outcome, Error> {
    if !args.watch {
        let view = collect(conn, out.wide()).await?;
        render::print(&format(&view, out))?;
        return Ok(Outcome::Ok);
    }
    // The first round's error ends the command (nothing was ever shown); later ones are shown
    // and the next refresh tries again, as `watch` does.
    let mut first = true;
    let mut ticker = tokio::time::interval(args.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(Outcome::Ok),
            _ = ticker.tick() => {}
        }
        let result = tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(Outcome::Ok),
            result = collect(conn, out.wide()) => result,
        };
        let text = match (result, first) {
            (Ok(view), _) => match out.structured(&view) {
                // One document per line, so a script can read the stream line by line.
                Some(_) if out.format == crate::cli::OutputFormat::Json => {
                    serde_json::to_string(&view).expect("serialisable") + "\n"
                }
                Some(text) => format!("---\n{text}"),
                None => format(&view, out),
            },
            (Err(error), true) => return Err(error),
            (Err(error), false) => format!("error: {error}\n"),
        };
        first = false;
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        let framed = if out.progress && out.structured(&()).is_none() {
            // On a terminal: redraw in place, like watch(1).
            format!(
                "\x1b[H\x1b[2JEvery {}: kubectl nodekeeper status   {now}\n\n{text}",
                humantime::format_duration(args.interval)
            )
        } else if out.structured(&()).is_none() {
            format!("# {now}\n{text}\n")
        } else {
            text
        };
        render::print(&framed)?;
    }
}

/// Reads everything `status` shows.
pub async fn collect(conn: &Connection, wide: bool) -> Result<StatusView, Error> {
    let summary = match controller_api::get(conn, "/api/v1/summary").await? {
        Answer::Found(value) => {
            serde_json::from_value::<Summary>(value).map_err(|e| Error::UnexpectedAnswer {
                what: "the controller's /api/v1/summary".into(),
                detail: e.to_string(),
            })?
        }
        Answer::NotFound(detail) => {
            return Err(Error::UnexpectedAnswer {
                what: "the controller's /api/v1/summary".into(),
                detail: format!("404: {detail}; is it an older controller?"),
            });
        }
    };
    let network_tests = active_tests(conn).await?;
    let node_maintenances = active_maintenances(conn).await?;
    let (problem_nodes, problem_nodes_omitted) = if wide {
        let (rows, omitted) = problem_nodes(conn).await?;
        (Some(rows), Some(omitted))
    } else {
        (None, None)
    };
    Ok(StatusView {
        controller: summary,
        network_tests,
        node_maintenances,
        problem_nodes,
        problem_nodes_omitted,
    })
}

/// NetworkTests in every namespace that have not finished. A cluster without the CRD has none.
async fn active_tests(conn: &Connection) -> Result<Vec<TestRow>, Error> {
    let api: Api<NetworkTest> = Api::all(conn.client.clone());
    let list = match api.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Vec::new()),
        Err(e) => return Err(conn.error("list networktests in all namespaces", e)),
    };
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let mut rows: Vec<TestRow> = list
        .items
        .into_iter()
        .filter_map(|nt| {
            let status = nt.status.clone().unwrap_or_default();
            let phase = status.phase;
            if matches!(phase, Some(Phase::Succeeded | Phase::Failed)) {
                return None;
            }
            Some(TestRow {
                namespace: nt.metadata.namespace.clone().unwrap_or_default(),
                name: nt.metadata.name.clone().unwrap_or_default(),
                kind: nt.spec.kind.as_str().to_owned(),
                phase: phase.map_or("Pending".to_owned(), |p| format!("{p:?}")),
                sources: status.sources,
                age_seconds: nt
                    .metadata
                    .creation_timestamp
                    .as_ref()
                    .map(|t| now - t.0.as_second()),
            })
        })
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(rows)
}

/// NodeMaintenances not at stage `Complete`. Read as plain JSON: the NodeMaintenance controller
/// is younger than this plugin, and a field it adds must not break `status`.
async fn active_maintenances(conn: &Connection) -> Result<Vec<MaintenanceRow>, Error> {
    let resource = ApiResource::erase::<NodeMaintenance>(&());
    let api: Api<DynamicObject> = Api::all_with(conn.client.clone(), &resource);
    let list = match api.list(&ListParams::default()).await {
        Ok(list) => list,
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Vec::new()),
        Err(e) => return Err(conn.error("list nodemaintenances", e)),
    };
    let mut rows: Vec<MaintenanceRow> = list
        .items
        .into_iter()
        .filter_map(|nm| {
            let stage = nm.data["spec"]["stage"]
                .as_str()
                .unwrap_or("Idle")
                .to_owned();
            if stage == "Complete" {
                return None;
            }
            let count = |field: &str| nm.data["status"][field].as_u64().unwrap_or(0);
            Some(MaintenanceRow {
                name: nm.metadata.name.clone().unwrap_or_default(),
                matched: count("matched"),
                cordoned: count("cordoned"),
                drained: count("drained"),
                blocked: count("blocked"),
                failed: count("failed"),
                stage,
            })
        })
        .collect();
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(rows)
}

/// Nodes with a nodekeeper condition that is not True (at most [`MAX_ROWS`] rows, and how many
/// more there were), read page by page.
async fn problem_nodes(conn: &Connection) -> Result<(Vec<ProblemNode>, usize), Error> {
    let api: Api<Node> = Api::all(conn.client.clone());
    let mut params = ListParams::default().limit(500);
    let mut rows = Vec::new();
    let mut omitted = 0;
    loop {
        let page = api
            .list(&params)
            .await
            .map_err(|e| conn.error("list nodes", e))?;
        for node in &page.items {
            let name = node.meta().name.clone().unwrap_or_default();
            let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
            for c in conditions.into_iter().flatten() {
                if OWNED_CONDITIONS.contains(&c.type_.as_str()) && c.status != "True" {
                    if rows.len() < MAX_ROWS {
                        rows.push(ProblemNode {
                            node: name.clone(),
                            condition: c.type_.clone(),
                            status: c.status.clone(),
                            reason: c.reason.clone().unwrap_or_default(),
                        });
                    } else {
                        omitted += 1;
                    }
                }
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    Ok((rows, omitted))
}

/// Renders a view for `out`'s format.
pub fn format(view: &StatusView, out: &Output) -> String {
    if let Some(text) = out.structured(view) {
        return text;
    }
    let s = &view.controller;
    let fleet = &s.fleet;
    let mut text = render::key_values(&[
        (
            "Controller",
            format!(
                "{} ({}{})",
                s.identity,
                if s.leader { "leader" } else { "standby" },
                if s.nodes_synced {
                    ", node list read"
                } else {
                    ", still reading the node list"
                }
            ),
        ),
        ("Nodes managed", fleet.nodes.to_string()),
        ("Reports held", fleet.read.to_string()),
        ("Stale reports", fleet.stale.to_string()),
        // The controller's own counts: an agent that stopped answering counts at once, where
        // NodekeeperReachable=False (the condition table) waits for the report to go stale.
        (
            "Unreachable agents",
            counted(fleet.unreachable, &fleet.unreachable_nodes),
        ),
        (
            "Refusing tuning rules",
            counted(fleet.refusing_rules, &fleet.refusing_rules_nodes),
        ),
        ("Without InternalIP", fleet.without_internal_ip.to_string()),
    ]);

    // Type → (True, False, Unknown), from the `Type=Status` counts.
    let mut by_type: BTreeMap<&str, [u64; 3]> = BTreeMap::new();
    for (key, n) in &fleet.conditions {
        let Some((type_, status)) = key.split_once('=') else {
            continue;
        };
        let slot = match status {
            "True" => 0,
            "False" => 1,
            _ => 2,
        };
        by_type.entry(type_).or_default()[slot] += n;
    }
    let mut t = Table::new(&["CONDITION", "TRUE", "FALSE", "UNKNOWN"]);
    for (type_, [yes, no, unknown]) in &by_type {
        let bad = |n: u64, c| {
            if n > 0 {
                Cell {
                    text: n.to_string(),
                    color: Some(c),
                }
            } else {
                Cell::from(n.to_string())
            }
        };
        t.row(vec![
            (*type_).into(),
            yes.to_string().into(),
            bad(*no, render::Color::Red),
            bad(*unknown, render::Color::Yellow),
        ]);
    }
    text.push_str(&render::section(
        out,
        "NODES BY CONDITION",
        &t.render_or_empty(out),
    ));

    let mut t = Table::new(&["RULE", "NODES"]);
    for (rule, n) in &fleet.tunables_out_of_bounds {
        t.row(vec![rule.as_str().into(), n.to_string().into()]);
    }
    text.push_str(&render::section(
        out,
        "TUNABLES OUT OF BOUNDS",
        &t.render_or_empty(out),
    ));

    let mut t = Table::new(&["NAMESPACE", "NAME", "KIND", "PHASE", "NODES", "AGE"]);
    for r in view.network_tests.iter().take(MAX_ROWS) {
        t.row(vec![
            r.namespace.as_str().into(),
            r.name.as_str().into(),
            r.kind.as_str().into(),
            Cell::verdict(&r.phase),
            r.sources.to_string().into(),
            r.age_seconds.map_or("-".to_owned(), age).into(),
        ]);
    }
    let mut section = t.render_or_empty(out);
    more(
        &mut section,
        view.network_tests.len().saturating_sub(MAX_ROWS),
    );
    text.push_str(&render::section(out, "ACTIVE NETWORKTESTS", &section));

    let mut t = Table::new(&[
        "NAME", "STAGE", "MATCHED", "CORDONED", "DRAINED", "BLOCKED", "FAILED",
    ]);
    for r in view.node_maintenances.iter().take(MAX_ROWS) {
        t.row(vec![
            r.name.as_str().into(),
            r.stage.as_str().into(),
            r.matched.to_string().into(),
            r.cordoned.to_string().into(),
            r.drained.to_string().into(),
            r.blocked.to_string().into(),
            r.failed.to_string().into(),
        ]);
    }
    let mut section = t.render_or_empty(out);
    more(
        &mut section,
        view.node_maintenances.len().saturating_sub(MAX_ROWS),
    );
    text.push_str(&render::section(out, "ACTIVE NODEMAINTENANCES", &section));

    if let Some(problems) = &view.problem_nodes {
        let mut t = Table::new(&["NODE", "CONDITION", "STATUS", "REASON"]);
        for p in problems {
            t.row(vec![
                p.node.as_str().into(),
                p.condition.as_str().into(),
                Cell::verdict(&p.status),
                p.reason.as_str().into(),
            ]);
        }
        let mut section = t.render_or_empty(out);
        more(&mut section, view.problem_nodes_omitted.unwrap_or(0));
        text.push_str(&render::section(
            out,
            "NODES WITH A CONDITION NOT TRUE",
            &section,
        ));
    }
    text
}

/// Nodes shown by name after a count, before "…".
const NAMES_SHOWN: usize = 5;

/// `2 (node-a, node-b)`; `-` from a controller too old to count them.
fn counted(count: Option<u64>, nodes: &[String]) -> String {
    let Some(count) = count else {
        return "- (the controller is too old to count them)".to_owned();
    };
    if count == 0 || nodes.is_empty() {
        return count.to_string();
    }
    let mut listed = nodes
        .iter()
        .take(NAMES_SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if count > NAMES_SHOWN as u64 {
        listed.push_str(", …");
    }
    format!("{count} ({listed})")
}

fn more(section: &mut String, omitted: usize) {
    if omitted > 0 {
        section.push_str(&format!("... and {omitted} more\n"));
    }
}

/// kubectl's age: `45s`, `12m`, `5h`, `3d`.
pub fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::OutputFormat;
    use crate::controller_api::Fleet;

    /// A fixed view: the golden layout below is what a pipe receives.
    pub fn sample() -> StatusView {
        StatusView {
            controller: Summary {
                identity: "nodekeeper-controller-7d9f-abcde".into(),
                leader: true,
                nodes_synced: true,
                fleet: Fleet {
                    nodes: 3,
                    read: 3,
                    stale: 1,
                    unreachable: Some(1),
                    unreachable_nodes: vec!["worker-2".into()],
                    refusing_rules: Some(0),
                    refusing_rules_nodes: vec![],
                    without_internal_ip: 0,
                    conditions: [
                        ("NodekeeperReachable=True".to_owned(), 2),
                        ("NodekeeperReachable=False".to_owned(), 1),
                        ("TunablesInBounds=True".to_owned(), 1),
                        ("TunablesInBounds=False".to_owned(), 1),
                    ]
                    .into(),
                    tunables_out_of_bounds: [("somaxconn".to_owned(), 1)].into(),
                },
            },
            network_tests: vec![TestRow {
                namespace: "nodekeeper".into(),
                name: "netcheck-x7k2q".into(),
                kind: "icmp".into(),
                phase: "Running".into(),
                sources: 3,
                age_seconds: Some(75),
            }],
            node_maintenances: vec![],
            problem_nodes: None,
            problem_nodes_omitted: None,
        }
    }

    #[test]
    fn piped_output_matches_the_golden_file() {
        let text = format(&sample(), &Output::plain(OutputFormat::Table));
        crate::golden::check("status", &text);
        assert!(!text.contains('\x1b'));
    }

    #[test]
    fn json_output_is_the_view() {
        let text = format(&sample(), &Output::plain(OutputFormat::Json));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["controller"]["fleet"]["stale"], 1);
        assert_eq!(v["controller"]["fleet"]["unreachable"], 1);
        assert_eq!(v["controller"]["fleet"]["unreachableNodes"][0], "worker-2");
        assert_eq!(v["controller"]["fleet"]["refusingRules"], 0);
        assert_eq!(
            v["controller"]["fleet"]["refusingRulesNodes"],
            serde_json::json!([])
        );
        assert_eq!(v["networkTests"][0]["name"], "netcheck-x7k2q");
        assert!(v.get("problemNodes").is_none());
        let yaml = format(&sample(), &Output::plain(OutputFormat::Yaml));
        assert!(
            yaml.contains("networkTests:\n- namespace: nodekeeper\n"),
            "{yaml}"
        );
    }

    /// The controller's `/api/v1/summary` fleet, as it serves it (shared/fleet.rs), is read
    /// whole: the unreachable and refusing counts are its own, not the condition counts.
    #[test]
    fn the_fleet_counts_come_from_the_controller() {
        let served = serde_json::json!({
            "identity": "c", "leader": true, "nodesSynced": true,
            "fleet": {
                "nodes": 70, "read": 70, "stale": 0,
                "unreachable": 7,
                "unreachableNodes": ["n1", "n2", "n3", "n4", "n5", "n6", "n7"],
                "refusingRules": 2, "refusingRulesNodes": ["n8", "n9"],
                "withoutInternalIp": 0,
                "conditions": {"NodekeeperReachable=True": 70},
                "tunablesOutOfBounds": {}
            }
        });
        let mut view = sample();
        view.controller = serde_json::from_value(served).unwrap();
        let row = |view: &StatusView, key: &str| {
            let text = format(view, &Output::plain(OutputFormat::Table));
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{key}:")))
                .map(|v| v.trim().to_owned())
                .unwrap_or_else(|| panic!("no {key} row: {text}"))
        };
        assert_eq!(
            row(&view, "Unreachable agents"),
            "7 (n1, n2, n3, n4, n5, …)"
        );
        assert_eq!(row(&view, "Refusing tuning rules"), "2 (n8, n9)");

        // An older controller serves neither: say so rather than show 0.
        let old = serde_json::json!({"fleet": {"nodes": 1, "conditions": {}}});
        view.controller = serde_json::from_value(old).unwrap();
        assert!(
            row(&view, "Unreachable agents").starts_with("- (the controller is too old"),
            "{view:?}"
        );
        let json = format(&view, &Output::plain(OutputFormat::Json));
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert!(v["controller"]["fleet"].get("unreachable").is_none(), "{v}");
    }

    #[test]
    fn intervals_are_bounded() {
        assert!(interval("500ms").is_err());
        assert!(interval("11m").is_err());
        assert_eq!(interval("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(age(75), "1m");
    }
}
