//! One async lock per instance, so attaches (and detaches) to one instance run one at a time:
//! OCI answers a second concurrent attach with 409 "instance … is currently being modified".

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::OwnedMutexGuard;

/// Per-instance locks; entries disappear when nobody holds or waits for them.
#[derive(Debug, Default)]
pub struct InstanceLocks {
    locks: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl InstanceLocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for and takes the lock of `instance_id`; dropping the guard releases it.
    pub async fn lock(&self, instance_id: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            locks.retain(|_, weak| weak.strong_count() > 0);
            match locks.get(instance_id).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    locks.insert(instance_id.to_string(), Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }

    /// Instances with a lock held or awaited (for tests and metrics).
    pub fn len(&self) -> usize {
        let locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.values().filter(|w| w.strong_count() > 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn one_holder_per_instance_and_instances_independent() {
        let locks = Arc::new(InstanceLocks::new());
        let inside = Arc::new(AtomicU32::new(0));
        let most = Arc::new(AtomicU32::new(0));
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let (locks, inside, most) = (locks.clone(), inside.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let _g = locks.lock("i1").await;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        // Another instance's lock is free while i1's is contended.
        let other = tokio::time::timeout(Duration::from_millis(500), locks.lock("i2"))
            .await
            .expect("a different instance must not wait");
        drop(other);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1);
        assert!(locks.is_empty(), "released locks are forgotten");
    }
}
