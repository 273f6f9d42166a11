//! Starting and stopping the control-plane processes: detached daemons for `cargo xtask cluster
//! up`, or children that die with the test binary that started them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::Error;

/// How long the started processes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// Outlive the starting process (its own process group, so Ctrl-C on `cargo xtask` does not
    /// reach it); stopped by `cluster down`.
    Detached,
    /// Receive SIGKILL when the starting process exits, however it exits (a test binary that
    /// panics, is killed, or simply returns from `main`).
    WithThisProcess,
}

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// The parent-death signal is tied to the *thread* that forked the child, not to the process:
/// libtest runs each test on its own short-lived thread, so a control plane forked there would be
/// killed when that one test returns. All `WithThisProcess` children are therefore forked by
/// this one thread, which lives as long as the process (its channel's sender is never dropped).
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnJob>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        thread::Builder::new()
            .name("nodekeeper-controlplane-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("spawn the control-plane spawner thread");
        Mutex::new(tx)
    })
}

/// Starts `program args…` with stdout and stderr appended to `log`, and returns the child.
pub fn spawn(
    program: &Path,
    args: &[String],
    envs: &[(&str, &Path)],
    log: &Path,
    lifetime: Lifetime,
) -> Result<Child, Error> {
    let open_log = || {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|source| Error::Io {
                context: format!("open log {}", log.display()),
                source,
            })
    };
    let mut command = match lifetime {
        Lifetime::Detached => {
            let mut c = Command::new(program);
            std::os::unix::process::CommandExt::process_group(&mut c, 0);
            c
        }
        Lifetime::WithThisProcess => {
            // util-linux's setpriv sets PR_SET_PDEATHSIG and then execs the component, so the
            // pid we record is the component's own; this keeps `unsafe` (a pre_exec hook) out of
            // the crate, which the workspace forbids outright.
            let mut c = Command::new("setpriv");
            c.args(["--pdeathsig", "KILL", "--"]).arg(program);
            c
        }
    };
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(open_log()?)
        .stderr(open_log()?);
    for (key, value) in envs {
        command.env(key, value);
    }
    let what = program.display().to_string();
    let spawned = match lifetime {
        Lifetime::Detached => command.spawn(),
        Lifetime::WithThisProcess => {
            let (tx, rx) = mpsc::channel();
            spawner()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .send((command, tx))
                .map_err(|_| Error::Spawn {
                    program: what.clone(),
                    source: std::io::Error::other("spawner thread is gone"),
                })?;
            rx.recv()
                .unwrap_or_else(|_| Err(std::io::Error::other("spawner thread is gone")))
        }
    };
    spawned.map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound && lifetime == Lifetime::WithThisProcess {
            Error::FindSetpriv
        } else {
            Error::Spawn {
                program: what,
                source,
            }
        }
    })
}

/// Whether `pid` is alive and is running `binary` (guards against a recycled pid).
pub fn is_running(pid: u32, binary: &Path) -> bool {
    let Ok(exe) = fs::read_link(format!("/proc/{pid}/exe")) else {
        return false;
    };
    // A zombie has no exe link; a replaced binary shows " (deleted)".
    let exe = PathBuf::from(exe.to_string_lossy().trim_end_matches(" (deleted)"));
    let same = exe == binary || fs::canonicalize(binary).is_ok_and(|b| b == exe);
    same && !is_zombie(pid)
}

fn is_zombie(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Stops a process this project started: SIGTERM, then SIGKILL after `grace`. Does nothing
/// (and returns false) unless `pid` is still running `binary`.
pub fn stop(pid: u32, binary: &Path, grace: Duration) -> bool {
    if !is_running(pid, binary) {
        return false;
    }
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    let target = Pid::from_raw(raw);
    let _ = kill(target, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !is_running(pid, binary) {
            return true;
        }
        thread::sleep(Duration::from_millis(100));
    }
    let _ = kill(target, Signal::SIGKILL);
    true
}
