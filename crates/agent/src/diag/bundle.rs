//! The bundle as it streams: a `.tar.gz` written on a blocking thread into fixed-size chunks that
//! go straight to the gRPC response (so at most one part and a few chunks are in memory), the
//! size budget that keeps the whole bundle under its cap, and the manifest written last.

use std::io::Write;
use std::time::Duration;

use flate2::Compression;
use flate2::write::GzEncoder;
use nodekeeper_proto::agent::v1 as pb;
use serde::Serialize;
use tokio::sync::mpsc;
use tonic::Status;

/// Size of one streamed chunk.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// Kept free in every bundle for the manifest, the tar trailer and gzip's framing, so that the
/// compressed bundle never exceeds its cap (deflate adds at most a few bytes per 16 KiB block on
/// incompressible input; the manifest is bounded by [`MAX_REASON_BYTES`] per entry).
pub const RESERVE_BYTES: u64 = 48 * 1024;
/// A reason in the manifest is cut to this many bytes.
pub const MAX_REASON_BYTES: usize = 512;
/// The tar header and padding of one member, in bytes.
const TAR_BLOCK: u64 = 512;

/// How a part ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PartStatus {
    Ok,
    Failed,
    Skipped,
}

/// One file of a part, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub truncated: bool,
}

/// One part's line in the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PartEntry {
    pub name: String,
    pub status: PartStatus,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Uncompressed bytes stored for this part.
    pub bytes: u64,
    pub duration_ms: u64,
    /// Secrets replaced by the redaction filter.
    pub redactions: usize,
    /// Cut short by the part or bundle size cap.
    pub truncated: bool,
    pub files: Vec<FileEntry>,
}

impl PartEntry {
    pub fn new(name: &str, status: PartStatus, reason: &str, took: Duration) -> Self {
        Self {
            name: name.to_owned(),
            status,
            reason: nodekeeper_model::text::truncate(reason, MAX_REASON_BYTES).into_owned(),
            bytes: 0,
            duration_ms: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
            redactions: 0,
            truncated: false,
            files: Vec::new(),
        }
    }
}

/// `manifest.json`, the bundle's last member.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub node: String,
    pub agent_version: String,
    pub created_at_unix_ms: i64,
    pub max_bundle_bytes: u64,
    pub max_part_bytes: u64,
    pub part_timeout_ms: u32,
    pub parts: Vec<PartEntry>,
}

impl Manifest {
    pub fn summary(&self) -> pb::DiagnosticsSummary {
        let count = |s: PartStatus| {
            u32::try_from(self.parts.iter().filter(|p| p.status == s).count()).unwrap_or(u32::MAX)
        };
        pb::DiagnosticsSummary {
            bundle_bytes: 0,
            parts_ok: count(PartStatus::Ok),
            parts_failed: count(PartStatus::Failed),
            parts_skipped: count(PartStatus::Skipped),
            parts_truncated: u32::try_from(self.parts.iter().filter(|p| p.truncated).count())
                .unwrap_or(u32::MAX),
        }
    }
}

/// The uncompressed space left in a bundle. Every member costs its tar header and padding too.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    left: u64,
}

impl Budget {
    pub fn new(max_bundle_bytes: u64) -> Self {
        Self {
            left: max_bundle_bytes.saturating_sub(RESERVE_BYTES + 2 * TAR_BLOCK),
        }
    }

    /// How many of `len` bytes fit as one more member (0 when not even the header fits), and
    /// takes that space.
    pub fn take(&mut self, len: u64) -> u64 {
        if self.left <= TAR_BLOCK {
            return 0;
        }
        let fit = len.min(self.left - TAR_BLOCK);
        self.left -= TAR_BLOCK + fit.div_ceil(TAR_BLOCK) * TAR_BLOCK;
        fit
    }

    pub fn exhausted(&self) -> bool {
        self.left <= TAR_BLOCK
    }
}

/// What the gathering task hands to the writer thread.
pub enum Member {
    File {
        name: String,
        data: Vec<u8>,
    },
    /// The manifest (written last), then the final chunk carrying the summary.
    Finish(Box<Manifest>),
}

/// `std::io::Write` into the response stream, [`CHUNK_BYTES`] at a time. A closed stream (the
/// controller went away) is a `BrokenPipe` error, which stops the writer.
struct ChunkSink {
    out: mpsc::Sender<Result<pb::DiagnosticsChunk, Status>>,
    buf: Vec<u8>,
    written: u64,
}

impl ChunkSink {
    fn send(&mut self, summary: Option<pb::DiagnosticsSummary>) -> std::io::Result<()> {
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK_BYTES));
        self.out
            .blocking_send(Ok(pb::DiagnosticsChunk { data, summary }))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }
}

impl Write for ChunkSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(CHUNK_BYTES - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        self.written += n as u64;
        if self.buf.len() == CHUNK_BYTES {
            self.send(None)?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn append(
    tar: &mut tar::Builder<GzEncoder<ChunkSink>>,
    name: &str,
    data: &[u8],
    mtime: u64,
) -> std::io::Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(mtime);
    header.set_entry_type(tar::EntryType::Regular);
    tar.append_data(&mut header, name, data)
}

/// The writer thread's body: appends members as they arrive, then the manifest, then sends the
/// last chunk with the summary. Returns when the bundle is complete or the stream is gone.
pub fn write(
    mut members: mpsc::Receiver<Member>,
    out: mpsc::Sender<Result<pb::DiagnosticsChunk, Status>>,
    prefix: &str,
    mtime: u64,
) {
    let sink = ChunkSink {
        out: out.clone(),
        buf: Vec::with_capacity(CHUNK_BYTES),
        written: 0,
    };
    let mut tar = tar::Builder::new(GzEncoder::new(sink, Compression::default()));
    let result = (|| -> std::io::Result<()> {
        while let Some(member) = members.blocking_recv() {
            match member {
                Member::File { name, data } => {
                    append(&mut tar, &format!("{prefix}/{name}"), &data, mtime)?;
                }
                Member::Finish(manifest) => {
                    let json = serde_json::to_vec_pretty(&*manifest)
                        .map_err(|e| std::io::Error::other(e.to_string()))?;
                    append(&mut tar, &format!("{prefix}/manifest.json"), &json, mtime)?;
                    let mut sink = tar.into_inner()?.finish()?;
                    let mut summary = manifest.summary();
                    summary.bundle_bytes = sink.written;
                    return sink.send(Some(summary));
                }
            }
        }
        // The gathering task ended without a manifest: it was cancelled.
        Err(std::io::Error::from(std::io::ErrorKind::Interrupted))
    })();
    if let Err(error) = result
        && error.kind() != std::io::ErrorKind::BrokenPipe
    {
        let _ = out.blocking_send(Err(Status::internal(format!(
            "write diagnostics bundle: {error}"
        ))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_counts_headers_and_padding() {
        let mut b = Budget::new(RESERVE_BYTES + 1024 + 4096);
        assert_eq!(b.take(100), 100); // 512 + 512
        assert_eq!(b.take(10_000), 3072 - 512); // 3072 left, less its header
        assert!(b.exhausted());
        assert_eq!(b.take(1), 0);
    }
}
