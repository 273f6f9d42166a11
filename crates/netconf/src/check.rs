//! The post-apply reachability check: each target must answer an ICMP echo (`address`) or accept
//! a TCP connection (`address:port`) before the deadline.
//!
//! Sockets are opened on the calling thread, so they live in that thread's network namespace —
//! the same one the netlink connection was opened in.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, SockaddrIn6,
    SockaddrStorage, recvfrom, sendto, socket,
};
use tokio::io::unix::AsyncFd;

/// One reachability target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Icmp(IpAddr),
    Tcp(SocketAddr),
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Target::Icmp(ip));
        }
        if let Ok(sa) = s.parse::<SocketAddr>() {
            return Ok(Target::Tcp(sa));
        }
        Err(format!(
            "check target {s:?} is neither an address nor address:port (IPv6 with port: [addr]:port)"
        ))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Icmp(ip) => write!(f, "icmp {ip}"),
            Target::Tcp(sa) => write!(f, "tcp {sa}"),
        }
    }
}

/// Checks every target (concurrently) within `timeout`; returns the first failure in words.
pub async fn check_all(targets: &[Target], timeout: Duration) -> Result<(), String> {
    let checks = targets.iter().map(|t| async move {
        match tokio::time::timeout(timeout, check_one(t)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("{t}: {e}")),
            Err(_) => Err(format!("{t}: no answer within {} ms", timeout.as_millis())),
        }
    });
    for r in futures::future::join_all(checks).await {
        r?;
    }
    Ok(())
}

async fn check_one(t: &Target) -> Result<(), String> {
    match t {
        Target::Tcp(sa) => tokio::net::TcpStream::connect(sa)
            .await
            .map(drop)
            .map_err(|e| e.to_string()),
        Target::Icmp(ip) => ping(*ip).await,
    }
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        let word = u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Sends ICMP echo requests (one every 200 ms) until a matching reply arrives; the caller bounds
/// the time. Uses a raw socket, so it needs CAP_NET_RAW (the agent runs as root).
async fn ping(ip: IpAddr) -> Result<(), String> {
    let v6 = ip.is_ipv6();
    let fd = socket(
        if v6 {
            AddressFamily::Inet6
        } else {
            AddressFamily::Inet
        },
        SockType::Raw,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        if v6 {
            SockProtocol::IcmpV6
        } else {
            SockProtocol::Icmp
        },
    )
    .map_err(|e| format!("open raw ICMP socket: {e}"))?;
    // `AsyncFd::new` is deprecated for types whose fd could be closed behind tokio's back; this
    // `OwnedFd` is moved in and closed only when the `AsyncFd` drops, so the concern does not
    // apply, and the replacement (`register`) is `unsafe`, which this workspace forbids.
    #[allow(deprecated)]
    let afd = AsyncFd::new(fd).map_err(|e| e.to_string())?;
    let id = (std::process::id() as u16) ^ 0x4e4b;
    let mut seq: u16 = 0;
    loop {
        seq = seq.wrapping_add(1);
        let mut pkt = vec![if v6 { 128 } else { 8 }, 0, 0, 0];
        pkt.extend_from_slice(&id.to_be_bytes());
        pkt.extend_from_slice(&seq.to_be_bytes());
        pkt.extend_from_slice(b"nodekeeper-check");
        if !v6 {
            // The kernel fills in the ICMPv6 checksum itself; ICMPv4's is ours to compute.
            let c = checksum(&pkt);
            pkt[2..4].copy_from_slice(&c.to_be_bytes());
        }
        let res = match ip {
            IpAddr::V4(a) => sendto(
                afd.as_raw_fd(),
                &pkt,
                &SockaddrIn::from(std::net::SocketAddrV4::new(a, 0)),
                MsgFlags::empty(),
            ),
            IpAddr::V6(a) => sendto(
                afd.as_raw_fd(),
                &pkt,
                &SockaddrIn6::from(std::net::SocketAddrV6::new(a, 0, 0, 0)),
                MsgFlags::empty(),
            ),
        };
        if let Err(e) = res {
            // EHOSTUNREACH/ENETUNREACH: no route yet; keep trying until the deadline.
            tracing::debug!(%ip, error = %e, "icmp send failed");
        }
        let wait = tokio::time::sleep(Duration::from_millis(200));
        tokio::pin!(wait);
        loop {
            tokio::select! {
                _ = &mut wait => break,
                guard = afd.readable() => {
                    let mut guard = guard.map_err(|e| e.to_string())?;
                    let mut buf = [0u8; 1500];
                    match recvfrom::<SockaddrStorage>(afd.as_raw_fd(), &mut buf) {
                        Ok((n, from)) => {
                            let data = &buf[..n];
                            let icmp = if v6 { data } else {
                                let ihl = usize::from(data.first().copied().unwrap_or(0) & 0x0f) * 4;
                                data.get(ihl..).unwrap_or(&[])
                            };
                            let from_ip = from.and_then(|s| {
                                s.as_sockaddr_in().map(|a| IpAddr::V4(a.ip()))
                                    .or_else(|| s.as_sockaddr_in6().map(|a| IpAddr::V6(a.ip())))
                            });
                            let reply_type = if v6 { 129 } else { 0 };
                            if icmp.len() >= 8 && icmp[0] == reply_type && icmp[4..6] == id.to_be_bytes() && from_ip == Some(ip) {
                                return Ok(());
                            }
                        }
                        Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
                        Err(e) => return Err(format!("receive: {e}")),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!(
            "10.0.0.1".parse::<Target>().unwrap(),
            Target::Icmp("10.0.0.1".parse().unwrap())
        );
        assert_eq!(
            "10.0.0.1:80".parse::<Target>().unwrap(),
            Target::Tcp("10.0.0.1:80".parse().unwrap())
        );
        assert_eq!(
            "[fd00::1]:443".parse::<Target>().unwrap(),
            Target::Tcp("[fd00::1]:443".parse().unwrap())
        );
        assert!("example.com".parse::<Target>().is_err());
    }

    #[test]
    fn icmp_checksum_matches_rfc1071_example() {
        // Echo request, id 1, seq 1, no payload: 08 00 [f7 fd] 00 01 00 01.
        let pkt = [8u8, 0, 0, 0, 0, 1, 0, 1];
        assert_eq!(checksum(&pkt), 0xf7fd);
    }
}
