//! The gatherers, one per part name in `nodekeeper_model::diagnostics::PARTS`. Each returns the
//! files it produced (every one already bounded by the part's size cap, and marked when that cut
//! it short), or says why it was skipped or failed; the caller applies the time cap, redaction
//! and the bundle budget.

use std::ffi::OsStr;
use std::io::Read as _;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt as _;

use super::Diagnostics;
use crate::collect;
use crate::config::under_root;
use crate::report::Report;

/// One file a gatherer produced.
pub struct PartFile {
    /// Name within the bundle.
    pub name: String,
    pub data: Vec<u8>,
    /// Cut short by the part's size cap (or the share of it this file was given): the manifest
    /// says so, so that a reader does not take a cut file for the whole.
    pub truncated: bool,
}

impl PartFile {
    pub fn new(name: impl Into<String>, data: Vec<u8>, truncated: bool) -> Self {
        Self {
            name: name.into(),
            data,
            truncated,
        }
    }
}

/// What a gatherer produced.
pub enum Gathered {
    /// Files and notes for the manifest's `reason`.
    Files(Vec<PartFile>, Vec<String>),
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
            "disk" => self.disk().await,
            "oca" => self.oca().await,
            "gpu" => self.gpu().await,
            "node-files" => self.node_files(cap).await,
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
                Ok((out, cut)) => {
                    files.push(PartFile::new(format!("journal/{unit}.log"), out, cut))
                }
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
    ) -> Result<(Vec<PartFile>, Vec<String>), Failure> {
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
                Ok((out, cut)) => files.push(PartFile::new(*name, out, cut)),
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
        // A dump cut by the size cap is not JSON: it is left out (null, not an empty list that
        // would read as "nothing owned"), and the file and the notes say so.
        let mut cut = false;
        let mut parsed = |name: &str| -> Option<Vec<Value>> {
            let dump = dumps.iter().find(|f| f.name == name)?;
            if dump.truncated {
                cut = true;
                notes.push(format!(
                    "{name}: the ip output was cut at {} bytes (its share of the part's size \
                     cap), so owned {name} are left out; raise maxPartBytes to include them",
                    dump.data.len()
                ));
                return None;
            }
            serde_json::from_slice::<Vec<Value>>(&dump.data).ok()
        };
        let routes = parsed("routes");
        let rules: Option<Vec<Value>> = parsed("rules").map(|rules| {
            rules
                .into_iter()
                .filter(|r| {
                    r["priority"]
                        .as_u64()
                        .is_some_and(|p| (20_000..=20_999).contains(&p))
                })
                .collect()
        });
        let links: Option<Vec<Value>> = parsed("links").map(|links| {
            links
                .into_iter()
                .filter(|l| {
                    l["ifalias"]
                        .as_str()
                        .is_some_and(|a| a.starts_with("nodekeeper:"))
                })
                .collect()
        });
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
            "ownedRoutes": routes,
            "ownedRules": rules,
            "ownedLinks": links,
        });
        let Gathered::Files(mut files, _) = one_json("nodekeeper-network.json", &body, cap)? else {
            unreachable!("one_json gives files")
        };
        for file in &mut files {
            file.truncated |= cut;
        }
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

    /// One row per `--mounts` entry. statvfs runs off the runtime thread with the report's
    /// bound (a hung NFS or FUSE mount blocks it in the kernel), all mounts at once, so one
    /// blocked mount costs the part a few seconds, not the agent its only runtime thread.
    async fn disk(&self) -> Result<Gathered, Failure> {
        let stats = futures::future::join_all(self.config.mounts.iter().map(|mount| {
            let path = under_root(&self.config.host_root, mount);
            async move { collect::disk::statvfs_bounded(&path).await }
        }))
        .await;
        let mut rows = Vec::new();
        for (mount, stat) in self.config.mounts.iter().zip(stats) {
            rows.push(match stat {
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

    /// Host files are opened and read on a blocking thread: a file on a hung mount blocks
    /// there (and the part's time cap still fires), never on the agent's one runtime thread.
    async fn node_files(&self, cap: usize) -> Result<Gathered, Failure> {
        let wanted = self.config.diagnostics.diagnostics_files.clone();
        if wanted.is_empty() {
            return Ok(Gathered::Skipped(
                "no --diagnostics-files configured".into(),
            ));
        }
        let root = self.config.host_root.clone();
        tokio::task::spawn_blocking(move || node_files(&root, &wanted, cap))
            .await
            .map_err(|e| format!("host file reader stopped: {e}"))?
    }
}

fn node_files(root: &Path, wanted: &[PathBuf], cap: usize) -> Result<Gathered, Failure> {
    let per = cap / wanted.len().max(1);
    let mut files = Vec::new();
    let mut notes = Vec::new();
    for path in wanted {
        // The path names the member too (`files/<path>`), and a member name with `..` would
        // fail the whole bundle.
        if path.components().any(|c| c == Component::ParentDir) {
            notes.push(format!(
                "{}: has a `..` component; name the file by a path without it",
                path.display()
            ));
            continue;
        }
        match read_host_file(root, path, per) {
            Ok((data, cut)) => {
                files.push(PartFile::new(format!("files{}", path.display()), data, cut))
            }
            Err(e) => notes.push(format!("{}: {e}", path.display())),
        }
    }
    if files.is_empty() {
        return Ok(Gathered::Skipped(notes.join("; ")));
    }
    Ok(Gathered::Files(files, notes))
}

/// The first `cap` bytes of a regular host file, and whether there was more. The path resolves
/// (symbolic links within `root`, [`open_in_root`]) to an `O_PATH` descriptor, which opens
/// nothing; only once `fstat` says it is a regular file is that file opened for reading
/// ([`reopen`]). A FIFO, socket or device at a configured path is never opened, not even
/// non-blocking: a device's open can act (rewind a tape, arm a watchdog, hang up a line).
fn read_host_file(root: &Path, host_path: &Path, cap: usize) -> std::io::Result<(Vec<u8>, bool)> {
    let path = open_in_root(root, host_path)?;
    let stat = nix::sys::stat::fstat(&path)?;
    if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(std::io::Error::other(
            "not a regular file (a FIFO, socket, device or directory); list only regular files \
             in --diagnostics-files",
        ));
    }
    read_capped(reopen(&path)?, cap)
}

/// Opens for reading the regular file that the `O_PATH` descriptor `path` refers to:
/// `/proc/self/fd/<n>` is a link to that very inode, so nothing is resolved again and nothing can
/// have been swapped in since `fstat`. `O_NONBLOCK` and `O_NOCTTY` stay as a second guard (for a
/// regular file they change nothing).
fn reopen(path: &OwnedFd) -> std::io::Result<std::fs::File> {
    let link = format!("/proc/self/fd/{}", path.as_raw_fd());
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
    match nix::fcntl::open(link.as_str(), flags, Mode::empty()) {
        Ok(fd) => Ok(fd.into()),
        Err(e) => Err(std::io::Error::other(format!(
            "open the file for reading through {link} (the agent needs /proc mounted): {e}"
        ))),
    }
}

fn one_json(name: &str, value: &Value, cap: usize) -> Result<Gathered, Failure> {
    let mut data = serde_json::to_vec_pretty(value).map_err(|e| e.to_string())?;
    let cut = data.len() > cap;
    data.truncate(cap);
    Ok(Gathered::Files(
        vec![PartFile::new(name, data, cut)],
        Vec::new(),
    ))
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
/// then, and when the caller's time cap drops this future), and whether it was cut.
async fn run(program: &Path, args: &[&str], cap: usize) -> Result<(Vec<u8>, bool), Failure> {
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
    // One byte past the cap tells output that fills the cap exactly from output that is cut.
    (&mut stdout)
        .take((cap as u64).saturating_add(1))
        .read_to_end(&mut out)
        .await
        .map_err(|e| format!("read output of {}: {e}", program.display()))?;
    if out.len() > cap {
        // Enough: the rest is not read, so the program is stopped rather than left blocked.
        let _ = child.kill().await;
        out.truncate(cap);
        return Ok((out, true));
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
    Ok((out, false))
}

/// Resolves `host_path` as the host does, with `root` (`--host-root`) as `/`, to an `O_PATH`
/// descriptor (which opens nothing, see [`read_host_file`]): symbolic links are followed, but an
/// absolute one, or `..`, never leaves `root`. A plain open of `root` + path would follow
/// `/etc/kubelet.env -> /run/kubelet.env` to the agent container's own `/run`, and `../..` out
/// of the host root, and put what it found in the bundle.
fn open_in_root(root: &Path, host_path: &Path) -> std::io::Result<OwnedFd> {
    let flags = OFlag::O_PATH | OFlag::O_CLOEXEC;
    let relative = host_path.strip_prefix("/").unwrap_or(host_path);
    let dir = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| std::io::Error::other(format!("open --host-root {}: {e}", root.display())))?;
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    match nix::fcntl::openat2(&dir, relative, how) {
        Ok(fd) => Ok(fd),
        // Linux before 5.6, or a seccomp profile that predates openat2.
        Err(Errno::ENOSYS | Errno::EPERM) => open_without_links(&dir, relative),
        Err(e) => Err(e.into()),
    }
}

/// [`open_in_root`] without openat2(2): walks `relative` a component at a time from `dir` with
/// `O_PATH` descriptors, as openat2 does, refusing every symbolic link (and `..`) on the way, so
/// nothing outside `dir` is reached (and nothing at all opened).
fn open_without_links(dir: &OwnedFd, relative: &Path) -> std::io::Result<OwnedFd> {
    let mut names = Vec::new();
    for component in relative.components() {
        match component {
            Component::Normal(name) => names.push(name),
            Component::CurDir => {}
            _ => {
                return Err(std::io::Error::other(
                    "`..` is not followed on a kernel without openat2(2); name the file by a \
                     path without it",
                ));
            }
        }
    }
    let Some((last, parents)) = names.split_last() else {
        return Err(std::io::Error::other("names no file under --host-root"));
    };
    let link = |name: &OsStr| {
        std::io::Error::other(format!(
            "{} is a symbolic link, which this kernel (no openat2(2), before Linux 5.6) \
             cannot follow safely within --host-root; name the file it points to instead",
            name.to_string_lossy()
        ))
    };
    // ENOTDIR (a link where a directory is wanted) or ELOOP from a component that is a link is
    // said as such.
    let refused = |at: &OwnedFd, name: &OsStr, error: Errno| {
        let is_link = matches!(error, Errno::ENOTDIR | Errno::ELOOP)
            && nix::sys::stat::fstatat(at, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                .is_ok_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFLNK);
        if is_link { link(name) } else { error.into() }
    };
    let mut current: Option<OwnedFd> = None;
    for name in parents {
        let at = current.as_ref().unwrap_or(dir);
        let next = nix::fcntl::openat(
            at,
            *name,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| refused(at, name, e))?;
        current = Some(next);
    }
    let at = current.as_ref().unwrap_or(dir);
    // With O_PATH and O_NOFOLLOW a link at the end gives a descriptor of the link itself (not
    // ELOOP): refused as a link all the same.
    let fd = nix::fcntl::openat(
        at,
        *last,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| refused(at, last, e))?;
    if nix::sys::stat::fstat(&fd).is_ok_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFLNK) {
        return Err(link(last));
    }
    Ok(fd)
}

/// The first `cap` bytes of `reader`, and whether there was more.
fn read_capped(reader: impl std::io::Read, cap: usize) -> std::io::Result<(Vec<u8>, bool)> {
    let mut data = Vec::new();
    reader
        .take((cap as u64).saturating_add(1))
        .read_to_end(&mut data)?;
    let cut = data.len() > cap;
    data.truncate(cap);
    Ok((data, cut))
}

fn read_head(path: &Path, cap: usize) -> std::io::Result<(Vec<u8>, bool)> {
    read_capped(std::fs::File::open(path)?, cap)
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
            vec![PartFile::new(
                "kernel-log.txt",
                text.into_bytes(),
                truncated,
            )],
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
    let mut cut = files.len() >= MAX_SYSCTL_ENTRIES;
    if cut {
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
            Ok((v, _)) => {
                let line = format!("{key} = {}\n", String::from_utf8_lossy(&v).trim_end());
                size += line.len();
                if size > cap {
                    notes.push(format!("cut at {cap} bytes"));
                    cut = true;
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
        vec![PartFile::new(
            "sysctl.txt",
            lines.concat().into_bytes(),
            cut,
        )],
        notes,
    ))
}

/// Socket and conntrack summaries from procfs.
fn sockets(proc_root: &Path, cap: usize) -> Result<Gathered, Failure> {
    let mut text = String::new();
    let mut missing = Vec::new();
    let mut cut = false;
    for file in [
        "net/sockstat",
        "net/sockstat6",
        "net/snmp",
        "sys/net/netfilter/nf_conntrack_count",
        "sys/net/netfilter/nf_conntrack_max",
    ] {
        match read_head(&proc_root.join(file), cap / 5) {
            Ok((v, file_cut)) => {
                cut |= file_cut;
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
        vec![PartFile::new("sockets.txt", text.into_bytes(), cut)],
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
        let out = String::from_utf8(files[0].data.clone()).unwrap();
        assert!(files[0].truncated);
        assert!(out.len() <= 200 && out.ends_with("line 99\n"), "{out}");
        assert!(!out.contains("line 1\n"));
        assert!(notes[0].contains("older messages dropped"), "{notes:?}");
    }

    /// Without openat2 (before Linux 5.6) host files are opened a component at a time and every
    /// symbolic link or `..` on the way is refused, naming it.
    #[test]
    fn without_openat2_links_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("host");
        std::fs::create_dir_all(root.join("etc/sub")).unwrap();
        std::fs::write(root.join("etc/sub/real.env"), "REAL=1\n").unwrap();
        std::fs::write(dir.path().join("outside.env"), "OUTSIDE=1\n").unwrap();
        std::os::unix::fs::symlink("/etc/sub/real.env", root.join("etc/link.env")).unwrap();
        std::os::unix::fs::symlink(dir.path(), root.join("etc/out")).unwrap();
        let at = nix::fcntl::open(
            &root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        let open = |path: &str| {
            open_without_links(&at, Path::new(path))
                .map(|fd| read_capped(reopen(&fd).unwrap(), 100).unwrap().0)
        };
        assert_eq!(open("etc/./sub/real.env").unwrap(), b"REAL=1\n");
        for (path, named) in [("etc/link.env", "link.env"), ("etc/out/outside.env", "out")] {
            let e = open(path).unwrap_err().to_string();
            assert!(
                e.contains(&format!("{named} is a symbolic link")) && e.contains("--host-root"),
                "{path}: {e}"
            );
        }
        assert!(
            open("etc/../outside.env")
                .unwrap_err()
                .to_string()
                .contains("`..`")
        );
        assert_eq!(
            open("etc/missing.env").unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
    }

    /// Whether the thread `tid` of this process waits in open(2)/openat(2).
    fn waits_in_open(tid: nix::unistd::Pid) -> bool {
        let task = format!("/proc/self/task/{tid}");
        match std::fs::read_to_string(format!("{task}/syscall")) {
            Ok(s) => s
                .split_whitespace()
                .next()
                .is_some_and(|n| n == libc::SYS_openat.to_string()),
            // Without CONFIG_HAVE_ARCH_TRACEHOOK: asleep (it does nothing but the open).
            Err(_) => std::fs::read_to_string(format!("{task}/stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('S'))
            }),
        }
    }

    /// A FIFO, socket or device at a `--diagnostics-files` path is never opened, not even
    /// non-blocking (a device's open can act: rewind a tape, arm a watchdog). A FIFO shows an
    /// open: a writer waiting in its open(2) for a reader is let through by any reader's open.
    /// Here it goes on waiting, through openat2 and through the walk without it, until the test
    /// itself opens the FIFO to read.
    #[test]
    fn a_node_file_that_is_not_regular_is_never_opened() {
        use std::os::unix::fs::OpenOptionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("host");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        let fifo = root.join("etc/fifo");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        let writer = std::thread::spawn(move || {
            tid_tx.send(nix::unistd::gettid()).unwrap();
            let file = std::fs::OpenOptions::new().write(true).open(&path);
            opened_tx.send(file.is_ok()).unwrap();
        });
        let tid = tid_rx.recv().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !waits_in_open(tid) {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer never waited in open"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }

        let e = read_host_file(&root, Path::new("/etc/fifo"), 100).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let at = nix::fcntl::open(
            &root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        let fd = open_without_links(&at, Path::new("etc/fifo")).unwrap();
        let stat = nix::sys::stat::fstat(&fd).unwrap();
        assert_eq!(stat.st_mode & libc::S_IFMT, libc::S_IFIFO);
        drop(fd);
        let waited = std::time::Duration::from_millis(300);
        assert!(
            opened_rx.recv_timeout(waited).is_err(),
            "the FIFO was opened for reading"
        );
        // What the test watches for: a reader's open (non-blocking, as the agent's was) lets the
        // writer through.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let through = opened_rx.recv_timeout(std::time::Duration::from_secs(5));
        assert_eq!(through, Ok(true), "a reader's open lets the writer through");
        drop(reader);
        writer.join().unwrap();
        // A regular file beside it is read.
        std::fs::write(root.join("etc/real.env"), "REAL=1\n").unwrap();
        let (data, cut) = read_host_file(&root, Path::new("/etc/real.env"), 100).unwrap();
        assert_eq!((data.as_slice(), cut), (b"REAL=1\n".as_slice(), false));
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
        let text = String::from_utf8(files[0].data.clone()).unwrap();
        assert!(!files[0].truncated);
        assert_eq!(text, "net.core.somaxconn = 4096\nvm.swappiness = 10\n");
        assert!(
            notes.contains(&"2 keys readable only by root left out (they may hold secrets)".into()),
            "{notes:?}"
        );
    }
}
