//! The processes started during `up`: recorded as they start, watched while the cluster comes
//! up (a component that exits fails the start, quoting its log), and stopped again if it fails.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use super::{Component, Error, Lifetime, binaries, process};

/// Processes started so far during `up`, stopped again if startup fails.
pub(super) struct Starting {
    pub(super) lifetime: Lifetime,
    pub(super) components: Vec<Component>,
    pub(super) children: Vec<Child>,
    pub(super) logs: PathBuf,
}

impl Starting {
    pub(super) fn spawn(
        &mut self,
        name: &str,
        binary: PathBuf,
        args: Vec<String>,
        envs: &[(&str, &Path)],
    ) -> Result<(), Error> {
        let log = self.logs.join(format!("{name}.log"));
        let child = process::spawn(&binary, &args, envs, &log, self.lifetime)?;
        self.components.push(Component {
            name: name.to_owned(),
            pid: child.id(),
            binary,
            log,
        });
        self.children.push(child);
        Ok(())
    }

    /// Fails if any component has exited, quoting the end of its log.
    pub(super) fn check_alive(&mut self) -> Result<(), Error> {
        for (component, child) in self.components.iter().zip(self.children.iter_mut()) {
            if let Ok(Some(status)) = child.try_wait() {
                let log = fs::read_to_string(&component.log).unwrap_or_default();
                return Err(Error::ComponentExited {
                    component: component.name.clone(),
                    status: status.to_string(),
                    log: component.log.clone(),
                    tail: binaries::tail_lines(&log, 12),
                });
            }
        }
        Ok(())
    }

    pub(super) fn abort(&mut self) {
        for component in self.components.iter().rev() {
            process::stop(component.pid, &component.binary, Duration::from_secs(5));
        }
        for child in &mut self.children {
            let _ = child.wait();
        }
    }

    /// Polls `check` every 250 ms until it returns true, a component dies, or `timeout` passes.
    pub(super) async fn wait<F, Fut>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut check: F,
    ) -> Result<(), Error>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_alive()?;
            if check().await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::WaitReady {
                    what: what.to_owned(),
                    secs: timeout.as_secs(),
                    logs: self.logs.clone(),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
