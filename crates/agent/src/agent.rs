//! The agent's state between calls, built once per process: the rules in force, the host
//! network manager (with the applied state and its status), the last collection (reused for
//! `--report-max-age`), the CPU sample for busy time, and the GPU reading (reused for
//! `--gpu-interval`). Runs the collectors and turns their output into a [`Report`].

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::debug;

use crate::collect::gpu::GpuReading;
use crate::collect::load::CpuTimes;
use crate::collect::{self, CollectError, Measurement, Unit};
use crate::config::{Config, under_root};
use crate::error::Error;
use crate::monitor::state::{self as monitor_state, ProblemState, SharedState};
use crate::network::NetworkManager;
use crate::report::{self, Inputs, Report, SystemInfo};
use crate::tunables::{RawRuleSet, Tunables};

/// What the collectors read, taken from the configuration.
#[derive(Clone, Debug)]
pub struct Sources {
    pub node_name: String,
    pub proc_root: PathBuf,
    pub host_root: PathBuf,
    pub mounts: Vec<PathBuf>,
    pub oca_plugin_dir: Option<PathBuf>,
    pub gpu: collect::gpu::GpuConfig,
    pub gpu_interval: Duration,
    pub report_max_age: Duration,
}

#[derive(Default)]
struct Cache {
    /// The last report, its revision and when it was collected.
    last: Option<(Instant, Arc<Report>, u64)>,
    /// The network manager's `status_changes()` that the last report shows.
    network_changes: u64,
    /// The problem monitors' state revision that the last report shows.
    problems_revision: u64,
    cpu: Option<CpuTimes>,
    gpu: Option<(Instant, GpuReading)>,
}

/// The agent: shared by every call.
pub struct Agent {
    sources: Sources,
    tunables: Mutex<Tunables>,
    cache: tokio::sync::Mutex<Cache>,
    /// GPU reads, one at a time and bounded in how long a report waits for them.
    gpu_reader: collect::gpu::Reader,
    network: NetworkManager,
    /// Filled by the node problem monitors (started by [`crate::run`]).
    problems: SharedState,
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Agent {
    /// Builds the agent, restoring the rules kept in `--state-dir`. Nothing is opened yet: the
    /// network manager connects to netlink on its first use.
    pub fn new(config: &Config) -> Self {
        Self {
            sources: Sources {
                node_name: config.node_name.clone(),
                proc_root: config.proc_root.clone(),
                host_root: config.host_root.clone(),
                mounts: config.mounts.clone(),
                oca_plugin_dir: config.oca_plugin_dir.clone(),
                gpu: config.gpu(),
                gpu_interval: config.gpu_interval,
                report_max_age: config.report_max_age,
            },
            tunables: Mutex::new(Tunables::load(config.sysctl_root(), &config.state_dir)),
            cache: tokio::sync::Mutex::new(Cache::default()),
            gpu_reader: collect::gpu::Reader::default(),
            network: NetworkManager::new(config.imds_endpoint.clone(), &config.state_dir),
            problems: ProblemState::new_shared(),
        }
    }

    /// The host network manager (`ApplyNetwork` and the drift loop).
    /// The Node this agent serves (`--node-name`).
    pub fn node_name(&self) -> &str {
        &self.sources.node_name
    }

    pub fn network(&self) -> &NetworkManager {
        &self.network
    }

    /// What the node problem monitors write into.
    pub fn problems(&self) -> &SharedState {
        &self.problems
    }

    /// The current revision and, unless the caller already holds it, the report.
    pub async fn report(&self, since_revision: u64) -> (u64, Option<Arc<Report>>) {
        let mut cache = self.cache.lock().await;
        // Read before collecting: a change published meanwhile makes the next call collect again.
        let network_changes = self.network.status_changes();
        let problems_revision = monitor_state::lock(&self.problems).revision();
        let fresh = cache
            .last
            .as_ref()
            .is_some_and(|(at, _, _)| at.elapsed() < self.sources.report_max_age)
            && cache.network_changes == network_changes
            && cache.problems_revision == problems_revision;
        if !fresh {
            cache.network_changes = network_changes;
            cache.problems_revision = problems_revision;
            let report = Arc::new(self.collect(&mut cache).await);
            let revision = report::revision(&report);
            debug!(revision, "collected report");
            cache.last = Some((Instant::now(), report, revision));
        }
        let (_, report, revision) = cache.last.as_ref().expect("set above");
        if since_revision == *revision {
            (*revision, None)
        } else {
            (*revision, Some(Arc::clone(report)))
        }
    }

    /// Validates and installs rules; the next report is collected afresh under them.
    pub async fn set_rules(&self, raw: &RawRuleSet) -> Result<u64, Error> {
        let revision = self
            .tunables
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_rules(raw)?;
        self.cache.lock().await.last = None;
        Ok(revision)
    }

    async fn collect(&self, cache: &mut Cache) -> Report {
        let s = &self.sources;
        let mut inputs = Inputs::default();
        // Failures are gathered beside the figures: a failed collector never fails the report.
        let mut errors: Vec<(String, String)> = Vec::new();
        let mut measurements: Vec<Measurement> = Vec::new();
        let mut take = |name: &str,
                        r: Result<Vec<Measurement>, CollectError>,
                        errors: &mut Vec<(String, String)>| match r {
            Ok(m) => measurements.extend(m),
            Err(e) => errors.push((name.to_string(), e.to_string())),
        };

        let mut system = SystemInfo::default();
        match collect::load::read_stat(&s.proc_root) {
            Ok(stat) => {
                system.cpus = stat.cpus;
                system.booted_at_unix = stat.btime;
                if let Some(before) = cache.cpu
                    && let Some(busy) = collect::load::busy_percent(before, stat.cpu)
                {
                    take(
                        "cpu",
                        Ok(vec![Measurement::new(
                            "cpu.busy_percent",
                            busy,
                            Unit::Percent,
                        )]),
                        &mut errors,
                    );
                }
                cache.cpu = Some(stat.cpu);
            }
            Err(e) => errors.push(("cpu".into(), e.to_string())),
        }
        take(
            "load",
            collect::load::collect_load(&s.proc_root, system.cpus),
            &mut errors,
        );
        match collect::memory::collect_memory(&s.proc_root) {
            Ok((info, m)) => {
                system.memory_total_bytes = info.total;
                take("memory", Ok(m), &mut errors);
            }
            Err(e) => errors.push(("memory".into(), e.to_string())),
        }
        for resource in ["cpu", "memory", "io"] {
            take(
                &format!("psi:{resource}"),
                collect::memory::collect_psi(&s.proc_root, resource),
                &mut errors,
            );
        }
        for mount in &s.mounts {
            let name = mount.display().to_string();
            take(
                &format!("disk:{name}"),
                collect::disk::collect_bounded(&name, &under_root(&s.host_root, mount)).await,
                &mut errors,
            );
        }
        take(
            "conntrack",
            collect::kernel::collect_conntrack(&s.proc_root),
            &mut errors,
        );
        take(
            "files",
            collect::kernel::collect_files(&s.proc_root),
            &mut errors,
        );
        take("time", collect::time::collect(), &mut errors);
        match collect::kernel::release_and_boot_id(&s.proc_root) {
            Ok((release, boot_id)) => {
                system.kernel_release = release;
                system.boot_id = boot_id;
            }
            Err(e) => errors.push(("kernel".into(), e.to_string())),
        }
        inputs.measurements = measurements;

        match collect::interfaces::collect().await {
            Ok(mut interfaces) => {
                for iface in &mut interfaces {
                    iface.managed = iface.managed || self.network.configures(iface);
                }
                inputs.interfaces = interfaces;
            }
            Err(e) => errors.push(("interfaces".into(), e.to_string())),
        }

        let gpu_fresh = cache
            .gpu
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < s.gpu_interval);
        if !gpu_fresh {
            cache.gpu = Some((Instant::now(), self.gpu_reader.read(&s.gpu).await));
        }
        inputs.gpu = cache
            .gpu
            .as_ref()
            .map(|(_, g)| g.clone())
            .unwrap_or_default();
        if !inputs.gpu.error.is_empty() {
            errors.push(("gpu".into(), inputs.gpu.error.clone()));
        }
        if !inputs.gpu.xid_error.is_empty() {
            errors.push(("gpu:xid".into(), inputs.gpu.xid_error.clone()));
        }

        let oca = collect::oca::collect_all(
            &collect::oca::OcaConfig {
                host_root: s.host_root.clone(),
                plugin_dir: s.oca_plugin_dir.clone(),
            },
            SystemTime::now(),
        );
        inputs.plugins = oca.plugins;
        inputs.oca_version = oca.version;
        inputs.oca_source = oca.source;
        errors.extend(oca.errors.into_iter().map(|(f, e)| (format!("oca:{f}"), e)));
        inputs.collector_errors = errors;
        inputs.system = system;

        let mut tunables = self.tunables.lock().unwrap_or_else(PoisonError::into_inner);
        let mut report = report::assemble(inputs, tunables.thresholds());
        report.node_name = s.node_name.clone();
        report.agent_version = env!("CARGO_PKG_VERSION").to_string();
        report.collected_at_unix_ms = now_unix_ms();
        report.tunables = tunables.evaluate(report.collected_at_unix_ms);
        report.rules_revision = tunables.revision();
        drop(tunables);
        report.network = self.network.status();
        report.problems = monitor_state::lock(&self.problems).clone();
        report
    }
}
