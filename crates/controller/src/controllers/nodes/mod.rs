//! The node sweep, the one controller that is not a watch-reconcile loop (see
//! [`crate::controllers`]): a scheduler over the agents that reads every managed node's agent on
//! its jittered interval ([`sweep`]) and writes the node's conditions only when they change,
//! turns the agents' node problems into Node Events within a per-node budget ([`problems`]), and
//! the per-condition and per-problem gauges computed from the fleet ([`condition_gauges`]). Its
//! input is the fleet kept by the Node watch in [`crate::shared::fleet`]. Nodes that leave
//! `--node-selector` get its conditions taken off ([`unselected`]).

pub mod problems;
pub mod sweep;
pub mod unselected;

use std::sync::Arc;
use std::time::Duration;

use std::collections::{BTreeMap, BTreeSet, HashSet};

use kube::runtime::events::Recorder;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::conditions::{Status, is_problem_type};
use crate::shared::metrics::{ConditionLabels, ConditionMetrics, ProblemMetrics, SweepMetrics};
use crate::shared::{Agents, Fleet, Shared, TuningState};

/// Most distinct condition types in `nodekeeper_conditions_nodes`: problem types are open-ended.
const MAX_CONDITION_LABELS: usize = 128;

/// What the sweep needs.
pub struct Context {
    pub client: kube::Client,
    pub agents: Arc<dyn Agents>,
    pub fleet: Arc<Fleet>,
    pub tuning: watch::Receiver<Arc<TuningState>>,
    /// The agents' gRPC port on each node's InternalIP.
    pub agent_port: u16,
    pub metrics: SweepMetrics,
    pub conditions: ConditionMetrics,
    pub problem_metrics: ProblemMetrics,
    /// Node Events (problems and problem conditions' transitions).
    pub recorder: Recorder,
    pub problems: problems::Problems,
}

impl Context {
    pub fn new(shared: &Shared) -> Self {
        Self {
            client: shared.client.clone(),
            agents: shared.agents(),
            fleet: Arc::clone(&shared.fleet),
            tuning: shared.tuning.clone(),
            agent_port: shared.agent_port,
            metrics: shared.metrics.sweep.clone(),
            conditions: shared.metrics.conditions.clone(),
            problem_metrics: shared.metrics.problems.clone(),
            recorder: shared.recorder(),
            problems: problems::Problems::new(k8s_openapi::jiff::Timestamp::now().as_millisecond()),
        }
    }

    /// The tuning in force.
    pub fn tuning(&self) -> Arc<TuningState> {
        Arc::clone(&self.tuning.borrow())
    }
}

/// Refreshes the per-condition gauges (bounded labels: type × status) until `shutdown`.
pub async fn condition_gauges(ctx: Arc<Context>, shutdown: CancellationToken) {
    let mut published = BTreeSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(15)) => {}
        }
        let summary = ctx.fleet.summary();
        ctx.metrics
            .nodes_stale
            .set(i64::try_from(summary.stale).unwrap_or(i64::MAX));
        // The sweep moves this gauge at once on every change; this recount also corrects it
        // for nodes deleted while unreachable.
        ctx.metrics
            .nodes_unreachable
            .set(i64::try_from(summary.unreachable).unwrap_or(i64::MAX));
        ctx.metrics
            .nodes_refusing_rules
            .set(i64::try_from(summary.refusing_rules).unwrap_or(i64::MAX));
        publish_condition_counts(&ctx.conditions.nodes, &mut published, summary.conditions);
        problem_gauges(&ctx);
    }
}

/// Sets `nodekeeper_conditions_nodes{condition,status}` from the fleet's counts (keys
/// `Type=Status`), at most [`MAX_CONDITION_LABELS`] condition types, and removes only the series
/// `published` last time that are gone now: a scrape never finds the family empty (a
/// clear-then-refill did that, and an alert's `for:` started over).
fn publish_condition_counts(
    family: &prometheus_client::metrics::family::Family<
        ConditionLabels,
        prometheus_client::metrics::gauge::Gauge,
    >,
    published: &mut BTreeSet<(String, String)>,
    counts: impl IntoIterator<Item = (String, usize)>,
) {
    let mut types: BTreeSet<String> = BTreeSet::new();
    let mut now = BTreeSet::new();
    for (key, count) in counts {
        let (condition, status) = key.split_once('=').unwrap_or((key.as_str(), ""));
        if !types.contains(condition) {
            if types.len() >= MAX_CONDITION_LABELS {
                continue;
            }
            types.insert(condition.to_owned());
        }
        family
            .get_or_create(&ConditionLabels {
                condition: condition.into(),
                status: status.into(),
            })
            .set(i64::try_from(count).unwrap_or(i64::MAX));
        now.insert((condition.to_owned(), status.to_owned()));
    }
    for (condition, status) in published.difference(&now) {
        family.remove(&ConditionLabels {
            condition: condition.clone(),
            status: status.clone(),
        });
    }
    *published = now;
}

/// NPD's `problem_gauge{type,reason}` over the fleet: nodes whose problem condition is `True`,
/// as written on the Nodes. Also forgets the problem state of nodes that are gone.
fn problem_gauges(ctx: &Context) {
    let mut gauges: BTreeMap<(String, String), u64> = BTreeMap::new();
    let names: HashSet<String> = {
        let nodes = ctx.fleet.lock();
        for entry in nodes.values() {
            for w in entry.written.iter() {
                let c = &w.condition;
                if is_problem_type(&c.type_) && c.status == Status::True {
                    *gauges
                        .entry((c.type_.clone(), c.reason.clone()))
                        .or_default() += 1;
                }
            }
        }
        nodes.keys().cloned().collect()
    };
    ctx.problem_metrics.totals.set_gauges(&gauges);
    ctx.problems.retain(|name| names.contains(name));
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;

    fn scrape(family: &Family<ConditionLabels, Gauge>) -> Vec<String> {
        let mut registry = Registry::default();
        registry.register("nodes", "help", family.clone());
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("nodes{"))
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    }

    #[test]
    fn condition_counts_replace_only_the_series_that_went() {
        let family = Family::<ConditionLabels, Gauge>::default();
        let mut published = BTreeSet::new();
        let counts = |pairs: &[(&str, usize)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect::<Vec<_>>()
        };
        publish_condition_counts(
            &family,
            &mut published,
            counts(&[("TunablesInBounds=True", 3), ("TunablesInBounds=False", 1)]),
        );
        assert_eq!(
            scrape(&family),
            [
                r#"nodes{condition="TunablesInBounds",status="False"} 1"#,
                r#"nodes{condition="TunablesInBounds",status="True"} 3"#,
            ]
        );
        publish_condition_counts(
            &family,
            &mut published,
            counts(&[("TunablesInBounds=True", 4)]),
        );
        assert_eq!(
            scrape(&family),
            [r#"nodes{condition="TunablesInBounds",status="True"} 4"#]
        );
        publish_condition_counts(&family, &mut published, counts(&[]));
        assert!(scrape(&family).is_empty());
        assert!(published.is_empty());
    }
}
