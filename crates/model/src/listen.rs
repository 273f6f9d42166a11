//! Listening on the IPv6 unspecified address by default, shared by the agent and the controller.
//! `[::]` takes IPv4 and IPv6 alike on Linux (IPv4 arrives mapped, unless the host sets
//! `net.ipv6.bindv6only`); on a host without IPv6 (`ipv6.disable=1`) it cannot be bound, and the
//! process listens on `0.0.0.0` instead rather than not start.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Linux's errno values (both binaries run on Linux only; no libc dependency for two numbers).
const EAFNOSUPPORT: i32 = 97;
const EADDRNOTAVAIL: i32 = 99;

/// Where to listen instead when binding `addr` failed with `error`: `0.0.0.0` on the same port
/// when `addr` is `[::]` and the host has no IPv6 (the socket family is not supported, or the
/// address is not available). Any other address or error stands: the flag named it.
pub fn ipv4_fallback(addr: SocketAddr, error: &std::io::Error) -> Option<SocketAddr> {
    let no_ipv6 = matches!(error.raw_os_error(), Some(EAFNOSUPPORT | EADDRNOTAVAIL));
    (addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) && no_ipv6)
        .then(|| SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_unspecified_ipv6_address_falls_back_and_only_without_ipv6() {
        let error = std::io::Error::from_raw_os_error;
        let any6: SocketAddr = "[::]:9443".parse().unwrap();
        for errno in [EAFNOSUPPORT, EADDRNOTAVAIL] {
            assert_eq!(
                ipv4_fallback(any6, &error(errno)),
                Some("0.0.0.0:9443".parse().unwrap())
            );
        }
        // A port in use (EADDRINUSE) is not a missing IPv6: the error stands.
        assert_eq!(ipv4_fallback(any6, &error(98)), None);
        // An address the operator named is not second-guessed.
        for named in [
            "[fd00::5]:9443",
            "[::1]:9443",
            "0.0.0.0:9443",
            "10.0.0.5:9443",
        ] {
            let named: SocketAddr = named.parse().unwrap();
            assert_eq!(ipv4_fallback(named, &error(EADDRNOTAVAIL)), None);
        }
    }
}
