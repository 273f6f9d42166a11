//! Network namespaces for tests and benches: create one (named, through `ip netns add`, or
//! anonymous, for a VM guest without iproute2), configure it with `ip -n`, run code inside it on
//! a thread of its own, and delete it on drop.
//!
//! Entering a namespace (`setns`) changes only the calling thread, and a tokio runtime's sockets
//! belong to the namespace of the thread that opens them, so code runs inside on a fresh thread
//! with its own current-thread runtime.

use std::fs::File;
use std::future::Future;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sched::{CloneFlags, setns, unshare};

use crate::Error;

/// A network namespace this process created; deleted (with its links) when dropped.
pub struct Netns {
    /// `None` for an anonymous namespace, which lives as long as `entry` holds its file.
    name: Option<String>,
    entry: NetnsEntry,
}

/// A way into a namespace that can be cloned into closures and threads; it does not delete the
/// namespace, and keeps an anonymous one alive.
#[derive(Clone)]
pub struct NetnsEntry {
    file: Arc<File>,
}

impl Netns {
    /// `ip netns add <prefix>-<pid>-<n>`: a fresh, empty namespace (loopback down), unique within
    /// this machine.
    pub fn new(prefix: &str) -> Result<Netns, Error> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        // A namespace left by a killed run with the same pid would make `add` fail.
        let _ = run("ip", &["netns", "del", &name]);
        run("ip", &["netns", "add", &name])?;
        let path = format!("/run/netns/{name}");
        // From here on, Drop deletes the namespace, also when opening it fails.
        let file = File::open(&path);
        let ns = Netns {
            name: Some(name),
            entry: NetnsEntry {
                file: Arc::new(file.map_err(|source| Error::Io {
                    context: format!("open {path}"),
                    source,
                })?),
            },
        };
        Ok(ns)
    }

    /// [`Netns::new`], then loopback up and IPv6 duplicate address detection off: while an
    /// address is tentative the kernel drops packets to it, which would be the setup's fault and
    /// not the code's under test; the addresses in a test namespace are the test's alone.
    pub fn with_loopback(prefix: &str) -> Result<Netns, Error> {
        let ns = Netns::new(prefix)?;
        ns.set_sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        ns.set_sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// A namespace without a name (`unshare`), for places without iproute2 (a VM guest's
    /// initramfs): it exists as long as this value or an entry holds it; [`Netns::ip`] and the
    /// other `ip`-based helpers refuse it.
    pub fn anonymous() -> Result<Netns, Error> {
        let file = std::thread::spawn(|| -> Result<File, Error> {
            unshare(CloneFlags::CLONE_NEWNET).map_err(|source| Error::Namespace {
                context: "unshare the network namespace".into(),
                source,
            })?;
            File::open("/proc/thread-self/ns/net").map_err(|source| Error::Io {
                context: "open /proc/thread-self/ns/net".into(),
                source,
            })
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        Ok(Netns {
            name: None,
            entry: NetnsEntry {
                file: Arc::new(file),
            },
        })
    }

    /// The name `ip netns` knows it by.
    ///
    /// # Panics
    /// For an anonymous namespace.
    pub fn name(&self) -> &str {
        self.name
            .as_deref()
            .expect("an anonymous network namespace has no name")
    }

    /// The open namespace file (for `setns`, or to move a link in by file descriptor).
    pub fn file(&self) -> &File {
        &self.entry.file
    }

    /// A cloneable way in, for closures that outlive a borrow of this value.
    pub fn entry(&self) -> NetnsEntry {
        self.entry.clone()
    }

    /// `ip -n <name> <args…>`; returns its stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String, Error> {
        let name = self.name.as_deref().ok_or(Error::Anonymous)?;
        let mut all = vec!["-n", name];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// `ip netns exec <name> <args…>`: a program run inside; returns its stdout.
    pub fn exec(&self, args: &[&str]) -> Result<String, Error> {
        let name = self.name.as_deref().ok_or(Error::Anonymous)?;
        let mut all = vec!["netns", "exec", name];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// A sysctl's value inside (`net.*` keys are per namespace).
    pub fn sysctl(&self, key: &str) -> Result<String, Error> {
        Ok(self.exec(&["sysctl", "-n", key])?.trim().to_owned())
    }

    /// Sets a sysctl inside.
    pub fn set_sysctl(&self, key: &str, value: &str) -> Result<(), Error> {
        self.exec(&["sysctl", "-qw", &format!("{key}={value}")])
            .map(drop)
    }

    /// A veth pair `name` (here) – `peer_name` (in `peer`, or here when `None`), with `extra`
    /// `ip link add` arguments for this end (e.g. `["mtu", "1400"]`, `["address", mac]`). Both
    /// ends stay down.
    pub fn add_veth(
        &self,
        name: &str,
        extra: &[&str],
        peer_name: &str,
        peer: Option<&Netns>,
    ) -> Result<(), Error> {
        let mut args = vec!["link", "add", name];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["type", "veth", "peer", "name", peer_name]);
        if let Some(peer) = peer {
            args.extend_from_slice(&["netns", peer.name.as_deref().ok_or(Error::Anonymous)?]);
        }
        self.ip(&args).map(drop)
    }

    /// Adds `cidr` to `dev` and sets `dev` up.
    pub fn address_up(&self, dev: &str, cidr: &str) -> Result<(), Error> {
        self.ip(&["addr", "add", cidr, "dev", dev])?;
        self.ip(&["link", "set", dev, "up"]).map(drop)
    }

    /// Runs `make()`'s future inside, on a new thread with a current-thread runtime, and waits
    /// for it. A panic inside (a failed assertion) is re-raised here.
    ///
    /// # Panics
    /// When the thread cannot enter the namespace or build its runtime.
    pub fn run<T, F, Fut>(&self, make: F) -> T
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T>,
    {
        self.entry.run(make)
    }

    /// Runs `f` inside, on a new thread, and waits for it (for code that reads per-namespace
    /// files such as `/proc/sys/net`, which show the namespace of the reading thread).
    pub fn run_blocking<T, F>(&self, f: F) -> T
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        join(self.entry.spawn_blocking(f))
    }
}

impl NetnsEntry {
    /// Enters the namespace on the calling thread.
    pub fn enter(&self) -> Result<(), Error> {
        setns(&*self.file, CloneFlags::CLONE_NEWNET).map_err(|source| Error::Namespace {
            context: "enter the network namespace (setns)".into(),
            source,
        })
    }

    /// [`Netns::run`] through an entry.
    pub fn run<T, F, Fut>(&self, make: F) -> T
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T>,
    {
        join(self.spawn(make))
    }

    /// Starts `make()`'s future inside on a new thread with a current-thread runtime and returns
    /// the thread; for servers that run while the test goes on.
    pub fn spawn<T, F, Fut>(&self, make: F) -> std::thread::JoinHandle<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = T>,
    {
        self.spawn_blocking(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("build a tokio runtime")
                .block_on(make())
        })
    }

    /// Starts `f` inside on a new thread and returns the thread.
    pub fn spawn_blocking<T, F>(&self, f: F) -> std::thread::JoinHandle<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let entry = self.clone();
        std::thread::spawn(move || {
            entry.enter().expect("enter the network namespace");
            f()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Some(name) = &self.name {
            let _ = run("ip", &["netns", "del", name]);
        }
    }
}

fn join<T>(thread: std::thread::JoinHandle<T>) -> T {
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Runs `program args…`; its stdout, or an error with its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<String, Error> {
    let command = format!("{program} {}", args.join(" "));
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|source| Error::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(Error::Command {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_separate_and_gone_after_drop() -> Result<(), Error> {
        crate::skip_unless_root!("needs root to create network namespaces");
        let a = Netns::with_loopback("nk-testkit")?;
        let b = Netns::new("nk-testkit")?;
        a.add_veth("ta", &["mtu", "1400"], "tb", Some(&b))?;
        a.address_up("ta", "10.99.0.1/24")?;
        b.address_up("tb", "10.99.0.2/24")?;
        assert!(a.ip(&["link", "show", "ta"])?.contains("mtu 1400"));
        // Sysctls are per namespace: forwarding set in `a` is not set in `b`.
        a.set_sysctl("net.ipv4.ip_forward", "1")?;
        assert_eq!(a.sysctl("net.ipv4.ip_forward")?, "1");
        assert_eq!(b.sysctl("net.ipv4.ip_forward")?, "0");
        // Code run inside sees the namespace's links, and a socket opened there is there.
        let links =
            b.run_blocking(|| std::fs::read_to_string("/proc/thread-self/net/dev").unwrap());
        assert!(links.contains("tb:") && !links.contains("ta:"), "{links}");
        let bound = a.run(|| async { tokio::net::TcpListener::bind("10.99.0.1:0").await.is_ok() });
        assert!(bound, "10.99.0.1 is an address inside `a`");
        assert!(
            std::net::TcpListener::bind("10.99.0.1:0").is_err(),
            "and not in this process's namespace"
        );
        let name = a.name().to_owned();
        drop(a);
        assert!(!run("ip", &["netns", "list"])?.contains(&name));
        Ok(())
    }

    #[test]
    fn an_anonymous_namespace_can_be_entered_and_has_no_name() -> Result<(), Error> {
        crate::skip_unless_root!("needs root to create network namespaces");
        let ns = Netns::anonymous()?;
        assert!(matches!(ns.ip(&["link"]), Err(Error::Anonymous)));
        let links =
            ns.run_blocking(|| std::fs::read_to_string("/proc/thread-self/net/dev").unwrap());
        assert_eq!(links.lines().count(), 3, "only lo: {links}");
        Ok(())
    }
}
