//! Probes against real listeners on 127.0.0.1 in the host namespace (no root needed, except that
//! ICMP needs a ping socket or CAP_NET_RAW): TCP, DNS, HTTP and HTTPS, ICMP, request validation.
//! All traffic stays on 127.0.0.0/8.

// A skipped test prints `SKIPPED: <test>: <reason>` (`nodekeeper_testkit::skip!`): that line is
// the contract with CI.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nodekeeper_agent::probes::{self, ProbeError, ProbeOptions};
use nodekeeper_proto::agent::v1::{ProbeKind, ProbeTarget, RunProbesRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

fn request(kind: ProbeKind, targets: Vec<ProbeTarget>) -> RunProbesRequest {
    RunProbesRequest {
        run_id: "test/local".into(),
        kind: kind as i32,
        targets,
        count: 3,
        interval_ms: 10,
        timeout_ms: 1_000,
        ..RunProbesRequest::default()
    }
}

fn target(id: &str) -> ProbeTarget {
    ProbeTarget {
        id: id.into(),
        ..ProbeTarget::default()
    }
}

/// A port on 127.0.0.1 that nothing listens on (bound, then closed).
async fn closed_port() -> u16 {
    nodekeeper_testkit::free_port()
}

#[tokio::test]
async fn tcp_connects_and_refusals() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let open = listener.local_addr().unwrap().port();
    let accept = tokio::spawn(async move {
        for _ in 0..3 {
            let _ = listener.accept().await;
        }
    });
    let closed = closed_port().await;
    let req = request(
        ProbeKind::Tcp,
        vec![
            ProbeTarget {
                address: "127.0.0.1".into(),
                port: u32::from(open),
                ..target("open")
            },
            ProbeTarget {
                address: "127.0.0.1".into(),
                port: u32::from(closed),
                ..target("closed")
            },
        ],
    );
    let resp = probes::run(req).await.unwrap();
    assert_eq!(resp.run_id, "test/local");
    let ids: Vec<_> = resp.results.iter().map(|r| r.target_id.as_str()).collect();
    assert_eq!(ids, ["open", "closed"], "results in request order");
    let (ok, refused) = (&resp.results[0], &resp.results[1]);
    assert_eq!((ok.sent, ok.received, ok.rtt_us.len()), (3, 3, 3), "{ok:?}");
    assert!(ok.error.is_empty(), "{ok:?}");
    assert_eq!((refused.sent, refused.received), (3, 0));
    assert!(refused.error.contains("refused"), "{refused:?}");
    accept.await.unwrap();
}

/// A DNS responder for the test: `web.test` has A 127.0.0.42 and no AAAA; other names NXDOMAIN.
/// Answers at most `max` queries, then stops.
async fn dns_server(max: usize) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut buf = [0u8; 512];
        for _ in 0..max {
            let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                return;
            };
            if let Some(resp) = dns_answer(&buf[..n], "web.test", [127, 0, 0, 42]) {
                let _ = sock.send_to(&resp, peer).await;
            }
        }
    });
    (addr, task)
}

/// Builds the answer to one query: the question copied, plus an A record when it matches.
fn dns_answer(q: &[u8], name: &str, a: [u8; 4]) -> Option<Vec<u8>> {
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*q.get(pos)?);
        pos += 1;
        if len == 0 {
            break;
        }
        labels.push(
            std::str::from_utf8(q.get(pos..pos + len)?)
                .ok()?
                .to_ascii_lowercase(),
        );
        pos += len;
    }
    let qtype = u16::from_be_bytes([*q.get(pos)?, *q.get(pos + 1)?]);
    let question = &q[12..pos + 4];
    let found = labels.join(".") == name;
    let mut r = Vec::new();
    r.extend_from_slice(&q[0..2]);
    r.extend_from_slice(&[0x81, if found { 0x80 } else { 0x83 }]);
    r.extend_from_slice(&[0, 1, 0, u8::from(found && qtype == 1), 0, 0, 0, 0]);
    r.extend_from_slice(question);
    if found && qtype == 1 {
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
        r.extend_from_slice(&a);
    }
    Some(r)
}

#[tokio::test]
async fn dns_answers_and_nxdomain() {
    // Two targets × three probes × two queries (A and AAAA).
    let (server, task) = dns_server(12).await;
    let t = |id: &str, name: &str| ProbeTarget {
        address: server.ip().to_string(),
        port: u32::from(server.port()),
        hostname: name.into(),
        ..target(id)
    };
    let req = request(
        ProbeKind::Dns,
        vec![t("web", "web.test."), t("missing", "nope.test")],
    );
    let resp = probes::run(req).await.unwrap();
    let (web, missing) = (&resp.results[0], &resp.results[1]);
    assert_eq!((web.sent, web.received), (3, 3), "{web:?}");
    assert_eq!(web.answers, ["127.0.0.42"]);
    assert_eq!((missing.sent, missing.received), (3, 0));
    assert!(missing.error.contains("NXDOMAIN"), "{missing:?}");
    task.await.unwrap();
}

#[tokio::test]
async fn dns_resolver_that_does_not_answer_times_out() {
    // A bound socket that never answers: queries arrive and vanish.
    let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let mut req = request(
        ProbeKind::Dns,
        vec![ProbeTarget {
            address: "127.0.0.1".into(),
            port: u32::from(port),
            hostname: "web.test".into(),
            ..target("x")
        }],
    );
    req.count = 1;
    req.timeout_ms = 200;
    let resp = probes::run(req).await.unwrap();
    assert_eq!(resp.results[0].received, 0);
    assert!(
        resp.results[0].error.contains("no answer"),
        "{:?}",
        resp.results[0]
    );
}

#[tokio::test]
async fn dns_without_resolver_uses_the_node_resolver() {
    // The node's resolver is always asked on port 53. Here it is 127.0.0.1, where normally nothing
    // listens, so the probe fails naming exactly that address; the netns test checks a real answer.
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("resolv.conf");
    std::fs::write(&conf, "search example\nnameserver 127.0.0.1\n").unwrap();
    let mut req = request(
        ProbeKind::Dns,
        vec![ProbeTarget {
            hostname: "web.test".into(),
            ..target("node")
        }],
    );
    req.count = 1;
    req.timeout_ms = 300;
    let opts = ProbeOptions {
        resolv_conf: conf,
        ..ProbeOptions::default()
    };
    let resp = probes::run_with(req, &opts).await.unwrap();
    let r = &resp.results[0];
    assert_eq!(r.sent, 1);
    assert!(r.received == 1 || r.error.contains("127.0.0.1:53"), "{r:?}");

    let empty = dir.path().join("empty.conf");
    std::fs::write(&empty, "search example\n").unwrap();
    let mut req = request(
        ProbeKind::Dns,
        vec![ProbeTarget {
            hostname: "web.test".into(),
            ..target("node")
        }],
    );
    req.count = 1;
    let opts = ProbeOptions {
        resolv_conf: empty,
        ..ProbeOptions::default()
    };
    let r = &probes::run_with(req, &opts).await.unwrap().results[0];
    assert_eq!(r.sent, 0);
    assert!(r.error.contains("no usable nameserver"), "{r:?}");
}

/// A minimal HTTP/1.1 server: `/ok` is 200, anything else 404. Serves at most `max` requests.
async fn http_server(max: usize) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        for _ in 0..max {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let _ = respond(&mut conn).await;
        }
    });
    (addr, task)
}

async fn respond<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    conn: &mut S,
) -> std::io::Result<()> {
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&req);
    let ok = line.starts_with("GET /ok ");
    let resp: &[u8] = if ok {
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    } else {
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    };
    conn.write_all(resp).await?;
    conn.shutdown().await
}

#[tokio::test]
async fn http_status_is_checked() {
    let (server, task) = http_server(9).await;
    let u = |id: &str, path: &str| ProbeTarget {
        url: format!("http://{server}{path}"),
        ..target(id)
    };
    let req = request(
        ProbeKind::Http,
        vec![u("ok", "/ok"), u("missing", "/missing")],
    );
    let resp = probes::run(req).await.unwrap();
    let (ok, missing) = (&resp.results[0], &resp.results[1]);
    assert_eq!((ok.received, ok.http_status), (3, 200), "{ok:?}");
    assert!(ok.error.is_empty());
    assert_eq!((missing.received, missing.http_status), (0, 404));
    assert!(
        missing
            .error
            .contains("status 404 is not an expected status (200–399)"),
        "{missing:?}"
    );
    // expected_status applies to the whole request: a 404 can be what the caller wants.
    let mut want_404 = request(ProbeKind::Http, vec![u("wanted-404", "/gone")]);
    want_404.expected_status = vec![404];
    let resp = probes::run(want_404).await.unwrap();
    assert_eq!(
        (resp.results[0].received, resp.results[0].http_status),
        (3, 404)
    );
    task.await.unwrap();
}

#[tokio::test]
async fn https_verifies_certificates() {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert_der = ck.cert.der().to_vec();
    let key_der = ck.signing_key.serialize_der();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server_cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert_der.clone().into()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key_der.into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_cfg));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        // One connection per probe: one rejected by the client, one served.
        for _ in 0..2 {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            if let Ok(mut tls) = acceptor.accept(tcp).await {
                let _ = respond(&mut tls).await;
            }
        }
    });
    let mut req = request(
        ProbeKind::Http,
        vec![ProbeTarget {
            url: format!("https://{addr}/ok"),
            ..target("tls")
        }],
    );
    req.count = 1;

    // Default roots: a self-signed certificate is refused.
    let resp = probes::run(req.clone()).await.unwrap();
    let r = &resp.results[0];
    assert_eq!(r.received, 0);
    assert!(
        r.error.contains("TLS handshake") && r.error.to_lowercase().contains("certificate"),
        "{r:?}"
    );

    // Trusted as an extra root: the same server passes.
    let opts = ProbeOptions {
        extra_root_certs: vec![cert_der],
        ..ProbeOptions::default()
    };
    let resp = probes::run_with(req, &opts).await.unwrap();
    let r = &resp.results[0];
    assert_eq!((r.received, r.http_status), (1, 200), "{r:?}");
    task.await.unwrap();
}

#[tokio::test]
async fn icmp_echo_to_loopback() {
    let mut req = request(
        ProbeKind::Icmp,
        vec![ProbeTarget {
            address: "127.0.0.1".into(),
            ..target("lo")
        }],
    );
    req.count = 3;
    let resp = probes::run(req).await.unwrap();
    let r = &resp.results[0];
    if r.error.contains("refused") && r.sent == 0 {
        nodekeeper_testkit::skip!(format!(
            "ICMP needs a ping socket (net.ipv4.ping_group_range) or CAP_NET_RAW: {}",
            r.error
        ));
    }
    assert_eq!((r.sent, r.received, r.rtt_us.len()), (3, 3, 3), "{r:?}");
}

#[tokio::test]
async fn bad_requests_name_the_field_and_send_nothing() {
    let cases: Vec<(RunProbesRequest, &str)> = vec![
        (
            {
                let mut r = request(
                    ProbeKind::Icmp,
                    vec![ProbeTarget {
                        address: "127.0.0.1".into(),
                        ..target("a")
                    }],
                );
                r.kind = 99;
                r
            },
            "kind",
        ),
        (
            {
                let mut r = request(
                    ProbeKind::Icmp,
                    vec![ProbeTarget {
                        address: "127.0.0.1".into(),
                        ..target("a")
                    }],
                );
                r.count = 0;
                r
            },
            "count",
        ),
        (
            request(
                ProbeKind::Http,
                vec![ProbeTarget {
                    url: "ftp://127.0.0.1/".into(),
                    ..target("a")
                }],
            ),
            "targets[0].url",
        ),
        (
            request(
                ProbeKind::Tcp,
                vec![ProbeTarget {
                    address: "localhost".into(),
                    port: 80,
                    ..target("a")
                }],
            ),
            "targets[0].address",
        ),
        (
            request(
                ProbeKind::Icmp,
                (0..10_000)
                    .map(|i| ProbeTarget {
                        address: format!("127.0.{}.{}", i / 250, i % 250 + 1),
                        ..target("a")
                    })
                    .collect(),
            ),
            "targets",
        ),
    ];
    for (req, field) in cases {
        match probes::run(req).await {
            Err(ProbeError::InvalidRequest { field: f, reason }) => {
                assert_eq!(f, field, "{reason}")
            }
            other => panic!("expected a refusal naming {field}, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn concurrency_keeps_request_order() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accept = tokio::spawn(async move {
        for _ in 0..20 {
            let _ = listener.accept().await;
        }
    });
    let targets: Vec<ProbeTarget> = (0..20)
        .map(|i| ProbeTarget {
            address: "127.0.0.1".into(),
            port: u32::from(port),
            ..target(&format!("t{i:02}"))
        })
        .collect();
    let mut req = request(ProbeKind::Tcp, targets);
    req.count = 1;
    req.concurrency = 4;
    let started = std::time::Instant::now();
    let resp = probes::run(req).await.unwrap();
    let ids: Vec<String> = resp.results.iter().map(|r| r.target_id.clone()).collect();
    let expected: Vec<String> = (0..20).map(|i| format!("t{i:02}")).collect();
    assert_eq!(ids, expected);
    assert!(resp.results.iter().all(|r| r.received == 1));
    assert!(started.elapsed() < Duration::from_secs(10));
    accept.await.unwrap();
}
