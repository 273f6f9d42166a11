//! Each component's command line and how its readiness is checked: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kwok, in that order.

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::path::Path;
use std::time::Duration;

use super::supervisor::Starting;
use super::{Binaries, Error, Options, Ports, binaries, client_from_kubeconfig, nodes, pki};

pub(super) struct Kubeconfigs<'a> {
    pub(super) admin: &'a Path,
    pub(super) controller_manager: &'a Path,
    pub(super) scheduler: &'a Path,
    pub(super) kwok: &'a Path,
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn start_components(
    options: &Options,
    dir: &Path,
    bin: &Binaries,
    pki: &pki::Pki,
    ports: Ports,
    starting: &mut Starting,
    progress: &mut dyn FnMut(&str),
    kubeconfigs: Kubeconfigs<'_>,
) -> Result<(), Error> {
    let etcd_client = format!("http://127.0.0.1:{}", ports.etcd_client);
    let etcd_peer = format!("http://127.0.0.1:{}", ports.etcd_peer);
    progress(&format!("starting etcd on {etcd_client}"));
    starting.spawn(
        "etcd",
        bin.path("etcd"),
        vec![
            "--name=nodekeeper".into(),
            format!("--data-dir={}", s(&dir.join("etcd"))),
            format!("--listen-client-urls={etcd_client}"),
            format!("--advertise-client-urls={etcd_client}"),
            format!("--listen-peer-urls={etcd_peer}"),
            format!("--initial-advertise-peer-urls={etcd_peer}"),
            format!("--initial-cluster=nodekeeper={etcd_peer}"),
            // Throwaway data on a shared disk: durability is not worth an fsync per write here.
            "--unsafe-no-fsync=true".into(),
            // etcd's suggested maximum instead of its 2 GiB default: the fleet benches' largest
            // runs (65,000 Nodes, each written several times between compactions) outgrow it.
            "--quota-backend-bytes=8589934592".into(),
            "--log-level=warn".into(),
        ],
        &[],
    )?;
    starting
        .wait("etcd", Duration::from_secs(60), || async {
            etcd_healthy(ports.etcd_client)
        })
        .await?;

    progress(&format!(
        "starting kube-apiserver on https://127.0.0.1:{}",
        ports.apiserver
    ));
    let mut args = vec![
        format!("--etcd-servers={etcd_client}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={}", ports.apiserver),
        // With a loopback advertise address the endpoint reconciler refuses to publish the
        // `kubernetes` Service endpoints and keeps retrying; nothing here needs them.
        "--endpoint-reconciler-type=none".into(),
        "--authorization-mode=Node,RBAC".into(),
        format!("--client-ca-file={}", s(&pki.ca_cert())),
        format!("--tls-cert-file={}", s(&pki.serving_cert())),
        format!("--tls-private-key-file={}", s(&pki.serving_key())),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        format!("--service-account-key-file={}", s(&pki.sa_pub())),
        format!("--service-account-signing-key-file={}", s(&pki.sa_key())),
        "--service-cluster-ip-range=10.96.0.0/16".into(),
        // The agent DaemonSet runs privileged with host networking.
        "--allow-privileged=true".into(),
        format!("--cert-dir={}", s(&dir.join("apiserver-certs"))),
    ];
    if !options.apiserver_feature_gates.is_empty() {
        args.push(format!(
            "--feature-gates={}",
            options.apiserver_feature_gates.join(",")
        ));
    }
    if let Some(n) = options.max_requests_inflight {
        args.push(format!("--max-requests-inflight={n}"));
    }
    if let Some(n) = options.max_mutating_requests_inflight {
        args.push(format!("--max-mutating-requests-inflight={n}"));
    }
    if options.audit {
        args.push(format!(
            "--audit-policy-file={}",
            s(&binaries::controlplane_dir()
                .join("config")
                .join("audit-policy.yaml"))
        ));
        args.push(format!("--audit-log-path={}", s(&dir.join("audit.log"))));
        args.push("--audit-log-format=json".into());
        args.push("--audit-log-maxbackup=1".into());
        // Unset (0), the log rotates at 100 MB, which a 10,000-node run passes within minutes;
        // benchmarks count lines from an offset and need one file.
        args.push("--audit-log-maxsize=100000".into());
    }
    starting.spawn("kube-apiserver", bin.path("kube-apiserver"), args, &[])?;
    let client = client_from_kubeconfig(kubeconfigs.admin).await?;
    starting
        .wait("kube-apiserver /readyz", Duration::from_secs(180), || {
            get_ok(&client, "/readyz")
        })
        .await?;

    progress("starting kube-controller-manager, kube-scheduler and kwok");
    let node_lease = options.node_lease_seconds.unwrap_or(40);
    starting.spawn(
        "kube-controller-manager",
        bin.path("kube-controller-manager"),
        vec![
            format!("--kubeconfig={}", s(kubeconfigs.controller_manager)),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", ports.controller_manager),
            format!("--tls-cert-file={}", s(&pki.serving_cert())),
            format!("--tls-private-key-file={}", s(&pki.serving_key())),
            format!("--service-account-private-key-file={}", s(&pki.sa_key())),
            format!("--root-ca-file={}", s(&pki.ca_cert())),
            format!("--cluster-signing-cert-file={}", s(&pki.ca_cert())),
            format!("--cluster-signing-key-file={}", s(&pki.ca_key())),
            "--use-service-account-credentials=true".into(),
            format!("--cluster-name={}", options.name),
            "--leader-elect=false".into(),
            // The TTL controller writes an annotation that only kubelets read (how long they
            // cache Secrets and ConfigMaps), and kwok's nodes have none. At 20 requests a
            // second it annotates each new Node, and again as the Node count crosses its
            // steps: 65,000 Nodes kept it patching for the whole of an hour's benchmark
            // (53,559 patches, 2026-11-28), Node writes that no real cluster of that size makes
            // once its nodes have joined.
            "--controllers=*,-ttl-controller".into(),
        ]
        .into_iter()
        // A Node kwok has not reported yet gets the same grace as one it has (never under the
        // default minute). Left at 1 minute, with the fleet rig's higher client rate, the node
        // lifecycle controller made 6,400 status updates and 3,472 taint patches of 65,000 new
        // Nodes in ten minutes (by all appearance marking Unknown those kwok had not reached
        // yet) while kwok made 750 a minute Ready, against about 3,500 a minute in earlier runs
        // (2026-11-28).
        .chain(options.node_lease_seconds.into_iter().flat_map(|l| {
            [
                format!("--node-monitor-grace-period={}s", l + 10),
                format!("--node-startup-grace-period={}s", (l + 10).max(60)),
            ]
        }))
        .chain(options.controller_manager_qps.into_iter().flat_map(|qps| {
            [
                format!("--kube-api-qps={qps}"),
                format!("--kube-api-burst={}", qps.saturating_mul(2)),
            ]
        }))
        .collect(),
        &[],
    )?;
    starting.spawn(
        "kube-scheduler",
        bin.path("kube-scheduler"),
        vec![
            format!("--kubeconfig={}", s(kubeconfigs.scheduler)),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", ports.scheduler),
            format!("--tls-cert-file={}", s(&pki.serving_cert())),
            format!("--tls-private-key-file={}", s(&pki.serving_key())),
            "--leader-elect=false".into(),
        ],
        &[],
    )?;
    let kwok_home = dir.join("kwok-home");
    starting.spawn(
        "kwok",
        bin.path("kwok"),
        vec![
            format!("--kubeconfig={}", s(kubeconfigs.kwok)),
            format!(
                "--config={}",
                s(&binaries::controlplane_dir()
                    .join("config")
                    .join("kwok-stages.yaml"))
            ),
            format!(
                "--manage-nodes-with-label-selector={}=true",
                nodes::SIMULATED_LABEL
            ),
            // kwok renews each node's Lease every quarter of this; node status itself is
            // rewritten only every 5-6 minutes by the heartbeat stage.
            format!("--node-lease-duration-seconds={node_lease}"),
            "--cidr=10.244.0.1/16".into(),
        ],
        // kwok also reads ~/.kwok/kwok.yaml when it exists; a private HOME keeps it out.
        &[("HOME", &kwok_home)],
    )?;

    let sa_client = client.clone();
    starting
        .wait(
            "the `default` ServiceAccount (created by kube-controller-manager)",
            Duration::from_secs(120),
            || {
                let client = sa_client.clone();
                async move {
                    let api: kube::Api<k8s_openapi::api::core::v1::ServiceAccount> =
                        kube::Api::namespaced(client, "default");
                    matches!(api.get_opt("default").await, Ok(Some(_)))
                }
            },
        )
        .await?;
    let mut scheduler_config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(kubeconfigs.admin).map_err(|source| {
            Error::ReadKubeconfig {
                path: kubeconfigs.admin.to_owned(),
                source,
            }
        })?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|source| Error::ReadKubeconfig {
        path: kubeconfigs.admin.to_owned(),
        source,
    })?;
    scheduler_config.cluster_url = format!("https://127.0.0.1:{}", ports.scheduler)
        .parse()
        .map_err(|e| Error::Io {
            context: "scheduler url".into(),
            source: std::io::Error::other(e),
        })?;
    let scheduler = kube::Client::try_from(scheduler_config)?;
    starting
        .wait("kube-scheduler /healthz", Duration::from_secs(60), || {
            get_ok(&scheduler, "/healthz")
        })
        .await?;
    starting.check_alive()?;
    Ok(())
}

fn etcd_healthy(port: u16) -> bool {
    let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    let Ok(mut stream) = TcpStream::connect_timeout(&addr.into(), Duration::from_secs(1)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.contains("\"health\":\"true\"")
}

async fn get_ok(client: &kube::Client, path: &str) -> bool {
    let Ok(request) = http::Request::get(path).body(Vec::new()) else {
        return false;
    };
    matches!(client.request_text(request).await, Ok(body) if body.trim() == "ok")
}
