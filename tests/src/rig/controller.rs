//! The controller process of the rig: how every user (the e2e tests, the fleet bench, the demo)
//! starts `nodekeeper-controller`, through its `NODEKEEPER_…` environment settings.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::process::{Output, Process, Program};

/// What the controller is told.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub kubeconfig: PathBuf,
    pub namespace: String,
    pub identity: String,
    /// Its HTTP API and metrics.
    pub http: SocketAddr,
    pub agent_port: u16,
    pub node_selector: String,
    /// `NODEKEEPER_LOG` (the controller's default when `None`).
    pub log: Option<String>,
    /// Further `NODEKEEPER_…` settings.
    pub env: Vec<(String, String)>,
    pub output: Output,
}

impl ControllerConfig {
    /// The environment that carries this configuration.
    fn env(&self) -> Vec<(String, OsString)> {
        let mut env: Vec<(String, OsString)> = vec![
            ("KUBECONFIG".into(), self.kubeconfig.clone().into()),
            ("NODEKEEPER_NAMESPACE".into(), self.namespace.clone().into()),
            ("NODEKEEPER_IDENTITY".into(), self.identity.clone().into()),
            (
                "NODEKEEPER_HTTP_LISTEN".into(),
                self.http.to_string().into(),
            ),
            (
                "NODEKEEPER_AGENT_PORT".into(),
                self.agent_port.to_string().into(),
            ),
            (
                "NODEKEEPER_NODE_SELECTOR".into(),
                self.node_selector.clone().into(),
            ),
            ("NODEKEEPER_LOG_FORMAT".into(), "plain".into()),
            // Plain log files, without terminal colour codes.
            ("NO_COLOR".into(), "1".into()),
        ];
        if let Some(log) = &self.log {
            env.push(("NODEKEEPER_LOG".into(), log.into()));
        }
        env.extend(self.env.iter().map(|(k, v)| (k.clone(), v.into())));
        env
    }
}

/// A running controller. Dropping it kills it.
pub struct ControllerProcess {
    pub process: Process,
    pub identity: String,
    pub http: SocketAddr,
}

impl ControllerProcess {
    /// Starts `program` as the controller configured by `config`.
    pub fn spawn(program: &Program, config: &ControllerConfig) -> anyhow::Result<Self> {
        let process = Process::start(
            "nodekeeper-controller",
            program,
            &[],
            &config.env(),
            &config.output,
        )?;
        Ok(Self {
            process,
            identity: config.identity.clone(),
            http: config.http,
        })
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// SIGTERM (the controller releases its Lease), SIGKILL after 10 s.
    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(10));
    }

    /// SIGKILL: no clean shutdown, no Lease release.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}
