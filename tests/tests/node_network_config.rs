//! `NodeNetworkConfig` end to end on real parts: the real kube-apiserver (CRDs from
//! `deploy/crds/`), kwok Nodes whose `spec.providerID` names an instance of the local OCI
//! endpoint (signatures checked, attach asynchronous), the controller crate's NodeNetworkConfig
//! reconciler, and per node a network namespace where the agent's real host-network code
//! (`NetworkManager`: IMDS layout, plan, apply, check, rollback) runs with its own `--imds-endpoint`
//! answered by the endpoint for that node's instance. Only the gRPC hop between controller and
//! agent is left out (the reconciler's `ApplyNetwork` runs the manager on the node's thread).
//!
//! The endpoint's attach is made visible to the guest the way OCI hot-plugs a NIC: once an
//! attachment is ATTACHED, a veth with the VNIC's MAC appears in the node's namespace (its peer
//! carries the subnet's router address), and it disappears once DETACHED.
//!
//! The bare-metal variant (macvlan + 802.1Q VLAN, which this kernel lacks) runs with its host
//! side in a qemu VM: `node_network_config_bare_metal.rs`.

mod oci_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use futures::future::BoxFuture;
use http::Method;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use nodekeeper_agent::network::NetworkManager;
use nodekeeper_api::crd::NodeNetworkConfig;
use nodekeeper_api::names::{NODE_CONDITION_NETWORK_READY, REASON_PAUSED};
use nodekeeper_controller::agent_client::{CallError, CallOutcome};
use nodekeeper_controller::controllers;
use nodekeeper_controller::controllers::node_network_config::cloud::{Cloud, CloudAccess};
use nodekeeper_controller::controllers::node_network_config::{Context, Settings};
use nodekeeper_controller::shared::agents::{AgentNode, Agents, Report, RulesOutcome};
use nodekeeper_controller::shared::metrics::{CloudMetrics, ReconcileMetrics};
use nodekeeper_e2e::oci_endpoint::{EndpointConfig, Fault, OciEndpoint, Recorded, test_key_pem};
use nodekeeper_e2e::{ControlPlane, create_simulated_nodes, install_crds, unique_name, wait_for};
use nodekeeper_oci::auth::{ApiKeyProvider, AuthProvider as _};
use nodekeeper_oci::compute::{ComputeClient, ComputeConfig};
use nodekeeper_oci::retry::RetryPolicy;
use nodekeeper_oci::signer::PrivateKey;
use nodekeeper_proto::agent::v1 as pb;
use nodekeeper_testkit::{Netns, skip_unless_root};
use oci_common::netns::{
    SimNode, addresses_of, default_routes, hotplug, ip_json, netns_host, nk_rules,
};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

const COMPARTMENT: &str = "ocid1.compartment.oc1..localtest";
const AD: &str = "Uocm:PHX-AD-1";
const VM: &str = "VM.Standard2.4"; // 4 VNICs in the endpoint's limits
const BM: &str = "BM.Standard.E5.192";
const TIMEOUT: Duration = Duration::from_secs(90);

type Call = (
    pb::ApplyNetworkRequest,
    oneshot::Sender<Result<pb::ApplyNetworkResponse, String>>,
);

/// The agents of these tests: `ApplyNetwork` goes either to the node's manager thread (inside
/// its namespace), or, for the benchmark, to a simulation where a VNIC is "on the host" once the
/// endpoint reports it ATTACHED (what the metadata service and hot-plug make visible) and an
/// apply answers Applied with those VNICs' links observed: no namespace, no netlink, so the
/// controller is what is measured.
enum TestAgents {
    /// The node threads by address, and the `ApplyNetwork` calls counted per address.
    Netns(
        BTreeMap<IpAddr, mpsc::UnboundedSender<Call>>,
        Arc<Mutex<BTreeMap<IpAddr, usize>>>,
    ),
    Simulated {
        endpoint: Arc<OciEndpoint>,
        instances: BTreeMap<IpAddr, String>,
        /// Agents that answer only after this long (an apply that takes its time).
        slow: BTreeMap<IpAddr, Duration>,
    },
}

fn call_error(endpoint: SocketAddr, detail: String) -> CallError {
    CallError {
        outcome: CallOutcome::Connect,
        endpoint,
        detail,
    }
}

/// The benchmark's simulated apply (see [`TestAgents`]).
fn simulated_apply(endpoint: &OciEndpoint, instance: &str) -> pb::ApplyNetworkResponse {
    let on_host: Vec<_> = endpoint
        .guest_vnics(instance)
        .into_iter()
        .filter(|v| !v.primary && v.state == "ATTACHED")
        .collect();
    let links: Vec<Value> = on_host
        .iter()
        .enumerate()
        .map(|(i, v)| json!({"name": format!("vnic{i}"), "kind": "existing", "mac": v.mac}))
        .collect();
    pb::ApplyNetworkResponse {
        outcome: pb::ApplyOutcome::Applied as i32,
        observed_state_json: json!({ "links": links }).to_string(),
        oci_vnic_ids: on_host.into_iter().map(|v| v.vnic_id).collect(),
        ..Default::default()
    }
}

impl Agents for TestAgents {
    fn apply_network<'a>(
        &'a self,
        node: &'a AgentNode,
        request: pb::ApplyNetworkRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<pb::ApplyNetworkResponse, CallError>> {
        let endpoint = node.endpoint;
        Box::pin(async move {
            let tx = match self {
                TestAgents::Simulated {
                    endpoint: oci,
                    instances,
                    slow,
                } => {
                    let instance = instances
                        .get(&endpoint.ip())
                        .ok_or_else(|| call_error(endpoint, "no agent here".into()))?;
                    if let Some(delay) = slow.get(&endpoint.ip()) {
                        tokio::time::sleep(*delay).await;
                    }
                    return Ok(simulated_apply(oci, instance));
                }
                TestAgents::Netns(by_address, applies) => {
                    *applies.lock().unwrap().entry(endpoint.ip()).or_default() += 1;
                    by_address
                        .get(&endpoint.ip())
                        .ok_or_else(|| call_error(endpoint, "no agent here".into()))?
                }
            };
            let (reply, rx) = oneshot::channel();
            tx.send((request, reply))
                .map_err(|_| call_error(endpoint, "agent thread gone".into()))?;
            match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(Ok(r))) => Ok(r),
                Ok(Ok(Err(e))) => Err(CallError {
                    outcome: CallOutcome::Status,
                    endpoint,
                    detail: e,
                }),
                Ok(Err(_)) => Err(call_error(endpoint, "agent thread died".into())),
                Err(_) => Err(call_error(
                    endpoint,
                    format!("no answer within {timeout:?}"),
                )),
            }
        })
    }

    fn report<'a>(
        &'a self,
        node: &'a AgentNode,
        _: nodekeeper_controller::shared::agents::ReportRequest<'a>,
        _: Duration,
    ) -> BoxFuture<'a, Report> {
        let view = Err(call_error(
            node.endpoint,
            "no reports in these tests".into(),
        ));
        Box::pin(std::future::ready(Report {
            view,
            rules: RulesOutcome::NotPushed,
        }))
    }

    fn run_probes<'a>(
        &'a self,
        node: &'a AgentNode,
        _: pb::RunProbesRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<pb::RunProbesResponse, CallError>> {
        let e = call_error(node.endpoint, "no probes in these tests".into());
        Box::pin(std::future::ready(Err(e)))
    }

    fn collect_diagnostics<'a>(
        &'a self,
        node: &'a AgentNode,
        _: pb::DiagnosticsRequest,
        _: Duration,
    ) -> BoxFuture<'a, Result<nodekeeper_controller::shared::agents::DiagnosticsStream, CallError>>
    {
        let e = call_error(node.endpoint, "no diagnostics in these tests".into());
        Box::pin(std::future::ready(Err(e)))
    }
}

/// Everything one test needs.
struct Rig {
    client: kube::Client,
    endpoint: Arc<OciEndpoint>,
    compute: ComputeClient,
    agents: Arc<dyn Agents>,
    nodes: Vec<Arc<SimNode>>,
    subnet: String,
    label: (String, String),
    stop: CancellationToken,
    /// The controllers' first retry wait (long by default: a failing node stays failing for
    /// the length of a test unless the test shortens it).
    retry_backoff: Duration,
    /// The controllers' bound on a node's cloud side (attach, 409s, detach).
    attach_timeout: Duration,
    /// `ApplyNetwork` calls per node address.
    applies: Arc<Mutex<BTreeMap<IpAddr, usize>>>,
}

impl Rig {
    /// `shapes[i]` and `broken[i]` for node i.
    async fn new(prefix: &str, shapes: &[&str], broken: &[bool]) -> anyhow::Result<Rig> {
        let cp = ControlPlane::shared();
        let client = cp.client().await?;
        install_crds(&client).await?;
        let endpoint = Arc::new(
            OciEndpoint::start(EndpointConfig {
                attach_delay: Duration::from_millis(800),
                detach_delay: Duration::from_millis(300),
                ..Default::default()
            })
            .await?,
        );
        let key = PrivateKey::from_pem(&test_key_pem()?)?;
        let auth = ApiKeyProvider::new("ocid1.tenancy.oc1..t", "ocid1.user.oc1..u", key.clone());
        let key_id = auth.credentials().await?.key_id;
        endpoint.register_key(&key_id, &key.public_key_pem()?)?;
        let mut cfg = ComputeConfig::new(endpoint.url());
        cfg.retry = RetryPolicy {
            max_attempts: 3,
            base: Duration::from_millis(20),
            cap: Duration::from_millis(100),
            max_elapsed: Duration::from_secs(5),
        };
        cfg.timeout = Duration::from_secs(5);
        let compute = ComputeClient::new(cfg, Arc::new(auth))?;
        let primary_subnet = endpoint.add_subnet("10.0.10.0/24")?;
        let subnet = endpoint.add_subnet("10.0.20.0/24")?;

        let label = ("nodekeeper.dev/e2e-nnc".to_string(), unique_name(prefix));
        let ips: Vec<Ipv4Addr> = (0..shapes.len())
            .map(|i| Ipv4Addr::new(127, 91, rand::random::<u8>(), 10 + i as u8))
            .collect();
        let names = create_simulated_nodes(
            &client,
            prefix,
            shapes.len(),
            &BTreeMap::from([label.clone()]),
            &ips,
        )
        .await?;
        let mut nodes = Vec::new();
        let mut by_address = BTreeMap::new();
        for (i, name) in names.iter().enumerate() {
            let (instance, _) = oci_common::instance_for_node(
                &client,
                &endpoint,
                name,
                shapes[i],
                (COMPARTMENT, AD),
                &primary_subnet,
            )
            .await?;
            let (ns, imds) = netns_host(&endpoint, &format!("nknnc{i}"), &instance).await?;
            let (tx, mut rx) = mpsc::unbounded_channel::<Call>();
            // The agent's state dir (its network journal), one per simulated node.
            let state_dir = tempfile::tempdir()?;
            ns.entry().spawn(move || async move {
                let manager = NetworkManager::new(Some(imds), state_dir.path());
                while let Some((request, reply)) = rx.recv().await {
                    let r = manager.apply(request).await.map_err(|e| e.to_string());
                    let _ = reply.send(r);
                }
            });
            by_address.insert(IpAddr::V4(ips[i]), tx);
            let broken = broken.get(i).copied().unwrap_or(false);
            nodes.push(Arc::new(SimNode::new(name, &instance, ns, broken)));
        }
        let applies = Arc::new(Mutex::new(BTreeMap::new()));
        let stop = CancellationToken::new();
        tokio::spawn(hotplug(Arc::clone(&endpoint), nodes.clone(), stop.clone()));
        Ok(Rig {
            client,
            endpoint,
            compute,
            agents: Arc::new(TestAgents::Netns(by_address, Arc::clone(&applies))),
            nodes,
            subnet,
            label,
            stop,
            retry_backoff: Duration::from_secs(300),
            attach_timeout: Duration::from_secs(30),
            applies,
        })
    }

    /// A controller as the controller-manager would run it, with its own caches (a restart
    /// starts from nothing but what OCI and the API server say).
    fn start_controller(&self) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let cloud = Cloud::new(
            self.compute.clone(),
            Some(COMPARTMENT.into()),
            CloudMetrics::default(),
        )
        .with_attach_latency(Duration::from_millis(500));
        let ctx = Arc::new(
            Context::with(
                self.client.clone(),
                Arc::clone(&self.agents),
                9443,
                CloudAccess::On(Arc::new(cloud)),
                CloudMetrics::default(),
                Settings {
                    node_concurrency: 8,
                    object_concurrency: 2,
                    poll: Duration::from_millis(250),
                    resync: Duration::from_secs(2),
                    attach_timeout: self.attach_timeout,
                    apply_timeout: Duration::from_secs(30),
                    retry_backoff: self.retry_backoff,
                    retry_backoff_max: self.retry_backoff * 4,
                },
            )
            .watching(&format!("{}={}", self.label.0, self.label.1)),
        );
        let token = CancellationToken::new();
        let handle = tokio::spawn(controllers::start(
            ctx,
            ReconcileMetrics::default(),
            token.clone(),
        ));
        (token, handle)
    }

    fn selector(&self) -> Value {
        json!({"matchLabels": {self.label.0.clone(): self.label.1.clone()}})
    }

    fn attach_calls(&self) -> usize {
        self.endpoint
            .requests()
            .iter()
            .filter(|r| r.method == Method::POST && r.path == "/vnicAttachments" && r.status == 200)
            .count()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The host state a refused object must leave alone.
fn host_snapshot(ns: &Netns) -> anyhow::Result<Value> {
    Ok(json!({
        "addr": ip_json(ns, &["addr", "show"])?,
        "route": ip_json(ns, &["route", "show", "table", "all"])?,
        "rule": ip_json(ns, &["rule", "show"])?,
    }))
}

async fn status_of(api: &Api<NodeNetworkConfig>, name: &str) -> anyhow::Result<Value> {
    let obj = api.get(name).await?;
    Ok(serde_json::to_value(obj.status.unwrap_or_default())?)
}

async fn node_ready(
    client: &kube::Client,
    node: &str,
) -> anyhow::Result<Option<(String, String, String)>> {
    nodekeeper_e2e::node_condition(client, node, NODE_CONDITION_NETWORK_READY).await
}

/// Server-side applies NodeNetworkConfig `name` with `spec`, labelled `label` so that only this
/// test's controller reconciles it (tests share the API server).
async fn apply_nnc(
    api: &Api<NodeNetworkConfig>,
    label: &(String, String),
    name: &str,
    spec: Value,
) -> anyhow::Result<()> {
    let labels = BTreeMap::from([label.clone()]);
    nodekeeper_e2e::apply_labelled_spec(api, name, &labels, spec).await
}

fn vnic(name: &str, subnet: &str) -> Value {
    json!({"displayName": name, "subnetId": subnet})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_vnics_on_three_nodes_rolled_out_rolled_back_detached_never_doubled()
-> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let rig = Rig::new("nnc", &[VM, VM, VM], &[false, false, true]).await?;
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());
    let name = unique_name("vnics");
    let (mut stop, mut handle) = rig.start_controller();
    // The check target is the pod subnet's router: it answers on the nodes whose VNIC can
    // reach it, and not on the broken node.
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic("pods-a", &rig.subnet), vnic("pods-b", &rig.subnet)]},
            "rollout": {"maxUnavailable": 1, "failureThreshold": 1},
            "checkTargets": ["10.0.20.1"],
            "checkTimeoutMs": 1500,
        }),
    )
    .await?;

    // Restart the controller mid-rollout: once the first attach is in flight.
    wait_for("the first AttachVnic", TIMEOUT, || async {
        Ok((rig.attach_calls() >= 1).then_some(()))
    })
    .await?;
    stop.cancel();
    handle.await?;
    (stop, handle) = rig.start_controller();

    let status = wait_for(
        "two nodes applied and the broken one failing",
        TIMEOUT,
        || async {
            let s = status_of(&api, &name).await?;
            Ok((s["applied"] == 2 && s["failing"] == 1).then_some(s))
        },
    )
    .await?;
    assert_eq!(status["matched"], 3, "{status:#}");
    assert_eq!(status["attached"], 3, "{status:#}");
    let failing = &status["failingNodes"][0];
    assert_eq!(failing["node"], rig.nodes[2].name.as_str(), "{status:#}");
    assert_eq!(failing["rolledBack"], true, "{status:#}");
    assert!(
        failing["error"]
            .as_str()
            .unwrap_or("")
            .contains("10.0.20.1"),
        "{status:#}"
    );
    let progressing = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Progressing")
        .cloned()
        .unwrap();
    assert_eq!(progressing["reason"], REASON_PAUSED, "{status:#}");
    assert!(
        progressing["message"]
            .as_str()
            .unwrap()
            .contains(&rig.nodes[2].name),
        "{status:#}"
    );

    // Never doubled, restart included: 2 VNICs × 3 nodes.
    assert_eq!(rig.attach_calls(), 6);
    for n in &rig.nodes {
        assert_eq!(
            rig.endpoint.live_attachment_count(&n.instance),
            3,
            "{}",
            n.name
        );
    }

    // The host side, read back with `ip -j`.
    for n in &rig.nodes[..2] {
        let vnics: Vec<_> = rig
            .endpoint
            .guest_vnics(&n.instance)
            .into_iter()
            .filter(|v| !v.primary)
            .collect();
        assert_eq!(vnics.len(), 2);
        let routes = default_routes(&n.ns)?;
        let rules = nk_rules(&n.ns)?;
        for (i, v) in vnics.iter().enumerate() {
            let table = 101 + i as u64;
            assert_eq!(
                addresses_of(&n.ns, &v.mac)?,
                [format!("{}/24", v.private_ip)],
                "{}",
                n.name
            );
            assert!(
                routes.contains(&(table, v.router.to_string())),
                "{}: {routes:?}",
                n.name
            );
            assert!(
                rules.iter().any(
                    |(_, from, t)| from == &v.private_ip.to_string() && t == &table.to_string()
                ),
                "{}: {rules:?}",
                n.name
            );
        }
        let ready = node_ready(&rig.client, &n.name)
            .await?
            .context("NodeNetworkReady")?;
        assert_eq!(
            (ready.0.as_str(), ready.1.as_str()),
            ("True", "NetworkConverged"),
            "{ready:?}"
        );
    }
    // The broken node: rolled back, nothing of nodekeeper's left, reported on the Node.
    let broken = &rig.nodes[2];
    assert!(
        nk_rules(&broken.ns)?.is_empty(),
        "{:?}",
        nk_rules(&broken.ns)?
    );
    assert!(
        default_routes(&broken.ns)?.is_empty(),
        "{:?}",
        default_routes(&broken.ns)?
    );
    let ready = node_ready(&rig.client, &broken.name)
        .await?
        .context("NodeNetworkReady")?;
    assert_eq!(
        (ready.0.as_str(), ready.1.as_str()),
        ("False", "NetworkApplyFailed"),
        "{ready:?}"
    );

    // The failed node leaves the selector while the controller is down (a restart forgets the
    // rollout). Its VNICs are still this object's, and go: the restarted controller finds the
    // node by the generation its condition names.
    stop.cancel();
    handle.await?;
    Api::<Node>::all(rig.client.clone())
        .patch(
            &broken.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {rig.label.0.clone(): null}}})),
        )
        .await?;
    (stop, handle) = rig.start_controller();
    wait_for(
        "the failed node's VNICs detached after it left",
        TIMEOUT,
        || async {
            let left = ["pods-a", "pods-b"].map(|v| attachment_state(&rig, broken, v));
            Ok((left == [Some("DETACHED"); 2]).then_some(()))
        },
    )
    .await?;
    wait_for(
        "the failed node's NodeNetworkReady removed",
        TIMEOUT,
        || async {
            Ok(node_ready(&rig.client, &broken.name)
                .await?
                .is_none()
                .then_some(()))
        },
    )
    .await?;

    // Remove one VNIC: its host side goes, then it is detached.
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic("pods-a", &rig.subnet)]},
            "rollout": {"maxUnavailable": 1, "failureThreshold": 1},
            "checkTargets": ["10.0.20.1"],
            "checkTimeoutMs": 1500,
        }),
    )
    .await?;
    let n0 = &rig.nodes[0];
    let b = rig
        .endpoint
        .guest_vnics(&n0.instance)
        .into_iter()
        .find(|v| v.display_name.as_deref() == Some("pods-b"))
        .context("pods-b")?;
    wait_for("pods-b detached from the first node", TIMEOUT, || async {
        let now = rig
            .endpoint
            .guest_vnics(&n0.instance)
            .into_iter()
            .find(|v| v.attachment_id == b.attachment_id);
        Ok(now.filter(|v| v.state == "DETACHED").map(|_| ()))
    })
    .await?;
    wait_for("the first node applied again", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["applied"].as_u64() >= Some(1)).then_some(()))
    })
    .await?;
    let rules = nk_rules(&n0.ns)?;
    assert!(
        !rules
            .iter()
            .any(|(_, from, _)| from == &b.private_ip.to_string()),
        "pods-b's rule is left: {rules:?}"
    );
    assert!(
        !default_routes(&n0.ns)?.iter().any(|(t, _)| *t == 102),
        "{:?}",
        default_routes(&n0.ns)?
    );
    let a = rig
        .endpoint
        .guest_vnics(&n0.instance)
        .into_iter()
        .find(|v| v.display_name.as_deref() == Some("pods-a"))
        .context("pods-a")?;
    assert_eq!(
        addresses_of(&n0.ns, &a.mac)?,
        [format!("{}/24", a.private_ip)]
    );
    assert_eq!(rig.attach_calls(), 6, "removing a VNIC attaches nothing");

    // Deleting the object detaches what it attached, and only that.
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the object gone after its cleanup", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    for n in &rig.nodes {
        let live: Vec<_> = rig
            .endpoint
            .guest_vnics(&n.instance)
            .into_iter()
            .filter(|v| !matches!(v.state, "DETACHED" | "DETACHING"))
            .collect();
        ensure!(live.len() == 1 && live[0].primary, "{}: {live:?}", n.name);
    }
    stop.cancel();
    handle.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_input_is_named_and_changes_nothing_on_the_host() -> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let rig = Rig::new("nncbad", &[VM, BM], &[false, false]).await?;
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());

    // A subnet OCID of the wrong form: the API server refuses it, naming the field.
    let name = unique_name("badsubnet");
    let e = apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic("x", "ocid1.vcn.oc1.phx.aaaa")]},
        }),
    )
    .await
    .unwrap_err();
    let text = format!("{e:#}");
    assert!(
        text.contains("subnetId") && text.contains("subnet OCID"),
        "{text}"
    );

    let before: Vec<Value> = rig
        .nodes
        .iter()
        .map(|n| host_snapshot(&n.ns))
        .collect::<anyhow::Result<_>>()?;
    // nicIndex on the VM node: refused per node, naming the field. On the bare-metal node the
    // attach goes to OCI, which answers 404: refused, naming OCI's code.
    rig.endpoint.inject(Fault {
        status: 404,
        code: "NotAuthorizedOrNotFound".into(),
        message: "Authorization failed or requested resource not found.".into(),
        count: 1,
        method: Some(Method::POST),
    });
    let (stop, handle) = rig.start_controller();

    // Secondary private IPs are not assigned yet: a count is refused (the schema still takes
    // it, so that objects stored when it was documented stay valid), naming the field and the
    // way to have them, and nothing changes anywhere.
    let name = unique_name("secondaryips");
    let mut ips = vnic("x", &rig.subnet);
    ips["secondaryPrivateIpCount"] = json!(2);
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({"nodeSelector": rig.selector(), "ociVnics": {"attach": [ips]}}),
    )
    .await?;
    let ready = wait_for("the secondary IPs refused", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok(condition(&s, "Ready").filter(|c| c["reason"] == "InvalidSpec"))
    })
    .await?;
    let message = ready["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("spec.ociVnics.attach[0].secondaryPrivateIpCount")
            && message.contains("not supported yet")
            && message.contains("assign-private-ip"),
        "{ready}"
    );
    assert_eq!(rig.attach_calls(), 0);
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the refused object deleted", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;

    let name = unique_name("nicindex");
    let mut one = vnic("x", &rig.subnet);
    one["nicIndex"] = json!(1);
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [one]},
            "rollout": {"maxUnavailable": 2, "failureThreshold": 5},
        }),
    )
    .await?;
    let status = wait_for("both nodes failing", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["failing"] == 2).then_some(s))
    })
    .await?;
    let errors: BTreeMap<String, String> = status["failingNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["node"].as_str().unwrap().to_string(),
                f["error"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let vm_error = &errors[&rig.nodes[0].name];
    assert!(
        vm_error.starts_with("spec.ociVnics.attach[0].nicIndex:"),
        "{vm_error}"
    );
    assert!(vm_error.contains("remove nicIndex"), "{vm_error}");
    let bm_error = &errors[&rig.nodes[1].name];
    assert!(
        bm_error.contains("NotAuthorizedOrNotFound") && bm_error.contains("404"),
        "{bm_error}"
    );
    for n in &rig.nodes {
        let ready = node_ready(&rig.client, &n.name)
            .await?
            .context("NodeNetworkReady")?;
        assert_eq!(
            (ready.0.as_str(), ready.1.as_str()),
            ("False", "VnicAttachFailed"),
            "{ready:?}"
        );
    }
    // Nothing attached, nothing on the hosts changed.
    assert_eq!(rig.attach_calls(), 0);
    for (n, b) in rig.nodes.iter().zip(&before) {
        if host_snapshot(&n.ns)? != *b {
            bail!("{}: the host changed", n.name);
        }
    }
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the refused object deleted", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    stop.cancel();
    handle.await?;
    Ok(())
}

fn condition(status: &Value, type_: &str) -> Option<Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

/// The state OCI gives the attachment of VNIC `display_name` on `node`, if any.
fn attachment_state(rig: &Rig, node: &SimNode, display_name: &str) -> Option<&'static str> {
    rig.endpoint
        .guest_vnics(&node.instance)
        .into_iter()
        .filter(|v| v.display_name.as_deref() == Some(display_name))
        .map(|v| v.state)
        .find(|s| *s != "DETACHED")
        .or_else(|| {
            rig.endpoint
                .guest_vnics(&node.instance)
                .into_iter()
                .find(|v| v.display_name.as_deref() == Some(display_name))
                .map(|v| v.state)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_leaving_is_cleaned_and_a_node_selected_twice_stays_with_the_older_object()
-> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let rig = Rig::new("nncleave", &[VM, VM], &[false, false]).await?;
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());
    let (stop, handle) = rig.start_controller();
    let spec = |vnic_name: &str| {
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic(vnic_name, &rig.subnet)]},
            "rollout": {"maxUnavailable": 2},
            "checkTargets": ["10.0.20.1"],
            "checkTimeoutMs": 1500,
        })
    };
    let older = unique_name("older");
    apply_nnc(&api, &rig.label, &older, spec("pods-a")).await?;
    wait_for("both nodes applied", TIMEOUT, || async {
        let s = status_of(&api, &older).await?;
        Ok((s["applied"] == 2).then_some(()))
    })
    .await?;

    // A younger object selecting the same nodes leaves them alone and says why.
    let younger = unique_name("younger");
    apply_nnc(&api, &rig.label, &younger, spec("pods-y")).await?;
    let status = wait_for(
        "the younger object's Conflict condition",
        TIMEOUT,
        || async {
            let s = status_of(&api, &younger).await?;
            Ok(condition(&s, "Conflict").map(|_| s))
        },
    )
    .await?;
    let conflict = condition(&status, "Conflict").unwrap();
    let message = conflict["message"].as_str().unwrap_or("");
    assert_eq!(conflict["status"], "True", "{status:#}");
    assert_eq!(conflict["reason"], "NodesSelectedByAnother", "{status:#}");
    for word in [&older, &younger, &rig.nodes[0].name, &rig.nodes[1].name] {
        assert!(message.contains(word.as_str()), "{word} missing: {message}");
    }
    assert_eq!(status["matched"], 0, "{status:#}");
    assert!(condition(&status_of(&api, &older).await?, "Conflict").is_none());
    assert_eq!(rig.attach_calls(), 2, "the younger object attached nothing");

    // The second node leaves the selector: its host side goes, then its VNIC.
    let leaving = &rig.nodes[1];
    Api::<Node>::all(rig.client.clone())
        .patch(
            &leaving.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {rig.label.0.clone(): null}}})),
        )
        .await?;
    wait_for(
        "pods-a detached from the node that left",
        TIMEOUT,
        || async {
            Ok((attachment_state(&rig, leaving, "pods-a") == Some("DETACHED")).then_some(()))
        },
    )
    .await?;
    assert!(
        nk_rules(&leaving.ns)?.is_empty(),
        "{:?}",
        nk_rules(&leaving.ns)?
    );
    assert!(
        default_routes(&leaving.ns)?.is_empty(),
        "{:?}",
        default_routes(&leaving.ns)?
    );
    wait_for(
        "the left node's NodeNetworkReady removed",
        TIMEOUT,
        || async {
            Ok(node_ready(&rig.client, &leaving.name)
                .await?
                .is_none()
                .then_some(()))
        },
    )
    .await?;
    let s = wait_for("the older object matching one node", TIMEOUT, || async {
        let s = status_of(&api, &older).await?;
        Ok((s["matched"] == 1 && s["applied"] == 1).then_some(s))
    })
    .await?;
    assert_eq!(s["attached"], 1, "{s:#}");
    // Only that node: the other keeps its VNIC and its host side.
    let stays = &rig.nodes[0];
    assert_eq!(attachment_state(&rig, stays, "pods-a"), Some("ATTACHED"));
    let rules = nk_rules(&stays.ns)?;
    assert!(rules.iter().any(|(_, _, t)| t == "101"), "{rules:?}");

    // The older object goes: the younger takes the node over (and the conflict ends).
    api.delete(&older, &DeleteParams::default()).await?;
    let s = wait_for(
        "the younger object applied on the first node",
        TIMEOUT,
        || async {
            let s = status_of(&api, &younger).await?;
            Ok((s["applied"] == 1).then_some(s))
        },
    )
    .await?;
    assert!(condition(&s, "Conflict").is_none(), "{s:#}");
    assert_eq!(attachment_state(&rig, stays, "pods-a"), Some("DETACHED"));
    assert_eq!(attachment_state(&rig, stays, "pods-y"), Some("ATTACHED"));
    assert_eq!(rig.attach_calls(), 3);
    api.delete(&younger, &DeleteParams::default()).await?;
    wait_for("the younger object deleted", TIMEOUT, || async {
        Ok(api.get_opt(&younger).await?.is_none().then_some(()))
    })
    .await?;
    stop.cancel();
    handle.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_node_is_retried_with_backoff_and_the_pause_holds() -> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let mut rig = Rig::new("nncretry", &[VM, VM], &[true, false]).await?;
    rig.retry_backoff = Duration::from_secs(1); // then 2 s, then 4 s at most
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());
    let (stop, handle) = rig.start_controller();
    let name = unique_name("retry");
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic("pods-a", &rig.subnet)]},
            "rollout": {"maxUnavailable": 1, "failureThreshold": 1},
            "checkTargets": ["10.0.20.1"],
            "checkTimeoutMs": 1000,
        }),
    )
    .await?;
    wait_for("the broken node failing", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["failing"] == 1).then_some(()))
    })
    .await?;
    let applies = || rig.applies.lock().unwrap().values().sum::<usize>();
    let first = applies();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let retries = applies() - first;
    // Backoff 1 s, 2 s, 4 s (each try also spends ~1 s in the failing check): 2 or 3 tries in
    // 8 s. Retrying at every pass (every 250 ms) would be about 30; never retrying, 0.
    assert!((1..=5).contains(&retries), "{retries} retries in 8 s");
    // The pause held all along: the second node never started.
    let s = status_of(&api, &name).await?;
    assert_eq!(
        (s["applied"].as_u64(), s["failing"].as_u64()),
        (Some(0), Some(1)),
        "{s:#}"
    );
    assert_eq!(
        condition(&s, "Progressing").unwrap()["reason"],
        REASON_PAUSED,
        "{s:#}"
    );
    assert_eq!(attachment_state(&rig, &rig.nodes[1], "pods-a"), None);

    // Fix the broken node (its VNIC's router answers now): the next retry applies it, the
    // pause lifts and the rollout goes on.
    let broken = &rig.nodes[0];
    let link = broken
        .plugged
        .lock()
        .unwrap()
        .values()
        .find(|l| !l.is_empty())
        .cloned()
        .context("the broken node's VNIC interface")?;
    broken
        .ns
        .ip(&["addr", "add", "10.0.20.1/24", "dev", &format!("{link}p")])?;
    wait_for("both nodes applied", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["applied"] == 2 && s["failing"] == 0).then_some(()))
    })
    .await?;
    let ready = node_ready(&rig.client, &broken.name)
        .await?
        .context("NodeNetworkReady")?;
    assert_eq!(
        (ready.0.as_str(), ready.1.as_str()),
        ("True", "NetworkConverged")
    );
    assert_eq!(rig.attach_calls(), 2, "a retry never attaches twice");
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the object deleted", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    stop.cancel();
    handle.await?;
    Ok(())
}

/// Writes `NodeNetworkReady` on `node` as the node sweep does from the agent's report (its own
/// field manager, taking the condition over).
async fn sweep_writes(
    client: &kube::Client,
    node: &str,
    reason: &str,
    message: &str,
) -> anyhow::Result<()> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let body = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "status": {"conditions": [{
            "type": NODE_CONDITION_NETWORK_READY,
            "status": "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
            "lastHeartbeatTime": now,
        }]},
    });
    Api::<Node>::all(client.clone())
        .patch_status(
            node,
            &PatchParams::apply("nodekeeper-e2e-sweep").force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

/// After a restart the controller finds an object's host
/// side by the generation the Node's `NodeNetworkReady` names. The node sweep rewrites that
/// condition from the agent's report: drifted (a drift not repaired yet), or the agent's last error (a
/// later generation that failed and was rolled back); both still name the generation the agent
/// holds. A restarted controller must still remove the host side where that generation is, on
/// a node that left the selector and on deletion, before detaching the VNICs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_controller_removes_the_host_side_under_the_sweeps_condition()
-> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let rig = Rig::new("nncsweep", &[VM, VM], &[false, false]).await?;
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());
    let (stop, handle) = rig.start_controller();
    let name = unique_name("sweep");
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic("pods-a", &rig.subnet)]},
            "rollout": {"maxUnavailable": 2},
            "checkTargets": ["10.0.20.1"],
            "checkTimeoutMs": 1500,
        }),
    )
    .await?;
    wait_for("both nodes applied", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["applied"] == 2).then_some(()))
    })
    .await?;
    for n in &rig.nodes {
        ensure!(!nk_rules(&n.ns)?.is_empty(), "{}: no rules applied", n.name);
    }
    let obj = api.get(&name).await?;
    let applied = format!(
        "{}/{}",
        obj.metadata.uid.clone().unwrap_or_default(),
        obj.metadata.generation.unwrap_or(0)
    );

    // The controller goes down; meanwhile the sweep rewrites both nodes' conditions in its own
    // words, and the first node leaves the selector.
    stop.cancel();
    handle.await?;
    let (leaving, deleted) = (&rig.nodes[0], &rig.nodes[1]);
    sweep_writes(
        &rig.client,
        &leaving.name,
        "NetworkDrifted",
        &format!(
            "drifted from generation {applied}: add-route 0.0.0.0/0 via 10.0.20.1 dev ens5 table 101"
        ),
    )
    .await?;
    sweep_writes(
        &rig.client,
        &deleted.name,
        "NetworkApplyFailed",
        &format!(
            "post-apply check failed: icmp 10.0.20.1: no answer within 1500 ms; host networking \
             stays at generation {applied}"
        ),
    )
    .await?;
    Api::<Node>::all(rig.client.clone())
        .patch(
            &leaving.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {rig.label.0.clone(): null}}})),
        )
        .await?;
    let (stop, handle) = rig.start_controller();
    wait_for(
        "pods-a detached from the node that left",
        TIMEOUT,
        || async {
            Ok((attachment_state(&rig, leaving, "pods-a") == Some("DETACHED")).then_some(()))
        },
    )
    .await?;
    let rules = nk_rules(&leaving.ns)?;
    ensure!(
        rules.is_empty(),
        "the node that left keeps the object's rules: {rules:?}"
    );

    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the object gone after its cleanup", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    let rules = nk_rules(&deleted.ns)?;
    ensure!(
        rules.is_empty(),
        "the deleted object's rules are left on the host: {rules:?}"
    );
    ensure!(
        default_routes(&deleted.ns)?.is_empty(),
        "{:?}",
        default_routes(&deleted.ns)?
    );
    ensure!(attachment_state(&rig, deleted, "pods-a") == Some("DETACHED"));
    stop.cancel();
    handle.await?;
    Ok(())
}

/// OCI answering every AttachVnic with 409 Conflict (the
/// instance is being changed by something else, for good) fails the node after the attach
/// timeout, naming OCI's answer, instead of leaving it in progress forever; once the conflict
/// ends, the retry attaches and applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lasting_409_fails_the_node_after_the_attach_timeout() -> anyhow::Result<()> {
    skip_unless_root!("needs root to create network namespaces");
    let mut rig = Rig::new("nnc409", &[VM], &[false]).await?;
    rig.attach_timeout = Duration::from_secs(3);
    rig.retry_backoff = Duration::from_secs(1);
    rig.endpoint.inject(Fault {
        status: 409,
        code: "Conflict".into(),
        message: "The instance is being modified by another operation".into(),
        count: u32::MAX,
        method: Some(Method::POST),
    });
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());
    let (stop, handle) = rig.start_controller();
    let name = unique_name("conflict");
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": rig.selector(),
            "ociVnics": {"attach": [vnic("pods-a", &rig.subnet)]},
            "rollout": {"maxUnavailable": 1, "failureThreshold": 1},
            "checkTargets": ["10.0.20.1"],
            "checkTimeoutMs": 1500,
        }),
    )
    .await?;
    let status = wait_for("the node failing on the 409", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["failing"] == 1).then_some(s))
    })
    .await?;
    let error = status["failingNodes"][0]["error"].as_str().unwrap_or("");
    for words in [
        "spec.ociVnics.attach[0] (pods-a): AttachVnic: 409 Conflict",
        "being modified by another operation",
        "still refused after 3s",
    ] {
        assert!(error.contains(words), "{words:?} missing: {status:#}");
    }
    assert_eq!(status["failingNodes"][0]["rolledBack"], false, "{status:#}");

    // The conflict ends: the retry attaches and applies.
    rig.endpoint.clear_faults();
    wait_for("the node applied after the conflict", TIMEOUT, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["applied"] == 1 && s["failing"] == 0).then_some(()))
    })
    .await?;
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the object deleted", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    stop.cancel();
    handle.await?;
    Ok(())
}

/// This process's CPU time (user + system), from `/proc/self/stat`.
fn process_cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    let after = stat.rsplit_once(')').context("parse /proc/self/stat")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}

/// The apiserver's write counters that only this controller moves: server-side applies of
/// `nodes/status` and `nodenetworkconfigs/status`, and patches of `nodenetworkconfigs` (the
/// finalizer). kwok's heartbeats are not applies, and the benchmark's own writes happen
/// before the first reading or are subtracted.
async fn controller_writes(client: &kube::Client) -> anyhow::Result<f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    let mut total = 0.0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let has = |k: &str, v: &str| line.contains(&format!("{k}=\"{v}\""));
        let ours = (has("verb", "APPLY")
            && has("subresource", "status")
            && (has("resource", "nodes") || has("resource", "nodenetworkconfigs")))
            || (has("verb", "PATCH") && has("resource", "nodenetworkconfigs"));
        if ours {
            total += line
                .rsplit_once(' ')
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap_or(0.0);
        }
    }
    Ok(total)
}

/// The kube-apiserver's own CPU seconds (its `process_cpu_seconds_total`): it shares the
/// machine's cores with the controller in the benchmark.
async fn apiserver_cpu_seconds(client: &kube::Client) -> anyhow::Result<f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    text.lines()
        .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
        .and_then(|v| v.trim().parse().ok())
        .context("process_cpu_seconds_total in the apiserver's /metrics")
}

/// Where a rollout's time goes, batch by batch, from the endpoint's log: the AttachVnic calls
/// in the order they came, cut into batches of `batch` nodes; each batch's GetVnicAttachment
/// calls are those before the next batch's first attach. Per batch, seconds: when its first
/// attach came (from `started`), how long its attaches took to all go out, from its last attach
/// to its first look, to its last look (the last node seen ATTACHED), and from that last look
/// to the next batch's first attach (apply on the host, the finished nodes' bookkeeping and the
/// next nodes' ListVnicAttachments).
fn batch_timeline(calls: &[Recorded], started: Instant, batch: usize) -> Vec<serde_json::Value> {
    let secs = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
    let is = |r: &Recorded, op: &str| {
        let collection = r.path.split('/').filter(|s| !s.is_empty()).count() == 1;
        r.path.starts_with("/vnicAttachments")
            && match op {
                "attach" => r.method == Method::POST,
                _ => r.method == Method::GET && !collection,
            }
    };
    let attaches: Vec<_> = calls
        .iter()
        .filter(|r| is(r, "attach"))
        .map(|r| r.at)
        .collect();
    let starts: Vec<_> = attaches.chunks(batch).map(|c| c[0]).collect();
    attaches
        .chunks(batch)
        .enumerate()
        .map(|(k, chunk)| {
            let (first, last) = (chunk[0], chunk[chunk.len() - 1]);
            let next = starts.get(k + 1).copied();
            let looks: Vec<_> = calls
                .iter()
                .filter(|r| is(r, "look") && r.at >= first && next.is_none_or(|t| r.at < t))
                .map(|r| r.at)
                .collect();
            let (first_look, last_look) = (looks.iter().min(), looks.iter().max());
            json!({
                "start_s": secs(first),
                "attaching_s": (last - first).as_secs_f64(),
                "to_first_look_s": first_look.map(|t| t.saturating_duration_since(last).as_secs_f64()),
                "to_last_look_s": last_look.map(|t| t.saturating_duration_since(last).as_secs_f64()),
                "to_next_batch_s": last_look.zip(next).map(|(l, n)| n.saturating_duration_since(*l).as_secs_f64()),
                "looks": looks.len(),
            })
        })
        .collect()
}

/// A rollout of simulated nodes (no namespaces, no netlink): `n` kwok nodes labelled with a
/// fresh label, an instance each on `endpoint`, the simulated agents (those named in `slow`
/// answer ApplyNetwork only after that long, by index in creation order), and the controller running with `settings`.
struct SimRollout {
    client: kube::Client,
    endpoint: Arc<OciEndpoint>,
    /// The subnet to attach the VNICs in.
    pods: String,
    label: (String, String),
    names: Vec<String>,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

/// The settings of the simulated rollouts; callers change what they measure.
fn sim_settings() -> Settings {
    Settings {
        node_concurrency: 8,
        object_concurrency: 2,
        poll: Duration::from_millis(250),
        resync: Duration::from_secs(5),
        attach_timeout: Duration::from_secs(120),
        apply_timeout: Duration::from_secs(30),
        retry_backoff: Duration::from_secs(30),
        retry_backoff_max: Duration::from_secs(600),
    }
}

#[allow(clippy::too_many_arguments)]
async fn sim_rollout(
    client: &kube::Client,
    endpoint: Arc<OciEndpoint>,
    key: &PrivateKey,
    prefix: &str,
    n: usize,
    attach_latency: Duration,
    settings: Settings,
    slow: &BTreeMap<usize, Duration>,
) -> anyhow::Result<SimRollout> {
    let client = client.clone();
    let auth = ApiKeyProvider::new("ocid1.tenancy.oc1..t", "ocid1.user.oc1..u", key.clone());
    endpoint.register_key(&auth.credentials().await?.key_id, &key.public_key_pem()?)?;
    let compute = ComputeClient::new(ComputeConfig::new(endpoint.url()), Arc::new(auth))?;
    let primary = endpoint.add_subnet("10.0.0.0/16")?;
    let pods = endpoint.add_subnet("10.1.0.0/16")?;
    let label = ("nodekeeper.dev/sim-vnic".to_string(), unique_name(prefix));
    let names =
        create_simulated_nodes(&client, prefix, n, &BTreeMap::from([label.clone()]), &[]).await?;
    let mut instances = BTreeMap::new();
    let mut slow_ips = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        let (instance, node) = oci_common::instance_for_node(
            &client,
            &endpoint,
            name,
            VM,
            (COMPARTMENT, AD),
            &primary,
        )
        .await?;
        let ip: IpAddr = node
            .status
            .and_then(|s| s.addresses)
            .unwrap_or_default()
            .iter()
            .find(|a| a.type_ == "InternalIP")
            .context("InternalIP")?
            .address
            .parse()?;
        instances.insert(ip, instance);
        if let Some(delay) = slow.get(&i) {
            slow_ips.insert(ip, *delay);
        }
    }
    let agents: Arc<dyn Agents> = Arc::new(TestAgents::Simulated {
        endpoint: Arc::clone(&endpoint),
        instances,
        slow: slow_ips,
    });
    let ctx = Arc::new(
        Context::with(
            client.clone(),
            agents,
            9443,
            CloudAccess::On(Arc::new(
                Cloud::new(compute, Some(COMPARTMENT.into()), CloudMetrics::default())
                    .with_attach_latency(attach_latency),
            )),
            CloudMetrics::default(),
            settings,
        )
        .watching(&format!("{}={}", label.0, label.1)),
    );
    let stop = CancellationToken::new();
    let handle = tokio::spawn(controllers::start(
        ctx,
        ReconcileMetrics::default(),
        stop.clone(),
    ));
    Ok(SimRollout {
        client,
        endpoint,
        pods,
        label,
        names,
        stop,
        handle,
    })
}

/// A node that finishes frees its place at once: with `maxUnavailable: 2`, the first node's
/// successor is attached, looked at, applied and shown Ready on its Node while the second
/// node's agent is still applying (it answers after 6 s), not after it, as when a pass waited
/// for every node it stepped before starting the next ones and looking again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_finished_node_starts_the_next_while_a_slow_one_still_applies() -> anyhow::Result<()> {
    let cp = ControlPlane::shared();
    let client = cp.client().await?;
    install_crds(&client).await?;
    let attach_delay = Duration::from_millis(300);
    let endpoint = Arc::new(
        OciEndpoint::start(EndpointConfig {
            attach_delay,
            ..Default::default()
        })
        .await?,
    );
    let key = PrivateKey::from_pem(&test_key_pem()?)?;
    let slow_apply = Duration::from_secs(6);
    // Nodes start in name order; the second one's agent is slow, the third waits its turn.
    let rig = sim_rollout(
        &client,
        endpoint,
        &key,
        "vslow",
        3,
        attach_delay * 2,
        sim_settings(),
        &BTreeMap::from([(1, slow_apply)]),
    )
    .await?;
    let mut names = rig.names.clone();
    names.sort();
    ensure!(
        names == rig.names,
        "nodes {:?} are not created in name order",
        rig.names
    );
    let (slow_name, next) = (names[1].clone(), names[2].clone());
    let api: Api<NodeNetworkConfig> = Api::all(rig.client.clone());
    let name = unique_name("vslow");
    let started = Instant::now();
    apply_nnc(
        &api,
        &rig.label,
        &name,
        json!({
            "nodeSelector": {"matchLabels": {rig.label.0.clone(): rig.label.1.clone()}},
            "ociVnics": {"attach": [vnic("pods", &rig.pods)]},
            "rollout": {"maxUnavailable": 2, "failureThreshold": 1},
        }),
    )
    .await?;
    let nodes: Api<Node> = Api::all(rig.client.clone());
    let ready = |node: Node| {
        node.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == NODE_CONDITION_NETWORK_READY)
            .map(|c| c.status)
    };
    wait_for(
        &format!("{next} NodeNetworkReady=True"),
        Duration::from_secs(30),
        || async { Ok((ready(nodes.get(&next).await?).as_deref() == Some("True")).then_some(())) },
    )
    .await?;
    let waited = started.elapsed();
    let slow_state = ready(nodes.get(&slow_name).await?);
    ensure!(
        slow_state.as_deref() != Some("True"),
        "{next} became Ready after {waited:?}, only once the slow node {slow_name} was \
         ({slow_state:?}): it waited for the slow apply"
    );
    ensure!(
        waited < slow_apply,
        "{next} took {waited:?}, longer than the slow node's apply ({slow_apply:?})"
    );
    wait_for("every node applied", Duration::from_secs(60), || async {
        let s = status_of(&api, &name).await?;
        Ok((s["applied"].as_u64() == Some(3)).then_some(()))
    })
    .await?;
    let attaches = rig
        .endpoint
        .requests()
        .iter()
        .filter(|r| r.method == Method::POST && r.path.starts_with("/vnicAttachments"))
        .count();
    ensure!(attaches == 3, "{attaches} AttachVnic calls for 3 nodes");
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the object gone", Duration::from_secs(60), || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    rig.stop.cancel();
    rig.handle.await?;
    Ok(())
}

/// `cargo xtask bench vnic` runs this with `NODEKEEPER_BENCH_VNIC_NODES` (default 100) and
/// reads the figures from the JSON file `NODEKEEPER_BENCH_OUT` names: N kwok nodes, one VNIC
/// each, `maxUnavailable: 10%`, the local endpoint with a 1 s attach, simulated agents.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "benchmark: cargo xtask bench vnic"]
async fn bench_vnic() -> anyhow::Result<()> {
    let n: usize = std::env::var("NODEKEEPER_BENCH_VNIC_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    // The controller's own log, when asked for (`NODEKEEPER_LOG=nodekeeper_controller=debug`
    // shows where each reconcile pass spends its time).
    if std::env::var_os("NODEKEEPER_LOG").is_some() {
        use clap::Parser as _;
        nodekeeper_controller::runtime::logging::init(&nodekeeper_controller::Cli::parse_from([
            "bench_vnic",
        ]));
    }
    // The simulated ATTACHING → ATTACHED time (`cargo xtask bench vnic --attach-latency`).
    let attach_delay = Duration::from_millis(
        std::env::var("NODEKEEPER_BENCH_VNIC_ATTACH_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
    );
    let poll = Duration::from_millis(250);
    let cp = ControlPlane::shared();
    let client = cp.client().await?;
    install_crds(&client).await?;
    let endpoint = Arc::new(
        OciEndpoint::start(EndpointConfig {
            attach_delay,
            ..Default::default()
        })
        .await?,
    );
    let key = PrivateKey::from_pem(&test_key_pem()?)?;
    // What one request signature costs the controller (every cloud call carries one).
    let signing = Instant::now();
    for i in 0..200u32 {
        key.sign_base64(format!("date: {i}\n(request-target): get /vnicAttachments/x").as_bytes())?;
    }
    let signature_ms = signing.elapsed().as_secs_f64() * 1000.0 / 200.0;
    // The same with the `rsa` crate, which signed them before (the comparison BENCHMARKS.md
    // keeps).
    let signature_rsa_crate_ms = {
        use rsa::pkcs8::DecodePrivateKey as _;
        use sha2::Digest as _;
        let slow = rsa::RsaPrivateKey::from_pkcs8_pem(&test_key_pem()?)?;
        let signing = Instant::now();
        for i in 0..50u32 {
            let digest = sha2::Sha256::digest(format!("date: {i}").as_bytes());
            slow.sign(rsa::Pkcs1v15Sign::new::<sha2::Sha256>(), &digest)?;
        }
        signing.elapsed().as_secs_f64() * 1000.0 / 50.0
    };
    let SimRollout {
        client,
        endpoint,
        pods,
        label,
        stop,
        handle,
        ..
    } = sim_rollout(
        &client,
        endpoint,
        &key,
        "bvnic",
        n,
        attach_delay,
        Settings {
            node_concurrency: 64,
            poll,
            ..sim_settings()
        },
        &BTreeMap::new(),
    )
    .await?;
    let api: Api<NodeNetworkConfig> = Api::all(client.clone());
    let name = unique_name("bench-vnic");
    // What the apiserver spends with no rollout (kwok's heartbeats and leases for the nodes,
    // the other controllers), over a few seconds before it starts.
    let idle = Duration::from_secs(5);
    let apiserver_idle_before = apiserver_cpu_seconds(&client).await?;
    tokio::time::sleep(idle).await;
    let apiserver_cpu_before = apiserver_cpu_seconds(&client).await?;
    let apiserver_idle_per_s = (apiserver_cpu_before - apiserver_idle_before) / idle.as_secs_f64();
    let writes_before = controller_writes(&client).await?;
    let cpu_before = process_cpu_seconds()?;
    let requests_before = endpoint.requests().len();
    let started = Instant::now();
    apply_nnc(
        &api,
        &label,
        &name,
        json!({
            "nodeSelector": {"matchLabels": {label.0.clone(): label.1.clone()}},
            "ociVnics": {"attach": [vnic("pods", &pods)]},
            "rollout": {"maxUnavailable": "10%", "failureThreshold": "5%"},
        }),
    )
    .await?;
    let timeout = Duration::from_secs(60 + 2 * n as u64);
    wait_for("every node applied", timeout, || async {
        let s = status_of(&api, &name).await?;
        Ok((s["applied"].as_u64() == Some(n as u64)).then_some(()))
    })
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    // Let the last status write land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu = process_cpu_seconds()? - cpu_before;
    let apiserver_cpu = apiserver_cpu_seconds(&client).await? - apiserver_cpu_before;
    let writes = controller_writes(&client).await? - writes_before;
    let requests = endpoint.requests();
    let calls = &requests[requests_before..];
    let mut by_op: BTreeMap<String, usize> = BTreeMap::new();
    for r in calls {
        let op = match (
            r.method.as_str(),
            r.path.split('/').filter(|s| !s.is_empty()).count(),
        ) {
            ("POST", _) => "AttachVnic",
            ("GET", 1) if r.path.starts_with("/vnicAttachments") => "ListVnicAttachments",
            ("GET", _) if r.path.starts_with("/vnicAttachments") => "GetVnicAttachment",
            ("GET", _) if r.path.starts_with("/vnics") => "GetVnic",
            ("GET", _) => "GetInstance",
            ("DELETE", _) => "DetachVnic",
            _ => "other",
        };
        *by_op.entry(op.to_string()).or_default() += 1;
    }
    let batches = (n as f64 / (n as f64 * 0.1).floor().max(1.0)).ceil();
    let timeline = batch_timeline(calls, started, (n as f64 * 0.1).floor().max(1.0) as usize);
    let figures = json!({
        "nodes": n,
        "seconds": seconds,
        "batches": batches,
        "attach_delay_s": attach_delay.as_secs_f64(),
        "poll_s": poll.as_secs_f64(),
        "lower_bound_s": batches * attach_delay.as_secs_f64(),
        "cloud_calls_per_node": calls.len() as f64 / n as f64,
        "cloud_calls_by_operation": by_op,
        "attach_calls": by_op.get("AttachVnic").copied().unwrap_or(0),
        "api_writes_per_node": writes / n as f64,
        "api_writes": writes,
        "process_cpu_s": cpu,
        "signature_ms": signature_ms,
        "signature_rsa_crate_ms": signature_rsa_crate_ms,
        "apiserver_cpu_s": apiserver_cpu,
        "apiserver_idle_cpu_per_s": apiserver_idle_per_s,
        "timeline": timeline,
    });
    if let Ok(path) = std::env::var("NODEKEEPER_BENCH_OUT") {
        std::fs::write(path, figures.to_string())?;
    }
    // The object stays (with its VNICs): the control plane is the benchmark's own.
    stop.cancel();
    handle.await?;
    Ok(())
}
