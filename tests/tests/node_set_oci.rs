//! `NodeSet` with the oci provider, end to end: the real `nodekeeper-controller` process, given
//! `--oci-endpoint` and an API key, launches and terminates instances at the local OCI endpoint
//! (signatures checked; PROVISIONING → RUNNING, TERMINATING → TERMINATED after delays), and the
//! test plays each instance's kubelet: once the endpoint reports an instance RUNNING, the Node
//! recorded for it (`spec.providerID` = `oci://<its OCID>`) is handed to kwok, which makes it
//! Ready — as a kubelet registering under that name takes the object over. A Node never becomes
//! Ready before its instance runs.
//!
//! Shown: scale 0 → 3 → 1 with pods and a PodDisruptionBudget (the removed nodes drained first,
//! their instances terminated, nothing lost, no extra launch); an unknown shape and OCIDs that
//! name nothing get a condition naming the field, before any launch; "Out of host capacity"
//! gets a condition naming the shape and a bounded number of LaunchInstance calls (counted at the
//! endpoint), and the set recovers when capacity returns. A machine whose kubelet never
//! registers is replaced once kube-controller-manager has marked its Node
//! `Ready=Unknown, NodeStatusNeverUpdated` and the join timeout has passed. The orphan sweep
//! terminates only this cluster's machines without any Node (in any availability domain of the
//! compartment, and of sets deleted since): not another cluster's instance of
//! a set of the same name, not one without the cluster tag, not one whose Node was taken out of
//! the set; and deleting a machine terminates an instance only if its tags name that machine,
//! and deletes the Node only while its providerID names the instance.
//!
//! Each test's controller reconciles only the NodeSets labelled for it
//! (`NODEKEEPER_NODESET_SELECTOR`), so sets left by other tests on a shared API server are not
//! touched. Run: `cargo xtask test -- -p nodekeeper-e2e --test node_set_oci`.

mod controller_common;
mod oci_common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use base64::Engine as _;
use controller_common::*;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use nodekeeper_api::crd::{NodeClass, NodeMaintenance, NodeSet};
use nodekeeper_api::names::LABEL_NODE_SET;
use nodekeeper_controller::controllers::node_set::oci::{TAG_CLUSTER, TAG_NODE};
use nodekeeper_controller::controllers::node_set::{self, Deletion, Machine};
use nodekeeper_e2e::oci_endpoint::{EndpointConfig, OciEndpoint};
use nodekeeper_e2e::{
    ControlPlane, apply_spec, install_crds, test_namespace, unique_name, wait_for,
};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_secs(180);
const POOL: &str = "nodekeeper.dev/e2e-pool";
const SHAPE: &str = "VM.Standard.E5.Flex";
const COMPARTMENT: &str = "ocid1.compartment.oc1..nodesete2e";
const AD: &str = "Uocm:PHX-AD-1";
const TENANCY: &str = "ocid1.tenancy.oc1..nodesete2e";
const USER: &str = "ocid1.user.oc1..nodesete2e";
/// The label that names the sets of one test's controller.
const OWNER: &str = "nodekeeper.dev/e2e-controller";
/// The label kwok manages nodes by.
const SIMULATED: &str = "nodekeeper.dev/simulated";

#[test]
#[ignore = "helper: re-executed by the tests in this file as a controller process; not a test by itself"]
fn run_as_controller() {
    run_as_controller_if_asked();
}

/// One test at a time (each has its own endpoint and controller; kept apart for clear logs).
static SERIAL: Mutex<()> = Mutex::const_new(());

/// The endpoint, its subnet and image, the controller acting on this test's sets, and the
/// kubelet stand-in.
struct Rig {
    client: kube::Client,
    ns: String,
    endpoint: Arc<OciEndpoint>,
    subnet: String,
    image: String,
    owner: String,
    /// The instances whose kubelet stays silent (see [`Silence`]).
    silence: Arc<std::sync::Mutex<Silence>>,
    _credentials: tempfile::TempDir,
    _controller: ControllerProcess,
    stop: CancellationToken,
}

/// Kubelets that never register: the first `left` instances the kubelet stand-in sees RUNNING
/// are skipped for good, and recorded in `skipped`.
#[derive(Debug, Default)]
struct Silence {
    left: usize,
    skipped: Vec<String>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Rig {
    async fn new(prefix: &str) -> anyhow::Result<Self> {
        Self::with(prefix, &[], 0).await
    }

    /// A rig whose controller also gets `env`, and whose first `silent` instances never join.
    async fn with(prefix: &str, env: &[(&str, &str)], silent: usize) -> anyhow::Result<Self> {
        let client = ControlPlane::shared().client().await?;
        install_crds(&client).await?;
        let ns = test_namespace(&client, prefix).await?;
        put_tuning(&client, &ns, &BTreeMap::new()).await?;
        let endpoint = Arc::new(
            OciEndpoint::start(EndpointConfig {
                launch_delay: Duration::from_secs(2),
                terminate_delay: Duration::from_secs(1),
                ..Default::default()
            })
            .await?,
        );
        // An API key Secret as the controller mounts it, and the endpoint trusting that key.
        let credentials = oci_common::api_key_for(&endpoint, TENANCY, USER)?;
        let subnet = endpoint.add_subnet("10.0.0.0/16")?;
        let image = endpoint.add_image();
        let owner = unique_name("oci");
        let url = endpoint.url();
        let dir = credentials.path().display().to_string();
        let selector = format!("{OWNER}={owner}");
        let mut vars = vec![
            ("NODEKEEPER_OCI_ENDPOINT", url.as_str()),
            ("NODEKEEPER_OCI_AUTH", "api-key"),
            ("NODEKEEPER_OCI_CREDENTIALS_DIR", dir.as_str()),
            ("NODEKEEPER_NODESET_SELECTOR", selector.as_str()),
        ];
        vars.extend_from_slice(env);
        let controller = ControllerProcess::start(
            &ns,
            &unique_name("nset-oci"),
            "nodekeeper.dev/no-such-label=none",
            free_port(),
            &vars,
        )?;
        let addr = controller.http;
        wait_for("the controller to serve", TIMEOUT, || async move {
            let (status, _) = http_get(addr, "/api/v1/summary").await?;
            Ok((status == 200).then_some(()))
        })
        .await?;
        let stop = CancellationToken::new();
        let silence = Arc::new(std::sync::Mutex::new(Silence {
            left: silent,
            skipped: Vec::new(),
        }));
        tokio::spawn(kubelets(
            client.clone(),
            Arc::clone(&endpoint),
            Arc::clone(&silence),
            stop.clone(),
        ));
        Ok(Self {
            client,
            ns,
            endpoint,
            subnet,
            image,
            owner,
            silence,
            _credentials: credentials,
            _controller: controller,
            stop,
        })
    }

    /// An oci NodeClass; `change` edits its `oci` template.
    async fn class(
        &self,
        name: &str,
        pool: &str,
        change: impl FnOnce(&mut Value),
    ) -> anyhow::Result<()> {
        let mut oci = json!({
            "compartmentId": COMPARTMENT,
            "availabilityDomain": AD,
            "shape": SHAPE,
            "shapeConfig": { "ocpus": 2, "memoryInGBs": 16 },
            "imageId": self.image,
            "subnetId": self.subnet,
            "metadata": {
                "user_data": base64::engine::general_purpose::STANDARD.encode("#cloud-config\nruncmd: [true]\n"),
                "ssh_authorized_keys": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2e2e e2e",
            },
            "displayNamePrefix": "nk-",
        });
        change(&mut oci);
        apply_spec(
            &Api::<NodeClass>::all(self.client.clone()),
            name,
            json!({ "provider": "oci", "oci": oci, "labels": { POOL: pool } }),
        )
        .await
    }

    /// A NodeSet labelled for this test's controller.
    async fn set(&self, name: &str, class: &str, replicas: u32) -> anyhow::Result<()> {
        let body = json!({
            "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NodeSet",
            "metadata": { "name": name, "labels": { OWNER: self.owner } },
            "spec": { "nodeClassName": class, "replicas": replicas, "scaleDown": { "drainTimeout": "2m" } },
        });
        Api::<NodeSet>::all(self.client.clone())
            .patch(
                name,
                &PatchParams::apply("nodekeeper-e2e").force(),
                &Patch::Apply(&body),
            )
            .await
            .with_context(|| format!("apply nodeset {name}"))?;
        Ok(())
    }

    /// The instances whose kubelet stayed silent so far.
    fn silenced(&self) -> Vec<String> {
        self.silence
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .skipped
            .clone()
    }

    /// The endpoint, image and subnet, for launching and reading instances directly.
    fn cloud(&self) -> RigLite {
        RigLite {
            endpoint: Arc::clone(&self.endpoint),
            subnet: self.subnet.clone(),
            image: self.image.clone(),
        }
    }

    async fn launch_tagged(&self, tags: &[(&str, &str)]) -> anyhow::Result<String> {
        self.cloud().launch_tagged(tags).await
    }

    fn state_of(&self, id: &str) -> Option<&'static str> {
        self.cloud().state_of(id)
    }

    /// ListInstances calls answered so far: one per orphan sweep.
    fn sweeps(&self) -> usize {
        self.endpoint
            .requests()
            .iter()
            .filter(|r| r.method == http::Method::GET && r.path == "/instances")
            .count()
    }

    /// LaunchInstance calls the endpoint answered, by status.
    fn launches(&self) -> (usize, usize) {
        let calls: Vec<u16> = self
            .endpoint
            .requests()
            .iter()
            .filter(|r| r.method == http::Method::POST && r.path == "/instances")
            .map(|r| r.status)
            .collect();
        let ok = calls.iter().filter(|s| **s == 200).count();
        (ok, calls.len() - ok)
    }
}

/// The local endpoint with an image and a subnet, without a controller.
struct RigLite {
    endpoint: Arc<OciEndpoint>,
    subnet: String,
    image: String,
}

impl RigLite {
    /// A Compute client signing as the controller does (the same API key).
    fn compute(&self) -> anyhow::Result<nodekeeper_oci::compute::ComputeClient> {
        let key = nodekeeper_oci::signer::PrivateKey::from_pem(
            &nodekeeper_e2e::oci_endpoint::test_key_pem()?,
        )?;
        let auth = nodekeeper_oci::auth::ApiKeyProvider::new(TENANCY, USER, key);
        let mut config = nodekeeper_oci::compute::ComputeConfig::new(self.endpoint.url());
        config.timeout = Duration::from_secs(5);
        Ok(nodekeeper_oci::compute::ComputeClient::new(
            config,
            Arc::new(auth),
        )?)
    }

    /// Launches an instance from this rig's image and subnet with `tags`, as another
    /// controller (or a person) would; returns its OCID.
    async fn launch_tagged(&self, tags: &[(&str, &str)]) -> anyhow::Result<String> {
        self.launch_tagged_in(AD, tags).await
    }

    /// [`RigLite::launch_tagged`] in availability domain `ad`.
    async fn launch_tagged_in(&self, ad: &str, tags: &[(&str, &str)]) -> anyhow::Result<String> {
        use nodekeeper_oci::compute::{CreateVnicDetails, LaunchInstanceDetails, SourceDetails};
        let details = LaunchInstanceDetails {
            availability_domain: ad.into(),
            compartment_id: COMPARTMENT.into(),
            shape: SHAPE.into(),
            shape_config: None,
            source_details: Some(SourceDetails::Image {
                image_id: self.image.clone(),
                boot_volume_size_in_gbs: None,
            }),
            create_vnic_details: Some(CreateVnicDetails {
                subnet_id: self.subnet.clone(),
                ..Default::default()
            }),
            metadata: BTreeMap::new(),
            display_name: Some(unique_name("foreign")),
            freeform_tags: tags
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            fault_domain: None,
        };
        Ok(self.compute()?.launch_instance(&details).await?.id)
    }

    /// The endpoint's state of instance `id` (`None`: it never existed).
    fn state_of(&self, id: &str) -> Option<&'static str> {
        self.endpoint
            .instances()
            .into_iter()
            .find(|i| i.id == id)
            .map(|i| i.state)
    }
}

/// The kubelets of the endpoint's instances: an instance RUNNING whose Node record exists (named
/// by its `nodekeeper.dev/node` tag, naming it in `spec.providerID`) joins — the Node is given to
/// kwok, which reports it Ready — except the instances `silence` picks, whose kubelet never
/// registers. Runs until `stop`.
async fn kubelets(
    client: kube::Client,
    endpoint: Arc<OciEndpoint>,
    silence: Arc<std::sync::Mutex<Silence>>,
    stop: CancellationToken,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut joined = BTreeSet::new();
    while !stop.is_cancelled() {
        for i in endpoint.instances() {
            if i.state != "RUNNING" || joined.contains(&i.id) {
                continue;
            }
            {
                let mut s = silence.lock().unwrap_or_else(PoisonError::into_inner);
                if s.skipped.contains(&i.id) {
                    continue;
                }
                if s.left > 0 && i.freeform_tags.contains_key(TAG_NODE) {
                    s.left -= 1;
                    s.skipped.push(i.id.clone());
                    continue;
                }
            }
            let Some(name) = i.freeform_tags.get("nodekeeper.dev/node") else {
                continue;
            };
            let Ok(Some(node)) = nodes.get_opt(name).await else {
                continue;
            };
            let provider_id = node.spec.as_ref().and_then(|s| s.provider_id.clone());
            if provider_id.as_deref() != Some(&format!("oci://{}", i.id)) {
                continue;
            }
            let patch = json!({ "metadata": { "labels": { SIMULATED: "true" } } });
            if nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                .await
                .is_ok()
            {
                joined.insert(i.id.clone());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn set_replicas(client: &kube::Client, name: &str, replicas: u32) -> anyhow::Result<()> {
    Api::<NodeSet>::all(client.clone())
        .patch_scale(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": replicas } })),
        )
        .await
        .with_context(|| format!("scale nodeset {name} to {replicas}"))?;
    Ok(())
}

async fn set_nodes(client: &kube::Client, set: &str) -> anyhow::Result<Vec<Node>> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
        .await?
        .items)
}

fn ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn set_condition(set: &NodeSet, type_: &str) -> Option<(String, String, String)> {
    set.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                format!("{:?}", c.status),
                c.reason.clone(),
                c.message.clone(),
            )
        })
}

async fn wait_converged(client: &kube::Client, set: &str, n: u32) -> anyhow::Result<Vec<Node>> {
    let api: Api<NodeSet> = Api::all(client.clone());
    wait_for(
        &format!("nodeset {set} at {n} Ready nodes"),
        TIMEOUT,
        || {
            let api = api.clone();
            async move {
                let s = api.get(set).await?;
                let st = s.status.clone().unwrap_or_default();
                let nodes = set_nodes(client, set).await?;
                let ok = st.replicas == n
                    && st.ready_replicas == n
                    && st.draining_replicas == 0
                    && set_condition(&s, "Ready").is_some_and(|c| c.0 == "True")
                    && nodes.len() == n as usize
                    && nodes.iter().all(ready);
                Ok(ok.then_some(nodes))
            }
        },
    )
    .await
}

async fn wait_refused(client: &kube::Client, set: &str) -> anyhow::Result<String> {
    let api: Api<NodeSet> = Api::all(client.clone());
    wait_for(
        &format!("nodeset {set}: Ready=False ProviderFailed"),
        TIMEOUT,
        || {
            let api = api.clone();
            async move {
                let s = api.get(set).await?;
                Ok(set_condition(&s, "Ready")
                    .filter(|c| c.0 == "False" && c.1 == "ProviderFailed")
                    .map(|c| c.2))
            }
        },
    )
    .await
}

async fn running_pods(client: &kube::Client, ns: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await?;
    Ok(pods
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| Some((p.name_any(), p.spec.as_ref()?.node_name.clone()?)))
        .collect())
}

#[tokio::test]
async fn oci_scale_up_then_down_drains_and_terminates() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let rig = Rig::new("nset-oci").await?;
    let client = &rig.client;
    let pool = unique_name("pool");
    let class = unique_name("e5");
    let set = unique_name("web");
    rig.class(&class, &pool, |_| {}).await?;
    rig.set(&set, &class, 0).await?;
    wait_converged(client, &set, 0).await?;

    // 0 → 3: three instances launched from the class, each recorded as a Node named by its tag,
    // Ready only once its instance runs.
    let started = Instant::now();
    set_replicas(client, &set, 3).await?;
    let nodes = wait_converged(client, &set, 3).await?;
    eprintln!("0 → 3 Ready in {:?}", started.elapsed());
    let instances = rig.endpoint.instances();
    for n in &nodes {
        let id = n
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.as_deref())
            .and_then(|p| p.strip_prefix("oci://"))
            .with_context(|| format!("node {} has no oci:// providerID", n.name_any()))?;
        let i = instances.iter().find(|i| i.id == id).with_context(|| {
            format!(
                "node {} names {id}, which the endpoint never launched",
                n.name_any()
            )
        })?;
        ensure!(i.state == "RUNNING", "{i:?}");
        ensure!(i.shape == SHAPE, "{i:?}");
        ensure!(i.display_name == format!("nk-{}", n.name_any()), "{i:?}");
        ensure!(i.freeform_tags.get(LABEL_NODE_SET) == Some(&set), "{i:?}");
        ensure!(
            i.metadata.get("nodekeeper_node_name") == Some(&n.name_any()),
            "{i:?}"
        );
        ensure!(
            i.metadata.contains_key("user_data") && i.metadata.contains_key("ssh_authorized_keys"),
            "{i:?}"
        );
        ensure!(
            n.labels().get(POOL) == Some(&pool),
            "class label missing on {}",
            n.name_any()
        );
    }
    ensure!(
        rig.launches() == (3, 0),
        "launches (ok, refused): {:?}",
        rig.launches()
    );

    // Three pods on the pool behind a budget of one unavailable.
    controller_common::pods_behind_a_budget(client, &rig.ns, (POOL, &pool), 3, 1).await?;
    wait_for("3 running pods", TIMEOUT, || async {
        Ok((running_pods(client, &rig.ns).await?.len() == 3).then_some(()))
    })
    .await?;

    // 3 → 1: two nodes drained through NodeMaintenances, then their instances terminated and
    // their Nodes deleted; the budget holds all along.
    set_replicas(client, &set, 1).await?;
    let nms: Api<NodeMaintenance> = Api::all(client.clone());
    let mut fewest = usize::MAX;
    let mut saw_maintenance = false;
    let deadline = Instant::now() + TIMEOUT;
    let survivor = loop {
        fewest = fewest.min(running_pods(client, &rig.ns).await?.len());
        saw_maintenance |= !nms
            .list(&ListParams::default().labels(&format!("{LABEL_NODE_SET}={set}")))
            .await?
            .items
            .is_empty();
        let nodes = set_nodes(client, &set).await?;
        let st = Api::<NodeSet>::all(client.clone())
            .get(&set)
            .await?
            .status
            .unwrap_or_default();
        if nodes.len() == 1
            && st.replicas == 1
            && st.ready_replicas == 1
            && st.draining_replicas == 0
        {
            break nodes[0].clone();
        }
        if Instant::now() > deadline {
            bail!(
                "nodeset {set} did not reach 1 node: {} nodes, status {st:?}",
                nodes.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(saw_maintenance, "the scale-down created no NodeMaintenance");
    ensure!(
        fewest >= 2,
        "the budget allows 1 unavailable, but only {fewest} pods ran at one point"
    );
    let kept = survivor
        .spec
        .as_ref()
        .and_then(|s| s.provider_id.clone())
        .unwrap_or_default();
    let gone = wait_for("the removed instances to terminate", TIMEOUT, || async {
        let all = rig.endpoint.instances();
        let removed: Vec<_> = all
            .iter()
            .filter(|i| format!("oci://{}", i.id) != kept)
            .collect();
        Ok(
            (removed.len() == 2 && removed.iter().all(|i| i.state == "TERMINATED"))
                .then_some(removed.len()),
        )
    })
    .await?;
    ensure!(gone == 2);
    let pods = wait_for("3 running pods on the survivor", TIMEOUT, || async {
        let pods = running_pods(client, &rig.ns).await?;
        Ok((pods.len() == 3).then_some(pods))
    })
    .await?;
    ensure!(
        pods.values().all(|n| *n == survivor.name_any()),
        "pods outside the surviving node: {pods:?}"
    );
    // No instance beyond the three; no terminate was refused.
    ensure!(
        rig.launches() == (3, 0),
        "launches (ok, refused): {:?}",
        rig.launches()
    );
    let refused: Vec<_> = rig
        .endpoint
        .requests()
        .into_iter()
        .filter(|r| r.method == http::Method::DELETE && r.status >= 400)
        .collect();
    ensure!(refused.is_empty(), "refused terminations: {refused:?}");
    Ok(())
}

#[tokio::test]
async fn oci_bad_input_is_named_by_field_before_any_launch() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let rig = Rig::new("nset-oci-bad").await?;
    let client = &rig.client;
    type Case = (
        &'static str,
        Box<dyn FnOnce(&mut Value)>,
        &'static [&'static str],
    );
    let cases: [Case; 3] = [
        (
            "shape",
            Box::new(|t: &mut Value| t["shape"] = json!("VM.Standard.Nope9")),
            &["spec.oci.shape", "VM.Standard.Nope9", SHAPE],
        ),
        (
            "image",
            Box::new(|t: &mut Value| t["imageId"] = json!("ocid1.image.oc1.phx.nosuchimage")),
            &["spec.oci.imageId", "ocid1.image.oc1.phx.nosuchimage"],
        ),
        (
            "subnet",
            Box::new(|t: &mut Value| t["subnetId"] = json!("ocid1.subnet.oc1.phx.nosuchsubnet")),
            &["spec.oci.subnetId", "ocid1.subnet.oc1.phx.nosuchsubnet"],
        ),
    ];
    for (what, change, words) in cases {
        let class = unique_name(what);
        let set = unique_name(&format!("bad-{what}"));
        rig.class(&class, &unique_name("pool"), change).await?;
        rig.set(&set, &class, 2).await?;
        let message = wait_refused(client, &set).await?;
        for w in words {
            ensure!(
                message.contains(w),
                "{what}: the condition does not say {w:?}: {message}"
            );
        }
        ensure!(
            set_nodes(client, &set).await?.is_empty(),
            "{what}: nodes were recorded"
        );
        set_replicas(client, &set, 0).await?;
    }
    // The shape and image were refused before any launch; the subnet only LaunchInstance knows.
    let (ok, refused) = rig.launches();
    ensure!(
        ok == 0 && refused >= 1,
        "launches (ok, refused): {:?}",
        (ok, refused)
    );

    // A malformed OCID never reaches the controller: the API server refuses it, naming the field.
    let error = rig
        .class(&unique_name("malformed"), "p", |t| {
            t["subnetId"] = json!("subnet-123")
        })
        .await
        .expect_err("a malformed subnet OCID must be refused");
    ensure!(
        format!("{error:#}").contains("spec.oci.subnetId"),
        "{error:#}"
    );
    Ok(())
}

#[tokio::test]
async fn oci_out_of_host_capacity_backs_off_then_recovers() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    let rig = Rig::new("nset-oci-cap").await?;
    let client = &rig.client;
    let class = unique_name("e5");
    let set = unique_name("full");
    rig.class(&class, &unique_name("pool"), |_| {}).await?;
    rig.endpoint.set_out_of_capacity(SHAPE, true);
    rig.set(&set, &class, 10).await?;
    let started = Instant::now();
    let message = wait_refused(client, &set).await?;
    ensure!(
        message.contains("spec.oci.shape")
            && message.contains(SHAPE)
            && message.contains(AD)
            && message.contains("out of host capacity"),
        "{message}"
    );
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(started.elapsed())).await;
    let (ok, refused) = rig.launches();
    // Slow start (one launch per round) and the doubling backoff (2, 4, 8, 16 s): a handful of
    // calls in 20 s for 10 missing machines, and the client never retried one.
    eprintln!(
        "{refused} LaunchInstance calls in 20 s for 10 missing machines, all out of capacity"
    );
    ensure!(
        ok == 0 && (2..=6).contains(&refused),
        "launches (ok, refused): {:?}",
        (ok, refused)
    );
    ensure!(set_nodes(client, &set).await?.is_empty());

    // Capacity returns: the next attempt after the backoff goes through, and the set fills.
    rig.endpoint.set_out_of_capacity(SHAPE, false);
    wait_converged(client, &set, 10).await?;
    let (ok, _) = rig.launches();
    ensure!(ok == 10, "{ok} instances launched for 10 replicas");
    Ok(())
}

/// A Node's Ready condition: (status, reason).
fn ready_condition(node: &Node) -> Option<(String, String)> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

/// This cluster's identity as the controller defaults it: the `kube-system` Namespace's UID.
async fn cluster_id(client: &kube::Client) -> anyhow::Result<String> {
    Api::<Namespace>::all(client.clone())
        .get("kube-system")
        .await?
        .metadata
        .uid
        .context("namespace kube-system has no uid")
}

#[tokio::test]
async fn oci_a_machine_whose_kubelet_never_registers_is_replaced() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    // On a real cluster kube-controller-manager marks a Node no kubelet ever updated
    // `Ready=Unknown, NodeStatusNeverUpdated` once --node-startup-grace-period (1 minute, as this
    // control plane runs it) has passed. A join timeout past that makes the controller meet the
    // Node in that state, as it does with its default 10 minutes.
    let join_timeout = Duration::from_secs(80);
    let rig = Rig::with(
        "nset-oci-join",
        &[("NODEKEEPER_NODESET_JOIN_TIMEOUT", "80s")],
        1,
    )
    .await?;
    let client = &rig.client;
    let class = unique_name("e5");
    let set = unique_name("silent");
    rig.class(&class, &unique_name("pool"), |_| {}).await?;
    rig.set(&set, &class, 1).await?;
    let silent = wait_for(
        "an instance whose kubelet stays silent",
        TIMEOUT,
        || async { Ok(rig.silenced().first().cloned()) },
    )
    .await?;
    let node_name = rig
        .endpoint
        .instances()
        .into_iter()
        .find(|i| i.id == silent)
        .and_then(|i| i.freeform_tags.get(TAG_NODE).cloned())
        .context("the silent instance has no node tag")?;
    let nodes: Api<Node> = Api::all(client.clone());

    // The premise: the node lifecycle controller marks the Node before the join timeout runs out.
    let deadline = Instant::now() + join_timeout + Duration::from_secs(30);
    loop {
        let Some(node) = nodes.get_opt(&node_name).await? else {
            bail!(
                "node {node_name} was removed before kube-controller-manager marked it \
                 NodeStatusNeverUpdated; raise the join timeout above its startup grace period"
            );
        };
        match ready_condition(&node) {
            Some((status, reason)) if reason == "NodeStatusNeverUpdated" => {
                ensure!(status == "Unknown", "{status} {reason}");
                break;
            }
            Some(other) => bail!("node {node_name} whose kubelet is silent has Ready {other:?}"),
            None if Instant::now() > deadline => bail!(
                "kube-controller-manager did not mark node {node_name} NodeStatusNeverUpdated \
                 within {:?}",
                join_timeout + Duration::from_secs(30)
            ),
            None => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }

    // The join timeout: the instance is terminated, its Node deleted, the failure counted, and
    // a new machine (whose kubelet registers) takes its place.
    let sets: Api<NodeSet> = Api::all(client.clone());
    wait_for(
        &format!("nodeset {set} to count a failed join and terminate {silent}"),
        TIMEOUT,
        || async {
            let failed = sets
                .get(&set)
                .await?
                .status
                .unwrap_or_default()
                .failed_joins;
            let terminated = matches!(rig.state_of(&silent), Some("TERMINATING" | "TERMINATED"));
            let node_gone = nodes.get_opt(&node_name).await?.is_none();
            Ok((failed >= 1 && terminated && node_gone).then_some(()))
        },
    )
    .await?;
    let nodes = wait_converged(client, &set, 1).await?;
    let replacement = nodes[0]
        .spec
        .as_ref()
        .and_then(|s| s.provider_id.clone())
        .unwrap_or_default();
    ensure!(
        replacement != format!("oci://{silent}"),
        "the set still counts the silent instance"
    );
    ensure!(
        rig.launches() == (2, 0),
        "launches (ok, refused): {:?}",
        rig.launches()
    );
    Ok(())
}

#[tokio::test]
async fn oci_the_orphan_sweep_terminates_only_this_clusters_machines_without_a_node()
-> anyhow::Result<()> {
    let _serial = SERIAL.lock().await;
    // No grace: what keeps machines alive here is their ownership and their Node, not their age.
    let rig = Rig::with(
        "nset-oci-sweep",
        &[("NODEKEEPER_NODESET_ORPHAN_GRACE", "0s")],
        0,
    )
    .await?;
    let client = &rig.client;
    let ours = cluster_id(client).await?;
    let class = unique_name("e5");
    let set = unique_name("sweep");
    rig.class(&class, &unique_name("pool"), |_| {}).await?;
    rig.set(&set, &class, 2).await?;
    let converged = wait_converged(client, &set, 2).await?;
    for i in rig.endpoint.instances() {
        ensure!(
            i.freeform_tags.get(TAG_CLUSTER) == Some(&ours),
            "instance {} does not carry this cluster's identity: {:?}",
            i.id,
            i.freeform_tags
        );
    }

    // One node taken out of the set by removing its label, as one orphans a ReplicaSet's pod.
    let taken = converged[0].name_any();
    let taken_instance = converged[0]
        .spec
        .as_ref()
        .and_then(|s| s.provider_id.as_deref())
        .and_then(|p| p.strip_prefix("oci://"))
        .context("no providerID")?
        .to_owned();
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            &taken,
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "labels": { LABEL_NODE_SET: null } } })),
        )
        .await?;
    // Instances tagged with the set and no Node: another cluster's (a blue/green twin with the
    // same set name), one from before the cluster tag, and one truly this cluster's orphan.
    let other_node = format!("{set}-green");
    let other = rig
        .launch_tagged(&[
            (LABEL_NODE_SET, &set),
            (TAG_NODE, &other_node),
            (TAG_CLUSTER, "another-cluster"),
        ])
        .await?;
    let legacy_node = format!("{set}-legacy");
    let legacy = rig
        .launch_tagged(&[(LABEL_NODE_SET, &set), (TAG_NODE, &legacy_node)])
        .await?;
    let orphan_node = format!("{set}-orphan");
    let orphan = rig
        .launch_tagged(&[
            (LABEL_NODE_SET, &set),
            (TAG_NODE, &orphan_node),
            (TAG_CLUSTER, &ours),
        ])
        .await?;

    // And one leaked in another availability domain (the class named it before it changed).
    let moved_node = format!("{set}-moved");
    let moved = rig
        .cloud()
        .launch_tagged_in(
            "Uocm:PHX-AD-2",
            &[
                (LABEL_NODE_SET, &set),
                (TAG_NODE, &moved_node),
                (TAG_CLUSTER, &ours),
            ],
        )
        .await?;

    // And, of this cluster and without a Node, one of a set deleted since (nothing else would
    // sweep it) and one of another set that exists (its own sweep's business).
    let deleted_set = unique_name("deleted");
    let deleted = rig
        .launch_tagged(&[
            (LABEL_NODE_SET, &deleted_set),
            (TAG_NODE, &format!("{deleted_set}-a")),
            (TAG_CLUSTER, &ours),
        ])
        .await?;
    // A set no controller acts on (none selects it): it exists, and that is all.
    let living_set = unique_name("living");
    Api::<NodeSet>::all(client.clone())
        .patch(
            &living_set,
            &PatchParams::apply("nodekeeper-e2e").force(),
            &Patch::Apply(json!({
                "apiVersion": "nodekeeper.dev/v1alpha1", "kind": "NodeSet",
                "metadata": { "name": living_set },
                "spec": { "nodeClassName": class, "replicas": 0 },
            })),
        )
        .await?;
    let living = rig
        .launch_tagged(&[
            (LABEL_NODE_SET, &living_set),
            (TAG_NODE, &format!("{living_set}-a")),
            (TAG_CLUSTER, &ours),
        ])
        .await?;

    // The sweep runs (it terminates the true orphans) and, one more sweep later, has left the
    // others running and the taken node in place.
    wait_for(
        &format!("the sweep to terminate the orphans {orphan}, {moved} and {deleted}"),
        TIMEOUT,
        || async {
            let gone = |id: &str| matches!(rig.state_of(id), Some("TERMINATING" | "TERMINATED"));
            Ok((gone(&orphan) && gone(&moved) && gone(&deleted)).then_some(()))
        },
    )
    .await?;
    let after = rig.sweeps();
    wait_for("one more orphan sweep", TIMEOUT, || async {
        Ok((rig.sweeps() > after).then_some(()))
    })
    .await?;
    for (what, id) in [
        ("another cluster's instance", &other),
        ("the instance without a cluster tag", &legacy),
        (
            "the instance of the node taken out of the set",
            &taken_instance,
        ),
        ("the instance of another set that exists", &living),
    ] {
        ensure!(
            rig.state_of(id) == Some("RUNNING"),
            "{what} ({id}) was not left running: {:?}",
            rig.state_of(id)
        );
    }
    let node = nodes
        .get_opt(&taken)
        .await?
        .with_context(|| format!("node {taken}, taken out of the set, was deleted"))?;
    ensure!(ready(&node), "node {taken} is no longer Ready");
    // The set made a replacement for the node it lost.
    let now = wait_converged(client, &set, 2).await?;
    ensure!(
        now.iter().all(|n| n.name_any() != taken),
        "node {taken} is still counted in the set"
    );
    ensure!(
        rig.launches() == (9, 0),
        "launches (ok, refused): {:?} (2 + 1 replacement by the controller, 6 by the test)",
        rig.launches()
    );
    nodes.delete(&taken, &Default::default()).await.ok();
    Api::<NodeSet>::all(client.clone())
        .delete(&living_set, &Default::default())
        .await
        .ok();
    Ok(())
}

#[tokio::test]
async fn oci_deleting_a_machine_checks_the_instance_tags_and_the_node_provider_id()
-> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let endpoint = Arc::new(
        OciEndpoint::start(EndpointConfig {
            launch_delay: Duration::from_millis(200),
            terminate_delay: Duration::from_millis(200),
            ..Default::default()
        })
        .await?,
    );
    let credentials = oci_common::api_key_for(&endpoint, TENANCY, USER)?;
    let cloud = oci_common::cloud_flags(&endpoint, &credentials)?;
    let provider = node_set::oci_provider(&client, &cloud, Some("blue"))
        .map_err(anyhow::Error::msg)?
        .context("the flags give an oci provider")?;
    // A rig without a controller: only its endpoint helpers are used.
    let rig = RigLite {
        endpoint: Arc::clone(&endpoint),
        subnet: endpoint.add_subnet("10.0.0.0/16")?,
        image: endpoint.add_image(),
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let set = unique_name("del");
    let node = |name: &str, provider_id: &str| -> anyhow::Result<Node> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": name },
            "spec": { "providerID": provider_id },
        }))?)
    };
    let machine = |name: &str, id: &str| Machine {
        node_name: name.to_owned(),
        provider_id: format!("oci://{id}"),
        node_set: Some(set.clone()),
        created: None,
    };
    let mut made = Vec::new();

    // The instance is the machine's, but the Node of that name is another instance's: the
    // instance goes, the Node stays.
    let a_node = unique_name("del-a");
    let a = rig
        .launch_tagged(&[
            (LABEL_NODE_SET, &set),
            (TAG_NODE, &a_node),
            (TAG_CLUSTER, "blue"),
        ])
        .await?;
    nodes
        .create(
            &Default::default(),
            &node(&a_node, "oci://ocid1.instance.oc1.phx.someoneelse")?,
        )
        .await?;
    made.push(a_node.clone());
    let deletion = provider.delete(&machine(&a_node, &a)).await?;
    ensure!(deletion == Deletion::InProgress, "{deletion:?}");
    ensure!(
        matches!(rig.state_of(&a), Some("TERMINATING" | "TERMINATED")),
        "{:?}",
        rig.state_of(&a)
    );
    ensure!(
        nodes.get_opt(&a_node).await?.is_some(),
        "node {a_node}, which names another instance, was deleted"
    );

    // The Node names the instance, but the instance was launched for another set, or by another
    // cluster: refused, naming the tag; the instance and the Node stay.
    for (what, tags_set, tags_cluster, word) in [
        (
            "another set's",
            "other-set",
            "blue",
            "nodekeeper.dev/nodeset=\"other-set\"",
        ),
        (
            "another cluster's",
            set.as_str(),
            "green",
            "another cluster's",
        ),
    ] {
        let name = unique_name("del-b");
        let id = rig
            .launch_tagged(&[
                (LABEL_NODE_SET, tags_set),
                (TAG_NODE, &name),
                (TAG_CLUSTER, tags_cluster),
            ])
            .await?;
        nodes
            .create(&Default::default(), &node(&name, &format!("oci://{id}"))?)
            .await?;
        made.push(name.clone());
        let error = provider
            .delete(&machine(&name, &id))
            .await
            .expect_err("an instance launched as another machine must not be terminated");
        let message = error.to_string();
        ensure!(
            message.contains(word) && message.contains(&id) && message.contains(&name),
            "{what}: {message}"
        );
        ensure!(
            matches!(rig.state_of(&id), Some("PROVISIONING" | "RUNNING")),
            "{what}: {:?}",
            rig.state_of(&id)
        );
        ensure!(
            nodes.get_opt(&name).await?.is_some(),
            "{what}: node {name} was deleted"
        );
    }

    // The machine's own instance and Node: both go.
    let c_node = unique_name("del-c");
    let c = rig
        .launch_tagged(&[
            (LABEL_NODE_SET, &set),
            (TAG_NODE, &c_node),
            (TAG_CLUSTER, "blue"),
        ])
        .await?;
    nodes
        .create(&Default::default(), &node(&c_node, &format!("oci://{c}"))?)
        .await?;
    provider.delete(&machine(&c_node, &c)).await?;
    ensure!(
        matches!(rig.state_of(&c), Some("TERMINATING" | "TERMINATED")),
        "{:?}",
        rig.state_of(&c)
    );
    ensure!(
        nodes.get_opt(&c_node).await?.is_none(),
        "node {c_node} was not deleted"
    );
    for n in made {
        nodes.delete(&n, &Default::default()).await.ok();
    }
    Ok(())
}
