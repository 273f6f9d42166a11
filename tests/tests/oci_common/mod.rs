//! What the tests that drive the controller against the local OCI endpoint share. Kept apart
//! from `controller_common` because that module is also compiled into the kubectl plugin's tests,
//! which do not link the OCI crate.

pub mod netns;

/// An API key as the controller mounts it (the tenancy, user, fingerprint and private key files
/// in a temporary directory, for `--oci-credentials-dir`), trusted by `endpoint`.
#[allow(dead_code)]
pub fn api_key_for(
    endpoint: &nodekeeper_e2e::oci_endpoint::OciEndpoint,
    tenancy: &str,
    user: &str,
) -> anyhow::Result<tempfile::TempDir> {
    use nodekeeper_oci::auth::api_key_files;
    let pem = nodekeeper_e2e::oci_endpoint::test_key_pem()?;
    let key = nodekeeper_oci::signer::PrivateKey::from_pem(&pem)?;
    let credentials = tempfile::tempdir()?;
    for (file, content) in [
        (api_key_files::TENANCY, tenancy.to_owned()),
        (api_key_files::USER, user.to_owned()),
        (api_key_files::FINGERPRINT, key.fingerprint().to_owned()),
        (api_key_files::PRIVATE_KEY, pem),
    ] {
        std::fs::write(credentials.path().join(file), content)?;
    }
    endpoint.register_key(
        &format!("{tenancy}/{user}/{}", key.fingerprint()),
        &key.public_key_pem()?,
    )?;
    Ok(credentials)
}

/// The local OCI endpoint started with `cfg`, trusting the test API key, and a Compute client
/// signing with that key (5 s per call; the client's default retries).
#[allow(dead_code)]
pub async fn endpoint_and_compute(
    cfg: nodekeeper_e2e::oci_endpoint::EndpointConfig,
) -> anyhow::Result<(
    std::sync::Arc<nodekeeper_e2e::oci_endpoint::OciEndpoint>,
    nodekeeper_oci::compute::ComputeClient,
)> {
    use nodekeeper_oci::auth::AuthProvider as _;
    let endpoint =
        std::sync::Arc::new(nodekeeper_e2e::oci_endpoint::OciEndpoint::start(cfg).await?);
    let key = nodekeeper_oci::signer::PrivateKey::from_pem(
        &nodekeeper_e2e::oci_endpoint::test_key_pem()?,
    )?;
    let auth = nodekeeper_oci::auth::ApiKeyProvider::new(
        "ocid1.tenancy.oc1..t",
        "ocid1.user.oc1..u",
        key.clone(),
    );
    endpoint.register_key(&auth.credentials().await?.key_id, &key.public_key_pem()?)?;
    let mut config = nodekeeper_oci::compute::ComputeConfig::new(endpoint.url());
    config.timeout = std::time::Duration::from_secs(5);
    let compute = nodekeeper_oci::compute::ComputeClient::new(config, std::sync::Arc::new(auth))?;
    Ok((endpoint, compute))
}

/// The NodeNetworkConfig reconciler as the controller-manager runs it (its own caches), for the
/// objects labelled `label` only, attaching through `compute` in `compartment`; cancel the
/// token and await the handle to stop it.
#[allow(dead_code)]
pub fn start_nnc_controller(
    client: &kube::Client,
    agents: std::sync::Arc<dyn nodekeeper_controller::shared::agents::Agents>,
    agent_port: u16,
    compute: nodekeeper_oci::compute::ComputeClient,
    compartment: &str,
    settings: nodekeeper_controller::controllers::node_network_config::Settings,
    label: &(String, String),
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    use nodekeeper_controller::controllers::node_network_config::Context;
    use nodekeeper_controller::controllers::node_network_config::cloud::{Cloud, CloudAccess};
    use nodekeeper_controller::shared::metrics::{CloudMetrics, ReconcileMetrics};
    let cloud = Cloud::new(compute, Some(compartment.into()), CloudMetrics::default())
        .with_attach_latency(std::time::Duration::from_millis(500));
    let ctx = std::sync::Arc::new(
        Context::with(
            client.clone(),
            agents,
            agent_port,
            CloudAccess::On(std::sync::Arc::new(cloud)),
            CloudMetrics::default(),
            settings,
        )
        .watching(&format!("{}={}", label.0, label.1)),
    );
    let token = tokio_util::sync::CancellationToken::new();
    let handle = tokio::spawn(nodekeeper_controller::controllers::start(
        ctx,
        ReconcileMetrics::default(),
        token.clone(),
    ));
    (token, handle)
}

/// Gives the kwok Node `node` an instance of `shape` at the endpoint, the way the cloud provider
/// would: its `spec.providerID` and its instance-type label. Returns the instance's OCID and the
/// patched Node.
#[allow(dead_code)]
pub async fn instance_for_node(
    client: &kube::Client,
    endpoint: &nodekeeper_e2e::oci_endpoint::OciEndpoint,
    node: &str,
    shape: &str,
    placement: (&str, &str),
    primary_subnet: &str,
) -> anyhow::Result<(String, k8s_openapi::api::core::v1::Node)> {
    use anyhow::Context as _;
    let (compartment, availability_domain) = placement;
    let instance = endpoint.add_instance(&nodekeeper_e2e::oci_endpoint::InstanceSpec {
        display_name: node.into(),
        shape: shape.into(),
        compartment_id: compartment.into(),
        availability_domain: availability_domain.into(),
        subnet_id: primary_subnet.into(),
    })?;
    let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let patched = api
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({
                "metadata": {"labels": {"node.kubernetes.io/instance-type": shape}},
                "spec": {"providerID": format!("oci://{instance}")},
            })),
        )
        .await
        .with_context(|| format!("set providerID of {node}"))?;
    Ok((instance, patched))
}

/// The controller's cloud flags for `endpoint` with the API key in `credentials` (from
/// [`api_key_for`]), parsed from a command line as the controller parses its own.
#[allow(dead_code)]
pub fn cloud_flags(
    endpoint: &nodekeeper_e2e::oci_endpoint::OciEndpoint,
    credentials: &tempfile::TempDir,
) -> anyhow::Result<nodekeeper_controller::controllers::node_network_config::CloudConfig> {
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        cloud: nodekeeper_controller::controllers::node_network_config::CloudConfig,
    }
    let flags = <Flags as clap::Parser>::try_parse_from([
        "x".to_owned(),
        format!("--oci-endpoint={}", endpoint.url()),
        "--oci-auth=api-key".to_owned(),
        format!("--oci-credentials-dir={}", credentials.path().display()),
    ])?;
    Ok(flags.cloud)
}
