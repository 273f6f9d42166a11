//! Types several custom resources share: label selectors, conditions, int-or-percent limits,
//! durations, and the field-naming validation error.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// At most this many entries in any status list of per-node or per-target detail; the rest are
/// counted, not listed, so one status write stays small at 10,000 nodes.
pub const MAX_LISTED: usize = 50;

/// A bad field in a custom resource: the JSON path (from the object root, e.g. `spec.count`) and
/// what is wrong, saying what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Joins field errors into one line, for conditions, events and logs.
pub fn format_field_errors(errors: &[FieldError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A label selector, with the same JSON shape as Kubernetes' `metav1.LabelSelector`. An empty
/// selector matches every object.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels that must all be present with exactly these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Requirements that must all hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

/// One requirement of a label selector.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.operator in ['In', 'NotIn'] ? size(self.values) > 0 : size(self.values) == 0",
        "message": "matchExpressions[].values: give at least one value for In and NotIn, and none for Exists and DoesNotExist"
    }
]))]
pub struct LabelSelectorRequirement {
    /// The label key.
    #[schemars(length(min = 1, max = 317))]
    pub key: String,
    /// How the label relates to `values`.
    pub operator: SelectorOperator,
    /// Values for `In` and `NotIn`; empty for `Exists` and `DoesNotExist`.
    #[serde(default)]
    #[schemars(length(max = 64), inner(length(max = 63)))]
    pub values: Vec<String>,
}

/// Label selector operators.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum SelectorOperator {
    /// The label's value is one of `values`.
    In,
    /// The label is absent or its value is none of `values`.
    NotIn,
    /// The label is present (any value).
    Exists,
    /// The label is absent.
    DoesNotExist,
}

impl LabelSelector {
    /// Whether an object with `labels` is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let value = labels.get(&r.key);
                match r.operator {
                    SelectorOperator::In => value.is_some_and(|v| r.values.contains(v)),
                    SelectorOperator::NotIn => value.is_none_or(|v| !r.values.contains(v)),
                    SelectorOperator::Exists => value.is_some(),
                    SelectorOperator::DoesNotExist => value.is_none(),
                }
            })
    }

    /// The selector in the API's query syntax (`a=b,c in (d,e),!f`), for list and watch calls.
    /// An empty selector gives an empty string, which selects everything.
    pub fn to_query(&self) -> String {
        let mut parts: Vec<String> = self
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        for r in &self.match_expressions {
            parts.push(match r.operator {
                SelectorOperator::In => format!("{} in ({})", r.key, r.values.join(",")),
                SelectorOperator::NotIn => format!("{} notin ({})", r.key, r.values.join(",")),
                SelectorOperator::Exists => r.key.clone(),
                SelectorOperator::DoesNotExist => format!("!{}", r.key),
            });
        }
        parts.join(",")
    }

    /// Checks what the schema cannot express well, naming the field under `path`.
    pub fn validate(&self, path: &str, errors: &mut Vec<FieldError>) {
        for (i, r) in self.match_expressions.iter().enumerate() {
            let needs_values = matches!(r.operator, SelectorOperator::In | SelectorOperator::NotIn);
            if needs_values == r.values.is_empty() {
                errors.push(FieldError::new(
                    format!("{path}.matchExpressions[{i}].values"),
                    if needs_values {
                        "give at least one value for In and NotIn"
                    } else {
                        "must be empty for Exists and DoesNotExist"
                    },
                ));
            }
        }
    }
}

/// Whether a condition holds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// A status condition, with the same JSON shape as Kubernetes' `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The condition's type, in PascalCase (e.g. `Ready`); unique within the list.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// Why the condition has this status: one PascalCase word.
    #[schemars(length(min = 1, max = 1024))]
    pub reason: String,
    /// Details for a human; may be empty.
    #[serde(default)]
    #[schemars(length(max = 32768))]
    pub message: String,
    /// When `status` last changed (RFC 3339).
    #[schemars(extend("format" = "date-time"))]
    pub last_transition_time: String,
    /// The object's `metadata.generation` this condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
}

/// Sets condition `type_` in `list` the way Kubernetes expects: `lastTransitionTime` moves to
/// `now` (RFC 3339) only when `status` changes. Returns whether anything changed, so a controller
/// writes status only when this (or another field) says so — never as a heartbeat.
pub fn set_condition(
    list: &mut Vec<Condition>,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
    observed_generation: Option<i64>,
    now: &str,
) -> bool {
    if let Some(c) = list.iter_mut().find(|c| c.type_ == type_) {
        if c.status == status
            && c.reason == reason
            && c.message == message
            && c.observed_generation == observed_generation
        {
            return false;
        }
        if c.status != status {
            c.last_transition_time = now.to_string();
        }
        c.status = status;
        c.reason = reason.to_string();
        c.message = message.to_string();
        c.observed_generation = observed_generation;
        return true;
    }
    list.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message: message.to_string(),
        last_transition_time: now.to_string(),
        observed_generation,
    });
    true
}

/// The schema of a `conditions` list: a map keyed by `type` (so server-side apply merges by type),
/// bounded.
pub(crate) fn conditions_schema(generator: &mut SchemaGenerator) -> Schema {
    let item = generator.subschema_for::<Condition>();
    json_schema!({
        "description": "Conditions, one per type (see the CRD's documentation for the types used).",
        "type": "array",
        "items": item,
        "maxItems": 16,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}

/// A count of objects or a percentage of a total (`3` or `"25%"`), like Kubernetes'
/// `maxUnavailable`. Percentages are whole numbers from 0 to 100.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntOrPercent {
    Int(u32),
    Percent(u8),
}

impl IntOrPercent {
    /// The absolute number for `total` objects. Percentages round up when `round_up` (as
    /// Kubernetes does for `maxSurge`) and down otherwise (as for `maxUnavailable`).
    pub fn resolve(self, total: u32, round_up: bool) -> u32 {
        match self {
            Self::Int(n) => n,
            Self::Percent(p) => {
                let scaled = u64::from(total) * u64::from(p);
                let value = if round_up {
                    scaled.div_ceil(100)
                } else {
                    scaled / 100
                };
                u32::try_from(value).unwrap_or(u32::MAX)
            }
        }
    }

    /// Parses `"25%"`.
    pub fn parse_percent(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{s:?} is not a percentage; write a whole number from 0 to 100 followed by %, e.g. \"25%\""
            )
        };
        let digits = s.strip_suffix('%').ok_or_else(bad)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        match digits.parse::<u8>() {
            Ok(p) if p <= 100 => Ok(Self::Percent(p)),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for IntOrPercent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Int(n) => write!(f, "{n}"),
            Self::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl Serialize for IntOrPercent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Int(n) => s.serialize_u32(*n),
            Self::Percent(_) => s.serialize_str(&self.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for IntOrPercent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u32),
            Str(String),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "expected a non-negative whole number or a percentage such as \"25%\"",
            )
        })? {
            Raw::Int(n) => Ok(Self::Int(n)),
            Raw::Str(s) => Self::parse_percent(&s).map_err(serde::de::Error::custom),
        }
    }
}

impl JsonSchema for IntOrPercent {
    fn schema_name() -> Cow<'static, str> {
        "IntOrPercent".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        // An int-or-string field (structural without a `type`), with the percentage's form
        // checked by CEL so that the message can say what to write. The number's upper bound is
        // the u32 it decodes into: a larger one would be stored and then fail every list of the
        // kind (see `crd::all`). `nullable: false` is explicit
        // because kube's schema rewriter marks every non-required int-or-string field nullable,
        // and a `null` here would reach the controller instead of taking the default.
        json_schema!({
            "x-kubernetes-int-or-string": true,
            "nullable": false,
            "x-kubernetes-validations": [{
                "rule": "type(self) == int ? self >= 0 && self <= 4294967295 : self.matches('^(100|[1-9]?[0-9])%$')",
                "message": "must be a non-negative whole number or a percentage from 0% to 100%, e.g. 1 or \"25%\"; a number is at most 4294967295"
            }]
        })
    }
}

/// Pattern of the durations nodekeeper resources accept: one or more `<digits><unit>` with unit
/// `ms`, `s`, `m` or `h` (e.g. `30s`, `5m`, `1h30m`).
pub const DURATION_PATTERN: &str = "^([0-9]{1,9}(ms|s|m|h))+$";

/// Parses a duration field, naming it on error.
pub fn parse_duration_field(field: &str, raw: &str) -> Result<Duration, FieldError> {
    nodekeeper_model::tuning::parse_duration(raw).map_err(|message| FieldError::new(field, message))
}

/// The label selector at `field` as the API server will check it when objects are listed with
/// it: the first bad key, value or operator, named by its field (`{field}.matchLabels["key"]`,
/// `{field}.matchExpressions[i]`).
pub fn check_selector(field: &str, selector: &LabelSelector) -> Result<(), FieldError> {
    let mut errors = Vec::new();
    selector.validate(field, &mut errors);
    if let Some(error) = errors.into_iter().next() {
        return Err(error);
    }
    for (key, value) in &selector.match_labels {
        let one = LabelSelector {
            match_labels: [(key.clone(), value.clone())].into(),
            ..LabelSelector::default()
        };
        crate::selector::check(&one)
            .map_err(|message| FieldError::new(format!("{field}.matchLabels[{key:?}]"), message))?;
    }
    for (i, requirement) in selector.match_expressions.iter().enumerate() {
        let one = LabelSelector {
            match_expressions: vec![requirement.clone()],
            ..LabelSelector::default()
        };
        crate::selector::check(&one).map_err(|message| {
            FieldError::new(format!("{field}.matchExpressions[{i}]"), message)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn selector_matches_labels_and_expressions() {
        let sel: LabelSelector = serde_json::from_value(serde_json::json!({
            "matchLabels": {"pool": "gpu"},
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
                {"key": "tainted", "operator": "DoesNotExist"},
                {"key": "tier", "operator": "NotIn", "values": ["system"]},
            ]
        }))
        .unwrap();
        assert!(sel.matches(&labels(&[("pool", "gpu"), ("zone", "a")])));
        assert!(!sel.matches(&labels(&[("pool", "gpu"), ("zone", "c")])));
        assert!(!sel.matches(&labels(&[("pool", "cpu"), ("zone", "a")])));
        assert!(!sel.matches(&labels(&[("pool", "gpu"), ("zone", "a"), ("tainted", "")])));
        assert!(!sel.matches(&labels(&[
            ("pool", "gpu"),
            ("zone", "a"),
            ("tier", "system")
        ])));
        assert_eq!(
            sel.to_query(),
            "pool=gpu,zone in (a,b),!tainted,tier notin (system)"
        );
        assert!(LabelSelector::default().matches(&BTreeMap::new()));
        assert_eq!(LabelSelector::default().to_query(), "");
    }

    #[test]
    fn selector_validation_names_the_field() {
        let sel: LabelSelector = serde_json::from_value(serde_json::json!({
            "matchExpressions": [
                {"key": "zone", "operator": "In"},
                {"key": "x", "operator": "Exists", "values": ["y"]},
            ]
        }))
        .unwrap();
        let mut errors = Vec::new();
        sel.validate("spec.nodeSelector", &mut errors);
        assert_eq!(errors.len(), 2);
        assert_eq!(
            errors[0].field,
            "spec.nodeSelector.matchExpressions[0].values"
        );
        assert_eq!(
            errors[1].field,
            "spec.nodeSelector.matchExpressions[1].values"
        );
    }

    #[test]
    fn set_condition_changes_only_on_change() {
        let mut list = Vec::new();
        let t0 = "2026-01-01T00:00:00Z";
        let t1 = "2026-01-01T00:05:00Z";
        assert!(set_condition(
            &mut list,
            "Ready",
            ConditionStatus::False,
            "InProgress",
            "",
            Some(1),
            t0
        ));
        assert!(!set_condition(
            &mut list,
            "Ready",
            ConditionStatus::False,
            "InProgress",
            "",
            Some(1),
            t1
        ));
        assert_eq!(list[0].last_transition_time, t0);
        // A new reason is a change, but not a transition.
        assert!(set_condition(
            &mut list,
            "Ready",
            ConditionStatus::False,
            "Blocked",
            "pdb x",
            Some(1),
            t1
        ));
        assert_eq!(list[0].last_transition_time, t0);
        assert!(set_condition(
            &mut list,
            "Ready",
            ConditionStatus::True,
            "Done",
            "",
            Some(2),
            t1
        ));
        assert_eq!(list[0].last_transition_time, t1);
        assert!(set_condition(
            &mut list,
            "Progressing",
            ConditionStatus::False,
            "Done",
            "",
            Some(2),
            t1
        ));
        assert_eq!(list.len(), 2);
    }

    #[test]
    fn int_or_percent_parses_resolves_and_round_trips() {
        let v: IntOrPercent = serde_json::from_str("3").unwrap();
        assert_eq!(v, IntOrPercent::Int(3));
        let p: IntOrPercent = serde_json::from_str("\"25%\"").unwrap();
        assert_eq!(p, IntOrPercent::Percent(25));
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"25%\"");
        assert_eq!(serde_json::to_string(&v).unwrap(), "3");
        assert_eq!(p.resolve(10, false), 2);
        assert_eq!(p.resolve(10, true), 3);
        assert_eq!(IntOrPercent::Percent(100).resolve(7, false), 7);
        assert_eq!(v.resolve(1000, true), 3);
        for bad in ["\"101%\"", "\"25\"", "\"%\"", "\"-1%\"", "-1", "\"2.5%\""] {
            let err = serde_json::from_str::<IntOrPercent>(bad).unwrap_err();
            assert!(err.to_string().contains("percentage"), "{bad}: {err}");
        }
    }

    #[test]
    fn durations_parse_with_the_field_named() {
        assert_eq!(
            parse_duration_field("spec.drainTimeout", "1h30m").unwrap(),
            Duration::from_secs(5400)
        );
        let err = parse_duration_field("spec.drainTimeout", "soon").unwrap_err();
        assert_eq!(err.field, "spec.drainTimeout");
        let re = DURATION_PATTERN;
        assert!(re.starts_with('^') && re.ends_with('$'));
    }
}
