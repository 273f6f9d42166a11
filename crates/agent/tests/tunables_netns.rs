//! Repair and conflict detection against the real kernel, inside a network namespace this test
//! creates: `net.*` sysctls are per namespace, so the host's values are never written.

use std::time::{SystemTime, UNIX_EPOCH};

use nodekeeper_agent::tunables::{RawRule, RawRuleSet, TunableStatus, Tunables};
use nodekeeper_model::indicators::Verdict;

/// The testkit's namespace, with the panicking reads and writes this test's assertions use.
struct Netns(nodekeeper_testkit::Netns);

impl Netns {
    fn create(prefix: &str) -> Self {
        Netns(nodekeeper_testkit::Netns::new(prefix).expect("create a network namespace"))
    }

    fn sysctl(&self, key: &str) -> String {
        self.0.sysctl(key).unwrap()
    }

    fn set(&self, key: &str, value: &str) {
        self.0.set_sysctl(key, value).unwrap();
    }

    /// Runs `f` on a thread that has joined this namespace (entering changes only that thread,
    /// and /proc/sys/net shows the namespace of the reading thread).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.0.run_blocking(f)
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
fn repairs_in_a_namespace_and_backs_off_on_conflict() {
    nodekeeper_testkit::skip_unless_root!("needs root to create a network namespace");
    let ns = Netns::create("nk-agent-tun");
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
