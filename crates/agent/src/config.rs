//! The agent's command line: every flag, its `NODEKEEPER_…` environment variable, and validation
//! of paths before anything reads them.

use std::net::SocketAddr;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::error::Error;

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line (for log collectors).
    Json,
    /// Human-readable lines.
    Plain,
}

/// The nodekeeper node agent: reports node health, holds sysctl tunables in bounds and answers
/// the nodekeeper controller over mutual-TLS gRPC. It never calls the Kubernetes API.
#[derive(Clone, Debug, Parser)]
#[command(name = "nodekeeper-agent", version, about, long_about = None)]
pub struct Config {
    /// Address and port the gRPC server listens on (the node's address with hostNetwork). The
    /// default `[::]` takes IPv4 and IPv6 alike; on a host without IPv6 (`ipv6.disable=1`) the
    /// agent listens on `0.0.0.0` instead.
    #[arg(long, env = "NODEKEEPER_LISTEN", default_value = "[::]:9443")]
    pub listen: SocketAddr,

    /// The Kubernetes Node name this agent runs on, reported back in every report.
    #[arg(long, env = "NODEKEEPER_NODE_NAME")]
    pub node_name: String,

    /// PEM file with the agent's server certificate (chain), issued by the controller's CA.
    #[arg(long, env = "NODEKEEPER_TLS_CERT")]
    pub tls_cert: PathBuf,

    /// PEM file with the private key of `--tls-cert`.
    #[arg(long, env = "NODEKEEPER_TLS_KEY")]
    pub tls_key: PathBuf,

    /// PEM file with the CA that signs the controller's client certificate. Calls without a
    /// client certificate signed by this CA are refused during the TLS handshake.
    #[arg(long, env = "NODEKEEPER_CLIENT_CA")]
    pub client_ca: PathBuf,

    /// How often the TLS files are checked for a reissued certificate; when they change the
    /// server restarts with them. At least 100ms.
    #[arg(long, env = "NODEKEEPER_TLS_RELOAD_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub tls_reload_interval: Duration,

    /// Revert what nodekeeper changed on this host and exit, instead of serving (the uninstall;
    /// its own flags: `nodekeeper-agent --cleanup --help`).
    #[arg(
        long,
        env = "NODEKEEPER_CLEANUP",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub cleanup: bool,

    /// Directory for the agent's state (the rules in force, repair history); survives restarts.
    #[arg(
        long,
        env = "NODEKEEPER_STATE_DIR",
        default_value = "/var/lib/nodekeeper"
    )]
    pub state_dir: PathBuf,

    /// Host mount points whose disk and inode use is reported (comma-separated absolute paths,
    /// resolved under `--host-root`).
    #[arg(
        long,
        env = "NODEKEEPER_MOUNTS",
        value_delimiter = ',',
        default_value = "/"
    )]
    pub mounts: Vec<PathBuf>,

    /// A PEM file of certificates trusted by HTTPS probes (NetworkTest kind http) besides the
    /// Mozilla roots compiled into the agent: the cluster's CA, so `apiServer` and in-cluster
    /// endpoints verify (e.g. the `kube-root-ca.crt` ConfigMap's `ca.crt` mounted into the
    /// agent). Read at each HTTP run, so a rotated bundle is used without a restart.
    #[arg(long, env = "NODEKEEPER_PROBE_CA_FILE")]
    pub probe_ca_file: Option<PathBuf>,

    /// Where the host's root filesystem is visible to the agent (e.g. `/host/root` in the
    /// DaemonSet); `--mounts` are resolved under it.
    #[arg(long, env = "NODEKEEPER_HOST_ROOT", default_value = "/")]
    pub host_root: PathBuf,

    /// Directory holding one JSON file per Oracle Cloud Agent plugin (nodekeeper's format, in
    /// the crate's README), read where OCA's own log (`/var/log/oracle-cloud-agent/agent.log`,
    /// or the snap's, under `--host-root`) is not found. OCA's log needs no flag.
    #[arg(long, env = "NODEKEEPER_OCA_PLUGIN_DIR")]
    pub oca_plugin_dir: Option<PathBuf>,

    /// The `nvidia-smi` program (a bare name is looked up on PATH), used with `-q -x` where
    /// NVML cannot be loaded. When neither is found the report says "no GPU", a normal answer.
    #[arg(long, env = "NODEKEEPER_NVIDIA_SMI", default_value = "nvidia-smi")]
    pub nvidia_smi: PathBuf,

    /// NVIDIA's management library, loaded at run time (a name is searched on the loader's
    /// path, e.g. the driver's library directory mounted into the agent and on
    /// `LD_LIBRARY_PATH`); `none` turns NVML off. It gives XID events, NVLink state and the
    /// other GPU health facts; without it `nvidia-smi -q -x` is read.
    #[arg(
        long,
        env = "NODEKEEPER_NVML_LIBRARY",
        default_value = "libnvidia-ml.so.1"
    )]
    pub nvml_library: String,

    /// GPUs this node must have (set it per node pool, e.g. from the instance shape). Fewer
    /// found (a GPU fell off the bus, the driver did not load) is a Critical GPU verdict.
    /// Unset: any number of GPUs, including none, is fine.
    #[arg(long, env = "NODEKEEPER_EXPECTED_GPUS")]
    pub expected_gpus: Option<u32>,

    /// How long a GPU reading is reused before `nvidia-smi` runs again (it is slow to start).
    #[arg(long, env = "NODEKEEPER_GPU_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub gpu_interval: Duration,

    /// Where the host's procfs is mounted (e.g. `/host/proc`); load, memory, PSI, file handles,
    /// kernel and boot facts are read from it.
    #[arg(long, env = "NODEKEEPER_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,

    /// The sysctl tree the tunable rules read and (where a rule allows repair) write. Defaults
    /// to `<proc-root>/sys`. Mount it writable only on nodes where repair is wanted.
    #[arg(long, env = "NODEKEEPER_SYSCTL_ROOT")]
    pub sysctl_root: Option<PathBuf>,

    /// A report's measurements are reused for this long before the node is read again, so a
    /// burst of calls costs one collection.
    #[arg(long, env = "NODEKEEPER_REPORT_MAX_AGE", default_value = "1s", value_parser = parse_duration)]
    pub report_max_age: Duration,

    /// How often the host network state last applied with `ApplyNetwork` is planned again: a
    /// non-empty plan is drift (something outside nodekeeper changed what it owns), reported and
    /// repaired.
    #[arg(long, env = "NODEKEEPER_DRIFT_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub drift_interval: Duration,

    /// The kernel log the kernel-log monitor reads (NPD's kmsg monitor; records as in
    /// `/dev/kmsg`). Its rules are NPD's kernel-monitor.json and readonly-monitor.json plus the
    /// kmsg files in `--monitor-config-dir`.
    #[arg(long, env = "NODEKEEPER_KMSG_PATH", default_value = "/dev/kmsg")]
    pub kmsg_path: PathBuf,

    /// Run the kernel-log monitor (`false` turns it off).
    #[arg(long, env = "NODEKEEPER_KERNEL_MONITOR", default_value_t = true, action = clap::ArgAction::Set)]
    pub kernel_monitor: bool,

    /// Directory of node-problem-detector monitor files (`*.json`): kmsg rule files
    /// (`"plugin": "kmsg"`; one with the `source` of a built-in file replaces it) and
    /// custom-plugin files (`"plugin": "custom"`), read unchanged. Unset: built-in rules only.
    #[arg(long, env = "NODEKEEPER_MONITOR_CONFIG_DIR")]
    pub monitor_config_dir: Option<PathBuf>,

    /// Run the journal monitor: NPD's `systemd-monitor.json` service rules (kubelet and runtime
    /// starts as Events) and `systemd-monitor-counter.json` restart counts
    /// (`FrequentKubeletRestart`, `FrequentContainerdRestart`), plus `journald` files and
    /// `log-counter` rules in `--monitor-config-dir` (`false` turns it off).
    #[arg(long, env = "NODEKEEPER_JOURNAL", default_value_t = true, action = clap::ArgAction::Set)]
    pub journal: bool,

    /// The `journalctl` program the journal is read with (a bare name is looked up on PATH).
    /// When it cannot run, the report lists why and the restart conditions are Unknown.
    #[arg(long, env = "NODEKEEPER_JOURNALCTL", default_value = "journalctl")]
    pub journalctl: PathBuf,

    /// The journal directory (the host's `/var/log/journal` or `/run/log/journal` mounted into
    /// the agent). Unset: the rule files' `logPath`, else the first of those two that exists.
    #[arg(long, env = "NODEKEEPER_JOURNAL_DIR")]
    pub journal_dir: Option<PathBuf>,

    /// Run the built-in kubelet and container-runtime health checks (conditions
    /// `KubeletUnhealthy` and `ContainerRuntimeUnhealthy`, as NPD's health checker).
    #[arg(long, env = "NODEKEEPER_HEALTH_CHECKS", default_value_t = true, action = clap::ArgAction::Set)]
    pub health_checks: bool,

    /// The kubelet's healthz endpoint (plain HTTP; the kubelet's `--healthz-bind-address` and
    /// `--healthz-port`).
    #[arg(
        long,
        env = "NODEKEEPER_KUBELET_HEALTHZ_URL",
        default_value = "http://127.0.0.1:10248/healthz"
    )]
    pub kubelet_healthz_url: String,

    /// The container runtime's CRI socket. Unset: the first of containerd's and CRI-O's usual
    /// sockets that exists under `--host-root`; none: the runtime check is off.
    #[arg(long, env = "NODEKEEPER_CRI_SOCKET")]
    pub cri_socket: Option<PathBuf>,

    /// The `crictl` program (a bare name is looked up on PATH). When it is not found the runtime
    /// check only connects to the CRI socket.
    #[arg(long, env = "NODEKEEPER_CRICTL", default_value = "crictl")]
    pub crictl: PathBuf,

    /// Address for `/metrics` (plain HTTP) with node-problem-detector's `problem_counter` and
    /// `problem_gauge` (NPD serves them on 127.0.0.1:20257). Unset: not served. An IPv6
    /// address may be written with or without brackets (`[fd00::5]:9444` or `fd00::5:9444`,
    /// the last colon starts the port), so the DaemonSet's `$(NODE_IP):9444` works on IPv4
    /// and IPv6 nodes alike.
    #[arg(long, env = "NODEKEEPER_METRICS_LISTEN", value_parser = parse_listen)]
    pub metrics_listen: Option<SocketAddr>,

    /// Largest gRPC message accepted or sent, in bytes; larger requests are refused. At least
    /// 65536 (64 KiB), as a node report must fit.
    #[arg(long, env = "NODEKEEPER_MAX_MESSAGE_BYTES", default_value_t = 1024 * 1024)]
    pub max_message_bytes: usize,

    /// Base URL of the instance metadata service (e.g. `http://169.254.169.254`; plain
    /// `http://`, checked at start). Unset: the
    /// agent never contacts it, and `ApplyNetwork` with `oci_vnics.enabled` fails with
    /// FAILED_PRECONDITION. Set: that call reads the secondary VNICs from it to lay them out.
    #[arg(long, env = "NODEKEEPER_IMDS_ENDPOINT")]
    pub imds_endpoint: Option<String>,

    /// Diagnostics bundle sources (`CollectDiagnostics`).
    #[command(flatten)]
    pub diagnostics: crate::diag::DiagConfig,

    /// Log line format.
    #[arg(
        long,
        env = "NODEKEEPER_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    pub log_format: LogFormat,

    /// Log filter in `tracing` env-filter syntax, e.g. `info` or `nodekeeper_agent=debug`.
    #[arg(long, env = "NODEKEEPER_LOG", default_value = "info")]
    pub log: String,
}

impl Config {
    /// The node-local settings of `RunProbes`: the host's resolver (under `--host-root`) and
    /// `--probe-ca-file`.
    pub fn probe_options(&self) -> crate::probes::ProbeOptions {
        crate::probes::ProbeOptions {
            ca_file: self.probe_ca_file.clone(),
            ..crate::probes::ProbeOptions::for_host_root(&self.host_root)
        }
    }

    /// Where the node problem monitors read from (the healthz URL checked by [`Self::validate`]).
    pub fn monitors(&self) -> crate::monitor::MonitorConfig {
        use crate::monitor::health;
        let health = self.health_checks.then(|| {
            let cri_socket = self.cri_socket.clone().or_else(|| {
                [
                    "/run/containerd/containerd.sock",
                    "/run/crio/crio.sock",
                    "/var/run/crio/crio.sock",
                ]
                .iter()
                .map(|p| under_root(&self.host_root, Path::new(p)))
                .find(|p| p.exists())
            });
            health::HealthConfig {
                kubelet: health::parse_healthz_url(&self.kubelet_healthz_url).ok(),
                cri_socket,
                crictl: crate::collect::gpu::locate(&self.crictl),
                interval: Duration::from_secs(10),
                timeout: Duration::from_secs(10),
            }
        });
        let journal = self
            .journal
            .then(|| crate::monitor::journal::JournalConfig {
                journalctl: crate::collect::gpu::locate(&self.journalctl)
                    .unwrap_or_else(|| self.journalctl.clone()),
                directory: self.journal_dir.clone(),
            });
        crate::monitor::MonitorConfig {
            kmsg_path: self.kernel_monitor.then(|| self.kmsg_path.clone()),
            journal,
            config_dir: self.monitor_config_dir.clone(),
            health,
            metrics: self.metrics_listen,
            state_dir: Some(self.state_dir.clone()),
        }
    }

    /// Where the GPU facts come from.
    pub fn gpu(&self) -> crate::collect::gpu::GpuConfig {
        crate::collect::gpu::GpuConfig {
            nvml_library: match self.nvml_library.trim() {
                "" | "none" => None,
                name => Some(name.to_owned()),
            },
            nvidia_smi: self.nvidia_smi.clone(),
            expected: self.expected_gpus,
            pci_devices: "/sys/bus/pci/devices".into(),
        }
    }

    /// The sysctl tree in use.
    pub fn sysctl_root(&self) -> PathBuf {
        self.sysctl_root
            .clone()
            .unwrap_or_else(|| self.proc_root.join("sys"))
    }

    /// Checks the paths the agent will read before it reads any of them.
    pub fn validate(&self) -> Result<(), Error> {
        for mount in &self.mounts {
            check_host_path("--mounts", mount)?;
        }
        if let Some(dir) = &self.oca_plugin_dir {
            check_host_path("--oca-plugin-dir", dir)?;
        }
        for file in &self.diagnostics.diagnostics_files {
            check_host_path("--diagnostics-files", file)?;
        }
        if self.health_checks
            && let Err(reason) =
                crate::monitor::health::parse_healthz_url(&self.kubelet_healthz_url)
        {
            return Err(Error::InvalidConfig {
                flag: "--kubelet-healthz-url",
                reason,
            });
        }
        if let Some(file) = &self.probe_ca_file {
            crate::probes::read_ca_file(file).map_err(|e| Error::InvalidConfig {
                flag: "--probe-ca-file",
                reason: e.to_string(),
            })?;
        }
        if self.node_name.trim().is_empty() {
            return Err(Error::InvalidConfig {
                flag: "--node-name",
                reason: "must not be empty; set it from the pod's spec.nodeName".into(),
            });
        }
        // Zero would panic the reload timer; 100ms is still cheap (three small files hashed) and
        // lets tests watch a rotation without waiting seconds.
        if self.tls_reload_interval < Duration::from_millis(100) {
            return Err(Error::InvalidConfig {
                flag: "--tls-reload-interval",
                reason: format!(
                    "{:?} is too short; use at least 100ms (the default, 30s, suits certificates \
                     reissued days ahead)",
                    self.tls_reload_interval
                ),
            });
        }
        if self.drift_interval < Duration::from_millis(100) {
            return Err(Error::InvalidConfig {
                flag: "--drift-interval",
                reason: format!(
                    "{:?} is too short; use at least 100ms (each check dumps the host's links, \
                     addresses, routes and rules)",
                    self.drift_interval
                ),
            });
        }
        // A report with its interfaces, probes and problems is tens of KiB; the controller
        // refuses a --max-reply-bytes below 64 KiB for the same reason.
        if self.max_message_bytes < MIN_MESSAGE_BYTES {
            return Err(Error::InvalidConfig {
                flag: "--max-message-bytes",
                reason: format!(
                    "{} is too small for a node report; use at least {MIN_MESSAGE_BYTES} (64 KiB; \
                     the default is 1 MiB)",
                    self.max_message_bytes
                ),
            });
        }
        // Checked by the client `ApplyNetwork` builds, with the same rules, so that a bad value
        // stops the agent here instead of failing every `ApplyNetwork` with OCI VNICs later.
        if let Some(endpoint) = &self.imds_endpoint {
            nodekeeper_oci::ImdsClient::new(nodekeeper_oci::ImdsConfig::new(endpoint.clone()))
                .map_err(|e| Error::InvalidConfig {
                    flag: "--imds-endpoint",
                    reason: format!(
                        "{e}; write the metadata service's base URL, e.g. \
                         http://169.254.169.254, or leave the flag unset"
                    ),
                })?;
        }
        Ok(())
    }
}

/// The smallest `--max-message-bytes`: a node report must fit.
pub const MIN_MESSAGE_BYTES: usize = 64 * 1024;

/// A configured host path must be absolute and free of `..`, so that configuration cannot make
/// the agent read outside the tree it names.
pub fn check_host_path(flag: &'static str, path: &Path) -> Result<(), Error> {
    if !path.is_absolute() {
        return Err(Error::InvalidConfig {
            flag,
            reason: format!(
                "{} is not an absolute path; write it from /",
                path.display()
            ),
        });
    }
    if path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(Error::InvalidConfig {
            flag,
            reason: format!(
                "{} contains `..`; name the directory directly",
                path.display()
            ),
        });
    }
    Ok(())
}

/// Joins an absolute host path under a root (`/host/root` + `/var/lib` → `/host/root/var/lib`).
pub fn under_root(root: &Path, host_path: &Path) -> PathBuf {
    let relative = host_path.strip_prefix("/").unwrap_or(host_path);
    if relative.as_os_str().is_empty() {
        root.to_path_buf()
    } else {
        root.join(relative)
    }
}

/// `ADDRESS:PORT`, where an IPv6 address may also come without brackets (from the downward
/// API's `status.hostIP`, pasted before `:PORT`).
fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(address) = s.parse() {
        return Ok(address);
    }
    let bad = || {
        format!(
            "{s:?} is not ADDRESS:PORT; write e.g. 10.0.0.5:9444, [fd00::5]:9444 or fd00::5:9444"
        )
    };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let ip: std::net::Ipv6Addr = host.parse().map_err(|_| bad())?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    Ok(SocketAddr::new(ip.into(), port))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration; write e.g. 500ms, 30s or 5m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?} has unknown unit {unit:?}; use ms, s or m")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listen_address_takes_ipv6_with_or_without_brackets() {
        let ok = |s: &str| parse_listen(s).unwrap().to_string();
        assert_eq!(ok("10.0.0.5:9444"), "10.0.0.5:9444");
        assert_eq!(ok("[fd00::5]:9444"), "[fd00::5]:9444");
        assert_eq!(ok("fd00::5:9444"), "[fd00::5]:9444");
        assert_eq!(ok("2001:db8::a:b:9444"), "[2001:db8::a:b]:9444");
        for bad in [
            "10.0.0.5",
            "10.0.0.5:",
            "fd00::5",
            "host:9444",
            "[fd00::5]:x",
            "",
        ] {
            let e = parse_listen(bad).unwrap_err();
            assert!(e.contains("ADDRESS:PORT"), "{bad}: {e}");
        }
    }

    fn base() -> Vec<&'static str> {
        vec![
            "nodekeeper-agent",
            "--node-name=n1",
            "--tls-cert=/c",
            "--tls-key=/k",
            "--client-ca=/ca",
        ]
    }

    #[test]
    fn parses_defaults_and_lists() {
        let mut args = base();
        args.push("--mounts=/,/var/lib");
        let c = Config::try_parse_from(args).unwrap();
        assert_eq!(
            c.mounts,
            vec![PathBuf::from("/"), PathBuf::from("/var/lib")]
        );
        assert_eq!(c.sysctl_root(), PathBuf::from("/proc/sys"));
        assert_eq!(c.report_max_age, Duration::from_secs(1));
        c.validate().unwrap();
    }

    #[test]
    fn refuses_traversal_and_relative_paths() {
        for (flag, value) in [
            ("--mounts", "/var/../etc"),
            ("--mounts", "var/lib"),
            ("--oca-plugin-dir", "/var/lib/oca/../../etc"),
        ] {
            let mut args = base();
            let arg = format!("{flag}={value}");
            args.push(&arg);
            let c = Config::try_parse_from(args).unwrap();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(flag), "{err}");
        }
    }

    #[test]
    fn refuses_intervals_too_short_to_tick() {
        // `tokio::time::interval` panics on zero, so these must be refused before anything runs.
        for (flag, value, ok) in [
            ("--tls-reload-interval", "0", false),
            ("--tls-reload-interval", "99ms", false),
            ("--tls-reload-interval", "100ms", true),
            ("--drift-interval", "0", false),
            ("--drift-interval", "100ms", true),
        ] {
            let mut args = base();
            let arg = format!("{flag}={value}");
            args.push(&arg);
            let c = Config::try_parse_from(args).unwrap();
            match c.validate() {
                Ok(()) => assert!(ok, "{arg} was accepted"),
                Err(e) => {
                    assert!(!ok, "{arg} was refused: {e}");
                    assert!(e.to_string().contains(flag), "{e}");
                }
            }
        }
    }

    #[test]
    fn refuses_an_imds_endpoint_the_metadata_client_cannot_use() {
        for (value, ok) in [
            ("http://169.254.169.254", true),
            ("http://169.254.169.254/", true),
            ("http://127.0.0.1:8080/prefix", true),
            ("169.254.169.254", false),
            ("https://169.254.169.254", false),
            ("http://", false),
            ("not a url", false),
        ] {
            let mut args = base();
            let arg = format!("--imds-endpoint={value}");
            args.push(&arg);
            let c = Config::try_parse_from(args).unwrap();
            match c.validate() {
                Ok(()) => assert!(ok, "{arg} was accepted"),
                Err(e) => {
                    assert!(!ok, "{arg} was refused: {e}");
                    let e = e.to_string();
                    assert!(
                        e.contains("--imds-endpoint") && e.contains("http://169.254.169.254"),
                        "{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn refuses_a_max_message_size_below_a_report() {
        for (value, ok) in [
            ("4096", false),
            ("65535", false),
            ("65536", true),
            ("1048576", true),
        ] {
            let mut args = base();
            let arg = format!("--max-message-bytes={value}");
            args.push(&arg);
            let c = Config::try_parse_from(args).unwrap();
            match c.validate() {
                Ok(()) => assert!(ok, "{arg} was accepted"),
                Err(e) => {
                    assert!(!ok, "{arg} was refused: {e}");
                    let e = e.to_string();
                    assert!(
                        e.contains("--max-message-bytes") && e.contains("65536"),
                        "{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn joins_under_root() {
        assert_eq!(
            under_root(Path::new("/host"), Path::new("/")),
            PathBuf::from("/host")
        );
        assert_eq!(
            under_root(Path::new("/host"), Path::new("/var/lib")),
            PathBuf::from("/host/var/lib")
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("2h").is_err());
    }

    #[test]
    fn every_flag_has_an_env_var_and_help() {
        use clap::CommandFactory;
        let cmd = Config::command();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert!(
                env.as_deref().is_some_and(|e| e.starts_with("NODEKEEPER_")),
                "flag {id} has no NODEKEEPER_ env var"
            );
            assert!(arg.get_help().is_some(), "flag {id} has no help");
        }
    }
}
