//! The Compute API client (`nodekeeper_oci::compute`) against the local OCI endpoint
//! (`nodekeeper_e2e::oci_endpoint`) on 127.0.0.1: every request signed and verified, attach →
//! poll → ATTACHED → visible in the instance's IMDS answer, idempotent find by display name,
//! pagination, bounded retries on 429/500 with one retry token per create, error parsing, the
//! capacity answer, 409 on concurrent attaches and the per-instance lock that avoids it.
//!
//! Run: `cargo test -p nodekeeper-e2e --test oci_compute`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use nodekeeper_e2e::oci_endpoint::{EndpointConfig, Fault, InstanceSpec, OciEndpoint};
use nodekeeper_oci::auth::{ApiKeyProvider, AuthProvider};
use nodekeeper_oci::compute::{
    AttachVnicDetails, ComputeClient, ComputeConfig, ComputeError, CreateVnicDetails,
    InstanceLocks, InstanceState, LaunchInstanceDetails, ListInstancesFilter, TerminateOptions,
    VnicAttachmentState,
};
use nodekeeper_oci::retry::RetryPolicy;
use nodekeeper_oci::signer::PrivateKey;
use nodekeeper_oci::{ImdsClient, ImdsConfig};

const COMPARTMENT: &str = "ocid1.compartment.oc1..localtest";
const AD: &str = "Uocm:PHX-AD-1";
const VM_SHAPE: &str = "VM.Standard.E5.Flex"; // 2 VNICs in the endpoint's default limits
const VM4_SHAPE: &str = "VM.Standard2.4"; // 4 VNICs
const POLL: Duration = Duration::from_millis(50);
const WAIT: Duration = Duration::from_secs(10);

fn test_key() -> PrivateKey {
    let pem = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/oci/tests/fixtures/test-key-2048.pem"
    ))
    .expect("read the test key fixture");
    PrivateKey::from_pem(&pem).expect("parse the test key")
}

fn fast_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        base: Duration::from_millis(10),
        cap: Duration::from_millis(40),
        max_elapsed: Duration::from_secs(5),
    }
}

struct Rig {
    endpoint: OciEndpoint,
    client: ComputeClient,
    subnet_primary: String,
    subnet_pods: String,
}

impl Rig {
    async fn new(retry: RetryPolicy, page_size: u32) -> Result<Self> {
        let endpoint = OciEndpoint::start(EndpointConfig {
            attach_delay: Duration::from_millis(300),
            detach_delay: Duration::from_millis(200),
            launch_delay: Duration::from_millis(200),
            // Long enough that a GET right after TerminateInstance sees TERMINATING on a busy machine.
            terminate_delay: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
        let key = test_key();
        let auth = ApiKeyProvider::new("ocid1.tenancy.oc1..t", "ocid1.user.oc1..u", key.clone());
        let key_id = auth.credentials().await?.key_id;
        endpoint.register_key(&key_id, &key.public_key_pem()?)?;
        let mut cfg = ComputeConfig::new(endpoint.url());
        cfg.retry = retry;
        cfg.page_size = page_size;
        cfg.timeout = Duration::from_secs(5);
        let client = ComputeClient::new(cfg, Arc::new(auth))?;
        let subnet_primary = endpoint.add_subnet("10.0.10.0/24")?;
        let subnet_pods = endpoint.add_subnet("10.0.20.0/24")?;
        Ok(Self {
            endpoint,
            client,
            subnet_primary,
            subnet_pods,
        })
    }

    fn instance(&self, name: &str, shape: &str) -> Result<String> {
        self.endpoint.add_instance(&InstanceSpec {
            display_name: name.into(),
            shape: shape.into(),
            compartment_id: COMPARTMENT.into(),
            availability_domain: AD.into(),
            subnet_id: self.subnet_primary.clone(),
        })
    }

    fn attach_details(&self, instance: &str, name: &str) -> AttachVnicDetails {
        AttachVnicDetails {
            instance_id: instance.into(),
            create_vnic_details: CreateVnicDetails {
                subnet_id: self.subnet_pods.clone(),
                skip_source_dest_check: Some(true),
                display_name: Some(name.into()),
                ..Default::default()
            },
            nic_index: None,
            display_name: Some(name.into()),
        }
    }

    fn requests_to(
        &self,
        method: &str,
        path_prefix: &str,
    ) -> Vec<nodekeeper_e2e::oci_endpoint::Recorded> {
        self.endpoint
            .requests()
            .into_iter()
            .filter(|r| r.method.as_str() == method && r.path.starts_with(path_prefix))
            .collect()
    }
}

#[tokio::test]
async fn attach_polls_to_attached_and_imds_lists_the_vnic() -> Result<()> {
    let rig = Rig::new(fast_retry(3), 100).await?;
    let instance = rig.instance("node-a", VM_SHAPE)?;
    let imds = ImdsClient::new(ImdsConfig::new(rig.endpoint.imds_url(&instance)))?;
    assert_eq!(
        imds.vnics().await?.len(),
        1,
        "only the primary VNIC at first"
    );
    assert_eq!(imds.instance().await?.shape, VM_SHAPE);

    let created = rig
        .client
        .attach_vnic(&rig.attach_details(&instance, "nk-pods-0"))
        .await?;
    assert_eq!(created.lifecycle_state, VnicAttachmentState::Attaching);
    assert_eq!(created.vnic_id, None, "vnicId appears only once attached");

    // A caller that lost the answer finds its attachment by display name instead of attaching again.
    let found = rig
        .client
        .find_vnic_attachment(COMPARTMENT, &instance, "nk-pods-0")
        .await?
        .expect("the attachment is found by display name");
    assert_eq!(found.id, created.id);
    assert!(
        rig.client
            .find_vnic_attachment(COMPARTMENT, &instance, "nk-other")
            .await?
            .is_none()
    );

    let attached = rig
        .client
        .wait_for_attached(&created.id, POLL, WAIT)
        .await?;
    assert_eq!(attached.lifecycle_state, VnicAttachmentState::Attached);
    let vnic_id = attached.vnic_id.clone().expect("vnicId once attached");
    let vnic = rig.client.get_vnic(&vnic_id).await?;
    assert!(vnic.skip_source_dest_check);
    let private_ip = vnic.private_ip.clone().expect("private IP");
    assert!(private_ip.starts_with("10.0.20."), "{private_ip}");

    // The agent's IMDS path now sees the VNIC, with the MAC and address the API reports.
    let vnics = imds.vnics().await?;
    assert_eq!(vnics.len(), 2, "{vnics:?}");
    let second = format!("{:?}", vnics[1]);
    assert!(second.contains(&private_ip), "{second}");
    assert!(
        second
            .to_lowercase()
            .contains(&vnic.mac_address.clone().unwrap_or_default().to_lowercase()),
        "{second}"
    );

    // Detach: DELETE, DETACHING → DETACHED, gone from IMDS.
    rig.client.detach_vnic(&created.id, None).await?;
    let gone = tokio::time::timeout(WAIT, async {
        loop {
            let a = rig.client.get_vnic_attachment(&created.id).await?;
            if a.lifecycle_state == VnicAttachmentState::Detached {
                return Ok::<_, anyhow::Error>(a);
            }
            tokio::time::sleep(POLL).await;
        }
    })
    .await??;
    assert_eq!(gone.lifecycle_state, VnicAttachmentState::Detached);
    assert_eq!(imds.vnics().await?.len(), 1);
    let err = rig.client.get_vnic(&vnic_id).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");

    // Every request was signed and verified.
    let requests = rig.endpoint.requests();
    assert!(requests.iter().all(|r| r.key_id.is_some()), "{requests:?}");
    Ok(())
}

#[tokio::test]
async fn shape_limit_nic_index_and_unknown_ids_are_errors_with_oci_code_and_request_id()
-> Result<()> {
    let rig = Rig::new(fast_retry(3), 100).await?;
    let instance = rig.instance("node-b", VM_SHAPE)?;
    let first = rig
        .client
        .attach_vnic(&rig.attach_details(&instance, "nk-0"))
        .await?;
    rig.client.wait_for_attached(&first.id, POLL, WAIT).await?;

    let err = rig
        .client
        .attach_vnic(&rig.attach_details(&instance, "nk-1"))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert_eq!(err.code(), Some("LimitExceeded"), "{err}");
    assert!(err.to_string().contains(VM_SHAPE), "{err}");
    assert_eq!(err.request_id().map(str::len), Some(32), "{err}");

    let mut on_vm = rig.attach_details(&instance, "nk-2");
    on_vm.nic_index = Some(1);
    let err = rig.client.attach_vnic(&on_vm).await.unwrap_err();
    assert_eq!(err.code(), Some("InvalidParameter"), "{err}");
    assert!(err.to_string().contains("nicIndex"), "{err}");

    let err = rig
        .client
        .get_instance("ocid1.instance.oc1.phx.doesnotexist")
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert_eq!(err.code(), Some("NotAuthorizedOrNotFound"));
    let ComputeError::Service {
        message,
        request_id,
        attempts,
        ..
    } = &err
    else {
        panic!("expected a service error, got {err:?}");
    };
    assert!(message.contains("not found"), "{message}");
    assert!(!request_id.is_empty());
    assert_eq!(*attempts, 1, "404 is not retried");
    Ok(())
}

#[tokio::test]
async fn concurrent_attach_gets_409_and_the_instance_lock_serialises() -> Result<()> {
    let rig = Rig::new(fast_retry(3), 100).await?;
    let instance = rig.instance("node-c", VM4_SHAPE)?;
    // The first attach stays ATTACHING long enough for the second to overlap it however busy
    // the machine is.
    rig.endpoint.set_attach_delay(Duration::from_secs(3));
    let first = rig
        .client
        .attach_vnic(&rig.attach_details(&instance, "nk-0"))
        .await?;
    let err = rig
        .client
        .attach_vnic(&rig.attach_details(&instance, "nk-1"))
        .await
        .unwrap_err();
    assert!(matches!(err, ComputeError::Conflict { .. }), "{err:?}");
    assert_eq!(err.status(), Some(409));
    assert_eq!(
        rig.requests_to("POST", "/vnicAttachments")
            .iter()
            .filter(|r| r.status == 409)
            .count(),
        1,
        "409 is surfaced, not retried"
    );
    rig.client.wait_for_attached(&first.id, POLL, WAIT).await?;
    rig.endpoint.set_attach_delay(Duration::from_millis(300));

    // Two attaches under the per-instance lock: each waits for the other's ATTACHED.
    let locks = Arc::new(InstanceLocks::new());
    let mut tasks = Vec::new();
    for name in ["nk-1", "nk-2"] {
        let (client, locks) = (rig.client.clone(), locks.clone());
        let details = rig.attach_details(&instance, name);
        let instance = instance.clone();
        tasks.push(tokio::spawn(async move {
            let _guard = locks.lock(&instance).await;
            let a = client.attach_vnic(&details).await?;
            client.wait_for_attached(&a.id, POLL, WAIT).await
        }));
    }
    for t in tasks {
        t.await??;
    }
    assert_eq!(rig.endpoint.live_attachment_count(&instance), 4);
    Ok(())
}

#[tokio::test]
async fn retries_429_and_500_within_bounds_with_one_retry_token() -> Result<()> {
    let rig = Rig::new(fast_retry(4), 100).await?;
    let instance = rig.instance("node-d", VM4_SHAPE)?;

    // A 429 burst shorter than the budget is absorbed.
    rig.endpoint.inject(Fault::throttle(2));
    let got = rig.client.get_instance(&instance).await?;
    assert_eq!(got.lifecycle_state, InstanceState::Running);
    let gets = rig.requests_to("GET", "/instances/");
    assert_eq!(
        gets.iter().map(|r| r.status).collect::<Vec<_>>(),
        vec![429, 429, 200]
    );

    // A retried create sends the same token each time and creates once.
    rig.endpoint.inject(Fault::internal(2));
    let a = rig
        .client
        .attach_vnic(&rig.attach_details(&instance, "nk-0"))
        .await?;
    let posts = rig.requests_to("POST", "/vnicAttachments");
    assert_eq!(
        posts.iter().map(|r| r.status).collect::<Vec<_>>(),
        vec![500, 500, 200]
    );
    let tokens: std::collections::BTreeSet<_> =
        posts.iter().map(|r| r.retry_token.clone()).collect();
    assert_eq!(tokens.len(), 1, "{tokens:?}");
    assert!(
        tokens
            .iter()
            .all(|t| t.as_ref().is_some_and(|t| t.len() == 32))
    );
    assert_eq!(rig.endpoint.live_attachment_count(&instance), 2);
    rig.client.wait_for_attached(&a.id, POLL, WAIT).await?;

    // A fault that outlasts the budget ends after max_attempts, with the last answer.
    rig.endpoint.inject(Fault::internal(10));
    let before = rig.endpoint.requests().len();
    let err = rig.client.get_instance(&instance).await.unwrap_err();
    let ComputeError::Service {
        status,
        attempts,
        code,
        ..
    } = &err
    else {
        panic!("expected a service error, got {err:?}");
    };
    assert_eq!(
        (*status, *attempts, code.as_str()),
        (500, 4, "InternalError")
    );
    assert_eq!(rig.endpoint.requests().len() - before, 4);

    // The time bound stops retries before the count does.
    let mut slow = ComputeConfig::new(rig.endpoint.url());
    slow.retry = RetryPolicy {
        max_attempts: 100,
        base: Duration::from_millis(100),
        cap: Duration::from_millis(100),
        max_elapsed: Duration::from_millis(600),
    };
    let key = test_key();
    let client = ComputeClient::new(
        slow,
        Arc::new(ApiKeyProvider::new(
            "ocid1.tenancy.oc1..t",
            "ocid1.user.oc1..u",
            key,
        )),
    )?;
    rig.endpoint.clear_faults();
    rig.endpoint.inject(Fault::throttle(100));
    let started = std::time::Instant::now();
    let err = client.get_instance(&instance).await.unwrap_err();
    assert_eq!(err.status(), Some(429), "{err}");
    let attempts = match err {
        ComputeError::Service { attempts, .. } => attempts,
        _ => 0,
    };
    // 600 ms of 50–100 ms pauses allow at most 13 attempts; a busy machine makes fewer.
    assert!(
        (2..=13).contains(&attempts),
        "{attempts} attempts: the time bound, not the count of 100, must end the retries"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn lists_follow_opc_next_page() -> Result<()> {
    let rig = Rig::new(fast_retry(2), 3).await?;
    let mut ids = Vec::new();
    for n in 0..7 {
        ids.push(rig.instance(&format!("node-{n}"), VM_SHAPE)?);
    }
    let listed = rig
        .client
        .list_instances(COMPARTMENT, &ListInstancesFilter::default())
        .await?;
    assert_eq!(listed.iter().map(|i| i.id.clone()).collect::<Vec<_>>(), ids);
    let pages = rig.requests_to("GET", "/instances");
    assert_eq!(pages.len(), 3, "7 items at 3 per page");
    assert!(pages[1].query.contains("page="), "{:?}", pages[1]);

    let attachments = rig
        .client
        .list_vnic_attachments(COMPARTMENT, &Default::default())
        .await?;
    assert_eq!(attachments.len(), 7, "one primary VNIC each");

    let one = rig
        .client
        .list_instances(
            COMPARTMENT,
            &ListInstancesFilter {
                display_name: Some("node-4".into()),
                ..Default::default()
            },
        )
        .await?;
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].id, ids[4]);
    Ok(())
}

#[tokio::test]
async fn launch_terminate_and_out_of_host_capacity() -> Result<()> {
    let rig = Rig::new(fast_retry(4), 100).await?;
    let details = LaunchInstanceDetails {
        availability_domain: AD.into(),
        compartment_id: COMPARTMENT.into(),
        shape: VM_SHAPE.into(),
        shape_config: None,
        source_details: None,
        create_vnic_details: Some(CreateVnicDetails {
            subnet_id: rig.subnet_primary.clone(),
            ..Default::default()
        }),
        metadata: Default::default(),
        display_name: Some("launched".into()),
        freeform_tags: [("nodekeeper.dev/nodeset".to_string(), "pool-a".to_string())].into(),
        fault_domain: None,
    };

    rig.endpoint.set_out_of_capacity(VM_SHAPE, true);
    let err = rig.client.launch_instance(&details).await.unwrap_err();
    assert!(matches!(err, ComputeError::OutOfCapacity { .. }), "{err:?}");
    assert!(err.to_string().contains("another shape"), "{err}");
    assert_eq!(
        rig.requests_to("POST", "/instances").len(),
        1,
        "capacity is not retried"
    );
    rig.endpoint.set_out_of_capacity(VM_SHAPE, false);

    let launched = rig.client.launch_instance(&details).await?;
    assert_eq!(launched.lifecycle_state, InstanceState::Provisioning);
    assert_eq!(launched.freeform_tags["nodekeeper.dev/nodeset"], "pool-a");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        rig.client.get_instance(&launched.id).await?.lifecycle_state,
        InstanceState::Running
    );
    rig.client
        .terminate_instance(&launched.id, &TerminateOptions::default())
        .await?;
    let terminating = rig.client.get_instance(&launched.id).await?;
    assert_eq!(terminating.lifecycle_state, InstanceState::Terminating);
    assert!(
        rig.requests_to("DELETE", "/instances/")[0]
            .query
            .contains("preserveBootVolume=false")
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let listed = rig
        .client
        .list_instances(
            COMPARTMENT,
            &ListInstancesFilter {
                lifecycle_state: Some(InstanceState::Terminated),
                ..Default::default()
            },
        )
        .await?;
    assert_eq!(listed.len(), 1, "terminated instances stay listed");
    Ok(())
}

#[tokio::test]
async fn a_key_the_service_does_not_know_is_refused_with_401() -> Result<()> {
    let rig = Rig::new(fast_retry(3), 100).await?;
    let instance = rig.instance("node-e", VM_SHAPE)?;
    let stranger = ComputeClient::new(
        ComputeConfig::new(rig.endpoint.url()),
        Arc::new(ApiKeyProvider::new(
            "ocid1.tenancy.oc1..other",
            "ocid1.user.oc1..x",
            test_key(),
        )),
    )?;
    let err = stranger.get_instance(&instance).await.unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");
    assert_eq!(err.code(), Some("NotAuthenticated"));
    // One renewal of credentials after a 401, then the answer stands.
    assert_eq!(rig.requests_to("GET", "/instances/").len(), 2);
    Ok(())
}

#[tokio::test]
async fn instance_principal_tokens_sign_calls_and_are_renewed() -> Result<()> {
    use nodekeeper_oci::auth::{SessionTokenProvider, X509FederationSource};
    let endpoint = OciEndpoint::start(EndpointConfig {
        token_ttl: Duration::from_secs(6),
        ..Default::default()
    })
    .await?;
    let subnet = endpoint.add_subnet("10.0.10.0/24")?;
    let instance = endpoint.add_instance(&InstanceSpec {
        display_name: "node-ip".into(),
        shape: VM_SHAPE.into(),
        compartment_id: COMPARTMENT.into(),
        availability_domain: AD.into(),
        subnet_id: subnet,
    })?;
    let leaf_pem = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/oci/tests/fixtures/test-key-2048.pem"
    ))?;
    endpoint.enable_instance_principal(&instance, "ocid1.tenancy.oc1..ip", &leaf_pem)?;
    let session_pem = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/oci/tests/fixtures/test-key-2048-b.pem"
    ))?;
    let imds = ImdsClient::new(ImdsConfig::new(endpoint.imds_url(&instance)))?;
    let source = X509FederationSource::new(imds, endpoint.federation_url(), Duration::from_secs(5));
    // Session keys come from a fixture: RSA generation is slow in unoptimised test builds.
    let provider = SessionTokenProvider::new(source)
        .with_renew_before(Duration::from_secs(3))
        .with_key_factory(Arc::new(move || PrivateKey::from_pem(&session_pem)));
    let mut cfg = ComputeConfig::new(endpoint.url());
    cfg.retry = fast_retry(3);
    let client = ComputeClient::new(cfg, Arc::new(provider))?;
    let federations = || {
        endpoint
            .requests()
            .iter()
            .filter(|r| r.path == "/v1/x509" && r.status == 200)
            .count()
    };

    client.get_instance(&instance).await?;
    client.get_instance(&instance).await?;
    assert_eq!(
        federations(),
        1,
        "one token serves calls until close to expiry"
    );
    let signed_with: Vec<_> = endpoint
        .requests()
        .iter()
        .filter(|r| r.path.starts_with("/instances/"))
        .map(|r| r.key_id.clone().unwrap_or_default())
        .collect();
    assert!(
        signed_with.iter().all(|k| k.starts_with("ST$")),
        "{signed_with:?}"
    );
    let fed = endpoint
        .requests()
        .into_iter()
        .find(|r| r.path == "/v1/x509")
        .unwrap();
    assert!(
        fed.key_id
            .as_deref()
            .is_some_and(|k| k.starts_with("ocid1.tenancy.oc1..ip/fed-x509-sha256/")),
        "{fed:?}"
    );

    // Within renew_before of exp (6 s lifetime in whole seconds, 3 s margin, so fresh for 2–3 s):
    // a new token.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    client.get_instance(&instance).await?;
    assert_eq!(federations(), 2);

    // A revoked token gets 401 once; the provider renews and the call succeeds.
    endpoint.revoke_sessions();
    client.get_instance(&instance).await?;
    assert_eq!(federations(), 3);
    let last_two: Vec<u16> = endpoint
        .requests()
        .iter()
        .filter(|r| r.path.starts_with("/instances/"))
        .map(|r| r.status)
        .rev()
        .take(2)
        .collect();
    assert_eq!(last_two, vec![200, 401]);
    Ok(())
}

#[tokio::test]
async fn a_signature_by_another_key_under_a_known_key_id_is_refused() -> Result<()> {
    #[derive(Debug)]
    struct Impostor(nodekeeper_oci::signer::Credentials);
    impl AuthProvider for Impostor {
        fn credentials(
            &self,
        ) -> nodekeeper_oci::auth::BoxFuture<
            '_,
            Result<nodekeeper_oci::signer::Credentials, nodekeeper_oci::auth::AuthError>,
        > {
            let c = self.0.clone();
            Box::pin(async move { Ok(c) })
        }
    }
    let rig = Rig::new(fast_retry(2), 100).await?;
    let instance = rig.instance("node-f", VM_SHAPE)?;
    let known = ApiKeyProvider::new("ocid1.tenancy.oc1..t", "ocid1.user.oc1..u", test_key())
        .credentials()
        .await?;
    let other = PrivateKey::from_pem(&std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/oci/tests/fixtures/test-key-2048-b.pem"
    ))?)?;
    let impostor = ComputeClient::new(
        ComputeConfig::new(rig.endpoint.url()),
        Arc::new(Impostor(nodekeeper_oci::signer::Credentials {
            key_id: known.key_id,
            key: other,
        })),
    )?;
    let err = impostor.get_instance(&instance).await.unwrap_err();
    assert_eq!(err.code(), Some("NotAuthenticated"), "{err}");
    assert!(err.to_string().contains("does not verify"), "{err}");
    Ok(())
}

#[tokio::test]
async fn oke_workload_identity_tokens_sign_calls() -> Result<()> {
    use nodekeeper_oci::auth::{OkeWorkloadIdentitySource, SessionTokenProvider};
    let rig = Rig::new(fast_retry(2), 100).await?;
    let instance = rig.instance("node-wi", VM_SHAPE)?;
    rig.endpoint.enable_workload_identity("sa-token-1");
    let dir = tempfile::tempdir()?;
    let token_path = dir.path().join("token");
    std::fs::write(&token_path, "sa-token-0\n")?;
    let source = OkeWorkloadIdentitySource::new(
        rig.endpoint.workload_identity_url(),
        &token_path,
        None,
        Duration::from_secs(5),
    )?;
    let session_pem = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/oci/tests/fixtures/test-key-2048-b.pem"
    ))?;
    let provider = SessionTokenProvider::new(source)
        .with_key_factory(Arc::new(move || PrivateKey::from_pem(&session_pem)));
    let client = ComputeClient::new(ComputeConfig::new(rig.endpoint.url()), Arc::new(provider))?;

    // A token the cluster does not know: the error names the token endpoint.
    let err = client.get_instance(&instance).await.unwrap_err();
    assert!(matches!(err, ComputeError::Authenticate { .. }), "{err:?}");
    assert!(
        err.to_string().contains("resourcePrincipalSessionTokens"),
        "{err}"
    );

    // The projected token rotates: the file is read again for the next exchange.
    std::fs::write(&token_path, "sa-token-1\n")?;
    let got = client.get_instance(&instance).await?;
    assert_eq!(got.id, instance);
    let last = rig.endpoint.requests().pop().unwrap();
    assert!(last.key_id.is_some_and(|k| k.starts_with("ST$")));
    Ok(())
}

#[tokio::test]
async fn an_unreachable_endpoint_ends_after_the_retry_budget() -> Result<()> {
    // A port that was free a moment ago: connections are refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut cfg = ComputeConfig::new(format!("http://127.0.0.1:{port}"));
    cfg.retry = fast_retry(3);
    let client = ComputeClient::new(
        cfg,
        Arc::new(ApiKeyProvider::new(
            "ocid1.tenancy.oc1..t",
            "ocid1.user.oc1..u",
            test_key(),
        )),
    )?;
    let err = client
        .get_instance("ocid1.instance.oc1.phx.x")
        .await
        .unwrap_err();
    let ComputeError::Transport { attempts, .. } = err else {
        panic!("expected a transport error, got {err:?}");
    };
    assert_eq!(attempts, 3);
    assert_eq!(client.counts(), (1, 3));
    Ok(())
}
