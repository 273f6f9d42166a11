//! The tuning ConfigMap watch (shared state, not a reconciler): watches `nodekeeper-tuning` in the controller's namespace,
//! parses it with [`nodekeeper_model::tuning::parse`], and publishes the result to the rest of the
//! controller through a `watch` channel, so changes take effect without a restart. An invalid
//! ConfigMap is refused with a Warning Event on it naming every bad key and the problem, and the
//! last good configuration stays in force. A deleted ConfigMap means the defaults.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use nodekeeper_model::tuning::{self, TuningConfig};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::metrics::{ResultLabels, TuningMetrics, WriteResult};

/// Event reason for a refused ConfigMap.
pub const REASON_INVALID: &str = "InvalidTuning";
/// Event reason for an accepted change.
pub const REASON_LOADED: &str = "TuningLoaded";

/// The configuration in force and where it came from.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TuningState {
    pub config: TuningConfig,
    /// The rules revision pushed to agents.
    pub rules_revision: u64,
    /// `defaults`, or `ConfigMap <namespace>/<name> resourceVersion <rv>`.
    pub source: String,
    /// Why the latest ConfigMap version was refused, if it was.
    pub last_error: Option<String>,
}

impl TuningState {
    pub fn defaults() -> Self {
        let config = TuningConfig::default();
        Self {
            rules_revision: config.rules.revision(),
            config,
            source: "defaults".into(),
            last_error: None,
        }
    }
}

/// What to do with one version of the ConfigMap (plain logic, tested below): the new state, or
/// the kept one with the reason recorded.
// Both arms carry a whole state by design; this runs once per ConfigMap change.
#[allow(clippy::result_large_err)]
pub fn next_state(
    current: &TuningState,
    data: &BTreeMap<String, String>,
    source: String,
) -> Result<TuningState, TuningState> {
    match tuning::parse(data) {
        Ok(config) => Ok(TuningState {
            rules_revision: config.rules.revision(),
            config,
            source,
            last_error: None,
        }),
        Err(error) => {
            let mut kept = current.clone();
            kept.last_error = Some(format!("{source}: {error}"));
            Err(kept)
        }
    }
}

/// Watches the ConfigMap until cancelled.
pub async fn watch_tuning(
    api: Api<ConfigMap>,
    name: String,
    recorder: Recorder,
    sender: watch::Sender<Arc<TuningState>>,
    metrics: TuningMetrics,
    cancel: CancellationToken,
) {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api, config).default_backoff().applied_objects();
    futures::pin_mut!(stream);
    let mut seen_version: Option<String> = None;
    loop {
        let next = tokio::select! {
            () = cancel.cancelled() => return,
            next = stream.try_next() => next,
        };
        let cm = match next {
            Ok(Some(cm)) => cm,
            Ok(None) => return,
            Err(error) => {
                warn!(%error, configmap = %name, "tuning ConfigMap watch failed; retrying");
                continue;
            }
        };
        // A relist replays the same version: nothing changed, no second Event.
        if cm.metadata.resource_version.is_some() && cm.metadata.resource_version == seen_version {
            continue;
        }
        seen_version.clone_from(&cm.metadata.resource_version);
        let source = format!(
            "ConfigMap {}/{} resourceVersion {}",
            cm.metadata.namespace.as_deref().unwrap_or_default(),
            name,
            cm.metadata.resource_version.as_deref().unwrap_or("?")
        );
        let data = cm.data.clone().unwrap_or_default();
        let current = sender.borrow().clone();
        match next_state(&current, &data, source) {
            Ok(state) => {
                metrics
                    .reloads
                    .get_or_create(&ResultLabels {
                        result: WriteResult::Ok,
                    })
                    .inc();
                info!(source = %state.source, rules_revision = state.rules_revision, sweep_interval = %tuning::format_duration(state.config.sweep_interval), concurrency = state.config.concurrency, "tuning loaded");
                sender.send_replace(Arc::new(state));
            }
            Err(kept) => {
                metrics
                    .reloads
                    .get_or_create(&ResultLabels {
                        result: WriteResult::Error,
                    })
                    .inc();
                let problems = tuning::parse(&data)
                    .err()
                    .map(|e| e.problems().to_vec())
                    .unwrap_or_default();
                metrics.invalid_keys.inc_by(problems.len() as u64);
                for p in &problems {
                    warn!(configmap = %name, key = %p.key, problem = %p.problem, "tuning ConfigMap refused; the last good configuration stays in force");
                }
                let mut note = format!(
                    "refused; the last good configuration ({}) stays in force: {}",
                    kept.source,
                    problems
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; ")
                );
                if note.len() > 1000 {
                    let mut cut = 997;
                    while !note.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    note.truncate(cut);
                    note.push_str("...");
                }
                let event = Event {
                    type_: EventType::Warning,
                    reason: REASON_INVALID.into(),
                    note: Some(note),
                    action: "LoadTuning".into(),
                    secondary: None,
                };
                if let Err(error) = recorder.publish(&event, &cm.object_ref(&())).await {
                    warn!(%error, configmap = %name, "publishing the Warning Event failed");
                }
                sender.send_replace(Arc::new(kept));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn a_bad_version_keeps_the_last_good_configuration() {
        let start = TuningState::defaults();
        let good = next_state(&start, &data(&[("sweepInterval", "1m")]), "v1".into()).unwrap();
        assert_eq!(good.config.sweep_interval, Duration::from_secs(60));
        let kept = next_state(
            &good,
            &data(&[("sweepInterval", "soon"), ("colour", "red")]),
            "v2".into(),
        )
        .unwrap_err();
        assert_eq!(kept.config, good.config);
        assert_eq!(kept.source, "v1");
        let error = kept.last_error.unwrap();
        assert!(
            error.contains("key `sweepInterval`") && error.contains("key `colour`"),
            "{error}"
        );
        // A later good version clears the error.
        let again = next_state(&good, &data(&[]), "v3".into()).unwrap();
        assert!(again.last_error.is_none());
    }
}
