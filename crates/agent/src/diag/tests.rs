//! Bundles built by the real gatherers from files in a temporary directory: a failing part is
//! recorded in the manifest while the rest arrive, the size cap holds, and planted secrets are
//! gone from every member.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::Path;

use clap::Parser as _;
use futures::StreamExt as _;

use super::*;

struct Rig {
    dir: tempfile::TempDir,
    diagnostics: Arc<Diagnostics>,
}

fn rig(extra: &[String]) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let write = |rel: &str, text: &str| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("sysctl/net/core/somaxconn", "4096\n");
    write("proc/net/sockstat", "sockets: used 42\n");
    write(
        "kmsg",
        "6,1,1000,-;eth0: link up\n4,2,2000,-;kubelet token=kmsg-secret-1 seen\n",
    );
    write(
        "host/etc/default/kubelet",
        "KUBELET_EXTRA_ARGS=--v=2\nBOOTSTRAP_TOKEN=env-secret-2\n",
    );
    let s = |p: &Path| p.display().to_string();
    let mut args = vec![
        "nodekeeper-agent".to_string(),
        "--node-name=n1".into(),
        "--tls-cert=/c".into(),
        "--tls-key=/k".into(),
        "--client-ca=/ca".into(),
        format!("--state-dir={}", s(&root.join("state"))),
        format!("--sysctl-root={}", s(&root.join("sysctl"))),
        format!("--proc-root={}", s(&root.join("proc"))),
        format!("--host-root={}", s(&root.join("host"))),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
        format!("--diagnostics-kmsg={}", s(&root.join("kmsg"))),
        "--diagnostics-journalctl=/nonexistent/journalctl".into(),
        "--diagnostics-files=/etc/default/kubelet,/etc/missing.env".into(),
    ];
    args.extend_from_slice(extra);
    let config = Config::try_parse_from(args).unwrap();
    let agent = Arc::new(Agent::new(&config));
    Rig {
        diagnostics: Arc::new(Diagnostics::new(agent, &config)),
        dir,
    }
}

/// The bundle's bytes and the last chunk's summary.
async fn fetch(rig: &Rig, req: pb::DiagnosticsRequest) -> (Vec<u8>, pb::DiagnosticsSummary) {
    let mut stream = rig.diagnostics.collect(req).unwrap();
    let mut bytes = Vec::new();
    let mut summary = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        assert!(chunk.data.len() <= bundle::CHUNK_BYTES);
        assert!(
            summary.is_none(),
            "the summary comes with the last chunk only"
        );
        bytes.extend_from_slice(&chunk.data);
        summary = chunk.summary;
    }
    (bytes, summary.expect("a last chunk with the summary"))
}

/// Member name (without the `<node>-<time>/` prefix) → content.
fn untar(bytes: &[u8]) -> BTreeMap<String, Vec<u8>> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    archive
        .entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let path = e.path().unwrap().to_string_lossy().into_owned();
            let (prefix, name) = path.split_once('/').unwrap();
            assert!(prefix.starts_with("n1-"), "{path}");
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            (name.to_owned(), data)
        })
        .collect()
}

fn manifest(members: &BTreeMap<String, Vec<u8>>) -> serde_json::Value {
    serde_json::from_slice(&members["manifest.json"]).unwrap()
}

fn part<'a>(m: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    m["parts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("part {name} in {m}"))
}

#[tokio::test]
async fn failing_parts_are_in_the_manifest_and_the_rest_arrive() {
    let rig = rig(&["--diagnostics-ip=/nonexistent/ip".into()]);
    let (bytes, summary) = fetch(&rig, pb::DiagnosticsRequest::default()).await;
    assert_eq!(summary.bundle_bytes, bytes.len() as u64);
    let members = untar(&bytes);
    let m = manifest(&members);
    assert_eq!(m["node"], "n1");
    // Every known part has a line, in gathering order.
    let names: Vec<&str> = m["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, nodekeeper_model::diagnostics::PARTS);

    let network = part(&m, "network");
    assert_eq!(network["status"], "failed", "{network}");
    assert!(
        network["reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/ip"),
        "{network}"
    );
    let journal = part(&m, "journal");
    assert_eq!(journal["status"], "skipped");
    assert!(
        journal["reason"]
            .as_str()
            .unwrap()
            .contains("journald is not reachable")
    );
    assert_eq!(part(&m, "gpu")["status"], "skipped");
    assert_eq!(part(&m, "oca")["status"], "skipped");

    // The parts that worked are there, and every file the manifest lists is a member.
    for name in [
        "report",
        "kernel-log",
        "sysctl",
        "sockets",
        "disk",
        "node-files",
    ] {
        let p = part(&m, name);
        assert_eq!(p["status"], "ok", "{p}");
        for f in p["files"].as_array().unwrap() {
            let file = f["name"].as_str().unwrap();
            assert_eq!(
                members[file].len() as u64,
                f["bytes"].as_u64().unwrap(),
                "{file}"
            );
        }
    }
    assert!(String::from_utf8_lossy(&members["sysctl.txt"]).contains("net.core.somaxconn = 4096"));
    let report: serde_json::Value = serde_json::from_slice(&members["report.json"]).unwrap();
    assert_eq!(report["nodeName"], "n1");
    // A configured file that is missing is noted, not fatal.
    assert!(
        part(&m, "node-files")["reason"]
            .as_str()
            .unwrap()
            .contains("/etc/missing.env")
    );
    assert_eq!(
        summary.parts_ok + summary.parts_failed + summary.parts_skipped,
        names.len() as u32
    );
    assert!(summary.parts_failed >= 1);
}

#[tokio::test]
async fn planted_secrets_are_redacted_from_every_member() {
    let rig = rig(&[]);
    let req = pb::DiagnosticsRequest {
        parts: vec!["kernel-log".into(), "node-files".into()],
        ..Default::default()
    };
    let (bytes, _) = fetch(&rig, req).await;
    let members = untar(&bytes);
    for (name, data) in &members {
        let text = String::from_utf8_lossy(data);
        assert!(!text.contains("kmsg-secret-1"), "{name}: {text}");
        assert!(!text.contains("env-secret-2"), "{name}: {text}");
    }
    let env = String::from_utf8_lossy(&members["files/etc/default/kubelet"]).into_owned();
    assert!(
        env.contains("KUBELET_EXTRA_ARGS=--v=2") && env.contains("BOOTSTRAP_TOKEN=[REDACTED]"),
        "{env}"
    );
    let m = manifest(&members);
    assert_eq!(part(&m, "kernel-log")["redactions"], 1);
    assert_eq!(part(&m, "node-files")["redactions"], 1);
    // Only the asked parts.
    assert_eq!(m["parts"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn the_bundle_cap_holds_and_the_manifest_says_what_was_cut() {
    let rig = rig(&[]);
    // 2 MiB of kernel log that compresses badly: well over the smallest bundle cap.
    let mut seed = 0x9e37_79b9_u32;
    let mut log = String::new();
    let mut i = 0;
    while log.len() < 2 << 20 {
        let mut word = String::new();
        for _ in 0..24 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            word.push(char::from(b'a' + (seed % 26) as u8));
        }
        log.push_str(&format!("6,{i},{i}000,-;{word}\n"));
        i += 1;
    }
    std::fs::write(rig.dir.path().join("kmsg"), log).unwrap();
    let cap = nodekeeper_model::diagnostics::MIN_BUNDLE_BYTES;
    let req = pb::DiagnosticsRequest {
        parts: vec!["kernel-log".into(), "sysctl".into(), "report".into()],
        max_bundle_bytes: cap,
        ..Default::default()
    };
    let (bytes, summary) = fetch(&rig, req).await;
    assert!(bytes.len() as u64 <= cap, "{} > {cap}", bytes.len());
    let m = manifest(&untar(&bytes));
    let kernel = part(&m, "kernel-log");
    assert_eq!(kernel["truncated"], true, "{kernel}");
    // Parts are gathered in PARTS order: the report first (whole), then the kernel log fills
    // the bundle, and sysctl finds it full.
    assert_eq!(part(&m, "report")["status"], "ok");
    let sysctl = part(&m, "sysctl");
    assert_eq!(sysctl["status"], "skipped", "{sysctl}");
    assert!(
        sysctl["reason"].as_str().unwrap().contains("size cap"),
        "{sysctl}"
    );
    assert!(summary.parts_truncated >= 1);
}

#[tokio::test]
async fn unknown_parts_and_bad_caps_are_refused_before_gathering() {
    let rig = rig(&[]);
    let err = rig
        .diagnostics
        .collect(pb::DiagnosticsRequest {
            parts: vec!["dmesg".into()],
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("\"dmesg\""), "{}", err.message());
    let err = rig
        .diagnostics
        .collect(pb::DiagnosticsRequest {
            max_bundle_bytes: 10,
            ..Default::default()
        })
        .unwrap_err();
    assert!(
        err.message().starts_with("max_bundle_bytes"),
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn a_part_past_its_time_cap_fails_and_the_bundle_goes_on() {
    // A fifo with no writer: opening it non-blocking succeeds and reads give EOF at once, so
    // use a journalctl that sleeps instead to exercise the time cap.
    let rig = rig(&[]);
    let script = rig.dir.path().join("journalctl");
    std::fs::write(&script, "#!/bin/sh\nsleep 5\n").unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let rig = Rig {
        diagnostics: {
            let mut config = rig.diagnostics.config.clone();
            config.diagnostics.diagnostics_journalctl = script;
            Arc::new(Diagnostics::new(
                Arc::clone(&rig.diagnostics.agent),
                &config,
            ))
        },
        dir: rig.dir,
    };
    let started = Instant::now();
    let (bytes, _) = fetch(
        &rig,
        pb::DiagnosticsRequest {
            parts: vec!["journal".into(), "sysctl".into()],
            part_timeout_ms: 300,
            ..Default::default()
        },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    let m = manifest(&untar(&bytes));
    let journal = part(&m, "journal");
    assert_eq!(journal["status"], "failed");
    assert!(
        journal["reason"].as_str().unwrap().contains("timed out"),
        "{journal}"
    );
    assert_eq!(part(&m, "sysctl")["status"], "ok");
}

/// A FIFO at a `--diagnostics-files` path (no writer ever comes) used to block the open on the
/// agent's one runtime thread, so not even the part's time cap could fire: the bundle, and every
/// other call, hung. It is refused now, and the next part is gathered.
#[test]
fn a_fifo_among_the_node_files_does_not_freeze_the_agent() {
    let rig = rig(&["--diagnostics-files=/etc/fifo,/etc/default/kubelet".into()]);
    let fifo = rig.dir.path().join("host/etc/fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // The agent's runtime (one thread) on a thread of its own, so that a hang fails the test
    // instead of hanging it.
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (bytes, _) = runtime.block_on(fetch(
            &rig,
            pb::DiagnosticsRequest {
                parts: vec!["node-files".into(), "sysctl".into()],
                part_timeout_ms: 300,
                ..Default::default()
            },
        ));
        let _ = tx.send(bytes);
    });
    let bytes = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the bundle within 5 s: a FIFO must not block the agent");
    let members = untar(&bytes);
    let m = manifest(&members);
    let files = part(&m, "node-files");
    assert_eq!(files["status"], "ok", "{files}");
    let reason = files["reason"].as_str().unwrap();
    assert!(
        reason.contains("/etc/fifo") && reason.contains("not a regular file"),
        "{files}"
    );
    assert!(members.contains_key("files/etc/default/kubelet"));
    assert!(!members.contains_key("files/etc/fifo"));
    assert_eq!(part(&m, "sysctl")["status"], "ok");
}

/// A file cut to its share of the part's size cap says so in the manifest (the file and the
/// part) and in the summary; a file that fits whole does not.
#[tokio::test]
async fn files_cut_to_their_share_of_the_part_cap_are_marked_truncated() {
    let rig = rig(&[]);
    std::fs::write(
        rig.dir.path().join("host/etc/big.conf"),
        "x=1\n".repeat(3 << 18),
    )
    .unwrap();
    // A journalctl that prints far more than a unit's third of the cap.
    let script = rig.dir.path().join("journalctl");
    std::fs::write(
        &script,
        "#!/bin/sh\nhead -c 2000000 /dev/zero | tr '\\0' a\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = rig.diagnostics.config.clone();
    config.diagnostics.diagnostics_journalctl = script;
    config.diagnostics.diagnostics_files =
        vec!["/etc/big.conf".into(), "/etc/default/kubelet".into()];
    let rig = Rig {
        diagnostics: Arc::new(Diagnostics::new(
            Arc::clone(&rig.diagnostics.agent),
            &config,
        )),
        dir: rig.dir,
    };
    let (bytes, summary) = fetch(
        &rig,
        pb::DiagnosticsRequest {
            parts: vec!["journal".into(), "node-files".into(), "sysctl".into()],
            max_part_bytes: 1 << 20,
            ..Default::default()
        },
    )
    .await;
    let members = untar(&bytes);
    let m = manifest(&members);
    let files = part(&m, "node-files");
    assert_eq!(files["truncated"], true, "{files}");
    let by_name = |p: &serde_json::Value, name: &str| {
        p["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {p}"))
            .clone()
    };
    let big = by_name(files, "files/etc/big.conf");
    assert_eq!(big["truncated"], true, "{files}");
    assert_eq!(big["bytes"], 1 << 19, "half the part cap each: {files}");
    assert_eq!(
        by_name(files, "files/etc/default/kubelet")["truncated"],
        false,
        "{files}"
    );
    let reason = files["reason"].as_str().unwrap();
    assert!(
        reason.contains("part's size cap") && reason.contains("files/etc/big.conf"),
        "{files}"
    );
    let journal = part(&m, "journal");
    assert_eq!(journal["truncated"], true, "{journal}");
    assert_eq!(by_name(journal, "journal/kubelet.log")["truncated"], true);
    // sysctl fits whole.
    assert_eq!(part(&m, "sysctl")["truncated"], false);
    assert_eq!(summary.parts_truncated, 2);
}

/// An `ip -j` dump cut by its share of the cap is not JSON: nodekeeper-network leaves it out
/// (null, not an empty list that reads as "nothing owned") and says so.
#[tokio::test]
async fn a_cut_ip_dump_is_not_reported_as_nothing_owned() {
    let rig = rig(&[]);
    let script = rig.dir.path().join("ip");
    std::fs::write(
        &script,
        "#!/bin/sh\ncase \"$*\" in\n*rule*) printf '['; i=0; while [ $i -lt 300 ]; do \
         printf '{\"priority\":20001},'; i=$((i+1)); done; printf '{}]' ;;\n*) echo '[]' ;;\nesac\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut config = rig.diagnostics.config.clone();
    config.diagnostics.diagnostics_ip = script;
    let rig = Rig {
        diagnostics: Arc::new(Diagnostics::new(
            Arc::clone(&rig.diagnostics.agent),
            &config,
        )),
        dir: rig.dir,
    };
    let (bytes, summary) = fetch(
        &rig,
        pb::DiagnosticsRequest {
            parts: vec!["nodekeeper-network".into()],
            max_part_bytes: 3000,
            ..Default::default()
        },
    )
    .await;
    let members = untar(&bytes);
    let body: serde_json::Value =
        serde_json::from_slice(&members["nodekeeper-network.json"]).unwrap();
    assert!(body["ownedRules"].is_null(), "{body}");
    assert_eq!(body["ownedRoutes"], serde_json::json!([]), "{body}");
    let m = manifest(&members);
    let p = part(&m, "nodekeeper-network");
    assert_eq!(p["truncated"], true, "{p}");
    assert!(
        p["reason"]
            .as_str()
            .unwrap()
            .contains("rules: the ip output was cut"),
        "{p}"
    );
    assert_eq!(summary.parts_truncated, 1);
}

/// `--diagnostics-files` are host paths: a symbolic link on the host resolves as the host would
/// (within `--host-root`), never to the agent container's files or out of the host root.
#[tokio::test]
async fn node_files_follow_links_only_within_the_host_root() {
    let rig = rig(&[]);
    let dir = rig.dir.path();
    let etc = dir.join("host/etc");
    std::fs::write(etc.join("real.env"), "REAL=host\n").unwrap();
    // Outside the host root (the agent container's own files, say).
    std::fs::write(dir.join("outside.env"), "OUTSIDE=agent-container\n").unwrap();
    let link = |target: &Path, name: &str| std::os::unix::fs::symlink(target, etc.join(name));
    link(Path::new("/etc/real.env"), "absolute.env").unwrap();
    link(&dir.join("outside.env"), "escape.env").unwrap();
    link(Path::new("../../outside.env"), "up.env").unwrap();
    std::os::unix::fs::symlink("/etc", dir.join("host/conf")).unwrap();
    let mut config = rig.diagnostics.config.clone();
    config.diagnostics.diagnostics_files = ["/etc/absolute.env", "/etc/escape.env", "/etc/up.env"]
        .iter()
        .chain(&["/conf/real.env", "/../outside.env"])
        .map(PathBuf::from)
        .collect();
    let rig = Rig {
        diagnostics: Arc::new(Diagnostics::new(
            Arc::clone(&rig.diagnostics.agent),
            &config,
        )),
        dir: rig.dir,
    };
    let (bytes, _) = fetch(
        &rig,
        pb::DiagnosticsRequest {
            parts: vec!["node-files".into()],
            ..Default::default()
        },
    )
    .await;
    let members = untar(&bytes);
    for (name, data) in &members {
        let text = String::from_utf8_lossy(data);
        assert!(!text.contains("OUTSIDE=agent-container"), "{name}: {text}");
    }
    assert_eq!(members["files/etc/absolute.env"], b"REAL=host\n");
    assert_eq!(members["files/conf/real.env"], b"REAL=host\n");
    let m = manifest(&members);
    let reason = part(&m, "node-files")["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    for missing in ["/etc/escape.env", "/etc/up.env", "/../outside.env"] {
        assert!(reason.contains(missing), "{missing}: {reason}");
    }
}
