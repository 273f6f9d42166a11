//! The node sweep, the one controller that is not a watch-reconcile loop (see
//! [`crate::controllers`]): a scheduler over the agents that reads every managed node's agent on
//! its jittered interval ([`sweep`]) and writes the node's conditions only when they change, and
//! the per-condition gauges computed from the fleet ([`condition_gauges`]). Its input is the
//! fleet kept by the Node watch in [`crate::shared::fleet`].

pub mod sweep;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::shared::metrics::{ConditionLabels, ConditionMetrics, SweepMetrics};
use crate::shared::{Agents, Fleet, Shared, TuningState};

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
        }
    }

    /// The tuning in force.
    pub fn tuning(&self) -> Arc<TuningState> {
        Arc::clone(&self.tuning.borrow())
    }
}

/// Refreshes the per-condition gauges (bounded labels: type × status) until `shutdown`.
pub async fn condition_gauges(ctx: Arc<Context>, shutdown: CancellationToken) {
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
        ctx.conditions.nodes.clear();
        for (key, count) in summary.conditions {
            let (condition, status) = key.split_once('=').unwrap_or((key.as_str(), ""));
            ctx.conditions
                .nodes
                .get_or_create(&ConditionLabels {
                    condition: condition.into(),
                    status: status.into(),
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }
}
