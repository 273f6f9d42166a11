//! Test support shared by every crate's tests, the benches and the demo, free of kube, tonic and
//! the generated gRPC code so that node-side crates can dev-depend on it: network namespaces
//! ([`Netns`]), the skip-unless-root check ([`skip_unless_root!`]), free ports and loopback
//! addresses ([`net`]). The controller-plus-agents rig, which needs the control plane, is
//! `nodekeeper_e2e::rig`.

pub mod net;
pub mod netns;
pub mod skip;

pub use net::{free_port, free_port_on};
pub use netns::{Netns, NetnsEntry};
pub use skip::is_root;

/// What a helper of this crate failed to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("run `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("{context}: {source}")]
    Namespace {
        context: String,
        source: nix::errno::Errno,
    },
    #[error("the network namespace is anonymous (no name for `ip -n`); create it with Netns::new")]
    Anonymous,
}
