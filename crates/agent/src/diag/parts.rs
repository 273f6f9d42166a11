//! The gatherers, one per part name in `nodekeeper_model::diagnostics::PARTS`. Each returns the
//! files it produced (every one already bounded by the part's size cap), or says why it was
//! skipped or failed; the caller applies the time cap, redaction and the bundle budget.

use std::io::Read as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;

use super::Diagnostics;
use crate::config::under_root;
use crate::report::Report;

/// What a gatherer produced.
pub enum Gathered {
    /// Files (name within the bundle, content) and notes for the manifest's `reason`.
    Files(Vec<(String, Vec<u8>)>, Vec<String>),
    /// Nothing to gather on this node, and why (e.g. no GPU).
    Skipped(String),
}

/// A part's failure, said in one line.
pub type Failure = String;

/// At most this many sysctl files are read for the `sysctl` part.
const MAX_SYSCTL_ENTRIES: usize = 20_000;
/// Lines kept from each unit's journal.
const JOURNAL_LINES: &str = "2000";
/// Units whose journal is included when journald is reachable.
const JOURNAL_UNITS: &[&str] = &["kubelet", "containerd", "crio"];

impl Diagnostics {
    pub(super) async fn gather(&self, part: &str, cap: usize) -> Result<Gathered, Failure> {
        match part {
            "report" => self.report_part(cap).await,
            "kernel-log" => kernel_log(self.config.diagnostics.diagnostics_kmsg.clone(), cap).await,
            "journal" => self.journal(cap).await,
            "network" => self.network(cap).await,
            "nodekeeper-network" => self.nodekeeper_network(cap).await,
            "sysctl" => self.sysctl(cap).await,
            "sockets" => sockets(&self.config.proc_root, cap),
            "disk" => self.disk(),
            "oca" => self.oca().await,
            "gpu" => self.gpu().await,
            "node-files" => self.node_files(cap),
            other => Err(format!("no gatherer for part {other:?}")),
        }
    }

    async fn report(&self) -> std::sync::Arc<Report> {
        // `since_revision` 0 asks for the full report; a revision of 0 itself answers "unchanged",
        // so ask once more with another revision.
        match self.agent.report(0).await {
            (_, Some(r)) => r,
            (_, None) => self.agent.report(1).await.1.unwrap_or_default(),
        }
    }

    async fn report_part(&self, cap: usize) -> Result<Gathered, Failure> {
        let report = self.report().await;
        one_json("report.json", &report_json(&report), cap)
    }

    async fn journal(&self, cap: usize) -> Result<Gathered, Failure> {
        let program = &self.config.diagnostics.diagnostics_journalctl;
        let Some(path) = resolve(program) else {
            return Ok(Gathered::Skipped(format!(
                "journalctl ({}) not found: journald is not reachable from the agent; mount the \
                 host's journal and journalctl and set --diagnostics-journalctl to include it",
                program.display()
            )));
        };
        let per_unit = cap / JOURNAL_UNITS.len();
        let mut files = Vec::new();
        let mut notes = Vec::new();
        for unit in JOURNAL_UNITS {
            let args = [
                "--no-pager",
                "--quiet",
                "--output=short-iso",
                "--lines",
                JOURNAL_LINES,
                "--unit",
                unit,
            ];
            match run(&path, &args, per_unit).await {
                Ok(out) => files.push((format!("journal/{unit}.log"), out)),
                Err(e) => notes.push(format!("{unit}: {e}")),
            }
        }
        if files.is_empty() {
            return Err(notes.join("; "));
        }
        Ok(Gathered::Files(files, notes))
    }

    async fn ip_dumps(
        &self,
        dumps: &[(&str, &[&str])],
        cap: usize,
    ) -> Result<(Vec<(String, Vec<u8>)>, Vec<String>), Failure> {
        let ip = &self.config.diagnostics.diagnostics_ip;
        let Some(path) = resolve(ip) else {
            return Err(format!(
                "the ip command ({}) is not found; install iproute2 in the agent image or set \
                 --diagnostics-ip",
                ip.display()
            ));
        };
        let per = cap / dumps.len().max(1);
        let mut files = Vec::new();
        let mut notes = Vec::new();
        for (name, args) in dumps {
            match run(&path, args, per).await {
                Ok(out) => files.push(((*name).to_owned(), out)),
                Err(e) => notes.push(format!("{name}: {e}")),
            }
        }
        if files.is_empty() {
            return Err(notes.join("; "));
        }
        Ok((files, notes))
    }

    async fn network(&self, cap: usize) -> Result<Gathered, Failure> {
        let (files, notes) = self
            .ip_dumps(
                &[
                    ("network/links.json", &["-d", "-j", "link", "show"]),
                    ("network/addresses.json", &["-d", "-j", "address", "show"]),
                    (
                        "network/routes4.json",
                        &["-d", "-j", "-4", "route", "show", "table", "all"],
                    ),
                    (
                        "network/routes6.json",
                        &["-d", "-j", "-6", "route", "show", "table", "all"],
                    ),
                    ("network/rules4.json", &["-d", "-j", "-4", "rule", "show"]),
                    ("network/rules6.json", &["-d", "-j", "-6", "rule", "show"]),
                    ("network/neighbours.json", &["-d", "-j", "neigh", "show"]),
                ],
                cap,
            )
            .await?;
        Ok(Gathered::Files(files, notes))
    }

    /// What nodekeeper owns (routes with protocol 176, rules in 20000–20999, links whose alias
    /// starts `nodekeeper:`) and the network manager's last outcome from the report.
    async fn nodekeeper_network(&self, cap: usize) -> Result<Gathered, Failure> {
        let report = self.report().await;
        let n = &report.network;
        let (dumps, mut notes) = self
            .ip_dumps(
                &[
                    (
                        "routes",
                        &["-d", "-j", "route", "show", "table", "all", "proto", "176"],
                    ),
                    ("rules", &["-d", "-j", "rule", "show"]),
                    ("links", &["-d", "-j", "link", "show"]),
                ],
                cap,
            )
            .await
            .unwrap_or_else(|e| (Vec::new(), vec![e]));
        let parsed = |name: &str| -> Vec<Value> {
            dumps
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, d)| serde_json::from_slice::<Vec<Value>>(d).ok())
                .unwrap_or_default()
        };
        let rules: Vec<Value> = parsed("rules")
            .into_iter()
            .filter(|r| {
                r["priority"]
                    .as_u64()
                    .is_some_and(|p| (20_000..=20_999).contains(&p))
            })
            .collect();
        let links: Vec<Value> = parsed("links")
            .into_iter()
            .filter(|l| {
                l["ifalias"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("nodekeeper:"))
            })
            .collect();
        notes.push(
            "plans: the agent keeps the generation and outcome of the last apply and the current \
             drift (below), not earlier plans"
                .into(),
        );
        let body = json!({
            "lastApply": {
                "appliedGeneration": n.applied_generation,
                "drifted": n.drifted,
                "drift": n.drift,
                "reconvergedAtUnixMs": n.reconverged_at_unix_ms,
                "lastError": n.last_error,
            },
            "ownedRoutes": parsed("routes"),
            "ownedRules": rules,
            "ownedLinks": links,
        });
        let Gathered::Files(files, _) = one_json("nodekeeper-network.json", &body, cap)? else {
            unreachable!("one_json gives files")
        };
        Ok(Gathered::Files(files, notes))
    }

    async fn sysctl(&self, cap: usize) -> Result<Gathered, Failure> {
        let report = self.report().await;
        let root = self.config.sysctl_root();
        let rule_keys: Vec<String> = report.tunables.iter().map(|t| t.key.clone()).collect();
        tokio::task::spawn_blocking(move || sysctl_dump(&root, &rule_keys, cap))
            .await
            .map_err(|e| format!("sysctl reader stopped: {e}"))?
    }

    fn disk(&self) -> Result<Gathered, Failure> {
        let mut rows = Vec::new();
        for mount in &self.config.mounts {
            let path = under_root(&self.config.host_root, mount);
            rows.push(match nix::sys::statvfs::statvfs(&path) {
                Ok(s) => {
                    let frag = s.fragment_size();
                    json!({
                        "mount": mount,
                        "bytesTotal": s.blocks() * frag,
                        "bytesFree": s.blocks_available() * frag,
                        "inodesTotal": s.files(),
                        "inodesFree": s.files_available(),
                    })
                }
                Err(e) => json!({"mount": mount, "error": e.to_string()}),
            });
        }
        one_json("disk.json", &Value::Array(rows), usize::MAX)
    }

    async fn oca(&self) -> Result<Gathered, Failure> {
        if self.config.oca_plugin_dir.is_none() {
            return Ok(Gathered::Skipped(
                "--oca-plugin-dir is not set: the agent reads no Oracle Cloud Agent plugin state"
                    .into(),
            ));
        }
        let report = self.report().await;
        let plugins: Vec<Value> = report
            .plugins
            .iter()
            .map(|p| json!({"name": p.name, "state": p.state, "message": p.message, "verdict": format!("{:?}", p.verdict)}))
            .collect();
        let errors: Vec<&(String, String)> = report
            .collector_errors
            .iter()
            .filter(|(c, _)| c.starts_with("oca"))
            .collect();
        one_json(
            "oca-plugins.json",
            &json!({"plugins": plugins, "errors": errors}),
            usize::MAX,
        )
    }

    async fn gpu(&self) -> Result<Gathered, Failure> {
        let report = self.report().await;
        if !report.gpu_present {
            return if report.gpu_error.is_empty() {
                Ok(Gathered::Skipped("no GPU on this node".into()))
            } else {
                Ok(Gathered::Skipped(format!(
                    "no GPU reading: {}",
                    report.gpu_error
                )))
            };
        }
        let gpus: Vec<Value> = report
            .gpus
            .iter()
            .map(|g| {
                json!({
                    "index": g.gpu.index, "uuid": g.gpu.uuid, "model": g.gpu.model,
                    "memoryTotalMib": g.gpu.memory_total_mib, "memoryUsedMib": g.gpu.memory_used_mib,
                    "temperatureC": g.gpu.temperature_c, "utilizationPercent": g.gpu.utilization_percent,
                    "eccUncorrected": g.gpu.ecc_uncorrected,
                    "verdict": format!("{:?}", g.verdict), "message": g.message,
                })
            })
            .collect();
        one_json(
            "gpu.json",
            &json!({"source": report.gpu_source, "error": report.gpu_error, "gpus": gpus}),
            usize::MAX,
        )
    }

    fn node_files(&self, cap: usize) -> Result<Gathered, Failure> {
        let wanted = &self.config.diagnostics.diagnostics_files;
        if wanted.is_empty() {
            return Ok(Gathered::Skipped(
                "no --diagnostics-files configured".into(),
            ));
        }
        let per = cap / wanted.len();
        let mut files = Vec::new();
        let mut notes = Vec::new();
        for path in wanted {
            let full = under_root(&self.config.host_root, path);
            match read_head(&full, per) {
                Ok(data) => files.push((format!("files{}", path.display()), data)),
                Err(e) => notes.push(format!("{}: {e}", path.display())),
            }
        }
        if files.is_empty() {
            return Ok(Gathered::Skipped(notes.join("; ")));
        }
        Ok(Gathered::Files(files, notes))
    }
}

fn one_json(name: &str, value: &Value, cap: usize) -> Result<Gathered, Failure> {
    let mut data = serde_json::to_vec_pretty(value).map_err(|e| e.to_string())?;
    data.truncate(cap);
    Ok(Gathered::Files(vec![(name.to_owned(), data)], Vec::new()))
}

/// The report as JSON, with the same field names as the controller's HTTP API.
fn report_json(r: &Report) -> Value {
    json!({
        "nodeName": r.node_name,
        "agentVersion": r.agent_version,
        "collectedAtUnixMs": r.collected_at_unix_ms,
        "rulesRevision": r.rules_revision,
        "system": {
            "kernelRelease": r.system.kernel_release,
            "bootId": r.system.boot_id,
            "bootedAtUnix": r.system.booted_at_unix,
            "cpus": r.system.cpus,
            "memoryTotalBytes": r.system.memory_total_bytes,
        },
        "indicators": r.indicators.iter().map(|i| json!({
            "name": i.name, "value": i.value, "unit": i.unit.as_str(),
            "verdict": format!("{:?}", i.verdict), "message": i.message,
        })).collect::<Vec<_>>(),
        "tunables": r.tunables.iter().map(|t| json!({
            "rule": t.rule, "key": t.key, "current": t.current, "expected": t.expected,
            "verdict": format!("{:?}", t.verdict), "previous": t.previous,
            "repairedAtUnixMs": t.repaired_at_unix_ms, "conflict": t.conflict, "error": t.error,
        })).collect::<Vec<_>>(),
        "interfaces": r.interfaces.iter().map(|i| json!({
            "name": i.name, "index": i.index, "mac": i.mac, "mtu": i.mtu, "up": i.up,
            "operState": i.oper_state, "kind": i.kind, "addresses": i.addresses,
        })).collect::<Vec<_>>(),
        "gpuPresent": r.gpu_present,
        "gpuError": r.gpu_error,
        "plugins": r.plugins.iter().map(|p| json!({"name": p.name, "state": p.state})).collect::<Vec<_>>(),
        "collectorErrors": r.collector_errors,
    })
}

/// Resolves a program: a path with a `/` as is, a bare name on `PATH`.
fn resolve(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// Runs a program and returns its standard output, cut at `cap` bytes (the program is killed
/// then, and when the caller's time cap drops this future).
async fn run(program: &Path, args: &[&str], cap: usize) -> Result<Vec<u8>, Failure> {
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("start {}: {e}", program.display()))?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let mut out = Vec::new();
    (&mut stdout)
        .take(cap as u64)
        .read_to_end(&mut out)
        .await
        .map_err(|e| format!("read output of {}: {e}", program.display()))?;
    if out.len() >= cap {
        // Enough: the rest is not read, so the program is stopped rather than left blocked.
        let _ = child.kill().await;
        return Ok(out);
    }
    let mut err = Vec::new();
    let _ = (&mut stderr).take(2048).read_to_end(&mut err).await;
    let status = child
        .wait()
        .await
        .map_err(|e| format!("wait for {}: {e}", program.display()))?;
    if !status.success() {
        return Err(format!(
            "{} exited with {status}: {}",
            program.display(),
            String::from_utf8_lossy(&err).trim()
        ));
    }
    Ok(out)
}

fn read_head(path: &Path, cap: usize) -> std::io::Result<Vec<u8>> {
    let mut data = Vec::new();
    std::fs::File::open(path)?
        .take(cap as u64)
        .read_to_end(&mut data)?;
    Ok(data)
}

/// The tail of the kernel ring buffer: `/dev/kmsg` is opened non-blocking and read record by
/// record until it has no more (EAGAIN), so the read never waits for new messages; a plain file
/// (tests, or a saved log) is read to its end. Only the last `cap` bytes are kept.
async fn kernel_log(path: PathBuf, cap: usize) -> Result<Gathered, Failure> {
    tokio::task::spawn_blocking(move || {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| format!("open {}: {e}", path.display()))?;
        let mut tail = std::collections::VecDeque::<String>::new();
        let mut kept = 0usize;
        let mut truncated = false;
        let mut buf = vec![0u8; 16 * 1024];
        let mut pending = String::new();
        loop {
            match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    pending.push_str(&String::from_utf8_lossy(&buf[..n]));
                    while let Some(end) = pending.find('\n') {
                        let line: String = pending.drain(..=end).collect();
                        if line.starts_with(' ') {
                            // A kmsg dictionary continuation (KEY=value): not part of the text.
                            continue;
                        }
                        let line = kmsg_line(&line);
                        kept += line.len();
                        tail.push_back(line);
                        while kept > cap {
                            let dropped = tail.pop_front().expect("kept > 0");
                            kept -= dropped.len();
                            truncated = true;
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // EPIPE: the record we were at was overwritten; the next read goes on.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("read {}: {e}", path.display())),
            }
        }
        let mut notes = Vec::new();
        if truncated {
            notes.push(format!(
                "older messages dropped to keep the last {cap} bytes"
            ));
        }
        let text: String = tail.into_iter().collect();
        Ok(Gathered::Files(
            vec![("kernel-log.txt".into(), text.into_bytes())],
            notes,
        ))
    })
    .await
    .map_err(|e| format!("kernel log reader stopped: {e}"))?
}

/// `6,1234,5678901,-;text` (a `/dev/kmsg` record) becomes `[    5.678901] text`; other lines stay.
fn kmsg_line(line: &str) -> String {
    let Some((meta, text)) = line.split_once(';') else {
        return line.to_owned();
    };
    let mut fields = meta.split(',');
    let (Some(prio), Some(_seq), Some(usec)) = (fields.next(), fields.next(), fields.next()) else {
        return line.to_owned();
    };
    match (prio.parse::<u32>(), usec.parse::<u64>()) {
        (Ok(_), Ok(us)) => format!("[{:>5}.{:06}] {text}", us / 1_000_000, us % 1_000_000),
        _ => line.to_owned(),
    }
}

/// `key = value` for every world-readable file under `<root>/net` and for each rule key, bounded.
fn sysctl_dump(root: &Path, rule_keys: &[String], cap: usize) -> Result<Gathered, Failure> {
    let mut lines = Vec::new();
    let mut notes = Vec::new();
    let mut stack = vec![root.join("net")];
    let mut files = Vec::new();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if files.len() >= MAX_SYSCTL_ENTRIES {
                break;
            }
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                Ok(t) if t.is_file() => files.push(entry.path()),
                _ => {}
            }
        }
    }
    if files.len() >= MAX_SYSCTL_ENTRIES {
        notes.push(format!("net.* cut at {MAX_SYSCTL_ENTRIES} keys"));
    }
    for key in rule_keys {
        files.push(root.join(key.replace('.', "/")));
    }
    files.sort();
    files.dedup();
    let mut size = 0;
    let mut unreadable = 0;
    let mut private = 0;
    for path in files {
        let Ok(rel) = path.strip_prefix(root) else {
            continue;
        };
        let key = rel.to_string_lossy().replace('/', ".");
        // The agent reads as root, but the bundle leaves the node: only keys every user on the
        // node may read are copied. The kernel marks its secrets by mode rather than by name
        // (`net.ipv4.tcp_fastopen_key`, the TCP Fast Open cookie key, is 0600), so the mode is
        // the test; a list of names would miss the next such key.
        match std::fs::metadata(&path).map(|m| m.permissions().mode()) {
            // Write-only keys (e.g. route flush) are not secrets, just not readable.
            Ok(mode) if mode & 0o444 == 0 => {
                unreadable += 1;
                continue;
            }
            Ok(mode) if mode & 0o004 == 0 => {
                private += 1;
                continue;
            }
            _ => {}
        }
        // Per-namespace keys may still refuse reads.
        match read_head(&path, 4096) {
            Ok(v) => {
                let line = format!("{key} = {}\n", String::from_utf8_lossy(&v).trim_end());
                size += line.len();
                if size > cap {
                    notes.push(format!("cut at {cap} bytes"));
                    break;
                }
                lines.push(line);
            }
            Err(_) => unreadable += 1,
        }
    }
    if lines.is_empty() {
        return Err(format!("no sysctl readable under {}", root.display()));
    }
    if unreadable > 0 {
        notes.push(format!(
            "{unreadable} keys not readable (write-only or refused)"
        ));
    }
    if private > 0 {
        notes.push(format!(
            "{private} keys readable only by root left out (they may hold secrets)"
        ));
    }
    Ok(Gathered::Files(
        vec![("sysctl.txt".into(), lines.concat().into_bytes())],
        notes,
    ))
}

/// Socket and conntrack summaries from procfs.
fn sockets(proc_root: &Path, cap: usize) -> Result<Gathered, Failure> {
    let mut text = String::new();
    let mut missing = Vec::new();
    for file in [
        "net/sockstat",
        "net/sockstat6",
        "net/snmp",
        "sys/net/netfilter/nf_conntrack_count",
        "sys/net/netfilter/nf_conntrack_max",
    ] {
        match read_head(&proc_root.join(file), cap / 5) {
            Ok(v) => {
                text.push_str(&format!(
                    "== {file} ==\n{}\n",
                    String::from_utf8_lossy(&v).trim_end()
                ));
            }
            Err(e) => missing.push(format!("{file}: {e}")),
        }
    }
    if text.is_empty() {
        return Err(format!(
            "nothing readable under {}: {}",
            proc_root.display(),
            missing.join("; ")
        ));
    }
    Ok(Gathered::Files(
        vec![("sockets.txt".into(), text.into_bytes())],
        missing,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kmsg_records_become_readable_lines() {
        assert_eq!(
            kmsg_line("6,339,5140900,-;NET: Registered protocol family 10\n"),
            "[    5.140900] NET: Registered protocol family 10\n"
        );
        assert_eq!(kmsg_line("plain line\n"), "plain line\n");
    }

    #[tokio::test]
    async fn kernel_log_keeps_the_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        let text: String = (0..100)
            .map(|i| format!("6,{i},{i}000,-;line {i}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
        let Gathered::Files(files, notes) = kernel_log(path, 200).await.unwrap() else {
            panic!("files expected")
        };
        let out = String::from_utf8(files[0].1.clone()).unwrap();
        assert!(out.len() <= 200 && out.ends_with("line 99\n"), "{out}");
        assert!(!out.contains("line 1\n"));
        assert!(notes[0].contains("older messages dropped"), "{notes:?}");
    }

    #[test]
    fn sysctl_dump_reads_net_and_rule_keys() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for (key, value) in [
            ("net/core/somaxconn", "4096"),
            ("vm/swappiness", "10"),
            ("kernel/other", "1"),
        ] {
            std::fs::create_dir_all(root.join(key).parent().unwrap()).unwrap();
            std::fs::write(root.join(key), format!("{value}\n")).unwrap();
        }
        // Secrets the kernel keeps root-only, under net and as a rule key: never copied.
        for key in ["net/ipv4/tcp_fastopen_key", "kernel/cad_pid"] {
            std::fs::create_dir_all(root.join(key).parent().unwrap()).unwrap();
            std::fs::write(root.join(key), "0a1b2c3d-secret\n").unwrap();
            std::fs::set_permissions(root.join(key), std::fs::Permissions::from_mode(0o600))
                .unwrap();
        }
        let Gathered::Files(files, notes) = sysctl_dump(
            root,
            &["vm.swappiness".into(), "kernel.cad_pid".into()],
            1 << 20,
        )
        .unwrap() else {
            panic!()
        };
        let text = String::from_utf8(files[0].1.clone()).unwrap();
        assert_eq!(text, "net.core.somaxconn = 4096\nvm.swappiness = 10\n");
        assert!(
            notes.contains(&"2 keys readable only by root left out (they may hold secrets)".into()),
            "{notes:?}"
        );
    }
}
