//! The demo's six steps: a fresh control plane with nodekeeper installed from `deploy/` and the
//! demo's tuning, the controller acting as the ServiceAccount `deploy/` created (exposed through
//! the API server's service proxy when root), one agent process per simulated node and their
//! Nodes, the controller's view of them, and a network test across them — each started through
//! the rig of `nodekeeper_e2e::rig` and awaited with a deadline that also fails when a child
//! exits. What the controller knows is shown by `kubectl nodekeeper` where it
//! can reach the controller, else read from the controller's HTTP API directly.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use nodekeeper_api::crd::NetworkTest;
use nodekeeper_api::crd::network_test::Phase;
use nodekeeper_e2e::controlplane::{self, Lifetime, Options, nodes};
use nodekeeper_e2e::install;
use nodekeeper_e2e::rig::service_proxy::{CONTROLLER_POD, SERVICE_HOST_LABEL, expose_controller};
use nodekeeper_e2e::rig::{
    AGENT_SECRET, AgentSetup, AgentTls, ControllerConfig, ControllerProcess, Output, Program,
    http_get,
};
use nodekeeper_testkit::net::{free_port_on, port_free_on_all, port_is_free};
use serde::Deserialize as _;
use serde_json::Value;

use super::print::{print_conditions, print_network_test, print_nodes, print_pairs, print_summary};
use super::{
    Binaries, DEMO_SWEEP_INTERVAL, DemoArgs, FIELD_MANAGER, NAMESPACE, NETWORK_TEST_EXAMPLE,
    Running, step,
};

/// One simulated node: its name, address, and the agent's files.
struct SimNode {
    name: String,
    ip: Ipv4Addr,
    dir: PathBuf,
}

pub(super) async fn steps(args: &DemoArgs, bins: &Binaries, running: &mut Running) -> Result<()> {
    let timeout = Duration::from_secs(args.timeout);
    let cluster_name = args.name.as_str();

    // 2. The control plane.
    step(
        2,
        &format!(
            "Starting the local control plane `{cluster_name}` (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok)"
        ),
    );
    let state = controlplane::read_state(cluster_name).ok();
    if let Some(api) = state
        .iter()
        .flat_map(|s| &s.components)
        .find(|c| c.name == "kube-apiserver" && c.is_running())
    {
        bail!(
            "the `{cluster_name}` control plane is still running (kube-apiserver pid {}, left by `cargo xtask demo --keep`?): stop it with `cargo xtask cluster down --name {cluster_name}` and retry, or give this demo another --name",
            api.pid
        );
    }
    // A fresh cluster every time: no Nodes, Secrets or NetworkTests left from an earlier run.
    controlplane::down(cluster_name, true).context("remove the previous demo cluster's state")?;
    let lifetime = if args.keep {
        Lifetime::Detached
    } else {
        Lifetime::WithThisProcess
    };
    let t = Instant::now();
    let cluster = controlplane::up(&Options::new(cluster_name, lifetime), &mut |line| {
        println!("    {line}")
    })
    .await
    .context("start the local control plane")?;
    let kubeconfig = cluster.kubeconfig.clone();
    let apiserver = cluster.apiserver_url();
    let apiserver_port = cluster.state.ports.apiserver;
    let state_dir = cluster.state_dir.clone();
    running.cluster = Some(cluster);
    println!(
        "    control plane ready at {apiserver} in {:.1}s (logs in {})",
        t.elapsed().as_secs_f64(),
        state_dir.join("logs").display()
    );
    if args.keep {
        println!(
            "    --keep: it stays up after the demo; use it with `export KUBECONFIG={}`, stop it with `cargo xtask cluster down --name {cluster_name}`",
            kubeconfig.display()
        );
    }
    let client = controlplane::client_from_kubeconfig(&kubeconfig).await?;
    let crds = nodekeeper_e2e::install_crds(&client).await?;
    println!(
        "    `kubectl apply --server-side -f deploy/crds/`: {}",
        crds.join(", ")
    );
    let account = install_deploy(&client).await?;
    let mut tuning = read_example("tuning-configmap.yaml")?;
    tuning["metadata"]["namespace"] = NAMESPACE.into();
    tuning["data"]["sweepInterval"] = DEMO_SWEEP_INTERVAL.into();
    // The demo's agents repair a sysctl tree of their own, so repair is safe to turn on here;
    // the example leaves it off for the read-only /proc/sys of the default DaemonSet.
    tuning["data"]["features.repair"] = "true".into();
    let tuning_name = tuning["metadata"]["name"]
        .as_str()
        .context("deploy/examples/tuning-configmap.yaml has no metadata.name")?
        .to_owned();
    apply(
        &Api::<ConfigMap>::namespaced(client.clone(), NAMESPACE),
        &tuning_name,
        &tuning,
    )
    .await?;
    println!(
        "    ConfigMap {NAMESPACE}/{tuning_name} from deploy/examples/tuning-configmap.yaml (sweepInterval {DEMO_SWEEP_INTERVAL} instead of 5m, so the demo need not wait; features.repair on, as the agents' sysctls are their own files)"
    );

    // 3. The controller.
    let demo_dir = state_dir.join("nodekeeper");
    std::fs::create_dir_all(&demo_dir).with_context(|| format!("create {}", demo_dir.display()))?;
    let http = SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        free_port_on(Ipv4Addr::LOCALHOST).context("find a free port on 127.0.0.1")?,
    ));
    let sim: Vec<SimNode> = (0..args.nodes)
        .map(|i| SimNode {
            name: format!("sim-{i}"),
            ip: controlplane::simulated_node_ip(i),
            dir: demo_dir.join("agents").join(format!("sim-{i}")),
        })
        .collect();
    // The agents' port: 9443 (the default) when it is free on every node address.
    let ips: Vec<Ipv4Addr> = sim.iter().map(|n| n.ip).collect();
    let agent_port = port_free_on_all(&ips, 9443)
        .context("found no port free on every simulated node address (127.1.x.y)")?;
    // Their /metrics port: the DaemonSet's 9444 when free (another user's demo may hold it).
    let metrics_port = std::iter::once(AGENT_METRICS_PORT)
        .chain((0..20).filter_map(|_| free_port_on(ips[0]).ok()))
        .find(|p| *p != agent_port && ips.iter().all(|ip| port_is_free(*ip, *p)))
        .context("found no metrics port free on every simulated node address (127.1.x.y)")?;
    let controller_log = demo_dir.join("controller.log");
    step(3, "Starting nodekeeper-controller");
    let t = Instant::now();
    // The controller acts as the ServiceAccount deploy/ made, with a token from the
    // TokenRequest API (what its Pod's projected token is), so it has exactly deploy/'s RBAC.
    let controller_kubeconfig = demo_dir.join("controller.kubeconfig");
    install::service_account_kubeconfig(
        &client,
        &kubeconfig,
        NAMESPACE,
        &account,
        CONTROLLER_TOKEN_LIFETIME,
        &controller_kubeconfig,
    )
    .await?;
    // For `apiServer: true` targets (deploy/examples/networktest-apiserver.yaml).
    let mut env = vec![(
        "NODEKEEPER_API_SERVER_ADDRESS".to_owned(),
        format!("127.0.0.1:{apiserver_port}"),
    )];
    // The plugin reaches the controller only through the API server's service proxy, which
    // dials Pod addresses and never loopback ones: as root, a network namespace stands in for
    // the controller Pod's network, and the Service deploy/ installed selects that Pod once the
    // controller, given the Pod's name as in the Deployment, labels it leader.
    let plugin = if nix::unistd::geteuid().is_root() {
        let exposed = expose_controller(&client, NAMESPACE, http)
            .await
            .context("expose the controller through the service proxy")?;
        env.push(("NODEKEEPER_POD_NAME".into(), CONTROLLER_POD.into()));
        println!(
            "    Pod {NAMESPACE}/{CONTROLLER_POD} stands in for the Deployment's Pod: its address is a network namespace with a veth pair (10.254.x.y/30) that forwards to the controller, so Service {NAMESPACE}/nodekeeper-controller from deploy/ leads `kubectl nodekeeper` to it through the API server's service proxy, as in a cluster"
        );
        if !exposed.installed_service {
            bail!("Service {NAMESPACE}/nodekeeper-controller was not installed from deploy/");
        }
        running.exposed = Some(exposed);
        Some(Plugin {
            binary: bins.plugin.clone(),
            kubeconfig: kubeconfig.clone(),
        })
    } else {
        println!(
            "    not root: no network namespace for the service proxy to reach the controller through, so the demo reads the controller's HTTP API directly instead of running `kubectl nodekeeper`"
        );
        None
    };
    let config = ControllerConfig {
        kubeconfig: controller_kubeconfig.clone(),
        namespace: NAMESPACE.into(),
        identity: "demo-controller".into(),
        http,
        agent_port,
        // Not the node that holds the controller's stand-in Pod: it has no agent.
        node_selector: fleet_selector(),
        log: None,
        env,
        output: Output::Log(controller_log.clone()),
    };
    let controller = ControllerProcess::spawn(&Program::Binary(bins.controller.clone()), &config)?;
    println!(
        "    pid {}  as ServiceAccount {NAMESPACE}/{account} (kubeconfig {})  HTTP API http://{http}  agents on port {agent_port}  log {}",
        controller.pid(),
        controller_kubeconfig.display(),
        controller_log.display()
    );
    running.children.push(controller.process);
    wait_until(
        running,
        "the controller to lead (/readyz)",
        timeout,
        &controller_log,
        move || async move {
            Ok(matches!(http_get(http, "/readyz").await, Ok((200, body)) if body.contains("leader")))
        },
    )
    .await?;
    let client_ref = &client;
    let tls = wait_until_some(
        running,
        &format!("the controller to create Secret {NAMESPACE}/{AGENT_SECRET}"),
        timeout,
        &controller_log,
        move || AgentTls::get(client_ref, NAMESPACE),
    )
    .await?;
    let tls_dir = demo_dir.join("tls");
    tls.write_to(&tls_dir)?;
    println!(
        "    leading after {:.1}s; it created its CA and the agents' certificate (Secret {NAMESPACE}/{AGENT_SECRET}, copied to {})",
        t.elapsed().as_secs_f64(),
        tls_dir.display()
    );
    if plugin.is_some() {
        wait_until(
            running,
            &format!("Service {NAMESPACE}/nodekeeper-controller to select the leader's Pod (EndpointSlice)"),
            timeout,
            &controller_log,
            move || async move { service_has_endpoint(client_ref).await },
        )
        .await?;
        println!(
            "    Service {NAMESPACE}/nodekeeper-controller selects Pod {CONTROLLER_POD} (labelled nodekeeper.dev/leader=true by the controller)"
        );
    }

    // 4. The agents, then the Nodes they stand for: the controller finds every agent already
    // listening when it first sees the Node.
    step(
        4,
        &format!(
            "Starting {} nodekeeper-agent(s) and their simulated Nodes",
            sim.len()
        ),
    );
    println!(
        "    Each agent reads this machine's /proc; its sysctls are a small file tree of its own (so repairs touch no real setting), seeded to give the tuning rules something to find:"
    );
    for (i, node) in sim.iter().enumerate() {
        let (sysctls, note) = seed_sysctls(i);
        let listen = SocketAddr::from((node.ip, agent_port));
        let mut agent = AgentSetup::new(&node.name, listen, &tls_dir, &node.dir);
        // The agent finds no nvidia-smi on this machine by itself.
        agent.no_gpu = false;
        // /metrics on the node's address, as the DaemonSet sets it up.
        agent.metrics_listen = Some(SocketAddr::from((node.ip, metrics_port)));
        agent.create_dirs()?;
        for (key, value) in &sysctls {
            agent.write_sysctl(key, value)?;
        }
        let child = agent.spawn(&bins.agent, &node.dir.join("agent.log"))?;
        println!(
            "    {:<8} {listen:<18} pid {:<8} {note}",
            node.name,
            child.pid()
        );
        running.children.push(child);
    }
    for node in &sim {
        let addr = SocketAddr::from((node.ip, agent_port));
        let log = node.dir.join("agent.log");
        wait_until(
            running,
            &format!("the agent of {} to listen on {addr}", node.name),
            timeout,
            &log,
            move || async move { Ok(tokio::net::TcpStream::connect(addr).await.is_ok()) },
        )
        .await?;
    }
    println!(
        "    agents listening (mutual TLS; logs in {}/<node>/agent.log)",
        demo_dir.join("agents").display()
    );
    let names: Vec<String> = sim.iter().map(|n| n.name.clone()).collect();
    let ips: Vec<Ipv4Addr> = sim.iter().map(|n| n.ip).collect();
    let created = Instant::now();
    nodes::create(&client, &names, &ips, &BTreeMap::new()).await?;
    nodes::wait_ready(&client, &names, timeout).await?;
    println!(
        "    Nodes {} created (label {}=true) and Ready (kwok)",
        names.join(", "),
        nodes::SIMULATED_LABEL
    );

    // 5. The controller reads every agent and writes conditions.
    step(5, "Waiting for the controller to read every agent");
    let n = sim.len() as u64;
    let summary = wait_until_some(
        running,
        &format!("the controller to report all {n} nodes NodekeeperReachable=True with TunablesInBounds evaluated (/api/v1/summary)"),
        timeout,
        &controller_log,
        move || async move {
            let Ok((200, body)) = http_get(http, "/api/v1/summary").await else {
                return Ok(None);
            };
            let summary: Value = serde_json::from_str(&body)?;
            let count = |key: &str| summary["fleet"]["conditions"][key].as_u64().unwrap_or(0);
            let reachable = count("NodekeeperReachable=True");
            let tunables = count("TunablesInBounds=True") + count("TunablesInBounds=False");
            Ok((reachable == n && tunables == n).then_some(summary))
        },
    )
    .await?;
    println!(
        "    all {n} agents read, and their conditions written, within {:.1}s of their Nodes' creation",
        created.elapsed().as_secs_f64()
    );
    if let Some(plugin) = &plugin {
        plugin.run(&["status", "-o", "wide"]).await?;
        plugin.run(&["node", &sim[0].name]).await?;
    } else {
        print_summary(&summary, http);
        let mut details = Vec::new();
        for node in &sim {
            let (status, body) = http_get(http, &format!("/api/v1/nodes/{}", node.name)).await?;
            if status != 200 {
                bail!(
                    "GET http://{http}/api/v1/nodes/{} answered {status}: {}",
                    node.name,
                    body.trim()
                );
            }
            details.push(serde_json::from_str::<Value>(&body)?);
        }
        print_nodes(&details, http);
    }
    let simulated = Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{}=true", nodes::SIMULATED_LABEL)))
        .await
        .context("list the simulated Nodes")?;
    print_conditions(&simulated.items);

    // 6. A network test across the fleet.
    let test_name = match &plugin {
        Some(plugin) => {
            step(
                6,
                "Running `kubectl nodekeeper netcheck` across the simulated fleet (the spec of deploy/examples/networktest-mesh.yaml)",
            );
            let selector = fleet_selector();
            // The example's spec: ICMP, three peers per node, three probes each, 1 s timeout.
            // Exit status 1 (a pair failed) is a result to show, not a failure of the demo.
            plugin
                .run(&[
                    "netcheck",
                    "-l",
                    &selector,
                    "--name",
                    MESH,
                    "--keep",
                    "--count",
                    "3",
                    "--probe-timeout",
                    "1s",
                    "peers:3",
                ])
                .await?;
            MESH.to_owned()
        }
        None => network_test_from_example(&client, running, timeout, &controller_log).await?,
    };
    let path = format!("/api/networktests/{NAMESPACE}/{test_name}");
    match http_get(http, &path).await {
        Ok((200, body)) => print_pairs(&serde_json::from_str(&body)?),
        Ok((status, body)) => println!("    GET {path}: {status} {}", body.trim()),
        Err(error) => println!("    GET {path}: {error:#}"),
    }
    println!(
        "    Status is what etcd holds (bounded); every pair's result is served by the controller:"
    );
    println!("      curl http://{http}{path}");
    println!(
        "    (in a cluster: kubectl get --raw /api/v1/namespaces/nodekeeper/services/nodekeeper-controller:http/proxy{path})"
    );

    if args.keep || args.wait {
        let kubectl = controlplane::binaries::ensure(&mut |_| {})
            .map(|b| b.path("kubectl"))
            .unwrap_or_else(|_| PathBuf::from("kubectl"));
        println!();
        println!("==> Explore");
        println!("    export KUBECONFIG={}", kubeconfig.display());
        println!(
            "    {} get nodes -o wide; {} get networktests -n {NAMESPACE}",
            kubectl.display(),
            kubectl.display()
        );
        if args.keep {
            println!(
                "    stop the control plane: cargo xtask cluster down --name {}",
                args.name
            );
        }
    }
    if args.wait {
        println!(
            "    controller: curl http://{http}/api/v1/summary  (/api/v1/nodes/<name>, /metrics)"
        );
        if let Some(node) = sim.first() {
            println!(
                "    agents:     curl http://{}:{metrics_port}/metrics  (each node's address)",
                node.ip
            );
        }
        println!("    press Ctrl-C to stop the agents and the controller");
        // Ctrl-C is how this mode ends, so it is a success here.
        let mut interrupted = std::pin::pin!(tokio::signal::ctrl_c());
        loop {
            tokio::select! {
                _ = &mut interrupted => break,
                () = tokio::time::sleep(Duration::from_secs(1)) => running.check_alive()?,
            }
        }
    }
    Ok(())
}

/// How long the controller's ServiceAccount token lasts: longer than a `--wait` demo is likely to
/// be explored (a Pod's projected token is renewed by the kubelet; here nothing renews it).
const CONTROLLER_TOKEN_LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// `kubectl apply -k deploy/` as the admin, printing each object and the file it comes from.
/// One change, said on screen: the controller Deployment gets 0 replicas, as kwok's Pods would
/// run nothing (the controller runs as a process of the demo instead, as the Deployment's
/// ServiceAccount). Returns that ServiceAccount's name.
async fn install_deploy(client: &kube::Client) -> Result<String> {
    let repo = install::repo();
    let deploy = repo.join("deploy");
    let mut objects = install::kustomize(&deploy)?;
    let origins = install::origins(&deploy, &repo)?;
    let mut account = None;
    for object in &mut objects {
        if object["kind"] == "Deployment" && object["metadata"]["name"] == "nodekeeper-controller" {
            if object["metadata"]["namespace"] != NAMESPACE {
                bail!(
                    "deploy/ installs the controller into namespace {}, the demo expects {NAMESPACE}",
                    object["metadata"]["namespace"]
                );
            }
            account = object["spec"]["template"]["spec"]["serviceAccountName"]
                .as_str()
                .map(str::to_owned);
            object["spec"]["replicas"] = 0.into();
        }
    }
    let account = account
        .context("deploy/ has no Deployment nodekeeper-controller with a serviceAccountName")?;
    install::apply_all(client, &objects, FIELD_MANAGER).await?;
    println!(
        "    `kubectl apply -k deploy/` ({} objects, rendered by the control plane's kubectl):",
        objects.len()
    );
    for object in &objects {
        let kind = object["kind"].as_str().unwrap_or("?");
        let name = object["metadata"]["name"].as_str().unwrap_or("?");
        let shown = match object["metadata"]["namespace"].as_str() {
            Some(ns) => format!("{kind} {ns}/{name}"),
            None => format!("{kind} {name}"),
        };
        let from = origins
            .get(&install::key(object))
            .map_or_else(|| "kustomize".to_owned(), |p| p.display().to_string());
        let note = match kind {
            "Deployment" => {
                "  (replicas 0 here: kwok runs no containers; the controller runs as a process below, as this ServiceAccount)"
            }
            "DaemonSet" => {
                "  (kwok shows one of its Pods Running on each simulated node but runs nothing; the agent processes of step 4 stand in)"
            }
            _ => "",
        };
        println!("      {shown:<58} from {from}{note}");
    }
    Ok(account)
}

/// Whether Service nodekeeper-controller's EndpointSlices hold a ready address.
async fn service_has_endpoint(client: &kube::Client) -> Result<bool> {
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels("kubernetes.io/service-name=nodekeeper-controller"))
        .await
        .context("list the controller Service's EndpointSlices")?;
    Ok(slices
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false)))
}

/// Step 6 without the plugin: applies `deploy/examples/networktest-mesh.yaml`, waits for it and
/// prints its status; returns its name.
async fn network_test_from_example(
    client: &kube::Client,
    running: &mut Running,
    timeout: Duration,
    controller_log: &Path,
) -> Result<String> {
    step(
        6,
        &format!(
            "Running NetworkTest {NAMESPACE}/mesh (deploy/examples/{NETWORK_TEST_EXAMPLE}) across the simulated fleet"
        ),
    );
    let mut test = read_example(NETWORK_TEST_EXAMPLE)?;
    test["metadata"]["namespace"] = NAMESPACE.into();
    let test_name = test["metadata"]["name"]
        .as_str()
        .with_context(|| format!("deploy/examples/{NETWORK_TEST_EXAMPLE} has no metadata.name"))?
        .to_owned();
    let tests: Api<NetworkTest> = Api::namespaced(client.clone(), NAMESPACE);
    apply(&tests, &test_name, &test).await?;
    let (tests, test_name) = (&tests, test_name.as_str());
    println!(
        "    applied: kind {}, targets {}",
        test["spec"]["kind"].as_str().unwrap_or("?"),
        test["spec"]["targets"]
    );
    let t = Instant::now();
    // A controller running the NetworkTest reconciler writes `Running` within seconds; without
    // one the test would wait out the whole timeout for nothing.
    wait_until(
        running,
        &format!("the controller to pick up NetworkTest {NAMESPACE}/{test_name} (any status.phase)"),
        timeout.min(Duration::from_secs(20)),
        controller_log,
        move || async move {
            let test = tests.get(test_name).await?;
            Ok(test.status.as_ref().and_then(|s| s.phase).is_some())
        },
    )
    .await
    .context(
        "the controller did not pick up the NetworkTest (does this build of nodekeeper-controller run the NetworkTest reconciler? `grep -n networktest crates/controller/src/controllers/mod.rs`)",
    )?;
    let done = wait_until_some(
        running,
        &format!(
            "NetworkTest {NAMESPACE}/{test_name} to finish (status.phase Succeeded or Failed)"
        ),
        timeout,
        controller_log,
        move || async move {
            let test = tests.get(test_name).await?;
            let finished = test
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .is_some_and(|p| matches!(p, Phase::Succeeded | Phase::Failed));
            Ok(finished.then_some(test))
        },
    )
    .await?;
    println!("    finished in {:.1}s", t.elapsed().as_secs_f64());
    print_network_test(&done);
    Ok(test_name.to_owned())
}

/// The demo's fleet: the simulated nodes, less the one holding the controller's stand-in Pod.
fn fleet_selector() -> String {
    format!("{}=true,!{SERVICE_HOST_LABEL}", nodes::SIMULATED_LABEL)
}

/// The agents' `/metrics` port, the one `deploy/agent/daemonset.yaml` sets, when it is free.
const AGENT_METRICS_PORT: u16 = 9444;
/// The NetworkTest the plugin runs: named as the example's.
const MESH: &str = "mesh";

/// The built `kubectl nodekeeper`, pointed at the demo's cluster.
struct Plugin {
    binary: PathBuf,
    kubeconfig: PathBuf,
}

impl Plugin {
    /// Runs `kubectl nodekeeper args…` with the demo's terminal as its own (colour and progress
    /// when it is one), after printing the command; returns its exit code.
    async fn run(&self, args: &[&str]) -> Result<i32> {
        println!();
        println!("    $ kubectl nodekeeper {}", args.join(" "));
        let status = tokio::process::Command::new(&self.binary)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["-n", NAMESPACE])
            .args(args)
            .env_remove("KUBECONFIG")
            .stdin(std::process::Stdio::null())
            .status()
            .await
            .with_context(|| format!("run {}", self.binary.display()))?;
        let code = status.code().unwrap_or(-1);
        if code != 0 {
            println!("    (exit status {code})");
        }
        println!();
        if code == 2 || code < 0 {
            bail!(
                "kubectl nodekeeper {} failed (exit status {code})",
                args.join(" ")
            );
        }
        Ok(code)
    }
}

/// The sysctls of simulated node `i` and what is notable about them: node 0's
/// `net.core.somaxconn` is below the example's rule (which allows repair), node 1's
/// `net.ipv4.ip_forward` is off (a critical rule, no repair), node 2's `vm.swappiness` is above
/// its bound (a warning); every other value is within the example's rules.
fn seed_sysctls(i: usize) -> (Vec<(&'static str, &'static str)>, &'static str) {
    let mut sysctls = vec![
        ("net.core.somaxconn", "4096"),
        ("net.ipv4.ip_forward", "1"),
        ("vm.swappiness", "10"),
    ];
    let note = match i {
        0 => {
            sysctls[0].1 = "128";
            "net.core.somaxconn=128 (rule: >= 4096, repair allowed)"
        }
        1 => {
            sysctls[1].1 = "0";
            "net.ipv4.ip_forward=0 (rule: = 1, critical, no repair)"
        }
        2 => {
            sysctls[2].1 = "60";
            "vm.swappiness=60 (rule: <= 10, warning)"
        }
        _ => "all within the rules",
    };
    (sysctls, note)
}

/// Polls `check` every 250 ms until it says true, failing after `timeout` or when a child
/// exits; the error names what was awaited and the log to read.
async fn wait_until<F, Fut>(
    running: &mut Running,
    what: &str,
    timeout: Duration,
    log: &Path,
    mut check: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    wait_until_some(running, what, timeout, log, || {
        let fut = check();
        async move { Ok(fut.await?.then_some(())) }
    })
    .await
}

async fn wait_until_some<T, F, Fut>(
    running: &mut Running,
    what: &str,
    timeout: Duration,
    log: &Path,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last_error = None;
    loop {
        running.check_alive()?;
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last_error = Some(format!("{error:#}")),
        }
        if Instant::now() > deadline {
            let last = last_error
                .map(|e| format!(" (last error: {e})"))
                .unwrap_or_default();
            bail!(
                "timed out after {}s waiting for {what}{last}; see {}",
                timeout.as_secs(),
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Server-side applies `object` as the demo's field manager.
async fn apply<K>(api: &Api<K>, name: &str, object: &Value) -> Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
    .with_context(|| {
        format!(
            "apply {} {name}",
            object["kind"].as_str().unwrap_or("object")
        )
    })
}

/// The single document of `deploy/examples/<file>`.
fn read_example(file: &str) -> Result<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("examples")
        .join(file);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let mut documents = serde_yaml::Deserializer::from_str(&text)
        .map(Value::deserialize)
        .filter(|d| !matches!(d, Ok(Value::Null)));
    let first = documents
        .next()
        .with_context(|| format!("{} holds no object", path.display()))?
        .with_context(|| format!("parse {}", path.display()))?;
    if documents.next().is_some() {
        bail!(
            "{} holds more than one object; the demo expects one",
            path.display()
        );
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_examples_the_demo_edits_have_the_fields_it_sets() {
        let tuning = read_example("tuning-configmap.yaml").unwrap();
        assert_eq!(tuning["kind"], "ConfigMap");
        assert!(
            tuning["data"]["sweepInterval"].is_string(),
            "the demo shortens data.sweepInterval; the example must name it"
        );
        assert!(tuning["metadata"]["name"].is_string());
        let mesh = read_example(NETWORK_TEST_EXAMPLE).unwrap();
        assert_eq!(mesh["kind"], "NetworkTest");
        assert!(mesh["metadata"]["name"].is_string());
    }

    #[test]
    fn only_the_first_three_nodes_are_seeded_out_of_bounds() {
        let values = |i| seed_sysctls(i).0;
        assert_eq!(values(0)[0], ("net.core.somaxconn", "128"));
        assert_eq!(values(1)[1], ("net.ipv4.ip_forward", "0"));
        assert_eq!(values(2)[2], ("vm.swappiness", "60"));
        assert_eq!(
            values(3),
            vec![
                ("net.core.somaxconn", "4096"),
                ("net.ipv4.ip_forward", "1"),
                ("vm.swappiness", "10")
            ]
        );
    }
}
