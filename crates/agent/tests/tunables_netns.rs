//! Repair and conflict detection against the real kernel, inside a network namespace this test
//! creates: `net.*` sysctls are per namespace, so the host's values are never written.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use nix::sched::{CloneFlags, setns};
use nodekeeper_agent::tunables::{RawRule, RawRuleSet, TunableStatus, Tunables};
use nodekeeper_model::indicators::Verdict;

struct Netns(String);

impl Netns {
    fn create(name: &str) -> Self {
        let _ = Command::new("ip")
            .args(["netns", "del", name])
            .stderr(std::process::Stdio::null())
            .status();
        let ok = Command::new("ip")
            .args(["netns", "add", name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name}");
        Netns(name.to_string())
    }

    fn sysctl(&self, key: &str) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0, "sysctl", "-n", key])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    fn set(&self, key: &str, value: &str) {
        let ok = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.0,
                "sysctl",
                "-qw",
                &format!("{key}={value}"),
            ])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Runs `f` on a thread that has joined this namespace (setns affects only that thread,
    /// and /proc/sys/net shows the namespace of the reading thread).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path).unwrap();
            setns(&fd, CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn host(key: &str) -> String {
    std::fs::read_to_string(format!("/proc/sys/{}", key.replace('.', "/")))
        .unwrap()
        .trim()
        .to_string()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn rules() -> RawRuleSet {
    RawRuleSet {
        revision: 42,
        rules: vec![
            RawRule {
                name: "forwarding".into(),
                key: "net.ipv4.ip_forward".into(),
                comparison: 1,
                values: vec!["1".into()],
                repair: true,
                repair_max_per_hour: 3,
                severity: 3,
            },
            RawRule {
                name: "somaxconn".into(),
                key: "net.core.somaxconn".into(),
                comparison: 2,
                values: vec!["8192".into()],
                repair: true,
                ..RawRule::default()
            },
        ],
        thresholds: vec![],
    }
}

fn evaluate_in(ns: &Netns, state: std::path::PathBuf, install: bool) -> Vec<TunableStatus> {
    ns.run(move || {
        let mut t = Tunables::load("/proc/sys".into(), &state);
        if install {
            t.set_rules(&rules()).unwrap();
        }
        assert_eq!(t.revision(), 42);
        t.evaluate(now_ms())
    })
}

#[test]
#[allow(clippy::print_stdout)] // the SKIPPED line is for the person reading the test output
fn repairs_in_a_namespace_and_backs_off_on_conflict() {
    if !nix::unistd::Uid::effective().is_root() {
        println!("SKIPPED: needs root to create a network namespace (ip netns add)");
        return;
    }
    let ns = Netns::create(&format!("nk-agent-tun-{}", std::process::id()));
    let host_before = (host("net.ipv4.ip_forward"), host("net.core.somaxconn"));
    assert_eq!(
        ns.sysctl("net.ipv4.ip_forward"),
        "0",
        "a fresh namespace starts without forwarding"
    );
    let state = tempfile::tempdir().unwrap();

    let s = evaluate_in(&ns, state.path().to_path_buf(), true);
    assert_eq!(s[0].verdict, Verdict::Ok, "{s:?}");
    assert_eq!((s[0].previous.as_str(), s[0].current.as_str()), ("0", "1"));
    assert!(s[0].repaired_at_unix_ms > 0 && !s[0].conflict);
    assert_eq!(s[1].verdict, Verdict::Ok, "{s:?}");
    assert_eq!(s[1].current, "8192");
    assert_eq!(ns.sysctl("net.ipv4.ip_forward"), "1");
    assert_eq!(ns.sysctl("net.core.somaxconn"), "8192");

    // Someone else turns forwarding off again. A restarted agent (rules and history from the
    // state file) reports the conflict and does not write the key back.
    ns.set("net.ipv4.ip_forward", "0");
    let s = evaluate_in(&ns, state.path().to_path_buf(), false);
    assert!(s[0].conflict, "{s:?}");
    assert_eq!(s[0].verdict, Verdict::Critical);
    assert_eq!(s[0].current, "0");
    assert!(s[0].error.contains("someone else"), "{s:?}");
    assert_eq!(
        ns.sysctl("net.ipv4.ip_forward"),
        "0",
        "the agent must not fight"
    );
    assert!(!s[1].conflict);

    // The host never changed.
    assert_eq!(
        (host("net.ipv4.ip_forward"), host("net.core.somaxconn")),
        host_before
    );
}
