//! HTTP probes to a host *name* are held to the address policy after the node resolves it: the
//! controller checked the addresses it saw when planning, but the node may resolve the name to
//! others (split-horizon DNS, a name rebound to loopback or the metadata service). `localhost`
//! stands in for such a name here: it resolves to 127.0.0.1 from the host's /etc/hosts, with no
//! DNS server involved. All traffic stays on 127.0.0.0/8, and none at all is expected when the
//! policy refuses.

use std::io::ErrorKind;
use std::net::TcpListener as StdListener;

use nodekeeper_agent::probes;
use nodekeeper_proto::agent::v1::{ProbeKind, ProbeTarget, RunProbesRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn request(url: String, allowed: &[&str]) -> RunProbesRequest {
    RunProbesRequest {
        run_id: "test/http-names".into(),
        kind: ProbeKind::Http as i32,
        targets: vec![ProbeTarget {
            id: "by-name".into(),
            url,
            ..ProbeTarget::default()
        }],
        count: 2,
        interval_ms: 10,
        timeout_ms: 2_000,
        allowed_cidrs: allowed.iter().map(|c| (*c).to_owned()).collect(),
        ..RunProbesRequest::default()
    }
}

/// Whether `localhost` resolves to 127.0.0.1 here; the test depends on it.
async fn localhost_is_loopback() -> bool {
    tokio::net::lookup_host(("localhost", 80))
        .await
        .is_ok_and(|mut a| a.any(|a| a.ip() == std::net::Ipv4Addr::LOCALHOST))
}

#[tokio::test]
async fn a_name_resolving_outside_the_policy_is_not_probed() {
    if !localhost_is_loopback().await {
        nodekeeper_testkit::skip!("localhost does not resolve to 127.0.0.1 on this machine");
    }
    let listener = StdListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    // The policy a controller would send for a cluster on 10.0.0.0/24: loopback is not in it.
    let resp = probes::run(request(
        format!("http://localhost:{port}/"),
        &["10.0.0.0/24"],
    ))
    .await
    .unwrap();
    let r = &resp.results[0];
    assert_eq!((r.received, r.http_status), (0, 0), "{r:?}");
    assert!(
        r.error
            .contains("localhost resolved to 127.0.0.1, outside the address policy"),
        "{r:?}"
    );
    // Nothing was sent: a connection on loopback is in the accept queue by the time `connect`
    // returns, so an empty queue after the run means no connection was ever made.
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the probe connected to a refused address: {other:?}"),
    }
}

#[tokio::test]
async fn a_name_resolving_inside_the_policy_is_probed() {
    if !localhost_is_loopback().await {
        nodekeeper_testkit::skip!("localhost does not resolve to 127.0.0.1 on this machine");
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        for _ in 0..2 {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut seen = Vec::new();
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0, "client closed before a full request");
                seen.extend_from_slice(&buf[..n]);
            }
            conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await
                .unwrap();
            conn.shutdown().await.unwrap();
        }
    });
    let resp = probes::run(request(
        format!("http://localhost:{port}/"),
        &["10.0.0.0/24", "127.0.0.0/8"],
    ))
    .await
    .unwrap();
    let r = &resp.results[0];
    assert_eq!((r.received, r.http_status), (2, 200), "{r:?}");
    assert!(r.error.is_empty(), "{r:?}");
    server.await.unwrap();
}
