//! Types shared by the nodekeeper controller and agent: custom resources, the host network model,
//! the tuning ConfigMap schema, well-known names, and the generated gRPC contract.

pub mod crd;
pub mod names;
pub mod network;
pub mod proto;
pub mod tuning;
