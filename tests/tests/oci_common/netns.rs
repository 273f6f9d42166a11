//! VM-shape nodes as network namespaces, for the NodeNetworkConfig tests: the namespace with the
//! primary VNIC's interface and a way to the node's metadata service, the hot-plug of attached
//! VNICs, and the `ip -j` readings the tests compare.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use nodekeeper_e2e::oci_endpoint::OciEndpoint;
use nodekeeper_testkit::{Netns, NetnsEntry};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// One simulated VM-shape node: its namespace and instance.
pub struct SimNode {
    pub name: String,
    pub instance: String,
    pub ns: Arc<Netns>,
    /// Hot-plugged VNIC interfaces: attachment id → link name.
    pub plugged: Mutex<HashMap<String, String>>,
    /// Its VNICs' peers get no router address: a post-apply check to the router fails here.
    pub broken: bool,
}

impl SimNode {
    pub fn new(name: &str, instance: &str, ns: Arc<Netns>, broken: bool) -> Self {
        SimNode {
            name: name.into(),
            instance: instance.into(),
            ns,
            plugged: Mutex::default(),
            broken,
        }
    }
}

/// A namespace for `instance`'s host: `ens3` with the primary VNIC's MAC and address (never
/// touched by the agent), and a loopback port forwarded to the endpoint. Returns the namespace
/// and the instance's metadata URL as seen from inside.
pub async fn netns_host(
    endpoint: &OciEndpoint,
    prefix: &str,
    instance: &str,
) -> anyhow::Result<(Arc<Netns>, String)> {
    let ns = Arc::new(Netns::with_loopback(prefix)?);
    let primary = endpoint
        .guest_vnics(instance)
        .into_iter()
        .find(|v| v.primary)
        .context("primary vnic")?;
    ns.ip(&[
        "link",
        "add",
        "ens3",
        "address",
        &primary.mac,
        "type",
        "veth",
        "peer",
        "name",
        "ens3p",
    ])?;
    ns.address_up(
        "ens3",
        &format!("{}/{}", primary.private_ip, primary.prefix),
    )?;
    let upstream: SocketAddr = endpoint.url().trim_start_matches("http://").parse()?;
    let port = loopback_proxy(&ns.entry(), upstream).await?;
    Ok((ns, format!("http://127.0.0.1:{port}/imds/{instance}")))
}

/// Forwards connections made to a loopback port inside `entry`'s namespace to `upstream` on the
/// host's loopback (sockets keep the namespace they were created in): the node's way to its
/// metadata service. Returns the port inside.
pub async fn loopback_proxy(entry: &NetnsEntry, upstream: SocketAddr) -> anyhow::Result<u16> {
    let listener = entry
        .spawn_blocking(|| std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .join()
        .map_err(|_| anyhow::anyhow!("bind thread panicked"))??;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    let listener = tokio::net::TcpListener::from_std(listener)?;
    tokio::spawn(async move {
        while let Ok((mut inside, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outside) = tokio::net::TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
                }
            });
        }
    });
    Ok(port)
}

/// Makes ATTACHED VNICs appear as interfaces in their node's namespace and DETACHED ones vanish,
/// the way OCI hot-plugs a NIC: a veth with the VNIC's MAC whose peer carries the subnet's router
/// address (none on a broken node).
pub async fn hotplug(
    endpoint: Arc<OciEndpoint>,
    nodes: Vec<Arc<SimNode>>,
    stop: CancellationToken,
) {
    let mut n = 0;
    while !stop.is_cancelled() {
        for node in &nodes {
            for v in endpoint.guest_vnics(&node.instance) {
                if v.primary {
                    continue;
                }
                let mut plugged = node.plugged.lock().unwrap();
                let present = plugged.get(&v.attachment_id).cloned();
                match (v.state, present) {
                    ("ATTACHED", None) => {
                        n += 1;
                        let link = format!("ens{}", 4 + n);
                        let peer = format!("{link}p");
                        let ok = node
                            .ns
                            .ip(&[
                                "link", "add", &link, "address", &v.mac, "type", "veth", "peer",
                                "name", &peer,
                            ])
                            .and_then(|_| node.ns.ip(&["link", "set", &peer, "up", "mtu", "9000"]));
                        if ok.is_ok() && !node.broken {
                            let _ = node.ns.ip(&[
                                "addr",
                                "add",
                                &format!("{}/{}", v.router, v.prefix),
                                "dev",
                                &peer,
                            ]);
                        }
                        plugged.insert(v.attachment_id.clone(), link);
                    }
                    ("DETACHED", Some(link)) if !link.is_empty() => {
                        let _ = node.ns.ip(&["link", "del", &link]);
                        plugged.insert(v.attachment_id.clone(), String::new());
                    }
                    _ => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `ip -j <args>` in the namespace, parsed.
pub fn ip_json(ns: &Netns, args: &[&str]) -> anyhow::Result<Vec<Value>> {
    let mut all = vec!["-j"];
    all.extend_from_slice(args);
    let out = ns.ip(&all)?;
    Ok(serde_json::from_str(if out.trim().is_empty() {
        "[]"
    } else {
        &out
    })?)
}

/// Addresses of the link with `mac`.
pub fn addresses_of(ns: &Netns, mac: &str) -> anyhow::Result<Vec<String>> {
    let links = ip_json(ns, &["addr", "show"])?;
    Ok(links
        .iter()
        .filter(|l| l["address"].as_str() == Some(mac))
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter(|a| a["family"] == "inet")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"]))
        .collect())
}

/// `(table, gateway)` of default routes outside the main table.
pub fn default_routes(ns: &Netns) -> anyhow::Result<Vec<(u64, String)>> {
    Ok(ip_json(ns, &["route", "show", "table", "all"])?
        .iter()
        .filter(|r| r["dst"] == "default")
        .filter_map(|r| {
            Some((
                r["table"].as_str()?.parse().ok()?,
                r["gateway"].as_str()?.to_string(),
            ))
        })
        .collect())
}

/// `(priority, from, table)` of rules in nodekeeper's range.
pub fn nk_rules(ns: &Netns) -> anyhow::Result<Vec<(u64, String, String)>> {
    Ok(ip_json(ns, &["rule", "show"])?
        .iter()
        .filter(|r| {
            r["priority"]
                .as_u64()
                .is_some_and(|p| (20000..21000).contains(&p))
        })
        .map(|r| {
            (
                r["priority"].as_u64().unwrap_or(0),
                r["src"].as_str().unwrap_or("").to_string(),
                r["table"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect())
}
