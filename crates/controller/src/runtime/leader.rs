//! Leadership: one `coordination.k8s.io/v1` Lease in the controller's namespace. Only the holder
//! sweeps and writes. Acquire and renew use optimistic concurrency (every update carries the
//! resourceVersion of the Lease as this replica last saw or wrote it), so two replicas can never
//! both believe they won. A holder that cannot renew within the renew deadline gives up, and the
//! process exits so the Pod restarts as a standby.
//!
//! Expiry is judged by the *local* clock: a standby takes over when the Lease record has not
//! changed for `leaseDurationSeconds` since it last saw it change (as client-go does), so clock
//! skew between replicas does not matter.
//!
//! Only the leader writes: one renewal per retry period, a single PUT from the Lease as it last
//! wrote it (a GET only after a 409), the controller's steady write rate. A standby neither
//! writes nor polls: it lists the one Lease (field selector `metadata.name`) and then *watches*
//! it from that list's resourceVersion ([`Follower`]), so it sees each renewal as it happens and
//! a timer fires exactly `leaseDurationSeconds` after the last change it saw. After the leader
//! dies without releasing, the standby therefore takes over one lease duration after the dead
//! leader's last renewal, plus the delivery of that watch event and the acquiring PUT
//! ([`LeaderConfig::takeover_after_crash`]); a leader that shuts down cleanly releases the Lease
//! and the standby takes over as soon as the watch shows it. A view that is late is safe: it only
//! delays the takeover, and the acquiring PUT carries the resourceVersion seen, so a renewal the
//! standby missed makes it fail with 409 (then the standby lists again). If the watch breaks or
//! its resourceVersion is too old (410) the standby lists again; if the Role lacks `list` or
//! `watch` on leases it says so and reads the Lease every [`RETRY_AFTER_FAILURE`] instead.
//!
//! A Lease deleted, or emptied by anyone but its holder (a release sets the duration to 1 s),
//! is taken only once the record of the holder seen before it would have expired: that holder
//! learns of the loss only at its next renewal and writes until then.
//!
//! A renewal that failed is tried again after [`RETRY_AFTER_FAILURE`] rather than a whole retry
//! period, until the renew deadline, so an API server stall of up to renew deadline − retry
//! period ([`LeaderConfig::stall_tolerance`]) does not cost the leadership.
//!
//! The leader also labels its own Pod `nodekeeper.dev/leader=true` ([`label_pod`]) so that the
//! Service routes the HTTP API to it.

use std::collections::BTreeMap;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How soon a failed renewal, or a failed list or watch of the Lease, is tried again; and how
/// often a standby whose Role cannot list and watch leases reads the Lease instead.
pub const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// The server ends a standby's watch after this long; it is resumed from the last
/// resourceVersion seen (one request every few minutes).
const WATCH_TIMEOUT_SECS: u32 = 290;

/// Lease timing and identity.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    /// Annotations the leader's renewals (and its release) put on the Lease. Set while leading
    /// (e.g. `--node-selector` in force, `controllers::nodes::unselected`), they ride on the next
    /// renewal: no write of their own, so no conflict with the renewal, whose steady state stays
    /// one PUT.
    pub annotations: LeaseAnnotations,
}

pub use crate::shared::LeaseAnnotations;

impl LeaderConfig {
    /// How long after the leader's last renewal a standby takes the Lease when the leader died
    /// without releasing it: the standby watches the Lease, so it sees that renewal as it is
    /// written and acts a whole lease duration later. Add the watch event's delivery and one PUT
    /// (milliseconds on a healthy API server).
    pub fn takeover_after_crash(&self) -> Duration {
        self.lease_duration
    }

    /// How much sooner a leader that cannot renew gives up (at the renew deadline) than a
    /// standby may take over (the lease duration after the last renewal): its time to stop.
    pub fn safety_margin(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_deadline)
    }

    /// How long the API server may stall (or fail) at the moment a renewal falls due without
    /// the leader giving up: from the retry period after the last renewal to the renew deadline.
    pub fn stall_tolerance(&self) -> Duration {
        self.renew_deadline.saturating_sub(self.retry_period)
    }
}
/// The parts of a Lease that say who holds it; any change counts as a renewal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub holder: String,
    pub renew_time: String,
    pub transitions: i32,
    pub duration: Duration,
}

impl Record {
    pub fn of(lease: &Lease) -> Record {
        let spec = lease.spec.clone().unwrap_or_default();
        Record {
            holder: spec.holder_identity.unwrap_or_default(),
            renew_time: spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default(),
            transitions: spec.lease_transitions.unwrap_or(0),
            duration: Duration::from_secs(
                u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
            ),
        }
    }
}

/// True when `me` may take the Lease: it is free, already ours, or its record has not changed
/// for its whole duration since `changed_at` (local clock).
pub fn may_acquire(record: &Record, changed_at: Instant, now: Instant, me: &str) -> bool {
    record.holder.is_empty()
        || record.holder == me
        || now.saturating_duration_since(changed_at) >= record.duration
}

/// The duration a release writes (as client-go's does): a Lease with no holder and this
/// duration was given up by its holder, after it stopped; one with a longer duration was
/// emptied by someone else.
const RELEASED_DURATION: Duration = Duration::from_secs(1);

/// Errors of leadership.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("lost the lease {name}: {why}")]
    LoseLease { name: String, why: String },
}

fn spec(config: &LeaderConfig, transitions: i32, acquire_time: Option<MicroTime>) -> LeaseSpec {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(
            i32::try_from(config.lease_duration.as_secs())
                .unwrap_or(i32::MAX)
                .max(1),
        ),
        acquire_time: Some(acquire_time.unwrap_or_else(|| now.clone())),
        renew_time: Some(now),
        lease_transitions: Some(transitions),
        ..LeaseSpec::default()
    }
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// What this replica learnt about the Lease as it took it.
#[derive(Clone, Debug, PartialEq)]
pub struct Acquired {
    /// The last holder this replica saw (a released Lease has none, so the holder seen before
    /// the release counts); `None` when it never saw one.
    pub previous: Option<String>,
    /// When the previous holder last renewed, on this replica's clock: the Lease's renew time
    /// carried over by its age on the wall clock (a skewed clock moves it by the skew, which
    /// only shifts when nodes turn stale). `None` for a Lease this replica created.
    pub previous_renewed: Option<Instant>,
    /// The Lease as this replica wrote it, to renew from without reading it first.
    pub lease: Lease,
    /// When the write that took the Lease was sent: [`hold`]'s renew deadline counts from here
    /// (not from when `hold` starts, which may be seconds later), because a standby's clock for
    /// this holder starts no earlier.
    pub sent: Instant,
}

/// `renew_time`'s age by the wall clock, as an `Instant` on the local clock (never later than
/// `now`).
fn renewed_at(lease: &Lease, now: Instant) -> Option<Instant> {
    let renewed = lease.spec.as_ref()?.renew_time.as_ref()?.0;
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(renewed);
    let age = Duration::try_from(age).unwrap_or(Duration::ZERO);
    Some(now.checked_sub(age).unwrap_or(now))
}

fn is_forbidden(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 403)
}

fn is_gone(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 410)
}

/// What a [`Follower`] learnt.
enum Seen {
    /// The Lease as it is now (listed, read, or changed by a watch event); `None`: there is none.
    Lease(Option<Box<Lease>>),
    /// The deadline passed with no news.
    Deadline,
    /// `cancel` fired.
    Cancelled,
}

/// A standby's view of the one Lease: a list by field selector `metadata.name`, then a watch from
/// that list's resourceVersion, resumed from the last resourceVersion seen when the server ends
/// it, and replaced by a new list when it breaks (410 Gone included). Where the Role forbids
/// `list` or `watch` on leases it says so once and reads the Lease every
/// [`RETRY_AFTER_FAILURE`] instead.
struct Follower<'a> {
    api: &'a Api<Lease>,
    fields: String,
    /// The resourceVersion to watch from; `None`: list first.
    version: Option<String>,
    watch: Option<BoxStream<'static, kube::Result<WatchEvent<Lease>>>>,
    /// When the watch was opened: one that the server ends at once is not reopened sooner than
    /// [`RETRY_AFTER_FAILURE`] later.
    opened: tokio::time::Instant,
    /// No request before this (a pause after a failure, or the next read when polling).
    not_before: Option<tokio::time::Instant>,
    /// The Role cannot list or watch leases: read the Lease with GET instead.
    polling: bool,
}

impl<'a> Follower<'a> {
    fn new(api: &'a Api<Lease>, name: &str) -> Self {
        Follower {
            api,
            fields: format!("metadata.name={name}"),
            version: None,
            watch: None,
            opened: tokio::time::Instant::now(),
            not_before: None,
            polling: false,
        }
    }

    fn name(&self) -> &str {
        self.fields.trim_start_matches("metadata.name=")
    }

    /// Drops the watch: the next [`Follower::next`] lists again, after [`RETRY_AFTER_FAILURE`]
    /// if `pause` (after a failure).
    fn relist(&mut self, pause: bool) {
        self.version = None;
        self.watch = None;
        if pause {
            self.not_before = Some(tokio::time::Instant::now() + RETRY_AFTER_FAILURE);
        }
    }

    /// Waits for news of the Lease, `deadline` or `cancel`, whichever comes first. The deadline
    /// also ends a list or watch request that hangs (a half-open connection: the client has no
    /// read timeout), so a stuck request never keeps the standby from taking over.
    async fn next(
        &mut self,
        deadline: Option<tokio::time::Instant>,
        cancel: &CancellationToken,
    ) -> Seen {
        let until_deadline = || async move {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        loop {
            if let Some(at) = self.not_before {
                tokio::select! {
                    () = cancel.cancelled() => return Seen::Cancelled,
                    () = until_deadline() => return Seen::Deadline,
                    () = tokio::time::sleep_until(at) => self.not_before = None,
                }
            }
            if self.polling {
                self.not_before = Some(tokio::time::Instant::now() + RETRY_AFTER_FAILURE);
                let read = tokio::select! {
                    () = cancel.cancelled() => return Seen::Cancelled,
                    () = until_deadline() => return Seen::Deadline,
                    read = self.api.get_opt(self.name()) => read,
                };
                match read {
                    Ok(lease) => return Seen::Lease(lease.map(Box::new)),
                    Err(error) => warn!(%error, lease = %self.name(), "reading the lease failed"),
                }
                continue;
            }
            let Some(version) = self.version.clone() else {
                let params = ListParams::default().fields(&self.fields);
                let listed = tokio::select! {
                    () = cancel.cancelled() => return Seen::Cancelled,
                    () = until_deadline() => return Seen::Deadline,
                    listed = self.api.list(&params) => listed,
                };
                match listed {
                    Ok(list) => {
                        self.version = Some(list.metadata.resource_version.unwrap_or_default());
                        return Seen::Lease(list.items.into_iter().next().map(Box::new));
                    }
                    Err(error) if is_forbidden(&error) => self.fall_back_to_polling(&error),
                    Err(error) => {
                        warn!(%error, lease = %self.name(), "listing the lease failed");
                        self.relist(true);
                    }
                }
                continue;
            };
            let Some(watch) = self.watch.as_mut() else {
                let params = WatchParams::default()
                    .fields(&self.fields)
                    .timeout(WATCH_TIMEOUT_SECS);
                let opened = tokio::select! {
                    () = cancel.cancelled() => return Seen::Cancelled,
                    () = until_deadline() => return Seen::Deadline,
                    opened = self.api.watch(&params, &version) => opened,
                };
                match opened {
                    Ok(stream) => {
                        self.watch = Some(stream.boxed());
                        self.opened = tokio::time::Instant::now();
                    }
                    Err(error) if is_forbidden(&error) => self.fall_back_to_polling(&error),
                    Err(error) if is_gone(&error) => self.relist(false),
                    Err(error) => {
                        warn!(%error, lease = %self.name(), "watching the lease failed; listing it again");
                        self.relist(true);
                    }
                }
                continue;
            };
            let event = tokio::select! {
                () = cancel.cancelled() => return Seen::Cancelled,
                () = until_deadline() => return Seen::Deadline,
                event = watch.next() => event,
            };
            match event {
                // The server ended the watch (its timeout): resume where it stopped.
                None => {
                    self.watch = None;
                    self.not_before = Some(self.opened + RETRY_AFTER_FAILURE);
                }
                Some(Ok(WatchEvent::Added(lease) | WatchEvent::Modified(lease))) => {
                    self.version =
                        Some(lease.metadata.resource_version.clone().unwrap_or_default());
                    return Seen::Lease(Some(Box::new(lease)));
                }
                Some(Ok(WatchEvent::Deleted(lease))) => {
                    self.version = Some(lease.metadata.resource_version.unwrap_or_default());
                    return Seen::Lease(None);
                }
                Some(Ok(WatchEvent::Bookmark(bookmark))) => {
                    self.version = Some(bookmark.metadata.resource_version);
                }
                // 410: the resourceVersion is older than the server keeps; list again at once.
                Some(Ok(WatchEvent::Error(status))) if status.code == 410 => self.relist(false),
                Some(Ok(WatchEvent::Error(status))) => {
                    warn!(error = %status.message, code = status.code, lease = %self.name(), "the lease's watch failed; listing it again");
                    self.relist(true);
                }
                Some(Err(error)) => {
                    warn!(%error, lease = %self.name(), "the lease's watch failed; listing it again");
                    self.relist(true);
                }
            }
        }
    }

    fn fall_back_to_polling(&mut self, error: &kube::Error) {
        warn!(%error, lease = %self.name(), "the controller's Role cannot list and watch leases; reading the lease every second instead until this replica restarts (apply the Role of deploy/controller/controller.yaml or the chart: leases need get, list, watch, create, update)");
        self.polling = true;
        self.version = None;
        self.watch = None;
    }
}

/// Blocks until this replica holds the Lease (Some, with the object as written, to renew from)
/// or `cancel` fires (None). While another replica holds it, this replica watches it
/// ([`Follower`]) and tries to take it when its record has not changed for its duration; a free
/// Lease, or none, is taken at once.
pub async fn acquire(
    api: &Api<Lease>,
    config: &LeaderConfig,
    cancel: &CancellationToken,
) -> Option<Acquired> {
    let mut follower = Follower::new(api, &config.name);
    // The Lease as last seen, its record, and when that record was first seen (local clock).
    let mut view: Option<(Lease, Record, Instant)> = None;
    let mut deadline = None;
    let mut announced_standby = false;
    let mut last_holder: Option<String> = None;
    // There is no Lease (deleted, or none yet).
    let mut absent = false;
    // Until when another replica seen holding the Lease may still act on it: its record's
    // last change seen + its duration (local clock).
    let mut held_until: Option<Instant> = None;
    let mut announced_wait = false;
    loop {
        match follower.next(deadline, cancel).await {
            Seen::Cancelled => return None,
            Seen::Deadline => {}
            Seen::Lease(None) => {
                view = None;
                absent = true;
            }
            Seen::Lease(Some(lease)) => {
                absent = false;
                let record = Record::of(&lease);
                let now = Instant::now();
                if !record.holder.is_empty() {
                    last_holder = Some(record.holder.clone());
                }
                let changed_at = match &view {
                    Some((_, seen, at)) if *seen == record => *at,
                    _ => now,
                };
                if !record.holder.is_empty() && record.holder != config.identity {
                    held_until = Some(changed_at + record.duration);
                }
                view = Some((*lease, record, changed_at));
            }
        }
        // A Lease deleted, or emptied by someone other than its holder (a release sets the
        // duration to 1 s, `put_ours`), says nothing about the holder seen before: it renews
        // only every retry period and learns of the loss at its next renewal, writing until
        // then. Take it only once that holder's record would have expired.
        let emptied = view.as_ref().is_some_and(|(_, record, _)| {
            record.holder.is_empty() && record.duration > RELEASED_DURATION
        });
        if (absent || emptied)
            && let Some(until) = held_until.filter(|until| *until > Instant::now())
        {
            if !announced_wait {
                announced_wait = true;
                info!(
                    previous = last_holder.as_deref().unwrap_or("none seen"),
                    wait = ?until.saturating_duration_since(Instant::now()),
                    lease = %config.name,
                    "the lease was deleted or emptied while another replica held it; waiting until its record would have expired"
                );
            }
            deadline = Some(tokio::time::Instant::from_std(until));
            continue;
        }
        if absent {
            deadline = None;
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(config.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec(config, 0, None)),
            };
            let sent = Instant::now();
            match api.create(&PostParams::default(), &lease).await {
                Ok(written) => {
                    return Some(Acquired {
                        previous: last_holder,
                        previous_renewed: None,
                        lease: written,
                        sent,
                    });
                }
                // Another replica created it first: look again.
                Err(e) if is_conflict(&e) => follower.relist(false),
                Err(error) => {
                    warn!(%error, lease = %config.name, "creating the lease failed");
                    follower.relist(true);
                }
            }
            continue;
        }
        let Some((lease, record, changed_at)) = &view else {
            deadline = None;
            continue;
        };
        let now = Instant::now();
        if !may_acquire(record, *changed_at, now, &config.identity) {
            if !announced_standby {
                announced_standby = true;
                info!(holder = %record.holder, lease = %config.name, "standing by; another replica leads");
            }
            deadline = Some(tokio::time::Instant::from_std(
                *changed_at + record.duration,
            ));
            continue;
        }
        // Until the next view: a failed attempt must not be repeated at once.
        deadline = None;
        let ours = record.holder == config.identity;
        let transitions = if ours {
            record.transitions
        } else {
            record.transitions + 1
        };
        let acquire_time = if ours {
            lease.spec.as_ref().and_then(|s| s.acquire_time.clone())
        } else {
            None
        };
        let previous_renewed = renewed_at(lease, now);
        let mut update = lease.clone();
        update.spec = Some(spec(config, transitions, acquire_time));
        // replace() sends the resourceVersion last seen: a write since (a renewal this view
        // missed, another standby) makes this fail with 409 instead of overwriting it.
        let sent = Instant::now();
        match api
            .replace(&config.name, &PostParams::default(), &update)
            .await
        {
            Ok(written) => {
                let how = if record.holder.is_empty() {
                    "released"
                } else if ours {
                    "held by this identity before a restart"
                } else {
                    "expired"
                };
                info!(
                    previous = last_holder.as_deref().unwrap_or("none seen"),
                    how,
                    lease = %config.name,
                    "took over the lease"
                );
                return Some(Acquired {
                    previous: last_holder,
                    previous_renewed,
                    lease: written,
                    sent,
                });
            }
            Err(e) if is_conflict(&e) => follower.relist(false),
            Err(error) => {
                warn!(%error, lease = %config.name, "taking the lease failed");
                follower.relist(true);
            }
        }
    }
}

/// Renews the Lease every retry period until it is lost (Err) or `cancel` fires (Ok, with the
/// Lease as last written). The caller then takes the leader label off its Pod and [`release`]s
/// the Lease from that object, in that order, so the Service never routes to a replica that no
/// longer leads. `written` is the Lease as this replica last wrote it and `sent` when that write
/// was sent ([`Acquired::lease`], [`Acquired::sent`]).
///
/// Every time counts from when a successful renewal was *sent*: the API server wrote it no
/// earlier, so a standby (which starts its lease-duration clock when it sees the write) never
/// takes over sooner than the lease duration after it. The leader gives up at that instant +
/// the renew deadline at the latest, whatever its requests' answer times, which keeps
/// [`LeaderConfig::safety_margin`] between its give-up and any takeover.
pub async fn hold(
    api: &Api<Lease>,
    config: &LeaderConfig,
    mut written: Lease,
    sent: Instant,
    cancel: &CancellationToken,
) -> Result<Lease, LeaderError> {
    let mut last_renew = sent;
    let lost = |why: String| LeaderError::LoseLease {
        name: config.name.clone(),
        why,
    };
    let mut failing = false;
    loop {
        let give_up_at = last_renew + config.renew_deadline;
        let due = if failing {
            (Instant::now() + RETRY_AFTER_FAILURE).min(give_up_at)
        } else {
            last_renew + config.retry_period
        };
        tokio::select! {
            () = cancel.cancelled() => return Ok(written),
            () = tokio::time::sleep_until(tokio::time::Instant::from_std(due)) => {}
        }
        // A renewal may not outlast the renew deadline. The client's own read timeout is minutes
        // (it serves watches too), and an API server that accepts the connection but never
        // answers (hung, partitioned behind a proxy) would hold this replica in a request
        // while its Lease expires and another replica takes over: two leaders. Found by the
        // fault campaign (tests/tests/apiserver_outage.rs, issue #20).
        let left = give_up_at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(lost(format!(
                "not renewed for {:?} (renew deadline {:?})",
                last_renew.elapsed(),
                config.renew_deadline
            )));
        }
        let attempt = Instant::now();
        let renewal =
            match tokio::time::timeout(left, put_ours(api, config, &written, Renewal::Renew)).await
            {
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(_) => Err(format!("no answer within {left:?}")),
            };
        match renewal {
            Ok(Held::Ours(lease)) => {
                written = *lease;
                last_renew = attempt;
                failing = false;
            }
            Ok(Held::By(holder)) => return Err(lost(format!("now held by {holder:?}"))),
            Err(error) => {
                failing = true;
                warn!(%error, lease = %config.name, "renewing the lease failed");
                if Instant::now() >= give_up_at {
                    return Err(lost(format!(
                        "not renewed for {:?} (renew deadline {:?}): {error}",
                        last_renew.elapsed(),
                        config.renew_deadline
                    )));
                }
            }
        }
    }
}

/// [`hold`] on a thread of its own, with a runtime and an API client (so a connection) of its
/// own, built from `kube_config`: the renewals do not wait behind the controllers' work.
///
/// On the controllers' runtime a renewal is one task among the sweep's hundreds of agent calls
/// and the watches' decoding of Node pages, and its request shares their HTTP/2 connection. At
/// 65,000 nodes on a loaded 2-core machine a restarted leader's renewal timer woke 0.8 s late,
/// its PUT reached the API server 0.9 s after that, and the answer (sent within 2 ms) was not
/// read before the renew deadline, 2 s after the retry period: it gave up the Lease in its
/// first minute (`cargo xtask bench fleet --nodes 65000`, issue #18). A thread that does
/// nothing else is woken by the kernel when its timer fires, whatever the other threads do.
pub async fn hold_apart(
    kube_config: kube::Config,
    namespace: String,
    config: LeaderConfig,
    written: Lease,
    sent: Instant,
    cancel: CancellationToken,
) -> Result<Lease, LeaderError> {
    let name = config.name.clone();
    let lost = |why: String| LeaderError::LoseLease {
        name: name.clone(),
        why,
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("lease-renewal".into())
        .spawn(move || {
            let held = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(async {
                    let client = kube::Client::try_from(kube_config).map_err(|e| {
                        LeaderError::LoseLease {
                            name: config.name.clone(),
                            why: format!("the renewals' API client: {e}"),
                        }
                    })?;
                    let api: Api<Lease> = Api::namespaced(client, &namespace);
                    hold(&api, &config, written, sent, &cancel).await
                }),
                Err(e) => Err(LeaderError::LoseLease {
                    name: config.name.clone(),
                    why: format!("the renewals' runtime: {e}"),
                }),
            };
            // The receiver is gone only when the controller is already stopping.
            let _ = tx.send(held);
        })
        .map_err(|e| lost(format!("the renewals' thread: {e}")))?;
    rx.await
        .map_err(|_| lost("the renewals' thread ended without an answer".into()))?
}

/// What a renewal or release found.
enum Held {
    /// We still hold it (renewed: the object as written now) or just gave it up (released).
    Ours(Box<Lease>),
    /// Someone else holds it now.
    By(String),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Renewal {
    Renew,
    Release,
}

/// One PUT from `last` (our own last write); on 409 one GET, and if the Lease is still ours one
/// more PUT from what the GET returned. Steady state is therefore one request per renewal.
async fn put_ours(
    api: &Api<Lease>,
    config: &LeaderConfig,
    last: &Lease,
    what: Renewal,
) -> Result<Held, kube::Error> {
    let update = |mut lease: Lease| {
        let record = Record::of(&lease);
        let ours = config
            .annotations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if !ours.is_empty() {
            lease
                .metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .extend(ours);
        }
        match what {
            Renewal::Renew => {
                let acquire_time = lease.spec.as_ref().and_then(|s| s.acquire_time.clone());
                lease.spec = Some(spec(config, record.transitions, acquire_time));
            }
            Renewal::Release => {
                if let Some(spec) = lease.spec.as_mut() {
                    spec.holder_identity = None;
                    spec.lease_duration_seconds = Some(1);
                }
            }
        }
        lease
    };
    match api
        .replace(&config.name, &PostParams::default(), &update(last.clone()))
        .await
    {
        Ok(lease) => return Ok(Held::Ours(Box::new(lease))),
        Err(e) if is_conflict(&e) => {}
        Err(e) => return Err(e),
    }
    // Someone else wrote since our last write: look before writing again.
    let current = api.get(&config.name).await?;
    let record = Record::of(&current);
    if record.holder != config.identity {
        return Ok(Held::By(record.holder));
    }
    let lease = api
        .replace(&config.name, &PostParams::default(), &update(current))
        .await?;
    Ok(Held::Ours(Box::new(lease)))
}

/// Gives the Lease up (best effort) so the standby takes over at once: one PUT from the Lease as
/// last written, a GET only on conflict.
pub async fn release(api: &Api<Lease>, config: &LeaderConfig, written: Lease) {
    match put_ours(api, config, &written, Renewal::Release).await {
        Ok(Held::Ours(_)) => info!(lease = %config.name, "released the lease"),
        Ok(Held::By(_)) => {}
        Err(error) => warn!(%error, lease = %config.name, "releasing the lease failed"),
    }
}

/// Tries of the leader label: the first, then after 1, 2 and 4 s.
const LABEL_TRIES: u32 = 4;
/// How long one label patch may take; the client itself sets no read timeout, and a patch that
/// hangs must not hold up the takeover or the release of the Lease.
const LABEL_PATCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `attempt` up to `tries` times, waiting 1, 2, 4, … s between failures; the last error if
/// none succeeded.
async fn with_retries<T, E, F, Fut>(tries: u32, mut attempt: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut wait = Duration::from_secs(1);
    let mut tried = 1;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(error) if tried >= tries => return Err(error),
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait *= 2;
                tried += 1;
            }
        }
    }
}

/// Labels this replica's Pod as leader or not (only with `--pod-name`): the Service routes the
/// HTTP API by this label. Tried [`LABEL_TRIES`] times, each patch bounded by
/// [`LABEL_PATCH_TIMEOUT`] (at most about 27 s in all); a label still not written is logged.
pub async fn label_pod(client: &kube::Client, namespace: &str, pod: Option<&str>, leader: bool) {
    let Some(pod) = pod else { return };
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let body = serde_json::json!({ "metadata": { "labels": { "nodekeeper.dev/leader": leader.to_string() } } });
    let patch = || async {
        match tokio::time::timeout(
            LABEL_PATCH_TIMEOUT,
            api.patch(pod, &PatchParams::default(), &Patch::Merge(&body)),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!("no answer within {LABEL_PATCH_TIMEOUT:?}")),
        }
    };
    if let Err(error) = with_retries(LABEL_TRIES, patch).await {
        warn!(%error, pod, leader, tries = LABEL_TRIES, "labelling the Pod failed; the Service may route the HTTP API to the wrong replica until the next change of leader");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(holder: &str) -> Record {
        Record {
            holder: holder.into(),
            renew_time: "t".into(),
            transitions: 1,
            duration: Duration::from_secs(15),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_leader_label_is_tried_again_a_bounded_number_of_times() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let failing_twice = || async {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n < 2 { Err(n) } else { Ok(n) }
        };
        assert_eq!(with_retries(LABEL_TRIES, failing_twice).await, Ok(2));
        calls.store(0, std::sync::atomic::Ordering::SeqCst);
        let started = tokio::time::Instant::now();
        let never = || async {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err::<(), _>("refused")
        };
        assert_eq!(with_retries(LABEL_TRIES, never).await, Err("refused"));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), LABEL_TRIES);
        // Waits of 1, 2 and 4 s between the four tries.
        assert_eq!(started.elapsed(), Duration::from_secs(7));
    }

    #[test]
    fn free_or_own_leases_are_taken_at_once() {
        let now = Instant::now();
        assert!(may_acquire(&record(""), now, now, "me"));
        assert!(may_acquire(&record("me"), now, now, "me"));
        assert!(!may_acquire(&record("other"), now, now, "me"));
    }

    #[test]
    fn the_default_timings_take_over_within_14s_write_at_most_0_1_per_s_and_keep_a_margin() {
        let cli = <crate::runtime::cli::Cli as clap::Parser>::parse_from(["nodekeeper-controller"]);
        cli.check().unwrap();
        let config = LeaderConfig {
            name: "l".into(),
            identity: "me".into(),
            lease_duration: cli.lease_duration,
            renew_deadline: cli.renew_deadline,
            retry_period: cli.retry_period,
            annotations: LeaseAnnotations::default(),
        };
        // The documented failover after a crash (docs/scaling.md; the fault campaign's bound,
        // issue #20, is 15 s): a lease duration after the last renewal, plus one PUT.
        assert!(config.takeover_after_crash() <= Duration::from_secs(14));
        // Between the leader giving up and the standby's earliest takeover: time for the
        // leader to stop its controllers.
        assert!(config.safety_margin() >= Duration::from_secs(2));
        // A renewal that fell due during an API server stall is tried again (every second)
        // for a while before the leader gives up.
        assert!(config.stall_tolerance() >= 2 * RETRY_AFTER_FAILURE);
        // Issue #18: the steady write rate is one renewal per 10 s (0.1 writes/s) or less.
        assert!(cli.retry_period >= Duration::from_secs(10));
    }

    #[test]
    fn a_held_lease_expires_by_the_local_clock() {
        let seen = Instant::now();
        assert!(!may_acquire(
            &record("other"),
            seen,
            seen + Duration::from_secs(14),
            "me"
        ));
        assert!(may_acquire(
            &record("other"),
            seen,
            seen + Duration::from_secs(15),
            "me"
        ));
    }
}
