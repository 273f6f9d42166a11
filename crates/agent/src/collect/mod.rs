//! Node collectors: one module per source, each a function returning plain data or a
//! [`CollectError`], with the text parsing split out so it can be tested on fixture text.

pub mod disk;
pub mod gpu;
pub mod interfaces;
pub mod kernel;
pub mod load;
pub mod memory;
pub mod nvml;
pub mod nvsmi;
pub mod oca;
pub mod time;

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Why one collector could not produce its figures. It is reported in the node report under
/// the collector's name; it never fails the call.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error("read {path}: {source}")]
    ReadFile { path: PathBuf, source: io::Error },
    #[error("parse {what}: {reason}")]
    Parse { what: String, reason: String },
    #[error("statvfs {path}: {source}")]
    Statvfs { path: PathBuf, source: nix::Error },
    #[error("adjtimex: {0}")]
    Adjtimex(io::Error),
    #[error("dump links and addresses over netlink: {0}")]
    Netlink(String),
    #[error("run {program}: {reason}")]
    RunCommand { program: String, reason: String },
    /// A read that blocks in the kernel (statvfs on a stale NFS mount) is left running on a
    /// thread of its own; the same read is not started again until it returns.
    #[error("{what} did not return within {after:?}; not tried again until it does")]
    TimedOut { what: String, after: Duration },
}

impl CollectError {
    pub(crate) fn parse(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Parse {
            what: what.into(),
            reason: reason.into(),
        }
    }
}

/// Unit of a measured value, as named in the proto's `Indicator.unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Percent,
    Ratio,
    Seconds,
    Bool,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Percent => "percent",
            Unit::Ratio => "ratio",
            Unit::Seconds => "seconds",
            Unit::Bool => "bool",
        }
    }
}

/// One raw figure before thresholds are applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub name: String,
    pub value: f64,
    pub unit: Unit,
}

impl Measurement {
    pub fn new(name: impl Into<String>, value: f64, unit: Unit) -> Self {
        Self {
            name: name.into(),
            value,
            unit,
        }
    }
}

/// Reads a small procfs/sysfs file whole.
pub(crate) fn read(path: &Path) -> Result<String, CollectError> {
    std::fs::read_to_string(path).map_err(|source| CollectError::ReadFile {
        path: path.to_path_buf(),
        source,
    })
}

/// Percentage of `part` in `whole`; `None` when `whole` is zero (nothing to measure against).
pub(crate) fn percent(part: f64, whole: f64) -> Option<f64> {
    (whole > 0.0).then(|| part / whole * 100.0)
}

/// Reads started by [`bounded`] that outlived their wait and have not returned yet (blocked in
/// the kernel), counted by key.
static BLOCKED: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

/// Runs a read that may block in the kernel (a syscall on a hung mount cannot be interrupted)
/// on the blocking pool and waits at most `wait` for it, so neither the agent's one runtime
/// thread nor a report call waits on it. While a read under `key` is still blocked past its
/// wait, a new one under the same key is not started (it would block another thread): the
/// answer is [`CollectError::TimedOut`] at once. Reads that merely overlap (two callers at
/// once) both run.
pub(crate) async fn bounded<T: Send + 'static>(
    key: &str,
    what: &str,
    wait: Duration,
    read: impl FnOnce() -> Result<T, CollectError> + Send + 'static,
) -> Result<T, CollectError> {
    let timed_out = || CollectError::TimedOut {
        what: what.to_owned(),
        after: wait,
    };
    let blocked = || BLOCKED.lock().unwrap_or_else(PoisonError::into_inner);
    if blocked().contains_key(key) {
        return Err(timed_out());
    }
    // Whether the read has returned, and whether it was counted as blocked: both changed
    // under the BLOCKED lock, so a read that returns just as its wait ends is never left
    // counted.
    let state = Arc::new(Mutex::new((false, false)));
    let (owned, theirs) = (key.to_owned(), Arc::clone(&state));
    let task = tokio::task::spawn_blocking(move || {
        let result = read();
        let mut map = BLOCKED.lock().unwrap_or_else(PoisonError::into_inner);
        let mut s = theirs.lock().unwrap_or_else(PoisonError::into_inner);
        s.0 = true;
        if s.1
            && let Some(n) = map.get_mut(&owned)
        {
            *n -= 1;
            if *n == 0 {
                map.remove(&owned);
            }
        }
        result
    });
    match tokio::time::timeout(wait, task).await {
        Ok(Ok(result)) => result,
        Ok(Err(panicked)) => Err(CollectError::parse(
            what,
            format!("the read panicked: {panicked}"),
        )),
        Err(_) => {
            let mut map = blocked();
            let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
            if !s.0 {
                s.1 = true;
                *map.entry(key.to_owned()).or_default() += 1;
            }
            Err(timed_out())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    /// Several agents in one process (the tests' rigs), or two calls at once, read the same
    /// mount: a read still within its wait holds nobody else up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_reads_of_one_key_both_run() {
        let slow = || {
            std::thread::sleep(Duration::from_millis(200));
            Ok(1)
        };
        let wait = Duration::from_secs(5);
        let (a, b) = tokio::join!(
            bounded("test:shared", "statvfs /", wait, slow),
            bounded("test:shared", "statvfs /", wait, slow)
        );
        assert_eq!((a.unwrap(), b.unwrap()), (1, 1));
    }

    #[tokio::test]
    async fn a_blocked_read_is_waited_for_once_and_not_started_again() {
        // A thread waiting on a flag stands in for a syscall blocked on a hung mount: both
        // hold a blocking-pool thread that nothing can interrupt.
        let started = Arc::new(AtomicU32::new(0));
        let open = Arc::new(AtomicBool::new(false));
        let read = |started: Arc<AtomicU32>, open: Arc<AtomicBool>| {
            move || {
                started.fetch_add(1, Ordering::SeqCst);
                // Bounded, so that a failing test leaves no thread behind for long.
                for _ in 0..1000 {
                    if open.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(7)
            }
        };
        let wait = Duration::from_millis(100);
        let t = std::time::Instant::now();
        let first = bounded(
            "test:hung",
            "statvfs /hung",
            wait,
            read(started.clone(), open.clone()),
        )
        .await;
        assert!(
            matches!(first, Err(CollectError::TimedOut { .. })),
            "{first:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(5));
        // Still blocked: answered at once, and no second read started.
        let t = std::time::Instant::now();
        let second = bounded(
            "test:hung",
            "statvfs /hung",
            wait,
            read(started.clone(), open.clone()),
        )
        .await;
        assert_eq!(
            second.unwrap_err().to_string(),
            "statvfs /hung did not return within 100ms; not tried again until it does"
        );
        assert!(t.elapsed() < wait, "{:?}", t.elapsed());
        // Another key is not held up.
        assert_eq!(bounded("test:other", "x", wait, || Ok(1)).await.unwrap(), 1);
        while started.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(started.load(Ordering::SeqCst), 1);
        // Once the blocked read returns, the key is read again.
        open.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            match bounded(
                "test:hung",
                "statvfs /hung",
                wait,
                read(started.clone(), open.clone()),
            )
            .await
            {
                Ok(v) => break assert_eq!(v, 7),
                Err(e) => assert!(std::time::Instant::now() < deadline, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(started.load(Ordering::SeqCst), 2);
    }
}
