//! The controller's cloud side: which OCI instance a Node is (`spec.providerID`), its shape and
//! compartment, the VNIC attachments on it with their owner tag, and the attach/detach calls —
//! each call counted per node (the caller's counter) and in `nodekeeper_cloud_calls_total`.
//!
//! Only built when the controller is given an OCI endpoint or region and credentials
//! ([`CloudConfig`]); there is no default endpoint, and the metadata service is asked only for
//! instance principals and only at the address given.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nodekeeper_api::crd::node_network_config::{OWNER_TAG, OciVnic};
use nodekeeper_model::oci_ids::{OcidKind, check_ocid};
use nodekeeper_oci::auth::{
    ApiKeyProvider, AuthProvider, OkeWorkloadIdentitySource, SessionTokenProvider,
    X509FederationSource, federation_url,
};
use nodekeeper_oci::compute::{
    AttachVnicDetails, ComputeClient, ComputeConfig, ComputeError, CreateVnicDetails,
    InstanceLocks, ListVnicAttachmentsFilter, VnicAttachment, VnicAttachmentState,
};
use nodekeeper_oci::{ImdsClient, ImdsConfig};

use super::plan::{AttachmentState, FoundAttachment};
use crate::shared::metrics::CloudMetrics;

/// How the controller authenticates to OCI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthKind {
    /// A user's API signing key from `--oci-credentials-dir` (a mounted Secret with `tenancy`,
    /// `user`, `fingerprint`, `key.pem`).
    ApiKey,
    /// The instance's identity certificate from the metadata service at `--oci-imds-endpoint`.
    InstancePrincipal,
    /// OKE workload identity (the pod's service-account token).
    WorkloadIdentity,
}

/// The cloud flags (part of the controller's `Config`).
#[derive(Clone, Debug, clap::Args)]
#[group(id = "oci")]
pub struct CloudConfig {
    /// Compute API endpoint (scheme and host, e.g. `https://iaas.us-phoenix-1.oraclecloud.com`).
    /// With neither this nor `--oci-region` the controller attaches and detaches nothing.
    #[arg(long, env = "NODEKEEPER_OCI_ENDPOINT")]
    pub oci_endpoint: Option<String>,
    /// Region (e.g. `us-phoenix-1`); the endpoint is `https://iaas.<region>.<realm domain>`.
    #[arg(long, env = "NODEKEEPER_OCI_REGION")]
    pub oci_region: Option<String>,
    /// Realm domain used with `--oci-region`.
    #[arg(
        long,
        env = "NODEKEEPER_OCI_REALM_DOMAIN",
        default_value = "oraclecloud.com"
    )]
    pub oci_realm_domain: String,
    /// How to authenticate.
    #[arg(
        long,
        env = "NODEKEEPER_OCI_AUTH",
        value_enum,
        default_value = "api-key"
    )]
    pub oci_auth: AuthKind,
    /// Directory of the API key Secret (`--oci-auth api-key`).
    #[arg(long, env = "NODEKEEPER_OCI_CREDENTIALS_DIR")]
    pub oci_credentials_dir: Option<PathBuf>,
    /// Metadata service base URL for `--oci-auth instance-principal` (no default: it must be
    /// given, e.g. `http://169.254.169.254/opc/v2` on an instance).
    #[arg(long, env = "NODEKEEPER_OCI_IMDS_ENDPOINT")]
    pub oci_imds_endpoint: Option<String>,
    /// Federation endpoint for instance principals; default `https://auth.<region>.<realm
    /// domain>/v1/x509` (needs `--oci-region`).
    #[arg(long, env = "NODEKEEPER_OCI_FEDERATION_ENDPOINT")]
    pub oci_federation_endpoint: Option<String>,
    /// Compartment of the nodes' instances (ListVnicAttachments needs one). Unset: read once
    /// per node with GetInstance.
    #[arg(long, env = "NODEKEEPER_OCI_COMPARTMENT_ID")]
    pub oci_compartment_id: Option<String>,
}

/// Whether the cloud side is on.
#[derive(Clone)]
pub enum CloudAccess {
    /// No endpoint or region given: VNICs are never attached or detached.
    Off,
    /// Given, but unusable; the message names the flag and what to do.
    Misconfigured(String),
    On(Arc<Cloud>),
}

impl CloudAccess {
    /// Builds the cloud side from the flags.
    pub fn from_config(cfg: &CloudConfig, metrics: CloudMetrics) -> Self {
        let endpoint = match (&cfg.oci_endpoint, &cfg.oci_region) {
            (Some(e), _) => e.clone(),
            (None, Some(r)) => ComputeConfig::for_region(r, &cfg.oci_realm_domain).endpoint,
            (None, None) => return Self::Off,
        };
        match auth(cfg).and_then(|auth| {
            ComputeClient::new(ComputeConfig::new(&endpoint), auth).map_err(|e| e.to_string())
        }) {
            Ok(client) => Self::On(Arc::new(Cloud::new(
                client,
                cfg.oci_compartment_id.clone(),
                metrics,
            ))),
            Err(message) => Self::Misconfigured(message),
        }
    }

    /// Why VNICs cannot be attached, when they cannot.
    pub fn unavailable(&self) -> Option<String> {
        match self {
            Self::On(_) => None,
            Self::Off => Some(
                "spec.ociVnics.attach lists VNICs, but the controller has no cloud access: start \
                 it with --oci-endpoint or --oci-region (NODEKEEPER_OCI_ENDPOINT / \
                 NODEKEEPER_OCI_REGION) and credentials (--oci-auth), or remove the attach list"
                    .into(),
            ),
            Self::Misconfigured(m) => Some(format!(
                "spec.ociVnics.attach lists VNICs, but the controller's cloud access is \
                 misconfigured: {m}"
            )),
        }
    }
}

pub(crate) fn auth(cfg: &CloudConfig) -> Result<Arc<dyn AuthProvider>, String> {
    let timeout = Duration::from_secs(10);
    match cfg.oci_auth {
        AuthKind::ApiKey => {
            let dir = cfg.oci_credentials_dir.as_ref().ok_or(
                "--oci-auth api-key needs --oci-credentials-dir (NODEKEEPER_OCI_CREDENTIALS_DIR), \
                 the mounted API key Secret",
            )?;
            let p = ApiKeyProvider::from_dir(dir)
                .map_err(|e| format!("--oci-credentials-dir {}: {e}", dir.display()))?;
            Ok(Arc::new(p))
        }
        AuthKind::InstancePrincipal => {
            let imds = cfg.oci_imds_endpoint.as_ref().ok_or(
                "--oci-auth instance-principal needs --oci-imds-endpoint \
                 (NODEKEEPER_OCI_IMDS_ENDPOINT); there is no default",
            )?;
            let federation = match (&cfg.oci_federation_endpoint, &cfg.oci_region) {
                (Some(f), _) => f.clone(),
                (None, Some(r)) => federation_url(r, &cfg.oci_realm_domain),
                (None, None) => {
                    return Err("--oci-auth instance-principal needs --oci-region or \
                                --oci-federation-endpoint"
                        .into());
                }
            };
            let client = ImdsClient::new(ImdsConfig::new(imds))
                .map_err(|e| format!("--oci-imds-endpoint {imds}: {e}"))?;
            let source = X509FederationSource::new(client, federation, timeout);
            Ok(Arc::new(SessionTokenProvider::new(source)))
        }
        AuthKind::WorkloadIdentity => {
            let source = OkeWorkloadIdentitySource::from_env(timeout)
                .map_err(|e| format!("--oci-auth workload-identity: {e}"))?;
            Ok(Arc::new(SessionTokenProvider::new(source)))
        }
    }
}

/// The instance behind a Node: `spec.providerID` is `oci://<instance OCID>` (the OCI cloud
/// controller manager's form) or the bare OCID.
pub fn instance_id(provider_id: Option<&str>) -> Result<String, String> {
    let Some(raw) = provider_id.filter(|p| !p.is_empty()) else {
        return Err(
            "the Node has no spec.providerID, so its OCI instance is unknown; nodes of \
                    OKE or the OCI cloud controller manager carry oci://<instance OCID>"
                .into(),
        );
    };
    let id = raw.strip_prefix("oci://").unwrap_or(raw);
    check_ocid(OcidKind::Instance, id).map_err(|m| format!("spec.providerID {raw:?}: {m}"))?;
    Ok(id.to_string())
}

/// What is known of an instance for the whole life of the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceFacts {
    pub shape: String,
    pub compartment: String,
}

/// The owner tag and MAC of an attachment's VNIC, read once (they do not change).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct VnicFacts {
    owner: Option<String>,
    mac: Option<String>,
}

/// An attachment as the planner and the detach step need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub found: FoundAttachment,
    pub vnic_id: Option<String>,
    pub mac: Option<String>,
}

/// The Compute API as the controller uses it, with its caches.
pub struct Cloud {
    client: ComputeClient,
    compartment: Option<String>,
    locks: InstanceLocks,
    instances: Mutex<HashMap<String, InstanceFacts>>,
    vnics: Mutex<HashMap<String, VnicFacts>>,
    /// How long ATTACHING → ATTACHED takes here: the first look at a new attachment waits this
    /// long, so that it usually finds it ATTACHED (one GetVnicAttachment per VNIC instead of one
    /// per poll). Starts at `--nnc-attach-latency` and follows what the first looks find.
    attach_latency: Mutex<AttachLatency>,
    pub metrics: CloudMetrics,
}

/// The first-look wait, and the first guess it never goes below.
#[derive(Clone, Copy, Debug)]
struct AttachLatency {
    guess: Duration,
    floor: Duration,
}

fn state_of(s: VnicAttachmentState) -> AttachmentState {
    match s {
        VnicAttachmentState::Attached => AttachmentState::Attached,
        VnicAttachmentState::Detaching => AttachmentState::Detaching,
        VnicAttachmentState::Detached => AttachmentState::Detached,
        // An unknown state is treated as in transition: never detached, never doubled.
        VnicAttachmentState::Attaching | VnicAttachmentState::Unknown => AttachmentState::Attaching,
    }
}

impl Cloud {
    pub fn new(client: ComputeClient, compartment: Option<String>, metrics: CloudMetrics) -> Self {
        Self {
            client,
            compartment,
            locks: InstanceLocks::new(),
            instances: Mutex::default(),
            vnics: Mutex::default(),
            attach_latency: Mutex::new(AttachLatency {
                guess: Duration::from_secs(10),
                floor: Duration::from_secs(10),
            }),
            metrics,
        }
    }

    fn count<T>(&self, operation: &'static str, calls: &mut u32, r: &Result<T, ComputeError>) {
        *calls += 1;
        self.metrics.record(operation, r.is_ok());
    }

    /// Shape and compartment of `instance`: from the Node's instance-type label and the
    /// configured compartment when both are known, else one GetInstance (then cached).
    pub async fn instance(
        &self,
        instance: &str,
        shape_label: Option<&str>,
        calls: &mut u32,
    ) -> Result<InstanceFacts, ComputeError> {
        if let (Some(shape), Some(compartment)) = (shape_label, &self.compartment) {
            return Ok(InstanceFacts {
                shape: shape.to_string(),
                compartment: compartment.clone(),
            });
        }
        if let Some(f) = self.lock_instances().get(instance) {
            return Ok(f.clone());
        }
        let r = self.client.get_instance(instance).await;
        self.count("GetInstance", calls, &r);
        let i = r?;
        let facts = InstanceFacts {
            shape: i.shape.clone(),
            compartment: self
                .compartment
                .clone()
                .or_else(|| i.compartment_id.clone())
                .unwrap_or_default(),
        };
        self.lock_instances()
            .insert(instance.to_string(), facts.clone());
        Ok(facts)
    }

    fn lock_instances(&self) -> std::sync::MutexGuard<'_, HashMap<String, InstanceFacts>> {
        self.instances
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_vnics(&self) -> std::sync::MutexGuard<'_, HashMap<String, VnicFacts>> {
        self.vnics.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The live attachments of `instance` (one ListVnicAttachments), each with its VNIC's owner
    /// tag. GetVnic is asked only for an attached VNIC with a display name not seen before: an
    /// attachment without a display name was never made by nodekeeper (it always sets one).
    pub async fn attachments(
        &self,
        facts: &InstanceFacts,
        instance: &str,
        calls: &mut u32,
    ) -> Result<Vec<Seen>, ComputeError> {
        let filter = ListVnicAttachmentsFilter {
            instance_id: Some(instance.to_string()),
            ..Default::default()
        };
        let r = self
            .client
            .list_vnic_attachments(&facts.compartment, &filter)
            .await;
        self.count("ListVnicAttachments", calls, &r);
        let mut out = Vec::new();
        for a in r? {
            if a.lifecycle_state == VnicAttachmentState::Detached {
                continue;
            }
            let vnic = self.vnic_facts(&a, calls).await?;
            out.push(Seen {
                found: FoundAttachment {
                    id: a.id.clone(),
                    display_name: a.display_name.clone(),
                    state: state_of(a.lifecycle_state),
                    owner: vnic.owner,
                },
                vnic_id: a.vnic_id.clone(),
                mac: vnic.mac,
            });
        }
        Ok(out)
    }

    async fn vnic_facts(
        &self,
        a: &VnicAttachment,
        calls: &mut u32,
    ) -> Result<VnicFacts, ComputeError> {
        if let Some(f) = self.lock_vnics().get(&a.id) {
            return Ok(f.clone());
        }
        let (Some(_), Some(vnic_id)) = (&a.display_name, &a.vnic_id) else {
            return Ok(VnicFacts::default());
        };
        let r = self.client.get_vnic(vnic_id).await;
        self.count("GetVnic", calls, &r);
        let v = match r {
            Ok(v) => v,
            // Gone between the list and now: nothing to own.
            Err(e) if e.is_not_found() => return Ok(VnicFacts::default()),
            Err(e) => return Err(e),
        };
        let facts = VnicFacts {
            owner: v.freeform_tags.get(OWNER_TAG).cloned(),
            mac: v.mac_address.clone(),
        };
        self.lock_vnics().insert(a.id.clone(), facts.clone());
        Ok(facts)
    }

    /// AttachVnic for `vnic` on `instance`, tagged as `owner`'s; one at a time per instance.
    pub async fn attach(
        &self,
        instance: &str,
        owner: &str,
        vnic: &OciVnic,
        calls: &mut u32,
    ) -> Result<VnicAttachment, ComputeError> {
        let details = AttachVnicDetails {
            instance_id: instance.to_string(),
            create_vnic_details: CreateVnicDetails {
                subnet_id: vnic.subnet_id.clone(),
                assign_public_ip: Some(false),
                skip_source_dest_check: Some(vnic.skip_source_dest_check),
                nsg_ids: vnic.nsg_ids.clone(),
                display_name: Some(vnic.display_name.clone()),
                freeform_tags: BTreeMap::from([(OWNER_TAG.to_string(), owner.to_string())]),
                ..Default::default()
            },
            nic_index: vnic.nic_index,
            display_name: Some(vnic.display_name.clone()),
        };
        let _guard = self.locks.lock(instance).await;
        let r = self.client.attach_vnic(&details).await;
        self.count("AttachVnic", calls, &r);
        let a = r?;
        // Our own attachment: its owner is known without asking (its MAC is asked once, when
        // the apply checks that the VNIC is on the host, or when it is detached).
        self.lock_vnics().insert(
            a.id.clone(),
            VnicFacts {
                owner: Some(owner.to_string()),
                mac: None,
            },
        );
        Ok(a)
    }

    /// Sets the first guess of the attach time (`--nnc-attach-latency`).
    pub fn with_attach_latency(self, guess: Duration) -> Self {
        *self
            .attach_latency
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = AttachLatency {
            guess,
            floor: guess,
        };
        self
    }

    /// How long to wait before the first look at a new attachment.
    pub fn expected_attach_latency(&self) -> Duration {
        self.attach_latency
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .guess
    }

    /// What the first look at an attachment requested `took` ago found: still ATTACHING means
    /// the wait was too short (it becomes 1.2 × `took`); ATTACHED lets a raised wait come back
    /// down (0.95 × `took`), but never below the first guess (`--nnc-attach-latency`): a probe
    /// below it would cost a second GetVnicAttachment for every node attached meanwhile each
    /// time it fails. Both follow `took` rather than the current guess, so a batch of nodes
    /// looking at once moves the guess once, not once per node.
    pub fn observe_first_look(&self, attached: bool, took: Duration) {
        let mut l = self
            .attach_latency
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let guess = if attached {
            took.mul_f64(0.95).min(l.guess).max(l.floor)
        } else {
            took.mul_f64(1.2).max(l.guess)
        };
        l.guess = guess.clamp(Duration::from_millis(100), Duration::from_secs(300));
    }

    /// GetVnicAttachment.
    pub async fn attachment(
        &self,
        id: &str,
        calls: &mut u32,
    ) -> Result<VnicAttachment, ComputeError> {
        let r = self.client.get_vnic_attachment(id).await;
        self.count("GetVnicAttachment", calls, &r);
        r
    }

    /// The MAC of `seen`'s VNIC: known from the list, else one GetVnic (a VNIC this process
    /// attached is cached without its MAC; it is asked for only when it is to be detached).
    pub async fn mac_of(
        &self,
        seen: &Seen,
        calls: &mut u32,
    ) -> Result<Option<String>, ComputeError> {
        if seen.mac.is_some() {
            return Ok(seen.mac.clone());
        }
        self.attachment_mac(&seen.found.id, seen.vnic_id.as_deref(), calls)
            .await
    }

    /// The MAC of the VNIC of attachment `id` (whose VNIC is `vnic_id`): from the cache, else
    /// one GetVnic (then cached; the MAC never changes). `None` without a VNIC id.
    pub async fn attachment_mac(
        &self,
        id: &str,
        vnic_id: Option<&str>,
        calls: &mut u32,
    ) -> Result<Option<String>, ComputeError> {
        if let Some(mac) = self.lock_vnics().get(id).and_then(|f| f.mac.clone()) {
            return Ok(Some(mac));
        }
        let Some(vnic_id) = vnic_id else {
            return Ok(None);
        };
        let r = self.client.get_vnic(vnic_id).await;
        self.count("GetVnic", calls, &r);
        let v = r?;
        let mut vnics = self.lock_vnics();
        let entry = vnics.entry(id.to_string()).or_default();
        entry.mac = v.mac_address.clone();
        entry.owner = v.freeform_tags.get(OWNER_TAG).cloned();
        Ok(v.mac_address)
    }

    /// DetachVnic (detaches and deletes the VNIC); one at a time per instance. An attachment
    /// already gone counts as detached.
    pub async fn detach(
        &self,
        instance: &str,
        id: &str,
        calls: &mut u32,
    ) -> Result<(), ComputeError> {
        let _guard = self.locks.lock(instance).await;
        let r = self.client.detach_vnic(id, None).await;
        self.count("DetachVnic", calls, &r);
        match r {
            Err(e) if e.is_not_found() => Ok(()),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_ids_in_both_forms_and_bad_ones_named() {
        let id = "ocid1.instance.oc1.phx.anyhqljsabcdef";
        assert_eq!(instance_id(Some(&format!("oci://{id}"))).unwrap(), id);
        assert_eq!(instance_id(Some(id)).unwrap(), id);
        let e = instance_id(None).unwrap_err();
        assert!(e.contains("no spec.providerID"), "{e}");
        let e = instance_id(Some("aws:///us-east-1a/i-0abc")).unwrap_err();
        assert!(
            e.starts_with("spec.providerID \"aws:///us-east-1a/i-0abc\""),
            "{e}"
        );
        let e = instance_id(Some("oci://ocid1.subnet.oc1.phx.aaaa")).unwrap_err();
        assert!(e.contains("instance OCID"), "{e}");
    }

    #[test]
    fn the_first_look_wait_follows_what_the_looks_find_without_compounding() {
        let cloud = Cloud::new(
            ComputeClient::new(
                ComputeConfig::new("http://127.0.0.1:9"),
                Arc::new(ApiKeyProvider::new(
                    "t",
                    "u",
                    nodekeeper_oci::signer::PrivateKey::generate().unwrap(),
                )),
            )
            .unwrap(),
            None,
            CloudMetrics::default(),
        )
        .with_attach_latency(Duration::from_secs(10));
        let s = Duration::from_secs;
        // Found ATTACHED at the first guess, again and again: the wait stays (no probe below
        // the flag, which would cost second looks).
        for _ in 0..20 {
            let wait = cloud.expected_attach_latency();
            cloud.observe_first_look(true, wait);
        }
        assert_eq!(cloud.expected_attach_latency(), s(10));
        // Too early for ten nodes: raised once, to 1.2 × what they waited.
        for _ in 0..10 {
            cloud.observe_first_look(false, s(10));
        }
        assert_eq!(cloud.expected_attach_latency(), s(12));
        // Ten nodes of a batch then find theirs ATTACHED after 12.2 s: it comes down once.
        for _ in 0..10 {
            cloud.observe_first_look(true, Duration::from_millis(12_200));
        }
        assert_eq!(
            cloud.expected_attach_latency(),
            Duration::from_millis(11_590)
        );
        // And back to the first guess, not below it.
        for _ in 0..20 {
            let wait = cloud.expected_attach_latency();
            cloud.observe_first_look(true, wait);
        }
        assert_eq!(cloud.expected_attach_latency(), s(10));
    }

    #[test]
    fn no_endpoint_means_no_cloud_and_a_message_naming_the_flags() {
        let cfg = CloudConfig {
            oci_endpoint: None,
            oci_region: None,
            oci_realm_domain: "oraclecloud.com".into(),
            oci_auth: AuthKind::ApiKey,
            oci_credentials_dir: None,
            oci_imds_endpoint: None,
            oci_federation_endpoint: None,
            oci_compartment_id: None,
        };
        let off = CloudAccess::from_config(&cfg, CloudMetrics::default());
        assert!(matches!(off, CloudAccess::Off));
        assert!(off.unavailable().unwrap().contains("--oci-endpoint"));
        let missing_key = CloudAccess::from_config(
            &CloudConfig {
                oci_endpoint: Some("http://127.0.0.1:9".into()),
                ..cfg.clone()
            },
            CloudMetrics::default(),
        );
        let m = missing_key.unavailable().unwrap();
        assert!(m.contains("--oci-credentials-dir"), "{m}");
        let ip = CloudAccess::from_config(
            &CloudConfig {
                oci_region: Some("us-phoenix-1".into()),
                oci_auth: AuthKind::InstancePrincipal,
                ..cfg
            },
            CloudMetrics::default(),
        );
        let m = ip.unavailable().unwrap();
        assert!(
            m.contains("--oci-imds-endpoint") && m.contains("no default"),
            "{m}"
        );
    }
}
