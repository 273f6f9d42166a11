//! The local control plane — etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
//! kwok on 127.0.0.1 with TLS, RBAC and service-account keys — one implementation used by
//! `cargo xtask cluster` and by the test harness.
//!
//! State of a cluster named `N` lives in `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/clusters/N/`:
//! `pki/`, `etcd/` (data), `logs/<component>.log`, `kubeconfig` (admin), `kubeconfigs/` (one per
//! component), `cluster.json` (ports and the pids this project started) and, when enabled,
//! `audit.log`.

//!
//! The module by job: `state.rs` (what `cluster.json` records, where it lives, the ports),
//! `kubeconfig.rs` (kubeconfigs and clients), `components.rs` (each component's flags and
//! readiness), `supervisor.rs` (the processes started during `up`), `process.rs` (spawning and
//! stopping), `binaries.rs`, `pki.rs` and `nodes.rs`; this file the entry points `up` and `down`.

pub mod binaries;
mod components;
mod kubeconfig;
pub mod nodes;
pub mod pki;
pub mod process;
mod state;
mod supervisor;

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

pub use binaries::Binaries;
pub use kubeconfig::client_from_kubeconfig;
pub use process::Lifetime;
pub use state::{Component, Ports, State, clusters_root, read_state, state_dir};

use components::{Kubeconfigs, start_components};
use kubeconfig::kubeconfig_text;
use state::{port_is_free, reuse_or_free, write_state};
use supervisor::Starting;

/// Everything that can go wrong starting, inspecting or stopping the control plane. Messages
/// are one line (plus quoted log lines where a component failed) and say what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "`go` was not found on PATH, and the control plane is built from Go modules on first use: install Go 1.26 or newer (https://go.dev/dl/ or `apt-get install golang-go`, which fetches the pinned toolchain itself) and re-run"
    )]
    FindGo,
    #[error(
        "`setpriv` (util-linux) was not found on PATH; it ties the control plane to the test process: `apt-get install util-linux`"
    )]
    FindSetpriv,
    #[error(
        "{path} does not pin {module} with a `require {module} vX.Y.Z` line; restore it from git"
    )]
    ReadPin { path: PathBuf, module: String },
    #[error("go build of {component} failed ({status}); last output:\n{tail}")]
    BuildComponent {
        component: &'static str,
        status: String,
        tail: String,
    },
    #[error("port {port} on 127.0.0.1 is in use: run `cargo xtask cluster down` or pass --port")]
    PortInUse { port: u16 },
    #[error(
        "cluster `{name}` is already running (kube-apiserver pid {pid}): use it (`cargo xtask cluster env`) or stop it with `cargo xtask cluster down`"
    )]
    AlreadyRunning { name: String, pid: u32 },
    #[error(
        "no cluster `{name}` has been started here ({path} is missing): run `cargo xtask cluster up`"
    )]
    NotStarted { name: String, path: PathBuf },
    #[error("start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{component} exited during startup ({status}); last lines of {log}:\n{tail}")]
    ComponentExited {
        component: String,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("{what} was not ready after {secs}s; see the logs in {logs}")]
    WaitReady {
        what: String,
        secs: u64,
        logs: PathBuf,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("generate certificates: {0}")]
    GenerateCertificates(#[from] rcgen::Error),
    #[error("read kubeconfig {path}: {source}")]
    ReadKubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("read cluster state {path}: {source}")]
    ReadState {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct Options {
    /// Names the state directory; `cargo xtask cluster` uses `dev`, each test binary `test-<pid>`.
    pub name: String,
    /// kube-apiserver's port on 127.0.0.1; `None` picks a free one (or the port the cluster had).
    pub apiserver_port: Option<u16>,
    /// Record every API request (Metadata level, JSON lines) in `<state>/audit.log`, for
    /// benchmarks that count requests by user. Off by default: it costs apiserver CPU.
    pub audit: bool,
    /// `--max-requests-inflight` / `--max-mutating-requests-inflight`; `None` keeps
    /// kube-apiserver's defaults (400/200). Fleet benchmarks with 10,000 nodes raise them.
    pub max_requests_inflight: Option<u32>,
    pub max_mutating_requests_inflight: Option<u32>,
    /// The simulated kubelets' node Lease duration (kwok renews every quarter of it); the node
    /// lifecycle controller's grace periods (for a Node's heartbeat, and for its first) follow
    /// it. `None` keeps a kubelet's 40 s. Fleet benchmarks at 10,000 nodes lengthen it: 1,000
    /// Lease renewals a second would take more of a 2-core machine than everything being
    /// measured.
    pub node_lease_seconds: Option<u32>,
    /// kube-controller-manager's `--kube-api-qps` (its burst twice that); `None` keeps its 20.
    /// With `--use-service-account-credentials` every controller has its own limit. Fleet
    /// benchmarks raise it: the node lifecycle controller makes two GETs and two PATCHes of
    /// every new Node for its taints, hours of work for 65,000 Nodes at 20 a second.
    pub controller_manager_qps: Option<u32>,
    /// kube-apiserver `--feature-gates` (e.g. `WatchList=false`, to stand in for an older
    /// server); empty keeps the release's defaults.
    pub apiserver_feature_gates: Vec<String>,
    pub lifetime: Lifetime,
}

impl Options {
    pub fn new(name: impl Into<String>, lifetime: Lifetime) -> Self {
        Self {
            name: name.into(),
            apiserver_port: None,
            audit: false,
            max_requests_inflight: None,
            max_mutating_requests_inflight: None,
            node_lease_seconds: None,
            controller_manager_qps: None,
            apiserver_feature_gates: Vec::new(),
            lifetime,
        }
    }
}

/// A started cluster. When started with [`Lifetime::WithThisProcess`], dropping it stops the
/// components (and they die with the process anyway).
#[derive(Debug)]
pub struct Cluster {
    pub state_dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub state: State,
    children: Vec<Child>,
    lifetime: Lifetime,
}

impl Cluster {
    pub fn apiserver_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.state.ports.apiserver)
    }

    /// `<state>/audit.log` when the cluster runs with audit logging.
    pub fn audit_log(&self) -> Option<PathBuf> {
        self.state.audit.then(|| self.state_dir.join("audit.log"))
    }

    /// Stops every component, last started first.
    pub fn stop(&mut self) {
        for component in self.state.components.iter().rev() {
            process::stop(component.pid, &component.binary, Duration::from_secs(10));
        }
        for child in &mut self.children {
            let _ = child.try_wait();
        }
        self.state.components.clear();
        let _ = write_state(&self.state_dir, &self.state);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.lifetime == Lifetime::WithThisProcess {
            self.stop();
        }
    }
}

/// The node-local address simulated node `i` gets as its InternalIP: `127.1.x.y`, distinct for
/// the first 65,024 nodes, so agents for a fleet can each bind their own loopback address.
pub fn simulated_node_ip(i: u32) -> Ipv4Addr {
    nodekeeper_testkit::net::indexed_loopback(1, i as usize)
}

/// Builds what is missing, starts the control plane and waits until the apiserver is ready,
/// kube-controller-manager has created the `default` ServiceAccount and kube-scheduler is healthy.
/// `progress` receives a line per step.
pub async fn up(options: &Options, progress: &mut dyn FnMut(&str)) -> Result<Cluster, Error> {
    remove_stale_scratch_clusters();
    let dir = state_dir(&options.name);
    let previous = read_state(&options.name).ok();
    if let Some(state) = &previous {
        if let Some(api) = state
            .components
            .iter()
            .find(|c| c.name == "kube-apiserver" && c.is_running())
        {
            return Err(Error::AlreadyRunning {
                name: options.name.clone(),
                pid: api.pid,
            });
        }
        // Whatever is left of a half-started cluster goes before the ports are reused.
        for component in state.components.iter().rev() {
            process::stop(component.pid, &component.binary, Duration::from_secs(5));
        }
    }
    let old = previous.as_ref().map(|s| s.ports);
    let apiserver = match options.apiserver_port {
        Some(port) if port_is_free(port) => port,
        Some(port) => return Err(Error::PortInUse { port }),
        None => reuse_or_free(old.map(|p| p.apiserver))?,
    };
    let ports = Ports {
        apiserver,
        etcd_client: reuse_or_free(old.map(|p| p.etcd_client))?,
        etcd_peer: reuse_or_free(old.map(|p| p.etcd_peer))?,
        controller_manager: reuse_or_free(old.map(|p| p.controller_manager))?,
        scheduler: reuse_or_free(old.map(|p| p.scheduler))?,
    };

    let bin = binaries::ensure(progress)?;
    let logs = dir.join("logs");
    let kubeconfigs = dir.join("kubeconfigs");
    for d in [&dir, &logs, &kubeconfigs, &dir.join("kwok-home")] {
        fs::create_dir_all(d).map_err(|source| Error::Io {
            context: format!("create {}", d.display()),
            source,
        })?;
    }
    let pki = pki::ensure(&dir.join("pki"))?;
    let kubeconfig_of = |id: &pki::Identity| -> Result<PathBuf, Error> {
        let path = if id.stem == pki::ADMIN.stem {
            dir.join("kubeconfig")
        } else {
            kubeconfigs.join(format!("{}.kubeconfig", id.stem))
        };
        let text = kubeconfig_text(
            &options.name,
            ports.apiserver,
            &pki.ca_cert(),
            id.user,
            &pki.client_cert(id),
            &pki.client_key(id),
        );
        fs::write(&path, text).map_err(|source| Error::Io {
            context: format!("write {}", path.display()),
            source,
        })?;
        Ok(path)
    };
    let admin_kubeconfig = kubeconfig_of(&pki::ADMIN)?;
    let kcm_kubeconfig = kubeconfig_of(&pki::CONTROLLER_MANAGER)?;
    let scheduler_kubeconfig = kubeconfig_of(&pki::SCHEDULER)?;
    let kwok_kubeconfig = kubeconfig_of(&pki::KWOK)?;

    let mut starting = Starting {
        lifetime: options.lifetime,
        components: Vec::new(),
        children: Vec::new(),
        logs,
    };
    let result = start_components(
        options,
        &dir,
        &bin,
        &pki,
        ports,
        &mut starting,
        progress,
        Kubeconfigs {
            admin: &admin_kubeconfig,
            controller_manager: &kcm_kubeconfig,
            scheduler: &scheduler_kubeconfig,
            kwok: &kwok_kubeconfig,
        },
    )
    .await;
    if let Err(error) = result {
        starting.abort();
        return Err(error);
    }
    let state = State {
        name: options.name.clone(),
        ports,
        audit: options.audit,
        components: std::mem::take(&mut starting.components),
    };
    write_state(&dir, &state)?;
    Ok(Cluster {
        state_dir: dir,
        kubeconfig: admin_kubeconfig,
        state,
        children: std::mem::take(&mut starting.children),
        lifetime: options.lifetime,
    })
}

/// Stops the components recorded for cluster `name` (only those pids, and only while they still
/// run the recorded binary); with `purge` also deletes the state directory. Returns what was
/// stopped.
pub fn down(name: &str, purge: bool) -> Result<Vec<Component>, Error> {
    let dir = state_dir(name);
    let mut stopped = Vec::new();
    match read_state(name) {
        Ok(mut state) => {
            for component in state.components.iter().rev() {
                if process::stop(component.pid, &component.binary, Duration::from_secs(10)) {
                    stopped.push(component.clone());
                }
            }
            state.components.clear();
            if !purge {
                write_state(&dir, &state)?;
            }
        }
        Err(Error::NotStarted { .. }) if purge => {}
        Err(e) => return Err(e),
    }
    if purge && dir.exists() {
        fs::remove_dir_all(&dir).map_err(|source| Error::Io {
            context: format!("remove {}", dir.display()),
            source,
        })?;
    }
    Ok(stopped)
}

/// The process that owns scratch cluster `name`: tests and benchmarks name their clusters
/// `test-…` or `bench-…` with their pid as a `-`-separated part (`test-4242`, `test-4242-lease`,
/// `test-install-4242`, `bench-drain-4242`). Clusters named otherwise (the demo's, `cargo xtask
/// cluster up --name …`) belong to the user and have no owner here.
fn scratch_owner(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("test-")
        .or_else(|| name.strip_prefix("bench-"))?;
    rest.split('-').find_map(|part| part.parse::<u32>().ok())
}

/// Removes the state directories of scratch clusters (see [`scratch_owner`]) whose owning process
/// is gone, stopping whatever recorded component still runs. Each run keeps its logs for a
/// post-mortem until the next test or benchmark starts a cluster; without this, every run leaves
/// its etcd data behind (hundreds of MiB for a benchmark).
pub fn remove_stale_scratch_clusters() {
    let Ok(entries) = fs::read_dir(clusters_root()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = scratch_owner(&name) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            if let Ok(state) = read_state(&name) {
                for component in &state.components {
                    process::stop(component.pid, &component.binary, Duration::from_secs(5));
                }
            }
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn scratch_clusters_are_owned_by_the_pid_in_their_name_and_user_clusters_by_no_one() {
        assert_eq!(scratch_owner("test-4242"), Some(4242));
        assert_eq!(scratch_owner("test-4242-lease"), Some(4242));
        assert_eq!(scratch_owner("test-install-4242"), Some(4242));
        assert_eq!(scratch_owner("test-suite-4242"), Some(4242));
        assert_eq!(scratch_owner("bench-drain-4242"), Some(4242));
        assert_eq!(scratch_owner("demo"), None);
        assert_eq!(scratch_owner("test"), None);
        assert_eq!(scratch_owner("test-mine"), None);
        assert_eq!(scratch_owner("local-4242"), None);
    }

    #[test]
    fn simulated_node_ips_are_distinct_loopback_addresses() {
        assert_eq!(simulated_node_ip(0), Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(simulated_node_ip(253), Ipv4Addr::new(127, 1, 0, 254));
        assert_eq!(simulated_node_ip(254), Ipv4Addr::new(127, 1, 1, 1));
        let ips: std::collections::BTreeSet<_> = (0..10_000).map(simulated_node_ip).collect();
        assert_eq!(ips.len(), 10_000);
        assert!(
            ips.iter()
                .all(|ip| ip.is_loopback() && ip.octets()[3] != 0 && ip.octets()[3] != 255)
        );
    }

    #[test]
    fn kubeconfig_quotes_paths() {
        let text = kubeconfig_text(
            "dev",
            6443,
            Path::new("/a b/ca.crt"),
            "u",
            Path::new("/c.crt"),
            Path::new("/c.key"),
        );
        let parsed: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        assert_eq!(
            parsed["clusters"][0]["cluster"]["certificate-authority"].as_str(),
            Some("/a b/ca.crt")
        );
        assert_eq!(
            parsed["clusters"][0]["cluster"]["server"].as_str(),
            Some("https://127.0.0.1:6443")
        );
        assert_eq!(parsed["current-context"].as_str(), Some("dev"));
    }

    #[test]
    fn taken_port_is_reported_with_the_fix() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(!port_is_free(port));
        let message = Error::PortInUse { port }.to_string();
        assert_eq!(
            message,
            format!(
                "port {port} on 127.0.0.1 is in use: run `cargo xtask cluster down` or pass --port"
            )
        );
    }
}
