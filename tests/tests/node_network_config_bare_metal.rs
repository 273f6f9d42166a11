//! `NodeNetworkConfig` end to end on a bare-metal node whose host is a qemu VM: this machine's
//! kernel has no 802.1Q, so the node's host side runs under Debian's kernel (the launcher
//! `crates/netconf/tests/vm/mod.rs`, shared with the agent's VLAN test and `cargo xtask vm`).
//!
//! The parts are real: the kube-apiserver (CRDs from `deploy/crds/`), a kwok Node whose
//! `spec.providerID` names a bare-metal instance of the local OCI endpoint (signatures checked,
//! attach asynchronous, `nicIndex` honoured, a `vlanTag` per VNIC), the NodeNetworkConfig
//! reconciler calling the agent over mutual-TLS gRPC through the controller's own `MtlsAgents`,
//! and in the VM the agent's real `run` (gRPC server, IMDS client, netlink apply). This test
//! binary is the guest program: started with the launcher's guest variable set, it brings the
//! NICs up and runs the agent ([`guest`]).
//!
//! The VM's NICs are virtio PCI devices; the agent sees two of them (the third goes into a
//! namespace, below) and numbers them physical NICs 0 and 1 by PCI address, the way it numbers a
//! bare-metal host's. NIC 0 carries the primary VNIC's
//! MAC and qemu's user-mode network with `restrict=on`: the host reaches the agent through a
//! `hostfwd` on 127.0.0.1, the guest reaches the endpoint's IMDS for its instance only through a
//! `guestfwd` to 127.0.0.1 (`http://10.0.2.100/imds/<instance>`); nothing leaves the machine.
//! NIC 1 shares a qemu hub with a third NIC that the guest moves into a namespace of its own:
//! OCI's virtual router, which gives every VNIC on NIC 1 (as the metadata service lists them) a
//! namespace with VLAN `vlanTag` on that wire and the subnet router's address, so the agent's
//! post-apply check (an ICMP echo to pods-b's router) is answered only through the right 802.1Q
//! tag. The guest's state is read back with iproute2's `ip -j` (copied into the initramfs) and
//! `/proc/net/vlan/config`, over a second `hostfwd` port that answers read-only queries (and
//! `fix-mtu`, below).
//!
//! The scenario: 2 VNICs, one per physical NIC. NIC 1 boots with MTU 1500, so the first apply
//! is refused in the guest before any change (the second macvlan's MTU 9000 is above its
//! parent's) and reported; once the NIC
//! is fixed the controller's retry converges: macvlan with the VNIC's MAC on NIC `nicIndex`,
//! 802.1Q VLAN `vlanTag` on it, address, default route in the VNIC's table and its `from` rule,
//! the check answered through the VLAN, `NodeNetworkReady` True, no attach doubled. Removing one
//! VNIC from the spec removes its host side in the guest and detaches it; deleting the object
//! removes the rest.
//!
//! The second test selects this node and two VM-shape nodes (network namespaces of this
//! machine, each running the agent's real server) with one object, and restarts the controller
//! mid-rollout ([`mixed`]).

mod oci_common;
#[path = "../../crates/netconf/tests/vm/mod.rs"]
mod vm;

use std::collections::BTreeMap;
use std::io::{BufReader, Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::DeleteParams;
use nodekeeper_api::crd::NodeNetworkConfig;
use nodekeeper_api::names::NODE_CONDITION_NETWORK_READY;
use nodekeeper_controller::certs::{self, Leaf};
use nodekeeper_controller::controllers::node_network_config::Settings;
use nodekeeper_controller::shared::agents::{Agents, MtlsAgents};
use nodekeeper_controller::shared::fleet::{Fleet, node_facts};
use nodekeeper_controller::shared::metrics::AgentMetrics;
use nodekeeper_e2e::oci_endpoint::{EndpointConfig, GuestVnic, OciEndpoint};
use nodekeeper_e2e::{
    ControlPlane, apply_labelled_spec, create_simulated_nodes, install_crds, node_condition,
    unique_name, wait_for,
};
use nodekeeper_oci::compute::ComputeClient;
use nodekeeper_oci::{ImdsClient, ImdsConfig, Vnic};
use oci_common::netns::{SimNode, addresses_of, default_routes, hotplug, netns_host, nk_rules};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// The tests' own names, which the guest run selects with `--exact`.
const TEST_NAME: &str = "bare_metal_node_in_a_vm_gets_vlan_vnics_and_loses_them_again";
const MIXED_TEST_NAME: &str =
    "one_config_over_vm_and_bare_metal_nodes_survives_a_controller_restart";

const COMPARTMENT: &str = "ocid1.compartment.oc1..localtest";
const AD: &str = "Uocm:PHX-AD-1";
const BM: &str = "BM.Standard.E5.192";
/// The VM shape of [`mixed`]'s namespace nodes (4 VNICs in the endpoint's limits).
const VM: &str = "VM.Standard2.4";

/// Physical NIC 1's MAC (NIC 0 carries the primary VNIC's, which the endpoint chooses).
const NIC1_MAC: &str = "02:00:17:ff:00:01";
/// The NIC on NIC 1's wire (a qemu hub) that the guest moves into a namespace of its own: the
/// virtual router's side, where a VLAN per VNIC answers as the VNIC's subnet router.
const WIRE_MAC: &str = "02:00:17:ff:00:02";
/// The agent's gRPC port and the query port inside the guest.
const GUEST_AGENT_PORT: u16 = 9443;
const GUEST_QUERY_PORT: u16 = 9444;
/// Where the guest finds its metadata service (a `guestfwd` to the endpoint on 127.0.0.1).
const GUEST_IMDS: (Ipv4Addr, u16) = (Ipv4Addr::new(10, 0, 2, 100), 80);
/// qemu user networking's guest address (its DHCP's first one; the guest sets it itself).
const GUEST_ADDRESS: &str = "10.0.2.15/24";
/// pods-b's subnet router (the endpoint's subnets have theirs at the first address).
const ROUTER_B: &str = "10.0.30.1";

/// Printed by the guest once the agent stopped cleanly; the host requires it besides exit 0.
const GUEST_OK: &str = "NODEKEEPER-BM-GUEST-OK";

/// From qemu's start until the agent answers: TCG on a busy 2-core machine, a ~75 MB program to
/// unpack (19 s when idle). Generous like every wait here: each ends once its condition holds.
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);
const TIMEOUT: Duration = Duration::from_secs(90);

/// The guest's environment: what the host tells the guest program.
mod env {
    pub const NODE: &str = "NK_BM_NODE";
    pub const IMDS: &str = "NK_BM_IMDS";
    pub const PRIMARY_MAC: &str = "NK_BM_PRIMARY_MAC";
    pub const TLS_CERT: &str = "NK_BM_TLS_CERT";
    pub const TLS_KEY: &str = "NK_BM_TLS_KEY";
    pub const CLIENT_CA: &str = "NK_BM_CLIENT_CA";
    /// The endpoint's port on the host's loopback, which the guest must not reach directly.
    pub const ENDPOINT_PORT: &str = "NK_BM_ENDPOINT_PORT";
}

#[test]
fn bare_metal_node_in_a_vm_gets_vlan_vnics_and_loses_them_again() -> anyhow::Result<()> {
    run_test(TEST_NAME, Scene::BareMetal)
}

/// One NodeNetworkConfig over 3 nodes of both shapes (see [`mixed`]).
#[test]
fn one_config_over_vm_and_bare_metal_nodes_survives_a_controller_restart() -> anyhow::Result<()> {
    run_test(MIXED_TEST_NAME, Scene::Mixed)
}

/// Which scenario the host side of a test runs once the guest is up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scene {
    /// The bare-metal node alone: [`rollout`].
    BareMetal,
    /// The bare-metal node and two VM-shape network-namespace nodes under one object: [`mixed`].
    Mixed,
}

/// The guest's program when started as one (the same for both tests), else the host's side of
/// test `name`.
fn run_test(name: &'static str, scene: Scene) -> anyhow::Result<()> {
    if std::env::var_os(vm::GUEST_ENV).is_some() {
        return guest::run();
    }
    nodekeeper_testkit::skip_unless_root!("needs root (qemu, apt-get download of the kernel)");
    if let Some(reason) = vm::missing_host_tool() {
        nodekeeper_testkit::skip!(reason);
    }
    if let Err(e) = vm::prepare_kernel(false) {
        nodekeeper_testkit::skip!(format!(
            "the VM kernel cannot be prepared ({e:#}); `cargo xtask vm` as root fetches it"
        ));
    }
    let ip = which_ip().context("iproute2's ip (apt-get install -y iproute2)")?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?
        .block_on(host(ip, name, scene))
}

/// `ip` from iproute2, copied into the guest (busybox's has no `-j`).
fn which_ip() -> Option<PathBuf> {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// The VM and the way into it.
struct Guest {
    vm: Option<vm::RunningVm>,
    query: SocketAddr,
}

impl Guest {
    /// Runs one query in the guest ([`guest`]'s `answer` lists them) and returns its output.
    fn query(&self, line: &str) -> anyhow::Result<String> {
        let mut stream = TcpStream::connect_timeout(&self.query, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        stream.write_all(format!("{line}\n").as_bytes())?;
        let mut out = String::new();
        stream.read_to_string(&mut out)?;
        match out.strip_prefix("ERROR ") {
            Some(e) => bail!("guest query {line:?}: {e}"),
            None => out
                .strip_prefix("OK\n")
                .map(str::to_string)
                .with_context(|| format!("guest query {line:?}: no answer ({out:?})")),
        }
    }

    fn ip_json(&self, args: &str) -> anyhow::Result<Vec<Value>> {
        let out = self.query(&format!("ip -j {args}"))?;
        let text = if out.trim().is_empty() { "[]" } else { &out };
        serde_json::from_str(text).with_context(|| format!("parse `ip -j {args}`: {out}"))
    }

    /// The console so far, for error messages.
    fn console_tail(&mut self) -> String {
        match self.vm.as_mut() {
            Some(vm) => vm::console_tail(vm.console(), 60),
            None => String::new(),
        }
    }
}

/// What the guest shows of one VNIC's host side (the names are the agent's, by `vlanTag`).
#[derive(Debug, PartialEq)]
struct HostSide {
    macvlan_mac: String,
    macvlan_parent: String,
    vlan_id: u64,
    vlan_parent: String,
    addresses: Vec<String>,
    /// `(table, gateway)` of default routes on the VLAN link outside the main table.
    default_routes: Vec<(String, String)>,
    /// Tables of the rules `from` the VNIC's address.
    rule_tables: Vec<String>,
    /// The VLAN's line in `/proc/net/vlan/config`.
    proc_vlan: String,
}

fn host_side(guest: &Guest, tag: u16, private_ip: Ipv4Addr) -> anyhow::Result<Option<HostSide>> {
    let links = guest.ip_json("-d link show")?;
    let find = |name: &str| links.iter().find(|l| l["ifname"] == name).cloned();
    let (Some(mv), Some(vl)) = (find(&format!("nkm{tag}")), find(&format!("nkv{tag}"))) else {
        return Ok(None);
    };
    ensure!(
        mv["linkinfo"]["info_kind"] == "macvlan",
        "nkm{tag} is no macvlan: {mv}"
    );
    ensure!(
        vl["linkinfo"]["info_kind"] == "vlan",
        "nkv{tag} is no VLAN: {vl}"
    );
    ensure!(
        vl["linkinfo"]["info_data"]["protocol"] == "802.1Q",
        "nkv{tag} is not 802.1Q: {vl}"
    );
    let vlan = format!("nkv{tag}");
    let addresses = guest
        .ip_json(&format!("addr show dev {vlan}"))?
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter(|a| a["family"] == "inet")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"]))
        .collect();
    let default_routes = guest
        .ip_json("route show table all")?
        .iter()
        .filter(|r| r["dst"] == "default" && r["dev"] == vlan.as_str())
        .map(|r| {
            (
                r["table"].as_str().unwrap_or("main").to_string(),
                r["gateway"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let rule_tables = guest
        .ip_json("rule show")?
        .iter()
        .filter(|r| r["src"] == private_ip.to_string().as_str())
        .map(|r| r["table"].as_str().unwrap_or("").to_string())
        .collect();
    let proc_vlan = guest
        .query("vlan")?
        .lines()
        .find(|l| l.split('|').next().map(str::trim) == Some(vlan.as_str()))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    Ok(Some(HostSide {
        macvlan_mac: mv["address"].as_str().unwrap_or("").to_string(),
        macvlan_parent: mv["link"].as_str().unwrap_or("").to_string(),
        vlan_id: vl["linkinfo"]["info_data"]["id"].as_u64().unwrap_or(0),
        vlan_parent: vl["link"].as_str().unwrap_or("").to_string(),
        addresses,
        default_routes,
        rule_tables,
        proc_vlan,
    }))
}

/// nodekeeper's links (`nkm*`, `nkv*`) and rules (priorities 20000–20999) in the guest.
fn nodekeeper_state(guest: &Guest) -> anyhow::Result<Vec<String>> {
    let links = guest
        .ip_json("link show")?
        .into_iter()
        .filter_map(|l| l["ifname"].as_str().map(str::to_string))
        .filter(|n| n.starts_with("nkm") || n.starts_with("nkv"));
    let rules = guest
        .ip_json("rule show")?
        .into_iter()
        .filter(|r| {
            r["priority"]
                .as_u64()
                .is_some_and(|p| (20000..21000).contains(&p))
        })
        .map(|r| r.to_string());
    Ok(links.chain(rules).collect())
}

/// Waits for the object's status to satisfy `done`; on timeout the error shows the status and
/// the node's `NodeNetworkReady`.
async fn wait_status(
    api: &Api<NodeNetworkConfig>,
    name: &str,
    client: &kube::Client,
    node: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let status = || async {
        anyhow::Ok(serde_json::to_value(
            api.get(name).await?.status.unwrap_or_default(),
        )?)
    };
    let waited = wait_for(what, TIMEOUT, || async {
        let st = status().await?;
        Ok(done(&st).then_some(st))
    })
    .await;
    match waited {
        Ok(st) => Ok(st),
        Err(e) => {
            let st = status().await?;
            let ready = node_ready(client, node).await?;
            bail!("{e:#}; status {st:#}; NodeNetworkReady {ready:?}")
        }
    }
}

/// The guest's interface with `mac`.
fn interface_with_mac(guest: &Guest, mac: &str) -> anyhow::Result<String> {
    guest
        .ip_json("link show")?
        .iter()
        .find(|l| l["address"].as_str().map(str::to_lowercase) == Some(mac.to_lowercase()))
        .and_then(|l| l["ifname"].as_str().map(str::to_string))
        .with_context(|| format!("no guest interface has MAC {mac}"))
}

async fn node_ready(
    client: &kube::Client,
    node: &str,
) -> anyhow::Result<Option<(String, String, String)>> {
    node_condition(client, node, NODE_CONDITION_NETWORK_READY).await
}

/// Checks the node's `NodeNetworkReady` status and reason; returns its message.
async fn network_ready_is(
    client: &kube::Client,
    node: &str,
    status: &str,
    reason: &str,
) -> anyhow::Result<String> {
    let ready = node_ready(client, node)
        .await?
        .context("no NodeNetworkReady")?;
    ensure!(
        (ready.0.as_str(), ready.1.as_str()) == (status, reason),
        "NodeNetworkReady {ready:?}, wanted {status} {reason}"
    );
    Ok(ready.2)
}

async fn host(ip: PathBuf, test_name: &'static str, scene: Scene) -> anyhow::Result<()> {
    let cp = ControlPlane::shared();
    let client = cp.client().await?;
    install_crds(&client).await?;
    let (endpoint, compute) = oci_common::endpoint_and_compute(EndpointConfig {
        attach_delay: Duration::from_millis(800),
        detach_delay: Duration::from_millis(300),
        ..Default::default()
    })
    .await?;
    let primary_subnet = endpoint.add_subnet("10.0.10.0/24")?;
    let subnet_a = endpoint.add_subnet("10.0.20.0/24")?;
    let subnet_b = endpoint.add_subnet("10.0.30.0/24")?;

    // The node: its agent is reached on 127.0.0.1 at the VM's hostfwd port.
    let label = (
        "nodekeeper.dev/e2e-nnc-bm".to_string(),
        unique_name("nncbm"),
    );
    let names = create_simulated_nodes(
        &client,
        "nncbm",
        1,
        &BTreeMap::from([label.clone()]),
        &[Ipv4Addr::LOCALHOST],
    )
    .await?;
    let node = names[0].clone();
    let (instance, node_obj) = oci_common::instance_for_node(
        &client,
        &endpoint,
        &node,
        BM,
        (COMPARTMENT, AD),
        &primary_subnet,
    )
    .await?;
    let primary_mac = endpoint
        .guest_vnics(&instance)
        .into_iter()
        .find(|v| v.primary)
        .context("primary vnic")?
        .mac;

    // mTLS: the agent's server certificate and the controller's client one, from one CA.
    let (ca, ca_key) = certs::generate_ca()?;
    let agent_pem = certs::issue(Leaf::Agent, &ca, &ca_key)?;
    let controller_pem = certs::issue(Leaf::Controller, &ca, &ca_key)?;

    // The guest program: this binary without its debug info (less to unpack under TCG), or as
    // it is where binutils' objcopy is missing.
    let scratch = tempfile::tempdir()?;
    let stripped = scratch.path().join("nk-bm-guest");
    let exe = std::env::current_exe()?;
    let program = match std::process::Command::new("objcopy")
        .arg("--strip-debug")
        .arg(&exe)
        .arg(&stripped)
        .status()
    {
        Ok(status) if status.success() => stripped,
        other => {
            eprintln!("objcopy --strip-debug: {other:?}; the guest gets the unstripped binary");
            exe
        }
    };
    let endpoint_port = endpoint
        .url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
        .context("endpoint port")?;
    let agent_port = nodekeeper_testkit::free_port();
    let query_port = nodekeeper_testkit::free_port();
    let imds = format!("http://{}:{}/imds/{instance}", GUEST_IMDS.0, GUEST_IMDS.1);
    let guest_program = vm::GuestProgram {
        binary: program,
        args: vec![
            test_name.into(),
            "--exact".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ],
        env: vec![
            ("RUST_BACKTRACE".into(), "0".into()),
            (env::NODE.into(), node.clone()),
            (env::IMDS.into(), imds),
            (env::PRIMARY_MAC.into(), primary_mac.clone()),
            (env::TLS_CERT.into(), agent_pem.cert.clone()),
            (env::TLS_KEY.into(), agent_pem.key.clone()),
            (env::CLIENT_CA.into(), ca.clone()),
            (env::ENDPOINT_PORT.into(), endpoint_port.to_string()),
        ],
    };
    let opts = vm::VmOptions {
        memory_mib: 1024,
        nics: vec![
            vm::Nic {
                mac: primary_mac.clone(),
                backend: vm::NicBackend::User {
                    hostfwd: vec![
                        (agent_port, GUEST_AGENT_PORT),
                        (query_port, GUEST_QUERY_PORT),
                    ],
                    guestfwd: vec![(GUEST_IMDS.0, GUEST_IMDS.1, endpoint_port)],
                },
            },
            vm::Nic {
                mac: NIC1_MAC.into(),
                backend: vm::NicBackend::Hub(1),
            },
            vm::Nic {
                mac: WIRE_MAC.into(),
                backend: vm::NicBackend::Hub(1),
            },
        ],
        extra_binaries: vec![ip],
    };
    let echo = std::env::var_os("NODEKEEPER_VM_ECHO").is_some();
    let started = Instant::now();
    let mut guest = Guest {
        vm: Some(vm::start_in_vm(&guest_program, &opts, echo)?),
        query: SocketAddr::from((Ipv4Addr::LOCALHOST, query_port)),
    };

    let s = Scenario {
        node: &node,
        node_obj: &node_obj,
        instance: &instance,
        label: &label,
        primary_subnet: &primary_subnet,
        subnets: [&subnet_a, &subnet_b],
        agent_port,
        controller_pem,
        agent_pem,
        ca,
        primary_mac: &primary_mac,
        started,
    };
    let result = scenario(&client, &endpoint, compute, &mut guest, s, scene).await;
    if let Err(e) = result {
        let tail = guest.console_tail();
        bail!("{e:#}\n--- guest console ---\n{tail}");
    }

    // The agent stops on request; the guest then reports its verdict and powers off.
    guest.query("stop")?;
    let outcome = guest
        .vm
        .take()
        .context("vm")?
        .wait(started.elapsed() + Duration::from_secs(60))?;
    let tail = vm::console_tail(&outcome.console, 60);
    ensure!(
        outcome.exit_code() == Some(0) && outcome.console.contains(GUEST_OK),
        "guest verdict {:?}; console:\n{tail}",
        outcome.verdict
    );
    eprintln!(
        "vm: whole run {:.1} s ({})",
        outcome.boot_to_verdict.as_secs_f64(),
        if outcome.kvm { "kvm" } else { "tcg" }
    );
    Ok(())
}

struct Scenario<'a> {
    node: &'a str,
    node_obj: &'a Node,
    instance: &'a str,
    label: &'a (String, String),
    primary_subnet: &'a str,
    subnets: [&'a String; 2],
    agent_port: u16,
    controller_pem: certs::Pem,
    /// The agents' server certificate and their CA (the guest's; the network-namespace nodes of
    /// [`mixed`] present the same).
    agent_pem: certs::Pem,
    ca: String,
    primary_mac: &'a str,
    started: Instant,
}

/// Waits until the guest answers; returns its physical NICs 0 and 1 (interface names).
async fn guest_up(guest: &mut Guest, s: &Scenario<'_>) -> anyhow::Result<[String; 2]> {
    let boot_deadline = s.started + BOOT_TIMEOUT;
    let nics = loop {
        if let Some(vm) = guest.vm.as_mut()
            && !vm.running()
        {
            bail!("the VM stopped before its agent answered");
        }
        if let (Ok(nic0), Ok(nic1)) = (
            interface_with_mac(guest, s.primary_mac),
            interface_with_mac(guest, NIC1_MAC),
        ) {
            break [nic0, nic1];
        }
        ensure!(
            Instant::now() < boot_deadline,
            "the guest did not answer within {BOOT_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!(
        "vm: guest answers after {:.1} s; physical NICs {nics:?}",
        s.started.elapsed().as_secs_f64()
    );
    Ok(nics)
}

/// The controller's own agents service: mutual TLS to each node's InternalIP at the agent
/// port (the VM's hostfwd on 127.0.0.1; a listener of a namespace node's agent), new each time
/// (a restarted controller starts with nothing).
fn mtls_agents(nodes: &[&Node], controller_pem: &certs::Pem) -> anyhow::Result<Arc<dyn Agents>> {
    let fleet = Arc::new(Fleet::default());
    for node in nodes {
        ensure!(
            fleet.observe(node_facts(node), Instant::now()),
            "node {:?} has no InternalIP",
            node.metadata.name
        );
    }
    let mtls = MtlsAgents::new(fleet, 4 << 20, AgentMetrics::default());
    mtls.set_tls(controller_pem);
    Ok(Arc::new(mtls))
}

/// The reconciler's settings in these tests.
fn settings() -> Settings {
    Settings {
        node_concurrency: 4,
        object_concurrency: 2,
        poll: Duration::from_millis(250),
        resync: Duration::from_secs(2),
        attach_timeout: Duration::from_secs(30),
        // An apply under TCG emulation takes its time.
        apply_timeout: Duration::from_secs(60),
        // A failed apply is retried after 2 s.
        retry_backoff: Duration::from_secs(2),
        retry_backoff_max: Duration::from_secs(8),
    }
}

async fn scenario(
    client: &kube::Client,
    endpoint: &Arc<OciEndpoint>,
    compute: ComputeClient,
    guest: &mut Guest,
    s: Scenario<'_>,
    scene: Scene,
) -> anyhow::Result<()> {
    let nics = guest_up(guest, &s).await?;
    if scene == Scene::Mixed {
        return mixed(client, endpoint, compute, guest, &s, &nics).await;
    }
    let agents = mtls_agents(&[s.node_obj], &s.controller_pem)?;
    let (stop, handle) = oci_common::start_nnc_controller(
        client,
        agents,
        s.agent_port,
        compute,
        COMPARTMENT,
        settings(),
        s.label,
    );
    let result = rollout(client, endpoint, guest, &s, &nics).await;
    stop.cancel();
    handle.await?;
    result
}

/// VNIC `display` of `instance` as attached at the endpoint, and as the instance's metadata
/// service lists it (`vlanTag`, `nicIndex`).
async fn vnic_seen(
    endpoint: &OciEndpoint,
    instance: &str,
    display: &str,
) -> anyhow::Result<(GuestVnic, Vnic)> {
    let v = endpoint
        .guest_vnics(instance)
        .into_iter()
        .find(|v| v.display_name.as_deref() == Some(display) && v.state == "ATTACHED")
        .with_context(|| format!("{display} attached"))?;
    let m = ImdsClient::new(ImdsConfig::new(endpoint.imds_url(instance)))?
        .vnics()
        .await?
        .into_iter()
        .find(|m| m.mac_addr == v.mac)
        .with_context(|| format!("{display} ({}) in IMDS", v.mac))?;
    Ok((v, m))
}

/// Checks VNIC `display`'s host side in the guest, read back with `ip -j`: on physical NIC
/// `nic` (as OCI placed it), a macvlan with the VNIC's MAC, 802.1Q VLAN `vlanTag` on it with the
/// VNIC's address, a default route to the subnet router in a table of its own and the `from`
/// rule to that table. Returns the table.
async fn guest_has_vnic(
    guest: &Guest,
    endpoint: &OciEndpoint,
    instance: &str,
    nics: &[String; 2],
    display: &str,
    nic: u32,
) -> anyhow::Result<String> {
    let (v, m) = vnic_seen(endpoint, instance, display).await?;
    assert_eq!(m.nic_index, Some(nic), "{display}: {m:?}");
    let tag = m.vlan_tag;
    let side = host_side(guest, tag, v.private_ip)?
        .with_context(|| format!("{display}: no nkm{tag}/nkv{tag} in the guest"))?;
    eprintln!("{display} (vlanTag {tag}, nicIndex {nic}) in the guest: {side:?}");
    let router = v.router.to_string();
    let table = side
        .default_routes
        .first()
        .map(|(t, _)| t.clone())
        .unwrap_or_default();
    assert_eq!(
        side,
        HostSide {
            macvlan_mac: v.mac.clone(),
            macvlan_parent: nics[nic as usize].clone(),
            vlan_id: u64::from(tag),
            vlan_parent: format!("nkm{tag}"),
            addresses: vec![format!("{}/{}", v.private_ip, v.prefix)],
            default_routes: vec![(table.clone(), router)],
            rule_tables: vec![table.clone()],
            proc_vlan: format!("nkv{tag} | {tag} | nkm{tag}"),
        },
        "{display}"
    );
    ensure!(
        table != "main" && !table.is_empty(),
        "{display}: default route in {table:?}"
    );
    Ok(table)
}

/// AttachVnic calls the endpoint answered with success.
fn attach_calls(endpoint: &OciEndpoint) -> usize {
    endpoint
        .requests()
        .iter()
        .filter(|r| {
            r.method == http::Method::POST && r.path == "/vnicAttachments" && r.status == 200
        })
        .count()
}

async fn rollout(
    client: &kube::Client,
    endpoint: &Arc<OciEndpoint>,
    guest: &Guest,
    s: &Scenario<'_>,
    nics: &[String; 2],
) -> anyhow::Result<()> {
    let api: Api<NodeNetworkConfig> = Api::all(client.clone());
    let name = unique_name("bmvnics");
    let labels = BTreeMap::from([s.label.clone()]);
    let selector = json!({"matchLabels": {s.label.0.clone(): s.label.1.clone()}});
    let vnic = |display: &str, subnet: &str, nic: u32| json!({"displayName": display, "subnetId": subnet, "nicIndex": nic});
    // The post-apply check pings pods-b's subnet router, which answers only through VLAN
    // `vlanTag` on NIC 1's wire.
    let spec = |vnics: Vec<Value>, check: &[&str]| {
        json!({
            "nodeSelector": selector,
            "ociVnics": {"attach": vnics},
            "rollout": {"maxUnavailable": 1, "failureThreshold": 1},
            "checkTargets": check,
            "checkTimeoutMs": 5000,
        })
    };
    // One VNIC on each physical NIC. NIC 1 came up with MTU 1500, below the layout's 9000: the
    // plan refuses pods-b's macvlan (a macvlan may not be larger than its parent, which the
    // kernel would refuse half-way through the apply), nothing is made, and the node is
    // reported failing.
    apply_labelled_spec(
        &api,
        &name,
        &labels,
        spec(
            vec![
                vnic("pods-a", s.subnets[0], 0),
                vnic("pods-b", s.subnets[1], 1),
            ],
            &[ROUTER_B],
        ),
    )
    .await?;
    let status = wait_status(&api, &name, client, s.node, "the node failing", |st| {
        st["failing"] == 1
    })
    .await?;
    let failing = &status["failingNodes"][0];
    assert_eq!(failing["node"], s.node, "{status:#}");
    // Refused before any step: nothing to roll back.
    assert_eq!(failing["rolledBack"], false, "{status:#}");
    let error = failing["error"].as_str().unwrap_or("");
    assert!(
        error.contains("macvlan") && error.contains(&nics[1]) && error.contains("mtu 9000"),
        "{status:#}"
    );
    let message = network_ready_is(client, s.node, "False", "NetworkApplyFailed").await?;
    assert!(message.contains(error), "{message}");
    let ours = nodekeeper_state(guest)?;
    ensure!(ours.is_empty(), "left after the refusal: {ours:?}");

    // The host's NIC is fixed: the controller's retry (after its backoff) converges.
    guest.query("fix-mtu")?;
    let status = wait_status(&api, &name, client, s.node, "the node applied", |st| {
        st["applied"] == 1
    })
    .await?;
    assert_eq!(status["matched"], 1, "{status:#}");
    assert_eq!(status["attached"], 1, "{status:#}");
    assert_eq!(status["failing"], 0, "{status:#}");
    network_ready_is(client, s.node, "True", "NetworkConverged").await?;

    let tables = [
        guest_has_vnic(guest, endpoint, s.instance, nics, "pods-a", 0).await?,
        guest_has_vnic(guest, endpoint, s.instance, nics, "pods-b", 1).await?,
    ];
    ensure!(
        tables[0] != tables[1],
        "one table for both VNICs: {tables:?}"
    );
    let by_name = |display: &'static str| vnic_seen(endpoint, s.instance, display);
    // The check's echo requests reached the router through pods-b's VLAN (nothing else on the
    // wire can reach it).
    let tag = by_name("pods-b").await?.1.vlan_tag;
    let router = guest.ip_json(&format!("-s -n r{tag} link show v{tag}"))?;
    let received = router[0]["stats64"]["rx"]["packets"].as_u64().unwrap_or(0);
    ensure!(
        received > 0,
        "the router on VLAN {tag} got nothing: {router:?}"
    );

    // Remove pods-b: its host side goes in the guest, then it is detached.
    let (b, b_meta) = by_name("pods-b").await?;
    let (a, a_meta) = by_name("pods-a").await?;
    let a_before = host_side(guest, a_meta.vlan_tag, a.private_ip)?;
    apply_labelled_spec(
        &api,
        &name,
        &labels,
        spec(vec![vnic("pods-a", s.subnets[0], 0)], &[]),
    )
    .await?;
    wait_for("pods-b detached", TIMEOUT, || async {
        let now = endpoint
            .guest_vnics(s.instance)
            .into_iter()
            .find(|v| v.attachment_id == b.attachment_id);
        Ok(now.filter(|v| v.state == "DETACHED").map(|_| ()))
    })
    .await?;
    ensure!(
        host_side(guest, b_meta.vlan_tag, b.private_ip)?.is_none(),
        "pods-b's macvlan/VLAN are left in the guest"
    );
    let rules = guest.ip_json("rule show")?;
    ensure!(
        !rules
            .iter()
            .any(|r| r["src"] == b.private_ip.to_string().as_str()),
        "pods-b's rule is left: {rules:?}"
    );
    ensure!(
        guest
            .query("vlan")?
            .lines()
            .all(|l| !l.contains(&format!("nkv{}", b_meta.vlan_tag))),
        "pods-b's VLAN is left in /proc/net/vlan/config"
    );
    assert_eq!(
        host_side(guest, a_meta.vlan_tag, a.private_ip)?,
        a_before,
        "pods-a is untouched"
    );
    wait_status(
        &api,
        &name,
        client,
        s.node,
        "the node applied with one VNIC",
        |st| st["applied"] == 1 && st["observedGeneration"] == 2,
    )
    .await?;
    network_ready_is(client, s.node, "True", "NetworkConverged").await?;

    // Two attaches in all: the failed apply and its retry attached nothing again.
    assert_eq!(attach_calls(endpoint), 2, "AttachVnic calls");

    // Deleting the object removes what it made: pods-a's host side, then its attachment.
    api.delete(&name, &DeleteParams::default()).await?;
    wait_for("the object gone after its cleanup", TIMEOUT, || async {
        Ok(api.get_opt(&name).await?.is_none().then_some(()))
    })
    .await?;
    let live: Vec<_> = endpoint
        .guest_vnics(s.instance)
        .into_iter()
        .filter(|v| !matches!(v.state, "DETACHED" | "DETACHING"))
        .collect();
    ensure!(live.len() == 1 && live[0].primary, "{live:?}");
    let left = nodekeeper_state(guest)?;
    ensure!(left.is_empty(), "left in the guest: {left:?}");
    ensure!(
        host_side(guest, a_meta.vlan_tag, a.private_ip)?.is_none(),
        "pods-a's host side is left"
    );
    // The primary NIC kept its address throughout (the agent never touches it).
    let nic0 = guest.ip_json(&format!("addr show dev {}", nics[0]))?;
    ensure!(
        nic0.iter()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .any(
                |a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"])
                    == GUEST_ADDRESS
            ),
        "{nic0:?}"
    );
    Ok(())
}

/// One NodeNetworkConfig whose selector picks both shapes: the bare-metal node in the VM and two
/// VM-shape nodes (network namespaces of this machine, each with the agent's real server over
/// mutual TLS and its own metadata answer), rolled out one node at a time with the controller
/// restarted after the first node converged and before the last one started; every VNIC is
/// attached exactly once, all three nodes converge, and their host side is read back with
/// `ip -j`.
///
/// The spec is one object valid for both shapes. `ociVnics.attach` applies to every selected
/// node and `nicIndex` is refused on VM shapes (a per-node error naming the field), so the
/// VNICs leave it unset; OCI then attaches to physical NIC 0 (AttachVnic's `nicIndex` "defaults
/// to 0", `shared/oci/compute-api.md`), and the guest must show both VNICs' macvlan and VLAN on
/// NIC 0. There is no post-apply check target: NIC 0 is qemu's user network, with no subnet
/// router on its wire (the single-shape test pings one through a VLAN on NIC 1).
async fn mixed(
    client: &kube::Client,
    endpoint: &Arc<OciEndpoint>,
    compute: ComputeClient,
    guest: &Guest,
    s: &Scenario<'_>,
    nics: &[String; 2],
) -> anyhow::Result<()> {
    let labels = BTreeMap::from([s.label.clone()]);
    let ips: Vec<Ipv4Addr> = (0..2u8)
        .map(|i| Ipv4Addr::new(127, 92, rand::random::<u8>(), 10 + i))
        .collect();
    let names = create_simulated_nodes(client, "nncmx", 2, &labels, &ips).await?;
    let stop_agents = CancellationToken::new();
    let _stop_agents_on_drop = stop_agents.clone().drop_guard();
    let scratch = tempfile::tempdir()?;
    let mut vm_nodes = Vec::new();
    let mut node_objs = vec![s.node_obj.clone()];
    let mut agents = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let (instance, node_obj) = oci_common::instance_for_node(
            client,
            endpoint,
            name,
            VM,
            (COMPARTMENT, AD),
            s.primary_subnet,
        )
        .await?;
        let (ns, imds) = netns_host(endpoint, &format!("nkmx{i}"), &instance).await?;
        let dir = scratch.path().join(name);
        agent_files(&dir, &s.agent_pem.cert, &s.agent_pem.key, &s.ca)?;
        let config = agent_config("127.0.0.1:9443", name, &dir, &imds);
        // The listener is bound here, outside the namespace, at the Node's InternalIP and the
        // agent port (where the controller calls); everything else the agent opens (netlink,
        // its metadata service) is inside, where it runs.
        let listener = std::net::TcpListener::bind((ips[i], s.agent_port))
            .with_context(|| format!("bind {}:{}", ips[i], s.agent_port))?;
        listener.set_nonblocking(true)?;
        let stop = stop_agents.child_token();
        agents.push(ns.entry().spawn(move || async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            anyhow::Ok(nodekeeper_agent::serve(config, listener, stop).await?)
        }));
        vm_nodes.push(Arc::new(SimNode::new(name, &instance, ns, false)));
        node_objs.push(node_obj);
    }
    tokio::spawn(hotplug(
        Arc::clone(endpoint),
        vm_nodes.clone(),
        stop_agents.clone(),
    ));
    let mut all = vec![(s.node.to_string(), s.instance.to_string())];
    all.extend(
        vm_nodes
            .iter()
            .map(|n| (n.name.clone(), n.instance.clone())),
    );
    let m = Mixed {
        client,
        endpoint,
        guest,
        s,
        nics,
        vm_nodes,
        node_objs,
        all,
    };
    let result = mixed_rollout(&m, compute).await;
    stop_agents.cancel();
    for agent in agents {
        let stopped = tokio::task::spawn_blocking(move || agent.join()).await?;
        match stopped {
            Ok(Ok(())) => {}
            Ok(Err(e)) if result.is_ok() => bail!("a namespace node's agent: {e:#}"),
            Ok(Err(_)) => {}
            Err(_) => bail!("a namespace node's agent panicked"),
        }
    }
    result
}

/// `(display name, state)` of every secondary VNIC attachment `instance` ever had.
fn secondary_attachments(
    endpoint: &OciEndpoint,
    instance: &str,
) -> Vec<(Option<String>, &'static str)> {
    endpoint
        .guest_vnics(instance)
        .into_iter()
        .filter(|v| !v.primary)
        .map(|v| (v.display_name, v.state))
        .collect()
}

/// What [`mixed`]'s steps share.
struct Mixed<'a> {
    client: &'a kube::Client,
    endpoint: &'a Arc<OciEndpoint>,
    guest: &'a Guest,
    s: &'a Scenario<'a>,
    nics: &'a [String; 2],
    vm_nodes: Vec<Arc<SimNode>>,
    node_objs: Vec<Node>,
    /// `(node, instance)` of all three, the bare-metal one first.
    all: Vec<(String, String)>,
}

async fn mixed_rollout(m: &Mixed<'_>, compute: ComputeClient) -> anyhow::Result<()> {
    let &Mixed {
        client,
        endpoint,
        s,
        ref all,
        ..
    } = m;
    let api: Api<NodeNetworkConfig> = Api::all(client.clone());
    let name = unique_name("mxvnics");
    let labels = BTreeMap::from([s.label.clone()]);
    let node_refs: Vec<&Node> = m.node_objs.iter().collect();
    let start = || {
        anyhow::Ok(oci_common::start_nnc_controller(
            client,
            mtls_agents(&node_refs, &s.controller_pem)?,
            s.agent_port,
            compute.clone(),
            COMPARTMENT,
            settings(),
            s.label,
        ))
    };
    let (stop, handle) = start()?;
    let vnic = |display: &str, subnet: &str| json!({"displayName": display, "subnetId": subnet});
    apply_labelled_spec(
        &api,
        &name,
        &labels,
        json!({
            "nodeSelector": {"matchLabels": {s.label.0.clone(): s.label.1.clone()}},
            "ociVnics": {"attach": [vnic("pods-a", s.subnets[0]), vnic("pods-b", s.subnets[1])]},
            "rollout": {"maxUnavailable": 1},
        }),
    )
    .await?;

    // Restart once the first node is converged: with one node at a time, the second is then
    // attaching or applying and the third has not started.
    let first = wait_for("the first node converged", TIMEOUT, || async {
        for (node, _) in all.iter() {
            if node_ready(client, node)
                .await?
                .is_some_and(|r| r.0 == "True")
            {
                return Ok(Some(node.clone()));
            }
        }
        Ok(None)
    })
    .await?;
    stop.cancel();
    handle.await?;
    let at_restart: Vec<_> = all
        .iter()
        .map(|(node, instance)| (node.clone(), secondary_attachments(endpoint, instance)))
        .collect();
    eprintln!(
        "controller restarted once {first} converged, after {} AttachVnic calls; attachments \
         then: {at_restart:?}",
        attach_calls(endpoint)
    );
    ensure!(
        at_restart.iter().any(|(_, v)| v.is_empty())
            && at_restart.iter().any(|(_, v)| v.len() == 2),
        "the restart did not land mid-rollout (some node attached, some not): {at_restart:?}"
    );
    let (stop, handle) = start()?;
    let result = mixed_converged(m, &name).await;
    stop.cancel();
    handle.await?;
    result
}

/// After the restart: all three converge with every VNIC attached once, their host side as
/// `ip -j` shows it; then deleting the object removes it all.
async fn mixed_converged(m: &Mixed<'_>, name: &str) -> anyhow::Result<()> {
    let &Mixed {
        client,
        endpoint,
        guest,
        s,
        nics,
        ref vm_nodes,
        ref all,
        ..
    } = m;
    let api: Api<NodeNetworkConfig> = Api::all(client.clone());
    let status = wait_status(
        &api,
        name,
        client,
        s.node,
        "all three nodes applied",
        |st| st["applied"] == 3,
    )
    .await?;
    for field in ["matched", "attached"] {
        assert_eq!(status[field], 3, "{field}: {status:#}");
    }
    assert_eq!(status["failing"], 0, "{status:#}");
    for (node, _) in all {
        network_ready_is(client, node, "True", "NetworkConverged").await?;
    }

    // Never doubled, the restart included: 2 VNICs × 3 nodes, each display name once per node.
    assert_eq!(attach_calls(endpoint), 6, "AttachVnic calls");
    for (node, instance) in all {
        let mut vnics = secondary_attachments(endpoint, instance);
        vnics.sort();
        assert_eq!(
            vnics,
            [
                (Some("pods-a".to_string()), "ATTACHED"),
                (Some("pods-b".to_string()), "ATTACHED")
            ],
            "{node}"
        );
    }

    // The VM-shape nodes: the hot-plugged NIC with the VNIC's MAC has its address, a default
    // route to the subnet router in a table of its own, and the `from` rule to that table.
    for n in vm_nodes {
        let routes = default_routes(&n.ns)?;
        let rules = nk_rules(&n.ns)?;
        let mut tables = std::collections::BTreeSet::new();
        for display in ["pods-a", "pods-b"] {
            let (v, _) = vnic_seen(endpoint, &n.instance, display).await?;
            assert_eq!(
                addresses_of(&n.ns, &v.mac)?,
                [format!("{}/{}", v.private_ip, v.prefix)],
                "{} {display}",
                n.name
            );
            let router = v.router.to_string();
            let table = routes
                .iter()
                .find(|(_, gateway)| *gateway == router)
                .map(|(t, _)| *t)
                .with_context(|| {
                    format!("{} {display}: no route via {router}: {routes:?}", n.name)
                })?;
            ensure!(
                rules.iter().any(
                    |(_, from, t)| *from == v.private_ip.to_string() && *t == table.to_string()
                ),
                "{} {display}: no rule from {} to table {table}: {rules:?}",
                n.name,
                v.private_ip
            );
            tables.insert(table);
        }
        ensure!(tables.len() == 2, "{}: tables {tables:?}", n.name);
    }
    // The bare-metal node: both VNICs on physical NIC 0 (OCI's default), each its own VLAN.
    let tables = [
        guest_has_vnic(guest, endpoint, s.instance, nics, "pods-a", 0).await?,
        guest_has_vnic(guest, endpoint, s.instance, nics, "pods-b", 0).await?,
    ];
    ensure!(
        tables[0] != tables[1],
        "one table for both VNICs: {tables:?}"
    );

    // Deleting the object removes what it made on all three, then detaches.
    api.delete(name, &DeleteParams::default()).await?;
    wait_for("the object gone after its cleanup", TIMEOUT, || async {
        Ok(api.get_opt(name).await?.is_none().then_some(()))
    })
    .await?;
    for (node, instance) in all {
        let live: Vec<_> = endpoint
            .guest_vnics(instance)
            .into_iter()
            .filter(|v| !matches!(v.state, "DETACHED" | "DETACHING"))
            .collect();
        ensure!(live.len() == 1 && live[0].primary, "{node}: {live:?}");
    }
    for n in vm_nodes {
        let (routes, rules) = (default_routes(&n.ns)?, nk_rules(&n.ns)?);
        ensure!(
            routes.is_empty() && rules.is_empty(),
            "{}: left {routes:?} {rules:?}",
            n.name
        );
    }
    let left = nodekeeper_state(guest)?;
    ensure!(left.is_empty(), "left in the guest: {left:?}");
    Ok(())
}

/// An agent's TLS files (server certificate and key, the controllers' CA) in `dir`.
fn agent_files(dir: &Path, cert: &str, key: &str, ca: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (file, pem) in [("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)] {
        std::fs::write(dir.join(file), pem)?;
    }
    Ok(())
}

/// The agent's flags in these tests: its server, name, TLS files and state in `dir`
/// ([`agent_files`]) and its metadata service; no monitors or GPU probes, and no drift
/// re-convergence (what a test reads back is the applies' doing).
fn agent_config(listen: &str, node: &str, dir: &Path, imds: &str) -> nodekeeper_agent::Config {
    use clap::Parser as _;
    let file = |f: &str| dir.join(f).display().to_string();
    nodekeeper_agent::Config::parse_from([
        "nodekeeper-agent".to_string(),
        format!("--listen={listen}"),
        format!("--node-name={node}"),
        format!("--tls-cert={}", file("tls.crt")),
        format!("--tls-key={}", file("tls.key")),
        format!("--client-ca={}", file("ca.crt")),
        format!("--state-dir={}", file("state")),
        format!("--imds-endpoint={imds}"),
        "--nvidia-smi=/nonexistent/nvidia-smi".into(),
        "--nvml-library=none".into(),
        "--health-checks=false".into(),
        "--kernel-monitor=false".into(),
        "--journal=false".into(),
        "--drift-interval=60m".into(),
        "--log-format=plain".into(),
    ])
}

/// The half that runs inside the VM (as its `/init`'s program, root, alone on the machine).
mod guest {
    use super::*;

    use std::io::BufRead as _;
    use std::net::TcpListener;
    use std::process::Command;

    const IP: &str = "/guest/ip";

    fn required(name: &str) -> anyhow::Result<String> {
        std::env::var(name).with_context(|| format!("{name} is not set in the guest"))
    }

    fn ip(args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(IP).args(args).output().context("run ip")?;
        ensure!(
            out.status.success(),
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The PCI NICs (those with a `device` link), by MAC.
    fn pci_nics() -> anyhow::Result<BTreeMap<String, String>> {
        let mut nics = BTreeMap::new();
        for entry in std::fs::read_dir("/sys/class/net")? {
            let path = entry?.path();
            if path.join("device").exists() {
                let mac = std::fs::read_to_string(path.join("address"))?;
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                nics.insert(mac.trim().to_lowercase(), name.into_owned());
            }
        }
        Ok(nics)
    }

    pub fn run() -> anyhow::Result<()> {
        // The agent's log on the console (what its own `main` sets up).
        {
            use clap::Parser as _;
            nodekeeper_controller::runtime::logging::init(&nodekeeper_controller::Cli::parse_from(
                ["nk-bm-guest", "--log-format=plain"],
            ));
        }
        // IPv6 duplicate address detection would change address flags between two reads.
        for knob in ["all", "default"] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{knob}/accept_dad"), "0")?;
        }
        // The NICs come up as a bare-metal host's do at boot, NIC 0 with OCI's MTU 9000 and
        // NIC 1 misconfigured with 1500 (a macvlan cannot have a larger MTU than its NIC: the
        // first apply fails until `fix-mtu`); NIC 0 gets user networking's address (no default
        // route: nothing but the forwarded addresses is reachable anyway).
        let wire = pci_nics()?
            .remove(WIRE_MAC)
            .with_context(|| format!("no NIC with MAC {WIRE_MAC}"))?;
        ip(&["netns", "add", "wire"])?;
        ip(&["link", "set", &wire, "netns", "wire"])?;
        ip(&["-n", "wire", "link", "set", &wire, "mtu", "9000", "up"])?;
        let nics = pci_nics()?;
        let primary = required(env::PRIMARY_MAC)?.to_lowercase();
        let nic0 = nics
            .get(&primary)
            .with_context(|| format!("no NIC with the primary MAC {primary}: {nics:?}"))?;
        for (mac, name) in &nics {
            let mtu = if *mac == primary { "9000" } else { "1500" };
            ip(&["link", "set", name, "mtu", mtu, "up"])?;
        }
        ip(&["addr", "add", GUEST_ADDRESS, "dev", nic0])?;
        eprintln!("guest: NICs {nics:?} up, {nic0} has {GUEST_ADDRESS}");
        // `restrict=on`: the host's loopback is reachable only through the forwards, not at
        // the gateway (where unrestricted user networking would offer it, and the world).
        let port: u16 = required(env::ENDPOINT_PORT)?.parse()?;
        let direct = SocketAddr::from((Ipv4Addr::new(10, 0, 2, 2), port));
        ensure!(
            TcpStream::connect_timeout(&direct, Duration::from_secs(2)).is_err(),
            "the guest reached {direct} past the forwards"
        );

        let dir = Path::new("/tmp/nodekeeper");
        agent_files(
            dir,
            &required(env::TLS_CERT)?,
            &required(env::TLS_KEY)?,
            &required(env::CLIENT_CA)?,
        )?;
        let shutdown = CancellationToken::new();
        let imds = required(env::IMDS)?;
        let stop = shutdown.clone();
        std::thread::spawn(move || {
            if let Err(e) = virtual_router(&imds, &wire, &stop) {
                eprintln!("guest: virtual router: {e:#}");
            }
        });
        // Queries are answered once the agent listens, so the host's first answer means the
        // agent can be called.
        let stop = shutdown.clone();
        std::thread::spawn(move || {
            let agent = SocketAddr::from((Ipv4Addr::LOCALHOST, GUEST_AGENT_PORT));
            while !stop.is_cancelled() && TcpStream::connect(agent).is_err() {
                std::thread::sleep(Duration::from_millis(50));
            }
            let listener = match TcpListener::bind((Ipv4Addr::UNSPECIFIED, GUEST_QUERY_PORT)) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("guest: bind the query port: {e}");
                    stop.cancel();
                    return;
                }
            };
            for stream in listener.incoming().flatten() {
                answer(stream, &stop);
            }
        });

        let config = agent_config(
            &format!("0.0.0.0:{GUEST_AGENT_PORT}"),
            &required(env::NODE)?,
            dir,
            &required(env::IMDS)?,
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime
            .block_on(nodekeeper_agent::run(config, shutdown))
            .context("the agent")?;
        eprintln!("{GUEST_OK}");
        Ok(())
    }

    /// OCI's virtual router on NIC 1's wire: for every VNIC on physical NIC 1 the metadata
    /// service shows, a namespace `r<vlanTag>` holding VLAN `v<vlanTag>` of the wire NIC with the
    /// subnet router's address, so the router answers only frames tagged with the VNIC's VLAN.
    fn virtual_router(imds: &str, wire: &str, stop: &CancellationToken) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = ImdsClient::new(ImdsConfig::new(imds))?;
        let mut done = std::collections::BTreeSet::new();
        while !stop.is_cancelled() {
            let vnics = runtime.block_on(client.vnics()).unwrap_or_default();
            for v in vnics.iter().filter(|v| v.nic_index == Some(1)) {
                let Some(v4) = &v.ipv4 else { continue };
                if !done.insert(v.vlan_tag) {
                    continue;
                }
                let tag = v.vlan_tag.to_string();
                let (ns, vlan) = (format!("r{tag}"), format!("v{tag}"));
                let router = format!("{}/{}", v4.virtual_router_ip, v4.subnet.prefix_len());
                ip(&["netns", "add", &ns])?;
                ip(&[
                    "-n", "wire", "link", "add", "link", wire, "name", &vlan, "type", "vlan", "id",
                    &tag,
                ])?;
                ip(&["-n", "wire", "link", "set", &vlan, "netns", &ns])?;
                ip(&["-n", &ns, "addr", "add", &router, "dev", &vlan])?;
                ip(&["-n", &ns, "link", "set", &vlan, "up"])?;
                eprintln!("guest: virtual router {router} on VLAN {tag}");
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        Ok(())
    }

    /// One query: `stop`, `fix-mtu` (every NIC to MTU 9000), `vlan` (`/proc/net/vlan/config`)
    /// or `ip -j …` with a `show` verb (read-only); the answer is `OK\n<output>` or
    /// `ERROR <why>`.
    fn answer(stream: std::net::TcpStream, stop: &CancellationToken) {
        let mut line = String::new();
        let mut reader = BufReader::new(&stream);
        if reader.read_line(&mut line).is_err() {
            return;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let result = match words.as_slice() {
            ["stop"] => {
                stop.cancel();
                Ok(String::new())
            }
            ["vlan"] => std::fs::read_to_string("/proc/net/vlan/config").map_err(|e| e.into()),
            ["fix-mtu"] => pci_nics().and_then(|nics| {
                for name in nics.values() {
                    ip(&["link", "set", name, "mtu", "9000"])?;
                }
                Ok(String::new())
            }),
            ["ip", "-j", rest @ ..] if rest.contains(&"show") => {
                let mut args = vec!["-j"];
                args.extend_from_slice(rest);
                ip(&args)
            }
            _ => Err(anyhow::anyhow!("unknown query {line:?}")),
        };
        let reply = match result {
            Ok(out) => format!("OK\n{out}"),
            Err(e) => format!("ERROR {e:#}"),
        };
        let _ = (&stream).write_all(reply.as_bytes());
    }
}
