//! Which collections are to stop because their NodeDiagnostic is being deleted, learnt from the
//! controller's own watch ([`Deletions::observe`], fed by the scaffold's `Reconciler::observe`):
//! a collection waits on a token of its object's UID instead of reading the object from the API
//! server while its bundles stream (up to `--diagnostics-timeout`).
//!
//! The object carries the bundles' finalizer while it is collected, so its deletion shows first
//! as an update with `deletionTimestamp`, then (the finalizer run) as a Delete. A deletion seen
//! before the collection starts (the reconcile works from the object as it was queued) is kept
//! as a cancelled token, so the collection stops as soon as it asks; and an object missing from a
//! relist (the watch fell behind, a Delete it never showed) counts as deleted.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

use kube::ResourceExt as _;
use kube::runtime::watcher;
use nodekeeper_api::crd::NodeDiagnostic;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// The tokens, by the UID of their NodeDiagnostic.
#[derive(Default)]
pub struct Deletions {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// A collection's token (cancelled once its object is seen being deleted), or a cancelled
    /// one for an object seen being deleted with no collection (yet): forgotten when the
    /// collection ends unharmed, when the object's Delete is seen, or when a relist lacks it.
    tokens: HashMap<String, CancellationToken>,
    /// The UIDs a relist has shown so far, between its `Init` and `InitDone`.
    relisted: Option<HashSet<String>>,
}

/// The collection of one object, registered until dropped.
pub struct Collection<'a> {
    deletions: &'a Deletions,
    uid: String,
    token: CancellationToken,
}

impl Collection<'_> {
    /// Completes once the watch shows the object deleted or being deleted (at once if it did
    /// before the collection started).
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.token.cancelled()
    }
}

impl Drop for Collection<'_> {
    fn drop(&mut self) {
        // A deletion stays noted until its Delete (or a relist without the object) is seen.
        if !self.token.is_cancelled() {
            self.deletions.inner().tokens.remove(&self.uid);
        }
    }
}

impl Deletions {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers the collection of the object `uid` (one at a time per object: kube runs no two
    /// reconciles of an object at once).
    pub fn collecting(&self, uid: &str) -> Collection<'_> {
        let token = self
            .inner()
            .tokens
            .entry(uid.to_owned())
            .or_default()
            .clone();
        Collection {
            deletions: self,
            uid: uid.to_owned(),
            token,
        }
    }

    /// Takes in one event of the controller's watch.
    pub fn observe(&self, event: &watcher::Event<NodeDiagnostic>) {
        let mut inner = self.inner();
        match event {
            watcher::Event::Init => inner.relisted = Some(HashSet::new()),
            watcher::Event::InitApply(o) | watcher::Event::Apply(o) => {
                let Some(uid) = o.uid() else { return };
                if let Some(seen) = inner.relisted.as_mut()
                    && matches!(event, watcher::Event::InitApply(_))
                {
                    seen.insert(uid.clone());
                }
                if super::reconcile::collection_cancelled(Some(o), &uid) {
                    inner.tokens.entry(uid).or_default().cancel();
                }
            }
            watcher::Event::Delete(o) => {
                if let Some(token) = o.uid().and_then(|uid| inner.tokens.remove(&uid)) {
                    token.cancel();
                }
            }
            watcher::Event::InitDone => {
                let Some(seen) = inner.relisted.take() else {
                    return;
                };
                inner.tokens.retain(|uid, token| {
                    let listed = seen.contains(uid);
                    if !listed {
                        token.cancel();
                    }
                    listed
                });
            }
        }
    }

    /// UIDs with a token (a collection, or a deletion noted).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.inner().tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use kube::runtime::watcher::Event;
    use nodekeeper_api::crd::NodeDiagnosticSpec;

    use super::*;

    fn object(uid: &str, deleting: bool) -> NodeDiagnostic {
        let spec = serde_json::json!({"nodeName": "n1"});
        let mut o = NodeDiagnostic::new(
            "d",
            serde_json::from_value::<NodeDiagnosticSpec>(spec).unwrap(),
        );
        o.metadata.uid = Some(uid.into());
        if deleting {
            o.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
        }
        o
    }

    #[test]
    fn the_watch_stops_the_collection_of_a_deleted_object_only() {
        let d = Deletions::default();
        let one = d.collecting("u1");
        let two = d.collecting("u2");
        // Updates that are no deletion, and another object's deletion.
        d.observe(&Event::Apply(object("u1", false)));
        d.observe(&Event::Apply(object("u3", true)));
        assert!(!one.token.is_cancelled() && !two.token.is_cancelled());
        // Marked for deletion (the finalizer holds it), or gone.
        d.observe(&Event::Apply(object("u1", true)));
        assert!(one.token.is_cancelled());
        d.observe(&Event::Delete(object("u2", false)));
        assert!(two.token.is_cancelled());
        drop((one, two));
        // Noted until their Delete: u1 and u3.
        assert_eq!(d.held(), 2);
        d.observe(&Event::Delete(object("u1", true)));
        d.observe(&Event::Delete(object("u3", true)));
        assert_eq!(d.held(), 0);
    }

    #[test]
    fn a_deletion_seen_before_the_collection_starts_stops_it_at_once() {
        let d = Deletions::default();
        d.observe(&Event::Apply(object("u1", true)));
        assert!(d.collecting("u1").token.is_cancelled());
        // A collection that ends unharmed is forgotten.
        drop(d.collecting("u2"));
        assert_eq!(d.held(), 1);
    }

    #[test]
    fn an_object_missing_from_a_relist_counts_as_deleted() {
        let d = Deletions::default();
        let kept = d.collecting("u1");
        let lost = d.collecting("u2");
        d.observe(&Event::Init);
        d.observe(&Event::InitApply(object("u1", false)));
        assert!(
            !lost.token.is_cancelled(),
            "not before the relist is complete"
        );
        d.observe(&Event::InitDone);
        assert!(!kept.token.is_cancelled());
        assert!(lost.token.is_cancelled());
        // Outside a relist, an update says nothing about the other objects.
        d.observe(&Event::Apply(object("u3", false)));
        d.observe(&Event::InitDone);
        assert!(!kept.token.is_cancelled());
    }
}
