//! ICMP echo to one address over an unprivileged ping socket, or a raw socket where the ping socket
//! is refused: the echo primitive shared by the ICMP and path-MTU probes, and the ICMP probe itself.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::sockopt::{self, Ipv4PathMtuDiscovery, Ipv6PathMtuDiscovery};
use rustix::net::{AddressFamily, SocketFlags, SocketType, ipproto};
use tokio::net::UdpSocket;
use tokio::time::Instant;

use super::Tally;
use super::validate::Plan;

/// Which ICMP socket the agent opens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IcmpSocketPolicy {
    /// A ping socket (`SOCK_DGRAM`/`IPPROTO_ICMP`) when `net.ipv4.ping_group_range` admits the
    /// agent's group, otherwise a raw socket (needs `CAP_NET_RAW`).
    #[default]
    Auto,
    /// Only a ping socket.
    PingOnly,
    /// Only a raw socket.
    RawOnly,
}

const ECHO_REQUEST_V4: u8 = 8;
const ECHO_REPLY_V4: u8 = 0;
const ECHO_REQUEST_V6: u8 = 128;
const ECHO_REPLY_V6: u8 = 129;
const ICMP_HEADER: usize = 8;

/// Why one echo got no reply.
#[derive(Debug)]
pub(super) enum EchoError {
    /// Nothing came back in time.
    Timeout,
    /// The packet is larger than the path MTU the kernel knows (EMSGSIZE), locally or after an
    /// ICMP "fragmentation needed"/"packet too big"; `kernel_mtu` is that MTU when readable.
    TooBig { kernel_mtu: Option<u32> },
    /// The kernel refused to send (no route, blackhole) or reported an ICMP error.
    Failed(String),
}

impl std::fmt::Display for EchoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout => f.write_str("no echo reply before the timeout"),
            Self::TooBig {
                kernel_mtu: Some(m),
            } => write!(f, "packet larger than the path MTU {m}"),
            Self::TooBig { kernel_mtu: None } => f.write_str("packet larger than the path MTU"),
            Self::Failed(e) => f.write_str(e),
        }
    }
}

/// An ICMP echo socket connected to one target. Connecting makes the kernel deliver only that
/// address's packets to a raw socket, report ICMP errors for it on this socket, and lets the path
/// MTU it learnt be read back.
pub(super) struct EchoSocket {
    /// The ICMP socket. tokio's `UdpSocket` is a thin readiness wrapper over send/recv on a
    /// datagram file descriptor, which ping and raw ICMP sockets are too; using it keeps this
    /// module free of `unsafe` (registering a bare fd with the reactor is unsafe).
    sock: UdpSocket,
    target: IpAddr,
    raw: bool,
    /// Our echo identifier. A ping socket's kernel replaces it with its own and matches replies
    /// itself; on a raw socket we match it.
    ident: u16,
    seq: u16,
    connected: Option<Result<(), String>>,
}

impl EchoSocket {
    pub(super) fn open(target: IpAddr, policy: IcmpSocketPolicy) -> Result<Self, String> {
        let (family, proto) = match target {
            IpAddr::V4(_) => (AddressFamily::INET, ipproto::ICMP),
            IpAddr::V6(_) => (AddressFamily::INET6, ipproto::ICMPV6),
        };
        let open = |ty| socket_with(family, ty, proto);
        let (fd, raw) = match policy {
            IcmpSocketPolicy::PingOnly => (open(SocketType::DGRAM).map_err(ping_refused)?, false),
            IcmpSocketPolicy::RawOnly => (open(SocketType::RAW).map_err(raw_refused)?, true),
            IcmpSocketPolicy::Auto => match open(SocketType::DGRAM) {
                Ok(fd) => (fd, false),
                Err(ping) => match open(SocketType::RAW) {
                    Ok(fd) => (fd, true),
                    Err(raw) => {
                        return Err(format!("{}; {}", ping_refused(ping), raw_refused(raw)));
                    }
                },
            },
        };
        let sock = UdpSocket::from_std(std::net::UdpSocket::from(fd))
            .map_err(|e| format!("register ICMP socket: {e}"))?;
        Ok(Self {
            sock,
            target,
            raw,
            ident: rand::random(),
            seq: 0,
            connected: None,
        })
    }

    /// Sets don't-fragment and makes the kernel refuse packets larger than the path MTU it knows.
    pub(super) fn set_dont_fragment(&self) -> Result<(), String> {
        let r = match self.target {
            IpAddr::V4(_) => sockopt::set_ip_mtu_discover(&self.sock, Ipv4PathMtuDiscovery::DO),
            IpAddr::V6(_) => sockopt::set_ipv6_mtu_discover(&self.sock, Ipv6PathMtuDiscovery::DO),
        };
        r.map_err(|e| format!("set IP_MTU_DISCOVER=DO: {}", io::Error::from(e)))
    }

    /// The path MTU the kernel holds for the target, if it has one.
    pub(super) fn kernel_mtu(&self) -> Option<u32> {
        match self.target {
            IpAddr::V4(_) => sockopt::ip_mtu(&self.sock).ok(),
            IpAddr::V6(_) => sockopt::ipv6_mtu(&self.sock).ok(),
        }
    }

    /// The bytes an echo adds around its payload: IP header (without options) and ICMP header.
    pub(super) fn overhead(&self) -> usize {
        ICMP_HEADER + if self.target.is_ipv4() { 20 } else { 40 }
    }

    /// Sends one echo request with `payload_len` bytes of payload and waits for its reply.
    pub(super) async fn echo(
        &mut self,
        payload_len: usize,
        timeout: Duration,
    ) -> Result<Duration, EchoError> {
        // A connect that failed (no route, blackhole) is retried on every probe: routes change.
        if !matches!(self.connected, Some(Ok(()))) {
            let r = rustix::net::connect(&self.sock, &SocketAddr::new(self.target, 0))
                .map_err(|e| format!("no route to {}: {}", self.target, io::Error::from(e)));
            self.connected = Some(r);
        }
        if let Some(Err(e)) = &self.connected {
            return Err(EchoError::Failed(e.clone()));
        }
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let packet = build_echo(self.target.is_ipv6(), self.ident, seq, payload_len);
        let start = Instant::now();
        let deadline = start + timeout;

        match tokio::time::timeout_at(deadline, self.sock.send(&packet)).await {
            Err(_) => return Err(EchoError::Timeout),
            Ok(Err(e)) => return Err(self.classify(e, "send echo request")),
            Ok(Ok(_)) => {}
        }

        let mut buf = vec![0u8; 65_536];
        // Bounded by the deadline; each turn consumes one packet.
        loop {
            match tokio::time::timeout_at(deadline, self.sock.recv(&mut buf)).await {
                Err(_) => return Err(EchoError::Timeout),
                Ok(Err(e)) => return Err(self.classify(e, "receive echo reply")),
                // Someone else's packet, or a late reply to an earlier probe: keep waiting.
                Ok(Ok(n)) => {
                    if self.is_reply(&buf[..n], seq) {
                        return Ok(start.elapsed());
                    }
                }
            }
        }
    }

    fn classify(&self, e: io::Error, what: &str) -> EchoError {
        if e.raw_os_error() == Some(Errno::MSGSIZE.raw_os_error()) {
            EchoError::TooBig {
                kernel_mtu: self.kernel_mtu(),
            }
        } else {
            EchoError::Failed(format!("{what} to {}: {e}", self.target))
        }
    }

    fn is_reply(&self, packet: &[u8], seq: u16) -> bool {
        // A raw IPv4 socket hands us the IP header too; IPv6 raw and all ping sockets do not.
        let icmp = if self.raw && self.target.is_ipv4() {
            let Some(&first) = packet.first() else {
                return false;
            };
            let ihl = usize::from(first & 0x0f) * 4;
            match packet.get(ihl..) {
                Some(rest) => rest,
                None => return false,
            }
        } else {
            packet
        };
        parse_reply(icmp, self.target.is_ipv6())
            .is_some_and(|(ident, s)| s == seq && (!self.raw || ident == self.ident))
    }
}

fn socket_with(
    family: AddressFamily,
    ty: SocketType,
    proto: rustix::net::Protocol,
) -> Result<OwnedFd, io::Error> {
    rustix::net::socket_with(
        family,
        ty,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        Some(proto),
    )
    .map_err(io::Error::from)
}

fn ping_refused(e: io::Error) -> String {
    format!("ping socket refused ({e}; net.ipv4.ping_group_range must include the agent's group)")
}

fn raw_refused(e: io::Error) -> String {
    format!("raw ICMP socket refused ({e}; needs CAP_NET_RAW)")
}

/// An echo request: type, code, checksum, identifier, sequence, then a recognisable payload.
pub(super) fn build_echo(v6: bool, ident: u16, seq: u16, payload_len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(ICMP_HEADER + payload_len);
    p.push(if v6 { ECHO_REQUEST_V6 } else { ECHO_REQUEST_V4 });
    p.push(0);
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(&ident.to_be_bytes());
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend((0..payload_len).map(|i| (i % 251) as u8));
    // The kernel fills in ICMPv6 checksums (they cover a pseudo-header we do not see), and a ping
    // socket rewrites the IPv4 one; a raw IPv4 socket sends ours as is.
    if !v6 {
        let sum = checksum(&p);
        p[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    p
}

/// The identifier and sequence of an echo reply, or `None` for any other ICMP message.
pub(super) fn parse_reply(icmp: &[u8], v6: bool) -> Option<(u16, u16)> {
    if icmp.len() < ICMP_HEADER {
        return None;
    }
    let reply = if v6 { ECHO_REPLY_V6 } else { ECHO_REPLY_V4 };
    if icmp[0] != reply || icmp[1] != 0 {
        return None;
    }
    Some((
        u16::from_be_bytes([icmp[4], icmp[5]]),
        u16::from_be_bytes([icmp[6], icmp[7]]),
    ))
}

/// The Internet checksum (RFC 1071): ones' complement of the ones' complement sum of 16-bit words.
pub(super) fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The ICMP probe: `count` echoes of 56 payload bytes (the size `ping` uses), one at a time.
pub(super) async fn probe(target: IpAddr, plan: &Plan, policy: IcmpSocketPolicy) -> Tally {
    let mut tally = Tally::default();
    let mut sock = match EchoSocket::open(target, policy) {
        Ok(s) => s,
        Err(e) => {
            tally.error = Some(e);
            return tally;
        }
    };
    for i in 0..plan.count {
        match sock.echo(56, plan.timeout).await {
            Ok(rtt) => tally.success(rtt),
            // A packet the kernel refused to send counts as sent and lost, so a blackholed target
            // shows 100 % loss rather than no data.
            Err(e) => tally.failure(e.to_string()),
        }
        super::pause(plan, i).await;
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_of_known_packet() {
        // Echo request, id 0x1234, seq 1, no payload: the words sum to 0x0800+0x1234+0x0001.
        let p = build_echo(false, 0x1234, 1, 0);
        assert_eq!(p, vec![8, 0, 0xe5, 0xca, 0x12, 0x34, 0, 1]);
        // A packet carrying its checksum sums to zero.
        assert_eq!(checksum(&p), 0);
        let odd = build_echo(false, 7, 9, 3);
        assert_eq!(checksum(&odd), 0);
    }

    #[test]
    fn replies_are_recognised() {
        let mut reply = build_echo(false, 0x1234, 5, 4);
        reply[0] = ECHO_REPLY_V4;
        assert_eq!(parse_reply(&reply, false), Some((0x1234, 5)));
        // The request itself, an ICMPv6 reply on a v4 socket, and short packets are not replies.
        assert_eq!(parse_reply(&build_echo(false, 1, 1, 0), false), None);
        assert_eq!(parse_reply(&reply, true), None);
        assert_eq!(parse_reply(&reply[..7], false), None);
        let mut v6 = build_echo(true, 9, 2, 0);
        v6[0] = ECHO_REPLY_V6;
        assert_eq!(parse_reply(&v6, true), Some((9, 2)));
    }
}
