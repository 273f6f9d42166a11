//! The bundles on the controller's own disk (`--diagnostics-dir`): one file per node under
//! `<dir>/<namespace>/<name>/<node>.tar.gz` (beside them `.uid`, the owning object's UID, for
//! the sweep when a replica starts leading), a bound on their total size (oldest bundles of other
//! NodeDiagnostics evicted to make room, only when that suffices; a bundle that still does not
//! fit is refused), and the
//! HTTP route that streams a bundle from disk (`/api/diagnostics/{namespace}/{name}/{node}/{token}`).
//!
//! The HTTP API has no authentication of its own (the API server's service proxy passes on no
//! credentials), and a bundle holds logs and configuration. So each bundle gets a download token
//! when it is stored: 128 random bits, kept beside it in `<node>.token` (on the same disk, so it
//! lives and dies with the bundle, across restarts of the process) and published only in the
//! NodeDiagnostic's `status.nodes[].downloadPath`. Whoever may `get` the NodeDiagnostic can
//! download its bundles; anyone else who reaches port 8080 gets the same 404 as for a bundle that
//! does not exist, the token compared in constant time. A bundle with no token file (stored by a
//! controller from before tokens) is never served: its status path is guessable, and
//! [`BundleStore::missing_bundle`] has the reconciler withdraw it from the status.
//!
//! The store is configured when the controllers start (it needs the flags), but its route is part
//! of the HTTP API from the process's start, so it answers 503 until then.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::SystemTime;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use tracing::info;

/// Suffix of a complete bundle.
const BUNDLE: &str = "tar.gz";
/// Suffix of a bundle being written.
const PARTIAL: &str = "tar.gz.partial";
/// Suffix of the marker left where a bundle was evicted, so its download says so.
const EVICTED: &str = "tar.gz.evicted";
/// Suffix of the file holding a bundle's download token.
const TOKEN: &str = "token";
/// Suffix of a token being written (renamed over [`TOKEN`], so a reader never sees half a token).
const PARTIAL_TOKEN: &str = "token.partial";
/// Random bytes in a download token: 128 bits, written as 32 hex digits.
const TOKEN_BYTES: usize = 16;
/// The file in an object's directory naming the UID of the NodeDiagnostic whose bundles it
/// holds (a node name never starts with a dot, so no bundle is named so).
const OWNER: &str = ".uid";

#[derive(Debug)]
struct Settings {
    dir: PathBuf,
    max_total_bytes: u64,
}

/// Shared by the controller (writes, evicts, deletes) and the HTTP route (reads).
#[derive(Clone, Default)]
pub struct BundleStore {
    settings: Arc<OnceLock<Settings>>,
    /// Bytes promised to bundles being written, per object directory (each bundle is promised
    /// its cap until it is done; its `.partial` file grows inside that promise).
    reserved: Arc<Mutex<HashMap<PathBuf, u64>>>,
}

/// Not enough room even after evicting every other bundle. Nothing is evicted when evicting
/// could not make the room; `evicted` lists what was (a bundle that could not be deleted left
/// the room short).
#[derive(Debug, thiserror::Error)]
#[error(
    "the controller's diagnostics store is full: {used} bytes stored or being written, {want} more \
     needed, limit {max} (--diagnostics-max-bytes); delete finished NodeDiagnostics or raise the limit"
)]
pub struct StoreFull {
    pub used: u64,
    pub want: u64,
    pub max: u64,
    /// Bundles evicted before the room was found short, as `<namespace>/<name>/<node>`.
    pub evicted: Vec<String>,
}

/// Room held for one bundle being written; given back when dropped.
pub struct Reservation {
    store: BundleStore,
    /// The object directory the room is held in.
    object: PathBuf,
    bytes: u64,
    /// Bundles evicted to make this room, as `<namespace>/<name>/<node>`.
    pub evicted: Vec<String>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut reserved = self
            .store
            .reserved
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = reserved.get_mut(&self.object) {
            *held = held.saturating_sub(self.bytes);
            if *held == 0 {
                reserved.remove(&self.object);
            }
        }
    }
}

/// `<dir>/<node>.<suffix>` beside `<dir>/<node>.tar.gz`.
fn beside(bundle: &Path, suffix: &str) -> PathBuf {
    let name = bundle
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let node = name.strip_suffix(&format!(".{BUNDLE}")).unwrap_or(&name);
    bundle.with_file_name(format!("{node}.{suffix}"))
}

/// A fresh download token: 128 bits from `rand`'s thread-local generator (a CSPRNG, ChaCha12
/// seeded and periodically reseeded from the operating system), as lowercase hex.
pub fn new_token() -> String {
    hex::encode(rand::random::<[u8; TOKEN_BYTES]>())
}

/// Whether `given` is the `recorded` token. The comparison takes the same time wherever the
/// first differing byte is, so the answer's timing cannot be used to guess a token byte by byte;
/// only the lengths (public: every token is 32 hex digits) decide early. An empty record matches
/// nothing.
pub fn token_matches(recorded: &str, given: &str) -> bool {
    !recorded.is_empty() && constant_time_eq(recorded.as_bytes(), given.as_bytes())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    // `black_box` at every step keeps the optimiser from turning the fold into an early exit.
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| std::hint::black_box(acc | (x ^ y)));
    diff == 0
}

/// A path segment we accept: what Kubernetes allows in namespace, object and node names.
pub fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl BundleStore {
    /// Sets the directory and the total limit. Called once; the directory is created when the
    /// first bundle is written, so a controller that never collects leaves no trace on disk.
    pub fn configure(&self, dir: &Path, max_total_bytes: u64) -> std::io::Result<()> {
        if !dir.is_absolute() {
            return Err(std::io::Error::other(format!(
                "--diagnostics-dir {} is not an absolute path",
                dir.display()
            )));
        }
        // A partial file left by an earlier process (stopped mid-collection) is never completed
        // and never evicted (only complete bundles are): it would hold its bytes for good.
        for (path, _, _, complete) in Self::files(dir) {
            if !complete {
                let _ = std::fs::remove_file(path);
            }
        }
        let _ = self.settings.set(Settings {
            dir: dir.to_path_buf(),
            max_total_bytes,
        });
        Ok(())
    }

    fn settings(&self) -> Option<&Settings> {
        self.settings.get()
    }

    /// `<dir>/<namespace>/<name>`.
    pub fn object_dir(&self, ns: &str, name: &str) -> Option<PathBuf> {
        Some(self.settings()?.dir.join(ns).join(name))
    }

    /// `<dir>/<namespace>/<name>/<node>.tar.gz`.
    pub fn bundle_path(&self, ns: &str, name: &str, node: &str) -> Option<PathBuf> {
        Some(self.object_dir(ns, name)?.join(format!("{node}.{BUNDLE}")))
    }

    /// Where a bundle is written before it is complete.
    pub fn partial_path(bundle: &Path) -> PathBuf {
        beside(bundle, PARTIAL)
    }

    /// Records `token` as the download token of the bundle about to be stored at `bundle`
    /// (written before the bundle is renamed into place, so a complete bundle always has one).
    pub async fn write_token(bundle: &Path, token: &str) -> std::io::Result<()> {
        let partial = beside(bundle, PARTIAL_TOKEN);
        tokio::fs::write(&partial, token).await?;
        tokio::fs::rename(&partial, beside(bundle, TOKEN)).await
    }

    /// The download token recorded for `bundle`, if any.
    async fn read_token(bundle: &Path) -> Option<String> {
        let token = tokio::fs::read_to_string(beside(bundle, TOKEN))
            .await
            .ok()?;
        Some(token.trim().to_owned())
    }

    /// Forgets an earlier eviction of `bundle` (a new one was just written there).
    pub fn clear_evicted(bundle: &Path) {
        let _ = std::fs::remove_file(beside(bundle, EVICTED));
    }

    /// Why the stored bundle of `node` for `<ns>/<name>` can no longer be downloaded, or `None`
    /// while it is on disk: evicted for newer bundles (the marker says so), stored without a
    /// download token (by a controller from before tokens; never served, see the module doc), or
    /// simply gone (this controller restarted without its disk, or another replica took over the
    /// lead).
    pub fn missing_bundle(&self, ns: &str, name: &str, node: &str) -> Option<&'static str> {
        let path = self.bundle_path(ns, name, node)?;
        if path.exists() && beside(&path, TOKEN).exists() {
            None
        } else if path.exists() {
            Some(
                "bundle stored by an earlier controller version, without a download token, so it \
                 is not served; create a new NodeDiagnostic to collect again",
            )
        } else if beside(&path, EVICTED).exists() {
            Some(
                "bundle evicted to make room for newer bundles (--diagnostics-max-bytes); create \
                 a new NodeDiagnostic to collect again",
            )
        } else {
            Some(
                "bundle no longer on the controller serving downloads (restarted without its \
                 disk, or another replica leads now); create a new NodeDiagnostic to collect again",
            )
        }
    }

    /// Records that `<ns>/<name>`'s directory holds the bundles of the NodeDiagnostic `uid`
    /// (see [`BundleStore::sweep`]), creating the directory.
    pub fn set_owner(&self, ns: &str, name: &str, uid: &str) -> std::io::Result<()> {
        let Some(dir) = self.object_dir(ns, name) else {
            return Ok(());
        };
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(OWNER), uid)
    }

    /// Deletes the directory of every object that `keep` (given namespace, name and the UID
    /// recorded by [`BundleStore::set_owner`], if any) does not keep; returns them as
    /// `<namespace>/<name>`. Run when this replica starts leading: a NodeDiagnostic deleted
    /// while another replica led had its finalizer run there, and its bundles here would stay,
    /// still downloadable, for good.
    pub fn sweep(&self, keep: impl Fn(&str, &str, Option<&str>) -> bool) -> Vec<String> {
        let Some(settings) = self.settings() else {
            return Vec::new();
        };
        let names = |d: &Path| -> Vec<(String, PathBuf)> {
            std::fs::read_dir(d)
                .map(|it| {
                    it.flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut removed = Vec::new();
        for (ns, ns_dir) in names(&settings.dir) {
            for (name, dir) in names(&ns_dir) {
                let owner = std::fs::read_to_string(dir.join(OWNER)).ok();
                let owner = owner.as_deref().map(str::trim);
                if keep(&ns, &name, owner) {
                    continue;
                }
                if std::fs::remove_dir_all(&dir).is_ok() {
                    info!(object = %format!("{ns}/{name}"), "diagnostics bundles of a deleted nodediagnostic removed");
                    removed.push(format!("{ns}/{name}"));
                }
            }
            // An emptied namespace directory goes too (fails harmlessly while it holds any).
            let _ = std::fs::remove_dir(&ns_dir);
        }
        removed
    }

    /// Deletes every bundle of one NodeDiagnostic.
    pub fn remove_object(&self, ns: &str, name: &str) -> std::io::Result<()> {
        let Some(dir) = self.object_dir(ns, name) else {
            return Ok(());
        };
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every bundle file on disk: (path, bytes, modified), complete and partial.
    fn files(dir: &Path) -> Vec<(PathBuf, u64, SystemTime, bool)> {
        let mut out = Vec::new();
        let level = |d: &Path| -> Vec<PathBuf> {
            std::fs::read_dir(d)
                .map(|it| it.flatten().map(|e| e.path()).collect())
                .unwrap_or_default()
        };
        for ns in level(dir) {
            for obj in level(&ns) {
                for file in level(&obj) {
                    let name = file.to_string_lossy();
                    let complete = name.ends_with(&format!(".{BUNDLE}"));
                    if !complete && !name.ends_with(&format!(".{PARTIAL}")) {
                        continue;
                    }
                    if let Ok(m) = file.metadata() {
                        let modified = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                        out.push((file, m.len(), modified, complete));
                    }
                }
            }
        }
        out
    }

    /// Bytes of bundles on disk.
    pub fn used_bytes(&self) -> u64 {
        self.settings()
            .map(|s| Self::files(&s.dir).iter().map(|f| f.1).sum())
            .unwrap_or(0)
    }

    /// Holds `want` bytes for a bundle of `<ns>/<name>`, evicting the oldest complete bundles of
    /// other NodeDiagnostics while the total would pass the limit, and only when evicting them
    /// makes the room (else nothing is evicted and the bundle is refused). The total is the
    /// complete bundles on disk plus, per object, the larger of its `.partial` files and the room
    /// held for it: a bundle being written counts once, at its cap.
    pub fn reserve(&self, ns: &str, name: &str, want: u64) -> Result<Reservation, StoreFull> {
        let Some(settings) = self.settings() else {
            return Err(StoreFull {
                used: 0,
                want,
                max: 0,
                evicted: Vec::new(),
            });
        };
        let mut reserved = self.reserved.lock().unwrap_or_else(PoisonError::into_inner);
        let files = Self::files(&settings.dir);
        let mut partial: HashMap<PathBuf, u64> = HashMap::new();
        for (path, bytes, _, complete) in &files {
            if !complete && let Some(object) = path.parent() {
                *partial.entry(object.to_path_buf()).or_default() += bytes;
            }
        }
        let in_flight: u64 = partial
            .keys()
            .chain(reserved.keys())
            .collect::<std::collections::HashSet<_>>()
            .into_iter()
            .map(|object| {
                let on_disk = partial.get(object).copied().unwrap_or(0);
                on_disk.max(reserved.get(object).copied().unwrap_or(0))
            })
            .sum();
        let complete: u64 = files.iter().filter(|f| f.3).map(|f| f.1).sum();
        let mut used = complete + in_flight;
        let own = settings.dir.join(ns).join(name);
        let mut candidates: Vec<_> = files
            .into_iter()
            .filter(|f| f.3 && !f.0.starts_with(&own))
            .collect();
        candidates.sort_by_key(|f| f.2);
        let full = |used, evicted| StoreFull {
            used,
            want,
            max: settings.max_total_bytes,
            evicted,
        };
        let evictable: u64 = candidates.iter().map(|f| f.1).sum();
        if (used + want).saturating_sub(settings.max_total_bytes) > evictable {
            return Err(full(used, Vec::new()));
        }
        let mut evicted = Vec::new();
        let mut candidates = candidates.into_iter();
        while used + want > settings.max_total_bytes {
            let Some((path, bytes, _, _)) = candidates.next() else {
                // A bundle that could not be deleted: the room is short after all.
                return Err(full(used, evicted));
            };
            if std::fs::remove_file(&path).is_ok() {
                let _ = std::fs::write(beside(&path, EVICTED), b"");
                used -= bytes;
                let rel = path
                    .strip_prefix(&settings.dir)
                    .unwrap_or(&path)
                    .to_string_lossy()
                    .trim_end_matches(&format!(".{BUNDLE}"))
                    .to_owned();
                info!(bundle = %rel, bytes, "diagnostics bundle evicted to make room");
                evicted.push(rel);
            }
        }
        *reserved.entry(own.clone()).or_default() += want;
        Ok(Reservation {
            store: self.clone(),
            object: own,
            bytes: want,
            evicted,
        })
    }

    /// The download route.
    pub fn router(&self) -> Router {
        Router::new()
            .route(
                "/api/diagnostics/{namespace}/{name}/{node}/{token}",
                get(download),
            )
            // The path without a token (an older controller's status, or a guess) answers as a
            // wrong token does, rather than the router's bare 404.
            .route(
                "/api/diagnostics/{namespace}/{name}/{node}",
                get(download_without_token),
            )
            .with_state(self.clone())
    }
}

fn error(code: StatusCode, message: String) -> Response {
    (code, axum::Json(json!({ "error": message }))).into_response()
}

/// The same answer for a bundle that does not exist and for a wrong or missing token, so that
/// without the token nobody learns whether a bundle exists.
fn not_found(ns: &str, name: &str, node: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!(
            "no diagnostics bundle of node {node} for nodediagnostic {ns}/{name} at this path; \
             download from the path in the NodeDiagnostic's status.nodes[].downloadPath"
        ),
    )
}

async fn download_without_token(
    State(store): State<BundleStore>,
    UrlPath((ns, name, node)): UrlPath<(String, String, String)>,
) -> Response {
    serve(&store, &ns, &name, &node, None).await
}

async fn download(
    State(store): State<BundleStore>,
    UrlPath((ns, name, node, token)): UrlPath<(String, String, String, String)>,
) -> Response {
    serve(&store, &ns, &name, &node, Some(&token)).await
}

/// Streams the bundle from disk in 64 KiB reads (the controller never holds a whole bundle), if
/// `token` is the one recorded for it.
async fn serve(
    store: &BundleStore,
    ns: &str,
    name: &str,
    node: &str,
    token: Option<&str>,
) -> Response {
    if ![ns, name, node].iter().all(|s| valid_segment(s)) {
        return error(
            StatusCode::BAD_REQUEST,
            "namespace, name and node must be Kubernetes names (lowercase letters, digits, '-', '.')".into(),
        );
    }
    let Some(path) = store.bundle_path(ns, name, node) else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this replica does not lead and holds no diagnostics bundles; ask the leader".into(),
        );
    };
    let recorded = BundleStore::read_token(&path).await.unwrap_or_default();
    if !token.is_some_and(|t| token_matches(&recorded, t)) {
        return not_found(ns, name, node);
    }
    match tokio::fs::File::open(&path).await {
        Ok(file) => {
            let len = file.metadata().await.map(|m| m.len()).ok();
            let body =
                Body::from_stream(tokio_util::io::ReaderStream::with_capacity(file, 64 * 1024));
            let mut response = Response::new(body);
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/gzip"),
            );
            if let Some(len) = len {
                headers.insert(header::CONTENT_LENGTH, len.into());
            }
            if let Ok(v) = header::HeaderValue::from_str(&format!(
                "attachment; filename=\"{ns}-{name}-{node}.tar.gz\""
            )) {
                headers.insert(header::CONTENT_DISPOSITION, v);
            }
            response
        }
        Err(_) if beside(&path, EVICTED).exists() => error(
            StatusCode::GONE,
            format!(
                "the bundle of node {node} for nodediagnostic {ns}/{name} was evicted to make room \
                 for newer bundles (--diagnostics-max-bytes); create a new NodeDiagnostic"
            ),
        ),
        Err(_) => not_found(ns, name, node),
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    fn put(store: &BundleStore, ns: &str, name: &str, node: &str, bytes: usize) {
        let p = store.bundle_path(ns, name, node).unwrap();
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(beside(&p, TOKEN), new_token()).unwrap();
        std::fs::write(&p, vec![0u8; bytes]).unwrap();
        // Distinct modification times, oldest first.
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    #[test]
    fn a_missing_bundle_says_whether_it_was_evicted_or_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        put(&store, "ns", "old", "n1", 600);
        put(&store, "ns", "kept", "n1", 10);
        assert_eq!(store.missing_bundle("ns", "kept", "n1"), None);
        let why = store.missing_bundle("ns", "kept", "n2").unwrap();
        assert!(why.contains("no longer on the controller"), "{why}");
        let r = store.reserve("ns", "new", 500).unwrap();
        assert_eq!(r.evicted, vec!["ns/old/n1".to_string()]);
        let why = store.missing_bundle("ns", "old", "n1").unwrap();
        assert!(why.contains("evicted to make room"), "{why}");
        assert_eq!(store.missing_bundle("ns", "kept", "n1"), None);
    }

    #[test]
    fn evicts_the_oldest_bundles_of_other_objects_then_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        put(&store, "ns", "old", "n1", 300);
        put(&store, "ns", "mid", "n1", 300);
        put(&store, "ns", "mine", "n1", 300);
        assert_eq!(store.used_bytes(), 900);

        let r = store.reserve("ns", "mine", 400).unwrap();
        assert_eq!(r.evicted, vec!["ns/old/n1".to_string()]);
        assert!(!store.bundle_path("ns", "old", "n1").unwrap().exists());
        assert!(dir.path().join("ns/old/n1.tar.gz.evicted").exists());
        // Held room counts: another 500 would need "mid" gone and more, and this object's own
        // bundle is never evicted for itself: refused, and "mid" is left alone.
        let err = store.reserve("ns", "mine", 500).err().unwrap();
        assert!(err.to_string().contains("--diagnostics-max-bytes"), "{err}");
        assert!(err.evicted.is_empty(), "{:?}", err.evicted);
        assert!(store.bundle_path("ns", "mid", "n1").unwrap().exists());
        drop(r);
        let r = store.reserve("ns", "mine", 700).unwrap();
        assert_eq!(r.evicted, vec!["ns/mid/n1".to_string()]);
    }

    #[test]
    fn a_bundle_being_written_counts_once_and_nothing_is_evicted_in_vain() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        put(&store, "ns", "other", "n1", 200);
        // "a" is writing a bundle: 400 held, 300 of it on disk so far.
        let a = store.reserve("ns", "a", 400).unwrap();
        let bundle = store.bundle_path("ns", "a", "n1").unwrap();
        std::fs::create_dir_all(bundle.parent().unwrap()).unwrap();
        std::fs::write(BundleStore::partial_path(&bundle), vec![0u8; 300]).unwrap();

        // 200 + 400 + 300 fits: nothing evicted.
        let b = store.reserve("ns", "b", 300).unwrap();
        assert!(b.evicted.is_empty(), "{:?}", b.evicted);
        assert!(store.bundle_path("ns", "other", "n1").unwrap().exists());
        // 600 more cannot fit even with "other" gone: refused, and "other" stays.
        let err = store.reserve("ns", "c", 600).err().unwrap();
        assert_eq!((err.used, err.want), (900, 600), "{err}");
        assert!(err.evicted.is_empty(), "{:?}", err.evicted);
        assert!(store.bundle_path("ns", "other", "n1").unwrap().exists());
        // 150 more fits once "other" is gone.
        let c = store.reserve("ns", "c", 150).unwrap();
        assert_eq!(c.evicted, vec!["ns/other/n1".to_string()]);
        // The partial of a collection that was dropped (its object deleted) still counts until
        // the finalizer deletes it.
        drop((a, b, c));
        let err = store.reserve("ns", "d", 800).err().unwrap();
        assert_eq!(err.used, 300, "{err}");
    }

    #[test]
    fn partial_files_of_an_earlier_process_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let first = BundleStore::default();
        first.configure(dir.path(), 1000).unwrap();
        put(&first, "ns", "done", "n1", 100);
        let bundle = first.bundle_path("ns", "cut", "n1").unwrap();
        std::fs::create_dir_all(bundle.parent().unwrap()).unwrap();
        std::fs::write(BundleStore::partial_path(&bundle), vec![0u8; 800]).unwrap();
        assert_eq!(first.used_bytes(), 900);
        // The next process: the cut-off collection's bytes are free, the finished bundle stays.
        let next = BundleStore::default();
        next.configure(dir.path(), 1000).unwrap();
        assert_eq!(next.used_bytes(), 100);
        assert!(next.bundle_path("ns", "done", "n1").unwrap().exists());
    }

    #[test]
    fn a_sweep_removes_the_bundles_of_objects_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        put(&store, "ns", "live", "n1", 10);
        store.set_owner("ns", "live", "u-live").unwrap();
        put(&store, "ns", "gone", "n1", 10);
        store.set_owner("ns", "gone", "u-gone").unwrap();
        // Same name as a live object, but the bundles of an earlier one of that name.
        put(&store, "ns", "reused", "n1", 10);
        store.set_owner("ns", "reused", "u-old").unwrap();
        // Stored before owners were recorded.
        put(&store, "other", "legacy", "n1", 10);
        let live = [
            ("ns", "live", "u-live"),
            ("ns", "reused", "u-new"),
            ("other", "legacy", "u-l"),
        ];
        let keep = |ns: &str, name: &str, owner: Option<&str>| {
            live.iter().any(|(n, o, uid)| {
                *n == ns && *o == name && owner.is_none_or(|owner| owner == *uid)
            })
        };
        let mut removed = store.sweep(keep);
        removed.sort();
        assert_eq!(
            removed,
            vec!["ns/gone".to_string(), "ns/reused".to_string()]
        );
        assert_eq!(store.missing_bundle("ns", "live", "n1"), None);
        assert_eq!(store.missing_bundle("other", "legacy", "n1"), None);
        assert!(store.missing_bundle("ns", "gone", "n1").is_some());
        assert!(!dir.path().join("ns/gone").exists());
        assert_eq!(store.used_bytes(), 20);
        // Nothing live: everything goes, the namespace directories too.
        store.sweep(|_, _, _| false);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn removes_an_objects_bundles() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        put(&store, "ns", "a", "n1", 10);
        store.remove_object("ns", "a").unwrap();
        assert_eq!(store.used_bytes(), 0);
        store.remove_object("ns", "never").unwrap();
    }

    /// A bundle as `collect::to_file` leaves it: the token recorded, then the bundle in place.
    async fn put_with_token(store: &BundleStore, ns: &str, name: &str, node: &str) -> String {
        let p = store.bundle_path(ns, name, node).unwrap();
        tokio::fs::create_dir_all(p.parent().unwrap())
            .await
            .unwrap();
        let token = new_token();
        BundleStore::write_token(&p, &token).await.unwrap();
        tokio::fs::write(&p, format!("bundle of {node}"))
            .await
            .unwrap();
        token
    }

    /// Serves the store's router on 127.0.0.1.
    async fn serve_on_loopback(
        store: &BundleStore,
    ) -> (tokio::task::JoinHandle<std::io::Result<()>>, SocketAddr) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = store.router();
        (
            tokio::spawn(async move { axum::serve(listener, router).await }),
            addr,
        )
    }

    /// `GET path` over real HTTP: (status code, body).
    async fn get(addr: SocketAddr, path: String) -> (u16, String) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (code, body.to_owned())
    }

    #[tokio::test]
    async fn a_bundle_downloads_only_with_its_token_and_otherwise_looks_absent() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        let token = put_with_token(&store, "ns", "d", "n1").await;
        // Stored by a controller from before tokens: a bundle with no token file.
        put(&store, "ns", "d", "legacy", 10);
        std::fs::remove_file(beside(
            &store.bundle_path("ns", "d", "legacy").unwrap(),
            TOKEN,
        ))
        .unwrap();
        let (server, addr) = serve_on_loopback(&store).await;

        let (code, body) = get(addr, format!("/api/diagnostics/ns/d/n1/{token}")).await;
        assert_eq!((code, body.as_str()), (200, "bundle of n1"));

        // Wrong token (same length, last digit changed), no token, a token of another length,
        // a node with no bundle, a bundle with no recorded token: the same 404, the same words.
        let mut wrong = token.clone().into_bytes();
        let last = wrong.len() - 1;
        wrong[last] = if wrong[last] == b'0' { b'1' } else { b'0' };
        let wrong = String::from_utf8(wrong).unwrap();
        let (code, absent) = get(addr, format!("/api/diagnostics/ns/d/n1/{wrong}")).await;
        assert_eq!(code, 404, "{absent}");
        assert!(absent.contains("downloadPath"), "{absent}");
        for path in [
            "/api/diagnostics/ns/d/n1".to_owned(),
            format!("/api/diagnostics/ns/d/n1/{}", &token[..16]),
            format!("/api/diagnostics/ns/d/n1/{token}0"),
        ] {
            assert_eq!(
                get(addr, path.clone()).await,
                (404, absent.clone()),
                "{path}"
            );
        }
        let (code, body) = get(addr, format!("/api/diagnostics/ns/d/n2/{token}")).await;
        assert_eq!(code, 404, "{body}");
        for path in [
            "/api/diagnostics/ns/d/legacy".to_owned(),
            format!("/api/diagnostics/ns/d/legacy/{token}"),
        ] {
            let (code, body) = get(addr, path.clone()).await;
            assert!(
                code == 404 && body.contains("node legacy"),
                "{path}: {body}"
            );
        }

        // Evicted: the token holder learns why; anyone else still sees nothing.
        let r = store.reserve("ns", "other", 995).unwrap();
        assert!(
            r.evicted.contains(&"ns/d/n1".to_string()),
            "{:?}",
            r.evicted
        );
        let (code, body) = get(addr, format!("/api/diagnostics/ns/d/n1/{token}")).await;
        assert_eq!(code, 410, "{body}");
        assert_eq!(
            get(addr, format!("/api/diagnostics/ns/d/n1/{wrong}")).await,
            (404, absent)
        );
        server.abort();
    }

    #[tokio::test]
    async fn a_bundles_token_survives_a_restart_of_the_controller() {
        let dir = tempfile::tempdir().unwrap();
        let first = BundleStore::default();
        first.configure(dir.path(), 1000).unwrap();
        let token = put_with_token(&first, "ns", "d", "n1").await;
        drop(first);
        // The next process, on the same disk: the same token downloads, and the bundle counts as
        // present (its status keeps its download path).
        let next = BundleStore::default();
        next.configure(dir.path(), 1000).unwrap();
        assert_eq!(next.missing_bundle("ns", "d", "n1"), None);
        let (server, addr) = serve_on_loopback(&next).await;
        let (code, body) = get(addr, format!("/api/diagnostics/ns/d/n1/{token}")).await;
        assert_eq!((code, body.as_str()), (200, "bundle of n1"));
        let (code, _) = get(addr, format!("/api/diagnostics/ns/d/n1/{}", new_token())).await;
        assert_eq!(code, 404);
        server.abort();
    }

    #[test]
    fn a_bundle_without_a_token_is_withdrawn() {
        let dir = tempfile::tempdir().unwrap();
        let store = BundleStore::default();
        store.configure(dir.path(), 1000).unwrap();
        put(&store, "ns", "d", "n1", 10);
        assert_eq!(store.missing_bundle("ns", "d", "n1"), None);
        std::fs::remove_file(beside(&store.bundle_path("ns", "d", "n1").unwrap(), TOKEN)).unwrap();
        let why = store.missing_bundle("ns", "d", "n1").unwrap();
        assert!(why.contains("without a download token"), "{why}");
    }

    #[test]
    fn tokens_are_random_and_compared_whole() {
        let a = new_token();
        assert_eq!(a.len(), 2 * TOKEN_BYTES);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, new_token());
        assert!(token_matches(&a, &a.clone()));
        assert!(!token_matches(&a, &a[..31]));
        assert!(!token_matches(&a, &format!("{a}0")));
        assert!(!token_matches(&a, ""));
        assert!(!token_matches("", ""), "an empty record matches nothing");
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"abcd", b"xbcd"));
        assert!(!constant_time_eq(b"abcd", b"abcx"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
    }

    #[test]
    fn path_segments_are_checked() {
        assert!(valid_segment("node-1.example"));
        for bad in ["", "..", ".hidden", "a/b", "UPPER", "a b"] {
            assert!(!valid_segment(bad), "{bad:?}");
        }
    }
}
