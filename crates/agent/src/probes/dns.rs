//! The DNS probe: A and AAAA queries over UDP to one resolver (the target's, or the node's first
//! `nameserver`), with the small part of RFC 1035 message encoding and decoding that needs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use tokio::net::UdpSocket;
use tokio::time::Instant;

use super::Tally;
use super::validate::Plan;

const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;
const CLASS_IN: u16 = 1;
const HEADER: usize = 12;
const FLAG_QR: u16 = 0x8000;
const FLAG_TC: u16 = 0x0200;
const FLAG_RD: u16 = 0x0100;

/// Runs `count` lookups of `name`; returns the tally and the addresses of the last good answer.
pub(super) async fn probe(
    resolver: Option<SocketAddr>,
    name: &str,
    plan: &Plan,
    resolv_conf: &Path,
) -> (Tally, Vec<String>) {
    let mut tally = Tally::default();
    let mut answers = Vec::new();
    let resolver = match resolver {
        Some(r) => r,
        None => match node_resolver(resolv_conf) {
            Ok(r) => r,
            Err(e) => {
                tally.error = Some(e);
                return (tally, answers);
            }
        },
    };
    for i in 0..plan.count {
        let start = Instant::now();
        match tokio::time::timeout(plan.timeout, lookup(resolver, name)).await {
            Ok(Ok(addrs)) if addrs.is_empty() => {
                tally.failure(format!(
                    "{name}: resolver {resolver} returned no A or AAAA records"
                ));
            }
            Ok(Ok(addrs)) => {
                tally.success(start.elapsed());
                answers = addrs.iter().map(ToString::to_string).collect();
            }
            Ok(Err(e)) => tally.failure(format!("{name}: {e}")),
            Err(_) => tally.failure(format!(
                "{name}: no answer from resolver {resolver} within {:?}",
                plan.timeout
            )),
        }
        super::pause(plan, i).await;
    }
    (tally, answers)
}

/// The first usable `nameserver` of a resolv.conf.
pub(super) fn node_resolver(path: &Path) -> Result<SocketAddr, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("read node resolver from {}: {e}", path.display()))?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
        .ok_or_else(|| {
            format!(
                "{} names no usable nameserver; give the resolver in the target's address",
                path.display()
            )
        })
}

/// Queries A and AAAA at once and waits for both answers.
async fn lookup(resolver: SocketAddr, name: &str) -> Result<Vec<IpAddr>, String> {
    let local: SocketAddr = match resolver {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(local)
        .await
        .map_err(|e| format!("open UDP socket: {e}"))?;
    // Connected, so the kernel drops datagrams from anyone but the resolver and reports its ICMP
    // port-unreachable as ECONNREFUSED.
    sock.connect(resolver)
        .await
        .map_err(|e| format!("no route to resolver {resolver}: {e}"))?;
    let id_a: u16 = rand::random();
    let id_aaaa = id_a.wrapping_add(1);
    for (id, qtype) in [(id_a, TYPE_A), (id_aaaa, TYPE_AAAA)] {
        sock.send(&build_query(id, name, qtype))
            .await
            .map_err(|e| format!("send query to resolver {resolver}: {e}"))?;
    }
    let mut v4 = None;
    let mut v6 = None;
    let mut buf = vec![0u8; 4096];
    // Bounded by the caller's timeout; each turn consumes one datagram.
    while v4.is_none() || v6.is_none() {
        let n = sock
            .recv(&mut buf)
            .await
            .map_err(|e| format!("receive from resolver {resolver}: {e}"))?;
        let Ok(resp) = parse_response(&buf[..n]) else {
            continue;
        };
        let slot = match resp.id {
            id if id == id_a => &mut v4,
            id if id == id_aaaa => &mut v6,
            _ => continue,
        };
        match resp.rcode {
            0 => {}
            3 => return Err(format!("name does not exist (NXDOMAIN from {resolver})")),
            rcode => {
                return Err(format!(
                    "resolver {resolver} answered {}",
                    rcode_name(rcode)
                ));
            }
        }
        if resp.truncated && resp.addrs.is_empty() {
            return Err(format!(
                "resolver {resolver} sent a truncated answer with no addresses"
            ));
        }
        *slot = Some(resp.addrs);
    }
    let mut addrs = v4.unwrap_or_default();
    for a in v6.unwrap_or_default() {
        if !addrs.contains(&a) {
            addrs.push(a);
        }
    }
    Ok(addrs)
}

fn rcode_name(rcode: u16) -> String {
    match rcode {
        1 => "FORMERR".into(),
        2 => "SERVFAIL".into(),
        4 => "NOTIMP".into(),
        5 => "REFUSED".into(),
        n => format!("rcode {n}"),
    }
}

/// A recursive query for `name` (presentation form, already checked) of type `qtype`.
pub(super) fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER + name.len() + 6);
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&FLAG_RD.to_be_bytes());
    m.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]); // one question, no other records
    for label in name
        .trim_end_matches('.')
        .split('.')
        .filter(|l| !l.is_empty())
    {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&CLASS_IN.to_be_bytes());
    m
}

/// What the probe needs from a response.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Response {
    pub id: u16,
    pub rcode: u16,
    pub truncated: bool,
    /// A and AAAA records of class IN in the answer section, in order.
    pub addrs: Vec<IpAddr>,
}

pub(super) fn parse_response(m: &[u8]) -> Result<Response, String> {
    let u16_at = |i: usize| -> Result<u16, String> {
        m.get(i..i + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or_else(|| "message ends early".to_owned())
    };
    let id = u16_at(0)?;
    let flags = u16_at(2)?;
    if flags & FLAG_QR == 0 {
        return Err("not a response".into());
    }
    let qdcount = u16_at(4)?;
    let ancount = u16_at(6)?;
    let mut pos = HEADER;
    for _ in 0..qdcount {
        pos = skip_name(m, pos)? + 4;
    }
    let mut addrs = Vec::new();
    for _ in 0..ancount {
        pos = skip_name(m, pos)?;
        let rtype = u16_at(pos)?;
        let class = u16_at(pos + 2)?;
        let len = usize::from(u16_at(pos + 8)?);
        let start = pos + 10;
        let data = m
            .get(start..start + len)
            .ok_or("record data runs past the message")?;
        match (rtype, class, len) {
            (TYPE_A, CLASS_IN, 4) => addrs.push(IpAddr::from(
                <[u8; 4]>::try_from(data).expect("length checked"),
            )),
            (TYPE_AAAA, CLASS_IN, 16) => addrs.push(IpAddr::from(
                <[u8; 16]>::try_from(data).expect("length checked"),
            )),
            // CNAMEs and anything else are skipped; the addresses they lead to follow in the section.
            _ => {}
        }
        pos = start + len;
    }
    Ok(Response {
        id,
        rcode: flags & 0x000f,
        truncated: flags & FLAG_TC != 0,
        addrs,
    })
}

/// The offset just past the (possibly compressed) name starting at `pos`.
fn skip_name(m: &[u8], mut pos: usize) -> Result<usize, String> {
    // A name has at most 127 labels; the bound keeps a malicious message from looping us.
    for _ in 0..128 {
        let len = *m.get(pos).ok_or("name runs past the message")?;
        match len & 0xc0 {
            0x00 if len == 0 => return Ok(pos + 1),
            0x00 => pos += 1 + usize::from(len),
            0xc0 => {
                m.get(pos + 1).ok_or("name pointer runs past the message")?;
                return Ok(pos + 2);
            }
            _ => return Err(format!("unsupported label type {len:#04x}")),
        }
    }
    Err("name has too many labels".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_encoding() {
        let q = build_query(0xbeef, "a.example.", TYPE_AAAA);
        let expected: Vec<u8> = [
            &[0xbe, 0xef, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0][..],
            &[1, b'a', 7, b'e', b'x', b'a', b'm', b'p', b'l', b'e', 0],
            &[0, 28, 0, 1],
        ]
        .concat();
        assert_eq!(q, expected);
    }

    /// A response to `build_query(7, "a.example", A)` with a CNAME and an A record, using
    /// compression pointers as real servers do.
    fn sample_response() -> Vec<u8> {
        let mut m = build_query(7, "a.example", TYPE_A);
        m[2] = 0x81; // QR, RD
        m[3] = 0x80; // RA, rcode 0
        m[7] = 2; // two answers
        // a.example CNAME b.a.example
        m.extend_from_slice(&[0xc0, 12, 0, 5, 0, 1, 0, 0, 0, 60, 0, 4, 1, b'b', 0xc0, 12]);
        // b.a.example A 10.1.2.3
        m.extend_from_slice(&[0xc0, 39, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 10, 1, 2, 3]);
        m
    }

    #[test]
    fn response_decoding() {
        let r = parse_response(&sample_response()).unwrap();
        assert_eq!(
            r,
            Response {
                id: 7,
                rcode: 0,
                truncated: false,
                addrs: vec!["10.1.2.3".parse().unwrap()]
            }
        );
    }

    #[test]
    fn nxdomain_and_garbage() {
        let mut m = build_query(9, "nope.example", TYPE_A);
        m[2] = 0x81;
        m[3] = 0x83;
        assert_eq!(parse_response(&m).unwrap().rcode, 3);
        // Our own query is not a response; cut messages and bad labels are errors, not panics.
        assert!(parse_response(&build_query(9, "x", TYPE_A)).is_err());
        let full = sample_response();
        for cut in 0..full.len() {
            assert!(
                parse_response(&full[..cut]).is_err(),
                "cut at {cut} accepted"
            );
        }
        let mut bad = sample_response();
        bad[HEADER] = 0x80;
        assert!(parse_response(&bad).is_err());
    }

    #[test]
    fn resolv_conf_parsing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("resolv.conf");
        std::fs::write(
            &p,
            "# comment\nsearch svc.cluster.local\nnameserver fe80::1%eth0\nnameserver 10.96.0.10\n",
        )
        .unwrap();
        assert_eq!(node_resolver(&p).unwrap(), "10.96.0.10:53".parse().unwrap());
        std::fs::write(&p, "search x\n").unwrap();
        assert!(
            node_resolver(&p)
                .unwrap_err()
                .contains("no usable nameserver")
        );
    }
}
