//! The README's first command, `cargo xtask demo`, run the way a newcomer runs it (the xtask
//! binary, from the repository root), under a control-plane name of its own so that a demo kept
//! with `--keep` on the same machine is left alone. It must install from `deploy/` and name where
//! each object came from, run the controller as the ServiceAccount `deploy/` created, and end
//! with a NetworkTest that succeeded across the simulated nodes. As root (CI), the plugin reaches
//! the controller through the Service from `deploy/`.
//!
//! It builds the demo's three binaries with `cargo build` first (a few minutes the first time:
//! cargo builds them with other features than the test build).

use std::path::Path;
use std::process::Command;

#[test]
fn the_demo_installs_from_deploy_and_ends_with_a_network_test_that_succeeded() {
    let name = format!("test-demo-{}", std::process::id());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(&root)
        .args(["demo", "--nodes", "3", "--timeout", "180", "--name", &name])
        .output()
        .expect("run xtask demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: String = stderr
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        out.status.success(),
        "xtask demo failed ({}):\n{stdout}\n--- stderr (tail)\n{tail}",
        out.status
    );
    let expect = |text: &str| {
        assert!(
            stdout.contains(text),
            "the demo's output lacks {text:?}:\n{stdout}"
        );
    };
    expect("`kubectl apply -k deploy/`");
    expect("Deployment nodekeeper/nodekeeper-controller");
    expect("from deploy/controller/controller.yaml");
    expect("DaemonSet nodekeeper/nodekeeper-agent");
    expect("from deploy/agent/daemonset.yaml");
    expect("as ServiceAccount nodekeeper/nodekeeper-controller");
    expect("all 3 agents read");
    expect("==> Demo finished");
    if nodekeeper_testkit::is_root() {
        expect("selects Pod nodekeeper-controller-0");
        expect("Result:        Succeeded");
        expect("Pairs:         6, 0 failed");
    } else {
        expect("Succeeded");
    }
}
