//! The full results of finished tests, kept in the controller's memory (never in etcd) for as long
//! as the test object lives, and served as JSON under `/api/networktests/{namespace}/{name}`.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router, routing::get};

use super::aggregate::{PairResult, Summary};

/// Most tests whose results are held at once; the oldest finished are dropped first.
pub const MAX_TESTS: usize = 256;
/// Most pairs held over all tests (a pair is about 250 bytes here: 200,000 are some 50 MiB of a
/// controller whose default memory limit is 256 MiB); past it the oldest finished tests are
/// dropped first, but the newest test's results are always kept, however many pairs it has.
/// Without it, 256 mesh tests of a 10,000-node fleet (30,000 pairs each) would hold gigabytes.
pub const MAX_PAIRS: usize = 200_000;
/// Pairs returned per page by default, and at most.
const DEFAULT_LIMIT: usize = 1_000;
const MAX_LIMIT: usize = 10_000;

/// One finished test's results.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredResults {
    pub uid: String,
    pub finished_unix: i64,
    /// The complete (unbounded) summary.
    pub summary: Summary,
    /// Every source→target pair, sorted by source then target.
    pub pairs: Vec<PairResult>,
}

/// Shared, cheaply cloned handle to the results. Each test's results are shared too: a reader
/// (a page of the HTTP API, the reconciler's check) never copies a test's pairs.
#[derive(Debug, Clone, Default)]
pub struct ResultsStore {
    inner: Arc<RwLock<ByTest>>,
}

/// Each held test's results, by (namespace, name).
type ByTest = BTreeMap<(String, String), Held>;

/// One test's results and whether its final status has been written: results inserted before
/// the write that failed must lead the next reconcile to write it again, not to wait for a
/// status that never comes.
#[derive(Debug)]
struct Held {
    results: Arc<StoredResults>,
    status_written: bool,
}

impl ResultsStore {
    pub fn insert(&self, namespace: &str, name: &str, results: StoredResults) {
        let mut map = self.inner.write().expect("results store lock");
        let key = (namespace.to_owned(), name.to_owned());
        map.insert(
            key.clone(),
            Held {
                results: Arc::new(results),
                status_written: false,
            },
        );
        let mut pairs: usize = map.values().map(|h| h.results.pairs.len()).sum();
        while map.len() > MAX_TESTS || (pairs > MAX_PAIRS && map.len() > 1) {
            let oldest = map
                .iter()
                .filter(|(k, _)| **k != key)
                .min_by_key(|(_, h)| h.results.finished_unix)
                .map(|(k, _)| k.clone())
                .expect("another test is held");
            if let Some(dropped) = map.remove(&oldest) {
                pairs -= dropped.results.pairs.len();
            }
        }
    }

    /// Removes a test's results (its object was deleted, or its TTL passed). Only the results of
    /// the same `uid` are removed, so a re-created test of the same name keeps its own.
    pub fn remove(&self, namespace: &str, name: &str, uid: &str) {
        let mut map = self.inner.write().expect("results store lock");
        let key = (namespace.to_owned(), name.to_owned());
        if map.get(&key).is_some_and(|h| h.results.uid == uid) {
            map.remove(&key);
        }
    }

    /// Notes that the final status of the test `uid` (its results held here) has been written.
    pub fn mark_status_written(&self, namespace: &str, name: &str, uid: &str) {
        let mut map = self.inner.write().expect("results store lock");
        if let Some(h) = map
            .get_mut(&(namespace.to_owned(), name.to_owned()))
            .filter(|h| h.results.uid == uid)
        {
            h.status_written = true;
        }
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<StoredResults>> {
        self.get_with_status(namespace, name).map(|(r, _)| r)
    }

    /// The test's results and whether its final status has been written
    /// ([`Self::mark_status_written`]).
    pub fn get_with_status(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<(Arc<StoredResults>, bool)> {
        let map = self.inner.read().expect("results store lock");
        map.get(&(namespace.to_owned(), name.to_owned()))
            .map(|h| (Arc::clone(&h.results), h.status_written))
    }

    pub fn len(&self) -> usize {
        self.inner.read().expect("results store lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PageQuery {
    offset: Option<usize>,
    limit: Option<usize>,
    /// Only pairs that failed.
    failed_only: Option<bool>,
}

#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Page<'a> {
    uid: &'a str,
    finished_unix: i64,
    summary: &'a Summary,
    /// Pairs matching the query in total (before paging).
    total_pairs: usize,
    offset: usize,
    pairs: &'a [&'a PairResult],
}

/// `GET /api/networktests/{namespace}/{name}?offset=&limit=&failedOnly=`: the summary and one page
/// of pairs. Mounted by the controller's HTTP server.
pub fn router(store: ResultsStore) -> Router {
    Router::new()
        .route("/api/networktests/{namespace}/{name}", get(handle))
        .with_state(store)
}

async fn handle(
    State(store): State<ResultsStore>,
    Path((namespace, name)): Path<(String, String)>,
    Query(q): Query<PageQuery>,
) -> Response {
    let Some(r) = store.get(&namespace, &name) else {
        let msg = format!(
            "no results for networktest {namespace}/{name}: it has not finished, its TTL passed, newer tests' results displaced them (at most {MAX_TESTS} tests and {MAX_PAIRS} pairs are kept), or the controller restarted since; its status still holds the summary"
        );
        return (StatusCode::NOT_FOUND, msg).into_response();
    };
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if limit == 0 || limit > MAX_LIMIT {
        return (
            StatusCode::BAD_REQUEST,
            format!("limit: {limit} is out of range; use 1–{MAX_LIMIT}"),
        )
            .into_response();
    }
    let failed_only = q.failed_only.unwrap_or(false);
    let selected: Vec<&PairResult> = r
        .pairs
        .iter()
        .filter(|p| !failed_only || !p.succeeded())
        .collect();
    let offset = q.offset.unwrap_or(0).min(selected.len());
    let end = offset.saturating_add(limit).min(selected.len());
    Json(Page {
        uid: &r.uid,
        finished_unix: r.finished_unix,
        summary: &r.summary,
        total_pairs: selected.len(),
        offset,
        pairs: &selected[offset..end],
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::super::aggregate::aggregate;
    use super::super::plan::{PlannedTarget, ProbeKind, ProbeParams, TestPlan};
    use super::*;

    fn results(uid: &str, finished: i64, pairs: usize) -> StoredResults {
        let plan = TestPlan {
            ranges: Vec::new(),
            params: ProbeParams {
                kind: ProbeKind::Icmp,
                count: 1,
                interval_ms: 1,
                timeout_ms: 1,
                expected_status: vec![],
                max_mtu: 0,
            },
            sources: [(
                "n0".to_owned(),
                (0..pairs)
                    .map(|i| PlannedTarget {
                        id: format!("t{i:04}"),
                        ..Default::default()
                    })
                    .collect(),
            )]
            .into_iter()
            .collect(),
        };
        let res: Vec<PairResult> = (0..pairs)
            .map(|i| PairResult {
                source: "n0".into(),
                target_id: format!("t{i:04}"),
                sent: 1,
                received: u32::from(i % 2 == 0),
                error: if i % 2 == 0 {
                    String::new()
                } else {
                    "timeout".into()
                },
                ..Default::default()
            })
            .collect();
        let outcomes = [("n0".to_owned(), Ok(res.clone()))].into_iter().collect();
        StoredResults {
            uid: uid.into(),
            finished_unix: finished,
            summary: aggregate(&plan, &outcomes),
            pairs: res,
        }
    }

    #[test]
    fn bounded_and_uid_checked() {
        let store = ResultsStore::default();
        for i in 0..(MAX_TESTS + 10) {
            store.insert("ns", &format!("t{i}"), results("u", i as i64, 1));
        }
        assert_eq!(store.len(), MAX_TESTS);
        assert!(
            store.get("ns", "t0").is_none(),
            "the oldest are dropped first"
        );
        assert!(store.get("ns", &format!("t{}", MAX_TESTS + 9)).is_some());
        store.remove("ns", "t100", "other-uid");
        assert!(store.get("ns", "t100").is_some());
        store.remove("ns", "t100", "u");
        assert!(store.get("ns", "t100").is_none());
    }

    #[test]
    fn the_final_status_write_is_noted_per_uid() {
        let store = ResultsStore::default();
        store.insert("ns", "t", results("u1", 1, 1));
        assert_eq!(
            store.get_with_status("ns", "t").map(|(_, w)| w),
            Some(false)
        );
        store.mark_status_written("ns", "t", "other-uid");
        assert_eq!(
            store.get_with_status("ns", "t").map(|(_, w)| w),
            Some(false)
        );
        store.mark_status_written("ns", "t", "u1");
        assert_eq!(store.get_with_status("ns", "t").map(|(_, w)| w), Some(true));
        // A re-created test's new results start unwritten again.
        store.insert("ns", "t", results("u2", 2, 1));
        assert_eq!(
            store.get_with_status("ns", "t").map(|(_, w)| w),
            Some(false)
        );
    }

    /// Past `MAX_PAIRS` the oldest finished tests go first; the newest stays even alone over it.
    #[test]
    fn bounded_by_pairs_too() {
        let store = ResultsStore::default();
        let big = MAX_PAIRS / 3;
        for i in 0..3 {
            store.insert("ns", &format!("t{i}"), results("u", 10 + i, big));
        }
        assert_eq!(store.len(), 3);
        store.insert("ns", "t3", results("u", 13, big));
        assert!(store.get("ns", "t0").is_none(), "the oldest is dropped");
        assert_eq!(store.len(), 3);
        // Finished earlier than every other, yet the one just inserted: kept.
        store.insert("ns", "early", results("u", 1, MAX_PAIRS + 1));
        assert_eq!(store.len(), 1);
        assert!(store.get("ns", "early").is_some());
    }

    /// Serves the router on 127.0.0.1 and asks it over real HTTP.
    #[tokio::test]
    async fn http_api_pages_and_filters() {
        let store = ResultsStore::default();
        store.insert("ns", "t", results("uid-1", 1, 2_500));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, router(store)).await });

        let get = |path: String| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            let (head, body) = out.split_once("\r\n\r\n").unwrap();
            (head.lines().next().unwrap().to_owned(), body.to_owned())
        };

        let (status, body) = get("/api/networktests/ns/t".into()).await;
        assert!(status.contains("200"), "{status}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["uid"], "uid-1");
        assert_eq!(v["totalPairs"], 2_500);
        assert_eq!(v["pairs"].as_array().unwrap().len(), 1_000);
        assert_eq!(v["summary"]["pairsFailed"], 1_250);

        let (_, body) =
            get("/api/networktests/ns/t?failedOnly=true&offset=1200&limit=100".into()).await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["totalPairs"], 1_250);
        let pairs = v["pairs"].as_array().unwrap();
        assert_eq!(pairs.len(), 50);
        assert!(pairs.iter().all(|p| p["error"] == "timeout"));

        let (status, _) = get("/api/networktests/ns/t?limit=0".into()).await;
        assert!(status.contains("400"), "{status}");
        let (status, body) = get("/api/networktests/ns/missing".into()).await;
        assert!(
            status.contains("404") && body.contains("ns/missing"),
            "{status} {body}"
        );
        server.abort();
    }
}
