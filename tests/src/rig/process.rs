//! A process the rig started and owns: stopped by pid through its `Child` handle, which is never
//! reaped before it is stopped, so the pid cannot belong to anyone else.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::controlplane::{Lifetime, process};

/// What to run: a built binary, or this test binary re-executed to run one of its ignored helper
/// tests (which is how tests and the fleet bench run code that links the agent or controller
/// crates without xtask linking them: xtask must build without the generated gRPC code).
#[derive(Clone, Debug)]
pub enum Program {
    Binary(PathBuf),
    TestHelper {
        exe: PathBuf,
        /// The ignored test that takes the role.
        test: String,
        /// `NODEKEEPER_E2E_ROLE`: the helper does its work only when this is set.
        role: String,
    },
}

/// Set in the environment of a re-executed test binary: the role its helper test plays.
pub const ROLE_ENV: &str = "NODEKEEPER_E2E_ROLE";

impl Program {
    /// The running test binary, re-executed as its helper test `test` in `role`.
    pub fn this_test_binary(test: &str, role: &str) -> anyhow::Result<Program> {
        Ok(Program::TestHelper {
            exe: std::env::current_exe().context("locate this test binary")?,
            test: test.to_owned(),
            role: role.to_owned(),
        })
    }

    /// The executable, its arguments and the environment it needs.
    fn parts(&self) -> (&Path, Vec<String>, Vec<(String, OsString)>) {
        match self {
            Program::Binary(path) => (path, Vec::new(), Vec::new()),
            Program::TestHelper { exe, test, role } => (
                exe,
                vec![
                    "--ignored".into(),
                    "--exact".into(),
                    test.clone(),
                    "--nocapture".into(),
                    "--test-threads=1".into(),
                ],
                vec![(ROLE_ENV.into(), role.into())],
            ),
        }
    }
}

/// Where a process's output goes.
#[derive(Clone, Debug)]
pub enum Output {
    /// stdout discarded, stderr shared with this process (tests and benches: errors show).
    Stderr,
    /// stdout and stderr appended to this file, and the process gets SIGKILL when this one
    /// exits however it exits (the control plane harness's parent-death signal).
    Log(PathBuf),
}

/// A started process.
pub struct Process {
    pub name: String,
    child: Child,
    log: Option<PathBuf>,
}

impl Process {
    /// Starts `program` with `args` and `env` added.
    pub fn start(
        name: &str,
        program: &Program,
        args: &[String],
        env: &[(String, OsString)],
        output: &Output,
    ) -> anyhow::Result<Process> {
        let (exe, mut all_args, mut all_env) = program.parts();
        all_args.extend_from_slice(args);
        all_env.extend_from_slice(env);
        let child = match output {
            Output::Stderr => {
                let mut command = Command::new(exe);
                command
                    .args(&all_args)
                    .envs(all_env.iter().map(|(k, v)| (k, v)))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null());
                command
                    .spawn()
                    .with_context(|| format!("start {name} ({})", exe.display()))?
            }
            Output::Log(log) => {
                let env: Vec<(&str, &Path)> = all_env
                    .iter()
                    .map(|(k, v)| (k.as_str(), Path::new(v)))
                    .collect();
                process::spawn(exe, &all_args, &env, log, Lifetime::WithThisProcess)
                    .with_context(|| format!("start {name}"))?
            }
        };
        Ok(Process {
            name: name.to_owned(),
            child,
            log: match output {
                Output::Stderr => None,
                Output::Log(log) => Some(log.clone()),
            },
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> Option<&Path> {
        self.log.as_deref()
    }

    /// Sends SIGTERM (a clean shutdown: the controller releases its Lease) without waiting.
    pub fn terminate(&mut self) {
        if let (Ok(None), Ok(pid)) = (self.child.try_wait(), i32::try_from(self.child.id())) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
    }

    /// Waits until `deadline` for the process to exit, then SIGKILLs and reaps it.
    pub fn wait_or_kill(&mut self, deadline: Instant) {
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) {
        self.terminate();
        self.wait_or_kill(Instant::now() + grace);
    }

    /// SIGKILL: no clean shutdown (no Lease release).
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    /// Fails when the process has exited, naming it, its exit status and its log's last line.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            match &self.log {
                Some(log) => bail!(
                    "{} exited ({status}); last log line: {:?}; full log: {}",
                    self.name,
                    last_line(log),
                    log.display()
                ),
                None => bail!("{} exited ({status})", self.name),
            }
        }
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

fn last_line(path: &Path) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(str::to_owned)
        })
        .unwrap_or_default()
}
