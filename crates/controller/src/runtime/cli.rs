//! The controller-manager's command line: every flag, each also settable through a
//! `NODEKEEPER_…` environment variable. The controllers' own flags are flattened in from
//! [`crate::controllers::Config`].

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::controllers;
use crate::shared::lists::InitialLists;

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line, with the current span and the list of enclosing spans.
    Json,
    /// Human-readable lines; coloured only when stderr is a terminal.
    Plain,
}

/// The nodekeeper controller-manager. Run two replicas: one holds the Lease and works, the other
/// waits to take over.
#[derive(Clone, Debug, Parser)]
#[command(name = "nodekeeper-controller", version, about, long_about = None)]
pub struct Cli {
    /// Namespace of the Lease, the certificate Secrets and the tuning ConfigMap.
    #[arg(long, env = "NODEKEEPER_NAMESPACE", default_value = "nodekeeper")]
    pub namespace: String,

    /// This replica's identity in the Lease (the Pod name in a cluster). Default: host name and PID.
    #[arg(long, env = "NODEKEEPER_IDENTITY")]
    pub identity: Option<String>,

    /// This replica's Pod name; when set, the leader labels its Pod `nodekeeper.dev/leader=true`
    /// so that the Service routes the HTTP API to it.
    #[arg(long, env = "NODEKEEPER_POD_NAME")]
    pub pod_name: Option<String>,

    /// Address of the HTTP API and metrics. The default `[::]` takes IPv4 and IPv6 alike; on a
    /// host without IPv6 (`ipv6.disable=1`) the controller listens on `0.0.0.0` instead.
    #[arg(long, env = "NODEKEEPER_HTTP_LISTEN", default_value = "[::]:8080")]
    pub http_listen: SocketAddr,

    /// Port of the agents' gRPC servers on each node's InternalIP.
    #[arg(long, env = "NODEKEEPER_AGENT_PORT", default_value_t = 9443)]
    pub agent_port: u16,

    /// Only Nodes matching this label selector are managed (default: all).
    #[arg(long, env = "NODEKEEPER_NODE_SELECTOR")]
    pub node_selector: Option<String>,

    /// How the watches of every Node and every Pod read what exists when they start: `stream`
    /// has the API server send it on the watch (WatchList, on by default in Kubernetes 1.32 and
    /// since 1.34: one pass over its cache); `pages` lists 100 Nodes (250 Pods) a request, each
    /// of which costs the API server a walk over the rest of its cache (tens of seconds of CPU
    /// at 65,000 nodes); `auto` asks the API server once, when this replica takes the Lease, and
    /// streams when it can.
    #[arg(
        long,
        env = "NODEKEEPER_INITIAL_LISTS",
        value_enum,
        default_value_t = InitialLists::Auto
    )]
    pub initial_lists: InitialLists,

    /// Name of the Lease.
    #[arg(
        long,
        env = "NODEKEEPER_LEASE_NAME",
        default_value = "nodekeeper-controller"
    )]
    pub lease_name: String,

    /// How long a Lease holder that stopped renewing keeps it. A standby watches the Lease and
    /// takes over this long after the dead leader's last renewal (plus one request): 14 s with
    /// the defaults.
    #[arg(long, env = "NODEKEEPER_LEASE_DURATION", default_value = "14s", value_parser = duration)]
    pub lease_duration: Duration,

    /// The leader gives up (and stops writing) if it could not renew for this long; a renewal
    /// that failed is retried every second until then, so the API server may stall for this −
    /// --retry-period when a renewal falls due (2 s with the defaults). Keep it below
    /// --lease-duration: the gap (2 s) is the old leader's time to stop before a standby may lead.
    #[arg(long, env = "NODEKEEPER_RENEW_DEADLINE", default_value = "12s", value_parser = duration)]
    pub renew_deadline: Duration,

    /// Interval of Lease renewals. Each renewal is one API write (a PUT), so this sets the
    /// controller's steady-state write rate: 10s is 0.1 writes/s (client-go's 2s would be 0.5/s).
    /// Standbys never write and never poll: they watch the Lease. `--retry-period 5s` keeps the
    /// failover and tolerates a 7 s stall for 0.2 writes/s (docs/scaling.md).
    #[arg(long, env = "NODEKEEPER_RETRY_PERIOD", default_value = "10s", value_parser = duration)]
    pub retry_period: Duration,

    /// Name of the tuning ConfigMap in `--namespace`.
    #[arg(long, env = "NODEKEEPER_TUNING_CONFIGMAP", default_value = nodekeeper_model::tuning::CONFIGMAP_NAME)]
    pub tuning_configmap: String,

    /// Largest agent reply accepted, in bytes; a larger one counts as an invalid reply.
    #[arg(long, env = "NODEKEEPER_MAX_REPLY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_reply_bytes: usize,

    /// Log line format.
    #[arg(
        long,
        env = "NODEKEEPER_LOG_FORMAT",
        value_enum,
        default_value = "json"
    )]
    pub log_format: LogFormat,

    /// Log filter in `tracing` env-filter syntax.
    #[arg(long, env = "NODEKEEPER_LOG", default_value = "info")]
    pub log: String,

    /// Remove what nodekeeper put in the cluster (its Node conditions, taint, labels and
    /// annotations, its Lease and certificate Secrets) and exit; the uninstall Job runs this after
    /// the controller is stopped (README, "Uninstall").
    #[arg(long, env = "NODEKEEPER_CLEANUP")]
    pub cleanup: bool,

    /// The controllers' own flags.
    #[command(flatten)]
    pub controllers: controllers::Config,
}

impl Cli {
    /// This replica's identity: `--identity`, else the host name and PID.
    pub fn identity(&self) -> String {
        self.identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        })
    }

    /// Checks the leadership timings (retry period < renew deadline < lease duration), values
    /// that would leave the controller running but doing nothing useful, and the controllers'
    /// names.
    pub fn check(&self) -> Result<(), String> {
        self.controllers.check()?;
        if self.retry_period < Duration::from_secs(1) {
            return Err(format!(
                "--retry-period ({:?}) must be at least 1s: every renewal is a Lease write, so a \
                 shorter period writes to the API server many times a second (default 10s)",
                self.retry_period
            ));
        }
        if self.agent_port == 0 {
            return Err(
                "--agent-port 0: give the port the agents listen on (the DaemonSet's \
                 NODEKEEPER_LISTEN port, default 9443)"
                    .into(),
            );
        }
        let diagnostics_timeout = self.controllers.node_diagnostic.diagnostics_timeout;
        if diagnostics_timeout.is_zero() {
            return Err(format!(
                "--diagnostics-timeout ({diagnostics_timeout:?}) must be more than 0: every \
                 node's diagnostics bundle would fail at once as late; give the longest time one \
                 bundle may take to arrive (default 5m)"
            ));
        }
        if self.controllers.node_diagnostic.diagnostics_max_bytes == 0 {
            return Err(
                "--diagnostics-max-bytes 0: every diagnostics bundle would fail as too large; give \
                 the bytes of bundles to keep (default 2147483648, 2 GiB)"
                    .into(),
            );
        }
        let join_timeout = self.controllers.node_set.nodeset_join_timeout;
        if join_timeout.is_zero() {
            // plan() replaces a machine that has not joined after this long: zero replaces every
            // machine the moment it is created, before any kubelet could report.
            return Err(format!(
                "--nodeset-join-timeout ({join_timeout:?}) must be more than 0: every new \
                 machine would be replaced at once, before its kubelet could join; give the \
                 longest time a machine may take to boot and join (default 10m)"
            ));
        }
        let nnc = &self.controllers.node_network_config;
        // Both are the NodeNetworkConfig controller's requeue delays: zero has it reconcile in a
        // loop, re-reading its nodes (and, during a rollout, the cloud) without pause.
        if nnc.nnc_poll_interval < Duration::from_millis(100) {
            return Err(format!(
                "--nnc-poll-interval ({:?}) must be at least 100ms: a rollout in progress is \
                 looked at again this soon, so a shorter one spins on the cloud's and the agents' \
                 APIs (default 2s)",
                nnc.nnc_poll_interval
            ));
        }
        if nnc.nnc_resync_interval < Duration::from_secs(1) {
            return Err(format!(
                "--nnc-resync-interval ({:?}) must be at least 1s: every finished \
                 NodeNetworkConfig is reconciled again this often (default 60s)",
                nnc.nnc_resync_interval
            ));
        }
        for (flag, timeout, default) in [
            ("--nnc-attach-timeout", nnc.nnc_attach_timeout, "5m"),
            ("--nnc-apply-timeout", nnc.nnc_apply_timeout, "90s"),
        ] {
            if timeout.is_zero() {
                return Err(format!(
                    "{flag} ({timeout:?}) must be more than 0: every node of every \
                     NodeNetworkConfig would fail at once as late (default {default})"
                ));
            }
        }
        let diagnostics_dir = &self.controllers.node_diagnostic.diagnostics_dir;
        if !diagnostics_dir.is_absolute() {
            // Refused here: the bundle store would refuse it later, with a warning only, and every
            // NodeDiagnostic would fail as if the store were full.
            return Err(format!(
                "--diagnostics-dir {:?} must be an absolute path (the controller's bundle \
                 store); give the directory's full path, e.g. /var/lib/nodekeeper/diagnostics \
                 (the default)",
                diagnostics_dir.display().to_string()
            ));
        }
        if let Some(selector) = &self.node_selector {
            // Refused here rather than by the Node watch later, where a typo would read as a
            // failing watch retried forever, with no node managed.
            let parsed = nodekeeper_api::selector::parse(selector)
                .and_then(|parsed| nodekeeper_api::selector::check(&parsed));
            if let Err(why) = parsed {
                return Err(format!(
                    "--node-selector {selector:?}: {why}; give a label selector in kubectl's \
                     syntax, e.g. `node-role.kubernetes.io/worker` or `pool in (gpu,cpu),!spot`"
                ));
            }
        }
        if self.max_reply_bytes < MIN_REPLY_BYTES {
            return Err(format!(
                "--max-reply-bytes {} is below {MIN_REPLY_BYTES}: every agent's report would be \
                 refused as too large (default {})",
                self.max_reply_bytes,
                4 * 1024 * 1024
            ));
        }
        if let Err(error) = tracing_subscriber::EnvFilter::try_new(&self.log) {
            return Err(format!(
                "--log {:?}: {error}; use tracing's env-filter syntax, e.g. `info` or \
                 `info,nodekeeper_controller=debug`",
                self.log
            ));
        }
        // The Lease stores whole seconds, and a standby's expiry is judged by what it stores.
        if self.lease_duration.subsec_nanos() != 0 || self.lease_duration.is_zero() {
            return Err(format!(
                "--lease-duration ({:?}) must be a whole number of seconds, at least 1s: the Lease \
                 stores leaseDurationSeconds, and standbys judge expiry by it",
                self.lease_duration
            ));
        }
        if self.renew_deadline >= self.lease_duration || self.retry_period >= self.renew_deadline {
            return Err(format!(
                "need --retry-period ({:?}) < --renew-deadline ({:?}) < --lease-duration ({:?}): \
                 the leader renews every retry period, gives up at the renew deadline, and a \
                 standby may take over at the lease duration (defaults 10s, 12s, 14s)",
                self.retry_period, self.renew_deadline, self.lease_duration
            ));
        }
        Ok(())
    }
}

/// The smallest `--max-reply-bytes` accepted: a node's report with a few GPUs and interfaces
/// is tens of KiB.
const MIN_REPLY_BYTES: usize = 64 * 1024;

fn duration(s: &str) -> Result<Duration, String> {
    nodekeeper_model::tuning::parse_duration(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_has_an_env_var_and_help() {
        use clap::CommandFactory;
        for arg in Cli::command().get_arguments() {
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

    #[test]
    fn lease_timings_out_of_order_are_refused_naming_the_flags() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["nodekeeper-controller"];
            argv.extend_from_slice(args);
            Cli::parse_from(argv).check()
        };
        assert_eq!(parse(&[]), Ok(()));
        assert_eq!(parse(&["--retry-period", "5s"]), Ok(()));
        for args in [
            &["--retry-period", "12s"][..],
            &["--renew-deadline", "14s"],
            &["--lease-duration", "12s"],
        ] {
            let error = parse(args).unwrap_err();
            for flag in ["--retry-period", "--renew-deadline", "--lease-duration"] {
                assert!(error.contains(flag), "{args:?}: {error}");
            }
        }
        for (args, flag) in [
            (&["--retry-period", "0s"][..], "--retry-period"),
            (&["--retry-period", "100ms"], "--retry-period"),
            (&["--agent-port", "0"], "--agent-port"),
            (&["--max-reply-bytes", "0"], "--max-reply-bytes"),
            (&["--diagnostics-timeout", "0s"], "--diagnostics-timeout"),
            (&["--diagnostics-timeout", "0ms"], "--diagnostics-timeout"),
            (&["--diagnostics-dir", "diagnostics"], "--diagnostics-dir"),
            (&["--diagnostics-dir", "./var/diag"], "--diagnostics-dir"),
            (&["--log", "info,[unclosed"], "--log"),
            (&["--node-selector", "pool=gpu,,zone=a"], "--node-selector"),
            (&["--diagnostics-max-bytes", "0"], "--diagnostics-max-bytes"),
            (&["--nodeset-join-timeout", "0s"], "--nodeset-join-timeout"),
            (&["--nodeset-join-timeout", "0ms"], "--nodeset-join-timeout"),
            (&["--nnc-poll-interval", "0s"], "--nnc-poll-interval"),
            (&["--nnc-poll-interval", "99ms"], "--nnc-poll-interval"),
            (&["--nnc-resync-interval", "0s"], "--nnc-resync-interval"),
            (&["--nnc-resync-interval", "999ms"], "--nnc-resync-interval"),
            (&["--nnc-attach-timeout", "0s"], "--nnc-attach-timeout"),
            (&["--nnc-apply-timeout", "0s"], "--nnc-apply-timeout"),
        ] {
            let error = parse(args).unwrap_err();
            assert!(error.contains(flag), "{args:?}: {error}");
        }
        assert_eq!(parse(&["--retry-period", "1s"]), Ok(()));
        // The smallest values accepted.
        for args in [
            &["--nodeset-join-timeout", "1s"][..],
            &["--nnc-poll-interval", "100ms"],
            &["--nnc-resync-interval", "1s"],
            &["--nnc-attach-timeout", "1s"],
            &["--nnc-apply-timeout", "1s"],
            &["--diagnostics-max-bytes", "1"],
        ] {
            assert_eq!(parse(args), Ok(()), "{args:?}");
        }
        let error = parse(&["--lease-duration", "12500ms"]).unwrap_err();
        assert!(
            error.contains("--lease-duration") && error.contains("whole"),
            "{error}"
        );
    }

    #[test]
    fn a_bad_node_selector_is_refused_naming_the_part_and_an_example() {
        let check = |selector: &str| {
            Cli::parse_from(["nodekeeper-controller", "--node-selector", selector]).check()
        };
        for good in ["nodekeeper.dev/e2e-group=g1", "pool in (gpu,cpu),!spot", ""] {
            assert_eq!(check(good), Ok(()), "{good}");
        }
        for (bad, part) in [
            ("pool=gpu,,zone=a", "empty requirement"),
            ("zone in (a", "unbalanced"),
            ("pool=gpu pool", "\"pool=gpu pool\""),
            ("Pool/x=gpu", "\"Pool/x\" is not a valid label key"),
            ("pool=gpu!", "\"gpu!\" is not a valid label value"),
        ] {
            let error = check(bad).unwrap_err();
            assert!(
                error.starts_with(&format!("--node-selector {bad:?}: ")),
                "{bad}: {error}"
            );
            assert!(error.contains(part), "{bad}: {error}");
            assert!(error.contains("e.g. `"), "an example: {error}");
        }
    }

    #[test]
    fn networktest_concurrency_defaults() {
        let cli = Cli::parse_from(["nodekeeper-controller"]);
        assert_eq!(cli.controllers.networktest.networktest_concurrency, 4);
        assert_eq!(
            cli.controllers.networktest.networktest_agent_concurrency,
            1024
        );
    }
}
