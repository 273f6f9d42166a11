//! A certificate rotation under a running agent keeps what the agent knows: the agent server runs
//! inside a network namespace this test creates, applies a host network state over mutual-TLS
//! gRPC, has its TLS files replaced (it reloads them), and must then still repair a route someone
//! deleted and still report the applied state. Root only (network namespaces).
//!
//! A rotation under a call in flight (any user, on 127.0.0.1): new connections are served with the
//! new certificates at once, and the call finishes on the old ones.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser as _;
use nodekeeper_agent::Config;
use nodekeeper_proto::agent::v1 as pb;
use nodekeeper_testkit::{Netns, skip_unless_root};
use pb::get_report_response::Result as Answer;
use pb::node_agent_client::NodeAgentClient;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const SERVER_NAME: &str = "agent.nodekeeper.internal";
/// Inside the test's own namespace any port is free.
const LISTEN: &str = "127.0.0.1:9443";

/// A CA, and the agent's server pair and the controller's client pair it signs.
struct Pki {
    ca: String,
    server: (String, String),
    client: (String, String),
}

fn pki(name: &str) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = params.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(params, ca_key);
    let leaf = |cn: &str, usage| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![cn.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        server: leaf(SERVER_NAME, ExtendedKeyUsagePurpose::ServerAuth),
        client: leaf(
            "controller.nodekeeper.internal",
            ExtendedKeyUsagePurpose::ClientAuth,
        ),
        ca,
    }
}

/// Writes the agent's three TLS files, as a Secret volume update would.
/// An agent on `listen` serving the TLS files in `dir` (as [`install`] writes them), checking them
/// every 100ms, with its state in `dir/state`; `extra` flags after those.
fn reloading_config(dir: &std::path::Path, listen: &str, extra: &[&str]) -> Config {
    let mut args = vec![
        "nodekeeper-agent".to_string(),
        "--node-name=worker-1".into(),
        format!("--listen={listen}"),
        format!("--tls-cert={}", dir.join("tls.crt").display()),
        format!("--tls-key={}", dir.join("tls.key").display()),
        format!("--client-ca={}", dir.join("ca.crt").display()),
        format!("--state-dir={}", dir.join("state").display()),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
        "--tls-reload-interval=100ms".into(),
    ];
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    Config::try_parse_from(args).unwrap()
}

/// Stops an agent started with `run` and checks it ended cleanly.
async fn stop(
    shutdown: CancellationToken,
    agent: tokio::task::JoinHandle<Result<(), nodekeeper_agent::Error>>,
) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), agent)
        .await
        .expect("the agent stops on shutdown")
        .unwrap()
        .unwrap();
}

fn install(dir: &std::path::Path, p: &Pki) {
    std::fs::write(dir.join("tls.crt"), &p.server.0).unwrap();
    std::fs::write(dir.join("tls.key"), &p.server.1).unwrap();
    std::fs::write(dir.join("ca.crt"), &p.ca).unwrap();
}

/// A client trusting `p`'s CA with its client pair; `Err` until the agent serves with `p`.
async fn client(p: &Pki) -> Result<NodeAgentClient<Channel>, String> {
    client_at(LISTEN, p).await
}

/// [`client`] for an agent listening on `addr`.
async fn client_at(addr: &str, p: &Pki) -> Result<NodeAgentClient<Channel>, String> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&p.ca))
        .domain_name(SERVER_NAME)
        .identity(Identity::from_pem(&p.client.0, &p.client.1));
    let channel = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut c = NodeAgentClient::new(channel);
    // A handshake with the wrong CA fails on the first call, not on connect.
    c.get_report(pb::GetReportRequest { since_revision: 0 })
        .await
        .map_err(|s| s.to_string())?;
    Ok(c)
}

/// Calls `client(p)` every 100 ms for up to `secs` seconds.
async fn wait_for_client(p: &Pki, secs: u64) -> NodeAgentClient<Channel> {
    wait_for_client_at(LISTEN, p, secs).await
}

/// [`wait_for_client`] for an agent listening on `addr`.
async fn wait_for_client_at(addr: &str, p: &Pki, secs: u64) -> NodeAgentClient<Channel> {
    let mut last = String::new();
    for _ in 0..secs * 10 {
        match client_at(addr, p).await {
            Ok(c) => return c,
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the agent did not serve with the expected certificates: {last}");
}

async fn network_status(c: &mut NodeAgentClient<Channel>) -> (pb::NetworkStatus, pb::NodeReport) {
    let answer = c
        .get_report(pb::GetReportRequest { since_revision: 0 })
        .await
        .unwrap()
        .into_inner()
        .result;
    let Some(Answer::Report(report)) = answer else {
        panic!("expected a full report, got {answer:?}");
    };
    (report.network.clone().unwrap_or_default(), report)
}

const DESIRED: &str = r#"{
  "links": [
    {"name": "nic0", "kind": "existing", "up": true},
    {"name": "nkm0", "kind": "macvlan", "parent": "nic0"}
  ],
  "addresses": [{"link": "nkm0", "cidr": "10.0.20.33/24"}],
  "routes": [{"destination": "default", "gateway": "10.0.20.1", "link": "nkm0", "table": 101}],
  "rules": [{"from": "10.0.20.33/32", "table": 101, "priority": 20101}]
}"#;

#[test]
fn certificate_rotation_keeps_the_applied_network_and_its_drift_repair() {
    skip_unless_root!("needs root to create network namespaces");
    // Shared with the code inside, which changes the namespace's routes with `ip`.
    let ns =
        Arc::new(Netns::with_loopback("nk-test-rotation").expect("create a network namespace"));
    ns.add_veth("nic0", &[], "nic0p", None).unwrap();
    ns.address_up("nic0p", "10.0.20.1/24").unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (pki("first CA"), pki("second CA"));
    install(dir.path(), &first);
    let config = reloading_config(
        dir.path(),
        LISTEN,
        &[
            "--drift-interval=300ms",
            // Every GetReport below must see the latest network status.
            "--report-max-age=0ms",
        ],
    );

    let inside = Arc::clone(&ns);
    let dir_path = dir.path().to_path_buf();
    // The agent, its netlink sockets and the client all live in the test's namespace.
    ns.run(move || async move {
        let ip = |args: &[&str]| inside.ip(args).unwrap();
        let shutdown = CancellationToken::new();
        let agent = tokio::spawn(nodekeeper_agent::run(config, shutdown.clone()));

        let mut c = wait_for_client(&first, 10).await;
        let r = c
            .apply_network(pb::ApplyNetworkRequest {
                desired_state_json: DESIRED.into(),
                generation: "uid-1/1".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.outcome, pb::ApplyOutcome::Applied as i32, "{}", r.message);
        let route = ip(&["route", "show", "table", "101"]);
        assert_eq!(route.trim(), "default via 10.0.20.1 dev nkm0 proto 176");
        let (status, _) = network_status(&mut c).await;
        assert_eq!(status.applied_generation, "uid-1/1");

        // Rotate: a new CA and new pairs, written under the running agent.
        install(&dir_path, &second);
        let mut c = wait_for_client(&second, 10).await;
        assert!(
            client(&first).await.is_err(),
            "the old CA must no longer be trusted"
        );

        // Someone deletes the route; the drift loop must still run and put it back.
        ip(&["route", "del", "default", "table", "101"]);
        let mut repaired = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if ip(&["route", "show", "table", "101"]).trim()
                == "default via 10.0.20.1 dev nkm0 proto 176"
            {
                repaired = true;
                break;
            }
        }
        assert!(
            repaired,
            "the deleted route was not repaired within 10 s after the certificate rotation"
        );
        let (status, report) = network_status(&mut c).await;
        assert_eq!(
            status.applied_generation, "uid-1/1",
            "the rotation forgot the applied state: {status:?}"
        );
        // Repaired: no drift left, and the repair's time says it happened.
        assert!(!status.drifted && status.drift.is_empty(), "{status:?}");
        assert!(status.reconverged_at_unix_ms > 0, "{status:?}");
        assert!(status.last_error.is_empty(), "{status:?}");
        // The links nodekeeper created or configures are reported as managed, no others.
        let managed: Vec<(&str, bool)> = report
            .interfaces
            .iter()
            .map(|i| (i.name.as_str(), i.managed))
            .collect();
        assert!(managed.contains(&("nkm0", true)), "{managed:?}");
        assert!(managed.contains(&("nic0", true)), "{managed:?}");
        assert!(managed.contains(&("nic0p", false)), "{managed:?}");
        assert!(managed.contains(&("lo", false)), "{managed:?}");

        stop(shutdown, agent).await;
    });
    drop(ns);
}

/// A TLS reload must not close the port until the calls in flight end: a long `RunProbes` (10
/// TCP probes 1 s apart, about 9 s) is running when the files are replaced; a client with the new
/// PKI must be served within 2 s, while the probe call still runs, and the probe call must then
/// finish with all its results.
#[tokio::test]
async fn a_rotation_serves_new_connections_while_a_long_call_is_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (pki("first CA"), pki("second CA"));
    install(dir.path(), &first);
    let addr = format!("127.0.0.1:{}", nodekeeper_testkit::free_port());
    let config = reloading_config(dir.path(), &addr, &[]);
    let shutdown = CancellationToken::new();
    let agent = tokio::spawn(nodekeeper_agent::run(config, shutdown.clone()));

    let mut old = wait_for_client_at(&addr, &first, 10).await;
    // Nothing listens on the target port: every probe is refused at once, and the run lasts
    // count x interval whatever the answers.
    let closed = nodekeeper_testkit::free_port();
    let probes = tokio::spawn(async move {
        old.run_probes(pb::RunProbesRequest {
            run_id: "ns/long/uid".into(),
            kind: pb::ProbeKind::Tcp as i32,
            targets: vec![pb::ProbeTarget {
                id: "closed".into(),
                address: "127.0.0.1".into(),
                port: u32::from(closed),
                ..pb::ProbeTarget::default()
            }],
            count: 10,
            interval_ms: 1_000,
            timeout_ms: 500,
            allowed_cidrs: vec!["127.0.0.0/8".into()],
            ..pb::RunProbesRequest::default()
        })
        .await
    });
    // The call is on its way before the rotation.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !probes.is_finished(),
        "the probe call ended early: {probes:?}"
    );

    install(dir.path(), &second);
    let rotated = std::time::Instant::now();
    let mut new = wait_for_client_at(&addr, &second, 2).await;
    assert!(
        !probes.is_finished(),
        "the new certificates were served only after the call in flight ended ({:?} after the \
         rotation)",
        rotated.elapsed()
    );
    let (status, _) = network_status(&mut new).await;
    assert!(status.applied_generation.is_empty(), "{status:?}");
    assert!(
        client_at(&addr, &first).await.is_err(),
        "new connections must no longer trust the old CA"
    );

    let done = tokio::time::timeout(Duration::from_secs(30), probes)
        .await
        .expect("the probe call in flight finishes")
        .unwrap()
        .expect("the probe call in flight succeeds on the old certificates")
        .into_inner();
    let got: Vec<(&str, u32, u32)> = done
        .results
        .iter()
        .map(|r| (r.target_id.as_str(), r.sent, r.received))
        .collect();
    assert_eq!(got, [("closed", 10, 0)]);

    stop(shutdown, agent).await;
}

/// New TLS files that cannot be used (a key that does not match the certificate, as a half-done
/// manual edit leaves them) are ignored: the agent keeps serving with the files it has, and takes
/// the next usable set.
#[tokio::test]
async fn unusable_new_files_are_ignored_until_usable_ones_come() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (pki("first CA"), pki("second CA"));
    install(dir.path(), &first);
    let addr = format!("127.0.0.1:{}", nodekeeper_testkit::free_port());
    let config = reloading_config(dir.path(), &addr, &[]);
    let shutdown = CancellationToken::new();
    let agent = tokio::spawn(nodekeeper_agent::run(config, shutdown.clone()));
    wait_for_client_at(&addr, &first, 10).await;

    // The second certificate with the first key.
    std::fs::write(dir.path().join("tls.crt"), &second.server.0).unwrap();
    std::fs::write(dir.path().join("ca.crt"), &second.ca).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !agent.is_finished(),
        "unusable TLS files stopped the agent: {agent:?}"
    );
    client_at(&addr, &first)
        .await
        .expect("the agent serves with the files it had");

    install(dir.path(), &second);
    wait_for_client_at(&addr, &second, 5).await;

    stop(shutdown, agent).await;
}
