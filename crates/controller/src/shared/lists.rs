//! How the big watches (every Node, every Pod) read their initial state: streamed by the API
//! server on the watch itself, or listed in pages.
//!
//! A paged list at the most recent resourceVersion is answered from the API server's watch
//! cache, but each page is cut from a copy of *every* object from the page's start to the end of
//! the resource (`btreeStore.ListPrefix` in k8s.io/apiserver v0.36, which takes no limit): a list
//! of n objects in pages of p costs the API server about n²/2p object visits. At 65,000 Nodes and
//! 100 a page that is 21 million per watch, and it was a fifth of the API server's samples while
//! a restarted controller listed (BENCHMARKS § fleet). A streaming list (`sendInitialEvents`,
//! Kubernetes' WatchList, on by default in 1.32 and since 1.34) walks the cache once and sends
//! the objects one event at a time, so this process also decodes one object at a time instead
//! of a page.
//!
//! API servers without it (1.31 and before, 1.33, or `--feature-gates=WatchList=false`) refuse
//! `sendInitialEvents` with 422 Invalid; a watcher asking for it would retry forever. So the
//! runtime asks once, when it takes the Lease ([`probe`]), and every watch built afterwards
//! ([`nodes`], [`pods`]) follows the answer.

use std::sync::OnceLock;
use std::time::Duration;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::runtime::watcher;

/// Nodes per page when a Node watch lists in pages (at its start and after a relist). A Node
/// decodes to tens of KiB (managedFields, images, every condition) before a watch trims it, and a
/// page is decoded whole, so the page is the controller's memory peak while it lists: the
/// client's default of 500 Nodes cost ~25 MiB of heap per watch listing at once (heaptrack,
/// 1,000-node fleet bench); 100 keeps it near 5 MiB, and 10,000 Nodes take 100 requests instead
/// of 20.
pub const NODE_LIST_PAGE: u32 = 100;

/// Pods per page when the Pod watch lists in pages (a decoded Pod with its managedFields is
/// several KiB).
pub const POD_LIST_PAGE: u32 = 250;

/// The annotation on the bookmark that ends a streaming list's initial events.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

/// How long [`probe`] waits for the API server's answer. It comes in milliseconds (one bookmark);
/// the bound matters to a server that ignores the parameter and sends nothing, and it is short
/// because the runtime asks between taking the Lease and renewing it.
const PROBE_TIMEOUT: Duration = Duration::from_secs(4);

/// `--initial-lists`: what the operator asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InitialLists {
    /// Ask the API server once, on taking the Lease; stream when it can, page when it cannot.
    #[default]
    Auto,
    /// Always stream (`sendInitialEvents`); the watches fail against a server without WatchList.
    Stream,
    /// Always list in pages.
    Pages,
}

/// What the watches do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Stream,
    Pages,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Stream => "stream",
            Mode::Pages => "pages",
        }
    }
}

/// Set once by the runtime, before the first watch starts. The API server a process talks to is
/// one and the same for all its watches, so this is process-wide rather than threaded through
/// every controller's constructor.
static MODE: OnceLock<Mode> = OnceLock::new();

/// Fixes the mode for every watch built from now on. A second call is ignored (the first
/// answer stands).
pub fn set(mode: Mode) {
    let _ = MODE.set(mode);
}

/// The mode in force: [`Mode::Pages`] until [`set`] (what works against every API server).
pub fn mode() -> Mode {
    MODE.get().copied().unwrap_or(Mode::Pages)
}

/// The watch configuration every Node watch starts from.
pub fn nodes() -> watcher::Config {
    nodes_in(mode())
}

/// The watch configuration of a watch of every Pod.
pub fn pods() -> watcher::Config {
    config(mode(), POD_LIST_PAGE)
}

/// A Node watch's configuration in `mode`, whatever the process's mode.
pub fn nodes_in(mode: Mode) -> watcher::Config {
    config(mode, NODE_LIST_PAGE)
}

fn config(mode: Mode, page: u32) -> watcher::Config {
    match mode {
        Mode::Stream => watcher::Config::default().streaming_lists(),
        Mode::Pages => watcher::Config::default().page_size(page),
    }
}

/// Why the API server will not stream lists.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// It said no: WatchList is off (Kubernetes 1.33, 1.31 and before, or the feature gate).
    #[error("the API server refused sendInitialEvents ({code} {reason}: {message})")]
    Refused {
        code: u16,
        reason: String,
        message: String,
    },
    /// It opened the watch but never marked the end of the initial events (a server that
    /// predates the parameter and ignores it).
    #[error("the API server did not end the initial events within {0:?} (it predates WatchList)")]
    NoEnd(Duration),
    /// Anything else (unreachable, forbidden, …): the answer is unknown.
    #[error("asking the API server failed: {0}")]
    Failed(String),
}

/// Asks the API server whether it streams lists: a watch of Nodes with `sendInitialEvents` and a
/// label selector no Node carries, so the answer is one bookmark (or a refusal) and costs the
/// server one pass over its Node cache.
pub async fn probe(client: &kube::Client) -> Result<(), Refusal> {
    probe_within(client, PROBE_TIMEOUT).await
}

async fn probe_within(client: &kube::Client, within: Duration) -> Result<(), Refusal> {
    let api: Api<Node> = Api::all(client.clone());
    let params = WatchParams::streaming_lists()
        .labels("nodekeeper.io/watch-list-probe=none")
        .timeout(u32::try_from(within.as_secs()).unwrap_or(u32::MAX).max(1));
    let ask = async {
        let stream = api.watch(&params, "0").await.map_err(refusal)?;
        futures::pin_mut!(stream);
        while let Some(event) = stream.try_next().await.map_err(refusal)? {
            match event {
                WatchEvent::Bookmark(b)
                    if b.metadata.annotations.contains_key(INITIAL_EVENTS_END) =>
                {
                    return Ok(());
                }
                WatchEvent::Error(status) => return Err(refusal(kube::Error::Api(status))),
                _ => {}
            }
        }
        Err(Refusal::NoEnd(within))
    };
    match tokio::time::timeout(within + Duration::from_secs(1), ask).await {
        Ok(answer) => answer,
        Err(_) => Err(Refusal::NoEnd(within)),
    }
}

fn refusal(err: kube::Error) -> Refusal {
    match err {
        // 422 Invalid: "sendInitialEvents is forbidden for watch unless the WatchList feature gate
        // is enabled" (k8s.io/apimachinery, meta internalversion validation).
        kube::Error::Api(status) if status.code == 422 => Refusal::Refused {
            code: status.code,
            reason: status.reason,
            message: status.message,
        },
        other => Refusal::Failed(other.to_string()),
    }
}

/// Resolves `--initial-lists` to a mode (probing for `auto`), with the reason for the log.
pub async fn resolve(client: &kube::Client, asked: InitialLists) -> (Mode, String) {
    match asked {
        InitialLists::Stream => (Mode::Stream, "--initial-lists=stream".into()),
        InitialLists::Pages => (Mode::Pages, "--initial-lists=pages".into()),
        InitialLists::Auto => match probe(client).await {
            Ok(()) => (
                Mode::Stream,
                "the API server streams lists (WatchList)".into(),
            ),
            Err(refusal) => (Mode::Pages, refusal.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher::InitialListStrategy;

    #[test]
    fn pages_until_set() {
        // Another test in this binary may have set it; only the unset default is checked here.
        if MODE.get().is_none() {
            assert_eq!(mode(), Mode::Pages);
        }
    }

    #[test]
    fn stream_asks_for_initial_events_and_pages_keep_their_size() {
        let stream = config(Mode::Stream, NODE_LIST_PAGE);
        assert_eq!(
            stream.initial_list_strategy,
            InitialListStrategy::StreamingList
        );
        assert!(stream.bookmarks, "a streaming list ends with a bookmark");
        let pages = config(Mode::Pages, NODE_LIST_PAGE);
        assert_eq!(pages.initial_list_strategy, InitialListStrategy::ListWatch);
        assert_eq!(pages.page_size, Some(NODE_LIST_PAGE));
        assert_eq!(
            config(Mode::Pages, POD_LIST_PAGE).page_size,
            Some(POD_LIST_PAGE)
        );
    }

    #[test]
    fn a_422_is_a_refusal_and_other_errors_are_not() {
        let status = |code: u16| {
            kube::Error::Api(Box::new(kube::core::Status::failure(
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
                "Invalid",
            ).with_code(code)))
        };
        assert!(matches!(
            refusal(status(422)),
            Refusal::Refused { code: 422, .. }
        ));
        assert!(matches!(refusal(status(403)), Refusal::Failed(_)));
    }
}
