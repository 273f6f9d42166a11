//! The nodekeeper custom resources (group `nodekeeper.dev`, version `v1alpha1`).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// Every CRD nodekeeper installs, in a stable order (the manifests in `deploy/crds/` are generated
/// from this list by `cargo xtask codegen`).
pub fn all() -> Vec<CustomResourceDefinition> {
    Vec::new()
}
