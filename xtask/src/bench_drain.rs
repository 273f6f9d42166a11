//! `cargo xtask bench drain`: a `NodeMaintenance` draining N kwok nodes of P pods each, owned by
//! Deployments whose PodDisruptionBudgets allow one pod down at a time, `maxConcurrentNodes` M,
//! through the release controller under its own ServiceAccount on a private control plane with
//! audit logging. Reports the time to every node Drained against the lower bound the budgets
//! allow (replacement time × the serial steps they force), the controller's API requests per
//! evicted pod (audit log), its status writes per node, and its CPU time (the machine is shared,
//! so wall time alone says little). Writes its section (`## drain`) in BENCHMARKS.md.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::NodeMaintenance;
use nodekeeper_e2e::controlplane::{Lifetime, Options, nodes};
use nodekeeper_e2e::{ControlPlane, wait_for};
use serde_json::json;

use crate::fleet_rig::{
    CONTROLLER_USER, NAMESPACE, audit_counts, audit_end, audit_lines, controller_kubeconfig,
    proc_usage,
};
use nodekeeper_e2e::rig::{ControllerConfig, ControllerProcess, Output, Program};

/// `cargo xtask bench drain` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct DrainArgs {
    /// Nodes maintained.
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// Pods per node: one Deployment per pod slot, `nodes` replicas each.
    #[arg(long, default_value_t = 30)]
    pub pods_per_node: usize,
    /// `spec.maxConcurrentNodes`.
    #[arg(long, default_value_t = 10)]
    pub max_concurrent: u32,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
    /// A release controller binary built already (skips the build: on a shared machine a
    /// release build takes longer than the benchmark).
    #[arg(long, env = "NODEKEEPER_BENCH_CONTROLLER")]
    pub controller: Option<PathBuf>,
    /// The controller's `NODEKEEPER_LOG` (its log goes to this command's stderr); `info`
    /// shows each accepted eviction.
    #[arg(long, env = "NODEKEEPER_BENCH_CONTROLLER_LOG", default_value = "warn")]
    pub controller_log: String,
}

const TARGET_RATIO: f64 = 1.5;
const TARGET_REQUESTS_PER_POD: f64 = 3.0;
const TARGET_STATUS_WRITES_PER_NODE: f64 = 6.0;
const WORK_NS: &str = "drain-bench";
const TARGET_LABEL: &str = "nodekeeper.dev/bench-drain";
const POOL_LABEL: &str = "nodekeeper.dev/bench-pool";

pub fn run(args: DrainArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    if let Some(controller) = args.controller.clone() {
        anyhow::ensure!(
            controller.is_file(),
            "--controller {}: no such file; build it with `cargo build --release -p nodekeeper-controller`, or leave the flag out",
            controller.display()
        );
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        return runtime.block_on(bench(args, root, controller));
    }
    let controller = crate::fleet_rig::build_controller(&root, false)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench(args, root, controller))
}

struct Figures {
    seconds: f64,
    replace_seconds: f64,
    /// Until the last budget of a round allows again (median of the rounds).
    round_seconds: f64,
    /// The most evictions one Deployment needed.
    steps: u64,
    /// Pods on the maintained nodes when the drain started.
    evicted: usize,
    requests: u64,
    by_kind: BTreeMap<String, u64>,
    status_writes: u64,
    /// Evictions the API server accepted, and refused with 429.
    accepted: u64,
    refused: u64,
    /// The controller's reaction per step (see [`Answers::reactions`]): median and 90th
    /// percentile, seconds.
    reaction: (f64, f64),
    /// Seconds from the create to the first node drained and to half of them.
    first_drained: f64,
    half_drained: f64,
    /// The controller's CPU seconds (user + system) during the drain, and its RSS at the end.
    cpu_seconds: f64,
    rss_mib: f64,
    /// The host's 1-minute load average at the start and the end of the drain.
    load: (f64, f64),
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The controller's evictions in the audit log.
#[derive(Default)]
struct Answers {
    /// Accepted, and refused with 429.
    accepted: u64,
    refused: u64,
    /// Accepted per Deployment (`app-NN`, from the pod's name).
    per_app: BTreeMap<String, u64>,
    /// Per accepted eviction after a Deployment's first: seconds from the last budget status
    /// write of kube-controller-manager's disruption controller before it (the one that allowed
    /// it) to the eviction. The controller's share of each serial step.
    reactions: Vec<f64>,
}

const DISRUPTION_CONTROLLER: &str = "system:serviceaccount:kube-system:disruption-controller";

fn audit_time(event: &serde_json::Value, field: &str) -> Option<f64> {
    let t: k8s_openapi::jiff::Timestamp = event[field].as_str()?.parse().ok()?;
    Some(t.as_microsecond() as f64 / 1e6)
}

/// The controller's evictions in the audit log after the mark `from`.
fn eviction_answers(path: &std::path::Path, from: u64) -> anyhow::Result<Answers> {
    let mut answers = Answers::default();
    // Per Deployment: the last budget write and whether an eviction came after the one before.
    let mut last_budget: BTreeMap<String, f64> = BTreeMap::new();
    let mut evicted_once: BTreeMap<String, bool> = BTreeMap::new();
    for event in audit_lines(path, from, u64::MAX)?.0 {
        if event["stage"] != "ResponseComplete" {
            continue;
        }
        let object = &event["objectRef"];
        if event["user"]["username"] == DISRUPTION_CONTROLLER
            && object["resource"] == "poddisruptionbudgets"
            && object["subresource"] == "status"
            && let (Some(name), Some(at)) = (
                object["name"].as_str(),
                audit_time(&event, "stageTimestamp"),
            )
        {
            let app = name.trim_end_matches("-pdb").to_owned();
            last_budget.insert(app, at);
            continue;
        }
        if event["user"]["username"] != CONTROLLER_USER || object["subresource"] != "eviction" {
            continue;
        }
        match event["responseStatus"]["code"].as_i64() {
            Some(200..=299) => {
                answers.accepted += 1;
                let app = app_of(object["name"].as_str().unwrap_or_default());
                *answers.per_app.entry(app.clone()).or_default() += 1;
                let sent = audit_time(&event, "requestReceivedTimestamp");
                if evicted_once.insert(app.clone(), true).is_some()
                    && let (Some(sent), Some(allowed)) = (sent, last_budget.get(&app))
                {
                    answers.reactions.push(sent - allowed);
                }
            }
            Some(429) => answers.refused += 1,
            _ => {}
        }
    }
    Ok(answers)
}

/// The Deployment of a pod `app-NN-<replicaset hash>-<suffix>`.
fn app_of(pod: &str) -> String {
    pod.rsplitn(3, '-').last().unwrap_or(pod).to_owned()
}

/// Evicts one Running pod of each of the `deployments` Deployments at once (as the admin, through
/// the Eviction subresource, like the controller) and returns, in seconds, the median over the
/// budgets of the time until each allows a disruption again (one Deployment's serial step
/// while the others replace theirs), and the time until the last does.
async fn eviction_round(
    pods: &Api<Pod>,
    pdb_api: &Api<PodDisruptionBudget>,
    deployments: usize,
) -> anyhow::Result<(f64, f64)> {
    wait_budgets(pdb_api, deployments, 1).await?;
    let mut victims: BTreeMap<String, (String, String)> = BTreeMap::new();
    for p in pods.list(&ListParams::default()).await?.items {
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if p.metadata.deletion_timestamp.is_some() || !running {
            continue;
        }
        let app = p.labels().get("app").cloned().unwrap_or_default();
        victims
            .entry(app)
            .or_insert_with(|| (p.name_any(), p.uid().unwrap_or_default()));
    }
    anyhow::ensure!(
        victims.len() == deployments,
        "a Running pod of every Deployment ({} of {deployments})",
        victims.len()
    );
    let started = Instant::now();
    let sends = victims.values().map(|(name, uid)| {
        let body = json!({
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": name},
            "deleteOptions": {"preconditions": {"uid": uid}},
        });
        async move {
            pods.create_subresource::<_, serde_json::Value>(
                "eviction",
                name,
                &PostParams::default(),
                &body,
            )
            .await
            .with_context(|| format!("evict {name}"))
        }
    });
    futures::future::try_join_all(sends).await?;
    // An accepted eviction has written its budget's status (allowing nothing) before it
    // answers, so from here "allows again" is the replacement's doing.
    let mut back: BTreeMap<String, f64> = BTreeMap::new();
    while back.len() < deployments {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "budgets still allowing nothing 300 s after the evictions ({} of {deployments} back)",
            back.len()
        );
        for p in pdb_api.list(&ListParams::default()).await?.items {
            if p.status.as_ref().and_then(|s| s.disruptions_allowed) == Some(1) {
                back.entry(p.name_any())
                    .or_insert_with(|| started.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut times: Vec<f64> = back.into_values().collect();
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times[times.len() - 1]))
}

async fn bench(args: DrainArgs, root: PathBuf, controller: PathBuf) -> anyhow::Result<()> {
    let say = |text: String| eprintln!("[bench drain] {text}");
    let mut options = Options::new(
        format!("bench-drain-{}", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    options.max_requests_inflight = Some(2000);
    options.max_mutating_requests_inflight = Some(1000);
    say("starting a private control plane (audit on)".into());
    let cp = ControlPlane::start(options)?;
    let client = cp.client().await?;
    let audit = cp.audit_log().context("audit log")?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for ns in [NAMESPACE, WORK_NS] {
        namespaces
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
            )
            .await?;
        wait_for("default ServiceAccount", Duration::from_secs(60), || {
            let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
            async move { Ok(sas.get_opt("default").await?.map(|_| ())) }
        })
        .await?;
    }
    nodekeeper_e2e::install_crds(&client).await?;
    let kubeconfig = cp.kubeconfig().with_file_name("controller-kubeconfig.yaml");
    controller_kubeconfig(&client, &root, cp.kubeconfig(), &kubeconfig).await?;
    Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE)
        .patch(
            "nodekeeper-tuning",
            &PatchParams::apply("nodekeeper-bench").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "nodekeeper-tuning"},
                "data": {"maintenance.maxConcurrentNodes": args.max_concurrent.to_string(),
                         "maintenance.maxSelectedNodes": args.nodes.to_string()}})),
        )
        .await?;

    // The maintained nodes first; the workloads land there; the spare nodes come after.
    let n = args.nodes;
    let targets: Vec<String> = (0..n).map(|i| format!("drain-{i:04}")).collect();
    let pool = BTreeMap::from([(POOL_LABEL.to_owned(), "bench".to_owned())]);
    let mut target_labels = pool.clone();
    target_labels.insert(TARGET_LABEL.to_owned(), "target".to_owned());
    let ips: Vec<_> = (0..n).map(nodes_ip).collect();
    nodes::create(&client, &targets, &ips, &target_labels).await?;
    nodes::wait_schedulable(&client, &targets, Duration::from_secs(300)).await?;

    let deployments = args.pods_per_node;
    let total = n * deployments;
    say(format!(
        "{deployments} Deployments × {n} replicas, PDB maxUnavailable 1 each"
    ));
    let deploy_api: Api<Deployment> = Api::namespaced(client.clone(), WORK_NS);
    let pdb_api: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), WORK_NS);
    for d in 0..deployments {
        let name = format!("app-{d:02}");
        deploy_api
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name},
                    "spec": {
                        "replicas": n,
                        "selector": {"matchLabels": {"app": name}},
                        "template": {
                            "metadata": {"labels": {"app": name}},
                            "spec": {
                                "nodeSelector": {POOL_LABEL: "bench"},
                                "terminationGracePeriodSeconds": 1,
                                // Spread one per node where possible.
                                "topologySpreadConstraints": [{
                                    "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                    "whenUnsatisfiable": "ScheduleAnyway",
                                    "labelSelector": {"matchLabels": {"app": name}},
                                }],
                                "containers": [{"name": "c", "image": "registry.invalid/app:1",
                                    "resources": {"requests": {"cpu": "10m"}}}],
                            },
                        },
                    },
                }))?,
            )
            .await?;
        pdb_api
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": format!("{name}-pdb")},
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": name}}},
                }))?,
            )
            .await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), WORK_NS);
    let placed = Instant::now();
    wait_for(
        &format!("{total} pods Running"),
        Duration::from_secs(1200),
        || {
            let pods = pods.clone();
            async move {
                let running = running(&pods).await?;
                Ok((running >= total).then_some(()))
            }
        },
    )
    .await?;
    say(format!("{total} pods Running in {:.0?}", placed.elapsed()));
    let spares_needed = total.div_ceil(100) + 1;
    let spares: Vec<String> = (0..spares_needed)
        .map(|i| format!("spare-{i:04}"))
        .collect();
    let spare_ips: Vec<_> = (0..spares_needed).map(|i| nodes_ip(n + i)).collect();
    nodes::create(&client, &spares, &spare_ips, &pool).await?;
    nodes::wait_schedulable(&client, &spares, Duration::from_secs(300)).await?;
    wait_budgets(&pdb_api, deployments, 1).await?;

    // The time one serial step takes: one pod of every Deployment evicted at once (what a
    // drain at full speed does, one pod per budget), until every budget allows a disruption
    // again (replacement created, scheduled, Running, Ready, budget status updated). Evicted
    // together, not one pod alone: kube-controller-manager's controllers each have a client
    // limited to 20 requests/s, and 30 replacements at once queue behind it where a single one
    // does not (a lone replacement takes about 0.3 s on kwok; a round of 30 takes seconds).
    let mut samples = Vec::new();
    let mut lasts = Vec::new();
    for round in 0..3 {
        let (median, last) = eviction_round(&pods, &pdb_api, deployments).await?;
        say(format!(
            "round {round}: {deployments} evictions at once; budgets allow again after {median:.2} s (median), {last:.2} s (last)"
        ));
        samples.push(median);
        lasts.push(last);
    }
    samples.sort_by(f64::total_cmp);
    lasts.sort_by(f64::total_cmp);
    let replace_seconds = samples[1];
    let round_seconds = lasts[1];
    say(format!(
        "one serial step (median of 3 rounds): {replace_seconds:.2} s; a whole round {round_seconds:.2} s"
    ));

    // Pods on the maintained nodes now; the serial steps themselves are counted after the
    // drain from the evictions accepted per Deployment (a replacement the scheduler puts on a
    // maintained node still waiting its turn is evicted again: one more step for its budget).
    let on_targets = pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_some_and(|n| n.starts_with("drain-"))
        })
        .count();

    let controller = ControllerProcess::spawn(
        &Program::Binary(controller),
        &ControllerConfig {
            kubeconfig,
            namespace: NAMESPACE.into(),
            identity: "bench-controller".into(),
            http: "127.0.0.1:18081".parse()?,
            agent_port: 9443,
            node_selector: format!("{}=fleet", crate::fleet_rig::GROUP_LABEL),
            log: Some(args.controller_log.clone()),
            env: Vec::new(),
            output: Output::Stderr,
        },
    )?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let audit_from = audit_end(&audit)?;
    let (_, _, cpu_before) = proc_usage(controller.pid())?;
    let load_start = load_average();
    let nms: Api<NodeMaintenance> = Api::all(client.clone());
    let started = Instant::now();
    let mut first_drained = None;
    let mut half_drained = None;
    nms.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NodeMaintenance",
            "metadata": {"name": "bench"},
            "spec": {
                "nodeSelector": {"matchLabels": {TARGET_LABEL: "target"}},
                "stage": "Drain",
                "maxConcurrentNodes": args.max_concurrent,
                "drainTimeout": "1h",
            },
        }))?,
    )
    .await?;
    let mut last_report = Instant::now();
    loop {
        let nm = nms.get("bench").await?;
        let drained = nm.status.as_ref().map_or(0, |s| s.drained) as usize;
        if drained >= 1 && first_drained.is_none() {
            first_drained = Some(started.elapsed().as_secs_f64());
            say(format!(
                "first node drained after {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        if drained * 2 >= n && half_drained.is_none() {
            half_drained = Some(started.elapsed().as_secs_f64());
            say(format!(
                "half the nodes drained after {:.1} s",
                started.elapsed().as_secs_f64()
            ));
        }
        if drained == n {
            break;
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            say(format!(
                "{drained}/{n} nodes drained after {:.0?}",
                started.elapsed()
            ));
            last_report = Instant::now();
        }
        if started.elapsed() > Duration::from_secs(3600) {
            bail!("not every node drained within an hour ({drained}/{n})");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let (_, _, cpu_after) = proc_usage(controller.pid())?;
    let load_end = load_average();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss_kib, _, _) = proc_usage(controller.pid())?;
    let answers = eviction_answers(&audit, audit_from)?;
    let steps = answers.per_app.values().copied().max().unwrap_or(0);
    let (counts, _, _) = audit_counts(&audit, audit_from)?;
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for ((user, verb, resource), c) in &counts {
        if user == CONTROLLER_USER {
            *by_kind.entry(format!("{verb} {resource}")).or_default() += c;
        }
    }
    let requests = by_kind.values().sum();
    let status_writes = by_kind
        .get("patch nodemaintenances/status")
        .copied()
        .unwrap_or(0);
    let figures = Figures {
        seconds,
        replace_seconds,
        round_seconds,
        steps,
        evicted: on_targets,
        requests,
        by_kind,
        status_writes,
        reaction: percentiles(answers.reactions),
        accepted: answers.accepted,
        refused: answers.refused,
        first_drained: first_drained.unwrap_or(seconds),
        half_drained: half_drained.unwrap_or(seconds),
        cpu_seconds: cpu_after - cpu_before,
        rss_mib: rss_kib as f64 / 1024.0,
        load: (load_start, load_end),
    };
    drop(controller);
    drop(cp);

    let report = render(&args, &figures);
    println!("{report}");
    if !args.no_write {
        crate::benchmarks::write_section(&root, "drain", &report)?;
    }
    Ok(())
}

/// Median and 90th percentile (0 for none).
fn percentiles(mut v: Vec<f64>) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.9))
}

fn nodes_ip(i: usize) -> std::net::Ipv4Addr {
    crate::fleet_rig::node_ip(i)
}

async fn running(pods: &Api<Pod>) -> anyhow::Result<usize> {
    Ok(pods
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .count())
}

/// Waits until `n` budgets allow exactly `allowed` disruptions.
async fn wait_budgets(
    api: &Api<PodDisruptionBudget>,
    n: usize,
    allowed: i32,
) -> anyhow::Result<()> {
    wait_for(
        &format!("{n} budgets to allow {allowed} disruptions"),
        Duration::from_secs(300),
        || async {
            let ok = api
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|p| p.status.as_ref().and_then(|s| s.disruptions_allowed) == Some(allowed))
                .count();
            Ok((ok >= n).then_some(()))
        },
    )
    .await
}

fn render(args: &DrainArgs, f: &Figures) -> String {
    let bound = f.replace_seconds * f.steps as f64;
    let ratio = if bound > 0.0 { f.seconds / bound } else { 0.0 };
    let per_pod = f.requests as f64 / f.accepted.max(1) as f64;
    let per_node = f.status_writes as f64 / args.nodes.max(1) as f64;
    let host_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mut out = String::from("## drain\n\n");
    out.push_str(&format!(
        "A `NodeMaintenance` (stage `Drain`, `maxConcurrentNodes` {}) over {} kwok nodes with {} pods each ({} Deployments of {} replicas, each with a PodDisruptionBudget `maxUnavailable: 1`), spare nodes for the replacements, the release controller under its own ServiceAccount, a private control plane with audit logging. The lower bound is what the budgets allow: a Deployment's evictions go one at a time, so the most evictions one Deployment needed ({} serial steps: its pods on the maintained nodes, plus each replacement the scheduler put on a maintained node still waiting its turn, evicted again) times the time of one step (one pod of every Deployment evicted at once, the median over the budgets of the time until each allows a disruption again, median of 3 rounds: {:.2} s; the last budget of a round took {:.2} s; measured under the same concurrency as the drain, because kube-controller-manager's ReplicaSet and disruption controllers each send at most 20 requests/s and a round of replacements queues behind that where a single one does not). Requests are every API request of the controller in the audit log from the create to the last node drained, divided by the evictions accepted. Targets: ≤ {TARGET_RATIO}× the bound, ≤ {TARGET_REQUESTS_PER_POD} requests per evicted pod, ≤ {TARGET_STATUS_WRITES_PER_NODE} status writes per node.\n\n",
        args.max_concurrent, args.nodes, args.pods_per_node, args.pods_per_node, args.nodes, f.steps, f.replace_seconds, f.round_seconds
    ));
    out.push_str(&format!(
        "Command: `cargo xtask bench drain --nodes {} --pods-per-node {} --max-concurrent {}`; machine: {host_cpus} cores shared with etcd, the apiserver, kube-controller-manager, the scheduler and kwok.\n\n",
        args.nodes, args.pods_per_node, args.max_concurrent
    ));
    out.push_str("| figure | value | target |\n|---|---|---|\n");
    out.push_str(&format!(
        "| create → every node Drained | {:.1} s | |\n| create → first node / half the nodes Drained | {:.1} s / {:.1} s | |\n| lower bound ({} steps × {:.2} s) | {:.1} s | |\n| ratio | {:.2}× | ≤ {TARGET_RATIO}× |\n| pods on the maintained nodes at the start | {} | |\n| evictions accepted / refused (429) | {} / {} | |\n| controller reaction per step (budget allows → next eviction of that Deployment), median / p90 | {:.2} s / {:.2} s | |\n| controller requests | {} | |\n| requests per evicted pod | {:.2} | ≤ {TARGET_REQUESTS_PER_POD} |\n| status writes | {} ({:.2} per node) | ≤ {TARGET_STATUS_WRITES_PER_NODE} per node |\n| controller CPU during the drain | {:.1} s ({:.0}% of one core) | |\n| controller RSS at the end | {:.1} MiB | |\n| host load average (1 min) at start / end | {:.1} / {:.1} | |\n\n",
        f.seconds, f.first_drained, f.half_drained, f.steps, f.replace_seconds, bound, ratio, f.evicted, f.accepted, f.refused, f.reaction.0, f.reaction.1, f.requests, per_pod, f.status_writes, per_node,
        f.cpu_seconds, 100.0 * f.cpu_seconds / f.seconds.max(0.001), f.rss_mib, f.load.0, f.load.1
    ));
    out.push_str("Controller requests by verb and resource:\n\n| request | count |\n|---|---|\n");
    for (k, v) in &f.by_kind {
        out.push_str(&format!("| {k} | {v} |\n"));
    }
    out.push('\n');
    out
}
