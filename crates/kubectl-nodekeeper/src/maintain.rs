//! `maintain`: cordons or drains named nodes through a `NodeMaintenance` — created, or an existing
//! one for exactly those nodes advanced — and follows it node by node, with the pods that block
//! each drain, until it is done; `maintain complete` finishes it (uncordon) and `maintain watch`
//! follows one again. Ctrl-C stops following and leaves the maintenance as it is. Nothing is
//! created when a check before it fails (controller not reachable, unknown node, bad flags).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::common::{ConditionStatus, LabelSelector};
use nodekeeper_api::crd::node_maintenance::{
    BlockReason, MAX_PODS_LISTED, NodeMaintenanceStatus, NodePhase, OnTimeout, Stage,
};
use nodekeeper_api::crd::{NodeMaintenance, NodeMaintenanceSpec};
use nodekeeper_api::names;
use serde_json::json;

use crate::Outcome;
use crate::connect::Connection;
use crate::controller_api;
use crate::error::Error;
use crate::live::{Interrupts, Live, eprint_line};
use crate::named_nodes;
use crate::render::{self, Cell, Color, Output, Table};

/// How often the maintenance is read while following it.
const POLL: Duration = Duration::from_secs(1);
/// The field manager of this plugin's writes.
pub const FIELD_MANAGER: &str = "kubectl-nodekeeper";
/// The `Ready` reason the NodeMaintenance controller writes when it refused the maintenance
/// before touching any node (its own constant lives in the controller crate).
const REASON_REFUSED: &str = "Refused";
/// After this long without a status for the current generation, say that the controller is
/// not acting on it (and keep waiting).
const QUIET_CONTROLLER: Duration = Duration::from_secs(60);

#[derive(Debug, clap::Args)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "\
Examples:
  kubectl nodekeeper maintain worker-7                   # cordon worker-7 and wait until it is
  kubectl nodekeeper maintain worker-7 --drain           # then drain it (the same NodeMaintenance)
  kubectl nodekeeper maintain worker-7 worker-8 --drain --timeout 30m --on-timeout proceed
  kubectl nodekeeper maintain watch worker-7             # follow it again after Ctrl-C
  kubectl nodekeeper maintain complete worker-7          # uncordon and finish
  kubectl nodekeeper maintain complete --name maint-x7k2q

Ctrl-C stops following and leaves the NodeMaintenance as it is; the line printed says how to
resume. Exit codes: 0 done, 1 a node's drain failed (timed out with --on-timeout fail), 2 not
done (unknown node, controller not reachable, refused), 130 interrupted."
)]
pub struct Args {
    #[command(subcommand)]
    pub action: Option<Action>,
    #[command(flatten)]
    pub start: StartArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Finishes a maintenance: stage Complete uncordons its nodes; follows until they are
    /// released.
    Complete(Which),
    /// Follows a maintenance again (after Ctrl-C or --no-wait) until its stage is reached.
    Watch(Which),
}

/// Which maintenance: the one for exactly these nodes, or one by name.
#[derive(Debug, clap::Args)]
pub struct Which {
    /// The nodes the maintenance was started for (all of them).
    #[arg(
        value_name = "NODES",
        required_unless_present = "name",
        conflicts_with = "name"
    )]
    pub nodes: Vec<String>,
    /// The NodeMaintenance's name instead (`kubectl get nodemaintenances`).
    #[arg(long, env = "NODEKEEPER_MAINTENANCE")]
    pub name: Option<String>,
    /// Do not follow: change the stage and return.
    #[arg(long, env = "NODEKEEPER_NO_WAIT")]
    pub no_wait: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnTimeoutArg {
    /// Stop evicting, keep the node cordoned, report it failed (exit 1).
    Fail,
    /// Count the node drained and report the pods left.
    Proceed,
    /// Delete the remaining pods, bypassing PodDisruptionBudgets.
    ForceDelete,
}

impl OnTimeoutArg {
    fn spec(self) -> OnTimeout {
        match self {
            OnTimeoutArg::Fail => OnTimeout::Fail,
            OnTimeoutArg::Proceed => OnTimeout::Proceed,
            OnTimeoutArg::ForceDelete => OnTimeout::ForceDelete,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct StartArgs {
    /// The nodes to maintain (as in `kubectl get nodes`).
    #[arg(value_name = "NODES", required = true)]
    pub nodes: Vec<String>,
    /// Drain the nodes too (evict their pods, honouring PodDisruptionBudgets); without it they
    /// are only cordoned.
    #[arg(long, env = "NODEKEEPER_DRAIN")]
    pub drain: bool,
    /// How long one node's drain may take (e.g. 30m, 2h; at most 168h). Default: 1h.
    #[arg(long, env = "NODEKEEPER_DRAIN_TIMEOUT", value_parser = crate::cli::duration)]
    pub timeout: Option<Duration>,
    /// What happens when a node's drain times out. Default: fail.
    #[arg(long, env = "NODEKEEPER_ON_TIMEOUT", value_enum)]
    pub on_timeout: Option<OnTimeoutArg>,
    /// Most nodes draining at once. Default: 1.
    #[arg(long, env = "NODEKEEPER_MAX_CONCURRENT")]
    pub max_concurrent: Option<u32>,
    /// Evict pods that no controller recreates (bare pods) too; otherwise they block.
    #[arg(long, env = "NODEKEEPER_ALLOW_STANDALONE_PODS")]
    pub allow_standalone_pods: bool,
    /// Allow a selection the controller refuses by default (every node, every control-plane
    /// node, more than maintenance.maxSelectedNodes).
    #[arg(long, env = "NODEKEEPER_ALLOW_BROAD_SELECTION")]
    pub allow_broad_selection: bool,
    /// Why the nodes are maintained (shown in the nodes' MaintenanceInProgress condition).
    #[arg(long, env = "NODEKEEPER_REASON")]
    pub reason: Option<String>,
    /// Name of the NodeMaintenance. Default: the unfinished one that selects exactly these
    /// nodes, else a new `maint-…`.
    #[arg(long, env = "NODEKEEPER_MAINTENANCE")]
    pub name: Option<String>,
    /// Do not follow: create or advance the maintenance and return.
    #[arg(long, env = "NODEKEEPER_NO_WAIT")]
    pub no_wait: bool,
}

pub async fn run(conn: &Connection, args: &Args, out: &Output) -> Result<Outcome, Error> {
    let mut interrupts = Interrupts::register()?;
    match &args.action {
        None => start(conn, &args.start, out, &mut interrupts).await,
        Some(Action::Complete(which)) => {
            controller_api::get(conn, "/api/v1/summary").await?;
            let api = api(conn);
            let nm = find(&api, conn, which).await?;
            let name = nm.name_any();
            if nm.spec.stage != Stage::Complete {
                patch(
                    &api,
                    conn,
                    &name,
                    json!({"spec": {"stage": Stage::Complete}}),
                )
                .await?;
            }
            follow_or_return(
                conn,
                &api,
                &name,
                false,
                which.no_wait,
                out,
                &mut interrupts,
            )
            .await
        }
        Some(Action::Watch(which)) => {
            controller_api::get(conn, "/api/v1/summary").await?;
            let api = api(conn);
            let name = find(&api, conn, which).await?.name_any();
            follow(conn, &api, &name, false, out, &mut interrupts).await
        }
    }
}

fn api(conn: &Connection) -> Api<NodeMaintenance> {
    Api::all(conn.client.clone())
}

/// The spec the flags ask for (the CRD's defaults fill in the rest), checked as the controller
/// will check it, with the flag named.
pub fn spec(args: &StartArgs, selector: LabelSelector) -> Result<NodeMaintenanceSpec, Error> {
    let mut spec = json!({
        "nodeSelector": selector,
        "stage": if args.drain { Stage::Drain } else { Stage::Cordon },
        "allowStandalonePods": args.allow_standalone_pods,
        "allowBroadSelection": args.allow_broad_selection,
    });
    for (key, value) in options(args)? {
        spec[key] = value;
    }
    let spec: NodeMaintenanceSpec =
        serde_json::from_value(spec).map_err(|e| Error::InvalidFlags(e.to_string()))?;
    if let Err(errors) = spec.validate() {
        let flag = |field: &str| match field {
            "spec.drainTimeout" => " (--timeout)",
            _ => "",
        };
        let text: Vec<String> = errors
            .iter()
            .map(|e| format!("{}{}: {}", e.field, flag(&e.field), e.message))
            .collect();
        return Err(Error::InvalidFlags(text.join("; ")));
    }
    Ok(spec)
}

/// The optional flags that were given, as spec fields: applied on create, and patched onto an
/// existing maintenance.
fn options(args: &StartArgs) -> Result<Vec<(&'static str, serde_json::Value)>, Error> {
    let mut set = Vec::new();
    if let Some(timeout) = args.timeout {
        set.push(("drainTimeout", json!(duration_word(timeout)?)));
    }
    if let Some(on_timeout) = args.on_timeout {
        set.push(("onTimeout", json!(on_timeout.spec())));
    }
    if let Some(n) = args.max_concurrent {
        set.push(("maxConcurrentNodes", json!(n)));
    }
    if let Some(reason) = &args.reason {
        set.push(("reason", json!(reason)));
    }
    Ok(set)
}

/// A duration in the spec's syntax (`90m`, `45s`, `1500ms`).
fn duration_word(d: Duration) -> Result<String, Error> {
    let ms = d.as_millis();
    if ms == 0 {
        return Err(Error::InvalidFlags(
            "--timeout must be longer than zero, e.g. 30m".into(),
        ));
    }
    Ok(if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1_000) {
        format!("{}s", ms / 1_000)
    } else {
        format!("{ms}ms")
    })
}

fn stage_rank(stage: Stage) -> u8 {
    match stage {
        Stage::Idle => 0,
        Stage::Cordon => 1,
        Stage::Drain => 2,
        Stage::Complete => 3,
    }
}

async fn start(
    conn: &Connection,
    args: &StartArgs,
    out: &Output,
    interrupts: &mut Interrupts,
) -> Result<Outcome, Error> {
    // Everything that can be refused is checked before anything is written.
    if args.nodes.iter().any(|n| n.is_empty()) {
        return Err(Error::InvalidFlags("a node name is empty".into()));
    }
    spec(args, hostname_placeholder())?;
    controller_api::get(conn, "/api/v1/summary").await?;
    let nodes = named_nodes::resolve(conn, &args.nodes).await?;
    let selector = named_nodes::selector(&nodes)?;
    let spec = spec(args, selector.clone())?;
    let names = named_nodes::names_of(&selector).unwrap_or_default();
    let api = api(conn);

    let existing = match &args.name {
        Some(name) => api
            .get_opt(name)
            .await
            .map_err(|e| conn.error(&format!("get nodemaintenance {name}"), e))?,
        None => by_nodes(&api, conn, &names).await?,
    };
    let (name, created) = match existing {
        Some(nm) => {
            let name = nm.name_any();
            if nm.spec.stage == Stage::Complete {
                return Err(Error::MaintenanceFinished { name });
            }
            if named_nodes::names_of(&nm.spec.node_selector).as_ref() != Some(&names) {
                return Err(Error::MaintenanceSelectsOtherNodes {
                    name,
                    selector: nm.spec.node_selector.to_query(),
                });
            }
            let mut fields = serde_json::Map::new();
            if stage_rank(spec.stage) > stage_rank(nm.spec.stage) {
                fields.insert("stage".into(), json!(spec.stage));
            } else if spec.stage != nm.spec.stage {
                eprint_line(&format!(
                    "nodemaintenance {name} is already at stage {:?}; following it (it is not set back)",
                    nm.spec.stage
                ));
            }
            for (key, value) in options(args)? {
                fields.insert(key.into(), value);
            }
            if args.allow_standalone_pods {
                fields.insert("allowStandalonePods".into(), json!(true));
            }
            if args.allow_broad_selection {
                fields.insert("allowBroadSelection".into(), json!(true));
            }
            if !fields.is_empty() {
                patch(&api, conn, &name, json!({ "spec": fields })).await?;
            }
            (name, false)
        }
        None => {
            let mut object = NodeMaintenance::new("", spec);
            object.metadata.name = args.name.clone();
            if args.name.is_none() {
                object.metadata.generate_name = Some("maint-".into());
            }
            object.metadata.labels = Some(BTreeMap::from([(
                crate::netcheck::CREATED_BY.0.to_owned(),
                crate::netcheck::CREATED_BY.1.to_owned(),
            )]));
            let created = api
                .create(
                    &PostParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..PostParams::default()
                    },
                    &object,
                )
                .await
                .map_err(|e| match e {
                    kube::Error::Api(s) if matches!(s.code, 400 | 409 | 422) => Error::Refused {
                        what: "NodeMaintenance".into(),
                        message: s.message.clone(),
                    },
                    e => conn.error("create a nodemaintenance", e),
                })?;
            (created.name_any(), true)
        }
    };
    follow_or_return(conn, &api, &name, created, args.no_wait, out, interrupts).await
}

fn hostname_placeholder() -> LabelSelector {
    let mut s = LabelSelector::default();
    s.match_labels
        .insert(named_nodes::HOSTNAME_LABEL.into(), "x".into());
    s
}

async fn patch(
    api: &Api<NodeMaintenance>,
    conn: &Connection,
    name: &str,
    body: serde_json::Value,
) -> Result<(), Error> {
    api.patch(
        name,
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Merge(body),
    )
    .await
    .map_err(|e| match e {
        kube::Error::Api(s) if matches!(s.code, 400 | 409 | 422) => Error::Refused {
            what: format!("change to nodemaintenance {name}"),
            message: s.message.clone(),
        },
        e => conn.error(&format!("patch nodemaintenance {name}"), e),
    })?;
    Ok(())
}

/// The unfinished maintenance that selects exactly `names`, if there is one.
async fn by_nodes(
    api: &Api<NodeMaintenance>,
    conn: &Connection,
    names: &[String],
) -> Result<Option<NodeMaintenance>, Error> {
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| conn.error("list nodemaintenances", e))?;
    let mut found: Vec<NodeMaintenance> = list
        .items
        .into_iter()
        .filter(|nm| nm.spec.stage != Stage::Complete)
        .filter(|nm| named_nodes::names_of(&nm.spec.node_selector).as_deref() == Some(names))
        .collect();
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(Error::AmbiguousMaintenance {
            names: found.iter().map(|nm| nm.name_any()).collect(),
        }),
    }
}

/// The maintenance `which` names.
async fn find(
    api: &Api<NodeMaintenance>,
    conn: &Connection,
    which: &Which,
) -> Result<NodeMaintenance, Error> {
    if let Some(name) = &which.name {
        return api
            .get_opt(name)
            .await
            .map_err(|e| conn.error(&format!("get nodemaintenance {name}"), e))?
            .ok_or_else(|| Error::MaintenanceNotFound {
                what: format!("named {name:?}"),
            });
    }
    let mut names = which.nodes.clone();
    names.sort();
    names.dedup();
    by_nodes(api, conn, &names)
        .await?
        .ok_or_else(|| Error::MaintenanceNotFound {
            what: format!("in progress for exactly the nodes {}", names.join(", ")),
        })
}

#[allow(clippy::too_many_arguments)]
async fn follow_or_return(
    conn: &Connection,
    api: &Api<NodeMaintenance>,
    name: &str,
    created: bool,
    no_wait: bool,
    out: &Output,
    interrupts: &mut Interrupts,
) -> Result<Outcome, Error> {
    if !no_wait {
        return follow(conn, api, name, created, out, interrupts).await;
    }
    let nm = api
        .get(name)
        .await
        .map_err(|e| conn.error(&format!("get nodemaintenance {name}"), e))?;
    if let Some(text) = out.structured(&trimmed(&nm)) {
        render::print(&text)?;
    } else {
        render::print(&format!(
            "nodemaintenance {name} {} (stage {:?}); follow it with `{}`\n",
            if created { "created" } else { "updated" },
            nm.spec.stage,
            resume_command("watch", name)
        ))?;
    }
    Ok(Outcome::Ok)
}

/// Where a maintenance stands, as far as following it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No status yet for the current spec.
    Waiting,
    InProgress,
    /// The stage is reached on every node.
    Done,
    /// A node's drain failed and nothing else is moving.
    Failed,
    /// The controller refused it before touching any node.
    Refused(String),
}

pub fn verdict(nm: &NodeMaintenance) -> Verdict {
    let Some(s) = &nm.status else {
        return Verdict::Waiting;
    };
    if s.observed_generation.is_none() || s.observed_generation != nm.metadata.generation {
        return Verdict::Waiting;
    }
    let ready = s
        .conditions
        .iter()
        .find(|c| c.type_ == names::CONDITION_READY);
    match ready {
        None => Verdict::Waiting,
        Some(c) if c.status == ConditionStatus::True => Verdict::Done,
        Some(c) if c.reason == REASON_REFUSED || c.reason == names::REASON_NO_MATCHING_NODES => {
            Verdict::Refused(c.message.clone())
        }
        Some(_)
            if s.failed > 0
                && !s.nodes.iter().any(|n| {
                    matches!(n.phase, NodePhase::Draining)
                        || (n.phase == NodePhase::Cordoned && nm.spec.stage == Stage::Drain)
                }) =>
        {
            Verdict::Failed
        }
        Some(_) => Verdict::InProgress,
    }
}

async fn follow(
    conn: &Connection,
    api: &Api<NodeMaintenance>,
    name: &str,
    created: bool,
    out: &Output,
    interrupts: &mut Interrupts,
) -> Result<Outcome, Error> {
    let started = Instant::now();
    let mut live = Live::new(out);
    let mut warned = false;
    let mut stage = Stage::Idle;
    let leave = |reason: &str, stage: Stage| {
        format!(
            "{reason}; nodemaintenance {name} is left as it is (stage {stage:?}): follow it again with `{}`, finish it with `{}`",
            resume_command("watch", name),
            resume_command("complete", name)
        )
    };
    loop {
        let got = tokio::select! {
            reason = interrupts.recv() => {
                live.clear();
                eprint_line(&leave(reason, stage));
                return Ok(Outcome::Interrupted);
            }
            got = api.get_opt(name) => got,
        };
        let nm = match got {
            Ok(Some(nm)) => nm,
            Ok(None) => {
                live.clear();
                return Err(Error::UnexpectedAnswer {
                    what: format!("nodemaintenance {name}"),
                    detail: "it was deleted by someone else while being followed".into(),
                });
            }
            Err(e) => {
                live.clear();
                // Exit 2 says nothing was created: name what was, and how to go on with it.
                eprint_line(&leave("it could not be read to follow it", stage));
                return Err(conn.error(&format!("read nodemaintenance {name}"), e));
            }
        };
        stage = nm.spec.stage;
        match verdict(&nm) {
            Verdict::Done => {
                live.clear();
                render::print(&format(&nm, &Verdict::Done, &[], out))?;
                return Ok(Outcome::Ok);
            }
            Verdict::Failed => {
                live.clear();
                let left = pods_left(conn, &nm).await;
                render::print(&format(&nm, &Verdict::Failed, &left, out))?;
                return Ok(Outcome::Failed);
            }
            Verdict::Refused(message) => {
                live.clear();
                let disposition = if created {
                    match api.delete(name, &DeleteParams::default()).await {
                        Ok(_) => format!("deleted nodemaintenance {name}; no node was touched"),
                        Err(e) => format!(
                            "could not delete nodemaintenance {name} ({}); no node was touched, delete it with `kubectl delete nodemaintenance {name}`",
                            crate::error::chain(&e)
                        ),
                    }
                } else {
                    format!("nodemaintenance {name} is left as it is")
                };
                // The controller names the spec field; say which flag sets it.
                let message = if message.contains("allowBroadSelection") {
                    format!("{message} (flag --allow-broad-selection)")
                } else {
                    message
                };
                return Err(Error::ControllerRefused {
                    what: format!("nodemaintenance {name}"),
                    message,
                    disposition,
                });
            }
            Verdict::Waiting if !warned && started.elapsed() > QUIET_CONTROLLER => {
                warned = true;
                live.clear();
                eprint_line(&format!(
                    "warning: the controller has not acted on nodemaintenance {name} for {}s; check `kubectl -n {} logs deploy/nodekeeper-controller`",
                    QUIET_CONTROLLER.as_secs(),
                    conn.namespace
                ));
            }
            Verdict::Waiting | Verdict::InProgress => {}
        }
        live.show(
            &format!(
                "{name} (stage {:?}): {}, {}s",
                nm.spec.stage,
                ready_message(&nm).unwrap_or("waiting for the controller"),
                started.elapsed().as_secs()
            ),
            // A status written for an earlier spec (before a stage change) is not shown.
            &progress_lines(nm.status.as_ref().filter(|s| {
                s.observed_generation.is_some() && s.observed_generation == nm.metadata.generation
            })),
        );
        tokio::select! {
            reason = interrupts.recv() => {
                live.clear();
                eprint_line(&leave(reason, stage));
                return Ok(Outcome::Interrupted);
            }
            () = tokio::time::sleep(POLL) => {}
        }
    }
}

fn resume_command(verb: &str, name: &str) -> String {
    format!("kubectl nodekeeper maintain {verb} --name {name}")
}

fn ready_message(nm: &NodeMaintenance) -> Option<&str> {
    nm.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == names::CONDITION_READY)
        .map(|c| c.message.as_str())
        .filter(|m| !m.is_empty())
}

fn phase_word(phase: NodePhase) -> String {
    format!("{phase:?}")
}

fn phase_color(phase: NodePhase) -> Option<Color> {
    match phase {
        NodePhase::Drained | NodePhase::Released => Some(Color::Green),
        NodePhase::Waiting | NodePhase::Cordoned | NodePhase::Draining => Some(Color::Yellow),
        NodePhase::Failed => Some(Color::Red),
    }
}

fn reason_word(reason: BlockReason) -> String {
    format!("{reason:?}")
}

/// `ns/pod (PodDisruptionBudget web)`.
fn blocker(p: &nodekeeper_api::crd::node_maintenance::BlockingPod) -> String {
    match &p.pdb {
        Some(pdb) => format!(
            "{}/{} ({} {pdb})",
            p.namespace,
            p.name,
            reason_word(p.reason)
        ),
        None => format!("{}/{} ({})", p.namespace, p.name, reason_word(p.reason)),
    }
}

/// One line per node: its phase, the pods left and what blocks it. Stable text (no times), so
/// piped output prints a line only when something about that node changed.
pub fn progress_lines(status: Option<&NodeMaintenanceStatus>) -> Vec<String> {
    /// Blocking pods named per line; the rest are counted.
    const NAMED: usize = 3;
    let Some(s) = status else {
        return Vec::new();
    };
    let mut lines: Vec<String> = s
        .nodes
        .iter()
        .map(|n| {
            let mut line = format!("{}: {}", n.node, phase_word(n.phase));
            if matches!(n.phase, NodePhase::Draining | NodePhase::Failed) || n.pods_remaining > 0 {
                line.push_str(&format!(
                    ", {} pod{} left",
                    n.pods_remaining,
                    if n.pods_remaining == 1 { "" } else { "s" }
                ));
            }
            if !n.blocking_pods.is_empty() {
                let named: Vec<String> = n.blocking_pods.iter().take(NAMED).map(blocker).collect();
                let more = n.blocking_pods.len().saturating_sub(NAMED) as u64
                    + u64::from(n.omitted_blocking_pods);
                line.push_str(&format!("; blocked by {}", named.join(", ")));
                if more > 0 {
                    line.push_str(&format!(" and {more} more"));
                }
            }
            if n.phase == NodePhase::Failed && !n.message.is_empty() {
                line.push_str(&format!("; {}", n.message));
            }
            line
        })
        .collect();
    if s.omitted_nodes > 0 {
        lines.push(format!("... and {} more nodes", s.omitted_nodes));
    }
    lines
}

/// A pod still on a failed node, read from the API server: the controller's status lists
/// blocking pods only while a drain is in progress, and names a failed node's leftovers in its
/// message alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftPod {
    pub node: String,
    pub namespace: String,
    pub name: String,
    /// `PodDisruptionBudget` when a budget that allows no disruption selects it, else `NotEvicted`.
    pub reason: String,
    pub pdb: Option<String>,
    pub message: String,
}

/// The pods that must still leave the failed nodes of `nm` (not DaemonSet or mirror pods, not
/// finished), at most [`MAX_PODS_LISTED`] per node, each with the PodDisruptionBudget that holds
/// it. Best effort: without the right to list pods or budgets the result is shorter, and the
/// node's message in the status still names its pods.
async fn pods_left(conn: &Connection, nm: &NodeMaintenance) -> Vec<LeftPod> {
    let Some(status) = &nm.status else {
        return Vec::new();
    };
    let pods: Api<Pod> = Api::all(conn.client.clone());
    let mut budgets: BTreeMap<String, Vec<PodDisruptionBudget>> = BTreeMap::new();
    let mut left = Vec::new();
    for node in status.nodes.iter().filter(|n| n.phase == NodePhase::Failed) {
        let params = ListParams::default().fields(&format!("spec.nodeName={}", node.node));
        let Ok(list) = pods.list(&params).await else {
            continue;
        };
        for pod in list
            .items
            .iter()
            .filter(|p| must_leave(p))
            .take(MAX_PODS_LISTED)
        {
            let namespace = pod.namespace().unwrap_or_default();
            if !budgets.contains_key(&namespace) {
                let api: Api<PodDisruptionBudget> =
                    Api::namespaced(conn.client.clone(), &namespace);
                let found = api.list(&ListParams::default()).await.map(|l| l.items);
                budgets.insert(namespace.clone(), found.unwrap_or_default());
            }
            let holding = budgets[&namespace].iter().find(|b| holds(b, pod));
            left.push(LeftPod {
                node: node.node.clone(),
                namespace,
                name: pod.name_any(),
                reason: if holding.is_some() {
                    "PodDisruptionBudget".into()
                } else {
                    "NotEvicted".into()
                },
                pdb: holding.map(|b| b.name_any()),
                message: "still on the node when its drain timed out".into(),
            });
        }
    }
    left
}

/// Whether a drain has to move `pod`: not a mirror pod, not DaemonSet-owned, not finished.
fn must_leave(pod: &Pod) -> bool {
    let mirror = pod
        .annotations()
        .contains_key("kubernetes.io/config.mirror");
    let daemon = pod
        .owner_references()
        .iter()
        .any(|o| o.kind == "DaemonSet" && o.controller == Some(true));
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    !mirror && !daemon && !finished && pod.metadata.deletion_timestamp.is_none()
}

/// Whether budget `b` selects `pod` and allows no disruption now.
fn holds(b: &PodDisruptionBudget, pod: &Pod) -> bool {
    let allowed = b
        .status
        .as_ref()
        .and_then(|s| s.disruptions_allowed)
        .unwrap_or(0);
    // The budget's selector has the same shape as the CRDs' own.
    let selector: Option<LabelSelector> = b
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .and_then(|v| serde_json::from_value(v).ok());
    allowed == 0 && selector.is_some_and(|s| s.matches(pod.labels()))
}

fn trimmed(nm: &NodeMaintenance) -> NodeMaintenance {
    let mut nm = nm.clone();
    nm.metadata.managed_fields = None;
    nm
}

/// The maintenance as it ended (or stands), for `out`'s format.
pub fn format(nm: &NodeMaintenance, verdict: &Verdict, left: &[LeftPod], out: &Output) -> String {
    if let Some(text) = out.structured(&trimmed(nm)) {
        return text;
    }
    let name = nm.name_any();
    let s = nm.status.clone().unwrap_or_default();
    let nodes = named_nodes::names_of(&nm.spec.node_selector).map_or_else(
        || format!("selector {}", nm.spec.node_selector.to_query()),
        |n| n.join(" "),
    );
    let (result, color) = match verdict {
        Verdict::Done => ("Done", Some(Color::Green)),
        Verdict::Failed => ("Failed", Some(Color::Red)),
        Verdict::Refused(_) => ("Refused", Some(Color::Red)),
        Verdict::InProgress | Verdict::Waiting => ("InProgress", Some(Color::Yellow)),
    };
    let mut result = out.paint(result, color);
    if let Some(message) = ready_message(nm) {
        result.push_str(&format!(" ({message})"));
    }
    let next = match (verdict, nm.spec.stage) {
        (Verdict::Done, Stage::Complete) => "nothing: the nodes are released".to_owned(),
        (Verdict::Done, Stage::Cordon) => format!(
            "drain: kubectl nodekeeper maintain {nodes} --drain; or finish: {}",
            resume_command("complete", &name)
        ),
        (Verdict::Failed, _) => format!(
            "free what blocks (BLOCKING PODS), then {}; or give up and uncordon: {}",
            resume_command("watch", &name),
            resume_command("complete", &name)
        ),
        _ => format!(
            "when the work on the nodes is done: {}",
            resume_command("complete", &name)
        ),
    };
    let mut facts = vec![
        ("NodeMaintenance", name.clone()),
        ("Nodes", nodes.clone()),
        ("Stage", format!("{:?}", nm.spec.stage)),
        ("Result", result),
        (
            "Counts",
            format!(
                "{} selected, {} cordoned, {} drained, {} blocked, {} failed",
                s.matched, s.cordoned, s.drained, s.blocked, s.failed
            ),
        ),
    ];
    if nm.spec.stage == Stage::Drain {
        facts.push((
            "Drain",
            format!(
                "timeout {} (on timeout: {:?}), {} at once",
                nm.spec.drain_timeout, nm.spec.on_timeout, nm.spec.max_concurrent_nodes
            ),
        ));
    }
    facts.push(("Next", next));
    let mut text = render::key_values(&facts);

    let mut t = Table::new(&["NODE", "PHASE", "PODS LEFT", "DRAIN STARTED", "MESSAGE"]);
    for n in &s.nodes {
        t.row(vec![
            n.node.as_str().into(),
            Cell {
                text: phase_word(n.phase),
                color: phase_color(n.phase),
            },
            n.pods_remaining.to_string().into(),
            n.drain_start_time.as_deref().unwrap_or("-").into(),
            n.message.as_str().into(),
        ]);
    }
    let mut body = t.render_or_empty(out);
    if s.omitted_nodes > 0 {
        body.push_str(&format!("... and {} more\n", s.omitted_nodes));
    }
    text.push_str(&render::section(out, "NODES", &body));

    let mut t = Table::new(&["NODE", "POD", "REASON", "PDB", "MESSAGE"]);
    let mut omitted = 0u64;
    for n in &s.nodes {
        omitted += u64::from(n.omitted_blocking_pods);
        for p in &n.blocking_pods {
            t.row(vec![
                n.node.as_str().into(),
                format!("{}/{}", p.namespace, p.name).into(),
                Cell {
                    text: reason_word(p.reason),
                    color: Some(Color::Red),
                },
                p.pdb.as_deref().unwrap_or("-").into(),
                p.message.as_str().into(),
            ]);
        }
    }
    for p in left {
        t.row(vec![
            p.node.as_str().into(),
            format!("{}/{}", p.namespace, p.name).into(),
            Cell {
                text: p.reason.clone(),
                color: Some(Color::Red),
            },
            p.pdb.as_deref().unwrap_or("-").into(),
            p.message.as_str().into(),
        ]);
    }
    let mut body = t.render_or_empty(out);
    if omitted > 0 {
        body.push_str(&format!("... and {omitted} more\n"));
    }
    text.push_str(&render::section(out, "BLOCKING PODS", &body));

    if out.wide() {
        let mut t = Table::new(&["NODE", "POD", "LEFT BECAUSE"]);
        for n in &s.nodes {
            for p in &n.skipped_pods {
                t.row(vec![
                    n.node.as_str().into(),
                    format!("{}/{}", p.namespace, p.name).into(),
                    format!("{:?}", p.reason).into(),
                ]);
            }
        }
        text.push_str(&render::section(
            out,
            "SKIPPED PODS",
            &t.render_or_empty(out),
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command, OutputFormat};
    use clap::Parser as _;

    fn parse(line: &[&str]) -> Args {
        let cli = Cli::try_parse_from(
            ["kubectl-nodekeeper", "maintain"]
                .iter()
                .chain(line.iter())
                .copied(),
        )
        .unwrap_or_else(|e| panic!("{line:?}: {e}"));
        match cli.command {
            Command::Maintain(args) => args,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn verbs_parse_kubectl_style() {
        let a = parse(&["n1", "n2", "--drain", "--timeout", "90m"]);
        assert!(a.action.is_none());
        assert_eq!(a.start.nodes, ["n1", "n2"]);
        assert!(a.start.drain);
        let a = parse(&["complete", "n1"]);
        assert!(matches!(a.action, Some(Action::Complete(w)) if w.nodes == ["n1"]));
        let a = parse(&["watch", "--name", "maint-x"]);
        assert!(matches!(a.action, Some(Action::Watch(w)) if w.name.as_deref() == Some("maint-x")));
        assert!(
            Cli::try_parse_from(["kubectl-nodekeeper", "maintain"]).is_err(),
            "nodes are required"
        );
        assert!(Cli::try_parse_from(["kubectl-nodekeeper", "maintain", "complete"]).is_err());
    }

    #[test]
    fn flags_become_the_spec_and_bad_ones_name_the_flag() {
        let a = parse(&[
            "n1",
            "--drain",
            "--timeout",
            "90m",
            "--on-timeout",
            "force-delete",
        ]);
        let spec = spec(&a.start, hostname_placeholder()).unwrap();
        assert_eq!(spec.stage, Stage::Drain);
        assert_eq!(spec.drain_timeout, "90m");
        assert_eq!(spec.on_timeout, OnTimeout::ForceDelete);
        assert_eq!(spec.max_concurrent_nodes, 1, "the CRD's default");
        let a = parse(&["n1"]);
        let spec = super::spec(&a.start, hostname_placeholder()).unwrap();
        assert_eq!(
            (spec.stage, spec.drain_timeout.as_str()),
            (Stage::Cordon, "1h")
        );
        let a = parse(&["n1", "--timeout", "200h"]);
        let e = super::spec(&a.start, hostname_placeholder())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("spec.drainTimeout (--timeout): must be at most 168h"),
            "{e}"
        );
        assert_eq!(
            duration_word(Duration::from_millis(1500)).unwrap(),
            "1500ms"
        );
        assert_eq!(duration_word(Duration::from_secs(7200)).unwrap(), "2h");
    }

    pub(crate) fn sample(verdict_failed: bool) -> NodeMaintenance {
        let mut nm = NodeMaintenance::new(
            "maint-x7k2q",
            serde_json::from_value(json!({
                "nodeSelector": {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["worker-1", "worker-2"]}]},
                "stage": "Drain", "drainTimeout": "30m"
            }))
            .unwrap(),
        );
        nm.metadata.generation = Some(2);
        let (phase, ready) = if verdict_failed {
            ("Failed", ("False", "InProgress", "1/2 nodes drained"))
        } else {
            ("Draining", ("False", "InProgress", "1/2 nodes drained"))
        };
        nm.status = Some(serde_json::from_value(json!({
            "matched": 2, "cordoned": 2, "drained": 1, "blocked": 1, "failed": if verdict_failed {1} else {0},
            "observedGeneration": 2,
            "nodes": [
                {"node": "worker-2", "phase": phase, "drainStartTime": "2026-11-23T08:00:05Z", "podsRemaining": 2,
                 "message": if verdict_failed {"drain timed out after 30m; 2 pods left"} else {""},
                 "blockingPods": [
                    {"namespace": "shop", "name": "web-5d8f-abcde", "reason": "PodDisruptionBudget", "pdb": "web", "message": "Cannot evict pod as it would violate the pod's disruption budget."},
                    {"namespace": "batch", "name": "report-0", "reason": "WaitingForCompletion"}
                 ]},
                {"node": "worker-1", "phase": "Drained", "drainStartTime": "2026-11-23T08:00:00Z", "podsRemaining": 0,
                 "skippedPods": [{"namespace": "kube-system", "name": "proxy-x", "reason": "DaemonSet"}]}
            ],
            "conditions": [{"type": "Ready", "status": ready.0, "reason": ready.1, "message": ready.2, "lastTransitionTime": "2026-11-23T08:00:00Z"}]
        })).unwrap());
        nm
    }

    #[test]
    fn verdicts_follow_the_status_of_the_current_generation() {
        let nm = sample(false);
        assert_eq!(verdict(&nm), Verdict::InProgress);
        assert_eq!(verdict(&sample(true)), Verdict::Failed);
        let mut stale = sample(false);
        stale.metadata.generation = Some(3);
        assert_eq!(verdict(&stale), Verdict::Waiting);
        let mut refused = sample(false);
        let c = &mut refused.status.as_mut().unwrap().conditions[0];
        c.reason = "Refused".into();
        c.message = "spec.nodeSelector picks every node".into();
        assert!(matches!(verdict(&refused), Verdict::Refused(m) if m.contains("every node")));
        let mut done = sample(false);
        done.status.as_mut().unwrap().conditions[0].status = ConditionStatus::True;
        assert_eq!(verdict(&done), Verdict::Done);
    }

    #[test]
    fn progress_lines_name_the_blocking_pods() {
        let lines = progress_lines(sample(false).status.as_ref());
        assert_eq!(
            lines,
            [
                "worker-2: Draining, 2 pods left; blocked by shop/web-5d8f-abcde (PodDisruptionBudget web), batch/report-0 (WaitingForCompletion)",
                "worker-1: Drained",
            ]
        );
    }

    #[test]
    fn budgets_that_allow_no_disruption_hold_the_pods_they_select() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "labels": {"app": "web"}},
        }))
        .unwrap();
        let budget = |allowed: i32, app: &str| -> PodDisruptionBudget {
            serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"selector": {"matchLabels": {"app": app}}},
                "status": {"disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1},
            }))
            .unwrap()
        };
        assert!(holds(&budget(0, "web"), &pod));
        assert!(!holds(&budget(1, "web"), &pod));
        assert!(!holds(&budget(0, "db"), &pod));
        let mut daemon = pod.clone();
        daemon.metadata.owner_references = Some(vec![serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u", "controller": true
        })).unwrap()]);
        assert!(must_leave(&pod) && !must_leave(&daemon));
    }

    #[test]
    fn piped_output_matches_the_golden_file() {
        let nm = sample(true);
        let left = [LeftPod {
            node: "worker-2".into(),
            namespace: "shop".into(),
            name: "cart-0".into(),
            reason: "PodDisruptionBudget".into(),
            pdb: Some("cart".into()),
            message: "still on the node when its drain timed out".into(),
        }];
        let text = format(
            &nm,
            &verdict(&nm),
            &left,
            &Output::plain(OutputFormat::Table),
        );
        crate::golden::check("maintain", &text);
        let json = format(
            &nm,
            &Verdict::Failed,
            &[],
            &Output::plain(OutputFormat::Json),
        );
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["kind"], "NodeMaintenance");
        assert_eq!(v["status"]["nodes"][0]["blockingPods"][0]["pdb"], "web");
    }
}
