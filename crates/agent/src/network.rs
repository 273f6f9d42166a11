//! The agent's host-network manager: serves `ApplyNetwork` (parse, add the OCI secondary-VNIC
//! layout from the configured metadata service when `oci_vnics` asks, validate, plan, dry-run or
//! apply, check, roll back), remembers the last applied desired state, and runs the drift loop
//! that re-converges what nodekeeper owns. It holds the one [`NetworkStatus`] the report shows,
//! and says which interfaces nodekeeper manages. One manager per agent, built with it; the drift
//! loop is a task under the agent's shutdown token.
//!
//! An apply cut short (the agent killed or the node restarted between two netlink steps) must not
//! leave the host between two states. Before the first step of every apply that changes
//! something, the manager journals, in `<state-dir>/network.json`, what the host has of
//! everything the apply can change ([`nodekeeper_netconf::restore_point`]); the same file keeps
//! the last applied state. The journal entry is cleared when the apply ends (applied, or rolled
//! back by netconf). An entry still there when the agent starts means the apply was cut short:
//! the manager applies the journalled state before anything else, so the host ends in the state
//! before the interrupted apply (never between), reports the interruption in `last_error`, and
//! the controller, which sees the old generation applied, asks again. Returning is itself an
//! idempotent apply, so an interrupted return is simply done again at the next start.
//!
//! Drift is found by a periodic re-plan (every `--drift-interval`): a non-empty plan against the
//! last applied state means something outside nodekeeper changed what it owns (or what it
//! configured on a NIC). A periodic check is chosen over netlink multicast events because it is
//! bounded in cost (one dump of each object type per interval) and cannot miss an event when the
//! socket buffer overflows.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nodekeeper_model::network::{LinkKind, NetworkState, format_errors, format_mac, parse_mac};
use nodekeeper_netconf::{
    ApplyOptions, ApplyReport, Netconf, NetconfError, Outcome, PlanError, Target,
};
use nodekeeper_proto::agent::v1 as pb;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::collect::interfaces::Interface;

/// The state of nodekeeper-managed host networking, as the report shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct NetworkStatus {
    pub applied_generation: String,
    pub drifted: bool,
    pub drift: Vec<String>,
    pub reconverged_at_unix_ms: i64,
    pub last_error: String,
}

/// At most this many drift lines are reported.
const MAX_DRIFT_LINES: usize = 20;

/// The bounds of `ApplyNetwork`'s request fields besides the desired state, as the
/// NodeNetworkConfig resource sets them (`checkTargets`, `checkTimeoutMs`): the agent enforces
/// them too, because the post-apply check runs under the manager's lock (a long one stalls every
/// apply and drift check) and opens a socket per target.
const MAX_CHECK_TARGETS: usize = 16;
/// `check_timeout_ms` other than 0 must lie in this range.
const CHECK_TIMEOUT_MS: std::ops::RangeInclusive<u32> = 100..=60_000;
/// `check_timeout_ms` 0 means this.
const DEFAULT_CHECK_TIMEOUT_MS: u32 = 5000;
/// A generation is `<uid>/<generation>` (under 60 bytes); it is kept in the journal and shown in
/// every report and condition message.
const MAX_GENERATION_BYTES: usize = 256;

/// How `last_error` begins when the applied state could not be checked for drift (cleared by
/// the next check that can).
const DRIFT_CHECK_FAILED: &str = "checking for drift failed: the applied generation";

/// How `last_error` begins when drift could not be re-converged (cleared by the next check that
/// finds the host converged, whoever converged it).
const RECONVERGE_FAILED: &str = "re-converging drift failed:";

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
    /// A request field other than the desired state is out of bounds.
    #[error("{field}: {reason}")]
    Request { field: &'static str, reason: String },
    #[error("host networking: {0}")]
    Netlink(String),
    /// The metadata service could not be read (worth retrying).
    #[error("instance metadata: {0}")]
    Metadata(String),
    /// The metadata service answered, but its VNICs cannot be laid out on this host.
    #[error("instance metadata: {0}")]
    Layout(String),
    #[error(
        "oci_vnics.enabled needs an instance metadata service, but this agent was started without \
         --imds-endpoint (NODEKEEPER_IMDS_ENDPOINT); start it with one or leave oci_vnics unset"
    )]
    NoImdsEndpoint,
    /// `--imds-endpoint` is not an address a metadata client can use: the agent's configuration
    /// is at fault, and asking again gives the same.
    #[error(
        "--imds-endpoint (NODEKEEPER_IMDS_ENDPOINT) cannot be used: {0}; restart the agent with \
         the metadata service's http:// URL"
    )]
    ImdsEndpoint(String),
    #[error("oci_vnics: {0}")]
    OciOptions(String),
    #[error("the OCI VNIC layout conflicts with desired_state_json: {0}")]
    LayoutConflict(String),
    /// The journal that lets an interrupted apply be undone could not be written; nothing was
    /// changed.
    #[error("save the network journal {path}: {source}; nothing was applied (check --state-dir)")]
    SaveJournal {
        path: PathBuf,
        source: std::io::Error,
    },
    /// An apply cut short by a restart could not be undone yet (tried again at every drift
    /// check; a later apply that succeeds ends it too).
    #[error(
        "an apply of generation {generation:?} was cut short and returning the host to the state \
         before it failed: {error}"
    )]
    Restore { generation: String, error: String },
}

impl From<NetconfError> for NetworkError {
    fn from(e: NetconfError) -> Self {
        match e {
            NetconfError::Plan(PlanError::Invalid(errs)) => {
                NetworkError::Invalid(format_errors(&errs))
            }
            NetconfError::Plan(p) => NetworkError::Plan(p.to_string()),
            NetconfError::BadCheckTarget(t) => NetworkError::CheckTarget(t),
            // What this host cannot do as asked, as an unplannable state is.
            e @ NetconfError::KernelTooOld { .. } => NetworkError::Plan(e.to_string()),
            other => NetworkError::Netlink(other.to_string()),
        }
    }
}

/// The last state applied in full; the drift loop re-converges to it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Applied {
    desired: NetworkState,
    generation: String,
    /// The request's post-apply check, as given (each parses as a [`Target`]).
    check_targets: Vec<String>,
    check_timeout_ms: u64,
}

impl Applied {
    fn opts(&self) -> ApplyOptions {
        ApplyOptions {
            // Parsed when the request was accepted; a journal edited by hand loses a bad one.
            check_targets: self
                .check_targets
                .iter()
                .filter_map(|t| t.parse().ok())
                .collect(),
            check_timeout: Duration::from_millis(self.check_timeout_ms),
            ..ApplyOptions::default()
        }
    }
}

/// An apply that began and has not ended: the host's state before it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Pending {
    generation: String,
    before: NetworkState,
}

/// `<state-dir>/network.json`.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Journal {
    applied: Option<Applied>,
    pending: Option<Pending>,
}

/// The journal's file name in `--state-dir`.
pub const JOURNAL_FILE: &str = "network.json";

/// The restore point in a journal's bytes: the generation of an apply that began and never
/// ended, and the host's state before it (`None` when no apply was cut short). For the uninstall
/// cleanup, which undoes such an apply as the agent's next start would have.
pub(crate) fn pending_restore_point(
    journal: &[u8],
) -> Result<Option<(String, NetworkState)>, serde_json::Error> {
    let journal: Journal = serde_json::from_slice(journal)?;
    Ok(journal.pending.map(|p| (p.generation, p.before)))
}

/// What the manager's lock guards.
#[derive(Default)]
struct State {
    /// The journal file has been read (on the first use after start).
    loaded: bool,
    journal: Journal,
}

/// Test hooks, read only by debug builds (tests run those); a release build compiles them out
/// and ignores the variables. `NODEKEEPER_TEST_HOLD_APPLY_AFTER_STEPS=N` stops every apply after
/// its N-th step and waits there forever, after writing N to the file
/// `NODEKEEPER_TEST_HOLD_APPLY_MARKER` names, so that a test can kill the agent at exactly that
/// point (tests/tests/fault_agent_restart.rs).
#[cfg(debug_assertions)]
fn test_hold() -> (Option<usize>, Option<PathBuf>) {
    let steps = std::env::var("NODEKEEPER_TEST_HOLD_APPLY_AFTER_STEPS")
        .ok()
        .and_then(|v| v.parse().ok());
    let marker = std::env::var_os("NODEKEEPER_TEST_HOLD_APPLY_MARKER").map(PathBuf::from);
    (steps, marker)
}

#[cfg(not(debug_assertions))]
fn test_hold() -> (Option<usize>, Option<PathBuf>) {
    (None, None)
}

/// An `existing` link of the applied state: how nodekeeper finds the interface it configures.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Configured {
    name: String,
    /// Lower-case colon form.
    mac: Option<String>,
}

/// One per agent; shared by the gRPC service and the drift loop.
pub struct NetworkManager {
    /// Connected on first use, in the namespace of the thread that first applies: an agent that
    /// never applies host networking (most of a simulated fleet) holds no netlink socket.
    netconf: tokio::sync::OnceCell<Netconf>,
    /// Serialises applies, drift checks and the journal.
    lock: tokio::sync::Mutex<State>,
    /// `<state-dir>/network.json`.
    journal_path: PathBuf,
    status: Mutex<NetworkStatus>,
    /// Counts changes of `status`, so that the agent knows when a cached report is out of date.
    changes: AtomicU64,
    /// The `existing` links of the applied state, for [`NetworkManager::configures`].
    configured: Mutex<Vec<Configured>>,
    /// `--imds-endpoint`, for `oci_vnics`; `None`: the metadata service is never asked.
    imds_endpoint: Option<String>,
    /// Where physical NICs' PCI addresses are read (bare metal's `nicIndex` numbering).
    sys_class_net: std::path::PathBuf,
}

/// A check found the host with the applied state: drift no longer holds, nor does a failure to
/// re-converge it.
fn converged(s: &mut NetworkStatus) {
    s.drifted = false;
    s.drift.clear();
    if s.last_error.starts_with(RECONVERGE_FAILED) {
        s.last_error.clear();
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn norm_mac(mac: &str) -> String {
    parse_mac(mac).map_or_else(|| mac.to_lowercase(), |b| format_mac(&b))
}

impl NetworkManager {
    /// A manager keeping its journal in `state_dir` (`--state-dir`; read on first use);
    /// `imds_endpoint` is `--imds-endpoint`.
    pub fn new(imds_endpoint: Option<String>, state_dir: &Path) -> Self {
        Self {
            netconf: tokio::sync::OnceCell::new(),
            lock: tokio::sync::Mutex::new(State::default()),
            journal_path: state_dir.join(JOURNAL_FILE),
            status: Mutex::new(NetworkStatus::default()),
            changes: AtomicU64::new(0),
            configured: Mutex::new(Vec::new()),
            imds_endpoint,
            sys_class_net: "/sys/class/net".into(),
        }
    }

    /// The netlink connection, opened on first use in the calling thread's network namespace.
    async fn netconf(&self) -> Result<&Netconf, NetworkError> {
        Ok(self
            .netconf
            .get_or_try_init(|| async { Netconf::connect() })
            .await?)
    }

    /// The status for the node report.
    pub fn status(&self) -> NetworkStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A number that changes whenever [`NetworkManager::status`] does.
    pub fn status_changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// True when the applied state configures `iface`: one of its `existing` links, found by
    /// MAC or by name as netconf finds it. (Links nodekeeper created carry netconf's alias mark,
    /// which the interface collector reads.)
    pub fn configures(&self, iface: &Interface) -> bool {
        let configured = self
            .configured
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        configured.iter().any(|c| match &c.mac {
            // A VLAN shares its parent's MAC; the MAC names the parent.
            Some(mac) => iface.kind != "vlan" && norm_mac(&iface.mac) == *mac,
            None => c.name == iface.name,
        })
    }

    fn publish(&self, f: impl FnOnce(&mut NetworkStatus)) {
        let mut s = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut s);
        s.drift.truncate(MAX_DRIFT_LINES);
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// Serves `ApplyNetwork`.
    pub async fn apply(
        &self,
        req: pb::ApplyNetworkRequest,
    ) -> Result<pb::ApplyNetworkResponse, NetworkError> {
        check_request_bounds(&req)?;
        let mut desired: NetworkState = serde_json::from_str(&req.desired_state_json)
            .map_err(|e| NetworkError::ParseDesired(e.to_string()))?;
        let mut vnic_ids = Vec::new();
        if let Some(oci) = req.oci_vnics.as_ref().filter(|o| o.enabled) {
            // What the metadata service answered, or how it failed, is the host's state: the
            // report shows it (a dry run changes nothing, the status included).
            let merged = self
                .merge_oci_layout(&mut desired, oci, &req.generation)
                .await;
            match merged {
                Ok(ids) => vnic_ids = ids,
                Err(e) => {
                    if !req.dry_run {
                        let msg = e.to_string();
                        self.publish(|s| s.last_error = msg);
                    }
                    return Err(e);
                }
            }
        }
        desired
            .validate()
            .map_err(|e| NetworkError::Invalid(format_errors(&e)))?;
        let check_targets = req
            .check_targets
            .iter()
            .map(|t| t.parse::<Target>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(NetworkError::CheckTarget)?;
        let check_timeout_ms = u64::from(if req.check_timeout_ms == 0 {
            DEFAULT_CHECK_TIMEOUT_MS
        } else {
            req.check_timeout_ms
        });
        let (hold_after_steps, hold_marker) = test_hold();
        let opts = ApplyOptions {
            dry_run: req.dry_run,
            check_targets,
            check_timeout: Duration::from_millis(check_timeout_ms),
            fail_at_step: None,
            hold_after_steps,
            hold_marker,
        };
        let new = Applied {
            desired: desired.clone(),
            generation: req.generation.clone(),
            check_targets: req.check_targets.clone(),
            check_timeout_ms,
        };
        let mut state = self.lock.lock().await;
        let netconf = self.netconf().await?;
        let applied = async {
            if req.dry_run {
                // A dry run changes nothing, an interrupted apply's return included: it plans
                // against the host as it is, and the journal keeps its entry.
                self.load(&mut state);
            } else if let Err(error) = self.prepare(&mut state).await {
                // The host is still between an earlier state and the one an interrupted apply
                // was making. Reaching this request's state ends that too, so it is tried; the
                // journalled state stays the one to return to until some apply succeeds.
                warn!(%error, generation = %req.generation, "applying the requested state over an interrupted apply");
            }
            self.apply_journaled(&mut state, netconf, &new, &opts).await
        };
        let report = match applied.await {
            Ok(r) => r,
            Err(e) => {
                if !req.dry_run {
                    let msg = e.to_string();
                    self.publish(|s| s.last_error = msg);
                }
                return Err(e);
            }
        };
        info!(generation = %req.generation, outcome = ?report.outcome, steps = report.plan.steps.len(), writes = report.writes, "apply network");
        if !req.dry_run {
            if report.outcome == Outcome::Applied {
                self.show_applied(&new);
                let generation = req.generation.clone();
                self.publish(|s| {
                    *s = NetworkStatus {
                        applied_generation: generation,
                        ..NetworkStatus::default()
                    };
                });
            } else {
                let msg = report.error.clone().unwrap_or_default();
                self.publish(|s| s.last_error = msg);
            }
        }
        let observed = netconf
            .observed_state(&desired)
            .await
            .map_err(NetworkError::from)?;
        let mut answer = response(&report, &observed);
        // The caller's proof that the VNICs it attached are on this host (a state rolled back
        // laid nothing out).
        if report.outcome == Outcome::Applied {
            answer.oci_vnic_ids = vnic_ids;
        }
        Ok(answer)
    }

    /// The `existing` links of `applied`, for [`NetworkManager::configures`].
    fn show_applied(&self, applied: &Applied) {
        *self
            .configured
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = applied
            .desired
            .links
            .iter()
            .filter(|l| l.kind == LinkKind::Existing)
            .map(|l| Configured {
                name: l.name.clone(),
                mac: l.mac.as_deref().map(norm_mac),
            })
            .collect();
    }

    /// Writes the journal atomically (a synced temporary file renamed over the old one, then
    /// the directory synced), so that a crash leaves the old journal or the new one.
    fn save(&self, journal: &Journal) -> Result<(), NetworkError> {
        let path = &self.journal_path;
        let fail = |source| NetworkError::SaveJournal {
            path: path.clone(),
            source,
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(fail)?;
        let bytes = serde_json::to_vec(journal).map_err(|e| fail(std::io::Error::other(e)))?;
        let tmp = path.with_extension("json.tmp");
        {
            use std::io::Write as _;
            let mut f = std::fs::File::create(&tmp).map_err(fail)?;
            f.write_all(&bytes).map_err(fail)?;
            f.sync_all().map_err(fail)?;
        }
        std::fs::rename(&tmp, path).map_err(fail)?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(fail)
    }

    /// On the first use after start, reads the journal ([`NetworkManager::load`]); whenever an
    /// apply was cut short, returns the host to the state before it. Called under the lock before
    /// every apply (not a dry run, which changes nothing) and drift check.
    async fn prepare(&self, state: &mut State) -> Result<(), NetworkError> {
        self.load(state);
        let Some(pending) = state.journal.pending.clone() else {
            return Ok(());
        };
        let restore_failed = |error: String| NetworkError::Restore {
            generation: pending.generation.clone(),
            error,
        };
        let netconf = self.netconf().await?;
        let report = match netconf
            .apply(&pending.before, &ApplyOptions::default())
            .await
        {
            Ok(report) => report,
            // The state before cannot be planned on this host any more (an interface it
            // names is gone): nothing can return to it, so the entry is dropped.
            Err(NetconfError::Plan(e)) => {
                state.journal.pending = None;
                self.save(&state.journal)?;
                return Err(restore_failed(format!(
                    "the state before it cannot be planned any more ({e}); left as it is"
                )));
            }
            Err(e) => return Err(restore_failed(e.to_string())),
        };
        if report.outcome != Outcome::Applied {
            return Err(restore_failed(report.error.unwrap_or_default()));
        }
        state.journal.pending = None;
        self.save(&state.journal)?;
        warn!(generation = %pending.generation, steps = report.plan.steps.len(), "an apply was cut short by a restart; returned the host to the state before it");
        let msg = format!(
            "an apply of generation {:?} was cut short (the agent stopped midway); the host was \
             returned to the state before it ({} steps undone)",
            pending.generation,
            report.plan.steps.len()
        );
        self.publish(|s| s.last_error = msg);
        Ok(())
    }

    /// On the first use after start, reads the journal: the applied state the report then shows
    /// and the drift loop keeps. Changes nothing on the host.
    fn load(&self, state: &mut State) {
        if !state.loaded {
            state.loaded = true;
            match std::fs::read(&self.journal_path) {
                Ok(bytes) => match serde_json::from_slice::<Journal>(&bytes) {
                    Ok(journal) => state.journal = journal,
                    Err(error) => {
                        // Not fatal: the controller applies its state again.
                        let msg = format!(
                            "the network journal {} is unreadable ({error}); nothing restored",
                            self.journal_path.display()
                        );
                        warn!(%msg, "network journal");
                        self.publish(|s| s.last_error = msg);
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    warn!(%error, path = %self.journal_path.display(), "read the network journal")
                }
            }
            if let Some(a) = state.journal.applied.clone() {
                info!(generation = %a.generation, "network state applied before the restart");
                self.show_applied(&a);
                self.publish(|s| s.applied_generation = a.generation);
            }
        }
    }

    /// Applies `new` (a dry run only plans), journalling the state before it first when the
    /// apply will change something; on success `new` becomes the applied state.
    async fn apply_journaled(
        &self,
        state: &mut State,
        netconf: &Netconf,
        new: &Applied,
        opts: &ApplyOptions,
    ) -> Result<ApplyReport, NetworkError> {
        if opts.dry_run {
            return Ok(netconf.apply(&new.desired, opts).await?);
        }
        // An entry left by an interrupted apply that could not be undone stays: the state
        // before that apply is the one to return to, not the half-way state the host has now.
        let inherited = state.journal.pending.is_some();
        let observed = netconf.observe().await?;
        // A plan that is empty or refused changes nothing: nothing to journal.
        if !inherited
            && nodekeeper_netconf::plan(&new.desired, &observed).is_ok_and(|p| !p.is_empty())
        {
            state.journal.pending = Some(Pending {
                generation: new.generation.clone(),
                before: nodekeeper_netconf::restore_point(&new.desired, &observed),
            });
            if let Err(e) = self.save(&state.journal) {
                state.journal.pending = None;
                return Err(e);
            }
        }
        let journalled = state.journal.pending.is_some();
        let report = netconf.apply(&new.desired, opts).await;
        let before = (state.journal.applied.clone(), journalled);
        match &report {
            Ok(r) if r.outcome == Outcome::Applied => {
                state.journal.applied = Some(new.clone());
                state.journal.pending = None;
            }
            // Netconf undid its steps, or refused before any: the host is as it was.
            Ok(r) if r.outcome == Outcome::RolledBack && !inherited => {
                state.journal.pending = None;
            }
            Err(_) if !inherited => state.journal.pending = None,
            // Some steps could not be undone (or the host was between states already): the
            // entry stays, and the next apply or drift check returns the host to its state.
            Ok(_) | Err(_) => {}
        }
        let after = (
            state.journal.applied.clone(),
            state.journal.pending.is_some(),
        );
        if after != before
            && let Err(error) = self.save(&state.journal)
        {
            // The host is as reported; only a restart before the next save would undo it.
            warn!(%error, "network journal not updated after the apply");
        }
        Ok(report?)
    }

    /// Re-plans the last applied state; on drift, records it and (if `reconverge`) applies again.
    /// A check that finds no drift, or a re-convergence that succeeds, clears the recorded drift
    /// and a failure to re-converge it (the report then shows the host converged again; a
    /// repair leaves `reconverged_at_unix_ms`).
    /// A state that cannot be planned any more (an interface it configures is gone) is reported
    /// in `last_error` until it plans again: otherwise the report would go on showing the host
    /// converged while nothing keeps it so.
    pub async fn check_drift(&self, reconverge: bool) -> Result<Vec<String>, NetworkError> {
        let mut state = self.lock.lock().await;
        self.prepare(&mut state).await?;
        let Some(a) = state.journal.applied.clone() else {
            return Ok(Vec::new());
        };
        let netconf = self.netconf().await?;
        let drift = match netconf.drift(&a.desired).await {
            Ok(drift) => {
                // Published only on a change: each publish makes the next report a full one.
                if self.status().last_error.starts_with(DRIFT_CHECK_FAILED) {
                    self.publish(|s| s.last_error.clear());
                }
                drift
            }
            Err(e) => {
                let error = NetworkError::from(e);
                let msg = format!(
                    "{DRIFT_CHECK_FAILED} {:?}: {error}; it is not re-converged until the \
                     host has what it names again or another state is applied",
                    a.generation
                );
                self.publish(|s| s.last_error = msg);
                return Err(error);
            }
        };
        if drift.is_empty() {
            // The host has the applied state again (re-converged earlier, or the drift undone by
            // other hands): what this check reported stops holding. Published only on a change.
            let s = self.status();
            if s.drifted || !s.drift.is_empty() || s.last_error.starts_with(RECONVERGE_FAILED) {
                self.publish(converged);
            }
            return Ok(drift);
        }
        warn!(generation = %a.generation, lines = drift.len(), "network drift");
        let lines = drift.clone();
        self.publish(|s| {
            s.drifted = true;
            s.drift = lines;
        });
        if reconverge {
            let report = self
                .apply_journaled(&mut state, netconf, &a, &a.opts())
                .await?;
            let ok = report.outcome == Outcome::Applied;
            let err = report.error.clone().unwrap_or_default();
            self.publish(|s| {
                if ok {
                    // The host has the applied state again; `reconverged_at` records the repair.
                    converged(s);
                    s.reconverged_at_unix_ms = now_ms();
                    s.last_error.clear();
                } else {
                    s.last_error = format!("{RECONVERGE_FAILED} {err}");
                }
            });
        }
        Ok(drift)
    }

    /// Reads the journal and, when an apply was cut short, returns the host to the state before
    /// it: the first thing the drift loop does after the agent starts.
    pub async fn restore(&self) {
        let mut state = self.lock.lock().await;
        if let Err(error) = self.prepare(&mut state).await {
            warn!(%error, "network state not restored; trying again at the next drift check");
            let msg = error.to_string();
            self.publish(|s| s.last_error = msg);
        }
    }

    /// Checks for drift every `interval` until `shutdown` is cancelled, after
    /// [`NetworkManager::restore`]. A check in progress finishes first, so the host is never left
    /// half re-converged.
    pub async fn drift_loop(&self, interval: Duration, shutdown: CancellationToken) {
        // Not raced with shutdown: a return dropped midway would itself be cut short.
        self.restore().await;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(error) = self.check_drift(true).await {
                warn!(%error, "drift check failed");
            }
        }
    }
}

impl NetworkManager {
    /// Adds the OCI secondary-VNIC layout that `oci` asks for to `desired`; returns the OCIDs
    /// of the VNICs laid out (not excluded, not waiting).
    async fn merge_oci_layout(
        &self,
        desired: &mut NetworkState,
        oci: &pb::OciVnics,
        generation: &str,
    ) -> Result<Vec<String>, NetworkError> {
        let opts = layout_options(oci)?;
        let endpoint = self
            .imds_endpoint
            .as_deref()
            .ok_or(NetworkError::NoImdsEndpoint)?;
        let layout = self
            .oci_vnic_layout(endpoint, &self.sys_class_net, &opts)
            .await?;
        for line in &layout.waiting {
            info!(%generation, %endpoint, waiting = %line, "oci vnic left out");
        }
        let mut laid_out = layout.desired;
        exclude_vnics(&mut laid_out, &oci.exclude_macs);
        merge_layout(desired, laid_out)?;
        let excluded: Vec<String> = oci.exclude_macs.iter().map(|m| norm_mac(m)).collect();
        Ok(layout
            .vnics
            .into_iter()
            .filter(|(_, mac)| !excluded.contains(&norm_mac(mac)))
            .map(|(id, _)| id)
            .collect())
    }

    /// The OCI secondary-VNIC layout of this host: asks the metadata service at `endpoint` for
    /// the instance and its VNICs, matches them with the interfaces netlink reports (PCI addresses
    /// from `sys_class_net`, normally `/sys/class/net`, number the physical NICs for bare metal's
    /// `nicIndex`), and returns the desired state plus what waits. Used only with an endpoint the
    /// agent was configured with; nothing here has a default address.
    pub async fn oci_vnic_layout(
        &self,
        endpoint: &str,
        sys_class_net: &std::path::Path,
        opts: &nodekeeper_oci::LayoutOptions,
    ) -> Result<nodekeeper_oci::Layout, NetworkError> {
        // Every metadata failure names the endpoint, so a wrong `--imds-endpoint` is obvious.
        let unavailable = |e: &dyn std::fmt::Display| {
            NetworkError::Metadata(format!("--imds-endpoint {endpoint}: {e}"))
        };
        // An endpoint the client refuses is the agent's configuration at fault, not an outage.
        let imds = nodekeeper_oci::ImdsClient::new(nodekeeper_oci::ImdsConfig::new(endpoint))
            .map_err(|e| match e {
                nodekeeper_oci::ImdsError::ConfigureEndpoint { .. } => {
                    NetworkError::ImdsEndpoint(e.to_string())
                }
                other => unavailable(&other),
            })?;
        // An answer that cannot be used (malformed, or a 4xx refusal) is the same when asked
        // again: FAILED_PRECONDITION, not a retryable UNAVAILABLE.
        let classify = |e: nodekeeper_oci::ImdsError| match e {
            nodekeeper_oci::ImdsError::Parse { .. } => {
                NetworkError::Layout(format!("--imds-endpoint {endpoint}: {e}"))
            }
            nodekeeper_oci::ImdsError::Status { status, .. } if status.is_client_error() => {
                NetworkError::Layout(format!("--imds-endpoint {endpoint}: {e}"))
            }
            other => unavailable(&other),
        };
        let instance = imds.instance().await.map_err(classify)?;
        let vnics = imds.vnics().await.map_err(classify)?;
        let observed = self.netconf().await?.observe().await?;
        let host: Vec<nodekeeper_oci::HostInterface> = observed
            .links
            .iter()
            .filter_map(|l| {
                let mac = l.mac.clone()?;
                // A physical NIC's `device` link points at its PCI function, e.g.
                // `../../../0000:31:00.0`; virtual devices have none.
                let pci_address = std::fs::read_link(sys_class_net.join(&l.name).join("device"))
                    .ok()
                    .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
                Some(nodekeeper_oci::HostInterface {
                    name: l.name.clone(),
                    mac,
                    pci_address,
                })
            })
            .collect();
        nodekeeper_oci::secondary_vnics(&instance, &vnics, &host, opts).map_err(|e| match e {
            nodekeeper_oci::LayoutError::BadOptions(m) => NetworkError::OciOptions(m),
            // Anything else is about what the metadata service answered: asking again gives
            // the same answer, so this is not UNAVAILABLE.
            other => NetworkError::Layout(format!("--imds-endpoint {endpoint}: {other}")),
        })
    }
}

/// Drops from `layout` the VNICs whose MAC is in `exclude_macs` (about to be detached): their
/// links and the links stacked on them, the addresses and routes on those links, and the rules
/// of those routes' tables. What nodekeeper had configured for them is then removed by the apply.
fn exclude_vnics(layout: &mut NetworkState, exclude_macs: &[String]) {
    if exclude_macs.is_empty() {
        return;
    }
    let excluded: Vec<String> = exclude_macs.iter().map(|m| norm_mac(m)).collect();
    let mut names: Vec<String> = layout
        .links
        .iter()
        .filter(|l| {
            l.mac
                .as_deref()
                .is_some_and(|m| excluded.contains(&norm_mac(m)))
        })
        .map(|l| l.name.clone())
        .collect();
    // Links stacked on an excluded one (a VLAN on a bare-metal VNIC's macvlan), transitively.
    loop {
        let more: Vec<String> = layout
            .links
            .iter()
            .filter(|l| !names.contains(&l.name))
            .filter(|l| l.parent.as_ref().is_some_and(|p| names.contains(p)))
            .map(|l| l.name.clone())
            .collect();
        if more.is_empty() {
            break;
        }
        names.extend(more);
    }
    let tables: Vec<u32> = layout
        .routes
        .iter()
        .filter(|r| r.link.as_ref().is_some_and(|l| names.contains(l)))
        .map(|r| r.table)
        .collect();
    layout.links.retain(|l| !names.contains(&l.name));
    layout.addresses.retain(|a| !names.contains(&a.link));
    layout.routes.retain(|r| {
        !r.link.as_ref().is_some_and(|l| names.contains(l)) && !tables.contains(&r.table)
    });
    layout.rules.retain(|r| !tables.contains(&r.table));
}

/// Refuses a request whose check or generation is out of the bounds the NodeNetworkConfig
/// resource sets, before anything is parsed.
fn check_request_bounds(req: &pb::ApplyNetworkRequest) -> Result<(), NetworkError> {
    let refuse = |field, reason| Err(NetworkError::Request { field, reason });
    if req.check_targets.len() > MAX_CHECK_TARGETS {
        return refuse(
            "check_targets",
            format!(
                "{} targets given, at most {MAX_CHECK_TARGETS} are allowed; check fewer",
                req.check_targets.len()
            ),
        );
    }
    if req.check_timeout_ms != 0 && !CHECK_TIMEOUT_MS.contains(&req.check_timeout_ms) {
        return refuse(
            "check_timeout_ms",
            format!(
                "{} is outside {}–{} (0 means {DEFAULT_CHECK_TIMEOUT_MS})",
                req.check_timeout_ms,
                CHECK_TIMEOUT_MS.start(),
                CHECK_TIMEOUT_MS.end()
            ),
        );
    }
    if req.generation.len() > MAX_GENERATION_BYTES {
        return refuse(
            "generation",
            format!(
                "{} bytes long, at most {MAX_GENERATION_BYTES} are allowed (it is \
                 `<uid>/<generation>`)",
                req.generation.len()
            ),
        );
    }
    Ok(())
}

/// The layout knobs of a request, with the proto's zero-means-default rule.
fn layout_options(oci: &pb::OciVnics) -> Result<nodekeeper_oci::LayoutOptions, NetworkError> {
    let d = nodekeeper_oci::LayoutOptions::default();
    let opts = nodekeeper_oci::LayoutOptions {
        table_base: if oci.table_base == 0 {
            d.table_base
        } else {
            oci.table_base
        },
        rule_priority_base: if oci.rule_priority_base == 0 {
            d.rule_priority_base
        } else {
            oci.rule_priority_base
        },
        mtu: if oci.mtu == 0 { d.mtu } else { oci.mtu },
    };
    if !(68..=65535).contains(&opts.mtu) {
        return Err(NetworkError::OciOptions(format!(
            "mtu {} is outside 68–65535 (0 means 9000)",
            opts.mtu
        )));
    }
    Ok(opts)
}

/// Adds the layout's objects to `desired`. An object equal to one already given is kept once; a
/// given object that claims the same link (name or MAC), address, route (destination and table)
/// or rule priority differently is refused, naming both, rather than letting either silently win.
/// The layout's own objects are only compared with what was given, never with each other: a
/// dual-stack or multi-IPv6 VNIC has several rules at its one priority, and the layout's
/// consistency is the layout's own validation.
fn merge_layout(desired: &mut NetworkState, layout: NetworkState) -> Result<(), NetworkError> {
    let conflict = |what: String| Err(NetworkError::LayoutConflict(what));
    let norm_mac = |m: &Option<String>| m.as_deref().map(norm_mac);
    let ip_of = |cidr: &str| cidr.split('/').next().unwrap_or(cidr).to_owned();
    let given = (
        desired.links.len(),
        desired.addresses.len(),
        desired.routes.len(),
        desired.rules.len(),
    );
    for l in layout.links {
        if desired.links[..given.0].contains(&l) {
            continue;
        }
        if let Some((i, g)) = desired.links[..given.0].iter().enumerate().find(|(_, g)| {
            g.name == l.name || (l.mac.is_some() && norm_mac(&g.mac) == norm_mac(&l.mac))
        }) {
            return conflict(format!(
                "links[{i}] ({}) and the layout's link {} (MAC {}) claim the same interface; \
                 drop one of them",
                g.name,
                l.name,
                l.mac.as_deref().unwrap_or("-")
            ));
        }
        desired.links.push(l);
    }
    for a in layout.addresses {
        if desired.addresses[..given.1].contains(&a) {
            continue;
        }
        if let Some((i, g)) = desired.addresses[..given.1]
            .iter()
            .enumerate()
            .find(|(_, g)| ip_of(&g.cidr) == ip_of(&a.cidr))
        {
            return conflict(format!(
                "addresses[{i}] ({} on {}) and the layout's address {} on {} are the same IP",
                g.cidr, g.link, a.cidr, a.link
            ));
        }
        desired.addresses.push(a);
    }
    for r in layout.routes {
        if desired.routes[..given.2].contains(&r) {
            continue;
        }
        if let Some((i, g)) = desired.routes[..given.2]
            .iter()
            .enumerate()
            .find(|(_, g)| g.destination == r.destination && g.table == r.table)
        {
            return conflict(format!(
                "routes[{i}] ({} table {}) and the layout's route to {} in table {} differ; \
                 drop the route or move the layout with oci_vnics.table_base",
                g.destination, g.table, r.destination, r.table
            ));
        }
        desired.routes.push(r);
    }
    // A given rule at one of the layout's priorities must be one of the layout's rules.
    if let Some((i, g, r)) = desired.rules[..given.3]
        .iter()
        .enumerate()
        .find_map(|(i, g)| {
            layout
                .rules
                .iter()
                .find(|r| r.priority == g.priority && !layout.rules.contains(g))
                .map(|r| (i, g, r))
        })
    {
        return conflict(format!(
            "rules[{i}] (priority {}, table {}) and the layout's rule at priority {} (table {}) \
             differ; drop the rule or move the layout with oci_vnics.rule_priority_base",
            g.priority, g.table, r.priority, r.table
        ));
    }
    for r in layout.rules {
        if !desired.rules[..given.3].contains(&r) {
            desired.rules.push(r);
        }
    }
    Ok(())
}

fn response(report: &ApplyReport, observed: &NetworkState) -> pb::ApplyNetworkResponse {
    pb::ApplyNetworkResponse {
        plan: report
            .plan
            .steps
            .iter()
            .map(|s| pb::PlanStep {
                op: s.op().to_string(),
                object: s.to_string(),
            })
            .collect(),
        outcome: match report.outcome {
            Outcome::Planned => pb::ApplyOutcome::Planned,
            Outcome::Applied => pb::ApplyOutcome::Applied,
            Outcome::RolledBack => pb::ApplyOutcome::RolledBack,
            Outcome::RollbackFailed => pb::ApplyOutcome::RollbackFailed,
        } as i32,
        message: report.error.clone().unwrap_or_default(),
        observed_state_json: serde_json::to_string(observed).unwrap_or_default(),
        netlink_writes: u32::try_from(report.writes).unwrap_or(u32::MAX),
        // Filled by `apply` for an apply that laid out OCI VNICs.
        oci_vnic_ids: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    //! The manager in a fresh network namespace (root only), driven with the gRPC messages.

    use std::sync::Arc;

    use clap::Parser;
    use nodekeeper_testkit::{Netns, skip_unless_root};
    use tonic::{Code, Status};

    use super::*;
    use crate::agent::Agent;
    use crate::config::Config;

    /// What the gRPC caller sees for `e` (through the service's one mapping).
    fn status_of(e: NetworkError) -> Status {
        crate::service::status(e.into())
    }

    /// A fresh namespace with its loopback up, shared with the code run inside it, which
    /// inspects and changes its links with `ip`.
    fn netns(prefix: &str) -> Arc<Netns> {
        Arc::new(Netns::with_loopback(prefix).expect("create a network namespace"))
    }

    /// `ip -n <ns> ARGS`, asserting success; its standard output.
    fn ip(ns: &Netns, args: &[&str]) -> String {
        ns.ip(args).unwrap()
    }

    /// An agent keeping its state in `state_dir`, asking the instance metadata at `imds` when
    /// given; its TLS files are never read by these tests.
    fn agent_in(state_dir: &str, imds: Option<&str>) -> Agent {
        let mut args = vec![
            "nodekeeper-agent".to_string(),
            "--node-name=n1".into(),
            "--tls-cert=/nonexistent".into(),
            "--tls-key=/nonexistent".into(),
            "--client-ca=/nonexistent".into(),
            format!("--state-dir={state_dir}"),
        ];
        args.extend(imds.map(|e| format!("--imds-endpoint={e}")));
        Agent::new(&Config::parse_from(args))
    }

    const DESIRED: &str = r#"{
      "links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 9000, "up": true}],
      "addresses": [{"link": "vnic1", "cidr": "10.0.20.33/24"}],
      "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "vnic1", "table": 101}],
      "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}]
    }"#;

    fn request(json: &str, dry_run: bool) -> pb::ApplyNetworkRequest {
        pb::ApplyNetworkRequest {
            desired_state_json: json.into(),
            dry_run,
            generation: "uid-1/3".into(),
            check_targets: vec!["10.0.20.1".into()],
            check_timeout_ms: 2000,
            ..Default::default()
        }
    }

    /// A namespace with the NIC of [`DESIRED`]: `nic0` (its MAC), up, whose veth peer holds
    /// the gateway 10.0.20.1 that the post-apply check pings.
    fn nic0_netns(prefix: &str) -> Arc<Netns> {
        let ns = netns(prefix);
        ip(
            &ns,
            &[
                "link",
                "add",
                "nic0",
                "address",
                "02:00:17:0a:22:02",
                "type",
                "veth",
                "peer",
                "name",
                "nic0p",
            ],
        );
        ip(&ns, &["link", "set", "nic0", "up"]);
        ip(&ns, &["link", "set", "nic0p", "up"]);
        ip(&ns, &["addr", "add", "10.0.20.1/24", "dev", "nic0p"]);
        ns
    }

    #[test]
    fn apply_network_dry_run_apply_reapply_errors_and_drift() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = nic0_netns("nk-test-agent");
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            let agent = Arc::new(agent_in(&state_dir, None));
            let m = agent.network();

            let r = m.apply(request(DESIRED, true)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Planned as i32);
            assert_eq!(r.netlink_writes, 0);
            let ops: Vec<&str> = r.plan.iter().map(|s| s.op.as_str()).collect();
            assert_eq!(
                ops,
                vec!["set-link", "add-address", "add-route", "add-rule"]
            );
            assert_eq!(r.plan[0].object, "nic0 mtu 9000");
            assert!(!ip(&name, &["addr", "show", "dev", "nic0"]).contains("10.0.20.33"));

            let r = m.apply(request(DESIRED, false)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
            assert_eq!(r.netlink_writes, 4);
            let observed: NetworkState = serde_json::from_str(&r.observed_state_json).unwrap();
            assert_eq!(observed.addresses[0].cidr, "10.0.20.33/24");
            assert_eq!(observed.links[0].name, "vnic1");
            assert_eq!(observed.links[0].mtu, Some(9000));
            assert_eq!(m.status().applied_generation, "uid-1/3");

            let r = m.apply(request(DESIRED, false)).await.unwrap();
            assert_eq!(
                (r.outcome, r.netlink_writes, r.plan.len()),
                (pb::ApplyOutcome::Applied as i32, 0, 0)
            );

            // Bad input: refused before any change, naming the field.
            let e = status_of(m.apply(request("{not json", false)).await.unwrap_err());
            assert_eq!(e.code(), Code::InvalidArgument);
            let bad = DESIRED.replace("\"mtu\": 9000", "\"mtu\": 60");
            let e = status_of(m.apply(request(&bad, false)).await.unwrap_err());
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(
                e.message().contains("links[0].mtu: 60 is outside 68–65535"),
                "{}",
                e.message()
            );
            let orphan = r#"{"links": [{"name": "nkm9", "kind": "macvlan", "parent": "ens9"}]}"#;
            let e = status_of(m.apply(request(orphan, false)).await.unwrap_err());
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(
                e.message().contains("parent ens9 does not exist"),
                "{}",
                e.message()
            );
            let mut req = request(DESIRED, false);
            req.check_targets = vec!["example.com".into()];
            let e = status_of(m.apply(req).await.unwrap_err());
            assert_eq!(e.code(), Code::InvalidArgument);

            // Drift: someone removes the VNIC's default route; the manager sees it and puts it
            // back, and the report shows the host converged again, the repair's time kept.
            let route_line = "add-route 0.0.0.0/0 via 10.0.20.1 dev nic0 table 101".to_string();
            ip(&name, &["route", "del", "default", "table", "101"]);
            let drift = m.check_drift(true).await.unwrap();
            assert_eq!(drift, vec![route_line.clone()]);
            let s = m.status();
            assert!(
                !s.drifted
                    && s.drift.is_empty()
                    && s.reconverged_at_unix_ms > 0
                    && s.last_error.is_empty(),
                "{s:?}"
            );
            assert_eq!(
                ip(&name, &["route", "show", "table", "101"]).trim(),
                "default via 10.0.20.1 dev nic0 proto 176"
            );
            assert!(m.check_drift(true).await.unwrap().is_empty());
            let (_, report) = agent.report(0).await;
            let network = report.unwrap().network.clone();
            assert!(!network.drifted && network.drift.is_empty(), "{network:?}");

            // A check that only looks reports the drift until the host has the state again,
            // whoever puts it back.
            let add_back = [
                "route",
                "add",
                "default",
                "via",
                "10.0.20.1",
                "dev",
                "nic0",
                "table",
                "101",
                "proto",
                "176",
            ];
            ip(&name, &["route", "del", "default", "table", "101"]);
            assert_eq!(
                m.check_drift(false).await.unwrap(),
                vec![route_line.clone()]
            );
            let s = m.status();
            assert!(s.drifted && s.drift == vec![route_line.clone()], "{s:?}");
            ip(&name, &add_back);
            assert!(m.check_drift(false).await.unwrap().is_empty());
            let s = m.status();
            assert!(!s.drifted && s.drift.is_empty(), "{s:?}");

            // A re-convergence that fails (the gateway no longer answers the post-apply check,
            // so it is rolled back) is reported until the host converges, here by other hands.
            ip(&name, &["addr", "del", "10.0.20.1/24", "dev", "nic0p"]);
            ip(&name, &["route", "del", "default", "table", "101"]);
            assert_eq!(m.check_drift(true).await.unwrap(), vec![route_line.clone()]);
            let s = m.status();
            assert!(
                s.drifted && s.last_error.starts_with(RECONVERGE_FAILED),
                "{s:?}"
            );
            ip(&name, &["addr", "add", "10.0.20.1/24", "dev", "nic0p"]);
            ip(&name, &add_back);
            assert!(m.check_drift(false).await.unwrap().is_empty());
            let s = m.status();
            assert!(
                !s.drifted && s.drift.is_empty() && s.last_error.is_empty(),
                "{s:?}"
            );
        });
    }

    /// The journal outlives the manager: a new one on the same `--state-dir` (a restarted
    /// agent) knows the applied generation and keeps it (drift repaired); without a journal it
    /// can write, an apply is refused and nothing changes. (An apply cut short by a kill is
    /// tests/tests/fault_agent_restart.rs, with real processes.)
    #[test]
    fn the_journal_keeps_the_applied_state_and_an_apply_needs_it() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = nic0_netns("nk-test-agent-journal");
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            let first = agent_in(&state_dir, None);
            let r = first
                .network()
                .apply(request(DESIRED, false))
                .await
                .unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
            let kept = std::fs::read_to_string(Path::new(&state_dir).join(JOURNAL_FILE)).unwrap();
            assert!(kept.contains("\"pending\":null"), "{kept}");
            drop(first);

            let again = agent_in(&state_dir, None);
            let m = again.network();
            m.restore().await;
            let s = m.status();
            assert_eq!(
                (s.applied_generation.as_str(), s.last_error.as_str()),
                ("uid-1/3", "")
            );
            ip(&name, &["route", "del", "default", "table", "101"]);
            assert_eq!(m.check_drift(true).await.unwrap().len(), 1);
            assert!(m.check_drift(true).await.unwrap().is_empty());

            // A state directory that cannot hold the journal (a path under a regular file).
            let file = Path::new(&state_dir).join("not-a-dir");
            std::fs::write(&file, "").unwrap();
            let stuck = agent_in(&file.join("state").to_string_lossy(), None);
            let other = DESIRED.replace("10.0.20.33", "10.0.20.34");
            let e = status_of(
                stuck
                    .network()
                    .apply(request(&other, false))
                    .await
                    .unwrap_err(),
            );
            assert_eq!(e.code(), Code::Internal, "{}", e.message());
            assert!(
                e.message().contains("save the network journal")
                    && e.message().contains("--state-dir"),
                "{}",
                e.message()
            );
            assert!(!ip(&name, &["addr", "show", "dev", "nic0"]).contains("10.0.20.34"));
            assert!(
                stuck
                    .network()
                    .status()
                    .last_error
                    .contains("nothing was applied")
            );

            // An interrupted apply whose earlier state the kernel now refuses (a macvlan with an
            // MTU above its parent's, 9000): the return fails and says so, and a later apply that
            // succeeds ends the interruption.
            let dir = Path::new(&state_dir).join("refused");
            std::fs::create_dir_all(&dir).unwrap();
            let before = r#"{"links": [{"name": "nic0", "kind": "existing"},
                {"name": "nkbig", "kind": "macvlan", "parent": "nic0", "mtu": 9500}]}"#;
            std::fs::write(
                dir.join(JOURNAL_FILE),
                format!(r#"{{"applied": null, "pending": {{"generation": "uid-1/9", "before": {before}}}}}"#),
            )
            .unwrap();
            let refused = agent_in(&dir.to_string_lossy(), None);
            let m = refused.network();
            m.restore().await;
            let last = m.status().last_error;
            assert!(
                last.contains("\"uid-1/9\" was cut short and returning the host"),
                "{last}"
            );
            let r = m.apply(request(&other, false)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
            let kept = std::fs::read_to_string(dir.join(JOURNAL_FILE)).unwrap();
            assert!(kept.contains("\"pending\":null"), "{kept}");
            assert!(m.status().last_error.is_empty());
        });
    }

    /// A dry run changes nothing, not even to end an apply a restart cut short: the journal
    /// entry and the host stay as they are (the plan is made against the host as it is), and
    /// the next drift check returns the host to the journalled state as usual.
    #[test]
    fn a_dry_run_leaves_an_interrupted_apply_for_the_drift_check() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = nic0_netns("nk-test-agent-dry");
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            // The state before the interrupted apply had the VNIC's address (the apply, cut
            // short, had removed it).
            let before = r#"{"links": [{"name": "vnic1", "kind": "existing", "mac": "02:00:17:0a:22:02"}],
                "addresses": [{"link": "vnic1", "cidr": "10.0.20.44/24"}]}"#;
            let journal = Path::new(&state_dir).join(JOURNAL_FILE);
            std::fs::write(
                &journal,
                format!(r#"{{"applied": null, "pending": {{"generation": "uid-1/2", "before": {before}}}}}"#),
            )
            .unwrap();
            let kept = std::fs::read(&journal).unwrap();
            let agent = agent_in(&state_dir, None);
            let m = agent.network();

            let r = m.apply(request(DESIRED, true)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Planned as i32);
            assert_eq!(r.netlink_writes, 0);
            assert!(
                !ip(&name, &["addr", "show", "dev", "nic0"]).contains("10.0.20.44"),
                "a dry run returned the host to the journalled state"
            );
            assert_eq!(std::fs::read(&journal).unwrap(), kept);
            assert!(m.status().last_error.is_empty(), "{:?}", m.status());

            // Not vacuous: the drift check does return the host to it and ends the entry.
            assert!(m.check_drift(true).await.unwrap().is_empty());
            assert!(ip(&name, &["addr", "show", "dev", "nic0"]).contains("10.0.20.44"));
            let now = std::fs::read_to_string(&journal).unwrap();
            assert!(now.contains("\"pending\":null"), "{now}");
            assert!(m.status().last_error.contains("\"uid-1/2\" was cut short"));
        });
    }

    /// A caller that goes away while `ApplyNetwork` is in
    /// its post-apply check (the controller's deadline passed, the connection dropped) does not
    /// cut the apply short: the check still fails, the steps are still undone and the journal
    /// entry cleared, with no further call and no drift check.
    #[test]
    fn an_apply_whose_caller_goes_away_still_rolls_back() {
        use pb::node_agent_server::NodeAgent as _;
        skip_unless_root!("needs root to create network namespaces");
        let ns = nic0_netns("nk-test-agent-drop");
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            let agent = Arc::new(agent_in(&state_dir, None));
            let service = crate::service::AgentService::new(Arc::clone(&agent));
            let has_address = || ip(&name, &["addr", "show", "dev", "nic0"]).contains("10.0.20.33");
            // Nothing answers at 10.0.20.9: the check fails after 3 s and the apply rolls back.
            let mut req = request(DESIRED, false);
            req.check_targets = vec!["10.0.20.9".into()];
            req.check_timeout_ms = 3000;
            let call = service.apply_network(tonic::Request::new(req));
            let steps_made = async {
                while !has_address() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::select! {
                r = call => panic!("the apply ended before its check: {r:?}"),
                made = tokio::time::timeout(Duration::from_secs(10), steps_made) => {
                    made.expect("the apply made its steps within 10 s");
                }
            }
            // The call is dropped here, mid-check, as tonic drops a handler whose caller left.
            let rolled_back = async {
                while has_address() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(15), rolled_back)
                .await
                .expect("the abandoned apply rolled back within 15 s");
            assert!(!ip(&name, &["rule", "show"]).contains("20101"));
            assert!(ip(&name, &["route", "show", "table", "101"]).is_empty());
            let last = agent.network().status().last_error;
            assert!(last.contains("post-apply check failed"), "{last}");
            // The lock is free and the journal holds nothing pending: the next apply works.
            let r = agent
                .network()
                .apply(request(DESIRED, false))
                .await
                .unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
            let kept = std::fs::read_to_string(Path::new(&state_dir).join(JOURNAL_FILE)).unwrap();
            assert!(kept.contains("\"pending\":null"), "{kept}");
        });
    }

    /// An interface the applied state configures goes
    /// away; the drift check cannot plan it any more, and the report says so in `last_error`
    /// (the node sweep shows it) instead of going on showing the host converged. The error
    /// goes once the interface is back.
    #[test]
    fn a_drift_check_that_cannot_plan_is_reported_until_it_can() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = nic0_netns("nk-test-agent-gone");
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            let agent = agent_in(&state_dir, None);
            let m = agent.network();
            let r = m.apply(request(DESIRED, false)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
            assert!(m.check_drift(true).await.unwrap().is_empty());

            ip(&name, &["link", "del", "nic0"]);
            assert!(m.check_drift(true).await.is_err());
            let s = m.status();
            assert!(
                s.last_error.starts_with(DRIFT_CHECK_FAILED)
                    && s.last_error.contains("\"uid-1/3\""),
                "{s:?}"
            );
            let (_, report) = agent.report(0).await;
            assert_eq!(report.unwrap().network.last_error, s.last_error);

            // The NIC comes back (same MAC): the check plans again, re-converges, and the
            // error goes.
            ip(
                &name,
                &[
                    "link",
                    "add",
                    "nic0",
                    "address",
                    "02:00:17:0a:22:02",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "nic0p",
                ],
            );
            ip(&name, &["link", "set", "nic0p", "up"]);
            ip(&name, &["addr", "add", "10.0.20.1/24", "dev", "nic0p"]);
            assert!(!m.check_drift(true).await.unwrap().is_empty());
            let s = m.status();
            assert!(s.last_error.is_empty(), "{s:?}");
            assert!(ip(&name, &["addr", "show", "dev", "nic0"]).contains("10.0.20.33"));
        });
    }

    #[test]
    fn merge_keeps_equal_objects_once_and_refuses_conflicts_by_name() {
        let layout: NetworkState = serde_json::from_str(DESIRED).unwrap();
        let mut desired = layout.clone();
        merge_layout(&mut desired, layout.clone()).unwrap();
        assert_eq!(desired, layout);

        let mut empty = NetworkState::default();
        merge_layout(&mut empty, layout.clone()).unwrap();
        assert_eq!(empty, layout);

        let cases = [
            (
                r#"{"links": [{"name": "x", "kind": "existing", "mac": "02:00:17:0A:22:02"}]}"#,
                "links[0] (x)",
            ),
            (
                r#"{"addresses": [{"link": "y", "cidr": "10.0.20.33/16"}]}"#,
                "addresses[0] (10.0.20.33/16 on y)",
            ),
            (
                r#"{"routes": [{"destination": "default", "gateway": "10.0.20.9", "table": 101}]}"#,
                "routes[0] (default table 101)",
            ),
            (
                r#"{"rules": [{"from": "10.9.9.9/32", "table": 7, "priority": 20101}]}"#,
                "rules[0] (priority 20101, table 7)",
            ),
        ];
        for (given, named) in cases {
            let mut d: NetworkState = serde_json::from_str(given).unwrap();
            let e = status_of(merge_layout(&mut d, layout.clone()).unwrap_err());
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.message().contains(named), "{given}: {}", e.message());
        }
    }

    /// The layout of a fixture from `crates/oci/tests/fixtures`, every VNIC visible.
    fn fixture_layout(file: &str) -> NetworkState {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../oci/tests/fixtures");
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        let instance = nodekeeper_oci::parse_instance(&read("instance-vm.json")).unwrap();
        let vnics = nodekeeper_oci::parse_vnics(&read(file)).unwrap();
        let host: Vec<nodekeeper_oci::HostInterface> = vnics
            .iter()
            .enumerate()
            .map(|(i, v)| nodekeeper_oci::HostInterface {
                name: format!("ens{}", i + 3),
                mac: v.mac_addr.clone(),
                pci_address: Some(format!("0000:00:0{}.0", i + 3)),
            })
            .collect();
        nodekeeper_oci::secondary_vnics(
            &instance,
            &vnics,
            &host,
            &nodekeeper_oci::LayoutOptions::default(),
        )
        .unwrap()
        .desired
    }

    /// Regression (issue 20, defect 5): a dual-stack or multi-IPv6 VNIC has several rules at its
    /// one priority; the layout's own objects are not a conflict with an empty desired state.
    #[test]
    fn dual_stack_and_multi_ipv6_layouts_merge_into_an_empty_desired_state() {
        for file in [
            "vnics-vm.json",
            "vnics-vm-dual-stack.json",
            "vnics-vm-multi-ipv6.json",
        ] {
            let layout = fixture_layout(file);
            let mut desired = NetworkState::default();
            merge_layout(&mut desired, layout.clone()).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(desired, layout, "{file}");
            // Given explicitly as well: kept once.
            let mut again = layout.clone();
            merge_layout(&mut again, layout.clone()).unwrap();
            assert_eq!(again, layout, "{file}");
        }
        // A given rule at the layout's priority for another source is still the caller's clash,
        // and the message names desired_state_json's rule.
        let layout = fixture_layout("vnics-vm-dual-stack.json");
        let mut d: NetworkState = serde_json::from_str(
            r#"{"rules": [{"from": "10.9.9.9/32", "table": 7, "priority": 20101}]}"#,
        )
        .unwrap();
        let e = status_of(merge_layout(&mut d, layout).unwrap_err());
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(
            e.message().contains("rules[0] (priority 20101, table 7)"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn excluded_vnics_lose_links_stacked_links_addresses_routes_and_rules() {
        let mut layout: NetworkState = serde_json::from_str(
            r#"{
              "links": [
                {"name": "keep", "kind": "existing", "mac": "02:00:17:00:00:01"},
                {"name": "mv", "kind": "macvlan", "parent": "eth0", "mac": "02:00:17:00:00:02"},
                {"name": "vl", "kind": "vlan", "parent": "mv", "vlanId": 7}
              ],
              "addresses": [{"link": "keep", "cidr": "10.0.1.5/24"}, {"link": "vl", "cidr": "10.0.2.5/24"}],
              "routes": [
                {"destination": "default", "gateway": "10.0.1.1", "link": "keep", "table": 101},
                {"destination": "default", "gateway": "10.0.2.1", "link": "vl", "table": 102}
              ],
              "rules": [
                {"from": "10.0.1.5/32", "table": 101, "priority": 20101},
                {"from": "10.0.2.5/32", "table": 102, "priority": 20102}
              ]
            }"#,
        )
        .unwrap();
        let before = layout.clone();
        exclude_vnics(&mut layout, &[]);
        assert_eq!(layout, before);
        exclude_vnics(&mut layout, &["02:00:17:00:00:02".to_uppercase()]);
        let names: Vec<&str> = layout.links.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["keep"]);
        assert_eq!(layout.addresses.len(), 1);
        assert_eq!(layout.routes.len(), 1);
        assert_eq!(layout.rules.len(), 1);
        assert_eq!(layout.rules[0].table, 101);
    }

    #[test]
    fn layout_options_default_zeros_and_refuse_bad_mtu() {
        let o = layout_options(&pb::OciVnics {
            enabled: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(o, nodekeeper_oci::LayoutOptions::default());
        let o = layout_options(&pb::OciVnics {
            enabled: true,
            mtu: 1500,
            table_base: 200,
            rule_priority_base: 21000,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (o.mtu, o.table_base, o.rule_priority_base),
            (1500, 200, 21000)
        );
        let e = status_of(
            layout_options(&pb::OciVnics {
                enabled: true,
                mtu: 70000,
                ..Default::default()
            })
            .unwrap_err(),
        );
        assert!(
            e.message().contains("oci_vnics: mtu 70000"),
            "{}",
            e.message()
        );
    }

    /// The check and the generation are held to the NodeNetworkConfig's bounds before anything
    /// is parsed or asked of the host, naming the field. (The desired state is not even JSON, so
    /// that nothing here can reach the test host's netlink: no root needed.)
    #[tokio::test]
    async fn request_fields_out_of_bounds_are_refused_naming_the_field() {
        let state = tempfile::tempdir().unwrap();
        let m = NetworkManager::new(None, state.path());
        let refused = |req: pb::ApplyNetworkRequest, field: &'static str| {
            let m = &m;
            async move {
                let e = status_of(m.apply(req).await.unwrap_err());
                assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
                assert!(
                    e.message().starts_with(&format!("{field}: ")),
                    "{}",
                    e.message()
                );
                e.message().to_owned()
            }
        };
        let mut req = request("{not json", false);
        req.check_targets = vec!["10.0.20.1".into(); MAX_CHECK_TARGETS + 1];
        let msg = refused(req, "check_targets").await;
        assert!(msg.contains("17 targets given, at most 16"), "{msg}");
        for ms in [99, 60_001, u32::MAX] {
            let mut req = request("{not json", false);
            req.check_timeout_ms = ms;
            let msg = refused(req, "check_timeout_ms").await;
            assert!(msg.contains(&format!("{ms} is outside 100–60000")), "{msg}");
        }
        let mut req = request("{not json", false);
        req.generation = "g".repeat(MAX_GENERATION_BYTES + 1);
        refused(req, "generation").await;
        // Nothing refused is published: the report still shows the last apply.
        assert_eq!(m.status(), NetworkStatus::default());

        // The bounds themselves, and 0 (5000), pass.
        for ms in [0, 100, 60_000] {
            let mut req = request(DESIRED, false);
            req.check_timeout_ms = ms;
            req.check_targets = vec!["10.0.20.1".into(); MAX_CHECK_TARGETS];
            req.generation = "g".repeat(MAX_GENERATION_BYTES);
            check_request_bounds(&req).unwrap();
        }
    }

    /// An `--imds-endpoint` the metadata client cannot use is the agent's configuration at
    /// fault: FAILED_PRECONDITION naming the flag, in the report too, not a retryable
    /// UNAVAILABLE (the client refuses it before any traffic or netlink).
    #[tokio::test]
    async fn an_unusable_imds_endpoint_is_a_failed_precondition_naming_the_flag() {
        let state = tempfile::tempdir().unwrap();
        for endpoint in ["https://169.254.169.254", "not a url"] {
            let m = NetworkManager::new(Some(endpoint.into()), state.path());
            let req = pb::ApplyNetworkRequest {
                oci_vnics: Some(pb::OciVnics {
                    enabled: true,
                    ..Default::default()
                }),
                ..request("{}", false)
            };
            let e = status_of(m.apply(req).await.unwrap_err());
            assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
            assert!(
                e.message()
                    .contains("--imds-endpoint (NODEKEEPER_IMDS_ENDPOINT) cannot be used")
                    && e.message().contains(endpoint)
                    && e.message().contains("restart the agent"),
                "{}",
                e.message()
            );
            assert_eq!(m.status().last_error, e.message());
        }
    }

    /// A minimal IMDS stand-in on 127.0.0.1 (inside the test namespace) serving the shared VM
    /// samples; it answers 401 without the v2 header.
    async fn imds_server() -> String {
        imds_server_with("vnics-vm.json").await
    }

    /// [`imds_server`] answering `/opc/v2/vnics/` with the fixture `vnics`.
    async fn imds_server_with(vnics: &'static str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let fixtures =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../oci/tests/fixtures");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let req = String::from_utf8_lossy(&buf).to_lowercase();
                let (status, body) = if !req.contains("\r\nauthorization: bearer oracle\r\n") {
                    ("401 Unauthorized", String::new())
                } else if req.starts_with("get /opc/v2/vnics/ ") {
                    (
                        "200 OK",
                        std::fs::read_to_string(fixtures.join(vnics)).unwrap(),
                    )
                } else if req.starts_with("get /opc/v2/instance/ ") {
                    (
                        "200 OK",
                        std::fs::read_to_string(fixtures.join("instance-vm.json")).unwrap(),
                    )
                } else {
                    ("404 Not Found", String::new())
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(resp.as_bytes()).await;
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn oci_layout_from_metadata_applies_and_reports_what_waits() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = netns("nk-test-agent-oci");
        // The primary VNIC and the second one are visible; the third is not attached yet.
        ip(
            &ns,
            &[
                "link",
                "add",
                "ens3",
                "address",
                "02:00:17:0a:11:01",
                "type",
                "veth",
                "peer",
                "name",
                "ens3p",
            ],
        );
        ip(
            &ns,
            &[
                "link",
                "add",
                "ens5",
                "address",
                "02:00:17:0a:22:02",
                "type",
                "veth",
                "peer",
                "name",
                "ens5p",
            ],
        );
        ip(&ns, &["link", "set", "ens5p", "up", "mtu", "9000"]);
        ip(&ns, &["addr", "add", "10.0.20.1/24", "dev", "ens5p"]);
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            let agent_with = |imds: Option<&str>| agent_in(&state_dir, imds);
            let oci_request = |json: &str, dry_run: bool| pb::ApplyNetworkRequest {
                oci_vnics: Some(pb::OciVnics {
                    enabled: true,
                    ..Default::default()
                }),
                ..request(json, dry_run)
            };
            let primary_before = ip(&name, &["addr", "show", "dev", "ens3"]);

            // Without --imds-endpoint: refused, naming the flag, nothing changed.
            let bare = agent_with(None);
            let m0 = bare.network();
            let e = status_of(m0.apply(oci_request("{}", false)).await.unwrap_err());
            assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
            assert!(e.message().contains("--imds-endpoint"), "{}", e.message());
            // oci_vnics present but not enabled: the metadata service is not needed.
            let mut off = oci_request("{}", true);
            off.oci_vnics = Some(pb::OciVnics::default());
            let r = m0.apply(off).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Planned as i32);
            assert!(r.plan.is_empty(), "{:?}", r.plan);

            // A metadata service that does not answer: UNAVAILABLE naming the endpoint.
            // (Port 1 on this namespace's loopback: connection refused, bounded retries.)
            let dead = agent_with(Some("http://127.0.0.1:1"));
            let md = dead.network();
            let e = status_of(md.apply(oci_request("{}", false)).await.unwrap_err());
            assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
            assert!(e.message().contains("http://127.0.0.1:1"), "{}", e.message());

            let endpoint = imds_server().await;
            let agent = agent_with(Some(&endpoint));
            let m = agent.network();

            // What the layout leaves out (the third VNIC has no interface yet).
            let no_sysfs = tempfile::tempdir().unwrap();
            let layout = m
                .oci_vnic_layout(
                    &endpoint,
                    no_sysfs.path(),
                    &nodekeeper_oci::LayoutOptions::default(),
                )
                .await
                .unwrap();
            assert_eq!(layout.waiting.len(), 1);
            assert!(
                layout.waiting[0]
                    .contains("waiting for an interface with MAC 02:00:17:0a:33:03")
            );

            // A given object that claims the VNIC's interface differently: refused, naming it.
            let clash = r#"{"links": [{"name": "mine", "kind": "existing", "mac": "02:00:17:0a:22:02", "mtu": 1500}]}"#;
            let e = status_of(m.apply(oci_request(clash, false)).await.unwrap_err());
            assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
            assert!(e.message().contains("links[0] (mine)"), "{}", e.message());
            // Bad layout knobs are the caller's.
            let mut bad = oci_request("{}", true);
            bad.oci_vnics = Some(pb::OciVnics {
                enabled: true,
                table_base: 253,
                ..Default::default()
            });
            let e = status_of(m.apply(bad).await.unwrap_err());
            assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
            assert!(e.message().starts_with("oci_vnics: "), "{}", e.message());

            // Dry run: the plan, no change.
            let r = m.apply(oci_request("{}", true)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Planned as i32);
            assert_eq!(r.netlink_writes, 0);
            assert!(!r.plan.is_empty());
            assert!(!ip(&name, &["addr", "show", "dev", "ens5"]).contains("10.0.20.33"));

            // Apply from the metadata alone (desired state `{}`).
            let r = m.apply(oci_request("{}", false)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
            assert!(r.netlink_writes > 0);
            // The VNIC laid out is named to the caller; the third, not attached yet, is not.
            assert_eq!(r.oci_vnic_ids, ["ocid1.vnic.oc1.phx.example1second"]);
            let addr = ip(&name, &["addr", "show", "dev", "ens5"]);
            assert!(addr.contains("inet 10.0.20.33/24"), "{addr}");
            assert!(addr.contains("mtu 9000"), "{addr}");
            assert_eq!(
                ip(&name, &["route", "show", "table", "101"]).trim(),
                "default via 10.0.20.1 dev ens5 proto 176"
            );
            let rules = ip(&name, &["rule", "show"]);
            assert!(
                rules.contains("20100:\tfrom all to 169.254.0.0/16 lookup main proto 176"),
                "{rules}"
            );
            assert!(
                rules.contains("20101:\tfrom 10.0.20.33 lookup 101 proto 176"),
                "{rules}"
            );
            // The primary VNIC was not touched.
            assert_eq!(ip(&name, &["addr", "show", "dev", "ens3"]), primary_before);
            assert!(!primary_before.contains("inet "));

            // Again, with the same object also given explicitly: kept once, nothing to do.
            let r = m.apply(oci_request(DESIRED, false)).await.unwrap();
            assert_eq!(
                (r.outcome, r.netlink_writes, r.plan.len()),
                (pb::ApplyOutcome::Applied as i32, 0, 0),
                "{:?}",
                r.plan
            );
        });
    }

    /// Regression (issue 20, defect 5): a dual-stack VNIC is applied from the metadata alone; a
    /// VNIC reusing the primary's address and a malformed answer are FAILED_PRECONDITION and
    /// show in the report's `last_error`; the primary is never touched.
    #[test]
    fn dual_stack_layout_applies_and_metadata_errors_reach_last_error() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = netns("nk-test-agent-oci6");
        for (dev, mac) in [("ens3", "02:00:17:0a:11:01"), ("ens5", "02:00:17:0a:22:02")] {
            let peer = format!("{dev}p");
            ip(
                &ns,
                &[
                    "link", "add", dev, "address", mac, "type", "veth", "peer", "name", &peer,
                ],
            );
        }
        ip(&ns, &["link", "set", "ens5p", "up", "mtu", "9000"]);
        ip(&ns, &["link", "set", "lo", "up"]);
        // The virtual routers answer the post-apply check from the veth peer.
        ip(&ns, &["addr", "add", "10.0.20.1/24", "dev", "ens5p"]);
        ip(
            &ns,
            &["addr", "add", "fd00:10:20::1/64", "dev", "ens5p", "nodad"],
        );
        let state = tempfile::tempdir().unwrap();
        let name = Arc::clone(&ns);
        let state_dir = state.path().to_string_lossy().into_owned();
        ns.run(move || async move {
            let agent_with = |imds: &str| agent_in(&state_dir, Some(imds));
            let oci = |dry_run: bool| pb::ApplyNetworkRequest {
                oci_vnics: Some(pb::OciVnics {
                    enabled: true,
                    ..Default::default()
                }),
                ..request("{}", dry_run)
            };
            let primary_before = ip(&name, &["addr", "show", "dev", "ens3"]);

            for (file, says) in [
                (
                    "vnics-vm-reuses-primary-ip.json",
                    "vnics[1].privateIp: 10.0.10.17 is also an address of vnics[0]",
                ),
                (
                    "vnics-vm-reuses-primary-ipv6.json",
                    "vnics[1].ipv6Addresses[0]: fd00:10:10::17 is also an address of vnics[0]",
                ),
                ("vnics-vm-null-subnet.json", "vnics[1].subnetCidrBlock"),
            ] {
                let agent = agent_with(&imds_server_with(file).await);
                let m = agent.network();
                // A dry run reports the error but leaves the status alone.
                let e = status_of(m.apply(oci(true)).await.unwrap_err());
                assert_eq!(
                    e.code(),
                    Code::FailedPrecondition,
                    "{file}: {}",
                    e.message()
                );
                assert!(m.status().last_error.is_empty(), "{file}");
                let e = status_of(m.apply(oci(false)).await.unwrap_err());
                assert_eq!(
                    e.code(),
                    Code::FailedPrecondition,
                    "{file}: {}",
                    e.message()
                );
                assert!(e.message().contains(says), "{file}: {}", e.message());
                let last = m.status().last_error;
                assert!(last.contains(says), "{file}: {last}");
                assert!(
                    last.starts_with("instance metadata: --imds-endpoint http://127.0.0.1:"),
                    "{last}"
                );
                assert_eq!(ip(&name, &["addr", "show", "dev", "ens3"]), primary_before);
                assert!(!ip(&name, &["addr", "show", "dev", "ens5"]).contains("inet"));
            }

            // The dual-stack layout is planned from the metadata alone, both families in
            // the VNIC's one table. (A real apply is not asserted here: netconf's
            // `add-route ::/0 via fd00:10:20::1 dev ens5 table 101` fails with EINVAL in
            // a netns while the same `ip -6 route add` succeeds; reported as open.)
            let agent = agent_with(&imds_server_with("vnics-vm-dual-stack.json").await);
            let m = agent.network();
            let r = m.apply(oci(true)).await.unwrap();
            assert_eq!(r.outcome, pb::ApplyOutcome::Planned as i32, "{}", r.message);
            let plan: Vec<&str> = r.plan.iter().map(|s| s.object.as_str()).collect();
            for want in [
                "10.0.20.33/24",
                "fd00:10:20::33/64",
                "via fd00:10:20::1",
                "from fd00:10:20::33",
            ] {
                assert!(plan.iter().any(|p| p.contains(want)), "{want}: {plan:?}");
            }
            assert!(m.status().last_error.is_empty(), "{:?}", m.status());
            assert_eq!(ip(&name, &["addr", "show", "dev", "ens3"]), primary_before);
        });
    }
}
