//! `RunProbes` through the agent's gRPC service with its configuration: a DNS target that names
//! no resolver asks the host's resolver, read from `/etc/resolv.conf` under `--host-root`, not the
//! agent container's own (which names the cluster DNS); HTTPS probes trust `--probe-ca-file`.

use std::path::Path;
use std::sync::Arc;

use clap::Parser as _;
use nodekeeper_agent::Config;
use nodekeeper_agent::agent::Agent;
use nodekeeper_agent::service::AgentService;
use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_server::NodeAgent as _;

/// The agent's configuration with `extra` flags, state kept in `dir`.
fn config(dir: &Path, extra: &[String]) -> Config {
    let mut args = vec![
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        "--tls-cert=/nonexistent/tls.crt".into(),
        "--tls-key=/nonexistent/tls.key".into(),
        "--client-ca=/nonexistent/ca.crt".into(),
        format!("--state-dir={}", dir.join("state").display()),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
    ];
    args.extend(extra.iter().cloned());
    Config::try_parse_from(args).unwrap()
}

fn service(config: &Config) -> AgentService {
    AgentService::new(Arc::new(Agent::new(config))).with_probe_options(config.probe_options())
}

#[tokio::test]
async fn dns_without_resolver_asks_the_hosts_resolver() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("host");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    // Nothing listens on 127.0.0.77:53: the probe fails naming the resolver it asked.
    std::fs::write(root.join("etc/resolv.conf"), "nameserver 127.0.0.77\n").unwrap();
    let config = config(dir.path(), &[format!("--host-root={}", root.display())]);
    let service = service(&config);
    let req = pb::RunProbesRequest {
        run_id: "ns/t/uid".into(),
        kind: pb::ProbeKind::Dns as i32,
        targets: vec![pb::ProbeTarget {
            id: "name".into(),
            hostname: "web.test".into(),
            ..pb::ProbeTarget::default()
        }],
        count: 1,
        interval_ms: 10,
        timeout_ms: 500,
        allowed_cidrs: vec!["127.0.0.0/8".into()],
        ..pb::RunProbesRequest::default()
    };
    let resp = service
        .run_probes(tonic::Request::new(req))
        .await
        .unwrap()
        .into_inner();
    let r = &resp.results[0];
    assert_eq!((r.sent, r.received), (1, 0), "{r:?}");
    assert!(r.error.contains("127.0.0.77:53"), "{r:?}");
}

/// An HTTPS endpoint whose certificate a private CA signed: refused with the compiled-in roots,
/// verified with that CA given as `--probe-ca-file`.
#[tokio::test]
async fn https_probes_trust_the_probe_ca_file() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_rustls::rustls;

    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, ck.cert.pem()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server_cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![ck.cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(ck.signing_key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        // One connection per probe: one refused by the client, one served.
        for _ in 0..2 {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            if let Ok(mut tls) = acceptor.accept(tcp).await {
                let mut buf = [0u8; 1024];
                let _ = tls.read(&mut buf).await;
                let _ = tls
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
                let _ = tls.shutdown().await;
            }
        }
    });
    let req = pb::RunProbesRequest {
        run_id: "ns/t/uid".into(),
        kind: pb::ProbeKind::Http as i32,
        targets: vec![pb::ProbeTarget {
            id: "private".into(),
            url: format!("https://{addr}/livez"),
            ..pb::ProbeTarget::default()
        }],
        count: 1,
        interval_ms: 10,
        timeout_ms: 2_000,
        allowed_cidrs: vec!["127.0.0.0/8".into()],
        ..pb::RunProbesRequest::default()
    };
    let run = |config: Config| {
        let req = req.clone();
        async move {
            service(&config)
                .run_probes(tonic::Request::new(req))
                .await
                .unwrap()
                .into_inner()
                .results
                .remove(0)
        }
    };

    let r = run(config(dir.path(), &[])).await;
    assert_eq!(r.received, 0, "{r:?}");
    assert!(r.error.to_lowercase().contains("certificate"), "{r:?}");

    let with_ca = config(
        dir.path(),
        &[format!("--probe-ca-file={}", ca_file.display())],
    );
    with_ca.validate().unwrap();
    let r = run(with_ca).await;
    assert_eq!((r.received, r.http_status), (1, 200), "{r:?}");
    server.await.unwrap();

    // A file without a certificate is refused at start, naming the flag.
    let empty = dir.path().join("empty.crt");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    let e = config(
        dir.path(),
        &[format!("--probe-ca-file={}", empty.display())],
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--probe-ca-file") && e.contains("no PEM certificate"),
        "{e}"
    );
}
