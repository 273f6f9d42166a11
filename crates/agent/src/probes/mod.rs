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

use std::path::PathBuf;
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
}

impl Default for ProbeOptions {
    fn default() -> Self {
        Self {
            resolv_conf: PathBuf::from("/etc/resolv.conf"),
            extra_root_certs: Vec::new(),
            icmp_socket: IcmpSocketPolicy::Auto,
        }
    }
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
        Kind::Http => Some(http::client_config(&opts.extra_root_certs)?),
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
