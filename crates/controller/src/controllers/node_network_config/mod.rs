//! The NodeNetworkConfig rollout, as pure logic over plain data: which VNICs to attach, keep or
//! detach on a node ([`plan`]), which nodes to start next within `rollout.maxUnavailable` and
//! when to pause ([`rollout`]), and the bounded status written only on change ([`status`]).
//!
//! No controller is registered yet: the reconciler (watch NodeNetworkConfigs and Nodes, read the
//! attachments through `nodekeeper_oci::compute`, attach, wait for ATTACHED, `ApplyNetwork` on
//! the agent, finalizer) is the next step and builds on these functions. Nothing here calls the
//! Kubernetes API, OCI or an agent.

pub mod plan;
pub mod rollout;
pub mod status;
