//! Lease renewals against a real kube-apiserver with audit logging: in steady state a renewal is
//! one request (a PUT from the last written object, no GET); a foreign write in between costs
//! one 409, one GET and one more PUT; a clean stop releases the Lease.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test controller_lease_renewal`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{Patch, PatchParams};
use nodekeeper_controller::runtime::leader::{self, LeaderConfig};
use nodekeeper_e2e::controlplane::{Lifetime, Options};
use nodekeeper_e2e::{ControlPlane, test_namespace, wait_for};
use tokio_util::sync::CancellationToken;

/// (verb, HTTP code) of every audited request on the Lease `name`.
fn lease_requests(text: &str, name: &str) -> anyhow::Result<Vec<(String, i64)>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)?;
        let object = &event["objectRef"];
        if object["resource"] == "leases" && object["name"] == name {
            out.push((
                event["verb"].as_str().unwrap_or_default().to_owned(),
                event["responseStatus"]["code"].as_i64().unwrap_or(0),
            ));
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_renewals_are_one_put_each_and_a_conflict_costs_one_get() -> anyhow::Result<()> {
    let mut options = Options::new(
        format!("test-{}-lease", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.audit = true;
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start(options)).await??;
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
    };
    let cancel = CancellationToken::new();
    let lease = leader::acquire(&api, &config, &cancel)
        .await
        .context("acquire without cancel returns the lease")?
        .lease;

    let holding = tokio::spawn({
        let (api, config, cancel) = (api.clone(), config.clone(), cancel.clone());
        async move { leader::hold(&api, &config, lease, &cancel).await }
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

    // The test's own final GET is the third GET; wait until the log has it.
    let requests = wait_for(
        "the audit log to show the final GET",
        Duration::from_secs(30),
        || {
            let audit_log = audit_log.clone();
            let name = config.name.clone();
            async move {
                let text = std::fs::read_to_string(&audit_log).unwrap_or_default();
                let requests = lease_requests(&text, &name)?;
                let gets = requests.iter().filter(|(v, _)| v == "get").count();
                Ok((gets >= 3).then_some(requests))
            }
        },
    )
    .await?;
    let mut by: BTreeMap<(String, i64), usize> = BTreeMap::new();
    for r in &requests {
        *by.entry(r.clone()).or_default() += 1;
    }
    // GETs: acquire's first look (404: no Lease yet), the one after the conflict, the test's own.
    assert_eq!(by.get(&("get".into(), 404)), Some(&1), "{by:?}");
    assert_eq!(by.get(&("get".into(), 200)), Some(&2), "{by:?}");
    assert_eq!(by.get(&("update".into(), 409)), Some(&1), "{by:?}");
    // ~15 renewals in 3 s at 200 ms, plus the release; each one PUT and nothing else.
    let puts = by.get(&("update".into(), 200)).copied().unwrap_or(0);
    assert!(puts >= 8, "expected many one-request renewals: {by:?}");
    assert_eq!(
        requests.len(),
        puts + 1 + 3 + 1 + 1,
        "create + gets + 409 + patch: {by:?}"
    );
    Ok(())
}
