//! The agent's error type: every way a call or the server can fail, each variant naming what was
//! being done. `service::status` is the one place these become gRPC statuses.

use std::path::PathBuf;

use crate::network::NetworkError;
use crate::probes::ProbeError;

/// Everything that can go wrong in the agent outside a single collector.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {flag}: {reason}")]
    InvalidConfig { flag: &'static str, reason: String },
    #[error("read {flag} {path}: {source}")]
    ReadTls {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("rules refused, previous rules stay in force: {0}")]
    InvalidRules(String),
    #[error("save state to {path}: {source}")]
    SaveState {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lock {path}: {reason}")]
    LockStateDir { path: PathBuf, reason: String },
    #[error("bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("run probes: {0}")]
    RunProbes(#[from] ProbeError),
    /// `ApplyNetwork` refused or failed; the message is the manager's own (it names the field).
    #[error(transparent)]
    ApplyNetwork(#[from] NetworkError),
    #[error("serve gRPC: {0}")]
    Serve(#[from] tonic::transport::Error),
}
