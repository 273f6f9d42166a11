//! Observability that installs with nodekeeper, proven on real parts: `deploy/monitoring` (the
//! kustomize copy) renders the same PodMonitor, PrometheusRule and dashboard ConfigMap as the
//! chart's `monitoring.*` values; and a real Prometheus (Debian's `prometheus` package) scrapes a
//! real controller and a real agent on 127.0.0.1, evaluates the chart's alert rules, and answers
//! every query of the Grafana dashboard with data while the test creates the conditions they
//! show (a failed NetworkTest, a NodeMaintenance whose drain a bare pod blocks, a
//! NodeNetworkConfig rollout). `promtool check rules` / `test rules` run in install_chart.rs.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test install_monitoring` (the live test needs
//! the local control plane and `prometheus` on PATH; `cargo xtask test` installs it as root).

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

mod controller_common;
mod install_common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use controller_common::*;
use install_common::{by_key, chart_dir, helm_template, kustomize, repo};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use nodekeeper_api::crd::{NetworkTest, NodeMaintenance, NodeNetworkConfig};
use nodekeeper_e2e::rig::{Output, Process, Program};
use nodekeeper_e2e::{
    ControlPlane, apply_spec, create_simulated_nodes, install_crds, test_namespace, unique_name,
    wait_for,
};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(90);

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// The monitoring objects with the dashboard's JSON parsed (Helm's block scalar and kustomize's
/// generator may differ in the text's last newline, not in the dashboard).
fn monitoring_objects(objects: Vec<Value>) -> BTreeMap<String, Value> {
    let mut objects = by_key(
        objects
            .into_iter()
            .filter(|o| {
                matches!(o["kind"].as_str(), Some("PodMonitor" | "PrometheusRule"))
                    || o["metadata"]["name"] == "nodekeeper-dashboard"
            })
            .collect(),
    );
    for object in objects.values_mut() {
        if let Some(text) = object["data"]["nodekeeper-fleet.json"].as_str() {
            object["data"]["nodekeeper-fleet.json"] =
                serde_json::from_str(text).expect("the dashboard is JSON");
        }
    }
    objects
}

/// `kubectl apply -k deploy/monitoring` installs what the chart installs with its monitoring
/// switched on, and the PrometheusRule's spec is the rules file promtool checks.
#[test]
fn kustomize_copy_is_the_charts_monitoring() {
    let base = monitoring_objects(kustomize(&repo().join("deploy/monitoring")).unwrap());
    let chart = monitoring_objects(
        helm_template(
            "nodekeeper",
            &[
                "--set",
                "monitoring.podMonitor.enabled=true,monitoring.prometheusRule.enabled=true,monitoring.dashboard.enabled=true",
            ],
        )
        .unwrap_or_else(|e| panic!("{e}")),
    );
    assert_eq!(
        base.keys().collect::<Vec<_>>(),
        [
            "ConfigMap/nodekeeper/nodekeeper-dashboard",
            "PodMonitor/nodekeeper/nodekeeper-controller",
            "PrometheusRule/nodekeeper/nodekeeper",
        ]
    );
    for (key, expected) in &base {
        assert!(
            chart.get(key) == Some(expected),
            "{key} differs between deploy/monitoring and the chart:\n--- deploy/monitoring\n{}\n--- chart\n{}",
            serde_yaml::to_string(expected).unwrap(),
            serde_yaml::to_string(&chart.get(key)).unwrap()
        );
    }
    assert_eq!(base.len(), chart.len(), "{:?}", chart.keys());
    let rules: Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart_dir().join("files/prometheus-rules.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(base["PrometheusRule/nodekeeper/nodekeeper"]["spec"], rules);
}

/// A percent-encoded query string value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server this test started (killed, by its pid, when dropped).
struct Prometheus {
    process: Process,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts `prometheus` on 127.0.0.1 scraping `targets` (job → address) every second and
    /// evaluating the chart's alert rules every second.
    fn start(binary: PathBuf, targets: &[(&str, SocketAddr)]) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let rules = chart_dir().join("files/prometheus-rules.yaml");
        let scrape: Vec<Value> = targets
            .iter()
            .map(|(job, addr)| {
                json!({"job_name": job, "static_configs": [{"targets": [addr.to_string()]}]})
            })
            .collect();
        let config = json!({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [rules],
            "scrape_configs": scrape,
        });
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, serde_yaml::to_string(&config)?)?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let args = vec![
            format!("--config.file={}", config_file.display()),
            format!("--storage.tsdb.path={}", dir.path().join("data").display()),
            format!("--web.listen-address={addr}"),
        ];
        let log = dir.path().join("prometheus.log");
        let process = Process::start(
            "prometheus",
            &Program::Binary(binary),
            &args,
            &[],
            &Output::Log(log),
        )?;
        Ok(Self {
            process,
            addr,
            _dir: dir,
        })
    }

    /// `GET /api/v1/<path>`'s `data`.
    async fn api(&mut self, path: &str) -> anyhow::Result<Value> {
        self.process.check_alive()?;
        let (code, body) = http_get(self.addr, &format!("/api/v1/{path}")).await?;
        ensure!(code == 200, "GET /api/v1/{path}: {code} {body}");
        let answer: Value = serde_json::from_str(&body)?;
        ensure!(answer["status"] == "success", "{body}");
        Ok(answer["data"].clone())
    }

    /// The result vector of an instant query.
    async fn query(&mut self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let data = self.api(&format!("query?query={}", encode(expr))).await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// Waits until `expr` returns at least one series; returns them.
    async fn wait_data(&mut self, what: &str, expr: &str) -> anyhow::Result<Vec<Value>> {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            let result = self.query(expr).await?;
            if !result.is_empty() {
                return Ok(result);
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "{what}: `{expr}` returned no data within {TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// Every query of the dashboard, with its panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("deploy/monitoring/dashboard.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queries.push((
                panel["title"].as_str().unwrap().to_owned(),
                target["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    queries
}

fn value_of(series: &Value) -> f64 {
    series["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_controller_and_agent_and_every_dashboard_query_has_data()
-> anyhow::Result<()> {
    let Some(prometheus) = which("prometheus") else {
        nodekeeper_testkit::skip!(
            "prometheus not on PATH (Debian's `prometheus` package; `cargo xtask test` installs it as root)"
        );
    };
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-monitoring").await?;
    let group = unique_name("monitoring");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(2);
    let nodes = create_simulated_nodes(&client, "nk-monitoring", 2, &labels, &ips).await?;
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([("sweepInterval", "10s"), ("callTimeout", "2s")]),
    )
    .await?;

    // The controller and the nodes' agents, the first one serving its own /metrics.
    let port = free_port();
    let controller = ControllerProcess::start(&ns, "monitoring-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let agent_metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let mut agents = Vec::new();
    for (i, (node, ip)) in nodes.iter().zip(&ips).enumerate() {
        let extra = if i == 0 {
            vec![format!("--metrics-listen={agent_metrics}")]
        } else {
            Vec::new()
        };
        let addr = SocketAddr::new((*ip).into(), port);
        agents.push(start_agent_with(node, addr, &tls, &extra).await?);
    }
    for node in &nodes {
        wait_condition(
            &client,
            node,
            "NodekeeperReachable",
            "True",
            Some("AgentReachable"),
            TIMEOUT,
        )
        .await?;
    }

    // A failed NetworkTest: the metadata service by address is refused before any probe.
    let tests: Api<NetworkTest> = Api::namespaced(client.clone(), &ns);
    let failed = unique_name("refused");
    apply_spec(
        &tests,
        &failed,
        json!({"kind": "icmp", "nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-group": group}},
            "count": 1, "targets": [{"address": "169.254.169.254"}], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    // A drain held up by a bare pod on the first node (nothing would recreate it).
    let drain_label = unique_name("drain");
    Api::<Node>::all(client.clone())
        .patch(
            &nodes[0],
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"nodekeeper.dev/e2e-drain": drain_label}}}),
            ),
        )
        .await?;
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "bare", "namespace": ns},
        "spec": {"nodeName": nodes[0], "containers": [{"name": "c", "image": "registry.invalid/none"}]},
    }))?;
    Api::<Pod>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &pod)
        .await?;
    let maintenances: Api<NodeMaintenance> = Api::all(client.clone());
    let blocked = unique_name("blocked");
    apply_spec(
        &maintenances,
        &blocked,
        json!({"nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-drain": drain_label}},
            "stage": "Drain", "reason": "install_monitoring test"}),
    )
    .await?;
    // A NodeNetworkConfig rollout (of nothing: its selector picks no node, so no host changes).
    let configs: Api<NodeNetworkConfig> = Api::all(client.clone());
    let rollout = unique_name("rollout");
    apply_spec(
        &configs,
        &rollout,
        json!({"nodeSelector": {"matchLabels": {"nodekeeper.dev/e2e-group": format!("{group}-none")}},
            "ociVnics": {}}),
    )
    .await?;
    wait_for("the drain to be blocked", TIMEOUT, || {
        let (maintenances, blocked) = (maintenances.clone(), blocked.clone());
        async move {
            let nm = maintenances.get(&blocked).await?;
            Ok(nm.status.filter(|s| s.blocked == 1))
        }
    })
    .await?;

    // Prometheus scrapes both, evaluates the alerts, and answers the dashboard.
    let mut prom = Prometheus::start(
        prometheus,
        &[("controller", controller.http), ("agent", agent_metrics)],
    )?;
    wait_for("both scrape targets up", TIMEOUT, || {
        let addr = prom.addr;
        async move {
            let (code, body) = http_get(addr, "/api/v1/targets").await?;
            ensure!(code == 200, "{code} {body}");
            let data: Value = serde_json::from_str(&body)?;
            let health: Vec<(String, String)> = data["data"]["activeTargets"]
                .as_array()
                .context("activeTargets")?
                .iter()
                .map(|t| {
                    (
                        t["labels"]["job"].as_str().unwrap_or_default().to_owned(),
                        t["health"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect();
            Ok((health.len() == 2 && health.iter().all(|(_, h)| h == "up")).then_some(health))
        }
    })
    .await?;
    // The agent's own series (node-problem-detector's names and its kernel log counter).
    prom.wait_data("the agent", "nodekeeper_kmsg_lost_records{job=\"agent\"}")
        .await?;

    let queries = dashboard_queries();
    assert!(queries.len() >= 16, "{queries:?}");
    for (title, expr) in &queries {
        let result = prom.wait_data(title, expr).await?;
        eprintln!("{title}: {} series", result.len());
    }

    // The status gauges name the objects the test made, with their state.
    let failed_series = prom
        .wait_data(
            "the failed NetworkTest",
            &format!("nodekeeper_networktest_phase{{phase=\"Failed\",name=\"{failed}\"}}"),
        )
        .await?;
    assert_eq!(failed_series[0]["metric"]["namespace"], ns.as_str());
    let blocked_series = prom
        .wait_data(
            "the blocked drain",
            &format!("nodekeeper_nodemaintenance_nodes{{name=\"{blocked}\",state=\"blocked\"}}"),
        )
        .await?;
    assert_eq!(value_of(&blocked_series[0]), 1.0, "{blocked_series:?}");
    let paused = prom
        .wait_data(
            "the rollout",
            &format!("nodekeeper_nodenetworkconfig_paused{{name=\"{rollout}\"}}"),
        )
        .await?;
    assert_eq!(value_of(&paused[0]), 0.0, "{paused:?}");
    // The chart's alert fires in this Prometheus on the failed test, naming it.
    prom.wait_data(
        "the NetworkTest alert",
        &format!(
            "ALERTS{{alertname=\"NodekeeperNetworkTestFailed\",alertstate=\"firing\",name=\"{failed}\",namespace=\"{ns}\"}}"
        ),
    )
    .await?;

    // A deleted object's series goes (the status gauges read the controller's cache).
    tests.delete(&failed, &DeleteParams::default()).await?;
    wait_for("the deleted NetworkTest's series to go", TIMEOUT, || {
        let addr = controller.http;
        let failed = failed.clone();
        async move {
            let (_, text) = http_get(addr, "/metrics").await?;
            Ok((!text.contains(&format!("name=\"{failed}\""))).then_some(()))
        }
    })
    .await?;

    // Leave the cluster as found: the maintenance releases its node when deleted.
    maintenances
        .delete(&blocked, &DeleteParams::default())
        .await?;
    configs.delete(&rollout, &DeleteParams::default()).await?;
    wait_for("the maintenance to go", TIMEOUT, || {
        let (maintenances, blocked) = (maintenances.clone(), blocked.clone());
        async move {
            Ok(maintenances
                .get_opt(&blocked)
                .await?
                .is_none()
                .then_some(()))
        }
    })
    .await?;
    prom.process.check_alive()?;
    drop((prom, agents, controller));
    Ok(())
}

/// The first executable named `command` on `PATH`.
fn which(command: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(command))
        .find(|p| p.is_file())
}
