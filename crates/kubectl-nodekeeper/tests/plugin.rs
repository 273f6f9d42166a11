//! `kubectl nodekeeper` driven as a user drives it: the built binary, a separate process with a
//! real kubeconfig, against the harness's real kube-apiserver; a real controller process (this
//! test binary re-executed) with real agents on 127.x.y.z; and the API server's real service
//! proxy in between.
//!
//! The service proxy only dials addresses that belong to a Pod and refuses loopback ones, so the
//! controller is exposed the way a cluster does it, within the test's own network namespace
//! (`nodekeeper_e2e::rig::service_proxy`, which the demo uses too). No traffic leaves
//! 127.0.0.0/8 or that namespace. The maintain and diag verbs run against the same controller:
//! it acts on every NodeMaintenance in the cluster, so no other test of this binary starts one.
//!
//! Run: `cargo xtask test -- -p kubectl-nodekeeper --test plugin` (as root: network namespaces
//! and the agents' ICMP sockets; otherwise the controller tests print SKIPPED).

// A skipped test prints `SKIPPED: <reason>`: that line is the contract with CI.
#![allow(clippy::print_stdout)]

// The controller/agent rig of the e2e tests, used as it is.
#[path = "../../../tests/tests/controller_common/mod.rs"]
mod controller_common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use controller_common::*;
use k8s_openapi::api::core::v1::{Node, Pod, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use nodekeeper_api::crd::node_maintenance::Stage;
use nodekeeper_api::crd::{NetworkTest, NodeDiagnostic, NodeMaintenance};
use nodekeeper_e2e::rig::service_proxy::expose_controller;
use nodekeeper_e2e::{
    ControlPlane, create_simulated_nodes, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::json;
use sha2::{Digest as _, Sha256};

const PLUGIN: &str = env!("CARGO_BIN_EXE_kubectl-nodekeeper");
const TIMEOUT: Duration = Duration::from_secs(90);

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// One run of the plugin.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The one error line, checked to be exactly one line, with exit status 2.
    fn error_line(&self) -> &str {
        assert_eq!(self.code, 2, "exit status 2 with an error: {self:?}");
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr: {self:?}");
        assert!(lines[0].starts_with("error: "), "{self:?}");
        lines[0]
    }
}

/// Runs the plugin with `--kubeconfig kubeconfig -n namespace args…`, piped (not a terminal).
async fn plugin(kubeconfig: &Path, namespace: &str, args: &[&str]) -> anyhow::Result<Run> {
    let child = tokio::process::Command::new(PLUGIN)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", namespace])
        .args(args)
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("start kubectl-nodekeeper")?;
    let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .context("kubectl-nodekeeper did not finish in 180s")??;
    let run = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout)?,
        stderr: String::from_utf8(out.stderr)?,
    };
    println!(
        "$ kubectl nodekeeper {} -> {}\n{}{}",
        args.join(" "),
        run.code,
        run.stdout,
        run.stderr
    );
    Ok(run)
}

/// The value after `label:` in the plugin's key/value block.
fn field<'a>(text: &'a str, label: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{label}:")))
        .map(str::trim)
}

/// The labels of the key/value block (the lines before the first blank one) and the section
/// titles (the lines after a blank one): what the golden files fix, whatever the values.
fn skeleton(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_block = true;
    let mut after_blank = false;
    for line in text.lines() {
        if line.is_empty() {
            in_block = false;
        } else if in_block {
            out.push(
                line.split_once(':')
                    .map_or(line, |(label, _)| label)
                    .to_owned(),
            );
        } else if after_blank {
            out.push(line.to_owned());
        }
        after_blank = line.is_empty();
    }
    out
}

fn golden(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/{name}.txt")),
    )
    .expect("golden file")
}

/// Runs the plugin under script(1), which gives it a pseudo-terminal: (exit code, transcript).
async fn on_a_terminal(
    kubeconfig: &Path,
    namespace: &str,
    args: &str,
) -> anyhow::Result<(Option<i32>, String)> {
    let line = format!(
        "{PLUGIN} --kubeconfig {} -n {namespace} {args}",
        kubeconfig.display()
    );
    let tty = tokio::process::Command::new("script")
        .args(["-qefc", &line, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .await
        .context("run script(1)")?;
    Ok((
        tty.status.code(),
        String::from_utf8_lossy(&tty.stdout).into_owned(),
    ))
}

/// What Ctrl-C sends: SIGINT to the plugin process this test started.
fn ctrl_c(child: &std::process::Child) -> anyhow::Result<()> {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id())?),
        nix::sys::signal::Signal::SIGINT,
    )?;
    Ok(())
}

/// NetworkTests this plugin created in `namespace`.
async fn created_tests(client: &kube::Client, namespace: &str) -> anyhow::Result<Vec<String>> {
    let api: Api<NetworkTest> = Api::namespaced(client.clone(), namespace);
    let list = api
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=kubectl-nodekeeper"))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|t| t.metadata.name)
        .collect())
}

/// NodeMaintenances this plugin created (cluster-wide) and not finished (stage not Complete).
async fn created_maintenances(client: &kube::Client) -> anyhow::Result<Vec<NodeMaintenance>> {
    let api: Api<NodeMaintenance> = Api::all(client.clone());
    let list = api
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=kubectl-nodekeeper"))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|nm| nm.spec.stage != Stage::Complete && nm.metadata.deletion_timestamp.is_none())
        .collect())
}

/// NodeDiagnostics this plugin created in `namespace`.
async fn created_diagnostics(
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<Vec<String>> {
    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), namespace);
    let list = api
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=kubectl-nodekeeper"))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|d| d.metadata.deletion_timestamp.is_none())
        .filter_map(|d| d.metadata.name)
        .collect())
}

/// Agent flags that keep the diagnostics parts on files of this test: a kernel log and a host
/// root of its own, and no journal (this machine's is not the simulated node's).
fn diagnostics_flags(root: &Path) -> anyhow::Result<Vec<String>> {
    let kmsg = root.join("kmsg");
    std::fs::write(&kmsg, "6,1,1000000,-;eth0: link becomes ready\n")?;
    std::fs::create_dir_all(root.join("host"))?;
    Ok(vec![
        format!("--diagnostics-kmsg={}", kmsg.display()),
        format!("--host-root={}", root.join("host").display()),
        "--diagnostics-journalctl=/nonexistent/journalctl".into(),
    ])
}

fn unschedulable(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// `maintain`, `maintain complete` and `maintain watch` against the real NodeMaintenance
/// controller, with a Deployment's pod behind a PodDisruptionBudget that blocks the drain.
async fn maintain_verbs(
    client: &kube::Client,
    kubeconfig: &Path,
    ns: &str,
    nodes: &[String],
) -> anyhow::Result<()> {
    let node_api: Api<Node> = Api::all(client.clone());
    let nms: Api<NodeMaintenance> = Api::all(client.clone());

    // An unknown node: one line, exit 2, nothing created.
    let run = plugin(
        kubeconfig,
        ns,
        &["maintain", "no-such-node-here", "--drain"],
    )
    .await?;
    assert!(
        run.error_line()
            .contains("node \"no-such-node-here\" not found"),
        "{run:?}"
    );
    assert!(
        created_maintenances(client).await?.is_empty(),
        "nothing created"
    );
    // Bad flags: refused before anything is sent.
    let run = plugin(
        kubeconfig,
        ns,
        &["maintain", &nodes[0], "--timeout", "200h"],
    )
    .await?;
    assert!(
        run.error_line()
            .contains("(--timeout): must be at most 168h"),
        "{run:?}"
    );

    // One pod on node 0, behind a budget that allows no disruption.
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), ns);
    deployments.create(&PostParams::default(), &serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"nodeSelector": {"kubernetes.io/hostname": nodes[0]},
                                       "terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "c", "image": "registry.invalid/nothing:1"}]}}},
    }))?).await?;
    let pdbs: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(client.clone(), ns);
    let pdb = json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "maxUnavailable": 0},
    });
    pdbs.create(
        &PostParams::default(),
        &serde_json::from_value(pdb.clone())?,
    )
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    wait_for("the web pod to run on node 0", TIMEOUT, || async {
        let list = pods.list(&ListParams::default().labels("app=web")).await?;
        Ok(list
            .items
            .iter()
            .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .then_some(()))
    })
    .await?;

    // Drain, blocked by the budget: the progress names the pod and the budget; Ctrl-C leaves
    // the maintenance as it is and says how to resume.
    let child = Command::new(PLUGIN)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args([
            "-n",
            ns,
            "maintain",
            &nodes[0],
            "--drain",
            "--reason",
            "kernel update",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let nm = wait_for(
        "the drain to be blocked by PodDisruptionBudget web",
        TIMEOUT,
        || async {
            let found = created_maintenances(client).await?;
            Ok(found.into_iter().find(|nm| {
                nm.status.as_ref().is_some_and(|s| {
                    s.nodes.iter().any(|n| {
                        n.blocking_pods
                            .iter()
                            .any(|p| p.pdb.as_deref() == Some("web"))
                    })
                })
            }))
        },
    )
    .await?;
    let name = nm.metadata.name.clone().context("name")?;
    // Two polls of the plugin, on a loaded machine.
    tokio::time::sleep(Duration::from_secs(3)).await;
    ctrl_c(&child)?;
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
    let stderr = String::from_utf8(out.stderr)?;
    println!("maintain, interrupted:\n{stderr}");
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.lines().any(|l| l.starts_with(&format!(
            "{}: Draining, 1 pod left; blocked by {ns}/web-",
            nodes[0]
        )) && l.ends_with("(PodDisruptionBudget web)")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "interrupted; nodemaintenance {name} is left as it is (stage Drain): follow it again with `kubectl nodekeeper maintain watch --name {name}`"
        )),
        "{stderr}"
    );
    assert_eq!(
        nms.get(&name).await?.spec.stage,
        Stage::Drain,
        "left as it was"
    );
    assert!(
        unschedulable(&node_api.get(&nodes[0]).await?),
        "still cordoned"
    );

    // The budget lifted, the same command finds the same maintenance and follows it to the end.
    pdbs.delete("web", &DeleteParams::default()).await?;
    let run = plugin(kubeconfig, ns, &["maintain", &nodes[0], "--drain"]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        field(&run.stdout, "NodeMaintenance"),
        Some(name.as_str()),
        "{run:?}"
    );
    assert!(
        field(&run.stdout, "Result").is_some_and(|r| r.starts_with("Done (1/1 nodes drained)")),
        "{run:?}"
    );
    assert_eq!(
        skeleton(&run.stdout),
        skeleton(&golden("maintain")),
        "{run:?}"
    );
    assert!(
        !run.stdout.contains('\x1b'),
        "no colour when piped: {run:?}"
    );
    assert_eq!(
        created_maintenances(client).await?.len(),
        1,
        "no second object"
    );
    let run = plugin(kubeconfig, ns, &["maintain", "complete", &nodes[0]]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(field(&run.stdout, "Stage"), Some("Complete"), "{run:?}");
    assert!(
        !unschedulable(&node_api.get(&nodes[0]).await?),
        "uncordoned"
    );
    assert!(created_maintenances(client).await?.is_empty(), "finished");

    // A drain that times out (onTimeout Fail): exit 1, the pod and its budget in the result;
    // `maintain complete` gives up and uncordons.
    pdbs.create(&PostParams::default(), &serde_json::from_value(pdb)?)
        .await?;
    wait_for("the web pod to run on node 0 again", TIMEOUT, || async {
        let list = pods.list(&ListParams::default().labels("app=web")).await?;
        Ok(list
            .items
            .iter()
            .any(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(nodes[0].as_str())
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            })
            .then_some(()))
    })
    .await?;
    let run = plugin(
        kubeconfig,
        ns,
        &["maintain", &nodes[0], "--drain", "--timeout", "2s"],
    )
    .await?;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        field(&run.stdout, "Result").is_some_and(|r| r.starts_with("Failed")),
        "{run:?}"
    );
    let blocking = run
        .stdout
        .split("BLOCKING PODS\n")
        .nth(1)
        .context("blocking pods")?;
    assert!(
        blocking.lines().any(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            cells.len() >= 4
                && cells[1].starts_with(&format!("{ns}/web-"))
                && cells[2] == "PodDisruptionBudget"
                && cells[3] == "web"
        }),
        "{run:?}"
    );
    assert!(
        field(&run.stdout, "Next").is_some_and(|n| n.contains("maintain complete --name maint-")),
        "{run:?}"
    );
    let run = plugin(kubeconfig, ns, &["maintain", "complete", &nodes[0]]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        !unschedulable(&node_api.get(&nodes[0]).await?),
        "uncordoned"
    );
    pdbs.delete("web", &DeleteParams::default()).await?;

    // Cordon, then advance the same object to Drain (-o json), then finish it by name.
    let run = plugin(kubeconfig, ns, &["maintain", &nodes[1]]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(field(&run.stdout, "Stage"), Some("Cordon"), "{run:?}");
    let cordoned = field(&run.stdout, "NodeMaintenance")
        .context("name")?
        .to_owned();
    assert!(unschedulable(&node_api.get(&nodes[1]).await?), "cordoned");
    let run = plugin(
        kubeconfig,
        ns,
        &["maintain", &nodes[1], "--drain", "-o", "json"],
    )
    .await?;
    assert_eq!(run.code, 0, "{run:?}");
    let v: serde_json::Value = serde_json::from_str(&run.stdout)?;
    assert_eq!(
        (v["metadata"]["name"].as_str(), v["spec"]["stage"].as_str()),
        (Some(cordoned.as_str()), Some("Drain")),
        "{v}"
    );
    let run = plugin(
        kubeconfig,
        ns,
        &["maintain", "complete", "--name", &cordoned, "--no-wait"],
    )
    .await?;
    assert_eq!(run.code, 0, "{run:?}");
    let run = plugin(kubeconfig, ns, &["maintain", "watch", "--name", &cordoned]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        !unschedulable(&node_api.get(&nodes[1]).await?),
        "uncordoned"
    );

    // On a terminal: the result in colour.
    let (code, transcript) =
        on_a_terminal(kubeconfig, ns, &format!("maintain {}", nodes[2])).await?;
    assert_eq!(code, Some(0), "{transcript:?}");
    assert!(
        transcript.contains("\x1b[32mDone\x1b[0m (1/1 nodes cordoned)"),
        "{transcript:?}"
    );
    let run = plugin(kubeconfig, ns, &["maintain", "complete", &nodes[2]]).await?;
    assert_eq!(run.code, 0, "{run:?}");

    // Refused by the controller (more nodes than maintenance.maxSelectedNodes): one line, the
    // maintenance deleted, no node touched.
    let all: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let run = plugin(
        kubeconfig,
        ns,
        &[&["maintain", "--drain"][..], &all].concat(),
    )
    .await?;
    let line = run.error_line();
    assert!(
        line.contains("the controller refused nodemaintenance maint-")
            && line.contains("maintenance.maxSelectedNodes")
            && line.contains("; deleted nodemaintenance"),
        "{run:?}"
    );
    assert!(created_maintenances(client).await?.is_empty(), "deleted");
    for node in nodes {
        assert!(
            !unschedulable(&node_api.get(node).await?),
            "{node} untouched"
        );
    }
    // Nothing to complete: one line.
    let run = plugin(kubeconfig, ns, &["maintain", "complete", &nodes[2]]).await?;
    assert!(
        run.error_line().contains("no NodeMaintenance in progress"),
        "{run:?}"
    );
    deployments.delete("web", &DeleteParams::default()).await?;
    Ok(())
}

/// `diag`: bundles collected by the real controller from real agents, downloaded by the plugin
/// through the API server's service proxy, and checked here against the status's sha256.
async fn diag_verb(
    client: &kube::Client,
    kubeconfig: &Path,
    ns: &str,
    nodes: &[String],
) -> anyhow::Result<()> {
    let api: Api<NodeDiagnostic> = Api::namespaced(client.clone(), ns);
    let dir = tempfile::tempdir()?;
    let out_dir = dir.path().join("bundles");
    let out_arg = out_dir.display().to_string();

    // Two nodes, kept, -o json: every file's bytes hash to the sha256 the controller wrote.
    let run = plugin(
        kubeconfig,
        ns,
        &[
            "diag", &nodes[0], &nodes[1], "-O", &out_arg, "--keep", "-o", "json",
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{run:?}");
    let v: serde_json::Value = serde_json::from_str(&run.stdout)?;
    let name = v["name"].as_str().context("name")?;
    let status = api.get(name).await?.status.context("status")?;
    let bundles = v["bundles"].as_array().context("bundles")?;
    assert_eq!(bundles.len(), 2, "{v}");
    for b in bundles {
        let node = b["node"].as_str().context("node")?;
        let stored = status
            .nodes
            .iter()
            .find(|n| n.node == node)
            .context("node in status")?;
        let file = PathBuf::from(b["file"].as_str().context("file")?);
        assert_eq!(file, out_dir.join(format!("{name}-{node}.tar.gz")));
        let bytes = std::fs::read(&file)?;
        assert_eq!(bytes.len() as u64, stored.size_bytes, "{node}");
        assert_eq!(hex::encode(Sha256::digest(&bytes)), stored.sha256, "{node}");
        assert_eq!(b["verified"], true);
        let listing = Command::new("tar").arg("-tzf").arg(&file).output()?;
        let listing = String::from_utf8_lossy(&listing.stdout);
        assert!(
            listing.lines().any(|l| l.ends_with("/manifest.json")),
            "{listing}"
        );
        assert!(!out_dir.join(format!("{name}-{node}.tar.gz.part")).exists());
    }
    api.delete(name, &DeleteParams::default()).await?;

    // Piped table output, the object deleted afterwards.
    let run = plugin(
        kubeconfig,
        ns,
        &[
            "diag",
            &nodes[2],
            "-O",
            &out_arg,
            "--parts",
            "report,sysctl",
        ],
    )
    .await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        field(&run.stdout, "Result").is_some_and(
            |r| r.starts_with("Succeeded (1 nodes, 1 downloaded and verified, 0 failed)")
        ),
        "{run:?}"
    );
    assert_eq!(skeleton(&run.stdout), skeleton(&golden("diag")), "{run:?}");
    let row = run
        .stdout
        .lines()
        .find(|l| l.starts_with(&format!("{} ", nodes[2])))
        .context("bundle row")?;
    let file = row.split_whitespace().last().context("file")?;
    assert!(Path::new(file).exists(), "{row}");
    assert!(run.stderr.contains("sha256 verified"), "{run:?}");
    assert!(created_diagnostics(client, ns).await?.is_empty(), "deleted");

    // On a terminal: the live line and colour.
    let (code, transcript) = on_a_terminal(
        kubeconfig,
        ns,
        &format!("diag {} -O {out_arg} --parts report", nodes[0]),
    )
    .await?;
    assert_eq!(code, Some(0), "{transcript:?}");
    // A live line: the collection's ("… bundles stored") unless the report was collected
    // before the plugin's first look (a small part on a fast machine), then the download's bar.
    assert!(
        transcript.contains("bundles stored") || transcript.contains("KiB / "),
        "{transcript:?}"
    );
    assert!(
        transcript.contains("\x1b[32mverified\x1b[0m"),
        "{transcript:?}"
    );

    // Refused by the controller (a part that does not exist): one line, the object deleted.
    let run = plugin(
        kubeconfig,
        ns,
        &["diag", &nodes[0], "--parts", "report,dmesg"],
    )
    .await?;
    let line = run.error_line();
    assert!(
        line.contains("the controller refused nodediagnostic")
            && line.contains("spec.parts[1]")
            && line.contains("; deleted nodediagnostic"),
        "{run:?}"
    );
    // An unknown node: nothing created.
    let run = plugin(kubeconfig, ns, &["diag", &nodes[0], "no-such-node-here"]).await?;
    assert!(
        run.error_line()
            .contains("node \"no-such-node-here\" not found"),
        "{run:?}"
    );
    assert!(
        created_diagnostics(client, ns).await?.is_empty(),
        "nothing left"
    );
    Ok(())
}

/// A kubeconfig for the harness's cluster that authenticates with `token`.
fn token_kubeconfig(dir: &Path, token: &str) -> anyhow::Result<PathBuf> {
    let admin: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(
        ControlPlane::shared().kubeconfig(),
    )?)?;
    let cluster = admin["clusters"][0]["cluster"].clone();
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    });
    let path = dir.join(format!("kubeconfig-{}", unique_name("sa")));
    std::fs::write(&path, serde_yaml::to_string(&config)?)?;
    Ok(path)
}

/// A ServiceAccount's token, as a kubeconfig.
async fn service_account_kubeconfig(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    dir: &Path,
) -> anyhow::Result<PathBuf> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(json!({"spec": {"audiences": [], "expirationSeconds": 3600}}))?;
    // The shared API server answers 429 "storage is (re)initializing" for a moment after it
    // starts, and again while other tests install CRDs: that is a wait, not a failure.
    let busy = |e: &kube::Error| matches!(e, kube::Error::Api(s) if s.code == 429);
    let token = wait_for(
        &format!("a token for ServiceAccount {name}"),
        TIMEOUT,
        || {
            let (sas, request) = (sas.clone(), request.clone());
            async move {
                let account = serde_json::from_value(json!({"metadata": {"name": name}}))?;
                match sas.create(&PostParams::default(), &account).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 409 => {}
                    Err(e) if busy(&e) => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
                match sas
                    .create_token_request(name, &PostParams::default(), &request)
                    .await
                {
                    Ok(answer) => Ok(answer.status.and_then(|s| s.token)),
                    Err(e) if busy(&e) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        },
    )
    .await?;
    token_kubeconfig(dir, &token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_controller_each_verb_works_and_bad_input_gets_one_line() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        println!(
            "SKIPPED: needs root for the network namespace behind the service proxy and the agents' ICMP"
        );
        return Ok(());
    }
    let cp = ControlPlane::shared();
    let kubeconfig = cp.kubeconfig();
    let client = cp.client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-plugin").await?;
    let group = unique_name("plugin");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(3);
    let nodes = create_simulated_nodes(&client, "nk-plugin", 3, &labels, &ips).await?;
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &BTreeMap::from([
            ("sweepInterval", "10s"),
            ("callTimeout", "2s"),
            // Low enough that `maintain` of all three nodes is refused by the controller.
            ("maintenance.maxSelectedNodes", "2"),
        ]),
    )
    .await?;
    let store = tempfile::tempdir()?;
    let store_dir = store.path().display().to_string();
    let controller = ControllerProcess::start(
        &ns,
        "plugin-controller",
        &selector,
        port,
        &[("NODEKEEPER_DIAGNOSTICS_DIR", &store_dir)],
    )?;
    let tls = agent_tls(&client, &ns).await?;
    let node_files = tempfile::tempdir()?;
    let diag_flags = diagnostics_flags(node_files.path())?;
    let mut agents = Vec::new();
    for (node, ip) in nodes.iter().zip(&ips) {
        let addr = SocketAddr::new((*ip).into(), port);
        agents.push(start_agent_with(node, addr, &tls, &diag_flags).await?);
    }
    for node in &nodes {
        wait_condition(&client, node, "NodekeeperReachable", "True", None, TIMEOUT).await?;
    }
    let _exposed = expose_controller(&client, &ns, controller.http).await?;

    // status: the fleet through the service proxy, plain when piped, with the golden layout.
    let run = wait_for("status to count 3 reachable nodes", TIMEOUT, || async {
        let run = plugin(kubeconfig, &ns, &["status"]).await?;
        Ok((run.code == 0 && field(&run.stdout, "Reports held") == Some("3")).then_some(run))
    })
    .await?;
    assert_eq!(field(&run.stdout, "Nodes managed"), Some("3"), "{run:?}");
    assert_eq!(
        field(&run.stdout, "Unreachable agents"),
        Some("0"),
        "{run:?}"
    );
    assert_eq!(
        field(&run.stdout, "Refusing tuning rules"),
        Some("0"),
        "{run:?}"
    );
    assert!(
        field(&run.stdout, "Controller")
            .is_some_and(|c| c.starts_with("plugin-controller (leader")),
        "{run:?}"
    );
    let reachable = run
        .stdout
        .lines()
        .find(|l| l.starts_with("NodekeeperReachable "))
        .context("NodekeeperReachable row")?;
    assert_eq!(
        reachable.split_whitespace().collect::<Vec<_>>(),
        ["NodekeeperReachable", "3", "0", "0"]
    );
    assert!(
        !run.stdout.contains('\x1b'),
        "no colour when piped: {run:?}"
    );
    assert_eq!(
        skeleton(&run.stdout),
        skeleton(&golden("status")),
        "{run:?}"
    );
    assert!(run.stderr.is_empty(), "{run:?}");

    let run = plugin(kubeconfig, &ns, &["status", "-o", "json"]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    let v: serde_json::Value = serde_json::from_str(&run.stdout)?;
    assert_eq!(v["controller"]["fleet"]["nodes"], 3, "{v}");
    assert_eq!(v["controller"]["fleet"]["unreachable"], 0, "{v}");
    assert_eq!(v["controller"]["fleet"]["refusingRules"], 0, "{v}");
    assert_eq!(
        v["controller"]["fleet"]["conditions"]["NodekeeperReachable=True"], 3,
        "{v}"
    );
    let run = plugin(kubeconfig, &ns, &["status", "-o", "wide"]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("NODES WITH A CONDITION NOT TRUE"),
        "{run:?}"
    );

    // --watch refreshes until Ctrl-C, which exits 0; piped, each snapshot is headed by its time.
    let child = Command::new(PLUGIN)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", &ns, "status", "--watch", "--interval", "1s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Long enough for at least two refreshes on a loaded machine.
    tokio::time::sleep(Duration::from_secs(4)).await;
    ctrl_c(&child)?;
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
    let stdout = String::from_utf8(out.stdout)?;
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let snapshots = stdout
        .lines()
        .filter(|l| l.starts_with("Controller:"))
        .count();
    let stamps = stdout.lines().filter(|l| l.starts_with("# 20")).count();
    assert!(snapshots >= 2 && stamps == snapshots, "{stdout}");

    // node: the full report, and the two ways a name can be wrong.
    let run = plugin(kubeconfig, &ns, &["node", &nodes[0]]).await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        field(&run.stdout, "Node"),
        Some(nodes[0].as_str()),
        "{run:?}"
    );
    assert_eq!(
        field(&run.stdout, "Address"),
        Some(ips[0].to_string().as_str()),
        "{run:?}"
    );
    for section in [
        "CONDITIONS",
        "INDICATORS",
        "TUNABLES",
        "INTERFACES",
        "GPUS",
        "PLUGINS",
    ] {
        assert!(
            run.stdout.lines().any(|l| l == section),
            "{section}: {run:?}"
        );
    }
    assert!(
        run.stdout.lines().any(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some("NodekeeperReachable") && w.next() == Some("True")
        }),
        "{run:?}"
    );
    let run = plugin(kubeconfig, &ns, &["node", &nodes[0], "-o", "json"]).await?;
    let v: serde_json::Value = serde_json::from_str(&run.stdout)?;
    assert_eq!(v["report"]["nodeName"], nodes[0].as_str(), "{v}");
    let run = plugin(kubeconfig, &ns, &["node", "no-such-node-here"]).await?;
    assert!(
        run.error_line()
            .contains("node \"no-such-node-here\" not found"),
        "{run:?}"
    );
    let unmanaged =
        create_simulated_nodes(&client, "nk-plugin-other", 1, &BTreeMap::new(), &[]).await?;
    let run = plugin(kubeconfig, &ns, &["node", &unmanaged[0]]).await?;
    assert!(
        run.error_line()
            .contains("exists but the controller has no report"),
        "{run:?}"
    );

    // netcheck: a mesh that succeeds, exit 0, and the test deleted afterwards.
    let nc = ["netcheck", "-l", selector.as_str()];
    let run = plugin(
        kubeconfig,
        &ns,
        &[&nc[..], &["--count", "2", "peers:2"]].concat(),
    )
    .await?;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(field(&run.stdout, "Result"), Some("Succeeded"), "{run:?}");
    assert_eq!(
        field(&run.stdout, "Pairs"),
        Some("6, 0 failed (100.0% succeeded)"),
        "{run:?}"
    );
    assert_eq!(
        skeleton(&run.stdout)[..5],
        skeleton(&golden("netcheck"))[..5],
        "{run:?}"
    );
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "deleted without --keep"
    );

    // A test that does not finish within --wait: exit 1, said on stderr, and deleted.
    let run = plugin(
        kubeconfig,
        &ns,
        &[&nc[..], &["--count", "60", "--wait", "1s"]].concat(),
    )
    .await?;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("did not finish within 1s"), "{run:?}");
    assert!(run.stderr.contains("; deleted networktest"), "{run:?}");
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "deleted after the wait"
    );

    // On a terminal (script(1) gives it a pty): the live progress line and colour.
    let (code, transcript) = on_a_terminal(
        kubeconfig,
        &ns,
        &format!("netcheck -l {selector} --count 8 peers:2"),
    )
    .await?;
    assert_eq!(code, Some(0), "{transcript:?}");
    assert!(
        transcript.contains("\r\x1b[2K"),
        "progress line: {transcript:?}"
    );
    assert!(
        transcript.contains(": Running"),
        "progress line: {transcript:?}"
    );
    assert!(
        transcript.contains("\x1b[32mSucceeded\x1b[0m"),
        "colour: {transcript:?}"
    );
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "deleted without --keep"
    );

    // Failing pairs: TCP to a closed port; exit 1, the pairs named.
    let closed = free_port().to_string();
    let run = plugin(
        kubeconfig,
        &ns,
        &[
            &nc[..],
            &[
                "--kind", "tcp", "--port", &closed, "--count", "1", "peers:1",
            ],
        ]
        .concat(),
    )
    .await?;
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(field(&run.stdout, "Result"), Some("Failed"), "{run:?}");
    let failing = run
        .stdout
        .split("FAILING PAIRS\n")
        .nth(1)
        .context("failing pairs")?;
    assert!(
        nodes.iter().any(|n| failing.contains(n.as_str())),
        "{run:?}"
    );
    assert!(failing.contains("100.0%"), "{run:?}");

    // --keep and -o json: the object stays, and the JSON is that object.
    let run = plugin(
        kubeconfig,
        &ns,
        &[&nc[..], &["--count", "1", "--keep", "-o", "json"]].concat(),
    )
    .await?;
    assert_eq!(run.code, 0, "{run:?}");
    let v: serde_json::Value = serde_json::from_str(&run.stdout)?;
    assert_eq!(
        (v["kind"].as_str(), v["status"]["phase"].as_str()),
        (Some("NetworkTest"), Some("Succeeded")),
        "{v}"
    );
    let kept = created_tests(&client, &ns).await?;
    assert_eq!(kept, [v["metadata"]["name"].as_str().unwrap_or_default()]);
    Api::<NetworkTest>::namespaced(client.clone(), &ns)
        .delete(&kept[0], &DeleteParams::default())
        .await?;

    // Refused by the API server (the CRD's rule: dns takes hostnames), a selector that matches
    // nothing: one line, exit 2, nothing created.
    let run = plugin(
        kubeconfig,
        &ns,
        &[&nc[..], &["--kind", "dns", "10.0.0.1"]].concat(),
    )
    .await?;
    let line = run.error_line();
    assert!(
        line.contains("refused the NetworkTest")
            && line.contains("kind dns takes hostname targets"),
        "{run:?}"
    );
    // Refused by the controller: the metadata service by address. The schema admits any IP; the
    // controller's address policy refuses it in its plan, so no probe is ever sent (and the agent
    // would refuse it again).
    let run = plugin(
        kubeconfig,
        &ns,
        &[&nc[..], &["--kind", "icmp", "169.254.169.254"]].concat(),
    )
    .await?;
    let line = run.error_line();
    assert!(
        line.contains("the controller refused networktest")
            && line.contains("spec.targets[0].address"),
        "{run:?}"
    );
    assert!(
        line.contains(&format!("; deleted networktest {ns}/")),
        "{run:?}"
    );
    assert!(created_tests(&client, &ns).await?.is_empty(), "deleted");
    let run = plugin(
        kubeconfig,
        &ns,
        &["netcheck", "-l", "nodekeeper.dev/e2e-group=matches-nothing"],
    )
    .await?;
    assert!(
        run.error_line().contains("no node matches the selector"),
        "{run:?}"
    );
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "nothing created"
    );

    // RBAC: a user who may read through the proxy and list nodes but not create NetworkTests.
    let dir = tempfile::tempdir()?;
    let viewer_kubeconfig = service_account_kubeconfig(&client, &ns, "viewer", dir.path()).await?;
    let role_name = unique_name("nk-plugin-viewer");
    let roles: Api<Role> = Api::namespaced(client.clone(), &ns);
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "viewer"},
                "rules": [{"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["get"]}],
            }))?,
        )
        .await?;
    Api::<RoleBinding>::namespaced(client.clone(), &ns).create(&PostParams::default(), &serde_json::from_value(json!({
        "metadata": {"name": "viewer"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "viewer"},
        "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": ns}],
    }))?).await?;
    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    cluster_roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": role_name},
                "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}],
            }))?,
        )
        .await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    bindings.create(&PostParams::default(), &serde_json::from_value(json!({
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": ns}],
    }))?).await?;
    let run = wait_for("RBAC to take effect", TIMEOUT, || async {
        let run = plugin(&viewer_kubeconfig, &ns, &nc[..]).await?;
        Ok(run
            .stderr
            .contains("cannot create resource \"networktests\"")
            .then_some(run))
    })
    .await?;
    assert!(
        run.error_line().starts_with("error: permission denied: "),
        "{run:?}"
    );
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "nothing created"
    );
    for (args, resource) in [
        (vec!["maintain", nodes[0].as_str()], "nodemaintenances"),
        (vec!["diag", nodes[0].as_str()], "nodediagnostics"),
    ] {
        let run = plugin(&viewer_kubeconfig, &ns, &args).await?;
        let line = run.error_line();
        assert!(
            line.starts_with("error: permission denied: ") && line.contains(resource),
            "{run:?}"
        );
    }
    assert!(
        created_maintenances(&client).await?.is_empty(),
        "nothing created"
    );
    assert!(
        created_diagnostics(&client, &ns).await?.is_empty(),
        "nothing created"
    );
    let _ = bindings.delete(&role_name, &DeleteParams::default()).await;
    let _ = cluster_roles
        .delete(&role_name, &DeleteParams::default())
        .await;

    // Ctrl-C during a run: exit 130, and the test is deleted (kept with --keep).
    for keep in [false, true] {
        let mut cmd = Command::new(PLUGIN);
        cmd.arg("--kubeconfig")
            .arg(kubeconfig)
            .args([
                "-n", &ns, "netcheck", "-l", &selector, "--count", "60", "peers:2",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if keep {
            cmd.arg("--keep");
        }
        let child = cmd.spawn()?;
        let name = wait_for("the netcheck's NetworkTest", TIMEOUT, || async {
            Ok(created_tests(&client, &ns).await?.into_iter().next())
        })
        .await?;
        ctrl_c(&child)?;
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
        let stderr = String::from_utf8(out.stderr)?;
        assert_eq!(out.status.code(), Some(130), "{stderr}");
        let left = created_tests(&client, &ns).await?;
        if keep {
            assert!(
                stderr.contains(&format!("interrupted; kept networktest {ns}/{name}")),
                "{stderr}"
            );
            assert_eq!(left, std::slice::from_ref(&name));
            Api::<NetworkTest>::namespaced(client.clone(), &ns)
                .delete(&name, &DeleteParams::default())
                .await?;
        } else {
            assert!(
                stderr.contains(&format!("interrupted; deleted networktest {ns}/{name}")),
                "{stderr}"
            );
            assert!(left.is_empty(), "{left:?}");
        }
    }

    maintain_verbs(&client, kubeconfig, &ns, &nodes).await?;
    diag_verb(&client, kubeconfig, &ns, &nodes).await?;

    drop((agents, controller));
    Ok(())
}

#[tokio::test]
async fn without_a_running_controller_or_without_rights_each_verb_says_so() -> anyhow::Result<()> {
    let cp = ControlPlane::shared();
    let kubeconfig = cp.kubeconfig();
    let client = cp.client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "nk-plugin-down").await?;
    let nodes = create_simulated_nodes(&client, "nk-plugin-down", 1, &BTreeMap::new(), &[]).await?;

    // No Service at all (nothing installed in this namespace).
    for args in [
        vec!["status"],
        vec!["node", nodes[0].as_str()],
        vec!["netcheck"],
        vec!["maintain", nodes[0].as_str(), "--drain"],
        vec!["maintain", "complete", nodes[0].as_str()],
        vec!["diag", nodes[0].as_str()],
    ] {
        let run = plugin(kubeconfig, &ns, &args).await?;
        let line = run.error_line();
        assert!(
            line.contains(&format!(
                "not reachable through Service {ns}/nodekeeper-controller"
            )) && line.contains("services \"nodekeeper-controller\" not found"),
            "{run:?}"
        );
    }
    // The Service, but no controller behind it: the proxy's 503.
    Api::<Service>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "nodekeeper-controller"},
                "spec": {"selector": {"app.kubernetes.io/name": "nodekeeper-controller"},
                         "ports": [{"name": "http", "port": 8080}]},
            }))?,
        )
        .await?;
    // kube-controller-manager writes the (empty) Endpoints a moment after the Service; until
    // then the proxy still answers "not found".
    wait_for("the Service's empty Endpoints", TIMEOUT, || async {
        let run = plugin(kubeconfig, &ns, &["status"]).await?;
        Ok(run.stderr.contains("no endpoints available").then_some(()))
    })
    .await?;
    for args in [
        vec!["status"],
        vec!["netcheck"],
        vec!["maintain", nodes[0].as_str()],
        vec!["diag", nodes[0].as_str()],
    ] {
        let run = plugin(kubeconfig, &ns, &args).await?;
        assert!(
            run.error_line()
                .contains("no endpoints available for service"),
            "{run:?}"
        );
    }
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "nothing created"
    );
    assert!(
        created_diagnostics(&client, &ns).await?.is_empty(),
        "nothing created"
    );

    // A user without any rights.
    let dir = tempfile::tempdir()?;
    let nobody = service_account_kubeconfig(&client, &ns, "nobody", dir.path()).await?;
    for args in [
        vec!["status"],
        vec!["netcheck"],
        vec!["maintain", nodes[0].as_str()],
        vec!["diag", nodes[0].as_str()],
    ] {
        let run = plugin(&nobody, &ns, &args).await?;
        let line = run.error_line();
        assert!(line.starts_with("error: permission denied: "), "{run:?}");
        assert!(
            line.contains("cannot get resource \"services/proxy\""),
            "{run:?}"
        );
    }
    // A token the API server does not accept.
    let stranger = token_kubeconfig(dir.path(), "not-a-valid-token")?;
    let run = plugin(&stranger, &ns, &["status"]).await?;
    assert!(
        run.error_line()
            .contains("refused the credentials (401 Unauthorized)"),
        "{run:?}"
    );
    assert!(
        created_tests(&client, &ns).await?.is_empty(),
        "nothing created"
    );
    Ok(())
}

#[tokio::test]
async fn an_api_server_that_is_down_or_a_missing_kubeconfig_is_one_line_and_exit_2()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let port = free_port();
    let config = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": format!("https://127.0.0.1:{port}"), "insecure-skip-tls-verify": true}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    });
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&config)?)?;
    for args in [
        vec!["status"],
        vec!["node", "n1"],
        vec!["netcheck"],
        vec!["maintain", "n1"],
        vec!["diag", "n1"],
    ] {
        let run = plugin(&path, "nodekeeper", &args).await?;
        let line = run.error_line();
        assert!(
            line.starts_with(&format!(
                "error: reach the API server at https://127.0.0.1:{port}"
            )),
            "{run:?}"
        );
        assert!(line.to_lowercase().contains("refused"), "{run:?}");
    }
    let run = plugin(&dir.path().join("missing"), "nodekeeper", &["status"]).await?;
    assert!(run.error_line().contains("load the kubeconfig"), "{run:?}");
    let run = plugin(&path, "nodekeeper", &["--context", "nope", "status"]).await?;
    assert!(run.error_line().contains("nope"), "{run:?}");
    Ok(())
}

#[tokio::test]
async fn help_usage_errors_and_completion() -> anyhow::Result<()> {
    let help = Command::new(PLUGIN).arg("--help").output()?;
    assert_eq!(help.status.code(), Some(0));
    let text = String::from_utf8(help.stdout)?;
    assert!(
        text.contains("Exit codes:") && text.contains("kubectl nodekeeper netcheck"),
        "{text}"
    );
    let usage = Command::new(PLUGIN)
        .args(["netcheck", "--kind", "udp"])
        .output()?;
    assert_eq!(usage.status.code(), Some(2));
    assert!(String::from_utf8(usage.stderr)?.contains("invalid value 'udp'"));
    let completion = Command::new(PLUGIN).args(["completion", "bash"]).output()?;
    assert_eq!(completion.status.code(), Some(0));
    let script = String::from_utf8(completion.stdout)?;
    assert!(
        script.contains("netcheck") && script.contains("complete"),
        "{script}"
    );
    Ok(())
}
