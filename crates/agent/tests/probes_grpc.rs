//! `RunProbes` through the agent's real gRPC server on 127.0.0.1 with mutual TLS: results come
//! back per target in request order, and a bad request is INVALID_ARGUMENT naming the field.

use std::time::Duration;

use clap::Parser as _;
use nodekeeper_agent::Config;
use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_client::NodeAgentClient;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const SERVER_NAME: &str = "agent.nodekeeper.internal";

/// (CA PEM, issuer) and a leaf signed by it.
fn ca() -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "probe test CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    name: &str,
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

#[tokio::test]
async fn run_probes_over_mutual_tls() {
    let (ca_pem, issuer) = ca();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, body: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let (cert, key) = leaf(&issuer, SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth);
    let config = Config::try_parse_from([
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        format!("--tls-cert={}", write("tls.crt", &cert)),
        format!("--tls-key={}", write("tls.key", &key)),
        format!("--client-ca={}", write("ca.crt", &ca_pem)),
        format!("--state-dir={}", dir.path().join("state").display()),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
    ])
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(nodekeeper_agent::serve(config, listener, shutdown.clone()));

    let (ccert, ckey) = leaf(
        &issuer,
        "controller.nodekeeper.internal",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca_pem))
        .domain_name(SERVER_NAME)
        .identity(Identity::from_pem(ccert, ckey));
    let mut channel = None;
    // The server task may need a moment to start accepting; bounded retries.
    for _ in 0..50 {
        match Channel::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls.clone())
            .unwrap()
            .connect()
            .await
        {
            Ok(c) => {
                channel = Some(c);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let mut client = NodeAgentClient::new(channel.expect("agent accepts connections"));

    let open = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let open_port = open.local_addr().unwrap().port();
    let accept = tokio::spawn(async move {
        for _ in 0..2 {
            let _ = open.accept().await;
        }
    });
    let closed_port = nodekeeper_testkit::free_port();
    let target = |id: &str, port: u16| pb::ProbeTarget {
        id: id.into(),
        address: "127.0.0.1".into(),
        port: u32::from(port),
        ..pb::ProbeTarget::default()
    };
    let req = pb::RunProbesRequest {
        run_id: "ns/t/uid".into(),
        kind: pb::ProbeKind::Tcp as i32,
        targets: vec![target("open", open_port), target("closed", closed_port)],
        count: 2,
        interval_ms: 10,
        timeout_ms: 1_000,
        ..pb::RunProbesRequest::default()
    };
    let resp = client.run_probes(req.clone()).await.unwrap().into_inner();
    assert_eq!(resp.run_id, "ns/t/uid");
    let got: Vec<(&str, u32, u32)> = resp
        .results
        .iter()
        .map(|r| (r.target_id.as_str(), r.sent, r.received))
        .collect();
    assert_eq!(got, [("open", 2, 2), ("closed", 2, 0)]);
    assert!(
        resp.results[1].error.contains("refused"),
        "{:?}",
        resp.results[1]
    );

    let mut bad = req;
    bad.count = 0;
    let status = client.run_probes(bad).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("count"), "{}", status.message());

    accept.await.unwrap();
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
}
