//! The local control plane — etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
//! kwok on 127.0.0.1 with TLS, RBAC and service-account keys — one implementation used by
//! `cargo xtask cluster` and by the test harness.
//!
//! State of a cluster named `N` lives in `${XDG_CACHE_HOME:-$HOME/.cache}/nodekeeper/clusters/N/`:
//! `pki/`, `etcd/` (data), `logs/<component>.log`, `kubeconfig` (admin), `kubeconfigs/` (one per
//! component), `cluster.json` (ports and the pids this project started) and, when enabled,
//! `audit.log`.

pub mod binaries;
pub mod nodes;
pub mod pki;
pub mod process;

use std::fs;
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use binaries::Binaries;
pub use process::Lifetime;

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
    /// lifecycle controller's grace period follows it. `None` keeps a kubelet's 40 s. Fleet
    /// benchmarks at 10,000 nodes lengthen it: 1,000 Lease renewals a second would take more of
    /// a 2-core machine than everything being measured.
    pub node_lease_seconds: Option<u32>,
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
            lifetime,
        }
    }
}

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

fn write_state(dir: &Path, state: &State) -> Result<(), Error> {
    let path = dir.join("cluster.json");
    let text = serde_json::to_string_pretty(state).unwrap_or_default();
    fs::write(&path, text).map_err(|source| Error::Io {
        context: format!("write {}", path.display()),
        source,
    })
}

/// The node-local address simulated node `i` gets as its InternalIP: `127.1.x.y`, distinct for
/// the first 65,024 nodes, so agents for a fleet can each bind their own loopback address.
pub fn simulated_node_ip(i: u32) -> Ipv4Addr {
    let i = i % (256 * 254);
    Ipv4Addr::new(127, 1, (i / 254) as u8, (i % 254 + 1) as u8)
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).is_ok()
}

fn free_port() -> Result<u16, Error> {
    let listener =
        TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)).map_err(|source| {
            Error::Io {
                context: "find a free port on 127.0.0.1".into(),
                source,
            }
        })?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|source| Error::Io {
            context: "find a free port on 127.0.0.1".into(),
            source,
        })
}

/// Reuses the port a restarted cluster had when it is still free, else picks a new one.
fn reuse_or_free(previous: Option<u16>) -> Result<u16, Error> {
    match previous {
        Some(port) if port_is_free(port) => Ok(port),
        _ => free_port(),
    }
}

fn kubeconfig_text(
    name: &str,
    port: u16,
    ca: &Path,
    user: &str,
    cert: &Path,
    key: &Path,
) -> String {
    // JSON strings are valid YAML scalars and quote any path safely.
    let q = |p: &Path| serde_json::to_string(&p.display().to_string()).unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: {name}\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: {name}\n  context:\n    cluster: {name}\n    user: {user}\ncurrent-context: {name}\n",
        ca = q(ca),
        cert = q(cert),
        key = q(key),
    )
}

/// Builds a client from a kubeconfig file, without kube's automatic retries.
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client, Error> {
    let kubeconfig =
        kube::config::Kubeconfig::read_from(path).map_err(|source| Error::ReadKubeconfig {
            path: path.to_owned(),
            source,
        })?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|source| Error::ReadKubeconfig {
        path: path.to_owned(),
        source,
    })?;
    // kube's default retry layer silently retries 429s with backoff for minutes — including an
    // eviction refused by a PodDisruptionBudget. Tests must see what the API answered.
    config.default_retry = false;
    Ok(kube::Client::try_from(config)?)
}

/// Processes started so far during `up`, stopped again if startup fails.
struct Starting {
    lifetime: Lifetime,
    components: Vec<Component>,
    children: Vec<Child>,
    logs: PathBuf,
}

impl Starting {
    fn spawn(
        &mut self,
        name: &str,
        binary: PathBuf,
        args: Vec<String>,
        envs: &[(&str, &Path)],
    ) -> Result<(), Error> {
        let log = self.logs.join(format!("{name}.log"));
        let child = process::spawn(&binary, &args, envs, &log, self.lifetime)?;
        self.components.push(Component {
            name: name.to_owned(),
            pid: child.id(),
            binary,
            log,
        });
        self.children.push(child);
        Ok(())
    }

    /// Fails if any component has exited, quoting the end of its log.
    fn check_alive(&mut self) -> Result<(), Error> {
        for (component, child) in self.components.iter().zip(self.children.iter_mut()) {
            if let Ok(Some(status)) = child.try_wait() {
                let log = fs::read_to_string(&component.log).unwrap_or_default();
                return Err(Error::ComponentExited {
                    component: component.name.clone(),
                    status: status.to_string(),
                    log: component.log.clone(),
                    tail: binaries::tail_lines(&log, 12),
                });
            }
        }
        Ok(())
    }

    fn abort(&mut self) {
        for component in self.components.iter().rev() {
            process::stop(component.pid, &component.binary, Duration::from_secs(5));
        }
        for child in &mut self.children {
            let _ = child.wait();
        }
    }

    /// Polls `check` every 250 ms until it returns true, a component dies, or `timeout` passes.
    async fn wait<F, Fut>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut check: F,
    ) -> Result<(), Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if check().await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::WaitReady {
                    what: what.to_owned(),
                    secs: timeout.as_secs(),
                    logs: self.logs.clone(),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

fn etcd_healthy(port: u16) -> bool {
    let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    let Ok(mut stream) = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(1)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.contains("\"health\":\"true\"")
}

async fn get_ok(client: &kube::Client, path: &str) -> bool {
    let Ok(request) = http::Request::get(path).body(Vec::new()) else {
        return false;
    };
    matches!(client.request_text(request).await, Ok(body) if body.trim() == "ok")
}

/// Builds what is missing, starts the control plane and waits until the apiserver is ready,
/// kube-controller-manager has created the `default` ServiceAccount and kube-scheduler is healthy.
/// `progress` receives a line per step.
pub async fn up(options: &Options, progress: &mut dyn FnMut(&str)) -> Result<Cluster, Error> {
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

struct Kubeconfigs<'a> {
    admin: &'a Path,
    controller_manager: &'a Path,
    scheduler: &'a Path,
    kwok: &'a Path,
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[allow(clippy::too_many_arguments)]
async fn start_components(
    options: &Options,
    dir: &Path,
    bin: &Binaries,
    pki: &pki::Pki,
    ports: Ports,
    starting: &mut Starting,
    progress: &mut dyn FnMut(&str),
    kubeconfigs: Kubeconfigs<'_>,
) -> Result<(), Error> {
    let etcd_client = format!("http://127.0.0.1:{}", ports.etcd_client);
    let etcd_peer = format!("http://127.0.0.1:{}", ports.etcd_peer);
    progress(&format!("starting etcd on {etcd_client}"));
    starting.spawn(
        "etcd",
        bin.path("etcd"),
        vec![
            "--name=nodekeeper".into(),
            format!("--data-dir={}", s(&dir.join("etcd"))),
            format!("--listen-client-urls={etcd_client}"),
            format!("--advertise-client-urls={etcd_client}"),
            format!("--listen-peer-urls={etcd_peer}"),
            format!("--initial-advertise-peer-urls={etcd_peer}"),
            format!("--initial-cluster=nodekeeper={etcd_peer}"),
            // Throwaway data on a shared disk: durability is not worth an fsync per write here.
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ],
        &[],
    )?;
    starting
        .wait("etcd", Duration::from_secs(60), || async {
            etcd_healthy(ports.etcd_client)
        })
        .await?;

    progress(&format!(
        "starting kube-apiserver on https://127.0.0.1:{}",
        ports.apiserver
    ));
    let mut args = vec![
        format!("--etcd-servers={etcd_client}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={}", ports.apiserver),
        // With a loopback advertise address the endpoint reconciler refuses to publish the
        // `kubernetes` Service endpoints and keeps retrying; nothing here needs them.
        "--endpoint-reconciler-type=none".into(),
        "--authorization-mode=Node,RBAC".into(),
        format!("--client-ca-file={}", s(&pki.ca_cert())),
        format!("--tls-cert-file={}", s(&pki.serving_cert())),
        format!("--tls-private-key-file={}", s(&pki.serving_key())),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        format!("--service-account-key-file={}", s(&pki.sa_pub())),
        format!("--service-account-signing-key-file={}", s(&pki.sa_key())),
        "--service-cluster-ip-range=10.96.0.0/16".into(),
        // The agent DaemonSet runs privileged with host networking.
        "--allow-privileged=true".into(),
        format!("--cert-dir={}", s(&dir.join("apiserver-certs"))),
    ];
    if let Some(n) = options.max_requests_inflight {
        args.push(format!("--max-requests-inflight={n}"));
    }
    if let Some(n) = options.max_mutating_requests_inflight {
        args.push(format!("--max-mutating-requests-inflight={n}"));
    }
    if options.audit {
        args.push(format!(
            "--audit-policy-file={}",
            s(&binaries::controlplane_dir()
                .join("config")
                .join("audit-policy.yaml"))
        ));
        args.push(format!("--audit-log-path={}", s(&dir.join("audit.log"))));
        args.push("--audit-log-format=json".into());
        args.push("--audit-log-maxbackup=1".into());
        // Unset (0), the log rotates at 100 MB, which a 10,000-node run passes within minutes;
        // benchmarks count lines from an offset and need one file.
        args.push("--audit-log-maxsize=100000".into());
    }
    starting.spawn("kube-apiserver", bin.path("kube-apiserver"), args, &[])?;
    let client = client_from_kubeconfig(kubeconfigs.admin).await?;
    starting
        .wait("kube-apiserver /readyz", Duration::from_secs(180), || {
            get_ok(&client, "/readyz")
        })
        .await?;

    progress("starting kube-controller-manager, kube-scheduler and kwok");
    let node_lease = options.node_lease_seconds.unwrap_or(40);
    starting.spawn(
        "kube-controller-manager",
        bin.path("kube-controller-manager"),
        vec![
            format!("--kubeconfig={}", s(kubeconfigs.controller_manager)),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", ports.controller_manager),
            format!("--tls-cert-file={}", s(&pki.serving_cert())),
            format!("--tls-private-key-file={}", s(&pki.serving_key())),
            format!("--service-account-private-key-file={}", s(&pki.sa_key())),
            format!("--root-ca-file={}", s(&pki.ca_cert())),
            format!("--cluster-signing-cert-file={}", s(&pki.ca_cert())),
            format!("--cluster-signing-key-file={}", s(&pki.ca_key())),
            "--use-service-account-credentials=true".into(),
            format!("--cluster-name={}", options.name),
            "--leader-elect=false".into(),
        ]
        .into_iter()
        .chain(
            options
                .node_lease_seconds
                .map(|l| format!("--node-monitor-grace-period={}s", l + 10)),
        )
        .collect(),
        &[],
    )?;
    starting.spawn(
        "kube-scheduler",
        bin.path("kube-scheduler"),
        vec![
            format!("--kubeconfig={}", s(kubeconfigs.scheduler)),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", ports.scheduler),
            format!("--tls-cert-file={}", s(&pki.serving_cert())),
            format!("--tls-private-key-file={}", s(&pki.serving_key())),
            "--leader-elect=false".into(),
        ],
        &[],
    )?;
    let kwok_home = dir.join("kwok-home");
    starting.spawn(
        "kwok",
        bin.path("kwok"),
        vec![
            format!("--kubeconfig={}", s(kubeconfigs.kwok)),
            format!(
                "--config={}",
                s(&binaries::controlplane_dir()
                    .join("config")
                    .join("kwok-stages.yaml"))
            ),
            format!(
                "--manage-nodes-with-label-selector={}=true",
                nodes::SIMULATED_LABEL
            ),
            // kwok renews each node's Lease every quarter of this; node status itself is
            // rewritten only every 5-6 minutes by the heartbeat stage.
            format!("--node-lease-duration-seconds={node_lease}"),
            "--cidr=10.244.0.1/16".into(),
        ],
        // kwok also reads ~/.kwok/kwok.yaml when it exists; a private HOME keeps it out.
        &[("HOME", &kwok_home)],
    )?;

    let sa_client = client.clone();
    starting
        .wait(
            "the `default` ServiceAccount (created by kube-controller-manager)",
            Duration::from_secs(120),
            || {
                let client = sa_client.clone();
                async move {
                    let api: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
                        kube::Api::namespaced(client, "default");
                    matches!(api.get_opt("default").await, Ok(Some(_)))
                }
            },
        )
        .await?;
    let mut scheduler_config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(kubeconfigs.admin).map_err(|source| {
            Error::ReadKubeconfig {
                path: kubeconfigs.admin.to_owned(),
                source,
            }
        })?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|source| Error::ReadKubeconfig {
        path: kubeconfigs.admin.to_owned(),
        source,
    })?;
    scheduler_config.cluster_url = format!("https://127.0.0.1:{}", ports.scheduler)
        .parse()
        .map_err(|e| Error::Io {
            context: "scheduler url".into(),
            source: std::io::Error::other(e),
        })?;
    let scheduler = kube::Client::try_from(scheduler_config)?;
    starting
        .wait("kube-scheduler /healthz", Duration::from_secs(60), || {
            get_ok(&scheduler, "/healthz")
        })
        .await?;
    starting.check_alive()?;
    Ok(())
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

/// Removes state directories of test clusters (`test-<pid>` and `test-<pid>-…`) whose process is gone.
pub fn remove_stale_test_clusters() {
    let Ok(entries) = fs::read_dir(clusters_root()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("test-")
            .and_then(|p| p.split('-').next()?.parse::<u32>().ok())
        else {
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
    use super::*;

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
