//! The leader's certificate upkeep: the Secrets are ensured once when it starts leading (see
//! [`crate::certs`]) and re-checked every [`certs::RENEW_CHECK`]; a check whose client
//! certificate differs from the one in use hands it to the agents service (only then: a new
//! TLS configuration drops every session the agents' connections could resume).
//!
//! Every check is bounded ([`ensure_bounded`]) and counted: failures in
//! `nodekeeper_controller_certificate_check_failures_total`, and each certificate's expiry in
//! `nodekeeper_controller_certificate_expiry_timestamp_seconds{secret}`, which the alerts
//! `NodekeeperCertificateExpiring` and `NodekeeperCertificateCheckFailing` watch.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::certs::{self, CertError, Pem};
use crate::shared::MtlsAgents;
use crate::shared::metrics::{RuntimeMetrics, SecretLabels};

/// How long one certificate check may take. The API client has no read timeout of its own,
/// and a check that hangs at the start of leadership would keep the new leader from ever
/// starting its controllers.
const CHECK_TIMEOUT: Duration = Duration::from_secs(20);
/// Tries of a check that failed on the API server (a CA Secret that cannot sign is not tried
/// again): the first, then after 1 and 2 s.
const CHECK_TRIES: u32 = 3;

/// [`certs::ensure_all`], each try bounded by [`CHECK_TIMEOUT`], tried again on the API
/// server's errors up to [`CHECK_TRIES`] times; updates the metrics. Returns the controller's
/// client material and whether a leaf was reissued.
pub async fn ensure_bounded(
    secrets: &Api<Secret>,
    metrics: &RuntimeMetrics,
) -> Result<(Pem, bool), CertError> {
    let result = with_tries(CHECK_TRIES, CHECK_TIMEOUT, || certs::ensure_all(secrets)).await;
    match result {
        Ok(ensured) => {
            for (secret, not_after) in &ensured.expiry {
                metrics
                    .certificate_expiry
                    .get_or_create(&SecretLabels {
                        secret: (*secret).to_owned(),
                    })
                    .set(*not_after);
            }
            if ensured.renewed {
                metrics.certificate_renewals.inc();
            }
            Ok((ensured.controller, ensured.renewed))
        }
        Err(error) => {
            metrics.certificate_check_failures.inc();
            Err(error)
        }
    }
}

/// Runs `check` up to `tries` times, each bounded by `timeout`, waiting 1, 2, 4, … s after a
/// transient failure ([`CertError::is_transient`]); the last error if none succeeded.
async fn with_tries<T, F, Fut>(tries: u32, timeout: Duration, mut check: F) -> Result<T, CertError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, CertError>>,
{
    let mut wait = Duration::from_secs(1);
    let mut tried = 1;
    loop {
        let error = match tokio::time::timeout(timeout, check()).await {
            Ok(Ok(done)) => return Ok(done),
            Ok(Err(error)) => error,
            Err(_) => CertError::TimedOut { after: timeout },
        };
        if tried >= tries || !error.is_transient() {
            return Err(error);
        }
        warn!(%error, "certificate check failed; trying again");
        tokio::time::sleep(wait).await;
        wait *= 2;
        tried += 1;
    }
}

/// Reissues leaves that near expiry until `shutdown`; `current` is the client material in use.
pub async fn renew_certificates(
    secrets: Api<Secret>,
    agents: std::sync::Arc<MtlsAgents>,
    metrics: RuntimeMetrics,
    mut current: Pem,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(certs::RENEW_CHECK) => {}
        }
        match ensure_bounded(&secrets, &metrics).await {
            Ok((pem, _)) => {
                if pem != current {
                    agents.set_tls(&pem);
                    current = pem;
                }
            }
            Err(error) => warn!(%error, "certificate renewal check failed; retrying later"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_hung_check_times_out_and_is_tried_again_but_a_bad_ca_is_not() {
        let calls = AtomicU32::new(0);
        let hung = with_tries(3, Duration::from_secs(20), || {
            calls.fetch_add(1, Ordering::Relaxed);
            std::future::pending::<Result<(), CertError>>()
        })
        .await;
        assert!(matches!(hung, Err(CertError::TimedOut { .. })), "{hung:?}");
        assert_eq!(calls.load(Ordering::Relaxed), 3);

        let calls = AtomicU32::new(0);
        let bad = with_tries(3, Duration::from_secs(20), || {
            calls.fetch_add(1, Ordering::Relaxed);
            std::future::ready(Err::<(), _>(CertError::BadCa {
                name: certs::CA_SECRET.into(),
                field: "tls.key",
                problem: "mismatch".into(),
                fix: "fix it".into(),
            }))
        })
        .await;
        assert!(bad.is_err());
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }
}
