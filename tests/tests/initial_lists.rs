//! How the controller's Node and Pod watches read their initial state (`shared::lists`): against
//! an API server with WatchList (the shared control plane, Kubernetes 1.36) it streams, and a
//! streamed and a paged Node watch see the same Nodes; against one without (a control plane of
//! this test's own, started with `--feature-gates=WatchList=false`, as a 1.33 server is by
//! default) the probe is refused and the controller lists in pages and still reads its node.
//!
//! Run: `cargo xtask test -- -p nodekeeper-e2e --test initial_lists`.

mod controller_common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use controller_common::*;
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::watcher;
use nodekeeper_controller::shared::lists::{self, InitialLists, Mode, Refusal};
use nodekeeper_e2e::{
    ControlPlane, Lifetime, Options, create_simulated_nodes, install_crds, test_namespace,
    unique_name,
};

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// The names a Node watch in `config` delivers before it says its initial state is complete.
async fn initial_names(
    client: &kube::Client,
    config: watcher::Config,
) -> anyhow::Result<BTreeSet<String>> {
    let stream = watcher(Api::<Node>::all(client.clone()), config);
    futures::pin_mut!(stream);
    let mut names = BTreeSet::new();
    let read = async {
        while let Some(event) = stream.try_next().await? {
            match event {
                watcher::Event::Init => names.clear(),
                watcher::Event::InitApply(node) => {
                    names.insert(node.metadata.name.unwrap_or_default());
                }
                watcher::Event::InitDone => return Ok::<_, anyhow::Error>(()),
                watcher::Event::Apply(_) | watcher::Event::Delete(_) => {}
            }
        }
        anyhow::bail!("the watch ended before its initial state was complete")
    };
    tokio::time::timeout(Duration::from_secs(60), read).await??;
    Ok(names)
}

/// One simulated node with a real agent, read by a controller started with the default
/// `--initial-lists=auto` on `cp`; returns the controller's log once the node is reachable.
async fn controller_reads_a_node(cp: &ControlPlane, prefix: &str) -> anyhow::Result<String> {
    let client = cp.client().await?;
    let ns = test_namespace(&client, prefix).await?;
    let group = unique_name(prefix);
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let ips = loopback_ips(1);
    let nodes = create_simulated_nodes(&client, prefix, 1, &labels, &ips).await?;
    let port = free_port();
    put_tuning(
        &client,
        &ns,
        &[("sweepInterval", "10s"), ("callTimeout", "2s")].into(),
    )
    .await?;
    let logs = tempfile::tempdir()?;
    let log = logs.path().join("controller.log");
    let c = spawn_logged(cp, &ns, "lists-a", &selector, port, &log)?;
    let tls = agent_tls(&client, &ns).await?;
    let _agent = start_agent(&nodes[0], SocketAddr::new(ips[0].into(), port), &tls).await?;
    wait_condition(
        &client,
        &nodes[0],
        "NodekeeperReachable",
        "True",
        Some("AgentReachable"),
        Duration::from_secs(90),
    )
    .await?;
    let text = std::fs::read_to_string(&log)?;
    drop(c);
    Ok(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_watchlist_the_watches_stream_and_see_what_pages_see() -> anyhow::Result<()> {
    let cp = ControlPlane::shared();
    let client = cp.client().await?;
    lists::probe(&client)
        .await
        .map_err(|refusal| anyhow::anyhow!("Kubernetes 1.36 streams lists: {refusal}"))?;
    assert_eq!(
        lists::resolve(&client, InitialLists::Auto).await.0,
        Mode::Stream
    );

    let group = unique_name("lists");
    let labels: BTreeMap<String, String> =
        [("nodekeeper.dev/e2e-group".to_string(), group.clone())].into();
    let selector = format!("nodekeeper.dev/e2e-group={group}");
    let created: BTreeSet<String> =
        create_simulated_nodes(&client, "nk-lists", 5, &labels, &loopback_ips(5))
            .await?
            .into_iter()
            .collect();
    let streamed = initial_names(&client, lists::nodes_in(Mode::Stream).labels(&selector)).await?;
    let paged = initial_names(
        &client,
        lists::nodes_in(Mode::Pages).labels(&selector).page_size(2),
    )
    .await?;
    assert_eq!(streamed, created, "a streamed list delivers every Node");
    assert_eq!(paged, created, "a paged list (3 pages) delivers every Node");

    let log = controller_reads_a_node(cp, "nk-lists-c").await?;
    assert!(
        log.contains(r#"mode="stream""#),
        "the controller streams its lists on a 1.36 API server: {log}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_watchlist_the_controller_lists_in_pages_and_reads_its_node() -> anyhow::Result<()>
{
    let mut options = Options::new(
        format!("test-{}-nowatchlist", std::process::id()),
        Lifetime::WithThisProcess,
    );
    options.apiserver_feature_gates = vec!["WatchList=false".into()];
    let cp = ControlPlane::start(options)?;
    let client = cp.client().await?;
    install_crds(&client).await?;
    match lists::probe(&client).await {
        Err(Refusal::Refused {
            code: 422, message, ..
        }) => {
            assert!(message.contains("sendInitialEvents"), "{message}")
        }
        other => anyhow::bail!("a server without WatchList refuses the probe with 422: {other:?}"),
    }
    assert_eq!(
        lists::resolve(&client, InitialLists::Auto).await.0,
        Mode::Pages
    );
    // Asked to stream anyway, a watch does not get its initial state (it retries).
    let forced = initial_names(&client, lists::nodes_in(Mode::Stream)).await;
    assert!(forced.is_err(), "streaming must fail here: {forced:?}");

    let log = controller_reads_a_node(&cp, "nk-nowl").await?;
    assert!(
        log.contains(r#"mode="pages""#) && log.contains("list in pages"),
        "the controller says it pages, and why: {log}"
    );
    Ok(())
}
