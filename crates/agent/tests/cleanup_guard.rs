//! `--cleanup` and a running agent: the agent holds `<state-dir>/agent.lock` while it serves, and
//! the cleanup refuses meanwhile (the agent's drift loop would put back what it removes); and
//! `NODEKEEPER_CLEANUP` chooses between the two the same way in `main` and in both flag sets.
//! Nothing here touches the host: the cleanup is only ever run while the lock is held.

use std::process::Command;
use std::time::Duration;

use clap::Parser as _;
use nodekeeper_agent::Config;
use nodekeeper_agent::cleanup::{self, CleanupArgs, CleanupError, StateLock};
use nodekeeper_proto::agent::v1 as pb;
use pb::node_agent_client::NodeAgentClient;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const SERVER_NAME: &str = "agent.nodekeeper.internal";

/// Writes a CA and the agent's pair into `dir`; returns the CA and a client pair it signs.
fn pki(dir: &std::path::Path) -> (String, (String, String)) {
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "guard CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = params.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(params, ca_key);
    let leaf = |cn: &str, usage| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![cn.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        (
            params.signed_by(&key, &issuer).unwrap().pem(),
            key.serialize_pem(),
        )
    };
    let server = leaf(SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth);
    std::fs::write(dir.join("tls.crt"), &server.0).unwrap();
    std::fs::write(dir.join("tls.key"), &server.1).unwrap();
    std::fs::write(dir.join("ca.crt"), &ca).unwrap();
    let client = leaf(
        "controller.nodekeeper.internal",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    (ca, client)
}

#[tokio::test]
async fn the_cleanup_refuses_while_an_agent_runs() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let (ca, (cert, key)) = pki(dir.path());
    let config = Config::try_parse_from([
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        format!("--tls-cert={}", dir.path().join("tls.crt").display()),
        format!("--tls-key={}", dir.path().join("tls.key").display()),
        format!("--client-ca={}", dir.path().join("ca.crt").display()),
        format!("--state-dir={}", state.display()),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
    ])
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let agent = tokio::spawn(nodekeeper_agent::serve(config, listener, shutdown.clone()));

    // Serving: the lock was taken before.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca))
        .domain_name(SERVER_NAME)
        .identity(Identity::from_pem(cert, key));
    let mut served = false;
    for _ in 0..50 {
        let channel = Channel::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls.clone())
            .unwrap()
            .connect()
            .await;
        if let Ok(channel) = channel
            && NodeAgentClient::new(channel)
                .get_report(pb::GetReportRequest { since_revision: 0 })
                .await
                .is_ok()
        {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "the agent did not serve");

    assert!(
        StateLock::try_take(&state).unwrap().is_none(),
        "a running agent must hold {}",
        state.join(cleanup::LOCK_FILE).display()
    );
    let args = CleanupArgs::parse_from([
        "nodekeeper-agent",
        "--cleanup",
        &format!("--state-dir={}", state.display()),
    ]);
    let error = cleanup::run(&args).await.unwrap_err();
    assert!(
        matches!(error, CleanupError::AgentRunning { .. }),
        "{error}"
    );

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), agent)
        .await
        .expect("the agent stops on shutdown")
        .unwrap()
        .unwrap();
    assert!(
        StateLock::try_take(&state).unwrap().is_some(),
        "a stopped agent must release the lock"
    );
}

/// The binary with `NODEKEEPER_CLEANUP=value` (and nothing else of the caller's environment):
/// (exit success, stderr).
fn agent_with(value: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nodekeeper-agent"))
        .env_clear()
        .env("NODEKEEPER_CLEANUP", value)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `NODEKEEPER_CLEANUP` values clap reads as true start the cleanup (seen by its refusal while
/// the test holds the lock, before it touches anything), values it reads as false start the
/// agent (seen by its refusal of an empty `--node-name`), and others are refused naming the
/// flag; none is refused by one half and taken by the other.
#[test]
fn the_cleanup_variable_chooses_the_same_way_everywhere() {
    let state = tempfile::tempdir().unwrap();
    let _held = StateLock::try_take(state.path()).unwrap().unwrap();
    let state_dir = format!("--state-dir={}", state.path().display());
    for value in ["1", "yes", "TRUE", "on"] {
        let (ok, stderr) = agent_with(value, &[&state_dir]);
        assert!(
            !ok && stderr.contains("still runs on this host"),
            "NODEKEEPER_CLEANUP={value}: {stderr}"
        );
    }
    let agent_args = [
        "--node-name=",
        "--tls-cert=/nonexistent/c",
        "--tls-key=/nonexistent/k",
        "--client-ca=/nonexistent/ca",
        &state_dir,
    ];
    for value in ["0", "no", "false", "off"] {
        let (ok, stderr) = agent_with(value, &agent_args);
        assert!(
            !ok && stderr.contains("invalid --node-name"),
            "NODEKEEPER_CLEANUP={value}: {stderr}"
        );
    }
    let (ok, stderr) = agent_with("maybe", &agent_args);
    assert!(
        !ok && stderr.contains("--cleanup") && stderr.contains("maybe"),
        "{stderr}"
    );
}
