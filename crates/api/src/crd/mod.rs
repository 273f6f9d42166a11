//! The nodekeeper custom resources (group `nodekeeper.dev`, version `v1alpha1`): one module per
//! kind, the types they share, and the list `cargo xtask codegen` writes to `deploy/crds/`.

pub mod common;
pub mod network_test;
pub mod node_class;
pub mod node_maintenance;
pub mod node_network_config;
pub mod node_set;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use common::{
    Condition, ConditionStatus, FieldError, IntOrPercent, LabelSelector, LabelSelectorRequirement,
    MAX_LISTED, SelectorOperator, format_field_errors,
};
pub use network_test::{NetworkTest, NetworkTestSpec, NetworkTestStatus};
pub use node_class::{NodeClass, NodeClassSpec, NodeClassStatus};
pub use node_maintenance::{NodeMaintenance, NodeMaintenanceSpec, NodeMaintenanceStatus};
pub use node_network_config::{NodeNetworkConfig, NodeNetworkConfigSpec, NodeNetworkConfigStatus};
pub use node_set::{NodeSet, NodeSetSpec, NodeSetStatus};

/// Every CRD nodekeeper installs, in a stable order (the manifests in `deploy/crds/` are generated
/// from this list by `cargo xtask codegen`).
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
        NetworkTest::crd(),
        NodeNetworkConfig::crd(),
        NodeMaintenance::crd(),
        NodeClass::crd(),
        NodeSet::crd(),
    ]
}
