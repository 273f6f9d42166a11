//! Observability that installs with nodekeeper, proven on real parts: `deploy/monitoring` (the
//! kustomize copy) renders the same PodMonitors, PrometheusRule and dashboard ConfigMap as the
//! chart's `monitoring.*` values; the agent DaemonSet of `deploy/agent` serves the port its
//! PodMonitor scrapes and does not run the journal monitor its image cannot run; and a real Prometheus (Debian's `prometheus` package), with scrape jobs
//! made from `deploy/monitoring`'s PodMonitors, scrapes a real controller and real agents on
//! their nodes' 127.x addresses, evaluates the chart's alert rules, and answers every query of
//! the Grafana dashboard with data while the test creates the conditions they show (a failed
//! NetworkTest, a NodeMaintenance whose drain a bare pod blocks, a NodeNetworkConfig rollout, a
//! hung task in one node's kernel log, a refused tuning ConfigMap). `promtool check rules` / `test rules` run in
//! install_chart.rs.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test install_monitoring` (the live test needs
//! the local control plane and `prometheus` on PATH; `cargo xtask test` installs it as root).

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

mod controller_common;
mod install_common;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use controller_common::*;
use install_common::{by_key, chart_dir, helm_template, kustomize, repo};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use nodekeeper_api::crd::{NetworkTest, NodeMaintenance, NodeNetworkConfig};
use nodekeeper_e2e::rig::{AgentSetup, Output, Process, Program};
use nodekeeper_e2e::{
    ControlPlane, apply_spec, create_simulated_nodes, install_crds, test_namespace, unique_name,
    wait_for,
};
use nodekeeper_testkit::free_port_on;
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
            "PodMonitor/nodekeeper/nodekeeper-agent",
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

/// The object of `kind` named `name` among `objects`.
fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The agent DaemonSet of `deploy/` serves `/metrics` on the node's address and the port its
/// PodMonitor names, in a form the agent's `--metrics-listen` accepts once the kubelet has put
/// the node's address in; the chart renders the same (install_chart.rs compares them).
#[test]
fn the_agent_serves_the_port_its_podmonitor_scrapes() {
    let install = kustomize(&repo().join("deploy")).unwrap();
    let monitoring = kustomize(&repo().join("deploy/monitoring")).unwrap();
    let agent = named(&install, "DaemonSet", "nodekeeper-agent");
    let monitor = named(&monitoring, "PodMonitor", "nodekeeper-agent");
    let template = &agent["spec"]["template"];
    for (label, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            &template["metadata"]["labels"][label], value,
            "the agent PodMonitor's selector misses the agent Pods"
        );
    }
    let container = &template["spec"]["containers"][0];
    let port_name = &monitor["spec"]["podMetricsEndpoints"][0]["port"];
    let port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| &p["name"] == port_name)
        .unwrap_or_else(|| panic!("the agent container has no port {port_name}"))["containerPort"]
        .as_u64()
        .unwrap();
    let env = container["env"].as_array().unwrap();
    let position = |name: &str| env.iter().position(|e| e["name"] == name);
    let node_ip = position("NODE_IP").expect("NODE_IP in the agent's env");
    assert_eq!(
        env[node_ip]["valueFrom"]["fieldRef"]["fieldPath"], "status.hostIP",
        "the node's address, from the downward API"
    );
    let listen = position("NODEKEEPER_METRICS_LISTEN").expect("NODEKEEPER_METRICS_LISTEN");
    // The kubelet expands `$(NODE_IP)` only from variables defined before it.
    assert!(
        node_ip < listen,
        "NODE_IP must come before NODEKEEPER_METRICS_LISTEN"
    );
    let value = env[listen]["value"].as_str().unwrap();
    assert_eq!(value, format!("$(NODE_IP):{port}"));
    let grpc = container["ports"][0]["containerPort"].as_u64().unwrap();
    assert_ne!(port, grpc, "the metrics port is the gRPC port");

    // What the agent makes of it on a node whose address is 10.0.0.5.
    use clap::Parser as _;
    let dir = tempfile::tempdir().unwrap();
    let setup = AgentSetup::new(
        "node-a",
        SocketAddr::from(([10, 0, 0, 5], grpc as u16)),
        dir.path(),
        dir.path(),
    );
    let mut args = setup.args();
    args.push(format!(
        "--metrics-listen={}",
        value.replace("$(NODE_IP)", "10.0.0.5")
    ));
    let config = nodekeeper_agent::Config::try_parse_from(args).unwrap();
    assert_eq!(
        config.metrics_listen,
        Some(SocketAddr::from(([10, 0, 0, 5], port as u16)))
    );
}

/// The agent image carries no `journalctl` (deploy/images/agent.Containerfile: FROM scratch,
/// one binary), so the shipped DaemonSet and the chart's defaults turn the journal monitor off:
/// on, it would leave FrequentKubeletRestart, FrequentContainerdRestart and
/// FrequentDockerRestart Unknown on every node. The chart turns it on only when asked
/// (`agent.journalMonitor`) and the journal is mounted (`agent.hostMounts.journal`).
#[test]
fn the_shipped_agent_does_not_run_the_journal_monitor_its_image_cannot_run() {
    let containerfile =
        std::fs::read_to_string(repo().join("deploy/images/agent.Containerfile")).unwrap();
    assert!(
        containerfile.contains("FROM scratch"),
        "the agent image is no longer empty but for the binary; revisit NODEKEEPER_JOURNAL"
    );
    let journal_env = |objects: &[Value]| -> Option<String> {
        let agent = named(objects, "DaemonSet", "nodekeeper-agent");
        agent["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "NODEKEEPER_JOURNAL")
            .map(|e| e["value"].as_str().unwrap().to_owned())
    };
    let install = kustomize(&repo().join("deploy")).unwrap();
    let value = journal_env(&install).expect("NODEKEEPER_JOURNAL in deploy/agent's env");
    let chart = helm_template("nodekeeper", &[]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(journal_env(&chart).as_deref(), Some(value.as_str()));
    let opted_in = helm_template("nodekeeper", &["--set=agent.journalMonitor=true"])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(journal_env(&opted_in), None, "agent.journalMonitor=true");
    let unmounted = helm_template(
        "nodekeeper",
        &["--set=agent.journalMonitor=true,agent.hostMounts.journal=false"],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(journal_env(&unmounted).as_deref(), Some("false"));

    // What the agent makes of it: no journal monitor.
    use clap::Parser as _;
    let dir = tempfile::tempdir().unwrap();
    let setup = AgentSetup::new(
        "node-a",
        SocketAddr::from(([10, 0, 0, 5], 9443)),
        dir.path(),
        dir.path(),
    );
    let mut args = setup.args();
    args.push(format!("--journal={value}"));
    let config = nodekeeper_agent::Config::try_parse_from(args).unwrap();
    assert!(config.monitors().journal.is_none());
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
    /// Starts `prometheus` on 127.0.0.1 with the scrape jobs `scrape`, scraping every second
    /// and evaluating the chart's alert rules every second.
    fn start(binary: PathBuf, scrape: Vec<Value>) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let rules = chart_dir().join("files/prometheus-rules.yaml");
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

/// A Pod a PodMonitor would find: its address with the monitored port, its name and node's.
struct PodTarget {
    addr: SocketAddr,
    pod: String,
    node: String,
}

/// The scrape job the Prometheus Operator makes of `monitor`, with `targets` standing in for the
/// Pods that Kubernetes service discovery would find (as the `__meta_kubernetes_*` labels it
/// would give them): the endpoint's path, honorLabels and relabelings after the operator's own
/// `namespace` and `pod` labels; the job named after the PodMonitor. The interval is the test's.
fn scrape_config(monitor: &Value, targets: &[PodTarget]) -> anyhow::Result<Value> {
    let name = monitor["metadata"]["name"].as_str().context("a name")?;
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_array()
        .context("podMetricsEndpoints")?;
    ensure!(endpoints.len() == 1, "{name}: one endpoint expected");
    let endpoint = &endpoints[0];
    let mut relabel = vec![
        json!({"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}),
        json!({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}),
    ];
    for rule in endpoint["relabelings"].as_array().into_iter().flatten() {
        let mut out = serde_json::Map::new();
        for (key, value) in rule.as_object().context("a relabeling")? {
            match key.as_str() {
                "sourceLabels" => out.insert("source_labels".into(), value.clone()),
                "targetLabel" => out.insert("target_label".into(), value.clone()),
                "action" => out.insert(
                    "action".into(),
                    value.as_str().unwrap_or_default().to_lowercase().into(),
                ),
                "separator" | "regex" | "replacement" | "modulus" => {
                    out.insert(key.clone(), value.clone())
                }
                other => anyhow::bail!("{name}: relabeling field {other} not translated"),
            };
        }
        relabel.push(Value::Object(out));
    }
    let namespace = &monitor["metadata"]["namespace"];
    let static_configs: Vec<Value> = targets
        .iter()
        .map(|t| {
            json!({"targets": [t.addr.to_string()], "labels": {
                "__meta_kubernetes_namespace": namespace,
                "__meta_kubernetes_pod_name": t.pod,
                "__meta_kubernetes_pod_node_name": t.node,
            }})
        })
        .collect();
    Ok(json!({
        "job_name": name,
        "metrics_path": endpoint["path"],
        "honor_labels": endpoint["honorLabels"].as_bool().unwrap_or(false),
        "static_configs": static_configs,
        "relabel_configs": relabel,
    }))
}

/// Appends `message` to a file standing in for `/dev/kmsg`, as the kernel formats a record
/// (`prio,seq,usec-since-boot,flags;message`).
fn append_kmsg(path: &Path, seq: u64, message: &str) -> anyhow::Result<()> {
    // Stamped now, by the boot time the agent uses: it skips records stamped before it started.
    let boot = nodekeeper_agent::monitor::kmsg::boot_time()?;
    let usec = std::time::SystemTime::now()
        .duration_since(boot)?
        .as_micros();
    let mut file = std::fs::OpenOptions::new().append(true).open(path)?;
    writeln!(file, "3,{seq},{usec},-;{message}")?;
    Ok(())
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
async fn prometheus_scrapes_controller_and_agents_and_every_dashboard_query_has_data()
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

    // The controller and the nodes' agents, each serving its /metrics on its node's address
    // as the DaemonSet does (a free port rather than 9444, which this machine may be using),
    // reading its own file as the kernel log. No kubelet, runtime or journal here: those
    // monitors are off, so the only problem condition is the one this test causes.
    let port = free_port();
    let controller = ControllerProcess::start(&ns, "monitoring-a", &selector, port, &[])?;
    let tls = agent_tls(&client, &ns).await?;
    let kmsg_dir = tempfile::tempdir()?;
    let mut agents = Vec::new();
    let mut agent_targets = Vec::new();
    for (i, (node, ip)) in nodes.iter().zip(&ips).enumerate() {
        let metrics = SocketAddr::new((*ip).into(), free_port_on(*ip)?);
        let kmsg = kmsg_dir.path().join(format!("kmsg{i}"));
        std::fs::write(&kmsg, b"")?;
        let extra = vec![
            format!("--metrics-listen={metrics}"),
            format!("--kmsg-path={}", kmsg.display()),
            "--health-checks=false".to_owned(),
            "--journal=false".to_owned(),
        ];
        let addr = SocketAddr::new((*ip).into(), port);
        agents.push(start_agent_with(node, addr, &tls, &extra).await?);
        agent_targets.push(PodTarget {
            addr: metrics,
            pod: format!("nodekeeper-agent-{i}"),
            node: node.clone(),
        });
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

    // Prometheus scrapes what deploy/monitoring's PodMonitors select (by their port's name),
    // evaluates the alerts, and answers the dashboard.
    let mut by_port: BTreeMap<&str, Vec<PodTarget>> = BTreeMap::new();
    by_port.insert(
        "http",
        vec![PodTarget {
            addr: controller.http,
            pod: "nodekeeper-controller-0".into(),
            node: String::new(),
        }],
    );
    by_port.insert("metrics", agent_targets);
    let mut scrape = Vec::new();
    for monitor in kustomize(&repo().join("deploy/monitoring"))?
        .iter()
        .filter(|o| o["kind"] == "PodMonitor")
    {
        let port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
            .as_str()
            .unwrap_or_default();
        let targets = by_port
            .remove(port)
            .with_context(|| format!("no process here serves port {port} of {monitor}"))?;
        scrape.push(scrape_config(monitor, &targets)?);
    }
    ensure!(
        by_port.is_empty(),
        "no PodMonitor scrapes {:?}",
        by_port.keys()
    );
    let mut prom = Prometheus::start(prometheus, scrape)?;
    wait_for("every scrape target up", TIMEOUT, || {
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
            Ok((health.len() == 3 && health.iter().all(|(_, h)| h == "up")).then_some(health))
        }
    })
    .await?;
    // The agents' own series (node-problem-detector's names and the kernel log counter), each
    // labelled with its node by the agent PodMonitor's relabeling.
    for node in &nodes {
        prom.wait_data(
            "the agent's kernel log counter",
            &format!("nodekeeper_kmsg_lost_records{{job=\"nodekeeper-agent\",node=\"{node}\"}}"),
        )
        .await?;
        prom.wait_data(
            "the agent's healthy KernelDeadlock",
            &format!(
                "problem_gauge{{job=\"nodekeeper-agent\",node=\"{node}\",type=\"KernelDeadlock\",reason=\"KernelHasNoDeadlock\"}} == 0"
            ),
        )
        .await?;
    }
    // A hung task in node 0's kernel log (the kernel's wording): its agent's gauge turns 1 and
    // the NodekeeperNodeProblem alert, pending for its `for`, names node 0 and only node 0.
    append_kmsg(
        &kmsg_dir.path().join("kmsg0"),
        1,
        "INFO: task docker:2931 blocked for more than 120 seconds.",
    )?;
    prom.wait_data(
        "node 0's KernelDeadlock",
        &format!(
            "problem_gauge{{job=\"nodekeeper-agent\",node=\"{}\",type=\"KernelDeadlock\",reason=\"DockerHung\"}} == 1",
            nodes[0]
        ),
    )
    .await?;
    let alerts = prom
        .wait_data(
            "the NodekeeperNodeProblem alert",
            "ALERTS{alertname=\"NodekeeperNodeProblem\"}",
        )
        .await?;
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0]["metric"]["node"], nodes[0].as_str(), "{alerts:?}");
    assert_eq!(alerts[0]["metric"]["type"], "KernelDeadlock", "{alerts:?}");
    assert_eq!(alerts[0]["metric"]["reason"], "DockerHung", "{alerts:?}");
    let quiet = prom
        .query(&format!(
            "problem_gauge{{job=\"nodekeeper-agent\",node=\"{}\",type=\"KernelDeadlock\"}}",
            nodes[1]
        ))
        .await?;
    assert!(
        quiet.len() == 1 && value_of(&quiet[0]) == 0.0,
        "node 1 has no problem: {quiet:?}"
    );

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

    // A refused tuning ConfigMap: the gauge holds 1 and the alert goes pending, carrying the
    // `namespace` label the PodMonitor gives the controller's series (its descriptions' commands
    // name it); a valid version again turns the gauge back to 0.
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([("sweepInterval", "soon"), ("callTimeout", "2s")]),
    )
    .await?;
    prom.wait_data(
        "the refused tuning gauge",
        "nodekeeper_tuning_refused{job=\"nodekeeper-controller\"} == 1",
    )
    .await?;
    let refused = prom
        .wait_data(
            "the NodekeeperTuningRefused alert",
            "ALERTS{alertname=\"NodekeeperTuningRefused\"}",
        )
        .await?;
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(
        refused[0]["metric"]["namespace"], "nodekeeper",
        "{refused:?}"
    );
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([("sweepInterval", "10s"), ("callTimeout", "2s")]),
    )
    .await?;
    prom.wait_data(
        "the tuning gauge back at 0",
        "nodekeeper_tuning_refused{job=\"nodekeeper-controller\"} == 0",
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
    drop((prom, agents, controller, kmsg_dir));
    Ok(())
}

/// The first executable named `command` on `PATH`.
fn which(command: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(command))
        .find(|p| p.is_file())
}
