//! The agents of the rig: the certificate they get from the controller, and one agent's command
//! line and files ([`AgentSetup`]), whichever way it runs — in the test's process (the e2e tests,
//! which link the agent crate), many in one agents-host process (the fleet bench), or one
//! `nodekeeper-agent` process per node (the demo).

use std::net::{Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use serde::{Deserialize, Serialize};

use super::process::{Output, Process, Program};
use crate::wait_for;

/// The Secret the controller creates with the agents' certificate.
pub const AGENT_SECRET: &str = "nodekeeper-agent-tls";

/// The agents' certificate, key and client CA (PEM), as the controller issued them.
#[derive(Clone, Debug)]
pub struct AgentTls {
    pub cert: String,
    pub key: String,
    pub ca: String,
}

impl AgentTls {
    /// The certificate from the controller's Secret in `namespace`, `None` while it is not there.
    pub async fn get(client: &kube::Client, namespace: &str) -> anyhow::Result<Option<AgentTls>> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let Some(secret) = secrets.get_opt(AGENT_SECRET).await? else {
            return Ok(None);
        };
        let data = secret.data.unwrap_or_default();
        let get = |k: &str| -> anyhow::Result<String> {
            let bytes = data
                .get(k)
                .with_context(|| format!("Secret {namespace}/{AGENT_SECRET} has no {k}"))?;
            Ok(String::from_utf8(bytes.0.clone())?)
        };
        Ok(Some(AgentTls {
            cert: get("tls.crt")?,
            key: get("tls.key")?,
            ca: get("ca.crt")?,
        }))
    }

    /// Waits up to `timeout` for the controller to create its Secret.
    pub async fn wait(
        client: &kube::Client,
        namespace: &str,
        timeout: Duration,
    ) -> anyhow::Result<AgentTls> {
        wait_for(
            &format!("Secret {namespace}/{AGENT_SECRET}"),
            timeout,
            || AgentTls::get(client, namespace),
        )
        .await
    }

    /// Writes `tls.crt`, `tls.key` and `ca.crt` into `dir` (what [`AgentSetup`] points at).
    pub fn write_to(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        for (file, text) in [
            ("tls.crt", &self.cert),
            ("tls.key", &self.key),
            ("ca.crt", &self.ca),
        ] {
            let path = dir.join(file);
            std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        }
        Ok(())
    }
}

/// One agent: its node, address and files. Its sysctls are a small file tree of its own (so
/// repairs touch no real setting).
#[derive(Clone, Debug)]
pub struct AgentSetup {
    pub node: String,
    pub listen: SocketAddr,
    /// Holds `tls.crt`, `tls.key`, `ca.crt` ([`AgentTls::write_to`]).
    pub tls_dir: PathBuf,
    pub state_dir: PathBuf,
    pub sysctl_root: PathBuf,
    /// A `/proc` of its own (default: the machine's).
    pub proc_root: Option<PathBuf>,
    /// Points `--nvidia-smi` at nothing, so no GPU collector runs.
    pub no_gpu: bool,
    /// `--metrics-listen`: where it serves `/metrics` (as the DaemonSet's agents do); unset: not
    /// served.
    pub metrics_listen: Option<SocketAddr>,
}

impl AgentSetup {
    /// An agent for `node` on `listen` whose state and sysctls live under `dir`.
    pub fn new(node: &str, listen: SocketAddr, tls_dir: &Path, dir: &Path) -> AgentSetup {
        AgentSetup {
            node: node.to_owned(),
            listen,
            tls_dir: tls_dir.to_owned(),
            state_dir: dir.join("state"),
            sysctl_root: dir.join("sysctl"),
            proc_root: None,
            no_gpu: true,
            metrics_listen: None,
        }
    }

    /// Creates the state and sysctl directories.
    pub fn create_dirs(&self) -> anyhow::Result<()> {
        for dir in [&self.state_dir, &self.sysctl_root] {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        }
        Ok(())
    }

    /// Writes a fake sysctl this agent reads (e.g. `net.core.somaxconn`).
    pub fn write_sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        let path = sysctl_path(&self.sysctl_root, key);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, format!("{value}\n"))
            .with_context(|| format!("write {}", path.display()))
    }

    /// The agent's command line, program name first.
    pub fn args(&self) -> Vec<String> {
        let s = |p: &Path| p.display().to_string();
        let mut args = vec![
            "nodekeeper-agent".to_owned(),
            format!("--listen={}", self.listen),
            format!("--node-name={}", self.node),
            format!("--tls-cert={}", s(&self.tls_dir.join("tls.crt"))),
            format!("--tls-key={}", s(&self.tls_dir.join("tls.key"))),
            format!("--client-ca={}", s(&self.tls_dir.join("ca.crt"))),
            format!("--state-dir={}", s(&self.state_dir)),
            format!("--sysctl-root={}", s(&self.sysctl_root)),
            "--log-format=plain".to_owned(),
        ];
        if let Some(proc_root) = &self.proc_root {
            args.push(format!("--proc-root={}", s(proc_root)));
        }
        if self.no_gpu {
            args.push("--nvidia-smi=/nonexistent/nvidia-smi".to_owned());
        }
        if let Some(metrics) = self.metrics_listen {
            args.push(format!("--metrics-listen={metrics}"));
        }
        args
    }

    /// Starts `nodekeeper-agent` (the built `binary`) as its own process, logging to `log`.
    pub fn spawn(&self, binary: &Path, log: &Path) -> anyhow::Result<Process> {
        Process::start(
            &format!("nodekeeper-agent for {}", self.node),
            &Program::Binary(binary.to_owned()),
            &self.args()[1..],
            &[("NO_COLOR".into(), "1".into())],
            &Output::Log(log.to_owned()),
        )
    }
}

/// Where a sysctl's file is under a sysctl root (`net.core.somaxconn` → `net/core/somaxconn`).
pub fn sysctl_path(root: &Path, key: &str) -> PathBuf {
    key.split('.').fold(root.to_owned(), |p, part| p.join(part))
}

/// What the agents host serves: every node's agent on `port` of its address, with the one
/// certificate in `dir` (`tls.crt`, `tls.key`, `ca.crt`); node `i`'s files under `dir/n<i>/`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetSpec {
    pub port: u16,
    pub dir: PathBuf,
    pub nodes: Vec<FleetNode>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleetNode {
    pub name: String,
    pub ip: Ipv4Addr,
}

/// The environment variable naming the agents host's spec file.
pub const FLEET_SPEC_ENV: &str = "NODEKEEPER_FLEET_SPEC";
/// The role and helper test of the agents host (`tests/tests/controller_fleet_agents.rs`).
pub const FLEET_ROLE: &str = "fleet-agents";
pub const FLEET_HELPER: &str = "fleet_agents_host";
/// The environment variable naming the nodes one agents host serves, `START..END` (indexes into
/// the spec's nodes); all of them when unset.
pub const FLEET_SHARD_ENV: &str = "NODEKEEPER_FLEET_SHARD";
/// The most agents one agents-host process serves. Each agent listens on a socket of its own,
/// and a process may open at most the hard limit of open files (20,000 on the machine the
/// benchmarks ran on, and no raising it without CAP_SYS_RESOURCE): a 65,000-node fleet runs as
/// five hosts.
pub const AGENTS_PER_HOST: usize = 15_000;
/// The file an agents host writes once every listener is bound (one per host, named by the
/// first node it serves).
const READY_FILE: &str = "ready";

impl FleetSpec {
    /// Node `i`'s agent.
    pub fn agent(&self, i: usize) -> AgentSetup {
        let node = &self.nodes[i];
        AgentSetup::new(
            &node.name,
            SocketAddr::new(node.ip.into(), self.port),
            &self.dir,
            &self.dir.join(format!("n{i}")),
        )
    }

    /// The file whose presence takes node `i`'s agent off the network: while it exists, the
    /// agents host closes every connection to that agent's address as soon as it is accepted
    /// (the client sees its TLS handshake cut, as when an agent is wedged or being replaced) and
    /// refuses any call already under way. The soak's agent outages.
    pub fn outage_marker(&self, i: usize) -> PathBuf {
        self.dir.join(format!("n{i}")).join("outage")
    }

    /// Takes node `i`'s agent off the network (`down`) or brings it back.
    pub fn set_outage(&self, i: usize, down: bool) -> anyhow::Result<()> {
        let marker = self.outage_marker(i);
        if down {
            std::fs::write(&marker, b"")
        } else {
            match std::fs::remove_file(&marker) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        }
        .with_context(|| {
            format!(
                "{} {}",
                if down { "write" } else { "remove" },
                marker.display()
            )
        })
    }

    /// Read from the file named by `NODEKEEPER_FLEET_SPEC` (in the agents host).
    pub fn from_env() -> anyhow::Result<FleetSpec> {
        let path =
            std::env::var(FLEET_SPEC_ENV).with_context(|| format!("read {FLEET_SPEC_ENV}"))?;
        Ok(serde_json::from_slice(
            &std::fs::read(&path).with_context(|| format!("read {path}"))?,
        )?)
    }

    /// The nodes this agents host serves, from `NODEKEEPER_FLEET_SHARD` (all when unset).
    pub fn shard_from_env(&self) -> anyhow::Result<Range<usize>> {
        let Some(text) = std::env::var_os(FLEET_SHARD_ENV) else {
            return Ok(0..self.nodes.len());
        };
        let text = text.to_string_lossy();
        let (start, end) = text
            .split_once("..")
            .with_context(|| format!("{FLEET_SHARD_ENV}={text}: expected START..END"))?;
        let shard = start.parse::<usize>()?..end.parse::<usize>()?;
        if shard.is_empty() || shard.end > self.nodes.len() {
            bail!(
                "{FLEET_SHARD_ENV}={text}: not a non-empty range of the spec's {} nodes",
                self.nodes.len()
            );
        }
        Ok(shard)
    }

    fn ready_file(&self, shard: &Range<usize>) -> PathBuf {
        self.dir.join(format!("{READY_FILE}-{}", shard.start))
    }

    /// Tells the rig that every agent of `shard` listens (a pipe to libtest's stdout is not a
    /// reliable signal).
    pub fn write_ready(&self, shard: &Range<usize>) -> anyhow::Result<()> {
        std::fs::write(self.ready_file(shard), format!("{} agents\n", shard.len()))?;
        Ok(())
    }
}

/// The agents host: every node's agent, in as many processes as [`AGENTS_PER_HOST`] makes
/// needed (`host`, a test binary of this package that runs [`FLEET_HELPER`]; each serves a
/// contiguous range of the nodes). Its work directory holds each node's files.
pub struct AgentsHost {
    pub processes: Vec<Process>,
    pub spec: FleetSpec,
    _work: tempfile::TempDir,
}

impl AgentsHost {
    /// Starts the hosts for `nodes` on `port` with `tls`, at most `per_host` agents in each,
    /// and waits until every one is ready.
    pub fn start(
        host: &Path,
        nodes: Vec<FleetNode>,
        port: u16,
        tls: &AgentTls,
        per_host: usize,
        within: Duration,
    ) -> anyhow::Result<AgentsHost> {
        let work = tempfile::tempdir()?;
        tls.write_to(work.path())?;
        let spec = FleetSpec {
            port,
            dir: work.path().to_owned(),
            nodes,
        };
        let spec_file = work.path().join("spec.json");
        std::fs::write(&spec_file, serde_json::to_vec(&spec)?)?;
        let program = Program::TestHelper {
            exe: host.to_owned(),
            test: FLEET_HELPER.into(),
            role: FLEET_ROLE.into(),
        };
        let n = spec.nodes.len();
        let shards: Vec<Range<usize>> = (0..n)
            .step_by(per_host.max(1))
            .map(|start| start..(start + per_host.max(1)).min(n))
            .collect();
        let mut processes = Vec::with_capacity(shards.len());
        for shard in &shards {
            processes.push(Process::start(
                &format!("the agents host of nodes {}..{}", shard.start, shard.end),
                &program,
                &[],
                &[
                    (FLEET_SPEC_ENV.into(), spec_file.clone().into()),
                    (
                        FLEET_SHARD_ENV.into(),
                        format!("{}..{}", shard.start, shard.end).into(),
                    ),
                ],
                &Output::Stderr,
            )?);
        }
        let mut host = AgentsHost {
            processes,
            spec,
            _work: work,
        };
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if shards.iter().all(|s| host.spec.ready_file(s).exists()) {
                return Ok(host);
            }
            for (process, shard) in host.processes.iter_mut().zip(&shards) {
                process.check_alive().with_context(|| {
                    format!(
                        "the agents host of nodes {}..{} exited before it was ready",
                        shard.start, shard.end
                    )
                })?;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for process in &mut host.processes {
            process.kill();
        }
        bail!(
            "the agents hosts ({} processes for {n} agents) were not ready within {within:?}",
            shards.len()
        )
    }

    /// The hosts' process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().map(Process::pid).collect()
    }
}
