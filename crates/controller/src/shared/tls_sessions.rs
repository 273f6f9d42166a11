//! The TLS session store of the agent client: what lets the second and later connections to an
//! agent resume instead of a full handshake, at the least memory per agent.
//!
//! rustls's own in-memory store reserves room for its whole bound up front (3.5 MiB for 65,536
//! agents, before the first connection) and keeps every TLS 1.3 ticket a server sends, up to
//! eight per server; an agent sends two after each handshake. A resumption needs one, and spends
//! it (each ticket is used at most once; the resumed connection brings new ones). This store
//! grows with the agents it has met, keeps the newest ticket per agent, and drops the agent met
//! longest ago once the bound is reached.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};

use rustls::NamedGroup;
use rustls::client::{ClientSessionStore, Tls12ClientSessionValue, Tls13ClientSessionValue};
use rustls::pki_types::ServerName;

/// A bounded store with one entry per server name (the agent's IP address, see
/// `agent_client::AgentNameVerifier`).
#[derive(Debug)]
pub struct SessionStore {
    bound: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<ServerName<'static>, Entry>,
    /// The names of `entries` in the order they were first stored.
    order: VecDeque<ServerName<'static>>,
}

/// The sessions are boxed: a map keeps room for an entry's whole inline size in every slot,
/// including the slots it keeps free (up to half of them), and the two session values are over
/// 100 bytes each where agents only ever use one of them (TLS 1.3) (see
/// `tests::an_entry_is_small`).
#[derive(Debug, Default)]
struct Entry {
    kx_hint: Option<NamedGroup>,
    tls12: Option<Box<Tls12ClientSessionValue>>,
    tls13: Option<Box<Tls13ClientSessionValue>>,
}

impl SessionStore {
    /// A store for at most `bound` servers (at least one).
    pub fn new(bound: usize) -> Self {
        Self {
            bound: bound.max(1),
            inner: Mutex::default(),
        }
    }

    /// Servers with an entry now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The entry of `name`, created (and the oldest dropped past the bound) if new.
    fn update(&self, name: ServerName<'static>, f: impl FnOnce(&mut Entry)) {
        let mut inner = self.lock();
        if let Some(entry) = inner.entries.get_mut(&name) {
            f(entry);
            return;
        }
        while inner.entries.len() >= self.bound {
            match inner.order.pop_front() {
                Some(oldest) => {
                    inner.entries.remove(&oldest);
                }
                None => break,
            }
        }
        let mut entry = Entry::default();
        f(&mut entry);
        inner.order.push_back(name.clone());
        inner.entries.insert(name, entry);
    }
}

impl ClientSessionStore for SessionStore {
    fn set_kx_hint(&self, server_name: ServerName<'static>, group: NamedGroup) {
        self.update(server_name, |e| e.kx_hint = Some(group));
    }

    fn kx_hint(&self, server_name: &ServerName<'_>) -> Option<NamedGroup> {
        self.lock()
            .entries
            .get(&server_name.to_owned())
            .and_then(|e| e.kx_hint)
    }

    fn set_tls12_session(&self, server_name: ServerName<'static>, value: Tls12ClientSessionValue) {
        self.update(server_name, |e| e.tls12 = Some(Box::new(value)));
    }

    fn tls12_session(&self, server_name: &ServerName<'_>) -> Option<Tls12ClientSessionValue> {
        self.lock()
            .entries
            .get(&server_name.to_owned())
            .and_then(|e| e.tls12.as_deref().cloned())
    }

    fn remove_tls12_session(&self, server_name: &ServerName<'static>) {
        if let Some(e) = self.lock().entries.get_mut(server_name) {
            e.tls12 = None;
        }
    }

    /// Keeps only the newest ticket: the older one would only ever be used if the newest were
    /// taken and the connection that took it brought no new one.
    fn insert_tls13_ticket(
        &self,
        server_name: ServerName<'static>,
        value: Tls13ClientSessionValue,
    ) {
        self.update(server_name, |e| e.tls13 = Some(Box::new(value)));
    }

    fn take_tls13_ticket(
        &self,
        server_name: &ServerName<'static>,
    ) -> Option<Tls13ClientSessionValue> {
        self.lock()
            .entries
            .get_mut(server_name)
            .and_then(|e| e.tls13.take())
            .map(|value| *value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(i: u8) -> ServerName<'static> {
        ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, i]).into())
    }

    #[test]
    fn grows_with_the_servers_met_and_drops_the_oldest_past_its_bound() {
        let store = SessionStore::new(2);
        assert!(store.is_empty());
        store.set_kx_hint(name(1), NamedGroup::X25519);
        store.set_kx_hint(name(2), NamedGroup::secp256r1);
        // Updating a known server neither grows the store nor reorders it.
        store.set_kx_hint(name(1), NamedGroup::secp384r1);
        assert_eq!(store.len(), 2);
        store.set_kx_hint(name(3), NamedGroup::X25519);
        assert_eq!(store.len(), 2);
        assert_eq!(
            store.kx_hint(&name(1)),
            None,
            "the first server met is dropped"
        );
        assert_eq!(store.kx_hint(&name(2)), Some(NamedGroup::secp256r1));
        assert_eq!(store.kx_hint(&name(3)), Some(NamedGroup::X25519));
    }

    #[test]
    fn an_entry_is_small() {
        // Key and value of one map slot: an IP address and three pointer-sized fields.
        let slot = size_of::<ServerName<'static>>() + size_of::<Entry>();
        assert!(slot <= 64, "a slot is {slot} bytes");
        assert!(size_of::<Tls13ClientSessionValue>() > 100);
    }

    #[test]
    fn stays_at_its_bound_under_churn_with_one_name_per_entry() {
        let store = SessionStore::new(4);
        for round in 0..50u8 {
            for i in 0..8u8 {
                store.set_kx_hint(name(i.wrapping_add(round)), NamedGroup::X25519);
            }
        }
        let inner = store.lock();
        assert_eq!(inner.entries.len(), 4);
        assert_eq!(inner.order.len(), 4);
        assert!(inner.order.iter().all(|n| inner.entries.contains_key(n)));
    }
}
