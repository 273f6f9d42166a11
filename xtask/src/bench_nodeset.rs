//! `cargo xtask bench nodeset`: a kwok `NodeSet` scaled 0 → N and N → 0 (every node drained
//! through a `NodeMaintenance` first) by the release controller under its own ServiceAccount, on
//! a private control plane with audit logging. Reports the time to N Ready and to 0, the
//! controller's API writes per node, the provider calls per node (the kwok provider's calls are
//! the controller's Node creates and deletes, counted in the audit log), and the controller's
//! RSS. Writes its section (`## nodeset`) in BENCHMARKS.md.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use nodekeeper_api::crd::NodeSet;
use nodekeeper_e2e::controlplane::{Lifetime, Options};
use nodekeeper_e2e::rig::{ControllerConfig, ControllerProcess, Output, Program};
use nodekeeper_e2e::{ControlPlane, wait_for};
use serde_json::json;

use crate::fleet_rig::{
    CONTROLLER_USER, NAMESPACE, audit_counts, audit_end, controller_kubeconfig, proc_usage,
};

/// `cargo xtask bench nodeset` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct NodesetArgs {
    /// Replicas to scale to (and back to 0).
    #[arg(long, default_value_t = 1000)]
    pub nodes: u32,
    /// Do not write BENCHMARKS.md.
    #[arg(long)]
    pub no_write: bool,
}

const TARGET_UP_SECONDS: f64 = 60.0;
const TARGET_WRITES_PER_CREATED_NODE: f64 = 4.0;
const SET: &str = "bench";

/// What the NodeSet controller needs beyond the release RBAC in deploy/controller (which does
/// not have it yet): applied by the bench only, bound to the same ServiceAccount.
fn nodeset_rbac() -> [serde_json::Value; 2] {
    [
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "nodekeeper-bench-nodeset"},
            "rules": [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["create", "delete", "get", "list", "watch"]},
                {"apiGroups": ["nodekeeper.dev"], "resources": ["nodesets", "nodeclasses"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["nodekeeper.dev"], "resources": ["nodesets/status"], "verbs": ["patch"]},
                {"apiGroups": ["nodekeeper.dev"], "resources": ["nodemaintenances"], "verbs": ["create", "delete", "get", "list", "watch"]},
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "nodekeeper-bench-nodeset"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "nodekeeper-bench-nodeset"},
            "subjects": [{"kind": "ServiceAccount", "name": "nodekeeper-controller", "namespace": NAMESPACE}],
        }),
    ]
}

pub fn run(args: NodesetArgs) -> anyhow::Result<()> {
    let root = crate::codegen::repo_root();
    let controller = crate::fleet_rig::build_controller(&root, false)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(bench(args, root, controller))
}

/// One direction's figures.
#[derive(Default)]
struct Leg {
    seconds: f64,
    by_kind: BTreeMap<String, u64>,
}

impl Leg {
    fn writes(&self) -> u64 {
        self.by_kind
            .iter()
            .filter(|(k, _)| {
                ["create ", "patch ", "update ", "delete "]
                    .iter()
                    .any(|v| k.starts_with(v))
            })
            .map(|(_, v)| v)
            .sum()
    }
    fn get(&self, key: &str) -> u64 {
        self.by_kind.get(key).copied().unwrap_or(0)
    }
}

fn controller_requests(
    audit: &std::path::Path,
    from: u64,
) -> anyhow::Result<(BTreeMap<String, u64>, u64)> {
    let (counts, n, _) = audit_counts(audit, from)?;
    let mut by_kind = BTreeMap::new();
    for ((user, verb, resource), c) in counts {
        if user == CONTROLLER_USER {
            *by_kind.entry(format!("{verb} {resource}")).or_default() += c;
        }
    }
    Ok((by_kind, n))
}

async fn bench(args: NodesetArgs, root: PathBuf, controller: PathBuf) -> anyhow::Result<()> {
    let say = |text: String| eprintln!("[bench nodeset] {text}");
    let n = args.nodes;
    let mut options = Options::new(
        format!("bench-nodeset-{}", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    options.max_requests_inflight = Some(2000);
    options.max_mutating_requests_inflight = Some(1000);
    options.node_lease_seconds = Some(crate::fleet_rig::node_lease_seconds(n as usize));
    say("starting a private control plane (audit on)".into());
    let cp = ControlPlane::start(options)?;
    let client = cp.client().await?;
    let audit = cp.audit_log().context("audit log")?;
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?,
        )
        .await?;
    wait_for("default ServiceAccount", Duration::from_secs(60), || {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
        async move { Ok(sas.get_opt("default").await?.map(|_| ())) }
    })
    .await?;
    nodekeeper_e2e::install_crds(&client).await?;
    let kubeconfig = cp.kubeconfig().with_file_name("controller-kubeconfig.yaml");
    controller_kubeconfig(&client, &root, cp.kubeconfig(), &kubeconfig).await?;
    for object in nodeset_rbac() {
        let obj: kube::api::DynamicObject = serde_json::from_value(object.clone())?;
        let gvk = kube::api::GroupVersionKind::try_from(obj.types.as_ref().context("no types")?)?;
        let (ar, _) = kube::discovery::pinned_kind(&client, &gvk).await?;
        Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar)
            .patch(
                obj.metadata.name.as_deref().unwrap_or_default(),
                &PatchParams::apply("nodekeeper-bench").force(),
                &Patch::Apply(&object),
            )
            .await?;
    }
    // Every drain at once: the nodes are empty, so the drains are the controller's own work.
    Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE)
        .patch(
            "nodekeeper-tuning",
            &PatchParams::apply("nodekeeper-bench").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "nodekeeper-tuning"},
                "data": {"maintenance.maxConcurrentNodes": n.max(1).to_string()}})),
        )
        .await?;
    let dynamic = |kind: &str, name: &str, spec: serde_json::Value| {
        json!({"apiVersion": "nodekeeper.dev/v1alpha1", "kind": kind,
               "metadata": {"name": name}, "spec": spec})
    };
    let classes: Api<nodekeeper_api::crd::NodeClass> = Api::all(client.clone());
    classes
        .patch(
            "bench",
            &PatchParams::apply("nodekeeper-bench").force(),
            &Patch::Apply(dynamic(
                "NodeClass",
                "bench",
                json!({"provider": "kwok", "kwok": {"capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"}}}),
            )),
        )
        .await?;
    let sets: Api<NodeSet> = Api::all(client.clone());
    sets.patch(
        SET,
        &PatchParams::apply("nodekeeper-bench").force(),
        &Patch::Apply(dynamic(
            "NodeSet",
            SET,
            json!({"nodeClassName": "bench", "replicas": 0, "scaleDown": {"drainTimeout": "10m"}}),
        )),
    )
    .await?;

    let process = ControllerProcess::spawn(
        &Program::Binary(controller),
        &ControllerConfig {
            kubeconfig,
            namespace: NAMESPACE.into(),
            identity: "bench-controller".into(),
            http: "127.0.0.1:18082".parse()?,
            agent_port: 9443,
            node_selector: "nodekeeper.dev/no-such-label=none".into(),
            log: Some("warn".into()),
            env: vec![(
                "NODEKEEPER_NODESET_MAX_REPLICAS".into(),
                n.max(1000).to_string(),
            )],
            output: Output::Stderr,
        },
    )?;
    let pid = process.pid();
    wait_for("the set's first status", Duration::from_secs(120), || {
        let sets = sets.clone();
        async move {
            let s = sets.get(SET).await?;
            Ok(s.status.and_then(|st| st.observed_generation).map(|_| ()))
        }
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mark = audit_end(&audit)?;

    let scale = |replicas: u32| {
        let sets = sets.clone();
        async move {
            sets.patch_scale(
                SET,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": replicas}})),
            )
            .await
        }
    };
    let wait_at = |target: u32, limit: Duration| {
        let sets = sets.clone();
        async move {
            let started = Instant::now();
            loop {
                let st = sets.get(SET).await?.status.unwrap_or_default();
                if st.replicas == target && st.ready_replicas == target && st.draining_replicas == 0
                {
                    return Ok::<f64, anyhow::Error>(started.elapsed().as_secs_f64());
                }
                if started.elapsed() > limit {
                    bail!("nodeset {SET} not at {target} within {limit:?}: {st:?}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };

    say(format!("scaling 0 → {n}"));
    let started = Instant::now();
    scale(n).await?;
    wait_at(n, Duration::from_secs(900)).await?;
    let up_seconds = started.elapsed().as_secs_f64();
    let (rss_up, _, _) = proc_usage(pid)?;
    say(format!("{n} Ready in {up_seconds:.1} s"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (up_kinds, mark2) = controller_requests(&audit, mark)?;
    let up = Leg {
        seconds: up_seconds,
        by_kind: up_kinds,
    };

    say(format!("scaling {n} → 0 (each node drained first)"));
    let started = Instant::now();
    scale(0).await?;
    wait_at(0, Duration::from_secs(1800)).await?;
    let down_seconds = started.elapsed().as_secs_f64();
    say(format!("0 nodes in {down_seconds:.1} s"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (down_kinds, _) = controller_requests(&audit, mark2)?;
    let (_, peak, cpu) = proc_usage(pid)?;
    let down = Leg {
        seconds: down_seconds,
        by_kind: down_kinds,
    };
    drop(process);
    drop(cp);

    let report = render(&args, &up, &down, rss_up, peak, cpu);
    println!("{report}");
    if !args.no_write {
        crate::benchmarks::write_section(&root, "nodeset", &report)?;
    }
    Ok(())
}

fn render(args: &NodesetArgs, up: &Leg, down: &Leg, rss_up: u64, peak: u64, cpu: f64) -> String {
    let n = f64::from(args.nodes.max(1));
    let host_cpus = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(0);
    let mut out = String::from("## nodeset\n\n");
    out.push_str(&format!(
        "A kwok `NodeSet` scaled 0 → {} (until `status.readyReplicas` is {}) and back to 0 (until no node is left; every node is drained through its own `NodeMaintenance` first, the nodes are empty), by the release controller under its own ServiceAccount (the release RBAC plus the NodeSet rules the bench adds), on a private control plane with audit logging; `maintenance.maxConcurrentNodes` {}. Writes are the controller's create/patch/update/delete requests in the audit log, by both of its controllers (NodeSet and NodeMaintenance) and its Events; provider calls are its Node creates and deletes (what the kwok provider does). Targets: 0 → {} Ready in ≤ {TARGET_UP_SECONDS} s, ≤ {TARGET_WRITES_PER_CREATED_NODE} API writes per created node.\n\n",
        args.nodes, args.nodes, args.nodes, args.nodes
    ));
    out.push_str(&format!(
        "Command: `cargo xtask bench nodeset --nodes {}`; machine: {host_cpus} cores shared with etcd, the apiserver, kube-controller-manager, the scheduler and kwok.\n\n",
        args.nodes
    ));
    out.push_str("| figure | value | target |\n|---|---|---|\n");
    out.push_str(&format!(
        "| 0 → {} Ready | {:.1} s | ≤ {TARGET_UP_SECONDS} s |\n| API writes per created node | {:.2} | ≤ {TARGET_WRITES_PER_CREATED_NODE} |\n| provider calls per created node | {:.2} | |\n| {} → 0 (drained, deleted) | {:.1} s | |\n| API writes per removed node | {:.2} | |\n| provider calls per removed node | {:.2} | |\n| controller RSS at {} nodes / peak | {:.1} / {:.1} MiB | |\n| controller CPU, whole run | {:.1} s | |\n\n",
        args.nodes,
        up.seconds,
        up.writes() as f64 / n,
        (up.get("create nodes") + up.get("delete nodes")) as f64 / n,
        args.nodes,
        down.seconds,
        down.writes() as f64 / n,
        (down.get("create nodes") + down.get("delete nodes")) as f64 / n,
        args.nodes,
        rss_up as f64 / 1024.0,
        peak as f64 / 1024.0,
        cpu
    ));
    for (title, leg) in [("0 → N", up), ("N → 0", down)] {
        out.push_str(&format!(
            "Controller requests, {title}:\n\n| request | count |\n|---|---|\n"
        ));
        for (k, v) in &leg.by_kind {
            out.push_str(&format!("| {k} | {v} |\n"));
        }
        out.push('\n');
    }
    out
}
