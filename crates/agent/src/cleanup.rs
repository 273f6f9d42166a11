//! `nodekeeper-agent --cleanup`: reverts on this host what the agent changed, and only that, then
//! exits (or, with `--cleanup-hold`, waits to be stopped, as a DaemonSet's Pod must). Run it from
//! `deploy/uninstall/agent-cleanup.yaml` after the controller is stopped.
//!
//! - A running agent stops it: the agent holds an exclusive `flock(2)` on `<state-dir>/agent.lock`
//!   while it runs (its drift loop would put back what the cleanup removes), and the cleanup
//!   refuses while that lock is held, and holds it itself while it works.
//! - An apply the agent journalled and never finished (`<state-dir>/network.json`'s `pending`,
//!   left when the agent died midway) is undone first, as the agent's next start would have: the
//!   links it configured get their MTU and up/down state from before it back. A restore point
//!   that cannot be planned any more (a link it names is gone) is left, and said so.
//! - Host networking: the empty network state is applied through netconf, whose plan deletes
//!   exactly what carries nodekeeper's ownership marks (links with the `nodekeeper:` alias;
//!   addresses, routes and rules with protocol 176; see `nodekeeper_netconf::observed`). The MTU
//!   and up/down state nodekeeper set on NICs it did not create are left: their earlier values
//!   were never recorded.
//! - Sysctls: each key a repair wrote (the state file's per-key record, kept whether or not a rule
//!   on the key is still in force or still repairs) gets back the value found before the first
//!   repair, if it still holds what nodekeeper wrote; a key already back at that value needs
//!   nothing; a key someone changed since is left and named.
//! - The agent's state files go last (the repair record `rules.json`, the network journal
//!   `network.json`, the node problems `monitor-conditions.json`, then `agent.lock`), so that an
//!   interrupted cleanup can run again.
//!
//! A second run finds nothing and says so.
// What it did is its output, read by a person in the Pod's log: plain lines on stdout.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};

use clap::Parser;
use clap::builder::{BoolishValueParser, TypedValueParser as _};
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
    #[arg(long, env = "NODEKEEPER_CLEANUP", value_parser = BoolishValueParser::new())]
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
    #[arg(long, env = "NODEKEEPER_CLEANUP_HOLD", value_parser = BoolishValueParser::new())]
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
/// `NODEKEEPER_CLEANUP` set to a true value.
pub fn requested() -> bool {
    requested_by(
        std::env::args_os().skip(1),
        std::env::var_os("NODEKEEPER_CLEANUP").as_deref(),
    )
}

/// [`requested`] for these arguments and this value of `NODEKEEPER_CLEANUP`. The value is read as
/// clap reads the `--cleanup` flag's variable (in [`CleanupArgs`] and in the agent's `Config`
/// alike): `1`, `true`, `yes`, `on`, `y`, `t` and `0`, `false`, `no`, `off`, `n`, `f`, in any
/// case. Anything else is not a request here, and the agent's own flags then refuse it, naming
/// the variable.
pub fn requested_by(
    args: impl IntoIterator<Item = std::ffi::OsString>,
    env: Option<&std::ffi::OsStr>,
) -> bool {
    args.into_iter().any(|a| a == "--cleanup")
        || env.is_some_and(|v| {
            BoolishValueParser::new()
                .parse_ref(&clap::Command::new("nodekeeper-agent"), None, v)
                .unwrap_or(false)
        })
}

/// The file a running agent holds an exclusive `flock(2)` on, in `--state-dir`.
pub const LOCK_FILE: &str = "agent.lock";

/// An exclusive lock on `<state-dir>/agent.lock`: held by a running agent, and by the cleanup
/// while it works. Released when dropped, or when the process ends however it ends (the kernel
/// drops a `flock` with the last descriptor), so a killed agent leaves no stale lock.
#[derive(Debug)]
pub struct StateLock {
    _file: nix::fcntl::Flock<std::fs::File>,
}

impl StateLock {
    /// Takes the lock without waiting (creating the directory and the file when missing);
    /// `Ok(None)` when another process holds it.
    pub fn try_take(state_dir: &Path) -> std::io::Result<Option<Self>> {
        use nix::fcntl::{Flock, FlockArg};
        std::fs::create_dir_all(state_dir)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(state_dir.join(LOCK_FILE))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(file) => Ok(Some(Self { _file: file })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err(errno.into()),
        }
    }
}

/// Why the cleanup stopped; what was reverted before stays reverted, and a second run goes on.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error(
        "a nodekeeper-agent still runs on this host (it holds {path}), and its drift loop would \
         put back what the cleanup removes: delete the agent DaemonSet (or stop the agent), wait \
         for its Pod to end, then run the cleanup again"
    )]
    AgentRunning { path: PathBuf },
    #[error("lock {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("read the network journal {path}: {reason}")]
    ReadJournal { path: PathBuf, reason: String },
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
    /// Steps that undid an apply cut short (`set-mtu nic0 ...`), before [`Summary::network`].
    pub undone: Vec<String>,
    /// `key: written -> original`.
    pub restored: Vec<String>,
    /// Sysctls (and an interrupted apply that could not be undone) left, with why.
    pub left: Vec<String>,
    /// Whether a state file was removed.
    pub state_removed: bool,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.network.is_empty()
            && self.undone.is_empty()
            && self.restored.is_empty()
            && !self.state_removed
        {
            return write!(
                f,
                "cleanup done: nothing of nodekeeper's on this host ({} sysctls left)",
                self.left.len()
            );
        }
        if !self.undone.is_empty() {
            write!(
                f,
                "interrupted apply undone ({} steps); ",
                self.undone.len()
            )?;
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
    let lock_path = args.state_dir.join(LOCK_FILE);
    let _lock = match StateLock::try_take(&args.state_dir) {
        Ok(Some(lock)) => lock,
        Ok(None) => return Err(CleanupError::AgentRunning { path: lock_path }),
        Err(source) => {
            return Err(CleanupError::Lock {
                path: lock_path,
                source,
            });
        }
    };
    let mut summary = Summary::default();
    let netconf = Netconf::connect().map_err(|e| CleanupError::RevertNetwork(e.to_string()))?;
    undo_pending(&netconf, &args.state_dir, &mut summary).await?;
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

    // The rules record, the network journal (the last applied state, which a later agent start
    // would otherwise put back on the host) and the node problems the monitors keep across
    // restarts.
    for file in [
        STATE_FILE,
        crate::network::JOURNAL_FILE,
        crate::monitor::persist::FILE_NAME,
    ] {
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
    // Last the lock, which this run created if no agent had (held until the process ends; an
    // agent started meanwhile waits for it).
    if let Err(source) = std::fs::remove_file(&lock_path)
        && source.kind() != std::io::ErrorKind::NotFound
    {
        return Err(CleanupError::RemoveState {
            path: lock_path,
            source,
        });
    }
    println!("{summary}");
    Ok(summary)
}

/// Undoes an apply the agent journalled and never finished (what its next start would have done):
/// applies the journal's restore point, which gives the links that apply configured their MTU
/// and up/down state from before it. The empty state applied next removes the rest.
async fn undo_pending(
    netconf: &Netconf,
    state_dir: &Path,
    summary: &mut Summary,
) -> Result<(), CleanupError> {
    let path = state_dir.join(crate::network::JOURNAL_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(CleanupError::ReadJournal {
                path,
                reason: e.to_string(),
            });
        }
    };
    let pending =
        crate::network::pending_restore_point(&bytes).map_err(|e| CleanupError::ReadJournal {
            path: path.clone(),
            reason: format!("{e}; move the file away to clean up without it"),
        })?;
    let Some((generation, before)) = pending else {
        return Ok(());
    };
    let generation = &generation;
    let left = match netconf.apply(&before, &ApplyOptions::default()).await {
        Ok(report) if report.outcome == Outcome::Applied => {
            for step in &report.plan.steps {
                let line = format!("{} {step}", step.op());
                println!("network: undo interrupted apply {generation:?}: {line}");
                summary.undone.push(line);
            }
            return Ok(());
        }
        Ok(report) => format!(
            "not undone ({:?}: {}); its links keep their MTU and up/down state",
            report.outcome,
            report.error.unwrap_or_default()
        ),
        // A link the restore point names is gone: there is nothing to give its state back to.
        Err(e) => format!("not undone ({e}); left as it is"),
    };
    let line = format!("network: the apply of generation {generation:?} cut short: {left}");
    println!("{line}");
    summary.left.push(line);
    Ok(())
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

    /// An apply cut short (the journal's restore point: nic0 at MTU 1500, up) is undone before
    /// the empty state is applied, and every state file of the agent is removed.
    #[test]
    fn undoes_an_interrupted_apply_and_removes_every_state_file() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = Arc::new(Netns::with_loopback("nk-cleanup-pend").expect("a network namespace"));
        let ip = |args: &[&str]| ns.ip(args).unwrap();
        ip(&[
            "link", "add", "nic0", "type", "veth", "peer", "name", "nic0p",
        ]);
        ip(&["link", "set", "nic0", "up"]);
        // Where the apply that was cut short had got to.
        ip(&["link", "set", "nic0", "mtu", "9000"]);
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().to_path_buf();
        std::fs::write(
            dir.join(crate::network::JOURNAL_FILE),
            r#"{"applied": null, "pending": {"generation": "uid-1/2", "before":
                {"links": [{"name": "nic0", "kind": "existing", "mtu": 1500, "up": true}]}}}"#,
        )
        .unwrap();
        std::fs::write(dir.join(crate::monitor::persist::FILE_NAME), "{}").unwrap();
        let summary = ns.run(move || async move {
            let args = CleanupArgs::parse_from([
                "nodekeeper-agent",
                "--cleanup",
                &format!("--state-dir={}", dir.display()),
            ]);
            run(&args).await.unwrap()
        });
        assert_eq!(summary.undone.len(), 1, "{summary:?}");
        assert!(summary.undone[0].starts_with("set-link"), "{summary:?}");
        assert!(
            summary.network.is_empty() && summary.left.is_empty(),
            "{summary:?}"
        );
        assert!(
            summary.to_string().contains("interrupted apply undone"),
            "{summary}"
        );
        let link = ip(&["-o", "link", "show", "nic0"]);
        assert!(link.contains("mtu 1500"), "{link}");
        let left: Vec<_> = std::fs::read_dir(state.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "state files left: {left:?}");
    }

    /// A restore point that cannot be planned any more (its link is gone) is left, said so, and
    /// does not stop the cleanup.
    #[test]
    fn an_interrupted_apply_that_cannot_be_undone_is_left_and_said_so() {
        skip_unless_root!("needs root to create network namespaces");
        let ns = Netns::with_loopback("nk-cleanup-gone").expect("a network namespace");
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().to_path_buf();
        std::fs::write(
            dir.join(crate::network::JOURNAL_FILE),
            r#"{"applied": null, "pending": {"generation": "uid-1/2", "before":
                {"links": [{"name": "gone0", "kind": "existing", "mtu": 1500}]}}}"#,
        )
        .unwrap();
        let summary = ns.run(move || async move {
            let args = CleanupArgs::parse_from([
                "nodekeeper-agent",
                "--cleanup",
                &format!("--state-dir={}", dir.display()),
            ]);
            run(&args).await.unwrap()
        });
        assert!(summary.undone.is_empty(), "{summary:?}");
        assert_eq!(summary.left.len(), 1, "{summary:?}");
        assert!(
            summary.left[0].contains("\"uid-1/2\" cut short")
                && summary.left[0].contains("not undone"),
            "{summary:?}"
        );
        assert!(!state.path().join(crate::network::JOURNAL_FILE).exists());
    }

    /// The cleanup refuses, before it touches anything, while another process (a running agent)
    /// holds the state directory's lock, and names what to do.
    #[tokio::test]
    async fn refuses_while_the_state_directory_is_locked() {
        let state = tempfile::tempdir().unwrap();
        std::fs::write(state.path().join(STATE_FILE), "{}").unwrap();
        let held = StateLock::try_take(state.path())
            .unwrap()
            .expect("a free lock");
        assert!(
            StateLock::try_take(state.path()).unwrap().is_none(),
            "a second holder must be refused"
        );
        let args = CleanupArgs::parse_from([
            "nodekeeper-agent",
            "--cleanup",
            &format!("--state-dir={}", state.path().display()),
        ]);
        let error = run(&args).await.unwrap_err();
        assert!(
            matches!(error, CleanupError::AgentRunning { .. }),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("agent.lock") && message.contains("delete the agent DaemonSet"),
            "{message}"
        );
        assert!(
            state.path().join(STATE_FILE).exists(),
            "the record was touched"
        );
        drop(held);
        assert!(StateLock::try_take(state.path()).unwrap().is_some());
    }

    /// `NODEKEEPER_CLEANUP` means what clap makes of it in both flag sets: whatever requests the
    /// cleanup parses as true there, whatever does not parses as false or is refused.
    #[test]
    fn the_cleanup_variable_is_read_alike_everywhere() {
        use clap::CommandFactory;
        use std::ffi::OsStr;
        let none = std::iter::empty::<std::ffi::OsString>;
        for (value, cleanup) in [
            ("1", Some(true)),
            ("true", Some(true)),
            ("TRUE", Some(true)),
            ("yes", Some(true)),
            ("on", Some(true)),
            ("0", Some(false)),
            ("false", Some(false)),
            ("no", Some(false)),
            ("off", Some(false)),
            ("maybe", None),
        ] {
            assert_eq!(
                requested_by(none(), Some(OsStr::new(value))),
                cleanup == Some(true),
                "NODEKEEPER_CLEANUP={value}"
            );
            // How each flag set parses the variable: a flag with a value goes the same way.
            for mut cmd in [CleanupArgs::command(), crate::Config::command()] {
                let parser = cmd
                    .get_arguments()
                    .find(|a| a.get_id() == "cleanup")
                    .unwrap()
                    .get_value_parser()
                    .clone();
                let arg = clap::Arg::new("v").long("v").value_parser(parser);
                cmd = clap::Command::new("t").arg(arg);
                let parsed = cmd
                    .try_get_matches_from(["t", &format!("--v={value}")])
                    .ok()
                    .and_then(|m| m.get_one::<bool>("v").copied());
                assert_eq!(parsed, cleanup, "NODEKEEPER_CLEANUP={value}");
            }
        }
        assert!(requested_by(["--cleanup".into()], None));
        assert!(!requested_by(none(), None));
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
