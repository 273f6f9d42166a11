//! The agent's host-network manager: serves `ApplyNetwork` (parse, validate, plan, dry-run or
//! apply, check, roll back), remembers the last applied desired state, and runs the drift loop
//! that re-converges what nodekeeper owns and reports drift in `NetworkStatus`.
//!
//! Drift is found by a periodic re-plan (every [`DRIFT_INTERVAL`]): a non-empty plan against the
//! last applied state means something outside nodekeeper changed what it owns (or what it
//! configured on a NIC). A periodic check is chosen over netlink multicast events because it is
//! bounded in cost (one dump of each object type per interval) and cannot miss an event when the
//! socket buffer overflows.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nodekeeper_api::network::{NetworkState, format_errors};
use nodekeeper_api::proto::agent::v1 as pb;
use nodekeeper_netconf::{ApplyOptions, ApplyReport, NetconfError, Netconf, Outcome, PlanError, Target};
use tonic::Status;
use tracing::{info, warn};

use crate::agent::Agent;
use crate::report::NetworkStatus;

/// How often the drift loop re-plans the last applied state.
pub const DRIFT_INTERVAL: Duration = Duration::from_secs(60);
/// At most this many drift lines are reported.
const MAX_DRIFT_LINES: usize = 20;

/// Why an `ApplyNetwork` call was refused. Nothing was changed when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("desired_state_json is not a NetworkState: {0}")]
    ParseDesired(String),
    #[error("desired state refused: {0}")]
    Invalid(String),
    #[error("desired state cannot be planned on this host: {0}")]
    Plan(String),
    #[error("check_targets: {0}")]
    CheckTarget(String),
    #[error("host networking: {0}")]
    Netlink(String),
}

impl From<NetworkError> for Status {
    fn from(e: NetworkError) -> Status {
        match e {
            NetworkError::ParseDesired(_) | NetworkError::Invalid(_) | NetworkError::CheckTarget(_) => {
                Status::invalid_argument(e.to_string())
            }
            NetworkError::Plan(_) => Status::failed_precondition(e.to_string()),
            NetworkError::Netlink(_) => Status::internal(e.to_string()),
        }
    }
}

impl From<NetconfError> for NetworkError {
    fn from(e: NetconfError) -> Self {
        match e {
            NetconfError::Plan(PlanError::Invalid(errs)) => NetworkError::Invalid(format_errors(&errs)),
            NetconfError::Plan(p) => NetworkError::Plan(p.to_string()),
            NetconfError::BadCheckTarget(t) => NetworkError::CheckTarget(t),
            other => NetworkError::Netlink(other.to_string()),
        }
    }
}

struct Applied {
    desired: NetworkState,
    generation: String,
    opts: ApplyOptions,
}

/// One per agent; shared by the gRPC service and the drift loop.
pub struct NetworkManager {
    agent: Weak<Agent>,
    netconf: Netconf,
    /// Serialises applies and drift checks.
    lock: tokio::sync::Mutex<Option<Applied>>,
    status: Mutex<NetworkStatus>,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The manager of `agent`, created on first use (with its drift loop) on the current runtime.
pub fn manager_for(agent: &Arc<Agent>) -> Result<Arc<NetworkManager>, NetworkError> {
    static MANAGERS: Mutex<Option<HashMap<usize, Arc<NetworkManager>>>> = Mutex::new(None);
    let mut all = MANAGERS.lock().unwrap_or_else(PoisonError::into_inner);
    let map = all.get_or_insert_with(HashMap::new);
    map.retain(|_, m| m.agent.strong_count() > 0);
    let key = Arc::as_ptr(agent) as usize;
    if let Some(m) = map.get(&key) {
        return Ok(m.clone());
    }
    let m = Arc::new(NetworkManager::new(agent)?);
    m.spawn_drift_loop(DRIFT_INTERVAL);
    map.insert(key, m.clone());
    Ok(m)
}

impl NetworkManager {
    /// Opens the netlink connection in the calling thread's network namespace.
    pub fn new(agent: &Arc<Agent>) -> Result<Self, NetworkError> {
        Ok(Self {
            agent: Arc::downgrade(agent),
            netconf: Netconf::connect()?,
            lock: tokio::sync::Mutex::new(None),
            status: Mutex::new(NetworkStatus::default()),
        })
    }

    /// The status for the node report.
    pub fn status(&self) -> NetworkStatus {
        self.status.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    async fn publish(&self, f: impl FnOnce(&mut NetworkStatus)) {
        let status = {
            let mut s = self.status.lock().unwrap_or_else(PoisonError::into_inner);
            f(&mut s);
            s.drift.truncate(MAX_DRIFT_LINES);
            s.clone()
        };
        if let Some(agent) = self.agent.upgrade() {
            agent.set_network_status(status).await;
        }
    }

    /// Serves `ApplyNetwork`.
    pub async fn apply(&self, req: pb::ApplyNetworkRequest) -> Result<pb::ApplyNetworkResponse, NetworkError> {
        let desired: NetworkState =
            serde_json::from_str(&req.desired_state_json).map_err(|e| NetworkError::ParseDesired(e.to_string()))?;
        desired.validate().map_err(|e| NetworkError::Invalid(format_errors(&e)))?;
        let check_targets = req
            .check_targets
            .iter()
            .map(|t| t.parse::<Target>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(NetworkError::CheckTarget)?;
        let opts = ApplyOptions {
            dry_run: req.dry_run,
            check_targets,
            check_timeout: Duration::from_millis(if req.check_timeout_ms == 0 { 5000 } else { u64::from(req.check_timeout_ms) }),
            fail_at_step: None,
        };
        let mut applied = self.lock.lock().await;
        let report = match self.netconf.apply(&desired, &opts).await {
            Ok(r) => r,
            Err(e) => {
                let e = NetworkError::from(e);
                if !req.dry_run {
                    let msg = e.to_string();
                    self.publish(|s| s.last_error = msg).await;
                }
                return Err(e);
            }
        };
        info!(generation = %req.generation, outcome = ?report.outcome, steps = report.plan.steps.len(), writes = report.writes, "apply network");
        if !req.dry_run {
            if report.outcome == Outcome::Applied {
                *applied = Some(Applied { desired: desired.clone(), generation: req.generation.clone(), opts });
                let generation = req.generation.clone();
                self.publish(|s| {
                    *s = NetworkStatus { applied_generation: generation, ..NetworkStatus::default() };
                })
                .await;
            } else {
                let msg = report.error.clone().unwrap_or_default();
                self.publish(|s| s.last_error = msg).await;
            }
        }
        let observed = self.netconf.observed_state(&desired).await.map_err(NetworkError::from)?;
        Ok(response(&report, &observed))
    }

    /// Re-plans the last applied state; on drift, records it and (if `reconverge`) applies again.
    pub async fn check_drift(&self, reconverge: bool) -> Result<Vec<String>, NetworkError> {
        let applied = self.lock.lock().await;
        let Some(a) = applied.as_ref() else { return Ok(Vec::new()) };
        let drift = self.netconf.drift(&a.desired).await?;
        if drift.is_empty() {
            return Ok(drift);
        }
        warn!(generation = %a.generation, lines = drift.len(), "network drift");
        let lines = drift.clone();
        self.publish(|s| {
            s.drifted = true;
            s.drift = lines;
        })
        .await;
        if reconverge {
            let report = self.netconf.apply(&a.desired, &a.opts).await?;
            let ok = report.outcome == Outcome::Applied;
            let err = report.error.clone().unwrap_or_default();
            self.publish(|s| {
                if ok {
                    s.reconverged_at_unix_ms = now_ms();
                    s.last_error.clear();
                } else {
                    s.last_error = format!("re-converging drift failed: {err}");
                }
            })
            .await;
        }
        Ok(drift)
    }

    /// Checks for drift every `interval` while the agent lives.
    pub fn spawn_drift_loop(self: &Arc<Self>, interval: Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(m) = weak.upgrade() else { return };
                if m.agent.strong_count() == 0 {
                    return;
                }
                if let Err(error) = m.check_drift(true).await {
                    warn!(%error, "drift check failed");
                }
            }
        });
    }
}

fn response(report: &ApplyReport, observed: &NetworkState) -> pb::ApplyNetworkResponse {
    pb::ApplyNetworkResponse {
        plan: report.plan.steps.iter().map(|s| pb::PlanStep { op: s.op().to_string(), object: s.to_string() }).collect(),
        outcome: match report.outcome {
            Outcome::Planned => pb::ApplyOutcome::Planned,
            Outcome::Applied => pb::ApplyOutcome::Applied,
            Outcome::RolledBack => pb::ApplyOutcome::RolledBack,
            Outcome::RollbackFailed => pb::ApplyOutcome::RollbackFailed,
        } as i32,
        message: report.error.clone().unwrap_or_default(),
        observed_state_json: serde_json::to_string(observed).unwrap_or_default(),
        netlink_writes: u32::try_from(report.writes).unwrap_or(u32::MAX),
    }
}
