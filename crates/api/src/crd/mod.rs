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
    [
        NetworkTest::crd(),
        NodeNetworkConfig::crd(),
        NodeMaintenance::crd(),
        NodeClass::crd(),
        NodeSet::crd(),
        NodeDiagnostic::crd(),
    ]
    .into_iter()
    .map(drop_unknown_formats)
    .collect()
}

/// Integer formats schemars writes for Rust's unsigned and small types, which the API server
/// does not know and warns about on every apply; the bounds they imply are already in the
/// schema as `minimum`/`maximum` where they matter.
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
