//! The controller's HTTP port made reachable through the API server's service proxy, the way a
//! cluster does it, for the `kubectl nodekeeper` tests and the demo (root only).
//!
//! The service proxy only dials addresses that belong to a Pod and refuses loopback ones, so: a
//! veth pair puts 10.254.x.y (the "Pod IP") in a network namespace created here, a listener bound
//! there forwards to the controller's 127.0.0.1 port, a kwok node with that InternalIP holds a
//! hostNetwork Pod (so kwok gives the Pod that IP; its container port `http` is the forwarder's).
//! Where Service `nodekeeper-controller` is already installed (from `deploy/`, selecting the
//! leader's Pod), that Service finds the Pod once the controller, started with
//! `--pod-name` [`CONTROLLER_POD`], labels it leader; otherwise a selector-less Service of that
//! name (port `http`) with hand-written Endpoints names the Pod. No traffic
//! leaves 127.0.0.0/8 or that namespace; dropping the [`ExposedController`] removes the namespace
//! (and with it the veth pair) and stops the forwarder.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use kube::Api;
use kube::api::PostParams;
use nix::sched::{CloneFlags, setns};
use serde_json::json;

use crate::{create_simulated_nodes, wait_for};

/// The label of the node that holds the controller's stand-in Pod: a controller whose
/// `--node-selector` is the simulated-node label can exclude it with `!` this label.
pub const SERVICE_HOST_LABEL: &str = "nodekeeper.dev/e2e-role";

/// The stand-in Pod's name: what the controller's `--pod-name` must be for the installed
/// Service (which selects the leader's Pod) to reach it.
pub const CONTROLLER_POD: &str = "nodekeeper-controller-0";

/// The Service the plugin reaches the controller through.
const SERVICE: &str = "nodekeeper-controller";

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// See the module doc. Dropping it removes the network namespace and stops the forwarder.
pub struct ExposedController {
    netns: String,
    forwarder: tokio::task::JoinHandle<()>,
    /// The simulated node that holds the stand-in Pod.
    pub host_node: String,
    /// Whether an installed Service (with a selector) leads to the Pod rather than one made here.
    pub installed_service: bool,
}

impl Drop for ExposedController {
    fn drop(&mut self) {
        self.forwarder.abort();
        let _ = ip(&["netns", "del", &self.netns]);
    }
}

/// Exposes `controller` (its HTTP API on 127.0.0.1) as Service `nodekeeper-controller:http` in
/// `namespace`. Needs root (a network namespace and a veth pair).
pub async fn expose_controller(
    client: &kube::Client,
    namespace: &str,
    controller: SocketAddr,
) -> anyhow::Result<ExposedController> {
    let (r1, r2) = (rand::random::<u8>(), rand::random::<u8>() & 0x3f);
    let host_ip = Ipv4Addr::new(10, 254, r1, r2 * 4 + 1);
    let pod_ip = Ipv4Addr::new(10, 254, r1, r2 * 4 + 2);
    let netns = format!("nkplug-{}-{r1}-{r2}", std::process::id());
    let veth = format!("nkp{r1:02x}{r2:02x}");
    ip(&["netns", "add", &netns])?;
    let mut exposed = ExposedController {
        netns: netns.clone(),
        forwarder: tokio::spawn(async {}),
        host_node: String::new(),
        installed_service: false,
    };
    ip(&["-n", &netns, "link", "set", "lo", "up"])?;
    ip(&[
        "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns,
    ])?;
    ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &veth])?;
    ip(&["link", "set", &veth, "up"])?;
    ip(&[
        "-n",
        &netns,
        "addr",
        "add",
        &format!("{pod_ip}/30"),
        "dev",
        "eth0",
    ])?;
    ip(&["-n", &netns, "link", "set", "eth0", "up"])?;

    // A socket keeps the namespace it was created in: bind it from a thread that entered the
    // namespace, then serve it from the host side.
    let ns_path = format!("/run/netns/{netns}");
    let listener = std::thread::spawn(move || -> anyhow::Result<std::net::TcpListener> {
        let target = File::open(&ns_path)?;
        setns(&target, CloneFlags::CLONE_NEWNET)?;
        let listener = std::net::TcpListener::bind((pod_ip, 0))?;
        listener.set_nonblocking(true)?;
        Ok(listener)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("listener thread panicked"))??;
    let port = listener.local_addr()?.port();
    let listener = tokio::net::TcpListener::from_std(listener)?;
    exposed.forwarder = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(controller).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });

    // The node and the hostNetwork Pod whose IP the Endpoints name.
    let labels: BTreeMap<String, String> =
        [(SERVICE_HOST_LABEL.to_owned(), "service-host".to_owned())].into();
    let host = create_simulated_nodes(client, "nk-plugin-svc", 1, &labels, &[pod_ip]).await?;
    exposed.host_node = host[0].clone();
    let pod_name = CONTROLLER_POD;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name, "labels": {"app.kubernetes.io/name": "nodekeeper-controller"}},
        "spec": {"nodeName": host[0], "hostNetwork": true,
                 "containers": [{"name": "controller", "image": "nodekeeper-controller:test",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    wait_for("the controller Pod's IP", Duration::from_secs(90), || {
        let pods = pods.clone();
        async move {
            let pod = pods.get(pod_name).await?;
            let ips = pod.status.and_then(|s| s.pod_ips).unwrap_or_default();
            Ok(ips.iter().any(|p| p.ip == pod_ip.to_string()).then_some(()))
        }
    })
    .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    if services
        .get_opt(SERVICE)
        .await
        .with_context(|| format!("read Service {namespace}/{SERVICE}"))?
        .is_some()
    {
        exposed.installed_service = true;
        return Ok(exposed);
    }
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": SERVICE},
                "spec": {"ports": [{"name": "http", "port": 8080, "targetPort": port}]},
            }))?,
        )
        .await?;
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), namespace);
    endpoints
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": SERVICE},
                "subsets": [{
                    "addresses": [{"ip": pod_ip.to_string(),
                                   "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod_name}}],
                    "ports": [{"name": "http", "port": port}],
                }],
            }))?,
        )
        .await?;
    Ok(exposed)
}
