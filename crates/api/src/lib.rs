//! nodekeeper's Kubernetes API: the custom resources (`nodekeeper.dev/v1alpha1`, with their CRD
//! schemas generated from these types) and the well-known names — labels, annotations, condition
//! types and reasons, field managers. Plain data and validation live in `nodekeeper-model`; the
//! gRPC contract in `nodekeeper-proto`. Only the controller and the tests depend on this crate.

pub mod crd;
pub mod names;
