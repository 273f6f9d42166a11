//! The agent's gRPC server end to end on 127.0.0.1: mutual TLS is enforced before any handler
//! runs, reports and their revisions, rule installation and refusal, oversized messages, and
//! health status through graceful shutdown.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser as _;
use nodekeeper_agent::Config;
use nodekeeper_proto::agent::v1 as pb;
use pb::get_report_response::Result as Answer;
use pb::node_agent_client::NodeAgentClient;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const SERVER_NAME: &str = "agent.nodekeeper.internal";

struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

/// (certificate PEM, key PEM) for a leaf signed by `ca`.
fn leaf(ca: &Ca, name: &str, usage: ExtendedKeyUsagePurpose) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, &ca.issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

struct Pki {
    ca: Ca,
    other_ca: Ca,
}

struct Agent {
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), nodekeeper_agent::Error>>,
    state_dir: PathBuf,
    _dir: tempfile::TempDir,
}

fn write(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path.display().to_string()
}

async fn start(pki: &Pki, extra: &[&str]) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = leaf(&pki.ca, SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth);
    let state_dir = dir.path().join("state");
    let mut args = vec![
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        format!("--tls-cert={}", write(dir.path(), "tls.crt", &cert)),
        format!("--tls-key={}", write(dir.path(), "tls.key", &key)),
        format!("--client-ca={}", write(dir.path(), "ca.crt", &pki.ca.pem)),
        format!("--state-dir={}", state_dir.display()),
        format!(
            "--oca-plugin-dir={}",
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/oca")
        ),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
        "--report-max-age=60s".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let config = Config::try_parse_from(args).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(nodekeeper_agent::serve(config, listener, shutdown.clone()));
    Agent {
        addr,
        shutdown,
        task,
        state_dir,
        _dir: dir,
    }
}

async fn channel(
    agent: &Agent,
    ca_pem: &str,
    identity: Option<(String, String)>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(SERVER_NAME);
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Channel::from_shared(format!("https://{}", agent.addr))
        .unwrap()
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
}

async fn good_client(pki: &Pki, agent: &Agent) -> NodeAgentClient<Channel> {
    let id = leaf(
        &pki.ca,
        "controller.nodekeeper.internal",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    NodeAgentClient::new(channel(agent, &pki.ca.pem, Some(id)).await.unwrap())
}

fn pki() -> Pki {
    Pki {
        ca: ca("nodekeeper test CA"),
        other_ca: ca("someone else's CA"),
    }
}

fn valid_rules(revision: u64) -> pb::SetRulesRequest {
    pb::SetRulesRequest {
        revision,
        rules: vec![pb::TunableRule {
            name: "somaxconn".into(),
            key: "net.core.somaxconn".into(),
            comparison: pb::Comparison::AtLeast as i32,
            values: vec!["1".into()],
            repair: false,
            repair_max_per_hour: 0,
            severity: pb::Verdict::Warning as i32,
        }],
        thresholds: vec![pb::IndicatorThreshold {
            indicator: "disk.*".into(),
            warning: 85.0,
            critical: 95.0,
        }],
    }
}

async fn report(client: &mut NodeAgentClient<Channel>, since: u64) -> (u64, Answer) {
    let r = client
        .get_report(pb::GetReportRequest {
            since_revision: since,
        })
        .await
        .unwrap()
        .into_inner();
    (r.revision, r.result.unwrap())
}

#[tokio::test]
async fn calls_without_a_trusted_client_certificate_are_refused() {
    let pki = pki();
    let agent = start(&pki, &[]).await;

    // No client certificate: the handshake (or the first call on it) fails; no rules arrive.
    let outcome = match channel(&agent, &pki.ca.pem, None).await {
        Err(e) => Err(e.to_string()),
        Ok(ch) => NodeAgentClient::new(ch)
            .set_rules(valid_rules(5))
            .await
            .map(|_| ())
            .map_err(|s| format!("{:?}: {}", s.code(), s.message())),
    };
    eprintln!("without a client certificate: {outcome:?}");
    // Refused at the transport (TLS) level, not by a handler's status.
    assert!(
        outcome.as_ref().is_err_and(|e| e.contains("transport")),
        "{outcome:?}"
    );

    // A certificate from another CA: likewise.
    let stranger = leaf(
        &pki.other_ca,
        "controller.nodekeeper.internal",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let outcome = match channel(&agent, &pki.ca.pem, Some(stranger)).await {
        Err(e) => Err(e.to_string()),
        Ok(ch) => NodeAgentClient::new(ch)
            .set_rules(valid_rules(6))
            .await
            .map(|_| ())
            .map_err(|s| format!("{:?}: {}", s.code(), s.message())),
    };
    eprintln!("with a foreign client certificate: {outcome:?}");
    assert!(
        outcome.as_ref().is_err_and(|e| e.contains("transport")),
        "{outcome:?}"
    );

    // Neither reached a handler: no state file, and the trusted client sees no rules.
    assert!(!agent.state_dir.join("rules.json").exists());
    let mut client = good_client(&pki, &agent).await;
    let (_, answer) = report(&mut client, 0).await;
    let Answer::Report(r) = answer else {
        panic!("expected a full report")
    };
    assert_eq!(r.rules_revision, 0);

    agent.shutdown.cancel();
    agent.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn reports_revisions_and_rules() {
    let pki = pki();
    let agent = start(&pki, &["--mounts=/,/nonexistent-mount"]).await;
    let mut client = good_client(&pki, &agent).await;

    let (revision, answer) = report(&mut client, 0).await;
    assert_ne!(revision, 0);
    let Answer::Report(r) = answer else {
        panic!("expected a full report")
    };
    assert_eq!(r.node_name, "worker-1");
    assert!(
        r.indicators
            .iter()
            .any(|i| i.name == "memory.available_percent")
    );
    assert!(r.indicators.iter().any(|i| i.name == "disk./.used_percent"));
    assert!(
        r.indicators.windows(2).all(|w| w[0].name < w[1].name),
        "indicators sorted by name"
    );
    assert!(
        r.indicators
            .iter()
            .all(|i| i.verdict != pb::Verdict::Unspecified as i32)
    );
    // A missing mount is a collector error, not a failed call.
    assert!(
        r.collector_errors
            .iter()
            .any(|e| e.collector == "disk:/nonexistent-mount"),
        "{:?}",
        r.collector_errors
    );
    let gpu = r.gpu.unwrap();
    assert!(
        !gpu.present && gpu.error.is_empty(),
        "no nvidia-smi means no GPU, not an error"
    );
    assert_eq!(r.plugins.len(), 4);
    assert!(r.interfaces.iter().any(|i| i.name == "lo"));
    let system = r.system.unwrap();
    assert!(system.cpus > 0 && !system.kernel_release.is_empty() && system.booted_at_unix > 0);

    // Asking with the current revision gets the small answer.
    let (again, answer) = report(&mut client, revision).await;
    assert_eq!(again, revision);
    assert!(matches!(answer, Answer::Unchanged(_)));

    // Installing rules changes what matters, so the revision moves and the report says so.
    let active = client
        .set_rules(valid_rules(77))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(active.active_revision, 77);
    let (after, answer) = report(&mut client, revision).await;
    assert_ne!(after, revision);
    let Answer::Report(r) = answer else {
        panic!("expected a full report")
    };
    assert_eq!(r.rules_revision, 77);
    assert_eq!(r.tunables.len(), 1);
    assert_eq!(
        r.tunables[0].verdict,
        pb::Verdict::Ok as i32,
        "{:?}",
        r.tunables
    );

    // An invalid set is refused whole, naming rule and field; the previous set stays.
    let mut bad = valid_rules(78);
    bad.rules.push(pb::TunableRule {
        name: "escape".into(),
        key: "../../etc/shadow".into(),
        comparison: pb::Comparison::Equal as i32,
        values: vec!["x".into()],
        repair: true,
        ..Default::default()
    });
    let err = client.set_rules(bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("rule \"escape\" (#2): field `key`"),
        "{}",
        err.message()
    );
    let (_, answer) = report(&mut client, 0).await;
    let Answer::Report(r) = answer else {
        panic!("expected a full report")
    };
    assert_eq!(r.rules_revision, 77);

    // The rules survive a restart.
    agent.shutdown.cancel();
    agent.task.await.unwrap().unwrap();
    let state = std::fs::read_to_string(agent.state_dir.join("rules.json")).unwrap();
    assert!(state.contains("\"revision\": 77"), "{state}");
}

/// Every agent serves the fleet's one certificate, so a call names the Node it is meant for: one
/// naming another node is refused before anything is done (an address reused by a new node never
/// gets the old node's network state, nor has its bundle filed under the old node).
#[tokio::test]
async fn calls_meant_for_another_node_are_refused() {
    let pki = pki();
    let agent = start(&pki, &[]).await;
    let mut client = good_client(&pki, &agent).await;
    let apply = |node: &str| pb::ApplyNetworkRequest {
        desired_state_json: "{}".into(),
        dry_run: true,
        node_name: node.into(),
        ..Default::default()
    };
    let err = client.apply_network(apply("worker-2")).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message()
            .contains("this agent serves node worker-1, not worker-2"),
        "{}",
        err.message()
    );
    let err = client
        .collect_diagnostics(pb::DiagnosticsRequest {
            parts: vec!["report".into()],
            node_name: "worker-2".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("not worker-2"), "{}", err.message());
    // Its own node, and a caller that names none, are served.
    for node in ["worker-1", ""] {
        let planned = client
            .apply_network(apply(node))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            planned.outcome,
            pb::ApplyOutcome::Planned as i32,
            "{planned:?}"
        );
    }
    agent.shutdown.cancel();
    agent.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn oversized_messages_are_refused() {
    let pki = pki();
    let agent = start(&pki, &["--max-message-bytes=65536"]).await;
    let mut client = good_client(&pki, &agent).await;
    let mut huge = valid_rules(9);
    huge.rules[0].values = vec!["9".repeat(100_000)];
    let err = client.set_rules(huge).await.unwrap_err();
    assert!(
        matches!(err.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{:?}: {}",
        err.code(),
        err.message()
    );
    assert!(
        !agent.state_dir.join("rules.json").exists(),
        "nothing may change"
    );
    agent.shutdown.cancel();
    agent.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn health_turns_not_serving_on_shutdown() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let pki = pki();
    let agent = start(&pki, &[]).await;
    let id = leaf(
        &pki.ca,
        "controller.nodekeeper.internal",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let mut health = HealthClient::new(channel(&agent, &pki.ca.pem, Some(id)).await.unwrap());
    let service = "nodekeeper.agent.v1.NodeAgent".to_string();
    let now = health
        .check(HealthCheckRequest {
            service: service.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(now.status, ServingStatus::Serving as i32);

    let mut watch = health
        .watch(HealthCheckRequest { service })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        watch.message().await.unwrap().unwrap().status,
        ServingStatus::Serving as i32
    );
    agent.shutdown.cancel();
    let next = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .unwrap();
    assert_eq!(
        next.unwrap().unwrap().status,
        ServingStatus::NotServing as i32
    );
    // Graceful shutdown waits for open streams, so the client lets go of its watch.
    drop(watch);
    drop(health);
    tokio::time::timeout(Duration::from_secs(30), agent.task)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
}

#[test]
fn help_explains_every_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodekeeper-agent"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--listen",
        "--node-name",
        "--tls-cert",
        "--tls-key",
        "--client-ca",
        "--state-dir",
        "--mounts",
        "--host-root",
        "--oca-plugin-dir",
        "--nvidia-smi",
        "--proc-root",
        "--sysctl-root",
        "--log-format",
        "--imds-endpoint",
        "--max-message-bytes",
        "--drift-interval",
        "NODEKEEPER_LISTEN",
    ] {
        assert!(help.contains(flag), "--help does not mention {flag}");
    }
}

#[tokio::test]
async fn reloads_reissued_certificates() {
    let (old, new) = (ca("old CA"), ca("new CA"));
    let dir = tempfile::tempdir().unwrap();
    let install = |ca: &Ca| {
        let (cert, key) = leaf(ca, SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth);
        write(dir.path(), "tls.crt", &cert);
        write(dir.path(), "tls.key", &key);
        write(dir.path(), "ca.crt", &ca.pem);
    };
    install(&old);
    let port = nodekeeper_testkit::free_port();
    let config = Config::try_parse_from([
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        format!("--listen=127.0.0.1:{port}"),
        format!("--tls-cert={}", dir.path().join("tls.crt").display()),
        format!("--tls-key={}", dir.path().join("tls.key").display()),
        format!("--client-ca={}", dir.path().join("ca.crt").display()),
        format!("--state-dir={}", dir.path().join("state").display()),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
        "--tls-reload-interval=100ms".into(),
    ])
    .unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(nodekeeper_agent::run(config, shutdown.clone()));
    let agent = Agent {
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        shutdown: shutdown.clone(),
        task: tokio::spawn(async { Ok(()) }),
        state_dir: dir.path().join("state"),
        _dir: tempfile::tempdir().unwrap(),
    };
    let call = |ca: &Ca| {
        let id = leaf(
            ca,
            "controller.nodekeeper.internal",
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let pem = ca.pem.clone();
        let agent = &agent;
        async move {
            let ch = channel(agent, &pem, Some(id))
                .await
                .map_err(|e| e.to_string())?;
            NodeAgentClient::new(ch)
                .get_report(pb::GetReportRequest { since_revision: 0 })
                .await
                .map(|_| ())
                .map_err(|s| s.to_string())
        }
    };
    // Wait for the listener, then check the old pair works.
    let mut ok = Err(String::new());
    for _ in 0..50 {
        ok = call(&old).await;
        if ok.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ok.unwrap();

    install(&new);
    let mut switched = false;
    for _ in 0..100 {
        if call(&new).await.is_ok() {
            switched = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        switched,
        "the agent did not pick up the reissued certificates"
    );
    assert!(
        call(&old).await.is_err(),
        "the old CA must no longer be trusted"
    );
    agent.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
