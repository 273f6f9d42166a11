//! Bad input from the fleet never crashes the sweep or writes a wrong condition: a node without
//! an InternalIP is skipped and counted, an agent with a certificate from another CA is rejected
//! in the handshake, an agent answering for another node or with a huge reply is refused — each
//! ends as `NodekeeperReachable=False` with the matching reason once stale, while a healthy
//! agent beside them is read as usual.
//!
//! Run: `cargo test -p nodekeeper-e2e --test controller_bad_agents`.

mod controller_common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::ensure;
use controller_common::*;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, test_namespace, unique_name, wait_for};
use nodekeeper_proto::agent::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// A gRPC server with valid mTLS that answers badly.
#[derive(Clone)]
enum Misbehaviour {
    /// Reports for a node name other than the one the controller asked.
    WrongNode,
    /// A report of about 8 MiB (the controller accepts 4 MiB).
    Huge,
}

#[tonic::async_trait]
impl pb::node_agent_server::NodeAgent for Misbehaviour {
    async fn get_report(
        &self,
        _: Request<pb::GetReportRequest>,
    ) -> Result<Response<pb::GetReportResponse>, Status> {
        let report = match self {
            Misbehaviour::WrongNode => pb::NodeReport {
                node_name: "somebody-else".into(),
                ..Default::default()
            },
            Misbehaviour::Huge => pb::NodeReport {
                node_name: "irrelevant".into(),
                collector_errors: vec![pb::CollectorError {
                    collector: "x".into(),
                    error: "e".repeat(8 << 20),
                }],
                ..Default::default()
            },
        };
        Ok(Response::new(pb::GetReportResponse {
            revision: 7,
            result: Some(pb::get_report_response::Result::Report(report)),
        }))
    }
    async fn set_rules(
        &self,
        _: Request<pb::SetRulesRequest>,
    ) -> Result<Response<pb::SetRulesResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn run_probes(
        &self,
        _: Request<pb::RunProbesRequest>,
    ) -> Result<Response<pb::RunProbesResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn apply_network(
        &self,
        _: Request<pb::ApplyNetworkRequest>,
    ) -> Result<Response<pb::ApplyNetworkResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type CollectDiagnosticsStream = tokio_stream::Empty<Result<pb::DiagnosticsChunk, Status>>;

    async fn collect_diagnostics(
        &self,
        _: Request<pb::DiagnosticsRequest>,
    ) -> Result<Response<Self::CollectDiagnosticsStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

async fn serve_fake(
    addr: SocketAddr,
    tls: &(String, String, String),
    behaviour: Misbehaviour,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
    let config = ServerTlsConfig::new()
        .identity(Identity::from_pem(&tls.0, &tls.1))
        .client_ca_root(Certificate::from_pem(&tls.2));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tokio::spawn(
        Server::builder()
            .tls_config(config)?
            .add_service(
                pb::node_agent_server::NodeAgentServer::new(behaviour)
                    .max_encoding_message_size(64 << 20),
            )
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.cancelled_owned(),
            ),
    );
    Ok(())
}

/// Accepts every connection on `addr` and closes it at once, until `stop`.
async fn close_every_connection(addr: SocketAddr, stop: CancellationToken) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => drop(accepted),
            }
        }
    });
    Ok(())
}

/// A CA and agent certificate that the controller does not trust (same server name).
fn foreign_agent_tls() -> (String, String, String) {
    let (ca_cert, ca_key) = nodekeeper_controller::certs::generate_ca().unwrap();
    let pem = nodekeeper_controller::certs::issue(
        nodekeeper_controller::certs::Leaf::Agent,
        &ca_cert,
        &ca_key,
    )
    .unwrap();
    (pem.cert, pem.key, pem.ca)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_agents_and_nodes_are_named_counted_and_never_stall_the_sweep() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let ns = test_namespace(&client, "nk-bad").await?;
    let group = unique_name("bad");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(6);
    // 0: healthy agent, 1: foreign certificate, 2: wrong node, 3: huge reply, 4: an agent that
    // does not trust the controller's certificate, 5: something that takes every connection and
    // closes it at once (a wedged agent; the soak's agent outage).
    let nodes = create_simulated_nodes(&client, "nk-bad", 6, &labels, &ips).await?;
    // A Node without any address (not managed by kwok: no simulated label).
    let bare = unique_name("nk-bad-noip");
    let bare_node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": bare, "labels": { "nodekeeper.dev/e2e-group": group } },
    }))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &bare_node)
        .await?;
    // The bare Node lacks the labels every other test's nodes carry (`kubernetes.io/os`, ...):
    // left behind, it would change what "every node" means to the tests after this one in the
    // shared API server. It goes whatever the checks found.
    let stop = CancellationToken::new();
    let result = check_bad_agents(
        client.clone(),
        &ns,
        &selector,
        &nodes,
        &ips,
        &bare,
        stop.clone(),
    )
    .await;
    stop.cancel();
    let deleted = Api::<Node>::all(client.clone())
        .delete(&bare, &Default::default())
        .await;
    result?;
    deleted?;
    Ok(())
}

async fn check_bad_agents(
    client: kube::Client,
    ns: &str,
    selector: &str,
    nodes: &[String],
    ips: &[Ipv4Addr],
    bare: &str,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let port = free_port();
    put_tuning(
        &client,
        ns,
        &[
            ("sweepInterval", "10s"),
            ("staleAfter", "10s"),
            ("callTimeout", "2s"),
        ]
        .into(),
    )
    .await?;
    let controller = ControllerProcess::start(ns, "bad-a", selector, port, &[])?;
    let tls = agent_tls(&client, ns).await?;
    let good = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    let _foreign = start_agent(
        &nodes[1],
        SocketAddr::new(ips[1].into(), port),
        &foreign_agent_tls(),
    )
    .await?;
    serve_fake(
        SocketAddr::new(ips[2].into(), port),
        &tls,
        Misbehaviour::WrongNode,
        stop.clone(),
    )
    .await?;
    serve_fake(
        SocketAddr::new(ips[3].into(), port),
        &tls,
        Misbehaviour::Huge,
        stop.clone(),
    )
    .await?;
    let distrusting = (tls.0.clone(), tls.1.clone(), foreign_agent_tls().2);
    let _distrusting = start_agent(
        &nodes[4],
        SocketAddr::new(ips[4].into(), port),
        &distrusting,
    )
    .await?;
    close_every_connection(SocketAddr::new(ips[5].into(), port), stop.clone()).await?;

    let t = Duration::from_secs(90);
    wait_condition(
        &client,
        &nodes[0],
        "NodekeeperReachable",
        "True",
        Some("AgentReachable"),
        t,
    )
    .await?;
    wait_condition(
        &client,
        &nodes[1],
        "NodekeeperReachable",
        "False",
        Some("AgentCertificateRejected"),
        t,
    )
    .await?;
    wait_condition(
        &client,
        &nodes[2],
        "NodekeeperReachable",
        "False",
        Some("AgentReplyInvalid"),
        t,
    )
    .await?;
    wait_condition(
        &client,
        &nodes[3],
        "NodekeeperReachable",
        "False",
        Some("AgentReplyInvalid"),
        t,
    )
    .await?;
    wait_condition(
        &client,
        &nodes[4],
        "NodekeeperReachable",
        "False",
        Some("AgentCertificateRejected"),
        t,
    )
    .await?;
    // A closed connection is no certificate rejection (it was reported as one before).
    wait_condition(
        &client,
        &nodes[5],
        "NodekeeperReachable",
        "False",
        Some("AgentUnreachable"),
        t,
    )
    .await?;
    // A failing agent's condition is written once, not at every failed call, even when its
    // calls fail in more than one way (node 4: an alert, then a closed connection): the time of
    // the last write stays put over three sweep intervals.
    let written_at = |node: Node| {
        node.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "NodekeeperReachable")
            .map(|c| (c.reason, c.last_heartbeat_time))
    };
    let nodes_api: Api<Node> = Api::all(client.clone());
    let mut before = Vec::new();
    for node in &nodes[1..] {
        before.push(written_at(nodes_api.get(node).await?));
    }
    tokio::time::sleep(Duration::from_secs(30)).await;
    for (node, was) in nodes[1..].iter().zip(before) {
        let now = written_at(nodes_api.get(node).await?);
        ensure!(
            now == was,
            "{node}: its condition was rewritten while its agent kept failing: {was:?} became {now:?}"
        );
    }
    // None of the bad answers produced a report-based condition (no TunablesInBounds).
    for node in &nodes[1..] {
        let tunables = condition(&nodes_api.get(node).await?, "TunablesInBounds");
        ensure!(
            tunables.is_none(),
            "{node}: a bad answer produced TunablesInBounds {tunables:?}"
        );
    }
    // The node without an address got nothing and was counted.
    let reachable = condition(&nodes_api.get(bare).await?, "NodekeeperReachable");
    ensure!(
        reachable.is_none(),
        "{bare} has no address, yet got NodekeeperReachable {reachable:?}"
    );
    let http = controller.http;
    for (name, label) in [
        (
            "nodekeeper_sweep_nodes_skipped_total",
            "reason=\"NoInternalIp\"",
        ),
        ("nodekeeper_sweep_agent_calls_total", "outcome=\"Tls\""),
        (
            "nodekeeper_sweep_agent_calls_total",
            "outcome=\"InvalidReply\"",
        ),
        ("nodekeeper_sweep_agent_calls_total", "outcome=\"TooLarge\""),
    ] {
        let value = metric(http, name, &[label]).await?;
        ensure!(
            value >= 1.0,
            "{name}{{{label}}} is {value}, expected at least 1"
        );
    }
    // The good node kept being read throughout.
    let (_, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[0])).await?;
    let node: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(
        node["stale"] == false && node["report"]["nodeName"] == nodes[0].as_str(),
        "the healthy agent's node is not read as usual: {node}"
    );
    // The wrong-node agent's failure is named. Its latest failure is the one shown, and on a
    // loaded machine one call may time out instead, so this waits for the next sweep's answer.
    wait_for(
        "the wrong-node agent's last failure naming the node it answered for",
        Duration::from_secs(60),
        || async {
            let (_, body) = http_get(http, &format!("/api/v1/nodes/{}", nodes[2])).await?;
            let node: serde_json::Value = serde_json::from_str(&body)?;
            let detail = node["lastFailure"]["detail"].as_str().unwrap_or_default();
            if detail.contains("somebody-else") {
                Ok(Some(()))
            } else {
                Err(anyhow::anyhow!("last failure: {}", node["lastFailure"]))
            }
        },
    )
    .await?;

    drop((good, controller));
    Ok(())
}
