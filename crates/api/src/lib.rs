//! nodekeeper's Kubernetes API: the custom resources (`nodekeeper.dev/v1alpha1`, with their CRD
//! schemas generated from these types) and the well-known names — labels, annotations, condition
//! types and reasons, field managers — and the retry rule of nodekeeper's own API clients
//! ([`client`]). Plain data and validation live in `nodekeeper-model`; the gRPC contract in
//! `nodekeeper-proto`. Only the controller, the plugin and the tests depend on this crate.

pub mod client;
pub mod crd;
pub mod names;
pub mod selector;
