//! Ports and loopback addresses for tests, benches and the demo. Everything here is on
//! 127.0.0.0/8: Linux answers on the whole block, so every simulated node can have an address
//! (and an agent listening on it) of its own.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener};

/// A TCP port that was free on `ip` a moment ago (bound, then released). Also serves as a port
/// nothing listens on, for connection-refused tests.
pub fn free_port_on(ip: Ipv4Addr) -> std::io::Result<u16> {
    Ok(TcpListener::bind(SocketAddrV4::new(ip, 0))?
        .local_addr()?
        .port())
}

/// A TCP port that was free on 127.0.0.1 a moment ago.
///
/// # Panics
/// When no port can be bound on 127.0.0.1 (a broken test machine).
pub fn free_port() -> u16 {
    free_port_on(Ipv4Addr::LOCALHOST).expect("bind a free port on 127.0.0.1")
}

/// Whether TCP `port` can be bound on `ip` now.
pub fn port_is_free(ip: Ipv4Addr, port: u16) -> bool {
    TcpListener::bind(SocketAddrV4::new(ip, port)).is_ok()
}

/// `preferred` when it is free on every address, else a port free on all of them (a few tries),
/// or `None`. For agents that must share one port across many node addresses.
pub fn port_free_on_all(ips: &[Ipv4Addr], preferred: u16) -> Option<u16> {
    let free_on_all = |port: u16| ips.iter().all(|ip| port_is_free(*ip, port));
    if free_on_all(preferred) {
        return Some(preferred);
    }
    let first = *ips.first()?;
    (0..20)
        .filter_map(|_| free_port_on(first).ok())
        .find(|port| free_on_all(*port))
}

/// Host `i` of the loopback block `127.<a>.0.0/16 …`: `127.a.0.1`, `127.a.0.2`, …, with 254 hosts
/// per third octet (never .0 or .255) and the second octet counting up from `a` once the third
/// is used up. Distinct for the first 65,024 × (256 - a) values of `i`.
pub fn indexed_loopback(a: u8, i: usize) -> Ipv4Addr {
    let per_b = 254;
    let per_a = per_b * 256;
    let second = usize::from(a) + i / per_a;
    let third = (i / per_b) % 256;
    let fourth = i % per_b + 1;
    Ipv4Addr::new(
        127,
        u8::try_from(second).unwrap_or(255),
        u8::try_from(third).unwrap_or(0),
        u8::try_from(fourth).unwrap_or(1),
    )
}

/// `n` distinct loopback addresses for one test, `127.<a>.<b>.1..=n` with `a` in 50..150 and `b`
/// random, so that tests running at the same time rarely collide.
///
/// # Panics
/// When `n` is over 254.
pub fn random_loopback_block(n: usize) -> Vec<Ipv4Addr> {
    let a = 50 + (rand::random::<u8>() % 100);
    let b = rand::random::<u8>();
    (0..n)
        .map(|i| {
            Ipv4Addr::new(
                127,
                a,
                b,
                u8::try_from(i + 1).expect("at most 254 addresses"),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn indexed_addresses_are_distinct_loopback_host_addresses() {
        let ips: HashSet<Ipv4Addr> = (0..70_000).map(|i| indexed_loopback(100, i)).collect();
        assert_eq!(ips.len(), 70_000);
        assert!(
            ips.iter()
                .all(|ip| ip.octets()[0] == 127 && ip.octets()[3] != 0 && ip.octets()[3] != 255)
        );
        assert_eq!(indexed_loopback(1, 0), Ipv4Addr::new(127, 1, 0, 1));
        assert_eq!(indexed_loopback(1, 254), Ipv4Addr::new(127, 1, 1, 1));
    }

    #[test]
    fn a_free_port_can_be_bound_and_a_taken_one_cannot() {
        let port = free_port();
        let held = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).unwrap();
        assert!(!port_is_free(Ipv4Addr::LOCALHOST, port));
        let ips = random_loopback_block(3);
        let shared = port_free_on_all(&ips, port).unwrap();
        assert!(ips.iter().all(|ip| port_is_free(*ip, shared)));
        drop(held);
    }
}
