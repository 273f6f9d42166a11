//! The CRDs in `deploy/crds/` against a real kube-apiserver: they install and become Established,
//! each kind accepts a valid object written as a user would write it, and the apiserver itself
//! rejects invalid ones with the schema's or the CEL rule's message (and stores nothing).

use anyhow::Context as _;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use nodekeeper_e2e::{ControlPlane, install_crds, test_namespace, unique_name};
use serde_json::{Value, json};

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "nodekeeper.dev".into(),
        version: "v1alpha1".into(),
        api_version: "nodekeeper.dev/v1alpha1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn object(kind: &str, name: &str, spec: Value) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "nodekeeper.dev/v1alpha1",
        "kind": kind,
        "metadata": { "name": name },
        "spec": spec,
    }))?)
}

/// A cluster-scoped API for `kind` with the CRDs installed.
async fn cluster_api(kind: &str, plural: &str) -> anyhow::Result<Api<DynamicObject>> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    Ok(Api::all_with(client, &resource(kind, plural)))
}

async fn accepts(
    api: &Api<DynamicObject>,
    kind: &str,
    spec: Value,
) -> anyhow::Result<DynamicObject> {
    let name = unique_name(&kind.to_ascii_lowercase());
    api.create(&PostParams::default(), &object(kind, &name, spec.clone())?)
        .await
        .with_context(|| format!("valid {kind} rejected: {spec}"))
}

/// Asserts the apiserver refuses `spec` with 422 and a message containing `message`, and that no
/// object was stored.
async fn rejects(
    api: &Api<DynamicObject>,
    kind: &str,
    spec: Value,
    message: &str,
) -> anyhow::Result<()> {
    let name = unique_name(&kind.to_ascii_lowercase());
    let result = api
        .create(&PostParams::default(), &object(kind, &name, spec.clone())?)
        .await;
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422, "{kind} {spec}: {}", status.message);
            assert!(
                status.message.contains(message),
                "{kind} {spec}\n  got:  {}\n  want: …{message}…",
                status.message
            );
        }
        Ok(_) => panic!("invalid {kind} was accepted: {spec}"),
        Err(other) => return Err(other).context("create"),
    }
    assert!(
        api.get_opt(&name).await?.is_none(),
        "a rejected {kind} must not be stored"
    );
    Ok(())
}

#[tokio::test]
async fn crds_install_and_become_established() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    let mut names = install_crds(&client).await?;
    names.sort();
    assert_eq!(
        names,
        [
            "networktests.nodekeeper.dev",
            "nodeclasses.nodekeeper.dev",
            "nodediagnostics.nodekeeper.dev",
            "nodemaintenances.nodekeeper.dev",
            "nodenetworkconfigs.nodekeeper.dev",
            "nodesets.nodekeeper.dev",
        ]
    );
    // Applying again is a no-op, not an error (server-side apply with one field manager).
    let again = install_crds(&client).await?;
    assert_eq!(again.len(), names.len());
    Ok(())
}

#[tokio::test]
async fn network_test_valid_accepted_invalid_rejected_with_message() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let ns = test_namespace(&client, "crd-networktest").await?;
    let api: Api<DynamicObject> =
        Api::namespaced_with(client, &ns, &resource("NetworkTest", "networktests"));

    let created = accepts(
        &api,
        "NetworkTest",
        json!({ "kind": "icmp", "targets": [{ "address": "127.0.0.1" }, { "apiServer": true }] }),
    )
    .await?;
    // Defaults from the schema are filled in by the apiserver.
    assert_eq!(created.data["spec"]["count"], 3, "{:?}", created.data);

    rejects(
        &api,
        "NetworkTest",
        json!({ "kind": "tcp", "targets": [{ "address": "10.0.0.1" }] }),
        "spec.port: kind tcp needs spec.port for address, hostname and peers targets",
    )
    .await?;
    rejects(
        &api,
        "NetworkTest",
        json!({ "kind": "icmp", "targets": [{ "address": "not-an-ip" }] }),
        "spec.targets[].address must be an IPv4 or IPv6 address",
    )
    .await?;
    rejects(
        &api,
        "NetworkTest",
        json!({ "kind": "ping", "targets": [{ "address": "127.0.0.1" }] }),
        "Unsupported value: \"ping\"",
    )
    .await?;

    // A NetworkTest is one run: its spec cannot be edited afterwards.
    let name = created.metadata.name.clone().context("name")?;
    let edit = api
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "count": 5 } })),
        )
        .await;
    match edit {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422);
            assert!(
                status.message.contains("spec is immutable"),
                "{}",
                status.message
            );
        }
        other => panic!("editing a NetworkTest spec must be refused, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn node_network_config_valid_accepted_invalid_rejected_with_message() -> anyhow::Result<()> {
    let api = cluster_api("NodeNetworkConfig", "nodenetworkconfigs").await?;
    let created = accepts(
        &api,
        "NodeNetworkConfig",
        json!({ "nodeSelector": { "matchLabels": { "pool": "gpu" } }, "ociVnics": {}, "rollout": { "maxUnavailable": "25%" } }),
    )
    .await?;
    assert_eq!(
        created.data["spec"]["ociVnics"]["mtu"], 9000,
        "{:?}",
        created.data
    );
    api.delete(
        &created.metadata.name.clone().context("name")?,
        &Default::default(),
    )
    .await?;

    rejects(
        &api,
        "NodeNetworkConfig",
        json!({ "nodeSelector": { "matchLabels": { "pool": "gpu" } } }),
        "spec: set ociVnics, state, or both; an empty configuration changes nothing",
    )
    .await?;
    rejects(
        &api,
        "NodeNetworkConfig",
        json!({ "nodeSelector": { "matchLabels": { "pool": "gpu" } }, "ociVnics": {}, "rollout": { "maxUnavailable": "150%" } }),
        "must be a non-negative whole number or a percentage from 0% to 100%",
    )
    .await?;
    rejects(
        &api,
        "NodeNetworkConfig",
        json!({ "nodeSelector": {}, "ociVnics": { "attach": [
            { "displayName": "a", "subnetId": "ocid1.vcn.oc1.phx.aaaa" }
        ] } }),
        "spec.ociVnics.attach[0].subnetId: Invalid value: \"ocid1.vcn.oc1.phx.aaaa\": subnetId must be a subnet OCID",
    )
    .await?;
    rejects(
        &api,
        "NodeNetworkConfig",
        json!({ "nodeSelector": {}, "ociVnics": { "attach": [
            { "displayName": "a", "subnetId": "ocid1.subnet.oc1.phx.aaaa", "nsgIds": ["sg-1"] },
            { "displayName": "a", "subnetId": "ocid1.subnet.oc1..bbbb" }
        ] } }),
        "Duplicate value",
    )
    .await?;
    rejects(
        &api,
        "NodeNetworkConfig",
        json!({ "nodeSelector": {}, "ociVnics": { "mtu": 100 } }),
        "should be greater than or equal to 576",
    )
    .await
}

#[tokio::test]
async fn node_maintenance_valid_accepted_invalid_rejected_with_message() -> anyhow::Result<()> {
    let api = cluster_api("NodeMaintenance", "nodemaintenances").await?;
    let created = accepts(
        &api,
        "NodeMaintenance",
        json!({ "nodeSelector": { "matchLabels": { "nodekeeper.dev/test-pool": unique_name("none") } }, "stage": "Complete" }),
    )
    .await?;
    rejects(
        &api,
        "NodeMaintenance",
        json!({ "nodeSelector": {} }),
        "spec.nodeSelector must name at least one label or expression",
    )
    .await?;
    rejects(
        &api,
        "NodeMaintenance",
        json!({ "nodeSelector": { "matchLabels": { "a": "b" } }, "stage": "Reboot" }),
        "Unsupported value: \"Reboot\"",
    )
    .await?;
    // Transition rule: a Complete maintenance cannot be reopened.
    let name = created.metadata.name.clone().context("name")?;
    let reopen = api
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "stage": "Drain" } })),
        )
        .await;
    match reopen {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 422);
            assert!(
                status
                    .message
                    .contains("spec.stage: a Complete maintenance is finished"),
                "{}",
                status.message
            );
        }
        other => panic!("reopening a Complete NodeMaintenance must be refused, got {other:?}"),
    }
    api.delete(&name, &Default::default()).await?;
    Ok(())
}

#[tokio::test]
async fn node_class_valid_accepted_invalid_rejected_with_message() -> anyhow::Result<()> {
    let api = cluster_api("NodeClass", "nodeclasses").await?;
    let created = accepts(&api, "NodeClass", json!({ "provider": "kwok", "kwok": {} })).await?;
    api.delete(
        &created.metadata.name.clone().context("name")?,
        &Default::default(),
    )
    .await?;
    rejects(
        &api,
        "NodeClass",
        json!({ "provider": "oci", "kwok": {} }),
        "spec: give the template of the provider named in spec.provider (spec.oci or spec.kwok), and only that one",
    )
    .await?;
    rejects(
        &api,
        "NodeClass",
        json!({
            "provider": "oci",
            "oci": {
                "availabilityDomain": "AD-1",
                "compartmentId": "ocid1.compartment.oc1..aaaa",
                "imageId": "ocid1.image.oc1..aaaa",
                "shape": "Standard.E4",
                "subnetId": "ocid1.subnet.oc1..aaaa",
            },
        }),
        "spec.oci.shape",
    )
    .await
}

#[tokio::test]
async fn node_set_valid_accepted_invalid_rejected_with_message() -> anyhow::Result<()> {
    let api = cluster_api("NodeSet", "nodesets").await?;
    let created = accepts(
        &api,
        "NodeSet",
        json!({ "nodeClassName": "small", "replicas": 3 }),
    )
    .await?;
    assert_eq!(created.data["spec"]["maxSurge"], 1, "{:?}", created.data);
    api.delete(
        &created.metadata.name.clone().context("name")?,
        &Default::default(),
    )
    .await?;
    rejects(
        &api,
        "NodeSet",
        json!({ "nodeClassName": "small", "replicas": 3, "maxSurge": 0, "maxUnavailable": "0%" }),
        "spec.maxSurge and spec.maxUnavailable cannot both be zero",
    )
    .await?;
    rejects(
        &api,
        "NodeSet",
        json!({ "nodeClassName": "small", "replicas": -1 }),
        "should be greater than or equal to 0",
    )
    .await?;
    rejects(
        &api,
        "NodeSet",
        json!({ "replicas": 1 }),
        "spec.nodeClassName: Required value",
    )
    .await
}
