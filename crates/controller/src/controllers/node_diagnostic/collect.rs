//! One node's bundle, from the agent's stream to the controller's disk: chunks are written as
//! they arrive (never gathered in memory), hashed with SHA-256 on the way, bounded in size and
//! time, written to a `.partial` file and renamed into place only when the agent's summary (its
//! last chunk) has arrived, so a download never sees half a bundle. A fresh download token is
//! recorded beside it just before (see [`super::store`]).

use std::path::Path;
use std::time::Duration;

use futures::StreamExt as _;
use nodekeeper_proto::agent::v1 as pb;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use super::store::{self, BundleStore};
use crate::shared::agents::DiagnosticsStream;

/// A bundle stored on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub size: u64,
    pub sha256: String,
    pub summary: pb::DiagnosticsSummary,
    /// The bundle's download token (the last segment of its download path).
    pub token: String,
}

/// Writes `stream` to `path` within `deadline`, refusing more than `max_bytes`. On any failure
/// the partial file is removed and the reason returned.
pub async fn to_file(
    stream: DiagnosticsStream,
    path: &Path,
    max_bytes: u64,
    deadline: Duration,
) -> Result<Stored, String> {
    let partial = BundleStore::partial_path(path);
    let result = tokio::time::timeout(deadline, write(stream, &partial, max_bytes))
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "the bundle did not arrive within {deadline:?} (--diagnostics-timeout)"
            ))
        });
    match result {
        Ok(mut stored) => {
            // The token first: a bundle in place without its token would not be served.
            stored.token = store::new_token();
            if let Err(e) = BundleStore::write_token(path, &stored.token).await {
                let _ = tokio::fs::remove_file(&partial).await;
                return Err(format!(
                    "store the download token of {}: {e}",
                    path.display()
                ));
            }
            tokio::fs::rename(&partial, path)
                .await
                .map_err(|e| format!("store bundle {}: {e}", path.display()))?;
            BundleStore::clear_evicted(path);
            Ok(stored)
        }
        Err(reason) => {
            let _ = tokio::fs::remove_file(&partial).await;
            Err(reason)
        }
    }
}

async fn write(
    mut stream: DiagnosticsStream,
    partial: &Path,
    max_bytes: u64,
) -> Result<Stored, String> {
    if let Some(dir) = partial.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| format!("create {}: {e}", dir.display()))?;
    }
    let mut file = tokio::fs::File::create(partial)
        .await
        .map_err(|e| format!("create {}: {e}", partial.display()))?;
    let mut hasher = Sha256::new();
    let mut size: u64 = 0;
    let mut summary = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("agent stream broke after {size} bytes: {e}"))?;
        if summary.is_some() {
            return Err("the agent sent data after its last chunk".into());
        }
        size += chunk.data.len() as u64;
        if size > max_bytes {
            return Err(format!(
                "the agent sent more than the bundle cap of {max_bytes} bytes \
                 (diagnostics.maxBundleBytes); stopped"
            ));
        }
        hasher.update(&chunk.data);
        file.write_all(&chunk.data)
            .await
            .map_err(|e| format!("write {}: {e}", partial.display()))?;
        summary = chunk.summary;
    }
    let Some(summary) = summary else {
        return Err(format!(
            "the agent's stream ended after {size} bytes without the bundle's summary: incomplete"
        ));
    };
    file.flush()
        .await
        .map_err(|e| format!("write {}: {e}", partial.display()))?;
    Ok(Stored {
        size,
        sha256: hex::encode(hasher.finalize()),
        summary,
        token: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::agent_client::{CallError, CallOutcome};

    fn chunks(items: Vec<Result<pb::DiagnosticsChunk, CallError>>) -> DiagnosticsStream {
        futures::stream::iter(items).boxed()
    }

    fn data(bytes: &[u8]) -> Result<pb::DiagnosticsChunk, CallError> {
        Ok(pb::DiagnosticsChunk {
            data: bytes.to_vec(),
            summary: None,
        })
    }

    fn last() -> Result<pb::DiagnosticsChunk, CallError> {
        Ok(pb::DiagnosticsChunk {
            data: b"end".to_vec(),
            summary: Some(pb::DiagnosticsSummary::default()),
        })
    }

    #[tokio::test]
    async fn stores_and_hashes_a_complete_stream() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ns/d/n1.tar.gz");
        let stored = to_file(
            chunks(vec![data(b"ab"), data(b"c"), last()]),
            &path,
            100,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abcend");
        assert_eq!(stored.size, 6);
        assert_eq!(stored.sha256, hex::encode(Sha256::digest(b"abcend")));
        assert_eq!(stored.token.len(), 32, "{}", stored.token);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("ns/d/n1.token")).unwrap(),
            stored.token
        );
    }

    #[tokio::test]
    async fn refuses_incomplete_oversized_and_broken_streams_leaving_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n1.tar.gz");
        let broken = Err(CallError {
            outcome: CallOutcome::Status,
            endpoint: "127.0.0.1:1".parse().unwrap(),
            detail: "Internal: boom".into(),
        });
        for (items, want) in [
            (vec![data(b"ab")], "without the bundle's summary"),
            (
                vec![data(&[0; 64]), data(&[0; 64]), last()],
                "bundle cap of 100",
            ),
            (vec![data(b"ab"), broken], "broke after 2 bytes"),
        ] {
            let err = to_file(chunks(items), &path, 100, Duration::from_secs(5))
                .await
                .unwrap_err();
            assert!(err.contains(want), "{err}");
            assert!(!path.exists() && !BundleStore::partial_path(&path).exists());
        }
    }
}
