//! The tuning ConfigMap watch (shared state, not a reconciler): watches `nodekeeper-tuning` in the controller's namespace,
//! parses it with [`nodekeeper_model::tuning::parse`], and publishes the result to the rest of the
//! controller through a `watch` channel, so changes take effect without a restart. An invalid
//! ConfigMap is refused with a Warning Event on it naming every bad key and the problem, and the
//! last good configuration stays in force; the gauge `nodekeeper_tuning_refused` reads 1 until a
//! good version (or the ConfigMap's deletion) replaces it. A deleted (or absent) ConfigMap means the defaults,
//! whether it goes while this process leads or before it starts.
//!
//! A process that has read no good configuration since it started (the ConfigMap was already
//! invalid at its start or failover) has no "last good" one: the other settings take their
//! defaults, but the rules are not pushed and `TunablesInBounds` is left as it is
//! ([`TuningState::rules_to_push`], [`TuningState::good`]), so that a refused ConfigMap never
//! replaces the fleet's rules with the empty default set.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use nodekeeper_model::tuning::{self, RuleSet, TuningConfig};
use serde::Serialize;
use sha2::Digest as _;
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
    /// The ConfigMap has been read (or found absent) since this process started leading: until
    /// then the defaults are a placeholder, and the sweep does not judge nodes by them.
    pub settled: bool,
    /// A valid ConfigMap (or its absence, which means the defaults) has been read since this
    /// process started. False while the only version seen was refused: then `config` is the
    /// defaults standing in, not a configuration anyone chose, and the rules are not pushed.
    pub good: bool,
}

/// The rule set pushed when `features.tunables` is off: no rule, so no agent checks or writes
/// any sysctl (not pushing at all would leave each agent repairing by its last rules).
static NO_RULES: RuleSet = RuleSet {
    tunables: Vec::new(),
    thresholds: Vec::new(),
};

impl TuningState {
    pub fn defaults() -> Self {
        let config = TuningConfig::default();
        Self {
            rules_revision: config.rules.revision(),
            config,
            source: "defaults".into(),
            last_error: None,
            settled: false,
            good: false,
        }
    }

    /// The defaults because there is no ConfigMap (never created, or deleted).
    pub fn absent() -> Self {
        Self {
            settled: true,
            good: true,
            ..Self::defaults()
        }
    }

    /// The rules to push to agents: none while no good configuration has been read (the agents
    /// keep theirs), the empty set while `features.tunables` is off, else the configured ones.
    pub fn rules_to_push(&self) -> Option<&RuleSet> {
        if !self.good {
            None
        } else if self.config.features.tunables {
            Some(&self.config.rules)
        } else {
            Some(&NO_RULES)
        }
    }

    /// What a refusal's Event says stays in force: the last good configuration's source, or
    /// None when there is none.
    pub fn kept_source(&self) -> Option<&str> {
        self.good.then_some(self.source.as_str())
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
            settled: true,
            good: true,
        }),
        Err(error) => {
            let mut kept = current.clone();
            kept.last_error = Some(format!("{source}: {error}"));
            kept.settled = true;
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
    let stream = watcher(api, config).default_backoff();
    futures::pin_mut!(stream);
    let mut seen_version: Option<String> = None;
    // Whether the list in progress (or the last one) held the ConfigMap.
    let mut listed = false;
    loop {
        let next = tokio::select! {
            () = cancel.cancelled() => return,
            next = stream.try_next() => next,
        };
        let cm = match next {
            Ok(Some(watcher::Event::Apply(cm))) => cm,
            Ok(Some(watcher::Event::InitApply(cm))) => {
                listed = true;
                cm
            }
            Ok(Some(watcher::Event::Init)) => {
                listed = false;
                continue;
            }
            // A list without the ConfigMap (the first one, or a relist after it was deleted
            // while the watch was down): the defaults are in force.
            Ok(Some(watcher::Event::InitDone)) => {
                if !listed && !is_absent(&sender.borrow()) {
                    info!(configmap = %name, "no tuning ConfigMap; the defaults are in force");
                    seen_version = None;
                    publish(&sender, &metrics, TuningState::absent());
                }
                continue;
            }
            // A deleted ConfigMap means the defaults, as an absent one does at start: the same
            // configuration whether the leader saw the deletion or started after it.
            Ok(Some(watcher::Event::Delete(_))) => {
                info!(configmap = %name, "tuning ConfigMap deleted; the defaults are in force");
                seen_version = None;
                publish(&sender, &metrics, TuningState::absent());
                continue;
            }
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
                publish(&sender, &metrics, state);
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
                    if kept.good {
                        warn!(configmap = %name, key = %p.key, problem = %p.problem, "tuning ConfigMap refused; the last good configuration stays in force");
                    } else {
                        warn!(configmap = %name, key = %p.key, problem = %p.problem, "tuning ConfigMap refused, and no good one has been read since start; rules are not pushed until it is fixed");
                    }
                }
                let refusal = Refusal::new(
                    kept.kept_source(),
                    &problems,
                    data.get("rules.yaml").map(String::as_str),
                );
                let event = Event {
                    type_: EventType::Warning,
                    reason: REASON_INVALID.into(),
                    note: Some(refusal.note),
                    action: refusal.action,
                    secondary: None,
                };
                if let Err(error) = recorder.publish(&event, &cm.object_ref(&())).await {
                    warn!(%error, configmap = %name, "publishing the Warning Event failed");
                }
                publish(&sender, &metrics, kept);
            }
        }
    }
}

/// Puts `state` in force, and the `nodekeeper_tuning_refused` gauge with it: 1 while the
/// latest version read was refused (`last_error`), for as long as that version stays (a relist
/// replays it without a second refusal), 0 once a good version or the ConfigMap's absence is.
fn publish(sender: &watch::Sender<Arc<TuningState>>, metrics: &TuningMetrics, state: TuningState) {
    metrics.refused.set(i64::from(state.last_error.is_some()));
    sender.send_replace(Arc::new(state));
}

/// The state the absence of the ConfigMap gives, already in force.
fn is_absent(state: &TuningState) -> bool {
    state.settled && state.good && state.source == TuningState::absent().source
}

/// The most bytes of an Event's note the API accepts (`events.k8s.io/v1`: 1 KiB).
const MAX_NOTE_BYTES: usize = 1000;

/// The Warning Event for one refused ConfigMap version.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Every problem, each naming its key (and, inside `rules.yaml`, the rule by name and the
    /// field), within the API's size limit.
    pub note: String,
    /// `LoadTuning-<digest of the note>`. kube's `Recorder` folds Events with the same type,
    /// reason, action, reporter and object into one series that keeps its *first* note (it does
    /// not key on the note), so a second, different refusal would only bump the first one's count
    /// and its message would never be shown. A short digest of the note in the action gives each
    /// distinct refusal its own Event, while the same refusal again still counts up one series
    /// (as client-go's correlator does, which keys on the message).
    pub action: String,
}

impl Refusal {
    /// The Event for `problems`, with the last good configuration's `kept_source` (None: no good
    /// configuration has been read since start); `rules_yaml` (the raw `rules.yaml`) lets a
    /// problem at `tunables[i]` or `thresholds[i]` name its rule.
    pub fn new(
        kept_source: Option<&str>,
        problems: &[tuning::KeyError],
        rules_yaml: Option<&str>,
    ) -> Self {
        let names = rules_yaml.map(entry_names).unwrap_or_default();
        let listed: Vec<String> = problems
            .iter()
            .map(|p| match named_entry(&p.key, &names) {
                Some(label) => format!("key `{}` ({label}): {}", p.key, p.problem),
                None => p.to_string(),
            })
            .collect();
        let kept = match kept_source {
            Some(source) => format!("the last good configuration ({source}) stays in force"),
            None => "no valid configuration has been read since the controller started, so \
                     the tunable rules are not pushed and TunablesInBounds is not rewritten \
                     until this ConfigMap is fixed (the other keys take their defaults)"
                .to_owned(),
        };
        let note = format!("refused; {kept}: {}", listed.join("; "));
        let note = nodekeeper_model::text::truncate(&note, MAX_NOTE_BYTES).into_owned();
        let digest = sha2::Sha256::digest(note.as_bytes());
        Self {
            action: format!("LoadTuning-{}", hex::encode(&digest[..4])),
            note,
        }
    }
}

/// `tunables` and `thresholds` entries of a `rules.yaml` → their `name` / `indicator`, by index;
/// nothing when the document does not parse (its own problem already says so).
fn entry_names(raw: &str) -> BTreeMap<(String, usize), String> {
    // A document too large once its aliases are expanded is not expanded here either.
    if tuning::check_rules_yaml_size(raw).is_err() {
        return BTreeMap::new();
    }
    let Ok(doc) = serde_yaml::from_str::<serde_yaml::Value>(raw) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for (list, field, what) in [
        ("tunables", "name", "rule"),
        ("thresholds", "indicator", "threshold for"),
    ] {
        let Some(items) = doc.get(list).and_then(serde_yaml::Value::as_sequence) else {
            continue;
        };
        for (i, item) in items.iter().enumerate() {
            if let Some(name) = item.get(field).and_then(serde_yaml::Value::as_str) {
                let name = nodekeeper_model::text::truncate(name, 64);
                out.insert((list.to_owned(), i), format!("{what} {name:?}"));
            }
        }
    }
    out
}

/// The rule a problem's key points into (`rules.yaml: tunables[2].atLeast` → `rule "x"`).
fn named_entry<'a>(key: &str, names: &'a BTreeMap<(String, usize), String>) -> Option<&'a str> {
    let path = key.strip_prefix("rules.yaml: ")?;
    let (list, rest) = path.split_once('[')?;
    let (index, _) = rest.split_once(']')?;
    names
        .get(&(list.to_owned(), index.parse().ok()?))
        .map(String::as_str)
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

    /// Regression: a ConfigMap already invalid when the controller started (or failed over)
    /// published the defaults as settled, and the sweep pushed their empty rule set to every
    /// agent and rewrote every node's TunablesInBounds.
    #[test]
    fn a_refused_configmap_at_start_pushes_no_rules_and_claims_no_good_configuration() {
        let rules = "tunables:\n  - {name: backlog, key: net.core.somaxconn, atLeast: 1024}\n";
        let bad = data(&[("rules.yaml", rules), ("sweepInterval", "soon")]);
        let kept = next_state(&TuningState::defaults(), &bad, "v1".into()).unwrap_err();
        assert!(kept.settled && !kept.good);
        assert_eq!(kept.rules_to_push(), None, "the agents keep their rules");
        assert_eq!(kept.kept_source(), None);
        let problems = tuning::parse(&bad).unwrap_err().problems().to_vec();
        let note = Refusal::new(kept.kept_source(), &problems, Some(rules)).note;
        assert!(!note.contains("stays in force"), "{note}");
        assert!(
            note.contains("not pushed") && note.contains("key `sweepInterval`"),
            "{note}"
        );

        // Once a good version is read, its rules go out, and a later refusal keeps them.
        let good = next_state(&kept, &data(&[("rules.yaml", rules)]), "v2".into()).unwrap();
        assert!(good.good);
        assert_eq!(good.rules_to_push().unwrap().tunables.len(), 1);
        let kept = next_state(&good, &bad, "v3".into()).unwrap_err();
        assert_eq!(kept.rules_to_push(), good.rules_to_push());
        assert_eq!(kept.kept_source(), Some("v2"));
        let note = Refusal::new(kept.kept_source(), &problems, Some(rules)).note;
        assert!(
            note.contains("the last good configuration (v2) stays in force"),
            "{note}"
        );
    }

    /// An absent or deleted ConfigMap is the defaults, pushed as such: no rules.
    #[test]
    fn no_configmap_means_the_defaults_in_force() {
        let absent = TuningState::absent();
        assert!(absent.settled && absent.good);
        assert!(is_absent(&absent));
        assert!(!is_absent(&TuningState::defaults()));
        assert_eq!(absent.config, TuningConfig::default());
        assert_eq!(absent.rules_to_push(), Some(&RuleSet::default()));
    }

    /// Regression: with `features.tunables: "false"` nothing was pushed, and every agent went on
    /// checking and repairing by its last rules.
    #[test]
    fn tunables_off_pushes_the_empty_rule_set() {
        let rules = "tunables:\n  - {name: backlog, key: net.core.somaxconn, atLeast: 1024}\n";
        let off = next_state(
            &TuningState::absent(),
            &data(&[("rules.yaml", rules), ("features.tunables", "false")]),
            "v1".into(),
        )
        .unwrap();
        let pushed = off.rules_to_push().expect("a rule set is pushed");
        assert!(pushed.tunables.is_empty() && pushed.thresholds.is_empty());
        assert_ne!(pushed.revision(), off.config.rules.revision());
    }

    /// The value `nodekeeper_tuning_refused` is scraped at.
    fn refused_gauge(registry: &prometheus_client::registry::Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("nodekeeper_tuning_refused "))
            .unwrap_or_else(|| panic!("no nodekeeper_tuning_refused in\n{text}"))
            .to_owned()
    }

    /// Regression: the NodekeeperTuningRefused alert read `increase()` of the invalid-keys
    /// counter, which goes up once per refused version, so it cleared fifteen minutes after a
    /// refusal while the refused ConfigMap stayed. The gauge holds until a good version (or the
    /// ConfigMap's deletion) is in force.
    #[test]
    fn the_refused_gauge_holds_while_the_refused_version_is_the_latest() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = crate::shared::metrics::Metrics::new(&mut registry).tuning;
        let (sender, receiver) = watch::channel(Arc::new(TuningState::defaults()));
        assert_eq!(refused_gauge(&registry), "0");

        let good = next_state(&TuningState::defaults(), &data(&[]), "v1".into()).unwrap();
        publish(&sender, &metrics, good.clone());
        assert_eq!(refused_gauge(&registry), "0");

        let kept = next_state(&good, &data(&[("sweepInterval", "soon")]), "v2".into()).unwrap_err();
        publish(&sender, &metrics, kept);
        assert_eq!(refused_gauge(&registry), "1");
        assert_eq!(
            receiver.borrow().source,
            "v1",
            "the last good one stays in force"
        );
        // Nothing else is read while that version stays: the gauge does not decay.
        assert_eq!(refused_gauge(&registry), "1");

        let fixed = next_state(&receiver.borrow(), &data(&[]), "v3".into()).unwrap();
        publish(&sender, &metrics, fixed);
        assert_eq!(refused_gauge(&registry), "0");

        // Refused at start (no good one yet), then deleted: the defaults, not refused.
        let kept = next_state(
            &TuningState::defaults(),
            &data(&[("colour", "red")]),
            "v4".into(),
        )
        .unwrap_err();
        publish(&sender, &metrics, kept);
        assert_eq!(refused_gauge(&registry), "1");
        publish(&sender, &metrics, TuningState::absent());
        assert_eq!(refused_gauge(&registry), "0");
    }

    fn refusal(data: &BTreeMap<String, String>) -> Refusal {
        let problems = tuning::parse(data).unwrap_err().problems().to_vec();
        Refusal::new(
            Some("defaults"),
            &problems,
            data.get("rules.yaml").map(String::as_str),
        )
    }

    #[test]
    fn a_refusal_names_the_rule_and_the_field() {
        let rules = "tunables:\n  - {name: backlog, key: net.core.somaxconn, atLeast: 1024}\n  - {name: bad-max, key: net.core.rmem_max, atLeast: many}\nthresholds:\n  - {indicator: load1PerCpu, warning: 4, critical: 2}\n";
        let r = refusal(&data(&[("rules.yaml", rules)]));
        assert!(
            r.note
                .contains("key `rules.yaml: tunables[1].atLeast` (rule \"bad-max\")"),
            "{}",
            r.note
        );
        assert!(
            r.note.contains("(threshold for \"load1PerCpu\")") && r.note.contains("thresholds[0]"),
            "{}",
            r.note
        );
        assert!(!r.note.contains("backlog"), "{}", r.note);
    }

    #[test]
    fn each_distinct_refusal_gets_its_own_event_series() {
        let a = refusal(&data(&[("sweepInterval", "soon")]));
        let a_again = refusal(&data(&[("sweepInterval", "soon")]));
        let b = refusal(&data(&[("concurrency", "lots")]));
        assert!(a.action.starts_with("LoadTuning-") && a.action.len() == "LoadTuning-".len() + 8);
        assert_eq!(a, a_again, "the same refusal again counts up one series");
        assert_ne!(a.action, b.action, "a new refusal is a new Event");
        assert!(b.note.contains("key `concurrency`"), "{}", b.note);
    }

    #[test]
    fn a_long_refusal_fits_the_event_note_limit_without_splitting_a_character() {
        let many: Vec<(String, String)> = (0..200)
            .map(|i| (format!("ünknown-{i}"), "x".to_owned()))
            .collect();
        let data: BTreeMap<String, String> = many.into_iter().collect();
        let r = refusal(&data);
        assert!(
            r.note.len() <= MAX_NOTE_BYTES + '…'.len_utf8(),
            "{}",
            r.note.len()
        );
        // Bad YAML names nothing but still refuses cleanly.
        let r = refusal(&self::data(&[("rules.yaml", "tunables: [")]));
        assert!(r.note.contains("key `rules.yaml`"), "{}", r.note);
    }
}
