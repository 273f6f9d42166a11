//! `CollectDiagnostics`: gathers the parts a request names (see
//! `nodekeeper_model::diagnostics::PARTS`) one at a time, each under its size and time cap, passes
//! every one through the redaction filter ([`redact`]), and streams them as a `.tar.gz`
//! ([`bundle`]) whose last member, `manifest.json`, says for each part ok / failed / skipped, why,
//! its size and how long it took. A part that fails never fails the bundle.
//!
//! Memory stays bounded whatever the bundle's size: one part (≤ its cap) is gathered while the
//! writer thread compresses the previous one, and at most [`OUT_CHUNKS`] chunks wait for the
//! controller to read them; a slow reader slows the gathering instead of growing a buffer.

pub mod bundle;
pub mod parts;
pub mod redact;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nodekeeper_model::diagnostics::{
    DEFAULT_MAX_BUNDLE_BYTES, DEFAULT_MAX_PART_BYTES, DEFAULT_PART_TIMEOUT_MS, MAX_BUNDLE_BYTES,
    MIN_BUNDLE_BYTES, select_parts,
};
use nodekeeper_proto::agent::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::{info, warn};

use crate::agent::Agent;
use crate::config::Config;
use bundle::{Budget, FileEntry, Manifest, Member, PartEntry, PartStatus};
use parts::Gathered;

/// Chunks that may wait for the controller to read them.
pub const OUT_CHUNKS: usize = 4;
/// Longest accepted time cap of one part.
const MAX_PART_TIMEOUT: Duration = Duration::from_secs(120);

/// The agent's diagnostics flags (flattened into [`Config`]).
#[derive(Clone, Debug, clap::Args)]
#[group(id = "diagnostics")]
pub struct DiagConfig {
    /// The kernel ring buffer read for the `kernel-log` part (read non-blocking; only what is
    /// buffered is taken).
    #[arg(long, env = "NODEKEEPER_DIAGNOSTICS_KMSG", default_value = "/dev/kmsg")]
    pub diagnostics_kmsg: PathBuf,

    /// The `journalctl` program for the `journal` part (kubelet and container runtime units); a
    /// bare name is looked up on PATH. When it is missing the manifest says journald is not
    /// reachable.
    #[arg(
        long,
        env = "NODEKEEPER_DIAGNOSTICS_JOURNALCTL",
        default_value = "journalctl"
    )]
    pub diagnostics_journalctl: PathBuf,

    /// The `ip` program (iproute2) for the `network` and `nodekeeper-network` parts; run in the
    /// agent's network namespace (the host's, with hostNetwork).
    #[arg(long, env = "NODEKEEPER_DIAGNOSTICS_IP", default_value = "ip")]
    pub diagnostics_ip: PathBuf,

    /// Host files included (redacted) in the `node-files` part, comma-separated absolute paths
    /// resolved under `--host-root`: typically the kubelet's and the runtime's environment files.
    /// Symbolic links resolve within `--host-root` as on the host; only regular files are read.
    #[arg(
        long,
        env = "NODEKEEPER_DIAGNOSTICS_FILES",
        value_delimiter = ',',
        default_value = "/etc/default/kubelet,/etc/sysconfig/kubelet,/etc/containerd/config.toml"
    )]
    pub diagnostics_files: Vec<PathBuf>,
}

/// Everything a bundle is gathered from: the agent (for its report) and its configuration.
pub struct Diagnostics {
    agent: Arc<Agent>,
    config: Config,
}

/// The limits of one bundle, from the request with defaults and bounds applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_bundle_bytes: u64,
    pub max_part_bytes: u64,
    pub part_timeout: Duration,
}

impl Limits {
    /// Zero means the default; a cap outside the model's bounds is refused naming the field.
    pub fn from_request(req: &pb::DiagnosticsRequest) -> Result<Self, Status> {
        let max_bundle_bytes = match req.max_bundle_bytes {
            0 => DEFAULT_MAX_BUNDLE_BYTES,
            n if (MIN_BUNDLE_BYTES..=MAX_BUNDLE_BYTES).contains(&n) => n,
            n => {
                return Err(Status::invalid_argument(format!(
                    "max_bundle_bytes: {n} is out of range; use {MIN_BUNDLE_BYTES} to {MAX_BUNDLE_BYTES}, or 0 for the default"
                )));
            }
        };
        let max_part_bytes = match req.max_part_bytes {
            0 => DEFAULT_MAX_PART_BYTES,
            n => n.min(max_bundle_bytes),
        };
        let part_timeout = match req.part_timeout_ms {
            0 => Duration::from_millis(u64::from(DEFAULT_PART_TIMEOUT_MS)),
            n => Duration::from_millis(u64::from(n)).min(MAX_PART_TIMEOUT),
        };
        Ok(Self {
            max_bundle_bytes,
            max_part_bytes,
            part_timeout,
        })
    }
}

/// The part's reason with the files cut short named, bounded like every reason.
fn truncated_reason(reason: &str, part_cut: &[String], bundle_cut: &[String]) -> String {
    let mut said: Vec<String> = Vec::new();
    if !reason.is_empty() {
        said.push(reason.to_owned());
    }
    if !part_cut.is_empty() {
        said.push(format!(
            "cut short by the part's size cap (maxPartBytes): {}",
            part_cut.join(", ")
        ));
    }
    if !bundle_cut.is_empty() {
        said.push(format!(
            "cut short by the bundle's size cap (maxBundleBytes): {}",
            bundle_cut.join(", ")
        ));
    }
    nodekeeper_model::text::truncate(&said.join("; "), bundle::MAX_REASON_BYTES).into_owned()
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Diagnostics {
    pub fn new(agent: Arc<Agent>, config: &Config) -> Self {
        Self {
            agent,
            config: config.clone(),
        }
    }

    /// Starts a bundle and returns the stream of its chunks. Refuses an unknown part or an
    /// out-of-range cap before anything is gathered.
    pub fn collect(
        self: &Arc<Self>,
        req: pb::DiagnosticsRequest,
    ) -> Result<ReceiverStream<Result<pb::DiagnosticsChunk, Status>>, Status> {
        let parts = select_parts(&req.parts)
            .map_err(|e| Status::invalid_argument(format!("parts: {e}")))?;
        let limits = Limits::from_request(&req)?;
        let (out_tx, out_rx) = mpsc::channel(OUT_CHUNKS);
        let (member_tx, member_rx) = mpsc::channel(1);
        let node = self.config.node_name.clone();
        let created = now_unix_ms();
        let prefix = format!("{node}-{created}");
        let mtime = u64::try_from(created / 1000).unwrap_or(0);
        tokio::task::spawn_blocking(move || bundle::write(member_rx, out_tx, &prefix, mtime));
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let started = Instant::now();
            let manifest = this.gather_all(&parts, limits, created, &member_tx).await;
            if let Some(manifest) = manifest {
                let summary = manifest.summary();
                if member_tx
                    .send(Member::Finish(Box::new(manifest)))
                    .await
                    .is_ok()
                {
                    info!(
                        ok = summary.parts_ok,
                        failed = summary.parts_failed,
                        skipped = summary.parts_skipped,
                        took_ms = started.elapsed().as_millis() as u64,
                        "diagnostics bundle gathered"
                    );
                    return;
                }
            }
            warn!("diagnostics bundle abandoned: the caller stopped reading");
        });
        Ok(ReceiverStream::new(out_rx))
    }

    /// Gathers every part into the writer; `None` when the writer is gone (caller left).
    async fn gather_all(
        &self,
        parts: &[&'static str],
        limits: Limits,
        created: i64,
        out: &mpsc::Sender<Member>,
    ) -> Option<Manifest> {
        let mut budget = Budget::new(limits.max_bundle_bytes);
        let cap = usize::try_from(limits.max_part_bytes).unwrap_or(usize::MAX);
        let mut entries = Vec::with_capacity(parts.len());
        for part in parts {
            let started = Instant::now();
            if budget.exhausted() {
                entries.push(PartEntry::new(
                    part,
                    PartStatus::Skipped,
                    "the bundle size cap was reached before this part",
                    Duration::ZERO,
                ));
                continue;
            }
            let gathered = tokio::time::timeout(limits.part_timeout, self.gather(part, cap)).await;
            let took = started.elapsed();
            let entry = match gathered {
                Err(_) => PartEntry::new(
                    part,
                    PartStatus::Failed,
                    &format!(
                        "timed out after {:?} (the part's time cap)",
                        limits.part_timeout
                    ),
                    took,
                ),
                Ok(Err(reason)) => PartEntry::new(part, PartStatus::Failed, &reason, took),
                Ok(Ok(Gathered::Skipped(reason))) => {
                    PartEntry::new(part, PartStatus::Skipped, &reason, took)
                }
                Ok(Ok(Gathered::Files(files, notes))) => {
                    let mut entry = PartEntry::new(part, PartStatus::Ok, &notes.join("; "), took);
                    // Redaction is CPU work over up to a part's cap: off the async thread, so
                    // the agent's other calls (one runtime thread) are not held up by it.
                    let Ok(redacted) = tokio::task::spawn_blocking(move || {
                        files
                            .into_iter()
                            .map(|file| {
                                let (data, n) = redact::redact_bytes(&file.data);
                                (file.name, data, n, file.truncated)
                            })
                            .collect::<Vec<_>>()
                    })
                    .await
                    else {
                        // Nothing unredacted may be written: the part is dropped whole.
                        let why = "the redaction filter stopped; the part is left out";
                        entries.push(PartEntry::new(part, PartStatus::Failed, why, took));
                        continue;
                    };
                    // Files cut by the part's size cap (the gatherer says which) and by what
                    // was left of the bundle's, named in the reason.
                    let (mut part_cut, mut bundle_cut) = (Vec::new(), Vec::new());
                    for (name, mut data, redactions, mut truncated) in redacted {
                        entry.redactions += redactions;
                        if truncated {
                            part_cut.push(name.clone());
                        }
                        let fit = budget.take(data.len() as u64);
                        if fit < data.len() as u64 {
                            data.truncate(usize::try_from(fit).unwrap_or(0));
                            truncated = true;
                            bundle_cut.push(name.clone());
                            if fit == 0 {
                                entry.truncated = true;
                                continue;
                            }
                        }
                        entry.truncated |= truncated;
                        entry.bytes += data.len() as u64;
                        entry.files.push(FileEntry {
                            name: name.clone(),
                            bytes: data.len() as u64,
                            truncated,
                        });
                        out.send(Member::File { name, data }).await.ok()?;
                    }
                    if entry.truncated {
                        entry.reason = truncated_reason(&entry.reason, &part_cut, &bundle_cut);
                    }
                    entry
                }
            };
            entries.push(entry);
        }
        Some(Manifest {
            node: self.config.node_name.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            created_at_unix_ms: created,
            max_bundle_bytes: limits.max_bundle_bytes,
            max_part_bytes: limits.max_part_bytes,
            part_timeout_ms: u32::try_from(limits.part_timeout.as_millis()).unwrap_or(u32::MAX),
            parts: entries,
        })
    }
}

#[cfg(test)]
mod tests;
