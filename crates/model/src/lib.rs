//! Plain data and every rule about it, written once: the host network model and its validation,
//! the tuning ConfigMap and its rules, probe limits and name rules. The controller, the agent, the
//! CRDs (`nodekeeper-api`) and the gRPC conversions (`nodekeeper-proto`) all use these, so a limit
//! or a validation rule exists in exactly one place.
//!
//! No kube, no tonic, no netlink: the node side (agent, netconf, oci) builds on this crate without
//! pulling in a Kubernetes client.

pub mod address_policy;
pub mod diagnostics;
pub mod indicators;
pub mod listen;
pub mod network;
pub mod oci_ids;
pub mod probe;
pub mod text;
pub mod tuning;
