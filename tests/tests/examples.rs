//! The examples in `deploy/examples/` are what users `kubectl apply` first, so each must be
//! accepted by a real kube-apiserver with the CRDs from `deploy/crds/`: every document is
//! server-side applied with `dryRun=All` (full validation, OpenAPI schema and CEL rules, nothing
//! stored) into a test namespace.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use kube::api::{DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::discovery::{self, Scope};
use kube::{Api, Client};
use nodekeeper_api::crd::NetworkTestSpec;
use nodekeeper_e2e::{ControlPlane, install_crds, test_namespace};
use serde::Deserialize as _;

/// The NetworkTest examples the README and `cargo xtask demo` refer to.
const NETWORK_TESTS: [&str; 4] = [
    "networktest-mesh.yaml",
    "networktest-apiserver.yaml",
    "networktest-dns.yaml",
    "networktest-mtu.yaml",
];

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
        .join("examples")
}

/// The non-empty YAML documents of one file.
fn documents(path: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let mut out = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_json::Value::deserialize(document)
            .with_context(|| format!("parse {}", path.display()))?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// Server-side applies `object` with `dryRun=All` into `namespace` (when the kind is
/// namespaced) and returns what the apiserver would store.
async fn dry_run_apply(
    client: &Client,
    namespace: &str,
    mut object: serde_json::Value,
) -> anyhow::Result<DynamicObject> {
    let api_version = object["apiVersion"]
        .as_str()
        .context("document without apiVersion")?
        .to_owned();
    let kind = object["kind"]
        .as_str()
        .context("document without kind")?
        .to_owned();
    let name = object["metadata"]["name"]
        .as_str()
        .context("document without metadata.name")?
        .to_owned();
    let (group, version) = api_version
        .split_once('/')
        .unwrap_or(("", api_version.as_str()));
    let gvk = GroupVersionKind::gvk(group, version, &kind);
    let (resource, caps) = discovery::pinned_kind(client, &gvk)
        .await
        .with_context(|| format!("discover {api_version} {kind}"))?;
    let api: Api<DynamicObject> = if caps.scope == Scope::Namespaced {
        object["metadata"]["namespace"] = namespace.into();
        Api::namespaced_with(client.clone(), namespace, &resource)
    } else {
        Api::all_with(client.clone(), &resource)
    };
    let params = PatchParams::apply("nodekeeper-e2e-examples").dry_run();
    Ok(api.patch(&name, &params, &Patch::Apply(&object)).await?)
}

#[tokio::test]
async fn every_example_is_accepted_by_the_apiserver() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let namespace = test_namespace(&client, "examples").await?;

    let dir = examples_dir();
    for file in NETWORK_TESTS {
        if !dir.join(file).is_file() {
            bail!("deploy/examples/{file} is missing; the README and `cargo xtask demo` use it");
        }
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();

    let mut network_tests = 0;
    for file in &files {
        let documents = documents(file)?;
        assert!(!documents.is_empty(), "{} holds no object", file.display());
        for document in documents {
            let stored = dry_run_apply(&client, &namespace, document.clone())
                .await
                .with_context(|| format!("apiserver refused {}", file.display()))?;
            assert_eq!(
                stored.metadata.name.as_deref(),
                document["metadata"]["name"].as_str(),
                "{}",
                file.display()
            );
            if document["kind"] == "NetworkTest" {
                // What the apiserver would store (defaults filled in) is also what the
                // controller will read.
                let spec: NetworkTestSpec = serde_json::from_value(stored.data["spec"].clone())
                    .with_context(|| format!("{}: stored spec does not parse", file.display()))?;
                assert!(!spec.targets.is_empty(), "{}", file.display());
                network_tests += 1;
            }
        }
    }
    assert!(
        network_tests >= NETWORK_TESTS.len(),
        "{network_tests} NetworkTests found"
    );
    Ok(())
}

/// The dry run above proves something only if the apiserver validates: the mesh example with a
/// probe kind that cannot take peers must be refused, with the CRD's message.
#[tokio::test]
async fn a_broken_example_is_refused_by_the_apiserver() -> anyhow::Result<()> {
    let client = ControlPlane::shared().client().await?;
    install_crds(&client).await?;
    let namespace = test_namespace(&client, "examples-bad").await?;

    let mut mesh = documents(&examples_dir().join("networktest-mesh.yaml"))?
        .pop()
        .context("mesh example is empty")?;
    mesh["spec"]["kind"] = "dns".into();
    let error = dry_run_apply(&client, &namespace, mesh)
        .await
        .expect_err("a dns NetworkTest with peers targets must be refused");
    let message = format!("{error:#}");
    assert!(
        message.contains("kind dns takes hostname targets"),
        "unexpected refusal: {message}"
    );
    Ok(())
}
