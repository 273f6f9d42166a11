//! `diag`: creates a `NodeDiagnostic` for named nodes, waits for the controller to collect the
//! bundles, downloads each one through the API server's service proxy to the controller's HTTP
//! API — streamed to disk chunk by chunk, never whole in memory — checks its size and SHA-256
//! against the status, and says where each bundle is. The object is deleted afterwards unless
//! `--keep` (or a download failed, so the bundle can be fetched again), and when interrupted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use http_body_util::BodyExt as _;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::common::ConditionStatus;
use nodekeeper_api::crd::node_diagnostic::{MAX_NODES, NodeBundle, Phase};
use nodekeeper_api::crd::{NodeDiagnostic, NodeDiagnosticSpec};
use nodekeeper_api::names;
use serde::Serialize;
use serde_json::json;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use crate::Outcome;
use crate::connect::Connection;
use crate::controller_api::{self, Answer};
use crate::error::{Error, chain};
use crate::live::{Interrupts, Live, eprint_line};
use crate::named_nodes;
use crate::render::{self, Cell, Color, Output, Table};

/// How often the object is read while waiting.
const POLL: Duration = Duration::from_millis(500);
/// A NodeDiagnostic this command deletes itself still gets a TTL, so one left behind by a killed
/// process is removed (with its bundles) by the controller within this many seconds.
const BACKSTOP_TTL_SECONDS: u32 = 600;
/// At most this much of an error answer is read.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// The progress bar is redrawn at most this often.
const REDRAW: Duration = Duration::from_millis(100);

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Examples:
  kubectl nodekeeper diag worker-7                       # ./diag-…-worker-7.tar.gz
  kubectl nodekeeper diag worker-7 worker-8 -O /tmp/incident-42
  kubectl nodekeeper diag worker-7 --parts report,kernel-log,network
  kubectl nodekeeper diag worker-7 --keep -o json | jq -r '.bundles[].file'

Parts: report, kernel-log, journal, network, nodekeeper-network, sysctl, sockets, disk, oca, gpu,
node-files (default: the tuning ConfigMap's diagnostics.parts). Each bundle is a .tar.gz with a
manifest.json saying which parts succeeded. Exit codes: 0 every bundle downloaded and its sha256
matches, 1 a node's bundle could not be collected or downloaded, 2 not done (unknown node,
controller not reachable, refused), 130 interrupted (the NodeDiagnostic is deleted unless --keep).")]
pub struct Args {
    /// The nodes to collect from (as in `kubectl get nodes`; at most 50).
    #[arg(value_name = "NODES", required = true)]
    pub nodes: Vec<String>,
    /// Directory the bundles are written to (created when missing).
    #[arg(
        short = 'O',
        long = "output-dir",
        env = "NODEKEEPER_OUTPUT_DIR",
        default_value = "."
    )]
    pub output_dir: PathBuf,
    /// Parts to gather, comma-separated. Default: the tuning ConfigMap's diagnostics.parts.
    #[arg(long, env = "NODEKEEPER_PARTS", value_delimiter = ',')]
    pub parts: Vec<String>,
    /// Name of the NodeDiagnostic. Default: `diag-` and a random suffix.
    #[arg(long, env = "NODEKEEPER_DIAGNOSTIC")]
    pub name: Option<String>,
    /// Keep the NodeDiagnostic (and the bundles on the controller) afterwards; the controller
    /// deletes both after its TTL (1h).
    #[arg(long, env = "NODEKEEPER_KEEP")]
    pub keep: bool,
    /// How long to wait for the collection before giving up (exit 1).
    #[arg(long, env = "NODEKEEPER_WAIT", default_value = "10m", value_parser = crate::cli::duration)]
    pub wait: Duration,
}

/// What became of one node's bundle.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct BundleResult {
    pub node: String,
    /// `Succeeded` (downloaded and checked) or `Failed`.
    pub phase: String,
    pub size_bytes: u64,
    pub sha256: String,
    /// The sha256 of the downloaded file matched the status.
    pub verified: bool,
    /// Where the bundle is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// Why it failed.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// The result, as `-o json` prints it.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DiagView {
    pub namespace: String,
    pub name: String,
    /// The collection's phase (`Succeeded`, `Failed`).
    pub phase: String,
    /// `deleted` or `kept`.
    pub object: String,
    pub directory: String,
    pub bundles: Vec<BundleResult>,
}

pub async fn run(conn: &Connection, args: &Args, out: &Output) -> Result<Outcome, Error> {
    let mut interrupts = Interrupts::register()?;
    if args.nodes.len() > MAX_NODES {
        return Err(Error::InvalidFlags(format!(
            "at most {MAX_NODES} nodes per diag ({} given)",
            args.nodes.len()
        )));
    }
    if args.parts.iter().any(|p| p.trim().is_empty()) {
        return Err(Error::InvalidFlags("--parts has an empty part name".into()));
    }
    controller_api::get(conn, "/api/v1/summary").await?;
    let nodes = named_nodes::resolve(conn, &args.nodes).await?;
    let mut spec = if let [node] = nodes.as_slice() {
        json!({ "nodeName": node.name_any() })
    } else {
        json!({ "nodeSelector": named_nodes::selector(&nodes)? })
    };
    if !args.parts.is_empty() {
        spec["parts"] = json!(args.parts);
    }
    if !args.keep {
        spec["ttlSecondsAfterFinished"] = json!(BACKSTOP_TTL_SECONDS);
    }
    let spec: NodeDiagnosticSpec =
        serde_json::from_value(spec).map_err(|e| Error::InvalidFlags(e.to_string()))?;
    tokio::fs::create_dir_all(&args.output_dir)
        .await
        .map_err(|source| Error::WriteFile {
            path: args.output_dir.clone(),
            source,
        })?;

    let api: Api<NodeDiagnostic> = Api::namespaced(conn.client.clone(), &conn.namespace);
    let mut object = NodeDiagnostic::new("", spec);
    object.metadata.name = args.name.clone();
    if args.name.is_none() {
        object.metadata.generate_name = Some("diag-".into());
    }
    object.metadata.labels = Some(BTreeMap::from([(
        crate::netcheck::CREATED_BY.0.to_owned(),
        crate::netcheck::CREATED_BY.1.to_owned(),
    )]));
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if matches!(s.code, 400 | 409 | 422) => Error::Refused {
                what: format!("NodeDiagnostic in namespace {}", conn.namespace),
                message: s.message.clone(),
            },
            e => conn.error(
                &format!("create a nodediagnostic in namespace {}", conn.namespace),
                e,
            ),
        })?;
    let name = created.name_any();
    let id = format!("{}/{name}", conn.namespace);
    let cleanup = |keep: bool| {
        let (api, name, id) = (api.clone(), name.clone(), id.clone());
        async move {
            if keep {
                return format!("kept nodediagnostic {id}");
            }
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => format!("deleted nodediagnostic {id}"),
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    format!("nodediagnostic {id} is already gone")
                }
                Err(e) => format!(
                    "could not delete nodediagnostic {id}: {}; the controller removes it {BACKSTOP_TTL_SECONDS}s after it finishes",
                    chain(&e)
                ),
            }
        }
    };

    // Wait for the collection.
    let started = Instant::now();
    let mut live = Live::new(out);
    let finished =
        loop {
            let got = tokio::select! {
                reason = interrupts.recv() => {
                    live.clear();
                    eprint_line(&format!("{reason}; {}", cleanup(args.keep).await));
                    return Ok(Outcome::Interrupted);
                }
                got = api.get_opt(&name) => got,
            };
            let d = match got {
                Ok(Some(d)) => d,
                Ok(None) => {
                    live.clear();
                    return Err(Error::UnexpectedAnswer {
                        what: format!("nodediagnostic {id}"),
                        detail: "it was deleted by someone else before it finished".into(),
                    });
                }
                Err(e) => {
                    live.clear();
                    eprint_line(&cleanup(args.keep).await);
                    return Err(conn.error(&format!("read nodediagnostic {id}"), e));
                }
            };
            let status = d.status.clone().unwrap_or_default();
            if let Some(invalid) = status.conditions.iter().find(|c| {
                c.type_ == names::CONDITION_SPEC_VALID && c.status == ConditionStatus::False
            }) {
                live.clear();
                return Err(Error::ControllerRefused {
                    what: format!("nodediagnostic {id}"),
                    message: invalid.message.clone(),
                    disposition: cleanup(args.keep).await,
                });
            }
            if matches!(status.phase, Some(Phase::Succeeded | Phase::Failed)) {
                break d;
            }
            if started.elapsed() > args.wait {
                live.clear();
                eprint_line(&format!(
                    "nodediagnostic {id} did not finish within {} (phase {}); {}",
                    humantime::format_duration(args.wait),
                    phase_word(status.phase),
                    cleanup(args.keep).await
                ));
                return Ok(Outcome::Failed);
            }
            let stored = status
                .nodes
                .iter()
                .filter(|n| n.phase == Phase::Succeeded)
                .count();
            live.show(
                &format!(
                    "{name}: {}, {stored}/{} bundles stored, {}s",
                    phase_word(status.phase),
                    status
                        .node_count
                        .max(u32::try_from(nodes.len()).unwrap_or(0)),
                    started.elapsed().as_secs()
                ),
                &status
                    .nodes
                    .iter()
                    .filter(|n| n.phase != Phase::Running)
                    .map(collected_line)
                    .collect::<Vec<_>>(),
            );
            tokio::select! {
                reason = interrupts.recv() => {
                    live.clear();
                    eprint_line(&format!("{reason}; {}", cleanup(args.keep).await));
                    return Ok(Outcome::Interrupted);
                }
                () = tokio::time::sleep(POLL) => {}
            }
        };
    live.clear();

    // Download every stored bundle.
    let status = finished.status.clone().unwrap_or_default();
    let mut results = Vec::new();
    for bundle in &status.nodes {
        if bundle.phase != Phase::Succeeded || bundle.download_path.is_empty() {
            results.push(BundleResult {
                node: bundle.node.clone(),
                phase: "Failed".into(),
                size_bytes: 0,
                sha256: String::new(),
                verified: false,
                file: None,
                reason: if bundle.reason.is_empty() {
                    "not collected".into()
                } else {
                    bundle.reason.clone()
                },
            });
            continue;
        }
        let file = args
            .output_dir
            .join(format!("{name}-{}.tar.gz", bundle.node));
        let got = tokio::select! {
            reason = interrupts.recv() => {
                live.clear();
                let _ = std::fs::remove_file(partial(&file));
                eprint_line(&format!("{reason}; {}", cleanup(args.keep).await));
                return Ok(Outcome::Interrupted);
            }
            got = download(conn, bundle, &file, &mut live) => got,
        };
        live.clear();
        results.push(match got {
            Ok(()) => {
                live.note(&format!(
                    "{}: downloaded {}, sha256 verified",
                    bundle.node,
                    file.display()
                ));
                BundleResult {
                    node: bundle.node.clone(),
                    phase: "Succeeded".into(),
                    size_bytes: bundle.size_bytes,
                    sha256: bundle.sha256.clone(),
                    verified: true,
                    file: Some(file.display().to_string()),
                    reason: String::new(),
                }
            }
            Err(e) => BundleResult {
                node: bundle.node.clone(),
                phase: "Failed".into(),
                size_bytes: bundle.size_bytes,
                sha256: bundle.sha256.clone(),
                verified: false,
                file: None,
                reason: format!(
                    "{e}; fetch it again: kubectl get --raw {} > {}",
                    controller_api::proxy_path(&conn.namespace, &bundle.download_path),
                    file.display()
                ),
            },
        });
    }
    live.clear();
    let all_ok = !results.is_empty() && results.iter().all(|r| r.verified);
    let download_failed = results.iter().any(|r| !r.verified && r.sha256.len() == 64);
    let keep = args.keep || download_failed;
    let object = if keep {
        "kept".to_owned()
    } else {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => "deleted".to_owned(),
            Err(e) => {
                eprint_line(&format!(
                    "warning: could not delete nodediagnostic {id}: {}; the controller removes it {BACKSTOP_TTL_SECONDS}s after it finished",
                    chain(&e)
                ));
                "kept".to_owned()
            }
        }
    };
    let view = DiagView {
        namespace: conn.namespace.clone(),
        name,
        phase: phase_word(status.phase),
        object,
        directory: args.output_dir.display().to_string(),
        bundles: results,
    };
    render::print(&format(&view, out))?;
    Ok(if all_ok { Outcome::Ok } else { Outcome::Failed })
}

fn phase_word(phase: Option<Phase>) -> String {
    phase.map_or("Pending".into(), |p| format!("{p:?}"))
}

fn collected_line(n: &NodeBundle) -> String {
    match n.phase {
        Phase::Succeeded => format!("{}: collected, {}", n.node, bytes(n.size_bytes)),
        Phase::Failed => format!("{}: failed: {}", n.node, n.reason),
        other => format!("{}: {other:?}", n.node),
    }
}

fn partial(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".part");
    PathBuf::from(name)
}

/// Streams one bundle to `file` (through `<file>.part`, renamed once its size and sha256 match
/// the status), hashing each chunk as it is written.
async fn download(
    conn: &Connection,
    bundle: &NodeBundle,
    file: &Path,
    live: &mut Live,
) -> Result<(), Error> {
    let response =
        controller_api::send_get(conn, &bundle.download_path, "application/gzip").await?;
    let code = response.status().as_u16();
    let mut body = response.into_body();
    if !(200..300).contains(&code) {
        // An error answer is small; read a bounded prefix to say what it was.
        let mut text = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            if let Ok(data) = frame.into_data() {
                text.extend_from_slice(&data);
            }
            if text.len() > MAX_ERROR_BODY {
                break;
            }
        }
        let text = String::from_utf8_lossy(&text).trim().to_owned();
        return Err(
            match controller_api::classify(&conn.namespace, &conn.server, code, &text) {
                Err(e) => e,
                Ok(Answer::NotFound(message))
                | Ok(Answer::Found(serde_json::Value::String(message))) => {
                    Error::UnexpectedAnswer {
                        what: format!("the bundle of node {}", bundle.node),
                        detail: message,
                    }
                }
                Ok(Answer::Found(_)) => Error::UnexpectedAnswer {
                    what: format!("the bundle of node {}", bundle.node),
                    detail: format!("HTTP {code}"),
                },
            },
        );
    }
    let part = partial(file);
    let write_err = |source| Error::WriteFile {
        path: part.clone(),
        source,
    };
    let mut out = tokio::fs::File::create(&part).await.map_err(write_err)?;
    let mut hasher = Sha256::new();
    let mut written: u64 = 0;
    let mut drawn = Instant::now() - REDRAW;
    let result: Result<(), Error> = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Error::ReachApiServer {
                server: conn.server.clone(),
                detail: format!("the download of node {}'s bundle broke off: {}", bundle.node, chain(&e)),
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            hasher.update(&data);
            out.write_all(&data).await.map_err(write_err)?;
            written += data.len() as u64;
            if drawn.elapsed() >= REDRAW {
                drawn = Instant::now();
                live.show(&bar(&bundle.node, written, bundle.size_bytes), &[]);
            }
        }
        out.flush().await.map_err(write_err)?;
        out.sync_all().await.map_err(write_err)?;
        let sha = hex::encode(hasher.finalize());
        if written != bundle.size_bytes || sha != bundle.sha256 {
            return Err(Error::UnexpectedAnswer {
                what: format!("the bundle of node {}", bundle.node),
                detail: format!(
                    "{written} bytes with sha256 {sha}, but the status says {} bytes with sha256 {}; the file was not kept",
                    bundle.size_bytes, bundle.sha256
                ),
            });
        }
        tokio::fs::rename(&part, file)
            .await
            .map_err(|source| Error::WriteFile {
                path: file.to_owned(),
                source,
            })
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&part).await;
    }
    result
}

/// `worker-1  [##########----------]  1.2 MiB / 2.4 MiB`.
fn bar(node: &str, done: u64, total: u64) -> String {
    const WIDTH: u64 = 24;
    let filled = (done.min(total) * WIDTH)
        .checked_div(total)
        .unwrap_or(WIDTH);
    let filled = usize::try_from(filled).unwrap_or(0);
    format!(
        "{node}  [{}{}]  {} / {}",
        "#".repeat(filled),
        "-".repeat(WIDTH as usize - filled),
        bytes(done),
        bytes(total)
    )
}

/// Bytes as a person reads them: `512 B`, `12.3 KiB`, `4.0 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Renders the result for `out`'s format.
pub fn format(view: &DiagView, out: &Output) -> String {
    if let Some(text) = out.structured(view) {
        return text;
    }
    let failed = view.bundles.iter().filter(|b| !b.verified).count();
    let object = match view.object.as_str() {
        "deleted" => format!(
            "{}/{} (deleted with its bundles on the controller; --keep keeps it)",
            view.namespace, view.name
        ),
        _ => format!(
            "{}/{} (kept: kubectl -n {} get nodediagnostic {})",
            view.namespace, view.name, view.namespace, view.name
        ),
    };
    let (word, color) = if failed == 0 {
        ("Succeeded", Some(Color::Green))
    } else {
        ("Failed", Some(Color::Red))
    };
    let facts = vec![
        ("NodeDiagnostic", object),
        (
            "Result",
            format!(
                "{} ({} nodes, {} downloaded and verified, {failed} failed)",
                out.paint(word, color),
                view.bundles.len(),
                view.bundles.len() - failed
            ),
        ),
        ("Directory", view.directory.clone()),
    ];
    let mut text = render::key_values(&facts);
    let mut t = Table::new(&["NODE", "RESULT", "SIZE", "SHA256", "FILE OR REASON"]);
    for b in &view.bundles {
        let sha = if b.sha256.is_empty() {
            "-".to_owned()
        } else if out.wide() {
            b.sha256.clone()
        } else {
            b.sha256.chars().take(12).collect()
        };
        t.row(vec![
            b.node.as_str().into(),
            if b.verified {
                Cell {
                    text: "verified".into(),
                    color: Some(Color::Green),
                }
            } else {
                Cell {
                    text: "failed".into(),
                    color: Some(Color::Red),
                }
            },
            if b.size_bytes > 0 {
                bytes(b.size_bytes)
            } else {
                "-".into()
            }
            .into(),
            sha.into(),
            b.file.clone().unwrap_or_else(|| b.reason.clone()).into(),
        ]);
    }
    text.push_str(&render::section(out, "BUNDLES", &t.render_or_empty(out)));
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command, OutputFormat};
    use clap::Parser as _;

    pub(crate) fn sample() -> DiagView {
        DiagView {
            namespace: "nodekeeper".into(),
            name: "diag-x7k2q".into(),
            phase: "Failed".into(),
            object: "deleted".into(),
            directory: ".".into(),
            bundles: vec![
                BundleResult {
                    node: "worker-1".into(),
                    phase: "Succeeded".into(),
                    size_bytes: 48_213,
                    sha256: "4f2a9c0d1e7b3a5566778899aabbccddeeff00112233445566778899aabbccdd"
                        .into(),
                    verified: true,
                    file: Some("./diag-x7k2q-worker-1.tar.gz".into()),
                    reason: String::new(),
                },
                BundleResult {
                    node: "worker-3".into(),
                    phase: "Failed".into(),
                    size_bytes: 0,
                    sha256: String::new(),
                    verified: false,
                    file: None,
                    reason: "agent unreachable: connection refused".into(),
                },
            ],
        }
    }

    #[test]
    fn piped_output_matches_the_golden_file() {
        crate::golden::check(
            "diag",
            &format(&sample(), &Output::plain(OutputFormat::Table)),
        );
        let v: serde_json::Value =
            serde_json::from_str(&format(&sample(), &Output::plain(OutputFormat::Json))).unwrap();
        assert_eq!(v["bundles"][0]["file"], "./diag-x7k2q-worker-1.tar.gz");
        assert_eq!(v["bundles"][1]["verified"], false);
    }

    #[test]
    fn sizes_and_the_bar_read_well() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(48_213), "47.1 KiB");
        assert_eq!(bytes(5 * 1024 * 1024), "5.0 MiB");
        assert_eq!(
            bar("n1", 512, 1024),
            "n1  [############------------]  512 B / 1.0 KiB"
        );
        assert_eq!(bar("n1", 0, 0), "n1  [########################]  0 B / 0 B");
    }

    #[test]
    fn flags_parse() {
        let cli = Cli::try_parse_from([
            "kubectl-nodekeeper",
            "diag",
            "n1",
            "n2",
            "-O",
            "/tmp/x",
            "--parts",
            "report,sysctl",
        ])
        .unwrap();
        let Command::Diag(args) = cli.command else {
            panic!()
        };
        assert_eq!(args.nodes, ["n1", "n2"]);
        assert_eq!(args.output_dir, PathBuf::from("/tmp/x"));
        assert_eq!(args.parts, ["report", "sysctl"]);
    }
}
