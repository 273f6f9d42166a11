//! The nodekeeper custom resources (group `nodekeeper.dev`, version `v1alpha1`): one module per
//! kind, the types they share, and the list `cargo xtask codegen` writes to `deploy/crds/`.

pub mod common;
pub mod network_test;
pub mod node_class;
pub mod node_diagnostic;
pub mod node_maintenance;
pub mod node_network_config;
pub mod node_set;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use common::{
    Condition, ConditionStatus, FieldError, IntOrPercent, LabelSelector, LabelSelectorRequirement,
    MAX_LISTED, SelectorOperator, format_field_errors, set_condition,
};
pub use network_test::{NetworkTest, NetworkTestSpec, NetworkTestStatus};
pub use node_class::{NodeClass, NodeClassSpec, NodeClassStatus};
pub use node_diagnostic::{NodeDiagnostic, NodeDiagnosticSpec, NodeDiagnosticStatus};
pub use node_maintenance::{NodeMaintenance, NodeMaintenanceSpec, NodeMaintenanceStatus};
pub use node_network_config::{NodeNetworkConfig, NodeNetworkConfigSpec, NodeNetworkConfigStatus};
pub use node_set::{NodeSet, NodeSetSpec, NodeSetStatus};

/// Every CRD nodekeeper installs, in a stable order (the manifests in `deploy/crds/` are generated
/// from this list by `cargo xtask codegen`). Install these rather than `Kind::crd()`: they carry
/// the schema clean-up below.
pub fn all() -> Vec<CustomResourceDefinition> {
    generated().into_iter().map(drop_unknown_formats).collect()
}

/// The CRDs as kube and schemars generate them, integer formats included.
fn generated() -> Vec<CustomResourceDefinition> {
    vec![
        NetworkTest::crd(),
        NodeNetworkConfig::crd(),
        NodeMaintenance::crd(),
        NodeClass::crd(),
        NodeSet::crd(),
        NodeDiagnostic::crd(),
    ]
}

/// Integer formats schemars writes for Rust's unsigned and small types, which the API server
/// does not know and warns about on every apply (and does not enforce). Every spec integer whose
/// Rust type is narrower than the API server's int64 therefore carries its range as
/// `minimum`/`maximum` (the test below checks it): a value the type cannot hold would otherwise be
/// stored, fail to decode, and so fail every list of that kind, stopping the controller's watch
/// for all objects of the kind, not just the bad one.
const UNKNOWN_FORMATS: &[&str] = &[
    "uint", "uint8", "uint16", "uint32", "uint64", "int8", "int16",
];

fn drop_unknown_formats(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    fn walk(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                if map
                    .get("format")
                    .and_then(|f| f.as_str())
                    .is_some_and(|f| UNKNOWN_FORMATS.contains(&f))
                {
                    map.remove("format");
                }
                map.values_mut().for_each(walk);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    let mut value = serde_json::to_value(&crd).expect("a CRD serialises to JSON");
    walk(&mut value);
    serde_json::from_value(value).expect("removing formats keeps a valid CRD")
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// The range of the Rust integer type behind a schemars `format`; `None` for a format this
    /// test does not know (the test then fails, so that a new type gets a row here).
    fn type_range(format: &str) -> Option<(f64, f64)> {
        Some(match format {
            "uint8" => (0.0, f64::from(u8::MAX)),
            "int8" => (f64::from(i8::MIN), f64::from(i8::MAX)),
            "uint16" => (0.0, f64::from(u16::MAX)),
            "int16" => (f64::from(i16::MIN), f64::from(i16::MAX)),
            "uint32" => (0.0, f64::from(u32::MAX)),
            "int32" => (f64::from(i32::MIN), f64::from(i32::MAX)),
            // As wide as the API server's own integers (int64): nothing it stores overflows
            // them, so no maximum is needed, but unsigned ones still need `minimum: 0`.
            "uint64" | "uint" => (0.0, f64::INFINITY),
            "int64" => (f64::NEG_INFINITY, f64::INFINITY),
            _ => return None,
        })
    }

    /// Walks the generated schema (which still has the formats) and the installed one (which
    /// `all()` cleaned) in step, collecting every integer the installed schema lets through
    /// although its Rust type cannot hold it.
    fn check(generated: &Value, installed: &Value, path: &str, problems: &mut Vec<String>) {
        let (Some(g), Some(i)) = (generated.as_object(), installed.as_object()) else {
            return;
        };
        if g.get("type").and_then(Value::as_str) == Some("integer") {
            let format = g.get("format").and_then(Value::as_str).unwrap_or("(none)");
            match type_range(format) {
                None => problems.push(format!("{path}: integer with unknown format {format}")),
                Some((lo, hi)) => {
                    let min = i.get("minimum").and_then(Value::as_f64);
                    let max = i.get("maximum").and_then(Value::as_f64);
                    if lo.is_finite() && min.is_none_or(|m| m < lo) {
                        problems.push(format!(
                            "{path}: {format} needs minimum >= {lo}, has {min:?}"
                        ));
                    }
                    if hi.is_finite() && max.is_none_or(|m| m > hi) {
                        problems.push(format!(
                            "{path}: {format} needs maximum <= {hi}, has {max:?}"
                        ));
                    }
                }
            }
        }
        if g.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
            // Every int-or-string field is an `IntOrPercent`, whose number is a u32: its CEL rule
            // must bound the number on both sides.
            let rules: Vec<&str> = i
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|v| v.get("rule").and_then(Value::as_str))
                .collect();
            let bound = |op: &str| {
                rules.iter().find_map(|r| {
                    let rest = &r[r.find(op)? + op.len()..];
                    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    digits.parse::<u64>().ok()
                })
            };
            if bound("self >= ") != Some(0)
                || bound("self <= ").is_none_or(|m| m > u64::from(u32::MAX))
            {
                problems.push(format!(
                    "{path}: int-or-string (u32) needs `self >= 0` and `self <= {}` in its CEL rule, has {rules:?}",
                    u32::MAX
                ));
            }
        }
        for (key, g_value) in g {
            if let Some(i_value) = i.get(key) {
                match (g_value, i_value) {
                    (Value::Array(gs), Value::Array(is)) => {
                        for (n, (gv, iv)) in gs.iter().zip(is).enumerate() {
                            check(gv, iv, &format!("{path}.{key}[{n}]"), problems);
                        }
                    }
                    _ => check(g_value, i_value, &format!("{path}.{key}"), problems),
                }
            }
        }
    }

    /// A spec integer above what its Rust type holds would be stored by the API server and then
    /// fail the decoding of every list of that kind (kube decodes a list whole), so each one must
    /// be bounded by the schema.
    #[test]
    fn every_spec_integer_is_bounded_by_its_rust_type() {
        let mut problems = Vec::new();
        let mut integers = 0;
        for (generated, installed) in generated().iter().zip(all()) {
            let name = installed.metadata.name.clone().unwrap_or_default();
            for (g, i) in generated.spec.versions.iter().zip(&installed.spec.versions) {
                let spec = |v: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceValidation| {
                    let schema = serde_json::to_value(v.open_api_v3_schema.as_ref().unwrap()).unwrap();
                    schema["properties"]["spec"].clone()
                };
                let (g, i) = (
                    spec(g.schema.as_ref().unwrap()),
                    spec(i.schema.as_ref().unwrap()),
                );
                assert!(i.is_object(), "{name}: no spec schema");
                integers += serde_json::to_string(&g)
                    .unwrap()
                    .matches("\"integer\"")
                    .count();
                check(&g, &i, &format!("{name}.spec"), &mut problems);
            }
        }
        assert!(integers > 10, "the walk found only {integers} integers");
        assert!(
            problems.is_empty(),
            "unbounded spec integers:\n{}",
            problems.join("\n")
        );
    }
}
