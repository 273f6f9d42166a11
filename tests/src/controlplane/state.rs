//! What `cluster.json` records about a cluster (its ports and the processes this project
//! started), where a cluster's state lives, and how its ports are picked.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Error, binaries, process};

/// A process this project started, as recorded in `cluster.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Component {
    pub name: String,
    pub pid: u32,
    pub binary: PathBuf,
    pub log: PathBuf,
}

impl Component {
    pub fn is_running(&self) -> bool {
        process::is_running(self.pid, &self.binary)
    }
}

/// What `cluster.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    pub name: String,
    pub ports: Ports,
    pub audit: bool,
    pub components: Vec<Component>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Ports {
    pub apiserver: u16,
    pub etcd_client: u16,
    pub etcd_peer: u16,
    pub controller_manager: u16,
    pub scheduler: u16,
}

/// `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/clusters`.
pub fn clusters_root() -> PathBuf {
    binaries::cache_root().join("clusters")
}

/// The state directory of cluster `name`.
pub fn state_dir(name: &str) -> PathBuf {
    clusters_root().join(name)
}

/// Reads `cluster.json` of cluster `name`.
pub fn read_state(name: &str) -> Result<State, Error> {
    let path = state_dir(name).join("cluster.json");
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NotStarted {
                name: name.to_owned(),
                path,
            });
        }
        Err(source) => {
            return Err(Error::Io {
                context: format!("read {}", path.display()),
                source,
            });
        }
    };
    serde_json::from_str(&text).map_err(|source| Error::ReadState { path, source })
}

pub(super) fn write_state(dir: &Path, state: &State) -> Result<(), Error> {
    let path = dir.join("cluster.json");
    let text = serde_json::to_string_pretty(state).unwrap_or_default();
    fs::write(&path, text).map_err(|source| Error::Io {
        context: format!("write {}", path.display()),
        source,
    })
}

pub(super) fn port_is_free(port: u16) -> bool {
    nodekeeper_testkit::net::port_is_free(Ipv4Addr::LOCALHOST, port)
}

fn free_port() -> Result<u16, Error> {
    nodekeeper_testkit::free_port_on(Ipv4Addr::LOCALHOST).map_err(|source| Error::Io {
        context: "find a free port on 127.0.0.1".into(),
        source,
    })
}

/// Reuses the port a restarted cluster had when it is still free, else picks a new one.
pub(super) fn reuse_or_free(previous: Option<u16>) -> Result<u16, Error> {
    match previous {
        Some(port) if port_is_free(port) => Ok(port),
        _ => free_port(),
    }
}
