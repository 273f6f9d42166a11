//! Network probes the agent runs on the controller's request (`RunProbes`): request validation,
//! fan-out over targets with bounded concurrency, and per-target results in request order.
//!
//! Every probe goes only to an address the request names (or, for DNS without a resolver, the
//! node's configured resolver, and for HTTP the addresses the URL's host resolves to, each checked
//! against the address policy again once resolved); nothing here chooses a destination by itself.

mod dns;
mod http;
mod icmp;
mod pmtu;
mod tcp;
pub mod validate;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use nodekeeper_proto::agent::v1::{RunProbesRequest, RunProbesResponse, TargetResult};
use tokio_rustls::rustls;
use tracing::{debug, info};

pub use icmp::IcmpSocketPolicy;
use validate::{Kind, Plan, Target};

/// Why a `RunProbes` request was refused as a whole. Failures of single probes are not errors:
/// they are reported in that target's result.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The request is malformed; `field` names the offending field (e.g. `targets[3].url`).
    #[error("invalid RunProbes request: {field}: {reason}")]
    InvalidRequest { field: String, reason: String },
    /// The TLS client configuration for HTTPS probes could not be built.
    #[error("build TLS client configuration: {0}")]
    BuildTlsConfig(#[from] rustls::Error),
    /// The certificates of `--probe-ca-file` could not be read.
    #[error("read --probe-ca-file {}: {reason}", path.display())]
    ReadCaFile { path: PathBuf, reason: String },
}

impl ProbeError {
    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidRequest {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Node-local settings for probes that are not part of the request.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Where the node's resolver is read from when a DNS target names none.
    pub resolv_conf: PathBuf,
    /// Certificates trusted for HTTPS in addition to the Mozilla roots compiled into the agent
    /// (for clusters whose endpoints use a private CA). DER encoded.
    pub extra_root_certs: Vec<Vec<u8>>,
    /// Which kind of ICMP socket to use.
    pub icmp_socket: IcmpSocketPolicy,
    /// A PEM file of more certificates trusted for HTTPS (`--probe-ca-file`), read for each
    /// HTTP run, so a bundle rotated in place (a mounted ConfigMap) is used without a restart.
    pub ca_file: Option<PathBuf>,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        Self {
            resolv_conf: PathBuf::from("/etc/resolv.conf"),
            extra_root_certs: Vec::new(),
            icmp_socket: IcmpSocketPolicy::Auto,
            ca_file: None,
        }
    }
}

impl ProbeOptions {
    /// The options of an agent that sees the host's root filesystem at `host_root`
    /// (`--host-root`): the node's resolver is the host's `/etc/resolv.conf`, not the agent
    /// container's, which names the cluster DNS (the DaemonSet's `ClusterFirstWithHostNet`).
    pub fn for_host_root(host_root: &Path) -> Self {
        Self {
            resolv_conf: host_path(host_root, Path::new("/etc/resolv.conf")),
            ..Self::default()
        }
    }
}

/// The certificates of the PEM file `path`, DER encoded; a file holding none is refused.
pub fn read_ca_file(path: &Path) -> Result<Vec<Vec<u8>>, ProbeError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let failed = |reason: String| ProbeError::ReadCaFile {
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| failed(e.to_string()))?
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| failed(e.to_string()))?;
    if certs.is_empty() {
        return Err(failed(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    Ok(certs)
}

/// Where `path` of the host is seen under `host_root`, following symbolic links the way the
/// host would: an absolute link target (systemd-resolved's `/etc/resolv.conf` →
/// `/run/systemd/resolve/stub-resolv.conf`) is the host's path, so under `host_root` too.
fn host_path(host_root: &Path, path: &Path) -> PathBuf {
    let mut at = crate::config::under_root(host_root, path);
    // A bound on links followed, as the kernel has (40); more is a loop.
    for _ in 0..40 {
        let Ok(target) = std::fs::read_link(&at) else {
            break;
        };
        at = if target.is_absolute() {
            crate::config::under_root(host_root, &target)
        } else {
            at.parent().unwrap_or(host_root).join(target)
        };
    }
    at
}

/// Runs the probes of `req` from this node with default options.
pub async fn run(req: RunProbesRequest) -> Result<RunProbesResponse, ProbeError> {
    run_with(req, &ProbeOptions::default()).await
}

/// Runs the probes of `req` from this node: validates the whole request first (nothing is sent for
/// an invalid one), then probes at most `concurrency` targets at once and returns one result per
/// target, in request order.
pub async fn run_with(
    req: RunProbesRequest,
    opts: &ProbeOptions,
) -> Result<RunProbesResponse, ProbeError> {
    let plan = validate::plan(&req)?;
    let tls = match plan.kind {
        Kind::Http => {
            let mut roots = opts.extra_root_certs.clone();
            if let Some(file) = &opts.ca_file {
                roots.extend(read_ca_file(file)?);
            }
            Some(http::client_config(&roots)?)
        }
        _ => None,
    };
    let started = Instant::now();
    let ctx = Ctx {
        plan: &plan,
        opts,
        tls,
    };
    // The futures are made up front (they do nothing until polled) rather than in a stream
    // adapter's closure: a borrowing closure there makes the future fail the `Send` bound of
    // the gRPC handler ("FnOnce is not general enough").
    let probes: Vec<_> = plan
        .targets
        .iter()
        .map(|target| probe_target(&ctx, target))
        .collect();
    let results: Vec<TargetResult> = futures::stream::iter(probes)
        .buffered(plan.concurrency)
        .collect()
        .await;
    let failed = results.iter().filter(|r| !r.error.is_empty()).count();
    info!(
        run_id = %req.run_id,
        kind = ?plan.kind,
        targets = results.len(),
        failed,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "probes finished"
    );
    Ok(RunProbesResponse {
        run_id: req.run_id,
        results,
    })
}

struct Ctx<'a> {
    plan: &'a Plan,
    opts: &'a ProbeOptions,
    tls: Option<Arc<rustls::ClientConfig>>,
}

/// Tallies of one target's probes, turned into a `TargetResult` at the end.
#[derive(Default)]
struct Tally {
    sent: u32,
    received: u32,
    rtt_us: Vec<u32>,
    error: Option<String>,
}

impl Tally {
    fn success(&mut self, rtt: Duration) {
        self.sent += 1;
        self.received += 1;
        self.rtt_us.push(micros(rtt));
    }

    fn failure(&mut self, error: String) {
        self.sent += 1;
        self.error = Some(error);
    }

    fn into_result(self, target_id: &str) -> TargetResult {
        TargetResult {
            target_id: target_id.to_owned(),
            sent: self.sent,
            received: self.received,
            rtt_us: self.rtt_us,
            error: self.error.unwrap_or_default(),
            ..TargetResult::default()
        }
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

async fn probe_target(ctx: &Ctx<'_>, target: &Target) -> TargetResult {
    let plan = ctx.plan;
    let result = match target {
        Target::Icmp { id, addr } => icmp::probe(*addr, plan, ctx.opts.icmp_socket)
            .await
            .into_result(id),
        Target::Tcp { id, addr } => tcp::probe(*addr, plan).await.into_result(id),
        Target::Dns { id, resolver, name } => {
            let (tally, answers) = dns::probe(*resolver, name, plan, &ctx.opts.resolv_conf).await;
            TargetResult {
                answers,
                ..tally.into_result(id)
            }
        }
        Target::Http { id, url } => {
            let tls = ctx.tls.clone().expect("TLS config is built for HTTP runs");
            let (tally, status) = http::probe(url, plan, tls).await;
            TargetResult {
                http_status: u32::from(status),
                ..tally.into_result(id)
            }
        }
        Target::PathMtu { id, addr } => {
            let (tally, mtu) = pmtu::probe(*addr, plan, ctx.opts.icmp_socket).await;
            TargetResult {
                path_mtu: mtu,
                ..tally.into_result(id)
            }
        }
    };
    debug!(
        target = %result.target_id,
        sent = result.sent,
        received = result.received,
        error = %result.error,
        "target probed"
    );
    result
}

/// Sleeps the configured pause between two probes of one target (not after the last one).
async fn pause(plan: &Plan, index: u32) {
    if index + 1 < plan.count {
        tokio::time::sleep(plan.interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_resolver_is_read_under_the_host_root() {
        let root = tempfile::tempdir().unwrap();
        let etc = root.path().join("etc");
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join("resolv.conf"), "nameserver 10.0.0.2\n").unwrap();
        let opts = ProbeOptions::for_host_root(root.path());
        assert_eq!(opts.resolv_conf, etc.join("resolv.conf"));
        assert_eq!(
            ProbeOptions::for_host_root(Path::new("/")).resolv_conf,
            Path::new("/etc/resolv.conf")
        );
    }

    /// systemd-resolved's absolute link is the host's path: followed under the host root, not
    /// in the agent's container.
    #[test]
    fn an_absolute_resolv_conf_link_is_followed_under_the_host_root() {
        let root = tempfile::tempdir().unwrap();
        let stub = root.path().join("run/systemd/resolve");
        std::fs::create_dir_all(&stub).unwrap();
        std::fs::create_dir_all(root.path().join("etc")).unwrap();
        std::fs::write(stub.join("stub-resolv.conf"), "nameserver 127.0.0.53\n").unwrap();
        std::os::unix::fs::symlink(
            "/run/systemd/resolve/stub-resolv.conf",
            root.path().join("etc/resolv.conf"),
        )
        .unwrap();
        let opts = ProbeOptions::for_host_root(root.path());
        assert_eq!(opts.resolv_conf, stub.join("stub-resolv.conf"));
        // A relative link resolves next to the link.
        std::fs::remove_file(root.path().join("etc/resolv.conf")).unwrap();
        std::os::unix::fs::symlink(
            "../run/systemd/resolve/stub-resolv.conf",
            root.path().join("etc/resolv.conf"),
        )
        .unwrap();
        let got = ProbeOptions::for_host_root(root.path()).resolv_conf;
        assert_eq!(
            std::fs::read_to_string(got).unwrap(),
            "nameserver 127.0.0.53\n"
        );
    }
}
