//! `nodekeeper-agent --cleanup`: reverts on this host what the agent changed, and only that, then
//! exits (or, with `--cleanup-hold`, waits to be stopped, as a DaemonSet's Pod must). Run it from
//! `deploy/uninstall/agent-cleanup.yaml` after the controller is stopped.
//!
//! - Host networking: the empty network state is applied through netconf, whose plan deletes
//!   exactly what carries nodekeeper's ownership marks (links with the `nodekeeper:` alias;
//!   addresses, routes and rules with protocol 176; see `nodekeeper_netconf::observed`). The MTU
//!   and up/down state nodekeeper set on NICs it did not create are left: their earlier values
//!   were never recorded.
//! - Sysctls: each key a repair wrote (the state file's per-key record, kept whether or not a rule
//!   on the key is still in force or still repairs) gets back the value found before the first
//!   repair, if it still holds what nodekeeper wrote; a key already back at that value needs
//!   nothing; a key someone changed since is left and named.
//! - The state file (`<state-dir>/rules.json`) goes last, so an interrupted cleanup can run again.
//!
//! A second run finds nothing and says so.
// What it did is its output, read by a person in the Pod's log: plain lines on stdout.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};

use clap::Parser;
use nodekeeper_model::network::NetworkState;
use nodekeeper_model::tuning::normalize_value;
use nodekeeper_netconf::{ApplyOptions, Netconf, Outcome};

use crate::tunables::{self, STATE_FILE};

/// Reverts what nodekeeper changed on this host (its links, addresses, routes and rules, and
/// the sysctls it repaired) and exits.
#[derive(Clone, Debug, Parser)]
#[command(name = "nodekeeper-agent --cleanup", version, long_about = None)]
pub struct CleanupArgs {
    /// Run the cleanup (this set of flags applies only with it).
    #[arg(long, env = "NODEKEEPER_CLEANUP")]
    pub cleanup: bool,

    /// The agent's state directory (its repair record is read from here).
    #[arg(
        long,
        env = "NODEKEEPER_STATE_DIR",
        default_value = "/var/lib/nodekeeper"
    )]
    pub state_dir: PathBuf,

    /// Where the host's procfs is mounted; sysctls are under `<proc-root>/sys`.
    #[arg(long, env = "NODEKEEPER_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,

    /// The sysctl tree to restore (default `<proc-root>/sys`); must be writable.
    #[arg(long, env = "NODEKEEPER_SYSCTL_ROOT")]
    pub sysctl_root: Option<PathBuf>,

    /// After the cleanup, wait for SIGTERM instead of exiting (a DaemonSet's Pod must keep
    /// running; its log holds the summary).
    #[arg(long, env = "NODEKEEPER_CLEANUP_HOLD")]
    pub cleanup_hold: bool,
}

impl CleanupArgs {
    fn sysctl_root(&self) -> PathBuf {
        self.sysctl_root
            .clone()
            .unwrap_or_else(|| self.proc_root.join("sys"))
    }
}

/// Whether this process was started for the cleanup: `--cleanup` on the command line, or
/// `NODEKEEPER_CLEANUP` set to true.
pub fn requested() -> bool {
    std::env::args().skip(1).any(|a| a == "--cleanup")
        || std::env::var("NODEKEEPER_CLEANUP")
            .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
}

/// Why the cleanup stopped; what was reverted before stays reverted, and a second run goes on.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error("revert host networking: {0}")]
    RevertNetwork(String),
    #[error("read the repair record: {0}")]
    ReadRecord(String),
    #[error("restore sysctl {key} to {value:?} at {path}: {source}")]
    RestoreSysctl {
        key: String,
        value: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("remove {path}: {source}")]
    RemoveState {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What the cleanup did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Network steps taken (`delete-link nkm0 ...`).
    pub network: Vec<String>,
    /// `key: written -> original`.
    pub restored: Vec<String>,
    /// Sysctls left, with why.
    pub left: Vec<String>,
    /// Whether the state file was removed.
    pub state_removed: bool,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.network.is_empty() && self.restored.is_empty() && !self.state_removed {
            return write!(
                f,
                "cleanup done: nothing of nodekeeper's on this host ({} sysctls left)",
                self.left.len()
            );
        }
        write!(
            f,
            "cleanup done: {} network objects removed, {} sysctls restored, {} left, state file {}",
            self.network.len(),
            self.restored.len(),
            self.left.len(),
            if self.state_removed {
                "removed"
            } else {
                "absent"
            }
        )
    }
}

/// Runs the cleanup in the calling thread's network namespace, printing each change and the
/// summary on stdout. Needs a tokio runtime.
pub async fn run(args: &CleanupArgs) -> Result<Summary, CleanupError> {
    let mut summary = Summary::default();
    let netconf = Netconf::connect().map_err(|e| CleanupError::RevertNetwork(e.to_string()))?;
    let report = netconf
        .apply(&NetworkState::default(), &ApplyOptions::default())
        .await
        .map_err(|e| CleanupError::RevertNetwork(e.to_string()))?;
    if report.outcome != Outcome::Applied {
        return Err(CleanupError::RevertNetwork(format!(
            "{:?}: {}",
            report.outcome,
            report.error.unwrap_or_default()
        )));
    }
    for step in &report.plan.steps {
        let line = format!("{} {step}", step.op());
        println!("network: {line}");
        summary.network.push(line);
    }

    let sysctl_root = args.sysctl_root();
    let repairs = tunables::repairs(&args.state_dir).map_err(CleanupError::ReadRecord)?;
    for repair in repairs {
        restore(&sysctl_root, &repair, &mut summary)?;
    }

    // The rules record, and the network journal (the last applied state, which a later agent
    // start would otherwise put back on the host).
    for file in [STATE_FILE, crate::network::JOURNAL_FILE] {
        let state = args.state_dir.join(file);
        match std::fs::remove_file(&state) {
            Ok(()) => {
                println!("removed {}", state.display());
                summary.state_removed = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(CleanupError::RemoveState {
                    path: state,
                    source,
                });
            }
        }
    }
    println!("{summary}");
    Ok(summary)
}

/// Puts one repaired key back, if it still holds nodekeeper's value.
fn restore(
    root: &Path,
    repair: &tunables::Repair,
    summary: &mut Summary,
) -> Result<(), CleanupError> {
    let key = &repair.key;
    let mut leave = |why: String| {
        println!("sysctl {key}: left: {why}");
        summary.left.push(format!("{key}: {why}"));
    };
    let path = match tunables::sysctl_path(root, key) {
        Ok(p) => p,
        Err(e) => {
            leave(format!("key {e}"));
            return Ok(());
        }
    };
    let current = match std::fs::read_to_string(&path) {
        Ok(v) => normalize_value(&v),
        Err(e) => {
            leave(format!("read {}: {e}", path.display()));
            return Ok(());
        }
    };
    // Already as nodekeeper found it (a reboot resets /proc/sys): nothing to put back.
    if current == repair.original {
        return Ok(());
    }
    if current != repair.written {
        leave(format!(
            "now {current:?}, not the {:?} nodekeeper wrote: someone changed it since",
            repair.written
        ));
        return Ok(());
    }
    if repair.original.is_empty() {
        return Ok(());
    }
    std::fs::write(&path, format!("{}\n", repair.original)).map_err(|source| {
        CleanupError::RestoreSysctl {
            key: key.clone(),
            value: repair.original.clone(),
            path: path.clone(),
            source,
        }
    })?;
    println!(
        "sysctl {key}: {current} -> {} (as before nodekeeper)",
        repair.original
    );
    summary
        .restored
        .push(format!("{key}: {current} -> {}", repair.original));
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use nodekeeper_testkit::{Netns, skip_unless_root};

    use super::*;
    use crate::tunables::{RawRule, RawRuleSet, Tunables};

    fn rule(name: &str, key: &str, comparison: i32, value: &str) -> RawRule {
        RawRule {
            name: name.into(),
            key: key.into(),
            comparison,
            values: vec![value.into()],
            repair: true,
            repair_max_per_hour: 5,
            ..RawRule::default()
        }
    }

    /// A host (a network namespace) where nodekeeper created a macvlan, put an address, a route
    /// and a rule on a NIC it did not create, and repaired two sysctls; someone else has their
    /// own address, route and rule, and changed one repaired sysctl afterwards. The cleanup
    /// removes nodekeeper's and nothing else, and a second run finds nothing.
    #[test]
    fn reverts_only_what_nodekeeper_owns_on_a_netns_host() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = Arc::new(Netns::with_loopback("nk-cleanup").expect("a network namespace"));
        let ip = |args: &[&str]| ns.ip(args).unwrap();
        ip(&[
            "link", "add", "nic0", "type", "veth", "peer", "name", "nic0p",
        ]);
        ip(&["link", "set", "nic0", "up"]);
        ip(&["link", "set", "nic0p", "up"]);
        // Someone else's.
        ip(&["addr", "add", "192.0.2.10/24", "dev", "nic0"]);
        ip(&[
            "route",
            "add",
            "198.51.100.0/24",
            "via",
            "192.0.2.1",
            "table",
            "200",
        ]);
        ip(&[
            "rule",
            "add",
            "from",
            "192.0.2.10",
            "table",
            "200",
            "priority",
            "20200",
        ]);
        let before_links = ip(&["-o", "link", "show"]);
        let state = tempfile::tempdir().unwrap();
        let state_dir = state.path().to_path_buf();
        let host = Arc::clone(&ns);
        ns.run(move || async move {
            let ip = |args: &[&str]| host.ip(args).unwrap();
            // nodekeeper's, as ApplyNetwork lays it out.
            let desired: NetworkState = serde_json::from_str(
                r#"{
                  "links": [{"name": "nic0", "kind": "existing"},
                            {"name": "nkm0", "kind": "macvlan", "parent": "nic0", "up": true}],
                  "addresses": [{"link": "nic0", "cidr": "10.0.20.33/24"},
                                {"link": "nkm0", "cidr": "10.0.30.5/24"}],
                  "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "nic0",
                              "table": 101}],
                  "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}]
                }"#,
            )
            .unwrap();
            let nc = Netconf::connect().unwrap();
            let applied = nc.apply(&desired, &ApplyOptions::default()).await.unwrap();
            assert_eq!(applied.outcome, Outcome::Applied, "{:?}", applied.error);
            // Repairs through the agent's own rules, on this namespace's real /proc/sys/net.
            let mut t = Tunables::load("/proc/sys".into(), &state_dir);
            t.set_rules(&RawRuleSet {
                revision: 1,
                rules: vec![
                    rule("forward", "net.ipv4.ip_forward", 1, "1"),
                    rule("backlog", "net.core.somaxconn", 2, "8192"),
                ],
                thresholds: vec![],
            })
            .unwrap();
            let forward_before = host.sysctl("net.ipv4.ip_forward").unwrap();
            assert_eq!(forward_before, "0");
            let s = t.evaluate(1_000);
            assert!(s.iter().all(|s| s.repaired_at_unix_ms == 1_000), "{s:?}");
            assert_eq!(host.sysctl("net.ipv4.ip_forward").unwrap(), "1");
            // Someone changes a repaired value afterwards: theirs now.
            host.set_sysctl("net.core.somaxconn", "1000").unwrap();
            // Then the operator turns repair off (`features.repair: "false"` reaches the agent
            // as every rule changed), and the agent restarts: the rules' runtimes start afresh,
            // but what the repairs changed is still on record for the uninstall.
            t.set_rules(&RawRuleSet {
                revision: 2,
                rules: vec![
                    RawRule {
                        repair: false,
                        ..rule("forward", "net.ipv4.ip_forward", 1, "1")
                    },
                    RawRule {
                        repair: false,
                        ..rule("backlog", "net.core.somaxconn", 2, "8192")
                    },
                ],
                thresholds: vec![],
            })
            .unwrap();
            let s = t.evaluate(2_000);
            assert!(s.iter().all(|s| s.repaired_at_unix_ms == 0), "{s:?}");
            drop(t);
            let mut t = Tunables::load("/proc/sys".into(), &state_dir);
            t.evaluate(3_000);

            let args = CleanupArgs::parse_from([
                "nodekeeper-agent",
                "--cleanup",
                &format!("--state-dir={}", state_dir.display()),
            ]);
            let summary = run(&args).await.unwrap();
            let ops: Vec<&str> = summary
                .network
                .iter()
                .map(|s| s.split(' ').next().unwrap())
                .collect();
            assert_eq!(
                ops,
                [
                    "delete-rule",
                    "delete-route",
                    "delete-address",
                    "delete-address",
                    "delete-link"
                ],
                "{summary:?}"
            );
            assert_eq!(summary.restored, ["net.ipv4.ip_forward: 1 -> 0"]);
            assert_eq!(summary.left.len(), 1);
            assert!(summary.left[0].starts_with("net.core.somaxconn: now \"1000\""));
            assert!(summary.state_removed);
            assert_eq!(host.sysctl("net.ipv4.ip_forward").unwrap(), "0");
            assert_eq!(host.sysctl("net.core.somaxconn").unwrap(), "1000");

            // Someone else's objects are all there; nodekeeper's are gone.
            let addrs = ip(&["addr", "show", "dev", "nic0"]);
            assert!(addrs.contains("192.0.2.10/24") && !addrs.contains("10.0.20.33"));
            assert!(ip(&["route", "show", "table", "200"]).contains("198.51.100.0/24"));
            assert!(ip(&["route", "show", "table", "101"]).trim().is_empty());
            let rules = ip(&["rule", "show"]);
            assert!(
                rules.contains("20200") && !rules.contains("20101"),
                "{rules}"
            );
            assert!(!ip(&["-o", "link", "show"]).contains("nkm0"));

            // Idempotent: nothing left to do.
            let again = run(&args).await.unwrap();
            assert!(
                again.network.is_empty() && again.restored.is_empty() && !again.state_removed,
                "{again:?}"
            );
            assert!(again.to_string().contains("nothing of nodekeeper's"));
        });
        // The links are as they were before nodekeeper (names and count).
        let names = |s: &str| {
            s.lines()
                .filter_map(|l| l.split(':').nth(1).map(|n| n.trim().to_owned()))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&ip(&["-o", "link", "show"])), names(&before_links));
    }

    #[test]
    fn env_or_flag_requests_it_and_flags_have_env_vars() {
        use clap::CommandFactory;
        for arg in CleanupArgs::command().get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert!(
                env.is_some_and(|e| e.starts_with("NODEKEEPER_")),
                "flag {id} has no NODEKEEPER_ env var"
            );
        }
        let args = CleanupArgs::parse_from(["nodekeeper-agent", "--cleanup", "--cleanup-hold"]);
        assert!(args.cleanup && args.cleanup_hold);
        assert_eq!(args.sysctl_root(), PathBuf::from("/proc/sys"));
    }
}
