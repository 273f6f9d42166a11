//! The controller-plus-agents rig: the one way the e2e tests, the fleet bench
//! (`xtask/src/fleet_rig.rs`) and the demo (`xtask/src/demo/`) start a `nodekeeper-controller`
//! against a control plane ([`ControllerProcess`]), give agents the certificate the controller
//! issued ([`AgentTls`]), start agents with one command line ([`AgentSetup`]: in-process in the
//! tests, many in one [`AgentsHost`] for the fleet bench, one process each in the demo), and read
//! the controller's HTTP API and metrics ([`http_get`], [`metric`]), and expose that API through
//! the API server's service proxy ([`service_proxy`], for the plugin's tests and the demo).
//!
//! This library does not link the agent or controller crates: xtask depends on it and must build
//! without the generated gRPC code. Code that needs those crates runs in a test binary of this
//! package, re-executed as one of its ignored helper tests ([`Program::TestHelper`]): the e2e
//! tests' controller (`tests/tests/controller_common`) and the fleet bench's agents host
//! (`tests/tests/controller_fleet_agents.rs`). The kube-free parts (namespaces, ports, loopback
//! addresses, the root check) are in `nodekeeper-testkit`.

mod agents;
mod controller;
mod http;
mod process;
pub mod service_proxy;

pub use agents::{
    AGENT_SECRET, AGENTS_PER_HOST, AgentSetup, AgentTls, AgentsHost, FLEET_HELPER, FLEET_ROLE,
    FLEET_SHARD_ENV, FLEET_SPEC_ENV, FleetNode, FleetSpec, sysctl_path,
};
pub use controller::{ControllerConfig, ControllerProcess};
pub use http::{http_get, metric, sum_metric};
pub use process::{Output, Process, Program, ROLE_ENV};
