//! Least privilege, proven: `deploy/` is installed on a private control plane that records an
//! audit log, the controller runs with a token of the ServiceAccount `deploy/` creates (not the
//! admin's), every controller goes through its happy path (the sweep with real agents, a
//! NetworkTest, a NodeMaintenance drain behind a PodDisruptionBudget, a NodeDiagnostic, a refused
//! tuning ConfigMap), and the audit log shows no 403 for that user. Then one verb at a time is
//! taken from the RBAC, and the controller names the missing permission (resource and verb) in
//! its log and keeps running instead of crash-looping. The installed FlowSchema puts that
//! account's Lease requests, and nothing else of it, in the `leader-election` priority level. And
//! the Helm chart installs into a namespace other than `nodekeeper`, where the controller runs as
//! that namespace's account.
//!
//! The tests share one control plane of their own (the audit log counts this user's requests
//! only) and run one at a time: the ClusterRole is cluster-wide and the second test edits it.
//!
//! Run (as root: the NetworkTest's agents ping): `cargo test -p nodekeeper-e2e --test install_rbac`.

mod controller_common;
mod install_common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use controller_common::{
    ControllerProcess, agent_tls, free_port, loopback_ips, start_agent, wait_condition,
};
use install_common::{apply_all, helm_template, kustomize, repo, service_account_kubeconfig};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use nodekeeper_api::crd::network_test::Phase as TestPhase;
use nodekeeper_api::crd::node_diagnostic::Phase as DiagPhase;
use nodekeeper_api::crd::node_maintenance::NodePhase;
use nodekeeper_api::crd::{NetworkTest, NodeDiagnostic, NodeMaintenance};
use nodekeeper_e2e::rig::{ControllerConfig, Output, Program};
use nodekeeper_e2e::{
    ControlPlane, Lifetime, Options, apply_spec, create_simulated_nodes, install_crds,
    test_namespace, unique_name, wait_for,
};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(120);
const NAMESPACE: &str = "nodekeeper";
const ACCOUNT: &str = "nodekeeper-controller";
const GROUP: &str = "nodekeeper.dev/e2e-group";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    controller_common::run_as_controller_if_asked();
}

/// One test at a time: they install the same cluster-scoped RBAC and the second edits it.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// This binary's own control plane, with the audit log on.
fn cluster() -> &'static ControlPlane {
    static CLUSTER: OnceLock<ControlPlane> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let mut options = Options::new(
            format!("test-install-{}", std::process::id()),
            Lifetime::WithThisProcess,
        );
        options.audit = true;
        ControlPlane::start(options).expect("start the audited control plane")
    })
}

/// The account's user name as the API server sees it.
fn user(namespace: &str) -> String {
    format!("system:serviceaccount:{namespace}:{ACCOUNT}")
}

/// Installs the CRDs and `deploy/` (`kubectl apply -k deploy/`) plus the example tuning
/// ConfigMap with a 10 s sweep, as the admin.
async fn install_deploy(client: &kube::Client) -> anyhow::Result<Vec<Value>> {
    install_crds(client).await?;
    let objects = kustomize(&repo().join("deploy"))?;
    apply_all(client, &objects).await?;
    let text = std::fs::read_to_string(repo().join("deploy/examples/tuning-configmap.yaml"))?;
    let mut tuning = install_common::documents(&text)?;
    tuning[0]["data"]["sweepInterval"] = "10s".into();
    tuning[0]["data"]["callTimeout"] = "2s".into();
    apply_all(client, &tuning).await?;
    Ok(objects)
}

/// A controller process acting as the ServiceAccount of `namespace`, logging to `log`.
async fn start_controller(
    client: &kube::Client,
    namespace: &str,
    selector: &str,
    agent_port: u16,
    work: &Path,
    env: &[(&str, &str)],
) -> anyhow::Result<(ControllerProcess, PathBuf)> {
    let kubeconfig = work.join(format!("kubeconfig-{}", unique_name("sa")));
    service_account_kubeconfig(
        client,
        cluster().kubeconfig(),
        namespace,
        ACCOUNT,
        &kubeconfig,
    )
    .await?;
    let log = work.join(format!("{}.log", unique_name("controller")));
    let mut all_env: Vec<(String, String)> = vec![(
        "NODEKEEPER_DIAGNOSTICS_DIR".into(),
        work.join("bundles").display().to_string(),
    )];
    all_env.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let config = ControllerConfig {
        kubeconfig,
        namespace: namespace.to_owned(),
        identity: unique_name("lp"),
        http: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port())),
        agent_port,
        node_selector: selector.to_owned(),
        log: Some("info,kube=warn".into()),
        env: all_env,
        output: Output::Log(log.clone()),
    };
    let program = Program::this_test_binary(controller_common::HELPER, "controller")?;
    Ok((ControllerProcess::spawn(&program, &config)?, log))
}

/// One audit event, as far as these tests read it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Request {
    verb: String,
    /// `resource` or `resource/subresource`, with `group/` in front for a named API group.
    resource: String,
    namespace: String,
    name: String,
    code: i64,
}

/// The audit log's length now: what [`requests_of`] reads from, so a test sees only the
/// requests made while it ran (the tests run one at a time).
fn audit_mark() -> anyhow::Result<usize> {
    let path = cluster()
        .audit_log()
        .context("the control plane has no audit log")?;
    Ok(std::fs::read(&path).map(|b| b.len()).unwrap_or(0))
}

/// Every request `username` made after `mark`, from the audit log.
fn requests_of(username: &str, mark: usize) -> anyhow::Result<Vec<Request>> {
    let path = cluster()
        .audit_log()
        .context("the control plane has no audit log")?;
    let bytes = std::fs::read(&path)?;
    let text = String::from_utf8_lossy(&bytes[mark.min(bytes.len())..]);
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if event["user"]["username"] != username {
            continue;
        }
        let object = &event["objectRef"];
        let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let mut resource = s(&object["resource"]);
        if let Some(sub) = object["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        if let Some(group) = object["apiGroup"].as_str().filter(|g| !g.is_empty()) {
            resource = format!("{group}/{resource}");
        }
        out.push(Request {
            verb: s(&event["verb"]),
            resource,
            namespace: s(&object["namespace"]),
            name: s(&object["name"]),
            code: event["responseStatus"]["code"].as_i64().unwrap_or_default(),
        });
    }
    Ok(out)
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installed_service_account_suffices_for_every_controller() -> anyhow::Result<()> {
    nodekeeper_testkit::skip_unless_root!("needs root for the NetworkTest agents' ICMP sockets");
    let _serial = SERIAL.lock().await;
    let client = cluster().client().await?;
    let mark = audit_mark()?;
    install_deploy(&client).await?;
    // As on a first install (another test here may have run a controller before): no Lease and
    // no certificates, so the controller must create them.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NAMESPACE);
    for name in [
        "nodekeeper-ca",
        "nodekeeper-agent-tls",
        "nodekeeper-controller-tls",
    ] {
        let _ = secrets.delete(name, &DeleteParams::default()).await;
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let _ = leases
        .delete("nodekeeper-controller", &DeleteParams::default())
        .await;
    let work = tempfile::tempdir()?;

    // Two nodes with agents (the sweep, the NetworkTest, the NodeDiagnostic) and one pool node
    // with a workload behind a PodDisruptionBudget (the NodeMaintenance).
    let group = unique_name("lp");
    let ips = loopback_ips(2);
    let agents_nodes =
        create_simulated_nodes(&client, "lp-agent", 2, &labels(&[(GROUP, &group)]), &ips).await?;
    let pool = unique_name("pool");
    let pool_nodes =
        create_simulated_nodes(&client, "lp-pool", 1, &labels(&[("pool", &pool)]), &[]).await?;
    let apps = test_namespace(&client, "lp-apps").await?;
    let workload: Value = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": apps},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                "nodeSelector": {"pool": pool}, "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "c", "image": "registry.invalid/web:1"}]}}},
    });
    let budget: Value = json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "web", "namespace": apps},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}},
    });
    apply_all(&client, &[workload, budget]).await?;
    // The Pod this replica runs as: the leader labels it for the Service (`pods` patch).
    let me: Pod = serde_json::from_value(json!({
        "metadata": {"name": unique_name("controller-pod")},
        "spec": {"nodeSelector": {"nodekeeper.dev/none": "none"},
                 "containers": [{"name": "c", "image": "registry.invalid/controller:1"}]},
    }))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let me = pods.create(&PostParams::default(), &me).await?;
    let me_name = me.metadata.name.clone().unwrap_or_default();

    let port = free_port();
    let selector = format!("{GROUP}={group}");
    let started = Instant::now();
    let (mut controller, log) = start_controller(
        &client,
        NAMESPACE,
        &selector,
        port,
        work.path(),
        &[
            ("NODEKEEPER_POD_NAME", &me_name),
            // Room for one bundle of the example's cap (diagnostics.maxBundleBytes): each
            // NodeDiagnostic evicts the last one's bundle and marks it gone in that object's status.
            ("NODEKEEPER_DIAGNOSTICS_MAX_BYTES", "33554432"),
        ],
    )
    .await?;
    let tls = agent_tls(&client, NAMESPACE).await?;
    let mut agents = Vec::new();
    for (node, ip) in agents_nodes.iter().zip(&ips) {
        let agent = start_agent(node, SocketAddr::new((*ip).into(), port), &tls).await?;
        // The example's rules read these; give them values in and out of bounds.
        agent.set_sysctl("net.core.somaxconn", "128")?;
        agent.set_sysctl("net.ipv4.ip_forward", "1")?;
        agent.set_sysctl("vm.swappiness", "10")?;
        agents.push(agent);
    }

    // The sweep: conditions on both nodes.
    for node in &agents_nodes {
        wait_condition(&client, node, "NodekeeperReachable", "True", None, TIMEOUT).await?;
        let nodes_api: Api<Node> = Api::all(client.clone());
        wait_for(&format!("TunablesInBounds on {node}"), TIMEOUT, || {
            let nodes_api = nodes_api.clone();
            async move {
                let n = nodes_api.get(node).await?;
                Ok(controller_common::condition(&n, "TunablesInBounds").map(|_| ()))
            }
        })
        .await?;
    }
    wait_for("the leader's Pod label", TIMEOUT, || {
        let pods = pods.clone();
        let name = me_name.clone();
        async move {
            let pod = pods.get(&name).await?;
            Ok((pod
                .metadata
                .labels
                .unwrap_or_default()
                .get("nodekeeper.dev/leader")
                == Some(&"true".to_owned()))
            .then_some(()))
        }
    })
    .await?;

    // A NetworkTest: the agents ping each other; finished tests are deleted after their TTL.
    let tests: Api<NetworkTest> = Api::namespaced(client.clone(), &apps);
    let mesh = unique_name("mesh");
    apply_spec(
        &tests,
        &mesh,
        json!({"kind": "icmp", "nodeSelector": {"matchLabels": {GROUP: group}}, "count": 2,
            "intervalMs": 20, "timeoutMs": 1000, "targets": [{"peers": {"perNode": 1}}],
            "ttlSecondsAfterFinished": 2}),
    )
    .await?;
    let phase = wait_for("the NetworkTest to finish", TIMEOUT, || {
        let tests = tests.clone();
        let mesh = mesh.clone();
        async move {
            let nt = tests.get(&mesh).await?;
            Ok(nt
                .status
                .and_then(|s| s.phase)
                .filter(|p| matches!(p, TestPhase::Succeeded | TestPhase::Failed)))
        }
    })
    .await?;
    ensure!(
        phase == TestPhase::Succeeded,
        "NetworkTest {mesh}: {phase:?}"
    );

    // A NodeDiagnostic of one node; deleted after its TTL (finalizer removed first). One before
    // it, kept, whose bundle it evicts: the controller reads that object and marks the bundle gone.
    let diagnostics: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &apps);
    let kept = unique_name("diag-kept");
    apply_spec(
        &diagnostics,
        &kept,
        json!({"nodeName": agents_nodes[0], "parts": ["report"], "ttlSecondsAfterFinished": 600}),
    )
    .await?;
    wait_for("the first NodeDiagnostic to finish", TIMEOUT, || {
        let (diagnostics, kept) = (diagnostics.clone(), kept.clone());
        async move {
            let d = diagnostics.get(&kept).await?;
            Ok(d.status
                .filter(|s| s.phase == Some(DiagPhase::Succeeded))
                .map(|_| ()))
        }
    })
    .await?;
    let diag = unique_name("diag");
    apply_spec(
        &diagnostics,
        &diag,
        json!({"nodeName": agents_nodes[0], "parts": ["report", "sysctl"],
               "ttlSecondsAfterFinished": 2}),
    )
    .await?;
    let phase = wait_for("the NodeDiagnostic to finish", TIMEOUT, || {
        let diagnostics = diagnostics.clone();
        let diag = diag.clone();
        async move {
            let d = diagnostics.get(&diag).await?;
            Ok(d.status
                .and_then(|s| s.phase)
                .filter(|p| matches!(p, DiagPhase::Succeeded | DiagPhase::Failed)))
        }
    })
    .await?;
    ensure!(
        phase == DiagPhase::Succeeded,
        "NodeDiagnostic {diag}: {phase:?}"
    );
    wait_for(
        "the evicted bundle marked gone in its object",
        TIMEOUT,
        || {
            let (diagnostics, kept) = (diagnostics.clone(), kept.clone());
            async move {
                let d = diagnostics.get(&kept).await?;
                Ok(d.status
                    .filter(|s| s.nodes.iter().all(|n| n.download_path.is_empty()))
                    .map(|_| ()))
            }
        },
    )
    .await?;
    diagnostics.delete(&kept, &DeleteParams::default()).await?;

    // A NodeMaintenance: cordon and drain the pool node through the Eviction API, then Complete.
    let maintenances: Api<NodeMaintenance> = Api::all(client.clone());
    let nm = unique_name("lp-drain");
    apply_spec(
        &maintenances,
        &nm,
        json!({"nodeSelector": {"matchLabels": {"pool": pool}}, "stage": "Drain",
               "reason": "least-privilege test"}),
    )
    .await?;
    let drained = |want: NodePhase| {
        let maintenances = maintenances.clone();
        let nm = nm.clone();
        let node = pool_nodes[0].clone();
        move || {
            let maintenances = maintenances.clone();
            let nm = nm.clone();
            let node = node.clone();
            async move {
                let m = maintenances.get(&nm).await?;
                Ok(m.status
                    .is_some_and(|s| s.nodes.iter().any(|n| n.node == node && n.phase == want))
                    .then_some(()))
            }
        }
    };
    wait_for(
        "the pool node to be drained",
        TIMEOUT,
        drained(NodePhase::Drained),
    )
    .await?;
    maintenances
        .patch(
            &nm,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"stage": "Complete"}})),
        )
        .await?;
    wait_for(
        "the pool node to be released",
        TIMEOUT,
        drained(NodePhase::Released),
    )
    .await?;
    maintenances.delete(&nm, &DeleteParams::default()).await?;
    wait_for("the NodeMaintenance to go", TIMEOUT, || {
        let maintenances = maintenances.clone();
        let nm = nm.clone();
        async move { Ok(maintenances.get_opt(&nm).await?.is_none().then_some(())) }
    })
    .await?;

    // A refused tuning ConfigMap: the Warning Event naming the key.
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    configmaps
        .patch(
            "nodekeeper-tuning",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"sweepIntervall": "10s"}})),
        )
        .await?;
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), NAMESPACE);
    wait_for(
        "the Warning Event about the tuning ConfigMap",
        TIMEOUT,
        || {
            let events = events.clone();
            async move {
                let list = events.list(&ListParams::default()).await?;
                Ok(list
                    .items
                    .iter()
                    .any(|e| {
                        e.regarding.as_ref().and_then(|r| r.name.as_deref())
                            == Some("nodekeeper-tuning")
                            && e.type_.as_deref() == Some("Warning")
                    })
                    .then_some(()))
            }
        },
    )
    .await?;
    configmaps
        .patch(
            "nodekeeper-tuning",
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(json!([
                {"op": "remove", "path": "/data/sweepIntervall"}
            ]))?),
        )
        .await?;

    // Finished NetworkTests and NodeDiagnostics are deleted by the controller (their TTL).
    wait_for(
        "the expired NetworkTest and NodeDiagnostic to go",
        TIMEOUT,
        || {
            let (tests, diagnostics) = (tests.clone(), diagnostics.clone());
            let (mesh, diag) = (mesh.clone(), diag.clone());
            async move {
                Ok((tests.get_opt(&mesh).await?.is_none()
                    && diagnostics.get_opt(&diag).await?.is_none())
                .then_some(()))
            }
        },
    )
    .await?;
    // Every metric the chart's alerts and dashboard query is one this controller declares.
    // Reconcile failures appear with the first failure: the missing-verb test checks that one.
    wait_monitoring_names(controller.http, &["nodekeeper_reconcile_failures"]).await?;
    controller.process.check_alive()?;
    controller.stop();
    drop(agents);
    eprintln!(
        "least privilege: happy paths done in {:.0}s",
        started.elapsed().as_secs_f64()
    );

    // The audit log: no 403 for the controller's account, and the calls that matter were made.
    // The API server writes the log asynchronously: give it a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = requests_of(&user(NAMESPACE), mark)?;
    let forbidden: BTreeSet<String> = requests
        .iter()
        .filter(|r| r.code == 403)
        .map(|r| format!("{} {} {}/{}", r.verb, r.resource, r.namespace, r.name))
        .collect();
    let log_tail = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        forbidden.is_empty(),
        "the ServiceAccount from deploy/ was refused (add these to deploy/controller/controller.yaml and the chart): {forbidden:#?}\ncontroller log:\n{log_tail}"
    );
    let seen: BTreeSet<(String, String)> = requests
        .iter()
        .filter(|r| (200..300).contains(&r.code))
        .map(|r| (r.verb.clone(), r.resource.clone()))
        .collect();
    for (verb, resource) in [
        ("watch", "nodes"),
        ("patch", "nodes/status"),
        ("patch", "nodes"),
        ("create", "coordination.k8s.io/leases"),
        ("update", "coordination.k8s.io/leases"),
        ("create", "secrets"),
        ("patch", "pods"),
        ("create", "pods/eviction"),
        ("patch", "nodekeeper.dev/networktests/status"),
        ("delete", "nodekeeper.dev/networktests"),
        ("patch", "nodekeeper.dev/nodemaintenances/status"),
        ("patch", "nodekeeper.dev/nodediagnostics/status"),
        ("delete", "nodekeeper.dev/nodediagnostics"),
        ("get", "nodekeeper.dev/nodediagnostics"),
        ("create", "events.k8s.io/events"),
    ] {
        assert!(
            seen.contains(&(verb.to_owned(), resource.to_owned())),
            "the happy paths never made a successful `{verb} {resource}` as the ServiceAccount; seen: {seen:#?}"
        );
    }
    eprintln!(
        "least privilege: {} requests as {}, none refused; {} distinct verb/resource pairs",
        requests.len(),
        user(NAMESPACE),
        seen.len()
    );
    Ok(())
}

/// The `nodekeeper_…` metric families the chart's alert rules and dashboard query that the
/// controller's /metrics (`exposition`) does not declare (`# TYPE`). prometheus-client leaves a
/// labelled family out until its first sample, so callers wait, or allow what cannot have one.
fn undeclared_monitoring_names(exposition: &str) -> anyhow::Result<BTreeSet<String>> {
    let declared: BTreeSet<&str> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let files = repo().join("deploy/helm/nodekeeper/files");
    let mut referenced = BTreeSet::new();
    for file in ["prometheus-rules.yaml", "grafana-dashboard.json"] {
        let text = std::fs::read_to_string(files.join(file))?;
        for (at, _) in text.match_indices("nodekeeper_") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let family = ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name)
                .to_owned();
            referenced.insert(family);
        }
    }
    ensure!(referenced.len() >= 8, "only {referenced:?} referenced");
    Ok(referenced
        .into_iter()
        .filter(|f| !declared.contains(f.as_str()))
        .collect())
}

/// Waits until every metric the alerts and dashboard query, but `allowed`, is on /metrics.
async fn wait_monitoring_names(http: SocketAddr, allowed: &[&str]) -> anyhow::Result<()> {
    let mut last = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(45);
    while Instant::now() < deadline {
        let (code, text) = controller_common::http_get(http, "/metrics").await?;
        ensure!(code == 200, "GET /metrics: {code}");
        last = undeclared_monitoring_names(&text)?;
        last.retain(|f| !allowed.contains(&f.as_str()));
        if last.is_empty() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    anyhow::bail!(
        "the chart's alerts or dashboard query metrics the controller does not expose: {last:?}"
    )
}

/// The deploy/ Role or ClusterRole with `verb` taken from the rule for `resource`.
fn without_verb(objects: &[Value], kind: &str, resource: &str, verb: &str) -> Value {
    let mut role = objects
        .iter()
        .find(|o| o["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in deploy/"))
        .clone();
    let mut found = false;
    for rule in role["rules"].as_array_mut().unwrap() {
        if rule["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == resource)
        {
            let verbs = rule["verbs"].as_array_mut().unwrap();
            let before = verbs.len();
            verbs.retain(|v| v != verb);
            found |= verbs.len() != before;
        }
    }
    assert!(found, "{kind} has no `{verb} {resource}` to take away");
    role["rules"]
        .as_array_mut()
        .unwrap()
        .retain(|r| !r["verbs"].as_array().unwrap().is_empty());
    role
}

/// Waits until the log at `path` holds a line with every one of `needles`; returns the line.
async fn log_line(path: &Path, needles: &[&str], timeout: Duration) -> anyhow::Result<String> {
    let what = format!("a controller log line with {needles:?}");
    wait_for(&what, timeout, || async {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        Ok(text
            .lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned))
    })
    .await
}

/// The FlowSchema `deploy/` installs puts the controller's Lease requests, and only those, in the
/// built-in `leader-election` priority level, where a burst from other clients cannot hold up a
/// renewal. The API server names the FlowSchema and the priority level it chose for a request in
/// the response headers `X-Kubernetes-PF-FlowSchema-UID` and `X-Kubernetes-PF-PriorityLevel-UID`;
/// the requests are made with the installed ServiceAccount's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_lease_requests_get_the_leader_election_priority_level()
-> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = cluster().client().await?;
    install_deploy(&client).await?;
    let uid = |meta: kube::api::ObjectMeta| meta.uid.unwrap_or_default();
    let schemas: Api<FlowSchema> = Api::all(client.clone());
    let ours = uid(schemas
        .get("nodekeeper-controller-leader-election")
        .await
        .context("the FlowSchema from deploy/controller/controller.yaml")?
        .metadata);
    let levels: Api<PriorityLevelConfiguration> = Api::all(client.clone());
    let leader_election = uid(levels.get("leader-election").await?.metadata);
    let work = tempfile::tempdir()?;
    let kubeconfig = work.path().join("kubeconfig");
    service_account_kubeconfig(
        &client,
        cluster().kubeconfig(),
        NAMESPACE,
        ACCOUNT,
        &kubeconfig,
    )
    .await?;
    let account = nodekeeper_e2e::controlplane::client_from_kubeconfig(&kubeconfig).await?;
    // (FlowSchema UID, PriorityLevelConfiguration UID) the API server chose for a GET of `path`.
    let classify = |path: String| {
        let account = account.clone();
        async move {
            let request = http::Request::get(&path).body(kube::client::Body::empty())?;
            let response = account.send(request).await?;
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned()
            };
            ensure!(
                response.status().is_success(),
                "GET {path} as {}: {}",
                user(NAMESPACE),
                response.status()
            );
            anyhow::Ok((
                header("X-Kubernetes-PF-FlowSchema-UID"),
                header("X-Kubernetes-PF-PriorityLevel-UID"),
            ))
        }
    };
    let leases = format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases");
    // The API server reads FlowSchemas from a watch: a new one takes effect within moments.
    let chosen = wait_for("the API server to use the FlowSchema", TIMEOUT, || {
        let (leases, ours) = (leases.clone(), ours.clone());
        async move {
            let chosen = classify(leases).await?;
            Ok((chosen.0 == ours).then_some(chosen))
        }
    })
    .await;
    let chosen = match chosen {
        Ok(chosen) => chosen,
        Err(error) => {
            let status = schemas
                .get("nodekeeper-controller-leader-election")
                .await?
                .status;
            anyhow::bail!("{error:#}; the FlowSchema's status: {status:?}");
        }
    };
    ensure!(
        chosen.1 == leader_election,
        "the Lease requests' priority level is {}, not leader-election ({leader_election})",
        chosen.1
    );
    // Everything else the controller does stays where it was: reading Nodes is not a Lease request.
    let nodes = classify("/api/v1/nodes?limit=1".to_owned()).await?;
    ensure!(
        nodes.0 != ours && nodes.1 != leader_election,
        "a Node list got the controller's leader-election FlowSchema: {nodes:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_verb_is_named_in_the_log_without_a_crash() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = cluster().client().await?;
    let objects = install_deploy(&client).await?;
    let work = tempfile::tempdir()?;
    let apps = test_namespace(&client, "lp-verbs").await?;
    let group = unique_name("verbs");
    let ips = loopback_ips(1);
    let nodes =
        create_simulated_nodes(&client, "lp-verbs", 1, &labels(&[(GROUP, &group)]), &ips).await?;
    let selector = format!("{GROUP}={group}");

    // (kind, resource, verb, what the controller must log besides the API server's refusal)
    let cases = [
        (
            "ClusterRole",
            "nodes/status",
            "patch",
            "patching node conditions failed",
        ),
        ("ClusterRole", "networktests", "list", "networktest"),
        (
            "ClusterRole",
            "nodediagnostics/status",
            "patch",
            "nodediagnostic",
        ),
        ("Role", "leases", "create", "lease"),
    ];
    for (kind, resource, verb, context) in cases {
        let role = without_verb(&objects, kind, resource, verb);
        apply_all(&client, &[role]).await?;
        if resource == "leases" {
            // A first install: no Lease yet, so the controller must create one.
            let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
            let _ = leases
                .delete("nodekeeper-controller", &DeleteParams::default())
                .await;
        }
        // RBAC changes reach the authorizer through its informer: wait until the API says no.
        let port = free_port();
        let (mut controller, log) =
            start_controller(&client, NAMESPACE, &selector, port, work.path(), &[]).await?;
        let mut agent = None;
        if resource != "leases" {
            let tls = agent_tls(&client, NAMESPACE).await?;
            agent = Some(start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?);
        }
        if resource == "networktests" || resource == "nodediagnostics/status" {
            let name = unique_name("verb");
            if resource == "networktests" {
                let api: Api<NetworkTest> = Api::namespaced(client.clone(), &apps);
                apply_spec(
                    &api,
                    &name,
                    json!({"kind": "tcp", "nodeSelector": {"matchLabels": {GROUP: group}},
                    "targets": [{"apiServer": true}]}),
                )
                .await?;
            } else {
                let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), &apps);
                apply_spec(
                    &api,
                    &name,
                    json!({"nodeName": nodes[0], "parts": ["report"]}),
                )
                .await?;
            }
        }
        // Kubernetes' refusal names the verb and the resource; the controller's line carries it
        // with what it was doing.
        let (resource_name, _) = resource.split_once('/').unwrap_or((resource, ""));
        let refusal = format!("cannot {verb} resource \\\"{resource_name}");
        let refusal_plain = format!("cannot {verb} resource \"{resource_name}");
        let line = match log_line(&log, &[&refusal_plain], Duration::from_secs(60)).await {
            Ok(line) => line,
            Err(_) => log_line(&log, &[&refusal], Duration::from_secs(5))
                .await
                .with_context(|| {
                    format!(
                        "without `{verb} {resource}` the controller never said so; log:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    )
                })?,
        };
        assert!(
            line.to_lowercase().contains(context),
            "the line naming `{verb} {resource}` does not say what failed ({context}): {line}"
        );
        // Still running, and not printing the refusal in a tight loop.
        tokio::time::sleep(Duration::from_secs(10)).await;
        controller.process.check_alive().with_context(|| {
            format!("the controller exited without `{verb} {resource}` (a crash loop in a Pod)")
        })?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let repeats = text
            .lines()
            .filter(|l| l.contains(&refusal_plain) || l.contains(&refusal))
            .count();
        assert!(
            repeats <= 20,
            "`{verb} {resource}` refused {repeats} times in a few seconds: a retry storm\n{text}"
        );
        eprintln!("missing `{verb} {resource}` ({repeats} lines): {line}");
        if resource == "nodediagnostics/status" {
            // A failed reconcile: now every metric the alerts and dashboard query exists.
            // (Condition patches show once this process writes one: the happy path checks it.)
            wait_monitoring_names(controller.http, &["nodekeeper_conditions_patches"]).await?;
        }
        controller.stop();
        drop(agent);
        // Put the permission back for the next case.
        apply_all(&client, &objects).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_into_another_namespace() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let client = cluster().client().await?;
    let mark = audit_mark()?;
    install_crds(&client).await?;
    let namespace = unique_name("nk-helm");
    // Agent and controller Pods are kept off the simulated nodes: this cluster's kwok would run them.
    let objects = helm_template(
        &namespace,
        &[
            "--set",
            "createNamespace=true",
            "--set",
            "agent.nodeSelector.nodekeeper\\.dev/none=none",
            "--set",
            "controller.nodeSelector.nodekeeper\\.dev/none=none",
        ],
    )
    .map_err(anyhow::Error::msg)?;
    ensure!(
        objects.iter().all(|o| o["kind"] == "ClusterRole"
            || o["kind"] == "ClusterRoleBinding"
            || o["kind"] == "FlowSchema"
            || o["kind"] == "Namespace"
            || o["metadata"]["namespace"] == namespace.as_str()),
        "a namespaced object outside {namespace}"
    );
    apply_all(&client, &objects).await?;
    let work = tempfile::tempdir()?;
    let (mut controller, log) = start_controller(
        &client,
        &namespace,
        "nodekeeper.dev/none=none",
        free_port(),
        work.path(),
        &[],
    )
    .await?;
    // It leads and issues its certificates in that namespace, as that namespace's account.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &namespace);
    wait_for(
        "the controller's Secrets and Lease in the namespace",
        TIMEOUT,
        || {
            let (secrets, leases) = (secrets.clone(), leases.clone());
            async move {
                let tls = secrets.get_opt("nodekeeper-agent-tls").await?.is_some();
                let lease = !leases.list(&ListParams::default()).await?.items.is_empty();
                Ok((tls && lease).then_some(()))
            }
        },
    )
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    let tuning: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    ensure!(tuning.get_opt("nodekeeper-tuning").await?.is_some());
    controller.process.check_alive()?;
    controller.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let refused: Vec<Request> = requests_of(&user(&namespace), mark)?
        .into_iter()
        .filter(|r| r.code == 403)
        .collect();
    ensure!(refused.is_empty(), "refused in {namespace}: {refused:#?}");
    Ok(())
}
