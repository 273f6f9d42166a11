//! Probes across real network namespaces that the test creates and deletes (root only): a client
//! "node" A, a router R and a server "node" B, where the R–B link has MTU 1400, one address is
//! blackholed in A's routing table and one subnet is silently dropped by R. B runs a real TCP
//! listener, HTTP server and DNS server. Every packet stays inside these namespaces.
//!
//! ```text
//!  A 10.77.1.2 ── veth mtu 1500 ── 10.77.1.1 R 10.77.2.1 ── veth mtu 1400 ── 10.77.2.2 B
//! ```

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context as _;
use nodekeeper_agent::probes::{self, IcmpSocketPolicy, ProbeOptions};
use nodekeeper_proto::agent::v1::{ProbeKind, ProbeTarget, RunProbesRequest, RunProbesResponse};
use nodekeeper_testkit::{Netns, skip_unless_root};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

const B: &str = "10.77.2.2";
const R_NEAR: &str = "10.77.1.1";
/// Blackholed in A's own routing table: the kernel refuses to send.
const LOCAL_BLACKHOLE: &str = "10.77.9.9";
/// Routed by A to R, which drops it without a word.
const REMOTE_BLACKHOLE: &str = "10.77.3.3";

/// `key=value` inside `ns`.
fn sysctl(ns: &Netns, kv: &str) -> anyhow::Result<()> {
    let (key, value) = kv.split_once('=').context("key=value")?;
    Ok(ns.set_sysctl(key, value)?)
}

/// The three namespaces; deleted on drop (which also deletes their veths).
struct Topology {
    a: Netns,
    r: Netns,
    b: Netns,
}

impl Topology {
    fn create() -> anyhow::Result<Self> {
        let t = Self {
            a: Netns::with_loopback("nkpr-a")?,
            r: Netns::with_loopback("nkpr-r")?,
            b: Netns::with_loopback("nkpr-b")?,
        };
        let (a, r, b) = (&t.a, &t.r, &t.b);
        a.add_veth("va", &[], "ra", Some(r))?;
        r.add_veth("rb", &["mtu", "1400"], "vb", Some(b))?;
        b.ip(&["link", "set", "vb", "mtu", "1400"])?;
        for (ns, dev, addr) in [
            (a, "va", "10.77.1.2/24"),
            (r, "ra", "10.77.1.1/24"),
            (r, "rb", "10.77.2.1/24"),
            (b, "vb", "10.77.2.2/24"),
        ] {
            ns.address_up(dev, addr)?;
        }
        sysctl(r, "net.ipv4.ip_forward=1")?;
        a.ip(&["route", "add", "10.77.2.0/24", "via", R_NEAR])?;
        a.ip(&["route", "add", "10.77.3.0/24", "via", R_NEAR])?;
        a.ip(&[
            "route",
            "add",
            "blackhole",
            &format!("{LOCAL_BLACKHOLE}/32"),
        ])?;
        r.ip(&["route", "add", "blackhole", "10.77.3.0/24"])?;
        b.ip(&["route", "add", "10.77.1.0/24", "via", "10.77.2.1"])?;
        // The same over IPv6.
        for (ns, dev, addr) in [
            (a, "va", "fd77:1::2/64"),
            (r, "ra", "fd77:1::1/64"),
            (r, "rb", "fd77:2::1/64"),
            (b, "vb", "fd77:2::2/64"),
        ] {
            ns.ip(&["addr", "add", addr, "dev", dev, "nodad"])?;
        }
        sysctl(r, "net.ipv6.conf.all.forwarding=1")?;
        a.ip(&["route", "add", "fd77:2::/64", "via", "fd77:1::1"])?;
        b.ip(&["route", "add", "fd77:1::/64", "via", "fd77:2::1"])?;
        Ok(t)
    }
}

/// B's servers: TCP on :7000, HTTP on :8080 (`/ok` 200, else 404), DNS on :53 (`web.test` A
/// 10.77.2.2, other names NXDOMAIN). They run until the returned sender is dropped.
fn start_servers(ns: &Netns) -> tokio::sync::oneshot::Sender<()> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = mpsc::channel();
    ns.entry().spawn(move || async move {
        let tcp = TcpListener::bind((B, 7000)).await.expect("bind tcp");
        let http = TcpListener::bind((B, 8080)).await.expect("bind http");
        let dns = UdpSocket::bind((B, 53)).await.expect("bind dns");
        ready_tx.send(()).unwrap();
        let serve = async {
            let mut buf = [0u8; 512];
            loop {
                tokio::select! {
                    Ok((c, _)) = tcp.accept() => drop(c),
                    Ok((mut c, _)) = http.accept() => { let _ = http_respond(&mut c).await; }
                    Ok((n, peer)) = dns.recv_from(&mut buf) => {
                        if let Some(r) = dns_answer(&buf[..n]) {
                            let _ = dns.send_to(&r, peer).await;
                        }
                    }
                    else => break,
                }
            }
        };
        tokio::select! {
            _ = stop_rx => {}
            () = serve => {}
        }
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("servers did not start");
    stop_tx
}

async fn http_respond(conn: &mut tokio::net::TcpStream) -> std::io::Result<()> {
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        req.extend_from_slice(&buf[..n]);
    }
    let resp: &[u8] = if req.starts_with(b"GET /ok ") {
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    } else {
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    };
    conn.write_all(resp).await?;
    conn.shutdown().await
}

/// The answer to one query: `web.test` A → 10.77.2.2 (no AAAA, NOERROR); other names NXDOMAIN.
fn dns_answer(q: &[u8]) -> Option<Vec<u8>> {
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*q.get(pos)?);
        pos += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(pos..pos + len)?).to_ascii_lowercase());
        pos += len;
    }
    let qtype = u16::from_be_bytes([*q.get(pos)?, *q.get(pos + 1)?]);
    let found = labels.join(".") == "web.test";
    let answer = found && qtype == 1;
    let mut r = q.get(0..2)?.to_vec();
    r.extend_from_slice(&[
        0x81,
        if found { 0x80 } else { 0x83 },
        0,
        1,
        0,
        u8::from(answer),
        0,
        0,
        0,
        0,
    ]);
    r.extend_from_slice(q.get(12..pos + 4)?);
    if answer {
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4, 10, 77, 2, 2]);
    }
    Some(r)
}

fn request(kind: ProbeKind, targets: Vec<ProbeTarget>) -> RunProbesRequest {
    RunProbesRequest {
        run_id: "test/netns".into(),
        kind: kind as i32,
        targets,
        count: 3,
        interval_ms: 20,
        timeout_ms: 500,
        // These tests judge the probes, not the address policy: every address is allowed.
        allowed_cidrs: vec!["0.0.0.0/0".into(), "::/0".into()],
        ..RunProbesRequest::default()
    }
}

fn addr(id: &str, address: &str) -> ProbeTarget {
    ProbeTarget {
        id: id.into(),
        address: address.into(),
        ..ProbeTarget::default()
    }
}

fn run_from(ns: &Netns, req: RunProbesRequest, opts: ProbeOptions) -> RunProbesResponse {
    ns.run(move || async move {
        probes::run_with(req, &opts)
            .await
            .expect("request accepted")
    })
}

#[test]
fn icmp_reaches_b_and_loses_everything_to_blackholes() {
    skip_unless_root!("needs root to create network namespaces");
    let t = Topology::create().unwrap();
    // Raw sockets (root, default ping_group_range), then ping sockets once A's range admits root.
    for policy in [IcmpSocketPolicy::RawOnly, IcmpSocketPolicy::PingOnly] {
        if policy == IcmpSocketPolicy::PingOnly {
            sysctl(&t.a, "net.ipv4.ping_group_range=0 2147483647").unwrap();
        }
        let req = request(
            ProbeKind::Icmp,
            vec![
                addr("b", B),
                addr("local-hole", LOCAL_BLACKHOLE),
                addr("remote-hole", REMOTE_BLACKHOLE),
            ],
        );
        let opts = ProbeOptions {
            icmp_socket: policy,
            ..ProbeOptions::default()
        };
        let resp = run_from(&t.a, req, opts);
        let [b, local, remote] = &resp.results[..] else {
            panic!("{resp:?}")
        };
        assert_eq!(
            (b.sent, b.received, b.rtt_us.len()),
            (3, 3, 3),
            "{policy:?}: {b:?}"
        );
        assert!(b.error.is_empty(), "{b:?}");
        assert_eq!(
            (local.sent, local.received),
            (3, 0),
            "{policy:?}: {local:?}"
        );
        assert!(local.error.contains(LOCAL_BLACKHOLE), "{local:?}");
        assert_eq!(
            (remote.sent, remote.received),
            (3, 0),
            "{policy:?}: {remote:?}"
        );
        assert!(remote.error.contains("no echo reply"), "{remote:?}");
    }
}

#[test]
fn icmp_ping_socket_refused_by_group_range_is_reported() {
    skip_unless_root!("needs root to create network namespaces");
    let t = Topology::create().unwrap();
    // A fresh namespace's ping_group_range is "1 0": no group may open ping sockets.
    let req = request(ProbeKind::Icmp, vec![addr("b", B)]);
    let opts = ProbeOptions {
        icmp_socket: IcmpSocketPolicy::PingOnly,
        ..ProbeOptions::default()
    };
    let r = &run_from(&t.a, req.clone(), opts).results[0];
    assert_eq!((r.sent, r.received), (0, 0));
    assert!(r.error.contains("ping_group_range"), "{r:?}");
    // Auto falls back to a raw socket.
    let r = &run_from(&t.a, req, ProbeOptions::default()).results[0];
    assert_eq!(r.received, 3, "{r:?}");
}

#[test]
fn path_mtu_finds_the_narrow_link() {
    skip_unless_root!("needs root to create network namespaces");
    let t = Topology::create().unwrap();
    sysctl(&t.a, "net.ipv4.ping_group_range=0 2147483647").unwrap();
    for policy in [IcmpSocketPolicy::RawOnly, IcmpSocketPolicy::PingOnly] {
        let mut req = request(
            ProbeKind::PathMtu,
            vec![
                addr("b", B),
                addr("r", R_NEAR),
                addr("remote-hole", REMOTE_BLACKHOLE),
            ],
        );
        req.count = 1;
        req.timeout_ms = 300;
        let opts = ProbeOptions {
            icmp_socket: policy,
            ..ProbeOptions::default()
        };
        let resp = run_from(&t.a, req, opts);
        let [b, r, hole] = &resp.results[..] else {
            panic!("{resp:?}")
        };
        assert_eq!(b.path_mtu, 1400, "{policy:?}: {b:?}");
        assert!(b.error.is_empty(), "{b:?}");
        assert_eq!(r.path_mtu, 1500, "{policy:?}: {r:?}");
        assert_eq!(hole.path_mtu, 0, "{hole:?}");
        assert!(!hole.error.is_empty());
    }
}

#[test]
fn path_mtu_finds_a_silent_l2_mismatch_by_bisection() {
    skip_unless_root!("needs root to create network namespaces");
    let t = Topology::create().unwrap();
    // B's side of the link is set to 1400 but R's side sends up to 1500: larger frames are
    // dropped at B without any ICMP, so only bisection with timeouts can find the limit. The
    // limit is 1404, not 1400: a veth accepts frames up to MTU + 4 bytes of VLAN header room
    // (`is_skb_forwardable` in the kernel's net/core/dev.c), and the probe reports what really
    // gets through.
    t.r.ip(&["link", "set", "rb", "mtu", "1500"]).unwrap();
    let mut req = request(ProbeKind::PathMtu, vec![addr("b", B)]);
    req.count = 1;
    req.timeout_ms = 200;
    req.max_mtu = 1500;
    let r = &run_from(&t.a, req, ProbeOptions::default()).results[0];
    assert_eq!(r.path_mtu, 1404, "{r:?}");
    assert!(r.error.is_empty(), "{r:?}");
    // The larger sizes the bisection tried went unanswered by design: only the final size's
    // echo is counted, so a healthy path shows no loss.
    assert_eq!((r.sent, r.received), (1, 1), "{r:?}");
}

#[test]
fn tcp_dns_and_http_against_real_servers_in_b() {
    skip_unless_root!("needs root to create network namespaces");
    let t = Topology::create().unwrap();
    let stop = start_servers(&t.b);

    let tcp = |id: &str, port: u32| ProbeTarget {
        port,
        ..addr(id, B)
    };
    let resp = run_from(
        &t.a,
        request(ProbeKind::Tcp, vec![tcp("open", 7000), tcp("closed", 7001)]),
        ProbeOptions::default(),
    );
    let [open, closed] = &resp.results[..] else {
        panic!("{resp:?}")
    };
    assert_eq!((open.sent, open.received), (3, 3), "{open:?}");
    assert_eq!(closed.received, 0);
    assert!(closed.error.contains("refused"), "{closed:?}");

    let dns = |id: &str, name: &str| ProbeTarget {
        hostname: name.into(),
        ..addr(id, B)
    };
    let resp = run_from(
        &t.a,
        request(
            ProbeKind::Dns,
            vec![dns("web", "web.test"), dns("nope", "nope.test")],
        ),
        ProbeOptions::default(),
    );
    let [web, nope] = &resp.results[..] else {
        panic!("{resp:?}")
    };
    assert_eq!(
        (web.received, web.answers.as_slice()),
        (3, [B.to_owned()].as_slice()),
        "{web:?}"
    );
    assert!(nope.error.contains("NXDOMAIN"), "{nope:?}");

    // No resolver in the target: the node's resolv.conf names B.
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("resolv.conf");
    std::fs::write(&conf, format!("nameserver {B}\n")).unwrap();
    let req = request(
        ProbeKind::Dns,
        vec![ProbeTarget {
            id: "node-resolver".into(),
            hostname: "web.test".into(),
            ..ProbeTarget::default()
        }],
    );
    let r = &run_from(
        &t.a,
        req,
        ProbeOptions {
            resolv_conf: conf,
            ..ProbeOptions::default()
        },
    )
    .results[0];
    assert_eq!(
        (r.received, r.answers.as_slice()),
        (3, [B.to_owned()].as_slice()),
        "{r:?}"
    );

    let url = |id: &str, path: &str| ProbeTarget {
        id: id.into(),
        url: format!("http://{B}:8080{path}"),
        ..ProbeTarget::default()
    };
    let resp = run_from(
        &t.a,
        request(
            ProbeKind::Http,
            vec![url("ok", "/ok"), url("missing", "/nope")],
        ),
        ProbeOptions::default(),
    );
    let [ok, missing] = &resp.results[..] else {
        panic!("{resp:?}")
    };
    assert_eq!((ok.received, ok.http_status), (3, 200), "{ok:?}");
    assert_eq!(
        (missing.received, missing.http_status),
        (0, 404),
        "{missing:?}"
    );

    drop(stop);
}

#[test]
fn ipv6_echo_and_path_mtu() {
    skip_unless_root!("needs root to create network namespaces");
    let t = Topology::create().unwrap();
    let req = request(ProbeKind::Icmp, vec![addr("b6", "fd77:2::2")]);
    let r = &run_from(&t.a, req, ProbeOptions::default()).results[0];
    assert_eq!((r.sent, r.received), (3, 3), "{r:?}");

    let mut req = request(
        ProbeKind::PathMtu,
        vec![addr("b6", "fd77:2::2"), addr("r6", "fd77:1::1")],
    );
    req.count = 1;
    req.timeout_ms = 1_000;
    let resp = run_from(&t.a, req, ProbeOptions::default());
    let [b, r] = &resp.results[..] else {
        panic!("{resp:?}")
    };
    assert_eq!(b.path_mtu, 1400, "{b:?}");
    assert_eq!(r.path_mtu, 1500, "{r:?}");
}
