//! Lease renewals against a real kube-apiserver with audit logging: in steady state a renewal is
//! one request (a PUT from the last written object, no GET); a foreign write in between costs
//! one 409, one GET and one more PUT; a clean stop releases the Lease. A standby lists the Lease
//! once and then only watches it (no GET, no list, no write while the leader renews), and takes
//! over one lease duration after the last renewal of a leader that stopped without releasing.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test controller_lease_renewal`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{Patch, PatchParams};
use nodekeeper_controller::runtime::leader::{self, LeaderConfig};
use nodekeeper_e2e::controlplane::{Lifetime, Options};
use nodekeeper_e2e::{ControlPlane, test_namespace, wait_for};
use tokio_util::sync::CancellationToken;

/// One control plane with an audit log for the tests of this file (it dies with the process).
fn control_plane() -> &'static ControlPlane {
    static CLUSTER: OnceLock<ControlPlane> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let mut options = Options::new(
            format!("test-{}-lease", std::process::id()),
            Lifetime::WithThisProcess,
        );
        options.audit = true;
        ControlPlane::start(options).expect("start the control plane")
    })
}

async fn started() -> anyhow::Result<&'static ControlPlane> {
    Ok(tokio::task::spawn_blocking(control_plane).await?)
}

/// An audited request on a Lease.
#[derive(Clone, Debug)]
struct Request {
    verb: String,
    code: i64,
    /// `ResponseStarted` (a watch, when it opens) or `ResponseComplete`.
    stage: String,
    user_agent: String,
    received: SystemTime,
    completed: SystemTime,
}

fn timestamp(event: &serde_json::Value, field: &str) -> anyhow::Result<SystemTime> {
    let stamp = event[field]
        .as_str()
        .with_context(|| format!("audit event without {field}"))?;
    Ok(SystemTime::from(
        stamp.parse::<k8s_openapi::jiff::Timestamp>()?,
    ))
}

/// Every audited request on the Lease `namespace`/`name` (a list or watch by field selector
/// `metadata.name` carries the name too).
fn lease_requests(audit_log: &Path, namespace: &str, name: &str) -> anyhow::Result<Vec<Request>> {
    let text = std::fs::read_to_string(audit_log).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)?;
        let object = &event["objectRef"];
        if object["resource"] == "leases"
            && object["namespace"] == namespace
            && object["name"] == name
        {
            out.push(Request {
                verb: event["verb"].as_str().unwrap_or_default().to_owned(),
                code: event["responseStatus"]["code"].as_i64().unwrap_or(0),
                stage: event["stage"].as_str().unwrap_or_default().to_owned(),
                user_agent: event["userAgent"].as_str().unwrap_or_default().to_owned(),
                received: timestamp(&event, "requestReceivedTimestamp")?,
                completed: timestamp(&event, "stageTimestamp")?,
            });
        }
    }
    Ok(out)
}

/// A client of the control plane's admin user that sends `user_agent`, so the audit log tells
/// its requests apart.
async fn client_as(cp: &ControlPlane, user_agent: &str) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(cp.kubeconfig())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_str(user_agent)?,
    ));
    Ok(kube::Client::try_from(config)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_renewals_are_one_put_each_and_a_conflict_costs_one_get() -> anyhow::Result<()> {
    let cp = started().await?;
    let audit_log = cp.audit_log().context("audit enabled")?;
    let client = cp.client().await?;
    let ns = test_namespace(&client, "nk-lease").await?;
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let config = LeaderConfig {
        name: "renewal".into(),
        identity: "replica-a".into(),
        lease_duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(200),
        annotations: Default::default(),
    };
    let cancel = CancellationToken::new();
    let acquired = leader::acquire(&api, &config, &cancel)
        .await
        .context("acquire without cancel returns the lease")?;

    let holding = tokio::spawn({
        let (api, config, cancel) = (api.clone(), config.clone(), cancel.clone());
        async move { leader::hold(&api, &config, acquired.lease, acquired.sent, &cancel).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    // A foreign write (a patch, so it is told apart in the log) moves the resourceVersion on.
    api.patch(
        &config.name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"touched": "yes"}}})),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    cancel.cancel();
    // `hold` hands back the Lease as last written; the caller (the runtime) releases from it
    // once its Pod label is off.
    let written = holding.await??;
    leader::release(&api, &config, written).await;
    let released = api.get(&config.name).await?;
    assert_eq!(
        released.spec.and_then(|s| s.holder_identity),
        None,
        "a clean stop releases the lease"
    );

    // The test's own final GET is the second GET; wait until the log has it.
    let requests = wait_for(
        "the audit log to show the final GET",
        Duration::from_secs(30),
        || {
            let (audit_log, ns, name) = (audit_log.clone(), ns.clone(), config.name.clone());
            async move {
                let requests = lease_requests(&audit_log, &ns, &name)?;
                let gets = requests.iter().filter(|r| r.verb == "get").count();
                Ok((gets >= 2).then_some(requests))
            }
        },
    )
    .await?;
    let mut by: BTreeMap<(String, i64), usize> = BTreeMap::new();
    for r in &requests {
        *by.entry((r.verb.clone(), r.code)).or_default() += 1;
    }
    // acquire's first look is a list by name (empty: no Lease yet), then it creates the Lease.
    assert_eq!(by.get(&("list".into(), 200)), Some(&1), "{by:?}");
    assert_eq!(by.get(&("create".into(), 201)), Some(&1), "{by:?}");
    // GETs: the one after the conflict, the test's own.
    assert_eq!(by.get(&("get".into(), 200)), Some(&2), "{by:?}");
    assert_eq!(by.get(&("update".into(), 409)), Some(&1), "{by:?}");
    // ~15 renewals in 3 s at 200 ms, plus the release; each one PUT and nothing else.
    let puts = by.get(&("update".into(), 200)).copied().unwrap_or(0);
    assert!(puts >= 8, "expected many one-request renewals: {by:?}");
    assert_eq!(
        requests.len(),
        puts + 1 + 1 + 2 + 1 + 1,
        "create + list + gets + 409 + patch: {by:?}"
    );
    Ok(())
}

/// Issue #18 "Quieter leadership": over a steady window the leader writes once per retry period
/// (and reads nothing), the standby neither writes nor reads (its one watch shows every renewal),
/// and when the leader stops without releasing, the standby takes the Lease one lease duration
/// after the last renewal, not polls later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_only_watches_and_takes_over_a_lease_duration_after_the_last_renewal()
-> anyhow::Result<()> {
    const LEADER_AGENT: &str = "nodekeeper-test/leader";
    const STANDBY_AGENT: &str = "nodekeeper-test/standby";
    let cp = started().await?;
    let audit_log = cp.audit_log().context("audit enabled")?;
    let admin = cp.client().await?;
    let ns = test_namespace(&admin, "nk-standby").await?;
    let leader_api: Api<Lease> = Api::namespaced(client_as(cp, LEADER_AGENT).await?, &ns);
    let standby_api: Api<Lease> = Api::namespaced(client_as(cp, STANDBY_AGENT).await?, &ns);
    let timing = |identity: &str| LeaderConfig {
        name: "standby".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(4),
        renew_deadline: Duration::from_secs(3),
        retry_period: Duration::from_secs(1),
        annotations: Default::default(),
    };
    let (a, b) = (timing("replica-a"), timing("replica-b"));
    let never = CancellationToken::new();
    let acquired = leader::acquire(&leader_api, &a, &never)
        .await
        .context("the first replica takes the free Lease")?;
    let holding = tokio::spawn({
        let (api, a) = (leader_api.clone(), a.clone());
        async move { leader::hold(&api, &a, acquired.lease, acquired.sent, &never).await }
    });
    let standby = tokio::spawn({
        let (api, b) = (standby_api.clone(), b.clone());
        async move {
            let taken = leader::acquire(&api, &b, &CancellationToken::new()).await;
            (taken, Instant::now())
        }
    });

    // The steady window, once the standby has listed the Lease and opened its watch.
    wait_for(
        "the standby's watch of the Lease",
        Duration::from_secs(30),
        || {
            let (audit_log, ns) = (audit_log.clone(), ns.clone());
            async move {
                Ok(lease_requests(&audit_log, &ns, "standby")?
                    .iter()
                    .any(|r| r.user_agent == STANDBY_AGENT && r.verb == "watch")
                    .then_some(()))
            }
        },
    )
    .await?;
    let window = Duration::from_secs(8);
    let from = SystemTime::now();
    tokio::time::sleep(window).await;
    let to = SystemTime::now();
    assert!(!standby.is_finished(), "the standby took a renewed Lease");

    // The leader stops renewing without releasing (as after SIGKILL).
    holding.abort();
    let _ = holding.await;
    let stopped = Instant::now();
    let (taken, taken_at) = standby.await?;
    let taken = taken.context("the standby returns once it holds the Lease")?;
    assert_eq!(taken.previous.as_deref(), Some("replica-a"));
    eprintln!(
        "standby took over {:?} after the leader stopped",
        taken_at - stopped
    );

    tokio::time::sleep(Duration::from_secs(2)).await;
    let requests = lease_requests(&audit_log, &ns, "standby")?;
    let in_window = |r: &&Request| r.received >= from && r.completed <= to;
    let mut by: BTreeMap<(&str, &str, i64), usize> = BTreeMap::new();
    for r in requests.iter().filter(in_window) {
        *by.entry((r.user_agent.as_str(), r.verb.as_str(), r.code))
            .or_default() += 1;
    }
    eprintln!("requests on the Lease in the {window:?} window: {by:?}");
    let of = |agent: &str| {
        by.iter()
            .filter(|((a, _, _), _)| *a == agent)
            .map(|(k, n)| (k.1, k.2, *n))
            .collect::<Vec<_>>()
    };
    // The leader: renewals only, one PUT per retry period (the window may hold one more, as
    // its edges cut the period).
    let renewals = by.get(&(LEADER_AGENT, "update", 200)).copied().unwrap_or(0);
    let most = (window.as_secs_f64() / a.retry_period.as_secs_f64()).floor() as usize + 1;
    assert!(
        (most - 3..=most).contains(&renewals),
        "leader: {renewals} renewals in {window:?} at one per {:?}: {by:?}",
        a.retry_period
    );
    assert_eq!(
        of(LEADER_AGENT),
        vec![("update", 200, renewals)],
        "the leader made no other request: {by:?}"
    );
    // The standby: nothing that completed in the window (its watch is still open).
    assert_eq!(
        of(STANDBY_AGENT),
        vec![],
        "the standby neither reads nor writes while it watches: {by:?}"
    );

    // The takeover: the standby's winning PUT, against the leader's last renewal.
    let last_renewal = requests
        .iter()
        .filter(|r| r.user_agent == LEADER_AGENT && r.verb == "update" && r.code == 200)
        .map(|r| r.completed)
        .max()
        .context("the leader's renewals")?;
    let takeover = requests
        .iter()
        .filter(|r| r.user_agent == STANDBY_AGENT && r.verb == "update" && r.code == 200)
        .map(|r| r.received)
        .min()
        .context("the standby's takeover")?;
    let after = takeover.duration_since(last_renewal)?;
    eprintln!(
        "takeover {after:?} after the last renewal (lease duration {:?})",
        b.lease_duration
    );
    // Never before the lease expired on the standby's clock (it saw the renewal after the API
    // server answered it, within the audit timestamps' precision), and not polls later: the
    // watch showed the last renewal when it was written and a timer fired at its expiry.
    assert!(
        after + Duration::from_millis(100) >= b.lease_duration,
        "taken over {after:?} after the last renewal, before the lease duration"
    );
    assert!(
        after <= b.lease_duration + Duration::from_millis(700),
        "taken over {after:?} after the last renewal"
    );
    let standby_requests: Vec<(String, i64)> = requests
        .iter()
        .filter(|r| r.user_agent == STANDBY_AGENT && r.stage == "ResponseComplete")
        .map(|r| (r.verb.clone(), r.code))
        .collect();
    // Its whole life: one list, then the watch (open until it took the Lease), then the PUT.
    assert_eq!(
        standby_requests
            .iter()
            .filter(|(v, _)| v == "get" || v == "list")
            .count(),
        1,
        "{standby_requests:?}"
    );
    Ok(())
}

/// The leader renews apart from the runtime its controllers run on (`leader::hold_apart`): with
/// that runtime's only thread blocked for twice the lease duration, the Lease is still renewed
/// every retry period and is still held when the thread is free again. (On the controllers'
/// runtime, as before, the renewals stop with it and the Lease is lost.)
#[test]
fn renewals_go_on_while_the_controllers_runtime_is_blocked() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let cp = started().await?;
        let client = cp.client().await?;
        let ns = test_namespace(&client, "nk-lease").await?;
        let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
        let config = LeaderConfig {
            name: "apart".into(),
            identity: "replica-a".into(),
            lease_duration: Duration::from_secs(3),
            renew_deadline: Duration::from_secs(2),
            retry_period: Duration::from_millis(500),
            annotations: Default::default(),
        };
        let cancel = CancellationToken::new();
        let acquired = leader::acquire(&api, &config, &cancel)
            .await
            .context("acquire without cancel returns the lease")?;
        let kube_config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(cp.kubeconfig())?,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?;
        let holding = tokio::spawn(leader::hold_apart(
            kube_config,
            ns.clone(),
            config.clone(),
            acquired.lease,
            acquired.sent,
            cancel.clone(),
        ));
        let renewed = |lease: &Lease| {
            lease
                .spec
                .as_ref()
                .and_then(|s| s.renew_time.as_ref())
                .map(|t| t.0.as_millisecond())
                .unwrap_or(0)
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = renewed(&api.get(&config.name).await?);
        // Nothing of this runtime runs for 6 s: not the task awaiting `hold_apart`, not a timer.
        std::thread::sleep(Duration::from_secs(6));
        let lease = api.get(&config.name).await?;
        let after = renewed(&lease);
        assert!(
            after - before >= 4_000,
            "renewTime moved {} ms while the runtime was blocked for 6 s (retry period 500 ms)",
            after - before
        );
        assert_eq!(
            lease.spec.and_then(|s| s.holder_identity).as_deref(),
            Some("replica-a")
        );
        assert!(
            !holding.is_finished(),
            "the leadership ended while the runtime was blocked"
        );
        cancel.cancel();
        let written = holding
            .await?
            .context("a cancelled hold hands back the Lease")?;
        leader::release(&api, &config, written).await;
        Ok(())
    })
}
