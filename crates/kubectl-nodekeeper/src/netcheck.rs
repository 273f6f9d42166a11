//! `netcheck`: creates a NetworkTest from the command line, follows it to the end (a live line on
//! a terminal), prints the summary and the failing pairs, and deletes the test unless `--keep` —
//! also when interrupted. Nothing is created when a check before it fails (controller not
//! reachable, selector matching no node, bad target).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use nodekeeper_api::crd::network_test::{NetworkTestStatus, Phase};
use nodekeeper_api::crd::{NetworkTest, NetworkTestSpec};
use nodekeeper_api::names;
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};

use crate::Outcome;
use crate::connect::Connection;
use crate::controller_api;
use crate::error::Error;
use crate::render::{self, Cell, Output, Table};

/// How often the test's status is read while waiting.
const POLL: Duration = Duration::from_millis(500);
/// A test this command deletes itself still gets a TTL, so one left behind by a killed process
/// (SIGKILL, lost connection) is removed by the controller within this many seconds.
const BACKSTOP_TTL_SECONDS: u32 = 600;
/// Label on the tests this command creates.
pub const CREATED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "kubectl-nodekeeper");

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// ICMP echo.
    Icmp,
    /// TCP connect (give --port, or host:port targets).
    Tcp,
    /// DNS query of hostname targets.
    Dns,
    /// HTTP(S) GET of URL targets.
    Http,
    /// Path-MTU discovery.
    Mtu,
}

impl Kind {
    fn spec_word(self) -> &'static str {
        match self {
            Kind::Icmp => "icmp",
            Kind::Tcp => "tcp",
            Kind::Dns => "dns",
            Kind::Http => "http",
            Kind::Mtu => "pathMtu",
        }
    }
}

#[derive(Debug, clap::Args)]
#[command(after_help = "\
Targets:
  peers | peers:N          other nodes of the test (N per node; default target: peers)
  apiserver | metadata     the API server / metadata service, as the controller is configured
                           (tcp: at the API server's own port; icmp/mtu need the controller's
                           --api-server-address, as the default kubernetes Service answers TCP only)
  10.0.0.1 | [fd00::1]     an address
  host:port                a TCP endpoint (--kind tcp)
  https://host/path        a URL (--kind http)
  name.example             a DNS name (--kind dns queries it; other kinds resolve and probe it)

Examples:
  kubectl nodekeeper netcheck
  kubectl nodekeeper netcheck -l pool=gpu peers:8 10.0.0.10
  kubectl nodekeeper netcheck --kind tcp apiserver
  kubectl nodekeeper netcheck --kind http https://registry.example/v2/
  kubectl nodekeeper netcheck --kind mtu peers --keep -o json")]
pub struct Args {
    /// Label selector of the nodes that run the probes (kubectl syntax). Default: every node
    /// the controller manages.
    #[arg(short = 'l', long, env = "NODEKEEPER_SELECTOR", default_value = "")]
    pub selector: String,
    /// The probe.
    #[arg(long, env = "NODEKEEPER_KIND", value_enum, default_value_t = Kind::Icmp)]
    pub kind: Kind,
    /// What to probe (see Targets below). Default: peers.
    pub targets: Vec<String>,
    /// Port for tcp probes of addresses, names and peers.
    #[arg(long, env = "NODEKEEPER_PORT")]
    pub port: Option<u32>,
    /// DNS resolver address for --kind dns. Default: each node's own.
    #[arg(long, env = "NODEKEEPER_RESOLVER")]
    pub resolver: Option<String>,
    /// Probes per target from each node.
    #[arg(long, env = "NODEKEEPER_COUNT")]
    pub count: Option<u32>,
    /// Most nodes that run the probes.
    #[arg(long, env = "NODEKEEPER_MAX_NODES")]
    pub max_nodes: Option<u32>,
    /// Timeout of each probe (e.g. 1s, 500ms).
    #[arg(long, env = "NODEKEEPER_PROBE_TIMEOUT", value_parser = crate::cli::duration)]
    pub probe_timeout: Option<Duration>,
    /// Name of the NetworkTest. Default: `netcheck-` and a random suffix.
    #[arg(long, env = "NODEKEEPER_NAME")]
    pub name: Option<String>,
    /// Keep the NetworkTest afterwards (also when interrupted); the controller deletes it after
    /// its TTL (1h).
    #[arg(long, env = "NODEKEEPER_KEEP")]
    pub keep: bool,
    /// How long to wait for the result before giving up (exit 1).
    #[arg(long, env = "NODEKEEPER_WAIT", default_value = "5m", value_parser = crate::cli::duration)]
    pub wait: Duration,
}

/// The spec the flags ask for (the CRD's defaults fill in the rest).
pub fn spec(args: &Args) -> Result<NetworkTestSpec, Error> {
    let selector = crate::selector::parse(&args.selector)?;
    let words: Vec<String> = if args.targets.is_empty() {
        vec!["peers".to_owned()]
    } else {
        args.targets.clone()
    };
    let targets = words
        .iter()
        .map(|w| crate::targets::parse(w))
        .collect::<Result<Vec<_>, _>>()?;
    let mut spec = json!({
        "nodeSelector": selector,
        "kind": args.kind.spec_word(),
        "targets": targets,
    });
    let set = |spec: &mut serde_json::Value, key: &str, value: serde_json::Value| {
        spec[key] = value;
    };
    if let Some(port) = args.port {
        set(&mut spec, "port", json!(port));
    }
    if let Some(resolver) = &args.resolver {
        set(&mut spec, "resolver", json!(resolver));
    }
    if let Some(count) = args.count {
        set(&mut spec, "count", json!(count));
    }
    if let Some(max_nodes) = args.max_nodes {
        set(&mut spec, "maxNodes", json!(max_nodes));
    }
    if let Some(timeout) = args.probe_timeout {
        let ms = u32::try_from(timeout.as_millis())
            .map_err(|_| Error::InvalidFlags("--probe-timeout is too long".into()))?;
        set(&mut spec, "timeoutMs", json!(ms));
    }
    if !args.keep {
        set(
            &mut spec,
            "ttlSecondsAfterFinished",
            json!(BACKSTOP_TTL_SECONDS),
        );
    }
    serde_json::from_value(spec).map_err(|e| Error::InvalidFlags(e.to_string()))
}

pub async fn run(conn: &Connection, args: &Args, out: &Output) -> Result<Outcome, Error> {
    let spec = spec(args)?;
    // Registered before anything is created, so an interrupt is always ours to handle.
    let mut interrupt = signal(SignalKind::interrupt()).map_err(Error::StartRuntime)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(Error::StartRuntime)?;

    // Checks that would otherwise leave a test waiting forever.
    controller_api::get(conn, "/api/v1/summary").await?;
    let nodes: Api<Node> = Api::all(conn.client.clone());
    let matching = nodes
        .list_metadata(&ListParams::default().labels(&args.selector).limit(1))
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if s.code == 400 => Error::InvalidSelector {
                selector: args.selector.clone(),
                reason: s.message.clone(),
            },
            e => conn.error("list nodes", e),
        })?;
    if matching.items.is_empty() {
        return Err(Error::NoMatchingNodes {
            selector: args.selector.clone(),
        });
    }

    let api: Api<NetworkTest> = Api::namespaced(conn.client.clone(), &conn.namespace);
    let mut object = NetworkTest::new("", spec);
    object.metadata.name = args.name.clone();
    if args.name.is_none() {
        object.metadata.generate_name = Some("netcheck-".into());
    }
    object.metadata.labels = Some(BTreeMap::from([(
        CREATED_BY.0.to_owned(),
        CREATED_BY.1.to_owned(),
    )]));
    let created = api
        .create(&PostParams::default(), &object)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) if matches!(s.code, 400 | 409 | 422) => Error::RefusedNetworkTest {
                namespace: conn.namespace.clone(),
                message: s.message.clone(),
            },
            e => conn.error(
                &format!("create a networktest in namespace {}", conn.namespace),
                e,
            ),
        })?;
    let name = created.metadata.name.clone().unwrap_or_default();
    let id = format!("{}/{name}", conn.namespace);

    let started = Instant::now();
    let mut progress = Progress::new(out.progress);
    let finished = loop {
        let current = tokio::select! {
            _ = interrupt.recv() => None,
            _ = terminate.recv() => None,
            got = api.get_opt(&name) => Some(got),
        };
        let Some(got) = current else {
            progress.clear();
            let what = cleanup(&api, &name, &id, args.keep).await;
            eprintln_quiet(&format!("interrupted; {what}"));
            return Ok(Outcome::Interrupted);
        };
        let nt = match got {
            Ok(Some(nt)) => nt,
            Ok(None) => {
                progress.clear();
                return Err(Error::UnexpectedAnswer {
                    what: format!("networktest {id}"),
                    detail: "it was deleted by someone else before it finished".into(),
                });
            }
            Err(e) => {
                progress.clear();
                let what = cleanup(&api, &name, &id, args.keep).await;
                eprintln_quiet(&what);
                return Err(conn.error(&format!("read networktest {id}"), e));
            }
        };
        let status = nt.status.clone().unwrap_or_default();
        if matches!(status.phase, Some(Phase::Succeeded | Phase::Failed)) {
            break nt;
        }
        if started.elapsed() > args.wait {
            progress.clear();
            let what = cleanup(&api, &name, &id, args.keep).await;
            eprintln_quiet(&format!(
                "networktest {id} did not finish within {} (phase {}); {what}",
                humantime::format_duration(args.wait),
                status.phase.map_or("Pending".into(), |p| format!("{p:?}")),
            ));
            return Ok(Outcome::Failed);
        }
        progress.show(&name, &status, started.elapsed());
        tokio::select! {
            _ = interrupt.recv() => {
                progress.clear();
                let what = cleanup(&api, &name, &id, args.keep).await;
                eprintln_quiet(&format!("interrupted; {what}"));
                return Ok(Outcome::Interrupted);
            }
            _ = terminate.recv() => {
                progress.clear();
                let what = cleanup(&api, &name, &id, args.keep).await;
                eprintln_quiet(&format!("terminated; {what}"));
                return Ok(Outcome::Interrupted);
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    };
    progress.clear();

    // A spec the controller could not turn into probes (a target it is not configured for) is
    // a usage problem, not a network result.
    if let Some(invalid) = finished.status.as_ref().and_then(|s| {
        s.conditions.iter().find(|c| {
            c.type_ == names::CONDITION_SPEC_VALID
                && c.status == nodekeeper_api::crd::common::ConditionStatus::False
        })
    }) {
        return Err(Error::ControllerRefusedNetworkTest {
            id: id.clone(),
            message: invalid.message.clone(),
            disposition: cleanup(&api, &name, &id, args.keep).await,
        });
    }

    let disposition = if args.keep {
        Disposition::Kept
    } else {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Disposition::Deleted,
            Err(e) => Disposition::DeleteFailed(crate::error::chain(&e)),
        }
    };
    let succeeded = finished.status.as_ref().and_then(|s| s.phase) == Some(Phase::Succeeded);
    render::print(&format(&finished, &conn.namespace, &disposition, out))?;
    if let Disposition::DeleteFailed(e) = &disposition {
        eprintln_quiet(&format!(
            "warning: could not delete networktest {id}: {e}; delete it with `kubectl -n {} delete networktest {name}`",
            conn.namespace
        ));
    }
    Ok(if succeeded {
        Outcome::Ok
    } else {
        Outcome::Failed
    })
}

/// Deletes the test unless `keep`; says what became of it.
async fn cleanup(api: &Api<NetworkTest>, name: &str, id: &str, keep: bool) -> String {
    if keep {
        return format!("kept networktest {id} (--keep)");
    }
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => format!("deleted networktest {id}"),
        Err(kube::Error::Api(s)) if s.code == 404 => format!("networktest {id} is already gone"),
        Err(e) => format!(
            "could not delete networktest {id}: {}; the controller removes it {BACKSTOP_TTL_SECONDS}s after it finishes",
            crate::error::chain(&e)
        ),
    }
}

fn eprintln_quiet(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// What became of the test object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Disposition {
    Deleted,
    Kept,
    DeleteFailed(String),
}

/// The live line on stderr, only on a terminal.
struct Progress {
    on: bool,
    frame: usize,
}

impl Progress {
    fn new(on: bool) -> Progress {
        Progress { on, frame: 0 }
    }

    fn show(&mut self, name: &str, status: &NetworkTestStatus, elapsed: Duration) {
        if !self.on {
            return;
        }
        const FRAMES: [char; 4] = ['|', '/', '-', '\\'];
        self.frame = (self.frame + 1) % FRAMES.len();
        let phase = status.phase.map_or("Pending".into(), |p| format!("{p:?}"));
        let nodes = if status.sources > 0 {
            format!(", {} nodes", status.sources)
        } else {
            String::new()
        };
        let _ = write!(
            std::io::stderr().lock(),
            "\r\x1b[2K{} {name}: {phase}{nodes}, {}s",
            FRAMES[self.frame],
            elapsed.as_secs()
        );
    }

    fn clear(&mut self) {
        if self.on {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
        }
    }
}

/// Renders a finished test for `out`'s format.
pub fn format(
    nt: &NetworkTest,
    namespace: &str,
    disposition: &Disposition,
    out: &Output,
) -> String {
    let mut nt = nt.clone();
    nt.metadata.managed_fields = None;
    if let Some(text) = out.structured(&nt) {
        return text;
    }
    let name = nt.metadata.name.clone().unwrap_or_default();
    let s = nt.status.clone().unwrap_or_default();
    let phase = s.phase.map_or("Pending".to_owned(), |p| format!("{p:?}"));
    let object = match disposition {
        Disposition::Deleted => format!("{namespace}/{name} (deleted; --keep keeps it)"),
        Disposition::Kept => {
            format!("{namespace}/{name} (kept: kubectl -n {namespace} get networktest {name})")
        }
        Disposition::DeleteFailed(_) => format!("{namespace}/{name} (not deleted)"),
    };
    let mut facts = vec![
        ("NetworkTest", object),
        ("Kind", nt.spec.kind.as_str().to_owned()),
        ("Result", out.paint(&phase, render::verdict_color(&phase))),
        (
            "Nodes",
            format!("{} ({} unreachable)", s.sources, s.sources_unreachable),
        ),
        (
            "Pairs",
            format!(
                "{}, {} failed{}",
                s.pairs,
                s.pairs_failed,
                s.success_percent
                    .map(|p| format!(" ({} succeeded)", render::percent(p)))
                    .unwrap_or_default()
            ),
        ),
        (
            "Probes",
            format!(
                "{} sent, {} received{}",
                s.sent,
                s.received,
                s.loss_percent
                    .map(|p| format!(" ({} loss)", render::percent(p)))
                    .unwrap_or_default()
            ),
        ),
    ];
    if let Some(l) = s.latency {
        facts.push((
            "Latency",
            format!(
                "p50 {}, p95 {}, max {}",
                render::micros(l.p50_us.into()),
                render::micros(l.p95_us.into()),
                render::micros(l.max_us.into())
            ),
        ));
    }
    if let Some(mtu) = s.path_mtu_min {
        facts.push(("Path MTU", format!("{mtu} bytes (smallest found)")));
    }
    // A test refused by the controller (e.g. a target it is not configured for) says why in a
    // False condition.
    if let Some(c) = s.conditions.iter().find(|c| {
        c.status == nodekeeper_api::crd::common::ConditionStatus::False && !c.message.is_empty()
    }) {
        facts.push(("Message", format!("{}: {}", c.reason, c.message)));
    }
    let mut text = render::key_values(&facts);

    let mtu = nt.spec.kind.as_str() == "pathMtu";
    let mut headers = vec!["TARGET", "PAIRS", "FAILED", "LOSS", "P50", "P95", "MAX"];
    if mtu {
        headers.push("PATH MTU");
    }
    let mut t = Table::new(&headers);
    for target in &s.targets {
        let lat = |f: fn(&nodekeeper_api::crd::network_test::Latency) -> u32| {
            target
                .latency
                .as_ref()
                .map_or("-".to_owned(), |l| render::micros(f(l).into()))
        };
        let failed = if target.pairs_failed > 0 {
            Cell {
                text: target.pairs_failed.to_string(),
                color: Some(render::Color::Red),
            }
        } else {
            Cell::from("0")
        };
        let mut row: Vec<Cell> = vec![
            target.target.as_str().into(),
            target.pairs.to_string().into(),
            failed,
            render::percent(target.loss_percent).into(),
            lat(|l| l.p50_us).into(),
            lat(|l| l.p95_us).into(),
            lat(|l| l.max_us).into(),
        ];
        if mtu {
            row.push(
                target
                    .path_mtu_min
                    .map_or("-".into(), |m| m.to_string())
                    .into(),
            );
        }
        t.row(row);
    }
    let mut body = t.render_or_empty(out);
    if s.targets_omitted > 0 {
        body.push_str(&format!("... and {} more\n", s.targets_omitted));
    }
    text.push_str(&render::section(out, "TARGETS", &body));

    let mut t = Table::new(&["SOURCE", "TARGET", "LOSS", "ERROR"]);
    for f in &s.worst_failures {
        t.row(vec![
            f.source.as_str().into(),
            f.target.as_str().into(),
            Cell {
                text: render::percent(f.loss_percent),
                color: Some(render::Color::Red),
            },
            f.error.as_str().into(),
        ]);
    }
    let mut body = t.render_or_empty(out);
    if s.omitted_failures > 0 {
        body.push_str(&format!(
            "... and {} more (with --keep: kubectl get --raw {}?failedOnly=true)\n",
            s.omitted_failures,
            controller_api::proxy_path(namespace, &format!("/api/networktests/{namespace}/{name}"))
        ));
    }
    text.push_str(&render::section(out, "FAILING PAIRS", &body));
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::OutputFormat;
    use clap::Parser as _;

    fn args(line: &[&str]) -> Args {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: Args,
        }
        Wrap::try_parse_from(std::iter::once("netcheck").chain(line.iter().copied()))
            .unwrap()
            .args
    }

    /// Every example of the help is a command that works: it parses into a spec, and none sends
    /// `--port` with `apiserver` (the API server target takes its own port; a port given for it
    /// would have dialled the kubernetes Service on a port it does not serve).
    #[test]
    fn help_examples_are_valid_commands() {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: Args,
        }
        let help = <Wrap as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        let examples: Vec<Vec<&str>> = help
            .lines()
            .filter_map(|l| l.trim().strip_prefix("kubectl nodekeeper netcheck"))
            .map(|rest| rest.split_whitespace().collect())
            .collect();
        assert!(examples.len() >= 5, "{help}");
        for mut words in examples {
            // `-o` is the plugin's global output flag, not one of netcheck's.
            if let Some(i) = words.iter().position(|w| *w == "-o") {
                words.drain(i..i + 2);
            }
            spec(&args(&words)).unwrap_or_else(|e| panic!("{words:?}: {e}"));
            assert!(
                !(words.contains(&"apiserver") && words.contains(&"--port")),
                "{words:?}"
            );
        }
    }

    #[test]
    fn flags_become_the_spec_with_crd_defaults_for_the_rest() {
        let spec = spec(&args(&[
            "-l", "pool=gpu", "--kind", "tcp", "--port", "443", "10.0.0.1", "peers:2",
        ]))
        .unwrap();
        assert_eq!(spec.kind.as_str(), "tcp");
        assert_eq!(spec.port, Some(443));
        assert_eq!(spec.node_selector.to_query(), "pool=gpu");
        assert_eq!(spec.targets.len(), 2);
        assert_eq!(spec.count, 3, "the CRD's default");
        assert_eq!(spec.ttl_seconds_after_finished, BACKSTOP_TTL_SECONDS);
        let spec = spec_of(&["--kind", "mtu", "--keep"]);
        assert_eq!(spec.kind.as_str(), "pathMtu");
        assert_eq!(spec.targets[0].peers.as_ref().map(|p| p.per_node), Some(3));
        assert_eq!(
            spec.ttl_seconds_after_finished, 3600,
            "--keep leaves the CRD's TTL"
        );
    }

    fn spec_of(line: &[&str]) -> NetworkTestSpec {
        spec(&args(line)).unwrap()
    }

    #[test]
    fn bad_selectors_and_targets_stop_before_anything_is_sent() {
        let e = spec(&args(&["-l", "a in b"])).unwrap_err().to_string();
        assert!(e.starts_with("invalid selector"), "{e}");
        let e = spec(&args(&["ftp://x"])).unwrap_err().to_string();
        assert!(e.starts_with("invalid target \"ftp://x\""), "{e}");
    }

    fn sample() -> NetworkTest {
        let mut nt = NetworkTest::new(
            "netcheck-x7k2q",
            spec_of(&["--kind", "icmp", "peers:2", "10.0.9.9"]),
        );
        nt.status = Some(serde_json::from_value(json!({
            "phase": "Failed", "sources": 3, "sourcesUnreachable": 0, "pairs": 9, "pairsFailed": 3,
            "successPercent": 66.66666, "sent": 27, "received": 18, "lossPercent": 33.33333,
            "latency": {"p50Us": 85, "p95Us": 240, "maxUs": 1300},
            "targets": [
                {"target": "10.0.9.9", "pairs": 3, "pairsFailed": 3, "lossPercent": 100.0},
                {"target": "peers", "pairs": 6, "pairsFailed": 0, "lossPercent": 0.0,
                 "latency": {"p50Us": 85, "p95Us": 240, "maxUs": 1300}}
            ],
            "worstFailures": [
                {"source": "worker-1", "target": "10.0.9.9", "error": "timed out", "lossPercent": 100.0},
                {"source": "worker-2", "target": "10.0.9.9", "error": "timed out", "lossPercent": 100.0}
            ],
            "omittedFailures": 1
        })).unwrap());
        nt
    }

    #[test]
    fn piped_output_matches_the_golden_file() {
        let text = format(
            &sample(),
            "nodekeeper",
            &Disposition::Deleted,
            &Output::plain(OutputFormat::Table),
        );
        crate::golden::check("netcheck", &text);
    }

    #[test]
    fn json_output_is_the_object() {
        let text = format(
            &sample(),
            "nodekeeper",
            &Disposition::Kept,
            &Output::plain(OutputFormat::Json),
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["kind"], "NetworkTest");
        assert_eq!(v["status"]["pairsFailed"], 3);
    }
}
