//! The fleet sweep (leader only): every node's agent is read on its jittered schedule with
//! bounded concurrency, per-call timeouts and backoff; rules are pushed by revision; a node's
//! conditions are patched only when they change (one apply per node per read at most); and the
//! node's new temporary problems and problem conditions' transitions become Node Events within
//! the node's hourly budget, in the same write task.
//!
//! Each call runs as its own task with its own timeout, so a slow or silent agent holds one
//! concurrency slot for at most `callTimeout` and never delays any other node. The call itself
//! (report, and the rules push on the same connection) goes through the agents service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use nodekeeper_model::tuning::{self, RuleSet};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Context;
use super::problems::{self, NewProblems};
use crate::conditions::{self, Observation, TransitionKind, Written};
use crate::shared::agent_client::{CallError, CallOutcome};
use crate::shared::agents::{AgentNode, ReportRequest, RulesOutcome, RulesPush};
use crate::shared::fleet::{Job, RulesNews, RulesRefusal};
use crate::shared::metrics::{
    EventLabels, EventResult, OutcomeLabels, PatchLabels, PatchResult, ResultLabels, WriteResult,
};
use crate::shared::writers::Writers;
use crate::view::{NodeView, StoredReport};

/// How often the sweep looks for due nodes. Due times are spread over the interval, so a tick
/// of one second only bounds how late a read may start.
const TICK: Duration = Duration::from_millis(500);

/// Condition writes running at once, apart from the reads' `concurrency`: well under
/// kube-apiserver's default 200 mutating requests in flight, so other writers keep room.
const WRITE_CONCURRENCY: usize = 64;

/// Condition writes queued or running at most. A queued write holds its conditions (a few KiB);
/// past this many, a read waits to hand its write over (see `Writers`).
const WRITE_QUEUE: usize = 1024;

/// How often `nodekeeper_sweep_nodes_read` is recounted after the first full sweep (a pass
/// over the fleet under its lock; before it, every tick).
const PROGRESS_EVERY: Duration = Duration::from_secs(15);

/// How long the sweep waits for the tuning ConfigMap's first read before it starts anyway.
const TUNING_SETTLE: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs the sweep until cancelled.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    // No node is judged by the placeholder defaults: the rules pushed to agents and the
    // conditions written follow the tuning ConfigMap from the first read on (a new leader
    // that swept before reading it would push an empty rule set and rewrite every node's
    // TunablesInBounds, then rewrite it back).
    let mut tuning = ctx.tuning.clone();
    tokio::select! {
        () = shutdown.cancelled() => return,
        settled = tokio::time::timeout(TUNING_SETTLE, tuning.wait_for(|t| t.settled)) => {
            if settled.is_err() {
                warn!(
                    waited_s = TUNING_SETTLE.as_secs(),
                    "the tuning ConfigMap was not read in time; sweeping with the default settings, without pushing rules or rewriting TunablesInBounds"
                );
            }
        }
    }
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut initial_done = false;
    let mut last_progress = started;
    let mut last_interval = ctx.tuning().config.sweep_interval;
    let writers = Writers::new(WRITE_CONCURRENCY, WRITE_QUEUE, shutdown.child_token());
    loop {
        let ticked = tokio::select! {
            () = shutdown.cancelled() => break,
            _ = ticker.tick() => true,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => false,
        };
        while tasks.try_join_next().is_some() {}
        let config = ctx.tuning().config.clone();
        let now = Instant::now();
        if config.sweep_interval < last_interval {
            for entry in ctx.fleet.lock().values_mut() {
                entry.schedule.clamp_to(now, config.sweep_interval);
            }
        }
        last_interval = config.sweep_interval;

        let room = config.concurrency.saturating_sub(tasks.len());
        // Looking for due nodes scans the fleet; after a completed call, do it only once a
        // sixteenth of the slots are free (the tick refills whatever is left).
        if !ticked && room < (config.concurrency / 16).max(1) {
            continue;
        }
        let jobs = ctx.fleet.take_due(now, room, ctx.agent_port);
        // Fewer nodes due than slots free: the first pass may be ending.
        let short = jobs.len() < room;
        for job in jobs {
            let (ctx, writers) = (Arc::clone(&ctx), writers.clone());
            tasks.spawn(async move { poll(&ctx, &writers, job).await });
        }
        ctx.metrics
            .calls_in_flight
            .set(i64::try_from(tasks.len()).unwrap_or(i64::MAX));

        // A count, not `Fleet::summary` (conditions and tunables of every node, under the
        // fleet's lock), which made a 65,000-node sweep wait on it. Still a pass over the fleet,
        // so made on the tick and once nodes are due no more, not after every completed call
        // while a start's whole fleet is still waiting to be read; after the first full sweep,
        // only every `PROGRESS_EVERY` (for `nodes_read`).
        let progress_due = if initial_done {
            ticked && now.saturating_duration_since(last_progress) >= PROGRESS_EVERY
        } else {
            ticked || short
        };
        if progress_due && ctx.fleet.synced() {
            last_progress = now;
            let progress = ctx.fleet.read_progress();
            ctx.metrics
                .nodes_read_once
                .set(i64::try_from(progress.read).unwrap_or(i64::MAX));
            if !initial_done && progress.first_sweep_done() {
                initial_done = true;
                let seconds = started.elapsed().as_secs_f64();
                ctx.metrics.initial_sweep_seconds.set(seconds);
                info!(
                    nodes = progress.called,
                    answered = progress.read,
                    seconds,
                    "first full sweep done"
                );
            }
        }
    }
    tasks.shutdown().await;
    writers.drain().await;
}

/// Reads one node's agent and acts on the answer.
async fn poll(ctx: &Arc<Context>, writers: &Writers, job: Job) {
    let started = Instant::now();
    let tuning = ctx.tuning();
    let (result, rules_news) = call_agent(
        ctx,
        &job,
        tuning.config.call_timeout,
        tuning.rules_to_push(),
    )
    .await;
    ctx.metrics
        .agent_call_seconds
        .observe(started.elapsed().as_secs_f64());
    let outcome = match &result {
        Ok(None) => CallOutcome::Unchanged,
        Ok(Some(_)) => CallOutcome::Report,
        Err(e) => e.outcome,
    };
    ctx.metrics
        .agent_calls
        .get_or_create(&OutcomeLabels { outcome })
        .inc();

    let now = Instant::now();
    let interval = tuning.config.sweep_interval;
    let config = &tuning.config;
    let unit: f64 = rand::random();
    let mut fresh_view: Option<Arc<NodeView>> = None;
    // The report the conditions are judged on: this read's, or the stored one when the agent
    // answered "unchanged".
    let mut judged: Option<Arc<NodeView>> = None;
    // Decide under the lock, write without it.
    let write = {
        let mut nodes = ctx.fleet.lock();
        let Some(entry) = nodes.get_mut(&job.name) else {
            return;
        };
        // Whatever became of the report: an agent that took the rules and then did not answer
        // the report that followed still took them.
        ctx.metrics
            .nodes_refusing_rules
            .inc_by(entry.note_rules(rules_news));
        let desired = match result {
            Ok(view) => {
                entry.schedule.succeeded(now, interval, unit);
                if let Some(view) = view {
                    let view = Arc::new(view);
                    entry.report = Some(StoredReport::of(&view));
                    fresh_view = Some(view);
                }
                judged = fresh_view
                    .clone()
                    .or_else(|| entry.report.as_ref().map(|r| Arc::new(r.view())));
                if entry.last_failure.is_some() {
                    ctx.metrics.nodes_unreachable.dec();
                    info!(node = %job.name, "agent answers again");
                }
                entry.stale = false;
                entry.last_failure = None;
                judged
                    .as_deref()
                    .and_then(|view| {
                        conditions::desired_conditions(
                            Observation::Fresh(view),
                            config,
                            &entry.written,
                        )
                    })
                    .map(|mut desired| {
                        if !tuning.good {
                            hold_tunables_condition(&mut desired, &entry.written);
                        }
                        desired
                    })
            }
            Err(error) => {
                entry.schedule.failed(now, interval, unit);
                debug!(node = %job.name, %error, failures = entry.schedule.failures, "agent call failed");
                let stale = entry.schedule.is_stale(now, tuning.config.stale_after);
                if stale && !entry.stale {
                    warn!(node = %job.name, %error, stale_after = %tuning::format_duration(tuning.config.stale_after), "agent is stale");
                }
                entry.stale = stale;
                let class = conditions::stale_class(error.class(), &entry.written);
                if entry.last_failure.is_none() {
                    // Visible at once in the summary, the gauge and the log; the Node condition
                    // waits for staleAfter so that one missed call does not flip it (README,
                    // "Dead agents").
                    ctx.metrics.nodes_unreachable.inc();
                    warn!(node = %job.name, %error, stale_after = %tuning::format_duration(tuning.config.stale_after), "agent unreachable; the node's condition turns False if it stays so for staleAfter");
                }
                entry.last_failure = Some((error.outcome, error.to_string()));
                if stale {
                    // A stale node's last report no longer describes it.
                    entry.report = None;
                    let address = job.endpoint.to_string();
                    let observation = Observation::Stale {
                        address: &address,
                        class,
                        stale_after: tuning.config.stale_after,
                    };
                    conditions::desired_conditions(observation, config, &entry.written)
                } else {
                    None
                }
            }
        };
        // Types the agent's own rules declare: their turning True is already in its counts.
        let agent_types: Vec<String> = judged
            .as_deref()
            .map(|r| {
                r.problems
                    .conditions
                    .iter()
                    .map(|c| c.type_.clone())
                    .collect()
            })
            .unwrap_or_default();
        // Types another writer keeps alive on this Node (node-problem-detector during a
        // migration) are left to it: written by both, each write would undo the other's.
        let desired = desired.map(|mut desired| {
            if let Some(foreign) = entry.foreign.as_deref() {
                desired.retain(|c| !foreign.contains(&c.type_));
            }
            desired
        });
        desired
            .filter(|desired| conditions::changed(&entry.written, desired))
            .map(|desired| (desired, entry.written.clone(), agent_types))
    };
    let new = match &fresh_view {
        Some(view) => ctx.problems.observe(
            &job.name,
            view,
            config.features.problems,
            &ctx.problem_metrics.totals,
        ),
        None => NewProblems::default(),
    };
    if write.is_none() && new.events.is_empty() {
        return;
    }
    let NewProblems { events, cursor } = new;
    // Handed to the writer pool: this read's slot is free for the next read now. The API
    // calls' futures are boxed when they start, so that a queued write holds only what it
    // will send, not room for a request in flight.
    let task = {
        let (ctx, name) = (Arc::clone(ctx), job.name.clone());
        async move {
            if let Some((desired, current, agent_types)) = write
                && Box::pin(patch_conditions(&ctx, &name, &current, &desired, interval)).await
            {
                for t in conditions::transitions(&current, &desired) {
                    if t.kind == TransitionKind::Problem && !agent_types.contains(&t.type_) {
                        ctx.problem_metrics.totals.add(&t.reason, 1);
                    }
                    Box::pin(publish(&ctx, &name, &problems::transition_event(&t))).await;
                }
            }
            for problem in &events {
                Box::pin(publish(&ctx, &name, &problems::temporary_event(problem))).await;
            }
        }
    };
    // A write for this node still pending drops this one; the problems stay unhandled and the
    // next read offers them again.
    if writers.submit(&job.name, task).await
        && let Some(cursor) = cursor
    {
        ctx.problems.commit(&job.name, cursor);
    }
}

/// Keeps the node's `TunablesInBounds` as written (or absent) while no good tuning configuration
/// has been read since start: the rules the agent holds are then not the controller's to judge
/// by, and a refused ConfigMap must not rewrite the condition on every node.
fn hold_tunables_condition(desired: &mut Vec<conditions::Condition>, current: &[Written]) {
    desired.retain(|c| c.type_ != conditions::TUNABLES_IN_BOUNDS);
    desired.extend(
        current
            .iter()
            .find(|w| w.condition.type_ == conditions::TUNABLES_IN_BOUNDS)
            .map(|w| w.condition.clone()),
    );
    desired.sort_by(|a, b| a.type_.cmp(&b.type_));
}

/// True when a failed `SetRules` is the agent refusing the rules on their merits
/// (`INVALID_ARGUMENT`): pushing the same set again would be refused again, so the revision is
/// recorded as refused and not pushed until it changes. Any other failure (a timeout, a broken
/// connection, `INTERNAL` when the agent could not save its state) is transient and retried on
/// the next read.
fn refused_on_merits(error: &CallError) -> bool {
    // The agent client writes a status's code first in the detail (`InvalidArgument: …`).
    error.outcome == CallOutcome::Status
        && error
            .detail
            .strip_prefix(&format!("{:?}", tonic::Code::InvalidArgument))
            .is_some_and(|rest| rest.starts_with(':'))
}

/// Writes one Node Event if the node's hourly budget allows; counts it either way.
async fn publish(ctx: &Context, node: &str, event: &kube::runtime::events::Event) {
    let budget = ctx.tuning().config.problems.events_per_node_per_hour;
    let result = if !ctx.problems.admit(node, Instant::now(), budget) {
        debug!(node = %node, reason = %event.reason, budget, "node event over the hourly budget; not written");
        EventResult::Suppressed
    } else {
        match ctx
            .recorder
            .publish(event, &problems::node_reference(node))
            .await
        {
            Ok(()) => EventResult::Emitted,
            Err(error) => {
                warn!(node = %node, reason = %event.reason, %error, "writing a node event failed");
                EventResult::Failed
            }
        }
    };
    ctx.problem_metrics
        .events
        .get_or_create(&EventLabels { result })
        .inc();
}

/// Reads the report through the agents service, pushing `rules` (None: none) when the agent holds
/// another revision. Returns the new view (None when unchanged) and, whether or not the report
/// came, what became of the push.
async fn call_agent(
    ctx: &Context,
    job: &Job,
    timeout: Duration,
    rules: Option<&RuleSet>,
) -> (Result<Option<NodeView>, CallError>, RulesNews) {
    let node = AgentNode {
        name: job.name.clone(),
        endpoint: job.endpoint,
    };
    let request = ReportRequest {
        cached_revision: job.cached_revision,
        rules: rules.map(|rules| RulesPush {
            rules,
            known_agent_revision: job.agent_rules_revision,
            refused_revision: job.rules_refused,
        }),
    };
    let report = ctx.agents.report(&node, request, timeout).await;
    let mut news = RulesNews::Nothing;
    match report.rules {
        RulesOutcome::NotPushed => {}
        // The ConfigMap is back at the revision the agent kept: nothing is refused any more.
        RulesOutcome::Held(_) => news = RulesNews::Accepted,
        RulesOutcome::Applied(_) => {
            news = RulesNews::Accepted;
            ctx.metrics
                .set_rules_calls
                .get_or_create(&ResultLabels {
                    result: WriteResult::Ok,
                })
                .inc();
        }
        RulesOutcome::Failed(revision, error) => {
            ctx.metrics
                .set_rules_calls
                .get_or_create(&ResultLabels {
                    result: WriteResult::Error,
                })
                .inc();
            warn!(node = %job.name, %error, revision, "agent refused or failed SetRules");
            if refused_on_merits(&error) {
                news = RulesNews::Refused(RulesRefusal {
                    revision,
                    error: error.detail.clone(),
                });
            }
        }
    }
    (report.view, news)
}

/// Writes a node's nodekeeper conditions with server-side apply and records what was written.
/// True when the write landed.
async fn patch_conditions(
    ctx: &Context,
    name: &str,
    current: &[Written],
    desired: &[conditions::Condition],
    interval: Duration,
) -> bool {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let body = conditions::apply_body(name, current, desired, &now);
    let api: Api<Node> = Api::all(ctx.client.clone());
    let params = PatchParams::apply(conditions::FIELD_MANAGER).force();
    match api.patch_status(name, &params, &Patch::Apply(&body)).await {
        Ok(node) => {
            ctx.conditions
                .patches
                .get_or_create(&PatchLabels {
                    result: PatchResult::Ok,
                })
                .inc();
            if let Some(entry) = ctx.fleet.lock().get_mut(name) {
                entry.schedule.write_succeeded();
            }
            let facts = crate::shared::fleet::node_facts(&node);
            info!(node = %name, conditions = ?desired.iter().map(|c| format!("{}={}/{}", c.type_, c.status.as_str(), c.reason)).collect::<Vec<_>>(), "conditions changed");
            ctx.fleet.observe_written(facts, Instant::now());
            true
        }
        Err(error) => {
            let result = PatchResult::of(&error);
            ctx.conditions
                .patches
                .get_or_create(&PatchLabels { result })
                .inc();
            // Nothing recorded: the difference remains, and the node is read again within
            // seconds (with backoff), which writes it again. A write that timed out but landed
            // shows up through the Node watch first and is not repeated.
            let retry = ctx
                .fleet
                .lock()
                .get_mut(name)
                .map(|entry| entry.schedule.write_failed(Instant::now(), interval));
            warn!(node = %name, %error, class = ?result, retry_in = ?retry, "patching node conditions failed; retrying");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conditions::{Condition, Status, reason};
    use crate::shared::agents::{Agents, DiagnosticsStream, Report};
    use crate::shared::{Fleet, TuningState};
    use futures::future::BoxFuture;
    use nodekeeper_proto::agent::v1 as pb;

    fn condition(type_: &str, status: Status, reason: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// A failed call as the agent client reports a gRPC status (code first in the detail).
    fn status_error(status: &tonic::Status) -> CallError {
        CallError {
            outcome: CallOutcome::Status,
            endpoint: "127.0.0.1:9443".parse().unwrap(),
            detail: format!("{:?}: {}", status.code(), status.message()),
        }
    }

    /// Regression: an agent that could not save its state answered INTERNAL, and the revision
    /// was recorded as refused for good, never pushed to that node again.
    #[test]
    fn only_invalid_argument_records_a_refusal() {
        assert!(refused_on_merits(&status_error(
            &tonic::Status::invalid_argument("rule \"a\" (#1): field `key`: is empty")
        )));
        for transient in [
            tonic::Status::internal("save /var/lib/nodekeeper/rules.json: No space left on device"),
            tonic::Status::unavailable("shutting down"),
            tonic::Status::failed_precondition("InvalidArgument: not yet"),
        ] {
            assert!(
                !refused_on_merits(&status_error(&transient)),
                "{transient:?}"
            );
        }
        let timeout = CallError {
            outcome: CallOutcome::Timeout,
            ..status_error(&tonic::Status::invalid_argument("x"))
        };
        assert!(!refused_on_merits(&timeout));
    }

    /// Agents that answer each report call with the next scripted [`Report`].
    struct ScriptedAgents(std::sync::Mutex<Vec<Report>>);

    fn not_scripted(node: &AgentNode) -> CallError {
        CallError {
            outcome: CallOutcome::NotManaged,
            endpoint: node.endpoint,
            detail: "not scripted".into(),
        }
    }

    impl Agents for ScriptedAgents {
        fn report<'a>(
            &'a self,
            _: &'a AgentNode,
            _: ReportRequest<'a>,
            _: Duration,
        ) -> BoxFuture<'a, Report> {
            let report = self.0.lock().unwrap().remove(0);
            Box::pin(async move { report })
        }

        fn run_probes<'a>(
            &'a self,
            node: &'a AgentNode,
            _: pb::RunProbesRequest,
            _: Duration,
        ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>> {
            Box::pin(async move { Err(not_scripted(node)) })
        }

        fn apply_network<'a>(
            &'a self,
            node: &'a AgentNode,
            _: pb::ApplyNetworkRequest,
            _: Duration,
        ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>> {
            Box::pin(async move { Err(not_scripted(node)) })
        }

        fn collect_diagnostics<'a>(
            &'a self,
            node: &'a AgentNode,
            _: pb::DiagnosticsRequest,
            _: Duration,
        ) -> BoxFuture<'a, Result<DiagnosticsStream, CallError>> {
            Box::pin(async move { Err(not_scripted(node)) })
        }
    }

    /// Regression: a refusal stayed recorded (in the summary, the gauge and the alert) after the
    /// ConfigMap went back to the rules the agent had kept, and when the report after a taken
    /// push failed.
    #[tokio::test]
    async fn a_refusal_ends_when_the_agent_holds_or_takes_the_rules() {
        use crate::shared::fleet::NodeFacts;
        let fleet = Arc::new(Fleet::default());
        fleet.observe(
            NodeFacts {
                name: "w1".into(),
                address: Some("127.0.0.1".parse().unwrap()),
                resource_version: 1,
                written: vec![],
                foreign: vec![],
            },
            Instant::now(),
        );
        let endpoint: std::net::SocketAddr = "127.0.0.1:9443".parse().unwrap();
        let refused = || Report {
            view: Ok(None),
            rules: RulesOutcome::Failed(
                7,
                status_error(&tonic::Status::invalid_argument(
                    "rule \"a\" (#1): key net.nope: no such sysctl",
                )),
            ),
        };
        let script = vec![
            refused(),
            // The ConfigMap went back to revision 5, which the agent kept.
            Report {
                view: Ok(None),
                rules: RulesOutcome::Held(5),
            },
            refused(),
            // Revision 8 taken, and the report after it lost.
            Report {
                view: Err(CallError {
                    outcome: CallOutcome::Connect,
                    endpoint,
                    detail: "connection reset".into(),
                }),
                rules: RulesOutcome::Applied(8),
            },
        ];
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap()))
                .unwrap();
        let metrics = crate::shared::Metrics::new(&mut Default::default());
        let (_keep, tuning) = tokio::sync::watch::channel(Arc::new(TuningState::absent()));
        let ctx = Arc::new(Context {
            recorder: kube::runtime::events::Recorder::new(
                client.clone(),
                kube::runtime::events::Reporter {
                    controller: "test".into(),
                    instance: None,
                },
            ),
            client,
            agents: Arc::new(ScriptedAgents(std::sync::Mutex::new(script))),
            fleet: Arc::clone(&fleet),
            tuning,
            agent_port: endpoint.port(),
            metrics: metrics.sweep,
            conditions: metrics.conditions,
            problem_metrics: metrics.problems,
            problems: problems::Problems::new(0),
        });
        let writers = Writers::new(1, 1, CancellationToken::new());
        let refusing = || {
            let refusal = fleet.lock()["w1"].rules_refusal.clone();
            (
                refusal.map(|r| r.revision),
                ctx.metrics.nodes_refusing_rules.get(),
            )
        };
        let job = || Job {
            name: "w1".into(),
            endpoint,
            cached_revision: None,
            agent_rules_revision: None,
            rules_refused: fleet.lock()["w1"].refused_revision(),
        };
        poll(&ctx, &writers, job()).await;
        assert_eq!(refusing(), (Some(7), 1));
        poll(&ctx, &writers, job()).await;
        assert_eq!(refusing(), (None, 0), "the agent holds the wanted revision");
        poll(&ctx, &writers, job()).await;
        assert_eq!(refusing(), (Some(7), 1));
        poll(&ctx, &writers, job()).await;
        assert_eq!(refusing(), (None, 0), "the agent took the rules");
    }

    #[test]
    fn tunables_in_bounds_is_held_as_written() {
        let written = |c: Condition| Written {
            condition: c,
            last_transition_time: None,
        };
        let out = condition(
            conditions::TUNABLES_IN_BOUNDS,
            Status::False,
            reason::TUNABLES_OUT_OF_BOUNDS,
            "somaxconn: 128, want >= 4096",
        );
        let reachable = condition(
            conditions::REACHABLE,
            Status::True,
            reason::AGENT_REACHABLE,
            "the nodekeeper agent answers",
        );
        let judged = || {
            vec![
                reachable.clone(),
                condition(
                    conditions::TUNABLES_IN_BOUNDS,
                    Status::True,
                    reason::TUNABLES_IN_BOUNDS,
                    "no rules",
                ),
            ]
        };
        let mut desired = judged();
        hold_tunables_condition(&mut desired, &[written(out.clone())]);
        assert_eq!(desired, vec![reachable.clone(), out]);
        // Not written yet: not written now either.
        let mut desired = judged();
        hold_tunables_condition(&mut desired, &[]);
        assert_eq!(desired, vec![reachable]);
    }
}
