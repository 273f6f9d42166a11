//! Simulated nodes: Node objects labelled for kwok, each with its own loopback InternalIP, and
//! the wait for them to become Ready.

use std::collections::{BTreeMap, HashSet};
use std::net::Ipv4Addr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

use super::Error;

/// The label that tells kwok (`--manage-nodes-with-label-selector`) to simulate a node; nodes
/// without it are left alone.
pub const SIMULATED_LABEL: &str = "nodekeeper.dev/simulated";

/// The Node object for one simulated node: linux/amd64 labels, the simulation label, the caller's
/// labels, `ip` as its InternalIP (kept by kwok's initialize stage), and a /24 pod range in
/// 10.0.0.0/8 numbered after the address (see [`pod_range`]).
pub fn simulated_node(
    name: &str,
    ip: Ipv4Addr,
    labels: &BTreeMap<String, String>,
) -> serde_json::Value {
    let mut all = BTreeMap::from([
        ("kubernetes.io/hostname".to_owned(), name.to_owned()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
        (SIMULATED_LABEL.to_owned(), "true".to_owned()),
    ]);
    all.extend(labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name, "labels": all },
        "spec": { "podCIDR": pod_range(ip), "podCIDRs": [pod_range(ip)] },
        "status": {
            "addresses": [
                { "type": "InternalIP", "address": ip.to_string() },
                { "type": "Hostname", "address": name },
            ],
        },
    })
}

/// The pod range of the simulated node at `ip`: what kube-controller-manager's range allocator
/// would give (a /24 each, handed out in order), numbered by the address's last two octets as
/// `indexed_loopback` hands them out (127.x.y.1–254), so that a fleet's ranges are contiguous.
pub fn pod_range(ip: Ipv4Addr) -> String {
    let [_, _, y, z] = ip.octets();
    let index = u32::from(y) * 254 + u32::from(z).saturating_sub(1);
    format!("{}/24", Ipv4Addr::from(0x0a00_0000 + (index << 8)))
}

/// Creates `names.len()` simulated nodes (node `i` gets `ips[i]`). Existing nodes of the same
/// name are an error, so a test never adopts another test's node by accident.
pub async fn create(
    client: &kube::Client,
    names: &[String],
    ips: &[Ipv4Addr],
    labels: &BTreeMap<String, String>,
) -> Result<(), Error> {
    use futures::{StreamExt as _, TryStreamExt as _};
    let api: Api<Node> = Api::all(client.clone());
    // 32 creates in flight: thousands of nodes (the fleet benchmarks) in seconds, without
    // pushing the apiserver past its in-flight limits.
    futures::stream::iter(names.iter().zip(ips))
        .map(|(name, ip)| {
            let api = api.clone();
            async move {
                let node: Node = serde_json::from_value(simulated_node(name, *ip, labels))
                    .map_err(|e| Error::Io {
                        context: format!("build node {name}"),
                        source: std::io::Error::other(e),
                    })?;
                api.create(&PostParams::default(), &node).await?;
                Ok::<(), Error>(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Whether a Node has condition Ready=True.
pub fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether the scheduler may place pods on a Node: Ready, not cordoned, and without the
/// `node.kubernetes.io/not-ready` or `unreachable` taint. The taint that admission puts on a new
/// node is lifted by kube-controller-manager only after kwok has made the node Ready, so for a
/// moment a Ready node still takes no pods.
pub fn is_schedulable(node: &Node) -> bool {
    const LIFECYCLE_TAINTS: [&str; 2] = [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ];
    let spec = node.spec.as_ref();
    let cordoned = spec.and_then(|s| s.unschedulable).unwrap_or(false);
    let tainted = spec.and_then(|s| s.taints.as_ref()).is_some_and(|ts| {
        ts.iter()
            .any(|t| LIFECYCLE_TAINTS.contains(&t.key.as_str()))
    });
    is_ready(node) && !cordoned && !tainted
}

/// Waits until every named node is Ready; the error names the nodes that are not.
///
/// One paged list, then a watch of the changes: a list of every node per round is the heaviest
/// load on the API server while kwok is making the nodes Ready (at 65,000 nodes a round decodes
/// hundreds of megabytes) and so slows the very thing it waits for.
pub async fn wait_ready(
    client: &kube::Client,
    names: &[String],
    timeout: Duration,
) -> Result<(), Error> {
    wait_until(
        client,
        names,
        timeout,
        is_ready,
        "Ready condition, set by kwok",
    )
    .await
}

/// Waits until every named node [`is_schedulable`]: what a caller that creates pods next waits
/// for (a test that expects the scheduler to spread pods over all its nodes).
pub async fn wait_schedulable(
    client: &kube::Client,
    names: &[String],
    timeout: Duration,
) -> Result<(), Error> {
    wait_until(
        client,
        names,
        timeout,
        is_schedulable,
        "Ready and without the not-ready taint, which kube-controller-manager lifts",
    )
    .await
}

async fn wait_until(
    client: &kube::Client,
    names: &[String],
    timeout: Duration,
    done: fn(&Node) -> bool,
    condition: &str,
) -> Result<(), Error> {
    use futures::StreamExt as _;
    use kube::runtime::WatchStreamExt as _;
    use kube::runtime::watcher::{self, Event};
    let api: Api<Node> = Api::all(client.clone());
    let wanted: HashSet<&str> = names.iter().map(String::as_str).collect();
    let mut ready: HashSet<String> = HashSet::new();
    let config = watcher::Config::default()
        .labels(&format!("{SIMULATED_LABEL}=true"))
        .page_size(500);
    let events = watcher::watcher(api, config).default_backoff();
    futures::pin_mut!(events);
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = None;
    // A long wait (tens of thousands of Nodes) says how far it got once a minute.
    let mut report = tokio::time::Instant::now() + Duration::from_secs(60);
    while ready.len() < wanted.len() {
        if tokio::time::Instant::now() >= report {
            eprintln!("[nodes] {} of {} {condition}", ready.len(), wanted.len());
            report += Duration::from_secs(60);
        }
        let event = match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(event)) => event,
            Ok(None) | Err(_) => break,
        };
        let mut seen = |node: &Node| {
            let Some(name) = node.metadata.name.as_deref() else {
                return;
            };
            if !wanted.contains(name) {
                return;
            }
            if done(node) {
                ready.insert(name.to_owned());
            } else {
                ready.remove(name);
            }
        };
        match event {
            Ok(Event::Apply(node) | Event::InitApply(node)) => seen(&node),
            Ok(Event::Delete(node)) => {
                if let Some(name) = node.metadata.name.as_deref() {
                    ready.remove(name);
                }
            }
            // A relist: what was Ready is learnt again from it.
            Ok(Event::Init) => ready.clear(),
            Ok(Event::InitDone) => {}
            Err(e) => last_error = Some(e.to_string()),
        }
    }
    if ready.len() == wanted.len() {
        return Ok(());
    }
    let not_ready: Vec<&str> = names
        .iter()
        .filter(|n| !ready.contains(n.as_str()))
        .map(String::as_str)
        .collect();
    Err(Error::WaitReady {
        what: format!(
            "{} simulated nodes, among them {} ({condition}){}",
            not_ready.len(),
            not_ready[..not_ready.len().min(10)].join(", "),
            last_error
                .map(|e| format!("; the last watch error: {e}"))
                .unwrap_or_default()
        ),
        secs: timeout.as_secs(),
        logs: super::clusters_root(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_carries_simulation_label_caller_labels_and_ip() {
        let labels = BTreeMap::from([("pool".to_owned(), "a".to_owned())]);
        let node = simulated_node("n1", Ipv4Addr::new(127, 1, 0, 7), &labels);
        assert_eq!(node["metadata"]["labels"][SIMULATED_LABEL], "true");
        assert_eq!(node["metadata"]["labels"]["pool"], "a");
        assert_eq!(node["status"]["addresses"][0]["type"], "InternalIP");
        assert_eq!(node["status"]["addresses"][0]["address"], "127.1.0.7");
        let parsed: Node = serde_json::from_value(node).unwrap();
        assert!(!is_ready(&parsed));
        assert!(!is_schedulable(&parsed));
    }

    #[test]
    fn a_ready_node_is_schedulable_only_once_the_not_ready_taint_is_lifted() {
        let mut node = simulated_node("n1", Ipv4Addr::new(127, 1, 0, 8), &BTreeMap::new());
        node["status"]["conditions"] = json!([{ "type": "Ready", "status": "True" }]);
        node["spec"]["taints"] =
            json!([{ "key": "node.kubernetes.io/not-ready", "effect": "NoSchedule" }]);
        let tainted: Node = serde_json::from_value(node.clone()).unwrap();
        assert!(is_ready(&tainted));
        assert!(!is_schedulable(&tainted));
        node["spec"]["taints"] = json!([{ "key": "example.com/other", "effect": "NoSchedule" }]);
        let lifted: Node = serde_json::from_value(node.clone()).unwrap();
        assert!(is_schedulable(&lifted));
        node["spec"]["unschedulable"] = json!(true);
        let cordoned: Node = serde_json::from_value(node).unwrap();
        assert!(!is_schedulable(&cordoned));
    }
}
