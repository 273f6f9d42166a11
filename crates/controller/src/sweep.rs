//! The fleet sweep (leader only): every node's agent is read on its jittered schedule with
//! bounded concurrency, per-call timeouts and backoff; rules are pushed by revision; and a
//! node's conditions are patched only when they change.
//!
//! Each call runs as its own task with its own timeout, so a slow or silent agent holds one
//! concurrency slot for at most `callTimeout` and never delays any other node.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use nodekeeper_model::tuning::{self, RuleSet};
use nodekeeper_proto::agent::v1 as pb;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::Context;
use crate::agent_client::{self, CallError, CallLimits};
use crate::conditions::{self, Observation, Written};
use crate::fleet::Job;
use crate::metrics::{CallOutcome, OutcomeLabels, ResultLabels, WriteResult};
use crate::view::NodeView;

/// How often the sweep looks for due nodes. Due times are spread over the interval, so a tick
/// of one second only bounds how late a read may start.
const TICK: Duration = Duration::from_millis(500);

/// Runs the sweep until cancelled.
pub async fn run(ctx: Arc<Context>) {
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut initial_done = false;
    let mut last_interval = ctx.tuning().config.sweep_interval;
    loop {
        let ticked = tokio::select! {
            () = ctx.cancel.cancelled() => break,
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
        for job in ctx.fleet.take_due(now, room, ctx.settings.agent_port) {
            let ctx = Arc::clone(&ctx);
            tasks.spawn(async move { poll(&ctx, job).await });
        }
        ctx.metrics
            .calls_in_flight
            .set(i64::try_from(tasks.len()).unwrap_or(i64::MAX));

        if !initial_done && ctx.fleet.synced() {
            let summary = ctx.fleet.summary();
            let reachable = summary.nodes - summary.without_internal_ip;
            ctx.metrics
                .nodes_read_once
                .set(i64::try_from(summary.read).unwrap_or(i64::MAX));
            if summary.read >= reachable && reachable > 0 {
                initial_done = true;
                let seconds = started.elapsed().as_secs_f64();
                ctx.metrics.initial_sweep_seconds.set(seconds);
                info!(nodes = summary.read, seconds, "first full sweep done");
            }
        }
    }
    tasks.shutdown().await;
}

/// Reads one node's agent and acts on the answer.
async fn poll(ctx: &Context, job: Job) {
    let started = Instant::now();
    let tuning = ctx.tuning();
    let limits = CallLimits {
        timeout: tuning.config.call_timeout,
        max_reply_bytes: ctx.settings.max_reply_bytes,
    };
    let result = call_agent(
        ctx,
        &job,
        limits,
        &tuning.config.rules,
        tuning.config.features.tunables,
    )
    .await;
    ctx.metrics
        .agent_call_seconds
        .observe(started.elapsed().as_secs_f64());
    let outcome = match &result {
        Ok((None, _)) => CallOutcome::Unchanged,
        Ok((Some(_), _)) => CallOutcome::Report,
        Err(e) => e.outcome,
    };
    ctx.metrics
        .agent_calls
        .get_or_create(&OutcomeLabels { outcome })
        .inc();

    let now = Instant::now();
    let interval = tuning.config.sweep_interval;
    let features = tuning.config.features;
    let unit: f64 = rand::random();
    // Decide under the lock, write without it.
    let write = {
        let mut nodes = ctx.fleet.lock();
        let Some(entry) = nodes.get_mut(&job.name) else {
            return;
        };
        let desired = match result {
            Ok((view, rules_refused)) => {
                entry.schedule.succeeded(now, interval, unit);
                if let Some(view) = view {
                    entry.report = Some(Arc::new(view));
                }
                if let Some(revision) = rules_refused {
                    entry.rules_refused = revision;
                }
                if entry.stale {
                    info!(node = %job.name, "agent answers again");
                }
                entry.stale = false;
                entry.last_failure = None;
                entry.report.as_deref().and_then(|view| {
                    conditions::desired_conditions(
                        Observation::Fresh(view),
                        &features,
                        &entry.written,
                    )
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
                let class = error.class();
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
                    conditions::desired_conditions(observation, &features, &entry.written)
                } else {
                    None
                }
            }
        };
        desired
            .filter(|desired| conditions::changed(&entry.written, desired))
            .map(|desired| (desired, entry.written.clone()))
    };
    if let Some((desired, current)) = write {
        patch_conditions(ctx, &job.name, &current, &desired).await;
    }
}

/// Connects, reads the report, and pushes the rules when the agent holds another revision.
/// Returns the new view (None when unchanged) and the rules revision the agent refused, if any.
async fn call_agent(
    ctx: &Context,
    job: &Job,
    limits: CallLimits,
    rules: &RuleSet,
    push_rules: bool,
) -> Result<(Option<NodeView>, Option<u64>), CallError> {
    let tls = ctx.agent_tls();
    let mut conn = agent_client::connect(&tls, job.endpoint, limits).await?;
    let invalid = |e: crate::view::InvalidReport| CallError {
        outcome: CallOutcome::InvalidReply,
        endpoint: job.endpoint,
        detail: e.to_string(),
    };
    let reply = conn.get_report(job.cached_revision.unwrap_or(0)).await?;
    let mut view = NodeView::from_reply(&job.name, reply, job.cached_revision).map_err(invalid)?;
    let agent_rules = view
        .as_ref()
        .map(|v| v.rules_revision)
        .or(job.agent_rules_revision)
        .unwrap_or(0);
    let wanted = rules.revision();
    let mut refused = None;
    // An agent that already holds the revision is not called; nor is one that refused it.
    if push_rules && agent_rules != wanted && job.rules_refused != wanted {
        match conn.set_rules(set_rules_request(rules, wanted)).await {
            Ok(_) => {
                ctx.metrics
                    .set_rules_calls
                    .get_or_create(&ResultLabels {
                        result: WriteResult::Ok,
                    })
                    .inc();
                // The agent's report changes with its rules: fetch it now rather than a sweep later.
                let since = view
                    .as_ref()
                    .map(|v| v.revision)
                    .or(job.cached_revision)
                    .unwrap_or(0);
                let reply = conn.get_report(since).await?;
                if let Some(fresh) =
                    NodeView::from_reply(&job.name, reply, Some(since)).map_err(invalid)?
                {
                    view = Some(fresh);
                }
            }
            Err(error) => {
                ctx.metrics
                    .set_rules_calls
                    .get_or_create(&ResultLabels {
                        result: WriteResult::Error,
                    })
                    .inc();
                warn!(node = %job.name, %error, revision = wanted, "agent refused or failed SetRules");
                if error.outcome == CallOutcome::Status {
                    // Refused on its merits (INVALID_ARGUMENT): pushing the same set again would
                    // be refused again.
                    refused = Some(wanted);
                }
            }
        }
    }
    Ok((view, refused))
}

/// The `SetRules` request for a rule set.
pub fn set_rules_request(rules: &RuleSet, revision: u64) -> pb::SetRulesRequest {
    use nodekeeper_model::tuning::{Comparison, Severity};
    pb::SetRulesRequest {
        revision,
        rules: rules
            .tunables
            .iter()
            .map(|r| pb::TunableRule {
                name: r.name.clone(),
                key: r.key.clone(),
                comparison: match r.comparison {
                    Comparison::Equal => pb::Comparison::Equal,
                    Comparison::AtLeast => pb::Comparison::AtLeast,
                    Comparison::AtMost => pb::Comparison::AtMost,
                    Comparison::OneOf => pb::Comparison::OneOf,
                } as i32,
                values: r.values.clone(),
                repair: r.repair,
                repair_max_per_hour: r.repair_max_per_hour,
                severity: match r.severity {
                    Severity::Warning => pb::Verdict::Warning,
                    Severity::Critical => pb::Verdict::Critical,
                } as i32,
            })
            .collect(),
        thresholds: rules
            .thresholds
            .iter()
            .map(|t| pb::IndicatorThreshold {
                indicator: t.indicator.clone(),
                warning: t.warning,
                critical: t.critical,
            })
            .collect(),
    }
}

/// Writes a node's nodekeeper conditions with server-side apply and records what was written.
async fn patch_conditions(
    ctx: &Context,
    name: &str,
    current: &[Written],
    desired: &[conditions::Condition],
) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let body = conditions::apply_body(name, current, desired, &now);
    let api: Api<Node> = Api::all(ctx.client.clone());
    let params = PatchParams::apply(conditions::FIELD_MANAGER).force();
    match api.patch_status(name, &params, &Patch::Apply(&body)).await {
        Ok(node) => {
            ctx.metrics
                .condition_patches
                .get_or_create(&ResultLabels {
                    result: WriteResult::Ok,
                })
                .inc();
            let facts = crate::fleet::node_facts(&node);
            info!(node = %name, conditions = ?desired.iter().map(|c| format!("{}={}/{}", c.type_, c.status.as_str(), c.reason)).collect::<Vec<_>>(), "conditions changed");
            ctx.fleet.observe(facts, Instant::now());
        }
        Err(error) => {
            ctx.metrics
                .condition_patches
                .get_or_create(&ResultLabels {
                    result: WriteResult::Error,
                })
                .inc();
            // Nothing recorded: the difference remains and the next read retries the write.
            warn!(node = %name, %error, "patching node conditions failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn rules_request_carries_every_field() {
        let data: BTreeMap<String, String> = [(
            "rules.yaml".to_string(),
            "tunables:\n  - {name: a, key: net.core.somaxconn, atLeast: 4096, severity: critical, repairMaxPerHour: 3}\nthresholds:\n  - {indicator: 'disk.*', warning: 70, critical: 80}\n".to_string(),
        )]
        .into();
        let config = tuning::parse(&data).unwrap();
        let revision = config.rules.revision();
        let req = set_rules_request(&config.rules, revision);
        assert_eq!(req.revision, revision);
        assert_eq!(req.rules[0].comparison, pb::Comparison::AtLeast as i32);
        assert_eq!(req.rules[0].values, vec!["4096".to_string()]);
        assert_eq!(req.rules[0].severity, pb::Verdict::Critical as i32);
        assert_eq!(req.rules[0].repair_max_per_hour, 3);
        assert!(!req.rules[0].repair);
        assert_eq!(req.thresholds[0].indicator, "disk.*");
    }
}
