//! The writer pool: API writes handed off by readers run here, under their own concurrency
//! bound, so a read slot is freed as soon as the read is done and reads never queue behind
//! writes (on a fresh fleet every node's first read is followed by a write, and the API
//! server, not the agents, is then the slow side). At most one write per key is queued or
//! running: a second one for the same key while the first is pending is dropped, because the
//! caller recomputes the difference at its next read and writes it then.
//!
//! The queue has a bound of its own: a queued write holds what it will send, and on a fresh
//! fleet the reads outrun the API server by far (at 65,000 nodes an unbounded queue held tens
//! of thousands of writes and the controller's RSS reached 1 GiB; issue #18). Past the bound,
//! `submit` waits for room, so the reads then go at the pace of the writes, which is the pace
//! of the API server: the time until every node is written does not change.

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A bounded pool of write tasks keyed by object name.
#[derive(Clone)]
pub struct Writers {
    /// Writes running.
    permits: Arc<Semaphore>,
    /// Writes queued or running.
    room: Arc<Semaphore>,
    pending: Arc<Mutex<HashSet<String>>>,
    tasks: TaskTracker,
    stop: CancellationToken,
}

impl Writers {
    /// A pool running at most `bound` writes at once and holding at most `queue` queued or
    /// running (at least `bound`); `stop` abandons queued and running writes (a replica that no
    /// longer leads must not write).
    pub fn new(bound: usize, queue: usize, stop: CancellationToken) -> Self {
        let bound = bound.max(1);
        Self {
            permits: Arc::new(Semaphore::new(bound)),
            room: Arc::new(Semaphore::new(queue.max(bound))),
            pending: Arc::default(),
            tasks: TaskTracker::new(),
            stop,
        }
    }

    /// Queues `write` for `key`, first waiting for room in the queue; false (and `write`
    /// dropped unrun) when a write for `key` is already queued or running, or the pool is
    /// stopped.
    pub async fn submit<F>(&self, key: &str, write: F) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if self.stop.is_cancelled() || self.lock().contains(key) {
            return false;
        }
        let room = tokio::select! {
            () = self.stop.cancelled() => return false,
            room = Arc::clone(&self.room).acquire_owned() => match room {
                Ok(room) => room,
                Err(_) => return false,
            },
        };
        if !self.lock().insert(key.to_owned()) {
            return false;
        }
        let (permits, pending, stop, key) = (
            Arc::clone(&self.permits),
            Arc::clone(&self.pending),
            self.stop.clone(),
            key.to_owned(),
        );
        self.tasks.spawn(async move {
            let _room = room;
            tokio::select! {
                () = stop.cancelled() => {}
                () = async {
                    let Ok(_permit) = permits.acquire().await else { return };
                    write.await;
                } => {}
            }
            pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&key);
        });
        true
    }

    /// Writes queued or running.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    /// Waits until every submitted write has finished or been abandoned.
    pub async fn drain(&self) {
        self.tasks.close();
        self.tasks.wait().await;
        self.tasks.reopen();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn runs_at_most_bound_writes_at_once() {
        let writers = Writers::new(3, 3, CancellationToken::new());
        let (running, peak, done) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        for i in 0..20 {
            let (running, peak, done) = (running.clone(), peak.clone(), done.clone());
            assert!(
                writers
                    .submit(&format!("node-{i}"), async move {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        running.fetch_sub(1, Ordering::SeqCst);
                        done.fetch_add(1, Ordering::SeqCst);
                    })
                    .await
            );
        }
        writers.drain().await;
        assert_eq!(done.load(Ordering::SeqCst), 20);
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        assert_eq!(writers.pending(), 0);
    }

    #[tokio::test]
    async fn a_second_write_for_a_pending_key_is_dropped() {
        let writers = Writers::new(1, 4, CancellationToken::new());
        let gate = Arc::new(tokio::sync::Notify::new());
        let ran = Arc::new(AtomicUsize::new(0));
        let (g, r) = (gate.clone(), ran.clone());
        assert!(
            writers
                .submit("node-a", async move {
                    g.notified().await;
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .await
        );
        let r = ran.clone();
        assert!(
            !writers
                .submit("node-a", async move {
                    r.fetch_add(10, Ordering::SeqCst);
                })
                .await
        );
        gate.notify_one();
        writers.drain().await;
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        // Once finished, the key takes writes again.
        let r = ran.clone();
        assert!(
            writers
                .submit("node-a", async move {
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .await
        );
        writers.drain().await;
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn stopping_abandons_queued_writes() {
        let stop = CancellationToken::new();
        let writers = Writers::new(1, 8, stop.clone());
        let ran = Arc::new(AtomicUsize::new(0));
        for i in 0..5 {
            let r = ran.clone();
            writers
                .submit(&format!("node-{i}"), async move {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    r.fetch_add(1, Ordering::SeqCst);
                })
                .await;
        }
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(5), writers.drain())
            .await
            .expect("stopped writers finish at once");
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        assert!(!writers.submit("node-x", async {}).await);
    }

    /// Past the queue's bound a submission waits until a queued write is done; the pool never
    /// holds more than the bound.
    #[tokio::test]
    async fn a_full_queue_makes_the_next_submission_wait() {
        let writers = Writers::new(1, 2, CancellationToken::new());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        for i in 0..2 {
            let g = gate.clone();
            assert!(
                writers
                    .submit(&format!("node-{i}"), async move {
                        g.acquire().await.expect("gate").forget();
                    })
                    .await
            );
        }
        assert_eq!(writers.pending(), 2);
        let third = writers.submit("node-2", async {});
        tokio::pin!(third);
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut third)
                .await
                .is_err(),
            "a third write was queued past a bound of 2"
        );
        assert_eq!(writers.pending(), 2);
        gate.add_permits(1);
        assert!(
            tokio::time::timeout(Duration::from_secs(5), third)
                .await
                .expect("room once a write finished")
        );
        gate.add_permits(2);
        writers.drain().await;
        assert_eq!(writers.pending(), 0);
    }

    /// A submission waiting for room gives up when the pool stops.
    #[tokio::test]
    async fn stopping_ends_a_wait_for_room() {
        let stop = CancellationToken::new();
        let writers = Writers::new(1, 1, stop.clone());
        assert!(writers.submit("node-0", std::future::pending::<()>()).await);
        let waiting = writers.submit("node-1", async {});
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waiting)
                .await
                .is_err()
        );
        stop.cancel();
        assert!(
            !tokio::time::timeout(Duration::from_secs(5), waiting)
                .await
                .expect("the wait ends when the pool stops")
        );
    }
}
