//! `NodeClass`: the machine template a `NodeSet` creates nodes from, per provider (OCI compute
//! instances, or kwok-simulated nodes).

// kube's `printcolumn(...)` repeats `type_ = …` once per column, which clippy mistakes for a
// duplicated attribute.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Condition, FieldError, conditions_schema};

/// How to create a machine: the provider and its template, and the labels and taints every node
/// made from it carries.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "nodekeeper.dev",
    version = "v1alpha1",
    kind = "NodeClass",
    plural = "nodeclasses",
    singular = "nodeclass",
    shortname = "ncl",
    category = "nodekeeper",
    status = "NodeClassStatus",
    derive = "PartialEq",
    doc = "A machine template (provider, shape, image, network) that NodeSets create nodes from.",
    printcolumn(name = "Provider", type_ = "string", json_path = ".spec.provider"),
    printcolumn(name = "Shape", type_ = "string", json_path = ".spec.oci.shape"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.provider == 'oci' ? has(self.oci) && !has(self.kwok) : has(self.kwok) && !has(self.oci)",
        "message": "spec: give the template of the provider named in spec.provider (spec.oci or spec.kwok), and only that one"
    }
]))]
pub struct NodeClassSpec {
    /// Where machines come from: `oci` (Compute instances) or `kwok` (simulated nodes, for tests
    /// and demos).
    pub provider: Provider,
    /// The instance template, for `provider: oci`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciTemplate>,
    /// The simulated node template, for `provider: kwok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kwok: Option<KwokTemplate>,
    /// Labels every node made from this class carries (a NodeSet's template may add more).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub labels: BTreeMap<String, String>,
    /// Taints every node made from this class carries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub taints: Vec<Taint>,
}

/// A machine provider.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Provider {
    /// Oracle Cloud Infrastructure Compute instances.
    Oci,
    /// Nodes simulated by kwok (no machine behind them).
    Kwok,
}

/// The fields of an OCI `LaunchInstance` request that nodekeeper sets.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OciTemplate {
    /// The compartment's OCID.
    #[schemars(
        length(max = 255),
        regex(pattern = r"^ocid1\.(compartment|tenancy)\.[a-z0-9][a-z0-9.-]*$")
    )]
    pub compartment_id: String,
    /// The availability domain, e.g. `Uocm:PHX-AD-1`.
    #[schemars(length(min = 1, max = 255))]
    pub availability_domain: String,
    /// The shape, e.g. `VM.Standard.E5.Flex` or `BM.Standard3.64`.
    #[schemars(
        length(min = 1, max = 255),
        regex(pattern = r"^(VM|BM)\.[A-Za-z0-9.]+$")
    )]
    pub shape: String,
    /// For flexible shapes: OCPUs and memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape_config: Option<ShapeConfig>,
    /// The boot image's OCID.
    #[schemars(
        length(max = 255),
        regex(pattern = r"^ocid1\.image\.[a-z0-9][a-z0-9.-]*$")
    )]
    pub image_id: String,
    /// The primary VNIC's subnet OCID.
    #[schemars(
        length(max = 255),
        regex(pattern = r"^ocid1\.subnet\.[a-z0-9][a-z0-9.-]*$")
    )]
    pub subnet_id: String,
    /// Instance metadata (e.g. `user_data` base64 cloud-init, `ssh_authorized_keys`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub metadata: BTreeMap<String, String>,
    /// Prefix of the instances' display names (the rest is the node's name suffix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub display_name_prefix: Option<String>,
}

/// Flexible shape sizing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShapeConfig {
    /// OCPUs.
    #[schemars(range(min = 1, max = 512))]
    pub ocpus: f64,
    /// Memory in gigabytes.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "memoryInGBs"
    )]
    #[schemars(range(min = 1, max = 8192))]
    pub memory_in_gbs: Option<f64>,
}

/// A simulated node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KwokTemplate {
    /// The node's capacity (and allocatable), e.g. `cpu: "8"`, `memory: 32Gi`, `pods: "110"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    pub capacity: BTreeMap<String, String>,
}

/// A node taint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    /// The taint key.
    #[schemars(length(min = 1, max = 317))]
    pub key: String,
    /// The taint value.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 63))]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: TaintEffect,
}

/// What a taint does to pods that do not tolerate it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

/// Reserved: no controller writes a NodeClass's status yet. A class that cannot be used shows
/// on each NodeSet that names it (`Ready=False`, reason `InvalidSpec` or `ProviderFailed`,
/// naming the class's field).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeClassStatus {
    /// Reserved for a `Ready` condition; not written yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_class_round_trips() {
        let spec: NodeClassSpec = serde_json::from_value(serde_json::json!({
            "provider": "oci",
            "oci": {
                "compartmentId": "ocid1.compartment.oc1..aaaa",
                "availabilityDomain": "Uocm:PHX-AD-1",
                "shape": "VM.Standard.E5.Flex",
                "shapeConfig": {"ocpus": 2, "memoryInGBs": 16},
                "imageId": "ocid1.image.oc1.phx.aaaa",
                "subnetId": "ocid1.subnet.oc1.phx.aaaa"
            },
            "taints": [{"key": "gpu", "effect": "NoSchedule"}]
        }))
        .unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["oci"]["shapeConfig"]["memoryInGBs"], 16.0);
        let back: NodeClassSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, spec);
    }
}

/// A name part of a qualified name or a non-empty label value, as Kubernetes checks it: at most
/// 63 characters, alphanumeric at both ends, `-`, `_` and `.` between.
fn name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A DNS-1123 subdomain: at most 253 characters, dot-separated lowercase alphanumeric labels
/// with `-` inside.
fn dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// Why `key` is not a qualified name (`[prefix/]name`), as the API server checks label and
/// taint keys.
fn qualified_name(key: &str) -> Option<&'static str> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if prefix.is_some_and(|p| !dns_subdomain(p)) {
        return Some(
            "its prefix (before /) must be a DNS subdomain: lowercase letters, digits, - and ., at most 253 characters",
        );
    }
    if !name_part(name) {
        return Some(
            "its name (after any prefix/) must be 1-63 characters of letters, digits, -, _ and ., beginning and ending with a letter or digit",
        );
    }
    None
}

/// Why `value` is not a label value, if it is not.
fn label_value(value: &str) -> Option<&'static str> {
    (!value.is_empty() && !name_part(value)).then_some(
        "a value must be empty or 1-63 characters of letters, digits, -, _ and ., beginning and ending with a letter or digit",
    )
}

/// Checks node labels as the API server will when the Node is created, naming each bad entry
/// as `{field}[{key}]`. A NodeSet checks its class's and its template's before any machine is
/// created: a Node the API server refuses would leave a machine without a Node.
pub fn check_labels(field: &str, labels: &BTreeMap<String, String>) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (key, value) in labels {
        if let Some(why) = qualified_name(key) {
            errors.push(FieldError::new(
                format!("{field}[{key:?}]"),
                format!("{key:?} is not a valid label key: {why}"),
            ));
        }
        if let Some(why) = label_value(value) {
            errors.push(FieldError::new(
                format!("{field}[{key:?}]"),
                format!("{value:?} is not a valid label value: {why}"),
            ));
        }
    }
    errors
}

/// Checks node taints as the API server will: keys are qualified names, values label values,
/// and no key and effect twice, counting the taints already given in `before` (the class's,
/// when checking a set's template). Each bad entry is named as `{field}[{index}]`.
pub fn check_taints(field: &str, taints: &[Taint], before: &[Taint]) -> Vec<FieldError> {
    let mut errors = Vec::new();
    for (i, taint) in taints.iter().enumerate() {
        let at = format!("{field}[{i}]");
        if let Some(why) = qualified_name(&taint.key) {
            errors.push(FieldError::new(
                format!("{at}.key"),
                format!("{:?} is not a valid taint key: {why}", taint.key),
            ));
        }
        if let Some(why) = label_value(&taint.value) {
            errors.push(FieldError::new(
                format!("{at}.value"),
                format!("{:?} is not a valid taint value: {why}", taint.value),
            ));
        }
        let same = |t: &Taint| t.key == taint.key && t.effect == taint.effect;
        if before.iter().any(same) || taints[..i].iter().any(same) {
            errors.push(FieldError::new(
                at,
                format!(
                    "a taint with key {:?} and effect {:?} is given twice (here or in the NodeClass); a Node takes each key and effect once: remove one",
                    taint.key, taint.effect
                ),
            ));
        }
    }
    errors
}

#[cfg(test)]
mod checks {
    use super::*;

    fn taint(key: &str, value: &str, effect: TaintEffect) -> Taint {
        Taint {
            key: key.into(),
            value: value.into(),
            effect,
        }
    }

    #[test]
    fn labels_are_checked_as_the_api_server_checks_them() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect()
        };
        let fine = labels(&[
            ("pool", "gpu"),
            ("nodekeeper.dev/set", "a-b_c.d"),
            ("node.kubernetes.io/exclude", ""),
            ("A1", "Z9"),
        ]);
        assert_eq!(check_labels("spec.labels", &fine), vec![]);
        for (key, value) in [
            ("team name", "x"),
            ("", "x"),
            ("-pool", "x"),
            ("Example.com/pool", "x"),
            ("a/b/c", "x"),
            ("/pool", "x"),
            ("pool", "has space"),
            ("pool", "-x"),
        ] {
            let errors = check_labels("spec.labels", &labels(&[(key, value)]));
            assert_eq!(errors.len(), 1, "{key:?}={value:?}: {errors:?}");
            assert_eq!(errors[0].field, format!("spec.labels[{key:?}]"));
        }
        let long = "v".repeat(64);
        assert_eq!(check_labels("f", &labels(&[("pool", &long)])).len(), 1);
        assert_eq!(check_labels("f", &labels(&[(&long, "x")])).len(), 1);
    }

    #[test]
    fn taints_are_unique_by_key_and_effect_over_class_and_template() {
        use TaintEffect::*;
        let class = [taint("gpu", "true", NoSchedule)];
        assert_eq!(
            check_taints(
                "spec.template.taints",
                &[taint("gpu", "", NoExecute)],
                &class
            ),
            vec![]
        );
        let twice = check_taints(
            "spec.template.taints",
            &[taint("gpu", "x", NoSchedule)],
            &class,
        );
        assert_eq!(twice.len(), 1);
        assert_eq!(twice[0].field, "spec.template.taints[0]");
        assert!(twice[0].message.contains("twice"), "{}", twice[0].message);
        let within = check_taints(
            "spec.taints",
            &[taint("a", "", NoSchedule), taint("a", "", NoSchedule)],
            &[],
        );
        assert_eq!(within.len(), 1);
        assert_eq!(within[0].field, "spec.taints[1]");
        let bad = check_taints("spec.taints", &[taint("a b", "c d", NoSchedule)], &[]);
        let fields: Vec<&str> = bad.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["spec.taints[0].key", "spec.taints[0].value"]);
    }
}
